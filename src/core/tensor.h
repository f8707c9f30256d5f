// Owned float tensors for activations, and non-owning views of stored weights.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace gemstage {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

// Row-major f32 activations. Small and copyable on purpose; hot loops use raw pointers.
struct FloatTensor {
  Shape shape;
  std::vector<float> data;

  FloatTensor() = default;
  explicit FloatTensor(Shape s)
      : shape(std::move(s)), data(static_cast<size_t>(shape_numel(shape)), 0.0f) {}
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t dim(size_t i) const { return shape.at(i); }
  float* row(int64_t r) { return data.data() + r * shape.back(); }
  const float* row(int64_t r) const { return data.data() + r * shape.back(); }
};

// A stored tensor: memory-mapped checkpoint data or a bundle's quantized blocks.
struct WeightView {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  const void* data = nullptr;
  size_t nbytes = 0;

  int64_t rows() const { return shape.empty() ? 1 : shape.front(); }
  int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  bool valid() const { return data != nullptr; }
};

// Element i of a float-typed or Q8_0/Q4_0 view as f32 (reference path; not for hot loops).
float weight_at(const WeightView& w, int64_t i);
// Row `row` of a float-typed view converted to f32; Q8_0/Q4_0 views are dequantized
// (nbytes = rows * quant_row_bytes, see kernels/quant.h).
void weight_row_to_f32(const WeightView& w, int64_t row, float* out);

}  // namespace gemstage
