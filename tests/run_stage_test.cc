// The stage contract at run time, through `gemstage run-stage` as an integrator would use it:
// chaining a bundle's stages by hand reproduces `dump`'s logits (images included), the embeddings
// stage hands on PLE identity and the splice mask as named tensors, every contract violation
// is refused with an error naming the stage, the tensor, what was expected and what was given,
// and a transformer stage's saved KV cache lets one later call (a decode step, a second prefill
// chunk) run alone.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "core/host_tensor.h"
#include "io/npy.h"
#include "stage/bundle.h"
#include "stage/cache_files.h"
#include "stage/model.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;

namespace {

std::string slurp(const std::string& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Result {
  int code;
  std::string log;
};

Result cli(const std::string& args, const std::string& log) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  return {rc, slurp(log)};
}

// An f32 bundle of the tiny model with two transformer stages (6 layers, 2 KV-shared).
const std::string& bundle() {
  static const std::string dir = [] {
    const std::string d = temp_dir("run_stage_bundle");
    ExportOptions o;
    o.stages = "0:2,2:6";
    o.weights = "f32";
    o.progress = false;
    export_bundle(fixture("model"), d, o);
    return d;
  }();
  return dir;
}

// The multimodal fixture's ids as the contract's i32, written to dir/input_ids.npy.
std::string ids_i32(const std::string& dir, const std::string& fixture_file) {
  const std::vector<int32_t> ids = load_ids(fixture(fixture_file));
  const std::string path = dir + "/input_ids.npy";
  save_npy(path, HostTensor({static_cast<int64_t>(ids.size())}, ids));
  return path;
}

// Rows of [S, L, P] per-layer inputs restricted to layers [a, b).
HostTensor slice_layers(const NpyArray& pli, int a, int b) {
  const int64_t S = pli.shape[0], L = pli.shape[1], P = pli.shape[2];
  const std::vector<float> all = pli.to_f32();
  std::vector<float> out;
  for (int64_t r = 0; r < S; ++r)
    out.insert(out.end(), all.begin() + (r * L + a) * P, all.begin() + (r * L + b) * P);
  return HostTensor({S, b - a, P}, std::move(out));
}

std::string positions(const std::string& dir, int64_t S, int64_t first = 0) {
  std::vector<int32_t> p(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) p[static_cast<size_t>(i)] = static_cast<int32_t>(first + i);
  const std::string path = dir + "/positions.npy";
  save_npy(path, HostTensor({S}, p));
  return path;
}

// `run-stage BUNDLE ARGS` must fail, and its output hold every one of `needles` (what names the
// stage, the tensor or the file, and what was expected).
void expect_refused(const std::string& bundle_dir, const std::string& dir, const std::string& args,
                    const std::vector<std::string>& needles) {
  const Result x =
      cli("run-stage " + bundle_dir + " " + args + " --out " + dir + "/x", dir + "/x.log");
  EXPECT_NE(x.code, 0) << args << "\n" << x.log;
  for (const std::string& n : needles)
    EXPECT_NE(x.log.find(n), std::string::npos) << "'" << n << "' not in: " << x.log;
}

// The values of rows [a, b) of an [S, ...] array.
std::vector<float> rows_of(const NpyArray& x, int64_t a, int64_t b) {
  const int64_t row = x.numel() / x.shape[0];
  const std::vector<float> all = x.to_f32();
  return std::vector<float>(all.begin() + a * row, all.begin() + b * row);
}

// The rows `ids` run through the embeddings stage (with embeddings_args, e.g. an image's
// tensors), both transformer stages and the head by `run-stage` into out/<stage id>/, each
// transformer stage starting from past/<stage id> when past is given and saving its cache to
// out/cache/<stage id>; returns the logits file.
std::string chain(const std::string& out, const std::vector<int32_t>& ids, int64_t first,
                  const std::string& past, const std::string& embeddings_args = "") {
  std::filesystem::create_directories(out);
  const int64_t n = static_cast<int64_t>(ids.size());
  save_npy(out + "/ids.npy", HostTensor({n}, ids));
  Result r = cli("run-stage " + bundle() + " embeddings --in input_ids=" + out + "/ids.npy" +
                     embeddings_args + " --out " + out + "/emb",
                 out + "/emb.log");
  EXPECT_EQ(r.code, 0) << r.log;
  const NpyArray pli = load_npy(out + "/emb/per_layer_inputs.npy");
  const std::string p = positions(out, n, first);
  std::string hidden = out + "/emb/hidden_states.npy";
  for (const auto& [id, a, b] : {std::tuple<std::string, int, int>{"layers_0_2", 0, 2},
                                 std::tuple<std::string, int, int>{"layers_2_6", 2, 6}}) {
    const std::string slice = out + "/pli_" + id + ".npy";
    save_npy(slice, slice_layers(pli, a, b));
    r = cli("run-stage " + bundle() + " " + id + " --in hidden_states=" + hidden +
                " --in per_layer_inputs=" + slice + " --in positions=" + p +
                (past.empty() ? "" : " --past " + past + "/" + id) + " --cache-out " + out +
                "/cache/" + id + " --out " + out + "/" + id,
            out + "/" + id + ".log");
    EXPECT_EQ(r.code, 0) << r.log;
    hidden = out + "/" + id + "/hidden_states.npy";
  }
  r = cli(
      "run-stage " + bundle() + " head --in hidden_states=" + hidden + " --out " + out + "/head",
      out + "/head.log");
  EXPECT_EQ(r.code, 0) << r.log;
  return out + "/head/logits.npy";
}

}  // namespace

TEST(RunStage, ChainingTheStagesByHandReproducesDumpLogitsWithAnImage) {
  const std::string dir = temp_dir("run_stage_chain");
  const std::string pix = fixture("multimodal/pixel_values.npy");
  const std::string pos = fixture("multimodal/image_position_ids.npy");

  // What users run end to end.
  Result r = cli("dump --model " + bundle() + " --ids " + fixture("multimodal/input_ids.npy") +
                     " --pixel-values " + pix + " --image-position-ids " + pos +
                     " --taps logits --out " + dir + "/dump",
                 dir + "/dump.log");
  ASSERT_EQ(r.code, 0) << r.log;

  const std::vector<int32_t> raw = load_ids(fixture("multimodal/input_ids.npy"));
  const std::string logits =
      chain(dir, raw, 0, "", " --in pixel_values=" + pix + " --in image_position_ids=" + pos);
  // The contract's named tensors travel: PLE identity is the reference's (PAD at every
  // placeholder row) and the splice mask marks exactly the placeholder rows, while the raw ids
  // still hold the image token.
  const auto cfg = nlohmann::json::parse(std::ifstream(fixture("model/config.json")));
  const int64_t image_token = cfg.at("image_token_id").get<int64_t>();
  const NpyArray ple = load_npy(dir + "/emb/ple_token_ids.npy");
  const NpyArray mask = load_npy(dir + "/emb/image_splice_mask.npy");
  EXPECT_EQ(ple.dtype, DType::I32);
  EXPECT_EQ(mask.dtype, DType::U8);
  EXPECT_EQ(ple.to_i64(), load_npy(fixture("multimodal/ple_ids.npy")).to_i64());
  const std::vector<int64_t> m = mask.to_i64();
  ASSERT_EQ(m.size(), raw.size());
  int images = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    images += raw[i] == image_token;
    EXPECT_EQ(m[i], raw[i] == image_token ? 1 : 0) << "row " << i;
  }
  EXPECT_GT(images, 0);
  // Each transformer stage got the hidden states, its own layers' slice and the positions; the
  // head's logits are dump's.
  const NpyArray chained = load_npy(logits);
  const NpyArray dumped = load_npy(dir + "/dump/logits.npy");
  ASSERT_EQ(chained.shape, dumped.shape);
  EXPECT_LE(max_abs_diff(chained.to_f32(), dumped.to_f32()), 1e-6);
  // And both are the reference's logits.
  EXPECT_LE(max_abs_diff(chained.to_f32(), load_npy(fixture("multimodal/logits.npy")).to_f32()),
            5e-4);
}

// Each refusal names the stage and the tensor, says what was expected and what was given, and
// exits non-zero.
TEST(RunStage, ContractViolationsAreRefusedByName) {
  const std::string dir = temp_dir("run_stage_refuse");
  const std::string ids = ids_i32(dir, "text/input_ids.npy");
  const int64_t S = static_cast<int64_t>(load_ids(fixture("text/input_ids.npy")).size());
  Result r =
      cli("run-stage " + bundle() + " embeddings --in input_ids=" + ids + " --out " + dir + "/emb",
          dir + "/emb.log");
  ASSERT_EQ(r.code, 0) << r.log;
  const std::string h = dir + "/emb/hidden_states.npy";
  const NpyArray pli = load_npy(dir + "/emb/per_layer_inputs.npy");
  const std::string slice = dir + "/pli.npy";
  save_npy(slice, slice_layers(pli, 0, 2));
  const std::string p = positions(dir, S);
  const std::string good = " --in hidden_states=" + h + " --in per_layer_inputs=" + slice;

  auto refused = [&](const std::string& args, const std::vector<std::string>& needles) {
    expect_refused(bundle(), dir, args, needles);
  };
  // Token ids given to a transformer stage: not in its contract.
  refused("layers_0_2" + good + " --in positions=" + p + " --in input_ids=" + ids,
          {"stage 'layers_0_2'", "'input_ids' is not in the stage's contract",
           "hidden_states, per_layer_inputs, positions"});
  // A missing input.
  refused("layers_0_2" + good, {"stage 'layers_0_2'", "'positions' is missing", "i32 [S]"});
  // A wrong dtype: the fixture's ids are int64.
  refused("embeddings --in input_ids=" + fixture("text/input_ids.npy"),
          {"stage 'embeddings'", "'input_ids' must be i32 [S], got i64 (numpy int64)"});
  // A wrong shape: the whole [S, 6, P] per-layer inputs instead of this stage's [S, 2, P] slice.
  refused("layers_0_2 --in hidden_states=" + h + " --in per_layer_inputs=" + dir +
              "/emb/per_layer_inputs.npy --in positions=" + p,
          {"stage 'layers_0_2'", "'per_layer_inputs' must have shape [S, 2, 32]",
           "(dim 1 is 6, expected 2)"});
  // S bound inconsistently: positions for one row fewer than the hidden states.
  const std::string short_p = dir + "/short";
  std::filesystem::create_directories(short_p);
  refused("layers_0_2" + good + " --in positions=" + positions(short_p, S - 1),
          {"stage 'layers_0_2'", "'positions' has shape [" + std::to_string(S - 1) + "]",
           "'S') is " + std::to_string(S - 1), "= " + std::to_string(S)});
  // Positions that do not start the fresh sequence at 0.
  const std::string late = dir + "/late.npy";
  std::vector<int32_t> lp(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) lp[static_cast<size_t>(i)] = static_cast<int32_t>(5 + i);
  save_npy(late, HostTensor({S}, lp));
  refused("layers_0_2" + good + " --in positions=" + late,
          {"stage 'layers_0_2'", "expected position 0 at row 0, got 5"});
  // An unknown stage, a malformed --in and a non-contract dtype.
  refused("layers_0_3 --in positions=" + p, {"no stage 'layers_0_3'", "layers_2_6"});
  refused("head --in hidden_states", {"expected NAME=FILE.npy"});
  const std::string f64 = dir + "/f64.npy";
  const std::vector<double> d(4, 0.0);
  save_npy(f64, DType::F64, {4}, d.data());
  refused("head --in hidden_states=" + f64, {"f64.npy", "not a stage tensor type"});
}

// Bundles written before the embeddings stage stopped taking positions (schema version 1) still
// run, under the current contract of each stage's role.
TEST(RunStage, SchemaVersion1BundlesStillRun) {
  const std::string dir = temp_dir("run_stage_v1");
  std::filesystem::copy(
      bundle(), dir,
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  auto j = nlohmann::json::parse(std::ifstream(dir + "/manifest.json"));
  j["schema_version"] = 1;
  for (auto& s : j["stages"])
    if (s["role"] == "embeddings") {
      auto& in = s["contract"]["inputs"];
      for (size_t i = 0; i < in.size(); ++i)
        if (in[i]["name"] == "image_soft_tokens") in.erase(i--);
      in.push_back({{"name", "positions"},
                    {"shape", {"S"}},
                    {"dtype", "i32"},
                    {"meaning", "absolute position of each row"}});
    }
  std::ofstream(dir + "/manifest.json") << j.dump(2);
  const Result r = cli("dump --model " + dir + " --ids " + fixture("text/input_ids.npy") +
                           " --taps logits --out " + dir + "/dump",
                       dir + "/dump.log");
  ASSERT_EQ(r.code, 0) << r.log;
  EXPECT_LE(max_abs_diff(load_npy(dir + "/dump/logits.npy").to_f32(),
                         load_npy(fixture("text/logits.npy")).to_f32()),
            5e-4);
}

// A decode step and a second prefill chunk of the middle stages, each run alone from the caches
// the calls before it saved, give what `dump` computes in one run (f32: within 1e-6), and the
// cache each leaves equals dump's.
TEST(RunStage, SavedCachesLetADecodeStepAndALaterPrefillChunkRunAlone) {
  const std::string dir = temp_dir("run_stage_past");
  const std::string ids_file = fixture("text/input_ids.npy");
  const std::vector<int32_t> ids = load_ids(ids_file);
  const int64_t S = static_cast<int64_t>(ids.size()), k = 10;
  ASSERT_GT(S, k + 8) << "the second chunk should outrun the sliding window (8)";
  // The whole run, and the caches it leaves after the prompt (--decode 1 forwards nothing more).
  Result r = cli("dump --model " + bundle() + " --ids " + ids_file +
                     " --taps logits,decode_ids,decode_logits --decode 2 --out " + dir + "/dump",
                 dir + "/dump.log");
  ASSERT_EQ(r.code, 0) << r.log;
  r = cli("dump --model " + bundle() + " --ids " + ids_file + " --decode 1 --cache-out " + dir +
              "/prompt_cache --out " + dir + "/dump1",
          dir + "/dump1.log");
  ASSERT_EQ(r.code, 0) << r.log;
  for (const char* id : {"layers_0_2", "layers_2_6"})
    EXPECT_TRUE(std::filesystem::exists(dir + "/prompt_cache/" + id + "/kv_cache.json")) << id;
  const NpyArray logits = load_npy(dir + "/dump/logits.npy");
  const NpyArray decode_logits = load_npy(dir + "/dump/decode_logits.npy");
  const std::vector<int64_t> decoded = load_npy(dir + "/dump/decode_ids.npy").to_i64();
  ASSERT_EQ(decoded.size(), 2u);

  // A decode step: the first decoded token at position S, from the prompt's caches.
  const std::string step =
      chain(dir + "/step", {static_cast<int32_t>(decoded[0])}, S, dir + "/prompt_cache");
  const std::vector<float> step_logits = load_npy(step).to_f32();
  const std::vector<float> want_step = rows_of(decode_logits, 1, 2);
  ASSERT_EQ(step_logits.size(), want_step.size());
  EXPECT_LE(max_abs_diff(step_logits, want_step), 1e-6);

  // The prompt in two chunks: rows 0..k-1 from fresh caches, then rows k..S-1 from theirs.
  chain(dir + "/first", std::vector<int32_t>(ids.begin(), ids.begin() + k), 0, "");
  const std::string second = chain(
      dir + "/second", std::vector<int32_t>(ids.begin() + k, ids.end()), k, dir + "/first/cache");
  EXPECT_LE(max_abs_diff(load_npy(second).to_f32(), rows_of(logits, k, S)), 1e-6);
  // What the second chunk leaves is what the whole prompt left in dump.
  for (const char* id : {"layers_0_2", "layers_2_6"})
    for (const auto& f : std::filesystem::directory_iterator(dir + "/prompt_cache/" + id)) {
      if (f.path().extension() != ".npy") continue;
      const NpyArray chained =
          load_npy(dir + "/second/cache/" + id + "/" + f.path().filename().string());
      const NpyArray whole = load_npy(f.path().string());
      ASSERT_EQ(chained.shape, whole.shape) << f.path();
      EXPECT_LE(max_abs_diff(chained.to_f32(), whole.to_f32()), 1e-6) << f.path();
    }

  // Refusals: another stage's cache, positions that do not continue it, a stage without one.
  const std::string emb = dir + "/step/emb/hidden_states.npy";
  const std::string pli = dir + "/step/pli_layers_0_2.npy";
  const std::string pos = dir + "/step/positions.npy";
  auto refused = [&](const std::string& args, const std::vector<std::string>& needles) {
    expect_refused(bundle(), dir, args, needles);
  };
  const std::string in0 = " --in hidden_states=" + emb + " --in per_layer_inputs=" + pli;
  refused(
      "layers_0_2" + in0 + " --in positions=" + pos + " --past " + dir + "/prompt_cache/layers_2_6",
      {"kv_cache.json", "the cache of stage 'layers_2_6'", "not of stage 'layers_0_2'"});
  refused("layers_0_2" + in0 + " --in positions=" + positions(dir, 1, 3) + " --past " + dir +
              "/prompt_cache/layers_0_2",
          {"stage 'layers_0_2'", "expected position " + std::to_string(S) + " at row 0, got 3"});
  refused("layers_0_2" + in0 + " --in positions=" + pos + " --past " + dir + "/nowhere",
          {"nowhere/kv_cache.json: not found", "dump --cache-out"});
  refused("head --in hidden_states=" + emb + " --past " + dir + "/prompt_cache/layers_0_2",
          {"stage 'head'", "keeps no KV cache"});
  const std::string width = dir + "/prompt_cache/layers_0_2/layer_0.k.npy";
  save_npy(width, HostTensor({S, 3}, std::vector<float>(static_cast<size_t>(S) * 3, 0.0f)));
  refused(
      "layers_0_2" + in0 + " --in positions=" + pos + " --past " + dir + "/prompt_cache/layers_0_2",
      {"layer_0.k.npy: expected float32 [" + std::to_string(S) + ", "});
}

// Saving and loading a cache group gives back the same rows in every row type, sliding rings
// included once they have wrapped (the saved rows then start past position 0).
TEST(RunStage, ACacheGroupSurvivesSaveAndLoadInEveryRowType) {
  const auto model = Model::open(bundle());
  const Stage* stage = model->find_stage("layers_2_6");
  ASSERT_NE(stage, nullptr);
  for (const KvType type : {KvType::F32, KvType::BF16, KvType::Q8_0}) {
    const std::string dir = temp_dir(std::string("run_stage_cache_") + kv_type_name(type));
    const int64_t n = 700, ctx = 1024;  // past a ring of window 8 + 512 slack rows
    auto saved = stage->new_cache(ctx, type);
    uint32_t state = 12345;
    for (int layer = 2; layer < 6; ++layer) {
      LayerKvCache* c = saved->own(layer);
      if (!c) continue;
      std::vector<float> k(static_cast<size_t>(n * c->width())), v(k.size());
      for (float& x : k)
        x = static_cast<float>((state = state * 1664525u + 1013904223u) >> 8) / 1e6f - 8;
      for (float& x : v)
        x = static_cast<float>((state = state * 1664525u + 1013904223u) >> 8) / 3e6f;
      c->append(k.data(), v.data(), n);
    }
    saved->advance(n);
    save_stage_cache(*stage, *saved, dir);
    const auto loaded = load_stage_cache(*stage, dir, ctx);
    EXPECT_EQ(loaded->n_past(), n);
    EXPECT_EQ(loaded->kv_type(), type);
    int rings = 0;
    for (int layer = 2; layer < 6; ++layer) {
      const LayerKvCache* a = saved->own(layer);
      const LayerKvCache* b = loaded->own(layer);
      ASSERT_EQ(a == nullptr, b == nullptr) << layer;
      if (!a) continue;
      rings += a->kind() == CacheKind::Ring;
      EXPECT_EQ(b->first_held(), a->first_held()) << layer;
      if (a->kind() == CacheKind::Ring) {
        EXPECT_GT(a->first_held(), 0) << layer;
      }
      std::vector<float> x(static_cast<size_t>(a->width())), y(x.size());
      for (int64_t pos = a->first_held(); pos < n; ++pos)
        for (const bool is_k : {true, false}) {
          a->widen(is_k, pos, 0, a->width(), x.data());
          b->widen(is_k, pos, 0, b->width(), y.data());
          ASSERT_EQ(x, y) << kv_type_name(type) << " layer " << layer << " position " << pos;
        }
    }
    EXPECT_EQ(rings, 1) << "layers 2..5: one sliding layer keeps a ring, two are KV-shared";
  }
}

// A bundle's drafter runs alone as a stage: one draft step from the saved caches of the stage it
// is placed with gives the reference's draft id and next hidden (fixture gemma4-tiny-assistant
// e_text, an independent reference), a second step chained from the first gives the next, and
// its contract is checked on the call.
TEST(RunStage, TheDrafterRunsADraftStepFromTheSavedCachesOfItsStage) {
  const std::string dir = temp_dir("run_stage_drafter");
  const std::string b = dir + "/bundle";
  const std::string assistant = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-assistant/";
  ExportOptions o;
  o.stages = "0:2,2:6";
  o.weights = "f32";
  o.progress = false;
  o.drafter = assistant + "assistant_e";
  export_bundle(fixture("model"), b, o);
  ASSERT_EQ(read_bundle_manifest(b).drafter->placed_with, "layers_2_6");

  const std::string ref = assistant + "e_text/";
  const std::vector<int64_t> starts = load_npy(ref + "draft_start_positions.npy").to_i64();
  const std::vector<int64_t> tokens = load_npy(ref + "draft_input_tokens.npy").to_i64();
  const NpyArray hidden = load_npy(ref + "draft_target_hidden.npy");   // [starts, H_t]
  const NpyArray hidden_out = load_npy(ref + "draft_hidden_out.npy");  // [starts, K, H_t]
  const std::vector<int64_t> draft_ids = load_npy(ref + "draft_ids.npy").to_i64();  // [starts, K]
  const std::vector<int32_t> ids = load_ids(fixture("text/input_ids.npy"));
  const int64_t H = hidden.shape[1], K = hidden_out.shape[1];
  size_t s = 0;  // the first start inside the prompt (a later one may draft past it)
  while (s < starts.size() && starts[s] >= static_cast<int64_t>(ids.size())) ++s;
  ASSERT_LT(s, starts.size());
  const int64_t P = starts[s];
  ASSERT_EQ(tokens[s], ids[static_cast<size_t>(P)]);

  // The target's caches of positions 0..P-1.
  const std::string prefix = dir + "/prefix.npy";
  save_npy(prefix, HostTensor({P}, std::vector<int32_t>(ids.begin(), ids.begin() + P)));
  Result r = cli("dump --model " + b + " --ids " + prefix + " --decode 1 --cache-out " + dir +
                     "/kv --out " + dir + "/dump",
                 dir + "/dump.log");
  ASSERT_EQ(r.code, 0) << r.log;
  const std::string past = " --past " + dir + "/kv/layers_2_6";
  save_npy(dir + "/position.npy", HostTensor({1}, std::vector<int32_t>{static_cast<int32_t>(P)}));
  save_npy(dir + "/token.npy",
           HostTensor({1}, std::vector<int32_t>{static_cast<int32_t>(tokens[s])}));
  const std::vector<float> h_all = hidden.to_f32();
  save_npy(dir + "/hidden.npy",
           HostTensor({H}, std::vector<float>(h_all.begin() + static_cast<int64_t>(s) * H,
                                              h_all.begin() + static_cast<int64_t>(s + 1) * H)));
  const std::vector<float> out_all = hidden_out.to_f32();
  std::string token = dir + "/token.npy", h = dir + "/hidden.npy";
  for (int64_t step = 0; step < 2; ++step) {
    const std::string out = dir + "/step" + std::to_string(step);
    r = cli("run-stage " + b + " drafter" + past + " --in input_token=" + token +
                " --in target_hidden=" + h + " --in position=" + dir + "/position.npy --out " + out,
            out + ".log");
    ASSERT_EQ(r.code, 0) << r.log;
    EXPECT_EQ(load_npy(out + "/draft_token.npy").to_i64(),
              std::vector<int64_t>{draft_ids[s * static_cast<size_t>(K) + step]})
        << "step " << step;
    const int64_t at = (static_cast<int64_t>(s) * K + step) * H;
    EXPECT_LE(max_abs_diff(load_npy(out + "/next_hidden.npy").to_f32(),
                           std::vector<float>(out_all.begin() + at, out_all.begin() + at + H)),
              1e-3)
        << "step " << step;  // the fixture's tolerance for draft_hidden_out
    token = out + "/draft_token.npy";
    h = out + "/next_hidden.npy";
  }

  auto refused = [&](const std::string& args, const std::vector<std::string>& needles) {
    expect_refused(b, dir, args, needles);
  };
  const std::string in = " --in input_token=" + dir + "/token.npy --in target_hidden=" + dir +
                         "/hidden.npy --in position=" + dir + "/position.npy";
  refused("drafter" + in,
          {"stage 'drafter' (drafter) reads the KV caches of stage 'layers_2_6'", "--past"});
  refused("drafter" + in + " --past " + dir + "/kv/layers_0_2",
          {"the cache of stage 'layers_0_2'", "not of stage 'layers_2_6'"});
  save_npy(dir + "/late.npy", HostTensor({1}, std::vector<int32_t>{static_cast<int32_t>(P + 1)}));
  refused("drafter --in input_token=" + dir + "/token.npy --in target_hidden=" + dir +
              "/hidden.npy --in position=" + dir + "/late.npy" + past,
          {"input 'position' is " + std::to_string(P + 1), "hold " + std::to_string(P)});
  refused("drafter --in input_token=" + dir + "/token.npy --in target_hidden=" + dir +
              "/prefix.npy --in position=" + dir + "/position.npy" + past,
          {"stage 'drafter' (drafter)", "'target_hidden'"});
  refused("drafter" + in + past + " --cache-out " + dir + "/c", {"only reads KV caches"});
  refused("drafters" + in, {"no stage 'drafters'", "drafter (drafter)"});
}
