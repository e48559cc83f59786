"""Chat data for a drafter: the template with loss only on the assistant's tokens, and regeneration of the
assistant's turns by the target itself (as SpecForge's data regeneration does), so the drafter learns the
distribution it will be asked to draft.

Records are JSON lines ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}``.
``encode`` renders them with the tokenizer's own chat template and marks, token by token, what the assistant
wrote (its content and its end-of-turn token); ``python -m draftpipe_client.hf`` sends that mark as the loss mask,
so DFlash anchors and labels fall only in the responses, while the context features still cover the whole
conversation. ``regenerate`` replaces each assistant turn with the target's greedy continuation of the
conversation before it (and answers a trailing user turn)::

    python -m draftpipe_client.chat --model DIR --data prompts.jsonl --out regenerated.jsonl --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ._producer import DraftpipeError

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


@dataclass(frozen=True)
class Encoded:
    """A conversation as the producer sends it: token ids and 1 on the tokens the assistant wrote."""

    input_ids: list[int]
    loss_mask: list[int]


def _render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def check_messages(messages: Any, where: str) -> list[dict]:
    """The record's ``messages``, checked: a non-empty list of ``{"role", "content": str}``."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where}: `messages` must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content"), str):
            raise ChatError(f"{where}: messages[{i}] needs a string `role` and a string `content`")
    return messages


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str = "conversation") -> tuple[str, list]:
    """The rendered conversation and the character spans ``[start, end)`` of each assistant turn: its content and
    its end-of-turn marker, without the whitespace the template puts after it.

    A span is what rendering the conversation up to and including the turn adds to rendering the turns before it
    with the generation prompt; the template must render every prefix of the conversation as a prefix of the
    whole, or the assistant's text cannot be located (a ``ChatError``)."""
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
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


def encode(tokenizer: Any, messages: Sequence[dict], max_length: int | None = None,
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


def regenerate(model: Any, tokenizer: Any, messages: Sequence[dict], max_new_tokens: int) -> list[dict]:
    """The conversation with every assistant turn replaced by the target's greedy continuation of the turns before
    it, and one added when the conversation ends with a user turn. Generation stops at the tokenizer's
    end-of-turn (eos) token or after ``max_new_tokens``."""
    import torch

    out: list[dict] = []
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


def prepare(record: dict, tokenizer: Any, model: Any, regenerate_tokens: int, max_length: int | None,
            where: str) -> dict:
    """What the producer sends for one record: a ``messages`` record becomes ``input_ids`` and ``loss_mask``
    (``encode``), its assistant turns first regenerated by ``model`` when ``regenerate_tokens`` > 0; any other
    record is returned as it is."""
    if "messages" not in record:
        return record
    messages = check_messages(record["messages"], where)
    if regenerate_tokens > 0:
        messages = regenerate(model, tokenizer, messages, regenerate_tokens)
    encoded = encode(tokenizer, messages, max_length, where)
    return {"input_ids": encoded.input_ids, "loss_mask": encoded.loss_mask}


def read_records(path: str) -> Iterator[tuple[str, dict]]:
    """``(file:line, record)`` for each non-empty JSON line of ``path``."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                where = f"{path}:{number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as error:
                    raise ChatError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None


def _arguments(argv):
    parser = argparse.ArgumentParser(prog="python -m draftpipe_client.chat",
                                     description="Regenerate the assistant turns of chat records with the target.")
    parser.add_argument("--model", required=True, help="the target (a transformers model directory)")
    parser.add_argument("--data", required=True, help="JSON lines with `messages`")
    parser.add_argument("--out", required=True, help="where to write the regenerated records (JSON lines)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per assistant turn (default 128)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def main(argv=None) -> int:
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
