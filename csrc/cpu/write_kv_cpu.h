// The stamping writer on the CPU (kvattn.write_kv; docs/ownership.md section 4), for CPU pools of
// the tokens' own dtype: the steps of kvattn/backends/torch/writer.py in one pass over the tokens.
// Every token is judged against the tags as they were when the call began: in range, held by its
// owner (tag_rule.cuh's held_by), and, with the tokens before it that fill the slots before its own
// on the same page (its run), starting at or before the page's written prefix; a token that lands
// has its K and V rows stored, then its page stamped WRITTEN through its slot (a maximum, so
// stamps never lower valid_len). Negative slots are padding: skipped, not counted.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "kvattn/tag_rule.cuh"

namespace kvattn {
namespace cpu {

struct WriteParams {
  const char* k;  // [T, num_kv_heads, head_dim] tokens, the pools' dtype
  const char* v;
  char* k_cache;
  char* v_cache;
  const int64_t* slot_mapping;
  int64_t* tags;
  const int64_t* owners;
  bool* landed;           // [T]
  int8_t* drop_reasons;   // [T]
  int64_t* dropped;       // 0-d
  int64_t num_tokens, num_pages, page_size, num_kv_heads, head_dim, head_dim_v, element_size;
  int64_t stride_slots, stride_owner;
  int64_t stride_kt, stride_kh, stride_vt, stride_vh;  // tokens, in elements
  int64_t stride_kp, stride_ks, stride_kkh, stride_vp, stride_vs, stride_vvh;  // pools
};

inline int64_t written_tag(int64_t owner, int64_t valid_len) {
  return (owner << tags::OWNER_SHIFT) | (valid_len << tags::VALID_LEN_SHIFT) | tags::STATE_WRITTEN;
}

inline void write_kv(const WriteParams& p) {
  const int64_t T = p.num_tokens, P = p.page_size, E = p.element_size;
  std::vector<int64_t> page(T), slot(T), before(T);
  std::vector<uint8_t> held(T);
  for (int64_t t = 0; t < T; ++t) {  // judged on the tags as the call found them
    const int64_t s = p.slot_mapping[t * p.stride_slots];
    page[t] = s < 0 ? -1 : s / P;
    slot[t] = s < 0 ? 0 : s - page[t] * P;
    const bool in_range = s >= 0 && page[t] < p.num_pages;
    before[t] = in_range ? p.tags[page[t]] : 0;
    held[t] = in_range && held_by(before[t], p.owners[t * p.stride_owner]);
  }
  int64_t dropped = 0, run_start = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool continues = t > 0 && held[t] && held[t - 1] && page[t] == page[t - 1] && slot[t] == slot[t - 1] + 1;
    if (!continues) run_start = t;
    const int64_t prefix = (before[t] & tags::STATE_MASK) == tags::STATE_WRITTEN ? tag_valid_len(before[t]) : 0;
    const bool padding = p.slot_mapping[t * p.stride_slots] < 0;
    const bool in_range = !padding && page[t] < p.num_pages;
    const bool lands = held[t] && slot[run_start] <= prefix;
    int reason = 0;
    if (!padding) {
      if (!in_range) reason = static_cast<int>(tags::WriteDrop_OUT_OF_RANGE);
      else if (!held[t]) reason = static_cast<int>(tags::WriteDrop_NOT_HELD);
      else if (!lands) reason = static_cast<int>(tags::WriteDrop_GAP);
    }
    p.landed[t] = lands;
    p.drop_reasons[t] = static_cast<int8_t>(reason);
    dropped += reason != 0;
  }
  for (int64_t t = 0; t < T; ++t) {  // the bytes of every landed token, then the stamps
    if (!p.landed[t]) continue;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      std::memcpy(p.k_cache + (page[t] * p.stride_kp + slot[t] * p.stride_ks + h * p.stride_kkh) * E,
                  p.k + (t * p.stride_kt + h * p.stride_kh) * E, p.head_dim * E);
      std::memcpy(p.v_cache + (page[t] * p.stride_vp + slot[t] * p.stride_vs + h * p.stride_vvh) * E,
                  p.v + (t * p.stride_vt + h * p.stride_vh) * E, p.head_dim_v * E);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    if (!p.landed[t]) continue;
    const int64_t stamp = written_tag(p.owners[t * p.stride_owner], slot[t] + 1);
    if (stamp > p.tags[page[t]]) p.tags[page[t]] = stamp;
  }
  *p.dropped = dropped;
}

}  // namespace cpu
}  // namespace kvattn
