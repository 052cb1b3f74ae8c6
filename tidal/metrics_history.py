"""The last few minutes of the server's metrics, for the live dashboard's time series.

`MetricsHistory` reads the server's Prometheus registry (tidal/metrics.py), never the engine, so it
costs the engine's step nothing and its figures are the ones /metrics shows. `sample()` (once a
second, from the event loop) appends one point:

    prompt_tps, generation_tps     tokens/s over the last `rate_window_s`
    ttft_p50/p99, tpot_p50/p99     seconds, over the requests of the last `latency_window_s`, from the
                                   histograms' buckets as Prometheus' histogram_quantile() computes them
                                   (None: no request in the window)
    kv_usage, running, waiting     the gauges now
    prefix_hit_rate                prefix-cache hits / lookups (tokens) over `rate_window_s` (None: no lookup)
    preemptions_per_s              over `rate_window_s`
    spec_acceptance                accepted / draft tokens over `rate_window_s` (None: no drafts)
"""
from __future__ import annotations

import time
from collections import deque

# short name -> the Prometheus sample summed over its labels
_COUNTERS = {
    "prompt_tokens": "tidal:prompt_tokens_total",
    "generation_tokens": "tidal:generation_tokens_total",
    "preemptions": "tidal:num_preemptions_total",
    "prefix_queries": "tidal:prefix_cache_queries_total",
    "prefix_hits": "tidal:prefix_cache_hits_total",
    "requests_finished": "tidal:request_success_total",
    "spec_draft_tokens": "tidal:spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "tidal:spec_decode_num_accepted_tokens_total",
    "running": "tidal:num_requests_running",
    "waiting": "tidal:num_requests_waiting",
    "kv_usage": "tidal:kv_cache_usage_perc",
}
_HISTOGRAMS = {"ttft": "tidal:time_to_first_token_seconds_bucket",
               "tpot": "tidal:time_per_output_token_seconds_bucket"}


def read_totals(registry) -> dict:
    """Counters and gauges by short name, and each latency histogram's cumulative buckets [(le, count)]."""
    by_name = {v: k for k, v in _COUNTERS.items()}
    by_bucket = {v: k for k, v in _HISTOGRAMS.items()}
    totals = dict.fromkeys(_COUNTERS, 0.0)
    buckets: dict[str, list] = {k: [] for k in _HISTOGRAMS}
    for family in registry.collect():
        for s in family.samples:
            if s.name in by_name:
                totals[by_name[s.name]] += s.value
            elif s.name in by_bucket:
                buckets[by_bucket[s.name]].append((float(s.labels["le"]), s.value))
    for k in buckets:
        buckets[k].sort()
    totals["buckets"] = buckets
    return totals


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate of quantile q from cumulative buckets [(upper bound, count)]: linear inside
    the bucket that holds it; the highest finite bound when it falls in +Inf. None: no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _bucket_delta(now: list, then: list) -> list:
    if not then:
        return now
    return [(b, c - c0) for (b, c), (_, c0) in zip(now, then)]


class MetricsHistory:
    def __init__(self, registry, keep_s: float = 300.0, interval_s: float = 1.0, rate_window_s: float = 5.0,
                 latency_window_s: float = 30.0) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.rate_window_s = rate_window_s
        self.latency_window_s = latency_window_s
        self.points: deque[dict] = deque(maxlen=int(keep_s / interval_s) + 1)
        # (monotonic time, totals) of recent samples: enough to reach back over the longest window
        self._totals: deque[tuple[float, dict]] = deque(maxlen=int(max(rate_window_s, latency_window_s)
                                                                    / interval_s) + 2)

    def _at_or_before(self, t: float) -> tuple[float, dict] | None:
        """The latest sample taken at or before monotonic time t (else the oldest one)."""
        best = None
        for sample in self._totals:
            if sample[0] > t and best is not None:
                break
            best = sample
        return best

    def sample(self, now: float | None = None) -> dict:
        """Read the registry and append (and return) one point."""
        mono = time.monotonic() if now is None else now
        totals = read_totals(self.registry)
        rate_then = self._at_or_before(mono - self.rate_window_s)
        lat_then = self._at_or_before(mono - self.latency_window_s)
        self._totals.append((mono, totals))
        point = {"time": time.time(), "kv_usage": totals["kv_usage"], "running": totals["running"],
                 "waiting": totals["waiting"]}
        if rate_then is None:
            point.update(prompt_tps=0.0, generation_tps=0.0, preemptions_per_s=0.0, prefix_hit_rate=None,
                         spec_acceptance=None)
        else:
            t0, then = rate_then
            dt = max(mono - t0, 1e-9)

            def delta(k):
                return totals[k] - then[k]
            point.update(prompt_tps=delta("prompt_tokens") / dt, generation_tps=delta("generation_tokens") / dt,
                         preemptions_per_s=delta("preemptions") / dt,
                         prefix_hit_rate=delta("prefix_hits") / delta("prefix_queries")
                         if delta("prefix_queries") else None,
                         spec_acceptance=delta("spec_accepted_tokens") / delta("spec_draft_tokens")
                         if delta("spec_draft_tokens") else None)
        for name in ("ttft", "tpot"):
            window = _bucket_delta(totals["buckets"][name], lat_then[1]["buckets"][name] if lat_then else [])
            point[f"{name}_p50"] = histogram_quantile(0.5, window)
            point[f"{name}_p99"] = histogram_quantile(0.99, window)
        self.points.append(point)
        return point
