"""Tensor and pipeline parallelism end to end: tiny random models (fp32) served by 2-4 worker processes
must give the single-process engine's greedy tokens and prompt logprobs; a dead or hung worker must
surface as an error within seconds; nothing may outlive the LLM.

Process start-up is the cost here (each worker imports torch and loads its shard), so each parallel
configuration is built once per module and shared by the tests that need it.
"""
from __future__ import annotations

import gc
import glob
import itertools
import os
import signal
import time

import psutil
import pytest
import torch

from tests.helpers import random_prompts, save_tiny_model, tiny_config
from tidal import LLM, SamplingParams
from tidal.core.scheduler import ScheduledRequest
from tidal.distributed import get_pp_indices
from tidal.layers.linear import HeadShard, split_heads
from tidal.worker.executor import WorkerError
from tidal.worker.worker import split_batch

KV_BYTES = 16 << 20
# a small token budget forces chunked prefill and mixed prefill/decode batches
ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": KV_BYTES, "max_num_batched_tokens": 48, "max_num_seqs": 8}
PROMPTS = random_prompts(6, 4, 40, 512, seed=3)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # workers share the machine's cores with everything else


def _generate(llm):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)


def _assert_same(ref, got):
    for a, b in zip(ref, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"request {a.request_id}: tokens differ"
        worst = 0.0
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            for tok, lp in pa.items():
                worst = max(worst, abs(lp.logprob - pb[tok].logprob))
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for tok, lp in pa.items():
                worst = max(worst, abs(lp.logprob - pb[tok].logprob))
        assert worst < 1e-4, f"request {a.request_id}: logprobs differ by {worst}"


def _model(tmp_path_factory, name, **overrides) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp(name)), tiny_config("llama", **overrides), seed=1)


class _Holder:
    """A shared parallel LLM plus its single-process reference outputs; a test may take the LLM away."""

    def __init__(self, path, **parallel):
        self.ref = _generate(LLM(path, **ENGINE))
        self.llm = LLM(path, **ENGINE, **parallel)
        self.pids = list(self.llm.llm_engine.executor.pids)

    def close(self):
        if self.llm is not None:
            self.llm.llm_engine.shutdown()
            self.llm = None


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    h = _Holder(_model(tmp_path_factory, "llama"), tensor_parallel_size=2)
    yield h
    h.close()


@pytest.fixture(scope="module")
def pp2_tied(tmp_path_factory):
    # tied embeddings split across stages: the last stage keeps its own copy as the LM head
    h = _Holder(_model(tmp_path_factory, "tied", tie_word_embeddings=True), pipeline_parallel_size=2)
    yield h
    h.close()


@pytest.fixture(scope="module")
def tp2_pp2_mqa(tmp_path_factory):
    # one KV head for two tensor-parallel ranks: replicated; four layers over two stages; every rank warms up
    # (one forward through both stages) and commits its KV cache at start-up
    h = _Holder(_model(tmp_path_factory, "mqa", num_key_value_heads=1, num_hidden_layers=4),
                tensor_parallel_size=2, pipeline_parallel_size=2, commit_kv_cache=True)
    yield h
    h.close()


@pytest.fixture(scope="module")
def tp2_uneven(tmp_path_factory):
    # 6 query heads in 3 KV-head groups over two ranks: rank 0 takes 2 KV heads (4 query heads), rank 1 one (2)
    h = _Holder(_model(tmp_path_factory, "uneven", hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
                tensor_parallel_size=2)
    yield h
    h.close()


def _all_gone(pids, timeout=10.0) -> bool:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


# -- pure bookkeeping -------------------------------------------------------------------------------
def test_pp_layer_ranges_cover_every_layer_once():
    for layers in range(1, 9):
        for pp in range(1, layers + 1):
            ranges = [get_pp_indices(layers, r, pp) for r in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(ranges))
    with pytest.raises(ValueError, match="pipeline_parallel_size 4"):
        get_pp_indices(3, 0, 4)


def test_split_batch_keeps_order_and_balances_tokens():
    def req(i, n):
        return ScheduledRequest(str(i), n, 0, True)
    parts = split_batch([req(i, n) for i, n in enumerate([1, 1, 30, 1, 20, 8])], 2)
    assert [r.request_id for p in parts for r in p] == [str(i) for i in range(6)]
    assert [sum(r.num_tokens for r in p) for p in parts] == [32, 29]
    assert [len(p) for p in split_batch([req(0, 100), req(1, 1)], 4)] == [1, 1]
    assert len(split_batch([req(0, 5)], 2)) == 1


def test_heads_split_by_kv_head_group_evenly_unevenly_or_replicated():
    assert split_heads(6, 3, 2) == [HeadShard(0, 4, 0, 2), HeadShard(4, 2, 2, 1)]
    assert split_heads(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    assert split_heads(8, 4, 2) == [HeadShard(0, 4, 0, 2), HeadShard(4, 4, 2, 2)]
    assert split_heads(4, 1, 2) == [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1)]  # one KV head, replicated
    for heads, kv_heads in [(9, 3), (12, 4), (8, 8), (6, 2), (32, 8), (4, 1)]:
        group = heads // kv_heads
        for tp in range(1, heads + 1):
            try:
                shards = split_heads(heads, kv_heads, tp)
            except ValueError:
                assert kv_heads < tp
                continue
            # every query head on exactly one rank, next to the KV heads it attends to
            assert [q for s in shards for q in range(s.q_start, s.q_start + s.num_heads)] == list(range(heads))
            for s in shards:
                assert s.kv_start <= s.q_start // group
                assert (s.q_start + s.num_heads - 1) // group < s.kv_start + s.num_kv_heads
            if kv_heads >= tp:
                assert [s.num_kv_heads for s in shards] == sorted((s.num_kv_heads for s in shards), reverse=True)
                assert shards[0].num_kv_heads - shards[-1].num_kv_heads <= 1
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 cannot split the model's 9 attention heads "
                                         r"\(3 KV heads\).*possible sizes: \[1, 2, 3, 9\]"):
        split_heads(9, 3, 4)


def test_uneven_head_split_loads_every_row_and_column_once(tmp_path_factory):
    """Rank shards of q, k, v (rows) and o_proj (columns) put back together are the checkpoint's."""
    from safetensors.torch import load_file

    from tidal.distributed import set_parallel_state
    from tidal.loader import load_model
    path = _model(tmp_path_factory, "shards", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    ranks = []
    try:
        for r in range(2):
            set_parallel_state(tp_rank=r, tp_size=2)
            ranks.append(load_model(path, "float32").model)
    finally:
        set_parallel_state()
    for i in range(3):
        attn = [m.model.layers[i].self_attn for m in ranks]
        assert [(a.num_heads, a.num_kv_heads) for a in attn] == [(4, 2), (2, 1)]
        q, k, v = zip(*(a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size]) for a in attn))
        prefix = f"model.layers.{i}.self_attn."
        for name, parts in (("q", q), ("k", k), ("v", v)):
            assert torch.equal(torch.cat(parts), ckpt[f"{prefix}{name}_proj.weight"]), name
        assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), ckpt[f"{prefix}o_proj.weight"])


# -- parallel == single process ---------------------------------------------------------------------
def test_tp2_matches_single_process(tp2):
    infos = tp2.llm.llm_engine.executor.worker_infos
    assert [i.layers for i in infos] == [(0, 3), (0, 3)]
    _assert_same(tp2.ref, _generate(tp2.llm))
    stats = tp2.llm.llm_engine.stats  # the output rank's forward and LM head, timed there, came back
    assert stats.step_time_s > stats.model_time_s > 0


def test_tp2_all_reduces_through_shared_memory_and_leave_no_segment_name(tp2):
    infos = tp2.llm.llm_engine.executor.worker_infos
    assert [i.tp_all_reduce for i in infos] == ["shared memory"] * 2
    # the segment is named after the creating rank's pid; the name is unlinked once both ranks mapped it
    assert [p for pid in tp2.pids for p in glob.glob(f"/dev/shm/tidal-allreduce-{pid}-*")] == []


def test_tp2_shards_the_weights(tp2):
    full = sum(p.numel() * 4 for p in LLM(tp2.llm.config.model, **ENGINE).llm_engine.runner.model.parameters())
    per_rank = [i.weight_bytes for i in tp2.llm.llm_engine.executor.worker_infos]
    # everything is split in two except the norms (replicated): each rank holds a little over half
    assert all(0.5 * full < b < 0.52 * full for b in per_rank), (per_rank, full)


def test_tp2_with_heads_split_unevenly_matches_single_process(tp2_uneven):
    _assert_same(tp2_uneven.ref, _generate(tp2_uneven.llm))
    engine = tp2_uneven.llm.llm_engine
    # every rank gets the blocks of rank 0, which holds 2 of the 3 KV heads: 3 layers x K, V x 2 x 16 dims x fp32
    assert engine.kv_plan.bytes_per_token == 3 * 2 * 2 * 16 * 4
    full = LLM(engine.config.model, **ENGINE).llm_engine.runner.model
    replicated = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n)
    # the shards add up to the whole model, plus one more copy of the (replicated) norms
    per_rank = [i.weight_bytes for i in engine.executor.worker_infos]
    assert sum(per_rank) == sum(p.numel() * 4 for p in full.parameters()) + replicated
    assert per_rank[0] > per_rank[1]  # rank 0 holds twice rank 1's attention heads


def test_pp2_tied_embeddings_matches_single_process(pp2_tied):
    infos = pp2_tied.llm.llm_engine.executor.worker_infos
    assert [i.layers for i in infos] == [(0, 2), (2, 3)]
    _assert_same(pp2_tied.ref, _generate(pp2_tied.llm))
    stats = pp2_tied.llm.llm_engine.stats  # pipelined: the model part is the driver's whole execute call
    assert stats.step_time_s > stats.model_time_s > 0


def test_tp2_pp2_replicated_kv_heads_matches_single_process(tp2_pp2_mqa):
    infos = tp2_pp2_mqa.llm.llm_engine.executor.worker_infos
    assert [(i.tp_rank, i.pp_rank, i.layers) for i in infos] == [(0, 0, (0, 2)), (1, 0, (0, 2)),
                                                                 (0, 1, (2, 4)), (1, 1, (2, 4))]
    assert {i.tp_all_reduce for i in infos} == {"shared memory"}  # one segment per stage's group
    # each of the 4 ranks committed its 2 layers' caches (K and V of 1 head of 16 dims, fp32, per token)
    engine = tp2_pp2_mqa.llm.llm_engine
    per_rank = engine.kv_plan.num_blocks * engine.kv_plan.block_size * 2 * 2 * 16 * 4
    assert engine.executor.commit_kv_cache() == 4 * per_rank
    _assert_same(tp2_pp2_mqa.ref, _generate(tp2_pp2_mqa.llm))


# -- failures and shutdown --------------------------------------------------------------------------
def test_killed_worker_is_reported_within_seconds(tp2_pp2_mqa):
    llm = tp2_pp2_mqa.llm
    llm.llm_engine.check_health()
    os.kill(tp2_pp2_mqa.pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 .*died"):
        _generate(llm)
    assert time.monotonic() - t0 < 10
    with pytest.raises(WorkerError):
        llm.llm_engine.check_health()
    assert _all_gone(tp2_pp2_mqa.pids), "the surviving workers were not stopped"


def test_stopped_worker_is_reported_within_seconds(tp2):
    llm = tp2.llm
    os.kill(tp2.pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"rank\(s\) \[1\] are stopped"):
            _generate(llm)
        assert time.monotonic() - t0 < 10
    finally:
        if psutil.pid_exists(tp2.pids[1]):
            os.kill(tp2.pids[1], signal.SIGCONT)
    assert _all_gone(tp2.pids), "a stopped worker was left behind"


def test_worker_that_does_not_answer_is_reported_after_the_timeout(tmp_path_factory, monkeypatch):
    from tidal.worker import executor
    monkeypatch.setenv("TIDAL_EXECUTE_TIMEOUT_S", "1")
    # a spawned worker (python, torch, the shard; not forked from the warm forkserver) takes longer than 1 s
    # to start: it does not answer in time
    monkeypatch.setattr(executor, "_worker_context", lambda: torch.multiprocessing.get_context("spawn"))
    monkeypatch.setattr(executor, "_INIT_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"did not answer init within 1 s \(rank 0: \w+"):
        LLM(_model(tmp_path_factory, "slow"), tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - t0 < 30


def test_deleting_the_llm_leaves_no_process(pp2_tied):
    pids = pp2_tied.pids
    assert all(psutil.pid_exists(p) for p in pids)
    pp2_tied.llm = None  # the only reference
    gc.collect()
    assert _all_gone(pids)


def test_impossible_layouts_are_refused_before_any_worker_starts(tmp_path_factory):
    path = _model(tmp_path_factory, "refused")
    with pytest.raises(ValueError, match="'uni' runs one process"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="uni", **ENGINE)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 cannot split the model's 4 attention heads "
                                         r"\(2 KV heads\).*possible sizes: \[1, 2, 4\]"):
        LLM(path, tensor_parallel_size=3, **ENGINE)


# -- Ray ----------------------------------------------------------------------------------------------
def test_ray_tp2_matches_single_process(tmp_path_factory):
    import ray
    # address="local": always a fresh one-machine cluster, whatever a `ray start` left behind
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        path = _model(tmp_path_factory, "ray")
        ref = _generate(LLM(path, **ENGINE))
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        pids = llm.llm_engine.executor.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids
        # the actors share this machine, which they prove by mapping the same segment
        assert [i.tp_all_reduce for i in llm.llm_engine.executor.worker_infos] == ["shared memory"] * 2
        _assert_same(ref, _generate(llm))
        del llm
        gc.collect()
        assert _all_gone(pids)
    finally:
        ray.shutdown()


# -- Mixtral (MoE experts sharded) and Jamba (Mamba split along its inner dimension) -------------------
# (their pipeline stages: tests/test_hybrid_parallel.py)
@pytest.mark.parametrize("kind", ["mixtral", "jamba"])
def test_tp2_hybrid_and_moe_models_match_single_process(kind, tmp_path_factory):
    from tests.test_hybrid import ENGINE as HYBRID_ENGINE
    from tests.test_hybrid import VOCAB, save_tiny_hybrid
    path = str(tmp_path_factory.mktemp(kind))
    save_tiny_hybrid(kind, path)
    engine = {**HYBRID_ENGINE, "kv_cache_memory_bytes": 4 << 20, "max_num_seqs": 8}
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 3, 40, VOCAB, seed=2)]
    ref = LLM(path, **engine).generate(prompts, PARAMS, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **engine)
    _assert_same(ref, llm.generate(prompts, PARAMS, use_tqdm=False))
    llm.llm_engine.shutdown()


# -- the server -----------------------------------------------------------------------------------------
def test_worker_killed_while_the_engine_is_idle_marks_it_dead_within_seconds(tmp_path_factory):
    """Nothing runs, so no step notices: the idle engine loop looks at its workers every second."""
    import threading

    from tidal.config import EngineConfig
    from tidal.engine.async_llm import AsyncLLM
    from tidal.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=_model(tmp_path_factory, "idle"), tensor_parallel_size=2, **ENGINE))
    died = threading.Event()
    async_llm = AsyncLLM(engine)
    async_llm.on_dead = lambda error: died.set()
    pids = list(engine.executor.pids)
    try:
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        assert died.wait(30)
        assert time.monotonic() - t0 < 5
        assert not async_llm.is_running and "died" in str(async_llm.dead_error)
        assert _all_gone(pids), "the surviving worker was not stopped"
    finally:
        async_llm.shutdown()
        engine.shutdown()


def test_server_exits_1_within_seconds_when_a_worker_dies_leaving_no_process_or_segment(tmp_path_factory):
    """A killed worker while a request streams: the request ends with an error event (no hang), the server
    stops with exit status 1 (for a supervisor to restart it) in under 5 s, and neither a process nor a
    shared-memory segment outlives it."""
    import json
    import socket
    import subprocess
    import sys
    import threading

    import httpx
    path = _model(tmp_path_factory, "served")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "tidal.entrypoints.cli", "serve", path, "--host", "127.0.0.1", "--port", str(port),
           "-tp", "2", "--dtype", "float32", "--kv-cache-memory-bytes", str(KV_BYTES), "--served-model-name", "tiny",
           "--uvicorn-log-level", "warning"]
    from tests.helpers import engine_core_process_flag
    cmd += engine_core_process_flag()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    base, pids, events, started = f"http://127.0.0.1:{port}", [], [], threading.Event()

    def stream():
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    started.set()

    try:
        deadline = time.monotonic() + 180
        while True:  # readiness: poll /health until the server answers (or dies)
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not ready:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.25)
        # the workers: forked by the core's forkserver (tidal/worker/executor.py), whose only children they are
        forkservers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "multiprocessing.forkserver" in " ".join(p.cmdline()) and p.children()]
        assert len(forkservers) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
        workers = forkservers[0].children()
        assert len(workers) == 2, [p.cmdline() for p in workers]
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(60), log_path.read_text()[-4000:]
        workers[1].kill()
        t0 = time.monotonic()
        assert proc.wait(30) == 1, log_path.read_text()[-4000:]
        assert time.monotonic() - t0 < 5
        client.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "died" in error["message"], error
    assert _all_gone(pids), "worker processes outlived the server"
    assert [p for pid in pids for p in glob.glob(f"/dev/shm/tidal-allreduce-{pid}-*")] == []


def test_jamba_large_estimate_runs_on_the_meta_device():
    """benchmarks/parallel.py --estimate-only builds Jamba-1.5-Large's shapes (no memory) and sizes its
    cache with the engine's own code: the published parameter count and, with INT8 experts, weights that fit
    an 80 GB GPU (bf16: 99.6 GB would not)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "parallel.py"
    out = subprocess.run([sys.executable, str(script), "--estimate-only"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "(398.6B parameters)" in out
    assert "quantization experts_int8" in out and "weights per device: 56.2 GB" in out
    assert "2304 B" in out  # fp8 KV: half of bf16's 4608 B per token
