// gemstage parity: reference loading, gates, the report against the fixtures, the raw-PLE
// diagnostic, a damaged checkpoint, a staged bundle, the SVG plot, and scripts/hf_dump.py's
// declared output layout.
#include "parity/parity.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "core/error.h"
#include "gemma4/config.h"
#include "parity/gate.h"
#include "parity/plot.h"
#include "parity/reference.h"
#include "test_util.h"
#include "trace/taps.h"

namespace gemstage {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::fixture;
using testing::temp_dir;

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int run_cli(const std::string& args, const std::string& log) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

bool have_tool(const std::string& name) {
  return std::system(("command -v " + name + " > /dev/null 2>&1").c_str()) == 0;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// gates

TEST(ParityGate, ParsesMetricOperatorNumber) {
  Gate g = parse_gate("logits.max_abs<1e-4");
  EXPECT_EQ(g.metric, "logits.max_abs");
  EXPECT_EQ(g.op, "<");
  EXPECT_DOUBLE_EQ(g.value, 1e-4);
  g = parse_gate(" per_layer_inputs.image.cos_min >= 0.999 ");
  EXPECT_EQ(g.metric, "per_layer_inputs.image.cos_min");
  EXPECT_EQ(g.op, ">=");
  EXPECT_DOUBLE_EQ(g.value, 0.999);
  EXPECT_EQ(parse_gate("teacher_forced==1").op, "==");
  EXPECT_EQ(parse_gate("a<=2").op, "<=");
  EXPECT_EQ(parse_gate("a>2").op, ">");
}

TEST(ParityGate, MalformedExpressionsSayWhy) {
  EXPECT_NE(error_of([] { parse_gate("<1e-4"); }).find("no metric name"), std::string::npos);
  EXPECT_NE(error_of([] { parse_gate("logits.max_abs"); }).find("no comparison operator"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_gate("logits.max_abs<"); }).find("no threshold"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_gate("logits.max_abs<abc"); }).find("is not a number"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_gate("logits.max_abs<1e-4x"); }).find("is not a number"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_gate("logits..max_abs<1"); }).find("malformed metric"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_gate("logits.max_abs=1"); }).find("OP one of"), std::string::npos);
}

TEST(ParityGate, UnknownMetricListsTheAvailableOnes) {
  json r;
  r["taps"]["logits"] = {{"kind", "sequence"}, {"max_abs", 1e-5}, {"max_rel", 1e-5},
                         {"cos", 1.0},         {"cos_min", 1.0},  {"cos_mean", 1.0}};
  r["teacher_forced"] = {{"rate", 0.5}, {"agree", 4}, {"steps", 8}};
  const std::string e = error_of([&] { evaluate_gates({parse_gate("logits.maxabs<1")}, r); });
  EXPECT_NE(e.find("unknown gate metric 'logits.maxabs'"), std::string::npos) << e;
  EXPECT_NE(e.find("logits.max_abs"), std::string::npos) << e;
  EXPECT_NE(e.find("teacher_forced"), std::string::npos) << e;
  const auto res =
      evaluate_gates({parse_gate("logits.max_abs<1e-4"), parse_gate("teacher_forced>=0.95")}, r);
  ASSERT_EQ(res.size(), 2u);
  EXPECT_TRUE(res[0].pass);
  EXPECT_FALSE(res[1].pass);
  EXPECT_DOUBLE_EQ(res[1].actual, 0.5);
}

// ---------------------------------------------------------------------------------------------
// reference dumps

TEST(ParityReference, ReadsFixtureManifestsAndTolerances) {
  const ReferenceDump r = load_reference(fixture("multimodal"));
  EXPECT_TRUE(r.has("hidden_states"));
  EXPECT_TRUE(r.has("per_layer_inputs_rawid"));
  EXPECT_EQ(r.num_patches, 504);
  EXPECT_FALSE(r.image_file.empty());
  EXPECT_FALSE(r.pixel_values.empty());
  EXPECT_DOUBLE_EQ(*r.tolerance("hidden_states"), 1e-2);
  EXPECT_DOUBLE_EQ(*r.tolerance("hidden_after_mlp"), 1e-2);
  EXPECT_DOUBLE_EQ(*r.tolerance("decode_logits"), 5e-4);
  EXPECT_DOUBLE_EQ(*r.tolerance("vision_patch_embeds"), 5e-5);
  EXPECT_DOUBLE_EQ(*r.tolerance("per_layer_inputs"), 2e-4);
  EXPECT_FALSE(r.tolerance("input_ids").has_value());
  // multimodal_bf16 points at ../multimodal's pixel values in its manifest.
  const ReferenceDump b = load_reference(fixture("multimodal_bf16"));
  EXPECT_TRUE(b.image_file.empty());
  EXPECT_NE(b.pixel_values.find("multimodal/pixel_values.npy"), std::string::npos);
  EXPECT_NE(b.image_position_ids.find("multimodal/image_position_ids.npy"), std::string::npos);
  EXPECT_EQ(parse_atol("atol 5e-4; decode_ids must match"), 5e-4);
  EXPECT_FALSE(parse_atol("see tolerances_atol_computed: 20x").has_value());
}

TEST(ParityReference, BadDumpsAreRefusedByName) {
  const std::string d = temp_dir("parity_badref");
  EXPECT_NE(error_of([&] { load_reference(d); }).find("manifest.json"), std::string::npos);
  std::ofstream(d + "/manifest.json") << "{\"fixture\": 1}";
  EXPECT_NE(error_of([&] { load_reference(d); }).find("\"files\""), std::string::npos);
  fs::copy_file(fixture("text/input_ids.npy"), d + "/input_ids.npy");
  std::ofstream(d + "/manifest.json", std::ios::trunc)
      << R"({"files": {"input_ids.npy": {"shape": [25], "dtype": "int64"}}})";
  const std::string e = error_of([&] { load_reference(d); });
  EXPECT_NE(e.find("input_ids.npy"), std::string::npos) << e;
  EXPECT_NE(e.find("[25]"), std::string::npos) << e;
  std::ofstream(d + "/manifest.json", std::ios::trunc) << R"({"files": {}})";
  fs::remove(d + "/input_ids.npy");
  EXPECT_NE(error_of([&] { load_reference(d); }).find("no input_ids.npy"), std::string::npos);
  fs::remove_all(d);
}

TEST(ParityReference, ReadsTheToleranceLinesHfDumpWrites) {
  const std::string d = temp_dir("parity_hfref");
  fs::copy_file(fixture("text/input_ids.npy"), d + "/input_ids.npy");
  std::ofstream(d + "/manifest.json") << R"J({"files": {"input_ids.npy": {"shape": [24]}},
    "tolerances": {"hidden_states": "atol 0.0123 (0.001 x max|ref| 12.3)",
                   "ids (input_ids, llm_input_ids)": "exact"}})J";
  const ReferenceDump r = load_reference(d);
  EXPECT_DOUBLE_EQ(*r.tolerance("hidden_states"), 0.0123);
  EXPECT_FALSE(r.tolerance("input_ids").has_value());
  fs::remove_all(d);
}

TEST(ParityRows, TokenClassesFollowTheConfig) {
  const ModelConfig c = load_model_config(fixture("model"));
  EXPECT_EQ(classify_token(c, c.image_token_id), RowClass::Image);
  EXPECT_EQ(classify_token(c, c.audio_token_id), RowClass::Audio);
  EXPECT_EQ(classify_token(c, c.boi_token_id), RowClass::Special);
  EXPECT_EQ(classify_token(c, c.eoi_token_id), RowClass::Special);
  EXPECT_EQ(classify_token(c, c.text.bos_token_id), RowClass::Special);
  EXPECT_EQ(classify_token(c, c.text.pad_token_id), RowClass::Special);
  EXPECT_EQ(classify_token(c, 100), RowClass::Text);
}

// ---------------------------------------------------------------------------------------------
// the CLI against the fixtures

struct CliRun {
  int rc = -1;
  std::string log;
  json report;
};

CliRun parity_cli(const std::string& model, const std::string& ref, const std::string& extra,
                  const std::string& tag) {
  const std::string d = temp_dir("parity_" + tag);
  CliRun r;
  const std::string report = d + "/report.json", log = d + "/log.txt";
  r.rc = run_cli(
      "parity -m " + model + " --reference " + ref + " --report " + report + " -t 2 " + extra, log);
  r.log = slurp(log);
  if (fs::exists(report)) r.report = json::parse(slurp(report));
  fs::remove_all(d);
  return r;
}

const char* kTightGates =
    " --gate 'logits.max_abs<5e-4' --gate 'decode_logits.max_abs<5e-4'"
    " --gate 'teacher_forced>=1.0' --gate 'hidden_states.text.cos_min>=0.9999'"
    " --gate 'first_divergence.found==0'";

TEST(ParityCli, DefaultModelPassesTightGatesOnMultimodal) {
  const CliRun r = parity_cli(fixture("model"), fixture("multimodal"),
                              std::string(kTightGates) +
                                  " --gate 'per_layer_inputs.image.cos_min>=0.9999'"
                                  " --gate 'hidden_states.image.cos_min>=0.9999'"
                                  " --gate 'vision_embedder_out.max_abs<5e-5'"
                                  " --gate 'image_gate.delta>0'",
                              "mm");
  ASSERT_EQ(r.rc, 0) << r.log;
  EXPECT_NE(r.log.find("gate PASS  per_layer_inputs.image.cos_min>=0.9999"), std::string::npos);
  EXPECT_NE(r.log.find("no divergence"), std::string::npos) << r.log;
  const json& j = r.report;
  EXPECT_EQ(j["teacher_forced"]["agree"], 8);
  EXPECT_TRUE(j["teacher_forced"]["first_divergent_step"].is_null());
  EXPECT_EQ(j["inputs"]["rows"]["image"], 56);
  // Vision patch taps compare only the real patches.
  EXPECT_EQ(j["taps"]["vision_encoder_out"]["rows"], 504);
  EXPECT_EQ(j["taps"]["vision_encoder_out"]["padding_rows_skipped"], 630 - 504);
  // The image matters: blanking it loses agreement.
  EXPECT_GT(j["image_gate"]["on"]["agree"].get<int>(), j["image_gate"]["off"]["agree"].get<int>());
  EXPECT_FALSE(j["image_gate"]["image_ignored"].get<bool>());
  EXPECT_TRUE(j["pass"].get<bool>());
}

TEST(ParityCli, DefaultModelPassesTightGatesOnText) {
  const CliRun r = parity_cli(fixture("model"), fixture("text"), kTightGates, "text");
  ASSERT_EQ(r.rc, 0) << r.log;
  EXPECT_TRUE(r.report["image_gate"].is_null());
  EXPECT_EQ(r.report["inputs"]["rows"]["image"], 0);
  EXPECT_EQ(r.report["teacher_forced"]["prompt_and_steps"]["steps"], 24 + 8 - 1);
}

TEST(ParityCli, Bf16ReferenceTakesPixelValuesFromItsManifest) {
  const CliRun r = parity_cli(fixture("model_bf16"), fixture("multimodal_bf16"),
                              "--gate 'teacher_forced>=1.0' --gate 'logits.max_abs<5e-4'", "bf16");
  ASSERT_EQ(r.rc, 0) << r.log;
  EXPECT_NE(r.report["inputs"]["image_source"].get<std::string>().find("pixel_values.npy"),
            std::string::npos);
}

TEST(ParityCli, RawPleIdentityFailsTheImageRowGate) {
  const CliRun r = parity_cli(fixture("model"), fixture("multimodal"),
                              "--ple-identity raw --gate 'per_layer_inputs.image.cos_min>=0.9999'"
                              " --gate 'per_layer_inputs.text.cos_min>=0.9999'",
                              "raw");
  EXPECT_EQ(r.rc, 3) << r.log;
  EXPECT_NE(r.log.find("gate FAIL  per_layer_inputs.image.cos_min>=0.9999"), std::string::npos)
      << r.log;
  EXPECT_NE(r.log.find("gate PASS  per_layer_inputs.text.cos_min>=0.9999"), std::string::npos);
  const json& t = r.report["taps"];
  for (const char* tap : {"per_layer_inputs", "ple_token_embeds"}) {
    EXPECT_LT(t[tap]["classes"]["image"]["cos_min"].get<double>(), 0.999) << tap;
    EXPECT_GE(t[tap]["classes"]["text"]["cos_min"].get<double>(), 0.999999) << tap;
    for (const json& l : t[tap]["layers"]) {
      EXPECT_LT(l["classes"]["image"]["cos"].get<double>(), 1.0) << tap << " layer " << l["layer"];
      EXPECT_GE(l["classes"]["text"]["cos_min"].get<double>(), 0.999999) << tap;
    }
  }
  EXPECT_EQ(t["ple_token_embeds"]["classes"]["text"]["max_abs"].get<double>(), 0.0);
  EXPECT_EQ(t["ple_ids"]["mismatches"], 56);
  EXPECT_FALSE(r.report["pass"].get<bool>());
  EXPECT_EQ(r.report["first_divergence"]["stage"], "embeddings");
  EXPECT_EQ(r.report["options"]["ple_identity"], "raw");
}

// Copies the tiny checkpoint and scales one weight of layer `layer` in model.safetensors.
std::string damaged_model(int layer, const std::string& tag) {
  const std::string d = temp_dir(tag);
  for (const auto& e : fs::directory_iterator(fixture("model")))
    fs::copy_file(e.path(), fs::path(d) / e.path().filename());
  const std::string st = d + "/model.safetensors";
  std::fstream f(st, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const json h = json::parse(header);
  const std::string key =
      "model.language_model.layers." + std::to_string(layer) + ".mlp.down_proj.weight";
  EXPECT_TRUE(h.contains(key)) << key;
  EXPECT_EQ(h[key]["dtype"], "F32");
  const uint64_t b = h[key]["data_offsets"][0], e = h[key]["data_offsets"][1];
  std::vector<float> w((e - b) / 4);
  f.seekg(static_cast<std::streamoff>(8 + n + b));
  f.read(reinterpret_cast<char*>(w.data()), static_cast<std::streamsize>(e - b));
  for (float& v : w) v *= 1.5f;
  f.seekp(static_cast<std::streamoff>(8 + n + b));
  f.write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(e - b));
  return d;
}

TEST(ParityCli, DamagedLayerIsTheFirstDivergence) {
  for (int k : {3, 1}) {
    const std::string m = damaged_model(k, "damaged_model" + std::to_string(k));
    const CliRun r = parity_cli(m, fixture("text"), "--gate 'first_divergence.found==0'",
                                "damaged" + std::to_string(k));
    EXPECT_EQ(r.rc, 3) << r.log;
    const json& fd = r.report["first_divergence"];
    EXPECT_EQ(fd["stage"], "layer") << fd.dump();
    EXPECT_EQ(fd["layer"], k) << fd.dump();
    EXPECT_EQ(fd["tap"], "hidden_after_mlp") << fd.dump();
    EXPECT_NE(r.log.find("first diverging at layer " + std::to_string(k)), std::string::npos)
        << r.log;
    // The layers before it are untouched.
    for (int l = 0; l < k; ++l)
      EXPECT_LT(r.report["taps"]["hidden_states"]["layers"][l]["max_abs"].get<double>(), 1e-3);
    fs::remove_all(m);
  }
}

TEST(ParityCli, StagedBundleReportIsWellFormedAndPlotRenders) {
  const std::string d = temp_dir("parity_bundle");
  const std::string bundle = d + "/bundle", log = d + "/export.txt";
  // q4_0 when this build's export has it, else bf16 (the report says which was measured).
  std::string weights = "q4_0";
  if (run_cli("export -m " + fixture("model") + " --out " + bundle +
                  " --stages 0:2,2:6 --weights q4_0 --max-context 256",
              log) != 0) {
    weights = "bf16";
    fs::remove_all(bundle);
    ASSERT_EQ(run_cli("export -m " + fixture("model") + " --out " + bundle +
                          " --stages 0:2,2:6 --weights bf16 --max-context 256",
                      log),
              0)
        << slurp(log);
  }
  std::cout << "[ parity ] staged bundle measured with --weights " << weights << "\n";
  const std::string svg = d + "/plot.svg", png = d + "/plot.png";
  const CliRun r = parity_cli(bundle, fixture("multimodal"),
                              "--plot " + svg + " --gate 'teacher_forced>=0'", "bundle_run");
  ASSERT_EQ(r.rc, 0) << r.log;
  const json& j = r.report;
  EXPECT_EQ(j["schema"], "gemstage-parity");
  EXPECT_EQ(j["schema_version"], kParityReportVersion);
  EXPECT_TRUE(j["bundle"].get<bool>());
  ASSERT_EQ(j["stages"].size(), 4u);
  EXPECT_EQ(j["stages"][1]["layers"], json({0, 2}));
  EXPECT_EQ(j["stages"][2]["layers"], json({2, 6}));
  for (const char* k :
       {"model", "reference", "options", "inputs", "taps", "reference_only", "ours_only",
        "teacher_forced", "image_gate", "first_divergence", "gates", "pass"})
    EXPECT_TRUE(j.contains(k)) << k;
  for (const char* tap : {"hidden_states", "per_layer_inputs", "logits", "vision_embedder_out"}) {
    const json& t = j["taps"][tap];
    for (const char* k : {"kind", "shape", "tolerance", "rows", "max_abs", "max_rel", "cos",
                          "cos_min", "cos_mean", "pass"})
      EXPECT_TRUE(t.contains(k)) << tap << "." << k;
  }
  ASSERT_EQ(j["taps"]["hidden_states"]["layers"].size(), 6u);
  EXPECT_TRUE(j["taps"]["hidden_states"]["layers"][5]["classes"].contains("image"));
  // Loose: a q4_0 bundle of random tiny weights is far from the f32 reference.
  EXPECT_GT(j["taps"]["logits"]["cos"].get<double>(), weights == "bf16" ? 0.99 : 0.5);
  for (const char* k : {"steps", "agree", "ties", "rate", "first_divergent_step", "per_step"})
    EXPECT_TRUE(j["teacher_forced"].contains(k)) << k;
  for (const char* k : {"on", "off", "delta", "blank", "image_ignored"})
    EXPECT_TRUE(j["image_gate"].contains(k)) << k;
  EXPECT_TRUE(j["first_divergence"].contains("found"));
  EXPECT_EQ(j["gates"][0]["metric"], "teacher_forced");

  // The plot is well-formed XML and draws.
  ASSERT_TRUE(fs::exists(svg));
  const std::string text = slurp(svg);
  EXPECT_EQ(text.rfind("<?xml", 0), 0u);
  EXPECT_NE(text.find("decoder layer"), std::string::npos);
  EXPECT_NE(text.find("per_layer_inputs, image rows"), std::string::npos);
  if (have_tool("xmllint")) {
    EXPECT_EQ(std::system(("xmllint --noout " + svg + " > " + log + " 2>&1").c_str()), 0)
        << slurp(log);
  }
  ASSERT_TRUE(have_tool("rsvg-convert"))
      << "rsvg-convert is needed to render the plot (Debian package librsvg2-bin; "
         "scripts/setup.sh installs it)";
  ASSERT_EQ(std::system(("rsvg-convert -o " + png + " " + svg + " > " + log + " 2>&1").c_str()), 0)
      << slurp(log);
  ASSERT_TRUE(fs::exists(png));
  EXPECT_GT(fs::file_size(png), 1000u);
  EXPECT_EQ(slurp(png).substr(1, 3), "PNG");
  fs::remove_all(d);
}

TEST(ParityCli, UsageErrors) {
  const std::string d = temp_dir("parity_usage"), log = d + "/log.txt";
  const std::string base = "parity -m " + fixture("model") + " --reference " + fixture("text");
  EXPECT_NE(run_cli(base + " --gate 'logits.max_abs'", log), 0);
  EXPECT_NE(slurp(log).find("no comparison operator"), std::string::npos) << slurp(log);
  EXPECT_NE(run_cli(base + " --gate 'logits.maxabs<1' -t 2", log), 0);
  std::string s = slurp(log);
  EXPECT_NE(s.find("unknown gate metric 'logits.maxabs'"), std::string::npos) << s;
  EXPECT_NE(s.find("per_layer_inputs.text.cos_min"), std::string::npos) << s;
  EXPECT_NE(run_cli("parity -m " + fixture("model") + " --reference " + d, log), 0);
  EXPECT_NE(slurp(log).find("manifest.json"), std::string::npos) << slurp(log);
  // A multimodal reference needs an image.
  const std::string ref = d + "/mm";
  fs::create_directories(ref);
  for (const char* f : {"manifest.json", "input_ids.npy", "logits.npy"})
    fs::copy_file(fixture(std::string("multimodal/") + f), ref + "/" + f);
  EXPECT_NE(run_cli("parity -m " + fixture("model") + " --reference " + ref + " -t 2", log), 0);
  EXPECT_NE(slurp(log).find("give --image FILE"), std::string::npos) << slurp(log);
  // ... which --image supplies.
  EXPECT_EQ(run_cli("parity -m " + fixture("model") + " --reference " + ref + " -t 2 --image " +
                        fixture("multimodal/image.png") + " --gate 'logits.max_abs<5e-4'",
                    log),
            0)
      << slurp(log);
  fs::remove_all(d);
}

// ---------------------------------------------------------------------------------------------
// scripts/hf_dump.py: its declared output layout matches what the fixtures hold and the tool reads

TEST(HfDumpScript, DeclaredLayoutMatchesTheFixtures) {
  if (!have_tool("python3")) GTEST_SKIP() << "python3 not installed";
  const std::string script = std::string(GEMSTAGE_FIXTURES) + "/../../scripts/hf_dump.py";
  const std::string d = temp_dir("parity_hfdump"), out = d + "/layout.json";
  ASSERT_EQ(std::system(("python3 " + script + " --print-layout > " + out + " 2>&1").c_str()), 0)
      << slurp(out);
  const json layout = json::parse(slurp(out));
  ASSERT_TRUE(layout.contains("files"));
  std::set<std::string> known(known_tap_names().begin(), known_tap_names().end());
  const std::map<std::string, int64_t> dims = {
      {"S", 70},   {"L", 6},   {"P", 32},  {"D", 128},  {"V", 2048}, {"N", 8},  {"T", 78},
      {"Np", 630}, {"Hv", 64}, {"Ns", 56}, {"Pd", 768}, {"H", 336},  {"W", 384}};
  const ReferenceDump mm = load_reference(fixture("multimodal"));
  const json& files = mm.manifest["files"];
  int checked = 0;
  for (const json& f : layout["files"]) {
    const std::string name = f["name"];
    SCOPED_TRACE(name);
    ASSERT_GT(name.size(), 4u);
    const std::string tap = name.substr(0, name.size() - 4);
    if (name.substr(name.size() - 4) == ".npy") {
      EXPECT_TRUE(known.count(tap)) << "the script writes a tap gemstage does not know";
    }
    ASSERT_TRUE(files.contains(name)) << "not in the multimodal fixture's manifest";
    // Its symbolic shape, evaluated with the fixture's dims, is the fixture's shape.
    json want = json::array();
    for (const json& s : f["shape"]) {
      if (s.is_number_integer())
        want.push_back(s);
      else
        want.push_back(dims.at(s.get<std::string>()));
    }
    EXPECT_EQ(files[name]["shape"], want);
    if (f.contains("dtype")) {
      EXPECT_EQ(files[name]["dtype"], f["dtype"]);
    }
    ++checked;
  }
  EXPECT_GE(checked, 20);
  // And every tap the parity tool compares in a fixture is one the script writes.
  std::set<std::string> written;
  for (const json& f : layout["files"]) written.insert(f["name"]);
  for (const auto& [name, entry] : files.items())
    if (name.find("_rawid") == std::string::npos) {
      EXPECT_TRUE(written.count(name))
          << name << " is in the fixture but not written by the script";
    }
  fs::remove_all(d);
}

}  // namespace
}  // namespace gemstage
