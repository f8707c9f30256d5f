// Inputs the libFuzzer targets in fuzz/ found to break a parser, kept so the fix stays fixed.
// Each names the target that found it; the bytes are the finding, minimized by hand.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "server/api.h"
#include "stage/bundle.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::server;
using namespace gemstage::testing;

namespace {

// fuzz_openai_request: a number beyond double's range made nlohmann's parser throw out_of_range
// (not parse_error), which escaped parse_json_body instead of becoming a 400.
TEST(FuzzRegression, NumberOverflowInARequestBodyIsInvalidJson) {
  for (const std::string& body :
       {std::string("2224e22961-2\xde\xde\xde"
                    "22222is2222222\xde\xde\xde\xde\xde\xde\xde\xde\xde"
                    "22222ist\"d\"}"),
        std::string(R"({"max_tokens": 1e999999})"), std::string("-1e400")}) {
    try {
      (void)parse_json_body(body);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400) << body;
      EXPECT_EQ(e.code(), "invalid_json") << body;
      EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
    }
  }
}

// Found by reading read_bundle_manifest while writing the fuzz targets: fields of the wrong
// JSON type below the checked ones (a kv_donors key that is no number, a cache group or copied
// file entry that is no object, a non-string ple_weights) escaped as std::invalid_argument or
// nlohmann::type_error instead of an Error naming the manifest.
TEST(FuzzRegression, MalformedManifestFieldsNameTheManifest) {
  const std::string dir = temp_dir("fuzz_manifest");
  const std::string bundle = dir + "/bundle";
  ASSERT_EQ(std::system((std::string(GEMSTAGE_CLI) + " export -m " + fixture("model") + " --out " +
                         bundle + " > " + dir + "/log 2>&1")
                            .c_str()),
            0);
  const std::string path = bundle + "/manifest.json";
  const nlohmann::json good = nlohmann::json::parse(std::ifstream(path));
  ASSERT_NO_THROW(read_bundle_manifest(bundle));
  const std::vector<std::function<void(nlohmann::json&)>> breakers = {
      [](nlohmann::json& j) {
        j["stages"][1]["kv_donors"] = {{"x", 1}};
      },
      [](nlohmann::json& j) {
        j["stages"][1]["kv_donors"] = {{"99999999999", 1}};
      },
      [](nlohmann::json& j) {
        j["stages"][1]["cache_groups"] = {1, 2};
      },
      [](nlohmann::json& j) {
        j["stages"][1]["cache_groups"] = {{{"capacity", "big"}}};
      },
      [](nlohmann::json& j) {
        j["copied_files"] = {{"config.json", 5}};
      },
      [](nlohmann::json& j) { j["ple_weights"] = 3; },
  };
  for (size_t i = 0; i < breakers.size(); ++i) {
    nlohmann::json j = good;
    breakers[i](j);
    std::ofstream(path) << j.dump();
    const std::string msg = error_of([&] { (void)read_bundle_manifest(bundle); });
    EXPECT_NE(msg.find(path), std::string::npos) << "case " << i << ": " << msg;
  }
}

}  // namespace
