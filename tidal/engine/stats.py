"""Engine statistics: counters and latency samples for the stats log and the /metrics page, and the
periodic stats log line (StatsLogger, on unless disable_log_stats)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished_reasons: dict = field(default_factory=dict)
    # latency samples since the last drain (seconds)
    ttft: list = field(default_factory=list)
    tpot: list = field(default_factory=list)
    e2e: list = field(default_factory=list)
    # KV utilization: slots holding real tokens / allocated slots, summed over steps
    kv_util_sum: float = 0.0
    kv_util_steps: int = 0
    started: float = field(default_factory=time.time)

    def record_step(self, batch, num_sampled: int, scheduler, kv_manager) -> None:
        self.num_steps += 1
        self.num_generation_tokens += num_sampled
        # the scheduled tokens at prompt positions (not decodes, not drafts)
        self.num_prompt_tokens += sum(max(0, min(s.num_tokens, s.num_prompt_tokens - s.start_pos))
                                      for s in batch.scheduled)
        self.num_running, self.num_waiting = scheduler.num_running, scheduler.num_waiting
        self.kv_usage = kv_manager.usage
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_queries, self.prefix_hits = kv_manager.prefix_queries, kv_manager.prefix_hits
        used_blocks = kv_manager.pool.num_used_blocks
        if used_blocks:
            tokens = sum(r.num_computed_tokens for r in scheduler.running)
            # A block shared through the prefix cache is in several block tables but holds its
            # tokens once; only full blocks are shared, so each extra reference over-counts a block.
            refs = sum(len(kv_manager.req_to_blocks.get(r.request_id, ())) for r in scheduler.running)
            tokens -= (refs - used_blocks) * kv_manager.block_size
            self.kv_util_sum += min(1.0, tokens / (used_blocks * kv_manager.block_size))
            self.kv_util_steps += 1

    def record_finished(self, out) -> None:
        for o in out.outputs:
            self.finished_reasons[o.finish_reason] = self.finished_reasons.get(o.finish_reason, 0) + 1
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        self.ttft.append(m.first_token_time - m.arrival_time)
        end = m.finished_time or m.last_token_time
        self.e2e.append(end - m.arrival_time)
        n = m.num_generation_tokens  # not the output's tokens: a delta output carries only the last ones
        if n > 1:
            self.tpot.append((m.last_token_time - m.first_token_time) / (n - 1))

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up (0 before any)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def kv_utilization(self) -> float:
        return self.kv_util_sum / self.kv_util_steps if self.kv_util_steps else 0.0


class StatsLogger:
    """Every `interval_s` seconds with activity, one line like vLLM's:

        Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.0 tokens/s, Running: 12 reqs,
        Waiting: 0 reqs, KV cache usage: 8.2%, Preemptions: 0, Prefix cache hit rate: 41.0%

    The engine calls maybe_log after each step (the server also while idle, so the last busy period is
    reported); throughputs are averaged since the previous line."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._log_time = time.monotonic()
        self._log_tokens = (0, 0)  # (prompt, generation) at the last line

    def maybe_log(self, engine, now: float | None = None) -> bool:
        """Log a line if interval_s has passed since the last one and there was work; True if logged."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._log_time
        if elapsed < self.interval_s:
            return False
        stats = engine.stats
        tokens = (stats.num_prompt_tokens, stats.num_generation_tokens)
        running, waiting = engine.scheduler.num_running, engine.scheduler.num_waiting
        prompt_tps = (tokens[0] - self._log_tokens[0]) / elapsed
        gen_tps = (tokens[1] - self._log_tokens[1]) / elapsed
        self._log_time, self._log_tokens = now, tokens
        if prompt_tps == 0 and gen_tps == 0 and running == 0 and waiting == 0:
            return False  # idle: nothing worth a line
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Preemptions: %d, "
                    "Prefix cache hit rate: %.1f%%", prompt_tps, gen_tps, running, waiting,
                    100 * engine.kv_manager.usage, stats.num_preemptions, 100 * stats.prefix_cache_hit_rate)
        return True
