// NEON (aarch64 Advanced SIMD) twins of the elementwise kernels in ops.h / attention.h, for the
// neon tier of kernels/cpu_features.h (Apple, Graviton, Raspberry Pi, phones). Same contracts and
// the same exp / tanh schemes as kernels/x86/vec_avx2.h, four lanes at a time; partial vectors go
// through zero-padded copies (NEON has no masked loads). tests/kernels_test.cc compares every one
// against the scalar reference on odd sizes (under qemu-aarch64 on x86 machines: the aarch64
// preset). Compiled only for aarch64.
#pragma once

#include <cstdint>

namespace gemstage::neon {

void scale_row(const float* x, float inv, const float* w, int64_t n, float* y);
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out);
void softcap(float* x, int64_t n, float cap);
void softmax_inplace(float* s, int64_t n);
float dot(const float* a, const float* b, int64_t n);
void axpy(float a, const float* x, float* y, int64_t n);
// attention.h's attend_key_block, as avx2::attend_key_block.
void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const float* const* k,
                      const float* const* v, int64_t nk, int64_t first, float* scores, int64_t ss,
                      float* max, float* sum);
void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const uint16_t* const* k,
                      const uint16_t* const* v, int64_t nk, int64_t first, float* scores,
                      int64_t ss, float* max, float* sum);

}  // namespace gemstage::neon
