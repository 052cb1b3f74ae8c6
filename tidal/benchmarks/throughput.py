"""`tidal bench throughput`: offline throughput of the engine on a fixed request set, with vLLM's
options, optionally beside Hugging Face transformers' static-batched `generate` on the same requests.

    tidal bench throughput --workload offline --dtype bfloat16 --compare hf
    tidal bench throughput --dataset random --num-prompts 64 --input-len-range 32 512 \
        --output-len-range 16 256 --seed 0 --output-json out.json

Every request is greedy with ignore_eos, so it produces exactly max_tokens tokens and the token
counts are the same whatever engine runs them. One warm-up generate on a different, smaller request
set runs first (first-call costs: allocator growth, kernel selection), then the prefix cache is
reset so the timed run starts cold.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

from tidal.benchmarks import datasets
from tidal.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tidal.layers.attention.kv_cache_dtype import describe_kv_cache_dtype

WARMUP_MAX_PROMPTS = 16


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = parser.add_argument_group("requests (an option that does not apply to the chosen requests is refused)")
    d.add_argument("--workload", choices=sorted(datasets.WORKLOADS), default=None,
                   help="a shared side-by-side workload, draw for draw (takes no other request option)")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", choices=["random", "prefix"], default=None,
                   help="random (default): lengths drawn from the ranges below; prefix: one shared prefix + own "
                        "suffixes")
    d.add_argument("--dataset-path", default=None,
                   help='JSON list of {"prompt_token_ids": [...], "max_tokens": n} (with --num-prompts: the first N)')
    d.add_argument("--num-prompts", type=int, default=None, help="number of requests (random: 128, prefix: 64)")
    d.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="random: prompt lengths, inclusive (default 32 512)")
    d.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="random: output lengths, inclusive (default 16 256)")
    d.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=None,
                   help="random: prompt length (a range with --random-range-ratio)")
    d.add_argument("--random-output-len", dest="random_output_len", type=int, default=None,
                   help="random: output length (a range with --random-range-ratio)")
    d.add_argument("--random-range-ratio", type=float, default=None,
                   help="random: lengths drawn from [L*(1-r), L*(1+r)] around --random-input-len, "
                        "--random-output-len or --output-len (default 0)")
    d.add_argument("--prefix-len", type=int, default=None, help="prefix: shared prefix length (default 1024)")
    d.add_argument("--suffix-len", type=int, default=None, help="prefix: per-request suffix length (default 64)")
    d.add_argument("--output-len", type=int, default=None,
                   help="prefix: tokens generated per request (default 64); random: a fixed output length")
    r = parser.add_argument_group("run")
    r.add_argument("--runs", type=int, default=1, help="timed runs (the best is reported)")
    r.add_argument("--disable-detokenize", action="store_true", help="do not detokenize outputs")
    r.add_argument("--compare", choices=["hf"], default=None,
                   help="also run Hugging Face transformers' static-batched generate on the same requests")
    r.add_argument("--hf-batch-size", type=int, default=32, help="batch size of the transformers run")
    r.add_argument("--output-json", default=None, help="write the results to this JSON file")
    add_engine_args(parser)  # its --seed also draws the random and prefix request sets
    return parser


# -- requests ------------------------------------------------------------------------------------

def _len_range(explicit, single: int | None, ratio: float, default: tuple[int, int]) -> tuple[int, int]:
    if explicit is not None:
        return tuple(explicit)
    if single is not None:
        return max(1, int(single * (1 - ratio))), max(1, int(single * (1 + ratio)))
    return default


_REQUEST_FLAGS = {"--dataset": "dataset", "--dataset-path": "dataset_path", "--num-prompts": "num_prompts",
                  "--input-len-range": "input_len_range", "--output-len-range": "output_len_range",
                  "--random-input-len": "input_len", "--random-output-len": "random_output_len",
                  "--random-range-ratio": "random_range_ratio", "--prefix-len": "prefix_len",
                  "--suffix-len": "suffix_len", "--output-len": "output_len"}


def check_request_options(args) -> None:
    """Refuse request options that the chosen requests would ignore (before the model loads)."""
    given = {flag for flag, dest in _REQUEST_FLAGS.items() if getattr(args, dest) is not None}
    if args.workload:
        source, applies = f"--workload {args.workload}", set()
    elif args.dataset_path:
        source, applies = "--dataset-path", {"--dataset-path", "--num-prompts"}
    elif args.dataset == "prefix":
        source, applies = "--dataset prefix", {"--dataset", "--num-prompts", "--prefix-len", "--suffix-len",
                                               "--output-len"}
    else:
        source, applies = "--dataset random", {"--dataset", "--num-prompts", "--input-len-range",
                                               "--output-len-range", "--random-input-len", "--random-output-len",
                                               "--random-range-ratio", "--output-len"}
        if "--random-range-ratio" in given and not given & {"--random-input-len", "--random-output-len",
                                                            "--output-len"}:
            applies = applies - {"--random-range-ratio"}  # it widens only the single lengths
    datasets.refuse_unused_options("bench throughput", given, source, applies, [
        ("--input-len-range", "--random-input-len"), ("--output-len-range", "--random-output-len"),
        ("--output-len-range", "--output-len"), ("--random-output-len", "--output-len")])


def build_requests(args, vocab_size: int | None) -> tuple[list[dict], list[dict]]:
    """(timed requests, warm-up requests). The warm-up set is drawn with another seed and is smaller."""
    check_request_options(args)
    if args.workload:
        return datasets.workload_requests(args.workload), datasets.workload_warmup(args.workload)
    if args.dataset_path:
        reqs = datasets.load_json_requests(args.dataset_path)[:args.num_prompts]
        ins = [len(r["prompt_token_ids"]) for r in reqs]
        outs = [r["max_tokens"] for r in reqs]
        warm = datasets.random_requests(min(WARMUP_MAX_PROMPTS, len(reqs)), (min(ins), max(ins)),
                                        (min(outs), max(outs)), args.seed + datasets.WARMUP_SEED, vocab_size)
        return reqs, warm
    if args.dataset == "prefix":
        n = args.num_prompts or 64
        out_len = args.output_len or 64

        def make(num, seed):
            return datasets.prefix_requests(num, args.prefix_len or 1024, args.suffix_len or 64, out_len, seed,
                                            vocab_size)
        return make(n, args.seed), make(min(8, n), args.seed + datasets.WARMUP_SEED)
    n = args.num_prompts or 128
    ratio = args.random_range_ratio or 0.0
    in_range = _len_range(args.input_len_range, args.input_len, ratio, (32, 512))
    out_range = _len_range(args.output_len_range, args.random_output_len or args.output_len, ratio, (16, 256))

    def make(num, seed):
        return datasets.random_requests(num, in_range, out_range, seed, vocab_size)
    return make(n, args.seed), make(min(WARMUP_MAX_PROMPTS, n), args.seed + datasets.WARMUP_SEED)


def _inputs(requests: list[dict], detokenize: bool):
    from tidal.sampling_params import SamplingParams
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=detokenize)
              for r in requests]
    return prompts, params


# -- tidal ---------------------------------------------------------------------------------------

def run_tidal(llm, requests: list[dict], warmup: list[dict], runs: int = 1, detokenize: bool = True,
              progress: bool = False) -> dict:
    """Warm up, then time `runs` generate calls over requests; returns the best run's figures."""
    engine = llm.llm_engine
    llm.generate(*_inputs(warmup, detokenize), use_tqdm=False)
    prompts, params = _inputs(requests, detokenize)
    num_prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    results = []
    for _ in range(runs):
        llm.reset_prefix_cache()
        stats = engine.stats
        # EngineStats accumulates over the engine's life: take differences around the timed call.
        util0, steps0, pre0 = stats.kv_util_sum, stats.kv_util_steps, stats.num_preemptions
        hits0, queries0 = stats.prefix_hits, stats.prefix_queries
        drafted0, accepted0 = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=progress)
        elapsed = time.perf_counter() - t0
        num_output = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = engine.stats.kv_util_steps - steps0
        ttft, tpot = [], []
        for o in outs:
            m, n = o.metrics, len(o.outputs[0].token_ids)
            if m is not None and m.first_token_time is not None:
                ttft.append(m.first_token_time - m.arrival_time)
                if n > 1 and m.last_token_time is not None:
                    tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
        queries = stats.prefix_queries - queries0
        results.append({
            "elapsed_s": elapsed,
            "num_requests": len(requests),
            "num_prompt_tokens": num_prompt_tokens,
            "num_output_tokens": num_output,
            "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": num_output / elapsed,
            "total_tokens_per_s": (num_prompt_tokens + num_output) / elapsed,
            "exact_lengths": all(len(o.outputs[0].token_ids) == r["max_tokens"] for o, r in zip(outs, requests)),
            "kv_utilization": (stats.kv_util_sum - util0) / steps if steps else 0.0,
            "num_steps": steps,
            "num_preemptions": stats.num_preemptions - pre0,
            "prefix_cache_hit_rate": (stats.prefix_hits - hits0) / queries if queries else 0.0,
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None,
            "mean_tpot_s": sum(tpot) / len(tpot) if tpot else None,
            "spec_draft_tokens": stats.spec_num_draft_tokens - drafted0,  # speculative decoding
            "spec_accepted_tokens": stats.spec_num_accepted_tokens - accepted0,
        })
    best = max(results, key=lambda r: r["output_tokens_per_s"])
    return dict(best, runs=[{k: r[k] for k in ("elapsed_s", "output_tokens_per_s")} for r in results])


# -- Hugging Face transformers -------------------------------------------------------------------

def hf_model_path(model: str | None) -> tuple[str, dict]:
    """(folder, extra from_pretrained kwargs) for transformers: a GGUF file goes through Tidal's
    one-time conversion folder when the loader provides one, else through transformers' GGUF reader."""
    from tidal.loader import resolve_model_path
    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        return path, {}
    from tidal.loader import gguf_loader
    if hasattr(gguf_loader, "cached_conversion"):
        return gguf_loader.cached_conversion(path), {}
    return os.path.dirname(path), {"gguf_file": os.path.basename(path)}


def run_hf(model: str | None, dtype, requests: list[dict], warmup: list[dict], batch_size: int = 32,
           device: str = "cpu") -> dict:
    """transformers' generate over static batches of batch_size requests in the given order, prompts
    left-padded, each batch run to its longest max_tokens, on the same device as Tidal's run. Only
    useful tokens count: a request's own max_tokens, not the padding nor the tokens past its end
    that its batch still computes."""
    import torch
    import transformers
    if batch_size < 1:
        raise ValueError(f"hf_batch_size must be >= 1, got {batch_size}")
    path, extra = hf_model_path(model)
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).to(device).eval()
    load_s = time.perf_counter() - t0
    gen_cfg = hf.generation_config
    pad_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]

    def run_batch(hf, batch: list[dict]) -> None:
        lens = [len(r["prompt_token_ids"]) for r in batch]
        width, new = max(lens), max(r["max_tokens"] for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - lens[i]:] = torch.tensor(r["prompt_token_ids"])
            mask[i, width - lens[i]:] = 1
        # min_new_tokens = max_new_tokens: EOS is suppressed, every row generates exactly `new` tokens.
        out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {new}")

    with torch.inference_mode():
        run_batch(hf, [dict(r, max_tokens=min(r["max_tokens"], 4)) for r in warmup[:2]])
        t0 = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            run_batch(hf, requests[i:i + batch_size])
        elapsed = time.perf_counter() - t0
    useful = sum(r["max_tokens"] for r in requests)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    del hf
    gc.collect()
    return {"elapsed_s": elapsed, "load_s": load_s, "batch_size": batch_size, "num_output_tokens": useful,
            "requests_per_s": len(requests) / elapsed, "output_tokens_per_s": useful / elapsed,
            "total_tokens_per_s": (prompt_tokens + useful) / elapsed}


# -- command -------------------------------------------------------------------------------------

def _machine(device: str = "cpu") -> dict:
    """Device, threads and load: a contended CPU (another process on a core) slows a run several-fold."""
    import torch
    machine = {"device": device, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
               "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
        machine["torch_cuda"] = torch.version.cuda
    return machine


def _print_report(tidal: dict, hf: dict | None, dtype: str, machine: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)
    load = machine["load_average_1min"]
    if load is not None and load > machine["cpu_count"] + 0.5 and machine.get("device", "cpu") == "cpu":
        p(f"WARNING: load average {load:.1f} on {machine['cpu_count']} CPUs: other processes share the cores, "
          "figures are contended")
    where = machine.get("gpu") or machine.get("device", "cpu")
    p(f"Requests: {tidal['num_requests']} ({tidal['num_prompt_tokens']} prompt + "
      f"{tidal['num_output_tokens']} output tokens), {dtype} on {where}, elapsed {tidal['elapsed_s']:.2f} s")
    p(f"Throughput: {tidal['requests_per_s']:.2f} requests/s, {tidal['total_tokens_per_s']:.1f} total tokens/s, "
      f"{tidal['output_tokens_per_s']:.1f} output tokens/s")
    if "kv_cache_dtype" in tidal:
        p(f"KV cache: {tidal['kv_cache_dtype']}, {tidal['kv_cache_tokens']} tokens")
    p(f"KV cache utilization: {100 * tidal['kv_utilization']:.1f}% (allocated slots holding tokens, mean over "
      f"{tidal['num_steps']} steps); preemptions: {tidal['num_preemptions']}; prefix cache hit rate: "
      f"{100 * tidal['prefix_cache_hit_rate']:.1f}%")
    if tidal["num_requests"] == 1 and tidal["mean_tpot_s"] is not None:
        p(f"Time per output token: {1000 * tidal['mean_tpot_s']:.2f} ms; time to first token: "
          f"{1000 * tidal['mean_ttft_s']:.1f} ms")
    if tidal.get("spec_draft_tokens"):
        p(f"Speculative decoding: {tidal['spec_accepted_tokens']} of {tidal['spec_draft_tokens']} draft tokens "
          f"accepted ({100 * tidal['spec_accepted_tokens'] / tidal['spec_draft_tokens']:.1f}%)")
    if not tidal["exact_lengths"]:
        p("WARNING: some requests did not produce exactly max_tokens tokens")
    if hf is not None:
        p(f"HF transformers (static batches of {hf['batch_size']}): {hf['output_tokens_per_s']:.1f} useful output "
          f"tokens/s, {hf['requests_per_s']:.2f} requests/s, elapsed {hf['elapsed_s']:.2f} s")
        p(f"Tidal / HF output tokens/s: {tidal['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x")


def main(args: argparse.Namespace) -> int:
    from tidal.entrypoints.llm import LLM
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    check_request_options(args)  # before the model loads
    config = engine_config_from_args(args)
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if config.batch_invariant_auto:  # left to the engine, which turns it off on a quantized checkpoint
        kwargs["batch_invariant"] = None
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    requests, warmup = build_requests(args, engine.vocab_size)
    machine = _machine(config.device)  # load before the run: the benchmark's own load would read as contention
    tidal = run_tidal(llm, requests, warmup, args.runs, not args.disable_detokenize,
                      progress=sys.stderr.isatty())
    tidal.update(kv_cache_dtype=describe_kv_cache_dtype(engine.kv_cache_dtype),
                 kv_cache_tokens=engine.kv_plan.num_tokens)
    dtype = str(engine.dtype).removeprefix("torch.")
    hf = None
    if args.compare == "hf":
        torch_dtype = engine.dtype
        del llm, engine  # free the KV cache before transformers loads its own copy of the model
        gc.collect()
        hf = run_hf(config.model, torch_dtype, requests, warmup, args.hf_batch_size, config.device)
    _print_report(tidal, hf, dtype, machine)
    if args.output_json:
        result = {"dtype": dtype, "model": config.model, "machine": machine, "tidal": tidal}
        if hf is not None:
            result["hf"] = hf
            result["tidal_over_hf"] = tidal["output_tokens_per_s"] / hf["output_tokens_per_s"]
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
