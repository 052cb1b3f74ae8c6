"""Scheduler properties (pure Python: no model, no tensors). Random workloads are driven through
Scheduler.schedule() / update() with fake sampled tokens, as the engine drives them, with random
aborts and small KV pools that force preemption, with chunked prefill on and off. Every step must
respect max_num_batched_tokens and max_num_seqs, give each scheduled request the blocks its tokens
need, keep the pool consistent and, without chunked prefill, schedule every prompt whole; requests are
admitted first-come-first-served; every request finishes with exactly its max_tokens (or is aborted);
and all blocks are free at the end."""
from __future__ import annotations

from functools import partial

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers import WorkerMirror
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler
from tidal.engine.stop_checker import append_tokens
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams

EOS = 0


def fake_token(request_id: str, position: int) -> int:
    # deterministic, never EOS; a 3-token alphabet makes requests share prefixes
    return 1 + (sum(map(ord, request_id)) + position) % 3


def update(scheduler: Scheduler, batch, sampled: dict[str, int]) -> list:
    """Scheduler.update as the engine calls it, with one sampled token per request and the engine's
    stop checker (no text: no stop strings)."""
    return scheduler.update(batch, {rid: [t] for rid, t in sampled.items()},
                            partial(append_tokens, max_model_len=scheduler.max_model_len))


def make_request(i: int, prompt: list[int], max_tokens: int, **params) -> Request:
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,),
                   arrival_time=float(i))


def run_to_completion(scheduler: Scheduler, arrivals: dict[int, list[Request]], aborts: dict[int, int],
                      max_steps: int = 5000):
    """Drive the scheduler as LLMEngine.step does and check per-step properties. Returns the ids in
    order of first admission and the requests in order of arrival."""
    kv = scheduler.kv
    bs = kv.block_size
    admission_order: list[str] = []
    all_requests: list[Request] = []
    mirror = WorkerMirror()
    step = 0
    while step < max_steps:
        for req in arrivals.get(step, []):
            scheduler.add_request(req)
            all_requests.append(req)
        if step in aborts and scheduler.requests:
            victim = sorted(scheduler.requests)[aborts[step] % len(scheduler.requests)]
            scheduler.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        if not scheduler.has_unfinished_requests() and step > max(arrivals, default=0):
            break
        batch = scheduler.schedule()
        mirror.apply(batch)
        # -- per-step properties --
        assert batch.num_batched_tokens == sum(sr.num_tokens for sr in batch.scheduled)
        assert batch.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(batch.scheduled) <= scheduler.max_num_seqs
        assert scheduler.num_running <= scheduler.max_num_seqs
        assert len({sr.request_id for sr in batch.scheduled}) == len(batch.scheduled)
        for sr in batch.scheduled:
            req = scheduler.requests[sr.request_id]
            assert req.status == RequestStatus.RUNNING
            assert sr.num_tokens >= 1
            assert mirror.step_tokens(sr) == req.all_token_ids[sr.start_pos:sr.start_pos + sr.num_tokens]
            assert mirror.tokens[sr.request_id] == req.all_token_ids, "the workers' copy is whole"
            end = sr.start_pos + sr.num_tokens
            assert mirror.blocks[sr.request_id] == kv.get_block_ids(sr.request_id)
            assert len(mirror.blocks[sr.request_id]) == -(-end // bs), \
                "a request holds exactly the blocks its tokens need"
            assert sr.sample == (end == req.num_tokens)
            if not scheduler.enable_chunked_prefill:
                assert sr.sample, "without chunked prefill a prompt is computed whole in one step"
            if sr.request_id not in admission_order:
                admission_order.append(sr.request_id)
        in_tables = [b for r in scheduler.running for b in kv.get_block_ids(r.request_id)]
        for b in set(in_tables):
            assert kv.pool.blocks[b].ref_cnt == in_tables.count(b)
        kv.pool.check_invariants()
        sampled = {sr.request_id: fake_token(sr.request_id, sr.start_pos + sr.num_tokens)
                   for sr in batch.scheduled if sr.sample}
        update(scheduler, batch, sampled)
        step += 1
    assert step < max_steps, "the scheduler stopped making progress"
    return admission_order, all_requests


workload = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(1, 32),
    "extra_blocks": st.integers(0, 4),  # few spare blocks: concurrent requests force preemption
    "caching": st.booleans(),
    "chunked": st.booleans(),
    # prompt lengths uniform up to max_model_len - 1: long prompts are common (chunked, or waiting whole)
    "requests": st.lists(st.tuples(st.integers(1, 39).flatmap(lambda n: st.lists(st.integers(1, 3), min_size=n,
                                                                                  max_size=n)),  # prompt
                                   st.integers(1, 20),                                     # max_tokens
                                   st.integers(0, 6)),                                     # arrival step
                         min_size=1, max_size=10),
    "aborts": st.dictionaries(st.integers(0, 40), st.integers(0, 100), max_size=3),
})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workload)
def test_random_workloads_finish_within_limits_and_free_every_block(w):
    max_model_len = 40
    bs = w["block_size"]
    num_blocks = -(-max_model_len // bs) + w["extra_blocks"]  # the engine guarantees one full request fits
    kv = KVCacheManager(num_blocks, bs, enable_caching=w["caching"])
    budget = w["max_num_batched_tokens"]
    if not w["chunked"]:  # the engine makes the budget hold a whole max_model_len prompt
        budget = max_model_len + budget // 8
    scheduler = Scheduler(kv, w["max_num_seqs"], budget, max_model_len, enable_chunked_prefill=w["chunked"])
    arrivals: dict[int, list[Request]] = {}
    for i, (prompt, max_tokens, at) in enumerate(w["requests"]):
        arrivals.setdefault(at, []).append(make_request(i, prompt, max_tokens))
    admission_order, requests = run_to_completion(scheduler, arrivals, w["aborts"])
    event("preempted" if scheduler.num_preemptions else "no preemption")

    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    for req in requests:
        assert req.is_finished
        if req.status != RequestStatus.FINISHED_ABORTED:
            assert req.status == RequestStatus.FINISHED_LENGTH
            expected = min(req.sampling_params.max_tokens, max_model_len - req.num_prompt_tokens)
            assert req.num_output_tokens == expected
            assert req.output_token_ids == [fake_token(req.request_id, req.num_prompt_tokens + k)
                                            for k in range(req.num_output_tokens)]
    # FCFS: requests are first admitted in the order they arrived (none overtakes a waiting one)
    assert admission_order == [r.request_id for r in requests if r.request_id in admission_order]
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == num_blocks
    assert not kv.req_to_blocks


def test_long_prompt_is_chunked_while_decodes_keep_running():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128)
    short = make_request(0, [1, 2, 3], max_tokens=20)
    scheduler.add_request(short)
    batch = scheduler.schedule()
    update(scheduler, batch, {"r0": 5})
    long = make_request(1, list(range(1, 41)), max_tokens=2)
    scheduler.add_request(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = scheduler.schedule()
        by_id = {sr.request_id: sr for sr in batch.scheduled}
        assert by_id["r0"].num_tokens == 1, "the decode runs in every step"
        chunks.append(by_id["r1"].num_tokens)
        assert batch.num_batched_tokens <= 8
        update(scheduler, batch, {sr.request_id: 5 for sr in batch.scheduled if sr.sample})
    assert chunks == [7] * 5 + [5]
    assert sum(chunks) == 40


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it_whole():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=40, max_model_len=64,
                          enable_chunked_prefill=False)
    short = make_request(0, [1, 2, 3], max_tokens=3)
    scheduler.add_request(short)
    update(scheduler, scheduler.schedule(), {"r0": 5})
    long, behind = make_request(1, list(range(1, 41)), max_tokens=2), make_request(2, [7, 8], max_tokens=2)
    scheduler.add_request(long)
    scheduler.add_request(behind)
    steps = []
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        steps.append({sr.request_id: sr.num_tokens for sr in batch.scheduled})
        update(scheduler, batch, {sr.request_id: 5 for sr in batch.scheduled if sr.sample})
    # the decode takes 1 of the 40 tokens, so the 40-token prompt waits (and r2 behind it) until r0 ends
    assert steps[:3] == [{"r0": 1}, {"r0": 1}, {"r1": 40}]
    assert steps[3] == {"r1": 1, "r2": 2}
    assert kv.pool.num_free_blocks == 64


def test_without_chunked_prefill_a_prefix_hit_schedules_the_uncached_rest_whole():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=64,
                          enable_chunked_prefill=False)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    first = make_request(0, prefix + [9], max_tokens=1)
    scheduler.add_request(first)
    update(scheduler, scheduler.schedule(), {"r0": 5})
    assert first.is_finished
    second = make_request(1, prefix + list(range(10, 30)), max_tokens=1)  # 28 tokens, 8 of them cached
    scheduler.add_request(second)
    batch = scheduler.schedule()
    [sr] = batch.scheduled
    assert (sr.start_pos, sr.num_tokens, sr.sample) == (8, 20, True)
    assert second.num_cached_tokens == 8
    update(scheduler, batch, {"r1": 5})
    assert second.is_finished and kv.pool.num_free_blocks == 64


def test_max_num_seqs_caps_running_and_admits_in_order():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64)
    for i in range(5):
        scheduler.add_request(make_request(i, [1, 2, 3, i + 1], max_tokens=3))
    order = []
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        assert len(batch.scheduled) <= 2
        for sr in batch.scheduled:
            if sr.request_id not in order:
                order.append(sr.request_id)
        update(scheduler, batch, {sr.request_id: 7 for sr in batch.scheduled if sr.sample})
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    assert kv.pool.num_free_blocks == 64


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    block_size = 2
    kv = KVCacheManager(6, block_size, enable_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=12)
    reqs = [make_request(i, [1, 2, 3, 4], max_tokens=8) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
    batch = scheduler.schedule()  # all three prefills: 2 blocks each, pool exhausted
    assert [sr.request_id for sr in batch.scheduled] == ["r0", "r1", "r2"]
    update(scheduler, batch, {sr.request_id: 5 for sr in batch.scheduled})
    batch = scheduler.schedule()  # r0 needs a third block: r2 (newest) is preempted
    assert batch.preempted_ids == ["r2"]
    assert scheduler.waiting[0] is reqs[2] and reqs[2].status == RequestStatus.PREEMPTED
    assert reqs[2].num_computed_tokens == 0 and reqs[2].output_token_ids == [5]
    assert scheduler.num_preemptions == 1


def test_eos_and_stop_token_ids_finish_after_min_tokens():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    eos = make_request(0, [1, 2], max_tokens=10)
    stop = make_request(1, [1, 2], max_tokens=10, stop_token_ids=[9], min_tokens=2)
    ignore = make_request(2, [1, 2], max_tokens=3, ignore_eos=True)
    for r in (eos, stop, ignore):
        scheduler.add_request(r)
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        update(scheduler, batch, {sr.request_id: {"r0": EOS, "r1": 9, "r2": EOS}[sr.request_id]
                                 for sr in batch.scheduled if sr.sample})
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [EOS]
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.output_token_ids == [9, 9]
    assert stop.stop_reason == 9
    assert ignore.status == RequestStatus.FINISHED_LENGTH and ignore.output_token_ids == [EOS] * 3
    assert kv.pool.num_free_blocks == 16


def test_abort_of_waiting_and_running_requests_frees_blocks():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    running, waiting = make_request(0, [1] * 9, 5), make_request(1, [2] * 9, 5)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    batch = scheduler.schedule()
    assert [sr.request_id for sr in batch.scheduled] == ["r0"] and kv.pool.num_free_blocks < 16
    scheduler.finish_request("r1", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    assert update(scheduler, batch, {"r0": 4}) == []  # its token arrives after the abort: dropped
    assert running.output_token_ids == [] and not scheduler.has_unfinished_requests()
    assert kv.pool.num_free_blocks == 16
    assert scheduler.schedule().finished_ids == ["r1", "r0"]


def test_a_request_id_in_use_is_refused_not_replaced():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    first = make_request(0, [1] * 9, 5)
    scheduler.add_request(first)
    scheduler.schedule()
    with pytest.raises(ValueError, match="request_id 'r0' is already in use"):
        scheduler.add_request(make_request(0, [2] * 3, 5))
    assert scheduler.requests["r0"] is first and list(scheduler.waiting) == [] and scheduler.running == [first]
    scheduler.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request(0, [2] * 3, 5))  # free again once finished
    assert kv.pool.num_free_blocks == 16
