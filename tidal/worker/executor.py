"""Executors: where the model runs. The engine hands each step's SchedulerOutput to `execute` and
gets the sampled tokens back; it never needs to know how many processes sit behind it.

    UniProcExecutor     the ModelRunner in the engine's own process (tensor = pipeline = 1)
    MultiprocExecutor   one process per rank, forked from a forkserver that has the worker's modules
                        imported (spawn's semantics otherwise), joined by torch.distributed (gloo
                        on CPU, NCCL on CUDA with rank r on GPU r) over 127.0.0.1; each step's
                        batch is pickled once and written to every worker's pipe, and the sampled
                        tokens come back from the last stage's rank 0 as plain Python lists
    RayExecutor         the same workers as Ray actors (tidal/worker/ray_executor.py)

Failure handling: the driver waits on the workers' pipes and their process sentinels together, so a
worker that dies is reported at once, a worker that raises sends its traceback, a stopped one is
reported within a second and one that hangs after `TIDAL_EXECUTE_TIMEOUT_S` (default 30 s). After a
failure the executor refuses further work. Worker processes are reaped when the executor is shut
down, garbage-collected or the interpreter exits, and they exit by themselves when the driver's end
of their pipe closes.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import time
import weakref
from dataclasses import dataclass

from tidal.config import HF_CONFIG_MODULES, EngineConfig
from tidal.worker.memory import cache_budget_bytes
from tidal.worker.model_runner import ModelRunner, RunnerOutput

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_S = 30.0
_INIT_TIMEOUT_S = 600.0  # loading a shard can take far longer than a step
_STATE_CHECK_S = 1.0  # while waiting, how often to look for a stopped worker


class WorkerError(RuntimeError):
    """A worker process died, raised, or stopped answering."""


def execute_timeout_s() -> float:
    return float(os.environ.get("TIDAL_EXECUTE_TIMEOUT_S", _DEFAULT_TIMEOUT_S))


def uses_workers(config: EngineConfig) -> bool:
    """Whether the model runs in worker processes (mp/ray) rather than in the engine's process."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    backend = config.distributed_executor_backend
    if backend == "uni" and world > 1:
        raise ValueError(f"distributed_executor_backend 'uni' runs one process, but tensor_parallel_size x "
                         f"pipeline_parallel_size = {world}: use 'mp' or 'ray'")
    return world > 1 or backend in ("mp", "ray")


@dataclass
class ModelMeta:
    """What the engine needs from a model whose weights live in the workers."""
    config: object
    tokenizer: object
    path: str
    name: str
    dtype: object
    quantization: str | None = None
    weight_dtype: object = None  # of linear layers and embeddings (and of an "auto" KV cache)


def load_model_meta(engine_config: EngineConfig) -> ModelMeta:
    """Config, tokenizer and dtype without building the model: the driver of a parallel engine holds
    no weights. Refuses, before any worker starts, what the workers would refuse."""
    from tidal.layers.linear import split_heads
    from tidal.layers.quantization import get_quantization_config
    from tidal.loader import gguf_loader
    from tidal.loader.loader import (
        DEFAULT_MODEL_NAME,
        dummy_config,
        load_config,
        load_tokenizer,
        resolve_dtypes,
        resolve_model_path,
    )
    from tidal.models.registry import resolve_model_class
    model, dtype = engine_config.model, engine_config.dtype
    tp, pp = engine_config.tensor_parallel_size, engine_config.pipeline_parallel_size
    quantization = engine_config.quantization
    if engine_config.load_format == "dummy":  # random weights in the workers: a config, no checkpoint
        path, config = dummy_config(model)
        is_gguf = False
    else:
        path = resolve_model_path(model)
        is_gguf = path.endswith(".gguf")
        if is_gguf:  # as load_model: converted once here (if at all), so the workers only read the conversion
            path, quantization = gguf_loader.prepare_gguf(path, quantization)
        config = load_config(path)
    model_cls = resolve_model_class(config)  # refuse an unsupported architecture before any worker starts
    if pp > 1 and not getattr(model_cls, "supports_pp", False):
        raise ValueError(f"{model_cls.__name__} does not support pipeline parallelism yet "
                         f"(pipeline_parallel_size={pp}); use tensor_parallel_size")
    heads = getattr(config, "num_attention_heads", None)
    if heads:  # the heads must split by KV-head group (unevenly if need be): refuses sizes that cannot
        split_heads(heads, getattr(config, "num_key_value_heads", None) or heads, tp)
    name = DEFAULT_MODEL_NAME if model is None else os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
    act_dtype, weight_dtype = resolve_dtypes(dtype, config, engine_config.device,
                                             checkpoint_fp32=False if is_gguf else None)
    quant = get_quantization_config(quantization, config, weight_dtype, act_dtype)  # refuses early
    tokenizer = load_tokenizer(path, engine_config.tokenizer, engine_config.tokenizer_mode)
    return ModelMeta(config, tokenizer, path, name, act_dtype, quant.name if quant else None,
                     weight_dtype)


def create_executor(config: EngineConfig, eos_token_ids: tuple[int, ...]):
    backend = config.distributed_executor_backend or "mp"
    if backend == "ray":
        from tidal.worker.ray_executor import RayExecutor
        return RayExecutor(config, eos_token_ids)
    return MultiprocExecutor(config, eos_token_ids)


class Executor:
    """The interface the engine calls."""
    worker_infos: tuple = ()  # per rank: WorkerInfo (layers, weight bytes, pid)

    def execute(self, batch) -> RunnerOutput:
        raise NotImplementedError

    output_rank = 0  # the rank whose RunnerOutput is the step's (the last pipeline stage's first)

    def _output_of(self, call) -> RunnerOutput:
        """The output rank's result of call() (every rank's results). Under pipeline parallelism (an output
        rank past 0) no one rank sees the whole forward, so the model time is the whole call's."""
        t0 = time.perf_counter()
        out = call()[self.output_rank]
        if self.output_rank > 0:
            out.model_time_s = time.perf_counter() - t0
        return out

    def kv_bytes_per_token(self) -> int:
        raise NotImplementedError

    def cache_budget_bytes(self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                           max_model_len: int) -> int:
        """Bytes the KV cache and Mamba state may take on each rank (ModelRunner.cache_budget_bytes)."""
        raise NotImplementedError

    def allocate_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def commit_kv_cache(self) -> int:
        """ModelRunner.commit_kv_cache on every rank: the bytes committed, all ranks together."""
        raise NotImplementedError

    def warm_up(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        """ModelRunner.warm_up on every rank at once (before the KV cache and state are allocated)."""
        raise NotImplementedError

    def state_bytes_per_request(self) -> int:
        """Mamba state bytes one running request needs (on the rank that needs most)."""
        raise NotImplementedError

    def allocate_state(self, num_slots: int) -> None:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raises WorkerError if a worker has died."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, batch) -> RunnerOutput:
        return self.runner.execute(batch)

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token()

    def cache_budget_bytes(self, *args) -> int:
        return self.runner.cache_budget_bytes(*args)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def commit_kv_cache(self) -> int:
        return self.runner.commit_kv_cache()

    def warm_up(self, *args) -> None:
        self.runner.warm_up(*args)

    def state_bytes_per_request(self) -> int:
        return self.runner.state_bytes_per_request()

    def allocate_state(self, num_slots: int) -> None:
        self.runner.allocate_state(num_slots)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_worker(world: int) -> int | None:
    if os.environ.get("OMP_NUM_THREADS"):
        return None  # the user chose; torch in each worker reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world)  # the cores this process may use, shared out: no oversubscription


# -- multiprocessing -----------------------------------------------------------------------------
# what a worker imports, loaded once into the forkserver its processes are forked from
_FORKSERVER_PRELOAD = ["tidal.worker.worker", *HF_CONFIG_MODULES]


def _worker_context():
    """Workers are forked from a forkserver (one per driver process, started with its first workers) that
    has imported torch, the model code and transformers' config machinery once: a tiny model's 2-rank
    engine is ready in 1.2 s after the first, against 5.6-6.1 s when each worker imported them (spawn).
    As spawned workers, they re-import the driver's main module and take its sys.path and working folder;
    the environment they run under is the driver's when they start (_worker_main), not the forkserver's."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # (no effect once the forkserver runs)
    return ctx


def _worker_main(conn, config: EngineConfig, rank: int, eos_token_ids, timeout_s: float,
                 num_threads: int | None, local_rank: int | None = None, environ: dict | None = None) -> None:
    """A worker process: answer (method, args) messages from the driver until told to stop or the
    driver goes away. Every message gets exactly one reply: ("ok", result) or ("error", text)."""
    import traceback

    if environ is not None:  # the driver's environment now, not the forkserver's from its start
        os.environ.clear()
        os.environ.update(environ)
    if num_threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        num_threads = int(os.environ["OMP_NUM_THREADS"])  # (torch read the forkserver's at import)
    from tidal.worker.worker import Worker
    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "WARNING"))
    worker = Worker(config, rank, eos_token_ids, timeout_s, num_threads, local_rank)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver is gone: nothing left to serve
        try:
            reply = ("ok", getattr(worker, method)(*args))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the driver
            why = f"worker rank {rank} (pid {os.getpid()}) failed in {method}: {type(e).__name__}: {e}"
            reply = ("error", f"{why}\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except (EOFError, OSError, BrokenPipeError):
            break
        if method == "shutdown":
            break
    os._exit(0)  # skip interpreter teardown: a gloo group with a dead peer can block in its destructor


def _reap(procs, conns, grace_s: float = 3.0) -> None:
    """Stop worker processes: ask politely, then terminate, then kill. Safe to call twice."""
    msg = pickle.dumps(("shutdown", ()))
    for p, c in zip(procs, conns):
        if p.is_alive():
            try:
                c.send_bytes(msg)
            except (OSError, BrokenPipeError):
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        c.close()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...]) -> None:
        self.world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.device = config.device
        if self.device == "cuda":
            import torch
            gpus = torch.cuda.device_count()
            if self.world > gpus:
                raise ValueError(f"device 'cuda' with tensor_parallel_size x pipeline_parallel_size = {self.world} "
                                 f"needs {self.world} GPUs (one per rank), but torch sees {gpus}")
        self.output_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.timeout_s = execute_timeout_s()
        self._failed: str | None = None
        ctx = _worker_context()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = _threads_per_worker(self.world)
        self.procs, self.conns = [], []
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.conns)
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"tidal-worker-{rank}", daemon=True,
                            args=(child, config, rank, eos_token_ids, self.timeout_s, threads, rank,
                                  dict(os.environ)))
            p.start()
            child.close()  # the driver keeps only its end: a dead worker then reads as EOF
            self.procs.append(p)
            self.conns.append(parent)
        try:
            self.worker_infos = self._call("init", (init_method,), timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s))
        except BaseException:
            self.shutdown()
            raise
        _log_shards(self.worker_infos)

    # -- the RPC: one message to every worker, one reply from each -----------------------------------
    def _call(self, method: str, args: tuple, timeout_s: float | None = None) -> list:
        from multiprocessing.connection import wait
        if self._failed:
            raise WorkerError(f"the workers have failed earlier and cannot run {method}: {self._failed}")
        msg = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self.conns:
                c.send_bytes(msg)
        except (OSError, BrokenPipeError) as e:
            self._fail(f"cannot reach a worker ({e})")
        replies: dict[int, object] = {}
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.world:
            waiting = [c for c, r in by_conn.items() if r not in replies]
            left = deadline - time.monotonic()
            ready = wait(waiting + [s for s, r in by_sentinel.items() if r not in replies],
                         max(0.0, min(left, _STATE_CHECK_S)))
            if not ready and left > _STATE_CHECK_S:
                # a stopped process (SIGSTOP, out of the scheduler) will not answer: no need to wait it out
                stopped = [r for r in range(self.world) if r not in replies
                           and _process_state(self.procs[r].pid) == "stopped"]
                if stopped:
                    self._fail(f"worker rank(s) {stopped} are stopped (state 'stopped', e.g. SIGSTOP) and cannot "
                               f"answer {method}")
                continue
            if not ready:
                late = sorted(set(range(self.world)) - set(replies))
                states = ", ".join(f"rank {r}: {_process_state(self.procs[r].pid)}" for r in late)
                self._fail(f"worker rank(s) {late} did not answer {method} within {timeout_s:.0f} s ({states}; "
                           "raise TIDAL_EXECUTE_TIMEOUT_S if steps are legitimately this slow)")
            for obj in ready:
                rank = by_conn[obj] if obj in by_conn else by_sentinel[obj]
                if rank in replies:
                    continue
                conn = self.conns[rank]
                try:  # a worker may have replied just before exiting: take the reply first
                    if obj is not conn and not conn.poll():
                        raise EOFError
                    status, value = conn.recv()
                except (EOFError, OSError):
                    p = self.procs[rank]
                    p.join(1.0)
                    hint = ("; a script that starts an LLM must do so under `if __name__ == \"__main__\":` "
                            "(each worker re-imports the main module)") if method == "init" else ""
                    self._fail(f"worker rank {rank} (pid {p.pid}) died while running {method} "
                               f"(exit code {p.exitcode}){hint}")
                if status == "error":
                    self._fail_with_cause(method, rank, value)
                replies[rank] = value
        return [replies[r] for r in range(self.world)]

    def _fail_with_cause(self, method: str, rank: int, error: str):
        """A rank raised. When another rank died, that is usually the cause (the survivor's collective
        lost its peer): report the death first, then the error it caused."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs) if r != rank and p.exitcode is not None]
            if dead:
                r, p = dead[0]
                self._fail(f"worker rank {r} (pid {p.pid}) died while running {method} (exit code {p.exitcode}); "
                           f"then {error}")
            time.sleep(0.05)
        self._fail(error)

    def _fail(self, why: str):
        self._failed = why.splitlines()[0]
        logger.error("worker failure: %s", why)
        _reap(self.procs, self.conns, grace_s=0.5)  # the others are stuck waiting on the failed one
        self._finalizer.detach()
        raise WorkerError(why)

    # -- the Executor interface ----------------------------------------------------------------------
    def execute(self, batch) -> RunnerOutput:
        return self._output_of(lambda: self._call("execute", (batch,)))

    def kv_bytes_per_token(self) -> int:
        return max(self._call("kv_bytes_per_token", ()))  # every rank gets the same number of blocks

    def cache_budget_bytes(self, *args) -> int:
        if self.device != "cuda":  # the ranks share this machine's memory: measured here, as one budget
            return cache_budget_bytes(None)
        # each GPU is measured by its own rank (all profile at once); every rank gets the same blocks
        return min(self._call("cache_budget_bytes", args, timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s)))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", (num_blocks,))

    def commit_kv_cache(self) -> int:
        return sum(self._call("commit_kv_cache", (), timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s)))

    def warm_up(self, *args) -> None:
        self._call("warm_up", args, timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s))

    def state_bytes_per_request(self) -> int:
        return max(self._call("state_bytes_per_request", ()))  # every rank gets the same number of slots

    def allocate_state(self, num_slots: int) -> None:
        self._call("allocate_state", (num_slots,))

    def check_health(self) -> None:
        # only looks (safe from another thread, e.g. a server's /health while a step runs); the next
        # step reports the failure in full and stops the other workers
        if self._failed:
            raise WorkerError(self._failed)
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            raise WorkerError(f"worker rank(s) {[r for r, _ in dead]} died (exit codes {[c for _, c in dead]})")

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _process_state(pid: int) -> str:
    """'running', 'sleeping' (e.g. blocked in a collective), 'stopped', ...: names the culprit of a hang."""
    import psutil
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


def _log_shards(infos) -> None:
    for info in infos:
        logger.info("worker rank %d (tp %d, pp %d, pid %d, %s): layers [%d, %d), %.1f MB of weights, loaded in "
                    "%.1f s", info.rank, info.tp_rank, info.pp_rank, info.pid, info.device, *info.layers,
                    info.weight_bytes / 1e6, info.load_seconds)
