// The MTP drafter as a bundle stage (export -md): written beside the target's stages, placed with
// the last transformer stage, checked by `check`, and run by `generate -m BUNDLE`. A bundle's f32
// drafter drafts exactly what the drafter checkpoint drafts: the fixture's rounds.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/speculative.h"
#include "stage/bundle.h"
#include "stage/model.h"
#include "stage/weights_file.h"
#include "test_util.h"

namespace gemstage {
namespace {

using testing::fixture;
using testing::load_ids;
using testing::temp_dir;
using json = nlohmann::json;

std::string assistant_fixture(const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-assistant/" + rel;
}

std::string export_with_drafter(const std::string& name, const std::string& weights) {
  const std::string out = temp_dir(name);
  ExportOptions o;
  o.stages = std::string("2");  // not = "2": GCC 12 reports a false -Wrestrict there
  o.weights = weights;
  o.progress = false;
  o.force = true;
  o.drafter = assistant_fixture("assistant_e");
  export_bundle(fixture("model"), out, o);
  return out;
}

std::vector<SpeculativeRound> greedy_rounds(const std::shared_ptr<const Model>& model,
                                            const AssistantModel& drafter,
                                            const std::vector<int32_t>& prompt,
                                            std::vector<int32_t>* ids) {
  ThreadPool pool(2);
  Sequence seq(model, 64);
  SpeculativeOptions opt;
  opt.draft_max = 4;  // the fixtures' constant K
  opt.adaptive = false;
  std::vector<SpeculativeRound> rounds;
  *ids = speculative_generate(pool, seq, drafter, prompt, 16, nullptr, opt, nullptr, &rounds);
  return rounds;
}

TEST(BundleDrafter, DraftsWhatTheCheckpointDrafts) {
  const std::string dir = export_with_drafter("bundle_drafter_f32", "f32");
  const BundleManifest m = read_bundle_manifest(dir);
  ASSERT_TRUE(m.drafter);
  EXPECT_EQ(m.drafter->placed_with, m.stages[m.stages.size() - 2].decl.id);
  const auto from_bundle = open_bundle_drafter(dir, m);
  ASSERT_TRUE(from_bundle);
  const auto from_checkpoint = AssistantModel::open(assistant_fixture("assistant_e"));
  const std::string set = assistant_fixture("e_text/");
  const std::vector<int32_t> prompt = load_ids(set + "input_ids.npy");
  std::vector<int32_t> bundle_ids, checkpoint_ids;
  const auto b = greedy_rounds(Model::open(dir), *from_bundle, prompt, &bundle_ids);
  const auto c =
      greedy_rounds(Model::open(fixture("model")), *from_checkpoint, prompt, &checkpoint_ids);
  EXPECT_EQ(bundle_ids, checkpoint_ids);
  EXPECT_EQ(bundle_ids, load_ids(set + "greedy_ids.npy"));
  ASSERT_EQ(b.size(), c.size());
  const std::vector<int32_t> accepted = load_ids(set + "spec_round_accepted.npy");
  const std::vector<int32_t> drafts = load_ids(set + "spec_round_drafts.npy");
  size_t fixture_round = 0;
  for (size_t r = 0; r < b.size(); ++r) {
    EXPECT_EQ(b[r].drafts, c[r].drafts) << "round " << r;
    EXPECT_EQ(b[r].accepted, c[r].accepted) << "round " << r;
    if (b[r].drafts.empty()) continue;
    ASSERT_LT(fixture_round, accepted.size());
    EXPECT_EQ(b[r].accepted, accepted[fixture_round]) << "round " << r;
    for (size_t i = 0; i < b[r].drafts.size(); ++i)
      EXPECT_EQ(b[r].drafts[i], drafts[fixture_round * 4 + i]) << "round " << r << " draft " << i;
    ++fixture_round;
  }
  EXPECT_EQ(fixture_round, accepted.size());
}

TEST(BundleDrafter, QuantizedDrafterIsCheckedAndKeepsGreedyOutput) {
  const std::string dir = export_with_drafter("bundle_drafter_q8", "q8_0");
  std::ostringstream log;
  EXPECT_EQ(check_bundle(dir, {}, log), 0) << log.str();
  EXPECT_NE(log.str().find("PASS  drafter stage"), std::string::npos) << log.str();
  const BundleManifest m = read_bundle_manifest(dir);
  const auto drafter = open_bundle_drafter(dir, m);
  // Its matrices are q8_0 blocks, its vectors f32.
  WeightsFile f(dir + "/" + m.drafter->weights_file);
  EXPECT_EQ(f.view("pre_projection.weight").dtype, DType::Q8_0);
  EXPECT_EQ(f.view("model.norm.weight").dtype, DType::F32);
  EXPECT_EQ(f.view("masked_embedding.token_ordering").dtype, DType::I64);
  // Whatever a drafter proposes, greedy output is the target's own.
  const std::vector<int32_t> prompt = load_ids(assistant_fixture("e_long/input_ids.npy"));
  const auto model = Model::open(dir);
  std::vector<int32_t> ids;
  const auto rounds = greedy_rounds(model, *drafter, prompt, &ids);
  ThreadPool pool(2);
  Sequence plain(model, 64);
  FloatTensor l = plain.forward(pool, prompt, nullptr, false, nullptr);
  for (size_t i = 0; i < ids.size(); ++i) {
    const float* row = l.row(0);
    const auto t = static_cast<int32_t>(std::max_element(row, row + l.dim(1)) - row);
    ASSERT_EQ(ids[i], t) << "token " << i;
    l = plain.forward(pool, std::span<const int32_t>(&t, 1), nullptr, false, nullptr);
  }
  // Each round accepts exactly its drafts that agree with the target's greedy ids. (Whether any
  // does depends on the tier's rounding: on this random model the q8_0 target's first step is a
  // near-tie that AMX's bf16 tiles resolve unlike VNNI's int8 rows, so no count is asserted.)
  for (size_t r = 0; r < rounds.size(); ++r) {
    const int64_t next = rounds[r].position + 1 - static_cast<int64_t>(prompt.size());
    ASSERT_GE(next, 1) << "round " << r;
    ASSERT_EQ(ids[static_cast<size_t>(next - 1)], rounds[r].input_token) << "round " << r;
    int agree = 0;
    while (agree < static_cast<int>(rounds[r].drafts.size()) &&
           next + agree < static_cast<int64_t>(ids.size()) &&
           rounds[r].drafts[static_cast<size_t>(agree)] == ids[static_cast<size_t>(next + agree)])
      ++agree;
    EXPECT_EQ(rounds[r].accepted, agree) << "round " << r;
  }
}

// -md takes a bundle too: its drafter stage drafts for any target of the drafter's shape (here the
// checkpoint the bundle came from), exactly as the drafter checkpoint does.
TEST(BundleDrafter, DashMdTakesABundlesDrafterStage) {
  const std::string dir = export_with_drafter("bundle_drafter_md", "f32");
  const auto from_bundle = open_drafter(dir);
  const auto from_checkpoint = open_drafter(assistant_fixture("assistant_e"));
  const std::string set = assistant_fixture("e_text/");
  const std::vector<int32_t> prompt = load_ids(set + "input_ids.npy");
  std::vector<int32_t> bundle_ids, checkpoint_ids;
  const auto target = Model::open(fixture("model"));
  const auto b = greedy_rounds(target, *from_bundle, prompt, &bundle_ids);
  const auto c = greedy_rounds(target, *from_checkpoint, prompt, &checkpoint_ids);
  EXPECT_EQ(bundle_ids, load_ids(set + "greedy_ids.npy"));
  EXPECT_EQ(bundle_ids, checkpoint_ids);
  ASSERT_EQ(b.size(), c.size());
  for (size_t r = 0; r < b.size(); ++r) EXPECT_EQ(b[r].drafts, c[r].drafts) << "round " << r;

  ExportOptions o;
  o.progress = false;
  o.force = true;
  const std::string plain = temp_dir("bundle_drafter_md_none");
  export_bundle(fixture("model"), plain, o);
  const std::string err = testing::error_of([&] { (void)open_drafter(plain); });
  EXPECT_NE(err.find("has no drafter stage"), std::string::npos) << err;
  EXPECT_NE(err.find(plain), std::string::npos) << err;
}

// The manifest's drafter must sit with the last transformer stage and read its donor layers.
TEST(BundleDrafter, CheckRefusesAMisplacedDrafterStage) {
  const std::string dir = export_with_drafter("bundle_drafter_misplaced", "f32");
  const std::string path = dir + "/manifest.json";
  std::ifstream in(path);
  const json original = json::parse(in);
  in.close();
  auto check_with = [&](const std::function<void(json&)>& edit) {
    json m = original;
    edit(m);
    std::ofstream(path) << m.dump(2);
    std::ostringstream log;
    EXPECT_GT(check_bundle(dir, {}, log), 0);
    return log.str();
  };
  std::string log = check_with([](json& m) { m["drafter"]["placed_with"] = "layers_0_2"; });
  EXPECT_NE(log.find("FAIL  drafter stage"), std::string::npos) << log;
  EXPECT_NE(log.find("placed with 'layers_0_2'"), std::string::npos) << log;
  EXPECT_NE(log.find("must be placed with it"), std::string::npos) << log;
  log = check_with([](json& m) { m["drafter"]["contract"]["reads_kv"][0]["layer"] = 1; });
  EXPECT_NE(log.find("donor layers"), std::string::npos) << log;
  std::ofstream(path) << original.dump(2);
  std::ostringstream ok;
  EXPECT_EQ(check_bundle(dir, {}, ok), 0) << ok.str();
}

int run(const std::string& cmd, std::string* out) {
  const std::string file = temp_dir("bundle_drafter_cli") + "/out";
  const int rc = std::system((cmd + " > " + file + " 2>&1").c_str());
  std::ifstream f(file);
  *out = std::string((std::istreambuf_iterator<char>(f)), {});
  return rc;
}

TEST(BundleDrafter, GenerateUsesTheBundlesDrafterUnlessToldNot) {
  const std::string dir = export_with_drafter("bundle_drafter_cli_bundle", "q8_0");
  const std::string gen = std::string(GEMSTAGE_CLI) + " generate -m " + dir +
                          " --raw -p 'Once upon a time' -n 8 --temp 0 -t 1 --json";
  std::string with, without;
  ASSERT_EQ(run(gen, &with), 0) << with;
  ASSERT_EQ(run(gen + " --no-bundle-drafter", &without), 0) << without;
  EXPECT_NE(with.find("\"draft_rounds\""), std::string::npos) << with;
  EXPECT_EQ(without.find("\"draft_rounds\""), std::string::npos) << without;
  // The same greedy ids either way.
  auto tokens = [](const std::string& out) {
    const size_t at = out.find("{\"");
    return at == std::string::npos ? json()
                                   : json::parse(out.substr(at, out.find('\n', at) - at))["tokens"];
  };
  EXPECT_EQ(tokens(with), tokens(without));
  EXPECT_EQ(tokens(with).size(), 8u);
}

}  // namespace
}  // namespace gemstage
