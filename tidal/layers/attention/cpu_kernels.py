"""Native CPU kernels: plain C++ (no torch headers) compiled on first use with the machine's
compiler into ~/.cache/tidal/kernels and called through ctypes. Without a compiler (or with
TIDAL_NATIVE_KERNELS=0) the torch implementations are used instead."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_lock = threading.Lock()
_lib = None
_failed = False


def _build() -> ctypes.CDLL:
    with open(_SRC, "rb") as f:
        src = f.read()
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found")
    key = hashlib.sha256(src + " ".join([cxx] + _FLAGS).encode()).hexdigest()[:16]
    root = os.environ.get("TIDAL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tidal"))
    out_dir = os.path.join(root, "kernels")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"paged_attention-{key}.so")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        subprocess.run([cxx, *_FLAGS, _SRC, "-o", tmp], check=True, capture_output=True)
        os.replace(tmp, path)  # atomic: concurrent builders never load half a file
    lib = ctypes.CDLL(path)
    fn = lib.tidal_paged_attention_decode
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn = lib.tidal_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def native_lib() -> ctypes.CDLL | None:
    global _lib, _failed
    if _lib is not None or _failed:
        return _lib
    with _lock:
        if _lib is None and not _failed:
            if os.environ.get("TIDAL_NATIVE_KERNELS", "1") == "0":
                _failed = True
            else:
                try:
                    _lib = _build()
                except Exception as e:  # no compiler, build error: fall back to torch ops
                    logger.warning("native CPU attention kernel unavailable (%s); using torch ops", e)
                    _failed = True
    return _lib


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
