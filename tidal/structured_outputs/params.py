"""StructuredOutputsParams: the constraint a request's output must satisfy, with vLLM's names.

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (a list of
strings), `grammar` (EBNF, GBNF-style as xgrammar reads it) or `json_object` (any JSON object) must be given:

    >>> SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))

`GuidedDecodingParams` is vLLM's older spelling of the same thing (`guided_decoding=` on
SamplingParams). The constraint's own syntax (a schema or regex that does not compile) is checked
when the request is added (ValueError naming the field), since that needs the grammar library.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")
BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options. Tidal defaults to compact JSON (no free whitespace): small models otherwise
    # tend to emit newlines until max_tokens. `disable_any_whitespace=False` allows it again.
    disable_any_whitespace: bool = True
    disable_fallback: bool = False  # true in effect: there is one backend, nothing to fall back to
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
                             f"{given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema, got invalid JSON: {e}") from e
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(parsed).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice and all(
                isinstance(c, str) and c for c in self.choice)
            if not ok:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF string, got {self.grammar!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if self.whitespace_pattern is not None:  # accepted by vLLM; a flag does what it says or is refused
            raise ValueError("structured_outputs.whitespace_pattern is not supported (whitespace is either free or "
                             "none: see disable_any_whitespace)")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs.backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.backend!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar (a cache key): the kind, its spec, the options."""
        spec = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = _json.dumps(spec, sort_keys=True)
        elif isinstance(spec, (list, tuple)):
            spec = tuple(spec)
        return (self.kind, spec, self.disable_any_whitespace, self.disable_additional_properties)

    @classmethod
    def from_dict(cls, d: dict, field: str = "structured_outputs") -> StructuredOutputsParams:
        """From a JSON body (the server's `structured_outputs` extra field)."""
        if not isinstance(d, dict):
            raise ValueError(f"{field} must be an object, got {type(d).__name__}")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{field} has unknown field(s) {unknown} (known: {sorted(names)})")
        return cls(**d)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name
