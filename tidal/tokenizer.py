"""Tokenizer loading helpers and incremental detokenization.

IncrementalDetokenizer turns a growing list of token ids into text pieces safely for streaming:
a piece is emitted only once it decodes to complete characters (no U+FFFD from a multi-byte
character split across tokens), and the decode window starts a few tokens back so that spacing
rules of the tokenizer apply as they would to the whole text. With a fast (Rust) tokenizer that needs
no clean-up pass, the windows are decoded by the Rust tokenizer directly: the same text, without
transformers' per-call Python work (two decodes per token, for every running request, every step).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-6:])  # context for spacing; never emitted
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self._decode = _window_decoder(tokenizer)

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


def _window_decoder(tokenizer):
    """tokenizer.decode, or the Rust tokenizer's own decode where that is what it would run anyway (a
    transformers fast tokenizer without clean_up_tokenization_spaces)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and type(backend).__module__.startswith("tokenizers") and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode
    return tokenizer.decode


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
