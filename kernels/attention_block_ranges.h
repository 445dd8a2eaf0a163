// The ranges a tiled attention kernel walks over a query block and a key
// block at global offsets (attention_mask.h's q_offset / kv_offset; one block
// with both 0): a key's queries, the mirror of visible_block_keys for a pass
// that goes from keys to queries (the cuda dK/dV kernels), and the keys or
// queries of a tile of rows (tiles none of whose pairs is visible are
// skipped). Checked against visible_block_keys pair by pair in
// tests/kernels/attention_blocks_test.cc.
//
// Header-only and usable in device code (nvcc, C++17). Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "kernels/attention_mask.h"

namespace strata::ops {

// The queries of a block of seq queries that see key `key` of the key block
// (both block-local): [first, last), empty when first >= last. The global key g is seen by the queries
// [g, last_seeing_query(g)]. Monotone in key like the keys' ranges in query.
STRATA_HOST_DEVICE inline BlockRange seeing_block_queries(const AttentionMask& mask, int64_t key, int64_t seq) {
  const int64_t global = mask.kv_offset + key;
  int64_t first = global - mask.q_offset;
  const int64_t last_global = last_seeing_query(mask, global);  // INT64_MAX: no bound
  int64_t last = last_global >= mask.q_offset + seq ? seq : last_global + 1 - mask.q_offset;
  first = first < 0 ? 0 : (first > seq ? seq : first);
  if (last < 0) last = 0;
  return {first, last > first ? last : first};
}

// The keys [first, last) of the key block that some query of local rows
// [q0, q1) (q0 < q1 <= seq) sees: the first row's first key to the last row's
// last (both ends monotone in the query); empty when first >= last.
STRATA_HOST_DEVICE inline BlockRange tile_block_keys(const AttentionMask& mask, int64_t q0, int64_t q1,
                                                     int64_t kv_seq) {
  return {visible_block_keys(mask, q0, kv_seq).first, visible_block_keys(mask, q1 - 1, kv_seq).last};
}

// The queries [first, last) of the query block that see some key of local
// keys [k0, k1) (k0 < k1 <= kv_seq).
STRATA_HOST_DEVICE inline BlockRange tile_seeing_queries(const AttentionMask& mask, int64_t k0, int64_t k1,
                                                         int64_t seq) {
  return {seeing_block_queries(mask, k0, seq).first, seeing_block_queries(mask, k1 - 1, seq).last};
}

}  // namespace strata::ops
