"""ModelRunner: keeps the requests it is running (tidal/worker/input_batch.py), applies each step's
deltas from the scheduler, runs one forward over all scheduled tokens (prefill chunks, decodes and
drafts together, no padding), and samples.

Batch layout: requests computing one token (decodes) first, then multi-token chunks; input_ids,
positions and slot_mapping are flat [num_tokens] tensors gathered from the InputBatch's fixed buffers.
Attention metadata is built once per step by the platform's attention backend. Logits are computed
only at the rows that sample - a request's last known token, and each of its draft tokens - and at
prompt rows of requests that asked for prompt logprobs. A request with k drafts gets k + 1 tokens
sampled with its own parameters and noise; the drafts are accepted up to the first that differs from
the token sampled at its place, and the tokens returned are the accepted drafts and the one sampled
after them: rejection sampling of point-mass drafts, exact for sampled requests too
(tidal/layers/rejection_sampler.py).

On a GPU, a decode-only step replays a CUDA graph of the forward instead, padded to a captured batch size
(tidal/worker/cuda_graphs.py); the LM head and the sampler run on its real rows as above.

The runner runs where the model's weights are (CPU or CUDA): the KV cache, the Mamba state and the
default generator lives there too. Each step's tensors are built on the host and copied once
(tidal/device.py); what goes back to the engine is plain Python (token ids, logprob lists).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from tidal.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from tidal.device import HostCopy, IdleCommitter, commit_pages, lazy_zeros, to_device
from tidal.forward_context import ForwardContext, set_forward_context
from tidal.layers.attention import Attention
from tidal.layers.attention.kv_cache_dtype import FP8, describe_kv_cache_dtype, kv_cache_torch_dtype
from tidal.layers.attention.layer import kv_cache_shape
from tidal.layers.mamba import MambaMixer
from tidal.layers.rejection_sampler import accept_point_mass
from tidal.layers.sampler import (
    PromptTokenLogprobs,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    TokenLogprobs,
    prompt_logprobs,
    read_back_tensors,
    sampler_output,
)
from tidal.platforms import get_platform
from tidal.sampling_params import SamplingParams
from tidal.worker import cuda_graphs
from tidal.worker.cuda_graphs import DecodeGraphs
from tidal.worker.input_batch import InputBatch, StepInputs
from tidal.worker.memory import cache_budget_bytes, cuda_cache_budget_bytes, release_free_heap

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    # request id -> the tokens it got this step, in order (one, or accepted drafts and one more)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> per sampled token, in step with sampled
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> the prompt positions this step predicted
    prompt_logprobs: dict[str, list[PromptTokenLogprobs]] = field(default_factory=dict)
    # seconds this run spent in the model: the forward and the LM head (ModelClock); the engine's stats
    # call the rest of its step host time. Under tensor parallelism the output rank's (collectives
    # included); under pipeline parallelism the executor sets it to its whole execute call.
    model_time_s: float = 0.0


class ModelClock:
    """The time one ModelRunner.run spends in the model (its forward and LM head calls), cheaply: on the
    host, wall time (perf_counter around each call); on CUDA, the GPU time between CUDA events around
    them, as the host only queues the kernels (read once the step's results are back, so no extra sync
    unless nothing was sampled)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list = []
        self._t0, self._start = 0.0, None

    def reset(self) -> None:
        self.seconds = 0.0
        self._events.clear()

    def timed(self) -> ModelClock:
        """`with clock.timed():` adds the block's time (one block at a time)."""
        return self

    def __enter__(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self.seconds += time.perf_counter() - self._t0

    def detach(self) -> ModelClock:
        """A clock holding this one's time so far (its events still to read), this one reset: a step's time,
        read when its output is, after the next step has started."""
        held = ModelClock.__new__(ModelClock)
        held.cuda, held.seconds, held._events, held._t0, held._start = self.cuda, self.seconds, self._events, 0.0, None
        self.seconds, self._events = 0.0, []
        return held

    def total(self) -> float:
        for start, end in self._events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        self._events.clear()
        return self.seconds


@dataclass
class PendingStep:
    """A step whose forward and draw are queued (on CUDA: launched, not waited for); result() reads back
    its tokens and logprobs, waiting for them only then."""
    sample_reqs: list[ScheduledRequest] = field(default_factory=list)
    drawn: list[int] | HostCopy | None = None  # the rows' tokens: a host list, or read_back_tensors on their way
    num_logprobs: list[int | None] = field(default_factory=list)
    prompt_logprobs: dict[str, list[PromptTokenLogprobs]] = field(default_factory=dict)
    clock: ModelClock | None = None

    def result(self) -> RunnerOutput:
        out = RunnerOutput(prompt_logprobs=self.prompt_logprobs)
        if self.sample_reqs:
            if isinstance(self.drawn, list):
                drawn = SamplerOutput(self.drawn, [None] * len(self.drawn))
            else:
                drawn = sampler_output(self.drawn.wait(), self.num_logprobs)
            j = 0
            for r in self.sample_reqs:
                k = len(r.spec_token_ids)
                tokens, lps = drawn.token_ids[j:j + k + 1], drawn.logprobs[j:j + k + 1]
                j += k + 1
                # exact rejection sampling of point-mass drafts (see tidal/layers/rejection_sampler.py)
                kept = out.sampled[r.request_id] = accept_point_mass(tokens, r.spec_token_ids)
                if lps[0] is not None:
                    out.logprobs[r.request_id] = lps[:len(kept)]
        if self.clock is not None:
            out.model_time_s = self.clock.total()
        return out


class ModelRunner:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, block_size: int, seed: int = 0,
                 eos_token_ids: tuple[int, ...] = (), kv_cache_dtype: torch.dtype | None = None,
                 max_num_seqs: int = 256, max_model_len: int = 2048, max_num_batched_tokens: int = 2048) -> None:
        self.model = model
        self.dtype = dtype
        # the activations' dtype, or bf16 under fp32 activations with bf16 weights: half the memory per
        # token, the same as a bf16 model's, rounded as the model's weights are; or FP8 (E4M3, one byte)
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.batch_invariant = False  # EngineConfig.batch_invariant: set by from_config
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.mamba_layers = [m for m in model.modules() if isinstance(m, MambaMixer)]
        self.device = next(model.parameters()).device
        self.platform = get_platform(self.device)
        self.attn_backend = self.platform.attention_backend()
        # rows enough for the requests of a step and for the profiling forward's sequences
        rows = max(max_num_seqs, -(-max_num_batched_tokens // max_model_len))
        self.max_model_len, self.max_step_tokens = max_model_len, max(max_num_batched_tokens, max_num_seqs)
        self.max_step_seqs = rows
        self.input_batch = InputBatch(rows, max_model_len, self.max_step_tokens, block_size)
        # (a model on the meta device - shapes only, for sizing estimates - samples nothing)
        gen_device = "cpu" if self.device.type == "meta" else self.device
        self.default_generator = torch.Generator(gen_device).manual_seed(seed)
        self.sampler = Sampler(self.default_generator)  # seeded rows need no generator of their own
        self.num_blocks = 0
        self._lm_head_contexts: dict[tuple[int, bool], ForwardContext] = {}  # _compute_logits' by rows, mode
        self._clock = ModelClock(self.device)  # the model time of the run in progress (reset by each run)
        # the last launched step's draw (tokens: a host list or a device tensor) and its sampling requests, in
        # row order: where the next step's ids come from under asynchronous scheduling
        self._last_draw: tuple[list[int] | torch.Tensor, list[ScheduledRequest]] = ([], [])
        # CUDA graphs of decode-only steps (tidal/worker/cuda_graphs.py), where they apply: set by from_config,
        # captured by capture_decode_graphs once the KV cache is allocated
        self.decode_graphs: DecodeGraphs | None = None

    @classmethod
    def from_config(cls, loaded, config, eos_token_ids: tuple[int, ...]) -> ModelRunner:
        """For a LoadedModel (tidal/loader) under an EngineConfig whose max_model_len and
        max_num_batched_tokens the engine has resolved."""
        runner = cls(loaded.model, loaded.dtype, config.block_size, config.seed, eos_token_ids,
                     kv_cache_dtype=kv_cache_torch_dtype(config.kv_cache_dtype, loaded.weight_dtype),
                     max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                     max_num_batched_tokens=config.max_num_batched_tokens)
        runner.batch_invariant = config.batch_invariant
        runner.log_kv_scales()
        why_eager = cuda_graphs.unsupported_reason(runner, config)
        if why_eager is None:
            runner.decode_graphs = DecodeGraphs(runner, cuda_graphs.capture_sizes(config.max_num_seqs))
        elif runner.device.type == "cuda":
            logger.info("CUDA graphs off (every step runs eagerly): %s", why_eager)
        if loaded.quantization == "w8a8":
            from tidal.layers.quantization.smoothing import smooth_w8a8
            smooth_w8a8(runner, loaded)
        if runner.kv_cache_dtype == FP8:
            from tidal.layers.quantization.smoothing import center_fp8_keys
            center_fp8_keys(runner, loaded)
        release_free_heap()
        return runner

    # -- KV cache --------------------------------------------------------------------------------
    def log_kv_scales(self) -> None:
        if self.kv_cache_dtype != FP8 or not self.attn_layers:
            return
        loaded = [a for a in self.attn_layers if a.kv_scales_from_checkpoint]
        if not loaded:
            logger.info("KV cache %s: the checkpoint has no KV-cache scales, so K and V are stored with scale "
                        "1.0 (values beyond +-448 saturate)", describe_kv_cache_dtype(self.kv_cache_dtype))
            return
        scales = [s for a in loaded for s in (a.k_scale, a.v_scale)]
        logger.info("KV cache %s: per-layer K/V scales from the checkpoint for %d of %d attention layers "
                    "(%.4g to %.4g; the others 1.0)", describe_kv_cache_dtype(self.kv_cache_dtype), len(loaded),
                    len(self.attn_layers), min(scales), max(scales))

    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * elem for a in self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks blocks for the scheduler's requests; with decode graphs one more, past them, where the
        graphs' padding rows write (graphs captured over an earlier cache are dropped)."""
        self.num_blocks = num_blocks
        graphs = self.decode_graphs
        if graphs is not None:
            graphs.drop()
        total = num_blocks + (graphs is not None)
        for a in self.attn_layers:
            a.kv_cache = lazy_zeros(kv_cache_shape(total, self.block_size, a.num_kv_heads, a.head_dim),
                                    self.kv_cache_dtype, self.device)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_seqs: int, max_model_len: int, compute_logits: bool = True) -> None:
        """profile_run's forward, as a start-up warm-up before the cache and state exist: the buffers of a
        step of num_tokens written once, so that the first such step of the requests does not write them
        first (on the AMX Xeon guest that first step took ~100 ms longer)."""
        self.profile_run(num_tokens, num_seqs, max_model_len, compute_logits)

    def commit_kv_cache(self) -> int:
        """On CPU, commit the KV cache's memory now (device.commit_pages: a thread per core, a layer's cache
        at a time each), so that no step pays the page faults of its first writes: the bytes committed (0 on
        CUDA, or where the kernel cannot)."""
        caches = self._cpu_kv_caches()
        if not caches:
            return 0
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(caches)))) as pool:
            done = list(pool.map(commit_pages, caches))
        return sum(c.numel() * c.element_size() for c, ok in zip(caches, done) if ok)

    def idle_committer(self, num_blocks: int) -> IdleCommitter | None:
        """On CPU, a background committer of the KV cache's blocks [0, num_blocks) while the engine is idle
        (commit_kv_cache None); None on CUDA or without attention layers. One thread: the other core stays
        free for a server still starting and its first clients (`tidal serve` answered /health 0.1 s later
        on the 2-core AMX Xeon guest with two committing threads, within the noise with one), and one
        thread commits the blocks a benchmark's 64 requests use within a second."""
        caches = self._cpu_kv_caches()
        return IdleCommitter(caches, num_blocks, 1) if caches else None

    def reserve_activations(self, num_tokens: int) -> int:
        """On CPU, the native decoder's activation scratch for a step of num_tokens made and written once on
        this thread (NativeDecoder.reserve), so that the first step that large does not take its page
        faults: the bytes written (0 where no native decoder runs)."""
        if self.device.type != "cpu":
            return 0
        written = 0
        for module in self.model.modules():
            native = module._native_decoder() if hasattr(module, "_native_decoder") else None
            if native is not None:
                written += native.reserve(num_tokens, self.batch_invariant)
        return written

    def _cpu_kv_caches(self) -> list[torch.Tensor]:
        """Every attention layer's KV cache on a CPU (the lazily committed ones); none on CUDA."""
        return [a.kv_cache for a in self.attn_layers if a.kv_cache is not None] if self.device.type == "cpu" else []

    def capture_decode_graphs(self) -> None:
        """Capture the decode graphs over the KV cache just allocated (nothing where graphs do not apply)."""
        if self.decode_graphs is not None and self.num_blocks:
            self.decode_graphs.capture(pad_block=self.num_blocks)

    # -- memory budget of the KV cache and the Mamba state ---------------------------------------
    def cache_budget_bytes(self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                           max_model_len: int, compute_logits: bool = True) -> int:
        """Measured now that the weights are loaded. CPU: min(4 GiB, half the available memory).
        CUDA: gpu_memory_utilization of the GPU less the memory in use and the activation peak of
        one profiling forward as large as the largest step."""
        if self.device.type != "cuda":
            return cache_budget_bytes(None)
        graphs = self.decode_graphs
        graph_profile = None if graphs is None else lambda: self.profile_decode(graphs.max_size)
        return cuda_cache_budget_bytes(self.device, gpu_memory_utilization, lambda: self.profile_run(
            max_num_batched_tokens, max_num_seqs, max_model_len, compute_logits), graph_profile)

    @torch.inference_mode()
    def profile_decode(self, num_seqs: int) -> None:
        """A forward shaped as a decode step of num_seqs requests (one token each), with a throwaway cache: the
        activations the largest decode graph keeps in its memory pool."""
        with self._throwaway_forward([[0]] * num_seqs, "graph-profile"):
            pass

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, max_model_len: int, compute_logits: bool = True) -> None:
        """A forward over num_tokens prompt tokens (fresh sequences of at most max_model_len) with a
        throwaway KV cache and state, then the logits and a top-k/top-p draw for num_seqs rows: the
        memory the largest step needs beside the cache. Leaves no cache bound."""
        lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
        with self._throwaway_forward([[0] * n for n in lens], "profile") as hidden:
            if compute_logits:
                rows = self._on_device(list(range(min(num_seqs, num_tokens))))
                logits = self._compute_logits(hidden[rows])
                draw = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
                Sampler(torch.Generator(self.device).manual_seed(0))(
                    logits, SamplingMetadata.from_params([draw] * len(rows), self.device, logits.shape[-1]))

    @torch.inference_mode()
    def calibration_forward(self, prompts: list[list[int]], inspect=None) -> None:
        """Forwards of fresh prompts (each at most max_model_len tokens), as many per forward as a step
        holds, with a throwaway KV cache and state (the w8a8 smoothing's observers watch them).
        inspect(group), if given, runs after each forward before its cache is dropped: the group's prompt i
        starts at block sum(ceil(len(p) / block_size) for the prompts p before it)."""
        group: list[list[int]] = []
        for p in [*prompts, None]:
            if group and (p is None or sum(map(len, group)) + len(p) > self.max_step_tokens
                          or len(group) == self.max_step_seqs):
                with self._throwaway_forward(group, "calibration"):
                    if inspect is not None:
                        inspect(group)
                group = []
            if p is not None:
                group.append(list(p))

    @contextlib.contextmanager
    def _throwaway_forward(self, prompts: list[list[int]], name: str):
        """A forward over fresh prompts in one step, with a KV cache (and Mamba state) made for them and
        dropped after the block, which gets the hidden states."""
        bs = self.block_size
        lens = [len(p) for p in prompts]
        blocks = [-(-n // bs) for n in lens]
        first_block = [sum(blocks[:i]) for i in range(len(lens))]
        self.allocate_kv_cache(max(1, sum(blocks)))
        if self.mamba_layers:
            self.allocate_state(len(lens))
        params = SamplingParams(max_tokens=1)
        reqs = [ScheduledRequest(f"{name}-{i}", n, 0, False, n, new_token_ids=prompts[i],
                                 new_block_ids=list(range(first_block[i], first_block[i] + blocks[i])),
                                 new=NewRequestData(params, n, i if self.mamba_layers else None))
                for i, n in enumerate(lens)]
        try:
            self.input_batch.update(SchedulerOutput(reqs, sum(lens)))
            step = self.input_batch.prepare(reqs)
            with set_forward_context(self._forward_context(step)):
                hidden = self.model(*self._model_inputs(step))
            yield hidden
        finally:
            for r in reqs:
                self.input_batch.drop(r.request_id)
            for a in self.attn_layers:
                a.kv_cache = None
            for m in self.mamba_layers:
                m.conv_state = m.ssm_state = None
            self.num_blocks = 0

    # -- Mamba state (one slot per running request; a chunk at position 0 starts from zero state) --
    def state_bytes_per_request(self) -> int:
        return sum(m.state_bytes() for m in self.mamba_layers)

    def allocate_state(self, num_slots: int) -> None:
        for m in self.mamba_layers:
            m.allocate_state(num_slots)

    def restore_states(self, reqs: list[ScheduledRequest]) -> None:
        """Prefix-cache hits on Mamba models: copy each hit's state checkpoint into its slot."""
        held = self.input_batch.requests
        pairs = [(held[r.request_id].state_slot, r.state_restore_from) for r in reqs
                 if r.state_restore_from is not None]
        if pairs:
            dst, src = (to_device(torch.tensor(ids), self.device) for ids in zip(*pairs))
            for m in self.mamba_layers:
                m.conv_state[dst] = m.conv_state[src]
                m.ssm_state[dst] = m.ssm_state[src]

    # -- one step --------------------------------------------------------------------------------
    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's deltas (new requests, appended tokens and blocks, finished ones)."""
        self.input_batch.update(so)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """One step: execute_async, then its result."""
        return self.execute_async(so).result()

    def execute_async(self, so: SchedulerOutput) -> PendingStep:
        """A step up to the read-back of its tokens: on CUDA the host is free while the GPU runs it, and the
        step's tokens stay on the device for the next step (SchedulerOutput.from_last_step) until result()
        reads them (asynchronous scheduling); on CPU the step has run when this returns. Under
        torch.inference_mode: the caller's where its loop holds it for all its steps (as LLM.generate and
        the engine thread do: entering the guard is no longer a per-step cost), else torch's own guard."""
        if torch.is_inference_mode_enabled():
            return self._launch_step(so)
        with torch._C._InferenceMode(True):  # torch.inference_mode's own guard, without its Python wrapper
            return self._launch_step(so)

    def _launch_step(self, so: SchedulerOutput) -> PendingStep:
        self.update_states(so)
        self.restore_states(so.scheduled)
        return self.launch(so.scheduled, so)

    def run(self, scheduled: list[ScheduledRequest], so: SchedulerOutput | None = None,
            compute_logits: bool = True) -> RunnerOutput:
        """Forward and sample `scheduled` (all or part of a step whose deltas update_states applied), under
        torch.inference_mode (the caller's). compute_logits False: only the forward (a pipeline stage before
        the last)."""
        return self.launch(scheduled, so, compute_logits).result()

    def launch(self, scheduled: list[ScheduledRequest], so: SchedulerOutput | None = None,
               compute_logits: bool = True) -> PendingStep:
        """run() up to the read-back: the forward and the draw queued, their tokens left on the device."""
        if not scheduled:
            return PendingStep()
        self._clock.reset()
        step = self.input_batch.prepare(scheduled)
        fill = self._ids_from_last_step(step, so.from_last_step) if so is not None and so.from_last_step else None
        # rows whose logits we need: each sampling request's last known token and its drafts
        reqs, starts = step.reqs, step.query_start_loc
        sample_reqs = [(i, r) for i, r in enumerate(reqs) if r.sample]
        if step.num_decodes == step.num_tokens == len(sample_reqs):  # decodes only, no drafts: every row
            rows = range(step.num_tokens)
        else:
            rows = []
            for i, r in sample_reqs:
                k = len(r.spec_token_ids)
                first = int(starts[i + 1]) - 1 - k
                rows.extend(range(first, first + k + 1))
        want_prompt_logprobs = ([i for i, r in enumerate(reqs) if self._wants_prompt_logprobs(r)] if compute_logits
                                else [])
        # the model may leave out the other rows' last layer when nothing reads them (ForwardContext.output_rows)
        output_rows = (rows if compute_logits and not want_prompt_logprobs and len(rows) < step.num_tokens
                       else None)
        graphs = self.decode_graphs
        if graphs is not None and graphs.takes(step):  # a decode-only step: its CUDA graph
            with self._clock.timed():
                hidden = graphs.run(step, fill)
        else:
            input_ids, positions = self._model_inputs(step)
            if fill is not None:
                input_ids.index_copy_(0, *fill)  # (on CPU the step's staging buffer, rewritten every step)
            ctx = self._forward_context(step)
            ctx.output_rows = output_rows
            with set_forward_context(ctx), self._clock.timed():
                hidden = self.model(input_ids, positions)  # [num_tokens or len(output_rows), hidden]
        if not compute_logits:  # a pipeline stage before the last: the executor times the whole pipeline
            return PendingStep()

        out = PendingStep(sample_reqs=[r for _, r in sample_reqs])
        drawn = []
        if rows:
            # every token samples (decodes), or the model returned only those rows: no gather
            picked = hidden if hidden.shape[0] == len(rows) else hidden[self._on_device(list(rows))]
            greedy = self._plain_greedy(so, out.sample_reqs)
            if greedy and (tokens := self._greedy_tokens(picked)) is not None:
                drawn, out.drawn = tokens, tokens
            else:
                logits = self._compute_logits(picked)
                meta = self._sampling_metadata(so, out.sample_reqs, logits.shape[-1], greedy)
                drawn, raw_logprobs = self.sampler.sample(logits, meta)
                out.num_logprobs = meta.num_logprobs
                out.drawn = drawn if isinstance(drawn, list) else HostCopy(
                    read_back_tensors(drawn, raw_logprobs, meta.num_logprobs))
        self._last_draw = (drawn, out.sample_reqs)
        for i in want_prompt_logprobs:
            r = reqs[i]
            out.prompt_logprobs[r.request_id] = self._prompt_logprobs(r, hidden, int(starts[i]))
        out.clock = self._clock.detach()
        return out

    def _ids_from_last_step(self, step: StepInputs, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the step, token ids) for the requests whose input is the token the last launched step drew
        for them, not yet read back: taken from that draw where it is (on the device)."""
        drawn, last_reqs = self._last_draw  # (no drafts: the config refuses them with async scheduling)
        where = {r.request_id: j for j, r in enumerate(last_reqs)}
        index = {r.request_id: i for i, r in enumerate(step.reqs)}
        try:
            src = [where[rid] for rid in request_ids]
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]}'s input is to come from the last step, which did not "
                               "sample for it") from None
        dst = self._on_device([int(step.query_start_loc[index[rid]]) for rid in request_ids])
        if isinstance(drawn, list):
            return dst, self._on_device([drawn[j] for j in src])
        return dst, drawn.index_select(0, self._on_device(src))

    def _model_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(step.input_ids, self.device), to_device(step.positions, self.device)

    def _forward_context(self, step: StepInputs) -> ForwardContext:
        reqs, nd = step.reqs, step.num_decodes
        ctx = ForwardContext(num_tokens=step.num_tokens, num_decodes=nd, query_start_loc=step.query_start_loc.tolist(),
                             skinny_gemm=nd == len(reqs), batch_invariant=self.batch_invariant)
        if self.attn_layers:
            ctx.attn_backend = self.attn_backend
            ctx.attn_metadata = self.attn_backend.build(step, self.device)
        if self.mamba_layers:
            held = self.input_batch.requests
            ctx.state_slots = self._on_device([held[r.request_id].state_slot for r in reqs])
            ctx.has_initial_state = self._on_device([r.start_pos > 0 for r in reqs])
            ctx.fresh_decodes = any(r.start_pos == 0 for r in reqs[:nd])
            ctx.state_checkpoints = [(i, *r.state_checkpoint) for i, r in enumerate(reqs) if r.state_checkpoint] or None
        return ctx

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over the rows that sample: one row per request (or per draft), never a prompt's
        other rows, so the skinny GEMM may take them (see ForwardContext.skinny_gemm). In the model's
        dtype: the sampler widens them where it needs to."""
        with set_forward_context(self._lm_head_context(hidden.shape[0])), self._clock.timed():
            return self.model.compute_logits(hidden)

    def _greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Rows that only need an argmax: the model's LM head finds it as it computes the logits where its
        kernel can (the same tokens as the sampler's argmax of _compute_logits); None elsewhere."""
        fused = getattr(self.model, "compute_greedy_tokens", None)
        if fused is None:
            return None
        with set_forward_context(self._lm_head_context(hidden.shape[0])), self._clock.timed():
            return fused(hidden)

    def _lm_head_context(self, n: int) -> ForwardContext:
        invariant = self.batch_invariant
        ctx = self._lm_head_contexts.get((n, invariant))
        if ctx is None:  # the layers only read it: one per row count
            ctx = self._lm_head_contexts[n, invariant] = ForwardContext(n, n, [], skinny_gemm=True,
                                                                        batch_invariant=invariant)
        return ctx

    @staticmethod
    def _grammar_rows(so: SchedulerOutput | None, sample_reqs: list[ScheduledRequest]):
        """(bitmask, logits rows it applies to) for the sampling requests with a grammar, or None."""
        if so is None or so.grammar_bitmask is None:
            return None
        where = {rid: j for j, rid in enumerate(so.grammar_request_ids)}
        pairs, row = [], 0
        for r in sample_reqs:
            if r.request_id in where:
                pairs.append((row, where[r.request_id]))
            row += 1 + len(r.spec_token_ids)
        if not pairs:
            return None
        rows, mask_rows = zip(*pairs)
        return so.grammar_bitmask[list(mask_rows)], list(rows)

    def _on_device(self, values: list) -> torch.Tensor:
        """A list of ints (or bools) as a tensor on the device (int64 for ints, as torch.tensor makes it)."""
        return to_device(torch.tensor(values), self.device)

    def _plain_greedy(self, so: SchedulerOutput | None, sample_reqs: list[ScheduledRequest]) -> bool:
        """Whether every row only needs an argmax: greedy requests without logprobs or penalties, past their
        min_tokens (no banned ids), no grammar."""
        requests = self.input_batch.requests
        return (so is None or so.grammar_bitmask is None) and all(
            (st := requests[r.request_id]).plain_greedy and st.sampling_params.min_tokens
            <= r.start_pos + r.num_tokens - len(r.spec_token_ids) - st.num_prompt_tokens for r in sample_reqs)

    def _sampling_metadata(self, so: SchedulerOutput | None, sample_reqs: list[ScheduledRequest],
                           vocab_size: int, plain_greedy: bool) -> SamplingMetadata:
        """One row per token drawn (plain_greedy: _plain_greedy's answer for them): for each sampling
        request, after its last known token, then after each of its drafts. A row's draw index is the number
        of output tokens before it, which with a seed fixes its noise; its penalties see the drafts before it
        as outputs."""
        batch = self.input_batch
        if plain_greedy:
            return SamplingMetadata.plain_greedy(sum(1 + len(r.spec_token_ids) for r in sample_reqs), self.device)
        params, draw_index, banned, prompts, outputs = [], [], [], [], []
        penalised = False
        for r in sample_reqs:
            state = batch.requests[r.request_id]
            p, n_prompt = state.sampling_params, state.num_prompt_tokens
            num_output = r.start_pos + r.num_tokens - len(r.spec_token_ids) - n_prompt
            stop_ids = list(p.stop_token_ids) + (list(self.eos_token_ids) if not p.ignore_eos else [])
            known = batch.tokens(r.request_id).tolist() if p.has_penalties else None
            penalised |= known is not None
            for j in range(len(r.spec_token_ids) + 1):
                params.append(p)
                draw_index.append(num_output + j)
                banned.append(stop_ids if num_output + j < p.min_tokens else [])
                prompts.append(known[:n_prompt] if known is not None else [])
                outputs.append(known[n_prompt:] + r.spec_token_ids[:j] if known is not None else [])
        return SamplingMetadata.from_params(
            params, self.device, vocab_size, prompt_token_ids=prompts if penalised else None,
            output_token_ids=outputs if penalised else None, banned_token_ids=banned, draw_index=draw_index,
            grammar=self._grammar_rows(so, sample_reqs))

    def _wants_prompt_logprobs(self, r: ScheduledRequest) -> bool:
        state = self.input_batch.requests[r.request_id]
        return state.sampling_params.prompt_logprobs is not None and r.start_pos < state.num_prompt_tokens - 1

    def _prompt_logprobs(self, r: ScheduledRequest, hidden: torch.Tensor,
                         q_start: int) -> list[PromptTokenLogprobs]:
        """Logprobs of the prompt tokens this chunk predicts: position p predicts token p + 1."""
        state = self.input_batch.requests[r.request_id]
        n_prompt = state.num_prompt_tokens
        positions = [p for p in range(r.start_pos, r.start_pos + r.num_tokens) if p + 1 < n_prompt]
        if not positions:
            return []
        rows = [q_start + p - r.start_pos for p in positions]
        prompt = self.input_batch.tokens(r.request_id)
        targets = [int(prompt[p + 1]) for p in positions]
        logits = self._compute_logits(hidden[self._on_device(rows)])
        k = state.sampling_params.prompt_logprobs
        return prompt_logprobs(logits, self._on_device(targets), k, [p + 1 for p in positions])
