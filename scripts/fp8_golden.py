"""Writes runtime/tests/data/fp8_golden.safetensors: f32 rows and what the Python producer's FP8 quantiser
(clients/python/draftpipe_client/_fp8.py) makes of them, for the runtime's test that its own quantiser gives the
same codes and scales (runtime/tests/source_fp8.rs). numpy only.

    python scripts/fp8_golden.py runtime/tests/data/fp8_golden.safetensors
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "python"))
from draftpipe_client._fp8 import quantise_e4m3  # noqa: E402 (after the path)
from draftpipe_client._safetensors import Tensor, serialize  # noqa: E402

rng = np.random.default_rng(2026)
tokens, width = 16, 64
x = (rng.standard_normal((tokens, width)) * 10.0 ** rng.integers(-4, 4, (tokens, 1))).astype(np.float32)
x[0] = 0.0                                  # a zero row: scale 1
x[1, :] = np.linspace(-448, 448, width)     # scale exactly 1: the values themselves rounded
x[1, :8] = [448, 1.0625, 1.1875, 0.5 / 512, 1.5 / 512, 1.99, -1.0625, 2.0 ** -10]  # ties and the subnormals
x[2, 5] = 1e6                                # one outlier
codes, scales = quantise_e4m3(x[None])
tensors = {
    "values": Tensor(x),
    "hidden_states_scale": Tensor(scales),
    "hidden_states": Tensor(codes, "F8_E4M3"),
}
parts, _ = serialize(tensors)
with open(sys.argv[1], "wb") as f:
    for p in parts:
        f.write(bytes(p))
