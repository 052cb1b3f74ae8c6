"""Native CPU kernels: plain C++ sources (no torch headers) compiled on first use with the machine's
compiler into ~/.cache/tidal/kernels (or $TIDAL_CACHE_DIR/kernels) and called through ctypes.

Each source is built once per ISA level, with that level's instruction-set flags (never
-march=native), so a build runs on every CPU of its level:

    avx512_bf16   AVX-512 F/BW/VL/DQ + BF16 + VNNI (AMD Zen 4 and later, Intel Cooper/Sapphire Rapids)
    avx512        AVX-512 F/BW/VL/DQ (Intel Skylake-X, Ice Lake)
    avx2          AVX2 + FMA + F16C (Intel Haswell and later, AMD Zen 1-3)
    generic       the compiler's baseline (other CPUs, other architectures)

The level in use is the highest the CPU supports (its flags in /proc/cpuinfo), capped by
TIDAL_CPU_ISA (e.g. TIDAL_CPU_ISA=avx2 on an AVX-512 machine runs the AVX2 code). A library file is
named by its level and a hash of the sources and flags, so a build made on one machine is never loaded
on a CPU that cannot run it, even with a cache directory shared between machines.

Without a compiler (or with TIDAL_NATIVE_KERNELS=0) `NativeLibrary.get()` returns None and callers use
their torch implementation; a failed build logs the compiler's message and leaves no file behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

# lowest to highest; each level's CPU flags (as /proc/cpuinfo names them) and compiler flags
ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")
_ISA_CPU_FLAGS = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                    "avx512_vnni"),
}
_ISA_COMPILE_FLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mavx512vnni"],
}


def cache_dir() -> str:
    return os.environ.get("TIDAL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tidal"))


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def detected_isa() -> str:
    """The highest ISA level this CPU supports."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    flags = _cpu_flags()
    return max((level for level in ISA_LEVELS if all(f in flags for f in _ISA_CPU_FLAGS[level])),
               key=ISA_LEVELS.index)


_forced: list[str] = []  # isa_override() stack (tests)


@functools.cache
def _env_isa(requested: str | None) -> str:
    level = detected_isa()
    if not requested:
        return level
    if requested not in ISA_LEVELS:
        raise ValueError(f"TIDAL_CPU_ISA must be one of {', '.join(ISA_LEVELS)}; got {requested!r}")
    if ISA_LEVELS.index(requested) > ISA_LEVELS.index(level):
        logger.warning("TIDAL_CPU_ISA=%s is above what this CPU supports (%s); using %s", requested, level, level)
        return level
    return requested


@functools.cache
def _process_isa() -> str:
    """TIDAL_CPU_ISA's level, resolved once per process (every native call asks for it)."""
    return _env_isa(os.environ.get("TIDAL_CPU_ISA") or None)


def cpu_isa() -> str:
    """The ISA level the native kernels are built for: the CPU's, capped by TIDAL_CPU_ISA, or
    isa_override's."""
    return _forced[-1] if _forced else _process_isa()


def has_native_bf16() -> bool:
    """Whether this CPU (as capped by TIDAL_CPU_ISA) computes bf16 products natively (AVX-512 BF16):
    without it, torch's bf16 GEMMs are several times slower than its fp32 ones."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in _cpu_flags()
    return cpu_isa() == "avx512_bf16"


@contextlib.contextmanager
def isa_override(level: str) -> Iterator[None]:
    """Run the kernels of `level` (at most the CPU's) inside the block: lets tests check the AVX2 code
    on an AVX-512 machine."""
    if level not in ISA_LEVELS or ISA_LEVELS.index(level) > ISA_LEVELS.index(detected_isa()):
        raise ValueError(f"ISA level {level!r} cannot run on this CPU ({detected_isa()})")
    _forced.append(level)
    try:
        yield
    finally:
        _forced.pop()


def runnable_isas() -> list[str]:
    """Every ISA level this CPU can run, lowest first."""
    return list(ISA_LEVELS[:ISA_LEVELS.index(detected_isa()) + 1])


class NativeLibrary:
    """One C++ source (plus the headers beside it) built into a shared library per ISA level, loaded
    once per process and level (thread-safe)."""

    def __init__(self, name: str, src: str, compile_flags: list[str], link_flags: list[str],
                 configure: Callable[[ctypes.CDLL], None]) -> None:
        self.name, self.src = name, src
        self.compile_flags, self.link_flags = compile_flags, link_flags
        self.configure = configure  # sets restype / argtypes of the exported functions
        self._lock = threading.Lock()
        self._libs: dict[str, ctypes.CDLL | None] = {}  # per level; None: failed

    def get(self, isa: str | None = None) -> ctypes.CDLL | None:
        level = isa or cpu_isa()
        if level in self._libs:
            return self._libs[level]
        with self._lock:
            if level not in self._libs:
                lib = None
                if os.environ.get("TIDAL_NATIVE_KERNELS", "1") != "0":
                    try:
                        lib = ctypes.CDLL(self._build(level))
                        self.configure(lib)
                        logger.info("native CPU kernels %s: %s build", self.name, level)
                    except Exception as e:  # noqa: BLE001  no compiler, build error: fall back to torch ops
                        logger.warning("native CPU kernel %s (%s) unavailable; using torch ops: %s", self.name,
                                       level, e)
                        lib = None
                self._libs[level] = lib
        return self._libs[level]

    def _sources(self) -> bytes:
        """The source and every header beside it (an edit to either makes a new build)."""
        parts = []
        for path in [self.src, *sorted(glob.glob(os.path.join(os.path.dirname(self.src), "*.h")))]:
            with open(path, "rb") as f:
                parts.append(f.read())
        return b"\0".join(parts)

    def _build(self, level: str) -> str:
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise RuntimeError("no C++ compiler found (set CXX or install g++)")
        compile_flags = [*self.compile_flags, *_ISA_COMPILE_FLAGS[level]]
        key = hashlib.sha256(self._sources() + " ".join([cxx, *compile_flags, *self.link_flags]).encode()
                             ).hexdigest()[:16]
        out_dir = os.path.join(cache_dir(), "kernels")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{self.name}-{level}-{key}.so")
        if os.path.exists(path):
            return path
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{self.name}-", suffix=".so")
        os.close(fd)
        obj = tmp + ".o"
        try:
            # compile and link separately: flags such as -ffast-math must not reach the link step, where
            # GCC would add a constructor setting flush-to-zero for the whole process
            for cmd in ([cxx, *compile_flags, "-fPIC", "-c", self.src, "-o", obj],
                        [cxx, *self.link_flags, "-shared", obj, "-o", tmp]):
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    message = (proc.stderr or proc.stdout).strip()
                    lines = message.splitlines()
                    raise RuntimeError(f"{os.path.basename(cxx)} exited with status {proc.returncode}: "
                                       + "\n".join(lines[:20]) + ("\n..." if len(lines) > 20 else ""))
            os.replace(tmp, path)  # atomic: concurrent builders never load half a file
        finally:
            for leftover in (obj, tmp):
                if os.path.exists(leftover):
                    os.remove(leftover)
        return path
