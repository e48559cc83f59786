"""A real `transformers` model (random weights from a small config, nothing downloaded) produces hidden states
through `python -m draftpipe_client.hf`, and a drafter trains on them in `draftpipe run`."""

import json
import math
import subprocess
import sys

import pytest

from conftest import write_pipe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(60)]


def tiny_model(directory):
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                                                pad_token="[PAD]", eos_token="[EOS]")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=0, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return len(vocab)


def test_a_transformers_target_feeds_a_drafter(tmp_path, start_run):
    vocab = tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as out:
        for i in range(40):
            words = [WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(4 + i % 27)]
            out.write(json.dumps({"text": " ".join(words)}) + "\n")
    socket = tmp_path / "hs.sock"
    # hidden_states[1] and [3]: the first and last decoder layers' outputs, 2 × 16 wide.
    run = start_run(write_pipe(tmp_path / "hf.pipe", f'stream(listen = "unix:{socket}")', hidden=16,
                               taps=(1, 3), vocab=vocab))
    producer = subprocess.run(
        [sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data", str(prompts),
         "--tap-layers", "1", "3", "--connect", f"unix:{socket}", "--device", "cpu", "--batch-size", "8",
         "--dtype", "float32", "--name", "hf"],
        capture_output=True, text=True, timeout=300)
    assert producer.returncode == 0, producer.stderr
    assert "40/40" in producer.stderr or "40it" in producer.stderr or "40/40" in producer.stdout, producer.stderr
    assert run.wait() == 0, run.stderr()
    summary = run.summary()
    assert summary["steps"] >= 5
    assert math.isfinite(summary["final_loss"])
    assert "producer `hf` connected" in run.stderr()
