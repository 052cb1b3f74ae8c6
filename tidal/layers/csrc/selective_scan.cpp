// Mamba selective scan for CPU, fp32: one pass over time, nothing of size [L, d, N] materialised
// (the torch path writes exp(dt A) and every state to memory).
//   h_t = exp(dt_t A) h_{t-1} + (dt x)_t B_t ;   y_t = h_t . C_t
// Layouts (contiguous): dt, dtx [L, R, d]; A [d, N]; B, C [L, R, N]; h [R, d, N] (in: initial
// state, out: final state); y [L, R, d]. Snapshots: for s < num_snaps, the state of request
// snap_r[s] after step snap_t[s] is written to snap_out[s] ([d, N]).
//
// Work is split into (request, block of 64 channels); a block's state [N][64] and A^T [N][64] stay
// in L1 for the whole sequence, each step reads 64 contiguous dt / dt*x values, and the inner loops
// run over channels so exp, the multiply-add and the C read-out vectorise.
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {
constexpr int64_t kBlock = 64;
constexpr int64_t kMaxState = 256;
}  // namespace

extern "C" void tidal_selective_scan(const float* dt, const float* dtx, const float* A, const float* B,
                                     const float* C, float* h, float* y, const int64_t* snap_t,
                                     const int64_t* snap_r, float* snap_out, int64_t num_snaps, int64_t L,
                                     int64_t R, int64_t d, int64_t N) {
    const int64_t num_blocks = (d + kBlock - 1) / kBlock;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t blk = 0; blk < num_blocks; ++blk) {
            const int64_t i0 = blk * kBlock, w = std::min(kBlock, d - i0);
            alignas(64) float state[kMaxState][kBlock];
            alignas(64) float at[kMaxState][kBlock];
            alignas(64) float acc[kBlock];
            for (int64_t n = 0; n < N; ++n) {
                for (int64_t j = 0; j < w; ++j) {
                    state[n][j] = h[(r * d + i0 + j) * N + n];
                    at[n][j] = A[(i0 + j) * N + n];
                }
            }
            for (int64_t t = 0; t < L; ++t) {
                const float* a = dt + (t * R + r) * d + i0;
                const float* u = dtx + (t * R + r) * d + i0;
                const float* Bt = B + (t * R + r) * N;
                const float* Ct = C + (t * R + r) * N;
                for (int64_t j = 0; j < w; ++j) acc[j] = 0.f;
                for (int64_t n = 0; n < N; ++n) {
                    const float b = Bt[n], c = Ct[n];
                    float* s = state[n];
                    const float* an = at[n];
#pragma omp simd
                    for (int64_t j = 0; j < w; ++j) {
                        const float v = std::exp(a[j] * an[j]) * s[j] + u[j] * b;
                        s[j] = v;
                        acc[j] += v * c;
                    }
                }
                float* yt = y + (t * R + r) * d + i0;
                for (int64_t j = 0; j < w; ++j) yt[j] = acc[j];
                for (int64_t k = 0; k < num_snaps; ++k) {
                    if (snap_t[k] == t && snap_r[k] == r) {
                        for (int64_t n = 0; n < N; ++n)
                            for (int64_t j = 0; j < w; ++j) snap_out[(k * d + i0 + j) * N + n] = state[n][j];
                    }
                }
            }
            for (int64_t n = 0; n < N; ++n)
                for (int64_t j = 0; j < w; ++j) h[(r * d + i0 + j) * N + n] = state[n][j];
        }
    }
}
