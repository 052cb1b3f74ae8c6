"""Server-sent events written as the engine delivers them.

A streamed request's outputs reach the server's event loop in one callback per engine step (AsyncLLM's
delivery). An `EventSource` (a streamed completion or chat completion) turns each output into its events right
there, and `EventStream`, the response, hands each event to the ASGI `send` at once, run eagerly: a send
that completes without waiting (the connection's buffer has room: the usual case) costs no task and no
wake-up. One that would wait is finished by a writer task, and the events that come meanwhile queue behind
it, in order. Streaming through an async generator instead (Starlette's StreamingResponse) wakes a task and
its generators for every event: at 64 streams of a saturated 2-core CPU that was a third of the API
server's CPU time, taken from the engine's cores (docs/cpu.md, the twentieth round). A send run outside
any task needs middleware that passes sends through (plain ASGI middleware, as Tidal's); an app with
Starlette's BaseHTTPMiddleware, which hands each send to another task, gets every event sent by a writer
task instead, in order.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine

from fastapi.responses import Response
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"


async def _until_disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(receive: Receive, coro):
    """Run coro; if the client goes away first, cancel it (which aborts its engine requests) and return None."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnected(receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    finally:
        watch.cancel()


class EventSource:
    """What an EventStream sends: start() queues the engine requests and calls emit(event) for each SSE
    event (text, "data: ...\\n\\n") as outputs are delivered, then end() once, after its last event; cancel()
    stops whatever is still running (the client went away)."""

    def start(self, emit: Callable[[str], None], end: Callable[[], None]) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError


class _Resumed:
    """Awaits the rest of a coroutine that ran outside a task until it had to wait (coro.send(None) gave
    waits_on, the future it waits for), as a task would have run it."""
    __slots__ = ("coro", "waits_on")

    def __init__(self, coro: Coroutine, waits_on) -> None:
        self.coro, self.waits_on = coro, waits_on

    def __await__(self):
        coro, waits_on = self.coro, self.waits_on
        while True:
            try:
                yield waits_on
            except BaseException as e:  # noqa: BLE001 - (a cancellation) passed on to the coroutine
                try:
                    waits_on = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                waits_on = coro.send(None)
            except StopIteration as stop:
                return stop.value


class _EagerSender:
    """Body chunks through an ASGI send, each started at once (see the module's docstring), or, when not
    eager, each handed to a writer task. After a failed send (the client went away) the rest are dropped and
    on_error(error) is called once."""

    def __init__(self, send: Send, on_error: Callable[[BaseException], None], eager: bool = True) -> None:
        self._send, self._on_error, self.eager = send, on_error, eager
        self._behind: deque[bytes] = deque()  # chunks waiting for the writer task's send
        self._writer: asyncio.Task | None = None
        self.error: BaseException | None = None

    def send(self, data: bytes) -> None:
        if self.error is not None:
            return
        if self._writer is not None or not self.eager:
            self._behind.append(data)
            if self._writer is None:
                self._writer = asyncio.ensure_future(self._finish(None, None))
            return
        coro = self._send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            waits_on = coro.send(None)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - the client went away (OSError) or the server is stopping
            self._failed(e)
            return
        self._writer = asyncio.ensure_future(self._finish(coro, waits_on))

    async def _finish(self, coro: Coroutine | None, waits_on) -> None:
        try:
            if coro is not None:
                await _Resumed(coro, waits_on)
            while self._behind and self.error is None:
                await self._send({"type": "http.response.body", "body": self._behind.popleft(), "more_body": True})
        except Exception as e:  # noqa: BLE001 - as in send()
            self._failed(e)
        finally:
            self._writer = None

    def _failed(self, error: BaseException) -> None:
        if not isinstance(error, OSError):  # not the client going away: say why the stream stopped
            logger.error("streaming a response failed: %r", error)
        self.error = error
        self._behind.clear()
        self._on_error(error)

    async def flush(self) -> None:
        """Return once every chunk given so far is sent (or sending failed)."""
        while self._writer is not None:
            await self._writer


def _passes_sends_through(app) -> bool:
    """Whether the app's middleware lets a send run outside a task: none of it is a BaseHTTPMiddleware."""
    return not any(isinstance(m.cls, type) and issubclass(m.cls, BaseHTTPMiddleware)
                   for m in getattr(app, "user_middleware", ()))


class EventStream(Response):
    """A text/event-stream response of an EventSource's events (see the module's docstring). The client
    going away, or a send failing, cancels the source: its engine requests are aborted at once."""
    media_type = "text/event-stream"

    def __init__(self, source: EventSource) -> None:
        self.source = source
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = asyncio.get_running_loop().create_future()

        def end() -> None:
            if not ended.done():
                ended.set_result(None)

        def stop(_error: BaseException) -> None:
            self.source.cancel()
            end()
        sender = _EagerSender(send, stop, eager=_passes_sends_through(scope.get("app")))

        async def run() -> bool:
            self.source.start(lambda event: sender.send(event.encode()), end)
            await ended
            await sender.flush()
            return sender.error is None

        try:
            complete = await cancel_on_disconnect(receive, run())
        finally:
            self.source.cancel()  # whatever still runs: the client is gone, or this response failed
        if complete:
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away after the last event
                pass
