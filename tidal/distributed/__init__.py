"""Process groups and the collectives the parallel layers call.

With one rank (the default) every collective is the identity, so single-process code pays nothing.
"""
from tidal.distributed.parallel_state import (  # noqa: F401
    destroy_distributed,
    get_pp_indices,
    get_pp_rank,
    get_pp_size,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_distributed,
    init_shm_all_reduce,
    is_first_pp_stage,
    is_last_pp_stage,
    pp_recv_hidden,
    pp_send_hidden,
    set_parallel_state,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    wait_pp_sends,
)
