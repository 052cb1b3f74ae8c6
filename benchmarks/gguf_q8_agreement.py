"""How far the decode products on int8 activations (TIDAL_GGUF_ACTIVATIONS=q8, llama.cpp's way) move the
default model's outputs from the default path (activations kept in fp32/bf16): greedy generations of 128
tokens from six prompts, run once each way in its own process; for each prompt, the first token at which
they differ and the largest difference of the chosen tokens' logprobs before it.

    python benchmarks/gguf_q8_agreement.py              # the ISA level of this CPU
    TIDAL_CPU_ISA=avx2 python benchmarks/gguf_q8_agreement.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROMPTS = ["The capital of France is", "Write a short story about a robot who learns to paint.",
           "Explain how a transformer neural network works.", "List five fruits and their colors:",
           "def fibonacci(n):", "Once upon a time in a small village,"]

_RUN = """
import json, sys
from tidal import LLM, SamplingParams
llm = LLM(max_model_len=1024)
outs = llm.generate(json.loads(sys.argv[1]), SamplingParams(max_tokens=128, temperature=0, logprobs=1,
                                                             ignore_eos=True), use_tqdm=False)
print(json.dumps([[list(o.outputs[0].token_ids),
                   [max(d.values(), key=lambda v: v.logprob).logprob for d in o.outputs[0].logprobs]] for o in outs]))
"""


def run(activations: str) -> list:
    env = {**os.environ, "TIDAL_GGUF_ACTIVATIONS": activations}
    out = subprocess.run([sys.executable, "-c", _RUN, json.dumps(PROMPTS)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    kept, q8 = run("float"), run("q8")
    for prompt, (ta, la), (tb, lb) in zip(PROMPTS, kept, q8):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        diff = max((abs(x - y) for x, y in zip(la[:n], lb[:n])), default=0.0)
        print(f"{prompt[:40]!r:44s} first different token: {n:3d} of {len(ta)}; "
              f"largest logprob difference before it: {diff:.4f}")


if __name__ == "__main__":
    main()
