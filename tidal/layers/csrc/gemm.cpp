// Matrix products out[M, N] = x[M, K] @ w[N, K]^T (+ bias) with bf16 weights, for CPUs of every ISA
// level. Plain C ABI (ctypes), no torch headers.
//
// tidal_linear_f32_bf16w: fp32 activations, bf16 weights, fp32 out. The weights are widened to fp32 in
// registers (exact), so the product is the fp32 product of the bf16-rounded weights: half the bytes of
// an fp32 weight for the same arithmetic, the way to run bf16 checkpoints fast on CPUs without native
// bf16 products (AVX2). Every output is one fp32 dot product: W-lane partial sums in k order, the same
// lane reduction, then the ragged tail and the bias, whatever M is and however rows are grouped, so a
// row's result never depends on the other rows of the batch.
//   M <= 8 (decode of a few requests): weights streamed from memory, widened as they are used.
//   M > 8: blocks of weight rows are widened once into an L2-resident fp32 buffer and reused by all M
//   rows in 4 x NR register tiles.
//
// tidal_skinny_gemm_bf16: bf16 activations and weights, bf16 out, M 1..4 (decode of a few requests in
// a bf16 model): VDPBF16PS on AVX-512 BF16, elsewhere the activations are widened and the fp32 path
// above runs.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

using simd::bf16_to_float;
using simd::float_to_bf16;

#if defined(TIDAL_VEC)
using simd::vf;
using simd::W;

// Up to this many rows, weights are widened in registers as they stream (in passes of four rows);
// beyond, blocks of widened weights serve all rows (measured on SmolLM2's shapes: two skinny passes
// beat the widened blocks at eight rows, not at sixteen).
constexpr int64_t kSkinnyMaxRows = 8;

template <bool WIDEN> static inline vf load_w(const void* w, int64_t i) {
  if constexpr (WIDEN) return simd::load_bf16(static_cast<const uint16_t*>(w) + i);
  else return simd::load(static_cast<const float*>(w) + i);
}

template <bool WIDEN> static inline float load_w1(const void* w, int64_t i) {
  if constexpr (WIDEN) return bf16_to_float(static_cast<const uint16_t*>(w)[i]);
  else return static_cast<const float*>(w)[i];
}

// MR x NR outputs: x rows [m0, m0 + MR) (stride ldx) against weight rows w + r * K, r < NR (bf16 when
// WIDEN, else already widened fp32). out[m * ldo + r] = sum_k x[m, k] w[r, k] (+ bias[r]).
template <int MR, int NR, bool WIDEN>
static inline void dot_tile(const float* x, int64_t ldx, const void* w, int64_t K, const float* bias, float* out,
                            int64_t ldo) {
  vf acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = simd::zero();
  const int64_t kfull = K - K % W;
  for (int64_t k = 0; k < kfull; k += W) {
    vf xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = simd::load(x + m * ldx + k);
    for (int r = 0; r < NR; ++r) {
      const vf wv = load_w<WIDEN>(w, r * K + k);
      for (int m = 0; m < MR; ++m) acc[m][r] = simd::fmadd(xv[m], wv, acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = simd::reduce_add(acc[m][r]);
      for (int64_t k = kfull; k < K; ++k) s += x[m * ldx + k] * load_w1<WIDEN>(w, r * K + k);
      if (bias) s += bias[r];
      out[m * ldo + r] = s;
    }
}

// weight rows per register tile, by rows of x: MR + 1 + MR * NR registers (16 on AVX2, 32 on AVX-512)
template <int MR> constexpr int skinny_nr() { return W == 16 ? (MR <= 2 ? 8 : 4) : (MR == 1 ? 8 : MR == 2 ? 4 : MR == 3 ? 3 : 2); }

template <int MR>
static void skinny_f32(const float* x, const uint16_t* w, const float* bias, float* out, int64_t N, int64_t K,
                       int num_threads) {
  constexpr int NR = skinny_nr<MR>();
  const int64_t tiles = N / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR;
    // each weight row is read once, straight from memory: ask for the rows a few tiles ahead
    if (n0 + 4 * NR < N)
      simd::prefetch_bytes(reinterpret_cast<const char*>(w + (n0 + 4 * NR) * K), NR * K * 2);
    dot_tile<MR, NR, true>(x, K, w + n0 * K, K, bias ? bias + n0 : nullptr, out + n0, N);
  }
  for (int64_t n0 = tiles * NR; n0 < N; ++n0)
    dot_tile<MR, 1, true>(x, K, w + n0 * K, K, bias ? bias + n0 : nullptr, out + n0, N);
}

// register tile of the blocked path: MR rows of x by NR weight rows, MR + 1 + MR * NR registers
constexpr int kBlockMR = W == 16 ? 4 : 3;
constexpr int kBlockNR = W == 16 ? 6 : 4;

template <int NR>
static void rows_tile(const float* x, int64_t M, const float* wf, int64_t K, const float* bias, float* out,
                      int64_t N) {
  constexpr int MR = kBlockMR;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) dot_tile<MR, NR, false>(x + m * K, K, wf, K, bias, out + m * N, N);
  switch (M - m) {
    case 3: dot_tile<3, NR, false>(x + m * K, K, wf, K, bias, out + m * N, N); break;
    case 2: dot_tile<2, NR, false>(x + m * K, K, wf, K, bias, out + m * N, N); break;
    case 1: dot_tile<1, NR, false>(x + m * K, K, wf, K, bias, out + m * N, N); break;
    default: break;
  }
}

static void blocked_f32(const float* x, const uint16_t* w, const float* bias, float* out, int64_t M, int64_t N,
                        int64_t K, int num_threads) {
  constexpr int NR = kBlockNR;
  // weight rows per block: about 96 KiB of widened weights (L2), a multiple of NR
  const int64_t NB = std::max<int64_t>(NR, std::min<int64_t>(64, (96 * 1024 / (4 * K)) / NR * NR));
  const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> wf(NB * K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * NB, nb = std::min(NB, N - n0);
      const uint16_t* src = w + n0 * K;
      int64_t i = 0;
      for (; i + W <= nb * K; i += W) simd::store(wf.data() + i, simd::load_bf16(src + i));
      for (; i < nb * K; ++i) wf[i] = bf16_to_float(src[i]);
      int64_t r = 0;
      for (; r + NR <= nb; r += NR)
        rows_tile<NR>(x, M, wf.data() + r * K, K, bias ? bias + n0 + r : nullptr, out + n0 + r, N);
      for (; r < nb; ++r) rows_tile<1>(x, M, wf.data() + r * K, K, bias ? bias + n0 + r : nullptr, out + n0 + r, N);
    }
  }
}
#endif

static void linear_f32_bf16w(const float* x, const uint16_t* w, const float* bias, float* out, int64_t M,
                             int64_t N, int64_t K, int num_threads) {
#if defined(TIDAL_VEC)
  if (M > kSkinnyMaxRows) {
    // chunks of rows whose activations stay in L2 while every weight block passes over them
    const int64_t chunk = std::max<int64_t>(kSkinnyMaxRows + 1, (256 * 1024) / (4 * K));
    for (int64_t m0 = 0; m0 < M; m0 += chunk)
      blocked_f32(x + m0 * K, w, bias, out + m0 * N, std::min(chunk, M - m0), N, K, num_threads);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {  // up to two passes of up to four rows over the streamed weights
    const float* xm = x + m0 * K;
    float* om = out + m0 * N;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: skinny_f32<1>(xm, w, bias, om, N, K, num_threads); break;
      case 2: skinny_f32<2>(xm, w, bias, om, N, K, num_threads); break;
      case 3: skinny_f32<3>(xm, w, bias, om, N, K, num_threads); break;
      default: skinny_f32<4>(xm, w, bias, om, N, K, num_threads); break;
    }
  }
#else
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * bf16_to_float(w[n * K + k]);
      out[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
#endif
}

#if defined(__AVX512BF16__)
// R output columns (weight rows) at a time for all M input rows: M * R fp32 accumulators.
template <int M, int R>
static inline void tile_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                             int64_t n0, int64_t N, int64_t K) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t kfull = K & ~int64_t(31);
  for (int64_t k = 0; k < kfull; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if (kfull < K) {
    const __mmask32 mask = (__mmask32)((1ull << (K - kfull)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + r) * K + kfull);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + kfull);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      if (bias) s += bf16_to_float(bias[n0 + r]);
      out[m * N + n0 + r] = float_to_bf16(s);
    }
}

template <int M>
static void skinny_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t N, int64_t K, int num_threads) {
  constexpr int R = 4;
  const int64_t tiles = N / R;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * R;
    // prefetch the weight rows a few tiles ahead: each row is read once, straight from memory
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + 4 * R) * K);
    if (n0 + 4 * R < N)
      for (int64_t b = 0; b < R * K * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    tile_bf16<M, R>(x, w, bias, out, n0, N, K);
  }
  for (int64_t n0 = tiles * R; n0 < N; ++n0) tile_bf16<M, 1>(x, w, bias, out, n0, N, K);
}
#endif

extern "C" {
// x [M, K] fp32, w [N, K] bf16, bias [N] fp32 or null, out [M, N] fp32; all contiguous.
void tidal_linear_f32_bf16w(const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t N,
                            int64_t K, int num_threads) {
  linear_f32_bf16w(static_cast<const float*>(x), static_cast<const uint16_t*>(w), static_cast<const float*>(bias),
                   static_cast<float*>(out), M, N, K, num_threads);
}

// x [M, K], w [N, K], bias [N] (or null), out [M, N], all bf16 and contiguous. Returns 0 when it ran,
// -1 when M is outside 1..4 or this build has no vector path (the caller uses its fallback).
int tidal_skinny_gemm_bf16(const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t N,
                           int64_t K, int num_threads) {
  if (M < 1 || M > 4) return -1;
  auto xs = static_cast<const uint16_t*>(x);
  auto ws = static_cast<const uint16_t*>(w);
  auto bs = static_cast<const uint16_t*>(bias);
  auto os = static_cast<uint16_t*>(out);
#if defined(__AVX512BF16__)
  switch (M) {
    case 1: skinny_bf16<1>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 2: skinny_bf16<2>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 3: skinny_bf16<3>(xs, ws, bs, os, N, K, num_threads); return 0;
    default: skinny_bf16<4>(xs, ws, bs, os, N, K, num_threads); return 0;
  }
#elif defined(TIDAL_VEC)
  std::vector<float> xf(M * K), bf(bias ? N : 0), of(M * N);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xs[i]);
  for (int64_t i = 0; i < (bias ? N : 0); ++i) bf[i] = bf16_to_float(bs[i]);
  linear_f32_bf16w(xf.data(), ws, bias ? bf.data() : nullptr, of.data(), M, N, K, num_threads);
  for (int64_t i = 0; i < M * N; ++i) os[i] = float_to_bf16(of[i]);
  return 0;
#else
  (void)xs; (void)ws; (void)bs; (void)os; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}
}
