// The OpenAI-compatible request parser (server/api.h): a body as it arrives on the wire, parsed
// as a chat completion and as a text completion, with the server's default limits.
#include "fuzz_util.h"
#include "server/api.h"

using namespace gemstage;
using namespace gemstage::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  fuzz::expect_error_or_success([&] {
    const nlohmann::json j = parse_json_body(body);
    fuzz::expect_error_or_success([&] { (void)parse_chat_request(j); });
    fuzz::expect_error_or_success([&] { (void)parse_completion_request(j); });
  });
  return 0;
}
