"""A picture of the engine's state at one instant, for the live dashboard (tidal/entrypoints/openai/dashboard.py).

`engine_snapshot(engine)` must run on the engine thread between two steps (AsyncLLM.call_in_engine),
where the scheduler and the block pool are consistent. It costs O(num_blocks + requests + new steps) and
runs only when someone asks (the dashboard's event stream, a few times a second). Per step the engine only
records the batch's shape in a bounded ring (EngineStats.step_history: one tuple per step); the snapshot
lists the steps numbered above `since` from it, so a reader that passes the last step it got sees every
step once (all of them while it reads at least once per STEP_HISTORY steps).

The KV cache comes as a map with one character per block (or per group of blocks once the pool has
more than `max_cells`: the group shows its busiest state and its first owner):

    f  free              no request, no reusable KV
    c  cached            no request, KV kept for the prefix cache (evicted least recently used first)
    u  in use            held by one request
    s  shared            held by several requests (a prefix-cache hit)

and `owner[i]`: the index in `requests` of the (first) request holding cell i, -1 for none.
"""
from __future__ import annotations

import time

MAX_CELLS = 4096  # a map of more blocks is drawn in groups
MAX_REQUESTS = 256  # requests listed (running first, then waiting in queue order); the counts are exact
_RANK = {"f": 0, "c": 1, "u": 2, "s": 3}


def _block_state(block) -> str:
    if block.ref_cnt > 1:
        return "s"
    if block.ref_cnt == 1:
        return "u"
    return "c" if block.block_hash is not None else "f"


def _request_row(request, status: str, num_blocks: int, now: float) -> dict:
    return {
        "id": request.request_id,
        "status": status,
        "prompt_tokens": request.num_prompt_tokens,
        "prompt_computed": min(request.num_computed_tokens, request.num_prompt_tokens),
        "cached_tokens": max(request.num_cached_tokens, 0),
        "output_tokens": request.num_output_tokens,
        "max_tokens": request.sampling_params.max_tokens,
        "preemptions": request.num_preemptions,
        "blocks": num_blocks,
        "state_slot": request.state_slot,
        "age_s": round(max(0.0, now - request.arrival_time), 3),
    }


def _kv_map(pool, req_to_blocks: dict, index: dict[str, int], max_cells: int) -> dict:
    n = pool.num_blocks
    per_cell = -(-n // max_cells)
    num_cells = -(-n // per_cell)
    cells = ["f"] * num_cells
    owner = [-1] * num_cells
    counts = {"f": 0, "c": 0, "u": 0, "s": 0}
    for block in pool.blocks:
        state = _block_state(block)
        counts[state] += 1
        cell = block.block_id // per_cell
        if _RANK[state] > _RANK[cells[cell]]:
            cells[cell] = state
    for request_id, blocks in req_to_blocks.items():
        i = index.get(request_id, -1)
        for block in blocks:
            cell = block.block_id // per_cell
            if owner[cell] < 0:
                owner[cell] = i
    return {"num_blocks": n, "blocks_per_cell": per_cell, "cells": "".join(cells), "owner": owner,
            "free": counts["f"], "cached": counts["c"], "in_use": counts["u"] + counts["s"],
            "shared": counts["s"], "usage": pool.usage()}


def _state_slots(scheduler, index: dict[str, int]) -> dict | None:
    pool = scheduler.state_pool
    if pool is None:
        return None
    owners = pool.owners()
    slots = [index.get(owners[s], -1) if s in owners else -2 for s in range(pool.num_slots)]  # -2: free
    out = {"num_slots": pool.num_slots, "free": pool.num_free_slots, "owner": slots}
    checkpoints = scheduler.state_checkpoints
    if checkpoints is not None:
        valid, pending = checkpoints.counts()
        out["checkpoints"] = {"num": checkpoints.num_checkpoints, "valid": valid, "pending": pending,
                              "hits": checkpoints.num_hits}
    return out


def engine_snapshot(engine, max_cells: int = MAX_CELLS, max_requests: int = MAX_REQUESTS, since: int = 0) -> dict:
    """The block map, the running and waiting requests, Mamba state slots, the latest step's batch, and
    `steps`: the batch of each step numbered above `since` still in the ring, oldest first, as
    [step number, time (s since the epoch), prefill tokens, decode tokens, requests]."""
    scheduler, kv = engine.scheduler, engine.kv_manager
    now = time.time()
    requests, index = [], {}
    for status, queue in (("running", scheduler.running), ("waiting", scheduler.waiting)):
        for request in queue:
            if len(requests) >= max_requests:
                break
            label = "preempted" if status == "waiting" and request.num_preemptions else status
            index[request.request_id] = len(requests)
            requests.append(_request_row(request, label, len(kv.req_to_blocks.get(request.request_id, ())), now))
    stats = engine.stats
    return {
        "time": now,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        "requests": requests,
        "kv": _kv_map(kv.pool, kv.req_to_blocks, index, max_cells),
        "state": _state_slots(scheduler, index),
        "step": {"num": stats.num_steps, "prefill_tokens": stats.last_step_prefill_tokens,
                 "decode_tokens": stats.last_step_decode_tokens, "num_requests": stats.last_step_num_requests},
        "steps": [[num, round(t, 4), prefill, decode, n] for num, t, prefill, decode, n in stats.steps_since(since)],
    }


def engine_config(engine) -> dict:
    """What does not change while the server runs (sent once, when the page connects)."""
    scheduler = engine.scheduler
    return {
        "model": engine.model_name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "num_blocks": engine.kv_manager.pool.num_blocks,
        "block_size": engine.kv_manager.block_size,
        "prefix_caching": engine.kv_manager.enable_caching,
        "num_state_slots": scheduler.state_pool.num_slots if scheduler.state_pool is not None else 0,
        "speculative": engine.proposer is not None,
    }
