"""DraftModelProposer: drafts from a smaller model with the target's tokenizer, run k steps ahead
inside the engine's step, with its own paged KV cache and prefix cache.

The draft model keeps a mirror of each request it drafts for: a draft-side Request (the target's
known tokens) in its own KVCacheManager, and a row in its own ModelRunner's InputBatch. One engine
step with k drafts for a set of requests runs k forwards of the draft:

    forward 1:  each request's tokens the draft has not computed yet (its whole prompt the first time,
                less what the draft's prefix cache holds; afterwards the tokens the target accepted
                since, usually 1 to k + 1), sampling draft 1 at the last one
    forward j:  draft j - 1 alone, sampling draft j

Drafts are the draft model's argmax, so each is a point mass (q(d) = 1) and the target verifies them
with the request's own sampler, exactly (tidal/layers/rejection_sampler.py). Drafts 1..k-1 leave KV in
the draft's cache; at the next step the mirror keeps it as far as the target accepted them (the
common prefix of what the draft computed and the request's tokens now) and gives back the blocks past
it, so the draft never recomputes an accepted draft. Blocks full of known tokens enter the draft's
prefix cache, as in the target's.

The draft runs in the engine's process, unsharded, whatever the target's parallelism.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from tidal.request import Request, RequestStatus
from tidal.sampling_params import SamplingParams
from tidal.worker.memory import plan_kv_cache
from tidal.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


@dataclass
class _Mirror:
    request: Request         # the draft's copy of the target's known tokens; num_computed_tokens of them
    drafted: list[int]       # drafts whose KV the last step computed, right after the known tokens
    sent_blocks: int = 0     # blocks the draft runner's InputBatch lists for it
    held: bool = False       # the draft runner holds a row for it


class DraftModelProposer:
    def __init__(self, loaded, k: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, num_kv_tokens: int, seed: int = 0) -> None:
        self.k = k
        self.max_model_len = max_model_len
        # forward 1 carries catch-up tokens; its buffers fit the target's largest step
        self.max_step_tokens = max_num_batched_tokens
        self.runner = ModelRunner(loaded.model, loaded.dtype, block_size, seed, (), kv_cache_dtype=loaded.weight_dtype,
                                  max_num_seqs=max_num_seqs, max_model_len=max_model_len + k,
                                  max_num_batched_tokens=max_num_batched_tokens + max_num_seqs)
        bytes_per_token = self.runner.kv_bytes_per_token()
        plan = plan_kv_cache(bytes_per_token, block_size, max_model_len + k, num_kv_tokens * bytes_per_token)
        self.runner.allocate_kv_cache(plan.num_blocks)
        self.kv = KVCacheManager(plan.num_blocks, block_size, enable_caching=True)
        self.mirrors: dict[str, _Mirror] = {}
        self._dropped: list[str] = []
        self.weight_bytes = loaded.weight_bytes
        self.model_time_s = 0.0  # seconds in the draft model's forwards and LM head, over its life
        self.forwards: list[tuple[int, float]] = []  # (tokens, wall seconds) of each forward since last read
        logger.info("Draft model %s: %.1f MB of weights, its KV cache %.1f MiB = %d blocks", loaded.name,
                    loaded.weight_bytes / 1e6, plan.num_bytes / 2**20, plan.num_blocks)

    def pending_tokens(self, request: Request) -> int:
        """About how many tokens of request the draft's first forward would compute: those it has not
        seen (a new request's whole prompt, then the target's tokens since its last drafts)."""
        mirror = self.mirrors.get(request.request_id)
        if mirror is None:
            return request.num_tokens
        m = mirror.request
        done = m.num_computed_tokens + (len(mirror.drafted) if m.num_computed_tokens == m.num_tokens else 0)
        return max(1, request.num_tokens - done)

    def propose(self, request: Request) -> list[int]:
        return self.propose_batch([(request, self.k)], None)[0]

    def propose_batch(self, wanted: list[tuple[Request, int]], live_ids=None) -> list[list[int]]:
        """Up to count drafts for each (request, count); live_ids (the engine's requests): mirrors of
        any other request are dropped first."""
        if live_ids is not None:
            for rid in [rid for rid in self.mirrors if rid not in live_ids]:
                self._drop(rid)
        drafts: dict[str, list[int]] = {}
        scheduled, counts = [], {}
        budget = self.max_step_tokens
        for request, count in wanted:
            count = min(count, self.k, self.max_model_len - request.num_tokens)
            if count < 1 or budget < 1:
                continue
            sr = self._catch_up(request, count, budget)
            if sr is None:
                continue
            scheduled.append(sr)
            budget -= sr.num_tokens
            if sr.sample:
                counts[request.request_id] = count
                drafts[request.request_id] = []
        step = 0
        while scheduled:
            num_tokens = sum(s.num_tokens for s in scheduled)
            t0 = time.perf_counter()
            out = self.runner.execute(SchedulerOutput(scheduled, num_tokens, finished_ids=self._dropped))
            self.forwards.append((num_tokens, time.perf_counter() - t0))
            self._dropped = []
            self.model_time_s += out.model_time_s
            nxt = []
            for sr in scheduled:
                mirror = self.mirrors[sr.request_id]
                if step == 0:
                    mirror.request.num_computed_tokens = sr.start_pos + sr.num_tokens
                if not sr.sample:
                    continue
                d = drafts[sr.request_id]
                d.append(out.sampled[sr.request_id][-1])
                if len(d) < counts[sr.request_id]:  # the draft just sampled is the next forward's input
                    nxt.append(ScheduledRequest(sr.request_id, 1, sr.start_pos + sr.num_tokens, True,
                                                new_token_ids=[d[-1]]))
            scheduled, step = nxt, step + 1
        for rid, d in drafts.items():
            self.mirrors[rid].drafted = d[:-1]  # the last draft's KV is not computed
        return [drafts.get(r.request_id, []) for r, _ in wanted]

    def _catch_up(self, request: Request, count: int, budget: int) -> ScheduledRequest | None:
        """The first forward's share for request: its tokens the draft has not computed, with room for
        count - 1 more drafts (None: no room in the draft's cache this step)."""
        rid, tokens = request.request_id, request.all_token_ids
        mirror = self.mirrors.get(rid)
        computed_blocks, new = [], None
        if mirror is None:
            m = Request(rid, tokens, _GREEDY)
            mirror = self.mirrors[rid] = _Mirror(m, [])
            computed_blocks, num_cached = self.kv.get_computed_blocks(m)
            start = num_cached
        else:
            m = mirror.request
            # what the draft computed - its known tokens, then last step's drafts if it computed them all -
            # kept as far as it is still the request's prefix (at least the last token is left to compute)
            done = m.all_token_ids[:m.num_computed_tokens]
            if m.num_computed_tokens == m.num_tokens:
                done = done + mirror.drafted
            limit = min(len(done), len(tokens) - 1)
            start = min(m.num_computed_tokens, limit)  # its computed known tokens are the request's prefix
            while start < limit and done[start] == tokens[start]:
                start += 1
            for t in tokens[m.num_tokens:]:  # the target's tokens only ever grow
                m.append_output_token(t)
            mirror.drafted = []
            m.num_computed_tokens = start
            freed = self.kv.free_tail(m, start)  # blocks past it held only rejected drafts
            if mirror.held:  # the runner's copy: tokens and blocks past what stays
                row = self.runner.input_batch.requests[rid].row
                self.runner.input_batch.num_tokens[row] = start
                self.runner.input_batch.num_blocks[row] -= freed
                mirror.sent_blocks -= freed
        if not mirror.held:
            new = NewRequestData(_GREEDY, m.num_prompt_tokens)
        num_new = min(len(tokens) - start, budget)
        sample = num_new == len(tokens) - start
        if self.kv.allocate_slots(m, num_new, computed_blocks, num_lookahead_tokens=count - 1 if sample else 0) is None:
            if new is not None:
                del self.mirrors[rid]
            return None
        m.num_computed_tokens = start  # (a new mirror: its prefix-cache hit)
        sr = ScheduledRequest(rid, num_new, start, sample, m.num_prompt_tokens,
                              new_token_ids=tokens[start:] if new is None else tokens,
                              new_block_ids=self.kv.get_block_ids(rid, mirror.sent_blocks), new=new)
        mirror.sent_blocks, mirror.held = self.kv.num_blocks(rid), True
        return sr

    def _drop(self, rid: str) -> None:
        mirror = self.mirrors.pop(rid)
        mirror.request.status = RequestStatus.FINISHED_ABORTED
        self.kv.free(mirror.request)
        if mirror.held:
            self._dropped.append(rid)
