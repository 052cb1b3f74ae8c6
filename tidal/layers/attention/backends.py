"""Attention backends: one interface, one class per way of attending over the paged KV cache.

    backend.build(step, device)                 -> its metadata for one step (once per step, not per layer)
    backend.forward(layer, q, k, v, metadata)   -> [T, Hq * D], after writing this step's K/V to the cache

    CPUNativeBackend   every token of the batch - decodes and prompt chunks alike - is a query over its own
                       prefix, read in place from the blocks by the native kernel (tidal/layers/cpu_kernels.py)
                       through the worker's persistent block table and a row index per token: no gather,
                       no mask, no loop over requests
    TorchSDPABackend   wherever torch runs (CUDA without triton): decodes gather their blocks and attend with a
                       padding mask; each prompt chunk takes torch's fused scaled-dot-product attention
    TritonBackend      CUDA with triton installed: one Triton kernel attends the whole flattened batch in place
                       through the block table (tidal/layers/attention/triton_attention.py); on a CPU only
                       under Triton's interpreter (TRITON_INTERPRET=1), which is how it is tested without a GPU

The platform (tidal/platforms.py) picks one for the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.device import to_device
from tidal.layers import cpu_kernels
from tidal.layers.attention.layer import (
    decode_attention,
    gather_kv,
    prefill_attention,
    split_kv_cache,
    write_kv,
)


class AttentionBackend:
    name = "base"

    def build(self, step, device: torch.device):
        """Metadata for one step from the worker's StepInputs (tidal/worker/input_batch.py)."""
        raise NotImplementedError

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class PagedMetadata:
    slot_mapping: torch.Tensor   # [T] int64: where each token's K/V goes
    block_table: torch.Tensor    # [max_num_seqs, max_blocks] int64: the worker's persistent table
    token_rows: torch.Tensor     # [T] int64: each token's row in block_table
    seq_lens: torch.Tensor       # [T] int64: each token attends to its first position + 1 cached tokens
    max_seq_len: int


class CPUNativeBackend(AttentionBackend):
    name = "cpu_native"

    def build(self, step, device: torch.device) -> PagedMetadata:
        return PagedMetadata(step.slot_mapping, step.block_table, step.token_rows, step.token_seq_lens,
                             step.max_seq_len)

    def forward(self, layer, q, k, v, meta: PagedMetadata) -> torch.Tensor:
        T = q.shape[0]
        q = q.view(T, layer.num_heads, layer.head_dim)
        k_cache, v_cache = split_kv_cache(layer.kv_cache)
        write_kv(k_cache, v_cache, k.view(T, layer.num_kv_heads, layer.head_dim),
                 v.view(T, layer.num_kv_heads, layer.head_dim), meta.slot_mapping, layer.k_scale, layer.v_scale,
                 layer.k_shift)
        out = cpu_kernels.paged_attention_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, layer.scale,
                                                 meta.token_rows, layer.k_scale, layer.v_scale)
        if out is None:  # a dtype the kernel does not take: the torch decode path, one query per token
            out = decode_attention(q, k_cache, v_cache, meta.block_table[meta.token_rows], meta.seq_lens,
                                   meta.max_seq_len, layer.scale, layer.k_scale, layer.v_scale)
        return out.view(T, -1)


@dataclass
class PrefillChunk:
    """A prompt chunk of the batch: its queries are rows [query_start, query_start + query_len)."""
    query_start: int
    query_len: int
    context_len: int             # tokens before the chunk, read from the cache
    block_ids: torch.Tensor      # [ceil((context_len + query_len) / block_size)] int64, on the device


@dataclass
class TorchMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_tables: torch.Tensor | None      # [num_decodes, max_blocks] int64 (padded)
    decode_seq_lens: torch.Tensor | None    # [num_decodes] int64
    decode_max_seq_len: int
    prefills: list[PrefillChunk]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build(self, step, device: torch.device) -> TorchMetadata:
        bs, nd = step.block_size, step.num_decodes
        # the whole table on the device once; each chunk takes a view of its row
        table = to_device(step.block_table[torch.from_numpy(step.rows)], device)
        qsl, seq_lens = step.query_start_loc, step.seq_lens
        prefills = [PrefillChunk(int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(seq_lens[i] - (qsl[i + 1] - qsl[i])),
                                 table[i, :-(-int(seq_lens[i]) // bs)]) for i in range(nd, len(step.reqs))]
        return TorchMetadata(
            slot_mapping=to_device(step.slot_mapping, device), num_decodes=nd,
            decode_tables=table[:nd] if nd else None,
            decode_seq_lens=to_device(torch.from_numpy(seq_lens[:nd]), device) if nd else None,
            decode_max_seq_len=int(seq_lens[:nd].max()) if nd else 0, prefills=prefills)

    def forward(self, layer, q, k, v, meta: TorchMetadata) -> torch.Tensor:
        T = q.shape[0]
        q = q.view(T, layer.num_heads, layer.head_dim)
        k = k.view(T, layer.num_kv_heads, layer.head_dim)
        v = v.view(T, layer.num_kv_heads, layer.head_dim)
        k_cache, v_cache = split_kv_cache(layer.kv_cache)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, layer.k_scale, layer.v_scale,
                 layer.k_shift)
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            out[:n] = decode_attention(q[:n], k_cache, v_cache, meta.decode_tables, meta.decode_seq_lens,
                                       meta.decode_max_seq_len, layer.scale, layer.k_scale, layer.v_scale)
        for chunk in meta.prefills:
            q_start, q_len, ctx_len = chunk.query_start, chunk.query_len, chunk.context_len
            qs = q[q_start:q_start + q_len]
            if ctx_len == 0:  # the whole sequence is in this batch: attends over its K/V as computed, not as cached
                ks = k[q_start:q_start + q_len].transpose(0, 1)
                vs = v[q_start:q_start + q_len].transpose(0, 1)
            else:  # (a bf16 cache under fp32 activations, or an FP8 cache: widened to q's dtype)
                ks, vs = gather_kv(k_cache, v_cache, chunk.block_ids, ctx_len + q_len, q.dtype, layer.k_scale,
                                   layer.v_scale)
            out[q_start:q_start + q_len] = prefill_attention(qs, ks, vs, ctx_len, layer.scale)
        return out.view(T, -1)


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor     # [T] int64
    block_table: torch.Tensor      # [num_reqs, blocks of the longest request] int64, rows in batch order
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor         # [num_reqs] int64: tokens in the cache after this step's
    max_query_len: int


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        # import triton only when this backend is chosen
        from tidal.layers import triton_kernels
        from tidal.layers.attention import triton_attention
        self._attention, self._kernels = triton_attention.paged_attention, triton_kernels

    def build(self, step, device: torch.device) -> TritonMetadata:
        qsl = torch.from_numpy(step.query_start_loc)
        num_blocks = -(-step.max_seq_len // step.block_size)
        table = step.block_table[torch.from_numpy(step.rows), :num_blocks]
        return TritonMetadata(slot_mapping=to_device(step.slot_mapping, device), block_table=to_device(table, device),
                              query_start_loc=to_device(qsl, device),
                              seq_lens=to_device(torch.from_numpy(step.seq_lens), device),
                              max_query_len=int((qsl[1:] - qsl[:-1]).max()))

    def forward(self, layer, q, k, v, meta: TritonMetadata) -> torch.Tensor:
        T = q.shape[0]
        k_cache, v_cache = split_kv_cache(layer.kv_cache)
        write_kv(k_cache, v_cache, k.view(T, layer.num_kv_heads, layer.head_dim),
                 v.view(T, layer.num_kv_heads, layer.head_dim), meta.slot_mapping, layer.k_scale, layer.v_scale,
                 layer.k_shift)
        return self._attend(layer, q.view(T, layer.num_heads, layer.head_dim), k_cache, v_cache, meta)

    def forward_rotary(self, layer, positions, qk, v, rotary, meta: TritonMetadata) -> torch.Tensor:
        """q/k not yet rotated: one kernel rotates q, and rotates k and writes it with v into the cache."""
        T = qk.shape[0]
        k_cache, v_cache = split_kv_cache(layer.kv_cache)
        q = self._kernels.rotary_write_kv(positions, qk, v.view(T, layer.num_kv_heads, layer.head_dim),
                                          layer.num_heads, rotary.cos_full, rotary.sin_signed, k_cache, v_cache,
                                          meta.slot_mapping, layer.k_scale, layer.v_scale)
        if q is None:  # a layout the kernel does not take
            qk = rotary.rotate(positions, qk).view(T, -1)
            q_size = layer.num_heads * layer.head_dim
            return self.forward(layer, qk[:, :q_size], qk[:, q_size:], v, meta)
        return self._attend(layer, q, k_cache, v_cache, meta)

    def _attend(self, layer, q, k_cache, v_cache, meta: TritonMetadata) -> torch.Tensor:
        out = self._attention(q, k_cache, v_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
                              layer.scale, meta.max_query_len, layer.k_scale, layer.v_scale)
        return out.view(q.shape[0], -1)
