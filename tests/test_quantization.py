"""Weight quantization (int8, w8a8, fp8, experts_int8): the per-row quantizers' error bounds, tiny random
models of each architecture served quantized against the same model unquantized (prompt logprobs within
stated tolerances), HF FP8 checkpoints, tensor parallelism, weight memory, and the refusals."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import TEST_KV_CACHE_BYTES, random_prompts, save_tiny_model, tiny_config
from tests.test_hybrid import save_tiny_hybrid
from tidal import LLM, SamplingParams
from tidal.layers.quantization.methods import dequantize_rows, quantize_rows

ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": TEST_KV_CACHE_BYTES, "max_num_batched_tokens": 32,
          "block_size": 4}
PARAMS = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)


# -- quantizers ---------------------------------------------------------------------------------------
def test_int8_rows_round_to_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 301, generator=g) * torch.logspace(-3, 1, 37).unsqueeze(1)
    w[5] = 0  # a row of zeros quantizes to zeros
    q, scale = quantize_rows(w, torch.int8)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (37,)
    err = (dequantize_rows(q, scale) - w).abs()
    assert (err <= scale.unsqueeze(1) / 2 * (1 + 1e-6)).all()
    assert torch.equal(q[5], torch.zeros(301, dtype=torch.int8))
    # each row's largest magnitude is exactly representable: +-127 steps
    assert torch.equal(q.abs().amax(1)[torch.arange(37) != 5], torch.full((36,), 127, dtype=torch.int8))


def test_fp8_rows_have_e4m3_relative_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 512, generator=g) * 3
    q, scale = quantize_rows(w, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= 448
    dq = dequantize_rows(q, scale)
    normal = w.abs() >= scale.unsqueeze(1) * 2 ** -6  # E4M3's normal range (3 mantissa bits: rel. error <= 2^-4)
    assert ((dq - w).abs()[normal] <= w.abs()[normal] * 2 ** -4 + 1e-7).all()
    assert ((dq - w).abs()[~normal] <= scale.unsqueeze(1).expand_as(w)[~normal] * 2 ** -10).all()  # denormal step: 2^-9


# -- tiny models, quantized vs not ----------------------------------------------------------------------
def _prompt_logprobs(llm: LLM, prompts) -> torch.Tensor:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    vals = []
    for o, p in zip(outs, prompts, strict=True):
        vals += [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
    return torch.tensor(vals)


# How far a quantized model may be from the unquantized fp32 one: |prompt logprob difference| over ~150
# prompt tokens, mean and max. Tiny random models are harsh (hidden size 64, so one rounded weight
# moves a product more than in a real model, and a routing flip in an MoE layer or a Mamba state that
# carries an error along the sequence makes the outliers): these bound the damage, the exact check is
# test_weight_only_schemes_compute_with_the_dequantized_weights.
TOLERANCE = {"int8": (0.03, 0.1), "w8a8": (0.08, 0.3), "fp8": (0.08, 0.3), "experts_int8": (0.03, 0.1)}
MOE_MAX_TOLERANCE = 2.0  # a token whose experts change when the router's inputs move by a rounding error


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {"llama": save_tiny_model(str(tmp_path_factory.mktemp("q-llama")), tiny_config("llama"), seed=2)}
    for kind in ("mixtral", "jamba"):
        path = str(tmp_path_factory.mktemp(f"q-{kind}"))
        save_tiny_hybrid(kind, path)
        paths[kind] = path
    return paths


PROMPTS = random_prompts(5, 10, 50, 256, seed=4)
_REFERENCE: dict[str, torch.Tensor] = {}
CASES = [("llama", "int8"), ("llama", "w8a8"), ("llama", "fp8"), ("mixtral", "int8"), ("mixtral", "experts_int8"),
         ("mixtral", "fp8"), ("jamba", "w8a8"), ("jamba", "experts_int8"), ("jamba", "int8")]


def _reference(path: str) -> torch.Tensor:
    if path not in _REFERENCE:
        _REFERENCE[path] = _prompt_logprobs(LLM(path, **ENGINE), PROMPTS)
    return _REFERENCE[path]


@pytest.mark.parametrize("arch,scheme", CASES)
def test_quantized_model_prompt_logprobs_near_unquantized(models, arch, scheme):
    ref = _reference(models[arch])
    got = _prompt_logprobs(LLM(models[arch], quantization=scheme, **ENGINE), PROMPTS)
    diff = (got - ref).abs()
    mean_tol, max_tol = TOLERANCE[scheme]
    if arch != "llama":
        max_tol = MOE_MAX_TOLERANCE
    assert diff.mean() < mean_tol and diff.max() < max_tol, (arch, scheme, diff.mean().item(), diff.max().item())
    assert diff.max() > 0  # the weights really were quantized


_QUANTIZED = re.compile(r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj|out_proj|"
                        r"\.w[123]|embed_tokens|embeddings|lm_head)\.weight$")


_TABLES = re.compile(r"(embed_tokens|embeddings|lm_head)\.weight$")


def _dequantized_checkpoint(src: str, dst: str, scheme: str) -> str:
    """src's tensors with every weight the scheme quantizes replaced by its quantize-dequantize round trip."""
    os.makedirs(dst, exist_ok=True)
    fmt = torch.float8_e4m3fn if scheme == "fp8" else torch.int8
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name, t in tensors.items():
        if _QUANTIZED.search(name) and (scheme != "experts_int8" or ".experts." in name):
            table = _TABLES.search(name) is not None  # embedding / LM-head tables: int8 rows in every scheme
            tensors[name] = dequantize_rows(*quantize_rows(t, torch.int8 if table else fmt))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), dst)
    return dst


@pytest.mark.parametrize("arch,scheme", [c for c in CASES if c[1] != "w8a8"])
def test_weight_only_schemes_compute_with_the_dequantized_weights(models, tmp_path, arch, scheme):
    """Quantizing at load (fused QKV / gate-up rows, Mamba's in_proj halves, stacked experts, the
    embedding table and LM head) must compute what the unquantized engine computes on the quantize-
    dequantize round trip of each checkpoint matrix: the same weights, only fp32 summation order differs."""
    plain = _dequantized_checkpoint(models[arch], str(tmp_path / "dq"), scheme)
    want = _prompt_logprobs(LLM(plain, **ENGINE), PROMPTS)
    got = _prompt_logprobs(LLM(models[arch], quantization=scheme, **ENGINE), PROMPTS)
    torch.testing.assert_close(got, want, atol=5e-4, rtol=0)


def test_quantized_weights_are_stored_narrow(models):
    from tidal.layers.linear import LinearBase
    from tidal.layers.moe import FusedMoE
    llm = LLM(models["mixtral"], quantization="experts_int8", **ENGINE)
    model = llm.llm_engine.executor.runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.w13_weight.dtype == torch.int8 and m.w2_weight.dtype == torch.int8 for m in moes)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(m.weight.dtype == torch.float32 for m in linears)  # everything else stays in the model dtype

    llm = LLM(models["llama"], quantization="int8", **ENGINE)
    model = llm.llm_engine.executor.runner.model
    assert all(m.weight.dtype == torch.int8 for m in model.modules() if isinstance(m, LinearBase))
    assert model.model.embed_tokens.weight.dtype == torch.int8

    # fp8: E4M3 linears, the embedding / LM-head table in int8 rows (the same byte, less rounding error)
    llm = LLM(models["llama"], quantization="fp8", **ENGINE)
    model = llm.llm_engine.executor.runner.model
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in model.modules() if isinstance(m, LinearBase))
    assert model.model.embed_tokens.weight.dtype == torch.int8
    assert model.lm_head.weight.dtype == torch.int8


def test_int8_weights_take_about_a_quarter_of_fp32(models):
    fp32 = LLM(models["llama"], **ENGINE).llm_engine.weight_bytes
    int8 = LLM(models["llama"], quantization="int8", **ENGINE).llm_engine.weight_bytes
    assert int8 <= 0.27 * fp32, (int8, fp32)


def test_tp2_int8_matches_single_process_int8(models, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = models["llama"]
    one = _prompt_logprobs(LLM(path, quantization="int8", **ENGINE), PROMPTS)
    llm = LLM(path, quantization="int8", tensor_parallel_size=2, **ENGINE)
    try:
        two = _prompt_logprobs(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()
    # row-parallel layers quantize each rank's half of a row with its own scale: close, not equal
    diff = (one - two).abs()
    assert diff.mean() < 0.01 and diff.max() < 0.05, (diff.mean().item(), diff.max().item())


# -- w8a8 smoothing (SmoothQuant) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory, models):
    """The tiny Llama with three hidden channels of every RMSNorm 40x larger: activation outliers, as real
    models have them, which per-token int8 activations handle badly."""
    path = str(tmp_path_factory.mktemp("q-outliers"))
    shutil.copytree(models["llama"], path, dirs_exist_ok=True)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[torch.randperm(t.numel(), generator=g)[:3]] *= 40
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def test_w8a8_smoothing_takes_activation_outliers_into_the_weights(outlier_model, monkeypatch):
    ref = _reference(outlier_model)
    monkeypatch.setenv("TIDAL_W8A8_SMOOTHING", "0")
    plain = (_prompt_logprobs(LLM(outlier_model, quantization="w8a8", **ENGINE), PROMPTS) - ref).abs()
    monkeypatch.setenv("TIDAL_W8A8_SMOOTHING", "1")
    llm = LLM(outlier_model, quantization="w8a8", **ENGINE)
    smoothed = (_prompt_logprobs(llm, PROMPTS) - ref).abs()
    assert smoothed.mean() < 0.7 * plain.mean(), (smoothed.mean().item(), plain.mean().item())
    assert smoothed.max() < plain.max(), (smoothed.max().item(), plain.max().item())
    # the divisions went into the norms: their outlier channels shrank
    ckpt = load_file(os.path.join(outlier_model, "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    norm = llm.llm_engine.runner.model.model.layers[0].input_layernorm.weight
    assert norm.abs().max() < 0.5 * ckpt.abs().max(), (norm.abs().max().item(), ckpt.abs().max().item())


def test_w8a8_smoothing_folds_are_exact_in_float():
    """What smoothing does to the weights leaves each product unchanged before quantization: the
    producers' divisions (a norm, V rows, up rows) times the consumers' column factors give the same
    outputs."""
    from tidal.layers.quantization.smoothing import _expand_heads, smoothing_factors
    torch.manual_seed(0)
    hq, hk, d, hidden = 4, 2, 8, 16
    x, gamma = torch.randn(5, hidden, dtype=torch.float64), torch.rand(hidden, dtype=torch.float64) + 0.5
    wqkv = torch.randn((hq + 2 * hk) * d, hidden, dtype=torch.float64)
    wo = torch.randn(hidden, hq * d, dtype=torch.float64)
    act = torch.rand(hidden, dtype=torch.float64) * 10
    s = smoothing_factors(act, wqkv.abs().amax(0))
    assert torch.allclose((x * (gamma / s)) @ (wqkv * s).T, (x * gamma) @ wqkv.T)
    # o's input: V rows divided per KV channel, o's columns multiplied per query-head channel
    so = smoothing_factors(torch.rand(hq * d, dtype=torch.float64) + 0.1, wo.abs().amax(0), (hq, hk, d))
    assert so.shape == (hk * d,)
    v = (x * gamma) @ wqkv[(hq + hk) * d:].T  # [5, hk * d]
    attn = v.view(5, hk, 1, d).expand(5, hk, hq // hk, d).reshape(5, hq * d)  # each query head reads its KV head
    v_s = (x * gamma) @ (wqkv[(hq + hk) * d:] / so.unsqueeze(1)).T
    attn_s = v_s.view(5, hk, 1, d).expand(5, hk, hq // hk, d).reshape(5, hq * d)
    assert torch.allclose(attn_s @ (wo * _expand_heads(so, (hq, hk, d))).T, attn @ wo.T)
    # a channel that never fires, or a zero weight column, keeps s = 1
    act[3] = 0
    assert smoothing_factors(act, wqkv.abs().amax(0))[3] == 1


def test_tp2_w8a8_smooths_each_rank_and_stays_near_unquantized(outlier_model, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ref = _reference(outlier_model)
    one = (_prompt_logprobs(LLM(outlier_model, quantization="w8a8", **ENGINE), PROMPTS) - ref).abs()
    llm = LLM(outlier_model, quantization="w8a8", tensor_parallel_size=2, **ENGINE)
    try:
        two = (_prompt_logprobs(llm, PROMPTS) - ref).abs()
    finally:
        llm.llm_engine.shutdown()
    monkeypatch.setenv("TIDAL_W8A8_SMOOTHING", "0")
    plain = (_prompt_logprobs(LLM(outlier_model, quantization="w8a8", **ENGINE), PROMPTS) - ref).abs()
    # each rank smooths its own shard from its own maxima: another rounding, about the same accuracy
    assert two.mean() < 0.7 * plain.mean(), (two.mean().item(), plain.mean().item())
    assert two.mean() < 1.3 * one.mean() and two.max() < 1.5 * one.max(), (two.mean().item(), one.mean().item(),
                                                                          two.max().item(), one.max().item())


# -- checkpoints already in FP8 (Hugging Face layout) ----------------------------------------------------
def _write_fp8_checkpoint(src: str, dst: str, per_tensor: bool) -> None:
    """The tiny model's linear weights as E4M3 + weight_scale (per tensor or per output channel), config
    with quantization_config {"quant_method": "fp8"}, everything else copied."""
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            if per_tensor:
                scale = t.abs().max() / 448
                out[name] = (t / scale).to(torch.float8_e4m3fn)
                out[name.replace(".weight", ".weight_scale")] = scale.reshape(())
            else:
                q, scale = quantize_rows(t, torch.float8_e4m3fn)
                out[name], out[name.replace(".weight", ".weight_scale")] = q, scale.unsqueeze(1)
            out[name.replace(".weight", ".input_scale")] = torch.tensor(1.0)  # static activation scale: unused
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    # the same values, dequantized, as a plain checkpoint: what the FP8 one must compute
    plain = {n: t for n, t in out.items() if not n.endswith("_scale")}
    for name, t in list(plain.items()):
        if t.dtype == torch.float8_e4m3fn:
            plain[name] = t.float() * out[name.replace(".weight", ".weight_scale")].float().reshape(-1, 1)
    os.makedirs(dst + "-plain", exist_ok=True)
    save_file(plain, os.path.join(dst + "-plain", "model.safetensors"))
    with open(os.path.join(dst + "-plain", "config.json"), "w") as f:
        del config["quantization_config"]
        json.dump(config, f)


@pytest.mark.parametrize("per_tensor", [True, False])
def test_hf_fp8_checkpoint_loads_as_fp8(models, tmp_path, per_tensor):
    dst = str(tmp_path / "fp8")
    _write_fp8_checkpoint(models["llama"], dst, per_tensor)
    llm = LLM(dst, **ENGINE)  # no quantization asked: the checkpoint says fp8
    assert llm.llm_engine.quantization == "fp8"
    got = _prompt_logprobs(llm, PROMPTS)
    plain = _prompt_logprobs(LLM(dst + "-plain", **ENGINE), PROMPTS)
    # same weight values; fused q/k/v and gate/up keep each shard's scale: only fp32 rounding differs
    torch.testing.assert_close(got, plain, atol=2e-4, rtol=0)
    with pytest.raises(ValueError, match="already FP8"):
        LLM(dst, quantization="int8", **ENGINE)


# -- refusals -------------------------------------------------------------------------------------------
def test_unknown_scheme_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization must be one of int8, w8a8, fp8, experts_int8"):
        LLM(quantization="gptq")


def test_experts_int8_without_experts_is_refused(models):
    with pytest.raises(ValueError, match="experts_int8.*has none"):
        LLM(models["llama"], quantization="experts_int8", **ENGINE)


def test_unreadable_checkpoint_quantization_is_refused(models, tmp_path):
    dst = tmp_path / "awq"
    dst.mkdir()
    for f in os.listdir(models["llama"]):
        os.symlink(os.path.join(models["llama"], f), dst / f) if f != "config.json" else None
    with open(os.path.join(models["llama"], "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        LLM(str(dst), **ENGINE)


# -- sizing without weights ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", [None, "experts_int8", "int8"])
def test_sizing_estimate_equals_what_a_real_load_holds(models, scheme):
    """tidal.worker.sizing builds the model on the meta device with the same quantization: its weight and
    KV bytes are the bytes a real load holds (the Jamba-1.5-Large estimate in docs/parallel.md is this
    code at that config)."""
    from tidal.loader.loader import load_config
    from tidal.worker.sizing import estimate_memory
    est = estimate_memory(load_config(models["jamba"]), dtype=torch.float32, quantization=scheme,
                          device_bytes=1e9, activation_reserve=0, context_lens=(64,))
    llm = LLM(models["jamba"], quantization=scheme, **ENGINE)
    assert est.weight_bytes_per_device == llm.llm_engine.weight_bytes
    assert est.kv_bytes_per_token_per_device == llm.llm_engine.runner.kv_bytes_per_token()
    assert est.state_bytes_per_request_per_device == llm.llm_engine.runner.state_bytes_per_request()
    assert est.fits[0].requests > 0
