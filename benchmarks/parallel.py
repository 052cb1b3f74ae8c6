"""Tensor / pipeline parallelism: what each rank holds and what the communication costs, plus a paper
estimate for Jamba-1.5-Large on 8 GPUs with INT8 experts (tidal.worker.sizing).

    python benchmarks/parallel.py                       # measure tp=1, tp=2, pp=2 on the default model
    python benchmarks/parallel.py --configs 1x1,1x2,1x3 # TPxPP pairs
    python benchmarks/parallel.py --estimate-only       # only the Jamba-Large estimate (no model run)
    python benchmarks/parallel.py --overhead            # per-step cost of the workers on a tiny model
    python benchmarks/parallel.py --all-reduce          # latency of one all-reduce: gloo vs shared memory

Measured: weight bytes per rank (each worker reports the parameters it built and loaded) and output
tokens/s of a fixed greedy workload. On a machine with few cores this measures the overhead of the
workers and their collectives, not a speed-up. The estimate (tidal.worker.sizing.estimate_memory)
builds the real Tidal Jamba model, quantized with experts_int8, on the meta device with the
tensor-parallel state of rank 0 of 8 set, so parameter shapes and bytes, KV bytes per token and Mamba
state bytes per request come from the same code the engine loads and sizes its caches with.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch


# AI21-Jamba-1.5-Large (398B parameters, 94B active), as in its config.json
def measure(model: str | None, tp: int, pp: int, num_prompts: int, input_len: int, output_len: int,
            dtype: str) -> dict:
    from tidal import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=dtype,
              kv_cache_memory_bytes=256 << 20, max_model_len=1024)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    if tp * pp == 1:
        params = {id(p): p for p in engine.runner.model.parameters()}.values()
        per_rank = [sum(p.numel() * p.element_size() for p in params)]
    else:
        per_rank = [info.weight_bytes for info in engine.executor.worker_infos]
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(100, vocab, (input_len,), generator=g).tolist()}
               for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    engine.shutdown()
    del llm, engine
    gc.collect()
    return {"tp": tp, "pp": pp, "weight_bytes_per_rank": per_rank, "startup_s": round(startup, 1),
            "output_tok_s": round(out_tokens / elapsed, 1), "elapsed_s": round(elapsed, 2),
            # every request decodes at once: one step per output token
            "ms_per_step": round(1000 * elapsed / output_len, 2), "first_tokens": outs[0].outputs[0].token_ids[:8]}


def _all_reduce_rank(rank: int, world: int, port: int, shapes, iterations: int, queue) -> None:
    """One rank of --all-reduce: times the same all-reduces through gloo and through shared memory."""
    from tidal.distributed.shm_all_reduce import SharedMemoryAllReduce
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = torch.distributed.group.WORLD
    shm = SharedMemoryAllReduce.create(group, max(n * h * 4 for n, h, _ in shapes), timeout_s=60.0)
    rows = []
    for n, h, dtype_name in shapes:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(n, h).to(dtype)
        for how in ("gloo", "shm"):
            def op():
                if how == "shm":
                    shm.all_reduce(x)
                else:  # as tensor_model_parallel_all_reduce does without the segment: 16-bit through fp32
                    y = x.float() if x.dtype != torch.float32 else x
                    torch.distributed.all_reduce(y, group=group)
                    if y is not x:
                        x.copy_(y)
            for _ in range(20):
                op()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(iterations):
                op()
            rows.append((f"[{n}, {h}] {dtype_name}", how, 1e6 * (time.perf_counter() - t0) / iterations))
    shm.close()
    torch.distributed.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def all_reduce_latency(world: int = 2, iterations: int = 2000) -> list:
    """Microseconds per all-reduce between `world` processes on this machine, gloo vs shared memory, for a
    decode step's activation (8 tokens), a prefill chunk's and a tiny one, SmolLM2's hidden size (576)."""
    import socket

    import torch.multiprocessing as mp
    shapes = [(8, 64, "float32"), (8, 576, "bfloat16"), (8, 576, "float32"), (512, 576, "bfloat16")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, world, port, shapes, iterations, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    return rows


def tiny_model(path: str) -> str:
    """A 4-layer random Llama small enough that a step is almost all overhead."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def report_estimate(results: dict) -> None:
    """Jamba-1.5-Large with INT8 experts on 8 x 80 GB GPUs, by the engine's own sizing code."""
    from tidal.worker.sizing import bundled_config, describe, estimate_memory
    config = bundled_config("jamba-1.5-large")
    results["jamba_large_estimate"] = []
    for kv in ("auto", "fp8"):
        est = estimate_memory(config, quantization="experts_int8", kv_cache_dtype=kv, tensor_parallel_size=8,
                              device_bytes=80e9)
        results["jamba_large_estimate"].append(est.as_dict())
        print("\n" + describe(est, "Jamba-1.5-Large", 80e9))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--configs", default="1x1,2x1,1x2", help="comma-separated TPxPP pairs")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--estimate-only", action="store_true")
    ap.add_argument("--overhead", action="store_true",
                    help="a tiny random model (fp32) instead: the step time is the workers' overhead")
    ap.add_argument("--all-reduce", action="store_true",
                    help="only the latency of one tensor-parallel all-reduce, gloo vs shared memory")
    ap.add_argument("--world", type=int, default=2, help="processes for --all-reduce")
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args()
    results = {"cpus": len(os.sched_getaffinity(0)), "runs": []}
    if args.all_reduce:
        results["all_reduce_us"] = rows = all_reduce_latency(args.world)
        print(f"{'tensor':>22} {'path':>5} {'us per all-reduce':>18}  ({args.world} processes)")
        for shape, how, us in rows:
            print(f"{shape:>22} {how:>5} {us:>18.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    if args.overhead:
        import tempfile
        args.model, args.dtype = tiny_model(tempfile.mkdtemp(prefix="tidal-tiny-")), "float32"
        if args.configs == ap.get_default("configs"):
            args.configs = "1x1,2x1,1x2,2x2"
    if not args.estimate_only:
        print(f"{'tp':>3} {'pp':>3} {'weights per rank (MB)':>28} {'startup s':>10} {'output tok/s':>13} "
              f"{'ms/step':>8}")
        for pair in args.configs.split(","):
            tp, pp = (int(x) for x in pair.lower().split("x"))
            try:
                r = measure(args.model, tp, pp, args.num_prompts, args.input_len, args.output_len, args.dtype)
            except Exception as e:  # noqa: BLE001 - report the refusal (e.g. heads that cannot split) and go on
                print(f"{tp:>3} {pp:>3}  refused: {str(e).splitlines()[0][:150]}")
                results["runs"].append({"tp": tp, "pp": pp, "error": str(e).splitlines()[0]})
                continue
            results["runs"].append(r)
            mb = ", ".join(f"{b / 1e6:.1f}" for b in r["weight_bytes_per_rank"])
            print(f"{tp:>3} {pp:>3} {mb:>28} {r['startup_s']:>10} {r['output_tok_s']:>13} {r['ms_per_step']:>8}")
        firsts = {tuple(r["first_tokens"]) for r in results["runs"] if "first_tokens" in r}
        print(f"greedy tokens identical across configurations: {len(firsts) == 1}")
    if not args.overhead:
        report_estimate(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
