// A bundle stage's .gsw file: magic, header length, JSON header, aligned tensor data
// (stage/weights_file.h).
#include "fuzz_util.h"
#include "stage/weights_file.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_scratch("input.gsw", data, size);
  fuzz::expect_error_or_success([&] {
    WeightsFile f(path);
    for (const std::string& k : f.keys()) {
      const WeightView v = f.view(k);
      if (v.nbytes > 0) {
        volatile uint8_t b = static_cast<const uint8_t*>(v.data)[v.nbytes - 1];
        (void)b;
      }
    }
  });
  return 0;
}
