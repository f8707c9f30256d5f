// A checkpoint's config.json (gemma4/config.h), every derived field included.
#include "fuzz_util.h"
#include "gemma4/config.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_error_or_success([&] { (void)parse_model_config(text, "config.json"); });
  return 0;
}
