"""The Triton kernels against their torch references, on small shapes.

Without a GPU they run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set here before
any kernel module is imported); with one (benchmarks/gpu_check.sh) the same tests run the compiled
kernels on CUDA tensors. Skipped where triton is not installed.
"""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytest.importorskip("numpy")

from tidal.layers.attention.kv_cache_dtype import FP8, write_slots  # noqa: E402
from tidal.layers.attention.layer import gather_kv, prefill_attention  # noqa: E402
from tidal.layers.attention.triton_attention import paged_attention  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype, seed=0):
    """A flattened batch over a paged cache with shuffled blocks: every request's K/V (context + this
    chunk) already in the cache, as the backends write it before attending."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(q_lens), max(blocks_per_req) + 1, dtype=torch.int64)
    k_cache = torch.zeros(num_blocks, num_kv_heads, head_dim, block_size, dtype=cache_dtype)
    v_cache = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=cache_dtype)
    k_scale, v_scale = (0.5, 2.0) if cache_dtype == FP8 else (1.0, 1.0)
    for r, nb in enumerate(blocks_per_req):
        table[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        ks = torch.randn(seq_lens[r], num_kv_heads, head_dim, generator=g).to(dtype)
        vs = torch.randn(seq_lens[r], num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(seq_lens[r])
        slots = table[r, pos // block_size] * block_size + pos % block_size
        write_slots(k_cache, v_cache, ks, vs, slots, k_scale, v_scale)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    return q, k_cache, v_cache, table, qsl, torch.tensor(seq_lens), k_scale, v_scale


def _reference(q, k_cache, v_cache, table, qsl, seq_lens, scale, k_scale, v_scale):
    out = torch.empty_like(q)
    for r in range(len(seq_lens)):
        a, b, s = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        nb = -(-s // v_cache.shape[2])
        ks, vs = gather_kv(k_cache, v_cache, table[r, :nb], s, torch.float32, k_scale, v_scale)
        out[a:b] = prefill_attention(q[a:b].float(), ks, vs, s - (b - a), scale).to(q.dtype)
    return out


def _check(q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
           cache_dtype=None, tile_n=16, num_splits=None):
    cache_dtype = cache_dtype or dtype
    q, kc, vc, table, qsl, seq_lens, k_scale, v_scale = _batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim,
                                                               block_size, dtype, cache_dtype)
    scale = head_dim ** -0.5
    want = _reference(q, kc, vc, table, qsl, seq_lens, scale, k_scale, v_scale)
    dev = [t.to(DEVICE) for t in (q, kc, vc, table, qsl, seq_lens)]
    got = paged_attention(*dev, scale, max(q_lens), k_scale, v_scale, tile_n=tile_n, num_splits=num_splits).cpu()
    tol = TOL[dtype]  # an FP8 cache: the reference dequantizes the same bytes
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_paged_attention_decodes_only():
    _check([1, 1, 1], [0, 6, 13])


def test_paged_attention_one_request():
    _check([1], [20])
    _check([9], [0])


def test_paged_attention_mixed_batch_of_decodes_and_chunks():
    # decodes, a chunk continuing a cached context, a fresh prompt
    _check([1, 1, 5, 7], [9, 3, 6, 0])


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_paged_attention_block_sizes(block_size):
    _check([1, 6], [10, 5], block_size=block_size)


def test_paged_attention_gqa_group_not_a_power_of_two_and_odd_head_dim():
    _check([1, 4], [7, 2], num_heads=6, num_kv_heads=2, head_dim=24)


def test_paged_attention_mha_and_mqa():
    _check([2, 1], [3, 5], num_heads=2, num_kv_heads=2)
    _check([2, 1], [3, 5], num_heads=4, num_kv_heads=1)


def test_paged_attention_chunk_longer_than_a_query_tile():
    # 64-row tiles hold 32 tokens of a group of 2: 40 tokens span two tiles of one request
    _check([1, 40], [4, 3], tile_n=16)


def test_paged_attention_smollm2_shape_with_default_tiles():
    # 9 query heads over 3 KV heads, head size 64, blocks of 16, the launcher's own key tile
    _check([1, 1, 20], [40, 70, 33], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, tile_n=32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_half_precision(dtype):
    _check([1, 5], [6, 2], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_fp8_cache_with_scales(dtype):
    _check([1, 5], [6, 2], dtype=dtype, cache_dtype=FP8)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])
def test_paged_attention_decode_keys_split_over_programs(num_splits):
    """Decode-only batches split each request's keys over num_splits programs (whole key tiles each, so
    short requests leave some programs without keys) and combine their partial softmaxes: the same as one
    program per request and KV head. Contexts of 0 to 70 keys, tiles of 16."""
    _check([1, 1, 1, 1], [0, 6, 37, 70], num_splits=num_splits)
    _check([1, 1, 1], [40, 70, 3], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, tile_n=32,
           dtype=torch.bfloat16, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_split_decode_with_an_fp8_cache(dtype):
    _check([1, 1], [6, 45], dtype=dtype, cache_dtype=FP8, num_splits=4)  # v_scale applied once, in the combine


def test_keys_are_split_only_for_decode_only_batches_and_never_in_batch_invariant_mode(monkeypatch):
    from tidal.layers.attention import triton_attention as ta
    monkeypatch.setattr(ta, "_multiprocessors", lambda device: 132)  # an H200
    cuda = torch.device("cuda")
    assert ta.num_kv_splits(8, 1, cuda) == ta.MAX_SPLITS            # one request of the 8B shape: 8 programs
    assert ta.num_kv_splits(132, 1, cuda) == 2
    assert ta.num_kv_splits(2560, 1, cuda) == 1                     # 256 decodes: programs enough
    assert ta.num_kv_splits(8, 20, cuda) == 1                       # a prompt chunk in the batch
    monkeypatch.setattr(ta, "batch_invariant", lambda: True)
    assert ta.num_kv_splits(8, 1, cuda) == 1                        # a token's sums must not depend on the batch
    with pytest.raises(ValueError, match="num_splits 4"):
        _check([1, 3], [5, 2], num_splits=4)


# -- fused layer kernels -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    from tidal.layers import triton_kernels
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(5, 48, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    out = triton_kernels.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6)
    torch.testing.assert_close(out.cpu(), torch.nn.functional.rms_norm(x, (48,), w, 1e-6), atol=TOL[dtype],
                               rtol=TOL[dtype])
    out, summed = triton_kernels.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, res.to(DEVICE))
    # (the interpreter rounds bf16 toward zero, a GPU to nearest: equal there)
    exact = 0 if ON_GPU else TOL[dtype]
    torch.testing.assert_close(summed.cpu(), x + res, atol=exact, rtol=exact)
    torch.testing.assert_close(out.cpu(), torch.nn.functional.rms_norm(x + res, (48,), w, 1e-6), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    from tidal.layers import triton_kernels
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = torch.nn.functional.silu(x[:, :40].float()) * x[:, 40:].float()
    torch.testing.assert_close(triton_kernels.silu_and_mul(x.to(DEVICE)).cpu().float(), want, atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, FP8)])
def test_rotary_write_kv_matches_rotate_then_write(dtype, cache_dtype):
    from tidal.layers import triton_kernels
    from tidal.layers.rotary import RotaryEmbedding
    T, Hq, Hk, D, bs = 5, 4, 2, 16, 4
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(D, 64, 10000.0)
    positions = torch.tensor([0, 7, 8, 9, 30])
    qk = torch.randn(T, Hq + Hk, D, generator=g).to(dtype)
    v = torch.randn(T, Hk, D, generator=g).to(dtype)
    slots = torch.tensor([3, 9, 10, 11, 0])
    k_scale, v_scale = (0.5, 2.0) if cache_dtype == FP8 else (1.0, 1.0)
    # the reference: torch's rotation in fp32, then the torch cache write
    rotated = (qk.float() * rope.cos_full[positions][:, None] + torch.cat((qk[..., D // 2:], qk[..., :D // 2]), -1)
               * rope.sin_signed[positions][:, None]).to(dtype)
    want_k = torch.zeros(4, Hk, D, bs, dtype=cache_dtype)
    want_v = torch.zeros(4, Hk, bs, D, dtype=cache_dtype)
    write_slots(want_k, want_v, rotated[:, Hq:], v, slots, k_scale, v_scale)
    k_cache, v_cache = torch.zeros_like(want_k, device=DEVICE), torch.zeros_like(want_v, device=DEVICE)
    q = triton_kernels.rotary_write_kv(positions.to(DEVICE), qk.to(DEVICE), v.to(DEVICE), Hq,
                                       rope.cos_full.to(DEVICE), rope.sin_signed.to(DEVICE), k_cache, v_cache,
                                       slots.to(DEVICE), k_scale, v_scale)
    torch.testing.assert_close(q.cpu(), rotated[:, :Hq], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(v_cache.cpu().view(torch.uint8), want_v.view(torch.uint8))
    # k is rotated, rounded to bf16, then quantized: a rounding apart in bf16 may be one E4M3 step (1/8) apart
    tol = 0.13 if cache_dtype == FP8 else TOL[dtype]
    torch.testing.assert_close(k_cache.cpu().float(), want_k.float(), atol=tol, rtol=tol)


# -- compiled for a GPU, without one -------------------------------------------------------------------

@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above run the compiled kernels")
def test_every_kernel_compiles_for_sm90_without_a_gpu():
    """Triton lowers each kernel variant the engine launches to PTX and a cubin for sm_90 (H100 / H200)
    with its bundled ptxas: what the interpreter cannot check (tests/triton_compile_check.py)."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("ok ") == len(done.stdout.splitlines()) > 0


# -- the backend in the engine ---------------------------------------------------------------------

def _generate(path, monkeypatch, backend, kv_cache_dtype="auto"):
    from tests.helpers import random_prompts, tiny_llm
    from tidal import SamplingParams
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", backend)
    llm = tiny_llm(path, max_num_batched_tokens=16, block_size=4, kv_cache_dtype=kv_cache_dtype)
    assert llm.llm_engine.runner.attn_backend.name == backend
    prompts = random_prompts(3, 5, 20, llm.llm_engine.vocab_size, seed=7)
    prompts.append(prompts[0] + [5, 6, 7])  # a prefix-cache hit: a chunk over a cached context
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_backend_matches_torch_sdpa_in_the_engine(tiny_model_dir, monkeypatch, kv_cache_dtype):
    """Chunked prompts (16-token steps), a prefix-cache hit, decodes beside chunks: the same greedy tokens
    and close logprobs through the Triton backend (interpreted on a CPU; rotary + cache write fused) as
    through torch's SDPA path, with an fp32 cache and with an FP8 one."""
    path = tiny_model_dir("llama")
    triton_out = _generate(path, monkeypatch, "triton", kv_cache_dtype)
    torch_out = _generate(path, monkeypatch, "torch_sdpa", kv_cache_dtype)
    # FP8: a k rotated a last bit apart on the two paths can round to the neighbouring E4M3 value (1/8 away),
    # which moves a logprob by up to a few hundredths in this tiny random model
    tol = 1e-4 if kv_cache_dtype == "auto" else 0.1
    for (tok_a, lp_a), (tok_b, lp_b) in zip(triton_out, torch_out):
        assert tok_a == tok_b
        for t, da, db in zip(tok_a, lp_a, lp_b):  # the sampled token's logprob (the top 3 may swap near ties)
            assert db[t].logprob == pytest.approx(da[t].logprob, abs=tol)
            if kv_cache_dtype == "auto":
                assert da.keys() == db.keys()


def test_cuda_platform_defaults_to_triton_and_falls_back_to_torch_with_a_log_line(monkeypatch, caplog):
    from tidal import platforms
    monkeypatch.delenv("TIDAL_ATTENTION_BACKEND", raising=False)
    cuda = platforms.CudaPlatform(torch.device("cuda"))
    assert cuda.attention_backend().name == "triton"
    monkeypatch.setattr(platforms, "triton_available", lambda: False)
    platforms._log_no_triton.cache_clear()
    with caplog.at_level("INFO", logger="tidal.platforms"):
        assert cuda.attention_backend().name == "torch_sdpa"
    assert "triton is not installed" in caplog.text


def test_paged_attention_reads_q_as_a_slice_of_the_fused_qkv_output():
    q, kc, vc, table, qsl, seq_lens, k_scale, v_scale = _batch([1, 4], [5, 3], 4, 2, 16, 4, torch.float32,
                                                               torch.float32)
    qkv = torch.cat([q.reshape(5, -1), torch.randn(5, 2 * 2 * 16)], dim=1).to(DEVICE)  # [T, (Hq + 2 Hk) * D]
    strided = qkv[:, :4 * 16].view(5, 4, 16)
    assert strided.stride(0) == 8 * 16
    want = _reference(q, kc, vc, table, qsl, seq_lens, 0.25, k_scale, v_scale)
    dev = [t.to(DEVICE) for t in (kc, vc, table, qsl, seq_lens)]
    got = paged_attention(strided, *dev, 0.25, 4)
    assert got.is_contiguous()
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_matches_the_product_and_on_a_gpu_does_not_depend_on_the_rows(dtype):
    """Batch-invariant mode's GEMM on CUDA: close to torch's product (ragged M, N and K, bias); on a GPU a
    row's bits are the same alone, in a few rows at another place in the tile, or among 300. (Under the
    interpreter the tile products are numpy's, whose order can depend on a row's place: closeness only.)"""
    from tidal.layers import triton_kernels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(130, 200, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(130, generator=g).to(dtype).to(DEVICE)
    full = triton_kernels.invariant_linear(x, w, bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(full.float(), ref, atol=TOL[dtype] * 20, rtol=TOL[dtype])
    for rows in (slice(0, 1), slice(3, 7), slice(61, 70), slice(250, 300)):
        part = triton_kernels.invariant_linear(x[rows], w, bias)
        torch.testing.assert_close(part.float(), ref[rows], atol=TOL[dtype] * 20, rtol=TOL[dtype])
        if ON_GPU:
            assert torch.equal(part, full[rows]), rows


# -- CUDA graphs of decode steps, with a stand-in for the graph on a CPU ----------------------------

class ReplayedCall:
    """torch.cuda.CUDAGraph's part on a CPU: capture runs the forward once and keeps it; replay runs it again
    under the capture's own forward context and input buffers and writes into the same output tensor. So a
    step reaches the model only through what DecodeGraphs copies into its buffers, as with a real graph."""
    captured: list[int] = []

    def __init__(self, pool) -> None:
        self.forward = self.out = None

    @staticmethod
    def new_pool():
        return None

    def capture(self, forward):
        self.forward, self.out = forward, forward()
        ReplayedCall.captured.append(self.out.shape[0])
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.forward())


def _graph_llm(path, monkeypatch, enforce_eager, **kwargs):
    from tests.helpers import tiny_llm
    from tidal.worker import cuda_graphs
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(cuda_graphs, "device_captures_graphs", lambda device: True)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "graph_cls", ReplayedCall)
    ReplayedCall.captured = []
    return tiny_llm(path, block_size=4, max_num_seqs=8, enforce_eager=enforce_eager, **kwargs)


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    from tidal.worker.cuda_graphs import capture_sizes
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and capture_sizes(4096)[-1] == 512


@pytest.mark.parametrize("case", ["mixed lengths", "preemption and prefix hits"])
def test_decode_graphs_give_the_eager_tokens_and_logprobs(tiny_model_dir, monkeypatch, case):
    """Decode steps replayed from graphs (batches of 1-6 requests padded to the captured 1 / 2 / 4 / 8; their
    padding rows write a scratch block) give the same tokens and logprobs as every step run eagerly: requests
    finishing at different lengths shrink the batch; in the second case a KV cache of 14 blocks preempts
    requests and prompts share prefixes that the cache hits, and the graphs run under asynchronous scheduling
    (each replay's ids written on the device from the step before)."""
    from tests.helpers import assert_engine_idle, random_prompts
    from tidal import SamplingParams
    from tidal.worker import cuda_graphs
    path = tiny_model_dir("llama")
    prompts = random_prompts(6, 3, 12, 256, seed=11)
    kwargs = {}
    if case != "mixed lengths":
        prompts = [prompts[0] + p for p in prompts[:5]]  # a shared first prompt
        kv_bytes = 3 * 2 * 2 * 16 * 4  # per token: layers x (K, V) x kv heads x head_dim x fp32
        kwargs = {"kv_cache_memory_bytes": kv_bytes * 4 * 14, "max_model_len": 48}
    params = [SamplingParams(temperature=0, max_tokens=3 + i if case == "mixed lengths" else 4 + 2 * i,
                             ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    results = {}
    filled = []
    run = cuda_graphs.DecodeGraphs.run
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run",
                        lambda self, step, fill=None: filled.append(fill is not None) or run(self, step, fill))
    for eager in (True, False):
        llm = _graph_llm(path, monkeypatch, eager, async_scheduling=case != "mixed lengths" and not eager, **kwargs)
        graphs = llm.llm_engine.runner.decode_graphs
        assert (graphs is None) == eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert_engine_idle(llm.llm_engine)
        if not eager:
            assert sorted(ReplayedCall.captured) == [1, 2, 4, 8]
            assert graphs.replays >= 5
            if case != "mixed lengths":
                engine = llm.llm_engine
                assert engine.kv_plan.num_blocks == 14
                assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.prefix_hits > 0
                assert sum(filled) >= graphs.replays // 2
            else:
                assert not any(filled)
    for (tok_e, lp_e), (tok_g, lp_g) in zip(results[True], results[False]):
        assert tok_e == tok_g
        for t, a, b in zip(tok_e, lp_e, lp_g):
            assert b[t].logprob == pytest.approx(a[t].logprob, abs=1e-5)


def test_decode_graphs_are_off_with_enforce_eager_and_where_the_model_syncs(tiny_model_dir, monkeypatch, tmp_path):
    from tests.test_hybrid import save_tiny_hybrid
    from tidal.worker import cuda_graphs
    llm = _graph_llm(tiny_model_dir("llama"), monkeypatch, enforce_eager=True)
    assert cuda_graphs.unsupported_reason(llm.llm_engine.runner, llm.config) == "enforce_eager is set"
    save_tiny_hybrid("mixtral", str(tmp_path))
    llm = _graph_llm(str(tmp_path), monkeypatch, enforce_eager=False)
    assert llm.llm_engine.runner.decode_graphs is None
    assert "MixtralForCausalLM" in cuda_graphs.unsupported_reason(llm.llm_engine.runner, llm.config)


def test_a_failed_capture_leaves_every_step_eager_with_a_warning(tiny_model_dir, monkeypatch, caplog):
    """A forward the capture cannot take (on a GPU: one that reads a value back) turns graphs off with a
    warning naming the cause; the engine serves as before."""
    def refuse(self, forward):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(ReplayedCall, "capture", refuse)
    with caplog.at_level("WARNING", logger="tidal.worker.cuda_graphs"):
        llm = _graph_llm(tiny_model_dir("llama"), monkeypatch, enforce_eager=False)
    assert "CUDA graphs off" in caplog.text and "not permitted when stream is capturing" in caplog.text
    from tidal import SamplingParams
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert llm.llm_engine.runner.decode_graphs.replays == 0
