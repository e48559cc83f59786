"""The producer side of draftpipe's stream protocol.

Every frame is an 8-byte little-endian length and that many bytes. The producer sends a JSON hello (protocol
version, the target's ``hidden``, ``tap_layers`` and ``vocab``, a token, a producer name) and gets a JSON
reply; then each message is one safetensors blob (``input_ids [N, S]``, ``hidden_states [N, S, D]``, optional
``loss_mask [N, S]``, ``last_hidden_states [N, S, hidden]`` when the reply says the plan's drafter reads
them, and ``hidden_states_scale [N, S]`` float32 beside ``F8_E4M3`` hidden states), answered by a JSON acknowledgement once its batches are in draftpipe's queue. An empty
frame says the producer is done. Any error is one reply ``{"ok": false, "error": ...}``, then the server closes.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Dict, Iterable, Literal, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import DTypeLike, NDArray

from ._fp8 import quantise_e4m3
from ._safetensors import Tensor, bf16_bits_to_float32, float32_to_bf16_bits, serialize

PROTOCOL_VERSION = 1

#: An array and the safetensors dtype it already has (``"BF16"`` for bfloat16 bit patterns), or ``None``.
_Converted = Tuple[NDArray[Any], Optional[str]]
#: A JSON reply of draftpipe.
_Reply = Dict[str, Any]

_HIDDEN_DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32", "fp8_e4m3": "F8_E4M3"}


class DraftpipeError(RuntimeError):
    """The base of every error this package raises."""


class ProducerError(DraftpipeError):
    """draftpipe refused the hello or a message (its reason is the message), or the connection failed."""


class ProducerTimeout(ProducerError):
    """draftpipe did not answer (or did not read what was sent) within the producer's ``timeout``: the message
    says what was awaited, for how long and from which address. The run may be stalled or the address wrong."""


class _Busy(ProducerError):
    """A hello refused only for now (every handshake or producer slot taken): worth trying again."""


class RunEnded(ProducerError):
    """The run stopped (it reached its step limit, got a signal or failed): nothing more will be accepted.

    Not a fault of the producer: a producer that gets it should exit normally, not reconnect."""


@dataclass
class Ack:
    """What draftpipe acknowledged for one :meth:`Producer.send` (summed over the messages it was split into)."""

    messages: int = 0
    batches: int = 0
    sequences: int = 0
    delivered: int = 0


def _to_numpy(value: Any, name: str) -> _Converted:
    """A numpy array from a numpy array, a torch tensor (any device; bfloat16 kept as BF16) or a list.

    Returns ``(array, safetensors_dtype_or_None)``."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        tensor = value.detach()
        if tensor.dtype == torch.bfloat16:
            bits = tensor.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
            return bits, "BF16"
        return tensor.contiguous().cpu().numpy(), None
    if isinstance(value, np.ndarray):
        return value, None
    try:
        return np.asarray(value), None
    except Exception as error:  # noqa: BLE001 - any conversion failure is the caller's type error
        raise TypeError(f"`{name}` must be a numpy array or a torch tensor") from error


def _pad_ragged(sequences: Sequence[NDArray[Any]], width: Tuple[int, ...], dtype: DTypeLike) -> NDArray[Any]:
    """Stacks 1-D (or ``[S, D]``) arrays of different lengths into one right-padded array."""
    longest = max(len(s) for s in sequences)
    shape = (len(sequences), longest) + tuple(width)
    out = np.zeros(shape, dtype=dtype)
    for row, sequence in enumerate(sequences):
        out[row, : len(sequence)] = sequence
    return out


class Producer:
    """One producer connection to ``draftpipe run``.

    ``address`` is ``"HOST:PORT"`` or ``"unix:/path"``; ``hidden``, ``tap_layers`` and ``vocab`` must match the
    plan's target stage; ``token`` defaults to ``$DRAFTPIPE_TOKEN``. ``name`` identifies this producer across
    reconnects (default: host name and process id); a restarted producer that reuses its name takes its slot
    back and learns from :attr:`delivered` how many messages were acknowledged before. ``hidden_dtype``
    (``"bf16"``, ``"f16"``, ``"f32"``, ``"fp8_e4m3"`` or ``None`` to send floats as given) converts hidden states
    before sending; ``"fp8_e4m3"`` quantises each token's row with its own scale (``_fp8.quantise_e4m3``: a byte
    per value and 4 per token, against bf16's 2 per value), and sends ``last_hidden_states``, if any, in bf16. For ``connect_timeout`` seconds the producer keeps trying while the run is still starting and while
    draftpipe refuses it only for now (every handshake or producer slot taken), waiting longer after each
    refusal; a refusal for cause (wrong token, shapes that do not match the plan) raises at once.
    """

    def __init__(
        self,
        address: str,
        hidden: int,
        tap_layers: Iterable[int],
        vocab: int,
        token: str | None = None,
        name: str | None = None,
        hidden_dtype: str | None = "bf16",
        connect_timeout: float = 30.0,
        timeout: float | None = 600.0,
    ) -> None:
        if hidden_dtype is not None and hidden_dtype not in _HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype must be one of {sorted(_HIDDEN_DTYPES)} or None")
        self.address = address
        self.hidden = int(hidden)
        self.tap_layers = [int(layer) for layer in tap_layers]
        self.vocab = int(vocab)
        self.width = self.hidden * len(self.tap_layers)
        self.hidden_dtype = hidden_dtype
        #: Seconds each send or receive may wait for draftpipe (``None``: for ever) before ``ProducerTimeout``.
        self.timeout = timeout
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        token = os.environ.get("DRAFTPIPE_TOKEN", "") if token is None else token
        deadline = time.monotonic() + connect_timeout
        backoff = 0.05
        while True:
            self._socket = self._connect(address, max(deadline - time.monotonic(), 0.0), timeout)
            try:
                reply = self._hello(token)
                break
            except _Busy:
                self._socket.close()
                if time.monotonic() + backoff >= deadline:
                    raise
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 2.0)
            except BaseException:
                self._socket.close()
                raise
        self.slot: int = reply["slot"]
        self.max_message_bytes: int = reply["max_message_bytes"]
        self.delivered: int = reply.get("delivered", 0)
        #: The plan's largest bucket: a longer sequence is refused (``None`` from a server before it was sent).
        self.largest_bucket: int | None = reply.get("largest_bucket")
        #: Token slots of one queue item (the plan's ``batch_tokens``), or ``None`` from an older server.
        self.batch_tokens: int | None = reply.get("batch_tokens")
        #: Whether the plan's drafter reads the target's final-norm output (``eagle3``): every :meth:`send` must
        #: then give ``last_hidden_states``; otherwise they are not sent.
        self.wants_last_hidden_states = bool(reply.get("last_hidden_states", False))
        self._done = False

    @staticmethod
    def _connect(address: str, connect_timeout: float, timeout: float | None) -> socket.socket:
        deadline = time.monotonic() + connect_timeout
        while True:
            sock: socket.socket | None = None
            try:
                if address.startswith("unix:"):
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.connect(address[len("unix:") :])
                else:
                    host, _, port = address.rpartition(":")
                    sock = socket.create_connection((host.strip("[]"), int(port)))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(timeout)
                return sock
            except (ConnectionRefusedError, FileNotFoundError):
                if sock is not None:
                    sock.close()
                if time.monotonic() >= deadline:
                    raise ProducerError(f"nothing listens on {address}") from None
                time.sleep(0.05)
            except (socket.timeout, TimeoutError) as error:
                if sock is not None:
                    sock.close()
                raise ProducerTimeout(f"connecting to draftpipe at {address} timed out ({error})") from error
            except OSError as error:
                # Unreachable network, unknown host, a path that is no socket...: nothing a retry would fix.
                if sock is not None:
                    sock.close()
                raise ProducerError(f"cannot connect to draftpipe at {address}: {error}") from error

    def _frame(self, parts: Iterable[Any], length: int, what: str) -> None:
        """Sends one frame of ``length`` bytes (``parts``: buffers); ``what`` names it in errors."""
        try:
            self._socket.sendall(struct.pack("<Q", length))
            for part in parts:
                self._socket.sendall(part)
        except OSError as error:
            # The server stopped reading: it may have said why (the run ended) before it closed.
            timed_out = isinstance(error, (socket.timeout, TimeoutError))
            try:
                self._socket.settimeout(1.0)
                self._reply("the reason draftpipe stopped reading")
            except ProducerTimeout:
                pass
            except ProducerError:
                raise
            except (OSError, ValueError, struct.error):
                pass
            if timed_out:
                raise ProducerTimeout(
                    f"draftpipe at {self.address} did not read {what} for {self.timeout} s (timeout)"
                ) from error
            raise ProducerError(f"draftpipe closed the connection while a message was sent ({error})") from error

    def _recv_exact(self, n: int, what: str) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            try:
                chunk = self._socket.recv(n - len(chunks))
            except (socket.timeout, TimeoutError) as error:
                raise ProducerTimeout(
                    f"no {what} from draftpipe at {self.address} within {self._socket.gettimeout()} s (timeout)"
                ) from error
            if not chunk:
                raise ProducerError("draftpipe closed the connection")
            chunks += chunk
        return bytes(chunks)

    def _reply(self, what: str) -> _Reply:
        """The next JSON reply (``what``: what it answers, for errors); raises the refusal it carries."""
        try:
            (length,) = struct.unpack("<Q", self._recv_exact(8, what))
            reply: _Reply = json.loads(self._recv_exact(length, what))
        except ConnectionError as error:
            raise ProducerError(f"draftpipe closed the connection ({error})") from None
        except OSError as error:
            raise ProducerError(f"receiving {what} from draftpipe at {self.address} failed ({error})") from error
        if not reply.get("ok"):
            self._socket.close()
            if reply.get("ended"):
                raise RunEnded(reply.get("error", "the run has ended"))
            refusal = _Busy if reply.get("retry") else ProducerError
            raise refusal(reply.get("error", "refused"))
        return reply

    def _hello(self, token: str) -> _Reply:
        hello = json.dumps(
            {
                "protocol": PROTOCOL_VERSION,
                "hidden": self.hidden,
                "tap_layers": self.tap_layers,
                "vocab": self.vocab,
                "token": token,
                "producer": self.name,
            }
        ).encode()
        self._frame([hello], len(hello), "the hello")
        return self._reply("reply to the hello")

    def _prepare(
        self, input_ids: Any, hidden_states: Any, loss_mask: Any, last_hidden_states: Any = None
    ) -> tuple[NDArray[Any], _Converted, NDArray[Any] | None, _Converted | None]:
        """Arrays ``[N, S]``, ``([N, S, D], dtype)``, ``[N, S]`` or None, and ``([N, S, hidden], dtype)`` or None,
        from 1-D/2-D inputs or lists of sequences."""
        if isinstance(input_ids, (list, tuple)) and input_ids and np.ndim(input_ids[0]) == 1:
            lengths = [len(s) for s in input_ids]
            ids = _pad_ragged([_to_numpy(s, "input_ids")[0] for s in input_ids], (), np.int64)

            def ragged(values: Any, name: str, width: int) -> _Converted:
                converted = [_to_numpy(h, name) for h in values]
                return _pad_ragged([c[0] for c in converted], (width,), converted[0][0].dtype), converted[0][1]

            ragged_hs = ragged(hidden_states, "hidden_states", self.width)
            ragged_last: _Converted | None = None
            if last_hidden_states is not None:
                ragged_last = ragged(last_hidden_states, "last_hidden_states", self.hidden)
            if loss_mask is None:
                ragged_mask = _pad_ragged([np.ones(n, np.uint8) for n in lengths], (), np.uint8)
            else:
                ragged_mask = _pad_ragged([_to_numpy(m, "loss_mask")[0] for m in loss_mask], (), np.uint8)
            return ids, ragged_hs, ragged_mask, ragged_last
        ids, _ = _to_numpy(input_ids, "input_ids")
        hs, hs_dtype = _to_numpy(hidden_states, "hidden_states")
        last: _Converted | None = None
        if last_hidden_states is not None:
            last = _to_numpy(last_hidden_states, "last_hidden_states")
        mask: NDArray[Any] | None = None if loss_mask is None else _to_numpy(loss_mask, "loss_mask")[0]
        if ids.ndim == 1:
            ids, hs = ids[None], hs[None]
            mask = None if mask is None else mask[None]
            last = None if last is None else (last[0][None], last[1])
        return ids, (hs, hs_dtype), mask, last

    def _sent_itemsize(self, hs: NDArray[Any], hs_dtype: str | None) -> int:
        """Bytes per hidden-state value as :meth:`_hidden_tensor` will send them."""
        if self.hidden_dtype == "fp8_e4m3":
            return 1
        if hs_dtype == "BF16" or self.hidden_dtype in ("bf16", "f16"):
            return 2
        if self.hidden_dtype == "f32":
            return 4
        return hs.dtype.itemsize

    def rows_per_message(self, width: int, itemsize: int = 2, masked: bool = True) -> int:
        """Rows of ``width`` tokens that fit one message under the server's ``max_message_bytes``, with hidden
        states of ``itemsize`` bytes per value (and ``last_hidden_states`` too when the run wants them), int64
        ids and (``masked``) a one-byte loss mask; at least 1."""
        floats = self.width * itemsize + (self.hidden * max(itemsize, 2) if self.wants_last_hidden_states else 0)
        # An FP8 row carries its 4-byte scale.
        scale = 4 if itemsize == 1 else 0
        row_bytes = width * (floats + scale + 8 + (1 if masked else 0))
        return max(1, (self.max_message_bytes - (1 << 16)) // max(row_bytes, 1))

    def _hidden_tensor(self, hs: NDArray[Any], hs_dtype: str | None, quantise: bool = True) -> Tensor:
        if self.hidden_dtype == "fp8_e4m3" and not quantise:
            return Tensor(hs if hs_dtype == "BF16" else float32_to_bf16_bits(hs), "BF16")
        if hs_dtype == "BF16":
            return Tensor(hs, "BF16")
        if self.hidden_dtype == "bf16":
            return Tensor(float32_to_bf16_bits(hs), "BF16")
        if self.hidden_dtype == "f16":
            return Tensor(hs.astype(np.float16, copy=False))
        if self.hidden_dtype == "f32":
            return Tensor(hs.astype(np.float32, copy=False))
        return Tensor(hs)

    def send(self, input_ids: Any, hidden_states: Any, loss_mask: Any = None, last_hidden_states: Any = None) -> Ack:
        """Sends sequences and waits until draftpipe has queued them; returns the :class:`Ack`.

        ``input_ids`` is ``[S]`` or ``[N, S]`` (or a list of 1-D sequences of any lengths), ``hidden_states``
        ``[S, D]`` / ``[N, S, D]`` (or a list of ``[S_i, D]``) with ``D = hidden × len(tap_layers)``, and
        ``loss_mask`` like ``input_ids`` (nonzero: the token may serve as a label; right padding should be 0).
        ``last_hidden_states`` (``[S, hidden]`` / ``[N, S, hidden]`` or a list, the target's final-norm output:
        what its ``lm_head`` consumes) is required when :attr:`wants_last_hidden_states` and not sent otherwise.
        numpy arrays or torch tensors. Rows are split over several messages when they exceed the server's limit.
        """
        if self._done:
            raise ProducerError("this producer already said it is done")
        if self.wants_last_hidden_states and last_hidden_states is None:
            raise ValueError(
                "the run's drafter reads the target's final-norm output: give last_hidden_states [N, S, hidden]"
                " (transformers: outputs.hidden_states[-1])"
            )
        if not self.wants_last_hidden_states:
            last_hidden_states = None
        ids, (hs, hs_dtype), mask, last = self._prepare(input_ids, hidden_states, loss_mask, last_hidden_states)
        if hs.ndim != 3 or hs.shape[:2] != ids.shape or hs.shape[2] != self.width:
            raise ValueError(
                f"hidden_states has shape {tuple(hs.shape)}, expected {tuple(ids.shape) + (self.width,)}"
                f" (hidden {self.hidden} × {len(self.tap_layers)} tap layers)"
            )
        if last is not None and (last[0].ndim != 3 or last[0].shape != ids.shape + (self.hidden,)):
            raise ValueError(
                f"last_hidden_states has shape {tuple(last[0].shape)}, expected {tuple(ids.shape) + (self.hidden,)}"
            )
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(f"loss_mask has shape {tuple(mask.shape)}, expected {tuple(ids.shape)}")
        # Sized by what is sent (2 bytes a value for bf16/f16), so a message carries as many rows as fit.
        rows_per_message = self.rows_per_message(ids.shape[1], self._sent_itemsize(hs, hs_dtype), mask is not None)
        ack = Ack()
        for start in range(0, max(ids.shape[0], 1), rows_per_message):
            rows = slice(start, start + rows_per_message)
            # hidden_states last: the server then knows every row's length before the hidden states arrive and
            # reads a one-item message straight into the batch it queues (any order is valid safetensors).
            # last_hidden_states before them, where the server copies them from the part it has read.
            tensors = {"input_ids": Tensor(ids[rows].astype(np.int64, copy=False))}
            if mask is not None:
                tensors["loss_mask"] = Tensor(np.asarray(mask[rows]).astype(np.uint8, copy=False))
            if last is not None:
                tensors["last_hidden_states"] = self._hidden_tensor(last[0][rows], last[1], quantise=False)
            if self.hidden_dtype == "fp8_e4m3":
                # The scales before the codes: the server takes them from the part it has read when it reads
                # the codes straight into the batch.
                wide = bf16_bits_to_float32(hs[rows]) if hs_dtype == "BF16" else hs[rows]
                codes, scales = quantise_e4m3(wide)
                tensors["hidden_states_scale"] = Tensor(scales)
                tensors["hidden_states"] = Tensor(codes, "F8_E4M3")
            else:
                tensors["hidden_states"] = self._hidden_tensor(hs[rows], hs_dtype)
            parts, length = serialize(tensors)
            self._frame(parts, length, f"message {ack.messages + 1} of this send")
            reply = self._reply(f"acknowledgement of message {ack.messages + 1} of this send")
            ack.messages += 1
            ack.batches += reply.get("batches", 0)
            ack.sequences += reply.get("sequences", 0)
            ack.delivered = self.delivered = reply.get("delivered", self.delivered)
        return ack

    def done(self) -> Ack | None:
        """Tells draftpipe this producer has nothing more to send; the run ends when every producer is done.

        Returns the :class:`Ack` of the rows still held in part-filled items, which are queued before the reply
        (``batches`` of them), or ``None`` when done was already said."""
        if self._done:
            return None
        self._frame([], 0, "the done frame")
        reply = self._reply("reply to done")
        self._done = True
        self._socket.close()
        return Ack(messages=0, batches=reply.get("batches", 0), sequences=0,
                   delivered=reply.get("delivered", self.delivered))

    def close(self) -> None:
        """Closes the connection without saying done: the slot waits for this producer to reconnect."""
        self._socket.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if exc_type is None:
            self.done()
        else:
            self.close()
        return False
