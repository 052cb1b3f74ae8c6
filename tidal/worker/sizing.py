"""What a model needs per device before any weight is read: the model is built on the meta device
(shapes only) with the engine's own layers, tensor-parallel sharding and quantization, and the cache
that fits is planned by the engine's own code (`plan_state_slots`, `plan_kv_cache`). So an estimate
for a model too large for this machine (Jamba-1.5-Large on 8 GPUs) uses the numbers a real start-up
would use.

    estimate_memory(config, quantization="experts_int8", tensor_parallel_size=8, device_bytes=80e9)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tidal.worker.memory import plan_kv_cache, plan_state_slots

# Configs of well-known models, for estimates and `tidal plan` (the shape fields of their config.json)
BUNDLED_CONFIGS = {
    "smollm2-135m": ("llama", dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "llama-3-8b": ("llama", dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3-70b": ("llama", dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "mixtral-8x7b": ("mixtral", dict(
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False)),
    "jamba-1.5-mini": ("jamba", dict(
        architectures=["JambaForCausalLM"], vocab_size=65536, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, attn_layer_period=8,
        attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1, num_experts=16, num_experts_per_tok=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256, use_mamba_kernels=False,
        max_position_embeddings=262144, tie_word_embeddings=False)),
    "jamba-1.5-large": ("jamba", dict(
        architectures=["JambaForCausalLM"], vocab_size=65536, hidden_size=8192, intermediate_size=24576,
        num_hidden_layers=72, num_attention_heads=64, num_key_value_heads=8, attn_layer_period=8,
        attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1, num_experts=16, num_experts_per_tok=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=512, use_mamba_kernels=False,
        max_position_embeddings=262144, tie_word_embeddings=False)),
}


def bundled_config(name: str):
    """A bundled config by name, case-insensitive ("Llama-3-8B" or "llama-3-8b")."""
    import transformers
    name = name.lower()
    if name not in BUNDLED_CONFIGS:
        raise ValueError(f"no bundled config {name!r}; bundled: {', '.join(BUNDLED_CONFIGS)}")
    model_type, fields = BUNDLED_CONFIGS[name]
    return transformers.AutoConfig.for_model(model_type, **fields)


@dataclass
class RequestFit:
    context_len: int
    bytes_per_request: int   # KV of context_len tokens + one Mamba state slot, per device
    requests: int            # that fit with the engine's own split of the budget
    best_split_requests: int  # that would fit if the budget split exactly by need


@dataclass
class MemoryEstimate:
    total_params: int
    tensor_parallel_size: int
    quantization: str | None
    kv_cache_dtype: str
    weight_bytes_per_device: int
    kv_bytes_per_token_per_device: int
    state_bytes_per_request_per_device: int
    cache_budget_per_device: int
    fits: list[RequestFit] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _build_on_meta(hf_config, dtype: torch.dtype, quantization: str | None):
    from tidal.layers.quantization import get_quantization_config
    from tidal.layers.quantization.methods import quantize_embeddings
    from tidal.models.registry import resolve_model_class
    quant = get_quantization_config(quantization, hf_config, dtype, dtype)
    model_cls = resolve_model_class(hf_config)
    with torch.device("meta"):
        model = model_cls(hf_config, dtype=dtype, quant=quant) if quant else model_cls(hf_config, dtype=dtype)
        if quant is not None and quant.embedding_format is not None:
            quantize_embeddings(model, quant.embedding_format)
    return model


def _param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def estimate_memory(hf_config, *, dtype: torch.dtype = torch.bfloat16, quantization: str | None = None,
                    kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, device_bytes: float = 80e9,
                    gpu_memory_utilization: float = 0.9, activation_reserve: float = 4e9, block_size: int = 16,
                    max_num_seqs: int = 4096, context_lens=(4096, 262144)) -> MemoryEstimate:
    """Weights, KV cache and Mamba state on one device (rank 0) of `tensor_parallel_size`, and how many
    requests of each context length fit in gpu_memory_utilization x device_bytes, less the weights and
    an activation reserve."""
    from tidal.distributed import set_parallel_state
    from tidal.layers.attention.kv_cache_dtype import kv_cache_torch_dtype
    from tidal.worker.model_runner import ModelRunner
    kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    set_parallel_state(tp_rank=0, tp_size=1)
    try:
        total_params, _ = _param_bytes(_build_on_meta(hf_config, dtype, None))
        set_parallel_state(tp_rank=0, tp_size=tensor_parallel_size)  # rank 0: shapes as that worker builds them
        model = _build_on_meta(hf_config, dtype, quantization)
        runner = ModelRunner(model, dtype, block_size, kv_cache_dtype=kv_dtype)
        kv_per_token = runner.kv_bytes_per_token()
        state_per_request = runner.state_bytes_per_request()
        _, weight_bytes = _param_bytes(model)
    finally:
        set_parallel_state()
    budget = int(device_bytes * gpu_memory_utilization - weight_bytes - activation_reserve)
    est = MemoryEstimate(total_params, tensor_parallel_size, quantization, kv_cache_dtype, weight_bytes,
                         kv_per_token, state_per_request, budget)
    for L in context_lens:
        if budget <= 0:
            est.fits.append(RequestFit(L, state_per_request + L * kv_per_token, 0, 0))
            continue
        # the engine's own split (memory.py): state slots take at most half, the KV cache the rest
        slots = plan_state_slots(state_per_request, max_num_seqs, budget, kv_per_token > 0) if state_per_request \
            else max_num_seqs
        plan = plan_kv_cache(kv_per_token, block_size, L, budget - slots * state_per_request)
        per_request = state_per_request + L * kv_per_token
        est.fits.append(RequestFit(L, per_request, min(slots, plan.num_tokens // L), budget // per_request))
    return est


def describe(est: MemoryEstimate, name: str, device_bytes: float) -> str:
    gb = 1e9
    lines = [f"{name} ({est.total_params / 1e9:.1f}B parameters), TP={est.tensor_parallel_size}, quantization "
             f"{est.quantization or 'none'}, KV cache {est.kv_cache_dtype}, {device_bytes / gb:.0f} GB per device:",
             f"  weights per device: {est.weight_bytes_per_device / gb:.1f} GB",
             f"  KV per token per device: {est.kv_bytes_per_token_per_device} B; Mamba state per request per device: "
             f"{est.state_bytes_per_request_per_device / 2**20:.2f} MiB",
             f"  cache budget per device: {est.cache_budget_per_device / gb:.1f} GB"]
    for f in est.fits:
        lines.append(f"  {f.context_len:>7}-token requests: {f.bytes_per_request / 2**20:9.1f} MiB each per device; "
                     f"{f.requests} fit with the engine's split ({f.best_split_requests} with an exact split)")
    return "\n".join(lines)
