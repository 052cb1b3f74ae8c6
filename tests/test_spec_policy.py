"""The draft policy: a step runs drafts only where the measured acceptance pays for the measured cost
of the extra rows - all of them while rows are cheap and drafts land, none once the step is
compute-bound or drafts keep failing - and the speculative-decoding metrics (stats, /metrics names
as vLLM's spec_decode_*, the SpecDecoding log line)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tidal.engine.stats import EngineStats, StatsLogger
from tidal.metrics import ServerMetrics
from tidal.request import Request
from tidal.sampling_params import SamplingParams
from tidal.spec_decode.policy import DraftPolicy, StepCostModel


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(n)]


def _policy(step_ms, max_drafts: int = 4, **kw) -> DraftPolicy:
    """A policy whose cost model has seen steps of 1..80 tokens costing step_ms(tokens)."""
    policy = DraftPolicy(max_drafts, **kw)
    for t in range(1, 81):
        policy.observe_step(t, step_ms(t) / 1000)
    return policy


def _memory_bound(t):  # the default model on 2 CPU cores: flat at first, then compute-bound
    return 10.0 + 3.0 * (t > 1) + 0.35 * max(0, t - 8)


def test_cost_model_interpolates_and_extrapolates_what_it_measured():
    cost = StepCostModel()
    assert cost.cost(5) == 0 and not cost.measured
    cost.observe(2, 0.010)
    cost.observe(10, 0.018)
    assert cost.cost(6) == pytest.approx(0.014)
    assert cost.cost(1) == pytest.approx(0.010)      # never cheaper than the smallest measured
    assert cost.cost(20) == pytest.approx(0.028)     # the measured slope (1 ms per token) continues
    cost.observe(10, 0.028)
    assert cost.cost(10) == pytest.approx(0.020)     # a moving average, not the last sample


def test_a_lone_request_with_good_drafts_runs_all_of_them():
    policy = _policy(_memory_bound)
    (r,) = _requests(1)
    for _ in range(10):
        policy.observe_drafts(r, 4, 4)
    assert policy.choose([(r, [5, 6, 7, 8, 9])], num_sampling=1, num_tokens=1) == [4]


def test_drafts_that_keep_failing_stop_being_run():
    policy = _policy(lambda t: 10.0 + 0.8 * t)  # each row costs 8% of a one-token step
    good, bad = _requests(2)
    for _ in range(10):
        policy.observe_drafts(good, 4, 3)
        policy.observe_drafts(bad, 4, 0)
    assert policy.acceptance_rate(bad) < 0.2 < 0.6 < policy.acceptance_rate(good)
    assert policy.choose([(good, [1, 2, 3, 4]), (bad, [1, 2, 3, 4])], num_sampling=2, num_tokens=2) == [4, 0]


def test_a_compute_bound_step_runs_no_drafts():
    policy = _policy(lambda t: 2.0 * t)  # every row costs as much as the first: no row is cheap
    reqs = _requests(8)
    for r in reqs:
        policy.observe_drafts(r, 4, 2)
    assert policy.choose([(r, [1, 2, 3]) for r in reqs], num_sampling=8, num_tokens=8) == [0] * 8


def test_a_large_batch_runs_fewer_drafts_than_a_small_one():
    policy = _policy(_memory_bound)
    reqs = _requests(16)
    for r in reqs:
        for _ in range(5):
            policy.observe_drafts(r, 4, 2)
    one = sum(policy.choose([(reqs[0], [1, 2, 3, 4])], 1, 1))
    many = sum(policy.choose([(r, [1, 2, 3, 4]) for r in reqs], 16, 16)) / 16
    assert one == 4 and many < one


def test_drafts_wait_for_a_measured_plain_step_and_a_draft_models_forwards_are_costed():
    # a draft model at batch 8 whose drafts are nearly always accepted
    policy = DraftPolicy(4)
    policy.observe_step(240, 0.150)  # the prompts' step
    reqs = _requests(8)
    for r in reqs:
        policy.observe_drafts(r, 4, 4)
    proposals = [(r, [1, 2, 3, 4]) for r in reqs]
    assert policy.choose(proposals, 8, 8) == [0] * 8, "no step of at most 8 tokens measured yet"
    policy.observe_step(8, 0.012)   # the target: 12 ms for 8 tokens, 26 ms for 40
    policy.observe_step(40, 0.026)
    assert sum(policy.choose(proposals, 8, 8)) == 32, "no draft forward measured: drafts look cheap"
    for _ in range(3):  # then the draft's forwards: 15 ms for 8 rows, 8 ms for one
        policy.observe_draft_forward(8, 0.015)
        policy.observe_draft_forward(1, 0.008)
    assert policy.choose(proposals, 8, 8) == [0] * 8, "four 15 ms forwards cost more than they save"
    # one request: the target's step costs 9 ms for 1 token and 12 ms for 5; a draft forward 8 ms does
    # not pay for 3.7 expected tokens (4.7 in 44 ms against 1 in 9), one of 2 ms does
    policy.observe_step(1, 0.009)
    policy.observe_step(5, 0.012)
    assert policy.choose(proposals[:1], 1, 1) == [0]
    for _ in range(30):
        policy.observe_draft_forward(1, 0.002)
        policy.observe_draft_forward(40, 0.030)
    assert policy.choose(proposals[:1], 1, 1) == [4]
    # unless its first forward must first catch up on 40 tokens it has not seen (30 ms)
    assert policy.choose(proposals[:1], 1, 1, catch_up=[40]) == [0]


def test_disable_by_batch_size_and_non_adaptive():
    policy = _policy(lambda t: 2.0 * t, disable_by_batch_size=4, adaptive=False)
    assert policy.wants_drafts(3) and not policy.wants_drafts(4)
    (r,) = _requests(1)
    assert policy.choose([(r, [1, 2, 3, 4, 5, 6])], 1, 1) == [4], "non-adaptive: everything found, up to k"


def test_stats_count_drafts_by_position():
    stats = EngineStats()
    stats.record_drafts([(3, 3), (3, 1), (2, 0)])
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (3, 8, 4)
    assert stats.spec_drafted_per_pos == [3, 3, 2] and stats.spec_accepted_per_pos == [2, 1, 1]
    assert stats.spec_acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert stats.spec_mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_metrics_page_and_log_line_carry_the_spec_decode_counters(caplog):
    stats = EngineStats()
    engine = SimpleNamespace(stats=stats, scheduler=SimpleNamespace(num_running=1, num_waiting=0),
                             kv_manager=SimpleNamespace(usage=0.1), stats_logger=None)
    metrics = ServerMetrics("m")
    stats.num_generation_tokens = 9
    stats.record_drafts([(4, 4), (4, 1)])
    with caplog.at_level(logging.INFO, logger="tidal.engine.stats"):
        metrics(engine)
        assert StatsLogger(interval_s=0).maybe_log(engine)  # the periodic line, and the SpecDecoding one beside it
    page = metrics.render().decode()
    assert 'tidal:spec_decode_num_drafts_total{model_name="m"} 2.0' in page
    assert 'tidal:spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in page
    assert 'tidal:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in page
    assert 'tidal:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0' in page
    assert 'tidal:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 1.0' in page
    line = next(r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage())
    assert "Mean acceptance length: 3.50" in line and "Per-position acceptance rate: 1.000, 0.500, 0.500, 0.500" in line
