"""Batch-invariant mode on and off on MoE and hybrid models: random Jamba- and Mixtral-shaped models of
SmolLM2's width (576, 8 layers, bf16) saved to a temporary folder, 48 requests of 32-255 random tokens
→ 64 tokens each (output tok/s), then one request of 128 tokens (ms per token). Each kind and mode runs
in its own process, off and on alternating.

    python benchmarks/batch_invariance.py [--kinds jamba mixtral] [--rounds 2]

(The default model's figures: benchmarks/host_overhead.py --workload offline|single [--no-batch-invariant].)
Run with the machine otherwise idle; name the CPU (lscpu) beside the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time


def config(kind: str):
    import transformers
    if kind == "jamba":
        return transformers.JambaConfig(
            vocab_size=32000, hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
            num_key_value_heads=3, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=36, use_mamba_kernels=False, max_position_embeddings=4096)
    return transformers.MixtralConfig(
        vocab_size=32000, hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
        num_key_value_heads=3, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)


def save(kind: str, path: str) -> None:
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(kind), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif name.endswith("dt_proj.bias"):
                p.uniform_(-4, -1)
            elif p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(path)


def run(path: str, invariant: bool) -> dict:
    from tidal import LLM, SamplingParams
    llm = LLM(path, dtype="bfloat16", max_model_len=1024, batch_invariant=invariant)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 31000) for _ in range(rng.randrange(32, 256))]}
               for _ in range(48)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    single = time.perf_counter() - t0
    return {"output_tok_s": round(48 * 64 / batch, 1), "single_ms_per_token": round(single / 128 * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["jamba", "mixtral"], choices=["jamba", "mixtral"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--run", nargs=2, metavar=("PATH", "ON"), help=argparse.SUPPRESS)  # one measurement
    args = ap.parse_args()
    if args.run:
        print("RESULT " + json.dumps(run(args.run[0], args.run[1] == "on")), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            path = os.path.join(tmp, kind)
            save(kind, path)
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    out = subprocess.run([sys.executable, __file__, "--run", path, mode], capture_output=True,
                                         text=True, check=True).stdout
                    res = json.loads(out.split("RESULT ", 1)[1])
                    print(f"{kind:8s} mode {mode:3s}: {res['output_tok_s']:7.1f} output tok/s, "
                          f"{res['single_ms_per_token']:6.2f} ms/token single", flush=True)


if __name__ == "__main__":
    main()
