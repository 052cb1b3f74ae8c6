"""Stops: where a request's output ends when a step gives it k tokens, and the model's EOS ids.

Pure-Python tests of tidal/engine/stop_checker.py (a fake detokenizer maps each token to a fixed
piece of text), of Scheduler.update with k tokens, and of how EOS ids are gathered; then end to end
on a tiny random Llama whose generation_config.json lists two EOS ids, and with a runner that
returns several tokens per step, as speculative decoding will."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_engine_idle, save_tiny_model, tiny_config, tiny_llm
from tidal import SamplingParams
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler
from tidal.engine.llm_engine import resolve_eos_token_ids
from tidal.engine.stop_checker import append_tokens
from tidal.request import Request, RequestStatus

EOS, EOS2 = 0, 1
PIECES = {10: "Hel", 11: "lo", 12: " wor", 13: "ld", 14: "!", EOS: "", EOS2: ""}


@dataclass
class FakeDetokenizer:
    seen: list[int] = field(default_factory=list)

    def add(self, token_id: int) -> str:
        self.seen.append(token_id)
        return PIECES.get(token_id, f"<{token_id}>")


@dataclass
class Text:  # what the output processor's SampleState gives the stop checker
    detok: FakeDetokenizer = field(default_factory=FakeDetokenizer)
    text: str = ""


def request(prompt_len: int = 2, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request("r", list(range(100, 100 + prompt_len)), SamplingParams(**params), eos_token_ids=(EOS, EOS2))


def append(req: Request, tokens: list[int], text: Text | None = None, max_model_len: int = 64) -> list[int]:
    return append_tokens(req, tokens, max_model_len, text)


# -- the stop checker ------------------------------------------------------------------------------
def test_eos_in_the_middle_of_k_tokens_cuts_there():
    req, text = request(), Text()
    assert append(req, [10, EOS, 11, 12], text) == [10, EOS]
    assert req.output_token_ids == [10, EOS] and req.all_token_ids[-2:] == [10, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert text.detok.seen == [10, EOS], "tokens after the stop are never detokenized"


def test_every_eos_id_stops():
    req = request()
    assert append(req, [10, EOS2, 11]) == [10, EOS2]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None


def test_stop_token_id_is_the_stop_reason():
    req = request(stop_token_ids=[12])
    assert append(req, [10, 11, 12, 13]) == [10, 11, 12]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 12


@pytest.mark.parametrize("include, want", [(False, "Hel"), (True, "Hello w")])
def test_stop_string_across_two_of_the_k_tokens(include, want):
    req, text = request(stop=["lo w"], include_stop_str_in_output=include), Text()
    assert append(req, [10, 11, 12, 13], text) == [10, 11, 12]
    assert text.text == want
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == "lo w"
    assert text.detok.seen == [10, 11, 12]


def test_stop_string_split_over_two_steps_is_found():
    req, text = request(stop=["lo w"]), Text()
    assert append(req, [10, 11], text) == [10, 11] and not req.is_finished
    assert append(req, [12, 13], text) == [12]
    assert text.text == "Hel" and req.stop_reason == "lo w"


def test_min_tokens_holds_back_eos_then_allows_it():
    req = request(min_tokens=3)
    assert append(req, [EOS, EOS2, 10, EOS, 11]) == [EOS, EOS2, 10, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_min_tokens_holds_back_stop_ids_and_stop_strings():
    req, text = request(min_tokens=3, stop=["Hel"], stop_token_ids=[11]), Text()
    assert append(req, [10, 11, 13, 11], text) == [10, 11, 13, 11]  # "Hel" and 11 come too early
    assert req.stop_reason == 11 and text.text == "Helloldlo"


def test_max_tokens_reached_in_the_middle_of_k():
    req = request(max_tokens=3)
    assert append(req, [10, 11]) == [10, 11]
    assert append(req, [12, 13, 14]) == [12]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 3


def test_max_model_len_reached_in_the_middle_of_k():
    req = request(prompt_len=6)
    assert append(req, [10, 11, 12], max_model_len=8) == [10, 11]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 8


def test_ignore_eos_passes_eos_but_not_stop_token_ids():
    req = request(ignore_eos=True, stop_token_ids=[13])
    assert append(req, [EOS, EOS2, 10, 13, 14]) == [EOS, EOS2, 10, 13]
    assert req.stop_reason == 13
    req = request(ignore_eos=True, max_tokens=3)
    assert append(req, [EOS, EOS2, EOS, EOS]) == [EOS, EOS2, EOS]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_stop_string_completed_by_the_last_allowed_token_reports_the_string():
    req, text = request(max_tokens=3, stop=["lo w"]), Text()
    append(req, [10, 11, 12], text)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == "lo w" and text.text == "Hel"


def test_eos_on_the_last_allowed_token_is_a_stop():
    req = request(max_tokens=2)
    assert append(req, [10, EOS]) == [10, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_id_that_completes_a_stop_string_reports_the_id_and_cuts_the_text():
    req, text = request(stop=["lo w"], stop_token_ids=[12]), Text()
    append(req, [10, 11, 12], text)
    assert req.stop_reason == 12 and text.text == "Hel"


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from([EOS, EOS2, 10, 11, 12, 13, 14]), min_size=1, max_size=14),
       cuts=st.lists(st.integers(1, 4), min_size=14, max_size=14),
       max_tokens=st.integers(1, 14), min_tokens=st.integers(0, 14), ignore_eos=st.booleans(),
       stop=st.sampled_from([[], ["lo w"], ["ld", "o"], ["Hello world"]]),
       stop_token_ids=st.sampled_from([[], [13], [11, 14]]), prompt_len=st.integers(1, 20))
def test_k_tokens_at_once_end_where_one_at_a_time_would(tokens, cuts, max_tokens, min_tokens, ignore_eos, stop,
                                                        stop_token_ids, prompt_len):
    """Speculative decoding must not change outputs: the same tokens given in steps of any sizes
    keep the same prefix, text and stop as one token per step."""
    params = dict(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos,
                  stop=stop, stop_token_ids=stop_token_ids)
    runs = []
    for sizes in ([1] * len(tokens), cuts):
        req, text, rest = request(prompt_len, **params), Text(), list(tokens)
        for k in sizes:
            if not rest or req.is_finished:
                break
            append(req, rest[:k], text, max_model_len=24)
            rest = rest[k:]
        runs.append((req.output_token_ids, text.text, text.detok.seen, req.status, req.stop_reason))
    assert runs[0] == runs[1]
    out, _, seen, status, _ = runs[0]
    assert seen == out and out == tokens[:len(out)]
    assert len(out) <= max_tokens and prompt_len + len(out) <= 24
    if status == RequestStatus.FINISHED_LENGTH:
        assert len(out) == max_tokens or prompt_len + len(out) >= 24


# -- the scheduler with k tokens per request -------------------------------------------------------
def test_scheduler_update_keeps_tokens_up_to_the_stop_and_frees_the_request():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    stops, runs = request(), Request("s", [7, 8, 9], SamplingParams(max_tokens=16), eos_token_ids=(EOS,))
    scheduler.add_request(stops)
    scheduler.add_request(runs)
    batch = scheduler.schedule()
    appended = scheduler.update(batch, {"r": [10, EOS2, 11], "s": [10, 11, 12]},
                                partial(append_tokens, max_model_len=64))
    assert [(r.request_id, kept) for r, kept in appended] == [("r", [10, EOS2]), ("s", [10, 11, 12])]
    assert stops.is_finished and "r" not in scheduler.requests and kv.get_block_ids("r") == []
    assert runs.num_computed_tokens == 3 and runs.num_tokens == 6
    nxt = scheduler.schedule()
    assert nxt.finished_ids == ["r"]
    assert [(sr.request_id, sr.start_pos, sr.num_tokens, sr.new_token_ids, sr.sample) for sr in nxt.scheduled] \
        == [("s", 3, 3, [10, 11, 12], True)]


# -- EOS ids of a model ----------------------------------------------------------------------------
@pytest.mark.parametrize("tokenizer_eos, generation, config, want", [
    (2, {}, 2, (2,)),
    (None, {"eos_token_id": [128001, 128008, 128009]}, 128001, (128001, 128008, 128009)),  # Llama-3.1 instruct
    (151645, {"eos_token_id": [151645, 151643]}, 151645, (151645, 151643)),  # Qwen2.5 instruct
    (None, {"eos_token_id": 5}, [6, 5], (5, 6)),
    (None, {}, None, ()),
    (3, {"eos_token_id": [4, 10**6]}, None, (3, 4)),  # outside the vocabulary: left out
])
def test_eos_ids_gather_tokenizer_generation_config_and_config(tokenizer_eos, generation, config, want):
    tokenizer = SimpleNamespace(eos_token_id=tokenizer_eos)
    assert resolve_eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=config), generation, 200_000) == want


# -- end to end on a tiny model --------------------------------------------------------------------
PROMPT = {"prompt_token_ids": [5, 17, 99, 230, 41]}
NUM = 16


@pytest.fixture(scope="module")
def two_eos_model(tmp_path_factory):
    """A tiny Llama without a tokenizer whose generation_config.json lists two EOS ids, both tokens
    the model produces greedily: (path, greedy tokens, first, second) where the second listed id is
    the one greedy decoding meets first."""
    path = save_tiny_model(str(tmp_path_factory.mktemp("two-eos")),
                           tiny_config("llama", eos_token_id=None, bos_token_id=None))
    llm = tiny_llm(path)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.shutdown()
    new = [i for i, t in enumerate(greedy) if t not in greedy[:i] and i >= 2]
    assert len(new) >= 2, f"greedy output repeats too much to pick two EOS ids: {greedy}"
    early, late = greedy[new[0]], greedy[new[1]]
    file = os.path.join(path, "generation_config.json")
    generation = {}
    if os.path.exists(file):
        with open(file) as f:
            generation = json.load(f)
    generation["eos_token_id"] = [late, early]
    with open(file, "w") as f:
        json.dump(generation, f)
    return path, greedy, late, early


def test_generation_stops_on_the_second_eos_id_of_generation_config(two_eos_model):
    path, greedy, first, second = two_eos_model
    llm = tiny_llm(path)
    assert llm.llm_engine.eos_token_ids == (first, second)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[:greedy.index(second) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None

    min_tokens = greedy.index(first) + 1  # both ids come earlier in the greedy output
    held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM, min_tokens=min_tokens),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= min_tokens
    assert not {first, second} & set(held.token_ids[:min_tokens]), "min_tokens let an EOS id through"
    assert held.finish_reason == "length" or held.token_ids[-1] in (first, second)
    assert_engine_idle(llm.llm_engine)


def with_extra_tokens(monkeypatch, engine, extra: list[int]) -> None:
    """Make the engine's runner return, for each sampling request, its sampled token followed by
    `extra` (one logprobs entry each): k = 1 + len(extra) tokens per step."""
    execute = engine.runner.execute

    def execute_k(batch):
        out = execute(batch)
        for rid, tokens in out.sampled.items():
            tokens.extend(extra)
            if rid in out.logprobs:
                out.logprobs[rid].extend([out.logprobs[rid][-1]] * len(extra))
        return out
    monkeypatch.setattr(engine.runner, "execute", execute_k)


def test_k_tokens_per_step_stop_at_eos_and_max_tokens_with_logprobs_per_token(tiny_model_dir, monkeypatch):
    llm = tiny_llm(tiny_model_dir("llama"))
    engine = llm.llm_engine
    eos = engine.eos_token_ids[0]
    with_extra_tokens(monkeypatch, engine, [300, eos, 301])
    outs = llm.generate([PROMPT] * 2, [SamplingParams(temperature=0, max_tokens=NUM, logprobs=1),
                                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)],
                        use_tqdm=False)
    stopped, length = outs[0].outputs[0], outs[1].outputs[0]
    assert stopped.token_ids[1:] == [300, eos] and stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == 3
    # ignore_eos: 4 tokens, then 2 of the next 4 reach max_tokens
    assert length.token_ids[1:4] == [300, eos, 301] and length.token_ids[5] == 300
    assert len(length.token_ids) == 6 and length.finish_reason == "length" and len(length.logprobs) == 6
    assert_engine_idle(engine)


def test_grammar_accepts_exactly_the_tokens_kept_and_text_stops_at_them(smollm2, monkeypatch):
    """Structured outputs and stop strings with k tokens per step: the grammar moves over the
    appended tokens only, and the text is that of the appended tokens."""
    engine = smollm2.llm_engine
    tok = smollm2.get_tokenizer()
    eos, dropped = engine.eos_token_ids[0], tok.encode(" dropped")[0]
    with_extra_tokens(monkeypatch, engine, [eos, dropped])
    accepted: list[int] = []
    accept = engine.structured.accept
    monkeypatch.setattr(engine.structured, "accept",
                        lambda rid, state, token: (accepted.append(token), accept(rid, state, token)))
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["Paris", "London"]})
    out = smollm2.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[1:] == [eos] and out.finish_reason == "stop"
    assert accepted == out.token_ids
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
