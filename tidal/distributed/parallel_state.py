"""Tensor- and pipeline-parallel ranks of this process and the collectives over them.

Ranks are laid out stage-major: global rank = pp_rank * tp_size + tp_rank, so the ranks of one
pipeline stage form one tensor-parallel group, and rank r of stage s sends its hidden states to rank
r of stage s + 1. With one rank (the default) every collective is the identity and nothing here
touches torch.distributed, so single-process code pays nothing.

On CPU, once the ranks of a tensor-parallel group have set up a shared-memory segment
(`init_shm_all_reduce`, which succeeds when they share a machine), tensor-parallel all-reduces go
through it (tidal/distributed/shm_all_reduce.py) instead of gloo; tensors it cannot take (larger than
its slots, other dtypes) still go through gloo.
"""
from __future__ import annotations

import datetime
import os

import torch

_TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None
_PP_RANK, _PP_SIZE = 0, 1
_PP_PREV, _PP_NEXT = None, None  # global ranks of the neighbouring stages (same tp rank)
_PENDING_SENDS: list = []  # (work, tensor): keeps each isend's buffer alive until it completes
_TP_SHM = None  # SharedMemoryAllReduce of this rank's tensor-parallel group, when its ranks share a machine


def set_parallel_state(tp_rank: int = 0, tp_size: int = 1, tp_group=None, pp_rank: int = 0,
                       pp_size: int = 1, pp_prev_rank: int | None = None, pp_next_rank: int | None = None) -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE, _PP_PREV, _PP_NEXT
    _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE = tp_rank, tp_size, tp_group, pp_rank, pp_size
    _PP_PREV, _PP_NEXT = pp_prev_rank, pp_next_rank


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, timeout_s: float = 60.0,
                     backend: str = "gloo") -> None:
    """Join the process group (every rank calls this) and set this process's parallel state.
    `backend`: "gloo" on CPU, "nccl" on CUDA (each rank on its own GPU, set before this call).

    `timeout_s` bounds every collective: a peer that died or hangs turns into an error here instead of
    a rank blocked forever."""
    world = tp_size * pp_size
    if init_method.startswith(("tcp://127.0.0.1", "tcp://localhost")):
        # one machine: keep gloo on the loopback device whatever the host name resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=timeout_s))
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    for stage in range(pp_size):  # every rank must create every group, in the same order
        group = torch.distributed.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        if stage == pp_rank:
            tp_group = group
    set_parallel_state(tp_rank, tp_size, tp_group, pp_rank, pp_size,
                       rank - tp_size if pp_rank > 0 else None,
                       rank + tp_size if pp_rank < pp_size - 1 else None)


def init_shm_all_reduce(max_bytes: int, timeout_s: float) -> bool:
    """Set up the shared-memory all-reduce for this rank's tensor-parallel group, with room for tensors
    of up to max_bytes (the largest activation of a step). Every rank of the group calls it together,
    after init_distributed; returns whether it is in use (False on every rank if any rank cannot map
    the segment). timeout_s: how long an all-reduce waits for a peer before raising."""
    global _TP_SHM
    from tidal.distributed.shm_all_reduce import SharedMemoryAllReduce
    if _TP_SIZE == 1 or _TP_SHM is not None or torch.distributed.get_backend(_TP_GROUP) != "gloo":
        return _TP_SHM is not None
    _TP_SHM = SharedMemoryAllReduce.create(_TP_GROUP, max_bytes, timeout_s)
    return _TP_SHM is not None


def destroy_distributed() -> None:
    global _TP_SHM
    if _TP_SHM is not None:
        _TP_SHM.close()
        _TP_SHM = None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    set_parallel_state()


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_group():
    return _TP_GROUP


def get_pp_rank() -> int:
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def is_first_pp_stage() -> bool:
    return _PP_RANK == 0


def is_last_pp_stage() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The contiguous layer range [start, end) of a pipeline stage. Layers split evenly; the first
    `num_layers % pp_size` stages take one more (the last stage also runs the LM head and sampling)."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def _reducible(x: torch.Tensor) -> torch.Tensor:
    # gloo reduces float32 exactly as it should; 16-bit floats go through float32 so every backend works
    return x if x.dtype == torch.float32 or x.device.type != "cpu" else x.float()


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    if _TP_SHM is not None and _TP_SHM.can_reduce(x):
        return _TP_SHM.all_reduce(x)
    y = _reducible(x)
    torch.distributed.all_reduce(y, group=_TP_GROUP)
    if y is not x:
        x.copy_(y)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


# -- pipeline stages: the tensors a stage hands over travel as one [n, num_tokens, hidden] tensor --------
def pp_send_hidden(*tensors: torch.Tensor) -> None:
    """Send a stage's output (hidden states and residual, or a model's single residual stream) to the
    next stage without waiting, so this stage can start on the next micro-batch; `wait_pp_sends()`
    completes the sends at the end of the step."""
    buf = torch.stack(tensors)
    _PENDING_SENDS.append((torch.distributed.isend(buf, dst=_PP_NEXT), buf))


def pp_recv_hidden(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                   num_tensors: int = 2, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The previous stage's `pp_send_hidden(*tensors)`: num_tensors tensors [num_tokens, hidden_size],
    received into a buffer on `device`."""
    buf = torch.empty(num_tensors, num_tokens, hidden_size, dtype=dtype, device=device)
    torch.distributed.recv(buf, src=_PP_PREV)
    return tuple(buf.unbind(0))


def wait_pp_sends() -> None:
    while _PENDING_SENDS:
        work, _ = _PENDING_SENDS.pop(0)
        work.wait()
