"""The KV cache's dtype (`kv_cache_dtype`, vLLM's names) and the FP8 cache's arithmetic.

    "auto"              the activations' dtype, or bf16 under fp32 activations with bf16 weights
    "fp8", "fp8_e4m3"   torch.float8_e4m3fn, one byte per value, with one scale per layer for K and one for V:
                            stored = e4m3(clamp(x / scale, -448, 448))   (round to nearest even)
                            read   = stored * scale
                        The scales come from the checkpoint when it has them (`load_kv_scale`), else 1.0.

The torch ops here are the TorchSDPABackend's path (any device); the native CPU kernels
(tidal/layers/csrc/cpu_kernels.cpp) write the same bytes, bit for bit, and read them widening in registers.
Only attention KV is FP8: the Mamba state of hybrid models keeps its dtype.
"""
from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Refuse a kv_cache_dtype Tidal does not implement, naming the field and the values it takes."""
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return
    allowed = ", ".join(repr(d) for d in KV_CACHE_DTYPES)
    if kv_cache_dtype == "fp8_e5m2":
        raise ValueError(f"kv_cache_dtype 'fp8_e5m2' is not supported: the FP8 KV cache is E4M3 (more precision, "
                         f"enough range with per-layer scales); kv_cache_dtype must be one of {allowed}")
    raise ValueError(f"kv_cache_dtype must be one of {allowed}; got {kv_cache_dtype!r}")


def kv_cache_torch_dtype(kv_cache_dtype: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype. "auto": the weights' dtype (the activations' dtype, or bf16 under fp32
    activations with bf16 weights: half the memory per token, rounded as the model's weights are)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return weight_dtype if kv_cache_dtype == "auto" else FP8


def describe_kv_cache_dtype(dtype: torch.dtype) -> str:
    return "fp8_e4m3" if dtype == FP8 else str(dtype).removeprefix("torch.")


def paired(cache: torch.Tensor, n: int) -> bool:
    """Whether the cache keeps its values in pairs along a dimension of size n (head_dim for K, block_size
    for V: attention/layer.py): a bf16 cache on a CPU, n even. The CPU kernels read such a cache so."""
    return cache.dtype == torch.bfloat16 and cache.device.type == "cpu" and n % 2 == 0


def storage(cache: torch.Tensor) -> torch.Tensor:
    """The cache as it is indexed: an FP8 cache as its bytes (gathers and scatters of uint8 run on every
    device and torch version; those of float8 not everywhere)."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> E4M3: divided by scale in fp32, saturated to +-448, rounded to nearest even.
    (torch 2.13's conversion saturates by itself; the clamp keeps older versions, whose conversion
    overflows to NaN, the same. NaN stays NaN.)"""
    x = x.float()
    if scale != 1.0:
        x = x.div(scale)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def read_blocks(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """cache[index] in dtype; an FP8 cache's values times its scale. Blocks in pairs (a 5-D view,
    layer.split_kv_cache) come back as 4-D ones: K [..., Hk, D, block_size], V [..., Hk, block_size, D]."""
    if cache.dim() == 5:
        return cache[index].flatten(-3, -2).to(dtype)
    if cache.dtype != FP8:
        return cache[index].to(dtype)
    out = storage(cache)[index].view(FP8).to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale: float, v_scale: float,
                k_shift: torch.Tensor | None = None) -> None:
    """k/v [T, Hk, D] into their slots of k_cache [nb, Hk, D, bs] (blocks transposed, or [nb, Hk, D / 2, 2,
    bs]: pairs of dims) and v_cache [nb, Hk, bs, D] (or [nb, Hk, bs / 2, 2, D]: pairs of tokens);
    quantized first for an FP8 cache (K less k_shift [Hk * D] first, where given)."""
    block_size = k_cache.shape[-1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if k_cache.dtype == FP8:
        if k_shift is not None:
            k = k.float() - k_shift.view(k.shape[1], k.shape[2])
        k, v = storage(quantize(k, k_scale)), storage(quantize(v, v_scale))
    else:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    storage(k_cache)[blocks, ..., offsets] = k.reshape(k.shape[0], *k_cache.shape[1:-1])
    if v_cache.dim() == 5:
        v_cache[blocks, :, offsets // 2, offsets % 2] = v
    else:
        storage(v_cache)[blocks, :, offsets, :] = v


# -- per-layer scales from the checkpoint ---------------------------------------------------------------
# vLLM / Hugging Face names of a layer's KV-cache scales (scalars): `<layer>.self_attn.k_scale`, the older
# `<layer>.self_attn.k_proj.k_scale` / `v_proj.v_scale`, and `qkv_proj.k_scale`; Tidal keeps them on the
# Attention module `<layer>.self_attn.attn`. Query and probability scales (FP8 attention arithmetic, which
# Tidal does not do) are read and dropped.
_KV_SCALE = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?:[kv]_proj\.|qkv_proj\.|attn\.)?(?P<which>[kv])_scale$")
_UNUSED_SCALE = re.compile(r"^.*\.self_attn\.(?:q_proj\.|qkv_proj\.|attn\.)?(?:q|prob)_scale$")


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether `name` is a KV-cache scale of the checkpoint (then stored as the layer's k_scale / v_scale,
    used when the cache is FP8) or another attention scale Tidal has no use for. Checkpoints without them
    load as before: nothing asks for these names."""
    if _UNUSED_SCALE.match(name):
        return True
    m = _KV_SCALE.match(name)
    if m is None:
        return False
    try:
        attn = model.get_submodule(f"{m['prefix']}.attn")
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}") from None
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be one number per layer, "
                         f"got shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be positive and finite, got {value}")
    setattr(attn, f"{m['which']}_scale", value)
    attn.kv_scales_from_checkpoint = True
    return True
