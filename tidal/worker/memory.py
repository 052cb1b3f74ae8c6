"""Sizing the paged KV cache from a memory budget measured after the weights are loaded."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 4 * 2**30  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE=4)
_AVAILABLE_FRACTION = 0.5


@dataclass
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


def cache_budget_bytes(budget_bytes: int | None) -> int:
    """The given budget, or min(4 GiB, half the memory available now, i.e. after loading weights)."""
    if budget_bytes is not None:
        return budget_bytes
    available = psutil.virtual_memory().available
    budget_bytes = min(DEFAULT_KV_CACHE_BYTES, int(available * _AVAILABLE_FRACTION))
    logger.info("KV cache budget %.2f GiB (%.2f GiB of memory available after loading weights)",
                budget_bytes / 2**30, available / 2**30)
    return budget_bytes


def plan_state_slots(state_bytes_per_request: int, max_num_seqs: int, budget_bytes: int,
                     has_kv: bool) -> int:
    """Mamba state slots (one per running request) taken from the cache budget: up to max_num_seqs,
    using at most half the budget when attention KV shares it (all of it otherwise)."""
    share = budget_bytes // 2 if has_kv else budget_bytes
    slots = min(max_num_seqs, share // state_bytes_per_request)
    if slots < 1:
        raise ValueError(
            f"kv_cache_memory_bytes {budget_bytes} cannot hold the recurrent state of one request "
            f"({state_bytes_per_request} bytes): raise kv_cache_memory_bytes to at least "
            f"{state_bytes_per_request * (2 if has_kv else 1)}")
    return slots


def plan_kv_cache(bytes_per_token: int, block_size: int, max_model_len: int,
                  budget_bytes: int | None = None, min_blocks: int | None = None) -> KVCachePlan:
    """How many blocks fit: the given budget, or min(4 GiB, half the memory available now — i.e.
    after the weights are loaded). A pool must hold at least one request of max_model_len."""
    if budget_bytes is None:
        budget_bytes = cache_budget_bytes(None)
    if bytes_per_token == 0:  # no attention layers (pure Mamba): a token-sized pool for bookkeeping
        return KVCachePlan(max(1, -(-max_model_len // block_size)) * 64, block_size, 0)
    num_blocks = budget_bytes // (bytes_per_token * block_size)
    need = min_blocks if min_blocks is not None else -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(
            f"kv_cache_memory_bytes {budget_bytes} holds {num_blocks * block_size} tokens "
            f"({bytes_per_token} bytes per token), fewer than one request of max_model_len {max_model_len}: "
            f"raise kv_cache_memory_bytes to at least {need * block_size * bytes_per_token} or lower max_model_len")
    return KVCachePlan(num_blocks, block_size, bytes_per_token)
