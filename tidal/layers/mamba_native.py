"""Native CPU selective scan (tidal/layers/csrc/selective_scan.cpp): plain C++ compiled on first use
with the machine's compiler into ~/.cache/tidal/kernels and called through ctypes, as the attention
kernels are. It keeps each channel's state in registers for the whole chunk instead of writing
exp(dt A) and every state to memory. Without a compiler (or with TIDAL_NATIVE_KERNELS=0) the torch
scan in tidal/layers/mamba.py runs instead."""
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

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "selective_scan.cpp")
# -ffast-math lets exp vectorise (glibc's vector expf). It is given to the compile step only: linked
# with it, GCC 12 adds a constructor that sets flush-to-zero for the whole process when the library loads.
_COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c++17", "-c"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_MAX_STATE = 256  # the kernel's per-channel state buffer
_lock = threading.Lock()
_lib = None
_failed = False


def _build() -> ctypes.CDLL:
    with open(_SRC, "rb") as f:
        src = f.read()
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found")
    key = hashlib.sha256(src + " ".join([cxx, *_COMPILE_FLAGS, *_LINK_FLAGS]).encode()).hexdigest()[:16]
    root = os.environ.get("TIDAL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tidal"))
    out_dir = os.path.join(root, "kernels")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"selective_scan-{key}.so")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        obj = tmp + ".o"
        try:
            subprocess.run([cxx, *_COMPILE_FLAGS, _SRC, "-o", obj], check=True, capture_output=True)
            subprocess.run([cxx, *_LINK_FLAGS, obj, "-o", tmp], check=True, capture_output=True)
        finally:
            if os.path.exists(obj):
                os.remove(obj)
        os.replace(tmp, path)  # atomic: concurrent builders never load half a file
    lib = ctypes.CDLL(path)
    fn = lib.tidal_selective_scan
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 5
    return lib


def _native_lib() -> ctypes.CDLL | None:
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
                except Exception as e:  # noqa: BLE001  no compiler, build error: fall back to torch ops
                    logger.warning("native CPU selective scan unavailable (%s); using torch ops", e)
                    _failed = True
    return _lib


def selective_scan_native(dt: torch.Tensor, dtx: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          C: torch.Tensor, h: torch.Tensor, snapshots) -> tuple[torch.Tensor, list] | None:
    """Same contract as mamba.selective_scan; None when the kernel cannot run these inputs."""
    tensors = (dt, dtx, A, B, C, h)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors) or A.shape[1] > _MAX_STATE:
        return None
    lib = _native_lib()
    if lib is None:
        return None
    L, R, d = dt.shape
    N = A.shape[1]
    dt, dtx, A, B, C = (t.contiguous() for t in (dt, dtx, A, B, C))
    state = h.contiguous()
    y = torch.empty(L, R, d, dtype=torch.float32)
    snap_t = torch.tensor([t for t, _ in snapshots], dtype=torch.int64)
    snap_r = torch.tensor([r for _, r in snapshots], dtype=torch.int64)
    snap_out = torch.empty(len(snapshots), d, N, dtype=torch.float32)
    lib.tidal_selective_scan(dt.data_ptr(), dtx.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
                             state.data_ptr(), y.data_ptr(), snap_t.data_ptr(), snap_r.data_ptr(),
                             snap_out.data_ptr(), len(snapshots), L, R, d, N)
    if state.data_ptr() != h.data_ptr():
        h.copy_(state)
    return y, list(snap_out.unbind(0))
