"""Bad input is refused with a ValueError that names the problem, before anything enters the engine,
and the same LLM serves the next call normally."""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers import assert_engine_idle, random_prompts, tiny_llm
from tidal import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir("llama"), max_model_len=64, block_size=8)


@pytest.fixture
def good():
    return {"prompt_token_ids": random_prompts(1, 5, 5, 512, seed=2)[0]}


def assert_refused_then_usable(llm, call, *messages):
    """call(llm) raises a ValueError naming every message; nothing was queued; the LLM still works."""
    engine = llm.llm_engine
    next_id = engine._next_id
    with pytest.raises(ValueError) as e:
        call(llm)
    for m in messages:
        assert m in str(e.value), f"{m!r} not in {str(e.value)!r}"
    assert_engine_idle(engine)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 3
    assert engine._next_id == next_id + 1  # the refused call used no request id
    assert_engine_idle(engine)


# -- prompts -------------------------------------------------------------------------------------------
def test_empty_token_prompt(llm):
    assert_refused_then_usable(llm, lambda m: m.generate({"prompt_token_ids": []}, use_tqdm=False), "empty")


def test_empty_string_prompt(smollm2):
    assert_refused_then_usable_text(smollm2, lambda m: m.generate("", use_tqdm=False), "empty")


def test_prompt_longer_than_max_model_len(llm):
    too_long = {"prompt_token_ids": list(range(1, 66))}
    assert_refused_then_usable(llm, lambda m: m.generate(too_long, use_tqdm=False), "65 tokens", "max_model_len",
                               "64")


def test_text_prompt_longer_than_max_model_len(smollm2):
    text = "hello " * 3000
    assert_refused_then_usable_text(smollm2, lambda m: m.generate(text, use_tqdm=False), "max_model_len", "2048")


@pytest.mark.parametrize("bad_id", [-1, 512, 10**9])
def test_token_id_outside_the_vocabulary(llm, bad_id):
    prompt = {"prompt_token_ids": [5, bad_id, 7]}
    assert_refused_then_usable(llm, lambda m: m.generate(prompt, use_tqdm=False), str(bad_id), "vocabulary", "512")


def test_non_integer_token_id(llm):
    prompt = {"prompt_token_ids": [5, "x", 7]}
    assert_refused_then_usable(llm, lambda m: m.generate(prompt, use_tqdm=False), "'x'")


def test_one_bad_prompt_in_a_batch_queues_none_of_them(llm, good):
    batch = [good, good, {"prompt_token_ids": [1, 600]}, good]
    assert_refused_then_usable(llm, lambda m: m.generate(batch, use_tqdm=False), "600")


def test_prompt_of_the_wrong_type(llm):
    assert_refused_then_usable(llm, lambda m: m.generate([3.5], use_tqdm=False), "float")
    assert_refused_then_usable(llm, lambda m: m.generate({"text": "hi"}, use_tqdm=False), "prompt_token_ids")


def test_text_prompt_without_a_tokenizer(llm):
    assert_refused_then_usable(llm, lambda m: m.generate("hello", use_tqdm=False), "tokenizer")


# -- sampling parameters ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -3), ("temperature", -1.0),
                                         ("top_p", 0.0), ("top_k", -5), ("min_p", 2.0), ("logprobs", 100)])
def test_out_of_range_sampling_values(llm, good, field, value):
    assert_refused_then_usable(llm, lambda m: m.generate(good, SamplingParams(**{field: value}), use_tqdm=False),
                               field, repr(value))


@pytest.mark.parametrize("field,value,message", [
    ("temperature", float("inf"), "finite"), ("temperature", float("nan"), "finite"),
    ("top_p", float("nan"), "finite"), ("repetition_penalty", float("inf"), "finite"),
    ("presence_penalty", float("-inf"), "finite"), ("top_k", 2**31, "2147483647"),
    ("stop", ["ab"] * 257, "at most 256 strings"), ("stop", "x" * 4097, "4096 characters"),
    ("stop_token_ids", [1] * 1025, "at most 1024")])
def test_non_finite_and_unbounded_sampling_values(llm, good, field, value, message):
    """NaN and infinity pass range checks (or break the sampler), and a huge stop list is checked on
    every token inside the step: each is refused by name, with the value cut to a readable length."""
    def call(m):
        m.generate(good, SamplingParams(max_tokens=4, **{field: value}), use_tqdm=False)
    with pytest.raises(ValueError, match=field) as e:
        call(llm)
    assert message in str(e.value) and len(str(e.value)) < 400
    assert_refused_then_usable(llm, call, field)


def test_stop_token_id_outside_the_vocabulary(llm, good):
    """Found inside a step, it would fail the whole batch (min_tokens masks stop ids by index)."""
    params = [SamplingParams(), SamplingParams(min_tokens=2, stop_token_ids=[7, 10**6])]
    assert_refused_then_usable(llm, lambda m: m.generate([good, good], params, use_tqdm=False),
                               "stop_token_ids", str(10**6), "512")


def test_wrong_number_of_sampling_params(llm, good):
    assert_refused_then_usable(llm, lambda m: m.generate([good, good], [SamplingParams()] * 3, use_tqdm=False),
                               "3 sampling_params", "2 prompts")


def test_sampling_params_of_the_wrong_type_queue_nothing(llm, good):
    assert_refused_then_usable(llm, lambda m: m.generate([good, good], [SamplingParams(), {"max_tokens": 3}],
                                                         use_tqdm=False), "SamplingParams")


def test_duplicate_request_id_is_refused(llm, good):
    engine = llm.llm_engine
    engine.add_request("dup", good, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", good, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(engine)


# -- models and engine arguments ---------------------------------------------------------------------------
def test_unknown_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(missing, kv_cache_memory_bytes=2**20)


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path), kv_cache_memory_bytes=2**20)


@pytest.mark.parametrize("model_type", ["llama", "foo"])
def test_unsupported_architecture_is_refused_by_name(tiny_model_dir, tmp_path, model_type):
    src = tiny_model_dir("llama")
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), tmp_path / name)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["FooForCausalLM"], model_type=model_type)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        LLM(str(tmp_path), kv_cache_memory_bytes=2**20)


@pytest.mark.parametrize("kwargs,name", [({"max_num_seqs": 0}, "max_num_seqs"), ({"block_size": -1}, "block_size"),
                                         ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                                         ({"dtype": "int3"}, "dtype"), ({"max_model_len": 10**6}, "max_model_len"),
                                         ({"kv_cache_memory_bytes": 10}, "kv_cache_memory_bytes"),
                                         ({"quantization": "awq"}, "quantization"),
                                         ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
                                         ({"tokenizer_mode": "mistral"}, "tokenizer_mode"),
                                         ({"tokenizer": "/no/such/tokenizer"}, "tokenizer path '/no/such/tokenizer'"),
                                         ({"swap_space": 4}, "swap_space 4 is not supported: Tidal preempts a "
                                                             "request by recomputation")])
def test_bad_engine_arguments(tiny_model_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        tiny_llm(tiny_model_dir("llama"), **kwargs)


def test_swap_space_zero_is_accepted():
    from tidal.config import EngineConfig
    assert EngineConfig(swap_space=0).swap_space == 0


def test_no_chunked_prefill_with_a_budget_under_max_model_len(tiny_model_dir):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than max_model_len \(64\) "
                                         "with enable_chunked_prefill=False"):
        tiny_llm(tiny_model_dir("llama"), max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_tokenizer_folder_without_tokenizer_files(tiny_model_dir):
    folder = tiny_model_dir("llama")  # a model folder: config and weights, no tokenizer files
    with pytest.raises(ValueError, match=f"tokenizer '{folder}' is not a directory with tokenizer files"):
        tiny_llm(tiny_model_dir("llama"), tokenizer=folder)


def test_tokenizer_mode_slow_without_a_slow_tokenizer(tiny_model_dir):
    """transformers has no slow tokenizer of SmolLM2's BPE: 'slow' would do nothing, so it is refused."""
    from tidal.loader.gguf_loader import cached_conversion
    from tidal.loader.loader import default_model_path
    with pytest.raises(ValueError, match="tokenizer_mode 'slow': transformers .* has no slow"):
        tiny_llm(tiny_model_dir("llama"), tokenizer=cached_conversion(default_model_path()), tokenizer_mode="slow")


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(None, max_num_seq=4)
    with pytest.raises(TypeError, match="extra"):  # a catch-all that nothing read: removed
        LLM(None, extra={})


def assert_refused_then_usable_text(llm, call, *messages):
    """As assert_refused_then_usable, for the default model (text prompts)."""
    engine = llm.llm_engine
    with pytest.raises(ValueError) as e:
        call(llm)
    for m in messages:
        assert m in str(e.value), f"{m!r} not in {str(e.value)!r}"
    assert_engine_idle(engine)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
