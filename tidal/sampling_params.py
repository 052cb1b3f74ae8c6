"""SamplingParams: how one request's tokens are chosen and when it stops, validated at construction.

Names and defaults follow vLLM, so code written for vLLM's offline API runs unchanged:

    >>> SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, stop=["\\n\\n"])
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tidal.structured_outputs.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"]

_GREEDY_EPS = 1e-5


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # with skip_special_tokens=False: a space either side of each special token in the text, as vLLM's
    # slow-tokenizer detokenizer (tidal/tokenizer.py)
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: str = "final"  # "final" | "cumulative" | "delta" (the server streams deltas)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name for structured_outputs
    extra: dict = field(default_factory=dict)  # vLLM's extra_args, for sampling plugins: Tidal has none

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        # Type first, so a string or None from a JSON body is a ValueError naming the field, not a
        # TypeError from the range comparisons below.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool), name, value, "a number")
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "0 or -1 (disabled) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        # torch.Generator takes 64-bit seeds; the n samples of a request use seed, seed + 1, ...
        _check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed
                                     and self.seed + self.n - 1 < 2**64),
               "seed", self.seed, "an integer in [-2**63, 2**64 - n] or None")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"<= max_tokens ({self.max_tokens})")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "in [-2, 2]")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "an integer in [0, 20] or None")
        _check(self.prompt_logprobs is None
               or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", self.prompt_logprobs, "an integer in [0, 20] or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of non-negative token ids")
        _check(self.output_kind in ("final", "cumulative", "delta"), "output_kind", self.output_kind,
               "'final', 'cumulative' or 'delta'")
        _check(isinstance(self.extra, dict) and not self.extra, "extra", self.extra,
               "empty (arguments for sampling plugins, which Tidal does not have)")
        self._check_structured_outputs()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters cannot change the argmax; drop them so the sampler takes its fast path.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_structured_outputs(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs is not self.guided_decoding:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> SamplingParams:
        from dataclasses import replace
        return replace(self, **changes)
