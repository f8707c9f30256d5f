// Antialiased bicubic resampling of 8-bit RGB, written to be bit-exact with the two resamplers a
// Hugging Face Gemma 4 processor can run.
//
// Both are the same separable filter (Pillow's design, which torch copied):
//   per axis: scale = in / out, support = 2 * max(scale, 1), center_i = scale * (i + 0.5),
//   taps j in [trunc(center - support + 0.5), trunc(center + support + 0.5)) clipped to the image,
//   w_j = keys_cubic((j - center + 0.5) / max(scale, 1)) with a = -0.5, normalised to sum 1;
//   the width pass runs first into an 8-bit image, then the height pass; an axis whose size does
//   not change is not filtered at all.
// They differ only in how the double weights become integers before the integer dot products:
//   kTorchvision  `Gemma4ImageProcessor` (the default backend) calls torchvision's
//                 resize(antialias=True) on the uint8 tensor; on CPU torchvision hands uint8
//                 straight to torch (`_do_native_uint8_resize_on_cpu` is true for BICUBIC), whose
//                 `_compute_index_ranges_int16_weights` makes int16 weights with the largest
//                 precision p <= 22 such that round(max_w * 2^(p+1)) < 2^15, and
//                 `basic_loop_aa_horizontal/vertical<uint8_t>` (and the AVX2 twin) compute
//                 clamp((2^(p-1) + sum(x * w)) >> p, 0, 255).
//   kPil          `Gemma4ImageProcessorPil` calls PIL's Image.resize: Resample.c uses int32
//                 weights with fixed PRECISION_BITS = 22 and the same rounding and clipping.
// Residuals, measured on the noisy 45x31 golden source resized to 7 odd sizes (35403 bytes,
// tests/image_test.cc MatchesPilGolden):
//   kPil vs Pillow 9.4 Image.resize(BICUBIC): bit-exact.
//   kTorchvision vs Pillow: max 2 (a 1 in the 8-bit intermediate can grow through the second
//     pass), 0.56% of bytes differ.
//   kTorchvision vs HF's default: 0 by construction - it follows torch's CPU uint8 source step by
//     step - but unverified by running it: only torch 1.13 was at hand, whose torchvision still
//     resized uint8 through float32.
//   Either vs torchvision's float32 path (taken for GPU tensors, e.g. processor(..., device=
//     "cuda"), and by torchvision releases without native uint8 bicubic): up to 19 on noisy,
//     high-contrast content, ~17% of bytes, because the float path neither rounds nor clips the
//     intermediate between the passes (bicubic overshoot survives); on smooth content at most 1
//     (5-9% of bytes).
#pragma once

#include <cstdint>
#include <vector>

#include "image/image_decode.h"

namespace gemstage {

enum class ResizeBackend {
  kTorchvision,  // HF's default backend on CPU: torch's uint8 path (int16 weights)
  kPil,          // HF's PIL backend: Pillow's ImagingResample (22-bit int32 weights)
};

// Keys cubic convolution kernel with a = -0.5, support 2 (Pillow's bicubic_filter; torch's
// HelperInterpCubic::aa_filter evaluates a different but, for a = -0.5, bit-identical form).
double bicubic_aa_filter(double x);

// One axis of the separable resample, with weights already quantised for `backend`.
struct ResampleAxis {
  int in_size = 0;
  int out_size = 0;
  int max_taps = 0;              // row stride of `weights`: ceil(support) * 2 + 1
  int precision = 0;             // fractional bits of `weights`
  std::vector<int> first;        // [out_size] first input index
  std::vector<int> taps;         // [out_size] number of inputs used
  std::vector<int32_t> weights;  // [out_size * max_taps]
};

ResampleAxis bicubic_aa_axis(int in_size, int out_size, ResizeBackend backend);

// Resizes to out_width x out_height (both >= 1). Returns a copy when the size already matches.
RgbImage resize_bicubic_aa(const RgbImage& src, int out_width, int out_height,
                           ResizeBackend backend);

}  // namespace gemstage
