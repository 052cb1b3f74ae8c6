"""Jamba under tensor parallelism (2 worker processes, gloo): the Mamba mixers' d_inner, the experts'
intermediate dimension and the attention heads are split across ranks as they load; greedy tokens and
prompt logprobs must equal the single-process engine's."""
from __future__ import annotations

import pytest

from tests.test_hybrid import ENGINE, GREEDY, PROMPTS, save_tiny_hybrid
from tidal import LLM


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # workers share the machine's cores with everything else


def test_jamba_with_tensor_parallel_2_equals_single_process(tmp_path):
    path = str(tmp_path)
    save_tiny_hybrid("jamba", path)
    outs = {}
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, kv_cache_memory_bytes=8 << 20, **ENGINE)
        try:
            outs[tp] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
    for single, parallel in zip(outs[1], outs[2]):
        assert parallel.outputs[0].token_ids == single.outputs[0].token_ids
        for a, b in zip(parallel.prompt_logprobs[1:], single.prompt_logprobs[1:]):
            assert list(a) == list(b)
            assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) < 1e-4
