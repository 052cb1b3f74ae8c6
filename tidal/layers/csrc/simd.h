// A few fp32 vector operations over the widest registers the build's ISA level has: AVX-512 (16
// lanes) or AVX2 + FMA (8 lanes), and the conversions to and from bf16 and FP8 E4M3. Kernels written against them build for either level; a build with
// neither (TIDAL_VEC undefined) keeps only the kernels' scalar paths.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TIDAL_VEC 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TIDAL_VEC 8
#endif

namespace simd {

// Working buffers start on a cache line: a 64-byte vector or tile row that straddles two lines costs two
// loads (malloc aligns to 16 bytes). avector<T>: a std::vector whose storage is 64-byte aligned.
template <class T>
struct LineAlloc {
  using value_type = T;
  LineAlloc() = default;
  template <class U>
  LineAlloc(const LineAlloc<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const LineAlloc<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAlloc<U>&) const { return false; }
};
template <class T>
using avector = std::vector<T, LineAlloc<T>>;

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16; float f; std::memcpy(&f, &u, 4); return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// FP8 E4M3 (torch.float8_e4m3fn: bias 7, no infinities, 0x7f/0xff NaN, largest finite 448).
//   from_float: round to nearest even, saturating to +-448 (infinities too), NaN -> 0x7f | sign: torch's
//     conversion (c10 fp8e4m3fn_from_fp32_value), bit for bit, written on the fp32 bits.
//   raw_half_bits: the byte's bits placed in an fp16 (sign to bit 15, exponent and mantissa to bits 13..7)
//     are its value times 2^-8, exactly (fp16's exponent bias is 15, E4M3's 7; subnormals map to
//     subnormals). The vector loads widen so (F16C), and callers fold the 2^8 into a scale they apply
//     anyway. NaN bytes read as 480. In vectors: the byte sign-extended to 16 bits and shifted left by 7
//     has the sign at bits 15 and 14 and the rest at 13..7; clearing bit 14 (and 6..0) leaves the fp16.
namespace e4m3 {
constexpr float kMax = 448.f;
constexpr int32_t kInf = 0x7f800000;
constexpr int32_t kMinNormal = 121 << 23;         // 2^-6 as fp32 bits: below it, E4M3 subnormals
constexpr int32_t kDenormMagic = 141 << 23;       // 2^14: adding it rounds to a multiple of 2^-9 (RNE)
constexpr int32_t kRebias = -(120 << 23) + 0x7ffff;  // exponent 127 -> 7, and rounding to 3 mantissa bits
constexpr int16_t kHalfMask = static_cast<int16_t>(0xbf80);

inline uint8_t from_float(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u, a = u ^ sign;
  uint8_t r;
  if (a > static_cast<uint32_t>(kInf)) {
    r = 0x7f;
  } else if (a >= 0x43e00000u) {  // >= 448 (and infinity): saturate
    r = 0x7e;
  } else if (a < static_cast<uint32_t>(kMinNormal)) {
    float x, magic; std::memcpy(&x, &a, 4);
    const uint32_t m = kDenormMagic; std::memcpy(&magic, &m, 4);
    x += magic;
    uint32_t xb; std::memcpy(&xb, &x, 4);
    r = static_cast<uint8_t>(xb - m);
  } else {
    r = static_cast<uint8_t>((a + static_cast<uint32_t>(kRebias) + ((a >> 20) & 1u)) >> 20);
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

inline uint16_t raw_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}
}  // namespace e4m3

#if TIDAL_VEC == 16
// r[c] <- column c of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15]
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + q]: element q of each 128-bit lane, rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i a_lo = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x44), a_hi = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xee);
    const __m512i b_lo = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x44);
    const __m512i b_hi = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xee);
    r[q] = _mm512_shuffle_i32x4(a_lo, b_lo, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(a_lo, b_lo, 0xdd);
    r[8 + q] = _mm512_shuffle_i32x4(a_hi, b_hi, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(a_hi, b_hi, 0xdd);
  }
}

using vf = __m512;
constexpr int W = 16;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
// the first n < W lanes of a vector: loaded (the others `fill`), stored, added (the others unchanged)
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline vf load_first(const float* p, int64_t n, float fill) { return _mm512_mask_loadu_ps(set1(fill), first_lanes(n), p); }
inline void store_first(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline vf add_first(vf acc, vf v, int64_t n) { return _mm512_mask_add_ps(acc, first_lanes(n), acc, v); }
inline vf load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// W bf16 pairs (32-bit words) as fp32: their first (low) or second (high) halves
template <int HALF> inline vf load_bf16_half(const uint16_t* p) {
  const __m512i w = _mm512_loadu_si512(p);
  if constexpr (HALF == 0) return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  else return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline vf load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512i bf16_bits(vf v) {  // round to nearest even, the bf16 in the high half of each lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
}
inline vf round_bf16(vf v) { return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(0xffff0000))); }
inline void store_bf16(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
inline vf round_nearest(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// 16 E4M3 bytes as fp32, each 2^-8 x its value (see namespace e4m3)
inline vf load_e4m3_raw(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(e4m3::kHalfMask)));
}
inline void store_e4m3(uint8_t* p, vf x) {  // 16 values to E4M3 as e4m3::from_float
  x = _mm512_min_ps(_mm512_set1_ps(e4m3::kMax), _mm512_max_ps(_mm512_set1_ps(-e4m3::kMax), x));  // NaN stays NaN
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_set1_epi32(e4m3::kDenormMagic)))),
      _mm512_set1_epi32(e4m3::kDenormMagic));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i norm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(e4m3::kRebias)), odd), 20);
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(e4m3::kMinNormal)), norm, sub);
  r = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(e4m3::kInf)), r, _mm512_set1_epi32(0x7f));
  r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(r));
}
#elif TIDAL_VEC == 8
using vf = __m256;
constexpr int W = 8;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// the first n < W lanes of a vector: loaded (the others `fill`), stored, added (the others + 0)
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load_first(const float* p, int64_t n, float fill) {
  const __m256i m = first_lanes(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void store_first(float* p, vf v, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
inline vf add_first(vf acc, vf v, int64_t n) {
  return _mm256_add_ps(acc, _mm256_and_ps(_mm256_castsi256_ps(first_lanes(n)), v));
}
inline vf load_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
template <int HALF> inline vf load_bf16_half(const uint16_t* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (HALF == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  else return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline vf load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i bf16_bits(vf v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
}
inline vf round_bf16(vf v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits(v), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store_bf16(uint16_t* p, vf v) {
  const __m256i r = _mm256_srli_epi32(bf16_bits(v), 16);  // each lane <= 0xffff: packus keeps it
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline vf round_nearest(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf p, vf n) {  // p * 2^n for integral n in [-252, 254]: two factors keep each exponent normal
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const vf f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const vf f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
// 8 E4M3 bytes as fp32, each 2^-8 x its value (see namespace e4m3)
inline vf load_e4m3_raw(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(e4m3::kHalfMask)));
}
inline void store_e4m3(uint8_t* p, vf x) {  // 8 values to E4M3 as e4m3::from_float
  x = _mm256_min_ps(_mm256_set1_ps(e4m3::kMax), _mm256_max_ps(_mm256_set1_ps(-e4m3::kMax), x));  // NaN stays NaN
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(bits, sign);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_set1_epi32(e4m3::kDenormMagic)))),
      _mm256_set1_epi32(e4m3::kDenormMagic));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  const __m256i norm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(e4m3::kRebias)), odd), 20);
  __m256i r = _mm256_blendv_epi8(norm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(e4m3::kMinNormal), a));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(e4m3::kInf)));
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
  const __m256i w = _mm256_packus_epi32(r, r);  // per 128-bit half: 4 values as 16 bits, twice
  const __m256i b = _mm256_packus_epi16(w, w);  // ... as bytes: the low 4 bytes of each half
  const int lo = _mm256_cvtsi256_si32(b), hi = _mm256_extract_epi32(b, 4);
  std::memcpy(p, &lo, 4);
  std::memcpy(p + 4, &hi, 4);
}
#endif

#if defined(TIDAL_VEC)
// exp(x), Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp; inputs clamped to
// [-87.3, 88.7] (the softmax passes x <= 0; silu passes any sign).
inline vf exp(vf x) {
  x = max(min(x, set1(88.7f)), set1(-87.3f));
  const vf n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.f)));
  return scale_pow2(p, n);
}

// silu(g) = g / (1 + exp(-g)), in fp32: tidal_silu_and_mul's and the fused gate/up epilogue's (gemm.cpp), one
// definition so that the two give the same bits
inline vf silu(vf g) { return div(g, add(set1(1.f), exp(sub(zero(), g)))); }

template <int HINT = _MM_HINT_T0>
inline void prefetch_bytes(const char* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(p + i, (_mm_hint)HINT);
}
#endif

#if defined(__AVX512BF16__) && defined(__x86_64__)
// AMX (Intel Sapphire Rapids and later): whether this process may run the tile instructions. CPUID leaf 7
// must list AMX-BF16 and AMX-TILE, and Linux must grant the process the tile state (8 KiB per thread,
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), without which the first tile instruction faults.
// TIDAL_AMX=0 says no. Asked once per library; every kernel with an AMX path takes it exactly when this is
// true, so that the kernels whose results must agree bit for bit take the same path in a process.
inline bool detect_amx() {
  const char* env = std::getenv("TIDAL_AMX");
  if (env && std::strcmp(env, "0") == 0) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline bool amx_usable() {
  static const bool ok = detect_amx();
  return ok;
}

// AMX-INT8 as well (the int8 tile products, TDPBSSD and TDPBUSD), where the tiles are in use
inline bool amx_int8_usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return amx_usable() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
  }();
  return ok;
}

// Tile register layouts: `rows` rows of `colsb` bytes for tiles 0-7 (palette 1)
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
#define TIDAL_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define TIDAL_AMX_INT8_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8")))

// LDTILECFG of the whole 64-byte configuration. (GCC 12's _tile_loadconfig tells the compiler it reads only
// the first 8 bytes, so an inlined configuration's colsb and rows stores could be dropped as dead, leaving
// every tile unconfigured: the first tile load faults.)
inline void load_tile_config(const TileConfig& c) { asm volatile("ldtilecfg %0" : : "m"(c)); }
#endif

// GCC 12's _tile_loadd is an asm that takes only its address: the compiler may move (or, with nothing else
// reading the buffer, drop) stores into a buffer past the tile load that reads it. Called between the stores
// into a kernel's own buffer and the tile loads of it.
inline void tiles_see_stores() { asm volatile("" : : : "memory"); }

}  // namespace simd
