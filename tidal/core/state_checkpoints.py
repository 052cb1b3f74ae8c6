"""StateCheckpoints: prefix caching for models with Mamba layers.

A cached prefix must restore attention KV *and* the Mamba state after that prefix. Attention KV is
cached per 16-token block as for any model; the Mamba state (conv inputs + SSM state of every Mamba
layer, one state slot's worth) is checkpointed at block boundaries into checkpoint slots, keyed by
the hash of the block that ends the prefix. A prefix-cache hit is cut back to the longest run of
cached blocks whose last block has a checkpoint, and the checkpoint is copied into the request's own
state slot before its first chunk runs.

A checkpoint costs a whole state slot (hundreds of KiB for a large model, the KV of hundreds of
tokens), so not every block gets one. The scheduler checkpoints each prompt at its last full block
before the final token (the longest hit an identical prompt, n > 1 samples or a preempted request's
recompute can have), and each request's generated text at its latest block boundary (each decode
step that fills a block moves that checkpoint forward), so a conversation's next turn, which
repeats the prompt and the answer, hits all of it. Checkpoints are evicted least recently used.

Checkpoints are written by the forward of the step that schedules them, so one reserved during a
`schedule()` call is only visible to lookups from the next call on (`commit`).
"""
from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, first_index: int, num_checkpoints: int) -> None:
        """Checkpoints live at state indices [first_index, first_index + num_checkpoints) of the
        per-layer state tensors, after the running requests' slots."""
        if num_checkpoints < 1:
            raise ValueError(f"num_checkpoints must be >= 1, got {num_checkpoints}")
        self.num_checkpoints = num_checkpoints
        self._free = list(range(first_index + num_checkpoints - 1, first_index - 1, -1))
        self._valid: OrderedDict[bytes, int] = OrderedDict()  # block hash -> state index, LRU first
        self._pending: dict[bytes, int] = {}  # reserved this step, written by its forward
        self._latest: dict[str, bytes] = {}  # request id -> its moving output checkpoint
        self.num_hits = 0

    def counts(self) -> tuple[int, int]:
        """(readable checkpoints, checkpoints being written by the next forward)."""
        return len(self._valid), len(self._pending)

    def commit(self) -> None:
        """The previous step's forward has run: its checkpoints are now readable."""
        self._valid.update(self._pending)
        self._pending.clear()

    def lookup(self, block_hashes: list[bytes], num_hit_blocks: int) -> tuple[int, int | None]:
        """Of the first num_hit_blocks cached blocks, how many end at a checkpointed boundary (the
        longest such run), and the checkpoint's state index (None when there is none)."""
        for n in range(min(num_hit_blocks, len(block_hashes)), 0, -1):
            index = self._valid.get(block_hashes[n - 1])
            if index is not None:
                self._valid.move_to_end(block_hashes[n - 1])
                self.num_hits += 1
                return n, index
        return 0, None

    def reserve(self, block_hash: bytes, owner: str | None = None) -> int | None:
        """A state index to checkpoint the prefix ending with this block into, or None when it is
        already checkpointed (or being written) or no checkpoint can be evicted. With an owner (a
        request's moving output checkpoint), the owner's previous checkpoint is dropped."""
        if block_hash in self._valid or block_hash in self._pending:
            return None
        previous = self._latest.pop(owner, None) if owner is not None else None
        if previous is not None and previous in self._valid:
            self._free.append(self._valid.pop(previous))
        if self._free:
            index = self._free.pop()
        elif self._valid:
            # Overwriting is safe even if this step restores from it: restores run before the forward.
            _, index = self._valid.popitem(last=False)
        else:
            return None
        self._pending[block_hash] = index
        if owner is not None:
            self._latest[owner] = block_hash
        return index

    def forget(self, owner: str) -> None:
        """The request is done: its latest output checkpoint stays, no longer moved."""
        self._latest.pop(owner, None)

    def reset(self) -> None:
        for index in [*self._valid.values(), *self._pending.values()]:
            self._free.append(index)
        self._valid.clear()
        self._pending.clear()
        self._latest.clear()

    def check_invariants(self) -> None:
        used = [*self._valid.values(), *self._pending.values()]
        assert len(used) + len(self._free) == self.num_checkpoints
        assert len(set(used) | set(self._free)) == self.num_checkpoints
