"""Where W8A16's bf16 calls switch from the exact skinny passes to the bf16 GEMM over rounded rows
(kW8A16TileMinRows in tidal/layers/csrc/quant_gemm.cpp): one layer's four products of SmolLM2 (QKV, o,
gate/up, down; int8 weights, bf16 activations) timed both ways for a range of row counts, best of 30.

    python benchmarks/w8a16_tiles.py

Run it on an otherwise idle machine with OMP_NUM_THREADS set; name the CPU beside the figures.
"""
from __future__ import annotations

import time

import torch

from tidal.layers import quant_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K] of SmolLM2-135M's four products


def main() -> None:
    torch.manual_seed(0)
    weights = [(torch.randint(-127, 128, s, dtype=torch.int8), torch.rand(s[0]) * 0.01) for s in SHAPES]
    print(f"threads {torch.get_num_threads()}, {quant_kernels.int8_dot_kind()}")
    for rows in (4, 6, 8, 10, 12, 16, 32, 128):
        xs = [torch.randn(rows, s[1]).bfloat16() for s in SHAPES]
        ms = {}
        for tiles in (False, True):
            best = float("inf")
            for _ in range(30):
                t0 = time.perf_counter()
                for (w, scale), x in zip(weights, xs, strict=True):
                    quant_kernels.int8_linear(x, w, scale, None, tiles=tiles)
                best = min(best, time.perf_counter() - t0)
            ms[tiles] = best * 1e3
        print(f"rows {rows:4d}: skinny passes {ms[False]:.3f} ms, bf16 tiles {ms[True]:.3f} ms "
              f"({ms[True] / ms[False]:.2f}x)")


if __name__ == "__main__":
    main()
