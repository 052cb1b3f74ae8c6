"""The forward context: what layers read about the batch while the model runner runs a forward.

Layers that need to know the batch's layout (attention reads its backend's metadata; Mamba layers read
state slots and chunk boundaries) take it from here instead of having it threaded through every model
signature, so model files look like the familiar Hugging Face ones. The model runner sets one for the
model's forward and another for the LM head over the rows that sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    num_tokens: int
    # requests computing one token, first in the batch (one token each)
    num_decodes: int
    # per request in batch order: query start offsets [num_reqs + 1]
    query_start_loc: list[int]
    # which rows a linear layer may send to a kernel whose rounding depends on the row count (the skinny
    # GEMM): only rows that never need to agree with the same tokens computed in a larger batch - decodes
    # in decode-only steps, and the LM head's sampled rows. Prompt tokens always take a row-independent
    # GEMM, so a prompt rounds the same with or without a prefix-cache hit.
    skinny_gemm: bool = False
    # batch-invariant mode (EngineConfig.batch_invariant): layers take only kernels whose result for a row
    # does not depend on the other rows, the chunking or the step (docs/batch_invariance.md)
    batch_invariant: bool = False
    # the rows of the step whose hidden states are read after the forward (the sampled ones), in order, or
    # None (every row). A model may then run its last layer's attention and MLP for these rows alone and
    # return hidden states for them only (hidden.shape[0] == len(output_rows)); the caller checks which.
    output_rows: list[int] | None = None
    attn_backend: Any = None           # tidal/layers/attention/backends.py
    attn_metadata: Any = None          # what that backend built for this step
    # models with Mamba layers: per request in batch order
    state_slots: Any = None            # [num_reqs] int64 tensor
    has_initial_state: Any = None      # [num_reqs] bool tensor: the chunk continues a computed state
    # does any decode start at position 0 (a one-token prompt)? Known on the host, so layers need not
    # read has_initial_state back from the device
    fresh_decodes: bool = False
    # Mamba state checkpoints to write: (request index in batch, after how many of its tokens, state index)
    state_checkpoints: list[tuple[int, int, int]] | None = None


_CONTEXT: ForwardContext | None = None


class set_forward_context:
    """`with set_forward_context(ctx):` layers called inside read ctx (a plain class rather than a
    generator context manager: it is entered twice on every step)."""
    __slots__ = ("context", "prev")

    def __init__(self, context: ForwardContext) -> None:
        self.context, self.prev = context, None

    def __enter__(self) -> None:
        global _CONTEXT
        self.prev, _CONTEXT = _CONTEXT, self.context

    def __exit__(self, *exc) -> None:
        global _CONTEXT
        _CONTEXT = self.prev


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: layers must run inside the model runner's forward")
    return _CONTEXT


def skinny_gemm_allowed() -> bool:
    """Whether the forward running now lets linear layers use the skinny GEMM (see ForwardContext).
    Outside a forward (a layer called on its own) there is no prompt to keep consistent: allowed."""
    return _CONTEXT is None or _CONTEXT.skinny_gemm


def batch_invariant() -> bool:
    """Whether the forward running now is in batch-invariant mode (False outside a forward)."""
    return _CONTEXT is not None and _CONTEXT.batch_invariant


def output_rows(device) -> Any:
    """The current forward's output rows (ForwardContext.output_rows) as an int64 index tensor on `device`
    when they name a non-empty subset, else None (copied from pinned memory without waiting)."""
    ctx = _CONTEXT
    if ctx is None or not ctx.output_rows:
        return None
    import torch

    from tidal.device import to_device
    return to_device(torch.tensor(ctx.output_rows, dtype=torch.int64), device)
