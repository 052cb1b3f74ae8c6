"""Rejection sampling is exact: on a toy target/draft pair, the tokens kept from steps with drafts are
distributed as the target's own samples (chi-square tests, with temperature, top-k and top-p shaping
the target), for drafts from a proposer distribution q, for point-mass (n-gram) drafts, and through
the runner's own path (the request's sampler draws at each draft, accept_point_mass keeps the
agreeing prefix). A broken acceptance rule fails the same test."""
from __future__ import annotations

import pytest
import torch

import tidal.layers.rejection_sampler as rs
from tidal.layers.rejection_sampler import accept_point_mass, rejection_noise, rejection_sample
from tidal.layers.sampler import Sampler, SamplingMetadata
from tidal.sampling_params import SamplingParams

VOCAB = 12
TRIALS = 40_000
K = 2  # drafts per trial
PARAMS = SamplingParams(temperature=0.8, top_k=9, top_p=0.92, max_tokens=8)


def _target_and_draft():
    """The target p (the toy model's logits through temperature, top-k and top-p: three tokens have
    probability 0) and a draft distribution q that differs from it, with mass where p has none."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, VOCAB, generator=g) * 1.5
    meta = SamplingMetadata.from_params([PARAMS], "cpu", VOCAB)
    p = Sampler(None).target_probs(logits, meta)[0]
    p = p / p.sum()
    q = torch.rand(VOCAB, generator=g) ** 2
    q = q / q.sum()
    return logits[0], p, q


def _chi_square_pvalue(tokens: list[int], p: torch.Tensor) -> float:
    """p-value of the counts of tokens under p (tokens where p is 0 must never appear)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    support = p > 0
    assert counts[~support].sum() == 0, "a token the target forbids was emitted"
    expected = p.double()[support] * len(tokens)
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def _speculative_tokens(p, draft_dist, point_mass: bool, seed: int = 1) -> list[list[int]]:
    """TRIALS steps of K drafts each, drafts drawn from draft_dist, verified against p at every place."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(draft_dist, TRIALS * K, replacement=True, generator=g).view(TRIALS, K).tolist()
    bonus = torch.multinomial(p, TRIALS, replacement=True, generator=g).tolist()
    target = p.expand(TRIALS * (K + 1), VOCAB)
    q = None if point_mass else draft_dist.expand(TRIALS * K, VOCAB)
    uniform, expo = rejection_noise(TRIALS * K, VOCAB, "cpu", generator=g)
    return rejection_sample(target, drafts, bonus, q, uniform, expo)


def _assert_distributed_as(p, kept: list[list[int]]) -> None:
    first = [t[0] for t in kept]
    second = [t[1] for t in kept if len(t) > 1]
    assert len(second) > TRIALS // 20, "too few accepted drafts to test the second position"
    for tokens in (first, second):
        assert _chi_square_pvalue(tokens, p) > 1e-3


def test_drafts_from_a_distribution_keep_the_target_distribution():
    _, p, q = _target_and_draft()
    _assert_distributed_as(p, _speculative_tokens(p, q, point_mass=False))


def test_point_mass_drafts_keep_the_target_distribution():
    _, p, q = _target_and_draft()
    _assert_distributed_as(p, _speculative_tokens(p, q, point_mass=True))


def test_runner_path_sampling_at_each_draft_keeps_the_target_distribution():
    """What the model runner does: the request's sampler (seeded, per output index) draws at the
    last known token and after each draft, and the drafts are kept while they agree."""
    logits, p, q = _target_and_draft()
    g = torch.Generator().manual_seed(2)
    drafts = torch.multinomial(q, TRIALS * K, replacement=True, generator=g).view(TRIALS, K).tolist()
    params = [PARAMS.clone(seed=s) for s in range(TRIALS) for _ in range(K + 1)]
    meta = SamplingMetadata.from_params(params, "cpu", VOCAB, draw_index=list(range(K + 1)) * TRIALS)
    sampled = Sampler(None)(logits.expand(len(params), VOCAB), meta).token_ids
    kept = [accept_point_mass(sampled[i * (K + 1):(i + 1) * (K + 1)], drafts[i]) for i in range(TRIALS)]
    _assert_distributed_as(p, kept)


@pytest.mark.parametrize("broken", ["accept-with-p", "accept-always"])
def test_a_broken_acceptance_rule_fails_the_distribution_test(broken, monkeypatch):
    _, p, q = _target_and_draft()
    if broken == "accept-with-p":  # ignores q: accepts with p(d) instead of min(1, p(d) / q(d))
        monkeypatch.setattr(rs, "acceptance_probability", lambda p_d, q_d: p_d)
    else:
        monkeypatch.setattr(rs, "acceptance_probability", lambda p_d, q_d: torch.ones_like(p_d))
    first = [t[0] for t in _speculative_tokens(p, q, point_mass=False)]
    if broken == "accept-with-p":
        assert _chi_square_pvalue(first, p) < 1e-6
    else:  # the draft's own distribution comes out, tokens p forbids included
        with pytest.raises(AssertionError, match="forbids"):
            _chi_square_pvalue(first, p)


def test_seeded_rejection_noise_is_reproducible_and_batch_independent():
    seeds, index = torch.tensor([5, 9, 5]), torch.tensor([3, 3, 3])
    u, e = rejection_noise(3, VOCAB, "cpu", seeds=seeds, draw_index=index)
    assert torch.equal(u[0], u[2]) and torch.equal(e[0], e[2]) and not torch.equal(e[0], e[1])
    u1, e1 = rejection_noise(1, VOCAB, "cpu", seeds=seeds[1:2], draw_index=index[1:2])
    assert torch.equal(u1[0], u[1]) and torch.equal(e1[0], e[1])
    assert ((u > 0) & (u < 1)).all()


def test_accept_point_mass_keeps_the_agreeing_prefix_and_the_token_after():
    assert accept_point_mass([5, 6, 9, 4], [5, 6, 7]) == [5, 6, 9]
    assert accept_point_mass([5, 6, 7, 4], [5, 6, 7]) == [5, 6, 7, 4]
    assert accept_point_mass([1, 6], [5]) == [1]
