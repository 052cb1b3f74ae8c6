"""Automatic prefix caching and parallel sampling, end to end through the offline API on a tiny
random Llama (fp32): outputs with caching on equal outputs with it off, under every scheduling
path that touches shared blocks (same-step sharing, eviction, preemption, chunked prefill)."""
from __future__ import annotations

import argparse
import math

import pytest

from tests.helpers import random_prompts, save_tiny_model, tiny_config
from tidal import LLM, SamplingParams
from tidal.entrypoints.engine_args import add_engine_args, engine_config_from_args

BS = 16
BLOCK_BYTES = 3 * 2 * 2 * 16 * 4 * BS  # layers * (K, V) * kv heads * head_dim * fp32 * tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), tiny_config("llama"), seed=0)


def make_llm(model_dir, caching=True, num_blocks=256, **kw):
    kw.setdefault("max_model_len", 256)
    return LLM(model_dir, dtype="float32", block_size=BS, kv_cache_memory_bytes=num_blocks * BLOCK_BYTES,
               enable_prefix_caching=caching, **kw)


def greedy(max_tokens=8):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def shared_prefix_prompts(n_groups, per_group, prefix_len, suffix_len, seed=0):
    prefixes = random_prompts(n_groups, prefix_len, prefix_len, 512, seed=seed)
    suffixes = random_prompts(n_groups * per_group, suffix_len, suffix_len, 512, seed=seed + 1)
    # interleave groups so a group's prefix is computed, pushed out, then wanted again
    return [prefixes[i % n_groups] + suffixes[i] for i in range(n_groups * per_group)]


def token_ids(outs):
    return [[o.token_ids for o in out.outputs] for out in outs]


def run_on_off(model_dir, prompts, params, **kw):
    on, off = make_llm(model_dir, True, **kw), make_llm(model_dir, False, **kw)
    outs_on, outs_off = on.generate(prompts, params, use_tqdm=False), off.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs_on) == token_ids(outs_off)
    return on, off, outs_on, outs_off


class PeakBlocks:
    """Wraps engine.step to record the most KV blocks in use after any step."""

    def __init__(self, llm):
        self.peak = 0
        engine = llm.llm_engine
        step = engine.step

        def wrapped():
            out = step()
            self.peak = max(self.peak, engine.kv_manager.pool.num_used_blocks)
            return out
        engine.step = wrapped


# -- greedy equality, caching on vs off --------------------------------------------------------------
def test_greedy_equal_on_shared_prefix_workload(model_dir):
    prompts = shared_prefix_prompts(3, 4, 40, 7)
    on, off, outs_on, _ = run_on_off(model_dir, prompts, greedy(12))
    assert all(out.num_cached_tokens == 32 for out in outs_on[3:])
    assert on.llm_engine.stats.prefix_hits == 9 * 32
    assert off.llm_engine.stats.prefix_queries == 0


@pytest.mark.parametrize("prefix_len, expected_hit", [(32, 32), (31, 16), (33, 32)])
def test_prefix_on_and_off_a_block_boundary(model_dir, prefix_len, expected_hit):
    prompts = shared_prefix_prompts(1, 4, prefix_len, 5, seed=prefix_len)
    _, _, outs_on, outs_off = run_on_off(model_dir, prompts, greedy(6))
    assert [o.num_cached_tokens for o in outs_on] == [0] + [expected_hit] * 3
    assert [o.num_cached_tokens for o in outs_off] == [0] * 4


@pytest.mark.parametrize("prompt_len, expected_hit", [(32, 16), (33, 32), (1, 0)])
def test_identical_prompts_recompute_the_last_token(model_dir, prompt_len, expected_hit):
    prompts = random_prompts(1, prompt_len, prompt_len, 512, seed=7) * 3
    _, _, outs_on, _ = run_on_off(model_dir, prompts, greedy(4))
    assert [o.num_cached_tokens for o in outs_on] == [0, expected_hit, expected_hit]
    assert len({tuple(o.outputs[0].token_ids) for o in outs_on}) == 1


def test_greedy_equal_under_eviction_pressure(model_dir):
    # 16 blocks hold 256 tokens; the working set is 6 prefixes of 48 tokens and 24 suffixes. Two
    # rounds over the groups, each group twice in a row: the pair shares, the next round finds
    # most prefixes evicted.
    by_group = shared_prefix_prompts(6, 4, 48, 9)
    prompts = [by_group[g + 6 * k] for r in range(2) for g in range(6) for k in (2 * r, 2 * r + 1)]
    on, _, outs_on, _ = run_on_off(model_dir, prompts, greedy(8), num_blocks=16, max_model_len=128,
                                   max_num_seqs=2)
    pool = on.llm_engine.kv_manager.pool
    assert pool.num_evictions > 0
    assert sum(o.num_cached_tokens == 48 for o in outs_on) >= 12
    pool.check_invariants()
    assert pool.num_used_blocks == 0


def test_greedy_equal_with_preemption(model_dir):
    prompts = shared_prefix_prompts(2, 3, 33, 6)
    params = greedy(48)
    on, off, _, _ = run_on_off(model_dir, prompts, params, num_blocks=16, max_model_len=128)
    assert on.llm_engine.scheduler.num_preemptions > 0
    assert off.llm_engine.scheduler.num_preemptions > 0
    assert on.llm_engine.stats.prefix_hits > 0


def test_greedy_equal_with_chunked_prefill(model_dir):
    prompts = shared_prefix_prompts(2, 3, 70, 20)
    _, _, outs_on, _ = run_on_off(model_dir, prompts, greedy(6), max_num_batched_tokens=24)  # 90-token prompts
    assert all(o.num_cached_tokens == 64 for o in outs_on[2:])


def test_prompt_logprobs_equal_on_and_off(model_dir):
    base = shared_prefix_prompts(1, 3, 40, 8)
    prompts = [base[0], base[1], base[0], base[2]]  # later ones would hit the first one's blocks
    params = [greedy(4), SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)] * 2
    _, _, outs_on, outs_off = run_on_off(model_dir, prompts, params)
    for on, off in zip(outs_on, outs_off):
        if on.prompt_logprobs is None:
            assert off.prompt_logprobs is None
            continue
        assert on.num_cached_tokens == 0, "a prompt-logprobs request computes its whole prompt"
        assert len(on.prompt_logprobs) == len(on.prompt_token_ids) and on.prompt_logprobs[0] is None
        for d_on, d_off in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:]):
            assert d_on.keys() == d_off.keys()
            for tok in d_on:
                assert d_on[tok].rank == d_off[tok].rank
                assert math.isclose(d_on[tok].logprob, d_off[tok].logprob, abs_tol=1e-5)


# -- parallel sampling ---------------------------------------------------------------------------------
def test_n4_shares_the_prompt_blocks(model_dir):
    prompt = random_prompts(1, 100, 100, 512, seed=3)[0]  # 6 full blocks + 4 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    shared = make_llm(model_dir, True)
    peak_shared = PeakBlocks(shared)
    out = shared.generate(prompt, params, use_tqdm=False)[0]
    separate = make_llm(model_dir, False)
    peak_separate = PeakBlocks(separate)
    separate.generate([prompt] * 4, params.clone(n=1), use_tqdm=False)
    per_request = -(-(100 + 20 - 1) // BS)  # KV is computed for every token but the last sampled one
    assert peak_separate.peak == 4 * per_request
    assert peak_shared.peak == 6 + 4 * (per_request - 6)  # the 6 full prompt blocks are held once
    assert len(out.outputs) == 4 and out.num_cached_tokens == 0
    stats = shared.llm_engine.stats
    assert (stats.prefix_queries, stats.prefix_hits) == (4 * 100, 3 * 96)


def test_seeded_n4_is_reproducible(model_dir):
    prompt = random_prompts(1, 50, 50, 512, seed=4)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=16)
    first = make_llm(model_dir).generate(prompt, params, use_tqdm=False)[0]
    llm = make_llm(model_dir)
    llm.generate(random_prompts(3, 20, 60, 512, seed=9), greedy(4), use_tqdm=False)  # other traffic
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    warm = llm.generate(prompt, params, use_tqdm=False)[0]  # every sample now hits the cache
    assert warm.num_cached_tokens == 48
    samples = [o.token_ids for o in first.outputs]
    assert [o.token_ids for o in again.outputs] == samples
    assert [o.token_ids for o in warm.outputs] == samples
    assert len({tuple(s) for s in samples}) == 4, "each sample has its own random stream"


def test_n4_greedy_matches_a_single_greedy_request(model_dir):
    prompt = random_prompts(1, 37, 37, 512, seed=6)[0]
    llm = make_llm(model_dir)
    one = llm.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    llm.reset_prefix_cache()
    four = llm.generate(prompt, SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [o.token_ids for o in four.outputs] == [one] * 4


# -- salts, reset, flag, metrics -----------------------------------------------------------------------
def test_different_cache_salts_never_share(model_dir):
    prompt = random_prompts(1, 40, 40, 512, seed=8)[0]
    llm = make_llm(model_dir)
    outs = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"},
                         {"prompt_token_ids": prompt, "cache_salt": "tenant-b"},
                         {"prompt_token_ids": prompt},
                         {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], greedy(4), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 32]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    again = llm.generate(prompt, greedy(4), use_tqdm=False, cache_salt="tenant-b")[0]
    assert again.num_cached_tokens == 32


def test_reset_prefix_cache_drops_unreferenced_blocks(model_dir):
    prompt = random_prompts(1, 40, 40, 512, seed=10)[0]
    llm = make_llm(model_dir)
    llm.generate(prompt, greedy(4), use_tqdm=False)
    pool = llm.llm_engine.kv_manager.pool
    assert pool.counts().cached == 2 and pool.num_used_blocks == 0
    assert llm.reset_prefix_cache() is True
    assert pool.counts().cached == 0 and pool.num_cached_blocks == 0
    assert llm.generate(prompt, greedy(4), use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(prompt, greedy(4), use_tqdm=False)[0].num_cached_tokens == 32


def test_reset_prefix_cache_reports_blocks_still_in_use(model_dir):
    prompt = random_prompts(1, 40, 40, 512, seed=11)[0]
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    engine.add_request("running", {"prompt_token_ids": prompt}, greedy(8))
    engine.step()  # the prompt's full blocks are cached and held by the running request
    assert engine.kv_manager.pool.num_cached_blocks > 0
    assert llm.reset_prefix_cache() is False, "blocks in use keep their entries: the reset is partial"
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    assert engine.kv_manager.pool.num_cached_blocks == 0


def test_reset_prefix_cache_reports_a_running_request_without_full_blocks(model_dir):
    """A prompt shorter than a block holds no cached block yet, but its block enters the cache when it
    fills: the reset is not complete while it runs."""
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    engine.add_request("short", {"prompt_token_ids": list(range(1, BS // 2))}, greedy(BS))
    engine.step()
    assert engine.kv_manager.pool.num_cached_blocks == 0 and engine.kv_manager.pool.num_used_blocks == 1
    assert llm.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True


def test_no_enable_prefix_caching_flag(model_dir):
    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args([]), model_dir).enable_prefix_caching is True
    args = parser.parse_args(["--no-enable-prefix-caching", "--dtype", "float32",
                              "--kv-cache-memory-bytes", str(64 * BLOCK_BYTES), "--max-model-len", "256"])
    config = engine_config_from_args(args, model_dir)
    assert config.enable_prefix_caching is False
    llm = LLM(**{f: getattr(config, f) for f in ("model", "dtype", "kv_cache_memory_bytes", "max_model_len",
                                                 "enable_prefix_caching")})
    prompt = random_prompts(1, 40, 40, 512, seed=11)[0]
    outs = llm.generate([prompt, prompt], greedy(4), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert llm.llm_engine.kv_manager.pool.num_cached_blocks == 0


def test_prefix_cache_metrics(model_dir):
    prompts = shared_prefix_prompts(1, 2, 32, 8, seed=12)
    llm = make_llm(model_dir)
    for p in prompts:  # one after the other: the second hits the first one's two full blocks
        llm.generate(p, greedy(4), use_tqdm=False)
    stats = llm.llm_engine.stats
    assert (stats.prefix_queries, stats.prefix_hits) == (80, 32)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4)


def test_bf16_cached_chat_equals_uncached_on_the_default_model():
    """In bf16 too, a repeated chat gives the same answer from the prefix cache: prompt tokens always
    take the same GEMM whatever the chunk's size, and attention reads each token's prefix the same way,
    so the few tokens computed after a hit round exactly as in the full prefill. (This prompt's first
    token is a near tie: a small-batch kernel for those last tokens flips it.) Then 24 requests sharing
    12 full blocks with 3 tokens of their own, caching on and off."""
    sp = SamplingParams(temperature=0, max_tokens=12)
    # plain bf16 weights (the GGUF dequantized at load): kept in its blocks, the decodes of a few requests
    # take the streaming kernel, which rounds otherwise than a batch's (batch-invariant mode is off there)
    plain = dict(quantization="none")
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 << 20, **plain)
    messages = [{"role": "user", "content": "Name three colors."}]
    first, again = (llm.chat(messages, sp, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    prefix = random_prompts(1, 192, 192, 49000, seed=11)[0]
    prompts = [{"prompt_token_ids": prefix + p} for p in random_prompts(24, 3, 3, 49000, seed=12)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cached = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    del llm
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
              **plain)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == cached


def test_n_samples_with_prompt_logprobs_compute_the_prompt_once(model_dir):
    """Only the first sample computes the prompt (prompt logprobs need every row's logits); the others
    read its blocks, as samples without prompt logprobs do."""
    prompt = random_prompts(1, 40, 40, 512, seed=12)[0]
    llm = make_llm(model_dir)
    before = llm.llm_engine.stats.num_prompt_tokens
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    computed = llm.llm_engine.stats.num_prompt_tokens - before
    assert computed == 40 + 2 * (40 - 32), f"{computed} prompt tokens computed for 3 samples of a 40-token prompt"
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == 40
    single = llm.generate({"prompt_token_ids": prompt}, params.clone(n=1), use_tqdm=False)[0]
    for pos in range(1, 40):
        tok = prompt[pos]
        assert out.prompt_logprobs[pos][tok].logprob == pytest.approx(single.prompt_logprobs[pos][tok].logprob,
                                                                      abs=1e-5)
