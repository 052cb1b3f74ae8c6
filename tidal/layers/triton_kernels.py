"""Fused Triton kernels for the steps of a layer that torch runs as several passes over memory:

    rms_norm(x, weight, eps, residual)      -> norm(x + residual), x + residual   (one read of each, fp32 sums)
    silu_and_mul(x)                         -> silu(gate) * up                    (one read, one write)
    rotary_write_kv(positions, qk, v, ...)  -> q rotated; k rotated and v written into their cache slots
                                               (an FP8 cache quantized on the way), one pass
    invariant_linear(x, weight, bias)       -> x @ weight^T (+ bias) in tiles of one fixed size, each output's
                                               K sum in one order whatever the number of rows
                                               (batch-invariant mode on CUDA)

The layers call them on CUDA tensors when triton is installed (`kernels_for` in triton_utils.py); the
Triton attention backend also rotates and writes K/V with rotary_write_kv. Tests run them on CPU tensors
under TRITON_INTERPRET=1 (tests/test_triton_kernels.py). This module imports triton: import it only
through triton_utils, or where triton is known to be installed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.layers.attention.kv_cache_dtype import FP8, storage
from tidal.layers.triton_utils import triton_interpreting


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, N, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    xf = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the sum is rounded to the activations' dtype (it is the next residual), then normalised as stored
        x = (xf + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, D, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

@triton.jit
def _to_e4m3_bytes(x, EMULATE: tl.constexpr):
    """fp32 -> E4M3 bytes as kv_cache_dtype.quantize makes them: saturated to +-448, rounded to nearest even.
    The GPU converts in hardware; Triton's interpreter rounds half up (and loses the carry into the
    exponent), so under it x is first rounded in fp32 to a value E4M3 holds exactly."""
    x = tl.clamp(x, -448.0, 448.0)
    if EMULATE:
        exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        # the spacing of E4M3 values around x: 3 mantissa bits; subnormals below 2^-6
        quantum = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        y = tl.abs(x) / quantum
        magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds 0 <= y < 2^22 to an integer, ties to even
        rounded = ((y + magic) - magic) * quantum
        x = tl.where(x < 0, -rounded, rounded)  # (-0.0 for a small negative x, as torch makes it)
    return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _rotary_write_kv_kernel(qk_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, q_out_ptr,
                            k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
                            stride_qk_t, stride_qk_h, stride_v_t, stride_v_h, stride_qo_t, stride_qo_h,
                            stride_table,
                            stride_k_b, stride_k_h, stride_k_d, stride_k_s,
                            stride_v_b, stride_v_h2, stride_v_s, stride_v_d,
                            NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                            KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, FP8_CACHE: tl.constexpr, EMULATE_FP8_ROUNDING: tl.constexpr):
    # one program per token, over all its heads ([heads, head_dim] tiles): q and k rows rotated together
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    in_dim = d < HEAD_DIM
    ok = (h < NUM_Q_HEADS + NUM_KV_HEADS) & in_dim
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(positions_ptr + t)
    # NeoX layout: out = x * cos_full + swap_halves(x) * sin_signed (tables [max_position, HEAD_DIM], fp32)
    row = qk_ptr + t * stride_qk_t + h * stride_qk_h
    x = tl.load(row + d, mask=ok, other=0.0)
    swapped = tl.load(row + (d + half) % HEAD_DIM, mask=ok, other=0.0)
    cos = tl.load(cos_ptr + pos * stride_table + d, mask=in_dim, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + d, mask=in_dim, other=0.0)
    rotated = x.to(tl.float32) * cos + swapped.to(tl.float32) * sin
    is_q = h < NUM_Q_HEADS
    tl.store(q_out_ptr + t * stride_qo_t + h * stride_qo_h + d, rotated.to(q_out_ptr.dtype.element_ty),
             mask=ok & is_q)
    slot = tl.load(slot_mapping_ptr + t)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # the value the cache holds is the rotated k rounded to the activations' dtype, as torch's path stores it
    k = rotated.to(qk_ptr.dtype.element_ty)
    if FP8_CACHE:
        k = _to_e4m3_bytes(k.to(tl.float32) / k_scale, EMULATE_FP8_ROUNDING)
    kv_head = tl.where(is_q, 0, h - NUM_Q_HEADS)  # (q rows: masked off)
    tl.store(k_cache_ptr + block * stride_k_b + kv_head * stride_k_h + d * stride_k_d + offset * stride_k_s,
             k.to(k_cache_ptr.dtype.element_ty), mask=ok & (h >= NUM_Q_HEADS))
    hv = tl.arange(0, KV_HEADS_PAD)[:, None]
    ok_v = (hv < NUM_KV_HEADS) & in_dim
    v = tl.load(v_ptr + t * stride_v_t + hv * stride_v_h + d, mask=ok_v, other=0.0)
    if FP8_CACHE:
        v = _to_e4m3_bytes(v.to(tl.float32) / v_scale, EMULATE_FP8_ROUNDING)
    tl.store(v_cache_ptr + block * stride_v_b + hv * stride_v_h2 + offset * stride_v_s + d * stride_v_d,
             v.to(v_cache_ptr.dtype.element_ty), mask=ok_v)


# Batch-invariant mode's tiles: one size whatever the shape (no split-K, no autotuning), so every output
# is computed by the same instructions, in the same K order, whether its row is alone or one of 512.
LINEAR_BLOCK_M, LINEAR_BLOCK_N, LINEAR_BLOCK_K = 64, 64, 32


@triton.jit
def _invariant_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                             HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in chunks, in order from zero
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K),
                    other=0.0).to(DOT_DTYPE)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) in x's dtype with fp32 sums, in tiles of one fixed size: on a
    GPU a row's result does not depend on the number of rows or on its place among them (batch-invariant
    mode; cuBLAS picks its kernel, hence its order, by shape). fp32 products in IEEE fp32 (no TF32).
    (Under the interpreter the tile products are numpy's, whose order may depend on a row's place.)"""
    from tidal.layers.attention.triton_attention import dot_dtype
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x2.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(M, LINEAR_BLOCK_M), triton.cdiv(N, LINEAR_BLOCK_N))
        _invariant_linear_kernel[grid](
            x2, weight, bias if bias is not None else x2, out, M, N, K, x2.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
            DOT_DTYPE=dot_dtype(x.dtype), BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=LINEAR_BLOCK_N, BLOCK_K=LINEAR_BLOCK_K)
    return out.view(*shape[:-1], N)


def _rows(x: torch.Tensor) -> bool:
    """A 2-D tensor whose rows may be strided but whose last dimension is contiguous."""
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, H] (+ residual [T, H]) -> norm(x) or (norm(x + residual), x + residual); None where it does
    not apply (rows not contiguous)."""
    if not _rows(x) or (residual is not None and not _rows(residual)):
        return None
    T, N = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    block = triton.next_power_of_2(N)
    if T:
        _rms_norm_kernel[(T,)](x, residual if residual is not None else x, weight, out, residual_out, N, eps,
                               x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
                               residual_out.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=min(8, max(1, block // 512)))
    return out if residual is None else (out, residual_out)


def silu_and_mul(x: torch.Tensor):
    """x [T, 2 * d] -> [T, d]: silu(gate) * up, computed in fp32; None where it does not apply (rows not contiguous)."""
    if not _rows(x):
        return None
    T, D = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(D))
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(D, block))](x, out, D, x.stride(0), out.stride(0), BLOCK=block)
    return out


def rotary_write_kv(positions: torch.Tensor, qk: torch.Tensor, v: torch.Tensor, num_q_heads: int,
                    cos_full: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0):
    """positions [T]; qk [T, Hq + Hk, D] (q heads, then k heads, not yet rotated); v [T, Hk, D];
    cos_full / sin_signed [max_position, D] fp32 (RotaryEmbedding's tables); k_cache [nb, Hk, D, bs],
    v_cache [nb, Hk, bs, D] (an FP8 cache gets k / k_scale, v / v_scale). Rotates q into a new
    [T, Hq, D] tensor (returned) and k into its cache slots, and writes v; None where it does not apply
    (heads not contiguous)."""
    if (qk.stride(2) != 1 or v.stride(2) != 1 or cos_full.dtype != torch.float32
            or cos_full.shape[1] != qk.shape[2]):  # (a rotary over part of each head: not this kernel)
        return None
    T, H, D = qk.shape
    q_out = torch.empty(T, num_q_heads, D, dtype=qk.dtype, device=qk.device)
    fp8 = k_cache.dtype == FP8
    k_store, v_store = storage(k_cache), storage(v_cache)
    if T:
        _rotary_write_kv_kernel[(T,)](
            qk, v, positions, cos_full, sin_signed, q_out, k_store, v_store, slot_mapping,
            k_scale, v_scale, qk.stride(0), qk.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), cos_full.stride(0), *k_store.stride(), *v_store.stride(),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=H - num_q_heads, HEADS_PAD=triton.next_power_of_2(H),
            KV_HEADS_PAD=triton.next_power_of_2(H - num_q_heads), HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D),
            BLOCK_SIZE=v_cache.shape[2], FP8_CACHE=fp8, EMULATE_FP8_ROUNDING=triton_interpreting())
    return q_out
