"""A learnable random-weight target for a first DFlash stream run, with nothing downloaded or trained: a tiny
Qwen3-architecture ``transformers`` model built from a config (seeded random weights), a word-level tokenizer
with the chat template and the DFlash mask token, and chat prompts whose replies the target will write itself.

    python clients/python/examples/random_target.py --out runs/dflash-stream/target \\
        --prompts runs/dflash-stream/prompts.jsonl

Then (``docs/sources.md``, "A first DFlash stream run"): ``draftpipe run pipelines/dflash-stream.pipe`` and
``python -m draftpipe_client.hf --model runs/dflash-stream/target --data runs/dflash-stream/prompts.jsonl
--regenerate 24 ...``, which replaces every reply by the target's own greedy continuation before it streams.

Why that is learnable: a drafter learns to predict what the target would say next. Trained on prompts of random
text, the next token is random too, whatever the target's hidden states hold, and the acceptance length τ stays
near 1 (1.05 in issue 20's first try): that looks broken and is not. On replies the target generated, each next
token is the target's greedy choice, a function of its hidden states, so the loss falls and τ rises within a
minute. The sizes match ``pipelines/dflash-stream.pipe``; the script prints the mask token's id for its
``mask_token``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftpipe_client.chat import CHATML_TEMPLATE, MASK_TOKEN, SPECIAL_TOKENS  # noqa: E402

#: The plan's figures (pipelines/dflash-stream.pipe): width, depth, vocabulary.
HIDDEN = 64
LAYERS = 4
WORDS = 250


def tokenizer():
    """A word-level tokenizer: the chat's special tokens (the mask token among them), then ``WORDS`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, "[UNK]", "\n"])}
    for i in range(WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>", MASK_TOKEN])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--out", required=True, type=Path, help="the target's directory (created)")
    parser.add_argument("--prompts", required=True, type=Path, help="where to write the chat prompts (JSON lines)")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts to write (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts (default 0)")
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tokenizer()
    torch.manual_seed(args.seed)
    # A wider initialisation than the default 0.02 keeps a random model's greedy choices dependent on the context
    # rather than one token repeated, so the replies are varied and still the target's own.
    config = Qwen3Config(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(args.out)
    tok.save_pretrained(args.out)

    rng = random.Random(args.seed)
    args.prompts.parent.mkdir(parents=True, exist_ok=True)
    with open(args.prompts, "w", encoding="utf-8") as out:
        for _ in range(args.num_prompts):
            words = " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(4, 24)))
            out.write(json.dumps({"messages": [{"role": "user", "content": words}]}) + "\n")
    print(f"random target in {args.out}: hidden {HIDDEN}, {LAYERS} layers, vocab {len(tok)}, "
          f"{MASK_TOKEN} = {tok.convert_tokens_to_ids(MASK_TOKEN)}; {args.num_prompts} prompts in {args.prompts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
