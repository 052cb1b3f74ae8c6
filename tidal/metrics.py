"""Prometheus metrics of the server.

`ServerMetrics` is the AsyncLLM step hook: it runs on the engine thread after every step (and
after every batch of add/abort commands), so it reads the engine's state and its EngineStats
without races, and feeds them into a Prometheus registry (prometheus_client is thread-safe, so
the /metrics handler renders it from the event loop). Names follow vLLM's, under `tidal:`:

    tidal:num_requests_running / num_requests_waiting / kv_cache_usage_perc     gauges
    tidal:prompt_tokens_total / generation_tokens_total / num_preemptions_total counters
    tidal:request_success_total{finished_reason}                                 counter
    tidal:prefix_cache_queries_total / prefix_cache_hits_total                   counters (tokens)
    tidal:spec_decode_num_drafts_total / spec_decode_num_draft_tokens_total /
    tidal:spec_decode_num_accepted_tokens_total, and
    tidal:spec_decode_num_accepted_tokens_per_pos_total{position}                  counters (speculative decoding)
    tidal:engine_step_seconds_total / engine_host_seconds_total / engine_steps_total  counters (Tidal's own:
        the wall time of the engine's steps, its part outside the model, and the steps; see EngineStats)
    tidal:time_to_first_token_seconds, tidal:inter_token_latency_seconds,
    tidal:time_per_output_token_seconds (per request), tidal:e2e_request_latency_seconds  histograms

It also gives the engine's stats logger (tidal/engine/stats.py; absent under --disable-log-stats) its
turn while the engine is idle, so the line for the end of a busy period is not lost.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for it read the same.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"tidal:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"tidal:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"tidal:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be admitted.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks held by requests (0-1).")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Requests x steps that ran draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens run.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.step_seconds = counter("engine_step_seconds", "Wall time of the engine's steps (seconds).")
        self.host_seconds = counter("engine_host_seconds", "Step time outside the model's forward and LM head: "
                                    "scheduling, input preparation, sampling, output processing (seconds).")
        self.steps = counter("engine_steps", "Engine steps.")
        self._spec_per_pos = Counter("tidal:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft (0: the first).",
                                     labels + ["position"], registry=r)
        self._success = Counter("tidal:request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):  # present (at 0) from the start, as in vLLM
            self._success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive outputs of a request.",
                             _TPOT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token of a request.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS)
        self._seen: dict[str, float] = {}  # last value of each cumulative EngineStats counter
        self._last_output_time: dict[str, float] = {}
        self._num_tokens: dict[str, dict[int, int]] = {}  # request -> sample index -> tokens so far

    # -- the step hook (engine thread) -----------------------------------------------------------
    def __call__(self, engine, outputs=()) -> None:
        now = time.monotonic()
        for out in outputs:
            self._observe_output(out, now)
        stats = engine.stats
        # Gauges from the live state: an abort between steps must show at once.
        self.running.set(engine.scheduler.num_running)
        self.waiting.set(engine.scheduler.num_waiting)
        self.kv_usage.set(engine.kv_manager.usage)
        self._advance(self.prompt_tokens, "prompt", stats.num_prompt_tokens)
        self._advance(self.generation_tokens, "generation", stats.num_generation_tokens)
        self._advance(self.preemptions, "preemptions", stats.num_preemptions)
        self._advance(self.prefix_queries, "prefix_queries", stats.prefix_queries)
        self._advance(self.prefix_hits, "prefix_hits", stats.prefix_hits)
        self._advance(self.spec_drafts, "spec_drafts", stats.spec_num_drafts)
        self._advance(self.spec_draft_tokens, "spec_draft_tokens", stats.spec_num_draft_tokens)
        self._advance(self.spec_accepted_tokens, "spec_accepted_tokens", stats.spec_num_accepted_tokens)
        self._advance(self.step_seconds, "step_seconds", stats.step_time_s)
        self._advance(self.host_seconds, "host_seconds", stats.host_time_s)
        self._advance(self.steps, "steps", stats.num_timed_steps)
        for pos, count in enumerate(list(stats.spec_accepted_per_pos)):
            self._advance(self._spec_per_pos.labels(self._model_name, str(pos)), f"spec_pos:{pos}", count)
        for reason, count in list(stats.finished_reasons.items()):
            if reason is not None:
                self._advance(self._success.labels(self._model_name, reason), f"finished:{reason}", count)
        # Latency samples are appended on this thread too: swap the lists, then observe. (TPOT is
        # measured here from the outputs: the server's delta outputs do not carry a token count.)
        for samples, hist in (("ttft", self.ttft), ("tpot", None), ("e2e", self.e2e)):
            values = getattr(stats, samples)
            setattr(stats, samples, [])
            for v in values if hist is not None else ():
                hist.observe(v)
        if engine.stats_logger is not None:
            engine.stats_logger.maybe_log(engine, now)

    def _observe_output(self, out, now: float) -> None:
        """Inter-token latency (one sample per output of a running request) and, when it finishes,
        the request's mean time per output token."""
        rid = out.request_id
        last = self._last_output_time.get(rid)
        if last is not None:
            self.itl.observe(now - last)
        counts = self._num_tokens.setdefault(rid, {})
        for o in out.outputs:
            counts[o.index] = counts.get(o.index, 0) + len(o.token_ids)
        if not out.finished:
            self._last_output_time[rid] = now
            return
        self._last_output_time.pop(rid, None)
        num_tokens = max(self._num_tokens.pop(rid).values(), default=0)
        m = out.metrics
        if m is not None and m.first_token_time is not None and m.last_token_time is not None and num_tokens > 1:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (num_tokens - 1))

    def _advance(self, counter, key: str, value: float) -> None:
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[key] = value

    # -- the /metrics page (event loop) ----------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
