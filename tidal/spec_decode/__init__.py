"""Speculative decoding: configuration (config.py), the per-step draft-length policy (policy.py) and
the proposers' shared bookkeeping. The proposers themselves are in tidal/engine/proposer.py; draft
verification runs inside the model runner's normal step (tidal/worker/model_runner.py,
tidal/layers/rejection_sampler.py)."""
from tidal.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
