"""GGUF files kept quantized (quantization "gguf"; .gguf files load dequantized unless asked).

Kernels: each block format's products (native, every runnable ISA level; fp32 and bf16 activations)
equal `gguf.quants.dequantize` followed by a float64 matmul, for 1, 3, 17 and 300 rows (K-quants, which
gguf-py cannot quantize to, as random blocks with sane fp16 scales). Models: tiny random Llamas written as
GGUF files by the `gguf` package (Q8_0, Q4_0, Q4_1; one with formats mixed inside the fused QKV and
gate/up layers and plain F16/BF16 tensors; one of K-quants and Q5_0/Q5_1) give the dequantize-at-load
path's greedy tokens and prompt logprobs; the default model (SmolLM2-135M Q4_1) agrees with its
dequantized load in fp32 and holds about the file's bytes of weights.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.helpers import TEST_KV_CACHE_BYTES
from tidal import LLM, SamplingParams
from tidal.layers import gguf_kernels
from tidal.layers.quantization.gguf import GGUFLinearMethod
from tidal.native import isa_override, runnable_isas

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
ROWS = (1, 3, 6, 8, 16, 17, 300)  # a few: the streaming decode kernel (groups of four rows; up to 6 in bf16,
# 8 in fp32); beyond: the dense kernels over dequantized tiles
# fp32: |kernel - float64 reference| <= 1e-5 * sum_k |x_k w_k| (reordered fp32 sums, fused multiply-adds);
# bf16 activations and output: the inputs and the result rounded to bf16 (2^-8 relative each)
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


# byte offsets of the fp16 d (and dmin) of a block of the formats gguf-py cannot quantize to
_D_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82)}
_CENTER = {"Q4_K": 7.5, "Q5_K": 15.5, "Q2_K": 1.5}  # dmin / d that centres the values on zero


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator, d: float = 1e-2) -> np.ndarray:
    """Blocks [rows, row bytes] of a K-quant (gguf-py does not quantize to them): random bytes (any byte
    pattern is a valid block) with each fp16 d about d (and dmin about d times _CENTER)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    qk, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    blocks = rng.integers(0, 256, size=(rows, cols // qk, nbytes), dtype=np.uint8)
    for i, off in enumerate(_D_FIELDS[fmt]):
        scale = d * (_CENTER.get(fmt, 1.0) if i else 1.0)
        field = scale * rng.uniform(0.5, 1.5, size=(rows, cols // qk, 1))
        blocks[..., off:off + 2] = field.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _cols(fmt: str, k: int) -> int:
    """k input columns for a 32-value format; a multiple of 256 of about that for a K-quant."""
    return k if gguf_kernels.BLOCK_VALUES[fmt] == 32 else 256 * (k // 64)


def _packed(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    from gguf import GGMLQuantizationType, quants
    rng = np.random.default_rng(seed)
    if fmt in _D_FIELDS:
        blocks = random_blocks(fmt, n, k, rng)
    else:
        blocks = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[fmt])
    values = quants.dequantize(blocks, GGMLQuantizationType[fmt])
    return torch.from_numpy(blocks.copy()).view(n, k // gguf_kernels.BLOCK_VALUES[fmt], -1), values


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_dequantization_equals_gguf_package(fmt):
    packed, values = _packed(fmt, 40, _cols(fmt, 96))
    assert gguf_kernels.block_format(packed) == fmt
    assert torch.equal(gguf_kernels.dequantize_reference(packed), torch.from_numpy(values))


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_dequantization_equals_gguf_package(fmt, isa):
    packed, values = _packed(fmt, 40, _cols(fmt, 96))
    with isa_override(isa):
        got = gguf_kernels.dequantize(packed)
    # d * q + m in one fused multiply-add: within one rounding of the package's two
    torch.testing.assert_close(got, torch.from_numpy(values), rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_bf16_dequantization_rounds_like_torch(fmt, isa):
    packed, _ = _packed(fmt, 40, _cols(fmt, 96))
    with isa_override(isa):
        got = gguf_kernels.dequantize(packed, torch.bfloat16)
    assert torch.equal(got, gguf_kernels.dequantize_reference(packed).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_equals_dequantize_then_matmul(fmt, isa, dtype):
    n, k = 70, _cols(fmt, 160)  # 5 blocks of 32, or 2 blocks of 256
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


def _q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int8-activation kernel sees it: per chunk of 32, round-half-even(x * 127 / max|x|)
    times max|x| / 127 (float64)."""
    xb = x.double().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).view_as(x.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", [i for i in runnable_isas() if i != "generic"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_activation_kernel_equals_its_quantized_product(fmt, isa, dtype):
    """tidal_gguf_linear_q8 (llama.cpp's way: activations quantized per chunk of 32, integer dot products;
    a measurement switch, TIDAL_GGUF_ACTIVATIONS=q8): the exact product of the quantized activations and the
    dequantized weights, within fp32 rounding; Q6_K is not taken."""
    n, k = 70, _cols(fmt, 160)
    packed, values = _packed(fmt, n, k, seed=1)
    w = torch.from_numpy(values).double()
    for rows in (1, 3, 16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with isa_override(isa):
            got = gguf_kernels.gguf_linear_q8(x, packed)
        if fmt == "Q6_K":
            assert got is None
            continue
        xh = _q8_activations(x)
        want, mag = xh @ w.T, xh.abs() @ w.abs().T
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8  # bf16 output: one rounding
        err = (got.double() - want).abs()
        assert (err <= tol * mag + 1e-6).all(), f"{fmt} {isa} rows={rows}: max error {err.max().item():.3g}"


def test_the_decode_kernel_switch(monkeypatch):
    q4_1, q6_k = gguf_kernels.BLOCK_FORMATS["Q4_1"][0], gguf_kernels.BLOCK_FORMATS["Q6_K"][0]
    assert gguf_kernels.decode_kernel(q4_1) == "tidal_gguf_linear"
    monkeypatch.setenv("TIDAL_GGUF_ACTIVATIONS", "q8")
    assert gguf_kernels.decode_kernel(q4_1) == "tidal_gguf_linear_q8"
    assert gguf_kernels.decode_kernel(q6_k) == "tidal_gguf_linear"
    monkeypatch.setenv("TIDAL_GGUF_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="TIDAL_GGUF_ACTIVATIONS='int4': expected 'float'"):
        GGUFLinearMethod(torch.bfloat16)


@pytest.mark.skipif("avx512_bf16" not in runnable_isas(), reason="the bf16 tile kernel needs AVX-512 BF16")
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_tiles_equal_the_dense_kernel_on_the_dequantized_weight_for_any_rows(fmt):
    """bf16 products dequantize each tile of 16 weight rows as the blocked kernel reaches it: bitwise the
    dense kernel's result on the bf16 dequantized weight, for every number of rows (1-4 through the
    ordered skinny kernel), so a row's bits never depend on the batch."""
    from tidal.layers.cpu_kernels import bf16_linear
    n, k = 70, _cols(fmt, 160)
    packed, _ = _packed(fmt, n, k, seed=3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).bfloat16()
    with isa_override("avx512_bf16"):
        dense = gguf_kernels.dequantize(packed, torch.bfloat16)
        x = torch.randn(300, k, generator=torch.Generator().manual_seed(5)).bfloat16()
        whole = bf16_linear(x, dense, bias)
        for rows in (1, 2, 3, 4, 5, 16, 17, 300):
            got = gguf_kernels._rows_linear(x[:rows], packed, bias)
            assert torch.equal(got, whole[:rows]), f"{fmt}: {rows} rows differ from the dense kernel"


@pytest.mark.parametrize("isa", [i for i in runnable_isas() if i != "generic"])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K"])
def test_fp32_tiles_equal_the_dense_fp32_kernel(fmt, isa):
    """fp32 activations, more than 8 rows: the blocked fp32 kernel over tiles dequantized in fp32 equals the
    same kernel on the fp32 dequantized weight."""
    from tidal.layers.cpu_kernels import linear_f32
    n, k = 70, _cols(fmt, 160)
    packed, _ = _packed(fmt, n, k, seed=6)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(7))
    with isa_override(isa):
        got = gguf_kernels._rows_linear(x, packed, None)
        want = linear_f32(x, gguf_kernels.dequantize(packed), None)
    assert torch.equal(got, want)


# -- tiny GGUF files ------------------------------------------------------------------------------------
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 512


# a K-quant's block is 256 values: the K-quant Llama's sizes are multiples of it; random blocks' d that
# give weights of about the other files' spread (0.08)
K_HIDDEN, K_INTER = 256, 512
_MODEL_D = {"Q4_K": 3e-4, "Q5_K": 1.4e-4, "Q6_K": 7e-5, "Q2_K": 5e-3}


def write_tiny_gguf(path: str, fmt: str, mixed: bool = False, untied: bool = True, seed: int = 0,
                    formats: dict[str, str] | None = None, hidden: int = HIDDEN, inter: int = INTER) -> str:
    """A random Llama as a GGUF file: linear weights and the embedding in fmt; with mixed, v and up in
    Q8_0, one layer's down projection in F16 and its gate in BF16 (fused layers with parts); formats:
    {tensor name: type} for the tensors of another type (K-quants written as random blocks)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        kind = (formats or {}).get(name, kind)
        if kind == "norm":
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        if kind in _D_FIELDS:
            writer.add_tensor(name, random_blocks(kind, *shape, rng, _MODEL_D[kind]),
                              raw_dtype=GGMLQuantizationType[kind])
            return
        w = (0.08 * rng.standard_normal(shape)).astype(np.float32)
        if kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            kind_type = GGMLQuantizationType[kind]
            writer.add_tensor(name, quants.quantize(w, kind_type), raw_dtype=kind_type)

    head_dim = hidden // HEADS
    add("token_embd.weight", (VOCAB, hidden), fmt)
    add("output_norm.weight", (hidden,), "norm")
    if untied:
        add("output.weight", (VOCAB, hidden), "Q8_0" if mixed else fmt)
    for i in range(LAYERS):
        odd = mixed and i == 1
        add(f"blk.{i}.attn_norm.weight", (hidden,), "norm")
        add(f"blk.{i}.ffn_norm.weight", (hidden,), "norm")
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, hidden), fmt)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, hidden), fmt)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, hidden), "Q8_0" if mixed else fmt)
        add(f"blk.{i}.attn_output.weight", (hidden, HEADS * head_dim), fmt)
        add(f"blk.{i}.ffn_gate.weight", (inter, hidden), "BF16" if odd else fmt)
        add(f"blk.{i}.ffn_up.weight", (inter, hidden), "Q8_0" if mixed else fmt)
        add(f"blk.{i}.ffn_down.weight", (hidden, inter), "F16" if odd else fmt)
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


def test_a_reopened_file_reads_its_tensors_from_the_index_without_parsing_the_header(cache_dir, monkeypatch):
    """open_gguf parses the header once and keeps a tensor index: the next open maps the same bytes, types
    and shapes without the gguf package's reader; an index that does not fit the file is not trusted."""
    import gguf

    from tidal.loader import gguf_loader
    path = write_tiny_gguf(str(cache_dir / "tiny-mixed.gguf"), "Q4_1", mixed=True)
    first, reader = gguf_loader.open_gguf(path), gguf.GGUFReader
    assert isinstance(first, reader)
    monkeypatch.setattr(gguf, "GGUFReader", None)  # a second parse would fail
    again = gguf_loader.open_gguf(path)
    assert isinstance(again, gguf_loader.IndexedGGUF)
    assert [t.name for t in again.tensors] == [t.name for t in first.tensors]
    assert {t.tensor_type.name for t in again.tensors} == {"Q4_1", "Q8_0", "F16", "BF16", "F32"}
    for a, b in zip(first.tensors, again.tensors):
        assert (a.tensor_type, list(a.shape), a.data.dtype, a.data.shape) == \
            (b.tensor_type, list(b.shape), b.data.dtype, b.data.shape), a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    monkeypatch.setattr(gguf, "GGUFReader", reader)
    index = gguf_loader._cache_folder(path, "gguf-meta") + ".tensors.json"
    entries = json.load(open(index))
    entries[-1]["offset"] = os.path.getsize(path)  # past the end: parsed again (and the index rewritten)
    json.dump(entries, open(index, "w"))
    assert isinstance(gguf_loader.open_gguf(path), reader)
    assert isinstance(gguf_loader.open_gguf(path), gguf_loader.IndexedGGUF)


@pytest.mark.skipif("avx512_bf16" not in runnable_isas(), reason="the bf16 tile kernel needs AVX-512 BF16")
def test_batch_invariant_mode_on_gguf_blocks(cache_dir):
    """batch_invariant=True with GGUF blocks (bf16, AVX-512 BF16): each prompt's logprobs and tokens alone
    are bitwise those it gets in a batch with the others and under a 7-token budget; by default
    (None) the mode is off for GGUF blocks, and fp32 activations are refused with it."""
    path = write_tiny_gguf(str(cache_dir / "tiny-mixed.gguf"), "Q4_1", mixed=True)
    kw = dict(quantization="gguf", dtype="bfloat16", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    with isa_override("avx512_bf16"):
        llm = LLM(path, batch_invariant=True, enable_prefix_caching=False, **kw)
        assert llm.llm_engine.config.batch_invariant
        together = _run(llm)
        alone = [_run_one(llm, i) for i in range(len(PROMPTS))]
        chunked = _run(LLM(path, batch_invariant=True, max_num_batched_tokens=7, **kw))
        assert not LLM(path, **kw).llm_engine.config.batch_invariant
        with pytest.raises(ValueError, match="batch_invariant=True runs GGUF blocks with bf16 activations"):
            LLM(path, batch_invariant=True, quantization="gguf", dtype="float32",
                kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    assert together[0] == [t for t, _ in alone] == chunked[0]
    assert torch.equal(together[1], torch.cat([lp for _, lp in alone]))
    assert torch.equal(together[1], chunked[1])


def _run_one(llm: LLM, i: int) -> tuple[list[int], torch.Tensor]:
    (o,) = llm.generate([{"prompt_token_ids": PROMPTS[i]}], PARAMS, use_tqdm=False)
    p = PROMPTS[i]
    return list(o.outputs[0].token_ids), torch.tensor([o.prompt_logprobs[j][p[j]].logprob for j in range(1, len(p))])


# llama.cpp's Q4_K_M mixes Q4_K with Q6_K (v, down, the LM head); here every new format, mixed inside the
# fused QKV and gate/up layers, the embedding in Q4_K and the LM head in Q6_K
K_FORMATS = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K",
             "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_K", "blk.0.attn_v.weight": "Q6_K",
             "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_K",
             "blk.0.ffn_down.weight": "Q6_K",
             "blk.1.attn_q.weight": "Q5_0", "blk.1.attn_k.weight": "Q5_1", "blk.1.attn_v.weight": "Q5_0",
             "blk.1.attn_output.weight": "Q6_K", "blk.1.ffn_gate.weight": "Q5_1", "blk.1.ffn_up.weight": "Q5_K",
             "blk.1.ffn_down.weight": "Q5_0"}


def test_tiny_kquant_gguf_quantized_equals_dequantized_load(cache_dir):
    from tidal.loader.loader import load_model
    path = write_tiny_gguf(str(cache_dir / "tiny-kquants.gguf"), "Q4_K", formats=K_FORMATS, hidden=K_HIDDEN,
                           inter=K_INTER)
    kw = dict(dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    tokens, logprobs = _run(LLM(path, quantization="gguf", **kw))
    ref_tokens, ref_logprobs = _run(LLM(path, quantization="none", **kw))
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)
    loaded = load_model(path, dtype="float32", quantization="gguf").model
    layers = loaded.model.layers
    qkv, gate_up = layers[0].self_attn.qkv_proj, layers[1].mlp.gate_up_proj
    assert [gguf_kernels.block_format(qkv.weight), gguf_kernels.block_format(qkv.weight_1),
            gguf_kernels.block_format(qkv.weight_2)] == ["Q4_K", "Q5_K", "Q6_K"]
    assert qkv.weight.shape == (K_HIDDEN, 1, 144) and qkv.gguf_rows == [(0, 256), (256, 128), (384, 128)]
    assert [gguf_kernels.block_format(gate_up.weight), gguf_kernels.block_format(gate_up.weight_1)] == ["Q5_1", "Q5_K"]
    assert gguf_kernels.block_format(loaded.model.embed_tokens.weight) == "Q4_K"
    assert gguf_kernels.block_format(loaded.lm_head.weight) == "Q6_K"


def test_kquant_tensor_parallel_columns_are_whole_blocks():
    """A row-parallel layer's rank takes whole 256-value blocks of its input columns, or refuses."""
    from tidal.layers.linear import RowParallelLinear
    packed, _ = _packed("Q4_K", 8, 512)
    layer = RowParallelLinear(512, 8, rank_sizes=[256, 256])
    layer.tp_rank = 1
    assert torch.equal(layer.rank_columns(packed), packed[:, 1:2])
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        RowParallelLinear(512, 8, rank_sizes=[128, 384]).rank_columns(packed)
    assert torch.equal(RowParallelLinear(512, 8, rank_sizes=[128, 384]).rank_columns(_packed("Q5_0", 8, 512)[0]),
                       _packed("Q5_0", 8, 512)[0][:, :4])


def test_rows_not_whole_blocks_are_refused_by_name():
    """A quantized tensor whose rows are not whole blocks of its format (a reader as the gguf package's)."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType

    from tidal.loader.gguf_loader import iterate_gguf_weights
    tensor = SimpleNamespace(name="blk.0.ffn_down.weight", tensor_type=GGMLQuantizationType.Q4_K,
                             data=np.zeros((4, 144), dtype=np.uint8), shape=np.array([320, 4]))
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight' of type Q4_K.*not whole blocks of 256"):
        list(iterate_gguf_weights(SimpleNamespace(tensors=[tensor]), config, torch.float32, keep_quantized=True))


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
    path = write_tiny_gguf(str(cache_dir / "tiny.gguf"), "Q8_0", formats={"token_embd.weight": "Q2_K"},
                           hidden=K_HIDDEN, inter=K_INTER)
    assert GGUFReader(path).tensors[0].tensor_type == GGMLQuantizationType.Q2_K
    with pytest.raises(ValueError, match=r"'token_embd.weight' is of type Q2_K.*quantization='none'"):
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


def test_pp2_with_fp8_kv_and_prefix_caching_gives_the_single_process_results(cache_dir, monkeypatch):
    """GGUF blocks under pipeline parallelism, an FP8 KV cache and a warm prefix cache: the same tokens and
    prompt logprobs as one process with the same cache dtype, and a second run of the same prompts hits
    the prefix cache and gives them again."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = write_tiny_gguf(str(cache_dir / "tiny-pp.gguf"), "Q4_1", mixed=True)
    kw = dict(dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    tokens, logprobs = _run(LLM(path, **kw))  # quantization None: kept in its blocks, the default for .gguf
    llm = LLM(path, pipeline_parallel_size=2, **kw)
    try:
        assert llm.llm_engine.quantization == "gguf"
        pp_tokens, pp_logprobs = _run(llm)
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # (prompt logprobs skip the cache)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        cold = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        hits = llm.llm_engine.kv_manager.prefix_hits
        warm = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert llm.llm_engine.kv_manager.prefix_hits > hits
    finally:
        llm.llm_engine.shutdown()
    assert pp_tokens == tokens == cold == warm
    torch.testing.assert_close(pp_logprobs, logprobs, atol=1e-4, rtol=0)
