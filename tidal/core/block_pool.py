"""BlockPool: the fixed set of KV-cache blocks, their ref counts, the LRU free queue and the
prefix-hash table.

Every block is in exactly one of three states:
- in use: ref_cnt > 0 (held by one request, or shared by several through the prefix cache);
- cached: ref_cnt == 0 but still in the hash table, so its KV can be revived by a later request
  whose prompt starts with the same tokens (a prefix-cache hit);
- free: ref_cnt == 0 and no hash.
Cached and free blocks both sit in the free queue. Eviction is lazy: a cached block loses its hash
only when it reaches the front of the queue and is handed out as a fresh block. Released blocks
join the back of the queue, so the least recently used are evicted first.

A request's blocks are kept side by side where they can be (get_new_blocks' `after`, reserve_after): decode
attention reads them from memory on every step, and runs of blocks come faster than strewn ones.

Blocks never handed out yet are "cold": their memory (a lazily committed mapping on CPU) is first written,
page by page, by the request that gets them. A prefix-cache reset leaves every unreferenced block free, and
then puts the warm ones (handed out before) ahead of the cold ones, so that the requests after it reuse
memory already committed rather than fault in new pages (a KV-cache page fault costs the kernel a page
clear: 4-11% of a prompt-heavy run on a fresh engine).

Invariant (checked by `check_invariants`): free + cached + in_use == num_blocks; a block is in the
free queue iff its ref_cnt is 0; every hash-table entry points to a block carrying that hash; a
block with a hash is in the table (no orphaned hashes).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set only while the block is in the hash table

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


@dataclass(frozen=True)
class BlockCounts:
    free: int      # unreferenced, no cached KV
    cached: int    # unreferenced, KV still reusable
    in_use: int    # referenced by at least one request


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (front = least recently released)
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self._warm = bytearray(num_blocks)  # 1: handed out at least once

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
        """Blocks in the hash table, whether in use or not."""
        return len(self.cached_blocks)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def counts(self) -> BlockCounts:
        """Free / cached / in-use split (O(num_blocks): for tests, invariants and debugging)."""
        cached = sum(1 for b in self.free_queue.values() if b.block_hash is not None)
        return BlockCounts(len(self.free_queue) - cached, cached, self.num_used_blocks)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    # -- mutations -------------------------------------------------------------------------------
    def get_new_blocks(self, n: int, after: int | None = None) -> list[KVCacheBlock]:
        """Take n blocks, evicting their cached KV if any. after: the id of the block the new ones follow (a
        request's last block). Decode attention reads a request's blocks from memory on every step, and blocks
        side by side come faster than blocks strewn across the cache, so each new block is, in this order: the
        front of the free queue if it is next to the block before (a freed request's run, which the queue holds
        last block first); the block right after or before that one, if free, unless it was never handed out
        and the front was (memory already committed goes first) or it holds cached KV and the front does not
        (a neighbour's cached KV goes only where the front would have given up its own: then that one stays
        instead of the least recently used); the front of the queue."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot take {n} blocks: only {len(self.free_queue)} free")
        out = []
        queue = self.free_queue
        for _ in range(n):
            block = None
            if after is not None:
                front = next(iter(queue))
                if abs(front - after) != 1:
                    head = self.blocks[front]
                    for nxt in (after + 1, after - 1):
                        b = self.blocks[nxt] if 0 <= nxt < self.num_blocks else None
                        if (b is not None and b.ref_cnt == 0 and (self._warm[nxt] or not self._warm[front])
                                and (b.block_hash is None or head.block_hash is not None)):
                            block = queue.pop(nxt)
                            break
            if block is None:
                _, block = queue.popitem(last=False)
            after = block.block_id
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue is referenced"
            if block.block_hash is not None:
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            self._warm[block.block_id] = 1
            out.append(block)
        return out

    def reserve_after(self, block_id: int, n: int, step: int = 1) -> int:
        """Keep the free blocks next to block_id on its `step` side (block_id + step, + 2 step, ...: up to n, up
        to the first one that is not free) for the request that ends at it: they go to the back of the free
        queue, so that others take them last and the request finds them when it grows (get_new_blocks' after).
        A hint, not a hold: they stay free. Returns how many were moved."""
        moved = 0
        for i in range(1, n + 1):
            bid = block_id + i * step
            if not 0 <= bid < self.num_blocks or bid not in self.free_queue:
                break
            self.free_queue.move_to_end(bid)
            moved += 1
        return moved

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving them if unreferenced)."""
        for block in blocks:
            assert block.block_hash is not None, f"block {block.block_id} is not cached"
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order, to_front: bool = False) -> None:
        """Drop one reference from each block; unreferenced blocks join the back of the LRU queue
        in the order given (callers pass a request's blocks last-first, so its tail goes first).
        to_front: each joins the front instead (blocks with nothing worth keeping, handed out first;
        given last-first, they come back in the order they were taken)."""
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if to_front:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Enter a full, referenced block into the hash table. Returns False (and leaves the block
        uncached) if caching is off or an identical block is already cached: two requests computed
        the same tokens concurrently, and one table entry serves later hits as well as two."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        assert block.ref_cnt > 0, f"caching unreferenced block {block.block_id}"
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def _uncache(self, block: KVCacheBlock) -> None:
        assert block.ref_cnt == 0, f"evicting block {block.block_id} still in use"
        del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request uses; return how many were dropped. Blocks in
        use keep their entries: their KV is valid and running requests still extend them. The free
        warm blocks then go ahead of the cold ones, in their order."""
        dropped = 0
        for block in self.free_queue.values():
            if block.block_hash is not None:
                self._uncache(block)
                dropped += 1
        warm = [bid for bid in self.free_queue if self._warm[bid]]
        for bid in reversed(warm):
            self.free_queue.move_to_end(bid, last=False)
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
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, \
                    f"block {block.block_id} carries a hash the table does not map to it"
        for h, block in self.cached_blocks.items():
            assert block.block_hash == h, f"block {block.block_id} lost its hash"
        c = self.counts()
        assert c.in_use == in_use, (c, in_use)
        assert c.free + c.cached + c.in_use == self.num_blocks, c
