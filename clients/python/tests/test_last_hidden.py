"""``last_hidden_states``, the target's final-norm output an ``eagle3`` drafter's teacher reads: transformers'
``hidden_states[-1]`` is what ``lm_head`` consumes (Llama and Qwen3), and the producer and ``hf`` send it when the
run's hello asks, after the small tensors and before ``hidden_states``, and not otherwise. The server here is a
stand-in that speaks the framing and keeps every message, so the tests need no binary."""

import json
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

from draftpipe_client import Producer
from draftpipe_client._safetensors import bf16_bits_to_float32

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from test_hf import WORDS, tiny_model  # noqa: E402  (after the importorskips test_hf needs too)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_last_hidden_states_entry_is_the_final_norm_output_lm_head_reads(family):
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(0)
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = model_class(config).eval()
    raw = {}
    model.model.layers[-1].register_forward_hook(
        lambda module, args, output: raw.setdefault("last", output[0] if isinstance(output, tuple) else output))
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # a norm that is not the identity
        ids = torch.randint(0, 64, (2, 9))
        out = model(input_ids=ids, output_hidden_states=True)
        last = out.hidden_states[-1]
        assert len(out.hidden_states) == config.num_hidden_layers + 1
        torch.testing.assert_close(model.lm_head(last), out.logits)
        torch.testing.assert_close(last, model.model.norm(raw["last"]))
        assert not torch.allclose(last, raw["last"])


class StandIn:
    """A stream server stand-in: answers the hello with ``reply``, acknowledges every message and keeps it."""

    def __init__(self, reply):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.hello, self.messages = None, []
        self.thread = threading.Thread(target=self._serve, args=(reply,), daemon=True)
        self.thread.start()

    @staticmethod
    def _frame(conn):
        def exactly(n):
            data = b""
            while len(data) < n:
                chunk = conn.recv(n - len(data))
                if not chunk:
                    raise ConnectionError("closed")
                data += chunk
            return data

        return exactly(struct.unpack("<Q", exactly(8))[0])

    @staticmethod
    def _send(conn, reply):
        body = json.dumps(reply).encode()
        conn.sendall(struct.pack("<Q", len(body)) + body)

    def _serve(self, reply):
        conn, _ = self.listener.accept()
        with conn:
            self.hello = json.loads(self._frame(conn))
            self._send(conn, {"ok": True, "slot": 0, "max_message_bytes": 1 << 22, "delivered": 0,
                              "largest_bucket": 64, "batch_tokens": 64, **reply})
            while True:
                body = self._frame(conn)
                if not body:
                    self._send(conn, {"ok": True, "done": True})
                    return
                self.messages.append(body)
                self._send(conn, {"ok": True, "batches": 1, "sequences": 1, "delivered": len(self.messages)})

    def tensors(self, index):
        """Message ``index`` as ``{name: array}`` (BF16 as float32) and its tensor names in data order."""
        blob = self.messages[index]
        (length,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + length])
        order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        loaded = safetensors_numpy.load(blob) if "BF16" not in {v["dtype"] for v in header.values()} else None
        arrays = {}
        for name in order:
            start, end = header[name]["data_offsets"]
            data = blob[8 + length + start : 8 + length + end]
            if header[name]["dtype"] == "BF16":
                arrays[name] = bf16_bits_to_float32(np.frombuffer(data, np.uint16)).reshape(header[name]["shape"])
            else:
                arrays[name] = loaded[name]
        return arrays, order


def test_the_producer_sends_last_hidden_states_only_when_the_run_asks():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 64, (2, 5))
    hidden = rng.standard_normal((2, 5, 16)).astype(np.float32)
    last = rng.standard_normal((2, 5, 8)).astype(np.float32)

    server = StandIn({"last_hidden_states": True})
    with Producer(server.address, hidden=8, tap_layers=[0, 1], vocab=64, hidden_dtype="f32") as producer:
        assert producer.wants_last_hidden_states
        with pytest.raises(ValueError, match="last_hidden_states"):
            producer.send(ids, hidden)
        with pytest.raises(ValueError, match=r"expected \(2, 5, 8\)"):
            producer.send(ids, hidden, last_hidden_states=last[:, :, :4])
        producer.send(ids, hidden, last_hidden_states=last)
    server.thread.join(10)
    arrays, order = server.tensors(0)
    # Before hidden_states: the server copies them from the part of the message it has already read.
    assert order == ["input_ids", "last_hidden_states", "hidden_states"]
    np.testing.assert_array_equal(arrays["last_hidden_states"], last)
    np.testing.assert_array_equal(arrays["hidden_states"], hidden)

    server = StandIn({})
    with Producer(server.address, hidden=8, tap_layers=[0, 1], vocab=64, hidden_dtype="f32") as producer:
        assert not producer.wants_last_hidden_states
        producer.send(ids, hidden, last_hidden_states=last)
    server.thread.join(10)
    _, order = server.tensors(0)
    assert order == ["input_ids", "hidden_states"], "no byte of them when the drafter does not read them"


def _final_norm_outputs(model_dir, sequences):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0].numpy()
                for s in sequences]


def _prompts(path, count):
    records = [[WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i % 6)] for i in range(count)]
    with open(path, "w") as out:
        for words in records:
            out.write(json.dumps({"text": " ".join(words)}) + "\n")


def test_hf_streams_the_final_norm_output_when_the_run_asks(tmp_path):
    tiny_model(tmp_path / "model")
    _prompts(tmp_path / "prompts.jsonl", 6)
    server = StandIn({"last_hidden_states": True})
    producer = subprocess.run(
        [sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data",
         str(tmp_path / "prompts.jsonl"), "--tap-layers", "1", "3", "--connect", server.address,
         "--model-dtype", "float32", "--dtype", "f32", "--name", "hf"],
        capture_output=True, text=True, timeout=300)
    assert producer.returncode == 0, producer.stderr
    server.thread.join(10)
    sent = [server.tensors(i)[0] for i in range(len(server.messages))]
    rows = [(m["input_ids"][r], m["loss_mask"][r], m["last_hidden_states"][r]) for m in sent
            for r in range(m["input_ids"].shape[0])]
    sequences = [ids[mask.astype(bool)].tolist() for ids, mask, _ in rows]
    expected = _final_norm_outputs(tmp_path / "model", sequences)
    assert len(rows) == 6
    for (_, mask, last), want in zip(rows, expected):
        np.testing.assert_allclose(last[: int(mask.sum())], want, rtol=1e-5, atol=1e-5)
        assert not last[int(mask.sum()):].any(), "padding is zero"


def test_hf_writes_last_hidden_states_when_asked(tmp_path):
    tiny_model(tmp_path / "model")
    _prompts(tmp_path / "prompts.jsonl", 5)
    out = tmp_path / "hs"
    for extra, expect in (([], False), (["--last-hidden-states"], True)):
        written = subprocess.run(
            [sys.executable, "-m", "draftpipe_client.hf", "--model", str(tmp_path / "model"), "--data",
             str(tmp_path / "prompts.jsonl"), "--tap-layers", "1", "3", "--write", str(out), "--dtype", "f32",
             "--model-dtype", "float32", *extra],
            capture_output=True, text=True, timeout=300)
        assert written.returncode == 0, written.stderr
        loaded = safetensors_numpy.load_file(str(out / "hs-00000.safetensors"))
        assert ("last_hidden_states" in loaded) == expect
    last = loaded["last_hidden_states"]
    assert last.shape == loaded["input_ids"].shape + (16,)
    sequences = [ids[mask.astype(bool)].tolist() for ids, mask in zip(loaded["input_ids"], loaded["loss_mask"])]
    for row, want in enumerate(_final_norm_outputs(tmp_path / "model", sequences)):
        np.testing.assert_allclose(last[row, : len(want)], want, rtol=1e-5, atol=1e-5)
