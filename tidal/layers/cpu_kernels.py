"""The native CPU kernels of paged attention and RMSNorm (csrc/paged_attention.cpp, built by
tidal/native.py), with thin wrappers that return None when the kernel cannot run so callers fall
back to torch ops."""
from __future__ import annotations

import ctypes
import os

import torch

from tidal.native import NativeLibrary

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _configure(lib: ctypes.CDLL) -> None:
    fn = lib.tidal_paged_attention_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn = lib.tidal_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]


_LIB = NativeLibrary("paged_attention", os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp"),
                     ["-O3", "-march=native", "-fopenmp", "-std=c++17"], ["-fopenmp"], _configure)


def native_lib() -> ctypes.CDLL | None:
    return _LIB.get()


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [B, Hq, D] over each request's cached K/V (layouts of layer.split_kv_cache).
    Returns None when the native kernel is unavailable or the inputs are not on the CPU."""
    lib = native_lib()
    if lib is None or q.device.type != "cpu" or q.dtype not in _DTYPES or k_cache.dtype != q.dtype:
        return None
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    B, Hq, D = q.shape
    lib.tidal_paged_attention_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), B, Hq, v_cache.shape[1], D, v_cache.shape[2], block_tables.shape[1], scale,
        _DTYPES[q.dtype], torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Fused (residual add +) RMSNorm over the last dim of a [T, H] CPU tensor. Returns out, or
    (out, new residual) when a residual is given; None when the native kernel does not apply."""
    lib = native_lib()
    if (lib is None or x.device.type != "cpu" or x.dtype not in _DTYPES or x.dim() != 2 or weight.dtype != x.dtype
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
