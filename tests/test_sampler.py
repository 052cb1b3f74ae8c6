"""The batched sampler, tested directly on small logits: penalties against a per-row reference loop,
banned ids, the top-k / top-p / min-p masks, seeded noise (a pure function of seed, draw index and
token id, checked against a pure-Python splitmix64; independent of the batch; distributed as the
softmax), logprobs and SamplingMetadata's validation."""
from __future__ import annotations

import math

import pytest
import torch

from tidal import SamplingParams
from tidal.layers.sampler import (
    Sampler,
    SamplingMetadata,
    TokenLogprobs,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    ban_tokens,
    exponential_from_bits,
    seeded_exponential,
)

VOCAB = 50


def meta_for(params, **kw) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, "cpu", VOCAB, **kw)


# -- penalties and banned ids ----------------------------------------------------------------------
def reference_penalties(logits: torch.Tensor, params, prompts, outputs) -> torch.Tensor:
    """One row at a time, as vLLM: repetition over prompt + output, presence/frequency over output."""
    out = logits.clone()
    for i, p in enumerate(params):
        x = out[i]
        for t in set(prompts[i]) | set(outputs[i]):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(outputs[i]):
            count = outputs[i].count(t)
            x[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_follow_vllm_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    meta = SamplingMetadata.from_params(params, "cpu", 5, prompt_token_ids=[[0, 1]], output_token_ids=[[2, 2, 3]])
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25 * 2, 1.0 / 2 - 0.5 - 0.25, 0.0]
    assert apply_penalties(logits, meta)[0].tolist() == pytest.approx(expected)


def test_batched_penalties_equal_a_per_row_loop():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
              SamplingParams(),  # no penalties: untouched
              SamplingParams(repetition_penalty=0.7),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
              SamplingParams(repetition_penalty=2.0, frequency_penalty=-0.5)]
    lens = [(7, 12), (3, 0), (1, 20), (15, 5), (0, 0)]  # uneven lengths: padding must change nothing
    prompts = [torch.randint(0, VOCAB, (a,), generator=g).tolist() for a, _ in lens]
    outputs = [torch.randint(0, VOCAB, (b,), generator=g).tolist() for _, b in lens]
    logits = torch.randn(len(params), VOCAB, generator=g) * 3
    got = apply_penalties(logits, meta_for(params, prompt_token_ids=prompts, output_token_ids=outputs))
    assert torch.allclose(got, reference_penalties(logits, params, prompts, outputs), atol=1e-6)


def test_banned_ids_are_masked_and_padding_bans_nothing():
    logits = torch.randn(3, VOCAB)
    banned = torch.tensor([[4, 7, -1], [-1, -1, -1], [0, 49, 4]])
    got = ban_tokens(logits.clone(), banned)
    assert torch.isinf(got).nonzero().tolist() == [[0, 4], [0, 7], [2, 0], [2, 4], [2, 49]]
    finite = torch.isfinite(got)
    assert torch.equal(got[finite], logits[finite])


def test_banned_ids_change_greedy_and_random_draws():
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10.0
    logits[:, 9] = 9.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1, seed=3)]
    meta = meta_for(params, banned_token_ids=[[3], [3]])
    assert Sampler(None)(logits.clone(), meta).token_ids == [9, 9]
    assert Sampler(None)(logits.clone(), meta_for(params)).token_ids == [3, 3]


# -- filters ----------------------------------------------------------------------------------------
def reference_kept(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    order = row.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]
    probs = row[order].softmax(-1).tolist()
    kept, mass = [], 0.0
    for t, p in zip(order, probs):
        if kept and mass >= top_p:
            break
        kept.append(t)
        mass += p
    return set(kept)


@pytest.mark.parametrize("top_k,top_p", [([3, 0, 1, 50], None), (None, [0.5, 0.9, 1e-6, 1.0]),
                                         ([5, 0, 20, 2], [0.3, 0.8, 0.95, 1.0])])
def test_top_k_top_p_keep_what_a_per_row_sort_keeps(top_k, top_p):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    got = apply_top_k_top_p(logits.clone(), None if top_k is None else torch.tensor(top_k),
                            None if top_p is None else torch.tensor(top_p))
    for i in range(4):
        want = reference_kept(logits[i], top_k[i] if top_k else 0, top_p[i] if top_p else 1.0)
        assert set(torch.isfinite(got[i]).nonzero().flatten().tolist()) == want
        assert torch.equal(got[i][list(want)], logits[i][list(want)])


def test_min_p_zeroes_tokens_below_a_fraction_of_the_top():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1]])
    got = apply_min_p(probs, torch.tensor([0.5, 0.0]))
    assert torch.equal(got, torch.tensor([[0.5, 0.3, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1]]))


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0 if i % 2 else 2.0, seed=i) for i in range(6)]
    meta = meta_for(params)
    assert not meta.all_greedy and not meta.all_random
    out = Sampler(torch.Generator().manual_seed(0))(logits.clone(), meta)
    assert out.token_ids[1::2] == logits.argmax(-1)[1::2].tolist()


# -- seeded noise -------------------------------------------------------------------------------------
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_noise(seed: int, draw_index: int, token: int) -> float:
    key = splitmix64(splitmix64(seed) + (draw_index + 1) * GOLDEN)
    u = ((splitmix64(key + (token + 1) * GOLDEN) >> 41) + 0.5) / 2 ** 23
    return -math.log(u)


def test_noise_is_finite_and_positive_at_the_extreme_bits():
    """q = 0 would make p / q inf (always drawn) or nan (drawn even when masked, p = 0)."""
    q = exponential_from_bits(torch.tensor([0, 1, 2**22, 2**23 - 2, 2**23 - 1]))
    assert torch.isfinite(q).all() and (q > 0).all()
    assert q[0].item() == pytest.approx(24 * math.log(2)) and q[-1].item() == pytest.approx(2.0 ** -24, rel=0.01)


def test_seeded_noise_is_splitmix64_of_seed_draw_index_and_token():
    """Wrapping int64 tensor arithmetic gives exactly the unsigned 64-bit hash (seeds past 2**63 too)."""
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -5]
    draws = [0, 1, 7, 1000, 3, 2**40]
    meta = meta_for([SamplingParams(seed=s) for s in seeds], draw_index=draws)
    q = seeded_exponential(meta.seeds, meta.draw_index, VOCAB)
    for i, (seed, draw) in enumerate(zip(seeds, draws)):
        for t in (0, 1, 17, VOCAB - 1):
            assert q[i, t].item() == pytest.approx(reference_noise(seed, draw, t), rel=1e-6)


def test_seeded_noise_differs_across_seeds_draws_and_tokens():
    q = seeded_exponential(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1]), 4096)
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    assert q[0].unique().numel() > 4000  # 23-bit uniforms: few collisions over 4096 tokens
    assert 0.95 < q.mean().item() < 1.05 and 0.9 < q.var().item() < 1.1  # Exponential(1)


def test_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, VOCAB, generator=g)
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, seed=9, min_p=0.05, repetition_penalty=1.2)]
    sampler = Sampler(torch.Generator().manual_seed(0))
    for draw in range(20):
        alone = sampler(row.clone(), meta_for([mine], draw_index=[draw])).token_ids[0]
        for position in range(len(others) + 1):
            params = others[:position] + [mine] + others[position:]
            logits = torch.randn(len(params), VOCAB, generator=g)
            logits[position] = row[0]
            meta = meta_for(params, draw_index=[draw + 5 * i for i in range(len(params))],
                            prompt_token_ids=[[1, 2]] * len(params), output_token_ids=[[]] * len(params))
            meta.draw_index[position] = draw
            assert sampler(logits, meta).token_ids[position] == alone


def test_seeded_draws_follow_the_softmax():
    """6000 seeded draws (each its own seed; then one seed over 6000 draw indices) over 6 tokens:
    a chi-square test against the softmax at significance 0.001 (df 5: 20.52)."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    n = 6000
    logits = probs.log().repeat(n, 1)
    for params, draws in (([SamplingParams(seed=s) for s in range(n)], [0] * n),
                          ([SamplingParams(seed=77)] * n, list(range(n)))):
        meta = SamplingMetadata.from_params(params, "cpu", 6, draw_index=draws)
        counts = torch.bincount(torch.tensor(Sampler(None)(logits.clone(), meta).token_ids), minlength=6)
        expected = probs * n
        assert ((counts - expected) ** 2 / expected).sum().item() < 20.52, counts.tolist()


def test_unseeded_rows_follow_the_default_generator():
    logits = torch.zeros(4, VOCAB)
    meta = meta_for([SamplingParams(temperature=1.0)] * 4)
    draw = [Sampler(torch.Generator().manual_seed(s))(logits, meta).token_ids for s in (5, 5, 6)]
    assert draw[0] == draw[1] and draw[0] != draw[2]


# -- logprobs and metadata ------------------------------------------------------------------------------
def test_logprobs_are_raw_and_typed():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    raw = logits.log_softmax(-1)
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=5.0),
              SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2, logprobs=0)]
    out = Sampler(None)(logits.clone(), meta_for(params, prompt_token_ids=[list(range(40))] * 3,
                                                 output_token_ids=[[]] * 3))
    assert out.logprobs[1] is None
    first, last = out.logprobs[0], out.logprobs[2]
    assert isinstance(first, TokenLogprobs) and last.top_ids == [] and last.top_logprobs == []
    assert first.top_ids == raw[0].topk(3).indices.tolist()
    assert first.top_logprobs == pytest.approx(raw[0].topk(3).values.tolist())
    for i, lp in ((0, first), (2, last)):
        token = out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, token].item())  # before the penalty
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())


def test_metadata_leaves_unused_fields_none():
    meta = meta_for([SamplingParams(temperature=0)] * 2)
    assert meta.all_greedy and not meta.all_random
    assert all(getattr(meta, name) is None for name in (
        "top_k", "top_p", "min_p", "seeds", "seeded", "draw_index", "repetition_penalty", "prompt_token_ids",
        "banned_token_ids", "grammar_bitmask"))
    mixed = meta_for([SamplingParams(seed=3), SamplingParams(top_p=0.5)], draw_index=[4, 9])
    assert mixed.all_random and not mixed.all_seeded
    assert mixed.seeded.tolist() == [True, False] and mixed.draw_index.tolist() == [4, 9]
    assert mixed.top_p.tolist() == [1.0, 0.5] and mixed.top_k is None


def test_metadata_refuses_mismatched_rows():
    meta = meta_for([SamplingParams(seed=1)] * 2)
    with pytest.raises(ValueError, match="top_p has 3 rows, expected 2"):
        SamplingMetadata(**{**meta.__dict__, "top_p": torch.ones(3)})
    with pytest.raises(ValueError, match="seeds, seeded, draw_index"):
        SamplingMetadata(**{**meta.__dict__, "draw_index": None})


def test_plain_greedy_metadata_takes_the_argmax_of_bf16_logits():
    torch.manual_seed(0)
    logits = torch.randn(9, 1000).bfloat16()
    out = Sampler(None)(logits, SamplingMetadata.plain_greedy(9, "cpu"))
    assert out.token_ids == logits.float().argmax(-1).tolist() and out.logprobs == [None] * 9
