"""End-to-end: the Python producer against the real `draftpipe run` binary on loopback sockets."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for, write_pipe
from draftpipe_client import Producer, ProducerError
from draftpipe_client._safetensors import Tensor, float32_to_bf16_bits, serialize

HIDDEN, TAPS, VOCAB = 8, (0, 1), 64
WIDTH = HIDDEN * len(TAPS)
HERE = Path(__file__).resolve().parent


def test_streamed_data_trains_exactly_like_the_same_data_from_a_file(tmp_path, start_run):
    """One producer, fifo: every message is one full item of bucket 32 (2 sequences of 32 tokens), so the file
    source (one file, the same rows in the same order) makes the same batches, and the two runs must end with
    bit-identical weights and the same final loss."""
    messages, rows, seq = 12, 2, 32
    rng = np.random.default_rng(11)
    ids = rng.integers(0, VOCAB, (messages * rows, seq))
    hs = rng.standard_normal((messages * rows, seq, WIDTH)).astype(np.float32)
    mask = np.ones((messages * rows, seq), np.uint8)
    parts, _ = serialize({
        "hidden_states": Tensor(float32_to_bf16_bits(hs), "BF16"),
        "input_ids": Tensor(ids),
        "loss_mask": Tensor(mask),
    })
    data = tmp_path / "hs.safetensors"
    data.write_bytes(b"".join(bytes(p) for p in parts))

    from_file = start_run(write_pipe(tmp_path / "file.pipe", f'safetensors(path = "{data}")'))
    assert from_file.wait() == 0, from_file.stderr()

    socket = tmp_path / "hs.sock"
    streamed = start_run(write_pipe(tmp_path / "stream.pipe", f'stream(listen = "unix:{socket}")'))
    with Producer(f"unix:{socket}", hidden=HIDDEN, tap_layers=TAPS, vocab=VOCAB) as producer:
        for m in range(messages):
            rows_m = slice(m * rows, (m + 1) * rows)
            ack = producer.send(input_ids=ids[rows_m], hidden_states=hs[rows_m], loss_mask=mask[rows_m])
            assert (ack.batches, ack.sequences) == (1, rows)
    assert streamed.wait() == 0, streamed.stderr()
    assert f"listening on unix:{socket}" in streamed.stderr()

    file_summary, stream_summary = from_file.summary(), streamed.summary()
    assert file_summary["steps"] == stream_summary["steps"] == messages
    assert file_summary["final_loss"] == stream_summary["final_loss"]
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    weights = [safetensors_numpy.load_file(str(run.save / "model.safetensors")) for run in (from_file, streamed)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        # Bit-identical: the same batches in the same order through the same steps.
        np.testing.assert_array_equal(weights[0][name], weights[1][name], err_msg=name)


def test_bad_producers_are_refused_and_the_run_goes_on(tmp_path, start_run):
    socket = tmp_path / "hs.sock"
    os.environ["TEST_STREAM_TOKEN"] = "correct horse"
    run = start_run(write_pipe(tmp_path / "bad.pipe",
                               f'stream(listen = "unix:{socket}", token = env("TEST_STREAM_TOKEN"))'))
    address = f"unix:{socket}"
    with pytest.raises(ProducerError, match="wrong token"):
        Producer(address, hidden=HIDDEN, tap_layers=TAPS, vocab=VOCAB, token="battery staple")
    with pytest.raises(ProducerError, match="hidden 9 does not match the plan's hidden 8"):
        Producer(address, hidden=9, tap_layers=TAPS, vocab=VOCAB, token="correct horse")
    wide = Producer(address, hidden=HIDDEN, tap_layers=TAPS, vocab=VOCAB, token="correct horse", name="wide")
    wide.width += 1  # lie about the width: the server's checks must catch it, not the client's
    with pytest.raises(ProducerError, match=r"hidden_states.*\[N, S, 16\]"):
        wide.send(input_ids=np.zeros((1, 8), np.int64), hidden_states=np.zeros((1, 8, WIDTH + 1), np.float32))
    with Producer(address, hidden=HIDDEN, tap_layers=TAPS, vocab=VOCAB, token="correct horse") as good:
        ack = good.send(input_ids=[np.arange(5), np.arange(20)],
                        hidden_states=[np.ones((5, WIDTH), np.float32), np.ones((20, WIDTH), np.float32)])
        # Lengths 5 and 20: buckets 16 and 32, whose items (4 and 2 sequences) wait open for more rows.
        assert (ack.batches, ack.sequences) == (0, 2)
    assert run.wait() == 0, run.stderr()
    log = run.stderr()
    assert "refused: wrong token" in log and "hidden_states" in log, log
    assert run.summary()["steps"] == 2


def test_five_producers_one_killed_and_restarted_train_on_every_acknowledged_batch(tmp_path, start_run):
    socket = tmp_path / "hs.sock"
    run = start_run(write_pipe(tmp_path / "five.pipe", f'stream(listen = "unix:{socket}")', producers=5))
    address, messages, victim = f"unix:{socket}", 6, "p3"
    logs = {f"p{i}": tmp_path / f"acks-p{i}.log" for i in range(5)}

    def producer(name, first, count, *extra):
        return subprocess.Popen([sys.executable, str(HERE / "producer_proc.py"), address, name, str(first),
                                 str(count), str(logs[name]), *extra])

    processes = [producer(name, 0, messages, *(["--hang-after", "2"] if name == victim else []))
                 for name in logs]
    wait_for(lambda: logs[victim].exists() and len(logs[victim].read_text().splitlines()) == 2,
             what="two acknowledgements of the victim")
    victim_index = list(logs).index(victim)
    processes[victim_index].send_signal(signal.SIGKILL)
    processes[victim_index].wait()
    processes[victim_index] = producer(victim, 2, messages - 2)
    for process in processes:
        assert process.wait(timeout=300) == 0
    assert run.wait() == 0, run.stderr()

    acknowledged = sum(int(line.split()[1]) for log in logs.values() for line in log.read_text().splitlines())
    assert all(len(log.read_text().splitlines()) == messages + 1 for log in logs.values())
    # Every acknowledged item trained, plus the victim's part-filled items (at most one per bucket), queued
    # when its connection closed.
    assert acknowledged <= run.summary()["steps"] <= acknowledged + 2
    assert "producer `p3` connected as slot" in run.stderr()
    assert "producers=[" in run.stdout(), run.stdout()
