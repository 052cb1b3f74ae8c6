"""The engine core in its own process (tidal/engine/core_process.py, `tidal serve --engine-core-process`):
outputs, aborts, faults, calls and metrics across the process boundary; a core process that dies (clear
errors, /health, the server exits 1); clean shutdown with no process left behind. On a tiny random model.
(TIDAL_TEST_ENGINE_CORE_PROCESS=1 also runs every test that starts a real `tidal serve` with the option.)"""
from __future__ import annotations

import asyncio
import contextlib
import operator
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.helpers import random_prompts
from tests.test_server_reliability import (
    TIMEOUT,
    VOCAB,
    _body,
    _offline,
    _serve,
    _token_ids,
    uvicorn_in_thread,
)
from tidal.config import EngineConfig
from tidal.engine.async_llm import AsyncLLM, EngineDeadError
from tidal.entrypoints.openai.api_server import build_app
from tidal.metrics import ServerMetrics
from tidal.sampling_params import SamplingParams

MAX_MODEL_LEN = 512


def _config(path: str) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN)


def _gone(pid: int, within: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # polls the process table; the pause only spaces the polls
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def core_serving(model_dir: str, **kwargs):
    """(base URL, AsyncLLM) of the app served by uvicorn in a thread of this process, its engine in a core
    process."""
    metrics = ServerMetrics("tiny")
    async_llm = AsyncLLM.from_config(_config(model_dir), step_hook=metrics, core_process=True, **kwargs)
    app = build_app(async_llm, "tiny", metrics=metrics, log_requests=False)
    try:
        with uvicorn_in_thread(app) as url:
            yield url, async_llm
    finally:
        async_llm.shutdown()
        assert _gone(async_llm.core_pid), "the engine core process outlived its shutdown"


def _worker_pids(engine) -> list[int]:
    return list(engine.executor.pids)


def _in_engine(async_llm, fn):
    return asyncio.run(asyncio.wait_for(async_llm.call_in_engine(fn), TIMEOUT))


def test_outputs_metrics_and_calls_match_the_engine_in_one_process(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = random_prompts(3, 5, 20, VOCAB, seed=3)
    expected, _ = _offline(path, prompts, 12)
    with core_serving(path) as (base, async_llm):
        assert async_llm.core_pid != os.getpid()

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                return await asyncio.gather(*[client.post("/v1/completions", json=_body(p, 12)) for p in prompts])

        replies = asyncio.run(main())
        assert [r.status_code for r in replies] == [200] * 3
        assert [_token_ids(r.json()["choices"][0]) for r in replies] == expected
        metrics = httpx.get(f"{base}/metrics").text
        assert 'tidal:generation_tokens_total{model_name="tiny"} 36.0' in metrics
        assert 'tidal:request_success_total{finished_reason="length",model_name="tiny"} 3.0' in metrics
        assert _in_engine(async_llm, operator.attrgetter("kv_manager.pool.num_used_blocks")) == 0
        with pytest.raises(AttributeError):  # an error raised in the core reaches the caller
            _in_engine(async_llm, operator.attrgetter("no_such_attribute"))
        snapshot = httpx.get(f"{base}/dashboard/snapshot")  # the dashboard's call_in_engine hook
        assert snapshot.status_code == 200, snapshot.text
        assert snapshot.json()["totals"]["generation_tokens"] == 36
        assert httpx.get(f"{base}/health").status_code == 200


def test_outputs_cross_without_their_prompts_and_get_them_back(tiny_model_dir, monkeypatch):
    """The core sends a step's outputs without their prompts (the server process has them); the caller's
    outputs carry them as in one process."""
    from tidal.engine import core_process
    real, on_the_wire = core_process._DECODER, []

    class Recording:  # what the server's receiver thread decodes, before the streams put the prompts back
        def decode(self, data):
            message = real.decode(data)
            on_the_wire.extend((o.prompt, list(o.prompt_token_ids)) for o in message.outputs)
            return message

    monkeypatch.setattr(core_process, "_DECODER", Recording())
    path = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = (("ids", {"prompt_token_ids": [5, 6, 7, 8]}),
               ("text", {"prompt": "a b c", "prompt_token_ids": [9, 10, 11]}))

    async def run(async_llm):
        return [[o async for o in async_llm.generate(prompt, params, rid)] for rid, prompt in prompts]

    with core_serving(path) as (_, async_llm):
        remote = asyncio.run(run(async_llm))
    local_llm = AsyncLLM.from_config(_config(path))
    try:
        local = asyncio.run(run(local_llm))
    finally:
        local_llm.shutdown()
    assert on_the_wire and all(prompt is None and ids == [] for prompt, ids in on_the_wire)
    for got, want in zip(remote, local, strict=True):
        assert len(got) == len(want) > 1
        assert [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in got] == \
            [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in want]
    assert remote[0][0].prompt_token_ids == [5, 6, 7, 8] and remote[0][0].prompt is None
    assert remote[1][-1].prompt == "a b c" and remote[1][-1].prompt_token_ids == [9, 10, 11]


def test_abort_crosses_the_boundary_and_frees_the_requests_blocks(tiny_model_dir):
    path = tiny_model_dir("llama")
    with core_serving(path) as (base, async_llm):
        async def main():
            stream = async_llm.generate({"prompt_token_ids": [5, 6, 7]},
                                        SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), "leaver")
            async for _ in stream:  # one output, then the caller leaves: the request is aborted
                break
            await stream.aclose()
            deadline = time.monotonic() + TIMEOUT
            while await async_llm.call_in_engine(operator.methodcaller("has_unfinished_requests")):
                assert time.monotonic() < deadline, "the abort never reached the engine"
                await asyncio.sleep(0.01)
            return await async_llm.call_in_engine(operator.attrgetter("kv_manager.pool.num_used_blocks"))

        assert asyncio.run(main()) == 0
        deadline = time.monotonic() + TIMEOUT
        while async_llm.engine.stats.finished_reasons.get("abort", 0) != 1:  # the next message's stats
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ok = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 4), timeout=TIMEOUT)
        assert ok.status_code == 200


def test_fault_in_a_step_fails_only_its_requests(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    expected, _ = _offline(path, [[5, 6, 7]], 8)
    monkeypatch.setenv("TIDAL_INJECT_FAULT", "execute:3")  # read by the core process at start
    with core_serving(path) as (base, async_llm):
        failed = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 8), timeout=TIMEOUT)
        assert failed.status_code == 500
        assert "the model failed in a step (RuntimeError: injected fault" in failed.json()["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 200
        ok = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 8), timeout=TIMEOUT)
        assert ok.status_code == 200 and _token_ids(ok.json()["choices"][0]) == expected[0]
        assert async_llm.is_running


def test_a_killed_core_fails_its_requests_clearly_and_health_says_so(tiny_model_dir):
    with core_serving(tiny_model_dir("llama")) as (base, async_llm):
        died = []
        async_llm.on_dead = died.append

        async def main():
            stream = async_llm.generate({"prompt_token_ids": [5, 6, 7]},
                                        SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), "victim")
            await anext(stream)
            os.kill(async_llm.core_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="engine core process .* exited unexpectedly"):
                async for _ in stream:
                    pass

        asyncio.run(main())
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503
        assert "engine core process" in health.json()["error"]["message"]
        later = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 8), timeout=TIMEOUT)
        assert later.status_code == 503 and "not running" in later.json()["error"]["message"]
        assert len(died) == 1 and "exit code -9" in str(died[0])


def test_server_exits_1_when_its_core_dies_and_0_after_a_clean_shutdown(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    for kill_core in (True, False):
        proc, base = _serve(path, tmp_path / f"server-{kill_core}.log", "--engine-core-process")
        try:
            (core,) = psutil.Process(proc.pid).children()
            assert httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 4), timeout=TIMEOUT).status_code == 200
            if kill_core:
                core.kill()
                assert proc.wait(TIMEOUT) == 1
            else:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(TIMEOUT) == 0
            assert _gone(core.pid, 5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "engine core process" in (tmp_path / "server-True.log").read_text()


def test_core_stops_by_itself_when_the_server_process_is_killed(tiny_model_dir, tmp_path):
    proc, _ = _serve(tiny_model_dir("llama"), tmp_path / "server.log", "--engine-core-process")
    try:
        (core,) = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait()
        assert _gone(core.pid, 10), "the engine core process was orphaned"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv", [["serve", "{missing}"], ["serve", "--max-num-seqs", "many"]])
def test_a_refused_serve_command_leaves_no_core_process_behind(tmp_path, argv):
    """`tidal serve` starts its core process before it parses its arguments (tidal/engine/core_launch.py):
    a command refused after that (a model path that does not exist; a flag argparse rejects) stops it."""
    marker = f"{os.getpid()}-{time.time_ns()}"
    argv = [a.format(missing=tmp_path / "missing") for a in argv]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:  # a file, not a pipe, which a leftover child would hold open past the exit
        code = subprocess.run([sys.executable, "-m", "tidal.entrypoints.cli", *argv], stdout=out, stderr=out,
                              timeout=TIMEOUT, env=dict(os.environ, TIDAL_TEST_MARKER=marker)).returncode
    text = log.read_text()
    assert code in (1, 2) and ("does not exist" in text or "invalid int value" in text), text
    assert "Traceback" not in text, text

    def marked(p):
        try:
            return p.environ().get("TIDAL_TEST_MARKER") == marker
        except psutil.Error:  # gone, or not ours
            return False
    assert not [p.pid for p in psutil.process_iter() if marked(p)], "a core process outlived the refused command"


def test_tensor_parallel_workers_run_under_the_core_and_go_with_it(tiny_model_dir):
    path = tiny_model_dir("llama")
    expected, _ = _offline(path, [[5, 6, 7]], 8)
    config = _config(path)
    config.tensor_parallel_size = 2
    async_llm = AsyncLLM.from_config(config, core_process=True)
    try:
        core = psutil.Process(async_llm.core_pid)
        workers = [psutil.Process(pid) for pid in _in_engine(async_llm, _worker_pids)]
        assert len(workers) == 2 and all(core in w.parents() for w in workers)

        async def main():
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            return [t async for out in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "tp")
                    for t in out.outputs[0].token_ids]

        assert asyncio.run(main()) == expected[0]
        core.kill()  # the workers read EOF from their driver's pipe and stop
        assert all(_gone(w.pid, 30) for w in workers), "a worker outlived its engine core"
        assert not async_llm.is_running or _gone(core.pid, 1)
    finally:
        async_llm.shutdown()
