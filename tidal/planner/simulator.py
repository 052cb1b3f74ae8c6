"""The engine's loop in simulated time: the real Scheduler, KVCacheManager, BlockPool and StatePool
(tidal/core/) schedule each step exactly as in `LLMEngine.step`, the cost model says how long the step
takes, and the clock moves by that much. Requests arrive when the clock passes their arrival time
(between steps, as they reach a running engine); each sampling request gets one token per step and
stops at max_tokens through the engine's own stop checker.

    result = simulate(profile, device, requests, EngineSettings(max_num_seqs=256))

`Simulation` keeps the engine between runs: `sim.run(a)` then `sim.run(b)` serves b on the engine a left
(its prefix cache warm), as one server serves a benchmark's successive runs.

The cache is planned as the engine plans it (tidal/worker/memory.py): the budget is the device's
memory x gpu_memory_utilization, less the weights and an activation reserve (or a fixed
kv_cache_memory_bytes, as on CPU); Mamba state slots (doubled with prefix caching, for checkpoints)
take at most half of it, KV blocks the rest.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from tidal.config import max_num_seqs_default, step_tokens_default
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler
from tidal.core.state_checkpoints import StateCheckpoints
from tidal.core.state_pool import StatePool
from tidal.engine.stop_checker import append_tokens
from tidal.planner.cost import CostModel, StepShape
from tidal.planner.devices import Device
from tidal.planner.model import ModelProfile
from tidal.planner.workload import SimRequest
from tidal.request import Request
from tidal.sampling_params import SamplingParams
from tidal.worker.memory import plan_kv_cache, plan_state_slots


@dataclass
class EngineSettings:
    max_num_seqs: int | None = None        # None: the engine's default for the device and use (for_device)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    activation_reserve: float = 4e9        # bytes per device kept for activations (GPUs)
    kv_cache_memory_bytes: int | None = None
    served: bool = False                   # under `tidal serve` (the server's per-step cost), not offline

    def for_device(self, device: Device) -> EngineSettings:
        """These settings with the engine's defaults where they are left open, as the engine takes them on
        the device: max_num_seqs 256, 128 for `tidal serve` on a CPU (tidal.entrypoints.engine_args)."""
        if self.max_num_seqs is not None:
            return self
        return replace(self, max_num_seqs=max_num_seqs_default(device.kind == "cpu", self.served))

    def step_budget(self, max_model_len: int, cpu: bool = False) -> int:
        """The engine's rule (LLMEngine._max_num_batched_tokens), on settings for_device resolved."""
        base = step_tokens_default(cpu, offline=not self.served)
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens or max(base, self.max_num_seqs)
        return max(self.max_num_batched_tokens or 0, base, self.max_num_seqs, max_model_len)


@dataclass
class CachePlan:
    fits: bool
    reason: str = ""
    budget_bytes: int = 0
    num_blocks: int = 0
    num_state_slots: int = 0      # 0: no Mamba layers
    kv_tokens: int = 0


@dataclass
class RequestRecord:
    arrival_time: float
    prompt_len: int
    output_len: int
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class SimResult:
    plan: CachePlan
    records: list[RequestRecord] = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    busy_time: float = 0.0
    start_time: float = 0.0   # the run's time 0 on the simulation's clock (0 but for a later run)
    end_time: float = 0.0
    max_running: int = 0
    peak_kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0


def plan_cache(model: ModelProfile, device: Device, settings: EngineSettings, max_model_len: int) -> CachePlan:
    budget = settings.kv_cache_memory_bytes or device.kv_cache_memory_bytes
    if model.weight_bytes > device.memory_bytes * settings.gpu_memory_utilization:
        return CachePlan(False, f"the weights take {model.weight_bytes / 1e9:.1f} GB per device, more than "
                                f"{settings.gpu_memory_utilization:g} x {device.memory_bytes / 1e9:.0f} GB")
    if budget is None:
        budget = (device.memory_bytes * settings.gpu_memory_utilization - model.weight_bytes
                  - settings.activation_reserve)
    budget = int(budget)
    if budget <= 0:
        return CachePlan(False, f"no memory is left for the cache after {model.weight_bytes / 1e9:.1f} GB of weights "
                                f"and {settings.activation_reserve / 1e9:.1f} GB of activations", budget)
    slots, kv_budget = 0, budget
    try:
        if model.state_bytes_per_request:
            per_slot = model.state_bytes_per_request * (2 if settings.enable_prefix_caching else 1)
            slots = plan_state_slots(per_slot, settings.max_num_seqs, budget, model.kv_bytes_per_token > 0)
            kv_budget = budget - slots * per_slot
        kv = plan_kv_cache(model.kv_bytes_per_token, settings.block_size, max_model_len, kv_budget)
    except ValueError as e:
        return CachePlan(False, str(e), budget)
    num_blocks = kv.num_blocks
    if slots and not kv.bytes_per_token:
        num_blocks = max(num_blocks, slots * -(-max_model_len // settings.block_size))
    return CachePlan(True, "", budget, num_blocks, slots, num_blocks * settings.block_size)


def _sampled_token(request: Request) -> int:
    # distinct across requests and positions, so generated blocks are shared only between identical streams
    return (int(request.request_id) * 7919 + request.num_tokens) % 256


def _shared_kv_tokens(kv: KVCacheManager, scheduled, block_size: int) -> int:
    """KV tokens the step's attention reads from a block another request of the step reads too (the
    same physical block: a cached prefix), counted from the second reader on."""
    seen: set[int] = set()
    shared = 0
    for sr in scheduled:
        end = sr.start_pos + sr.num_tokens
        for j, block in enumerate(kv.get_block_ids(sr.request_id)[:-(-end // block_size)]):
            if block in seen:
                shared += min(block_size, end - j * block_size)
            else:
                seen.add(block)
    return shared


class Simulation:
    """One simulated engine: its cache plan, KV blocks, state slots and scheduler, and a clock. `run` serves
    a set of requests to the end; a later `run` on the same simulation finds the engine as the earlier one
    left it (the prefix cache holds the blocks of the prompts it served, as a server's does between two
    benchmark runs), its clock where that run ended."""

    def __init__(self, model: ModelProfile, device: Device, settings: EngineSettings | None = None) -> None:
        self.settings = settings = (settings or EngineSettings()).for_device(device)
        self.max_model_len = min(settings.max_model_len or model.max_model_len, model.max_model_len)
        self.plan = plan = plan_cache(model, device, settings, self.max_model_len)
        self.now = 0.0
        self._next_id = 0
        if not plan.fits:
            return
        self.kv = KVCacheManager(plan.num_blocks, settings.block_size, settings.enable_prefix_caching)
        pool = StatePool(plan.num_state_slots) if plan.num_state_slots else None
        checkpoints = StateCheckpoints(plan.num_state_slots, plan.num_state_slots) \
            if pool is not None and settings.enable_prefix_caching else None
        budget = settings.step_budget(self.max_model_len, device.kind == "cpu")
        self.scheduler = Scheduler(self.kv, settings.max_num_seqs, budget,
                                   self.max_model_len, state_pool=pool, state_checkpoints=checkpoints,
                                   enable_chunked_prefill=settings.enable_chunked_prefill)
        self.cost = CostModel(model, device, settings.served)

    def run(self, requests: list[SimRequest], start: float | None = None) -> SimResult:
        """Serve `requests` to the end; their arrival times count from `start` (default: the clock now, 0
        for a fresh simulation). The result's records are in the order of `requests`, its times (arrival,
        first token, finish, end) on the simulation's clock."""
        result = SimResult(self.plan)
        if not self.plan.fits:
            return result
        max_model_len, settings, scheduler, kv = self.max_model_len, self.settings, self.scheduler, self.kv
        for i, r in enumerate(requests):
            if len(r.prompt_token_ids) + r.max_tokens > max_model_len:
                raise ValueError(f"request {i}: {len(r.prompt_token_ids)} prompt + {r.max_tokens} output tokens "
                                 f"exceed max_model_len {max_model_len}")
        base = self.now if start is None else start
        now = self.now = max(self.now, base)
        result.start_time = base
        sent = [base + r.arrival_time for r in requests]
        # served: a request reaches the engine the server's first-token latency after it is sent (its way in
        # and its first chunk's way out, counted before the engine); its latencies count from the send
        latency = self.cost.device.serve_first_token_latency if settings.served else 0.0
        arrivals = [t + latency for t in sent]
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        records = [RequestRecord(sent[i], len(r.prompt_token_ids), r.max_tokens) for i, r in enumerate(requests)]
        first_id, self._next_id = self._next_id, self._next_id + len(requests)
        live: dict[str, Request] = {}
        nxt = 0
        preemptions, hits, queries = scheduler.num_preemptions, kv.prefix_hits, kv.prefix_queries
        scheduler_log = logging.getLogger("tidal.core.scheduler")
        level = scheduler_log.level
        scheduler_log.setLevel(logging.ERROR)  # a preemption is counted here, not logged once per event
        try:
            while nxt < len(order) or scheduler.has_unfinished_requests():
                if not scheduler.has_unfinished_requests() and arrivals[order[nxt]] > now:
                    now = arrivals[order[nxt]]  # idle until the next arrival
                while nxt < len(order) and arrivals[order[nxt]] <= now:
                    i = order[nxt]
                    r = requests[i]
                    req = Request(str(first_id + i), r.prompt_token_ids,
                                  SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), arrival_time=arrivals[i])
                    live[req.request_id] = req
                    scheduler.add_request(req)
                    nxt += 1
                batch = scheduler.schedule()
                if not batch.scheduled:
                    if nxt < len(order):
                        now = max(now, arrivals[order[nxt]])
                        continue
                    raise RuntimeError("the scheduler can run none of the waiting requests")
                shape = StepShape.of([(sr.num_tokens, sr.start_pos, sr.sample) for sr in batch.scheduled],
                                     _shared_kv_tokens(kv, batch.scheduled, settings.block_size))
                dt = self.cost.step_time(shape)
                now += dt
                result.busy_time += dt
                result.num_steps += 1
                result.max_running = max(result.max_running, scheduler.num_running)
                result.peak_kv_usage = max(result.peak_kv_usage, kv.pool.usage())
                sampled = {sr.request_id: [_sampled_token(live[sr.request_id])] for sr in batch.scheduled
                           if sr.sample}
                scheduler.update(batch, sampled, lambda req, toks: append_tokens(req, toks, max_model_len))
                for rid in sampled:
                    req, rec = live[rid], records[int(rid) - first_id]
                    if rec.first_token_time is None:
                        rec.first_token_time = now
                    if req.is_finished:
                        rec.finish_time = now
                        rec.num_preemptions = req.num_preemptions
                        rec.num_cached_tokens = max(req.num_cached_tokens, 0)
                        del live[rid]
        finally:
            scheduler_log.setLevel(level)
            self.now = now
        result.records = records
        result.num_preemptions = scheduler.num_preemptions - preemptions
        result.end_time = now
        queries = kv.prefix_queries - queries
        result.prefix_hit_rate = (kv.prefix_hits - hits) / queries if queries else 0.0
        return result


def simulate(model: ModelProfile, device: Device, requests: list[SimRequest],
             settings: EngineSettings | None = None) -> SimResult:
    """`requests` on a fresh engine (an empty cache), from time 0."""
    return Simulation(model, device, settings).run(requests)
