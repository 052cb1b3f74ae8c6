"""Whether Triton's kernels can run: triton is an optional dependency (`pip install 'tidal[gpu]'`).

On CUDA with triton installed, attention (tidal/layers/attention/triton_attention.py) and the fused
layer kernels (tidal/layers/triton_kernels.py) run as Triton kernels; without it CUDA takes torch's
paths. On a CPU they run only under Triton's interpreter (TRITON_INTERPRET=1, read by triton when a
kernel module is imported), which is how tests check them without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """TRITON_INTERPRET is set: kernels run on CPU tensors, in numpy (slowly)."""
    return triton_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel runs on t's device: CUDA with triton, or a CPU under the interpreter."""
    if t.device.type == "cuda":
        return triton_available()
    return t.device.type == "cpu" and triton_interpreting()


def kernels_for(x: torch.Tensor):
    """The fused Triton kernels (tidal/layers/triton_kernels.py) for a layer's CUDA tensor, or None: on a
    CPU, or without triton, layers take their other paths."""
    if x.device.type != "cuda" or not triton_available():
        return None
    from tidal.layers import triton_kernels
    return triton_kernels
