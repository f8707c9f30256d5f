#include "gemma4/placeholder_policy.h"

#include <algorithm>

#include "core/error.h"

namespace gemstage {

TokenIdentity resolve_token_identity(std::span<const int32_t> input_ids,
                                     std::span<const int> placeholder_ids, int pad_token_id,
                                     int vocab_size, int ple_vocab_size, PleIdentity mode) {
  TokenIdentity t;
  t.embed_ids.reserve(input_ids.size());
  t.ple_ids.reserve(input_ids.size());
  t.is_placeholder.reserve(input_ids.size());
  for (size_t i = 0; i < input_ids.size(); ++i) {
    const int32_t id = input_ids[i];
    const bool ph =
        std::find(placeholder_ids.begin(), placeholder_ids.end(), id) != placeholder_ids.end();
    if (!ph && (id < 0 || id >= vocab_size))
      fail("input_ids[", i, "] = ", id, " is outside the vocabulary [0, ", vocab_size, ")");
    t.is_placeholder.push_back(ph ? 1 : 0);
    t.embed_ids.push_back(ph ? pad_token_id : id);
    const int32_t ple = (ph && mode == PleIdentity::Pad) ? pad_token_id : id;
    if (ple_vocab_size > 0 && (ple < 0 || ple >= ple_vocab_size))
      fail("input_ids[", i, "] = ", ple, " is outside the per-layer-embedding vocabulary [0, ",
           ple_vocab_size, ")");
    t.ple_ids.push_back(ple);
  }
  return t;
}

}  // namespace gemstage
