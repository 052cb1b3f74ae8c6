// CPU kernels of the decode path. Paged attention: one query token per request, K/V read in place
// from the block-structured cache (no gather copy); work is split over (request, KV head) pairs and
// the query heads that share a KV head (GQA) are processed together so each K/V row is read once.
// Also: fused residual + RMSNorm, rotary embedding, and the write of new K/V rows into the cache.
// The cache is of the activations' dtype, bf16 under fp32 activations, or FP8 E4M3 (kv_cache_dtype "fp8")
// with one scale per layer for K and one for V: stored = e4m3(x / scale), read = e4m3 * scale.
// Plain C ABI (called through ctypes), no torch headers: it builds in a few seconds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"

enum DType { kF32 = 0, kBF16 = 1, kF16 = 2, kFP8 = 3 };  // kFP8: E4M3, caches only

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

using simd::float_to_bf16;

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

// One value as fp32; an E4M3 value as 2^-8 x its value (simd.h, namespace e4m3): the attention kernel
// folds the 2^8 into the layer's scales.
template <int DT> static inline float load1(const void* p, int64_t i) {
  if constexpr (DT == kF32) return static_cast<const float*>(p)[i];
  else if constexpr (DT == kFP8) return half_to_float(simd::e4m3::raw_half_bits(static_cast<const uint8_t*>(p)[i]));
  else if constexpr (DT == kBF16) return simd::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  else return half_to_float(static_cast<const uint16_t*>(p)[i]);
}

template <int DT> static inline void store1(void* p, int64_t i, float f) {
  if (DT == kF32) static_cast<float*>(p)[i] = f;
  else if (DT == kBF16) static_cast<uint16_t*>(p)[i] = float_to_bf16(f);
  else static_cast<uint16_t*>(p)[i] = float_to_half(f);
}

template <int DT> static inline float round_to(float f) {  // f rounded to the dtype, as a float
  uint32_t buf = 0;  // room for any dtype
  store1<DT>(&buf, 0, f);
  return load1<DT>(&buf, 0);
}

template <int DT> static inline int64_t elem_size() { return DT == kF32 ? 4 : DT == kFP8 ? 1 : 2; }

#if defined(TIDAL_VEC)
using simd::vf;
using simd::W;
template <int DT> static inline vf loadv(const void* p, int64_t i) {  // W values of the dtype, as fp32 (as load1)
  if constexpr (DT == kF32) return simd::load(static_cast<const float*>(p) + i);
  else if constexpr (DT == kFP8) return simd::load_e4m3_raw(static_cast<const uint8_t*>(p) + i);
  else if constexpr (DT == kBF16) return simd::load_bf16(static_cast<const uint16_t*>(p) + i);
  else return simd::load_f16(static_cast<const uint16_t*>(p) + i);
}
template <int DT> static inline void storev(void* p, int64_t i, vf v) {  // W values as store1 (fp32, bf16)
  if constexpr (DT == kF32) simd::store(static_cast<float*>(p) + i, v);
  else simd::store_bf16(static_cast<uint16_t*>(p) + i, v);
}
#endif

// n values of p from element `start`, as fp32 (as load1 each)
template <int DT> static void widen(const void* p, int64_t start, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(TIDAL_VEC)
  for (; i + W <= n; i += W) simd::store(dst + i, loadv<DT>(p, start + i));
#endif
  for (; i < n; ++i) dst[i] = load1<DT>(p, start + i);
}

// n values src[i] * scale into p from element `start` (as store1 each)
template <int DT> static void narrow(const float* src, float scale, int64_t n, void* p, int64_t start) {
  int64_t i = 0;
#if defined(TIDAL_VEC)
  if constexpr (DT == kF32 || DT == kBF16) {
    const vf sv = simd::set1(scale);
    for (; i + W <= n; i += W) storev<DT>(p, start + i, simd::mul(simd::load(src + i), sv));
  }
#endif
  for (; i < n; ++i) store1<DT>(p, start + i, src[i] * scale);
}

// Cache layout per layer (one block = block_size tokens):
//   K [num_blocks, Hk, D, block_size]  (transposed: the scores of 16 tokens are one vector FMA chain);
//     a bf16 cache's (D even) in pairs of dims: [num_blocks, Hk, D / 2, block_size, 2], dims 2p and 2p + 1 of
//     a token side by side, so that 16 tokens' pairs are the 64 bytes a VDPBF16PS (or an AMX tile row) takes
//     as they are, and widening a pair's halves costs one shift or one mask
//   V [num_blocks, Hk, block_size, D]; a bf16 cache's (block_size even) in pairs of tokens: [num_blocks, Hk,
//     block_size / 2, D, 2], tokens 2k and 2k + 1 of a dim side by side (the weighted sum's pair operand)
template <int DT> static inline bool k_pairs(int64_t D) { return DT == kBF16 && D % 2 == 0; }
template <int DT> static inline bool v_pairs(int64_t bs) { return DT == kBF16 && bs % 2 == 0; }
// where the row of the block's token t starts in one head's V block: its pair's row where v_pairs (the token's
// dim d then at 2 d + t % 2)
template <int DT> static inline int64_t v_row(int64_t t, int64_t bs, int64_t D) {
  return v_pairs<DT>(bs) ? (t & ~int64_t{1}) * D : t * D;
}
template <int DT> static inline int64_t v_offset(int64_t t, int64_t d, int64_t bs, int64_t D) {
  return v_pairs<DT>(bs) ? v_row<DT>(t, bs, D) + 2 * d + (t & 1) : t * D + d;
}
// where dim d of the block's token t sits in one head's K block
template <int DT> static inline int64_t k_offset(int64_t d, int64_t t, int64_t bs, int64_t D) {
  return k_pairs<DT>(D) ? (d & ~int64_t{1}) * bs + 2 * t + (d & 1) : d * bs + t;
}
// `rows` (even) bf16 rows of n values stored in pairs of rows (rows 2i and 2i + 1 interleaved value by value,
// 2 n words a pair) as fp32 rows [rows][n]
static void widen_pairs(const uint16_t* src, int64_t rows, int64_t n, float* dst) {
  for (int64_t r = 0; r < rows; r += 2) {
    const uint16_t* pairs = src + r * n;
    float* even = dst + r * n;
    float* odd = even + n;
    int64_t i = 0;
#if defined(TIDAL_VEC)
    for (; i + W <= n; i += W) {
      simd::store(even + i, simd::load_bf16_half<0>(pairs + 2 * i));
      simd::store(odd + i, simd::load_bf16_half<1>(pairs + 2 * i));
    }
#endif
    for (; i < n; ++i) even[i] = simd::bf16_to_float(pairs[2 * i]), odd[i] = simd::bf16_to_float(pairs[2 * i + 1]);
  }
}

// One head's K block (from element `start`) as fp32 rows of dims, [D][bs] (a bf16 cache's pairs taken apart)
template <int DT> static void widen_k_block(const void* k, int64_t start, int64_t D, int64_t bs, float* dst) {
  if (!k_pairs<DT>(D)) return widen<DT>(k, start, D * bs, dst);
  widen_pairs(static_cast<const uint16_t*>(k) + start, D, bs, dst);
}

#if defined(TIDAL_VEC)
// dim d (of parity PAR) of W tokens as fp32, from `at` = a head's K block + k_offset(0, the first token)
template <int DT, int PAR> static inline vf load_k(const void* k, int64_t at, int64_t d, int64_t bs) {
  if constexpr (DT == kBF16) return simd::load_bf16_half<PAR>(static_cast<const uint16_t*>(k) + at + (d - PAR) * bs);
  else return loadv<DT>(k, at + d * bs);
}
// dims [d, d + W) of a token of parity PAR as fp32, its row at `row` (a head's V block + v_row)
template <int DT, int PAR> static inline vf load_v(const void* v, int64_t row, int64_t d) {
  if constexpr (DT == kBF16) return simd::load_bf16_half<PAR>(static_cast<const uint16_t*>(v) + row + 2 * d);
  else return loadv<DT>(v, row + d);
}
#endif

// One head's V block (from element `start`) as fp32 rows of tokens, [bs][D] (a bf16 cache's pairs taken apart)
template <int DT> static void widen_v_block(const void* v, int64_t start, int64_t D, int64_t bs, float* dst) {
  if (!v_pairs<DT>(bs)) return widen<DT>(v, start, D * bs, dst);
  widen_pairs(static_cast<const uint16_t*>(v) + start, bs, D, dst);
}

template <int DT>
static void scores_generic(const float* qf, const void* k_cache, const int64_t* table, int64_t L, int64_t h,
                           int64_t G, int64_t Hk, int64_t D, int64_t bs, float* scores) {
  for (int64_t t = 0; t < L; ++t) {
    const int64_t base = (table[t / bs] * Hk + h) * D * bs;
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * load1<DT>(k_cache, base + k_offset<DT>(d, t % bs, bs, D));
      scores[g * L + t] = s;
    }
  }
}

template <int DT>
static void accumulate_generic(const float* scores, const void* v_cache, const int64_t* table, int64_t L,
                               int64_t h, int64_t G, int64_t Hk, int64_t D, int64_t bs, float* acc) {
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t base = (table[t / bs] * Hk + h) * bs * D;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        acc[g * D + d] += scores[g * L + t] * load1<DT>(v_cache, base + v_offset<DT>(t % bs, d, bs, D));
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

#if defined(TIDAL_VEC)
using simd::prefetch_bytes;

// softmax_vec up to its last pass: exp(s - max) in place; returns the factor softmax_vec multiplies them by
// (1 / their sum), for a caller that applies it as it reads them (bf16_pairs). Every token goes through
// simd::exp, a last partial vector masked (a scalar tail through libm's expf cost as much as the vectors on
// rows of ~1,100 tokens); the sum is per lane (token mod W, in token order), reduced once.
static float softmax_exp(float* s, int64_t L) {
  vf mv = simd::set1(-INFINITY);
  int64_t t = 0;
  for (; t + W <= L; t += W) mv = simd::max(mv, simd::load(s + t));
  if (t < L) mv = simd::max(mv, simd::load_first(s + t, L - t, -INFINITY));
  const vf mb = simd::set1(simd::reduce_max(mv));
  vf sv = simd::zero();
  for (t = 0; t + W <= L; t += W) {
    const vf e = simd::exp(simd::sub(simd::load(s + t), mb));
    simd::store(s + t, e);
    sv = simd::add(sv, e);
  }
  if (t < L) {
    const vf e = simd::exp(simd::sub(simd::load_first(s + t, L - t, 0.f), mb));
    simd::store_first(s + t, e, L - t);
    sv = simd::add_first(sv, e, L - t);
  }
  return 1.f / simd::reduce_add(sv);
}

static void softmax_vec(float* s, int64_t L) {
  const vf iv = simd::set1(softmax_exp(s, L));
  int64_t t = 0;
  for (; t + W <= L; t += W) simd::store(s + t, simd::mul(simd::load(s + t), iv));
  if (t < L) simd::store_first(s + t, simd::mul(simd::load_first(s + t, L - t, 0.f), iv), L - t);
}

// silu(gate) * up over rows [gate | up] of 2 * d values, matching the reference computation (each op
// rounds to the dtype): s = round(g / (1 + exp(-g))); out = round(s * u).
template <int DT>
static void silu_and_mul(const void* x, void* out, int64_t T, int64_t d, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * d > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g = t * 2 * d, u = g + d, o = t * d;
    int64_t i = 0;
    for (; i + W <= d; i += W) {
      const vf gv = loadv<DT>(x, g + i), uv = loadv<DT>(x, u + i);
      vf sv = simd::silu(gv);
      if (DT == kBF16) {
        sv = simd::round_bf16(sv);
        simd::store_bf16(static_cast<uint16_t*>(out) + o + i, simd::mul(sv, uv));
      } else {
        simd::store(static_cast<float*>(out) + o + i, simd::mul(sv, uv));
      }
    }
    for (; i < d; ++i) {
      const float gi = load1<DT>(x, g + i);
      const float si = round_to<DT>(gi / (1.f + std::exp(-gi)));
      store1<DT>(out, o + i, si * load1<DT>(x, u + i));
    }
  }
}

// One dim d (of parity PAR) of scores_vec's step: acc[g][v] += q[g][d] * k[v][d]
template <int DT, int PAR, int G, int TV>
[[gnu::always_inline]] static inline void scores_dim(const float* qf, int64_t D, const void* k_cache,
                                                     const int64_t* base, int64_t d, int64_t bs, vf (&acc)[G][TV]) {
  vf k[TV];
  #pragma GCC unroll 16
  for (int v = 0; v < TV; ++v) k[v] = load_k<DT, PAR>(k_cache, base[v], d, bs);
  #pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
    const vf qv = simd::set1(qf[g * D + d]);
    #pragma GCC unroll 16
    for (int v = 0; v < TV; ++v) acc[g][v] = simd::fmadd(qv, k[v], acc[g][v]);
  }
}

// block_size a multiple of W: the scores of W consecutive tokens accumulate in one register. TV
// registers of tokens (possibly of different blocks) per query head are in flight at once, so that
// G * TV independent FMA chains hide the FMA latency and each broadcast query value serves TV vectors.
// G (query heads per KV head) and C (head_dim / W) are template parameters so the accumulators stay
// in registers. Tokens [t_begin, t_end) (t_begin a multiple of bs); row g's scores at scores + g * stride.
template <int DT, int G, int C, int TV>
static void scores_vec(const float* qf, const void* k_cache, const void* v_cache, const int64_t* table,
                       int64_t t_begin, int64_t t_end, int64_t stride, int64_t h, int64_t Hk, int64_t bs,
                       float* scores) {
  constexpr int64_t D = C * W, STEP = TV * W;
  alignas(64) float tail[G][TV][W];
  const int64_t chunk_bytes = D * bs * elem_size<DT>();  // one block of one head: contiguous
  constexpr int64_t ahead = 4;
  // the first blocks, which no step of this range asks for: all in flight at once (a decode's range starts
  // with four blocks' misses otherwise; 128 decodes from memory 5-10% faster)
  for (int64_t t0 = t_begin; t0 < std::min(t_end, t_begin + ahead * bs); t0 += bs)
    prefetch_bytes<_MM_HINT_T1>(static_cast<const char*>(k_cache) + (table[t0 / bs] * Hk + h) * chunk_bytes,
                                chunk_bytes);
  for (int64_t start = t_begin; start < t_end; start += STEP) {
    int64_t base[TV];
    #pragma GCC unroll 16
    for (int v = 0; v < TV; ++v) {
      const int64_t t0 = start + v * W;
      if (t0 >= t_end) { base[v] = base[0]; continue; }  // past the range: computed, never stored
      const int64_t blk = table[t0 / bs], off = t0 % bs;
      base[v] = (blk * Hk + h) * D * bs + k_offset<DT>(0, off, bs, D);
      if (off == 0) {
        // Blocks sit at random places: hide their memory latency by asking for the K block four ahead
        // (into L2: more misses can be in flight there than in L1; measured 1.25x over one block ahead
        // into L1) and for this block's V (the second pass reads it; a request's V fits in L2).
        if (t0 + ahead * bs < t_end)
          prefetch_bytes<_MM_HINT_T1>(static_cast<const char*>(k_cache) + (table[t0 / bs + ahead] * Hk + h) * chunk_bytes,
                                      chunk_bytes);
        prefetch_bytes<_MM_HINT_T1>(static_cast<const char*>(v_cache) + (blk * Hk + h) * chunk_bytes, chunk_bytes);
      }
    }
    vf acc[G][TV];
    #pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
      #pragma GCC unroll 16
      for (int v = 0; v < TV; ++v) acc[g][v] = simd::zero();
    for (int64_t d = 0; d < D; d += 2) {  // (D is even: a multiple of W)
      scores_dim<DT, 0, G, TV>(qf, D, k_cache, base, d, bs, acc);
      scores_dim<DT, 1, G, TV>(qf, D, k_cache, base, d + 1, bs, acc);
    }
    if (start + STEP <= t_end) {  // every index a constant: the accumulators stay in registers in the d loop
      #pragma GCC unroll 16
      for (int v = 0; v < TV; ++v)
        #pragma GCC unroll 16
        for (int g = 0; g < G; ++g) simd::store(scores + g * stride + start + v * W, acc[g][v]);
      continue;
    }
    #pragma GCC unroll 16
    for (int v = 0; v < TV; ++v)
      #pragma GCC unroll 16
      for (int g = 0; g < G; ++g) simd::store(tail[g][v], acc[g][v]);
    #pragma GCC unroll 16
    for (int v = 0; v < TV; ++v) {
      const int64_t t0 = start + v * W;
      if (t0 >= t_end) break;
      const int64_t n = std::min<int64_t>(W, t_end - t0);
      #pragma GCC unroll 16
      for (int g = 0; g < G; ++g) std::copy(tail[g][v], tail[g][v] + n, scores + g * stride + t0);
    }
  }
}

constexpr int kVecRegs = W == 16 ? 32 : 16;  // vector registers: AVX-512's, AVX2's

// One token t (of parity PAR, its row at `row`) of accumulate_pass: av[g][c] += p[g][t] * V[t][d0 + c W]
template <int DT, int PAR, int G, int CN>
[[gnu::always_inline]] static inline void acc_token(const float* p, int64_t stride, int64_t t, const void* v_cache,
                                                    int64_t row, int64_t d0, vf (&av)[G][CN]) {
  if constexpr (G * CN + G + 1 <= kVecRegs) {  // G broadcasts, then one V vector at a time
    vf pv[G];
    #pragma GCC unroll 16
    for (int g = 0; g < G; ++g) pv[g] = simd::set1(p[g * stride + t]);
    #pragma GCC unroll 16
    for (int c = 0; c < CN; ++c) {
      const vf vv = load_v<DT, PAR>(v_cache, row, d0 + c * W);
      #pragma GCC unroll 16
      for (int g = 0; g < G; ++g) av[g][c] = simd::fmadd(pv[g], vv, av[g][c]);
    }
  } else {  // the CN V vectors, then one broadcast at a time: G * CN + CN + 1 registers
    vf vv[CN];
    #pragma GCC unroll 16
    for (int c = 0; c < CN; ++c) vv[c] = load_v<DT, PAR>(v_cache, row, d0 + c * W);
    #pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const vf pv = simd::set1(p[g * stride + t]);
      #pragma GCC unroll 16
      for (int c = 0; c < CN; ++c) av[g][c] = simd::fmadd(pv, vv[c], av[g][c]);
    }
  }
}

// One pass of accumulate_vec: vectors [c0, c0 + CN) of the head dim, all G rows' sums in registers.
template <int DT, int G, int C, int CN>
static void accumulate_pass(const float* p, int64_t stride, const void* v_cache, const int64_t* table, int64_t t_begin,
                            int64_t t_end, int64_t h, int64_t Hk, int64_t bs, float* acc, bool init, int c0) {
  constexpr int64_t D = C * W;
  const int64_t chunk_bytes = D * bs * elem_size<DT>();
  vf av[G][CN];
  #pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
    #pragma GCC unroll 16
    for (int c = 0; c < CN; ++c) av[g][c] = init ? simd::zero() : simd::load(acc + g * D + (c0 + c) * W);
  for (int64_t start = t_begin; start < t_end; start += bs) {  // block by block: no division per token
    const int64_t n = std::min(bs, t_end - start);
    const int64_t block_base = (table[start / bs] * Hk + h) * bs * D;
    if (c0 == 0 && start + bs < t_end)
      prefetch_bytes(static_cast<const char*>(v_cache) + (table[start / bs + 1] * Hk + h) * chunk_bytes, chunk_bytes);
    for (int64_t off = 0; off < n; off += 2) {  // (bs is a multiple of W: even)
      acc_token<DT, 0, G, CN>(p, stride, start + off, v_cache, block_base + v_row<DT>(off, bs, D), c0 * W, av);
      if (off + 1 < n)  // (the pair's row where v_pairs, the next row otherwise)
        acc_token<DT, 1, G, CN>(p, stride, start + off + 1, v_cache, block_base + v_row<DT>(off + 1, bs, D), c0 * W,
                                av);
    }
  }
  #pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
    #pragma GCC unroll 16
    for (int c = 0; c < CN; ++c) simd::store(acc + g * D + (c0 + c) * W, av[g][c]);
}

// Weighted sum of V rows: acc[g] += sum_t p[g, t] V[t] over tokens [t_begin, t_end) (t_begin a multiple of
// bs), starting from zero when init. The head dim is covered in passes of CB vectors, with all G query
// heads' sums for those CB vectors in registers (G * CB <= kAccRegs) for the whole range: each pass reads
// its own part of every V row, so V is read (and widened) once. Row g's probabilities at p + g * stride.
// Each pass's vector count is a template parameter: with every index a constant, the sums never leave the
// registers inside the loop (with a run-time count they were stored back on every token).
template <int DT, int G, int C>
static void accumulate_vec(const float* p, int64_t stride, const void* v_cache, const int64_t* table,
                           int64_t t_begin, int64_t t_end, int64_t h, int64_t Hk, int64_t bs, float* acc, bool init) {
  constexpr int kAccRegs = W == 16 ? 24 : 12;
  constexpr int CB = std::max(1, std::min(C, kAccRegs / G));  // vectors of the head dim per pass
  constexpr int full = C / CB * CB;
  for (int c0 = 0; c0 < full; c0 += CB)
    accumulate_pass<DT, G, C, CB>(p, stride, v_cache, table, t_begin, t_end, h, Hk, bs, acc, init, c0);
  if constexpr (C % CB != 0)
    accumulate_pass<DT, G, C, C % CB>(p, stride, v_cache, table, t_begin, t_end, h, Hk, bs, acc, init, full);
}

// One dim d (of parity PAR) of decode_heads' step for head h (its K at base[v] + head)
template <int DT, int PAR, int G, int TV>
[[gnu::always_inline]] static inline void heads_dim(const float* qh, int64_t D, const void* k_cache, const int64_t* base,
                                                    int64_t head, int64_t d, int64_t bs, vf (&acc)[G][TV]) {
  vf qv[G];
  #pragma GCC unroll 16
  for (int g = 0; g < G; ++g) qv[g] = simd::set1(qh[g * D + d]);
  #pragma GCC unroll 16
  for (int v = 0; v < TV; ++v) {
    const vf k = load_k<DT, PAR>(k_cache, base[v] + head, d, bs);
    #pragma GCC unroll 16
    for (int g = 0; g < G; ++g) acc[g][v] = simd::fmadd(qv[g], k, acc[g][v]);
  }
}

// One decode query (G query heads per KV head) over every KV head of its request, block by block: each
// step reads a run of consecutive blocks' K (then V) for all Hk heads before the next, so the request's
// blocks, side by side when they were allocated together (a prompt's), stream from memory as one run
// that the hardware prefetcher follows, instead of Hk runs of block-sized pieces strided by a block (one
// per head item). Every score, probability and sum is the chain scores_vec, softmax_vec and
// accumulate_vec compute (tokens in order, d in order, from zero): the same bits. qf: [Hk][G][D] scaled;
// out: [Hk][G][D] fp32 rows.
template <int DT, int G, int C>
static void decode_heads(const float* qf, const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                         int64_t Hk, int64_t bs, simd::avector<float>& work, float* out) {
  constexpr int64_t D = C * W;
  // G * TV accumulators + G broadcasts + one K vector within AVX2's 16 registers
  constexpr int TV = G <= 3 ? 4 : 2;
  constexpr int64_t STEP = TV * W;
  const int64_t stride = (L + STEP - 1) / STEP * STEP;  // whole steps stored: the row's tail is never read
  work.resize(Hk * G * stride);
  float* scores = work.data();
  const int64_t chunk = D * bs;  // one head's K (or V) of one block
  for (int64_t start = 0; start < L; start += STEP) {
    int64_t base[TV];
    #pragma GCC unroll 16
    for (int v = 0; v < TV; ++v) {
      const int64_t t0 = start + v * W;
      base[v] = t0 < L ? table[t0 / bs] * Hk * chunk + k_offset<DT>(0, t0 % bs, bs, D) : base[0];  // past L: never read
    }
    for (int64_t h = 0; h < Hk; ++h) {
      const float* qh = qf + h * G * D;
      vf acc[G][TV];
      #pragma GCC unroll 16
      for (int g = 0; g < G; ++g)
        #pragma GCC unroll 16
        for (int v = 0; v < TV; ++v) acc[g][v] = simd::zero();
      for (int64_t d = 0; d < D; d += 2) {
        heads_dim<DT, 0, G, TV>(qh, D, k_cache, base, h * chunk, d, bs, acc);
        heads_dim<DT, 1, G, TV>(qh, D, k_cache, base, h * chunk, d + 1, bs, acc);
      }
      #pragma GCC unroll 16
      for (int g = 0; g < G; ++g)
        #pragma GCC unroll 16
        for (int v = 0; v < TV; ++v) simd::store(scores + (h * G + g) * stride + start + v * W, acc[g][v]);
    }
  }
  for (int64_t r = 0; r < Hk * G; ++r) softmax_vec(scores + r * stride, L);
  const int64_t span = std::max<int64_t>(bs, STEP / bs * bs);  // tokens per step: whole blocks
  for (int64_t start = 0; start < L; start += span)
    for (int64_t h = 0; h < Hk; ++h)  // each head's sums carried on from the step before
      accumulate_vec<DT, G, C>(scores + h * G * stride, stride, v_cache, table, start, std::min(L, start + span), h,
                               Hk, bs, out + h * G * D, start == 0);
}

using HeadsFn = void (*)(const float* qf, const void* k_cache, const void* v_cache, const int64_t* table, int64_t L,
                         int64_t Hk, int64_t bs, simd::avector<float>& work, float* out);

// decode_heads for G query heads per KV head and head_dim D (AVX2 builds: measured there), or none
template <int DT, int G>
static HeadsFn heads_kernel_for_dim(int64_t C) {
  switch (C) {
    case 4: return decode_heads<DT, G, 4>;
    case 8: return decode_heads<DT, G, 8>;
    case 16: return decode_heads<DT, G, 16>;
    default: return nullptr;
  }
}

template <int DT>
static HeadsFn heads_kernel_for(int64_t G, int64_t D, int64_t bs) {
#if TIDAL_VEC == 8
  if (D % W == 0 && bs % W == 0) {
    switch (G) {
      case 1: return heads_kernel_for_dim<DT, 1>(D / W);
      case 2: return heads_kernel_for_dim<DT, 2>(D / W);
      case 3: return heads_kernel_for_dim<DT, 3>(D / W);
      case 4: return heads_kernel_for_dim<DT, 4>(D / W);
      default: return nullptr;
    }
  }
#endif
  (void)G; (void)D; (void)bs;
  return nullptr;
}

#if defined(__AVX512BF16__)
// The scores of scores_bf16 (below) on AMX tiles, where simd::amx_usable(): for each group of 16 tokens, the
// cache's (dim 2p, dim 2p + 1) pairs of those tokens for 32 dims are a weight tile of 16 pairs x 16 tokens,
// loaded as it is (rows 2 bs words apart), and TDPBF16PS multiplies the R query rows (a tile of
// 16 rows, those past R zero) by it: each score one sum over the head's dims in chunks of 32, from zero in
// dim order, whatever R is and whichever tokens share its group, so a row's scores are the same alone (a
// decode's G rows) or in a tile of 12 (a prompt chunk, decodes sharing a prefix). Tiles: tmm0 the sums,
// tmm1-4 the query's chunks (D <= 128), tmm5-6 the K tiles in turn.
template <int CH>
TIDAL_AMX_TARGET static inline void load_query_chunks(const uint16_t* qa) {
  _tile_loadd(1, qa, 64);
  if constexpr (CH > 1) _tile_loadd(2, qa + 512, 64);
  if constexpr (CH > 2) _tile_loadd(3, qa + 1024, 64);
  if constexpr (CH > 3) _tile_loadd(4, qa + 1536, 64);
}

template <int CHI>
TIDAL_AMX_TARGET static inline void score_chunk(const uint16_t* kb, int64_t ld) {
  // (the tile numbers are written out: the intrinsics paste them into the instruction)
  if constexpr (CHI % 2 == 0) _tile_loadd(5, kb, ld);
  else _tile_loadd(6, kb, ld);
  if constexpr (CHI == 0) _tile_dpbf16ps(0, 1, 5);
  else if constexpr (CHI == 1) _tile_dpbf16ps(0, 2, 6);
  else if constexpr (CHI == 2) _tile_dpbf16ps(0, 3, 5);
  else _tile_dpbf16ps(0, 4, 6);
}

// the tiles' configuration of the scores kernels, and the R query rows' chunks in tmm1-4 (rows past R zero)
template <int R, int C>
TIDAL_AMX_TARGET static inline void begin_scores(const uint16_t* qb) {
  constexpr int64_t D = C * 16;
  constexpr int CH = C / 2;  // chunks of 32 dims
  static_assert(C % 2 == 0 && CH <= 4 && R <= 16, "AMX scores: D a multiple of 32 up to 128, at most 16 rows");
  alignas(64) uint16_t qa[CH][16][32];
  std::memset(qa, 0, sizeof(qa));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CH; ++c) std::memcpy(qa[c][r], qb + r * D + 32 * c, 64);
  simd::tiles_see_stores();
  simd::TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  simd::load_tile_config(cfg);
  load_query_chunks<CH>(&qa[0][0][0]);
}

// one group's scores from its K pairs (kb: those of dims 0, 1 of its first token, in blocks of bs tokens)
// into sums (tmm0 through the chunks of 32 dims, 32 bs words apart)
template <int CH>
TIDAL_AMX_TARGET static inline void score_group(const uint16_t* kb, int64_t bs, float (*sums)[16]) {
  const int64_t ld = 4 * bs, chunk = 32 * bs;
  _tile_zero(0);
  score_chunk<0>(kb, ld);
  if constexpr (CH > 1) score_chunk<1>(kb + chunk, ld);
  if constexpr (CH > 2) score_chunk<2>(kb + 2 * chunk, ld);
  if constexpr (CH > 3) score_chunk<3>(kb + 3 * chunk, ld);
  _tile_stored(0, sums, 64);
}

template <int R, int C>
TIDAL_AMX_TARGET static void scores_bf16_amx(const uint16_t* qb, float scale, const uint16_t* k_cache,
                                             const uint16_t* v_cache, const int64_t* table, int64_t t_begin,
                                             int64_t t_end, int64_t stride, int64_t h, int64_t Hk, int64_t bs,
                                             float* scores) {
  constexpr int64_t D = C * 16;
  constexpr int CH = C / 2;  // chunks of 32 dims
  static_assert(C % 2 == 0 && CH <= 4 && R <= 16, "AMX scores: D a multiple of 32 up to 128, at most 16 rows");
  begin_scores<R, C>(qb);
  alignas(64) float sums[16][16];
  const __m512 sv = _mm512_set1_ps(scale);
  const int64_t chunk_bytes = D * bs * 2;
  constexpr int64_t ahead = 8;  // groups of 16 tokens: scores_bf16's two steps of 4
  for (int64_t t0 = t_begin; t0 < std::min(t_end, t_begin + ahead * 16); t0 += bs)
    prefetch_bytes<_MM_HINT_T1>(reinterpret_cast<const char*>(k_cache + (table[t0 / bs] * Hk + h) * D * bs), chunk_bytes);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
    const int64_t blk = table[t0 / bs], off = t0 % bs;
    const uint16_t* base = k_cache + (blk * Hk + h) * D * bs + 2 * off;
    if (off == 0) {
      const int64_t next = t0 + ahead * 16;
      if (next < t_end && next % bs < 16)
        prefetch_bytes<_MM_HINT_T1>(reinterpret_cast<const char*>(k_cache + (table[next / bs] * Hk + h) * D * bs),
                                    chunk_bytes);
      prefetch_bytes<_MM_HINT_T1>(reinterpret_cast<const char*>(v_cache + (blk * Hk + h) * D * bs), chunk_bytes);
    }
    score_group<CH>(base, bs, sums);
    const int64_t n = std::min<int64_t>(16, t_end - t0);
    const __mmask16 nmask = (__mmask16)((1u << n) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(scores + r * stride + t0, nmask, _mm512_mul_ps(_mm512_load_ps(sums[r]), sv));
  }
  _tile_release();
}

// bf16 cache: the dot products run on VDPBF16PS (pairs of bf16 products accumulated in fp32, twice
// the work of an fp32 FMA per instruction). Scores: q . k with q, k in bf16 (exact products), then
// scaled. The cache's (dim 2p, dim 2p + 1) pairs of 16 tokens are one 512-bit load. Tokens and rows as in
// scores_vec.
template <int G, int C>
static void scores_bf16(const uint16_t* qb, float scale, const uint16_t* k_cache, const uint16_t* v_cache,
                        const int64_t* table, int64_t t_begin, int64_t t_end, int64_t stride, int64_t h, int64_t Hk,
                        int64_t bs, float* scores) {
  if constexpr (C / 2 <= 4 && G <= 16) {
    if (simd::amx_usable()) {
      scores_bf16_amx<G, C>(qb, scale, k_cache, v_cache, table, t_begin, t_end, stride, h, Hk, bs, scores);
      return;
    }
  }
  constexpr int64_t D = C * 16;
  // TV groups of 16 tokens (possibly of different blocks) are in flight at once, so that G * TV
  // independent VDPBF16PS chains hide the instruction's latency when G is small (a decode's query heads
  // per KV head); each score is still one chain over the dim pairs in order, whatever TV is.
  constexpr int TV = std::max(1, std::min(4, 16 / G));
  constexpr int64_t STEP = TV * 16;
  uint32_t qpair[G][D / 2];
  for (int g = 0; g < G; ++g) std::memcpy(qpair[g], qb + g * D, D * 2);
  const __m512 sv = _mm512_set1_ps(scale);
  float tmp[16];
  const int64_t chunk_bytes = D * bs * 2;
  // K blocks are asked for two steps ahead (into L2); the range's first blocks, which no step asks for,
  // all at once before the first step, as scores_vec does (128 decodes from memory on a Zen 4: a median
  // 22.2 against 21.2 GB/s over 14 alternating rounds, with four steps ahead and no first blocks)
  constexpr int64_t ahead = 2 * TV;
  for (int64_t t0 = t_begin; t0 < std::min(t_end, t_begin + ahead * bs); t0 += bs)
    prefetch_bytes<_MM_HINT_T1>(reinterpret_cast<const char*>(k_cache + (table[t0 / bs] * Hk + h) * D * bs), chunk_bytes);
  for (int64_t start = t_begin; start < t_end; start += STEP) {
    const uint16_t* base[TV];
    for (int v = 0; v < TV; ++v) {
      const int64_t t0 = start + v * 16;
      if (t0 >= t_end) { base[v] = base[0]; continue; }  // past the range: computed, never stored
      const int64_t blk = table[t0 / bs], off = t0 % bs;
      base[v] = k_cache + (blk * Hk + h) * D * bs + 2 * off;
      if (off == 0) {
        if (t0 + ahead * bs < t_end)
          prefetch_bytes<_MM_HINT_T1>(reinterpret_cast<const char*>(k_cache + (table[t0 / bs + ahead] * Hk + h) * D * bs),
                                      chunk_bytes);
        prefetch_bytes<_MM_HINT_T1>(reinterpret_cast<const char*>(v_cache + (blk * Hk + h) * D * bs), chunk_bytes);
      }
    }
    __m512 acc[G][TV];
    #pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
      #pragma GCC unroll 16
      for (int v = 0; v < TV; ++v) acc[g][v] = _mm512_setzero_ps();
    // every index into acc a constant once the loops over g and v are unrolled: the accumulators then stay
    // in registers (with those loops left rolled, GCC kept them on the stack, a load and a store around
    // every VDPBF16PS: tiles of 12 rows 1.5x slower). The layout test is the same on every iteration.
    for (int64_t p = 0; p < D / 2; ++p) {
      __m512i kp[TV];
      #pragma GCC unroll 16
      for (int v = 0; v < TV; ++v) kp[v] = _mm512_loadu_si512(base[v] + 2 * p * bs);
      #pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const __m512i qv = _mm512_set1_epi32(static_cast<int>(qpair[g][p]));
        #pragma GCC unroll 16
        for (int v = 0; v < TV; ++v) acc[g][v] = _mm512_dpbf16_ps(acc[g][v], (__m512bh)kp[v], (__m512bh)qv);
      }
    }
    #pragma GCC unroll 16
    for (int v = 0; v < TV; ++v) {
      const int64_t t0 = start + v * 16;
      if (t0 >= t_end) continue;
      const int64_t n = std::min<int64_t>(16, t_end - t0);
      #pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const __m512 s = _mm512_mul_ps(acc[g][v], sv);
        if (n == 16) {
          _mm512_storeu_ps(scores + g * stride + t0, s);
        } else {
          _mm512_storeu_ps(tmp, s);
          std::copy(tmp, tmp + n, scores + g * stride + t0);
        }
      }
    }
  }
}

// The probabilities of `rows` rows rounded to bf16 (as torch's CPU flash attention does before its P.V
// product), in token order; read as 32-bit words, element i of row r is the pair (2i, 2i + 1). Row r
// (stride `stride` floats in, (stride + 1) / 2 words out) converts its first ends[r / G] values; an odd
// count gets a zero partner.
// (row r's values times factor[r] first, where factor is given: softmax_vec's last pass, the same products)
static void bf16_pairs(const float* scores, int64_t stride, int64_t rows, int64_t G, const int64_t* ends,
                       uint32_t* ppairs, const float* factor = nullptr) {
  const int64_t half = (stride + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* sg = scores + r * stride;
    uint16_t* pb = reinterpret_cast<uint16_t*>(ppairs + r * half);
    const int64_t L = ends[r / G];
    const float f = factor ? factor[r] : 1.f;  // (x * 1 is x)
    const __m512 fv = _mm512_set1_ps(f);
    int64_t t = 0;
    for (; t + 32 <= L; t += 32)
      _mm512_storeu_si512(pb + t, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sg + t + 16), fv),
                                                               _mm512_mul_ps(_mm512_loadu_ps(sg + t), fv)));
    if (t < L) {  // the last values by the same conversion, zeros after them (a last odd value's partner)
      const int64_t r = L - t;
      const __mmask16 lo = (__mmask16)(r >= 16 ? 0xffff : (1u << r) - 1);
      const __mmask16 hi = (__mmask16)(r > 16 ? (1u << (r - 16)) - 1 : 0);
      const __m512 x0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(lo, sg + t), fv);
      const __m512 x1 = _mm512_mul_ps(_mm512_maskz_loadu_ps(hi, sg + t + 16), fv);
      const int64_t stored = r + (r % 2);
      _mm512_mask_storeu_epi16(pb + t, (__mmask32)(stored >= 32 ? ~0u : (1u << stored) - 1),
                               (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
    }
  }
}

static constexpr int pow2_floor(int x) { return x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; }

// accumulate_bf16 (below) on AMX tiles, where simd::amx_usable() and bs is a multiple of 16: per group of 16
// tokens (groups from t_begin, a multiple of bs: the same groups whichever call covers a token), the rows' 8
// probability pairs (a tile of G rows x 32 bytes) times, per 16 dims, the cache's 8 token pairs of those dims
// (a tile loaded as it is, rows 2 D words apart), into sum tiles that are acc's rows: acc[g][c][16] is row g
// of sum tile c (dims 16 c on), loaded (or zeroed when init) and stored with a row stride of C * 16 floats.
// A last group's tiles are copied, a last odd token's partner and the pairs past the range zero, as in
// accumulate_bf16. Tiles: tmm0-3 the sums of up to 64 dims per pass, tmm4 the probabilities, tmm5-6 V.
template <int J>
TIDAL_AMX_TARGET static inline void acc_tile_load(float* acc, int64_t ldb, bool init) {
  if (init) {
    if constexpr (J == 0) _tile_zero(0);
    else if constexpr (J == 1) _tile_zero(1);
    else if constexpr (J == 2) _tile_zero(2);
    else _tile_zero(3);
  } else {
    if constexpr (J == 0) _tile_loadd(0, acc, ldb);
    else if constexpr (J == 1) _tile_loadd(1, acc, ldb);
    else if constexpr (J == 2) _tile_loadd(2, acc, ldb);
    else _tile_loadd(3, acc, ldb);
  }
}

template <int J>
TIDAL_AMX_TARGET static inline void acc_tile_store(float* acc, int64_t ldb) {
  if constexpr (J == 0) _tile_stored(0, acc, ldb);
  else if constexpr (J == 1) _tile_stored(1, acc, ldb);
  else if constexpr (J == 2) _tile_stored(2, acc, ldb);
  else _tile_stored(3, acc, ldb);
}

// sum tile J += probabilities (tmm4) x the V tile at vb (rows ld bytes apart)
template <int J>
TIDAL_AMX_TARGET static inline void acc_tile_step(const uint16_t* vb, int64_t ld) {
  if constexpr (J % 2 == 0) _tile_loadd(5, vb, ld);
  else _tile_loadd(6, vb, ld);
  if constexpr (J == 0) _tile_dpbf16ps(0, 4, 5);
  else if constexpr (J == 1) _tile_dpbf16ps(1, 4, 6);
  else if constexpr (J == 2) _tile_dpbf16ps(2, 4, 5);
  else _tile_dpbf16ps(3, 4, 6);
}

// A group's V (pairs: the pair row of its first two tokens at dim 16 c0, pair rows 2 D words apart; n tokens)
// copied as the weighted sum's tiles for nc 16-dim chunks: vb[c][8 pairs][16] words (a last odd token's
// partner and the pairs past n zero), tile c `unit` words apart
static inline void copy_v_group(const uint16_t* pairs, int64_t D, int64_t n, int nc, int64_t unit, uint32_t* vb) {
  const int64_t np = (n + 1) / 2;
  const __m512i first = _mm512_set1_epi32(0xffff);
  for (int64_t k = 0; k < 8; ++k)
    for (int c = 0; c < nc; ++c) {
      __m512i w = _mm512_setzero_si512();
      if (k < np) {
        w = _mm512_loadu_si512(pairs + 2 * k * D + 32 * c);
        if (2 * k + 1 == n) w = _mm512_and_si512(w, first);  // the last token alone
      }
      _mm512_store_si512(vb + c * unit + k * 16, w);
    }
}

// a pass's nc (2 or 4) sum tiles, those of acc's dims from 16 c0: loaded (or zeroed when init), stepped by the
// probabilities in tmm4 times the V tiles at vb (`unit` elements apart, rows ld bytes apart), stored
TIDAL_AMX_TARGET static inline void acc_tiles_load(float* acc, int c0, int64_t ldb, bool init, int nc) {
  acc_tile_load<0>(acc + c0 * 16, ldb, init);
  acc_tile_load<1>(acc + (c0 + 1) * 16, ldb, init);
  if (nc > 2) {
    acc_tile_load<2>(acc + (c0 + 2) * 16, ldb, init);
    acc_tile_load<3>(acc + (c0 + 3) * 16, ldb, init);
  }
}

TIDAL_AMX_TARGET static inline void acc_tiles_step(const uint16_t* vb, int64_t unit, int64_t ld, int nc) {
  acc_tile_step<0>(vb, ld);
  acc_tile_step<1>(vb + unit, ld);
  if (nc > 2) {
    acc_tile_step<2>(vb + 2 * unit, ld);
    acc_tile_step<3>(vb + 3 * unit, ld);
  }
}

TIDAL_AMX_TARGET static inline void acc_tiles_store(float* acc, int c0, int64_t ldb, int nc) {
  acc_tile_store<0>(acc + c0 * 16, ldb);
  acc_tile_store<1>(acc + (c0 + 1) * 16, ldb);
  if (nc > 2) {
    acc_tile_store<2>(acc + (c0 + 2) * 16, ldb);
    acc_tile_store<3>(acc + (c0 + 3) * 16, ldb);
  }
}

TIDAL_AMX_TARGET static inline void configure_acc(int G) {
  simd::TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = G;
  cfg.colsb[4] = 32, cfg.rows[4] = G;
  cfg.colsb[5] = cfg.colsb[6] = 64, cfg.rows[5] = cfg.rows[6] = 8;
  simd::load_tile_config(cfg);
}

template <int G, int C>
TIDAL_AMX_TARGET static void accumulate_bf16_amx(const uint32_t* ppairs, int64_t half, const uint16_t* v_cache,
                                                 const int64_t* table, int64_t t_begin, int64_t t_end, int64_t h,
                                                 int64_t Hk, int64_t bs, float* acc, bool init) {
  constexpr int64_t D = C * 16;
  static_assert(C % 2 == 0 && G <= 16, "AMX weighted sum: D a multiple of 32, at most 16 rows");
  configure_acc(G);
  const int64_t ldb = C * 16 * 4;  // acc's row stride in bytes
  const int64_t chunk_bytes = D * bs * 2;
  alignas(64) uint32_t pa[16][8];   // a last group's probabilities, zero past the range
  alignas(64) uint32_t vb[4][8][16];  // a last group's V tiles: [sum tile][token pair][16 dims]
  for (int c0 = 0; c0 < C; c0 += 4) {  // passes of up to 64 dims (4 sum tiles)
    const int nc = (int)std::min<int64_t>(4, C - c0);
    acc_tiles_load(acc, c0, ldb, init, nc);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, t_end - t0), np = (n + 1) / 2;
      // the pair row of tokens t0, t0 + 1 at dim 16 c0
      const uint16_t* pairs = v_cache + (table[t0 / bs] * Hk + h) * bs * D + (t0 % bs) * D + 32 * c0;
      if (c0 == 0 && t0 % bs == 0 && t0 + bs < t_end)
        prefetch_bytes(reinterpret_cast<const char*>(v_cache + (table[t0 / bs + 1] * Hk + h) * bs * D), chunk_bytes);
      if (n == 16) {
        _tile_loadd(4, ppairs + t0 / 2, half * 4);
        acc_tiles_step(pairs, 32, 4 * D, nc);
      } else {
        std::memset(pa, 0, sizeof(pa));
        for (int g = 0; g < G; ++g) std::memcpy(pa[g], ppairs + g * half + t0 / 2, np * 4);
        copy_v_group(pairs, D, n, nc, 128, &vb[0][0][0]);
        simd::tiles_see_stores();
        _tile_loadd(4, pa, 32);
        acc_tiles_step(reinterpret_cast<const uint16_t*>(&vb[0][0][0]), 256, 64, nc);
      }
    }
    acc_tiles_store(acc, c0, ldb, nc);
  }
  _tile_release();
}

// Weighted sum of V rows over the bf16 probability pairs of bf16_pairs (row g at ppairs + g * half): the
// cache's (token t, token t + 1) pairs of 16 dims are one load, so one VDPBF16PS adds two tokens. Tokens
// [t_begin, t_end), t_begin a multiple of bs (bs is even: a pair never straddles two blocks); a last odd
// token's partner is zeroed (its row may hold anything). acc [G][D] holds the sums, from zero when init.
// The head dim is covered in passes of P2 32-dim units, so that at most 24 accumulators are live.
template <int G, int C>
static void accumulate_bf16(const uint32_t* ppairs, int64_t half, const uint16_t* v_cache, const int64_t* table,
                            int64_t t_begin, int64_t t_end, int64_t h, int64_t Hk, int64_t bs, float* acc, bool init) {
  if constexpr (G <= 16) {
    if (simd::amx_usable() && bs % 16 == 0) {
      accumulate_bf16_amx<G, C>(ppairs, half, v_cache, table, t_begin, t_end, h, Hk, bs, acc, init);
      return;
    }
  }
  constexpr int64_t D = C * 16;
  constexpr int C2 = C / 2, P2 = pow2_floor(std::min(C2, std::max(1, 12 / G)));
  static_assert(C2 % P2 == 0, "passes cover the head dim");
  const int64_t chunk_bytes = D * bs * 2;
  for (int u0 = 0; u0 < C2; u0 += P2) {
    __m512 av[G][2 * P2];  // in registers: every loop over g, u and c below is unrolled (see scores_bf16)
    #pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
      #pragma GCC unroll 16
      for (int c = 0; c < 2 * P2; ++c)
        av[g][c] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (g * C + 2 * u0 + c) * 16);
    for (int64_t start = t_begin; start < t_end; start += bs) {
      const int64_t n = std::min(bs, t_end - start);
      const uint16_t* block = v_cache + (table[start / bs] * Hk + h) * bs * D + u0 * 64;  // pair row 0, dim 32 u0
      if (u0 == 0 && start + bs < t_end)
        prefetch_bytes(reinterpret_cast<const char*>(v_cache + (table[start / bs + 1] * Hk + h) * bs * D), chunk_bytes);
      for (int64_t off = 0; off < n; off += 2) {
        const uint16_t* prow = block + off * D;  // tokens off, off + 1
        const __m512i keep = off + 1 < n ? _mm512_set1_epi32(-1) : _mm512_set1_epi32(0xffff);
        __m512i pp[G];
        #pragma GCC unroll 16
        for (int g = 0; g < G; ++g) pp[g] = _mm512_set1_epi32(static_cast<int>(ppairs[g * half + (start + off) / 2]));
        #pragma GCC unroll 16
        for (int u = 0; u < P2; ++u) {
          const __m512i lo = _mm512_and_si512(_mm512_loadu_si512(prow + u * 64), keep);
          const __m512i hi = _mm512_and_si512(_mm512_loadu_si512(prow + u * 64 + 32), keep);
          #pragma GCC unroll 16
          for (int g = 0; g < G; ++g) {
            av[g][2 * u] = _mm512_dpbf16_ps(av[g][2 * u], (__m512bh)lo, (__m512bh)pp[g]);
            av[g][2 * u + 1] = _mm512_dpbf16_ps(av[g][2 * u + 1], (__m512bh)hi, (__m512bh)pp[g]);
          }
        }
      }
    }
    #pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
      #pragma GCC unroll 16
      for (int c = 0; c < 2 * P2; ++c) _mm512_storeu_ps(acc + (g * C + 2 * u0 + c) * 16, av[g][c]);
  }
}

// A prompt chunk's tile on AMX: n <= 16 consecutive tokens of one request (token i sees its first lens[i]
// cached tokens, lens growing by one, S = lens[n - 1]) against KV head h, its G query heads one after the
// other as 16-row tiles (rows the tokens). Every row is what attend_tile computes for it in tiles of fewer
// tokens, and what the one-token path computes alone: the same scores (per group of 16 tokens from zero, the
// chunks of 32 dims into one sum tile, times scale), softmax_exp over the row's own tokens, its probabilities
// rounded to pairs with the factor folded in (bf16_pairs), zero past the row's length, and the weighted sum
// over the same groups of 16 from zero sums (a last partial group's V copied with zeros past S). What the
// wider tile saves is the work per K/V tile: each loaded for 16 rows (attend_tile's tiles hold 12), K walked
// in spans that the heads after the first read from L1, two tile configurations for 16 tokens instead of two
// for every 4. qb [n][G][D] bf16; res [n][G][D] fp32; w: the query tiles, scores and probability pairs.
struct PromptWork {
  simd::avector<float> scores;
  simd::avector<uint32_t> pairs;
  simd::avector<uint16_t> qa;  // the heads' query chunks of 32 dims: [G][CH][16 rows][32]
};

template <int C>
TIDAL_AMX_TARGET static void attend_prompt_amx(const uint16_t* qb, int64_t n, const int64_t* lens, int64_t G,
                                               float scale, const uint16_t* k_cache, const uint16_t* v_cache,
                                               const int64_t* table, int64_t h, int64_t Hk, int64_t bs,
                                               PromptWork& w, float* res) {
  constexpr int64_t D = C * 16;
  constexpr int CH = C / 2;  // chunks of 32 dims
  static_assert(C % 2 == 0 && CH <= 4, "AMX prompt tiles: D a multiple of 32 up to 128");
  const int64_t S = lens[n - 1];
  const int64_t stride = (S + 15) / 16 * 16, half = stride / 2;  // a row's scores; its probability pairs
  w.scores.resize(G * 16 * stride);
  w.pairs.resize(G * 16 * half);
  w.qa.assign(G * CH * 512, 0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i)
      for (int c = 0; c < CH; ++c)
        std::memcpy(w.qa.data() + ((g * CH + c) * 16 + i) * 32, qb + (i * G + g) * D + 32 * c, 64);
  simd::tiles_see_stores();
  const int64_t chunk_bytes = D * bs * 2;
  {  // scores: tmm0 (and tmm7) a group's sums, tmm1-4 the head's query chunks, tmm5-6 (and tmm3-4) K
    simd::TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    simd::load_tile_config(cfg);
  }
  const int64_t ld = 4 * bs, chunk = 32 * bs;
  auto k_group = [&](int64_t t0) {  // the group's K pairs (dims 0, 1 of its first token)
    return k_cache + (table[t0 / bs] * Hk + h) * D * bs + 2 * (t0 % bs);
  };
  // K in spans of 64 tokens, each span's K read from memory once and from L1 by every head after the first
  constexpr int64_t kSpan = 64;
  for (int64_t s0 = 0; s0 < S; s0 += kSpan) {
    const int64_t s1 = std::min(S, s0 + kSpan);
    for (int64_t t0 = s0; t0 < s1; t0 += 16)
      if (t0 % bs == 0) {
        if (t0 + 2 * kSpan < S && (t0 + 2 * kSpan) % bs == 0)
          prefetch_bytes<_MM_HINT_T1>(
              reinterpret_cast<const char*>(k_cache + (table[(t0 + 2 * kSpan) / bs] * Hk + h) * D * bs), chunk_bytes);
        prefetch_bytes<_MM_HINT_T1>(reinterpret_cast<const char*>(v_cache + (table[t0 / bs] * Hk + h) * D * bs),
                                    chunk_bytes);
      }
    for (int64_t g = 0; g < G; ++g) {
      load_query_chunks<CH>(w.qa.data() + g * CH * 512);
      float* sg = w.scores.data() + g * 16 * stride;
      int64_t t0 = s0;
      if constexpr (CH <= 2) {
        // two groups at a time, sums in tmm0 and tmm7, K in tmm5-6 and tmm3-4
        for (; t0 + 16 < s1; t0 += 32) {
          const uint16_t* ka = k_group(t0);
          const uint16_t* kb = k_group(t0 + 16);
          _tile_zero(0);
          _tile_zero(7);
          _tile_loadd(5, ka, ld);
          _tile_dpbf16ps(0, 1, 5);
          _tile_loadd(3, kb, ld);
          _tile_dpbf16ps(7, 1, 3);
          if constexpr (CH > 1) {
            _tile_loadd(6, ka + chunk, ld);
            _tile_dpbf16ps(0, 2, 6);
            _tile_loadd(4, kb + chunk, ld);
            _tile_dpbf16ps(7, 2, 4);
          }
          _tile_stored(0, sg + t0, stride * 4);
          _tile_stored(7, sg + t0 + 16, stride * 4);
        }
      }
      for (; t0 < s1; t0 += 16) {
        const uint16_t* kb = k_group(t0);
        _tile_zero(0);
        score_chunk<0>(kb, ld);
        if constexpr (CH > 1) score_chunk<1>(kb + chunk, ld);
        if constexpr (CH > 2) score_chunk<2>(kb + 2 * chunk, ld);
        if constexpr (CH > 3) score_chunk<3>(kb + 3 * chunk, ld);
        _tile_stored(0, sg + t0, stride * 4);
      }
    }
  }
  // probabilities: per row, the scores times scale and their maximum in one pass (the products scores_bf16_amx
  // stores, kept apart from the subtraction that follows: GCC would fuse the two into one FMA, other bits),
  // then softmax_exp's exponent pass and bf16_pairs' rounding. (Scaling first and calling softmax_exp, which
  // takes the maximum in a pass of its own: eight 256-token prompts' attention 1.27-1.36 -> 1.51-1.59 ms.)
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < 16; ++i) {
      float* row = w.scores.data() + (g * 16 + i) * stride;
      uint32_t* prow = w.pairs.data() + (g * 16 + i) * half;
      if (i >= n) {
        std::memset(prow, 0, half * 4);
        continue;
      }
      const int64_t L = lens[i];
      __m512 mv = _mm512_set1_ps(-INFINITY);
      int64_t t = 0;
      for (; t + 16 <= L; t += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + t), sv);
        _mm512_storeu_ps(row + t, x);
        mv = _mm512_max_ps(mv, x);
      }
      if (t < L) {
        const __mmask16 m = (__mmask16)((1u << (L - t)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t), sv);
        _mm512_mask_storeu_ps(row + t, m, x);
        mv = _mm512_mask_max_ps(mv, m, mv, x);
      }
      const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
      __m512 sum = _mm512_setzero_ps();
      for (t = 0; t + 16 <= L; t += 16) {
        const __m512 e = simd::exp(_mm512_sub_ps(_mm512_loadu_ps(row + t), mb));
        _mm512_storeu_ps(row + t, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (t < L) {
        const int64_t r = L - t;
        const __m512 e = simd::exp(simd::sub(simd::load_first(row + t, r, 0.f), mb));
        simd::store_first(row + t, e, r);
        sum = simd::add_first(sum, e, r);
      }
      const float factor = 1.f / simd::reduce_add(sum);
      bf16_pairs(row, stride, 1, 1, &L, prow, &factor);
      const int64_t used = (L + 1) / 2;
      std::memset(prow + used, 0, (half - used) * 4);
    }
  simd::tiles_see_stores();
  {  // weighted sums: tmm0-3 the sums of up to 64 dims a pass, tmm4 the probabilities, tmm5-6 V
    simd::TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    cfg.colsb[4] = 32, cfg.rows[4] = 16;
    cfg.colsb[5] = cfg.colsb[6] = 64, cfg.rows[5] = cfg.rows[6] = 8;
    simd::load_tile_config(cfg);
  }
  alignas(64) uint32_t vb[4][8][16];  // a last partial group's V tiles
  const int64_t ldb = G * D * 4;      // res's row stride (tokens) in bytes
  for (int64_t g = 0; g < G; ++g) {
    const uint32_t* pg = w.pairs.data() + g * 16 * half;
    float* rg = res + g * D;
    for (int c0 = 0; c0 < C; c0 += 4) {
      const int nc = (int)std::min<int64_t>(4, C - c0);
      acc_tiles_load(rg, c0, ldb, true, nc);
      for (int64_t t0 = 0; t0 < S; t0 += 16) {
        const uint16_t* pairs = v_cache + (table[t0 / bs] * Hk + h) * bs * D + (t0 % bs) * D + 32 * c0;
        _tile_loadd(4, pg + t0 / 2, half * 4);
        if (t0 + 16 <= S) {
          acc_tiles_step(pairs, 32, 4 * D, nc);
        } else {
          copy_v_group(pairs, D, S - t0, nc, 128, &vb[0][0][0]);
          simd::tiles_see_stores();
          acc_tiles_step(reinterpret_cast<const uint16_t*>(&vb[0][0][0]), 256, 64, nc);
        }
      }
      // rows past n are stored into a scratch copy: res holds n rows
      if (n == 16) {
        acc_tiles_store(rg, c0, ldb, nc);
      } else {
        alignas(64) float tmp[16][64];
        acc_tiles_store(&tmp[0][0], 0, 256, nc);
        for (int64_t i = 0; i < n; ++i) std::memcpy(rg + i * G * D + c0 * 16, tmp[i], nc * 64);
      }
    }
  }
  _tile_release();
}

using PromptFn = void (*)(const uint16_t*, int64_t, const int64_t*, int64_t, float, const uint16_t*, const uint16_t*,
                          const int64_t*, int64_t, int64_t, int64_t, PromptWork&, float*);

static PromptFn prompt_kernel_for(int64_t D, int64_t bs) {
  if (!simd::amx_usable() || bs % 16 != 0) return nullptr;
  switch (D) {
    case 32: return attend_prompt_amx<2>;
    case 64: return attend_prompt_amx<4>;
    case 96: return attend_prompt_amx<6>;
    case 128: return attend_prompt_amx<8>;
    default: return nullptr;
  }
}

#endif

// The two halves of attention for R query rows on one path (the VDPBF16PS path for exact bf16 queries
// over a bf16 cache with an even number of 16-dim chunks, the fp32-accumulating vector path otherwise):
// scores over a range of tokens, and the weighted sum of V over a range, continuing earlier sums. The
// queries are prepared by the caller (attend_tile): bf16 values on the VDPBF16PS path (bf16), fp32 values
// scaled on the other.
using ScoresFn = void (*)(const void* q, float scale, const void* k_cache, const void* v_cache, const int64_t* table,
                          int64_t t_begin, int64_t t_end, int64_t stride, int64_t h, int64_t Hk, int64_t bs,
                          float* scores);
using AccFn = void (*)(const void* probs, int64_t stride, const void* v_cache, const int64_t* table, int64_t t_begin,
                       int64_t t_end, int64_t h, int64_t Hk, int64_t bs, float* acc, bool init);
struct RowKernels {
  ScoresFn scores = nullptr;
  AccFn acc = nullptr;
  bool bf16 = false;
  explicit operator bool() const { return scores != nullptr; }
};

template <int DT, int C, bool QEXACT>
static constexpr bool bf16_path() {
#if defined(__AVX512BF16__)
  return DT == kBF16 && C % 2 == 0 && QEXACT;
#else
  return false;
#endif
}

template <int DT, int R, int C, bool QEXACT>
static void scores_rows(const void* q, float scale, const void* k_cache, const void* v_cache, const int64_t* table,
                        int64_t t_begin, int64_t t_end, int64_t stride, int64_t h, int64_t Hk, int64_t bs,
                        float* scores) {
#if defined(__AVX512BF16__)
  if constexpr (bf16_path<DT, C, QEXACT>()) {
    scores_bf16<R, C>(static_cast<const uint16_t*>(q), scale, static_cast<const uint16_t*>(k_cache),
                      static_cast<const uint16_t*>(v_cache), table, t_begin, t_end, stride, h, Hk, bs, scores);
    return;
  }
#endif
  // as many independent FMA chains as the registers hold: R * TV accumulators + TV K vectors + the
  // broadcast query value (16 registers on AVX2, 32 on AVX-512)
  constexpr int TV = std::max(1, std::min(4, (W == 16 ? 24 : 15) / (R + 1)));
  scores_vec<DT, R, C, TV>(static_cast<const float*>(q), k_cache, v_cache, table, t_begin, t_end, stride, h, Hk, bs,
                           scores);
}

template <int DT, int R, int C, bool QEXACT>
static void acc_rows(const void* probs, int64_t stride, const void* v_cache, const int64_t* table, int64_t t_begin,
                     int64_t t_end, int64_t h, int64_t Hk, int64_t bs, float* acc, bool init) {
#if defined(__AVX512BF16__)
  if constexpr (bf16_path<DT, C, QEXACT>()) {
    accumulate_bf16<R, C>(static_cast<const uint32_t*>(probs), stride, static_cast<const uint16_t*>(v_cache), table,
                          t_begin, t_end, h, Hk, bs, acc, init);
    return;
  }
#endif
  accumulate_vec<DT, R, C>(static_cast<const float*>(probs), stride, v_cache, table, t_begin, t_end, h, Hk, bs, acc,
                           init);
}

template <int DT, bool QEXACT, int R, int C>
static RowKernels row_kernels() {
  return {scores_rows<DT, R, C, QEXACT>, acc_rows<DT, R, C, QEXACT>, bf16_path<DT, C, QEXACT>()};
}

template <int DT, bool QEXACT, int R>
static RowKernels row_kernels_for_chunks(int64_t C) {
  switch (C) {
    case 1: return row_kernels<DT, QEXACT, R, 1>();
    case 2: return row_kernels<DT, QEXACT, R, 2>();
    case 4: return row_kernels<DT, QEXACT, R, 4>();
    case 8: return row_kernels<DT, QEXACT, R, 8>();
    case 16: return row_kernels<DT, QEXACT, R, 16>();
    default: return {};
  }
}

// The vector kernels for R query rows and head_dim D, or none (generic path).
template <int DT, bool QEXACT>
static RowKernels row_kernels_for(int64_t R, int64_t D) {
  if (D % W != 0) return {};
  const int64_t C = D / W;
  switch (R) {
    case 1: return row_kernels_for_chunks<DT, QEXACT, 1>(C);
    case 2: return row_kernels_for_chunks<DT, QEXACT, 2>(C);
    case 3: return row_kernels_for_chunks<DT, QEXACT, 3>(C);
    case 4: return row_kernels_for_chunks<DT, QEXACT, 4>(C);
    case 5: return row_kernels_for_chunks<DT, QEXACT, 5>(C);
    case 6: return row_kernels_for_chunks<DT, QEXACT, 6>(C);
    case 7: return row_kernels_for_chunks<DT, QEXACT, 7>(C);
    case 8: return row_kernels_for_chunks<DT, QEXACT, 8>(C);
    case 10: return row_kernels_for_chunks<DT, QEXACT, 10>(C);
    case 12: return row_kernels_for_chunks<DT, QEXACT, 12>(C);
    default: return {};
  }
}

// Query tokens per tile for G query heads per KV head: as many as keep R = QT * G rows within the
// instantiated sizes (at most 12: the accumulators stay in registers).
static int64_t query_tile(int64_t G) {
  for (int64_t qt = 8; qt > 1; --qt)
    if (qt * G <= 12 && (qt * G <= 8 || qt * G == 10 || qt * G == 12)) return qt;
  return 1;
}

// One item on the vector path: m query tokens (G query heads each, R = m G rows, token-major) against one
// KV head. Token i reads the cache through tables[i] and sees its first lens[i] tokens. The first S tokens
// are the same blocks for every token: they are attended as one tile (each K/V row read serves all R rows),
// then each token with lens[i] > S continues alone over its own tokens [S, lens[i]): its scores, and its
// sums of V carried on from the tile's. Tokens of a prompt chunk have S = the longest length, and the
// probabilities past a token's length are zero; decodes of requests that share prefix blocks have S = the
// shared part. Every row is computed exactly as when its token is attended alone (the same chains of
// products in the same order). qf holds the rows unscaled, in fp32 (it is overwritten); out gets fp32 rows.
// Where a tile's shared part [0, S) is read: the cache itself (src null), or a copy of those blocks of this
// head widened to fp32, one block after the other (decode's tiled_wide: table 0, 1, ..., head 0 of 1).
struct TileSource {
  const void* k;
  const void* v;
  const int64_t* table;
  int64_t h, Hk;
};

template <bool BF16>
static void attend_tile(const RowKernels& tile, const RowKernels& one, float* qf, int64_t m, int64_t G, int64_t D,
                        float scale, const void* k_cache, const void* v_cache, const int64_t* const* tables,
                        const int64_t* lens, int64_t S, int64_t h, int64_t Hk, int64_t bs, simd::avector<float>& work,
                        float* out, const TileSource* src = nullptr) {
  const TileSource shared = src ? *src : TileSource{k_cache, v_cache, tables[0], h, Hk};
  const int64_t R = m * G;
  int64_t stride = S, ends[8];
  for (int64_t i = 0; i < m; ++i) {
    stride = std::max(stride, lens[i]);
    ends[i] = std::max(lens[i], S);
  }
  const int64_t half = (stride + 1) / 2;
  work.resize(R * stride + R * half + (R * D + 1) / 2);  // scores, bf16 probability pairs, bf16 queries
  float* scores = work.data();
  uint32_t* pairs = reinterpret_cast<uint32_t*>(scores + R * stride);
  void* q;
  int64_t q_row_bytes;
  if constexpr (BF16) {
    uint16_t* qb = reinterpret_cast<uint16_t*>(pairs + R * half);
    int64_t i = 0;  // exact: qf came from bf16
#if defined(TIDAL_VEC)
    for (; i + W <= R * D; i += W) simd::store_bf16(qb + i, simd::load(qf + i));
#endif
    for (; i < R * D; ++i) qb[i] = float_to_bf16(qf[i]);
    q = qb;
    q_row_bytes = D * 2;
  } else {
    for (int64_t i = 0; i < R * D; ++i) qf[i] *= scale;
    q = qf;
    q_row_bytes = D * 4;
  }
  if (S > 0) tile.scores(q, scale, shared.k, shared.v, shared.table, 0, S, stride, shared.h, shared.Hk, bs, scores);
  for (int64_t i = 0; i < m; ++i)
    if (lens[i] > S)
      one.scores(static_cast<char*>(q) + i * G * q_row_bytes, scale, k_cache, v_cache, tables[i], S, lens[i], stride,
                 h, Hk, bs, scores + i * G * stride);
  // bf16 probabilities: softmax_vec's last pass (the factor 1 / sum) is applied as they are rounded to pairs
  constexpr int64_t kMaxFactors = 256;
  float factors[kMaxFactors];
  const bool fold = BF16 && R <= kMaxFactors;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lens[r / G];
    if (fold) factors[r] = softmax_exp(scores + r * stride, n);
    else softmax_vec(scores + r * stride, n);
    std::fill(scores + r * stride + n, scores + r * stride + ends[r / G], 0.f);
  }
  const void* probs = scores;
  int64_t pstride = stride;
#if defined(__AVX512BF16__)
  if constexpr (BF16) {
    bf16_pairs(scores, stride, R, G, ends, pairs, fold ? factors : nullptr);
    probs = pairs;
    pstride = half;
  }
#endif
  tile.acc(probs, pstride, shared.v, shared.table, 0, S, shared.h, shared.Hk, bs, out, true);
  for (int64_t i = 0; i < m; ++i)
    if (lens[i] > S) {
      const void* pi = BF16 ? static_cast<const void*>(static_cast<const uint32_t*>(probs) + i * G * pstride)
                            : static_cast<const void*>(static_cast<const float*>(probs) + i * G * pstride);
      one.acc(pi, pstride, v_cache, tables[i], S, lens[i], h, Hk, bs, out + i * G * D, false);
    }
}
#endif

#if TIDAL_VEC == 8
// A tile's shared part on AVX2 with its blocks widened to fp32 (decode's tiled_wide), with the vector lanes
// over the tile's query rows instead of over tokens: each K (or V) value is broadcast once for all rows and
// each row vector is loaded once per value of the head dim, 7 loads per 12 FMAs (3 row vectors x 4 tokens or
// 4 dims) where the token-lane kernels need one broadcast per FMA (12 rows x 1 token vector). Every score and
// every sum is the same chain as theirs (fmadd(q, k, s) over d in order from zero; fmadd(p, v, s) over the
// tokens in order from zero), and the softmax is softmax_vec's per row: the same bits. The rows go in and
// out through 8 x 8 transposes. Measured on a Zen 3 (fp32 queries over a bf16 cache, 3 query heads per KV
// head, head_dim 64): eight 256-token prompts through one layer 8.2 -> 6.8 ms (tiles of 8 tokens, 24 rows,
// against 4 tokens, 12 rows on the token lanes); a 2,048-token prompt step of SmolLM2-135M 2.553 -> 2.510 s.
namespace lanes {
// v[i] = row i of an 8 x 8 block, in place: v[i] = column i
inline void transpose8(__m256 v[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  v[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  v[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  v[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  v[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  v[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  v[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  v[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// rows [R, n] (stride ld) -> cols [n8, 8 * RV] (cols[c * 8RV + r] = rows[r * ld + c]; rows past R and
// columns past n zero), n8 = n rounded up to 8
template <int RV>
static void to_lanes(const float* rows, int64_t ld, int64_t R, int64_t n, float* cols) {
  constexpr int64_t RW = 8 * RV;
  alignas(32) float tail[8];
  for (int64_t c0 = 0; c0 < n; c0 += 8) {
    const int64_t nc = std::min<int64_t>(8, n - c0);
    for (int rv = 0; rv < RV; ++rv) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t r = rv * 8 + i;
        if (r >= R) { v[i] = _mm256_setzero_ps(); continue; }
        if (nc == 8) { v[i] = _mm256_loadu_ps(rows + r * ld + c0); continue; }
        for (int c = 0; c < 8; ++c) tail[c] = c < nc ? rows[r * ld + c0 + c] : 0.f;
        v[i] = _mm256_load_ps(tail);
      }
      transpose8(v);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(cols + (c0 + c) * RW + rv * 8, v[c]);
    }
  }
}

// cols [n, 8 * RV] -> rows [R, n] (stride ld), n a multiple of 8 or the columns past it not stored
template <int RV>
static void from_lanes(const float* cols, int64_t n, int64_t R, float* rows, int64_t ld) {
  constexpr int64_t RW = 8 * RV;
  for (int64_t c0 = 0; c0 < n; c0 += 8) {
    const int64_t nc = std::min<int64_t>(8, n - c0);
    for (int rv = 0; rv < RV && rv * 8 < R; ++rv) {
      __m256 v[8];
      for (int c = 0; c < 8; ++c) v[c] = c < nc ? _mm256_loadu_ps(cols + (c0 + c) * RW + rv * 8) : _mm256_setzero_ps();
      transpose8(v);
      for (int i = 0; i < 8 && rv * 8 + i < R; ++i) {
        float* dst = rows + (rv * 8 + i) * ld + c0;
        if (nc == 8) {
          _mm256_storeu_ps(dst, v[i]);
        } else {
          alignas(32) float t[8];
          _mm256_store_ps(t, v[i]);
          std::copy(t, t + nc, dst);
        }
      }
    }
  }
}

// scores (lanes: [S8, 8 RV], token-major) of the rows in qt ([D, 8 RV]) over tokens [0, S) of the widened K
// ([blocks][D][bs], bs a multiple of 8); the tokens past S up to a multiple of 8 are computed from the
// widened block's other tokens and never read
template <int RV>
static void scores(const float* qt, const float* kw, int64_t D, int64_t bs, int64_t S, float* st) {
  constexpr int64_t RW = 8 * RV;
  constexpr int TV = RV == 1 ? 8 : 4;  // 4 x RV accumulators + RV row vectors + the broadcast: 16 at RV = 3
  for (int64_t t0 = 0; t0 < S; t0 += TV) {
    const float* kb = kw + (t0 / bs) * D * bs + t0 % bs;
    __m256 acc[RV][TV];
    for (int rv = 0; rv < RV; ++rv)
      for (int v = 0; v < TV; ++v) acc[rv][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      __m256 q[RV];
      for (int rv = 0; rv < RV; ++rv) q[rv] = _mm256_loadu_ps(qt + d * RW + rv * 8);
      for (int v = 0; v < TV; ++v) {
        const __m256 k = _mm256_broadcast_ss(kb + d * bs + v);
        for (int rv = 0; rv < RV; ++rv) acc[rv][v] = _mm256_fmadd_ps(q[rv], k, acc[rv][v]);
      }
    }
    for (int v = 0; v < TV; ++v)
      for (int rv = 0; rv < RV; ++rv) _mm256_storeu_ps(st + (t0 + v) * RW + rv * 8, acc[rv][v]);
  }
}

// sums (lanes: [D, 8 RV]) of the probabilities pt ([S, 8 RV], token-major) times the widened V rows
// ([S][D] and on), from zero, tokens in order
template <int RV>
static void accumulate(const float* pt, const float* vw, int64_t D, int64_t S, float* ot) {
  constexpr int64_t RW = 8 * RV;
  constexpr int DV = RV == 1 ? 8 : 4;
  constexpr int64_t TB = 64;  // tokens per pass over the head dim: their probabilities and V rows stay in L1
  for (int64_t t0 = 0; t0 < S; t0 += TB) {
    const int64_t t1 = std::min(S, t0 + TB);
    for (int64_t d0 = 0; d0 < D; d0 += DV) {
      __m256 acc[RV][DV];
      for (int rv = 0; rv < RV; ++rv)
        for (int v = 0; v < DV; ++v)
          acc[rv][v] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(ot + (d0 + v) * RW + rv * 8);
      for (int64_t t = t0; t < t1; ++t) {
        __m256 p[RV];
        for (int rv = 0; rv < RV; ++rv) p[rv] = _mm256_loadu_ps(pt + t * RW + rv * 8);
        for (int v = 0; v < DV; ++v) {
          const __m256 x = _mm256_broadcast_ss(vw + t * D + d0 + v);
          for (int rv = 0; rv < RV; ++rv) acc[rv][v] = _mm256_fmadd_ps(p[rv], x, acc[rv][v]);
        }
      }
      for (int v = 0; v < DV; ++v)
        for (int rv = 0; rv < RV; ++rv) _mm256_storeu_ps(ot + (d0 + v) * RW + rv * 8, acc[rv][v]);
    }
  }
}

// softmax_vec on each row of scores in lanes ([S8, 8 RV], in place; row r over its first len[r] tokens,
// the rest of [0, S) zeroed): the same operations in the same order per row, vectorised over the rows. A row's
// tokens take simd::exp and are summed in 8 partial sums by token mod 8 (softmax_vec's vector of sums),
// reduced as simd::reduce_add pairs them.
template <int RV>
static void softmax(float* st, int64_t S, const int64_t* len) {
  constexpr int64_t RW = 8 * RV;
  for (int rv = 0; rv < RV; ++rv) {
    const int64_t* lr = len + rv * 8;
    alignas(32) float lf[8];
    for (int i = 0; i < 8; ++i) lf[i] = static_cast<float>(lr[i]);
    const __m256 lv = _mm256_load_ps(lf);
    float* col = st + rv * 8;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < S; ++t) {
      const __m256 in = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(t)), lv, _CMP_LT_OQ);
      mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(col + t * RW), in));
    }
    __m256 ps[8];
    for (int j = 0; j < 8; ++j) ps[j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < S; ++t) {
      const __m256 e = simd::exp(_mm256_sub_ps(_mm256_loadu_ps(col + t * RW), mv));
      _mm256_storeu_ps(col + t * RW, e);
      const __m256 in = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(t)), lv, _CMP_LT_OQ);
      ps[t % 8] = _mm256_add_ps(ps[t % 8], _mm256_and_ps(in, e));
    }
    const __m256 sv = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(ps[0], ps[4]), _mm256_add_ps(ps[2], ps[6])),
                                    _mm256_add_ps(_mm256_add_ps(ps[1], ps[5]), _mm256_add_ps(ps[3], ps[7])));
    const __m256 iv = _mm256_div_ps(_mm256_set1_ps(1.f), sv);
    for (int64_t t = 0; t < S; ++t) {
      const __m256 in = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(t)), lv, _CMP_LT_OQ);
      _mm256_storeu_ps(col + t * RW, _mm256_and_ps(in, _mm256_mul_ps(_mm256_loadu_ps(col + t * RW), iv)));
    }
  }
}
}  // namespace lanes

// attend_tile<false> over widened blocks (kw, vw: decode's tiled_wide copies), with the shared part's
// scores and sums on the lane kernels above; R = m G <= 8 RV rows
template <int RV>
static void attend_tile_lanes(const RowKernels& one, float* qf, int64_t m, int64_t G, int64_t D, float scale,
                              const void* k_cache, const void* v_cache, const int64_t* const* tables,
                              const int64_t* lens, int64_t S, int64_t h, int64_t Hk, int64_t bs,
                              simd::avector<float>& work, float* out, const float* kw, const float* vw) {
  constexpr int64_t RW = 8 * RV;
  const int64_t R = m * G;
  int64_t stride = S, ends[8];
  for (int64_t i = 0; i < m; ++i) {
    stride = std::max(stride, lens[i]);
    ends[i] = std::max(lens[i], S);
  }
  const int64_t S8 = (S + 7) / 8 * 8;
  work.resize(R * stride + S8 * RW + 2 * D * RW);
  float* scores = work.data();
  float* lanes_t = scores + R * stride;  // the scores, then the probabilities, token-major
  float* qt = lanes_t + S8 * RW;
  float* ot = qt + D * RW;
  for (int64_t i = 0; i < R * D; ++i) qf[i] *= scale;
  lanes::to_lanes<RV>(qf, D, R, D, qt);
  lanes::scores<RV>(qt, kw, D, bs, S, lanes_t);
  bool within = true;  // every query within the shared part (a prompt chunk's): the rows stay in lanes
  for (int64_t i = 0; i < m; ++i) within = within && lens[i] <= S;
  if (within) {  // softmax in lanes, no transposes of the scores
    int64_t len[RW];
    for (int64_t r = 0; r < RW; ++r) len[r] = r < R ? lens[r / G] : S;
    lanes::softmax<RV>(lanes_t, S, len);
    lanes::accumulate<RV>(lanes_t, vw, D, S, ot);
    lanes::from_lanes<RV>(ot, D, R, out, D);
    return;
  }
  lanes::from_lanes<RV>(lanes_t, S, R, scores, stride);
  for (int64_t i = 0; i < m; ++i)
    if (lens[i] > S)
      one.scores(qf + i * G * D, scale, k_cache, v_cache, tables[i], S, lens[i], stride, h, Hk, bs,
                 scores + i * G * stride);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lens[r / G];
    softmax_vec(scores + r * stride, n);
    std::fill(scores + r * stride + n, scores + r * stride + ends[r / G], 0.f);
  }
  lanes::to_lanes<RV>(scores, stride, R, S, lanes_t);
  lanes::accumulate<RV>(lanes_t, vw, D, S, ot);
  lanes::from_lanes<RV>(ot, D, R, out, D);
  for (int64_t i = 0; i < m; ++i)
    if (lens[i] > S)
      one.acc(scores + i * G * stride, stride, v_cache, tables[i], S, lens[i], h, Hk, bs, out + i * G * D, false);
}

// query tokens per tile on the lane kernels: up to 24 rows (3 vectors), at most 8 tokens
static int64_t lanes_query_tile(int64_t G) { return std::min<int64_t>(8, 24 / G); }
#endif

// Decodes of different requests that share at least this many leading blocks are attended as one tile
// over the shared blocks (neighbours once sorted by their first block, in step order among equals).
static constexpr int64_t kMinSharedBlocks = 4;

// QDT: queries and output; KDT: the cache (fp32 queries over a bf16 cache when activations are fp32, or an
// E4M3 cache under any activations: it is read as 2^-8 x its values, so 2^8 x k_scale goes into the query
// scale and 2^8 x v_scale into the output).
// Queries are attended in tiles, so that each K/V row read serves the whole tile:
// - consecutive queries over the same block table whose lengths grow by one (the tokens of a prompt
//   chunk; measured on a 64-token chunk over 1,100 cached tokens: 1.6x with AVX-512 BF16, 1.2x with AVX2);
// - other queries (decodes) whose tables share their first blocks (a common prompt prefix in the prefix
//   cache), over the shared blocks (cascade attention), each continuing alone over its own blocks.
template <int QDT, int KDT>
static void decode(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                   const int64_t* block_tables, const int64_t* table_index, const int64_t* seq_lens, void* out, int64_t B,
                   int64_t Hq, int64_t Hk, int64_t D, int64_t bs, int64_t max_blocks, float scale, float k_scale,
                   float v_scale, int num_threads) {
  const int64_t G = Hq / Hk;
  const float out_scale = KDT == kFP8 ? 256.f * v_scale : 1.f;
  if (KDT == kFP8) scale *= 256.f * k_scale;
  auto table_of = [&](int64_t b) { return block_tables + (table_index ? table_index[b] : b) * max_blocks; };
  int64_t QT = 1;
#if defined(TIDAL_VEC)
  const RowKernels one = bs % W == 0 ? row_kernels_for<KDT, QDT == KDT>(G, D) : RowKernels{};
  RowKernels tiled, tiled_wide;
  [[maybe_unused]] int lanes_rv = 0;  // > 0: widened tiles run attend_tile_lanes<lanes_rv> (AVX2)
  if (one && table_index) {
    QT = query_tile(G);
    tiled = QT > 1 ? row_kernels_for<KDT, QDT == KDT>(QT * G, D) : RowKernels{};
    if (!tiled) QT = 1;
    // a bf16 or E4M3 cache read by the fp32 kernels (not VDPBF16PS: fp32 queries, or any build without AVX-512
    // BF16): a tile's shared blocks are widened to fp32 once per thread and head, and the tile runs the
    // fp32-cache kernels over them (the same products in the same order: the same bits), instead of
    // widening every K and V vector it loads
    if (QT > 1 && KDT != kF32 && !tiled.bf16) tiled_wide = row_kernels_for<kF32, true>(QT * G, D);
#if TIDAL_VEC == 8
    // widened tiles of 16-24 rows on the lane kernels (attend_tile_lanes; with one query head per KV head a
    // tile's 8 rows are one vector either way, and the token-lane kernels stay)
    if (tiled_wide && G >= 2 && G <= 12) {
      QT = lanes_query_tile(G);
      lanes_rv = (QT * G + 7) / 8;
    }
#endif
  }
#endif
  // tiles: queries order[first, first + count) sharing their first `shared` tokens' blocks (0: one query)
  // a prompt chunk's tiles of up to 16 tokens on AMX (attend_prompt_amx), where the queries are exact bf16
  int64_t chunk_tile = QT;
#if defined(__AVX512BF16__) && defined(TIDAL_VEC)
  const PromptFn prompt = QDT == kBF16 && KDT == kBF16 && QT > 1 && one.bf16 ? prompt_kernel_for(D, bs) : nullptr;
  if (prompt) chunk_tile = 16;
#endif
  struct Tile { int64_t first, count, shared; bool chunk; };
  std::vector<Tile> tiles;
  std::vector<int64_t> order, singles;
  order.reserve(B);
  for (int64_t b = 0; b < B;) {
    int64_t n = 1;
    while (n < chunk_tile && b + n < B && table_index[b + n] == table_index[b] &&
           seq_lens[b + n] == seq_lens[b + n - 1] + 1)
      ++n;
    if (n > 1) {
      tiles.push_back({static_cast<int64_t>(order.size()), n, seq_lens[b + n - 1], true});
      for (int64_t i = 0; i < n; ++i) order.push_back(b + i);
    } else {
      singles.push_back(b);
    }
    b += n;
  }
  // leading blocks two queries' tables have in common, among those both have complete
  auto common_blocks = [&](int64_t a, int64_t b) {
    const int64_t n = std::min(seq_lens[a], seq_lens[b]) / bs;
    const int64_t *ta = table_of(a), *tb = table_of(b);
    int64_t i = 0;
    while (i < n && ta[i] == tb[i]) ++i;
    return i;
  };
  if (QT > 1 && singles.size() > 1) {  // queries whose first blocks are the same become neighbours
    auto first_block = [&](int64_t b) { return seq_lens[b] >= bs ? table_of(b)[0] : -1; };
    std::stable_sort(singles.begin(), singles.end(),
                     [&](int64_t a, int64_t b) { return first_block(a) < first_block(b); });
  }
  for (size_t s = 0; s < singles.size();) {
    size_t n = 1;
    int64_t shared = QT > 1 ? seq_lens[singles[s]] / bs : 0;
    while (n < static_cast<size_t>(QT) && s + n < singles.size()) {
      const int64_t c = std::min(shared, common_blocks(singles[s], singles[s + n]));
      // (a query sharing less than half of what the tile shares so far starts a tile of its own)
      if (c < kMinSharedBlocks || (n > 1 && 2 * c < shared)) break;
      shared = c;
      ++n;
    }
    const int64_t first = static_cast<int64_t>(order.size());
    for (size_t i = 0; i < n; ++i) order.push_back(singles[s + i]);
    tiles.push_back({first, static_cast<int64_t>(n), n > 1 ? shared * bs : 0, false});
    s += n;
  }
#if defined(TIDAL_VEC)
  // every query alone (decodes sharing no blocks): one item per request, over all its heads (decode_heads)
  const HeadsFn heads = one && !one.bf16 ? heads_kernel_for<KDT>(G, D, bs) : nullptr;
  if (heads && static_cast<int64_t>(tiles.size()) == B) {
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> qf(Hq * D), res(Hq * D);
      simd::avector<float> work;
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < B; ++b) {
        widen<QDT>(q, b * q_stride, Hq * D, qf.data());
        for (int64_t i = 0; i < Hq * D; ++i) qf[i] *= scale;
        heads(qf.data(), k_cache, v_cache, table_of(b), seq_lens[b], Hk, bs, work, res.data());
        narrow<QDT>(res.data(), out_scale, Hq * D, out, b * Hq * D);
      }
    }
    return;
  }
#endif
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  // the work items (tile, head): tile by tile, its heads together (their K/V sit side by side in each block);
  // when tiles widen their shared blocks, the tiles of several queries come first, head by head, so that the
  // next tile a thread takes is often of the same head and over the same blocks, which it keeps widened
  std::vector<int64_t> items;
#if defined(TIDAL_VEC)
  if (tiled_wide) {
    items.reserve(2 * num_tiles * Hk);
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t t = 0; t < num_tiles; ++t)
        if (tiles[t].count > 1) items.insert(items.end(), {t, h});
    for (int64_t t = 0; t < num_tiles; ++t)
      if (tiles[t].count == 1)
        for (int64_t h = 0; h < Hk; ++h) items.insert(items.end(), {t, h});
  }
#endif
  // with tiles enough to share out, a tile's heads go to one thread together (a request's blocks read by
  // one thread, not its heads by both at once: a 64-row decode step 47 -> 45 ms on the AMX Xeon); with few,
  // head by head (one request alone would leave the other threads idle)
  const int64_t per_take = items.empty() && num_tiles >= 4 * num_threads ? Hk : 1;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qf(QT * G * D), res(QT * G * D);
    simd::avector<float> work;
    int64_t lens[16];
    const int64_t* tabs[16];
#if defined(__AVX512BF16__) && defined(TIDAL_VEC)
    std::unique_ptr<PromptWork> pw;
    std::vector<uint16_t> qp;
#endif
#if defined(TIDAL_VEC)
    // the widened blocks (tiled_wide): K and V of head wide_h for the cache blocks wide_ids, in that order
    std::vector<float> wide_k, wide_v;
    std::vector<int64_t> wide_ids, wide_table;
    int64_t wide_h = -1;
#endif
#pragma omp for schedule(dynamic, per_take)
    for (int64_t item = 0; item < num_tiles * Hk; ++item) {
      const Tile& tile = tiles[items.empty() ? item / Hk : items[2 * item]];
      const int64_t h = items.empty() ? item % Hk : items[2 * item + 1], n = tile.count;
#if defined(__AVX512BF16__) && defined(TIDAL_VEC)
      if (prompt && tile.chunk) {
        if (!pw) pw = std::make_unique<PromptWork>();
        qp.resize(n * G * D);
        if (static_cast<int64_t>(res.size()) < n * G * D) res.resize(n * G * D);
        const int64_t* tab = table_of(order[tile.first]);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t b = order[tile.first + i];
          lens[i] = seq_lens[b];
          std::memcpy(qp.data() + i * G * D, static_cast<const uint16_t*>(q) + b * q_stride + h * G * D, G * D * 2);
        }
        prompt(qp.data(), n, lens, G, scale, static_cast<const uint16_t*>(k_cache),
               static_cast<const uint16_t*>(v_cache), tab, h, Hk, bs, *pw, res.data());
        for (int64_t i = 0; i < n; ++i)
          narrow<QDT>(res.data() + i * G * D, out_scale, G * D, out, (order[tile.first + i] * Hq + h * G) * D);
        continue;
      }
#endif
      const int64_t m = n > 1 ? QT : 1;  // a partial tile repeats its last query (results unused)
      for (int64_t i = 0; i < m; ++i) {
        const int64_t b = order[tile.first + std::min(i, n - 1)];
        lens[i] = i < n ? seq_lens[b] : std::min(seq_lens[b], std::max<int64_t>(tile.shared, 1));
        tabs[i] = table_of(b);
        widen<QDT>(q, b * q_stride + h * G * D, G * D, qf.data() + i * G * D);  // its G query heads
      }
#if defined(TIDAL_VEC)
      if (one) {
        const int64_t S = n > 1 ? tile.shared : lens[0];
        if (KDT != kF32 && n > 1 && tiled_wide) {
          const int64_t blocks = (S + bs - 1) / bs, chunk = D * bs;
          if (wide_h != h) wide_ids.clear();
          wide_h = h;
          if (static_cast<int64_t>(wide_table.size()) < blocks) {
            wide_k.resize(blocks * chunk);
            wide_v.resize(blocks * chunk);
            for (int64_t j = static_cast<int64_t>(wide_table.size()); j < blocks; ++j) wide_table.push_back(j);
          }
          for (int64_t j = 0; j < blocks; ++j) {  // blocks already widened (the same ids, in order) are kept
            const int64_t id = tabs[0][j];
            if (j < static_cast<int64_t>(wide_ids.size()) && wide_ids[j] == id) continue;
            widen_k_block<KDT>(k_cache, (id * Hk + h) * chunk, D, bs, wide_k.data() + j * chunk);
            widen_v_block<KDT>(v_cache, (id * Hk + h) * chunk, D, bs, wide_v.data() + j * chunk);
            if (j < static_cast<int64_t>(wide_ids.size())) wide_ids[j] = id;
            else wide_ids.push_back(id);
          }
#if TIDAL_VEC == 8
          if (lanes_rv > 0) {
            auto lanes_fn = lanes_rv == 1 ? attend_tile_lanes<1> : lanes_rv == 2 ? attend_tile_lanes<2>
                                                                                 : attend_tile_lanes<3>;
            lanes_fn(one, qf.data(), m, G, D, scale, k_cache, v_cache, tabs, lens, S, h, Hk, bs, work, res.data(),
                     wide_k.data(), wide_v.data());
          } else
#endif
          {
            const TileSource wide{wide_k.data(), wide_v.data(), wide_table.data(), 0, 1};
            attend_tile<false>(tiled_wide, one, qf.data(), m, G, D, scale, k_cache, v_cache, tabs, lens, S, h, Hk,
                               bs, work, res.data(), &wide);
          }
        } else {
          (one.bf16 ? attend_tile<true> : attend_tile<false>)(n > 1 ? tiled : one, one, qf.data(), m, G, D, scale,
                                                          k_cache, v_cache, tabs, lens, S, h, Hk, bs, work,
                                                          res.data(), nullptr);
        }
      } else
#endif
      {
        const int64_t L = lens[0];
        work.resize(G * L);
        for (int64_t i = 0; i < G * D; ++i) qf[i] *= scale;
        scores_generic<KDT>(qf.data(), k_cache, tabs[0], L, h, G, Hk, D, bs, work.data());
        for (int64_t g = 0; g < G; ++g) softmax_generic(work.data() + g * L, L);
        accumulate_generic<KDT>(work.data(), v_cache, tabs[0], L, h, G, Hk, D, bs, res.data());
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = order[tile.first + i];
        narrow<QDT>(res.data() + i * G * D, out_scale, G * D, out, (b * Hq + h * G) * D);
      }
    }
  }
}

// Rotary embedding, GPT-NeoX layout (the two halves of each head rotate together), matching the
// reference computation: c, s = cos, sin rounded to the dtype; a = round(x * c);
// out = round(a + swap_halves(x) * s), where s carries the sign of each half (-sin, sin).
// x rows have stride x_stride (elements): heads [H, D] are contiguous inside a row; out is [T, H, D].
template <int DT>
static void rope_neox(const void* x, int64_t x_stride, const float* cos_full, const float* sin_signed,
                      const int64_t* positions, void* out, int64_t T, int64_t H, int64_t D, int num_threads) {
  const int64_t half = D / 2;
// (threads from ~22 rows of the default model's 12 heads: a 64-row decode step's 30 layers of rotary took
// 0.63 ms on one thread, 0.37 ms on two, on the AMX Xeon)
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H * D > 16384)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos_full + positions[t] * D;
    const float* s = sin_signed + positions[t] * D;
#if defined(TIDAL_VEC)
    // the token's cos and sin (rounded to the dtype) once for all its heads, where a head's half is at most
    // kRopeVecs vectors
    constexpr int64_t kRopeVecs = 8;
    const bool vec = (DT == kF32 || DT == kBF16) && half % W == 0 && half / W <= kRopeVecs;
    vf cv_lo[kRopeVecs], cv_hi[kRopeVecs], sv_lo[kRopeVecs], sv_hi[kRopeVecs];
    if (vec)
      for (int64_t j = 0; j < half / W; ++j) {
        cv_lo[j] = simd::load(c + j * W), cv_hi[j] = simd::load(c + half + j * W);
        sv_lo[j] = simd::load(s + j * W), sv_hi[j] = simd::load(s + half + j * W);
        if constexpr (DT == kBF16) {
          cv_lo[j] = simd::round_bf16(cv_lo[j]);
          cv_hi[j] = simd::round_bf16(cv_hi[j]);
          sv_lo[j] = simd::round_bf16(sv_lo[j]);
          sv_hi[j] = simd::round_bf16(sv_hi[j]);
        }
      }
#endif
    for (int64_t h = 0; h < H; ++h) {
      const int64_t src = t * x_stride + h * D, dst = (t * H + h) * D;
#if defined(TIDAL_VEC)
      if (vec) {  // the same operations, W lanes at a time
        for (int64_t d = 0; d < half; d += W) {
          const vf x_lo = loadv<DT>(x, src + d), x_hi = loadv<DT>(x, src + half + d);
          const vf c_lo = cv_lo[d / W], c_hi = cv_hi[d / W], s_lo = sv_lo[d / W], s_hi = sv_hi[d / W];
          vf a_lo = simd::mul(x_lo, c_lo), a_hi = simd::mul(x_hi, c_hi);
          if constexpr (DT == kBF16) {
            a_lo = simd::round_bf16(a_lo);
            a_hi = simd::round_bf16(a_hi);
          }
          const vf o_lo = simd::fmadd(x_hi, s_lo, a_lo), o_hi = simd::fmadd(x_lo, s_hi, a_hi);
          if constexpr (DT == kBF16) {
            simd::store_bf16(static_cast<uint16_t*>(out) + dst + d, o_lo);
            simd::store_bf16(static_cast<uint16_t*>(out) + dst + half + d, o_hi);
          } else {
            simd::store(static_cast<float*>(out) + dst + d, o_lo);
            simd::store(static_cast<float*>(out) + dst + half + d, o_hi);
          }
        }
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) {
        const int64_t sw = d < half ? d + half : d - half;
        float cd = c[d], sd = s[d], xd = load1<DT>(x, src + d), xs = load1<DT>(x, src + sw);
        if (DT != kF32) { cd = round_to<DT>(cd); sd = round_to<DT>(sd); }
        float a = xd * cd;
        if (DT != kF32) a = round_to<DT>(a);
        const float b = xs * sd;
        store1<DT>(out, dst + d, a + b);
      }
    }
  }
}

// Writes this step's K/V rows into the paged cache: k, v [T, Hk, D] with row strides k_stride,
// v_stride (elements); token t goes to slot slots[t] = block * bs + offset of
// k_cache [num_blocks, Hk, D, bs] (K blocks transposed; pairs of dims [num_blocks, Hk, D / 2, bs, 2] where
// k_pairs: a bf16 cache) and v_cache [num_blocks, Hk, bs, D] (pairs of tokens [num_blocks, Hk, bs / 2, D, 2]
// where v_pairs).
template <typename S, typename E>
static inline E convert(S x) {
  if constexpr (std::is_same<S, E>::value) return x;
  else return float_to_bf16(x);  // fp32 rows into a bf16 cache
}

// An E4M3 cache: each value divided by its layer's scale in fp32, then converted as torch's
// x.float().div(scale).clamp(-448, 448).to(torch.float8_e4m3fn) does (simd.h, namespace e4m3), bit for bit;
// with a shift (K rows: the layer's mean key, see tidal/layers/attention/kv_cache_dtype.py), (x - shift) in
// fp32 first.
template <int DT>
static void to_e4m3(const void* src, int64_t start, int64_t n, float scale, uint8_t* dst,
                    const float* shift = nullptr) {
  int64_t i = 0;
#if defined(TIDAL_VEC)
  const vf s = simd::set1(scale);
  if (shift)
    for (; i + W <= n; i += W)
      simd::store_e4m3(dst + i, simd::div(simd::sub(loadv<DT>(src, start + i), simd::load(shift + i)), s));
  else
    for (; i + W <= n; i += W) simd::store_e4m3(dst + i, simd::div(loadv<DT>(src, start + i), s));
#endif
  for (; i < n; ++i)
    dst[i] = simd::e4m3::from_float((shift ? load1<DT>(src, start + i) - shift[i] : load1<DT>(src, start + i)) / scale);
}

// A decode's slot sits in a cache block written long ago, out of the caches: the lines token t + 1's rows
// go to (its K column touches every line of its head's K block) are asked for while token t is written, so
// the stores do not wait on memory one line after another. Nothing when t + 1 goes to t's block.
template <typename E>
static inline void prefetch_next_slot(const int64_t* slots, int64_t t, int64_t T, const E* kc, const E* vc,
                                      int64_t Hk, int64_t D, int64_t bs) {
#if defined(TIDAL_VEC)
  if (t + 1 >= T || slots[t + 1] / bs == slots[t] / bs) return;
  const int64_t next = slots[t + 1] / bs, off = slots[t + 1] % bs;
  for (int64_t h = 0; h < Hk; ++h) {
    prefetch_bytes(reinterpret_cast<const char*>(kc + (next * Hk + h) * D * bs), D * bs * sizeof(E));
    // (the token's pair of rows: a bf16 cache's V in pairs of tokens)
    prefetch_bytes(reinterpret_cast<const char*>(vc + ((next * Hk + h) * bs + (off & ~int64_t{1})) * D), 2 * D * sizeof(E));
  }
#else
  (void)slots; (void)t; (void)T; (void)kc; (void)vc; (void)Hk; (void)D; (void)bs;
#endif
}

// The writes below split their tokens over the threads when there are many (a prompt chunk, a large
// batch of decodes).
template <int DT>
static void write_kv_e4m3(const void* k, int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots,
                          uint8_t* kc, uint8_t* vc, int64_t T, int64_t Hk, int64_t D, int64_t bs, float k_scale,
                          float v_scale, const float* k_shift, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (T * Hk * D >= 8192)
  {
    std::vector<uint8_t> row(D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t block = slots[t] / bs, off = slots[t] % bs;
      prefetch_next_slot(slots, t, T, kc, vc, Hk, D, bs);
      for (int64_t h = 0; h < Hk; ++h) {
        to_e4m3<DT>(k, t * k_stride + h * D, D, k_scale, row.data(), k_shift ? k_shift + h * D : nullptr);
        uint8_t* kdst = kc + (block * Hk + h) * D * bs + off;
        for (int64_t d = 0; d < D; ++d) kdst[d * bs] = row[d];
        to_e4m3<DT>(v, t * v_stride + h * D, D, v_scale, vc + ((block * Hk + h) * bs + off) * D);
      }
    }
  }
}

template <typename S, typename E>
static void write_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots,
                     void* k_cache, void* v_cache, int64_t T, int64_t Hk, int64_t D, int64_t bs, bool k_pairs,
                     bool v_pairs, int num_threads) {
  const S* ks = static_cast<const S*>(k);
  const S* vs = static_cast<const S*>(v);
  E* kc = static_cast<E*>(k_cache);
  E* vc = static_cast<E*>(v_cache);
  // A prompt's tokens fill whole blocks: where 16 tokens in a row go to one block's 16 slots in order, that
  // block's K rows of each head are the transpose of the tokens' pairs, written 64 bytes at a time (16 x 16
  // transposes of 32-bit pairs) instead of a pair per token and row: the same bytes, and a 2,048-token
  // prompt step's KV writes 7.9-8.0 -> 5.4 ms on the AMX Xeon (the default model, 30 layers, a committed
  // cache). units: the first token of each whole block written so; every other token is written alone.
  bool whole_blocks = false;
#if TIDAL_VEC == 16
  if constexpr (std::is_same<S, E>::value && sizeof(E) == 2)
    whole_blocks = k_pairs && bs == 16 && D % 32 == 0 && T >= 16;
#endif
  auto whole_at = [&](int64_t t) {  // tokens t .. t + bs - 1 fill one block's slots in order
    bool whole = slots[t] >= 0 && slots[t] % bs == 0 && t + bs <= T;
    for (int64_t i = 1; whole && i < bs; ++i) whole = slots[t + i] == slots[t] + i;
    return whole;
  };
  if (whole_blocks) {  // (a decode step's rows, one per request, fill none: no units for them)
    whole_blocks = false;
    for (int64_t t = 0; t < T && !whole_blocks; ++t) whole_blocks = whole_at(t);
  }
  std::vector<int64_t> units;  // >= 0: a token alone; < 0: -(first token + 1) of a whole block
  if (whole_blocks) {
    units.reserve(T);
    for (int64_t t = 0; t < T;) {
      if (whole_at(t)) {
        units.push_back(-(t + 1));
        t += bs;
      } else {
        units.push_back(t++);
      }
    }
  }
  const int64_t num_units = whole_blocks ? static_cast<int64_t>(units.size()) : T;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * Hk * D >= 8192)
  for (int64_t u = 0; u < num_units; ++u) {
    const int64_t first = whole_blocks ? (units[u] < 0 ? -units[u] - 1 : units[u]) : u;
    const bool block_whole = whole_blocks && units[u] < 0;
#if TIDAL_VEC == 16
    if constexpr (std::is_same<S, E>::value && sizeof(E) == 2) {
      if (block_whole) {
        const int64_t block = slots[first] / bs;
        for (int64_t h = 0; h < Hk; ++h) {
          E* kb = kc + (block * Hk + h) * D * bs;  // row p: the 16 tokens' pair p, 64 bytes
          for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i)
              r[i] = _mm512_loadu_si512(ks + (first + i) * k_stride + h * D + 2 * p0);
            simd::transpose16x16(r);
            for (int q = 0; q < 16; ++q) _mm512_storeu_si512(kb + (p0 + q) * 2 * bs, r[q]);
          }
        }
      }
    }
#endif
    for (int64_t t = first; t < first + (block_whole ? bs : 1); ++t) {  // the unit's tokens: V, and K if alone
      const int64_t block = slots[t] / bs, off = slots[t] % bs;
      if (!block_whole) prefetch_next_slot(slots, t, T, kc, vc, Hk, D, bs);
      for (int64_t h = 0; h < Hk; ++h) {
        const S* kr = ks + t * k_stride + h * D;
        const S* vr = vs + t * v_stride + h * D;
        if (v_pairs) {
          E* prow = vc + (block * Hk + h) * bs * D + (off & ~int64_t{1}) * D;  // the token's pair row
          int64_t d = 0;
#if TIDAL_VEC == 16
          if constexpr (std::is_same<S, E>::value) {  // 16 values into every other 16-bit slot: one masked store
            const __mmask32 mine = (off & 1) ? 0xAAAAAAAAu : 0x55555555u;
            for (; d + 16 <= D; d += 16) {
              __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + d)));
              if (off & 1) w = _mm512_slli_epi32(w, 16);
              _mm512_mask_storeu_epi16(prow + 2 * d, mine, w);
            }
          }
#endif
          for (; d < D; ++d) prow[2 * d + (off & 1)] = convert<S, E>(vr[d]);
        } else if constexpr (std::is_same<S, E>::value) {
          std::memcpy(vc + ((block * Hk + h) * bs + off) * D, vr, D * sizeof(E));
        } else {
          E* vdst = vc + ((block * Hk + h) * bs + off) * D;
          for (int64_t d = 0; d < D; ++d) vdst[d] = convert<S, E>(vr[d]);
        }
        if (block_whole) continue;  // its K rows written above
        if (k_pairs) {
          E* kdst = kc + (block * Hk + h) * D * bs + 2 * off;
          for (int64_t d = 0; d < D; d += 2) {
            if constexpr (std::is_same<S, E>::value) {
              std::memcpy(kdst + d * bs, kr + d, 2 * sizeof(E));  // the pair as one word
            } else {
              kdst[d * bs] = convert<S, E>(kr[d]);
              kdst[d * bs + 1] = convert<S, E>(kr[d + 1]);
            }
          }
        } else {
          E* kdst = kc + (block * Hk + h) * D * bs + off;
          for (int64_t d = 0; d < D; ++d) kdst[d * bs] = convert<S, E>(kr[d]);
        }
      }
    }
  }
}

// RMSNorm over rows of H, optionally after adding a residual, matching the reference computation:
// s = round(x + residual) (kept as the new residual); y = round(s * rsqrt(mean(s^2) + eps)); out = round(w * y).
// A row's sum of squares is one chain of FMAs (16 partial sums, element i into sum i % 16) and then a serial
// sum, each waiting on the one before. Rows go RN at a time, their chains side by side (each row's arithmetic
// the same, in the same order): on two threads of the AMX Xeon 64 rows of 576 14.4 -> 11.9 us, 2,048 rows
// 240 -> 222 us (there the ~14 MB the rows read and write through L3 bound it).
template <int DT, int RN>
static void rms_norm_rows(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                          int64_t t0, int64_t H, float eps, float* rows) {
#if defined(TIDAL_VEC)
  constexpr bool VEC = DT == kF32 || DT == kBF16;  // (fp16 rows: the scalar loops)
#endif
  int64_t kv = 0;  // where the vector loops stop (the scalar ones take the rest)
#if defined(TIDAL_VEC)
  if constexpr (VEC) kv = H / W * W;
#endif
  for (int q = 0; q < RN; ++q) {
    const int64_t base = (t0 + q) * H;
    float* r = rows + q * H;
    int64_t k = 0;
#if defined(TIDAL_VEC)
    if constexpr (VEC) {
      for (; k < kv; k += W) {
        vf v = loadv<DT>(x, base + k);
        if (residual != nullptr) {
          v = simd::add(v, loadv<DT>(residual, base + k));
          storev<DT>(residual_out, base + k, v);
          if constexpr (DT == kBF16) v = simd::round_bf16(v);  // the rounded sum, as stored
        }
        simd::store(r + k, v);
      }
    }
#endif
    for (; k < H; ++k) {
      r[k] = load1<DT>(x, base + k);
      if (residual != nullptr) {
        store1<DT>(residual_out, base + k, r[k] + load1<DT>(residual, base + k));
        r[k] = load1<DT>(residual_out, base + k);  // the rounded sum, as the reference keeps it
      }
    }
  }
  // sum of squares: 16 partial sums (element i into sum i % 16), added in order, then the tail
  alignas(64) float partial[RN][16] = {};
  const int64_t i16 = H / 16 * 16;
#if defined(TIDAL_VEC)
  {
    vf acc[RN][16 / W];
    for (int q = 0; q < RN; ++q)
      for (int j = 0; j < 16 / W; ++j) acc[q][j] = simd::zero();
    for (int64_t i = 0; i < i16; i += 16)
      for (int q = 0; q < RN; ++q)
        for (int j = 0; j < 16 / W; ++j) {
          const vf v = simd::load(rows + q * H + i + j * W);
          acc[q][j] = simd::fmadd(v, v, acc[q][j]);
        }
    for (int q = 0; q < RN; ++q)
      for (int j = 0; j < 16 / W; ++j) simd::store(partial[q] + j * W, acc[q][j]);
  }
#else
  for (int64_t i = 0; i < i16; i += 16)
    for (int q = 0; q < RN; ++q)
      for (int j = 0; j < 16; ++j) partial[q][j] += rows[q * H + i + j] * rows[q * H + i + j];
#endif
  float ss[RN] = {};
  for (int j = 0; j < 16; ++j)
    for (int q = 0; q < RN; ++q) ss[q] += partial[q][j];
  for (int q = 0; q < RN; ++q) {
    const float* r = rows + q * H;
    for (int64_t i = i16; i < H; ++i) ss[q] += r[i] * r[i];
  }
  for (int q = 0; q < RN; ++q) {
    const int64_t base = (t0 + q) * H;
    const float* r = rows + q * H;
    const float inv = 1.f / std::sqrt(ss[q] / static_cast<float>(H) + eps);
    int64_t k = 0;
#if defined(TIDAL_VEC)
    if constexpr (VEC) {
      const vf iv = simd::set1(inv);
      for (; k < kv; k += W) {
        vf y = simd::mul(simd::load(r + k), iv);
        if constexpr (DT == kBF16) y = simd::round_bf16(y);
        storev<DT>(out, base + k, simd::mul(loadv<DT>(weight, k), y));
      }
    }
#endif
    for (; k < H; ++k) {
      float y = r[k] * inv;
      if (DT != kF32) { store1<DT>(out, base + k, y); y = load1<DT>(out, base + k); }
      store1<DT>(out, base + k, load1<DT>(weight, k) * y);
    }
  }
}

template <int DT>
static void rms_norm(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                     int64_t T, int64_t H, float eps, int num_threads) {
  constexpr int RN = 4;
  const int64_t groups = (T + RN - 1) / RN;
#pragma omp parallel num_threads(num_threads) if (T * H > 16384)  // a few decode rows: not worth waking threads
  {
    simd::avector<float> rows(RN * H);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t t0 = g * RN;
      if (t0 + RN <= T) {
        rms_norm_rows<DT, RN>(x, residual, weight, out, residual_out, t0, H, eps, rows.data());
      } else {
        for (int64_t t = t0; t < T; ++t) rms_norm_rows<DT, 1>(x, residual, weight, out, residual_out, t, H, eps, rows.data());
      }
    }
  }
}

// Greedy sampling: the index of each row's maximum (the first, as torch.argmax), reading the logits
// once in their own dtype (a bf16 row of a 49152-token vocabulary is 96 KiB: it stays in L2 between the
// two passes). NaN never wins.
template <int DT> static void argmax_rows(const void* x, int64_t R, int64_t V, int64_t* out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (R * V > 65536)
  for (int64_t r = 0; r < R; ++r) {
    const char* row = static_cast<const char*>(x) + r * V * elem_size<DT>();
    float m = -INFINITY;
    int64_t i = 0;
#if defined(TIDAL_VEC)
    vf vm = simd::set1(-INFINITY);
    for (; i + W <= V; i += W) vm = simd::max(loadv<DT>(row, i), vm);  // a NaN lane keeps vm
    m = simd::reduce_max(vm);
#endif
    for (; i < V; ++i) m = std::max(m, load1<DT>(row, i));
    int64_t idx = 0;
    i = 0;
#if defined(TIDAL_VEC)
    const vf target = simd::set1(m);
    for (; i + W <= V; i += W) {
#if TIDAL_VEC == 16
      const unsigned hit = _mm512_cmp_ps_mask(loadv<DT>(row, i), target, _CMP_EQ_OQ);
#else
      const unsigned hit = _mm256_movemask_ps(_mm256_cmp_ps(loadv<DT>(row, i), target, _CMP_EQ_OQ));
#endif
      if (hit) { idx = i + __builtin_ctz(hit); goto found; }
    }
#endif
    for (; i < V; ++i)
      if (load1<DT>(row, i) == m) { idx = i; goto found; }
  found:
    out[r] = idx;
  }
}

extern "C" {
// x [T, 2 * d] (gate, up); out [T, d]; dtype 0 f32, 1 bf16. Returns -1 where this build has no vector
// path (the caller's torch ops are as fast there).
int tidal_silu_and_mul(const void* x, void* out, int64_t T, int64_t d, int dtype, int num_threads) {
#if defined(TIDAL_VEC)
  if (dtype == kF32) { silu_and_mul<kF32>(x, out, T, d, num_threads); return 0; }
  if (dtype == kBF16) { silu_and_mul<kBF16>(x, out, T, d, num_threads); return 0; }
#endif
  (void)x; (void)out; (void)T; (void)d; (void)dtype; (void)num_threads;
  return -1;
}

// x [R, V] fp32 or bf16 (dtype 0 / 1); out [R] int64.
void tidal_argmax_rows(const void* x, int64_t R, int64_t V, int64_t* out, int dtype, int num_threads) {
  if (dtype == kBF16) argmax_rows<kBF16>(x, R, V, out, num_threads);
  else argmax_rows<kF32>(x, R, V, out, num_threads);
}

// The vector width this build runs (fp32 lanes): 16 (AVX-512), 8 (AVX2) or 1 (scalar code only).
int tidal_vector_lanes() {
#if defined(TIDAL_VEC)
  return TIDAL_VEC;
#else
  return 1;
#endif
}

// x rows of stride x_stride holding [H, D]; cos_full, sin_signed [max_position, D] fp32; out [T, H, D].
void tidal_rope_neox(const void* x, int64_t x_stride, const float* cos_full, const float* sin_signed,
                     const int64_t* positions, void* out, int64_t T, int64_t H, int64_t D, int dtype,
                     int num_threads) {
  if (dtype == kF32) rope_neox<kF32>(x, x_stride, cos_full, sin_signed, positions, out, T, H, D, num_threads);
  else if (dtype == kBF16) rope_neox<kBF16>(x, x_stride, cos_full, sin_signed, positions, out, T, H, D, num_threads);
  else rope_neox<kF16>(x, x_stride, cos_full, sin_signed, positions, out, T, H, D, num_threads);
}

// dtype: of k and v; kv_dtype: of the cache (equal, fp32 rows into a bf16 cache, or any rows into an E4M3
// cache, divided by k_scale / v_scale first, K rows less k_shift [Hk * D] fp32 first when it is not null).
void tidal_write_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots,
                    void* k_cache, void* v_cache, int64_t T, int64_t Hk, int64_t D, int64_t block_size, int dtype,
                    int kv_dtype, float k_scale, float v_scale, const float* k_shift, int num_threads) {
#define TIDAL_WRITE_E4M3(S) write_kv_e4m3<S>(k, k_stride, v, v_stride, slots, static_cast<uint8_t*>(k_cache), \
                                             static_cast<uint8_t*>(v_cache), T, Hk, D, block_size, k_scale, v_scale, \
                                             k_shift, num_threads)
  if (kv_dtype == kFP8) {
    if (dtype == kF32) TIDAL_WRITE_E4M3(kF32);
    else if (dtype == kBF16) TIDAL_WRITE_E4M3(kBF16);
    else TIDAL_WRITE_E4M3(kF16);
  } else if (dtype == kF32 && kv_dtype == kBF16)
    write_kv<float, uint16_t>(k, k_stride, v, v_stride, slots, k_cache, v_cache, T, Hk, D, block_size,
                              k_pairs<kBF16>(D), v_pairs<kBF16>(block_size), num_threads);
  else if (dtype == kF32)
    write_kv<float, float>(k, k_stride, v, v_stride, slots, k_cache, v_cache, T, Hk, D, block_size, false, false,
                           num_threads);
  else  // any 2-byte type into the same type
    write_kv<uint16_t, uint16_t>(k, k_stride, v, v_stride, slots, k_cache, v_cache, T, Hk, D, block_size,
                                 kv_dtype == kBF16 && k_pairs<kBF16>(D), kv_dtype == kBF16 && v_pairs<kBF16>(block_size),
                                 num_threads);
#undef TIDAL_WRITE_E4M3
}

// x, residual (may be null), out, residual_out: [T, H]; weight [H]. dtype: 0 f32, 1 bf16, 2 f16.
void tidal_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                    int64_t T, int64_t H, float eps, int dtype, int num_threads) {
  if (dtype == kF32) rms_norm<kF32>(x, residual, weight, out, residual_out, T, H, eps, num_threads);
  else if (dtype == kBF16) rms_norm<kBF16>(x, residual, weight, out, residual_out, T, H, eps, num_threads);
  else rms_norm<kF16>(x, residual, weight, out, residual_out, T, H, eps, num_threads);
}

// q [B, Hq, D], query b's heads at q + b * q_stride (elements; Hq * D when contiguous, more when the queries
// are read in place from rows of [q | k] or [q | k | v]); k_cache [num_blocks, Hk, D, block_size] (in pairs of
// dims where k_pairs, as write_kv); v_cache [num_blocks, Hk, block_size, D] (in pairs of tokens where
// v_pairs); block_tables [rows, max_blocks]; table_index [B] (query b reads row
// table_index[b]; null: row b); seq_lens [B] (including the new token); out [B, Hq, D]. All but q
// contiguous. dtype (q and out), kv_dtype (the cache): 0 f32, 1 bf16, 2 f16, 3 E4M3; equal, fp32 queries
// over a bf16 cache, or any queries over an E4M3 cache whose values are k_scale / v_scale times the stored
// ones (ignored for other caches).
void tidal_paged_attention_decode(const void* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                                  const int64_t* block_tables, const int64_t* table_index, const int64_t* seq_lens,
                                  void* out, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t block_size,
                                  int64_t max_blocks, float scale, int dtype, int kv_dtype, float k_scale,
                                  float v_scale, int num_threads) {
#define TIDAL_DECODE(Q, K) decode<Q, K>(q, q_stride, k_cache, v_cache, block_tables, table_index, seq_lens, out, B, \
                                        Hq, Hk, D, block_size, max_blocks, scale, k_scale, v_scale, num_threads)
  if (kv_dtype == kFP8) {
    if (dtype == kF32) TIDAL_DECODE(kF32, kFP8);
    else if (dtype == kBF16) TIDAL_DECODE(kBF16, kFP8);
    else TIDAL_DECODE(kF16, kFP8);
  } else if (dtype == kF32 && kv_dtype == kBF16) TIDAL_DECODE(kF32, kBF16);
  else if (dtype == kF32) TIDAL_DECODE(kF32, kF32);
  else if (dtype == kBF16) TIDAL_DECODE(kBF16, kBF16);
  else TIDAL_DECODE(kF16, kF16);
#undef TIDAL_DECODE
}
}
