// The hot path of the shared-memory all-reduce (tidal/distributed/shm_all_reduce.py): publish this
// rank's tensor, wait for the peers', sum every rank's copy in rank order. Plain C ABI, called
// through ctypes (which releases the GIL for the call).
//
// Segment layout (the Python side maps it; offsets in bytes):
//   [0, 64)                      header written once by the creating rank (checked by the others)
//   [64 * (1 + r), +8)           rank r's sequence counter: the last all-reduce whose input it published
//   [data, data + 2 * world * slot_bytes)
//                                two buffers of one slot per rank; all-reduce number `seq` uses buffer
//                                seq % 2
//
// Why two buffers and one counter per rank suffice: a rank publishes number n only after it finished
// number n - 1, reads included. So when a rank starts number n (it has seen every peer publish n - 1),
// every peer is done reading n - 2, the last user of the buffer it is about to overwrite; a slow peer
// may still be reading n - 1, in the other buffer.
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax() { asm volatile("yield" ::: "memory"); }
#else
static inline void cpu_relax() {}
#endif

namespace {

constexpr int64_t kLine = 64;
enum DType { kF32 = 0, kBF16 = 1 };

inline std::atomic<int64_t>* counter(char* base, int rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + kLine * (1 + rank));
}

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16; float f; std::memcpy(&f, &u, 4); return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN to 0x7fc0: as torch does
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Wait until a peer's counter reaches seq. Ranks may share cores with each other and with other
// processes: spin a few microseconds (a peer on another core that is just behind), then yield the
// core at every check (a peer waiting on this core's run queue gets it at once: with two ranks pinned
// to one core an all-reduce took 24 us, against 73 us napping at once and 2.6 us on two cores), then,
// past yield_s, nap in 50 us sleeps so a peer that is far behind costs no CPU. False after timeout_s.
bool wait_for(std::atomic<int64_t>* c, int64_t seq, double timeout_s, double yield_s) {
  for (int i = 0; i < 256; ++i) {
    if (c->load(std::memory_order_acquire) >= seq) return true;
    cpu_relax();
  }
  const double start = now_s();
  for (;;) {
    for (int i = 0; i < 16; ++i) {
      if (c->load(std::memory_order_acquire) >= seq) return true;
      cpu_relax();
    }
    const double waited = now_s() - start;
    if (waited > timeout_s) return c->load(std::memory_order_acquire) >= seq;
    if (waited > yield_s) {
      timespec nap{0, 50 * 1000};
      nanosleep(&nap, nullptr);
    } else {
      sched_yield();
    }
  }
}

template <typename T, typename Load, typename Store>
void sum_slots(char* const* slots, int world, void* dst, int64_t numel, Load load, Store store) {
  T* out = static_cast<T*>(dst);
  const T* s0 = reinterpret_cast<const T*>(slots[0]);
  if (world == 2) {  // the common case, kept simple enough to vectorize
    const T* s1 = reinterpret_cast<const T*>(slots[1]);
    for (int64_t i = 0; i < numel; ++i) out[i] = store(load(s0[i]) + load(s1[i]));
    return;
  }
  for (int64_t i = 0; i < numel; ++i) {
    float acc = load(s0[i]);
    for (int r = 1; r < world; ++r) acc += load(reinterpret_cast<const T*>(slots[r])[i]);
    out[i] = store(acc);
  }
}

}  // namespace

extern "C" {

// Sum `src` (numel elements of dtype, contiguous) over all ranks into `dst` (may alias src). Every
// rank gets the same bits: the sum runs in float32, rank 0 + rank 1 + ... in that order, rounded once
// to the dtype. Returns 0, or -1 after timeout_s with *late_rank set to a rank that never published.
int tidal_shm_all_reduce(void* base_, int64_t data_offset, int64_t slot_bytes, int world, int rank, int64_t seq,
                         const void* src, void* dst, int64_t numel, int dtype, double timeout_s, double yield_s,
                         int* late_rank) {
  char* base = static_cast<char*>(base_);
  const int64_t elem = dtype == kF32 ? 4 : 2;
  char* buffer = base + data_offset + (seq & 1) * world * slot_bytes;
  char* slots[64];
  for (int r = 0; r < world; ++r) slots[r] = buffer + r * slot_bytes;
  std::memcpy(slots[rank], src, numel * elem);
  counter(base, rank)->store(seq, std::memory_order_release);  // the copy above is visible before this
  for (int r = 0; r < world; ++r) {
    if (r != rank && !wait_for(counter(base, r), seq, timeout_s, yield_s)) {
      *late_rank = r;
      return -1;
    }
  }
  if (dtype == kF32) {
    sum_slots<float>(slots, world, dst, numel, [](float v) { return v; }, [](float v) { return v; });
  } else {
    sum_slots<uint16_t>(slots, world, dst, numel, bf16_to_float, float_to_bf16);
  }
  return 0;
}

// Rank `rank`'s counter: lets a test check that every rank went through the same number of all-reduces.
int64_t tidal_shm_counter(void* base, int rank) {
  return counter(static_cast<char*>(base), rank)->load(std::memory_order_acquire);
}

}  // extern "C"
