// A transformer stage's KV cache group as named tensors on disk, so any one call of the stage (a
// decode step, a later prefill chunk) can be run alone from the state the calls before it left:
// `dump --cache-out`, `run-stage --past` and `run-stage --cache-out`.
//
//   DIR/kv_cache.json           {"format": "gemstage-kv-cache", "version": 1, "stage": ID,
//                                "layers": [B, E], "n_past": N, "kv_type": "f32"|"bf16"|"q8_0",
//                                "caches": [{"layer": L, "kind": "ring"|"growing", "width": D,
//                                            "window": W, "first_position": P}, ...]}
//   DIR/layer_L.k.npy / .v.npy  float32 [N - P, D]: the rows of positions P..N-1 that layer L
//                                keeps (a sliding ring keeps its last window + slack rows), K
//                                after k_norm and RoPE, V after its norm, as the cache holds them.
//
// The rows are widened to f32 from the cache's row type; loading rounds them back into that type,
// which gives back the same bits (every bf16 and q8_0 value is exact in f32, and a q8_0 block's
// scale is recomputed exactly from its largest value), so a restored cache equals the saved one.
// KV-shared layers keep nothing and have no files: they read their donor's rows.
#pragma once

#include <memory>
#include <string>

#include "cache/kv_cache.h"
#include "stage/stage.h"

namespace gemstage {

// Writes `cache` (a cache group of `stage`) into dir, creating it.
void save_stage_cache(const Stage& stage, const KvCache& cache, const std::string& dir);

// Reads what save_stage_cache wrote into a new cache group of `stage` with room for max_context
// positions (more than the saved n_past, so the next call's rows fit). Refuses, naming the file and
// field, a directory written for another stage or layer range, rows of the wrong width or count,
// and a context too small for the saved positions.
std::unique_ptr<KvCache> load_stage_cache(const Stage& stage, const std::string& dir,
                                          int64_t max_context);

}  // namespace gemstage
