// The request parsers of `serve` (server/api.h, messages_api.h, responses_api.h): a body as it
// arrives on the wire, parsed as a chat completion (plain and tool path), a text completion, an
// Anthropic Messages request and a Responses request, each dialect's chat body then parsed as the
// server does, with the server's default limits.
#include "fuzz_util.h"
#include "server/api.h"
#include "server/messages_api.h"
#include "server/responses_api.h"

using namespace gemstage;
using namespace gemstage::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  fuzz::expect_error_or_success([&] {
    const nlohmann::json j = parse_json_body(body);
    fuzz::expect_error_or_success([&] { (void)parse_chat_request(j); });
    fuzz::expect_error_or_success([&] { (void)parse_completion_request(j); });
    fuzz::expect_error_or_success([&] { (void)parse_tool_request(j); });
    // The server serves both dialects on the tool path, images included.
    fuzz::expect_error_or_success(
        [&] { (void)parse_tool_request(messages::to_chat_body(j).chat_body); });
    fuzz::expect_error_or_success(
        [&] { (void)parse_tool_request(responses::to_chat_body(j).chat_body); });
  });
  return 0;
}
