"""Where the model runs: the `device` engine argument ("auto", "cpu" or "cuda") and copies of
per-step host tensors to it.

The model runner builds each step's metadata (token ids, positions, slot mapping, block tables) on
the host as plain Python integers, then copies each tensor to the device once per step. On CUDA the
copy goes through pinned memory with `non_blocking=True`, so the host never waits for the GPU to
drain its queue before the forward starts; on CPU it is the tensor itself.
"""
from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one is refused."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise ValueError(f"device 'cuda' was asked for, but torch sees no GPU (torch {torch.__version__}, {build}): "
                         "use device='cpu' or device='auto'")
    return device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device (no copy on CPU)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
