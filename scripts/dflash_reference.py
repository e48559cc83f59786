"""The DFlash training step in plain PyTorch, as SpecForge trains it, for draftpipe's parity test and benchmark.

Shared by `dflash_parity.py` (3 AdamW steps against `draftpipe run --init … --save …`, weight by weight) and
`dflash_bench.py` (the eager CPU step against draftpipe's). Written from SpecForge's
`specforge/algorithms/common/dflash_family_model.py` (anchors, blocks, dense mask, decayed loss) and z-lab's
`dflash/model.py` (the drafter: `fc` + `hidden_norm` on the context, Qwen3 layers whose keys and values are the
context's projections followed by the block's, a final `norm`, the target's frozen `lm_head`); attention is
`torch.nn.functional.scaled_dot_product_attention` with a dense boolean mask, as SpecForge's `sdpa` backend.

The drafter's forward (and its mask) is `draftpipe_client.drafter`'s, the definition the acceptance loop
(`python -m draftpipe_client.speculative`) drafts with; this file adds the training side: anchors, labels, the
decayed loss, the schedule. Parameters are a dict name -> tensor under z-lab's names (the names of draftpipe's
`model.safetensors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "python"))
from draftpipe_client.drafter import dflash_mask, draft_hidden, tensor_shapes  # noqa: E402


@dataclass(frozen=True)
class Dims:
    """A dflash drafter's dimensions, as the `.pipe` file's `dflash(...)` and target section give them."""

    hidden: int
    taps: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block: int
    anchors: int
    mask_token: int
    rope_theta: float
    position_decay: float | None
    rms_norm_eps: float = 1e-6


def shapes(d: Dims) -> list[tuple[str, tuple[int, ...]]]:
    """The trained tensors in draftpipe's layout order (Contract 1), PyTorch `[out, in]` shapes."""
    return tensor_shapes(d)


def random_params(d: Dims, generator: torch.Generator, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Weights with every tensor away from its initial value (norms near 1, matrices ~ N(0, 1/fan_in)), so the
    parity test exercises each one."""
    params = {}
    for name, shape in shapes(d):
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
        else:
            t = torch.randn(shape, generator=generator, dtype=torch.float64) / math.sqrt(shape[1])
        params[name] = t.to(dtype)
    return params


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """SpecForge's rule: position `a` may anchor a block when `loss_mask[a]` and `loss_mask[a + 1]` (`a < S − 1`).
    Returns a bool `[B, S]` (the last column is always False)."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    return valid


def all_anchors(loss_mask: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every valid anchor of each sequence, sorted, when there are at most `limit` (what draftpipe and SpecForge
    draw then, whatever the seed); padded with position 0 and `keep = False`. Returns `(anchors, keep)`, `[B, N]`."""
    valid = valid_anchors(loss_mask)
    counts = valid.sum(dim=1)
    if int(counts.max()) > limit:
        raise ValueError(f"{int(counts.max())} valid anchors in a sequence, more than anchors = {limit}")
    n = max(int(counts.max()), 1)
    anchors = torch.zeros(loss_mask.shape[0], n, dtype=torch.long)
    keep = torch.zeros(loss_mask.shape[0], n, dtype=torch.bool)
    for b in range(loss_mask.shape[0]):
        positions = torch.nonzero(valid[b]).flatten()
        anchors[b, : len(positions)] = positions
        keep[b, : len(positions)] = True
    return anchors, keep


def dflash_loss(
    d: Dims,
    params: dict[str, torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's loss Σ w·CE / Σ w, and per slot the correct and counted predictions (for accuracy).

    `hidden_states` `[B, S, taps·H]`, `input_ids`/`loss_mask` `[B, S]`, `anchors`/`keep` `[B, N]`."""
    bsz, seq_len = input_ids.shape
    n, blk = anchors.shape[1], d.block
    slots = torch.arange(blk)
    block_ids = torch.full((bsz, n, blk), d.mask_token, dtype=torch.long)
    block_ids[:, :, 0] = torch.where(keep, torch.gather(input_ids, 1, anchors), d.mask_token)
    block_positions = (anchors[:, :, None] + slots).reshape(bsz, n * blk)
    context_positions = torch.arange(seq_len).expand(bsz, seq_len)
    x = draft_hidden(d, params, hidden_states, embed[block_ids.reshape(bsz, n * blk)], context_positions,
                     block_positions, dflash_mask(anchors, seq_len, blk))
    logits = x @ lm_head.T  # [B, N·blk, V]

    label_pos = anchors[:, :, None] + slots  # [B, N, blk]
    in_range = label_pos < seq_len
    safe = label_pos.clamp(max=seq_len - 1).reshape(bsz, n * blk)
    labels = torch.gather(input_ids, 1, safe).view(bsz, n, blk)
    label_mask = torch.gather(loss_mask, 1, safe).view(bsz, n, blk) > 0
    counted = keep[:, :, None] & in_range & label_mask & (slots > 0)
    if d.position_decay is None:
        decay = torch.ones(blk, dtype=logits.dtype)
    else:
        decay = torch.exp(-(slots - 1).clamp(min=0).to(logits.dtype) / d.position_decay)
    weights = counted.to(logits.dtype) * decay
    ce = F.cross_entropy(logits.reshape(-1, d.vocab), labels.reshape(-1), reduction="none").view(bsz, n, blk)
    loss = (ce * weights).sum() / weights.sum()
    correct = ((logits.detach().argmax(dim=-1).view(bsz, n, blk) == labels) & counted).sum(dim=(0, 1))
    return loss, correct, counted.sum(dim=(0, 1))


def schedule_factor(kind: str, warmup: int, total: int, applied: int) -> float:
    """Hugging Face's `get_{constant,linear,cosine}_schedule_with_warmup` at `applied` steps (Contract 2)."""
    if applied < warmup:
        return applied / max(1, warmup)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, (total - applied) / max(1, total - warmup))
    progress = (applied - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
