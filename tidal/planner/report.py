"""What a plan reports: memory per device, the requests that fit, throughput, latency percentiles and
preemptions of one simulation; the highest request rate meeting a latency SLO (bisection over the
rate, each point a simulation); and latency against request rate as a PNG (with matplotlib) or a table.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tidal.planner.model import ModelProfile
from tidal.planner.simulator import SimResult


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(result: SimResult) -> dict:
    """Latencies in ms, throughputs per second of simulated time (from the run's start to the last finish,
    as `tidal bench serve` measures its duration)."""
    if not result.plan.fits:
        return {"fits": False, "reason": result.plan.reason}
    recs = [r for r in result.records if r.finish_time is not None]
    ttft = [(r.first_token_time - r.arrival_time) * 1e3 for r in recs]
    tpot = [(r.finish_time - r.first_token_time) * 1e3 / (r.output_len - 1) for r in recs if r.output_len > 1]
    e2e = [(r.finish_time - r.arrival_time) * 1e3 for r in recs]
    duration = (result.end_time - result.start_time) or 1e-9
    out_tokens = sum(r.output_len for r in recs)
    in_tokens = sum(r.prompt_len for r in recs)
    s = {"fits": True, "completed": len(recs), "duration_s": duration if recs else 0.0, "num_steps": result.num_steps,
         "request_throughput": len(recs) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (in_tokens + out_tokens) / duration, "num_preemptions": result.num_preemptions,
         "max_running": result.max_running, "peak_kv_usage": result.peak_kv_usage,
         "prefix_hit_rate": result.prefix_hit_rate, "busy_fraction": result.busy_time / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2e)):
        s[f"mean_{name}_ms"] = float(np.mean(values)) if values else 0.0
        s[f"p50_{name}_ms"], s[f"p99_{name}_ms"] = _pct(values, 50), _pct(values, 99)
    return s


def requests_that_fit(profile: ModelProfile, result: SimResult, max_num_seqs: int, block_size: int,
                      context_lens: list[int]) -> list[dict]:
    """Requests of each context length held at once by the planned cache (KV blocks and state slots)."""
    plan, out = result.plan, []
    for L in context_lens:
        by_kv = plan.num_blocks // -(-L // block_size) if profile.kv_bytes_per_token else max_num_seqs
        by_slots = plan.num_state_slots or max_num_seqs
        n = min(by_kv, by_slots, max_num_seqs) if plan.fits else 0
        limit = "max_num_seqs" if n == max_num_seqs else ("KV blocks" if n == by_kv else "state slots")
        out.append({"context_len": L, "requests": n, "limited_by": limit})
    return out


def highest_rate(run: Callable[[float], dict], slo_ttft_ms: float | None, slo_tpot_ms: float | None,
                 saturation_rate: float, percentile: str = "p99", iterations: int = 12) -> tuple[float | None, dict]:
    """The highest request rate whose simulation meets the SLOs: inf when all requests arriving at once meet
    them, else a bisection in log rate between 1/1000 of the saturation rate and the first doubling of it
    that misses. Returns (rate, or
    None when even the lowest rate misses, and that rate's summary)."""
    def ok(s: dict) -> bool:
        return s.get("fits", False) and (slo_ttft_ms is None or s[f"{percentile}_ttft_ms"] <= slo_ttft_ms) \
            and (slo_tpot_ms is None or s[f"{percentile}_tpot_ms"] <= slo_tpot_ms)
    s_inf = run(float("inf"))
    if ok(s_inf):
        return float("inf"), s_inf
    lo = saturation_rate / 1000
    best = run(lo)
    if not ok(best):
        return None, best
    hi = saturation_rate
    while hi < saturation_rate * 1000:  # a short run of requests can meet it above the saturation rate
        s = run(hi)
        if not ok(s):
            break
        lo, best, hi = hi, s, hi * 2
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        s = run(mid)
        if ok(s):
            lo, best = mid, s
        else:
            hi = mid
    return lo, best


def sweep_table(points: list[tuple[float, dict]]) -> str:
    lines = [f"{'rate req/s':>10} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
             f"{'preempt':>7}"]
    for rate, s in points:
        lines.append(f"{rate:>10.3g} {s['output_throughput']:>10.1f} {s['p50_ttft_ms']:>9.1f} {s['p99_ttft_ms']:>9.1f} "
                     f"{s['p50_tpot_ms']:>9.2f} {s['p99_tpot_ms']:>9.2f} {s['num_preemptions']:>7}")
    return "\n".join(lines)


def latency_series(points: list[tuple[float, dict]]) -> dict[str, list[float]]:
    """The plot's data: the request rates, and TTFT and TPOT (ms, p50 and p99) at each."""
    series = {"rate": [r for r, _ in points]}
    for metric in ("ttft", "tpot"):
        for key in ("p50", "p99"):
            series[f"{key}_{metric}_ms"] = [s[f"{key}_{metric}_ms"] for _, s in points]
    return series


def latency_figure(points: list[tuple[float, dict]], title: str):
    """A matplotlib Figure of latency against request rate: TTFT (log scale) on the left axes, TPOT on the
    right, each p50 and p99 (lines labelled "TTFT p50" and so on). Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    series = latency_series(points)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, style in (("p50", "-o"), ("p99", "--o")):
        ax1.plot(series["rate"], series[f"{key}_ttft_ms"], style, label=f"TTFT {key}")
        ax2.plot(series["rate"], series[f"{key}_tpot_ms"], style, label=f"TPOT {key}")
    ax1.set_yscale("log")  # TTFT grows without bound past saturation (the queue); TPOT levels off
    ax1.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax2.set_ylim(bottom=0)
    for ax, what in ((ax1, "time to first token (ms)"), (ax2, "time per output token (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_latency(points: list[tuple[float, dict]], path: str, title: str) -> str | None:
    """Write latency against request rate to `path` (PNG, 1000 x 400 pixels). Returns None, or why no plot
    was written."""
    try:
        fig = latency_figure(points, title)
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
