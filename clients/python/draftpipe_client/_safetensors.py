"""Safetensors blobs in memory, written with numpy alone (the format is a JSON header and raw little-endian data).

bfloat16 has no numpy dtype: such arrays travel as uint16 bit patterns tagged ``BF16``.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Mapping

import numpy as np
from numpy.typing import ArrayLike, NDArray

_NUMPY_TO_SAFETENSORS = {
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    np.dtype("float64"): "F64",
    np.dtype("int64"): "I64",
    np.dtype("int32"): "I32",
    np.dtype("int16"): "I16",
    np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8",
    np.dtype("bool"): "BOOL",
}


class Tensor:
    """An array and the safetensors dtype it is stored as (``BF16`` arrays hold uint16 bit patterns)."""

    __slots__ = ("array", "dtype")

    array: NDArray[Any]
    dtype: str

    def __init__(self, array: ArrayLike, dtype: str | None = None) -> None:
        contiguous: NDArray[Any] = np.ascontiguousarray(array)
        if dtype is None:
            try:
                dtype = _NUMPY_TO_SAFETENSORS[contiguous.dtype]
            except KeyError:
                raise TypeError(f"arrays of dtype {contiguous.dtype} cannot be sent") from None
        if contiguous.dtype.byteorder == ">":
            contiguous = contiguous.astype(contiguous.dtype.newbyteorder("<"))
        self.array = contiguous
        self.dtype = dtype


def float32_to_bf16_bits(array: ArrayLike) -> NDArray[np.uint16]:
    """Rounds float32 values to the nearest bfloat16 (ties to even, NaN kept NaN) and returns the bit patterns."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(array, dtype=np.float32))
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def bf16_bits_to_float32(bits: ArrayLike) -> NDArray[np.float32]:
    """The float32 values of bfloat16 bit patterns."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def serialize(tensors: Mapping[str, Tensor]) -> tuple[list[Any], int]:
    """One safetensors blob of ``{name: Tensor}`` as a list of buffers (header first, then each tensor's bytes,
    not copied), and its total length. The header is padded to 8 bytes, as the reference writer does."""
    header: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.array.nbytes
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    parts: list[Any] = [struct.pack("<Q", len(encoded)) + encoded]
    parts.extend(t.array.reshape(-1).view(np.uint8) for t in tensors.values() if t.array.size)
    return parts, 8 + len(encoded) + offset
