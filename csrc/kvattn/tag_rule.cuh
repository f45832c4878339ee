// The reader's rule (docs/ownership.md, section 3) and the writer's precondition as CUDA code,
// shared by every kernel of csrc/. The bit layout comes from kvattn/tags.py through the generated
// kvattn_tags.h; this file is the only CUDA statement of the rule.
#pragma once

#include "compat.cuh"
#include "kvattn_tags.h"

namespace kvattn {

KVATTN_DEVICE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
KVATTN_DEVICE int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

KVATTN_DEVICE bool valid_owner(int64_t owner) { return owner >= 1 && owner <= tags::OWNER_MAX; }

KVATTN_DEVICE int64_t tag_valid_len(int64_t tag) { return (tag >> tags::VALID_LEN_SHIFT) & tags::VALID_LEN_MAX; }

// How many leading slots of a page may be read for `owner`: its valid_len if the tag is WRITTEN for
// that owner, else 0. One compare tests state, owner and bit 63 (a tag no writer produces).
KVATTN_DEVICE int readable_slots(int64_t tag, int64_t owner) {
  constexpr int64_t kKeyMask = ~(tags::VALID_LEN_MAX << tags::VALID_LEN_SHIFT);
  const bool owned = valid_owner(owner) && (tag & kKeyMask) == ((owner << tags::OWNER_SHIFT) | tags::STATE_WRITTEN);
  return owned ? static_cast<int>(tag_valid_len(tag)) : 0;
}

// The reader's rule per page as a Violation value; the first failing condition in the order of
// kvattn.Violation wins, as in kvattn.tags.page_reason. `tag` is 0 when the page is out of range.
KVATTN_DEVICE int page_reason(int64_t tag, bool in_range, int64_t owner, int64_t slots_read) {
  if (!in_range) return static_cast<int>(tags::Violation_OUT_OF_RANGE);
  const int64_t state = tag & tags::STATE_MASK;
  const bool malformed = tag < 0 || (state != tags::STATE_RESERVED && state != tags::STATE_WRITTEN);
  if (malformed) return static_cast<int>(tags::Violation_FREE);
  if (state == tags::STATE_RESERVED) return static_cast<int>(tags::Violation_RESERVED);
  if (!valid_owner(owner) || (tag >> tags::OWNER_SHIFT) != owner) return static_cast<int>(tags::Violation_OWNER_MISMATCH);
  if (tag_valid_len(tag) < slots_read) return static_cast<int>(tags::Violation_UNWRITTEN);
  return 0;
}

// The writer's precondition: the page is RESERVED or WRITTEN for `owner` (a valid id).
KVATTN_DEVICE bool held_by(int64_t tag, int64_t owner) {
  const int64_t state = tag & tags::STATE_MASK;
  return valid_owner(owner) && tag >= 0 && (state == tags::STATE_RESERVED || state == tags::STATE_WRITTEN) &&
         (tag >> tags::OWNER_SHIFT) == owner;
}

constexpr int kReportFields = 3;  // the report's counters: refused pages, OR of reasons, pages read

// The report for logical pages [page_lo, page_hi) of one sequence of seq_len tokens whose queries
// read keys from first_key on (a sliding window; 0 without one), by the `threads` threads of a
// block: each page's reason into reasons_row (0 when accepted or not read), and the block's sums
// (refused pages, OR of reasons, pages read) added into counters[0..2] in shared memory, which the
// caller zeroed. Page memory is untouched.
KVATTN_DEVICE void check_pages(const int32_t* bt_row, int64_t stride_bt_p, const int64_t* exp_row, int64_t stride_ep,
                               const int64_t* page_tags, int64_t num_pages, int64_t page_size, int64_t seq_len,
                               int64_t first_key, int64_t page_lo, int64_t page_hi, int8_t* reasons_row,
                               int32_t* counters, int threads) {
  int bad = 0, bits = 0, read = 0;
  for (int64_t i = page_lo + threadIdx.x; i < page_hi; i += threads) {
    const int64_t slots_read = min64(max64(seq_len - i * page_size, 0), page_size);
    int reason = 0;
    if (slots_read > 0 && (i + 1) * page_size > first_key) {
      const int64_t page = bt_row[i * stride_bt_p];
      const bool in_range = page >= 0 && page < num_pages;
      reason = page_reason(in_range ? page_tags[page] : 0, in_range, exp_row[i * stride_ep], slots_read);
      ++read;
    }
    reasons_row[i] = static_cast<int8_t>(reason);
    bad += reason != 0;
    bits |= reason;
  }
  if (bad) atomicAdd(&counters[0], bad);
  if (bits) atomicOr(&counters[1], bits);
  if (read) atomicAdd(&counters[2], read);
}

}  // namespace kvattn
