// One tier's SIMD twins of the elementwise and attention kernels of ops.h and attention.h, as a
// table: ops.cc and attention.cc call through vec_kernels() instead of switching on the tier at
// every call site, and a tier is one table (vec_kernels.cc) over its own file of twins
// (x86/vec_avx512.*, x86/vec_avx2.*, arm/vec_neon.*, each compiled only for its architecture).
#pragma once

#include <cstdint>

#include "cache/kv_cache.h"
#include "core/cpu_features.h"

namespace gemstage {

// attention.h's attend_key_block on raw pointers (see x86/vec_avx512.h); next_k / next_v / next_n
// are the following block's rows, which a tier may prefetch and the others ignore.
template <typename T>
using AttendKeyBlockFn = void (*)(const float* const* q, float* const* out, const int64_t* lo,
                                  const int64_t* hi, int64_t M, int64_t hd, const T* const* k,
                                  const T* const* v, int64_t nk, int64_t first, float* scores,
                                  int64_t ss, float* max, float* sum, const T* const* next_k,
                                  const T* const* next_v, int64_t next_n);

struct VecKernels {
  // y = x * inv * w (w == nullptr: y = x * inv): rmsnorm's scaling, its reduction being dot.
  void (*scale_row)(const float* x, float inv, const float* w, int64_t n, float* y);
  void (*gelu_tanh_mul)(const float* gate, const float* up, int64_t n, float* out);
  void (*softcap)(float* x, int64_t n, float cap);
  void (*softmax_inplace)(float* s, int64_t n);
  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float a, const float* x, float* y, int64_t n);
  AttendKeyBlockFn<float> attend_key_block_f32;
  AttendKeyBlockFn<uint16_t> attend_key_block_bf16;  // bf16 bit patterns
  AttendKeyBlockFn<KvQ8Block> attend_key_block_q8;   // null: the portable loops
};

// The table of `tier` (ops.h's vector_ops_path()); nullptr on the scalar path, where the callers
// run their portable reference loops.
const VecKernels* vec_kernels(CpuTier tier);

}  // namespace gemstage
