"""`tidal plan`: will this model fit, and what traffic will it carry? The engine's scheduler and cache
managers run in simulated time on a device from the table or a calibration file (see
tidal/planner/__init__.py); `tidal plan calibrate` measures this machine.

    tidal plan --model jamba-1.5-large --quantization experts_int8 -tp 8 --device H100-80GB \
        --input-len 4096 --output-len 256 --context-lens 4096 262144
    tidal plan --model llama-3-8b --device H100-80GB --slo-ttft 500 --slo-tpot 50 --plot latency.png
    tidal plan calibrate --model ~/.cache/tidal-peers/smollm2-135m-instruct --output cpu.json
"""
from __future__ import annotations

import argparse
import json
import os

from tidal.worker.sizing import BUNDLED_CONFIGS

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal")  # tidal.planner.workload.DISTRIBUTIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", default="smollm2-135m",
                   help=f"a bundled config ({', '.join(BUNDLED_CONFIGS)}; any case), a config.json or a model folder")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--quantization", default=None, choices=["int8", "w8a8", "fp8", "experts_int8", "none"])
    m.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    m.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    m.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    m.add_argument("--device", default="cpu",
                   help="H100-80GB, H200, A100-80GB, L40S (datasheet figures) or cpu (the reference CPU's calibration: "
                        "a 2-core AMD EPYC Zen 4, AVX-512 BF16)")
    m.add_argument("--calibration", default=None, help="a device file from `tidal plan calibrate` (replaces --device)")
    e = p.add_argument_group("engine (as `tidal serve`)")
    e.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: the engine's, 256 (128 for `tidal serve` on a CPU device)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    e.add_argument("--served", action=argparse.BooleanOptionalAction, default=None,
                   help="cost the server's own work (a calibration's serve_* figures: per step, and its latency to "
                        "each first token): default on, "
                        "off for --workload offline/shared_prefix (the offline engine)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=256)
    w.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson (default inf: all at once)")
    w.add_argument("--burstiness", type=float, default=1.0)
    for what, default in (("input", 512), ("output", 128)):
        flag = f"--{what}-len"
        w.add_argument(flag, type=int, default=default,
                       help=f"{what} tokens per request (default {default}); with {flag}-dist lognormal, their mean")
        w.add_argument(f"{flag}-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                       help=f"uniform over LO..HI; with {flag}-dist lognormal, the bounds of its draws")
        w.add_argument(f"{flag}-dist", choices=LENGTH_DISTRIBUTIONS, default=None,
                       help=f"how {what} lengths are drawn: fixed ({flag}), uniform ({flag}-range) or lognormal "
                            f"(mean {flag}, spread {flag}-sigma; rounded, kept within {flag}-range or else "
                            f"max_model_len); default uniform with {flag}-range, else fixed")
        w.add_argument(f"{flag}-sigma", type=_positive_float, default=None,
                       help="lognormal: the standard deviation of the log length (default 1)")
    w.add_argument("--prefix-len", type=int, default=0, help="tokens every prompt shares with others (prefix caching)")
    w.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    w.add_argument("--workload", choices=["offline", "shared_prefix"], default=None,
                   help="the benchmarks' request sets (tidal bench throughput --workload), at --request-rate")
    w.add_argument("--trace", default=None, help="JSON (lines) of {arrival_time, prompt_len, output_len}")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--context-lens", type=int, nargs="+", default=None,
                   help="context lengths to count the requests that fit at once (default 4096 and max_model_len)")
    o.add_argument("--slo-ttft", type=float, default=None, help="ms: find the highest rate meeting it")
    o.add_argument("--slo-tpot", type=float, default=None, help="ms: find the highest rate meeting it")
    o.add_argument("--slo-percentile", choices=["p50", "p99"], default="p99")
    o.add_argument("--sweep", type=float, nargs="*", default=None,
                   help="request rates to tabulate (no value: 0.1 to 2 x the saturation rate)")
    o.add_argument("--plot", default=None, help="PNG of latency against request rate (needs matplotlib)")
    o.add_argument("--output-json", default=None)


def register(subparsers) -> None:
    # allow_abbrev=False: the calibrate subcommand's --output must not read as an abbreviation of --output-json
    p = subparsers.add_parser("plan", help="capacity planner: the real scheduler in simulated time", allow_abbrev=False,
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="plan_command")
    c = sub.add_parser("calibrate", help="measure this machine into a device file for --calibration")
    c.add_argument("--model", default=os.path.join(os.path.expanduser("~/.cache/tidal-peers"), "smollm2-135m-instruct"),
                   help="a model folder (bf16 is timed)")
    c.add_argument("--output", default="tidal-calibration.json")
    c.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 2048],
                   help="rows of the timed products (2048: the default step budget of tokens)")
    c.add_argument("--batch", type=int, default=16, help="the batch timed at the short and the long context")
    c.add_argument("--contexts", type=int, nargs=2, default=[64, 1024], metavar=("SHORT", "LONG"))
    c.add_argument("--steps", type=int, default=30)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--wide", type=int, default=64, help="the wide decode batch (per-request cost, shared prefix)")
    c.add_argument("--serve", action="store_true",
                   help="also measure the server: start `tidal serve` on the model (a free local port), run `tidal "
                        "bench serve` at --serve-rates after a warm-up, stop it, and fit the server's cost per step, "
                        "its extra cost per step off the skinny GEMM and its latency to a request's first token "
                        "(about a minute more with the defaults)")
    c.add_argument("--serve-rates", type=float, nargs="+", default=None,
                   help="--serve: request rates (req/s, Poisson), run in order (default 0.5 6: a low rate fits the "
                        "cost per step, a high one the extra cost off the skinny GEMM)")
    c.add_argument("--serve-num-prompts", type=int, default=None, help="--serve: requests per rate (default 16)")
    c.add_argument("--serve-input-len", type=int, default=None,
                   help="--serve: random prompt tokens per request (default 128)")
    c.add_argument("--serve-output-len", type=int, default=None, help="--serve: tokens out per request (default 64)")
    c.add_argument("--serve-result", nargs="+", default=None,
                   help="instead of --serve, served runs measured before: JSON of `tidal bench serve` runs against "
                        "`tidal serve` on this machine, the entries of one benchmarks/serve_sweep.py run (random "
                        "dataset), in the order it ran them; one low rate fits the server's cost per step, two "
                        "rates (low and high) also its extra cost per step off the skinny GEMM; and its latency to "
                        "a request's first token")
    c.add_argument("--serve-max-model-len", type=int, default=2048, help="the served engine's max_model_len")
    c.set_defaults(func=_calibrate)


def _calibrate(args) -> int:
    from tidal.planner import calibrate
    return calibrate.main(args)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def lengths(args, what: str):
    """The prompt ("input") or output lengths of the plan's synthetic workload: a (LO, HI) range (LO == HI:
    fixed) or workload.Lengths; a ValueError names the arguments that do not go together."""
    from tidal.planner import workload
    n, span, dist, sigma = (getattr(args, f"{what}_len{s}", None) for s in ("", "_range", "_dist", "_sigma"))
    flag = f"--{what}-len"
    dist = dist or ("uniform" if span else "fixed")
    if dist == "fixed" and span:
        raise ValueError(f"{flag}-range does not apply to {flag}-dist fixed (uniform or lognormal use it)")
    if dist == "uniform" and not span:
        raise ValueError(f"{flag}-dist uniform needs {flag}-range LO HI")
    if sigma is not None and dist != "lognormal":
        raise ValueError(f"{flag}-sigma applies to {flag}-dist lognormal only, not {dist}")
    if dist == "uniform":
        return tuple(span)
    if dist == "fixed":
        return (n, n)
    lo, hi = span or (1, None)
    return workload.Lengths("lognormal", n, lo, hi, 1.0 if sigma is None else sigma, name=flag)


def build_requests(args, rate: float, max_model_len: int | None = None):
    from tidal.planner import workload
    if args.trace:
        requests = workload.load_trace(args.trace, args.request_rate, args.seed)
        # the trace as given at --request-rate; other rates (SLO search, sweep) replay it faster or slower
        return requests if rate == args.request_rate else workload.at_rate(requests, rate)
    if args.workload:
        from tidal.benchmarks import datasets
        return workload.from_requests(datasets.WORKLOADS[args.workload](), rate, args.burstiness, args.seed)
    spec = workload.WorkloadSpec(args.num_requests, rate, lengths(args, "input"), lengths(args, "output"),
                                 args.prefix_len, args.num_prefixes, args.burstiness, args.seed,
                                 max_model_len=max_model_len)
    return workload.synthesize(spec)


def run(args) -> int:
    from tidal.planner import report
    from tidal.planner.devices import get_device, load_calibration
    from tidal.planner.model import profile_model
    from tidal.planner.simulator import EngineSettings, simulate
    try:
        profile = profile_model(args.model, dtype=args.dtype, quantization=args.quantization,
                                kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size, max_model_len=args.max_model_len)
        device = load_calibration(args.calibration) if args.calibration else get_device(args.device)
    except (ValueError, OSError) as e:
        print(f"error: {e}")
        return 2
    settings = EngineSettings(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len, args.block_size,
                              args.enable_prefix_caching, args.enable_chunked_prefill, args.gpu_memory_utilization,
                              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                              served=args.workload is None if args.served is None else args.served)

    max_model_len = min(args.max_model_len or profile.max_model_len, profile.max_model_len)

    def at(rate: float) -> tuple[dict, object]:
        result = simulate(profile, device, build_requests(args, rate, max_model_len), settings)
        return report.summarize(result), result

    try:
        summary, result = at(args.request_rate)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    context_lens = args.context_lens or sorted({min(4096, max_model_len), max_model_len})
    fit = report.requests_that_fit(profile, result, settings.for_device(device).max_num_seqs, args.block_size,
                                   context_lens)
    out = {"model": vars(profile), "device": device.as_dict(), "cache": vars(result.plan), "fit": fit,
           "summary": summary}
    print(describe(profile, device, result.plan, fit, summary, args))
    if summary["fits"] and (args.slo_ttft is not None or args.slo_tpot is not None or args.sweep is not None
                            or args.plot):
        saturation = at(float("inf"))[0]["request_throughput"]
        if args.slo_ttft is not None or args.slo_tpot is not None:
            rate, s = report.highest_rate(lambda r: at(r)[0], args.slo_ttft, args.slo_tpot, saturation,
                                          args.slo_percentile)
            out["slo"] = {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot, "percentile": args.slo_percentile,
                          "highest_rate": rate, "summary": s}
            slo = " and ".join(f"{args.slo_percentile} {k} <= {v:g} ms" for k, v in
                               (("TTFT", args.slo_ttft), ("TPOT", args.slo_tpot)) if v is not None)
            if rate is None:
                verdict = "none (even a trickle of requests misses it)"
            elif rate == float("inf"):
                verdict = f"any (met with every request arriving at once: {s['output_throughput']:.0f} output tok/s)"
            else:
                verdict = f"{rate:.3g} req/s ({s['output_throughput']:.0f} output tok/s)"
            print(f"highest request rate with {slo}: {verdict}")
        if args.sweep is not None or args.plot:
            rates = args.sweep or [saturation * f for f in (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
            points = [(r, at(r)[0]) for r in rates]
            out["sweep"] = [{"request_rate": r, **s} for r, s in points]
            print(report.sweep_table(points))
            if args.plot:
                why = report.plot_latency(points, args.plot, f"{profile.name} on {device.name}")
                print(why or f"wrote {args.plot}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0 if summary["fits"] else 1


def describe(profile, device, plan, fit: list[dict], s: dict, args) -> str:
    gb = 1e9
    n_dev = profile.tensor_parallel_size * profile.pipeline_parallel_size
    lines = [f"{profile.name} ({profile.total_params / 1e9:.1f}B parameters) on {n_dev} x {device.name} "
             f"({device.source}): TP={profile.tensor_parallel_size} PP={profile.pipeline_parallel_size}, {args.dtype}, "
             f"quantization {profile.quantization or 'none'}, KV cache {profile.kv_cache_dtype}",
             f"  per device: weights {profile.weight_bytes / gb:.2f} GB, KV {profile.kv_bytes_per_token} B per token, "
             f"Mamba state {profile.state_bytes_per_request / 2**20:.2f} MiB per request"]
    if device.source == "table" and device.name.startswith("cpu"):
        lines.append("  (the cpu row is the reference CPU's calibration: `tidal plan calibrate` measures this machine, "
                     "then pass --calibration FILE)")
    if not plan.fits:
        lines.append(f"  DOES NOT FIT: {plan.reason}")
        return "\n".join(lines)
    slots = f", {plan.num_state_slots} state slots" if plan.num_state_slots else ""
    lines.append(f"  cache budget {plan.budget_bytes / gb:.2f} GB: {plan.num_blocks} blocks of {args.block_size} "
                 f"tokens ({plan.kv_tokens} tokens){slots}")
    lines.append("  requests that fit at once: " + "; ".join(
        f"{f['context_len']} tokens: {f['requests']} ({f['limited_by']})" for f in fit))
    lines.append(f"  simulated {s['completed']} requests at {args.request_rate:g} req/s: {s['duration_s']:.2f} s, "
                 f"{s['num_steps']} steps; {s['output_throughput']:.1f} output tok/s, "
                 f"{s['total_token_throughput']:.1f} total tok/s, {s['request_throughput']:.2f} req/s")
    lines.append(f"  TTFT p50 {s['p50_ttft_ms']:.1f} ms, p99 {s['p99_ttft_ms']:.1f} ms; "
                 f"TPOT p50 {s['p50_tpot_ms']:.2f} ms, p99 {s['p99_tpot_ms']:.2f} ms; "
                 f"preemptions {s['num_preemptions']}; most running at once {s['max_running']}; "
                 f"peak KV use {s['peak_kv_usage']:.0%}; prefix-cache hits {s['prefix_hit_rate']:.0%}")
    return "\n".join(lines)
