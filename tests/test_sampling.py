"""SamplingParams validation and the sampler's behaviour through the engine: seeded requests are
reproducible whatever shares their batch, top_k=1 (and a vanishing top_p, min_p=1) is greedy,
logprobs come back in vLLM's shape, penalties and min_tokens do what they say, n=2 gives two
samples. The batched sampler itself is tested directly in tests/test_sampler.py."""
from __future__ import annotations

import math

import pytest

from tests.helpers import random_prompts, tiny_llm
from tidal import Logprob, SamplingParams

# -- validation ----------------------------------------------------------------------------------------
INVALID = [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1), ("seed", "abc"), ("seed", 2**64), ("seed", -2**63 - 1),
    ("max_tokens", 0), ("max_tokens", -5),
    ("max_tokens", 2.0), ("min_tokens", -1), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", "x"), ("frequency_penalty", -2.5), ("logprobs", -1),
    ("logprobs", 21), ("prompt_logprobs", -1), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("output_kind", "partial"),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and repr(value) in str(e.value)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_extra_arguments_are_refused_not_ignored():
    """vLLM's extra_args go to sampling plugins; Tidal has none, so they would do nothing."""
    with pytest.raises(ValueError, match=r"extra must be empty .*got \{'my_plugin': 1\}"):
        SamplingParams(extra={"my_plugin": 1})
    assert SamplingParams(extra={}).extra == {}


def test_valid_values_are_accepted_and_normalised():
    p = SamplingParams(top_k=-1, stop="###", temperature=0.0, top_p=0.5)
    assert p.top_k == 0 and p.stop == ["###"] and p.greedy and p.top_p == 1.0
    assert SamplingParams(max_tokens=None, logprobs=0, prompt_logprobs=20, seed=0).max_tokens is None


# -- through the engine, on a tiny model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir("llama"), block_size=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(17, 5, 30, 512, seed=11)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_request_is_the_same_alone_and_in_a_batch_of_16(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = tokens(llm.generate(prompts[0], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.5 + 0.1 * i, top_k=10 * (i % 3), seed=None if i % 2 else i,
                             max_tokens=8 + i, ignore_eos=True) for i in range(16)]
    for position in (0, 9, 16):  # first, middle and last in the batch
        params = others[:position] + [seeded] + others[position:]
        batch = prompts[1:position + 1] + [prompts[0]] + prompts[position + 1:]
        assert tokens(llm.generate(batch, params, use_tqdm=False))[position] == alone
    # and a different seed gives a different draw
    assert tokens(llm.generate(prompts[0], seeded.clone(seed=4321), use_tqdm=False))[0] != alone


def test_unseeded_sampling_varies(llm, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert tokens(llm.generate([prompts[0]] * 2, params, use_tqdm=False))[0] != \
        tokens(llm.generate([prompts[0]] * 2, params, use_tqdm=False))[1]


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_that_keep_one_token_equal_greedy(llm, prompts, filters):
    greedy = tokens(llm.generate(prompts[:6], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False))
    sampled = tokens(llm.generate(prompts[:6], SamplingParams(temperature=1.5, seed=7, max_tokens=12,
                                                              ignore_eos=True, **filters), use_tqdm=False))
    assert sampled == greedy


def test_logprobs_shape(llm, prompts):
    k = 3
    out = llm.generate(prompts[1], SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=k,
                                                  prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    sample = out.outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids) == 6
    total = 0.0
    for token, entry in zip(sample.token_ids, sample.logprobs):
        assert token in entry and all(isinstance(v, Logprob) for v in entry.values())
        assert k <= len(entry) <= k + 1  # the top k, plus the sampled token when outside them
        ranked = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in ranked[:k]] == [1, 2, 3]
        sampled = entry[token]
        assert sampled.logprob <= 0 and sampled.rank >= 1
        assert sampled.rank == 1 + sum(lp.logprob > sampled.logprob for lp in ranked[:k]) or sampled.rank > k
        total += sampled.logprob
    assert sample.cumulative_logprob == pytest.approx(total, abs=1e-5)
    prompt = prompts[1]["prompt_token_ids"]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert prompt[pos] in out.prompt_logprobs[pos] and 2 <= len(out.prompt_logprobs[pos]) <= 3


def test_logprobs_zero_gives_only_the_sampled_token(llm, prompts):
    sample = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in sample.logprobs] == [[t] for t in sample.token_ids]
    assert all(e[t].rank == 1 for t, e in zip(sample.token_ids, sample.logprobs))  # greedy: the argmax


def test_no_logprobs_when_not_asked(llm, prompts):
    out = llm.generate(prompts[2], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None
    assert out.outputs[0].cumulative_logprob is None


def test_logprobs_carry_decoded_tokens(smollm2):
    out = smollm2.generate("The capital of France is",
                           SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1),
                           use_tqdm=False)[0]
    tok = smollm2.get_tokenizer()
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        for tid, lp in entry.items():
            assert lp.decoded_token == tok.decode([tid])
        assert entry[token].rank == 1
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1][out.prompt_token_ids[1]].decoded_token == tok.decode([out.prompt_token_ids[1]])


def test_n_2_gives_two_samples(llm, prompts):
    out = llm.generate(prompts[3], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)
    assert len(out) == 1
    samples = out[0].outputs
    assert [s.index for s in samples] == [0, 1]
    assert all(len(s.token_ids) == 10 and s.finish_reason == "length" for s in samples)
    assert samples[0].token_ids != samples[1].token_ids
    again = llm.generate(prompts[3], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    assert [s.token_ids for s in again[0].outputs] == [s.token_ids for s in samples]


def test_large_repetition_penalty_never_repeats_a_token(llm, prompts):
    outs = llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1e4,
                                                    ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        seen = set(prompt["prompt_token_ids"])
        for t in out.outputs[0].token_ids:
            assert t not in seen
            seen.add(t)


def test_presence_penalty_changes_greedy_output_and_zero_penalties_do_not(llm, prompts):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = tokens(llm.generate(prompts[:4], base, use_tqdm=False))
    neutral = tokens(llm.generate(prompts[:4], base.clone(repetition_penalty=1.0, presence_penalty=0.0),
                                  use_tqdm=False))
    assert neutral == plain
    penalised = tokens(llm.generate(prompts[:4], base.clone(presence_penalty=2.0, frequency_penalty=2.0),
                                    use_tqdm=False))
    assert penalised != plain
    # output repetitions are pushed down: fewer repeated tokens than without penalties
    def repeats(seqs):
        return sum(len(s) - len(set(s)) for s in seqs)
    assert repeats(penalised) < repeats(plain)


def test_min_tokens_masks_stop_tokens(llm, prompts):
    greedy = llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_id = greedy[2]
    first = greedy.index(stop_id)
    stopped = llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == greedy[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    held = llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id],
                                                   min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 6
    assert stop_id not in held.token_ids[:5]
    assert held.token_ids[:first] == greedy[:first]


def test_temperature_reshapes_the_distribution(llm, prompts):
    """With a high temperature draws spread over many tokens; with a tiny one they collapse."""
    def distinct_first_tokens(temperature):
        params = [SamplingParams(temperature=temperature, seed=s, max_tokens=1) for s in range(24)]
        return len({o.outputs[0].token_ids[0] for o in llm.generate([prompts[5]] * 24, params, use_tqdm=False)})
    assert distinct_first_tokens(3.0) > 4
    assert distinct_first_tokens(1e-3) == 1


def test_sampled_logprob_is_the_unmodified_distribution(llm, prompts):
    """logprobs report the model's raw distribution (before temperature / penalties), as vLLM's default."""
    greedy = llm.generate(prompts[6], SamplingParams(temperature=0, max_tokens=1, logprobs=1), use_tqdm=False)
    hot = llm.generate(prompts[6], SamplingParams(temperature=5.0, top_k=1, seed=1, max_tokens=1, logprobs=1),
                       use_tqdm=False)
    g, h = greedy[0].outputs[0], hot[0].outputs[0]
    assert g.token_ids == h.token_ids
    assert math.isclose(g.logprobs[0][g.token_ids[0]].logprob, h.logprobs[0][h.token_ids[0]].logprob,
                        abs_tol=1e-6)
