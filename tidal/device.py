"""Where the model runs: the `device` engine argument ("auto", "cpu" or "cuda") and copies of
per-step host tensors to it.

The model runner builds each step's metadata (token ids, positions, slot mapping, block tables) on
the host as plain Python integers, then copies each tensor to the device once per step. On CUDA the
copy goes through pinned memory with `non_blocking=True`, so the host never waits for the GPU to
drain its queue before the forward starts; on CPU it is the tensor itself.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys
import threading
import time

import torch

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one is refused."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise ValueError(f"device 'cuda' was asked for, but torch sees no GPU (torch {torch.__version__}, {build}): "
                         "use device='cpu' or device='auto'")
    return device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device (no copy on CPU)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def lazy_zeros(shape: tuple, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose host memory is committed only as it is written. On CPU it lives in an
    anonymous mapping (zero pages from the kernel), so a KV cache sized for the worst case costs
    nothing at start-up and only the pages requests use are ever touched; torch.zeros would write
    every byte up front (seconds for a few GiB). Elsewhere: torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        # huge pages where the kernel gives them to shared anonymous memory (shmem_enabled "advise"; a
        # private mapping, which always gets them, measured slower: docs/cpu.md, "Start-up")
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


_MADV_POPULATE_WRITE = 23  # Linux 5.14


def commit_pages(t: torch.Tensor) -> bool:
    """Fault in now, writable, every page of the host memory under a contiguous CPU tensor (one of
    lazy_zeros'), leaving its contents as they are: madvise(MADV_POPULATE_WRITE). The kernel's page
    clearing then happens here instead of in the first writes. False where the kernel cannot (before
    Linux 5.14, or not Linux): the pages are left to be committed as they are written."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    return _madvise()(start, end - start, _MADV_POPULATE_WRITE) == 0


@functools.cache
def _madvise():
    """libc's madvise (the call releases the GIL: threads commit tensors in parallel), looked up once."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _lowest_priority() -> None:
    """The calling thread runs only on a core nothing else wants (SCHED_IDLE; else nice 19)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread on Linux
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass


class IdleCommitter:
    """Commits a lazily committed KV cache (lazy_zeros: [2, num_blocks, ...] per layer) in the background
    while the engine is idle: `num_threads` threads at the lowest priority (SCHED_IDLE: they take only CPU
    time nothing else wants, so a server still starting, a client or a step never waits for them), each over
    its share of the layers, commit the K and V of `chunk` blocks at a time (commit_pages) in block id order,
    the order in which the pool hands out blocks never used, and stop between chunks whenever set_idle(False)
    says the engine has work. Writing a page while it is being committed is safe (the commit keeps contents).
    Started by the first set_idle(True): an engine whose loop is never idle (the offline LLM) never runs it."""

    def __init__(self, caches: list[torch.Tensor], num_blocks: int, num_threads: int, chunk: int = 8) -> None:
        self.num_blocks, self.chunk = num_blocks, chunk
        self.num_bytes = sum(c.numel() * c.element_size() for c in caches)
        self._idle = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()
        self._running = 0
        self.done = threading.Event()  # set when every thread has finished (or given up)
        self.failed = False  # this kernel cannot commit ahead (before Linux 5.14): the pages stay lazy
        n = max(1, min(num_threads, len(caches)))
        self._shares = [caches[i::n] for i in range(n)]
        self._threads: list[threading.Thread] = []
        self._busy_s = 0.0  # the threads' time committing, summed
        self._start = 0.0  # when the threads started (perf_counter)
        self._progress = [0] * n  # blocks each thread has committed (of its layers)

    @property
    def committed_blocks(self) -> int:
        """Blocks [0, committed_blocks) are committed in every layer."""
        return min(self._progress)

    def set_idle(self, idle: bool) -> None:
        if not idle:
            self._idle.clear()
            return
        if not self._threads and self._shares and not self._stopped:
            self._start = time.perf_counter()
            self._running = len(self._shares)
            self._threads = [threading.Thread(target=self._run, args=(i, share), name=f"tidal-kv-commit-{i}",
                                              daemon=True) for i, share in enumerate(self._shares)]
            for t in self._threads:
                t.start()
        self._idle.set()

    def stop(self) -> None:
        self._stopped = True
        self._idle.set()
        for t in self._threads:
            t.join(5.0)

    def _run(self, index: int, caches: list[torch.Tensor]) -> None:
        _lowest_priority()
        busy = 0.0
        try:
            for start in range(0, self.num_blocks, self.chunk):
                self._idle.wait()
                if self._stopped or self.failed:
                    return
                t = time.perf_counter()
                for c in caches:
                    for part in (c[0, start:start + self.chunk], c[1, start:start + self.chunk]):
                        if not commit_pages(part):
                            self.failed = True
                            return
                busy += time.perf_counter() - t
                self._progress[index] = min(self.num_blocks, start + self.chunk)
        finally:
            with self._lock:
                self._busy_s += busy
                self._running -= 1
                last = self._running == 0
            if last:
                if not self.failed and not self._stopped:
                    logger.info("KV cache memory committed while the engine was idle: %.1f MiB, %.2f s of "
                                "committing over %.1f s", self.num_bytes / 2**20, self._busy_s,
                                time.perf_counter() - self._start)
                self.done.set()


class HostCopy:
    """Device tensors on their way to the host, without waiting: on CUDA, copies into pinned memory queued
    on the stream behind the work that makes them, and an event to wait on; on CPU, the tensors themselves.

        >>> HostCopy([torch.arange(3)]).wait()[0].tolist()
        [0, 1, 2]
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event = None
        if not tensors or tensors[0].device.type == "cpu":
            self._host = tensors
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                      for t in tensors]
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host, once their copies are done."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
