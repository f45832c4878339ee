// A small SIMT harness: runs CUDA kernel sources on the CPU, compiled by the host compiler.
//
// Each thread block runs on the calling OS thread, its threads as fibers (ucontext). A thread runs
// uninterrupted until its next scheduling point: __syncthreads(), a warp shuffle, or its return.
// Between two scheduling points the threads of a block run one after another in a freshly shuffled
// order, and every block starts with its shared memory filled with 0xFF bytes (NaN for every float
// type, -1 for integers). So a kernel that reads shared memory another thread writes without a
// barrier in between sees poison or stale data in some order, which the tests catch as a wrong
// result; a barrier not reached by every thread of the block, or a shuffle not reached by every lane
// of the warp, is reported as a launch error. Blocks also run in a shuffled order.
//
// Warp-level matrix operations run with the exact fragment layout of the PTX ISA: ldmatrix hands
// each lane the elements the hardware would (row lane / 4, columns 2 * (lane % 4) + {0, 1} of each
// 8x8 matrix, or the transpose), and mma.m16n8k16 reads A, B and C from the lanes that hold each
// element and gives each lane its own D elements, so a kernel that indexes a fragment wrongly
// computes a wrong product. Async copies (cp.async) are deferred: a thread's copies land only when
// it waits for their group (cp.async.wait_group), the latest moment the hardware allows, so a read
// of a stage before its wait sees the poison or a stale tile. A thread that exits with copies still
// pending fails the launch.
//
// Supported: blockIdx/threadIdx/blockDim/gridDim, dynamic shared memory, __syncthreads,
// __syncwarp, full-warp __shfl_sync/__shfl_xor_sync/__shfl_down_sync/__ballot_sync, int atomics,
// __half and __nv_bfloat16 with round-to-nearest-even conversions, cp.async (16 bytes, zero-fill),
// ldmatrix (x1/x2/x4, .trans), mma.sync m16n8k16 (f16/bf16 inputs, f32 accumulators),
// ex2.approx.ftz's flush, and the few runtime calls the launchers make. Block sizes must be
// multiples of 32. This is a test tool for logic, not a performance model.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>

// AddressSanitizer tracks one stack per thread: every swapcontext between a fiber and the scheduler
// is announced to it (make sanitize), or it reports the fibers' stack frames as overflows.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define KVSIM_FIBER_SWITCH(save, bottom, size) __sanitizer_start_switch_fiber(save, bottom, size)
#define KVSIM_FIBER_ARRIVED(save, bottom, size) __sanitizer_finish_switch_fiber(save, bottom, size)
#else
#define KVSIM_FIBER_SWITCH(save, bottom, size) ((void)0)
#define KVSIM_FIBER_ARRIVED(save, bottom, size) ((void)0)
#endif
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct uint4 {
  unsigned x, y, z, w;
};

struct int2 {
  int x, y;
};
inline int2 make_int2(int x, int y) { return {x, y}; }

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorLaunchFailure = 719,
};
typedef void* cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

constexpr int warpSize = 32;

namespace kvsim {

// ---- 16-bit float stand-ins, bit-exact with the CUDA conversions (round to nearest even) ----

inline uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN stays NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below the smallest normal half: a subnormal in units of 2**-24
    const int exp = static_cast<int>(a >> 23);
    const int shift = 126 - exp;
    if (exp == 0 || shift > 24) return static_cast<uint16_t>(sign);
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t rebased = a - 0x38000000u;  // exponent bias 127 -> 15
  uint32_t r = rebased >> 13;
  const uint32_t rem = rebased & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | r);
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- special functions ----

// ex2.approx.ftz.f32: 2^x with results under 2^-126 flushed to 0, so that a kernel's tests run the
// flush the device does. The unit's approximation error is not modelled: exp2f is within every
// test's tolerance of it.
inline float ex2_approx_ftz(float x) {
  const float y = std::exp2(x);
  return y < std::ldexp(1.0f, -126) ? 0.0f : y;
}

}  // namespace kvsim

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "16-bit stand-ins");

inline float __half2float(__half h) { return kvsim::half_bits_to_float(h.bits); }
inline __half __float2half_rn(float f) { return __half{kvsim::float_to_half_bits(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return kvsim::bf16_bits_to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{kvsim::float_to_bf16_bits(f)}; }

namespace kvsim {

enum class FiberState { kRunnable, kBlockBarrier, kWarpSync, kDone, kFailed };

struct PendingCopy {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes;  // 0..16; the rest of the 16 bytes is zero-filled
};

struct Fiber {
  ucontext_t ctx;
  unsigned char* stack = nullptr;
  void* asan_fake_stack = nullptr;
  dim3 tid;
  int linear = 0;
  FiberState state = FiberState::kRunnable;
  unsigned shuffle_mask = 0;
  uint64_t warp_syncs = 0;  // warp exchanges this thread took part in (selects the buffer)
  std::vector<PendingCopy> copies;  // cp.async issued and not yet landed
  std::vector<size_t> group_ends;   // copies.size() at each commit
};

constexpr size_t kExchangeBytes = 64;  // what one lane posts to a warp-collective operation

struct Block {
  dim3 block_idx, block_dim, grid_dim;
  unsigned char* smem = nullptr;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  const std::function<void()>* body = nullptr;
  // kExchangeBytes per thread; warp exchanges alternate the two buffers, so a lane that runs ahead
  // into the next exchange cannot overwrite what a slower lane is still reading.
  std::vector<unsigned char> exchange[2];
  std::string error;
};

struct State {
  Block* block = nullptr;
  Fiber* fiber = nullptr;
  std::mt19937_64 rng{0x6b766174746eULL};
  std::vector<unsigned char*> stacks;
  std::vector<unsigned char> smem;
  std::string last_error;
  const void* scheduler_stack = nullptr;  // the OS thread's stack, for the sanitizer
  size_t scheduler_stack_size = 0;
  void* scheduler_fake_stack = nullptr;
};

inline State& state() {
  static thread_local State s;
  return s;
}

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;
constexpr size_t kMaxDynamicSmem = 227 * 1024;  // an sm_90 block's limit

inline void set_seed(uint64_t seed) { state().rng.seed(seed); }

inline unsigned char* dynamic_smem() { return state().block->smem; }

// The calling fiber hands the OS thread back to the scheduler; `exiting`: it will never resume.
inline void switch_to_scheduler(bool exiting) {
  State& s = state();
  Fiber* f = s.fiber;
  KVSIM_FIBER_SWITCH(exiting ? nullptr : &f->asan_fake_stack, s.scheduler_stack, s.scheduler_stack_size);
  swapcontext(&f->ctx, &s.block->scheduler);
  KVSIM_FIBER_ARRIVED(f->asan_fake_stack, &s.scheduler_stack, &s.scheduler_stack_size);
}

// Stops the calling thread for good and makes the launch fail with `message`.
[[noreturn]] inline void fail(const std::string& message) {
  State& s = state();
  if (s.block->error.empty()) s.block->error = message;
  s.fiber->state = FiberState::kFailed;
  switch_to_scheduler(true);
  __builtin_unreachable();
}

inline void yield_to_scheduler() { switch_to_scheduler(false); }

inline void syncthreads() {
  state().fiber->state = FiberState::kBlockBarrier;
  yield_to_scheduler();
}

// Posts `bytes` of `value` for the calling lane, waits until every lane of the warp has posted,
// and returns the warp's 32 slots (lane i's post at i * kExchangeBytes). Valid until the lane's
// next exchange.
inline const unsigned char* warp_exchange(const void* value, size_t bytes, unsigned mask = 0xffffffffu) {
  State& s = state();
  Fiber* f = s.fiber;
  if (mask != 0xffffffffu) fail("warp operation with a partial mask: the harness supports full warps only");
  if (bytes > kExchangeBytes) fail("warp exchange of more than kExchangeBytes per lane");
  const int warp_base = f->linear & ~31;
  unsigned char* buf = s.block->exchange[f->warp_syncs & 1].data();
  if (bytes) std::memcpy(buf + f->linear * kExchangeBytes, value, bytes);
  f->shuffle_mask = mask;
  f->state = FiberState::kWarpSync;
  yield_to_scheduler();
  ++f->warp_syncs;
  return buf + warp_base * kExchangeBytes;
}

inline int lane_id() { return state().fiber->linear & 31; }

template <class T>
T shuffle(unsigned mask, T value, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
  const unsigned char* slots = warp_exchange(&value, sizeof(T), mask);
  T out;
  std::memcpy(&out, slots + src_lane * kExchangeBytes, sizeof(T));
  return out;
}

inline unsigned ballot(unsigned mask, bool predicate) {
  const int p = predicate;
  const unsigned char* slots = warp_exchange(&p, sizeof(p), mask);
  unsigned bits = 0;
  for (int lane = 0; lane < 32; ++lane) {
    int q;
    std::memcpy(&q, slots + lane * kExchangeBytes, sizeof(q));
    bits |= static_cast<unsigned>(q != 0) << lane;
  }
  return bits;
}

// ---- cp.async: deferred until the thread waits for the copy's group ----

inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 || (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % 16))
    fail("cp.async of 16 bytes with an address not 16-byte aligned");
  if (src_bytes < 0 || src_bytes > 16) fail("cp.async source size outside [0, 16]");
  state().fiber->copies.push_back({static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src),
                                   src_bytes});
}

inline void cp_async_commit() {
  Fiber* f = state().fiber;
  f->group_ends.push_back(f->copies.size());
}

// Lands every committed group but the `newest` most recent ones.
inline void cp_async_wait(int newest) {
  Fiber* f = state().fiber;
  const int groups = static_cast<int>(f->group_ends.size());
  if (groups <= newest) return;
  const size_t done = f->group_ends[groups - newest - 1];
  for (size_t i = 0; i < done; ++i) {
    const PendingCopy& c = f->copies[i];
    if (c.src_bytes > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
    std::memset(c.dst + c.src_bytes, 0, static_cast<size_t>(16 - c.src_bytes));
  }
  f->copies.erase(f->copies.begin(), f->copies.begin() + static_cast<std::ptrdiff_t>(done));
  f->group_ends.erase(f->group_ends.begin(), f->group_ends.begin() + (groups - newest));
  for (size_t& end : f->group_ends) end -= done;
}

// ---- ldmatrix and mma.sync with the PTX fragment layouts ----

// ldmatrix .x1/.x2/.x4 (.trans): lanes 8i..8i+7 give the row addresses of matrix i (16 bytes each);
// register i of lane l holds row l / 4, columns 2 * (l % 4) + {0, 1} of matrix i, or with .trans
// rows 2 * (l % 4) + {0, 1}, column l / 4 (low half first).
template <int N>
inline void ldmatrix(uint32_t* regs, const void* row_address, bool trans) {
  const unsigned char* slots = warp_exchange(&row_address, sizeof(row_address));
  const int lane = lane_id();
  for (int i = 0; i < N; ++i) {
    auto row = [&](int r) {
      const void* a;
      std::memcpy(&a, slots + (8 * i + r) * kExchangeBytes, sizeof(a));
      if (reinterpret_cast<uintptr_t>(a) % 16) fail("ldmatrix row address not 16-byte aligned");
      return static_cast<const uint16_t*>(a);
    };
    uint16_t lo, hi;
    if (trans) {
      lo = row(2 * (lane % 4))[lane / 4];
      hi = row(2 * (lane % 4) + 1)[lane / 4];
    } else {
      lo = row(lane / 4)[2 * (lane % 4)];
      hi = row(lane / 4)[2 * (lane % 4) + 1];
    }
    regs[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
  }
}

struct MmaPost {
  uint32_t a[4], b[2];
  float c[4];
};

// D = A (16x16, row) * B (16x8, col) + C (16x8), f32 accumulate. With g = lane / 4, t = lane % 4:
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c/d0,1 = C[g][2t..2t+1], c/d2,3 = C[g+8][2t..].
template <float (*ToFloat)(uint16_t)>
inline void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  MmaPost mine;
  std::memcpy(mine.a, a, sizeof(mine.a));
  std::memcpy(mine.b, b, sizeof(mine.b));
  std::memcpy(mine.c, c, sizeof(mine.c));
  const unsigned char* slots = warp_exchange(&mine, sizeof(mine));
  auto post = [&](int lane) {
    MmaPost p;
    std::memcpy(&p, slots + lane * kExchangeBytes, sizeof(p));
    return p;
  };
  auto half = [](uint32_t reg, int k) { return static_cast<uint16_t>(k % 2 ? reg >> 16 : reg & 0xffffu); };
  auto A = [&](int row, int k) {
    const MmaPost p = post((row % 8) * 4 + (k % 8) / 2);
    return ToFloat(half(p.a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k));
  };
  auto B = [&](int k, int n) {
    const MmaPost p = post(n * 4 + (k % 8) / 2);
    return ToFloat(half(p.b[k >= 8 ? 1 : 0], k));
  };
  const int lane = lane_id();
  const int g = lane / 4, t = lane % 4;
  const MmaPost self = post(lane);
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0);
    const int col = 2 * t + i % 2;
    float acc = self.c[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[i] = acc;
  }
}

inline void fiber_entry() {
  State& s = state();
  KVSIM_FIBER_ARRIVED(nullptr, &s.scheduler_stack, &s.scheduler_stack_size);
  (*s.block->body)();
  if (!s.fiber->copies.empty()) {
    if (s.block->error.empty()) s.block->error = "a thread exited with cp.async copies it never waited for";
    s.fiber->state = FiberState::kFailed;
  } else {
    s.fiber->state = FiberState::kDone;
  }
  KVSIM_FIBER_SWITCH(nullptr, s.scheduler_stack, s.scheduler_stack_size);
}  // returns to the scheduler through uc_link

inline unsigned char* stack_for(size_t i) {
  State& s = state();
  while (s.stacks.size() <= i) {
    void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    mprotect(p, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of corrupting
    s.stacks.push_back(static_cast<unsigned char*>(p) + kGuardBytes);
  }
  return s.stacks[i];
}

inline const char* state_name(FiberState st) {
  switch (st) {
    case FiberState::kRunnable: return "running";
    case FiberState::kBlockBarrier: return "__syncthreads";
    case FiberState::kWarpSync: return "a warp shuffle";
    case FiberState::kDone: return "exited";
    default: return "failed";
  }
}

// Releases the threads waiting at a barrier that every participant reached; returns false, with
// block.error set, when the block can make no progress.
inline bool release_barriers(Block& block) {
  const int n = static_cast<int>(block.fibers.size());
  bool released = false;
  for (int w = 0; w < n; w += 32) {
    int waiting = 0;
    for (int i = w; i < w + 32; ++i) waiting += block.fibers[i].state == FiberState::kWarpSync;
    if (waiting == 32) {
      for (int i = w; i < w + 32; ++i) block.fibers[i].state = FiberState::kRunnable;
      released = true;
    }
  }
  if (released) return true;
  int at_barrier = 0, done = 0;
  for (const Fiber& f : block.fibers) {
    at_barrier += f.state == FiberState::kBlockBarrier;
    done += f.state == FiberState::kDone;
  }
  if (at_barrier == n) {
    for (Fiber& f : block.fibers) f.state = FiberState::kRunnable;
    return true;
  }
  if (done == n) return true;
  std::string what = "deadlock: threads wait at different synchronisation points (";
  for (int i = 0; i < n; ++i) {
    if (i == 0 || block.fibers[i].state != block.fibers[i - 1].state) {
      what += (i ? "; thread " : "thread ") + std::to_string(i) + "..: " + state_name(block.fibers[i].state);
    }
  }
  block.error = what + ")";
  return false;
}

inline bool run_block(Block& block) {
  State& s = state();
  const int n = static_cast<int>(block.fibers.size());
  for (int i = 0; i < n; ++i) {
    Fiber& f = block.fibers[i];
    unsigned char* stack = stack_for(i);
    if (!stack) {
      block.error = "could not allocate fiber stacks";
      return false;
    }
    getcontext(&f.ctx);
    f.stack = stack;
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &block.scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  std::vector<int> order(n);
  for (;;) {
    order.clear();
    for (int i = 0; i < n; ++i)
      if (block.fibers[i].state == FiberState::kRunnable) order.push_back(i);
    std::shuffle(order.begin(), order.end(), s.rng);
    for (int i : order) {
      s.fiber = &block.fibers[i];
      KVSIM_FIBER_SWITCH(&s.scheduler_fake_stack, s.fiber->stack, kStackBytes);
      swapcontext(&block.scheduler, &s.fiber->ctx);
      KVSIM_FIBER_ARRIVED(s.scheduler_fake_stack, nullptr, nullptr);
      if (!block.error.empty()) return false;
    }
    if (!release_barriers(block)) return false;
    bool all_done = true;
    for (const Fiber& f : block.fibers) all_done &= f.state == FiberState::kDone;
    if (all_done) return true;
  }
}

inline cudaError_t run_grid(dim3 grid, dim3 block_dim, size_t smem_bytes, const std::function<void()>& body) {
  State& s = state();
  const size_t threads = static_cast<size_t>(block_dim.x) * block_dim.y * block_dim.z;
  if (threads == 0 || threads > 1024 || threads % 32) {
    s.last_error = "block of " + std::to_string(threads) + " threads: the harness needs a multiple of 32 up to 1024";
    return cudaErrorInvalidValue;
  }
  if (smem_bytes > kMaxDynamicSmem) {
    s.last_error = "dynamic shared memory of " + std::to_string(smem_bytes) + " bytes exceeds the limit";
    return cudaErrorInvalidValue;
  }
  std::vector<dim3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.emplace_back(x, y, z);
  std::shuffle(blocks.begin(), blocks.end(), s.rng);
  s.smem.assign(smem_bytes + 16, 0);
  unsigned char* smem = s.smem.data() + ((16 - reinterpret_cast<uintptr_t>(s.smem.data()) % 16) % 16);
  for (const dim3& idx : blocks) {
    Block block;
    block.block_idx = idx;
    block.block_dim = block_dim;
    block.grid_dim = grid;
    block.smem = smem;
    block.body = &body;
    block.fibers.resize(threads);
    block.exchange[0].assign(threads * kExchangeBytes, 0);
    block.exchange[1].assign(threads * kExchangeBytes, 0);
    for (size_t i = 0; i < threads; ++i) {
      Fiber& f = block.fibers[i];
      f.linear = static_cast<int>(i);
      f.tid = dim3(i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y));
    }
    std::memset(smem, 0xff, smem_bytes);
    s.block = &block;
    const bool ok = run_block(block);
    s.block = nullptr;
    s.fiber = nullptr;
    if (!ok) {
      s.last_error = "block (" + std::to_string(idx.x) + ", " + std::to_string(idx.y) + ", " +
                     std::to_string(idx.z) + "): " + block.error;
      return cudaErrorLaunchFailure;
    }
  }
  return cudaSuccess;
}

template <class Params>
cudaError_t launch(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem_bytes, const Params& params) {
  const std::function<void()> body = [kernel, &params] { kernel(params); };
  return run_grid(grid, block, smem_bytes, body);
}

}  // namespace kvsim

#define threadIdx (::kvsim::state().fiber->tid)
#define blockIdx (::kvsim::state().block->block_idx)
#define blockDim (::kvsim::state().block->block_dim)
#define gridDim (::kvsim::state().block->grid_dim)

inline void __syncthreads() { kvsim::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { kvsim::warp_exchange(nullptr, 0, mask); }
inline void __threadfence() {}
inline unsigned __ballot_sync(unsigned mask, int predicate) { return kvsim::ballot(mask, predicate != 0); }

template <class T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = warpSize) {
  if (width != warpSize) kvsim::fail("__shfl_sync: the harness supports width 32 only");
  return kvsim::shuffle(mask, value, src_lane & 31);
}

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = warpSize) {
  if (width != warpSize) kvsim::fail("__shfl_xor_sync: the harness supports width 32 only");
  return kvsim::shuffle(mask, value, (kvsim::state().fiber->linear & 31) ^ (lane_mask & 31));
}

template <class T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = warpSize) {
  if (width != warpSize) kvsim::fail("__shfl_down_sync: the harness supports width 32 only");
  const int lane = kvsim::state().fiber->linear & 31;
  const int src = lane + static_cast<int>(delta);
  return kvsim::shuffle(mask, value, src < 32 ? src : lane);
}

// Threads never interleave between scheduling points, so plain read-modify-writes are atomic here.
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
inline int atomicOr(int* address, int value) {
  const int old = *address;
  *address = old | value;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old + value;
  return old;
}
inline long long atomicMax(long long* address, long long value) {
  const long long old = *address;
  *address = std::max(old, value);
  return old;
}

inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t error) {
  if (error == cudaSuccess) return "no error";
  return kvsim::state().last_error.empty() ? "launch failure" : kvsim::state().last_error.c_str();
}
