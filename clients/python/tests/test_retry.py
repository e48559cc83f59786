"""A hello refused only for now (draftpipe's handshake or producer slots all taken) is tried again with backoff; a
refusal for cause is not. The server here is a stand-in that speaks the framing, so the test needs no binary."""

import json
import socket
import struct
import threading

import pytest

from draftpipe_client import Producer, ProducerError


def _recv_frame(conn):
    header = b""
    while len(header) < 8:
        header += conn.recv(8 - len(header))
    (length,) = struct.unpack("<Q", header)
    body = b""
    while len(body) < length:
        body += conn.recv(length - len(body))
    return body


def _send_frame(conn, reply):
    body = json.dumps(reply).encode()
    conn.sendall(struct.pack("<Q", len(body)) + body)


def _serve(listener, replies, hellos):
    for reply in replies:
        conn, _ = listener.accept()
        with conn:
            hellos.append(json.loads(_recv_frame(conn)))
            _send_frame(conn, reply)


@pytest.fixture
def server():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    yield listener
    listener.close()


def _run(listener, replies):
    hellos = []
    thread = threading.Thread(target=_serve, args=(listener, replies, hellos), daemon=True)
    thread.start()
    return hellos, thread


# The server's refusal for now when newer connections displace a slow hello (runtime's stream handshake).
BUSY = {
    "ok": False,
    "error": "0 of 187 bytes of the hello had arrived when newer connections needed the place (64 connections "
    "may wait for their hello, 8 from one remote address): try again, sending the hello as you connect",
    "retry": True,
}
WELCOME = {"ok": True, "slot": 0, "max_message_bytes": 1 << 20, "delivered": 3}


def test_a_busy_refusal_is_retried_until_a_slot_frees(server):
    hellos, thread = _run(server, [BUSY, BUSY, WELCOME])
    address = "127.0.0.1:%d" % server.getsockname()[1]
    producer = Producer(address, hidden=8, tap_layers=[0, 1], vocab=64, name="p0", connect_timeout=10)
    thread.join(5)
    assert len(hellos) == 3
    assert producer.slot == 0 and producer.delivered == 3
    producer._socket.close()


def test_a_refusal_for_cause_raises_at_once(server):
    hellos, thread = _run(server, [{"ok": False, "error": "wrong token"}, WELCOME])
    address = "127.0.0.1:%d" % server.getsockname()[1]
    with pytest.raises(ProducerError, match="wrong token"):
        Producer(address, hidden=8, tap_layers=[0, 1], vocab=64, connect_timeout=10)
    assert len(hellos) == 1


def test_a_busy_server_past_the_timeout_raises_its_reason(server):
    _run(server, [BUSY] * 100)
    address = "127.0.0.1:%d" % server.getsockname()[1]
    with pytest.raises(ProducerError, match="newer connections needed the place"):
        Producer(address, hidden=8, tap_layers=[0, 1], vocab=64, connect_timeout=0.5)
