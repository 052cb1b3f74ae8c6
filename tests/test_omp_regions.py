"""benchmarks/omp_regions.py: its libgomp shim's per-thread figures on a small OpenMP program whose waits are
known (one thread kept busy longer than the other), and the names it gives the regions."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers import load_benchmark

omp_regions = load_benchmark("omp_regions")

PROGRAM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
static void spin_ms(double ms) {
  double t = omp_get_wtime();
  while ((omp_get_wtime() - t) * 1e3 < ms) {}
}
int main(void) {
  for (int i = 0; i < 4; ++i) {
#pragma omp parallel num_threads(2)
    spin_ms(omp_get_thread_num() == 1 ? 30 : 5);  /* thread 0 waits ~25 ms at each region's end */
  }
  void (*mark)(int) = (void (*)(int))dlsym(RTLD_DEFAULT, "omp_regions_phase");  /* the preloaded shim's */
  if (!mark) return 1;
  mark(2);
#pragma omp parallel num_threads(2)
  {
#pragma omp for schedule(static)
    for (int i = 0; i < 2; ++i) spin_ms(i == 0 ? 40 : 10);  /* thread 1 waits ~30 ms at the loop's end */
  }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the shim is built with gcc")
def test_the_shim_puts_each_wait_on_the_thread_that_waited(tmp_path):
    shim = omp_regions.build(str(tmp_path))
    src, exe = tmp_path / "waits.c", tmp_path / "waits"
    src.write_text(PROGRAM)
    subprocess.run(["gcc", "-O1", "-fopenmp", str(src), "-o", str(exe), "-ldl"], check=True)
    data = omp_regions.run(shim, [str(exe)], str(tmp_path), "waits")
    by_phase = {r["phase"]: r for r in data["regions"]}
    assert set(by_phase) == {0, 2}
    ms = 1e-6
    first, second = by_phase[0], by_phase[2]
    assert first["calls"] == 4 and second["calls"] == 1
    (busy0, _, end0, _), (busy1, _, end1, _) = first["threads"]
    assert 4 * 20 < end0 * ms < 4 * 60, "thread 0 finishes its 5 ms and waits for thread 1's 30"
    assert end1 * ms < 4 * 5
    assert 4 * 28 < busy1 * ms < 4 * 60 and 4 * 4 < busy0 * ms < 4 * 20
    assert 4 * 28 < first["wall"] * ms < 4 * 60
    # inside the body: the loop's end is where thread 1 waits (counted in its busy time, not at the region's end)
    (_, _, _, loop0), (_, _, _, loop1) = second["threads"]
    assert 20 < loop1 * ms < 60 and loop0 * ms < 10
    # between the five regions, four gaps of the opening thread, none of them long
    gaps = [n for phase in data["gaps"] for n, _ in phase]
    assert sum(gaps) == 4


def test_region_names_lose_their_return_type_parameters_and_clone_suffix():
    assert omp_regions.short_name("void decode<1, 1>(void const*, long) [clone ._omp_fn.1]") == "decode<1, 1>"
    assert omp_regions.short_name("amx::gemm(unsigned short const*, long) [clone ._omp_fn.0]") == "amx::gemm"
    assert omp_regions.short_name("tidal_unpack_bf16_rows._omp_fn.0") == "tidal_unpack_bf16_rows._omp_fn.0"
    assert os.path.basename(omp_regions.name_of("/nowhere/libx-abc.so", 0x10, {})) == "libx-abc.so+0x10"
