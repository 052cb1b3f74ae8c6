"""Each engine flag has the effect its name says, through the offline API on tiny models: chunked
prefill on and off give the same outputs, --tokenizer loads another folder's tokenizer, the seed,
the stats log, max_num_seqs, block_size and served_model_name do what they say, and the flags
accepted for vLLM compatibility log what they do. (Refusals are in test_bad_input.py; the CLI side
and docs/cli.md in test_cli.py; the scheduler's side of chunked prefill in test_scheduler.py.)"""
from __future__ import annotations

import contextlib
import logging

import pytest

from tests.helpers import (
    TEST_KV_CACHE_BYTES,
    assert_engine_idle,
    random_prompts,
    save_tiny_model,
    tiny_config,
    tiny_llm,
)
from tidal import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96


@contextlib.contextmanager
def tidal_log():
    """The records the `tidal` loggers emit (they do not propagate to the root logger, so caplog misses them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("tidal")
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)


def _params(i: int) -> SamplingParams:
    if i % 2:  # odd requests sample (seeded), even ones are greedy
        return SamplingParams(temperature=0.9, seed=50 + i, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def _run(llm, prompts):
    """Outputs and the steps' scheduled (request, start, tokens), recorded from the scheduler."""
    scheduler = llm.llm_engine.scheduler
    steps, schedule = [], scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append([(sr.request_id, sr.start_pos, sr.num_tokens, sr.num_prompt_tokens) for sr in batch.scheduled])
        return batch

    scheduler.schedule = recording_schedule
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i) for i in range(len(prompts))],
                            use_tqdm=False)
    finally:
        del scheduler.schedule
    assert_engine_idle(llm.llm_engine)
    return outs, steps


def _same_outputs(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids, x.request_id
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=1e-4)
        if x.prompt_logprobs is not None:  # each prompt token's logprob, position 0 having none
            ids = x.prompt_token_ids
            got = [y.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
            want = [x.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
            assert got == pytest.approx(want, abs=1e-4)


# -- enable_chunked_prefill ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts():
    # long prompts (40 to 80 tokens, over a 16-token budget), two pairs sharing a 40-token prefix
    prompts = random_prompts(8, 40, 80, 512, seed=5)
    prompts[4] = prompts[1][:40] + prompts[4][:10]  # (even: greedy, no prompt logprobs, so it reads the cache)
    prompts[6] = prompts[3][:40] + prompts[6][:30]
    return prompts


@pytest.fixture(scope="module")
def chunked_run(tiny_model_dir, prompts):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                   max_num_batched_tokens=16)
    outs, steps = _run(llm, prompts)
    assert any(start > 0 and start < n_prompt for step in steps for _, start, _, n_prompt in step), "never chunked"
    return outs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_without_chunked_prefill_prompts_run_whole_with_the_chunked_runs_outputs(tiny_model_dir, prompts,
                                                                                 chunked_run, prefix_caching):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                   max_num_batched_tokens=MAX_MODEL_LEN, enable_chunked_prefill=False,
                   enable_prefix_caching=prefix_caching)
    outs, steps = _run(llm, prompts)
    _same_outputs(chunked_run, outs)
    for step in steps:
        assert sum(n for _, _, n, _ in step) <= MAX_MODEL_LEN
        for rid, start, num_tokens, num_prompt in step:
            if start < num_prompt:  # a prefill: from the first uncached token to the end of the prompt
                assert start + num_tokens == num_prompt, (rid, start, num_tokens)
    cached = [o.num_cached_tokens for o in outs]
    if prefix_caching:  # the uncached rest of a prompt that hits the cache is computed whole too
        assert cached[4] == 40 and cached[6] == 40
    else:
        assert not any(cached)


def test_without_chunked_prefill_preempted_requests_recompute_whole(tiny_model_dir, prompts, chunked_run):
    bytes_per_token = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32 of the tiny llama
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                   enable_chunked_prefill=False, kv_cache_memory_bytes=30 * BLOCK_SIZE * bytes_per_token)
    outs, steps = _run(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _same_outputs(chunked_run, outs)
    for step in steps:
        for rid, start, num_tokens, num_prompt in step:
            assert start >= num_prompt or num_tokens >= num_prompt - start, (rid, start, num_tokens)


def test_without_chunked_prefill_the_default_budget_holds_max_model_len(tiny_model_dir):
    """vLLM's defaults on a CPU: 4096 tokens a step for the offline LLM, 2048 for a server's engine; without
    chunked prefill at least max_model_len."""
    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine
    path = tiny_model_dir("llama", max_position_embeddings=8192)
    assert tiny_llm(path, max_model_len=5000, enable_chunked_prefill=False).llm_engine.max_num_batched_tokens == 5000
    assert tiny_llm(path, max_model_len=1000, enable_chunked_prefill=False).llm_engine.max_num_batched_tokens == 4096
    assert tiny_llm(path, max_model_len=3000).llm_engine.max_num_batched_tokens == 4096  # chunked: vLLM's default
    assert tiny_llm(path, max_model_len=3000, max_num_batched_tokens=512).llm_engine.max_num_batched_tokens == 512
    server = dict(model=path, dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, max_model_len=3000)
    assert LLMEngine(EngineConfig(**server)).max_num_batched_tokens == 2048
    assert LLMEngine(EngineConfig(**server, enable_chunked_prefill=False)).max_num_batched_tokens == 3000


# -- tokenizer / tokenizer_mode ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir():
    """The default model's tokenizer folder (its GGUF conversion: tokenizer.json and the chat template)."""
    from tidal.loader.gguf_loader import cached_conversion
    from tidal.loader.loader import default_model_path
    return cached_conversion(default_model_path())


@pytest.fixture(scope="module")
def model_without_tokenizer(tmp_path_factory):
    """A tiny random model with SmolLM2's vocabulary size and no tokenizer files."""
    path = str(tmp_path_factory.mktemp("no-tokenizer"))
    return save_tiny_model(path, tiny_config("llama", vocab_size=49152, max_position_embeddings=256))


def test_tokenizer_is_loaded_from_the_tokenizer_folder(model_without_tokenizer, tokenizer_dir):
    from transformers import AutoTokenizer
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    llm = tiny_llm(model_without_tokenizer, tokenizer=tokenizer_dir)
    tok = llm.get_tokenizer()
    assert tok is not None and tok.encode("The tide comes in.") == reference.encode("The tide comes in.")
    out = llm.generate("The tide comes in", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == reference.encode("The tide comes in")
    assert out.outputs[0].text == reference.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_tokenizer_of_the_worker_path_comes_from_the_tokenizer_folder(model_without_tokenizer, tokenizer_dir):
    """Tensor/pipeline parallel: the driver's tokenizer comes from load_model_meta (no worker started here)."""
    from tidal.config import EngineConfig
    from tidal.worker.executor import load_model_meta
    meta = load_model_meta(EngineConfig(model=model_without_tokenizer, distributed_executor_backend="mp"))
    assert meta.tokenizer is None
    meta = load_model_meta(EngineConfig(model=model_without_tokenizer, tokenizer=tokenizer_dir,
                                        distributed_executor_backend="mp"))
    from transformers import AutoTokenizer
    assert meta.tokenizer.encode("The tide") == AutoTokenizer.from_pretrained(tokenizer_dir).encode("The tide")


def test_tokenizer_mode_slow_loads_a_slow_tokenizer(tiny_model_dir, tmp_path):
    from transformers import ByT5Tokenizer  # a Python tokenizer needing no vocabulary files
    ByT5Tokenizer().save_pretrained(tmp_path)
    llm = tiny_llm(tiny_model_dir("llama"), tokenizer=str(tmp_path), tokenizer_mode="slow")
    assert not llm.get_tokenizer().is_fast
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids[:3] == [100, 101, 102]  # bytes + 3


# -- seed, stats log, max_num_seqs, block_size, served_model_name, trust_remote_code ----------------------

def test_engine_seed_fixes_unseeded_sampling(tiny_model_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 10, 512, seed=8)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed):
        llm = tiny_llm(tiny_model_dir("llama"), seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, unseeded, use_tqdm=False)]

    first = sample(1)
    assert sample(1) == first
    assert sample(2) != first


def test_stats_line_is_logged_unless_disable_log_stats(tiny_model_dir):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    quiet = tiny_llm(tiny_model_dir("llama"))  # the offline API's default, as vLLM's LLM
    assert quiet.llm_engine.stats_logger is None
    chatty = tiny_llm(tiny_model_dir("llama"), disable_log_stats=False)
    chatty.llm_engine.stats_logger.interval_s = 0  # a line after every busy step
    with tidal_log() as records:
        quiet.generate(prompt, params, use_tqdm=False)
        assert not [r for r in records if "Avg prompt throughput" in r.getMessage()]
        chatty.generate(prompt, params, use_tqdm=False)
    lines = [r.getMessage() for r in records if "Avg prompt throughput" in r.getMessage()]
    assert lines and "Running: 1 reqs" in lines[0]


def test_max_num_seqs_caps_the_running_requests(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"), max_num_seqs=2)
    _, steps = _run(llm, random_prompts(5, 5, 10, 512, seed=9))
    assert max(len(step) for step in steps) == 2


def test_block_size_sets_the_kv_blocks(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=8)
    engine = llm.llm_engine
    assert engine.kv_plan.block_size == engine.kv_manager.block_size == 8
    engine.add_request("r", {"prompt_token_ids": list(range(1, 18))}, SamplingParams(max_tokens=3))
    engine.step()  # the 17 prompt tokens: 3 blocks of 8
    assert engine.kv_manager.num_blocks("r") == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(engine)


def test_served_model_name_names_the_model(tiny_model_dir):
    assert tiny_llm(tiny_model_dir("llama"), served_model_name="tiny").llm_engine.model_name == "tiny"


def test_trust_remote_code_logs_that_no_remote_code_runs(tiny_model_dir):
    with tidal_log() as records:
        tiny_llm(tiny_model_dir("llama"), trust_remote_code=True)
    assert any("never runs code from a checkpoint" in r.getMessage() for r in records)


def test_gpu_memory_utilization_on_cpu_warns_that_it_has_no_effect(tiny_model_dir):
    with tidal_log() as records:
        tiny_llm(tiny_model_dir("llama"), device="cpu", gpu_memory_utilization=0.5)
    assert any(r.levelno == logging.WARNING and "gpu_memory_utilization 0.5 has no effect on CPU" in r.getMessage()
               for r in records)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_the_engine_starts_and_left_as_it_was(tiny_model_dir, monkeypatch, enabled):
    """Python's cyclic collector is off while the engine loads (docs/cpu.md, "Start-up"), back to the
    caller's setting after, also when the start fails."""
    import gc

    from tidal.engine import llm_engine
    seen, fail = [], []
    start = llm_engine.LLMEngine._start

    def spy(self, config):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("start failed")
        return start(self, config)

    monkeypatch.setattr(llm_engine.LLMEngine, "_start", spy)
    path = tiny_model_dir("llama")
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        llm = tiny_llm(path)
        assert seen == [False] and gc.isenabled() is enabled
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
        fail.append(True)
        with pytest.raises(RuntimeError, match="start failed"):
            tiny_llm(path)
        assert seen == [False, False] and gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def _resident_pages(t) -> tuple[int, int]:
    """(resident, all) pages of the host memory under a contiguous CPU tensor (mincore)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    n = -(-(end - start) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), n


def _resident(t) -> bool:
    resident, total = _resident_pages(t)
    return resident == total


def _kernel_before_5_14() -> bool:
    import platform
    import re
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    return platform.system() != "Linux" or release < (5, 14)


def test_commit_pages_faults_in_every_page_and_keeps_what_was_written():
    import torch

    from tidal.device import commit_pages, lazy_zeros
    t = lazy_zeros((4 << 20,), torch.uint8, "cpu")
    t[:100] = 7
    t[-1] = 9
    resident, total = _resident_pages(t)
    assert resident < total  # the untouched pages are not committed yet
    if not commit_pages(t):  # only a kernel without MADV_POPULATE_WRITE may refuse, and it changes nothing
        assert _kernel_before_5_14() and _resident_pages(t)[0] == resident
        return
    assert _resident_pages(t) == (total, total)
    assert t[:100].eq(7).all() and t[-1] == 9 and t[100:-1].eq(0).all()


def test_commit_kv_cache_commits_every_layers_cache_and_changes_no_output(tiny_model_dir):
    prompts = random_prompts(4, 5, 40, 512, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    lazy = tiny_llm(tiny_model_dir("llama"))
    caches = [a.kv_cache for a in lazy.llm_engine.runner.attn_layers]
    assert not any(_resident(c) for c in caches)  # left to the first writes
    expected = [o.outputs[0].token_ids for o in lazy.generate(prompts, params, use_tqdm=False)]
    with tidal_log() as records:
        committed = tiny_llm(tiny_model_dir("llama"), commit_kv_cache=True)
    caches = [a.kv_cache for a in committed.llm_engine.runner.attn_layers]
    if _kernel_before_5_14():
        assert any(r.levelno == logging.WARNING and "not committed" in r.getMessage() for r in records)
    else:
        assert all(_resident(c) for c in caches)
        assert any("KV cache memory committed" in r.getMessage() and "warm-up forward" in r.getMessage()
                   for r in records)
    assert [o.outputs[0].token_ids for o in committed.generate(prompts, params, use_tqdm=False)] == expected


def test_commit_kv_cache_must_be_a_bool_or_none(tiny_model_dir):
    with pytest.raises(ValueError, match="commit_kv_cache must be True, False or None .*, got 'yes'"):
        tiny_llm(tiny_model_dir("llama"), commit_kv_cache="yes")


def _idle_engine(path: str, **kwargs):
    from tests.helpers import TEST_KV_CACHE_BYTES
    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
                                  max_model_len=512, **kwargs))


def test_the_idle_committer_goes_in_block_order_only_while_idle_and_at_the_lowest_priority(monkeypatch):
    """device.IdleCommitter: each thread commits its layers' K and V a chunk of blocks at a time from block 0
    up (the order the pool hands out never-used blocks), every block once; nothing while not idle; its
    threads run at SCHED_IDLE; the pages end up resident with their contents kept."""
    import os
    import threading

    import torch

    from tidal import device
    from tidal.device import IdleCommitter, lazy_zeros
    caches = [lazy_zeros((2, 40, 2, 16, 32), torch.float32, "cpu") for _ in range(3)]
    caches[1][1, 39] = 5.0  # written before the commit: kept
    calls, policies, real = [], set(), device.commit_pages
    gate = threading.Event()

    def commit(part):
        gate.wait()
        policies.add(os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None)
        calls.append((threading.current_thread().name, part.data_ptr()))
        return real(part)
    monkeypatch.setattr(device, "commit_pages", commit)
    committer = IdleCommitter(caches, num_blocks=40, num_threads=2, chunk=8)
    committer.set_idle(False)
    assert not committer._threads  # nothing starts before the engine is first idle
    committer.set_idle(True)
    committer.set_idle(False)  # busy again: the threads stop at their next chunk
    gate.set()
    assert not committer.done.wait(0.3) and len(calls) <= 2 * 2 * 2  # at most the chunk each had begun
    committer.set_idle(True)
    assert committer.done.wait(30)
    assert committer.committed_blocks == (0 if committer.failed else 40)
    if committer.failed:  # a kernel before 5.14: nothing committed, the cache stays lazy
        assert _kernel_before_5_14()
        return
    if hasattr(os, "SCHED_IDLE"):
        assert policies == {os.SCHED_IDLE}
    starts = {}
    for name, ptr in calls:
        starts.setdefault(name, []).append(ptr)
    assert len(starts) == 2
    for ptrs in starts.values():  # per thread: its layers' K then V, chunk after chunk, in block order
        per_chunk = len(ptrs) // 5
        chunks = [ptrs[i:i + per_chunk] for i in range(0, len(ptrs), per_chunk)]
        assert all(b[0] > a[0] for a, b in zip(chunks, chunks[1:]))
    assert len(calls) == len(set(p for _, p in calls)) == 3 * 2 * 5  # layers x (K, V) x chunks, each once
    assert all(_resident(c) for c in caches)
    assert caches[1][1, 39].eq(5.0).all() and caches[1][0].eq(0).all()


def test_a_server_engine_loop_commits_the_cache_while_idle_and_serves_the_same_outputs(tiny_model_dir):
    """AsyncLLM's loop (a server's engine) has the cache committed in the background between requests, and a
    request that arrives meanwhile gets the offline engine's tokens; with commit_kv_cache False the pages are
    left to the writes, with True there is nothing left to commit; the offline LLM never starts it."""
    import asyncio
    import time

    from tidal.engine.async_llm import AsyncLLM
    prompts = random_prompts(3, 5, 40, 512, seed=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    offline = tiny_llm(tiny_model_dir("llama"), max_model_len=512)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    assert not offline.llm_engine._committer._threads  # no idle loop offline: nothing committed ahead

    async def run(llm):
        async def one(i):
            tokens = []
            async for out in llm.generate(prompts[i], params, f"r{i}"):
                tokens += out.outputs[0].token_ids if out.outputs else []
            return tokens
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    for setting in (None, False, True):
        engine = _idle_engine(tiny_model_dir("llama"), commit_kv_cache=setting)
        caches = [a.kv_cache for a in engine.runner.attn_layers]
        llm = AsyncLLM(engine)
        try:
            with tidal_log() as records:
                assert asyncio.run(run(llm)) == expected  # from the first moment, while it may be committing
                if setting is None:
                    assert engine._committer.done.wait(30)
                    time.sleep(0.1)  # the log line comes after
            reserved = [r.getMessage() for r in records if "Activation memory" in r.getMessage()]
            # the first idle moment also writes the activation scratch of a step as large as the budget, once
            assert len(reserved) == (setting is None), reserved
            if setting is None and not _kernel_before_5_14():
                assert all(_resident(c) for c in caches), "the idle loop committed the whole cache"
                assert any("committed while the engine was idle" in r.getMessage() for r in records)
            elif setting is not True:
                time.sleep(0.3)
                assert not any(_resident(c) for c in caches), "only the requests' blocks were written"
                assert engine._committer is None or engine._committer.failed
            else:
                assert engine._committer is None  # committed at start-up already
            assert asyncio.run(run(llm)) == expected
        finally:
            llm.shutdown()


def test_commit_kv_cache_on_cuda_says_it_has_no_effect_there():
    from types import SimpleNamespace

    from tidal.engine.llm_engine import LLMEngine
    config = SimpleNamespace(trust_remote_code=False, device="cuda", gpu_memory_utilization=0.9, commit_kv_cache=True)
    with tidal_log() as records:
        LLMEngine._log_accepted_flags(SimpleNamespace(config=config))
    assert any(r.levelno == logging.WARNING and "commit_kv_cache has no effect on cuda" in r.getMessage()
               for r in records)
