"""Hostile input against a real `tidal serve` (a tiny random Llama with SmolLM2's tokenizer, so text
goes in and out): every malformed or extreme body is a 4xx OpenAI error body naming the field,
never a 5xx, a hang or a crash; Schemathesis fuzzing of every route from the app's OpenAPI schema
gets no response >= 500; afterwards the server answers as before with its KV cache empty. Also:
prompts, outputs and the API key stay out of the log; CORS only for --allowed-origins."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import running_server, save_tiny_model, tiny_config

API_KEY = "hostile-test-key"
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 256
BODY_LIMIT = 1 << 20
ORIGIN = "https://app.example"
SECRET = "zebra-marmalade-7731"  # a prompt marker that must never reach the log
STARTUP_TIMEOUT = 180


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tidal.loader.gguf_loader import load_gguf_tokenizer
    from tidal.loader.loader import default_model_path
    path = str(tmp_path_factory.mktemp("tiny-llama-served"))
    tokenizer = load_gguf_tokenizer(default_model_path())
    config = tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=0)
    save_tiny_model(path, config)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """(base URL, log path) of a running server; request logging on, at the default log level."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [model_dir, "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32", "--served-model-name", "tiny",
            "--api-key", API_KEY, "--max-request-body-bytes", str(BODY_LIMIT), "--allowed-origins", ORIGIN]
    with running_server(args, log, STARTUP_TIMEOUT) as (_, base):
        yield base, log


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _headers():
    return {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def _post(server, path, raw: bytes, timeout=60) -> httpx.Response:
    return httpx.post(f"{server}{path}", content=raw, headers=_headers(), timeout=timeout)


def _kv_usage(server) -> float:
    text = httpx.get(f"{server}/metrics", headers=_headers()).text
    return float(next(line for line in text.splitlines() if line.startswith("tidal:kv_cache_usage_perc")).split()[-1])


def _assert_serves_and_drains(server, expected_text: str | None = None) -> str:
    """A normal greedy request answers (the same text as before, if given), then KV usage is 0."""
    r = _post(server, "/v1/completions", json.dumps({"prompt": "The tide", "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True}).encode())
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    if expected_text is not None:
        assert text == expected_text
    deadline = time.monotonic() + 30
    while _kv_usage(server) != 0 and time.monotonic() < deadline:  # freed before the engine's next step
        time.sleep(0.05)
    assert _kv_usage(server) == 0
    return text


@pytest.fixture(scope="module")
def baseline_text(server):
    return _assert_serves_and_drains(server)


def _j(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes out as the escape "\ud800"


C, CHAT, TOK = "/v1/completions", "/v1/chat/completions", "/tokenize"
USER = [{"role": "user", "content": "hi"}]
HOSTILE = {
    # (route, body, param the error must name (None: no single field), text the message must hold)
    "temperature=Infinity": (C, b'{"prompt": "hi", "temperature": Infinity}', "temperature", "finite"),
    "temperature=NaN": (C, b'{"prompt": "hi", "temperature": NaN}', "temperature", "finite"),
    "temperature=1e999": (C, b'{"prompt": "hi", "temperature": 1e999}', "temperature", "finite"),
    "top_p=NaN": (C, b'{"prompt": "hi", "top_p": NaN}', "top_p", "finite"),
    "min_p=NaN": (C, b'{"prompt": "hi", "min_p": NaN}', "min_p", "finite"),
    "repetition_penalty=inf": (C, b'{"prompt": "hi", "repetition_penalty": Infinity}', "repetition_penalty",
                               "finite"),
    "presence_penalty=-inf": (C, b'{"prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty",
                              "finite"),
    "temperature string": (C, _j({"prompt": "hi", "temperature": "hot"}), "temperature", "number"),
    "max_tokens=1e9": (C, _j({"prompt": "hi", "max_tokens": 10**9}), "max_tokens", "maximum context length"),
    "max_tokens=1e30": (C, _j({"prompt": "hi", "max_tokens": 10**30}), "max_tokens", "maximum context length"),
    "max_tokens=-3": (C, _j({"prompt": "hi", "max_tokens": -3}), "max_tokens", "at least 1"),
    "max_completion_tokens=1e9": (CHAT, _j({"messages": USER, "max_completion_tokens": 10**9}), "max_tokens",
                                  "maximum context length"),
    "n=1e6": (C, _j({"prompt": "hi", "n": 10**6}), "n", f"at most {MAX_NUM_SEQS}"),
    "n=1e6 chat stream": (CHAT, _j({"messages": USER, "n": 10**6, "stream": True}), "n", "--max-num-seqs"),
    "n=0": (C, _j({"prompt": "hi", "n": 0}), "n", ">= 1"),
    "1000 prompts": (C, _j({"prompt": ["hi"] * 1000}), "prompt", "split the batch"),
    "logprobs=1e6": (C, _j({"prompt": "hi", "logprobs": 10**6}), "logprobs", "--max-logprobs"),
    "top_logprobs=1e6": (CHAT, _j({"messages": USER, "logprobs": True, "top_logprobs": 10**6}), "top_logprobs",
                         "--max-logprobs"),
    "prompt_logprobs=1e6": (C, _j({"prompt": "hi", "prompt_logprobs": 10**6}), "prompt_logprobs",
                            "--max-logprobs"),
    "logprobs=-1": (C, _j({"prompt": "hi", "logprobs": -1}), "logprobs", "[0, 20]"),
    "top_k=-5": (C, _j({"prompt": "hi", "top_k": -5}), "top_k", "-1 (disabled)"),
    "top_k=1e30": (C, _j({"prompt": "hi", "top_k": 10**30}), "top_k", "2147483647"),
    "seed=1e30": (C, _j({"prompt": "hi", "seed": 10**30}), "seed", "2**64"),
    "min_tokens=1e30": (C, _j({"prompt": "hi", "max_tokens": 4, "min_tokens": 10**30}), "min_tokens",
                        "max_tokens"),
    "stop list of 100000": (C, _j({"prompt": "hi", "stop": ["ab"] * 100_000}), "stop", "at most 256"),
    "stop string of 1 MB": (C, _j({"prompt": "hi", "stop": "x" * 1_000_000}), "stop", "4096 characters"),
    "stop_token_ids of 2000": (C, _j({"prompt": "hi", "stop_token_ids": [1] * 2000}), "stop_token_ids",
                               "at most 1024"),
    "stop_token_ids=1e30": (C, _j({"prompt": "hi", "stop_token_ids": [10**30]}), "stop_token_ids",
                            "vocabulary"),
    "lone surrogate prompt": (C, _j({"prompt": "a\ud800b"}), "prompt", "surrogate"),
    "lone surrogate prompt list": (C, _j({"prompt": ["ok", "\udfff"]}), "prompt[1]", "surrogate"),
    "lone surrogate chat": (CHAT, _j({"messages": [{"role": "user", "content": "\ud800"}]}),
                            "messages[0].content", "surrogate"),
    "lone surrogate stop": (C, _j({"prompt": "hi", "stop": ["\udc00"]}), "stop[0]", "surrogate"),
    "lone surrogate cache_salt": (C, _j({"prompt": "hi " * 40, "cache_salt": "\ud800"}), "cache_salt",
                                  "surrogate"),
    "lone surrogate tokenize": (TOK, _j({"prompt": "\ud800"}), "prompt", "surrogate"),
    "lone surrogate key": (CHAT, _j({"messages": USER, "chat_template_kwargs": {"\ud800": 1}}),
                           "chat_template_kwargs", "surrogate"),
    "invalid UTF-8": (C, b'{"prompt": "\xff\xfe"}', None, "not valid UTF-8"),
    "nested 100 deep": (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
                        + b"[" * 100 + b"]" * 100 + b"}}", "chat_template_kwargs", "nested"),
    "nested 100000 deep": (C, b'{"prompt": "x", "structured_outputs": ' + b"[" * 100_000 + b"]" * 100_000
                           + b"}", None, "nested too deep"),
    "guided_json nested 900 deep": (C, b'{"prompt": "x", "guided_json": ' + b'{"items": ' * 900 + b"{}"
                                    + b"}" * 900 + b"}", "guided_json", "nested"),
    "malformed JSON": (C, b'{"prompt": ', None, "JSON"),
    "body is a list": (C, b"[1, 2]", None, "dictionary"),
    "body is null": (C, b"null", None, ""),
    "empty body": (C, b"", None, ""),
    "missing prompt": (C, _j({"max_tokens": 1}), "prompt", "required"),
    "missing messages": (CHAT, _j({"max_tokens": 1}), "messages", "required"),
    "prompt of the wrong type": (C, _j({"prompt": 5}), "prompt", ""),
    "empty prompt list": (C, _j({"prompt": []}), "prompt", "empty"),
    "empty token list": (C, _j({"prompt": [[]]}), "prompt", "empty"),
    "prompt too long": (C, _j({"prompt": "hello " * 300}), "prompt", "more than max_model_len"),
    "prompt of 600,000 characters": (C, _j({"prompt": "hello " * 100_000}), "prompt", "characters"),
    "messages of 600,000 characters": (CHAT, _j({"messages": [{"role": "user", "content": "hi " * 100_000},
                                                             {"role": "user", "content": [
                                                                 {"type": "text", "text": "hi " * 100_000}]}]}),
                                       "messages", "characters"),
    "tokenize 600,000 characters": (TOK, _j({"prompt": "hello " * 100_000}), "prompt", "characters"),
    "token id past the vocabulary": (C, _j({"prompt": [1, 10**12]}), "prompt", "vocabulary"),
    "negative token id": (C, _j({"prompt": [[1, -1]]}), "prompt", "vocabulary"),
    "empty messages": (CHAT, _j({"messages": []}), "messages", "empty"),
    "message content of the wrong type": (CHAT, _j({"messages": [{"role": "user", "content": 5}]}),
                                          "messages[0].content", ""),
    "unknown role": (CHAT, _j({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role", "wizard"),
    "template that raises": (CHAT, _j({"messages": USER, "chat_template": "{{ 1/0 }}"}), "chat_template",
                             "--trust-request-chat-template"),
    "template with nested loops": (CHAT, _j({"messages": USER, "chat_template": "{% for i in range(99999) %}"
                                             "{% for j in range(99999) %}x{% endfor %}{% endfor %}"}),
                                   "chat_template", "--trust-request-chat-template"),
    "template kwargs that clash": (CHAT, _j({"messages": USER, "chat_template_kwargs": {"tokenize": True}}),
                                   "messages", "chat template"),
    "unknown field": (C, _j({"prompt": "hi", "no_such_field": 1}), "no_such_field", "unknown field"),
    "stream_options not an object": (C, _j({"prompt": "hi", "stream": True, "stream_options": 5}),
                                     "stream_options", ""),
    "invalid regex": (C, _j({"prompt": "hi", "guided_regex": "(("}), "guided_regex", "regular expression"),
    "detokenize id 1e30": ("/detokenize", _j({"tokens": [10**30]}), "tokens", "vocabulary"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_body_is_a_4xx_naming_the_field(server, baseline_text, name):
    path, raw, param, text = HOSTILE[name]
    r = _post(server, path, raw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["param"] == param, error
    assert text in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_server_serves_as_before_after_the_hostile_bodies(server, baseline_text):
    _assert_serves_and_drains(server, baseline_text)


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    """The Content-Length alone is enough: the server answers without waiting for 100 MB."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {100 * 2**20}\r\n\r\n".encode() + b'{"prompt"')
        reply = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert b"--max-request-body-bytes" in reply and b"request_too_large" in reply


def test_a_chunked_body_over_the_limit_is_413(server):
    def body():  # no Content-Length: the server counts the bytes as they arrive
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"x" * BODY_LIMIT
        yield b'"}'
    r = httpx.post(f"{server}/v1/completions", content=body(), headers=_headers(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok = _post(server, "/v1/completions", _j({"prompt": "x" * (BODY_LIMIT // 2), "max_tokens": 1}))
    assert ok.status_code == 400 and ok.json()["error"]["param"] == "prompt"  # under the limit: read, too long


def test_prompts_outputs_and_the_api_key_are_not_logged(served):
    server, log = served
    r = _post(server, "/v1/completions", _j({"prompt": f"Remember {SECRET}", "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True}))
    assert r.status_code == 200
    output = r.json()["choices"][0]["text"]
    text = log.read_text()
    assert "Received request cmpl-" in text  # the request is logged, without its content
    assert SECRET not in text and API_KEY not in text
    assert len(output) < 8 or output not in text


def test_cors_headers_only_for_the_allowed_origin(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(f"{server}/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server}/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    r = httpx.get(f"{server}/v1/models", headers={"Origin": ORIGIN})  # no key: refused, still with CORS headers
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_without_allowed_origins():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tidal.entrypoints.openai.input_guard import add_cors
    app = FastAPI()
    app.get("/x")(lambda: {})
    add_cors(app, None)
    r = TestClient(app).get("/x", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("value, origins", [("https://a.example", ["https://a.example"]),
                                            ("https://a.example, http://b.example:8080",
                                             ["https://a.example", "http://b.example:8080"]),
                                            ('["*"]', ["*"])])
def test_allowed_origins_flag_forms(value, origins):
    from tidal.entrypoints.openai.input_guard import parse_allowed_origins
    assert parse_allowed_origins(value) == origins


# -- fuzzing -------------------------------------------------------------------------------------------
def _fuzz(server, tmp_path, max_examples: int, phases: str) -> dict[int, int]:
    """Schemathesis over every route of the app's OpenAPI schema; returns {status: count}."""
    report = tmp_path / "fuzz"
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", f"{server}/openapi.json",
           "--checks", "not_a_server_error", "--phases", phases, "--max-examples", str(max_examples),
           "--workers", "1", "--request-timeout", "60", "--continue-on-failure", "--seed", "1",
           "--header", f"Authorization: Bearer {API_KEY}", "--report", "ndjson", "--report-dir", str(report)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path,  # its cache there
                         env=dict(os.environ, NO_COLOR="1"))
    statuses: dict[int, int] = {}

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("status_code"), int):
                statuses[x["status_code"]] = statuses.get(x["status_code"], 0) + 1
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for path in report.glob("*.ndjson"):
        for line in path.read_text().splitlines():
            walk(json.loads(line))
    assert run.returncode == 0, run.stdout[-6000:]
    return statuses


def _check_fuzz(server, baseline_text, statuses, at_least: int) -> None:
    total = sum(statuses.values())
    print(f"fuzz: {total} responses, by status {dict(sorted(statuses.items()))}")
    assert total >= at_least
    assert not {s: n for s, n in statuses.items() if s >= 500}
    assert statuses.get(200, 0) > 0  # some fuzzed requests were valid and answered
    _assert_serves_and_drains(server, baseline_text)


def test_fuzzed_requests_get_no_server_error(server, baseline_text, tmp_path):
    statuses = _fuzz(server, tmp_path, max_examples=10, phases="coverage,fuzzing")
    _check_fuzz(server, baseline_text, statuses, at_least=500)


@pytest.mark.slow
def test_fuzzed_requests_get_no_server_error_long(server, baseline_text, tmp_path):
    statuses = _fuzz(server, tmp_path, max_examples=300, phases="examples,coverage,fuzzing")
    _check_fuzz(server, baseline_text, statuses, at_least=1000)


# -- hypothesis: valid bodies with one to three fields made hostile -----------------------------------
# Schemathesis mostly sends bodies that fail validation early; these reach the engine: a valid request
# with a few fields set to random (often extreme) values of any JSON type.
FIELDS = {
    C: ["prompt", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "prompt_logprobs",
        "echo", "stream", "ignore_eos", "best_of", "cache_salt", "include_stop_str_in_output", "skip_special_tokens",
        "guided_choice", "guided_regex", "stream_options", "model", "user"],
    CHAT: ["messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_k", "seed", "stop", "logprobs",
           "top_logprobs", "stream", "tools", "tool_choice", "response_format", "chat_template", "chat_template_kwargs",
           "continue_final_message", "add_generation_prompt", "echo", "cache_salt", "min_tokens", "ignore_eos"],
    TOK: ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools"],
    "/detokenize": ["tokens"],
}
BASE = {C: {"prompt": "The tide", "max_tokens": 4}, CHAT: {"messages": USER, "max_tokens": 4},
        TOK: {"prompt": "The tide"}, "/detokenize": {"tokens": [1, 2, 3]}}


def _json_values():
    from hypothesis import strategies as st
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                        st.sampled_from(["\ud800", "a\udfff", "\x00", "", "{{ 1/0 }}", "user", "json_object"]))
    hostile = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
    # values that many fields accept, so that half the bodies get past validation into the engine
    plausible = st.sampled_from([0, 1, 2, 3, -1, 0.0, 0.5, 1.0, True, False, None, "a", ".", ["a"], [1, 2], 42])
    return st.one_of(plausible, hostile)


def _hypothesis_fuzz(server, max_examples: int) -> dict[int, int]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    statuses: dict[int, int] = {}
    routes = st.sampled_from(list(FIELDS))

    @st.composite
    def bodies(draw):
        route = draw(routes)
        body = dict(BASE[route])
        for field in draw(st.lists(st.sampled_from(FIELDS[route]), min_size=1, max_size=3, unique=True)):
            body[field] = draw(_json_values())
        return route, body

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=bodies())
    def run(case):
        route, body = case
        with httpx.stream("POST", f"{server}{route}", content=json.dumps(body).encode(), headers=_headers(),
                          timeout=120) as r:
            r.read()  # a stream to its end
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (route, body, r.text[:500])
        if r.status_code == 200 and body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-500:]

    run()
    return statuses


def test_valid_bodies_with_hostile_fields_get_no_server_error(server, baseline_text):
    statuses = _hypothesis_fuzz(server, max_examples=150)
    print(f"hypothesis fuzz: {sum(statuses.values())} responses, by status {dict(sorted(statuses.items()))}")
    assert not {s: n for s, n in statuses.items() if s >= 500} and statuses.get(200, 0) > 0
    _assert_serves_and_drains(server, baseline_text)


@pytest.mark.slow
def test_valid_bodies_with_hostile_fields_get_no_server_error_long(server, baseline_text):
    statuses = _hypothesis_fuzz(server, max_examples=1500)
    print(f"hypothesis fuzz: {sum(statuses.values())} responses, by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= 1000
    assert not {s: n for s, n in statuses.items() if s >= 500} and statuses.get(200, 0) > 0
    _assert_serves_and_drains(server, baseline_text)


@pytest.mark.parametrize("argv, message", [(["--max-logprobs", "21"], "--max-logprobs"),
                                           (["--max-request-body-bytes", "-1"], "--max-request-body-bytes"),
                                           (["--allowed-origins", "[1]"], "--allowed-origins")])
def test_server_limit_flags_are_checked(argv, message):
    import argparse

    from tidal.entrypoints.openai.cli import _validate, add_server_args
    args = add_server_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(SystemExit, match=message):
        _validate(args)


def test_server_limit_flag_defaults():
    import argparse

    from tidal.entrypoints.openai.cli import add_server_args
    args = add_server_args(argparse.ArgumentParser()).parse_args([])
    assert (args.max_request_body_bytes, args.max_logprobs, args.allowed_origins,
            args.trust_request_chat_template) == (32 * 2**20, 20, None, False)
