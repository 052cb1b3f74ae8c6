"""Speculative decoding through the public API: `speculative_config` (validated, refused by field
name), `--speculative-config` on the command line, and outputs identical with and without
speculation - greedy and seeded requests in one batch, under chunked prefill, prefix caching,
preemption and tensor parallelism."""
from __future__ import annotations

import argparse
import json

import pytest

from tests.helpers import assert_engine_idle, random_prompts, tiny_llm
from tidal import SamplingParams
from tidal.config import EngineConfig
from tidal.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tidal.spec_decode.config import SpeculativeConfig

# always run what the proposer finds, so every test exercises drafts whatever the step costs
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "adaptive": False}
DRAFT_SELF = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
BLOCK_SIZE = 4
MAX_TOKENS = 24
BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4  # the tiny llama: layers x (K, V) x kv heads x head_dim x fp32
NUM_BLOCKS = 40


# -- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("config", "field"), [
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "speculative_config.adaptive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field.*lookahead"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int3"},
     "speculative_config.quantization"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "hf_overrides": {"num_hidden_layers": 0}},
     "speculative_config.hf_overrides.num_hidden_layers"),
    ("{not json", "speculative_config is not valid JSON"),
    (["ngram"], "speculative_config must be a dict"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=config)


def test_prompt_lookup_defaults_follow_vllm():
    assert (SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min,
            SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_max) == (5, 5)
    one = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)


def test_command_line_flag_parses_json_into_the_engine_config():
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'])
    spec = engine_config_from_args(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 4, 2, 4)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_config_from_args(parser.parse_args(["--speculative-config", '{"method": "ngram"}']))


# -- same outputs with and without speculation -------------------------------------------------------
def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (so prompt lookup finds drafts) and plain random ones."""
    looped = [(p * 5)[:40] for p in random_prompts(6, 4, 9, 512, seed=21)]
    return looped + random_prompts(4, 6, 30, 512, seed=22)


def _params(i: int) -> SamplingParams:
    kind = i % 4
    if kind == 1:  # seeded random sampling with the full set of filters, two samples
        return SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=7 + i, max_tokens=MAX_TOKENS,
                              ignore_eos=True, n=2)
    if kind == 2:  # penalties see the drafts before each row as outputs
        return SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=MAX_TOKENS,
                              ignore_eos=True, logprobs=2)
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS - kind, ignore_eos=True)


def _generate(llm, prompts):
    # every prompt twice: the second copy hits the prefix cache when it is on
    inputs = [{"prompt_token_ids": p} for p in prompts] * 2
    return llm.generate(inputs, [_params(i) for i in range(len(prompts))] * 2, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=128)
    return _generate(llm, _prompts())


ENGINES = {
    "chunked-prefill": {"max_num_batched_tokens": 32},
    "no-prefix-caching": {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
    "preemption": {"max_num_batched_tokens": 32, "kv_cache_memory_bytes": NUM_BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN},
    # the draft policy deciding per step (the tiny model's steps cost about the same at any size)
    "adaptive-policy": {"max_num_batched_tokens": 32, "speculative_config": dict(SPEC, adaptive=True)},
    # a draft model: the target's own checkpoint (its drafts are the target's argmax), under preemption
    "draft-model-self": {"max_num_batched_tokens": 32, "speculative_config": DRAFT_SELF,
                         "kv_cache_memory_bytes": NUM_BLOCKS * BLOCK_SIZE * BYTES_PER_TOKEN},
    # its first layer with the shared embedding and head: drafts partly right
    "draft-model-first-layer": {"max_num_batched_tokens": 32, "speculative_config": dict(
        DRAFT_SELF, hf_overrides={"num_hidden_layers": 1})},
}


@pytest.mark.parametrize("engine_kwargs", ENGINES.values(), ids=ENGINES.keys())
def test_outputs_are_identical_with_speculation(tiny_model_dir, reference, engine_kwargs):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=128,
                   **{"speculative_config": SPEC, **engine_kwargs})
    engine = llm.llm_engine
    outs = _generate(llm, _prompts())
    for i, (got, want) in enumerate(zip(outs, reference, strict=True)):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], f"request {i} changed"
        if want.outputs[0].logprobs:
            assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)
    stats = engine.stats
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.spec_num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.spec_num_accepted_tokens
    if "kv_cache_memory_bytes" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0
    if engine_kwargs.get("speculative_config") is DRAFT_SELF:  # plain greedy requests: drafts are their argmax
        greedy = [o.metrics for i, o in enumerate(outs) if i % len(_prompts()) % 4 in (0, 3)]
        assert sum(m.num_accepted_tokens for m in greedy) >= 0.9 * sum(m.num_draft_tokens for m in greedy) > 0
    proposer = engine.proposer
    if hasattr(proposer, "kv"):  # the draft's cache: every mirror dropped once its request finished
        if "kv_cache_memory_bytes" not in engine_kwargs:  # the second copy of each prompt hits its prefix cache
            assert proposer.kv.prefix_hits > 0
        proposer.propose_batch([], set())
        proposer.kv.pool.check_invariants()
        assert proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_blocks
        # the draft model's forwards count as model time of the steps, beside the target's
        assert engine.stats.step_time_s > engine.stats.model_time_s > proposer.model_time_s > 0
    if engine_kwargs.get("enable_prefix_caching", True):
        assert engine.stats.prefix_hits > 0
    assert_engine_idle(engine)


@pytest.mark.parametrize("spec,parallel", [(SPEC, {"tensor_parallel_size": 2}),
                                           (DRAFT_SELF, {"tensor_parallel_size": 2}),
                                           (SPEC, {"pipeline_parallel_size": 2})],
                         ids=["tp2-ngram", "tp2-draft-model", "pp2-ngram"])
def test_tensor_parallel_outputs_are_identical_with_speculation(tiny_model_dir, reference, monkeypatch, spec,
                                                                parallel):
    """A TP=2 or PP=2 target (a draft model runs whole in the engine's process)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=128, speculative_config=spec,
                   max_num_batched_tokens=32, **parallel)
    try:
        outs = _generate(llm, _prompts())
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in reference]
        assert llm.llm_engine.stats.spec_num_accepted_tokens > 0
    finally:
        llm.llm_engine.shutdown()


def test_bench_throughput_takes_the_speculative_config(tiny_model_dir, tmp_path):
    from tests.test_cli import tidal_cli
    out_json = tmp_path / "result.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": false}'
    proc = tidal_cli("bench", "throughput", "--model", tiny_model_dir("llama"), "--dataset", "random",
                     "--num-prompts", "4", "--input-len-range", "24", "48", "--output-len-range", "8", "16",
                     "--kv-cache-memory-bytes", "4194304", "--speculative-config", spec, "--output-json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    tidal = json.loads(out_json.read_text())["tidal"]
    assert tidal["exact_lengths"] and tidal["spec_draft_tokens"] > 0
    bad = tidal_cli("bench", "throughput", "--model", tiny_model_dir("llama"), "--num-prompts", "1",
                    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}')
    assert bad.returncode != 0 and "speculative_config.num_speculative_tokens" in bad.stderr


def test_draft_models_that_cannot_serve_are_refused_naming_the_field(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    other_vocab = tiny_model_dir("llama", vocab_size=256)
    for model, why in ((other_vocab, "vocabulary"), (str(tmp_path / "missing"), "does not exist")):
        with pytest.raises(ValueError, match=f"speculative_config.model: .*{why}"):
            tiny_llm(target, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 2})


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_draft_model_catch_up_is_the_tokens_the_draft_has_not_seen(tiny_model_dir, num_drafts):
    llm = tiny_llm(tiny_model_dir("llama"), block_size=BLOCK_SIZE, max_model_len=128,
                   speculative_config=dict(DRAFT_SELF, num_speculative_tokens=num_drafts))
    proposer = llm.llm_engine.proposer
    computed = []
    execute = proposer.runner.execute

    def spy(so):
        computed.append(sum(sr.num_tokens for sr in so.scheduled))
        return execute(so)

    proposer.runner.execute = spy
    (out,) = llm.generate([{"prompt_token_ids": _prompts()[0]}], SamplingParams(temperature=0, max_tokens=13,
                                                                                ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.stats
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0, "its own argmax: all accepted"
    # the first forward takes the prompt and the first token; afterwards the last draft (whose KV the
    # draft never computes) and the target's bonus token, then one token per further draft: every
    # position is computed once, the accepted drafts' KV kept
    prompt_len = len(_prompts()[0])
    assert computed[0] == prompt_len + 1 and max(computed[1:]) == 2
    assert sum(computed) <= prompt_len + len(out.outputs[0].token_ids) + num_drafts


def test_the_server_speculates_and_reports_it(tmp_path):
    """`tidal serve --speculative-config` (the default model, n-gram): a request whose answer copies its
    prompt runs drafts, its completion has every token asked for, and /metrics counts the drafts."""
    import httpx

    from tests.helpers import running_server
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    args = ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "512", "--speculative-config", spec,
            "--disable-log-requests", "--uvicorn-log-level", "warning"]
    text = "one two three four five six seven eight nine ten " * 6
    with running_server(args, tmp_path / "server.log", 240) as (_, base):
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": text, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
        metrics = httpx.get(f"{base}/metrics").text
    drafted = [float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("tidal:spec_decode_num_draft_tokens_total")]
    accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("tidal:spec_decode_num_accepted_tokens_total")]
    assert drafted and drafted[0] > 0 and accepted and accepted[0] > 0, metrics[-2000:]
