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
within one step. If the engine fails, every open stream and every later call raises
EngineDeadError instead of hanging.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from tidal.config import EngineConfig
from tidal.engine.llm_engine import LLMEngine, PromptType
from tidal.outputs import RequestOutput
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more."""


@dataclass
class _Stream:
    """Where the engine thread delivers one request's outputs (or its error)."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass


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
    def __init__(self, engine: LLMEngine, step_hook=None) -> None:
        """Wrap an engine and start its loop thread. `step_hook` runs on the engine thread
        after every step and every batch of commands (metrics; the engine is consistent there), with
        the step's outputs: `step_hook(engine, outputs)`."""
        self.engine = engine
        self.step_hook = step_hook
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._stopping = False
        self._wakeup = threading.Event()
        self.idle_wait_s = 1.0  # how often an idle loop wakes to run step_hook (periodic stats)
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, step_hook=None) -> AsyncLLM:
        return cls(LLMEngine(config), step_hook)

    # -- public API (event-loop side) ------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping

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
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.engine.process_prompt(prompt)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, {"prompt": text, "prompt_token_ids": ids},
                    params.clone(output_kind="delta"), cache_salt))
        finished = False
        try:
            self._check_alive()  # the loop may have died before it saw this stream
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot this request
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
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
        if self.is_running:
            self._send(("abort", request_id))

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
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

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
                _resolve(loop, future, result, error)
            else:
                aborted += engine.abort_request(command[1])

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wakeup.clear()
                aborted = self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._hook(aborted)
                    self._wakeup.wait(self.idle_wait_s)
                    continue
                outputs = engine.step()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                self._hook(aborted + outputs)
        except BaseException as e:
            logger.exception("Engine loop failed; failing all requests")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine loop failed: {e!r}"))

    def _hook(self, outputs) -> None:
        if self.step_hook is None:
            return
        try:
            self.step_hook(self.engine, outputs)
        except Exception:  # metrics must never take the engine down with them
            logger.exception("step hook failed; disabling it")
            self.step_hook = None
