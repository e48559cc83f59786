"""The EAGLE-3 training step in plain PyTorch, as SpecForge's offline path trains it, for draftpipe's parity test.

Used by `eagle3_parity.py` (3 AdamW steps against `draftpipe run --init … --save …`, weight by weight). Written
from issue 22's EAGLE-3 semantics and SpecForge's code, read for each rule:

- `specforge/modeling/target/target_head.py`: the teacher's hidden states and the input ids are shifted left by
  one position once, up front (`padding(…, left=False)`: zeros enter at the end); the loss mask is not.
- `specforge/core/compact_teacher.py` (`compute_target_from_hidden`, the offline teacher from the target's last
  hidden states): logits = hidden · lm_headᵀ over the full vocabulary in f32; a row counts when its loss mask is
  set and the full-vocabulary argmax (lowest index on ties) is a draft token (`t2d[argmax]`); the target
  distribution is the softmax of the logits of the draft tokens only, i.e. renormalised over the draft vocabulary.
- `specforge/algorithms/eagle3/model.py` (`OnlineEagle3Model.forward`): step 0's `h` is `fc(hidden_states)`;
  each TTT step runs the one decoder layer, takes the logits of the draft's own head on `norm(h)`, and feeds the
  layer's output (before the final norm, not detached) to the next step; after each step the ids, the loss mask
  and the supervised-row mask move left by one more position (zeros at the end), and step k reads the teacher at
  row t + k.
- `specforge/modeling/draft/llama3_eagle.py` (`LlamaDecoderLayer`, `LlamaAttention` with `cache_hidden`): the
  layer's input is `cat(input_layernorm(embed(ids)), hidden_norm(h))` (embedding first), q/k/v read that 2H-wide
  row, the residual is h; step k's queries and keys take RoPE position t + k (`position_ids + lck`) and the keys
  are cached with it; a query sees step 0's keys causally and, of each later step's keys, only its own row's
  (`(q · k_j).sum(-1)`); one softmax over the concatenation in f32; GQA by `repeat_kv`; RMSNorm eps 1e-6; the MLP
  is SwiGLU (`silu(gate) · up`, then `down`).
- `specforge/core/loss.py` (`LogSoftmaxLoss`): a step's loss is `−Σ mask · Σ p log q` over every row of the
  batch divided by B · S (padding rows included); `specforge/training/strategies/base.py`: the total is
  `Σ_k ploss_decay^k · loss_k` (`ploss_decay = 0.8`), not renormalised.

Parameters are a dict name → tensor under SGLang's `LlamaForCausalLMEagle3` names (the names of draftpipe's
`model.safetensors`). Everything runs in the dtype of the inputs (f64 for the reference, f32 to measure what
f32 rounding alone does); the softmaxes run in that dtype too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Dims:
    """An eagle3 drafter's dimensions, as the `.pipe` file's `eagle3(...)`, loss and target section give them."""

    hidden: int
    taps: int
    vocab: int
    draft_vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    ttt: int
    rope_theta: float
    step_decay: float = 0.8
    rms_norm_eps: float = 1e-6


def shapes(d: Dims) -> list[tuple[str, tuple[int, ...]]]:
    """The trained tensors in draftpipe's layout order, PyTorch `[out, in]` shapes (the export's names)."""
    h, q, kv, i = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.intermediate
    return [
        ("fc.weight", (h, d.taps * h)),
        ("midlayer.input_layernorm.weight", (h,)),
        ("midlayer.hidden_norm.weight", (h,)),
        ("midlayer.self_attn.q_proj.weight", (q, 2 * h)),
        ("midlayer.self_attn.k_proj.weight", (kv, 2 * h)),
        ("midlayer.self_attn.v_proj.weight", (kv, 2 * h)),
        ("midlayer.self_attn.o_proj.weight", (h, q)),
        ("midlayer.post_attention_layernorm.weight", (h,)),
        ("midlayer.mlp.gate_proj.weight", (i, h)),
        ("midlayer.mlp.up_proj.weight", (i, h)),
        ("midlayer.mlp.down_proj.weight", (h, i)),
        ("norm.weight", (h,)),
        ("lm_head.weight", (d.draft_vocab, h)),
    ]


def random_params(d: Dims, generator: torch.Generator, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Weights with every tensor away from its usual initial value (norms near 1, matrices ~ N(0, 1/fan_in)), so
    the parity test exercises each one."""
    params = {}
    for name, shape in shapes(d):
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
        else:
            t = torch.randn(shape, generator=generator, dtype=torch.float64) / math.sqrt(shape[1])
        params[name] = t.to(dtype)
    return params


def shift_left(x: torch.Tensor, by: int) -> torch.Tensor:
    """`x` (`[B, S, …]`) moved left by `by` positions along dim 1, zeros entering at the end (SpecForge's
    `padding(x, left=False)` applied `by` times)."""
    if by == 0:
        return x
    return torch.cat((x[:, by:], torch.zeros_like(x[:, :by])), dim=1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's rotary embedding (`rotate_half` pairing `(j, j + head_dim/2)`) of `x` `[B, heads, S, hd]`
    at `positions` `[S]`."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rotated = torch.cat((-x[..., hd // 2 :], x[..., : hd // 2]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class Teacher:
    """The teacher of a batch before the per-step shifts: `p` `[B, S, Vd]` the target distribution renormalised
    over the draft vocabulary, `supervised` `[B, S]` (loss mask · argmax-in-draft-vocabulary), `token` `[B, S]`
    the full-vocabulary argmax (what an accurate draft predicts)."""

    p: torch.Tensor
    supervised: torch.Tensor
    token: torch.Tensor


def teacher(
    last_hidden_states: torch.Tensor,
    target_lm_head: torch.Tensor,
    t2d: torch.Tensor,
    loss_mask: torch.Tensor,
    renormalise: bool = True,
) -> Teacher:
    """SpecForge's offline teacher from the target's final hidden states, shifted left by one position once.

    `renormalise = False` is a deliberate mistake the parity check must reject (the target's full-vocabulary
    probabilities of the draft tokens, not renormalised over them)."""
    shifted = shift_left(last_hidden_states, 1)
    logits = shifted @ target_lm_head.T  # [B, S, V]
    token = logits.argmax(dim=-1)
    supervised = (loss_mask > 0) & t2d[token]
    draft_logits = logits[..., t2d]
    if renormalise:
        p = torch.softmax(draft_logits, dim=-1)
    else:
        p = torch.exp(draft_logits - torch.logsumexp(logits, dim=-1, keepdim=True))
    return Teacher(p=p.detach(), supervised=supervised, token=token)


def unroll_attention(
    d: Dims,
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    diagonal: bool = True,
) -> torch.Tensor:
    """Step k's attention (`k = len(keys) − 1`): `q` `[B, heads, S, hd]`; `keys`/`values` every step's so far,
    `[B, heads, S, hd]` (kv heads repeated). Step 0's keys are seen causally, each later step's only at the
    query's own row; one softmax over the concatenation. `diagonal = False` is a deliberate mistake the parity
    check must reject (a cached step's keys seen causally like step 0's)."""
    seq = q.shape[2]
    scale = 1.0 / math.sqrt(d.head_dim)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = [(q @ keys[0].transpose(2, 3) * scale).masked_fill(~causal, float("-inf"))]
    for cached in keys[1:]:
        if diagonal:
            scores.append(((q * cached).sum(-1) * scale)[..., None])
        else:
            scores.append((q @ cached.transpose(2, 3) * scale).masked_fill(~causal, float("-inf")))
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :seq] @ values[0]
    at = seq
    for cached in values[1:]:
        if diagonal:
            out = out + weights[..., at : at + 1] * cached
            at += 1
        else:
            out = out + weights[..., at : at + seq] @ cached
            at += seq
    return out


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """`[B, kv_heads, S, hd]` → `[B, kv_heads · groups, S, hd]`, query head `h` reading kv head `h / groups`."""
    return x.repeat_interleave(groups, dim=1)


@dataclass
class Eagle3Loss:
    """A batch's loss `Σ_k decay^k · loss_k`, and per TTT step the rows whose draft argmax is the target's
    (`correct`) among those the shifted loss mask counts (`supervised`): SpecForge's accuracy."""

    loss: torch.Tensor
    correct: list[int]
    supervised: list[int]


def eagle3_loss(
    d: Dims,
    params: dict[str, torch.Tensor],
    embed: torch.Tensor,
    target_lm_head: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    hidden_states: torch.Tensor,
    last_hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    step_decay: float | None = None,
    diagonal: bool = True,
    renormalise: bool = True,
) -> Eagle3Loss:
    """SpecForge's offline EAGLE-3 loss of one batch: `hidden_states` `[B, S, taps·H]`, `last_hidden_states`
    `[B, S, H]`, `input_ids`/`loss_mask` `[B, S]`; `t2d` bool `[V]`, `d2t` int `[Vd]` (draft token `i` is target
    token `i + d2t[i]`). `step_decay`, `diagonal` and `renormalise` exist to plant the parity check's deliberate
    mistakes."""
    decay = d.step_decay if step_decay is None else step_decay
    bsz, seq, _ = hidden_states.shape
    groups = d.heads // d.kv_heads
    eps = d.rms_norm_eps
    w = params
    prefix = "midlayer."
    teach = teacher(last_hidden_states, target_lm_head, t2d, loss_mask, renormalise)
    ids = shift_left(input_ids, 1)
    h = hidden_states @ w["fc.weight"].T
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = torch.zeros((), dtype=hidden_states.dtype)
    correct, supervised = [], []
    for k in range(d.ttt):
        e = embed[shift_left(ids, k)]
        embedded = rms_norm(e, w[prefix + "input_layernorm.weight"], eps)
        c = torch.cat((embedded, rms_norm(h, w[prefix + "hidden_norm.weight"], eps)), dim=-1)
        positions = torch.arange(seq) + k

        def project(name: str, heads: int) -> torch.Tensor:
            out = c @ w[f"{prefix}self_attn.{name}.weight"].T
            return out.view(bsz, seq, heads, d.head_dim).transpose(1, 2)

        q = rope(project("q_proj", d.heads), positions, d.rope_theta)
        keys.append(repeat_kv(rope(project("k_proj", d.kv_heads), positions, d.rope_theta), groups))
        values.append(repeat_kv(project("v_proj", d.kv_heads), groups))
        a = unroll_attention(d, q, keys, values, diagonal).transpose(1, 2).reshape(bsz, seq, d.heads * d.head_dim)
        m = h + a @ w[prefix + "self_attn.o_proj.weight"].T
        x = rms_norm(m, w[prefix + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(x @ w[prefix + "mlp.gate_proj.weight"].T) * (x @ w[prefix + "mlp.up_proj.weight"].T)
        h = m + mlp @ w[prefix + "mlp.down_proj.weight"].T

        logits = rms_norm(h, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [B, S, Vd]
        mask = shift_left(teach.supervised, k).to(logits.dtype)
        p = shift_left(teach.p, k)
        step_loss = -(mask * (p * torch.log_softmax(logits, dim=-1)).sum(-1)).sum() / (bsz * seq)
        total = total + decay**k * step_loss
        with torch.no_grad():
            draft_token = logits.argmax(-1)
            predicted = draft_token + d2t[draft_token]
            counted = shift_left(loss_mask, k) > 0
            correct.append(int(((predicted == shift_left(teach.token, k)) & counted).sum()))
            supervised.append(int(counted.sum()))
    return Eagle3Loss(loss=total, correct=correct, supervised=supervised)
