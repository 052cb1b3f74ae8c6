"""What the completion and chat handlers share: the OpenAI error body, model and length checks,
request logging, SSE framing and the merge of several request streams into one."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from pydantic import BaseModel

from tidal.engine.async_llm import AsyncLLM, EngineDeadError
from tidal.engine.llm_engine import StepError
from tidal.entrypoints.openai.event_stream import DONE_EVENT, EventSource
from tidal.entrypoints.openai.input_guard import (
    DEFAULT_MAX_LOGPROBS,
    check_request_limits,
    check_text_length,
    max_token_chars,
)
from tidal.entrypoints.openai.protocol import UsageInfo
from tidal.outputs import RequestOutput

logger = logging.getLogger("tidal.entrypoints.openai")

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered with OpenAI's JSON error body and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code if code is not None else status}}


_PARAM_RE = re.compile(r"^([a-z_]+) (?:must\b|-?\d)")  # "top_p must be ...", "stop_token_ids 99 is ..."


def bad_request(error: ValueError, default_param: str | None = None) -> APIError:
    """A ValueError from SamplingParams or prompt validation as a 400 naming the parameter."""
    message = str(error)
    param = getattr(error, "param", None)
    if param is None:
        m = _PARAM_RE.match(message)
        param = m.group(1) if m else default_param
    return APIError(400, message, param)


def engine_error(error: BaseException) -> APIError:
    if isinstance(error, EngineDeadError):
        if error.in_flight:  # the engine failed while serving this request
            return APIError(500, f"the engine failed while serving this request: {error}")
        return APIError(503, f"the engine is not running: {error}")
    if isinstance(error, StepError):  # already says what failed and that the request was aborted
        return APIError(500, str(error))
    return APIError(500, f"internal error: {error!r}")


class ServingContext:
    """The engine and the server settings every handler needs."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str, max_log_len: int | None = None,
                 log_requests: bool = True, chat_template: str | None = None, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 trust_request_chat_template: bool = False) -> None:
        self.async_llm = async_llm
        self.engine = async_llm.engine
        self.served_model_name = served_model_name
        self.max_model_len = self.engine.max_model_len
        self.tokenizer = self.engine.tokenizer
        self.max_log_len = max_log_len
        self.log_requests = log_requests
        self.chat_template = chat_template  # overrides the model's (--chat-template)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.max_logprobs = max_logprobs  # --max-logprobs
        self.trust_request_chat_template = trust_request_chat_template
        config = getattr(self.engine, "config", None)
        self.max_n = getattr(config, "max_num_seqs", 256)  # n above it could never run as one batch
        self.max_prompt_chars = None if self.tokenizer is None else \
            self.max_model_len * max_token_chars(self.tokenizer)

    def check_limits(self, request) -> None:
        """The server's limits on n and the logprobs fields (APIError 400 naming the field)."""
        check_request_limits(request, self.max_n, self.max_logprobs)

    def check_text_length(self, texts, field: str) -> None:
        """Refuse text far too long for the context before tokenizing it (APIError 400)."""
        if self.max_prompt_chars is not None:
            check_text_length(texts, self.max_prompt_chars, self.max_model_len, field)

    def check_params(self, params, constraint_field: str | None) -> None:
        """The engine's checks of a request's SamplingParams (an invalid schema, regex or grammar is
        a 400 naming the request field that carried it)."""
        try:
            self.engine.check_params(params)
        except ValueError as e:
            if getattr(e, "param", None) and constraint_field is not None:
                raise APIError(400, f"{constraint_field}: {e}", constraint_field) from e
            raise bad_request(e) from e

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"`{self.served_model_name}`.", "model", "model_not_found")

    def check_alive(self) -> None:
        if not self.async_llm.is_running:
            dead = self.async_llm.dead_error
            raise engine_error(EngineDeadError(f"the engine loop failed: {dead!r}" if dead is not None
                                               else "the server is shutting down"))

    def max_tokens_for(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "prompt") -> int:
        """The request's max_tokens, checked against the context length (None: all the room left)."""
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            if room < 1:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, your {what} has {num_prompt_tokens} tokens, which leaves no room "
                                    "for the completion. Please reduce the length of the "
                                    f"{'messages' if what == 'messages' else 'prompt'}.", what)
            return room
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                                f"({num_prompt_tokens} in the {what}, {max_tokens} in the completion). "
                                f"Please reduce the length of the {what} or completion.", "max_tokens")
        return max_tokens

    def log_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> None:
        """One INFO line per request without its content; the prompt, token ids and sampling
        params (which hold stop strings and schemas) only at DEBUG: users' text stays out of logs
        at the default level."""
        if not self.log_requests:
            return
        logger.info("Received request %s: %d prompt tokens, n %d, max_tokens %s", request_id,
                    len(prompt_token_ids), params.n, params.max_tokens)
        if not logger.isEnabledFor(logging.DEBUG):
            return
        ids = prompt_token_ids
        if self.max_log_len is not None:
            prompt = prompt[:self.max_log_len] if prompt is not None else None
            ids = ids[:self.max_log_len]
        logger.debug("Request %s: prompt: %r, params: %s, prompt_token_ids (%d): %s", request_id,
                     prompt, params, len(prompt_token_ids), ids)


def sse(data: BaseModel | dict | str) -> str:
    """One server-sent event: a model as pydantic writes its JSON (compact, in one call: half the time of
    model_dump and json.dumps for a streamed token's chunk), a dict through json.dumps, a string as it is."""
    if isinstance(data, BaseModel):
        return f"data: {data.model_dump_json()}\n\n"
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class EngineEvents(EventSource):
    """The events of a streamed request whose engine requests run through AsyncLLM.stream_to: a subclass
    queues them in begin() (with run()) and turns each delivered output into events in on_output(), counting
    num_gen. Once every request has finished, the usage chunk (with stream_options.include_usage) and [DONE]
    end the stream; an exception
    delivered or raised while writing ends it with an error event (a 400 for a refused prompt, else the
    engine's error) and [DONE], and cancels the requests still running."""
    prompt_field = "prompt"  # the request field a refused prompt's 400 names

    def __init__(self, ctx: ServingContext, request, request_id: str, num_prompt: int) -> None:
        self.ctx, self.request, self.request_id, self.num_prompt = ctx, request, request_id, num_prompt
        self.num_gen = 0  # tokens generated so far, over all the requests
        self.running: set[str] = set()  # engine request ids until their last output
        self.emit: Callable[[str], None] | None = None
        self.end: Callable[[], None] | None = None

    def begin(self) -> None:
        raise NotImplementedError

    def on_output(self, key, out: RequestOutput) -> None:
        raise NotImplementedError

    def chunk(self, choices, usage: UsageInfo | None = None) -> str:
        """The SSE event of one chunk of the response (its choices; the usage chunk: none and the usage)."""
        raise NotImplementedError

    def start(self, emit: Callable[[str], None], end: Callable[[], None]) -> None:
        self.emit, self.end = emit, end
        try:
            self.begin()
        except Exception as e:  # noqa: BLE001 - the engine stopped (or refused a prompt) since validation
            self._fail(e)

    def run(self, request_id: str, prompt: dict, params, cache_salt: str | None, key) -> None:
        """Queue one engine request; its outputs go to on_output(key, output)."""
        self.running.add(request_id)
        self.ctx.async_llm.stream_to(prompt, params, request_id, functools.partial(self._deliver, request_id, key),
                                     cache_salt)

    def cancel(self) -> None:
        for request_id in self.running:
            self.ctx.async_llm.cancel(request_id)
        self.running.clear()

    def _deliver(self, request_id: str, key, item: RequestOutput | BaseException) -> None:
        if self.emit is None:  # ended
            return
        try:
            if isinstance(item, BaseException):
                self.running.discard(request_id)  # the engine already forgot it
                self._fail(item)
                return
            self.on_output(key, item)
            if item.finished:
                self.running.discard(request_id)
                if not self.running:
                    options = self.request.stream_options
                    if options is not None and options.include_usage:
                        usage = UsageInfo(prompt_tokens=self.num_prompt, completion_tokens=self.num_gen,
                                          total_tokens=self.num_prompt + self.num_gen)
                        self.emit(self.chunk([], usage))
                    self._close()
        except Exception as e:  # noqa: BLE001 - an event that cannot be written ends this stream, not the server
            logger.exception("streaming %s failed", self.request_id)
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        self.cancel()
        body = (bad_request(error, self.prompt_field) if isinstance(error, ValueError)
                else engine_error(error)).body()
        try:
            self.emit(sse(body))
        finally:
            self._close()

    def _close(self) -> None:
        emit, end = self.emit, self.end
        self.emit = self.end = None
        try:
            emit(DONE_EVENT)
        finally:
            end()


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncGenerator[tuple[int, object], None]:
    """Yield (index of the iterator, item) as items arrive from any of them. Closing this
    generator (a client gone) closes every iterator, so their requests are aborted."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
    finally:
        for task in pending:
            task.cancel()  # the iterator's own finally aborts its request
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()
