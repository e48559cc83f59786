"""End-to-end FP8: the Python producer streaming ``hidden_dtype="fp8_e4m3"`` and a shard written the way
``hf --write --dtype fp8_e4m3`` writes it (``F8_E4M3`` codes with ``hidden_states_scale``), each into a real
``draftpipe run`` with ``hs_dtype = fp8_e4m3``, train bit-identically; and the fp8 run stays close to bf16's."""

import numpy as np
import pytest

from conftest import write_pipe
from draftpipe_client import Producer
from draftpipe_client._fp8 import quantise_e4m3
from draftpipe_client._safetensors import Tensor, float32_to_bf16_bits, serialize

HIDDEN, TAPS, VOCAB = 8, (0, 1), 64
WIDTH = HIDDEN * len(TAPS)
MESSAGES, ROWS, SEQ = 12, 2, 32


def pipe_in(path, source, hs_dtype):
    """``conftest.write_pipe``'s plan with ``hs_dtype`` on its target."""
    pipe = write_pipe(path, source)
    text = pipe.read_text()
    line = f"    source       = {source}\n"
    assert line in text
    pipe.write_text(text.replace(line, f"{line}    hs_dtype     = {hs_dtype}\n"))
    return pipe


def data():
    rng = np.random.default_rng(11)
    ids = rng.integers(0, VOCAB, (MESSAGES * ROWS, SEQ))
    hs = rng.standard_normal((MESSAGES * ROWS, SEQ, WIDTH)).astype(np.float32)
    return ids, hs, np.ones((MESSAGES * ROWS, SEQ), np.uint8)


def write_shard(path, tensors):
    parts, _ = serialize(tensors)
    path.write_bytes(b"".join(bytes(p) for p in parts))


def test_fp8_streamed_and_from_an_fp8_shard_train_alike_and_near_bf16(tmp_path, start_run):
    ids, hs, mask = data()
    codes, scales = quantise_e4m3(hs)
    fp8_shard = tmp_path / "fp8.safetensors"
    write_shard(fp8_shard, {"input_ids": Tensor(ids), "loss_mask": Tensor(mask),
                            "hidden_states_scale": Tensor(scales), "hidden_states": Tensor(codes, "F8_E4M3")})
    bf16_shard = tmp_path / "bf16.safetensors"
    write_shard(bf16_shard, {"input_ids": Tensor(ids), "loss_mask": Tensor(mask),
                             "hidden_states": Tensor(float32_to_bf16_bits(hs), "BF16")})

    from_file = start_run(pipe_in(tmp_path / "file.pipe", f'safetensors(path = "{fp8_shard}")', "fp8_e4m3"))
    assert from_file.wait() == 0, from_file.stderr()
    bf16 = start_run(pipe_in(tmp_path / "bf16.pipe", f'safetensors(path = "{bf16_shard}")', "bf16"))
    assert bf16.wait() == 0, bf16.stderr()

    socket = tmp_path / "hs.sock"
    streamed = start_run(pipe_in(tmp_path / "stream.pipe", f'stream(listen = "unix:{socket}")', "fp8_e4m3"))
    with Producer(f"unix:{socket}", hidden=HIDDEN, tap_layers=TAPS, vocab=VOCAB, hidden_dtype="fp8_e4m3") as p:
        for m in range(MESSAGES):
            rows = slice(m * ROWS, (m + 1) * ROWS)
            ack = p.send(input_ids=ids[rows], hidden_states=hs[rows], loss_mask=mask[rows])
            assert (ack.batches, ack.sequences) == (1, ROWS)
    assert streamed.wait() == 0, streamed.stderr()

    file_summary, stream_summary = from_file.summary(), streamed.summary()
    assert file_summary["steps"] == stream_summary["steps"] == MESSAGES
    assert file_summary["final_loss"] == stream_summary["final_loss"]
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    weights = [safetensors_numpy.load_file(str(run.save / "model.safetensors")) for run in (from_file, streamed)]
    for name in weights[0]:
        # Bit-identical: the same codes and scales, the same batches in the same order.
        np.testing.assert_array_equal(weights[0][name], weights[1][name], err_msg=name)
    bf16_loss = bf16.summary()["final_loss"]
    print(f"final loss: fp8 file {file_summary['final_loss']}, fp8 stream {stream_summary['final_loss']}, bf16 {bf16_loss}")
    assert abs(file_summary["final_loss"] - bf16_loss) <= 0.02 * abs(bf16_loss), (file_summary, bf16_loss)
