"""A hybrid model behind the OpenAI-compatible server: `tidal serve` on a tiny random Jamba (with
SmolLM2's tokenizer, so text goes in and out) driven by the official `openai` client. Streamed
completions must equal non-streamed ones and the offline engine's greedy tokens."""
from __future__ import annotations

import openai
import pytest

from tests.helpers import running_server
from tidal import LLM, SamplingParams

PROMPT = "The tide comes in and"
STARTUP_TIMEOUT = 180


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
    args = [jamba_dir, "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "256",
            "--max-num-batched-tokens", "16", "--dtype", "float32", "--served-model-name", "jamba",
            "--uvicorn-log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("server") / "server.log", STARTUP_TIMEOUT) as (_, base):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_streamed_completion_equals_non_streamed_and_offline(client, jamba_dir):
    kw = {"model": "jamba", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole
    offline = LLM(jamba_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
                  max_num_batched_tokens=16).generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))
    assert whole == offline[0].outputs[0].text
    assert whole  # the random model still produces some text
