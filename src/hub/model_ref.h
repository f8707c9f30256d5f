// A model named the way the Hugging Face Hub names it: ORG/NAME, optionally @REVISION (a branch,
// a tag or a 40-hex commit). docs/models-by-name.md describes how a name becomes a directory.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace gemstage::hub {

// The branch a name without @REVISION means (huggingface_hub's DEFAULT_REVISION).
inline constexpr const char* kDefaultRevision = "main";

struct ModelRef {
  std::string org, name;
  std::string revision;  // as written; empty: kDefaultRevision

  std::string repo_id() const { return org + "/" + name; }
  const std::string& revision_or_default() const;
  // ORG/NAME, with @REVISION when one was given.
  std::string display() const;
};

// ORG/NAME[@REVISION] under the Hub's naming rules (docs/hf-hub.md "Names"), or nullopt when text
// is not of that form (a path, a bare name, characters the Hub does not allow).
std::optional<ModelRef> parse_model_ref(std::string_view text);

// Whether a revision names a commit: exactly 40 lowercase hex digits, as the Hub writes them.
bool is_commit_hash(std::string_view revision);

}  // namespace gemstage::hub
