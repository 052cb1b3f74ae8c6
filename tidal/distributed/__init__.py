"""Process groups and the collectives the parallel layers call.

With one rank (the default) every collective is the identity, so single-process code pays nothing.
"""
from tidal.distributed.parallel_state import (  # noqa: F401
    get_pp_rank, get_pp_size, get_tp_group, get_tp_rank, get_tp_size, tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
