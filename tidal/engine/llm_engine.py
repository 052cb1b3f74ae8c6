"""LLMEngine: the one loop. add_request / step / abort_request.

    while engine.has_unfinished_requests():
        outputs = engine.step()   # schedule -> execute -> update

A request with n > 1 samples runs as n child requests that share the prompt's KV blocks through
the prefix cache; the output processor gathers them back into one RequestOutput.

With async_scheduling a step() queues one step and then reads the previous one:

    schedule N+1 -> launch N+1 -> read N's tokens -> update (stops) -> outputs of N

so on CUDA the GPU has step N + 1 queued while the host reads, detokenizes and streams step N. The
scheduler counts step N's tokens as pending (tidal/core/scheduler.py) and step N + 1 takes their ids
from step N's draw on the device. A step waits for the previous one first when one of its requests needs
that token on the host before it samples again: penalties (they count it) and grammars (its bitmask
follows it).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import NamedTuple

from tidal.config import EngineConfig, step_tokens_default
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler, SchedulerOutput
from tidal.core.state_checkpoints import StateCheckpoints
from tidal.core.state_pool import StatePool
from tidal.engine.output_processor import OutputProcessor
from tidal.engine.stats import EngineStats, StatsLogger
from tidal.engine.stop_checker import append_tokens
from tidal.layers.attention.kv_cache_dtype import describe_kv_cache_dtype, kv_cache_torch_dtype
from tidal.loader import load_model
from tidal.loader.loader import load_generation_config
from tidal.outputs import RequestOutput
from tidal.platforms import get_platform
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams
from tidal.spec_decode import speculation
from tidal.spec_decode.policy import DraftPolicy
from tidal.structured_outputs.manager import StructuredOutputManager
from tidal.worker.executor import UniProcExecutor, WorkerError, create_executor, load_model_meta, uses_workers
from tidal.worker.memory import plan_kv_cache, plan_state_slots
from tidal.worker.model_runner import ModelRunner, PendingStep

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class _Launched(NamedTuple):
    """A step launched under asynchronous scheduling, not yet read."""
    batch: SchedulerOutput
    step: PendingStep
    needs_tokens: bool  # a request it samples for needs that token on the host before its next step
    launched_at: float  # perf_counter


class StepError(RuntimeError):
    """The model failed in one step. The engine aborted that step's requests (their KV was left half
    written) and is otherwise intact: it can go on serving the rest. `request_ids` are the aborted
    requests (as given to add_request), `outputs` their final (aborted) RequestOutputs."""

    def __init__(self, cause: BaseException, request_ids: list[str], outputs: list[RequestOutput]) -> None:
        super().__init__(f"the model failed in a step ({type(cause).__name__}: {cause}); its "
                         f"{len(request_ids)} request(s) were aborted")
        self.request_ids, self.outputs = request_ids, outputs


def resolve_eos_token_ids(tokenizer, model_config, generation_config: dict, vocab_size: int) -> tuple[int, ...]:
    """Every id that ends a turn, as vLLM stops on them all: the tokenizer's eos, then the
    `eos_token_id` of generation_config.json and of config.json (each an int or a list; e.g.
    Llama-3 instruct lists <|eot_id|> and <|eom_id|>), in that order, without repeats.

        >>> from types import SimpleNamespace as NS
        >>> resolve_eos_token_ids(NS(eos_token_id=2), NS(eos_token_id=[2, 7]), {"eos_token_id": 5}, 100)
        (2, 5, 7)
    """
    found = [getattr(tokenizer, "eos_token_id", None)]
    for eos in (generation_config.get("eos_token_id"), getattr(model_config, "eos_token_id", None)):
        found.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    ids: list[int] = []
    for t in found:
        if not isinstance(t, int) or isinstance(t, bool) or t in ids:
            continue
        if 0 <= t < vocab_size:
            ids.append(t)
        else:  # the sampler masks stop ids by index (min_tokens): one outside the logits cannot be used
            logger.warning("ignoring EOS token id %d: outside the vocabulary [0, %d)", t, vocab_size)
    return tuple(ids)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off inside the block (restored after): loading a model allocates hundreds of
    thousands of objects that all live on, and the full collections they set off took 0.5-0.8 s of an
    `LLM()`'s 2.2-2.5 s (docs/cpu.md, "Start-up"). Reference counting still frees what dies meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class LLMEngine:
    def __init__(self, config: EngineConfig, offline: bool = False) -> None:
        """offline: the engine of the offline `LLM` (its default step budget is vLLM's for that use)."""
        self.offline = offline
        with gc_paused():
            self._start(config)

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        workers = uses_workers(config)  # tensor/pipeline parallel: the weights live in worker processes
        self._log_accepted_flags()
        loaded = load_model_meta(config) if workers else load_model(
            config.model, config.dtype, quantization=config.quantization, device=config.device,
            tokenizer=config.tokenizer, tokenizer_mode=config.tokenizer_mode, load_format=config.load_format)
        self.model_name = config.served_model_name or loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype  # activations
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, loaded.weight_dtype)
        self.quantization = loaded.quantization  # the scheme the weights are stored in (None: plain)
        if config.batch_invariant and self.quantization is not None:  # quantized by its checkpoint
            if not config.batch_invariant_auto and (why := self._invariance_unsupported()):
                raise ValueError(f"batch_invariant=True {why}")
            # on by default for plain weights only: GGUF blocks run it when asked, at a cost to a single
            # stream (docs/batch_invariance.md)
            config.batch_invariant = not config.batch_invariant_auto
        hf = loaded.config
        self.vocab_size = hf.vocab_size
        self.max_model_len = self._max_model_len(hf)
        config.max_model_len = self.max_model_len
        self.eos_token_ids = self._eos_token_ids(loaded.path)
        self.max_num_batched_tokens = self._max_num_batched_tokens()
        config.max_num_batched_tokens = self.max_num_batched_tokens  # the workers size their buffers by it
        if workers:  # same interface as a ModelRunner: execute / kv_bytes_per_token / allocate_kv_cache
            self.runner = self.executor = create_executor(config, self.eos_token_ids)
            self.weight_bytes = sum(info.weight_bytes for info in self.executor.worker_infos)  # all ranks
        else:
            self.weight_bytes = loaded.weight_bytes
            self.runner = ModelRunner.from_config(loaded, config, self.eos_token_ids)
            self.executor = UniProcExecutor(self.runner)
        budget = config.kv_cache_memory_bytes
        if budget is None:  # measured now that the weights are loaded (on CUDA, after a profiling forward)
            budget = self.runner.cache_budget_bytes(config.gpu_memory_utilization, self.max_num_batched_tokens,
                                                    config.max_num_seqs, self.max_model_len)
        commit = config.commit_kv_cache and config.device == "cpu"
        if commit:  # the warm-up forward before the cache and state exist (it replaces them)
            t = time.perf_counter()
            self.runner.warm_up(self.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)
            warm_s = time.perf_counter() - t
        state_pool, checkpoints, kv_budget = self._plan_state(budget)
        plan = plan_kv_cache(self.runner.kv_bytes_per_token(), config.block_size, self.max_model_len, kv_budget)
        if state_pool is not None and not plan.bytes_per_token:  # no attention: blocks are bookkeeping only,
            plan.num_blocks = max(plan.num_blocks,  # so they must never be what runs out
                                  state_pool.num_slots * -(-self.max_model_len // config.block_size))
        self.runner.allocate_kv_cache(plan.num_blocks)
        if commit:
            self._commit_kv_cache(plan.num_bytes, warm_s)
        if (capture := getattr(self.runner, "capture_decode_graphs", None)) is not None:  # CUDA graphs (a runner's)
            capture()
        self.kv_plan = plan
        # commit_kv_cache None: a server's loop has the cache committed in the background while it is idle
        idle = config.commit_kv_cache is None and config.device == "cpu" and not workers
        self._committer = self.runner.idle_committer(plan.num_blocks) if idle else None
        self._reserved = False  # the activations' scratch made at the first idle moment (set_idle)
        self.kv_manager = KVCacheManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, state_pool=state_pool, state_checkpoints=checkpoints,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        if state_pool is not None:
            self._log_hybrid_plan(plan, state_pool)
        logger.info(get_platform(config.device).describe())
        if config.batch_invariant:
            logger.info("batch-invariant mode: each request's logits do not depend on the other requests of a "
                        "step, its chunking or prefix-cache hits (docs/batch_invariance.md)")
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, list(self.eos_token_ids))
        self.stats = EngineStats()
        self.stats_logger = None if config.disable_log_stats else StatsLogger()
        self._next_id = 0
        self._pending: _Launched | None = None  # asynchronous scheduling: the step launched last, not yet read
        self._last_read = 0.0  # when the last launched step's output was read (perf_counter)
        if config.async_scheduling:
            logger.info("Asynchronous scheduling: each step is scheduled and queued while the previous one runs%s",
                        "" if config.device == "cuda" else " (on a CPU the steps still run one after the other: "
                        "same outputs, no gain)")
        # speculative decoding: an object with propose(request) -> draft token ids for its next tokens
        # (tidal/engine/proposer.py); None runs one token per request per step. The draft policy
        # decides how many of them a step runs (None: all).
        self.proposer = None
        self.draft_policy: DraftPolicy | None = None
        if config.speculative_config is not None:
            try:
                self.proposer, self.draft_policy = speculation.start(config.speculative_config, self)
            except ValueError:
                self.shutdown()
                raise
        logger.info("Engine ready in %.1f s: %s, %s on %s, max_model_len %d, KV cache %s at %d bytes per token: "
                    "%.1f MiB = %d blocks of %d tokens = %d tokens (%.1f requests of max_model_len)",
                    time.perf_counter() - t0, self.model_name, str(self.dtype).removeprefix("torch."), config.device,
                    self.max_model_len, describe_kv_cache_dtype(self.kv_cache_dtype), plan.bytes_per_token,
                    plan.num_bytes / 2**20, plan.num_blocks, config.block_size, plan.num_tokens,
                    plan.num_tokens / self.max_model_len)

    def set_idle(self, idle: bool) -> None:
        """A server's engine loop says whether it has nothing to run. With commit_kv_cache None (the default;
        CPU, no workers) the first idle moment writes the activation scratch of a step as large as the budget
        (on this, the engine's thread), and the KV cache's memory is committed in the background while it has
        nothing to run (device.IdleCommitter), so that the next requests' steps do not pay their first writes'
        page faults."""
        if self._committer is not None:
            if idle and not self._reserved:  # first: the activations of a step as large as the budget
                self._reserved = True
                self._reserve_activations()
            self._committer.set_idle(idle)

    def _reserve_activations(self) -> None:
        t = time.perf_counter()
        written = self.runner.reserve_activations(self.max_num_batched_tokens)
        if written:
            logger.info("Activation memory of a %d-token step written while the engine was idle: %.1f MiB in %.3f s",
                        self.max_num_batched_tokens, written / 2**20, time.perf_counter() - t)

    # -- setup helpers ---------------------------------------------------------------------------
    def _commit_kv_cache(self, num_bytes: int, warm_s: float) -> None:
        """commit_kv_cache: the KV cache's memory faulted in now, not in the steps that first write it (and,
        before it, warm_s seconds of a warm-up forward as large as a step)."""
        t = time.perf_counter()
        committed = self.runner.commit_kv_cache()
        if committed:
            logger.info("KV cache memory committed: %.1f MiB in %.2f s (after a %d-token warm-up forward: %.2f s)",
                        committed / 2**20, time.perf_counter() - t, self.max_num_batched_tokens, warm_s)
        elif num_bytes:
            logger.warning("KV cache memory not committed at start-up: this kernel cannot fault pages in ahead "
                           "(MADV_POPULATE_WRITE, Linux 5.14); they are committed as requests first write them")

    def _log_accepted_flags(self) -> None:
        """Flags accepted for vLLM compatibility whose effect is nil here: say so once."""
        if self.config.trust_remote_code:
            logger.info("trust_remote_code: Tidal never runs code from a checkpoint; its own implementations of "
                        "the supported architectures load the weights")
        if self.config.device == "cpu" and self.config.gpu_memory_utilization != 0.9:
            logger.warning("gpu_memory_utilization %s has no effect on CPU: the KV cache gets min(4 GiB, half the "
                           "free memory); set kv_cache_memory_bytes to size it", self.config.gpu_memory_utilization)
        if self.config.device != "cpu" and self.config.commit_kv_cache:
            logger.warning("commit_kv_cache has no effect on %s: the KV cache's memory is allocated whole at "
                           "start-up there; it commits a CPU cache", self.config.device)

    def _max_num_batched_tokens(self) -> int:
        """The token budget of a step: as given, else max(base, max_num_seqs), base being vLLM's default on
        the device: 4096 for the offline `LLM` on a CPU (fewer, larger prompt steps: 64 prompts of 256 ->
        128 tokens 6% faster than with 2048, docs/cpu.md), 2048 otherwise (a server, and any CUDA engine).
        Without chunked prefill (as vLLM) at least max_model_len, so that any prompt fits one step whole."""
        c = self.config
        base = step_tokens_default(c.device == "cpu", self.offline)
        if c.enable_chunked_prefill:
            return c.max_num_batched_tokens or max(base, c.max_num_seqs)
        if c.max_num_batched_tokens is None:
            return max(base, c.max_num_seqs, self.max_model_len)
        if c.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({c.max_num_batched_tokens}) is smaller than max_model_len "
                             f"({self.max_model_len}) with enable_chunked_prefill=False: without chunked prefill "
                             "a prompt is computed whole in one step, so a long one could never run. Raise "
                             "max_num_batched_tokens, lower max_model_len or enable chunked prefill")
        return c.max_num_batched_tokens

    def _plan_state(self, budget: int):
        """Models with Mamba layers: state slots (one per running request) come out of the same
        budget as the KV cache; with prefix caching, as many again hold state checkpoints (see
        tidal/core/state_checkpoints.py). Returns (pool, checkpoints, budget left for the KV cache)."""
        state_bytes = getattr(self.runner, "state_bytes_per_request", lambda: 0)()
        if not state_bytes:
            return None, None, budget
        per_slot = state_bytes * (2 if self.config.enable_prefix_caching else 1)
        num_slots = plan_state_slots(per_slot, self.config.max_num_seqs, budget,
                                     self.runner.kv_bytes_per_token() > 0)
        checkpoints = None
        if self.config.enable_prefix_caching:
            checkpoints = StateCheckpoints(first_index=num_slots, num_checkpoints=num_slots)
            logger.info("Prefix caching with Mamba layers: a hit restores attention KV and a checkpoint of the "
                        "Mamba state (%d checkpoints of %d bytes, taken at each prompt's last full block)",
                        num_slots, state_bytes)
        self.runner.allocate_state(num_slots * (2 if checkpoints else 1))
        return StatePool(num_slots), checkpoints, budget - num_slots * per_slot

    def _log_hybrid_plan(self, plan, pool: StatePool) -> None:
        state_bytes = self.runner.state_bytes_per_request()
        fit_kv = plan.num_tokens // self.max_model_len if plan.bytes_per_token else pool.num_slots
        logger.info("Hybrid cache: KV %d bytes per token (attention layers only), state %d bytes per request "
                    "(%.1f MiB for %d slots); requests that fit at once: %d (state slots %d, KV for %d of "
                    "max_model_len %d, max_num_seqs %d)", plan.bytes_per_token, state_bytes,
                    pool.num_slots * state_bytes / 2**20, pool.num_slots,
                    min(pool.num_slots, self.config.max_num_seqs, max(fit_kv, 1)), pool.num_slots, fit_kv,
                    self.max_model_len, self.config.max_num_seqs)

    def _invariance_unsupported(self) -> str | None:
        """Why batch-invariant mode cannot run on the loaded quantized weights (None: it can): GGUF blocks
        where their bf16 tile kernel runs (bf16 activations on AVX-512 BF16)."""
        if self.quantization == "gguf":
            from tidal.layers.gguf_kernels import invariant_supported
            if invariant_supported(self.dtype):
                return None
            return (f"runs GGUF blocks with bf16 activations on a CPU with AVX-512 BF16 only (here: {self.dtype}, "
                    "CPU kernels of another level); quantization='none' dequantizes the file at load")
        return (f"runs plain weights or GGUF blocks: this checkpoint's quantization {self.quantization!r} is not "
                "supported with it (its kernels are not batch-invariant)")

    def _max_model_len(self, hf) -> int:
        limit = getattr(hf, "max_position_embeddings", None) or 2048
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", True):
            limit = min(limit, window)  # attention over a sliding window is not implemented: stay inside it
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit and getattr(hf, "model_type", "") != "mamba":
            # (Mamba has no positions: 2048 is only its default length, not a limit)
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit of {limit} "
                             "positions")
        return self.config.max_model_len

    def _eos_token_ids(self, path: str) -> tuple[int, ...]:
        ids = resolve_eos_token_ids(self.tokenizer, self.model_config, load_generation_config(path), self.vocab_size)
        names = [self.tokenizer.convert_ids_to_tokens(t) for t in ids] if self.tokenizer is not None else []
        logger.info("EOS token ids: %s%s", list(ids) or "none (outputs end at max_tokens or max_model_len)",
                    f" {names}" if names else "")
        return ids

    # -- requests --------------------------------------------------------------------------------
    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text, token ids). Raises ValueError before anything is queued."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            ids = self.tokenizer.encode(text) if text else []
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})")
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        """Checks of sampling params that need the model (SamplingParams checks the rest at
        construction). Raises ValueError before anything is queued: a bad value found inside a step
        would fail every request sharing the batch."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")  # noqa: TRY004
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        if params.stop and (self.tokenizer is None or not params.detokenize):
            why = "this model has no tokenizer" if self.tokenizer is None else "detokenize is False"
            raise ValueError(f"stop strings need the output text, but {why}: use stop_token_ids")

    def _child_ids(self, request_id: str, n: int) -> list[str]:
        """The scheduler's ids of a request's samples: the request id itself for n = 1; for n > 1,
        request_id#i, renamed (request_id~k#i) where a request already holds such an id. An id is
        never reused while a request or a sample holds it: it would take over their state."""
        def taken(cid: str) -> bool:
            return cid in self.scheduler.requests or cid in self.output_processor.child_to_parent

        if n == 1:
            owner = self.output_processor.child_to_parent.get(request_id)
            if owner is not None and owner[0] != request_id:  # the id of another request's sample
                raise ValueError(f"request_id {request_id!r} is already in use (by sample {owner[1]} of "
                                 f"request {owner[0]!r})")
            if taken(request_id):
                raise ValueError(f"request_id {request_id!r} is already in use")
            return [request_id]
        base, k = request_id, 0
        while any(taken(f"{base}#{i}") for i in range(n)):
            k += 1
            base = f"{request_id}~{k}"
        return [f"{base}#{i}" for i in range(n)]

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a request (its n samples as n child requests). Raises ValueError, queueing nothing,
        for a bad prompt or params, or for a request_id already in use: by a request not finished,
        or by a sample of one (an id like `x#0` while `x` runs with n > 1)."""
        params = params or SamplingParams()
        self.check_params(params)
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.process_prompt(prompt)
        arrival_time = arrival_time or time.time()
        child_ids = self._child_ids(request_id, params.n)
        requests = []
        for i, cid in enumerate(child_ids):
            # sample 0 computes the prompt (and its logprobs, the only ones reported); the others read
            # its blocks from the prefix cache
            p = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            request = Request(cid, ids, p, self.eos_token_ids, arrival_time, cache_salt)
            if p.structured_outputs is not None:
                request.structured = self.structured.start(p.structured_outputs)
            requests.append(request)
        # every id was checked above: neither of these can refuse one now
        self.output_processor.add_request(request_id, text, ids, params, child_ids, arrival_time)
        for request in requests:
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        outs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for cid in self.output_processor.children_of(rid):
                request = self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
                if request is not None:  # scheduled, maybe preempted, since its last token
                    self.output_processor.record_progress(request)
            out = self.output_processor.abort(rid)
            if out is not None:
                self.stats.record_finished(out)
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.config.async_scheduling:
            return self._step_async()
        t0 = time.perf_counter()
        draft_time_s = getattr(self.proposer, "model_time_s", 0.0)  # a draft model's forwards are model time too
        draft_forwards_s = speculation.propose_drafts(self) if self.proposer is not None else 0.0
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            self._wait_for_a_grammar()
        self._add_grammar_bitmask(batch)
        try:
            result = self.runner.execute(batch)
        except WorkerError:
            raise  # the workers are gone: nothing left to recover
        except Exception as e:
            raise self._fail_step(batch, e) from e
        appended = self.scheduler.update(batch, result.sampled, self._append_tokens)  # stops checked here
        if self.proposer is not None:
            speculation.record_drafts(self, batch, result.sampled, time.perf_counter() - t0 - draft_forwards_s)
        outputs = self._process_outputs(batch, result, appended)
        model_time_s = result.model_time_s + getattr(self.proposer, "model_time_s", 0.0) - draft_time_s
        self.stats.record_step_time(time.perf_counter() - t0, model_time_s)
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(self)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """One step under asynchronous scheduling (see the module's docstring): launch the next step, then read
        the one launched before it. Returns that one's outputs."""
        pending, self._pending, outputs = self._pending, None, []
        if pending is not None and pending.needs_tokens:  # the next step needs its tokens on the host first
            outputs, pending = self._finish_async(pending), None
        batch = self.scheduler.schedule()
        if not batch.scheduled and (batch.finished_ids or batch.preempted_ids):
            # no launch carries these deltas to the runner: it drops the requests now, or their input-batch
            # rows would stay held (an engine polled while idle would run out of rows)
            self.runner.update_states(batch)
        if not batch.scheduled and pending is None:
            self._wait_for_a_grammar()
        launched = None
        if batch.scheduled:
            self._add_grammar_bitmask(batch)
            try:
                launched = self._launch(batch)
            except WorkerError:
                raise
            except Exception as e:
                if pending is not None:  # its tokens stand (for the requests this failure does not abort)
                    outputs += self._finish_async(pending)
                error = self._fail_step(batch, e)
                error.outputs = outputs + error.outputs
                raise error from e
        if pending is not None:
            try:
                outputs += self._finish_async(pending)
            except WorkerError:
                raise
            except Exception as e:  # the next step's inputs came from this one: fail both
                raise self._fail_step([pending.batch] + ([batch] if launched else []), e) from e
        if launched is not None and not self.scheduler.has_unfinished_requests():
            self._finish_async(launched)  # all its requests ended with the step before: nothing to report
            launched = None
        self._pending = launched
        return outputs

    def _launch(self, batch: SchedulerOutput) -> _Launched:
        requests = self.scheduler.requests
        needs_tokens = any(sr.sample and ((r := requests[sr.request_id]).structured is not None
                                          or r.sampling_params.has_penalties) for sr in batch.scheduled)
        launched_at = time.perf_counter()
        return _Launched(batch, self.runner.execute_async(batch), needs_tokens, launched_at)

    def _finish_async(self, pending: _Launched) -> list[RequestOutput]:
        """Read a launched step's tokens and report them (update, stops, outputs, stats). Its time is from
        the read before it (or its launch, if later) to the end of this one: the steps' times then add up
        to the time the engine was busy, overlapped or not, as the stats' host time (step - model) needs."""
        result = pending.step.result()
        appended = self.scheduler.update(pending.batch, result.sampled, self._append_tokens)
        outputs = self._process_outputs(pending.batch, result, appended)
        now = time.perf_counter()
        self.stats.record_step_time(now - max(pending.launched_at, self._last_read), result.model_time_s)
        self._last_read = now
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(self)
        return outputs

    def _fail_step(self, batch, cause: Exception) -> StepError:
        """Undo a step whose execute raised: its requests' scheduled tokens were never computed, so they are
        aborted, and the prefix cache is reset so that no block they filled (hashed at allocation, its KV not
        valid) is served again; that reset also drops other unused cached blocks (a fault is rare, and the
        reset is the one mechanism that forgets blocks). Requests outside the step, and the blocks they
        hold, are untouched."""
        logger.error("the model failed in a step; aborting its requests", exc_info=cause)
        op = self.output_processor
        batches = batch if isinstance(batch, list) else [batch]
        parents = list(dict.fromkeys(op.child_to_parent.get(sr.request_id, (sr.request_id,))[0]
                                     for b in batches for sr in b.scheduled))
        outputs = self.abort_request(parents)
        self.reset_prefix_cache()
        return StepError(cause, parents, outputs)

    def _wait_for_a_grammar(self) -> None:
        """Nothing to run but requests whose grammars are compiling: wait for one."""
        compiling = [r.structured for r in self.scheduler.waiting if r.structured is not None]
        if compiling:
            self.structured.wait_any(compiling)

    def _append_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """The scheduler's hook for a request's sampled tokens: keep them up to the first stop
        (tidal/engine/stop_checker.py, which extends the sample's text as it goes) and move its
        grammar over exactly the tokens kept."""
        text = self.output_processor.sample_text(request.request_id)
        kept = append_tokens(request, token_ids, self.max_model_len, text)
        if request.structured is not None:
            for token in kept:
                self.structured.accept(request.request_id, request.structured, token)
        return kept

    def _add_grammar_bitmask(self, batch) -> None:
        ids, states = [], []
        for sr in batch.scheduled:
            structured = self.scheduler.requests[sr.request_id].structured
            if sr.sample and structured is not None:
                ids.append(sr.request_id)
                states.append(structured)
        if states:
            batch.grammar_bitmask, batch.grammar_request_ids = self.structured.bitmask(states), ids

    def _process_outputs(self, batch, result, appended: list[tuple[Request, list[int]]]) -> list[RequestOutput]:
        op = self.output_processor
        for cid, entries in result.prompt_logprobs.items():
            if cid in op.child_to_parent:
                op.add_prompt_logprobs(cid, entries)
        parents: dict[str, None] = {}  # ordered set
        for request, token_ids in appended:
            logprobs = result.logprobs.get(request.request_id)  # one entry per sampled token
            parents[op.process_tokens(request, token_ids, logprobs[:len(token_ids)] if logprobs else None)] = None
        outputs = []
        for parent in parents:
            out = op.make_output(parent)
            if out is not None:
                outputs.append(out)
                if out.finished:
                    self.stats.record_finished(out)
        self.stats.record_step(batch, sum(len(t) for _, t in appended), self.scheduler, self.kv_manager)
        return outputs

    # -- misc ------------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the cached blocks no request uses. Returns True when no block is in use, so nothing
        computed before the reset can be served from the cache after it; False (as vLLM) while running
        requests hold blocks: their cached entries stay (their KV is valid and they extend it) and
        their partial blocks enter the cache as they fill."""
        self.kv_manager.reset_prefix_cache()
        if self.scheduler.state_checkpoints is not None:
            self.scheduler.state_checkpoints.reset()
        return self.kv_manager.pool.num_used_blocks == 0

    def check_health(self) -> None:
        """Raises WorkerError if a worker process has died or stopped answering."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop worker processes (also done when the engine is garbage-collected or at exit)."""
        if getattr(self, "_committer", None) is not None:
            self._committer.stop()
        self.structured.shutdown()
        self.executor.shutdown()
