from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.layers import cpu_kernels, triton_utils


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.silu_and_mul(x)
        if out is None and x.dim() == 2 and (kernels := triton_utils.kernels_for(x)) is not None:  # CUDA with triton
            out = kernels.silu_and_mul(x)
        if out is not None:
            return out
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
