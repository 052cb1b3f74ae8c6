"""RayExecutor: the same workers as the multiprocessing executor, placed by Ray as actors on the
cluster this process is connected to (or a local one), so ranks can live on several machines. On
CUDA each actor asks Ray for one GPU, which Ray makes the only one the actor sees (its cuda:0)."""
from __future__ import annotations

import logging
import os
import time
import weakref

from tidal.config import EngineConfig
from tidal.worker.executor import (
    _INIT_TIMEOUT_S,
    Executor,
    WorkerError,
    _log_shards,
    _threads_per_worker,
    execute_timeout_s,
)
from tidal.worker.memory import cache_budget_bytes
from tidal.worker.model_runner import RunnerOutput

logger = logging.getLogger(__name__)


def _ray_kill(actors, placement_group) -> None:
    try:
        import ray
        if not ray.is_initialized():
            return
        for a in actors:
            ray.kill(a)
        if placement_group is not None:
            ray.util.remove_placement_group(placement_group)
    except Exception as e:  # noqa: BLE001 - best effort at teardown
        logger.warning("Ray teardown: %s", e)


class RayExecutor(Executor):
    """Workers as Ray actors, one CPU bundle each, packed onto as few nodes as possible. Uses the
    cluster this process is connected to, else `ray.init()` (RAY_ADDRESS, or a local instance)."""

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...]) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ImportError("distributed_executor_backend='ray' needs Ray: pip install ray") from e
        from tidal.worker.worker import Worker
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
        self.world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.output_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.timeout_s = execute_timeout_s()
        self._failed: str | None = None
        self.actors = []
        self.device = config.device
        num_gpus = 1 if self.device == "cuda" else 0
        bundle = {"CPU": 1, "GPU": 1} if num_gpus else {"CPU": 1}
        self.placement_group = ray.util.placement_group([bundle] * self.world, strategy="PACK")
        self._finalizer = weakref.finalize(self, _ray_kill, self.actors, self.placement_group)
        try:
            ray.get(self.placement_group.ready(), timeout=max(_INIT_TIMEOUT_S, self.timeout_s))
            remote_worker = ray.remote(num_cpus=1, num_gpus=num_gpus)(Worker)
            threads = _threads_per_worker(self.world)

            for rank in range(self.world):
                strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
                self.actors.append(remote_worker.options(scheduling_strategy=strategy).remote(
                    config, rank, eos_token_ids, self.timeout_s, threads, 0))
            # rank 0 hosts the rendezvous, on whichever node Ray placed it
            # starting actors (a Python process each, importing torch) is slow on a loaded machine
            init_method = ray.get(self.actors[0].get_rendezvous.remote(),
                                  timeout=max(_INIT_TIMEOUT_S, self.timeout_s))
            self.worker_infos = self._call("init", init_method, timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s))
        except BaseException:
            self.shutdown()
            raise
        _log_shards(self.worker_infos)

    def _call(self, method: str, *args, timeout_s: float | None = None) -> list:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
        if self._failed:
            raise WorkerError(f"the workers have failed earlier and cannot run {method}: {self._failed}")
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        index = {ref: r for r, ref in enumerate(refs)}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        replies, pending = {}, list(refs)
        while pending:  # take replies as they come, so one failure is seen without waiting on the rest
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(index[p] for p in pending)
                self._fail(f"worker rank(s) {late} did not answer {method} within {timeout_s:.0f} s")
            try:
                replies[index[ready[0]]] = ray.get(ready[0])
            except RayActorError as e:
                self._fail(f"worker rank {index[ready[0]]} died: {e}")
            except (RayTaskError, GetTimeoutError) as e:
                self._fail(f"worker rank {index[ready[0]]} failed in {method}: {e}")
        return [replies[r] for r in range(self.world)]

    def _fail(self, why: str):
        self._failed = why.splitlines()[0]
        logger.error("worker failure: %s", why)
        self.shutdown()
        raise WorkerError(why)

    @property
    def pids(self) -> list[int]:
        return [info.pid for info in getattr(self, "worker_infos", [])]

    def execute(self, batch) -> RunnerOutput:
        return self._output_of(lambda: self._call("execute", batch))

    def kv_bytes_per_token(self) -> int:
        return max(self._call("kv_bytes_per_token"))

    def cache_budget_bytes(self, *args) -> int:
        if self.device != "cuda":  # as before: one budget measured where the engine runs
            return cache_budget_bytes(None)
        return min(self._call("cache_budget_bytes", *args, timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s)))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def commit_kv_cache(self) -> int:
        return sum(self._call("commit_kv_cache", timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s)))

    def warm_up(self, *args) -> None:
        self._call("warm_up", *args, timeout_s=max(_INIT_TIMEOUT_S, self.timeout_s))

    def state_bytes_per_request(self) -> int:
        return max(self._call("state_bytes_per_request"))

    def allocate_state(self, num_slots: int) -> None:
        self._call("allocate_state", num_slots)

    def check_health(self) -> None:
        # an actor's calls queue behind its running step, so a ping could not tell slow from dead:
        # report what the steps have seen (a dead actor fails the next step within seconds)
        if self._failed:
            raise WorkerError(self._failed)

    def shutdown(self) -> None:
        self._finalizer()
