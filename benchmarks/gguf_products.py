"""Products on GGUF blocks per decode step of the default model's shapes: the streaming decode kernel
against the dense kernels over dequantized tiles, by number of rows, with bf16 and fp32 activations (the
figures behind `tidal.layers.gguf_kernels.DECODE_MAX_ROWS`).

    python benchmarks/gguf_products.py                 # rows 1 2 4 6 8 12 16
    python benchmarks/gguf_products.py --rows 1 16

A step is a layer's four products (QKV, output, gate/up, down; Q4_1, SmolLM2-135M's shapes) x 30 plus the
LM head (Q8_0, 49,152 x 576), each timed alone on random blocks, warm, 2 threads by default.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [("qkv", 960, 576, "Q4_1", 30), ("o", 576, 576, "Q4_1", 30), ("gate_up", 3072, 576, "Q4_1", 30),
          ("down", 576, 1536, "Q4_1", 30), ("lm_head", 49152, 576, "Q8_0", 1)]


def _ms(fn, reps: int = 20) -> float:
    fn()
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from tidal.layers import gguf_kernels as gk
    torch.set_num_threads(args.threads)
    weights = []
    for name, n, k, fmt, times in SHAPES:
        w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        blocks = quants.quantize(w, GGMLQuantizationType[fmt])
        weights.append((torch.from_numpy(blocks.copy()).view(n, k // 32, -1), k, times))
    for dtype in (torch.bfloat16, torch.float32):
        for m in args.rows:
            stream = tiles = 0.0
            for packed, k, times in weights:
                x = torch.randn(m, k).to(dtype)
                if m <= 16:  # the streaming kernel's limit (gguf_gemm.cpp kMaxRows)
                    lib = gk.gguf_lib()
                    out = torch.empty(m, packed.shape[0], dtype=dtype)
                    code = gk.BLOCK_FORMATS[gk.block_format(packed)][0]
                    stream += times * _ms(lambda: lib.tidal_gguf_linear(
                        x.data_ptr(), packed.data_ptr(), code, None, out.data_ptr(), m, packed.shape[0], k,
                        1 if dtype == torch.bfloat16 else 0, args.threads))
                if dtype == torch.bfloat16 or m > 8:  # fp32 tiles run above 8 rows
                    tiles += times * _ms(lambda: gk._rows_linear(x, packed, None))
            print(f"{str(dtype).removeprefix('torch.'):8s} {m:3d} rows: streaming {stream:6.2f} ms   "
                  f"tiles {tiles:6.2f} ms per step", flush=True)


if __name__ == "__main__":
    main()
