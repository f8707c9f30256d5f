#include "image/unified_image.h"

#include "core/error.h"
#include "image/image_resize.h"

namespace gemstage {

ResizeTarget unified_resize_target(int64_t height, int64_t width, const ImageProcessorConfig& c) {
  // The processor cuts patch_size patches and merges pooling² of them; the budget counts merged
  // blocks, so it is the Gemma 4 rule over max_soft_tokens · pooling² patches.
  return aspect_ratio_preserving_size(height, width, c.patch_size, c.max_patches(),
                                      c.pooling_kernel_size);
}

UnifiedPatches preprocess_unified_image(const RgbImage& image, const ImageProcessorConfig& c) {
  c.validate("image processor config");
  if (c.do_normalize)
    fail(
        "image processor config: do_normalize is true; the unified image embedder takes "
        "uint8/255 values without normalisation");
  if (image.width < 1 || image.height < 1 ||
      image.rgb.size() != size_t(image.width) * image.height * 3)
    fail("image preprocess: image is ", image.width, "x", image.height, " with ", image.rgb.size(),
         " bytes; expected a non-empty width*height*3 RGB buffer");
  const int b = c.patch_size * c.pooling_kernel_size;
  const RgbImage* src = &image;
  RgbImage resized;
  if (c.do_resize) {
    const ResizeTarget t = unified_resize_target(image.height, image.width, c);
    if (t.height != image.height || t.width != image.width) {
      resized = resize_bicubic_aa(image, t.width, t.height, c.backend);
      src = &resized;
    }
  }
  UnifiedPatches out;
  out.resized_h = src->height;
  out.resized_w = src->width;
  if (src->height % b != 0 || src->width % b != 0)
    fail("image preprocess: image is ", src->height, "x", src->width, ", not a multiple of the ", b,
         "-px block; enable do_resize or resize the image first");
  out.grid_h = src->height / b;
  out.grid_w = src->width / b;
  out.num_soft_tokens = out.grid_h * out.grid_w;
  out.max_soft_tokens = c.max_soft_tokens;
  if (out.num_soft_tokens > c.max_soft_tokens)
    fail("image preprocess: ", src->height, "x", src->width, " gives ", out.num_soft_tokens,
         " blocks, more than max_soft_tokens = ", c.max_soft_tokens, "; enable do_resize");
  const int64_t pd = int64_t{3} * b * b;
  out.pixel_values.assign(static_cast<size_t>(c.max_soft_tokens * pd), 0.0f);
  out.position_ids.assign(static_cast<size_t>(c.max_soft_tokens) * 2, -1);
  // float32(uint8) * float32(rescale_factor), as the processor's tensor path computes it.
  const float scale = c.do_rescale ? static_cast<float>(c.rescale_factor) : 1.0f;
  const int W = src->width;
  for (int by = 0; by < out.grid_h; ++by)
    for (int bx = 0; bx < out.grid_w; ++bx) {
      const int64_t k = int64_t{by} * out.grid_w + bx;
      float* dst = out.pixel_values.data() + k * pd;
      for (int dy = 0; dy < b; ++dy) {
        const uint8_t* row = src->rgb.data() + (size_t(by * b + dy) * W + size_t(bx) * b) * 3;
        for (int i = 0; i < b * 3; ++i) *dst++ = static_cast<float>(row[i]) * scale;
      }
      out.position_ids[static_cast<size_t>(2 * k)] = bx;
      out.position_ids[static_cast<size_t>(2 * k + 1)] = by;
    }
  return out;
}

}  // namespace gemstage
