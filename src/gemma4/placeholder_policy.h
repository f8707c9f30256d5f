// The one place that decides which token identity each row gets.
//
// Hugging Face (Gemma4Model.forward) replaces every image / video / audio placeholder id with
// pad_token_id before BOTH the main embedding lookup and the per-layer-embedding (PLE) lookup;
// the tower features are spliced into the placeholder rows afterwards, so the PLE *projection*
// sees the image while the PLE *identity* sees PAD. Staged exports that re-derive PLE ids from
// raw input_ids look up image_token_id instead and the model ignores the image. Keeping the
// policy here, with its own tests, and passing its result as named tensors makes that
// impossible to re-derive elsewhere.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace gemstage {

enum class PleIdentity {
  Pad,  // HF behaviour (default)
  Raw,  // DIAGNOSTIC ONLY: raw placeholder ids feed the PLE table, reproducing the known bug
};

struct TokenIdentity {
  std::vector<int32_t> embed_ids;       // ids for the main embedding lookup (HF llm_input_ids)
  std::vector<int32_t> ple_ids;         // ids for the PLE table lookup
  std::vector<uint8_t> is_placeholder;  // 1 where a tower feature will be spliced in
};

// Throws if an id is outside [0, vocab_size) or, for ple ids, outside [0, ple_vocab_size).
TokenIdentity resolve_token_identity(std::span<const int32_t> input_ids,
                                     std::span<const int> placeholder_ids, int pad_token_id,
                                     int vocab_size, int ple_vocab_size,
                                     PleIdentity mode = PleIdentity::Pad);

}  // namespace gemstage
