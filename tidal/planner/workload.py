"""The requests a simulation runs: arrival time, prompt token ids, output length.

Synthetic traffic draws prompt and output lengths uniformly from inclusive ranges, arrivals from a
gamma process of the given rate (burstiness 1: Poisson; `tidal bench serve`'s own draw, so a plan and
a benchmark with the same seed see the same arrivals), and may start every prompt with one of a few
shared prefixes (what the prefix cache can reuse). A trace file is a JSON list (or JSON lines) of
{"arrival_time": s, "prompt_len": n or "prompt_token_ids": [...], "output_len" or "max_tokens": n};
requests without an arrival time arrive at the request rate. `at_rate` replays a trace faster or slower
(its arrival times scaled to a mean rate), as the SLO search and the rate sweep do.

Token ids only need to make prompts distinct where they are meant to be: they are drawn from [0, 256)
(CPython's shared small ints, so a long prompt costs 8 bytes a token; 16 tokens a block make a repeat
impossible in practice).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass
class SimRequest:
    arrival_time: float
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class WorkloadSpec:
    num_requests: int = 256
    request_rate: float = float("inf")   # requests/s; inf: all arrive at once
    input_len: tuple[int, int] = (512, 512)
    output_len: tuple[int, int] = (128, 128)
    prefix_len: int = 0                  # shared tokens at the start of each prompt
    num_prefixes: int = 1                # distinct shared prefixes, one picked per request
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate!r}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= LO <= HI, got {lo} {hi}")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise ValueError(f"prefix_len must be >= 0 and num_prefixes >= 1, got {self.prefix_len}, "
                             f"{self.num_prefixes}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (s) as `tidal bench serve` sends them: a gap before each request, the first included."""
    from tidal.benchmarks.serve import arrival_delays
    return np.cumsum(arrival_delays(n, rate, burstiness, seed)).tolist()


def synthesize(spec: WorkloadSpec) -> list[SimRequest]:
    rng = np.random.default_rng(spec.seed)
    prefixes = [rng.integers(0, 256, spec.prefix_len).tolist() for _ in range(spec.num_prefixes)]
    arrivals = arrival_times(spec.num_requests, spec.request_rate, spec.burstiness, spec.seed)
    out = []
    for t in arrivals:
        n_in = int(rng.integers(spec.input_len[0], spec.input_len[1] + 1))
        n_out = int(rng.integers(spec.output_len[0], spec.output_len[1] + 1))
        prefix = prefixes[int(rng.integers(len(prefixes)))] if spec.prefix_len else []
        out.append(SimRequest(t, prefix + rng.integers(0, 256, max(n_in - len(prefix), 1)).tolist(), n_out))
    return out


def from_requests(requests: list[dict], request_rate: float = float("inf"), burstiness: float = 1.0,
                  seed: int = 0) -> list[SimRequest]:
    """Requests as the benchmarks give them ({"prompt_token_ids", "max_tokens"}), at the given rate."""
    arrivals = arrival_times(len(requests), request_rate, burstiness, seed)
    return [SimRequest(t, list(r["prompt_token_ids"]), int(r["max_tokens"])) for t, r in zip(arrivals, requests)]


def load_trace(path: str, request_rate: float = float("inf"), seed: int = 0) -> list[SimRequest]:
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:  # JSON lines
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no requests")
    rng = np.random.default_rng(seed)
    default_arrivals = arrival_times(len(rows), request_rate, 1.0, seed)
    out = []
    for i, row in enumerate(rows):
        ids = row.get("prompt_token_ids")
        if ids is None:
            if "prompt_len" not in row:
                raise ValueError(f"{path}: request {i} has neither prompt_token_ids nor prompt_len")
            ids = rng.integers(0, 256, int(row["prompt_len"])).tolist()
        n_out = row.get("max_tokens", row.get("output_len"))
        if n_out is None or int(n_out) < 1 or not ids:
            raise ValueError(f"{path}: request {i} needs a prompt and max_tokens (or output_len) >= 1")
        out.append(SimRequest(float(row.get("arrival_time", default_arrivals[i])), list(ids), int(n_out)))
    out.sort(key=lambda r: r.arrival_time)
    return out


def at_rate(requests: list[SimRequest], rate: float) -> list[SimRequest]:
    """The same requests with arrival times scaled so that they arrive at `rate` per second on average
    (inf: all at once)."""
    span = max(r.arrival_time for r in requests)
    if rate == float("inf") or span <= 0:
        scale = 0.0
    else:
        scale = len(requests) / span / rate
    return [SimRequest(r.arrival_time * scale, r.prompt_token_ids, r.max_tokens) for r in requests]
