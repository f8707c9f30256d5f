// The CLI contract later work relies on: dump's file names, shapes and dtypes equal the fixture
// manifest's; make-random presets load through info and dump.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "io/npy.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;

namespace {

int run(const std::string& args, const std::string& log) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + log + " 2>&1";
  return std::system(cmd.c_str());
}

std::string slurp(const std::string& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string slurp_binary(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Cli, DumpWritesEveryFixtureTapWithManifestNamesShapesAndDtypes) {
  const std::string out = temp_dir("cli_dump");
  ASSERT_EQ(run("dump --model " + fixture("model") + " --ids " + fixture("text/input_ids.npy") +
                    " --decode 8 --taps all --chunk 5 --out " + out,
                out + "/log"),
            0)
      << slurp(out + "/log");
  const auto manifest = nlohmann::json::parse(std::ifstream(fixture("text/manifest.json")));
  int checked = 0;
  for (const auto& [file, meta] : manifest["files"].items()) {
    const std::string ours = out + "/" + file;
    ASSERT_TRUE(std::filesystem::exists(ours)) << "dump did not write " << file;
    const NpyArray a = load_npy(ours);
    EXPECT_EQ(a.shape, meta["shape"].get<Shape>()) << file;
    const std::string dt = meta["dtype"];
    EXPECT_EQ(a.dtype, dt == "int64" ? DType::I64 : DType::F32) << file;
    ++checked;
  }
  EXPECT_GE(checked, 15);
  EXPECT_EQ(load_npy(out + "/decode_ids.npy").to_i64(),
            load_npy(fixture("text/decode_ids.npy")).to_i64());
}

TEST(Cli, BadInputsExitNonZeroWithAMessage) {
  const std::string out = temp_dir("cli_bad");
  EXPECT_NE(run("dump --model /nonexistent --ids x.npy --out " + out, out + "/log1"), 0);
  EXPECT_NE(slurp(out + "/log1").find("config.json"), std::string::npos) << slurp(out + "/log1");
  EXPECT_NE(run("dump --model " + fixture("model") + " --ids " + fixture("text/logits.npy") +
                    " --out " + out,
                out + "/log2"),
            0);
  EXPECT_NE(slurp(out + "/log2").find("1-D array of token ids"), std::string::npos)
      << slurp(out + "/log2");
  EXPECT_NE(run("dump --model " + fixture("model") + " --ids " + fixture("text/input_ids.npy") +
                    " --taps nonsense --out " + out,
                out + "/log3"),
            0);
  EXPECT_NE(slurp(out + "/log3").find("unknown tap 'nonsense'"), std::string::npos)
      << slurp(out + "/log3");
}

// llama.cpp's `-n -1`: no limit of its own, so the context ends the generation; below -1 is
// refused.
TEST(Cli, MaxTokensMinusOneRunsToTheContext) {
  const std::string out = temp_dir("cli_n_minus_one");
  const std::string cmd = std::string(GEMSTAGE_CLI) + " generate -m " + fixture("model") +
                          " -n -1 -c 48 --temp 0 --ignore-eos -p Hi --json > " + out + "/j 2> " +
                          out + "/e";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(out + "/e");
  const auto j = nlohmann::json::parse(slurp(out + "/j"));
  EXPECT_EQ(j["finish_reason"], "context") << j;
  EXPECT_GE(j["prompt_tokens"].get<int>() + j["completion_tokens"].get<int>(), 48) << j;
  EXPECT_NE(run("generate -m " + fixture("model") + " -n -2 -p Hi", out + "/log2"), 0);
  EXPECT_NE(slurp(out + "/log2").find("--max-tokens"), std::string::npos) << slurp(out + "/log2");
}

// The E2B preset at full width (262144 vocab, 1536 hidden, PLE 256) on a shortened stack.
TEST(Cli, MakeRandomE2BLoadsInInfoAndDump) {
  const std::string dir = temp_dir("cli_e2b");
  ASSERT_EQ(run("make-random --preset e2b --layers 3 --seed 7 --out " + dir + "/model --force",
                dir + "/log"),
            0)
      << slurp(dir + "/log");
  ASSERT_EQ(run("info --model " + dir + "/model", dir + "/info"), 0) << slurp(dir + "/info");
  const std::string info = slurp(dir + "/info");
  EXPECT_NE(info.find("D=1536"), std::string::npos) << info;
  EXPECT_NE(info.find("vocab=262144"), std::string::npos) << info;
  EXPECT_NE(info.find("shared <- layer 1"), std::string::npos) << info;
  const auto cfg = nlohmann::json::parse(std::ifstream(dir + "/model/config.json"));
  EXPECT_EQ(cfg["text_config"]["hidden_size_per_layer_input"], 256);
  save_npy_i64(dir + "/ids.npy", {5}, {2, 105, 2364, 107, 9259});
  ASSERT_EQ(run("dump --model " + dir + "/model --ids " + dir +
                    "/ids.npy --decode 2 --taps logits,per_layer_inputs --out " + dir + "/out",
                dir + "/dump"),
            0)
      << slurp(dir + "/dump");
  EXPECT_EQ(load_npy(dir + "/out/logits.npy").shape, (Shape{5, 262144}));
  EXPECT_EQ(load_npy(dir + "/out/per_layer_inputs.npy").shape, (Shape{5, 3, 256}));
  std::filesystem::remove_all(dir);
}

TEST(Cli, MakeRandomShardsLoadLikeOneFile) {
  const std::string dir = temp_dir("cli_shards");
  ASSERT_EQ(run("make-random --preset tiny --dtype f32 --out " + dir + "/one", dir + "/l1"), 0)
      << slurp(dir + "/l1");
  ASSERT_EQ(run("make-random --preset tiny --dtype f32 --shard-gb 0.002 --out " + dir + "/many",
                dir + "/l2"),
            0)
      << slurp(dir + "/l2");
  EXPECT_TRUE(std::filesystem::exists(dir + "/many/model.safetensors.index.json"));
  for (const char* m : {"one", "many"})
    ASSERT_EQ(run(std::string("dump --model ") + dir + "/" + m + " --ids " +
                      fixture("text/input_ids.npy") + " --taps logits --out " + dir + "/out_" + m,
                  dir + "/d"),
              0)
        << slurp(dir + "/d");
  EXPECT_EQ(load_npy(dir + "/out_one/logits.npy").to_f32(),
            load_npy(dir + "/out_many/logits.npy").to_f32());
}

}  // namespace

namespace {

TEST(Cli, BenchJsonHasLlamaBenchFields) {
  const std::string dir = temp_dir("cli_bench");
  const std::string cmd = std::string(GEMSTAGE_CLI) + " bench -m " + fixture("model") +
                          " -p 8 -n 4 -d 0,16 -r 2 --json > " + dir + "/out.json 2> " + dir +
                          "/log";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(dir + "/log");
  const auto j = nlohmann::json::parse(std::ifstream(dir + "/out.json"));
  ASSERT_EQ(j.size(), 4u);  // pp8, tg4 at depths 0 and 16
  for (const auto& e : j) {
    for (const char* k : {"n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts",
                          "read_bandwidth_gbs", "decode_bound_ts"})
      EXPECT_TRUE(e.contains(k)) << k;
    EXPECT_GT(e["avg_ts"].get<double>(), 0.0);
    EXPECT_EQ(e["samples_ts"].size(), 2u);
    // What was resident at the end (Linux /proc) can only be part of the peak. A build with only
    // core/platform.h's portable fallbacks (the asan preset) knows the peak alone: -1 says so.
    const double file = e["final_rss_file_gb"], anon = e["final_rss_anon_gb"];
#if GEMSTAGE_PORTABLE_ONLY
    EXPECT_EQ(file, -1.0);
    EXPECT_EQ(anon, -1.0);
#else
    EXPECT_GT(file, 0.0);  // the mapped fixture weights
    EXPECT_GT(anon, 0.0);
    EXPECT_LE(file + anon, e["peak_rss_gb"].get<double>() + 1e-3);
#endif
  }
  EXPECT_EQ(j[3]["n_depth"], 16);
  EXPECT_EQ(j[3]["n_gen"], 4);
}

// bench -md: the drafter row, and --draft-agree rows whose drafts are replaced by the target's
// own greedy tokens with a given probability. Agreeing always must accept every draft (which
// only holds if each replacement lands on the output token it proposes); never, none. bench
// itself fails if a speculative decode's output differs from the plain one.
TEST(Cli, BenchDrafterSpeedCurveAgainstAcceptance) {
  const std::string dir = temp_dir("cli_bench_draft");
  const std::string fx = std::string(GEMSTAGE_FIXTURES);
  const std::string cmd = std::string(GEMSTAGE_CLI) + " bench -m " + fx +
                          "/gemma4-tiny-dense/model -md " + fx +
                          "/gemma4-tiny-assistant/assistant_dense -p 0 -n 12 -r 2 --draft-max 3 "
                          "--draft-agree 0,1 > " +
                          dir + "/out 2> " + dir + "/log";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(dir + "/log");
  const std::string out = slurp(dir + "/out");
  EXPECT_NE(out.find("| tg12 | 3 | drafter |"), std::string::npos) << out;
  EXPECT_NE(out.find("| tg12 | 3 | 1.00 |"), std::string::npos) << out;
  EXPECT_NE(out.find("| tg12 | 3 | 0.00 |"), std::string::npos) << out;
  // Columns: drafter, test, k max, drafts agree, plain t/s, drafter t/s, ratio, acceptance, then
  // where a round's time went: plain step ms, draft step ms, verify ms (mean rows).
  auto columns = [](const std::string& line) {
    std::vector<std::string> cols;
    std::stringstream ss(line);
    std::string c;
    std::getline(ss, c, '|');  // before the first bar
    while (std::getline(ss, c, '|')) cols.push_back(c.substr(1, c.size() - 2));
    return cols;
  };
  std::stringstream lines(out);
  int rows = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("| tg12 | 3 |") == std::string::npos) continue;
    const auto cols = columns(line);
    ASSERT_EQ(cols.size(), 11u) << line;
    ++rows;
    if (cols[3] == "1.00") {
      EXPECT_EQ(cols[7].substr(0, 5), "1.000") << line;  // every draft accepted
      // Every round drafted and verified: a draft step and a verify call of 2-4 rows timed.
      EXPECT_GT(std::stod(cols[9]), 0.0) << line;
      const size_t open = cols[10].find('(');
      ASSERT_NE(open, std::string::npos) << line;
      EXPECT_GT(std::stod(cols[10].substr(0, open)), 0.0) << line;
      const double rows_per_call = std::stod(cols[10].substr(open + 1));
      EXPECT_GE(rows_per_call, 2.0) << line;
      EXPECT_LE(rows_per_call, 4.0) << line;
    }
    if (cols[3] == "0.00") {
      EXPECT_EQ(cols[7].substr(0, 5), "0.000") << line;
    }
    EXPECT_GT(std::stod(cols[8]), 0.0) << line;  // plain step ms
  }
  EXPECT_EQ(rows, 3) << out;
}

// The compute probe: each row's multiply-adds against the int8 peak of the instruction its GEMM
// runs, probed on this machine with every thread busy; a q8_0 bundle so the GEMMs are the int8
// kernels the peak is for.
TEST(Cli, BenchReportsTheInt8Peak) {
  const std::string dir = temp_dir("cli_bench_peak");
  ASSERT_EQ(
      run("export -m " + fixture("model") + " --out " + dir + "/b --weights q8_0 --max-context 64",
          dir + "/l1"),
      0)
      << slurp(dir + "/l1");
  const std::string cmd = std::string(GEMSTAGE_CLI) + " bench -m " + dir +
                          "/b -p 16 -n 4 --parallel 1,2 -r 1 --json > " + dir + "/out.json 2> " +
                          dir + "/log";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(dir + "/log");
  const auto j = nlohmann::json::parse(std::ifstream(dir + "/out.json"));
  ASSERT_EQ(j.size(), 4u);
  for (const auto& e : j) {
    ASSERT_TRUE(e.contains("int8_peak_gmacs")) << e;
    ASSERT_TRUE(e.contains("int8_peak_fraction")) << e;
    const double peak = e["int8_peak_gmacs"], fraction = e["int8_peak_fraction"];
    EXPECT_GT(peak, 0.0) << e;  // NaN fails too
    EXPECT_GT(fraction, 0.0) << e;
    EXPECT_LE(fraction, 1.5) << e;
    EXPECT_GT(e["macs_per_token"].get<double>(), 0.0) << e;
  }
  // The table prints the same columns.
  const std::string table = std::string(GEMSTAGE_CLI) + " bench -m " + dir +
                            "/b -p 8 -n 0 -r 1 > " + dir + "/table 2> " + dir + "/log";
  ASSERT_EQ(std::system(table.c_str()), 0) << slurp(dir + "/log");
  const std::string out = slurp(dir + "/table");
  EXPECT_NE(out.find("% int8 peak"), std::string::npos) << out;
  EXPECT_NE(out.find("G MAC/s ("), std::string::npos) << out;
}

TEST(Cli, BenchDecodesSeveralSequencesTogether) {
  const std::string dir = temp_dir("cli_bench_sequences");
  // llama-batched-bench's convention: --parallel (the older --sequences spelling still works).
  const std::string cmd = std::string(GEMSTAGE_CLI) + " bench -m " + fixture("model") +
                          " -p 16 -n 4 -d 8 --parallel 1,3 -r 1 --json > " + dir + "/out.json 2> " +
                          dir + "/log";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(dir + "/log");
  const auto j = nlohmann::json::parse(std::ifstream(dir + "/out.json"));
  ASSERT_EQ(j.size(), 4u);  // pp16, pp16 x3, tg4, tg4 x3
  EXPECT_EQ(j[0]["n_prompt"], 16);
  EXPECT_EQ(j[0]["n_parallel"], 1);
  EXPECT_EQ(j[1]["n_prompt"], 16);
  EXPECT_EQ(j[1]["n_parallel"], 3);
  EXPECT_EQ(j[2]["n_gen"], 4);
  EXPECT_EQ(j[2]["n_parallel"], 1);
  EXPECT_EQ(j[3]["n_gen"], 4);
  EXPECT_EQ(j[3]["n_parallel"], 3);
  EXPECT_EQ(j[3]["n_sequences"], 3);
  for (const auto& e : j) EXPECT_GT(e["avg_ts"].get<double>(), 0.0);
  const std::string old_spelling = std::string(GEMSTAGE_CLI) + " bench -m " + fixture("model") +
                                   " -p 0 -n 2 --sequences 2 -r 1 --json > " + dir +
                                   "/old.json 2> " + dir + "/log";
  ASSERT_EQ(std::system(old_spelling.c_str()), 0) << slurp(dir + "/log");
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir + "/old.json"))[0]["n_parallel"], 2);
  const std::string refused = std::string(GEMSTAGE_CLI) + " bench -m " + fixture("model") +
                              " -p 0 -n 4 --parallel 0 > " + dir + "/bad 2>&1";
  EXPECT_NE(std::system(refused.c_str()), 0);
  EXPECT_NE(slurp(dir + "/bad").find("--parallel"), std::string::npos) << slurp(dir + "/bad");
}

// --profile splits each test's timed wall time by kind of work: the kinds a model has are
// timed, the kinds it lacks stay zero, and together they fit in the test's time.
TEST(Cli, BenchProfileSplitsTheTimeByKindOfWork) {
  const std::string dir = temp_dir("cli_bench_profile");
  const std::string moe = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-moe/model";
  auto profiles = [&](const std::string& model, const std::string& name) {
    const std::string cmd = std::string(GEMSTAGE_CLI) + " bench -m " + model +
                            " -p 16 -n 4 --parallel 1,2 -r 2 --profile --json > " + dir + "/" +
                            name + ".json 2> " + dir + "/log";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << slurp(dir + "/log");
    return nlohmann::json::parse(std::ifstream(dir + "/" + name + ".json"));
  };
  for (const auto& [model, has_ple] : {std::pair{fixture("model"), true}, std::pair{moe, false}}) {
    const auto j = profiles(model, has_ple ? "e" : "moe");
    ASSERT_EQ(j.size(), 4u) << model;
    for (const auto& e : j) {
      ASSERT_TRUE(e.contains("profile_seconds")) << e;
      const auto& p = e["profile_seconds"];
      double sum = 0;
      for (const char* k : {"embeddings", "attention projections", "attention", "MLP projections",
                            "experts", "per-layer input", "head"}) {
        ASSERT_TRUE(p.contains(k)) << k;
        EXPECT_GE(p[k].get<double>(), 0.0) << k;
        sum += p[k].get<double>();
      }
      for (const char* k :
           {"embeddings", "attention projections", "attention", "MLP projections", "head"})
        EXPECT_GT(p[k].get<double>(), 0.0) << model << " " << k << " " << p;
      EXPECT_EQ(p["experts"].get<double>() > 0, !has_ple) << model << " " << p;
      EXPECT_EQ(p["per-layer input"].get<double>() > 0, has_ple) << model << " " << p;
      EXPECT_LE(sum, p["timed_seconds"].get<double>() * 1.0001) << p;
    }
  }
  // Without --profile the timers stay off.
  const std::string plain = std::string(GEMSTAGE_CLI) + " bench -m " + fixture("model") +
                            " -p 8 -n 2 -r 1 --json > " + dir + "/plain.json 2> " + dir + "/log";
  ASSERT_EQ(std::system(plain.c_str()), 0) << slurp(dir + "/log");
  for (const auto& e : nlohmann::json::parse(std::ifstream(dir + "/plain.json")))
    EXPECT_FALSE(e.contains("profile_seconds"));
}

}  // namespace

namespace {

// The tiny MoE checkpoint rewritten with a 48-wide expert MLP and an 80-wide dense MLP, widths
// the 32-wide quantization blocks do not divide (as a pruned or fine-tuned checkpoint may have).
// The widened matrices repeat the original's columns and rows (halved where repeated), so the
// model stays a plausible one; only their shapes matter to the export.
std::string write_odd_width_checkpoint(const std::string& dir) {
  const std::string src = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-moe/model";
  std::filesystem::create_directories(dir);
  auto cfg = nlohmann::json::parse(std::ifstream(src + "/config.json"));
  const int64_t old_i = cfg["text_config"]["intermediate_size"], new_i = 80;
  const int64_t old_e = cfg["text_config"]["moe_intermediate_size"], new_e = 48;
  cfg["text_config"]["intermediate_size"] = new_i;
  cfg["text_config"]["moe_intermediate_size"] = new_e;
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  std::filesystem::copy_file(src + "/preprocessor_config.json", dir + "/preprocessor_config.json",
                             std::filesystem::copy_options::overwrite_existing);
  const std::string bytes = slurp_binary(src + "/model.safetensors");
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  const auto header = nlohmann::json::parse(bytes.substr(8, hlen));
  const char* data = bytes.data() + 8 + hlen;
  nlohmann::json out_header = nlohmann::json::object();
  std::string out_data;
  for (const auto& [key, meta] : header.items()) {
    if (key == "__metadata__") continue;
    std::vector<int64_t> shape = meta["shape"].get<std::vector<int64_t>>();
    const auto offsets = meta["data_offsets"].get<std::vector<uint64_t>>();
    const float* w = reinterpret_cast<const float*>(data + offsets[0]);
    const bool lm = key.find("language_model.layers.") != std::string::npos;
    // (old, new) of the row dimension (for gate_up: each half) and of the column dimension.
    int64_t ro = 0, rn = 0, co = 0, cn = 0, halves = 1;
    if (lm && key.ends_with("mlp.down_proj.weight")) co = old_i, cn = new_i;
    if (lm && (key.ends_with("mlp.gate_proj.weight") || key.ends_with("mlp.up_proj.weight")))
      ro = old_i, rn = new_i;
    if (lm && key.ends_with("experts.down_proj")) co = old_e, cn = new_e;
    if (lm && key.ends_with("experts.gate_up_proj")) ro = old_e, rn = new_e, halves = 2;
    std::string t;
    if (ro == 0 && co == 0) {
      t.assign(data + offsets[0], offsets[1] - offsets[0]);
    } else {
      const int64_t batch = shape.size() == 3 ? shape[0] : 1;
      const int64_t rows = shape[shape.size() - 2], cols = shape.back();
      const int64_t out_rows = ro ? rn * halves : rows, out_cols = co ? cn : cols;
      std::vector<float> v(static_cast<size_t>(batch * out_rows * out_cols));
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t r = 0; r < out_rows; ++r)
          for (int64_t c = 0; c < out_cols; ++c) {
            const int64_t sr = ro ? (r / rn) * ro + (r % rn) % ro : r;
            const int64_t sc = co ? c % co : c;
            const float scale = (ro && r % rn >= ro) || (co && c >= co) ? 0.5f : 1.0f;
            v[static_cast<size_t>((b * out_rows + r) * out_cols + c)] =
                scale * w[(b * rows + sr) * cols + sc];
          }
      shape[shape.size() - 2] = out_rows;
      shape.back() = out_cols;
      t.assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    }
    out_header[key] = {{"dtype", meta["dtype"]},
                       {"shape", shape},
                       {"data_offsets", {out_data.size(), out_data.size() + t.size()}}};
    out_data += t;
  }
  const std::string h = out_header.dump();
  const uint64_t n = h.size();
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << h << out_data;
  return dir;
}

// A q8_0 / q4_0 export keeps the tensors whose input width is not a multiple of 32 in bf16 (per
// tensor, as llama-quantize falls back) instead of refusing the model; export and info name them,
// and the bundle runs, its logits close to the f32 checkpoint's.
TEST(Cli, QuantizedExportKeepsOddWidthTensorsInBf16) {
  const std::string dir = temp_dir("cli_odd_width");
  const std::string ckpt = write_odd_width_checkpoint(dir + "/ckpt");
  ASSERT_EQ(run("dump --model " + ckpt + " --ids " + fixture("text/input_ids.npy") +
                    " --taps logits --out " + dir + "/ref",
                dir + "/l0"),
            0)
      << slurp(dir + "/l0");
  const std::vector<float> ref = load_npy(dir + "/ref/logits.npy").to_f32();
  for (const char* w : {"q8_0", "q4_0"}) {
    const std::string b = dir + "/" + w;
    ASSERT_EQ(run("export -m " + ckpt + " --out " + b + " --weights " + w, dir + "/l1"), 0)
        << slurp(dir + "/l1");
    const std::string export_log = slurp(dir + "/l1");
    EXPECT_NE(export_log.find("kept in bf16"), std::string::npos) << export_log;
    const auto manifest = nlohmann::json::parse(std::ifstream(b + "/manifest.json"));
    ASSERT_TRUE(manifest.contains("kept_bf16")) << manifest.dump();
    std::set<std::string> kept;
    for (const auto& k : manifest["kept_bf16"]) kept.insert(k.get<std::string>());
    const int layers = manifest["model_config"]["text_config"]["num_hidden_layers"];
    EXPECT_EQ(kept.size(), 2u * static_cast<size_t>(layers)) << manifest["kept_bf16"];
    EXPECT_TRUE(kept.count("model.language_model.layers.0.mlp.down_proj.weight"));
    EXPECT_TRUE(kept.count("model.language_model.layers.0.experts.down_proj"));
    EXPECT_FALSE(kept.count("model.language_model.layers.0.mlp.gate_proj.weight"));
    ASSERT_EQ(run("info -m " + b, dir + "/l2"), 0) << slurp(dir + "/l2");
    const std::string info = slurp(dir + "/l2");
    EXPECT_NE(info.find("kept in bf16"), std::string::npos) << info;
    EXPECT_NE(info.find("layers.0.experts.down_proj"), std::string::npos) << info;
    ASSERT_EQ(run("check " + b, dir + "/l3"), 0) << slurp(dir + "/l3");
    ASSERT_EQ(run("dump --model " + b + " --ids " + fixture("text/input_ids.npy") +
                      " --taps logits --out " + dir + "/out_" + w,
                  dir + "/l4"),
              0)
        << slurp(dir + "/l4");
    const std::vector<float> got = load_npy(dir + "/out_" + w + "/logits.npy").to_f32();
    // The weight quantization's own error on this model, as a mean over every logit: its
    // random MoE router turns small weight changes into other experts on some later rows, so
    // the largest single difference is noise (a plain bf16 export of it already reaches 0.45
    // against logits of magnitude 1.06). Measured mean errors: bf16 0.022, q8_0 0.058, q4_0
    // 0.174 (the reference's mean magnitude is 0.183). A NaN fails the comparison.
    ASSERT_EQ(got.size(), ref.size());
    double err = 0;
    for (size_t i = 0; i < got.size(); ++i) err += std::fabs(double(got[i]) - double(ref[i]));
    err /= static_cast<double>(got.size());
    EXPECT_LT(err, std::string(w) == "q8_0" ? 0.1 : 0.3) << w;
  }
  // Widths of a multiple of 32 keep the whole model quantized: no kept_bf16 entry.
  ASSERT_EQ(
      run("export -m " + fixture("model") + " --out " + dir + "/even --weights q8_0", dir + "/l5"),
      0)
      << slurp(dir + "/l5");
  EXPECT_FALSE(
      nlohmann::json::parse(std::ifstream(dir + "/even/manifest.json")).contains("kept_bf16"));
}

// llama.cpp's -ctk / -ctv spell the cache type: q8_0 runs (logits near the bf16 cache's), two
// different types are refused (gemstage keeps K and V in one type), and info prints the KV bytes
// a token takes in each type.
TEST(Cli, CacheTypeKAndVSelectAQ8Cache) {
  const std::string dir = temp_dir("cli_ctk");
  const std::string ids = fixture("long/input_ids.npy");
  for (const char* t : {"bf16", "q8_0"})
    ASSERT_EQ(run("dump --model " + fixture("model") + " --ids " + ids + " -ctk " + t + " -ctv " +
                      t + " --taps logits --out " + dir + "/" + t,
                  dir + "/log_" + t),
              0)
        << slurp(dir + "/log_" + t);
  const double d = max_abs_diff(load_npy(dir + "/q8_0/logits.npy").to_f32(),
                                load_npy(dir + "/bf16/logits.npy").to_f32());
  EXPECT_GT(d, 0.0);
  EXPECT_LE(d, 0.25);
  ASSERT_EQ(run("dump --model " + fixture("model") + " --ids " + ids +
                    " --cache-type-k q8_0 --taps logits --out " + dir + "/k_only",
                dir + "/log_k"),
            0)
      << slurp(dir + "/log_k");
  EXPECT_EQ(load_npy(dir + "/k_only/logits.npy").to_f32(),
            load_npy(dir + "/q8_0/logits.npy").to_f32());  // either flag alone sets both
  EXPECT_NE(run("dump --model " + fixture("model") + " --ids " + ids +
                    " -ctk q8_0 -ctv bf16 --taps logits --out " + dir + "/mixed",
                dir + "/log_mixed"),
            0);
  EXPECT_NE(slurp(dir + "/log_mixed").find("one cache type"), std::string::npos)
      << slurp(dir + "/log_mixed");
  ASSERT_EQ(run("info -m " + fixture("model"), dir + "/info"), 0) << slurp(dir + "/info");
  const std::string info = slurp(dir + "/info");
  for (const char* t : {"f32", "bf16", "q8_0"})
    EXPECT_NE(info.find(std::string("\n  ") + t + " "), std::string::npos) << t << "\n" << info;
}

TEST(Cli, InfoAndDumpAcceptBundles) {
  const std::string dir = temp_dir("cli_bundle_info");
  ASSERT_EQ(run("export -m " + fixture("model") + " --out " + dir +
                    "/b --stages 0:2,2:6 --weights q8_0 --max-context 64",
                dir + "/l1"),
            0)
      << slurp(dir + "/l1");
  ASSERT_EQ(run("info -m " + dir + "/b", dir + "/info"), 0) << slurp(dir + "/info");
  const std::string info = slurp(dir + "/info");
  EXPECT_NE(info.find("(gemstage bundle)"), std::string::npos) << info;
  EXPECT_NE(info.find("layers_2_6"), std::string::npos) << info;
  EXPECT_NE(info.find("weights q8_0"), std::string::npos) << info;
  ASSERT_EQ(run("dump -m " + dir + "/b --ids " + fixture("text/input_ids.npy") +
                    " --decode 4 --taps decode_ids --out " + dir + "/d",
                dir + "/l2"),
            0)
      << slurp(dir + "/l2");
  EXPECT_EQ(load_npy(dir + "/d/decode_ids.npy").shape, (Shape{4}));
}

}  // namespace
