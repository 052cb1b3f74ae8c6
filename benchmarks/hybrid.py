"""Hybrid (Jamba-shaped) vs attention-only decode: KV bytes per token, memory and decode throughput
vs context length, requests that fit in a fixed budget, and prefill of one Mamba layer vs one
attention layer.

    .venv/bin/python benchmarks/hybrid.py                    # 1k, 4k, 16k context, batch 8
    .venv/bin/python benchmarks/hybrid.py --contexts 1024 --steps 3 --json out.json

Both models are random-weight JambaForCausalLM stacks of the same width and depth with the same
feed-forwards (MoE every other layer); the Jamba-shaped one has one attention layer in eight (as
Jamba), the other attention everywhere. Decode is timed through the real ModelRunner at a context
length without computing the prefill first: each request's KV blocks and Mamba state slot are
filled with random values (the step's cost does not depend on their contents), so a 16k-token
context costs no 16k-token prefill on a CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tidal.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from tidal.forward_context import ForwardContext, set_forward_context
from tidal.layers.attention.backends import PrefillChunk, TorchMetadata, TorchSDPABackend
from tidal.layers.attention.layer import kv_cache_shape
from tidal.layers.mamba import MambaMixer
from tidal.models.jamba import JambaAttention, JambaForCausalLM
from tidal.sampling_params import SamplingParams
from tidal.worker.memory import plan_state_slots
from tidal.worker.model_runner import ModelRunner

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)


def model_config(attention_everywhere: bool, layers: int, hidden: int):
    import transformers
    return transformers.JambaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        attn_layer_period=1 if attention_everywhere else 8, attn_layer_offset=0 if attention_everywhere else 4,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=hidden // 16, use_mamba_kernels=False)


def random_model(config) -> JambaForCausalLM:
    torch.manual_seed(0)
    model = JambaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.arange(1, p.shape[1] + 1, dtype=p.dtype)).expand_as(p))
            elif name.endswith(("norm.weight", ".D")):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model


def decode_tok_s(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """Decode tokens per second of `batch` requests that each already hold `context` tokens."""
    blocks_per_req = -(-(context + steps + 1) // BLOCK)
    runner.allocate_kv_cache(batch * blocks_per_req)
    for a in runner.attn_layers:
        a.kv_cache.normal_()
    if runner.mamba_layers:
        runner.allocate_state(batch)
        for m in runner.mamba_layers:
            m.conv_state.normal_()
            m.ssm_state.normal_()
    mamba = bool(runner.mamba_layers)
    # the first step hands the runner each request whole (context + 1 tokens, its blocks); later steps
    # only the token sampled before, as the scheduler does
    reqs = [ScheduledRequest(str(i), 1, context, True, context + 1, new_token_ids=[7] * (context + 1),
                             new_block_ids=list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
                             new=NewRequestData(GREEDY, context + 1, i if mamba else None)) for i in range(batch)]
    times = []
    for step in range(steps + 1):  # the first step warms up
        t0 = time.perf_counter()
        runner.execute(SchedulerOutput(scheduled=reqs, num_batched_tokens=batch))
        times.append(time.perf_counter() - t0)
        reqs = [ScheduledRequest(r.request_id, 1, r.start_pos + 1, True, context + 1, new_token_ids=[7])
                for r in reqs]
    runner.execute(SchedulerOutput(scheduled=[], num_batched_tokens=0, finished_ids=[r.request_id for r in reqs]))
    runner.allocate_kv_cache(0)
    return batch / statistics.median(times[1:])  # median: the machine may be shared


def layer_prefill_tok_s(layer: torch.nn.Module, hidden: int, tokens: int, repeats: int) -> float:
    """One attention or Mamba layer over a fresh `tokens`-token prompt (its own forward context)."""
    num_blocks = -(-tokens // BLOCK)
    if isinstance(layer, MambaMixer):
        layer.allocate_state(1)
    else:
        a = layer.attn
        a.kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, a.num_kv_heads, a.head_dim))
    meta = ForwardContext(num_tokens=tokens, num_decodes=0, query_start_loc=[0, tokens],
                          state_slots=torch.tensor([0]), has_initial_state=torch.tensor([False]))
    if not isinstance(layer, MambaMixer):
        backend = TorchSDPABackend()
        meta.attn_backend = backend
        meta.attn_metadata = TorchMetadata(slot_mapping=torch.arange(tokens), num_decodes=0, decode_tables=None,
                                           decode_seq_lens=None, decode_max_seq_len=0,
                                           prefills=[PrefillChunk(0, tokens, 0, torch.arange(num_blocks))])
    x = torch.randn(tokens, hidden)
    times = []
    with torch.inference_mode(), set_forward_context(meta):
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps per point (after one warm-up)")
    ap.add_argument("--budget-gib", type=float, default=4.0, help="cache budget for the max-concurrency column")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's cap on running requests")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    results: dict = {"args": vars(args), "models": {}}
    budget = int(args.budget_gib * 2**30)
    for name, everywhere in (("jamba-shaped", False), ("attention-only", True)):
        cfg = model_config(everywhere, args.layers, args.hidden)
        model = random_model(cfg)
        runner = ModelRunner(model, torch.float32, BLOCK, max_num_seqs=args.batch,
                             max_model_len=max(args.contexts) + args.steps + 2, max_num_batched_tokens=args.batch)
        kv, state = runner.kv_bytes_per_token(), runner.state_bytes_per_request()
        row = {"attention_layers": len(runner.attn_layers), "mamba_layers": len(runner.mamba_layers),
               "kv_bytes_per_token": kv, "state_bytes_per_request": state,
               "weights_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, "points": []}
        print(f"{name}: {row['attention_layers']} attention + {row['mamba_layers']} Mamba layers, "
              f"KV {kv} B/token, state {state} B/request, weights {row['weights_mib']:.0f} MiB", flush=True)
        for ctx in args.contexts:
            per_request = ctx * kv + state
            fit = budget // per_request  # the memory layout's limit
            # the engine's split: state slots for up to max_num_seqs requests first, the rest for KV
            slots = plan_state_slots(state, args.max_num_seqs, budget, kv > 0) if state else args.max_num_seqs
            engine_fit = min(slots, (budget - (slots * state if state else 0)) // (ctx * kv), args.max_num_seqs)
            tok_s = decode_tok_s(runner, args.batch, ctx, args.steps)
            row["points"].append({"context": ctx, "cache_mib_batch": args.batch * per_request / 2**20,
                                  "max_concurrent": fit, "max_concurrent_engine": engine_fit, "decode_tok_s": tok_s})
            print(f"  context {ctx:6d}: cache for batch {args.batch} {args.batch * per_request / 2**20:8.1f} MiB, "
                  f"requests that fit in {args.budget_gib:g} GiB: {fit:6d} (engine, max_num_seqs "
                  f"{args.max_num_seqs}: {engine_fit}), decode {tok_s:7.1f} tok/s", flush=True)
        results["models"][name] = row
        del runner, model

    cfg = model_config(False, args.layers, args.hidden)
    torch.manual_seed(0)
    mamba = MambaMixer(cfg.hidden_size, cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_state, cfg.mamba_d_conv,
                       cfg.mamba_dt_rank, bcdt_rms_eps=cfg.rms_norm_eps)
    attn = JambaAttention(cfg, torch.float32)
    for m in (mamba, attn):
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.fill_(0.0) if name.endswith("A_log") else p.normal_(0, 0.02)
    pm = layer_prefill_tok_s(mamba, cfg.hidden_size, args.prefill_tokens, 3)
    pa = layer_prefill_tok_s(attn, cfg.hidden_size, args.prefill_tokens, 3)
    results["prefill"] = {"tokens": args.prefill_tokens, "mamba_tok_s": pm, "attention_tok_s": pa}
    print(f"prefill of {args.prefill_tokens} tokens, one layer of hidden {args.hidden}: Mamba {pm:.0f} tok/s, "
          f"attention {pa:.0f} tok/s (attention / Mamba = {pa / pm:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
