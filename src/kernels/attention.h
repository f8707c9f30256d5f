// Causal attention of query heads against the keys and values of one KV head: out =
// softmax(q·k_j)·v_j with scaling 1.0 (Gemma 4 has no 1/sqrt(d) and no attention soft-cap).
// Keys and values are fetched by absolute position through callables, so the same kernel reads a
// sliding ring, a growing full cache, or the current chunk's fresh rows. Their rows are f32, bf16
// (uint16_t bit patterns) or q8_0 blocks (KvQ8Block), as cache/kv_cache.h stores them; queries and
// outputs are f32. A q8_0 row is read a block at a time and widened in registers only.
//
// The kernel is flash-style: keys are taken in blocks of kKeyBlock with a running max and sum
// per query, so its scratch stays in L1 at any depth (a 32k-key score row per query would not),
// and a block of queries (a chunk's rows times the group's heads during prefill) shares every
// key and value it loads. Scores come from 4x4 register tiles (4 queries x 4 keys), the value
// pass from 8-query x 32-column tiles; the AVX-512 twins live in x86/vec_avx512.cc, the portable
// loops in attention.cc stay the reference.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cache/kv_cache.h"
#include "core/cpu_features.h"
#include "kernels/ops.h"

namespace gemstage {

float dot_f32(CpuTier tier, const float* a, const float* b, int64_t n);
// y += a * x
void axpy_f32(CpuTier tier, float a, const float* x, float* y, int64_t n);

constexpr int64_t kKeyBlock = 32;

// The queries of one call: query m reads q[m] (head_dim floats), writes out[m], and sees the keys
// at absolute positions lo[m]..hi[m] (inclusive, lo <= hi). `tier` picks the kernels that attend
// them (the caller's ThreadPool::tier(); scalar is the portable reference).
struct QueryBlock {
  CpuTier tier = CpuTier::Scalar;
  std::vector<const float*> q;
  std::vector<float*> out;
  std::vector<int64_t> lo, hi;

  int64_t size() const { return static_cast<int64_t>(q.size()); }
  void clear() {
    q.clear();
    out.clear();
    lo.clear();
    hi.clear();
  }
  void add(const float* query, float* result, int64_t first_key, int64_t last_key) {
    q.push_back(query);
    out.push_back(result);
    lo.push_back(first_key);
    hi.push_back(last_key);
  }
};

// The key and value rows of one block, in the cache's row type.
template <typename T>
struct KeyBlockRows {
  const T* keys[kKeyBlock];
  const T* values[kKeyBlock];
};

// Per-thread working memory, reused across calls so the decode loop does not allocate.
struct AttentionScratch {
  std::vector<float> scores;  // [queries, kKeyBlock]
  std::vector<float> max, sum;
  KeyBlockRows<float> f32[2];  // the block being attended and the next one, being prefetched
  KeyBlockRows<uint16_t> bf16[2];
  KeyBlockRows<KvQ8Block> q8[2];

  template <typename T>
  KeyBlockRows<T>* rows() {
    if constexpr (std::is_same_v<T, float>)
      return f32;
    else if constexpr (std::is_same_v<T, uint16_t>)
      return bf16;
    else
      return q8;
  }
};

// The AVX-512 kernels prefetch the next key block's rows while computing the current one, in
// spans that do not fit in L2 (kPrefetchMinBytes; there it only costs instructions). At long
// context the cache streams from DRAM and the hardware prefetchers, following 64 separate rows,
// do not run far enough ahead: E2B's full layer at 32k bf16 keys ran at 47-71 GFLOP/s on one core
// without, 70-85 with the block's prefetches issued at once, 90-107 with them spread over the
// score tiles (x86/vec_avx512.cc: TilePrefetch). The portable reference does not prefetch.
constexpr size_t kPrefetchMinBytes = size_t{1} << 20;

// Why bf16 rows are widened to f32 rather than multiplied as bf16 pairs (VDPBF16PS): measured
// on an AVX512-BF16 CPU (AMD EPYC), that only wins when q (and p) are rounded to one bf16, which
// moved the tiny model's logits 0.073 from the f32 cache's (0.05 allowed) and, p being rounded
// relative to each block's running max, made token-by-token decode differ from recomputing the
// prompt by 4e-4. With q split into two bf16 (2^-17) the scores ran no faster than the widened
// FMAs.

// One key block (nk <= kKeyBlock keys at positions first..first+nk-1) of the running softmax:
// scores, masks, rescales each query's out/max/sum and adds this block's p·v. The next block's
// next_nk rows (0: none, or not worth prefetching) are prefetched meanwhile.
void attend_key_block(const QueryBlock& qb, int64_t head_dim, const KeyBlockRows<float>& rows,
                      int64_t nk, const KeyBlockRows<float>& next, int64_t next_nk, int64_t first,
                      AttentionScratch& s);
void attend_key_block(const QueryBlock& qb, int64_t head_dim, const KeyBlockRows<uint16_t>& rows,
                      int64_t nk, const KeyBlockRows<uint16_t>& next, int64_t next_nk,
                      int64_t first, AttentionScratch& s);
void attend_key_block(const QueryBlock& qb, int64_t head_dim, const KeyBlockRows<KvQ8Block>& rows,
                      int64_t nk, const KeyBlockRows<KvQ8Block>& next, int64_t next_nk,
                      int64_t first, AttentionScratch& s);

// The running softmax over the queries' keys, left unnormalized: out[m] holds sum_j p_j v_j with
// p_j = exp(s_j - s.max[m]), and s.sum[m] holds sum_j p_j. Partial results over disjoint key
// ranges merge exactly (merge_partial_attention); attend_queries normalizes in place.
template <typename KeyFn, typename ValFn>
void attend_queries_partial(const QueryBlock& qb, int64_t head_dim, KeyFn key, ValFn val,
                            AttentionScratch& s) {
  using Row = std::remove_cv_t<std::remove_pointer_t<decltype(key(int64_t{}))>>;
  static_assert(
      std::is_same_v<Row, float> || std::is_same_v<Row, uint16_t> || std::is_same_v<Row, KvQ8Block>,
      "key rows are f32, bf16 bits or q8_0 blocks");
  const int64_t M = qb.size();
  if (M == 0) return;
  KeyBlockRows<Row>* rows = s.rows<Row>();
  s.scores.resize(static_cast<size_t>(M * kKeyBlock));
  s.max.assign(static_cast<size_t>(M), -std::numeric_limits<float>::infinity());
  s.sum.assign(static_cast<size_t>(M), 0.0f);
  for (int64_t m = 0; m < M; ++m) std::fill_n(qb.out[static_cast<size_t>(m)], head_dim, 0.0f);
  const int64_t first = *std::min_element(qb.lo.begin(), qb.lo.end());
  const int64_t last = *std::max_element(qb.hi.begin(), qb.hi.end());
  auto fetch = [&](KeyBlockRows<Row>& r, int64_t p0) {
    const int64_t nk = std::min(kKeyBlock, last - p0 + 1);
    for (int64_t j = 0; j < nk; ++j) {
      r.keys[j] = key(p0 + j);
      r.values[j] = val(p0 + j);
    }
    return nk;
  };
  const size_t row_bytes = kv_row_bytes<Row>(head_dim);
  const bool prefetch = static_cast<size_t>(last - first + 1) * 2 * row_bytes > kPrefetchMinBytes;
  int64_t nk = fetch(rows[0], first);
  for (int64_t p0 = first, b = 0; p0 <= last; p0 += kKeyBlock, b ^= 1) {
    KeyBlockRows<Row>&cur = rows[b], &next = rows[b ^ 1];
    const int64_t next_nk = p0 + kKeyBlock <= last ? fetch(next, p0 + kKeyBlock) : 0;
    attend_key_block(qb, head_dim, cur, nk, next, prefetch ? next_nk : 0, p0, s);
    nk = next_nk;
  }
}

template <typename KeyFn, typename ValFn>
void attend_queries(const QueryBlock& qb, int64_t head_dim, KeyFn key, ValFn val,
                    AttentionScratch& s) {
  attend_queries_partial(qb, head_dim, key, val, s);
  for (int64_t m = 0; m < qb.size(); ++m) {
    const float inv = 1.0f / s.sum[static_cast<size_t>(m)];
    float* o = qb.out[static_cast<size_t>(m)];
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
  }
}

// attend_queries over contiguous rows: key and value j at k / v + j * head_dim.
template <typename T>
void attend_contiguous(const QueryBlock& qb, int64_t head_dim, const T* k, const T* v,
                       AttentionScratch& s) {
  attend_queries(
      qb, head_dim, [&](int64_t j) { return kv_advance(k, j * head_dim); },
      [&](int64_t j) { return kv_advance(v, j * head_dim); }, s);
}

// out = the attention over the union of n_parts disjoint key ranges, from each range's
// unnormalized output (head_dim floats at part_out + i * stride * head_dim), max[i * stride] and
// sum[i * stride]; a part whose sum is 0 saw no key and its output is not read.
void merge_partial_attention(CpuTier tier, const float* part_out, const float* max,
                             const float* sum, int64_t n_parts, int64_t stride, int64_t head_dim,
                             float* out);

// Double-precision reference over contiguous K/V [n_keys, head_dim].
void attention_reference(const float* q, const float* k, const float* v, int64_t head_dim,
                         int64_t n_keys, float* out);

}  // namespace gemstage
