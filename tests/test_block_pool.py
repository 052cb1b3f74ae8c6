"""KVCacheManager + BlockPool bookkeeping under random allocate / append / free / preempt / abort
sequences (hypothesis state machine, pure Python: no model, no tensors).

After every operation: the pool's own invariants hold, every block's ref count equals the number of
block tables holding it (so no leak and no double free), free + in use == total, no table holds a
block twice, a block is in two tables only when it is a shared prefix-cache block, and every
request's table has exactly the blocks its computed tokens need (a new block only when the last one
fills). A fake KV cache records which token sequence wrote each slot, so reading a slot that was
handed to someone else while still referenced fails the test. At teardown all requests end and every
block must be free.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from tidal.core.block_pool import BlockPool
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams

# A 3-token alphabet and short prompts, so random prompts share prefixes and hit the prefix cache.
tokens_st = st.lists(st.integers(1, 3), min_size=1, max_size=24)


class KVCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 24),
                caching=st.booleans(), chunk=st.integers(1, 8))
    def setup(self, block_size, num_blocks, caching, chunk):
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.chunk = chunk
        self.live: dict[str, Request] = {}
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix that wrote it
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------------
    def _table(self, req: Request) -> list[int]:
        return self.kv.get_block_ids(req.request_id)

    def _compute(self, req: Request, num_new: int) -> None:
        """The model runner's part: write the KV of tokens [computed, computed + num_new), then check
        every slot the request attends to holds its own prefix."""
        table = self._table(req)
        start = req.num_computed_tokens
        for pos in range(start, start + num_new):
            self.slots[(table[pos // self.bs], pos % self.bs)] = tuple(req.all_token_ids[:pos + 1])
        req.num_computed_tokens += num_new
        for pos in range(req.num_computed_tokens):
            assert self.slots.get((table[pos // self.bs], pos % self.bs)) == tuple(req.all_token_ids[:pos + 1]), \
                f"{req.request_id} reads a slot of block {table[pos // self.bs]} written by another sequence"
        if req.num_computed_tokens == req.num_tokens:
            # the step reached the last known token: as Scheduler.update, append the sampled token
            req.append_output_token(1 + req.num_tokens % 3)

    def _end(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        del self.live[req.request_id]

    # -- rules -----------------------------------------------------------------------------------
    @rule(target=requests, prompt=tokens_st)
    def add_request(self, prompt):
        req = Request(f"r{self.next_id}", prompt, SamplingParams(max_tokens=None))
        self.next_id += 1
        self.live[req.request_id] = req
        return req

    @rule(req=requests)
    def step(self, req):
        """Admit (with prefix-cache lookup) a waiting request, or advance a running one by one chunk
        of prefill or one decode token (the token sampled at the end of the previous step)."""
        if req.request_id not in self.live:
            return
        free_before = self.kv.pool.num_free_blocks
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            hits, num_cached = self.kv.get_computed_blocks(req)
            assert num_cached % self.bs == 0 and num_cached < req.num_tokens
            num_new = min(req.num_tokens - num_cached, self.chunk)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                assert self._table(req) == [] and self.kv.pool.num_free_blocks == free_before
                return
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            for pos in range(num_cached):  # the hit blocks already hold this request's prefix
                table = self._table(req)
                assert self.slots.get((table[pos // self.bs], pos % self.bs)) == tuple(req.all_token_ids[:pos + 1])
            self._compute(req, num_new)
            return
        num_new = min(req.num_tokens - req.num_computed_tokens, self.chunk)
        table_before = self._table(req)
        if self.kv.allocate_slots(req, num_new) is None:
            assert self._table(req) == table_before and self.kv.pool.num_free_blocks == free_before
            return
        assert self._table(req)[:len(table_before)] == table_before  # a table only grows at its end
        self._compute(req, num_new)

    @rule(req=consumes(requests), status=st.sampled_from([RequestStatus.FINISHED_STOPPED,
                                                          RequestStatus.FINISHED_ABORTED]))
    def finish_or_abort(self, req, status):
        if req.request_id in self.live:
            self._end(req, status)

    @rule(req=requests)
    def preempt(self, req):
        if req.request_id in self.live and req.status == RequestStatus.RUNNING:
            self.kv.free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            assert self._table(req) == []

    @rule()
    def reset_prefix_cache(self):
        self.kv.reset_prefix_cache()

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def bookkeeping_is_consistent(self):
        pool = self.kv.pool
        pool.check_invariants()
        holders: dict[int, int] = {}
        for req in self.live.values():
            table = self._table(req)
            assert len(table) == len(set(table)), f"{req.request_id} holds a block twice: {table}"
            # exactly the blocks its computed tokens need: a new block only when the last one fills
            assert len(table) == -(-req.num_computed_tokens // self.bs), (req, table)
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)}"
            if block.ref_cnt > 1:
                assert self.kv.enable_caching and block.block_hash is not None, "unshared block in two tables"
        assert pool.num_free_blocks + len(holders) == pool.num_blocks

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in list(self.live.values()):
            self._end(req, RequestStatus.FINISHED_ABORTED)
        self.kv.pool.check_invariants()
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        assert not self.kv.req_to_blocks


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_kv_cache_manager_random_sequences = KVCacheMachine.TestCase


# -- direct checks -----------------------------------------------------------------------------------
def test_free_twice_is_refused():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks)


def test_taking_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_a_prefix_cache_reset_hands_out_blocks_used_before_ahead_of_fresh_ones():
    """Blocks handed out before (their memory committed) come before never-used ones after a reset, in
    their queue order; without a reset, cached blocks stay behind the fresh ones (LRU eviction last)."""
    pool = BlockPool(8)
    first = pool.get_new_blocks(3)  # blocks 0, 1, 2
    for i, b in enumerate(first):
        pool.cache_full_block(b, bytes([i]))
    pool.free_blocks(reversed(first))  # cached, at the back: 3..7 come first
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]
    pool.free_blocks(pool.blocks[3:5][::-1])
    assert pool.reset_prefix_cache() == 3
    assert list(pool.free_queue)[:5] == [2, 1, 0, 4, 3]  # warm, in the order they were freed
    assert [b.block_id for b in pool.get_new_blocks(6)] == [2, 1, 0, 4, 3, 5]
    pool.check_invariants()


def test_allocation_failure_leaves_request_untouched():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = Request("a", list(range(1, 13)), SamplingParams())
    assert kv.allocate_slots(req, 12) is None  # needs 3 blocks
    assert kv.get_block_ids("a") == [] and kv.pool.num_free_blocks == 2


def test_new_block_only_when_last_one_fills():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    req = Request("a", [1, 2, 3], SamplingParams())
    assert len(kv.allocate_slots(req, 3)) == 1
    req.num_computed_tokens = 3
    for n_tokens, expect_new in [(4, 0), (5, 1), (6, 0), (7, 0), (8, 0), (9, 1)]:
        req.append_output_token(7)
        assert len(kv.allocate_slots(req, 1)) == expect_new, n_tokens
        req.num_computed_tokens += 1
    assert len(kv.get_block_ids("a")) == 3


def _decode(kv: KVCacheManager, req: Request, steps: int) -> None:
    for _ in range(steps):
        req.num_computed_tokens = req.num_tokens
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1) is not None


def test_a_request_grows_into_the_blocks_after_its_own_while_others_are_admitted():
    """Requests decoding together each keep their blocks side by side: the blocks a request will grow into
    (its prompt and max_tokens) are kept after its last one at admission, and the next one takes its own
    beyond them."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    reqs = [Request(f"r{i}", [i + 1] * 8, SamplingParams(max_tokens=12)) for i in range(4)]  # 20 tokens: 5 blocks
    for req in reqs:
        kv.allocate_slots(req, 8)
    for _ in range(12):  # one token each a step, as a decode batch takes them
        for req in reqs:
            _decode(kv, req, 1)
    tables = [kv.get_block_ids(r.request_id) for r in reqs]
    assert all(len(t) == 5 for t in tables)
    for t in tables:
        assert t == list(range(t[0], t[0] + 5)), tables
    assert len({b for t in tables for b in t}) == 20
    kv.pool.check_invariants()


def test_kept_blocks_are_a_hint_that_never_refuses_another_request():
    """A request's kept blocks stay free: when nothing else is left, another request takes them (and the
    first then grows wherever there is room)."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = Request("a", [1] * 4, SamplingParams(max_tokens=100))
    kv.allocate_slots(a, 4)  # block 0; 1-5 kept for it
    assert kv.pool.num_free_blocks == 5
    b = Request("b", [2] * 16, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(b, 16) is not None  # four of a's kept blocks
    _decode(kv, a, 4)  # a's second block: the one left
    assert sorted(kv.get_block_ids("a") + kv.get_block_ids("b")) == list(range(6))
    assert kv.pool.num_free_blocks == 0
    kv.pool.check_invariants()


def test_a_long_running_pool_still_hands_out_blocks_side_by_side():
    """Hundreds of requests of mixed lengths through the pool (prefix caching on, every full block cached
    when freed): the requests decoding together afterwards still find most of their blocks side by side
    (in either direction: a freed request's run comes back last block first), where the front of the free
    queue alone strews them (decode attention reads them ~20% slower then)."""
    import random
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=3000, block_size=16)
    running, n = [], 0

    def admit(prompt_len: int, max_tokens: int) -> Request:
        nonlocal n
        n += 1
        prompt = [rng.randrange(1, 1000) for _ in range(prompt_len)]
        req = Request(f"q{n}", prompt, SamplingParams(max_tokens=max_tokens))
        assert kv.allocate_slots(req, prompt_len) is not None
        return req

    for _ in range(1500):  # decode steps; each keeps 32 requests of 50-500 prompt tokens and 20-200 out
        while len(running) < 32:
            running.append(admit(rng.randint(50, 500), rng.randint(20, 200)))
        for req in running:
            _decode(kv, req, 1)
        for req in [r for r in running if r.num_output_tokens >= r.sampling_params.max_tokens]:
            running.remove(req)
            req.status = RequestStatus.FINISHED_LENGTH
            kv.free(req)
    kv.pool.check_invariants()
    batch = [admit(256, 128) for _ in range(32)]
    for _ in range(64):
        for req in batch:
            _decode(kv, req, 1)
    pairs = [(t[i], t[i + 1]) for t in (kv.get_block_ids(r.request_id) for r in batch) for i in range(len(t) - 1)]
    adjacent = sum(abs(b - a) == 1 for a, b in pairs) / len(pairs)
    assert adjacent > 0.7, adjacent


def test_core_imports_no_torch():
    """core/ is plain Python over integers (STYLE.md): its modules never import torch."""
    core = pathlib.Path(__file__).resolve().parent.parent / "tidal" / "core"
    for path in list(core.glob("*.py")) + [core.parent / "request.py", core.parent / "sampling_params.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports torch"


def test_prefix_hit_always_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = Request("a", list(range(1, 9)), SamplingParams())
    kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    req.status = RequestStatus.PREEMPTED
    kv.free(req)
    req.num_computed_tokens = 0
    _, num_cached = kv.get_computed_blocks(req)
    assert num_cached < req.num_tokens
