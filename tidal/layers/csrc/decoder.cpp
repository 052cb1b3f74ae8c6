// A Llama-family decoder stack run from one native call: the embedding lookup (a first stage's, from token
// ids), then for each layer the fused residual + RMSNorm, the QKV product, rotary, the KV-cache write, paged
// attention, the output product, the second RMSNorm, gate/up, silu-and-mul and the down product, in that
// order, then the final RMSNorm (a last stage's), through the same kernels the Python layers
// call one by one (their addresses come from the other libraries: cpu_kernels.cpp, gemm.cpp,
// gguf_gemm.cpp, quant_gemm.cpp). The results are therefore bitwise those of the layer-by-layer path;
// what goes is the per-op cost of Python, ctypes and tensor allocation, which on a small model's decode
// step is comparable to the products themselves (tidal/layers/native_decoder.py).
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#include "simd.h"

namespace {

// one linear layer: out[M, n] = x[M, k] @ W^T (+ bias), by the kernel its Python method would call
struct Linear {
  int32_t kind;     // 0 gemm-style fn(x, w, bias, out, M, N, K, threads); 1 tidal_gguf_linear; 2 rows kernel;
                    // 3 tidal_w8a16_linear; 4 tidal_w8a8_linear
  int32_t fmt;      // GGUF block type (kinds 1, 2); weight type (kind 3: 0 int8, 1 E4M3, | 2 bf16 tiles); for kind 0,
                    // 1: the kernel returns nothing
  const void* fn;
  const void* w;
  const void* bias;
  const void* aux;  // kind 2: the row maker; kinds 3, 4: the per-row scales
  const void* aux2; // kind 4: the weight's row sums
  int64_t n, k;
};

struct Layer {
  Linear qkv, o, gate_up, down;
  const void* in_norm;
  const void* post_norm;
  void* k_cache;
  void* v_cache;
  float k_scale, v_scale;
  int32_t kv_dtype, pad;
  const float* k_shift;  // an E4M3 cache's mean key, or null (tidal_write_kv)
};

struct Model {
  int64_t num_layers, hidden, hq, hk, head_dim, inter, block_size, max_blocks;
  float eps, scale;
  int32_t dtype, threads;
  const void* rms_norm;
  const void* rope;
  const void* write_kv;
  const void* attention;
  const void* silu_and_mul;
  const void* gate_up_silu;  // or null: gate/up and silu-and-mul in one call (tidal_gemm_bf16_packed_silu), where
                             // every layer's gate/up is the packed bf16 product; -1 from it: the two calls
  const float* cos_full;
  const float* sin_signed;
  const Layer* layers;
  const void* final_norm;  // or null: the model's final RMSNorm after the last layer (the last pipeline stage)
  float final_eps;
  // the embedding of the first stage, for a forward from token ids: a table of embed_rows rows [H] in the
  // activations' dtype, read row by row (embed_unpack null), or a bf16 table packed at load, read through
  // embed_unpack (gemm.cpp: tidal_unpack_bf16_rows); null: the caller gives the hidden states
  const void* embed_table;
  const void* embed_unpack;
  int64_t embed_rows;
};

using gemm_fn = int (*)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int);
using gemm_void_fn = void (*)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int);
using gguf_fn = int (*)(const void*, const void*, int, const void*, void*, int64_t, int64_t, int64_t, int, int);
using rows_fn = int (*)(const void*, const void*, const void*, int, const void*, void*, int64_t, int64_t, int64_t,
                        int);
using w8a16_fn = int (*)(const void*, int, const void*, int, const void*, const void*, void*, int64_t, int64_t,
                         int64_t, int);
using rms_norm_fn = void (*)(const void*, const void*, const void*, void*, void*, int64_t, int64_t, float, int, int);
using rope_fn = void (*)(const void*, int64_t, const float*, const float*, const int64_t*, void*, int64_t, int64_t,
                         int64_t, int, int);
using write_kv_fn = void (*)(const void*, int64_t, const void*, int64_t, const int64_t*, void*, void*, int64_t,
                             int64_t, int64_t, int64_t, int, int, float, float, const float*, int);
using attention_fn = void (*)(const void*, int64_t, const void*, const void*, const int64_t*, const int64_t*,
                              const int64_t*, void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int,
                              float, float, int);
using w8a8_fn = int (*)(const void*, int, const void*, const void*, const void*, const void*, void*, int64_t,
                        int64_t, int64_t, int);
using silu_fn = int (*)(const void*, void*, int64_t, int64_t, int, int);
using unpack_fn = int (*)(const void*, const int64_t*, int64_t, int64_t, int64_t, void*, int);

int run_linear(const Linear& l, const void* x, void* out, int64_t M, int dtype, int threads) {
  switch (l.kind) {
    case 0:
      if (l.fmt == 1) {
        reinterpret_cast<gemm_void_fn>(l.fn)(x, l.w, l.bias, out, M, l.n, l.k, threads);
        return 0;
      }
      return reinterpret_cast<gemm_fn>(l.fn)(x, l.w, l.bias, out, M, l.n, l.k, threads);
    case 1:
      return reinterpret_cast<gguf_fn>(l.fn)(x, l.w, l.fmt, l.bias, out, M, l.n, l.k, dtype, threads);
    case 2:
      return reinterpret_cast<rows_fn>(l.fn)(x, l.w, l.aux, l.fmt, l.bias, out, M, l.n, l.k, threads);
    case 3:
      return reinterpret_cast<w8a16_fn>(l.fn)(x, dtype, l.w, l.fmt, l.aux, l.bias, out, M, l.n, l.k, threads);
    case 4:
      return reinterpret_cast<w8a8_fn>(l.fn)(x, dtype, l.w, l.aux2, l.aux, l.bias, out, M, l.n, l.k, threads);
    default:
      return 1;
  }
}

// The activations' scratch of a forward over T rows: normed, res2, qkv, qk, attn, gate_up, act, out, each
// on cache lines (a row that straddles two costs the tile loads and the products' stores twice the traffic;
// a 4,096-token prompt step's products ran at half the speed on malloc's 16-byte alignment). Returns the
// bytes, and each buffer's offset in offsets.
constexpr int kBuffers = 8;
constexpr int kGateUp = 5;  // never written where gate/up and silu-and-mul run as one product
constexpr int64_t kKeepBytes = int64_t{128} << 20;

int64_t scratch_layout(int64_t H, int64_t hq, int64_t hk, int64_t D, int64_t I, int64_t es, int64_t T,
                       int64_t* offsets) {
  const int64_t q_size = hq * D, kv_size = hk * D, qkv_size = q_size + 2 * kv_size;
  const int64_t sizes[kBuffers] = {T * H, T * H, T * qkv_size, T * (q_size + kv_size), T * q_size, T * 2 * I, T * I,
                                   T * H};
  int64_t total = 0;
  for (int i = 0; i < kBuffers; ++i) {
    offsets[i] = total;
    total += (sizes[i] * es + 63) / 64 * 64;
  }
  return total;
}

// Scratch memory that grows without being written: a std::vector's resize would zero (and copy) it on the
// calling thread alone, page faults included, while the other threads wait (a server's first 2,048-token
// step took ~100 ms longer on the AMX Xeon guest); here each page is first written by the kernel that
// fills it, on whichever thread computes it.
struct Scratch {
  uint8_t* data = nullptr;
  int64_t size = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { release(); }
  void release() {
    if (data != nullptr) ::operator delete(data, std::align_val_t{64});
    data = nullptr;
    size = 0;
  }
  uint8_t* reserve(int64_t bytes) {
    if (bytes > size) {
      release();
      data = static_cast<uint8_t*>(::operator new(static_cast<size_t>(bytes), std::align_val_t{64}, std::nothrow));
      size = data != nullptr ? bytes : 0;
    }
    return data;
  }
};

thread_local Scratch kept;

}  // namespace

extern "C" {

// Make the calling thread's kept scratch as large as m's forward over T rows needs (up to kKeepBytes) and
// write each of its pages once, the threads splitting them (not the gate/up product's buffer where m runs
// gate/up and silu-and-mul as one product, which never writes it), so that the first forward of that
// size does not take the page faults. For where the engine is idle (a server's first idle moment), on the
// thread that runs the forwards. Returns the bytes written (0 beyond kKeepBytes: such forwards make their
// scratch for the call), or -1 when the memory could not be had.
int64_t tidal_decoder_reserve(const Model* m, int64_t T) {
  int64_t offsets[kBuffers];
  const int64_t total = scratch_layout(m->hidden, m->hq, m->hk, m->head_dim, m->inter, m->dtype == 0 ? 4 : 2, T,
                                       offsets);
  if (total > kKeepBytes) return 0;
  uint8_t* p = kept.reserve(total);
  if (p == nullptr) return -1;
  const bool skip = m->gate_up_silu != nullptr;
  const int64_t skip_begin = skip ? offsets[kGateUp] : total, skip_end = skip ? offsets[kGateUp + 1] : total;
  const int64_t pages = (total + 4095) / 4096;
  int64_t written = 0;
#pragma omp parallel for schedule(static) num_threads(m->threads) reduction(+ : written)
  for (int64_t i = 0; i < pages; ++i) {
    const int64_t at = i * 4096;
    if (at >= skip_begin && at < skip_end) continue;
    p[at] = 0;
    written += std::min<int64_t>(4096, total - at);
  }
  return written;
}

// hidden [T, H] in: the embeddings (or the previous stage's hidden states), or, with ids [T] (m's embedding),
// unset: the rows of ids are looked up here; residual [T, H]: the residual coming in when has_residual, else
// unset. Both out: the last layer's output and residual, as the Python layers return them; or, where m has a
// final norm, hidden the final RMSNorm's output and residual unset. positions, slots, token_rows, seq_lens [T]
// int64; block_table [*, max_blocks]. Returns 2 (having done nothing) for an id outside the embedding's
// table, else non-zero when a kernel refused (nothing is half-done that a rerun of the Python layers would not
// redo: the KV writes are idempotent).
int tidal_decoder_forward(const Model* m, void* hidden, void* residual, int has_residual, const int64_t* positions,
                          const int64_t* slots, const int64_t* block_table, const int64_t* token_rows,
                          const int64_t* seq_lens, int64_t T, const int64_t* out_rows, int64_t n_out,
                          const int64_t* ids) {
  const int64_t es = m->dtype == 0 ? 4 : 2;
  const int64_t H = m->hidden, D = m->head_dim, hq = m->hq, hk = m->hk;
  if (ids != nullptr) {  // the embedding: the bytes the Python lookup returns
    if (m->embed_table == nullptr) return 1;
    for (int64_t t = 0; t < T; ++t)
      if (ids[t] < 0 || ids[t] >= m->embed_rows) return 2;
    if (m->embed_unpack != nullptr) {
      if (reinterpret_cast<unpack_fn>(m->embed_unpack)(m->embed_table, ids, T, m->embed_rows, H, hidden,
                                                        m->threads) != 0)
        return 2;
    } else {
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(static_cast<uint8_t*>(hidden) + t * H * es,
                    static_cast<const uint8_t*>(m->embed_table) + ids[t] * H * es, H * es);
    }
  }
  const int64_t q_size = hq * D, kv_size = hk * D, qkv_size = q_size + 2 * kv_size, I = m->inter;
  // the activations' buffers (scratch_layout): kept between calls up to kKeepBytes (a decode step's few
  // kilobytes, a prompt chunk's megabytes), made for the call alone beyond
  int64_t offsets[kBuffers];
  const int64_t total = scratch_layout(m->hidden, hq, hk, D, I, es, T, offsets);
  Scratch once;
  uint8_t* p = (total <= kKeepBytes ? kept : once).reserve(total);
  if (p == nullptr) return 1;
  void* buf[kBuffers];
  for (int i = 0; i < kBuffers; ++i) buf[i] = p + offsets[i];
  void* normed = buf[0];
  void* res2 = buf[1];
  void* qkv = buf[2];
  void* qk = buf[3];
  void* attn = buf[4];
  void* gate_up = buf[5];
  void* act = buf[6];
  void* out = buf[7];  // the output and down products' output (the caller's hidden is an input)
  const int dt = m->dtype, th = m->threads;
  auto rms_norm = reinterpret_cast<rms_norm_fn>(m->rms_norm);
  auto rope = reinterpret_cast<rope_fn>(m->rope);
  auto write_kv = reinterpret_cast<write_kv_fn>(m->write_kv);
  auto attention = reinterpret_cast<attention_fn>(m->attention);
  auto silu = reinterpret_cast<silu_fn>(m->silu_and_mul);
  // h: the layer's input (then its output), res: the residual stream; both alternate between the caller's
  // buffers and scratch, and are copied back at the end if they finish in scratch
  void* h = hidden;
  void* res = residual;
  void* res_other = res2;
  int64_t R = T;  // the rows carried on: T, or n_out from the last layer's attention on
  std::vector<int64_t> picked_rows, picked_lens;
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const Layer& L = m->layers[l];
    if (l == 0 && !has_residual) {
      std::memcpy(res, h, T * H * es);
      rms_norm(h, nullptr, L.in_norm, normed, nullptr, T, H, m->eps, dt, th);
    } else {
      rms_norm(h, res, L.in_norm, normed, res_other, T, H, m->eps, dt, th);
      std::swap(res, res_other);
    }
    if (run_linear(L.qkv, normed, qkv, T, dt, th)) return 1;
    rope(qkv, qkv_size, m->cos_full, m->sin_signed, positions, qk, T, hq + hk, D, dt, th);
    const uint8_t* v = static_cast<const uint8_t*>(qkv) + (q_size + kv_size) * es;
    const uint8_t* k = static_cast<const uint8_t*>(qk) + q_size * es;
    write_kv(k, q_size + kv_size, v, qkv_size, slots, L.k_cache, L.v_cache, T, hk, D, m->block_size, dt,
             L.kv_dtype, L.k_scale, L.v_scale, L.k_shift, th);
    // the queries are read in place from the [q | k] rows
    const void* q = qk;
    int64_t q_stride = q_size + kv_size;
    const int64_t* rows = token_rows;
    const int64_t* lens = seq_lens;
    if (out_rows != nullptr && l == m->num_layers - 1) {
      // only the rows read after the stage go on: their queries into the qkv buffer (free once the KV
      // write has read it), their residuals compacted, their attention spans picked
      R = n_out;
      picked_rows.resize(R);
      picked_lens.resize(R);
      uint8_t* qdst = static_cast<uint8_t*>(qkv);
      uint8_t* rdst = static_cast<uint8_t*>(res_other);
      for (int64_t j = 0; j < R; ++j) {
        const int64_t t = out_rows[j];
        if (t < 0 || t >= T) return 1;
        std::memcpy(qdst + j * q_size * es, static_cast<const uint8_t*>(qk) + t * q_stride * es, q_size * es);
        std::memcpy(rdst + j * H * es, static_cast<const uint8_t*>(res) + t * H * es, H * es);
        picked_rows[j] = token_rows[t];
        picked_lens[j] = seq_lens[t];
      }
      std::swap(res, res_other);
      q = qkv;
      q_stride = q_size;
      rows = picked_rows.data();
      lens = picked_lens.data();
      if (R == 0) break;  // nothing to read back: the layer's K and V were all it had to give
    }
    attention(q, q_stride, L.k_cache, L.v_cache, block_table, rows, lens, attn, R, hq, hk, D, m->block_size,
              m->max_blocks, m->scale, dt, L.kv_dtype, L.k_scale, L.v_scale, th);
    if (run_linear(L.o, attn, out, R, dt, th)) return 1;
    rms_norm(out, res, L.post_norm, normed, res_other, R, H, m->eps, dt, th);
    std::swap(res, res_other);
    if (!m->gate_up_silu || reinterpret_cast<gemm_fn>(m->gate_up_silu)(normed, L.gate_up.w, L.gate_up.bias, act, R,
                                                                         L.gate_up.n, L.gate_up.k, th) != 0) {
      if (run_linear(L.gate_up, normed, gate_up, R, dt, th)) return 1;
      if (silu(gate_up, act, R, I, dt, th)) return 1;
    }
    if (run_linear(L.down, act, out, R, dt, th)) return 1;
    h = out;
  }
  if (R == 0) return 0;
  if (m->final_norm != nullptr) {  // hidden: norm(h + res), what the final RMSNorm gives (residual: unset)
    rms_norm(h, res, m->final_norm, normed, res_other, R, H, m->final_eps, dt, th);
    std::memcpy(hidden, normed, R * H * es);
    return 0;
  }
  if (h != hidden) std::memcpy(hidden, h, R * H * es);
  if (res != residual) std::memcpy(residual, res, R * H * es);
  return 0;
}

}  // extern "C"
