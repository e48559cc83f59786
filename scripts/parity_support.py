"""What the two parity checks against PyTorch share (`dflash_parity.py`, `eagle3_parity.py`): the command line,
the training settings, the files a tiny pipeline reads (frozen target tables, data, random initial weights, the
`.pipe` file), the `draftpipe run`s, the 3 AdamW steps in PyTorch, and the tensor-by-tensor comparison of what
draftpipe saved with the f64 reference.

Tolerance (`compare`): draftpipe computes in f32, in its own order; the reference runs in f64. Per tensor, what is
compared is the change over the steps (weights minus the initial ones; the AdamW moments, which carry the
gradients, from zero). draftpipe must be within the larger of two bounds of the f64 reference on every element:
TOLERANCE_FACTOR times the largest distance of a float32 PyTorch run from the f64 one (what f32 rounding alone
does to these steps), or RELATIVE_TOLERANCE of the tensor's largest change (a gradient element sums ~10^3
products, and f32 accumulation over n terms is good to about n·2^-24 ≈ 6e-5 of its size). Every kind must
change by at least 100 times the f32 bound, so the comparison can fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash_reference import schedule_factor  # noqa: E402

STEPS = 3
SEQUENCES_PER_BATCH = 2
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
SCHEDULE, WARMUP = "cosine", 1
TOLERANCE_FACTOR = 20.0
RELATIVE_TOLERANCE = 1e-4

# A loss of batch `step` at `dtype` for the parameters given (the files source's batches are its rows in order).
BatchLoss = Callable[[dict[str, torch.Tensor], int, torch.dtype], torch.Tensor]


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options both checks take: the binary (`DRAFTPIPE_BIN`, else the debug build) and a directory to keep."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent
    default_bin = os.environ.get("DRAFTPIPE_BIN", str(root / "target" / "debug" / "draftpipe"))
    parser.add_argument("--draftpipe", default=default_bin, help="the draftpipe binary [%(default)s]")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    return parser


def frozen_target(hidden: int, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The target's frozen embedding and `lm_head` (scaled as a trained head's logits are, about unit size)."""
    return {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator),
        "lm_head.weight": torch.randn(vocab, hidden, generator=generator) / hidden**0.5,
    }


def save(work: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    """`tensors` as `work/name` (a safetensors file); its path."""
    path = work / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def write_pipe(work: Path, template: str, dims, tap_layers: list[int], seq_len: int, **extra) -> Path:
    """`work/parity.pipe` from `template`, filled with `dims`' fields, the taps, the bucket, the training
    settings above, the files `target.safetensors` and `data.safetensors` in `work`, and `extra`."""
    pipe = work / "parity.pipe"
    pipe.write_text(
        template.format(
            **{k: getattr(dims, k) for k in dims.__dataclass_fields__},
            tap_layers=tap_layers,
            batch_tokens=seq_len * SEQUENCES_PER_BATCH,
            seq_len=seq_len,
            target=work / "target.safetensors",
            data=work / "data.safetensors",
            lr=LR,
            b1=BETAS[0],
            b2=BETAS[1],
            eps=EPS,
            wd=WEIGHT_DECAY,
            schedule=SCHEDULE,
            warmup=WARMUP,
            steps=STEPS,
            **extra,
        )
    )
    return pipe


def run_command(draftpipe: str, pipe: Path, work: Path, steps: int, run_dir: str, save: Path | None) -> list[str]:
    """`draftpipe run PIPE --init WORK/init --steps N [--save SAVE] --run-dir WORK/RUN_DIR --json`."""
    command = [draftpipe, "run", str(pipe), "--init", str(work / "init"), "--steps", str(steps)]
    if save is not None:
        command += ["--save", str(save)]
    return command + ["--run-dir", str(work / run_dir), "--json"]


def run_draftpipe(commands: list[list[str]]) -> bool:
    """Runs each command; on the first that fails, prints it with its standard error and returns False."""
    for command in commands:
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"draftpipe failed (exit {run.returncode}): {' '.join(command)}\n{run.stderr}", file=sys.stderr)
            return False
    return True


def torch_steps(init: dict[str, torch.Tensor], batch_loss: BatchLoss, dtype: torch.dtype):
    """The `STEPS` AdamW steps in PyTorch at `dtype` (torch.optim.AdamW, Hugging Face's schedule with warmup);
    returns the weights and the AdamW moments."""
    params = {k: v.to(dtype).clone().requires_grad_(True) for k, v in init.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda applied: schedule_factor(SCHEDULE, WARMUP, STEPS, applied)
    )
    for step in range(STEPS):
        loss = batch_loss(params, step, dtype)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    state = optimizer.state
    return (
        {k: v.detach() for k, v in params.items()},
        {k: state[v]["exp_avg"] for k, v in params.items()},
        {k: state[v]["exp_avg_sq"] for k, v in params.items()},
    )


def compare(what, found, reference, torch32, start) -> list[str]:
    """Per tensor, draftpipe's change from `start` (the initial weights, or zero for the moments) against the
    f64 reference's, within the tolerance of the module's docstring."""
    problems = []
    f32_error = max(float((torch32[k].double() - reference[k]).abs().max()) for k in reference)
    worst, worst_name, moved = 0.0, "", 0.0
    for name, ref in reference.items():
        if name not in found:
            problems.append(f"{what}: `{name}` missing from draftpipe's file")
            continue
        got = found[name].double()
        if got.shape != ref.shape:
            problems.append(f"{what}: `{name}` has shape {list(got.shape)}, expected {list(ref.shape)}")
            continue
        change = (ref - start[name]).abs().max().item()
        moved = max(moved, change)
        tolerance = max(TOLERANCE_FACTOR * f32_error, RELATIVE_TOLERANCE * change)
        diff = (got - ref).abs()
        if diff.max().item() / tolerance > worst:
            worst, worst_name = diff.max().item() / tolerance, name
        if diff.max().item() > tolerance:
            at = int(diff.argmax())
            problems.append(
                f"{what}: `{name}` element {at}: draftpipe {got.flatten()[at].item():.9g}, "
                f"PyTorch f64 {ref.flatten()[at].item():.9g} (|diff| {diff.max().item():.3g} > tolerance {tolerance:.3g})"
            )
    print(
        f"{what}: PyTorch f32 − f64 at most {f32_error:.3g}; draftpipe − f64 at most {worst:.3f} of its tolerance "
        f"(`{worst_name}`); largest change {moved:.3g}"
    )
    if moved < 100 * TOLERANCE_FACTOR * f32_error:
        problems.append(f"{what}: changed only {moved:.3g}, too little against f32 rounding ({f32_error:.3g})")
    return problems


def compare_saved(out: Path, init: dict[str, torch.Tensor], batch_loss: BatchLoss, also_saved=frozenset()):
    """draftpipe's saved weights (`OUT/model.safetensors`) and AdamW moments
    (`OUT/training_state/optimizer.safetensors`) against the f64 reference's steps from `init`, with the f32
    run's distance as the rounding bound; any other saved tensor not in `also_saved` is a problem. Returns the
    saved weights and the problems."""
    reference = torch_steps(init, batch_loss, torch.float64)
    torch32 = torch_steps(init, batch_loss, torch.float32)
    weights = load_file(str(out / "model.safetensors"))
    optimizer = load_file(str(out / "training_state" / "optimizer.safetensors"))
    moments = [{k: optimizer[f"{prefix}{k}"] for k in init if f"{prefix}{k}" in optimizer}
               for prefix in ("exp_avg.", "exp_avg_sq.")]  # fmt: skip

    zeros = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in init.items()}
    initial = {k: v.double() for k, v in init.items()}
    problems = compare("weights", weights, reference[0], torch32[0], initial)
    problems += compare("exp_avg", moments[0], reference[1], torch32[1], zeros)
    problems += compare("exp_avg_sq", moments[1], reference[2], torch32[2], zeros)
    if extra := sorted(set(weights) - set(init) - set(also_saved)):
        problems.append(f"weights: unexpected tensors in draftpipe's file: {extra}")
    return weights, problems


def check_config(out: Path, expected: dict) -> list[str]:
    """Every key of `expected` as `OUT/config.json` holds it."""
    config = json.loads((out / "config.json").read_text())
    return [f"config.json: `{key}` is {config.get(key)!r}, expected {value!r}"
            for key, value in expected.items() if config.get(key) != value]  # fmt: skip


def verdict(family: str, tensors: int, problems: list[str]) -> int:
    """Prints each problem and the one-line verdict; the exit status (0 when there is none, else 1)."""
    for problem in problems:
        print(f"MISMATCH {problem}", file=sys.stderr)
    print(f"{family} parity: {tensors} tensors, {STEPS} steps: {'FAILED' if problems else 'ok'}")
    return 1 if problems else 0
