"""Tokenizer loading helpers and incremental detokenization.

IncrementalDetokenizer turns a growing list of token ids into text pieces safely for streaming:
a piece is emitted only once it decodes to complete characters (no U+FFFD from a multi-byte
character split across tokens), and the decode window starts a few tokens back so that spacing
rules of the tokenizer apply as they would to the whole text. With a fast (Rust) tokenizer that needs
no clean-up pass, the windows are decoded by the Rust tokenizer directly, or for a byte-level BPE one
from a table of each token's bytes: the same text, without transformers' per-call Python work or a
call into Rust (two decodes per token, for every running request, every step).
"""
from __future__ import annotations

import weakref


class IncrementalDetokenizer:
    """skip_special_tokens and spaces_between_special_tokens are vLLM's SamplingParams options: special
    tokens are left out of the text, or kept and, with spaces_between_special_tokens, set apart from
    their neighbours by a space, as vLLM's detokenizer does with a slow tokenizer
    ("<|im_start|> user"); without it they are joined as the tokenizer decodes them
    ("<|im_start|>user", which is all transformers 5 and vLLM's fast-tokenizer path ever give)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-6:])  # context for spacing; never emitted
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self._decode = window_decoder(tokenizer)
        if spaces_between_special_tokens and not skip_special_tokens:
            self._decode = _spaced_decoder(self._decode, special_token_ids(tokenizer))

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ('' if it ends mid-character)."""
        self.ids.append(token_id)
        decode, skip = self._decode, self.skip_special_tokens
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


def window_decoder(tokenizer):
    """tokenizer.decode, or where that is what it would run anyway (a transformers fast tokenizer without
    clean_up_tokenization_spaces) the Rust tokenizer's own decode, or for a byte-level BPE one (GPT-2,
    Llama 3, Qwen, SmolLM) the same decode from a table of each token's bytes."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and type(backend).__module__.startswith("tokenizers") and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return byte_level_decoder(backend) or backend.decode
    return tokenizer.decode


_BYTE_LEVEL_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> its decode


def byte_level_decoder(backend):
    """backend.decode(ids, skip_special_tokens) in Python, for a tokenizers.Tokenizer whose decoder is
    ByteLevel alone (or None otherwise): each token, added ones too, is the bytes its characters stand for
    (GPT-2's byte-to-character map; a token with a character outside the map is its own UTF-8), special
    ones left out when skipped, and the bytes of a window decoded as UTF-8 with each invalid sequence
    replaced by U+FFFD, as Rust's from_utf8_lossy does. The same text as the Rust decode
    (tests/test_stop_strings.py compares them over random ids), without a call into it: a detokenizer
    decodes two windows per token of every running request, every step. Built once per tokenizer (the
    whole vocabulary, ~0.1 s for 150k tokens)."""
    cached = _BYTE_LEVEL_DECODERS.get(backend)
    if cached is not None:
        return cached
    import tokenizers
    if type(backend.decoder) is not tokenizers.decoders.ByteLevel:
        return None
    chars = _byte_level_chars()
    to_bytes = str.maketrans({c: chr(b) for b, c in enumerate(chars)})
    known = set(chars)
    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    table: list[bytes] = [b""] * size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i >= size:
            return None
        if known.issuperset(token):
            table[i] = token.translate(to_bytes).encode("latin-1")
        else:
            table[i] = token.encode()
    skipped = list(table)
    for i, token in added.items():
        if token.special:
            skipped[i] = b""
    join = b"".join

    def decode(ids, skip_special_tokens: bool = False) -> str:
        rows = skipped if skip_special_tokens else table
        return join([rows[i] for i in ids]).decode("utf-8", "replace")

    _BYTE_LEVEL_DECODERS[backend] = decode  # kept while the tokenizer is (the table holds no reference to it)
    return decode


def _byte_level_chars() -> list[str]:
    """GPT-2's map of the 256 byte values to printable characters (tokenizers' ByteLevel, bytes_char)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (those skip_special_tokens leaves out); other added
    tokens, such as a tool-call tag that is not special, are text like any other."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(token_id)
    return frozenset(ids)


def _spaced_decoder(decode, special: frozenset[int]):
    """decode, with each special token set apart from its neighbours by one space: the runs of other
    tokens between them are decoded each on its own (vLLM's slow-tokenizer detokenization)."""
    if not special:
        return decode

    def spaced(ids, skip_special_tokens: bool = False) -> str:
        if not any(i in special for i in ids):
            return decode(ids, skip_special_tokens=False)
        parts, run = [], []
        for i in ids:
            if i in special:
                if run:
                    parts.append(decode(run, skip_special_tokens=False))
                    run = []
                parts.append(decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            parts.append(decode(run, skip_special_tokens=False))
        return " ".join(parts)

    return spaced


def check_stop_strings(text: str, new_len: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Look for a stop string that ends within the last new_len characters of text. Returns
    (the stop string, the length text is cut to), or None."""
    if not stops:
        return None
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    if best is None:
        return None
    stop, idx = best
    return stop, idx + len(stop) if include else idx
