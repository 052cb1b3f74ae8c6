// Matrix products out[M, N] = x[M, K] @ w[N, K]^T with 8-bit weights, for CPUs of every ISA level.
// Plain C ABI (ctypes), no torch headers. Every weight is read from the plain [N, K] row-major layout
// the checkpoint loader produced (one copy in memory, nothing prepacked); per-output-channel fp32
// scales w_scale[N] and an optional bias of x's dtype.
//
// tidal_w8a16_linear: fp32 or bf16 activations, int8 or fp8 (E4M3) weights. The weights are widened to
// fp32 in registers (exact) and every output is one fp32 dot product: W-lane partial sums in k order,
// the same lane reduction, then the ragged tail, then * w_scale + bias, whatever M is and however rows
// are grouped, so a row's result never depends on the other rows of the batch.
//   M <= 32 (decodes, short chunks): passes of up to 4 rows, each streaming the weights from memory
//   and widening them as they are used.
//   M > 32: blocks of weight rows are widened once into an L2-resident fp32 buffer and reused by all M
//   rows in register tiles (the same dot products, in the same order).
//   fp8: E4M3 byte b -> fp16 bits (sign << 15) | ((b & 0x7f) << 7), which is b's value * 2^-8 for
//   normals and denormals alike; F16C widens that to fp32 and the 2^8 is folded into the scale (exact).
//
// tidal_w8a8_linear: x quantized per row (symmetric, scale = max|x| / 127, round half to even), int8 x
// int8 products summed exactly in int32, out = acc * x_scale[m] * w_scale[n] + bias. Integer sums are
// exact, so any order gives the same accumulator; the epilogue is the same per-element arithmetic in
// every path (no contraction: built with -ffp-contract=off), so rows are batch-invariant here too.
//   AVX-512 VNNI: VPDPBUSD multiplies unsigned by signed bytes: the activations are shifted to
//   x + 128 (u8) and 128 * row_sum(w) is subtracted from each accumulator. M <= 4: 64-byte steps
//   along K per weight row; M > 4: the vector lanes run over 16 rows of x (x packed in groups of 16
//   rows, 4-byte quads interleaved), each weight quad broadcast from the plain layout.
//   AVX-512 without VNNI, AVX2: |x| (u8) times w with x's sign (s8) through VPMADDUBSW, pairs summed to
//   int32 by VPMADDWD with ones: no saturation since |x|, |w| <= 127. Blocked over L2-sized blocks of
//   weight rows for M > 4.
//   generic: scalar loops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

using simd::bf16_to_float;
using simd::float_to_bf16;

namespace {

enum DType : int { kF32 = 0, kBF16 = 1, kI32 = 2 };  // of x, bias and out (kI32: the raw accumulator)

// Up to this many rows of x, each weight row is streamed once against all of them.
constexpr int64_t kSkinnyMaxRows = 4;
// W8A16 runs passes of the skinny kernel (4 rows each) up to this many rows: measured on SmolLM2's
// shapes (Zen 5, 2 threads), they beat the blocked path at every M from 5 to 32 (2.3x at 5, 1.5x at 16,
// 1.25x at 32): both are FMA-bound, and the blocked path also widens every block and streams x from L2.
constexpr int64_t kW8A16SkinnyMaxRows = 32;

// The W8A16 skinny path reads each weight byte once, from memory: it asks for the bytes this far ahead
// of the tile being computed, one cache line per line consumed, issued inside the k loop (a separate
// prefetch loop per tile costs as much as the tile's arithmetic when the weights are in cache).
// Measured on SmolLM2's shapes at M = 1: ~40% less time than without, flat from 8 to 32 KiB ahead.
constexpr int64_t kPrefetchBytes = 16 * 1024;

// value of an E4M3 byte * 2^-8 (what the vector path widens to), NaN encodings not expected
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -17) : std::ldexp(static_cast<float>(8 + m), e - 18);
      v[b] = b & 0x80 ? -mag : mag;
    }
  }
};
const Fp8Table kFp8;

// thread-local scratch that keeps its capacity between calls
template <class T> T* scratch(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// rows [m0, m0 + rows) of x [M, K] (fp32 or bf16) as fp32: x itself, or a copy in a thread-local buffer
// (callers convert a bounded number of rows at a time, so that the buffer stays small)
const float* rows_f32(const void* x, int dtype, int64_t m0, int64_t rows, int64_t K) {
  if (dtype == kF32) return static_cast<const float*>(x) + m0 * K;
  static thread_local std::vector<float> buf;
  float* out = scratch(buf, rows * K);
  const uint16_t* src = static_cast<const uint16_t*>(x) + m0 * K;
  int64_t i = 0;
#if defined(TIDAL_VEC)
  for (; i + simd::W <= rows * K; i += simd::W) simd::store(out + i, simd::load_bf16(src + i));
#endif
  for (; i < rows * K; ++i) out[i] = bf16_to_float(src[i]);
  return out;
}

inline float load_bias(const void* bias, int dtype, int64_t n) {
  return dtype == kBF16 ? bf16_to_float(static_cast<const uint16_t*>(bias)[n]) : static_cast<const float*>(bias)[n];
}

inline void store_out(void* out, int dtype, int64_t i, float v) {
  if (dtype == kBF16) static_cast<uint16_t*>(out)[i] = float_to_bf16(v);
  else static_cast<float*>(out)[i] = v;
}

// ---------------------------------------------------------------------------------------------------
// W8A16: fp32 dot products against widened 8-bit weights

// out[m, n] = s * (w_scale[n] * post) + bias[n], s the dot product of row m and weight row n
struct F32Epilogue {
  const float* w_scale;
  float post;  // 2^8 for fp8 (its widened values are b * 2^-8), else 1
  const void* bias;
  void* out;
  int dtype;  // of bias and out
  int64_t N;
  inline void operator()(int64_t m, int64_t n, float s) const {
    float v = s * (w_scale[n] * post);
    if (bias) v = v + load_bias(bias, dtype, n);
    store_out(out, dtype, m * N + n, v);
  }
#if defined(TIDAL_VEC)
  // the same for the W / 4 rows m0 + m by 4 columns n0 + r held in lane 4m + r of s
  inline void store_square(simd::vf s, int64_t m0, int64_t n0) const;
#endif
};

struct Int8W {
  using T = int8_t;
  static inline float one(const T* p) { return static_cast<float>(*p); }
#if TIDAL_VEC == 16
  static inline simd::vf vec(const T* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
#elif TIDAL_VEC == 8
  static inline simd::vf vec(const T* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#endif
};

struct Fp8W {
  using T = uint8_t;
  static inline float one(const T* p) { return kFp8.v[*p]; }
#if TIDAL_VEC == 16
  static inline simd::vf vec(const T* p) {  // sign-extended byte << 7 has the sign in bit 15; bit 14 cleared
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
    return _mm512_cvtph_ps(h);
  }
#elif TIDAL_VEC == 8
  static inline simd::vf vec(const T* p) {
    __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
    return _mm256_cvtph_ps(h);
  }
#endif
};

struct F32W {  // weights already widened (the blocked path's buffer)
  using T = float;
  static inline float one(const T* p) { return *p; }
#if defined(TIDAL_VEC)
  static inline simd::vf vec(const T* p) { return simd::load(p); }
#endif
};

#if defined(TIDAL_VEC)
using simd::vf;
using simd::W;

// The lane sum of one fp32 accumulator, by one fixed tree (lanes i + W/2, then i + W/4, ...): written out
// here rather than left to the compiler's reduce builtin, because hsum_lanes below must match it bit
// for bit.
#if TIDAL_VEC == 16
inline float hsum(vf a) {
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// W lane sums at once, each by hsum's additions: lane 4j + e of the result is hsum(v[4e + j])
inline vf hsum_lanes(const vf v[16]) {
  vf t[8], u[4], w[2];
  for (int p = 0; p < 8; ++p)  // blocks [v2p 0-1 + v2p 2-3 | v2p+1 0-1 + v2p+1 2-3]: lanes i + i + 8
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44), _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xee));
  for (int q = 0; q < 4; ++q)  // block j: v[4q + j]'s lanes i + i + 4
    u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0x88), _mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0xdd));
  for (int h = 0; h < 2; ++h)  // lanes i + i + 2 of two accumulators per block
    w[h] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * h], u[2 * h + 1], 0x44), _mm512_shuffle_ps(u[2 * h], u[2 * h + 1], 0xee));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
}
#else
inline float hsum(vf a) {
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// lane 4j + e of the result is hsum(v[2e + j])
inline vf hsum_lanes(const vf v[8]) {
  vf t[4], u[2];
  for (int p = 0; p < 4; ++p)
    t[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20), _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
  for (int h = 0; h < 2; ++h)
    u[h] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * h], t[2 * h + 1], 0x44), _mm256_shuffle_ps(t[2 * h], t[2 * h + 1], 0xee));
  return _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xdd));
}
#endif

// MR x NR outputs: x rows m0 + [0, MR) (x points at row m0, stride ldx) against weight rows w + r * K,
// r < NR (output columns n0 + r). The order of every sum is fixed: W lanes over k in steps of W, hsum,
// the ragged tail in k order, then the epilogue.
// prefetch (or null): the bytes at prefetch + i, i < NR * K * sizeof(T), are asked for during the k loop
template <int MR, int NR, class Src>
inline void dot_tile(const float* x, int64_t ldx, const typename Src::T* w, int64_t K, const F32Epilogue& epi,
                     int64_t m0, int64_t n0, const char* prefetch = nullptr) {
  vf acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = simd::zero();
  const int64_t kfull = K - K % W;
  constexpr int64_t step_bytes = NR * W * sizeof(typename Src::T);  // of weights consumed per k step
  for (int64_t k = 0; k < kfull; k += W) {
    if (prefetch)
      for (int64_t b = 0; b < step_bytes; b += 64) _mm_prefetch(prefetch + k / W * step_bytes + b, _MM_HINT_T1);
    vf xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = simd::load(x + m * ldx + k);
    for (int r = 0; r < NR; ++r) {
      const vf wv = Src::vec(w + r * K + k);
      for (int m = 0; m < MR; ++m) acc[m][r] = simd::fmadd(xv[m], wv, acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t k = kfull; k < K; ++k) s = s + x[m * ldx + k] * Src::one(w + r * K + k);
      epi(m0 + m, n0 + r, s);
    }
}

// The blocked path's register tile: W / 4 rows of x by 4 rows of widened weights (wf, stride K), the W
// outputs finished together: hsum_lanes puts row m's four in lanes 4m .. 4m + 3, then the tail and the
// epilogue run on whole vectors, lane by lane the same operations as dot_tile's scalar ones.
constexpr int kSquareMR = W / 4;

inline void square_tile(const float* x, int64_t ldx, const float* wf, int64_t K, const F32Epilogue& epi, int64_t m0,
                        int64_t n0) {
  constexpr int MR = kSquareMR, NR = 4;
  vf acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = simd::zero();
  const int64_t kfull = K - K % W;
  for (int64_t k = 0; k < kfull; k += W) {
    vf xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = simd::load(x + m * ldx + k);
    for (int r = 0; r < NR; ++r) {
      const vf wv = simd::load(wf + r * K + k);
      for (int m = 0; m < MR; ++m) acc[m][r] = simd::fmadd(xv[m], wv, acc[m][r]);
    }
  }
  vf v[W];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) v[MR * r + m] = acc[m][r];  // lane 4m + r after hsum_lanes
  vf s = hsum_lanes(v);
  if (kfull < K) {  // lane 4m + r gathers x[m, k] and wf[r, k]
    alignas(64) int32_t xi[W], wi[W];
    for (int i = 0; i < W; ++i) {
      xi[i] = static_cast<int32_t>((i / 4) * ldx);
      wi[i] = static_cast<int32_t>((i % 4) * K);
    }
#if TIDAL_VEC == 16
    const __m512i xidx = _mm512_load_si512(xi), widx = _mm512_load_si512(wi);
    for (int64_t k = kfull; k < K; ++k)
      s = simd::add(s, simd::mul(_mm512_i32gather_ps(xidx, x + k, 4), _mm512_i32gather_ps(widx, wf + k, 4)));
#else
    const __m256i xidx = _mm256_load_si256(reinterpret_cast<const __m256i*>(xi));
    const __m256i widx = _mm256_load_si256(reinterpret_cast<const __m256i*>(wi));
    for (int64_t k = kfull; k < K; ++k)
      s = simd::add(s, simd::mul(_mm256_i32gather_ps(x + k, xidx, 4), _mm256_i32gather_ps(wf + k, widx, 4)));
#endif
  }
  epi.store_square(s, m0, n0);
}

// 4 consecutive fp32 (or bf16 widened to fp32) values repeated in every 4-lane block
#if TIDAL_VEC == 16
inline vf repeat4(__m128 v) { return _mm512_broadcast_f32x4(v); }
#else
inline vf repeat4(__m128 v) { return _mm256_broadcast_ps(&v); }
#endif
inline __m128 load4(const void* p, int dtype) {
  if (dtype != kBF16) return _mm_loadu_ps(static_cast<const float*>(p));
  const __m128i raw = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(raw), 16));
}

inline void F32Epilogue::store_square(vf s, int64_t m0, int64_t n0) const {
  vf v = simd::mul(s, simd::mul(repeat4(_mm_loadu_ps(w_scale + n0)), simd::set1(post)));
  const int elem = dtype == kBF16 ? 2 : 4;
  if (bias) v = simd::add(v, repeat4(load4(static_cast<const char*>(bias) + n0 * elem, dtype)));
  alignas(64) float lanes[W];
  simd::store(lanes, v);
  for (int m = 0; m < W / 4; ++m) {
    if (dtype == kBF16) {
      uint16_t* dst = static_cast<uint16_t*>(out) + (m0 + m) * N + n0;
      for (int r = 0; r < 4; ++r) dst[r] = float_to_bf16(lanes[4 * m + r]);
    } else {
      std::memcpy(static_cast<float*>(out) + (m0 + m) * N + n0, lanes + 4 * m, 4 * sizeof(float));
    }
  }
}

// weight rows per register tile, by rows of x: MR + 1 + MR * NR registers (16 on AVX2, 32 on AVX-512)
template <int MR> constexpr int skinny_nr() { return W == 16 ? (MR <= 2 ? 8 : 4) : (MR == 1 ? 8 : MR == 2 ? 4 : MR == 3 ? 3 : 2); }

template <int MR, class Src>
void skinny_w8a16(const float* x, const typename Src::T* w, const F32Epilogue& epi, int64_t m0, int64_t N, int64_t K,
                  int num_threads) {
  constexpr int NR = skinny_nr<MR>();
  const int64_t tiles = N / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR;
    dot_tile<MR, NR, Src>(x, K, w + n0 * K, K, epi, m0, n0, reinterpret_cast<const char*>(w + n0 * K) + kPrefetchBytes);
  }
  for (int64_t n0 = tiles * NR; n0 < N; ++n0) dot_tile<MR, 1, Src>(x, K, w + n0 * K, K, epi, m0, n0);
}

// M rows of x (from row m0) against NR widened weight rows (columns n0 ..)
template <int NR>
void rows_tile(const float* x, int64_t M, const float* wf, int64_t K, const F32Epilogue& epi, int64_t m0,
               int64_t n0) {
  constexpr int MR = kSquareMR;
  int64_t m = 0;
  if constexpr (NR == 4)
    for (; m + MR <= M; m += MR) square_tile(x + m * K, K, wf, K, epi, m0 + m, n0);
  for (; m + 2 <= M; m += 2) dot_tile<2, NR, F32W>(x + m * K, K, wf, K, epi, m0 + m, n0);
  if (m < M) dot_tile<1, NR, F32W>(x + m * K, K, wf, K, epi, m0 + m, n0);
}

// M rows of x (x points at row m0) against all weight rows, in blocks of weight rows widened once into
// fp32
template <class Src>
void blocked_w8a16(const float* x, const typename Src::T* w, const F32Epilogue& epi, int64_t m0, int64_t M,
                   int64_t N, int64_t K, int num_threads) {
  constexpr int NR = 4;
  // weight rows per block: about 96 KiB of widened weights (L2), a multiple of NR, and enough blocks
  // to keep every thread busy
  int64_t NB = std::max<int64_t>(NR, std::min<int64_t>(64, (96 * 1024 / (4 * K)) / NR * NR));
  while (NB > NR && (N + NB - 1) / NB < 4 * num_threads) NB -= NR;
  const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(num_threads)
  {
    static thread_local std::vector<float> buf;
    float* wf = scratch(buf, NB * K);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * NB, nb = std::min(NB, N - n0);
      const typename Src::T* src = w + n0 * K;
      int64_t i = 0;
      for (; i + W <= nb * K; i += W) simd::store(wf + i, Src::vec(src + i));
      for (; i < nb * K; ++i) wf[i] = Src::one(src + i);
      int64_t r = 0;
      for (; r + 4 <= nb; r += 4) rows_tile<4>(x, M, wf + r * K, K, epi, m0, n0 + r);
      for (; r < nb; ++r) rows_tile<1>(x, M, wf + r * K, K, epi, m0, n0 + r);
    }
  }
}
#endif

// Batches and prompts of bf16 rows, outside batch-invariant mode: gemm.cpp's bf16 GEMM (VDPBF16PS, twice
// the multiplies per instruction of the fp32 FMAs above) over weight rows made as it reaches them, each
// value bf16(w * scale) - what a bf16 model holds after a quantize-dequantize round trip of its weights.
// The GEMM (tidal_gemm_bf16_rows, AVX-512 BF16 builds) is handed over by the Python side once both
// libraries are loaded; where it is missing or declines, the fp32 path runs.
using bf16_rows_gemm_fn = int (*)(const void* x, const void* w, void* fn, int format, const void* bias, void* out,
                                  int64_t M, int64_t N, int64_t K, int num_threads);
bf16_rows_gemm_fn g_bf16_rows_gemm = nullptr;
// From this many rows: on one layer's four products of SmolLM2 (benchmarks/w8a16_tiles.py, run with this
// constant at 8; Zen 5, 2 threads) the tiles took 1.29x the skinny passes' time at 8 rows, 0.90x at 12,
// 0.69x at 16, 0.47x at 32, 0.33x at 128
constexpr int64_t kW8A16TileMinRows = 12;

struct ScaledRows {  // the `w` a row maker gets: the 8-bit weight and its per-row scales
  const void* w;
  const float* scale;
};

// rows [n0, n0 + rows) of the weight as bf16(value * scale[row]) into out [rows, K]
template <class Src>
void scaled_rows_bf16(const void* wv, int /*format*/, int64_t n0, int64_t rows, int64_t K, void* out) {
  const ScaledRows& src = *static_cast<const ScaledRows*>(wv);
  const float post = std::is_same_v<Src, Fp8W> ? 256.f : 1.f;
  for (int64_t r = 0; r < rows; ++r) {
    const typename Src::T* w = static_cast<const typename Src::T*>(src.w) + (n0 + r) * K;
    uint16_t* o = static_cast<uint16_t*>(out) + r * K;
    const float f = src.scale[n0 + r] * post;
    int64_t k = 0;
#if defined(TIDAL_VEC)
    const simd::vf vs = simd::set1(f);
    for (; k + simd::W <= K; k += simd::W) simd::store_bf16(o + k, simd::mul(Src::vec(w + k), vs));
#endif
    for (; k < K; ++k) o[k] = float_to_bf16(Src::one(w + k) * f);
  }
}

// x [M, K] (dtype kF32 or kBF16); tiles: bf16 rows beyond kW8A16TileMinRows may take the bf16 GEMM
template <class Src>
void w8a16(const void* x, int dtype, const typename Src::T* w, const F32Epilogue& epi, int64_t M, int64_t N,
           int64_t K, int num_threads, bool tiles) {
  if (tiles && dtype == kBF16 && M >= kW8A16TileMinRows && g_bf16_rows_gemm != nullptr) {
    const ScaledRows src{w, epi.w_scale};
    if (g_bf16_rows_gemm(x, &src, reinterpret_cast<void*>(&scaled_rows_bf16<Src>), 0, epi.bias, epi.out, M, N, K,
                         num_threads) == 0)
      return;
  }
#if defined(TIDAL_VEC)
  if (M > kW8A16SkinnyMaxRows) {
    // chunks of rows whose activations stay in L2 while every weight block passes over them
    const int64_t chunk = std::max<int64_t>(kW8A16SkinnyMaxRows + 1, (256 * 1024) / (4 * K));
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t rows = std::min(chunk, M - m0);
      blocked_w8a16<Src>(rows_f32(x, dtype, m0, rows, K), w, epi, m0, rows, N, K, num_threads);
    }
    return;
  }
  const float* xf = rows_f32(x, dtype, 0, M, K);
  for (int64_t m0 = 0; m0 < M; m0 += 4) {  // passes of up to four rows over the streamed weights
    const float* xm = xf + m0 * K;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: skinny_w8a16<1, Src>(xm, w, epi, m0, N, K, num_threads); break;
      case 2: skinny_w8a16<2, Src>(xm, w, epi, m0, N, K, num_threads); break;
      case 3: skinny_w8a16<3, Src>(xm, w, epi, m0, N, K, num_threads); break;
      default: skinny_w8a16<4, Src>(xm, w, epi, m0, N, K, num_threads); break;
    }
  }
#else
  constexpr int64_t chunk = 64;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    const float* xf = rows_f32(x, dtype, m0, rows, K);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t m = 0; m < rows; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += xf[m * K + k] * Src::one(w + n * K + k);
        epi(m0 + m, n, s);
      }
  }
#endif
}

// ---------------------------------------------------------------------------------------------------
// Per-row int8 quantization of the activations

// xq[m] = round_half_even(x[m] / s) clamped to [-127, 127], s = max|x[m]| / 127 (1 for a row of zeros)
void quantize_row(const float* x, int64_t K, int8_t* xq, float* scale) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(TIDAL_VEC)
  vf vmax = simd::zero();
  for (; k + W <= K; k += W) vmax = simd::max(vmax, simd::max(simd::load(x + k), simd::sub(simd::zero(), simd::load(x + k))));
  amax = simd::reduce_max(vmax);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  float s = amax / 127.f;
  if (!(s > 0.f)) s = 1.f;
  *scale = s;
  k = 0;
#if TIDAL_VEC == 16
  const vf vs = simd::set1(s), lo = simd::set1(-127.f), hi = simd::set1(127.f);
  for (; k + W <= K; k += W) {
    const vf q = simd::min(simd::max(simd::round_nearest(simd::div(simd::load(x + k), vs)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
  }
#elif TIDAL_VEC == 8
  const vf vs = simd::set1(s), lo = simd::set1(-127.f), hi = simd::set1(127.f);
  for (; k + W <= K; k += W) {
    const vf q = simd::min(simd::max(simd::round_nearest(simd::div(simd::load(x + k), vs)), lo), hi);
    const __m128i i32lo = _mm256_castsi256_si128(_mm256_cvtps_epi32(q)), i32hi = _mm256_extracti128_si256(_mm256_cvtps_epi32(q), 1);
    const __m128i i16 = _mm_packs_epi32(i32lo, i32hi);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + k), _mm_packs_epi16(i16, i16));
  }
#endif
  for (; k < K; ++k) xq[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[k] / s))));
}

void quantize_rows(const void* x, int dtype, int64_t M, int64_t K, int8_t* xq, float* scale, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(M * K >= (1 << 16) ? num_threads : 1)
  for (int64_t m = 0; m < M; ++m) quantize_row(rows_f32(x, dtype, m, 1, K), K, xq + m * K, scale + m);
}

// ---------------------------------------------------------------------------------------------------
// W8A8: int8 x int8 products summed exactly in int32

// out[m, n] from the exact accumulator: itself (kI32), or acc * x_scale[m] * w_scale[n] (+ bias[n])
struct IntEpilogue {
  const int32_t* row_sums;  // of the weights, when the accumulator carries 128 * row_sum (x shifted to u8)
  const float* x_scale;
  const float* w_scale;
  const void* bias;
  void* out;
  int dtype;  // of bias and out
  int64_t N;
  inline void operator()(int64_t m, int64_t n, int32_t acc) const {
    if (row_sums) acc -= 128 * row_sums[n];
    if (dtype == kI32) {
      static_cast<int32_t*>(out)[m * N + n] = acc;
      return;
    }
    float v = static_cast<float>(acc) * x_scale[m];
    v = v * w_scale[n];
    if (bias) v = v + load_bias(bias, dtype, n);
    store_out(out, dtype, m * N + n, v);
  }
};

// One step of a byte dot product along K: Dot::B bytes of one row of x against B bytes of one weight
// row, summed into int32 lanes.
#if defined(__AVX512VNNI__) && TIDAL_VEC == 16
// acc + the four u8 x s8 products of each 32-bit lane. In asm: GCC 12 copies the accumulator of the
// intrinsic into a fresh register and back around every instruction (and spills), halving throughput.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

constexpr bool kShiftedX = true;  // VPDPBUSD: x + 128 as u8
struct Dot {
  static constexpr int B = 64;
  using acc_t = __m512i;
  using xv_t = __m512i;
  static inline acc_t zero() { return _mm512_setzero_si512(); }
  static inline xv_t x(const int8_t* p) { return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(-128)); }
  static inline xv_t x_tail(const int8_t* p, int n) {  // bytes past n: 0 (not 128), adding nothing
    const __mmask64 mask = (__mmask64)((1ull << n) - 1);
    return _mm512_maskz_mov_epi8(mask, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, p), _mm512_set1_epi8(-128)));
  }
  static inline __m512i w(const int8_t* p) { return _mm512_loadu_si512(p); }
  static inline __m512i w_tail(const int8_t* p, int n) { return _mm512_maskz_loadu_epi8((__mmask64)((1ull << n) - 1), p); }
  static inline acc_t dot(acc_t acc, xv_t xv, __m512i wv) { return dpbusd(acc, xv, wv); }
  static inline int32_t reduce(acc_t acc) { return _mm512_reduce_add_epi32(acc); }
};
#elif TIDAL_VEC == 16
constexpr bool kShiftedX = false;
struct Dot {  // |x| * (w with x's sign), VPMADDUBSW + VPMADDWD
  static constexpr int B = 64;
  using acc_t = __m512i;
  struct xv_t { __m512i abs; __mmask64 neg; };
  static inline acc_t zero() { return _mm512_setzero_si512(); }
  static inline xv_t make(__m512i v) { return {_mm512_abs_epi8(v), _mm512_movepi8_mask(v)}; }
  static inline xv_t x(const int8_t* p) { return make(_mm512_loadu_si512(p)); }
  static inline xv_t x_tail(const int8_t* p, int n) { return make(_mm512_maskz_loadu_epi8((__mmask64)((1ull << n) - 1), p)); }
  static inline __m512i w(const int8_t* p) { return _mm512_loadu_si512(p); }
  static inline __m512i w_tail(const int8_t* p, int n) { return _mm512_maskz_loadu_epi8((__mmask64)((1ull << n) - 1), p); }
  static inline acc_t dot(acc_t acc, const xv_t& xv, __m512i wv) {
    const __m512i signed_w = _mm512_mask_sub_epi8(wv, xv.neg, _mm512_setzero_si512(), wv);
    const __m512i pairs = _mm512_maddubs_epi16(xv.abs, signed_w);  // |each| <= 2 * 127 * 127: no saturation
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
  static inline int32_t reduce(acc_t acc) { return _mm512_reduce_add_epi32(acc); }
};
#elif TIDAL_VEC == 8
constexpr bool kShiftedX = false;
struct Dot {  // |x| * sign(w, x), VPMADDUBSW + VPMADDWD (the llama.cpp AVX2 product)
  static constexpr int B = 32;
  using acc_t = __m256i;
  struct xv_t { __m256i abs, sign; };
  static inline acc_t zero() { return _mm256_setzero_si256(); }
  static inline __m256i tail(const int8_t* p, int n) {  // no byte-masked loads on AVX2
    alignas(32) int8_t buf[32] = {};
    std::memcpy(buf, p, n);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
  }
  static inline xv_t make(__m256i v) { return {_mm256_abs_epi8(v), v}; }
  static inline xv_t x(const int8_t* p) { return make(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static inline xv_t x_tail(const int8_t* p, int n) { return make(tail(p, n)); }
  static inline __m256i w(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline __m256i w_tail(const int8_t* p, int n) { return tail(p, n); }
  static inline acc_t dot(acc_t acc, const xv_t& xv, __m256i wv) {
    const __m256i pairs = _mm256_maddubs_epi16(xv.abs, _mm256_sign_epi8(wv, xv.sign));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static inline int32_t reduce(acc_t acc) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
};
#else
constexpr bool kShiftedX = false;
#endif

#if defined(TIDAL_VEC)
// MR x NR exact accumulators: x rows (x points at row m0, stride ldx) against weight rows w + r * K
template <int MR, int NR>
inline void idot_tile(const int8_t* x, int64_t ldx, const int8_t* w, int64_t K, const IntEpilogue& epi, int64_t m0,
                      int64_t n0) {
  typename Dot::acc_t acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = Dot::zero();
  const int64_t kfull = K - K % Dot::B;
  for (int64_t k = 0; k < kfull; k += Dot::B) {
    typename Dot::xv_t xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = Dot::x(x + m * ldx + k);
    for (int r = 0; r < NR; ++r) {
      const auto wv = Dot::w(w + r * K + k);
      for (int m = 0; m < MR; ++m) acc[m][r] = Dot::dot(acc[m][r], xv[m], wv);
    }
  }
  if (kfull < K) {
    const int n = static_cast<int>(K - kfull);
    typename Dot::xv_t xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = Dot::x_tail(x + m * ldx + kfull, n);
    for (int r = 0; r < NR; ++r) {
      const auto wv = Dot::w_tail(w + r * K + kfull, n);
      for (int m = 0; m < MR; ++m) acc[m][r] = Dot::dot(acc[m][r], xv[m], wv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) epi(m0 + m, n0 + r, Dot::reduce(acc[m][r]));
}

// weight rows per register tile by rows of x (accumulators, x and temporaries within 16 or 32 registers)
template <int MR> constexpr int iskinny_nr() { return Dot::B == 64 ? (MR <= 2 ? 8 : 4) : (MR == 1 ? 4 : 2); }

template <int MR>
void skinny_w8a8(const int8_t* x, const int8_t* w, const IntEpilogue& epi, int64_t m0, int64_t N, int64_t K,
                 int num_threads) {
  constexpr int NR = iskinny_nr<MR>();
  const int64_t tiles = N / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR;
    // the int8 products are so cheap (VPDPBUSD: one instruction per 64 bytes and row of x) that
    // prefetches inside the k loop crowd the loads: the tile's lines are asked for a few tiles ahead
    // in one burst instead (measured 20-25% faster here, the opposite of the fp32 paths)
    if (n0 + 5 * NR <= N) simd::prefetch_bytes(reinterpret_cast<const char*>(w + (n0 + 4 * NR) * K), NR * K);
    idot_tile<MR, NR>(x + m0 * K, K, w + n0 * K, K, epi, m0, n0);
  }
  for (int64_t n0 = tiles * NR; n0 < N; ++n0) idot_tile<MR, 1>(x + m0 * K, K, w + n0 * K, K, epi, m0, n0);
}

void skinny_rows_w8a8(const int8_t* x, const int8_t* w, const IntEpilogue& epi, int64_t M, int64_t N, int64_t K,
                      int num_threads) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: skinny_w8a8<1>(x, w, epi, m0, N, K, num_threads); break;
      case 2: skinny_w8a8<2>(x, w, epi, m0, N, K, num_threads); break;
      case 3: skinny_w8a8<3>(x, w, epi, m0, N, K, num_threads); break;
      default: skinny_w8a8<4>(x, w, epi, m0, N, K, num_threads); break;
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && TIDAL_VEC == 16
// ---- any number of rows on AVX-512 VNNI: vector lanes over 16 rows of x ----
// Each lane holds the quad (x[m, 4q .. 4q + 3] + 128) of one row m and VPDPBUSD multiplies it by the
// quad (w[n, 4q .. 4q + 3]) of one weight row, broadcast straight from the plain [N, K] weight. Only x
// (M * K bytes per call) is reordered, into groups of 16 rows ([K4p][16] quads); the 16 x 16 tile of
// accumulators is transposed once at the end. Same structure as gemm.cpp's gemm_bf16.


// rows [m0, m0 + 16) of x (those < M; the others zero) as xg[q * 16 + r] = quad q of row m0 + r plus 128
// (u8), q < K4p (a multiple of 16); bytes past K are 0, so they add nothing
void pack_group(const int8_t* x, int64_t M, int64_t K, int64_t m0, int64_t K4p, uint32_t* xg) {
  for (int64_t q0 = 0; q0 < K4p; q0 += 16) {
    const int64_t k0 = 4 * q0;
    const __mmask64 mask = k0 >= K ? 0 : K - k0 >= 64 ? ~__mmask64(0) : (__mmask64)((1ull << (K - k0)) - 1);
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = m0 + i < M ? _mm512_maskz_mov_epi8(mask, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, x + (m0 + i) * K + k0),
                                                                       _mm512_set1_epi8(-128)))
                        : _mm512_setzero_si512();
    simd::transpose16x16(r);
    for (int q = 0; q < 16; ++q) _mm512_storeu_si512(xg + (q0 + q) * 16, r[q]);
  }
}

// the epilogue of 16 outputs of row m (columns n0 + i, i < nn, in lane i), vectorised: the same
// per-element arithmetic as IntEpilogue
inline void finish_row(__m512i acc, const IntEpilogue& e, int64_t m, int64_t n0, __mmask16 nmask) {
  acc = _mm512_sub_epi32(acc, _mm512_slli_epi32(_mm512_maskz_loadu_epi32(nmask, e.row_sums + n0), 7));
  if (e.dtype == kI32) {
    _mm512_mask_storeu_epi32(static_cast<int32_t*>(e.out) + m * e.N + n0, nmask, acc);
    return;
  }
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(e.x_scale[m]));
  v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(nmask, e.w_scale + n0));
  if (e.dtype == kBF16) {
    if (e.bias) {
      const __m256i b = _mm256_maskz_loadu_epi16(nmask, static_cast<const uint16_t*>(e.bias) + n0);
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    __m512i bits = _mm512_srli_epi32(simd::bf16_bits(v), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(e.out) + m * e.N + n0, nmask, _mm512_cvtepi32_epi16(bits));
  } else {
    if (e.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(nmask, static_cast<const float*>(e.bias) + n0));
    _mm512_mask_storeu_ps(static_cast<float*>(e.out) + m * e.N + n0, nmask, v);
  }
}

// MV packed groups of 16 rows (xg + v * gstride, the first at row m0) against NR weight rows
// (w + i * K, columns n0 + i, nn of them real): MV * NR accumulators, each lane one output.
// prefetch (or null): K / 4 cache lines to bring into L2 meanwhile (the next tile's weights).
template <int MV, int NR>
inline void tile_vnni(const uint32_t* xg, int64_t gstride, const int8_t* w, int64_t K, const IntEpilogue& epi,
                      int64_t M, int64_t m0, int64_t n0, int nn, const char* prefetch) {
  __m512i acc[MV][NR];
  for (int v = 0; v < MV; ++v)
    for (int i = 0; i < NR; ++i) acc[v][i] = _mm512_setzero_si512();
  const int64_t quads = K / 4;
  for (int64_t q = 0; q < quads; ++q) {
    if (prefetch) _mm_prefetch(prefetch + q * 64, _MM_HINT_T1);
    __m512i xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_si512(xg + v * gstride + q * 16);
    for (int i = 0; i < NR; ++i) {
      int32_t wq;
      std::memcpy(&wq, w + i * K + 4 * q, 4);
      const __m512i wv = _mm512_set1_epi32(wq);
      for (int v = 0; v < MV; ++v) acc[v][i] = dpbusd(acc[v][i], xv[v], wv);
    }
  }
  if (K % 4) {  // the last, partial quad: x's bytes past K are 0; the weight's are not read
    for (int i = 0; i < NR; ++i) {
      int32_t wq = 0;
      std::memcpy(&wq, w + i * K + 4 * quads, K % 4);
      const __m512i wv = _mm512_set1_epi32(wq);
      for (int v = 0; v < MV; ++v)
        acc[v][i] = dpbusd(acc[v][i], _mm512_loadu_si512(xg + v * gstride + quads * 16), wv);
    }
  }
  if constexpr (NR == 16) {
    static_assert(MV == 1, "16 weight rows: one group of x");
    simd::transpose16x16(acc[0]);  // acc[0][row]: the row's outputs
    const __mmask16 nmask = (__mmask16)((1u << nn) - 1);
    const int64_t rows = std::min<int64_t>(16, M - m0);
    for (int64_t row = 0; row < rows; ++row) finish_row(acc[0][row], epi, m0 + row, n0, nmask);
  } else {
    static_assert(NR == 8, "8 or 16 weight rows");
    const __mmask16 nmask = (__mmask16)((1u << nn) - 1);
    for (int v = 0; v < MV; v += 2) {
      // two groups' 8 columns in one transpose: r[c] has row c's outputs in lanes 0-7 and row 16 + c's
      // in lanes 8-15
      __m512i r[16];
      for (int i = 0; i < 8; ++i) {
        r[i] = acc[v][i];
        r[8 + i] = v + 1 < MV ? acc[v + 1][i] : _mm512_setzero_si512();
      }
      simd::transpose16x16(r);
      const int64_t g0 = m0 + 16 * v;
      const int64_t rows = std::min<int64_t>(16, M - g0), rows_hi = v + 1 < MV ? std::min<int64_t>(16, M - g0 - 16) : 0;
      for (int64_t c = 0; c < rows; ++c) finish_row(r[c], epi, g0 + c, n0, nmask);
      for (int64_t c = 0; c < rows_hi; ++c) finish_row(_mm512_shuffle_i32x4(r[c], r[c], 0xee), epi, g0 + 16 + c, n0, nmask);
    }
  }
}

void blocked_w8a8(const int8_t* x, const int8_t* w, const IntEpilogue& epi, int64_t M, int64_t N, int64_t K,
                  int num_threads) {
  // Tiles of 16 weight rows, whose K quads stay in L1/L2 while the panel of x passes: two groups of 16
  // rows of x at a time against each half (16 accumulators); a last single group against all 16.
  constexpr int NT = 16;
  const int64_t K4p = ((K + 3) / 4 + 15) / 16 * 16;
  const int64_t gstride = K4p * 16;
  // groups of 16 rows per panel: ~384 KiB of packed x, in L2 while every weight tile passes over it
  const int64_t groups = (M + 15) / 16;
  const int64_t panel = std::max<int64_t>(2, (384 * 1024) / (gstride * 4) / 2 * 2);
  const int64_t tiles = (N + NT - 1) / NT;
  static thread_local std::vector<uint32_t> packed;
  uint32_t* xp = scratch(packed, std::min(panel, groups) * gstride);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<int8_t> tail_rows;  // the last tile's weight rows, padded with zero rows to NT
    for (int64_t g0 = 0; g0 < groups; g0 += panel) {
      const int64_t ng = std::min(panel, groups - g0);
#pragma omp for schedule(static)
      for (int64_t g = 0; g < ng; ++g) pack_group(x, M, K, (g0 + g) * 16, K4p, xp + g * gstride);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * NT;
        const int nn = static_cast<int>(std::min<int64_t>(NT, N - n0));
        const int8_t* wt = w + n0 * K;
        if (nn < NT) {
          tail_rows.assign(NT * K, 0);
          std::memcpy(tail_rows.data(), wt, nn * K);
          wt = tail_rows.data();
        }
        // the next tile's weights (16 * K bytes: K / 4 lines) come from memory while this one computes
        const char* next = n0 + 2 * NT <= N ? reinterpret_cast<const char*>(w + (n0 + NT) * K) : nullptr;
        const int64_t pairs_end = ng / 2 * 2;
        for (int half = 0; half < 2; ++half) {
          const int nh = std::max(0, std::min(8, nn - 8 * half));
          for (int64_t g = 0; g < pairs_end && nh > 0; g += 2, next = nullptr)
            tile_vnni<2, 8>(xp + g * gstride, gstride, wt + 8 * half * K, K, epi, M, (g0 + g) * 16, n0 + 8 * half, nh,
                            next);
        }
        if (ng % 2)
          tile_vnni<1, 16>(xp + pairs_end * gstride, gstride, wt, K, epi, M, (g0 + pairs_end) * 16, n0, nn, next);
      }
    }
  }
}
#elif defined(TIDAL_VEC)
// register tile of the blocked path: MR rows of x by NR weight rows
constexpr int kIBlockMR = Dot::B == 64 ? 4 : 2;
constexpr int kIBlockNR = Dot::B == 64 ? 4 : 2;

template <int NR>
void irows_tile(const int8_t* x, int64_t M, const int8_t* w, int64_t K, const IntEpilogue& epi, int64_t m0,
                int64_t n0) {
  constexpr int MR = kIBlockMR;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) idot_tile<MR, NR>(x + (m0 + m) * K, K, w, K, epi, m0 + m, n0);
  for (; m < M; ++m) idot_tile<1, NR>(x + (m0 + m) * K, K, w, K, epi, m0 + m, n0);
}

// rows [m0, m0 + M) of x against blocks of weight rows small enough to stay in L2 while the rows pass
void blocked_w8a8(const int8_t* x, const int8_t* w, const IntEpilogue& epi, int64_t M, int64_t N, int64_t K,
                  int num_threads) {
  constexpr int NR = kIBlockNR;
  int64_t NB = std::max<int64_t>(NR, std::min<int64_t>(64, (128 * 1024 / K) / NR * NR));
  while (NB > NR && (N + NB - 1) / NB < 4 * num_threads) NB -= NR;
  const int64_t blocks = (N + NB - 1) / NB;
  const int64_t chunk = std::max<int64_t>(kSkinnyMaxRows + 1, (256 * 1024) / K);  // rows of x kept in L2
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t mc = std::min(chunk, M - m0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * NB, nb = std::min(NB, N - n0);
      int64_t r = 0;
      for (; r + NR <= nb; r += NR) irows_tile<NR>(x, mc, w + (n0 + r) * K, K, epi, m0, n0 + r);
      for (; r < nb; ++r) irows_tile<1>(x, mc, w + (n0 + r) * K, K, epi, m0, n0 + r);
    }
  }
}
#endif

// the weights' row sums, when this build's accumulators need them
const int32_t* row_sums_for(const int8_t* w, const int32_t* given, int64_t N, int64_t K, int num_threads);

void int8_gemm(const int8_t* x, const int8_t* w, const IntEpilogue& epi, int64_t M, int64_t N, int64_t K,
               int num_threads) {
#if defined(TIDAL_VEC)
  if (M <= kSkinnyMaxRows) skinny_rows_w8a8(x, w, epi, M, N, K, num_threads);
  else blocked_w8a8(x, w, epi, M, N, K, num_threads);
#else
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      int32_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<int32_t>(x[m * K + k]) * w[n * K + k];
      epi(m, n, acc);
    }
#endif
}

void row_sums(const int8_t* w, int32_t* out, int64_t N, int64_t K, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; ++n) {
    int32_t s = 0;
    for (int64_t k = 0; k < K; ++k) s += w[n * K + k];
    out[n] = s;
  }
}

const int32_t* row_sums_for(const int8_t* w, const int32_t* given, int64_t N, int64_t K, int num_threads) {
  if (!kShiftedX) return nullptr;
  if (given) return given;
  static thread_local std::vector<int32_t> sums;
  int32_t* out = scratch(sums, N);
  row_sums(w, out, N, K, num_threads);
  return out;
}

}  // namespace

extern "C" {
// x [M, K] (x_dtype 0: fp32, 1: bf16), w [N, K] int8 (w_kind 0) or fp8 E4M3 (w_kind 1), w_scale [N]
// fp32, bias [N] of x's dtype or null, out [M, N] of x's dtype; all contiguous. w_kind | kW8A16Tiles:
// bf16 batches may take the bf16 GEMM over rounded rows (above; not batch-invariant, so the caller leaves
// it off in that mode). Returns 0, or -1 for arguments it does not handle.
constexpr int kW8A16Tiles = 2;
int tidal_w8a16_linear(const void* x, int x_dtype, const void* w, int w_kind, const float* w_scale, const void* bias,
                       void* out, int64_t M, int64_t N, int64_t K, int num_threads) {
  const bool tiles = w_kind & kW8A16Tiles;
  w_kind &= ~kW8A16Tiles;
  if (M < 1 || (x_dtype != kF32 && x_dtype != kBF16) || (w_kind != 0 && w_kind != 1)) return -1;
  const F32Epilogue epi{w_scale, w_kind == 1 ? 256.f : 1.f, bias, out, x_dtype, N};
  if (w_kind == 0) w8a16<Int8W>(x, x_dtype, static_cast<const int8_t*>(w), epi, M, N, K, num_threads, tiles);
  else w8a16<Fp8W>(x, x_dtype, static_cast<const uint8_t*>(w), epi, M, N, K, num_threads, tiles);
  return 0;
}

// gemm.cpp's tidal_gemm_bf16_rows, for the bf16 batches of tidal_w8a16_linear (null: none)
void tidal_w8a16_set_bf16_rows_gemm(void* fn) { g_bf16_rows_gemm = reinterpret_cast<bf16_rows_gemm_fn>(fn); }

// x [M, K] fp32 or bf16 -> xq [M, K] int8, scale [M] fp32 (see quantize_row). Returns 0 or -1.
int tidal_quantize_rows_int8(const void* x, int x_dtype, void* xq, float* scale, int64_t M, int64_t K,
                             int num_threads) {
  if (x_dtype != kF32 && x_dtype != kBF16) return -1;
  quantize_rows(x, x_dtype, M, K, static_cast<int8_t*>(xq), scale, num_threads);
  return 0;
}

// out [N] int32: the sum of each weight row [N, K] int8
void tidal_int8_row_sums(const void* w, void* out, int64_t N, int64_t K, int num_threads) {
  row_sums(static_cast<const int8_t*>(w), static_cast<int32_t*>(out), N, K, num_threads);
}

// xq [M, K] int8 @ w [N, K] int8 ^T -> out [M, N] int32, exact. row_sums [N] (tidal_int8_row_sums) or
// null (then computed here: one more pass over the weights).
void tidal_int8_gemm_i32(const void* xq, const void* w, const int32_t* row_sums, void* out, int64_t M, int64_t N,
                         int64_t K, int num_threads) {
  const int8_t* ws = static_cast<const int8_t*>(w);
  const IntEpilogue epi{row_sums_for(ws, row_sums, N, K, num_threads), nullptr, nullptr, nullptr, out, kI32, N};
  int8_gemm(static_cast<const int8_t*>(xq), ws, epi, M, N, K, num_threads);
}

// x [M, K] (x_dtype 0: fp32, 1: bf16) quantized per row, @ w [N, K] int8 ^T, out [M, N] of x's dtype
// = acc * x_scale[m] * w_scale[n] (+ bias[n], of x's dtype). row_sums as for tidal_int8_gemm_i32.
// Returns 0, or -1 for arguments it does not handle.
int tidal_w8a8_linear(const void* x, int x_dtype, const void* w, const int32_t* row_sums, const float* w_scale,
                      const void* bias, void* out, int64_t M, int64_t N, int64_t K, int num_threads) {
  if (M < 1 || (x_dtype != kF32 && x_dtype != kBF16)) return -1;
  // chunks of rows quantized into thread-local buffers (bounded: 512 rows), each a product of its own
  constexpr int64_t chunk = 512;
  static thread_local std::vector<int8_t> xq_buf;
  static thread_local std::vector<float> scale_buf;
  int8_t* xq = scratch(xq_buf, std::min(chunk, M) * K);
  float* x_scale = scratch(scale_buf, std::min(chunk, M));
  const int8_t* ws = static_cast<const int8_t*>(w);
  const int32_t* sums = row_sums_for(ws, row_sums, N, K, num_threads);
  const int64_t x_bytes = x_dtype == kBF16 ? 2 : 4;  // of an element of x and of out
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    quantize_rows(static_cast<const char*>(x) + m0 * K * x_bytes, x_dtype, rows, K, xq, x_scale, num_threads);
    const IntEpilogue epi{sums, x_scale, w_scale, bias, static_cast<char*>(out) + m0 * N * x_bytes, x_dtype, N};
    int8_gemm(xq, ws, epi, rows, N, K, num_threads);
  }
  return 0;
}

// how this build multiplies bytes: 3 VPDPBUSD (AVX-512 VNNI), 2 AVX-512 VPMADDUBSW, 1 AVX2, 0 scalar
int tidal_int8_dot_kind() {
#if defined(__AVX512VNNI__) && TIDAL_VEC == 16
  return 3;
#elif TIDAL_VEC == 16
  return 2;
#elif TIDAL_VEC == 8
  return 1;
#else
  return 0;
#endif
}
}
