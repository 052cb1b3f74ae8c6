"""The engine on an NVIDIA GPU (device="cuda"), and device selection.

The first tests run everywhere: how `device` and `gpu_memory_utilization` are chosen and checked. The
rest need a GPU and are skipped without one (CI has none; benchmarks/gpu_check.sh runs them on a GPU
machine). On the GPU, tiny random models in fp32 must agree with the same engine on CPU and with
transformers (greedy tokens equal, logprobs within 1e-3: TF32 is turned off for these tests, so fp32
means fp32), bf16 must run and stay close to fp32, chunked prefill and preemption must not change a
token, seeded sampling must not depend on the batch, the KV cache must be sized from
gpu_memory_utilization, and a forward must not wait on the GPU.
"""
from __future__ import annotations

import gc
import logging
import warnings

import pytest
import torch

from tests import test_hybrid as hybrid
from tests.helpers import assert_engine_idle, hf_greedy, hf_model, hf_prompt_logprobs, random_prompts, tiny_llm
from tidal import LLM, SamplingParams
from tidal.config import EngineConfig
from tidal.entrypoints.engine_args import add_engine_args, engine_config_from_args

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
GPU_TOLERANCE = 1e-3


# -- device selection: runs everywhere -------------------------------------------------------------

def test_cuda_without_a_gpu_is_refused_naming_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda'"):
        EngineConfig(device="cuda")


def test_auto_picks_cpu_without_a_gpu(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig(device="auto").device == "cpu"
    llm = tiny_llm(tiny_model_dir("llama"), device="auto")
    assert llm.config.device == "cpu"
    assert llm.llm_engine.runner.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in llm.llm_engine.runner.model.parameters())


def test_auto_picks_cuda_when_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(device="auto").device == "cuda"


@pytest.mark.parametrize(("field", "value"), [("device", "tpu"), ("device", "gpu"),
                                              ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5),
                                              ("gpu_memory_utilization", -0.1), ("gpu_memory_utilization", "0.9")])
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_cli_flags_reach_the_config():
    import argparse
    parser = add_engine_args(argparse.ArgumentParser())
    config = engine_config_from_args(parser.parse_args(["--device", "cpu", "--gpu-memory-utilization", "0.5"]))
    assert (config.device, config.gpu_memory_utilization) == ("cpu", 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "tpu"])


def test_profile_run_leaves_the_runner_as_it_was(tiny_model_dir):
    """The profiling forward that sizes the cache on CUDA binds a throwaway cache and unbinds it; it runs
    the same code on CPU, so it is checked here too."""
    llm = tiny_llm(tiny_model_dir("llama"), block_size=4)
    runner = llm.llm_engine.runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 20, 512, seed=4)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    cache = [a.kv_cache for a in runner.attn_layers]
    runner.profile_run(100, 8, 40)  # three sequences (40 + 40 + 20 tokens)
    assert all(a.kv_cache is None for a in runner.attn_layers)
    for a, c in zip(runner.attn_layers, cache):
        a.kv_cache = c
    runner.num_blocks = llm.llm_engine.kv_plan.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == before


# -- on the GPU ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ieee_fp32():
    """fp32 matmuls and convolutions in full fp32 (cuDNN would use TF32 for convolutions by default)."""
    if not torch.cuda.is_available():
        yield
        return
    new_api = hasattr(torch.backends.cudnn, "conv") and hasattr(torch.backends.cudnn.conv, "fp32_precision")
    if new_api:
        saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    else:
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    if new_api:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved
    else:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _greedy_run(path: str, prompts: list[list[int]], **engine) -> list:
    llm = tiny_llm(path, **engine)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_engine_idle(llm.llm_engine)
    return outs


def _worst_prompt_logprob_gap(outs_a, outs_b, prompts) -> float:
    return max(abs(a.prompt_logprobs[i][p[i]].logprob - b.prompt_logprobs[i][p[i]].logprob)
               for a, b, p in zip(outs_a, outs_b, prompts) for i in range(1, len(p)))


@requires_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_on_cuda_equals_cpu_and_transformers(ieee_fp32, tiny_model_dir, arch):
    """Chunked prefill (16-token budget, every prompt longer) and small blocks on both devices."""
    path = tiny_model_dir(arch)
    prompts = random_prompts(8, 20, 70, 512, seed=21)
    engine = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    gpu = _greedy_run(path, prompts, device="cuda", **engine)
    cpu = _greedy_run(path, prompts, device="cpu", **engine)
    hf = hf_model(path)
    for i, (g, c, prompt) in enumerate(zip(gpu, cpu, prompts)):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids, f"{arch}: prompt {i}: cuda and cpu tokens differ"
        assert g.outputs[0].token_ids == hf_greedy(hf, prompt, 12), f"{arch}: prompt {i} differs from transformers"
        ref = hf_prompt_logprobs(hf, prompt)
        worst = max(abs(g.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1]) for pos in range(1, len(prompt)))
        assert worst < GPU_TOLERANCE, f"{arch}: prompt {i}: logprobs differ from transformers by {worst:.2e}"
        for lp_gpu, lp_cpu, tok in zip(g.outputs[0].logprobs, c.outputs[0].logprobs, g.outputs[0].token_ids):
            assert lp_gpu[tok].logprob == pytest.approx(lp_cpu[tok].logprob, abs=GPU_TOLERANCE)
    assert _worst_prompt_logprob_gap(gpu, cpu, prompts) < GPU_TOLERANCE
    _free_gpu()


@requires_cuda
def test_jamba_fp32_on_cuda_equals_cpu_and_transformers(ieee_fp32, tmp_path):
    """Attention + Mamba (torch scan on the GPU) + MoE, chunked, with preemption-free small blocks."""
    hf = hybrid.save_tiny_hybrid("jamba", str(tmp_path))
    prompts = hybrid.PROMPTS
    engine = dict(hybrid.ENGINE, kv_cache_memory_bytes=8 << 20)
    gpu, llm = hybrid.run(str(tmp_path), prompts, hybrid.GREEDY, device="cuda", **engine)
    assert llm.llm_engine.runner.device.type == "cuda"
    assert all(m.ssm_state.device.type == "cuda" for m in llm.llm_engine.runner.mamba_layers)
    cpu, _ = hybrid.run(str(tmp_path), prompts, hybrid.GREEDY, device="cpu", **engine)
    for i, (g, c, prompt) in enumerate(zip(gpu, cpu, prompts)):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids, f"jamba: prompt {i}: cuda and cpu tokens differ"
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=hybrid.MAX_TOKENS, do_sample=False)[0, len(prompt):]
        assert g.outputs[0].token_ids == ref.tolist(), f"jamba: prompt {i} differs from transformers"
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for pos in range(1, len(prompt)):
            got = g.prompt_logprobs[pos][prompt[pos]].logprob
            assert got == pytest.approx(lp[pos - 1, prompt[pos]].item(), abs=GPU_TOLERANCE), f"prompt {i} pos {pos}"
    pool = llm.llm_engine.scheduler.state_pool
    assert pool.num_free_slots == pool.num_slots
    _free_gpu()


@requires_cuda
def test_bf16_on_cuda_runs_and_stays_close_to_fp32(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = random_prompts(6, 10, 60, 512, seed=5)
    llm = tiny_llm(path, device="cuda", dtype="bfloat16", block_size=8)
    runner = llm.llm_engine.runner
    assert runner.dtype == torch.bfloat16
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert all(a.kv_cache.device.type == "cuda" for a in runner.attn_layers)
    # one copy of each weight: nothing prepacked beside the parameters
    assert all(getattr(m, "packed_weight", None) is None for m in runner.model.modules())
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = hf_model(path)
    gaps = []
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 16 and all(0 <= t < 512 for t in tokens)
        ref = hf_prompt_logprobs(hf, prompt)
        gaps += [abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1]) for pos in range(1, len(prompt))]
    assert all(g == g for g in gaps), "NaN logprobs"
    assert sum(gaps) / len(gaps) < 0.1 and max(gaps) < 1.0, f"bf16 vs fp32: mean {sum(gaps) / len(gaps):.3f}"
    _free_gpu()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _mixed_params(i: int) -> SamplingParams:
    if i % 2:  # odd requests sample (seeded), even ones are greedy
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True,
                              prompt_logprobs=1)
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)


@requires_cuda
def test_chunked_prefill_and_preemption_on_cuda_equal_an_unconstrained_run(ieee_fp32, tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = random_prompts(12, 10, 50, 512, seed=3)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [_mixed_params(i) for i in range(len(prompts))]
    free = tiny_llm(path, device="cuda", block_size=4, max_model_len=128, max_num_batched_tokens=2048)
    reference = free.generate(inputs, params, use_tqdm=False)
    assert free.llm_engine.scheduler.num_preemptions == 0
    bytes_per_token = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32
    tight = tiny_llm(path, device="cuda", block_size=4, max_model_len=128, max_num_batched_tokens=16,
                     kv_cache_memory_bytes=36 * 4 * bytes_per_token)
    outs = tight.generate(inputs, params, use_tqdm=False)
    engine = tight.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert_engine_idle(engine)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"request {i} changed under preemption"
    assert _worst_prompt_logprob_gap(outs, reference, prompts) < GPU_TOLERANCE
    _free_gpu()


@requires_cuda
def test_seeded_sampling_on_cuda_is_reproducible_and_batch_invariant(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"), device="cuda", block_size=8, max_num_batched_tokens=64)
    assert llm.llm_engine.runner.default_generator.device.type == "cuda"
    prompts = [{"prompt_token_ids": p} for p in random_prompts(17, 5, 30, 512, seed=11)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]
    alone = tokens(llm.generate(prompts[0], seeded, use_tqdm=False))[0]
    assert tokens(llm.generate(prompts[0], seeded, use_tqdm=False))[0] == alone
    others = [SamplingParams(temperature=0.5 + 0.1 * i, top_k=10 * (i % 3), min_p=0.01 * (i % 2),
                             seed=None if i % 2 else i, repetition_penalty=1.0 + 0.1 * (i % 3),
                             max_tokens=8 + i, ignore_eos=True) for i in range(16)]
    for position in (0, 9, 16):
        params = others[:position] + [seeded] + others[position:]
        batch = prompts[1:position + 1] + [prompts[0]] + prompts[position + 1:]
        assert tokens(llm.generate(batch, params, use_tqdm=False))[position] == alone, f"at position {position}"
    assert tokens(llm.generate(prompts[0], seeded.clone(seed=4321), use_tqdm=False))[0] != alone
    _free_gpu()


@requires_cuda
def test_kv_cache_is_sized_from_gpu_memory_utilization(tiny_model_dir):
    _free_gpu()
    free, total = torch.cuda.mem_get_info()
    utilization = round((total - free + 2 * 2**30) / total + 0.005, 2)  # about 2 GiB beyond what is in use now
    logged = _Lines()
    logger = logging.getLogger("tidal")  # does not propagate to the root logger: listen on it directly
    logger.addHandler(logged)
    try:
        llm = LLM(tiny_model_dir("llama"), device="cuda", dtype="float32", gpu_memory_utilization=utilization)
    finally:
        logger.removeHandler(logged)
    line = next((m for m in logged.lines if "gpu_memory_utilization" in m), None)
    assert line is not None and "KV cache budget" in line, logged.lines
    print(line)
    free, total = torch.cuda.mem_get_info()
    plan = llm.llm_engine.kv_plan
    assert plan.num_bytes > 2**30, f"{plan.num_bytes} bytes of KV cache"  # most of the headroom went to the cache
    assert total - free <= utilization * total + 512 * 2**20, "the engine took more than gpu_memory_utilization"
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    del llm, out
    _free_gpu()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(tiny_model_dir("llama"), device="cuda", dtype="float32", gpu_memory_utilization=0.001)
    _free_gpu()


def _sync_watcher(caught: list[str]):
    """watched = _sync_watcher(caught); watched(fn) runs fn under torch's sync debug mode and appends to
    caught a line for each host synchronisation it made."""
    def watched(fn):
        def call(*args, **kwargs):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    caught.extend(f"{w.filename}:{w.lineno}: {w.message}" for w in seen
                                  if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message))
        return call
    return watched


@requires_cuda
def test_a_forward_never_waits_on_the_gpu(tiny_model_dir):
    """Step metadata is copied without waiting and no layer reads a GPU value back on the host: under
    torch's sync debug mode, preparing a step and its forward (decodes, a prefill continuing a cached
    context and a fresh one) raise no warning. Sampling reads the tokens back, once per step."""
    # eager: decodes go through the watched model too (the property CUDA graphs rely on; their replays are
    # watched in test_cuda_graphs_replay_decodes_with_the_eager_tokens)
    llm = tiny_llm(tiny_model_dir("llama"), device="cuda", block_size=4, max_num_batched_tokens=24, enforce_eager=True)
    runner = llm.llm_engine.runner
    caught: list[str] = []
    watched = _sync_watcher(caught)
    runner.input_batch.prepare = watched(runner.input_batch.prepare)
    runner._forward_context = watched(runner._forward_context)  # builds the attention metadata
    model = runner.model
    runner.model = type("Watched", (), {"__call__": staticmethod(watched(model)),
                                        "compute_logits": staticmethod(model.compute_logits)})()
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 10, 40, 512, seed=9)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    runner.model = model
    assert not caught, "\n".join(caught[:10])
    _free_gpu()


GRAPH_MAX_MODEL_LEN = 96  # the longest request: 43 prompt + 32 generated tokens


def _graph_workload(tiny_model_dir):
    """(model folder, prompts, params, KV bytes) of the graph tests: 7 greedy requests of different lengths,
    one extending another's prompt (a prefix hit), in a cache of 30 blocks of 4 (preemptions), which holds
    one request of GRAPH_MAX_MODEL_LEN."""
    prompts = random_prompts(6, 10, 40, 512, seed=5)
    prompts.append(prompts[0] + [7, 8, 9])
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    bytes_per_token = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32
    return tiny_model_dir("llama"), prompts, params, 30 * 4 * bytes_per_token


def _assert_same_tokens(expected, got) -> None:
    """[(tokens, logprobs)] per request: the same tokens, their logprobs within GPU_TOLERANCE."""
    for (tok_e, lp_e), (tok_g, lp_g) in zip(expected, got):
        assert tok_e == tok_g
        for t, a, b in zip(tok_e, lp_e, lp_g):
            assert abs(a[t].logprob - b[t].logprob) < GPU_TOLERANCE


@requires_cuda
def test_cuda_graphs_replay_decodes_with_the_eager_tokens(ieee_fp32, tiny_model_dir):
    """Decode steps replay the CUDA graphs captured at start-up (sizes 1, 2, 4, 8 for max_num_seqs 8): the
    same greedy tokens and logprobs as with enforce_eager, while batches shrink as requests finish (replays
    with fewer requests than the captured size), requests are preempted and prompts hit the prefix cache;
    a replay reads nothing back from the GPU."""
    pytest.importorskip("triton")
    path, prompts, params, kv_bytes = _graph_workload(tiny_model_dir)
    results = {}
    for eager in (True, False):
        llm = tiny_llm(path, device="cuda", block_size=4, max_model_len=GRAPH_MAX_MODEL_LEN, max_num_seqs=8,
                       enforce_eager=eager, kv_cache_memory_bytes=kv_bytes)
        engine = llm.llm_engine
        graphs = engine.runner.decode_graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.sizes == [1, 2, 4, 8]
            synced: list[str] = []
            graphs.run = _sync_watcher(synced)(graphs.run)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.prefix_hits > 0
        assert_engine_idle(engine)
        if graphs is not None:
            assert graphs.replays > 20 and not synced, synced[:5]
        del llm, engine, graphs
        _free_gpu()
    _assert_same_tokens(results[True], results[False])


@requires_cuda
def test_sampling_waits_on_the_gpu_only_to_read_its_tokens_back(tiny_model_dir):
    """Temperature, top-k, top-p, min-p, penalties, tokens banned until min_tokens, seeded and unseeded rows,
    logprobs: the sampler's metadata, its draw and the queued copies of tokens and logprobs to the host run
    without a host synchronisation; reading them (PendingStep.result) is the step's one wait."""
    llm = tiny_llm(tiny_model_dir("llama"), device="cuda", block_size=4)
    runner = llm.llm_engine.runner
    caught: list[str] = []
    watched = _sync_watcher(caught)
    sampler = runner.sampler
    runner.sampler = type("Watched", (), {"sample": staticmethod(watched(sampler.sample))})()
    runner._sampling_metadata = watched(runner._sampling_metadata)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                             presence_penalty=0.5, frequency_penalty=0.3, min_tokens=3, logprobs=2,
                             seed=i if i % 2 else None, max_tokens=8) for i in range(4)]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 10, 40, 512, seed=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner.sampler = sampler
    assert all(len(o.outputs[0].token_ids) >= 3 for o in outs)
    assert not caught, "\n".join(caught[:10])
    _free_gpu()


@requires_cuda
def test_async_scheduling_launches_without_waiting_and_equals_sync_steps(ieee_fp32, tiny_model_dir):
    """async_scheduling=True with CUDA graphs: launching a step (its inputs, the previous draw's ids written on
    the device, the forward or replay, the draw and the queued read-back) never waits on the GPU, and the
    tokens and logprobs are those of synchronous eager steps, with preemption and prefix hits."""
    pytest.importorskip("triton")
    path, prompts, params, kv_bytes = _graph_workload(tiny_model_dir)
    results = {}
    for asynchronous in (False, True):
        llm = tiny_llm(path, device="cuda", block_size=4, max_model_len=GRAPH_MAX_MODEL_LEN, max_num_seqs=8,
                       enforce_eager=not asynchronous, async_scheduling=asynchronous,
                       kv_cache_memory_bytes=kv_bytes)
        engine = llm.llm_engine
        synced: list[str] = []
        fed = []
        if asynchronous:
            launch = engine.runner.launch
            engine.runner.launch = _sync_watcher(synced)(
                lambda scheduled, so=None, *a: fed.append(bool(so.from_last_step)) or launch(scheduled, so, *a))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[asynchronous] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.prefix_hits > 0
        assert_engine_idle(engine)
        if asynchronous:
            assert sum(fed) > 20 and engine.runner.decode_graphs.replays > 20
            assert not synced, synced[:5]
        del llm, engine
        _free_gpu()
    _assert_same_tokens(results[False], results[True])


@requires_cuda
def test_grammar_bitmask_on_cuda_matches_cpu():
    """Structured outputs: the sampler's bitmask (made on the host) masks CUDA logits as CPU ones."""
    from tidal.layers.sampler import Sampler, SamplingMetadata, apply_token_bitmask
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    on_gpu = logits.cuda()
    apply_token_bitmask(logits, bitmask, [0, 2, 4])
    apply_token_bitmask(on_gpu, bitmask, [0, 2, 4])
    assert torch.equal(on_gpu.cpu(), logits)
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 1.0)]
    meta = SamplingMetadata.from_params(params, "cuda", vocab, grammar=(bitmask, [0, 1, 2]))
    out = Sampler(torch.Generator("cuda").manual_seed(0))(torch.randn(3, vocab, device="cuda"), meta)
    for i, tok in enumerate(out.token_ids):
        assert (int(bitmask[i, tok // 32]) >> (tok % 32)) & 1


@requires_cuda
def test_seeded_sampling_on_cuda_matches_cpu():
    """Seeded noise is wrapping int64 arithmetic: the same bits on both devices, and so the same
    seeded draws wherever the logits agree (here: the same logits, copied)."""
    from tidal.layers.sampler import Sampler, SamplingMetadata, seeded_exponential
    vocab = 49152
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (0, 1, 2**63, 2**64 - 1)]
    draws = [0, 5, 17, 2**33]
    cpu = SamplingMetadata.from_params(params, "cpu", vocab, draw_index=draws)
    gpu = SamplingMetadata.from_params(params, "cuda", vocab, draw_index=draws)
    # u is exact on both devices; -log(u) may differ in the last bit between the two libms
    assert torch.allclose(seeded_exponential(gpu.seeds, gpu.draw_index, vocab).cpu(),
                          seeded_exponential(cpu.seeds, cpu.draw_index, vocab), rtol=1e-6, atol=0)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 2
    assert Sampler(None)(logits.cuda(), gpu).token_ids == Sampler(None)(logits.clone(), cpu).token_ids


@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_mode_on_cuda_keeps_every_logprob_whatever_the_batch(tmp_path_factory, dtype):
    """batch_invariant=True on CUDA (Triton products in fixed tiles, one attention tile size): the same
    prompts alone, all at once, in 37-token chunks, on a warm prefix cache and preempted give the same
    logprobs to the last bit, as the CPU's tests/test_batch_invariance.py asks of the CPU."""
    from tests import test_batch_invariance as inv
    path = inv._tiny_path(tmp_path_factory, "llama")
    got = inv._scenarios(path, dtype, inv.PROMPTS, {**inv.TINY_ENGINE, "device": "cuda"})
    assert inv._differences(got) == []
    _free_gpu()
