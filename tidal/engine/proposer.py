"""Proposers: where draft tokens come from (speculative decoding).

A proposer looks at a running request and guesses its next tokens; the model runner computes them in
the same forward as the request's last known token and keeps them as far as the model agrees (see
tidal/worker/model_runner.py and tidal/layers/rejection_sampler.py), so a good guess yields several
tokens in one step and a bad one costs only the extra rows. Outputs are the same either way.

    class Proposer:
        def propose(self, request) -> list[int]

`LLMEngine.proposer` holds one (None: one token per request per step); `speculative_config` builds
it (tidal/spec_decode/config.py), and the engine's draft policy (tidal/spec_decode/policy.py)
decides how many of the proposed tokens a step runs.
"""
from __future__ import annotations

from tidal.request import Request


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the request's last n tokens (n from
    max_ngram down to min_ngram) in its prompt or output and propose the k tokens that followed it.
    Costs no model; pays off on outputs that copy from their context (summaries, code edits, extraction).

    Each request keeps an index (on `request.proposer_state`): per n, n-gram -> where its latest
    occurrence ends, extended by the tokens appended since the last call. A proposal is then
    max_ngram - min_ngram + 1 dictionary look-ups, whatever the context length: no measurable cost in
    steps where nothing is found.

        >>> from tidal.sampling_params import SamplingParams
        >>> NgramProposer(k=2, max_ngram=2).propose(Request("r", [1, 2, 3, 4, 1, 2], SamplingParams()))
        [3, 4]
    """

    def __init__(self, k: int = 4, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if k < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramProposer needs k >= 1 and 1 <= min_ngram <= max_ngram; got k={k}, "
                             f"min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.k, self.min_ngram, self.max_ngram = k, min_ngram, max_ngram

    def propose(self, request: Request) -> list[int]:
        tokens = request.all_token_ids
        index = self._index(request, tokens)
        num_tokens = len(tokens)
        for n in range(min(self.max_ngram, num_tokens - 1), self.min_ngram - 1, -1):
            end = index[n - self.min_ngram].get(tuple(tokens[num_tokens - n:]))
            if end is not None:
                return tokens[end:end + self.k]
        return []

    def _index(self, request: Request, tokens: list[int]) -> list[dict[tuple, int]]:
        """The request's n-gram index over every occurrence that ends before its last token (the
        tail itself is what is looked up), brought up to date."""
        state = request.proposer_state
        if not isinstance(state, _NgramIndex) or state.sizes != (self.min_ngram, self.max_ngram):
            state = request.proposer_state = _NgramIndex((self.min_ngram, self.max_ngram))
        last = len(tokens) - 1  # occurrences ending at positions <= last (exclusive end) are indexed
        for end in range(state.indexed_to + 1, last + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                state.maps[n - self.min_ngram][tuple(tokens[end - n:end])] = end  # later ends overwrite
        state.indexed_to = max(state.indexed_to, last)
        return state.maps


class _NgramIndex:
    __slots__ = ("indexed_to", "maps", "sizes")

    def __init__(self, sizes: tuple[int, int]) -> None:
        self.sizes = sizes
        self.maps: list[dict[tuple, int]] = [{} for _ in range(sizes[1] - sizes[0] + 1)]
        self.indexed_to = 0  # the largest end position indexed
