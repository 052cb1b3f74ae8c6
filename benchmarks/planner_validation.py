"""The planner's predictions against measurements on this machine: `tidal plan`'s simulation (with a
calibration file from `tidal plan calibrate`) beside the engine running the same requests.

    python benchmarks/serve_sweep.py --rates 0.5 6 --num-prompts 16      # first, on an idle machine: two served
    #   rates (each rate's entry of the RESULT line saved as serve_0.5.json, serve_6.json) for the server's cost
    python -m tidal.entrypoints.cli plan calibrate --output cpu.json --serve-result serve_0.5.json serve_6.json
    python benchmarks/planner_validation.py --calibration cpu.json        # predicts, measures, prints the table
    python benchmarks/planner_validation.py --calibration cpu.json --predict-only

Workloads (the benchmarks' own request sets and settings):
- offline: `tidal bench throughput --workload offline` (128 requests, prompts 32-512, outputs 16-256, all at once);
- shared_prefix: `tidal bench throughput --workload shared_prefix` (64 requests, one 1024-token prefix + 64, 64 out);
- serve at 2, 4 and 8 req/s: benchmarks/serve_sweep.py (`tidal serve`, then `tidal bench serve`: 32 requests of
  128 random tokens, 64 out, Poisson arrivals, max_model_len 2048).
Each row prints predicted, measured and the error (predicted / measured - 1). The serve rows are simulated as
served (the calibration's server cost per step and per request of a step, and its latency to a request's first
token) and as serve_sweep.py runs them: one server, its warm-up (4 requests), then the rates in order, each run
after `tidal bench serve`'s probe, each drawing its requests and arrivals with a seed of its own (so no run finds
an earlier run's prompts in the prefix cache). offline and shared_prefix are not served.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's tidal, whatever is installed

from tidal.benchmarks import datasets  # noqa: E402
from tidal.benchmarks.sweep import sweep_seed  # noqa: E402
from tidal.planner import report, workload  # noqa: E402
from tidal.planner.calibrate import simulate_sweep, sweep_warmup_requests  # noqa: E402
from tidal.planner.devices import load_calibration  # noqa: E402
from tidal.planner.model import profile_model  # noqa: E402
from tidal.planner.simulator import EngineSettings, simulate  # noqa: E402

PEERS = os.environ.get("PEERS_DIR", os.path.expanduser("~/.cache/tidal-peers"))
SERVE = dict(num_prompts=32, input_len=128, output_len=64, max_model_len=2048)


def predict(model: str, calibration: str, rates: list[float]) -> dict:
    profile = profile_model(model, dtype="bfloat16")
    device = load_calibration(calibration)
    out = {}
    for name in ("offline", "shared_prefix"):
        reqs = workload.from_requests(datasets.workload_requests(name))
        s = report.summarize(simulate(profile, device, reqs, EngineSettings()))
        out[name] = {"elapsed_s": s["duration_s"], "output_tok_s": s["output_throughput"],
                     "mean_ttft_ms": s["mean_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"], "steps": s["num_steps"]}
    # under `tidal serve`, as serve_sweep.py runs the rates: one server, its warm-up, then each rate in order,
    # each with requests and arrivals of its own seed
    lens = (SERVE["input_len"],) * 2, (SERVE["output_len"],) * 2
    sweep = [(datasets.random_requests(SERVE["num_prompts"], *lens, sweep_seed(i)), rate, 1.0, sweep_seed(i))
             for i, rate in enumerate(rates)]
    runs = simulate_sweep(profile, device, sweep, SERVE["max_model_len"],
                          warmup=sweep_warmup_requests(SERVE["input_len"], SERVE["output_len"]))
    for rate, run in zip(rates, runs):
        s = report.summarize(run)
        out[f"serve {rate:g} req/s"] = {
            "output_tok_s": s["output_throughput"], "mean_ttft_ms": s["mean_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
            "mean_tpot_ms": s["mean_tpot_ms"], "p99_tpot_ms": s["p99_tpot_ms"]}
    return out


def _tidal(*args: str) -> list[str]:
    return [sys.executable, "-m", "tidal.entrypoints.cli", *args]


def measure(model: str, rates: list[float]) -> dict:
    out = {}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("offline", "shared_prefix"):
        path = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        subprocess.run(_tidal("bench", "throughput", "--model", model, "--workload", name, "--dtype", "bfloat16",
                              "--output-json", path), check=True, env=env, stdout=subprocess.DEVNULL)
        with open(path) as f:
            t = json.load(f)["tidal"]
        out[name] = {"elapsed_s": t["elapsed_s"], "output_tok_s": t["output_tokens_per_s"],
                     "mean_ttft_ms": (t["mean_ttft_s"] or 0) * 1e3, "mean_tpot_ms": (t["mean_tpot_s"] or 0) * 1e3,
                     "steps": t["num_steps"]}
    sweep = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serve_sweep.py"), "--engines", "tidal",
                            "--model", model, "--rates", *[f"{r:g}" for r in rates],
                            "--num-prompts", str(SERVE["num_prompts"]), "--input-len", str(SERVE["input_len"]),
                            "--output-len", str(SERVE["output_len"]), "--max-model-len", str(SERVE["max_model_len"])],
                           check=True, env=env, capture_output=True, text=True)
    line = next(x for x in sweep.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))["tidal"]
    for rate in rates:
        r = results[f"{rate:g}"]
        out[f"serve {rate:g} req/s"] = {
            "output_tok_s": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
            "mean_tpot_ms": r["mean_tpot_ms"], "p99_tpot_ms": r["p99_tpot_ms"]}
    return out


def table(predicted: dict, measured: dict | None) -> str:
    lines = ["| workload | metric | predicted | measured | error |", "| --- | --- | ---: | ---: | ---: |"]
    for name, metrics in predicted.items():
        for key, p in metrics.items():
            m = measured.get(name, {}).get(key) if measured else None
            err = f"{p / m - 1:+.0%}" if m else ""
            lines.append(f"| {name} | {key} | {p:.4g} | {'' if m is None else f'{m:.4g}'} | {err} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", required=True, help="the device file of `tidal plan calibrate` on this machine")
    ap.add_argument("--model", default=os.path.join(PEERS, "smollm2-135m-instruct"))
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8])
    ap.add_argument("--predict-only", action="store_true", help="print the predictions; run nothing")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    predicted = predict(args.model, args.calibration, args.rates)
    measured = None if args.predict_only else measure(args.model, args.rates)
    print(table(predicted, measured))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"predicted": predicted, "measured": measured}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
