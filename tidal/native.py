"""Native CPU kernels: plain C++ sources (no torch headers) compiled on first use with the machine's
compiler into ~/.cache/tidal/kernels (or $TIDAL_CACHE_DIR/kernels) and called through ctypes. A build
takes a second or two and is keyed by a hash of the source and flags. Without a compiler (or with
TIDAL_NATIVE_KERNELS=0) `NativeLibrary.get()` returns None and callers use their torch implementation.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def cache_dir() -> str:
    return os.environ.get("TIDAL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tidal"))


class NativeLibrary:
    """One C++ source built into a shared library, loaded once per process (thread-safe)."""

    def __init__(self, name: str, src: str, compile_flags: list[str], link_flags: list[str],
                 configure: Callable[[ctypes.CDLL], None]) -> None:
        self.name, self.src = name, src
        self.compile_flags, self.link_flags = compile_flags, link_flags
        self.configure = configure  # sets restype / argtypes of the exported functions
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failed = False

    def get(self) -> ctypes.CDLL | None:
        if self._lib is not None or self._failed:
            return self._lib
        with self._lock:
            if self._lib is None and not self._failed:
                if os.environ.get("TIDAL_NATIVE_KERNELS", "1") == "0":
                    self._failed = True
                else:
                    try:
                        lib = ctypes.CDLL(self._build())
                        self.configure(lib)
                        self._lib = lib
                    except Exception as e:  # noqa: BLE001  no compiler, build error: fall back to torch ops
                        logger.warning("native CPU kernel %s unavailable (%s); using torch ops", self.name, e)
                        self._failed = True
        return self._lib

    def _build(self) -> str:
        with open(self.src, "rb") as f:
            src = f.read()
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise RuntimeError("no C++ compiler found")
        key = hashlib.sha256(src + " ".join([cxx, *self.compile_flags, *self.link_flags]).encode()).hexdigest()[:16]
        out_dir = os.path.join(cache_dir(), "kernels")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{self.name}-{key}.so")
        if os.path.exists(path):
            return path
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        obj = tmp + ".o"
        try:
            # compile and link separately: flags such as -ffast-math must not reach the link step, where
            # GCC would add a constructor setting flush-to-zero for the whole process
            subprocess.run([cxx, *self.compile_flags, "-fPIC", "-c", self.src, "-o", obj], check=True,
                           capture_output=True)
            subprocess.run([cxx, *self.link_flags, "-shared", obj, "-o", tmp], check=True, capture_output=True)
        finally:
            if os.path.exists(obj):
                os.remove(obj)
        os.replace(tmp, path)  # atomic: concurrent builders never load half a file
        return path
