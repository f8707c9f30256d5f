#include "kernels/attention_layer.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/attention.h"

namespace gemstage {

void attend_layer(ThreadPool& pool, const LayerAttention& a, AttentionWorkspace& ws) {
  const int64_t S = a.rows, H = a.heads, Hkv = a.kv_heads, hd = a.head_dim, start = a.start;
  const int64_t G = H / Hkv, kvw = Hkv * hd;
  // One task per (block of rows, KV head, part of the keys). A task's queries share every key
  // and value row the kernel loads, so a prefill task takes several rows, about
  // kQueriesPerTask queries; causal rows see more keys the later they are, so tasks go to
  // whichever thread is free, latest rows first. Decode has one row, too few (row, KV head)
  // groups to occupy the pool: each group's keys are then split into key_parts ranges whose
  // partial softmax states are merged afterwards, so every key and value is still read once per
  // token (the cache at depth is what decode reads besides the weights).
  constexpr int64_t kQueriesPerTask = 16;
  const int64_t per_group = S * Hkv;
  const int64_t key_parts = per_group < pool.size() ? (pool.size() + per_group - 1) / per_group : 1;
  const int64_t rows_per_task = key_parts > 1 ? 1 : std::max<int64_t>(1, kQueriesPerTask / G);
  const int64_t row_blocks = (S + rows_per_task - 1) / rows_per_task;
  const int64_t n_tasks = row_blocks * Hkv * key_parts;
  const int64_t n_queries = S * H;
  if (key_parts > 1) {
    ws.part_out.resize(static_cast<size_t>(key_parts * n_queries * hd));
    ws.part_max.resize(static_cast<size_t>(key_parts * n_queries));
    ws.part_sum.resize(static_cast<size_t>(key_parts * n_queries));
  }
  // T: the cache's row type (float or bf16 bits); the call's fresh rows come in the same type.
  auto attend_tasks = [&]<typename T>(const T* fresh_k, const T* fresh_v) {
    pool.parallel_chunks(static_cast<size_t>(n_tasks), 1, [&](size_t b, size_t e) {
      thread_local AttentionScratch scratch;
      thread_local QueryBlock queries;
      for (size_t task = b; task < e; ++task) {
        const int64_t t = static_cast<int64_t>(task);
        const int64_t rb = row_blocks - 1 - t / (Hkv * key_parts), kvh = t / key_parts % Hkv;
        const int64_t part = t % key_parts;
        queries.clear();
        queries.tier = pool.tier();
        for (int64_t r = rb * rows_per_task; r < std::min(S, (rb + 1) * rows_per_task); ++r) {
          const int64_t pos = start + r;
          // Sliding: keys in (pos - W, pos]; full: [0, pos]; an image row may see further.
          int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
          int64_t hi = a.last_key ? std::max(pos, a.last_key[r]) : pos;
          float* out = a.out;
          if (key_parts > 1) {  // this part's share of the key blocks; may be empty
            const int64_t blocks = (hi - lo + kKeyBlock) / kKeyBlock;
            const int64_t per_part = (blocks + key_parts - 1) / key_parts;
            lo += part * per_part * kKeyBlock;
            hi = std::min(hi, lo + per_part * kKeyBlock - 1);
            out = ws.part_out.data() + part * n_queries * hd;
            for (int64_t g = 0; g < G; ++g)  // marks an empty part for the merge
              ws.part_sum[static_cast<size_t>(part * n_queries + r * H + kvh * G + g)] = 0.0f;
            if (lo > hi) continue;
          }
          for (int64_t g = 0; g < G; ++g) {
            const int64_t at = (r * H + kvh * G + g) * hd;
            queries.add(a.q + at, out + at, lo, hi);
          }
        }
        if (queries.size() == 0) continue;
        // Keys before the call come from the cache, the rest from the call's fresh K/V.
        auto key = [&](int64_t p) {
          return kv_advance(p < start ? a.past->k_at<T>(p) : kv_advance(fresh_k, (p - start) * kvw),
                            kvh * hd);
        };
        auto val = [&](int64_t p) {
          return kv_advance(p < start ? a.past->v_at<T>(p) : kv_advance(fresh_v, (p - start) * kvw),
                            kvh * hd);
        };
        if (key_parts == 1) {
          attend_queries(queries, hd, key, val, scratch);
          continue;
        }
        attend_queries_partial(queries, hd, key, val, scratch);
        for (int64_t m = 0; m < queries.size(); ++m) {  // G heads of one row, in order
          const int64_t at = (queries.out[static_cast<size_t>(m)] - ws.part_out.data()) / hd;
          ws.part_max[static_cast<size_t>(at)] = scratch.max[static_cast<size_t>(m)];
          ws.part_sum[static_cast<size_t>(at)] = scratch.sum[static_cast<size_t>(m)];
        }
      }
    });
  };
  if (a.past->kv_type() == KvType::Q8_0 && hd % kKvQ8Values != 0)
    fail("a q8_0 KV cache needs a head_dim that is a multiple of ", kKvQ8Values,
         "; this layer's is ", hd, " (use --cache-type-k/-v bf16)");
  if (a.past->kv_type() == KvType::BF16)
    attend_tasks(static_cast<const uint16_t*>(a.fresh_k), static_cast<const uint16_t*>(a.fresh_v));
  else if (a.past->kv_type() == KvType::Q8_0)
    attend_tasks(static_cast<const KvQ8Block*>(a.fresh_k),
                 static_cast<const KvQ8Block*>(a.fresh_v));
  else
    attend_tasks(static_cast<const float*>(a.fresh_k), static_cast<const float*>(a.fresh_v));
  if (key_parts > 1)
    for (int64_t i = 0; i < n_queries; ++i)
      merge_partial_attention(pool.tier(), ws.part_out.data() + i * hd, ws.part_max.data() + i,
                              ws.part_sum.data() + i, key_parts, n_queries, hd, a.out + i * hd);
}

}  // namespace gemstage
