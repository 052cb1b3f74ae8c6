"""dtype "auto" by CPU: on a CPU without native bf16 products (forced here with the AVX2 kernels) a
bf16 checkpoint computes in fp32 with bf16 weights and a bf16 KV cache, and stays faithful to
transformers run on the same (bf16-valued) weights in fp32."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import TEST_KV_CACHE_BYTES, hf_model, random_prompts, save_tiny_model, tiny_config
from tidal import LLM, SamplingParams
from tidal.layers.linear import Bf16WeightLinearMethod
from tidal.loader.loader import load_model, resolve_dtypes
from tidal.native import isa_override, runnable_isas

BF16_CONFIG = tiny_config("llama", tie_word_embeddings=True)
BF16_CONFIG.dtype = "bfloat16"
FP32_CONFIG = tiny_config("llama")
FP32_CONFIG.dtype = "float32"


def test_auto_on_a_cpu_without_bf16_is_fp32_compute_with_bf16_weights():
    with isa_override("avx2"):
        assert resolve_dtypes("auto", BF16_CONFIG) == (torch.float32, torch.bfloat16)
        assert resolve_dtypes("auto", FP32_CONFIG) == (torch.float32, torch.float32)
        assert resolve_dtypes("bfloat16", BF16_CONFIG) == (torch.bfloat16, torch.bfloat16)
        assert resolve_dtypes("float32", BF16_CONFIG) == (torch.float32, torch.float32)
        assert resolve_dtypes("auto", BF16_CONFIG, device="meta") == (torch.bfloat16, torch.bfloat16)


@pytest.mark.skipif("avx512_bf16" not in runnable_isas(), reason="needs a CPU with AVX-512 BF16")
def test_auto_on_a_cpu_with_bf16_is_bf16():
    with isa_override("avx512_bf16"):
        assert resolve_dtypes("auto", BF16_CONFIG) == (torch.bfloat16, torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama saved in bf16, and transformers' model of it in fp32 (the same bf16 values)."""
    import transformers
    path = str(tmp_path_factory.mktemp("tiny-bf16"))
    save_tiny_model(path, tiny_config("llama", tie_word_embeddings=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path, hf_model(path)


def test_a_bf16_model_holds_each_weight_once(bf16_checkpoint):
    """With bf16 activations on the CPU the loaded model holds the checkpoint's tensors once, with no
    prepacked copy beside them, and weight_bytes is that: each weight plain bf16, or (AVX-512 BF16)
    repacked in place into the packed kernel's tiles, the same bytes for shapes that fill whole tiles."""
    import glob

    from safetensors import safe_open
    path, _ = bf16_checkpoint
    loaded = load_model(path, dtype="bfloat16")
    beside = [f"{name}.{key}" for name, module in loaded.model.named_modules()
              for key, value in vars(module).items() if isinstance(value, torch.Tensor)]
    assert beside == []
    params = {id(p): p for p in loaded.model.parameters()}.values()
    assert all(p.dtype == torch.bfloat16 or (p.dtype == torch.int32 and p.bf16_packed) for p in params)
    checkpoint_bytes = 0
    for file in glob.glob(f"{path}/*.safetensors"):
        with safe_open(file, framework="pt") as f:
            checkpoint_bytes += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert loaded.weight_bytes == sum(p.nbytes for p in params) == checkpoint_bytes


def _teacher_forced_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_bf16_checkpoint_on_avx2_matches_transformers(bf16_checkpoint):
    path, hf = bf16_checkpoint
    prompts = random_prompts(6, 20, 60, 512, seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    with isa_override("avx2"):
        llm = LLM(path, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, block_size=8, max_num_batched_tokens=32)
        engine = llm.llm_engine
        assert engine.dtype == torch.float32
        layer = engine.runner.model.model.layers[0]
        assert isinstance(layer.mlp.down_proj.quant_method, Bf16WeightLinearMethod)
        # bf16 weights and table, packed at load for the fp32-activation kernel (one shift or mask widens them)
        for weight in (layer.mlp.down_proj.weight, engine.runner.model.model.embed_tokens.weight):
            n, k = weight.bf16_packed
            assert weight.dtype == torch.int32 and weight.numel() == -(-n // 16) * 16 * (k + k % 2) // 2
        assert layer.self_attn.attn.kv_cache.dtype == torch.bfloat16
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        ref = _teacher_forced_logprobs(hf, prompt + tokens)
        # prompt logprobs: fp32 arithmetic on the same weights; the bf16 KV cache rounds K and V
        ours = [out.prompt_logprobs[i + 1][prompt[i + 1]].logprob for i in range(len(prompt) - 1)]
        expected = [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert max(abs(a - b) for a, b in zip(ours, expected)) < 5e-3
        for j, (tok, lp) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert abs(lp[tok].logprob - row[tok].item()) < 5e-3
            assert row[tok].item() >= row.max().item() - 1e-2  # greedy: transformers' best up to a near tie


def test_fp32_compute_with_bf16_weights_is_batch_invariant(bf16_checkpoint):
    """Every row of the bf16-weight GEMM, and every token of attention, is computed the same way
    whatever shares the step: a request alone and in a batch with chunked prompts agree bitwise."""
    path, _ = bf16_checkpoint
    prompts = random_prompts(8, 20, 60, 512, seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    with isa_override("avx2"):
        llm = LLM(path, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, block_size=8, max_num_batched_tokens=40,
                  enable_prefix_caching=False)
        alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == batched.token_ids
    assert alone.logprobs == batched.logprobs


def _greedy_twice(llm, prompts):
    """Generate greedily twice, plain and asking for logprobs (the sampler's path, from the full logits):
    for each run, what the LM head's kernel found at each step and every request's tokens."""
    model = llm.llm_engine.runner.model
    fused, runs = model.compute_greedy_tokens, []
    for logprobs in (None, 1):
        found = []

        def counted(hidden, found=found):
            found.append(fused(hidden))
            return found[-1]
        model.compute_greedy_tokens = counted
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=logprobs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append((found, [o.outputs[0].token_ids for o in outs]))
    model.compute_greedy_tokens = fused
    return runs


def test_greedy_bf16_decodes_take_their_tokens_from_the_lm_head_kernel(bf16_checkpoint):
    """With bf16 weights packed at load (AVX-512 BF16), the LM head of plain greedy steps of 1-4 rows finds
    each row's token as it computes the logits, and those are the tokens the sampler's argmax picks from
    the logits (the path a request asking for logprobs takes); elsewhere the LM head finds none and the
    sampler runs."""
    from tidal.layers.cpu_kernels import packed_gemm_available
    path, _ = bf16_checkpoint
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 20, 60, 512, seed=5)]
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, block_size=8)
    (found, plain), (found_sampled, sampled) = _greedy_twice(llm, prompts)
    assert found  # plain greedy steps ask the LM head
    assert all(f is not None for f in found) == packed_gemm_available()
    assert not found_sampled  # logprobs: the sampler's path
    assert plain == sampled


def test_greedy_bf16_batches_on_amx_take_their_tokens_without_logits(bf16_checkpoint):
    """On AMX, the LM head of plain greedy steps of more than 4 bf16 rows finds each row's token without
    storing the logits (packed_linear_argmax_only), and they are the tokens the sampler's argmax picks from
    the full logits (a request asking for logprobs); without AMX such steps go to the sampler."""
    from tidal.layers.cpu_kernels import amx_in_use
    path, _ = bf16_checkpoint
    prompts = [{"prompt_token_ids": p} for p in random_prompts(9, 20, 60, 512, seed=7)]
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, block_size=8)
    (found, plain), (found_sampled, sampled) = _greedy_twice(llm, prompts)
    batches = [f for f in found if f is not None and len(f) > 4]
    assert bool(batches) == amx_in_use()
    if batches:
        assert max(len(f) for f in batches) == len(prompts)  # a step of nine rows
    assert not found_sampled
    assert plain == sampled


def test_greedy_bf16_steps_of_few_rows_take_their_tokens_from_the_int8_screen_on_amx(bf16_checkpoint, monkeypatch):
    """Where the AMX tiles have int8 products, a bf16 LM head holds an int8 screen in their layout, and plain
    greedy steps of up to 16 rows take their tokens from it (packed_linear_screen); they are the tokens the
    sampler's argmax picks from the full logits (a request asking for logprobs). Elsewhere there is no such
    screen, and steps of 5 rows find their tokens in the LM head only on AMX (packed_linear_argmax_only)."""
    from tidal.layers import embedding
    from tidal.layers.cpu_kernels import SCREEN_MAX_ROWS, amx_in_use, amx_int8_in_use
    path, _ = bf16_checkpoint
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 20, 60, 512, seed=8)]
    llm = LLM(path, dtype="bfloat16", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, block_size=8)
    assert (llm.llm_engine.runner.model.lm_head.greedy_screen_tiles is not None) == amx_int8_in_use()
    screened = []

    def counted(hidden, *args, screen=embedding.packed_linear_screen):
        found = screen(hidden, *args)
        screened.append(None if found is None else len(found))
        return found
    monkeypatch.setattr(embedding, "packed_linear_screen", counted)
    (found, plain), (found_sampled, sampled) = _greedy_twice(llm, prompts)
    assert found and all(f is not None for f in found) == amx_in_use()
    assert not found_sampled
    assert plain == sampled
    if amx_int8_in_use():
        assert screened and None not in screened and max(screened) == len(prompts) <= SCREEN_MAX_ROWS
    else:
        assert not screened


def test_greedy_fp32_rows_take_their_tokens_from_the_lm_heads_int8_screen(bf16_checkpoint):
    """With fp32 activations on bf16 weights (dtype auto without native bf16), the LM head holds an int8
    screen and plain greedy steps of any number of rows take their tokens from it (packed_linear_greedy);
    they are the tokens the sampler's argmax picks from the full logits (a request asking for logprobs),
    on a random model whose logits lie close together (many candidates a row)."""
    path, _ = bf16_checkpoint
    prompts = [{"prompt_token_ids": p} for p in random_prompts(9, 20, 60, 512, seed=6)]
    with isa_override("avx2"):
        llm = LLM(path, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, block_size=8)
        assert llm.llm_engine.runner.model.lm_head.greedy_screen is not None
        (found, plain), (found_sampled, sampled) = _greedy_twice(llm, prompts)
    assert found and all(f is not None for f in found)
    assert max(len(f) for f in found) == len(prompts)  # a step of nine rows
    assert not found_sampled
    assert plain == sampled
