"""The requests a simulation runs: arrival time, prompt token ids, output length.

Synthetic traffic draws prompt and output lengths from a distribution each (`Lengths`): fixed, uniform
over an inclusive range, or log-normal of a given mean (a common fit for real prompt and output lengths:
most short, a long tail); arrivals from a gamma process of the given rate (burstiness 1: Poisson;
`tidal bench serve`'s own draw, so a plan and a benchmark with the same seed see the same arrivals); and
it may start every prompt with one of a few shared prefixes (what the prefix cache can reuse). A trace
file is a JSON list (or JSON lines) of {"arrival_time": s, "prompt_len": n or "prompt_token_ids": [...],
"output_len" or "max_tokens": n}; requests without an arrival time arrive at the request rate. `at_rate`
replays a trace faster or slower (its arrival times scaled to a mean rate), as the SLO search and the
rate sweep do.

Token ids only need to make prompts distinct where they are meant to be: they are drawn from [0, 256)
(CPython's shared small ints, so a long prompt costs 8 bytes a token; 16 tokens a block make a repeat
impossible in practice).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass
class SimRequest:
    arrival_time: float
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Lengths:
    """How a workload's prompt (or output) lengths are drawn, one per request:
    - "fixed": every one `mean`;
    - "uniform": an integer uniform over [lo, hi];
    - "lognormal": exp of a normal of standard deviation `sigma` (the spread of log length), the normal's
      mean chosen so that the lengths' mean is `mean` (mu = ln(mean) - sigma^2 / 2), rounded and clamped to
      [lo, hi] (hi None: no bound but the one `synthesize` gives, the engine's max_model_len).
    `name` is the length's name in error messages."""
    dist: str = "fixed"
    mean: float = 512
    lo: int = 1
    hi: int | None = None
    sigma: float | None = None
    name: str = "length"

    def __post_init__(self) -> None:
        n = self.name
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"{n}: the distribution must be one of {', '.join(DISTRIBUTIONS)}, got {self.dist!r}")
        if self.dist == "fixed":
            if not (float(self.mean).is_integer() and self.mean >= 1):
                raise ValueError(f"{n} must be an integer >= 1, got {self.mean!r}")
        elif self.dist == "uniform":
            if self.hi is None or not 1 <= self.lo <= self.hi:
                raise ValueError(f"{n} range must be 1 <= LO <= HI, got {self.lo} {self.hi}")
        else:
            if self.sigma is None or not self.sigma > 0 or not math.isfinite(self.sigma):
                raise ValueError(f"{n} sigma (the log-normal's spread) must be > 0, got {self.sigma!r}")
            if not 1 <= self.lo <= (self.hi if self.hi is not None else self.lo):
                raise ValueError(f"{n} range must be 1 <= LO <= HI, got {self.lo} {self.hi}")
            if not self.lo <= self.mean <= (self.hi if self.hi is not None else math.inf):
                raise ValueError(f"{n} mean must be within its range [{self.lo}, {self.hi}], got {self.mean!r}")

    @classmethod
    def of(cls, value: tuple[int, int] | Lengths, name: str) -> Lengths:
        """A (LO, HI) range (LO == HI: fixed) as the uniform draw it stands for; a Lengths as it is."""
        if isinstance(value, Lengths):
            return value
        lo, hi = value
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be 1 <= LO <= HI, got {lo} {hi}")
        return cls("uniform", (lo + hi) / 2, lo, hi, name=name)

    @property
    def smallest(self) -> int:
        return int(self.mean) if self.dist == "fixed" else self.lo

    @property
    def largest(self) -> int | None:
        return int(self.mean) if self.dist == "fixed" else self.hi

    def draw(self, rng: np.random.Generator, cap: int | None = None) -> int:
        """One length; a log-normal draw is also kept within `cap` (and at least lo)."""
        if self.dist != "lognormal":  # fixed: the same draw as a range of one value (the seed's stream unchanged)
            return int(rng.integers(self.smallest, self.largest + 1))
        x = rng.lognormal(math.log(self.mean) - self.sigma ** 2 / 2, self.sigma)
        hi = min(h for h in (self.hi, cap, 2 ** 62) if h is not None)
        return int(max(self.lo, min(hi, round(x))))


@dataclass
class WorkloadSpec:
    num_requests: int = 256
    request_rate: float = float("inf")   # requests/s; inf: all arrive at once
    # prompt and output lengths: an inclusive (LO, HI) range drawn uniformly (LO == HI: fixed), or Lengths
    input_len: tuple[int, int] | Lengths = (512, 512)
    output_len: tuple[int, int] | Lengths = (128, 128)
    prefix_len: int = 0                  # shared tokens at the start of each prompt
    num_prefixes: int = 1                # distinct shared prefixes, one picked per request
    burstiness: float = 1.0
    seed: int = 0
    # the engine's max_model_len: log-normal lengths are kept within it (the prompt leaves room for the
    # longest output, or the shortest when the output is log-normal too; the output within what the prompt
    # drawn leaves)
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate!r}")
        self.input_len = Lengths.of(self.input_len, "input_len")
        self.output_len = Lengths.of(self.output_len, "output_len")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
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
    ins, outs, cap = spec.input_len, spec.output_len, spec.max_model_len
    # the output tokens a prompt leaves room for: the most a uniform or fixed output takes; a log-normal's fewest
    # (the output is then kept within what the prompt drawn leaves)
    room = outs.smallest if outs.dist == "lognormal" else outs.largest
    for t in arrivals:
        n_in = ins.draw(rng, None if cap is None else max(cap - room, 1))
        n_out = outs.draw(rng, None if cap is None else max(cap - n_in, 1))
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
