// PNG and JPEG decoding (libpng, libjpeg-turbo through image/image_decode.h), EXIF orientation,
// and the vision preprocessing of whatever decodes, with the fixture model's processor config.
#include "fuzz_util.h"
#include "image/image_decode.h"
#include "image/image_processor.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ImageProcessorConfig cfg = load_processor_config(GEMSTAGE_FUZZ_MODEL_DIR);
  ImageLimits limits;
  // 256x256: small enough that each run stays fast under ASan, and a header claiming more is
  // refused before any pixel buffer is allocated, which is the limit worth fuzzing.
  limits.max_pixels = 1 << 16;
  fuzz::expect_error_or_success([&] {
    const RgbImage img = decode_image(data, size, limits, "input image");
    (void)preprocess_image(img, cfg);
  });
  return 0;
}
