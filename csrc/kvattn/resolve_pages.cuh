// The checked extend's page pre-pass (extend.cuh describes the extend): the reader's rule on every
// logical page of a sequence once, the report, and the effective table the attention kernel reads.
// Not a template: its own header, included by exactly one translation unit of a module (a second
// definition of the kernel would not link).
#pragma once

#include "compat.cuh"
#include "launchers.h"
#include "params.h"
#include "tag_rule.cuh"
#include "tiles.h"

namespace kvattn {

// The first key any query row of sequence b reads: 0, or with a sliding window the window start of
// its first row (at position seq_len - q_len).
KVATTN_DEVICE int64_t extend_first_key(const ExtendParams& p, int64_t b, int32_t raw_len) {
  if (p.var.window_left < 0) return 0;
  const int64_t q_len = p.q_start[b + 1] - p.q_start[b];
  return max64(static_cast<int64_t>(raw_len) - q_len - p.var.window_left, 0);
}

// One sequence per block: each table entry's reason (0 when accepted or not read), the report's
// counters and the effective entry page << 32 | readable slots (0 for a page that is not read,
// including pages wholly before a sliding window).
__global__ void __launch_bounds__(kThreads, 1) resolve_pages_kernel(const ExtendParams p) {
  KVATTN_DYNAMIC_SMEM(smem);
  int32_t* counters = reinterpret_cast<int32_t*>(smem);
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x;
  const int64_t page_size = p.page.size;
  const int64_t capacity = static_cast<int64_t>(p.max_pages) * page_size;
  const int32_t raw_len = p.seq_lens[b * p.stride_sl];
  const int64_t seq_len = min64(max64(raw_len, 0), capacity);
  const int32_t* bt_row = p.block_table + b * p.stride_bt_b;
  const int64_t* exp_row = p.expected + b * p.stride_eb;
  const int64_t first_key = extend_first_key(p, b, raw_len);
  if (tid < kReportFields) counters[tid] = 0;
  __syncthreads();
  check_pages(bt_row, p.stride_bt_p, exp_row, p.stride_ep, p.page_tags, p.num_pages, page_size, seq_len, first_key,
              0, p.max_pages, p.page_reasons + b * p.max_pages, counters, kThreads);
  for (int64_t i = tid; i < p.max_pages; i += kThreads) {
    const bool read = seq_len > i * page_size && (i + 1) * page_size > first_key;
    const int64_t page = read ? bt_row[i * p.stride_bt_p] : 0;
    const bool in_range = page >= 0 && page < p.num_pages;
    const int readable = read && in_range ? readable_slots(p.page_tags[page], exp_row[i * p.stride_ep]) : 0;
    p.effective[b * p.max_pages + i] =
        (in_range ? page : 0) << 32 | static_cast<int64_t>(min64(readable, page_size));
  }
  __syncthreads();
  if (tid == 0) {
    // A seq_len past the table: nothing beyond it is read, and it counts once.
    const int beyond = raw_len > capacity;
    p.beyond_table[b] = beyond;
    p.violations[b] = counters[0] + beyond;
    p.reasons[b] = counters[1] | (beyond ? static_cast<int>(tags::Violation_OUT_OF_RANGE) : 0);
    p.pages_checked[b] = counters[2];
  }
}

cudaError_t ResolvePagesKernel::launch(const ExtendParams& p, cudaStream_t stream) {
  return launch_kernel(&resolve_pages_kernel, dim3(static_cast<unsigned>(p.batch)), dim3(kThreads), 16, stream, p);
}

}  // namespace kvattn
