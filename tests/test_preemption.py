"""Forced preemption: a KV cache far smaller than the demand of many requests makes the scheduler
preempt (free and later recompute) running requests. Every request must still finish, with exactly
the tokens (greedy or seeded) and prompt logprobs of an unconstrained run, and every block must be
back in the pool afterwards."""
from __future__ import annotations

import pytest

from tests.helpers import assert_engine_idle, random_prompts, tiny_llm
from tidal import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128
BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32 of the tiny llama
NUM_BLOCKS = 36  # one max_model_len request needs 32
TIGHT_KV_BYTES = NUM_BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN
NUM_REQUESTS = 12
MAX_TOKENS = 24


def _params(i: int) -> SamplingParams:
    if i % 2:  # odd requests sample (seeded), even ones are greedy
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                              prompt_logprobs=1)
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1, logprobs=2)


def _generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i) for i in range(len(prompts))],
                        use_tqdm=False)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(NUM_REQUESTS, 10, 50, 512, seed=3)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                   max_num_batched_tokens=32)
    outs = _generate(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions == 0
    return outs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forced_preemption_gives_identical_outputs(tiny_model_dir, prompts, reference, prefix_caching):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                   max_num_batched_tokens=32, kv_cache_memory_bytes=TIGHT_KV_BYTES,
                   enable_prefix_caching=prefix_caching)
    engine = llm.llm_engine
    assert engine.kv_manager.pool.num_blocks == NUM_BLOCKS
    outs = _generate(llm, prompts)

    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.num_preemptions == engine.scheduler.num_preemptions
    assert_engine_idle(engine)
    assert len(outs) == NUM_REQUESTS
    assert sum(o.metrics.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    for i, (out, ref) in enumerate(zip(outs, reference)):
        got, want = out.outputs[0], ref.outputs[0]
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert out.finished and got.finish_reason == "length"
        assert got.token_ids == want.token_ids, f"request {i} changed under preemption"
        assert len(out.prompt_logprobs) == len(prompts[i])
        for pos in range(1, len(prompts[i])):
            tok = prompts[i][pos]
            assert out.prompt_logprobs[pos][tok].logprob == pytest.approx(ref.prompt_logprobs[pos][tok].logprob,
                                                                           abs=1e-5)
        if want.logprobs is not None:
            assert len(got.logprobs) == MAX_TOKENS
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
