"""The attention backends agree: the same requests (chunked prompts, prefix-cache hits, decodes beside
chunks) give the same greedy tokens and close logprobs through the native CPU kernel and through torch's
SDPA path (the one CUDA takes), chosen with TIDAL_ATTENTION_BACKEND."""
from __future__ import annotations

import pytest

from tests.helpers import random_prompts, tiny_llm
from tidal import SamplingParams
from tidal.platforms import get_platform


def _generate(path, monkeypatch, backend):
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", backend)
    llm = tiny_llm(path, max_num_batched_tokens=24, block_size=4)
    assert llm.llm_engine.runner.attn_backend.name == backend
    prompts = random_prompts(6, 5, 40, llm.llm_engine.vocab_size, seed=7)
    prompts += [prompts[0] + [5, 6, 7], prompts[1][:20] + [9]]  # prefix-cache hits: chunks over a cached context
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_and_torch_backends_agree(tiny_model_dir, monkeypatch, arch):
    path = tiny_model_dir(arch)
    native = _generate(path, monkeypatch, "cpu_native")
    torch_sdpa = _generate(path, monkeypatch, "torch_sdpa")
    for (tok_a, lp_a), (tok_b, lp_b) in zip(native, torch_sdpa):
        assert tok_a == tok_b
        for da, db in zip(lp_a, lp_b):
            for t, v in da.items():
                assert db[t].logprob == pytest.approx(v.logprob, abs=1e-4)


def test_unknown_backend_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="TIDAL_ATTENTION_BACKEND 'flash'.*cpu_native, torch_sdpa"):
        get_platform("cpu").attention_backend()
