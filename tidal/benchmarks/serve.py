"""`tidal bench serve`: load an OpenAI-compatible server (Tidal's, vLLM's, any) with streamed
completions arriving as a Poisson process, and report latency and throughput like vLLM's
`bench serve`.

    tidal serve &                                           # or: vllm serve ...
    tidal bench serve --base-url http://127.0.0.1:8000 --dataset random --random-input-len 128 \
        --random-output-len 128 --request-rate 4 --num-prompts 64 --seed 0 --output-json out.json

Prompts are token ids (exact input lengths, no client tokenizer), greedy with ignore_eos, so every
request produces exactly its output length on any server that honours vLLM's `ignore_eos`.
Reported: TTFT (time to first token), TPOT (time per output token after the first), ITL (time
between streamed chunks) and E2E latency, each as mean / p50 / p90 / p99 in ms, plus request and
token throughput over the whole run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from tidal.benchmarks import datasets


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    s = parser.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (without /v1)")
    s.add_argument("--endpoint", default="/v1/completions", help="completions endpoint path")
    s.add_argument("--model", default=None, help="model name in the API (default: the server's first model)")
    s.add_argument("--no-stream", action="store_true",
                   help="ask for one JSON reply per request instead of a stream of events: throughput and "
                        "end-to-end latency only (TTFT, TPOT and ITL are reported as null), to measure what "
                        "streaming costs the server")
    s.add_argument("--api-key", default=os.environ.get("TIDAL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $TIDAL_API_KEY or $OPENAI_API_KEY)")
    d = parser.add_argument_group("requests (an option that does not apply to the chosen requests is refused)")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", choices=["random", "prefix"], default=None,
                   help="random (default): lengths drawn from the options below; prefix: one shared prefix + own "
                        "suffixes")
    d.add_argument("--dataset-path", default=None,
                   help='JSON list of {"prompt_token_ids": [...], "max_tokens": n} (the first --num-prompts)')
    d.add_argument("--num-prompts", type=int, default=100, help="number of requests (default 100)")
    d.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=None,
                   help="random: prompt length (a range with --random-range-ratio; default 128)")
    d.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=None,
                   help="random: output length (a range with --random-range-ratio); prefix: output length "
                        "(default 128)")
    d.add_argument("--random-range-ratio", type=float, default=None,
                   help="random: lengths drawn from [L*(1-r), L*(1+r)] (default 0)")
    d.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="random: prompt lengths, inclusive (instead of --random-input-len)")
    d.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="random: output lengths, inclusive (instead of --random-output-len)")
    d.add_argument("--prefix-len", type=int, default=None, help="prefix: shared prefix length (default 1024)")
    d.add_argument("--suffix-len", type=int, default=None, help="prefix: per-request suffix length (default 64)")
    d.add_argument("--vocab-size", type=int, default=None,
                   help="draw token ids below this (default: a range valid for SmolLM2's vocabulary)")
    d.add_argument("--seed", type=int, default=0, help="seed of the request set and the arrival times")
    r = parser.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    r.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times (1: Poisson; <1 burstier)")
    r.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds before a request is counted as failed")
    r.add_argument("--output-json", default=None, help="write the results to this JSON file")
    return parser


# -- requests ------------------------------------------------------------------------------------

def _range(explicit, length: int, ratio: float) -> tuple[int, int]:
    if explicit is not None:
        return tuple(explicit)
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


_REQUEST_FLAGS = {"--dataset": "dataset", "--dataset-path": "dataset_path", "--random-input-len": "input_len",
                  "--random-output-len": "output_len", "--random-range-ratio": "random_range_ratio",
                  "--input-len-range": "input_len_range", "--output-len-range": "output_len_range",
                  "--prefix-len": "prefix_len", "--suffix-len": "suffix_len", "--vocab-size": "vocab_size"}


def check_request_options(args) -> None:
    """Refuse request options that the chosen requests would ignore."""
    given = {flag for flag, dest in _REQUEST_FLAGS.items() if getattr(args, dest) is not None}
    if args.dataset_path:
        source, applies = "--dataset-path", {"--dataset-path"}
    elif args.dataset == "prefix":
        source, applies = "--dataset prefix", {"--dataset", "--prefix-len", "--suffix-len", "--random-output-len",
                                               "--vocab-size"}
    else:
        source, applies = "--dataset random", {"--dataset", "--random-input-len", "--random-output-len",
                                               "--random-range-ratio", "--input-len-range", "--output-len-range",
                                               "--vocab-size"}
        if {"--input-len-range", "--output-len-range"} <= given:
            applies = applies - {"--random-range-ratio"}  # it widens only the single lengths
    datasets.refuse_unused_options("bench serve", given, source, applies, [
        ("--input-len-range", "--random-input-len"), ("--output-len-range", "--random-output-len")])


def build_requests(args) -> list[dict]:
    check_request_options(args)
    if args.dataset_path:
        return datasets.load_json_requests(args.dataset_path)[:args.num_prompts]
    output_len, ratio = args.output_len or 128, args.random_range_ratio or 0.0
    if args.dataset == "prefix":
        return datasets.prefix_requests(args.num_prompts, args.prefix_len or 1024, args.suffix_len or 64, output_len,
                                        args.seed, args.vocab_size)
    return datasets.random_requests(args.num_prompts, _range(args.input_len_range, args.input_len or 128, ratio),
                                    _range(args.output_len_range, output_len, ratio), args.seed, args.vocab_size)


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), n).tolist()


# -- one request ---------------------------------------------------------------------------------

@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


async def send_request(session, url: str, model: str, request: dict, stream: bool = True) -> RequestResult:
    """One completion, streamed or (stream=False) in one reply (the session's timeout bounds it)."""
    body = {"model": model, "prompt": request["prompt_token_ids"], "max_tokens": request["max_tokens"],
            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    result = RequestResult(prompt_len=len(request["prompt_token_ids"]))
    start = last = time.perf_counter()
    if not stream:
        return await _send_unstreamed(session, url, body, result, start)
    body["stream_options"] = {"include_usage": True}
    chunks = 0
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:  # one SSE line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].rstrip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("choices"):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def _send_unstreamed(session, url: str, body: dict, result: RequestResult, start: float) -> RequestResult:
    """send_request's one-reply form: the tokens the reply's usage counts, and its end-to-end time."""
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            reply = await response.json()
        result.output_tokens = int(reply["usage"]["completion_tokens"])
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    if not result.ok:
        result.error = "no tokens generated"
    return result


# -- the run -------------------------------------------------------------------------------------

async def run(args, requests: list[dict]) -> dict:
    # aiohttp, as vLLM's `bench serve`: the client shares the machine's cores with the server it measures,
    # and streaming through it costs about three quarters of the CPU time httpx's does
    import aiohttp
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: --max-concurrency caps requests
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as client:
        model = args.model
        if model is None:
            try:
                async with client.get(f"{base}/v1/models") as r:
                    r.raise_for_status()
                    model = (await r.json())["data"][0]["id"]
            except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError) as e:
                raise SystemExit(f"tidal bench serve: could not read the served model from {base}/v1/models "
                                 f"({type(e).__name__}: {e})") from e
        url = f"{base}{args.endpoint}"
        stream = not getattr(args, "no_stream", False)
        probe = await send_request(client, url, model, {"prompt_token_ids": requests[0]["prompt_token_ids"][:16],
                                                        "max_tokens": 2}, stream)
        if not probe.ok:
            raise SystemExit(f"tidal bench serve: the test request to {url} failed: {probe.error}")
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(request):
            if semaphore is None:
                return await send_request(client, url, model, request, stream)
            async with semaphore:
                return await send_request(client, url, model, request, stream)

        tasks = []
        start = time.perf_counter()
        for request, delay in zip(requests, arrival_delays(len(requests), args.request_rate, args.burstiness,
                                                           args.seed)):
            await asyncio.sleep(delay)  # the arrival process itself, not synchronisation
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args, model)


def _dist(values: list[float], name: str) -> dict:
    ms = np.array(values or [0.0]) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.percentile(ms, 50)),
            f"p90_{name}_ms": float(np.percentile(ms, 90)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float, args, model: str) -> dict:
    done = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary = {
        "model": model, "base_url": args.base_url, "num_prompts": len(results), "seed": args.seed,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "completed": len(done),
        "failed": len(results) - len(done), "duration": duration, "total_input_tokens": total_in,
        "total_output_tokens": total_out, "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
    }
    summary["stream"] = not getattr(args, "no_stream", False)
    for name, values in (("ttft", [r.ttft for r in done]), ("tpot", tpot), ("itl", [x for r in done for x in r.itl])):
        # (one reply per request: nothing arrives before the end, so these are not measured)
        summary.update(_dist(values, name) if summary["stream"] else {f"{k}_{name}_ms": None
                                                                        for k in ("mean", "median", "p90", "p99")})
    summary.update(_dist([r.e2e for r in done], "e2el"))
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["errors"] = errors[:10]
    return summary


def print_report(s: dict, out=None) -> None:
    out = out or sys.stdout  # resolved per call: tests and callers may swap sys.stdout
    w = 50
    print(f"{' Serving Benchmark Result ':=^{w}}", file=out)
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Request rate (req/s):", s["request_rate"]), ("Benchmark duration (s):", s["duration"]),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", s["request_throughput"]),
            ("Output token throughput (tok/s):", s["output_throughput"]),
            ("Total token throughput (tok/s):", s["total_token_throughput"])]
    for label, v in rows:
        print(f"{label:<36}{v:>14.2f}" if isinstance(v, float) else f"{label:<36}{v:>14}", file=out)
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^{w}}", file=out)
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            v = s[f"{stat}_{key}_ms"]
            print(f"{label + ' ' + key.upper() + ' (ms):':<36}{'n/a (not streamed)' if v is None else f'{v:.2f}':>14}",
                  file=out)
    print("=" * w, file=out)
    for e in s.get("errors", []):
        print(f"error: {e}", file=out)


def main(args: argparse.Namespace) -> int:
    for name in ("num_prompts",):
        if getattr(args, name) < 1:
            raise SystemExit(f"tidal bench serve: --{name.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        raise SystemExit(f"tidal bench serve: --request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise SystemExit(f"tidal bench serve: --burstiness must be > 0, got {args.burstiness}")
    try:
        requests = build_requests(args)
    except ValueError as e:
        raise SystemExit(f"tidal bench serve: {e}") from e
    summary = asyncio.run(run(args, requests))
    print_report(summary)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
