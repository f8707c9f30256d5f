#include "kernels/x86/vec_avx2.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/x86/tile_prefetch.h"

#define GEMSTAGE_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace gemstage::avx2 {

namespace {

// Lanes [0, n) of an 8-float vector as a VMASKMOV mask (all lanes when n >= 8).
GEMSTAGE_AVX2 inline __m256i tail_mask(int64_t n) {
  const int c = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
GEMSTAGE_AVX2 inline __m256 load(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(n));
}
GEMSTAGE_AVX2 inline void store(float* p, int64_t n, __m256 v) {
  if (n >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, tail_mask(n), v);
}
// bf16 bit patterns widen exactly; a partial vector goes through a zero-padded copy.
GEMSTAGE_AVX2 inline __m256 load(const uint16_t* p, int64_t n) {
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t t[8] = {};
    std::memcpy(t, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(uint16_t));
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Values d..d+n-1 of a row (n <= 8): f32 and bf16 rows as above; a q8_0 row's codes widen and
// take their block's scale (F16C converts its f16 bits). hd is a multiple of 32 on q8_0 rows, so
// its vectors are always whole.
GEMSTAGE_AVX2 inline __m256 load_at(const float* p, int64_t d, int64_t n) {
  return load(p + d, n);
}
GEMSTAGE_AVX2 inline __m256 load_at(const uint16_t* p, int64_t d, int64_t n) {
  return load(p + d, n);
}
GEMSTAGE_AVX2 inline __m256 load_at(const KvQ8Block* p, int64_t d, int64_t) {
  const KvQ8Block& b = p[d / kKvQ8Values];
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.q + d % kKvQ8Values));
  return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(b.d)),
                       _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
}
// The byte offset a tile's prefetches follow: a q8_0 row's bytes run 17/16 of its values,
// rounded down to its values here (the hardware prefetcher takes the last line of a long row).
template <typename T>
int64_t prefetch_offset(int64_t d) {
  if constexpr (std::is_same_v<T, KvQ8Block>)
    return d;
  else
    return d * static_cast<int64_t>(sizeof(T));
}

GEMSTAGE_AVX2 inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
GEMSTAGE_AVX2 inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// As avx512's exp_ps: Cody-Waite reduction and a degree-7 polynomial. AVX2 has no VSCALEFPS, so
// 2^n is applied as two exponent-field products 2^(n/2) * 2^(n - n/2), each a normal float for
// n in [-150, 128]: results below FLT_MIN underflow gradually to 0 as std::exp does.
GEMSTAGE_AVX2 inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.7f), x);  // constant first: a NaN in x comes through
  x = _mm256_max_ps(_mm256_set1_ps(-103.9f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

GEMSTAGE_AVX2 inline __m256 tanh_ps(__m256 u) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign_bit, u);
  const __m256 u2 = _mm256_mul_ps(u, u);
  __m256 p = _mm256_set1_ps(62.0f / 2835.0f);
  p = _mm256_fmadd_ps(p, u2, _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_fmadd_ps(p, u2, _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_fmadd_ps(p, u2, _mm256_set1_ps(-1.0f / 3.0f));
  p = _mm256_mul_ps(p, u2);
  const __m256 small = _mm256_fmadd_ps(p, u, u);
  const __m256 e = exp_ps(_mm256_add_ps(a, a));
  const __m256 big =
      _mm256_sub_ps(_mm256_set1_ps(1.0f),
                    _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  const __m256 big_signed = _mm256_or_ps(big, _mm256_and_ps(u, sign_bit));
  const __m256 is_small = _mm256_cmp_ps(a, _mm256_set1_ps(0.3f), _CMP_LT_OQ);
  return _mm256_blendv_ps(big_signed, small, is_small);
}

GEMSTAGE_AVX2 inline __m256 gelu_tanh_ps(__m256 x) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  const __m256 half_x = _mm256_mul_ps(_mm256_set1_ps(0.5f), x);
  return _mm256_fmadd_ps(half_x, tanh_ps(inner), half_x);
}

}  // namespace

GEMSTAGE_AVX2 void scale_row(const float* x, float inv, const float* w, int64_t n, float* y) {
  const __m256 s = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = _mm256_mul_ps(load(x + i, n - i), s);
    if (w) v = _mm256_mul_ps(v, load(w + i, n - i));
    store(y + i, n - i, v);
  }
}

GEMSTAGE_AVX2 void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8)
    store(out + i, n - i, _mm256_mul_ps(gelu_tanh_ps(load(gate + i, n - i)), load(up + i, n - i)));
}

GEMSTAGE_AVX2 void softcap(float* x, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  for (int64_t i = 0; i < n; i += 8)
    store(x + i, n - i, _mm256_mul_ps(c, tanh_ps(_mm256_div_ps(load(x + i, n - i), c))));
}

GEMSTAGE_AVX2 void softmax_inplace(float* s, int64_t n) {
  if (n <= 0) return;
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mx = ninf;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v =
        _mm256_blendv_ps(ninf, load(s + i, n - i), _mm256_castsi256_ps(tail_mask(n - i)));
    mx = _mm256_max_ps(mx, v);
  }
  const __m256 vmax = _mm256_set1_ps(hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 keep = _mm256_castsi256_ps(tail_mask(n - i));
    const __m256 e = _mm256_and_ps(keep, exp_ps(_mm256_sub_ps(load(s + i, n - i), vmax)));
    store(s + i, n - i, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
  for (int64_t i = 0; i < n; i += 8) store(s + i, n - i, _mm256_mul_ps(load(s + i, n - i), inv));
}

namespace {

template <typename T>
GEMSTAGE_AVX2 inline float dot_t(const float* a, const T* b, int64_t n) {
  // Two accumulators hide the FMA latency.
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load(b + i, 8), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load(b + i + 8, 8), s1);
  }
  for (; i < n; i += 8) s0 = _mm256_fmadd_ps(load(a + i, n - i), load(b + i, n - i), s0);
  return hsum(_mm256_add_ps(s0, s1));
}

}  // namespace

GEMSTAGE_AVX2 float dot(const float* a, const float* b, int64_t n) {
  return dot_t(a, b, n);
}

GEMSTAGE_AVX2 void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  for (int64_t i = 0; i < n; i += 8)
    store(y + i, n - i, _mm256_fmadd_ps(va, load(x + i, n - i), load(y + i, n - i)));
}

namespace {

// Up to 4 queries' outputs, one 16-column slice at a time, stay in registers across all nk value
// rows: each value vector is loaded once per slice and used by every query of the group. kFull:
// the slice has all 16 columns, so its loads and stores carry no tail checks (GCC kept the
// checks' lengths in registers and spilled the queries' p-row pointers for them).
template <int NG, bool kFull, typename T>
GEMSTAGE_AVX2 inline void accumulate_slice(const float* p, int64_t pstride, const T* const* v,
                                           int64_t nk, int64_t d, int64_t hd, float* const* out) {
  const int64_t n0 = kFull ? 8 : hd - d, n1 = kFull ? 8 : hd - d - 8;
  const float* pg[NG];
  for (int g = 0; g < NG; ++g) pg[g] = p + g * pstride;
  __m256 a0[NG], a1[NG];
  for (int g = 0; g < NG; ++g) {
    a0[g] = load(out[g] + d, n0);
    a1[g] = n1 > 0 ? load(out[g] + d + 8, n1) : _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 v0 = load_at(v[j], d, n0);
    const __m256 v1 = n1 > 0 ? load_at(v[j], d + 8, n1) : _mm256_setzero_ps();
    for (int g = 0; g < NG; ++g) {
      const __m256 s = _mm256_broadcast_ss(pg[g] + j);
      a0[g] = _mm256_fmadd_ps(s, v0, a0[g]);
      a1[g] = _mm256_fmadd_ps(s, v1, a1[g]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    store(out[g] + d, n0, a0[g]);
    if (n1 > 0) store(out[g] + d + 8, n1, a1[g]);
  }
}

template <int NG, typename T>
GEMSTAGE_AVX2 void accumulate_values(const float* p, int64_t pstride, const T* const* v, int64_t nk,
                                     int64_t hd, float* const* out) {
  int64_t d = 0;
  for (; d + 16 <= hd; d += 16) accumulate_slice<NG, true>(p, pstride, v, nk, d, hd, out);
  if (d < hd) accumulate_slice<NG, false>(p, pstride, v, nk, d, hd, out);
}

// The eight sums of a[0..7] in one vector, in order: two rounds of pairwise horizontal adds
// inside each 128-bit lane, then the two lanes added.
GEMSTAGE_AVX2 inline __m256 reduce_8(const __m256 (&a)[8]) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  // h0123 lane L: partial sums of a0..a3 over lane L; likewise h4567 for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// A 4 x 2 score tile prefetches two keys of the next block (x86/tile_prefetch.h).
using TilePrefetch = x86::TilePrefetch<2>;

// s[(m0 + i) * ss + j0 + j] = q[m0 + i] · k[j0 + j] for the 4 x 2 tile at (m0, j0): each key
// vector (widening bf16 keys is much of a step's work) serves four queries and each query vector
// two keys, and the eight sums are reduced together. It replaced a 2 x 1 tile with a horizontal
// sum per score: E2B's full-layer decode shape (8 heads, 4096 bf16 keys of 512) took 2.6-3.0 ms,
// now 1.4-1.8 (bench BM_Attention, avx2 tier, 2-core Xeon). Past the last query or key the tile
// repeats the last one, and those sums are not stored.
// kFull: hd is a whole number of 8-lane vectors (every Gemma 4 head), so the loads carry no
// tail checks.
template <bool kFull, typename T>
GEMSTAGE_AVX2 void score_tile(const float* const* q, int64_t M, int64_t m0, const T* const* k,
                              int64_t nk, int64_t j0, int64_t hd, float* s, int64_t ss,
                              const TilePrefetch& pf) {
  const float* qp[4];
  for (int i = 0; i < 4; ++i) qp[i] = q[std::min<int64_t>(m0 + i, M - 1)];
  const T* k0 = k[std::min<int64_t>(j0, nk - 1)];
  const T* k1 = k[std::min<int64_t>(j0 + 1, nk - 1)];
  // Named accumulators: GCC spills an array of vectors to the stack every iteration.
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;  // a<key><query>
  for (int64_t d = 0; d < hd; d += 8) {
    pf.line(prefetch_offset<T>(d));
    const int64_t n = kFull ? 8 : hd - d;
    const __m256 q0 = load(qp[0] + d, n), q1 = load(qp[1] + d, n);
    const __m256 q2 = load(qp[2] + d, n), q3 = load(qp[3] + d, n);
    __m256 kv = load_at(k0, d, n);
    a00 = _mm256_fmadd_ps(q0, kv, a00);
    a01 = _mm256_fmadd_ps(q1, kv, a01);
    a02 = _mm256_fmadd_ps(q2, kv, a02);
    a03 = _mm256_fmadd_ps(q3, kv, a03);
    kv = load_at(k1, d, n);
    a10 = _mm256_fmadd_ps(q0, kv, a10);
    a11 = _mm256_fmadd_ps(q1, kv, a11);
    a12 = _mm256_fmadd_ps(q2, kv, a12);
    a13 = _mm256_fmadd_ps(q3, kv, a13);
  }
  const __m256 acc[8] = {a00, a10, a01, a11, a02, a12, a03, a13};  // query-major
  alignas(32) float t[8];
  _mm256_store_ps(t, reduce_8(acc));
  const int64_t nq = std::min<int64_t>(4, M - m0), nkk = std::min<int64_t>(2, nk - j0);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nkk; ++j) s[(m0 + i) * ss + j0 + j] = t[2 * i + j];
}

template <typename T>
GEMSTAGE_AVX2 void key_block(const float* const* q, float* const* out, const int64_t* lo,
                             const int64_t* hi, int64_t M, int64_t hd, const T* const* k,
                             const T* const* v, int64_t nk, int64_t first, float* scores,
                             int64_t ss, float* max, float* sum, const T* const* next_k,
                             const T* const* next_v, int64_t next_n) {
  // Scores of every (query, key) pair; masked ones are overwritten by the softmax pass below.
  // The first row of tiles prefetches the next block.
  const bool full = hd % 8 == 0;
  for (int64_t m0 = 0; m0 < M; m0 += 4)
    for (int64_t j0 = 0; j0 < nk; j0 += 2) {
      const TilePrefetch pf(next_k, next_v, m0 == 0 ? next_n : 0, j0, k, nk);
      if (full)
        score_tile<true>(q, M, m0, k, nk, j0, hd, scores, ss, pf);
      else
        score_tile<false>(q, M, m0, k, nk, j0, hd, scores, ss, pf);
    }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t a = std::max<int64_t>(lo[m] - first, 0),
                  b = std::min<int64_t>(hi[m] - first, nk - 1);
    float* row = scores + m * ss;
    if (a > b) {  // nothing visible in this block: p = 0, the running state stays
      std::fill_n(row, nk, 0.0f);
      continue;
    }
    float block_max = -INFINITY;
    for (int64_t j = a; j <= b; ++j) block_max = std::max(block_max, row[j]);
    const float new_max = std::max(max[m], block_max);
    const float scale = std::exp(max[m] - new_max);  // 0 for the first visible block
    std::fill_n(row, a, 0.0f);
    std::fill(row + b + 1, row + nk, 0.0f);
    const __m256 vmax = _mm256_set1_ps(new_max);
    __m256 added = _mm256_setzero_ps();
    for (int64_t j = a; j <= b; j += 8) {
      const int64_t n = b + 1 - j;
      const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(tail_mask(n)),
                                     exp_ps(_mm256_sub_ps(load(row + j, n), vmax)));
      store(row + j, n, e);
      added = _mm256_add_ps(added, e);
    }
    sum[m] = sum[m] * scale + hsum(added);
    max[m] = new_max;
    if (scale != 1.0f) {
      const __m256 vs = _mm256_set1_ps(scale);
      for (int64_t d = 0; d < hd; d += 8)
        store(out[m] + d, hd - d, _mm256_mul_ps(vs, load(out[m] + d, hd - d)));
    }
  }
  for (int64_t g0 = 0; g0 < M; g0 += 4) {
    const float* p = scores + g0 * ss;
    switch (std::min<int64_t>(M - g0, 4)) {
      case 1:
        accumulate_values<1>(p, ss, v, nk, hd, out + g0);
        break;
      case 2:
        accumulate_values<2>(p, ss, v, nk, hd, out + g0);
        break;
      case 3:
        accumulate_values<3>(p, ss, v, nk, hd, out + g0);
        break;
      default:
        accumulate_values<4>(p, ss, v, nk, hd, out + g0);
        break;
    }
  }
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

}  // namespace gemstage::avx2

#endif  // x86
