"""Tidal: an LLM inference and serving engine with a paged KV cache and continuous batching.

The public names are imported on first use (PEP 562), so `import tidal` stays light: the command line
parses its arguments, and `tidal serve` starts its engine-core process, before torch is imported."""
import importlib as _importlib
import logging as _logging

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "tidal.entrypoints.llm",
    "SamplingParams": "tidal.sampling_params",
    "StructuredOutputsParams": "tidal.structured_outputs",
    "GuidedDecodingParams": "tidal.structured_outputs",
    "RequestOutput": "tidal.outputs",
    "CompletionOutput": "tidal.outputs",
    "Logprob": "tidal.outputs",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # looked up here from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


_logger = _logging.getLogger("tidal")
if not _logger.handlers:
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    _logger.addHandler(_h)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False
