#!/usr/bin/env python3
"""Parity of draftpipe's DFlash training step with a PyTorch implementation of SpecForge's, weight by weight.

Writes a tiny dflash pipeline with its frozen target weights, its data and random initial drafter weights, runs
`draftpipe run PIPE --init INIT --steps 3 --save OUT`, takes the same 3 AdamW steps (torch.optim.AdamW, Hugging
Face's cosine schedule with warmup) in PyTorch, and compares OUT/model.safetensors and the AdamW moments in
OUT/training_state/optimizer.safetensors with PyTorch's, tensor by tensor. It also checks OUT/config.json against the pipeline.

Anchors: every sequence has fewer valid anchors than `anchors`, so draftpipe takes all of them, sorted, whatever
its seed (the issue's rule); PyTorch takes the same.

Tolerance (`parity_support.compare`): per tensor, the change over the 3 steps (weights minus the initial ones;
the AdamW moments from zero) within the larger of 20 times what f32 rounding alone does to these steps (a float32
PyTorch run against the f64 one) and 1e-4 of the tensor's largest change; every kind must change by at least 100
times the f32 bound, so the comparison can fail; changing the decay from 7 to 6, or letting a query see its own
anchor's context position, fails it.

Exit 0 when every tensor matches, 1 otherwise (each mismatch named), 2 when draftpipe itself fails.
Usage: python scripts/dflash_parity.py [--draftpipe target/debug/draftpipe] [--keep DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash_reference import Dims, all_anchors, dflash_loss, random_params  # noqa: E402
from parity_support import (  # noqa: E402
    SEQUENCES_PER_BATCH,
    STEPS,
    arguments,
    check_config,
    compare_saved,
    frozen_target,
    run_command,
    run_draftpipe,
    save,
    verdict,
    write_pipe,
)

SEQ_LEN = 32
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


def batch_loss(embed, lm_head, data):
    """The reference's loss of batch `step` (the files source's batches are its rows in order), every valid
    anchor taken."""

    def loss(params, step, dtype):
        rows = slice(step * SEQUENCES_PER_BATCH, (step + 1) * SEQUENCES_PER_BATCH)
        hidden = data["hidden_states"][rows].to(dtype)
        ids, mask = data["input_ids"][rows], data["loss_mask"][rows]
        anchors, keep = all_anchors(mask, DIMS.anchors)
        value, _, _ = dflash_loss(DIMS, params, embed.to(dtype), lm_head.to(dtype), hidden, ids, mask, anchors, keep)
        return value

    return loss


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


def main() -> int:
    args = arguments(__doc__).parse_args()

    with tempfile.TemporaryDirectory(prefix="dflash-parity-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(10)
        frozen = frozen_target(DIMS.hidden, DIMS.vocab, generator)
        save(work, "target.safetensors", frozen)
        data = make_data(generator)
        save(work, "data.safetensors", data)
        init = random_params(DIMS, generator)
        save(work, "init/model.safetensors", init)
        pipe = write_pipe(work, PIPE, DIMS, TAP_LAYERS, SEQ_LEN)
        out = work / "out"
        if not run_draftpipe([run_command(args.draftpipe, pipe, work, STEPS, "run", out)]):
            return 2

        loss = batch_loss(frozen["model.embed_tokens.weight"], frozen["lm_head.weight"], data)
        _, problems = compare_saved(out, init, loss)
        problems += check_config(out, expected_config())
    return verdict("dflash", len(init), problems)


if __name__ == "__main__":
    sys.exit(main())
