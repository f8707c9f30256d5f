#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/error.h"
#include "runtime/generation.h"

using namespace gemstage;

TEST(Sampler, GreedyTakesTheFirstMaximum) {
  const std::vector<float> l = {0.1f, 3.0f, 3.0f, -1.0f};
  Sampler s(SamplingParams::greedy());
  EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedDiffers) {
  std::vector<float> l(50);
  for (size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(i % 7) * 0.3f;
  SamplingParams p;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.seed = 42;
  auto run = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(l.data(), 50, {}));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, TopKOneIsGreedyAndTopPKeepsTheHead) {
  const std::vector<float> l = {1.0f, 5.0f, 4.9f, 0.0f};
  SamplingParams p;
  p.top_k = 1;
  p.top_p = 1.0f;
  Sampler s(p);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
  p.top_k = 0;
  p.top_p = 0.5f;  // token 1 alone holds ~52% of the mass
  Sampler s2(p);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(s2.sample(l.data(), 4, {}), 1);
}

TEST(Sampler, MinPDropsTheTail) {
  const std::vector<float> l = {5.0f, 4.0f, -3.0f, -3.0f};
  SamplingParams p;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.1f;  // exp(-8) relative mass is far below 0.1
  Sampler s(p);
  for (int i = 0; i < 200; ++i) EXPECT_LT(s.sample(l.data(), 4, {}), 2);
}

TEST(Sampler, DistributionFollowsTheSoftmax) {
  const std::vector<float> l = {0.0f, std::log(3.0f)};  // probabilities 1/4 and 3/4
  SamplingParams p;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.seed = 7;
  Sampler s(p);
  int ones = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ones += s.sample(l.data(), 2, {}) == 1;
  EXPECT_NEAR(static_cast<double>(ones) / n, 0.75, 0.015);
}

TEST(Sampler, RepetitionPenaltyDiscouragesSeenTokens) {
  const std::vector<float> l = {2.0f, 1.9f};
  SamplingParams p = SamplingParams::greedy();
  p.repetition_penalty = 1.5f;  // 2.0 / 1.5 < 1.9
  Sampler s(p);
  const std::vector<int32_t> hist = {0};
  EXPECT_EQ(s.sample(l.data(), 2, hist), 1);
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THROW(Sampler{p}, Error);
  p = {};
  p.temperature = -1.0f;
  EXPECT_THROW(Sampler{p}, Error);
}

TEST(Sampler, TokenLogprobIsTheLogSoftmaxAndTheTopAreSorted) {
  // log-softmax of {1, 3, 2, 3}: log Z = log(e + 2e^3 + e^2).
  const float logits[] = {1.0f, 3.0f, 2.0f, 3.0f};
  const double log_z = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  const TokenLogprob t = token_logprob(logits, 4, 2, 3);
  EXPECT_EQ(t.id, 2);
  EXPECT_NEAR(t.logprob, 2.0 - log_z, 1e-6);
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].first, 1);  // ties: the lower id first
  EXPECT_EQ(t.top[1].first, 3);
  EXPECT_EQ(t.top[2].first, 2);
  EXPECT_NEAR(t.top[0].second, 3.0 - log_z, 1e-6);
  EXPECT_TRUE(token_logprob(logits, 4, 0, 0).top.empty());
  EXPECT_EQ(token_logprob(logits, 4, 0, 10).top.size(), 4u);
}
