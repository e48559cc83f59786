"""The DFlash training step in plain PyTorch, as SpecForge trains it, for draftpipe's parity test and benchmark.

Shared by `dflash_parity.py` (3 AdamW steps against `draftpipe run --init … --save …`, weight by weight) and
`dflash_bench.py` (the eager CPU step against draftpipe's). Written from SpecForge's
`specforge/algorithms/common/dflash_family_model.py` (anchors, blocks, dense mask, decayed loss) and z-lab's
`dflash/model.py` (the drafter: `fc` + `hidden_norm` on the context, Qwen3 layers whose keys and values are the
context's projections followed by the block's, a final `norm`, the target's frozen `lm_head`); attention is
`torch.nn.functional.scaled_dot_product_attention` with a dense boolean mask, as SpecForge's `sdpa` backend.

Parameters are a dict name -> tensor under z-lab's names (the names of draftpipe's `model.safetensors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    h, hd, i = d.hidden, d.head_dim, d.intermediate
    q, kv = d.heads * hd, d.kv_heads * hd
    out = [("fc.weight", (h, d.taps * h)), ("hidden_norm.weight", (h,))]
    for layer in range(d.layers):
        p = f"layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    out.append(("norm.weight", (h,)))
    return out


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's rotary embedding (`rotate_half`: pairs `(j, j + hd/2)`), `x` `[B, T, heads, hd]`,
    `positions` `[B, T]`."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def dflash_mask(anchors: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """The dense DFlash mask `[B, 1, N·block, S + N·block]` (True = may attend): a query of block `j` sees the
    context keys strictly before its anchor and every slot of its own block (SpecForge's
    `create_dflash_sdpa_mask`). Padding blocks keep their own block, so no row is empty; their loss weight is 0."""
    b, n = anchors.shape
    q_block = torch.arange(n * block) // block
    kv = torch.arange(seq_len + n * block)
    anchor_of_query = anchors[:, q_block]  # [B, Q]
    context = (kv[None, None, :] < seq_len) & (kv[None, None, :] < anchor_of_query[:, :, None])
    own_block = (kv[None, None, :] >= seq_len) & (((kv - seq_len) // block)[None, None, :] == q_block[None, :, None])
    return (context | own_block)[:, None, :, :]


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
    n, blk, hd = anchors.shape[1], d.block, d.head_dim
    eps = d.rms_norm_eps
    context = rms_norm(hidden_states @ params["fc.weight"].T, params["hidden_norm.weight"], eps)

    slots = torch.arange(blk)
    block_ids = torch.full((bsz, n, blk), d.mask_token, dtype=torch.long)
    block_ids[:, :, 0] = torch.where(keep, torch.gather(input_ids, 1, anchors), d.mask_token)
    x = embed[block_ids.reshape(bsz, n * blk)]
    block_positions = (anchors[:, :, None] + slots).reshape(bsz, n * blk)
    context_positions = torch.arange(seq_len).expand(bsz, seq_len)
    all_positions = torch.cat([context_positions, block_positions], dim=1)
    mask = dflash_mask(anchors, seq_len, blk)
    groups = d.heads // d.kv_heads

    for layer in range(d.layers):
        p = f"layers.{layer}"
        w = lambda name: params[f"{p}.{name}.weight"]  # noqa: E731
        h = rms_norm(x, w("input_layernorm"), eps)
        q = (h @ w("self_attn.q_proj").T).view(bsz, n * blk, d.heads, hd)
        k = torch.cat([context @ w("self_attn.k_proj").T, h @ w("self_attn.k_proj").T], dim=1)
        v = torch.cat([context @ w("self_attn.v_proj").T, h @ w("self_attn.v_proj").T], dim=1)
        k = k.view(bsz, seq_len + n * blk, d.kv_heads, hd)
        v = v.view(bsz, seq_len + n * blk, d.kv_heads, hd)
        q = rope(rms_norm(q, w("self_attn.q_norm"), eps), block_positions, d.rope_theta)
        k = rope(rms_norm(k, w("self_attn.k_norm"), eps), all_positions, d.rope_theta)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)
        x = x + attn.transpose(1, 2).reshape(bsz, n * blk, d.heads * hd) @ w("self_attn.o_proj").T
        h = rms_norm(x, w("post_attention_layernorm"), eps)
        x = x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T

    logits = rms_norm(x, params["norm.weight"], eps) @ lm_head.T  # [B, N·blk, V]

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
