// A tensor as it crosses a stage boundary: an element type, a shape and owned row-major values.
// Stages take and return maps of these by name (TensorMap); the stage contract says which names,
// element types and (symbolic) shapes a stage accepts and produces.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "core/tensor.h"

namespace gemstage {

enum class ElemType : uint8_t { F32, I32, I64, U8 };
// The contract's spelling: "f32", "i32", "i64", "u8".
const char* elem_type_name(ElemType t);
// NumPy's spelling of the same type, for messages: "float32", "int32", "int64", "uint8".
const char* elem_type_numpy_name(ElemType t);

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(Shape shape, std::vector<float> v);
  HostTensor(Shape shape, std::vector<int32_t> v);
  HostTensor(Shape shape, std::vector<int64_t> v);
  HostTensor(Shape shape, std::vector<uint8_t> v);
  // Takes over an activation tensor's values without copying them.
  static HostTensor from(FloatTensor&& t) {
    return HostTensor(std::move(t.shape), std::move(t.data));
  }

  ElemType type() const { return static_cast<ElemType>(values_.index()); }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_numel(shape_); }

  // The values as T (float, int32_t, int64_t or uint8_t); fails when the type differs.
  template <typename T>
  std::span<const T> values() const {
    const auto* v = std::get_if<std::vector<T>>(&values_);
    if (!v) wrong_type(kTypeOf<T>);
    return *v;
  }
  template <typename T>
  std::span<T> values() {
    auto* v = std::get_if<std::vector<T>>(&values_);
    if (!v) wrong_type(kTypeOf<T>);
    return *v;
  }
  // Moves an f32 tensor's values out as an activation tensor.
  FloatTensor take_float();

 private:
  template <typename T>
  static constexpr ElemType kTypeOf = std::is_same_v<T, float>     ? ElemType::F32
                                      : std::is_same_v<T, int32_t> ? ElemType::I32
                                      : std::is_same_v<T, int64_t> ? ElemType::I64
                                                                   : ElemType::U8;
  [[noreturn]] void wrong_type(ElemType want) const;
  void check_size(size_t n) const;

  Shape shape_;
  // Index order matches ElemType.
  std::variant<std::vector<float>, std::vector<int32_t>, std::vector<int64_t>, std::vector<uint8_t>>
      values_;
};

using TensorMap = std::map<std::string, HostTensor>;

}  // namespace gemstage
