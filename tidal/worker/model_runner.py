"""ModelRunner: turns a scheduled batch into tensors, runs one forward over all of its tokens
(prefill chunks and decodes together, no padding), and samples.

Batch layout: requests computing one token (decodes) first, then multi-token chunks; input_ids,
positions and slot_mapping are flat [num_tokens] tensors. Logits are computed only at the rows
that sample (and at prompt rows of requests that asked for prompt logprobs).

The runner runs where the model's weights are (CPU or CUDA): the KV cache, the Mamba state and the
default generator lives there too. Each step's tensors are built on the host and copied once
(tidal/device.py); what goes back to the engine is plain Python (token ids, logprob lists).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tidal.core.scheduler import ScheduledRequest, SchedulerOutput
from tidal.device import lazy_zeros, to_device
from tidal.forward_context import set_forward_context
from tidal.layers import cpu_kernels
from tidal.layers.attention import Attention, AttentionMetadata
from tidal.layers.attention.layer import kv_cache_shape
from tidal.layers.mamba import MambaMixer
from tidal.layers.sampler import PromptTokenLogprobs, Sampler, SamplingMetadata, TokenLogprobs, prompt_logprobs
from tidal.sampling_params import SamplingParams
from tidal.worker.memory import cache_budget_bytes, cuda_cache_budget_bytes

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> the prompt positions this step predicted
    prompt_logprobs: dict[str, list[PromptTokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, block_size: int, seed: int = 0,
                 eos_token_id: int | None = None, kv_cache_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.dtype = dtype
        # the activations' dtype, or bf16 under fp32 activations with bf16 weights: half the memory per
        # token, the same as a bf16 model's, rounded as the model's weights are
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.mamba_layers = [m for m in model.modules() if isinstance(m, MambaMixer)]
        self.device = next(model.parameters()).device
        # (a model on the meta device - shapes only, for sizing estimates - samples nothing)
        gen_device = "cpu" if self.device.type == "meta" else self.device
        self.default_generator = torch.Generator(gen_device).manual_seed(seed)
        self.sampler = Sampler(self.default_generator)  # seeded rows need no generator of their own
        self.num_blocks = 0

    # -- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * elem for a in self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        for a in self.attn_layers:
            a.kv_cache = lazy_zeros(kv_cache_shape(num_blocks, self.block_size, a.num_kv_heads, a.head_dim),
                                    self.kv_cache_dtype, self.device)

    # -- memory budget of the KV cache and the Mamba state ---------------------------------------
    def cache_budget_bytes(self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                           max_model_len: int, compute_logits: bool = True) -> int:
        """Measured now that the weights are loaded. CPU: min(4 GiB, half the available memory).
        CUDA: gpu_memory_utilization of the GPU less the memory in use and the activation peak of
        one profiling forward as large as the largest step."""
        if self.device.type != "cuda":
            return cache_budget_bytes(None)
        return cuda_cache_budget_bytes(self.device, gpu_memory_utilization, lambda: self.profile_run(
            max_num_batched_tokens, max_num_seqs, max_model_len, compute_logits))

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, max_model_len: int, compute_logits: bool = True) -> None:
        """A forward over num_tokens prompt tokens (fresh sequences of at most max_model_len) with a
        throwaway KV cache and state, then the logits and a top-k/top-p draw for num_seqs rows: the
        memory the largest step needs beside the cache. Leaves no cache bound."""
        bs = self.block_size
        lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
        blocks = [-(-n // bs) for n in lens]
        first_block = [sum(blocks[:i]) for i in range(len(lens))]
        self.allocate_kv_cache(max(1, sum(blocks)))
        if self.mamba_layers:
            self.allocate_state(len(lens))
        params = SamplingParams(max_tokens=1)
        reqs = [ScheduledRequest(f"profile-{i}", [0] * n, 0, list(range(first_block[i], first_block[i] + blocks[i])),
                                 False, n, params, state_slot=i if self.mamba_layers else None)
                for i, n in enumerate(lens)]
        try:
            meta, input_ids, positions = self._prepare(reqs)
            with set_forward_context(meta):
                hidden = self.model(input_ids, positions)
            if compute_logits:
                rows = self._on_device(list(range(min(num_seqs, num_tokens))))
                logits = self.model.compute_logits(hidden[rows]).float()
                draw = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
                Sampler(torch.Generator(self.device).manual_seed(0))(
                    logits, SamplingMetadata.from_params([draw] * len(rows), self.device, logits.shape[-1]))
        finally:
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
        pairs = [(r.state_slot, r.state_restore_from) for r in reqs if r.state_restore_from is not None]
        if pairs:
            dst, src = (to_device(torch.tensor(ids), self.device) for ids in zip(*pairs))
            for m in self.mamba_layers:
                m.conv_state[dst] = m.conv_state[src]
                m.ssm_state[dst] = m.ssm_state[src]

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        if not so.scheduled:
            return out
        # decodes, then chunks continuing a context, then fresh chunks (stable: FCFS within each)
        reqs = sorted(so.scheduled, key=lambda r: (len(r.token_ids) > 1, r.start_pos == 0))
        meta, input_ids, positions = self._prepare(reqs)
        self.restore_states(reqs)
        with set_forward_context(meta):
            hidden = self.model(input_ids, positions)  # [num_tokens, hidden]

        # rows whose logits we need: the last token of each sampling request, then prompt rows
        sample_reqs = [r for r in reqs if r.sample]
        starts = meta.query_start_loc
        rows = [starts[i] + len(r.token_ids) - 1 for i, r in enumerate(reqs) if r.sample]
        if sample_reqs:
            logits = self.model.compute_logits(hidden[self._on_device(rows)]).float()
            result = self.sampler(logits, self._sampling_metadata(so, sample_reqs, logits.shape[-1]))
            for r, tok, lp in zip(sample_reqs, result.token_ids, result.logprobs):
                out.sampled[r.request_id] = tok
                if lp is not None:
                    out.logprobs[r.request_id] = lp
        for i, r in enumerate(reqs):
            if r.want_prompt_logprobs:
                out.prompt_logprobs[r.request_id] = self._prompt_logprobs(r, hidden, starts[i])
        return out

    def _prepare(self, reqs: list[ScheduledRequest]):
        bs = self.block_size
        q_lens = [len(r.token_ids) for r in reqs]
        query_start_loc = [0]
        for n in q_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        num_tokens = query_start_loc[-1]
        input_ids = torch.tensor([t for r in reqs for t in r.token_ids], dtype=torch.long)
        q_lens_t = torch.tensor(q_lens)
        req_idx = torch.repeat_interleave(torch.arange(len(reqs)), q_lens_t)
        offsets = torch.arange(num_tokens) - torch.tensor(query_start_loc[:-1])[req_idx]
        positions = torch.tensor([r.start_pos for r in reqs])[req_idx] + offsets
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_tables = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in reqs],
                                    dtype=torch.long)
        slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs

        num_decodes = sum(1 for n in q_lens if n == 1)
        seq_lens = [r.start_pos + n for r, n in zip(reqs, q_lens)]
        # With the native kernel every token is attended in place through the paged kernel, prompt
        # chunks too (each token a query over its own prefix, after this step's K/V are written): on the
        # offline workload 1.04-1.11x the throughput of torch's SDPA for chunks, whose bf16 path runs
        # fp32 GEMMs. Without it, decodes take the torch decode path and chunks SDPA.
        num_paged_reqs = num_decodes
        if self.device.type == "cpu" and cpu_kernels.native_lib() is not None:
            num_paged_reqs = len(reqs)
        num_paged = query_start_loc[num_paged_reqs]
        # everything above is on the host; each tensor the forward reads is copied to the device once
        dev = self.device
        device_block_tables = to_device(block_tables, dev)
        prefills = [(query_start_loc[i], q_lens[i], reqs[i].start_pos,
                     device_block_tables[i, :-(-seq_lens[i] // bs)]) for i in range(num_paged_reqs, len(reqs))]
        # per request, not per token: a long chunk over a long context would otherwise copy its table
        # once per token
        paged_table_index = to_device(req_idx[:num_paged], dev)
        slots = [r.state_slot for r in reqs]
        meta = AttentionMetadata(
            num_tokens=num_tokens, slot_mapping=to_device(slot_mapping, dev), block_size=bs, num_decodes=num_decodes,
            num_paged_tokens=num_paged,
            paged_block_tables=device_block_tables if num_paged else None,
            paged_table_index=paged_table_index if num_paged else None,
            paged_seq_lens=to_device(positions[:num_paged] + 1, dev) if num_paged else None,
            paged_max_seq_len=max(seq_lens[:num_paged_reqs], default=0),
            prefills=prefills, query_start_loc=query_start_loc,
            state_slots=(self._on_device(slots) if any(s is not None for s in slots) else None),
            has_initial_state=self._on_device([r.start_pos > 0 for r in reqs]),
            fresh_decodes=any(r.start_pos == 0 for r in reqs[:num_decodes]),
            state_checkpoints=[(i, *r.state_checkpoint) for i, r in enumerate(reqs) if r.state_checkpoint] or None,
        )
        return meta, to_device(input_ids, dev), to_device(positions, dev)

    @staticmethod
    def _grammar_rows(so: SchedulerOutput, sample_reqs: list[ScheduledRequest]):
        """(bitmask, logits rows it applies to) for the sampling requests with a grammar, or None."""
        if so.grammar_bitmask is None:
            return None
        where = {rid: j for j, rid in enumerate(so.grammar_request_ids)}
        pairs = [(i, where[r.request_id]) for i, r in enumerate(sample_reqs) if r.request_id in where]
        if not pairs:
            return None
        rows, mask_rows = zip(*pairs)
        return so.grammar_bitmask[list(mask_rows)], list(rows)

    def _on_device(self, values: list) -> torch.Tensor:
        """A list of ints (or bools) as a tensor on the device (int64 for ints, as torch.tensor makes it)."""
        return to_device(torch.tensor(values), self.device)

    def _sampling_metadata(self, so: SchedulerOutput, sample_reqs: list[ScheduledRequest],
                           vocab_size: int) -> SamplingMetadata:
        """The sampling rows of this step, one per sampling request. A row's draw index is its
        request's number of output tokens so far, which with its seed fixes its noise."""
        params = [r.sampling_params for r in sample_reqs]
        num_outputs = [r.start_pos + len(r.token_ids) - r.num_prompt_tokens for r in sample_reqs]
        banned = []
        for p, num_output in zip(params, num_outputs):
            stop_ids = list(p.stop_token_ids)
            if not p.ignore_eos and self.eos_token_id is not None:
                stop_ids.append(self.eos_token_id)
            banned.append(stop_ids if num_output < p.min_tokens else [])
        all_ids = [r.all_token_ids or [] for r in sample_reqs]
        return SamplingMetadata.from_params(
            params, self.device, vocab_size,
            prompt_token_ids=[ids[:r.num_prompt_tokens] for r, ids in zip(sample_reqs, all_ids)],
            output_token_ids=[ids[r.num_prompt_tokens:] for r, ids in zip(sample_reqs, all_ids)],
            banned_token_ids=banned, draw_index=num_outputs, grammar=self._grammar_rows(so, sample_reqs))

    def _prompt_logprobs(self, r: ScheduledRequest, hidden: torch.Tensor,
                         q_start: int) -> list[PromptTokenLogprobs]:
        """Logprobs of the prompt tokens this chunk predicts: position p predicts token p + 1."""
        positions = [p for p in range(r.start_pos, r.start_pos + len(r.token_ids)) if p + 1 < r.num_prompt_tokens]
        if not positions:
            return []
        rows = [q_start + p - r.start_pos for p in positions]
        targets = [r.prompt_token_ids[p + 1] for p in positions]
        logits = self.model.compute_logits(hidden[self._on_device(rows)]).float()
        k = r.sampling_params.prompt_logprobs
        return prompt_logprobs(logits, self._on_device(targets), k, [p + 1 for p in positions])
