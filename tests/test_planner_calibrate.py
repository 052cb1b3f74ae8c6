"""`tidal plan calibrate --serve`: the served runs measured in one command (tidal.benchmarks.sweep: a `tidal
serve` started here, its warm-up and rates through `tidal bench serve`, the server stopped however the runs
end) and fitted as the planner simulates them."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from tidal.benchmarks import sweep
from tidal.planner import calibrate
from tidal.planner.cost import CostModel, StepShape
from tidal.planner.devices import get_device, load_calibration
from tidal.planner.model import profile_model


@pytest.fixture(scope="module")
def smollm2():
    return profile_model("SmolLM2-135M")


def _measurements(profile) -> calibrate.Measurements:
    """Engine steps as a device of plausible CPU figures would time them (no engine runs)."""
    device = get_device("cpu")
    device.gemm_flops_by_rows, device.memory_bandwidth = {1: 30e9, 64: 700e9, 1024: 850e9}, 30e9
    device.attention_seconds_per_kv_byte, device.attention_flops = 4e-11, 400e9
    device.step_overhead, device.request_overhead, device.token_overhead = 1e-3, 30e-6, 50e-6
    cost = CostModel(profile, device)

    def t(requests, shared=0):
        return cost.step_time(StepShape.of(requests, shared))
    return calibrate.Measurements(device.gemm_flops_by_rows, 30e9, 8, 64, 1024, t([(1, 64, True)]),
                                  t([(1, 64, True)] * 8), t([(1, 1024, True)] * 8), 64, t([(1, 64, True)] * 64),
                                  t([(1, 1024, True)] * 64, 63 * 960), {n: t([(n, 0, True)]) for n in (1024, 256, 512)},
                                  (960, 64))


class _FakeServer:
    def __init__(self, events: list, cmd, port: int) -> None:
        self.events, self.cmd, self.port = events, list(cmd), port
        self.url, self.log_path = f"http://127.0.0.1:{port}", "/dev/null"

    def stop(self) -> None:
        self.events.append("stop")


def _fake_sweep(monkeypatch, fail_at: int | None = None, error: BaseException | None = None) -> tuple[list, list]:
    """Replace the server start and the bench run: returns (events, servers started)."""
    events, servers = [], []

    def start(cmd, port, name="tidal", env=None, ready_timeout=600.0, log_dir=None):
        servers.append(_FakeServer(events, cmd, port))
        events.append("start")
        return servers[-1]

    def run_rate(url, rate, *, num_prompts, input_len, output_len, seed, vocab_size=None, stream=True):
        assert url == servers[-1].url and stream  # calibration measures streamed latencies
        events.append(("run", rate, num_prompts, seed))
        if fail_at is not None and len([e for e in events if e[0] == "run"]) == fail_at:
            raise error
        return {"num_prompts": num_prompts, "seed": seed, "request_rate": rate, "burstiness": 1.0,
                "total_input_tokens": num_prompts * input_len, "total_output_tokens": num_prompts * output_len,
                "mean_tpot_ms": 10.0 + rate, "mean_ttft_ms": 60.0 + rate, "completed": num_prompts, "failed": 0,
                "duration": 1.0, "output_throughput": 100.0}
    monkeypatch.setattr(sweep, "start", start)
    monkeypatch.setattr(sweep, "run_rate", run_rate)
    return events, servers


def test_calibrate_serve_runs_the_sweep_the_fit_simulates_then_stops_the_server(monkeypatch, smollm2):
    """--serve starts `tidal serve` as the sweep does (bf16, the served max_model_len, request logging off, a
    local port), runs the warm-up (4 requests at once, its own seed) and then each rate in order with
    sweep_seed(i), stops the server, and hands the rates' results, in order, to fit_serve."""
    events, servers = _fake_sweep(monkeypatch)
    fitted = []

    def fit_serve(profile, device, results, max_model_len=2048):
        fitted.append((results, max_model_len, list(events)))
        device.serve_step_overhead, device.serve_wide_step_overhead = 1e-3, 2e-3
        device.serve_first_token_latency = 0.01
        return 1e-3, 2e-3, 0.01
    monkeypatch.setattr(calibrate, "fit_serve", fit_serve)
    monkeypatch.setattr(calibrate, "profile_model", lambda model, dtype: smollm2)
    lines = []
    out = calibrate.calibrate("some-model", measurements=_measurements(smollm2), serve=calibrate.ServeSweep(),
                              progress=lines.append)
    # the defaults are the validated calibration's (docs/planner.md)
    assert calibrate.ServeSweep() == calibrate.ServeSweep((0.5, 6.0), 16, 128, 64, 2048)
    assert events == ["start", ("run", float("inf"), calibrate.SWEEP_WARMUP, calibrate.SWEEP_WARMUP_SEED),
                      ("run", 0.5, 16, sweep.sweep_seed(0)), ("run", 6.0, 16, sweep.sweep_seed(1)), "stop"]
    cmd = servers[0].cmd
    assert cmd[cmd.index("serve") + 1] == "some-model" and cmd[cmd.index("--port") + 1] == str(servers[0].port)
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert "--disable-log-requests" in cmd
    (results, max_model_len, events_then), = fitted
    assert events_then[-1] == "stop"  # the server is stopped before the fit
    assert [(r["request_rate"], r["seed"], r["num_prompts"]) for r in results] == [(0.5, 1, 16), (6.0, 2, 16)]
    assert max_model_len == 2048
    # the warm-up and the fit's simulation draw the same requests as the runs (random dataset, each seed)
    assert [run[3] for run in calibrate.serve_runs(results)] == [1, 2]
    assert out["serve_step_overhead"] == 1e-3 and out["serve_first_token_latency"] == 0.01
    assert out["measured"]["serve_results"] == results
    assert any("rate 0.5 req/s" in line for line in lines) and any("rate 6 req/s" in line for line in lines)


@pytest.mark.parametrize("error", [sweep.SweepError("a request failed"), KeyboardInterrupt()])
def test_the_server_is_stopped_when_a_run_fails(monkeypatch, smollm2, error):
    events, _ = _fake_sweep(monkeypatch, fail_at=2, error=error)
    monkeypatch.setattr(calibrate, "profile_model", lambda model, dtype: smollm2)
    monkeypatch.setattr(calibrate, "fit_serve", lambda *a, **k: pytest.fail("fitted after a failed run"))
    with pytest.raises(type(error)):
        calibrate.calibrate("some-model", measurements=_measurements(smollm2), serve=calibrate.ServeSweep(),
                            progress=lambda line: None)
    assert events[-1] == "stop" and events.count("stop") == 1 and len(events) == 4  # start, warm-up, 0.5, stop


def test_calibrate_serve_options(monkeypatch, tmp_path, capsys):
    """The served runs' options apply only with --serve; --serve and --serve-result exclude each other; a
    server that fails is an error (status 1), after the server was stopped."""
    from tidal.entrypoints.cli import main
    assert main(["plan", "calibrate", "--serve-rates", "1", "2"]) == 2
    assert "--serve-rates applies only with --serve" in capsys.readouterr().out
    assert main(["plan", "calibrate", "--serve", "--serve-result", "a.json"]) == 2
    assert main(["plan", "calibrate", "--serve", "--serve-rates", "0"]) == 2
    assert main(["plan", "calibrate", "--serve", "--serve-input-len", "2000", "--serve-output-len", "64"]) == 2
    events, _ = _fake_sweep(monkeypatch, fail_at=1, error=sweep.SweepError("the probe request failed"))
    monkeypatch.setattr(calibrate, "profile_model", lambda model, dtype: profile_model("SmolLM2-135M"))
    assert main(["plan", "calibrate", "--serve", "--output", str(tmp_path / "cpu.json")]) == 1
    assert "error: the probe request failed" in capsys.readouterr().out
    assert events[-1] == "stop" and not (tmp_path / "cpu.json").exists()


_HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_serving_waits_for_health_and_stops_the_server_on_an_error(tmp_path):
    port = sweep.free_port()
    with pytest.raises(RuntimeError, match="boom"):
        with sweep.serving([sys.executable, "-c", _HEALTH_SERVER, str(port)], port, "fake",
                           log_dir=str(tmp_path)) as server:
            assert server.proc.poll() is None
            raise RuntimeError("boom")
    assert server.proc.poll() is not None
    # a server that exits before it is ready: an error with its log
    with pytest.raises(sweep.SweepError, match="exited with status 3"):
        sweep.start([sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"], port, "fake",
                    log_dir=str(tmp_path))


# a "server" whose child process burns CPU while the parent sleeps (as an engine core under an HTTP server)
_BUSY = """
import time
print("go", flush=True)
while True:
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    time.sleep(0.01)
"""
_BUSY_TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE)
child.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


def test_cpu_split_charges_each_process_of_the_server_tree_and_the_client():
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_TREE, _BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with sweep.cpu_split(proc.pid) as split:
            assert split == {}  # filled when the block ends
            t = time.process_time()
            while time.process_time() - t < 0.2:  # the client's own work
                pass
            time.sleep(0.6)
        server, = (v for k, v in split.items() if k.startswith(f"pid {proc.pid}: "))
        child, = (v for k, v in split.items() if k.startswith("pid ") and not k.startswith(f"pid {proc.pid}: "))
        assert server < 0.1  # the parent slept
        assert child > 0.2  # ~5/6 of 0.8 s busy
        assert 0.15 < split["client"] < 0.8
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_calibrate_serve_end_to_end_on_a_tiny_model(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """One command: the engine steps timed, a real `tidal serve` on the tiny model measured at two rates
    (a few short requests), stopped, and the serving figures fitted into the calibration file."""
    import tempfile

    from tidal.entrypoints.cli import main
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the server's log
    model = tiny_model_dir("llama")
    out = tmp_path / "cpu.json"
    t0 = time.perf_counter()
    assert main(["plan", "calibrate", "--model", model, "--output", str(out), "--rows", "1", "8", "--batch", "2",
                 "--contexts", "16", "64", "--steps", "3", "--repeats", "1", "--wide", "4",
                 "--serve", "--serve-rates", "2", "20", "--serve-num-prompts", "4", "--serve-input-len", "32",
                 "--serve-output-len", "8", "--serve-max-model-len", "128"]) == 0
    printed = capsys.readouterr().out
    print(f"calibrate --serve on the tiny model: {time.perf_counter() - t0:.1f} s")
    assert "serving: rate 2 req/s (1 of 2)" in printed and "serving: server stopped" in printed
    data = json.loads(out.read_text())
    runs = data["measured"]["serve_results"]
    assert [(r["request_rate"], r["seed"], r["completed"], r["failed"]) for r in runs] == [(2.0, 1, 4, 0),
                                                                                         (20.0, 2, 4, 0)]
    assert all(r["vocab_size"] == 512 and r["total_input_tokens"] == 4 * 32 for r in runs)
    # fitted (the fit keeps every figure >= 0: on a tiny model timed on a busy machine any of them may be 0)
    for key in ("serve_step_overhead", "serve_wide_step_overhead", "serve_request_overhead",
                "serve_first_token_latency"):
        assert isinstance(data[key], float) and data[key] >= 0, key
    device = load_calibration(str(out))
    assert device.serve_first_token_latency == data["serve_first_token_latency"]
    # nothing of the server is left running
    left = [p for p in psutil.process_iter(["cmdline"]) if model in " ".join(p.info["cmdline"] or [])]
    assert left == []
