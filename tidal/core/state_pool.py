"""StatePool: per-request recurrent-state slots for Mamba layers, beside the KV block pool.

A running request of a model with Mamba layers owns exactly one slot (the conv state and SSM state
of every Mamba layer live at that index of the per-layer state tensors). A slot is taken on
admission, carried across chunks and steps, and returned on finish, abort or preemption.
"""
from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def owners(self) -> dict[int, str]:
        """Slot -> id of the request holding it (a copy)."""
        return dict(self._owner)

    def allocate(self, request_id: str) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._owner[slot] = request_id
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._owner, f"slot {slot} freed twice"
        del self._owner[slot]
        self._free.append(slot)

    def check_invariants(self) -> None:
        assert len(self._free) + len(self._owner) == self.num_slots
        assert not set(self._free) & set(self._owner)
