"""Engine flags for the CLI and the server, with vLLM's names, mapped onto EngineConfig."""
from __future__ import annotations

import argparse

from tidal.config import TOKENIZER_MODES, EngineConfig, max_num_seqs_default
from tidal.device import resolve_device
from tidal.layers.attention.kv_cache_dtype import KV_CACHE_DTYPES
from tidal.layers.quantization import QUANTIZATION_METHODS


def _bool_flag(parser, name: str, default: bool, help: str) -> None:
    parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=help)


def add_engine_args(parser: argparse.ArgumentParser, disable_log_stats: bool = False) -> argparse.ArgumentParser:
    """The engine flags (docs/cli.md lists each with its default and limits). `disable_log_stats` is the
    default of --disable-log-stats: `generate` and `chat` print text to the terminal, so they keep the
    periodic stats line off unless asked (--no-disable-log-stats)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                   help="model directory (HF format) or .gguf file; default: SmolLM2-135M-Instruct")
    g.add_argument("--tokenizer", default=None,
                   help="load the tokenizer from this directory (tokenizer files) or .gguf file instead of the "
                        "model's (default: the model's)")
    g.add_argument("--tokenizer-mode", default="auto", choices=list(TOKENIZER_MODES),
                   help="auto/hf: transformers' tokenizer (the fast one where there is one); slow: its slow "
                        "(Python) tokenizer, refused where transformers has none (default auto)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility: Tidal never runs code from a checkpoint (logs one line)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype (auto: fp32 for an fp32 checkpoint; else bfloat16 on GPUs and "
                        "CPUs with native bf16 products, fp32 activations with bfloat16 weights on other CPUs)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs (auto: cuda when torch sees a GPU, else cpu)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA: share of the GPU's memory for weights, activations and the KV cache, "
                        "which gets what is left (default 0.9; no effect on CPU)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default and limit: the model's")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="maximum requests running at once (default 256; `tidal serve` on a CPU: 128, vLLM's CPU "
                        "server default)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: max(2048, max-num-seqs); without chunked "
                        "prefill at least max-model-len)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16, at most 1024)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes (default on CPU: min(4 GiB, half the free memory); "
                        "on CUDA: from --gpu-memory-utilization)")
    _bool_flag(g, "commit-kv-cache", None,
               "on a CPU, commit the KV cache's memory at start-up (seconds for a few GiB, as vLLM-CPU does); "
               "--no-commit-kv-cache: only page by page as requests first write it, which costs those requests' "
               "steps a page fault per 4 KiB; default: as they write it, and a server's engine commits the rest "
               "while it is idle, in the order the blocks are handed out")
    _bool_flag(g, "enable-prefix-caching", True, "reuse the KV of repeated prompt prefixes (default on)")
    _bool_flag(g, "enable-chunked-prefill", True,
               "split a prompt longer than a step's token budget across steps (default on); off: each prompt is "
               "computed whole in one step, and --max-num-batched-tokens must be >= --max-model-len")
    _bool_flag(g, "batch-invariant", None,
               "a request's logits, tokens and logprobs bitwise the same whatever else runs with it (batch size, "
               "chunking, prefix-cache hits, preemption). Default: on where supported (the CPU, float32 or "
               "bfloat16, no quantization), off elsewhere; --batch-invariant also takes it on CUDA (Triton "
               "kernels) and refuses settings it does not support, --no-batch-invariant turns it off. "
               "docs/batch_invariance.md")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of sampling for requests without their own seed (default 0)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step runs eagerly (on CUDA, decode steps otherwise replay graphs "
                        "captured at start-up; a CPU runs eagerly either way)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and queue each step while the previous one runs, reading its tokens after (on "
                        "CUDA the GPU does not wait for the host between steps; on a CPU no gain). Not with "
                        "speculative decoding or tensor/pipeline parallelism. Default: on where it applies on "
                        "CUDA, off elsewhere; --no-async-scheduling turns it off")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks, one process each (default 1)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages, one process each (default 1)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray", "uni"], default=None,
                   help="mp: worker processes started here; ray: Ray actors; uni: the engine's own process "
                        "(default: uni for one rank, else mp)")
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                   help="quantize the weights as they load: int8 (int8 weights, W8A16), w8a8 (int8 weights and "
                   "activations), fp8 (E4M3 weights), experts_int8 (only MoE experts in int8), gguf (a GGUF file's "
                   "weights kept in its blocks); default: the "
                   "checkpoint's own weights (an FP8 checkpoint loads as fp8; a GGUF file kept in its blocks); none: "
                   "the checkpoint's weights in the model dtype")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache dtype: auto (the model's dtype; bf16 under fp32 activations with bf16 weights), "
                   "fp8 or fp8_e4m3 (E4M3, one byte per value: twice the tokens of a bf16 cache in the same memory; "
                   "per-layer scales from the checkpoint when it has them, else 1.0)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the checkpoint's weights; dummy: random weights made on the device, no checkpoint read "
                   "(--model: a folder with a config.json, or a bundled config: smollm2-135m, llama-3-8b, ...), for "
                   "benchmarks (default auto)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (docs/speculative_decoding.md)')
    g.add_argument("--served-model-name", default=None,
                   help="the model's name in the API and the logs (default: the model folder's or file's name)")
    default = "on" if disable_log_stats else "off"
    _bool_flag(g, "disable-log-stats", disable_log_stats,
               f"do not log the periodic stats line (every 10 s while there is work; default {default})")
    return parser


def default_max_num_seqs(device: str, server: bool) -> int:
    """--max-num-seqs when not given: vLLM's defaults, 128 for a server on a CPU, else EngineConfig's 256.
    A CPU server under more load than it can serve then runs 128 requests at a time and keeps the rest
    waiting, rather than decoding them all at once (192 requests of 256 -> 128 tokens arriving at 8 req/s on
    2 Zen 4 cores: throughput 348 against 314 output tok/s, mean TPOT 265 against 437 ms)."""
    cpu = server and resolve_device(device) == "cpu"  # (only a server's default depends on the device)
    return max_num_seqs_default(cpu, server)


def engine_config_from_args(args: argparse.Namespace, model: str | None = None, server: bool = False) -> EngineConfig:
    """The EngineConfig of parsed flags; `model` is a subcommand's positional model (`tidal serve MODEL`),
    which may not name another model than --model; `server`: the flags of `tidal serve` (its defaults)."""
    flag = getattr(args, "model_flag", None)
    if model is not None and flag is not None and model != flag:
        raise ValueError(f"two models given: {model!r} and --model {flag!r}; give one")
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = default_max_num_seqs(args.device, server)
    return EngineConfig(
        model=model or flag, tokenizer=args.tokenizer, tokenizer_mode=args.tokenizer_mode,
        trust_remote_code=args.trust_remote_code, served_model_name=args.served_model_name, dtype=args.dtype,
        device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
        commit_kv_cache=args.commit_kv_cache,
        enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, disable_log_stats=args.disable_log_stats,
        speculative_config=args.speculative_config, batch_invariant=args.batch_invariant,
        load_format=args.load_format, async_scheduling=args.async_scheduling,
    )
