#!/usr/bin/env python3
"""Parity of draftpipe's DFlash training step with a PyTorch implementation of SpecForge's, weight by weight.

Writes a tiny dflash pipeline with its frozen target weights, its data and random initial drafter weights, runs
`draftpipe run PIPE --init INIT --steps 3 --save OUT`, takes the same 3 AdamW steps (torch.optim.AdamW, Hugging
Face's cosine schedule with warmup) in PyTorch, and compares OUT/model.safetensors and the AdamW moments in
OUT/training_state/optimizer.safetensors with PyTorch's, tensor by tensor. It also checks OUT/config.json against the pipeline.

Anchors: every sequence has fewer valid anchors than `anchors`, so draftpipe takes all of them, sorted, whatever
its seed (the issue's rule); PyTorch takes the same.

Tolerance: draftpipe computes in f32, in its own order; the reference runs in f64. Per tensor, what is compared
is the change over the 3 steps (weights minus the initial ones; the AdamW moments, which carry the gradients,
from zero). draftpipe must be within the larger of two bounds of the f64 reference on every element:
TOLERANCE_FACTOR times the largest distance of a float32 PyTorch run from the f64 one (what f32 rounding alone
does to these steps), or RELATIVE_TOLERANCE of the tensor's largest change (a gradient element sums ~10^3
products, and f32 accumulation over n terms is good to about n·2^-24 ≈ 6e-5 of its size). Every kind must
change by at least 100 times the f32 bound, so the comparison can fail; changing the decay from 7 to 6, or
letting a query see its own anchor's context position, fails it.

Exit 0 when every tensor matches, 1 otherwise (each mismatch named), 2 when draftpipe itself fails.
Usage: python scripts/dflash_parity.py [--draftpipe target/debug/draftpipe] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash_reference import Dims, all_anchors, dflash_loss, random_params, schedule_factor  # noqa: E402

STEPS = 3
SEQ_LEN = 32
SEQUENCES_PER_BATCH = 2
TAP_LAYERS = [1, 2]
DIMS = Dims(
    hidden=16,
    taps=len(TAP_LAYERS),
    vocab=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=8,
    intermediate=48,
    block=4,
    anchors=SEQ_LEN,
    mask_token=63,
    rope_theta=10000.0,
    position_decay=7.0,
)
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
SCHEDULE, WARMUP = "cosine", 1
TOLERANCE_FACTOR = 20.0
RELATIVE_TOLERANCE = 1e-4

PIPE = """pipeline "dflash-parity"

target t on cpu {{
    hidden       = {hidden}
    tap_layers   = {tap_layers}
    vocab        = {vocab}
    batch_tokens = {batch_tokens}
    weights      = safetensors(path = "{target}")
    source       = safetensors(path = "{data}")
}}

queue hs from t to d {{
    capacity  = 4
    min_ready = 1
    buckets   = [{seq_len}]
    pull      = fifo
}}

drafter d on cpu {{
    model     = dflash(layers = {layers}, heads = {heads}, kv_heads = {kv_heads}, head_dim = {head_dim}, intermediate = {intermediate}, block = {block}, anchors = {anchors}, mask_token = {mask_token}, rope_theta = {rope_theta:g})
    loss      = cross_entropy(position_decay = {position_decay})
    optimizer = adamw(lr = {lr}, betas = ({b1}, {b2}), eps = {eps}, weight_decay = {wd})
    schedule  = {schedule}(warmup = {warmup})
    steps     = {steps}
}}
"""


def make_data(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`STEPS` batches of `SEQUENCES_PER_BATCH` sequences with loss masks that exercise the anchor rule: a prompt
    of unmasked tokens, a hole in the middle, and a sequence shorter than the bucket (right padding, zeroed as
    draftpipe pads)."""
    n = STEPS * SEQUENCES_PER_BATCH
    ids = torch.randint(0, DIMS.vocab - 1, (n, SEQ_LEN), generator=generator)
    hidden = torch.randn(n, SEQ_LEN, DIMS.taps * DIMS.hidden, generator=generator)
    mask = torch.ones(n, SEQ_LEN, dtype=torch.uint8)
    for row in range(n):
        prompt = 2 + row % 5
        mask[row, :prompt] = 0
        if row % 2 == 1:
            mask[row, 12 + row] = 0
        if row % 3 == 2:
            length = SEQ_LEN - 5 - row
            mask[row, length:] = 0
            ids[row, length:] = 0
            hidden[row, length:] = 0
    return {"hidden_states": hidden, "input_ids": ids.to(torch.int64), "loss_mask": mask}


def torch_steps(init, embed, lm_head, data, dtype):
    """The 3 AdamW steps in PyTorch at `dtype`; returns the weights and the AdamW moments."""
    params = {k: v.to(dtype).clone().requires_grad_(True) for k, v in init.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda applied: schedule_factor(SCHEDULE, WARMUP, STEPS, applied)
    )
    embed, lm_head = embed.to(dtype), lm_head.to(dtype)
    for step in range(STEPS):
        rows = slice(step * SEQUENCES_PER_BATCH, (step + 1) * SEQUENCES_PER_BATCH)
        hidden = data["hidden_states"][rows].to(dtype)
        ids, mask = data["input_ids"][rows], data["loss_mask"][rows]
        anchors, keep = all_anchors(mask, DIMS.anchors)
        loss, _, _ = dflash_loss(DIMS, params, embed, lm_head, hidden, ids, mask, anchors, keep)
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


def expected_config() -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": DIMS.block,
        "hidden_size": DIMS.hidden,
        "intermediate_size": DIMS.intermediate,
        "num_hidden_layers": DIMS.layers,
        "num_attention_heads": DIMS.heads,
        "num_key_value_heads": DIMS.kv_heads,
        "head_dim": DIMS.head_dim,
        "vocab_size": DIMS.vocab,
        "rope_theta": DIMS.rope_theta,
        "rms_norm_eps": DIMS.rms_norm_eps,
        "dflash_config": {"mask_token_id": DIMS.mask_token, "target_layer_ids": [t - 1 for t in TAP_LAYERS]},
    }


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent
    default_bin = os.environ.get("DRAFTPIPE_BIN", str(root / "target" / "debug" / "draftpipe"))
    parser.add_argument("--draftpipe", default=default_bin, help="the draftpipe binary [%(default)s]")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dflash-parity-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(10)
        embed = torch.randn(DIMS.vocab, DIMS.hidden, generator=generator)
        lm_head = torch.randn(DIMS.vocab, DIMS.hidden, generator=generator) / DIMS.hidden**0.5
        save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}, str(work / "target.safetensors"))
        data = make_data(generator)
        save_file(data, str(work / "data.safetensors"))
        init = random_params(DIMS, generator)
        (work / "init").mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in init.items()}, str(work / "init" / "model.safetensors"))
        pipe = work / "parity.pipe"
        pipe.write_text(
            PIPE.format(
                **{k: getattr(DIMS, k) for k in DIMS.__dataclass_fields__},
                tap_layers=TAP_LAYERS,
                batch_tokens=SEQ_LEN * SEQUENCES_PER_BATCH,
                seq_len=SEQ_LEN,
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
            )
        )
        out = work / "out"
        command = [
            args.draftpipe, "run", str(pipe), "--init", str(work / "init"), "--steps", str(STEPS),
            "--save", str(out), "--run-dir", str(work / "run"), "--json",
        ]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"draftpipe failed (exit {run.returncode}): {' '.join(command)}\n{run.stderr}", file=sys.stderr)
            return 2

        reference = torch_steps(init, embed, lm_head, data, torch.float64)
        torch32 = torch_steps(init, embed, lm_head, data, torch.float32)
        weights = load_file(str(out / "model.safetensors"))
        optimizer = load_file(str(out / "training_state" / "optimizer.safetensors"))
        moments = [{k: optimizer[f"{prefix}{k}"] for k in init if f"{prefix}{k}" in optimizer}
                   for prefix in ("exp_avg.", "exp_avg_sq.")]  # fmt: skip

        zeros = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in init.items()}
        initial = {k: v.double() for k, v in init.items()}
        problems = compare("weights", weights, reference[0], torch32[0], initial)
        problems += compare("exp_avg", moments[0], reference[1], torch32[1], zeros)
        problems += compare("exp_avg_sq", moments[1], reference[2], torch32[2], zeros)
        if extra := sorted(set(weights) - set(init)):
            problems.append(f"weights: unexpected tensors in draftpipe's file: {extra}")
        config = json.loads((out / "config.json").read_text())
        for key, value in expected_config().items():
            if config.get(key) != value:
                problems.append(f"config.json: `{key}` is {config.get(key)!r}, expected {value!r}")

    for problem in problems:
        print(f"MISMATCH {problem}", file=sys.stderr)
    print(f"dflash parity: {len(init)} tensors, {STEPS} steps: {'FAILED' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
