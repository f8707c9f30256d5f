// y = x * W^T on AVX2 (VPMADDUBSW, 8 lanes = half a chunk) for Q8_0 / Q4_0 weights in their
// stored, chunk-interleaved form (kernels/quant.h). Q8_0 uses the sign trick (|q|, sign(x, q)), so
// its activations carry no zero-point term. Prefill keeps a 4 x 2 tile (tile_avx2); the decode
// GEMV (gemv_avx2) walks the rows one at a time with the same prefetch as the VNNI one. The 1 x 4
// tile it replaced read four row streams without prefetch and reached ~45% of the VNNI GEMV's
// GB/s on the Zen 4 VM; gemv_avx2 measured at or above the VNNI GEMV there (bench/RESULTS.md).
//
// The prefill tile is bound by its vector ALU ports: per half chunk and (row, weight row) pair,
// 8 VPMADDUBSW and 8 int16 adds, 5 ops to widen, convert and scale, and 1.5 of the 4 x 2 tile's
// shared nibble unpacking. Written so GCC keeps the accumulators in registers (whole chunks on
// their own path, see fold_half; pin_in_registers), it measured 1.25-1.45x its first form on the
// 2-core Xeon (bench/RESULTS.md, 2026-12-07, Intel Xeon); AVX-VNNI's VPDPBUSD in place of the
// multiply-add pairs measured no faster, its 5-cycle latency chaining the 8 accumulators.
#include "kernels/x86/quant_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/quant.h"
#include "kernels/x86/avx2_sum.h"

namespace gemstage::avx2 {

namespace {

constexpr int64_t kQB = kQuantBlock;
constexpr int64_t kCB = kQuantChunkBlocks;

#define GEMSTAGE_AVX2 __attribute__((target("avx2,fma,f16c")))

// The same codes as quantize_act_row, 8 lanes at a time (VCVTPS2DQ rounds like nearbyint).
GEMSTAGE_AVX2 void quantize_act_row_impl(const float* x, int64_t K, int z, uint8_t* q, float* d,
                                         int32_t* nzx) {
  const int64_t nb = K / kQB;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  // packs interleaves the four 8-lane vectors by 128-bit lane; this puts the codes back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * kQB + 8 * i);
    __m256 m =
        _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q),
                                                _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                                   _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q),
                                                _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
    const bool nan = _mm256_movemask_ps(un) != 0;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = nan ? NAN : amax / 127.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 p = _mm256_mul_ps(v[i], idv);
      // A NaN product (a NaN or infinite input) is code 0, as in the scalar twin.
      const __m256i ci = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(p), lo), hi);
      c[i] = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)), ci);
    }
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    nzx[b] = -z * _mm_cvtsi128_si32(s4);
    const __m256i codes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
    alignas(32) uint8_t bytes[kQB];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), codes);
    const int64_t ch = b / kCB, i = b % kCB, mb = std::min(kCB, nb - ch * kCB);
    uint8_t* base = q + ch * 512 + 4 * i;
    for (int j = 0; j < 8; ++j) std::memcpy(base + j * 4 * mb, bytes + 4 * j, 4);
  }
}

// `bytes` (<= 32) bytes from p, zero-filled: full loads for whole halves, a copy for tails.
GEMSTAGE_AVX2 inline __m256i load_part(const void* p, int bytes) {
  if (bytes == 32) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint8_t buf[32] = {};
  std::memcpy(buf, p, static_cast<size_t>(bytes));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}

template <bool kFull>
GEMSTAGE_AVX2 inline __m256i load_half(const uint8_t* p, int lb) {
  return kFull ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : load_part(p, lb);
}

// An empty asm that takes every accumulator of a tile as a register operand. GCC 12 schedules an
// unrolled tile's loads and products ahead of their uses and, with more values live than the 16
// ymm registers hold, spills accumulators and carries them through the stack from one group to
// the next. Requiring them in registers at each group's end keeps them there; the VPMADDUBSW
// rows ran 20-45% faster in a standalone copy of the tile on the 2-core Xeon.
template <int NX, int NW>
GEMSTAGE_AVX2 inline void pin_in_registers(__m256i (&v)[NX][NW]) {
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) __asm__("" : "+x"(v[a][w]));
}

// The integer dots of one half chunk (8 blocks, one int32 lane each) for an NX x NW tile:
// D[a][w] lane i = -z * sum(x) + dot of block i of activation row a and weight row w. kFull is the
// common case (the half has all 8 blocks): whole-vector loads and no per-load branch, which let
// the compiler keep the tile's accumulators in registers; the tail halves of a row's last chunk
// take the zero-filling loads.
template <DType T, int NX, int NW, bool kFull>
GEMSTAGE_AVX2 inline void half_tile(const uint8_t* const* xq, const uint8_t* const* wq,
                                    const int32_t* const* nzx, int64_t gs, int lb,
                                    __m256i (&D)[NX][NW]) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  if constexpr (T == DType::Q4_0) {
    // A VPMADDUBSW lane holds u0 x0 + u1 x1 with u <= 15, |x| <= 127 (<= 3810); the eight of a
    // half sum to <= 30480 < 2^15, so the whole half accumulates in int16 and widens once. Low
    // nibbles, then high ones, so that only NW unpacked weight vectors are live beside the NX x NW
    // accumulators.
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    __m256i s16[NX][NW];
    for (int a = 0; a < NX; ++a)
      for (int w = 0; w < NW; ++w) s16[a][w] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      for (int hi = 0; hi < 2; ++hi) {
        __m256i wv[NW];
        for (int w = 0; w < NW; ++w) {
          const __m256i pv = load_half<kFull>(wq[w] + g * gs, lb);
          wv[w] = _mm256_and_si256(hi ? _mm256_srli_epi16(pv, 4) : pv, lo4);
        }
        for (int a = 0; a < NX; ++a) {
          const __m256i xv = load_half<kFull>(xq[a] + (2 * g + hi) * gs, lb);
          for (int w = 0; w < NW; ++w)
            s16[a][w] = _mm256_add_epi16(s16[a][w], _mm256_maddubs_epi16(wv[w], xv));
        }
        pin_in_registers(s16);
      }
    }
    for (int a = 0; a < NX; ++a) {
      const __m256i init = load_half<kFull>(reinterpret_cast<const uint8_t*>(nzx[a]), lb);
      for (int w = 0; w < NW; ++w)
        D[a][w] = _mm256_add_epi32(_mm256_madd_epi16(s16[a][w], ones16), init);
    }
  } else {
    // Signed q = u - 128 by the sign trick; a pair sum reaches 2 * 127 * 127, so each group
    // widens to int32 on its own.
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int a = 0; a < NX; ++a) {
      const __m256i init = load_half<kFull>(reinterpret_cast<const uint8_t*>(nzx[a]), lb);
      for (int w = 0; w < NW; ++w) D[a][w] = init;
    }
    for (int j = 0; j < 8; ++j) {
      __m256i qa[NW], qs[NW];  // |q| and q's sign pattern
      for (int w = 0; w < NW; ++w) {
        qs[w] = _mm256_xor_si256(load_half<kFull>(wq[w] + j * gs, lb), bias);
        qa[w] = _mm256_sign_epi8(qs[w], qs[w]);
      }
      for (int a = 0; a < NX; ++a) {
        const __m256i xv = load_half<kFull>(xq[a] + j * gs, lb);
        for (int w = 0; w < NW; ++w) {
          const __m256i p = _mm256_maddubs_epi16(qa[w], _mm256_sign_epi8(xv, qs[w]));
          D[a][w] = _mm256_add_epi32(D[a][w], _mm256_madd_epi16(p, ones16));
        }
      }
      pin_in_registers(D);
    }
  }
}

// Folds one half's integer dots into the f32 accumulators: one convert, one scale product and
// one FMA per (row, weight row). kFull: all 8 blocks of the half are there (whole-vector loads).
template <DType T, int NX, int NW, bool kFull>
GEMSTAGE_AVX2 inline void fold_half(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                    int64_t c, int64_t h, int64_t m, __m256 (&facc)[NX][NW]) {
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  const int64_t K = A.K, nb = A.nb, gs = 4 * m, b0 = c * kCB + 8 * h;
  const int64_t L = std::min<int64_t>(8, m - 8 * h);
  const int lb = static_cast<int>(4 * L);
  const uint8_t* xq[NX];
  const uint8_t* wq[NW];
  const int32_t* nzx[NX];
  for (int a = 0; a < NX; ++a) {
    xq[a] = A.q.data() + srow[a] * K + c * 512 + 32 * h;
    nzx[a] = A.nzx.data() + srow[a] * nb + b0;
  }
  for (int w = 0; w < NW; ++w) wq[w] = wrow[w] + 2 * nb + c * chunk_bytes + 32 * h;
  __m256i D[NX][NW];
  half_tile<T, NX, NW, kFull>(xq, wq, nzx, gs, lb, D);
  __m256 dw[NW];
  for (int w = 0; w < NW; ++w) {
    if constexpr (kFull) {
      dw[w] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow[w] + 2 * b0)));
    } else {
      alignas(16) uint16_t hs[8] = {};
      std::memcpy(hs, wrow[w] + 2 * b0, static_cast<size_t>(2 * L));
      dw[w] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hs)));
    }
  }
  for (int a = 0; a < NX; ++a) {
    const __m256 dx = _mm256_castsi256_ps(
        load_half<kFull>(reinterpret_cast<const uint8_t*>(A.d.data() + srow[a] * nb + b0), lb));
    for (int w = 0; w < NW; ++w)
      facc[a][w] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(D[a][w]), _mm256_mul_ps(dw[w], dx), facc[a][w]);
  }
}

// One (NX activation rows x NW weight rows) tile over the whole input width: per half chunk the
// integer dots (half_tile) folded into f32 accumulators (fold_half), halves in order (the decode
// GEMV's order, so its outputs are bit-identical to a prefill's). Whole chunks take the kFull
// path; only a row's short last chunk takes the zero-filling one.
template <DType T, int NX, int NW>
GEMSTAGE_AVX2 void tile_avx2(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                             float* out) {
  const int64_t nb = A.nb, full = nb / kCB;
  __m256 facc[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) facc[a][w] = _mm256_setzero_ps();
  for (int64_t c = 0; c < full; ++c) {
    fold_half<T, NX, NW, true>(A, srow, wrow, c, 0, kCB, facc);
    fold_half<T, NX, NW, true>(A, srow, wrow, c, 1, kCB, facc);
  }
  if (const int64_t m = nb - full * kCB; m > 0) {
    if (m >= 8) {
      fold_half<T, NX, NW, true>(A, srow, wrow, full, 0, m, facc);
    } else {
      fold_half<T, NX, NW, false>(A, srow, wrow, full, 0, m, facc);
    }
    if (m > 8) fold_half<T, NX, NW, false>(A, srow, wrow, full, 1, m, facc);
  }
  if constexpr (NX * NW == 8) {
    _mm256_storeu_ps(out, x86::hsum_hadd_8(&facc[0][0]));  // out[a * NW + w], in that order
  } else {
    for (int a = 0; a < NX; ++a)
      for (int w = 0; w < NW; ++w) out[a * NW + w] = x86::hsum_hadd(facc[a][w]);
  }
}

// The decode GEMV's integer dots of half a chunk: the 1 x 1 tile of half_tile, with the -z*sum(x)
// term (lanes past the half's L blocks are 0 when kFull is false).
template <DType T, bool kFull>
GEMSTAGE_AVX2 inline __m256i row_half_dot(const uint8_t* wq, const uint8_t* xq, const int32_t* nzx,
                                          int64_t gs, int lb) {
  __m256i D[1][1];
  half_tile<T, 1, 1, kFull>(&xq, &wq, &nzx, gs, lb, D);
  return D[0][0];
}

// Decode GEMV: weight rows [r0, r1) against activation row 0, one row at a time in address
// order, whole chunks per step, prefetching kDecodePrefetch ahead like the VNNI decode tile.
template <DType T>
GEMSTAGE_AVX2 void gemv_avx2(const ActQ& A, const uint8_t* wdata, size_t row_bytes, float* y,
                             int64_t r0, int64_t r1) {
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  const int64_t nb = A.nb, n_chunks = (nb + kCB - 1) / kCB;
  const uint8_t* xq = A.q.data();
  const float* dx = A.d.data();
  const int32_t* nzx = A.nzx.data();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wrow = wdata + static_cast<size_t>(r) * row_bytes;
    const uint8_t* wq = wrow + 2 * nb;
    const char* ahead = reinterpret_cast<const char*>(wrow) + kDecodePrefetch;
    // One accumulator, the halves in order: the prefill tile's summation order, so a decoded
    // token's outputs are bit-identical to the same row recomputed in a prefill.
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < n_chunks; ++c) {
      // Prefetches never fault, so running past the end of the mapping is harmless.
      const size_t lo =
          (row_bytes * static_cast<size_t>(c) / static_cast<size_t>(n_chunks)) & ~size_t{63};
      const size_t hi = row_bytes * static_cast<size_t>(c + 1) / static_cast<size_t>(n_chunks);
      for (size_t o = lo; o < hi; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T2);
      const int64_t b0 = c * kCB, m = std::min(kCB, nb - b0);
      const uint8_t* wc = wq + c * chunk_bytes;
      const uint8_t* xc = xq + c * 512;
      if (m == kCB) {
        const __m256i d0 = row_half_dot<T, true>(wc, xc, nzx + b0, 64, 32);
        const __m256i d1 = row_half_dot<T, true>(wc + 32, xc + 32, nzx + b0 + 8, 64, 32);
        const __m256 s0 =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + 2 * b0)));
        const __m256 s1 =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + 2 * b0 + 16)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(s0, _mm256_loadu_ps(dx + b0)),
                              acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1),
                              _mm256_mul_ps(s1, _mm256_loadu_ps(dx + b0 + 8)), acc);
        continue;
      }
      for (int64_t h = 0; h < 2; ++h) {  // the row's short last chunk, half by half
        const int64_t L = std::min<int64_t>(8, m - 8 * h);
        if (L <= 0) break;
        const int lb = static_cast<int>(4 * L);
        const int64_t bh = b0 + 8 * h;
        const __m256i dh = row_half_dot<T, false>(wc + 32 * h, xc + 32 * h, nzx + bh, 4 * m, lb);
        alignas(16) uint16_t hs[8] = {};
        std::memcpy(hs, wrow + 2 * bh, static_cast<size_t>(2 * L));
        const __m256 sh = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hs)));
        const __m256 xs = _mm256_castsi256_ps(load_part(dx + bh, lb));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_mul_ps(sh, xs), acc);
      }
    }
    y[r] = x86::hsum_hadd(acc);
  }
}

template <DType T>
struct Avx2Tiles {
  static constexpr int NW = 2;
  static constexpr bool kWeightsPastRows = true;
  template <int NX>
  GEMSTAGE_AVX2 static void run(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                float* out) {
    tile_avx2<T, NX, NW>(A, srow, wrow, out);
  }
};

template <DType T>
GEMSTAGE_AVX2 void rows_avx2(const ActQ& A, int64_t S, const uint8_t* wdata, size_t row_bytes,
                             int64_t N, float* y, int64_t r0, int64_t r1) {
  if (S == 1) return gemv_avx2<T>(A, wdata, row_bytes, y, r0, r1);
  prefill_tiles<Avx2Tiles<T>>(A, S, wdata, row_bytes, N, y, r0, r1);
}

}  // namespace

void quantize_act_row(const float* x, int64_t K, int z, uint8_t* q, float* d, int32_t* nzx) {
  quantize_act_row_impl(x, K, z, q, d, nzx);
}

QuantRowsFn quant_rows(DType t) {
  return t == DType::Q8_0 ? rows_avx2<DType::Q8_0> : rows_avx2<DType::Q4_0>;
}

}  // namespace gemstage::avx2
