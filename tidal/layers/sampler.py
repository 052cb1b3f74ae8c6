"""Sampler: one batched path from logits to tokens for every request that samples this step.

Order (as vLLM): rows with a grammar (structured outputs) first lose the tokens their bitmask
forbids, then raw log-probabilities are taken (what `logprobs` reports), then penalties,
min_tokens masking, temperature, top-k, top-p, min-p, and the draw. A draw is argmax(p / q) with
q ~ Exponential(1) (the Gumbel-max trick in disguise): rows of seeded requests fill q from their own
torch.Generator, so a request's tokens never depend on what else shares the batch.

On CUDA the logits stay on the GPU: per-row parameters are gathered on the host and copied once, the
generators are CUDA generators, and the host reads back only the sampled tokens (and logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.device import to_device
from tidal.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    all_token_ids: list[int] | None      # prompt + outputs, when penalties need them
    num_prompt_tokens: int
    num_output_tokens: int
    stop_ids_before_min: list[int]       # EOS / stop ids masked while num_output < min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None, or (top ids, top logprobs, sampled logprob, sampled rank)
    logprobs: list[tuple[list[int], list[float], float, int] | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place. Token sets and counts are made on the host (from the token-id lists) and copied."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties or row.all_token_ids is None:
            continue
        toks = torch.tensor(row.all_token_ids, dtype=torch.long)
        toks = toks[toks < vocab]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[toks] = True
            seen = to_device(seen, logits.device)
            x = logits[i]
            logits[i] = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.presence_penalty or p.frequency_penalty:
            out = toks[row.num_prompt_tokens:] if len(row.all_token_ids) > row.num_prompt_tokens else toks[:0]
            counts = to_device(torch.bincount(out, minlength=vocab).to(logits.dtype), logits.device)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k / nucleus (top_k 0 = off, top_p 1 = off)."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
    # remove a token when the mass of the tokens strictly before it already reaches top_p
    before = probs.cumsum(-1) - probs
    remove |= before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


_BITS = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[j], t] = -inf where bit t of bitmask[j] (int32 words, little-endian bit
    order within a word) is 0. Plain torch, so the same code runs on CPU and CUDA; the bitmask is
    made on the host and copied once. Columns past the bitmask (padded vocabularies) are forbidden."""
    device, vocab = logits.device, logits.shape[-1]
    if device not in _BITS:
        _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = to_device(bitmask, device)
    allowed = ((words.unsqueeze(-1) >> _BITS[device]) & 1).bool().flatten(1)  # [k, words * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    idx = to_device(torch.tensor(rows, dtype=torch.long), device)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :vocab], float("-inf"))


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator | None = None,
           grammar: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput:
    """logits [num_rows, vocab] (fp32, on the model's device) -> one token per row. Generators must be
    on the logits' device. `grammar`: (int32 bitmask [k, ceil(vocab / 32)], the k rows it constrains)."""
    n = len(rows)
    device = logits.device
    if grammar is not None:
        apply_token_bitmask(logits, *grammar)

    def on_device(values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device)

    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None
    if any(r.params.has_penalties for r in rows):
        logits = logits.clone()
        apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        if row.stop_ids_before_min and row.num_output_tokens < row.params.min_tokens:
            logits[i, on_device(row.stop_ids_before_min, torch.long)] = float("-inf")

    tokens = logits.argmax(-1)
    rand_pos = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand_pos:
        rand_idx = on_device(rand_pos, torch.long)
        rand_rows = [rows[i] for i in rand_pos]
        x = logits[rand_idx] / on_device([r.params.temperature for r in rand_rows]).unsqueeze(1)
        if any(r.params.top_k > 0 or r.params.top_p < 1 for r in rand_rows):
            top_k = on_device([r.params.top_k for r in rand_rows])
            x = _top_k_top_p(x, top_k, on_device([r.params.top_p for r in rand_rows]))
        probs = x.softmax(-1)
        if any(r.params.min_p > 0 for r in rand_rows):
            min_p = on_device([r.params.min_p for r in rand_rows])
            keep = probs >= min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
            probs = probs * keep
        q = torch.empty_like(probs)
        for j, row in enumerate(rand_rows):
            q[j].exponential_(generator=row.generator or default_generator)
        tokens[rand_idx] = (probs / q).argmax(-1)

    token_list = tokens.tolist()
    logprob_out: list = [None] * n
    if raw_logprobs is not None:
        k_max = max(r.params.logprobs for r in rows if r.params.logprobs is not None)
        top_vals, top_ids = raw_logprobs.topk(max(k_max, 1), dim=-1) if k_max else (None, None)
        sampled_lp = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        ranks = (raw_logprobs > sampled_lp.unsqueeze(1)).sum(-1) + 1
        sampled_lp, ranks = sampled_lp.tolist(), ranks.tolist()
        top_vals = top_vals.tolist() if top_vals is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                continue
            logprob_out[i] = (top_ids[i][:k] if k else [], top_vals[i][:k] if k else [], sampled_lp[i], ranks[i])
    return SamplerOutput(token_list, logprob_out)


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int):
    """Log-probabilities of target_ids under logits [n, vocab], with each row's top-k.
    Returns (target logprobs, target ranks, top ids, top logprobs) as lists."""
    lp = logits.float().log_softmax(-1)
    target = lp.gather(1, target_ids.unsqueeze(1)).squeeze(1)
    ranks = (lp > target.unsqueeze(1)).sum(-1) + 1
    if k:
        top_vals, top_ids = lp.topk(k, dim=-1)
        return target.tolist(), ranks.tolist(), top_ids.tolist(), top_vals.tolist()
    return target.tolist(), ranks.tolist(), [[] for _ in range(len(target))], [[] for _ in range(len(target))]
