"""The producer's FP8 messages (``hidden_dtype="fp8_e4m3"``): ``hidden_states`` as ``F8_E4M3`` codes with a float32
``hidden_states_scale [N, S]`` before them (where the server reads them straight into the batch), the codes and
scales those of ``quantise_e4m3``, and half bf16's bytes per token plus the scale. A stand-in server that speaks
the framing, so the test needs no binary."""

import json
import socket
import struct
import threading

import numpy as np
import pytest

from draftpipe_client import Producer
from draftpipe_client._fp8 import dequantise_e4m3, quantise_e4m3

WELCOME = {"ok": True, "slot": 0, "max_message_bytes": 1 << 20, "delivered": 0}


def _recv_frame(conn):
    def exact(n):
        data = b""
        while len(data) < n:
            data += conn.recv(n - len(data))
        return data

    (length,) = struct.unpack("<Q", exact(8))
    return exact(length)


def _send_frame(conn, reply):
    body = json.dumps(reply).encode()
    conn.sendall(struct.pack("<Q", len(body)) + body)


def _serve(listener, messages):
    conn, _ = listener.accept()
    with conn:
        _recv_frame(conn)
        _send_frame(conn, WELCOME)
        messages.append(_recv_frame(conn))
        _send_frame(conn, {"ok": True, "batches": 0, "sequences": 2, "delivered": 1})


@pytest.fixture
def server():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    yield listener
    listener.close()


def _tensors(blob):
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    data = blob[8 + header_len :]
    return {name: (info, data[info["data_offsets"][0] : info["data_offsets"][1]])
            for name, info in header.items() if name != "__metadata__"}


def test_an_fp8_producer_sends_codes_with_their_scales_first(server):
    messages = []
    thread = threading.Thread(target=_serve, args=(server, messages), daemon=True)
    thread.start()
    address = "127.0.0.1:%d" % server.getsockname()[1]
    hidden, taps = 8, [0, 1]
    rng = np.random.default_rng(7)
    hs = (rng.standard_normal((2, 5, hidden * len(taps))) * 3).astype(np.float32)
    hs[1, 2] = 0.0
    ids = rng.integers(0, 64, (2, 5))
    with Producer(address, hidden=hidden, tap_layers=taps, vocab=64, hidden_dtype="fp8_e4m3") as producer:
        producer.send(input_ids=ids, hidden_states=hs)
        producer._done = True
    thread.join(5)
    tensors = _tensors(messages[0])
    (hs_info, codes), (scale_info, scales) = tensors["hidden_states"], tensors["hidden_states_scale"]
    assert hs_info["dtype"] == "F8_E4M3" and hs_info["shape"] == [2, 5, 16]
    assert scale_info["dtype"] == "F32" and scale_info["shape"] == [2, 5]
    assert scale_info["data_offsets"][1] <= hs_info["data_offsets"][0], "the scales come before the codes"
    want_codes, want_scales = quantise_e4m3(hs)
    codes = np.frombuffer(codes, np.uint8).reshape(2, 5, 16)
    scales = np.frombuffer(scales, "<f4").reshape(2, 5)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)
    assert scales[1, 2] == 1.0, "a zero row's scale is 1"
    np.testing.assert_allclose(dequantise_e4m3(codes, scales), hs, rtol=1 / 16, atol=1e-6)
    # Bytes per token on the wire: 16 codes and a 4-byte scale, against bf16's 32.
    tokens = 2 * 5
    assert (codes.nbytes // tokens, scales.nbytes // tokens) == (16, 4)
