"""FP8 E4M3 hidden states with one float32 scale per token, in numpy alone (numpy has no fp8 dtype).

What the producer sends and the shard writer stores for ``hs_dtype = fp8_e4m3``: ``hidden_states`` as
``F8_E4M3`` codes (OCP FP8 "e4m3fn": bias 7, largest finite 448, no infinities, NaN at 0x7F/0xFF) and
``hidden_states_scale [N, S]`` float32, the scale of each token's row, ``amax / 448`` (1 for an all-zero row), so
the value of element ``d`` of token ``t`` is ``decode(code[t, d]) * scale[t]``. The arithmetic is float32 and the
same as draftpipe's own quantiser (``runtime/src/fp8.rs``), so both give the same codes for the same rows.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

E4M3_MAX = np.float32(448.0)
E4M3_NAN = 0x7F


def decode_e4m3(codes: ArrayLike) -> NDArray[np.float32]:
    """The float32 values of E4M3 ``codes`` (uint8)."""
    codes = np.asarray(codes, dtype=np.uint8)
    exponent = ((codes >> 3) & 0xF).astype(np.int32)
    mantissa = (codes & 0x7).astype(np.float32)
    magnitude = np.where(
        exponent == 0,
        mantissa / np.float32(512.0),
        np.ldexp(np.float32(1.0) + mantissa / np.float32(8.0), exponent - 7).astype(np.float32),
    ).astype(np.float32)
    magnitude[(codes & 0x7F) == E4M3_NAN] = np.nan
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)


def encode_e4m3(values: ArrayLike) -> NDArray[np.uint8]:
    """float32 ``values`` rounded to the nearest E4M3 code (ties to even), finite values saturating at ±448;
    NaN and ±inf (which E4M3 lacks) become the NaN code, with their sign."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    sign = ((x.view(np.uint32) >> 24) & 0x80).astype(np.uint8)
    magnitude = np.abs(x)
    finite = np.isfinite(magnitude)
    safe = np.where(finite, magnitude, np.float32(0.0))
    # Normal range: rebias the exponent (127 → 7) and round the 23 mantissa bits to 3, ties to even; a carry
    # out of the mantissa bumps the exponent, as it should.
    bits = safe.view(np.uint32).astype(np.int64) - (120 << 23)
    normal = np.minimum((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20, 0x7E)
    # Subnormals (and 0): steps of 2^-9, rounded half to even (np.rint).
    subnormal = np.rint(np.minimum(safe, np.float32(1.0 / 64.0)) * np.float32(512.0)).astype(np.int64)
    code = np.where(safe < np.float32(1.0 / 64.0), subnormal, normal)
    code = np.where(safe >= E4M3_MAX, 0x7E, code)
    code = np.where(finite, code, E4M3_NAN).astype(np.uint8)
    return code | sign


def quantise_e4m3(hidden_states: ArrayLike) -> tuple[NDArray[np.uint8], NDArray[np.float32]]:
    """``(codes, scales)`` of float ``hidden_states [..., D]``: uint8 codes of the same shape and one float32 scale
    per row (``[...]``), ``amax / 448`` over the row's finite values, 1 where that is 0."""
    x = np.asarray(hidden_states, dtype=np.float32)
    amax = np.where(np.isfinite(x), np.abs(x), np.float32(0.0)).max(axis=-1, initial=np.float32(0.0))
    scales = np.where(amax > 0, amax / E4M3_MAX, np.float32(1.0)).astype(np.float32)
    return encode_e4m3(x / scales[..., None]), scales


def dequantise_e4m3(codes: ArrayLike, scales: ArrayLike) -> NDArray[np.float32]:
    """The float32 values of ``codes [..., D]`` with their rows' ``scales [...]``."""
    return (decode_e4m3(codes) * np.asarray(scales, dtype=np.float32)[..., None]).astype(np.float32)
