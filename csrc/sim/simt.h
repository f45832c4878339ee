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
// Supported: blockIdx/threadIdx/blockDim/gridDim, dynamic shared memory, __syncthreads,
// full-warp __shfl_sync/__shfl_xor_sync/__shfl_down_sync, int atomics, __half and __nv_bfloat16
// with round-to-nearest-even conversions, and the few runtime calls the launchers make. Block sizes
// must be multiples of 32. This is a test tool for logic, not a performance model.
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

struct Fiber {
  ucontext_t ctx;
  dim3 tid;
  int linear = 0;
  FiberState state = FiberState::kRunnable;
  unsigned shuffle_mask = 0;
  uint64_t warp_syncs = 0;  // shuffles this thread took part in (selects the exchange buffer)
};

struct Block {
  dim3 block_idx, block_dim, grid_dim;
  unsigned char* smem = nullptr;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  const std::function<void()>* body = nullptr;
  std::vector<uint64_t> exchange[2];  // one slot per thread; shuffles alternate the two buffers
  std::string error;
};

struct State {
  Block* block = nullptr;
  Fiber* fiber = nullptr;
  std::mt19937_64 rng{0x6b766174746eULL};
  std::vector<unsigned char*> stacks;
  std::vector<unsigned char> smem;
  std::string last_error;
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

// Stops the calling thread for good and makes the launch fail with `message`.
[[noreturn]] inline void fail(const std::string& message) {
  State& s = state();
  if (s.block->error.empty()) s.block->error = message;
  s.fiber->state = FiberState::kFailed;
  swapcontext(&s.fiber->ctx, &s.block->scheduler);
  __builtin_unreachable();
}

inline void yield_to_scheduler() {
  State& s = state();
  swapcontext(&s.fiber->ctx, &s.block->scheduler);
}

inline void syncthreads() {
  state().fiber->state = FiberState::kBlockBarrier;
  yield_to_scheduler();
}

template <class T>
T shuffle(unsigned mask, T value, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
  State& s = state();
  Fiber* f = s.fiber;
  if (mask != 0xffffffffu) fail("warp shuffle with a partial mask: the harness supports full warps only");
  const int warp_base = f->linear & ~31;
  std::vector<uint64_t>& buf = s.block->exchange[f->warp_syncs & 1];
  uint64_t slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  buf[f->linear] = slot;
  f->shuffle_mask = mask;
  f->state = FiberState::kWarpSync;
  yield_to_scheduler();
  ++f->warp_syncs;
  T out;
  std::memcpy(&out, &buf[warp_base + src_lane], sizeof(T));
  return out;
}

inline void fiber_entry() {
  State& s = state();
  (*s.block->body)();
  s.fiber->state = FiberState::kDone;
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
      swapcontext(&block.scheduler, &s.fiber->ctx);
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
    block.exchange[0].assign(threads, 0);
    block.exchange[1].assign(threads, 0);
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
inline void __threadfence() {}

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
