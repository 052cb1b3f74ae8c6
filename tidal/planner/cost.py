"""The time of one engine step from its shape: each kind of work is a roofline, the longer of its FLOPs
at the device's achieved rate and its bytes at the device's bandwidth, and the kinds add up (the engine
runs them one after the other):

- linear layers: 2 x tokens x parameters FLOPs; the weights read once per step;
- MoE experts: top-k experts' FLOPs per token; the bytes of every expert some token routes to (the
  expected number of distinct experts of T tokens choosing k of E: E x (1 - (1 - k/E)^T));
- the LM head, only for the rows that sample;
- attention: 4 x heads x head_dim FLOPs per query-key pair; each request's whole KV read once per layer.
  A KV block that several requests of the step attend to (a shared prefix, the same physical block) is
  fetched from memory once: its first read is charged per KV byte from memory (calibrated: seconds per
  KV byte), the others per KV byte from the caches (calibrated on a batch sharing a prefix);
- Mamba: the state read and written per request, and the scan's elementwise FLOPs per token;
- tensor parallel: two all-reduces of [tokens, hidden] per layer and the logits' gather; pipeline
  parallel: the stages run one after the other inside a step (the engine drains the pipeline each
  step) and pass [tokens, hidden] between them;
- host overhead: per step, per layer (kernel launches), per scheduled request (greedy sampling, outputs)
  and per token (elementwise work and inputs; measured on CPU); under `tidal serve` (served=True) a
  further cost per step and per request of the step, and more per step whose products leave the skinny
  GEMM (a prompt, or a decode of more requests than the device's skinny_max_rows): the HTTP server,
  detokenization and streaming share the host with the engine, and on CPU a step on the blocked GEMM
  loses more to them than a skinny decode (calibrated from served runs).
"""
from __future__ import annotations

from dataclasses import dataclass

from tidal.planner.devices import Device
from tidal.planner.model import ModelProfile


@dataclass
class StepShape:
    num_tokens: int        # tokens whose KV the step computes
    num_seqs: int          # requests scheduled
    num_sampled: int       # requests that sample (their logits are computed)
    attn_pairs: float      # sum over requests of query-key pairs: q x (start + (q + 1) / 2)
    kv_tokens_read: int    # sum over requests of start + q: KV tokens each attention layer reads
    kv_tokens_distinct: int | None = None  # of those, the tokens of distinct blocks (None: all distinct)

    @classmethod
    def of(cls, requests: list[tuple[int, int, bool]], kv_tokens_shared: int = 0) -> StepShape:
        """From (num_tokens, start_pos, samples) per scheduled request; kv_tokens_shared: KV tokens read
        again from a block another request of the step already read."""
        read = sum(q + s for q, s, _ in requests)
        return cls(sum(q for q, _, _ in requests), len(requests), sum(1 for *_, s in requests if s),
                   sum(q * (s + (q + 1) / 2) for q, s, _ in requests), read, read - kv_tokens_shared)


class CostModel:
    def __init__(self, model: ModelProfile, device: Device, served: bool = False) -> None:
        self.model, self.device, self.served = model, device, served
        self.kind = "int8" if model.quantization == "w8a8" else ("fp32" if model.act_bytes == 4 else "bf16")

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        m, d = self.model, self.device
        bw, T = d.achieved_bandwidth, max(shape.num_tokens, 1)
        rate = d.gemm_rate(T, self.kind)
        flops = 2 * T * m.dense_params
        nbytes = m.dense_bytes + m.other_bytes
        if m.num_experts:
            k, E = m.experts_per_token, m.num_experts
            flops += 2 * T * k * m.expert_params
            nbytes += E * (1 - (1 - k / E) ** T) * m.expert_bytes
        out = {"linear": max(flops / rate, nbytes / bw)}
        S = shape.num_sampled
        out["lm_head"] = max(2 * S * m.head_params / d.gemm_rate(max(S, 1)), m.head_bytes / bw) if S else 0.0
        attn_flops = 4 * m.num_heads * m.head_dim * shape.attn_pairs * m.num_attn_layers
        distinct = shape.kv_tokens_read if shape.kv_tokens_distinct is None else shape.kv_tokens_distinct
        per_byte = d.attention_seconds_per_kv_byte or 1 / bw
        per_cached_byte = per_byte if d.attention_seconds_per_cached_kv_byte is None \
            else d.attention_seconds_per_cached_kv_byte
        kv_time = m.kv_bytes_per_token * (distinct * per_byte + (shape.kv_tokens_read - distinct) * per_cached_byte)
        out["attention"] = max(attn_flops / (d.attention_flops or d.peak_gemm_rate), kv_time)
        if m.num_mamba_layers:
            scan_flops = 10 * T * m.num_mamba_layers * m.mamba_d_inner * m.mamba_d_state
            out["mamba"] = max(scan_flops / d.vector_flops, 2 * shape.num_seqs * m.state_bytes_per_request / bw)
        tp, pp = m.tensor_parallel_size, m.pipeline_parallel_size
        comm = 0.0
        if tp > 1:
            ibw, lat = d.interconnect_bandwidth, d.interconnect_latency
            act = T * m.hidden_size * m.act_bytes
            comm += 2 * m.num_layers * (lat + 2 * (tp - 1) / tp * act / ibw)
            comm += lat + S * m.vocab_size * 4 / ibw  # logits gathered from the vocabulary shards
        if pp > 1:
            comm += (pp - 1) * (d.interconnect_latency + T * m.hidden_size * m.act_bytes / d.interconnect_bandwidth)
        out["communication"] = comm
        out["overhead"] = d.step_overhead + d.layer_overhead * m.num_layers + d.request_overhead * shape.num_seqs \
            + d.token_overhead * shape.num_tokens
        if self.served:
            out["overhead"] += d.serve_step_overhead + d.serve_request_overhead * shape.num_seqs
            if not self.skinny(shape):
                out["overhead"] += d.serve_wide_step_overhead
        return out

    def skinny(self, shape: StepShape) -> bool:
        """Whether the step's products run on the skinny GEMM: a decode (one token per request) of at most
        the device's skinny_max_rows requests; a step with a prompt never does."""
        return shape.num_tokens == shape.num_seqs <= self.device.skinny_max_rows

    def step_time(self, shape: StepShape) -> float:
        return sum(self.breakdown(shape).values())
