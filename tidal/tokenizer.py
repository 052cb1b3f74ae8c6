"""Tokenizer loading helpers and incremental detokenization.

IncrementalDetokenizer turns a growing list of token ids into text pieces safely for streaming:
a piece is emitted only once it decodes to complete characters (no U+FFFD from a multi-byte
character split across tokens), and the decode window starts a few tokens back so that spacing
rules of the tokenizer apply as they would to the whole text.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-6:])  # context for spacing; never emitted
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes ('' if it ends mid-character)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


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
