// Helpers shared by the subcommands: thread pool sizing, timing, argmax, warnings.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "stage/sequence.h"

namespace gemstage::cli {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// First index of the maximum (greedy decoding takes the first index on ties).
inline int64_t argmax_first(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

// --cache-type: the KV cache's row type, "auto" leaving the model's choice
// (Model::default_kv_type). llama.cpp's --cache-type-k / --cache-type-v (-ctk / -ctv, translated
// in gemstage.cc) set it too; gemstage keeps K and V in one type, so two different types are
// refused rather than one of them ignored.
inline void add_cache_type(CLI::App* sub, std::string& v) {
  const auto types = CLI::IsMember({"auto", "f32", "bf16", "q8_0"});
  sub->add_option("--cache-type", v,
                  "KV cache row type: auto (bf16 for Q8_0/Q4_0 weights, else f32), f32, bf16 or "
                  "q8_0 (int8 codes per 32 values with an f16 scale, 0.53x bf16's bytes)")
      ->check(types)
      ->capture_default_str();
  for (const char* kv : {"--cache-type-k", "--cache-type-v"})
    sub->add_option_function<std::string>(
           kv,
           [&v, kv](const std::string& t) {
             if (v != "auto" && v != t)
               throw CLI::ValidationError(
                   kv, "K and V share one cache type in gemstage; got " + v + " and " + t);
             v = t;
           },
           std::string("KV cache row type of ") + (kv[13] == 'k' ? "K" : "V") + " (also -ct" +
               (kv[13] == 'k' ? "k" : "v") +
               ", as llama.cpp); gemstage keeps K and V in one type: either alone sets both, and "
               "the two must agree")
        ->check(types);
}
inline std::optional<KvType> cache_type_of(const std::string& v) {
  KvType t;
  if (!kv_type_from_name(v, &t)) return std::nullopt;  // "auto"
  return t;
}
inline void apply_cache_type(Sequence& p, const std::string& v) {
  if (const auto t = cache_type_of(v)) p.set_kv_type(*t);
}

inline void print_model_notes(const std::vector<std::string>& notes, bool verbose) {
  if (notes.empty()) return;
  if (verbose) {
    for (const auto& n : notes) std::cerr << "note: " << n << "\n";
  } else {
    std::cerr << "note: " << notes.size()
              << " config field(s) / tensor(s) not used by gemstage (--verbose lists them)\n";
  }
}

}  // namespace gemstage::cli
