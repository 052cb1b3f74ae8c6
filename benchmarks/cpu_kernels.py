"""Microbenchmarks of the native CPU kernels for each ISA level this CPU runs, on SmolLM2-135M's shapes:

    .venv/bin/python benchmarks/cpu_kernels.py [--isa avx2 avx512_bf16 ...] [--only gemm_bf16|invariant|...]

- GEMM with bf16 weights and fp32 activations (the `dtype auto` path of CPUs without native bf16): the
  packed kernel the engine runs (weights packed at load) and the plain-layout kernel, against torch's
  fp32 GEMM, for 1 to 2,048 rows, summed over one layer's four products, and the LM head.
- The LM head of greedy rows under fp32 activations (`--only greedy`): the int8 screen that finds each row's
  argmax without most of the logits (cpu_kernels.packed_linear_greedy) against the packed product and an
  argmax over its logits, 1 to 256 rows.
- bf16 x bf16 GEMM (AVX-512 BF16: the path of prompt chunks and batches in a bf16 model) on the packed
  weight the engine holds and on the plain weight, against oneDNN's GEMM on its own prepacked copy and on
  the plain weight (F.linear), for 16 to 2048 rows, summed over one layer's four products; the LM head
  alone up to 256 rows (it sees one row per sequence); and a step's products through 30 layers of weights
  of their own (not in the caches) for 64 rows (a decode batch) and 4,096 (an offline prompt step).
- Products with 8-bit weights (tidal/layers/quant_kernels.py) against the bf16 kernels on the same
  shapes, for 1, 4, 16 and 128 rows: int8 and fp8 weights widened in registers under fp32 (W8A16),
  W8A8 (per-token int8 activations, VPDPBUSD or VPMADDUBSW), beside the bf16 skinny kernel (rows <= 4)
  and the blocked one (AVX-512 BF16), and the fp32-activation bf16-weight kernel; a layer's four
  products and the LM head separately, each call on weights not in the caches (as in a decode).
- Batch-invariant mode's products (docs/batch_invariance.md): 1-4 bf16 rows through the skinny kernel in
  the blocked kernel's order against the skinny and blocked kernels (weights not in the caches, best of
  a few rounds); fp32 products through the native fp32 kernel against torch's, 1 to 256 rows.
- Paged attention: 64 decodes over 1,100 cached tokens each (own blocks; sharing their first 1,024
  tokens' blocks, attended in tiles over those, and untiled), and one 64-token prompt chunk over
  1,100 cached tokens (attended in tiles, and per token), fp32 queries over bf16, fp32 and FP8 (E4M3)
  caches and bf16 over bf16 and FP8; one 256-token prompt attending to itself (causal, in tiles); and 128
  decodes over 340 tokens in a cache three times L3 (K/V from memory, as in a serving batch); and a
  saturated engine's decode step: 64 decodes over 320 tokens through 30 layers' caches, each prompt's
  blocks side by side. GFLOP/s count 4 * heads * head_dim per query and cached token.
- The rest of a layer for a prompt of 256 and 2,048 tokens: the two RMSNorms, rotary, the KV write and
  SiLU-and-mul; and the KV write of 128 decodes into a cache far larger than L3 (`--only elementwise`).
Run with the machine otherwise idle; name the CPU (lscpu) beside the figures.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

from tidal.layers import cpu_kernels
from tidal.layers.attention.layer import kv_cache_shape, split_kv_cache
from tidal.native import isa_override, runnable_isas

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate_up, down, lm_head


def timed(fn, n: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def gemm(isa: str) -> None:
    for m in (1, 4, 8, 16, 64, 256, 2048):
        for part, shapes in (("layer", SHAPES[:4]), ("lm head", SHAPES[4:])):
            packed = plain = reference = 0.0
            for n, k in shapes:
                x, w = torch.randn(m, k), torch.randn(n, k).bfloat16()
                wf, wp = w.float(), cpu_kernels.pack_bf16_weight(w)
                rounds = 3 if m * n > 10**7 else 20
                if cpu_kernels.packed_gemm_available(torch.float32):
                    packed += timed(lambda: cpu_kernels.packed_linear(x, wp, n, k, None), rounds)
                plain += timed(lambda: cpu_kernels.linear_f32_bf16w(x, w, None), rounds)
                reference += timed(lambda: F.linear(x, wf), rounds)
            flops = 2 * m * sum(n * k for n, k in shapes)
            line = f"{isa:12s} gemm {part:7s} rows {m:4d}: "
            if packed:
                line += f"packed {packed * 1e3:8.3f} ms ({flops / packed / 1e9:6.1f} GFLOP/s), "
            print(line + f"plain {plain * 1e3:8.3f} ms ({flops / plain / 1e9:6.1f}), torch fp32 "
                  f"{reference * 1e3:8.3f} ms ({flops / reference / 1e9:6.1f}): {reference / (packed or plain):5.2f}x")


def greedy(isa: str) -> None:
    """The LM head of greedy rows under fp32 activations: the int8 screen (packed_linear_greedy) against the
    packed fp32 product and argmax_rows over its logits. Hidden states here are a weight row scaled plus
    noise (one clear winner, as SmolLM2's decodes mostly have: ~12 candidates of 49,152 on average)."""
    n, k = SHAPES[4]
    w = torch.randn(n, k).bfloat16()
    wp, screen = cpu_kernels.pack_bf16_weight(w), cpu_kernels.greedy_screen(w)
    if screen is None:
        return
    for m in (1, 4, 16, 64, 256):
        x = w[torch.randint(0, n, (m,))].float() * 4 + torch.randn(m, k)
        rounds = 5 if m >= 64 else 30
        full = timed(lambda: cpu_kernels.argmax_rows(cpu_kernels.packed_linear(x, wp, n, k, None)), rounds)
        fast = timed(lambda: cpu_kernels.packed_linear_greedy(x, wp, n, k, screen, n), rounds)
        assert cpu_kernels.packed_linear_greedy(x, wp, n, k, screen, n) == cpu_kernels.argmax_rows(
            cpu_kernels.packed_linear(x, wp, n, k, None))
        print(f"{isa:12s} greedy lm head rows {m:4d}: screen {fast * 1e3:7.3f} ms, packed product + argmax "
              f"{full * 1e3:7.3f} ms: {full / fast:5.2f}x")


def gemm_bf16(isa: str) -> None:
    if isa != "avx512_bf16":
        return  # bf16 activations are not what dtype auto picks there
    for m in (16, 64, 256, 1024, 2048):
        native = packed = onednn = plain = 0.0
        layer = [(n, k) for n, k in SHAPES if n != 49152]  # one decoder layer's four products
        for n, k in layer:
            x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
            ours = cpu_kernels.pack_bf16_weight(w)  # as the engine holds a bf16 model's weights
            prepacked = torch.ops.mkldnn._reorder_linear_weight(w, 128)
            reps = max(3, min(20, 4096 // m))
            native += timed(lambda: cpu_kernels.bf16_linear(x, w, None), reps)
            packed += timed(lambda: cpu_kernels.packed_linear(x, ours, n, k, None), reps)
            onednn += timed(lambda: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], ""), reps)
            plain += timed(lambda: F.linear(x, w), reps)
        flops = 2 * m * sum(n * k for n, k in layer)
        print(f"{isa:12s} bf16 gemm rows {m:4d}, one layer: packed {packed * 1e3:7.3f} ms "
              f"({flops / packed / 1e9:6.1f} GFLOP/s), plain weight {native * 1e3:7.3f} ms "
              f"({flops / native / 1e9:6.1f}), oneDNN prepacked {onednn * 1e3:7.3f} ms ({onednn / packed:5.2f}x), "
              f"oneDNN plain {plain * 1e3:7.3f} ms ({plain / packed:5.2f}x)")
        if m in (64, 2048):
            stack(isa, m if m == 64 else 4096)
        if m <= 256:  # the LM head sees one row per sequence
            n, k = SHAPES[-1]
            x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
            ours = cpu_kernels.pack_bf16_weight(w)
            head = timed(lambda: cpu_kernels.packed_linear(x, ours, n, k, None), max(3, min(20, 512 // m)))
            print(f"{isa:12s} bf16 gemm rows {m:4d}, LM head: {head * 1e3:7.3f} ms "
                  f"({2 * m * n * k / head / 1e9:6.1f} GFLOP/s)")


def stack(isa: str, m: int) -> None:
    """A step's products through 30 layers, each with weights of its own (SmolLM2's 200 MB: not in the
    caches, as in the engine): the packed kernel against oneDNN on the plain weights, mean of 5 steps."""
    layer = [(n, k) for n, k in SHAPES if n != 49152]
    plain = [[torch.randn(n, k).bfloat16() for n, k in layer] for _ in range(30)]
    packed = [[cpu_kernels.pack_bf16_weight(w) for w in ws] for ws in plain]
    xs = {k: torch.randn(m, k).bfloat16() for _, k in layer}

    def ours():
        for ws in packed:
            for (n, k), w in zip(layer, ws):
                cpu_kernels.packed_linear(xs[k], w, n, k, None)

    def onednn():
        for ws in plain:
            for (n, k), w in zip(layer, ws):
                F.linear(xs[k], w)

    a, b = timed(ours, 5), timed(onednn, 5)
    flops = 30 * 2 * m * sum(n * k for n, k in layer)
    print(f"{isa:12s} bf16 gemm rows {m:4d}, 30 layers' weights (not in the caches): packed {a * 1e3:7.1f} ms "
          f"({flops / a / 1e9:6.1f} GFLOP/s), oneDNN plain {b * 1e3:7.1f} ms ({b / a:5.2f}x)")


def elementwise(isa: str) -> None:
    """One decoder layer's kernels besides its products and attention, for a prompt of T tokens: the two
    RMSNorms (with the residual add), rotary on q and k, the KV write (into pages already touched) and
    SiLU-and-mul."""
    dt = torch.bfloat16 if isa == "avx512_bf16" else torch.float32
    nb, bs, hq, hk, d, inter = 512, 16, 9, 3, 64, 1536
    for t in (256, 2048):
        x, res, w = torch.randn(t, hq * d).to(dt), torch.randn(t, hq * d).to(dt), torch.ones(hq * d, dtype=dt)
        qkv = torch.randn(t, (hq + 2 * hk) * d).to(dt)
        q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d:].view(t, hk, d)
        cos, sin, pos = torch.randn(4096, d), torch.randn(4096, d), torch.arange(t)
        kv = torch.zeros(kv_cache_shape(nb, bs, hk, d)).to(dt)
        k_cache, v_cache = split_kv_cache(kv)
        slots = torch.arange(t)
        gate_up = torch.randn(t, 2 * inter).to(dt)
        times = {"2 x rms_norm": 2 * timed(lambda: cpu_kernels.rms_norm(x, w, 1e-5, res)),
                 "rotary q, k": timed(lambda: cpu_kernels.rope_neox(q, cos, sin, pos))
                 + timed(lambda: cpu_kernels.rope_neox(k, cos, sin, pos)),
                 "write_kv": timed(lambda: cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)),
                 "silu_and_mul": timed(lambda: cpu_kernels.silu_and_mul(gate_up))}
        print(f"{isa:12s} elementwise {str(dt)[6:]:8s} prompt of {t:4d}: "
              + ", ".join(f"{name} {sec * 1e3:.3f}" for name, sec in times.items())
              + f" ms; one layer {sum(times.values()) * 1e3:.3f} ms")
    # the KV write of 128 decodes, each into a block of its own in caches of 98 MB (out of L3, as in a
    # serving batch: every K column touches its head's 32 lines of the block), four layers' caches in turn
    kv_dt = torch.bfloat16
    big_nb, m = 8000, 128
    caches = [split_kv_cache(torch.zeros(kv_cache_shape(big_nb, bs, hk, d), dtype=kv_dt)) for _ in range(4)]
    k, v = torch.randn(m, hk, d).to(dt), torch.randn(m, hk, d).to(dt)
    slots = torch.randperm(big_nb)[:m] * bs + torch.randint(0, bs, (m,))
    turn = itertools.cycle(caches)
    write = timed(lambda: cpu_kernels.write_kv(k, v, *next(turn), slots), 100)
    print(f"{isa:12s} elementwise {str(dt)[6:]:8s} KV write of {m} decodes into a {str(kv_dt)[6:]} cache from "
          f"memory: {write * 1e6:.1f} us")


def rotating(w: torch.Tensor, nbytes: int = 96 << 20) -> list[torch.Tensor]:
    """Copies of w filling nbytes (3x this CPU's 32 MiB L3): called on each in turn, a kernel reads its
    weights from memory, as it does in a model's decode (one layer's weights after another)."""
    return [w.clone() for _ in range(max(1, -(-nbytes // (w.numel() * w.element_size()))))]


def timed_cold(fn, weights: list[torch.Tensor], n: int) -> float:
    fn(weights[-1])
    t0 = time.perf_counter()
    for i in range(n):
        fn(weights[i % len(weights)])
    return (time.perf_counter() - t0) / n


def quant(isa: str, rounds: int = 3) -> None:
    from tidal.layers import quant_kernels as qk
    bf16 = isa == "avx512_bf16"  # bf16 activations are what dtype auto picks there; fp32 elsewhere
    for m in (1, 4, 16, 128):
        best: dict[tuple[str, int, int], float] = {}
        for _ in range(rounds):  # best of a few rounds: other work on the machine only slows a round down
            for n, k in SHAPES:
                x = torch.randn(m, k)
                xb = x.bfloat16()
                x_in = xb if bf16 else x
                scale = torch.rand(n) * 0.01
                reps = max(5, min(60, 3000 // m))
                runs = {}
                w8 = rotating(torch.randint(-127, 128, (n, k), dtype=torch.int8))
                sums = qk.int8_row_sums(w8[0])
                runs["int8"] = timed_cold(lambda w: qk.int8_linear(x_in, w, scale), w8, reps)
                runs["w8a8"] = timed_cold(lambda w: qk.w8a8_linear(x_in, w, scale, None, sums), w8, reps)
                del w8
                wf8 = rotating((torch.randn(n, k) * 100).to(torch.float8_e4m3fn))
                runs["fp8"] = timed_cold(lambda w: qk.fp8_linear(x_in, w, scale), wf8, reps)
                del wf8
                wb = rotating(torch.randn(n, k).bfloat16())
                if m <= cpu_kernels.SKINNY_MAX_ROWS and bf16:
                    runs["bf16 skinny"] = timed_cold(lambda w: cpu_kernels.skinny_linear(xb, w, None), wb, reps)
                if bf16:
                    runs["bf16 blocked"] = timed_cold(lambda w: cpu_kernels.bf16_linear(xb, w, None), wb, reps)
                runs["f32 x bf16w"] = timed_cold(lambda w: cpu_kernels.linear_f32_bf16w(x, w, None), wb, reps)
                del wb
                for name, t in runs.items():
                    best[name, n, k] = min(t, best.get((name, n, k), t))
        names = list(dict.fromkeys(name for name, _, _ in best))
        for part, shapes in (("layer", SHAPES[:4]), ("lm_head", SHAPES[4:]), ("both", SHAPES)):
            t = {name: sum(best[name, n, k] for n, k in shapes) for name in names}
            base = t.get("bf16 skinny") or t.get("bf16 blocked") or t["f32 x bf16w"]
            cells = ", ".join(f"{name} {v * 1e3:6.3f} ms ({v / base:4.2f}x)" for name, v in t.items())
            print(f"{isa:12s} 8-bit weights, rows {m:4d}, {part:7s}: {cells}", flush=True)


def invariant(isa: str, rounds: int = 3) -> None:
    if isa == "avx512_bf16":
        for m in range(1, cpu_kernels.SKINNY_MAX_ROWS + 1):
            best: dict[str, float] = {}
            for _ in range(rounds):
                t = dict.fromkeys(("skinny", "packed", "ordered skinny", "blocked"), 0.0)
                for n, k in SHAPES:
                    xb, wb = torch.randn(m, k).bfloat16(), rotating(torch.randn(n, k).bfloat16())
                    reps = 30
                    t["skinny"] += timed_cold(lambda w: cpu_kernels.skinny_linear(xb, w, None), wb, reps)
                    wp = [cpu_kernels.pack_bf16_weight(w) for w in wb]
                    t["packed"] += timed_cold(lambda w: cpu_kernels.packed_linear(xb, w, n, k, None), wp, reps)
                    del wp
                    t["ordered skinny"] += timed_cold(lambda w: cpu_kernels.skinny_linear_ordered(xb, w, None), wb,
                                                      reps)
                    t["blocked"] += timed_cold(lambda w: cpu_kernels.bf16_linear(xb, w, None), wb, reps)
                    del wb
                best = {name: min(v, best.get(name, v)) for name, v in t.items()}
            cells = ", ".join(f"{name} {v * 1e3:6.3f} ms ({v / best['skinny']:4.2f}x)" for name, v in best.items())
            print(f"{isa:12s} invariant bf16, rows {m}, layer + LM head, cold weights: {cells}", flush=True)
    for m in (1, 4, 16, 64, 256):
        native = reference = 0.0
        for n, k in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            reps = max(3, min(20, 4096 // m))
            native += timed(lambda: cpu_kernels.linear_f32(x, w, None), reps)
            reference += timed(lambda: F.linear(x, w), reps)
        flops = 2 * m * sum(n * k for n, k in SHAPES)
        print(f"{isa:12s} invariant fp32 rows {m:4d}: {native * 1e3:8.3f} ms ({flops / native / 1e9:6.1f} GFLOP/s), "
              f"torch fp32 {reference * 1e3:8.3f} ms: {reference / native:5.2f}x", flush=True)


def attention(isa: str) -> None:
    nb, hk, hq, bs, d, ctx, n = 600, 3, 9, 16, 64, 1100, 64
    for qdt, kdt in ((torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                     (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
                     (torch.bfloat16, torch.float8_e4m3fn)):
        if isa != "avx512_bf16" and qdt == torch.bfloat16:
            continue  # bf16 activations are not what dtype auto picks there
        kv = torch.randn(kv_cache_shape(nb, bs, hk, d)).to(kdt)
        k_cache, v_cache = split_kv_cache(kv)
        q_all = torch.randn(256, hq, d).to(qdt)
        decode_tables = torch.stack([torch.randperm(nb)[:70] for _ in range(n)])
        chunk_table = torch.randperm(nb)[:70].view(1, 70)
        chunk_lens = torch.arange(ctx - n + 1, ctx + 1)
        # decodes of requests whose first 64 blocks (1,024 tokens) are one cached prompt prefix
        shared_tables = torch.cat([decode_tables[:1, :64].expand(n, 64), decode_tables[:, 64:]], dim=1)
        cases = {
            "decodes": (decode_tables, torch.full((n,), ctx), None),
            "shared prefix": (shared_tables, torch.full((n,), ctx), torch.arange(n)),
            "same, untiled": (shared_tables, torch.full((n,), ctx), None),
            "chunk tiled": (chunk_table, chunk_lens, torch.zeros(n, dtype=torch.long)),
            "chunk per token": (chunk_table.expand(n, 70).contiguous(), chunk_lens, None),
        }
        prompt = 256  # one whole prompt attending to itself (causal), in tiles
        cases[f"prompt of {prompt}"] = (chunk_table, torch.arange(1, prompt + 1), torch.zeros(prompt, dtype=torch.long))
        for name, (tables, lens, index) in cases.items():
            q = q_all[:len(lens)]
            dt = timed(lambda: cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5,
                                                                  index))
            flops = 4 * hq * d * int(lens.sum())
            print(f"{isa:12s} attention {str(qdt)[6:]:8s} over {str(kdt)[6:]:13s} cache, {name:15s}: "
                  f"{dt * 1e3:7.2f} ms ({flops / dt / 1e9:6.1f} GFLOP/s)")
        # a serving batch: 128 decodes over 340 tokens each, in blocks of their own among 8,000 (a cache of
        # 98 MB in bf16, three times L3: K and V come from memory, as in the engine)
        big_nb, m, ctx_m = 8000, 128, 340
        big = torch.empty(kv_cache_shape(big_nb, bs, hk, d), dtype=kdt)
        big.view(torch.uint8).random_(0, 64)  # small finite values of any dtype
        bk, bv = split_kv_cache(big)
        per = -(-ctx_m // bs)
        big_tables = torch.randperm(big_nb)[:m * per].view(m, per).contiguous()
        q = q_all[:1].expand(m, hq, d).contiguous()
        lens = torch.full((m,), ctx_m)
        dt = timed(lambda: cpu_kernels.paged_attention_decode(q, bk, bv, big_tables, lens, d ** -0.5, None))
        nbytes, flops = m * ctx_m * hk * d * 2 * big.element_size(), 4 * hq * d * m * ctx_m
        print(f"{isa:12s} attention {str(qdt)[6:]:8s} over {str(kdt)[6:]:13s} cache, {m} decodes from memory: "
              f"{dt * 1e3:7.2f} ms ({flops / dt / 1e9:6.1f} GFLOP/s, K/V {nbytes / dt / 1e9:5.1f} GB/s)")
        # a saturated engine's decode step: 64 requests over 320 tokens, each prompt's 16 blocks side by side and
        # its later blocks among the other requests', through 30 layers' caches (K and V from memory)
        n_req, ctx_s, layers, nb_s = 64, 320, 30, 1500
        per_s = -(-ctx_s // bs)
        step_tables = torch.tensor([[r * 16 + j if j < 16 else n_req * 16 + (j - 16) * n_req + r
                                     for j in range(per_s)] for r in range(n_req)])
        layer_caches = []
        for _ in range(layers):
            c = torch.empty(kv_cache_shape(nb_s, bs, hk, d), dtype=kdt)
            c.view(torch.uint8).random_(0, 64)
            layer_caches.append(split_kv_cache(c))
        q = q_all[:1].expand(n_req, hq, d).contiguous()
        lens = torch.full((n_req,), ctx_s)
        dt = timed(lambda: [cpu_kernels.paged_attention_decode(q, k, v, step_tables, lens, d ** -0.5, None)
                            for k, v in layer_caches])
        nbytes = layers * n_req * ctx_s * hk * d * 2 * big.element_size()
        print(f"{isa:12s} attention {str(qdt)[6:]:8s} over {str(kdt)[6:]:13s} cache, a step of {n_req} decodes "
              f"over {ctx_s} tokens, {layers} layers: {dt * 1e3:7.2f} ms (K/V {nbytes / dt / 1e9:5.1f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", nargs="*", default=[i for i in runnable_isas() if i != "generic"])
    ap.add_argument("--only", choices=["gemm", "greedy", "gemm_bf16", "quant", "invariant", "attention", "elementwise"],
                    default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    for isa in args.isa:
        with isa_override(isa):
            for name, bench in (("gemm", gemm), ("greedy", greedy), ("gemm_bf16", gemm_bf16), ("quant", quant),
                                 ("invariant", invariant), ("attention", attention), ("elementwise", elementwise)):
                if args.only in (None, name):
                    bench(isa)


if __name__ == "__main__":
    main()
