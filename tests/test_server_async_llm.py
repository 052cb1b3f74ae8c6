"""AsyncLLM on a tiny random model: concurrent streams equal the offline engine's outputs, an early
exit aborts and frees blocks within one step, bad prompts are refused before queueing, engine
failures reach every caller instead of hanging, shutdown ends open streams, and a function can be run
on the engine thread between steps."""
from __future__ import annotations

import asyncio
import threading

import pytest

from tests.helpers import TEST_KV_CACHE_BYTES, assert_engine_idle, random_prompts, tiny_llm
from tidal.config import EngineConfig
from tidal.engine.async_llm import AsyncLLM, EngineDeadError
from tidal.engine.llm_engine import LLMEngine
from tidal.sampling_params import SamplingParams

VOCAB = 512
TIMEOUT = 60  # seconds; only reached if a stream hangs, which is the failure these tests catch


class StepRecorder:
    """Step hook: remembers (steps run so far, KV usage) after every step and command batch."""

    def __init__(self) -> None:
        self.usage_after: list[tuple[int, float]] = []
        self.freed = threading.Event()

    def __call__(self, engine, outputs) -> None:
        self.usage_after.append((engine.stats.num_steps, engine.kv_manager.usage))
        if self.usage_after[-1][0] > 0 and engine.kv_manager.usage == 0:
            self.freed.set()


@pytest.fixture
def make_async_llm(tiny_model_dir):
    made = []

    def make(hook=None) -> AsyncLLM:
        config = EngineConfig(model=tiny_model_dir("llama"), dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
                              max_model_len=512)
        llm = AsyncLLM(LLMEngine(config), step_hook=hook)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


async def _collect(async_llm, prompt, params, request_id):
    tokens, finish = [], None
    async for out in async_llm.generate(prompt, params, request_id):
        tokens += out.outputs[0].token_ids if out.outputs else []
        if out.finished:
            finish = out.outputs[0].finish_reason
    return tokens, finish


def test_concurrent_streams_equal_offline_outputs(make_async_llm, tiny_model_dir):
    prompts = random_prompts(6, 3, 40, VOCAB, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    offline = tiny_llm(tiny_model_dir("llama"), max_model_len=256).generate(prompts, params, use_tqdm=False)
    async_llm = make_async_llm()

    async def main():
        return await asyncio.wait_for(asyncio.gather(*[_collect(async_llm, p, params, f"r{i}")
                                                       for i, p in enumerate(prompts)]), TIMEOUT)
    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == [o.outputs[0].token_ids for o in offline]
    assert all(finish == "length" for _, finish in results)
    assert_engine_idle(async_llm.engine)


def test_leaving_stream_early_frees_blocks_within_one_step(make_async_llm):
    recorder = StepRecorder()
    async_llm = make_async_llm(recorder)

    async def main():
        # long enough (500 steps) that it cannot finish by itself while the test reads 3 outputs
        gen = async_llm.generate(list(range(5, 10)), SamplingParams(max_tokens=500, ignore_eos=True), "long")
        num_outputs = 0
        async for _ in gen:
            num_outputs += 1
            if num_outputs == 3:
                break
        assert async_llm.engine.kv_manager.usage > 0
        steps_at_abort = async_llm.engine.stats.num_steps  # read just before the abort is queued
        await gen.aclose()
        assert await asyncio.to_thread(recorder.freed.wait, TIMEOUT)
        return steps_at_abort

    steps_at_abort = asyncio.run(main())
    freed_at = next(steps for steps, usage in recorder.usage_after if steps > 0 and usage == 0)
    assert freed_at - steps_at_abort <= 1  # at most the step already running when the abort came
    assert_engine_idle(async_llm.engine)


def test_bad_prompt_is_refused_before_queueing_and_others_finish(make_async_llm):
    async_llm = make_async_llm()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main():
        good = asyncio.ensure_future(_collect(async_llm, [5, 6, 7, 8], params, "good"))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(async_llm, [5, VOCAB + 7], params, "bad-token")
        with pytest.raises(ValueError, match="empty"):
            await _collect(async_llm, [], params, "bad-empty")
        return await asyncio.wait_for(good, TIMEOUT)

    tokens, finish = asyncio.run(main())
    assert len(tokens) == 8 and finish == "length"
    assert_engine_idle(async_llm.engine)


def test_engine_failure_reaches_open_and_later_requests(make_async_llm):
    async_llm = make_async_llm()

    def broken_step():
        raise RuntimeError("simulated kernel failure")
    async_llm.engine.step = broken_step

    async def main():
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            await asyncio.wait_for(_collect(async_llm, [5, 6, 7], SamplingParams(max_tokens=4), "a"), TIMEOUT)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(async_llm, [5, 6, 7], SamplingParams(max_tokens=4), "b"), TIMEOUT)

    asyncio.run(main())
    assert not async_llm.is_running


def test_shutdown_ends_open_streams(make_async_llm):
    async_llm = make_async_llm()

    async def main():
        gen = async_llm.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "s")
        await asyncio.wait_for(anext(gen), TIMEOUT)
        await asyncio.to_thread(async_llm.shutdown)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect_rest(gen), TIMEOUT)

    async def _collect_rest(gen):
        async for _ in gen:
            pass

    asyncio.run(main())
    assert not async_llm._thread.is_alive()


def test_call_in_engine_runs_between_steps_on_the_engine_thread(make_async_llm):
    async_llm = make_async_llm()

    def where(engine):
        return threading.current_thread().name, engine.stats.num_steps

    def broken(engine):
        raise ValueError("bad reading")

    async def main():
        gen = async_llm.generate([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "c")
        first = await asyncio.wait_for(anext(gen), TIMEOUT)
        thread, steps = await asyncio.wait_for(async_llm.call_in_engine(where), TIMEOUT)
        assert thread == "tidal-engine" and steps >= 1
        with pytest.raises(ValueError, match="bad reading"):  # the caller's error; the engine runs on
            await asyncio.wait_for(async_llm.call_in_engine(broken), TIMEOUT)
        rest = await asyncio.wait_for(_collect_rest(gen), TIMEOUT)
        assert len(first.outputs[0].token_ids) + len(rest) == 50

    async def _collect_rest(gen):
        return [t async for out in gen for t in out.outputs[0].token_ids]

    asyncio.run(main())
    assert async_llm.is_running
