// Bad checkpoints give a clear error that names the problem, and never read out of bounds.
#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "gemma4/config.h"
#include "io/safetensors.h"
#include "kernels/weight_rows.h"
#include "stage/sequence.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;
namespace fs = std::filesystem;

namespace {

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file from a header string and a data section.
std::string safetensors_bytes(const std::string& header, const std::string& data,
                              uint64_t hlen_override = 0) {
  const uint64_t n = hlen_override ? hlen_override : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

void expect_safetensors_error(const std::string& bytes, const std::string& needle) {
  const std::string dir = temp_dir("st_bad");
  const std::string p = dir + "/model.safetensors";
  write_file(p, bytes);
  const std::string msg = error_of([&] { SafetensorsFile f(p); });
  EXPECT_NE(msg.find(needle), std::string::npos) << "message: " << msg;
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << "must name the file: " << msg;
}

TEST(Safetensors, RejectsTruncatedFile) {
  expect_safetensors_error("abc", "truncated");
}

TEST(Safetensors, RejectsHeaderLengthPastTheEnd) {
  expect_safetensors_error(safetensors_bytes("{}", "", 1 << 20), "runs past the end");
}

TEST(Safetensors, RejectsInvalidJson) {
  expect_safetensors_error(safetensors_bytes("{not json", ""), "not valid JSON");
}

TEST(Safetensors, RejectsUnknownDtype) {
  expect_safetensors_error(
      safetensors_bytes(R"({"w":{"dtype":"F8_E9","shape":[1],"data_offsets":[0,1]}})", "x"),
      "unknown dtype");
}

TEST(Safetensors, RejectsOutOfRangeOffsets) {
  expect_safetensors_error(
      safetensors_bytes(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", "1234"),
      "past the data section");
}

TEST(Safetensors, RejectsShapeSizeMismatch) {
  expect_safetensors_error(
      safetensors_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "12345678"),
      "needs 12 bytes");
}

TEST(Safetensors, RejectsOverlappingTensors) {
  expect_safetensors_error(
      safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        "123456789012"),
      "overlap");
}

TEST(Safetensors, RejectsNonFiniteOrFractionalHeaderNumbers) {
  expect_safetensors_error(
      safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "1234"),
      "non-negative integer");
  expect_safetensors_error(
      safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})", "1234"),
      "w");
  expect_safetensors_error(
      safetensors_bytes(R"({"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}})", "1234"),
      "not valid JSON");
  expect_safetensors_error(
      safetensors_bytes(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "1234"),
      "non-negative integer");
}

TEST(Safetensors, RejectsShapeOverflow) {
  expect_safetensors_error(
      safetensors_bytes(
          R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})",
          "1234"),
      "overflow");
}

TEST(Safetensors, ReadsAValidFile) {
  const std::string dir = temp_dir("st_ok");
  const float vals[2] = {1.5f, -2.0f};
  write_file(
      dir + "/model.safetensors",
      safetensors_bytes(
          R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
          std::string(reinterpret_cast<const char*>(vals), 8)));
  SafetensorsFile f(dir + "/model.safetensors");
  const WeightView w = f.view("w");
  EXPECT_EQ(weight_at(w, 1), -2.0f);
  EXPECT_EQ(f.metadata().at("format"), "pt");
}

// Resident kB of this process's mappings of `path` (Linux /proc/self/smaps; -1 elsewhere).
long resident_kb_of_mapping(const std::string& path) {
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) return -1;
  const std::string want = fs::canonical(path).string();
  long kb = 0;
  bool in_file = false;
  for (std::string line; std::getline(smaps, line);) {
    if (line.find('-') < line.find(' ') && line.find(" r") != std::string::npos &&
        std::isxdigit(static_cast<unsigned char>(line[0]))) {
      in_file = line.size() >= want.size() &&
                line.compare(line.size() - want.size(), want.size(), want) == 0;
    } else if (in_file && line.rfind("Rss:", 0) == 0) {
      kb += std::stol(line.substr(4));
    }
  }
  return kb;
}

// A [2048, 2048] BF16 table (4 KiB rows, 8 MiB) whose element (r, c) is the exact small integer
// (r * 2048 + c) % 251 - 125.
std::string write_bf16_table(const std::string& dir) {
  const int rows = 2048, cols = 2048;
  std::string data(static_cast<size_t>(rows) * cols * 2, '\0');
  for (int i = 0; i < rows * cols; ++i) {
    const float v = static_cast<float>(i % 251 - 125);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint16_t h = static_cast<uint16_t>(u >> 16);
    std::memcpy(data.data() + 2 * static_cast<size_t>(i), &h, 2);
  }
  const std::string p = dir + "/model.safetensors";
  write_file(p, safetensors_bytes(R"({"t":{"dtype":"BF16","shape":[2048,2048],"data_offsets":[0,)" +
                                      std::to_string(data.size()) + "]}}",
                                  data));
  return p;
}

// Token-embedding and PLE lookups read their rows with pread: the rows are right, and they do
// not become resident pages of the mapping (mapped lookups of random rows left most of the
// 2.3 GB E2B PLE table in the process's RSS). The rows read start past the first 2 MiB, which
// opening the file may map whole (reading the header can fault in one huge page).
TEST(Safetensors, GatheredRowsAreReadFromTheFileNotTheMapping) {
  const std::string p = write_bf16_table(temp_dir("st_gather"));
  SafetensorsFile f(p);
  const WeightView w = f.view("t");
  ASSERT_GE(w.file.fd, 0);
  std::vector<uint8_t> raw;
  std::vector<float> row(2048);
  const long before = resident_kb_of_mapping(p);
  for (int r = 600; r < 2048; r += 16) {
    gather_weight_row_to_f32(w, r, row.data(), raw);
    for (int c : {0, 1, 777, 2047})
      ASSERT_EQ(row[static_cast<size_t>(c)], static_cast<float>((r * 2048 + c) % 251 - 125))
          << "row " << r << " col " << c;
  }
  const long after_gather = resident_kb_of_mapping(p);
  if (before < 0) GTEST_SKIP() << "no /proc/self/smaps to measure residency";
  EXPECT_LE(after_gather - before, 4) << "gathered rows were faulted into the mapping";
  // A copy of the view pointed at other memory (a quantized or converted copy) reads that memory.
  std::vector<uint16_t> mine(2048 * 2, 0x3f80);  // bf16 1.0
  WeightView copy = w;
  copy.shape = {2, 2048};
  copy.data = mine.data();
  copy.nbytes = mine.size() * 2;
  gather_weight_row_to_f32(copy, 1, row.data(), raw);
  EXPECT_EQ(row[5], 1.0f);
  // The same rows through the mapping do become resident: the measurement can tell.
  for (int r = 600; r < 2048; r += 16) weight_row_to_f32(w, r, row.data());
  EXPECT_GE(resident_kb_of_mapping(p) - after_gather, 200);
}

// A file cut short after it was opened: the gather names the tensor instead of dying of
// SIGBUS as a read through the mapping would.
TEST(Safetensors, GatherFromAFileTruncatedAfterOpeningIsAClearError) {
  const std::string p = write_bf16_table(temp_dir("st_gather_cut"));
  SafetensorsFile f(p);
  fs::resize_file(p, 4096);
  std::vector<uint8_t> raw;
  std::vector<float> row(2048);
  const std::string msg =
      error_of([&] { gather_weight_row_to_f32(f.view("t"), 1500, row.data(), raw); });
  EXPECT_NE(msg.find("tensor t"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ends before the row"), std::string::npos) << msg;
}

// A sharded copy of the fixture (split by the index) loads and gives identical tensors.
std::string make_sharded_copy(const std::string& name) {
  const std::string src = fixture("model");
  const std::string dir = temp_dir(name);
  for (const char* f :
       {"config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"})
    fs::copy_file(src + "/" + f, dir + "/" + f);
  SafetensorsFile whole(src + "/model.safetensors");
  nlohmann::json h1, h2, index;
  std::string d1, d2;
  int i = 0;
  for (const auto& [key, e] : whole.entries()) {
    const WeightView v = whole.view(key);
    const bool first = (i++ % 2) == 0;
    nlohmann::json& h = first ? h1 : h2;
    std::string& d = first ? d1 : d2;
    h[key] = {{"dtype", std::string(dtype_name(e.dtype))},
              {"shape", e.shape},
              {"data_offsets", {d.size(), d.size() + v.nbytes}}};
    d.append(static_cast<const char*>(v.data), v.nbytes);
    index["weight_map"][key] =
        first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_file(dir + "/model-00001-of-00002.safetensors", safetensors_bytes(h1.dump(), d1));
  write_file(dir + "/model-00002-of-00002.safetensors", safetensors_bytes(h2.dump(), d2));
  write_file(dir + "/model.safetensors.index.json", index.dump());
  return dir;
}

TEST(Checkpoint, ShardedCheckpointLoadsAndMatches) {
  const std::string dir = make_sharded_copy("sharded");
  EXPECT_EQ(TensorStore::open_dir(dir).keys(), TensorStore::open_dir(fixture("model")).keys());
  auto a = Sequence::open(dir, 64);
  auto b = Sequence::open(fixture("model"), 64);
  const std::vector<int32_t> ids = load_ids(fixture("text/input_ids.npy"));
  ThreadPool pool(2);
  const FloatTensor la = a->forward(pool, ids, nullptr, false, nullptr);
  const FloatTensor lb = b->forward(pool, ids, nullptr, false, nullptr);
  EXPECT_EQ(la.data, lb.data);
}

TEST(Checkpoint, MissingShardIsNamed) {
  const std::string dir = make_sharded_copy("missing_shard");
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  const std::string msg = error_of([&] { Model::open(dir); });
  EXPECT_NE(msg.find("model-00002-of-00002.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
}

TEST(Checkpoint, ShardNameCannotEscapeTheDirectory) {
  const std::string dir = make_sharded_copy("escape");
  write_file(dir + "/model.safetensors.index.json", R"({"weight_map":{"a":"../../etc/passwd"}})");
  const std::string msg = error_of([&] { Model::open(dir); });
  EXPECT_NE(msg.find("plain file name"), std::string::npos) << msg;
}

// Re-writes the fixture checkpoint with one tensor changed, then expects `needle` in the error.
void expect_checkpoint_error(const std::function<void(nlohmann::json&, std::string&)>& edit,
                             const std::string& needle, const std::string& name) {
  const std::string src = fixture("model");
  const std::string dir = temp_dir(name);
  fs::copy_file(src + "/config.json", dir + "/config.json");
  SafetensorsFile whole(src + "/model.safetensors");
  nlohmann::json h;
  std::string d;
  for (const auto& [key, e] : whole.entries()) {
    const WeightView v = whole.view(key);
    h[key] = {{"dtype", std::string(dtype_name(e.dtype))},
              {"shape", e.shape},
              {"data_offsets", {d.size(), d.size() + v.nbytes}}};
    d.append(static_cast<const char*>(v.data), v.nbytes);
  }
  edit(h, d);
  write_file(dir + "/model.safetensors", safetensors_bytes(h.dump(), d));
  const std::string msg = error_of([&] { Model::open(dir); });
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
}

TEST(Checkpoint, MissingTensorIsNamed) {
  expect_checkpoint_error(
      [](nlohmann::json& h, std::string&) {
        h.erase("model.language_model.layers.3.mlp.up_proj.weight");
      },
      "missing tensor model.language_model.layers.3.mlp.up_proj.weight", "missing_tensor");
}

TEST(Checkpoint, WrongShapeNamesKeyExpectedAndFound) {
  expect_checkpoint_error(
      [](nlohmann::json& h, std::string&) {
        h["model.language_model.layers.1.self_attn.q_norm.weight"]["shape"] = {16, 2};
      },
      "tensor model.language_model.layers.1.self_attn.q_norm.weight: expected shape [32], found "
      "[16, 2]",
      "wrong_shape");
}

TEST(Checkpoint, KvSharedLayersMayOmitTheirUnusedKv) {
  // HF ignores k_proj/v_proj/k_norm of KV-shared layers (4 and 5 here): absent is fine too.
  const std::string src = fixture("model");
  const std::string dir = temp_dir("no_shared_kv");
  fs::copy_file(src + "/config.json", dir + "/config.json");
  SafetensorsFile whole(src + "/model.safetensors");
  nlohmann::json h;
  std::string d;
  for (const auto& [key, e] : whole.entries()) {
    if (key.find("layers.5.self_attn.k_proj") != std::string::npos ||
        key.find("layers.4.self_attn.v_proj") != std::string::npos)
      continue;
    const WeightView v = whole.view(key);
    h[key] = {{"dtype", std::string(dtype_name(e.dtype))},
              {"shape", e.shape},
              {"data_offsets", {d.size(), d.size() + v.nbytes}}};
    d.append(static_cast<const char*>(v.data), v.nbytes);
  }
  write_file(dir + "/model.safetensors", safetensors_bytes(h.dump(), d));
  EXPECT_NO_THROW(Model::open(dir));
}

std::string fixture_config_with(const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(std::ifstream(fixture("model/config.json")));
  edit(j);
  return j.dump();
}

TEST(Config, WrongModelTypeIsRefused) {
  const std::string msg = error_of([] {
    parse_model_config(fixture_config_with([](nlohmann::json& j) { j["model_type"] = "llama"; }),
                       "config.json");
  });
  EXPECT_NE(msg.find("model_type is 'llama'"), std::string::npos) << msg;
}

TEST(Config, WrongFieldTypeNamesTheField) {
  const std::string msg = error_of([] {
    parse_model_config(
        fixture_config_with([](nlohmann::json& j) { j["text_config"]["hidden_size"] = "big"; }),
        "config.json");
  });
  EXPECT_NE(msg.find("text_config.hidden_size must be an integer"), std::string::npos) << msg;
}

TEST(Config, UnknownFieldsAreReportedByName) {
  const ModelConfig c = parse_model_config(
      fixture_config_with([](nlohmann::json& j) { j["text_config"]["shiny_new_knob"] = 3; }),
      "config.json");
  ASSERT_FALSE(c.warnings.empty());
  EXPECT_NE(c.warnings[0].find("shiny_new_knob"), std::string::npos);
}

TEST(Config, UnsupportedSemanticsAreRefused) {
  const std::string msg = error_of([] {
    parse_model_config(
        fixture_config_with([](nlohmann::json& j) { j["text_config"]["enable_moe_block"] = true; }),
        "config.json");
  });
  EXPECT_NE(msg.find("enable_moe_block"), std::string::npos) << msg;
}

TEST(Config, DerivesLayerSpecsOfTheFixture) {
  const ModelConfig c = load_model_config(fixture("model"));
  const auto& L = c.text.layers;
  ASSERT_EQ(L.size(), 6u);
  EXPECT_EQ(L[2].type, LayerType::Full);
  EXPECT_EQ(L[2].head_dim, 64);
  EXPECT_EQ(L[0].head_dim, 32);
  EXPECT_TRUE(L[4].kv_shared);
  EXPECT_EQ(L[4].kv_donor, 3);
  EXPECT_EQ(L[5].kv_donor, 2);
  EXPECT_EQ(L[4].mlp_width, 512);  // double-wide from the first shared layer
  EXPECT_EQ(L[3].mlp_width, 256);
  EXPECT_TRUE(L[3].is_donor && L[2].is_donor && !L[1].is_donor);
}

TEST(Config, PerLayerConfigLayoutMatchesFlatLayout) {
  // transformers >= 5.15 re-saves global_head_dim as per-layer overrides on full layers.
  const ModelConfig flat = load_model_config(fixture("model"));
  const ModelConfig per = parse_model_config(
      fixture_config_with([](nlohmann::json& j) {
        auto& t = j["text_config"];
        t.erase("global_head_dim");
        t.erase("num_global_key_value_heads");
        t["per_layer_config"] = {{"2", {{"head_dim", 64}}}, {"5", {{"head_dim", 64}}}};
      }),
      "config.json");
  for (size_t i = 0; i < flat.text.layers.size(); ++i) {
    EXPECT_EQ(per.text.layers[i].head_dim, flat.text.layers[i].head_dim) << i;
    EXPECT_EQ(per.text.layers[i].kv_donor, flat.text.layers[i].kv_donor) << i;
  }
}

TEST(Config, E2BDonorsAndWidthsFollowTheSpec) {
  nlohmann::json t = {{"model_type", "gemma4_text"}, {"hidden_size", 1536},
                      {"num_hidden_layers", 35},     {"num_attention_heads", 8},
                      {"num_key_value_heads", 1},    {"intermediate_size", 6144},
                      {"num_kv_shared_layers", 20},  {"use_double_wide_mlp", true}};
  std::vector<std::string> types;
  for (int i = 0; i < 35; ++i)
    types.push_back((i % 5 == 4) ? "full_attention" : "sliding_attention");
  t["layer_types"] = types;
  const ModelConfig c = parse_model_config(t.dump(), "e2b.json");
  EXPECT_FALSE(c.multimodal);
  EXPECT_EQ(c.text_prefix(), "model.");
  for (int i : {15, 18, 20, 33}) EXPECT_EQ(c.text.layers[static_cast<size_t>(i)].kv_donor, 13) << i;
  for (int i : {19, 24, 29, 34}) EXPECT_EQ(c.text.layers[static_cast<size_t>(i)].kv_donor, 14) << i;
  EXPECT_EQ(c.text.layers[14].mlp_width, 6144);
  EXPECT_EQ(c.text.layers[15].mlp_width, 12288);
  EXPECT_EQ(c.text.layers[4].head_dim, 512);
}

}  // namespace
