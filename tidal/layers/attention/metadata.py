"""AttentionMetadata: how one step's flat token batch maps onto requests and KV-cache slots.

The model runner orders each batch decodes first (one query token each), then chunks that continue a
cached context, then chunks that start at position 0. Token i of the batch writes its K/V at flat slot
slot_mapping[i] = block_id * block_size + offset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor          # [num_tokens] int64
    block_size: int
    # decodes: the first num_decodes tokens, one per request
    num_decodes: int
    # Tokens attended one by one through the paged kernel: the first num_paged_tokens of the batch
    # (with the native kernel, every token: each is a query over its own prefix, read in place from the
    # blocks; without it, the decodes).
    num_paged_tokens: int
    paged_block_tables: torch.Tensor | None  # [num_requests, max_blocks] int64 (padded), batch order
    paged_table_index: torch.Tensor | None   # [num_paged_tokens] int64: each token's row in paged_block_tables
    paged_seq_lens: torch.Tensor | None      # [num_paged_tokens] int64: position + 1
    paged_max_seq_len: int
    # the remaining chunks: (query_start, query_len, context_len, block_ids [n] int64)
    prefills: list[tuple[int, int, int, torch.Tensor]]
    # per request in batch order (decodes then prefills): query start offsets [num_reqs + 1]
    query_start_loc: list[int]
    # state slots per request in batch order (models with Mamba layers); -1 for none
    state_slots: torch.Tensor | None = None
    # per request: does this chunk start at position 0 (fresh recurrent state)?
    has_initial_state: torch.Tensor | None = None
    # does any decode start at position 0 (a one-token prompt)? Known on the host, so layers need not
    # read has_initial_state back from the device; None: read it
    fresh_decodes: bool | None = None
    # Mamba state checkpoints to write: (request index in batch, after how many of its tokens, state index)
    state_checkpoints: list[tuple[int, int, int]] | None = None
