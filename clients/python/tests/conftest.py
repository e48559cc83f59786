"""Fixtures that run the real `draftpipe` binary (``$DRAFTPIPE_BIN``, default ``target/debug/draftpipe``)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def draftpipe_bin():
    path = Path(os.environ.get("DRAFTPIPE_BIN", REPO / "target" / "debug" / "draftpipe"))
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it with `cargo build --bin draftpipe` or set DRAFTPIPE_BIN")
    return path


def write_pipe(path, source, producers=1, hidden=8, taps=(0, 1), vocab=64, batch_tokens=64, buckets=(16, 32),
               steps=None):
    """A small plan: CPU drafter, fifo queue, one `target` stage with `producers` workers."""
    steps_line = f"    steps     = {steps}\n" if steps else ""
    path.write_text(
        f"""pipeline "py-{path.stem}"

target live on cpu x{producers} {{
    hidden       = {hidden}
    tap_layers   = [{", ".join(str(t) for t in taps)}]
    vocab        = {vocab}
    batch_tokens = {batch_tokens}
    source       = {source}
}}

queue hs from live to draft {{
    capacity  = 4
    min_ready = 1
    buckets   = [{", ".join(str(b) for b in buckets)}]
    pull      = fifo
}}

drafter draft on cpu {{
    model     = mlp(hidden = 16, blocks = 1, intermediate = 32, heads = 2)
    loss      = cross_entropy(head_decay = 0.8)
    optimizer = adamw(lr = 1e-2)
{steps_line}}}

telemetry {{ every = 1s }}
"""
    )
    return path


class Run:
    """`draftpipe run` in the background, its output in files."""

    def __init__(self, binary, pipe, workdir, *extra):
        self.out = open(workdir / f"{pipe.stem}.out", "w+")
        self.err = open(workdir / f"{pipe.stem}.err", "w+")
        self.run_dir = workdir / f"run-{pipe.stem}"
        self.save = workdir / f"ckpt-{pipe.stem}"
        args = [str(binary), "run", str(pipe), "--run-dir", str(self.run_dir), "--save", str(self.save), *extra]
        env = dict(os.environ, MATMUL_NUM_THREADS="1")
        self.process = subprocess.Popen(args, stdout=self.out, stderr=self.err, cwd=workdir, env=env)

    def wait(self, timeout=300):
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"draftpipe run did not finish in {timeout} s:\n{self.stderr()}") from None
        return code

    def stderr(self):
        self.err.flush()
        return Path(self.err.name).read_text()

    def stdout(self):
        self.out.flush()
        return Path(self.out.name).read_text()

    def summary(self):
        return json.loads((self.run_dir / "summary.json").read_text())

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.out.close()
        self.err.close()


@pytest.fixture
def start_run(draftpipe_bin, tmp_path):
    runs = []

    def start(pipe, *extra):
        run = Run(draftpipe_bin, pipe, tmp_path, *extra)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()


def python_module(*args, **kwargs):
    """Runs `python -m ...` with this interpreter in the background."""
    return subprocess.Popen([sys.executable, "-m", *args], **kwargs)


def wait_for(condition, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
