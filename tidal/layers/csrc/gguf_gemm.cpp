// Products with weights kept in llama.cpp's GGUF blocks: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), where
// each weight row is K / 32 blocks of 32 values (K / 256 blocks of 256 for the K-quants). Plain C ABI
// (ctypes), no torch headers.
//
// Block formats (the type codes the Python side passes):
//   0  Q4_0   18 bytes: fp16 d, 16 bytes of nibbles                          w = d * (q - 8)
//   1  Q4_1   20 bytes: fp16 d, fp16 m, 16 bytes of nibbles                  w = d * q + m
//   2  Q8_0   34 bytes: fp16 d, 32 int8                                      w = d * q
//   3  Q5_0   22 bytes: fp16 d, 32 high bits (uint32), 16 bytes of nibbles   w = d * (q - 16)
//   4  Q5_1   24 bytes: fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles    w = d * q + m
//   5  Q4_K  144 bytes (256 values): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
//            nibbles; 8 sub-blocks of 32                                   w = d * sc * q - dmin * mn
//   6  Q5_K  176 bytes: as Q4_K with 32 bytes of high bits before the nibbles (bit j of byte i: value i
//            of sub-block j)
//   7  Q6_K  210 bytes: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales, fp16 d;
//            16 sub-blocks of 16                                            w = d * sc * (q - 32)
// In a 32-value nibble block, byte j holds value j (low nibble) and value j + 16 (high nibble); the
// K-quants' layouts are those of ggml-quants.c (and gguf-py's quants.py).
// The kernels see every format as chunks of 32 values with w = d * q + m (Q4_0: m = -8d, Q5_0: m = -16d,
// Q8_0 and Q6_K: m = 0, Q6_K's q signed and a scale per half chunk; a K-quant block's scales and offsets
// decoded once per 256 values), so a chunk's dot product with x is d * (q . x) + m * sum(x): the kernels
// widen q in registers and fold m in once per chunk.
//
// tidal_gguf_linear: M 1..16 (decode steps): the packed weights stream from memory once, each chunk
//   widened in registers and multiplied with up to four rows; further groups of four rows reread a
//   chunk of 64 weight rows from cache; fp32 or bf16 activations and output.
// tidal_gguf_linear_q8: as tidal_gguf_linear with the activations quantized to int8 per chunk of 32 and
//   integer dot products (llama.cpp's way; TIDAL_GGUF_ACTIVATIONS=q8, measured in docs/quantization.md).
// tidal_gguf_dequantize: rows of packed weights to fp32 or bf16 [rows, K] (prompt chunks and bigger
//   batches dequantize the layer into a scratch buffer and run the dense GEMM; embedding lookups).
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

constexpr int QK = 32;  // values per chunk: a block of the 32-value formats, a sub-block of a K-quant
constexpr int kTypes = 8;
constexpr int kBlockBytes[kTypes] = {18, 20, 34, 22, 24, 144, 176, 210};
constexpr int kChunks[kTypes] = {1, 1, 1, 1, 1, 8, 8, 8};  // chunks of 32 values per block
constexpr int kMaxChunks = 8;

inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

inline bool valid_type(int type) { return type >= 0 && type < kTypes; }
inline int block_bytes(int type) { return kBlockBytes[type]; }
inline int block_values(int type) { return kChunks[type] * QK; }

inline uint16_t read_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t read_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// A block's scales and offsets: chunk j's values are w = d[2j] * q + m[j] (its first 16) and
// d[2j + 1] * q + m[j] (its last 16); the two scales differ only in Q6_K (sub-blocks of 16). d holds
// 2 * kChunks[type] floats, m kChunks[type]. A K-quant's d * sc and dmin * mn are exact in fp32 (at most
// 11 + 8 significant bits), as are d * sc * q for Q4_K / Q5_K: one fused multiply-add gives gguf-py's
// values bit for bit.
inline void block_header(int type, const uint8_t* blk, float* d, float* m) {
  switch (type) {
    case 0: case 2: case 3: {
      const float s = fp16_to_float(read_u16(blk));
      d[0] = d[1] = s;
      m[0] = type == 0 ? -8.f * s : type == 3 ? -16.f * s : 0.f;
      break;
    }
    case 1: case 4:
      d[0] = d[1] = fp16_to_float(read_u16(blk));
      m[0] = fp16_to_float(read_u16(blk + 2));
      break;
    case 5: case 6: {  // 6-bit scales and mins of the 8 sub-blocks (ggml-quants.c's get_scale_min_k4)
      const float dd = fp16_to_float(read_u16(blk)), dmin = fp16_to_float(read_u16(blk + 2));
      const uint8_t* s = blk + 4;
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        if (j < 4) {
          sc = s[j] & 63; mn = s[j + 4] & 63;
        } else {
          sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        d[2 * j] = d[2 * j + 1] = dd * static_cast<float>(sc);
        m[j] = -(dmin * static_cast<float>(mn));
      }
      break;
    }
    default: {  // Q6_K: an int8 scale per 16 values
      const float dd = fp16_to_float(read_u16(blk + 208));
      for (int i = 0; i < 16; ++i) d[i] = dd * static_cast<float>(static_cast<int8_t>(blk[192 + i]));
      for (int j = 0; j < 8; ++j) m[j] = 0.f;
    }
  }
}

// the 32 integer quants of chunk j of a block, scalar
inline void chunk_quants(int type, const uint8_t* blk, int j, float* q) {
  switch (type) {
    case 0: case 1: {
      const uint8_t* qs = blk + (type == 0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) { q[i] = static_cast<float>(qs[i] & 0x0f); q[i + 16] = static_cast<float>(qs[i] >> 4); }
      break;
    }
    case 2:
      for (int i = 0; i < QK; ++i) q[i] = static_cast<float>(static_cast<int8_t>(blk[2 + i]));
      break;
    case 3: case 4: {  // bit i of qh is the fifth bit of value i
      const uint32_t qh = read_u32(blk + (type == 3 ? 2 : 4));
      const uint8_t* qs = blk + (type == 3 ? 6 : 8);
      for (int i = 0; i < 16; ++i) {
        q[i] = static_cast<float>((qs[i] & 0x0f) | (((qh >> i) & 1u) << 4));
        q[i + 16] = static_cast<float>((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
      }
      break;
    }
    case 5: case 6: {  // sub-block j: the low (even j) or high (odd j) nibbles of bytes 32 (j / 2) ..; Q5_K: bit j of qh[i]
      const uint8_t* qs = blk + (type == 5 ? 16 : 48) + 32 * (j / 2);
      const int sh = 4 * (j & 1);
      for (int i = 0; i < QK; ++i) {
        int v = (qs[i] >> sh) & 0x0f;
        if (type == 6) v |= ((blk[16 + i] >> j) & 1) << 4;
        q[i] = static_cast<float>(v);
      }
      break;
    }
    default: {  // Q6_K: values 128 h + 32 k + i (chunk j = 4h + k): nibble k / 2 of ql[64 h + 32 (k % 2) + i],
                // bits 2k, 2k + 1 of qh[32 h + i] above, minus 32
      const int h = j / 4, k = j % 4;
      const uint8_t* ql = blk + 64 * h + 32 * (k & 1);
      const uint8_t* qh = blk + 128 + 32 * h;
      const int sl = 4 * (k / 2), sh = 2 * k;
      for (int i = 0; i < QK; ++i)
        q[i] = static_cast<float>((((ql[i] >> sl) & 0x0f) | (((qh[i] >> sh) & 3) << 4)) - 32);
    }
  }
}

#if defined(TIDAL_VEC)
using simd::vf;
using simd::W;
constexpr int NV = QK / W;  // vectors per chunk

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// each byte shifted right by n (0..7; bits from the neighbouring byte land above those the caller keeps)
inline __m128i srl_bytes(__m128i v, int n) { return _mm_srl_epi16(v, _mm_cvtsi32_si128(n)); }
// 0x10 in each byte whose bits & mask is mask (mask: one bit per byte), else 0
inline __m128i bit_to_16(__m128i bits, __m128i mask) {
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(bits, mask), mask), _mm_set1_epi8(0x10));
}

// Chunk j's 32 quants as bytes: values 0..15 in a, 16..31 in b (signed for Q8_0 and Q6_K).
inline void chunk_bytes(int type, const uint8_t* blk, int j, __m128i& a, __m128i& b) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  switch (type) {
    case 0: case 1: case 3: case 4: {
      const __m128i raw = load16(blk + (type == 0 ? 2 : type == 1 ? 4 : type == 3 ? 6 : 8));
      a = _mm_and_si128(raw, low4);
      b = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
      if (type >= 3) {  // bit i of the 32-bit qh: byte i / 8 of it spread over 8 lanes, bit i % 8 of each
        const __m128i qh = _mm_set1_epi32(static_cast<int>(read_u32(blk + (type == 3 ? 2 : 4))));
        const __m128i mask = _mm_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
        a = _mm_or_si128(a, bit_to_16(_mm_shuffle_epi8(qh, _mm_set_epi64x(0x0101010101010101LL, 0)), mask));
        b = _mm_or_si128(b, bit_to_16(_mm_shuffle_epi8(qh, _mm_set_epi64x(0x0303030303030303LL,
                                                                          0x0202020202020202LL)), mask));
      }
      break;
    }
    case 2:
      a = load16(blk + 2); b = load16(blk + 18);
      break;
    case 5: case 6: {
      const uint8_t* qs = blk + (type == 5 ? 16 : 48) + 32 * (j / 2);
      const int sh = 4 * (j & 1);
      a = _mm_and_si128(srl_bytes(load16(qs), sh), low4);
      b = _mm_and_si128(srl_bytes(load16(qs + 16), sh), low4);
      if (type == 6) {
        const __m128i mask = _mm_set1_epi8(static_cast<char>(1 << j));
        a = _mm_or_si128(a, bit_to_16(load16(blk + 16), mask));
        b = _mm_or_si128(b, bit_to_16(load16(blk + 32), mask));
      }
      break;
    }
    default: {  // Q6_K, as chunk_quants
      const int h = j / 4, k = j % 4;
      const uint8_t* ql = blk + 64 * h + 32 * (k & 1);
      const uint8_t* qh = blk + 128 + 32 * h;
      const int sl = 4 * (k / 2), sh = 2 * k;
      const __m128i three = _mm_set1_epi8(3), off = _mm_set1_epi8(32);
      auto six = [&](int o) {
        const __m128i lo = _mm_and_si128(srl_bytes(load16(ql + o), sl), low4);
        const __m128i hi = _mm_slli_epi16(_mm_and_si128(srl_bytes(load16(qh + o), sh), three), 4);
        return _mm_sub_epi8(_mm_or_si128(lo, hi), off);
      };
      a = six(0);
      b = six(16);
    }
  }
}

// chunk j's 32 quants widened to NV fp32 vectors
inline void chunk_quants_vec(int type, const uint8_t* blk, int j, vf* q) {
  __m128i a, b;
  chunk_bytes(type, blk, j, a, b);
  const bool sgn = type == 2 || type == 7;
#if TIDAL_VEC == 16
  q[0] = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(a) : _mm512_cvtepu8_epi32(a));
  q[1] = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  auto widen = [sgn](__m128i v) { return _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v)); };
  q[0] = widen(a);
  q[1] = widen(_mm_srli_si128(a, 8));
  q[2] = widen(b);
  q[3] = widen(_mm_srli_si128(b, 8));
#endif
}
#endif

inline float load_act(const void* x, int dtype, int64_t i) {
  return dtype == 0 ? static_cast<const float*>(x)[i] : bf16_to_float(static_cast<const uint16_t*>(x)[i]);
}

// One output row's dot products with MR rows of x, in two interleaved chains (even and odd chunks) so
// that consecutive chunks do not wait on each other's accumulation. T: the type (compiled per format).
template <int T, int MR>
void linear_rows(const float* xf, const float* xsum, const uint8_t* w, int64_t n0, int64_t n1, int64_t K,
                 float* acc_out) {
  constexpr int C = kChunks[T], BB = kBlockBytes[T];
  constexpr bool kTwoScales = T == 7;         // Q6_K: a scale per 16 values
  constexpr bool kOffset = T != 2 && T != 7;  // m != 0
  const int64_t nc = K / QK, nb = nc / C, row_bytes = nb * BB;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float s[2][MR] = {};
#if defined(TIDAL_VEC)
    vf acc[2][MR];
    for (int r = 0; r < MR; ++r) acc[0][r] = acc[1][r] = simd::zero();
#endif
    // chunk g of the row (chunk j of the block at blk): scales dl, dh of its halves, offset m; chain c
    auto chunk = [&](const uint8_t* blk, int j, int64_t g, float dl, float dh, float m, int c) {
#if defined(TIDAL_VEC)
      vf q[NV];
      chunk_quants_vec(T, blk, j, q);
      const vf dlv = simd::set1(dl);
      for (int r = 0; r < MR; ++r) {
        const float* xb = xf + r * K + g * QK;
        if constexpr (kTwoScales) {
          constexpr int H = NV / 2;
          vf pl = simd::mul(q[0], simd::load(xb)), ph = simd::mul(q[H], simd::load(xb + H * W));
          for (int i = 1; i < H; ++i) {
            pl = simd::fmadd(q[i], simd::load(xb + i * W), pl);
            ph = simd::fmadd(q[H + i], simd::load(xb + (H + i) * W), ph);
          }
          acc[c][r] = simd::fmadd(dlv, pl, simd::fmadd(simd::set1(dh), ph, acc[c][r]));
        } else {
          vf p = simd::mul(q[0], simd::load(xb));
          for (int i = 1; i < NV; ++i) p = simd::fmadd(q[i], simd::load(xb + i * W), p);
          acc[c][r] = simd::fmadd(dlv, p, acc[c][r]);
        }
        if constexpr (kOffset) s[c][r] += m * xsum[r * nc + g];
      }
#else
      float q[QK];
      chunk_quants(T, blk, j, q);
      for (int r = 0; r < MR; ++r) {
        const float* xb = xf + r * K + g * QK;
        if constexpr (kTwoScales) {
          float pl = 0.f, ph = 0.f;
          for (int i = 0; i < 16; ++i) { pl += q[i] * xb[i]; ph += q[i + 16] * xb[i + 16]; }
          s[c][r] += dl * pl + dh * ph;
        } else {
          float p = 0.f;
          for (int i = 0; i < QK; ++i) p += q[i] * xb[i];
          s[c][r] += kOffset ? dl * p + m * xsum[r * nc + g] : dl * p;
        }
      }
#endif
    };
    if constexpr (C == 1) {  // 32-value blocks: even and odd blocks in the two chains
      auto block = [&](int64_t b, int c) {
        const uint8_t* blk = wr + b * BB;
        float d[2], m[1];
        block_header(T, blk, d, m);
        chunk(blk, 0, b, d[0], d[1], m[0], c);
      };
      int64_t b = 0;
      for (; b + 1 < nb; b += 2) { block(b, 0); block(b + 1, 1); }
      if (b < nb) block(b, 0);
    } else {  // a K-quant's scales and offsets decoded once per 256 values, its sub-blocks in the two chains
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wr + b * BB;
        float d[2 * C], m[C];
        block_header(T, blk, d, m);
        for (int j = 0; j < C; j += 2) {
          chunk(blk, j, b * C + j, d[2 * j], d[2 * j + 1], m[j], 0);
          chunk(blk, j + 1, b * C + j + 1, d[2 * j + 2], d[2 * j + 3], m[j + 1], 1);
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      float total = s[0][r] + s[1][r];
#if defined(TIDAL_VEC)
      total += simd::reduce_add(simd::add(acc[0][r], acc[1][r]));
#endif
      acc_out[r * (n1 - n0) + (n - n0)] = total;
    }
  }
}

// linear_rows for a group of mr (1..4) rows of x
template <int T>
void linear_group(int64_t mr, const float* xg, const float* sg, const uint8_t* w, int64_t n0, int64_t n1,
                  int64_t K, float* acc) {
  switch (mr) {
    case 1: linear_rows<T, 1>(xg, sg, w, n0, n1, K, acc); break;
    case 2: linear_rows<T, 2>(xg, sg, w, n0, n1, K, acc); break;
    case 3: linear_rows<T, 3>(xg, sg, w, n0, n1, K, acc); break;
    default: linear_rows<T, 4>(xg, sg, w, n0, n1, K, acc); break;
  }
}
using group_fn = void (*)(int64_t, const float*, const float*, const uint8_t*, int64_t, int64_t, int64_t, float*);
constexpr group_fn kGroups[kTypes] = {linear_group<0>, linear_group<1>, linear_group<2>, linear_group<3>,
                                      linear_group<4>, linear_group<5>, linear_group<6>, linear_group<7>};

#if defined(__AVX2__)
// Integer dot products on activations quantized per chunk of 32 (llama.cpp's Q8 activations): xq int8,
// xd the chunk's scale (max |x| / 127), xs the sum of its xq. A chunk's dot product is
// d * xd * (q . xq) + m * xd * xs, the integer part exact. Q6_K (two scales per chunk) is not taken.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);  // VPDPBUSD
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // no saturation: |u| <= 128
#endif
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <int T, int MR>
void linear_rows_q8(const int8_t* xq, const float* xd, const float* xs, const uint8_t* w, int64_t n0, int64_t n1,
                    int64_t K, float* acc_out) {
  constexpr int C = kChunks[T], BB = kBlockBytes[T];
  constexpr bool kSigned = T == 2;            // Q8_0's quants are signed: |q| times x with q's sign
  constexpr bool kOffset = T != 2;
  const int64_t nc = K / QK, nb = nc / C, row_bytes = nb * BB;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[MR];
    float s[MR] = {};
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wr + b * BB;
      float d[2 * C], m[C];
      block_header(T, blk, d, m);
      for (int j = 0; j < C; ++j) {
        const int64_t g = b * C + j;
        __m128i lo, hi;
        chunk_bytes(T, blk, j, lo, hi);
        const __m256i q = _mm256_set_m128i(hi, lo);
        const __m256i u = kSigned ? _mm256_sign_epi8(q, q) : q;
        for (int r = 0; r < MR; ++r) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * QK));
          if constexpr (kSigned) xv = _mm256_sign_epi8(xv, q);
          const float sx = xd[r * nc + g];
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, xv)), _mm256_set1_ps(d[2 * j] * sx), acc[r]);
          if constexpr (kOffset) s[r] += m[j] * xs[r * nc + g];
        }
      }
    }
    for (int r = 0; r < MR; ++r) acc_out[r * (n1 - n0) + (n - n0)] = hsum8(acc[r]) + s[r];
  }
}

template <int T>
void linear_group_q8(int64_t mr, const int8_t* xq, const float* xd, const float* xs, const uint8_t* w, int64_t n0,
                     int64_t n1, int64_t K, float* acc) {
  switch (mr) {
    case 1: linear_rows_q8<T, 1>(xq, xd, xs, w, n0, n1, K, acc); break;
    case 2: linear_rows_q8<T, 2>(xq, xd, xs, w, n0, n1, K, acc); break;
    case 3: linear_rows_q8<T, 3>(xq, xd, xs, w, n0, n1, K, acc); break;
    default: linear_rows_q8<T, 4>(xq, xd, xs, w, n0, n1, K, acc); break;
  }
}
using group_q8_fn = void (*)(int64_t, const int8_t*, const float*, const float*, const uint8_t*, int64_t, int64_t,
                             int64_t, float*);
constexpr group_q8_fn kGroupsQ8[kTypes] = {linear_group_q8<0>, linear_group_q8<1>, linear_group_q8<2>,
                                           linear_group_q8<3>, linear_group_q8<4>, linear_group_q8<5>,
                                           linear_group_q8<6>, nullptr};
#endif

// The values of one block (32, or 256 for a K-quant), to fp32 or bf16 (round to nearest even), d * q + m
// in one fused multiply-add per value.
template <typename T>
inline void dequantize_block(int type, const uint8_t* blk, T* o) {
  float d[2 * kMaxChunks], m[kMaxChunks];
  block_header(type, blk, d, m);
  for (int j = 0; j < kChunks[type]; ++j, o += QK) {
#if defined(TIDAL_VEC)
    vf q[NV];
    chunk_quants_vec(type, blk, j, q);
    const vf mv = simd::set1(m[j]);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {  // NV = 2: both halves rounded (nearest even) in one instruction
      // (VCVTNE2PS2BF16 flushes fp32 subnormals, which d * q + m never is: a multiple of an fp16 d's quantum)
      const vf lo = simd::fmadd(q[0], simd::set1(d[2 * j]), mv), hi = simd::fmadd(q[1], simd::set1(d[2 * j + 1]), mv);
      _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      continue;
    }
#endif
    for (int v = 0; v < NV; ++v) {
      const vf val = simd::fmadd(q[v], simd::set1(d[2 * j + (v >= NV / 2)]), mv);
      if constexpr (std::is_same_v<T, uint16_t>) simd::store_bf16(o + v * W, val);
      else simd::store(o + v * W, val);
    }
#else
    float vals[QK];
    chunk_quants(type, blk, j, vals);
    for (int i = 0; i < QK; ++i) {
      const float val = vals[i] * d[2 * j + (i >= 16)] + m[j];
      if constexpr (std::is_same_v<T, uint16_t>) o[i] = float_to_bf16(val);
      else o[i] = val;
    }
#endif
  }
}


// rows [n0, n0 + rows) of a packed weight as plain rows [rows, K], compiled per format
template <int TYPE, typename T>
void make_rows_of(const uint8_t* w, int64_t n0, int64_t rows, int64_t K, T* out) {
  constexpr int64_t bv = kChunks[TYPE] * QK, bb = kBlockBytes[TYPE];
  const int64_t nb = K / bv;
  const uint8_t* wp = w + n0 * nb * bb;
  for (int64_t i = 0; i < rows * nb; ++i) dequantize_block(TYPE, wp + i * bb, out + i * bv);
}

template <typename T>
void make_rows(const void* wv, int type, int64_t n0, int64_t rows, int64_t K, T* out) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  switch (type) {
    case 0: make_rows_of<0>(w, n0, rows, K, out); break;
    case 1: make_rows_of<1>(w, n0, rows, K, out); break;
    case 2: make_rows_of<2>(w, n0, rows, K, out); break;
    case 3: make_rows_of<3>(w, n0, rows, K, out); break;
    case 4: make_rows_of<4>(w, n0, rows, K, out); break;
    case 5: make_rows_of<5>(w, n0, rows, K, out); break;
    case 6: make_rows_of<6>(w, n0, rows, K, out); break;
    default: make_rows_of<7>(w, n0, rows, K, out); break;
  }
}

// out[M, N] (+ bias) of dtype from the products of rows of x with chunks of 64 weight rows, the chunks
// spread over the threads: group(r0, mr, n0, n1, acc) fills acc[mr, n1 - n0] for rows r0 .. r0 + mr (up to
// four) of x. Rows of x go in groups of four: a chunk's packed weights (a few KB) come from memory for the
// first group and from cache for the others.
template <class Group>
void decode_chunks(int64_t M, int64_t N, const void* bias, void* out, int dtype, int threads, const Group& group) {
  constexpr int64_t kChunk = 64;  // output rows per task
  const int64_t chunks = (N + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * kChunk, n1 = n0 + kChunk < N ? n0 + kChunk : N;
    float acc[4 * kChunk];
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int64_t mr = M - r0 < 4 ? M - r0 : 4;
      group(r0, mr, n0, n1, acc);
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t n = n0; n < n1; ++n) {
          float v = acc[r * (n1 - n0) + (n - n0)];
          if (bias) v += load_act(bias, dtype, n);
          if (dtype == 0) static_cast<float*>(out)[(r0 + r) * N + n] = v;
          else static_cast<uint16_t*>(out)[(r0 + r) * N + n] = float_to_bf16(v);
        }
    }
  }
}

}  // namespace

extern "C" {

constexpr int64_t kMaxRows = 16;

// out[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias[N]); x, bias and out of dtype (0 fp32, 1 bf16).
// Returns non-zero when it does not apply (M outside 1..kMaxRows, K not a multiple of the format's block,
// unknown type).
int tidal_gguf_linear(const void* x, const void* w, int type, const void* bias, void* out, int64_t M, int64_t N,
                      int64_t K, int dtype, int threads) {
  if (M < 1 || M > kMaxRows || !valid_type(type) || K % block_values(type) != 0 || (dtype != 0 && dtype != 1))
    return 1;
  const int64_t nc = K / QK;  // chunks of 32 per row
  std::vector<float> xf(M * K), xsum(M * nc);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nc; ++b) {
      float s = 0.f;
      for (int j = 0; j < QK; ++j) { const float v = load_act(x, dtype, r * K + b * QK + j); xf[r * K + b * QK + j] = v; s += v; }
      xsum[r * nc + b] = s;
    }
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  const group_fn group = kGroups[type];
  decode_chunks(M, N, bias, out, dtype, threads, [&](int64_t r0, int64_t mr, int64_t n0, int64_t n1, float* acc) {
    group(mr, xf.data() + r0 * K, xsum.data() + r0 * nc, wp, n0, n1, K, acc);
  });
  return 0;
}

// As tidal_gguf_linear with the activations quantized per chunk of 32 to int8 (scale max |x| / 127, round
// to nearest even) and integer dot products (VPDPBUSD on AVX-512 VNNI, VPMADDUBSW elsewhere): llama.cpp's
// way; the engine's decode products take it with TIDAL_GGUF_ACTIVATIONS=q8 (docs/quantization.md).
// Returns non-zero where it does not apply (no AVX2, Q6_K, M outside 1..kMaxRows).
int tidal_gguf_linear_q8(const void* x, const void* w, int type, const void* bias, void* out, int64_t M, int64_t N,
                         int64_t K, int dtype, int threads) {
#if defined(__AVX2__)
  if (M < 1 || M > kMaxRows || !valid_type(type) || kGroupsQ8[type] == nullptr || K % block_values(type) != 0 ||
      (dtype != 0 && dtype != 1))
    return 1;
  const int64_t nc = K / QK;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nc), xs(M * nc);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < nc; ++c) {
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(load_act(x, dtype, r * K + c * QK + j)));
      const float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < QK; ++j) {
        const int v = static_cast<int>(std::nearbyint(load_act(x, dtype, r * K + c * QK + j) * inv));
        xq[r * K + c * QK + j] = static_cast<int8_t>(v);
        sum += v;
      }
      xd[r * nc + c] = sc;
      xs[r * nc + c] = sc * static_cast<float>(sum);
    }
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  const group_q8_fn group = kGroupsQ8[type];
  decode_chunks(M, N, bias, out, dtype, threads, [&](int64_t r0, int64_t mr, int64_t n0, int64_t n1, float* acc) {
    group(mr, xq.data() + r0 * K, xd.data() + r0 * nc, xs.data() + r0 * nc, wp, n0, n1, K, acc);
  });
  return 0;
#else
  (void)x; (void)w; (void)type; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)dtype; (void)threads;
  return 1;
#endif
}

// out[rows, K] (dtype 0 fp32, 1 bf16) = the values of rows of packed blocks.
int tidal_gguf_dequantize(const void* w, int type, void* out, int64_t rows, int64_t K, int dtype, int threads) {
  if (!valid_type(type) || K % block_values(type) != 0 || (dtype != 0 && dtype != 1)) return 1;
  const int64_t bv = block_values(type), nb = K / bv, bb = block_bytes(type), total = rows * nb;
  const uint8_t* wp = static_cast<const uint8_t*>(w);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < total; ++i) {
    if (dtype == 1) dequantize_block(type, wp + i * bb, static_cast<uint16_t*>(out) + i * bv);
    else dequantize_block(type, wp + i * bb, static_cast<float*>(out) + i * bv);
  }
  return 0;
}

// Rows [n0, n0 + rows) of a packed weight w [N, K / block values, block bytes] as plain bf16 rows
// out [rows, K], on the calling thread: gemm.cpp's tidal_gemm_bf16_rows makes each tile of 16 weight rows
// it multiplies with this (the Python side passes its address), so a batch's product reads the blocks
// once per panel of x and never holds the layer in bf16.
void tidal_gguf_rows_bf16(const void* w, int type, int64_t n0, int64_t rows, int64_t K, void* out) {
  make_rows(w, type, n0, rows, K, static_cast<uint16_t*>(out));
}

// As tidal_gguf_rows_bf16, in fp32 (gemm.cpp's tidal_linear_f32_rows: fp32 activations, more than 8 rows).
void tidal_gguf_rows_f32(const void* w, int type, int64_t n0, int64_t rows, int64_t K, void* out) {
  make_rows(w, type, n0, rows, K, static_cast<float*>(out));
}

}  // extern "C"
