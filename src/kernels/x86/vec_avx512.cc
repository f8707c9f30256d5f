#include "kernels/x86/vec_avx512.h"

#if defined(__x86_64__) || defined(__i386__)

// GCC 12 reports false "uninitialized" warnings inside its AVX-512 intrinsic headers.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/x86/tile_prefetch.h"

#define GEMSTAGE_AVX512F __attribute__((target("avx512f")))

namespace gemstage::avx512 {

namespace {

// Lanes [0, n) of a vector: full loads in the body, masked loads for the tail, so odd sizes
// never read past the end.
GEMSTAGE_AVX512F inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

GEMSTAGE_AVX512F inline __m512 exp_ps(__m512 x) {
  // min/max take the constant first so a NaN in x comes through (the second operand is
  // returned when either is NaN).
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), x);
  x = _mm512_max_ps(_mm512_set1_ps(-103.9f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 split in a part exact in float (n * hi has no rounding error for |n| < 256) and the rest.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p * 2^n, underflowing gracefully to 0
}

GEMSTAGE_AVX512F inline __m512 tanh_ps(__m512 u) {
  // Sign-bit logic on the integer view: the float and/or forms need AVX-512DQ.
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i ui = _mm512_castps_si512(u);
  const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, ui));
  // Small |u|: the Taylor series to u^9; the next term is below 3e-8 relative at 0.3.
  const __m512 u2 = _mm512_mul_ps(u, u);
  __m512 p = _mm512_set1_ps(62.0f / 2835.0f);
  p = _mm512_fmadd_ps(p, u2, _mm512_set1_ps(-17.0f / 315.0f));
  p = _mm512_fmadd_ps(p, u2, _mm512_set1_ps(2.0f / 15.0f));
  p = _mm512_fmadd_ps(p, u2, _mm512_set1_ps(-1.0f / 3.0f));
  p = _mm512_mul_ps(p, u2);
  const __m512 small = _mm512_fmadd_ps(p, u, u);
  // Otherwise 1 - 2 / (e^{2|u|} + 1), no cancellation worth speaking of once |u| >= 0.3.
  const __m512 e = exp_ps(_mm512_add_ps(a, a));
  const __m512 big =
      _mm512_sub_ps(_mm512_set1_ps(1.0f),
                    _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  const __m512 big_signed = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(big), _mm512_and_si512(ui, sign_bit)));
  const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.3f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(is_small, big_signed, small);
}

GEMSTAGE_AVX512F inline __m512 gelu_tanh_ps(__m512 x) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  const __m512 half_x = _mm512_mul_ps(_mm512_set1_ps(0.5f), x);
  return _mm512_fmadd_ps(half_x, tanh_ps(inner), half_x);
}

}  // namespace

GEMSTAGE_AVX512F void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i), u = _mm512_maskz_loadu_ps(m, up + i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(gelu_tanh_ps(g), u));
  }
}

GEMSTAGE_AVX512F void scale_row(const float* x, float inv, const float* w, int64_t n, float* y) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s);
    if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i));
    _mm512_mask_storeu_ps(y + i, m, v);
  }
}

GEMSTAGE_AVX512F void softcap(float* x, int64_t n, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(c, tanh_ps(_mm512_div_ps(v, c))));
  }
}

GEMSTAGE_AVX512F void softmax_inplace(float* s, int64_t n) {
  if (n <= 0) return;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + i));
  }
  const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vmax));
    _mm512_mask_storeu_ps(s + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(s + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i), inv));
  }
}

GEMSTAGE_AVX512F float dot(const float* a, const float* b, int64_t n) {
  // Two accumulators hide the FMA latency for the 256/512-wide heads that dominate.
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

GEMSTAGE_AVX512F void axpy(float a, const float* x, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 r =
        _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, r);
  }
}

namespace {

GEMSTAGE_AVX512F inline __mmask16 lanes_left(int64_t n) {
  return n <= 0 ? static_cast<__mmask16>(0) : tail_mask(n);
}

// Lanes m of a row as f32: f32 rows load directly, bf16 bits widen exactly. The masked 16-bit
// load needs AVX-512BW, so a partial bf16 vector (only an odd head_dim's tail) goes through a
// zero-padded copy. m is always a low-lanes mask.
GEMSTAGE_AVX512F inline __m512 load_lanes(__mmask16 m, const float* p) {
  return _mm512_maskz_loadu_ps(m, p);
}
GEMSTAGE_AVX512F inline __m512 load_lanes(__mmask16 m, const uint16_t* p) {
  __m256i h;
  if (m == static_cast<__mmask16>(0xffff)) {
    h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    alignas(32) uint16_t t[16] = {};
    std::memcpy(t, p, static_cast<size_t>(__builtin_popcount(m)) * sizeof(uint16_t));
    h = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
  }
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lanes d..d+15 of a row (d a multiple of 16), through the overloads above for f32 and bf16 rows;
// a q8_0 row's 16 codes widen to f32 and take their block's scale, its f16 bits converted by
// VCVTPH2PS (AVX-512F). hd is a multiple of 32 on q8_0 rows, so the lanes are always whole.
GEMSTAGE_AVX512F inline __m512 load_at(__mmask16 m, const float* p, int64_t d) {
  return load_lanes(m, p + d);
}
GEMSTAGE_AVX512F inline __m512 load_at(__mmask16 m, const uint16_t* p, int64_t d) {
  return load_lanes(m, p + d);
}
GEMSTAGE_AVX512F inline __m512 load_at(__mmask16, const KvQ8Block* p, int64_t d) {
  const KvQ8Block& b = p[d / kKvQ8Values];
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q + d % kKvQ8Values));
  const __m512 scale = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(b.d)));
  return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
}
// The byte offset whose crossing of a 64-byte line a tile prefetches at: a q8_0 row's bytes run
// 17/16 of its values, rounded down here to whole lines of values (the last line of a long row is
// left to the hardware prefetcher).
template <typename T>
int64_t prefetch_offset(int64_t d) {
  if constexpr (std::is_same_v<T, KvQ8Block>)
    return d;
  else
    return d * static_cast<int64_t>(sizeof(T));
}

// Two vectors (32 columns) of each of NG queries stay in registers across all nk value rows.
template <int NG, typename T>
GEMSTAGE_AVX512F void accumulate_values_n(const float* p, int64_t pstride, const T* const* v,
                                          int64_t nk, int64_t hd, float* const* out) {
  for (int64_t d = 0; d < hd; d += 32) {
    const __mmask16 m0 = lanes_left(hd - d), m1 = lanes_left(hd - d - 16);
    __m512 a0[NG], a1[NG];
    for (int g = 0; g < NG; ++g) {
      a0[g] = _mm512_maskz_loadu_ps(m0, out[g] + d);
      a1[g] = _mm512_maskz_loadu_ps(m1, out[g] + d + 16);
    }
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 v0 = load_at(m0, v[j], d), v1 = load_at(m1, v[j], d + 16);
      for (int g = 0; g < NG; ++g) {
        const __m512 s = _mm512_set1_ps(p[g * pstride + j]);
        a0[g] = _mm512_fmadd_ps(s, v0, a0[g]);
        a1[g] = _mm512_fmadd_ps(s, v1, a1[g]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm512_mask_storeu_ps(out[g] + d, m0, a0[g]);
      _mm512_mask_storeu_ps(out[g] + d + 16, m1, a1[g]);
    }
  }
}

// Horizontal sums of 16 accumulators a[4k + q] (query q, key k) in one vector, element 4q + k:
// three rounds of lane shuffles and adds instead of 16 separate reductions.
GEMSTAGE_AVX512F inline __m512 reduce_4x4(const __m512* a) {
  __m512 c[8], e[4];
  for (int i = 0; i < 8; ++i)  // 512 -> 256: [a(L0+L2), a(L1+L3), b(L0+L2), b(L1+L3)]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 256 -> 128: 128-bit lane L of e[i] holds a[4i + L]
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  // 128 -> 32 inside each 128-bit lane: element 4L + i becomes the total of a[4i + L].
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(e[0], e[1]), _mm512_unpackhi_ps(e[0], e[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(e[2], e[3]), _mm512_unpackhi_ps(e[2], e[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// A 4 x 4 score tile prefetches four keys of the next block (x86/tile_prefetch.h).
using TilePrefetch = x86::TilePrefetch<4>;

// s[(m0 + i) * ss + j0 + j] = q[m0 + i] · k[j0 + j] for the 4x4 tile at (m0, j0). Past the last
// query or key the tile repeats the last one, and those sums are not stored.
template <typename T>
GEMSTAGE_AVX512F void score_tile(const float* const* q, int64_t M, int64_t m0, const T* const* k,
                                 int64_t nk, int64_t j0, int64_t hd, float* s, int64_t ss,
                                 const TilePrefetch& pf) {
  const float* qp[4];
  const T* kp[4];
  for (int i = 0; i < 4; ++i) {
    qp[i] = q[std::min<int64_t>(m0 + i, M - 1)];
    kp[i] = k[std::min<int64_t>(j0 + i, nk - 1)];
  }
  // Sixteen named accumulators, not an array: GCC keeps a 1 KiB array of vectors on the stack
  // and stores every accumulator back to it in each iteration (measured 2x slower).
  const __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;  // a<key><query>
  __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
  for (int64_t d = 0; d < hd; d += 16) {
    pf.line(prefetch_offset<T>(d));
    const __mmask16 m = tail_mask(hd - d);
    const __m512 q0 = _mm512_maskz_loadu_ps(m, qp[0] + d), q1 = _mm512_maskz_loadu_ps(m, qp[1] + d);
    const __m512 q2 = _mm512_maskz_loadu_ps(m, qp[2] + d), q3 = _mm512_maskz_loadu_ps(m, qp[3] + d);
    __m512 kv = load_at(m, kp[0], d);
    a00 = _mm512_fmadd_ps(q0, kv, a00);
    a01 = _mm512_fmadd_ps(q1, kv, a01);
    a02 = _mm512_fmadd_ps(q2, kv, a02);
    a03 = _mm512_fmadd_ps(q3, kv, a03);
    kv = load_at(m, kp[1], d);
    a10 = _mm512_fmadd_ps(q0, kv, a10);
    a11 = _mm512_fmadd_ps(q1, kv, a11);
    a12 = _mm512_fmadd_ps(q2, kv, a12);
    a13 = _mm512_fmadd_ps(q3, kv, a13);
    kv = load_at(m, kp[2], d);
    a20 = _mm512_fmadd_ps(q0, kv, a20);
    a21 = _mm512_fmadd_ps(q1, kv, a21);
    a22 = _mm512_fmadd_ps(q2, kv, a22);
    a23 = _mm512_fmadd_ps(q3, kv, a23);
    kv = load_at(m, kp[3], d);
    a30 = _mm512_fmadd_ps(q0, kv, a30);
    a31 = _mm512_fmadd_ps(q1, kv, a31);
    a32 = _mm512_fmadd_ps(q2, kv, a32);
    a33 = _mm512_fmadd_ps(q3, kv, a33);
  }
  const __m512 acc[16] = {a00, a01, a02, a03, a10, a11, a12, a13,
                          a20, a21, a22, a23, a30, a31, a32, a33};
  alignas(64) float t[16];
  _mm512_store_ps(t, reduce_4x4(acc));
  const int64_t nq = std::min<int64_t>(4, M - m0), nkk = std::min<int64_t>(4, nk - j0);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nkk; ++j) s[(m0 + i) * ss + j0 + j] = t[4 * i + j];
}

// Lanes base..base+15 that fall inside [a, b].
GEMSTAGE_AVX512F inline __mmask16 range_mask(int64_t a, int64_t b, int64_t base) {
  const int64_t lo = std::clamp<int64_t>(a - base, 0, 16),
                hi = std::clamp<int64_t>(b - base + 1, 0, 16);
  if (lo >= hi) return 0;
  const uint32_t upto_hi = hi == 16 ? 0xffffu : (1u << hi) - 1u;
  return static_cast<__mmask16>(upto_hi & ~((1u << lo) - 1u));
}

// The G heads in groups of at most 8 (what fits in registers): f.template operator()<NG>(g0) for
// each group starting at head g0, NG a compile-time count.
template <typename F>
void for_head_groups(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    switch (std::min<int64_t>(G - g0, 8)) {
      case 1:
        f.template operator()<1>(g0);
        break;
      case 2:
        f.template operator()<2>(g0);
        break;
      case 3:
        f.template operator()<3>(g0);
        break;
      case 4:
        f.template operator()<4>(g0);
        break;
      case 5:
        f.template operator()<5>(g0);
        break;
      case 6:
        f.template operator()<6>(g0);
        break;
      case 7:
        f.template operator()<7>(g0);
        break;
      default:
        f.template operator()<8>(g0);
        break;
    }
  }
}

}  // namespace

namespace {

// Turns the block's scores into p = exp(s - max) (0 where the key is masked) while updating each
// query's running max and sum and rescaling its output.
GEMSTAGE_AVX512F void softmax_update(float* const* out, const int64_t* lo, const int64_t* hi,
                                     int64_t M, int64_t hd, int64_t nk, int64_t first,
                                     float* scores, int64_t ss, float* max, float* sum) {
  for (int64_t m = 0; m < M; ++m) {
    const int64_t a = std::max<int64_t>(lo[m] - first, 0),
                  b = std::min<int64_t>(hi[m] - first, nk - 1);
    float* row = scores + m * ss;
    if (a > b) {  // nothing visible in this block: p = 0, the running state stays
      for (int64_t j = 0; j < nk; j += 16)
        _mm512_mask_storeu_ps(row + j, tail_mask(nk - j), _mm512_setzero_ps());
      continue;
    }
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < nk; j += 16) {
      const __mmask16 vis = range_mask(a, b, j);
      mx = _mm512_mask_max_ps(mx, vis, mx, _mm512_maskz_loadu_ps(vis, row + j));
    }
    const float new_max = std::max(max[m], _mm512_reduce_max_ps(mx));
    const float scale = std::exp(max[m] - new_max);  // 0 for the first visible block
    const __m512 vmax = _mm512_set1_ps(new_max);
    __m512 added = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j += 16) {
      const __mmask16 vis = range_mask(a, b, j);
      const __m512 p = _mm512_maskz_mov_ps(
          vis, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(vis, row + j), vmax)));
      _mm512_mask_storeu_ps(row + j, tail_mask(nk - j), p);
      added = _mm512_add_ps(added, p);
    }
    sum[m] = sum[m] * scale + _mm512_reduce_add_ps(added);
    max[m] = new_max;
    if (scale != 1.0f) {
      const __m512 vs = _mm512_set1_ps(scale);
      float* o = out[m];
      for (int64_t d = 0; d < hd; d += 16) {
        const __mmask16 t = tail_mask(hd - d);
        _mm512_mask_storeu_ps(o + d, t, _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(t, o + d)));
      }
    }
  }
}

template <typename T>
void key_block(const float* const* q, float* const* out, const int64_t* lo, const int64_t* hi,
               int64_t M, int64_t hd, const T* const* k, const T* const* v, int64_t nk,
               int64_t first, float* scores, int64_t ss, float* max, float* sum,
               const T* const* next_k, const T* const* next_v, int64_t next_n) {
  for (int64_t m0 = 0; m0 < M; m0 += 4)  // the first row of tiles prefetches the next block
    for (int64_t j0 = 0; j0 < nk; j0 += 4)
      score_tile(q, M, m0, k, nk, j0, hd, scores, ss,
                 TilePrefetch(next_k, next_v, m0 == 0 ? next_n : 0, j0, k, nk));
  softmax_update(out, lo, hi, M, hd, nk, first, scores, ss, max, sum);
  for_head_groups(M, [&]<int NG>(int64_t g0) {
    accumulate_values_n<NG>(scores + g0 * ss, ss, v, nk, hd, out + g0);
  });
}

}  // namespace

void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const float* const* k,
                      const float* const* v, int64_t nk, int64_t first, float* scores, int64_t ss,
                      float* max, float* sum, const float* const* next_k,
                      const float* const* next_v, int64_t next_n) {
  key_block(q, out, lo, hi, M, hd, k, v, nk, first, scores, ss, max, sum, next_k, next_v, next_n);
}

void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const uint16_t* const* k,
                      const uint16_t* const* v, int64_t nk, int64_t first, float* scores,
                      int64_t ss, float* max, float* sum, const uint16_t* const* next_k,
                      const uint16_t* const* next_v, int64_t next_n) {
  key_block(q, out, lo, hi, M, hd, k, v, nk, first, scores, ss, max, sum, next_k, next_v, next_n);
}

void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const KvQ8Block* const* k,
                      const KvQ8Block* const* v, int64_t nk, int64_t first, float* scores,
                      int64_t ss, float* max, float* sum, const KvQ8Block* const* next_k,
                      const KvQ8Block* const* next_v, int64_t next_n) {
  key_block(q, out, lo, hi, M, hd, k, v, nk, first, scores, ss, max, sum, next_k, next_v, next_n);
}

}  // namespace gemstage::avx512

#endif  // x86
