"""The engine core in a process of its own (`tidal serve`'s default, `--no-engine-core-process` to turn it off;
`AsyncLLM.from_config(config, core_process=True)` in code), as vLLM V1 runs it:

    API server process                                   engine-core process
    HTTP, JSON, chat templates, tokenization    --zmq-->  the AsyncLLM loop (tidal/engine/async_llm.py)
    streams, metrics, /health, dashboard        <--zmq--  schedule -> execute -> detokenize -> outputs

`CoreProcessAsyncLLM` has AsyncLLM's interface (generate, abort, call_in_engine, drain, shutdown, is_running,
num_waiting, dead_error, on_dead, step_hook, `engine`) and is what the server holds. It spawns the core
process, which builds the LLMEngine (and its tensor/pipeline-parallel workers) and runs AsyncLLM's own loop
on its main thread, so errors, aborts, drain and the fault hook behave exactly as in one process. Commands
(add, abort, call, drain, shutdown) go to the core pickled over one ZeroMQ PUSH/PULL pair; after every
step (and every second while idle) the core sends one msgspec message back with the step's outputs (without
their prompts, which the server process holds: each request's stream puts its own back, so a step of 64
requests of 256-token prompts is an 18 KB message rather than 67 KB, and the server does not decode 16,384
prompt ids a step; a step hook's output of a request whose stream has gone has none), the
errors of the requests that failed, the answers to `call_in_engine`, and the engine's stats, which a
receiver thread of the server process hands to the request streams and to the step hook (the server's
Prometheus metrics), through `engine`: a view of the engine (tokenizer, limits, stats, check_params,
process_prompt, check_health) in the server process.

Faults: if the core process dies (killed, out of memory) or its loop fails, every open request fails with
EngineDeadError saying so, `dead_error` is set (the server's /health answers 503 with it) and `on_dead`
runs, as for an engine loop that dies in process. The core stops by itself if the server process goes
away (it polls its parent), and it ignores SIGINT and SIGTERM: the server drains and stops it.
"""
from __future__ import annotations

import gc
import itertools
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import msgspec
import zmq

from tidal.config import EngineConfig
from tidal.engine.async_llm import AsyncLLM, EngineDeadError, _deliver, _resolve
from tidal.engine.core_launch import start_core_process
from tidal.engine.llm_engine import LLMEngine, StepError
from tidal.engine.stats import EngineStats
from tidal.outputs import RequestOutput

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often each side's receiver looks at the other's liveness while nothing arrives


class CoreMessage(msgspec.Struct, array_like=True):
    """One message from the core: kind "step" (after a step or an idle wait), "ready" (payload: the pickled
    engine info), "failed" (the engine could not be built; error) or "dead" (the loop failed; error)."""
    kind: str
    outputs: list[RequestOutput] = []
    num_hook: int = 0  # outputs[:num_hook] are the step hook's; the others were only delivered
    deliveries: list[tuple[str, int, list | None]] = []  # (request id, index in outputs or -1, error)
    calls: list[tuple[int, bytes]] = []  # (call id, pickled (result, error))
    stats: EngineStats | None = None
    adds_applied: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    payload: bytes = b""
    error: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(CoreMessage)


def _error_info(error: BaseException) -> list:
    return [type(error).__name__, str(error), bool(getattr(error, "in_flight", False))]


def _rebuild_error(info: list) -> BaseException:
    kind, message, in_flight = info
    if kind == "ValueError":
        return ValueError(message)
    if kind == "StepError":
        error = StepError.__new__(StepError)
        RuntimeError.__init__(error, message)
        error.request_ids, error.outputs = [], []
        return error
    if kind == "EngineDeadError":
        return EngineDeadError(message, in_flight)
    return RuntimeError(message)


def _pickle_answer(result, error) -> bytes:
    try:
        return pickle.dumps((result, error))
    except Exception as e:  # noqa: BLE001 - an answer that cannot cross the boundary is an error for the caller
        return pickle.dumps((None, RuntimeError(f"the engine's answer could not be sent to the server: {e!r}")))


# -- the core process ------------------------------------------------------------------------------
class _RemoteStream:
    """The core's end of one request's stream: what is put is sent with the next message."""
    __slots__ = ("core", "request_id")

    def __init__(self, core: _CoreLoop, request_id: str) -> None:
        self.core, self.request_id = core, request_id

    def put(self, item) -> None:
        self.core._outbox.append((self.request_id, item))
        if isinstance(item, BaseException) or item.finished:
            self.core._streams.pop(self.request_id, None)


class _CoreLoop(AsyncLLM):
    """AsyncLLM's loop over the engine, run on the core process's main thread; its streams and its step
    hook send to the server process."""

    def __init__(self, engine: LLMEngine, sock, parent_pid: int) -> None:
        super().__init__(engine, step_hook=None, _start=False)
        self._sock, self._parent_pid = sock, parent_pid
        self._outbox: list[tuple[str, object]] = []
        self._answers: list[tuple[int, bytes]] = []
        self.on_dead = lambda error: self._flush((), kind="dead", error=repr(error))

    def _deliver_outputs(self, outputs) -> None:
        for out in outputs:  # into the outbox, sent with the step's message
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _answer_call(self, loop, future, result, error) -> None:
        self._answers.append((future, _pickle_answer(result, error)))

    def _hook(self, outputs) -> None:
        engine = self.engine
        if engine.stats_logger is not None and not engine.has_unfinished_requests():
            engine.stats_logger.maybe_log(engine)  # the line that ends a busy period (steps log the others)
        self._flush(outputs)

    def _flush(self, hook_outputs, kind: str = "step", error: str = "") -> None:
        outputs = list(hook_outputs)
        num_hook = len(outputs)
        index = {id(o): i for i, o in enumerate(outputs)}
        deliveries = []
        for request_id, item in self._outbox:
            if isinstance(item, BaseException):
                deliveries.append((request_id, -1, _error_info(item)))
                continue
            i = index.get(id(item))
            if i is None:
                i = index[id(item)] = len(outputs)
                outputs.append(item)
            deliveries.append((request_id, i, None))
        self._outbox = []
        for out in outputs:  # the server process holds each request's prompt: not sent again with every output
            out.prompt, out.prompt_token_ids = None, []
        answers, self._answers = self._answers, []
        engine = self.engine
        stats = engine.stats
        message = CoreMessage(kind, outputs, num_hook, deliveries, answers, stats, self._num_adds_applied,
                              engine.scheduler.num_running, engine.scheduler.num_waiting, engine.kv_manager.usage,
                              error=error)
        try:
            self._sock.send(_ENCODER.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the server process is gone: the receiver thread stops the loop
            pass
        stats.ttft, stats.tpot, stats.e2e = [], [], []  # sent: the server's metrics observe them

    def receive(self, sock) -> None:
        """The receiver thread: applies the server's commands (the loop picks adds, aborts and calls up
        between steps, as in one process) and stops the loop if the server process goes away."""
        while not self._stopping:
            if not sock.poll(POLL_MS):
                if os.getppid() != self._parent_pid:
                    logger.error("the server process went away: stopping the engine core")
                    self._stopping = True
                    self._wakeup.set()
                continue
            command = pickle.loads(sock.recv())
            kind = command[0]
            if kind == "add":
                self._streams[command[1]] = _RemoteStream(self, command[1])
                self._send(command)
            elif kind == "abort":
                self._streams.pop(command[1], None)  # the server's stream is gone: nothing more to send
                self._send(command)
            elif kind == "call":
                _, call_id, fn = command
                self._send(("call", fn, None, call_id))
            elif kind == "drain":
                self.drain(command[1])
            elif kind == "shutdown":
                self._stopping = True
                self._wakeup.set()


def run_core(config: EngineConfig, in_addr: str, out_addr: str, stats_log_interval: float | None,
             parent_pid: int) -> None:
    """The core process's main function."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains and stops the core
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)  # never block the engine on a slow server
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(out_addr)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(in_addr)
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which raises it
        out.send(_ENCODER.encode(CoreMessage("failed", payload=pickle.dumps(type(e).__name__), error=str(e))))
        out.close()
        ctx.term()
        os._exit(1)
    # the start-up heap (modules, weights' wrappers, the tokenizer) lives as long as this process: out of the
    # collector's sight, a full collection walks only what requests create (no 0.1-0.2 s pauses mid-serving)
    gc.collect()
    gc.freeze()
    if engine.stats_logger is not None and stats_log_interval is not None:
        engine.stats_logger.interval_s = stats_log_interval
    info = {"model_name": engine.model_name, "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
            "eos_token_ids": engine.eos_token_ids, "config": engine.config, "kv_plan": engine.kv_plan,
            "dtype": engine.dtype, "tokenizer": engine.tokenizer, "pid": os.getpid()}
    out.send(_ENCODER.encode(CoreMessage("ready", payload=pickle.dumps(info))))
    core = _CoreLoop(engine, out, parent_pid)
    receiver = threading.Thread(target=core.receive, args=(inp,), name="tidal-core-commands", daemon=True)
    receiver.start()
    core._run()  # returns once stopped, or after the loop failed (the engine already shut down then)
    if core._dead is None:
        core._fail_all(EngineDeadError("the engine was shut down"))
        core._flush(())
        engine.shutdown()
    receiver.join(1.0)
    out.close()  # lingers until the last message is out
    inp.close(0)
    ctx.term()
    logging.shutdown()
    os._exit(0 if core._dead is None else 1)


# -- the server process ----------------------------------------------------------------------------
class _EngineView:
    """What the server reads of the engine, in the server process: its limits, tokenizer and config, the
    prompt and params checks (LLMEngine's own, on the same state), and the stats of the latest message."""

    process_prompt = LLMEngine.process_prompt
    check_params = LLMEngine.check_params

    def __init__(self, info: dict, client: CoreProcessAsyncLLM) -> None:
        from tidal.structured_outputs.manager import StructuredOutputManager
        self.model_name, self.max_model_len = info["model_name"], info["max_model_len"]
        self.vocab_size, self.eos_token_ids = info["vocab_size"], info["eos_token_ids"]
        self.config, self.kv_plan, self.dtype = info["config"], info["kv_plan"], info["dtype"]
        self.tokenizer = info["tokenizer"]
        self.core_pid = info["pid"]
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, list(self.eos_token_ids))
        self.stats = EngineStats()
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0)
        self.kv_manager = SimpleNamespace(usage=0.0)
        self.stats_logger = None  # the core logs the stats lines
        self._client = client

    def get_tokenizer(self):
        return self.tokenizer

    def check_health(self) -> None:
        """Raises if the core process has exited (a dead worker of its own kills its loop: dead_error)."""
        self._client._check_core()

    def shutdown(self) -> None:
        self.structured.shutdown()  # the core process is stopped by the AsyncLLM's shutdown


class CoreProcessAsyncLLM(AsyncLLM):
    def __init__(self, config: EngineConfig, step_hook=None, max_waiting_requests: int | None = None,
                 stats_log_interval: float | None = None, startup_timeout: float = 900.0,
                 process: subprocess.Popen | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 (or None: unbounded), got {max_waiting_requests}")
        self.step_hook = step_hook
        self.max_waiting_requests = max_waiting_requests
        self.on_dead = None  # called (receiver thread) with the error when the engine dies
        self._streams = {}
        self._num_adds_sent = self._num_adds_applied = 0
        self._dead: BaseException | None = None
        self._stopping = False
        self._drain_deadline: float | None = None
        self._calls: dict[int, tuple] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="tidal-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.bind(out_addr)
        self._proc = process if process is not None else start_core_process()
        with self._proc.stdin:
            self._proc.stdin.write(pickle.dumps((config, in_addr, out_addr, stats_log_interval, os.getpid())))
        try:
            info = self._wait_ready(startup_timeout)
        except BaseException:
            self._stop_process(5.0)
            self._close()
            raise
        self.engine = _EngineView(info, self)
        logger.info("Engine core running in process %d", self._proc.pid)
        self._thread = threading.Thread(target=self._receive, name="tidal-core-outputs", daemon=True)
        self._thread.start()

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self._out.poll(POLL_MS):
                message = _DECODER.decode(self._out.recv())
                if message.kind == "ready":
                    return pickle.loads(message.payload)
                kind = pickle.loads(message.payload)
                raise (ValueError if kind == "ValueError" else RuntimeError)(message.error)
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine core process exited (exit code {self._proc.returncode}) before it "
                                   "was ready; its log says why")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core process was not ready after {timeout:g} s")

    # -- AsyncLLM's interface ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_adds_sent - self._num_adds_applied + self.engine.scheduler.num_waiting

    @property
    def core_pid(self) -> int:
        return self._proc.pid

    def drain(self, timeout_s: float) -> None:
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout_s
            self._send_raw(("drain", timeout_s))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the core process (after its current step; it stops its workers) and the receiver."""
        first = not self._stopping
        self._stopping = True
        if first:
            self._send_raw(("shutdown",))
            self._stop_process(timeout)
            if self._thread.is_alive() and threading.current_thread() is not self._thread:
                self._thread.join(5.0)
            self._close()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._fail_calls(EngineDeadError("the engine was shut down"))

    # -- internals ---------------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        if command[0] == "call":
            _, fn, loop, future = command
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
            command = ("call", call_id, fn)
        self._send_raw(command)

    def _send_raw(self, command: tuple) -> None:
        data = pickle.dumps(command)
        with self._send_lock:
            if not self._in.closed:
                try:
                    self._in.send(data, zmq.NOBLOCK)
                except zmq.Again:  # no core connected any more (it exited): nobody to tell
                    pass

    def _check_core(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop failed: {self._dead!r}") from self._dead
        if self._proc.poll() is not None:
            raise EngineDeadError(f"the engine core process exited (exit code {self._proc.returncode})")

    def _stop_process(self, timeout: float | None) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine core process did not stop in time: killing it")
            self._proc.kill()
            self._proc.wait(5.0)

    def _close(self) -> None:
        with self._send_lock:
            self._in.close(0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _fail_calls(self, error: BaseException) -> None:
        calls, self._calls = self._calls, {}
        for loop, future in calls.values():
            _resolve(loop, future, None, error)

    def _receive(self) -> None:
        """The receiver thread: hands each message's outputs, errors and answers over, runs the step hook,
        and notices a core process that died."""
        sock = self._out
        try:
            while True:
                if sock.poll(POLL_MS):
                    message = _DECODER.decode(sock.recv())
                    self._handle(message)
                    if message.kind == "dead":
                        self._die(RuntimeError(f"{message.error} (in the engine core process)"))
                        return
                elif self._proc.poll() is not None:
                    if not self._stopping:
                        self._die(RuntimeError(f"the engine core process (pid {self._proc.pid}) exited unexpectedly "
                                               f"(exit code {self._proc.returncode})"))
                    return
        finally:
            sock.close(0)

    def _handle(self, message: CoreMessage) -> None:
        self._num_adds_applied = message.adds_applied
        view = self.engine
        if message.stats is not None:
            view.stats = message.stats
        view.scheduler.num_running, view.scheduler.num_waiting = message.running, message.waiting
        view.kv_manager.usage = message.kv_usage
        outputs, streams = message.outputs, self._streams
        items = []
        for request_id, i, error in message.deliveries:
            stream = streams.get(request_id)
            if stream is None:
                continue
            if error is None:
                out = outputs[i]
                out.prompt, out.prompt_token_ids = stream.prompt  # as the stream's request sent it
                items.append((stream, out))
            else:
                items.append((stream, _rebuild_error(error)))
        _deliver(items)
        for call_id, answer in message.calls:
            waiter = self._calls.pop(call_id, None)
            if waiter is not None:
                result, error = pickle.loads(answer)
                _resolve(waiter[0], waiter[1], result, error)
        self._hook(outputs[:message.num_hook])

    def _die(self, error: BaseException) -> None:
        if self._dead is not None:
            return
        logger.error("The engine core failed: %s; failing all requests", error)
        self._dead = error
        self._fail_all(EngineDeadError(f"the engine loop failed: {error!r}", in_flight=True))
        self._fail_calls(EngineDeadError(f"the engine loop failed: {error!r}"))
        if self.on_dead is not None:
            self.on_dead(error)


if __name__ == "__main__":
    import importlib

    from tidal.config import HF_CONFIG_MODULES
    for module in HF_CONFIG_MODULES:  # before the config arrives (tidal/engine/core_launch.py)
        importlib.import_module(module)
    try:
        arguments = pickle.load(sys.stdin.buffer)
    except EOFError:  # the server stopped before it had a config to send
        sys.exit(1)
    run_core(*arguments)
