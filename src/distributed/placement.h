// Which rank runs which of a bundle's stages, and the start-up handshake that proves every rank
// opened the same bundle and holds the stages it is meant to (issue 22).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace gemstage {

// rank -> the stage ids it runs, in pipeline order. Rank 0 also holds the tokenizer and the server.
using Placement = std::map<int, std::vector<std::string>>;

// The default: rank 0 the non-transformer stages (embeddings, final norm + head), ranks 1.. the
// transformer stages in order, spread as evenly as the rank count allows. `stage_ids` and
// `is_transformer` are the bundle's stages in order. With one rank everything is on rank 0.
Placement default_placement(const std::vector<std::string>& stage_ids,
                            const std::vector<bool>& is_transformer, int ranks);

// Parses "--placement 0=embeddings,head 1=layers_0_13 2=layers_13_35": every bundle
// stage placed exactly once, every rank in [0, ranks) named, only known stage ids.
Placement parse_placement(const std::string& spec, const std::vector<std::string>& stage_ids,
                          int ranks);

// The placement as "--placement" text (what rank 0 sends every worker, so all agree on it).
std::string placement_spec(const Placement& p);

// Rank 0 runs the embeddings stage (the vision and audio towers the front calls directly live in
// it) and the tokenizer; throws naming the rank that holds it otherwise.
void check_front_placement(const Placement& p, const std::string& embeddings_id);

// What each rank reports at start.
struct RankIdentity {
  int rank = 0;
  std::string host;
  std::string manifest_sha256;
  std::vector<std::string> stages_held;  // stage ids whose weight files this rank opened
  // Per held stage: bytes of every matrix it reads for one decoded token.
  std::map<std::string, double> decode_weight_bytes;
  std::string error;  // why the rank could not open its stages; empty when it did
};

std::string encode_rank_identity(const RankIdentity& id);
RankIdentity decode_rank_identity(const std::string& bytes, const std::string& where);

// Rank 0's check of everyone's identity against its own manifest hash and the placement; throws
// naming the rank and host that differ (another bundle, or a stage it does not hold).
void check_handshake(const std::string& manifest_sha256, const Placement& placement,
                     const std::vector<RankIdentity>& ranks);

}  // namespace gemstage
