// NumPy .npy files (format 1.0-3.0, C order, little-endian): the tap dump and fixture format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/host_tensor.h"
#include "core/tensor.h"

namespace gemstage {

struct NpyArray {
  DType dtype = DType::F32;  // F32, F64, F16, I64, I32, I8, U8, BOOL
  Shape shape;
  std::vector<uint8_t> bytes;

  int64_t numel() const { return shape_numel(shape); }
  std::vector<float> to_f32() const;    // any float or int dtype
  std::vector<int64_t> to_i64() const;  // integer dtypes only
};

NpyArray load_npy(const std::string& path);
NpyArray parse_npy(const uint8_t* data, size_t size, const std::string& what);

void save_npy(const std::string& path, DType dtype, const Shape& shape, const void* data);
void save_npy_f32(const std::string& path, const Shape& shape, const std::vector<float>& v);
// A contract tensor from an array whose dtype is one of the contract's element types (float32,
// int32, int64, uint8), exactly: no conversion, so a wrong dtype is reported, not guessed.
HostTensor npy_to_host_tensor(const NpyArray& a, const std::string& what);
void save_npy(const std::string& path, const HostTensor& t);
void save_npy_i64(const std::string& path, const Shape& shape, const std::vector<int64_t>& v);

}  // namespace gemstage
