#include "core/tensor.h"

#include <cstring>
#include <sstream>

#include "core/error.h"
#include "kernels/quant.h"

namespace gemstage {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

float weight_at(const WeightView& w, int64_t i) {
  if (dtype_is_quantized(w.dtype)) {
    const int64_t n = w.cols(), r = i / n;
    return dequantize_at(
        w.dtype,
        static_cast<const uint8_t*>(w.data) + static_cast<size_t>(r) * quant_row_bytes(w.dtype, n),
        n, i % n);
  }
  switch (w.dtype) {
    case DType::F32: {
      float f;
      std::memcpy(&f, static_cast<const char*>(w.data) + i * 4, 4);
      return f;
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(w.data) + i * 2, 2);
      return bf16_to_f32(h);
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(w.data) + i * 2, 2);
      return f16_to_f32(h);
    }
    default:
      fail("tensor ", w.name, ": dtype ", dtype_name(w.dtype), " cannot be read element-wise");
  }
}

void weight_row_to_f32(const WeightView& w, int64_t row, float* out) {
  const int64_t n = w.cols();
  const int64_t base = row * n;
  if (dtype_is_quantized(w.dtype)) {
    const size_t rb = quant_row_bytes(w.dtype, n);
    if (w.nbytes != 0 && (row < 0 || static_cast<size_t>(row + 1) * rb > w.nbytes))
      fail("tensor ", w.name, ": row ", row, " outside ", w.nbytes, " bytes of ",
           dtype_name(w.dtype), " rows of ", rb, " bytes");
    dequantize_row(w.dtype, static_cast<const uint8_t*>(w.data) + static_cast<size_t>(row) * rb, n,
                   out);
    return;
  }
  switch (w.dtype) {
    case DType::F32:
      std::memcpy(out, static_cast<const float*>(w.data) + base, static_cast<size_t>(n) * 4);
      return;
    case DType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + base;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
      return;
    }
    case DType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(w.data) + base;
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(p[i]);
      return;
    }
    default:
      fail("tensor ", w.name, ": dtype ", dtype_name(w.dtype), " has no row conversion");
  }
}

}  // namespace gemstage
