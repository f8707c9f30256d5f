// safetensors files and model.safetensors.index.json. The first byte picks which: even, the
// input is a .safetensors file; odd, the rest is an index.json over a folder that holds one
// valid shard (so shard look-ups proceed past the JSON).
#include <cstring>

#include "fuzz_util.h"
#include "io/safetensors.h"

using namespace gemstage;

namespace {
const std::string& folder_with_shard() {
  static const std::string dir = [] {
    const std::string d = fuzz::scratch_dir() + "/ckpt";
    std::filesystem::create_directories(d);
    const std::string h = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
    file += h + std::string(8, '\0');
    fuzz::write_scratch("ckpt/model-00001-of-00001.safetensors",
                        reinterpret_cast<const uint8_t*>(file.data()), file.size());
    return d;
  }();
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  if ((data[0] & 1) == 0) {
    const std::string path = fuzz::write_scratch("input.safetensors", data + 1, size - 1);
    fuzz::expect_error_or_success([&] {
      SafetensorsFile f(path);
      for (const auto& [k, e] : f.entries()) {
        const WeightView v = f.view(k);
        // Touch the first and last byte: the validated range must be inside the mapping.
        if (v.nbytes > 0) {
          volatile uint8_t b = static_cast<const uint8_t*>(v.data)[0];
          b = static_cast<const uint8_t*>(v.data)[v.nbytes - 1];
          (void)b;
        }
      }
    });
  } else {
    const std::string dir = folder_with_shard();
    fuzz::write_scratch("ckpt/model.safetensors.index.json", data + 1, size - 1);
    fuzz::expect_error_or_success([&] {
      const TensorStore s = TensorStore::open_dir(dir);
      for (const std::string& k : s.keys()) (void)s.view(k);
    });
  }
  return 0;
}
