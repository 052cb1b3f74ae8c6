"""Prefix caching on a hybrid model: a conversation's second turn with and without the cache.

    .venv/bin/python benchmarks/hybrid_prefix.py                  # 1,000-token first turn
    .venv/bin/python benchmarks/hybrid_prefix.py --turn-tokens 2000

A random-weight Jamba-shaped model (as benchmarks/hybrid.py: hidden 512, 8 layers, one attention
layer in eight, MoE every other layer) is saved to a temporary folder and served by the engine. Turn
one is a prompt of --turn-tokens tokens (+ 16 generated); turn two is turn one's prompt, its answer
and a 32-token question. With prefix caching, turn two restores turn one's attention KV and Mamba
state checkpoint and computes only the rest. Reports each turn's latency (prefill dominated) and
the cached tokens; the outputs of both engines must match.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tidal import LLM, SamplingParams


def save_model(path: str) -> None:
    import transformers
    cfg = transformers.JambaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=32, use_mamba_kernels=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.endswith("A_log"):
                p.normal_(0, 0.02)
    model.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turn-tokens", type=int, default=1000)
    args = ap.parse_args()
    path = tempfile.mkdtemp(prefix="tidal-jamba-")
    save_model(path)
    g = torch.Generator().manual_seed(1)
    turn1 = torch.randint(3, 1024, (args.turn_tokens,), generator=g).tolist()
    question = torch.randint(3, 1024, (32,), generator=g).tolist()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = LLM(path, dtype="float32", enable_prefix_caching=caching, kv_cache_memory_bytes=256 << 20,
                  max_model_len=args.turn_tokens + 64)
        t0 = time.perf_counter()
        first = llm.generate([{"prompt_token_ids": turn1}], params, use_tqdm=False)[0]
        t1 = time.perf_counter()
        turn2 = turn1 + first.outputs[0].token_ids + question
        second = llm.generate([{"prompt_token_ids": turn2}], params, use_tqdm=False)[0]
        t2 = time.perf_counter()
        results[caching] = (second.outputs[0].token_ids, second.num_cached_tokens)
        print(f"prefix caching {'on ' if caching else 'off'}: turn 1 ({len(turn1)} tokens) {t1 - t0:.2f} s, "
              f"turn 2 ({len(turn2)} tokens, {second.num_cached_tokens} cached) {t2 - t1:.2f} s", flush=True)
    assert results[False][0] == results[True][0], "cached and uncached turn 2 differ"


if __name__ == "__main__":
    main()
