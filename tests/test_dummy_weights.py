"""load_format="dummy" (`--load-format dummy`): random weights of a config, made on the device, with no
checkpoint read; the engine runs them as any model."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.helpers import tiny_llm
from tidal import SamplingParams
from tidal.config import EngineConfig
from tidal.loader.loader import dummy_config


@pytest.fixture
def config_only_dir(tiny_model_dir, tmp_path):
    """A folder with a tiny model's config.json and nothing else: no weights, no tokenizer."""
    shutil.copy(os.path.join(tiny_model_dir("llama"), "config.json"), tmp_path / "config.json")
    return str(tmp_path)


def test_dummy_weights_generate_tokens_without_a_checkpoint(config_only_dir):
    llm = tiny_llm(config_only_dir, load_format="dummy")
    params = [p for p in llm.llm_engine.runner.model.parameters()]
    assert all(torch.isfinite(p).all() for p in params)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6]}],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    vocab = llm.llm_engine.vocab_size
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert all(0 <= t < vocab for o in outs for t in o.outputs[0].token_ids)


def test_dummy_weights_are_the_same_run_to_run(config_only_dir):
    first = tiny_llm(config_only_dir, load_format="dummy").llm_engine.runner.model.state_dict()
    second = tiny_llm(config_only_dir, load_format="dummy").llm_engine.runner.model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize(("name", "arch"), [("smollm2-135m", "LlamaForCausalLM"), ("Llama-3-8B", "LlamaForCausalLM"),
                                            ("mixtral-8x7b", "MixtralForCausalLM")])
def test_bundled_configs_are_found_by_name_in_any_case(name, arch):
    folder, config = dummy_config(name)
    assert folder is None and config.architectures == [arch]


def test_a_bundled_config_runs_without_any_file():
    """SmolLM2-135M's shape (30 layers), no folder: no tokenizer, token-id prompts."""
    llm = tiny_llm("smollm2-135m", load_format="dummy", max_model_len=64)
    assert llm.get_tokenizer() is None and llm.llm_engine.model_name == "smollm2-135m"
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_dummy_without_a_config_is_refused_naming_load_format(tmp_path):
    with pytest.raises(ValueError, match="load_format 'dummy' needs a folder with a config.json or a bundled"):
        dummy_config(str(tmp_path))


def test_dummy_with_quantization_is_refused():
    with pytest.raises(ValueError, match="load_format 'dummy'.*quantization 'int8' needs a checkpoint"):
        EngineConfig(load_format="dummy", quantization="int8")


def test_unknown_load_format_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy; got 'pt'"):
        EngineConfig(load_format="pt")


def test_gpu_bench_serve_case_serves_a_config_only_folder(config_only_dir, tmp_path):
    """benchmarks/gpu_bench.py --case serve (run on a GPU by gpu_check.sh): `tidal serve --load-format dummy`
    on a folder with no tokenizer answers every request of `tidal bench serve`, here on the CPU."""
    import json
    import subprocess
    import sys
    out = tmp_path / "serve.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_bench.py"), "--case", "serve",
                           "--model", config_only_dir, "--device", "cpu", "--dtype", "float32", "--num-prompts", "6",
                           "--prompt-len", "20", "--output-len", "5", "--max-model-len", "128",
                           "--output-json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"]) == (6, 120, 30)
    assert result["cuda_graphs"] is False and result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
