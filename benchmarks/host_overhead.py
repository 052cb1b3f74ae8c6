"""Host time per engine step: everything but the model's forward (and LM head).

    python benchmarks/host_overhead.py [--workload offline|single|shared_prefix|prefill] [--model DIR]
        [--dtype float32] [--repeat 5] [--tensor-parallel-size 2] [--pipeline-parallel-size 2] [--batch-invariant]
        [--cached-forward]

Runs one workload of benchmarks/peers/workload.py (greedy, ignore_eos) through `LLMEngine.step` and
times each step end to end; in one process the model's `forward` and LM head (`compute_logits`, or
`compute_greedy_tokens` where the LM head finds greedy tokens itself) are timed too (the time inside them
is the model's, the rest is the host's: scheduling, building inputs, sampling, detokenizing, outputs),
and the process's resident memory at the end is reported. Under tensor/pipeline parallelism only whole
steps are timed (the forward runs in the workers). Prints one JSON line starting with "RESULT ".

--cached-forward: the model's forward and LM head return the output they gave for the same input shape
(computing it the first time only, from the warm-up on), so a step is the host's work alone and the
caches stay warm. The tokens are then not the model's (greedy over the same logits); the host work per step is
the same code. A shape the warm-up did not run is computed in the first measured run: take the median
of --repeat 3 or more. With the forward, the host's code and data are fetched again from memory after
each forward, evicted while it ran (on a shared machine by the time it takes, whatever it reads:
docs/architecture.md): the difference between the two is that cost.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import workload  # noqa: E402

# the model's calls (its time): the forward, the LM head, and the LM head that also finds greedy tokens
MODEL_CALLS = ("forward", "compute_logits", "compute_greedy_tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="offline", choices=sorted(workload.WORKLOADS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none",
                    help="default none: the default GGUF's weights dequantized at load, as the figures in the docs")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1,
                    help="measured runs (each on an emptied prefix cache); host time is reported per run and "
                         "as their median: on a noisy machine one run's figure moves by tens of percent")
    ap.add_argument("--cached-forward", action="store_true",
                    help="the forward and LM head return the output of their first call per input shape: "
                         "the host's work alone, on warm caches")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="batch-invariant mode (docs/batch_invariance.md); default: the engine's (on where supported)")
    args = ap.parse_args()

    import torch

    from tidal import LLM, SamplingParams
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              quantization=args.quantization,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              batch_invariant=args.batch_invariant)
    engine = llm.llm_engine
    model = getattr(getattr(engine, "runner", None), "model", None)
    in_model = [0.0]
    if model is not None and args.tensor_parallel_size * args.pipeline_parallel_size == 1:
        for name in [n for n in MODEL_CALLS if hasattr(model, n)]:
            inner = getattr(model, name)

            def timed(*a, _inner=inner, **kw):
                t0 = time.perf_counter()
                try:
                    return _inner(*a, **kw)
                finally:
                    in_model[0] += time.perf_counter() - t0
            setattr(model, name, timed)

    def run(reqs) -> dict:
        for i, r in enumerate(reqs):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": r["prompt_token_ids"]},
                               SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
        in_model[0], steps, generated = 0.0, 0, 0
        t0 = time.perf_counter()
        with torch.inference_mode():  # held over the steps, as LLM.generate and the engine thread hold it
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        generated += len(out.outputs[0].token_ids)
                steps += 1
        wall = time.perf_counter() - t0
        res = {"steps": steps, "wall_s": round(wall, 3), "gen_tok_s": round(generated / wall, 1),
               "step_ms": round(1e3 * wall / steps, 3)}
        if model is not None and args.tensor_parallel_size * args.pipeline_parallel_size == 1:
            res["model_ms_per_step"] = round(1e3 * in_model[0] / steps, 3)
            res["host_ms_per_step"] = round(1e3 * (wall - in_model[0]) / steps, 3)
            res["host_share"] = round((wall - in_model[0]) / wall, 4)
        return res

    if args.cached_forward:
        if model is None or args.tensor_parallel_size * args.pipeline_parallel_size != 1:
            sys.exit("--cached-forward needs the model in this process (no tensor or pipeline parallelism)")
        for name in [n for n in MODEL_CALLS if hasattr(model, n)]:
            setattr(model, name, cached_by_shape(getattr(model, name)))
    run(workload.warm_up(args.workload))
    runs = []
    for _ in range(max(1, args.repeat)):
        engine.reset_prefix_cache()
        runs.append(run(workload.WORKLOADS[args.workload]()))
    res = runs[0]
    if len(runs) > 1:
        for key in ("wall_s", "step_ms", "model_ms_per_step", "host_ms_per_step", "host_share"):
            if key in res:
                values = [r[key] for r in runs]
                res[key] = round(statistics.median(values), 4 if key == "host_share" else 3)
                res[f"{key}_runs"] = values
        res["gen_tok_s"] = round(statistics.median(r["gen_tok_s"] for r in runs), 1)
    res["rss_mb"] = round(resident_bytes() / 2**20, 1)  # the engine's process (with the model, in one process)
    print("RESULT " + json.dumps({"workload": args.workload, "dtype": args.dtype,
                                  "tp": args.tensor_parallel_size, "pp": args.pipeline_parallel_size,
                                  "batch_invariant": llm.llm_engine.config.batch_invariant,
                                  "cached_forward": args.cached_forward, **res}),
          flush=True)


def cached_by_shape(fn):
    """fn, returning (a copy of) what it returned the first time for a first argument of the same shape."""
    outputs = {}

    def cached(*a, **kw):
        key = tuple(a[0].shape)
        if key not in outputs:
            out = fn(*a, **kw)
            outputs[key] = out.clone() if hasattr(out, "clone") else out
        out = outputs[key]
        return list(out) if isinstance(out, list) else out
    return cached


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    main()
