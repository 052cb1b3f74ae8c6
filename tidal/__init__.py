"""Tidal: an LLM inference and serving engine with a paged KV cache and continuous batching."""
import logging as _logging

from tidal.entrypoints.llm import LLM
from tidal.outputs import CompletionOutput, Logprob, RequestOutput
from tidal.sampling_params import SamplingParams
from tidal.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]

_logger = _logging.getLogger("tidal")
if not _logger.handlers:
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    _logger.addHandler(_h)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False
