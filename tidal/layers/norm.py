from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.layers import cpu_kernels, triton_utils


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: returns (norm(x + residual), x + residual), the fused pre-norm pattern."""
        fused = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)  # one pass instead of ~6 ops
        if fused is None and (kernels := triton_utils.kernels_for(x)) is not None:  # CUDA with triton
            fused = kernels.rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:
            return fused
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # fp32 accumulation inside
        return out if residual is None else (out, residual)
