"""A ready producer for Hugging Face ``transformers`` models: streams a target's hidden states to ``draftpipe run``
(``--connect``) or writes them as safetensors files for ``draftpipe eval`` or a file source (``--write``).

    python -m draftpipe_client.hf --model PATH --data prompts.jsonl --tap-layers 2 10 18 \\
        --connect 127.0.0.1:7070 --name gpu0 [--device cuda:0]
    python -m draftpipe_client.hf --model PATH --data held-out.jsonl --tap-layers 2 10 18 --write held-out/

Reads prompts (one JSON object per line with a ``text`` field, or ``input_ids`` already tokenized), tokenizes
them (truncated to ``--max-length`` and to the plan's largest bucket, which the run announces), runs the target
with ``output_hidden_states=True`` and sends the tapped layers' hidden states (``hidden_states[i]``, index 0
being the embeddings, as ``docs/sources.md`` describes) concatenated per token, in ``--dtype`` (bf16 by
default), with the attention mask as the loss mask.

Streaming, sequences are gathered into messages of about the plan's ``batch_tokens`` real tokens (and within the
run's message limit), so each message fills a queue item. Which prompts make which message follows from the
prompts' token counts alone, so a restarted producer with the same ``--name`` resumes by itself: the run says
how many of its messages it acknowledged, and those prompts are skipped without running the model. When the run
ends (its step limit), the producer prints one line and exits 0.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from . import Producer, ProducerError, RunEnded
from ._safetensors import Tensor, serialize

_SENT_DTYPES = {"bf16": "bf16", "f16": "f16", "f32": "f32"}


class _Refusal(Exception):
    """A problem with the arguments or the data, reported as one line."""


def _arguments(argv):
    parser = argparse.ArgumentParser(
        prog="python -m draftpipe_client.hf",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Details: docs/sources.md of the draftpipe repository.",
    )
    parser.add_argument("--model", required=True, help="model directory or Hub name (AutoModelForCausalLM)")
    parser.add_argument("--data", required=True, help="JSON lines with `text` (or `input_ids`) per line")
    parser.add_argument("--tap-layers", required=True, type=int, nargs="+", help="indices into hidden_states")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", help="HOST:PORT or unix:/path of `draftpipe run`")
    where.add_argument("--write", metavar="DIR",
                       help="write hidden-state files into DIR instead (for `draftpipe eval --data 'DIR/*'`)")
    parser.add_argument("--device", default="cpu", help="torch device of the target (default cpu)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass (default 8)")
    parser.add_argument("--max-length", type=int, default=2048,
                        help="truncate prompts to this many tokens (and to the plan's largest bucket)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_SENT_DTYPES),
                        help="precision of the hidden states sent or written (default bf16)")
    parser.add_argument("--model-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="the target's weights and activations (default bfloat16)")
    parser.add_argument("--vocab", type=int, help="the plan's vocab (default: the model's vocab_size)")
    parser.add_argument("--name", help="producer name, stable across restarts (default host-pid)")
    parser.add_argument("--token", help="the stream's token (default $DRAFTPIPE_TOKEN)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.max_length < 1:
        parser.error("--batch-size and --max-length must be at least 1")
    return args


def _prompts(path):
    try:
        lines = open(path, encoding="utf-8")
    except OSError as error:
        raise _Refusal(f"{path}: {error.strerror}") from None
    with lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise _Refusal(f"{path}:{number}:{error.colno}: not JSON: {error.msg}") from None
            if not isinstance(record, dict) or ("input_ids" not in record and "text" not in record):
                raise _Refusal(f"{path}:{number}: a line needs `text` or `input_ids`")
            yield record


def _tokenize(tokenizer, records, limit):
    """Every prompt's token ids, truncated to ``limit`` (empty prompts dropped: they train nothing)."""
    sequences = []
    for record in records:
        if "input_ids" in record:
            ids = [int(i) for i in record["input_ids"]][:limit]
        else:
            ids = tokenizer(record["text"], truncation=True, max_length=limit)["input_ids"]
        if ids:
            sequences.append(ids)
    return sequences


def plan_messages(lengths, batch_tokens, max_rows_of_width):
    """Splits prompts (by their token counts) into messages: consecutive prompts until about ``batch_tokens``
    real tokens, each message within the run's size limit (``max_rows_of_width(width)``: rows of that padded
    width that fit one message). Deterministic in the lengths alone, so a restart finds the same messages.

    Returns ``[(start, end)]`` prompt ranges."""
    messages, start, tokens, longest = [], 0, 0, 0
    for i, length in enumerate(lengths):
        wider = max(longest, length)
        if i > start and (tokens >= batch_tokens or i + 1 - start > max_rows_of_width(wider)):
            messages.append((start, i))
            start, tokens, wider = i, 0, length
        tokens += length
        longest = wider
    if start < len(lengths):
        messages.append((start, len(lengths)))
    return messages


class _Target:
    """The model, run over prompts in forward batches; yields each prompt's ids and tapped hidden states."""

    def __init__(self, args, tokenizer):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        dtype = getattr(torch, args.model_dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        except TypeError:  # transformers before 4.56 names the argument torch_dtype
            model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype)
        self.model = model.to(args.device).eval()
        self.device = args.device
        self.tokenizer = tokenizer
        self.taps = args.tap_layers
        self.batch_size = args.batch_size
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        layers = config.num_hidden_layers
        bad = [layer for layer in self.taps if not 0 <= layer <= layers]
        if bad:
            raise _Refusal(f"--tap-layers {bad}: hidden_states has indices 0..{layers} (0 = embeddings)")

    def run(self, sequences, hidden_dtype):
        """``(ids, hidden)`` per sequence, in order; hidden is ``[len, hidden × taps]`` in ``hidden_dtype``."""
        torch = self.torch
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            batch = self.tokenizer.pad({"input_ids": chunk}, return_tensors="pt")
            batch = {k: v.to(self.device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                out = self.model(**batch, output_hidden_states=True)
            hidden = torch.cat([out.hidden_states[layer] for layer in self.taps], dim=-1).to(hidden_dtype)
            for row, ids in enumerate(chunk):
                yield torch.tensor(ids), hidden[row, : len(ids)].cpu()


class _Progress:
    """A progress line on stderr (tqdm when installed)."""

    def __init__(self, total, done=0):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, unit="seq", file=sys.stderr)
        except ImportError:
            self._bar = None
        self.total, self.done, self.started = total, done, time.monotonic()

    def update(self, n, tokens):
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix(tokens=tokens)
        else:
            rate = n and self.done / max(time.monotonic() - self.started, 1e-9)
            print(f"\r{self.done}/{self.total} sequences ({rate:.1f}/s)", end="", file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def _hidden_torch_dtype(torch, name):
    return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[name]


def _stream(args, target, sequences_of):
    torch = target.torch
    config = target.config
    with Producer(args.connect, hidden=config.hidden_size, tap_layers=args.tap_layers,
                  vocab=args.vocab or config.vocab_size, token=args.token, name=args.name,
                  hidden_dtype=_SENT_DTYPES[args.dtype]) as producer:
        limit = min(args.max_length, producer.largest_bucket or args.max_length)
        sequences = sequences_of(limit)
        itemsize = 4 if args.dtype == "f32" else 2
        plan = plan_messages([len(s) for s in sequences], producer.batch_tokens or 0,
                             lambda width: producer.rows_per_message(width, itemsize))
        skip = min(producer.delivered, len(plan))
        first = plan[skip][0] if skip < len(plan) else len(sequences)
        if producer.delivered:
            print(f"producer `{producer.name}`: draftpipe acknowledged {producer.delivered} messages; resuming after"
                  f" {skip} messages ({first} prompts)", file=sys.stderr)
        progress = _Progress(len(sequences), first)
        outputs = target.run(sequences[first:], _hidden_torch_dtype(torch, args.dtype))
        tokens_sent = 0
        try:
            for start, end in plan[skip:]:
                group = [next(outputs) for _ in range(end - start)]
                producer.send(input_ids=[ids for ids, _ in group], hidden_states=[hs for _, hs in group])
                tokens_sent += sum(len(ids) for ids, _ in group)
                progress.update(end - start, tokens_sent)
        finally:
            # Before any closing line (the run has ended, a refusal), so that line is the last one.
            progress.close()
        print(f"producer `{producer.name}`: {len(plan)} messages acknowledged ({len(sequences)} prompts), done",
              file=sys.stderr)


def _write(args, target, sequences):
    import numpy as np

    torch = target.torch
    out = Path(args.write)
    out.mkdir(parents=True, exist_ok=True)
    dtype = _hidden_torch_dtype(torch, args.dtype)
    outputs = target.run(sequences, dtype)
    files = 0
    for start in range(0, len(sequences), args.batch_size):
        group = [next(outputs) for _ in sequences[start : start + args.batch_size]]
        width, din = max(len(ids) for ids, _ in group), group[0][1].shape[1]
        ids = np.zeros((len(group), width), np.int64)
        mask = np.zeros((len(group), width), np.uint8)
        hidden = torch.zeros((len(group), width, din), dtype=dtype)
        for row, (seq_ids, seq_hs) in enumerate(group):
            ids[row, : len(seq_ids)] = seq_ids.numpy()
            mask[row, : len(seq_ids)] = 1
            hidden[row, : len(seq_ids)] = seq_hs
        if dtype == torch.bfloat16:
            hs = Tensor(hidden.view(torch.int16).numpy().view(np.uint16), "BF16")
        else:
            hs = Tensor(hidden.numpy())
        parts, _ = serialize({"input_ids": Tensor(ids), "loss_mask": Tensor(mask), "hidden_states": hs})
        with open(out / f"hs-{files:05}.safetensors", "wb") as file:
            for part in parts:
                file.write(bytes(part))
        files += 1
    print(f"wrote {files} files ({len(sequences)} sequences) to {out}", file=sys.stderr)


def main(argv=None):
    """Runs the producer; returns the exit status (one line on standard error for every refusal)."""
    args = _arguments(argv)
    try:
        from transformers import AutoTokenizer

        records = list(_prompts(args.data))
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except OSError as error:
            raise _Refusal(f"--model {args.model}: {str(error).splitlines()[0]}") from None
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        target = _Target(args, tokenizer)
        if args.write:
            _write(args, target, _tokenize(tokenizer, records, args.max_length))
        else:
            _stream(args, target, lambda limit: _tokenize(tokenizer, records, limit))
    except RunEnded as ended:
        print(f"draftpipe: {ended}; this producer stops", file=sys.stderr)
        return 0
    except (_Refusal, ProducerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
