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
  // The mapped file `data` lies in, so lookups of single rows can pread them instead (see
  // gather_weight_row_to_f32). Only used while `data` is inside [map, map + size): a copy of the
  // view pointed at other memory reads that memory.
  struct FileBacking {
    int fd = -1;
    const uint8_t* map = nullptr;
    size_t size = 0;
  } file;

  int64_t rows() const { return shape.empty() ? 1 : shape.front(); }
  int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  bool valid() const { return data != nullptr; }
};

}  // namespace gemstage
