"""Tool-call parsers on fixed texts: whole outputs, and streaming, where the deltas of every prefix
must reassemble to exactly the whole-output message."""
from __future__ import annotations

import json

import pytest

from tidal.entrypoints.openai.tool_calls import ToolCallStream, full_message
from tidal.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
)

HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')

CASES = [
    (HermesToolParser(), HERMES_TWO, "Let me check.\n",
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    (HermesToolParser(), "No tools needed: 4.", "No tools needed: 4.", []),
    (HermesToolParser(), '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    (Llama3JsonToolParser(), '{"name": "search", "parameters": {"q": "tidal {waves}"}}', None,
     [("search", '{"q": "tidal {waves}"}')]),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}',
     None, [("a", "{}"), ("b", '{"x": [1]}')]),
    (Llama3JsonToolParser(), "Hello there", "Hello there", []),
    (RequiredToolParser(), '[{"name": "f", "parameters": {"a": "}]"}}, {"name": "g", "parameters": {}}]', None,
     [("f", '{"a": "}]"}'), ("g", "{}")]),
    (NamedToolParser("f"), '{"a": 1, "b": [true]}', None, [("f", '{"a": 1, "b": [true]}')]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_output(parser, text, content, calls):
    got_content, got_calls = full_message(parser, text)
    assert got_content == content
    assert [(c.function.name, c.function.arguments) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c.function.arguments)
        assert c.id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("parser, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_reassembles_to_whole_output(parser, text, content, calls, step):
    stream = ToolCallStream(parser)
    got_content, names, args, ids = "", [], [], []
    ends = list(range(step, len(text), step)) + [len(text)]
    for end in ends:
        c, deltas = stream.update(text[:end], final=end == len(text))
        got_content += c
        for d in deltas:
            if d.id is not None:  # a call opens with its id and complete name, arguments ""
                assert d.index == len(names) and d.function.name and d.function.arguments == ""
                names.append(d.function.name)
                args.append("")
                ids.append(d.id)
            else:
                assert d.function.name is None
                args[d.index] += d.function.arguments
    assert (got_content or None) == content if calls else got_content == content
    assert list(zip(names, args)) == calls
    assert len(set(ids)) == len(ids)


def test_stream_holds_back_a_partial_tag():
    stream = ToolCallStream(HermesToolParser())
    assert stream.update("Sure <tool", final=False) == ("Sure ", [])
    content, deltas = stream.update('Sure <tool_call>{"name": "f", "arguments": {', final=False)
    assert content == "" and [d.function.name for d in deltas] == ["f", None]
