"""Mixtral, Jamba and Mamba split across worker processes (gloo): tensor parallelism splits the Mamba
mixers' d_inner, the experts' intermediate dimension and the attention heads as they load; pipeline
parallelism gives each stage a contiguous range of layers, holding the KV cache and Mamba state of
its own layers only. Greedy tokens and logprobs must equal the single-process engine's.

Each model and reference run is built once per module: worker start-up is the cost here.
"""
from __future__ import annotations

import pytest

from tests.helpers import random_prompts
from tests.test_hybrid import ENGINE as HYBRID_ENGINE
from tests.test_hybrid import GREEDY, PROMPTS, VOCAB, save_tiny_hybrid
from tests.test_parallel import PARAMS, _assert_same
from tidal import LLM, SamplingParams

ENGINE = {**HYBRID_ENGINE, "kv_cache_memory_bytes": 4 << 20, "max_num_seqs": 8}
PP_PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(4, 3, 40, VOCAB, seed=2)]
# per attention layer: K, V x 2 KV heads x 16 dims x fp32; per Mamba layer (d_inner 128, d_conv 4,
# d_state 8): conv inputs 128 x 3 plus the SSM state 128 x 8, fp32
KV_BYTES_PER_LAYER, STATE_BYTES_PER_LAYER = 2 * 2 * 16 * 4, 128 * 3 * 4 + 128 * 8 * 4


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # workers share the machine's cores with everything else


def _run(path, **parallel):
    """(outputs, worker infos, (KV bytes per token, state bytes per request) of the rank needing most)."""
    llm = LLM(path, **ENGINE, **parallel)
    engine = llm.llm_engine
    try:
        sizes = (engine.kv_plan.bytes_per_token, engine.executor.state_bytes_per_request())
        return llm.generate(PP_PROMPTS, PARAMS, use_tqdm=False), engine.executor.worker_infos, sizes
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=["mixtral", "jamba", "mamba"])
def model(request, tmp_path_factory):
    """(kind, checkpoint path, single-process outputs)."""
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_hybrid(request.param, path)
    return request.param, path, _run(path)[0]


# layers of each stage (pp = 2), and of each stage: (attention layers, Mamba layers).
# Jamba: attention at 2 and 6 of 8 layers, so each stage holds one attention and three Mamba layers.
STAGES = {"mixtral": ([(0, 1), (1, 2)], (1, 0)), "jamba": ([(0, 4), (4, 8)], (1, 3)),
          "mamba": ([(0, 2), (2, 3)], (0, 2))}


def test_pp2_matches_single_process_and_sizes_caches_per_stage(model):
    kind, path, ref = model
    outs, infos, sizes = _run(path, pipeline_parallel_size=2)
    _assert_same(ref, outs)
    ranges, (attn, mamba) = STAGES[kind]
    assert [i.layers for i in infos] == ranges
    # a stage holds the KV cache and state of its own layers (all ranks get the larger stage's sizing)
    assert sizes == (attn * KV_BYTES_PER_LAYER, mamba * STATE_BYTES_PER_LAYER)


def test_tp2_pp2_matches_single_process(model):
    kind, path, ref = model
    outs, infos, sizes = _run(path, tensor_parallel_size=2, pipeline_parallel_size=2)
    _assert_same(ref, outs)
    assert [(i.tp_rank, i.pp_rank, i.layers) for i in infos] == [
        (t, p, STAGES[kind][0][p]) for p in (0, 1) for t in (0, 1)]
    _, (attn, mamba) = STAGES[kind]
    assert sizes == (attn * KV_BYTES_PER_LAYER // 2, mamba * STATE_BYTES_PER_LAYER // 2)  # half the heads, d_inner


def test_jamba_with_tensor_parallel_2_equals_single_process(tmp_path):
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    outs = {}
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, kv_cache_memory_bytes=8 << 20, **HYBRID_ENGINE)
        try:
            outs[tp] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
    for single, parallel in zip(outs[1], outs[2]):
        assert parallel.outputs[0].token_ids == single.outputs[0].token_ids
        for a, b in zip(parallel.prompt_logprobs[1:], single.prompt_logprobs[1:]):
            assert list(a) == list(b)
            assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) < 1e-4


def test_jamba_pp2_prefix_cache_hits_restore_the_mamba_state_on_every_stage(tmp_path):
    """As test_hybrid's prefix-cache test, with the layers split over two stages: each stage writes and
    restores the checkpoints of its own Mamba layers, at the same state indices."""
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    base = PROMPTS[4]
    prompts = [base, base + [11, 12, 13, 14, 15, 16, 17], base[:20], base]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outs = {}
    for pp in (1, 2):  # the reference without prefix caching
        llm = LLM(path, pipeline_parallel_size=pp, enable_prefix_caching=pp == 2,
                  **{**ENGINE, "max_num_batched_tokens": 64})
        try:
            outs[pp] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
            num_hits = pp == 2 and llm.llm_engine.scheduler.state_checkpoints.num_hits
        finally:
            llm.llm_engine.shutdown()
    assert [o.num_cached_tokens for o in outs[2]] == [0, 32, 0, 32]
    assert num_hits == 2
    for a, b in zip(outs[1], outs[2]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(next(iter(la.values())).logprob - next(iter(lb.values())).logprob) < 1e-4
