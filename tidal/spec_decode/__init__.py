"""Speculative decoding: configuration (config.py), the engine's side of a step (speculation.py: drafts
before scheduling, acceptance after), the per-step draft-length policy (policy.py) and the draft-model
proposer (draft_model.py). The n-gram proposer is tidal/engine/proposer.py; draft verification runs
inside the model runner's normal step (tidal/worker/model_runner.py, tidal/layers/rejection_sampler.py)."""
from tidal.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
