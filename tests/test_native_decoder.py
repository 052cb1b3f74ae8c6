"""The native decoder (tidal/layers/native_decoder.py): a Llama-family stage's layers run from one C++
call through the same kernels the Python layers call. Each configuration runs the same prompts twice,
natively and through the Python layers, and the sampled tokens and every logprob (prompt and sample)
must be bitwise equal; the native path must have run. Prompts of 7-40 tokens and a batch of 8 take the
kernels' row-count thresholds (1-4 rows, the GGUF decode kernel's 6/8, prompt chunks)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import TEST_KV_CACHE_BYTES, random_prompts, save_tiny_model, tiny_config
from tests.test_gguf_quantized import VOCAB, write_tiny_gguf
from tidal import LLM, SamplingParams
from tidal.layers.native_decoder import NativeDecoder
from tidal.native import cpu_isa, isa_override, runnable_isas

PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2, ignore_eos=True)


def _decoder(llm: LLM) -> NativeDecoder | None:
    return llm.llm_engine.runner.model.model._native_decoder()


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [lp.logprob for o in outs for step in o.outputs[0].logprobs for lp in step.values()]
    logprobs += [lp.logprob for o in outs for step in (o.prompt_logprobs or [None])[1:] for lp in step.values()]
    return tokens, torch.tensor(logprobs)


def _native_equals_python(llm: LLM, prompts: list[list[int]], expect_native: bool = True,
                          params: SamplingParams = PARAMS) -> NativeDecoder:
    decoder = _decoder(llm)
    assert decoder is not None
    native = _run(llm, prompts, params)
    assert (decoder.calls > 0) == expect_native
    llm.llm_engine.runner.model.model._native[:] = [None]  # the Python layers from here on
    python = _run(llm, prompts, params)
    assert native[0] == python[0]
    assert torch.equal(native[1], python[1])
    return decoder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("llama")), tiny_config("llama"))


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):  # a bf16 checkpoint: dtype "auto" without native bf16 keeps bf16 weights
    import transformers
    path = save_tiny_model(str(tmp_path_factory.mktemp("llama-bf16")), tiny_config("llama"))
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    return path


def test_native_decoder_on_bf16_weights_under_fp32_activations(llama_bf16):
    """dtype auto on a CPU without native bf16 (AVX2): fp32 activations against the bf16 weights packed at
    load, gate/up and silu-and-mul as one call (steps of 5 rows and more), bitwise the Python layers."""
    with isa_override("avx2"):
        llm = LLM(llama_bf16, dtype="auto", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
        layer = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.bf16_packed and llm.llm_engine.dtype == torch.float32  # bf16, packed at load
        decoder = _native_equals_python(llm, _prompts())
        assert any(plan and plan.gate_up_silu for plan in decoder._plans.values())


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_the_last_layer_runs_only_for_the_rows_that_sample(llama_bf16, dtype):
    """Without prompt logprobs a step reads back only its sampled rows, and the native stage runs its last
    layer's attention and MLP for those alone: prompt chunks that sample nothing (12-token steps over
    7-40-token prompts), prompts finishing beside decodes. Every sampled logprob stays bitwise that of the
    full Python layers."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    with isa_override("avx2"):
        llm = LLM(llama_bf16, dtype=dtype, max_num_batched_tokens=12, enable_prefix_caching=False,
                  kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
        decoder = _native_equals_python(llm, _prompts(), params=params)
    assert decoder.picked_calls > 0 and decoder.empty_calls > 0


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):  # the LM head tied to the embedding (as SmolLM2's)
    return save_tiny_model(str(tmp_path_factory.mktemp("llama-tied")), tiny_config("llama", tie_word_embeddings=True))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_embedding_and_the_final_norm_run_in_the_native_call(llama, llama_tied, dtype, tied):
    """The first stage's embedding lookup and the last stage's final RMSNorm run in the decoder's own call
    (their Python calls after a forward were ~0.1 ms each of a single stream's step): neither module is
    called then, and every token and logprob is bitwise what the Python embedding, layers and norm give.
    A bf16 table is packed at load where the CPU has AVX-512 BF16 (tied to the LM head or not), and read
    back by the same unpacking kernel the Python lookup calls."""
    llm = LLM(llama_tied if tied else llama, dtype=dtype, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    model = llm.llm_engine.runner.model.model
    packed = getattr(model.embed_tokens.weight, "bf16_packed", None) is not None
    assert packed == (dtype == "bfloat16" and cpu_isa() == "avx512_bf16")  # (tied or not)
    calls = {"embed": 0, "norm": 0}
    for name, module in (("embed", model.embed_tokens), ("norm", model.norm)):
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    decoder = _decoder(llm)
    assert decoder.final_norm is model.norm and decoder.embedding is not None
    assert (decoder.embedding[1] is not None) == packed
    native = _run(llm, _prompts())
    if dtype == "bfloat16" and cpu_isa() != "avx512_bf16":  # bf16 products there are torch's: Python layers
        assert decoder.calls == 0 and calls["embed"] > 0
        return
    assert decoder.calls > 0 and calls == {"embed": 0, "norm": 0}
    model._native[:] = [None]
    python = _run(llm, _prompts())
    assert calls["embed"] > 0 and calls["norm"] > 0  # the Python path calls them
    assert native[0] == python[0] and torch.equal(native[1], python[1])


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):  # QKV bias
    return save_tiny_model(str(tmp_path_factory.mktemp("qwen2")), tiny_config("qwen2"))


def _prompts(vocab: int = 512, n: int = 8) -> list[list[int]]:
    return random_prompts(n, 7, 40, vocab)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("dtype,quantization,kv", [
    ("float32", None, "auto"), ("bfloat16", None, "auto"), ("bfloat16", "int8", "auto"),
    ("float32", "w8a8", "auto"), ("bfloat16", "fp8", "fp8"), ("bfloat16", None, "fp8")])
def test_native_decoder_is_bitwise_the_python_layers(llama, isa, dtype, quantization, kv):
    with isa_override(isa):
        llm = LLM(llama, dtype=dtype, quantization=quantization, kv_cache_dtype=kv,
                  kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
        if isa == "generic":  # no vector silu-and-mul in that build: the driver is not used there
            _run(llm, _prompts(n=2))
            assert _decoder(llm) is None
            return
        # bf16 products of plain weights without AVX-512 BF16 are torch's: those layers stay in Python
        decoder = _native_equals_python(llm, _prompts(), expect_native=not (dtype == "bfloat16" and quantization is None
                                                                            and isa != "avx512_bf16"))
        # with AVX-512 BF16, packed bf16 gate/up products take silu-and-mul into their epilogue (the same bits)
        fused = any(plan and plan.gate_up_silu for plan in decoder._plans.values())
        assert fused == (dtype == "bfloat16" and quantization is None and isa == "avx512_bf16")


def test_the_scratch_reserved_ahead_is_the_one_the_forwards_use(llama):
    """ModelRunner.reserve_activations (a server's first idle moment) makes the native decoder's activation
    scratch of a step that large and writes each of its pages: every byte of the layout of that many rows
    (fp32: no fused gate/up buffer to leave out); the forwards after it, smaller and as large, in scratch
    that holds the earlier ones' values, stay bitwise the Python layers'."""
    llm = LLM(llama, dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    decoder = _decoder(llm)
    a, m = decoder.layers[0].self_attn, decoder.layers[0].mlp
    H, q, kv, inter = decoder.layers[0].input_layernorm.weight.shape[0], a.num_heads * a.head_dim, \
        a.num_kv_heads * a.head_dim, m.down_proj.in_features
    rows = 200
    per_row = [H, H, q + 2 * kv, q + kv, q, 2 * inter, inter, H]  # csrc/decoder.cpp: scratch_layout
    expected = sum(-(-rows * n * 4 // 64) * 64 for n in per_row)
    assert llm.llm_engine.runner.reserve_activations(rows) == expected
    assert decoder.calls == 0  # no forward made it
    _native_equals_python(llm, _prompts())


@pytest.mark.parametrize("invariant", [False, True])
def test_native_decoder_with_qkv_bias_and_batch_invariance(qwen2, invariant):
    # bf16 products of plain weights run natively with AVX-512 BF16 only (torch's elsewhere): fp32 there
    dtype = "bfloat16" if cpu_isa() == "avx512_bf16" else "float32"
    llm = LLM(qwen2, dtype=dtype, batch_invariant=invariant, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    _native_equals_python(llm, _prompts())


@pytest.mark.parametrize("activations", ["float", "q8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decoder_on_gguf_blocks(cache_dir, monkeypatch, dtype, activations):
    monkeypatch.setenv("TIDAL_GGUF_ACTIVATIONS", activations)  # q8: the int8-activation decode kernel
    path = write_tiny_gguf(str(cache_dir / "tiny.gguf"), "Q4_1")
    llm = LLM(path, quantization="gguf", dtype=dtype, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    # bf16 activations on blocks past the decode kernel's rows need AVX-512 BF16 (the driver's GEMM refuses
    # elsewhere and those steps keep the Python layers): this batch of 8 runs natively only there
    _native_equals_python(llm, _prompts(VOCAB), expect_native=dtype == "float32" or cpu_isa() == "avx512_bf16")


def test_layers_the_driver_cannot_call_take_the_python_path(cache_dir, monkeypatch):
    """A GGUF file whose fused gate/up mixes formats (a layer held in two parts) keeps the Python layers,
    and TIDAL_NATIVE_DECODER=0 turns the driver off."""
    path = write_tiny_gguf(str(cache_dir / "mixed.gguf"), "Q4_1", mixed=True)
    llm = LLM(path, quantization="gguf", dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    decoder = _decoder(llm)
    assert decoder is not None
    _run(llm, _prompts(VOCAB, 2))
    assert decoder.calls == 0 and all(plan is None for plan in decoder._plans.values())
    monkeypatch.setenv("TIDAL_NATIVE_DECODER", "0")
    assert _decoder(LLM(path, quantization="gguf", dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)) is None


@pytest.mark.parametrize("arch", ["llama", "mixtral", "jamba"])
def test_python_layers_run_the_last_mlp_only_for_the_rows_that_sample(tmp_path, monkeypatch, arch):
    """The Python layers (the native driver off, or layers it does not run: Mixtral's MoE, Jamba's Mamba
    and MoE) carry on only the sampled rows after the last layer's mixer: its feed-forward sees one row
    per prompt in a prompt step, and the sampled logprobs equal those of a run that reads every row back
    (prompt logprobs asked)."""
    from tests.test_hybrid import VOCAB as HYBRID_VOCAB
    from tests.test_hybrid import save_tiny_hybrid
    monkeypatch.setenv("TIDAL_NATIVE_DECODER", "0")
    path = str(tmp_path / arch)
    if arch == "llama":
        save_tiny_model(path, tiny_config("llama"))
    else:
        save_tiny_hybrid(arch, path)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    model = llm.llm_engine.runner.model.model
    last = model.layers[model.end_layer - 1]
    mlp = {"llama": "mlp", "mixtral": "block_sparse_moe", "jamba": "feed_forward"}[arch]
    mlp = getattr(last, mlp)
    seen = []
    mlp.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    prompts = _prompts(vocab=512 if arch == "llama" else HYBRID_VOCAB, n=4)
    picked = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    every = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=1, ignore_eos=True)
    pruned, full = _run(llm, prompts, picked), None
    assert seen[0] == len(prompts)  # the prompt step: 4 rows of its 7-40-token prompts
    seen.clear()
    full = _run(llm, prompts, every)
    assert seen[0] == sum(len(p) for p in prompts)
    assert pruned[0] == full[0]
    logprobs = full[1][:pruned[1].numel()]  # (then the prompt logprobs)
    torch.testing.assert_close(pruned[1], logprobs, rtol=0, atol=1e-5)
