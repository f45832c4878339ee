// The keyed transfer digest's NH on the CPU (kvattn.transfer.DigestKey; the function is stated in
// kvattn/backends/triton/digest.py and docs/transfer.md): the device kernel's four Toeplitz
// instances over the same message and key words, so a page digested on one side of a transfer
// compares equal with the other side's whatever device each used.
//
// A page's message is, per chunk (one pool of one layer) in order, the 32-bit words of its slots
// [0, valid_len) in NHD order (a slot's heads in turn, wherever the pool keeps them); word w of
// slot s meets key word key_offset + s * row_words + w, instance j's key shifted by 4 j words:
//   NH_j = sum over pairs (2i, 2i + 1) of ((m[2i] + k[2i + 4j]) mod 2^32) * ((m[2i + 1] + k[2i + 1 + 4j]) mod 2^32)
// mod 2^64. 16 words at a time: on a little-endian CPU a pair is one 64-bit lane, word 2i its low
// half, so each instance is one 64-bit multiply of the two zero-extended halves per lane (GCC
// emits vpmullq for it on AVX-512; a widening 32-bit multiply would take fewer uops, not tried:
// this already outruns a copy of the same bytes here). Pages are spread
// over OpenMP threads; the caller releases the GIL, so the digest runs beside the engine's step.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/attention_cpu.h"  // KVATTN_CPU_CLONES, KVATTN_CPU_INLINE

namespace kvattn::cpu {

constexpr int kNhInstances = 4;
constexpr int64_t kNhShift = 4;  // key words between instances

struct NhChunk {  // one pool of one layer
  const char* base;
  int64_t page_stride, slot_stride, head_stride;  // bytes
  int64_t row_words;                              // 32-bit words per slot row, a multiple of 4
  int64_t head_words;                             // of them per head, a multiple of 4
  int64_t key_offset;                             // the key word its page-sized stretch starts at
};

typedef uint32_t NhWords __attribute__((vector_size(64)));
typedef uint64_t NhPairs __attribute__((vector_size(64)));

// acc[j] += NH_j of n words of m (n a multiple of 16) against key k.
KVATTN_CPU_INLINE void nh_block(const char* m, const uint32_t* k, int64_t n, NhPairs* acc) {
  for (int64_t w = 0; w < n; w += 16) {
    NhWords x;
    std::memcpy(&x, m + w * 4, sizeof x);
    for (int j = 0; j < kNhInstances; ++j) {
      NhWords y;
      std::memcpy(&y, k + w + kNhShift * j, sizeof y);
      const NhWords sum = x + y;  // wraps mod 2^32
      NhPairs pairs;
      std::memcpy(&pairs, &sum, sizeof pairs);
      acc[j] += (pairs & 0xffffffffu) * (pairs >> 32);
    }
  }
}

// The same for runs narrower than 16 words (a multiple of 4), pair by pair.
KVATTN_CPU_INLINE void nh_pairs(const char* m, const uint32_t* k, int64_t n, uint64_t* acc) {
  for (int64_t w = 0; w < n; w += 2) {
    uint32_t x[2];
    std::memcpy(x, m + w * 4, sizeof x);
    for (int j = 0; j < kNhInstances; ++j)
      acc[j] += static_cast<uint64_t>(x[0] + k[w + kNhShift * j]) * static_cast<uint64_t>(x[1] + k[w + 1 + kNhShift * j]);
  }
}

// acc/narrow += NH of n message words at m against key k (n a multiple of 4).
KVATTN_CPU_INLINE void nh_run(const char* m, const uint32_t* k, int64_t n, NhPairs* acc, uint64_t* narrow) {
  const int64_t body = n / 16 * 16;
  nh_block(m, k, body, acc);
  nh_pairs(m + body * 4, k + body, n - body, narrow);
}

// out[0..3] = NH of ``page``'s first ``slots`` slots over the chunks.
KVATTN_CPU_CLONES void nh_page(const NhChunk* chunks, int64_t num_chunks, int64_t page, int64_t slots,
                               const uint32_t* key, uint64_t* out) {
  NhPairs acc[kNhInstances] = {};
  uint64_t narrow[kNhInstances] = {};
  for (int64_t c = 0; c < num_chunks; ++c) {
    const NhChunk& ch = chunks[c];
    const char* rows = ch.base + page * ch.page_stride;
    const uint32_t* k = key + ch.key_offset;
    // The message runs as far as the bytes lie back to back (its key words always do): the
    // page's slots at once (NHD, slots adjacent), a slot row (NHD), or a head's row (HND, or
    // K and V interleaved per head).
    const bool whole_rows = ch.head_words == ch.row_words || ch.head_stride == ch.head_words * 4;
    if (whole_rows && ch.slot_stride == ch.row_words * 4) {
      nh_run(rows, k, slots * ch.row_words, acc, narrow);
      continue;
    }
    for (int64_t s = 0; s < slots; ++s) {
      const char* m = rows + s * ch.slot_stride;
      const uint32_t* ks = k + s * ch.row_words;
      if (whole_rows) {
        nh_run(m, ks, ch.row_words, acc, narrow);
        continue;
      }
      for (int64_t h = 0; h < ch.row_words / ch.head_words; ++h)
        nh_run(m + h * ch.head_stride, ks + h * ch.head_words, ch.head_words, acc, narrow);
    }
  }
  for (int j = 0; j < kNhInstances; ++j) {
    uint64_t total = narrow[j];
    for (int l = 0; l < 8; ++l) total += acc[j][l];
    out[j] = total;
  }
}

// out [n, 4]: NH of pages[i]'s first clamp(lens[i], 0, page_size) slots, pages over up to
// ``threads`` threads (the caller has checked pages, strides and the key's length).
inline void nh_pages(const NhChunk* chunks, int64_t num_chunks, const int64_t* pages, const int64_t* lens, int64_t n,
                     int64_t page_size, const uint32_t* key, uint64_t* out, int64_t threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast<int>(threads)) if (threads > 1 && n > 1)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slots = lens[i] < 0 ? 0 : (lens[i] > page_size ? page_size : lens[i]);
    nh_page(chunks, num_chunks, pages[i], slots, key, out + i * kNhInstances);
  }
}

}  // namespace kvattn::cpu
