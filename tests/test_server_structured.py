"""Structured outputs and tool calling through a real `tidal serve` (the default model, with the
Hermes tool template of examples/ and the hermes parser) driven by the official openai client."""
from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import running_server

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "tool_chat_template_hermes.jinja")
STARTUP_TIMEOUT = 240

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0, "maximum": 3},
        "pets": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"type": "string", "enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer"}},
            "required": ["kind", "legs"]}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "country": {"type": "string", "maxLength": 24}},
                    "required": ["city", "country"]},
    },
    "required": ["name", "age", "height_m", "pets", "address"],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--kv-cache-memory-bytes", "67108864", "--max-model-len", "2048", "--chat-template", TEMPLATE,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-requests",
            "--uvicorn-log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("server") / "server.log", STARTUP_TIMEOUT) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def _schema_of(tool):
    return tool["function"]["parameters"]


# -- structured outputs ------------------------------------------------------------------------------

def test_json_schema_on_20_prompts_always_parses_and_validates(server):
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def one(i):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Invent person number {i} and describe them."}],
            response_format=fmt, temperature=0.9, seed=i, max_tokens=200)

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(20)))
        finally:
            await client.close()
    for r in asyncio.run(all_of_them()):
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float
    landmarks: list[Annotated[str, Field(max_length=30)]] = Field(max_length=3)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, temperature=0, max_tokens=300)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_choice_and_regex_on_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="The best pet is a", max_tokens=8, temperature=1.0, seed=2,
                                  extra_body={"guided_choice": ["cat", "dog"]})
    assert r.choices[0].text in ("cat", "dog")
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"regex": r"\+33 [0-9]{9}"}})
    assert re.fullmatch(r"\+33 [0-9]{9}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, n=3, seed=5, temperature=1.0,
                                       extra_body={"guided_regex": "(sunny|rainy|cloudy)"})
    assert {c.message.content for c in r.choices} <= {"sunny", "rainy", "cloudy"}
    r = client.completions.create(model=MODEL, prompt="A JSON object with the keys name and age of a cat:",
                                  max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "root ::= nothing_here"}}, "guided_grammar"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
    ({"extra_body": {"guided_regex": "a", "guided_whitespace_pattern": "[ ]?"}}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_invalid_constraints_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


# -- tool calling ------------------------------------------------------------------------------------

def _calls(message):
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def _streamed(client, **kw):
    """Reassemble a streamed chat completion: (content, [(name, arguments)], finish_reason, ids)."""
    content, calls, ids, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:
                    ids[d.index] = d.id
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish, ids


def test_required_tool_choice_calls_valid_tools_streamed_alike(client):
    """tool_choice "required" constrains the output to a non-empty array of calls of the given tools: with
    parallel_tool_calls false to one call, which ends the output; otherwise the model may go on calling
    (this one repeats itself on some CPUs' bf16 products until max_tokens), every call it completes valid."""
    schemas = {t["function"]["name"]: _schema_of(t) for t in TOOLS}
    for parallel, finishes in ((False, {"tool_calls"}), (None, {"tool_calls", "length"})):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=150)
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason in finishes and msg.tool_calls, (parallel, r.choices[0])
        assert parallel is None or len(msg.tool_calls) == 1
        for call in msg.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            assert call.id and call.type == "function"
        if r.choices[0].finish_reason == "tool_calls":
            content, calls, finish, ids = _streamed(client, **kw)
            assert calls == _calls(msg) and finish == "tool_calls" and len(ids) == len(calls)


def test_named_tool_choice_calls_that_function(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0.7, seed=4, max_tokens=80)
    r = client.chat.completions.create(**kw)
    (name, args), = _calls(r.choices[0].message)
    assert name == "get_time"
    jsonschema.validate(json.loads(args), _schema_of(TIME))
    assert _streamed(client, **kw)[1] == [(name, args)]


def test_auto_tool_choice_parses_hermes_calls_streamed_alike(client):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>')
    # the template's own format, forced so that the test does not depend on what the 135M model decides
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=60,
              extra_body={"structured_outputs": {"choice": [text]}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert _calls(msg) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
    content, calls, finish, _ = _streamed(client, **kw)
    assert (content, calls, finish) == (None, _calls(msg), "tool_calls")
    # no call in the text: plain content
    kw["extra_body"] = {"structured_outputs": {"choice": ["It is sunny in Paris."]}}
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == "It is sunny in Paris." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_template_gets_tools_and_tool_results_are_accepted(client, server):
    body = {"messages": ASK, "tools": TOOLS}
    ids = httpx.post(f"{server}/tokenize", json=body).json()["tokens"]
    prompt = httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "get_weather" in prompt and "<tools>" in prompt
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    ids = httpx.post(f"{server}/tokenize", json={"messages": turn, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_response>\n{"temperature": 21}' in prompt and '"city": "Paris"' in prompt
    r = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls
