"""The offline path with the engine core in this process (`LLM`, what Tidal ships) against the same engine
in a core process of its own (`AsyncLLM.from_config(config, core_process=True)`, what `tidal serve` runs),
fed the whole workload at once; and, for reference, in this process but stepped by AsyncLLM's loop thread.

    python benchmarks/offline_core_process.py                          # offline and shared_prefix
    python benchmarks/offline_core_process.py --workloads offline --runs 3

The workloads are benchmarks/peers/workload.py's (greedy, ignore_eos, token-id prompts), on the model
folder benchmarks/peers/setup_vllm_cpu.sh writes (or --model). One warm-up generate precedes the timed
runs and the prefix cache is reset before each, as in run_llm_api.py. Prints one line per mode and
workload: output tokens per second (best of the runs, and each run) and the time to build the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import operator
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import workload  # noqa: E402

PEERS = os.environ.get("PEERS_DIR", os.path.expanduser("~/.cache/tidal-peers"))
WARM = {"offline": dict(n=16), "shared_prefix": dict(n=8), "single": {}}


def requests_of(name: str, seed: int | None = None):
    kw = {} if seed is None else dict(seed=seed, **WARM[name])
    reqs = workload.WORKLOADS[name](**kw)
    return [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], [r["max_tokens"] for r in reqs]


def run_llm(args, name: str) -> dict:
    from tidal import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048)
    init_s = time.perf_counter() - t0

    def generate(prompts, lengths):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    generate(*requests_of(name, seed=1000))
    runs = []
    for _ in range(args.runs):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        tokens = generate(*requests_of(name))
        runs.append(tokens / (time.perf_counter() - t0))
    return {"init_s": init_s, "runs": runs}


def run_async(args, name: str, core_process: bool) -> dict:
    from tidal import SamplingParams
    from tidal.config import EngineConfig
    from tidal.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(model=args.model, dtype=args.dtype, max_model_len=2048),
                                  core_process=core_process)
    init_s = time.perf_counter() - t0
    counter = iter(range(10 ** 9))

    async def one(prompt, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        tokens = 0
        async for out in engine.generate(prompt, params, f"r{next(counter)}"):
            tokens += len(out.outputs[0].token_ids)  # deltas
        return tokens

    async def generate(prompts, lengths):
        return sum(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths))))

    async def main():
        await generate(*requests_of(name, seed=1000))
        runs = []
        for _ in range(args.runs):
            await engine.call_in_engine(operator.methodcaller("reset_prefix_cache"))
            t0 = time.perf_counter()
            tokens = await generate(*requests_of(name))
            runs.append(tokens / (time.perf_counter() - t0))
        return runs

    try:
        runs = asyncio.run(main())
    finally:
        engine.shutdown()
    return {"init_s": init_s, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(PEERS, "smollm2-135m-instruct"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workloads", nargs="+", default=["offline", "shared_prefix"], choices=sorted(workload.WORKLOADS))
    ap.add_argument("--modes", nargs="+", default=["llm", "core-process", "loop-thread"],
                    choices=["llm", "core-process", "loop-thread"])
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    for name in args.workloads:
        for mode in args.modes:
            result = run_llm(args, name) if mode == "llm" else run_async(args, name, mode == "core-process")
            print(json.dumps({"workload": name, "mode": mode, "best_gen_tok_s": round(max(result["runs"]), 1),
                              "runs": [round(r, 1) for r in result["runs"]], "init_s": round(result["init_s"], 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
