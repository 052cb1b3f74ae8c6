"""The offline API as vLLM's: what `generate` accepts, what it returns (in input order, with ids,
prompts, metrics and finish reasons), `chat` on one conversation or many, `get_tokenizer`, and
`LLMEngine.abort_request` freeing a request's blocks at any point."""
from __future__ import annotations

import pytest

from tests.helpers import assert_engine_idle, tiny_llm
from tidal import CompletionOutput, RequestOutput, SamplingParams
from tidal.engine.output_processor import OutputProcessor

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def check_output(out: RequestOutput, prompt_ids: list[int], prompt_text: str | None = None) -> None:
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt_token_ids == prompt_ids
    if prompt_text is not None:
        assert out.prompt == prompt_text
    assert len(out.outputs) == 1 and isinstance(out.outputs[0], CompletionOutput)
    sample = out.outputs[0]
    assert sample.index == 0 and sample.token_ids
    assert sample.finish_reason in ("stop", "length")
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time


def test_generate_one_string(smollm2):
    tok = smollm2.get_tokenizer()
    outs = smollm2.generate("The capital of France is", GREEDY, use_tqdm=False)
    assert len(outs) == 1
    check_output(outs[0], tok.encode("The capital of France is"), "The capital of France is")
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)


def test_generate_list_of_strings_in_input_order(smollm2):
    tok = smollm2.get_tokenizer()
    prompts = ["One, two, three,", "The sky is", "A long time ago, in a galaxy far, far away, there was",
               "def fibonacci(n):"]
    outs = smollm2.generate(prompts, GREEDY, use_tqdm=False)
    assert len({o.request_id for o in outs}) == len(prompts)
    for prompt, out in zip(prompts, outs):
        check_output(out, tok.encode(prompt), prompt)
    alone = smollm2.generate(prompts[2], GREEDY, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids  # batching does not change greedy


def test_generate_token_id_prompts(smollm2):
    tok = smollm2.get_tokenizer()
    ids = tok.encode("Once upon a time")
    by_dict = smollm2.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    check_output(by_dict, ids)
    assert by_dict.prompt is None
    by_text = smollm2.generate({"prompt": "Once upon a time"}, GREEDY, use_tqdm=False)[0]
    by_list = smollm2.generate([ids], GREEDY, use_tqdm=False)[0]
    assert by_dict.outputs[0].token_ids == by_text.outputs[0].token_ids == by_list.outputs[0].token_ids


def test_generate_with_a_list_of_sampling_params(smollm2):
    prompts = ["Hello, my name is", "Hello, my name is", "Hello, my name is"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 7, 4)]
    outs = smollm2.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 7, 4]
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].stop_reason is None for o in outs)
    assert outs[1].outputs[0].token_ids[:4] == outs[2].outputs[0].token_ids


def test_finish_and_stop_reasons(smollm2):
    tok = smollm2.get_tokenizer()
    eos = smollm2.chat([{"role": "user", "content": "What is 2+2?"}],
                       SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.stop_reason is None and eos.token_ids[-1] == tok.eos_token_id
    length = smollm2.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    stop = smollm2.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[" 5"]),
                            use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == " 5" and " 5" not in stop.text


def test_default_sampling_params_are_vllms(smollm2):
    out = smollm2.generate("Tell me a story.", use_tqdm=False)[0].outputs[0]
    assert 1 <= len(out.token_ids) <= 16  # SamplingParams() samples at most 16 tokens


def test_chat_one_conversation_and_a_list(smollm2):
    tok = smollm2.get_tokenizer()
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    one = smollm2.chat(conv, GREEDY, use_tqdm=False)
    assert len(one) == 1
    ids = list(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False))
    check_output(one[0], ids)
    assert "<|im_start|>assistant" in one[0].prompt
    other = [{"role": "user", "content": "Name an animal."}]
    many = smollm2.chat([conv, other], GREEDY, use_tqdm=False)
    assert len(many) == 2
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert "Name an animal." in many[1].prompt


def test_get_tokenizer_round_trips(smollm2):
    tok = smollm2.get_tokenizer()
    assert tok is smollm2.llm_engine.tokenizer
    assert tok.decode(tok.encode("Tidal serves tokens.")) == "Tidal serves tokens."
    assert smollm2.llm_engine.eos_token_ids[0] == tok.eos_token_id


def test_progress_bar_does_not_change_outputs(smollm2, capsys):
    prompts = ["Red, green,", "Monday, Tuesday,"]
    quiet = smollm2.generate(prompts, GREEDY, use_tqdm=False)
    loud = smollm2.generate(prompts, GREEDY, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in loud] == [o.outputs[0].token_ids for o in quiet]
    assert "Processed prompts" in capsys.readouterr().err


@pytest.mark.parametrize("steps_before_abort", [0, 1, 5])
def test_abort_request_frees_blocks(smollm2, steps_before_abort):
    engine = smollm2.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind="delta")
    long_prompt = "Write a very long essay about the history of the printing press. " * 8
    engine.add_request("keep", "Hello there", params.clone(max_tokens=8))
    engine.add_request("drop", long_prompt, params)
    for _ in range(steps_before_abort):
        engine.step()
    if steps_before_abort:
        assert engine.kv_manager.get_block_ids("drop")
    aborted = engine.abort_request("drop")
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert not engine.kv_manager.get_block_ids("drop")
    assert engine.abort_request("drop") == []  # aborting twice is harmless
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["keep"]
    assert_engine_idle(engine)


def test_abort_of_a_request_with_n_samples(smollm2):
    engine = smollm2.llm_engine
    engine.add_request("multi", "Once upon a time", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30))
    engine.step()
    engine.step()
    out = engine.abort_request(["multi"])
    assert [s.finish_reason for s in out[0].outputs] == ["abort"] * 3
    assert_engine_idle(engine)


def test_generation_stops_at_max_model_len(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"), max_model_len=64, block_size=8)
    out = llm.generate({"prompt_token_ids": list(range(3, 63))},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    full = llm.generate({"prompt_token_ids": list(range(3, 67))},  # exactly max_model_len: one token
                        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(full.outputs[0].token_ids) == 1 and full.outputs[0].finish_reason == "length"
    assert_engine_idle(llm.llm_engine)


def test_streaming_n_2_delivers_every_token_of_each_sample(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=8)
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    final = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)[0]
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params.clone(output_kind="delta"))
    streamed: dict[int, list[int]] = {0: [], 1: []}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for sample in out.outputs:
                streamed[sample.index] += sample.token_ids
                if sample.finish_reason:
                    reasons[sample.index] = sample.finish_reason
    assert streamed == {s.index: s.token_ids for s in final.outputs}
    assert reasons == {0: "length", 1: "length"}
    assert_engine_idle(engine)


def test_an_exception_mid_generate_aborts_its_requests(tiny_model_dir, monkeypatch):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=8)
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, SamplingParams(max_tokens=20, ignore_eos=True),
                     use_tqdm=False)
    assert_engine_idle(engine)
    monkeypatch.setattr(engine, "step", real_step)
    assert len(llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_request_ids_never_clobber_another_requests_samples(tiny_model_dir):
    """x with n = 2 runs as samples x#0 and x#1: a request named x#0 must not replace its sample, and a
    later x with n = 2 must not take a running request's id."""
    llm = tiny_llm(tiny_model_dir("llama"), block_size=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    two = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2)
    engine.add_request("y#0", {"prompt_token_ids": [3, 4, 5]}, params)
    engine.add_request("y", {"prompt_token_ids": [6, 7, 8]}, two)       # its samples are renamed
    engine.add_request("x", {"prompt_token_ids": [9, 10, 11]}, two)
    with pytest.raises(ValueError, match=r"'x#0' is already in use \(by sample 0 of request 'x'\)"):
        engine.add_request("x#0", {"prompt_token_ids": [1, 2]}, params)
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request("x", {"prompt_token_ids": [1, 2]}, two)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert sorted(outs) == ["x", "y", "y#0"]
    assert outs["y#0"].prompt_token_ids == [3, 4, 5] and len(outs["y#0"].outputs) == 1
    for rid in ("x", "y"):
        assert [len(o.token_ids) for o in outs[rid].outputs] == [5, 5]
    assert_engine_idle(engine)


def test_output_processor_refuses_an_id_in_use_and_keeps_its_state():
    op = OutputProcessor(tokenizer=None)
    params = SamplingParams(n=2)
    op.add_request("x", None, [1, 2], params, ["x#0", "x#1"], arrival_time=0.0)
    state = op.states["x"]
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        op.add_request("x", None, [3], SamplingParams(), ["x"], arrival_time=1.0)
    with pytest.raises(ValueError, match=r"sample ids of request 'y' collide: \['x#1'\]"):
        op.add_request("y", None, [3], SamplingParams(), ["x#1"], arrival_time=1.0)
    assert op.states == {"x": state} and op.child_to_parent == {"x#0": ("x", 0), "x#1": ("x", 1)}


def test_a_request_aborted_mid_prompt_reports_when_it_was_scheduled(tiny_model_dir):
    """Its prompt is split across steps (chunked prefill): aborted before its first token, its metrics
    still say when it was first scheduled."""
    llm = tiny_llm(tiny_model_dir("llama"), block_size=8, max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": list(range(3, 43))}, GREEDY.clone(n=2))
    assert engine.step() == []  # 16 of the first sample's 40 prompt tokens
    scheduled_at = engine.scheduler.requests["long#0"].first_scheduled_time
    assert scheduled_at is not None
    (out,) = engine.abort_request("long")
    m = out.metrics
    assert out.finished and m.first_token_time is None
    assert m.first_scheduled_time == scheduled_at and m.arrival_time <= m.first_scheduled_time
    assert_engine_idle(engine)


def test_stop_strings_without_text_are_refused(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=8)  # a tiny model without tokenizer files
    with pytest.raises(ValueError, match="stop strings need the output text, but this model has no tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["\n"]), use_tqdm=False)
    assert_engine_idle(llm.llm_engine)


def test_stop_strings_with_detokenize_false_are_refused(smollm2):
    with pytest.raises(ValueError, match="detokenize is False"):
        smollm2.generate("Hi", SamplingParams(stop=["\n"], detokenize=False, max_tokens=2), use_tqdm=False)


def test_streaming_n_2_reports_a_sample_that_finished_early_once(tiny_model_dir):
    """One sample stops at a stop id while the other runs on: its finish is sent once, never again in
    the later chunks, and the stats' time per output token counts every token, not the last chunk's."""
    llm = tiny_llm(tiny_model_dir("llama"), block_size=8)
    engine = llm.llm_engine
    base = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, base, use_tqdm=False)[0]
    stop_at = first.outputs[0].token_ids[1]  # sample 0 stops at its second token
    assert stop_at not in first.outputs[1].token_ids[:4], "pick a seed where sample 1 runs on"
    params = base.clone(stop_token_ids=[stop_at])
    final = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)[0]
    assert [len(s.token_ids) for s in final.outputs][0] == 2 and len(final.outputs[1].token_ids) > 4
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params.clone(output_kind="delta"))
    streamed: dict[int, list[int]] = {0: [], 1: []}
    finishes: dict[int, int] = {0: 0, 1: 0}
    tpot_before = len(engine.stats.tpot)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for sample in out.outputs:
                streamed[sample.index] += sample.token_ids
                finishes[sample.index] += sample.finish_reason is not None
    assert streamed == {s.index: s.token_ids for s in final.outputs}
    assert finishes == {0: 1, 1: 1}
    m = out.metrics
    assert m.num_generation_tokens == len(final.outputs[1].token_ids)
    assert engine.stats.tpot[tpot_before] == pytest.approx(
        (m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1))
    assert_engine_idle(engine)
