"""`tidal plan calibrate`: measure this machine for the planner and write the figures as a device file
(JSON, read with `tidal plan --calibration FILE`).

Everything is timed on the engine's own code with a real model (bf16), with greedy sampling as the
benchmarks use:
- GEMM rate at a few row counts M: one pass over every linear layer of the model (the products of one
  forward, on weights that do not stay in the caches), FLOPs 2 x M x parameters over the time; the
  one-row pass gives the memory bandwidth (weight bytes over its time);
- attention per KV byte: whole engine decode steps of the same batch at a short and a long context,
  the difference over the KV bytes the longer context adds;
- host overhead: engine decode steps of 1 and of a wide batch (64) at the short context, less what the
  figures above predict for them, split into a fixed part per step and a part per request;
- repeated KV reads: decode steps of the wide batch at the long context, all but the short context of it a
  shared prefix (the same cached blocks), less the same batch at the short context and the distinct
  blocks' reads: the rest over the prefix's repeated reads is a time per KV byte read from the caches;
- prompts: engine steps computing a whole fresh prompt of the long context and of a quarter of it, less
  what the figures above predict for their linear layers, give a cost per token (elementwise layers,
  inputs) and attention's FLOP rate on prompts.
A prompt of half the long context is then timed and predicted, as a check of figures not fitted on it.
- serving (optional: --serve, or --serve-result): `tidal bench serve` runs against `tidal serve` on this
  machine, a low and a high rate (--serve: started here on the model, the runs of
  tidal.benchmarks.sweep made, the server stopped; --serve-result: the results of such a sweep measured
  before, e.g. by benchmarks/serve_sweep.py, in the order they ran); the same runs are simulated as the
  sweep makes them (one server: its warm-up, then each rate with prompts of its own,
  the prefix cache kept between them) with the figures above, and the measured mean
  TPOTs' excess over the simulated ones gives the server's cost per engine step and per request of a
  step (HTTP, detokenization and streaming share the host with the engine), the mean TTFTs' excess its
  latency to a request's first token (the request's way in and its first chunk's way out); both are
  applied when a plan is for a served workload.

    tidal plan calibrate --model ~/.cache/tidal-peers/smollm2-135m-instruct --serve --output cpu.json
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

# the sweep's warm-up (tidal.benchmarks.sweep), which the planner simulates
from tidal.benchmarks.sweep import SWEEP_WARMUP, SWEEP_WARMUP_SEED, SweepError
from tidal.planner.cost import CostModel, StepShape
from tidal.planner.devices import Device, get_device
from tidal.planner.model import ModelProfile, profile_model


def _time(fn, repeats: int) -> float:
    """Median of `repeats` timings of fn (after one untimed call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rates(model: torch.nn.Module, rows: list[int], dtype: torch.dtype, repeats: int) -> tuple[dict, float]:
    """{M: FLOP/s} over all linear layers at M rows, and the bandwidth (B/s) of the one-row pass."""
    from tidal.layers.linear import LinearBase
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    params = sum(m.in_features * m.out_features for m in linears) if linears else 0
    nbytes = sum(p.numel() * p.element_size() for m in linears for p in m.parameters(recurse=False))
    rates, bandwidth = {}, 0.0
    with torch.inference_mode():
        for M in rows:
            inputs = {m.in_features: torch.randn(M, m.in_features, dtype=dtype) for m in linears}

            def one_pass():
                for m in linears:
                    m(inputs[m.in_features])
            t = _time(one_pass, repeats)
            rates[M] = 2 * M * params / t
            if M == min(rows):
                bandwidth = nbytes / t
    return rates, bandwidth


class _Steps:
    """Times engine decode steps of a fixed batch: B requests of a C-token prompt, prefilled first."""

    def __init__(self, engine) -> None:
        self.engine, self.counter = engine, 0

    def _add(self, batch: int, context: int, max_tokens: int, prefix: int = 0) -> list[str]:
        """batch requests of `context` random tokens, the first `prefix` of them the same for all."""
        from tidal.sampling_params import SamplingParams
        ids = []
        g = torch.Generator().manual_seed(10**6 + self.counter)
        shared = torch.randint(0, self.engine.vocab_size, (prefix,), generator=g).tolist()
        for _ in range(batch):
            self.counter += 1
            g = torch.Generator().manual_seed(self.counter)
            prompt = shared + torch.randint(0, self.engine.vocab_size, (context - prefix,), generator=g).tolist()
            rid = f"calibrate-{self.counter}"
            # greedy and detokenized, as the benchmarks' requests are (random sampling adds elementwise work
            # over the whole vocabulary per sampled row: ~0.35 ms a row for SmolLM2 on a 2-core CPU)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    detokenize=self.engine.tokenizer is not None)
            self.engine.add_request(rid, prompt, params)
            ids.append(rid)
        return ids

    def prefill_step_time(self, context: int, repeats: int) -> float:
        """One step computing a whole fresh prompt of `context` tokens (a check of the fitted figures)."""
        times = []
        for _ in range(repeats):
            ids = self._add(1, context, 2)
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
            self.engine.abort_request(ids)
        self.engine.reset_prefix_cache()
        return statistics.median(times)

    def decode_step_time(self, batch: int, context: int, steps: int, prefix: int = 0) -> float:
        e = self.engine
        ids = self._add(batch, context, steps + 8, prefix)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.requests.values()):
            e.step()  # the prompts' prefill: not timed
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            e.step()
            times.append(time.perf_counter() - t0)
        e.abort_request(ids)
        e.reset_prefix_cache()
        return statistics.median(times[1:] if len(times) > 2 else times)


@dataclass
class Measurements:
    """What calibrate times: GEMM FLOP/s by rows, the one-row bandwidth, and engine steps (s)."""
    gemm_flops_by_rows: dict[int, float]
    bandwidth: float
    batch: int
    short: int
    long: int
    decode_one: float          # one request at the short context
    decode_short: float        # `batch` requests at the short context
    decode_long: float         # `batch` requests at the long context
    wide: int                  # a wide batch at the short context: the per-request cost
    decode_wide: float
    decode_shared: float       # `wide` requests of a shared prefix and a distinct suffix
    prefill: dict[int, float]  # a whole fresh prompt of n tokens: long, long // 4 (fitted) and long // 2 (check)
    shared: tuple[int, int] = (0, 0)  # the shared batch's (prefix, suffix) tokens


def measure(model: str, *, rows=(1, 4, 16, 64, 256, 1024, 2048), batch: int = 16, contexts=(64, 1024),
            steps: int = 30, repeats: int = 5, kv_cache_memory_bytes: int = 2**30, wide: int = 64) -> Measurements:
    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine
    short, long = contexts
    if not 1 <= short < long or batch < 1:
        raise ValueError(f"contexts must be 1 <= SHORT < LONG and batch >= 1, got {contexts}, {batch}")
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", device="cpu", max_model_len=long + steps + 16,
                                    max_num_seqs=max(batch, wide), max_num_batched_tokens=max(2048, long),
                                    kv_cache_memory_bytes=kv_cache_memory_bytes))
    try:
        rates, bandwidth = gemm_rates(engine.runner.model, list(rows), torch.bfloat16, repeats)
        timer = _Steps(engine)
        return Measurements(rates, bandwidth, batch, short, long, timer.decode_step_time(1, short, steps),
                            timer.decode_step_time(batch, short, steps), timer.decode_step_time(batch, long, steps),
                            wide, timer.decode_step_time(wide, short, steps),
                            timer.decode_step_time(wide, long, steps, prefix=long - short),
                            {n: timer.prefill_step_time(n, repeats) for n in (long, long // 4, long // 2)},
                            (long - short, short))
    finally:
        engine.shutdown()


def fit(profile: ModelProfile, m: Measurements) -> tuple[Device, list[str]]:
    """The device whose cost model reproduces the measured steps (see the module docstring), and notes on
    any figure that could not be separated."""
    notes = []
    device = get_device("cpu")
    device.gemm_flops_by_rows, device.memory_bandwidth = dict(m.gemm_flops_by_rows), m.bandwidth
    peak = max(m.gemm_flops_by_rows.values())
    device.peak_flops = {"bf16": peak, "fp32": peak / 2, "int8": 2 * peak}
    device.step_overhead = device.request_overhead = device.layer_overhead = device.token_overhead = 0.0
    # nothing of the table's row (the reference CPU's own calibration) is carried over unmeasured: the served
    # costs stay 0 unless fit_serve fits them, and attention's figures are this machine's or None
    device.serve_step_overhead = device.serve_request_overhead = device.serve_wide_step_overhead = 0.0
    device.serve_first_token_latency = 0.0
    device.attention_flops = device.attention_seconds_per_cached_kv_byte = None
    device.source = "calibration"
    added_kv = m.batch * (m.long - m.short) * profile.kv_bytes_per_token
    per_kv_byte = (m.decode_long - m.decode_short) / added_kv if added_kv else 0.0
    if per_kv_byte <= 0:
        notes.append("the long-context steps were not slower than the short ones (a busy machine?): attention "
                     "per KV byte taken as one read at the measured bandwidth")
        per_kv_byte = 1 / m.bandwidth
    device.attention_seconds_per_kv_byte = per_kv_byte

    def predicted(requests: list[tuple[int, int, bool]], without: str | None = None) -> float:
        parts = CostModel(profile, device).breakdown(StepShape.of(requests))
        return sum(v for k, v in parts.items() if k != without)

    # decodes: what is left beyond the predicted work is a fixed part per step and a part per request
    # (a wide batch: at a few rows the products are bound by the weights' bytes, and the GEMM rate
    # interpolated between measured row counts is least exact there)
    residual_one = m.decode_one - predicted([(1, m.short, True)])
    residual_wide = m.decode_wide - predicted([(1, m.short, True)] * m.wide)
    request = max(0.0, (residual_wide - residual_one) / (m.wide - 1)) if m.wide > 1 else 0.0
    if residual_one < 0:
        notes.append("a one-request decode step ran faster than its predicted compute: step overhead set to 0")
    device.step_overhead, device.request_overhead = max(0.0, residual_one - request), request
    # prompts: beyond their predicted linear, head and overhead work, a cost per token past the first (the first
    # is in the per-request figure) plus attention's query-key FLOPs at their own rate; two lengths give both
    def beyond(n: int) -> tuple[float, float, float]:
        shape = StepShape.of([(n, 0, True)])
        flops = 4 * profile.num_heads * profile.head_dim * shape.attn_pairs * profile.num_attn_layers
        return n - 1, flops, m.prefill[n] - predicted([(n, 0, True)], without="attention")
    (n1, f1, y1), (n2, f2, y2) = beyond(m.long), beyond(m.long // 4)
    det = n1 * f2 - n2 * f1
    per_token, per_flop = ((y1 * f2 - y2 * f1) / det, (n1 * y2 - n2 * y1) / det) if det else (-1.0, 0.0)
    if per_token < 0 or per_flop <= 0:
        per_token, per_flop = 0.0, (y1 / f1 if y1 > 0 and f1 else 0.0)
        notes.append("the two prompt lengths did not separate a per-token cost from attention: all of it is "
                     "taken as attention")
    # a decode step has one token per request: the per-request figure fitted on decodes already held it
    device.token_overhead, device.request_overhead = per_token, max(0.0, request - per_token)
    device.attention_flops = 1 / per_flop if per_flop > 0 else None
    # a shared prefix: beyond the same batch at the short context, the distinct blocks at the memory rate, the
    # prefix's repeated reads (wide - 1 readers after the first) at the caches' rate
    prefix, suffix = m.shared
    distinct_kv = (prefix + m.wide * (suffix + 1)) * profile.kv_bytes_per_token
    repeated_kv = (m.wide - 1) * prefix * profile.kv_bytes_per_token
    extra = m.decode_shared - m.decode_wide - distinct_kv * per_kv_byte \
        + m.wide * (m.short + 1) * profile.kv_bytes_per_token * per_kv_byte  # the short batch's own reads
    if extra > 0 and repeated_kv:
        device.attention_seconds_per_cached_kv_byte = min(per_kv_byte, extra / repeated_kv)
    else:
        notes.append("a batch sharing a prefix was not slower than one without: repeated KV reads taken as free")
        device.attention_seconds_per_cached_kv_byte = 0.0
    return device, notes


PROBE_TOKENS = 16           # `tidal bench serve`'s probe before each run: the first prompt's first 16 tokens, 2 out


@dataclass
class ServeSweep:
    """The served runs --serve makes (tidal.benchmarks.sweep): after the warm-up, `num_prompts` requests of
    `input_len` random tokens and `output_len` out at each rate in order. The defaults are the validated
    calibration's (docs/planner.md): a low rate, mostly one request a step (the skinny GEMM), and a high
    one, wider batches; max_model_len is the served engine's."""
    rates: tuple[float, ...] = (0.5, 6.0)
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if not self.rates or not all(r > 0 for r in self.rates):
            raise ValueError(f"the served runs' rates must be > 0 (inf: all at once), got {list(self.rates)}")
        if min(self.num_prompts, self.input_len, self.output_len) < 1:
            raise ValueError(f"the served runs' prompts, input and output lengths must be >= 1, got "
                             f"{self.num_prompts}, {self.input_len}, {self.output_len}")
        if self.input_len + self.output_len > self.max_model_len:
            raise ValueError(f"the served runs' input + output length ({self.input_len} + {self.output_len}) "
                             f"exceeds the served max_model_len {self.max_model_len}")


def sweep_warmup_requests(input_len: int, output_len: int, vocab_size: int | None = None) -> list[dict]:
    """The requests of the sweep's warm-up for runs of these lengths."""
    from tidal.benchmarks import datasets
    return datasets.random_requests(SWEEP_WARMUP, (input_len,) * 2, (output_len,) * 2, SWEEP_WARMUP_SEED,
                                    vocab_size)


def measure_serve(model: str, spec: ServeSweep | None = None, vocab_size: int | None = None,
                  progress=print) -> list[dict]:
    """Start `tidal serve` on the model (a free local port; bf16, spec.max_model_len, request logging
    off), wait for /health, make the sweep's runs (its warm-up, then spec.rates in order, each with
    sweep_seed(i)) with `tidal bench serve`, stop the server (also on an error or an interrupt) and
    return each rate's results, as fit_serve takes them. Prompts are token ids below `vocab_size` when
    given (a model's vocabulary smaller than the benchmarks' token range)."""
    from tidal.benchmarks import datasets, sweep
    spec = spec or ServeSweep()
    if vocab_size is not None and vocab_size >= datasets.TOKEN_HI:
        vocab_size = None  # the benchmarks' own token range fits: the same prompts as `tidal bench serve`'s

    def say(line: str) -> None:
        progress(f"serving: {line}")
    port = sweep.free_port()
    say(f"starting tidal serve on {model} (127.0.0.1:{port})")
    t0 = time.perf_counter()
    with sweep.serving(sweep.tidal_serve_command(model, port, spec.max_model_len), port) as server:
        say(f"server ready in {time.perf_counter() - t0:.1f} s (log {server.log_path})")
        try:
            results = sweep.sweep(server.url, spec.rates, num_prompts=spec.num_prompts, input_len=spec.input_len,
                                  output_len=spec.output_len, vocab_size=vocab_size, progress=say)
        except sweep.SweepError as e:
            raise sweep.SweepError(f"{e} (server log {server.log_path})") from None
    say("server stopped")
    return results


def simulate_sweep(profile: ModelProfile, device: Device, runs: list[tuple[list[dict], float, float, int]],
                   max_model_len: int = 2048, warmup: list[dict] | None = None) -> list:
    """A sweep's runs (tidal.benchmarks.sweep), simulated as it makes them: one server (one engine, its prefix
    cache kept from run to run), first its warm-up (the `warmup` requests, all at once), then each run
    (requests, rate, burstiness, seed of the arrivals) in order; `tidal bench serve` sends its probe
    before each (warm-up included). A prompt that an earlier run, the warm-up or the probe sent is found
    in the prefix cache (all but its last block's tokens), as on the server. Returns the SimResult of
    each run."""
    from tidal.planner import workload
    from tidal.planner.simulator import EngineSettings, Simulation
    sim = Simulation(profile, device, EngineSettings(max_model_len=max_model_len, served=True))

    def bench(requests: list[dict], rate: float, burstiness: float, seed: int):
        sim.run([workload.SimRequest(0.0, list(requests[0]["prompt_token_ids"][:PROBE_TOKENS]), 2)])
        return sim.run(workload.from_requests(requests, rate, burstiness, seed))
    if warmup:
        bench(warmup, float("inf"), 1.0, SWEEP_WARMUP_SEED)
    return [bench(*run) for run in runs]


def serve_runs(results: list[dict]) -> list[tuple[list[dict], float, float, int]]:
    """The requests of `tidal bench serve` results (random dataset, fixed lengths, each result's seed and,
    where it records one, its vocabulary bound), with each run's rate, burstiness and seed."""
    from tidal.benchmarks import datasets
    runs = []
    for result in results:
        n, seed = result["num_prompts"], result.get("seed", 0)
        in_len, out_len = result["total_input_tokens"] // n, result["total_output_tokens"] // n
        requests = datasets.random_requests(n, (in_len,) * 2, (out_len,) * 2, seed, result.get("vocab_size"))
        runs.append((requests, result["request_rate"], result.get("burstiness") or 1.0, seed))
    return runs


def fit_serve(profile: ModelProfile, device: Device, results: list[dict],
              max_model_len: int = 2048) -> tuple[float, float, float]:
    """The server's two costs per step and its first-token latency per request, from the results of one
    sweep (tidal.benchmarks.sweep: measure_serve, or benchmarks/serve_sweep.py; random dataset; in the
    order it ran them) against the simulation of
    the same runs on one server (simulate_sweep: its warm-up, then each run, the prefix cache kept
    between them). The costs: a cost per step, and more per step whose products leave the skinny GEMM
    (with a device that has one; else more per request of a step), solved so that the simulated mean
    TPOTs match the measured ones (a few Newton steps on the simulation, so the queueing the costs add is
    simulated, not assumed; one result: the per-step cost alone). The latency: the measured mean TTFT
    less the simulated one, averaged over the results. Returns (per step, the second cost, latency)."""
    import numpy as np

    from tidal.planner import report
    runs = serve_runs(results)
    first = runs[0][0][0]  # the first run's first request: the warm-up's requests have its lengths
    warmup = sweep_warmup_requests(len(first["prompt_token_ids"]), first["max_tokens"], results[0].get("vocab_size"))
    second = "serve_wide_step_overhead" if device.skinny_max_rows > 0 else "serve_request_overhead"
    device.serve_request_overhead = device.serve_wide_step_overhead = 0.0

    def summaries(x: np.ndarray) -> list[dict]:
        device.serve_step_overhead = float(x[0])
        setattr(device, second, float(x[1]))
        return [report.summarize(r) for r in simulate_sweep(profile, device, runs, max_model_len, warmup)]

    def tpots(x: np.ndarray) -> np.ndarray:
        return np.array([s["mean_tpot_ms"] / 1e3 for s in summaries(x)])
    target = np.array([r["mean_tpot_ms"] / 1e3 for r in results])
    ttfts = np.array([r["mean_ttft_ms"] / 1e3 for r in results])
    k = 2 if len(runs) > 1 else 1
    x = np.zeros(2)
    device.serve_first_token_latency = 0.0
    for _ in range(2):  # the latency moves arrivals a little, and so the steps: the costs again with it
        for _ in range(3):
            y = tpots(x)
            jac = np.stack([(tpots(x + d) - y) / d[i] for i, d in enumerate(np.eye(2)[:k] * 1e-3)], axis=1)
            x[:k] += np.linalg.lstsq(jac, target - y, rcond=None)[0]
            x = np.maximum(x, 0.0)
        simulated = np.array([s["mean_ttft_ms"] / 1e3 for s in summaries(x)])
        device.serve_first_token_latency = max(0.0, device.serve_first_token_latency
                                               + float(np.mean(ttfts - simulated)))
    device.serve_step_overhead = float(x[0])
    setattr(device, second, float(x[1]))
    return float(x[0]), float(x[1]), device.serve_first_token_latency


def calibrate(model: str, serve_result: list[str] | None = None, serve_max_model_len: int = 2048,
              measurements: Measurements | None = None, serve: ServeSweep | None = None, progress=print,
              **kwargs) -> dict:
    """Measure (keyword arguments: measure's; or given measurements) and fit; returns the device file's
    contents. The server's costs are fitted on the served runs measured here first (`serve`: measure_serve,
    its max_model_len the served engine's) or on results measured before (`serve_result`: JSON files, the
    served engine's max_model_len `serve_max_model_len`); on neither they stay 0."""
    from tidal.worker.memory import cache_budget_bytes
    if serve is not None and serve_result:
        raise ValueError("give the served runs to measure (serve) or results measured before (serve_result), "
                         "not both")
    profile = profile_model(model, dtype="bfloat16")
    results = []
    if serve is not None:  # first: a server that does not start fails the calibration before the long part
        results = measure_serve(model, serve, profile.vocab_size, progress)
        serve_max_model_len = serve.max_model_len
    for path in serve_result or ():
        with open(path) as f:
            results.append(json.load(f))
    if measurements is None:
        progress("engine steps: timing the model's products and engine steps")
    m = measurements or measure(model, **kwargs)
    device, notes = fit(profile, m)
    device.skinny_max_rows = _skinny_max_rows()
    if results:
        fit_serve(profile, device, results, serve_max_model_len)
    check = m.long // 2
    predicted_check = CostModel(profile, device).step_time(StepShape.of([(check, 0, True)]))
    keys = ("peak_flops", "memory_bandwidth", "attention_seconds_per_kv_byte", "attention_seconds_per_cached_kv_byte",
            "attention_flops", "step_overhead",
            "layer_overhead", "request_overhead", "token_overhead", "serve_step_overhead", "serve_request_overhead",
            "serve_wide_step_overhead", "serve_first_token_latency", "skinny_max_rows")
    return {
        "base": "cpu", "name": f"cpu ({platform.node()}, {torch.get_num_threads()} threads)",
        "memory_bytes": _memory_bytes(), **{k: getattr(device, k) for k in keys},
        "gemm_flops_by_rows": {str(k): v for k, v in m.gemm_flops_by_rows.items()},
        "kv_cache_memory_bytes": cache_budget_bytes(None),  # the engine's own CPU budget
        "measured": {"model": model, "threads": torch.get_num_threads(), "batch": m.batch,
                     "contexts": [m.short, m.long],
                     "decode_step_s": {f"1x{m.short}": m.decode_one, f"{m.batch}x{m.short}": m.decode_short,
                                       f"{m.batch}x{m.long}": m.decode_long, f"{m.wide}x{m.short}": m.decode_wide,
                                       f"{m.wide}x{m.shared[0]}+{m.shared[1]} sharing {m.shared[0]}": m.decode_shared},
                     "prefill_step_s": {str(n): t for n, t in m.prefill.items()},
                     # how well the fitted figures predict a step they were not fitted on
                     "check_prefill_step_s": {"tokens": check, "measured": m.prefill[check],
                                              "predicted": predicted_check},
                     # the served runs the server's costs were fitted on (`tidal bench serve` results)
                     "serve_results": results,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "notes": notes,
    }


def _skinny_max_rows() -> int:
    """Decodes of up to this many requests run their products on the skinny GEMM (bf16 on AVX-512 BF16:
    tidal.layers.linear); 0 where the native GEMM library is not available."""
    from tidal.layers import cpu_kernels
    return cpu_kernels.SKINNY_MAX_ROWS if cpu_kernels.gemm_lib() is not None else 0


def _memory_bytes() -> int:
    import psutil
    return psutil.virtual_memory().total


def serve_sweep_from_args(args) -> ServeSweep | None:
    """The served runs of `tidal plan calibrate --serve` (None without it); the --serve-* options of the
    runs are refused without --serve, and --serve beside --serve-result (ValueError)."""
    given = {"--serve-rates": args.serve_rates, "--serve-num-prompts": args.serve_num_prompts,
             "--serve-input-len": args.serve_input_len, "--serve-output-len": args.serve_output_len}
    if not args.serve:
        unused = sorted(flag for flag, v in given.items() if v is not None)
        if unused:
            raise ValueError(f"{', '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} only with --serve")
        return None
    if args.serve_result:
        raise ValueError("--serve measures the served runs here, --serve-result reads runs measured before: give one")
    default = ServeSweep()

    def given_or(value, fallback):
        return fallback if value is None else value
    return ServeSweep(tuple(given_or(args.serve_rates, default.rates)),
                      given_or(args.serve_num_prompts, default.num_prompts),
                      given_or(args.serve_input_len, default.input_len),
                      given_or(args.serve_output_len, default.output_len), args.serve_max_model_len)


def main(args) -> int:
    model = os.path.expanduser(args.model)
    try:
        serve = serve_sweep_from_args(args)
    except ValueError as e:
        print(f"error: {e}")
        return 2

    def progress(line: str) -> None:
        print(line, flush=True)
    try:
        result = calibrate(model, rows=args.rows, batch=args.batch, contexts=tuple(args.contexts),
                           steps=args.steps, repeats=args.repeats, wide=args.wide, serve_result=args.serve_result,
                           serve_max_model_len=args.serve_max_model_len, serve=serve, progress=progress)
    except SweepError as e:  # the served runs: a server that did not start, a failed request
        print(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {args.output} not written" + (" (the server was stopped)" if serve else ""))
        return 130
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    rates = ", ".join(f"M={k}: {v / 1e9:.1f}" for k, v in result["gemm_flops_by_rows"].items())
    print(f"GEMM GFLOP/s ({rates}); bandwidth {result['memory_bandwidth'] / 1e9:.1f} GB/s; attention "
          f"{result['attention_seconds_per_kv_byte'] * 1e12:.1f} ps per KV byte; step overhead "
          f"{result['step_overhead'] * 1e3:.2f} ms + {result['request_overhead'] * 1e6:.0f} us per request + "
          f"{result['token_overhead'] * 1e6:.1f} us per token; attention on prompts "
          f"{(result['attention_flops'] or 0) / 1e9:.1f} GFLOP/s; repeated KV reads "
          f"{result['attention_seconds_per_cached_kv_byte'] * 1e12:.1f} ps per byte; served: "
          f"{result['serve_step_overhead'] * 1e3:.2f} ms per step + "
          f"{result['serve_wide_step_overhead'] * 1e3:.2f} ms more per step off the skinny GEMM + "
          f"{result['serve_request_overhead'] * 1e6:.0f} us per request of a step, "
          f"{result['serve_first_token_latency'] * 1e3:.1f} ms to each request's first token")
    check = result["measured"]["check_prefill_step_s"]
    print(f"check: a {check['tokens']}-token prefill step took {check['measured'] * 1e3:.1f} ms, predicted "
          f"{check['predicted'] * 1e3:.1f} ms")
    for note in result["notes"]:
        print("note:", note)
    print(f"wrote {args.output}")
    return 0
