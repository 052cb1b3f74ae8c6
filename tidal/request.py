"""Request: the engine's record of one sequence being generated.

Plain Python over integers (no torch): token ids, how many of them have KV computed, status and
stop state. The scheduler advances `num_computed_tokens`; the tokens a step keeps (see
tidal/engine/stop_checker.py) are appended to `output_token_ids`. A preempted request keeps its
output tokens and recomputes them later.
"""
from __future__ import annotations

import enum
import time

from tidal.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None,
                 cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)  # any of them ends the output, unless ignore_eos
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        # prompt + outputs; the scheduler computes KV for all_token_ids[:num_computed_tokens].
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # steps in flight that sample a token for it (asynchronous scheduling: step N + 1 is scheduled before
        # step N's tokens are read): the scheduler counts their tokens as known, the engine appends them later
        self.num_pending_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # when the scheduler first admitted it
        self.state_slot: int | None = None  # recurrent-state slot for Mamba layers
        # structured outputs: an object with `.ready` (its grammar has compiled); the engine's
        # StructuredOutputManager owns what is behind it
        self.structured = None
        # draft tokens proposed for the next step (speculative decoding): computed after the known tokens,
        # kept only as far as the model agrees; the scheduler hands them to the step that runs them
        self.spec_token_ids: list[int] = []
        self.proposer_state = None  # the proposer's memo for this request (e.g. its n-gram index)
        self.proposer_stats = None  # its drafts' measured acceptance (tidal/spec_decode/policy.py)
        # speculative decoding counters: draft tokens run for it, and how many of them it kept
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
