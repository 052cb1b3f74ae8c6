"""The CPU's arithmetic peak, the ceiling the products of a prompt step are measured against.

    python benchmarks/cpu_peak.py [--threads 2]

Compiles (g++ -O2 -march=native -fopenmp) and runs loops of independent accumulators that all stay in
registers (10 of AVX2's 16, 24 of AVX-512's 32: more spill, and the loop then measures the stores),
so that nothing but the vector units bounds them: fp32 FMA on 8 lanes (AVX2), fp32 FMA on
16 lanes (AVX-512) and bf16 pair dot products into fp32 (VDPBF16PS, AVX-512 BF16), each where the CPU
has it. Prints GFLOP/s per thread count (a multiply-add is two FLOPs; a VDPBF16PS of 32 bf16 pairs is 64),
best of five runs, and one JSON line starting with "RESULT ".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

static long ITERS = 20000000;

template <typename V, int CHAINS, typename Step>
static double run(Step step, V init, int flops_per_op) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = omp_get_wtime();
        float sink = 0;
        #pragma omp parallel reduction(+:sink)
        {
            V acc[CHAINS];
            for (int i = 0; i < CHAINS; i++) acc[i] = init;
            for (long it = 0; it < ITERS; it++) {
                #pragma GCC unroll 32
                for (int i = 0; i < CHAINS; i++) acc[i] = step(acc[i]);
            }
            float lanes[64];
            for (int i = 0; i < CHAINS; i++) {
                memcpy(lanes, &acc[i], sizeof(V));
                sink += lanes[0];
            }
        }
        double rate = (double)ITERS * CHAINS * flops_per_op * omp_get_max_threads() / (omp_get_wtime() - t0);
        if (rate > best) best = rate;
        if (sink == 1234.5f) printf("#");  // keeps the loop
    }
    return best / 1e9;
}

int main(int argc, char **argv) {
    const char *what = argv[1];
    double g = -1;
#if defined(__AVX2__) && defined(__FMA__)
    if (!strcmp(what, "avx2_fma")) {
        __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-6f);
        g = run<__m256, 10>([=](__m256 x) { return _mm256_fmadd_ps(x, a, b); }, _mm256_set1_ps(1.f), 16);
    }
#endif
#if defined(__AVX512F__)
    if (!strcmp(what, "avx512_fma")) {
        __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-6f);
        g = run<__m512, 24>([=](__m512 x) { return _mm512_fmadd_ps(x, a, b); }, _mm512_set1_ps(1.f), 32);
    }
#endif
#if defined(__AVX512BF16__)
    if (!strcmp(what, "avx512_bf16_dot")) {
        __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
        g = run<__m512, 24>([=](__m512 x) { return _mm512_dpbf16_ps(x, a, b); }, _mm512_set1_ps(1.f), 64);
    }
#endif
    printf("%.1f\n", g);
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    args = ap.parse_args()
    flags = open("/proc/cpuinfo").read().split()
    kinds = [k for k, need in (("avx2_fma", "fma"), ("avx512_fma", "avx512f"), ("avx512_bf16_dot", "avx512_bf16"))
             if need in flags]
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "peak.cpp"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", "-std=c++17", src, "-o", exe], check=True)
        for kind in kinds:
            for n in args.threads:
                out = subprocess.run([exe, kind], env=dict(os.environ, OMP_NUM_THREADS=str(n)), check=True,
                                     capture_output=True, text=True).stdout.split()[-1]
                result[f"{kind}_{n}t_gflops"] = float(out)
                print(f"{kind:16s} {n} thread(s): {float(out):8.1f} GFLOP/s")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
