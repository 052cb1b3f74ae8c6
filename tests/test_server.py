"""The OpenAI-compatible server end to end: a real `tidal serve` process on 127.0.0.1 (the default
model, started once for this module) driven by the official `openai` client, sync and async."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import running_server

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
STARTUP_TIMEOUT = 240  # seconds; loading the model on a busy 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Base URL of a running `tidal serve`; its log is printed if it fails to start."""
    args = ["--kv-cache-memory-bytes", "67108864", "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
            "--disable-log-requests", "--uvicorn-log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("server") / "server.log", STARTUP_TIMEOUT) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _auth():
    return {"Authorization": f"Bearer {API_KEY}"}


def _tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server}/tokenize", json=body, headers=_auth())
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _metrics(server) -> dict:
    text = httpx.get(f"{server}/metrics", headers=_auth()).text
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _metric(metrics: dict, name: str, **labels) -> float:
    return metrics[name + json.dumps({"model_name": MODEL, **labels}, sort_keys=True)]


# -- completions and chat ------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_usage_is_the_real_token_counts(client, server):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(_tokenize(server, prompt=PROMPT))
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    assert r.choices[0].finish_reason == "length" and r.choices[0].text


def test_a_streamed_chunk_is_one_event_with_the_models_values():
    from tidal.entrypoints.openai.protocol import (
        ChatCompletionChunk,
        ChatStreamChoice,
        CompletionChoice,
        CompletionLogProbs,
        CompletionResponse,
        DeltaMessage,
        UsageInfo,
    )
    from tidal.entrypoints.openai.serving_base import sse
    text = 'é "q"\n\r\u2028 \\ end'
    chunks = [CompletionResponse(id="c", created=1, model="m", usage=UsageInfo(prompt_tokens=1, completion_tokens=2,
                                                                              total_tokens=3),
                                 choices=[CompletionChoice(index=0, text=text, finish_reason="stop", stop_reason=7,
                                                           logprobs=CompletionLogProbs(tokens=[text],
                                                                                       token_logprobs=[-0.25],
                                                                                       top_logprobs=[{text: -0.25}],
                                                                                       text_offset=[0]))]),
              ChatCompletionChunk(id="c", created=1, model="m",
                                  choices=[ChatStreamChoice(index=1, delta=DeltaMessage(content=text))])]
    for chunk in chunks:
        event = sse(chunk)
        assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2] and "\r" not in event
        assert json.loads(event[len("data: "):]) == json.loads(json.dumps(chunk.model_dump()))


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_completion_token_id_prompts_and_echo(client, server):
    ids = _tokenize(server, prompt=PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text == PROMPT + by_text.choices[0].text for c in r.choices)
    assert r.usage.prompt_tokens == 2 * len(ids)


def test_echo_with_logprobs_covers_prompt_and_output(client, server):
    num_prompt = len(_tokenize(server, prompt=PROMPT))
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1,
                                     extra_body={"ignore_eos": True})
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == num_prompt + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == full.choices[0].text and full.choices[0].text.startswith(PROMPT)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=3,
                                            echo=True, logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine).startswith(PROMPT)
        assert sum(len(c.logprobs.tokens) for c in mine) == num_prompt + 4


def test_chat_stream_equals_non_stream(client, server):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert full.usage.prompt_tokens == len(_tokenize(server, messages=MESSAGES))
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_text_parts_equal_string_content(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    a = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_n2_gives_two_full_choices(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=5,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=2, temperature=1.0,
                                          seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1] and chat.usage.completion_tokens == 16


def test_stop_string_cuts_the_output(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    stop = words[len(words) // 2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[:base.index(stop)], (base, stop)
    assert r.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(11) == sample(11)
    assert len({sample(s) for s in (1, 2, 3)}) > 1  # the seed does change the draw


# -- logprobs against the offline API ------------------------------------------------------------

@pytest.fixture(scope="module")
def offline_llm():
    import torch

    from tidal import LLM
    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=67108864)  # same model, dtype as the server
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server (OMP_NUM_THREADS=1): same reduction order, same numbers
    yield llm
    torch.set_num_threads(threads)


def test_completion_logprobs_equal_offline(client, offline_llm):
    from tidal import SamplingParams
    # A fresh cache salt: the server computes the whole prompt, as the offline engine does. (In bf16
    # a prefix-cache hit changes the prefill's shapes, and the logprobs move by up to ~0.1.)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"cache_salt": "completion-logprobs"})
    ref = offline_llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, logprobs=3),
                               use_tqdm=False)[0].outputs[0]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids)
    for i, (token_id, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.tokens[i] == entry[token_id].decoded_token
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-3)
        top = {v.decoded_token: v.logprob for v in entry.values()}
        assert set(lp.top_logprobs[i]) == set(top) and len(lp.top_logprobs[i]) >= 3
        for token, value in lp.top_logprobs[i].items():
            assert value == pytest.approx(top[token], abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_shape_and_values(client, offline_llm):
    from tidal import SamplingParams
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"cache_salt": "chat-logprobs"})
    ref = offline_llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(ref.token_ids)
    for item, token_id, entry in zip(content, ref.token_ids, ref.logprobs):
        assert item.token == entry[token_id].decoded_token
        assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-3)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode())


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 1.5), ("n", 0), ("logprobs", 50)])
def test_invalid_parameter_is_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **{field: value})
    assert e.value.status_code == 400 and e.value.body["param"] == field


def test_over_context_length_is_400_with_the_numbers(client, server):
    num_prompt = len(_tokenize(server, prompt=PROMPT))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    message = e.value.body["message"]
    assert str(MAX_MODEL_LEN) in message and str(num_prompt + MAX_MODEL_LEN) in message


def test_missing_or_wrong_key_is_401_on_every_route_but_health(server):
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/metrics")]:
        r = httpx.request(method, f"{server}{path}", json={})
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, param", [
    # this server runs without --enable-auto-tool-choice
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_unimplemented_fields_are_refused(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param


def test_bad_requests_do_not_disturb_a_running_one(server):
    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        solo = await ac.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})

        async def good():
            stream = await ac.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def bad(kwargs):
            with pytest.raises(openai.BadRequestError):
                await ac.completions.create(model=MODEL, prompt=PROMPT, **kwargs)

        results = await asyncio.gather(good(), bad({"max_tokens": 4, "temperature": -2}),
                                       bad({"max_tokens": 10**6}), bad({"max_tokens": 4, "extra_body": {"top_k": -5}}),
                                       bad({"max_tokens": 4, "extra_body": {"stop_token_ids": [-1]}}))
        return solo.choices[0].text, results[0]

    solo, concurrent = asyncio.run(main())
    assert concurrent == solo


# -- load, disconnects, metrics ------------------------------------------------------------------

def test_64_concurrent_streams_all_complete(server):
    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one(i):
            stream = await ac.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
            return sum(1 for c in chunks if c.choices), chunks[-1].usage.completion_tokens
        return await asyncio.gather(*[one(i) for i in range(64)])

    assert asyncio.run(main()) == [(8, 8)] * 64


def _wait_for_metrics(server, condition, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:  # poll the condition itself; the short pause only spaces the polls
        metrics = _metrics(server)
        if condition(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_the_blocks(client, server):
    aborts_before = _metric(_metrics(server), "tidal:request_success_total", finished_reason="abort")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    during = _metrics(server)
    assert _metric(during, "tidal:num_requests_running") == 1
    assert _metric(during, "tidal:kv_cache_usage_perc") > 0
    stream.close()
    after = _wait_for_metrics(server, lambda m: _metric(m, "tidal:kv_cache_usage_perc") == 0)
    assert _metric(after, "tidal:num_requests_running") == 0
    assert _metric(after, "tidal:kv_cache_usage_perc") == 0
    assert _metric(after, "tidal:request_success_total", finished_reason="abort") == aborts_before + 1


def test_disconnect_of_a_non_streaming_request_aborts_it(server):
    aborts_before = _metric(_metrics(server), "tidal:request_success_total", finished_reason="abort")

    async def main():
        async with httpx.AsyncClient(headers=_auth(), timeout=300) as ac:
            request = asyncio.ensure_future(ac.post(f"{server}/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the engine runs it
                r = await ac.get(f"{server}/metrics")
                running = [line for line in r.text.splitlines() if line.startswith("tidal:num_requests_running")]
                if running and float(running[0].split()[-1]) == 1:
                    break
                await asyncio.sleep(0.1)
            request.cancel()  # closes the connection: the client is gone
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(main())
    after = _wait_for_metrics(server, lambda m: _metric(m, "tidal:kv_cache_usage_perc") == 0)
    assert _metric(after, "tidal:num_requests_running") == 0
    assert _metric(after, "tidal:request_success_total", finished_reason="abort") == aborts_before + 1


def test_serve_help_lists_engine_and_server_flags():
    from tidal.entrypoints.engine_args import add_engine_args
    from tidal.entrypoints.openai.cli import add_server_args
    engine = {s for a in add_engine_args(argparse.ArgumentParser())._actions for s in a.option_strings}
    serve = {s for a in add_server_args(argparse.ArgumentParser())._actions for s in a.option_strings}
    assert engine <= serve
    assert {"--host", "--port", "--served-model-name", "--api-key", "--max-log-len", "--uvicorn-log-level"} <= serve


def test_api_key_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("TIDAL_API_KEY", "from-env")
    from tidal.entrypoints.openai.cli import add_server_args
    assert add_server_args(argparse.ArgumentParser()).parse_args([]).api_key == "from-env"


def test_metrics_page_parses_with_vllm_style_names(client, server):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    names = {f.name for f in text_string_to_metric_families(
        httpx.get(f"{server}/metrics", headers=_auth()).text)}
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
                 "prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries",
                 "prefix_cache_hits", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds"]:
        assert f"tidal:{name}" in names, name
    m = _metrics(server)
    assert _metric(m, "tidal:generation_tokens_total") >= 4
    assert _metric(m, "tidal:time_to_first_token_seconds_count") >= 1
    assert _metric(m, "tidal:e2e_request_latency_seconds_count") >= 1
    assert _metric(m, "tidal:request_success_total", finished_reason="length") >= 1
    # Tidal's own step counters (from the engine core's stats): host time is a part of the steps
    assert _metric(m, "tidal:engine_steps_total") >= 4
    assert _metric(m, "tidal:engine_step_seconds_total") > _metric(m, "tidal:engine_host_seconds_total") > 0


# -- small routes and the benchmark client -------------------------------------------------------

def test_tokenize_detokenize_roundtrip_and_version(server):
    ids = _tokenize(server, prompt=PROMPT)
    r = httpx.post(f"{server}/detokenize", json={"tokens": ids}, headers=_auth())
    assert r.status_code == 200 and r.json()["prompt"] == PROMPT
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [10**9]}, headers=_auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    import tidal
    assert httpx.get(f"{server}/version", headers=_auth()).json() == {"version": tidal.__version__}


def test_bench_serve_reports_every_request(server, tmp_path, capsys):
    from tidal.benchmarks import serve as bench_serve
    parser = bench_serve.add_arguments(argparse.ArgumentParser())
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--base-url", server, "--api-key", API_KEY, "--num-prompts", "4",
                              "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "20",
                              "--seed", "3", "--output-json", str(out)])
    assert bench_serve.main(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["seed"] == 3  # what the planner draws the same requests from (calibrate.serve_runs)
    assert result["total_output_tokens"] == 16 and result["total_input_tokens"] == 64
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serve_without_streaming_counts_tokens_and_reports_no_latencies(server, tmp_path, capsys):
    """--no-stream: one JSON reply a request; the tokens come from each reply's usage, and TTFT, TPOT and ITL
    (nothing arrives before the end) are null rather than a number that was never measured."""
    from tidal.benchmarks import serve as bench_serve
    parser = bench_serve.add_arguments(argparse.ArgumentParser())
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--base-url", server, "--api-key", API_KEY, "--num-prompts", "3",
                              "--random-input-len", "16", "--random-output-len", "5", "--seed", "4",
                              "--no-stream", "--output-json", str(out)])
    assert bench_serve.main(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["failed"] == 0 and result["stream"] is False
    assert result["total_output_tokens"] == 15 and result["mean_e2el_ms"] > 0
    assert result["mean_ttft_ms"] is None and result["p99_tpot_ms"] is None and result["median_itl_ms"] is None
    assert "n/a (not streamed)" in capsys.readouterr().out
