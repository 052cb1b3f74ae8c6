"""Building the native kernels: one library per ISA level, named by it; a failed build says why and
leaves nothing behind."""
from __future__ import annotations

import ctypes
import logging
import os

import pytest

from tidal.native import NativeLibrary, cpu_isa, isa_override, runnable_isas


def _noop(lib: ctypes.CDLL) -> None:
    lib.tidal_answer.restype = ctypes.c_int


def test_each_isa_level_gets_its_own_library(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    src = tmp_path / "answer.cpp"
    src.write_text('extern "C" int tidal_answer() {\n#if defined(__AVX2__)\n  return 2;\n#else\n  return 0;\n'
                   '#endif\n}\n')
    lib = NativeLibrary("answer", str(src), ["-O1"], [], _noop)
    built = {}
    for level in runnable_isas():
        with isa_override(level):
            assert cpu_isa() == level
            built[level] = lib.get().tidal_answer()
    assert built["generic"] == 0
    if "avx2" in built:
        assert built["avx2"] == 2
    names = sorted(os.listdir(tmp_path / "kernels"))
    assert [n.split("-")[1] for n in names] == sorted(runnable_isas())  # answer-<level>-<hash>.so
    assert all(n.endswith(".so") for n in names)


def test_a_level_above_the_cpus_is_refused(monkeypatch):
    import tidal.native
    monkeypatch.setattr(tidal.native, "detected_isa", lambda: "avx2")  # as on a Zen 3
    with pytest.raises(ValueError, match="cannot run on this CPU"):
        with isa_override("avx512_bf16"):
            pass


def test_failed_build_logs_the_compiler_message_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    src = tmp_path / "broken.cpp"
    src.write_text('extern "C" int tidal_answer() { return undeclared_name; }\n')
    lib = NativeLibrary("broken", str(src), ["-O1"], [], _noop)
    with caplog.at_level(logging.WARNING, logger="tidal.native"):
        assert lib.get() is None
    assert "undeclared_name" in caplog.text and "using torch ops" in caplog.text
    assert os.listdir(tmp_path / "kernels") == []
    assert lib.get() is None  # not retried on every call
