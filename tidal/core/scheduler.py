"""Scheduler: iteration-level continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests are served first, in admission order, so decodes keep flowing;
then waiting requests are admitted first-come-first-served while budget, KV blocks (and state
slots, for Mamba layers) last. A prompt longer than the remaining budget is split into chunks
across steps (chunked prefill); with `enable_chunked_prefill=False` a prompt (what the prefix cache
does not hold of it) is scheduled whole in one step, and the queue waits until a step has the budget
for it (the engine makes the budget at least max_model_len, so every prompt fits an empty step).
When a running request cannot get a block, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed.
No request is ever dropped.

A request's computed tokens advance when a step is scheduled, not when it returns. Under asynchronous
scheduling (`async_scheduling=True`) the engine schedules step N + 1 while step N runs: a request that
step N samples for counts that token as pending (`Request.num_pending_tokens`), so step N + 1 computes
it at the next position, its id taken on the device from step N's draw (`SchedulerOutput.from_last_step`);
`update` appends it when step N's output is read. A request whose pending token may end its output by
length (max_tokens, max_model_len) waits for it instead of computing a token past the end.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.state_checkpoints import StateCheckpoints
from tidal.core.state_pool import StatePool
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class NewRequestData:
    """What the workers keep for a request they have not seen (sent once, at admission or again
    after a preemption); its tokens and blocks come in the ScheduledRequest's deltas."""
    sampling_params: SamplingParams
    num_prompt_tokens: int
    state_slot: int | None = None


@dataclass
class ScheduledRequest:
    """One request's share of a step, as sent to the workers: no Request object and no whole token or
    block lists. The workers hold each running request's tokens and block table (tidal/worker/
    input_batch.py) and apply these deltas first, so a step costs a few integers per request."""
    request_id: str
    num_tokens: int               # tokens whose KV this step computes (known tokens, then any drafts)
    start_pos: int                # num_computed_tokens before this step
    sample: bool                  # the step reaches the last known token: sample the next one(s)
    num_prompt_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)   # appended to the workers' copy first
    new_block_ids: list[int] = field(default_factory=list)   # appended to the workers' block table first
    new: NewRequestData | None = None  # set when the workers do not hold the request yet
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens, the last len() of num_tokens
    # blocks the workers drop from the end of their block table before new_block_ids are appended:
    # blocks that held only rejected drafts, returned to the pool (see Scheduler.update)
    num_rolled_back_blocks: int = 0
    state_restore_from: int | None = None  # copy this Mamba state checkpoint into the request's slot first
    state_checkpoint: tuple[int, int] | None = None  # (after how many of this step's tokens, into which index)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    # finished, aborted or preempted since the previous step: the workers drop what they hold for them
    finished_ids: list[str] = field(default_factory=list)
    # structured outputs (set by the engine after scheduling): an int32 tensor [k, ceil(vocab / 32)]
    # of allowed-token bitmasks, row j for the sampling request grammar_request_ids[j]
    grammar_bitmask: object = None
    grammar_request_ids: list[str] = field(default_factory=list)
    # asynchronous scheduling: requests whose one token this step is the one the previous step samples for
    # them, not yet read back (the workers take it from that step's draw on the device)
    from_last_step: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, state_pool: StatePool | None = None,
                 state_checkpoints: StateCheckpoints | None = None, enable_chunked_prefill: bool = True) -> None:
        self.kv = kv_cache_manager
        self.state_pool = state_pool
        self.state_checkpoints = state_checkpoints  # prefix caching with Mamba layers
        self._state_restores: dict[str, int] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        # per request the workers hold: (tokens, blocks) they have been sent
        self._sent: dict[str, tuple[int, int]] = {}
        # per request: blocks freed after rejected drafts that its workers still list
        self._rolled_back: dict[str, int] = {}
        self.num_preemptions = 0

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # never replace a live request: its blocks would leak
            raise ValueError(f"request_id {request.request_id!r} is already in use by a running or "
                             "waiting request")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._release(request)
        self._finished_ids.append(request_id)
        return request

    def _release(self, request: Request) -> None:
        self._sent.pop(request.request_id, None)
        self._rolled_back.pop(request.request_id, None)
        self.kv.free(request)
        if request.state_slot is not None:
            self.state_pool.free(request.state_slot)
            request.state_slot = None
        if self.state_checkpoints is not None:
            self.state_checkpoints.forget(request.request_id)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        if self.state_checkpoints is not None:
            self.state_checkpoints.commit()
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []

        # 1. running requests, in admission order; drafts ride along once the known tokens all fit
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_pending_tokens
            if pending and self._may_end_by_length(request):
                i += 1  # its pending token may be its last: see it first
                continue
            num_known = min(request.num_tokens + pending - request.num_computed_tokens, budget)
            num_spec = 0
            if request.spec_token_ids and num_known == request.num_tokens - request.num_computed_tokens:
                num_spec = max(0, min(len(request.spec_token_ids), budget - num_known,
                                      self.max_model_len - request.num_tokens))
            if num_spec and self.kv.allocate_slots(request, num_known, num_lookahead_tokens=num_spec) is None:
                num_spec = 0  # drafts never cost a preemption: run without them instead (a second
                # call for slots already held allocates nothing)
            while self.kv.allocate_slots(request, num_known, num_lookahead_tokens=num_spec) is None:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                request.spec_token_ids = request.spec_token_ids[:num_spec]
                scheduled.append((request, num_known + num_spec))
                budget -= num_known + num_spec
                i += 1
                continue
            break

        # 2. waiting requests, first come first served (not in a step that had to preempt); one whose
        # grammar is still compiling stays in place while the requests behind it go ahead
        skip = 0
        coming: set[bytes] | None = None  # Mamba state checkpoints that running prompts have yet to reach
        while len(self.waiting) > skip and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[skip]
            if (request.structured is not None and not request.structured.ready) or request.num_pending_tokens:
                skip += 1  # (a pending token: preempted while a step samples for it, readmitted after it)
                continue
            if self.state_pool is not None and self.state_pool.num_free_slots == 0:
                break
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            restore = None
            if self.state_checkpoints is not None and computed_blocks:  # a hit needs the Mamba state too
                hashes = self.kv.req_to_hashes[request.request_id]
                n, restore = self.state_checkpoints.lookup(hashes, len(computed_blocks))
                if n < len(computed_blocks):
                    if coming is None:
                        coming = {h for r in self.running if (h := self._checkpoint_coming(r)) is not None}
                    if not coming.isdisjoint(hashes[n:len(computed_blocks)]):
                        # a running request is computing this prefix (e.g. the first of n samples): wait for
                        # its checkpoint rather than compute the prefix again
                        skip += 1
                        continue
                computed_blocks, num_cached = computed_blocks[:n], n * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break  # whole or not at all; the requests behind it wait too (first come first served)
                num_new = budget
            if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            del self.waiting[skip]
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if self.state_pool is not None:
                request.state_slot = self.state_pool.allocate(request.request_id)
            if restore is not None:
                self._state_restores[request.request_id] = restore
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
            if coming is not None and (h := self._checkpoint_coming(request)) is not None:
                coming.add(h)

        out = SchedulerOutput(
            scheduled=[self._describe(r, n) for r, n in scheduled],
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_ids=preempted,
            finished_ids=self._finished_ids,
            from_last_step=[r.request_id for r, _ in scheduled if r.num_pending_tokens],
        )
        self._finished_ids = []
        for (request, n), sr in zip(scheduled, out.scheduled):
            request.num_computed_tokens += n  # (update takes back rejected drafts)
            request.num_pending_tokens += sr.sample
        return out

    def _may_end_by_length(self, request: Request) -> bool:
        """Whether the request's pending tokens may reach its max_tokens or max_model_len."""
        pending, max_tokens = request.num_pending_tokens, request.sampling_params.max_tokens
        return (request.num_tokens + pending >= self.max_model_len
                or (max_tokens is not None and request.num_output_tokens + pending >= max_tokens))

    def _checkpoint_coming(self, request: Request) -> bytes | None:
        """The block hash at which a running request will checkpoint its Mamba state when its prompt
        gets there (see _state_checkpoint), if it has not yet: a waiting request whose prefix ends
        there can read it then. A running request advances every step it is not preempted, so a
        wait on it ends."""
        bs = self.kv.block_size
        boundary = (request.num_prompt_tokens - 1) // bs * bs
        if not boundary or request.num_computed_tokens >= boundary:
            return None
        return self.kv.block_hashes(request, boundary)[boundary // bs - 1]

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start, rid = request.num_computed_tokens, request.request_id
        spec, request.spec_token_ids = request.spec_token_ids, []  # drafts are good for one step
        sent = self._sent.get(rid)
        new = None
        if sent is None:
            sent = (0, 0)
            new = NewRequestData(request.sampling_params, request.num_prompt_tokens, request.state_slot)
        self._sent[rid] = (request.num_tokens, self.kv.num_blocks(rid))
        return ScheduledRequest(
            request_id=rid,
            num_tokens=num_new,
            start_pos=start,
            sample=start + num_new - len(spec) == request.num_tokens + request.num_pending_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            new_token_ids=request.all_token_ids[sent[0]:],
            new_block_ids=self.kv.get_block_ids(rid, sent[1]),
            new=new,
            spec_token_ids=spec,
            num_rolled_back_blocks=self._rolled_back.pop(rid, 0) if new is None else 0,
            state_restore_from=self._state_restores.pop(rid, None),
            state_checkpoint=self._state_checkpoint(request, num_new),
        )

    def _state_checkpoint(self, request: Request, num_new: int) -> tuple[int, int] | None:
        """Checkpoint the Mamba state at the prompt's last full block before its final token (in the
        multi-token chunk that reaches it), and at each block a decode step fills (one moving
        checkpoint per request); see StateCheckpoints."""
        if self.state_checkpoints is None:
            return None
        bs, start = self.kv.block_size, request.num_computed_tokens
        decode = num_new == 1 and start >= request.num_prompt_tokens
        boundary = start + 1 if decode else (request.num_prompt_tokens - 1) // bs * bs
        hashes = self.kv.req_to_hashes.get(request.request_id, [])
        if (decode and boundary % bs) or not start < boundary <= start + num_new or len(hashes) < boundary // bs:
            return None
        if not decode and num_new < 2:  # a one-token prompt chunk takes the decode path: no mid-chunk state
            return None
        index = self.state_checkpoints.reserve(hashes[boundary // bs - 1],
                                               owner=request.request_id if decode else None)
        return None if index is None else (boundary - start, index)

    def _roll_back(self, request: Request) -> None:
        """After rejected drafts: return the blocks past the request's computed tokens (they held only
        rejected drafts' KV, never entered the prefix cache) to the front of the free queue, so the
        pool and the block table are those of a step that never proposed them. Its workers drop
        them from their table at its next step (ScheduledRequest.num_rolled_back_blocks)."""
        rid = request.request_id
        freed = self.kv.free_tail(request, request.num_computed_tokens)
        if freed:
            tokens, blocks = self._sent[rid]
            self._sent[rid] = (tokens, blocks - freed)
            self._rolled_back[rid] = self._rolled_back.get(rid, 0) + freed

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.warning("Preempted request %s (recompute of %d tokens); %d preemptions so far",
                       request.request_id, request.num_tokens, self.num_preemptions)

    # -- after the forward -----------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               append: Callable[[Request, list[int]], list[int]]) -> list[tuple[Request, list[int]]]:
        """Advance each scheduled request's computed tokens, hand the tokens sampled for it to
        `append` (which appends those it keeps and marks the request finished at a stop: the
        engine's stop checker, tidal/engine/stop_checker.py) and free the requests that finished.
        Returns (request, tokens appended) for the requests that received tokens this step."""
        updated = []
        for sr in output.scheduled:
            request = self.requests.get(sr.request_id)
            if request is None:
                continue  # aborted meanwhile
            request.num_pending_tokens -= sr.sample
            token_ids = sampled.get(sr.request_id)
            if request.status == RequestStatus.PREEMPTED:
                # preempted by the step scheduled while this one ran (asynchronous scheduling): its tokens
                # stand, and it recomputes them with the rest when it is admitted again
                if token_ids:
                    kept = append(request, token_ids)
                    if request.is_finished:
                        self.waiting.remove(request)
                        del self.requests[request.request_id]
                        self._release(request)
                    updated.append((request, kept))
                continue
            if request.status != RequestStatus.RUNNING:
                continue
            # drafts the runner rejected have KV computed that no token will use: not computed
            rejected = max(0, len(sr.spec_token_ids) - (len(token_ids) - 1)) if token_ids else 0
            request.num_computed_tokens -= rejected
            if not token_ids:
                continue
            if sr.spec_token_ids:
                request.num_draft_tokens += len(sr.spec_token_ids)
                request.num_accepted_tokens += len(sr.spec_token_ids) - rejected
            kept = append(request, token_ids)
            if request.is_finished:
                self.running.remove(request)
                del self.requests[request.request_id]
                self._release(request)
                self._finished_ids.append(request.request_id)
            elif rejected:
                self._roll_back(request)
            updated.append((request, kept))
        return updated

    # -- stats -----------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
