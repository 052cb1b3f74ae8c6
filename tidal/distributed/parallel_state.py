"""Tensor- and pipeline-parallel ranks of this process and the collectives over them."""
from __future__ import annotations

import torch

_TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None
_PP_RANK, _PP_SIZE = 0, 1


def set_parallel_state(tp_rank: int = 0, tp_size: int = 1, tp_group=None, pp_rank: int = 0,
                       pp_size: int = 1) -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE
    _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE = tp_rank, tp_size, tp_group, pp_rank, pp_size


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


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
