"""What the server refuses before a handler runs, and the server's own limits on a request.

- A body over `--max-request-body-bytes` is answered 413 as soon as its Content-Length says so,
  or as soon as that many bytes have arrived: it is never read whole.
- JSON that is not text: a string holding a lone UTF-16 surrogate (`"\\ud800"` is legal JSON, but
  no tokenizer, hash or log can encode it) and values nested deeper than MAX_JSON_DEPTH are a 400
  naming the field (`find_bad_json`, run by every request model in protocol.py).
- `n` (times the number of prompts of a completions batch) above `--max-num-seqs` (all of a
  request's samples must fit in one batch) and
  `logprobs` / `top_logprobs` / `prompt_logprobs` above `--max-logprobs` (vLLM's name, default 20)
  are a 400 naming the field (`check_request_limits`).
- Cross-origin requests are refused by browsers unless `--allowed-origins` names the origin
  (`add_cors`; no CORS headers at all without the flag).

The value checks of the sampling fields themselves (types, ranges, finite numbers) are
SamplingParams'; this module holds only what depends on the server's flags or on the raw JSON.
"""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20  # a full 128k-token prompt as JSON token ids is ~1 MB
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default; SamplingParams computes at most 20 per token
MAX_JSON_DEPTH = 64  # deeper than any chat request or JSON schema a client sends on purpose


class RequestBodyLimit:
    """ASGI middleware: read at most max_bytes of a request body, then hand the buffered body to
    the app (later receive() calls, e.g. to watch for a disconnect, go to the client as before).
    A larger body is answered 413 with OpenAI's error body and the rest of it is never read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send, f"Content-Length: {length.decode('latin-1')[:40]}")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send, f"got more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, got: str) -> None:
        from tidal.entrypoints.openai.serving_base import error_body
        message = f"the request body is larger than the server's limit of {self.max_bytes} bytes " \
                  f"(--max-request-body-bytes); {got}"
        content = json.dumps(error_body(413, message, None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})


def find_bad_json(data, max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """(field path, why) of the first string that is not valid Unicode text (a lone surrogate) or
    the first value nested deeper than max_depth in a parsed JSON body; None if all is well."""
    stack = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    return path or "body", (f"holds a lone UTF-16 surrogate ({value[e.start]!r} at character "
                                            f"{e.start}): strings must be valid Unicode text")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= max_depth:  # named by its top-level field: the full path would be max_depth long
            return path.split(".")[0].split("[")[0] or "body", f"is nested more than {max_depth} levels deep"
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    stack.append((key, path or "body", depth + 1))  # a bad key names its object
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        else:
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
    return None


def body_error_message(exc: BaseException, detail: str) -> str:
    """What is wrong with a body that could not be parsed (FastAPI says only "There was an error
    parsing the body" and keeps the cause)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        bad = cause.object[cause.start:cause.start + 1]
        return f"the body is not valid UTF-8 (byte {bad!r} at offset {cause.start})"
    if isinstance(cause, RecursionError):
        return f"the body's JSON is nested too deep (at most {MAX_JSON_DEPTH} levels)"
    return detail


def max_token_chars(tokenizer) -> int:
    """The most characters one token of this vocabulary stands for (its longest token string: a
    byte-level token's string has one character per byte, and a byte holds at most one character)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def check_text_length(texts, max_chars: int, max_model_len: int, field: str) -> None:
    """Refuse text that cannot fit in max_model_len tokens, by its length alone: tokenizing (or
    rendering a chat of) megabytes blocks the server's event loop for seconds."""
    from tidal.entrypoints.openai.serving_base import APIError
    num_chars = sum(len(t) for t in texts if isinstance(t, str))
    if num_chars > max_chars:
        raise APIError(400, f"{field} has {num_chars} characters: more than max_model_len ({max_model_len}) "
                            f"tokens can hold ({max_chars} characters)", field)


def check_request_limits(request, max_n: int, max_logprobs: int) -> None:
    """The server's limits on a completion or chat request; APIError 400 naming the field."""
    from tidal.entrypoints.openai.serving_base import APIError
    if isinstance(request.n, int) and request.n > max_n:
        raise APIError(400, f"n must be at most {max_n} (--max-num-seqs: all the samples of a request run in "
                            f"one batch), got {request.n}", "n")
    prompt = getattr(request, "prompt", None)  # completions: a batch of prompts is n samples of each
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    if num_prompts * request.n > max_n:
        raise APIError(400, f"{num_prompts} prompts with n = {request.n} make {num_prompts * request.n} sequences, "
                            f"more than {max_n} (--max-num-seqs) in one request: split the batch", "prompt")
    for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(request, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_logprobs:
            raise APIError(400, f"{field} must be at most {max_logprobs} (--max-logprobs), got {value}", field)


def add_cors(app, allowed_origins: list[str] | None) -> None:
    """Answer CORS preflights and add CORS headers for these origins only (none: no CORS at all,
    so browsers refuse cross-origin calls). Add it last: it must wrap the API-key check too."""
    if not allowed_origins:
        return
    from starlette.middleware.cors import CORSMiddleware
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["Authorization", "Content-Type"])


def parse_allowed_origins(value: str) -> list[str]:
    """--allowed-origins: a JSON list (vLLM's form) or comma-separated origins."""
    value = value.strip()
    if value.startswith("["):
        origins = json.loads(value)
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError("--allowed-origins: a JSON list of strings, or origins separated by commas")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]
