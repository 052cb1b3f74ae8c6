"""Rotary position embedding (GPT-NeoX / HF Llama layout: rotate the two halves of each head),
with Llama-3 and linear frequency scaling, and per-frequency divisors (llama.cpp's `rope_freqs` tensor)."""
from __future__ import annotations

import math

import torch
from torch import nn

from tidal.layers import cpu_kernels


def _inv_freq(rot_dim: int, base: float, scaling: dict | None,
              freq_factors: tuple[float, ...] | None = None) -> torch.Tensor:
    inv_freq = _scaled_inv_freq(rot_dim, base, scaling)
    if freq_factors is not None:  # llama.cpp's rope_freqs: each frequency divided by its factor
        if len(freq_factors) != rot_dim // 2:
            raise ValueError(f"{len(freq_factors)} RoPE frequency factors for a rotary dimension of {rot_dim} "
                             f"(want {rot_dim // 2})")
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    return inv_freq


def _scaled_inv_freq(rot_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables. `rotate` applies them to q and k in one pass; the lookup for a
    positions tensor is memoised, so the layers of one forward (which share their RotaryEmbedding
    through `get_rope`) index the tables once."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None,
                 dtype=torch.float32, device: torch.device | str = "cpu",
                 freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        # computed on the host whatever the device, so that every device rotates by the same angles
        with torch.device("cpu"):
            inv_freq = _inv_freq(head_dim, base, scaling, freq_factors)
            t = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
            cos, sin = freqs.cos(), freqs.sin()
        # out = x * cos_full + swap_halves(x) * sin_signed, where swap_halves(x) = (x2, x1)
        self.cos_full = torch.cat((cos, cos), -1).to(device)   # [max_position, head_dim]
        self.sin_signed = torch.cat((-sin, sin), -1).to(device)
        self._memo: tuple | None = None

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == dtype:
            return memo[2], memo[3]
        cos = self.cos_full[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self.sin_signed[positions].unsqueeze(1).to(dtype)
        self._memo = (positions, dtype, cos, sin)
        return cos, sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T]; x [T, H, D] (q and k heads side by side) -> rotated copy."""
        out = cpu_kernels.rope_neox(x, self.cos_full, self.sin_signed, positions)
        if out is not None:
            return out
        cos, sin = self._lookup(positions, x.dtype)
        h = self.head_dim // 2
        swapped = torch.cat((x[..., h:], x[..., :h]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, Hq, D]; k [T, Hk, D] -> rotated (q, k)."""
        return self.rotate(positions, q), self.rotate(positions, k)


_ROPE_CACHE: dict = {}


def get_rope(head_dim: int, max_position: int, base: float, scaling: dict | None = None,
             freq_factors=None) -> RotaryEmbedding:
    """One RotaryEmbedding per distinct configuration and device, shared by all layers that use it.
    Its tables live on the default device (the loader builds models under `with torch.device(...)`).
    freq_factors: head_dim / 2 divisors of the frequencies (a GGUF file's `rope_freqs`), or None."""
    device = torch.get_default_device()
    factors = tuple(float(f) for f in freq_factors) if freq_factors is not None else None
    key = (head_dim, max_position, float(base), repr(sorted((scaling or {}).items())), factors, str(device))
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = _ROPE_CACHE[key] = RotaryEmbedding(head_dim, max_position, base, scaling, device=device,
                                                  freq_factors=factors)
    return rope
