"""The measuring tools of the quantization benchmark: benchmarks/perplexity.py's windows and figure, and
benchmarks/peers/make_q8_0_gguf.py's Q/K layout, on tiny models (a second or two)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import hf_model, hf_prompt_logprobs, load_benchmark, random_prompts, tiny_llm

perplexity = load_benchmark("perplexity")


@pytest.mark.parametrize("num_tokens,window,stride", [(1, 8, 4), (8, 8, 4), (9, 8, 4), (100, 32, 16),
                                                      (100, 32, 32), (101, 32, 7), (5000, 1024, 512)])
def test_windows_score_every_token_after_the_first_once(num_tokens, window, stride):
    spans = perplexity.windows(num_tokens, window, stride)
    scored = [t for start, end, first in spans for t in range(start + first, end)]
    assert scored == list(range(1, num_tokens))
    for k, (start, end, first) in enumerate(spans):
        assert end - start <= window
        if k > 0:  # after the first window a scored token sees at least window - stride tokens before it
            assert first >= min(window - stride, end - start - 1)


def test_windows_refuse_a_stride_outside_the_window():
    with pytest.raises(ValueError, match="stride"):
        perplexity.windows(100, 32, 64)


def test_perplexity_equals_transformers_on_the_same_windows(tiny_model_dir):
    path = tiny_model_dir("llama")
    (ids,) = random_prompts(1, 150, 150, vocab=512, seed=3)
    llm = tiny_llm(path, max_model_len=64)
    result = perplexity.perplexity(llm, ids, window=48, stride=20)
    hf = hf_model(path)
    nll = 0.0
    for start, end, first in perplexity.windows(len(ids), 48, 20):
        lp = hf_prompt_logprobs(hf, ids[start:end])  # lp[j - 1]: token j of the window
        nll -= sum(lp[first - 1:])
    assert result["tokens"] == len(ids) - 1
    assert result["mean_nll"] == pytest.approx(nll / (len(ids) - 1), rel=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-4)


def test_gguf_qk_permutation_inverts_the_loaders():
    pytest.importorskip("gguf")
    from tidal.loader.gguf_loader import unpermute_qk
    make_gguf = load_benchmark("peers/make_q8_0_gguf")
    w = torch.randn(3 * 64, 40)  # 3 heads of 64 rows
    assert torch.equal(torch.from_numpy(make_gguf.permute_qk(unpermute_qk(w, 3).numpy(), 3)), w)
    assert not torch.equal(unpermute_qk(w, 3), w)
