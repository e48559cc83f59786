"""Producer-side cost per message: turning float32 (or torch bfloat16) hidden states into a safetensors blob
ready to send (bf16 rounding, header), without the network.

    python bench_producer.py [ROWS SEQ WIDTH]
"""

import statistics
import sys
import time

import numpy as np

from draftpipe_client._safetensors import Tensor, float32_to_bf16_bits, serialize


def main():
    rows, seq, width = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (2, 1024, 4096)
    rng = np.random.default_rng(0)
    hs = rng.standard_normal((rows, seq, width)).astype(np.float32)
    ids = rng.integers(0, 32000, (rows, seq))
    mask = np.ones((rows, seq), np.uint8)

    def encode_f32():
        return serialize({"input_ids": Tensor(ids), "loss_mask": Tensor(mask),
                          "hidden_states": Tensor(float32_to_bf16_bits(hs), "BF16")})

    cases = [("float32 -> bf16", encode_f32)]
    try:
        import torch

        hs_bf16 = torch.from_numpy(hs).to(torch.bfloat16)

        def encode_torch_bf16():
            bits = hs_bf16.view(torch.int16).numpy().view(np.uint16)
            return serialize({"input_ids": Tensor(ids), "loss_mask": Tensor(mask),
                              "hidden_states": Tensor(bits, "BF16")})

        cases.append(("torch bfloat16 (no conversion)", encode_torch_bf16))
    except ImportError:
        pass
    megabytes = rows * seq * width * 2 / 2**20
    for name, encode in cases:
        times = []
        for _ in range(15):
            start = time.perf_counter()
            encode()
            times.append(time.perf_counter() - start)
        print(f"{name}: {statistics.median(times) * 1e3:.2f} ms per message of {megabytes:.1f} MiB of bf16 "
              f"hidden states ({rows}x{seq}x{width}), median of 15")


if __name__ == "__main__":
    main()
