"""CUDA graphs of decode-only steps.

On a GPU a small model's decode step is a few hundred short kernels, and launching them from Python
takes longer than running them. A step in which every request computes one token (no prompt chunk, no
drafts) instead replays a CUDA graph: the whole forward, captured once at start-up, launched with one
call. The LM head and the sampler run after it as before (they read the graph's output rows).

    sizes        a ladder of batch sizes, 1, 2, 4, 8, then every 8 up to max_num_seqs (at most 512); a step
                 of B requests replays the smallest captured size >= B
    buffers      the forward's inputs live in persistent device buffers of the largest size (input ids,
                 positions, KV slots, context lengths, block table); a step copies its rows in, from pinned
                 host staging buffers, and replays
    padding      rows B..size-1 compute a token nobody reads: token 0 at position 0, its K/V written to a
                 scratch block past the ones the scheduler hands out, attending over nothing
    memory       all graphs share one memory pool, whose size is the largest size's activations; the
                 engine measures that with a decode-shaped profiling forward and takes it out of the KV
                 cache budget; capture time and memory are logged

Graphs need the Triton attention backend (its kernel reads every length from device memory, so one
capture serves any context length), a single GPU in the engine's process (no tensor or pipeline
parallelism, no worker processes), no Mamba layers
and a model whose forward never waits on the host (`supports_cuda_graphs`: the Llama family; Mixtral's
expert routing reads its token counts back). Elsewhere, and with `enforce_eager=True`, every step runs
eagerly, as it always does on a CPU.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from tidal.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to max_num_seqs (itself included) and at most MAX_CAPTURE_SIZE."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def device_captures_graphs(device: torch.device) -> bool:
    return device.type == "cuda"


class CudaGraph:
    """One captured forward: torch.cuda.CUDAGraph in a memory pool shared by all sizes."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @staticmethod
    def new_pool():
        return torch.cuda.graph_pool_handle()

    def capture(self, forward) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return forward()

    def replay(self) -> None:
        self.graph.replay()


def unsupported_reason(runner, config) -> str | None:
    """Why decode steps of this runner cannot replay graphs (None: they can)."""
    if config.enforce_eager:
        return "enforce_eager is set"
    if not device_captures_graphs(runner.device):
        return "not on a GPU"
    from tidal.worker.executor import uses_workers
    if uses_workers(config):  # (no executor asks its workers to capture)
        return "a model in worker processes (tensor / pipeline parallelism, the mp / ray executor) runs eagerly"
    if runner.attn_backend.name != "triton":
        return f"the {runner.attn_backend.name} attention backend reads context lengths on the host"
    if runner.mamba_layers:
        return "models with Mamba layers run eagerly"
    if not getattr(runner.model, "supports_cuda_graphs", False):
        return f"{type(runner.model).__name__}'s forward reads values back from the GPU"
    return None


class DecodeGraphs:
    """The captured decode forwards of one ModelRunner (see the module docstring)."""

    graph_cls = CudaGraph  # (tests replace it on a CPU: tests/test_triton_kernels.py)

    def __init__(self, runner, sizes: list[int]) -> None:
        from tidal.layers.attention.backends import TritonMetadata
        self.runner, self.sizes = runner, sorted(sizes)
        self.max_size = S = self.sizes[-1]
        self._pick = [self.sizes[bisect.bisect_left(self.sizes, b)] for b in range(S + 1)]  # B -> captured size
        device, batch = runner.device, runner.input_batch
        self.block_size = batch.block_size
        pin = device.type == "cuda"
        # rows: input ids, positions, KV slots, context lengths (one host -> device copy for all four)
        self._host = torch.zeros(4, S, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(4, S, dtype=torch.int64, device=device)
        # a step's block-table rows, [B, blocks] contiguous in the first B * blocks elements
        self._host_table = torch.zeros(S * batch.max_blocks, dtype=torch.int64, pin_memory=pin)
        # a second pair of staging buffers, taken in turns: under asynchronous scheduling a replay is staged
        # while the one before may still be queued, its copies out of the other pair not yet done (the step
        # before that was read back, so its copies are)
        self._spare = (torch.zeros_like(self._host, pin_memory=pin), torch.zeros_like(self._host_table, pin_memory=pin))
        self._table = torch.zeros(S, batch.max_blocks, dtype=torch.int64, device=device)
        query_start_loc = torch.arange(S + 1, dtype=torch.int64, device=device)  # one token per request
        input_ids, positions, slots, seq_lens = self._dev
        self._contexts = {
            n: ForwardContext(num_tokens=n, num_decodes=n, query_start_loc=list(range(n + 1)), skinny_gemm=True,
                              batch_invariant=runner.batch_invariant, attn_backend=runner.attn_backend,
                              attn_metadata=TritonMetadata(slots[:n], self._table[:n], query_start_loc[:n + 1],
                                                           seq_lens[:n], max_query_len=1))
            for n in self.sizes}
        self._inputs = {n: (input_ids[:n], positions[:n]) for n in self.sizes}
        self._graphs: dict[int, tuple[CudaGraph, torch.Tensor]] = {}
        self.pad_slot = 0  # set by capture(): the first slot of the scratch block
        self.replays = 0

    def drop(self) -> None:
        """Forget the captured graphs (they point into a KV cache being replaced)."""
        self._graphs.clear()

    def takes(self, step) -> bool:
        """A decode-only step (one token per request) that a captured size holds."""
        return step.num_tokens == step.num_decodes == len(step.reqs) <= self.max_size and bool(self._graphs)

    def _forward(self, n: int):
        model, ctx, inputs = self.runner.model, self._contexts[n], self._inputs[n]

        def forward() -> torch.Tensor:
            with set_forward_context(ctx):
                return model(*inputs)
        return forward

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) of the host staging buffer become padding rows."""
        h = self._host
        h[0:2, start:end] = 0
        h[2, start:end] = self.pad_slot
        h[3, start:end] = 0

    @torch.inference_mode()
    def capture(self, pad_block: int) -> None:
        """Capture every size, largest first (the pool grows once); pad_block: a KV block no request uses."""
        cuda = self.runner.device.type == "cuda"
        self.pad_slot = pad_block * self.block_size
        self._pad(0, self.max_size)
        self._dev.copy_(self._host)
        if cuda:
            torch.cuda.synchronize(self.runner.device)
            free_before = torch.cuda.mem_get_info(self.runner.device)[0]
        t0 = time.perf_counter()
        pool = self.graph_cls.new_pool()
        try:
            for n in reversed(self.sizes):
                forward = self._forward(n)
                forward()  # warm-up: kernels compiled and the allocator settled outside the capture
                forward()
                graph = self.graph_cls(pool)
                self._graphs[n] = (graph, graph.capture(forward))
        except RuntimeError as e:  # a layer the capture cannot take (one that waits on the GPU): run eagerly
            self._graphs.clear()
            if cuda:
                torch.cuda.synchronize(self.runner.device)
                torch.cuda.empty_cache()
            logger.warning("CUDA graphs off (every step runs eagerly): capturing the decode forward of %d requests "
                           "failed: %s", n, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        if cuda:
            torch.cuda.synchronize(self.runner.device)
            used = (free_before - torch.cuda.mem_get_info(self.runner.device)[0]) / 2**20
            logger.info("CUDA graphs: captured %d decode batch sizes (1 to %d) in %.1f s, %.0f MiB of GPU memory",
                        len(self.sizes), self.max_size, time.perf_counter() - t0, used)

    def run(self, step, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's hidden states [B, hidden]: its inputs copied into the buffers, the graph replayed.
        fill (rows, ids): token ids that are on the device only (the previous step's draw, under
        asynchronous scheduling), written over those rows' ids. A view of the graph's output, valid until
        the next replay."""
        B = step.num_tokens
        n = self._pick[B]
        (self._host, self._host_table), self._spare = self._spare, (self._host, self._host_table)
        h = self._host
        h[0, :B].copy_(step.input_ids)
        h[1, :B].copy_(step.positions)
        h[2, :B].copy_(step.slot_mapping)
        h[3, :B].copy_(step.token_seq_lens)
        if B < n:
            self._pad(B, n)
        self._dev.copy_(h, non_blocking=True)  # all of it (4 x max size): one contiguous copy from pinned memory
        blocks = -(-step.max_seq_len // self.block_size)
        table = self._host_table[:B * blocks].view(B, blocks)
        table.copy_(step.block_table[step.token_rows, :blocks])
        self._table[:B, :blocks].copy_(table, non_blocking=True)
        if fill is not None:
            self._dev[0].index_copy_(0, *fill)
        graph, out = self._graphs[n]
        graph.replay()
        self.replays += 1
        return out[:B]
