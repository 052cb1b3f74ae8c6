"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLM.

    app = build_app(async_llm, served_model_name="SmolLM2-135M-Instruct", api_key=None, metrics=...)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health,
/version, /metrics, and the live dashboard /dashboard (tidal/entrypoints/openai/dashboard.py). Every
error is OpenAI's JSON error body; with an API key set, every route but /health and the dashboard's
page needs `Authorization: Bearer <key>` (compared in constant time, never logged). What hostile
input is refused before a handler runs (body size, non-text JSON, limits, CORS): input_guard.py.
A non-streaming request whose client
disconnects is cancelled (and its engine request aborted) like a streaming one.
watched for a disconnect even while no token comes (waiting in the queue, computing its prompt).
With `max_waiting_requests` set on the AsyncLLM, a request that finds the queue full gets 503 with
`Retry-After` instead of queueing.
"""
from __future__ import annotations

import hmac
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import tidal
from tidal.engine.async_llm import AsyncLLM
from tidal.entrypoints.openai.dashboard import add_dashboard_routes, checks_own_key
from tidal.entrypoints.openai.event_stream import EventSource, EventStream, cancel_on_disconnect
from tidal.entrypoints.openai.input_guard import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    RequestBodyLimit,
    add_cors,
    body_error_message,
)
from tidal.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tidal.entrypoints.openai.serving_base import APIError, ServingContext, bad_request, error_body
from tidal.entrypoints.openai.serving_chat import ChatHandler, message_texts, render_chat
from tidal.entrypoints.openai.serving_completion import CompletionHandler
from tidal.entrypoints.openai.tool_calls import check_tools
from tidal.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("tidal.entrypoints.openai")


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if getattr(cause, "param", None):  # a ValueError naming its field (protocol's checks)
        return APIError(400, str(cause), cause.param)
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    param = _field_path(first.get("loc", ())) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}: Tidal does not support it", param)
    return APIError(400, f"{param or 'body'}: {first.get('msg')} (got {first.get('input')!r})", param)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")  # pydantic's name of a union member


def _field_path(loc) -> str:
    """pydantic's error location as the request field: messages[0].content, not body.messages.0.content.str."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and not _UNION_TAG.match(part):
            path += f".{part}" if path else part
    return path


RETRY_AFTER_S = 1  # what an overloaded server asks clients to wait before trying again


class _RequireKey:
    """ASGI middleware: every HTTP route but /health, CORS preflights and the routes that check a key of their
    own answers 401 without `Authorization: Bearer <key>` (compared in constant time: no key-guessing by
    timing). A plain ASGI layer: the responses it lets through, streams included, pass untouched."""

    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path != "/health" and not checks_own_key(path) and scope["method"] != "OPTIONS":
                given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if not hmac.compare_digest(given, self.expected):
                    response = JSONResponse(error_body(401, "Incorrect or missing API key: send 'Authorization: "
                                                       "Bearer <key>'", None, "invalid_api_key"), status_code=401)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None, max_log_len: int | None = None,
              log_requests: bool = True, chat_template: str | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
              max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
              allowed_origins: list[str] | None = None, trust_request_chat_template: bool = False) -> FastAPI:
    ctx = ServingContext(async_llm, served_model_name, max_log_len, log_requests, chat_template,
                         enable_auto_tool_choice, tool_call_parser, max_logprobs, trust_request_chat_template)
    completions, chat = CompletionHandler(ctx), ChatHandler(ctx)
    app = FastAPI(title="Tidal OpenAI-compatible server", version=tidal.__version__)
    app.state.ctx = ctx

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, body_error_message(exc, str(exc.detail))),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("internal error")
        return JSONResponse(error_body(500, f"internal error: {exc!r}"), status_code=500)

    if max_request_body_bytes is not None:  # inside the API-key check: no body is read for a wrong key
        app.add_middleware(RequestBodyLimit, max_bytes=max_request_body_bytes)

    if api_key:
        app.add_middleware(_RequireKey, expected=f"Bearer {api_key}".encode())

    add_cors(app, allowed_origins)  # outermost: a refused key still carries the CORS headers

    async def _respond(request: Request, handler, body):
        if async_llm.is_overloaded:
            return JSONResponse(error_body(503, f"The server is overloaded: {async_llm.num_waiting} requests are "
                                                f"waiting (--max-waiting-requests {async_llm.max_waiting_requests})."
                                                f" Retry after {RETRY_AFTER_S} s.", None, "overloaded"),
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            result = await cancel_on_disconnect(request.receive, handler.create(body))
        except APIError as e:
            return _error_response(e)
        if result is None:  # client gone
            return Response(status_code=499)
        if isinstance(result, EventSource):  # stream=true: the events, sent as the engine delivers them
            return EventStream(result)
        return JSONResponse(result)

    @app.get("/health")
    async def health():
        if not async_llm.is_running:
            why = "the server is shutting down" if async_llm.dead_error is None else repr(async_llm.dead_error)
            return JSONResponse(error_body(503, f"the engine is not running: {why}"), status_code=503)
        check = getattr(async_llm.engine, "check_health", None)
        try:
            if check is not None:
                check()  # a dead worker process (tensor/pipeline parallel) shows at once, even when idle
        except Exception as e:  # noqa: BLE001 - any failure is unhealthy
            return JSONResponse(error_body(503, f"the engine is unhealthy: {e}"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": tidal.__version__}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=served_model_name, root=async_llm.engine.model_name,
                                         max_model_len=ctx.max_model_len)]).model_dump()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await _respond(request, completions, body)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await _respond(request, chat, body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "prompt")
        if body.messages is not None:
            ctx.check_text_length(message_texts(body.messages), "messages")
        else:
            ctx.check_text_length([body.prompt], "prompt")
        try:
            if body.messages is not None:
                _, ids = render_chat(ctx.tokenizer, body.messages, body.add_generation_prompt,
                                     body.continue_final_message, ctx.chat_template, body.chat_template_kwargs,
                                     check_tools(body.tools) if body.tools else None)
            else:
                ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ValueError as e:
            raise bad_request(e, "messages" if body.messages is not None else "prompt") from e
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        vocab = async_llm.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics_page():
        if metrics is None:
            raise APIError(404, "metrics are disabled")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    add_dashboard_routes(app, async_llm, metrics, api_key)
    return app

