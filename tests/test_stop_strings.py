"""Stop strings and detokenization with the real tokenizer (SmolLM2's byte-level BPE).

A stop string ends the output exactly where it starts (or just after it with
include_stop_str_in_output), wherever it falls relative to token boundaries. When streaming, no
piece ever shows text that is later taken back (a stop string is never split across pieces), and the
pieces add up to the final text. IncrementalDetokenizer gives the same text as a full decode,
multi-byte characters (emoji, CJK) included."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal import SamplingParams
from tidal.engine.output_processor import OutputProcessor
from tidal.engine.stop_checker import append_tokens
from tidal.request import Request
from tidal.tokenizer import IncrementalDetokenizer, byte_level_decoder, check_stop_strings, window_decoder

MAX_TOKENS = 40
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def reference(_smollm2_session):
    """The greedy text without stop strings, and where each token's text ends in it."""
    llm = _smollm2_session
    tok = llm.get_tokenizer()
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    text, ids = out.outputs[0].text, out.outputs[0].token_ids
    ends = [len(tok.decode(ids[:i + 1], skip_special_tokens=True)) for i in range(len(ids))]
    assert text == tok.decode(ids, skip_special_tokens=True) and len(text) > 60
    return out.prompt_token_ids, text, ends


def stop_cases(text: str, ends: list[int]) -> dict[str, str]:
    """Stop strings at different places: inside one token, across a token boundary, one character,
    and a long one across several tokens."""
    boundary = next(e for e in ends if e > 20 and text[e - 2:e + 2].strip() == text[e - 2:e + 2])
    word = next(w for w in text[15:].split() if len(w) >= 4 and w.isalpha())
    return {
        "word": word,
        "across-boundary": text[boundary - 2:boundary + 2],
        "one-char": next(c for c in text[10:] if c in ",.\n"),
        "several-tokens": text[ends[6]:ends[12]],
    }


def expected(text: str, stop: str, include: bool) -> str:
    idx = text.index(stop)
    return text[:idx + len(stop)] if include else text[:idx]


def stream(engine, requests: dict[str, tuple]) -> dict[str, tuple[list[str], list[int], object]]:
    """Run requests {id: (prompt, params)} together through LLMEngine with delta outputs; return
    {id: (text pieces, all token ids, final RequestOutput)}."""
    results = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params.clone(output_kind="delta"))
        results[rid] = ([], [], None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces, ids, _ = results[out.request_id]
            pieces.append(out.outputs[0].text if out.outputs else "")
            ids.extend(out.outputs[0].token_ids if out.outputs else [])
            if out.finished:
                results[out.request_id] = (pieces, ids, out)
    return results


CASES = ["word", "across-boundary", "one-char", "several-tokens"]
STREAMED_CASES = ["across-boundary", "several-tokens"]


def stop_params(stop, include: bool = False, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=stop,
                          include_stop_str_in_output=include, **kw)


@pytest.fixture(scope="module")
def stopped(_smollm2_session, reference):
    """One batched generate with every stop-string case; {(case, include): CompletionOutput}."""
    prompt_ids, text, ends = reference
    cases = stop_cases(text, ends)
    keys = [(c, inc) for c in CASES for inc in (False, True)]
    outs = _smollm2_session.generate([{"prompt_token_ids": prompt_ids}] * len(keys),
                                     [stop_params([cases[c]], inc) for c, inc in keys], use_tqdm=False)
    return {k: o.outputs[0] for k, o in zip(keys, outs)}


@pytest.fixture(scope="module")
def streamed(_smollm2_session, reference):
    """Streamed requests run together: the stop-string cases, one without stops, one cumulative."""
    prompt_ids, text, ends = reference
    cases = stop_cases(text, ends)
    prompt = {"prompt_token_ids": prompt_ids}
    requests = {f"{c}-{inc}": (prompt, stop_params([cases[c]], inc)) for c in STREAMED_CASES for inc in (False, True)}
    requests["plain"] = (prompt, stop_params(None))
    engine = _smollm2_session.llm_engine
    results = stream(engine, requests)
    engine.add_request("cumulative", prompt, stop_params([cases["across-boundary"]], output_kind="cumulative"))
    texts = []
    while engine.has_unfinished_requests():
        texts.extend(o.outputs[0].text for o in engine.step())
    results["cumulative"] = texts
    return results


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
@pytest.mark.parametrize("case", CASES)
def test_stop_string_ends_output_where_it_starts(reference, stopped, case, include):
    _, text, ends = reference
    stop = stop_cases(text, ends)[case]
    out = stopped[(case, include)]
    assert out.text == expected(text, stop, include)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < MAX_TOKENS


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(smollm2, reference):
    """The 13th token both reaches max_tokens and completes the stop string: finish_reason is
    "stop" (the text is cut at the stop string), as in vLLM."""
    prompt_ids, text, ends = reference
    stop = stop_cases(text, ends)["several-tokens"]  # ends exactly where token 12 (0-based) ends
    out = smollm2.generate({"prompt_token_ids": prompt_ids}, stop_params([stop]).clone(max_tokens=13),
                           use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 13 and out.text == expected(text, stop, False)
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_first_completed_of_several_stop_strings_wins(smollm2, reference):
    """As in vLLM, the output stops at the first stop string to be completed (a longer one that
    would have started earlier is not complete yet when a shorter one ends)."""
    prompt_ids, text, ends = reference
    cases = stop_cases(text, ends)
    stops = [cases["several-tokens"], cases["word"], cases["one-char"], "never-generated-zzz"]
    first = min(stops[:3], key=lambda s: (text.index(s) + len(s), text.index(s)))
    out = smollm2.generate({"prompt_token_ids": prompt_ids}, stop_params(stops), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(first)] and out.stop_reason == first


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
@pytest.mark.parametrize("case", STREAMED_CASES)
def test_streamed_pieces_never_show_a_stop_string_that_is_taken_back(reference, streamed, case, include):
    _, text, ends = reference
    stop = stop_cases(text, ends)[case]
    pieces, _, final = streamed[f"{case}-{include}"]
    want = expected(text, stop, include)
    assert final is not None and final.outputs[0].finish_reason == "stop"
    assert "".join(pieces) == want
    shown = ""
    for piece in pieces:
        shown += piece
        assert want.startswith(shown), f"streamed {shown!r}, which the final text {want!r} takes back"
    if include:  # the stop string arrives whole, in one piece
        assert any(stop in p for p in pieces)
    assert len(pieces) > 3  # it really streamed


def test_streaming_without_stop_strings_adds_up_to_the_full_text(reference, streamed):
    _, text, _ = reference
    pieces, ids, final = streamed["plain"]
    assert "".join(pieces) == text
    assert len(ids) == MAX_TOKENS and final.outputs[0].finish_reason == "length"


def test_cumulative_outputs_grow_by_prefixes(reference, streamed):
    _, text, ends = reference
    texts = streamed["cumulative"]
    assert texts[-1] == expected(text, stop_cases(text, ends)["across-boundary"], False)
    assert len(texts) > 3 and all(b.startswith(a) for a, b in itertools.pairwise(texts))


# -- detokenization --------------------------------------------------------------------------------------
MULTIBYTE = [
    "Hello 😊 world! 你好，世界。 Ça va? naïve café 🇫🇷 👨‍👩‍👧‍👦 ∑∫√ end",
    "日本語のテキストと絵文字🎉🎉🎉が混ざった文章です。",
    "  leading spaces, tabs\tand\nnewlines  ",
]


@pytest.mark.parametrize("text", MULTIBYTE, ids=["mixed", "cjk-emoji", "whitespace"])
@pytest.mark.parametrize("with_prompt", [False, True], ids=["no-prompt", "prompt"])
def test_incremental_detokenizer_equals_full_decode(_smollm2_session, text, with_prompt):
    tok = _smollm2_session.get_tokenizer()
    ids = tok.encode(text)
    prompt = tok.encode("Some context before the output:") if with_prompt else []
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces), "a piece holds half a character"
    assert sum(1 for p in pieces if p == "") > 0 or text.isascii()  # multi-byte characters spanned tokens


def test_byte_level_table_decodes_every_token_as_the_rust_tokenizer(_smollm2_session):
    backend = _smollm2_session.get_tokenizer()._tokenizer
    decode = byte_level_decoder(backend)
    assert decode is not None and window_decoder(_smollm2_session.get_tokenizer()) is decode
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        for skip in (False, True):
            assert decode([i], skip) == backend.decode([i], skip_special_tokens=skip), i


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 300)), min_size=1, max_size=16),
       skip=st.booleans())
def test_byte_level_table_decodes_any_ids_as_the_rust_tokenizer(_smollm2_session, ids, skip):
    """Windows of any ids (low ids: special tokens and single bytes, so split and invalid UTF-8 too)."""
    backend = _smollm2_session.get_tokenizer()._tokenizer
    assert byte_level_decoder(backend)(ids, skip) == backend.decode(ids, skip_special_tokens=skip)


def _byte_level_tokenizer_with_added_tokens():
    """A byte-level BPE (the 256 byte characters and one merge) with added tokens of every kind: text of
    byte characters only ("ünï": three bytes of invalid UTF-8 once mapped), with a space, CJK, and special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["Ġh"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "h")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False) for t in ("hello world", "ünï", "日本")])
    tok.add_special_tokens([AddedToken("<|end|>", special=True), AddedToken("<é sp>", special=True)])
    return tok


_ADDED = _byte_level_tokenizer_with_added_tokens()


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 261), st.integers(256, 261)), min_size=1, max_size=12),
       skip=st.booleans())
def test_byte_level_table_decodes_added_tokens_as_the_rust_tokenizer(ids, skip):
    assert byte_level_decoder(_ADDED)(ids, skip) == _ADDED.decode(ids, skip_special_tokens=skip)


def test_byte_level_table_only_for_a_byte_level_decoder():
    from tokenizers import Tokenizer, decoders, models
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert byte_level_decoder(wordpiece) is None


def test_incremental_detokenizer_skips_special_tokens(_smollm2_session):
    tok = _smollm2_session.get_tokenizer()
    ids = tok.encode("Hi there") + [tok.eos_token_id] + tok.encode(" 你好")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(detok.add(t) for t in ids) == tok.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(detok.add(t) for t in ids) == tok.decode(ids, skip_special_tokens=False)


def test_spaces_between_special_tokens_sets_kept_special_tokens_apart(_smollm2_session):
    tok = _smollm2_session.get_tokenizer()
    before, after = tok.encode("Hi there"), tok.encode(" 你好")
    ids = before + [tok.eos_token_id, tok.bos_token_id or 1] + after
    eos, bos = tok.decode([tok.eos_token_id]), tok.decode([tok.bos_token_id or 1])
    spaced = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=True)
    assert "".join(spaced.add(t) for t in ids) == f"Hi there {eos} {bos}  你好"  # " 你好" keeps its own space
    joined = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(joined.add(t) for t in ids) == f"Hi there{eos}{bos} 你好"
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True, spaces_between_special_tokens=True)
    assert "".join(skipped.add(t) for t in ids) == "Hi there 你好"  # nothing kept, nothing to set apart


@pytest.mark.parametrize("spaces", [True, False])
def test_engine_text_follows_spaces_between_special_tokens(_smollm2_session, spaces):
    """The output processor hands the option to each sample's detokenizer (a chat-template prompt
    whose last tokens are special: the first output token follows one)."""
    tok = _smollm2_session.get_tokenizer()
    op = OutputProcessor(tok)
    prompt = tok.encode("Hi") + [tok.eos_token_id]
    params = SamplingParams(max_tokens=8, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    op.add_request("r", None, prompt, params, ["r"], arrival_time=0.0)
    request = Request("r", prompt, params, eos_token_ids=(tok.eos_token_id,))
    out_ids = tok.encode("Yes") + [tok.eos_token_id]
    append_tokens(request, out_ids, max_model_len=64, text=op.sample_text("r"))
    op.process_tokens(request, out_ids, None)
    eos = tok.decode([tok.eos_token_id])
    assert op.make_output("r").outputs[0].text == (f" Yes {eos}" if spaces else f"Yes{eos}")


def test_engine_text_equals_decode_for_multibyte_output(smollm2):
    tok = smollm2.get_tokenizer()
    # SmolLM2 answers this with emoji (4-byte characters split across byte-level tokens).
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Say hello in Spanish."}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False))
    request = ({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16))
    pieces, ids, _ = stream(smollm2.llm_engine, {"multibyte": request})["multibyte"]
    text = "".join(pieces)
    assert any(not c.isascii() for c in text)
    assert not any("\ufffd" in p for p in pieces)
    # 16 tokens end inside an emoji: its incomplete bytes are never shown (a full decode shows U+FFFD)
    assert text == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_check_stop_strings_looks_only_at_new_text():
    assert check_stop_strings("abc STOP def", 4, ["STOP"], False) is None  # the stop ended earlier
    assert check_stop_strings("abc STOP", 2, ["STOP"], False) == ("STOP", 4)
    assert check_stop_strings("abc STOP", 2, ["STOP"], True) == ("STOP", 8)
    assert check_stop_strings("xx abcd", 3, ["cd", "ab"], False) == ("ab", 3)  # earliest start wins
    assert check_stop_strings("anything", 3, [], False) is None
