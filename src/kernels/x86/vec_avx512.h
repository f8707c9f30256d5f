// AVX-512 twins of the elementwise kernels in ops.h / attention.h. ops.cc and attention.cc
// dispatch to them when the tier in force (kernels/cpu_features.h) is avx512 or amx;
// the scalar functions there stay the reference the tests compare these against.
//
// Accuracy (measured by tests/kernels_test.cc against the scalar std:: versions):
//   exp: Cody-Waite reduction to r in [-ln2/2, ln2/2] and a degree-7 Taylor polynomial, about
//        1 ulp;  tanh: odd Taylor polynomial for |u| < 0.3 (relative error < 3e-8), else
//        1 - 2 / (exp(2|u|) + 1), a few ulp. Both far inside the fixtures' tolerances, which
//        compare against a float32 reference whose own tanh differs from glibc's by ulps.
#pragma once

#include <cstdint>

#include "cache/kv_cache.h"

namespace gemstage::avx512 {

// y = x * inv * w (w == nullptr: y = x * inv); rmsnorm's scaling, its reduction being dot(x, x).
void scale_row(const float* x, float inv, const float* w, int64_t n, float* y);
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out);
void softcap(float* x, int64_t n, float cap);
void softmax_inplace(float* s, int64_t n);
float dot(const float* a, const float* b, int64_t n);
void axpy(float a, const float* x, float* y, int64_t n);
// attention.h's attend_key_block for M queries (pointers q/out, visible key ranges lo..hi) over
// nk keys at positions first..; scores has row stride ss; max/sum are the running softmax state.
// next_k/next_v: the next block's next_n rows (0: none), prefetched along the way.
void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const float* const* k,
                      const float* const* v, int64_t nk, int64_t first, float* scores, int64_t ss,
                      float* max, float* sum, const float* const* next_k,
                      const float* const* next_v, int64_t next_n);
// The same with bf16 key and value rows (uint16_t bit patterns).
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

}  // namespace gemstage::avx512
