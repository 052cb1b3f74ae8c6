"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` mean for one request, and
the assistant message (whole, or as stream deltas) built from the generated text.

tool_choice (default: "auto" when the server enables auto tool choice, else "none", when tools are
given):
- "none": the template sees the tools, the output is plain content.
- "auto": the model decides; its text is parsed by the server's --tool-call-parser.
- "required": the output is constrained to a JSON array of one or more {"name", "parameters"}
  objects, each valid under its function's parameters schema.
- {"type": "function", "function": {"name": ...}}: constrained to that function's arguments object.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from tidal.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UnsupportedFieldError,
)
from tidal.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    Parsed,
    RequiredToolParser,
    ToolParser,
)
from tidal.structured_outputs.params import StructuredOutputsParams

_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolSetup:
    tools: list[dict] | None = None            # for the chat template
    parser: ToolParser | None = None           # None: the output is plain content
    constraint: StructuredOutputsParams | None = None
    named: bool = False                        # a named call finishes with "stop", as OpenAI's


def check_tools(tools) -> list[dict]:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise UnsupportedFieldError(f"tools[{i}]", "each tool must be {\"type\": \"function\", \"function\": "
                                                      "{\"name\": ..., \"parameters\": {...}}}")
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise UnsupportedFieldError(f"tools[{i}].function.name", f"must be 1-64 letters, digits, '_', '-' or "
                                                                    f"'.', got {fn.get('name')!r}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise UnsupportedFieldError(f"tools[{i}].function.parameters", "must be a JSON schema object")
    return tools


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def setup_tools(request, auto_tool_choice: bool, parser_name: str | None) -> ToolSetup:
    """ToolSetup of a chat request; UnsupportedFieldError (a 400) naming the field if invalid."""
    tools = check_tools(request.tools) if request.tools else None
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools and auto_tool_choice else "none"
    if choice == "none":
        return ToolSetup(tools)
    if tools is None:
        raise UnsupportedFieldError("tool_choice", f"tool_choice {choice!r} needs tools")
    conflicting = request.structured_field()
    if choice == "auto":
        if not auto_tool_choice or parser_name is None:
            raise UnsupportedFieldError("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                                       "--tool-call-parser to be set")
        return ToolSetup(tools, TOOL_PARSERS[parser_name]())
    if conflicting is not None:
        raise UnsupportedFieldError(conflicting, f"cannot constrain the output with {conflicting} when tool_choice "
                                                 "forces a tool call")
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": _parameters(fn)},
                  "required": ["name", "parameters"]} for name, fn in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolSetup(tools, RequiredToolParser(), StructuredOutputsParams(json=schema))
    if isinstance(choice, dict) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise UnsupportedFieldError("tool_choice", f"tool_choice names function {name!r}, which is not in "
                                                       f"tools ({', '.join(functions)})")
        return ToolSetup(tools, NamedToolParser(name), StructuredOutputsParams(json=_parameters(functions[name])),
                         named=True)
    raise UnsupportedFieldError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or "
                                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                               f"got {choice!r}")


def full_message(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole output."""
    parsed = parser.parse(text, final=True)
    calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    return (parsed.content or None) if calls else parsed.content, calls


class ToolCallStream:
    """One choice's streamed message: each update turns the growth of the parse into deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = 0
        self.sent_args: list[int] = []

    def update(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        parsed: Parsed = self.parser.parse(text, final)
        content = parsed.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent_args):  # a new call: its id and name first, as OpenAI sends them
                self.sent_args.append(0)
                deltas.append(DeltaToolCall(index=i, id=tool_call_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments="")))
            new = call.arguments[self.sent_args[i]:]
            if new:
                self.sent_args[i] = len(call.arguments)
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
        return content, deltas

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_args)
