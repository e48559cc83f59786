#!/usr/bin/env python3
"""Benchmark (not a test): draftpipe's CPU DFlash training step against PyTorch eager's, same shapes, same run.

Reads the pipeline's plan (`draftpipe compile --emit json`), then times, on the same machine one after the other:

- PyTorch eager: the DFlash step of `dflash_reference.py` (SDPA with a dense mask, fused nothing) — forward,
  decayed cross-entropy, backward, `torch.optim.AdamW` — on batches of the pipeline's largest bucket, every
  sequence full, `anchors` anchors per sequence drawn afresh each step; `--torch-steps` steps after 2 warm-up
  steps, each timed alone; the median.
- draftpipe: `draftpipe run` of the same pipeline with its source replaced by a safetensors file of such batches
  (and target weights written for it), one drafter worker (all the cores, as PyTorch has), `--steps` steps,
  `--repeats` runs; per run the drafter's compute time per step from `summary.json` (every phase but waiting
  for data), then the median over runs.

Prints both times per step, tokens/s, and the ratio PyTorch / draftpipe (the issue's goal: ≥ 1.5).
Usage: python scripts/dflash_bench.py [--pipeline pipelines/dflash-quickstart.pipe] [--draftpipe BIN]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash_reference import Dims, dflash_loss, random_params  # noqa: E402

COMPUTE_PHASES = {"copy", "forward", "loss", "backward", "all_reduce", "optimizer", "device_step", "other"}


def plan_of(draftpipe: str, pipeline: Path) -> dict:
    out = subprocess.run([draftpipe, "compile", "--emit", "json", str(pipeline)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"draftpipe compile failed:\n{out.stderr}")
    return json.loads(out.stdout)


def dims_of(plan: dict) -> Dims:
    spec = plan["model"]["spec"]["Dflash"]
    decay = plan["drafter"]["loss"].get("position_decay")
    return Dims(
        hidden=spec["hidden"],
        taps=spec["taps"],
        vocab=spec["vocab"],
        layers=spec["layers"],
        heads=spec["heads"],
        kv_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        intermediate=spec["intermediate"],
        block=spec["block"],
        anchors=spec["anchors"],
        mask_token=spec["mask_token"],
        rope_theta=spec["rope_theta"],
        position_decay=decay,
        rms_norm_eps=spec.get("rms_norm_eps", 1e-6),
    )


def sample_anchors(bsz: int, seq_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` distinct sorted anchors per sequence from `0..seq_len − 1` (every position valid: full masks)."""
    scores = torch.rand(bsz, seq_len - 1, generator=generator)
    return scores.argsort(dim=1)[:, :count].sort(dim=1).values


def time_torch(d: Dims, seq_len: int, sequences: int, steps: int, lr: float) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    params = {k: v.requires_grad_(True) for k, v in random_params(d, generator).items()}
    embed = torch.randn(d.vocab, d.hidden, generator=generator)
    lm_head = torch.randn(d.vocab, d.hidden, generator=generator) / d.hidden**0.5
    optimizer = torch.optim.AdamW(params.values(), lr=lr)
    hidden = torch.randn(sequences, seq_len, d.taps * d.hidden, generator=generator)
    ids = torch.randint(0, d.vocab, (sequences, seq_len), generator=generator)
    mask = torch.ones(sequences, seq_len, dtype=torch.uint8)
    count = min(d.anchors, seq_len - 1)
    keep = torch.ones(sequences, count, dtype=torch.bool)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        anchors = sample_anchors(sequences, seq_len, count, generator)
        loss, _, _ = dflash_loss(d, params, embed, lm_head, hidden, ids, mask, anchors, keep)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return times


def derived_pipeline(text: str, target: Path, data: Path, epochs: int) -> str:
    """The pipeline reading `data` with `target`'s weights, with one drafter worker."""
    text = re.sub(r"(?m)^(\s*)weights\s*=.*$\n", "", text)
    text = re.sub(
        r"(?m)^(\s*)source\s*=.*$",
        lambda m: f'{m[1]}weights      = safetensors(path = "{target}")\n'
        f'{m[1]}source       = safetensors(path = "{data}", epochs = {epochs})',
        text,
    )
    return re.sub(r"(?m)^(drafter\s+\S+\s+on\s+cpu)\s+x\d+", r"\1", text)


def time_draftpipe(args, plan: dict, d: Dims, seq_len: int, sequences: int, work: Path) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(d.vocab, d.hidden, generator=generator),
            "lm_head.weight": torch.randn(d.vocab, d.hidden, generator=generator) / d.hidden**0.5,
        },
        str(work / "target.safetensors"),
    )
    batches = 4
    save_file(
        {
            "hidden_states": torch.randn(batches * sequences, seq_len, d.taps * d.hidden, generator=generator),
            "input_ids": torch.randint(0, d.vocab, (batches * sequences, seq_len), generator=generator),
            "loss_mask": torch.ones(batches * sequences, seq_len, dtype=torch.uint8),
        },
        str(work / "data.safetensors"),
    )
    epochs = args.steps // batches + 2
    pipe = work / "bench.pipe"
    pipe.write_text(derived_pipeline(args.pipeline.read_text(), work / "target.safetensors",
                                     work / "data.safetensors", epochs))  # fmt: skip
    per_step = []
    for repeat in range(args.repeats):
        run_dir = work / f"run{repeat}"
        command = [args.draftpipe, "run", str(pipe), "--steps", str(args.steps), "--json", "--run-dir", str(run_dir)]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"draftpipe run failed (exit {out.returncode}):\n{out.stderr}")
        summary = json.loads((run_dir / "summary.json").read_text())
        drafter = summary["drafters"][0]
        compute = sum(p["total_s"] for p in drafter["phases"] if p["phase"] in COMPUTE_PHASES)
        per_step.append(compute / drafter["steps"])
    return per_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--pipeline", type=Path, default=root / "pipelines" / "dflash-quickstart.pipe")
    default_bin = os.environ.get("DRAFTPIPE_BIN", str(root / "target" / "release" / "draftpipe"))
    parser.add_argument("--draftpipe", default=default_bin, help="the draftpipe binary [%(default)s]")
    parser.add_argument("--steps", type=int, default=20, help="draftpipe steps per run [%(default)s]")
    parser.add_argument("--repeats", type=int, default=3, help="draftpipe runs [%(default)s]")
    parser.add_argument("--torch-steps", type=int, default=10, help="timed PyTorch steps [%(default)s]")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="PyTorch threads [%(default)s]")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    plan = plan_of(args.draftpipe, args.pipeline)
    d = dims_of(plan)
    largest = max(plan["buckets"], key=lambda b: b["padded_len"])
    seq_len, sequences = largest["padded_len"], largest["sequences"]
    tokens = seq_len * sequences
    lr = plan["drafter"]["optimizer"]["lr"]
    print(f"{args.pipeline.name}: {d}")
    print(f"batch: {sequences} sequences × {seq_len} tokens, {min(d.anchors, seq_len - 1)} anchors each; "
          f"PyTorch {torch.__version__} on {args.threads} threads")  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        ours = time_draftpipe(args, plan, d, seq_len, sequences, Path(tmp))
    theirs = time_torch(d, seq_len, sequences, args.torch_steps, lr)
    ours_median, theirs_median = statistics.median(ours), statistics.median(theirs)
    print(f"draftpipe:     {ours_median * 1e3:8.1f} ms/step  {tokens / ours_median:9.0f} tok/s  "
          f"(runs: {', '.join(f'{t * 1e3:.1f}' for t in ours)} ms)")  # fmt: skip
    print(f"PyTorch eager: {theirs_median * 1e3:8.1f} ms/step  {tokens / theirs_median:9.0f} tok/s  "
          f"(min {min(theirs) * 1e3:.1f}, max {max(theirs) * 1e3:.1f} ms)")  # fmt: skip
    print(f"ratio PyTorch / draftpipe: {theirs_median / ours_median:.2f}x (goal ≥ 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
