"""Native CPU selective scan (tidal/layers/csrc/selective_scan.cpp): plain C++ compiled on first use
with the machine's compiler into ~/.cache/tidal/kernels and called through ctypes, as the attention
kernels are. It keeps each channel's state in registers for the whole chunk instead of writing
exp(dt A) and every state to memory. Without a compiler (or with TIDAL_NATIVE_KERNELS=0) the torch
scan in tidal/layers/mamba.py runs instead."""
from __future__ import annotations

import ctypes
import os

import torch

from tidal.native import NativeLibrary

_MAX_STATE = 256  # the kernel's per-channel state buffer


def _configure(lib: ctypes.CDLL) -> None:
    fn = lib.tidal_selective_scan
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 5


# -ffast-math lets exp vectorise (glibc's vector expf); NativeLibrary gives it to the compile step only.
_LIB = NativeLibrary("selective_scan", os.path.join(os.path.dirname(__file__), "csrc", "selective_scan.cpp"),
                     ["-O3", "-fopenmp", "-ffast-math", "-std=c++17"], ["-fopenmp"], _configure)


def _native_lib() -> ctypes.CDLL | None:
    return _LIB.get()


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
