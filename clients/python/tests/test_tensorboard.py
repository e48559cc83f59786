"""TensorBoard event files of `draftpipe run`, read back with the `tensorboard` package's own reader.

The quick start runs with `telemetry { tensorboard = "tb" }`; every tag of the files must equal, step by step,
the `status.jsonl` field that docs/telemetry.md's table names for it (as an f32, TensorBoard's scalar type), and
every documented field a status line carries must have its tag. A resumed run adds a second file whose steps go on
from the checkpoint's.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO

QUICKSTART = REPO / "pipelines" / "dflash-quickstart.pipe"
DOCS = REPO / "docs" / "telemetry.md"
ROW = re.compile(r"^\| `(?P<tag>[^`]+)` \| .* \| `(?P<field>[^`]+)` \|$")


def documented_tags():
    """(tag pattern, field template) for each row of docs/telemetry.md's TensorBoard table."""
    rows = [ROW.match(line) for line in DOCS.read_text().splitlines()]
    rows = [(m["tag"], m["field"]) for m in rows if m and "/" in m["tag"]]
    assert len(rows) >= 15, f"the TensorBoard table of {DOCS} was not found"
    return rows


def field_value(line, template, index):
    """The status-line value at `template` (`drafters[{i}].busy_pct`, `slot_accuracy[{i-1}]`) for `index`."""
    path = template.replace("{i-1}", str(index - 1 if index is not None else 0)).replace("{i}", str(index))
    value = line
    for part in path.split("."):
        name, *subscripts = re.findall(r"[^\[\]]+", part)
        value = value.get(name) if isinstance(value, dict) else None
        for subscript in subscripts:
            value = value[int(subscript)] if isinstance(value, list) and int(subscript) < len(value) else None
    return value


def status_series(lines, rows):
    """tag -> [(step, value)] as status.jsonl says the event files must hold them."""
    series = {}
    for line in lines:
        for tag, field in rows:
            if "{i}" not in tag:
                candidates = [(tag, None)]
            else:
                first = 1 if "{i-1}" in field else 0
                candidates = [(tag.replace("{i}", str(i)), i) for i in range(first, first + 64)]
            for name, index in candidates:
                value = field_value(line, field, index)
                if value is not None:
                    series.setdefault(name, []).append((line["step"], float(np.float32(value))))
    return series


def event_series(path):
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def status_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "status.jsonl").read_text().splitlines()]


def quickstart_copy(tmp_path, tensorboard_line):
    text = QUICKSTART.read_text()
    assert "telemetry { every = 1s }" in text
    pipe = tmp_path / "dflash-quickstart.pipe"
    pipe.write_text(text.replace("telemetry { every = 1s }", f"telemetry {{\n    every = 200ms\n{tensorboard_line}}}"))
    return pipe


def run(start_run, pipe, *extra):
    process = start_run(pipe, *extra)
    code = process.wait()
    assert code == 0, process.stderr()
    return process


def test_every_tag_equals_status_jsonl(start_run, tmp_path):
    pipe = quickstart_copy(tmp_path, '    tensorboard = "tb"\n')
    process = run(start_run, pipe, "--steps", "60")
    # Relative to the directory the run runs in, as every path of a pipeline.
    files = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1, files

    rows = documented_tags()
    lines = status_lines(process.run_dir)
    assert len(lines) >= 2, "the run must write several status lines"
    expected = status_series(lines, rows)
    found = event_series(files[0])

    patterns = [re.compile("^" + re.escape(tag).replace(r"\{i\}", r"\d+") + "$") for tag, _ in rows]
    undocumented = [tag for tag in found if not any(p.match(tag) for p in patterns)]
    assert not undocumented, f"tags missing from docs/telemetry.md: {undocumented}"
    assert sorted(found) == sorted(expected)
    for tag, series in expected.items():
        assert found[tag] == series, tag
    # The figures the issue names are there on the quick start (a CPU dflash drafter, two buckets).
    for tag in ["train/loss", "train/tau_exact", "train/tau_simulated", "train/slot_accuracy/1", "train/slot_accuracy/3", "train/learning_rate",
                "train/grad_norm", "throughput/real_tokens_per_s", "throughput/token_slots_per_s", "queue/depth",
                "queue/bucket_0", "queue/bucket_1", "drafter_0/busy_pct", "drafter_0/data_wait_pct"]:
        assert tag in found, tag
    assert found["train/loss"][-1][0] == 60


def test_a_resumed_run_adds_a_file_whose_steps_go_on(start_run, tmp_path):
    pipe = quickstart_copy(tmp_path, "")
    tb = tmp_path / "shared-tb"
    first = run(start_run, pipe, "--steps", "30", "--tensorboard", str(tb))
    # The second process resumes from the first one's checkpoint into the same event directory.
    resumed_pipe = tmp_path / "resumed.pipe"
    resumed_pipe.write_text(pipe.read_text())
    second = run(start_run, resumed_pipe, "--steps", "60", "--resume", str(first.save), "--tensorboard", str(tb))

    files = sorted(tb.glob("events.out.tfevents.*"))
    assert len(files) == 2, files
    by_process = [event_series(path) for path in files]
    first_steps = [step for step, _ in by_process[0]["train/loss"]]
    second_steps = [step for step, _ in by_process[1]["train/loss"]]
    assert first_steps[-1] == 30 and second_steps[-1] == 60
    assert second_steps[0] > first_steps[-1], (first_steps, second_steps)

    rows = documented_tags()
    for series, process in zip(by_process, [first, second]):
        expected = status_series(status_lines(process.run_dir), rows)
        assert series == expected

    # The directory read as TensorBoard reads it: one curve over both processes, steps rising.
    joined = [step for step, _ in event_series(tb)["train/loss"]]
    assert joined == first_steps + second_steps


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
