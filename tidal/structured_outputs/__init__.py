"""Structured outputs: constrained decoding to a JSON schema, regex, choice list or EBNF grammar."""
from tidal.structured_outputs.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
