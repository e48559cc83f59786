"""A ready producer for Hugging Face ``transformers`` models.

    python -m draftpipe_client.hf --model PATH --data prompts.jsonl --tap-layers 2 10 18 \\
        --connect 127.0.0.1:7070 [--device cuda:0]

Reads prompts (one JSON object per line with a ``text`` field, or ``input_ids`` already tokenized), tokenizes
them, runs the target with ``output_hidden_states=True`` and sends the tapped layers' hidden states (in
``hidden_states[i]``, index 0 being the embeddings, as ``docs/sources.md`` describes) concatenated per token,
in bfloat16, with the attention mask as the loss mask. Sequences keep their own lengths; draftpipe buckets them.
"""

import argparse
import json
import sys
import time

from . import Producer


def _arguments(argv):
    parser = argparse.ArgumentParser(prog="python -m draftpipe_client.hf", description=__doc__.split("\n")[1])
    parser.add_argument("--model", required=True, help="model directory or Hub name (AutoModelForCausalLM)")
    parser.add_argument("--data", required=True, help="JSON lines with `text` (or `input_ids`) per line")
    parser.add_argument("--tap-layers", required=True, type=int, nargs="+", help="indices into hidden_states")
    parser.add_argument("--connect", required=True, help="HOST:PORT or unix:/path of `draftpipe run`")
    parser.add_argument("--device", default="cpu", help="torch device of the target (default cpu)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass")
    parser.add_argument("--max-length", type=int, default=2048, help="truncate prompts to this many tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="the target's weights and activations")
    parser.add_argument("--vocab", type=int, help="the plan's vocab (default: the model's vocab_size)")
    parser.add_argument("--name", help="producer name, stable across restarts (default host-pid)")
    parser.add_argument("--token", help="the stream's token (default $DRAFTPIPE_TOKEN)")
    parser.add_argument("--skip", type=int, default=0,
                        help="prompts to skip (resume after a restart: the slot's delivered count says where)")
    return parser.parse_args(argv)


def _prompts(path):
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                record = json.loads(line)
                if "input_ids" not in record and "text" not in record:
                    raise SystemExit(f"{path}:{number}: a line needs `text` or `input_ids`")
                yield record


class _Progress:
    """A progress line on stderr (tqdm when installed)."""

    def __init__(self, total):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="seq", file=sys.stderr)
        except ImportError:
            self._bar = None
        self.total, self.done, self.started = total, 0, time.monotonic()

    def update(self, n, tokens):
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix(tokens=tokens)
        else:
            rate = self.done / max(time.monotonic() - self.started, 1e-9)
            print(f"\r{self.done}/{self.total} sequences ({rate:.1f}/s)", end="", file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def main(argv=None):
    args = _arguments(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    except TypeError:  # transformers before 4.56 names the argument torch_dtype
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype)
    model = model.to(args.device).eval()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = config.num_hidden_layers
    bad = [layer for layer in args.tap_layers if not 0 <= layer <= layers]
    if bad:
        raise SystemExit(f"--tap-layers {bad}: hidden_states has indices 0..{layers} (0 = embeddings)")
    records = list(_prompts(args.data))[args.skip :]
    progress = _Progress(len(records))
    tokens_sent = 0
    with Producer(
        args.connect,
        hidden=config.hidden_size,
        tap_layers=args.tap_layers,
        vocab=args.vocab or config.vocab_size,
        token=args.token,
        name=args.name,
    ) as producer:
        for start in range(0, len(records), args.batch_size):
            chunk = records[start : start + args.batch_size]
            if all("input_ids" in r for r in chunk):
                batch = tokenizer.pad({"input_ids": [r["input_ids"][: args.max_length] for r in chunk]},
                                      return_tensors="pt")
            else:
                batch = tokenizer([r.get("text", "") for r in chunk], return_tensors="pt", padding=True,
                                  truncation=True, max_length=args.max_length)
            batch = {k: v.to(args.device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                out = model(**batch, output_hidden_states=True)
            hidden = torch.cat([out.hidden_states[layer] for layer in args.tap_layers], dim=-1)
            mask = batch["attention_mask"]
            # Trim the columns no sequence uses; each row's own length comes from its mask.
            width = int(mask.sum(dim=1).max())
            producer.send(
                input_ids=batch["input_ids"][:, :width],
                hidden_states=hidden[:, :width].to(torch.bfloat16),
                loss_mask=mask[:, :width],
            )
            tokens_sent += int(mask.sum())
            progress.update(len(chunk), tokens_sent)
    progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
