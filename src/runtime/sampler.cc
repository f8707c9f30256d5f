#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "io/mapped_file.h"

namespace gemstage {

Sampler::Sampler(const SamplingParams& p) : p_(p), state_(p.seed ^ 0x853c49e6748fea9bull) {
  if (!(p.temperature >= 0)) fail("temperature must be >= 0");
  if (p.top_k < 0) fail("top_k must be >= 0");
  if (!(p.top_p > 0 && p.top_p <= 1)) fail("top_p must be in (0, 1]");
  if (!(p.min_p >= 0 && p.min_p <= 1)) fail("min_p must be in [0, 1]");
  if (!(p.repetition_penalty > 0)) fail("repetition penalty must be > 0");
  if (!(std::abs(p.frequency_penalty) <= 2) || !(std::abs(p.presence_penalty) <= 2))
    fail("frequency and presence penalties must be in [-2, 2]");
  for (const auto& [id, bias] : p.logit_bias)
    if (!std::isfinite(bias)) fail("logit bias of token ", id, " is not a finite number");
}

double Sampler::uniform() {
  // splitmix64: identical sequences everywhere for the same seed.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
}

std::vector<int32_t> load_suppress_tokens(const std::string& model_dir) {
  const std::filesystem::path path = std::filesystem::path(model_dir) / "generation_config.json";
  std::vector<int32_t> ids;
  if (model_dir.empty() || !std::filesystem::exists(path)) return ids;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file(path.string(), size_t{1} << 20));
  } catch (const nlohmann::json::exception& e) {
    fail(path.string(), ": not valid JSON (", e.what(), ")");
  }
  if (!j.is_object() || !j.contains("suppress_tokens") || j["suppress_tokens"].is_null())
    return ids;
  const auto& s = j["suppress_tokens"];
  if (!s.is_array()) fail(path.string(), ": suppress_tokens must be a list of token ids");
  for (const auto& x : s) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > (int64_t{1} << 31) - 1)
      fail(path.string(), ": suppress_tokens entries must be non-negative token ids, found ",
           x.dump());
    ids.push_back(x.get<int32_t>());
  }
  return ids;
}

int32_t Sampler::sample(const float* logits, int64_t V, std::span<const int32_t> history) {
  std::vector<double> prob;
  const double total = distribution(logits, V, history, prob);
  double r = uniform() * total;
  for (size_t i = 0; i < prob.size(); ++i) {
    r -= prob[i];
    if (r < 0) return idx_[i];
  }
  return idx_[prob.size() - 1];
}

double Sampler::distribution(const float* logits, int64_t V, std::span<const int32_t> history,
                             std::vector<double>& prob) {
  if (V <= 0) fail("sampler: empty vocabulary");
  work_.assign(logits, logits + V);
  if (p_.repetition_penalty != 1.0f) {
    const size_t n = p_.repeat_last_n < 0
                         ? history.size()
                         : std::min(history.size(), static_cast<size_t>(p_.repeat_last_n));
    std::unordered_set<int32_t> seen(history.end() - static_cast<std::ptrdiff_t>(n), history.end());
    for (int32_t t : seen) {
      if (t < 0 || t >= V) continue;
      float& l = work_[static_cast<size_t>(t)];
      l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    }
  }
  if (p_.frequency_penalty != 0.0f || p_.presence_penalty != 0.0f) {
    const size_t n = p_.repeat_last_n < 0
                         ? history.size()
                         : std::min(history.size(), static_cast<size_t>(p_.repeat_last_n));
    std::unordered_map<int32_t, int> count;
    for (auto it = history.end() - static_cast<std::ptrdiff_t>(n); it != history.end(); ++it)
      ++count[*it];
    for (const auto& [t, c] : count)
      if (t >= 0 && t < V)
        work_[static_cast<size_t>(t)] -=
            p_.frequency_penalty * static_cast<float>(c) + p_.presence_penalty;
  }
  for (const auto& [t, bias] : p_.logit_bias)
    if (t >= 0 && t < V) work_[static_cast<size_t>(t)] += bias;
  for (int32_t t : p_.suppress_tokens)
    if (t >= 0 && t < V) work_[static_cast<size_t>(t)] = -std::numeric_limits<float>::infinity();
  if (p_.temperature == 0.0f) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (work_[static_cast<size_t>(i)] > work_[static_cast<size_t>(best)]) best = i;
    idx_.assign(1, static_cast<int32_t>(best));
    prob.assign(1, 1.0);
    return 1.0;
  }
  for (float& l : work_) l /= p_.temperature;
  // Candidates sorted by logit, descending (stable: ties keep the lower id first).
  idx_.resize(static_cast<size_t>(V));
  std::iota(idx_.begin(), idx_.end(), 0);
  size_t keep = static_cast<size_t>(V);
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < keep) {
    keep = static_cast<size_t>(p_.top_k);
    std::partial_sort(
        idx_.begin(), idx_.begin() + static_cast<std::ptrdiff_t>(keep), idx_.end(),
        [&](int32_t a, int32_t b) {
          return work_[static_cast<size_t>(a)] > work_[static_cast<size_t>(b)] ||
                 (work_[static_cast<size_t>(a)] == work_[static_cast<size_t>(b)] && a < b);
        });
  } else {
    std::stable_sort(idx_.begin(), idx_.end(), [&](int32_t a, int32_t b) {
      return work_[static_cast<size_t>(a)] > work_[static_cast<size_t>(b)];
    });
  }
  idx_.resize(keep);
  prob.assign(keep, 0.0);
  const double mx = work_[static_cast<size_t>(idx_[0])];
  double sum = 0;
  for (size_t i = 0; i < keep; ++i)
    sum += (prob[i] = std::exp(static_cast<double>(work_[static_cast<size_t>(idx_[i])]) - mx));
  for (double& q : prob) q /= sum;
  if (p_.top_p < 1.0f) {
    // Smallest prefix whose mass reaches top_p (always at least one token).
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += prob[n++];
      if (cum >= p_.top_p) break;
    }
    keep = n;
  }
  if (p_.min_p > 0.0f) {
    const double floor_p = p_.min_p * prob[0];
    size_t n = 1;
    while (n < keep && prob[n] >= floor_p) ++n;
    keep = n;
  }
  prob.resize(keep);
  idx_.resize(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += prob[i];
  return total;
}

}  // namespace gemstage
