// Paged attention for decode on CPU: one query token per request, K/V read in place from the
// block-structured cache (no gather copy). Work is split over (request, KV head) pairs; the query
// heads that share a KV head (GQA) are processed together so each K/V row is read once.
// Plain C ABI (called through ctypes), no torch headers: it builds in about a second.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum DType { kF32 = 0, kBF16 = 1, kF16 = 2 };

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) { bits = sign; }
    else { float f = std::ldexp(static_cast<float>(mant), -24); std::memcpy(&bits, &f, 4); bits |= sign; }
  } else if (exp == 31) { bits = sign | 0x7f800000u | (mant << 13); }
  else { bits = sign | ((exp + 112) << 23) | (mant << 13); }
  float f; std::memcpy(&f, &bits, 4); return f;
}

static inline uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, 0);
#else
  // slow path: rarely used on CPUs without F16C
  uint32_t u; std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u; int32_t e = ((u >> 23) & 0xff) - 112; uint32_t m = (u >> 13) & 0x3ff;
  if (e <= 0) return static_cast<uint16_t>(sign);
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | (e << 10) | m);
#endif
}

template <int DT> static inline float load1(const void* p, int64_t i) {
  if (DT == kF32) return static_cast<const float*>(p)[i];
  const uint16_t v = static_cast<const uint16_t*>(p)[i];
  if (DT == kBF16) { uint32_t u = static_cast<uint32_t>(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  return half_to_float(v);
}

template <int DT> static inline void store1(void* p, int64_t i, float f) {
  if (DT == kF32) static_cast<float*>(p)[i] = f;
  else if (DT == kBF16) static_cast<uint16_t*>(p)[i] = float_to_bf16(f);
  else static_cast<uint16_t*>(p)[i] = float_to_half(f);
}

template <int DT> static inline int64_t elem_size() { return DT == kF32 ? 4 : 2; }

#if defined(__AVX512F__)
template <int DT> static inline __m512 load16(const void* p, int64_t i) {
  if (DT == kF32) return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
  if (DT == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  return _mm512_cvtph_ps(raw);
}
#endif

constexpr int64_t kMaxGroup = 8;   // query heads per KV head kept in registers
constexpr int64_t kMaxChunks = 8;  // head_dim / 16

// Cache layout per layer (one block = block_size tokens):
//   K [num_blocks, Hk, D, block_size]  (transposed: the scores of 16 tokens are one vector FMA chain)
//   V [num_blocks, Hk, block_size, D]
template <int DT>
static void scores_generic(const float* qf, const void* k_cache, const int64_t* table, int64_t L, int64_t h,
                           int64_t G, int64_t Hk, int64_t D, int64_t bs, float* scores) {
  for (int64_t t = 0; t < L; ++t) {
    const int64_t base = (table[t / bs] * Hk + h) * D * bs + t % bs;
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * load1<DT>(k_cache, base + d * bs);
      scores[g * L + t] = s;
    }
  }
}

template <int DT>
static void accumulate_generic(const float* scores, const void* v_cache, const int64_t* table, int64_t L,
                               int64_t h, int64_t G, int64_t Hk, int64_t D, int64_t bs, float* acc) {
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t base = ((table[t / bs] * Hk + h) * bs + t % bs) * D;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += scores[g * L + t] * load1<DT>(v_cache, base + d);
  }
}

static void softmax_generic(float* s, int64_t L) {
  float m = -INFINITY;
  for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < L; ++t) s[t] *= inv;
}

#if defined(__AVX512F__)
static inline void prefetch_bytes(const char* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// exp(x) for x <= 0 (softmax inputs after subtracting the max): Cody-Waite range reduction and a
// degree-6 polynomial, ~2 ulp.
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

static void softmax512(float* s, int64_t L) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(mv);
  for (int64_t u = t; u < L; ++u) m = std::max(m, s[u]);
  const __m512 mb = _mm512_set1_ps(m);
  __m512 sv = _mm512_setzero_ps();
  t = 0;
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), mb));
    _mm512_storeu_ps(s + t, e);
    sv = _mm512_add_ps(sv, e);
  }
  float sum = _mm512_reduce_add_ps(sv);
  for (int64_t u = t; u < L; ++u) { s[u] = std::exp(s[u] - m); sum += s[u]; }
  const float inv = 1.f / sum;
  const __m512 iv = _mm512_set1_ps(inv);
  t = 0;
  for (; t + 16 <= L; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), iv));
  for (int64_t u = t; u < L; ++u) s[u] *= inv;
}

// block_size a multiple of 16: the scores of 16 consecutive tokens accumulate in one register.
template <int DT>
static void scores512(const float* qf, const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                      int64_t h, int64_t G, int64_t Hk, int64_t D, int64_t bs, float* scores) {
  float tmp[kMaxGroup][16];
  const int64_t chunk_bytes = D * bs * elem_size<DT>();  // one block of one head: contiguous
  for (int64_t start = 0; start < L; start += 16) {
    const int64_t blk = table[start / bs], off = start % bs;
    const int64_t base = (blk * Hk + h) * D * bs + off;
    if (off == 0) {
      // hide the next block's memory latency behind this block's math; bring this block's V toward
      // the core too (the second pass reads it, and a request's V fits in L2)
      if (start + bs < L)
        prefetch_bytes(static_cast<const char*>(k_cache) + (table[start / bs + 1] * Hk + h) * chunk_bytes,
                       chunk_bytes);
      prefetch_bytes(static_cast<const char*>(v_cache) + (blk * Hk + h) * chunk_bytes, chunk_bytes);
    }
    __m512 acc[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 k = load16<DT>(k_cache, base + d * bs);
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * D + d]), k, acc[g]);
    }
    const int64_t n = std::min<int64_t>(16, L - start);
    if (n == 16) {
      for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * L + start, acc[g]);
    } else {
      for (int64_t g = 0; g < G; ++g) {
        _mm512_storeu_ps(tmp[g], acc[g]);
        std::copy(tmp[g], tmp[g] + n, scores + g * L + start);
      }
    }
  }
}

template <int DT>
static void accumulate512(const float* scores, const void* v_cache, const int64_t* table, int64_t L, int64_t h,
                          int64_t G, int64_t Hk, int64_t D, int64_t bs, float* out) {
  const int64_t C = D / 16;
  __m512 av[kMaxGroup][kMaxChunks];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) av[g][c] = _mm512_setzero_ps();
  const int64_t chunk_bytes = D * bs * elem_size<DT>();
  for (int64_t start = 0; start < L; start += bs) {  // block by block: no division per token
    const int64_t n = std::min(bs, L - start);
    const int64_t block_base = (table[start / bs] * Hk + h) * bs * D;
    if (start + bs < L)
      prefetch_bytes(static_cast<const char*>(v_cache) + (table[start / bs + 1] * Hk + h) * chunk_bytes, chunk_bytes);
    for (int64_t off = 0; off < n; ++off) {
      const int64_t base = block_base + off * D, t = start + off;
      __m512 vv[kMaxChunks];
      for (int64_t c = 0; c < C; ++c) vv[c] = load16<DT>(v_cache, base + c * 16);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * L + t]);
        for (int64_t c = 0; c < C; ++c) av[g][c] = _mm512_fmadd_ps(p, vv[c], av[g][c]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(out + g * D + c * 16, av[g][c]);
}
#endif

template <int DT>
static void decode(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, void* out, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                   int64_t bs, int64_t max_blocks, float scale, int num_threads) {
  const int64_t G = Hq / Hk;
#if defined(__AVX512F__)
  const bool vec = D % 16 == 0 && D / 16 <= kMaxChunks && G <= kMaxGroup && bs % 16 == 0;
#endif
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qf(G * D), acc(G * D), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hk; ++item) {
      const int64_t b = item / Hk, h = item % Hk;
      const int64_t L = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load1<DT>(q, (b * Hq + h * G + g) * D + d) * scale;
#if defined(__AVX512F__)
      if (vec) {
        scores512<DT>(qf.data(), k_cache, v_cache, table, L, h, G, Hk, D, bs, scores.data());
        for (int64_t g = 0; g < G; ++g) softmax512(scores.data() + g * L, L);
        accumulate512<DT>(scores.data(), v_cache, table, L, h, G, Hk, D, bs, acc.data());
      } else
#endif
      {
        scores_generic<DT>(qf.data(), k_cache, table, L, h, G, Hk, D, bs, scores.data());
        for (int64_t g = 0; g < G; ++g) softmax_generic(scores.data() + g * L, L);
        accumulate_generic<DT>(scores.data(), v_cache, table, L, h, G, Hk, D, bs, acc.data());
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) store1<DT>(out, (b * Hq + h * G + g) * D + d, acc[g * D + d]);
    }
  }
}

// RMSNorm over rows of H, optionally after adding a residual, matching the reference computation:
// s = round(x + residual) (kept as the new residual); y = round(s * rsqrt(mean(s^2) + eps)); out = round(w * y).
template <int DT>
static void rms_norm(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                     int64_t T, int64_t H, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> row(H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t base = t * H;
      float* r = row.data();
      for (int64_t i = 0; i < H; ++i) r[i] = load1<DT>(x, base + i);
      if (residual != nullptr) {
        for (int64_t i = 0; i < H; ++i) {
          store1<DT>(residual_out, base + i, r[i] + load1<DT>(residual, base + i));
          r[i] = load1<DT>(residual_out, base + i);  // the rounded sum, as the reference keeps it
        }
      }
      float partial[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= H; i += 16)
        for (int j = 0; j < 16; ++j) partial[j] += r[i + j] * r[i + j];
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += partial[j];
      for (; i < H; ++i) ss += r[i] * r[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      for (int64_t k = 0; k < H; ++k) {
        float y = r[k] * inv;
        if (DT != kF32) { store1<DT>(out, base + k, y); y = load1<DT>(out, base + k); }
        store1<DT>(out, base + k, load1<DT>(weight, k) * y);
      }
    }
  }
}

extern "C" {
// x, residual (may be null), out, residual_out: [T, H]; weight [H]. dtype: 0 f32, 1 bf16, 2 f16.
void tidal_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                    int64_t T, int64_t H, float eps, int dtype, int num_threads) {
  if (dtype == kF32) rms_norm<kF32>(x, residual, weight, out, residual_out, T, H, eps, num_threads);
  else if (dtype == kBF16) rms_norm<kBF16>(x, residual, weight, out, residual_out, T, H, eps, num_threads);
  else rms_norm<kF16>(x, residual, weight, out, residual_out, T, H, eps, num_threads);
}

// q [B, Hq, D]; k_cache [num_blocks, Hk, D, block_size]; v_cache [num_blocks, Hk, block_size, D];
// block_tables [B, max_blocks];
// seq_lens [B] (including the new token); out [B, Hq, D]. All contiguous. dtype: 0 f32, 1 bf16, 2 f16.
void tidal_paged_attention_decode(const void* q, const void* k_cache, const void* v_cache,
                                  const int64_t* block_tables, const int64_t* seq_lens, void* out, int64_t B,
                                  int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, int64_t max_blocks,
                                  float scale, int dtype, int num_threads) {
  if (dtype == kF32) decode<kF32>(q, k_cache, v_cache, block_tables, seq_lens, out, B, Hq, Hk, D, block_size, max_blocks, scale, num_threads);
  else if (dtype == kBF16) decode<kBF16>(q, k_cache, v_cache, block_tables, seq_lens, out, B, Hq, Hk, D, block_size, max_blocks, scale, num_threads);
  else decode<kF16>(q, k_cache, v_cache, block_tables, seq_lens, out, B, Hq, Hk, D, block_size, max_blocks, scale, num_threads);
}
}
