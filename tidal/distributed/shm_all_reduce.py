"""All-reduce through shared memory, for CPU tensor-parallel ranks on one machine.

Gloo's all-reduce between two processes costs 0.5-1.3 ms on a small machine (a socket round trip
that needs both ranks on a core at once), and a step runs two per layer. Ranks on the same host can
instead exchange tensors through one mapped segment: each rank copies its tensor into its own slot,
bumps its sequence counter, waits for the peers' counters, then sums every slot itself. The wait
spins a few microseconds, then yields the core, then naps (ranks may share cores), and gives up
after the engine's execute timeout with an error naming the collective, so a dead or hung peer
cannot block a rank forever.

Every rank sums the same slots in the same order (rank 0 + rank 1 + ..., in float32, rounded once to
the tensor's dtype), so all ranks get bitwise the same result; for two ranks it is the same result as
gloo's float32 all-reduce. The slots are double-buffered (csrc/shm_all_reduce.cpp says why that is
enough) so a rank can start the next all-reduce while a slow peer still reads the previous one.

Lifecycle: the group's first rank creates the segment in /dev/shm and broadcasts its name through
the process group; the others map it and check a random token in its header, which proves they share
the machine (under Ray too). As soon as every rank has it mapped the name is unlinked, so nothing is
left in /dev/shm whatever happens to the processes later; the mapping lives until `close()` or exit.
If any rank cannot map it (another machine, no /dev/shm, no C++ compiler), every rank keeps gloo.
"""
from __future__ import annotations

import ctypes
import datetime
import logging
import mmap
import os
import secrets
import struct

import torch

from tidal.native import NativeLibrary

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
_LINE = 64  # header and each rank's counter get a cache line of their own
_MAX_WORLD = 64  # the C++ side keeps one slot pointer per rank on its stack
_MAGIC = b"tidal-shm-ar\0\0\0\0"  # 16 bytes
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# waiting for a peer: a few microseconds of spinning, then yield the core until _YIELD_S, then nap
_YIELD_S = 2e-3


def _configure(lib: ctypes.CDLL) -> None:
    fn = lib.tidal_shm_all_reduce
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
                   + [ctypes.c_double] * 2 + [ctypes.POINTER(ctypes.c_int)])
    lib.tidal_shm_counter.restype = ctypes.c_int64
    lib.tidal_shm_counter.argtypes = [ctypes.c_void_p, ctypes.c_int]


_LIB = NativeLibrary("shm_all_reduce", os.path.join(os.path.dirname(__file__), "csrc", "shm_all_reduce.cpp"),
                     ["-O3", "-std=c++17"], [], _configure)


class SharedMemoryAllReduce:
    """All-reduce of CPU tensors of up to `slot_bytes` bytes among the ranks of `group`, in place.

    Built collectively with `create(...)` (every rank of the group at once); None means gloo stays.

    >>> ar = SharedMemoryAllReduce.create(group, slot_bytes=2048 * 576 * 4, timeout_s=30.0)
    >>> if ar is not None and ar.can_reduce(x):
    ...     ar.all_reduce(x)  # x now holds the sum over the group's ranks, the same bits on every rank
    """

    def __init__(self, mapping: mmap.mmap, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float,
                 lib: ctypes.CDLL) -> None:
        self.path = path  # the segment's name while it was being set up (unlinked since)
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self._mapping, self._lib = mapping, lib
        self._anchor = ctypes.c_char.from_buffer(mapping)  # pins the mapping: close() releases it first
        self._base = ctypes.addressof(self._anchor)
        self._data_offset = _LINE * (1 + world)
        self._seq = 0  # all-reduces done through this segment; the same on every rank
        self._late_rank = ctypes.c_int(-1)

    @staticmethod
    def segment_bytes(world: int, slot_bytes: int) -> int:
        return _LINE * (1 + world) + 2 * world * slot_bytes

    @classmethod
    def create(cls, group, slot_bytes: int, timeout_s: float,
               setup_timeout_s: float = 600.0) -> SharedMemoryAllReduce | None:
        """Every rank of `group` (a gloo group) calls this together. The first rank creates the segment;
        returns None on every rank unless every rank mapped it. `setup_timeout_s` bounds the wait for
        the slowest rank to arrive (ranks come here after loading their shards, which takes a while)."""
        import torch.distributed as dist
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        lib = _LIB.get() if world <= _MAX_WORLD and os.path.isdir(_SHM_DIR) else None
        slot_bytes = -(-slot_bytes // _LINE) * _LINE
        # the ranks arrive after loading their shards, possibly far apart: wait with a bound of its own
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=setup_timeout_s))
        path, fd, mapping = None, -1, None
        try:
            if rank == 0:
                offer = [None]
                if lib is not None:
                    try:
                        path, fd, mapping, token = _create_segment(world, slot_bytes)
                        offer = [(path, token)]
                    except OSError as e:
                        logger.warning("shared-memory all-reduce: cannot create a segment in %s (%s); using gloo",
                                       _SHM_DIR, e)
            else:
                offer = [None]
            dist.broadcast_object_list(offer, src=dist.get_global_rank(group, 0), group=group)
            name = offer[0][0] if offer[0] is not None else None
            ok = 0
            if rank == 0:
                ok = int(mapping is not None)
            elif offer[0] is not None and lib is not None:
                mapping = _attach_segment(*offer[0], world, slot_bytes)
                ok = int(mapping is not None)
            flags = torch.tensor([ok], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)  # also: every rank is done mapping
        finally:
            if fd >= 0:
                os.close(fd)
            if path is not None:
                os.unlink(path)  # the mappings keep the memory; the name is no longer needed
        dist.barrier(group)  # no rank returns before the name is gone
        if not flags.item():
            if mapping is not None:
                mapping.close()
            if rank == 0 and lib is not None:
                logger.warning("shared-memory all-reduce: not every rank could map the segment (ranks on "
                               "different machines?); tensor-parallel all-reduces use gloo")
            return None
        return cls(mapping, name, rank, world, slot_bytes, timeout_s, lib)

    def can_reduce(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in _DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.slot_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x must pass can_reduce)."""
        self._seq += 1
        status = self._lib.tidal_shm_all_reduce(
            self._base, self._data_offset, self.slot_bytes, self.world, self.rank, self._seq, x.data_ptr(),
            x.data_ptr(), x.numel(), _DTYPES[x.dtype], self.timeout_s, _YIELD_S, ctypes.byref(self._late_rank))
        if status != 0:
            raise TimeoutError(f"tensor-parallel all-reduce (shared memory, number {self._seq}, {tuple(x.shape)} "
                               f"{x.dtype}) on rank {self.rank}: rank {self._late_rank.value} of the group did not "
                               f"arrive within {self.timeout_s:g} s (TIDAL_EXECUTE_TIMEOUT_S)")
        return x

    def counters(self) -> list[int]:
        """Every rank's published sequence number (the all-reduces it has entered)."""
        return [self._lib.tidal_shm_counter(self._base, r) for r in range(self.world)]

    def close(self) -> None:
        if self._mapping is None:
            return
        del self._anchor
        self._mapping.close()
        self._mapping = None


def _create_segment(world: int, slot_bytes: int) -> tuple[str, int, mmap.mmap, bytes]:
    token = secrets.token_bytes(16)
    path = os.path.join(_SHM_DIR, f"tidal-allreduce-{os.getpid()}-{token[:4].hex()}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        size = SharedMemoryAllReduce.segment_bytes(world, slot_bytes)
        os.ftruncate(fd, size)  # zero-filled: every counter starts at 0
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    mapping[:_LINE] = _header(token, world, slot_bytes)
    return path, fd, mapping, token


def _attach_segment(path: str, token: bytes, world: int, slot_bytes: int) -> mmap.mmap | None:
    """The segment at path if it is the one the first rank created (same token, same layout), else
    None: a rank on another machine either finds no such file or a different one."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        size = SharedMemoryAllReduce.segment_bytes(world, slot_bytes)
        if os.fstat(fd).st_size != size:
            return None
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mapping[:_LINE] != _header(token, world, slot_bytes):
        mapping.close()
        return None
    return mapping


def _header(token: bytes, world: int, slot_bytes: int) -> bytes:
    return (_MAGIC + token + struct.pack("<qq", world, slot_bytes)).ljust(_LINE, b"\0")
