// Inputs the libFuzzer targets in fuzz/ found to break a parser, kept so the fix stays fixed.
// Each names the target that found it; the bytes are the finding, minimized by hand.
#include <gtest/gtest.h>

#include <string>

#include "server/api.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::server;

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

}  // namespace
