"""Does the drafter speed up decoding? Greedy speculative decoding with an exported DFlash drafter against its
target, as SGLang's DFlash worker (and z-lab's ``spec_generate``) runs it, beside the training's measure.

    python -m draftpipe_client.speculative --draft EXPORT_DIR --target MODEL_DIR --prompts prompts.jsonl \\
        --max-new-tokens 64

One prefill forward of the target gives its first token and the context features (the hidden states of the
export's ``target_layer_ids``, i.e. ``hidden_states[id + 1]``, concatenated per token). Then, until the budget or
the end-of-turn token: a block of ``block_size`` slots at positions ``start .. start + block_size − 1`` holds the
last accepted token (the target's bonus token, not yet verified into the target's cache) and ``mask_token_id``
in every other slot; the drafter drafts slots ``1 ..`` in one forward over the context features of every
position before ``start``; the target verifies the whole block in one forward (its KV cache holds the accepted
tokens); the drafted tokens are accepted while each equals the target's argmax at the slot before it, and the
target's argmax after the last accepted one is the bonus token that starts the next block. The target's cache
and the context features keep the accepted tokens only.

The output must equal the target's own greedy decode (``generate(do_sample=False)``) token for token: when it
does not, the loop is wrong and the command fails. It reports τ (the mean accepted length per verifying target
forward, the bonus token counted), acceptance per block position, the target forwards per generated token
against plain decoding (one per token), and the teacher-forced τ of the same drafter on the same sequences (the
prompt and the target's greedy continuation): per-slot accuracy over every anchor in the continuation and
``1 + Σ_k Π_{j≤k} acc_j``, the measure draftpipe's training reports. The train/serve gap is their ratio. It
also checks that each block the loop drafted equals the teacher-forced drafter's block at the same anchor (a
mismatch means the loop feeds the drafter differently from the training).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, cast

import torch

from ._producer import DraftpipeError
from .drafter import Drafter, dflash_mask

#: Logits within this margin of the maximum count as a tie when two ways of computing the same draft disagree on
#: the argmax (float rounding, not a different input).
TIE_MARGIN = 1e-4


class SpeculativeError(DraftpipeError):
    """The loop's output differs from the target's greedy decode, its drafts from the teacher-forced drafts, or
    the drafter does not fit the target."""


def block_positions(start: int, block: int) -> torch.Tensor:
    """RoPE positions of a block's slots: the block's first slot sits at the position of the last accepted token."""
    return torch.arange(start, start + block)[None, :]


def accepted_drafts(drafted: torch.Tensor, posterior: torch.Tensor) -> int:
    """How many drafted tokens (slots ``1 ..``) the target accepts: the longest prefix where each equals the
    target's argmax at the slot before it (``posterior[k − 1]`` predicts slot ``k``)."""
    agree = (drafted[1:] == posterior[:-1]).to(torch.long)
    return int(agree.cumprod(dim=0).sum())


def bonus_token(posterior: torch.Tensor, accepted: int) -> int:
    """The target's own token after the accepted drafts: its argmax at the last accepted slot."""
    return int(posterior[accepted])


def context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """The drafter's context input: ``hidden_states[id + 1]`` (entry 0 is the embeddings) of each target layer id,
    concatenated per token (z-lab's ``extract_context_feature``)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@dataclass
class Decode:
    """One prompt's speculative decode: the generated tokens, the accepted length of each verifying forward, and
    the blocks drafted (their start position and drafted tokens, slot 1 onward)."""

    tokens: list[int]
    accepted: list[int]
    blocks: list[tuple[int, list[int]]] = field(default_factory=list)


class SpeculativeDecoder:
    """A target (``transformers`` causal LM) and an exported drafter, checked against each other."""

    def __init__(self, target: Any, drafter: Drafter):
        self.target, self.drafter = target, drafter
        cfg, tcfg = drafter.config, target.config
        self.embed = target.get_input_embeddings().weight.detach()
        self.lm_head = target.get_output_embeddings().weight.detach()
        problems = []
        if cfg.hidden != tcfg.hidden_size:
            problems.append(f"hidden_size {cfg.hidden} (target {tcfg.hidden_size})")
        if cfg.vocab != self.embed.shape[0]:
            problems.append(f"vocab_size {cfg.vocab} (target {self.embed.shape[0]})")
        if not 0 <= cfg.mask_token < self.embed.shape[0]:
            problems.append(f"mask_token_id {cfg.mask_token} outside the target's vocabulary")
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < tcfg.num_hidden_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {tcfg.num_hidden_layers} layers")
        if problems:
            raise SpeculativeError("the drafter does not fit the target: " + "; ".join(problems))
        # transformers 5.x names the forward's cache argument `cache`; earlier versions `past_key_values`.
        parameters = inspect.signature(target.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    def _draft(self, features: torch.Tensor, start: int, bonus: int) -> torch.Tensor:
        """The block at ``start``: ``bonus`` then the drafter's argmax in every other slot."""
        cfg = self.drafter.config
        block = torch.full((cfg.block,), cfg.mask_token, dtype=torch.long)
        block[0] = bonus
        hidden = self.drafter.hidden(features[:, :start], self.embed[block][None], torch.arange(start)[None],
                                     block_positions(start, cfg.block))
        block[1:] = (hidden[0, 1:] @ self.lm_head.T).argmax(dim=-1)
        return block

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None) -> Decode:
        """Greedy speculative decoding of ``prompt`` (token ids) for up to ``max_new_tokens`` tokens, stopping after
        ``eos``."""
        from transformers import DynamicCache

        cfg = self.drafter.config
        cache = DynamicCache()
        ids = torch.tensor([list(prompt)])
        out = self.target(input_ids=ids, use_cache=True, output_hidden_states=True, **{self._cache_arg: cache})
        features = context_features(out.hidden_states, cfg.target_layer_ids).to(self.embed.dtype)
        bonus = int(out.logits[0, -1].argmax())
        result = Decode(tokens=[bonus], accepted=[])
        start = ids.shape[1]  # the position of `bonus`
        while len(result.tokens) < max_new_tokens and bonus != eos:
            block = self._draft(features, start, bonus)
            result.blocks.append((start, block[1:].tolist()))
            out = self.target(input_ids=block[None], position_ids=block_positions(start, cfg.block),
                              use_cache=True, output_hidden_states=True, **{self._cache_arg: cache})
            posterior = out.logits[0].argmax(dim=-1)
            accepted = accepted_drafts(block, posterior)
            bonus = bonus_token(posterior, accepted)
            result.tokens += block[1 : accepted + 1].tolist() + [bonus]
            result.accepted.append(accepted + 1)
            new = context_features(out.hidden_states, cfg.target_layer_ids)[:, : accepted + 1]
            features = torch.cat([features, new.to(features.dtype)], dim=1)
            start += accepted + 1
            rejected = cache.get_seq_length() - start
            if rejected:
                cache.crop(-rejected)  # a negative count removes that many (every transformers version)
        result.tokens = _until_eos(result.tokens, eos)[:max_new_tokens]
        return result

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def greedy(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None) -> list[int]:
        """The target's own greedy decode (``generate(do_sample=False)``), the tokens after the prompt."""
        ids = torch.tensor([list(prompt)])
        out = self.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                                   min_new_tokens=0)
        return cast("list[int]", out[0, ids.shape[1] :].tolist())

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def teacher_forced(self, prompt: Sequence[int], continuation: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The drafter as training scores it on ``prompt + continuation``: a block at every anchor ``a`` in the
        continuation with a label at ``a + 1`` (context features of the whole sequence from one target forward,
        the training's mask). Returns ``(anchors, drafted tokens [N, block − 1], correct [N, block − 1],
        counted [N, block − 1], logits [N, block − 1, V])``."""
        cfg = self.drafter.config
        seq = torch.tensor([list(prompt) + list(continuation)])
        seq_len, p = seq.shape[1], len(prompt)
        anchors = torch.arange(p, seq_len - 1)
        if len(anchors) == 0:
            empty = torch.zeros((0, cfg.block - 1), dtype=torch.long)
            return anchors, empty, empty.bool(), empty.bool(), torch.zeros((0, cfg.block - 1, cfg.vocab))
        out = self.target(input_ids=seq, output_hidden_states=True)
        features = context_features(out.hidden_states, cfg.target_layer_ids).to(self.embed.dtype)
        slots = torch.arange(cfg.block)
        block_ids = torch.full((len(anchors), cfg.block), cfg.mask_token, dtype=torch.long)
        block_ids[:, 0] = seq[0, anchors]
        positions = (anchors[:, None] + slots).reshape(1, -1)
        hidden = self.drafter.hidden(features, self.embed[block_ids.reshape(1, -1)], torch.arange(seq_len)[None],
                                     positions, dflash_mask(anchors[None], seq_len, cfg.block))
        logits = (hidden[0] @ self.lm_head.T).view(len(anchors), cfg.block, -1)[:, 1:]
        label_pos = anchors[:, None] + slots[1:]
        counted = label_pos < seq_len
        labels = seq[0, label_pos.clamp(max=seq_len - 1)]
        drafted = logits.argmax(dim=-1)
        return anchors, drafted, (drafted == labels) & counted, counted, logits


def _until_eos(tokens: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    return tokens


@dataclass
class Report:
    """The figures over every prompt."""

    block: int
    prompts: int = 0
    generated: int = 0
    verify_forwards: int = 0
    accepted: list[int] = field(default_factory=list)
    tf_correct: torch.Tensor | None = None
    tf_counted: torch.Tensor | None = None
    tf_accepted: int = 0
    tf_blocks: int = 0
    draft_mismatches: int = 0
    blocks_compared: int = 0

    @property
    def tau(self) -> float:
        """Mean accepted length per verifying target forward (the bonus token counted)."""
        return sum(self.accepted) / max(len(self.accepted), 1)

    def acceptance_by_position(self) -> list[float]:
        """Per drafted slot ``k`` (1 ..), the share of blocks whose slot ``k`` was accepted."""
        n = max(len(self.accepted), 1)
        return [sum(a - 1 >= k for a in self.accepted) / n for k in range(1, self.block)]

    def slot_accuracy(self) -> list[float]:
        """Teacher-forced accuracy per drafted slot (1 ..)."""
        correct, counted = cast(torch.Tensor, self.tf_correct), cast(torch.Tensor, self.tf_counted)
        return cast("list[float]", (correct.double() / counted.double().clamp(min=1)).tolist())

    def add_teacher_forced(self, correct: torch.Tensor, counted: torch.Tensor) -> None:
        """Adds one sequence's teacher-forced blocks (``correct`` and ``counted`` ``[N, block − 1]``): the
        per-slot counts, and per block the drafted prefix that matches the labels (the first miss or the first
        slot without a label ends it) over the blocks labelled at their first drafted slot."""
        self.tf_correct += correct.sum(dim=0)
        self.tf_counted += counted.sum(dim=0)
        self.tf_accepted += int(correct.long().cumprod(dim=1).sum())
        self.tf_blocks += int(counted[:, 0].sum()) if counted.shape[1] else 0

    @property
    def teacher_forced_tau_exact(self) -> float:
        """The exact teacher-forced acceptance length: ``1 + Σ_blocks accepted prefix / blocks``."""
        return 1.0 + self.tf_accepted / self.tf_blocks if self.tf_blocks else 1.0

    @property
    def teacher_forced_tau_simulated(self) -> float:
        """``1 + Σ_k Π_{j≤k} acc_j``, SpecForge's simulated τ from per-slot accuracy."""
        tau, chain = 1.0, 1.0
        for acc in self.slot_accuracy():
            chain *= acc
            tau += chain
        return tau

    @property
    def forwards_per_token(self) -> float:
        """Target forwards (the prefill and every verify) per generated token; plain decoding needs 1."""
        return (self.prompts + self.verify_forwards) / max(self.generated, 1)

    def as_dict(self) -> dict[str, Any]:
        """The figures as JSON-ready values (what ``--json`` writes)."""
        return {
            "prompts": self.prompts, "generated_tokens": self.generated, "block_size": self.block,
            "verify_forwards": self.verify_forwards, "tau": self.tau,
            "acceptance_by_position": self.acceptance_by_position(),
            "target_forwards_per_token": self.forwards_per_token, "plain_forwards_per_token": 1.0,
            "teacher_forced_tau_exact": self.teacher_forced_tau_exact,
            "teacher_forced_tau_simulated": self.teacher_forced_tau_simulated,
            "teacher_forced_slot_accuracy": self.slot_accuracy(),
            "gap": 1.0 - self.tau / self.teacher_forced_tau_simulated,
            "blocks_compared": self.blocks_compared, "draft_mismatches": self.draft_mismatches,
        }

    def lines(self) -> list[str]:
        positions = " ".join(f"{k}:{a:.2f}" for k, a in enumerate(self.acceptance_by_position(), 1))
        slots = " ".join(f"{a:.2f}" for a in self.slot_accuracy())
        fpt = self.forwards_per_token
        return [
            f"{self.prompts} prompts, {self.generated} tokens generated, every one equal to the target's greedy "
            "decode",
            f"tau {self.tau:.3f} (mean accepted length per target forward, block {self.block}, "
            f"{self.verify_forwards} verify forwards)",
            f"acceptance by position {positions}",
            f"target forwards per token {fpt:.3f} ({self.prompts} prefill + {self.verify_forwards} verify for "
            f"{self.generated} tokens) against 1.000 plain: {1 / fpt:.2f}x fewer",
            f"teacher-forced tau {self.teacher_forced_tau_exact:.3f} exact "
            f"({self.teacher_forced_tau_simulated:.3f} simulated, slot accuracy {slots}) on the same sequences; "
            f"train/serve gap {100 * (1 - self.tau / self.teacher_forced_tau_simulated):.1f}% against the simulated",
            f"drafts equal to the teacher-forced drafts at {self.blocks_compared - self.draft_mismatches}/"
            f"{self.blocks_compared} blocks",
        ]


def evaluate(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             eos: int | None) -> Report:
    """Runs the loop on every prompt, checks it against greedy decoding and the teacher-forced drafts, and sums
    the figures. Raises ``SpeculativeError`` on the first prompt whose output differs from greedy decoding, and
    when a drafted block differs from the teacher-forced one."""
    block = decoder.drafter.config.block
    report = Report(block=block, tf_correct=torch.zeros(block - 1, dtype=torch.long),
                    tf_counted=torch.zeros(block - 1, dtype=torch.long))
    for index, prompt in enumerate(prompts):
        decoded = decoder.generate(prompt, max_new_tokens, eos)
        greedy = decoder.greedy(prompt, max_new_tokens, eos)
        if decoded.tokens != greedy:
            first = next((i for i, (a, b) in enumerate(zip(decoded.tokens, greedy)) if a != b),
                         min(len(decoded.tokens), len(greedy)))
            raise SpeculativeError(
                f"prompt {index}: speculative output differs from the target's greedy decode at generated token "
                f"{first} (speculative {decoded.tokens[first:first + 4]}, greedy {greedy[first:first + 4]}; "
                f"lengths {len(decoded.tokens)} and {len(greedy)})")
        anchors, drafted, correct, counted, logits = decoder.teacher_forced(prompt, greedy)
        report.add_teacher_forced(correct, counted)
        row_of = {int(a): i for i, a in enumerate(anchors)}
        for start, tokens in decoded.blocks:
            if start not in row_of:
                continue  # the last block may start at the last token, which has no label to anchor
            row = logits[row_of[start]]
            chosen = row.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            report.blocks_compared += 1
            report.draft_mismatches += int(bool((row.max(dim=1).values - chosen > TIE_MARGIN).any()))
        report.prompts += 1
        report.generated += len(greedy)
        report.verify_forwards += len(decoded.accepted)
        report.accepted += decoded.accepted
    if report.draft_mismatches:
        raise SpeculativeError(
            f"{report.draft_mismatches} of {report.blocks_compared} drafted blocks differ from the teacher-forced "
            "drafter's block at the same anchor: the loop feeds the drafter other positions, tokens or context "
            "than training does")
    return report


def load_prompts(path: str, tokenizer: Any, limit: int | None) -> list[list[int]]:
    """Token ids of each prompt: ``messages`` rendered with the chat template and the generation prompt (a
    trailing assistant turn is dropped: the target answers), or ``text``, or ``input_ids``."""
    from .chat import check_messages, read_records

    prompts = []
    for where, record in read_records(path):
        if "messages" in record:
            messages = check_messages(record["messages"], where)
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        elif "text" in record:
            prompts.append(tokenizer(record["text"])["input_ids"])
        elif "input_ids" in record:
            prompts.append(list(record["input_ids"]))
        else:
            raise SpeculativeError(f"{where}: a prompt needs `messages`, `text` or `input_ids`")
        if not prompts[-1]:
            raise SpeculativeError(f"{where}: the prompt has no tokens")
        if limit is not None and len(prompts) == limit:
            break
    return prompts


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m draftpipe_client.speculative",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--draft", required=True, help="the exported drafter (config.json, model.safetensors)")
    parser.add_argument("--target", required=True, help="the target (a transformers model directory)")
    parser.add_argument("--prompts", required=True, help="JSON lines with `messages`, `text` or `input_ids`")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default 64)")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--json", help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Measures the drafter's acceptance against the target; returns the exit status."""
    args = _arguments(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    try:
        drafter = Drafter.load(args.draft)
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        decoder = SpeculativeDecoder(target, drafter)
        prompts = load_prompts(args.prompts, tokenizer, args.limit)
        report = evaluate(decoder, prompts, args.max_new_tokens, tokenizer.eos_token_id)
    except DraftpipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    print(f"({time.monotonic() - started:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
