#include "core/host_tensor.h"

#include "core/error.h"

namespace gemstage {

const char* elem_type_name(ElemType t) {
  switch (t) {
    case ElemType::F32:
      return "f32";
    case ElemType::I32:
      return "i32";
    case ElemType::I64:
      return "i64";
    case ElemType::U8:
      return "u8";
  }
  return "?";
}

const char* elem_type_numpy_name(ElemType t) {
  switch (t) {
    case ElemType::F32:
      return "float32";
    case ElemType::I32:
      return "int32";
    case ElemType::I64:
      return "int64";
    case ElemType::U8:
      return "uint8";
  }
  return "?";
}

HostTensor::HostTensor(Shape shape, std::vector<float> v)
    : shape_(std::move(shape)), values_(std::move(v)) {
  check_size(std::get<0>(values_).size());
}
HostTensor::HostTensor(Shape shape, std::vector<int32_t> v)
    : shape_(std::move(shape)), values_(std::move(v)) {
  check_size(std::get<1>(values_).size());
}
HostTensor::HostTensor(Shape shape, std::vector<int64_t> v)
    : shape_(std::move(shape)), values_(std::move(v)) {
  check_size(std::get<2>(values_).size());
}
HostTensor::HostTensor(Shape shape, std::vector<uint8_t> v)
    : shape_(std::move(shape)), values_(std::move(v)) {
  check_size(std::get<3>(values_).size());
}

void HostTensor::check_size(size_t n) const {
  for (int64_t d : shape_)
    if (d < 0) fail("tensor shape ", shape_str(shape_), " has a negative dimension");
  if (static_cast<int64_t>(n) != shape_numel(shape_))
    fail("tensor of shape ", shape_str(shape_), " needs ", shape_numel(shape_), " values, got ", n);
}

void HostTensor::wrong_type(ElemType want) const {
  fail("tensor of shape ", shape_str(shape_), " holds ", elem_type_name(type()), " values, not ",
       elem_type_name(want));
}

FloatTensor HostTensor::take_float() {
  FloatTensor t;
  auto* v = std::get_if<std::vector<float>>(&values_);
  if (!v) wrong_type(ElemType::F32);
  t.shape = shape_;
  t.data = std::move(*v);
  shape_.clear();
  v->clear();
  return t;
}

}  // namespace gemstage
