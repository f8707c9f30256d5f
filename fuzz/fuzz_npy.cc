// .npy arrays (io/npy.h): the header dict, dtype, shape, and conversion to a host tensor.
#include "fuzz_util.h"
#include "io/npy.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::expect_error_or_success([&] {
    const NpyArray a = parse_npy(data, size, "input.npy");
    (void)npy_to_host_tensor(a, "input.npy");
  });
  return 0;
}
