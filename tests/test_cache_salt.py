"""cache_salt keeps tenants apart in the prefix cache (pure-Python bookkeeping, KVCacheManager alone).

The only thing a prefix-cache hit changes for a client is how fast its prompt is computed, so a
third party can detect another tenant's prompt by timing only if its own request gets a hit on that
tenant's blocks. Property: with random prompts sharing prefixes and random salts (including None,
"", salts that are prefixes of each other, and non-ASCII), a request's hit is exactly the longest
full-block prefix it shares with an earlier request of the *same* salt, and no block is ever held
by two requests of different salts.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.core.kv_cache_manager import KVCacheManager
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams

BS = 4
SALTS = [None, "", "a", "ab", "a\x00", "b", "tenant-1", "tenant-10", "τ"]


def _admit(kv: KVCacheManager, request: Request) -> int:
    blocks, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.RUNNING
    return num_cached


def _expected_hit(tokens: list[int], earlier: list[list[int]]) -> int:
    """Full blocks shared with the longest matching earlier prompt, leaving the last token to compute."""
    best = 0
    for other in earlier:
        shared = 0
        while (shared + 1) * BS <= min(len(tokens), len(other)) and \
                tokens[:(shared + 1) * BS] == other[:(shared + 1) * BS]:
            shared += 1
        best = max(best, shared)
    return min(best * BS, (len(tokens) - 1) // BS * BS)


request_spec = st.fixed_dictionaries({
    "prefix": st.integers(0, 2),  # which of three shared stems the prompt starts with
    "stem_blocks": st.integers(0, 3),
    "tail": st.lists(st.integers(1, 5), max_size=6),
    "salt": st.sampled_from(SALTS),
    "free_after": st.booleans(),  # finish at once (its blocks stay cached) or keep running
})


@settings(max_examples=200, deadline=None)
@given(specs=st.lists(request_spec, min_size=2, max_size=12))
def test_a_salt_only_ever_hits_its_own_blocks(specs):
    stems = [[100 + s] * (3 * BS) for s in range(3)]
    kv = KVCacheManager(256, BS)  # room for everything: nothing is evicted, hits are exact
    seen: dict[str | None, list[list[int]]] = {}
    running: dict[str, tuple[Request, str | None]] = {}
    for i, spec in enumerate(specs):
        tokens = stems[spec["prefix"]][:spec["stem_blocks"] * BS] + spec["tail"] + [7]
        request = Request(f"r{i}", tokens, SamplingParams(max_tokens=1), cache_salt=spec["salt"])
        hit = _admit(kv, request)
        assert hit == _expected_hit(tokens, seen.get(spec["salt"], [])), (spec, seen)
        seen.setdefault(spec["salt"], []).append(tokens)
        running[request.request_id] = (request, spec["salt"])
        holders: dict[int, set] = {}
        for rid, blocks in kv.req_to_blocks.items():
            for b in blocks:
                holders.setdefault(b.block_id, set()).add(running[rid][1])
        assert all(len(salts) == 1 for salts in holders.values()), holders
        if spec["free_after"]:
            request.status = RequestStatus.FINISHED_STOPPED
            kv.free(request)
            del running[request.request_id]
    kv.pool.check_invariants()


def test_a_third_party_gets_no_hit_on_another_salts_prompt():
    """Tenant A's prompt is cached; B (another salt) and an unsalted request with the same prompt get
    0 cached tokens, so their prompt takes as long as a cold one; A's second request hits."""
    kv = KVCacheManager(64, BS)
    prompt = list(range(1, 4 * BS + 2))
    assert _admit(kv, Request("a1", prompt, SamplingParams(), cache_salt="tenant-a")) == 0
    assert _admit(kv, Request("b", prompt, SamplingParams(), cache_salt="tenant-b")) == 0
    assert _admit(kv, Request("none", prompt, SamplingParams())) == 0
    assert _admit(kv, Request("a2", prompt, SamplingParams(), cache_salt="tenant-a")) == 4 * BS
