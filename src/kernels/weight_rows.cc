#include "kernels/weight_rows.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "kernels/quant.h"

namespace gemstage {

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

namespace {

// Bytes of one stored row; fails for dtypes row_to_f32 cannot convert.
size_t row_bytes(const WeightView& w) {
  const int64_t n = w.cols();
  if (dtype_is_quantized(w.dtype)) return quant_row_bytes(w.dtype, n);
  if (w.dtype != DType::F32 && w.dtype != DType::BF16 && w.dtype != DType::F16)
    fail("tensor ", w.name, ": dtype ", dtype_name(w.dtype), " has no row conversion");
  return static_cast<size_t>(n) * dtype_size(w.dtype);
}

// The byte offset of `row` within the view, after checking it lies inside.
size_t row_offset(const WeightView& w, int64_t row) {
  const size_t rb = row_bytes(w);
  if (row < 0 || (w.nbytes != 0 && static_cast<size_t>(row + 1) * rb > w.nbytes))
    fail("tensor ", w.name, ": row ", row, " outside ", w.nbytes, " bytes of ", dtype_name(w.dtype),
         " rows of ", rb, " bytes");
  return static_cast<size_t>(row) * rb;
}

// One stored row (`bytes`, in w's dtype) as n = w.cols() floats.
void row_to_f32(const WeightView& w, const uint8_t* bytes, float* out) {
  const int64_t n = w.cols();
  if (dtype_is_quantized(w.dtype)) return dequantize_row(w.dtype, bytes, n, out);
  switch (w.dtype) {
    case DType::F32:
      std::memcpy(out, bytes, static_cast<size_t>(n) * 4);
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      return;
    default:
      fail("tensor ", w.name, ": dtype ", dtype_name(w.dtype), " has no row conversion");
  }
}

}  // namespace

void weight_row_to_f32(const WeightView& w, int64_t row, float* out) {
  row_to_f32(w, static_cast<const uint8_t*>(w.data) + row_offset(w, row), out);
}

void gather_weight_row_to_f32(const WeightView& w, int64_t row, float* out,
                              std::vector<uint8_t>& raw) {
  const auto* bytes = static_cast<const uint8_t*>(w.data);
  const bool in_file = w.file.fd >= 0 && bytes >= w.file.map &&
                       static_cast<size_t>(bytes - w.file.map) <= w.file.size &&
                       w.nbytes <= w.file.size - static_cast<size_t>(bytes - w.file.map);
  if (!in_file) return weight_row_to_f32(w, row, out);
  const size_t rb = row_bytes(w);
  const uint64_t at = static_cast<uint64_t>(bytes - w.file.map) + row_offset(w, row);
  raw.resize(rb);
  size_t done = 0;
  while (done < rb) {
    const ssize_t got =
        ::pread(w.file.fd, raw.data() + done, rb - done, static_cast<off_t>(at + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      fail("tensor ", w.name, ": reading row ", row, " (", rb, " bytes at file offset ", at,
           ") failed: ", got < 0 ? std::strerror(errno) : "the file ends before the row");
    done += static_cast<size_t>(got);
  }
  row_to_f32(w, raw.data(), out);
}

}  // namespace gemstage
