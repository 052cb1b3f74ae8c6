"""Products with quantized weights on the CPU. The wrappers return None where no native kernel runs,
and callers then use the torch expressions (quantization.methods); so far every product takes them."""
from __future__ import annotations

import torch


def int8_linear(x, wq, w_scale, bias=None):
    return None


def fp8_linear(x, wq, w_scale, bias=None):
    return None


def w8a8_linear(x, wq, w_scale, bias=None, w_row_sums=None):
    return None


def quantize_rows_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric int8: (xq, scale) with scale = max|row| / 127 (1 for a row of zeros)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8), scale
