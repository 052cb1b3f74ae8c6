"""Jamba (attention + Mamba + MoE), Mamba and Mixtral through the whole engine, against transformers
(fp32, its PyTorch Mamba path): prompt logprobs of a mixed-length batch run with chunked prefill and
small blocks, greedy continuations, runs starved of KV blocks (preemption) or of state slots, and the
state-slot bookkeeping.

The models are tiny random checkpoints saved as safetensors so the real loader runs. Weights are
widened from transformers' init so logits are not flat, and the Mamba parameters are set so the
recurrent state matters over tens of tokens: dt = softplus(bias) in about [0.02, 0.3], A in [-4.5, -0.5].
"""
from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import random_prompts
from tidal import LLM, SamplingParams

VOCAB = 256
MAX_TOKENS = 8
ENGINE = {"dtype": "float32", "max_model_len": 128, "block_size": 4, "max_num_batched_tokens": 16}


def tiny_hybrid_config(kind: str):
    import transformers
    if kind == "jamba":  # 8 layers: attention at 2 and 6, MoE on odd layers, GQA 4:2
        return transformers.JambaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False, max_position_embeddings=512)
    if kind == "mamba":
        return transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8,
                                        expand=2, conv_kernel=4, time_step_rank=8)
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512)


def save_tiny_hybrid(kind: str, path: str, seed: int = 0, config=None):
    """Save a seeded random model of `kind` (or of config) to path; returns the transformers model
    (fp32, eval)."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config or tiny_hybrid_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif name.endswith("dt_proj.bias"):
                p.uniform_(-4, -1)
            elif p.dim() > 1:
                p.normal_(0, 0.15 if kind == "mamba" else 0.08)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # fixed-length greedy runs, like the engine's ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def run(path: str, prompts: list[list[int]], params: SamplingParams, **engine) -> tuple[list, LLM]:
    llm = LLM(path, **{**ENGINE, **engine})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, llm


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0)
PROMPTS = random_prompts(6, 3, 45, VOCAB, seed=1)  # chunks of 16 tokens: most prompts take several steps


@pytest.fixture(scope="module", params=["jamba", "mamba", "mixtral"])
def case(request, tmp_path_factory):
    """(kind, checkpoint path, transformers model, engine outputs, engine, batches) for one model kind;
    batches: per step, the number of tokens each scheduled request computed."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny_hybrid(request.param, path)
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, **ENGINE)
    runner, batches = llm.llm_engine.runner, []
    execute = runner.execute

    def recording_execute(so):
        batches.append([r.num_tokens for r in so.scheduled])
        return execute(so)
    runner.execute = recording_execute
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return request.param, path, hf, outs, llm, batches


def test_prompt_logprobs_with_chunked_prefill_match_transformers(case):
    kind, _, hf, outs, _, _ = case
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            worst = max(worst, abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()))
    assert worst < 1e-4, f"{kind}: worst prompt logprob difference {worst:.2e}"


def test_greedy_continuations_equal_transformers_generate(case):
    kind, _, hf, outs, _, _ = case
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist(), f"{kind}: prompt of {len(prompt)} tokens"


def test_one_forward_carries_decodes_and_prefill_chunks_together(case):
    *_, batches = case
    assert any(1 in b and any(n > 1 for n in b) for b in batches)  # mixed steps happened
    assert any(sum(b) == ENGINE["max_num_batched_tokens"] and len(b) > 1 for b in batches)


def test_every_state_slot_is_returned_after_the_batch(case):
    kind, _, _, _, llm, _ = case
    pool = llm.llm_engine.scheduler.state_pool
    if kind == "mixtral":
        assert pool is None  # no Mamba layers, no state pool
        return
    pool.check_invariants()
    assert pool.num_free_slots == pool.num_slots


def test_kv_cache_is_allocated_for_attention_layers_only(case):
    kind, _, _, _, llm, _ = case
    runner = llm.llm_engine.runner
    num_attn = {"jamba": 2, "mamba": 0, "mixtral": 2}[kind]
    assert len(runner.attn_layers) == num_attn
    assert runner.kv_bytes_per_token() == num_attn * 2 * 2 * 16 * 4  # K,V x 2 KV heads x 16 dims x fp32
    assert len(runner.mamba_layers) == {"jamba": 6, "mamba": 3, "mixtral": 0}[kind]


# -- constrained runs equal unconstrained ones -------------------------------------------------------

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _budget(llm: LLM, num_slots: int, kv_tokens: int) -> int:
    """A cache budget that yields num_slots state slots (half the budget at most goes to state when
    attention shares it) and then about kv_tokens tokens of KV, for an engine configured as llm."""
    runner = llm.llm_engine.runner
    state, kv = runner.state_bytes_per_request(), runner.kv_bytes_per_token()
    if llm.llm_engine.scheduler.state_checkpoints is not None:
        state *= 2  # prefix caching: one state checkpoint per slot
    if state and kv:
        return max(2 * num_slots * state, num_slots * state + kv_tokens * kv)
    return num_slots * state if state else kv_tokens * kv


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_jamba_run_equals_unconstrained_run(tmp_path, prefix_caching):
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    engine = {"max_model_len": 256, "enable_prefix_caching": prefix_caching}
    ref, llm = run(path, PROMPTS, params, kv_cache_memory_bytes=8 << 20, **engine)
    # 3 state slots and 260-396 tokens of KV: three running requests of up to 165 tokens outgrow
    # the blocks, so the newest is preempted (slot and blocks freed) and recomputed later (with
    # prefix caching, from its own prompt's state checkpoint).
    outs, small = run(path, PROMPTS, params, kv_cache_memory_bytes=_budget(llm, 3, 260), **engine)
    assert small.llm_engine.scheduler.state_pool.num_slots == 3
    assert small.llm_engine.scheduler.num_preemptions > 0
    if prefix_caching:  # recomputes resumed from their prompts' checkpoints
        assert small.llm_engine.scheduler.state_checkpoints.num_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    pool = small.llm_engine.scheduler.state_pool
    assert pool.num_free_slots == pool.num_slots


def test_preempted_mixtral_run_equals_unconstrained_run(tmp_path):
    path = str(tmp_path)
    save_tiny_hybrid("mixtral", path)
    ref, llm = run(path, PROMPTS, LONG, kv_cache_memory_bytes=8 << 20)
    outs, small = run(path, PROMPTS, LONG, kv_cache_memory_bytes=_budget(llm, 0, 128))
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_mamba_run_with_two_state_slots_equals_unconstrained_run(tmp_path):
    path = str(tmp_path)
    save_tiny_hybrid("mamba", path)
    ref, llm = run(path, PROMPTS, LONG, kv_cache_memory_bytes=8 << 20)
    outs, small = run(path, PROMPTS, LONG, kv_cache_memory_bytes=_budget(llm, 2, 0))
    assert small.llm_engine.scheduler.state_pool.num_slots == 2
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


# -- engine set-up ------------------------------------------------------------------------------------

def test_hybrid_start_up_logs_the_cache_plan(tmp_path, caplog):
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    with caplog.at_level(logging.INFO):
        llm = LLM(path, kv_cache_memory_bytes=4 << 20, **ENGINE)
    assert "512 bytes per token" in caplog.text and "33792 bytes per request" in caplog.text
    assert "Prefix caching with Mamba layers" in caplog.text
    pool, checkpoints = llm.llm_engine.scheduler.state_pool, llm.llm_engine.scheduler.state_checkpoints
    assert checkpoints.num_checkpoints == pool.num_slots
    assert llm.llm_engine.runner.mamba_layers[0].ssm_state.shape[0] == 2 * pool.num_slots


PC_PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


def _one_at_a_time(llm: LLM, prompts: list[list[int]]) -> list:
    return [llm.generate([{"prompt_token_ids": p}], PC_PARAMS, use_tqdm=False)[0] for p in prompts]


@pytest.mark.parametrize("kind", ["jamba", "mamba"])
def test_prefix_cache_hits_restore_the_mamba_state(kind, tmp_path):
    """A repeated prompt, an extended prompt (a conversation's next turn) and a shorter one after a
    34-token prompt: hits stop at the checkpoint (the prompt's last full 4-token block, 32 tokens),
    and every output equals the engine without prefix caching and transformers."""
    path = str(tmp_path)
    hf = save_tiny_hybrid(kind, path)
    base = PROMPTS[4]
    assert len(base) == 34
    prompts = [base, base + [11, 12, 13, 14, 15, 16, 17], base[:20], base]
    engine = {**ENGINE, "kv_cache_memory_bytes": 4 << 20, "max_num_batched_tokens": 64}
    ref = _one_at_a_time(LLM(path, enable_prefix_caching=False, **engine), prompts)
    llm = LLM(path, enable_prefix_caching=True, **engine)
    outs = _one_at_a_time(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 0, 32]
    assert llm.llm_engine.scheduler.state_checkpoints.num_hits == 2
    for o, r, p in zip(outs, ref, prompts):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) < 1e-5
        expected = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
        assert o.outputs[0].token_ids == expected.tolist()
    llm.llm_engine.scheduler.state_checkpoints.check_invariants()


def test_next_conversation_turn_hits_the_previous_answer(tmp_path):
    """Turn two repeats turn one's prompt (34 tokens) and answer (8 tokens, of which 7 computed) and
    adds a question: the hit reaches the answer's last full block (40 tokens), through the moving
    checkpoint decode steps keep, and turn two equals the uncached engine and transformers."""
    path = str(tmp_path)
    hf = save_tiny_hybrid("jamba", path)
    engine = {**ENGINE, "kv_cache_memory_bytes": 4 << 20, "max_num_batched_tokens": 64}
    turns = {}
    for caching in (False, True):
        llm = LLM(path, enable_prefix_caching=caching, **engine)
        first = _one_at_a_time(llm, [PROMPTS[4]])[0]
        turn2 = PROMPTS[4] + first.outputs[0].token_ids + [21, 22, 23, 24, 25]
        turns[caching] = (turn2, _one_at_a_time(llm, [turn2])[0])
    turn2, cached = turns[True]
    assert cached.num_cached_tokens == 40
    assert cached.outputs[0].token_ids == turns[False][1].outputs[0].token_ids
    expected = hf.generate(torch.tensor([turn2]), max_new_tokens=8, do_sample=False)[0, len(turn2):]
    assert cached.outputs[0].token_ids == expected.tolist()


def test_identical_prompts_in_one_step_wait_for_the_first_ones_checkpoint(tmp_path):
    """The first computes the prompt and checkpoints its state at 32 tokens; the others never read the
    checkpoint before the step that writes it has run: they wait a step, then hit it."""
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    llm = LLM(path, enable_prefix_caching=True, kv_cache_memory_bytes=4 << 20,
              **{**ENGINE, "max_num_batched_tokens": 256})
    stats = llm.llm_engine.stats
    outs = llm.generate([{"prompt_token_ids": PROMPTS[4]}] * 3, PC_PARAMS, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    assert stats.num_prompt_tokens == 34 + 2 * 2
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    later = _one_at_a_time(llm, [PROMPTS[4]])[0]
    assert later.num_cached_tokens == 32 and later.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
def test_n_samples_on_a_hybrid_compute_the_prompt_once(tmp_path, prompt_logprobs):
    """n = 3 (with prompt logprobs, which only the first sample computes): samples 1 and 2 wait for
    sample 0's state checkpoint and compute only the 2 tokens after it."""
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    outs = {}
    for caching in (False, True):
        llm = LLM(path, enable_prefix_caching=caching, kv_cache_memory_bytes=4 << 20,
                  **{**ENGINE, "max_num_batched_tokens": 256})
        params = SamplingParams(n=3, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True,
                                prompt_logprobs=prompt_logprobs)
        outs[caching] = llm.generate({"prompt_token_ids": PROMPTS[4]}, params, use_tqdm=False)[0]
        assert llm.llm_engine.stats.num_prompt_tokens == (34 + 2 * 2 if caching else 3 * 34)
    assert [o.token_ids for o in outs[True].outputs] == [o.token_ids for o in outs[False].outputs]
    if prompt_logprobs is not None:
        assert len(outs[True].prompt_logprobs) == 34


def test_abort_returns_the_state_slot(tmp_path):
    path = str(tmp_path)
    save_tiny_hybrid("mamba", path)
    engine = LLM(path, kv_cache_memory_bytes=1 << 20, **ENGINE).llm_engine
    pool = engine.scheduler.state_pool
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert pool.num_free_slots == pool.num_slots - 1
    engine.abort_request("a")
    assert pool.num_free_slots == pool.num_slots
    pool.check_invariants()


def test_seeded_sampling_with_n_and_streaming_is_independent_of_the_batch(tmp_path):
    """Sampling features on a hybrid: a seeded n=2 request with penalties, top-k/p and a stop token
    streams deltas that add up to its final output, and samples the same tokens alone or beside
    other requests (its Mamba state and random stream are its own)."""
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    params = SamplingParams(n=2, seed=7, temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2,
                            max_tokens=12, stop_token_ids=[5], logprobs=2, ignore_eos=True)
    engine = LLM(path, kv_cache_memory_bytes=4 << 20, **ENGINE).llm_engine

    def sample(with_neighbours: bool) -> tuple[list, list]:
        engine.add_request("r", PROMPTS[2], params.clone(output_kind="delta"))
        if with_neighbours:
            for i, p in enumerate(PROMPTS[3:]):
                engine.add_request(f"other{i}", p, SamplingParams(max_tokens=6, temperature=1.0, seed=i))
        deltas: dict[int, list[int]] = {0: [], 1: []}
        num_logprobs = [0, 0]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "r":
                    for c in out.outputs:
                        deltas[c.index] += c.token_ids
                        num_logprobs[c.index] += len(c.logprobs)
        return [deltas[0], deltas[1]], num_logprobs

    alone, lp_lens = sample(False)
    beside, _ = sample(True)
    assert alone == beside
    assert alone[0] != alone[1]  # two different samples from one seed
    assert lp_lens == [len(alone[0]), len(alone[1])]
    for toks in alone:
        assert 0 < len(toks) <= 12 and 5 not in toks[:-1]


def test_mamba_accepts_a_max_model_len_beyond_its_default(tmp_path):
    """Mamba has no position embeddings: 2048 is only a default, and a 3,000-token prompt runs (in
    chunks of 2,048) and continues as transformers does."""
    path = str(tmp_path)
    hf = save_tiny_hybrid("mamba", path)
    llm = LLM(path, dtype="float32", max_model_len=4096, kv_cache_memory_bytes=1 << 20, max_num_seqs=4)
    prompt = random_prompts(1, 3000, 3000, VOCAB, seed=5)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
    assert out[0].outputs[0].token_ids == expected.tolist()
