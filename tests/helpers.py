"""Tiny random models for numerical tests: built from a config with a fixed seed and saved as
safetensors to a folder, so the real loading path runs."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import torch

TINY_COMMON = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def load_benchmark(name: str):
    """A script of benchmarks/ (not a package) loaded as a module: load_benchmark("perplexity"),
    load_benchmark("peers/make_q8_0_gguf")."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(arch: str, **overrides):
    import transformers
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[arch]
    kw = dict(TINY_COMMON)
    kw.update(overrides)
    return cfg_cls(**kw)


def save_tiny_model(path: str, config, seed: int = 0) -> str:
    """Build a random-weight HF model from config (seeded), save it to path and return path."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF's init is tiny for some params; widen it so logits are not flat
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):  # biases too: HF zeroes them, which would hide bias bugs
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    os.makedirs(path, exist_ok=True)
    return path


def hf_model(path: str):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


# -- engine-side helpers (shared by the correctness, sampling and bad-input tests) ---------------------
TEST_KV_CACHE_BYTES = 16 * 2**20  # the default KV budget is 4 GiB: far too slow to allocate per test


def tiny_llm(path: str, **kwargs):
    """An LLM on a tiny model folder, fp32, with a small KV cache unless told otherwise."""
    from tidal import LLM
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("kv_cache_memory_bytes", TEST_KV_CACHE_BYTES)
    return LLM(path, **kwargs)


def hf_prompt_logprobs(hf, ids: list[int]) -> list[float]:
    """transformers' full-sequence log-probability of each prompt token after the first."""
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def hf_greedy(hf, ids: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """transformers' greedy continuation (exactly max_new_tokens long when ignore_eos)."""
    kw = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def assert_engine_idle(engine) -> None:
    """No request left anywhere and every KV block back in the pool."""
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.states, list(engine.output_processor.states)
    pool = engine.kv_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def engine_core_process_flag() -> list[str]:
    """The serve flag TIDAL_TEST_ENGINE_CORE_PROCESS asks for: 0 runs the engine in the server's process
    (--no-engine-core-process), 1 in its own (--engine-core-process); unset, the default (its own)."""
    choice = os.environ.get("TIDAL_TEST_ENGINE_CORE_PROCESS")
    return {"0": ["--no-engine-core-process"], "1": ["--engine-core-process"]}.get(choice, [])


@contextlib.contextmanager
def running_server(serve_args: list[str], log_path, startup_timeout: float):
    """A real `tidal serve` process on a free 127.0.0.1 port: yields (process, base URL) once /health
    answers, fails the test with the server's log if it dies or is not ready in time, stops it after.
    TIDAL_TEST_ENGINE_CORE_PROCESS=0 runs every such server with its engine in process (see
    engine_core_process_flag)."""
    import httpx
    import pytest
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TIDAL_API_KEY", None)
    cmd = [sys.executable, "-m", "tidal.entrypoints.cli", "serve", *serve_args, "--host", "127.0.0.1",
           "--port", str(port)]
    cmd += engine_core_process_flag()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    try:
        while True:  # readiness: poll /health until the server answers (or dies)
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in {startup_timeout} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        yield proc, base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WorkerMirror:
    """What a worker holds of each request, rebuilt from the scheduler's deltas alone (as
    tidal/worker/input_batch.py does): checks that the deltas carry everything a step needs."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}

    def apply(self, so) -> None:
        for rid in (*so.finished_ids, *so.preempted_ids):
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        for sr in so.scheduled:
            if sr.new is not None:
                self.tokens[sr.request_id], self.blocks[sr.request_id] = [], []
            assert sr.request_id in self.tokens, f"{sr.request_id} scheduled as running but never sent whole"
            if sr.num_rolled_back_blocks:
                del self.blocks[sr.request_id][-sr.num_rolled_back_blocks:]
            self.tokens[sr.request_id] += sr.new_token_ids
            self.blocks[sr.request_id] += sr.new_block_ids

    def step_tokens(self, sr) -> list[int]:
        """The tokens whose KV sr computes (known tokens, then drafts)."""
        known = self.tokens[sr.request_id][sr.start_pos:]
        return (known + sr.spec_token_ids)[:sr.num_tokens]
