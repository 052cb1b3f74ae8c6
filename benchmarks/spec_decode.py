"""Speculative decoding benchmark: decode speed with and without n-gram speculation on the default
model, for an input-grounded workload (the answer copies the prompt) and free-form chat, at batch 1
and batch 8; acceptance rates; and the `offline` throughput workload.

    .venv/bin/python benchmarks/spec_decode.py                        # everything, default model
    .venv/bin/python benchmarks/spec_decode.py --parts grounded chat  # skip offline
    .venv/bin/python benchmarks/spec_decode.py --spec '{"method": "ngram", "num_speculative_tokens": 6}'

Input-grounded: "Repeat the following text exactly" over eight passages, through the chat template,
chosen because SmolLM2-135M-Instruct copies them (verbatim or nearly: `--show` prints each answer
beside its passage; it summarises or paraphrases others, e.g. the openings of Alice in Wonderland,
The Hobbit and Anna Karenina); free-form: open questions. Requests are
greedy, so both modes must give the same tokens (checked). Batch 1 runs the requests one at a time,
batch 8 eight at once. Decode tok/s is output tokens after the first over the time from first to last
token (prefill excluded), summed over a batch's requests. One engine serves both modes (its proposer
switched off for the baseline), runs alternate between them, the prefix cache is reset before each
run, and the figure per mode is the median over --runs. `offline` is the shared throughput workload
(random prompts, 128 requests, as `tidal bench throughput --workload offline`), whose random tokens
give prompt lookup nothing to find. Prints a table and one line starting with "RESULT " (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tidal import LLM, SamplingParams  # noqa: E402

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

PASSAGES = [
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering "
    "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little and see the "
    "watery part of the world. It is a way I have of driving off the spleen and regulating the circulation.",
    "The sun shone, having no alternative, on the nothing new. Murphy sat out of it, as though he were free, "
    "in a mew in West Brompton. Here for what might have been six months he had eaten, drunk, slept, and put "
    "his clothes on and off, in a medium-sized cage of north-western aspect commanding an unbroken view.",
    "Happy families are all alike, the proverb goes, but the ledger of the town council was another matter: "
    "every entry listed the date, the name of the petitioner, the sum requested, and the decision, and every "
    "decision was written in the same careful hand, year after year, until the flood of 1893 took the ledger "
    "and the hand that kept it.",
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
    "members agreed to spend the money on books, computers and a reading room for children, and to open the "
    "library on the first of June.",
    "To install the package, open a terminal and run the install command. Then create a configuration file in "
    "your home directory, set the path to your data folder, and start the server with the default port. Check "
    "the log file if the server does not start.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, so "
    "water boils at a lower temperature, and food takes longer to cook.",
]

QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What are some good habits for staying healthy while working from home?",
    "Describe the water cycle in a few sentences.",
    "Give me three ideas for a weekend trip and say why each is fun.",
    "Why is the sky blue?",
    "Write a poem about autumn leaves.",
    "What should I consider when adopting a dog?",
]


def chat_prompts(llm, texts: list[str], template: str) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for t in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": template.format(t)}], tokenize=True,
                                      add_generation_prompt=True)
        out.append({"prompt_token_ids": list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids")
                                             else ids)})
    return out


def run_batches(llm, prompts: list[dict], batch: int, params) -> tuple[list, float | None, float]:
    """Generate in groups of `batch`; returns (outputs, decode tok/s, end-to-end output tok/s). Decode
    tok/s needs per-request token times (None for an engine whose outputs carry none)."""
    outs, decode_tokens, decode_s, wall = [], 0, 0.0, 0.0
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        group = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        wall += time.perf_counter() - t0
        times = [getattr(o.metrics, "first_token_time", None) for o in group]
        if None not in times:
            decode_tokens += sum(len(o.outputs[0].token_ids) - 1 for o in group)
            decode_s += max(o.metrics.last_token_time for o in group) - min(times)
        outs.extend(group)
    return outs, decode_tokens / decode_s if decode_s else None, sum(len(o.outputs[0].token_ids) for o in outs) / wall


def measure(llm, name: str, prompts: list[dict], batch: int, params: SamplingParams, runs: int) -> dict:
    engine = llm.llm_engine
    proposer = engine.proposer
    figures = {"base": [], "spec": []}
    e2e = {"base": [], "spec": []}
    tokens = {}
    stats = engine.stats
    d0, a0, n0 = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, stats.spec_num_drafts
    for run in range(runs):
        for mode in (("base", "spec") if run % 2 == 0 else ("spec", "base")):
            engine.proposer = proposer if mode == "spec" else None
            llm.reset_prefix_cache()
            outs, tps, e2e_tps = run_batches(llm, prompts, batch, params)
            figures[mode].append(tps)
            e2e[mode].append(e2e_tps)
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
    engine.proposer = proposer
    drafted, accepted = stats.spec_num_draft_tokens - d0, stats.spec_num_accepted_tokens - a0
    drafts = stats.spec_num_drafts - n0
    base, spec = statistics.median(figures["base"]), statistics.median(figures["spec"])
    return {"workload": name, "batch": batch, "base_tok_s": base, "spec_tok_s": spec, "speedup": spec / base,
            "base_e2e_tok_s": statistics.median(e2e["base"]), "spec_e2e_tok_s": statistics.median(e2e["spec"]),
            "same_requests": sum(a == b for a, b in zip(tokens["base"], tokens["spec"])),
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "output_tokens": sum(len(t) for t in tokens["spec"])}


def measure_vllm(model: str, dtype: str, spec: dict, parts: list[str], batches: list[int], max_tokens: int,
                 runs: int) -> list[dict]:
    """The same prompts through vLLM's offline API (`--engine vllm`, in vLLM's environment): one engine
    without and one with `speculative_config`, end-to-end output tok/s (prefill included)."""
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VParams
    params = VParams(temperature=0, max_tokens=max_tokens)
    e2e: dict = {}
    for mode, cfg in (("base", None), ("spec", spec)):
        llm = VLLM(model=model, dtype=dtype, max_model_len=2048, speculative_config=cfg)
        workloads = {"grounded": chat_prompts(llm, PASSAGES, "Repeat the following text exactly:\n\n{}"),
                     "chat": chat_prompts(llm, QUESTIONS, "{}")}
        llm.generate(workloads["grounded"][:2] + workloads["chat"][:2], params, use_tqdm=False)
        for name in parts:
            for batch in batches:
                e2e[(name, batch, mode)] = statistics.median(
                    run_batches(llm, workloads[name], batch, params)[2] for _ in range(runs))
        del llm
    return [{"workload": name, "batch": batch, "base_e2e_tok_s": e2e[(name, batch, "base")],
             "spec_e2e_tok_s": e2e[(name, batch, "spec")],
             "speedup_e2e": e2e[(name, batch, "spec")] / e2e[(name, batch, "base")]}
            for name in parts for batch in batches]


def run_offline(model, dtype: str, spec: dict, num: int, quantization: str | None = None) -> list[dict]:
    from tidal.benchmarks import datasets
    from tidal.benchmarks.throughput import run_tidal
    requests, warmup = datasets.workload_requests("offline")[:num], datasets.workload_warmup("offline")
    rows = []
    for label, cfg in (("base", None), ("spec", spec)):
        llm = LLM(model, dtype=dtype, speculative_config=cfg, quantization=quantization)
        r = run_tidal(llm, requests, warmup, runs=1, detokenize=True)
        s = llm.llm_engine.stats
        rows.append({"mode": label, "output_tok_s": r["output_tokens_per_s"], "elapsed_s": r["elapsed_s"],
                     "draft_tokens": s.spec_num_draft_tokens, "accepted_tokens": s.spec_num_accepted_tokens})
        llm.llm_engine.shutdown()
        del llm
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--engine", choices=["tidal", "vllm"], default="tidal",
                    help="vllm: the same prompts through vLLM (run with vLLM's python; --model its folder)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none",
                    help="Tidal: the target's weights (default none: the default GGUF dequantized at load, plain "
                    "bf16 weights, as the figures in docs/speculative_decoding.md; gguf: kept in its blocks)")
    ap.add_argument("--spec", default=json.dumps(DEFAULT_SPEC), help="speculative_config JSON")
    ap.add_argument("--parts", nargs="+", default=["grounded", "chat", "offline"],
                    choices=["grounded", "chat", "offline"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--offline-n", type=int, default=128, help="requests of the offline workload")
    ap.add_argument("--show", action="store_true", help="print each grounded answer beside its passage")
    args = ap.parse_args()
    spec = json.loads(args.spec)
    if args.engine == "vllm":
        parts = [p for p in args.parts if p != "offline"]
        rows = measure_vllm(args.model, "bfloat16" if args.dtype == "auto" else args.dtype, spec, parts,
                            args.batches, args.max_tokens, args.runs)
        for r in rows:
            print(f"vLLM {r['workload']:<10} batch {r['batch']}: {r['base_e2e_tok_s']:.1f} -> "
                  f"{r['spec_e2e_tok_s']:.1f} output tok/s end to end ({r['speedup_e2e']:.2f}x)")
        print("RESULT " + json.dumps({"engine": "vllm", "rows": rows, "spec": spec}))
        return 0
    rows = []
    if "grounded" in args.parts or "chat" in args.parts:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, speculative_config=spec,
                  quantization=args.quantization)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        workloads = {"grounded": chat_prompts(llm, PASSAGES, "Repeat the following text exactly:\n\n{}"),
                     "chat": chat_prompts(llm, QUESTIONS, "{}")}
        proposer = llm.llm_engine.proposer
        for p in (None, proposer):  # warm up both modes (first uses of kernels, the draft policy's cost model)
            llm.llm_engine.proposer = p
            llm.generate(workloads["grounded"][:2] + workloads["chat"][:2], params, use_tqdm=False)
        llm.llm_engine.proposer = proposer
        if args.show:
            tok = llm.get_tokenizer()
            for p, o in zip(PASSAGES, llm.generate(workloads["grounded"], params, use_tqdm=False)):
                print(f"--- passage\n{p}\n--- answer\n{tok.decode(o.outputs[0].token_ids)}\n")
        for name in ("grounded", "chat"):
            if name in args.parts:
                for batch in args.batches:
                    rows.append(measure(llm, name, workloads[name], batch, params, args.runs))
                    print(json.dumps(rows[-1]), flush=True)
        llm.llm_engine.shutdown()
    offline = (run_offline(args.model, args.dtype, spec, args.offline_n, args.quantization)
               if "offline" in args.parts else [])
    print(f"\nCPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; spec {json.dumps(spec)}")
    print(f"{'workload':<10} {'batch':>5} {'decode tok/s':>12} {'with spec':>10} {'speedup':>8} {'e2e speedup':>11} "
          f"{'accept':>7} {'mean len':>8} {'same outputs':>12}")
    for r in rows:
        print(f"{r['workload']:<10} {r['batch']:>5} {r['base_tok_s']:>12.1f} {r['spec_tok_s']:>10.1f} "
              f"{r['speedup']:>7.2f}x {r['spec_e2e_tok_s'] / r['base_e2e_tok_s']:>10.2f}x "
              f"{r['acceptance_rate']:>7.1%} {r['mean_acceptance_length']:>8.2f} "
              f"{r['same_requests']:>9}/{len(PASSAGES if r['workload'] == 'grounded' else QUESTIONS)}")
    if offline:
        base, sp = offline
        print(f"offline ({args.offline_n} requests): {base['output_tok_s']:.1f} -> {sp['output_tok_s']:.1f} output "
              f"tok/s ({sp['output_tok_s'] / base['output_tok_s']:.2f}x), drafts {sp['draft_tokens']}, accepted "
              f"{sp['accepted_tokens']}")
    print("RESULT " + json.dumps({"rows": rows, "offline": offline, "spec": spec}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
