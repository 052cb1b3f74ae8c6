"""A hybrid model behind the OpenAI-compatible server: `tidal serve` on a tiny random Jamba (with
SmolLM2's tokenizer, so text goes in and out) driven by the official `openai` client. Streamed
completions must equal non-streamed ones and the offline engine's greedy tokens."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tidal import LLM, SamplingParams

PROMPT = "The tide comes in and"
STARTUP_TIMEOUT = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jamba_dir(tmp_path_factory):
    """A tiny random Jamba with SmolLM2's tokenizer (vocabulary 49152) saved beside it."""
    import transformers

    from tests.test_hybrid import save_tiny_hybrid, tiny_hybrid_config
    from tidal.loader.gguf_loader import load_gguf_tokenizer
    from tidal.loader.loader import default_model_path
    path = str(tmp_path_factory.mktemp("jamba-served"))
    tokenizer = load_gguf_tokenizer(default_model_path())
    cfg = tiny_hybrid_config("jamba")
    cfg.vocab_size = len(tokenizer)
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id, 0
    save_tiny_hybrid("jamba", path, config=cfg)
    tokenizer.save_pretrained(path)
    assert isinstance(transformers.AutoConfig.from_pretrained(path), transformers.JambaConfig)
    return path


@pytest.fixture(scope="module")
def client(jamba_dir, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TIDAL_API_KEY", None)
    cmd = [sys.executable, "-m", "tidal.entrypoints.cli", "serve", jamba_dir, "--host", "127.0.0.1",
           "--port", str(port), "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "256",
           "--max-num-batched-tokens", "16", "--dtype", "float32", "--served-model-name", "jamba",
           "--uvicorn-log-level", "warning"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
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
                pytest.fail(f"server not ready in {STARTUP_TIMEOUT} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_streamed_completion_equals_non_streamed_and_offline(client, jamba_dir):
    kw = {"model": "jamba", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole
    offline = LLM(jamba_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
                  max_num_batched_tokens=16).generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))
    assert whole == offline[0].outputs[0].text
    assert whole  # the random model still produces some text
