"""Chat data for a drafter: the template with loss only on the assistant's tokens, and regeneration of the
assistant's turns by the target itself (as SpecForge's data regeneration does), so the drafter learns the
distribution it will be asked to draft.

Records are JSON lines ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}``.
``encode`` renders them with the tokenizer's own chat template and marks, token by token, what the assistant
wrote (its content and its end-of-turn token); ``python -m draftpipe_client.hf`` sends that mark as the loss mask,
so DFlash anchors and labels fall only in the responses, while the context features still cover the whole
conversation. A mask gone wrong trains without any error, so ``MaskReport`` judges every encoded conversation
(all ones, all zeros, a turn whose end-of-turn token is not in the mask, an empty thinking block in the mask) and
``MaskReport.check`` raises ``MaskError`` when more than ``max_bad_share`` of them are bad, before anything is
sent. ``regenerate`` replaces each assistant turn with the target's greedy continuation of the
conversation before it (and answers a trailing user turn)::

    python -m draftpipe_client.chat --model DIR --data prompts.jsonl --out regenerated.jsonl --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Sequence, cast

from ._producer import DraftpipeError

#: One chat turn: ``{"role": ..., "content": ...}``.
Message = Dict[str, Any]

MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]

#: ChatML (Qwen's turn format, without its system-prompt and thinking logic): what
#: ``scripts/train_tiny_target.py`` installs in the tokenizer it trains.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ChatError(DraftpipeError):
    """A conversation the template cannot mark: a bad record, or a template whose rendering of a conversation does
    not start with its rendering of the turns before (so the assistant's text cannot be located)."""


class MaskError(ChatError):
    """Encoded conversations whose loss masks are bad in more than the allowed share of them: the message names
    each kind, its count and the first conversations of it."""


@dataclass(frozen=True)
class Encoded:
    """A conversation as the producer sends it: token ids and 1 on the tokens the assistant wrote."""

    input_ids: list[int]
    loss_mask: list[int]


def _render(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    rendered = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return cast(str, rendered)


def check_messages(messages: Any, where: str) -> list[Message]:
    """The record's ``messages``, checked: a non-empty list of ``{"role", "content": str}``."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where}: `messages` must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content"), str):
            raise ChatError(f"{where}: messages[{i}] needs a string `role` and a string `content`")
    return messages


def assistant_spans(tokenizer: Any, messages: Sequence[Message],
                    where: str = "conversation") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of each assistant turn: its content and
    its end-of-turn marker, without the whitespace the template puts after it.

    A span is what rendering the conversation up to and including the turn adds to rendering the turns before it
    with the generation prompt; the template must render every prefix of the conversation as a prefix of the
    whole, or the assistant's text cannot be located (a ``ChatError``)."""
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not through.startswith(before) or not text.startswith(through):
            raise ChatError(f"{where}: the chat template does not render messages[:{i}] as a prefix of the "
                            "conversation, so the assistant's tokens cannot be marked")
        spans.append((len(before), len(through.rstrip())))
    return text, spans


def encode(tokenizer: Any, messages: Sequence[Message], max_length: int | None = None,
           where: str = "conversation") -> Encoded:
    """Token ids of the rendered conversation and its loss mask: 1 on every token that overlaps an assistant span
    (a fast tokenizer's offsets say where each token came from; a token that merges the header's newline with the
    reply's first characters belongs to the reply), 0 elsewhere."""
    text, spans = assistant_spans(tokenizer, check_messages(messages, where), where)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start < e and s < end for s, e in spans))
            for start, end in encoding["offset_mapping"]]
    ids = list(encoding["input_ids"])
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return Encoded(ids, mask)


#: Conversations named per kind of bad mask: enough to find the template's fault, few enough for one message.
FIRST_IDS = 5
#: The kinds of bad mask, in the order reports name them.
MASK_KINDS = ("all_ones", "all_zeros", "missing_end_of_turn", "empty_thinking")
#: An empty thinking block, as Qwen3-style templates insert before a reply that had none.
_EMPTY_THINKING = re.compile(r"<think>\s*</think>")


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The tokenizer's end-of-turn token: ChatML's ``<|im_end|>`` when it has one, else its eos token."""
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        return cast(int, vocab["<|im_end|>"])
    return cast("int | None", tokenizer.eos_token_id)


@dataclass
class BadMasks:
    """The conversations of one kind of bad mask: how many, and the first ``FIRST_IDS`` by place."""

    count: int = 0
    first_ids: list[str] = field(default_factory=list)

    def add(self, where: str) -> None:
        self.count += 1
        if len(self.first_ids) < FIRST_IDS:
            self.first_ids.append(where)

    def describe(self, kind: str) -> str:
        """``all_ones 3 (data.jsonl:1, data.jsonl:4)``."""
        named = ", ".join(self.first_ids) + (", …" if self.count > len(self.first_ids) else "")
        return f"{kind} {self.count}" + (f" ({named})" if named else "")


@dataclass
class MaskReport:
    """What the loss masks of encoded conversations hold: tokens with a loss, and the conversations whose mask is
    bad, per kind:

    - ``all_ones``: every token from the first to the last one with a loss has one, the prompt included;
    - ``all_zeros``: no token has a loss (the conversation trains nothing);
    - ``missing_end_of_turn``: a masked span does not end on the end-of-turn token (a reply cut by
      ``max_length``, or a template that leaves the token out of the mask);
    - ``empty_thinking``: a masked span holds an empty ``<think>…</think>`` block (whitespace inside), which
      Qwen3-style templates insert: the drafter would learn to draft it after every prompt.

    ``end_of_turn`` is the token each span must end on (``None``: not checked); ``decode`` turns token ids into
    text for the thinking check (``None``: not checked). A conversation of several kinds counts once in
    ``bad_sequences``."""

    end_of_turn: int | None
    decode: Callable[[list[int]], str] | None = None
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    bad_sequences: int = 0
    kinds: dict[str, BadMasks] = field(default_factory=lambda: {kind: BadMasks() for kind in MASK_KINDS})

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "MaskReport":
        """A report checking ``tokenizer``'s end-of-turn token and decoding spans with it (special tokens kept)."""
        return cls(end_of_turn_id(tokenizer),
                   lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

    @property
    def loss_token_share(self) -> float:
        """Share (0–1) of the tokens that have a loss."""
        return self.loss_tokens / self.tokens if self.tokens else 0.0

    def add(self, input_ids: Sequence[int], loss_mask: Sequence[int], where: str) -> list[str]:
        """Judges one encoded conversation (``where`` names it, e.g. ``data.jsonl:7``) and returns its bad kinds."""
        if not input_ids:
            return []
        self.sequences += 1
        self.tokens += len(input_ids)
        labelled = [i for i, m in enumerate(loss_mask) if m]
        self.loss_tokens += len(labelled)
        spans = _spans(loss_mask)
        found: list[str] = []
        if not labelled:
            found.append("all_zeros")
        elif len(labelled) == labelled[-1] + 1:
            found.append("all_ones")
        if self.end_of_turn is not None and any(input_ids[end - 1] != self.end_of_turn for _, end in spans):
            found.append("missing_end_of_turn")
        if self.decode is not None and any(
                _EMPTY_THINKING.search(self.decode(list(input_ids[start:end]))) for start, end in spans):
            found.append("empty_thinking")
        for kind in found:
            self.kinds[kind].add(where)
        self.bad_sequences += bool(found)
        return found

    def summary(self) -> str:
        """One line: ``12 conversations, loss on 41.0% of 980 tokens; bad masks 1 (8.3%): all_ones 0, …``."""
        bad = self.bad_sequences / self.sequences if self.sequences else 0.0
        kinds = ", ".join(self.kinds[kind].describe(kind) for kind in MASK_KINDS)
        return (f"{self.sequences} conversations, loss on {100 * self.loss_token_share:.1f}% of {self.tokens} "
                f"tokens; bad masks {self.bad_sequences} ({100 * bad:.1f}%): {kinds}")

    def check(self, max_bad_share: float = 0.01) -> None:
        """Raises ``MaskError`` when the bad conversations are more than ``max_bad_share`` (0–1) of them."""
        if not 0.0 <= max_bad_share <= 1.0:
            raise ChatError(f"max_bad_share must lie in 0..1, not {max_bad_share}")
        if self.bad_sequences > max_bad_share * self.sequences:
            raise MaskError(f"loss masks: {self.summary()} — over the bound of {100 * max_bad_share:g}% bad; fix "
                            "the chat template or the data (or allow more with --max-bad-mask-share)")


def _spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """The maximal runs ``[start, end)`` of nonzero entries."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for i, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def check_masks(tokenizer: Any, encoded: Iterator[tuple[str, Encoded]],
                max_bad_share: float = 0.01) -> MaskReport:
    """Judges ``(where, Encoded)`` pairs with ``tokenizer``'s end-of-turn token and returns the report; raises
    ``MaskError`` when more than ``max_bad_share`` of them are bad."""
    report = MaskReport.for_tokenizer(tokenizer)
    for where, one in encoded:
        report.add(one.input_ids, one.loss_mask, where)
    report.check(max_bad_share)
    return report


def regenerate(model: Any, tokenizer: Any, messages: Sequence[Message], max_new_tokens: int) -> list[Message]:
    """The conversation with every assistant turn replaced by the target's greedy continuation of the turns before
    it, and one added when the conversation ends with a user turn. Generation stops at the tokenizer's
    end-of-turn (eos) token or after ``max_new_tokens``."""
    import torch

    out: list[Message] = []
    turns = list(messages) + ([{"role": "assistant", "content": ""}] if messages[-1]["role"] != "assistant" else [])
    for message in turns:
        if message["role"] != "assistant":
            out.append(dict(message))
            continue
        prompt = tokenizer(_render(tokenizer, out, add_generation_prompt=True), add_special_tokens=False,
                           return_tensors="pt")["input_ids"].to(model.device)
        with torch.no_grad():
            generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id)
        reply = tokenizer.decode(generated[0, prompt.shape[1]:], skip_special_tokens=True)
        out.append({"role": "assistant", "content": reply})
    return out


def prepare(record: dict[str, Any], tokenizer: Any, model: Any, regenerate_tokens: int, max_length: int | None,
            where: str) -> dict[str, Any]:
    """What the producer sends for one record: a ``messages`` record becomes ``input_ids`` and ``loss_mask``
    (``encode``), and ``where`` (its place, which ``MaskReport`` names), its assistant turns first regenerated by
    ``model`` when ``regenerate_tokens`` > 0; any other record is returned as it is."""
    if "messages" not in record:
        return record
    messages = check_messages(record["messages"], where)
    if regenerate_tokens > 0:
        messages = regenerate(model, tokenizer, messages, regenerate_tokens)
    encoded = encode(tokenizer, messages, max_length, where)
    return {"input_ids": encoded.input_ids, "loss_mask": encoded.loss_mask, "where": where}


def read_records(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(file:line, record)`` for each non-empty JSON line of ``path``."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                where = f"{path}:{number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as error:
                    raise ChatError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m draftpipe_client.chat",
                                     description="Regenerate the assistant turns of chat records with the target.")
    parser.add_argument("--model", required=True, help="the target (a transformers model directory)")
    parser.add_argument("--data", required=True, help="JSON lines with `messages`")
    parser.add_argument("--out", required=True, help="where to write the regenerated records (JSON lines)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per assistant turn (default 128)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerates the records of ``--data`` into ``--out``; returns the exit status."""
    args = _arguments(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    try:
        records = [(where, check_messages(r.get("messages"), where)) for where, r in read_records(args.data)]
        with open(args.out, "w", encoding="utf-8") as out:
            for where, messages in records:
                out.write(json.dumps({"messages": regenerate(model, tokenizer, messages, args.max_new_tokens)})
                          + "\n")
    except ChatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"regenerated {len(records)} conversations into {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
