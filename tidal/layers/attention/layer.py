"""Attention: the paged-attention layer a model calls, and the torch building blocks of its backends.
The layer hands q/k/v to the step's backend (tidal/layers/attention/backends.py), which writes this
step's K/V into the layer's KV cache at `slot_mapping`, then attends through block tables.

KV cache per layer: one tensor [2, num_blocks, num_kv_heads, block_size, head_dim] (`kv_cache_shape`),
in the activations' dtype, bf16 under fp32 activations (bf16 weights on a CPU without native bf16), or
FP8 E4M3 with the layer's k_scale / v_scale (kv_cache_dtype "fp8": tidal/layers/attention/kv_cache_dtype.py).
V blocks use it as is; K blocks are stored transposed, [num_blocks, num_kv_heads, head_dim, block_size],
so that the decode kernel computes the scores of a block's tokens as one vector multiply-add chain
without horizontal sums. A bf16 cache on a CPU keeps K's dims in pairs (head_dim even): [num_blocks,
num_kv_heads, head_dim / 2, block_size, 2], dims 2p and 2p + 1 of a token side by side, and V's tokens in
pairs (block_size even): [num_blocks, num_kv_heads, block_size / 2, head_dim, 2], tokens 2k and 2k + 1 of
a dim side by side. Those are the operand layouts of the bf16 pair products (VDPBF16PS, AMX tiles), which
the CPU kernels then read as they are. Their views (`split_kv_cache`) are 5-D: K [num_blocks,
num_kv_heads, head_dim / 2, 2, block_size] and V [num_blocks, num_kv_heads, block_size / 2, 2, head_dim],
indexed as the 4-D blocks with the paired dim split in two (`read_blocks` and `write_slots` take both).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.forward_context import get_forward_context
from tidal.layers import cpu_kernels
from tidal.layers.attention.kv_cache_dtype import paired, read_blocks, write_slots


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        # an FP8 cache holds K / k_scale and V / v_scale: from the checkpoint when it has them
        self.k_scale, self.v_scale = 1.0, 1.0
        self.kv_scales_from_checkpoint = False
        # an FP8 cache's mean key [Hk * D] fp32, taken off every key before it is stored (kv_cache_dtype.py)
        self.k_shift: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq * D], k/v [T, Hk * D] -> [T, Hq * D], through the step's attention backend."""
        ctx = get_forward_context()
        return ctx.attn_backend.forward(self, q, k, v, ctx.attn_metadata)

    def forward_rotary(self, positions: torch.Tensor, qk: torch.Tensor, v: torch.Tensor, rotary) -> torch.Tensor:
        """qk [T, Hq + Hk, D] not yet rotated (q heads, then k heads), v [T, Hk * D] -> [T, Hq * D]. A backend
        that rotates q/k as it writes the cache (`forward_rotary`: the Triton backend) takes them as they are;
        otherwise q and k are rotated in one pass first."""
        ctx = get_forward_context()
        fused = getattr(ctx.attn_backend, "forward_rotary", None)
        if fused is not None and self.k_shift is None:  # (the fused write has no key shift)
            return fused(self, positions, qk, v, rotary, ctx.attn_metadata)
        T = qk.shape[0]
        qk = rotary.rotate(positions, qk).view(T, -1)
        q_size = self.num_heads * self.head_dim
        return ctx.attn_backend.forward(self, qk[:, :q_size], qk[:, q_size:], v, ctx.attn_metadata)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
    return (2, num_blocks, num_kv_heads, block_size, head_dim)


def split_kv_cache(kv_cache: torch.Tensor):
    """-> K [num_blocks, Hk, D, block_size] (transposed blocks), V [num_blocks, Hk, block_size, D]; a bf16 CPU
    cache's K [num_blocks, Hk, D / 2, 2, block_size] where D is even and V [num_blocks, Hk, block_size / 2, 2,
    D] where block_size is even (pairs: module docstring)."""
    _, num_blocks, hk, block_size, d = kv_cache.shape
    if paired(kv_cache, d):
        k = kv_cache[0].view(num_blocks, hk, d // 2, block_size, 2).transpose(3, 4)
    else:
        k = kv_cache[0].view(num_blocks, hk, d, block_size)
    if paired(kv_cache, block_size):
        v = kv_cache[1].view(num_blocks, hk, block_size // 2, d, 2).transpose(3, 4)
    else:
        v = kv_cache[1]
    return k, v


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
             k_shift: torch.Tensor | None = None) -> None:
    """Store this step's k/v [T, Hk, D] at their slots (slot = block * block_size + offset); an FP8 cache
    stores (k - k_shift) / k_scale and v / v_scale."""
    if not cpu_kernels.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_shift):
        write_slots(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale, k_shift)


def gather_kv(k_cache, v_cache, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype,
              k_scale: float = 1.0, v_scale: float = 1.0):
    """A request's first seq_len K/V rows in dtype, [Hk, seq_len, D] each (an FP8 cache's dequantized)."""
    hk, d = v_cache.shape[1], v_cache.shape[-1]
    ks = read_blocks(k_cache, block_ids, dtype, k_scale).permute(1, 0, 3, 2).reshape(hk, -1, d)[:, :seq_len]
    vs = read_blocks(v_cache, block_ids, dtype, v_scale).permute(1, 0, 2, 3).reshape(hk, -1, d)[:, :seq_len]
    return ks, vs


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of q [Lq, Hq, D] over k/v [Hk, ctx_len + Lq, D]; query i sits at position
    ctx_len + i (bottom-right aligned causal mask)."""
    Lq, Lk = q.shape[0], k.shape[1]
    # 4-D inputs take torch's fused CPU flash kernel (3-D ones fall back to a path 2-3x slower)
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # [1, H, L, D]
    gqa = qh.shape[1] != kh.shape[1]
    if ctx_len == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(diagonal=ctx_len)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     max_seq_len: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query token per request: q [B, Hq, D] over each request's cached K/V (torch fallback of
    the native kernel: gathers the blocks, then attends with a padding mask). k_scale / v_scale: of an
    FP8 cache (ignored for others)."""
    B, Hq, D = q.shape
    Hk, block_size = v_cache.shape[1], k_cache.shape[-1]
    nb = -(-max_seq_len // block_size)
    bt = block_tables[:, :nb]
    L = nb * block_size
    ks = read_blocks(k_cache, bt, q.dtype, k_scale).permute(0, 2, 1, 4, 3).reshape(B, Hk, L, D)  # [B, Hk, L, D]
    vs = read_blocks(v_cache, bt, q.dtype, v_scale).permute(0, 2, 1, 3, 4).reshape(B, Hk, L, D)
    mask = torch.arange(L, device=q.device) < seq_lens.unsqueeze(1)  # [B, L]
    qh = q.view(B, Hk, Hq // Hk, D)  # the query heads of each KV group act as query rows
    o = F.scaled_dot_product_attention(qh, ks, vs, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(B, Hq, D)
