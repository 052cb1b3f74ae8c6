"""Multi-token steps: a request scheduled with draft tokens gets every draft the model agrees with plus
one more token in a single step, and its outputs are exactly those of one token per step - whether the
drafts are right, wrong or partly right, with chunked prefill, prefix caching, logprobs and stops."""
from __future__ import annotations

from functools import partial

import pytest

from tests.helpers import WorkerMirror, assert_engine_idle, random_prompts, tiny_llm
from tidal import SamplingParams
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler
from tidal.engine.proposer import NgramProposer
from tidal.engine.stop_checker import append_tokens
from tidal.request import Request

K = 3


class ScriptedProposer:
    """Proposes the reference continuation of each request, corrupted from draft `wrong_from` on."""

    def __init__(self, reference: dict[tuple, list[int]], wrong_from: int, vocab: int) -> None:
        self.reference, self.wrong_from, self.vocab = reference, wrong_from, vocab
        self.proposed = 0

    def propose(self, request: Request) -> list[int]:
        ref = self.reference[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        drafts = ref[done:done + K]
        drafts = drafts[:self.wrong_from] + [(t + 1) % self.vocab for t in drafts[self.wrong_from:]]
        self.proposed += len(drafts)
        return drafts


def _run(llm, prompts, params):
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", {"prompt_token_ids": p}, params)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        steps += 1
    return [outs[f"q{i}"] for i in range(len(prompts))], steps


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # a small token budget so prompts are chunked and decodes share steps with chunks
    return tiny_llm(tiny_model_dir("llama"), max_num_batched_tokens=32, block_size=4)


@pytest.mark.parametrize("wrong_from", [K, 1, 0], ids=["all-right", "first-right", "all-wrong"])
def test_drafts_give_the_same_tokens_in_fewer_steps(llm, wrong_from):
    engine = llm.llm_engine
    prompts = random_prompts(5, 3, 40, engine.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=2)
    engine.proposer = None
    ref, ref_steps = _run(llm, prompts, params)
    reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    engine.proposer = proposer = ScriptedProposer(reference, wrong_from, engine.vocab_size)
    try:
        got, steps = _run(llm, prompts, params)
    finally:
        engine.proposer = None
    assert proposer.proposed > 0
    for a, b in zip(ref, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason == "length"
        assert [sorted(d) for d in b.outputs[0].logprobs] == [sorted(d) for d in a.outputs[0].logprobs]
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in da:
                assert db[t].logprob == pytest.approx(da[t].logprob, abs=1e-4)
    if wrong_from == 0:
        assert steps == ref_steps, "rejected drafts cost rows, never tokens or steps"
    else:
        assert steps < ref_steps, f"accepted drafts must save steps ({steps} vs {ref_steps})"
    assert_engine_idle(engine)


def test_max_tokens_and_stop_ids_cut_inside_the_accepted_drafts(llm):
    engine = llm.llm_engine
    prompts = random_prompts(3, 5, 20, engine.vocab_size, seed=4)
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.proposer = None
    ref, _ = _run(llm, prompts, base)
    reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    stop_id = ref[0].outputs[0].token_ids[5]
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])):
        engine.proposer = None
        want, _ = _run(llm, prompts, params)
        engine.proposer = ScriptedProposer(reference, K, engine.vocab_size)
        try:
            got, _ = _run(llm, prompts, params)
        finally:
            engine.proposer = None
        for a, b in zip(want, got):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason) == \
                (a.outputs[0].finish_reason, a.outputs[0].stop_reason)
    assert_engine_idle(engine)


def test_ngram_proposer_keeps_outputs_and_proposes_from_context(llm):
    engine = llm.llm_engine
    # prompts that repeat themselves, so prompt lookup has something to find
    prompts = [(p * 4)[:36] for p in random_prompts(4, 5, 9, engine.vocab_size, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.proposer = None
    ref, _ = _run(llm, prompts, params)
    engine.proposer = NgramProposer(k=K)
    try:
        got, _ = _run(llm, prompts, params)
    finally:
        engine.proposer = None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    r = Request("x", [1, 2, 3, 4, 1, 2], SamplingParams())
    assert NgramProposer(k=2, max_ngram=2).propose(r) == [3, 4]
    assert NgramProposer(k=2).propose(Request("y", [5, 6, 7], SamplingParams())) == []
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(min_ngram=3, max_ngram=2)


def test_draft_blocks_are_reserved_but_never_enter_the_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    mirror = WorkerMirror()
    append = partial(append_tokens, max_model_len=scheduler.max_model_len)
    req = Request("r0", list(range(10, 17)), SamplingParams(max_tokens=20, ignore_eos=True))  # 7 tokens
    scheduler.add_request(req)
    so = scheduler.schedule()
    mirror.apply(so)
    scheduler.update(so, {"r0": [50]}, append)  # 8 tokens: two full blocks, 7 computed
    req.spec_token_ids = [51, 52, 53, 54, 55]
    so = scheduler.schedule()
    mirror.apply(so)
    (sr,) = so.scheduled
    assert (sr.num_tokens, sr.spec_token_ids, sr.sample) == (6, [51, 52, 53, 54, 55], True)
    assert mirror.step_tokens(sr) == [50, 51, 52, 53, 54, 55]
    assert len(kv.get_block_ids("r0")) == 4, "7 computed + 1 known + 5 drafts = 13 slots"
    assert kv.req_num_cached_blocks["r0"] == 2, "only blocks full of known tokens are cached"
    assert req.spec_token_ids == [], "drafts are good for one step"
    # the model agreed with the first two drafts: 51, 52 and then 60 are the new tokens
    scheduler.update(so, {"r0": [51, 52, 60]}, append)
    assert req.output_token_ids == [50, 51, 52, 60]
    assert req.num_computed_tokens == 10, "the KV of the 3 rejected drafts does not count"
    so = scheduler.schedule()
    mirror.apply(so)
    (sr,) = so.scheduled
    assert (sr.start_pos, sr.num_tokens, mirror.step_tokens(sr)) == (10, 1, [60])


@pytest.mark.parametrize("wrong_from", [K, 1])
def test_seeded_random_sampling_is_unchanged_by_drafts(llm, wrong_from):
    """A seeded row's noise depends on (seed, output index) only, so verifying drafts against tokens
    sampled at their places reproduces the one-token-per-step stream exactly."""
    engine = llm.llm_engine
    prompts = random_prompts(4, 3, 30, engine.vocab_size, seed=6)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=15, ignore_eos=True)
    engine.proposer = None
    ref, _ = _run(llm, prompts, params)
    reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    engine.proposer = ScriptedProposer(reference, wrong_from, engine.vocab_size)
    try:
        got, _ = _run(llm, prompts, params)
    finally:
        engine.proposer = None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
