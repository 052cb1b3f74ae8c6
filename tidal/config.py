"""EngineConfig: every engine knob, with vLLM's names, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, fields

from tidal.device import resolve_device

# "auto" and "hf": transformers' AutoTokenizer (its fast tokenizer where there is one); "slow": its slow
# (Python) tokenizer, refused at load time where transformers has none for the model
TOKENIZER_MODES = ("auto", "hf", "slow")

# what a process that receives a pickled EngineConfig (its model's transformers config inside) will import to
# unpickle it, ~3 s: the engine-core and worker processes import them before their config arrives
HF_CONFIG_MODULES = ("transformers.configuration_utils", "transformers.utils.type_validators")


# vLLM's default max_num_seqs for its OpenAI server on a CPU (256 for its offline LLM, as EngineConfig's)
SERVER_CPU_MAX_NUM_SEQS = 128


def max_num_seqs_default(cpu: bool, server: bool) -> int:
    """vLLM's default of requests running at once: 128 for a server on a CPU, else EngineConfig's 256."""
    return SERVER_CPU_MAX_NUM_SEQS if cpu and server else EngineConfig.max_num_seqs


def step_tokens_default(cpu: bool, offline: bool) -> int:
    """vLLM's default step budget before max_num_seqs and max_model_len raise it: 4096 tokens for the offline
    engine on a CPU (fewer, larger prompt steps), 2048 otherwise (a server, and any CUDA engine: on an H200
    the offline workload of a SmolLM2-shaped model with asynchronous scheduling ran at 14,916 output tok/s
    with 2,048-token steps against 12,363 with 16,384, docs/gpu.md)."""
    return 4096 if cpu and offline else 2048


@dataclass
class EngineConfig:
    """Every engine knob; docs/cli.md says what each does, its default and what is refused."""
    model: str | None = None
    # a directory with tokenizer files (or a .gguf file) to load the tokenizer from instead of the model's
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    served_model_name: str | None = None
    dtype: str = "auto"
    # "auto": CUDA when torch sees a GPU, else CPU; resolved to "cpu" or "cuda" at construction
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256  # `tidal serve` on a CPU: max_num_seqs_default (tidal.entrypoints.engine_args)
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    # on a CPU, when the KV cache's memory is committed (its pages faulted in): True, at start-up, after a
    # warm-up forward (before the first request); None, by a server's engine loop while it is idle, in the
    # order the blocks are handed out (and, until then, by the first writes); False, only page by page as
    # requests first write it, inside their steps
    commit_kv_cache: bool | None = None
    enable_prefix_caching: bool = True
    # False: a prompt is computed whole in one step (never split across steps), which needs
    # max_num_batched_tokens >= max_model_len (the default budget is raised to it)
    enable_chunked_prefill: bool = True
    seed: int = 0  # seeds the sampler's generator for requests without their own seed
    # True: no CUDA graphs (on CUDA, decode-only steps otherwise replay graphs captured at start-up where
    # tidal/worker/cuda_graphs.py says they apply); a CPU runs eagerly either way. torch.compile never runs
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # False: the engine logs a stats line (throughput, running/waiting requests, KV cache usage) every
    # 10 s while it has work; True by default in the offline API, as vLLM's LLM
    disable_log_stats: bool = True
    # on CUDA: the share of the GPU's memory the engine may fill (weights, activations, KV cache);
    # sizes the KV cache unless kv_cache_memory_bytes is given. No effect on CPU (a warning says so).
    gpu_memory_utilization: float = 0.9
    # speculative decoding, vLLM's dict (tidal/spec_decode/config.py); a SpeculativeConfig once validated
    speculative_config: dict | None = None
    # Tidal never runs code from a checkpoint (its own implementations of the supported architectures
    # load the weights), so True is harmless: it is accepted with one log line saying so
    trust_remote_code: bool = False
    # "auto": the checkpoint's weights; "dummy" (vLLM's name): random weights made on the device, no checkpoint
    # read (model: a config.json folder, or a bundled config of tidal/worker/sizing.py), for benchmarks
    load_format: str = "auto"
    # vLLM's CPU swap space (GiB) for preempted requests' KV blocks: Tidal preempts by recomputation,
    # so only 0 is accepted
    swap_space: float = 0
    # True: each request's logits are bitwise the same whatever else runs in the same steps (batch size,
    # chunk boundaries, prefix-cache hits, preemption): every reduction in a fixed order per row
    # (docs/batch_invariance.md). None (default): on where it is supported (the CPU, fp32 or bf16, plain
    # weights), off elsewhere; True refuses what it does not support.
    batch_invariant: bool | None = None
    # True: the engine schedules step N + 1 and queues it while step N runs, and reads step N's tokens after
    # (on CUDA the GPU never waits for the host between steps; on CPU the same outputs at no gain). The model
    # in the engine's process, without speculative decoding (tidal/engine/llm_engine.py, docs/gpu.md).
    # None (default): on where it pays and applies (CUDA, the model in the engine's process, no speculative
    # decoding), off elsewhere; True refuses what it does not support
    async_scheduling: bool | None = None

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
        # a flag does what it says or is refused
        from tidal.layers.quantization import QUANTIZATION_METHODS
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None for the "
                             f"checkpoint's own weights); got {self.quantization!r}")
        from tidal.layers.attention.kv_cache_dtype import check_kv_cache_dtype
        check_kv_cache_dtype(self.kv_cache_dtype)  # "auto" (the model's dtype), "fp8" / "fp8_e4m3"
        from tidal.loader.loader import LOAD_FORMATS
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.load_format == "dummy" and self.quantization is not None:
            raise ValueError(f"load_format 'dummy' makes plain random weights: quantization {self.quantization!r} "
                             "needs a checkpoint")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)}; got {self.tokenizer_mode!r} "
                             "(Tidal loads tokenizers with transformers only: no 'mistral' or custom tokenizers)")
        if self.swap_space != 0:
            raise ValueError(f"swap_space {self.swap_space!r} is not supported: Tidal preempts a request by "
                             "recomputation (its KV blocks are freed and recomputed when it is resumed), it never "
                             "swaps KV blocks to CPU memory; leave swap_space at 0")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"tokenizer must be a path (a directory with tokenizer files or a .gguf file), "
                             f"got {self.tokenizer!r}")
        self.device = resolve_device(self.device)
        # None: "auto", resolved here; the engine turns it off after loading a checkpoint quantized in itself
        self.batch_invariant_auto = self.batch_invariant is None
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True, False or None (on where supported), got "
                             f"{self.batch_invariant!r}")
        unsupported = self.batch_invariant_unsupported()
        if self.batch_invariant and unsupported:
            raise ValueError(f"batch_invariant=True {unsupported}")
        if self.batch_invariant is None:
            self.batch_invariant = unsupported is None
        from tidal.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise ValueError("distributed_executor_backend must be 'mp', 'ray' or 'uni', "
                             f"got {self.distributed_executor_backend!r}")
        if self.commit_kv_cache is not None and not isinstance(self.commit_kv_cache, bool):
            raise ValueError("commit_kv_cache must be True, False or None (the default: a server commits it while "
                             f"idle), got {self.commit_kv_cache!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False (or None: on where it applies on CUDA), got "
                             f"{self.async_scheduling!r}")
        if self.async_scheduling is None:
            from tidal.worker.executor import uses_workers
            self.async_scheduling = (self.device.startswith("cuda") and self.speculative_config is None
                                     and not uses_workers(self))
        elif self.async_scheduling:
            if self.speculative_config is not None:
                raise ValueError("async_scheduling=True cannot run with speculative decoding: a step's drafts need "
                                 "the previous step's tokens on the host; drop one of the two")
            from tidal.worker.executor import uses_workers
            if uses_workers(self):
                raise ValueError("async_scheduling=True needs the model in the engine's process: it is not supported "
                                 "with tensor_parallel_size or pipeline_parallel_size above 1, nor with "
                                 f"distributed_executor_backend {self.distributed_executor_backend!r}")

    def batch_invariant_unsupported(self) -> str | None:
        """Why batch-invariant mode cannot run with these settings (None: it can). The mode covers the
        CPU's fp32 and bf16 products with plain weights; anything else is refused rather than silently
        left dependent on the batch (docs/batch_invariance.md)."""
        if self.device != "cpu" and not (self.device.startswith("cuda") and self.batch_invariant):
            # CUDA only when asked for: its Triton kernels are not yet measured on a GPU (docs/batch_invariance.md)
            return (f"is on by default on the CPU only; on device {self.device!r} pass batch_invariant=True"
                    if self.device.startswith("cuda") else f"is implemented on the CPU and CUDA, not {self.device!r}")
        if self.device.startswith("cuda"):
            from tidal.layers.triton_utils import triton_available
            if not triton_available():
                return "on CUDA runs Triton kernels: install triton (pip install 'tidal[gpu]')"
        if self.dtype in ("float16", "half"):
            return f"supports dtype float32, bfloat16 or auto, not {self.dtype!r}"
        if self.quantization not in (None, "none", "gguf"):  # gguf: checked once the activation dtype is known
            return (f"runs plain weights or GGUF blocks: quantization {self.quantization!r} is not supported with "
                    "it (its kernels are not batch-invariant)")
        return None

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
