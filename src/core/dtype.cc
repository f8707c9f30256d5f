#include "core/dtype.h"

#include <cmath>

namespace gemstage {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::F64:
      return "F64";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
    case DType::I16:
      return "I16";
    case DType::I8:
      return "I8";
    case DType::U8:
      return "U8";
    case DType::BOOL:
      return "BOOL";
    case DType::Q8_0:
      return "Q8_0";
    case DType::Q4_0:
      return "Q4_0";
  }
  return "?";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
      return 1;
    case DType::Q8_0:
    case DType::Q4_0:
      return 0;
  }
  return 0;
}

bool dtype_from_safetensors(std::string_view s, DType* out) {
  static constexpr struct {
    std::string_view name;
    DType t;
  } kNames[] = {{"F32", DType::F32},  {"F16", DType::F16}, {"BF16", DType::BF16},
                {"F64", DType::F64},  {"I64", DType::I64}, {"I32", DType::I32},
                {"I16", DType::I16},  {"I8", DType::I8},   {"U8", DType::U8},
                {"BOOL", DType::BOOL}};
  for (const auto& n : kNames)
    if (n.name == s) {
      *out = n.t;
      return true;
    }
  return false;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (a < 0x38800000u) {  // subnormal half: round value / 2^-24 to nearest even
    const float m = std::ldexp(std::fabs(f), 24);
    const float r = std::nearbyint(m);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  uint32_t v = a - 0x38000000u;  // rebias 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

}  // namespace gemstage
