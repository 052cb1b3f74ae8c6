"""Structured outputs offline: constrained decoding to JSON schemas, regexes, choices and EBNF
grammars on the default model, invalid constraints refused by name, the grammar bitmask in the batched
sampler, and composition with n > 1, seeds, logprobs, stop strings, prefix caching and preemption."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.helpers import assert_engine_idle, save_tiny_model, tiny_config, tiny_llm
from tidal import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler
from tidal.layers.sampler import Sampler, SamplingMetadata, apply_token_bitmask
from tidal.request import Request

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "height_m", "color", "tags", "address"],
}


def _chat(llm, texts, params):
    return llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)


# -- parameters ---------------------------------------------------------------------------------------

def test_params_take_exactly_one_constraint_and_name_the_field():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs has unknown field"):
        SamplingParams(structured_outputs={"regex": "a", "colour": 1})
    with pytest.raises(ValueError, match="structured_outputs.whitespace_pattern"):
        StructuredOutputsParams(regex="a", whitespace_pattern=r"[ ]?")
    # vLLM's older spelling and a plain dict land on the same field
    assert SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+")).structured_outputs.regex == "a+"
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]


@pytest.mark.parametrize("constraint, field", [
    ({"json": {"type": "frobnicate"}}, "structured_outputs.json"),
    ({"regex": "(ab"}, "structured_outputs.regex"),
    ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar"),
])
def test_invalid_constraint_is_a_value_error_naming_the_field(smollm2, constraint, field):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(field)):
        smollm2.generate("Hi", params, use_tqdm=False)
    assert_engine_idle(smollm2.llm_engine)


def test_model_without_tokenizer_refuses_constraints(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(structured_outputs={"regex": "a"}))


# -- the default model ----------------------------------------------------------------------------------

def test_json_schema_outputs_parse_and_validate(smollm2):
    prompts = [f"Describe a person from city number {i} as JSON." for i in range(8)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=160, structured_outputs=StructuredOutputsParams(
        json=PERSON)) for i in range(len(prompts))]
    outs = _chat(smollm2, prompts, params)
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)


def test_choice_regex_grammar_and_json_object(smollm2):
    choice = StructuredOutputsParams(choice=["Paris", "London", "Berlin, Germany"])
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
    grammar = StructuredOutputsParams(grammar='root ::= "The answer is " ("yes" | "no") "."')
    anyjson = StructuredOutputsParams(json_object=True)
    # free-form JSON has no length bound: greedy, as the sampled kind can wander off into long strings
    outs = _chat(smollm2, ["What is the capital of France?", "Give a phone number.", "Is water wet?",
                           "Give a JSON object with the keys name and age of a cat."],
                 [SamplingParams(temperature=1.0 if c is not anyjson else 0, seed=3, max_tokens=200,
                                 structured_outputs=c) for c in (choice, regex, grammar, anyjson)])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in choice.choice
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[1]), texts[1]
    assert texts[2] in ("The answer is yes.", "The answer is no."), texts[2]
    assert isinstance(json.loads(texts[3]), dict), texts[3]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_composes_with_n_seeds_logprobs_and_stop_strings(smollm2):
    words = StructuredOutputsParams(regex=r"(alpha|beta|gamma)(,(alpha|beta|gamma)){4}")
    params = SamplingParams(n=3, temperature=1.0, seed=11, logprobs=3, max_tokens=40, structured_outputs=words)
    a = smollm2.generate("List some Greek letters:", params, use_tqdm=False)[0]
    b = smollm2.generate("List some Greek letters:", params, use_tqdm=False)[0]
    assert [o.text for o in a.outputs] == [o.text for o in b.outputs]  # seeded: reproducible
    for o in a.outputs:
        assert re.fullmatch(r"(alpha|beta|gamma)(,(alpha|beta|gamma)){4}", o.text), o.text
        assert len(o.logprobs) == len(o.token_ids)
        for tok, entry in zip(o.token_ids, o.logprobs):
            assert entry[tok].logprob > float("-inf")  # sampled tokens were allowed
    stopped = smollm2.generate("List some Greek letters:", SamplingParams(
        temperature=0, max_tokens=40, stop=[","], structured_outputs=words), use_tqdm=False)[0].outputs[0]
    assert stopped.text in ("alpha", "beta", "gamma") and stopped.finish_reason == "stop"


def test_grammar_compiled_once_per_schema_and_prefix_cache_hits(smollm2):
    engine = smollm2.llm_engine
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    before = engine.structured.num_compiles
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema))
    prompt = "Answer in JSON whether the sky is blue. " * 4
    first = smollm2.generate(prompt, params, use_tqdm=False)[0]
    second = smollm2.generate(prompt, params.clone(), use_tqdm=False)[0]
    assert engine.structured.num_compiles == before + 1
    assert second.num_cached_tokens > 0  # the prompt came from the prefix cache
    assert first.outputs[0].text == second.outputs[0].text
    assert json.loads(first.outputs[0].text)["ok"] in (True, False)


# -- preemption on a tiny model with the default model's tokenizer -----------------------------------------

@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tidal.loader.gguf_loader import cached_conversion
    from tidal.loader.loader import default_model_path
    path = str(tmp_path_factory.mktemp("tiny-tok"))
    save_tiny_model(path, tiny_config("llama", vocab_size=49152, max_position_embeddings=256))
    AutoTokenizer.from_pretrained(cached_conversion(default_model_path())).save_pretrained(path)
    return path


def test_constrained_outputs_unchanged_by_preemption(tiny_with_tokenizer):
    pattern = r"[a-z]{2,6}( [a-z]{2,6}){5,8}\."
    params = [SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(regex=pattern)) for i in range(8)]
    prompts = [f"Sentence {i}:" for i in range(8)]
    roomy = tiny_llm(tiny_with_tokenizer, block_size=4, max_model_len=80)
    want = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    bytes_per_token = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32
    tight = tiny_llm(tiny_with_tokenizer, block_size=4, max_model_len=80, max_num_batched_tokens=32,
                     kv_cache_memory_bytes=20 * 4 * bytes_per_token)  # 80 tokens for 8 requests
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert got == want, [len(t) for t in want]
    assert all(re.fullmatch(pattern, t) for t in got), got
    assert_engine_idle(tight.llm_engine)


# -- scheduler and sampler -----------------------------------------------------------------------------

class _Compiling:
    ready = False


def test_scheduler_admits_requests_behind_a_compiling_grammar():
    sched = Scheduler(KVCacheManager(64, 4, True), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    blocked = Request("blocked", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_ids=(0,))
    blocked.structured = _Compiling()
    free = Request("free", [4, 5, 6], SamplingParams(max_tokens=2), eos_token_ids=(0,))
    sched.add_request(blocked)
    sched.add_request(free)
    assert [r.request_id for r in sched.schedule().scheduled] == ["free"]
    assert list(sched.waiting) == [blocked]
    blocked.structured.ready = True
    assert [r.request_id for r in sched.schedule().scheduled] == ["free", "blocked"]


def test_bitmask_masks_only_its_rows_and_padded_columns():
    vocab = 70  # 3 words of 32 bits: columns 70..95 of the mask do not exist in the logits
    allowed = [3, 40, 69]
    words = torch.zeros(1, 3, dtype=torch.int32)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_token_bitmask(logits, words, [1])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == allowed
    # in the sampler: greedy and random rows both stay inside the mask
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0)]
    sampler = Sampler(torch.Generator().manual_seed(0))
    for _ in range(20):
        meta = SamplingMetadata.from_params(params, "cpu", vocab, grammar=(words.repeat(2, 1), [0, 1]))
        out = sampler(torch.randn(2, vocab), meta)
        assert set(out.token_ids) <= set(allowed)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_constrained_outputs_equal_across_worker_processes(tiny_with_tokenizer, layout):
    """The bitmask is made by the engine and travels with the batch to the rank that samples."""
    pattern = r"[a-z]{2,6}( [a-z]{2,6}){2,4}\."
    params = [SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=pattern)) for i in range(4)]
    prompts = [f"Words {i}:" for i in range(4)]
    want = [o.outputs[0].text for o in tiny_llm(tiny_with_tokenizer).generate(prompts, params, use_tqdm=False)]
    llm = tiny_llm(tiny_with_tokenizer, **layout)
    try:
        got = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert got == want and all(re.fullmatch(pattern, t) for t in got), got


def test_compiling_grammar_does_not_hold_up_the_engine(tiny_with_tokenizer):
    """A grammar compiles on its own thread: the engine keeps stepping other requests meanwhile."""
    import threading

    llm = tiny_llm(tiny_with_tokenizer)
    engine = llm.llm_engine
    release = threading.Event()
    compile_real = engine.structured._compiler.compile

    def held_compile(grammar):
        assert release.wait(60), "never released"
        return compile_real(grammar)

    engine.structured._compiler.compile = held_compile
    engine.add_request("constrained", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[a-z]{3,8}"}))
    engine.add_request("free", {"prompt_token_ids": [8, 9]}, SamplingParams(temperature=0, max_tokens=5,
                                                                              ignore_eos=True))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "constrained" not in finished and engine.scheduler.waiting[0].request_id == "constrained"
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("[a-z]{3,8}", finished["constrained"].outputs[0].text)
    assert_engine_idle(engine)
