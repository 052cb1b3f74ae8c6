"""SpeculativeConfig: vLLM's `speculative_config` dict, validated at start-up.

    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    tidal serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Every bad value is refused with a ValueError that names the field (`speculative_config.<field>`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    # the most draft tokens proposed for a request in one step (the policy may propose fewer, or none)
    num_speculative_tokens: int | None = None
    # n-gram (prompt lookup): the lengths of the request's last tokens looked up in its context,
    # longest first; vLLM's defaults (both 5 when neither is given, else the one given for both)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # True: propose per step and per request only as many drafts as the measured acceptance and the
    # step's cost model say pay off (tidal/spec_decode/policy.py); False: always propose what is found
    adaptive: bool = True
    # no drafts at all while this many requests or more are running (vLLM's
    # speculative_disable_by_batch_size); None: the adaptive policy alone decides
    disable_by_batch_size: int | None = None
    # method "draft_model": a smaller model with the target's tokenizer (None: the target's own checkpoint,
    # made smaller by quantization and/or hf_overrides such as {"num_hidden_layers": 8}: its first layers
    # with the shared embedding and head)
    model: str | None = None
    quantization: str | None = None
    hf_overrides: dict | None = None

    def __post_init__(self) -> None:
        def fail(name, value, allowed):
            raise ValueError(f"speculative_config.{name} must be {allowed}, got {value!r}")

        if self.method not in METHODS:
            fail("method", self.method, f"one of {', '.join(repr(m) for m in METHODS)}")

        def positive(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, value, "a positive integer")

        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (a positive integer)")
        positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > 32:
            fail("num_speculative_tokens", self.num_speculative_tokens, "at most 32")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        positive("prompt_lookup_min", lo)
        positive("prompt_lookup_max", hi)
        if lo > hi:
            fail("prompt_lookup_min", lo, f"<= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if not isinstance(self.adaptive, bool):
            fail("adaptive", self.adaptive, "true or false")
        if self.disable_by_batch_size is not None:
            positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.method != "draft_model":
            for name in ("model", "quantization", "hf_overrides"):
                if getattr(self, name) is not None:
                    fail(name, getattr(self, name), "unset unless method is 'draft_model'")
            return
        if self.model is not None and not isinstance(self.model, str):
            fail("model", self.model, "a path (string)")
        from tidal.layers.quantization import QUANTIZATION_METHODS
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            fail("quantization", self.quantization, f"one of {', '.join(QUANTIZATION_METHODS)}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            fail("hf_overrides", self.hf_overrides, "a dict of config fields")
        layers = (self.hf_overrides or {}).get("num_hidden_layers")
        if layers is not None:
            positive("hf_overrides.num_hidden_layers", layers)

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a dict (LLM(speculative_config=...)), a JSON string (the command line), a
        SpeculativeConfig or None. Unknown keys are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(names))}")
        return cls(**value)
