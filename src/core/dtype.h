// Storage dtypes and the scalar conversions every kernel's reference path uses.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace gemstage {

enum class DType : uint8_t { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, Q8_0, Q4_0 };

std::string_view dtype_name(DType t);
// Bytes per element for plain dtypes; 0 for block-quantized ones (see quant_block_bytes).
size_t dtype_size(DType t);
bool dtype_from_safetensors(std::string_view s, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even, as torch's .to(bfloat16); NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_to_bf16(float f) {
  return bf16_to_f32(f32_to_bf16(f));
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace gemstage
