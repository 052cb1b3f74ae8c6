"""The request fields that constrain the output (OpenAI's response_format, vLLM's structured_outputs
and guided_* extras) and their translation to StructuredOutputsParams."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tidal.structured_outputs.params import StructuredOutputsParams


class UnsupportedFieldError(ValueError):
    """A known OpenAI field whose feature Tidal does not implement (answered with 400)."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponseFormat(_Request):
    type: str
    json_schema: dict | None = None  # {"name", "schema", "strict", "description"}


# vLLM's extra fields for structured outputs, each the StructuredOutputsParams field it sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class StructuredFields(BaseModel):
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_field(self) -> str | None:
        """Which request field carries the output constraint (None: no constraint)."""
        given = [name for name in ("structured_outputs", *GUIDED_FIELDS) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise UnsupportedFieldError(given[1], f"give one output constraint, got {', '.join(given)}")
        return given[0] if given else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint of this request; ValueError naming the request field if malformed."""
        if self.guided_whitespace_pattern is not None:
            raise UnsupportedFieldError("guided_whitespace_pattern", "is not supported (whitespace is either free "
                                        "or none: structured_outputs.disable_any_whitespace)")
        name = self.structured_field()
        if name is None:
            return None
        try:
            if name == "structured_outputs":
                return StructuredOutputsParams.from_dict(self.structured_outputs)
            if name in GUIDED_FIELDS:
                return StructuredOutputsParams(**{GUIDED_FIELDS[name]: getattr(self, name)},
                                               backend=self.guided_decoding_backend)
            fmt = self.response_format
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.type == "json_schema":
                if fmt.json_schema is None:
                    raise ValueError("response_format of type 'json_schema' needs a json_schema object")
                schema = fmt.json_schema.get("schema", {"type": "object"})
                return StructuredOutputsParams(json=schema)
            raise ValueError(f"response_format type {fmt.type!r} is not supported (supported: 'text', "
                             "'json_object', 'json_schema')")
        except UnsupportedFieldError:
            raise
        except (ValueError, TypeError) as e:
            raise UnsupportedFieldError(name, str(e)) from e

