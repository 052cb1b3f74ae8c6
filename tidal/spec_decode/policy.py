"""DraftPolicy: how many draft tokens each request runs in a step, or none.

A draft costs one more row in the step's forward and pays only when the model accepts it. Both
sides are measured, never assumed:

- **Cost**: `StepCostModel` keeps the wall time of the engine's steps by the number of tokens they
  computed (an exponential moving average per token count), and reads a step of T tokens off it,
  interpolating between measured counts. On a CPU a decode step streams every weight once whatever
  its rows, so a few extra rows cost little at batch 1 (10.1 ms for 1 token, 13.0 ms for 5 with the
  default model on 2 Zen 4 cores) and a lot once the step is compute-bound (13.4 ms for 8 tokens,
  26.5 ms for 40).
- **A draft model's forwards** (k per step with k drafts) are timed apart, by the tokens each computes,
  and taken out of the step's time, so the target's curve stays the target's and a draft's cost is
  counted per forward (at batch 8, an int8 draft's four forwards cost more than the tokens they save).
- **Acceptance**: per request, the share of draft positions the model accepted (a position counts
  when every draft before it was accepted), shrunk toward the engine-wide rate while the request has
  few samples. Draft j of a request is accepted with probability alpha^j, which is what it adds to
  the step's expected tokens.

Each step, for D = 0, 1, ... drafts in all (taken greedily by expected gain, which is optimal for a
given D since each request's gains fall with position), the policy picks the D that maximises
expected tokens per second, (num_sampling_requests + gain(D)) / cost(T0 + D). A step that is already
compute-bound, or requests whose drafts keep failing, get none. Until a step of at most T0 tokens has
been measured, the step runs without drafts, so that the choice always weighs drafts against a measured
plain step (otherwise the cost of T0 tokens would be read off a larger step, one that may have paid for
a draft model's forwards, and drafting would look free). A step where no proposer finds
anything costs a few dictionary look-ups.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.request import Request


class StepCostModel:
    """Step wall time as a function of the tokens it computes, measured online.

    Until a token count has been seen, its cost is interpolated between the nearest measured counts,
    or extrapolated above the largest with the slope of the measured points, at least `prior_slope`
    of the largest one's cost per token: optimistic enough that drafts get tried, and then measured."""

    def __init__(self, smoothing: float = 0.2, prior_slope: float = 0.03) -> None:
        self.smoothing = smoothing
        self.prior_slope = prior_slope
        self._counts: list[int] = []       # measured token counts, sorted
        self._seconds: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or seconds <= 0:
            return
        old = self._seconds.get(num_tokens)
        if old is None:
            bisect.insort(self._counts, num_tokens)
            self._seconds[num_tokens] = seconds
        else:
            self._seconds[num_tokens] = old + self.smoothing * (seconds - old)

    @property
    def measured(self) -> bool:
        return bool(self._counts)

    def measured_up_to(self, num_tokens: int) -> bool:
        """Whether a step of at most num_tokens tokens has been measured (else cost(num_tokens) is a
        larger step's, which may have paid for drafts: a draft model's forwards are in the step time)."""
        return bool(self._counts) and self._counts[0] <= num_tokens

    def cost(self, num_tokens: int) -> float:
        """Seconds for a step of num_tokens tokens (0 before any measurement)."""
        counts, secs = self._counts, self._seconds
        if not counts:
            return 0.0
        t = secs.get(num_tokens)
        if t is not None:
            return t
        i = bisect.bisect_left(counts, num_tokens)
        if 0 < i < len(counts):  # between two measured counts
            lo, hi = counts[i - 1], counts[i]
            return secs[lo] + (secs[hi] - secs[lo]) * (num_tokens - lo) / (hi - lo)
        if i == 0:  # below every measured count: no cheaper than the smallest
            return secs[counts[0]]
        last = counts[-1]
        return secs[last] + self._slope() * (num_tokens - last)

    def _slope(self) -> float:
        """Seconds per extra token above the largest measured count: a least-squares line over the
        measured counts (never below the prior slope of the largest: extrapolation must not be free)."""
        counts = self._counts
        last = counts[-1]
        floor = self.prior_slope * self._seconds[last]
        if len(counts) < 2:
            return floor
        xs, ys = counts, [self._seconds[c] for c in counts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return max(slope, floor)


@dataclass
class AcceptanceStats:
    """Draft positions tried and accepted (position j is tried when drafts 1..j-1 were accepted)."""
    tried: float = 0.0
    accepted: float = 0.0


class DraftPolicy:
    def __init__(self, max_drafts: int, adaptive: bool = True, disable_by_batch_size: int | None = None,
                 prior_rate: float = 0.5, prior_weight: float = 4.0) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.prior_weight = prior_weight
        self.cost = StepCostModel()        # the target's step, by the tokens it computes
        self.draft_cost = StepCostModel()  # one forward of a draft model, by the tokens it computes
        # engine-wide, seeded with a prior of prior_weight positions at prior_rate
        self.overall = AcceptanceStats(prior_weight, prior_rate * prior_weight)

    # -- measurements -----------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def observe_draft_forward(self, num_tokens: int, seconds: float) -> None:
        """A draft model's forward of num_tokens tokens took seconds (a step with k drafts runs k)."""
        self.draft_cost.observe(num_tokens, seconds)

    def observe_drafts(self, request: Request | None, num_drafts: int, num_accepted: int) -> None:
        """A step ran num_drafts drafts for request (None: it has finished) and accepted num_accepted."""
        tried = min(num_drafts, num_accepted + 1)
        self.overall.tried += tried
        self.overall.accepted += num_accepted
        if request is None:
            return
        if request.proposer_stats is None:
            request.proposer_stats = AcceptanceStats()
        request.proposer_stats.tried += tried
        request.proposer_stats.accepted += num_accepted

    def acceptance_rate(self, request: Request) -> float:
        """The request's rate, shrunk toward the engine-wide one while it has few samples."""
        overall = self.overall.accepted / self.overall.tried
        s = request.proposer_stats
        if s is None:
            return overall
        return (s.accepted + self.prior_weight * overall) / (s.tried + self.prior_weight)

    # -- the decision -----------------------------------------------------------------------------
    def wants_drafts(self, num_running: int) -> bool:
        """False when this step runs none whatever is proposed (checked before asking the proposer)."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def choose(self, proposals: Sequence[tuple[Request, list[int]]], num_sampling: int,
               num_tokens: int, catch_up: Sequence[int] | None = None) -> list[int]:
        """How many of each proposal's tokens to run, given the step's requests that sample
        (num_sampling) and the tokens it computes without drafts (num_tokens); catch_up (a draft model):
        per proposal, the tokens the draft's first forward computes for it (those it has not seen)."""
        counts = [min(len(d), self.max_drafts) for _, d in proposals]
        if not self.adaptive:
            return counts
        if not self.cost.measured_up_to(max(1, num_tokens)):
            # the step without drafts has no measured cost to weigh them against: run it plain once (what
            # drafts cost is learnt from the steps that run them, at every count above)
            return [0] * len(proposals)
        gains = []  # (expected extra tokens, proposal index)
        for i, (request, _) in enumerate(proposals):
            rate = self.acceptance_rate(request)
            g = 1.0
            for _ in range(counts[i]):
                g *= rate
                gains.append((g, i))
        gains.sort(key=lambda x: -x[0])
        base = self.cost.cost(max(1, num_tokens))
        best_d, best_rate, expected = 0, num_sampling / base, float(num_sampling)
        # a draft model's forwards: forward j computes draft j of every request given j or more, so its
        # rows are rows[j] (forward 1: each such request's catch-up tokens); nothing while no draft
        # forward has been measured (an n-gram proposer)
        given = [0] * len(proposals)
        rows = [0] * (self.max_drafts + 1)
        draft_s = 0.0
        for d, (g, i) in enumerate(gains, start=1):
            expected += g
            given[i] += 1
            j = given[i]
            add = catch_up[i] if catch_up is not None and j == 1 else 1
            if self.draft_cost.measured:
                draft_s += self.draft_cost.cost(rows[j] + add) - (self.draft_cost.cost(rows[j]) if rows[j] else 0.0)
            rows[j] += add
            rate = expected / (self.cost.cost(num_tokens + d) + draft_s)
            if rate > best_rate:
                best_d, best_rate = d, rate
        chosen = [0] * len(proposals)
        for _, i in gains[:best_d]:
            chosen[i] += 1
        return chosen
