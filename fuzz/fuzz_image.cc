// PNG and JPEG decoding (libpng, libjpeg-turbo through image/image_decode.h), EXIF orientation,
// and the vision preprocessing of whatever decodes, with the fixture model's processor config.
#include "fuzz_util.h"
#include "image/image_decode.h"
#include "image/image_processor.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The fixture model's config with 2-pixel patches and no pooling: the resize arithmetic
  // (aspect ratios, rounding to whole patches, the patch budget) is the same code, but the
  // output is 70 patches of 2 x 2 pixels instead of 2520 of 16 x 16, so one run costs the
  // decode, not a 645k-pixel bicubic resize (15 runs/s under ASan before).
  static const ImageProcessorConfig cfg = [] {
    ImageProcessorConfig c = load_processor_config(GEMSTAGE_FUZZ_MODEL_DIR);
    c.patch_size = 2;
    c.pooling_kernel_size = 1;
    c.max_soft_tokens = 70;
    return c;
  }();
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
