// Several sequences in one call (Sequence::forward_batch): each sequence gets what it gets alone,
// with prompts, images and decode rows mixed in one step.
#include <gtest/gtest.h>

#include "gemma4/vision_model.h"
#include "stage/sequence.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;

namespace {

int32_t argmax(const FloatTensor& logits) {
  const float* row = logits.row(logits.dim(0) - 1);
  int32_t best = 0;
  for (int32_t i = 1; i < logits.dim(1); ++i)
    if (row[i] > row[best]) best = i;
  return best;
}

struct Prompt {
  std::vector<int32_t> ids;
  FloatTensor soft;  // empty without images
  const FloatTensor* soft_ptr() const { return soft.numel() ? &soft : nullptr; }
};

std::vector<Prompt> prompts(const Model& m, ThreadPool& pool) {
  std::vector<Prompt> p(3);
  p[0].ids = load_ids(fixture("text/input_ids.npy"));
  p[1].ids = load_ids(fixture("long/input_ids.npy"));
  p[2].ids = load_ids(fixture("multimodal/input_ids.npy"));
  const auto images = vision_inputs_from_arrays(
      load_npy(fixture("multimodal/pixel_values.npy")),
      load_npy(fixture("multimodal/image_position_ids.npy")), m.vision()->patch_dim(),
      "pixel_values.npy", "image_position_ids.npy");
  p[2].soft = m.embeddings().encode_images(pool, images, nullptr);
  return p;
}

// Each prompt alone: its last-row logits after the prompt and after each of `steps` greedy tokens.
std::vector<std::vector<FloatTensor>> alone(const std::shared_ptr<const Model>& m,
                                            const std::vector<Prompt>& ps, int steps,
                                            ThreadPool& pool) {
  std::vector<std::vector<FloatTensor>> out;
  for (const Prompt& p : ps) {
    Sequence seq(m, 256);
    std::vector<FloatTensor> rows{seq.forward(pool, p.ids, p.soft_ptr(), false, nullptr)};
    for (int s = 0; s < steps; ++s) {
      const int32_t next = argmax(rows.back());
      rows.push_back(
          seq.forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr));
    }
    out.push_back(std::move(rows));
  }
  return out;
}

}  // namespace

TEST(Batch, EachSequenceGetsWhatItGetsAloneWithAnImageInTheBatch) {
  const auto model = Model::open(fixture("model"));
  ThreadPool pool(2);
  const std::vector<Prompt> ps = prompts(*model, pool);
  constexpr int kSteps = 6;
  const auto want = alone(model, ps, kSteps, pool);
  // The alone runs are the golden greedy decodes (the parity tests check their logits).
  for (auto [k, dir] : {std::pair{0, "text"}, std::pair{1, "long"}, std::pair{2, "multimodal"}}) {
    const std::vector<int64_t> golden =
        load_npy(fixture(std::string(dir) + "/decode_ids.npy")).to_i64();
    for (int s = 0; s < kSteps; ++s)
      EXPECT_EQ(argmax(want[static_cast<size_t>(k)][static_cast<size_t>(s)]),
                golden[static_cast<size_t>(s)])
          << dir << " step " << s;
  }

  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int k = 0; k < 3; ++k) seqs.push_back(std::make_unique<Sequence>(model, 256));
  std::vector<BatchEntry> batch;
  for (size_t k = 0; k < 3; ++k)
    batch.push_back({seqs[k].get(), ps[k].ids, ps[k].soft_ptr(), false});
  std::vector<FloatTensor> got = Sequence::forward_batch(pool, batch);
  std::vector<int32_t> next(3);
  for (int s = 0; s <= kSteps; ++s) {
    ASSERT_EQ(got.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      ASSERT_EQ(got[k].shape, want[k][static_cast<size_t>(s)].shape);
      EXPECT_LE(max_abs_diff(got[k].data, want[k][static_cast<size_t>(s)].data), 1e-4)
          << "sequence " << k << " step " << s;
      next[k] = argmax(got[k]);
      EXPECT_EQ(next[k], argmax(want[k][static_cast<size_t>(s)])) << "sequence " << k;
    }
    if (s == kSteps) break;
    for (size_t k = 0; k < 3; ++k)
      batch[k] = {seqs[k].get(), std::span<const int32_t>(&next[k], 1), nullptr, false};
    got = Sequence::forward_batch(pool, batch);
  }
  for (size_t k = 0; k < 3; ++k)
    EXPECT_EQ(seqs[k]->n_past(), static_cast<int64_t>(ps[k].ids.size()) + kSteps);
}

// A long prompt prefilled in chunks while another sequence decodes: each step mixes one decode
// row with a prompt chunk, and both end where they end alone.
TEST(Batch, PromptChunksMixWithDecodeRows) {
  const auto model = Model::open(fixture("model"));
  ThreadPool pool(2);
  const std::vector<int32_t> text = load_ids(fixture("text/input_ids.npy"));
  const std::vector<int32_t> longp = load_ids(fixture("long/input_ids.npy"));
  const auto want = alone(model, {{text, {}}, {longp, {}}}, 4, pool);

  Sequence a(model, 256), b(model, 256);
  FloatTensor la = a.forward(pool, text, nullptr, false, nullptr);
  const size_t chunk = (longp.size() + 3) / 4;
  FloatTensor lb;
  for (size_t at = 0, step = 0; at < longp.size(); at += chunk, ++step) {
    const int32_t next = argmax(la);
    const auto part =
        std::span<const int32_t>(longp).subspan(at, std::min(chunk, longp.size() - at));
    const BatchEntry batch[] = {{&a, std::span<const int32_t>(&next, 1), nullptr, false},
                                {&b, part, nullptr, true}};
    auto got = Sequence::forward_batch(pool, batch);
    EXPECT_LE(max_abs_diff(got[0].data, want[0][step + 1].data), 1e-4) << "decode step " << step;
    EXPECT_EQ(got[1].dim(0), static_cast<int64_t>(part.size()));
    la = std::move(got[0]);
    lb = std::move(got[1]);
  }
  // The last row of the last chunk is the long prompt's last-row logits.
  FloatTensor last({1, lb.dim(1)});
  std::copy(lb.row(lb.dim(0) - 1), lb.row(lb.dim(0) - 1) + lb.dim(1), last.data.begin());
  EXPECT_LE(max_abs_diff(last.data, want[1][0].data), 1e-4);
}

TEST(Batch, MalformedBatchesAreRefusedAndLeaveTheSequencesUnchanged) {
  const auto model = Model::open(fixture("model"));
  const auto other = Model::open(fixture("model"));
  ThreadPool pool(1);
  const std::vector<int32_t> ids = load_ids(fixture("text/input_ids.npy"));
  Sequence a(model, 256), b(other, 256), c(model, 16);
  const BatchEntry twice[] = {{&a, ids, nullptr, false}, {&a, ids, nullptr, false}};
  EXPECT_NE(error_of([&] { Sequence::forward_batch(pool, twice); }).find("appears twice"),
            std::string::npos);
  const BatchEntry models[] = {{&a, ids, nullptr, false}, {&b, ids, nullptr, false}};
  EXPECT_NE(error_of([&] { Sequence::forward_batch(pool, models); }).find("share one model"),
            std::string::npos);
  // One sequence over its context: nothing of the call stays in either cache.
  const std::vector<int32_t> longp = load_ids(fixture("long/input_ids.npy"));
  const BatchEntry full[] = {{&a, ids, nullptr, false}, {&c, longp, nullptr, false}};
  EXPECT_NE(error_of([&] { Sequence::forward_batch(pool, full); }).find("context limit"),
            std::string::npos);
  EXPECT_EQ(a.n_past(), 0);
  EXPECT_EQ(c.n_past(), 0);
}
