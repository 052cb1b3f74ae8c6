"""OutputProcessor: turns the tokens each request keeps into RequestOutputs — logprobs in vLLM's
shape, streaming deltas, and the fan-in of a request's n parallel samples. Each sample owns an
incremental detokenizer and its text; the stop checker (tidal/engine/stop_checker.py) extends them
token by token, as it looks for stop strings, and cuts the text at one."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tidal.request import Request
from tidal.sampling_params import SamplingParams
from tidal.tokenizer import IncrementalDetokenizer, window_decoder

if TYPE_CHECKING:
    from tidal.layers.sampler import PromptTokenLogprobs, TokenLogprobs


@dataclass
class SampleState:
    index: int
    detok: IncrementalDetokenizer | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for delta outputs
    sent_text: int = 0
    sent_finish: bool = False  # delta outputs: its finish has been reported (never report it twice)
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    hold_back: int = 0  # characters kept back while streaming, so a stop string is never split

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:
            window_decoder(tokenizer)  # a byte-level tokenizer's table is built now, not by the first request
        self.states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], arrival_time: float) -> None:
        """Start gathering a request's samples, one per child id. Refuses (ValueError, changing
        nothing) an id already in use, of a request or of a sample: it would take over their state."""
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        taken = [c for c in child_ids if c in self.child_to_parent]
        if taken or len(set(child_ids)) != len(child_ids):
            raise ValueError(f"sample ids of request {request_id!r} collide: {taken or child_ids}")
        detok = (lambda: IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                params.spaces_between_special_tokens)
                 if params.detokenize and self.tokenizer is not None else None)
        samples = [SampleState(i, detok(), logprobs=[] if params.logprobs is not None else None,
                               cumulative_logprob=0.0 if params.logprobs is not None else None)
                   for i in range(params.n)]
        state = RequestState(request_id, prompt, prompt_token_ids, params, samples, RequestMetrics(arrival_time),
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                             hold_back=max((len(s) for s in params.stop), default=1) - 1)
        self.states[request_id] = state
        for i, cid in enumerate(child_ids):
            self.child_to_parent[cid] = (request_id, i)

    def has(self, request_id: str) -> bool:
        return request_id in self.states

    def children_of(self, request_id: str) -> list[str]:
        return [c for c, (p, _) in self.child_to_parent.items() if p == request_id]

    # -- per step --------------------------------------------------------------------------------
    def add_prompt_logprobs(self, child_id: str, entries: list[PromptTokenLogprobs]) -> None:
        parent, index = self.child_to_parent[child_id]
        state = self.states[parent]
        if index != 0 or state.prompt_logprobs is None:
            return
        for e in entries:
            if e.position != len(state.prompt_logprobs):  # already recorded (e.g. recomputed after preemption)
                continue
            d = self._logprob_dict(e.top_ids, e.top_logprobs, range(1, len(e.top_ids) + 1))
            d.setdefault(e.token_id, Logprob(e.logprob, e.rank, self._decode_one(e.token_id)))
            state.prompt_logprobs.append(d)

    def sample_text(self, child_id: str) -> SampleState | None:
        """The sample whose detokenizer and text the stop checker extends (None without text)."""
        parent, index = self.child_to_parent[child_id]
        sample = self.states[parent].samples[index]
        return sample if sample.detok is not None else None

    def process_tokens(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> str:
        """Record the tokens a child request kept this step (its text is already extended by the stop
        checker), one logprobs entry per token, and its finish if it finished. Returns the parent
        request id."""
        parent, index = self.child_to_parent[request.request_id]
        state = self.states[parent]
        sample = state.samples[index]
        now = time.time()
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now
        if index == 0:  # sample 0 computes the prompt; later samples hit its blocks, not earlier requests'
            state.num_cached_tokens = max(request.num_cached_tokens, 0)
        self.record_progress(request)
        m = state.metrics
        m.num_generation_tokens = max(m.num_generation_tokens, len(sample.token_ids) + len(token_ids))
        sample.token_ids.extend(token_ids)
        if logprobs is not None and sample.logprobs is not None:
            for token, lp in zip(token_ids, logprobs):
                d = self._logprob_dict(lp.top_ids, lp.top_logprobs, range(1, len(lp.top_ids) + 1))
                d.setdefault(token, Logprob(lp.logprob, lp.rank, self._decode_one(token)))
                sample.logprobs.append(d)
                sample.cumulative_logprob += lp.logprob
        if request.is_finished:
            self.finish_sample(request.request_id, request.finish_reason, request.stop_reason)
        return parent

    def record_progress(self, request: Request) -> None:
        """Copy a child request's scheduling record into its parent's metrics: when it was first
        scheduled (the earliest sample's), preemptions and draft tokens (summed over the samples).
        Called with each step's tokens, and for a request aborted before its next token."""
        parent, index = self.child_to_parent[request.request_id]
        state = self.states[parent]
        sample, m = state.samples[index], state.metrics
        if request.first_scheduled_time is not None and (m.first_scheduled_time is None
                                                         or request.first_scheduled_time < m.first_scheduled_time):
            m.first_scheduled_time = request.first_scheduled_time
        if sample.num_preemptions != request.num_preemptions:
            sample.num_preemptions = request.num_preemptions
            m.num_preemptions = sum(s.num_preemptions for s in state.samples)
        if request.num_draft_tokens:
            sample.num_draft_tokens, sample.num_accepted_tokens = request.num_draft_tokens, request.num_accepted_tokens
            m.num_draft_tokens = sum(s.num_draft_tokens for s in state.samples)
            m.num_accepted_tokens = sum(s.num_accepted_tokens for s in state.samples)

    def finish_sample(self, child_id: str, finish_reason: str, stop_reason=None) -> None:
        parent, index = self.child_to_parent.pop(child_id)
        sample = self.states[parent].samples[index]
        sample.finish_reason = finish_reason
        sample.stop_reason = stop_reason

    def make_output(self, request_id: str) -> RequestOutput | None:
        """The RequestOutput to hand out now (None when nothing new is to be said in this mode)."""
        state = self.states[request_id]
        finished = state.finished
        kind = state.params.output_kind
        if kind == "final" and not finished:
            return None
        outs = []
        for s in state.samples:
            text_end = len(s.text) if s.finish_reason is not None else max(len(s.text) - state.hold_back, s.sent_text)
            if kind == "delta":
                text, tokens = s.text[s.sent_text:text_end], s.token_ids[s.sent_tokens:]
                lps = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
                if not tokens and not text and (s.finish_reason is None or s.sent_finish):
                    continue
            else:
                text, tokens, lps = s.text[:text_end], list(s.token_ids), s.logprobs
            s.sent_text, s.sent_tokens = text_end, len(s.token_ids)
            s.sent_finish = s.finish_reason is not None
            outs.append(CompletionOutput(s.index, text, tokens, s.cumulative_logprob,
                                         list(lps) if lps is not None else None, s.finish_reason, s.stop_reason))
        if finished:
            state.metrics.finished_time = time.time()
            del self.states[request_id]
        if not outs and not finished:
            return None
        return RequestOutput(request_id, state.prompt, state.prompt_token_ids,
                             state.prompt_logprobs, outs, finished, state.metrics, state.num_cached_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        for c in self.children_of(request_id):
            del self.child_to_parent[c]
        return self.make_output(request_id)

    # -- helpers ---------------------------------------------------------------------------------
    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _logprob_dict(self, ids, vals, ranks) -> dict[int, Logprob]:
        return {i: Logprob(v, r, self._decode_one(i)) for i, v, r in zip(ids, vals, ranks)}
