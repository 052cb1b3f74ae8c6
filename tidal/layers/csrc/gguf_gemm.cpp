// Products with weights kept in llama.cpp's GGUF blocks: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), where
// each weight row is K / 32 blocks of 32 values. Plain C ABI (ctypes), no torch headers.
//
// Block formats (the type codes the Python side passes):
//   0  Q4_0  18 bytes: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
//   1  Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
//   2  Q8_0  34 bytes: fp16 d, 32 int8                      w = d * q
// In a nibble block, byte j holds value j (low nibble) and value j + 16 (high nibble).
// Every format is w = d * q + m per block (Q4_0: m = -8d, Q8_0: m = 0), so a block's dot product with x
// is d * (q . x) + m * sum(x): the kernels widen q in registers and fold m in once per block.
//
// tidal_gguf_linear: M 1..16 (decode steps): the packed weights stream from memory once, each block
//   widened in registers and multiplied with up to four rows; further groups of four rows reread a
//   chunk of 64 weight rows from cache; fp32 or bf16 activations and output.
// tidal_gguf_dequantize: rows of packed weights to fp32 or bf16 [rows, K] (prompt chunks and bigger
//   batches dequantize the layer into a scratch buffer and run the dense GEMM; embedding lookups).
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

using simd::bf16_to_float;
using simd::float_to_bf16;

namespace {

constexpr int QK = 32;

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

inline int block_bytes(int type) { return type == 0 ? 18 : type == 1 ? 20 : 34; }

inline uint16_t read_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// d, m of a block and a pointer to its quants
inline void block_header(int type, const uint8_t* blk, float& d, float& m, const uint8_t*& qs) {
  d = fp16_to_float(read_u16(blk));
  if (type == 0) { m = -8.f * d; qs = blk + 2; }
  else if (type == 1) { m = fp16_to_float(read_u16(blk + 2)); qs = blk + 4; }
  else { m = 0.f; qs = blk + 2; }
}

// the 32 integer quants of a block, scalar
inline void block_quants(int type, const uint8_t* qs, float* q) {
  if (type == 2) {
    for (int j = 0; j < QK; ++j) q[j] = static_cast<float>(static_cast<int8_t>(qs[j]));
  } else {
    for (int j = 0; j < 16; ++j) { q[j] = static_cast<float>(qs[j] & 0x0f); q[j + 16] = static_cast<float>(qs[j] >> 4); }
  }
}

#if defined(TIDAL_VEC)
using simd::vf;
using simd::W;
constexpr int NV = QK / W;  // vectors per block

// the 32 quants of a block widened to NV fp32 vectors
inline void block_quants_vec(int type, const uint8_t* qs, vf* q) {
  if (type == 2) {
#if TIDAL_VEC == 16
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
#else
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i))));
#endif
    return;
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
#if TIDAL_VEC == 16
  q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
  q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
#else
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#endif
}
#endif

inline float load_act(const void* x, int dtype, int64_t i) {
  return dtype == 0 ? static_cast<const float*>(x)[i] : bf16_to_float(static_cast<const uint16_t*>(x)[i]);
}

// One output row's dot products with MR rows of x, in two interleaved chains (even and odd blocks) so
// that consecutive blocks do not wait on each other's accumulation.
template <int MR>
void linear_rows(int type, const float* xf, const float* xsum, const uint8_t* w, int64_t n0, int64_t n1,
                 int64_t K, float* acc_out) {
  const int64_t nb = K / QK, bb = block_bytes(type), row_bytes = nb * bb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float s[2][MR] = {};
#if defined(TIDAL_VEC)
    vf acc[2][MR];
    for (int r = 0; r < MR; ++r) acc[0][r] = acc[1][r] = simd::zero();
#endif
    auto block = [&](int64_t b, int c) {
      float d, m; const uint8_t* qs;
      block_header(type, wr + b * bb, d, m, qs);
#if defined(TIDAL_VEC)
      vf q[NV];
      block_quants_vec(type, qs, q);
      const vf dv = simd::set1(d);
      for (int r = 0; r < MR; ++r) {
        const float* xb = xf + r * K + b * QK;
        vf p = simd::mul(q[0], simd::load(xb));
        for (int i = 1; i < NV; ++i) p = simd::fmadd(q[i], simd::load(xb + i * W), p);
        acc[c][r] = simd::fmadd(dv, p, acc[c][r]);
        s[c][r] += m * xsum[r * nb + b];
      }
#else
      float q[QK];
      block_quants(type, qs, q);
      for (int r = 0; r < MR; ++r) {
        const float* xb = xf + r * K + b * QK;
        float p = 0.f;
        for (int j = 0; j < QK; ++j) p += q[j] * xb[j];
        s[c][r] += d * p + m * xsum[r * nb + b];
      }
#endif
    };
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) { block(b, 0); block(b + 1, 1); }
    if (b < nb) block(b, 0);
    for (int r = 0; r < MR; ++r) {
      float total = s[0][r] + s[1][r];
#if defined(TIDAL_VEC)
      total += simd::reduce_add(simd::add(acc[0][r], acc[1][r]));
#endif
      acc_out[r * (n1 - n0) + (n - n0)] = total;
    }
  }
}

}  // namespace

extern "C" {

constexpr int64_t kMaxRows = 16;

// out[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias[N]); x, bias and out of dtype (0 fp32, 1 bf16).
// Returns non-zero when it does not apply (M outside 1..kMaxRows, K not a multiple of 32, unknown type).
int tidal_gguf_linear(const void* x, const void* w, int type, const void* bias, void* out, int64_t M, int64_t N,
                      int64_t K, int dtype, int threads) {
  if (M < 1 || M > kMaxRows || K % QK != 0 || type < 0 || type > 2 || (dtype != 0 && dtype != 1)) return 1;
  const int64_t nb = K / QK;
  std::vector<float> xf(M * K), xsum(M * nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int j = 0; j < QK; ++j) { const float v = load_act(x, dtype, r * K + b * QK + j); xf[r * K + b * QK + j] = v; s += v; }
      xsum[r * nb + b] = s;
    }
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  constexpr int64_t kChunk = 64;  // output rows per task
  const int64_t chunks = (N + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * kChunk, n1 = n0 + kChunk < N ? n0 + kChunk : N;
    float acc[4 * kChunk];
    // rows of x in groups of four: the chunk's packed weights (a few KB) come from memory for the first
    // group and from cache for the others
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int64_t mr = M - r0 < 4 ? M - r0 : 4;
      const float* xg = xf.data() + r0 * K;
      const float* sg = xsum.data() + r0 * nb;
      switch (mr) {
        case 1: linear_rows<1>(type, xg, sg, wp, n0, n1, K, acc); break;
        case 2: linear_rows<2>(type, xg, sg, wp, n0, n1, K, acc); break;
        case 3: linear_rows<3>(type, xg, sg, wp, n0, n1, K, acc); break;
        default: linear_rows<4>(type, xg, sg, wp, n0, n1, K, acc); break;
      }
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t n = n0; n < n1; ++n) {
          float v = acc[r * (n1 - n0) + (n - n0)];
          if (bias) v += load_act(bias, dtype, n);
          if (dtype == 0) static_cast<float*>(out)[(r0 + r) * N + n] = v;
          else static_cast<uint16_t*>(out)[(r0 + r) * N + n] = float_to_bf16(v);
        }
    }
  }
  return 0;
}

// out[rows, K] (dtype 0 fp32, 1 bf16) = the values of rows of packed blocks.
int tidal_gguf_dequantize(const void* w, int type, void* out, int64_t rows, int64_t K, int dtype, int threads) {
  if (K % QK != 0 || type < 0 || type > 2 || (dtype != 0 && dtype != 1)) return 1;
  const int64_t nb = K / QK, bb = block_bytes(type), total = rows * nb;
  const uint8_t* wp = static_cast<const uint8_t*>(w);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < total; ++i) {
    float d, m; const uint8_t* qs;
    block_header(type, wp + i * bb, d, m, qs);
    float vals[QK];
#if defined(TIDAL_VEC)
    vf q[NV];
    block_quants_vec(type, qs, q);
    if (dtype == 1) {  // straight to bf16 (round to nearest even, as the scalar path)
      uint16_t* o = static_cast<uint16_t*>(out) + i * QK;
      for (int v = 0; v < NV; ++v) simd::store_bf16(o + v * W, simd::fmadd(q[v], simd::set1(d), simd::set1(m)));
      continue;
    }
    for (int v = 0; v < NV; ++v) simd::store(vals + v * W, simd::fmadd(q[v], simd::set1(d), simd::set1(m)));
#else
    block_quants(type, qs, vals);
    for (int j = 0; j < QK; ++j) vals[j] = vals[j] * d + m;
#endif
    if (dtype == 0) {
      std::memcpy(static_cast<float*>(out) + i * QK, vals, sizeof(vals));
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + i * QK;
      for (int j = 0; j < QK; ++j) o[j] = float_to_bf16(vals[j]);
    }
  }
  return 0;
}

}  // extern "C"
