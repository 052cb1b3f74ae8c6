"""Benchmark request sets: lists of {"prompt_token_ids": [...], "max_tokens": n}, run greedy with
ignore_eos so every request produces exactly max_tokens tokens.

The named workloads (`offline`, `shared_prefix`, `single`) reproduce the shared side-by-side
workloads draw for draw (same numpy generator, same call order), so a figure measured here can be
set beside a peer engine's figure on the very same requests. `random_requests` is the same
generator as `offline` with the ranges and the token-id range as parameters: with SmolLM2's
vocabulary and the default arguments it yields exactly the `offline` workload.
"""
from __future__ import annotations

import json

import numpy as np

# Token ids are drawn from [TOKEN_LO, TOKEN_HI): valid for SmolLM2's 49,152-entry vocabulary and clear
# of the special tokens at the start of it.
TOKEN_LO, TOKEN_HI = 100, 49000


def _token_range(vocab_size: int | None) -> tuple[int, int]:
    """[lo, hi) for random token ids: the workload's range, shrunk to fit a smaller vocabulary."""
    if vocab_size is None or vocab_size >= TOKEN_HI:
        return TOKEN_LO, TOKEN_HI
    lo = min(TOKEN_LO, vocab_size // 4)
    if vocab_size - lo < 1:
        raise ValueError(f"vocab_size must be at least 2 for random prompts, got {vocab_size}")
    return lo, vocab_size


def refuse_unused_options(command: str, given: set[str], source: str, applies: set[str],
                          exclusive: list[tuple[str, str]] = ()) -> None:
    """Refuse request options (flags) given on the command line that the request source would ignore,
    and pairs of options that set the same thing: a flag accepted and ignored would misreport what was
    measured. Raises SystemExit naming the flags."""
    unused = sorted(given - applies)
    if unused:
        raise SystemExit(f"tidal {command}: {', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply "
                         f"to the requests of {source}")
    for a, b in exclusive:
        if a in given and b in given:
            raise SystemExit(f"tidal {command}: {a} and {b} both set the same lengths; give one")


def _check_range(name: str, lo: int, hi: int) -> None:
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"{name} must be two integers 1 <= LO <= HI, got {lo!r} {hi!r}")


def random_requests(num_prompts: int = 128, input_len_range: tuple[int, int] = (32, 512),
                    output_len_range: tuple[int, int] = (16, 256), seed: int = 0,
                    vocab_size: int | None = None) -> list[dict]:
    """num_prompts requests with input and output lengths drawn uniformly from the inclusive ranges."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    (in_lo, in_hi), (out_lo, out_hi) = input_len_range, output_len_range
    _check_range("input_len_range", in_lo, in_hi)
    _check_range("output_len_range", out_lo, out_hi)
    tok_lo, tok_hi = _token_range(vocab_size)
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(num_prompts):
        # Draw order (input length, output length, tokens) is the shared workload's: keep it.
        prompt_len = int(rng.integers(in_lo, in_hi + 1))
        output_len = int(rng.integers(out_lo, out_hi + 1))
        reqs.append({"prompt_token_ids": rng.integers(tok_lo, tok_hi, prompt_len).tolist(), "max_tokens": output_len})
    return reqs


def prefix_requests(num_prompts: int = 64, prefix_len: int = 1024, suffix_len: int = 64,
                    output_len: int = 64, seed: int = 1, vocab_size: int | None = None) -> list[dict]:
    """num_prompts requests sharing one random prefix of prefix_len tokens, each with its own random
    suffix: the workload where prefix caching pays."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    for name, v, least in (("prefix_len", prefix_len, 0), ("suffix_len", suffix_len, 0),
                           ("output_len", output_len, 1)):
        if not isinstance(v, int) or v < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix_len + suffix_len must be >= 1 (a prompt needs a token)")
    tok_lo, tok_hi = _token_range(vocab_size)
    rng = np.random.default_rng(seed)
    p = rng.integers(tok_lo, tok_hi, prefix_len).tolist()
    return [{"prompt_token_ids": p + rng.integers(tok_lo, tok_hi, suffix_len).tolist(), "max_tokens": output_len}
            for _ in range(num_prompts)]


# -- the shared side-by-side workloads, verbatim in behaviour ------------------------------------------

def offline(seed=0, n=128, in_lo=32, in_hi=512, out_lo=16, out_hi=256) -> list[dict]:
    return random_requests(n, (in_lo, in_hi), (out_lo, out_hi), seed)


def shared_prefix(seed=1, n=64, prefix=1024, suffix=64, out=64) -> list[dict]:
    return prefix_requests(n, prefix, suffix, out, seed)


def single(seed=2, L=128, out=128) -> list[dict]:
    # Fixed lengths: the shared workload draws the tokens only, with no length draws before them.
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(TOKEN_LO, TOKEN_HI, L).tolist(), "max_tokens": out}]


WORKLOADS = {"offline": offline, "shared_prefix": shared_prefix, "single": single}
# Warm-up sets for the workloads: another seed, fewer requests (as the side-by-side runner does).
WARMUP_KWARGS = {"offline": {"n": 16}, "shared_prefix": {"n": 8}, "single": {}}
WARMUP_SEED = 1000


def workload_requests(name: str) -> list[dict]:
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(sorted(WORKLOADS))}, got {name!r}")
    return WORKLOADS[name]()


def workload_warmup(name: str) -> list[dict]:
    return WORKLOADS[name](seed=WARMUP_SEED, **WARMUP_KWARGS[name])


def load_json_requests(path: str) -> list[dict]:
    """A JSON list of {"prompt_token_ids": [...], "max_tokens": n} (what workload.py prints)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of requests")
    reqs = []
    for i, r in enumerate(data):
        ids = r.get("prompt_token_ids") if isinstance(r, dict) else None
        n = r.get("max_tokens") if isinstance(r, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{path}: request {i} needs a non-empty 'prompt_token_ids' list of integers")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{path}: request {i} needs 'max_tokens' >= 1, got {n!r}")
        reqs.append({"prompt_token_ids": ids, "max_tokens": n})
    return reqs
