#include "distributed/placement.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"

namespace gemstage {

Placement default_placement(const std::vector<std::string>& stage_ids,
                            const std::vector<bool>& is_transformer, int ranks) {
  GEMSTAGE_CHECK(stage_ids.size() == is_transformer.size(), "placement: stage lists differ");
  if (ranks < 1) fail("placement: ", ranks, " ranks");
  Placement p;
  for (int r = 0; r < ranks; ++r) p[r];
  std::vector<std::string> layers;
  for (size_t i = 0; i < stage_ids.size(); ++i) {
    if (is_transformer[i] && ranks > 1)
      layers.push_back(stage_ids[i]);
    else
      p[0].push_back(stage_ids[i]);
  }
  const int workers = ranks - 1;
  if (workers > 0 && static_cast<int>(layers.size()) < workers)
    fail("placement: ", ranks, " ranks but only ", layers.size(),
         " transformer stages; use fewer ranks or a bundle split into more stages");
  // Contiguous runs, the first ranks taking one more when the count does not divide.
  size_t next = 0;
  for (int w = 0; w < workers; ++w) {
    const size_t take =
        layers.size() / workers + (static_cast<size_t>(w) < layers.size() % workers);
    for (size_t k = 0; k < take; ++k) p[w + 1].push_back(layers[next++]);
  }
  return p;
}

Placement parse_placement(const std::string& spec, const std::vector<std::string>& stage_ids,
                          int ranks) {
  Placement p;
  std::set<std::string> placed;
  std::istringstream words(spec);
  std::string word;
  while (words >> word) {
    const auto eq = word.find('=');
    if (eq == std::string::npos || eq == 0)
      fail("--placement: '", word, "' is not RANK=STAGE[,STAGE...]");
    int rank = -1;
    try {
      size_t used = 0;
      rank = std::stoi(word.substr(0, eq), &used);
      if (used != eq) rank = -1;
    } catch (const std::exception&) {
    }
    if (rank < 0 || rank >= ranks)
      fail("--placement: rank '", word.substr(0, eq), "' outside 0..", ranks - 1);
    if (p.count(rank)) fail("--placement: rank ", rank, " named twice");
    auto& list = p[rank];
    std::istringstream ids(word.substr(eq + 1));
    std::string id;
    while (std::getline(ids, id, ',')) {
      if (std::find(stage_ids.begin(), stage_ids.end(), id) == stage_ids.end())
        fail("--placement: rank ", rank, ": the bundle has no stage '", id, "'");
      if (!placed.insert(id).second) fail("--placement: stage '", id, "' placed twice");
      list.push_back(id);
    }
  }
  for (const auto& id : stage_ids)
    if (!placed.count(id)) fail("--placement: stage '", id, "' is not placed on any rank");
  for (int r = 0; r < ranks; ++r) p[r];
  return p;
}

std::string placement_spec(const Placement& p) {
  std::string s;
  for (const auto& [rank, ids] : p) {
    if (ids.empty()) continue;
    if (!s.empty()) s += ' ';
    s += std::to_string(rank) + '=';
    for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + ids[i];
  }
  return s;
}

void check_front_placement(const Placement& p, const std::string& embeddings_id) {
  for (const auto& [rank, ids] : p)
    if (rank != 0 && std::find(ids.begin(), ids.end(), embeddings_id) != ids.end())
      fail("--placement: stage '", embeddings_id, "' is on rank ", rank,
           "; it must be on rank 0, which holds the tokenizer and the image and audio towers");
}

std::string encode_rank_identity(const RankIdentity& id) {
  nlohmann::json j{{"rank", id.rank},
                   {"host", id.host},
                   {"manifest_sha256", id.manifest_sha256},
                   {"stages_held", id.stages_held},
                   {"decode_weight_bytes", id.decode_weight_bytes},
                   {"error", id.error}};
  return j.dump();
}

RankIdentity decode_rank_identity(const std::string& bytes, const std::string& where) {
  try {
    const auto j = nlohmann::json::parse(bytes);
    RankIdentity id;
    id.rank = j.at("rank").get<int>();
    id.host = j.at("host").get<std::string>();
    id.manifest_sha256 = j.at("manifest_sha256").get<std::string>();
    id.stages_held = j.at("stages_held").get<std::vector<std::string>>();
    id.decode_weight_bytes = j.value("decode_weight_bytes", std::map<std::string, double>{});
    id.error = j.value("error", "");
    return id;
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": bad rank identity: ", e.what());
  }
}

void check_handshake(const std::string& manifest_sha256, const Placement& placement,
                     const std::vector<RankIdentity>& ranks) {
  if (ranks.size() != placement.size())
    fail("handshake: ", ranks.size(), " ranks answered, the placement has ", placement.size());
  for (const auto& id : ranks) {
    const auto it = placement.find(id.rank);
    if (it == placement.end()) fail("handshake: rank ", id.rank, " on ", id.host, " not placed");
    if (!id.error.empty())
      fail("handshake: rank ", id.rank, " on host ", id.host,
           " could not open its stages: ", id.error);
    if (id.manifest_sha256 != manifest_sha256)
      fail("handshake: rank ", id.rank, " on host ", id.host, " opened another bundle (manifest ",
           id.manifest_sha256, ", rank 0 has ", manifest_sha256, ")");
    for (const auto& want : it->second)
      if (std::find(id.stages_held.begin(), id.stages_held.end(), want) == id.stages_held.end())
        fail("handshake: rank ", id.rank, " on host ", id.host, " does not hold stage '", want,
             "' that the placement gives it");
  }
}

}  // namespace gemstage
