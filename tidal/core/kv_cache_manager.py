"""KVCacheManager: each request's block table, prefix-cache lookup, allocation and freeing.

A request owns an ordered list of blocks; token t lives in block t // block_size at offset
t % block_size. A request takes a new block only when its last one is full.

Prefix caching: the identity of a full block is a hash chained from its parent block's hash,
its own token ids and any extra key that changes its KV (the request's cache salt). We use
SHA-256: a collision would silently serve one prompt's KV for another, so a cryptographic hash
(no practical collisions, not steerable by an adversary choosing prompts) is worth its cost,
which is small next to a block's forward pass.
"""
from __future__ import annotations

import hashlib
from array import array

from tidal.core.block_pool import BlockPool, KVCacheBlock
from tidal.request import Request

# At most this many blocks are kept after a request's last one at its admission, for it to grow into: decode
# attention reads a request's blocks from memory on every step, and blocks side by side come ~20% faster than
# blocks strewn across the cache (docs/cpu.md)
RESERVE_BLOCKS = 64


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_key: str | None = None) -> bytes:
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\x01salt:" + extra_key.encode())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}
        # past the last block kept for the request to grow into, and the way its blocks run (+1 or -1)
        self.req_reserve: dict[str, tuple[int, int]] = {}
        # prefix-cache statistics, in tokens, counted at each admission of a request that reads the
        # cache (as vLLM's prefix_cache_queries / prefix_cache_hits)
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- hashing ---------------------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the request's first num_tokens // block_size full blocks (memoised)."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], request.cache_salt))
        return hashes

    def block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """The hashes of the request's first num_tokens // block_size blocks (what the prefix cache
        keys them by), whether or not they are allocated yet."""
        return self._block_hashes(request, num_tokens)[:num_tokens // self.block_size]

    # -- lookup / allocation ---------------------------------------------------------------------
    def reads_prefix_cache(self, request: Request) -> bool:
        """Requests asking for prompt logprobs compute every prompt token (a cached block has KV
        but no logits), so they never read the cache; they still fill it for others."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens, and how many
        tokens they hold. The last token is always recomputed (its logits are needed), so hits
        stop at the last full block before it and at least one token is computed. Takes no
        references: pass the blocks to allocate_slots in the same scheduling pass."""
        if not self.reads_prefix_cache(request):
            return [], 0
        # (the memo may hold more hashes than that: a block filled by computed tokens that a preemption
        # then freed before a new token was appended)
        usable = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, request.num_tokens - 1)[:usable]
        hits = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: list[KVCacheBlock] = ()) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size \
            + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - have)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = (),
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Give the request room for num_new_tokens more tokens (after any prefix-cache hits), and for
        num_lookahead_tokens past them (draft tokens, whose KV is computed before they are accepted).
        Only blocks full of known tokens enter the prefix cache, never one holding a draft's KV.
        Returns the new blocks, or None (and changes nothing) if the pool cannot supply them."""
        num_new_blocks = self.num_blocks_needed(request, num_new_tokens + num_lookahead_tokens, new_computed_blocks)
        # Reviving an unreferenced cached block takes it out of the free queue too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None
        admitting = request.request_id not in self.req_to_blocks  # first, or again after preemption
        if admitting and self.reads_prefix_cache(request):
            # count the lookup once here, not in get_computed_blocks, which a request blocked on memory
            # repeats every step
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(new_computed_blocks) * self.block_size
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(list(new_computed_blocks))
            blocks.extend(new_computed_blocks)
            self.req_num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks, blocks[-1].block_id if blocks else None)
        blocks.extend(new_blocks)
        if admitting and blocks:
            self._reserve_growth(request, blocks)
        if self.enable_caching:
            # Blocks that will be full once this step's tokens are computed become shareable now:
            # the attention backend writes all of a step's K/V before any of it is read.
            num_full = min(request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                           + num_new_tokens, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, blocks, num_full)
        return new_blocks

    def _reserve_growth(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Keep the blocks an admitted request will grow into after its last one (BlockPool.reserve_after),
        in the way its run of blocks goes, and remember where they end (free_tail puts them back)."""
        max_tokens = request.sampling_params.max_tokens
        expected = request.num_prompt_tokens + (
            max_tokens if max_tokens is not None else RESERVE_BLOCKS * self.block_size)
        grow = min(RESERVE_BLOCKS, -(-expected // self.block_size) - len(blocks))
        if grow <= 0:
            return
        last = blocks[-1].block_id
        step = -1 if len(blocks) > 1 and blocks[-2].block_id == last + 1 else 1
        self.pool.reserve_after(last, grow, step)
        self.req_reserve[request.request_id] = (last + step * (grow + 1), step)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full: int) -> None:
        done = self.req_num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(request, num_full * self.block_size)
        for i in range(done, num_full):
            self.pool.cache_full_block(blocks[i], hashes[i])
        self.req_num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Return a finished, aborted or preempted request's blocks, last block first, so the tail
        of a sequence is evicted before the prefix it shares with others."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.req_num_cached_blocks.pop(request.request_id, None)
        self.req_reserve.pop(request.request_id, None)
        if request.is_finished:
            self.req_to_hashes.pop(request.request_id, None)

    def free_tail(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past those its first num_tokens tokens need (blocks that held
        only rejected draft tokens), to the front of the free queue: nothing worth keeping is in them. Those
        of the blocks kept for the request to grow into (allocate_slots) go back to the back of the queue, in
        their order, as if never taken. Returns how many."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        assert all(b.block_hash is None for b in tail), "a block holding drafts entered the prefix cache"
        self.pool.free_blocks(reversed(tail), to_front=True)
        reserve = self.req_reserve.get(request.request_id)
        if reserve is not None and blocks:  # those of the request's reserve go back to it, as if never taken
            end, step = reserve
            self.pool.reserve_after(blocks[-1].block_id, (end - blocks[-1].block_id) * step - 1, step)
        return len(tail)

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its start-th block on (start > 0: only those added since)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())[start:]]

    def num_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.pool.usage()
