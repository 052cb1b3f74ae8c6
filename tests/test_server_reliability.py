"""The server under overload, client disconnects, faults and shutdown (docs/reliability.md), on a tiny
random model: the app in a uvicorn thread of this process where the test must see the engine, a real
`tidal serve` subprocess where it must see signals and exit codes. Clients are real HTTP clients (httpx)
that close their connections when they leave."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import assert_engine_idle, random_prompts, tiny_llm
from tidal.config import EngineConfig
from tidal.engine.async_llm import AsyncLLM
from tidal.engine.llm_engine import LLMEngine
from tidal.entrypoints.openai.api_server import build_app
from tidal.metrics import ServerMetrics
from tidal.sampling_params import SamplingParams

VOCAB = 512
MAX_MODEL_LEN = 64
TIMEOUT = 60  # seconds; only reached if something hangs, which is what these tests catch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gate:
    """Holds the model inside a step (runner.execute) until opened, so a test can act mid-step; logs (steps
    done before it, requests holding KV blocks) at each step's execution."""

    def __init__(self, engine) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        self.opened.set()
        self.holders: list[tuple[int, set[str]]] = []
        original = engine.runner.execute

        def execute(batch):
            self.holders.append((engine.stats.num_steps, set(engine.kv_manager.req_to_blocks)))
            self.entered.set()
            assert self.opened.wait(TIMEOUT)
            return original(batch)
        engine.runner.execute = execute

    def close(self) -> None:
        self.entered.clear()
        self.opened.clear()


@contextlib.contextmanager
def uvicorn_in_thread(app):
    """The base URL of `app` served by uvicorn in a thread of this process, stopped on exit."""
    import uvicorn
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:  # uvicorn's own readiness flag
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)


@contextlib.contextmanager
def serving(model_dir: str, max_waiting_requests: int | None = None, **engine_kwargs):
    """(base URL, AsyncLLM) of the app served by uvicorn in a thread of this process."""
    kwargs = {"dtype": "float32", "kv_cache_memory_bytes": 4 << 20, "max_model_len": MAX_MODEL_LEN, **engine_kwargs}
    engine = LLMEngine(EngineConfig(model=model_dir, **kwargs))
    metrics = ServerMetrics("tiny")
    async_llm = AsyncLLM(engine, step_hook=metrics, max_waiting_requests=max_waiting_requests)
    app = build_app(async_llm, "tiny", metrics=metrics, log_requests=False)
    try:
        with uvicorn_in_thread(app) as url:
            yield url, async_llm
    finally:
        async_llm.shutdown()
        engine.shutdown()


def _body(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **extra}


def _token_ids(choice: dict) -> list[int]:
    # this model has no tokenizer: logprobs name each token by its id
    return [int(t) for t in choice["logprobs"]["tokens"]]


def _offline(model_dir: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of an unconstrained engine, and its KV bytes per token."""
    llm = tiny_llm(model_dir, max_model_len=MAX_MODEL_LEN)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.kv_plan.bytes_per_token


def _aborted(async_llm) -> int:
    return async_llm.engine.stats.finished_reasons.get("abort", 0)


def _metric(base: str, name: str) -> float:
    line = next(x for x in httpx.get(f"{base}/metrics").text.splitlines() if x.startswith(name))
    return float(line.split()[-1])


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():  # polls the condition itself; the pause only spaces the polls
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- overload ----------------------------------------------------------------------------------------------
def test_full_waiting_queue_answers_503_with_retry_after_then_serves_again(tiny_model_dir):
    with serving(tiny_model_dir("llama"), max_waiting_requests=2, max_num_seqs=1) as (base, async_llm):
        gate = Gate(async_llm.engine)
        gate.close()

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                first = asyncio.ensure_future(client.post("/v1/completions", json=_body([5, 6, 7], 4)))
                await asyncio.to_thread(gate.entered.wait, TIMEOUT)  # running, held inside its first step
                queued = [asyncio.ensure_future(client.post("/v1/completions", json=_body([5, 6, 7 + i], 4)))
                          for i in range(2)]
                await asyncio.to_thread(_wait_until, lambda: async_llm.num_waiting == 2, "2 waiting")
                refused = await client.post("/v1/completions", json=_body([9, 9], 4))
                gate.opened.set()
                done = await asyncio.gather(first, *queued)
                again = await client.post("/v1/completions", json=_body([9, 9], 4))
                return refused, done, again

        refused, done, again = asyncio.run(main())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert "overloaded" in error["message"] and "--max-waiting-requests 2" in error["message"]
        assert error["type"] == "server_error"
        assert [r.status_code for r in done] == [200] * 3
        assert again.status_code == 200
        assert_engine_idle(async_llm.engine)


def test_kv_budget_for_a_tenth_of_the_demand_completes_every_request_with_unconstrained_outputs(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts, max_tokens = random_prompts(16, 20, 40, VOCAB, seed=7), 24
    expected, bytes_per_token = _offline(path, prompts, max_tokens)
    demand = sum(len(p) + max_tokens for p in prompts)  # tokens, were every request resident at once
    with serving(path, kv_cache_memory_bytes=MAX_MODEL_LEN * bytes_per_token, block_size=16) as (base, async_llm):
        assert async_llm.engine.kv_plan.num_tokens <= demand // 10  # one request of max_model_len, no more

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                return await asyncio.gather(*[client.post("/v1/completions", json=_body(p, max_tokens))
                                              for p in prompts])

        responses = asyncio.run(main())
        assert [r.status_code for r in responses] == [200] * len(prompts)
        assert [_token_ids(r.json()["choices"][0]) for r in responses] == expected
        assert async_llm.engine.stats.num_preemptions > 0  # the budget did bind
        assert_engine_idle(async_llm.engine)


# -- disconnects -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["mid-prompt", "mid-stream"])
def test_client_that_goes_away_is_aborted_within_a_step_and_others_are_unchanged(tiny_model_dir, when):
    path = tiny_model_dir("llama")
    others = random_prompts(3, 5, 20, VOCAB, seed=11)
    expected, _ = _offline(path, others, 16)
    with serving(path, max_model_len=512) as (base, async_llm):
        gate = Gate(async_llm.engine)

        async def main():
            if when == "mid-prompt":
                gate.close()  # its first step (the prompt) is held until the client has gone
            async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                async with client.stream("POST", "/v1/completions", json=_body(list(range(5, 25)), 400,
                                                                               stream=True)) as r:
                    assert r.status_code == 200
                    if when == "mid-prompt":
                        await asyncio.to_thread(_wait_until, lambda: gate.entered.is_set(), "its first step")
                        (leaver,) = async_llm._streams
                    else:
                        chunks, lines = [], r.aiter_lines()
                        while len(chunks) < 3:
                            line = await anext(lines)
                            if line.startswith("data: "):
                                chunks.append(json.loads(line.removeprefix("data: ")))
                        leaver = chunks[0]["id"] + "-0"
                    rest = [asyncio.ensure_future(client.post("/v1/completions", json=_body(p, 16))) for p in others]
                    if when == "mid-stream":
                        gate.close()
                        await asyncio.to_thread(gate.entered.wait, TIMEOUT)
                # the connection is closed here, mid-response; the engine is held inside a step
                await asyncio.to_thread(_wait_until, lambda: leaver not in async_llm._streams, "the stream's end")
                steps_when_gone = async_llm.engine.stats.num_steps
                gate.opened.set()
                return leaver, steps_when_gone, await asyncio.gather(*rest)

        leaver, steps_when_gone, rest = asyncio.run(main())
        assert [r.status_code for r in rest] == [200] * len(others)
        assert [_token_ids(r.json()["choices"][0]) for r in rest] == expected
        # it held blocks in the step running when the client left, and in no step after that
        assert any(steps == steps_when_gone and leaver in holders for steps, holders in gate.holders)
        assert not [steps for steps, holders in gate.holders if steps > steps_when_gone and leaver in holders]
        assert _aborted(async_llm) == 1
        assert _metric(base, 'tidal:request_success_total{finished_reason="abort"') == 1
        assert_engine_idle(async_llm.engine)


# -- faults ------------------------------------------------------------------------------------------------
def test_failed_step_aborts_its_requests_and_its_blocks_leave_the_prefix_cache(tiny_model_dir):
    """The blocks a failed step filled are hashed but hold no valid KV: a later request with the same
    prompt must compute it again, not read them."""
    from tidal.engine.llm_engine import StepError
    path = tiny_model_dir("llama")
    prompt = list(range(5, 45))  # two full blocks of 16, cached when allocated
    (expected,), _ = _offline(path, [prompt], 8)
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory_bytes=4 << 20,
                                    max_model_len=MAX_MODEL_LEN))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("victim", {"prompt_token_ids": prompt}, params)
    working = engine.runner.execute

    def failing(batch):
        raise RuntimeError("simulated kernel failure")
    engine.runner.execute = failing
    with pytest.raises(StepError, match=r"RuntimeError: simulated kernel failure\); its 1 request") as failed:
        engine.step()
    assert failed.value.request_ids == ["victim"]
    assert [o.outputs[0].finish_reason for o in failed.value.outputs] == ["abort"]
    assert engine.kv_manager.pool.num_cached_blocks == 0
    assert_engine_idle(engine)
    engine.runner.execute = working
    engine.add_request("again", {"prompt_token_ids": prompt}, params)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.outputs[0].token_ids]
    assert tokens == expected
    engine.shutdown()


def test_fault_in_a_step_fails_its_requests_with_500_and_the_engine_serves_on(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    expected, _ = _offline(path, [[5, 6, 7]], 8)
    monkeypatch.setenv("TIDAL_INJECT_FAULT", "execute:3")  # the third step's model execution raises
    with serving(path) as (base, async_llm):
        failed = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 8), timeout=TIMEOUT)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error"
        assert "the model failed in a step (RuntimeError: injected fault" in error["message"]
        assert "were aborted" in error["message"]
        assert httpx.get(f"{base}/health").status_code == 200
        ok = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 8), timeout=TIMEOUT)
        assert ok.status_code == 200 and _token_ids(ok.json()["choices"][0]) == expected[0]
        assert async_llm.is_running
        assert_engine_idle(async_llm.engine)


def test_fault_that_breaks_the_engine_state_marks_it_dead(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TIDAL_INJECT_FAULT", "update:2")  # bookkeeping half done: cannot go on
    with serving(tiny_model_dir("llama")) as (base, async_llm):
        died = []
        async_llm.on_dead = died.append
        failed = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 8), timeout=TIMEOUT)
        assert failed.status_code == 500
        assert "the engine failed while serving this request" in failed.json()["error"]["message"]
        assert "injected fault" in failed.json()["error"]["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "injected fault" in health.json()["error"]["message"]
        later = httpx.post(f"{base}/v1/completions", json=_body([5, 6, 7], 8), timeout=TIMEOUT)
        assert later.status_code == 503 and "not running" in later.json()["error"]["message"]
        assert len(died) == 1 and "injected fault" in str(died[0])


def test_draining_server_refuses_new_requests_and_health_while_in_flight_ones_finish(tiny_model_dir):
    with serving(tiny_model_dir("llama")) as (base, async_llm):
        gate = Gate(async_llm.engine)
        gate.close()

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                in_flight = asyncio.ensure_future(client.post("/v1/completions", json=_body([5, 6, 7], 8)))
                await asyncio.to_thread(gate.entered.wait, TIMEOUT)
                async_llm.drain(TIMEOUT)  # what SIGTERM does first
                health = await client.get("/health")
                refused = await client.post("/v1/completions", json=_body([5, 6, 7], 8))
                gate.opened.set()
                return health, refused, await in_flight

        health, refused, done = asyncio.run(main())
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert done.status_code == 200 and len(_token_ids(done.json()["choices"][0])) == 8
        assert_engine_idle(async_llm.engine)


# -- shutdown (a real `tidal serve`) ---------------------------------------------------------------------
def _serve(model_dir: str, log_path, *args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tidal.entrypoints.cli", "serve", model_dir, "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--kv-cache-memory-bytes", str(4 << 20), "--served-model-name", "tiny",
           "--disable-log-requests", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        assert time.monotonic() < deadline, f"server not ready:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.25)


def _stream_events(base: str, body: dict, started: threading.Event, events: list) -> None:
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r:
        if r.status_code != 200:
            events.append(r.read().decode())
            started.set()
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line.removeprefix("data: "))
                started.set()


@pytest.mark.parametrize(("sig", "core_process"), [(signal.SIGTERM, False), (signal.SIGINT, False),
                                                    (signal.SIGTERM, True)])
def test_signal_during_streaming_finishes_in_flight_aborts_the_late_and_exits_0(tiny_model_dir, tmp_path, sig,
                                                                                core_process):
    # the long request (16000 steps: the tiny model decodes a token in well under a millisecond) cannot
    # finish within the timeout, the short one (20) must
    proc, base = _serve(tiny_model_dir("llama", max_position_embeddings=16384), tmp_path / "server.log",
                        "--max-model-len", "16384", "--kv-cache-memory-bytes", str(16 << 20), "--shutdown-timeout", "1",
                        "--engine-core-process" if core_process else "--no-engine-core-process")
    try:
        short, long = [], []  # SSE data of a request that fits in the timeout and of one that cannot
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream_events, args=(base, _body([5, 6, 7], n, stream=True), s, e))
                   for n, s, e in ((20, started[0], short), (16000, started[1], long))]
        for t in threads:
            t.start()
        assert all(s.wait(TIMEOUT) for s in started)
        t0 = time.monotonic()
        proc.send_signal(sig)
        for t in threads:
            t.join(TIMEOUT)
        assert proc.wait(TIMEOUT) == 0, (tmp_path / "server.log").read_text()[-4000:]
        assert time.monotonic() - t0 < 1 + 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert short[-1] == "[DONE]"
    chunks = [json.loads(d) for d in short[:-1]]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 20
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]"
    error = json.loads(long[-2])["error"]
    assert "shut down before this request finished" in error["message"], error
    with pytest.raises(httpx.TransportError):  # no longer listening
        httpx.get(f"{base}/health", timeout=2)


def test_a_signal_that_lands_while_the_engine_client_holds_its_send_lock_does_not_deadlock():
    """The signal handler runs on the event loop's thread between two bytecodes of whatever it interrupted:
    there, the engine-core client in the middle of sending a command under its (non-reentrant) lock. The
    drain it starts must not take that lock from inside the handler (a server hung forever that way)."""
    import uvicorn

    from tidal.entrypoints.openai.cli import _server_class

    send_lock = threading.Lock()  # as CoreProcessAsyncLLM._send_raw holds it

    class Client:
        num_open_requests = 1
        drained: list = []

        def drain(self, timeout_s: float) -> None:
            assert send_lock.acquire(timeout=2), "drain ran inside the handler, under the interrupted send's lock"
            self.drained.append(timeout_s)
            send_lock.release()

    client = Client()
    server = _server_class()(uvicorn.Config(app=None), client, 7.0)

    async def main():
        with send_lock:  # the client is sending when the signal arrives
            server.handle_exit(signal.SIGTERM, None)
            assert server.should_exit and client.drained == []
        await asyncio.sleep(0)  # the loop's next callbacks: the drain
        await asyncio.sleep(0)

    asyncio.run(main())
    assert client.drained == [7.0]


# -- load (slow) -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_200_streaming_clients_with_random_disconnects_on_a_small_kv_budget(tiny_model_dir):
    """200 concurrent streaming clients, a quarter of which leave at a random point (before the first token
    or after a few), on a KV cache for 4 requests of max_model_len, for TIDAL_SOAK_ROUNDS rounds (default 3):
    every client that stays gets exactly the unconstrained engine's greedy tokens, no block leaks, and the
    process's RSS does not grow by 5% from the end of the first round to the end of the last."""
    import random

    import psutil
    path = tiny_model_dir("llama")
    rng = random.Random(0)
    num_clients, rounds = 200, int(os.environ.get("TIDAL_SOAK_ROUNDS", "3"))
    prompts = random_prompts(num_clients, 5, 32, VOCAB, seed=5)
    max_tokens = [rng.randint(8, 32) for _ in prompts]
    longest, bytes_per_token = _offline(path, prompts, 32)
    expected = [tokens[:n] for tokens, n in zip(longest, max_tokens)]  # greedy: a shorter run is a prefix
    with serving(path, kv_cache_memory_bytes=4 * MAX_MODEL_LEN * bytes_per_token) as (base, async_llm):
        async def client(http, i: int, leave_after: int | None):
            tokens = []
            async with http.stream("POST", "/v1/completions", json=_body(prompts[i], max_tokens[i],
                                                                          stream=True)) as r:
                assert r.status_code == 200
                if leave_after == 0:
                    return None  # leaves before its first token: the connection closes
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line.removeprefix("data: "))["choices"][0]
                        tokens += [int(t) for t in choice["logprobs"]["tokens"]]
                    if leave_after is not None and len(tokens) >= leave_after:
                        return None  # leaves mid-stream
            return tokens

        async def one_round():
            leavers = {i: rng.randint(0, 4) for i in rng.sample(range(num_clients), num_clients // 4)}
            async with httpx.AsyncClient(base_url=base, timeout=300, limits=httpx.Limits(max_connections=None)) as http:
                got = await asyncio.gather(*[client(http, i, leavers.get(i)) for i in range(num_clients)])
            return leavers, got

        rss = []
        # thousands of preemption warnings would pile up in pytest's log capture and read as growth
        tidal_logger = logging.getLogger("tidal")
        level = tidal_logger.level
        tidal_logger.setLevel(logging.ERROR)
        try:
            for _ in range(rounds):
                leavers, got = asyncio.run(one_round())
                for i, tokens in enumerate(got):
                    if i not in leavers:
                        assert tokens == expected[i], f"client {i}"
                _wait_until(lambda: not async_llm.engine.has_unfinished_requests(), "the aborts")
                assert_engine_idle(async_llm.engine)
                rss.append(psutil.Process().memory_info().rss)
        finally:
            tidal_logger.setLevel(level)
        assert async_llm.engine.stats.num_preemptions > 0
        print(f"\n{rounds} rounds of {num_clients} clients: aborts {_aborted(async_llm)}, preemptions "
              f"{async_llm.engine.stats.num_preemptions}, RSS after each round (MB): {[r >> 20 for r in rss]}")
        if rounds > 1:
            assert rss[-1] < 1.05 * rss[0]


@pytest.mark.parametrize("argv, message", [(["--max-waiting-requests", "0"], "--max-waiting-requests must be >= 1"),
                                           (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
                                           (["--shutdown-timeout", "nan"], "--shutdown-timeout must be >= 0")])
def test_serve_refuses_bad_overload_and_shutdown_flags(argv, message):
    import argparse

    from tidal.entrypoints.openai.cli import _validate, add_server_args
    args = add_server_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(SystemExit, match=message):
        _validate(args)
