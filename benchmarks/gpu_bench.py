"""Engine steps on random (dummy) weights: throughput of the `offline` workload, or batch-1 decode against
the memory-bandwidth floor. No checkpoint is needed (load_format="dummy", bundled configs).

    python benchmarks/gpu_bench.py --case offline --model smollm2-135m [--device cuda] [--dtype bfloat16]
    python benchmarks/gpu_bench.py --case decode --model llama-3-8b --prompt-len 128 --output-len 256 \
        [--bandwidth-gbs 4800]
    python benchmarks/gpu_bench.py --case serve --model llama-3-8b --num-prompts 256 --prompt-len 1024 \
        --output-len 256

Runs the requests through `LLMEngine.step` and times every step on the host (wall); on CUDA it also
reads each step's model time, the CUDA events the model runner records around the forward (or the
replay of its decode graph) and the LM head: the GPU's span of the step's model work, so wall - span is
time the GPU waited on the host (inputs, scheduling, sampling, outputs). Decode steps replay CUDA graphs
unless --enforce-eager (tidal/worker/cuda_graphs.py); the result says how many steps did. With
asynchronous scheduling (the engine's default on CUDA; --no-async-scheduling turns it off) each step is
launched before the previous one is read.
`decode`: the median step of the single request's decode steps is the
time per output token, compared with weight bytes / bandwidth (H200: 4.8 TB/s). `serve`: `tidal serve`
on the dummy model (max_num_seqs = --num-prompts), then `tidal bench serve` sends --num-prompts random
token-id prompts of --prompt-len, --output-len out, all at once (so that many are in flight together):
output throughput and TTFT / TPOT / end-to-end percentiles. Prints one JSON line starting with "RESULT "
(and writes it to --output-json). --cprofile N (offline, decode): the timed run under cProfile, its N
costliest functions by own time printed before the result (the host's share of a step, function by
function; the figures of such a run are slower than without it). --torch-profile N (offline, decode): after
the timed run, the same requests once more under torch.profiler, its N costliest GPU kernels printed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import workload  # noqa: E402


def emit(result: dict, output_json: str | None) -> None:
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if output_json:
        with open(output_json, "w") as f:
            f.write(line + "\n")


def serve(args) -> None:
    """`tidal serve` on dummy weights, and one `tidal bench serve` run of --num-prompts requests at once."""
    from tidal.benchmarks import sweep
    from tidal.device import resolve_device
    from tidal.loader.loader import dummy_config

    n = args.num_prompts or 256
    _, config = dummy_config(args.model)
    port = sweep.free_port()
    cmd = sweep.tidal_serve_command(
        args.model, port, args.max_model_len, "--load-format", "dummy", "--device", args.device,
        "--max-num-seqs", str(args.max_num_seqs or n), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []),
        *(["--enforce-eager"] if args.enforce_eager else []),
        *([] if args.async_scheduling is None else
          ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]), dtype=args.dtype)
    t0 = time.perf_counter()
    with sweep.serving(cmd, port, "tidal") as server:
        def stop(signum, frame):  # `timeout` stops this run: take the server (and its GPU memory) with it
            server.stop(timeout=2)
            sys.exit(128 + signum)
        signal.signal(signal.SIGTERM, stop)
        ready_s = time.perf_counter() - t0
        # a few requests first: kernels compiled, graphs captured, before the timed run
        sweep.run_rate(server.url, float("inf"), num_prompts=4, input_len=args.prompt_len, output_len=8, seed=1000,
                       vocab_size=config.vocab_size)
        r = sweep.run_rate(server.url, float("inf"), num_prompts=n, input_len=args.prompt_len,
                           output_len=args.output_len, seed=0, vocab_size=config.vocab_size)
    keep = ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "total_token_throughput")
    result = {"case": "serve", "model": args.model, "dtype": args.dtype, "device": args.device,
              "async_scheduling": args.async_scheduling,  # None: the engine's default
              "cuda_graphs": resolve_device(args.device) == "cuda" and not args.enforce_eager,
              "num_prompts": n, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "server_ready_s": round(ready_s, 1), **{k: r[k] for k in keep if k in r},
              **{k: v for k, v in r.items() if k.endswith("_ms")}}
    emit(result, args.output_json)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["offline", "decode", "serve"], default="offline")
    ap.add_argument("--model", default="smollm2-135m", help="a bundled config name or a config.json folder")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="offline: only the first N requests; serve: N requests at once (default 256)")
    ap.add_argument("--max-tokens", type=int, default=None, help="offline: cap each request's output")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth for the decode floor")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step eager")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="launch each step while the previous one runs (the engine's async_scheduling; default: "
                         "the engine's, on for CUDA)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engine's (default: its own; serve: --num-prompts)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engine's step budget (default: its own)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="offline/decode: profile the timed run's host work, print its N costliest functions")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N",
                    help="offline/decode: after the timed run, the same requests again under torch.profiler; "
                         "print its N costliest kernels by GPU time")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.case == "serve":
        return serve(args)

    import torch

    from tidal import LLM, SamplingParams
    llm = LLM(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
              **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
              **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}))
    engine = llm.llm_engine
    runner = engine.runner
    cuda = runner.device.type == "cuda"
    spans: list[float] = []  # per step: the runner's model time (seconds; the GPU's span on CUDA)
    from tidal.worker.model_runner import PendingStep
    read = PendingStep.result

    def timed_result(pending):  # every step's output is read here, launched synchronously or not
        out = read(pending)
        spans.append(out.model_time_s)
        return out
    PendingStep.result = timed_result

    def kernel_table(reqs) -> None:  # the requests again under torch.profiler: the GPU's time, kernel by kernel
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            steps = run(reqs)[0]["steps"]
        events = prof.key_averages()
        key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        total = sum(getattr(e, key) for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"== torch.profiler: {steps} steps, GPU kernels {total / 1e3:.1f} ms in all, "
              f"{total / 1e3 / steps:.3f} ms a step; top {args.torch_profile} by GPU time")
        print(events.table(sort_by=key, row_limit=args.torch_profile, max_name_column_width=90))

    def run(reqs, profile: bool = False) -> dict:
        for i, r in enumerate(reqs):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": r["prompt_token_ids"]},
                               SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
        spans.clear()
        replays_before = 0 if runner.decode_graphs is None else runner.decode_graphs.replays
        step_s, generated = [], 0
        profiler = None
        if profile:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
            step_s.append(time.perf_counter() - s0)
        wall = time.perf_counter() - t0
        if profiler is not None:
            import pstats
            profiler.disable()
            print(f"== cProfile of the timed run ({len(step_s)} steps, {wall:.3f} s): top {args.cprofile} by own time")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(args.cprofile)
        res = {"requests": len(reqs), "steps": len(step_s), "wall_s": round(wall, 3),
               "output_tokens": generated, "output_tok_s": round(generated / wall, 1),
               "step_ms_mean": round(1e3 * wall / len(step_s), 3)}
        if cuda and spans:
            gpu = 1e3 * sum(spans) / len(spans)  # ms
            res["gpu_model_ms_per_step"] = round(gpu, 3)
            res["host_ms_per_step"] = round(1e3 * wall / len(step_s) - gpu, 3)
        graphs = runner.decode_graphs
        res["graph_replays"] = 0 if graphs is None else graphs.replays - replays_before
        return res, step_s

    if args.case == "offline":
        reqs = workload.WORKLOADS["offline"]()[:args.num_prompts]
        warm = workload.WORKLOADS["offline"](seed=1000, n=16)[:args.num_prompts]
        if args.max_tokens:
            reqs = [dict(r, max_tokens=min(r["max_tokens"], args.max_tokens)) for r in reqs]
            warm = [dict(r, max_tokens=min(r["max_tokens"], args.max_tokens)) for r in warm]
        run(warm)
        llm.reset_prefix_cache()
        res, _ = run(reqs, profile=args.cprofile > 0)
        if args.torch_profile:
            llm.reset_prefix_cache()
            kernel_table(reqs)
    else:
        rng = random.Random(0)
        vocab = engine.vocab_size

        def one():
            return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)],
                     "max_tokens": args.output_len}]
        run(one())  # warm-up
        res, step_s = run(one(), profile=args.cprofile > 0)
        if args.torch_profile:
            kernel_table(one())
        decode = step_s[1:]  # the first step computes the prompt
        tpot = statistics.median(decode) * 1e3
        floor = engine.weight_bytes / (args.bandwidth_gbs * 1e9) * 1e3
        res.update(tpot_ms_median=round(tpot, 3), tpot_ms_mean=round(statistics.mean(decode) * 1e3, 3),
                   weight_gb=round(engine.weight_bytes / 1e9, 3), bandwidth_floor_ms=round(floor, 3),
                   tpot_over_floor=round(tpot / floor, 3))
    result = {"case": args.case, "model": args.model, "dtype": args.dtype, "device": str(runner.device),
              "attention": runner.attn_backend.name, "cuda_graphs": runner.decode_graphs is not None,
              "async_scheduling": engine.config.async_scheduling, "max_num_seqs": engine.config.max_num_seqs,
              "max_num_batched_tokens": engine.max_num_batched_tokens, "cprofile": args.cprofile > 0,
              "gpu": torch.cuda.get_device_name(0) if cuda else None, **res}
    emit(result, args.output_json)


if __name__ == "__main__":
    main()
