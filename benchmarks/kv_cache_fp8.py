"""FP8 KV cache (kv_cache_dtype="fp8") against the default cache on the default model (SmolLM2-135M-Instruct),
in one process, the two engines one after the other:

    KV bytes per token and the tokens that fit in a 1 GiB budget;
    prompt logprobs of a few fixed texts (208 positions): each cache's perplexity, and its largest and mean
    gap to an fp32 run of the model (fp32 activations and cache), beside that of the "auto" cache; how many
    greedy continuations (32 tokens) equal the fp32 run's;
    output tok/s on a short offline batch (32 random requests, 32-512 prompt and 16-256 output tokens,
    greedy, exact lengths), timed twice per cache in A/B/A/B order, the best run of each reported.

    python benchmarks/kv_cache_fp8.py [--dtype auto] [--num-prompts 32]
    TIDAL_CPU_ISA=avx2 python benchmarks/kv_cache_fp8.py   # the fp32-activation mode of AVX2 CPUs

Run it on an otherwise idle machine (on a shared one: flock /tmp/tidal-bench.lock ...); name the CPU beside
the figures.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time

from tidal import LLM, SamplingParams
from tidal.benchmarks import datasets
from tidal.native import cpu_isa

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could produce books quickly.",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic and cook it gently until it smells "
    "sweet, then add crushed tomatoes, a pinch of salt and a few basil leaves.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs light, water is split, oxygen "
    "is released and carbon dioxide is fixed into sugars in the Calvin cycle.",
    "User: What is the capital of Australia, and why was it chosen?\nAssistant:",
    "The quick brown fox jumps over the lazy dog. This sentence contains every letter of the English alphabet and "
    "is often used to test typewriters and fonts.",
]
BUDGET = 1 << 30


def quality(llm) -> tuple[list, list]:
    params = SamplingParams(temperature=0, max_tokens=32, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    lps = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    return lps, [o.outputs[0].token_ids for o in outs]


def timed(llm, reqs) -> float:
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == r["max_tokens"] for o, r in zip(outs, reqs))
    return sum(r["max_tokens"] for r in reqs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    args = ap.parse_args()
    reqs = datasets.random_requests(args.num_prompts, (32, 512), (16, 256), seed=0, vocab_size=49152)
    warm = datasets.random_requests(4, (32, 512), (16, 64), seed=1, vocab_size=49152)
    result = {"isa": cpu_isa(), "dtype": args.dtype, "num_prompts": args.num_prompts,
              "output_tokens": sum(r["max_tokens"] for r in reqs)}
    engines, runs = {}, {"auto": [], "fp8": []}
    reference = quality(LLM(dtype="float32", kv_cache_memory_bytes=BUDGET, max_model_len=2048))
    gc.collect()
    for kv in ("auto", "fp8"):
        llm = LLM(dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=BUDGET, max_model_len=2048)
        e = llm.llm_engine
        result[kv] = {"kv_cache_dtype": str(e.kv_cache_dtype).removeprefix("torch."), "activations":
                      str(e.dtype).removeprefix("torch."), "kv_bytes_per_token": e.kv_plan.bytes_per_token,
                      "kv_tokens_in_1GiB": e.kv_plan.num_tokens}
        lps, greedy = quality(llm)
        gaps = [abs(a - b) for x, y in zip(reference[0], lps) for a, b in zip(x, y)]
        nll = -sum(sum(x) for x in lps) / len(gaps)
        result[kv].update(perplexity=round(math.exp(nll), 3), logprob_gap_to_fp32_max=round(max(gaps), 4),
                          logprob_gap_to_fp32_mean=round(sum(gaps) / len(gaps), 4),
                          greedy_equal_to_fp32=f"{sum(a == b for a, b in zip(reference[1], greedy))} of {len(TEXTS)}")
        timed(llm, warm)
        engines[kv] = llm
    for _ in range(2):
        for kv in ("auto", "fp8"):
            runs[kv].append(round(timed(engines[kv], reqs), 1))
    del engines
    gc.collect()
    ref_nll = -sum(sum(x) for x in reference[0]) / sum(len(x) for x in reference[0])
    result["fp32_perplexity"] = round(math.exp(ref_nll), 3)
    for kv in ("auto", "fp8"):
        result[kv]["output_tok_s_runs"] = runs[kv]
        result[kv]["output_tok_s"] = max(runs[kv])
    result["kv_tokens_ratio"] = round(result["fp8"]["kv_tokens_in_1GiB"] / result["auto"]["kv_tokens_in_1GiB"], 3)
    result["speed_ratio"] = round(result["fp8"]["output_tok_s"] / result["auto"]["output_tok_s"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
