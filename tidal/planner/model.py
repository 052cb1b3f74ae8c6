"""ModelProfile: what one device holds and computes for a model, read off the engine's own model built on
the meta device (shapes only) with the tensor-parallel sharding and quantization of rank 0, as
tidal/worker/sizing.py does for memory. Memory figures are sizing.estimate_memory's; the compute
figures (parameters each token multiplies, expert sizes, attention heads, Mamba channels) come from
walking the same modules.

Pipeline parallelism divides the decoder layers between stages; a stage holds its layers' weights,
KV and state, and the first/last stage the embedding and LM head (the larger stage is reported).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from tidal.worker import sizing

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
QUANTIZATIONS = (None, "int8", "w8a8", "fp8", "experts_int8")


@dataclass
class ModelProfile:
    name: str
    total_params: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    quantization: str | None
    kv_cache_dtype: str
    hidden_size: int
    vocab_size: int
    max_model_len: int
    act_bytes: int                   # bytes of one activation element (the model dtype)
    # per device (the larger pipeline stage), as the workers hold them
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_request: int
    # per device, what a step reads and multiplies (all stages: a step runs through each in turn)
    dense_params: int                # linear-layer parameters every token multiplies (not experts, not the head)
    dense_bytes: int
    other_bytes: int                 # norms, convs, routers, biases: read every step, negligible FLOPs
    head_params: int                 # LM head (rows that sample only)
    head_bytes: int
    num_experts: int                 # per MoE layer
    experts_per_token: int
    expert_params: int               # one expert of one layer (this rank's slice), all MoE layers summed
    expert_bytes: int
    num_attn_layers: int
    num_heads: int                   # query heads per device
    head_dim: int
    num_mamba_layers: int
    mamba_d_inner: int               # per device
    mamba_d_state: int
    num_layers: int

    @property
    def num_layers_per_stage(self) -> int:
        return -(-self.num_layers // self.pipeline_parallel_size)


def load_hf_config(model: str):
    """A bundled config name (tidal.worker.sizing.BUNDLED_CONFIGS), a config.json or a model folder."""
    import transformers
    if model.lower() in sizing.BUNDLED_CONFIGS:
        return sizing.bundled_config(model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"model {model!r} is neither a bundled config ({', '.join(sizing.BUNDLED_CONFIGS)}) nor a "
                         "config.json or a folder holding one")
    with open(path) as f:
        fields = json.load(f)
    fields.pop("quantization_config", None)  # sized by --quantization instead
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path} has no model_type")
    return transformers.AutoConfig.for_model(model_type, **fields)


def _walk(model: torch.nn.Module) -> dict:
    from tidal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from tidal.layers.linear import LinearBase
    from tidal.layers.moe import FusedMoE
    out = dict(dense_params=0, dense_bytes=0, other_bytes=0, head_params=0, head_bytes=0, num_experts=0,
               expert_params=0, expert_bytes=0)
    seen: set[int] = set()

    def size(mod):
        ps = [p for p in mod.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in ps)
        return sum(p.numel() for p in ps if p.dim() > 1), sum(p.numel() * p.element_size() for p in ps)

    head = next((m for m in model.modules() if isinstance(m, ParallelLMHead)), None)
    embed = next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding)
                  and not isinstance(m, ParallelLMHead)), None)
    if head is not None:
        out["head_params"], out["head_bytes"] = size(head)
    if not out["head_params"] and embed is not None:  # tied: the embedding table computes the logits
        out["head_params"], out["head_bytes"] = embed.weight.numel(), embed.weight.numel() * embed.weight.element_size()
    if embed is not None:
        size(embed)  # a row per token: not read whole
    for mod in model.modules():
        if isinstance(mod, FusedMoE):
            params, nbytes = size(mod)
            out["num_experts"] = mod.num_experts
            out["expert_params"] += params // mod.num_experts
            out["expert_bytes"] += nbytes // mod.num_experts
        elif isinstance(mod, LinearBase):
            params, nbytes = size(mod)
            out["dense_params"] += params
            out["dense_bytes"] += nbytes
    out["other_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in seen)
    return out


def profile_model(model: str, *, dtype: str = "bfloat16", quantization: str | None = None,
                  kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                  max_model_len: int | None = None) -> ModelProfile:
    """Profile `model` (bundled name or config.json path) on rank 0 of tensor_parallel_size."""
    from tidal.distributed import set_parallel_state
    from tidal.layers.attention.kv_cache_dtype import kv_cache_torch_dtype
    from tidal.worker.model_runner import ModelRunner
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantization == "none":
        quantization = None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)} or none, "
                         f"got {quantization!r}")
    for name, v in (("tensor_parallel_size", tensor_parallel_size), ("pipeline_parallel_size", pipeline_parallel_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    hf = load_hf_config(model)
    torch_dtype = DTYPES[dtype]
    est = sizing.estimate_memory(hf, dtype=torch_dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                 tensor_parallel_size=tensor_parallel_size, context_lens=())
    set_parallel_state(tp_rank=0, tp_size=tensor_parallel_size)
    try:
        meta = sizing._build_on_meta(hf, torch_dtype, quantization)
        runner = ModelRunner(meta, torch_dtype, 16, kv_cache_dtype=kv_cache_torch_dtype(kv_cache_dtype, torch_dtype))
        walked = _walk(meta)
        attn, mamba = runner.attn_layers, runner.mamba_layers
    finally:
        set_parallel_state()
    num_layers = hf.num_hidden_layers
    pp = pipeline_parallel_size
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers")
    # the larger stage: ceil(layers / pp) of the layers, plus the embedding and LM head (held by the end stages)
    ends = walked["head_bytes"] + (0 if getattr(hf, "tie_word_embeddings", False) else
                                   hf.vocab_size // tensor_parallel_size * hf.hidden_size * torch_dtype.itemsize)
    stage = (-(-num_layers // pp)) / num_layers
    weight_bytes = est.weight_bytes_per_device if pp == 1 else int((est.weight_bytes_per_device - ends) * stage + ends)
    limit = getattr(hf, "max_position_embeddings", None) or 2048
    return ModelProfile(
        name=model, total_params=est.total_params, tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pp, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        hidden_size=hf.hidden_size, vocab_size=hf.vocab_size, max_model_len=min(max_model_len or limit, limit),
        act_bytes=torch_dtype.itemsize, weight_bytes=weight_bytes,
        kv_bytes_per_token=-(-est.kv_bytes_per_token_per_device * (-(-num_layers // pp)) // num_layers) if pp > 1
        else est.kv_bytes_per_token_per_device,
        state_bytes_per_request=-(-est.state_bytes_per_request_per_device * (-(-num_layers // pp)) // num_layers)
        if pp > 1 else est.state_bytes_per_request_per_device,
        num_experts=walked["num_experts"], experts_per_token=getattr(hf, "num_experts_per_tok", 0) or 0,
        dense_params=walked["dense_params"], dense_bytes=walked["dense_bytes"], other_bytes=walked["other_bytes"],
        head_params=walked["head_params"], head_bytes=walked["head_bytes"], expert_params=walked["expert_params"],
        expert_bytes=walked["expert_bytes"], num_attn_layers=len(attn),
        num_heads=attn[0].num_heads if attn else 0, head_dim=attn[0].head_dim if attn else 0,
        num_mamba_layers=len(mamba), mamba_d_inner=mamba[0].d_inner if mamba else 0,
        mamba_d_state=mamba[0].d_state if mamba else 0, num_layers=num_layers)
