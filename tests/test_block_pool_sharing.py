"""Block pool and KV-cache manager with prefix sharing: pure-Python bookkeeping tests.

Two hypothesis tests drive random operations against a model of what the blocks must hold:
- the BlockPool alone (take / cache / hit / release / reset), checking ref counts, the free queue
  and free + cached + in_use == num_blocks after every operation;
- the real Scheduler + KVCacheManager on random shared-prefix workloads (chunked prefill,
  preemption, aborts, cache salts, prompt-logprobs requests), with a fake KV cache where every
  slot records which token sequence wrote it: a request that reads a slot holding another
  sequence's KV (an evicted or reused shared block, a cross-salt hit) fails the test.
"""
from __future__ import annotations

from functools import partial

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.helpers import WorkerMirror
from tidal.core.block_pool import BlockPool
from tidal.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from tidal.core.scheduler import Scheduler
from tidal.engine.stop_checker import append_tokens
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None, prompt_logprobs: int | None = None,
                 max_tokens: int = 4) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Request(rid, tokens, params, cache_salt=salt)


def update(sched: Scheduler, batch, sampled: dict[str, int]) -> list:
    """Scheduler.update as the engine calls it, with one sampled token per request and the engine's
    stop checker (no text: no stop strings)."""
    return sched.update(batch, {rid: [t] for rid, t in sampled.items()},
                        partial(append_tokens, max_model_len=sched.max_model_len))


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None):
    """What the scheduler does to admit a waiting request; returns the hit token count."""
    blocks, num_cached = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_cached if num_new is None else num_new
    assert kv.allocate_slots(req, num_new, blocks) is not None
    req.num_computed_tokens = num_cached
    req.status = RequestStatus.RUNNING
    return num_cached


def finish(kv: KVCacheManager, req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)


# -- BlockPool state machine -------------------------------------------------------------------------
class BlockPoolMachine(RuleBasedStateMachine):
    """Holders take fresh blocks, publish them in the hash table, hit cached blocks and release
    everything they hold; the model counts each block's holders."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.holders: list[list] = []  # each holder: the blocks it references, in order
        self.next_hash = 0

    def _holders_of(self, block) -> int:
        return sum(h.count(block) for h in self.holders)

    @rule(n=st.integers(0, 4))
    def take(self, n):
        if n > self.pool.num_free_blocks:
            return
        blocks = self.pool.get_new_blocks(n)
        for b in blocks:
            assert self._holders_of(b) == 0, f"block {b.block_id} handed out while referenced"
            assert b.block_hash is None
        self.holders.append(blocks)

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data(), reuse_hash=st.booleans())
    def cache(self, data, reuse_hash):
        holder = data.draw(st.sampled_from([h for h in self.holders if h]))
        block = data.draw(st.sampled_from(holder))
        if reuse_hash and self.pool.cached_blocks:
            h = data.draw(st.sampled_from(sorted(self.pool.cached_blocks)))
        else:
            self.next_hash += 1
            h = self.next_hash.to_bytes(8, "little")
        was_cached = h in self.pool.cached_blocks or block.block_hash is not None
        assert self.pool.cache_full_block(block, h) is not was_cached

    @precondition(lambda self: bool(self.pool.cached_blocks))
    @rule(data=st.data())
    def hit(self, data):
        h = data.draw(st.sampled_from(sorted(self.pool.cached_blocks)))
        block = self.pool.get_cached_block(h)
        self.pool.touch([block])
        self.holders.append([block])

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        self.pool.free_blocks(reversed(self.holders.pop(i)))

    @rule()
    def reset(self):
        in_use_hashes = {b.block_hash for h in self.holders for b in h if b.block_hash is not None}
        self.pool.reset_prefix_cache()
        assert set(self.pool.cached_blocks) == in_use_hashes  # only referenced blocks keep their entry

    @invariant()
    def ref_counts_match_holders(self):
        self.pool.check_invariants()
        for b in self.pool.blocks:
            assert b.ref_cnt == self._holders_of(b), b
        c = self.pool.counts()
        assert c.free + c.cached + c.in_use == self.pool.num_blocks

    def teardown(self):
        while self.holders:
            self.pool.free_blocks(reversed(self.holders.pop()))
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        self.pool.check_invariants()


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- scheduler + manager on random shared-prefix workloads --------------------------------------------
PREFIXES = [[7] * 12, [8, 9] * 6, list(range(10, 22))]

request_spec = st.fixed_dictionaries({
    "prefix": st.sampled_from(range(len(PREFIXES))),
    "prefix_len": st.integers(0, 12),
    "suffix": st.lists(st.integers(1, 3), min_size=0, max_size=10),
    "salt": st.sampled_from([None, None, "a", "b"]),
    "max_tokens": st.integers(1, 6),
    "prompt_logprobs": st.sampled_from([None, None, None, 1]),
    "arrive_at": st.integers(0, 8),
    "abort_at": st.one_of(st.none(), st.integers(1, 30)),
})


def run_workload(specs, num_blocks, budget, max_num_seqs, sample_tokens):
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64)
    kv_slots: dict[int, tuple] = {}  # fake KV cache: slot -> (salt, the token sequence ending there)
    salts: dict[str, str | None] = {}
    expected_queries = expected_hits = 0
    admitted_hits: dict[str, list[int]] = {}
    mirror = WorkerMirror()  # the block tables as the workers hold them, from the deltas alone
    for step in range(400):
        for i, s in enumerate(specs):
            if s["arrive_at"] == step:
                tokens = (PREFIXES[s["prefix"]][:s["prefix_len"]] + s["suffix"]) or [5]
                rid = f"r{i}"
                salts[rid] = s["salt"]
                sched.add_request(make_request(rid, tokens, s["salt"], s["prompt_logprobs"], s["max_tokens"]))
            if s["abort_at"] == step and f"r{i}" in sched.requests:
                sched.finish_request(f"r{i}", RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished_requests() and step > 8:
            break
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule()
        mirror.apply(out)
        # execute: every scheduled request writes its tokens' KV ...
        for sr in out.scheduled:
            req = sched.requests[sr.request_id]
            if sr.request_id not in running_before:  # admitted this step
                reads = kv.reads_prefix_cache(req)
                assert sr.start_pos % BS == 0 and sr.start_pos <= req.num_tokens - 1, "last token recomputed"
                if not reads:
                    assert sr.start_pos == 0, "prompt-logprobs requests never read the cache"
                else:
                    expected_queries += req.num_tokens
                    expected_hits += sr.start_pos
                admitted_hits.setdefault(sr.request_id, []).append(sr.start_pos)
            for p in range(sr.start_pos, sr.start_pos + sr.num_tokens):
                slot = mirror.blocks[sr.request_id][p // BS] * BS + p % BS
                kv_slots[slot] = (salts[sr.request_id], tuple(req.all_token_ids[:p + 1]))
        # ... before any is read: each request's whole context must be its own tokens' KV
        for sr in out.scheduled:
            req = sched.requests[sr.request_id]
            for p in range(sr.start_pos + sr.num_tokens):
                slot = mirror.blocks[sr.request_id][p // BS] * BS + p % BS
                assert kv_slots.get(slot) == (salts[sr.request_id], tuple(req.all_token_ids[:p + 1])), \
                    f"{sr.request_id} reads wrong KV at position {p}"
        check_sharing(sched, kv, salts)
        sampled = {sr.request_id: sample_tokens[(step + sr.num_tokens) % len(sample_tokens)]
                   for sr in out.scheduled if sr.sample}
        update(sched, out, sampled)
        check_sharing(sched, kv, salts)
    assert not sched.has_unfinished_requests(), "workload did not finish"
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks), "ref counts must return to zero"
    assert kv.pool.num_free_blocks == num_blocks
    assert not kv.req_to_blocks and not kv.req_to_hashes
    assert (kv.prefix_queries, kv.prefix_hits) == (expected_queries, expected_hits)
    return kv, sched, admitted_hits


def check_sharing(sched, kv, salts):
    """Ref counts equal the number of holders; a block in two requests is the same prefix block
    of both (same index, same salt, same tokens up to its end)."""
    kv.pool.check_invariants()
    holders: dict[int, list[tuple[str, int]]] = {}
    for rid, blocks in kv.req_to_blocks.items():
        assert sched.requests[rid].status == RequestStatus.RUNNING
        for i, b in enumerate(blocks):
            holders.setdefault(b.block_id, []).append((rid, i))
    for b in kv.pool.blocks:
        assert b.ref_cnt == len(holders.get(b.block_id, ())), b
    for block_id, hs in holders.items():
        if len(hs) < 2:
            continue
        (rid0, i0) = hs[0]
        assert kv.pool.blocks[block_id].block_hash is not None, "only cached blocks are shared"
        for rid, i in hs[1:]:
            assert i == i0 and salts[rid] == salts[rid0]
            end = (i + 1) * BS
            assert sched.requests[rid].all_token_ids[:end] == sched.requests[rid0].all_token_ids[:end]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=10),
       num_blocks=st.integers(16, 40), budget=st.integers(3, 40), max_num_seqs=st.integers(1, 6),
       sample_tokens=st.lists(st.integers(1, 2), min_size=1, max_size=3))
def test_scheduler_sharing_never_serves_wrong_kv(specs, num_blocks, budget, max_num_seqs, sample_tokens):
    run_workload(specs, num_blocks, budget, max_num_seqs, sample_tokens)


# -- focused cases ---------------------------------------------------------------------------------
def test_hits_stop_before_the_last_token():
    for n_tokens, expected in [(8, 4), (9, 8), (7, 4), (4, 0), (1, 0)]:
        kv = KVCacheManager(16, BS)
        first = make_request("a", list(range(1, n_tokens + 1)))
        admit(kv, first)
        second = make_request("b", list(range(1, n_tokens + 1)))
        assert admit(kv, second) == expected, n_tokens


def test_same_step_children_share_the_first_childs_blocks():
    """n children admitted in one scheduling pass: the later ones hit the blocks the first one
    allocated in that pass (its K/V is written before any is read)."""
    kv = KVCacheManager(32, BS)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    children = [make_request(f"p#{i}", prompt) for i in range(4)]
    hits = [admit(kv, c) for c in children]
    assert hits == [0, 8, 8, 8]
    shared = kv.req_to_blocks["p#0"][:2]
    for c in children[1:]:
        assert kv.req_to_blocks[c.request_id][:2] == shared
    assert [b.ref_cnt for b in shared] == [4, 4]
    assert kv.pool.num_used_blocks == 3 + 3  # 3 blocks for child 0, one private tail block each
    for c in children:
        finish(kv, c)
    assert kv.pool.num_used_blocks == 0


def test_chunk_caches_only_blocks_full_after_the_step():
    kv = KVCacheManager(32, BS)
    a = make_request("a", list(range(1, 15)))  # 14 tokens
    admit(kv, a, num_new=6)  # computes tokens 0..5: block 0 full, block 1 half
    assert kv.pool.num_cached_blocks == 1
    b = make_request("b", list(range(1, 15)))
    assert admit(kv, b, num_new=1) == 4


def test_different_salts_never_share():
    kv = KVCacheManager(32, BS)
    prompt = list(range(1, 13))
    admit(kv, make_request("a", prompt, salt="tenant-1"))
    assert admit(kv, make_request("b", prompt, salt="tenant-2")) == 0
    assert admit(kv, make_request("c", prompt)) == 0
    assert admit(kv, make_request("d", prompt, salt="tenant-1")) == 8
    ids = {rid: {b.block_id for b in blocks} for rid, blocks in kv.req_to_blocks.items()}
    assert not ids["a"] & ids["b"] and not ids["a"] & ids["c"] and not ids["b"] & ids["c"]
    assert hash_block_tokens(None, [1, 2], "x") != hash_block_tokens(None, [1, 2], None)
    assert hash_block_tokens(None, [1, 2], "") != hash_block_tokens(None, [1, 2], None)


def test_hash_chains_over_the_parent():
    a, b = hash_block_tokens(None, [1, 2, 3, 4]), hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(b, [5, 6, 7, 8])
    assert len(a) == 32  # sha256


def test_prompt_logprobs_requests_fill_but_never_read_the_cache():
    kv = KVCacheManager(32, BS)
    prompt = list(range(1, 13))
    admit(kv, make_request("a", prompt))
    assert admit(kv, make_request("b", prompt, prompt_logprobs=1)) == 0
    kv2 = KVCacheManager(32, BS)
    admit(kv2, make_request("a", prompt, prompt_logprobs=1))
    assert admit(kv2, make_request("b", prompt)) == 8
    assert (kv2.prefix_queries, kv2.prefix_hits) == (12, 8)  # only the request that read counts


def test_freed_blocks_stay_cached_and_evict_tail_first():
    kv = KVCacheManager(7, BS)
    a = make_request("a", list(range(1, 13)))  # 3 full blocks
    admit(kv, a)
    finish(kv, a)
    assert kv.pool.counts().cached == 3
    a_last_first = [b.block_id for b in kv.pool.free_queue.values()][-3:]
    x = make_request("x", [50] * 17)  # 5 blocks: the 4 never-used ones, then a's last block
    admit(kv, x)
    assert kv.pool.num_evictions == 1
    assert a_last_first[0] in {b.block_id for b in kv.req_to_blocks["x"]}
    finish(kv, x)
    c = make_request("c", list(range(1, 13)) + [99])
    assert admit(kv, c) == 8, "a's tail block was evicted, its first two blocks still hit"


def test_reset_prefix_cache_drops_only_unreferenced_blocks():
    kv = KVCacheManager(32, BS)
    a, b = make_request("a", list(range(1, 13))), make_request("b", list(range(20, 32)))
    admit(kv, a)
    admit(kv, b)
    finish(kv, a)
    assert kv.reset_prefix_cache() == 3
    assert kv.pool.num_cached_blocks == 3  # b's blocks are in use and stay cached
    assert admit(kv, make_request("a2", list(range(1, 13)))) == 0
    assert admit(kv, make_request("b2", list(range(20, 32)))) == 8
    kv.pool.check_invariants()


def test_caching_off_never_hits_or_counts():
    kv = KVCacheManager(32, BS, enable_caching=False)
    admit(kv, make_request("a", list(range(1, 13))))
    assert admit(kv, make_request("b", list(range(1, 13)))) == 0
    assert kv.pool.num_cached_blocks == 0 and (kv.prefix_queries, kv.prefix_hits) == (0, 0)


def test_lookup_is_counted_once_per_admission():
    """A request blocked on memory is looked up every step; the metrics count its admission only."""
    kv = KVCacheManager(4, BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    sched.add_request(make_request("a", list(range(1, 13)), max_tokens=3))
    sched.add_request(make_request("b", list(range(1, 9)) + list(range(40, 47)), max_tokens=1))
    admitted_at = {}
    for step in range(10):
        out = sched.schedule()
        for sr in out.scheduled:
            admitted_at.setdefault(sr.request_id, (step, sr.start_pos))
        update(sched, out, {sr.request_id: 1 for sr in out.scheduled if sr.sample})
    assert not sched.has_unfinished_requests()
    assert admitted_at == {"a": (0, 0), "b": (3, 8)}  # b waited three steps for a's blocks
    assert (kv.prefix_queries, kv.prefix_hits) == (12 + 15, 8)


def test_preempted_request_rehits_its_own_blocks():
    kv = KVCacheManager(32, BS)
    a = make_request("a", list(range(1, 10)))
    admit(kv, a)
    a.num_computed_tokens = a.num_tokens
    a.append_output_token(77)
    a.status = RequestStatus.PREEMPTED
    kv.free(a)
    a.num_computed_tokens = 0
    assert admit(kv, a) == 8
    assert kv.req_to_hashes["a"], "a preempted request keeps its memoised hashes"
    finish(kv, a)
    assert "a" not in kv.req_to_hashes
