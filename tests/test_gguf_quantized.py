"""GGUF files kept quantized (quantization "gguf"; .gguf files load dequantized unless asked).

Kernels: each block format's products (native, every runnable ISA level; fp32 and bf16 activations)
equal `gguf.quants.dequantize` followed by a float64 matmul, for 1, 3, 17 and 300 rows. Models: tiny
random Llamas written as GGUF files by the `gguf` package (Q8_0, Q4_0, Q4_1; one with formats mixed
inside the fused QKV and gate/up layers and plain F16/BF16 tensors) give the dequantize-at-load path's
greedy tokens and prompt logprobs; the default model (SmolLM2-135M Q4_1) agrees with its dequantized
load in fp32 and holds about the file's bytes of weights.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.helpers import TEST_KV_CACHE_BYTES
from tidal import LLM, SamplingParams
from tidal.layers import gguf_kernels
from tidal.native import isa_override, runnable_isas

FORMATS = ("Q4_0", "Q4_1", "Q8_0")
ROWS = (1, 3, 7, 16, 17, 300)  # up to 16: the decode kernel (groups of four rows); beyond: dense
# fp32: |kernel - float64 reference| <= 1e-5 * sum_k |x_k w_k| (reordered fp32 sums, fused multiply-adds);
# bf16 activations and output: the inputs and the result rounded to bf16 (2^-8 relative each)
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _packed(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    from gguf import GGMLQuantizationType, quants
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quants.quantize(w, GGMLQuantizationType[fmt])
    values = quants.dequantize(blocks, GGMLQuantizationType[fmt])
    return torch.from_numpy(blocks.copy()).view(n, k // 32, -1), values


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_dequantization_equals_gguf_package(fmt):
    packed, values = _packed(fmt, 40, 96)
    assert gguf_kernels.block_format(packed) == fmt
    assert torch.equal(gguf_kernels.dequantize_reference(packed), torch.from_numpy(values))


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_dequantization_equals_gguf_package(fmt, isa):
    packed, values = _packed(fmt, 40, 96)
    with isa_override(isa):
        got = gguf_kernels.dequantize(packed)
    # d * q + m in one fused multiply-add: within one rounding of the package's two
    torch.testing.assert_close(got, torch.from_numpy(values), rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_bf16_dequantization_rounds_like_torch(fmt, isa):
    packed, _ = _packed(fmt, 40, 96)
    with isa_override(isa):
        got = gguf_kernels.dequantize(packed, torch.bfloat16)
    assert torch.equal(got, gguf_kernels.dequantize_reference(packed).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_equals_dequantize_then_matmul(fmt, isa, dtype):
    n, k = 70, 160
    packed, values = _packed(fmt, n, k, seed=1)
    w = torch.from_numpy(values).double()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with isa_override(isa):
            got = gguf_kernels.gguf_linear(x, packed, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = x.double() @ w.T + bias.double()
        bound = REL_TOL[dtype] * (x.double().abs() @ w.abs().T + bias.double().abs()) + 1e-6
        err = (got.double() - want).abs()
        assert (err <= bound).all(), f"{fmt} {isa} {dtype} rows={rows}: max error {err.max().item():.3g}"


# -- tiny GGUF files ------------------------------------------------------------------------------------
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 512


def write_tiny_gguf(path: str, fmt: str, mixed: bool = False, untied: bool = True, seed: int = 0) -> str:
    """A random Llama as a GGUF file: linear weights and the embedding in fmt; with mixed, v and up in
    Q8_0, one layer's down projection in F16 and its gate in BF16 (fused layers with parts)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        if kind == "norm":
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        w = (0.08 * rng.standard_normal(shape)).astype(np.float32)
        if kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            kind_type = GGMLQuantizationType[kind]
            writer.add_tensor(name, quants.quantize(w, kind_type), raw_dtype=kind_type)

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", (VOCAB, HIDDEN), fmt)
    add("output_norm.weight", (HIDDEN,), "norm")
    if untied:
        add("output.weight", (VOCAB, HIDDEN), "Q8_0" if mixed else fmt)
    for i in range(LAYERS):
        odd = mixed and i == 1
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), "norm")
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), "norm")
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, HIDDEN), fmt)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), fmt)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), "Q8_0" if mixed else fmt)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * head_dim), fmt)
        add(f"blk.{i}.ffn_gate.weight", (INTER, HIDDEN), "BF16" if odd else fmt)
        add(f"blk.{i}.ffn_up.weight", (INTER, HIDDEN), "Q8_0" if mixed else fmt)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, INTER), "F16" if odd else fmt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PROMPTS = [[int(t) for t in np.random.default_rng(s).integers(3, VOCAB, size=n)] for s, n in ((0, 7), (1, 40), (2, 19))]
PARAMS = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)


def _run(llm: LLM) -> tuple[list[list[int]], torch.Tensor]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    logprobs = [o.prompt_logprobs[i][p[i]].logprob for o, p in zip(outs, PROMPTS) for i in range(1, len(p))]
    return [list(o.outputs[0].token_ids) for o in outs], torch.tensor(logprobs)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("fmt,mixed,untied", [("Q8_0", False, True), ("Q4_0", False, False), ("Q4_1", False, True),
                                              ("Q4_1", True, True)])
def test_tiny_gguf_quantized_equals_dequantized_load(cache_dir, fmt, mixed, untied):
    path = write_tiny_gguf(str(cache_dir / f"tiny-{fmt}.gguf"), fmt, mixed, untied)
    kw = dict(dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    quantized = LLM(path, quantization="gguf", **kw)
    assert quantized.llm_engine.quantization == "gguf"
    tokens, logprobs = _run(quantized)
    ref_tokens, ref_logprobs = _run(LLM(path, quantization="none", **kw))
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)


def test_tiny_gguf_keeps_blocks_in_memory(cache_dir):
    from tidal.loader.loader import load_model
    path = write_tiny_gguf(str(cache_dir / "tiny-mixed.gguf"), "Q4_1", mixed=True)
    loaded = load_model(path, dtype="float32", quantization="gguf")
    net = loaded.model
    qkv = net.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and gguf_kernels.block_format(qkv.weight) == "Q4_1"
    assert gguf_kernels.block_format(qkv.weight_1) == "Q8_0"  # v in another format: a second part
    assert qkv.gguf_rows == [(0, 96), (96, 32)]
    gate_up = net.model.layers[1].mlp.gate_up_proj
    assert gate_up.weight.dtype == torch.float32 and gate_up.gguf_rows == [(0, INTER), (INTER, INTER)]
    assert net.model.embed_tokens.weight.dtype == torch.uint8
    dequantized = load_model(path, dtype="float32", quantization="none")
    assert loaded.weight_bytes < 0.4 * dequantized.weight_bytes  # blocks (and two plain matrices), not fp32


def test_unsupported_block_format_is_refused_by_name(cache_dir):
    from gguf import GGMLQuantizationType, GGUFReader
    path = write_tiny_gguf(str(cache_dir / "tiny.gguf"), "Q5_0")
    assert GGUFReader(path).tensors[0].tensor_type == GGMLQuantizationType.Q5_0
    with pytest.raises(ValueError, match=r"'token_embd.weight' is of type Q5_0.*quantization='none'"):
        LLM(path, dtype="float32", quantization="gguf", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    LLM(path, dtype="float32", quantization="none", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)  # dequantized


def test_gguf_scheme_refused_for_a_folder(tiny_model_dir):
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(tiny_model_dir("llama"), quantization="gguf", dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)


# -- the default model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_gguf():
    from tests.conftest import SMOLLM2_KV_CACHE_BYTES
    return LLM(dtype="float32", quantization="gguf", max_model_len=2048, kv_cache_memory_bytes=SMOLLM2_KV_CACHE_BYTES)


def test_default_model_loads_quantized_with_about_the_file_bytes(smollm2_gguf):
    from tidal.loader.loader import default_model_path
    engine = smollm2_gguf.llm_engine
    assert engine.quantization == "gguf"
    file_bytes = os.path.getsize(default_model_path())
    assert 0.9 * file_bytes < engine.weight_bytes <= file_bytes


def test_default_model_quantized_agrees_with_dequantized_load(smollm2_gguf, smollm2):
    conversations = [[{"role": "user", "content": q}] for q in ("What is the capital of France?",
                                                                 "Write a short poem about the sea.")]
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0)
    got = smollm2_gguf.chat(conversations, params, use_tqdm=False)
    want = smollm2.chat(conversations, params, use_tqdm=False)  # the default: dequantized at load
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = torch.tensor([next(iter(p.values())).logprob for p in a.prompt_logprobs[1:]])
        lb = torch.tensor([next(iter(p.values())).logprob for p in b.prompt_logprobs[1:]])
        torch.testing.assert_close(la, lb, atol=1e-3, rtol=0)


def test_torch_fallback_without_native_kernels(monkeypatch):
    """No compiler (or a GPU): the torch dequantization feeds a dense product, same values."""
    packed, values = _packed("Q4_1", 70, 160, seed=3)
    monkeypatch.setattr(gguf_kernels, "gguf_lib", lambda: None)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(4))
    got = gguf_kernels.gguf_linear(x, packed, None)
    torch.testing.assert_close(got.double(), x.double() @ torch.from_numpy(values).double().T, atol=1e-4, rtol=0)


def test_tp2_splits_packed_rows_and_blocks(cache_dir, monkeypatch):
    """Tensor parallelism: column-parallel layers take rows of blocks, row-parallel layers whole blocks of
    their input columns; the result is the single process's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = write_tiny_gguf(str(cache_dir / "tiny-tp.gguf"), "Q4_1", mixed=True)
    kw = dict(dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    tokens, logprobs = _run(LLM(path, quantization="gguf", **kw))
    llm = LLM(path, quantization="gguf", tensor_parallel_size=2, **kw)
    try:
        tp_tokens, tp_logprobs = _run(llm)
    finally:
        llm.llm_engine.shutdown()
    assert tp_tokens == tokens
    torch.testing.assert_close(tp_logprobs, logprobs, atol=1e-4, rtol=0)
