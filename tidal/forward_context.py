"""The forward context: batch metadata that layers read while the model runner runs a forward.

Layers that need to know about the batch's layout (attention reads block tables and slot mapping;
Mamba layers read state slots and chunk boundaries) take it from here instead of having it threaded
through every model signature, so model files look like the familiar Hugging Face ones.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

_CONTEXT: Any = None


@contextmanager
def set_forward_context(attn_metadata: Any):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, attn_metadata
    try:
        yield
    finally:
        _CONTEXT = prev


def get_forward_context() -> Any:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: layers must run inside the model runner's forward")
    return _CONTEXT


def in_decode_only_step() -> bool:
    """Whether the forward running now holds only decodes (one token per request); True outside a
    forward (the LM head over the sampled rows)."""
    ctx = _CONTEXT
    return ctx is None or getattr(ctx, "num_decodes", -1) == getattr(ctx, "num_tokens", -2)
