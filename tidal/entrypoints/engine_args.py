"""Engine flags for the CLI and the server, with vLLM's names, mapped onto EngineConfig."""
from __future__ import annotations

import argparse

from tidal.config import EngineConfig
from tidal.layers.quantization import QUANTIZATION_METHODS


def _bool_flag(parser, name: str, default: bool, help: str) -> None:
    parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=help)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                   help="model directory (HF format) or .gguf file; default: SmolLM2-135M-Instruct")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype (auto: the checkpoint's; bfloat16 for GGUF and fp16)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs (auto: cuda when torch sees a GPU, else cpu)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA: share of the GPU's memory for weights, activations and the KV cache, "
                        "which gets what is left (default 0.9)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="maximum requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: max(2048, max-num-seqs))")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes (default on CPU: min(4 GiB, half the free memory); "
                        "on CUDA: from --gpu-memory-utilization)")
    _bool_flag(g, "enable-prefix-caching", True, "reuse the KV of repeated prompt prefixes")
    _bool_flag(g, "enable-chunked-prefill", True, "split long prompts across steps")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded random sampling")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never compile the model (Tidal always runs eagerly: no compilation or graph capture)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray", "uni"], default=None)
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                   help="quantize the weights as they load: int8 (int8 weights, W8A16), w8a8 (int8 weights and "
                   "activations), fp8 (E4M3 weights), experts_int8 (only MoE experts in int8); default: the "
                   "checkpoint's own weights (an FP8 checkpoint loads as fp8)")
    g.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype (only 'auto': the model's dtype, bf16 "
                   "under fp32 activations with bf16 weights)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (docs/speculative_decoding.md)')
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: derived)")
    _bool_flag(g, "disable-log-stats", False, "do not log periodic engine stats")
    return parser


def engine_config_from_args(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    model = model or getattr(args, "model_flag", None)
    return EngineConfig(
        model=model, tokenizer=args.tokenizer, served_model_name=args.served_model_name, dtype=args.dtype,
        device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, disable_log_stats=args.disable_log_stats,
        speculative_config=args.speculative_config,
    )
