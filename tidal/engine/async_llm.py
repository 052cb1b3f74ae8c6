"""AsyncLLM: the asyncio front of the engine, for the server.

One dedicated thread owns the LLMEngine and runs its loop for every request at once:

    while alive:
        apply queued commands (add / abort)        # only this thread touches the engine
        outputs = engine.step()                    # schedule -> execute -> update
        hand each output to its request's asyncio queue (call_soon_threadsafe)

The step runs off the event loop, so HTTP handling stays responsive while the model computes.
Each request gets its own stream of delta RequestOutputs:

    >>> async for out in async_llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
    ...     print(out.outputs[0].text, end="")

Leaving the `async for` early (a client that disconnected, a cancelled task) aborts the request;
the engine thread applies the abort before its next step, so the request's blocks are free
within one step.

Faults: if the model fails inside a step (LLMEngine raises StepError), only that step's requests fail
(with the StepError) and the loop goes on; any other failure, a dead worker (looked for every
`idle_wait_s` while idle too), or `MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row mark the engine
dead: every open stream and every later call raises EngineDeadError instead of hanging, and
`on_dead(error)` runs (the server stops then, for a supervisor to restart it). `drain(timeout_s)`
refuses new requests, lets the running ones finish for up to `timeout_s` seconds and then aborts the rest
with EngineDeadError (graceful shutdown). `max_waiting_requests` bounds the queue: `is_overloaded` says
when it is full, for the server to answer 503 instead of queueing.

Test hook: TIDAL_INJECT_FAULT=execute:N makes the N-th model execution raise (a step fault the engine
survives), TIDAL_INJECT_FAULT=update:N the N-th scheduler update (state half updated: the engine dies).
Read once at start; unset, it costs nothing.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import torch

from tidal.config import EngineConfig
from tidal.engine.llm_engine import LLMEngine, PromptType, StepError
from tidal.outputs import RequestOutput
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3  # a model that fails every step (e.g. a broken device) is dead, not flaky


class EngineDeadError(RuntimeError):
    """The engine loop failed (or is shutting down); no request can be served any more. `in_flight`: raised to
    a request the engine was serving when it failed (for the server, a 500 rather than a 503)."""

    def __init__(self, message: str, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


@dataclass
class _Stream:
    """Where the engine thread delivers one request's outputs (or its error): `deliver(item)`, called on the
    consumer's event loop; and the request's prompt (text, token ids) as the caller sent it: an engine core in
    another process sends its outputs without it."""
    loop: asyncio.AbstractEventLoop
    deliver: Callable[[RequestOutput | BaseException], None]
    prompt: tuple[str | None, list[int]]

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(_put_all, [(self.deliver, item)])
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass


def _deliver(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Hand a step's outputs to their streams with one wake-up of each consumer loop (a step of 64 requests
    wakes a server's event loop once, not 64 times), each stream's items in their order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable, object]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.deliver, item))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass


def _put_all(pairs: list[tuple[Callable, object]]) -> None:
    for deliver, item in pairs:
        try:
            deliver(item)
        except Exception:  # noqa: BLE001 - one consumer's failure must not keep the step's outputs from the others
            logger.exception("a request's stream failed on its output")


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error) -> None:
    def settle():
        if future.done():  # the caller stopped waiting (timed out, cancelled)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's event loop is closed
        pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine, step_hook=None, max_waiting_requests: int | None = None,
                 _start: bool = True) -> None:
        """Wrap an engine and start its loop thread. `step_hook` runs on the engine thread
        after every step and every batch of commands (metrics; the engine is consistent there), with
        the step's outputs: `step_hook(engine, outputs)`. `max_waiting_requests` (None: unbounded) is
        the most requests that may wait for admission before `is_overloaded`."""
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 (or None: unbounded), got {max_waiting_requests}")
        self.engine = engine
        self.step_hook = step_hook
        self.max_waiting_requests = max_waiting_requests
        self.on_dead = None  # called (engine thread) with the error when the engine dies
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # adds sent (event loop) and applied (engine thread): each counter has one writer, so no lock
        self._num_adds_sent = self._num_adds_applied = 0
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._stopping = False
        self._drain_deadline: float | None = None  # set by drain(): no new requests; abort the rest then
        self._wakeup = threading.Event()
        self.idle_wait_s = 1.0  # how often an idle loop wakes to run step_hook (periodic stats, worker health)
        _install_fault(engine, os.environ.get("TIDAL_INJECT_FAULT"))
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        if _start:  # (the engine-core process runs the loop on its main thread instead)
            self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, step_hook=None, max_waiting_requests: int | None = None,
                    core_process: bool = False, **core_options) -> AsyncLLM:
        """An AsyncLLM over a new engine: in this process, or with core_process=True in an engine-core process
        of its own (tidal/engine/core_process.py; core_options: stats_log_interval, startup_timeout)."""
        if core_process:
            from tidal.engine.core_process import CoreProcessAsyncLLM
            return CoreProcessAsyncLLM(config, step_hook, max_waiting_requests, **core_options)
        return cls(LLMEngine(config), step_hook, max_waiting_requests)

    # -- public API (event-loop side) ------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """Accepting requests: alive and neither draining nor stopped."""
        return self._dead is None and not self._stopping and self._drain_deadline is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (those just sent included); an n > 1 request counts n."""
        return self._num_adds_sent - self._num_adds_applied + self.engine.scheduler.num_waiting

    @property
    def is_overloaded(self) -> bool:
        return self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validate and tokenize a prompt without queueing it (ValueError for a bad one)."""
        return self.engine.process_prompt(prompt)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       cache_salt: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream delta RequestOutputs for one request until it finishes. A bad prompt or
        duplicate id raises ValueError before anything is queued."""
        outputs: asyncio.Queue = asyncio.Queue()
        self.stream_to(prompt, params, request_id, outputs.put_nowait, cache_salt)
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot this request
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.cancel(request_id)

    def stream_to(self, prompt: PromptType, params: SamplingParams, request_id: str,
                  deliver: Callable[[RequestOutput | BaseException], None], cache_salt: str | None = None) -> None:
        """Queue one request whose delta RequestOutputs go to deliver(output) on the calling event loop, in
        order, from the callback that hands the loop a step's outputs: no task wakes for an output (what a
        server streaming many requests saves per token). The last call is the finished output, or the
        exception that ended the request. deliver must not block; an exception it raises is logged. A bad
        prompt or duplicate id raises ValueError before anything is queued; cancel(request_id) stops it."""
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.engine.process_prompt(prompt)
        streams = self._streams
        if request_id in streams:
            raise ValueError(f"request_id {request_id!r} is already in use")

        def deliver_last_once(item: RequestOutput | BaseException) -> None:
            if streams.get(request_id) is not stream:  # cancelled: nobody is listening any more
                return
            if isinstance(item, BaseException) or item.finished:
                del streams[request_id]  # the engine already forgot this request
            deliver(item)

        stream = streams[request_id] = _Stream(asyncio.get_running_loop(), deliver_last_once, (text, ids))
        self._num_adds_sent += 1
        self._send(("add", request_id, {"prompt": text, "prompt_token_ids": ids},
                    params.clone(output_kind="delta"), cache_salt))
        try:
            self._check_alive()  # the loop may have died before it saw this stream
        except EngineDeadError:
            self.cancel(request_id)
            raise

    def cancel(self, request_id: str) -> None:
        """Stop a stream_to request early: nothing more is delivered, and the engine aborts it."""
        if self._streams.pop(request_id, None) is not None:
            self.abort(request_id)

    async def call_in_engine(self, fn):
        """Run fn(engine) on the engine thread between two steps (where the engine's state is consistent)
        and return its result: how the dashboard reads the block map without a race or a per-step cost.
        It waits for the step in progress; if the engine stops first it may never answer, so callers
        bound the wait (asyncio.wait_for)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(("call", fn, loop, future))
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the engine's next step."""
        if self._dead is None and not self._stopping:
            self._send(("abort", request_id))

    def drain(self, timeout_s: float) -> None:
        """Graceful shutdown, first half: refuse new requests from now on, let the running and waiting
        ones finish for up to timeout_s seconds, then abort those left with EngineDeadError."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout_s
            self._wakeup.set()

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop thread (after its current step); open streams get EngineDeadError."""
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # -- internals -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop failed: {self._dead!r}") from self._dead
        if self._stopping or self._drain_deadline is not None:
            raise EngineDeadError("the engine is shutting down: it accepts no new requests")

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)

    def _apply_commands(self) -> list[RequestOutput]:
        """Apply queued adds and aborts; returns the final outputs of aborted requests."""
        engine = self.engine
        aborted = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return aborted
            if command[0] == "add":
                self._num_adds_applied += 1
                _, request_id, prompt, params, cache_salt = command
                stream = self._streams.get(request_id)
                if stream is None:  # the caller went away before its request got here
                    continue
                try:
                    engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
                except ValueError as e:
                    stream.put(e)
            elif command[0] == "call":
                _, fn, loop, future = command
                try:
                    result, error = fn(engine), None
                except Exception as e:  # noqa: BLE001 - handed to the caller, never raised here
                    result, error = None, e
                self._answer_call(loop, future, result, error)
            else:
                aborted += engine.abort_request(command[1])

    def _answer_call(self, loop, future, result, error) -> None:
        _resolve(loop, future, result, error)

    def _run(self) -> None:
        with torch.inference_mode():  # the guard of every step, entered once for the thread (ModelRunner.execute)
            self._run_steps()

    def _run_steps(self) -> None:
        engine = self.engine
        failures = 0  # steps failed in a row
        drained = False  # drain()'s deadline has passed and the requests left were aborted
        try:
            while not self._stopping:
                self._wakeup.clear()
                aborted = self._apply_commands()
                draining = not drained and self._drain_deadline is not None
                if draining and time.monotonic() >= self._drain_deadline:
                    drained, draining = True, False
                    aborted += self._abort_open_streams()
                if not engine.has_unfinished_requests():
                    self._hook(aborted)
                    engine.check_health()  # a worker that died while nothing ran
                    wait = self.idle_wait_s
                    if draining and self._streams:
                        wait = min(wait, max(0.0, self._drain_deadline - time.monotonic()))
                    engine.set_idle(True)
                    self._wakeup.wait(wait)
                    continue
                engine.set_idle(False)
                try:
                    outputs = engine.step()
                    failures = 0
                except StepError as e:
                    failures += 1
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    for request_id in e.request_ids:
                        stream = self._streams.get(request_id)
                        if stream is not None:
                            stream.put(e)
                    self._hook(aborted + e.outputs)
                    continue
                self._deliver_outputs(outputs)
                self._hook(aborted + outputs)
        except BaseException as e:
            logger.exception("Engine loop failed; failing all requests")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine loop failed: {e!r}", in_flight=True))
            try:
                engine.shutdown()  # stop the workers left (a failed executor has already)
            except Exception:  # noqa: BLE001 - already dying; the first error is the one to report
                logger.exception("stopping the engine after its failure failed too")
            if self.on_dead is not None:
                self.on_dead(e)

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        """Each output of a step to its request's stream (those still open)."""
        streams = self._streams
        _deliver([(stream, out) for out in outputs if (stream := streams.get(out.request_id)) is not None])

    def _abort_open_streams(self) -> list[RequestOutput]:
        """The drain deadline has passed: abort every request still open, each with a clear error."""
        error = EngineDeadError("the server shut down before this request finished (it was aborted when the "
                                "shutdown timeout ran out)")
        aborted = []
        for request_id, stream in list(self._streams.items()):
            aborted += self.engine.abort_request(request_id)
            stream.put(error)
        return aborted

    def _hook(self, outputs) -> None:
        if self.step_hook is None:
            return
        try:
            self.step_hook(self.engine, outputs)
        except Exception:  # metrics must never take the engine down with them
            logger.exception("step hook failed; disabling it")
            self.step_hook = None


def _install_fault(engine: LLMEngine, spec: str | None) -> None:
    """The TIDAL_INJECT_FAULT test hook (see the module docstring): wraps one engine method so that its
    N-th call raises. Nothing is wrapped when spec is None."""
    if not spec:
        return
    where, _, nth = spec.partition(":")
    owners = {"execute": engine.runner, "update": engine.scheduler}
    if where not in owners or not nth.isdigit() or int(nth) < 1:
        raise ValueError(f"TIDAL_INJECT_FAULT must be execute:N or update:N (N >= 1), got {spec!r}")
    owner, nth, calls = owners[where], int(nth), [0]
    if where == "execute" and engine.config.async_scheduling:
        where = "execute_async"  # what the engine calls to run a step
    original = getattr(owner, where)

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError(f"injected fault (TIDAL_INJECT_FAULT={spec})")
        return original(*args, **kwargs)
    setattr(owner, where, failing)
    logger.warning("TIDAL_INJECT_FAULT=%s: call %d of %s will raise (a test hook)", spec, nth, where)
