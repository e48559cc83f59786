"""A draftpipe that stops answering raises ``ProducerTimeout``, a ``ProducerError`` and so a ``DraftpipeError``,
naming what the producer waited for, how long and where: never a bare ``socket.timeout``/``OSError``. The
server is a plain socket that speaks the framing, so the test needs no binary."""

import json
import socket
import struct
import threading

import numpy as np
import pytest

from draftpipe_client import DraftpipeError, Producer, ProducerError, ProducerTimeout


@pytest.fixture
def server():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    yield listener
    listener.close()


def _address(listener):
    return "127.0.0.1:%d" % listener.getsockname()[1]


def _accept_and_hold(listener, held, answer_hello=False):
    """Accepts one connection and keeps it open; with ``answer_hello``, welcomes the hello first."""
    conn, _ = listener.accept()
    held.append(conn)
    if answer_hello:
        header = b""
        while len(header) < 8:
            header += conn.recv(8 - len(header))
        (length,) = struct.unpack("<Q", header)
        body = b""
        while len(body) < length:
            body += conn.recv(length - len(body))
        reply = json.dumps({"ok": True, "slot": 0, "max_message_bytes": 1 << 20}).encode()
        conn.sendall(struct.pack("<Q", len(reply)) + reply)


def _hold(listener, answer_hello=False):
    held = []
    thread = threading.Thread(target=_accept_and_hold, args=(listener, held, answer_hello), daemon=True)
    thread.start()
    return held, thread


def test_a_hello_never_answered_raises_producer_timeout(server):
    held, thread = _hold(server)
    try:
        with pytest.raises(ProducerTimeout) as caught:
            Producer(_address(server), hidden=8, tap_layers=[0, 1], vocab=64, connect_timeout=5, timeout=0.5)
        error = caught.value
        assert isinstance(error, ProducerError) and isinstance(error, DraftpipeError)
        message = str(error)
        assert "hello" in message and "0.5 s" in message and _address(server) in message, message
        assert isinstance(error.__cause__, (socket.timeout, TimeoutError))
    finally:
        thread.join(5)
        for conn in held:
            conn.close()


def test_an_acknowledgement_never_sent_raises_producer_timeout(server):
    held, thread = _hold(server, answer_hello=True)
    try:
        producer = Producer(_address(server), hidden=8, tap_layers=[0, 1], vocab=64, connect_timeout=5,
                            timeout=0.5)
        with pytest.raises(ProducerTimeout, match="acknowledgement of message 1") as caught:
            producer.send(input_ids=np.arange(4), hidden_states=np.zeros((4, 16), np.float32))
        assert isinstance(caught.value, DraftpipeError) and _address(server) in str(caught.value)
        producer.close()
    finally:
        thread.join(5)
        for conn in held:
            conn.close()
