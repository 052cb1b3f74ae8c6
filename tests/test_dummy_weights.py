"""load_format="dummy" (`--load-format dummy`): random weights of a config, made on the device, with no
checkpoint read; the engine runs them as any model."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.helpers import tiny_llm
from tidal import SamplingParams
from tidal.config import EngineConfig
from tidal.loader.loader import DUMMY_CONFIGS, load_config, resolve_model_path


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


@pytest.mark.parametrize("name", DUMMY_CONFIGS)
def test_bundled_configs_resolve_by_name(name):
    path = resolve_model_path(name, load_format="dummy")
    assert load_config(path).architectures == ["LlamaForCausalLM"]
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"


def test_dummy_without_a_config_is_refused_naming_load_format(tmp_path):
    with pytest.raises(ValueError, match="load_format 'dummy' needs a folder with a config.json"):
        resolve_model_path(str(tmp_path), load_format="dummy")


def test_dummy_with_quantization_is_refused(config_only_dir):
    with pytest.raises(ValueError, match="load_format 'dummy'.*quantization 'int8' needs a checkpoint"):
        tiny_llm(config_only_dir, load_format="dummy", quantization="int8")


def test_unknown_load_format_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy; got 'pt'"):
        EngineConfig(load_format="pt")
