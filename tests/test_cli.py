"""The `tidal` command line: help texts, `generate` and `chat` on the default model (as subprocesses,
as a user runs them), streaming, and `bench throughput` on a tiny random model."""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from tidal.benchmarks import datasets
from tidal.entrypoints import cli
from tidal.entrypoints.engine_args import add_engine_args

SMALL_ENGINE = ["--kv-cache-memory-bytes", "33554432", "--max-model-len", "1024"]


def tidal_cli(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run([sys.executable, "-m", "tidal.entrypoints.cli", *args], check=False, input=stdin,
                          text=True, capture_output=True, timeout=timeout, env=env)


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    return out.getvalue()


def engine_flags() -> list[str]:
    parser = add_engine_args(argparse.ArgumentParser())
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


# -- help ------------------------------------------------------------------------------------------

def test_tidal_help_lists_the_subcommands():
    proc = tidal_cli("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("generate", "chat", "bench"):
        assert name in proc.stdout


@pytest.mark.parametrize("argv", [("generate",), ("chat",), ("bench", "throughput")])
def test_help_lists_every_engine_flag(argv):
    text = help_text(*argv)
    flags = engine_flags()
    assert {"--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--dtype"} <= set(flags)
    missing = [f for f in flags if f not in text]
    assert not missing, f"tidal {' '.join(argv)} --help lacks {missing}"


SUBCOMMANDS = [("generate",), ("chat",), ("serve",), ("bench", "throughput"), ("bench", "serve")]


@pytest.mark.parametrize("argv", SUBCOMMANDS)
def test_every_flag_in_help_is_in_docs_cli(argv, monkeypatch):
    """docs/cli.md names every flag `--help` lists, so the doc stays true as flags come and go."""
    monkeypatch.setenv("COLUMNS", "1000")  # no flag broken across lines
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", help_text(*argv))) - {"-h", "--help"}
    assert len(flags) > 10
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")) as f:
        doc = f.read()
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", doc))
    assert not missing, f"docs/cli.md does not mention these flags of tidal {' '.join(argv)}: {missing}"


def cli_parsers():
    """(argv, parser) of each subcommand, as `tidal` builds them."""
    parser = cli.build_parser()
    subparsers = {}

    def walk(p, prefix):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    subparsers[(*prefix, name)] = sub
                    walk(sub, (*prefix, name))

    walk(parser, ())
    return [(argv, subparsers[argv]) for argv in SUBCOMMANDS]


@pytest.mark.parametrize("argv,parser", cli_parsers(), ids=[" ".join(a) for a in SUBCOMMANDS])
def test_every_choice_of_a_flag_is_in_its_docs_cli_row(argv, parser):
    """A flag with a fixed set of values (--quantization, --kv-cache-dtype, ...) lists them all in its
    row of docs/cli.md's tables."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")) as f:
        rows = [line.split("|")[1:] for line in f if line.startswith("| `")]
    for action in parser._actions:
        if not action.choices or not action.option_strings:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        cells = [" ".join(r) for r in rows if re.search(rf"`{re.escape(flag)}(?![\w-])", r[0])]
        assert cells, f"docs/cli.md has no row for {flag} (tidal {' '.join(argv)})"
        missing = [c for c in action.choices if not any(re.search(rf"(?<![\w-]){re.escape(str(c))}(?![\w-])", cell)
                                                        for cell in cells)]
        assert not missing, f"docs/cli.md's row for {flag} does not name {missing} (tidal {' '.join(argv)})"


# A non-default value of each engine flag, and the EngineConfig field it must set.
ENGINE_FLAG_VALUES = {
    "--model": (["--model", "m"], "model", "m"), "--tokenizer": (["--tokenizer", "t"], "tokenizer", "t"),
    "--tokenizer-mode": (["--tokenizer-mode", "slow"], "tokenizer_mode", "slow"),
    "--trust-remote-code": (["--trust-remote-code"], "trust_remote_code", True),
    "--dtype": (["--dtype", "float32"], "dtype", "float32"), "--device": (["--device", "cuda"], "device", "cuda"),
    "--gpu-memory-utilization": (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    "--max-model-len": (["--max-model-len", "99"], "max_model_len", 99),
    "--max-num-seqs": (["--max-num-seqs", "3"], "max_num_seqs", 3),
    "--max-num-batched-tokens": (["--max-num-batched-tokens", "77"], "max_num_batched_tokens", 77),
    "--block-size": (["--block-size", "8"], "block_size", 8),
    "--kv-cache-memory-bytes": (["--kv-cache-memory-bytes", "1000"], "kv_cache_memory_bytes", 1000),
    "--commit-kv-cache": (["--commit-kv-cache"], "commit_kv_cache", True),
    "--enable-prefix-caching": (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    "--enable-chunked-prefill": (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    "--batch-invariant": (["--batch-invariant"], "batch_invariant", True),
    "--seed": (["--seed", "7"], "seed", 7), "--enforce-eager": (["--enforce-eager"], "enforce_eager", True),
    "--tensor-parallel-size": (["-tp", "2"], "tensor_parallel_size", 2),
    "--pipeline-parallel-size": (["-pp", "2"], "pipeline_parallel_size", 2),
    "--distributed-executor-backend": (["--distributed-executor-backend", "ray"], "distributed_executor_backend",
                                       "ray"),
    "--quantization": (["-q", "int8"], "quantization", "int8"),
    "--kv-cache-dtype": (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    "--speculative-config": (["--speculative-config", '{"method": "ngram"}'], "speculative_config",
                             '{"method": "ngram"}'),
    "--served-model-name": (["--served-model-name", "x"], "served_model_name", "x"),
    "--disable-log-stats": (["--disable-log-stats"], "disable_log_stats", True),
    "--load-format": (["--load-format", "dummy"], "load_format", "dummy"),
    "--async-scheduling": (["--async-scheduling"], "async_scheduling", True),
}


def test_every_engine_flag_sets_its_engine_config_field(monkeypatch):
    from tidal.entrypoints import engine_args
    monkeypatch.setattr(engine_args, "EngineConfig", lambda **kw: kw)  # the fields, before validation
    parser = add_engine_args(argparse.ArgumentParser())
    assert set(ENGINE_FLAG_VALUES) == {f for f in engine_flags() if not f.startswith("--no-")}
    default = engine_args.engine_config_from_args(parser.parse_args([]))
    for flag, (argv, field, value) in ENGINE_FLAG_VALUES.items():
        got = engine_args.engine_config_from_args(parser.parse_args(argv))
        assert got[field] == value != default[field], flag
        assert {k: v for k, v in got.items() if k != field} == {k: v for k, v in default.items() if k != field}, flag


def test_max_num_seqs_defaults_to_vllms_cpu_server_value_for_serve_only():
    from tidal.entrypoints import engine_args
    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_args.engine_config_from_args(parser.parse_args(["--device", "cpu"]), server=True).max_num_seqs == 128
    assert engine_args.engine_config_from_args(parser.parse_args(["--device", "cpu"])).max_num_seqs == 256
    given = parser.parse_args(["--device", "cpu", "--max-num-seqs", "300"])
    assert engine_args.engine_config_from_args(given, server=True).max_num_seqs == 300
    assert engine_args.default_max_num_seqs("cpu", server=True) == 128
    assert engine_args.default_max_num_seqs("cpu", server=False) == 256


def test_periodic_stats_default_off_for_terminal_commands_on_for_serve_and_bench():
    parsers = {name: p for name, p in cli.build_parser()._subparsers._group_actions[0].choices.items()}
    assert parsers["generate"].parse_args([]).disable_log_stats is True
    assert parsers["chat"].parse_args([]).disable_log_stats is True
    assert parsers["generate"].parse_args(["--no-disable-log-stats"]).disable_log_stats is False
    assert parsers["serve"].parse_args([]).disable_log_stats is False


def test_generate_system_needs_chat(capsys):
    assert cli.main(["generate", "hi", "--system", "be brief"]) == 2
    assert "--system needs --chat" in capsys.readouterr().err


def test_serve_refuses_two_different_models(tmp_path):
    with pytest.raises(SystemExit, match="two models given: 'a' and --model 'b'"):
        cli.main(["serve", "a", "--model", "b"])


def test_serve_builds_its_config_with_the_server_defaults(monkeypatch):
    from tidal.entrypoints import engine_args
    from tidal.entrypoints.openai import cli as serve_cli
    seen = []

    def config_from_args(args, model=None, server=False):
        seen.append(engine_args.engine_config_from_args(args, model, server=server).max_num_seqs)
        raise ValueError("stop here")
    monkeypatch.setattr(serve_cli, "engine_config_from_args", config_from_args)
    with pytest.raises(SystemExit, match="stop here"):
        cli.main(["serve", "--device", "cpu", "--no-engine-core-process"])
    assert seen == [128]


@pytest.mark.parametrize("argv,message", [
    (["--workload", "offline", "--num-prompts", "5"], "--num-prompts does not apply to the requests of --workload"),
    (["--dataset-path", "x.json", "--dataset", "prefix"], "--dataset does not apply to the requests of --dataset-path"),
    (["--dataset", "prefix", "--input-len-range", "4", "8"], "--input-len-range does not apply"),
    (["--prefix-len", "10"], "--prefix-len does not apply to the requests of --dataset random"),
    (["--random-range-ratio", "0.5"], "--random-range-ratio does not apply"),
    (["--input-len-range", "4", "8", "--random-input-len", "6"], "--input-len-range and --random-input-len"),
])
def test_bench_throughput_refuses_request_options_that_do_not_apply(argv, message):
    from tidal.benchmarks.throughput import add_arguments, check_request_options
    with pytest.raises(SystemExit, match=re.escape(message)):
        check_request_options(add_arguments(argparse.ArgumentParser()).parse_args(argv))


@pytest.mark.parametrize("argv,message", [
    (["--dataset-path", "x.json", "--random-input-len", "5"], "--random-input-len does not apply"),
    (["--dataset", "prefix", "--random-range-ratio", "0.5"], "--random-range-ratio does not apply"),
    (["--suffix-len", "5"], "--suffix-len does not apply to the requests of --dataset random"),
    (["--output-len-range", "4", "8", "--random-output-len", "6"], "--output-len-range and --random-output-len"),
])
def test_bench_serve_refuses_request_options_that_do_not_apply(argv, message):
    from tidal.benchmarks.serve import add_arguments, check_request_options
    with pytest.raises(SystemExit, match=re.escape(message)):
        check_request_options(add_arguments(argparse.ArgumentParser()).parse_args(argv))


def test_generate_help_lists_sampling_flags():
    text = help_text("generate")
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--stop", "--seed", "--chat"):
        assert flag in text


def test_generate_rejects_bad_sampling_value_before_loading(capsys):
    assert cli.main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0, got -1.0" in capsys.readouterr().err


def test_generate_names_a_missing_model(capsys, tmp_path):
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- generate / chat on the default model --------------------------------------------------------

def test_generate_prints_text_and_exits_0():
    proc = tidal_cli("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                     "--show-stats", *SMALL_ENGINE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "no text on stdout"
    assert "8 tokens" in proc.stderr and "finish reason: length" in proc.stderr


def test_generate_with_tokenizer_from_another_folder(tmp_path):
    """A model folder without tokenizer files takes text prompts with --tokenizer (here the default
    model's tokenizer, from its GGUF conversion)."""
    from tests.helpers import save_tiny_model, tiny_config
    from tidal.loader.gguf_loader import cached_metadata
    from tidal.loader.loader import default_model_path
    model = save_tiny_model(str(tmp_path / "model"), tiny_config("llama", vocab_size=49152))
    args = ("generate", "The tide", "--model", model, "--max-tokens", "4", "--temperature", "0", "--show-stats",
            "--kv-cache-memory-bytes", "4194304")
    proc = tidal_cli(*args)
    assert proc.returncode == 2 and "no tokenizer" in proc.stderr  # text prompts need a tokenizer
    proc = tidal_cli(*args, "--tokenizer", cached_metadata(default_model_path()))
    assert proc.returncode == 0, proc.stderr
    assert "4 tokens" in proc.stderr and proc.stdout.strip()


def test_chat_with_piped_stdin_answers_two_turns_with_history():
    # fp32: the first answer token is a near tie in bf16 ('The' -1.88 vs 'L' -1.97 in fp32), whose
    # rounding differs between CPUs; fp32 answers the same everywhere
    proc = tidal_cli("chat", "--max-tokens", "16", "--temperature", "0", "--show-stats", "--dtype", "float32",
                     "--kv-cache-memory-bytes", "67108864", "--max-model-len", "1024",
                     stdin="What is the capital of France?\nAnd of Germany?\n/exit\nnever read\n")
    assert proc.returncode == 0, proc.stderr
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[") and "tokens in" in line]
    assert len(stats) == 2, proc.stderr  # two replies, and the line after /exit was not answered
    assert "Paris" in proc.stdout
    # "And of Germany?" means nothing without the first turn: Berlin shows the history was kept.
    assert "Berlin" in proc.stdout


def test_stream_writes_pieces_that_join_to_the_final_text(smollm2):
    from tidal.entrypoints.cli_generate import stream
    from tidal.sampling_params import SamplingParams

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.pieces = []

        def write(self, s):
            self.pieces.append(s)
            return super().write(s)

    prompt = "List the planets of the solar system:"
    params = SamplingParams(max_tokens=24, temperature=0.0)
    final = smollm2.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    out = Recorder()
    reply = stream(smollm2.llm_engine, prompt, params.clone(output_kind="delta"), out)
    assert len(out.pieces) > 1, "the reply came in one piece: nothing was streamed"
    assert reply.text == out.getvalue() == final.text
    assert reply.num_tokens == len(final.token_ids)
    assert reply.finish_reason == final.finish_reason


# -- bench throughput ------------------------------------------------------------------------------

def test_workloads_reproduce_the_shared_generator_draw_for_draw():
    # Fingerprints of /work/shared/bench/workload.py's output (the package must not import it).
    expected = {"offline": (128, 35511, 16865, "4728a93fafb6c71b"),
                "shared_prefix": (64, 69632, 4096, "d8615c91804b526f"),
                "single": (1, 128, 128, "2d760646e21c54d3")}
    for name, want in expected.items():
        reqs = datasets.workload_requests(name)
        got = (len(reqs), sum(len(r["prompt_token_ids"]) for r in reqs), sum(r["max_tokens"] for r in reqs),
               hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:16])
        assert got == want, name
    assert datasets.random_requests(128, (32, 512), (16, 256), 0, vocab_size=49152) == \
        datasets.workload_requests("offline")


def test_random_dataset_respects_ranges_and_vocabulary():
    reqs = datasets.random_requests(50, (5, 9), (2, 3), seed=7, vocab_size=512)
    assert all(5 <= len(r["prompt_token_ids"]) <= 9 and 2 <= r["max_tokens"] <= 3 for r in reqs)
    assert all(0 <= t < 512 for r in reqs for t in r["prompt_token_ids"])
    with pytest.raises(ValueError, match="input_len_range"):
        datasets.random_requests(1, (9, 5), (2, 3))


def test_dataset_path_and_prefix_dataset(tmp_path):
    from tidal.benchmarks.throughput import add_arguments, build_requests
    path = tmp_path / "reqs.json"
    path.write_text(json.dumps([{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}]))
    parser = add_arguments(argparse.ArgumentParser())
    reqs, warm = build_requests(parser.parse_args(["--dataset-path", str(path)]), vocab_size=512)
    assert reqs == [{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}] and warm != reqs
    reqs, _ = build_requests(parser.parse_args(["--dataset", "prefix", "--num-prompts", "3", "--prefix-len", "10",
                                                "--suffix-len", "2", "--output-len", "5"]), vocab_size=512)
    assert len(reqs) == 3 and all(r["prompt_token_ids"][:10] == reqs[0]["prompt_token_ids"][:10] for r in reqs)
    assert len({tuple(r["prompt_token_ids"]) for r in reqs}) == 3 and all(r["max_tokens"] == 5 for r in reqs)
    path.write_text(json.dumps([{"prompt_token_ids": [], "max_tokens": 4}]))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        datasets.load_json_requests(str(path))


@pytest.mark.parametrize("flag,want", [(None, None), ("--batch-invariant", True), ("--no-batch-invariant", False)])
def test_bench_throughput_leaves_the_default_batch_invariance_to_the_engine(monkeypatch, flag, want):
    """Unset, --batch-invariant reaches the engine unset (None: on where supported, off on a checkpoint
    quantized in itself, such as a GGUF file kept in its blocks), not as the config's resolved True."""
    from tidal.benchmarks import throughput
    seen = {}

    class Loaded(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Loaded

    monkeypatch.setattr("tidal.entrypoints.llm.LLM", fake_llm)
    parser = throughput.add_arguments(argparse.ArgumentParser())
    with pytest.raises(Loaded):
        throughput.main(parser.parse_args(["--workload", "single"] + ([flag] if flag else [])))
    assert seen["batch_invariant"] is want


@pytest.mark.parametrize("block_size", [1, 16])
def test_kv_utilization_counts_only_slots_holding_tokens(tiny_model_dir, block_size):
    from tidal import LLM
    from tidal.benchmarks.throughput import run_tidal
    llm = LLM(model=tiny_model_dir("llama"), block_size=block_size, kv_cache_memory_bytes=4 * 2**20)
    reqs = datasets.random_requests(6, (3, 40), (2, 20), seed=3, vocab_size=512)
    warm = datasets.random_requests(2, (3, 40), (2, 20), seed=4, vocab_size=512)
    result = run_tidal(llm, reqs, warm)
    assert result["exact_lengths"] and result["num_output_tokens"] == sum(r["max_tokens"] for r in reqs)
    if block_size == 1:  # every allocated slot holds a token
        assert result["kv_utilization"] == pytest.approx(1.0)
    else:  # partly filled last blocks of short requests
        assert 0.3 < result["kv_utilization"] < 0.99


def test_bench_throughput_on_tiny_model_with_hf_comparison(tiny_model_dir, tmp_path):
    out_json = tmp_path / "result.json"
    proc = tidal_cli("bench", "throughput", "--model", tiny_model_dir("llama"), "--dataset", "random",
                     "--num-prompts", "6", "--input-len-range", "4", "48", "--output-len-range", "2", "16",
                     "--seed", "5", "--kv-cache-memory-bytes", "4194304", "--compare", "hf", "--hf-batch-size", "4",
                     "--output-json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    for figure in ("requests/s", "total tokens/s", "output tokens/s", "KV cache utilization", "Tidal / HF"):
        assert figure in proc.stdout, figure
    result = json.loads(out_json.read_text())
    reqs = datasets.random_requests(6, (4, 48), (2, 16), seed=5, vocab_size=512)
    tidal = result["tidal"]
    assert tidal["num_requests"] == 6 and tidal["exact_lengths"]
    assert tidal["num_output_tokens"] == result["hf"]["num_output_tokens"] == sum(r["max_tokens"] for r in reqs)
    assert tidal["num_prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in reqs)
    assert 0 < tidal["kv_utilization"] <= 1 and tidal["output_tokens_per_s"] > 0
    assert result["tidal_over_hf"] == pytest.approx(tidal["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"])


def test_kv_utilization_counts_a_shared_prefix_block_once(tiny_model_dir):
    # 16 requests share 2 full blocks (32 tokens) of their prompt through the prefix cache; summing
    # each request's tokens would count those blocks 16 times and report a full cache.
    from tidal import LLM
    from tidal.benchmarks.throughput import run_tidal
    llm = LLM(model=tiny_model_dir("llama"), block_size=16, kv_cache_memory_bytes=4 * 2**20)
    reqs = datasets.prefix_requests(16, prefix_len=40, suffix_len=3, output_len=4, seed=3, vocab_size=512)
    result = run_tidal(llm, reqs, reqs[:1])
    assert result["prefix_cache_hit_rate"] > 0.5
    # per request: 32 shared tokens + 11..15 own tokens in its third block of 16 slots
    assert 0.4 < result["kv_utilization"] < 0.9


def test_bench_serve_against_no_server_says_so_in_one_line():
    """No server at the URL: one clear line naming it, exit code 1, no traceback."""
    import socket
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for extra in ((), ("--model", "m")):  # the model asked of the server, then the test request
        proc = tidal_cli("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2", *extra,
                         timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        assert f"127.0.0.1:{port}" in proc.stderr and "tidal bench serve:" in proc.stderr
