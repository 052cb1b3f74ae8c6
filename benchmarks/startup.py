"""Start-up times a user waits for: `tidal serve` from the command to the first `/health` answer, and
`LLM(..., tensor_parallel_size=2)` built several times in one process (the first starts the workers'
forkserver; the later ones fork from it).

    python benchmarks/startup.py                      # the default model, 3 of each
    python benchmarks/startup.py --runs 5 --model path/to/model --serve-arg=--dtype=float32

Each server runs alone on a free port (its output discarded) and is stopped before the next starts; the
parallel engines are shut down between builds. Prints one line per run and a RESULT JSON line.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time


def serve_ready_s(model: str | None, extra: list[str], timeout_s: float = 300.0) -> float:
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tidal.entrypoints.cli", "serve", *([model] if model else []), "--host",
           "127.0.0.1", "--port", str(port), *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"tidal serve exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"tidal serve not ready after {timeout_s:g} s")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait()


def parallel_ready_s(model: str | None, runs: int) -> list[float]:
    from tidal import LLM
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        llm = LLM(*([model] if model else []), tensor_parallel_size=2, max_model_len=2048,
                  kv_cache_memory_bytes=64 << 20)
        times.append(time.perf_counter() - t0)
        llm.llm_engine.shutdown()
        del llm
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or .gguf file (default: the default model)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `tidal serve` argument (repeatable)")
    ap.add_argument("--skip-parallel", action="store_true", help="only the server")
    args = ap.parse_args()
    serve = []
    for i in range(args.runs):
        serve.append(serve_ready_s(args.model, args.serve_arg))
        print(f"tidal serve run {i + 1}: /health answered {serve[-1]:.2f} s after the command", flush=True)
    parallel = [] if args.skip_parallel else parallel_ready_s(args.model, args.runs)
    for i, t in enumerate(parallel):
        print(f"LLM(tensor_parallel_size=2) build {i + 1} in this process: {t:.2f} s", flush=True)
    print("RESULT " + json.dumps({"serve_ready_s": [round(t, 2) for t in serve],
                                  "tp2_ready_s": [round(t, 2) for t in parallel]}))


if __name__ == "__main__":
    main()
