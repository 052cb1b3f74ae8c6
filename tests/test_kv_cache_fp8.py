"""FP8 KV cache (kv_cache_dtype "fp8" / "fp8_e4m3"): the native write kernel converts exactly as torch does,
on every ISA level; attention over an E4M3 cache equals attention over its dequantized values and stays
close to attention over the unquantized cache; end to end on tiny random models the engine's logprobs stay
within stated tolerances of the "auto" cache, twice the tokens fit in a bf16 cache's budget, checkpoint
scales are loaded and used, and prefix caching, preemption, a hybrid (Jamba) model and tensor parallelism
work with it; the refusals and the CLI flag."""
from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch

from tests.helpers import TEST_KV_CACHE_BYTES, random_prompts, save_tiny_model, tiny_config, tiny_llm
from tests.test_cli import tidal_cli
from tidal import LLM, SamplingParams
from tidal.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tidal.layers import cpu_kernels
from tidal.layers.attention.kv_cache_dtype import FP8, quantize
from tidal.layers.attention.layer import decode_attention, kv_cache_shape, split_kv_cache
from tidal.native import isa_override, runnable_isas

# -- kernels, on every ISA level this CPU runs ----------------------------------------------------------

SPECIAL = [0.0, -0.0, 1.0, -1.0, 448.0, -448.0, 449.0, 463.9, 464.0, 464.1, 479.9, 480.0, 500.0, -1e6, 1e30,
           float("inf"), float("-inf"), float("nan"), -float("nan"), 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10,
           1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9, 2.0 ** -10 * 1.0001, 1.0625, 1.1875, 1.0624, 0.9999, 1e-40, -1e-45]


def _conversion_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Specials (saturation, NaN, ties, subnormals), every bf16 bit pattern, and normal samples spread
    over the E4M3 range."""
    g = torch.Generator().manual_seed(0)
    every_bf16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    spread = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 10, (20000,), generator=g).float())
    return torch.cat([torch.tensor(SPECIAL), every_bf16, spread]).to(dtype)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 11.0])
def test_write_kernel_converts_bit_for_bit_as_torch(isa, dtype, scale):
    """Native write of k / v into an E4M3 cache == torch's x.float().div(scale).clamp(+-448).to(e4m3):
    round to nearest even, saturation, NaN, subnormals; K blocks transposed, V blocks as rows."""
    hk, d, bs = 2, 45, 16  # 45: vector bodies and a scalar tail at 8 and 16 lanes
    x = _conversion_inputs(dtype)
    per_token = hk * d
    x = torch.cat([x, x[:(-x.numel()) % per_token]]).view(-1, hk, d)
    T = x.shape[0]
    nb = -(-T // bs) + 3
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=FP8)
    k_cache, v_cache = split_kv_cache(kv)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(1))[:T]
    v = x.flip(0)  # a different row at each slot
    with isa_override(isa):
        assert cpu_kernels.write_kv(x, v, k_cache, v_cache, slots, scale, 2 * scale)
    want_k = quantize(x, scale).view(torch.uint8)
    want_v = quantize(v, 2 * scale).view(torch.uint8)
    got_k = k_cache.view(torch.uint8)[slots // bs, :, :, slots % bs]
    got_v = v_cache.view(torch.uint8)[slots // bs, :, slots % bs, :]
    if dtype == torch.float16:
        # torch widens an fp16 NaN to a NaN whose sign depends on where it sits (its vector loop keeps the
        # sign, its scalar tail does not): a NaN's sign is not compared
        for got, want in ((got_k, want_k), (got_v, want_v)):
            nan = want & 0x7F == 0x7F
            assert torch.equal(got[nan] & 0x7F, want[nan] & 0x7F)
            got[nan] = want[nan]
    assert torch.equal(got_k, want_k), (got_k != want_k).sum()
    assert torch.equal(got_v, want_v), (got_v != want_v).sum()


def test_torch_write_path_stores_the_same_bytes():
    """layer.write_kv's torch path (TorchSDPABackend, CUDA) scatters what quantize gives, through a byte view."""
    from tidal.layers.attention.kv_cache_dtype import write_slots
    torch.manual_seed(0)
    kv = torch.zeros(kv_cache_shape(6, 4, 3, 16), dtype=FP8)
    k_cache, v_cache = split_kv_cache(kv)
    k, v = torch.randn(5, 3, 16) * 40, torch.randn(5, 3, 16) * 40
    slots = torch.tensor([0, 3, 9, 22, 13])
    write_slots(k_cache, v_cache, k, v, slots, 0.5, 3.0)
    native = torch.zeros_like(kv)
    nk, nv = split_kv_cache(native)
    assert cpu_kernels.write_kv(k, v, nk, nv, slots, 0.5, 3.0)
    assert torch.equal(kv.view(torch.uint8), native.view(torch.uint8))


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_with_a_key_shift_stores_the_shifted_keys(isa, dtype):
    """k_shift [Hk * D] is taken off each key in fp32 before the conversion: the native kernel (vector bodies
    and scalar tails) and the torch path store (k - shift) / scale, bit for bit; V is not shifted."""
    from tidal.layers.attention.kv_cache_dtype import write_slots
    hk, d, bs = 2, 45, 4
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(7, hk, d, generator=g) * 30).to(dtype), (torch.randn(7, hk, d, generator=g) * 30).to(dtype)
    shift = torch.randn(hk * d, generator=g) * 20
    slots = torch.tensor([0, 5, 9, 2, 13, 30, 17])
    native, torch_path = (torch.zeros(kv_cache_shape(9, bs, hk, d), dtype=FP8) for _ in range(2))
    nk, nv = split_kv_cache(native)
    with isa_override(isa):
        assert cpu_kernels.write_kv(k, v, nk, nv, slots, 0.5, 2.0, shift)
    tk, tv = split_kv_cache(torch_path)
    write_slots(tk, tv, k, v, slots, 0.5, 2.0, shift)
    assert torch.equal(native.view(torch.uint8), torch_path.view(torch.uint8))
    want_k = quantize(k.float() - shift.view(hk, d), 0.5).view(torch.uint8)
    assert torch.equal(nk.view(torch.uint8)[slots // bs, :, :, slots % bs], want_k)
    assert torch.equal(nv.view(torch.uint8)[slots // bs, :, slots % bs, :], quantize(v, 2.0).view(torch.uint8))


def test_a_constant_key_shift_leaves_attention_unchanged():
    """Every score of a query moves by q . shift, which softmax ignores: the reason centring the keys of an
    FP8 cache is exact before rounding (checked here on an fp32 cache)."""
    nb, bs, hk, hq, d = 6, 4, 2, 4, 16
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(kv_cache_shape(nb, bs, hk, d), generator=g)
    shifted = kv.clone()
    shift = torch.randn(hk, d, generator=g) * 10
    split_kv_cache(shifted)[0].sub_(shift.view(1, hk, d, 1))  # K blocks are [block, Hk, D, block size]
    q = torch.randn(3, hq, d, generator=g)
    tables, lens = torch.tensor([[0, 1, 2, 3, 4, 5]] * 3), torch.tensor([5, 13, 24])
    outs = []
    for cache in (kv, shifted):
        k_cache, v_cache = split_kv_cache(cache)
        outs.append(cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def _fp8_cache(nb, bs, hk, d, seed=0):
    """An unquantized fp32 cache and its E4M3 copy (K / 0.05, V / 0.08: scales that are not 1)."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(kv_cache_shape(nb, bs, hk, d), generator=g)
    k_scale, v_scale = 0.05, 0.08
    fp8 = torch.empty(ref.shape, dtype=FP8)
    fp8[0], fp8[1] = quantize(ref[0], k_scale), quantize(ref[1], v_scale)
    return ref, fp8, k_scale, v_scale


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 32])
def test_attention_over_fp8_cache_equals_its_dequantized_values(isa, dtype, d):
    """Decodes and prompt-chunk tiles over an E4M3 cache (widened in registers, scales folded in) equal
    torch attention over the same cache dequantized to fp32 (x scale): 1e-5 with fp32 queries, 2e-2 (bf16
    output rounding) with bf16 ones; each prompt token of a tile is bitwise what it is alone."""
    torch.manual_seed(0)
    nb, hk, hq, bs = 40, 3, 9, 16
    _, kv, k_scale, v_scale = _fp8_cache(nb, bs, hk, d)
    k_cache, v_cache = split_kv_cache(kv)
    tables = torch.randperm(nb)[:30].view(3, 10)
    index = torch.tensor([0] + [1] * 11 + [2] * 2 + [0])  # a decode, a chunk of 11, a chunk of 2, a decode
    lens = torch.tensor([70] + list(range(90, 101)) + [16, 17] + [33])
    q = torch.randn(len(index), hq, d).to(dtype)
    with isa_override(isa):
        out = cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5, index, k_scale, v_scale)
        for i in (3, 12, 14):
            alone = cpu_kernels.paged_attention_decode(q[i:i + 1], k_cache, v_cache, tables, lens[i:i + 1],
                                                       d ** -0.5, index[i:i + 1], k_scale, v_scale)
            assert torch.equal(alone, out[i:i + 1]), i
    assert out.dtype == dtype
    # the torch path (TorchSDPABackend's decode) dequantizes what it gathers
    reference = decode_attention(q.float(), k_cache, v_cache, tables[index], lens, 100, d ** -0.5, k_scale, v_scale)
    k_deq, v_deq = k_cache.float() * k_scale, v_cache.float() * v_scale
    assert torch.allclose(reference, decode_attention(q.float(), k_deq, v_deq, tables[index], lens, 100, d ** -0.5),
                          atol=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference, atol=tol, rtol=tol)


def test_fp8_attention_stays_close_to_the_unquantized_cache():
    """The quantization error itself: E4M3 keeps 3 mantissa bits, so each stored value is within 2^-4 of
    its own magnitude. Outputs are convex combinations of V rows, so over random unit-variance K/V the
    attention over the FP8 cache is within 2^-4 x max|V| (a one-token sequence returns its V row) of that
    over the fp32 cache everywhere, and within 0.02 on average."""
    torch.manual_seed(0)
    nb, hk, hq, bs, d = 40, 2, 8, 16, 64
    ref, kv, k_scale, v_scale = _fp8_cache(nb, bs, hk, d, seed=3)
    tables = torch.randperm(nb)[:40].view(4, 10)
    seq_lens = torch.tensor([1, 17, 150, 90])
    q = torch.randn(4, hq, d)
    exact = decode_attention(q, *split_kv_cache(ref), tables, seq_lens, 150, d ** -0.5)
    out = cpu_kernels.paged_attention_decode(q, *split_kv_cache(kv), tables, seq_lens, d ** -0.5, None,
                                             k_scale, v_scale)
    err = (out - exact).abs()
    assert err.max() <= 2 ** -4 * ref[1].abs().max() and err.mean() < 0.02, (err.max(), err.mean())


# -- end to end ----------------------------------------------------------------------------------------

NUM_PROMPTS = 12
LOGPROB_WORST, LOGPROB_MEAN = 0.25, 0.04  # measured: 0.09 and 0.02
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0)


def _run(path, prompts, params=GREEDY, **kwargs):
    llm = tiny_llm(path, block_size=4, max_num_batched_tokens=24, **kwargs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False), llm


def _prompt_logprob_gaps(a_outs, b_outs) -> list[float]:
    return [abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob)
            for a, b in zip(a_outs, b_outs) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
def test_fp8_cache_logprobs_close_to_auto_and_greedy_mostly_agrees(tiny_model_dir, monkeypatch, backend):
    """Tiny random Llama (fp32, chunked prefill, blocks of 4): prompt logprobs with the FP8 cache within
    0.25 (worst) and 0.04 (mean) of the fp32 cache's; the first greedy token equal for >= 9 of 12 prompts
    and >= half of all greedy tokens equal (measured: 11 of 12, 93 and 97 of 144; random tiny models have
    near ties, so a continuation may part after one flip)."""
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", backend)
    path = tiny_model_dir("llama")
    prompts = random_prompts(NUM_PROMPTS, 20, 60, 512, seed=5)
    auto, _ = _run(path, prompts)
    fp8, llm = _run(path, prompts, kv_cache_dtype="fp8")
    assert all(a.kv_cache.dtype == FP8 for a in llm.llm_engine.runner.attn_layers)
    gaps = _prompt_logprob_gaps(auto, fp8)
    assert max(gaps) < LOGPROB_WORST and sum(gaps) / len(gaps) < LOGPROB_MEAN, (max(gaps), sum(gaps) / len(gaps))
    firsts = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(auto, fp8))
    same = sum(x == y for a, b in zip(auto, fp8) for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
    assert firsts >= 9 and same >= 0.5 * NUM_PROMPTS * 12, (firsts, same)


def test_centred_keys_cut_the_error_of_keys_with_constant_offsets(tmp_path, monkeypatch):
    """Keys whose slowest rotary channels carry a large constant offset (as real models' keys do): with each
    layer's mean key taken off before storing (the default), the FP8 cache's prompt logprobs move much less
    from the fp32 cache's than without (TIDAL_FP8_KV_CENTERING=0)."""
    from safetensors.torch import load_file, save_file
    path = save_tiny_model(str(tmp_path / "qwen2"), tiny_config("qwen2"), seed=2)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("k_proj.bias"):
            t.view(-1, 16)[:, [6, 7, 14, 15]] += 8.0  # head_dim 16: rotary pairs (6, 14), (7, 15) turn slowest
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    engine = {"dtype": "float32", "kv_cache_memory_bytes": TEST_KV_CACHE_BYTES, "max_num_batched_tokens": 32,
              "block_size": 4}
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompts = random_prompts(5, 10, 50, 256, seed=4)

    def logprobs(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return torch.tensor([o.prompt_logprobs[i][p[i]].logprob
                             for o, p in zip(outs, prompts, strict=True) for i in range(1, len(p))])

    ref = logprobs(LLM(path, **engine))
    monkeypatch.setenv("TIDAL_FP8_KV_CENTERING", "0")
    plain = (logprobs(LLM(path, kv_cache_dtype="fp8", **engine)) - ref).abs()
    monkeypatch.delenv("TIDAL_FP8_KV_CENTERING")
    llm = LLM(path, kv_cache_dtype="fp8", **engine)
    centred = (logprobs(llm) - ref).abs()
    assert all(a.k_shift is not None for a in llm.llm_engine.runner.attn_layers)
    assert centred.mean() < 0.7 * plain.mean(), (centred.mean().item(), plain.mean().item())


def test_fp8_e4m3_is_the_same_cache_as_fp8(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = random_prompts(3, 10, 30, 512, seed=6)
    a, _ = _run(path, prompts, kv_cache_dtype="fp8")
    b, _ = _run(path, prompts, kv_cache_dtype="fp8_e4m3")
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert _prompt_logprob_gaps(a, b) == [0.0] * sum(len(p) - 1 for p in prompts)


def test_prefix_cache_hits_and_preemption_with_fp8_equal_a_plain_fp8_run(tiny_model_dir):
    """Hits read the FP8 blocks another request wrote, and preempted requests recompute into new ones:
    tokens and logprobs equal those of an unconstrained FP8 run without prefix caching."""
    path = tiny_model_dir("llama")
    base = random_prompts(3, 40, 40, 512, seed=7)
    prompts = [base[i % 3] + s for i, s in enumerate(random_prompts(9, 5, 12, 512, seed=8))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    # (the same max_model_len: the keys' centring is measured over a prompt of up to that many tokens)
    ref, _ = _run(path, prompts, params, kv_cache_dtype="fp8", enable_prefix_caching=False, max_model_len=96)
    tight = 24 * 4 * 3 * 2 * 2 * 16  # 24 blocks of 4 tokens: 3 layers x (K, V) x 2 heads x 16 dims x 1 byte
    outs, llm = _run(path, prompts, params, kv_cache_dtype="fp8", kv_cache_memory_bytes=tight, max_model_len=96)
    engine = llm.llm_engine
    assert engine.kv_manager.pool.num_blocks == 24
    assert engine.scheduler.num_preemptions > 0 and engine.stats.prefix_hits > 0
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 1e-4


def _bf16_checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama-bf16"))
    save_tiny_model(path, tiny_config("llama"))
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def test_fp8_cache_holds_twice_the_tokens_of_a_bf16_cache(tmp_path_factory):
    """In the same kv_cache_memory_bytes: a bf16 model's cache, and the bf16 cache of fp32 activations with
    bf16 weights (dtype auto on an AVX2 CPU), each hold >= 1.9x the tokens as FP8, at half the bytes per token."""
    path = _bf16_checkpoint(tmp_path_factory)
    prompts = random_prompts(2, 10, 20, 512, seed=9)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for isa, dtype in [(runnable_isas()[-1], "bfloat16"), ("avx2", "auto")]:
        if isa not in runnable_isas():
            continue
        with isa_override(isa):
            plans = {}
            for kv in ("auto", "fp8"):
                llm = LLM(path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
                engine = llm.llm_engine
                assert engine.kv_cache_dtype == (torch.bfloat16 if kv == "auto" else FP8)
                assert engine.dtype == (torch.float32 if dtype == "auto" else torch.bfloat16), engine.dtype
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
                plans[kv] = engine.kv_plan
        assert plans["auto"].bytes_per_token == 3 * 2 * 2 * 16 * 2
        assert plans["fp8"].bytes_per_token == plans["auto"].bytes_per_token // 2
        assert plans["fp8"].num_tokens >= 1.9 * plans["auto"].num_tokens


def _scaled_checkpoint(src: str, dst: str, factor: float, with_scales: bool, old_names: bool = False) -> str:
    """src's model with K and V `factor` times larger (k_proj, v_proj x factor; q_proj, o_proj / factor: the
    same function), so that unscaled E4M3 would saturate; with_scales adds per-layer k_scale / v_scale (and
    a q_scale, which is read and dropped), vLLM's names or the older k_proj.k_scale / v_proj.v_scale."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst)
    files = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    assert len(files) == 1
    weights = load_file(os.path.join(src, files[0]))
    for name in list(weights):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = weights[name] * factor
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            weights[name] = weights[name] / factor
        if with_scales and name.endswith("self_attn.q_proj.weight"):
            prefix = name.removesuffix(".q_proj.weight")
            scale = torch.tensor(factor / 16)
            if old_names:
                weights[f"{prefix}.k_proj.k_scale"], weights[f"{prefix}.v_proj.v_scale"] = scale, scale * 1.5
            else:
                weights[f"{prefix}.k_scale"], weights[f"{prefix}.v_scale"] = scale, scale * 1.5
            weights[f"{prefix}.q_scale"] = torch.tensor(1.0)
    save_file(weights, os.path.join(dst, files[0]), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("old_names", [False, True])
def test_checkpoint_kv_scales_are_loaded_and_used(tiny_model_dir, tmp_path, old_names):
    """K and V 1000x larger than the model needs: with the checkpoint's scales (1000 / 16 and 1.5x that)
    the FP8 cache keeps its accuracy; without them every value saturates at 448. An "auto" cache ignores
    the scales, and the checkpoint without them loads as before."""
    path = tiny_model_dir("llama")
    prompts = random_prompts(4, 20, 40, 512, seed=10)
    scaled = _scaled_checkpoint(path, str(tmp_path / "scaled"), 1000.0, True, old_names)
    unscaled = _scaled_checkpoint(path, str(tmp_path / "unscaled"), 1000.0, False)
    reference, _ = _run(path, prompts)
    auto, _ = _run(scaled, prompts)
    assert max(_prompt_logprob_gaps(reference, auto)) < 1e-3
    with_scales, llm = _run(scaled, prompts, kv_cache_dtype="fp8")
    for a in llm.llm_engine.runner.attn_layers:
        assert a.kv_scales_from_checkpoint
        assert a.k_scale == pytest.approx(1000 / 16) and a.v_scale == pytest.approx(1.5 * 1000 / 16)
    gaps = _prompt_logprob_gaps(reference, with_scales)
    assert max(gaps) < LOGPROB_WORST and sum(gaps) / len(gaps) < LOGPROB_MEAN, (max(gaps), sum(gaps) / len(gaps))
    without, llm = _run(unscaled, prompts, kv_cache_dtype="fp8")
    assert all(a.k_scale == 1.0 and not a.kv_scales_from_checkpoint for a in llm.llm_engine.runner.attn_layers)
    saturated = _prompt_logprob_gaps(reference, without)
    assert sum(saturated) / len(saturated) > 5 * sum(gaps) / len(gaps)


def test_a_kv_scale_that_is_not_one_number_is_refused(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    path = _scaled_checkpoint(tiny_model_dir("llama"), str(tmp_path / "bad"), 1.0, True)
    file = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    weights = load_file(file)
    weights["model.layers.1.self_attn.v_scale"] = torch.ones(2)
    save_file(weights, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale.*one number per layer"):
        tiny_llm(path, kv_cache_dtype="fp8")


@pytest.mark.parametrize("parallel,bytes_per_token", [({"tensor_parallel_size": 2}, 3 * 2 * 16),  # 1 of 2 heads
                                                      ({"pipeline_parallel_size": 2}, 2 * 2 * 2 * 16)])  # 2 of 3 layers
def test_parallel_fp8_cache_with_checkpoint_scales_matches_single_process(tiny_model_dir, tmp_path, monkeypatch,
                                                                          parallel, bytes_per_token):
    """TP=2: each rank quantizes its own KV heads with the layer's scales; PP=2: each stage loads the scales
    of its own layers. Tokens and logprobs equal one process's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = _scaled_checkpoint(tiny_model_dir("llama"), str(tmp_path / "scaled"), 100.0, True)
    prompts = random_prompts(4, 10, 40, 512, seed=11)
    single, _ = _run(path, prompts, kv_cache_dtype="fp8")
    outs, llm = _run(path, prompts, kv_cache_dtype="fp8", **parallel)
    try:  # bytes per token of the rank that needs most
        assert llm.llm_engine.kv_cache_dtype == FP8 and llm.llm_engine.kv_plan.bytes_per_token == bytes_per_token
        for a, b in zip(single, outs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(_prompt_logprob_gaps(single, outs)) < 1e-4
    finally:
        llm.llm_engine.shutdown()


def test_jamba_with_fp8_attention_cache_and_prefix_caching(tmp_path):
    """Hybrid model: only the attention layers' KV is E4M3, the Mamba state keeps fp32. Prefix-cache hits
    (attention blocks plus a Mamba state checkpoint) give the tokens and logprobs of a run without
    prefix caching, and prompt logprobs stay within the stated tolerances of the "auto" cache."""
    from tests.test_hybrid import ENGINE, PROMPTS, save_tiny_hybrid
    save_tiny_hybrid("jamba", str(tmp_path))
    base = PROMPTS[4]
    prompts = [base, base + [11, 12, 13, 14, 15, 16, 17], base[:20], base]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    with_prompt = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    engine_args = {**ENGINE, "kv_cache_memory_bytes": 4 << 20, "max_num_batched_tokens": 64}
    outs = {}
    for name, kv, caching in [("auto", "auto", False), ("fp8", "fp8", False), ("fp8-cached", "fp8", True)]:
        llm = LLM(str(tmp_path), kv_cache_dtype=kv, enable_prefix_caching=caching, **engine_args)
        runner = llm.llm_engine.runner
        # one request at a time: each finds the blocks and state checkpoints of those before it (a request
        # asking for prompt logprobs computes its whole prompt, so only the uncached runs ask)
        outs[name] = [llm.generate([{"prompt_token_ids": p}], params if caching else with_prompt,
                                   use_tqdm=False)[0] for p in prompts]
        if kv == "fp8":
            assert {a.kv_cache.dtype for a in runner.attn_layers} == {FP8}
            assert {m.ssm_state.dtype for m in runner.mamba_layers} == {torch.float32}
            assert {m.conv_state.dtype for m in runner.mamba_layers} == {torch.float32}
        if caching:
            assert [o.num_cached_tokens for o in outs[name]] == [0, 32, 0, 32]
            assert llm.llm_engine.scheduler.state_checkpoints.num_hits == 2
    for a, b in zip(outs["fp8"], outs["fp8-cached"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 1e-4
    gaps = _prompt_logprob_gaps(outs["auto"], outs["fp8"])
    assert max(gaps) < LOGPROB_WORST and sum(gaps) / len(gaps) < LOGPROB_MEAN, (max(gaps), sum(gaps) / len(gaps))


# -- refusals and the CLI ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["int8", "fp16", "fp8_e5m2", "FP8"])
def test_unknown_kv_cache_dtype_is_refused_naming_the_field_and_allowed_values(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*'auto', 'fp8', 'fp8_e4m3'") as info:
        LLM(None, kv_cache_dtype=value)
    assert repr(value) in str(info.value) or value in str(info.value)


def test_cli_flag_reaches_the_engine(tiny_model_dir, tmp_path):
    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    out_json = tmp_path / "result.json"
    proc = tidal_cli("bench", "throughput", "--model", tiny_model_dir("llama"), "--dataset", "random",
                     "--num-prompts", "2", "--input-len-range", "4", "16", "--output-len-range", "2", "4",
                     "--kv-cache-memory-bytes", "1048576", "--kv-cache-dtype", "fp8", "--output-json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    assert "KV cache fp8_e4m3 at 192 bytes per token" in proc.stderr
    result = json.loads(out_json.read_text())["tidal"]
    assert result["kv_cache_dtype"] == "fp8_e4m3"
    assert result["kv_cache_tokens"] == 1048576 // (192 * 16) * 16
