"""The DFlash drafter in PyTorch, read from the directory ``draftpipe run --save`` exports.

The one PyTorch definition of the drafter in the project: ``speculative`` drafts with it, and
``scripts/dflash_reference.py`` (the training step ``scripts/dflash_parity.py`` checks draftpipe against) builds
its loss on it. Written from the published architecture (z-lab's DFlash; SpecForge's training forward) under the
export's tensor names (``docs/serving.md``): the target's tapped hidden states, concatenated per token, go through
``fc`` and ``hidden_norm`` into context features; each block row starts as the target's (frozen) embedding of its
token; every layer is a Qwen3 layer whose queries come from the block rows and whose keys and values are the
layer's projections of the context features followed by those of the block rows (``k_norm`` and RoPE on both, no
norm on values); attention is not causal, restricted by a mask; a final ``norm``, then the target's ``lm_head``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ._producer import DraftpipeError


class DrafterError(DraftpipeError):
    """An exported drafter directory that cannot be read: a missing file, a config key, a tensor's name or shape."""


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter's dimensions, from the export's ``config.json`` (``docs/serving.md`` lists the keys)."""

    hidden: int
    taps: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block: int
    mask_token: int
    target_layer_ids: tuple[int, ...]
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def from_json(cls, config: Mapping[str, Any], where: str) -> "DrafterConfig":
        """The config of an exported drafter's ``config.json`` (``where`` names it in errors)."""

        def key(name: str) -> Any:
            node: Any = config
            for part in name.split("."):
                if not isinstance(node, Mapping) or part not in node:
                    raise DrafterError(f"{where}: `{name}` is missing")
                node = node[part]
            return node

        layer_ids = key("dflash_config.target_layer_ids")
        if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) for i in layer_ids):
            raise DrafterError(f"{where}: `dflash_config.target_layer_ids` is {layer_ids!r}, expected a list of ints")
        return cls(
            hidden=int(key("hidden_size")), taps=len(layer_ids), vocab=int(key("vocab_size")),
            layers=int(key("num_hidden_layers")), heads=int(key("num_attention_heads")),
            kv_heads=int(key("num_key_value_heads")), head_dim=int(key("head_dim")),
            intermediate=int(key("intermediate_size")), block=int(key("block_size")),
            mask_token=int(key("dflash_config.mask_token_id")), target_layer_ids=tuple(layer_ids),
            rope_theta=float(key("rope_theta")), rms_norm_eps=float(key("rms_norm_eps")),
        )


def tensor_shapes(d: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The trained tensors in draftpipe's layout order under z-lab's names, PyTorch ``[out, in]`` shapes.
    ``d`` has ``hidden``, ``taps``, ``layers``, ``heads``, ``kv_heads``, ``head_dim``, ``intermediate``."""
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's rotary embedding (``rotate_half``: pairs ``(j, j + hd/2)``), ``x`` ``[B, T, heads, hd]``,
    ``positions`` ``[B, T]``."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def dflash_mask(anchors: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """The dense DFlash mask ``[B, 1, N·block, S + N·block]`` (True = may attend) for ``N`` blocks per sequence at
    ``anchors`` ``[B, N]``: a query of block ``j`` sees the context keys strictly before its anchor and every slot of
    its own block (SpecForge's ``create_dflash_sdpa_mask``)."""
    b, n = anchors.shape
    q_block = torch.arange(n * block) // block
    kv = torch.arange(seq_len + n * block)
    anchor_of_query = anchors[:, q_block]  # [B, Q]
    context = (kv[None, None, :] < seq_len) & (kv[None, None, :] < anchor_of_query[:, :, None])
    own_block = (kv[None, None, :] >= seq_len) & (((kv - seq_len) // block)[None, None, :] == q_block[None, :, None])
    return (context | own_block)[:, None, :, :]


def draft_hidden(
    d: Any,
    params: Mapping[str, torch.Tensor],
    target_hidden: torch.Tensor,
    block_embeddings: torch.Tensor,
    context_positions: torch.Tensor,
    block_positions: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The drafter's final hidden states of the block rows, ``[B, Q, H]`` (``@ lm_head.T`` gives the logits).

    ``target_hidden`` ``[B, S, taps·H]`` (the tapped layers concatenated per token), ``block_embeddings``
    ``[B, Q, H]``, positions ``[B, S]`` and ``[B, Q]`` (RoPE), ``mask`` ``[B, 1, Q, S + Q]`` or ``None`` when every
    block row sees every context row and every block row (one block drafted after the whole context)."""
    bsz, seq_len = target_hidden.shape[:2]
    q_len, hd, eps = block_embeddings.shape[1], d.head_dim, d.rms_norm_eps
    context = rms_norm(target_hidden @ params["fc.weight"].T, params["hidden_norm.weight"], eps)
    all_positions = torch.cat([context_positions, block_positions], dim=1)
    groups = d.heads // d.kv_heads
    x = block_embeddings
    for layer in range(d.layers):
        p = f"layers.{layer}"

        def w(name: str) -> torch.Tensor:
            return params[f"{p}.{name}.weight"]

        h = rms_norm(x, w("input_layernorm"), eps)
        q = (h @ w("self_attn.q_proj").T).view(bsz, q_len, d.heads, hd)
        k = torch.cat([context @ w("self_attn.k_proj").T, h @ w("self_attn.k_proj").T], dim=1)
        v = torch.cat([context @ w("self_attn.v_proj").T, h @ w("self_attn.v_proj").T], dim=1)
        k = k.view(bsz, seq_len + q_len, d.kv_heads, hd)
        v = v.view(bsz, seq_len + q_len, d.kv_heads, hd)
        q = rope(rms_norm(q, w("self_attn.q_norm"), eps), block_positions, d.rope_theta)
        k = rope(rms_norm(k, w("self_attn.k_norm"), eps), all_positions, d.rope_theta)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)
        x = x + attn.transpose(1, 2).reshape(bsz, q_len, d.heads * hd) @ w("self_attn.o_proj").T
        h = rms_norm(x, w("post_attention_layernorm"), eps)
        x = x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    return rms_norm(x, params["norm.weight"], eps)


@dataclass
class Drafter:
    """An exported drafter: its config and its tensors (widened to ``dtype``)."""

    config: DrafterConfig
    params: dict[str, torch.Tensor]

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "Drafter":
        """Reads ``config.json`` and ``model.safetensors`` (the engine-facing files of an export); every tensor the
        config implies must be there with its shape, and no other (an engine would skip it silently)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path, weights_path = directory / "config.json", directory / "model.safetensors"
        for path in (config_path, weights_path):
            if not path.is_file():
                raise DrafterError(f"{path}: not found (is {directory} a `draftpipe run --save` export?)")
        try:
            config_json = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise DrafterError(f"{config_path}:{error.lineno}:{error.colno}: {error.msg}") from None
        config = DrafterConfig.from_json(config_json, str(config_path))
        tensors = load_file(str(weights_path))
        expected = dict(tensor_shapes(config))
        for name, shape in expected.items():
            if name not in tensors:
                raise DrafterError(f"{weights_path}: tensor `{name}` is missing")
            if tuple(tensors[name].shape) != shape:
                raise DrafterError(f"{weights_path}: tensor `{name}` has shape {list(tensors[name].shape)}, "
                                   f"the config gives {list(shape)}")
        unknown = sorted(set(tensors) - set(expected))
        if unknown:
            raise DrafterError(f"{weights_path}: tensors the config does not account for: {', '.join(unknown[:5])}")
        return cls(config, {name: tensors[name].to(dtype) for name in expected})

    def hidden(
        self,
        target_hidden: torch.Tensor,
        block_embeddings: torch.Tensor,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``draft_hidden`` with this drafter's config and weights."""
        return draft_hidden(self.config, self.params, target_hidden, block_embeddings, context_positions,
                            block_positions, mask)
