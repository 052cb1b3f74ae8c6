"""The capacity planner (tidal/planner/): the engine's real scheduler in simulated time, a roofline cost per
step, memory figures from the engine's own sizing, the CLI, and the calibration on a tiny model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tidal.planner.cost import CostModel, StepShape
from tidal.planner.devices import get_device, load_calibration
from tidal.planner.model import profile_model
from tidal.planner.report import highest_rate, requests_that_fit, summarize
from tidal.planner.simulator import EngineSettings, simulate
from tidal.planner.workload import Lengths, SimRequest, WorkloadSpec, at_rate, load_trace, synthesize


@pytest.fixture(scope="module")
def llama8b():
    return profile_model("llama-3-8b")


@pytest.fixture(scope="module")
def smollm2():
    return profile_model("SmolLM2-135M")


def run(profile, device="H100-80GB", settings=None, **spec):
    return simulate(profile, get_device(device), synthesize(WorkloadSpec(**spec)), settings)


# -- memory ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,quantization,tp,kv", [("jamba-1.5-large", "experts_int8", 8, "auto"),
                                                     ("mixtral-8x7b", "int8", 2, "fp8"),
                                                     ("SmolLM2-135M", None, 1, "auto")])
def test_memory_figures_equal_estimate_memory(name, quantization, tp, kv):
    from tidal.worker.sizing import bundled_config, estimate_memory
    profile = profile_model(name, quantization=quantization, tensor_parallel_size=tp, kv_cache_dtype=kv)
    est = estimate_memory(bundled_config(name), quantization=quantization, tensor_parallel_size=tp,
                          kv_cache_dtype=kv, context_lens=())
    assert (profile.weight_bytes, profile.kv_bytes_per_token, profile.state_bytes_per_request) == \
        (est.weight_bytes_per_device, est.kv_bytes_per_token_per_device, est.state_bytes_per_request_per_device)
    assert profile.total_params == est.total_params


def test_requests_that_fit_without_prefix_caching_equal_estimate_memory():
    """The engine's split of the budget (state slots at most half, KV the rest) gives estimate_memory's count."""
    from tidal.worker.sizing import bundled_config, estimate_memory
    profile = profile_model("jamba-1.5-large", quantization="experts_int8", tensor_parallel_size=8)
    est = estimate_memory(bundled_config("jamba-1.5-large"), quantization="experts_int8", tensor_parallel_size=8,
                          context_lens=(4096, 262144))
    settings = EngineSettings(max_num_seqs=4096, enable_prefix_caching=False)
    result = simulate(profile, get_device("H100-80GB"), [SimRequest(0.0, [1] * 64, 4)], settings)
    fit = requests_that_fit(profile, result, 4096, 16, [4096, 262144])
    assert [f["requests"] for f in fit] == [f.requests for f in est.fits]


def test_a_model_that_does_not_fit_is_reported_as_such():
    profile = profile_model("llama-3-70b")  # 141 GB of bf16 weights on one 48 GB device
    result = run(profile, "L40S", num_requests=4)
    assert not result.plan.fits and "weights" in result.plan.reason
    assert summarize(result) == {"fits": False, "reason": result.plan.reason}
    assert result.num_steps == 0


def test_pipeline_parallel_splits_the_layers(llama8b):
    pp2 = profile_model("llama-3-8b", pipeline_parallel_size=2)
    assert pp2.weight_bytes < llama8b.weight_bytes * 0.6
    assert pp2.kv_bytes_per_token == llama8b.kv_bytes_per_token // 2


# -- the cost of a step ---------------------------------------------------------------------------------------

def test_step_cost_grows_with_context_and_tokens(llama8b):
    cost = CostModel(llama8b, get_device("H100-80GB"))
    decode = cost.step_time(StepShape.of([(1, 128, True)] * 32))
    assert cost.step_time(StepShape.of([(1, 4096, True)] * 32)) > decode
    assert cost.step_time(StepShape.of([(2048, 0, True)])) > decode


def test_tensor_parallel_adds_all_reduces():
    profile = profile_model("llama-3-70b", tensor_parallel_size=4)
    parts = CostModel(profile, get_device("H100-80GB")).breakdown(StepShape.of([(512, 0, True)]))
    assert parts["communication"] > 0


def test_moe_reads_only_the_experts_a_small_batch_routes_to():
    profile = profile_model("mixtral-8x7b", tensor_parallel_size=2)
    cost = CostModel(profile, get_device("H100-80GB"))
    one = cost.breakdown(StepShape.of([(1, 64, True)]))["linear"]
    many = cost.breakdown(StepShape.of([(1, 64, True)] * 64))["linear"]
    assert many > 2 * one  # one token reads 2 of 8 experts, 64 tokens read nearly all


def test_the_cpu_row_is_the_reference_cpus_calibration():
    """The table's cpu row holds the reference CPU's measured figures: rates that rise with the rows of a
    product up to its peak, a one-row pass bound by the weights' bytes (2 FLOPs per 2-byte bf16 weight: the
    FLOP/s equal the bandwidth), the skinny GEMM for decodes of up to 4 requests, and the engine's fixed
    4 GiB cache on CPU; "cpu" and the row's full name both find it."""
    device = get_device("cpu")
    assert "EPYC" in device.name and get_device(device.name).as_dict() == device.as_dict()
    rows = sorted(device.gemm_flops_by_rows)
    rates = [device.gemm_rate(m) for m in rows]
    assert rates == sorted(rates) and rates[-1] == device.peak_gemm_rate == device.peak_flops["bf16"]
    assert device.gemm_flops_by_rows[1] == pytest.approx(device.memory_bandwidth, rel=0.01)
    assert device.gemm_efficiency == device.bandwidth_efficiency == 1.0  # achieved, not datasheet, figures
    assert device.skinny_max_rows == 4 and device.kv_cache_memory_bytes == 4 * 2**30
    assert 0 < device.attention_seconds_per_cached_kv_byte < device.attention_seconds_per_kv_byte
    assert device.serve_wide_step_overhead > 0 and device.serve_first_token_latency > 0


def test_the_cpu_row_predicts_the_measured_offline_run(smollm2):
    """`tidal bench throughput --workload offline` measured on the reference CPU (docs/planner.md: 25.85 s,
    652.3 output tokens/s, 262 steps, mean TTFT 6969 ms, mean TPOT 152 ms) is predicted within 15%. It ran
    2,048-token steps, the offline engine's budget on a CPU then (4,096 since)."""
    from tidal.benchmarks import datasets
    from tidal.planner.workload import from_requests
    s = summarize(simulate(smollm2, get_device("cpu"), from_requests(datasets.workload_requests("offline")),
                           EngineSettings(max_num_batched_tokens=2048)))
    for key, measured in (("duration_s", 25.85), ("output_throughput", 652.3), ("mean_ttft_ms", 6969),
                          ("mean_tpot_ms", 152)):
        assert s[key] == pytest.approx(measured, rel=0.15), (key, s[key])
    assert abs(s["num_steps"] - 262) <= 2


# -- the simulation -------------------------------------------------------------------------------------------

def test_throughput_rises_with_rate_until_saturation(llama8b):
    spec = dict(num_requests=64, input_len=(256, 512), output_len=(64, 128))
    tput = [summarize(run(llama8b, request_rate=r, **spec))["output_throughput"] for r in (1, 4, 16, float("inf"))]
    assert tput[0] < tput[1] < tput[2] <= tput[3] * 1.05
    low = summarize(run(llama8b, request_rate=1, **spec))
    assert low["request_throughput"] == pytest.approx(1, rel=0.35)  # underloaded: it carries what arrives


def test_latency_rises_with_rate(llama8b):
    spec = dict(num_requests=64, input_len=(256, 512), output_len=(64, 128))
    slow, fast = (summarize(run(llama8b, request_rate=r, **spec)) for r in (1, 64))
    assert fast["p99_ttft_ms"] > slow["p99_ttft_ms"] and fast["p50_tpot_ms"] > slow["p50_tpot_ms"]


def test_the_real_scheduler_runs_every_step(monkeypatch, smollm2):
    from tidal.core.scheduler import Scheduler
    from tidal.planner import simulator
    calls = []

    class Counting(Scheduler):
        def schedule(self):
            out = super().schedule()
            calls.append(out.num_batched_tokens)
            return out
    monkeypatch.setattr(simulator, "Scheduler", Counting)
    result = run(smollm2, num_requests=8, input_len=(100, 100), output_len=(10, 10))
    assert result.num_steps == len([c for c in calls if c]) > 0
    assert all(r.finish_time is not None for r in result.records)


def test_preemptions_appear_when_the_kv_cache_is_tight(smollm2):
    spec = dict(num_requests=32, input_len=(256, 256), output_len=(256, 256))
    tight = run(smollm2, settings=EngineSettings(kv_cache_memory_bytes=1024 * smollm2.kv_bytes_per_token,
                                                 max_model_len=1024), **spec)
    roomy = run(smollm2, settings=EngineSettings(max_model_len=1024), **spec)
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert all(r.finish_time is not None for r in tight.records)  # no request is dropped
    assert summarize(tight)["output_throughput"] < summarize(roomy)["output_throughput"]


def test_shared_prefixes_hit_the_prefix_cache(smollm2):
    spec = dict(num_requests=32, request_rate=8, input_len=(1100, 1100), output_len=(16, 16), prefix_len=1024)
    shared = summarize(run(smollm2, "cpu", **spec))
    cold = summarize(run(smollm2, "cpu", EngineSettings(enable_prefix_caching=False), **spec))
    assert shared["prefix_hit_rate"] > 0.8 and cold["prefix_hit_rate"] == 0
    assert shared["mean_ttft_ms"] < cold["mean_ttft_ms"]


def test_a_hybrid_model_runs_no_more_requests_than_its_state_slots():
    profile = profile_model("jamba-1.5-mini", tensor_parallel_size=2)
    settings = EngineSettings(kv_cache_memory_bytes=16 * profile.state_bytes_per_request, max_model_len=4096)
    result = run(profile, settings=settings, num_requests=16, input_len=(64, 64), output_len=(32, 32))
    assert result.plan.num_state_slots == 4  # half the budget, two slots (own + checkpoint) per request
    assert result.max_running == 4 and all(r.finish_time is not None for r in result.records)


def test_highest_rate_meets_the_slo(llama8b):
    spec = dict(num_requests=48, input_len=(256, 256), output_len=(64, 64))

    def at(rate):
        return summarize(run(llama8b, request_rate=rate, **spec))
    saturation = at(float("inf"))["request_throughput"]
    rate, s = highest_rate(at, 100.0, None, saturation)
    assert 0 < rate < float("inf") and s["p99_ttft_ms"] <= 100.0
    assert at(rate * 1.5)["p99_ttft_ms"] > 100.0
    assert highest_rate(at, 0.001, None, saturation)[0] is None  # 1 us to first token: never
    assert highest_rate(at, None, 1e6, saturation)[0] == float("inf")  # a bound no rate reaches


def test_trace_file(tmp_path, smollm2):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_time": 0.5, "prompt_len": 40, "output_len": 5}\n'
                    '{"arrival_time": 0.0, "prompt_token_ids": [1, 2, 3], "max_tokens": 2}\n')
    reqs = load_trace(str(path))
    assert [r.arrival_time for r in reqs] == [0.0, 0.5] and len(reqs[1].prompt_token_ids) == 40
    result = simulate(smollm2, get_device("cpu"), reqs)
    assert all(r.first_token_time > r.arrival_time for r in result.records)
    assert [r.arrival_time for r in at_rate(reqs, 8.0)] == [0.0, 0.25]  # 2 requests over 0.25 s: 8 per second


# -- length distributions ------------------------------------------------------------------------------------

def test_lognormal_lengths_have_the_asked_mean():
    """A log-normal of mean 512: the mean of many draws is 512, the median exp(-sigma^2 / 2) of it (most
    lengths short, a long tail); a narrower one keeps the mean."""
    import numpy as np
    for sigma in (1.0, 0.5):
        dist = Lengths("lognormal", 512, sigma=sigma)
        rng = np.random.default_rng(0)
        draws = np.array([dist.draw(rng) for _ in range(20000)])
        assert draws.mean() == pytest.approx(512, rel=0.03), sigma
        assert np.median(draws) == pytest.approx(512 * np.exp(-sigma ** 2 / 2), rel=0.05), sigma
        assert draws.min() >= 1 and len(set(draws.tolist())) > 100


def test_lognormal_workloads_are_reproducible_and_within_bounds():
    def lens(seed, **kw):
        spec = WorkloadSpec(400, input_len=Lengths("lognormal", 96, sigma=1.0),
                            output_len=Lengths("lognormal", 48, sigma=0.8), seed=seed, **kw)
        return [(len(r.prompt_token_ids), r.max_tokens) for r in synthesize(spec)]
    a = lens(7)
    assert a == lens(7) and a != lens(8)  # the workload's seed draws the lengths
    assert np.mean([i for i, _ in a]) == pytest.approx(96, rel=0.15)
    assert np.mean([o for _, o in a]) == pytest.approx(48, rel=0.15)
    capped = lens(7, max_model_len=128)  # the long tail kept within max_model_len, prompt and output together
    assert max(i + o for i, o in capped) <= 128 and min(min(p) for p in capped) >= 1
    assert max(i for i, _ in a) > 128  # (the tail the cap cut)
    bounded = WorkloadSpec(400, input_len=Lengths("lognormal", 96, 32, 160, sigma=1.0), seed=7)
    assert {32, 160} <= {len(r.prompt_token_ids) for r in synthesize(bounded)} <= set(range(32, 161))


def test_a_fixed_or_uniform_range_draws_as_before():
    """A (LO, HI) range is a uniform draw, and a fixed Lengths the same draw as a range of one value, so a
    seed gives the same workload it gave before the distributions."""
    spec = dict(num_requests=20, output_len=(16, 64), seed=3)
    tuple_spec, fixed = synthesize(WorkloadSpec(input_len=(100, 100), **spec)), \
        synthesize(WorkloadSpec(input_len=Lengths("fixed", 100), **spec))
    assert [(r.prompt_token_ids, r.max_tokens) for r in tuple_spec] == [(r.prompt_token_ids, r.max_tokens)
                                                                        for r in fixed]
    assert {len(r.prompt_token_ids) for r in tuple_spec} == {100}
    assert {r.max_tokens for r in tuple_spec} <= set(range(16, 65)) and len({r.max_tokens for r in tuple_spec}) > 5


@pytest.mark.parametrize("kwargs,message", [
    (dict(dist="pareto"), "must be one of fixed, uniform, lognormal, got 'pareto'"),
    (dict(dist="lognormal", sigma=0.0), "sigma .* must be > 0"),
    (dict(dist="lognormal", sigma=-1.0), "sigma .* must be > 0"),
    (dict(dist="lognormal"), "sigma .* must be > 0, got None"),
    (dict(dist="lognormal", sigma=1.0, lo=600, hi=900), r"mean must be within its range \[600, 900\]"),
    (dict(dist="uniform", lo=10, hi=5), "range must be 1 <= LO <= HI"),
])
def test_bad_length_distributions_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=f"input_len.*{message}"):
        Lengths(**{"mean": 512, **kwargs}, name="input_len")


@pytest.mark.parametrize("argv,message", [
    (["--input-len-dist", "lognormal", "--input-len-sigma", "0"], "argument --input-len-sigma: must be a number > 0"),
    (["--output-len-dist", "lognormal", "--output-len-sigma", "-0.5"], "argument --output-len-sigma: must be a number"),
    (["--input-len-dist", "pareto"], "argument --input-len-dist: invalid choice: 'pareto'"),
])
def test_cli_refuses_bad_length_arguments(argv, message, capsys):
    from tidal.entrypoints.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan", "--num-requests", "4", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--input-len-dist", "uniform"], "--input-len-dist uniform needs --input-len-range LO HI"),
    (["--output-len-sigma", "0.5"], "--output-len-sigma applies to --output-len-dist lognormal only"),
    (["--input-len-dist", "fixed", "--input-len-range", "8", "16"], "--input-len-range does not apply to"),
    (["--input-len-dist", "lognormal", "--input-len", "900", "--input-len-range", "1", "512"],
     r"--input-len mean must be within its range [1, 512], got 900"),
])
def test_cli_names_the_length_arguments_that_do_not_go_together(argv, message, capsys):
    from tidal.entrypoints.cli import main
    assert main(["plan", "--num-requests", "4", *argv]) == 2
    assert f"error: {message}" in capsys.readouterr().out


def test_cli_plans_lognormal_lengths(tmp_path, capsys):
    """Log-normal prompts and outputs through the CLI: the same seed plans the same workload, the lengths'
    means near the asked ones, every request within --max-model-len (a longer one is refused: exit 2)."""
    from tidal.entrypoints.cli import main
    from tidal.planner.cli import LENGTH_DISTRIBUTIONS
    from tidal.planner.workload import DISTRIBUTIONS
    assert LENGTH_DISTRIBUTIONS == DISTRIBUTIONS
    argv = ["plan", "--num-requests", "200", "--input-len", "300", "--input-len-dist", "lognormal",
            "--input-len-sigma", "1.2", "--output-len", "40", "--output-len-dist", "lognormal",
            "--max-model-len", "1024", "--seed", "5", "--output-json"]
    runs = []
    for i in range(2):
        assert main([*argv, str(tmp_path / f"{i}.json")]) == 0
        runs.append(json.loads((tmp_path / f"{i}.json").read_text())["summary"])
    assert runs[0] == runs[1] and runs[0]["completed"] == 200
    d = runs[0]["duration_s"]
    # tokens per second of the run x its duration: the lengths' totals
    assert runs[0]["output_throughput"] * d / 200 == pytest.approx(40, rel=0.2)
    assert (runs[0]["total_token_throughput"] - runs[0]["output_throughput"]) * d / 200 == pytest.approx(300, rel=0.2)


# -- the command line -----------------------------------------------------------------------------------------

def test_cli_plans_a_bundled_model(tmp_path, capsys):
    from tidal.entrypoints.cli import main
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "llama-3-8b", "--device", "H100-80GB", "--num-requests", "32",
               "--input-len", "512", "--output-len", "64", "--slo-tpot", "20", "--sweep", "2", "8",
               "--plot", str(tmp_path / "p.png"), "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "requests that fit at once" in text and "highest request rate with p99 TPOT <= 20 ms" in text
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 32 and data["slo"]["highest_rate"] > 0
    assert [p["request_rate"] for p in data["sweep"]] == [2, 8]
    assert f"wrote {tmp_path / 'p.png'}" in text


def _png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk; fails on anything else."""
    import struct
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_plot_is_a_png_of_the_sweep(tmp_path, capsys, monkeypatch):
    """--plot writes a PNG whose lines are the sweep's TTFT and TPOT (p50, p99) at its rates, as the plan's
    JSON reports them."""
    import matplotlib.image

    from tidal.entrypoints.cli import main
    from tidal.planner import report
    figures = []
    real = report.latency_figure
    monkeypatch.setattr(report, "latency_figure", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1])
    png, out = tmp_path / "latency.png", tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3-8b", "--device", "H100-80GB", "--num-requests", "16", "--input-len",
                 "256", "--output-len", "32", "--sweep", "1", "4", "16", "--plot", str(png),
                 "--output-json", str(out)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert _png_size(png) == (1000, 400)  # 10 x 4 inches at 100 dpi
    assert matplotlib.image.imread(str(png)).shape[:2] == (400, 1000)
    sweep = json.loads(out.read_text())["sweep"]
    (fig,) = figures
    ttft_ax, tpot_ax = fig.axes
    lines = {line.get_label(): line for ax in (ttft_ax, tpot_ax) for line in ax.get_lines()}
    assert sorted(lines) == ["TPOT p50", "TPOT p99", "TTFT p50", "TTFT p99"]
    for label, line in lines.items():
        metric, pct = label.lower().split()
        assert list(line.get_xdata()) == [p["request_rate"] for p in sweep] == [1, 4, 16]
        assert list(line.get_ydata()) == pytest.approx([p[f"{pct}_{metric}_ms"] for p in sweep]), label
    assert ttft_ax.get_yscale() == "log" and tpot_ax.get_ylim()[0] == 0


def test_cli_plot_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    import sys

    from tidal.entrypoints.cli import main
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    png = tmp_path / "latency.png"
    assert main(["plan", "--model", "llama-3-8b", "--device", "H100-80GB", "--num-requests", "8", "--input-len",
                 "128", "--output-len", "16", "--sweep", "2", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "matplotlib is not installed (pip install matplotlib): no plot written" in text
    assert "rate req/s" in text and not png.exists()  # the sweep's table is printed all the same


def test_cli_says_when_a_model_does_not_fit(capsys):
    from tidal.entrypoints.cli import main
    assert main(["plan", "--model", "llama-3-70b", "--device", "L40S", "--num-requests", "2"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_calibrate_writes_a_device_the_planner_reads(tmp_path, tiny_model_dir, capsys):
    from tidal.entrypoints.cli import main
    out = tmp_path / "cpu.json"
    assert main(["plan", "calibrate", "--model", tiny_model_dir("llama"), "--output", str(out), "--rows", "1", "8",
                 "--batch", "2", "--contexts", "16", "64", "--steps", "3", "--repeats", "1"]) == 0
    device = load_calibration(str(out))
    assert set(device.gemm_flops_by_rows) == {1, 8} and device.memory_bandwidth > 0
    assert device.attention_seconds_per_kv_byte > 0 and device.step_overhead >= 0
    assert main(["plan", "--model", tiny_model_dir("llama"), "--calibration", str(out), "--num-requests", "4",
                 "--input-len", "32", "--output-len", "8"]) == 0
    assert "simulated 4 requests" in capsys.readouterr().out


def test_calibration_fit_recovers_the_figures_that_produced_the_steps(smollm2):
    """Steps timed on a device of known figures (here: predicted by it) give those figures back."""
    from tidal.planner.calibrate import Measurements, fit
    truth = get_device("cpu")
    truth.gemm_flops_by_rows, truth.memory_bandwidth = {1: 2e9, 64: 40e9, 1024: 80e9}, 2e9
    truth.peak_flops = {"bf16": 80e9, "fp32": 40e9, "int8": 160e9}
    truth.attention_seconds_per_kv_byte, truth.attention_flops = 4e-10, 20e9
    truth.attention_seconds_per_cached_kv_byte = 2e-10  # bytes-bound: the fit takes the shared batch so
    truth.step_overhead, truth.request_overhead, truth.token_overhead = 2e-3, 60e-6, 5e-6
    cost = CostModel(smollm2, truth)

    def t(requests, shared=0):
        return cost.step_time(StepShape.of(requests, shared))
    # 64 requests of a 960-token shared prefix and a 64-token suffix (+1 decoded): 63 of them re-read the prefix
    m = Measurements(truth.gemm_flops_by_rows, 2e9, 8, 64, 1024, t([(1, 64, True)]), t([(1, 64, True)] * 8),
                     t([(1, 1024, True)] * 8), 64, t([(1, 64, True)] * 64), t([(1, 1024, True)] * 64, 63 * 960),
                     {n: t([(n, 0, True)]) for n in (1024, 256, 512)}, (960, 64))
    device, notes = fit(smollm2, m)
    assert notes == []
    for name in ("attention_seconds_per_kv_byte", "attention_seconds_per_cached_kv_byte", "attention_flops",
                 "step_overhead", "request_overhead", "token_overhead"):
        assert getattr(device, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    mixed = [(300, 0, True), (1, 700, True), (1, 40, True), (128, 512, False)]
    assert CostModel(smollm2, device).step_time(StepShape.of(mixed)) == pytest.approx(t(mixed), rel=1e-6)
    # nothing unmeasured comes from the table's cpu row (the reference CPU's calibration, served costs included)
    assert truth.serve_wide_step_overhead > 0 and truth.serve_first_token_latency > 0
    assert (device.serve_step_overhead, device.serve_request_overhead, device.serve_wide_step_overhead,
            device.serve_first_token_latency) == (0.0, 0.0, 0.0, 0.0)


def test_shared_blocks_and_the_served_cost(smollm2):
    """A step's KV tokens in blocks another request of it reads too are charged at the caches' rate, and a
    served step adds the server's cost per step and per request."""
    from tidal.core.kv_cache_manager import KVCacheManager
    from tidal.core.scheduler import ScheduledRequest
    from tidal.planner.simulator import _shared_kv_tokens
    from tidal.request import Request
    from tidal.sampling_params import SamplingParams
    kv = KVCacheManager(64, 16, True)
    prefix = list(range(40))
    reqs = [Request(str(i), prefix + [100 + i] * 8, SamplingParams(max_tokens=4)) for i in range(3)]
    for r in reqs:
        blocks, n = kv.get_computed_blocks(r)
        kv.allocate_slots(r, r.num_tokens - n, blocks)
        r.num_computed_tokens = r.num_tokens
    scheduled = [ScheduledRequest(r.request_id, 1, 48, True) for r in reqs]
    shared = _shared_kv_tokens(kv, scheduled, 16)
    assert shared == 2 * 2 * 16  # the prefix's two full blocks, re-read by the 2nd and 3rd requests
    device = get_device("cpu")
    device.attention_seconds_per_kv_byte, device.attention_seconds_per_cached_kv_byte = 4e-10, 1e-10
    device.serve_step_overhead, device.serve_request_overhead = 5e-3, 1e-4
    shape, alone = StepShape.of([(1, 48, True)] * 3, 64), StepShape.of([(1, 48, True)] * 3)
    kvb = smollm2.kv_bytes_per_token
    offline, served = CostModel(smollm2, device), CostModel(smollm2, device, served=True)
    assert offline.breakdown(alone)["attention"] - offline.breakdown(shape)["attention"] == \
        pytest.approx(64 * kvb * 3e-10, rel=1e-6)
    assert served.step_time(shape) - offline.step_time(shape) == pytest.approx(5e-3 + 3e-4, rel=1e-6)


def test_the_simulation_schedules_as_the_engine_does(tiny_model_dir):
    """Same requests, same cache: the simulated run takes the engine's own number of steps and preemptions
    (counts, not times: the schedule does not depend on the cost model when all requests arrive at once)."""
    from tests.helpers import random_prompts, tiny_llm
    from tidal.planner.workload import from_requests
    from tidal.sampling_params import SamplingParams
    path = tiny_model_dir("llama")
    profile = profile_model(path, dtype="float32")
    budget = 48 * 16 * profile.kv_bytes_per_token  # 48 blocks: preemptions
    prompts = random_prompts(24, 20, 100, 512, seed=3)
    outputs = [10 + 7 * i % 31 for i in range(24)]
    llm = tiny_llm(path, kv_cache_memory_bytes=budget, max_num_batched_tokens=256)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in outputs], use_tqdm=False)
    stats = llm.llm_engine.stats
    requests = from_requests([{"prompt_token_ids": p, "max_tokens": n} for p, n in zip(prompts, outputs)])
    result = simulate(profile, get_device("cpu"), requests,
                      EngineSettings(kv_cache_memory_bytes=budget, max_num_batched_tokens=256))
    assert stats.num_preemptions > 0, stats.num_preemptions
    assert (result.num_steps, result.num_preemptions) == (stats.num_steps, stats.num_preemptions), \
        (result.num_steps, result.num_preemptions)


# -- served runs: one server's successive runs, the server's latency to the first token ------------------------

def _served_device():
    device = get_device("cpu")
    device.serve_step_overhead, device.serve_request_overhead, device.serve_first_token_latency = 4e-3, 3e-4, 0.0
    return device


def test_a_later_run_finds_its_prompts_in_the_prefix_cache(smollm2):
    """A Simulation keeps its engine between runs, as a server does between two benchmark runs: the same
    prompts again compute only their last block, so the first token comes sooner; a fresh simulation
    (simulate) starts with an empty cache every time."""
    from tidal.planner.simulator import Simulation
    from tidal.planner.workload import from_requests
    reqs = [{"prompt_token_ids": [(7 * i + j) % 997 for j in range(128)], "max_tokens": 8} for i in range(6)]
    settings = EngineSettings(max_model_len=2048, served=True)
    device = _served_device()
    sim = Simulation(smollm2, device, settings)
    first = sim.run(from_requests(reqs, 4.0, 1.0, 0))
    second = sim.run(from_requests(reqs, 4.0, 1.0, 0))
    assert second.start_time == pytest.approx(first.end_time)  # its arrivals count from where the first ended
    assert [r.num_cached_tokens for r in first.records] == [0] * 6
    assert [r.num_cached_tokens for r in second.records] == [112] * 6  # 7 of the 8 blocks: the last is computed
    assert second.prefix_hit_rate > 0.8 and first.prefix_hit_rate == 0.0
    cold, warm = summarize(first), summarize(second)
    assert warm["mean_ttft_ms"] < 0.6 * cold["mean_ttft_ms"], (warm["mean_ttft_ms"], cold["mean_ttft_ms"])
    assert warm["duration_s"] == pytest.approx(second.end_time - second.start_time)
    again = summarize(simulate(smollm2, device, from_requests(reqs, 4.0, 1.0, 0), settings))
    assert again["mean_ttft_ms"] == pytest.approx(cold["mean_ttft_ms"])


def test_the_served_first_token_latency(smollm2):
    """Served, a request reaches the engine the server's first-token latency after it is sent: a lone
    request's TTFT is that latency plus its prompt step, and its TPOT does not change; offline it is not
    charged."""
    from tidal.planner.workload import from_requests
    device = _served_device()
    reqs = from_requests([{"prompt_token_ids": list(range(100)), "max_tokens": 16}])
    served = EngineSettings(max_model_len=2048, served=True)
    before = summarize(simulate(smollm2, device, reqs, served))
    device.serve_first_token_latency = 0.025
    after = summarize(simulate(smollm2, device, reqs, served))
    assert after["mean_ttft_ms"] - before["mean_ttft_ms"] == pytest.approx(25.0, rel=1e-6)
    assert after["mean_tpot_ms"] == pytest.approx(before["mean_tpot_ms"], rel=1e-9)
    step = CostModel(smollm2, device, served=True).step_time(StepShape.of([(100, 0, True)]))
    assert after["mean_ttft_ms"] == pytest.approx(25.0 + step * 1e3, rel=1e-6)
    offline = summarize(simulate(smollm2, device, reqs, EngineSettings(max_model_len=2048)))
    assert offline["mean_ttft_ms"] < before["mean_ttft_ms"]  # neither the latency nor the server's step cost


def test_a_serve_sweep_is_simulated_as_it_runs(smollm2):
    """serve_sweep.py's runs draw their own prompts: after its warm-up, each run finds only the first block
    of its first prompt cached (the probe `tidal bench serve` sends first). A run of prompts sent before
    finds all but their last block cached."""
    from tidal.benchmarks import datasets
    from tidal.benchmarks.sweep import sweep_seed
    from tidal.planner.calibrate import simulate_sweep, sweep_warmup_requests
    runs = [(datasets.random_requests(8, (128, 128), (8, 8), sweep_seed(i)), rate, 1.0, sweep_seed(i))
            for i, rate in enumerate((4.0, 8.0))]
    again = (runs[0][0], 8.0, 1.0, sweep_seed(0))
    first, second, third = simulate_sweep(smollm2, _served_device(), runs + [again],
                                          warmup=sweep_warmup_requests(128, 8))
    assert [r.num_cached_tokens for r in first.records] == [16] + [0] * 7
    assert [r.num_cached_tokens for r in second.records] == [16] + [0] * 7
    assert [r.num_cached_tokens for r in third.records] == [112] * 8


def test_a_served_step_off_the_skinny_gemm_costs_more(smollm2):
    """Served, a step whose products leave the skinny GEMM (a decode of more requests than skinny_max_rows,
    or any step with a prompt) pays the wide step's cost on top of the per-step one; offline neither."""
    device = _served_device()
    device.serve_wide_step_overhead, device.skinny_max_rows = 6e-3, 4
    offline, served = CostModel(smollm2, device), CostModel(smollm2, device, served=True)

    def extra(requests):
        shape = StepShape.of(requests)
        return served.step_time(shape) - offline.step_time(shape)
    assert extra([(1, 100, True)] * 4) == pytest.approx(4e-3 + 4 * 3e-4, rel=1e-6)
    assert extra([(1, 100, True)] * 5) == pytest.approx(4e-3 + 5 * 3e-4 + 6e-3, rel=1e-6)
    assert extra([(3, 0, True)]) == pytest.approx(4e-3 + 3e-4 + 6e-3, rel=1e-6)  # a prompt of 3 tokens
    device.skinny_max_rows = 0  # no skinny kernel: every step is a wide one
    assert extra([(1, 100, True)]) == pytest.approx(4e-3 + 3e-4 + 6e-3, rel=1e-6)


def test_the_serving_fit_recovers_the_figures_that_produced_the_runs(smollm2):
    """Served runs simulated with known server figures (the benchmark's results: mean TPOT and TTFT) give
    those figures back: the cost per step and the wide step's from the TPOTs (a low rate: mostly skinny
    decodes; a high one: wider batches), the latency from the TTFTs."""
    from tidal.benchmarks import datasets
    from tidal.benchmarks.sweep import sweep_seed
    from tidal.planner.calibrate import fit_serve, simulate_sweep, sweep_warmup_requests
    truth = _served_device()
    truth.serve_request_overhead, truth.serve_wide_step_overhead, truth.skinny_max_rows = 0.0, 6e-3, 4
    truth.serve_first_token_latency = 0.012
    results = []
    runs = [(datasets.random_requests(16, (64, 64), (16, 16), sweep_seed(i)), rate, 1.0, sweep_seed(i))
            for i, rate in enumerate((0.5, 12.0))]
    for (reqs, rate, _, seed), sim in zip(runs, simulate_sweep(smollm2, truth, runs,
                                                               warmup=sweep_warmup_requests(64, 16))):
        s = summarize(sim)
        results.append({"num_prompts": 16, "seed": seed, "total_input_tokens": 16 * 64,
                        "total_output_tokens": 16 * 16,
                        "request_rate": rate, "burstiness": 1.0, "mean_tpot_ms": s["mean_tpot_ms"],
                        "mean_ttft_ms": s["mean_ttft_ms"]})
    device = get_device("cpu")
    device.skinny_max_rows = 4
    step, wide, latency = fit_serve(smollm2, device, results)
    assert step == pytest.approx(4e-3, rel=0.05) and wide == pytest.approx(6e-3, rel=0.05)
    assert device.serve_request_overhead == 0.0 and device.serve_wide_step_overhead == wide
    assert latency == pytest.approx(0.012, abs=1e-3)
    assert device.serve_first_token_latency == latency


@pytest.mark.parametrize(("device", "served", "seqs", "budget"), [
    ("cpu", True, 128, 2048),         # `tidal serve` on a CPU: vLLM's CPU server defaults
    ("cpu", False, 256, 4096),        # the offline engine on a CPU (LLM, tidal bench throughput)
    ("H100-80GB", True, 256, 2048),
    ("H100-80GB", False, 256, 2048),
])
def test_simulated_engine_takes_the_engines_defaults_for_the_device(smollm2, device, served, seqs, budget):
    from tidal.planner.simulator import Simulation
    sim = Simulation(smollm2, get_device(device), EngineSettings(max_model_len=2048, served=served))
    assert (sim.scheduler.max_num_seqs, sim.scheduler.max_num_batched_tokens) == (seqs, budget)
    given = Simulation(smollm2, get_device(device), EngineSettings(max_num_seqs=64, max_model_len=2048, served=served))
    assert given.scheduler.max_num_seqs == 64
