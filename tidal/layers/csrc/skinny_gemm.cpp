// Skinny bf16 matrix products for decode: out[M, N] = x[M, K] @ w[N, K]^T (+ bias) with M small
// (one to four rows: decode of one or a few requests). Such products are bound by reading the
// weight once, so the kernel streams each weight row once for all M rows, with AVX-512 BF16 dot
// products (VDPBF16PS: bf16 pairs multiplied, accumulated in fp32) and rounds to bf16 at the end.
// Rows of the output are split over OpenMP threads. Plain C ABI (ctypes), no torch headers.
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

extern "C" int tidal_skinny_gemm_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512BF16__)

static inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

static inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16; float f; std::memcpy(&f, &u, 4); return f;
}

// R output columns (weight rows) at a time for all M input rows: M * R fp32 accumulators.
template <int M, int R>
static inline void tile(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
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
static void skinny(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
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
    tile<M, R>(x, w, bias, out, n0, N, K);
  }
  for (int64_t n0 = tiles * R; n0 < N; ++n0) tile<M, 1>(x, w, bias, out, n0, N, K);
}

#endif

// Returns 0 when it ran, -1 when this build or M (1 to 4) does not support it (the caller uses its fallback).
extern "C" int tidal_skinny_gemm_bf16(const void* x, const void* w, const void* bias, void* out,
                                      int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(__AVX512BF16__)
  auto xs = static_cast<const uint16_t*>(x);
  auto ws = static_cast<const uint16_t*>(w);
  auto bs = static_cast<const uint16_t*>(bias);
  auto os = static_cast<uint16_t*>(out);
  switch (M) {
    case 1: skinny<1>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 2: skinny<2>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 3: skinny<3>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 4: skinny<4>(xs, ws, bs, os, N, K, num_threads); return 0;
    default: return -1;
  }
#else
  (void)x; (void)w; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}
