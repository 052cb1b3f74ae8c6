"""The streamed completion's events (serving_completion._CompletionEvents) and the response that sends them
(event_stream.EventStream): chunks written from a template are the bytes pydantic writes, each output's
events go out from the delivery callback itself, a send that has to wait keeps the events' order, and a
client gone or a failed request ends the stream with its requests cancelled. Fast: no model, no server."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.engine.async_llm import EngineDeadError
from tidal.entrypoints.openai.event_stream import DONE_EVENT, EventSource, EventStream, _EagerSender
from tidal.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from tidal.entrypoints.openai.serving_base import sse
from tidal.entrypoints.openai.serving_chat import _ChatEvents
from tidal.entrypoints.openai.serving_completion import CompletionHandler, _CompletionEvents
from tidal.entrypoints.openai.tool_calls import ToolSetup
from tidal.outputs import CompletionOutput, RequestOutput


class FakeLLM:
    """stream_to / cancel as AsyncLLM's: the deliver callbacks kept, to be called by the test."""

    def __init__(self):
        self.delivers, self.cancelled = {}, []

    def stream_to(self, prompt, params, request_id, deliver, cache_salt=None):
        self.delivers[request_id] = deliver

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def _events(llm: FakeLLM, **request) -> tuple[_CompletionEvents, list[str], list[bool]]:
    ctx = SimpleNamespace(async_llm=llm, served_model_name="tiny-model", tokenizer=None,
                          log_request=lambda *args: None)
    body = CompletionRequest(model="tiny-model", stream=True, **request)
    prompts = [(None, [1, 2, 3])] * (len(body.prompt) if isinstance(body.prompt, list) and
                                     isinstance(body.prompt[0], str) else 1)
    source = _CompletionEvents(CompletionHandler(ctx), body, "cmpl-abc", prompts, [None] * len(prompts))
    emitted, ended = [], []
    source.start(emitted.append, lambda: ended.append(True))
    return source, emitted, ended


def _output(rid: str, text: str, n_tokens: int = 1, finish: str | None = None, stop=None, index: int = 0):
    return RequestOutput(rid, None, [], None, [CompletionOutput(index, text, list(range(n_tokens)), None, None,
                                                                finish, stop)], finish is not None)


@settings(max_examples=200, deadline=None)
@given(text=st.text(), finish=st.sampled_from([None, "stop", "length", "abort"]),
       stop=st.one_of(st.none(), st.integers(0, 50000), st.text(max_size=8)))
def test_plain_chunk_is_the_bytes_pydantic_writes(text, finish, stop):
    llm = FakeLLM()
    source, emitted, _ = _events(llm, prompt="hi")
    llm.delivers["cmpl-abc-0"](_output("cmpl-abc-0", text, finish=None))
    llm.delivers["cmpl-abc-0"](_output("cmpl-abc-0", text, finish=finish or "length", stop=stop))
    for event, reason, why in zip(emitted, [None, finish or "length"], [None, stop]):
        choice = CompletionChoice(index=0, text=text, finish_reason=reason, stop_reason=why)
        model = CompletionResponse(id="cmpl-abc", created=source.created, model="tiny-model", choices=[choice])
        assert event == sse(model)


def test_events_go_out_from_the_delivery_and_end_with_usage_and_done():
    llm = FakeLLM()
    _, emitted, ended = _events(llm, prompt=["a", "b"], stream_options={"include_usage": True})
    assert set(llm.delivers) == {"cmpl-abc-0", "cmpl-abc-1"}
    llm.delivers["cmpl-abc-1"](_output("cmpl-abc-1", "x", 2))
    assert len(emitted) == 1 and json.loads(emitted[0][6:])["choices"][0]["index"] == 1  # at once, no await
    llm.delivers["cmpl-abc-0"](_output("cmpl-abc-0", "y", 1, finish="stop"))
    assert not ended  # the second prompt still runs
    llm.delivers["cmpl-abc-1"](_output("cmpl-abc-1", "z", 1, finish="length"))
    assert ended == [True] and emitted[-1] == DONE_EVENT
    usage = json.loads(emitted[-2][6:])["usage"]
    assert usage == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    assert llm.cancelled == []


def test_logprobs_chunks_still_carry_their_logprobs():
    llm = FakeLLM()
    source, emitted, _ = _events(llm, prompt="hi", logprobs=0, echo=True)
    assert not source.plain
    out = _output("cmpl-abc-0", "x", 1, finish="stop")
    out.outputs[0].logprobs = [{0: SimpleNamespace(logprob=-0.5, decoded_token="x")}]
    source.handler._echo_text = lambda prompt: "hi"
    llm.delivers["cmpl-abc-0"](out)
    choice = json.loads(emitted[0][6:])["choices"][0]
    assert choice["text"] == "hix" and choice["logprobs"]["token_logprobs"] == [-0.5]


def test_a_failed_request_ends_the_stream_with_an_error_and_cancels_the_others():
    llm = FakeLLM()
    _, emitted, ended = _events(llm, prompt=["a", "b"])
    llm.delivers["cmpl-abc-0"](RuntimeError("the model broke"))
    assert ended == [True] and emitted[-1] == DONE_EVENT
    error = json.loads(emitted[-2][6:])["error"]
    assert error["code"] == 500 and "the model broke" in error["message"]
    assert llm.cancelled == ["cmpl-abc-1"]
    llm.delivers["cmpl-abc-1"](_output("cmpl-abc-1", "late", 1))  # ignored: the stream has ended
    assert emitted[-1] == DONE_EVENT


def test_a_refused_prompt_is_a_400_event():
    llm = FakeLLM()
    _, emitted, _ = _events(llm, prompt="hi")
    llm.delivers["cmpl-abc-0"](ValueError("prompt is too long: 5000 tokens, max_model_len 2048"))
    assert json.loads(emitted[-2][6:])["error"]["code"] == 400


class SlowSend:
    """An ASGI send whose every third body send waits for the loop (a full socket buffer)."""

    def __init__(self):
        self.bodies, self.calls = [], 0

    async def __call__(self, message):
        self.calls += 1
        if self.calls % 3 == 0:
            await asyncio.sleep(0.001)
        self.bodies.append(message["body"])


def test_a_send_that_waits_keeps_the_order():
    async def run():
        send = SlowSend()
        errors = []
        sender = _EagerSender(send, errors.append)
        for i in range(50):
            sender.send(b"%d" % i)
            if i % 7 == 0:
                await asyncio.sleep(0)
        await sender.flush()
        return send.bodies, errors
    bodies, errors = asyncio.run(run())
    assert bodies == [b"%d" % i for i in range(50)] and errors == []


def test_a_send_that_fails_stops_the_rest():
    async def run():
        sent, errors = [], []

        async def send(message):
            if len(sent) == 2:
                raise ConnectionResetError("client gone")
            sent.append(message["body"])
        sender = _EagerSender(send, errors.append)
        for i in range(5):
            sender.send(b"%d" % i)
        await sender.flush()
        return sent, errors
    sent, errors = asyncio.run(run())
    assert sent == [b"0", b"1"] and len(errors) == 1 and isinstance(errors[0], ConnectionResetError)


class TwoEvents(EventSource):
    """Two events and [DONE], each from a loop callback of its own (as steps deliver them)."""

    def __init__(self):
        self.cancelled = 0

    def start(self, emit, end):
        self.emit, self.end = emit, end
        asyncio.get_running_loop().call_soon(self._step, 0)

    def _step(self, i):
        if i == 2:
            self.emit(DONE_EVENT)
            self.end()
            return
        self.emit(f"data: {i}\n\n")
        asyncio.get_running_loop().call_soon(self._step, i + 1)

    def cancel(self):
        self.cancelled += 1


def test_event_stream_sends_the_events_then_ends_the_body():
    async def run():
        messages = []

        async def send(message):
            messages.append(message)

        async def receive():
            await asyncio.sleep(10)
        source = TwoEvents()
        await EventStream(source)({"type": "http"}, receive, send)
        return messages, source
    messages, source = asyncio.run(run())
    assert messages[0]["type"] == "http.response.start"
    assert dict(messages[0]["headers"])[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert [m["body"] for m in messages[1:]] == [b"data: 0\n\n", b"data: 1\n\n", DONE_EVENT.encode(), b""]
    assert messages[-1]["more_body"] is False


def test_event_stream_cancels_its_source_when_the_client_goes_away():
    async def run():
        messages = []

        async def send(message):
            messages.append(message)

        async def receive():
            return {"type": "http.disconnect"}

        class Endless(EventSource):
            cancelled = 0

            def start(self, emit, end):
                pass

            def cancel(self):
                Endless.cancelled += 1
        await EventStream(Endless())({"type": "http"}, receive, send)
        return messages, Endless.cancelled
    messages, cancelled = asyncio.run(run())
    assert cancelled >= 1 and [m["type"] for m in messages] == ["http.response.start"]


def _chat(llm: FakeLLM, **request):
    ctx = SimpleNamespace(async_llm=llm, served_model_name="tiny-model", tokenizer=None)
    body = ChatCompletionRequest(model="tiny-model", messages=[{"role": "user", "content": "hi"}], stream=True,
                                 **request)
    source = _ChatEvents(ctx, body, "chatcmpl-abc", ToolSetup(), ("hi", [1, 2]), None)
    emitted, ended = [], []
    source.start(emitted.append, lambda: ended.append(True))
    return emitted, ended


def test_chat_events_send_the_role_then_each_delta_then_usage():
    llm = FakeLLM()
    emitted, ended = _chat(llm, n=2, stream_options={"include_usage": True})
    assert [json.loads(e[6:])["choices"][0]["delta"]["role"] for e in emitted] == ["assistant", "assistant"]
    deliver = llm.delivers["chatcmpl-abc"]
    out = _output("chatcmpl-abc", "Hel", 1)
    out.outputs.append(CompletionOutput(1, "Yo", [5], None, None))
    deliver(out)
    first_done = _output("chatcmpl-abc", "lo", 1, finish="stop", index=0)
    first_done.finished = False  # sample 1 still runs
    deliver(first_done)
    assert not ended
    last = _output("chatcmpl-abc", "!", 1, finish="length", index=1)
    deliver(last)
    chunks = [json.loads(e[6:]) for e in emitted[2:-1]]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]["content"]) for c in chunks[:-1]] == [
        (0, "Hel"), (1, "Yo"), (0, "lo"), (1, "!")]
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert emitted[-1] == DONE_EVENT and ended == [True]


def test_chat_events_end_with_the_engine_error():
    llm = FakeLLM()
    emitted, ended = _chat(llm)
    llm.delivers["chatcmpl-abc"](EngineDeadError("the engine core process exited", in_flight=True))
    error = json.loads(emitted[-2][6:])["error"]
    assert error["code"] == 500 and "exited" in error["message"] and ended == [True]


def _app_streaming_two_events(with_base_http_middleware: bool):
    from fastapi import FastAPI

    app = FastAPI()
    if with_base_http_middleware:
        @app.middleware("http")
        async def passthrough(request, call_next):  # hands every send to another task
            return await call_next(request)

    @app.get("/events")
    async def events():
        return EventStream(TwoEvents())
    return app


def _get_under_uvicorn(app) -> bytes:
    """GET /events from app served by uvicorn on a thread (a real server: its sends run as in production)."""
    import socket
    import threading
    import time
    import urllib.request

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/events", timeout=10).read()
    finally:
        server.should_exit = True
        thread.join(10)


def test_events_reach_the_client_with_or_without_a_base_http_middleware():
    # BaseHTTPMiddleware hands each send to another task (anyio): a send run outside a task fails there, so
    # such an app's events go through the writer task
    for wrapped in (False, True):
        body = _get_under_uvicorn(_app_streaming_two_events(wrapped))
        assert body == ("data: 0\n\ndata: 1\n\n" + DONE_EVENT).encode(), wrapped


def test_a_sender_that_is_not_eager_keeps_the_order():
    async def run():
        send = SlowSend()
        sender = _EagerSender(send, lambda error: None, eager=False)
        for i in range(20):
            sender.send(b"%d" % i)
        assert send.bodies == []  # nothing sent outside the writer task
        await sender.flush()
        return send.bodies
    assert asyncio.run(run()) == [b"%d" % i for i in range(20)]
