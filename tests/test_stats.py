"""Step overhead in the engine's stats: each step's wall time and the model's part of it (forward and LM
head) are summed in EngineStats, the stats line reports their means since the previous line (`Steps: N,
Step time: X ms (host Y ms)`, after vLLM's fields) and /metrics has them as counters."""
from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from tidal import SamplingParams
from tidal.engine.stats import EngineStats, StatsLogger
from tidal.metrics import ServerMetrics

STEP_FIELDS = re.compile(r", Steps: (\d+), Step time: ([\d.]+) ms \(host ([\d.]+) ms\)$")


def _fake_engine(stats: EngineStats):
    return SimpleNamespace(stats=stats, scheduler=SimpleNamespace(num_running=1, num_waiting=0),
                           kv_manager=SimpleNamespace(usage=0.25), stats_logger=None)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Avg prompt throughput")]


def test_stats_line_averages_step_and_host_time_over_the_steps_since_the_previous_line(caplog):
    stats = EngineStats()
    engine, logger = _fake_engine(stats), StatsLogger(interval_s=0)
    stats.num_generation_tokens = 4
    stats.record_step_time(0.010, 0.008)
    stats.record_step_time(0.012, 0.007)
    with caplog.at_level(logging.INFO, logger="tidal.engine.stats"):
        assert logger.maybe_log(engine, now=logger._log_time + 1.0)
        stats.num_generation_tokens = 5
        stats.record_step_time(0.004, 0.001)
        assert logger.maybe_log(engine, now=logger._log_time + 1.0)
    first, second = _lines(caplog)
    # vLLM's fields first, as before; then the steps since the previous line
    assert first == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 4.0 tokens/s, Running: 1 reqs, "
                     "Waiting: 0 reqs, KV cache usage: 25.0%, Preemptions: 0, Prefix cache hit rate: 0.0%, "
                     "Steps: 2, Step time: 11.00 ms (host 3.50 ms)")
    assert second.endswith(", Steps: 1, Step time: 4.00 ms (host 3.00 ms)")
    assert stats.step_time_s == pytest.approx(0.026) and stats.host_time_s == pytest.approx(0.010)


def test_metrics_page_counts_step_and_host_seconds():
    stats = EngineStats()
    engine, metrics = _fake_engine(stats), ServerMetrics("m")
    stats.record_step_time(0.5, 0.25)
    metrics(engine)
    stats.record_step_time(1.0, 0.5)
    metrics(engine)
    page = metrics.render().decode()
    assert 'tidal:engine_steps_total{model_name="m"} 2.0' in page
    assert 'tidal:engine_step_seconds_total{model_name="m"} 1.5' in page
    assert 'tidal:engine_host_seconds_total{model_name="m"} 0.75' in page


def test_real_steps_time_the_model_inside_the_step_and_log_it(smollm2, caplog):
    engine = smollm2.llm_engine
    stats = engine.stats
    logger = StatsLogger(interval_s=0)
    logger.maybe_log(engine)  # the baseline: the line below covers only this test's steps
    steps0, step_s0, model_s0 = stats.num_timed_steps, stats.step_time_s, stats.model_time_s
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tok = smollm2.get_tokenizer()
    for i, prompt in enumerate(["The capital of France is", "One, two, three,"]):
        engine.add_request(f"stats-{i}", {"prompt_token_ids": tok.encode(prompt)}, params)
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    steps = stats.num_timed_steps - steps0
    step_s, model_s = stats.step_time_s - step_s0, stats.model_time_s - model_s0
    assert steps == num_steps >= 6
    assert step_s > model_s > 0, (step_s, model_s)
    assert model_s > 0.3 * step_s, "a 135M model's forwards are most of its steps on CPU"
    caplog.clear()  # the baseline line above, if the logger's level let it through
    with caplog.at_level(logging.INFO, logger="tidal.engine.stats"):
        assert logger.maybe_log(engine)
    (line,) = _lines(caplog)
    m = STEP_FIELDS.search(line)
    assert m, line
    logged_steps, step_ms, host_ms = int(m[1]), float(m[2]), float(m[3])
    assert logged_steps == num_steps
    assert step_ms == pytest.approx(1000 * step_s / steps, abs=0.01)
    assert host_ms == pytest.approx(1000 * (step_s - model_s) / steps, abs=0.01)
    assert 0 <= host_ms < step_ms
