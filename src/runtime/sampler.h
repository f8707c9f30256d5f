// Token sampling with the Hugging Face logits-processor order: repetition penalty (then OpenAI's
// frequency / presence penalties and logit_bias), then temperature, top-k, top-p, min-p, then a
// draw. temperature 0 is greedy (first index on ties).
// A seeded generator of our own makes runs reproducible across machines and library versions.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace gemstage {

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy
  int top_k = 64;                   // 0: off
  float top_p = 0.95f;              // 1: off
  float min_p = 0.0f;               // 0: off
  float repetition_penalty = 1.0f;  // 1: off (HF/CTRL style: divide positive, multiply negative)
  int repeat_last_n = 64;           // how much history the penalty sees; -1: all
  // OpenAI's penalties, over the same window of history as the repetition penalty:
  // logit -= frequency_penalty x (times the token occurs) + presence_penalty x (it occurs at all).
  float frequency_penalty = 0.0f, presence_penalty = 0.0f;  // 0: off; each in [-2, 2]
  // OpenAI's logit_bias: added to the token's logit after the penalties (+100 all but forces it,
  // -100 all but bans it); ids outside the vocabulary are ignored.
  std::vector<std::pair<int32_t, float>> logit_bias;
  uint64_t seed = 0;
  // generation_config.json suppress_tokens: their logits are -inf at every step, greedy
  // included (gemma4_unified suppresses <audio|> and <image|>, which are never generated).
  std::vector<int32_t> suppress_tokens;

  static SamplingParams greedy() {
    SamplingParams p;
    p.temperature = 0.0f;
    return p;
  }
};

// generation_config.json's suppress_tokens in a checkpoint or bundle directory (empty when the
// file or the field is absent); a malformed field is an error naming the file.
std::vector<int32_t> load_suppress_tokens(const std::string& model_dir);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // history: tokens so far (prompt + generated), for the repetition penalty.
  int32_t sample(const float* logits, int64_t vocab, std::span<const int32_t> history);
  const SamplingParams& params() const { return p_; }
  // The distribution sample() draws from: candidates() (ids) with weights `prob` whose sum is
  // returned (divide by it for probabilities); greedy gives the argmax alone with weight 1.
  // Speculative decoding's acceptance rule needs the target's distribution itself.
  double distribution(const float* logits, int64_t vocab, std::span<const int32_t> history,
                      std::vector<double>& prob);
  const std::vector<int32_t>& candidates() const { return idx_; }
  // A uniform draw in [0, 1) from this sampler's seeded generator.
  double next_uniform() { return uniform(); }

 private:
  double uniform();  // [0, 1)

  SamplingParams p_;
  uint64_t state_;
  std::vector<float> work_;
  std::vector<int32_t> idx_;
};

}  // namespace gemstage
