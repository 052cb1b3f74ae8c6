"""Engine statistics: counters and latency samples for the stats log and the /metrics page, and the
periodic stats log line (StatsLogger, on unless disable_log_stats)."""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

STEP_HISTORY = 1024  # steps kept in EngineStats.step_history (the dashboard's batch of each step)


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished_reasons: dict = field(default_factory=dict)
    # speculative decoding (vLLM's spec_decode_* counters): requests x steps that ran drafts, draft
    # tokens run, draft tokens accepted; and by position (index 0: the first draft) drafts run and
    # accepted, whose ratio is the acceptance rate by position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_drafted_per_pos: list = field(default_factory=list)
    spec_accepted_per_pos: list = field(default_factory=list)
    # latency samples since the last drain (seconds)
    ttft: list = field(default_factory=list)
    tpot: list = field(default_factory=list)
    e2e: list = field(default_factory=list)
    # KV utilization: slots holding real tokens / allocated slots, summed over steps
    kv_util_sum: float = 0.0
    kv_util_steps: int = 0
    # the batch of the latest step (for the dashboard): tokens at prompt positions (prefill), the others
    # (decodes, drafts, outputs recomputed after a preemption), requests
    last_step_prefill_tokens: int = 0
    last_step_decode_tokens: int = 0
    last_step_num_requests: int = 0
    # and the same of each recent step, oldest first: (step number = num_steps after it, time.time() at its
    # end, prefill tokens, decode tokens, requests), the last STEP_HISTORY steps. Not a field: it stays in
    # the engine's process (the dashboard reads it there, steps_since) and is not sent with the stats
    # after each step; created by the first step, so a copy of the stats (decoded in the server process)
    # allocates nothing for it.
    step_history = None
    # where the steps' time goes, summed over the steps: the wall time of LLMEngine.step, and the part of
    # it spent in the model (forward and LM head, the draft model's too; see RunnerOutput.model_time_s).
    # The rest is host time: scheduling, input preparation, sampling, output processing.
    step_time_s: float = 0.0
    model_time_s: float = 0.0
    num_timed_steps: int = 0
    started: float = field(default_factory=time.time)

    def record_step(self, batch, num_sampled: int, scheduler, kv_manager) -> None:
        self.num_steps += 1
        self.num_generation_tokens += num_sampled
        # the scheduled tokens at prompt positions (not decodes, not drafts)
        prefill = sum(max(0, min(s.num_tokens, s.num_prompt_tokens - s.start_pos)) for s in batch.scheduled)
        self.num_prompt_tokens += prefill
        decode, num_requests = batch.num_batched_tokens - prefill, len(batch.scheduled)
        self.last_step_prefill_tokens, self.last_step_decode_tokens = prefill, decode
        self.last_step_num_requests = num_requests
        history = self.step_history
        if history is None:
            history = self.step_history = deque(maxlen=STEP_HISTORY)
        history.append((self.num_steps, time.time(), prefill, decode, num_requests))  # one tuple, no more
        # (the running/waiting/KV-usage gauges are read from the scheduler where shown, not copied here)
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_queries, self.prefix_hits = kv_manager.prefix_queries, kv_manager.prefix_hits
        used_blocks = kv_manager.pool.num_used_blocks
        if used_blocks:
            # A block shared through the prefix cache is in several block tables but holds its
            # tokens once; only full blocks are shared, so each extra reference over-counts a block.
            tokens = refs = 0
            held = kv_manager.req_to_blocks
            for r in scheduler.running:
                tokens += r.num_computed_tokens
                refs += len(held.get(r.request_id, ()))
            tokens -= (refs - used_blocks) * kv_manager.block_size
            self.kv_util_sum += min(1.0, tokens / (used_blocks * kv_manager.block_size))
            self.kv_util_steps += 1

    def steps_since(self, since: int = 0) -> list[tuple[int, float, int, int, int]]:
        """The recorded steps numbered above `since`, oldest first (at most the last STEP_HISTORY); read on
        the engine thread, between two steps."""
        return steps_after(self.step_history or (), since)

    def record_step_time(self, step_s: float, model_s: float) -> None:
        """One step's wall time and the model's part of it (seconds)."""
        self.step_time_s += step_s
        self.model_time_s += model_s
        self.num_timed_steps += 1

    @property
    def host_time_s(self) -> float:
        """Step time outside the model, summed over the steps (seconds)."""
        return self.step_time_s - self.model_time_s

    def record_drafts(self, drafts: list[tuple[int, int]]) -> None:
        """One step's (draft tokens run, draft tokens accepted) per request that ran drafts."""
        for num_drafts, num_accepted in drafts:
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += num_drafts
            self.spec_num_accepted_tokens += num_accepted
            grow = num_drafts - len(self.spec_drafted_per_pos)
            if grow > 0:
                self.spec_drafted_per_pos.extend([0] * grow)
                self.spec_accepted_per_pos.extend([0] * grow)
            for pos in range(num_drafts):
                self.spec_drafted_per_pos[pos] += 1
                self.spec_accepted_per_pos[pos] += pos < num_accepted

    @property
    def spec_acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.spec_accepted_per_pos, self.spec_drafted_per_pos)]

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a request gets per step that ran drafts: 1 + accepted drafts per draft run (as vLLM)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

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


def steps_after(history, since: int) -> list:
    """The entries of `history` (a sequence ordered by its entries' first item, a step number) numbered
    above `since`, oldest first; walks back from the newest, so a reader that keeps up touches only the
    few new ones."""
    if not history or history[-1][0] <= since:
        return []
    if history[0][0] > since:
        return list(history)
    out = []
    for step in reversed(history):
        if step[0] <= since:
            break
        out.append(step)
    out.reverse()
    return out


class StatsLogger:
    """Every `interval_s` seconds with activity, one line like vLLM's:

        Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.0 tokens/s, Running: 12 reqs,
        Waiting: 0 reqs, KV cache usage: 8.2%, Preemptions: 0, Prefix cache hit rate: 41.0%, Steps: 812,
        Step time: 11.2 ms (host 0.41 ms)

    The engine calls maybe_log after each step (the server also while idle, so the last busy period is
    reported); throughputs are averaged since the previous line. After vLLM's fields: the engine steps
    since the previous line and their mean wall time, of which host is the part outside the model's
    forward and LM head (scheduling, input preparation, sampling, output processing; EngineStats)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._log_time = time.monotonic()
        self._log_tokens = (0, 0)  # (prompt, generation) at the last line
        self._log_steps = (0, 0.0, 0.0)  # (timed steps, step seconds, model seconds) at the last line
        self._spec_log = SpecDecodingLog()  # with speculative decoding: vLLM's SpecDecoding line beside it

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
        steps = (stats.num_timed_steps, stats.step_time_s, stats.model_time_s)
        num_steps = steps[0] - self._log_steps[0]
        step_ms = 1000 * (steps[1] - self._log_steps[1]) / num_steps if num_steps else 0.0
        host_ms = step_ms - 1000 * (steps[2] - self._log_steps[2]) / num_steps if num_steps else 0.0
        self._log_time, self._log_tokens, self._log_steps = now, tokens, steps
        if prompt_tps == 0 and gen_tps == 0 and running == 0 and waiting == 0:
            return False  # idle: nothing worth a line
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Preemptions: %d, "
                    "Prefix cache hit rate: %.1f%%, Steps: %d, Step time: %.2f ms (host %.2f ms)", prompt_tps,
                    gen_tps, running, waiting, 100 * engine.kv_manager.usage, stats.num_preemptions,
                    100 * stats.prefix_cache_hit_rate, num_steps, step_ms, host_ms)
        self._spec_log.maybe_log(stats, elapsed)
        return True


class SpecDecodingLog:
    """vLLM's speculative-decoding log line, over the drafts since the previous one (called beside the
    periodic stats line):

        SpecDecoding metrics: Mean acceptance length: 3.41, Accepted throughput: 150.2 tokens/s, Drafted
        throughput: 210.0 tokens/s, Accepted: 1502 tokens, Drafted: 2100 tokens, Per-position acceptance
        rate: 0.880, 0.750, 0.610, 0.520, Avg Draft acceptance rate: 71.5%
    """

    def __init__(self) -> None:
        self._last = (0, 0, 0, [], [])  # the spec counters at the previous line

    def maybe_log(self, stats: EngineStats, elapsed: float) -> bool:
        """Log a line if drafts ran since the previous one (elapsed seconds ago); True if logged."""
        if stats.spec_num_drafts <= self._last[0] or elapsed <= 0:
            return False
        drafts, drafted, accepted, drafted_pos, accepted_pos = self._last
        now = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
               list(stats.spec_drafted_per_pos), list(stats.spec_accepted_per_pos))
        self._last = now
        n_drafts, n_drafted, n_accepted = now[0] - drafts, now[1] - drafted, now[2] - accepted
        per_pos = []
        for pos, (d, a) in enumerate(zip(now[3], now[4])):
            d -= drafted_pos[pos] if pos < len(drafted_pos) else 0
            a -= accepted_pos[pos] if pos < len(accepted_pos) else 0
            per_pos.append(f"{a / d:.3f}" if d else "-")
        logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.1f tokens/s, "
                    "Drafted throughput: %.1f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position "
                    "acceptance rate: %s, Avg Draft acceptance rate: %.1f%%", 1 + n_accepted / n_drafts,
                    n_accepted / elapsed, n_drafted / elapsed, n_accepted, n_drafted, ", ".join(per_pos),
                    100 * n_accepted / n_drafted if n_drafted else 0.0)
        return True
