"""The FP8 E4M3 codec of the producer and the shard writer (numpy only): every one of the 256 codes against the
OCP table, rounding ties to even, saturation, the per-token scale, and the quantisation error against float32
on hidden-state-like rows (the figures docs/sources.md states)."""

import numpy as np
import pytest

from draftpipe_client._fp8 import decode_e4m3, dequantise_e4m3, encode_e4m3, quantise_e4m3


def ocp_value(code):
    """The OCP FP8 E4M3 ("e4m3fn") value of ``code``, from the format's definition in Python floats."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


TABLE = [ocp_value(code) for code in range(256)]


def nearest_even(x):
    """The reference encoder: the nearest finite code by brute force over the table, ties to the even code,
    saturating at ±448."""
    positive = [(v, c) for c, v in enumerate(TABLE[:0x7F])]
    magnitude = min(abs(x), 448.0)
    best = min(positive, key=lambda vc: (abs(vc[0] - magnitude), vc[1] & 1))
    return best[1] | (0x80 if np.signbit(x) else 0)


def test_all_256_codes_decode_to_the_ocp_table_and_encode_back():
    codes = np.arange(256, dtype=np.uint8)
    decoded = decode_e4m3(codes)
    for code in range(256):
        want = TABLE[code]
        if np.isnan(want):
            assert np.isnan(decoded[code]), hex(code)
        else:
            assert decoded[code] == np.float32(want), hex(code)
            assert np.signbit(decoded[code]) == bool(code & 0x80), hex(code)
    finite = ~np.isnan(decoded)
    assert (encode_e4m3(decoded[finite]) == codes[finite]).all()
    assert (encode_e4m3(decoded[~finite]) & 0x7F == 0x7F).all()
    assert TABLE[0x7E] == 448.0 and TABLE[0x08] == 2.0**-6 and TABLE[0x01] == 2.0**-9 and TABLE[0x77] == 240.0


def test_midpoints_round_to_the_even_code_and_the_rest_to_the_nearest():
    positive = np.array(TABLE[:0x7F])
    midpoints = (positive[:-1] + positive[1:]) / 2
    got = encode_e4m3(midpoints.astype(np.float32))
    lower = np.arange(0x7E)
    want = np.where(lower % 2 == 0, lower, lower + 1)
    assert (got == want).all(), np.nonzero(got != want)
    # Against the brute-force reference on values spread over every binade, both signs.
    rng = np.random.default_rng(32)
    values = (rng.uniform(-1, 1, 20000) * 2.0 ** rng.integers(-12, 10, 20000)).astype(np.float32)
    reference = np.array([nearest_even(float(v)) for v in values], dtype=np.uint8)
    assert (encode_e4m3(values) == reference).all()


def test_saturation_and_the_non_finite_values():
    big = np.array([448, 449, 464, 480, 1e9, np.finfo(np.float32).max], dtype=np.float32)
    assert (encode_e4m3(big) == 0x7E).all()
    assert (encode_e4m3(-big) == 0xFE).all()
    specials = encode_e4m3(np.array([np.nan, np.inf, -np.inf], dtype=np.float32))
    assert list(specials) == [0x7F, 0x7F, 0xFF]


def test_each_token_has_its_own_scale_and_a_zero_row_no_nan():
    hs = np.array([[[1.0, -2.0, 4.0], [0.0, 0.0, 0.0], [0.001, 0.002, -0.003]]], dtype=np.float32)
    codes, scales = quantise_e4m3(hs)
    assert codes.shape == hs.shape and codes.dtype == np.uint8
    assert scales.shape == (1, 3) and scales.dtype == np.float32
    assert list(scales[0]) == [np.float32(4.0) / np.float32(448), 1.0, np.float32(0.003) / np.float32(448)]
    back = dequantise_e4m3(codes, scales)
    assert not np.isnan(back).any()
    assert (back[0, 1] == 0).all()
    # Each row's largest magnitude lands on ±448 and comes back to float32 rounding.
    assert codes[0, 0, 2] == 0x7E and codes[0, 2, 2] == 0xFE
    np.testing.assert_allclose(back, hs, rtol=1 / 16)


def hidden_like(rng, tokens, width):
    """Hidden-state-like rows: most channels small, one "massive activation" channel far larger."""
    hs = rng.uniform(-1, 1, (tokens, width, 4)).sum(axis=-1).astype(np.float32) * np.float32(0.8)
    hs[:, 3] = hs[:, 3] * 80 + 120
    return hs


def test_the_quantisation_error_against_float32_is_e4m3s_half_step():
    rng = np.random.default_rng(32)
    hs = hidden_like(rng, 64, 4096)
    codes, scales = quantise_e4m3(hs)
    back = dequantise_e4m3(codes, scales).astype(np.float64)
    x = hs.astype(np.float64)
    normal = np.abs(x) >= scales[:, None].astype(np.float64) / 64
    relative = np.abs(back - x)[normal] / np.abs(x)[normal]
    rms = np.sqrt(((back - x) ** 2).sum() / (x**2).sum())
    print(f"producer fp8_e4m3: max relative error {relative.max():.4f} (normal range, {normal.mean():.1%} of"
          f" elements), RMS error / RMS {rms:.5f}")
    assert relative.max() <= 1 / 16 + 1e-7
    assert rms < 0.04


if __name__ == "__main__":
    pytest.main([__file__, "-v", "-s"])
