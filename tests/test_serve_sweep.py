"""benchmarks/serve_sweep.py's rounds (--repeat) and the ratios it prints, with the servers and runs faked
(tidal.benchmarks.sweep's own start, wait and runs are tested with real servers elsewhere)."""
from __future__ import annotations

import contextlib
import json
import sys
from types import SimpleNamespace

import pytest

from tests.helpers import load_benchmark

serve_sweep = load_benchmark("serve_sweep")


def _result(tok_s: float, ms: float) -> dict:
    return {"output_throughput": tok_s, "mean_ttft_ms": ms, "p99_ttft_ms": 2 * ms, "mean_tpot_ms": ms / 10,
            "p99_e2el_ms": 10 * ms}


def test_ratios_are_per_round_and_the_median_takes_the_middle():
    rounds = [{"tidal": {"inf": _result(900, 100)}, "vllm": {"inf": _result(600, 200)}},
              {"tidal": {"inf": _result(800, 300)}, "vllm": {"inf": _result(800, 200)}},
              {"tidal": {"inf": _result(700, 100)}, "vllm": {"inf": _result(500, 100)}}]
    per = serve_sweep.ratios(rounds, ["inf"])
    assert per["inf"]["output_throughput"] == [1.5, 1.0, 1.4]
    assert per["inf"]["p99_ttft_ms"] == [0.5, 1.5, 1.0]
    assert serve_sweep.median(per["inf"]["output_throughput"]) == 1.4
    assert serve_sweep.median([1.0, 3.0]) == 2.0


def test_repeat_runs_every_engine_on_fresh_servers_each_round(monkeypatch, capsys):
    started = []
    throughput = {"tidal": iter([900.0, 800.0, 700.0]), "vllm": iter([600.0, 800.0, 500.0])}

    @contextlib.contextmanager
    def serving(cmd, port, name, env=None):
        started.append(name)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=SimpleNamespace(pid=0))

    def fake_sweep(url, rates, **kw):
        name = started[-1]
        return [_result(next(throughput[name]), 100.0) for _ in rates]

    monkeypatch.setattr(serve_sweep.sweep, "serving", serving)
    monkeypatch.setattr(serve_sweep.sweep, "sweep", fake_sweep)
    monkeypatch.setattr(serve_sweep.sweep, "free_port", lambda: 12345)
    monkeypatch.setattr(serve_sweep.shutil, "which", lambda path: path)
    monkeypatch.setattr(sys, "argv", ["serve_sweep.py", "--engines", "vllm", "tidal", "--rates", "inf",
                                      "--repeat", "3"])
    assert serve_sweep.main() == 0
    out = capsys.readouterr().out
    assert started == ["vllm", "tidal"] * 3
    assert "round 3 of 3" in out
    assert "median of 3 rounds" in out
    assert "out tok/s 1.40x (1.00-1.50)" in out  # 1.5, 1.0, 1.4
    result = json.loads(out.split("RESULT ", 1)[1])
    assert [r["tidal"]["inf"]["output_throughput"] for r in result["rounds"]] == [900.0, 800.0, 700.0]


def test_no_stream_passes_on_and_prints_no_latency_ratios(monkeypatch, capsys):
    """--no-stream: the runs go without streaming, and the latencies such runs do not measure (null) print
    as n/a, with no ratio, while the throughput's ratio stands."""
    asked = []

    @contextlib.contextmanager
    def serving(cmd, port, name, env=None):
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=SimpleNamespace(pid=0))

    def fake_sweep(url, rates, stream=True, **kw):
        asked.append(stream)
        r = dict(_result(900.0 if len(asked) % 2 == 0 else 600.0, 100.0), mean_ttft_ms=None, p99_ttft_ms=None,
                 mean_tpot_ms=None)
        return [r for _ in rates]

    monkeypatch.setattr(serve_sweep.sweep, "serving", serving)
    monkeypatch.setattr(serve_sweep.sweep, "sweep", fake_sweep)
    monkeypatch.setattr(serve_sweep.sweep, "free_port", lambda: 12345)
    monkeypatch.setattr(serve_sweep.shutil, "which", lambda path: path)
    monkeypatch.setattr(sys, "argv", ["serve_sweep.py", "--engines", "vllm", "tidal", "--rates", "inf",
                                      "--no-stream", "--repeat", "2"])
    assert serve_sweep.main() == 0
    out = capsys.readouterr().out
    assert asked == [False] * 4
    assert "TTFT ms n/a" in out and "out tok/s 1.50x (1.50-1.50)" in out and "p99 E2E ms 1.00x" in out


def test_repeat_below_one_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["serve_sweep.py", "--repeat", "0"])
    with pytest.raises(SystemExit):
        serve_sweep.main()
    assert "--repeat must be at least 1, got 0" in capsys.readouterr().err
