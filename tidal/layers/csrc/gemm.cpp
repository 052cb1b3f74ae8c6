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
// It serves weights in the plain layout (MoE expert slices; GGUF rows made in fp32 as they are reached).
//
// tidal_linear_f32_bf16_packed: the same product on a bf16 weight packed at load in tiles of 16 rows
// (every plain bf16 linear, embedding and LM-head weight under fp32 activations): the lanes over weight
// rows, x broadcast (an outer-product micro-kernel, as BLIS's), each output one FMA chain over k in order
// for any M (see packed_f32). No lane reduction and the widening is one instruction per vector: on a Zen 3
// 1.2-1.4x the plain-layout kernel from 64 rows, 1.5-1.8x for one row.
//
// tidal_skinny_gemm_bf16: bf16 activations and weights, bf16 out, M 1..4 (decode of a few requests in
// a bf16 model): VDPBF16PS on AVX-512 BF16, elsewhere the activations are widened and the fp32 path
// above runs.
//
// tidal_gemm_bf16: bf16 activations and weights, bf16 out, any M (prompt chunks, batches of decodes),
// AVX-512 BF16 only: VDPBF16PS with lanes over rows of x, the weight pairs broadcast from the plain
// layout (no repacked copy of the weights), rows independent of each other (see gemm_bf16).
//
// tidal_gemm_bf16_packed: the same product on a bf16 weight packed at load in tiles of 16 rows (every plain
// bf16 linear, embedding and LM-head weight under bf16 activations): the lanes over a tile's weight rows,
// each pair of x broadcast from x, one lane per output summing the K pairs in order, so its bits are
// tidal_gemm_bf16's for any M (skinny_bf16_packed for 1-4 rows, gemm_bf16_cols for more).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "simd.h"

using simd::bf16_to_float;
using simd::float_to_bf16;

// A weight held in another format (GGUF blocks), whose rows a function of a sibling library makes into
// plain rows as the kernels reach them: rows [n0, n0 + rows) as [rows, K] at out, fp32 for the fp32
// path (gguf_gemm.cpp's tidal_gguf_rows_f32), bf16 for the bf16 one (tidal_gguf_rows_bf16).
typedef void (*rows_fn)(const void* w, int format, int64_t n0, int64_t rows, int64_t K, void* out);
struct RowSource {
  rows_fn fn;
  int format;
};

// weight elements: bf16 (widened in registers) when WIDEN, else fp32
template <bool WIDEN> using weight_t = std::conditional_t<WIDEN, uint16_t, float>;

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

template <int MR, bool WIDEN>
static void skinny_f32(const float* x, const weight_t<WIDEN>* w, const float* bias, float* out, int64_t N, int64_t K,
                       int num_threads) {
  constexpr int NR = skinny_nr<MR>();
  const int64_t tiles = N / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR;
    // each weight row is read once, straight from memory: ask for the rows a few tiles ahead
    if (n0 + 4 * NR < N)
      simd::prefetch_bytes(reinterpret_cast<const char*>(w + (n0 + 4 * NR) * K), NR * K * sizeof(*w));
    dot_tile<MR, NR, WIDEN>(x, K, w + n0 * K, K, bias ? bias + n0 : nullptr, out + n0, N);
  }
  for (int64_t n0 = tiles * NR; n0 < N; ++n0)
    dot_tile<MR, 1, WIDEN>(x, K, w + n0 * K, K, bias ? bias + n0 : nullptr, out + n0, N);
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

// With a RowSource (src.fn), w is a weight in another format whose blocks of rows src.fn makes in fp32.
template <bool WIDEN>
static void blocked_f32(const float* x, const weight_t<WIDEN>* w, const float* bias, float* out, int64_t M,
                        int64_t N, int64_t K, int num_threads, RowSource src = {nullptr, 0}) {
  constexpr int NR = kBlockNR;
  // weight rows per block: about 96 KiB of widened weights (L2), a multiple of NR
  const int64_t NB = std::max<int64_t>(NR, std::min<int64_t>(64, (96 * 1024 / (4 * K)) / NR * NR));
  const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> wf(WIDEN || src.fn ? NB * K : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * NB, nb = std::min(NB, N - n0);
      const float* block;
      if (src.fn) {
        src.fn(w, src.format, n0, nb, K, wf.data());
        block = wf.data();
      } else if constexpr (WIDEN) {
        const uint16_t* src = w + n0 * K;
        int64_t i = 0;
        for (; i + W <= nb * K; i += W) simd::store(wf.data() + i, simd::load_bf16(src + i));
        for (; i < nb * K; ++i) wf[i] = bf16_to_float(src[i]);
        block = wf.data();
      } else {
        block = w + n0 * K;  // fp32 weights: read in place
      }
      int64_t r = 0;
      for (; r + NR <= nb; r += NR)
        rows_tile<NR>(x, M, block + r * K, K, bias ? bias + n0 + r : nullptr, out + n0 + r, N);
      for (; r < nb; ++r) rows_tile<1>(x, M, block + r * K, K, bias ? bias + n0 + r : nullptr, out + n0 + r, N);
    }
  }
}
#endif

#if defined(TIDAL_VEC)
// ---- fp32 activations x bf16 weights packed at load (tidal.layers.cpu_kernels.pack_bf16_weight) ----
// Outer-product form: the vector lanes run over weight rows (output columns) and each value of x is
// broadcast, so every output is one fp32 FMA chain over k = 0, 1, ..., K - 1 starting from zero, then
// + bias, in one lane: no lane reduction, and the same chain whatever M is, however the rows of x are
// grouped into register tiles and however many weight tiles a tile spans, so a row's result never
// depends on the other rows of the call. A packed tile of 16 weight rows holds pair p of row i at
// w32[p * 16 + i] (lo half w[i, 2p], hi half w[i, 2p + 1]): widened in registers by a shift (even k)
// and a mask (odd k), one instruction per vector.
namespace packed_f32 {
constexpr int H = 16 / W;  // vectors per tile of 16 weight rows
#if TIDAL_VEC == 16
using vi = __m512i;
static inline vi load_words(const uint32_t* p) { return _mm512_loadu_si512(p); }
static inline vf even(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline vf odd(vi v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u)))); }
#else
using vi = __m256i;
static inline vi load_words(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline vf even(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline vf odd(vi v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u)))); }
#endif

// MR rows of x (stride ldx) by NT consecutive packed tiles from w (tile stride tstride words):
// out[m * ldo + c] (+ bias[c]) for output columns c < nn <= 16 * NT.
template <int MR, int NT>
static inline void tile(const float* x, int64_t ldx, const uint32_t* w, int64_t tstride, int64_t K,
                        const float* bias, float* out, int64_t ldo, int nn) {
  constexpr int J = NT * H;
  vf acc[MR][J];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < J; ++j) acc[m][j] = simd::zero();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* wp = w + p * 16;
    vf wv[J];
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < H; ++h) wv[t * H + h] = even(load_words(wp + t * tstride + h * W));
    for (int m = 0; m < MR; ++m) {
      const vf xb = simd::set1(x[m * ldx + 2 * p]);
      for (int j = 0; j < J; ++j) acc[m][j] = simd::fmadd(xb, wv[j], acc[m][j]);
    }
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < H; ++h) wv[t * H + h] = odd(load_words(wp + t * tstride + h * W));
    for (int m = 0; m < MR; ++m) {
      const vf xb = simd::set1(x[m * ldx + 2 * p + 1]);
      for (int j = 0; j < J; ++j) acc[m][j] = simd::fmadd(xb, wv[j], acc[m][j]);
    }
  }
  if (K % 2) {  // the last pair's even half (its odd half is padding)
    const uint32_t* wp = w + pairs * 16;
    vf wv[J];
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < H; ++h) wv[t * H + h] = even(load_words(wp + t * tstride + h * W));
    for (int m = 0; m < MR; ++m) {
      const vf xb = simd::set1(x[m * ldx + K - 1]);
      for (int j = 0; j < J; ++j) acc[m][j] = simd::fmadd(xb, wv[j], acc[m][j]);
    }
  }
  if (nn == 16 * NT) {
    for (int j = 0; j < J; ++j) {
      const vf b = bias ? simd::load(bias + j * W) : simd::zero();
      for (int m = 0; m < MR; ++m) simd::store(out + m * ldo + j * W, simd::add(acc[m][j], b));
    }
    return;
  }
  alignas(64) float row[16 * NT];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < J; ++j) simd::store(row + j * W, acc[m][j]);
    for (int c = 0; c < nn; ++c) out[m * ldo + c] = row[c] + (bias ? bias[c] : 0.f);
  }
}

// register tiles: MR rows of x by NT weight tiles, MR * NT * H accumulators, the rest of the registers for
// the widened weights, the broadcast and the mask (more accumulators spill on AVX2: measured on a Zen 3,
// 5 x 1 runs SmolLM2's products at 188-198 GFLOP/s from 64 rows, 6 x 1 at 130)
constexpr int kMR = W == 16 ? 8 : 5;
template <int M> constexpr int skinny_nt() { return W == 16 ? (M == 1 ? 8 : M == 2 ? 4 : 2) : (M == 1 ? 4 : M == 2 ? 2 : 1); }

// 1-4 rows (decodes): every tile of the weight streamed once from memory, NT tiles at a time
template <int M>
static void skinny(const float* x, const uint32_t* w, const float* bias, float* out, int64_t N, int64_t K,
                   int num_threads) {
  constexpr int NT = skinny_nt<M>();
  const int64_t tstride = (K + 1) / 2 * 16, tiles = (N + 15) / 16, groups = tiles / NT;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n0 = g * NT * 16;
      tile<M, NT>(x, K, w + g * NT * tstride, tstride, K, bias ? bias + n0 : nullptr, out + n0, N,
                  (int)std::min<int64_t>(16 * NT, N - n0));
    }
#pragma omp for schedule(static)
    for (int64_t t = groups * NT; t < tiles; ++t) {
      const int64_t n0 = t * 16;
      tile<M, 1>(x, K, w + t * tstride, tstride, K, bias ? bias + n0 : nullptr, out + n0, N,
                 (int)std::min<int64_t>(16, N - n0));
    }
  }
}

template <int MR>
static inline void tile_of_rows(int mr, const float* x, const uint32_t* wt, int64_t tstride, int64_t K,
                                const float* bias, float* out, int64_t N, int nn) {
  if (mr == MR) tile<MR, 1>(x, K, wt, tstride, K, bias, out, N, nn);
  else if constexpr (MR > 1) tile_of_rows<MR - 1>(mr, x, wt, tstride, K, bias, out, N, nn);
}

// M rows against one weight tile, in as few register tiles as kMR allows, their rows spread evenly (6 rows:
// 3 + 3, 16: 4 x 4, not 5 + 1 and 5 + 5 + 5 + 1): a tile of MR rows has MR * H independent FMA chains, and
// under the FMA's latency x its throughput (8 on AVX2, 4 on AVX-512) it runs at a fraction of the peak (a
// 1-row tile took nearly as long as a 5-row one). Each row's outputs are the same chains in any tile.
static inline void rows_of_tile(const float* x, int64_t M, const uint32_t* wt, int64_t tstride, int64_t K,
                                const float* bias, float* out, int64_t N, int nn) {
  const int64_t tiles = (M + kMR - 1) / kMR, base = M / tiles, extra = M % tiles;
  for (int64_t i = 0, m = 0; i < tiles; ++i) {
    const int mr = static_cast<int>(base + (i < extra));
    tile_of_rows<kMR>(mr, x + m * K, wt, tstride, K, bias, out + m * N, N, nn);
    m += mr;
  }
}

// the rows of x a chunk of `blocked` (and `blocked_silu`) holds: ~256 KiB of fp32 rows, whole register tiles
static inline int64_t chunk_rows(int64_t K) { return std::max<int64_t>(kMR, (256 * 1024) / (4 * K) / kMR * kMR); }

// more rows: chunks of rows of x that stay in L2 while every weight tile (in L1) passes over them. The tiles
// are handed out in shrinking chunks (guided), so a thread slowed down (another tenant of the machine, an
// interrupt) leaves the other less to wait for: with equal static shares the engine's two threads spent 6% of
// their time waiting at the end of a product (perf, 64 requests of 256 -> 128 tokens on a Zen 3), 2% now
static void blocked(const float* x, const uint32_t* w, const float* bias, float* out, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
  const int64_t tstride = (K + 1) / 2 * 16, tiles = (N + 15) / 16;
  const int64_t chunk = chunk_rows(K);
#pragma omp parallel num_threads(num_threads)
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t mc = std::min(chunk, M - m0);
#pragma omp for schedule(guided) nowait
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * 16;
      rows_of_tile(x + m0 * K, mc, w + t * tstride, tstride, K, bias ? bias + n0 : nullptr, out + m0 * N + n0, N,
                   (int)std::min<int64_t>(16, N - n0));
    }
  }
}

// blocked for a gate/up product [gate; up] (N = 2 I, I a multiple of 16) with silu-and-mul after each pair of
// tiles: gate tile t and up tile I / 16 + t over a chunk of rows into two small buffers (L1), then
// out[:, 16 t .. 16 t + 16) = silu(gate) * up as tidal_silu_and_mul computes it in fp32 (simd::silu, one
// multiply): the bits of the product followed by silu-and-mul, without writing and reading back the [M, N]
// product. out [M, I].
static void blocked_silu(const float* x, const uint32_t* w, const float* bias, float* out, int64_t M, int64_t N,
                         int64_t K, int num_threads) {
  const int64_t tstride = (K + 1) / 2 * 16, cols = N / 2, gate_tiles = cols / 16;
  const int64_t chunk = chunk_rows(K), most = std::min(chunk, M);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> buf(size_t(2 * 16 * most));
    float* const g = buf.data();
    float* const u = g + 16 * most;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t mc = std::min(chunk, M - m0);
#pragma omp for schedule(guided) nowait
      for (int64_t t = 0; t < gate_tiles; ++t) {
        const int64_t n0 = t * 16;
        rows_of_tile(x + m0 * K, mc, w + t * tstride, tstride, K, bias ? bias + n0 : nullptr, g, 16, 16);
        rows_of_tile(x + m0 * K, mc, w + (gate_tiles + t) * tstride, tstride, K, bias ? bias + cols + n0 : nullptr,
                     u, 16, 16);
        for (int64_t r = 0; r < mc; ++r)
          for (int h = 0; h < H; ++h)
            simd::store(out + (m0 + r) * cols + n0 + h * W,
                        simd::mul(simd::silu(simd::load(g + r * 16 + h * W)), simd::load(u + r * 16 + h * W)));
      }
    }
  }
}

static void linear(const float* x, const uint32_t* w, const float* bias, float* out, int64_t M, int64_t N,
                   int64_t K, int num_threads) {
  switch (M) {
    case 1: skinny<1>(x, w, bias, out, N, K, num_threads); return;
    case 2: skinny<2>(x, w, bias, out, N, K, num_threads); return;
    case 3: skinny<3>(x, w, bias, out, N, K, num_threads); return;
    case 4: skinny<4>(x, w, bias, out, N, K, num_threads); return;
    default: blocked(x, w, bias, out, M, N, K, num_threads); return;
  }
}
}  // namespace packed_f32
#endif

#if defined(TIDAL_VEC) && defined(__AVX2__)
// Greedy screen: the argmax of a row's logits x W^T over W's first n_valid rows (the first index of the
// largest, as argmax_rows gives on tidal_linear_f32_bf16_packed's output) without the whole fp32 product.
// An int8 copy of W (per-row scales) against x in int16 (one scale per row of x) gives every logit
// approximately through VPMADDWD (16 multiply-adds an instruction, twice an FMA's 8), and a bound on how
// far each approximation can be from the fp32 product's value:
//     |x . w - xq . wq| <= |w - wq| |x| + |wq| |x - xq|,   |fp32 chain - x . w| <= ~K 2^-24 |w| |x|,
// folded at load into two numbers per weight row (a = |w - wq| + c |w|, b = |wq|), so the bound of row v is
// a[v] |x| + b[v] |x - xq|. Every output whose upper bound reaches the largest lower bound is a candidate
// (the argmax always is: its fp32 value is at least that lower bound); the candidates' 16-row tiles are then
// computed by the fp32 kernel itself (tile<1, 1>: the same FMA chains, the same bits) and the argmax taken
// over them. On SmolLM2's head the greedy rows of a serving batch leave ~12 candidates of 49,152 on average.
namespace screen {
constexpr int kMaxMR = 5;  // 5 rows x 2 vectors of accumulators, 2 weight vectors, a broadcast, a product: 14 of 16

// MR rows of xq (int16 pairs as int32, stride ldq pairs) against one int8 tile of 16 weight rows
// (pairs of k interleaved: 32 bytes per pair): out[m * 16 + c], the integer dot products
template <int MR>
static inline void int_tile(const int32_t* xq, int64_t ldq, const int8_t* wt, int64_t pairs, int32_t* out) {
  __m256i acc[MR][2];  // (local: an array the caller reads would be kept in memory through the loop)
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wt + p * 32)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wt + p * 32 + 16)));
    for (int m = 0; m < MR; ++m) {
      const __m256i b = _mm256_set1_epi32(xq[m * ldq + p]);
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(w0, b));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(w1, b));
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * 16), acc[m][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * 16 + 8), acc[m][1]);
  }
}

struct Rows {  // per row of x: its int16 pairs, scale, |x|, |x - xq|
  const int32_t* xq;
  int64_t ldq;
  const float* scale;
  const float* norm;
  const float* err;
};

// the approximations of MR rows x one tile: each row's largest lower bound so far
// (lo, 8 lanes) and the tile's largest upper bound per row (hi[m * tiles + t]); nn valid outputs in the tile
template <int MR>
static inline void approx_tile(const Rows& r, int64_t m0, const int8_t* wt, int64_t pairs, const float* ws,
                               const float* a, const float* b, int nn, float* lo,
                               float* hi, int64_t tiles, int64_t t) {
  alignas(32) int32_t acc[MR * 16];
  int_tile<MR>(r.xq + m0 * r.ldq, r.ldq, wt, pairs, acc);
  for (int m = 0; m < MR; ++m) {
    const int64_t row = m0 + m;
    const float xs = r.scale[row], xn = r.norm[row], xe = r.err[row];
    alignas(32) float lo_v[16], hi_v[16];
    for (int h = 0; h < 2; ++h) {
      const __m256 av = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc + m * 16 + h * 8))), _mm256_set1_ps(xs)),
                                      _mm256_loadu_ps(ws + h * 8));
      // the bound, widened by 2^-10 for its own rounding
      const __m256 bound = _mm256_mul_ps(
          _mm256_fmadd_ps(_mm256_loadu_ps(a + h * 8), _mm256_set1_ps(xn),
                          _mm256_mul_ps(_mm256_loadu_ps(b + h * 8), _mm256_set1_ps(xe))),
          _mm256_set1_ps(1.0f + 1.0f / 1024));
      _mm256_store_ps(lo_v + h * 8, _mm256_sub_ps(av, bound));
      _mm256_store_ps(hi_v + h * 8, _mm256_add_ps(av, bound));
    }
    if (nn == 16) {
      _mm256_storeu_ps(lo + row * 8, _mm256_max_ps(_mm256_loadu_ps(lo + row * 8),
                                                   _mm256_max_ps(_mm256_load_ps(lo_v), _mm256_load_ps(lo_v + 8))));
      const __m256 hv = _mm256_max_ps(_mm256_load_ps(hi_v), _mm256_load_ps(hi_v + 8));
      __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(hv), _mm256_extractf128_ps(hv, 1));
      h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
      h4 = _mm_max_ss(h4, _mm_shuffle_ps(h4, h4, 1));
      hi[row * tiles + t] = _mm_cvtss_f32(h4);
    } else {  // the last tile: only its valid outputs count
      float hmax = -INFINITY;
      for (int c = 0; c < nn; ++c) {
        lo[row * 8 + c % 8] = std::max(lo[row * 8 + c % 8], lo_v[c]);
        hmax = std::max(hmax, hi_v[c]);
      }
      hi[row * tiles + t] = hmax;
    }
  }
}

template <int MR>
static inline void approx_rows(int mr, const Rows& r, int64_t m0, const int8_t* wt, int64_t pairs, const float* ws,
                               const float* a, const float* b, int nn, float* lo,
                               float* hi, int64_t tiles, int64_t t) {
  if (mr == MR) approx_tile<MR>(r, m0, wt, pairs, ws, a, b, nn, lo, hi, tiles, t);
  else if constexpr (MR > 1) approx_rows<MR - 1>(mr, r, m0, wt, pairs, ws, a, b, nn, lo, hi, tiles, t);
}
}  // namespace screen

// x [M, K] fp32; wpk the packed bf16 weight (tidal_linear_f32_bf16_packed's); wq its int8 copy in tiles
// ([tiles, pairs, 16, 2]), ws the int8 rows' scales, a and b the bound's terms (all [tiles * 16]).
// Returns 0 with argmax[m] set, -1 when it does not apply (x not finite, K too large for int32 sums, a
// candidate's logit not finite).
static int greedy(const float* x, const uint32_t* wpk, const int8_t* wq, const float* ws, const float* a,
                  const float* b, int64_t M, int64_t N, int64_t K, int64_t n_valid, int num_threads, int64_t* argmax) {
  n_valid = std::min(n_valid, N);
  const int64_t pairs = (K + 1) / 2, tiles = (n_valid + 15) / 16, tstride = pairs * 16;
  // x's integer range: |sum| <= 2 * pairs * 127 * qmax < 2^31
  const int64_t qmax = std::min<int64_t>(16383, (int64_t(1) << 31) / (2 * pairs * 127 + 1) - 1);
  if (qmax < 64 || M < 1 || n_valid < 1) return -1;
  std::vector<int32_t> xq(M * pairs);
  std::vector<float> scale(M), norm(M), err(M);
  int bad = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : bad)
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      if (!std::isfinite(xm[k])) bad = 1;
      amax = std::max(amax, std::fabs(xm[k]));
    }
    const float s = amax > 0.f && std::isfinite(amax) ? amax / float(qmax) : 1.f;
    double n2 = 0, e2 = 0;
    auto q16 = reinterpret_cast<int16_t*>(xq.data() + m * pairs);
    for (int64_t k = 0; k < 2 * pairs; ++k) {
      const float v = k < K ? xm[k] : 0.f;
      const float q = std::min(float(qmax), std::max(-float(qmax), std::nearbyint(v / s)));
      q16[k] = static_cast<int16_t>(q);
      const double e = double(v) - double(q) * double(s);
      n2 += double(v) * v;
      e2 += e * e;
    }
    scale[m] = s;
    // rounded up: the bound must not shrink in float
    norm[m] = std::nextafter(float(std::sqrt(n2)), INFINITY);
    err[m] = std::nextafter(float(std::sqrt(e2)), INFINITY);
  }
  if (bad) return -1;
  const screen::Rows rows{xq.data(), pairs, scale.data(), norm.data(), err.data()};
  // each tile's largest upper bound per row, in a buffer kept between calls (the caller's thread's: the
  // parallel region below reaches it through the pointer)
  thread_local std::vector<float> hi_buf;
  if (hi_buf.size() < size_t(M * tiles)) hi_buf.resize(M * tiles);
  float* const hi = hi_buf.data();
  // each thread's largest lower bound per row, 8 lanes a row
  std::vector<float> lo_all(size_t(num_threads) * M * 8, -INFINITY);
  int nonfinite = 0;
  const int64_t rtiles = (M + screen::kMaxMR - 1) / screen::kMaxMR, base = M / rtiles, extra = M % rtiles;
#pragma omp parallel num_threads(num_threads)
  {
    float* lo = lo_all.data() + size_t(omp_get_thread_num()) * M * 8;
#pragma omp for schedule(guided)
    for (int64_t t = 0; t < tiles; ++t) {
      const int nn = static_cast<int>(std::min<int64_t>(16, n_valid - t * 16));
      for (int64_t i = 0, m = 0; i < rtiles; ++i) {
        const int mr = static_cast<int>(base + (i < extra));
        screen::approx_rows<screen::kMaxMR>(mr, rows, m, wq + t * pairs * 32, pairs, ws + t * 16, a + t * 16,
                                            b + t * 16, nn, lo, hi, tiles, t);
        m += mr;
      }
    }
#pragma omp for schedule(dynamic) reduction(| : nonfinite)
    for (int64_t m = 0; m < M; ++m) {
      float lb = -INFINITY;
      for (int th = 0; th < num_threads; ++th)
        for (int j = 0; j < 8; ++j) lb = std::max(lb, lo_all[(size_t(th) * M + m) * 8 + j]);
      if (!std::isfinite(lb)) lb = -INFINITY;  // (approximations out of fp32's range: every tile is a candidate)
      float best = -INFINITY;
      int64_t best_i = -1;
      alignas(64) float row[16];
      for (int64_t t = 0; t < tiles; ++t) {
        if (!(hi[m * tiles + t] >= lb)) continue;
        const int nn = static_cast<int>(std::min<int64_t>(16, n_valid - t * 16));
        packed_f32::tile<1, 1>(x + m * K, K, wpk + t * tstride, tstride, K, nullptr, row, 16, 16);
        for (int c = 0; c < nn; ++c) {
          if (!std::isfinite(row[c])) nonfinite = 1;  // logits out of fp32's range: the caller's argmax decides
          if (row[c] > best || best_i < 0) {
            best = row[c];
            best_i = t * 16 + c;
          }
        }
      }
      argmax[m] = best_i;
    }
  }
  return nonfinite ? -1 : 0;
}
#endif

// fp32 activations against bf16 weights (WIDEN) or fp32 weights: every output one fp32 dot product in the
// same order whatever M is (see dot_tile), so a row's result never depends on the other rows.
template <bool WIDEN>
static void linear_f32(const float* x, const weight_t<WIDEN>* w, const float* bias, float* out, int64_t M,
                       int64_t N, int64_t K, int num_threads) {
#if defined(TIDAL_VEC)
  if (M > kSkinnyMaxRows) {
    // chunks of rows whose activations stay in L2 while every weight block passes over them
    const int64_t chunk = std::max<int64_t>(kSkinnyMaxRows + 1, (256 * 1024) / (4 * K));
    for (int64_t m0 = 0; m0 < M; m0 += chunk)
      blocked_f32<WIDEN>(x + m0 * K, w, bias, out + m0 * N, std::min(chunk, M - m0), N, K, num_threads);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {  // up to two passes of up to four rows over the streamed weights
    const float* xm = x + m0 * K;
    float* om = out + m0 * N;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: skinny_f32<1, WIDEN>(xm, w, bias, om, N, K, num_threads); break;
      case 2: skinny_f32<2, WIDEN>(xm, w, bias, om, N, K, num_threads); break;
      case 3: skinny_f32<3, WIDEN>(xm, w, bias, om, N, K, num_threads); break;
      default: skinny_f32<4, WIDEN>(xm, w, bias, om, N, K, num_threads); break;
    }
  }
#else
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        if constexpr (WIDEN) s += x[m * K + k] * bf16_to_float(w[n * K + k]);
        else s += x[m * K + k] * w[n * K + k];
      }
      out[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
#endif
}

static void linear_f32_bf16w(const float* x, const uint16_t* w, const float* bias, float* out, int64_t M,
                             int64_t N, int64_t K, int num_threads) {
  linear_f32<true>(x, w, bias, out, M, N, K, num_threads);
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

#if defined(__AVX512BF16__)
// ---- bf16 activations x bf16 weights, any number of rows (prompt chunks, batches of decodes) ----
// VDPBF16PS with the vector lanes over rows of x: each lane holds the bf16 pair (x[m, 2p], x[m, 2p+1])
// of one row m and is multiplied by the pair (w[n, 2p], w[n, 2p+1]) of one weight row, broadcast
// straight from the plain [N, K] weight. So the weights need no repacked copy: only x, M * K values
// per call, is reordered (into groups of 16 rows, pair-interleaved: [K2][16]), and the 16 x 16 tile
// of outputs is transposed once at the end. Each output is one fp32 lane accumulating the pairs in k
// order, whatever M is and wherever the row sits in its group, so a row's result never depends on the
// other rows of the call; bias is added in fp32, then one rounding to bf16 (nearest even).


// rows [m0, m0 + 16) of x (those < M; the others zero) as xg[p * 16 + r] = pair p of row m0 + r, p < K2p
// (a multiple of 16; pairs past K, and the missing half of an odd K's last pair, are zero)
static void pack_group(const uint16_t* x, int64_t M, int64_t K, int64_t m0, int64_t K2p, uint32_t* xg) {
  for (int64_t p0 = 0; p0 < K2p; p0 += 16) {
    const int64_t k0 = 2 * p0;
    const __mmask32 mask = k0 >= K ? 0 : K - k0 >= 32 ? ~__mmask32(0) : (__mmask32)((1u << (K - k0)) - 1);
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = m0 + i < M ? _mm512_maskz_loadu_epi16(mask, x + (m0 + i) * K + k0) : _mm512_setzero_si512();
    simd::transpose16x16(r);
    for (int q = 0; q < 16; ++q) _mm512_storeu_si512(xg + (p0 + q) * 16, r[q]);
  }
}

// 16 fp32 outputs plus the bias, rounded to bf16 (nearest even, NaN kept NaN): each lane's low 16 bits
static inline __m512i rounded_bits(__m512 v, __m512 bias) {
  v = _mm512_add_ps(v, bias);
  const __m512i bits = _mm512_srli_epi32(simd::bf16_bits(v), 16);
  return _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// 16 fp32 outputs (one row's, columns [n0, n0 + nn)) plus the bias, rounded (rounded_bits) and stored at dst
static inline void store_row(__m512 v, __m512 bias, __mmask16 nmask, uint16_t* dst) {
  _mm256_mask_storeu_epi16(dst, nmask, _mm512_cvtepi32_epi16(rounded_bits(v, bias)));
}

static inline __m512 load_bias(const uint16_t* bias, int64_t n0, __mmask16 nmask) {
  if (!bias) return _mm512_setzero_ps();
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(nmask, bias + n0)), 16));
}

// ---- AMX: the same products on Intel's tile units (Sapphire Rapids and later) ----
// Where the CPU has AMX-BF16 (and the kernel grants the process its tile state), every bf16-activation
// product of this file that must agree with the others bit for bit (tidal_gemm_bf16 and its ordered
// skinny form, the packed kernels, the GGUF rows path) runs on the tiles instead: TDPBF16PS multiplies a
// 16 x 32 tile of x by a 32 x 16 tile of the weight (the packed layout's pairs are the tile layout) into
// 16 x 16 fp32 sums, 16x the work of a VDPBF16PS. Each output accumulates its K in chunks of 32 in k
// order from zero, the chunks past K zero-padded on both sides, whatever M is and wherever its row sits,
// so a row's bits still never depend on the batch; they are not VDPBF16PS's bits (the tile unit rounds
// inside a chunk its own way), so one process takes one path for all of them: AMX when usable(), else
// VDPBF16PS. TIDAL_AMX=0 turns it off (the kernels of a CPU without AMX, for comparisons).
namespace amx {

static bool usable() { return simd::amx_usable(); }

using simd::TileConfig;

// every tile 64 bytes a row: tmm0-3 sums (2 x 2 blocks of 16 x 16 fp32) and tmm4-5 x of `rows` rows (16, or
// fewer for a product of fewer rows), tmm6-7 weights of 16
TIDAL_AMX_TARGET static void configure(int rows = 16) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = t < 6 ? rows : 16;
  simd::load_tile_config(c);
}

TIDAL_AMX_TARGET static void release() { _tile_release(); }

// RB groups of 16 rows of x (a0, a1: bf16 rows lda apart, 32 * chunks values each) against NB weight tiles
// (b0, b1: 16 pairs x 16 columns per chunk, 256 words a chunk) into the sum tiles, left there (store_tiles
// takes them out). between(ch) runs after chunk ch's products are issued: vector work (the block before's
// epilogue, a few rows a chunk) that the core does while the tiles compute. Spread over the chunks, it
// overlaps them; run whole after the block, its instructions queued behind the tile instructions and
// overlapped far less (docs/cpu.md: gate/up with SiLU at 2,048 rows 3.5 -> 3.1 ms).
// The operand a block uses once is loaded with TILELOADDT1 (kept out of L1), so that it does not evict the
// one that stays there for the blocks after: STREAM_B, the weight tiles, where a block of x stays in L1 for a
// group of weight pairs that come from L2 (gemm's wide order: 30 layers of SmolLM2's products at 2,048 rows
// 194-197 -> 158-164 ms on the AMX Xeon); otherwise x's tiles, where a pair's weights stay in L1 for the
// panel's blocks of rows (the narrow order: the same products at 64 rows, in the engine's decode steps,
// 11.30-11.39 -> 11.04-11.13 ms)
template <int RB, int NB, bool STREAM_B, class Between>
TIDAL_AMX_TARGET static void tile_block(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint32_t* b0,
                                        const uint32_t* b1, int64_t chunks, Between&& between) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (RB > 1) _tile_zero(2);
  if (RB > 1 && NB > 1) _tile_zero(3);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    if constexpr (STREAM_B) _tile_loadd(4, a0 + ch * 32, lda * 2);
    else _tile_stream_loadd(4, a0 + ch * 32, lda * 2);
    if constexpr (STREAM_B) _tile_stream_loadd(6, b0 + ch * 256, 64);
    else _tile_loadd(6, b0 + ch * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) {
      if constexpr (STREAM_B) _tile_stream_loadd(7, b1 + ch * 256, 64);
      else _tile_loadd(7, b1 + ch * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (RB > 1) {
      if constexpr (STREAM_B) _tile_loadd(5, a1 + ch * 32, lda * 2);
      else _tile_stream_loadd(5, a1 + ch * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
    between(ch);
  }
}

// tile_block's sums into c (fp32, 32 columns a row)
template <int RB, int NB>
TIDAL_AMX_TARGET static void store_tiles(float* c) {
  _tile_stored(0, c, 128);
  if (NB > 1) _tile_stored(1, c + 16, 128);
  if (RB > 1) _tile_stored(2, c + 16 * 32, 128);
  if (RB > 1 && NB > 1) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// Where the weight tiles come from: the packed layout (PACKED), the plain [N, K] rows (PLAIN), or rows of
// another format made plain 16 at a time (ROWS, src). tile() gives tile t as `chunks` chunks of 16 pairs x
// 16 columns, zero past K and past N: the packed tile itself when K is a multiple of 32, else a copy.
struct Weights {
  enum Kind { PACKED, PLAIN, ROWS } kind;
  const void* w;
  RowSource src;
  int64_t N, K;

  const uint32_t* tile(int64_t t, uint32_t* buf, uint16_t* rows) const {
    const int64_t pairs = (K + 1) / 2, chunks = (K + 31) / 32;
    if (kind == PACKED) {
      const uint32_t* p = static_cast<const uint32_t*>(w) + t * pairs * 16;
      if (K % 32 == 0) return p;
      std::memcpy(buf, p, pairs * 16 * 4);
      std::memset(buf + pairs * 16, 0, (chunks * 16 - pairs) * 16 * 4);
      simd::tiles_see_stores();
      return buf;
    }
    const int64_t n0 = t * 16;
    const int nn = (int)std::min<int64_t>(16, N - n0);
    const uint16_t* wt = static_cast<const uint16_t*>(w) + n0 * K;
    if (kind == ROWS) {
      src.fn(w, src.format, n0, nn, K, rows);
      wt = rows;
    }
    for (int64_t p0 = 0; p0 < chunks * 16; p0 += 16) {  // 16 pairs of the 16 rows: one transpose
      const int64_t k0 = 2 * p0;
      const __mmask32 mask = k0 >= K ? 0 : K - k0 >= 32 ? ~__mmask32(0) : (__mmask32)((1u << (K - k0)) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < nn ? _mm512_maskz_loadu_epi16(mask, wt + i * K + k0) : _mm512_setzero_si512();
      simd::transpose16x16(r);  // r[q] lane i: pair p0 + q of weight row n0 + i
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(buf + (p0 + q) * 16, r[q]);
    }
    simd::tiles_see_stores();
    return buf;
  }
};

// store_row's 32 outputs for two tiles side by side: one 64-byte row
static inline __m512i rounded_pair(__m512 lo, __m512 hi, __m512 bias_lo, __m512 bias_hi) {
  const __m512i idx = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24,
                                       22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);  // the low halves of both
  return _mm512_permutex2var_epi16(rounded_bits(lo, bias_lo), idx, rounded_bits(hi, bias_hi));
}

// rows [m0, m0 + rows) of the fp32 sums c (32 columns a row) plus bias, rounded, into out's columns
// [n0, n0 + 16 nb) (those < N). stream: 64-byte rows go around the caches (non-temporal stores: no read of
// the line first), for outputs far larger than L2 (the caller fences before the outputs are read)
static void store_block(const float* c, int64_t rows, int nb, const uint16_t* bias, uint16_t* out, int64_t N,
                        int64_t m0, int64_t n0, bool stream = false) {
  if (nb == 2 && n0 + 32 <= N) {  // 32 whole columns: one 64-byte store a row
    const __m512 b0 = load_bias(bias, n0, 0xffff), b1 = load_bias(bias, n0 + 16, 0xffff);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i v = rounded_pair(_mm512_loadu_ps(c + r * 32), _mm512_loadu_ps(c + r * 32 + 16), b0, b1);
      uint16_t* dst = out + (m0 + r) * N + n0;
      if (stream && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
      else _mm512_storeu_si512(dst, v);
    }
    return;
  }
  for (int j = 0; j < nb; ++j) {
    const int64_t n = n0 + 16 * j;
    if (n >= N) break;
    const __mmask16 nmask = (__mmask16)((1u << std::min<int64_t>(16, N - n)) - 1);
    const __m512 b = load_bias(bias, n, nmask);
    for (int64_t r = 0; r < rows; ++r) store_row(_mm512_loadu_ps(c + r * 32 + 16 * j), b, nmask, out + (m0 + r) * N + n);
  }
}

// The fused gate/up epilogue (gemm's silu_cols): rows [m0, m0 + rows) of a block whose two tiles are gate
// columns [n0, n0 + 16) and the up columns of the same index (c: 32 fp32 sums a row, gate then up), each
// plus its bias and rounded as store_row rounds, then silu(gate) * up as tidal_silu_and_mul computes it from
// those stored values (s = round(g / (1 + exp(-g))); round(s * u)), into out's columns [n0, n0 + 16), rows
// `cols` apart: the same bits as the product followed by silu-and-mul, without the product's output. (Not
// streamed: half a line per row and block, which the write-combining buffers would flush half full.)
static void store_block_silu(const float* c, int64_t rows, const uint16_t* bias, uint16_t* out, int64_t cols,
                             int64_t m0, int64_t n0) {
  const __m512 bg = load_bias(bias, n0, 0xffff), bu = load_bias(bias, cols + n0, 0xffff);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(rounded_bits(_mm512_loadu_ps(c + r * 32), bg), 16));
    const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(rounded_bits(_mm512_loadu_ps(c + r * 32 + 16), bu), 16));
    const __m512 s = simd::round_bf16(simd::silu(g));
    const __m256i v = _mm512_cvtepi32_epi16(_mm512_srli_epi32(simd::bf16_bits(_mm512_mul_ps(s, u)), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + r) * cols + n0), v);
  }
}

// Greedy rows (gemm's argmax): a thread's running argmax of each row of x over the columns it has computed,
// in the order it computes them (ascending, for a row: see gemm)
struct RowArgmax {
  float* val;     // [M]: the largest output so far, as stored (rounded)
  int64_t* idx;   // [M]: its column, -1 while none (every one NaN so far)
  int64_t n_valid;  // columns from here on are left out (a padded vocabulary)
};

// rows [m0, m0 + rows) of the fp32 sums c (32 columns a row, nb tiles from column n0) plus bias, rounded as
// store_block rounds them, into each row's running argmax: the first column of the largest, NaN never
// winning, as argmax_rows finds it on the stored outputs
static void argmax_block(const float* c, int64_t rows, int nb, const uint16_t* bias, int64_t N, int64_t m0,
                         int64_t n0, RowArgmax& a) {
  for (int j = 0; j < nb; ++j) {  // (a row's first tile before its second: ascending columns)
    const int64_t n = n0 + 16 * j;
    if (n >= a.n_valid) break;
    const __mmask16 valid = (__mmask16)((1u << std::min<int64_t>(16, a.n_valid - n)) - 1);
    const __m512 b = load_bias(bias, n, (__mmask16)((1u << std::min<int64_t>(16, N - n)) - 1));
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(rounded_bits(_mm512_loadu_ps(c + r * 32 + 16 * j), b), 16));
      const __mmask16 ord = valid & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
      if (!ord) continue;
      const float top = _mm512_mask_reduce_max_ps(ord, v);
      const unsigned first = (unsigned)__builtin_ctz(ord & _mm512_cmp_ps_mask(v, _mm512_set1_ps(top), _CMP_EQ_OQ));
      const int64_t row = m0 + r;
      if (a.idx[row] < 0 || top > a.val[row]) a.val[row] = top, a.idx[row] = n + first;
    }
  }
}

// One 32 x 32 block of the output through the tiles, with the epilogue of the block before overlapped:
// the sums of block (g, t0) (rb groups of 16 rows of x, nb weight tiles) go to the tiles; between their
// chunks, the block before's sums (waiting in the other half of c) are rounded and stored, a few rows at a
// time; then this block's sums go to its half of c, to be stored during the next block.
struct BlockPipe {
  alignas(64) float c[2][32 * 32];
  int64_t pend_g = -1, pend_t0 = 0, pend_rows = 0;
  int pend_nb = 2, parity = 0;
  bool stream = false;  // store_block's
  bool stream_weights = false;  // tile_block's STREAM_B (else x's tiles are the ones loaded around L1)
  int64_t silu_cols = 0;  // > 0: the blocks are (gate, up) tile pairs, stored by store_block_silu
  RowArgmax* amax = nullptr;  // greedy rows: each block's outputs go into the rows' argmax (and out, if any)
  // bytes to bring into L2 meanwhile (prefetch_pair): two ranges, ahead_lines lines of them after each chunk
  const char* ahead[2] = {nullptr, nullptr};
  const char* ahead_end[2] = {nullptr, nullptr};
  int ahead_lines = 0;

  // the weight tiles t0 and t1 (t1 < 0: none), tile_bytes each, into L2 a few lines after each chunk of the
  // next `calls` chunks of products: at most kAheadLines a chunk, the rest left to the hardware's prefetcher
  // (with few rows a chunk asked for 16-32 lines, more than a core has line fill buffers; capped, 30 layers'
  // products of the default model at 64 rows, weights from memory, 12.4-13.4 -> 10.2-10.5 ms alone and
  // 11.3-12.3 -> 10.8-12.1 ms in the engine's decode steps, on the AMX Xeon; docs/cpu.md)
  // With one block of rows (up to 32: a single stream's or a small batch's decode), whose chunks are shorter
  // still, at most 4 (a single stream's decode step in the engine 13.4-13.9 -> 12.6-13.3 ms, alternating;
  // docs/cpu.md)
  static constexpr int64_t kAheadLines = 12, kAheadLinesOneBlock = 4;
  void prefetch_pair(const char* tiles, int64_t tile_bytes, int64_t t0, int64_t t1, int64_t row_blocks,
                     int64_t chunks) {
    ahead[0] = tiles + t0 * tile_bytes, ahead_end[0] = ahead[0] + tile_bytes;
    ahead[1] = tiles + std::max<int64_t>(t1, 0) * tile_bytes, ahead_end[1] = ahead[1] + (t1 >= 0 ? tile_bytes : 0);
    const int64_t calls = row_blocks * chunks;
    ahead_lines = (int)std::min(row_blocks > 1 ? kAheadLines : kAheadLinesOneBlock,
                                (2 * tile_bytes / 64 + calls - 1) / calls);
  }

  template <bool STREAM_B, class Between>
  TIDAL_AMX_TARGET static void blocks(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint32_t* b0,
                                      const uint32_t* b1, int64_t chunks, int rb, int nb, Between& between) {
    if (rb == 2 && nb == 2) tile_block<2, 2, STREAM_B>(a0, a1, lda, b0, b1, chunks, between);
    else if (rb == 2) tile_block<2, 1, STREAM_B>(a0, a1, lda, b0, b1, chunks, between);
    else if (nb == 2) tile_block<1, 2, STREAM_B>(a0, a1, lda, b0, b1, chunks, between);
    else tile_block<1, 1, STREAM_B>(a0, a1, lda, b0, b1, chunks, between);
  }

  TIDAL_AMX_TARGET void run(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint32_t* b0,
                            const uint32_t* b1, int64_t chunks, int rb, int nb, int64_t g, int64_t t0, int64_t M,
                            const uint16_t* bias, uint16_t* out, int64_t N) {
    // the waiting block's rows, a few after each chunk (those left, if any, after the last)
    const int64_t step = (32 + chunks - 1) / std::max<int64_t>(chunks, 1);
    int64_t done = 0;
    auto between = [&](int64_t) {
      if (pend_g >= 0 && done < pend_rows) {
        const int64_t upto = std::min(pend_rows, done + step);
        flush_rows(done, upto, bias, out, N);
        done = upto;
      }
      for (int i = 0; i < ahead_lines; ++i) {
        const int r = i & 1;
        if (ahead[r] < ahead_end[r]) {
          _mm_prefetch(ahead[r], _MM_HINT_T1);
          ahead[r] += 64;
        }
      }
    };
    if (stream_weights) blocks<true>(a0, a1, lda, b0, b1, chunks, rb, nb, between);
    else blocks<false>(a0, a1, lda, b0, b1, chunks, rb, nb, between);
    if (pend_g >= 0 && done < pend_rows) flush_rows(done, pend_rows, bias, out, N);
    pend_g = -1;
    float* cur = c[parity];
    if (rb == 2 && nb == 2) store_tiles<2, 2>(cur);
    else if (rb == 2) store_tiles<2, 1>(cur);
    else if (nb == 2) store_tiles<1, 2>(cur);
    else store_tiles<1, 1>(cur);
    pend_g = g, pend_t0 = t0, pend_rows = std::min<int64_t>(16 * rb, M - 16 * g), pend_nb = nb;
    parity ^= 1;
  }

  // rows [r0, r1) of the waiting block's outputs
  void flush_rows(int64_t r0, int64_t r1, const uint16_t* bias, uint16_t* out, int64_t N) {
    const float* cb = c[parity ^ 1] + r0 * 32;
    const int64_t m0 = 16 * pend_g + r0;
    if (amax) argmax_block(cb, r1 - r0, pend_nb, bias, N, m0, 16 * pend_t0, *amax);
    if (silu_cols > 0) store_block_silu(cb, r1 - r0, bias, out, silu_cols, m0, 16 * pend_t0);
    else if (out) store_block(cb, r1 - r0, pend_nb, bias, out, N, m0, 16 * pend_t0, stream);
  }

  // the waiting block's outputs, if any
  void flush(const uint16_t* bias, uint16_t* out, int64_t N) {
    if (pend_g >= 0) flush_rows(0, pend_rows, bias, out, N);
    pend_g = -1;
  }
};

// A whole 2 x 2 block of gemm's wide order (32 rows of x in L1, a pair of weight tiles around L1): what
// BlockPipe::run does for it, written out in a function of its own. Through run's general path (any rb and nb,
// its epilogue and prefetches in a closure called after each chunk) the block ran ~15% slower than the same
// loop written plainly; here tile_block's loop is compiled for a 2 x 2 block alone, and the waiting block's
// plain rows (no SiLU, no argmax: store_block's 32 whole columns) are rounded and stored between its chunks.
// (run's prefetches are left out: the wide order asks for no lines ahead; prefetch_pair serves the other order.)
// The same products, sums and stores in the same order, so the same bits: 30 layers of SmolLM2's products at
// 2,048 rows, weights from memory, 183-190 -> 175-179 ms on the AMX Xeon (docs/cpu.md).
TIDAL_AMX_TARGET __attribute__((noinline)) static void wide_block(BlockPipe& pipe, const uint16_t* a0,
                                                                  const uint16_t* a1, int64_t lda, const uint32_t* b0,
                                                                  const uint32_t* b1, int64_t chunks, int64_t g,
                                                                  int64_t t0, int64_t M, const uint16_t* bias,
                                                                  uint16_t* out, int64_t N) {
  const int64_t step = (32 + chunks - 1) / chunks;  // the waiting block's rows a chunk, as run stores them
  const int64_t rows = pipe.pend_g >= 0 ? pipe.pend_rows : 0;
  uint16_t* dst = out && rows > 0 ? out + 16 * pipe.pend_g * N + 16 * pipe.pend_t0 : nullptr;
  const bool plain = dst && !pipe.amax && pipe.silu_cols == 0 && pipe.pend_nb == 2 && 16 * pipe.pend_t0 + 32 <= N &&
                     (!pipe.stream || ((reinterpret_cast<uintptr_t>(dst) & 63) == 0 && (N * 2) % 64 == 0));
  const float* cb = pipe.c[pipe.parity ^ 1];
  const __m512 bias_lo = plain ? load_bias(bias, 16 * pipe.pend_t0, 0xffff) : _mm512_setzero_ps();
  const __m512 bias_hi = plain ? load_bias(bias, 16 * pipe.pend_t0 + 16, 0xffff) : _mm512_setzero_ps();
  int64_t done = 0;
  auto between = [&](int64_t) {
    if (done < rows) {
      const int64_t upto = std::min(rows, done + step);
      if (plain) {
        for (int64_t r = done; r < upto; ++r) {
          const __m512i v = rounded_pair(_mm512_loadu_ps(cb + r * 32), _mm512_loadu_ps(cb + r * 32 + 16), bias_lo,
                                         bias_hi);
          if (pipe.stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + r * N), v);
          else _mm512_storeu_si512(dst + r * N, v);
        }
      } else {
        pipe.flush_rows(done, upto, bias, out, N);
      }
      done = upto;
    }
  };
  tile_block<2, 2, true>(a0, a1, lda, b0, b1, chunks, between);
  if (done < rows) pipe.flush_rows(done, rows, bias, out, N);
  store_tiles<2, 2>(pipe.c[pipe.parity]);
  pipe.pend_g = g, pipe.pend_t0 = t0, pipe.pend_rows = std::min<int64_t>(32, M - 16 * g), pipe.pend_nb = 2;
  pipe.parity ^= 1;
}

// out [M, N] = x [M, K] @ W^T (+ bias), bf16, any M >= 1, in panels of ~512 KiB of x (in L2). x is read
// where it is when K is a multiple of 32; a last group of fewer than 16 rows, or every row when K is not,
// goes through a zero-padded copy. The threads take pairs of weight tiles (32 columns) statically. Two
// orders, the same sums (every output a chain over its K in order, whichever block it is in):
// - up to kRowsWide rows: each pair runs over the panel's blocks of 32 rows (the pair's weights in L1, x
//   from L2), bringing the next pair's weights into L2 a few lines after each chunk of products (left to
//   the hardware, or prefetched between blocks, the weights' memory time and the products' compute time
//   added up: 30 layers of SmolLM2's products at 128 rows, weights from memory, 14.5-15.7 -> 12.4-13.7 ms,
//   docs/cpu.md);
// - more: a thread's pairs go in groups of ~512 KiB of weights (in L2), and each block of rows runs over a
//   group's pairs (the block in L1, the weight tiles loaded around L1: tile_block's STREAM_B), so that a
//   row's outputs are written in runs of the group's columns rather than 64 bytes at a time down the rows,
//   and from kRowsStreamed rows streamed around the caches (they are far larger than L2). Measured on the
//   AMX Xeon (30 layers of SmolLM2's products, weights not in the caches, docs/cpu.md): 4,096 rows 460 ->
//   405 ms, 3,072 rows 315 -> 290 ms, then streamed 4,096 rows 410 -> 355 ms (300 ms without storing the
//   outputs at all); with the weight tiles around L1, 512 rows 51.3 -> 48.8-50.1 ms and 768 rows 75.2 ->
//   66.6-72.7 ms against the first order, 256 rows 28.2 -> 29.6 ms (the first order kept there).
//
// silu: W is a gate/up product's [gate; up] (N = 2 I, I a multiple of 16), and out [M, I] gets silu(gate) *
// up (store_block_silu): a thread's blocks pair gate tile j with up tile I / 16 + j instead of tiles 2j
// and 2j + 1, so each block holds the two halves of 16 outputs; the product's own output is never stored.
//
// argmax (greedy rows; not with silu): argmax[m] = the first column < n_valid of row m's largest output as
// stored (NaN never wins; 0 when all are NaN), argmax_rows' result on out[:, :n_valid]; out may then be null
// (nothing stored: an LM head's rows that only sample greedily). Each thread keeps every row's argmax over
// its own columns (its tile pairs are consecutive, the lower threads' below its own, and it reaches a row's
// pairs in ascending order in either order above), and the threads' are merged in thread order.
static constexpr int64_t kRowsWide = 512;
static constexpr int64_t kRowsStreamed = 1024;

TIDAL_AMX_TARGET static void gemm(const uint16_t* x, const Weights& w, const uint16_t* bias, uint16_t* out,
                                  int64_t M, int num_threads, bool silu = false, int64_t* argmax = nullptr,
                                  int64_t n_valid = 0) {
  const int64_t N = w.N, K = w.K, chunks = (K + 31) / 32, Kp = chunks * 32;
  const int64_t tiles = (N + 15) / 16, pairs_of_tiles = (tiles + 1) / 2, groups = (M + 15) / 16;
  // tile pair tp: tiles first(tp) and second(tp) (the second is first's unless nb(tp) == 2)
  const int64_t up_tiles = silu ? N / 32 : 0;
  auto first = [&](int64_t tp) { return silu ? tp : 2 * tp; };
  auto second = [&](int64_t tp) { return silu ? tp + up_tiles : 2 * tp + 1; };
  auto nb_of = [&](int64_t tp) { return silu || 2 * tp + 1 < tiles ? 2 : 1; };
  simd::avector<uint16_t> pad;
  // fewer than 16 rows with K a multiple of 32: x read in place, into tiles of M rows (the sum tiles too)
  const bool short_rows = M < 16 && K % 32 == 0;
  const int64_t full = K % 32 == 0 ? (short_rows ? 1 : M / 16) : 0;  // groups read in place
  if (full < groups) {
    pad.assign((groups - full) * 16 * Kp, 0);
    for (int64_t m = full * 16; m < M; ++m) std::memcpy(pad.data() + (m - full * 16) * Kp, x + m * K, K * 2);
  }
  auto group = [&](int64_t g) { return g < full ? x + g * 16 * K : pad.data() + (g - full) * 16 * Kp; };
  const int64_t lda = full > 0 ? K : Kp;  // in place and padded rows have the same stride when K % 32 == 0
  const int64_t panel = std::max<int64_t>(2, (512 * 1024) / (32 * K) / 2 * 2);  // groups of 16 rows per panel
  // the second order needs each tile in place (a packed weight whose K is a multiple of 32)
  const bool wide = M >= kRowsWide && w.kind == Weights::PACKED && K % 32 == 0;
  const int64_t pairs_per_group = std::max<int64_t>(1, (512 * 1024) / (chunks * 2048));
  std::vector<float> amax_val(argmax ? size_t(num_threads) * M : 0);
  std::vector<int64_t> amax_idx(argmax ? size_t(num_threads) * M : 0, -1);
#pragma omp parallel num_threads(num_threads)
  {
    configure(short_rows ? static_cast<int>(M) : 16);
    simd::avector<uint32_t> bbuf(w.kind == Weights::PACKED && K % 32 == 0 ? 0 : 2 * chunks * 256);
    simd::avector<uint16_t> rows(w.kind == Weights::ROWS ? 16 * K : 0);
    BlockPipe pipe;
    pipe.stream = wide && !silu && M >= kRowsStreamed;
    pipe.stream_weights = wide;
    pipe.silu_cols = silu ? N / 2 : 0;
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    RowArgmax amax{argmax ? amax_val.data() + size_t(tid) * M : nullptr,
                   argmax ? amax_idx.data() + size_t(tid) * M : nullptr, std::min(n_valid, N)};
    if (argmax) pipe.amax = &amax;
    const int64_t p_begin = pairs_of_tiles * tid / nth, p_end = pairs_of_tiles * (tid + 1) / nth;
    for (int64_t g0 = 0; g0 < groups; g0 += panel) {
      const int64_t g1 = std::min(groups, g0 + panel);
      if (wide) {
        for (int64_t q0 = p_begin; q0 < p_end; q0 += pairs_per_group) {
          const int64_t q1 = std::min(p_end, q0 + pairs_per_group);
          for (int64_t g = g0; g < g1; g += 2) {
            const int rb = g + 1 < g1 ? 2 : 1;
            const uint16_t* a0 = group(g);
            const uint16_t* a1 = rb > 1 ? group(g + 1) : a0;
            for (int64_t tp = q0; tp < q1; ++tp) {
              const int64_t t0 = first(tp);
              const int nb = nb_of(tp);
              const uint32_t* b0 = w.tile(t0, nullptr, nullptr);
              const uint32_t* b1 = nb > 1 ? w.tile(second(tp), nullptr, nullptr) : b0;
              if (rb == 2 && nb == 2) wide_block(pipe, a0, a1, lda, b0, b1, chunks, g, t0, M, bias, out, N);
              else pipe.run(a0, a1, lda, b0, b1, chunks, rb, nb, g, t0, M, bias, out, N);
            }
          }
        }
        continue;
      }
      for (int64_t tp = p_begin; tp < p_end; ++tp) {
        const int64_t t0 = first(tp);
        const int nb = nb_of(tp);
        const uint32_t* b0 = w.tile(t0, bbuf.data(), rows.data());
        const uint32_t* b1 = nb > 1 ? w.tile(second(tp), bbuf.data() + chunks * 256, rows.data()) : b0;
        if (w.kind == Weights::PACKED && K % 32 == 0 && tp + 1 < p_end)  // the next pair's tiles, from memory
          pipe.prefetch_pair(static_cast<const char*>(w.w), chunks * 1024, first(tp + 1),
                             nb_of(tp + 1) > 1 ? second(tp + 1) : -1, (g1 - g0 + 1) / 2, chunks);
        for (int64_t g = g0; g < g1; g += 2) {
          const int rb = g + 1 < g1 ? 2 : 1;
          const uint16_t* a0 = group(g);
          pipe.run(a0, rb > 1 ? group(g + 1) : a0, lda, b0, b1, chunks, rb, nb, g, t0, M, bias, out, N);
        }
      }
    }
    pipe.flush(bias, out, N);
    if (wide) _mm_sfence();  // the streamed rows visible before the threads join
    release();
  }
  if (argmax) {
    for (int64_t m = 0; m < M; ++m) {
      float best = 0.f;
      int64_t at = -1;
      for (int t = 0; t < num_threads; ++t) {  // thread order: column order
        const int64_t i = amax_idx[size_t(t) * M + m];
        if (i >= 0 && (at < 0 || amax_val[size_t(t) * M + m] > best)) best = amax_val[size_t(t) * M + m], at = i;
      }
      argmax[m] = at < 0 ? 0 : at;
    }
  }
}

// argmax[m] = the first column < n_valid of row m's largest output as stored (NaN never wins; 0 when all
// are NaN): what skinny_bf16_packed finds as it stores
static void argmax_rows(const uint16_t* out, int64_t M, int64_t N, int64_t n_valid, int64_t* argmax) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = out + m * N;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i where = _mm512_set1_epi32(-1);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t n0 = 0; n0 < n_valid; n0 += 16) {
      const __mmask16 vmask = (__mmask16)((1u << std::min<int64_t>(16, n_valid - n0)) - 1);
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vmask, row + n0)), 16));
      const __mmask16 ord = vmask & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
      const __mmask16 take = _mm512_mask_cmp_ps_mask(ord, v, best, _CMP_GT_OQ) |
                             (ord & _mm512_cmplt_epi32_mask(where, _mm512_setzero_si512()));
      best = _mm512_mask_mov_ps(best, take, v);
      where = _mm512_mask_mov_epi32(where, take, _mm512_add_epi32(lanes, _mm512_set1_epi32((int)n0)));
    }
    alignas(64) float bv[16];
    alignas(64) int32_t bi[16];
    _mm512_store_ps(bv, best);
    _mm512_store_si512(bi, where);
    float v = -INFINITY;
    int64_t i = -1;
    for (int l = 0; l < 16; ++l)
      if (bi[l] >= 0 && (i < 0 || bv[l] > v || (bv[l] == v && bi[l] < i))) v = bv[l], i = bi[l];
    argmax[m] = i < 0 ? 0 : i;
  }
}

// The greedy LM head's screen on the tiles, for bf16 rows (screen_argmax below). The screen's weight is the
// int8 copy of the fp32 screen (tidal_greedy_screen_bf16: one scale a weight row, the bound's terms a and b)
// in the int8 unit's layout: [tiles, chunks of 64 k, 16 quads of k, 16 columns, 4] (a 1 KiB tile a chunk).
namespace screen8 {
// rounding to bf16 moves a value by at most 2^-8 of it: a column is a candidate when its upper bound, moved up
// by that, reaches the largest lower bound moved down by it (widened for the fp32 arithmetic of both)
constexpr float kRound = 1.0f / 256 + 1.0f / 4096;
constexpr float kTiny = 0x1p-100f;  // plus this much: values flushed to zero or rounded in the subnormal range

// what a row needs: x in int16 as a signed high byte and an unsigned low byte (xq = 256 hi + lo), both
// [rows padded to 16, chunks * 64]; its scale, |x| and |x - xq| (rounded up)
struct Rows {
  std::vector<int8_t> hi;
  std::vector<uint8_t> lo;
  std::vector<float> scale, norm, err;
};

// the lower and upper bounds of 16 outputs of one row: v = s_x s_w (xq . wq), bound = a |x| + b |x - xq| (the
// fp32 screen's: greedy above), with |x| and |x - xq| widened by 2^-10 beforehand (for the bound's own rounding)
// and kTiny added; columns from `valid` on left out (-inf)
struct Bounds {
  __m512 lo, hi;
};
static inline Bounds bounds(__m512i dot, __m512 xs, __m512 xn, __m512 xe, const float* ws, const float* a, const float* b,
                            __mmask16 valid) {
  const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(ws)), xs);
  const __m512 bound = _mm512_fmadd_ps(_mm512_loadu_ps(a), xn, _mm512_fmadd_ps(_mm512_loadu_ps(b), xe, _mm512_set1_ps(kTiny)));
  const __m512 none = _mm512_set1_ps(-INFINITY);
  return {_mm512_mask_sub_ps(none, valid, v, bound), _mm512_mask_add_ps(none, valid, v, bound)};
}

// a candidate's test value: the upper bound moved up by what rounding to bf16 may add
static inline __m512 rounded_up(__m512 hi) {
  return _mm512_fmadd_ps(_mm512_abs_ps(hi), _mm512_set1_ps(kRound), hi);
}
// and the threshold: the largest lower bound moved down by it
static inline float threshold(float lb) { return lb - std::fabs(lb) * kRound - kTiny; }
}  // namespace screen8

// Each row's argmax over the first n_valid columns of x [M, K] (bf16) times the packed bf16 weight of [N, K]
// (no bias), as tidal_gemm_bf16_packed_greedy finds it (the first column of the largest output rounded to
// bf16), reading the int8 screen instead of the bf16 weight for all but a few tiles of columns:
// - each row of x becomes int16 (scale |x|max / qmax) in two bytes, and the tiles multiply the screen's int8
//   weight by the high and by the low byte (TDPBSSD, TDPBUSD: exact int32 sums, xq . wq = 256 hi + lo), at
//   the int8 unit's rate, the screen's weight half the bf16 weight's bytes;
// - with the fp32 screen's bound (greedy above), every output has a lower and an upper bound on its fp32
//   value; the threshold is the largest lower bound, and a tile of 16 columns is a candidate for a row where
//   a column's upper bound reaches it (both widened by what rounding to bf16 may move a value: the argmax
//   is taken on rounded values, as the product stores them). The test runs against the threshold so far,
//   each tile recorded with its largest test value, and the final threshold keeps those that reach it;
// - the candidate tiles of each group of 16 rows go through the bf16 product itself (tile_block over the
//   packed tile: the same chunks in the same order, the same sums and rounding as in gemm), and each row's
//   argmax is taken over its candidates' columns (the first of equal maxima, NaN never winning).
// Returns 0 with argmax set; -1 when it does not apply (no AMX-INT8, a row of x or a bound not finite, K too
// large for int32 sums): the caller runs the whole product. w_bound: the largest of a and b (every output's value
// and bound are at most 3 (|x| + |x - xq|) w_bound, which must stay finite).
TIDAL_AMX_INT8_TARGET static int screen_argmax(const uint16_t* x, const uint32_t* wpk, const int8_t* wq,
                                               const float* ws, const float* wa, const float* wb, float w_bound,
                                               int64_t M, int64_t N, int64_t K, int64_t n_valid, int num_threads,
                                               int64_t* argmax) {
  n_valid = std::min(n_valid, N);
  if (M < 1 || n_valid < 1 || !simd::amx_int8_usable()) return -1;
  const int64_t chunks8 = (K + 63) / 64, K8 = chunks8 * 64, chunks = (K + 31) / 32, Kp = chunks * 32;
  const int64_t groups = (M + 15) / 16, tiles = (n_valid + 15) / 16, pairs_of_tiles = (tiles + 1) / 2;
  // |xq . wq| <= K8 * 127 * qmax < 2^31 (the screen's sums, and 256 hi + lo, exact in int32)
  const int64_t qmax = std::min<int64_t>(16383, (int64_t(1) << 31) / (K8 * 127 + 1) - 1);
  if (qmax < 64) return -1;
  screen8::Rows r;
  r.hi.assign(groups * 16 * K8, 0);
  r.lo.assign(groups * 16 * K8, 0);
  r.scale.assign(M, 1.f), r.norm.assign(M, 0.f), r.err.assign(M, 0.f);
  simd::avector<uint16_t> xp(groups * 16 * Kp, 0);  // x for the bf16 products, zero-padded to tiles
  // each thread: per row its largest lower bound (16 lanes) and the threshold so far; the candidate tiles it
  // recorded (row, tile, largest test value)
  struct Candidate {
    int64_t row, tile;
    float top;
  };
  std::vector<std::vector<Candidate>> found(num_threads);
  std::vector<float> lo_all(size_t(num_threads) * M * 16, -INFINITY);
  std::vector<float> best_v(size_t(num_threads) * M, -INFINITY);
  std::vector<int64_t> best_i(size_t(num_threads) * M, -1);
  std::vector<int64_t> work;  // (tile, group, row mask) triples for the bf16 products
  int bad = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : bad)
  {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* xm = x + m * K;
      std::memcpy(xp.data() + m * Kp, xm, K * 2);
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const float v = bf16_to_float(xm[k]);
        if (!std::isfinite(v)) bad = 1;
        amax = std::max(amax, std::fabs(v));
      }
      const float s = amax > 0.f && std::isfinite(amax) ? amax / float(qmax) : 1.f;
      double n2 = 0, e2 = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float v = bf16_to_float(xm[k]);
        const float q = std::min(float(qmax), std::max(-float(qmax), std::nearbyint(v / s)));
        const int32_t qi = static_cast<int32_t>(q);
        r.lo[m * K8 + k] = static_cast<uint8_t>(qi & 255);
        r.hi[m * K8 + k] = static_cast<int8_t>((qi - (qi & 255)) / 256);
        const double e = double(v) - double(q) * double(s);
        n2 += double(v) * v;
        e2 += e * e;
      }
      r.scale[m] = s;
      // |x| and |x - xq| rounded up, and widened by 2^-10 for the rounding of the bound made from them
      r.norm[m] = std::nextafter(float(std::sqrt(n2) * (1.0 + 1.0 / 1024)), INFINITY);
      r.err[m] = std::nextafter(float(std::sqrt(e2) * (1.0 + 1.0 / 1024)), INFINITY);
      if (!((double(r.norm[m]) + r.err[m]) * w_bound * 3 < 1e37)) bad = 1;  // values and bounds stay finite
    }  // (the implicit barrier: every row ready)
    configure();
    float* lo_acc = lo_all.data() + size_t(tid) * M * 16;
    std::vector<float> thr(M, -INFINITY);
    std::vector<Candidate>& mine = found[tid];
    alignas(64) int32_t sums[2][16 * 32];  // the high and the low byte's sums: 16 rows x 2 tiles
    const int64_t p_begin = pairs_of_tiles * tid / nth, p_end = pairs_of_tiles * (tid + 1) / nth;
    const char* ahead[2] = {nullptr, nullptr};
    const char* ahead_end[2] = {nullptr, nullptr};
    const int64_t tile_bytes = chunks8 * 1024;
    const int ahead_lines = (int)std::min<int64_t>(groups > 2 ? 12 : 4, (2 * tile_bytes / 64 + groups * chunks8 - 1) /
                                                                            (groups * chunks8));
    for (int64_t tp = p_begin; tp < p_end; ++tp) {
      const int64_t t0 = 2 * tp, t1 = t0 + 1;
      const bool two = t1 < tiles;
      const int8_t* b0 = wq + t0 * tile_bytes;
      const int8_t* b1 = two ? b0 + tile_bytes : b0;
      if (tp + 1 < p_end) {  // the next pair's tiles into L2, a few lines after each chunk
        ahead[0] = reinterpret_cast<const char*>(b0) + 2 * tile_bytes, ahead_end[0] = ahead[0] + tile_bytes;
        ahead[1] = ahead_end[0], ahead_end[1] = ahead[1] + (2 * tp + 3 < tiles ? tile_bytes : 0);
      } else {
        ahead[0] = ahead_end[0], ahead[1] = ahead_end[1];
      }
      for (int64_t g = 0; g < groups; ++g) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int8_t* ah = r.hi.data() + g * 16 * K8;
        const uint8_t* al = r.lo.data() + g * 16 * K8;
        for (int64_t ch = 0; ch < chunks8; ++ch) {
          _tile_loadd(4, ah + ch * 64, K8);
          _tile_loadd(5, al + ch * 64, K8);
          _tile_loadd(6, b0 + ch * 1024, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbusd(2, 5, 6);
          if (two) {
            _tile_loadd(7, b1 + ch * 1024, 64);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbusd(3, 5, 7);
          }
          for (int i = 0; i < ahead_lines; ++i) {
            const int k = i & 1;
            if (ahead[k] < ahead_end[k]) {
              _mm_prefetch(ahead[k], _MM_HINT_T1);
              ahead[k] += 64;
            }
          }
        }
        _tile_stored(0, sums[0], 128);
        _tile_stored(2, sums[1], 128);
        if (two) {
          _tile_stored(1, sums[0] + 16, 128);
          _tile_stored(3, sums[1] + 16, 128);
        }
        const int64_t rows = std::min<int64_t>(16, M - 16 * g);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t m = 16 * g + i;
          const __m512 xs = _mm512_set1_ps(r.scale[m]), xn = _mm512_set1_ps(r.norm[m]), xe = _mm512_set1_ps(r.err[m]);
          __m512 lo_m = _mm512_loadu_ps(lo_acc + m * 16);
          const __m512 t = _mm512_set1_ps(thr[m]);
          for (int j = 0; j < (two ? 2 : 1); ++j) {
            const int64_t n0 = 16 * (t0 + j);
            const __mmask16 valid = (__mmask16)((1u << std::min<int64_t>(16, n_valid - n0)) - 1);
            const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[0] + i * 32 + 16 * j), 8),
                                                 _mm512_load_si512(sums[1] + i * 32 + 16 * j));
            const screen8::Bounds bd = screen8::bounds(dot, xs, xn, xe, ws + n0, wa + n0, wb + n0, valid);
            lo_m = _mm512_max_ps(lo_m, bd.lo);
            const __m512 up = screen8::rounded_up(bd.hi);
            if (_mm512_mask_cmp_ps_mask(valid, up, t, _CMP_GE_OQ))
              mine.push_back({m, t0 + j, _mm512_mask_reduce_max_ps(valid, up)});
          }
          _mm512_storeu_ps(lo_acc + m * 16, lo_m);
          thr[m] = screen8::threshold(_mm512_reduce_max_ps(lo_m));
        }
      }
    }
#pragma omp barrier
#pragma omp single
    {
      // the final thresholds, and the candidates that reach them: (tile, group) items with their rows
      std::vector<float> final_thr(M);
      for (int64_t m = 0; m < M; ++m) {
        float lb = -INFINITY;
        for (int th = 0; th < nth; ++th)
          for (int l = 0; l < 16; ++l) lb = std::max(lb, lo_all[(size_t(th) * M + m) * 16 + l]);
        final_thr[m] = screen8::threshold(lb);
      }
      std::vector<std::pair<int64_t, int64_t>> keep;  // (tile * groups + group, row)
      for (int th = 0; th < nth; ++th)
        for (const Candidate& c : found[th])
          if (c.top >= final_thr[c.row]) keep.push_back({c.tile * groups + c.row / 16, c.row});
      std::sort(keep.begin(), keep.end());
      for (size_t i = 0; i < keep.size();) {
        int64_t mask = 0;
        size_t j = i;
        for (; j < keep.size() && keep[j].first == keep[i].first; ++j) mask |= int64_t(1) << (keep[j].second % 16);
        work.insert(work.end(), {keep[i].first / groups, keep[i].first % groups, mask});
        i = j;
      }
    }
    // the candidates' bf16 products, tile by tile, and each row's argmax over them
    const Weights w{Weights::PACKED, wpk, {nullptr, 0}, N, K};
    simd::avector<uint32_t> bbuf(K % 32 == 0 ? 0 : chunks * 256);
    alignas(64) float c[16 * 32];
    float* bv = best_v.data() + size_t(tid) * M;
    int64_t* bi = best_i.data() + size_t(tid) * M;
    auto nothing = [](int64_t) {};
#pragma omp for schedule(dynamic)
    for (int64_t it = 0; it < static_cast<int64_t>(work.size() / 3); ++it) {
      const int64_t t = work[3 * it], g = work[3 * it + 1], mask = work[3 * it + 2];
      const uint32_t* bt = w.tile(t, bbuf.data(), nullptr);
      const uint16_t* a0 = xp.data() + g * 16 * Kp;
      tile_block<1, 1, false>(a0, a0, Kp, bt, bt, chunks, nothing);
      store_tiles<1, 1>(c);
      const int64_t n0 = 16 * t;
      const __mmask16 valid = (__mmask16)((1u << std::min<int64_t>(16, n_valid - n0)) - 1);
      const __m512 zero_bias = load_bias(nullptr, n0, valid);
      for (int i = 0; i < 16; ++i) {
        if (!(mask >> i & 1)) continue;
        const int64_t m = 16 * g + i;
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(rounded_bits(_mm512_loadu_ps(c + i * 32), zero_bias), 16));
        const __mmask16 ord = valid & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
        if (!ord) continue;
        const float top = _mm512_mask_reduce_max_ps(ord, v);
        const int64_t at = n0 + __builtin_ctz(ord & _mm512_cmp_ps_mask(v, _mm512_set1_ps(top), _CMP_EQ_OQ));
        if (bi[m] < 0 || top > bv[m] || (top == bv[m] && at < bi[m])) bv[m] = top, bi[m] = at;
      }
    }
    release();
  }
  if (bad) return -1;
  for (int64_t m = 0; m < M; ++m) {
    float v = -INFINITY;
    int64_t at = -1;
    for (int th = 0; th < num_threads; ++th) {
      const float tv = best_v[size_t(th) * M + m];
      const int64_t ti = best_i[size_t(th) * M + m];
      if (ti >= 0 && (at < 0 || tv > v || (tv == v && ti < at))) v = tv, at = ti;
    }
    if (at < 0) return -1;  // (a row without a candidate: the bounds did not hold)
    argmax[m] = at;
  }
  return 0;
}

}  // namespace amx

// Stores out[m0 + r, n0 + i] = acc[i] lane r (+ bias) for i < nn <= 16 and rows < M.
static inline void store_16x16(const __m512* acc, const uint16_t* bias, uint16_t* out, int64_t M, int64_t N,
                               int64_t m0, int64_t n0, int nn) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(acc[i]);
  simd::transpose16x16(r);  // r[row]: the row's outputs
  const __mmask16 nmask = (__mmask16)((1u << nn) - 1);
  const __m512 b = load_bias(bias, n0, nmask);
  const int64_t rows = std::min<int64_t>(16, M - m0);
  for (int64_t row = 0; row < rows; ++row) store_row(_mm512_castsi512_ps(r[row]), b, nmask, out + (m0 + row) * N + n0);
}

// Two groups' 8 columns in one transpose: out[m0 + r, n0 + i] = lo[i] lane r and out[m0 + 16 + r, n0 + i]
// = hi[i] lane r (+ bias), for i < nn <= 8 and rows < M (hi null: only the first group).
static inline void store_2x16x8(const __m512* lo, const __m512* hi, const uint16_t* bias, uint16_t* out, int64_t M,
                                int64_t N, int64_t m0, int64_t n0, int nn) {
  __m512i r[16];
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_castps_si512(lo[i]);
    r[8 + i] = hi ? _mm512_castps_si512(hi[i]) : _mm512_setzero_si512();
  }
  simd::transpose16x16(r);  // r[c]: row m0 + c's outputs in lanes 0-7, row m0 + 16 + c's in lanes 8-15
  const __mmask16 nmask = (__mmask16)((1u << nn) - 1);
  __m512 b = load_bias(bias, n0, nmask);
  b = _mm512_shuffle_f32x4(b, b, 0x44);  // the 8 biases in both halves
  const int64_t rows = std::min<int64_t>(16, M - m0), rows_hi = hi ? std::min<int64_t>(16, M - m0 - 16) : 0;
  for (int64_t c = 0; c < rows; ++c) store_row(_mm512_castsi512_ps(r[c]), b, nmask, out + (m0 + c) * N + n0);
  for (int64_t c = 0; c < rows_hi; ++c) {
    const __m512 v = _mm512_castsi512_ps(_mm512_shuffle_i32x4(r[c], r[c], 0xee));  // lanes 8-15 down to 0-7
    store_row(v, b, nmask, out + (m0 + 16 + c) * N + n0);
  }
}

// MV packed groups of 16 rows of x (xg + v * gstride, the first at row m0) against NR weight rows: MV * NR
// accumulators, one per (group, weight row), each lane one output. The weight rows are w + i * K (plain
// rows). prefetch (or null): K / 2 cache lines to bring into L2 meanwhile, one per pair (the next tile's
// weights).
template <int MV, int NR>
static inline void tile_bf16(const uint32_t* xg, int64_t gstride, const void* wv_, int64_t K,
                             const uint16_t* bias, uint16_t* out, int64_t M, int64_t N, int64_t m0, int64_t n0,
                             int nn, const char* prefetch) {
  const uint16_t* w = static_cast<const uint16_t*>(wv_);
  __m512 acc[MV][NR];
  for (int v = 0; v < MV; ++v)
    for (int i = 0; i < NR; ++i) acc[v][i] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch) _mm_prefetch(prefetch + p * 64, _MM_HINT_T1);
    __m512bh xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(xg + v * gstride + p * 16);
    for (int i = 0; i < NR; ++i) {
      int32_t wp;
      std::memcpy(&wp, w + i * K + 2 * p, 4);
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(wp);
      for (int v = 0; v < MV; ++v) acc[v][i] = _mm512_dpbf16_ps(acc[v][i], xv[v], wv);
    }
  }
  if (K % 2) {  // x's half of the last pair is zero; so is the weight's, so that no inf or NaN comes in
    for (int i = 0; i < NR; ++i) {
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(w[i * K + K - 1]);
      for (int v = 0; v < MV; ++v)
        acc[v][i] = _mm512_dpbf16_ps(acc[v][i], (__m512bh)_mm512_loadu_si512(xg + v * gstride + pairs * 16), wv);
    }
  }
  if constexpr (NR == 16) {
    static_assert(MV == 1, "16 weight rows: one group of x");
    store_16x16(acc[0], bias, out, M, N, m0, n0, nn);
  } else {
    static_assert(NR == 8, "8 or 16 weight rows");
    for (int v = 0; v < MV; v += 2)
      store_2x16x8(acc[v], v + 1 < MV ? acc[v + 1] : nullptr, bias, out, M, N, m0 + 16 * v, n0, nn);
  }
}

// Where gemm_bf16's weight tiles (16 rows each) come from: the plain [N, K] rows (PLAIN), or rows of
// another format turned into plain bf16 rows by a function of a sibling library, one tile at a time into a
// per-thread buffer (ROWS: GGUF blocks, gguf_gemm.cpp's tidal_gguf_rows_bf16), so a quantized weight is
// read once per panel of x and never held whole in bf16. (Weights packed at load take gemm_bf16_cols.)
enum class Tiles { PLAIN, ROWS };

template <Tiles T>
static void gemm_bf16(const uint16_t* x, const void* w, const uint16_t* bias, uint16_t* out, int64_t M,
                      int64_t N, int64_t K, int num_threads, RowSource src = {nullptr, 0}) {
  if (amx::usable()) {
    amx::gemm(x, amx::Weights{T == Tiles::ROWS ? amx::Weights::ROWS : amx::Weights::PLAIN, w, src, N, K}, bias, out,
              M, num_threads);
    return;
  }
  // Tiles of 16 weight rows, whose K pairs stay in L1/L2 while the panel of x passes: two groups of 16
  // rows of x at a time against each half (16 accumulators); a last single group against all 16
  // (again 16 accumulators, enough to hide VDPBF16PS's latency).
  constexpr int NT = 16;
  const int64_t K2p = ((K + 1) / 2 + 15) / 16 * 16;
  const int64_t gstride = K2p * 16;
  // groups of 16 rows per panel: ~384 KiB of packed x, in L2 while every weight tile passes over it
  const int64_t groups = (M + 15) / 16;
  const int64_t panel = std::max<int64_t>(2, (384 * 1024) / (gstride * 4) / 2 * 2);
  const int64_t tiles = (N + NT - 1) / NT;
  static thread_local simd::avector<uint32_t> packed;
  packed.resize(std::min(panel, groups) * gstride);
  uint32_t* xp = packed.data();
#pragma omp parallel num_threads(num_threads)
  {
    simd::avector<uint16_t> tile_rows;  // the last plain tile padded with zero rows to NT; a ROWS tile
    if (T == Tiles::ROWS) tile_rows.assign(NT * K, 0);
    for (int64_t g0 = 0; g0 < groups; g0 += panel) {
      const int64_t ng = std::min(panel, groups - g0);
#pragma omp for schedule(static)
      for (int64_t g = 0; g < ng; ++g) pack_group(x, M, K, (g0 + g) * 16, K2p, xp + g * gstride);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * NT;
        const int nn = (int)std::min<int64_t>(NT, N - n0);
        // this tile's weights: the plain rows (the last tile's padded with zero rows to NT) or the rows
        // made here
        const uint16_t* wt = static_cast<const uint16_t*>(w) + n0 * K;
        if (T == Tiles::ROWS) {
          if (nn < NT) std::fill(tile_rows.begin() + nn * K, tile_rows.end(), 0);
          src.fn(w, src.format, n0, nn, K, tile_rows.data());
          wt = tile_rows.data();
        } else if (nn < NT) {
          tile_rows.assign(NT * K, 0);
          std::memcpy(tile_rows.data(), wt, nn * K * 2);
          wt = tile_rows.data();
        }
        auto half_rows = [&](int h) -> const void* { return wt + 8 * h * K; };
        // the next tile's weights (16 * K bf16: K / 2 lines) come from memory while this one computes:
        // what keeps a weight too large for the caches (an LM head) streaming at small M
        const char* next = T == Tiles::ROWS || n0 + 2 * NT > N
                               ? nullptr : reinterpret_cast<const char*>(static_cast<const uint16_t*>(w) + (n0 + NT) * K);
        const int64_t pairs_end = ng / 2 * 2;
        for (int half = 0; half < 2; ++half) {
          const int nh = std::max(0, std::min(8, nn - 8 * half));
          for (int64_t g = 0; g < pairs_end && nh > 0; g += 2, next = nullptr)
            tile_bf16<2, 8>(xp + g * gstride, gstride, half_rows(half), K, bias, out, M, N, (g0 + g) * 16,
                            n0 + 8 * half, nh, next);
        }
        if (ng % 2)
          tile_bf16<1, 16>(xp + pairs_end * gstride, gstride, half_rows(0), K, bias, out, M, N,
                           (g0 + pairs_end) * 16, n0, nn, next);
      }
    }
  }
}

// ---- 1-4 rows in gemm_bf16's order (batch-invariant mode) ----
// The skinny kernel above sums each output over 16 lanes of k, then across the lanes: a different order
// from gemm_bf16, whose output is one lane accumulating the k pairs in order. This one has gemm_bf16's
// order: the lanes over 16 weight rows (their pairs transposed in registers, 16 pairs at a time), the
// pairs of each row of x broadcast, one VDPBF16PS per pair in k order from zero, the same odd-K pair
// (x_last, 0) x (w_last, 0), bias in fp32 and rounding. So a row of 1 to 4 gives the bits it gets among
// 512, while the weights still stream once.
// With a RowSource (src.fn), w is a weight in another format and each tile's 16 rows are made into a
// per-thread bf16 buffer first (tidal_gemm_bf16_rows' rows for 1-4 rows of x).
template <int M>
static void skinny_bf16_ordered(const uint16_t* x, const void* wv, const uint16_t* bias, uint16_t* out,
                                int64_t N, int64_t K, int num_threads, RowSource src = {nullptr, 0}) {
  if (amx::usable()) {
    amx::gemm(x, amx::Weights{src.fn ? amx::Weights::ROWS : amx::Weights::PLAIN, wv, src, N, K}, bias, out, M,
              num_threads);
    return;
  }
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  const int64_t pairs = (K + 1) / 2;  // the last one (x_last, 0) when K is odd
  simd::avector<uint32_t> xpairs(M * pairs, 0);
  for (int m = 0; m < M; ++m) std::memcpy(xpairs.data() + m * pairs, x + m * K, K * 2);
  const int64_t tiles = (N + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * 16;
    const int nn = (int)std::min<int64_t>(16, N - n0);
    const uint16_t* wt = w + n0 * K;  // this tile's rows
    if (src.fn) {
      static thread_local simd::avector<uint16_t> rows;
      rows.resize(16 * K);
      src.fn(wv, src.format, n0, nn, K, rows.data());
      wt = rows.data();
    } else if (n0 + 64 < N) {  // each weight row is read once, straight from memory: the rows four tiles ahead
      const char* ahead = reinterpret_cast<const char*>(w + (n0 + 64) * K);
      for (int64_t b = 0; b < 16 * K * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const int64_t k0 = 2 * p0;
      const __mmask32 mask = K - k0 >= 32 ? ~__mmask32(0) : (__mmask32)((1u << (K - k0)) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < nn ? _mm512_maskz_loadu_epi16(mask, wt + i * K + k0) : _mm512_setzero_si512();
      simd::transpose16x16(r);  // r[q] lane i: pair p0 + q of weight row n0 + i
      const int np = (int)std::min<int64_t>(16, pairs - p0);
      for (int q = 0; q < np; ++q)
        for (int m = 0; m < M; ++m)
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32((int)xpairs[m * pairs + p0 + q]),
                                    (__m512bh)r[q]);
    }
    const __mmask16 nmask = (__mmask16)((1u << nn) - 1);
    const __m512 b = load_bias(bias, n0, nmask);
    for (int m = 0; m < M; ++m) store_row(acc[m], b, nmask, out + m * N + n0);
  }
}

// ---- bf16 weights packed by 16 rows ----
// The packed layout (tidal/layers/cpu_kernels.py: pack_bf16_weight) holds a weight [N, K] as tiles of 16
// rows, pair-interleaved: wpk[t][p][i] (32 bits) = the pair (w[16t + i, 2p], w[16t + i, 2p + 1]), with
// zeros past N and past an odd K. One copy, the same bytes as the plain weight. Its 1-4 row kernel
// puts the vector lanes over a tile's 16 weight rows (one 64-byte load per pair, no transpose) and
// broadcasts each pair of x: every output is one lane accumulating the K pairs in order from zero, the
// blocked kernel's order, so a row's bits never depend on the batch; several tiles' chains run side by
// side to hide VDPBF16PS latency. More rows take gemm_bf16 over the same layout.

// rows [0, M) of x (M <= 4) as pairs, zero-padded to an odd K's last pair
// argmax (or null): argmax[m] = the first column < n_valid holding row m's largest output as stored (bf16,
// NaN never wins; 0 when every one is NaN), what tidal_argmax_rows gives on out[:, :n_valid]: found as the
// tiles are stored, each thread over its own tiles, so greedy sampling reads the logits no more.
template <int M>
static void skinny_bf16_packed(const uint16_t* x, const uint32_t* wpk, const uint16_t* bias, uint16_t* out,
                               int64_t N, int64_t K, int num_threads, int64_t* argmax = nullptr,
                               int64_t n_valid = 0) {
  if (amx::usable()) {
    amx::gemm(x, amx::Weights{amx::Weights::PACKED, wpk, {nullptr, 0}, N, K}, bias, out, M, num_threads);
    if (argmax) amx::argmax_rows(out, M, N, n_valid, argmax);
    return;
  }
  const int64_t pairs = (K + 1) / 2, tstride = pairs * 16;
  uint32_t xpairs[M][1024];  // K <= 2048 here (the caller checks); larger K takes the heap copy
  std::vector<uint32_t> heap;
  uint32_t* xp = &xpairs[0][0];
  int64_t xstride = 1024;
  if (pairs > 1024) {
    heap.assign(M * pairs, 0);
    xp = heap.data();
    xstride = pairs;
  }
  for (int m = 0; m < M; ++m) {
    xp[m * xstride + pairs - 1] = 0;
    std::memcpy(xp + m * xstride, x + m * K, K * 2);
  }
  const int64_t tiles = (N + 15) / 16;
  constexpr int TG = 1;  // tiles side by side: M * TG accumulators
  std::vector<float> best_v(argmax ? num_threads * M : 0);  // per thread and row: its tiles' maximum
  std::vector<int64_t> best_i(argmax ? num_threads * M : 0, -1);  // and where it is first (-1: none)
#pragma omp parallel num_threads(num_threads)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t t_begin = tiles * id / nt, t_end = tiles * (id + 1) / nt;
    // per lane: the largest output stored so far and its column (-1: none yet), for argmax
    __m512 lane_v[M];
    __m512i lane_i[M];
    for (int m = 0; m < M; ++m) {
      lane_v[m] = _mm512_set1_ps(-INFINITY);
      lane_i[m] = _mm512_set1_epi32(-1);
    }
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += TG) {
      const int tg = (int)std::min<int64_t>(TG, t_end - t0);
      const uint32_t* w0 = wpk + t0 * tstride;
      __m512 acc[M][TG];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < TG; ++j) acc[m][j] = _mm512_setzero_ps();
      if (tg == TG) {
        const char* ahead = t0 + 2 * TG < t_end ? reinterpret_cast<const char*>(w0 + 2 * TG * tstride) : nullptr;
        for (int64_t p = 0; p < pairs; ++p) {
          if (ahead) _mm_prefetch(ahead + p * 64, _MM_HINT_T0);
          __m512bh wv[TG];
          for (int j = 0; j < TG; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w0 + j * tstride + p * 16);
          for (int m = 0; m < M; ++m) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[m * xstride + p]);
            for (int j = 0; j < TG; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
          }
        }
      } else {
        for (int64_t p = 0; p < pairs; ++p)
          for (int j = 0; j < tg; ++j) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w0 + j * tstride + p * 16);
            for (int m = 0; m < M; ++m)
              acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)_mm512_set1_epi32((int)xp[m * xstride + p]), wv);
          }
      }
      for (int j = 0; j < tg; ++j) {
        const int64_t n0 = (t0 + j) * 16;
        const int nn = (int)std::min<int64_t>(16, N - n0);
        const __mmask16 nmask = (__mmask16)((1u << nn) - 1);
        const __m512 b = load_bias(bias, n0, nmask);
        for (int m = 0; m < M; ++m) store_row(acc[m][j], b, nmask, out + m * N + n0);
        if (argmax && n0 < n_valid) {
          const int nv = (int)std::min<int64_t>(16, n_valid - n0);
          const __mmask16 vmask = (__mmask16)((1u << nv) - 1);
          const __m512i cols = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)n0));
          for (int m = 0; m < M; ++m) {
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vmask, out + m * N + n0)), 16));
            // a lane takes its first number, then only a larger one (so the first of equal maxima stays)
            const __mmask16 first = _mm512_cmplt_epi32_mask(lane_i[m], _mm512_setzero_si512());
            const __mmask16 take = _mm512_mask_cmp_ps_mask(vmask & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q),
                                                           v, lane_v[m], _CMP_GT_OQ) |
                                   (first & vmask & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q));
            lane_v[m] = _mm512_mask_mov_ps(lane_v[m], take, v);
            lane_i[m] = _mm512_mask_mov_epi32(lane_i[m], take, cols);
          }
        }
      }
    }
    if (argmax) {
      for (int m = 0; m < M; ++m) {
        alignas(64) float v[16];
        alignas(64) int32_t i[16];
        _mm512_store_ps(v, lane_v[m]);
        _mm512_store_si512(i, lane_i[m]);
        float bv = -INFINITY;
        int64_t bi = -1;
        for (int l = 0; l < 16; ++l)
          if (i[l] >= 0 && (bi < 0 || v[l] > bv || (v[l] == bv && i[l] < bi))) bv = v[l], bi = i[l];
        best_v[id * M + m] = bv;
        best_i[id * M + m] = bi;
      }
    }
  }
  if (argmax) {
    for (int m = 0; m < M; ++m) {  // threads in column order: a later one wins only with a larger number
      float bv = -INFINITY;
      int64_t bi = -1;
      for (int t = 0; t < num_threads; ++t) {
        const int64_t i = best_i[t * M + m];
        if (i >= 0 && (bi < 0 || best_v[t * M + m] > bv)) bv = best_v[t * M + m], bi = i;
      }
      argmax[m] = bi < 0 ? 0 : bi;
    }
  }
}

// ---- more rows over the packed layout: the lanes over weight columns ----
// MR rows of x against NV packed tiles (16 weight rows each): MR * NV accumulators, lane i of acc[m][j]
// the output (m0 + m, 16 (t0 + j) + i). Each pair of a row of x is broadcast straight from x (no copy of x
// in another layout) against the NV tiles' 64-byte vectors of that pair, so every output is one lane
// accumulating the K pairs in order from zero (an odd K's last pair (x_last, 0) x (w_last, 0)): the order
// of gemm_bf16 and of skinny_bf16_packed, and VDPBF16PS's two products per lane are the same whichever
// operand is broadcast, so the bits are theirs. Rows from `rows` on repeat the last row and are not
// stored. prefetch (or null): NV * pairs cache lines to bring into L2 meanwhile (the next tiles).
//
// SILU (a gate/up product [gate; up], N = 2 I): tiles j < NV / 2 are gate tiles t0 + j and tiles j >= NV / 2
// the up tiles of the same index, `ustride` words after them; each gate output and its up output are
// rounded as store_row rounds them (with their biases), then silu(gate) * up as tidal_silu_and_mul computes
// it from those stored values (s = round(g / (1 + exp(-g))); round(s * u)), stored at out's columns
// 16 (t0 + j) of rows I apart: the bits of the product followed by silu-and-mul, without the product's
// [M, N] output (store_block_silu's epilogue, from the registers). prefetch: the next gate tiles' lines,
// and as many `ustride` words on (the next up tiles').
template <int MR, int NV, bool SILU = false>
static inline void cols_tile(const uint16_t* x, int64_t K, int64_t m0, int rows, const uint32_t* w0,
                             int64_t tstride, const uint16_t* bias, uint16_t* out, int64_t N, int64_t t0,
                             const char* prefetch, int64_t ustride = 0) {
  constexpr int NG = SILU ? NV / 2 : NV;  // the tiles side by side in memory
  static_assert(!SILU || NV % 2 == 0, "gate and up tiles in pairs");
  const int64_t full = K / 2;
  const uint16_t* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = x + (m0 + std::min(m, rows - 1)) * K;
  const uint32_t* wj[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) wj[j] = w0 + (j % NG) * tstride + (j / NG) * ustride;
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < full; ++p) {
    if (prefetch) {
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j)
        _mm_prefetch(prefetch + (p * NG + j % NG) * 64 + (j / NG) * ustride * 4, _MM_HINT_T1);
    }
    __m512bh wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wj[j] + p * 16);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      int32_t xp;
      std::memcpy(&xp, xr[m] + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  if (K % 2) {
    __m512bh wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wj[j] + full * 16);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)xr[m][K - 1]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  // every index into acc a constant (the loops unrolled, the rows past `rows` skipped by a test), so that
  // the sums never leave the registers: an index that varies would put the whole array on the stack
  if constexpr (SILU) {
    const int64_t cols = N / 2;
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) {
      const int64_t n0 = (t0 + j) * 16;
      const __m512 bg = load_bias(bias, n0, 0xffff), bu = load_bias(bias, cols + n0, 0xffff);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
        if (m < rows) {
          const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(rounded_bits(acc[m][j], bg), 16));
          const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(rounded_bits(acc[m][j + NG], bu), 16));
          const __m512 s = simd::round_bf16(simd::silu(g));
          const __m256i v = _mm512_cvtepi32_epi16(_mm512_srli_epi32(simd::bf16_bits(_mm512_mul_ps(s, u)), 16));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + m) * cols + n0), v);
        }
    }
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const int64_t n0 = (t0 + j) * 16;
      const __mmask16 nmask = (__mmask16)((1u << std::min<int64_t>(16, N - n0)) - 1);
      const __m512 b = load_bias(bias, n0, nmask);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
        if (m < rows) store_row(acc[m][j], b, nmask, out + (m0 + m) * N + n0);
    }
  }
}

// Blocks of rows of x in order (~192 KiB of bf16 rows, whole panels of MR: block_rows), and in each the groups
// [0, groups) handed to the threads statically (the same groups to a thread in every block, no barrier between
// blocks): group(g, b0, b1).
template <int MR> static inline int64_t block_rows(int64_t K) {
  return std::max<int64_t>(MR, (192 * 1024) / (2 * K) / MR * MR);
}

template <class Group>
static void over_blocks(int64_t M, int64_t block, int64_t groups, int num_threads, const Group& group) {
#pragma omp parallel num_threads(num_threads)
  for (int64_t b0 = 0; b0 < M; b0 += block) {
    const int64_t b1 = std::min(M, b0 + block);
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < groups; ++g) group(g, b0, b1);
  }
}

// gemm_bf16 over the packed layout for any M: blocks of rows of x of ~192 KiB (in L2), and in each block
// every group of NV tiles (their K pairs in L2; the groups handed to the threads statically, the same
// groups to a thread in every block, no barrier between blocks) against the block's panels of MR rows.
// The first panel of a group asks for the next group's tiles, so a weight too large for the caches (an
// LM head) streams from memory while the block computes. Unlike gemm_bf16 on plain rows, x is read where
// it is: no copy of it in another layout (docs/cpu.md, "The bf16 products").
static void gemm_bf16_cols(const uint16_t* x, const uint32_t* wpk, const uint16_t* bias, uint16_t* out, int64_t M,
                           int64_t N, int64_t K, int num_threads) {
  if (amx::usable()) {
    amx::gemm(x, amx::Weights{amx::Weights::PACKED, wpk, {nullptr, 0}, N, K}, bias, out, M, num_threads);
    return;
  }
  constexpr int MR = 8, NV = 3;  // 24 accumulators, 3 weight vectors and a broadcast: 28 of 32 registers
  const int64_t pairs = (K + 1) / 2, tstride = pairs * 16;
  const int64_t tiles = (N + 15) / 16, groups = (tiles + NV - 1) / NV;
  const int64_t block = block_rows<MR>(K);
  over_blocks(M, block, groups, num_threads, [&](int64_t g, int64_t b0, int64_t b1) {
    const int64_t t0 = g * NV;
    const int nv = (int)std::min<int64_t>(NV, tiles - t0);
    const uint32_t* w0 = wpk + t0 * tstride;
    const char* next = g + 1 < groups ? reinterpret_cast<const char*>(w0 + NV * tstride) : nullptr;
    for (int64_t m0 = b0; m0 < b1; m0 += MR, next = nullptr) {
      const int rows = (int)std::min<int64_t>(MR, b1 - m0);
      switch (nv) {  // a last group of fewer tiles
        case 3: cols_tile<MR, 3>(x, K, m0, rows, w0, tstride, bias, out, N, t0, next); break;
        case 2: cols_tile<MR, 2>(x, K, m0, rows, w0, tstride, bias, out, N, t0, nullptr); break;
        default: cols_tile<MR, 1>(x, K, m0, rows, w0, tstride, bias, out, N, t0, nullptr); break;
      }
    }
  });
}

// gemm_bf16_cols of a gate/up product [gate; up] (N = 2 I, I a multiple of 16) with silu-and-mul in the
// epilogue (cols_tile's SILU): out [M, I]. Each group is one gate tile and its up tile, against panels of 8
// rows (16 accumulators; 6 rows against two gate tiles and their up tiles, or 12 rows against one, were
// slower on a Zen 4).
static void gemm_bf16_cols_silu(const uint16_t* x, const uint32_t* wpk, const uint16_t* bias, uint16_t* out,
                                int64_t M, int64_t N, int64_t K, int num_threads) {
  constexpr int MR = 8;
  const int64_t pairs = (K + 1) / 2, tstride = pairs * 16;
  const int64_t gate_tiles = N / 32, ustride = gate_tiles * tstride;
  const int64_t block = block_rows<MR>(K);
  over_blocks(M, block, gate_tiles, num_threads, [&](int64_t t0, int64_t b0, int64_t b1) {
    const uint32_t* w0 = wpk + t0 * tstride;
    const char* next = t0 + 1 < gate_tiles ? reinterpret_cast<const char*>(w0 + tstride) : nullptr;
    for (int64_t m0 = b0; m0 < b1; m0 += MR, next = nullptr)
      cols_tile<MR, 2, true>(x, K, m0, (int)std::min<int64_t>(MR, b1 - m0), w0, tstride, bias, out, N, t0, next,
                             ustride);
  });
}
#endif

extern "C" {
// x [M, K] fp32, w [N, K] bf16, bias [N] fp32 or null, out [M, N] fp32; all contiguous.
void tidal_linear_f32_bf16w(const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t N,
                            int64_t K, int num_threads) {
  linear_f32_bf16w(static_cast<const float*>(x), static_cast<const uint16_t*>(w), static_cast<const float*>(bias),
                   static_cast<float*>(out), M, N, K, num_threads);
}

// x [M, K] fp32, wpk the packed bf16 weight of [N, K] (tidal.layers.cpu_kernels.pack_bf16_weight), bias
// [N] fp32 or null, out [M, N] fp32; any M >= 1. Each output one fp32 FMA chain over k in order, then +
// bias, whatever M is (see packed_f32). Returns 0 when it ran, -1 when this build has no vector path.
// The greedy screen of a plain bf16 weight w [N, K] (see greedy): wq [ceil(N / 16), ceil(K / 2), 16, 2] int8,
// ws, a, b [ceil(N / 16) * 16] fp32 (zero rows past N; scale 1). Returns -1 (nothing usable) when w has a value
// that is not finite.
int tidal_greedy_screen_bf16(const void* w, int64_t N, int64_t K, void* wq, void* ws, void* a, void* b,
                             int num_threads) {
  const auto wb = static_cast<const uint16_t*>(w);
  const int64_t pairs = (K + 1) / 2, tiles = (N + 15) / 16;
  const double c = double(4 * pairs + 64) * std::ldexp(1.0, -24);  // the fp32 chain's error, doubled
  auto q8 = static_cast<int8_t*>(wq);
  auto up = [](double v) { const float f = float(v); return double(f) < v ? std::nextafter(f, INFINITY) : f; };
  int bad = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : bad)
  for (int64_t n = 0; n < tiles * 16; ++n) {
    const uint16_t* row = wb + n * K;
    float amax = 0.f;
    for (int64_t k = 0; n < N && k < K; ++k) {
      const float v = bf16_to_float(row[k]);
      if (!std::isfinite(v)) bad = 1;
      amax = std::max(amax, std::fabs(v));
    }
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    double e2 = 0, w2 = 0, q2 = 0;
    int8_t* dst = q8 + (n / 16) * pairs * 32 + (n % 16) * 2;
    for (int64_t k = 0; k < 2 * pairs; ++k) {
      const float v = n < N && k < K ? bf16_to_float(row[k]) : 0.f;
      const float q = std::min(127.f, std::max(-127.f, std::nearbyint(v / s)));
      dst[(k / 2) * 32 + k % 2] = static_cast<int8_t>(q);
      const double wqv = double(q) * double(s), e = double(v) - wqv;
      e2 += e * e;
      w2 += double(v) * v;
      q2 += wqv * wqv;
    }
    static_cast<float*>(ws)[n] = s;
    static_cast<float*>(a)[n] = up(std::sqrt(e2) + c * std::sqrt(w2));
    static_cast<float*>(b)[n] = up(std::sqrt(q2));
  }
  return bad ? -1 : 0;
}

// Greedy rows (fp32 x, bf16 weight packed at load, its int8 screen: see greedy above): argmax[m] for every
// row. Returns 0 when it ran, -1 when it does not apply here (the caller computes the logits).
int tidal_linear_f32_bf16_packed_greedy(const void* x, const void* wpk, const void* wq, const void* ws, const void* a,
                                        const void* b, int64_t M, int64_t N, int64_t K, int64_t n_valid,
                                        int num_threads, int64_t* argmax) {
#if defined(TIDAL_VEC) && defined(__AVX2__)
  return greedy(static_cast<const float*>(x), static_cast<const uint32_t*>(wpk), static_cast<const int8_t*>(wq),
                static_cast<const float*>(ws), static_cast<const float*>(a), static_cast<const float*>(b), M, N, K,
                n_valid, num_threads, argmax);
#else
  (void)x; (void)wpk; (void)wq; (void)ws; (void)a; (void)b; (void)M; (void)N; (void)K; (void)n_valid;
  (void)num_threads; (void)argmax;
  return -1;
#endif
}

int tidal_linear_f32_bf16_packed(const void* x, const void* wpk, const void* bias, void* out, int64_t M, int64_t N,
                                 int64_t K, int num_threads) {
#if defined(TIDAL_VEC)
  if (M < 1) return -1;
  packed_f32::linear(static_cast<const float*>(x), static_cast<const uint32_t*>(wpk), static_cast<const float*>(bias),
                     static_cast<float*>(out), M, N, K, num_threads);
  return 0;
#else
  (void)x; (void)wpk; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}

// x [M, K] fp32, wpk the packed weight of a gate/up product [gate; up] of [N, K] (N = 2 I), bias [N] fp32 or
// null, out [M, I] fp32 = silu(gate) * up: bitwise tidal_linear_f32_bf16_packed followed by tidal_silu_and_mul,
// without the product's [M, N] output (packed_f32::blocked_silu). From 5 rows (fewer stream the weight once:
// skinny); returns -1 when it does not apply (fewer rows, I not a multiple of 16, no vector build).
int tidal_linear_f32_bf16_packed_silu(const void* x, const void* wpk, const void* bias, void* out, int64_t M,
                                      int64_t N, int64_t K, int num_threads) {
#if defined(TIDAL_VEC)
  if (M < 5 || N % 32 != 0) return -1;
  packed_f32::blocked_silu(static_cast<const float*>(x), static_cast<const uint32_t*>(wpk),
                           static_cast<const float*>(bias), static_cast<float*>(out), M, N, K, num_threads);
  return 0;
#else
  (void)x; (void)wpk; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
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

// x [M, K] fp32, w [N, K] fp32, bias [N] fp32 or null, out [M, N] fp32; all contiguous. Each output is
// the dot product of dot_tile's order whatever M is (batch-invariant mode's fp32 products).
void tidal_linear_f32(const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t N, int64_t K,
                      int num_threads) {
  linear_f32<false>(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<const float*>(bias),
                    static_cast<float*>(out), M, N, K, num_threads);
}

// As tidal_skinny_gemm_bf16 (M 1..4), in tidal_gemm_bf16's order: a row's bits are those it gets from
// tidal_gemm_bf16 in any batch. -1 when M is outside 1..4 or this build has no AVX-512 BF16.
int tidal_skinny_gemm_bf16_ordered(const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t N,
                                   int64_t K, int num_threads) {
#if defined(__AVX512BF16__)
  auto xs = static_cast<const uint16_t*>(x);
  auto ws = static_cast<const uint16_t*>(w);
  auto bs = static_cast<const uint16_t*>(bias);
  auto os = static_cast<uint16_t*>(out);
  switch (M) {
    case 1: skinny_bf16_ordered<1>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 2: skinny_bf16_ordered<2>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 3: skinny_bf16_ordered<3>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 4: skinny_bf16_ordered<4>(xs, ws, bs, os, N, K, num_threads); return 0;
    default: return -1;
  }
#else
  (void)x; (void)w; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}

// 1 when the bf16-activation products run on AMX tiles here (see namespace amx), else 0
int tidal_gemm_amx() {
#if defined(__AVX512BF16__)
  return amx::usable() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 when the tiles' int8 products run here as well (the LM head's screen: amx::screen_argmax), else 0
int tidal_gemm_amx_int8() {
#if defined(__AVX512BF16__)
  return simd::amx_int8_usable() ? 1 : 0;
#else
  return 0;
#endif
}

// x [M, K], w [N, K], bias [N] (or null), out [M, N], all bf16 and contiguous, any M >= 1. Returns 0
// when it ran, -1 when this build has no AVX-512 BF16 (the caller uses its fallback).
int tidal_gemm_bf16(const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t N, int64_t K,
                    int num_threads) {
#if defined(__AVX512BF16__)
  if (M < 1) return -1;
  gemm_bf16<Tiles::PLAIN>(static_cast<const uint16_t*>(x), w, static_cast<const uint16_t*>(bias),
            static_cast<uint16_t*>(out), M, N, K, num_threads);
  return 0;
#else
  (void)x; (void)w; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}

// x [M, K] bf16, wpk the packed weight of [N, K] (see skinny_bf16_packed), bias [N] bf16 or null, out
// [M, N] bf16; any M >= 1, and a row's bits are those of tidal_gemm_bf16 on the plain weight. Returns 0
// when it ran, -1 when this build has no AVX-512 BF16.
int tidal_gemm_bf16_packed(const void* x, const void* wpk, const void* bias, void* out, int64_t M, int64_t N,
                           int64_t K, int num_threads) {
#if defined(__AVX512BF16__)
  auto xs = static_cast<const uint16_t*>(x);
  auto ws = static_cast<const uint32_t*>(wpk);
  auto bs = static_cast<const uint16_t*>(bias);
  auto os = static_cast<uint16_t*>(out);
  switch (M) {
    case 1: skinny_bf16_packed<1>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 2: skinny_bf16_packed<2>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 3: skinny_bf16_packed<3>(xs, ws, bs, os, N, K, num_threads); return 0;
    case 4: skinny_bf16_packed<4>(xs, ws, bs, os, N, K, num_threads); return 0;
    default:
      if (M < 1) return -1;
      gemm_bf16_cols(xs, ws, bs, os, M, N, K, num_threads);
      return 0;
  }
#else
  (void)x; (void)wpk; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}
// x [M, K] bf16, wpk the packed weight of a gate/up product [gate; up] of [N, K] (N = 2 I), bias [N] bf16 or
// null, out [M, I] bf16 = silu(gate) * up: bitwise tidal_gemm_bf16_packed followed by tidal_silu_and_mul,
// without the product's [M, N] output. Runs on the AMX tiles from 5 rows (the rows the packed product takes
// there); returns -1 when it does not apply (no AMX, fewer rows, I not a multiple of 16) and nothing ran.
int tidal_gemm_bf16_packed_silu(const void* x, const void* wpk, const void* bias, void* out, int64_t M, int64_t N,
                                int64_t K, int num_threads) {
#if defined(__AVX512BF16__)
  if (M < 5 || N % 32 != 0) return -1;
  if (amx::usable())
    amx::gemm(static_cast<const uint16_t*>(x), amx::Weights{amx::Weights::PACKED, wpk, {nullptr, 0}, N, K},
              static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), M, num_threads, true);
  else
    gemm_bf16_cols_silu(static_cast<const uint16_t*>(x), static_cast<const uint32_t*>(wpk),
                        static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), M, N, K, num_threads);
  return 0;
#else
  (void)x; (void)wpk; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}

// Greedy rows on the AMX tiles: argmax[m] for each row of x [M, K] (bf16, any M >= 1) against the packed
// weight of [N, K] (plus bias, or null), the first column < n_valid of the row's largest output: what
// tidal_argmax_rows gives on tidal_gemm_bf16_packed's output [:, :n_valid], found as the tiles' sums are
// rounded, without storing that output (an LM head's [M, vocabulary] logits, a few MB that nothing reads
// when every row samples greedily). Returns -1 (nothing run) without AMX.
int tidal_gemm_bf16_packed_greedy(const void* x, const void* wpk, const void* bias, int64_t M, int64_t N, int64_t K,
                                  int num_threads, int64_t* argmax, int64_t n_valid) {
#if defined(__AVX512BF16__)
  if (M < 1 || n_valid < 1 || !amx::usable()) return -1;
  amx::gemm(static_cast<const uint16_t*>(x), amx::Weights{amx::Weights::PACKED, wpk, {nullptr, 0}, N, K},
            static_cast<const uint16_t*>(bias), nullptr, M, num_threads, false, argmax, n_valid);
  return 0;
#else
  (void)x; (void)wpk; (void)bias; (void)M; (void)N; (void)K; (void)num_threads; (void)argmax; (void)n_valid;
  return -1;
#endif
}

// Greedy rows on the tiles through the LM head's int8 screen (amx::screen_argmax): argmax[m] as
// tidal_gemm_bf16_packed_greedy gives it (no bias), reading the screen's int8 weight wq (the int8 unit's
// layout: [ceil(N / 16), ceil(K / 64), 16, 16, 4]) and, for a few candidate tiles a row, the packed bf16
// weight; ws, a, b the screen's per-row scale and bound terms (tidal_greedy_screen_bf16's), w_bound the largest
// of a and b. Returns -1 (the caller runs the whole product) without AMX-INT8, or when x is not finite or the
// values could overflow.
int tidal_gemm_bf16_packed_screen(const void* x, const void* wpk, const void* wq, const void* ws, const void* a,
                                  const void* b, float w_bound, int64_t M, int64_t N, int64_t K, int64_t n_valid,
                                  int num_threads, int64_t* argmax) {
#if defined(__AVX512BF16__)
  if (!amx::usable()) return -1;
  return amx::screen_argmax(static_cast<const uint16_t*>(x), static_cast<const uint32_t*>(wpk),
                            static_cast<const int8_t*>(wq), static_cast<const float*>(ws), static_cast<const float*>(a),
                            static_cast<const float*>(b), w_bound, M, N, K, n_valid, num_threads, argmax);
#else
  (void)x; (void)wpk; (void)wq; (void)ws; (void)a; (void)b; (void)w_bound; (void)M; (void)N; (void)K;
  (void)n_valid; (void)num_threads; (void)argmax;
  return -1;
#endif
}

// tidal_gemm_bf16_packed for M 1..4, and argmax[m] = the first column < n_valid of row m's largest output
// (tidal_argmax_rows on out[:, :n_valid]). Returns -1 (nothing run) for other M or without AVX-512 BF16.
int tidal_gemm_bf16_packed_argmax(const void* x, const void* wpk, const void* bias, void* out, int64_t M, int64_t N,
                                  int64_t K, int num_threads, int64_t* argmax, int64_t n_valid) {
#if defined(__AVX512BF16__)
  auto xs = static_cast<const uint16_t*>(x);
  auto ws = static_cast<const uint32_t*>(wpk);
  auto bs = static_cast<const uint16_t*>(bias);
  auto os = static_cast<uint16_t*>(out);
  n_valid = std::min(n_valid, N);
  switch (M) {
    case 1: skinny_bf16_packed<1>(xs, ws, bs, os, N, K, num_threads, argmax, n_valid); return 0;
    case 2: skinny_bf16_packed<2>(xs, ws, bs, os, N, K, num_threads, argmax, n_valid); return 0;
    case 3: skinny_bf16_packed<3>(xs, ws, bs, os, N, K, num_threads, argmax, n_valid); return 0;
    case 4: skinny_bf16_packed<4>(xs, ws, bs, os, N, K, num_threads, argmax, n_valid); return 0;
    default: return -1;
  }
#else
  (void)x; (void)wpk; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads; (void)argmax;
  (void)n_valid;
  return -1;
#endif
}

// x [M, K] bf16, bias [N] bf16 or null, out [M, N] bf16, any M >= 1; the weight w [N, K] in another
// format, whose rows fn (a function of a sibling library, e.g. gguf_gemm.cpp's tidal_gguf_rows_bf16)
// turns into plain bf16 rows 16 at a time. Each output is tidal_gemm_bf16's on the plain bf16 weight of
// those rows, for any M (1-4 rows through skinny_bf16_ordered), so a row's bits never depend on the batch. Returns 0 when it ran, -1 when this build has no AVX-512 BF16.
int tidal_gemm_bf16_rows(const void* x, const void* w, void* fn, int format, const void* bias, void* out, int64_t M,
                         int64_t N, int64_t K, int num_threads) {
#if defined(__AVX512BF16__)
  if (M < 1 || fn == nullptr) return -1;
  const RowSource src{reinterpret_cast<rows_fn>(fn), format};
  auto xs = static_cast<const uint16_t*>(x);
  auto bs = static_cast<const uint16_t*>(bias);
  auto os = static_cast<uint16_t*>(out);
  switch (M) {  // 1-4 rows: the lanes over the tile's weight rows (skinny_bf16_ordered), the same order
    case 1: skinny_bf16_ordered<1>(xs, w, bs, os, N, K, num_threads, src); return 0;
    case 2: skinny_bf16_ordered<2>(xs, w, bs, os, N, K, num_threads, src); return 0;
    case 3: skinny_bf16_ordered<3>(xs, w, bs, os, N, K, num_threads, src); return 0;
    case 4: skinny_bf16_ordered<4>(xs, w, bs, os, N, K, num_threads, src); return 0;
    default: gemm_bf16<Tiles::ROWS>(xs, w, bs, os, M, N, K, num_threads, src); return 0;
  }
#else
  (void)x; (void)w; (void)fn; (void)format; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}
// x [M, K] fp32, bias [N] fp32 or null, out [M, N] fp32, M > 8 (batches and prompt chunks; fewer rows are
// the caller's streaming kernel's); the weight w [N, K] in another format, whose blocks of rows fn (e.g.
// gguf_gemm.cpp's tidal_gguf_rows_f32) makes in fp32 into the blocked path's L2 buffer, where the bf16
// path widens its rows. Returns 0 when it ran, -1 otherwise (M <= 8, a build without vectors).
int tidal_linear_f32_rows(const void* x, const void* w, void* fn, int format, const void* bias, void* out, int64_t M,
                          int64_t N, int64_t K, int num_threads) {
#if defined(TIDAL_VEC)
  if (M <= kSkinnyMaxRows || fn == nullptr) return -1;
  const RowSource src{reinterpret_cast<rows_fn>(fn), format};
  const float* xs = static_cast<const float*>(x);
  float* os = static_cast<float*>(out);
  // chunks of rows as large as about 4 MiB of activations (L3): each chunk dequantizes the whole weight
  // again, which costs more than widening bf16 (linear_f32's 256 KiB chunks stay in L2)
  const int64_t chunk = std::max<int64_t>(kSkinnyMaxRows + 1, (4 << 20) / (4 * K));
  for (int64_t m0 = 0; m0 < M; m0 += chunk)
    blocked_f32<false>(xs + m0 * K, static_cast<const float*>(w), static_cast<const float*>(bias), os + m0 * N,
                       std::min(chunk, M - m0), N, K, num_threads, src);
  return 0;
#else
  (void)x; (void)w; (void)fn; (void)format; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)num_threads;
  return -1;
#endif
}
// Rows ids[0, n) of a weight [rows, k] held packed (pack_bf16_weight: pair p of row 16t + i at 32-bit word
// (t * pairs + p) * 16 + i) as plain bf16 rows out [n, k]: an embedding lookup in a table packed for the
// LM head tied to it (each row: k / 2 words 64 bytes apart). Returns -1 (writing nothing) when an id is
// outside [0, rows).
int tidal_unpack_bf16_rows(const void* packed, const int64_t* ids, int64_t n, int64_t rows, int64_t k, void* out,
                           int num_threads) {
  for (int64_t r = 0; r < n; ++r)
    if (ids[r] < 0 || ids[r] >= rows) return -1;
  const int64_t pairs = (k + 1) / 2;
  const uint32_t* words = static_cast<const uint32_t*>(packed);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= 16)
  for (int64_t r = 0; r < n; ++r) {
    const uint32_t* src = words + (ids[r] / 16) * pairs * 16 + ids[r] % 16;
    uint16_t* dst = static_cast<uint16_t*>(out) + r * k;
    for (int64_t p = 0; p < k / 2; ++p) std::memcpy(dst + 2 * p, src + p * 16, 4);  // (w[2p], w[2p + 1])
    if (k % 2) dst[k - 1] = static_cast<uint16_t>(src[(pairs - 1) * 16] & 0xffffu);  // (w[k - 1], 0)
  }
  return 0;
}
}
