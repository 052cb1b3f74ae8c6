"""Shared fixtures: tiny random model folders (built once per session) and the real default model
(SmolLM2-135M-Instruct, fp32), loaded once per session and checked to be left idle by every test; a fresh
cache folder that keeps the native kernels' builds (`cache_dir`)."""
from __future__ import annotations

import os

import pytest

from tests.helpers import assert_engine_idle, save_tiny_model, tiny_config

SMOLLM2_KV_CACHE_BYTES = 128 * 2**20  # 2912 tokens at 46 KB per token (fp32, 30 layers)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """make(arch, seed=0, **config overrides) -> path of a saved tiny random model (cached)."""
    cache: dict[str, str] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides) -> str:
        key = f"{arch}-{seed}-{sorted(overrides.items())!r}"
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            cache[key] = save_tiny_model(path, tiny_config(arch, **overrides), seed=seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def _smollm2_session():
    from tidal import LLM
    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=SMOLLM2_KV_CACHE_BYTES)


@pytest.fixture
def smollm2(_smollm2_session):
    """The default model (loaded once per session); each test must leave it idle with all blocks free."""
    assert_engine_idle(_smollm2_session.llm_engine)
    yield _smollm2_session
    assert_engine_idle(_smollm2_session.llm_engine)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Conversions in a fresh cache folder; the native kernels' builds still from the usual one (linked)."""
    from tidal.native import cache_dir as native_cache
    kernels = os.path.join(native_cache(), "kernels")
    os.makedirs(kernels, exist_ok=True)
    os.makedirs(tmp_path / "cache")
    os.symlink(kernels, tmp_path / "cache" / "kernels")
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path
