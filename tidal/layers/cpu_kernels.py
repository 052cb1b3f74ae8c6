"""Native CPU kernels, built by tidal/native.py (one build per ISA level: AVX2, AVX-512, AVX-512 BF16),
with thin wrappers that return None (or False) when the kernel cannot run so callers fall back to torch
ops:
    csrc/cpu_kernels.cpp   paged attention, fused residual + RMSNorm, rotary, KV-cache writes, silu-and-mul,
                           greedy argmax over logits rows; the KV cache may be FP8 (E4M3, per-layer scales)
    csrc/gemm.cpp          products with bf16 weights, all from the plain [out, in] weight: fp32
                           activations (any number of rows; the path of bf16 checkpoints on CPUs without
                           native bf16), bf16 activations of one to four rows (decode of a few requests)
                           and, on AVX-512 BF16, bf16 activations of any number of rows
    csrc/simd.h            the fp32 vector operations both are written against (16 or 8 lanes)
Tensors on another device (CUDA) always take the torch ops: the device is checked before the library
is asked for, so a model on a GPU never builds it."""
from __future__ import annotations

import ctypes
import os
import threading
from typing import NamedTuple

import numpy as np
import torch

from tidal.layers import quant_kernels
from tidal.layers.attention.kv_cache_dtype import paired
from tidal.native import NativeLibrary, cpu_isa

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CACHE_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 3}  # an FP8 (E4M3) KV cache: kv_cache_dtype "fp8"


def _configure(lib: ctypes.CDLL) -> None:
    fn = lib.tidal_paged_attention_decode
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
                   + [ctypes.c_int] * 2 + [ctypes.c_float] * 2 + [ctypes.c_int])
    fn = lib.tidal_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn = lib.tidal_rope_neox
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    fn = lib.tidal_silu_and_mul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.tidal_vector_lanes.restype = ctypes.c_int
    fn = lib.tidal_argmax_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn = lib.tidal_write_kv
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
                   + [ctypes.c_int] * 2 + [ctypes.c_float] * 2 + [ctypes.c_void_p, ctypes.c_int])


_LIB = NativeLibrary("cpu_kernels", os.path.join(os.path.dirname(__file__), "csrc", "cpu_kernels.cpp"),
                     ["-O3", "-fopenmp", "-std=c++17"], ["-fopenmp"], _configure)


def native_lib() -> ctypes.CDLL | None:
    """The kernels built for this CPU's ISA level (tidal.native.cpu_isa), or None."""
    return _LIB.get()


def describe() -> str:
    """One line for the start-up log: the ISA level and which kernels run natively."""
    from tidal.native import cpu_isa
    lib, gemm = native_lib(), _GEMM_LIB.get()
    if lib is None:
        return f"CPU ISA {cpu_isa()}: native kernels unavailable, torch ops only"
    lanes = lib.tidal_vector_lanes()
    parts = ["paged attention", "RMSNorm", "rotary", "KV writes"]
    if lanes > 1:
        parts.append("silu-and-mul")
    if gemm is not None:
        kind = " (AMX tiles)" if amx_in_use() else " (VDPBF16PS)" if cpu_isa() == "avx512_bf16" else ""
        parts.append("bf16-weight GEMM" + kind)
    if (int8_dot := quant_kernels.int8_dot_kind()) is not None:
        parts.append(f"int8/fp8 GEMM (W8A8: {int8_dot})")
    return f"CPU ISA {cpu_isa()} ({lanes} fp32 lanes): native {', '.join(parts)}"


def _lib_for(t: torch.Tensor) -> ctypes.CDLL | None:
    """The library for a kernel over t: None (not even built) unless t is on the CPU."""
    return native_lib() if t.is_cpu else None


def _cache_dtype_ok(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """The kernels read a cache of the activations' dtype, a bf16 cache under fp32 activations, or an FP8
    cache under any."""
    return (cache_dtype == dtype or (dtype == torch.float32 and cache_dtype == torch.bfloat16)
            or cache_dtype == torch.float8_e4m3fn)


def _layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernels read a paired cache in pairs (kv_cache_dtype.paired): its K and V views must be the 5-D ones
    split_kv_cache gives where they pair, 4-D where they do not."""
    head_dim, block_size = v_cache.shape[-1], k_cache.shape[-1]
    return (k_cache.dim() == (5 if paired(k_cache, head_dim) else 4)
            and v_cache.dim() == (5 if paired(v_cache, block_size) else 4))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           table_index: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor | None:
    """q [B, Hq, D], each a query over its first seq_lens[b] cached K/V (layouts of layer.split_kv_cache),
    through block_tables[table_index[b]] (block_tables[b] without an index). The cache is of q's dtype,
    bf16 under fp32 queries, or FP8 (E4M3) holding K / k_scale and V / v_scale, widened in registers.
    Returns None when the native kernel is unavailable or the inputs are not on the CPU."""
    lib = _lib_for(q)
    if (lib is None or q.dtype not in _DTYPES or not _cache_dtype_ok(q.dtype, k_cache.dtype)
            or not _layout_ok(k_cache, v_cache)):
        return None
    B, Hq, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:  # each query's heads contiguous; the queries may be strided
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    index = None if table_index is None else table_index.contiguous()
    out = torch.empty(B, Hq, D, dtype=q.dtype)
    lib.tidal_paged_attention_decode(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        None if index is None else index.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), B, Hq, v_cache.shape[1], D, k_cache.shape[-1], block_tables.shape[1], scale,
        _DTYPES[q.dtype], _CACHE_DTYPES[k_cache.dtype], k_scale, v_scale, torch.get_num_threads())
    return out


def rope_neox(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor | None:
    """Rotated copy [T, H, D] of x [T, H, D] (rows may be strided, heads contiguous inside a row), with
    fp32 tables [max_position, D]; None when the native kernel does not apply."""
    lib = _lib_for(x)
    if (lib is None or x.dtype not in _DTYPES or x.dim() != 3
            or x.stride(2) != 1 or x.stride(1) != x.shape[2] or positions.dtype != torch.int64):
        return None
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=x.dtype)
    positions = positions.contiguous()  # held: a temporary copy would be freed before the call runs
    lib.tidal_rope_neox(x.data_ptr(), x.stride(0), cos_full.data_ptr(), sin_signed.data_ptr(),
                        positions.data_ptr(), out.data_ptr(), T, H, D, _DTYPES[x.dtype],
                        torch.get_num_threads())
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
             k_shift: torch.Tensor | None = None) -> bool:
    """Store k/v [T, Hk, D] (rows may be strided) at their slots of k_cache [nb, Hk, D, bs] and
    v_cache [nb, Hk, bs, D] (a bf16 cache's in pairs: layer.split_kv_cache); an FP8 cache gets
    (k - k_shift) / k_scale and v / v_scale converted as kv_cache_dtype.quantize does, bit for bit
    (k_shift: fp32 [Hk * D] or None; FP8 caches only). False when the native kernel does not apply."""
    lib = _lib_for(k)
    if (lib is None or k.dtype not in _DTYPES or k.dtype != v.dtype or not _cache_dtype_ok(k.dtype, k_cache.dtype)
            or v_cache.dtype != k_cache.dtype or slot_mapping.dtype != torch.int64 or not _layout_ok(k_cache, v_cache)):
        return False
    if k_shift is not None and (k_cache.dtype != torch.float8_e4m3fn or k_shift.dtype != torch.float32
                                or not k_shift.is_contiguous() or k_shift.numel() != k.shape[1] * k.shape[2]):
        return False
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return False
    T, Hk, D = k.shape
    slot_mapping = slot_mapping.contiguous()  # held: a temporary copy would be freed before the call runs
    lib.tidal_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(),
                       k_cache.data_ptr(), v_cache.data_ptr(), T, Hk, D, k_cache.shape[-1], _DTYPES[k.dtype],
                       _CACHE_DTYPES[k_cache.dtype], k_scale, v_scale,
                       None if k_shift is None else k_shift.data_ptr(), torch.get_num_threads())
    return True


_ARGMAX_OUT = threading.local()  # argmax_rows' result buffers: {row count: (array, its address)} per thread


def _argmax_buffer(rows: int) -> tuple[np.ndarray, int]:
    """This thread's int64 result buffer for `rows` argmaxes, and its address (made once per row count)."""
    buffers = _ARGMAX_OUT.__dict__
    out = buffers.get(rows)
    if out is None:
        array = np.empty(rows, dtype=np.int64)
        out = buffers[rows] = (array, array.ctypes.data)
    return out


def argmax_rows(x: torch.Tensor) -> list[int] | None:
    """torch.argmax(x, -1).tolist() for a contiguous fp32 or bf16 CPU tensor [R, V] (the first index of each
    row's maximum), read once in its own dtype: greedy sampling without widening the logits to fp32 first,
    and without a torch tensor for the result. None where the native kernel does not apply."""
    lib = _lib_for(x)
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous():
        return None
    rows = x.shape[0]
    out = _argmax_buffer(rows)
    lib.tidal_argmax_rows(x.data_ptr(), rows, x.shape[1], out[1], _DTYPES[x.dtype], torch.get_num_threads())
    return out[0].tolist()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :d]) * x[..., d:] for a contiguous fp32 or bf16 CPU tensor [T, 2d]; None where the
    native kernel does not apply."""
    lib = _lib_for(x)
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or not x.is_contiguous():
        return None
    T, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, d, dtype=x.dtype)
    if lib.tidal_silu_and_mul(x.data_ptr(), out.data_ptr(), T, d, _DTYPES[x.dtype], torch.get_num_threads()) != 0:
        return None
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Fused (residual add +) RMSNorm over the last dim of a [T, H] CPU tensor. Returns out, or
    (out, new residual) when a residual is given; None when the native kernel does not apply."""
    lib = _lib_for(x)
    if (lib is None or x.dtype not in _DTYPES or x.dim() != 2 or weight.dtype != x.dtype
            or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape))):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    T, H = x.shape
    if residual is None:
        lib.tidal_rms_norm(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, T, H, eps,
                           _DTYPES[x.dtype], torch.get_num_threads())
        return out
    residual = residual.contiguous()
    new_residual = torch.empty_like(x)
    lib.tidal_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), new_residual.data_ptr(),
                       T, H, eps, _DTYPES[x.dtype], torch.get_num_threads())
    return out, new_residual


def _configure_gemm(lib: ctypes.CDLL) -> None:
    lib.tidal_gemm_amx.restype = ctypes.c_int
    lib.tidal_gemm_amx.argtypes = []
    lib.tidal_skinny_gemm_bf16.restype = ctypes.c_int
    lib.tidal_skinny_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_gemm_bf16.restype = ctypes.c_int
    lib.tidal_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_linear_f32_bf16w.restype = None
    lib.tidal_linear_f32_bf16w.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_linear_f32_bf16_packed.restype = ctypes.c_int
    lib.tidal_linear_f32_bf16_packed.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_linear_f32.restype = None
    lib.tidal_linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_skinny_gemm_bf16_ordered.restype = ctypes.c_int
    lib.tidal_skinny_gemm_bf16_ordered.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_gemm_bf16_packed.restype = ctypes.c_int
    lib.tidal_gemm_bf16_packed.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_gemm_bf16_packed_silu.restype = ctypes.c_int
    lib.tidal_gemm_bf16_packed_silu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_linear_f32_bf16_packed_silu.restype = ctypes.c_int
    lib.tidal_linear_f32_bf16_packed_silu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tidal_gemm_bf16_packed_argmax.restype = ctypes.c_int
    lib.tidal_gemm_bf16_packed_argmax.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
                                                  + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64])
    lib.tidal_gemm_bf16_packed_greedy.restype = ctypes.c_int
    lib.tidal_gemm_bf16_packed_greedy.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                                                  + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64])
    lib.tidal_gemm_amx_int8.restype = ctypes.c_int
    lib.tidal_gemm_amx_int8.argtypes = []
    lib.tidal_gemm_bf16_packed_screen.restype = ctypes.c_int
    lib.tidal_gemm_bf16_packed_screen.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_float] + [ctypes.c_int64] * 4
                                                  + [ctypes.c_int, ctypes.c_void_p])
    lib.tidal_linear_f32_bf16_packed_greedy.restype = ctypes.c_int
    lib.tidal_linear_f32_bf16_packed_greedy.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
                                                        + [ctypes.c_int, ctypes.c_void_p])
    lib.tidal_greedy_screen_bf16.restype = ctypes.c_int
    lib.tidal_greedy_screen_bf16.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4
                                             + [ctypes.c_int])
    lib.tidal_unpack_bf16_rows.restype = ctypes.c_int
    lib.tidal_unpack_bf16_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int]
    for name in ("tidal_gemm_bf16_rows", "tidal_linear_f32_rows"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                       + [ctypes.c_int64] * 3 + [ctypes.c_int])


_GEMM_LIB = NativeLibrary("gemm", os.path.join(os.path.dirname(__file__), "csrc", "gemm.cpp"),
                          ["-O3", "-fopenmp", "-std=c++17"], ["-fopenmp"], _configure_gemm)


def gemm_lib() -> ctypes.CDLL | None:
    return _GEMM_LIB.get()


def amx_in_use() -> bool:
    """Whether the bf16-activation products run on AMX tiles (gemm.cpp: namespace amx): an AVX-512 BF16
    build on a CPU with AMX-BF16 whose kernel grants the tile state, unless TIDAL_AMX=0. One process takes
    one path for all of them, so their rows agree bit for bit with each other (not with the other path's)."""
    lib = _GEMM_LIB.get()
    return lib is not None and cpu_isa() == "avx512_bf16" and bool(lib.tidal_gemm_amx())


def amx_int8_in_use() -> bool:
    """Whether the AMX tiles' int8 products run here as well (the greedy LM head's screen for bf16 rows:
    packed_linear_screen): amx_in_use() and a CPU with AMX-INT8."""
    return amx_in_use() and bool(_GEMM_LIB.get().tidal_gemm_amx_int8())


# Up to this many rows the skinny kernel (weights streamed once, VDPBF16PS) beats oneDNN's prepacked
# GEMM. Measured on SmolLM2's shapes, 2 threads, summed over one layer's four products: 1.6x for one row,
# 1.6x for two, 1.3x for three, 1.2x for four (at four rows the LM head alone is 10% slower). The blocked
# kernel (bf16_linear) costs the same for 1 to 16 rows: its vector lanes are 16 rows of x.
SKINNY_MAX_ROWS = 4

# Up to this many bf16 rows (one tile of rows) the greedy LM head reads its int8 screen on the AMX tiles
# (packed_linear_screen) rather than the bf16 weight: SmolLM2's head (49,152 x 576, weights from memory, real
# hidden states) 1 row 2.4-2.6 -> 1.4-1.5 ms, 8 rows 2.3 -> 1.7, 16 rows 2.4 -> 1.9; from 24 rows the rows'
# two int8 tiles a chunk, loaded from L2 for every pair of weight tiles, cost what the weight's bytes save
# (32 rows 2.5 either way, 64 rows 2.8 -> 3.5; docs/cpu.md)
SCREEN_MAX_ROWS = 16


def _gemm(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          out_dtype: torch.dtype) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias) through one of gemm.cpp's kernels (same signature: x, w, bias,
    out, M, N, K, threads; a non-zero return means it does not apply here). None when it does not run."""
    lib = _GEMM_LIB.get()
    if lib is None:
        return None
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    M, K = x2.shape
    N = weight.shape[0]
    if M == 0:
        return None
    out = torch.empty(M, N, dtype=out_dtype)
    weight = weight.contiguous()  # held here: a temporary's memory would be freed before the call runs
    bias = None if bias is None else bias.contiguous()
    if getattr(lib, kernel)(x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                            out.data_ptr(), M, N, K, torch.get_num_threads()):
        return None
    return out.view(*shape[:-1], N)


def linear_f32_bf16w(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] fp32 @ weight [N, K] bf16 ^T (+ fp32 bias) in fp32, on CPU: the weights widened in
    registers. A row's result does not depend on the other rows. None when the kernel does not apply."""
    if (x.dtype != torch.float32 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or (bias is not None and bias.dtype != torch.float32)):
        return None
    return _gemm("tidal_linear_f32_bf16w", x, weight, bias, torch.float32)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias), all fp32 on CPU, through the native kernel whose outputs are
    each one dot product in a fixed order whatever the number of rows (batch-invariant mode; torch's
    GEMM picks its kernel, hence its summation order, by shape). None when it does not apply."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or (bias is not None and bias.dtype != torch.float32)):
        return None
    return _gemm("tidal_linear_f32", x, weight, bias, torch.float32)


def skinny_linear_ordered(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """skinny_linear in bf16_linear's summation order (1 to SKINNY_MAX_ROWS rows, AVX-512 BF16): a row's
    result is bitwise the one bf16_linear gives it in any batch. None when it does not apply."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or (bias is not None and bias.dtype != torch.bfloat16) or not bf16_gemm_available()):
        return None
    return _gemm("tidal_skinny_gemm_bf16_ordered", x, weight, bias, torch.bfloat16)


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in the layout of the packed kernel (gemm.cpp: skinny_bf16_packed): tiles of 16
    rows, pair-interleaved, [ceil(N / 16), ceil(K / 2), 16] int32 (pair (w[n, 2p], w[n, 2p + 1]) of row
    16t + i at [t, p, i]), zero past N and past an odd K. The same bytes as the weight, give or take the
    padding. Each row's values are kept: `unpack_bf16_rows` reads rows back."""
    n, k = weight.shape
    n_pad, k_pad = -(-n // 16) * 16, k + k % 2
    w = torch.zeros(n_pad, k_pad, dtype=torch.bfloat16, device=weight.device)
    w[:n, :k] = weight
    return w.view(torch.int32).view(n_pad // 16, 16, k_pad // 2).transpose(1, 2).contiguous()


def unpack_bf16_rows(packed: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `rows` (any shape of indices) of the weight `packed` holds, bf16 [..., k]: an embedding lookup
    in a table packed for the LM head it is tied to."""
    flat = rows.reshape(-1)
    lib = _GEMM_LIB.get() if packed.device.type == "cpu" and flat.dtype == torch.int64 else None
    if lib is not None:  # a copy of each row's 64-byte-strided pairs; torch's gather costs ~0.1 ms per call
        flat = flat.contiguous()
        out = torch.empty(flat.shape[0], k, dtype=torch.bfloat16)
        n_rows = packed.shape[0] * 16
        if lib.tidal_unpack_bf16_rows(packed.data_ptr(), flat.data_ptr(), flat.shape[0], n_rows, k, out.data_ptr(),
                                      torch.get_num_threads()) != 0:
            bad = int(flat[(flat < 0) | (flat >= n_rows)][0])
            raise IndexError(f"row {bad} is outside the table's {n_rows} rows")
        return out.reshape(*rows.shape, k)
    picked = packed[flat // 16, :, flat % 16]  # [len, ceil(k / 2)] pairs
    return picked.contiguous().view(torch.bfloat16)[:, :k].reshape(*rows.shape, k)


def unpack_bf16_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plain bf16 weight [n, k] of a packed one (a copy)."""
    return unpack_bf16_rows(packed, torch.arange(n, device=packed.device), k)


def bf16_gemm_available() -> bool:
    """Whether gemm.cpp's bf16-activation kernels (VDPBF16PS: tidal_gemm_bf16, its ordered skinny and packed
    forms) run here: an AVX-512 BF16 build. Elsewhere callers skip them rather than pay a call that fails."""
    return _GEMM_LIB.get() is not None and cpu_isa() == "avx512_bf16"


def packed_gemm_available(act_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a packed kernel for activations of act_dtype runs on this CPU: bf16 (tidal_gemm_bf16_packed)
    on an AVX-512 BF16 build of gemm.cpp; fp32 (tidal_linear_f32_bf16_packed) on any vector build (AVX2 and
    up)."""
    if act_dtype == torch.bfloat16:
        return bf16_gemm_available()
    return act_dtype == torch.float32 and _GEMM_LIB.get() is not None and cpu_isa() != "generic"


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                  bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., k] @ W^T (+ bias) in x's dtype for a bf16 weight W [n, k] held packed (`pack_bf16_weight`),
    any number of rows, a row's result whatever the number of rows. bf16 x: bitwise what `bf16_linear`
    gives on the plain W (1-4 rows stream the weight once, more take the blocked kernel). fp32 x: each
    output one fp32 FMA chain over k in order (gemm.cpp: packed_f32), 1-4 rows streaming the weight once,
    more in register tiles over L1-resident weight tiles. None when it does not apply (no such build)."""
    lib = _GEMM_LIB.get()
    if lib is None or x.dtype not in (torch.bfloat16, torch.float32) or (bias is not None and bias.dtype != x.dtype):
        return None
    kernel = lib.tidal_gemm_bf16_packed if x.dtype == torch.bfloat16 else lib.tidal_linear_f32_bf16_packed
    return _run_linear(x, n, k, bias, lambda xp, bp, op, m: kernel(
        xp, packed.data_ptr(), bp, op, m, n, k, torch.get_num_threads()))


def packed_linear_silu(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(gate) * up of a gate/up product [gate; up] (W [n, k] held packed, n = 2 d) of rows x [rows, k] as
    one kernel, the [rows, n] product never stored: bitwise `silu_and_mul(packed_linear(x, ...))`. bf16 x:
    the products on the AMX tiles or with VDPBF16PS, silu-and-mul in their epilogue; fp32 x: each pair of
    gate and up tiles over a chunk of rows, then silu-and-mul on them while they are in L1. None when it
    does not apply (bf16 x without AVX-512 BF16, no vector build, fewer than 5 rows, d not a multiple of 16)."""
    lib = _GEMM_LIB.get()
    if (lib is None or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or not x.is_contiguous()
            or x.shape[1] != k or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
        return None
    kernel = lib.tidal_gemm_bf16_packed_silu if x.dtype == torch.bfloat16 else lib.tidal_linear_f32_bf16_packed_silu
    out = torch.empty(x.shape[0], n // 2, dtype=x.dtype)
    if kernel(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
              out.data_ptr(), x.shape[0], n, k, torch.get_num_threads()) != 0:
        return None
    return out


def packed_linear_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
                         n_valid: int) -> tuple[torch.Tensor, list[int]] | None:
    """packed_linear of 1-4 rows of x [rows, k] with each row's argmax over its first n_valid outputs (the
    first index of the largest; argmax_rows' result on them), found by the kernel as it stores the outputs:
    greedy sampling's LM head, without a second pass over the logits (from the other threads' caches).
    None when it does not apply (other row counts, no AVX-512 BF16 build)."""
    lib = _GEMM_LIB.get()
    rows = x.shape[0] if x.dim() == 2 else 0
    if lib is None or not 1 <= rows <= SKINNY_MAX_ROWS or x.dtype != torch.bfloat16 or (
            bias is not None and bias.dtype != torch.bfloat16):
        return None
    found = _argmax_buffer(rows)
    logits = _run_linear(x, n, k, bias, lambda xp, bp, op, m: lib.tidal_gemm_bf16_packed_argmax(
        xp, packed.data_ptr(), bp, op, m, n, k, torch.get_num_threads(), found[1], n_valid))
    return None if logits is None else (logits, found[0].tolist())


class GreedyScreen(NamedTuple):
    """What the greedy LM head (packed_linear_greedy) screens the vocabulary with: the weight's rows in int8
    (one scale per row) in 16-row tiles, [tiles, ceil(k / 2), 16, 2] (pair (q[n, 2p], q[n, 2p + 1]) of row
    16t + i at [t, p, i]); and per row the two terms of the bound on how far an int8 logit may be from the
    fp32 product's (gemm.cpp: greedy), rounded up to fp32."""
    weight: torch.Tensor
    scale: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor


def greedy_screen_available() -> bool:
    """Whether packed_linear_greedy runs here (a vector build of gemm.cpp: AVX2 and up)."""
    return _GEMM_LIB.get() is not None and cpu_isa() != "generic"


def greedy_screen(weight: torch.Tensor) -> GreedyScreen | None:
    """The screen of a bf16 LM-head weight [n, k] (plain, before packing), or None where the kernel does not
    run or the weight is not finite. Half the bf16 weight's bytes and three floats a row."""
    if (not greedy_screen_available() or weight.dim() != 2 or weight.device.type != "cpu"
            or weight.dtype != torch.bfloat16):
        return None
    lib = _GEMM_LIB.get()
    n, k = weight.shape
    tiles, pairs = -(-n // 16), -(-k // 2)
    w = weight.contiguous()
    screen = GreedyScreen(torch.empty(tiles, pairs, 16, 2, dtype=torch.int8),
                          *(torch.empty(tiles * 16, dtype=torch.float32) for _ in range(3)))
    if lib.tidal_greedy_screen_bf16(w.data_ptr(), n, k, screen.weight.data_ptr(), screen.scale.data_ptr(),
                                    screen.a.data_ptr(), screen.b.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return screen


class TileScreen(NamedTuple):
    """What packed_linear_screen screens the vocabulary with on the AMX tiles: GreedyScreen's int8 rows in the
    tile unit's int8 layout [tiles, ceil(k / 64), 16, 16, 4] (for each 64 k, 16 quads of k, each of the tile's
    16 rows' four values side by side; zero past k), its scales and bound terms, and the largest of those
    terms (with it the kernel checks that no value or bound can overflow)."""
    weight: torch.Tensor
    scale: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    bound: float


def greedy_screen_tiles(weight: torch.Tensor) -> TileScreen | None:
    """The int8 screen of a bf16 LM-head weight [n, k] (plain, before packing) for bf16 rows on the AMX tiles
    (packed_linear_screen): greedy_screen's in the tile unit's layout. Half the bf16 weight's bytes. None where
    it does not run (no AMX-INT8 in use here, a weight that is not finite)."""
    if not amx_int8_in_use():
        return None
    screen = greedy_screen(weight)
    if screen is None:
        return None
    n, k = weight.shape
    tiles, pairs, k64 = screen.weight.shape[0], screen.weight.shape[1], -(-k // 64) * 64
    rows = screen.weight.permute(0, 2, 1, 3).reshape(tiles, 16, 2 * pairs)[..., :k]  # each tile's 16 int8 rows
    padded = torch.zeros(tiles, 16, k64, dtype=torch.int8)
    padded[..., :k] = rows
    quads = padded.view(tiles, 16, k64 // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()
    return TileScreen(quads, screen.scale, screen.a, screen.b, float(torch.maximum(screen.a.max(), screen.b.max())))


def packed_linear_screen(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, screen: TileScreen,
                         n_valid: int) -> list[int] | None:
    """Each row's argmax over the first n_valid outputs of packed_linear(x, packed, n, k) (bf16 x [rows, k], no
    bias), as packed_linear_argmax_only finds it, reading the weight's int8 screen (greedy_screen_tiles) on
    the AMX tiles and the bf16 weight only for a few candidate tiles of each row (gemm.cpp: screen_argmax).
    None where it does not apply (no AMX-INT8, x not finite): the caller runs the whole product."""
    return _screened_argmax("tidal_gemm_bf16_packed_screen", torch.bfloat16, x, packed, n, k, screen, n_valid,
                            screen.bound)


def packed_linear_argmax_only(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
                              n_valid: int) -> list[int] | None:
    """Each row's argmax over the first n_valid outputs of packed_linear(x, packed, n, k, bias) (bf16 x [rows,
    k], any number of rows), argmax_rows' result on them, without the outputs themselves: the AMX kernel
    takes each row's largest as it rounds the tiles' sums and stores nothing (greedy sampling's LM head over
    a batch: [rows, vocabulary] logits that nothing would read). None where it does not apply (no AMX)."""
    lib = _GEMM_LIB.get()
    if (lib is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or x.shape[0] < 1
            or (bias is not None and bias.dtype != torch.bfloat16)):
        return None
    x = x.contiguous()
    rows = x.shape[0]
    found = _argmax_buffer(rows)
    bias = None if bias is None else bias.contiguous()
    if lib.tidal_gemm_bf16_packed_greedy(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                         rows, n, k, torch.get_num_threads(), found[1], n_valid) != 0:
        return None
    return found[0].tolist()


def packed_linear_greedy(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, screen: GreedyScreen,
                         n_valid: int) -> list[int] | None:
    """Each row's argmax over the first n_valid outputs of packed_linear(x, packed) (fp32 x [rows, k], no
    bias), the first index of the largest as argmax_rows gives, without computing most of them: int8
    approximations of every output and a bound on their error leave a few candidates, whose tiles the fp32
    kernel computes (gemm.cpp: greedy). None when it does not apply (no such build, x not finite)."""
    return _screened_argmax("tidal_linear_f32_bf16_packed_greedy", torch.float32, x, packed, n, k, screen, n_valid)


def _screened_argmax(kernel: str, dtype: torch.dtype, x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                     screen: GreedyScreen | TileScreen, n_valid: int, *extra) -> list[int] | None:
    """A screened greedy kernel's argmax of each row of x [rows, k] (of dtype), or None where it does not run."""
    lib = _GEMM_LIB.get()
    if lib is None or x.dtype != dtype or x.dim() != 2 or x.shape[1] != k or x.shape[0] < 1:
        return None
    x = x.contiguous()
    rows = x.shape[0]
    found = _argmax_buffer(rows)
    if getattr(lib, kernel)(x.data_ptr(), packed.data_ptr(), screen.weight.data_ptr(), screen.scale.data_ptr(),
                            screen.a.data_ptr(), screen.b.data_ptr(), *extra, rows, n, k, n_valid,
                            torch.get_num_threads(), found[1]) != 0:
        return None
    return found[0].tolist()


def _run_linear(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, call) -> torch.Tensor | None:
    """x [..., k] -> [..., n] in x's dtype through call(x ptr, bias ptr or None, out ptr, rows), a native
    kernel's call on the contiguous rows of x (non-zero: it does not apply here, None)."""
    shape = x.shape
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return out.view(*shape[:-1], n)
    bias = None if bias is None else bias.contiguous()  # held here: a temporary would be freed before the call
    if call(x2.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), m):
        return None
    return out.view(*shape[:-1], n)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, rows_fn: int, fmt: int, n: int, k: int,
                bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., k] @ W^T (+ bias) for a weight W [n, k] held in another format (`weight`'s storage), whose
    rows the native function at address `rows_fn` makes in x's dtype as the kernel reaches them (e.g. GGUF
    blocks: gguf_kernels). bf16 x (AVX-512 BF16 builds): any number of rows, each output what `bf16_linear`
    gives on the plain bf16 W. fp32 x: more than 8 rows, through the blocked fp32 path (fewer rows are
    the caller's streaming kernel's). None when it does not apply."""
    lib = _GEMM_LIB.get()
    kernel = {torch.bfloat16: "tidal_gemm_bf16_rows", torch.float32: "tidal_linear_f32_rows"}.get(x.dtype)
    if lib is None or kernel is None or (bias is not None and bias.dtype != x.dtype):
        return None
    return _run_linear(x, n, k, bias, lambda xp, bp, op, m: getattr(lib, kernel)(
        xp, weight.data_ptr(), rows_fn, fmt, bp, op, m, n, k, torch.get_num_threads()))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T (+ bias) for M <= SKINNY_MAX_ROWS, bf16 on CPU; None when it does not
    apply (callers fall back to the blocked kernel)."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or (bias is not None and bias.dtype != torch.bfloat16)):
        return None
    return _gemm("tidal_skinny_gemm_bf16", x, weight, bias, torch.bfloat16)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias), all bf16 on CPU, any number of rows, straight from the plain
    weight (VDPBF16PS; AVX-512 BF16 builds only). A row's result does not depend on the other rows.
    None when it does not apply (callers fall back to F.linear)."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or (bias is not None and bias.dtype != torch.bfloat16) or not bf16_gemm_available()):
        return None
    return _gemm("tidal_gemm_bf16", x, weight, bias, torch.bfloat16)
