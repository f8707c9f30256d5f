#include "image/image_resize.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace gemstage {

double bicubic_aa_filter(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

ResampleAxis bicubic_aa_axis(int in_size, int out_size, ResizeBackend backend) {
  if (in_size < 1 || out_size < 1)
    fail("bicubic resize: sizes must be positive, got ", in_size, " -> ", out_size);
  ResampleAxis ax;
  ax.in_size = in_size;
  ax.out_size = out_size;
  // Every expression below keeps the operand order of torch's
  // _compute_indices_min_size_weights_aa (and Pillow's precompute_coeffs, which it copies), so the
  // double weights are bit-identical to both.
  const double scale = static_cast<double>(in_size) / out_size;
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  ax.max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  ax.first.resize(out_size);
  ax.taps.resize(out_size);
  std::vector<double> w(size_t(out_size) * ax.max_taps, 0.0);
  double wt_max = 0.0;
  for (int i = 0; i < out_size; ++i) {
    const double center = scale * (i + 0.5);
    const int64_t xmin = std::max(static_cast<int64_t>(center - support + 0.5), int64_t{0});
    int64_t xsize = std::min(static_cast<int64_t>(center + support + 0.5), int64_t{in_size}) - xmin;
    // Rounding can make the window one longer than max_taps; torch clips it.
    xsize = std::clamp(xsize, int64_t{0}, int64_t{ax.max_taps});
    double* wi = &w[size_t(i) * ax.max_taps];
    double total = 0.0;
    for (int64_t j = 0; j < xsize; ++j) {
      const double v = bicubic_aa_filter((j + xmin - center + 0.5) * invscale);
      wi[j] = v;
      total += v;
    }
    if (total != 0.0) {
      for (int64_t j = 0; j < xsize; ++j) {
        wi[j] /= total;
        wt_max = std::max(wt_max, wi[j]);
      }
    }
    ax.first[i] = static_cast<int>(xmin);
    ax.taps[i] = static_cast<int>(xsize);
  }
  if (backend == ResizeBackend::kPil) {
    ax.precision = 22;  // Resample.c PRECISION_BITS = 32 - 8 - 2
  } else {
    // torch: the most fractional bits that keep the largest weight (times 2) inside int16.
    int p = 0;
    for (p = 0; p < 22; ++p) {
      const int next = static_cast<int>(0.5 + wt_max * (1 << (p + 1)));
      if (next >= (1 << 15)) break;
    }
    ax.precision = p;
  }
  if (ax.precision < 1) fail("bicubic resize: degenerate weights for ", in_size, " -> ", out_size);
  ax.weights.resize(w.size());
  const double one = static_cast<double>(1 << ax.precision);
  for (size_t k = 0; k < w.size(); ++k) {
    const double v = w[k] * one;
    const int q = v < 0 ? static_cast<int>(-0.5 + v) : static_cast<int>(0.5 + v);
    // torch stores int16; every value fits by construction of the precision.
    ax.weights[k] = backend == ResizeBackend::kPil ? q : static_cast<int16_t>(q);
  }
  return ax;
}

namespace {

inline uint8_t clamp_shift(int32_t acc, int precision) {
  return static_cast<uint8_t>(std::clamp(acc >> precision, 0, 255));
}

// Filters along x: src is w x h, result out_w x h.
void horizontal_pass(const uint8_t* src, int w, int h, const ResampleAxis& ax, uint8_t* dst) {
  const int out_w = ax.out_size;
  const int32_t half = int32_t{1} << (ax.precision - 1);
  for (int y = 0; y < h; ++y) {
    const uint8_t* row = src + size_t(y) * w * 3;
    uint8_t* orow = dst + size_t(y) * out_w * 3;
    for (int x = 0; x < out_w; ++x) {
      const int32_t* k = &ax.weights[size_t(x) * ax.max_taps];
      const uint8_t* s = row + size_t(ax.first[x]) * 3;
      int32_t r = half, g = half, b = half;
      for (int j = 0; j < ax.taps[x]; ++j) {
        r += s[3 * j] * k[j];
        g += s[3 * j + 1] * k[j];
        b += s[3 * j + 2] * k[j];
      }
      orow[3 * x] = clamp_shift(r, ax.precision);
      orow[3 * x + 1] = clamp_shift(g, ax.precision);
      orow[3 * x + 2] = clamp_shift(b, ax.precision);
    }
  }
}

// Filters along y: src is w x h, result w x out_h.
void vertical_pass(const uint8_t* src, int w, const ResampleAxis& ax, uint8_t* dst) {
  const size_t stride = size_t(w) * 3;
  const int32_t half = int32_t{1} << (ax.precision - 1);
  std::vector<int32_t> acc(stride);
  for (int y = 0; y < ax.out_size; ++y) {
    std::fill(acc.begin(), acc.end(), half);
    const int32_t* k = &ax.weights[size_t(y) * ax.max_taps];
    for (int j = 0; j < ax.taps[y]; ++j) {
      const uint8_t* s = src + size_t(ax.first[y] + j) * stride;
      const int32_t kj = k[j];
      for (size_t i = 0; i < stride; ++i) acc[i] += s[i] * kj;
    }
    uint8_t* d = dst + size_t(y) * stride;
    for (size_t i = 0; i < stride; ++i) d[i] = clamp_shift(acc[i], ax.precision);
  }
}

}  // namespace

RgbImage resize_bicubic_aa(const RgbImage& src, int out_width, int out_height,
                           ResizeBackend backend) {
  if (src.width < 1 || src.height < 1 || src.rgb.size() != size_t(src.width) * src.height * 3)
    fail("bicubic resize: source image is ", src.width, "x", src.height, " with ", src.rgb.size(),
         " bytes of RGB; expected a non-empty width*height*3 buffer");
  if (out_width < 1 || out_height < 1)
    fail("bicubic resize: target size ", out_width, "x", out_height, " must be at least 1x1");
  RgbImage cur = src;
  if (out_width != src.width) {
    const ResampleAxis ax = bicubic_aa_axis(src.width, out_width, backend);
    RgbImage next;
    next.width = out_width;
    next.height = cur.height;
    next.rgb.resize(size_t(out_width) * cur.height * 3);
    horizontal_pass(cur.rgb.data(), cur.width, cur.height, ax, next.rgb.data());
    cur = std::move(next);
  }
  if (out_height != src.height) {
    const ResampleAxis ax = bicubic_aa_axis(src.height, out_height, backend);
    RgbImage next;
    next.width = cur.width;
    next.height = out_height;
    next.rgb.resize(size_t(cur.width) * out_height * 3);
    vertical_pass(cur.rgb.data(), cur.width, ax, next.rgb.data());
    cur = std::move(next);
  }
  return cur;
}

}  // namespace gemstage
