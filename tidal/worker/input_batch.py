"""InputBatch: the requests a worker holds, in fixed host buffers that outlive the step.

The scheduler sends each request whole once (its NewRequestData and every token and block so far),
then per step only deltas: the tokens appended since (the previous step's samples), new block ids,
and how many tokens to compute. Each request the worker holds owns one row of the buffers below
until it finishes or is preempted:

    token_ids      [max_num_seqs, max_model_len]  prompt + outputs (+ this step's drafts past num_tokens)
    block_table    [max_num_seqs, max_blocks]     its KV blocks, in order
    num_tokens, num_prompt_tokens, num_blocks     [max_num_seqs]

A step's flat inputs (input_ids, positions, slot_mapping, query_start_loc, seq_lens) are gathered
from them with a few vectorised numpy operations into buffers sized for the largest step, so nothing
is rebuilt from Python lists, and the shapes a device graph would capture stay fixed. The block
table is handed to attention as it is, with a row index per token: no per-step table copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tidal.core.scheduler import ScheduledRequest, SchedulerOutput
from tidal.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    row: int
    sampling_params: SamplingParams
    num_prompt_tokens: int
    state_slot: int | None
    # greedy, without logprobs or penalties: its rows need only an argmax (once past min_tokens)
    plain_greedy: bool = False


@dataclass
class StepInputs:
    """One step's flat inputs, views of the InputBatch's buffers (valid until the next step)."""
    reqs: list[ScheduledRequest]   # batch order: decodes, then chunks continuing a context, then fresh chunks
    rows: np.ndarray               # [num_reqs] each request's row in the InputBatch
    num_tokens: int
    num_decodes: int               # requests (= tokens) computing one token, first in the batch
    query_start_loc: np.ndarray    # [num_reqs + 1]
    seq_lens: np.ndarray           # [num_reqs] start_pos + num_tokens
    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    slot_mapping: torch.Tensor     # [num_tokens] int64
    token_rows: torch.Tensor       # [num_tokens] int64: each token's row in block_table
    block_table: torch.Tensor      # [max_num_seqs, max_blocks] int64, the whole persistent table
    block_size: int
    token_seq_lens: torch.Tensor   # [num_tokens] int64: position + 1, the context each token attends to
    max_seq_len: int


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, block_size: int,
                 max_spec_tokens: int = 0) -> None:
        self.block_size = block_size
        self.max_len = max_model_len + max_spec_tokens  # room for drafts past the last known token
        self.max_blocks = -(-self.max_len // block_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.token_ids = np.zeros((max_num_seqs, self.max_len), dtype=np.int32)  # vocabularies fit in int32
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)      # known tokens (no drafts)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self._block_table = torch.zeros(max_num_seqs, self.max_blocks, dtype=torch.int64)
        self.block_table = self._block_table.numpy()
        n = max_num_batched_tokens
        self._input_ids = torch.zeros(n, dtype=torch.int64)
        self._positions = torch.zeros(n, dtype=torch.int64)
        self._slot_mapping = torch.zeros(n, dtype=torch.int64)
        self._token_rows = torch.zeros(n, dtype=torch.int64)
        self._token_seq_lens = torch.zeros(n, dtype=torch.int64)
        # numpy views of the same memory, written by prepare()
        self._np = {name: getattr(self, name).numpy() for name in ("_input_ids", "_positions", "_slot_mapping",
                                                                    "_token_rows", "_token_seq_lens")}
        self._arange = np.arange(max(n, max_num_seqs) + 1, dtype=np.int64)
        # a single decode's inputs: the first element of each buffer (views made once)
        self._one_decode = tuple(t[:1] for t in (self._input_ids, self._positions, self._slot_mapping,
                                                  self._token_rows, self._token_seq_lens))

    # -- deltas from the scheduler ------------------------------------------------------------------
    def update(self, so: SchedulerOutput) -> list[str]:
        """Apply a step's deltas: drop finished and preempted requests, add new ones, append tokens and
        blocks. Returns the ids dropped."""
        dropped = [rid for rid in (*so.finished_ids, *so.preempted_ids) if self.drop(rid)]
        for sr in so.scheduled:
            state = self.requests.get(sr.request_id)
            if sr.new is not None:
                if state is not None:
                    self.drop(sr.request_id)
                if not self.free_rows:
                    raise RuntimeError(f"request {sr.request_id}: no free row in the input batch (max_num_seqs "
                                       f"{len(self.num_tokens)} requests are held)")
                row = self.free_rows.pop()
                p = sr.new.sampling_params
                state = CachedRequestState(sr.request_id, row, p, sr.new.num_prompt_tokens, sr.new.state_slot,
                                           plain_greedy=p.greedy and p.logprobs is None and not p.has_penalties)
                self.requests[sr.request_id] = state
                self.num_tokens[row] = self.num_blocks[row] = 0
            elif state is None:
                raise RuntimeError(f"request {sr.request_id} was scheduled as running, but this worker does not "
                                   "hold it")
            row = state.row
            if sr.num_rolled_back_blocks:
                self.num_blocks[row] -= sr.num_rolled_back_blocks
            if new := sr.new_token_ids:
                n = int(self.num_tokens[row])
                if len(new) == 1:  # a decode's token: a scalar write costs less than a slice's
                    self.token_ids[row, n] = new[0]
                else:
                    self.token_ids[row, n:n + len(new)] = new
                self.num_tokens[row] = n + len(new)
            if sr.new_block_ids:
                b = int(self.num_blocks[row])
                self.block_table[row, b:b + len(sr.new_block_ids)] = sr.new_block_ids
                self.num_blocks[row] = b + len(sr.new_block_ids)
            if sr.spec_token_ids:  # drafts sit past the known tokens, overwritten by what is accepted
                n = int(self.num_tokens[row])
                self.token_ids[row, n:n + len(sr.spec_token_ids)] = sr.spec_token_ids
        return dropped

    def drop(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        self.free_rows.append(state.row)
        return True

    def tokens(self, request_id: str) -> np.ndarray:
        """A request's known tokens (prompt + outputs), a view."""
        row = self.requests[request_id].row
        return self.token_ids[row, :self.num_tokens[row]]

    # -- one step's inputs --------------------------------------------------------------------------
    def prepare(self, reqs: list[ScheduledRequest]) -> StepInputs:
        """Flat inputs of `reqs` in batch order: decodes first, then chunks that continue a cached context,
        then chunks starting at position 0 (stable: scheduling order within each)."""
        if len(reqs) == 1 and reqs[0].num_tokens == 1:  # one decode (a single stream): scalars, no gathers
            return self._prepare_one_decode(reqs[0])
        return self._prepare_batch(reqs)

    def _prepare_batch(self, reqs: list[ScheduledRequest]) -> StepInputs:
        reqs = sorted(reqs, key=lambda r: (r.num_tokens > 1, r.start_pos == 0))
        B = len(reqs)
        held = self.requests
        rows = np.fromiter((held[r.request_id].row for r in reqs), dtype=np.int64, count=B)
        q_lens = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=B)
        starts = np.fromiter((r.start_pos for r in reqs), dtype=np.int64, count=B)
        T = sum(r.num_tokens for r in reqs)  # (Python ints: numpy reductions cost more on arrays this small)
        if T == B:  # decode-only (the common step): one token per request, no expansion to do
            query_start_loc = self._arange[:B + 1]
            positions, token_rows, num_decodes = starts, rows, B
        else:
            query_start_loc = np.zeros(B + 1, dtype=np.int64)
            np.cumsum(q_lens, out=query_start_loc[1:])
            req_idx = np.repeat(self._arange[:B], q_lens)                                  # [T] request of each token
            positions = starts[req_idx] + self._arange[:T] - query_start_loc[:-1][req_idx]  # [T]
            token_rows = rows[req_idx]
            num_decodes = int(np.searchsorted(q_lens > 1, True))
        bs = self.block_size
        input_ids, pos_t, slots, rows_t = (self._input_ids[:T], self._positions[:T], self._slot_mapping[:T],
                                           self._token_rows[:T])
        views = self._np
        views["_input_ids"][:T] = self.token_ids[token_rows, positions]
        views["_positions"][:T] = positions
        views["_token_rows"][:T] = token_rows
        np.add(positions, 1, out=views["_token_seq_lens"][:T])
        np.add(self.block_table[token_rows, positions // bs] * bs, positions % bs, out=views["_slot_mapping"][:T])
        return StepInputs(reqs, rows, T, num_decodes, query_start_loc, starts + q_lens, input_ids, pos_t, slots,
                          rows_t, self._block_table, bs, self._token_seq_lens[:T],
                          max(r.start_pos + r.num_tokens for r in reqs))

    def _prepare_one_decode(self, r: ScheduledRequest) -> StepInputs:
        """prepare() of a step that is one request's one token, with scalar writes: the same inputs."""
        row, pos, bs = self.requests[r.request_id].row, r.start_pos, self.block_size
        views = self._np
        views["_input_ids"][0] = self.token_ids[row, pos]
        views["_positions"][0] = pos
        views["_token_rows"][0] = row
        views["_token_seq_lens"][0] = pos + 1
        views["_slot_mapping"][0] = self.block_table[row, pos // bs] * bs + pos % bs
        input_ids, positions, slots, token_rows, token_seq_lens = self._one_decode
        return StepInputs([r], np.array([row], dtype=np.int64), 1, 1, self._arange[:2],
                          np.array([pos + 1], dtype=np.int64), input_ids, positions, slots, token_rows,
                          self._block_table, bs, token_seq_lens, pos + 1)
