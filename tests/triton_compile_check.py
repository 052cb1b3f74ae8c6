"""Compile every Triton kernel Tidal launches for an H100/H200 (sm_90) without a GPU: Triton lowers each
variant through its MLIR passes to PTX and runs the bundled ptxas, so errors the interpreter cannot see
(types of loop-carried values, dot shapes, FP8 conversions, shared memory) show up on a CPU machine.

    python tests/triton_compile_check.py [--arch 90]     # one line per kernel variant; exit 1 on a failure

Run in a process without TRITON_INTERPRET (tests/test_triton_kernels.py starts it in a subprocess).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tidal.layers import triton_kernels  # noqa: E402
from tidal.layers.attention import triton_attention  # noqa: E402

DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}


def _compile(fn, pointers: dict, scalars: dict, constexprs: dict, target) -> str | None:
    signature = {**pointers, **scalars, **{n: "i32" for n in fn.arg_names if n.startswith("stride")},
                 **{n: "constexpr" for n in constexprs}}
    try:
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=target)
    except Exception as e:  # noqa: BLE001 - report every variant's failure, then fail
        return f"{type(e).__name__}: {e}"
    return None if kernel.asm.get("cubin") else "no cubin (ptxas did not run)"


def variants():
    """(label, kernel, pointer types, scalar types, constexprs): the shapes the engine launches."""
    for dt, cache, group, head_dim, block_m, splits in [
            ("bf16", "bf16", 3, 64, 16, 1), ("bf16", "bf16", 3, 64, 16, 16), ("bf16", "bf16", 3, 64, 64, 1),
            ("bf16", "bf16", 4, 128, 16, 1), ("bf16", "bf16", 4, 128, 16, 16), ("bf16", "bf16", 4, 128, 16, 3),
            ("bf16", "bf16", 4, 128, 64, 1), ("fp16", "fp16", 4, 128, 64, 1), ("fp16", "fp16", 4, 128, 16, 8),
            ("fp32", "fp32", 2, 16, 64, 1), ("fp32", "fp32", 2, 16, 16, 4), ("bf16", "u8", 4, 128, 16, 1),
            ("bf16", "u8", 4, 128, 16, 16), ("bf16", "u8", 4, 128, 64, 1)]:
        yield (f"paged_attention q {dt} cache {cache} group {group} head_dim {head_dim} BLOCK_M {block_m} "
               f"splits {splits}",
               triton_attention._paged_attention_kernel,
               {"out_ptr": f"*{dt}", "q_ptr": f"*{dt}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
                "block_table_ptr": "*i64", "query_start_loc_ptr": "*i64", "seq_lens_ptr": "*i64",
                "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"},
               {"qk_scale": "fp32", "v_scale": "fp32", "num_reqs": "i32"},
               dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
                    BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=32, FP8_CACHE=cache == "u8",
                    DOT_PRECISION="ieee" if dt == "fp32" else None, DOT_DTYPE=DTYPES[dt], NUM_SPLITS=splits))
    for dt, head_dim, splits in [("bf16", 64, 16), ("bf16", 128, 16), ("bf16", 128, 3), ("fp16", 128, 8),
                                 ("fp32", 16, 4)]:
        yield (f"combine_splits {dt} head_dim {head_dim} splits {splits}", triton_attention._combine_splits_kernel,
               {"out_ptr": f"*{dt}", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"},
               {"v_scale": "fp32"},
               dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), NUM_SPLITS=splits,
                    SPLITS_PAD=max(2, triton.next_power_of_2(splits))))
    for dt in ("bf16", "fp16", "fp32"):
        for residual in (False, True):
            yield (f"rms_norm {dt} residual {residual}", triton_kernels._rms_norm_kernel,
                   {n: f"*{dt}" for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr")},
                   {"N": "i32", "eps": "fp32"}, dict(HAS_RESIDUAL=residual, BLOCK=4096))
        yield (f"silu_and_mul {dt}", triton_kernels._silu_and_mul_kernel, {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}"},
               {"D": "i32"}, dict(BLOCK=1024))
    for dt, cache in [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "u8")]:
        yield (f"rotary_write_kv {dt} cache {cache}", triton_kernels._rotary_write_kv_kernel,
               {"qk_ptr": f"*{dt}", "v_ptr": f"*{dt}", "positions_ptr": "*i64", "cos_ptr": "*fp32",
                "sin_ptr": "*fp32", "q_out_ptr": f"*{dt}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
                "slot_mapping_ptr": "*i64"},
               {"k_scale": "fp32", "v_scale": "fp32"},
               dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEADS_PAD=64, KV_HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128,
                    BLOCK_SIZE=16, FP8_CACHE=cache == "u8", EMULATE_FP8_ROUNDING=False))

    for dt in ("bf16", "fp16", "fp32"):  # batch-invariant mode's GEMM
        for bias in (False, True):
            yield (f"invariant_linear {dt} bias {bias}", triton_kernels._invariant_linear_kernel,
                   {n: f"*{dt}" for n in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr")},
                   {"M": "i32", "N": "i32", "K": "i32"},
                   dict(HAS_BIAS=bias, DOT_PRECISION="ieee" if dt == "fp32" else None, DOT_DTYPE=DTYPES[dt],
                        BLOCK_M=triton_kernels.LINEAR_BLOCK_M, BLOCK_N=triton_kernels.LINEAR_BLOCK_N,
                        BLOCK_K=triton_kernels.LINEAR_BLOCK_K))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100 / H200)")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for label, fn, pointers, scalars, constexprs in variants():
        t0 = time.perf_counter()
        error = _compile(fn, pointers, scalars, constexprs, target)
        failed += error is not None
        print(f"{'FAIL' if error else 'ok'}   sm_{args.arch} {label} ({time.perf_counter() - t0:.1f} s)"
              + (f": {error}" if error else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
