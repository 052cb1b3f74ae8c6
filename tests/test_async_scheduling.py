"""Asynchronous scheduling (`async_scheduling=True`): step N + 1 is scheduled and launched before step N's
tokens are read, its inputs taken from step N's draw where it is. On a CPU the steps still run one after
the other, so every output must be exactly that of the same requests run with synchronous steps:
greedy and seeded tokens, logprobs, prompt logprobs, stops, preemption (also of a request whose token a
launched step is still drawing), aborts and faults. The tests also check that steps really took their
inputs from the step before (the path a GPU overlaps) and that requests which need their last token on
the host (penalties, grammars) wait for it."""
from __future__ import annotations

import pytest

from tests.conftest import SMOLLM2_KV_CACHE_BYTES
from tests.helpers import assert_engine_idle, random_prompts, tiny_llm
from tidal import LLM, SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.engine.llm_engine import StepError
from tidal.worker.model_runner import ModelRunner, PendingStep

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128
BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32 of the tiny llama
TIGHT_KV_BYTES = 36 * BLOCK_SIZE * BYTES_PER_TOKEN  # 36 blocks: the 12 requests below preempt each other


class Watch:
    """Counts, over the engines made while it is installed: steps launched, steps with inputs from the step
    before, the requests those were, preemptions of requests whose token was still being drawn, and tokens
    drawn."""

    def __init__(self, monkeypatch) -> None:
        self.launched = self.fed_steps = self.pending_victims = self.drawn = 0
        self.fed_params: list[SamplingParams] = []  # of the requests whose input came from the step before
        launch, preempt, result = ModelRunner.execute_async, Scheduler._preempt, PendingStep.result

        def execute_async(runner, so):
            self.launched += 1
            self.fed_steps += bool(so.from_last_step)
            pending = launch(runner, so)
            self.fed_params += [runner.input_batch.requests[rid].sampling_params for rid in so.from_last_step]
            return pending

        def _preempt(scheduler, request):
            self.pending_victims += request.num_pending_tokens > 0
            return preempt(scheduler, request)

        def read(pending):
            out = result(pending)
            self.drawn += sum(len(t) for t in out.sampled.values())
            return out
        monkeypatch.setattr(ModelRunner, "execute_async", execute_async)
        monkeypatch.setattr(Scheduler, "_preempt", _preempt)
        monkeypatch.setattr(PendingStep, "result", read)


def _params(i: int) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1, logprobs=2)
    if i % 3 == 1:  # seeded sampling, n = 2
        return SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=20, ignore_eos=True,
                              logprobs=0)
    # may stop at the EOS id (2) before max_tokens: the step after it is drawn for nothing
    return SamplingParams(temperature=1.0, seed=7 + i, max_tokens=30, min_tokens=2)


def _outputs(outs) -> list:
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] + [o.prompt_logprobs] for o in outs]


def _run(path, prompts, params, **kwargs):
    llm = tiny_llm(path, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_engine_idle(llm.llm_engine)
    return llm, _outputs(outs)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, 10, 50, 512, seed=3)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts):
    return _run(tiny_model_dir("llama"), prompts, [_params(i) for i in range(len(prompts))])[1]


@pytest.mark.parametrize("cache", ["roomy", "tight"])
def test_outputs_equal_synchronous_steps(tiny_model_dir, prompts, reference, monkeypatch, cache):
    watch = Watch(monkeypatch)
    kwargs = {"kv_cache_memory_bytes": TIGHT_KV_BYTES} if cache == "tight" else {}
    llm, got = _run(tiny_model_dir("llama"), prompts, [_params(i) for i in range(len(prompts))],
                    async_scheduling=True, **kwargs)
    assert got == reference
    assert watch.fed_steps >= watch.launched * 3 // 4, (watch.fed_steps, watch.launched)
    stats = llm.llm_engine.stats  # each step timed once, the host's part (step - model) not negative
    assert stats.num_timed_steps == stats.num_steps == watch.launched
    assert stats.step_time_s >= stats.model_time_s > 0
    assert any(t == 2 for o in reference for c in o[:-1] for t in c[0])  # an EOS stop happened
    if cache == "tight":
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert watch.pending_victims > 0  # preempted while a launched step drew its token


def test_length_stops_draw_no_token_past_the_end(tiny_model_dir, prompts, monkeypatch):
    """A request whose pending token may be its last by max_tokens or max_model_len waits for it: no step
    draws a token that is thrown away."""
    watch = Watch(monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    prompts = prompts[:-1] + [list(range(3, MAX_MODEL_LEN - 4))]  # the last one reaches max_model_len
    llm, got = _run(tiny_model_dir("llama"), prompts, params, async_scheduling=True)
    assert watch.fed_steps > 0
    assert got[-1][0][1] == "length" and len(got[-1][0][0]) == MAX_MODEL_LEN - len(prompts[-1])
    assert watch.drawn == sum(len(o[0][0]) for o in got)


def test_penalised_requests_wait_for_their_last_token(tiny_model_dir, prompts, monkeypatch):
    penalties = {"repetition_penalty": 1.5, "frequency_penalty": 0.4}
    params = [SamplingParams(temperature=0.8, seed=i, ignore_eos=True, **({"max_tokens": 8, **penalties} if i % 2 else
                                                                         {"max_tokens": 20}))
              for i in range(len(prompts))]
    _, expected = _run(tiny_model_dir("llama"), prompts, params)
    watch = Watch(monkeypatch)
    _, got = _run(tiny_model_dir("llama"), prompts, params, async_scheduling=True)
    assert got == expected
    assert watch.fed_steps > 0  # the others ran ahead once the penalised ones had finished, never a penalised one
    assert not any(p.has_penalties for p in watch.fed_params)


def test_abort_while_a_step_is_drawing_for_the_request(tiny_model_dir, prompts):
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (expected,) = [o[0][0] for o in _run(path, prompts[:1], params)[1]]
    engine = tiny_llm(path, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, async_scheduling=True).llm_engine
    engine.add_request("kept", {"prompt_token_ids": prompts[0]}, params)
    engine.add_request("left", {"prompt_token_ids": prompts[1]}, params)
    tokens: dict[str, list[int]] = {"kept": [], "left": []}
    finish = {}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert engine._pending is not None  # a step is in flight for both
    (aborted,) = engine.abort_request("left")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            finish[out.request_id] = out.outputs[0].finish_reason
    assert tokens["kept"] == expected and finish == {"kept": "length"}
    assert_engine_idle(engine)


def test_a_failed_step_aborts_its_requests_and_the_engine_goes_on(tiny_model_dir, prompts):
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o[0][0] for o in _run(path, prompts[:2], params)[1]]
    engine = tiny_llm(path, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, async_scheduling=True).llm_engine
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params)
    for _ in range(3):
        engine.step()
    working, calls = engine.runner.execute_async, []

    def failing(so):
        calls.append(so)
        raise RuntimeError("simulated kernel failure")
    engine.runner.execute_async = failing
    with pytest.raises(StepError, match="simulated kernel failure") as failed:
        engine.step()
    assert failed.value.request_ids == ["a"] and calls
    assert [o.outputs[0].finish_reason for o in failed.value.outputs if o.finished] == ["abort"]
    assert_engine_idle(engine)
    engine.runner.execute_async = working
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, params)
    tokens = []
    while engine.has_unfinished_requests():
        tokens = [out.outputs[0].token_ids for out in engine.step()] or tokens
    assert tokens == [expected[1]]
    assert_engine_idle(engine)


def test_refused_where_it_cannot_run():
    from tidal.config import EngineConfig
    with pytest.raises(ValueError, match="async_scheduling=True cannot run with speculative decoding"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size or pipeline_parallel_size above 1"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineConfig(async_scheduling="yes")


def test_on_by_default_on_cuda_where_it_applies_and_off_elsewhere(monkeypatch):
    """async_scheduling=None (the default) resolves to True on CUDA with the model in the engine's process
    and no speculative decoding, False on a CPU, with speculative decoding and with worker processes;
    False stays off on CUDA."""
    from tidal import config
    from tidal.config import EngineConfig
    monkeypatch.setattr(config, "resolve_device", lambda d: "cpu" if d == "auto" else d)  # "cuda" without a GPU
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(device="cuda").async_scheduling is True
    assert EngineConfig(device="cuda:1").async_scheduling is True
    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cuda", speculative_config=ngram).async_scheduling is False
    assert EngineConfig(device="cuda", tensor_parallel_size=2).async_scheduling is False
    assert EngineConfig(device="cuda", distributed_executor_backend="mp").async_scheduling is False
    assert EngineConfig(device="cuda", async_scheduling=False).async_scheduling is False


def test_grammars_stop_strings_and_eos_on_the_default_model(smollm2, monkeypatch):
    """Grammar requests read their last token before their next bitmask; the others run ahead and stop at
    EOS or at a stop string one step late, with the same text."""
    prompts = ["What is the capital of France?", "Give a phone number.", "Counting in words: one, two, three, four,",
               "Write a haiku about the sea."]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": r"[0-9]{3}-[0-9]{4}"}),
              SamplingParams(temperature=0.7, seed=5, max_tokens=64),
              SamplingParams(temperature=0, max_tokens=80, stop=["eight"]),
              SamplingParams(temperature=0, max_tokens=60, logprobs=1)]

    def texts(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in outs]
    expected = texts(smollm2)
    watch = Watch(monkeypatch)
    llm = LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=SMOLLM2_KV_CACHE_BYTES, async_scheduling=True)
    got = texts(llm)
    assert got == expected
    assert got[2][0] == " five, six, seven, " and got[2][2:] == ("stop", "eight")
    assert got[3][2:] == ("stop", None)  # EOS
    assert watch.fed_steps > 0
    assert watch.fed_params and not any(p.structured_outputs for p in watch.fed_params)
    assert_engine_idle(llm.llm_engine)


def test_served_from_a_core_process_with_a_fault_in_a_step(tiny_model_dir, prompts, monkeypatch):
    """`tidal serve --async-scheduling`'s engine core: concurrent requests get the offline tokens; a fault in a
    step fails only its request, and the core serves on."""
    import asyncio

    import httpx

    from tests.test_engine_core_process import _gone
    from tests.test_server_reliability import TIMEOUT, _body, _offline, _token_ids, uvicorn_in_thread
    from tidal.config import EngineConfig
    from tidal.engine.async_llm import AsyncLLM
    from tidal.entrypoints.openai.api_server import build_app
    path = tiny_model_dir("llama")
    expected, _ = _offline(path, prompts[:3], 12)
    monkeypatch.setenv("TIDAL_INJECT_FAULT", "execute:3")  # read by the core process at start
    config = EngineConfig(model=path, dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=512,
                          async_scheduling=True)
    async_llm = AsyncLLM.from_config(config, core_process=True)
    try:
        with uvicorn_in_thread(build_app(async_llm, "tiny", log_requests=False)) as base:
            failed = httpx.post(f"{base}/v1/completions", json=_body(prompts[0], 12), timeout=TIMEOUT)
            assert failed.status_code == 500
            assert "injected fault" in failed.json()["error"]["message"]
            assert httpx.get(f"{base}/health").status_code == 200

            async def main():
                async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                    return await asyncio.gather(*[client.post("/v1/completions", json=_body(p, 12))
                                                  for p in prompts[:3]])
            replies = asyncio.run(main())
            assert [r.status_code for r in replies] == [200] * 3
            assert [_token_ids(r.json()["choices"][0]) for r in replies] == expected
    finally:
        async_llm.shutdown()
        assert _gone(async_llm.core_pid)


def test_preempted_jamba_run_with_state_checkpoints(tmp_path, monkeypatch):
    """Attention + Mamba layers: preempted requests resume from their prompts' Mamba state checkpoints, with the
    tokens of an unconstrained synchronous run."""
    from tests.test_hybrid import PROMPTS, _budget, run, save_tiny_hybrid
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    ref, llm = run(path, PROMPTS, params, kv_cache_memory_bytes=8 << 20, max_model_len=256)
    watch = Watch(monkeypatch)
    outs, small = run(path, PROMPTS, params, kv_cache_memory_bytes=_budget(llm, 3, 260), max_model_len=256,
                      enable_prefix_caching=True, async_scheduling=True)
    scheduler = small.llm_engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.state_checkpoints.num_hits > 0 and watch.fed_steps > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert scheduler.state_pool.num_free_slots == scheduler.state_pool.num_slots


def test_steps_while_idle_hand_every_finished_request_back_to_the_runner(tiny_model_dir, prompts):
    """A served engine is stepped while it has nothing to run: the requests that finished with the last
    read must still leave the runner's input batch then (no later launch carries them), or its rows run
    out after a few rounds of max_num_seqs requests ("no free row in the input batch")."""
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                   async_scheduling=True)
    engine = llm.llm_engine
    rows = len(engine.runner.input_batch.free_rows)
    for rnd in range(3):
        params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(4)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[4 * rnd:4 * rnd + 4]], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7, 9]
        assert engine.step() == []  # idle
        assert not engine.runner.input_batch.requests and len(engine.runner.input_batch.free_rows) == rows
        assert_engine_idle(engine)
