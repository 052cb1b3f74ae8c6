"""Batch-invariant mode (batch_invariant=True): each request's logprobs are bitwise the same whatever else
runs in the same steps. The same prompts (greedy and seeded sampled requests mixed) run one at a time,
all at once, with a 37-token step budget (chunks cut at other places, mixed with others' decodes), a
second time on a warm prefix cache, and under forced preemption (recomputed after being evicted); the
logprob of every generated token must be equal as a float, not merely close. On the default model in
bf16 and on tiny random Llama, Mixtral and Jamba models in fp32 and bf16. Without the mode the same
comparison shows differences (the last test), so these tests can fail."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import random_prompts, save_tiny_model, tiny_config
from tests.test_hybrid import save_tiny_hybrid
from tidal import LLM, SamplingParams
from tidal.layers.gguf_kernels import invariant_supported
from tidal.native import isa_override, runnable_isas

TINY_ENGINE = {"max_model_len": 128, "block_size": 4, "max_tokens": 40}
# Jamba: at least half a cache goes to KV, about 130 tokens per state slot: requests long enough that four
# outgrow their KV blocks under a tight cache
JAMBA_ENGINE = {"max_model_len": 192, "block_size": 4, "max_tokens": 100}
SMOLLM2_ENGINE = {"max_model_len": 128, "block_size": 16, "max_tokens": 8}


def _params(i: int, max_tokens: int) -> SamplingParams:
    if i % 3 == 2:  # a seeded sampled request: its draws do not depend on its neighbours either
        return SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True,
                              logprobs=0)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def _results(outs) -> list[tuple[list[int], list[float]]]:
    """Per request: its tokens and the logprob of each (as floats, compared exactly)."""
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return res


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int, indices: list[int] | None = None):
    indices = list(range(len(prompts))) if indices is None else indices
    return _results(llm.generate([{"prompt_token_ids": prompts[i]} for i in indices],
                                 [_params(i, max_tokens) for i in indices], use_tqdm=False))


def _tight_cache(llm: LLM, num_slots: int, kv_tokens: int) -> int:
    """A cache budget of about num_slots Mamba state slots and kv_tokens tokens of KV, for an engine set up
    as llm (as tests/test_hybrid.py's _budget)."""
    runner = llm.llm_engine.runner
    state, kv = runner.state_bytes_per_request(), runner.kv_bytes_per_token()
    if llm.llm_engine.scheduler.state_checkpoints is not None:
        state *= 2
    if state and kv:
        return max(2 * num_slots * state, num_slots * state + kv_tokens * kv)
    return num_slots * state if state else kv_tokens * kv


def _scenarios(path: str | None, dtype: str, prompts: list[list[int]], engine: dict, invariant: bool = True,
               big: int | None = None) -> dict:
    """The results of each way of running the prompts (path None: the default model); big: the cache of the
    unconstrained engines (enough to keep every prompt's blocks for the warm second run)."""
    engine = dict(engine)
    n = engine.pop("max_tokens")
    common = {**engine, "dtype": dtype, "batch_invariant": invariant}
    model = [] if path is None else [path]
    big = big or (16 << 20 if path is not None else 64 << 20)
    alone_llm = LLM(*model, enable_prefix_caching=False, kv_cache_memory_bytes=big, **common)
    got = {"alone": [_generate(alone_llm, prompts, n, [i])[0] for i in range(len(prompts))],
           "batch": _generate(alone_llm, prompts, n)}
    chunked = LLM(*model, max_num_batched_tokens=37, kv_cache_memory_bytes=big, **common)
    got["chunked 37"] = _generate(chunked, prompts, n)
    hits = chunked.llm_engine.kv_manager.prefix_hits
    got["warm prefix cache"] = _generate(chunked, prompts, n)
    assert chunked.llm_engine.kv_manager.prefix_hits > hits
    small = LLM(*model, max_num_batched_tokens=64, enable_prefix_caching=False,
                kv_cache_memory_bytes=_tight_cache(alone_llm, 4, engine["max_model_len"] + 8), **common)
    got["preempted"] = _generate(small, prompts, n)
    assert small.llm_engine.scheduler.num_preemptions > 0
    return got


def _differences(got: dict) -> list[str]:
    ref = got["alone"]
    bad = []
    for name, res in got.items():
        for i, (r, w) in enumerate(zip(res, ref)):
            if r != w:
                bad.append(f"{name}: request {i}")
    return bad


def _tiny_path(tmp_path_factory, kind: str) -> str:
    path = str(tmp_path_factory.mktemp(f"inv-{kind}"))
    if kind == "llama":
        return save_tiny_model(path, tiny_config("llama", vocab_size=256), seed=0)
    save_tiny_hybrid(kind, path)
    return path


PROMPTS = random_prompts(12, 3, 60, 256, seed=5)


def test_fp8_kv_cache_is_batch_invariant(tmp_path_factory):
    engine = {**TINY_ENGINE, "kv_cache_dtype": "fp8"}
    got = _scenarios(_tiny_path(tmp_path_factory, "llama"), "bfloat16", PROMPTS, engine)
    assert _differences(got) == []


@pytest.mark.parametrize("kwargs,message", [
    ({"quantization": "int8"}, "quantization 'int8' is not supported"), ({"dtype": "float16"}, "not 'float16'"),
    ({"device": "cuda"}, "install triton")])
def test_what_the_mode_does_not_cover_is_refused(monkeypatch, kwargs, message):
    from tidal import config
    from tidal.config import EngineConfig
    from tidal.layers import triton_utils
    monkeypatch.setattr(config, "resolve_device", lambda d: "cpu" if d == "auto" else d)  # "cuda" without a GPU
    monkeypatch.setattr(triton_utils, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=message):
        EngineConfig(batch_invariant=True, **kwargs)


def test_on_cuda_the_mode_is_taken_when_asked_for_with_triton(monkeypatch):
    from tidal import config
    from tidal.config import EngineConfig
    from tidal.layers import triton_utils
    monkeypatch.setattr(config, "resolve_device", lambda d: "cpu" if d == "auto" else d)  # "cuda" without a GPU
    monkeypatch.setattr(triton_utils, "triton_available", lambda: True)
    assert EngineConfig(batch_invariant=True, device="cuda").batch_invariant
    assert not EngineConfig(device="cuda").batch_invariant  # not by default there


@pytest.mark.parametrize("kwargs,on", [
    ({}, True), ({"dtype": "float32"}, True), ({"dtype": "bfloat16"}, True), ({"quantization": "int8"}, False),
    ({"dtype": "float16"}, False), ({"device": "cuda"}, False), ({"batch_invariant": False}, False)])
def test_the_mode_is_on_by_default_where_it_is_supported(monkeypatch, kwargs, on):
    from tidal import config
    from tidal.config import EngineConfig
    monkeypatch.setattr(config, "resolve_device", lambda d: "cpu" if d == "auto" else d)  # "cuda" without a GPU
    assert EngineConfig(**kwargs).batch_invariant is on


def test_the_default_model_runs_in_the_mode_with_packed_weights():
    """The default model with plain weights (its GGUF dequantized at load): batch-invariant, its bf16
    weights packed (bf16 activations on a CPU with AVX-512 BF16, fp32 ones on AVX2 and up: what dtype auto
    picks on each), and a decode alone gives the bits it gets inside a batch
    of others. Kept in its GGUF blocks (the default for a .gguf file) the mode is off unless asked for."""
    from tidal.layers.cpu_kernels import packed_gemm_available
    assert not LLM(max_model_len=128, kv_cache_memory_bytes=16 << 20).llm_engine.config.batch_invariant
    llm = LLM(max_model_len=128, kv_cache_memory_bytes=64 << 20, quantization="none")
    assert llm.llm_engine.config.batch_invariant
    packed = [p for p in llm.llm_engine.runner.model.parameters() if getattr(p, "bf16_packed", None)]
    assert bool(packed) == packed_gemm_available(llm.llm_engine.dtype)
    prompts = random_prompts(6, 3, 40, 49152, seed=5)
    alone = [_generate(llm, prompts, 6, [i])[0] for i in range(len(prompts))]
    assert _generate(llm, prompts, 6) == alone


@pytest.mark.skipif("avx2" not in runnable_isas(), reason="this CPU cannot run the AVX2 kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_avx2_kernels_are_batch_invariant_too(tmp_path_factory, kind, dtype):
    """The AVX2 build (TIDAL_CPU_ISA=avx2 on an AVX-512 machine): bf16 products widened to fp32 there."""
    path = _tiny_path(tmp_path_factory, kind)
    with isa_override("avx2"):
        assert _differences(_scenarios(path, dtype, PROMPTS, TINY_ENGINE)) == []


@pytest.mark.parametrize("kind,dtype,n", [
    ("smollm2", "bfloat16", 32), pytest.param("smollm2", "bfloat16", 64, marks=pytest.mark.slow),
    pytest.param("smollm2", "float32", 64, marks=pytest.mark.slow),
    *[(kind, dtype, 64) for kind in ("llama", "mixtral") for dtype in ("float32", "bfloat16")],
    ("jamba", "bfloat16", 16), pytest.param("jamba", "bfloat16", 64, marks=pytest.mark.slow),
    pytest.param("jamba", "float32", 64, marks=pytest.mark.slow)])
def test_64_prompts_logprobs_do_not_depend_on_the_batch(tmp_path_factory, kind, dtype, n):
    """64 prompts per model (greedy and seeded sampled mixed), each way of running them against one at a
    time: tiny Llama and Mixtral in both dtypes; the default model in bf16 with 32 of the prompts and tiny
    Jamba in bf16 with 16 (all 64 of them, and fp32, with -m slow: 40-118 s each on a Zen 3, 2 cores)."""
    if kind == "smollm2":
        path, engine, prompts = None, SMOLLM2_ENGINE, random_prompts(64, 3, 80, 49152, seed=11)[:n]
        if dtype == "float32":  # the mode runs GGUF blocks with bf16 activations only: plain fp32 weights
            engine = {**engine, "quantization": "none"}
        elif not invariant_supported(torch.bfloat16):  # GGUF blocks in the mode need AVX-512 BF16 (a clear
            # error without it): a CPU without it runs what dtype "auto" picks there, fp32 on bf16 weights
            dtype, engine = "auto", {**engine, "quantization": "none"}
    else:
        path = _tiny_path(tmp_path_factory, kind)
        engine = JAMBA_ENGINE if kind == "jamba" else TINY_ENGINE
        prompts = random_prompts(64, 3, 60, 256, seed=11)[:n]
    # a cache that holds all 64 prompts' blocks, so the second run hits them
    assert _differences(_scenarios(path, dtype, prompts, engine, big=256 << 20)) == []


@pytest.mark.parametrize("kind,dtype", [("mixtral", "float32"), ("jamba", "bfloat16")])
def test_without_the_mode_the_batch_changes_logprobs(tmp_path_factory, kind, dtype):
    """The same comparison with batch_invariant=False finds differences (the experts' products through
    torch's GEMM, whose kernel depends on how many rows an expert takes; Mamba decodes on their own batched
    path), so the tests above can fail. (The dense bf16 layers are invariant in both modes once packed.)"""
    engine = JAMBA_ENGINE if kind == "jamba" else TINY_ENGINE
    got = _scenarios(_tiny_path(tmp_path_factory, kind), dtype, PROMPTS, engine, invariant=False)
    assert _differences(got) != []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_decoding_changes_no_logprob(tmp_path_factory, dtype):
    """n-gram drafts verified several tokens per request per step, alone or in a batch: the same tokens
    and logprobs as plain decoding one request at a time."""
    path = _tiny_path(tmp_path_factory, "llama")
    prompts = [p + p[:20] + p[:20] for p in PROMPTS]  # repeats, so that drafts are proposed and accepted
    common = {"dtype": dtype, "batch_invariant": True, "max_model_len": 256, "block_size": 4,
              "kv_cache_memory_bytes": 16 << 20}
    plain = LLM(path, enable_prefix_caching=False, **common)
    ref = [_generate(plain, prompts, 40, [i])[0] for i in range(len(prompts))]
    spec = LLM(path, max_num_batched_tokens=37, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}, **common)
    assert [_generate(spec, prompts, 40, [i])[0] for i in range(len(prompts))] == ref
    assert _generate(spec, prompts, 40) == ref
    assert spec.llm_engine.stats.spec_num_accepted_tokens > 0
