#include "kernels/vec_kernels.h"

#include "kernels/arm/vec_neon.h"
#include "kernels/ops.h"
#include "kernels/x86/vec_avx2.h"
#include "kernels/x86/vec_avx512.h"

namespace gemstage {

namespace {

// The overloads of the twins' attend_key_block without the prefetch arguments.
using F32Block = void (*)(const float* const*, float* const*, const int64_t*, const int64_t*,
                          int64_t, int64_t, const float* const*, const float* const*, int64_t,
                          int64_t, float*, int64_t, float*, float*);
using Bf16Block = void (*)(const float* const*, float* const*, const int64_t*, const int64_t*,
                           int64_t, int64_t, const uint16_t* const*, const uint16_t* const*,
                           int64_t, int64_t, float*, int64_t, float*, float*);

// Twins without a prefetch of the next block take the table's signature through this adapter.
template <typename T, auto kFn>
void without_next(const float* const* q, float* const* out, const int64_t* lo, const int64_t* hi,
                  int64_t M, int64_t hd, const T* const* k, const T* const* v, int64_t nk,
                  int64_t first, float* scores, int64_t ss, float* max, float* sum, const T* const*,
                  const T* const*, int64_t) {
  kFn(q, out, lo, hi, M, hd, k, v, nk, first, scores, ss, max, sum);
}

#if defined(__x86_64__) || defined(__i386__)
constexpr VecKernels kAvx512{avx512::scale_row,
                             avx512::gelu_tanh_mul,
                             avx512::softcap,
                             avx512::softmax_inplace,
                             avx512::dot,
                             avx512::axpy,
                             avx512::attend_key_block,
                             avx512::attend_key_block,
                             avx512::attend_key_block};

constexpr VecKernels kAvx2{avx2::scale_row,
                           avx2::gelu_tanh_mul,
                           avx2::softcap,
                           avx2::softmax_inplace,
                           avx2::dot,
                           avx2::axpy,
                           avx2::attend_key_block,
                           avx2::attend_key_block,
                           avx2::attend_key_block};
#endif

#if defined(__aarch64__)
constexpr VecKernels kNeon{neon::scale_row,
                           neon::gelu_tanh_mul,
                           neon::softcap,
                           neon::softmax_inplace,
                           neon::dot,
                           neon::axpy,
                           without_next<float, static_cast<F32Block>(neon::attend_key_block)>,
                           without_next<uint16_t, static_cast<Bf16Block>(neon::attend_key_block)>,
                           nullptr};
#endif

}  // namespace

const VecKernels* vec_kernels(CpuTier tier) {
  switch (vector_ops_path(tier)) {
#if defined(__x86_64__) || defined(__i386__)
    case VecPath::Avx512:
      return &kAvx512;
    case VecPath::Avx2:
      return &kAvx2;
#endif
#if defined(__aarch64__)
    case VecPath::Neon:
      return &kNeon;
#endif
    default:
      return nullptr;
  }
}

}  // namespace gemstage
