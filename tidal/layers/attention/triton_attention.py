"""Paged attention in Triton: every token of a flattened batch (decodes and prompt chunks alike) attends
over its own prefix, reading K/V in place from the cache blocks through the block table.

    paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, ...) -> [T, Hq, D]

One program takes BLOCK_Q consecutive query tokens of one request and the GROUP query heads that share
one KV head (GQA), as BLOCK_M = BLOCK_Q * GROUP rows of one matrix, so each K/V tile it loads serves
them all (the layout of vLLM's unified Triton attention). Query token i of a request whose batch rows
are [query_start_loc[r], query_start_loc[r + 1]) sits at position seq_lens[r] - query_len + i and sees
keys at positions <= its own: the prefix cached by earlier steps and, causally, the chunk itself (this
step's K/V are in the cache before the kernel runs). A decode is a chunk of one token.

A batch of decodes too small to give every multiprocessor PROGRAMS_PER_SM programs (one request's decode
is one program per KV head) splits each request's keys into NUM_SPLITS shares of whole key tiles, one
program each; _combine_splits_kernel then rescales the shares' partial sums to their common max and adds
them (flash-decoding). The number of shares depends on the batch's shape only, never on its lengths, so
a CUDA graph captured for a batch size serves every context length.

Scores and the running softmax are fp32 (exp2, online max); K/V tiles are widened to q's dtype before
the dot products (fp32 under the interpreter). An FP8 (E4M3) cache is read as bytes, bitcast, widened
(exact: E4M3 fits bf16, fp16 and fp32), and its k_scale folded into the softmax scale, v_scale into the
output.

Runs on CUDA, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before this module
is imported), which is how tests/test_triton_kernels.py checks it against the torch reference.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tidal.forward_context import batch_invariant
from tidal.layers.attention.kv_cache_dtype import FP8, storage
from tidal.layers.triton_utils import triton_interpreting


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """The request that owns query tile `tile`: request r's tiles start at query_start_loc[r] // BLOCK_Q + r
    (an upper bound on the tiles before it, so no tile straddles two requests); binary search."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs"])  # one compiled kernel whatever the batch (Triton treats 1 apart)
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
        part_acc_ptr, part_m_ptr, part_l_ptr,
        qk_scale, v_scale, num_reqs,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h,
        stride_k_b, stride_k_h, stride_k_d, stride_k_s,
        stride_v_b, stride_v_h, stride_v_s, stride_v_d,
        stride_bt, stride_p_t, stride_p_h,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, FP8_CACHE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
    q_tile = tile - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len

        m = tl.arange(0, BLOCK_M)
        q_tok = q_tile * BLOCK_Q + m // GROUP            # [BLOCK_M] token index within the request
        head = kv_head * GROUP + m % GROUP               # [BLOCK_M] query head
        row_ok = (m < BLOCK_Q * GROUP) & (q_tok < q_len)
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + q_tok)[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM_PAD]
        q_pos = context_len + q_tok                      # [BLOCK_M] each row's position
        # the last key any row of this tile sees, + 1
        kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if NUM_SPLITS > 1:  # this program takes its share of the keys, in whole tiles (maybe none)
            share = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), TILE_N) * TILE_N
            kv_lo = split * share
            kv_end = tl.minimum(kv_end, kv_lo + share)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        for kv_start in range(kv_lo, kv_end, TILE_N):
            pos = kv_start + tl.arange(0, TILE_N)        # [TILE_N] key positions
            pos_ok = pos < kv_end
            block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            offset = pos % BLOCK_SIZE
            # K blocks are stored transposed ([D, block_size]): the tile loads as [HEAD_DIM_PAD, TILE_N]
            k = tl.load(k_cache_ptr + block[None, :] * stride_k_b + kv_head * stride_k_h + d[:, None] * stride_k_d
                        + offset[None, :] * stride_k_s, mask=d_ok[:, None] & pos_ok[None, :], other=0)
            v = tl.load(v_cache_ptr + block[:, None] * stride_v_b + kv_head * stride_v_h + offset[:, None] * stride_v_s
                        + d[None, :] * stride_v_d, mask=pos_ok[:, None] & d_ok[None, :], other=0)
            if FP8_CACHE:
                k = k.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            k = k.to(DOT_DTYPE)
            v = v.to(DOT_DTYPE)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2 units
            s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if NUM_SPLITS > 1:  # the share's running max, sum and unscaled output, for _combine_splits_kernel
            part = (q_start + q_tok) * stride_p_t + head * stride_p_h + split
            tl.store(part_m_ptr + part, m_i, mask=row_ok)
            tl.store(part_l_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_ok[:, None])
        else:
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc * (v_scale / l_i)[:, None]
            tl.store(out_ptr + (q_start + q_tok)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits_kernel(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, v_scale, stride_o_t, stride_o_h,
                           stride_p_t, stride_p_h, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One query token and head: its NUM_SPLITS shares' softmax sums and outputs rescaled to their common
    max and added (flash-decoding's combine). A share with no keys has max -inf and weighs nothing."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < NUM_SPLITS
    base = t * stride_p_t + h * stride_p_h
    m = tl.load(part_m_ptr + base + sp, mask=sp_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + sp, mask=sp_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # [SPLITS_PAD]
    d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * HEAD_DIM_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    l_all = tl.sum(w * l_s, 0)
    l_all = tl.where(l_all == 0.0, 1.0, l_all)
    out = tl.sum(acc * w[:, None], 0) * (v_scale / l_all)
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def dot_dtype(dtype: torch.dtype):
    """The dtype of the dot products' operands: q's. (Triton's interpreter multiplies bf16 operands as
    their raw bits, so under it every dot is fp32.)"""
    if triton_interpreting() or dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def tile_rows(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): matrix rows per program and the query tokens they hold. Decode-only batches
    take 16 rows (the smallest a tensor-core dot takes); batches with prompt chunks 64, so one K/V tile
    serves more of a chunk's queries. In batch-invariant mode always 64, so a token's dot products are
    the same instructions whether it decodes alone or sits in a prompt chunk."""
    rows = 16 if max_query_len == 1 and not batch_invariant() else 64  # the mode: one tile size for all
    block_m = max(rows, triton.next_power_of_2(group))
    return block_m, block_m // group


# decode-only batches: split each request's keys over programs until the grid holds this many per
# multiprocessor (one request's decode is otherwise one program per KV head: 8 on an H200's 132)
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter on a CPU: a few splits, so that the tests run the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_splits(programs: int, max_query_len: int, device: torch.device) -> int:
    """How many programs share each decode's keys: 1 for batches with prompt chunks (they have programs
    enough) and in batch-invariant mode (a token's sums must not depend on the batch); otherwise enough
    to give every multiprocessor PROGRAMS_PER_SM programs, at most MAX_SPLITS. A function of the batch's
    shape only, so that a CUDA graph captured for a batch size holds for any context length."""
    if max_query_len != 1 or batch_invariant():
        return 1
    want = -(-PROGRAMS_PER_SM * _multiprocessors(device) // programs)
    return max(1, min(MAX_SPLITS, want))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
                    tile_n: int = 32, num_splits: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] (the batch's tokens, request after request); k_cache [nb, Hk, D, bs] (transposed
    blocks), v_cache [nb, Hk, bs, D] (any float dtype, or FP8 with k_scale / v_scale); block_table
    [num_reqs, >= blocks of the longest] (request r's blocks in order); query_start_loc [num_reqs + 1];
    seq_lens [num_reqs] (tokens in the cache after this step's, per request); max_query_len: the
    longest chunk; num_splits: programs sharing each request's keys (None: num_kv_splits; above 1 only
    for decode-only batches, whose shares' partial softmaxes _combine_splits_kernel then adds up).
    -> out [T, Hq, D] in q's dtype."""
    T, num_heads, head_dim = q.shape
    num_kv_heads, block_size = v_cache.shape[1], v_cache.shape[2]
    group = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    if out is None:  # contiguous whatever q's strides (q may be a slice of the fused qkv output)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    assert q.stride(2) == 1 and out.stride(2) == 1, "the head dimension must be contiguous"
    block_m, block_q = tile_rows(group, max_query_len)
    fp8 = k_cache.dtype == FP8
    k_store, v_store = storage(k_cache), storage(v_cache)
    tiles = T // block_q + num_reqs
    if num_splits is None:
        num_splits = num_kv_splits(tiles * num_kv_heads, max_query_len, q.device)
    elif num_splits > 1 and max_query_len != 1:
        raise ValueError(f"num_splits {num_splits}: keys are split only for decode-only batches (max_query_len 1)")
    head_pad = max(16, triton.next_power_of_2(head_dim))
    v_scale = v_scale if fp8 else 1.0
    if num_splits > 1:
        part_m, part_l = torch.empty(2, T, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(T, num_heads, num_splits, head_pad, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # not read
    _paged_attention_kernel[(tiles, num_kv_heads, num_splits)](
        out, q, k_store, v_store, block_table, query_start_loc, seq_lens, part_acc, part_m, part_l,
        scale * (k_scale if fp8 else 1.0) * math.log2(math.e), v_scale, num_reqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_store.stride(), *v_store.stride(), block_table.stride(0),
        num_heads * num_splits, num_splits,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, FP8_CACHE=fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, DOT_DTYPE=dot_dtype(q.dtype),
        NUM_SPLITS=num_splits)
    if num_splits > 1:
        _combine_splits_kernel[(T, num_heads)](
            out, part_acc, part_m, part_l, v_scale, out.stride(0), out.stride(1), num_heads * num_splits,
            num_splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)))
    return out
