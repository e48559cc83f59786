"""The client's safetensors encoding and bf16 rounding, checked against the reference implementations."""

import numpy as np
import pytest

from draftpipe_client._safetensors import Tensor, bf16_bits_to_float32, float32_to_bf16_bits, serialize


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 10000),
                             np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)])
    ours = float32_to_bf16_bits(values)
    reference = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, reference)
    assert np.isnan(bf16_bits_to_float32(float32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_blobs_load_with_the_reference_reader():
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(2)
    tensors = {
        "hidden_states": Tensor(rng.standard_normal((3, 5, 7)).astype(np.float16)),
        "input_ids": Tensor(rng.integers(0, 100, (3, 5))),
        "loss_mask": Tensor(rng.integers(0, 2, (3, 5)).astype(np.uint8)),
    }
    parts, length = serialize(tensors)
    blob = b"".join(bytes(p) for p in parts)
    assert len(blob) == length
    assert (len(blob) - sum(t.array.nbytes for t in tensors.values())) % 8 == 0
    loaded = safetensors_numpy.load(blob)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(loaded[name], tensor.array)
