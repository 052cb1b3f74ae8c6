"""POST /v1/chat/completions: messages (and tools) through the model's chat template, then one engine
request with n samples. Streams as chat.completion.chunk events: the role first, then content and
tool-call deltas, then the finish reason, then (with stream_options.include_usage) a usage chunk.
Tool calling: tidal/entrypoints/openai/tool_calls.py."""
from __future__ import annotations

import json
import time

from tidal.engine.async_llm import EngineDeadError
from tidal.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UnsupportedFieldError,
    UsageInfo,
    random_id,
)
from tidal.entrypoints.openai.serving_base import (
    APIError,
    EngineEvents,
    ServingContext,
    bad_request,
    engine_error,
    merge_async_iterators,
    sse,
)
from tidal.entrypoints.openai.serving_completion import _prompt_logprobs_json
from tidal.entrypoints.openai.tool_calls import ToolCallStream, ToolSetup, full_message, setup_tools
from tidal.outputs import RequestOutput

_ROLES = ("system", "developer", "user", "assistant", "tool")


def _template_tool_calls(calls: list[dict], i: int) -> list[dict]:
    """An assistant turn's tool calls for the template, arguments as objects (what tool templates
    expect; a string that is not JSON stays a string)."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise UnsupportedFieldError(f"messages[{i}].tool_calls[{j}]", "must be {\"id\", \"type\": "
                                        "\"function\", \"function\": {\"name\", \"arguments\"}}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def normalize_messages(messages: list[ChatMessage]) -> list[dict]:
    """Plain {"role", "content"} dicts for the chat template; text parts are joined by newlines."""
    conversation = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise UnsupportedFieldError(f"messages[{i}].role", f"role {m.role!r} is not supported "
                                        f"(supported: {', '.join(_ROLES)})")
        extra = set(m.model_extra or {}) - {"name"}
        if extra:
            raise UnsupportedFieldError(f"messages[{i}]", f"message field(s) {sorted(extra)} are not supported")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UnsupportedFieldError(f"messages[{i}].content[{j}]",
                                                f"content part type {part.get('type')!r} is not supported "
                                                "(only 'text')")
                texts.append(part["text"])
            content = "\n".join(texts)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.model_extra and "name" in m.model_extra:
            msg["name"] = m.model_extra["name"]
        if m.tool_calls:
            msg["tool_calls"] = _template_tool_calls(m.tool_calls, i)
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        conversation.append(msg)
    if not conversation:
        raise UnsupportedFieldError("messages", "messages must not be empty")
    return conversation


def message_texts(messages: list[ChatMessage]) -> list[str]:
    """The text of every message (content strings and text parts), to bound before rendering."""
    texts = []
    for m in messages:
        if isinstance(m.content, str):
            texts.append(m.content)
        elif isinstance(m.content, list):
            texts += [part.get("text") for part in m.content if isinstance(part.get("text"), str)]
    return texts


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """The prompt text and token ids of a conversation under the model's chat template."""
    if tokenizer is None or (chat_template is None and not getattr(tokenizer, "chat_template", None)):
        raise UnsupportedFieldError("messages", "this model has no chat template: use /v1/completions")
    conversation = normalize_messages(messages)
    if continue_final_message and add_generation_prompt:
        add_generation_prompt = False
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         chat_template=chat_template, tools=tools, **(chat_template_kwargs or {}))
    # The template already holds any BOS token: do not add special tokens again.
    return text, tokenizer.encode(text, add_special_tokens=False)


def _chat_logprobs(token_ids, entries, top_n: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        top = sorted(((v.rank, k, v) for k, v in entry.items() if v.rank is not None and v.rank <= top_n),
                     key=lambda t: t[0])
        content.append(TokenLogprob(
            token=_token_str(chosen, token_id), logprob=max(chosen.logprob, -9999.0),
            bytes=list(_token_str(chosen, token_id).encode()),
            top_logprobs=[TopLogprob(token=_token_str(v, k), logprob=max(v.logprob, -9999.0),
                                     bytes=list(_token_str(v, k).encode())) for _, k, v in top[:top_n]]))
    return ChatLogprobs(content=content)


def _token_str(logprob, token_id: int) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else str(token_id)


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: ChatCompletionRequest):
        ctx = self.ctx
        ctx.check_alive()
        ctx.check_model(request.model)
        ctx.check_limits(request)
        ctx.check_text_length(message_texts(request.messages), "messages")
        if request.chat_template is not None and not ctx.trust_request_chat_template:
            # A template is a program: nested loops within the sandbox's limits still run for hours.
            raise APIError(400, "chat_template in a request runs the client's Jinja code on the server: refused "
                                "unless the server runs with --trust-request-chat-template", "chat_template")
        try:
            request.check_unsupported()
            tools = setup_tools(request, ctx.enable_auto_tool_choice, ctx.tool_call_parser)
            structured = tools.constraint or request.structured_outputs_params()
            text, ids = render_chat(ctx.tokenizer, request.messages, request.add_generation_prompt,
                                    request.continue_final_message, request.chat_template or ctx.chat_template,
                                    request.chat_template_kwargs, tools.tools)
            ctx.async_llm.process_prompt({"prompt": text, "prompt_token_ids": ids})
        except ValueError as e:
            raise bad_request(e, "messages") from e
        except Exception as e:  # a template that fails to render on these messages
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        max_tokens = ctx.max_tokens_for(len(ids), max_tokens, "messages")
        top_n = request.top_logprobs or 0
        if request.logprobs and top_n < 0:
            raise APIError(400, f"top_logprobs must be an integer >= 0, got {top_n}", "top_logprobs")
        try:
            params = request.sampling_params(max_tokens, top_n if request.logprobs else None,
                                             request.prompt_logprobs, structured)
        except ValueError as e:
            raise bad_request(e) from e
        ctx.check_params(params, "tools" if tools.constraint else request.structured_field())
        request_id = random_id("chatcmpl")
        ctx.log_request(request_id, text, ids, params)
        if request.stream:
            return _ChatEvents(ctx, request, request_id, tools, (text, ids), params)
        stream = merge_async_iterators(ctx.async_llm.generate({"prompt": text, "prompt_token_ids": ids}, params,
                                                              request_id, request.cache_salt))
        return await self._full(request, request_id, tools, len(ids), stream)

    async def _full(self, request, request_id: str, tools: ToolSetup, num_prompt: int, stream) -> dict:
        n = request.n
        texts = [request.messages[-1].content if request.echo and isinstance(request.messages[-1].content, str)
                 else "" for _ in range(n)]
        contents: list[list] = [[] for _ in range(n)]
        finish, stop_reasons = [None] * n, [None] * n
        num_gen = 0
        prompt_logprobs = None
        try:
            async for _, out in stream:
                if out.prompt_logprobs is not None and prompt_logprobs is None:
                    prompt_logprobs = _prompt_logprobs_json(out.prompt_logprobs)
                for o in out.outputs:
                    texts[o.index] += o.text
                    num_gen += len(o.token_ids)
                    if request.logprobs and o.logprobs is not None:
                        contents[o.index] += _chat_logprobs(o.token_ids, o.logprobs, request.top_logprobs or 0).content
                    if o.finish_reason is not None:
                        finish[o.index], stop_reasons[o.index] = o.finish_reason, o.stop_reason
        except (EngineDeadError, RuntimeError) as e:
            raise engine_error(e) from e
        choices = []
        for i in range(n):
            message = ChatResponseMessage(content=texts[i])
            if tools.parser is not None:
                message.content, message.tool_calls = full_message(tools.parser, texts[i])
                if message.tool_calls and not tools.named and finish[i] == "stop":
                    finish[i] = "tool_calls"
            choices.append(ChatChoice(index=i, message=message,
                                      logprobs=ChatLogprobs(content=contents[i]) if request.logprobs else None,
                                      finish_reason=finish[i], stop_reason=stop_reasons[i]))
        return ChatCompletionResponse(id=request_id, model=self.ctx.served_model_name, choices=choices,
                                      usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                                      total_tokens=num_prompt + num_gen),
                                      prompt_logprobs=prompt_logprobs).model_dump()


class _ChatEvents(EngineEvents):
    """A streamed chat completion's events: the role first (as OpenAI sends it, so that clients can open the
    message before any text), then each output's delta as the step delivers it (an EventStream's source)."""
    prompt_field = "messages"

    def __init__(self, ctx: ServingContext, request, request_id: str, tools: ToolSetup, prompt, params) -> None:
        super().__init__(ctx, request, request_id, len(prompt[1]))
        self.tools, self.prompt, self.params = tools, prompt, params
        self.created = int(time.time())
        self.texts = [""] * request.n
        self.calls = [ToolCallStream(tools.parser) for _ in range(request.n)] if tools.parser is not None else None

    def chunk(self, choices, usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.request_id, created=self.created, model=self.ctx.served_model_name,
                                       choices=choices, usage=usage))

    def begin(self) -> None:
        request = self.request
        first = request.messages[-1].content if request.echo and isinstance(request.messages[-1].content, str) \
            else ""
        for i in range(request.n):
            self.emit(self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=first))]))
        text, ids = self.prompt
        self.run(self.request_id, {"prompt": text, "prompt_token_ids": ids}, self.params, request.cache_salt, None)

    def on_output(self, _key, out: RequestOutput) -> None:
        request, calls = self.request, self.calls
        for o in out.outputs:
            self.num_gen += len(o.token_ids)
            lp = _chat_logprobs(o.token_ids, o.logprobs, request.top_logprobs or 0) \
                if request.logprobs and o.logprobs is not None else None
            if not o.text and not o.token_ids and o.finish_reason is None:
                continue
            delta, finish = DeltaMessage(content=o.text), o.finish_reason
            if calls is not None:
                self.texts[o.index] += o.text
                content, deltas = calls[o.index].update(self.texts[o.index], o.finish_reason is not None)
                delta = DeltaMessage(content=content or None, tool_calls=deltas or None)
                if calls[o.index].has_calls and not self.tools.named and finish == "stop":
                    finish = "tool_calls"
            self.emit(self.chunk([ChatStreamChoice(index=o.index, delta=delta, logprobs=lp, finish_reason=finish,
                                                    stop_reason=o.stop_reason)]))
