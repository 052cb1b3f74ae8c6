"""EngineConfig: every engine knob, with vLLM's names, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from tidal.device import resolve_device


@dataclass
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    # "auto": CUDA when torch sees a GPU, else CPU; resolved to "cpu" or "cuda" at construction
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    enforce_eager: bool = False  # always true in effect: nothing is compiled or captured as a graph
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    disable_log_stats: bool = True
    # on CUDA: the share of the GPU's memory the engine may fill (weights, activations, KV cache);
    # sizes the KV cache unless kv_cache_memory_bytes is given. No effect on CPU.
    gpu_memory_utilization: float = 0.9
    # speculative decoding, vLLM's dict (tidal/spec_decode/config.py); a SpeculativeConfig once validated
    speculative_config: dict | None = None
    # accepted for compatibility with vLLM scripts; they have no effect
    trust_remote_code: bool = False
    swap_space: float = 0
    tokenizer_mode: str = "auto"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def positive(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            positive(name)
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        # a flag does what it says or is refused: these have no implementation yet
        from tidal.layers.quantization import QUANTIZATION_METHODS
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None for the "
                             f"checkpoint's own weights); got {self.quantization!r}")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported yet: only 'auto' (the KV "
                             "cache in the model's dtype; bf16 under fp32 activations with bf16 weights)")
        self.device = resolve_device(self.device)
        from tidal.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise ValueError("distributed_executor_backend must be 'mp', 'ray' or 'uni', "
                             f"got {self.distributed_executor_backend!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
