// Client-supplied JSON schemas (response_format, text.format, output_format, tool parameters)
// compiled for constrained decoding (runtime/json_constraint.h), then text matched against the
// result. The input is "<schema JSON>\n<text>": the schema must compile or be refused with an
// Error (bounded depth, nodes, properties; recursive $refs), and matching any bytes, in either
// dialect, must neither crash nor let a copy's state leak into the original.
#include "fuzz_util.h"
#include "runtime/json_constraint.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nl = input.find('\n');
  const std::string_view schema_text = input.substr(0, nl);
  const std::string_view text = nl == std::string_view::npos ? "" : input.substr(nl + 1);
  nlohmann::json schema;
  try {
    schema = nlohmann::json::parse(schema_text);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  for (const JsonDialect dialect : {JsonDialect::kJson, JsonDialect::kGemmaArgs}) {
    std::shared_ptr<const JsonGrammar> g;
    fuzz::expect_error_or_success([&] { g = JsonGrammar::from_schema(schema, dialect); });
    if (!g) continue;
    JsonMatcher m(*g);
    for (const char c : text) {
      const JsonMatcher before = m;
      JsonMatcher trial = m;
      const bool ok = trial.feed_byte(static_cast<unsigned char>(c));
      // Trying on a copy leaves the original as it was.
      if (m.complete() != before.complete() || m.closed() != before.closed()) __builtin_trap();
      if (!ok) break;
      m = trial;
      (void)m.complete();
    }
  }
  return 0;
}
