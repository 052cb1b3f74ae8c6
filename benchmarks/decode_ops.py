"""Where a single stream's decode step goes, op by op: every native kernel call and quantized product is
wrapped in a timer (perf_counter around the Python call, so a call's ctypes and tensor set-up count), and
the model's forward is timed whole.

    python benchmarks/decode_ops.py                       # default model, dtype auto
    python benchmarks/decode_ops.py --quantization int8

One 128-token prompt, 256 greedy tokens (after one untimed run); prints ms per token per op. The decoder
layers run through the Python layers here (TIDAL_NATIVE_DECODER=0, unless set otherwise), so that each
kernel call can be timed; in the engine they run from one native call (tidal/layers/native_decoder.py),
the same kernels without the calls' Python.
"""
from __future__ import annotations

import argparse
import collections
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="none",
                    help="int8, w8a8, fp8, gguf (the default GGUF kept in its blocks); none: plain weights")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()

    os.environ.setdefault("TIDAL_NATIVE_DECODER", "0")
    from tidal import LLM, SamplingParams
    from tidal.layers import cpu_kernels, quant_kernels

    llm = LLM(quantization=args.quantization, dtype=args.dtype, max_model_len=2048)
    total, calls = collections.defaultdict(float), collections.Counter()

    def timed(label, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            total[label] += time.perf_counter() - t0
            calls[label] += 1
            return out
        return wrapper

    for mod, names in ((cpu_kernels, ("paged_attention_decode", "rope_neox", "write_kv", "rms_norm", "silu_and_mul")),
                       (quant_kernels, ("int8_linear", "fp8_linear", "w8a8_linear"))):
        for name in names:
            setattr(mod, name, timed(name, getattr(mod, name)))
    model = llm.llm_engine.runner.model
    model.forward = timed("model forward (all layers)", model.forward)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    prompt = [{"prompt_token_ids": list(range(100, 228))}]
    llm.generate(prompt, params, use_tqdm=False)
    total.clear()
    calls.clear()
    t0 = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    print(f"{wall / args.tokens * 1e3:.3f} ms per token end to end")
    for label in sorted(total, key=lambda k: -total[k]):
        print(f"{label:28s} {total[label] / args.tokens * 1e3:7.3f} ms per token, {calls[label]:6d} calls, "
              f"{total[label] / calls[label] * 1e6:8.1f} us per call")


if __name__ == "__main__":
    main()
