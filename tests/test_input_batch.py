"""InputBatch.prepare: a step of one request's one token (a single stream's decode) takes a scalar path;
its inputs must be those the general path gives the same step."""
from __future__ import annotations

import numpy as np
import torch

from tidal.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from tidal.sampling_params import SamplingParams
from tidal.worker.input_batch import InputBatch


def _fields(step) -> dict:
    """A step's inputs, copied (they are views of buffers the next prepare() overwrites)."""
    out = {name: np.array(getattr(step, name).numpy() if isinstance(getattr(step, name), torch.Tensor)
                          else getattr(step, name))
           for name in ("rows", "query_start_loc", "seq_lens", "input_ids", "positions", "slot_mapping",
                        "token_rows", "token_seq_lens")}
    out["scalars"] = (step.num_tokens, step.num_decodes, step.max_seq_len, step.block_size,
                      [r.request_id for r in step.reqs], step.block_table.data_ptr())
    return out


def test_one_decode_takes_the_scalar_path_with_the_same_inputs():
    ib = InputBatch(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256, block_size=16)
    filler = ScheduledRequest("x", 3, 0, True, 3, new_token_ids=[7, 8, 9], new_block_ids=[0],
                              new=NewRequestData(SamplingParams(max_tokens=8), 3, None))
    first = ScheduledRequest("a", 40, 0, True, 40, new_token_ids=list(range(100, 140)), new_block_ids=[5, 2, 9],
                             new=NewRequestData(SamplingParams(max_tokens=8), 40, None))
    ib.update(SchedulerOutput([filler, first], 43))  # "a" in the second row
    decode = ScheduledRequest("a", 1, 40, True, 40, new_token_ids=[555])
    ib.update(SchedulerOutput([decode], 1))
    fast = _fields(ib.prepare([decode]))
    general = _fields(ib._prepare_batch([decode]))
    for name in fast:
        if name == "scalars":
            assert fast[name] == general[name]
        else:
            assert fast[name].dtype == general[name].dtype and np.array_equal(fast[name], general[name]), name
    assert fast["input_ids"].tolist() == [555] and fast["positions"].tolist() == [40]
    assert fast["slot_mapping"].tolist() == [9 * 16 + 8]  # position 40: the table's third block (id 9), offset 8
