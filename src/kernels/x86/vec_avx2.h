// AVX2 + FMA twins of the elementwise kernels in ops.h / attention.h, for the avx2 tier of
// kernels/cpu_features.h (most laptops and desktops: Intel client CPUs since Alder Lake and AMD
// before Zen 4 have no AVX-512). Same contracts and the same exp / tanh schemes as
// kernels/x86/vec_avx512.h (about 1 ulp / a few ulp); tests/kernels_test.cc compares every one
// against the scalar reference on odd sizes. Compiled only for x86.
#pragma once

#include <cstdint>

#include "cache/kv_cache.h"

namespace gemstage::avx2 {

void scale_row(const float* x, float inv, const float* w, int64_t n, float* y);
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out);
void softcap(float* x, int64_t n, float cap);
void softmax_inplace(float* s, int64_t n);
float dot(const float* a, const float* b, int64_t n);
void axpy(float a, const float* x, float* y, int64_t n);
// attention.h's attend_key_block for M queries over nk keys at positions first.., as
// avx512::attend_key_block: next_k / next_v / next_n are the following block's rows, prefetched
// while this block's scores are computed.
void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const float* const* k,
                      const float* const* v, int64_t nk, int64_t first, float* scores, int64_t ss,
                      float* max, float* sum, const float* const* next_k,
                      const float* const* next_v, int64_t next_n);
void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const uint16_t* const* k,
                      const uint16_t* const* v, int64_t nk, int64_t first, float* scores,
                      int64_t ss, float* max, float* sum, const uint16_t* const* next_k,
                      const uint16_t* const* next_v, int64_t next_n);

// The same with q8_0 key and value rows (cache/kv_cache.h's KvQ8Block; hd a multiple of 32),
// each 16 or 8 values widened in registers as they are used.
void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const KvQ8Block* const* k,
                      const KvQ8Block* const* v, int64_t nk, int64_t first, float* scores,
                      int64_t ss, float* max, float* sum, const KvQ8Block* const* next_k,
                      const KvQ8Block* const* next_v, int64_t next_n);

}  // namespace gemstage::avx2
