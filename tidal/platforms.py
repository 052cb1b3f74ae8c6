"""Platform: the device-specific choices, made in one place so generic code has no `if cpu` branches.

    platform = get_platform(device)
    platform.attention_backend()   # how attention reads the paged KV cache on this device
    platform.describe()            # one line for the start-up log

CpuPlatform uses the native kernels when they built for this CPU's ISA level (tidal/native.py), else
torch's paths; CudaPlatform takes the Triton kernels when triton is installed (paged attention; fused
norm, rotary and activation kernels in the layers), else torch's paths (fused SDPA), saying so in the
log. `TIDAL_ATTENTION_BACKEND` (`cpu_native`, `torch_sdpa` or `triton`, as vLLM's
VLLM_ATTENTION_BACKEND) overrides the choice; `triton` runs on a CPU only under Triton's interpreter
(TRITON_INTERPRET=1: slow, for tests). The GEMM path
of each linear layer is chosen by its weight's dtype and device (tidal/layers/linear.py); threads are
set per worker (tidal/worker/executor.py).
"""
from __future__ import annotations

import logging
import os
from functools import cache

import torch

from tidal.layers.attention.backends import AttentionBackend, CPUNativeBackend, TorchSDPABackend, TritonBackend
from tidal.layers.triton_utils import triton_available, triton_interpreting

logger = logging.getLogger(__name__)
BACKENDS = {b.name: b for b in (CPUNativeBackend, TorchSDPABackend, TritonBackend)}


class Platform:
    device_type = "base"
    backends = ("torch_sdpa",)  # the backends that run on this device

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def attention_backend(self) -> AttentionBackend:
        name = os.environ.get("TIDAL_ATTENTION_BACKEND")
        if name:
            if name not in self.backends:
                raise ValueError(f"TIDAL_ATTENTION_BACKEND {name!r} does not run on {self.device_type}: choose one of "
                                 f"{', '.join(self.backends)}")
            return BACKENDS[name]()
        return self.default_attention_backend()

    def default_attention_backend(self) -> AttentionBackend:
        return TorchSDPABackend()

    def describe(self) -> str:
        return f"{self.device_type}: attention {self.attention_backend().name}"


class CpuPlatform(Platform):
    device_type = "cpu"

    @property
    def backends(self) -> tuple[str, ...]:
        return ("cpu_native", "torch_sdpa") + (("triton",) if triton_interpreting() else ())

    def default_attention_backend(self) -> AttentionBackend:
        from tidal.layers import cpu_kernels
        # the native kernel attends every token in place (prompt chunks too): on the offline workload
        # 1.04-1.11x the throughput of torch's SDPA for chunks
        return CPUNativeBackend() if cpu_kernels.native_lib() is not None else TorchSDPABackend()

    def describe(self) -> str:
        from tidal.layers import cpu_kernels
        return cpu_kernels.describe()


class CudaPlatform(Platform):
    device_type = "cuda"
    backends = ("triton", "torch_sdpa")

    def default_attention_backend(self) -> AttentionBackend:
        if triton_available():
            return TritonBackend()
        _log_no_triton()
        return TorchSDPABackend()


@cache
def _log_no_triton() -> None:  # once per process, however many runners ask
    logger.info("triton is not installed: attention, norms, rotary and activations on CUDA take torch's paths "
                "(pip install 'tidal[gpu]' for the Triton kernels)")


class MetaPlatform(Platform):
    """Shapes only (a model on the meta device, for sizing estimates): nothing runs."""
    device_type = "meta"


def get_platform(device: torch.device | str) -> Platform:
    device = torch.device(device)
    cls = {"cpu": CpuPlatform, "cuda": CudaPlatform, "meta": MetaPlatform}.get(device.type)
    if cls is None:
        raise ValueError(f"device {device} is not supported: Tidal runs on cpu or cuda")
    return cls(device)
