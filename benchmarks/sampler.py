"""Sampler time per step over a 49152 vocab (SmolLM2's), on one CPU thread: 1, 8 and 256 rows,
all greedy, all random with top-p 0.9, and all seeded (each row its own seed).

    OMP_NUM_THREADS=1 python benchmarks/sampler.py
"""
from __future__ import annotations

import time

import torch

from tidal.layers.sampler import Sampler, SamplingMetadata
from tidal.sampling_params import SamplingParams

VOCAB = 49152
CASES = {"greedy": dict(temperature=0.0), "random_top_p": dict(temperature=1.0, top_p=0.9),
         "seeded": dict(temperature=1.0, seed=0)}


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(g)
    for n in (1, 8, 256):
        logits = torch.randn(n, VOCAB, generator=g) * 3
        for name, kw in CASES.items():
            params = [SamplingParams(**kw).clone(seed=i) if "seed" in kw else SamplingParams(**kw)
                      for i in range(n)]
            reps = 20 if n < 256 else 5
            step = lambda: sampler(logits, SamplingMetadata.from_params(params, "cpu", VOCAB))  # noqa: E731
            step()
            start = time.perf_counter()
            for _ in range(reps):
                step()
            print(f"n={n:4d} {name:13s} {(time.perf_counter() - start) / reps * 1e3:8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
