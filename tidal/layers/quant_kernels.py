"""Products with 8-bit weights on the CPU, native (csrc/quant_gemm.cpp, built by tidal/native.py per ISA
level) with a torch reference for each:

    int8_linear     W8A16: fp32 / bf16 activations, int8 weights widened to fp32 in registers
    fp8_linear      the same with float8_e4m3fn weights
    w8a8_linear     activations quantized per token to int8, int8 x int8 summed exactly in int32
                    (VPDPBUSD on AVX-512 VNNI, VPMADDUBSW elsewhere)
    quantize_rows_int8, int8_row_sums, int8_gemm_i32: the pieces of w8a8_linear

Weights stay in the plain [N, K] row-major layout with a per-output-channel fp32 scale [N]: one copy in
memory, nothing prepacked. Symmetric int8 weights must lie in [-127, 127]. A row's result never depends
on the other rows of the call (the same sums in the same order whatever M is), so batching does not
change a request's tokens.

Each native wrapper returns None when its kernel cannot run (no compiler, a tensor not on the CPU, a
dtype it does not handle): callers then use the `*_reference` function of the same name, which computes
the same thing with torch ops (up to fp32 summation order for the W8A16 products; exactly for the
rest).
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from tidal.native import NativeLibrary

_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _configure(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.tidal_w8a16_linear.restype = i32
    lib.tidal_w8a16_linear.argtypes = [p, i32, p, i32, p, p, p, i64, i64, i64, i32]
    lib.tidal_quantize_rows_int8.restype = i32
    lib.tidal_quantize_rows_int8.argtypes = [p, i32, p, p, i64, i64, i32]
    lib.tidal_int8_row_sums.restype = None
    lib.tidal_int8_row_sums.argtypes = [p, p, i64, i64, i32]
    lib.tidal_int8_gemm_i32.restype = None
    lib.tidal_int8_gemm_i32.argtypes = [p, p, p, p, i64, i64, i64, i32]
    lib.tidal_w8a8_linear.restype = i32
    lib.tidal_w8a8_linear.argtypes = [p, i32, p, p, p, p, p, i64, i64, i64, i32]
    lib.tidal_int8_dot_kind.restype = i32
    lib.tidal_int8_dot_kind.argtypes = []
    lib.tidal_w8a16_set_bf16_rows_gemm.restype = None
    lib.tidal_w8a16_set_bf16_rows_gemm.argtypes = [p]
    from tidal.layers import cpu_kernels  # the bf16 GEMM that W8A16's bf16 batches run over rounded rows
    gemm = cpu_kernels.gemm_lib()
    if gemm is not None:
        lib.tidal_w8a16_set_bf16_rows_gemm(ctypes.cast(gemm.tidal_gemm_bf16_rows, p).value)


# -ffp-contract=off: the epilogues' a * b + c must round twice in every path (vector or scalar), as the
# torch references do, for rows to be bitwise batch-invariant
_LIB = NativeLibrary("quant_gemm", os.path.join(os.path.dirname(__file__), "csrc", "quant_gemm.cpp"),
                     ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off"], ["-fopenmp"], _configure)


def quant_lib() -> ctypes.CDLL | None:
    """The kernels built for this CPU's ISA level (tidal.native.cpu_isa), or None."""
    return _LIB.get()


def int8_dot_kind() -> str | None:
    """How the W8A8 kernels multiply bytes at this ISA level (for logs and benchmarks), or None."""
    lib = _LIB.get()
    return None if lib is None else ("scalar", "AVX2 VPMADDUBSW", "AVX-512 VPMADDUBSW", "VPDPBUSD")[
        lib.tidal_int8_dot_kind()]


def _ptr(t: torch.Tensor | None) -> int | None:
    """The address of a tensor the caller holds, contiguous (a temporary copy's memory would be freed before
    the native call runs)."""
    if t is not None and not t.is_contiguous():
        raise ValueError("a native kernel's tensor argument must be contiguous")
    return None if t is None else t.data_ptr()


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.is_cpu for t in tensors)


def _linear(kernel: str, x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
            *extra) -> torch.Tensor | None:
    """x [..., K] @ wq [N, K]^T through a kernel of signature (x, x_dtype, w, *extra, w_scale, bias, out, M,
    N, K, threads) returning 0 when it ran, after the checks every 8-bit product shares (None: not here).
    The library is asked for only once the tensors are known to be on the CPU: a GPU model never builds it."""
    x_dtype = _X_DTYPES.get(x.dtype)
    if (x_dtype is None or wq.dim() != 2 or x.dim() == 0 or x.shape[-1] != wq.shape[1]
            or w_scale.dtype != torch.float32 or w_scale.numel() != wq.shape[0]
            or (bias is not None and (bias.dtype != x.dtype or bias.numel() != wq.shape[0]))
            or not _on_cpu(x, wq, w_scale, bias)):
        return None
    lib = _LIB.get()
    if lib is None:
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (the costs here matter: one-row decodes)
    M, K = x2.shape
    N = wq.shape[0]
    if M == 0:
        return None
    out = torch.empty(M, N, dtype=x.dtype)
    # held in locals: a temporary contiguous copy would be freed before the call runs
    x2, wq, w_scale = x2.contiguous(), wq.contiguous(), w_scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    if getattr(lib, kernel)(x2.data_ptr(), x_dtype, wq.data_ptr(), *extra, w_scale.data_ptr(), _ptr(bias),
                            out.data_ptr(), M, N, K, torch.get_num_threads()):
        return None
    return out if x.dim() == 2 else out.view(*x.shape[:-1], N)


W8A16_TILES = 2  # the kernels' w_kind flag: bf16 batches may take the bf16 GEMM (see int8_linear)


def int8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, tiles: bool = True) -> torch.Tensor | None:
    """W8A16: (x @ wq^T) * w_scale + bias in fp32, returned in x's dtype.

    x [..., K] fp32 or bf16; wq [N, K] int8 (symmetric per output channel); w_scale [N] fp32; bias [N]
    of x's dtype or None. The weights are widened in registers (no dequantized copy). With `tiles`, bf16
    x of 12 rows or more on AVX-512 BF16 runs the bf16 GEMM (VDPBF16PS) over weight rows made as it reaches
    them, bf16(wq * w_scale): what a bf16 model computes on the quantize-dequantize round trip of the
    weight; off in batch-invariant mode (a row's result would depend on the rows beside it). None when the
    native kernel does not apply (then use int8_linear_reference).

        >>> w = torch.randint(-127, 128, (960, 576), dtype=torch.int8)
        >>> int8_linear(torch.randn(1, 576), w, torch.full((960,), 0.01)).shape
        torch.Size([1, 960])
    """
    if wq.dtype != torch.int8:
        return None
    return _linear("tidal_w8a16_linear", x, wq, w_scale, bias, W8A16_TILES if tiles else 0)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, tiles: bool = True) -> torch.Tensor | None:
    """int8_linear with wq [N, K] torch.float8_e4m3fn (NaN encodings not expected), widened in registers."""
    if wq.dtype != torch.float8_e4m3fn:
        return None
    return _linear("tidal_w8a16_linear", x, wq, w_scale, bias, 1 | (W8A16_TILES if tiles else 0))


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Dynamic per-token symmetric quantization of x [..., K] (fp32 or bf16) viewed as [M, K]:
    x_scale [M] = max|row| / 127 (1 for a row of zeros), xq [M, K] int8 = round-half-to-even(x / x_scale)
    clamped to [-127, 127]. Bitwise the same as quantize_rows_int8_reference; None when the native
    kernel does not apply."""
    if x.dtype not in _X_DTYPES or x.dim() == 0 or not _on_cpu(x) or (lib := _LIB.get()) is None:
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    xq = torch.empty(M, K, dtype=torch.int8)
    scale = torch.empty(M, dtype=torch.float32)
    if lib.tidal_quantize_rows_int8(x2.data_ptr(), _X_DTYPES[x.dtype], xq.data_ptr(), scale.data_ptr(), M, K,
                                    torch.get_num_threads()):
        return None
    return xq, scale


def int8_row_sums(wq: torch.Tensor) -> torch.Tensor | None:
    """int32 [N]: the sum of each row of wq [N, K] int8. Computed once when the weights load and passed to
    w8a8_linear (VPDPBUSD multiplies x + 128 by w, and takes 128 * row_sum back off)."""
    if wq.dtype != torch.int8 or wq.dim() != 2 or not _on_cpu(wq) or (lib := _LIB.get()) is None:
        return None
    out = torch.empty(wq.shape[0], dtype=torch.int32)
    wq = wq.contiguous()
    lib.tidal_int8_row_sums(wq.data_ptr(), out.data_ptr(), wq.shape[0], wq.shape[1],
                            torch.get_num_threads())
    return out


def _row_sums_ok(w_row_sums: torch.Tensor | None, n: int) -> bool:
    return w_row_sums is None or (w_row_sums.dtype == torch.int32 and w_row_sums.numel() == n)


def int8_gemm_i32(xq: torch.Tensor, wq: torch.Tensor, w_row_sums: torch.Tensor | None = None) -> torch.Tensor | None:
    """The exact int32 accumulator of w8a8_linear: xq [M, K] int8 @ wq [N, K] int8 ^T -> [M, N] int32,
    values of both in [-127, 127]. w_row_sums: int8_row_sums(wq), or None (then computed per call)."""
    if (xq.dtype != torch.int8 or wq.dtype != torch.int8 or xq.dim() != 2 or wq.dim() != 2
            or xq.shape[1] != wq.shape[1] or xq.shape[0] == 0 or not _row_sums_ok(w_row_sums, wq.shape[0])
            or not _on_cpu(xq, wq, w_row_sums) or (lib := _LIB.get()) is None):
        return None
    M, K = xq.shape
    N = wq.shape[0]
    out = torch.empty(M, N, dtype=torch.int32)
    xq, wq = xq.contiguous(), wq.contiguous()
    w_row_sums = None if w_row_sums is None else w_row_sums.contiguous()
    lib.tidal_int8_gemm_i32(xq.data_ptr(), wq.data_ptr(), _ptr(w_row_sums), out.data_ptr(),
                            M, N, K, torch.get_num_threads())
    return out


def w8a8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                w_row_sums: torch.Tensor | None = None) -> torch.Tensor | None:
    """W8A8: x [..., K] (fp32 or bf16) quantized per token as quantize_rows_int8 does, int8 x int8 summed
    exactly in int32, out [..., N] in x's dtype = acc * x_scale[m] * w_scale[n] + bias[n] (fp32, rounded
    once to x's dtype). wq [N, K] int8 in [-127, 127], w_scale [N] fp32, bias [N] of x's dtype or None,
    w_row_sums = int8_row_sums(wq) computed once at load (None: recomputed per call on AVX-512 VNNI).
    Bitwise the same as w8a8_linear_reference; None when the native kernel does not apply.

        >>> w = torch.randint(-127, 128, (960, 576), dtype=torch.int8)
        >>> w8a8_linear(torch.randn(4, 576), w, torch.full((960,), 0.01), None, int8_row_sums(w)).shape
        torch.Size([4, 960])
    """
    if wq.dtype != torch.int8 or not _row_sums_ok(w_row_sums, wq.shape[0]) or not _on_cpu(w_row_sums):
        return None
    return _linear("tidal_w8a8_linear", x, wq, w_scale, bias, _ptr(w_row_sums))


# ---- torch references (the fallbacks) ----

def int8_linear_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    out = F.linear(x.float(), wq.float()) * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


fp8_linear_reference = int8_linear_reference  # wq.float() widens float8_e4m3fn exactly too


def quantize_rows_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1]).float()
    scale = x2.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    xq = torch.round(x2 / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return xq, scale


def int8_row_sums_reference(wq: torch.Tensor) -> torch.Tensor:
    return wq.sum(1, dtype=torch.int32)


def int8_gemm_i32_reference(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Exact: fp64 holds every product (<= 127^2) and every sum of up to 2^38 of them without rounding."""
    return (xq.double() @ wq.double().t()).int()


def w8a8_linear_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    xq, x_scale = quantize_rows_int8_reference(x)
    out = int8_gemm_i32_reference(xq, wq).float() * x_scale[:, None] * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], wq.shape[0])
