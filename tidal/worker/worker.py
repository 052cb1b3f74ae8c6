"""Worker: one tensor/pipeline-parallel rank. It joins the process group, builds the model with its
parallel state set (so every layer creates and loads only this rank's shard, and a pipeline stage
only its layers), and runs the scheduler's batches through an ordinary ModelRunner.

The same class runs inside a process started by the multiprocessing executor and as a Ray actor.
On CUDA each rank drives one GPU (cuda:local_rank) and the ranks talk over NCCL; on CPU over gloo.

Pipeline parallelism keeps stages busy by splitting each step's batch into micro-batches: stage s
works on micro-batch i + 1 while stage s + 1 works on micro-batch i (sends do not wait), so with P
stages up to P micro-batches are in flight at once. Requests are independent in a forward (each has
its own KV blocks), so splitting changes no result.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from tidal.config import EngineConfig
from tidal.core.scheduler import ScheduledRequest, SchedulerOutput
from tidal.worker.model_runner import ModelRunner, RunnerOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerInfo:
    rank: int
    tp_rank: int
    pp_rank: int
    layers: tuple[int, int]
    weight_bytes: int
    load_seconds: float
    pid: int
    device: str = "cpu"
    tp_all_reduce: str = "none"  # how tensor-parallel all-reduces travel: "shared memory", "gloo", "nccl"


class Worker:
    def __init__(self, config: EngineConfig, rank: int, eos_token_ids: tuple[int, ...], timeout_s: float = 60.0,
                 num_threads: int | None = None, local_rank: int | None = None) -> None:
        """local_rank: this rank's GPU index on its machine (default: rank); unused on CPU."""
        self.config, self.rank = config, rank
        self.local_rank = rank if local_rank is None else local_rank
        self.eos_token_ids, self.timeout_s, self.num_threads = eos_token_ids, timeout_s, num_threads
        self.tp_size, self.pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        self.pp_rank, self.tp_rank = divmod(rank, self.tp_size)
        # micro-batches per step under pipeline parallelism (1 turns the overlap off, for measuring it)
        self.num_microbatches = int(os.environ.get("TIDAL_PP_MICROBATCHES", self.pp_size))
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        # the rank whose sampled tokens go back to the driver (every last-stage rank samples the same)
        self.is_output_rank = self.is_last_stage and self.tp_rank == 0
        self.runner: ModelRunner | None = None

    def init(self, init_method: str) -> WorkerInfo:
        """Join the group at init_method (tcp://host:port of the rendezvous) and load this rank's shard.
        Every rank must call it at the same time."""
        from tidal.distributed import init_distributed
        from tidal.loader import load_model
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        t0 = time.perf_counter()
        if self.config.device == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)  # before NCCL joins: each rank's communicator on its own GPU
        else:
            device = torch.device("cpu")
        init_distributed(self.rank, self.tp_size, self.pp_size, init_method, self.timeout_s,
                         backend="nccl" if device.type == "cuda" else "gloo")
        loaded = load_model(self.config.model, self.config.dtype, quantization=self.config.quantization, device=device,
                            tokenizer=self.config.tokenizer, tokenizer_mode=self.config.tokenizer_mode,
                            load_format=self.config.load_format)
        model = loaded.model
        all_reduce = self._init_all_reduce(loaded.config, device)
        self.runner = ModelRunner.from_config(loaded, self.config, self.eos_token_ids)
        stack = next((m for m in model.modules() if hasattr(m, "start_layer")), None)  # LlamaModel, MambaModel...
        layers = ((stack.start_layer, stack.end_layer) if stack is not None  # models without stages hold every layer
                  else (0, getattr(loaded.config, "num_hidden_layers", 0)))
        info = WorkerInfo(self.rank, self.tp_rank, self.pp_rank, layers, loaded.weight_bytes,
                          time.perf_counter() - t0, os.getpid(), str(device), all_reduce)
        logger.info("rank %d (tp %d/%d, pp %d/%d) on %s: layers [%d, %d), %.1f MB of weights, loaded in %.1f s; "
                    "all-reduce: %s", self.rank, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, device,
                    *layers, info.weight_bytes / 1e6, info.load_seconds, all_reduce)
        return info

    def _init_all_reduce(self, model_config, device: torch.device) -> str:
        """On CPU, move the tensor-parallel all-reduces from gloo to shared memory when the group's
        ranks share this machine. The segment's slots hold the largest activation of a step: a step's
        tokens (the engine's max_num_batched_tokens, which it resolves before starting the workers) x hidden
        size in fp32.
        TIDAL_SHM_ALL_REDUCE=0 keeps gloo (to compare the two)."""
        from tidal.distributed import init_shm_all_reduce
        if self.tp_size == 1:
            return "none"
        if device.type != "cpu":
            return "nccl"
        hidden = getattr(model_config, "hidden_size", None)
        tokens = self.config.max_num_batched_tokens or max(2048, self.config.max_num_seqs)
        wanted = os.environ.get("TIDAL_SHM_ALL_REDUCE", "1") != "0"
        if hidden and wanted and init_shm_all_reduce(tokens * hidden * 4, self.timeout_s):
            return "shared memory"
        return "gloo"

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token()

    def cache_budget_bytes(self, *args) -> int:
        """Every rank profiles at once (the forward's collectives need them all); see ModelRunner."""
        from tidal.distributed import wait_pp_sends
        try:
            return self.runner.cache_budget_bytes(*args, compute_logits=self.is_last_stage)
        finally:
            wait_pp_sends()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def commit_kv_cache(self) -> int:
        return self.runner.commit_kv_cache()

    def warm_up(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        """Every rank at once (the forward's collectives need them all); see ModelRunner."""
        from tidal.distributed import wait_pp_sends
        try:
            self.runner.warm_up(num_tokens, num_seqs, max_model_len, compute_logits=self.is_last_stage)
        finally:
            wait_pp_sends()

    def state_bytes_per_request(self) -> int:
        return self.runner.state_bytes_per_request()

    def allocate_state(self, num_slots: int) -> None:
        self.runner.allocate_state(num_slots)

    def get_rendezvous(self) -> str:
        """Under Ray: tcp://address:port on this worker's node, as Ray knows the node, with a port free
        there. Rank 0 hosts the process group's rendezvous."""
        import socket

        import ray
        node_id = ray.get_runtime_context().get_node_id()
        address = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            return f"tcp://{address}:{s.getsockname()[1]}"

    def execute(self, so: SchedulerOutput) -> RunnerOutput | None:
        if self.pp_size == 1:
            out = self.runner.execute(so)
        else:
            out = self._execute_pipelined(so)
        return out if self.is_output_rank else None

    @torch.inference_mode()
    def _execute_pipelined(self, so: SchedulerOutput) -> RunnerOutput:
        from tidal.distributed import wait_pp_sends
        out = RunnerOutput()
        self.runner.update_states(so)
        # Mamba state checkpoints are restored for the whole step before any micro-batch runs: a forward
        # may overwrite a checkpoint that a later micro-batch restores from (the scheduler reuses an
        # evicted checkpoint's index in the step that restores from it, relying on restores coming first).
        self.runner.restore_states(so.scheduled)
        last = self.is_last_stage  # earlier stages only run their layers: nothing to sample
        try:
            for part in split_batch(so.scheduled, self.num_microbatches):
                res = self.runner.run(part, so, compute_logits=last)
                out.sampled.update(res.sampled)
                out.logprobs.update(res.logprobs)
                out.prompt_logprobs.update(res.prompt_logprobs)
        finally:
            wait_pp_sends()
        return out

    def shutdown(self) -> None:
        from tidal.distributed import destroy_distributed
        destroy_distributed()


def split_batch(reqs: list[ScheduledRequest], num_parts: int) -> list[list[ScheduledRequest]]:
    """Split a step's requests into up to num_parts contiguous micro-batches of about equal token counts.
    Every stage splits the same batch the same way, so micro-batch i meets itself on every stage."""
    n = min(num_parts, len(reqs))
    if n <= 1:
        return [list(reqs)]
    total = sum(r.num_tokens for r in reqs)
    parts, current, seen = [], [], 0
    for i, r in enumerate(reqs):
        current.append(r)
        seen += r.num_tokens
        remaining_parts = n - len(parts) - 1
        # close this part once it holds its share, keeping at least one request for each later part
        if remaining_parts and (seen >= total * (len(parts) + 1) / n or len(reqs) - i - 1 == remaining_parts):
            parts.append(current)
            current = []
    parts.append(current)
    return [p for p in parts if p]
