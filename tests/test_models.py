"""Tiny random Llama-family models through the real loader against transformers (fp32): a batch of
prompts of different lengths, run with chunked prefill (every chunk shorter than the prompts) and a
small block size, must give transformers' full-sequence prompt logprobs within 1e-4 and transformers'
greedy `generate` token for token."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_greedy, hf_model, hf_prompt_logprobs, random_prompts, tiny_llm
from tidal import SamplingParams

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# name -> (arch, config overrides, block size)
CASES = {
    "llama": ("llama", {}, 4),
    "qwen2": ("qwen2", {}, 8),
    "mistral": ("mistral", {}, 4),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}, 8),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, 4),
    "llama3-rope-scaling": ("llama", {"rope_parameters": LLAMA3_ROPE}, 8),
    "llama-bias-head-dim": ("llama", {"attention_bias": True, "head_dim": 32}, 4),
}

NUM_PROMPTS = 9
MIN_LEN, MAX_LEN = 20, 70
BUDGET = 16  # max_num_batched_tokens: below every prompt length, so every prefill is chunked
MAX_TOKENS = 12
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tiny_model_dir):
    """Generate once per model; the tests below check different parts of the same run."""
    arch, overrides, block_size = CASES[request.param]
    path = tiny_model_dir(arch, **overrides)
    prompts = random_prompts(NUM_PROMPTS, MIN_LEN, MAX_LEN, 512, seed=len(request.param))
    llm = tiny_llm(path, block_size=block_size, max_num_batched_tokens=BUDGET, max_num_seqs=NUM_PROMPTS)
    scheduler = llm.llm_engine.scheduler
    batches = []
    original_schedule = scheduler.schedule

    def spy():
        out = original_schedule()
        batches.append([(sr.request_id, sr.start_pos, sr.num_tokens, sr.num_prompt_tokens)
                        for sr in out.scheduled])
        return out

    scheduler.schedule = spy
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=2, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return request.param, path, prompts, outs, batches


def test_prefill_is_chunked_and_within_budget(run):
    _, _, prompts, _, batches = run
    assert min(len(p) for p in prompts) > BUDGET
    assert len({len(p) for p in prompts}) > 1
    prefill_chunks: dict[str, int] = {}
    for batch in batches:
        assert sum(n for _, _, n, _ in batch) <= BUDGET
        for rid, start, n, num_prompt in batch:
            if start < num_prompt:
                prefill_chunks[rid] = prefill_chunks.get(rid, 0) + 1
    assert len(prefill_chunks) == len(prompts)
    assert all(c >= 2 for c in prefill_chunks.values()), prefill_chunks
    # decodes ran in the same steps as other requests' prefill chunks
    assert any(any(n == 1 and s >= p for _, s, n, p in b) and any(s < p for _, s, _, p in b) for b in batches)


def test_prompt_logprobs_match_transformers(run):
    name, path, prompts, outs, _ = run
    hf = hf_model(path)
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        ref = hf_prompt_logprobs(hf, prompt)
        with torch.no_grad():
            ref_top = hf(torch.tensor([prompt])).logits[0].float().topk(2).indices.tolist()
        for pos in range(1, len(prompt)):
            ranked = {lp.rank: t for t, lp in out.prompt_logprobs[pos].items()}
            assert [ranked[1], ranked[2]] == ref_top[pos - 1], f"{name}: prompt top-2 differ at {pos}"
            entry = out.prompt_logprobs[pos]
            assert prompt[pos] in entry
            worst = max(worst, abs(entry[prompt[pos]].logprob - ref[pos - 1]))
            top = sorted(entry.values(), key=lambda lp: -lp.logprob)[:2]
            assert [lp.rank for lp in top] == [1, 2]
    assert worst < TOLERANCE, f"{name}: prompt logprobs differ from transformers by {worst}"


def test_greedy_matches_transformers_generate(run):
    name, path, prompts, outs, _ = run
    hf = hf_model(path)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].finish_reason == "length"
        expected = hf_greedy(hf, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{name}: prompt {i} diverges from transformers"


def test_decode_logprobs_match_transformers(run):
    """Logprobs of the generated tokens (computed by decode steps through the paged KV cache) equal
    transformers' full forward over prompt + output, top-2 included."""
    name, path, prompts, outs, _ = run
    hf = hf_model(path)
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        sample = out.outputs[0]
        ids = prompt + sample.token_ids
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for k, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            ref = lp[len(prompt) - 1 + k]
            top_vals, top_ids = ref.topk(2)
            assert set(entry) == set(top_ids.tolist()), f"{name}: top-2 differ at output {k}"
            worst = max(worst, abs(entry[token].logprob - ref[token].item()),
                        *(abs(entry[t].logprob - v) for t, v in zip(top_ids.tolist(), top_vals.tolist())))
    assert worst < TOLERANCE, f"{name}: decode logprobs differ from transformers by {worst}"


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_odd_token_budgets_split_prompts_anywhere(tiny_model_dir, budget):
    """Budgets that cut prompts off block boundaries (1 = one token per step: every chunk is a
    decode-shaped step) still give transformers' logprobs and greedy tokens."""
    path = tiny_model_dir("llama")
    prompts = random_prompts(4, 9, 23, 512, seed=budget)
    llm = tiny_llm(path, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outs):
        ref = hf_prompt_logprobs(hf, prompt)
        got = [out.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(got, ref)) < TOLERANCE
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 5)
