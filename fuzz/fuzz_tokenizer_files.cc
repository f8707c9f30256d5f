// The tokenizer's own files: tokenizer.json (vocabulary, merges, added tokens, normalizer and
// pre-tokenizer) and tokenizer_config.json (added_tokens_decoder, special-token names). The first
// byte picks which one the rest of the input is: even, tokenizer.json on its own; odd,
// tokenizer_config.json beside the fixture's valid tokenizer.json. A tokenizer that loads then
// encodes and decodes a prompt with special tokens, so a table that parses but is inconsistent
// (an added token pointing past the vocabulary, say) is exercised too.
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

using namespace gemstage;

namespace {
const std::string& config_dir() {
  static const std::string dir = [] {
    const std::string d = fuzz::scratch_dir() + "/tok_with_config";
    std::filesystem::create_directories(d);
    std::filesystem::copy_file(std::string(GEMSTAGE_FUZZ_MODEL_DIR) + "/tokenizer.json",
                               d + "/tokenizer.json",
                               std::filesystem::copy_options::overwrite_existing);
    return d;
  }();
  return dir;
}

void exercise(const Tokenizer& tok) {
  const std::vector<int32_t> ids =
      tok.encode("<bos><|turn>user\nHello, wörld 12345 <|image|>\t\n<turn|>", true, true);
  (void)tok.decode(ids, false);
  (void)tok.decode(ids, true);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool config = data[0] & 1;
  fuzz::expect_error_or_success([&] {
    if (config) {
      fuzz::write_scratch("tok_with_config/tokenizer_config.json", data + 1, size - 1);
      exercise(Tokenizer::from_model_dir(config_dir()));
    } else {
      exercise(Tokenizer::from_file(fuzz::write_scratch("tokenizer.json", data + 1, size - 1)));
    }
  });
  return 0;
}
