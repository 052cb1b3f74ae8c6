"""Rejection sampling of draft tokens (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"): the tokens a request keeps from a step with k drafts are distributed exactly
as k + 1 tokens sampled one step at a time from the target.

For draft j, with p the target's distribution at its place (after the request's own temperature,
top-k, top-p, min-p, penalties: Sampler.target_probs) and q the proposer's:

    accept d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection, emit a token drawn
    from norm(max(p - q, 0)) and stop; if every draft is accepted, emit a bonus token drawn from p
    at the place after the last draft.

`rejection_sample` does that for any q, batched over every request's drafts with one host read-back.

Point-mass drafts (n-gram: q(d) = 1) need no q and no extra noise: the runner draws x from p with the
request's own sampler (its seeded noise for that output index) and accepts d iff x == d. That happens
with probability p(d) = min(1, p(d) / q(d)), and a rejected x is distributed as p without d,
renormalised - norm(max(p - q, 0)) for a point mass. Same distribution, and a seeded request's
tokens are the very ones it gets without speculation (`accept_point_mass`).
"""
from __future__ import annotations

import torch

from tidal.layers.sampler import seeded_exponential

# draw-index offsets that give the acceptance tests and the recovered draws of a seeded row their own
# noise streams, independent of the one its normal draw at the same output index uses
_ACCEPT_STREAM = 1 << 40
_RECOVER_STREAM = 2 << 40


def accept_point_mass(sampled: list[int], drafts: list[int]) -> list[int]:
    """Tokens kept from a step whose k drafts are point masses: `sampled` holds the k + 1 tokens the
    request's sampler drew at its last known token and after each draft; drafts are kept up to the
    first that differs from the token drawn at its place, which replaces it.

        >>> accept_point_mass([5, 6, 9, 4], [5, 6, 7])
        [5, 6, 9]
    """
    n = next((j for j, d in enumerate(drafts) if sampled[j] != d), len(drafts))
    return sampled[:n + 1]


def rejection_noise(num_drafts: int, vocab: int, device, generator: torch.Generator | None = None,
                    seeds: torch.Tensor | None = None, draw_index: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform [D] in (0, 1), Exponential(1) [D, vocab]) for D draft rows: from the rows' seeds and
    draw indices (output index of the draft) when given - the same for the same (seed, index) on
    every device and in every batch - else from `generator`."""
    if seeds is not None:
        uniform = seeded_exponential(seeds, draw_index + _ACCEPT_STREAM, 1).squeeze(1).neg().exp()
        return uniform, seeded_exponential(seeds, draw_index + _RECOVER_STREAM, vocab)
    uniform = torch.rand(num_drafts, generator=generator, device=device)
    expo = torch.rand(num_drafts, vocab, generator=generator, device=device).log_().neg_()
    return uniform, expo


def acceptance_probability(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) per draft (a draft the proposer gave probability 0 is accepted as far as p allows)."""
    return torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), p_d.gt(0).float()).clamp_max(1.0)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[list[int]], bonus_token_ids: list[int],
                     draft_probs: torch.Tensor | None, uniform: torch.Tensor,
                     exponential: torch.Tensor) -> list[list[int]]:
    """Tokens each request keeps.

    target_probs [R, vocab]: per request, its k_i + 1 target distributions (at its last known token,
        then after each draft), requests one after another (R = sum of k_i + 1)
    draft_token_ids: per request its k_i drafts; bonus_token_ids: per request the token drawn from its
        last row (used when every draft is accepted)
    draft_probs [D, vocab] (D = sum of k_i) the proposer's distribution of each draft, or None for
        point masses (n-gram)
    uniform [D], exponential [D, vocab]: noise (rejection_noise)
    """
    device = target_probs.device
    rows, flat = [], []
    start = 0
    for drafts in draft_token_ids:
        rows.extend(range(start, start + len(drafts)))
        flat.extend(drafts)
        start += len(drafts) + 1
    if not flat:
        return [[b] for b in bonus_token_ids]
    p = target_probs[torch.tensor(rows, device=device)]                 # [D, vocab]
    d = torch.tensor(flat, device=device).unsqueeze(1)                  # [D, 1]
    p_d = p.gather(1, d).squeeze(1)
    if draft_probs is None:  # q = one-hot at d: accept with p(d), residual p without d
        accept = uniform < acceptance_probability(p_d, torch.ones_like(p_d))
        residual = p.scatter(1, d, 0.0)
    else:
        accept = uniform < acceptance_probability(p_d, draft_probs.gather(1, d).squeeze(1))
        residual = (p - draft_probs).clamp_min_(0.0)
    # where p <= q everywhere (p == q) a rejection has probability 0; draw from p rather than from nothing
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    recovered = (residual / exponential).argmax(-1)  # a draw proportional to residual (no normalising)
    accept, recovered = accept.tolist(), recovered.tolist()
    out, j = [], 0
    for drafts, bonus in zip(draft_token_ids, bonus_token_ids):
        k = len(drafts)
        n = next((a for a in range(k) if not accept[j + a]), k)
        out.append(list(drafts[:n]) + [recovered[j + n] if n < k else bonus])
        j += k
    return out
