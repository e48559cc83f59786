#!/usr/bin/env python3
"""Parity of draftpipe's EAGLE-3 training step with a PyTorch implementation of SpecForge's, weight by weight.

Writes a tiny eagle3 pipeline over a files source (`hidden_states [N, S, 3H]`, `last_hidden_states [N, S, H]`,
`input_ids`, `loss_mask`), the target's frozen embedding and `lm_head`, a draft vocabulary map and random
initial drafter weights, runs `draftpipe run PIPE --init INIT --steps 3 --save OUT`, takes the same 3 AdamW steps
(torch.optim.AdamW, Hugging Face's cosine schedule with warmup) in PyTorch (`eagle3_reference.py`), and compares
every exported weight tensor (OUT/model.safetensors, SGLang's `LlamaForCausalLMEagle3` layout) and the AdamW
moments (OUT/training_state/optimizer.safetensors) with PyTorch's, tensor by tensor. It checks the export's
`d2t`/`t2d` are the given map unchanged and its config.json's EAGLE-3 keys. A second run of one step gives the
loss and the per-step accuracy at the initial weights (its summary's `final_loss` and `final_slot_accuracy`):
the loss must equal the f64 reference's to LOSS_TOLERANCE relative, the accuracies the reference's counts.

The data makes every rule matter: about half the rows' target argmax is outside the draft vocabulary (those rows
train nothing, and only renormalising over the draft vocabulary gives the reference's teacher); prompts and a
hole in the loss mask; every sequence ends as SpecForge's offline data does (the last real token's mask 0, so its
successor is read only as an input id and a teacher row), two of them before the bucket's end (right padding,
zeros, as a shorter sequence is padded); TTT 4 (steps 2 and 3 read cached keys), GQA ratio 2 (4 heads over 2 kv
heads), RoPE positions that differ per step.

Tolerance (`parity_support.compare`, the dflash check's rule): draftpipe computes in f32, in its own order; the
reference runs in f64. Per tensor, what is compared is the change over the 3 steps (weights minus the initial
ones; the AdamW moments from zero). draftpipe must be within the larger of TOLERANCE_FACTOR (20) times the
largest distance of a float32 PyTorch run from the f64 one, and RELATIVE_TOLERANCE (1e-4) of the tensor's largest
change, on every element; every kind must change by at least 100 times the f32 bound, so the comparison can
fail.

Deliberate mistakes (`--mistake`, planted in the reference; each must make this check exit 1): `decay` (step
weight 0.7 instead of 0.8), `dense-cache` (a cached step's keys seen causally like step 0's instead of only the
query's own row), `unnormalised` (the teacher's full-vocabulary probabilities of the draft tokens, not
renormalised over the draft vocabulary). Checked: each of the three fails it (the weights, the moments and the
loss at the initial weights all mismatch). So do, planted by hand, RoPE at position t for every step instead of
t + k, and GQA's query head h reading kv head h mod kv_heads instead of h / (heads / kv_heads); and so did
draftpipe itself before its files source kept the token after a sequence's last label (docs/eagle3.md).

Exit 0 when every tensor matches, 1 otherwise (each mismatch named), 2 when draftpipe itself fails.
Usage: python scripts/eagle3_parity.py [--draftpipe target/debug/draftpipe] [--keep DIR] [--mistake KIND]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle3_reference import Dims, eagle3_loss, random_params  # noqa: E402
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

SEQ_LEN = 24
TAP_LAYERS = [1, 3, 5]
DIMS = Dims(
    hidden=16,
    taps=len(TAP_LAYERS),
    vocab=64,
    draft_vocab=32,
    heads=4,
    kv_heads=2,
    head_dim=8,
    intermediate=40,
    ttt=4,
    rope_theta=10000.0,
)
LOSS_TOLERANCE = 1e-4
MISTAKES = {
    "decay": {"step_decay": 0.7},
    "dense-cache": {"diagonal": False},
    "unnormalised": {"renormalise": False},
}

PIPE = """pipeline "eagle3-parity"

target t on cpu {{
    hidden       = {hidden}
    layers       = 6
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
    model     = eagle3(heads = {heads}, kv_heads = {kv_heads}, head_dim = {head_dim}, intermediate = {intermediate}, ttt = {ttt}, draft_vocab = {draft_vocab}, rope_theta = {rope_theta:g})
    loss      = cross_entropy(step_decay = {step_decay})
    optimizer = adamw(lr = {lr}, betas = ({b1}, {b2}), eps = {eps}, weight_decay = {wd})
    schedule  = {schedule}(warmup = {warmup})
    steps     = {steps}
    vocab_map = "{vocab_map}"
}}
"""


def make_vocab_map(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A draft vocabulary of `draft_vocab` random target ids, sorted, in SpecForge's form: `d2t` offsets (draft
    id `i` is target id `i + d2t[i]`) and the `t2d` membership mask."""
    chosen = torch.randperm(DIMS.vocab, generator=generator)[: DIMS.draft_vocab].sort().values
    t2d = torch.zeros(DIMS.vocab, dtype=torch.bool)
    t2d[chosen] = True
    return {"d2t": (chosen - torch.arange(DIMS.draft_vocab)).to(torch.int64), "t2d": t2d}


def make_data(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`STEPS` batches of `SEQUENCES_PER_BATCH` sequences: a prompt of unmasked tokens, a hole in the loss mask
    of every other sequence, the last real token's mask 0 (SpecForge's offline normalisation), and two sequences
    shorter than the bucket (zeros after their end, as a padded batch holds)."""
    n = STEPS * SEQUENCES_PER_BATCH
    ids = torch.randint(0, DIMS.vocab, (n, SEQ_LEN), generator=generator)
    hidden = torch.randn(n, SEQ_LEN, DIMS.taps * DIMS.hidden, generator=generator)
    last = torch.randn(n, SEQ_LEN, DIMS.hidden, generator=generator)
    mask = torch.ones(n, SEQ_LEN, dtype=torch.uint8)
    for row in range(n):
        mask[row, : 2 + row % 5] = 0
        if row % 2 == 1:
            mask[row, 6 + row] = 0
        length = SEQ_LEN - 4 - row if row % 3 == 2 else SEQ_LEN
        mask[row, length - 1 :] = 0
        ids[row, length:] = 0
        hidden[row, length:] = 0
        last[row, length:] = 0
    return {"hidden_states": hidden, "last_hidden_states": last, "input_ids": ids.to(torch.int64), "loss_mask": mask}


def batch_loss(params, frozen, vocab_map, data, step, dtype, mistake):
    """The reference's loss of batch `step` (the files source's batches are its rows in order)."""
    rows = slice(step * SEQUENCES_PER_BATCH, (step + 1) * SEQUENCES_PER_BATCH)
    return eagle3_loss(
        DIMS,
        params,
        frozen["model.embed_tokens.weight"].to(dtype),
        frozen["lm_head.weight"].to(dtype),
        vocab_map["t2d"],
        vocab_map["d2t"],
        data["hidden_states"][rows].to(dtype),
        data["last_hidden_states"][rows].to(dtype),
        data["input_ids"][rows],
        data["loss_mask"][rows],
        **MISTAKES.get(mistake, {}),
    )


def expected_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": DIMS.hidden,
        "intermediate_size": DIMS.intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": DIMS.heads,
        "num_key_value_heads": DIMS.kv_heads,
        "head_dim": DIMS.head_dim,
        "vocab_size": DIMS.vocab,
        "draft_vocab_size": DIMS.draft_vocab,
        "target_hidden_size": DIMS.hidden,
        "rope_theta": DIMS.rope_theta,
        "rms_norm_eps": DIMS.rms_norm_eps,
        "tie_word_embeddings": False,
    }


def check_export(out: Path, weights: dict, vocab_map: dict) -> list[str]:
    """The export's vocabulary tensors (the given map, unchanged, `d2t` int64) and its config's EAGLE-3 keys."""
    problems = check_config(out, expected_config())
    for name, given in vocab_map.items():
        found = weights.get(name)
        if found is None or found.dtype != given.dtype or not torch.equal(found, given):
            problems.append(f"export: `{name}` is not the given map ({None if found is None else found.dtype})")
    config = json.loads((out / "config.json").read_text())
    aux = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if aux != [t - 1 for t in TAP_LAYERS]:
        problems.append(f"config.json: eagle_config.eagle_aux_hidden_state_layer_ids is {aux!r}")
    return problems


def check_initial_loss(run_dir: Path, params, frozen, vocab_map, data, mistake) -> list[str]:
    """draftpipe's loss and per-step accuracy of its first step (the initial weights, batch 0) against the f64
    reference's."""
    summary = json.loads((run_dir / "summary.json").read_text())
    found, accuracy = summary.get("final_loss"), summary.get("final_slot_accuracy", [])
    f64 = {k: v.double() for k, v in params.items()}
    reference = batch_loss(f64, frozen, vocab_map, data, 0, torch.float64, mistake)
    expected = float(reference.loss)
    expected_accuracy = [c / s if s else 0.0 for c, s in zip(reference.correct, reference.supervised)]
    problems = []
    if found is None:
        return [f"loss at the initial weights: no `final_loss` in {run_dir / 'summary.json'}"]
    relative = abs(found - expected) / abs(expected)
    print(f"loss at the initial weights: draftpipe {found:.9g}, PyTorch f64 {expected:.9g} (relative {relative:.2g})")
    print(f"accuracy per TTT step: draftpipe {[round(a, 6) for a in accuracy]}, PyTorch f64 "
          f"{[round(a, 6) for a in expected_accuracy]} ({reference.correct} of {reference.supervised})")  # fmt: skip
    if relative > LOSS_TOLERANCE:
        problems.append(f"loss at the initial weights: relative difference {relative:.3g} > {LOSS_TOLERANCE}")
    if len(accuracy) != DIMS.ttt or any(abs(a - b) > 1e-6 for a, b in zip(accuracy, expected_accuracy)):
        problems.append(f"accuracy per TTT step: draftpipe {accuracy}, PyTorch {expected_accuracy}")
    return problems


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--mistake", choices=sorted(MISTAKES), help="plant this mistake in the reference")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="eagle3-parity-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(22)
        frozen = frozen_target(DIMS.hidden, DIMS.vocab, generator)
        save(work, "target.safetensors", frozen)
        vocab_map = make_vocab_map(generator)
        vocab_file = save(work, "vocab.safetensors", vocab_map)
        data = make_data(generator)
        save(work, "data.safetensors", data)
        init = random_params(DIMS, generator)
        save(work, "init/model.safetensors", init)
        pipe = write_pipe(work, PIPE, DIMS, TAP_LAYERS, SEQ_LEN, vocab_map=vocab_file)
        out = work / "out"
        trained = run_command(args.draftpipe, pipe, work, STEPS, "run", out)
        first_step = run_command(args.draftpipe, pipe, work, 1, "first", None)
        if not run_draftpipe([trained, first_step]):
            return 2

        def loss(params, step, dtype):
            return batch_loss(params, frozen, vocab_map, data, step, dtype, args.mistake).loss

        weights, problems = compare_saved(out, init, loss, also_saved=vocab_map.keys())
        problems += check_export(out, weights, vocab_map)
        problems += check_initial_loss(work / "first", init, frozen, vocab_map, data, args.mistake)
    return verdict("eagle3", len(init), problems)


if __name__ == "__main__":
    sys.exit(main())
