"""Train a small real target model offline: a byte-level BPE tokenizer and a Qwen3-architecture causal LM on the
Python standard library's own sources (every machine with Python has them), saved as a `transformers` model
directory (config.json, model.safetensors, tokenizer files with a chat template).

    python scripts/train_tiny_target.py --out runs/tiny-target [--minutes 4] [--tiny]

The model is the target of the acceptance walk (`scripts/acceptance-walk.sh`): it generates the responses the
drafter trains on, streams its hidden states into `draftpipe run`, and verifies the drafter's blocks in
`python -m draftpipe_client.speculative`. Each training sample is one chat turn in the template this script
installs (`draftpipe_client.chat.CHATML_TEMPLATE`): the user's message is a run of lines of a stdlib file, the
assistant's the lines that follow, so the model learns to continue code inside a conversation and to end its
turn with `<|im_end|>`. Files whose name hashes into the held-out tenth are never trained on; `--eval-prompts`
writes prompts from them, `--prompts` from the training files (one JSON object per line,
`{"messages": [{"role": "user", "content": ...}]}`).

Seeded (`--seed`): the same machine and thread count give the same model. Prints the loss as it trains.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "python"))
from draftpipe_client.chat import CHATML_TEMPLATE, MASK_TOKEN, SPECIAL_TOKENS  # noqa: E402


def stdlib_files() -> list[Path]:
    """The standard library's own modules, sorted; tests, IDLE and installed packages left out (their text is
    mostly data and fixtures)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def held_out(path: Path) -> bool:
    """One file in ten, by a hash of its name (stable across machines and Python versions)."""
    return hashlib.sha256(path.name.encode()).digest()[0] % 10 == 0


def turns(text: str, rng: random.Random, count: int) -> list[tuple[str, str]]:
    """`count` (user, assistant) pairs from one file: a run of 3–8 lines, then the 3–8 lines after it."""
    lines = [line for line in text.splitlines() if line.strip()]
    out = []
    for _ in range(count):
        if len(lines) < 8:
            break
        start = rng.randrange(0, len(lines) - 6)
        split = min(start + rng.randint(3, 8), len(lines) - 1)
        end = min(split + rng.randint(3, 8), len(lines))
        out.append(("\n".join(lines[start:split]), "\n".join(lines[split:end])))
    return out


def write_prompts(path: Path, sources: list[Path], rng: random.Random, count: int) -> None:
    """`count` one-turn conversations (a user message of 3–8 lines of a file in `sources`) as JSON lines."""
    with path.open("w", encoding="utf-8") as out:
        written = 0
        while written < count:
            for user, _ in turns(sources[rng.randrange(len(sources))].read_text(encoding="utf-8", errors="replace"),
                                 rng, 1):
                out.write(json.dumps({"messages": [{"role": "user", "content": user}]}) + "\n")
                written += 1


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE (GPT-2's pre-tokenizer) with the chat's special tokens and the DFlash mask token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the model directory to write")
    parser.add_argument("--minutes", type=float, default=4.0, help="training wall time (default 4)")
    parser.add_argument("--steps", type=int, default=100000, help="stop earlier after this many steps")
    parser.add_argument("--tiny", action="store_true", help="CI size: a 512-token vocabulary and a 3-layer model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--prompts", type=Path, help="also write chat prompts from the training files here")
    parser.add_argument("--eval-prompts", type=Path, help="also write chat prompts from the held-out files here")
    parser.add_argument("--num-prompts", type=int, default=64, help="lines in each prompts file (default 64)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    files = stdlib_files()
    train_files = [p for p in files if not held_out(p)]
    test_files = [p for p in files if held_out(p)]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in train_files]
    started = time.monotonic()
    tokenizer = train_tokenizer(texts[: 60 if args.tiny else 400], 512 if args.tiny else 2048)
    print(f"tokenizer: {len(tokenizer)} tokens from {len(train_files)} training files "
          f"({time.monotonic() - started:.1f} s)", flush=True)

    # One layer more than the drafter's deepest tap: a tap is the hidden state entering a layer, as the engines
    # capture it, so the target's last output (after its final norm) is never a tap.
    dims = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32) if args.tiny else \
        dict(hidden_size=128, intermediate_size=384, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
    config = Qwen3Config(
        vocab_size=len(tokenizer), max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **dims,
    )
    model = Qwen3ForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {dims}", flush=True)

    seq_len, batch = 128, 16
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    deadline = time.monotonic() + 60 * args.minutes
    step, smoothed = 0, None
    model.train()
    while step < args.steps and time.monotonic() < deadline:
        rows = []
        while len(rows) < batch:
            for user, assistant in turns(texts[rng.randrange(len(texts))], rng, 2):
                chat = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
                rows.append(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
                            [:seq_len])
        rows = rows[:batch]
        width = max(len(r) for r in rows)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        labels = ids.masked_fill(mask == 0, -100)
        lr = 3e-3 * min(1.0, (step + 1) / 50)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % 20 == 0 or step == 1:
            print(f"step {step}: loss {loss.item():.3f} (smoothed {smoothed:.3f}, ppl {math.exp(smoothed):.1f}), "
                  f"{time.monotonic() - started:.0f} s", flush=True)

    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.out} after {step} steps, smoothed loss {smoothed:.3f}; mask token {MASK_TOKEN} = "
          f"{tokenizer.convert_tokens_to_ids(MASK_TOKEN)}", flush=True)

    for path, sources, seed in ((args.prompts, train_files, 1), (args.eval_prompts, test_files, 2)):
        if path is not None:
            write_prompts(path, sources, random.Random(args.seed + seed), args.num_prompts)
            print(f"wrote {args.num_prompts} prompts to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
