// Encoding arbitrary bytes with the fixture model's tokenizer (tests/fixtures/gemma4-tiny), then
// decoding the ids again: invalid UTF-8 must be an Error, valid text must round-trip through
// decode without a fault.
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer tok = Tokenizer::from_model_dir(GEMSTAGE_FUZZ_MODEL_DIR);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_error_or_success([&] {
    const bool flags = size > 0 && (data[0] & 1);
    const std::vector<int32_t> ids = tok.encode(text, flags, !flags);
    (void)tok.decode(ids, flags);
  });
  return 0;
}
