"""Rollback after rejected drafts: the scheduler's and the workers' state after a step whose drafts
were partly rejected equals the state of a run that never proposed the rejected tokens - block table
(the very block ids, and the free queue's order), prefix-cache contents and num_computed_tokens. And
models with Mamba layers refuse speculation (their recurrent state cannot be rolled back)."""
from __future__ import annotations

import random
from functools import partial

import pytest

from tests.helpers import WorkerMirror
from tidal import LLM
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler
from tidal.engine.stop_checker import append_tokens
from tidal.request import Request
from tidal.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _model_next(tokens: list[int]) -> int:
    """A deterministic stand-in for the model's greedy token."""
    return (tokens[-1] * 7 + tokens[-2] * 3) % 97 + 3


class _Run:
    """A scheduler, its KV cache manager and a worker's mirror of the deltas, driven step by step."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.kv = KVCacheManager(num_blocks=128, block_size=BLOCK_SIZE, enable_caching=True)
        self.scheduler = Scheduler(self.kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
        self.mirror = WorkerMirror()
        self.append = partial(append_tokens, max_model_len=256)
        self.requests = [Request(f"r{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
                         for i, p in enumerate(prompts)]
        for r in self.requests:
            self.scheduler.add_request(r)

    def step(self, drafts: dict[str, tuple[int, int]]) -> None:
        """drafts: request id -> (drafts that are right, drafts that are wrong after them)."""
        for r in self.scheduler.running:
            right, wrong = drafts.get(r.request_id, (0, 0))
            truth = self._continuation(r, right + wrong)
            r.spec_token_ids = truth[:right] + [(t + 1) % 100 + 3 for t in truth[right:right + wrong]]
        so = self.scheduler.schedule()
        self.mirror.apply(so)
        sampled = {}
        for sr in so.scheduled:
            if sr.sample:  # the model keeps the drafts that match its own tokens and adds one
                r = self.scheduler.requests[sr.request_id]
                truth = self._continuation(r, len(sr.spec_token_ids) + 1)
                n = next((j for j, d in enumerate(sr.spec_token_ids) if d != truth[j]), len(sr.spec_token_ids))
                sampled[sr.request_id] = truth[:n + 1]
        self.scheduler.update(so, sampled, self.append)

    @staticmethod
    def _continuation(request: Request, n: int) -> list[int]:
        tokens = list(request.all_token_ids)
        for _ in range(n):
            tokens.append(_model_next(tokens))
        return tokens[request.num_tokens:]

    def state(self):
        """Everything rollback must restore, block ids included."""
        return ([(r.request_id, r.num_computed_tokens, list(r.all_token_ids), self.kv.get_block_ids(r.request_id))
                 for r in self.requests],
                sorted((h, b.block_id) for h, b in self.kv.pool.cached_blocks.items()),
                list(self.kv.pool.free_queue))


@pytest.mark.parametrize("num_requests", [1, 3])
def test_state_after_rejected_drafts_equals_a_run_that_never_proposed_them(num_requests):
    rng = random.Random(num_requests)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randrange(5, 14))] for _ in range(num_requests)]
    spec, plain = _Run(prompts), _Run(prompts)
    rejected = 0
    for _ in range(25):
        plan = {r.request_id: (rng.randrange(0, 4), rng.randrange(0, 6)) for r in spec.requests}
        spec.step(plan)  # right drafts, then wrong ones the model rejects
        plain.step({rid: (right, 0) for rid, (right, _) in plan.items()})  # only the drafts that were kept
        rejected += sum(w for _, w in plan.values())
        got, want = spec.state(), plain.state()
        for (rid, computed, tokens, blocks), (_, computed2, tokens2, blocks2) in zip(got[0], want[0]):
            assert (computed, tokens) == (computed2, tokens2), rid
            assert len(blocks) == len(blocks2) == -(-computed // BLOCK_SIZE), f"{rid}: blocks past its tokens kept"
            # (the workers drop rolled-back blocks at the request's next step: until then they list more)
            assert spec.mirror.blocks.get(rid, blocks)[:len(blocks)] == blocks, f"{rid}: the workers' table differs"
            if num_requests == 1:  # alone, even the block ids and the pool's order are the same
                assert blocks == blocks2
        if num_requests == 1:
            assert got[1:] == want[1:]
        else:  # the same tokens cached, whichever blocks hold them
            assert [h for h, _ in got[1]] == [h for h, _ in want[1]]
        spec.kv.pool.check_invariants()
    assert rejected > 0


def test_rolled_back_blocks_reach_the_workers_before_new_ones():
    run = _Run([[10, 11, 12, 13, 14, 15, 16]])  # 7 tokens
    run.step({})                               # prefill: 8 tokens, 7 computed, 2 blocks
    run.step({"r0": (0, 5)})                   # 1 known + 5 wrong drafts: 4 blocks, then back to 2
    assert run.kv.num_blocks("r0") == 2 and len(run.mirror.blocks["r0"]) == 4
    run.step({})
    (r,) = run.requests
    assert run.mirror.blocks["r0"] == run.kv.get_block_ids("r0")
    assert run.mirror.tokens["r0"] == r.all_token_ids[:-1]


def test_models_with_mamba_layers_refuse_speculation(tmp_path):
    from tests.test_hybrid import save_tiny_hybrid
    save_tiny_hybrid("jamba", str(tmp_path))
    with pytest.raises(ValueError, match="speculative_config: .*Mamba"):
        LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
