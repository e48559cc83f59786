"""Chat data preparation (``draftpipe_client.chat``): loss only on the assistant's tokens, regeneration of the
assistant's turns by the target, and both through ``python -m draftpipe_client.hf`` into ``draftpipe run``."""

import json
import subprocess
import sys

import pytest

from conftest import write_pipe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from draftpipe_client import chat  # noqa: E402

CORPUS = ["def add(a, b):\n    return a + b\n", "for item in items:\n    print(item)\n",
          "class Point:\n    x: int\n    y: int\n", "import os\nprint(os.getcwd())\n"] * 20


def chat_tokenizer():
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=chat.SPECIAL_TOKENS,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = chat.CHATML_TEMPLATE
    return fast


CONVERSATION = [
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "    return a + b"},
    {"role": "user", "content": "for item in items:"},
    {"role": "assistant", "content": "    print(item)"},
]


def test_the_loss_mask_covers_the_assistant_turns_and_their_end_tokens_only():
    tokenizer = chat_tokenizer()
    encoded = chat.encode(tokenizer, CONVERSATION)
    assert len(encoded.input_ids) == len(encoded.loss_mask)
    assert encoded.input_ids == tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False),
                                          add_special_tokens=False)["input_ids"]
    kept = [t for t, m in zip(encoded.input_ids, encoded.loss_mask) if m]
    # The byte-level pre-tokenizer merges the header's newline with the reply's leading spaces: that token is the
    # reply's.
    assert tokenizer.decode(kept) == "\n    return a + b<|im_end|>\n    print(item)<|im_end|>"
    # The user's turns, the role headers and the newline after each end token carry no loss.
    dropped = tokenizer.decode([t for t, m in zip(encoded.input_ids, encoded.loss_mask) if not m])
    assert dropped == ("<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant"
                       "\n<|im_start|>user\nfor item in items:<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_does_not_render_prefixes_as_prefixes_is_refused():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = "{{ messages|length }}" + chat.CHATML_TEMPLATE
    with pytest.raises(chat.ChatError, match=r"data.jsonl:3: .*messages\[:1\] as a prefix"):
        chat.encode(tokenizer, CONVERSATION, where="data.jsonl:3")


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], "hello", [{"role": "user", "content": 3}]])
def test_bad_records_are_refused_with_their_place(messages):
    with pytest.raises(chat.ChatError, match="data.jsonl:7: "):
        chat.check_messages(messages, "data.jsonl:7")


def tiny_target(tokenizer, directory=None):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=16, max_position_embeddings=256,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.Qwen3ForCausalLM(config).eval()
    if directory is not None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return model


def test_regeneration_replaces_the_assistant_turns_by_the_targets_greedy_replies():
    tokenizer = chat_tokenizer()
    model = tiny_target(tokenizer)
    out = chat.regenerate(model, tokenizer, CONVERSATION[:3], max_new_tokens=6)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    assert out[0] == CONVERSATION[0] and out[2] == CONVERSATION[2]
    prompt = tokenizer(tokenizer.apply_chat_template(out[:3], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False, return_tensors="pt")["input_ids"]
    greedy = model.generate(prompt, do_sample=False, max_new_tokens=6, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    assert out[3]["content"] == tokenizer.decode(greedy[0, prompt.shape[1]:], skip_special_tokens=True)
    assert out[1]["content"] != CONVERSATION[1]["content"]  # the first reply is the target's too


def test_chat_records_stream_through_the_hf_producer(tmp_path, start_run):
    tokenizer = chat_tokenizer()
    tiny_target(tokenizer, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION[: 1 + i % 4]}) + "\n" for i in range(12)))
    socket = tmp_path / "hs.sock"
    run = start_run(write_pipe(tmp_path / "chat.pipe", f'stream(listen = "unix:{socket}")', hidden=32,
                               taps=(1, 2), vocab=len(tokenizer), batch_tokens=256, buckets=(64, 128)))
    producer = subprocess.run(
        [sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data", str(data),
         "--tap-layers", "1", "2", "--connect", f"unix:{socket}", "--model-dtype", "float32", "--batch-size", "4",
         "--regenerate", "8", "--epochs", "2", "--name", "chat"],
        capture_output=True, text=True, timeout=300)
    assert producer.returncode == 0, producer.stderr
    assert "(24 prompts), done" in producer.stderr, producer.stderr
    assert run.wait() == 0, run.stderr()
    assert run.summary()["steps"] >= 1
