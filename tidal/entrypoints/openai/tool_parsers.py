"""Tool-call parsers: the model's text -> (content, tool calls), for whole and streamed outputs alike.

Every parser maps the text generated so far to a `Parsed`: the content that is certain so far and
each call's name (once complete) and raw argument text (a prefix of the final one). Streaming sends
the growth of that parse as deltas, and the whole response is the parse of the whole text, so the
streamed deltas reassemble exactly to the non-streamed message. Arguments are the model's own JSON
text for the arguments object, never re-serialised.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text before the first
  one is content (Hermes, Qwen2.5 and other ChatML tool templates).
- `llama3_json`: the output is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`, several joined by `;`); anything else is content (Llama 3.1/3.2 JSON tools).
- `required` / `named`: what `tool_choice` "required" (a JSON array of {"name", "parameters"}) and a
  named function (the arguments object itself) constrain the output to.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass
class Call:
    name: str
    arguments: str  # raw JSON text of the arguments (a prefix of it while the call is incomplete)


@dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def _held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of text could be the start of tag (kept back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_object(text: str, pos: int, final: bool) -> tuple[Call | None, int | None]:
    """Parse {"name": ..., "arguments"|"parameters": {...}} starting at pos (after whitespace).
    Returns (the call so far or None, the index after its closing brace or None if not closed)."""
    m = _HEAD.match(text, pos)
    if m is None:
        if final:  # keys in another order: parse the whole object (arguments then re-serialised)
            try:
                obj, end = _DECODER.raw_decode(text, len(text) - len(text[pos:].lstrip()))
            except ValueError:
                return None, None
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and args is not None:
                return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)), end
        return None, None
    name = json.loads(f'"{m.group(1)}"')
    start = m.end()
    if start < len(text) and text[start] != "{":
        # arguments as a JSON string (some models) or another value: only taken once complete
        try:
            value, end = _DECODER.raw_decode(text, start)
        except ValueError:
            return Call(name, ""), None
        args = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    else:
        try:
            _, end = _DECODER.raw_decode(text, start)
        except ValueError:  # the object is still open: everything after its start belongs to it
            return Call(name, text[start:]), None
        args = text[start:end]
    rest = text[end:]
    close = len(rest) - len(rest.lstrip())
    if close < len(rest) and rest[close] == "}":
        return Call(name, args), end + close + 1
    return Call(name, args), None


class ToolParser:
    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        i = text.find(self.start)
        if i < 0:
            return Parsed(text if final else text[:len(text) - _held_prefix(text, self.start)])
        out = Parsed(text[:i])
        while i >= 0:
            call, close = _call_object(text, i + len(self.start), final)
            if call is None:
                break
            out.calls.append(call)
            if close is None:
                break
            i = text.find(self.start, close)
        return out


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        elif not body.startswith("{"):
            if not final and (not body or self.tag.startswith(body)):
                return Parsed()  # not yet known whether this is a call
            return Parsed(text)
        out, pos = Parsed(), 0
        while pos < len(body):
            call, close = _call_object(body, pos, final)
            if call is None:
                break
            out.calls.append(call)
            if close is None:
                break
            rest = body[close:].lstrip()
            if not rest.startswith(";"):
                break
            pos = len(body) - len(rest) + 1
        if final and not out.calls:
            return Parsed(text)
        return out


class RequiredToolParser(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects."""
    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        out = Parsed()
        if not body.startswith("["):
            return out
        pos = 1
        while True:
            call, close = _call_object(body, pos, final)
            if call is None:
                return out
            out.calls.append(call)
            if close is None:
                return out
            rest = body[close:].lstrip()
            if not rest.startswith(","):
                return out
            pos = len(body) - len(rest) + 1


class NamedToolParser(ToolParser):
    """A named tool_choice: the whole output is the arguments object of that function."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [Call(self.function_name, text)])


TOOL_PARSERS = {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)}
