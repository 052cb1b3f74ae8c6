"""StateCheckpoints bookkeeping (plain Python): a checkpoint is readable only after the step that
writes it, lookups return the longest checkpointed prefix, eviction is least recently used, and
indices are never lost or shared."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.core.state_checkpoints import StateCheckpoints

H = [bytes([i]) * 32 for i in range(8)]  # block hashes of one prompt, in order


def test_a_checkpoint_is_readable_only_after_commit():
    c = StateCheckpoints(first_index=4, num_checkpoints=2)
    index = c.reserve(H[2])
    assert index in (4, 5)
    assert c.lookup(H, 5) == (0, None)  # the forward that writes it has not run yet
    c.commit()
    assert c.lookup(H, 5) == (3, index)  # blocks 0..2: the prefix ending at H[2]
    assert c.lookup(H, 2) == (0, None)  # a hit of 2 blocks cannot use a checkpoint after block 3


def test_lookup_returns_the_longest_checkpointed_prefix():
    c = StateCheckpoints(0, 3)
    a, b = c.reserve(H[1]), c.reserve(H[4])
    c.commit()
    assert c.lookup(H, 8) == (5, b)
    assert c.lookup(H, 4) == (2, a)
    assert c.num_hits == 2


def test_reserving_twice_or_when_full_of_pending_gives_nothing():
    c = StateCheckpoints(0, 1)
    assert c.reserve(H[0]) == 0
    assert c.reserve(H[0]) is None  # being written
    assert c.reserve(H[1]) is None  # the only index is pending: nothing to evict
    c.commit()
    assert c.reserve(H[0]) is None  # already checkpointed


def test_eviction_is_least_recently_used():
    c = StateCheckpoints(0, 2)
    c.reserve(H[0])
    c.reserve(H[1])
    c.commit()
    c.lookup(H, 1)  # H[0] used: H[1] is now the least recent
    index = c.reserve(H[2])
    c.commit()
    assert c.lookup([H[1]], 1) == (0, None)
    assert c.lookup([H[0]], 1) == (1, 1 - index)
    c.check_invariants()


def test_an_owners_moving_checkpoint_replaces_its_previous_one():
    c = StateCheckpoints(0, 3)
    first = c.reserve(H[1], owner="r")
    c.commit()
    second = c.reserve(H[3], owner="r")  # the next block boundary of r's output
    c.commit()
    assert c.lookup(H, 8) == (4, second)
    assert c.lookup(H, 2) == (0, None)  # H[1] was dropped and its index freed
    c.forget("r")  # r finished: its latest checkpoint stays
    c.reserve(H[5], owner="r2")
    c.commit()
    assert c.lookup(H, 4) == (4, second)
    c.check_invariants()
    assert first is not None


def test_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="num_checkpoints"):
        StateCheckpoints(0, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "reserve_owned", "forget", "commit", "lookup", "reset"]),
                          st.integers(0, 7)), max_size=60))
def test_indices_are_never_lost_or_shared(ops):
    c = StateCheckpoints(first_index=10, num_checkpoints=3)
    for op, i in ops:
        if op in ("reserve", "reserve_owned"):
            index = c.reserve(H[i], owner=f"r{i % 2}" if op == "reserve_owned" else None)
            assert index is None or 10 <= index < 13
        elif op == "forget":
            c.forget(f"r{i % 2}")
        elif op == "commit":
            c.commit()
        elif op == "lookup":
            n, index = c.lookup(H, i)
            assert (n == 0) == (index is None) and n <= i
        else:
            c.reset()
        c.check_invariants()
