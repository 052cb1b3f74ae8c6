"""Products on GGUF blocks per decode step of the default model's shapes: the streaming decode kernel
against the dense kernels over dequantized tiles, by number of rows, with bf16 and fp32 activations (the
figures behind `tidal.layers.gguf_kernels.DECODE_MAX_ROWS`).

    python benchmarks/gguf_products.py                 # rows 1 2 4 6 8 12 16
    python benchmarks/gguf_products.py --rows 1 16

A step is a layer's four products (QKV, output, gate/up, down; Q4_1, SmolLM2-135M's shapes) x 30 plus the
LM head (Q8_0, 49,152 x 576), each timed alone on random blocks, 2 threads by default. Beside the decode
kernel (activations kept in fp32/bf16) and the tiles: the decode kernel on activations quantized to int8 per
chunk of 32 with integer dot products (gguf_kernels.gguf_linear_q8, llama.cpp's way). Each shape has 30
copies of its weight (one per layer, as in the model: 96 MB in all, more than the caches hold), taken in
turn, so the weights come from memory as in the engine; --warm reuses one copy (the weights then come
from cache). The last line times the packed bf16 kernel over the same shapes (the model dequantized to
bf16, 269 MB) with one row: the rate at which a kernel of little arithmetic per byte streams weights here.
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
    ap.add_argument("--warm", action="store_true", help="one copy of each weight, reused (from cache)")
    args = ap.parse_args()
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from tidal.layers import cpu_kernels
    from tidal.layers import gguf_kernels as gk
    torch.set_num_threads(args.threads)
    weights = []  # (copies of the packed weight, K, times per step)
    for name, n, k, fmt, times in SHAPES:
        w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        blocks = torch.from_numpy(quants.quantize(w, GGMLQuantizationType[fmt]).copy()).view(n, k // 32, -1)
        weights.append(([blocks] + [blocks.clone() for _ in range(1 if args.warm else times - 1)], k, times))

    def per_step(copies, times, call) -> float:
        """ms per step: call(weight) on each copy in turn, times calls per step."""
        turn = [0]

        def one():
            turn[0] = (turn[0] + 1) % len(copies)
            call(copies[turn[0]])
        return times * _ms(one, reps=max(20, 2 * len(copies)))

    for dtype in (torch.bfloat16, torch.float32):
        for m in args.rows:
            stream = tiles = 0.0
            for copies, k, times in weights:
                x = torch.randn(m, k).to(dtype)
                n = copies[0].shape[0]
                if m <= 16:  # the streaming kernel's limit (gguf_gemm.cpp kMaxRows)
                    lib = gk.gguf_lib()
                    out = torch.empty(m, n, dtype=dtype)
                    code = gk.BLOCK_FORMATS[gk.block_format(copies[0])][0]
                    stream += per_step(copies, times, lambda p: lib.tidal_gguf_linear(
                        x.data_ptr(), p.data_ptr(), code, None, out.data_ptr(), m, n, k,
                        1 if dtype == torch.bfloat16 else 0, args.threads))
                if dtype == torch.bfloat16 or m > 8:  # fp32 tiles run above 8 rows
                    tiles += per_step(copies, times, lambda p: gk._rows_linear(x, p, None))
            q8 = 0.0
            for copies, k, times in weights:  # the same products on int8 activations (llama.cpp's way)
                x = torch.randn(m, k).to(dtype)
                n = copies[0].shape[0]
                lib, out = gk.gguf_lib(), torch.empty(m, n, dtype=dtype)
                code = gk.BLOCK_FORMATS[gk.block_format(copies[0])][0]
                q8 += per_step(copies, times, lambda p: lib.tidal_gguf_linear_q8(
                    x.data_ptr(), p.data_ptr(), code, None, out.data_ptr(), m, n, k,
                    1 if dtype == torch.bfloat16 else 0, args.threads))
            print(f"{str(dtype).removeprefix('torch.'):8s} {m:3d} rows: streaming {stream:6.2f} ms   "
                  f"tiles {tiles:6.2f} ms   streaming on int8 activations {q8:6.2f} ms per step", flush=True)
    if cpu_kernels.packed_gemm_available():
        total = nbytes = 0.0
        for copies, k, times in weights:
            n = copies[0].shape[0]
            plain = [cpu_kernels.pack_bf16_weight(torch.randn(n, k).bfloat16()) for _ in copies]
            x, out = torch.randn(1, k).bfloat16(), torch.empty(1, n, dtype=torch.bfloat16)
            gemm = cpu_kernels.gemm_lib()
            total += per_step(plain, times, lambda p: gemm.tidal_gemm_bf16_packed(
                x.data_ptr(), p.data_ptr(), None, out.data_ptr(), 1, n, k, args.threads))
            nbytes += times * 2 * n * k
        print(f"packed bf16, 1 row: {total:6.2f} ms per step, {nbytes / total / 1e6:.1f} GB/s of weights "
              f"(GGUF blocks: {sum(times * c[0].numel() for c, _, times in weights) / 1e6:.1f} MB per step)")


if __name__ == "__main__":
    main()
