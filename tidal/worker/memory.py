"""Sizing the paged KV cache from a memory budget measured after the weights are loaded.

CPU: min(4 GiB, half the memory available). CUDA (as vLLM): gpu_memory_utilization x the GPU's
memory, less what is in use once the weights are loaded (this process's tensors and CUDA context,
and any other process on the GPU) and less the activation peak of a profiling forward as large as
the largest step. `kv_cache_memory_bytes`, when given, overrides both.
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
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


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere): loading a
    checkpoint frees hundreds of MB of conversion buffers that the heap would otherwise keep, counted in
    the process's resident memory (default model, w8a8: 809 MiB before, 474 after)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def cache_budget_bytes(budget_bytes: int | None) -> int:
    """The given budget, or min(4 GiB, half the memory available now, i.e. after loading weights)."""
    if budget_bytes is not None:
        return budget_bytes
    available = psutil.virtual_memory().available
    budget_bytes = min(DEFAULT_KV_CACHE_BYTES, int(available * _AVAILABLE_FRACTION))
    logger.info("KV cache budget %.2f GiB (%.2f GiB of memory available after loading weights)",
                budget_bytes / 2**30, available / 2**30)
    return budget_bytes


def cuda_cache_budget_bytes(device, gpu_memory_utilization: float, profile: Callable[[], None],
                            graph_profile: Callable[[], None] | None = None) -> int:
    """gpu_memory_utilization x the GPU's memory, less the memory in use now, the peak that `profile` (one
    forward as large as the largest step) allocates on top of it and, with CUDA graphs, the peak of
    `graph_profile` (the largest decode graph's forward: its memory pool stays allocated beside the
    eager steps' memory)."""
    import torch
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    allocated = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    activations = max(0, torch.cuda.max_memory_allocated(device) - allocated)
    graphs = 0
    if graph_profile is not None:
        torch.cuda.reset_peak_memory_stats(device)
        graph_profile()
        torch.cuda.synchronize(device)
        graphs = max(0, torch.cuda.max_memory_allocated(device) - allocated)
    torch.cuda.empty_cache()
    allowed = int(total * gpu_memory_utilization)
    budget = allowed - in_use - activations - graphs
    gib = 2**30
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {gpu_memory_utilization} allows {allowed / gib:.2f} GiB of the GPU's "
            f"{total / gib:.2f} GiB, but {in_use / gib:.2f} GiB are in use after loading the weights and the largest "
            f"step needs {activations / gib:.2f} GiB more (the CUDA graphs {graphs / gib:.2f} GiB): no room is left "
            "for the KV cache; raise gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, set "
            "enforce_eager or set kv_cache_memory_bytes")
    logger.info("KV cache budget %.2f GiB on %s: gpu_memory_utilization %.2f x %.2f GiB = %.2f GiB, less %.2f GiB "
                "in use after loading weights, %.2f GiB activation peak of the profiling forward and %.2f GiB for "
                "the CUDA graphs' memory pool", budget / gib, device, gpu_memory_utilization, total / gib,
                allowed / gib, in_use / gib, activations / gib, graphs / gib)
    return budget


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
