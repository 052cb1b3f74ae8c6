"""The shared-memory all-reduce across real processes (2 and 3 ranks, spawned, joined by gloo): sums equal
to a reference summed in rank order, bitwise the same on every rank, over many reuses of the double
buffer; a peer that never arrives turns into an error naming the collective after the timeout; the
segment's name is gone from /dev/shm once the ranks have mapped it, and the ranks fall back to gloo
together when one cannot map it.
"""
from __future__ import annotations

import glob
import hashlib
import os
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tidal.distributed import shm_all_reduce
from tidal.distributed.shm_all_reduce import SharedMemoryAllReduce

HIDDEN = 96
SLOT_BYTES = 64 * HIDDEN * 4  # 64 tokens of fp32
# (shape, dtype) cases: decode-sized, prefill-sized, odd sizes, the largest that fits a slot (64 x HIDDEN
# fp32, 128 x HIDDEN bf16) and one row more than fits (which must be refused)
CASES = [((1, HIDDEN), torch.float32), ((8, HIDDEN), torch.bfloat16), ((3, 7), torch.float32),
         ((5,), torch.bfloat16), ((64, HIDDEN), torch.float32), ((128, HIDDEN), torch.bfloat16),
         ((2, 3, HIDDEN), torch.float32), ((65, HIDDEN), torch.float32)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _input(rank: int, iteration: int, case: int) -> torch.Tensor:
    shape, dtype = CASES[case]
    g = torch.Generator().manual_seed(rank * 1_000_003 + iteration * 101 + case)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


def _ranks(world: int, scenario: str, **kwargs) -> list[dict]:
    """Run `scenario` on `world` spawned ranks; each returns a dict (or its traceback as 'error')."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, scenario, kwargs, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    by_rank = {r["rank"]: r for r in results}
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return [by_rank[r] for r in range(world)]


def _rank_main(rank, world, port, scenario, kwargs, queue) -> None:
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world)
        result = {"rank": rank, "pid": os.getpid(), **globals()[f"_scenario_{scenario}"](rank, world, **kwargs)}
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the test reports it
        result = {"rank": rank, "error": f"rank {rank}:\n{traceback.format_exc()}"}
    queue.put(result)


def _scenario_sums(rank, world, iterations) -> dict:
    group = torch.distributed.group.WORLD
    ar = SharedMemoryAllReduce.create(group, SLOT_BYTES, timeout_s=30.0)
    assert ar is not None
    name_gone = not os.path.exists(ar.path)
    digest, mismatches = hashlib.sha256(), []
    for it in range(iterations):
        if rank == world - 1 and it % 17 == 0:
            time.sleep(0.002)  # a late rank: the others must wait for it, not read a stale slot
        for case in range(len(CASES)):
            x = _input(rank, it, case)
            big = x.numel() * x.element_size() > SLOT_BYTES
            if not ar.can_reduce(x):
                assert big, f"case {case} refused but fits"
                continue
            ar.all_reduce(x)
            acc = _input(0, it, case).float()
            for r in range(1, world):  # the reference, in rank order
                acc = acc + _input(r, it, case).float()
            if not torch.equal(x, acc.to(x.dtype)):
                mismatches.append((it, case))
            digest.update(x.view(torch.uint8).numpy().tobytes())
    counters = ar.counters()
    ar.close()
    return {"name_gone": name_gone, "path": ar.path, "mismatches": mismatches, "digest": digest.hexdigest(),
            "counters": counters}


def _scenario_late_peer(rank, world, timeout_s) -> dict:
    ar = SharedMemoryAllReduce.create(torch.distributed.group.WORLD, SLOT_BYTES, timeout_s=timeout_s)
    out = {}
    if rank == 0:
        ar.all_reduce(torch.ones(4))  # rank 1 is not there for the second one
        t0 = time.monotonic()
        try:
            ar.all_reduce(torch.ones(4))
        except TimeoutError as e:
            out["error_text"] = str(e)
        out["waited_s"] = time.monotonic() - t0
    else:
        ar.all_reduce(torch.ones(4))
    torch.distributed.barrier()  # rank 1 stays alive (not arriving) until rank 0 has given up
    ar.close()
    return out


def _scenario_one_rank_cannot_map(rank, world) -> dict:
    if rank == 1:  # as a rank on another machine: the name does not lead to the same segment
        shm_all_reduce._attach_segment = lambda *args: None
    ar = SharedMemoryAllReduce.create(torch.distributed.group.WORLD, SLOT_BYTES, timeout_s=30.0)
    return {"uses_shm": ar is not None}


def _leftovers(pids) -> list[str]:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/tidal-allreduce-{pid}-*")]


@pytest.mark.parametrize("world", [2, 3])
def test_sums_equal_the_rank_order_reference_and_are_identical_on_every_rank(world):
    ranks = _ranks(world, "sums", iterations=60)
    for r in ranks:
        assert r["mismatches"] == [], f"rank {r['rank']}: sums differ from the reference at {r['mismatches'][:5]}"
    assert len({r["digest"] for r in ranks}) == 1, "ranks got different bits"
    fitting = sum(1 for shape, dtype in CASES if torch.Size(shape).numel() * dtype.itemsize <= SLOT_BYTES)
    assert fitting < len(CASES)  # one case is larger than a slot and must be refused
    for r in ranks:  # every rank went through every all-reduce: the double buffer was reused 60 x fitting times
        assert r["counters"] == [60 * fitting] * world


def test_segment_name_is_unlinked_once_mapped_and_nothing_is_left():
    ranks = _ranks(2, "sums", iterations=1)
    assert all(r["name_gone"] for r in ranks), "the segment's name outlived the set-up"
    assert ranks[0]["path"].startswith("/dev/shm/tidal-allreduce-")
    assert not os.path.exists(ranks[0]["path"])
    assert _leftovers([r["pid"] for r in ranks]) == []


def test_peer_that_never_arrives_is_an_error_after_the_timeout():
    rank0 = _ranks(2, "late_peer", timeout_s=1.0)[0]
    assert "tensor-parallel all-reduce (shared memory" in rank0["error_text"]
    assert "rank 1 of the group did not arrive within 1 s" in rank0["error_text"]
    assert 1.0 <= rank0["waited_s"] < 5.0


def test_every_rank_keeps_gloo_when_one_cannot_map_the_segment():
    ranks = _ranks(2, "one_rank_cannot_map")
    assert [r["uses_shm"] for r in ranks] == [False, False]
    assert _leftovers([r["pid"] for r in ranks]) == []
