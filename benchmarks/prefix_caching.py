"""Prefix caching benchmark: the same workloads with caching on and off, measured in one run.

    .venv/bin/python benchmarks/prefix_caching.py                      # default model, bf16
    .venv/bin/python benchmarks/prefix_caching.py --runs 3 --offline-n 48
    .venv/bin/python benchmarks/prefix_caching.py --model DIR --workloads shared_prefix

Workloads come from benchmarks/peers/workload.py, so the figures compare with the peers measured
there (PEERS.md): `shared_prefix` (64 requests of a 1024-token shared prefix + 64 unique tokens,
64 output tokens each) shows the speedup; the first --offline-n requests of `offline` (random
prompts, nothing shared) show what caching costs when it never hits. Every request is greedy with
ignore_eos, so both engines do exactly the same work.

Wall time is what the targets are about; CPU time of this process and the time spent in
Scheduler.schedule (prefix lookups, hashing, allocation) are printed too, because on a shared,
busy machine they separate the engine's own cost from other processes' noise.

Two engines are built side by side (one with caching, one without) and their timed runs are
interleaved, alternating which goes first, so the machine's noise hits both alike; the prefix
cache is reset before every timed run, so a run's hits come from inside that run. Ratios are
medians over --runs. Prints a table and one line starting with "RESULT " (JSON).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tidal import LLM, SamplingParams  # noqa: E402


def load_workloads(bench_dir: Path):
    spec = importlib.util.spec_from_file_location("bench_workload", bench_dir / "workload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_requests(reqs):
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    return prompts, params


class ScheduleTimer:
    """Time spent in Scheduler.schedule (where prefix lookups, hashing and allocation happen):
    the bookkeeping cost of caching, free of the forward pass's noise."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        scheduler = llm.llm_engine.scheduler
        schedule = scheduler.schedule

        def timed():
            t0 = time.perf_counter()
            try:
                return schedule()
            finally:
                self.seconds += time.perf_counter() - t0
        scheduler.schedule = timed


def timed_run(llm: LLM, timer: ScheduleTimer, prompts, params) -> dict:
    llm.reset_prefix_cache()
    stats = llm.llm_engine.stats
    q0, h0, s0 = stats.prefix_queries, stats.prefix_hits, timer.seconds
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    queries, hits = stats.prefix_queries - q0, stats.prefix_hits - h0
    return {"wall_s": wall, "cpu_s": cpu, "schedule_s": timer.seconds - s0,
            "gen_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "hit_rate": hits / queries if queries else 0.0, "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0,
                    help="KV cache per engine (2 GiB holds all 64 shared_prefix requests uncached)")
    ap.add_argument("--runs", type=int, default=2, help="timed runs per setting of the offline workload")
    ap.add_argument("--shared-prefix-runs", type=int, default=1,
                    help="timed runs per setting of shared_prefix (uncached, it is the long one)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 is faster on a machine other processes keep busy)")
    ap.add_argument("--offline-n", type=int, default=32, help="requests taken from the offline workload")
    ap.add_argument("--workloads", default="shared_prefix,offline")
    ap.add_argument("--num-prompts", type=int, default=64, help="shared_prefix: requests")
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared_prefix: shared tokens")
    ap.add_argument("--suffix-len", type=int, default=64, help="shared_prefix: unique tokens per request")
    ap.add_argument("--output-len", type=int, default=64, help="shared_prefix: output tokens per request")
    ap.add_argument("--bench-dir", default=str(REPO.parent / "shared" / "bench"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    wl = load_workloads(Path(args.bench_dir))
    workloads = {
        # (timed requests, warm-up requests: other tokens, same code paths, short)
        "shared_prefix": (wl.shared_prefix(n=args.num_prompts, prefix=args.prefix_len, suffix=args.suffix_len,
                                           out=args.output_len),
                          wl.shared_prefix(seed=1000, n=3, prefix=100, suffix=20, out=4)),
        "offline": (wl.offline()[:args.offline_n], wl.offline(seed=1000, n=3, in_hi=100, out_lo=4, out_hi=8)),
    }
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in workloads:
            raise SystemExit(f"unknown workload {w!r}; choose from {sorted(workloads)}")

    kw = {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
          "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)}
    engines = {"off": LLM(enable_prefix_caching=False, **kw), "on": LLM(enable_prefix_caching=True, **kw)}
    timers = {mode: ScheduleTimer(llm) for mode, llm in engines.items()}

    results = {}
    for name in names:
        reqs, warm = workloads[name]
        prompts, params = as_requests(reqs)
        for llm in engines.values():
            llm.generate(*as_requests(warm), use_tqdm=False)
        runs = {"on": [], "off": []}
        for i in range(args.shared_prefix_runs if name == "shared_prefix" else args.runs):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                r = timed_run(engines[mode], timers[mode], prompts, params)
                runs[mode].append(r)
                print(f"{name:14s} caching {mode:3s} run {i + 1}: {r['wall_s']:7.2f} s wall, {r['cpu_s']:7.2f} s CPU "
                      f"({r['gen_tokens'] / r['wall_s']:.1f} output tok/s, hit rate {r['hit_rate']:.1%}, "
                      f"{r['schedule_s']:.3f} s scheduling)", flush=True)
        on = statistics.median(r["wall_s"] for r in runs["on"])
        off = statistics.median(r["wall_s"] for r in runs["off"])
        same = sum(a == b for a, b in zip(runs["on"][0]["token_ids"], runs["off"][0]["token_ids"]))
        results[name] = {
            "requests": len(reqs), "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs),
            "output_tokens": sum(r["max_tokens"] for r in reqs),
            "wall_off_s": round(off, 2), "wall_on_s": round(on, 2), "speedup": round(off / on, 3),
            "on_vs_off_throughput": round(off / on - 1, 4), "hit_rate_on": round(runs["on"][0]["hit_rate"], 4),
            "identical_outputs": f"{same}/{len(reqs)}",
            "cpu_off_s": round(statistics.median(r["cpu_s"] for r in runs["off"]), 2),
            "cpu_on_s": round(statistics.median(r["cpu_s"] for r in runs["on"]), 2),
            "schedule_off_s": round(statistics.median(r["schedule_s"] for r in runs["off"]), 4),
            "schedule_on_s": round(statistics.median(r["schedule_s"] for r in runs["on"]), 4),
            "runs_off_s": [round(r["wall_s"], 2) for r in runs["off"]],
            "runs_on_s": [round(r["wall_s"], 2) for r in runs["on"]],
        }

    print(f"\n{'workload':14s} {'off (s)':>9s} {'on (s)':>9s} {'off/on':>8s} {'hit rate':>9s} {'same out':>9s} "
          f"{'CPU off/on (s)':>17s} {'sched off/on (s)':>17s}")
    for name, r in results.items():
        print(f"{name:14s} {r['wall_off_s']:9.2f} {r['wall_on_s']:9.2f} {r['speedup']:7.2f}x "
              f"{r['hit_rate_on']:9.1%} {r['identical_outputs']:>9s} "
              f"{r['cpu_off_s']:8.1f}/{r['cpu_on_s']:<8.1f} "
              f"{r['schedule_off_s']:8.3f}/{r['schedule_on_s']:.3f}")
    print("RESULT " + json.dumps({"dtype": args.dtype, "runs": args.runs, "results": results}), flush=True)


if __name__ == "__main__":
    main()
