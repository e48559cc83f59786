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


def tiny_model(directory, spare_rows=0):
    """A random Llama target with a word-level tokenizer; its embedding has ``spare_rows`` rows past the tokens."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                                                pad_token="[PAD]", eos_token="[EOS]")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab) + spare_rows, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=0, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return len(vocab) + spare_rows


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
         "--model-dtype", "float32", "--name", "hf"],
        capture_output=True, text=True, timeout=300)
    assert producer.returncode == 0, producer.stderr
    assert "40/40" in producer.stderr or "40it" in producer.stderr or "40/40" in producer.stdout, producer.stderr
    assert run.wait() == 0, run.stderr()
    summary = run.summary()
    assert summary["steps"] >= 5
    assert math.isfinite(summary["final_loss"])
    assert "producer `hf` connected" in run.stderr()
    assert "40 prompts" in producer.stderr.splitlines()[-1], producer.stderr


def bucket_of(length, buckets):
    return next(b for b in buckets if length <= b)


def mixed_prompts(path, count, shortest, longest, seed=5):
    """`count` prompts of uniformly mixed lengths (one token per word with the tiny tokenizer)."""
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(shortest, longest) for _ in range(count)]
    with open(path, "w") as out:
        for i, n in enumerate(lengths):
            out.write(json.dumps({"text": " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(n))}) + "\n")
    return lengths


def hf_command(model, prompts, address, *extra):
    return [sys.executable, "-m", "draftpipe_client.hf", "--model", str(model), "--data", str(prompts),
            "--tap-layers", "1", "3", "--connect", address, "--model-dtype", "float32", *extra]


def test_mixed_lengths_fill_the_queue_items(tmp_path, start_run):
    """The documented path with mixed lengths: `hf` (8 prompts per forward pass) into a plan of 4 buckets.
    Rows of consecutive messages share items, so the slots trained are the rows' buckets plus at most one
    part-filled item per bucket at the end; before, each message's last item of every bucket was padded and
    29% of the slots held a real token."""
    vocab = tiny_model(tmp_path / "model")
    buckets = (32, 64, 96, 128)
    lengths = mixed_prompts(tmp_path / "prompts.jsonl", 160, 8, 128)
    socket = tmp_path / "hs.sock"
    run = start_run(write_pipe(tmp_path / "fill.pipe", f'stream(listen = "unix:{socket}")', hidden=16,
                               taps=(1, 3), vocab=vocab, batch_tokens=512, buckets=buckets))
    producer = subprocess.run(hf_command(tmp_path / "model", tmp_path / "prompts.jsonl", f"unix:{socket}"),
                              capture_output=True, text=True, timeout=300)
    assert producer.returncode == 0, producer.stderr
    assert run.wait() == 0, run.stderr()
    summary = run.summary()
    slots = summary["token_slots"]
    real = sum(lengths)
    # The run counts the real tokens it trained on beside the slots: every prompt's tokens, exactly.
    assert summary["real_tokens"] == real, summary
    assert 0 < summary["loss_tokens"] <= real
    bucket_bound = sum(bucket_of(n, buckets) for n in lengths)
    print(f"fill: {real} real tokens in {slots} slots = {real / slots:.3f} (rows' buckets: {real / bucket_bound:.3f})")
    # Only the last item of each bucket may be part-filled (measured: 13056 of 14112 slots are the rows' buckets,
    # 0.756 real; before, 0.290 real in 36832 slots).
    assert slots <= bucket_bound + len(buckets) * 512
    assert bucket_bound / slots >= 0.9 and real / slots >= 0.7


def test_hf_stops_with_one_line_when_the_run_ends_and_resumes_by_itself(tmp_path, start_run):
    vocab = tiny_model(tmp_path / "model")
    mixed_prompts(tmp_path / "prompts.jsonl", 120, 8, 60)
    socket = tmp_path / "hs.sock"
    pipe = write_pipe(tmp_path / "steps.pipe", f'stream(listen = "unix:{socket}")', hidden=16, taps=(1, 3),
                      vocab=vocab, batch_tokens=256, buckets=(32, 64), steps=4)
    run = start_run(pipe)
    command = hf_command(tmp_path / "model", tmp_path / "prompts.jsonl", f"unix:{socket}", "--name", "gpu0")
    first = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    # "the run has ended" between messages, or "the run is stopping: this message was not queued" inside one.
    last = first.stderr.splitlines()[-1]
    assert last.startswith("draftpipe: the run ") and last.endswith("this producer stops"), first.stderr
    assert "Traceback" not in first.stderr, first.stderr
    assert run.wait() == 0, run.stderr()

    # The checkpoint keeps the producer's name and count: a resumed run tells `hf` where to go on.
    delivered = json.loads((run.save / "training_state" / "state.json").read_text())["stream_producers"][0]
    assert (delivered["name"], delivered["slot"]) == ("gpu0", 0), delivered
    resumed = start_run(pipe, "--resume", str(run.save), "--steps", "8")
    second = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert f"acknowledged {delivered['delivered']} messages; resuming after" in second.stderr, second.stderr
    assert resumed.wait() == 0, resumed.stderr()
    assert resumed.summary()["steps"] == 4  # the steps of this run: 4 to 8


def test_hf_writes_hidden_state_files_the_file_source_reads(tmp_path, start_run):
    """`--write` makes the file source's format (what `draftpipe eval --data` reads too; eval itself needs a
    DFlash plan with target weights, which this tiny Llama does not make)."""
    vocab = tiny_model(tmp_path / "model")
    mixed_prompts(tmp_path / "held-out.jsonl", 12, 4, 30)
    written = subprocess.run(
        [sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data",
         str(tmp_path / "held-out.jsonl"), "--tap-layers", "1", "3", "--write", str(tmp_path / "held-out"),
         "--model-dtype", "float32", "--batch-size", "5"], capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr
    assert "wrote 3 files (12 sequences)" in written.stderr, written.stderr
    pipe = write_pipe(tmp_path / "train.pipe", f'safetensors(path = "{tmp_path}/held-out/*.safetensors")',
                      hidden=16, taps=(1, 3), vocab=vocab, steps=3)
    run = start_run(pipe)
    assert run.wait() == 0, run.stderr()
    assert run.summary()["steps"] == 3


def test_hf_refusals_are_one_line(tmp_path):
    tiny_model(tmp_path / "model")
    (tmp_path / "bad.jsonl").write_text('{"text": "w1 w2"}\n{"oops": 1}\n')
    refused = subprocess.run(
        [sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data",
         str(tmp_path / "bad.jsonl"), "--tap-layers", "1", "--write", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"error: {tmp_path / 'bad.jsonl'}:2: a line needs `text`, `input_ids` or `messages`"
    described = subprocess.run([sys.executable, "-m", "draftpipe_client.hf", "--help"], capture_output=True,
                               text=True, timeout=60)
    assert "Hugging Face" in described.stdout and "--dtype {bf16,f16,f32,fp8_e4m3}" in described.stdout


def test_hf_adds_the_mask_token_when_the_tokenizer_has_none_and_prints_its_id(tmp_path):
    # A tokenizer without `<|mask|>` over an embedding with spare rows (as Qwen3's 151936 rows over 151669 tokens).
    vocab = tiny_model(tmp_path / "model", spare_rows=5)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"text": "w1 w2 w3"}) + "\n")
    hf = subprocess.run([sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data",
                         str(tmp_path / "prompts.jsonl"), "--tap-layers", "1", "3", "--model-dtype", "float32",
                         "--write", str(tmp_path / "out"), "--save-tokenizer", str(tmp_path / "tokenizer")],
                        capture_output=True, text=True, timeout=300)
    assert hf.returncode == 0, hf.stderr
    mask_id = len(WORDS) + 3
    assert mask_id < vocab
    assert f"mask token <|mask|> = {mask_id} (added to the tokenizer" in hf.stderr, hf.stderr
    assert f"`mask_token = {mask_id}`" in hf.stderr
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert saved.convert_tokens_to_ids("<|mask|>") == mask_id
    # A mask token the tokenizer has is found, not added.
    again = subprocess.run([sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"),
                            "--data", str(tmp_path / "prompts.jsonl"), "--tap-layers", "1", "--model-dtype",
                            "float32", "--write", str(tmp_path / "out2"), "--mask-token", "w5"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "mask token w5 = 8 (in the tokenizer)" in again.stderr, again.stderr


def test_hf_says_when_no_row_is_free_for_a_mask_token(tmp_path):
    tiny_model(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"text": "w1 w2 w3"}) + "\n")
    hf = subprocess.run([sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data",
                         str(tmp_path / "prompts.jsonl"), "--tap-layers", "1", "--model-dtype", "float32",
                         "--write", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert hf.returncode == 0, hf.stderr
    assert "note: the tokenizer has no <|mask|>" in hf.stderr and "--mask-token" in hf.stderr, hf.stderr
