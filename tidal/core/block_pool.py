"""BlockPool: the fixed set of KV-cache blocks, their ref counts, the LRU free queue and the
prefix-hash table.

A block with ref_cnt == 0 sits in the free queue. If it also carries a block hash, it still holds
valid KV for that prefix and can be revived by a later request (a prefix-cache hit) until it is
evicted: eviction happens lazily, only when a fresh block is taken from the front of the queue.
Freed blocks join the back of the queue, so the least recently used are evicted first.

Invariant (checked by `check_invariants`): every block is either in the free queue with
ref_cnt == 0 or in use with ref_cnt > 0; free + in_use == num_blocks; the hash table maps each
hash to a block that carries that hash.
"""
from __future__ import annotations

from collections import OrderedDict


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached but unreferenced and evictable)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    # -- mutations -------------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise ValueError(f"cannot take {n} blocks: only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving them if unreferenced)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order) -> None:
        """Drop one reference from each block; unreferenced blocks join the back of the LRU queue
        in the order given (callers pass a request's blocks last-first, so its tail goes first)."""
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # If an identical block is already cached (computed concurrently), keep the first one.
        self.cached_blocks.setdefault(block_hash, block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request uses; return how many were dropped."""
        dropped = 0
        for block in self.free_queue.values():
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def check_invariants(self) -> None:
        in_use = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                assert block.block_id in self.free_queue, f"unreferenced block {block.block_id} not free"
            else:
                assert block.block_id not in self.free_queue, f"referenced block {block.block_id} is free"
                in_use += 1
        assert in_use + len(self.free_queue) == self.num_blocks
        for h, block in self.cached_blocks.items():
            assert block.block_hash == h, f"block {block.block_id} lost its hash"
