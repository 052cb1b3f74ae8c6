"""Proposers: where draft tokens come from (speculative decoding).

A proposer looks at a running request and guesses its next tokens; the model runner computes them in
the same forward as the request's last known token and keeps them as far as the model agrees (each
draft is compared with the token sampled at its place; see tidal/worker/model_runner.py), so a good
guess yields several tokens in one step and a bad one costs only the extra rows. Outputs are the same
either way.

    class Proposer:
        def propose(self, request) -> list[int]

`LLMEngine.proposer` holds one (None: one token per request per step).
"""
from __future__ import annotations

from tidal.request import Request


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the request's last n tokens (n from
    max_ngram down to min_ngram) and propose the k tokens that followed it. Costs no model; pays off on
    outputs that copy from their context (summaries, code edits, extraction)."""

    def __init__(self, k: int = 4, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if k < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramProposer needs k >= 1 and 1 <= min_ngram <= max_ngram; got k={k}, "
                             f"min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.k, self.min_ngram, self.max_ngram = k, min_ngram, max_ngram

    def propose(self, request: Request) -> list[int]:
        tokens = request.all_token_ids
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent match first
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + self.k]
        return []
