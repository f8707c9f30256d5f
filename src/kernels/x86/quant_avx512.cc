// y = x * W^T on AVX-512 VNNI for Q8_0 / Q4_0 weights in their stored, chunk-interleaved form
// (kernels/quant.h), from activations quantized with the zero-point term (kernels/quant_kernels.h).
//
// With the interleaving, int32 lane i of a VPDPBUSD accumulator is block i of the chunk: 8
// VPDPBUSD per 16 blocks per (weight row, activation row) (Q4_0: after 4 loads and 12 AND/shift
// unpack ops per weight row, shared by the activation rows), then one convert, one scale product
// and one FMA per chunk; the -z*sum(xq) term seeds the int32 accumulator. Register blocking:
// decode (S = 1, and up to kStreamMaxRows rows of a batched decode step) walks the weight rows in
// address order, prefetching ahead (see kDecodePrefetch); prefill keeps a 4 x 4 tile (each
// unpacked weight vector is used by 4 activation rows, each activation vector by 4 weight rows).
//
// GCC 12 reports false "uninitialized" warnings inside its own AVX-512 intrinsic headers.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "kernels/x86/quant_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "kernels/quant.h"

namespace gemstage::avx512 {

namespace {

constexpr int64_t kQB = kQuantBlock;
constexpr int64_t kCB = kQuantChunkBlocks;

#define GEMSTAGE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// The same codes as quantize_act_row (VCVTPS2DQ rounds to nearest even, like nearbyint).
GEMSTAGE_VNNI void quantize_act_row_impl(const float* x, int64_t K, int z, uint8_t* q, float* d,
                                         int32_t* nzx) {
  const int64_t nb = K / kQB;
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kQB), v1 = _mm512_loadu_ps(x + b * kQB + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const bool nan =
        (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = nan ? NAN : amax / 127.0f;
    const __m512 idv = _mm512_set1_ps(id);
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv)),
            i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
    i0 = _mm512_min_epi32(_mm512_max_epi32(i0, lo), hi);
    i1 = _mm512_min_epi32(_mm512_max_epi32(i1, lo), hi);
    nzx[b] = -z * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    alignas(32) uint8_t codes[kQB];
    _mm_store_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(i0));
    _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtepi32_epi8(i1));
    const int64_t c = b / kCB, i = b % kCB, m = std::min(kCB, nb - c * kCB);
    uint8_t* base = q + c * 512 + 4 * i;
    for (int j = 0; j < 8; ++j) std::memcpy(base + j * 4 * m, codes + 4 * j, 4);
  }
}

// One chunk (m blocks) of NX activation rows x NW weight rows into int32 accumulators.
//
// A 1 x 1 tile (the decode GEMV) splits its accumulator into 4 chains, summed at the end: with one,
// its 8 VPDPBUSD per chunk wait on each other (about 5 cycles apiece on Zen 4) and the GEMV read
// ~33 GB/s where the AVX2 one reads the bandwidth (46-50 GB/s, LM-head shape, 2 threads). Integer
// sums are exact in any order, so the output is bit-identical. Tiles of 2 to 4 (row, row) pairs
// (the batched decode's 2-4 x 1) split theirs in two; larger tiles have enough chains already.
template <DType T, int NX, int NW, bool kTail>
GEMSTAGE_VNNI inline void chunk_vnni(const uint8_t* const* wq, const uint8_t* const* xq, int64_t m,
                                     __mmask16 mk, __m512i (&D)[NX][NW]) {
  const int64_t gs = kTail ? 4 * m : 64;  // group stride in bytes
  constexpr int kChains = NX * NW == 1 ? 4 : NX * NW <= 4 ? 2 : 1;
  __m512i P[kChains][NX][NW];
  for (int k = 0; k < kChains; ++k)
    for (int a = 0; a < NX; ++a)
      for (int w = 0; w < NW; ++w) P[k][a][w] = k == 0 ? D[a][w] : _mm512_setzero_si512();
#define ld(p) (kTail ? _mm512_maskz_loadu_epi32(mk, (p)) : _mm512_loadu_si512((p)))
  if constexpr (T == DType::Q8_0) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[NW];
      for (int w = 0; w < NW; ++w) wv[w] = ld(wq[w] + j * gs);
      for (int a = 0; a < NX; ++a) {
        const __m512i xv = ld(xq[a] + j * gs);
        for (int w = 0; w < NW; ++w)
          P[j % kChains][a][w] = _mm512_dpbusd_epi32(P[j % kChains][a][w], wv[w], xv);
      }
    }
  } else {
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      __m512i wl[NW], wh[NW];
      for (int w = 0; w < NW; ++w) {
        const __m512i pv = ld(wq[w] + g * gs);
        wl[w] = _mm512_and_si512(pv, lo4);
        wh[w] = _mm512_and_si512(_mm512_srli_epi16(pv, 4), lo4);
      }
      const int kl = (2 * g) % kChains, kh = (2 * g + 1) % kChains;
      for (int a = 0; a < NX; ++a) {
        const __m512i xl = ld(xq[a] + (2 * g) * gs), xh = ld(xq[a] + (2 * g + 1) * gs);
        for (int w = 0; w < NW; ++w) {
          P[kl][a][w] = _mm512_dpbusd_epi32(P[kl][a][w], wl[w], xl);
          P[kh][a][w] = _mm512_dpbusd_epi32(P[kh][a][w], wh[w], xh);
        }
      }
    }
  }
#undef ld
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) {
      __m512i sum = P[0][a][w];
      for (int k = 1; k < kChains; ++k) sum = _mm512_add_epi32(sum, P[k][a][w]);
      D[a][w] = sum;
    }
}

// The 16 sums of a 4 x 4 tile's accumulators, lane a * 4 + w = _mm512_reduce_add_ps(v[a][w])
// bit for bit: the same additions of the same lanes (GCC's reduce adds the upper 256 bits to the
// lower, then the upper 128 of that to the lower, then lanes 2-3 to 0-1, then lane 1 to 0), done
// for all 16 vectors at once by pairing them at each step. 46 instructions where 16 separate
// reductions take about 130, which for a 1536-wide input (3 chunks a tile) was about a tenth of
// the tile's work; and the decode GEMV, which reduces one vector alone, still agrees with it.
GEMSTAGE_VNNI inline __m512 reduce_add_4x4(const __m512 (&v)[4][4]) {
  __m512 l1[8], l2[4], l3[2];
  for (int p = 0; p < 8; ++p) {  // lanes 0-7: vector 2p's 8 sums, 8-15: vector 2p + 1's
    const __m512 x = v[p / 2][2 * (p % 2)], y = v[p / 2][2 * (p % 2) + 1];
    l1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)),
                          _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  for (int p = 0; p < 4; ++p)  // 128-bit lane q: vector 4p + q's 4 sums
    l2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * p], l1[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                          _mm512_shuffle_f32x4(l1[2 * p], l1[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int p = 0; p < 2; ++p)  // in lane q: two sums of vector 8p + q, then of 8p + 4 + q
    l3[p] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * p], l2[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                          _mm512_shuffle_ps(l2[2 * p], l2[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  // Lane 4q + k: the sum of vector 4k + q.
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i to_rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(to_rows, r);
}

// Folds chunk c (m blocks) of the tile into its f32 accumulators: the integer dots seeded with
// the -z*sum(xq) term, then one convert, one scale product and one FMA per (row, weight row).
// Whole chunks (kTail false) and a row's short last chunk are separate instances, so the whole
// chunks' loads carry no mask and their accumulators stay in registers.
template <DType T, int NX, int NW, bool kTail>
GEMSTAGE_VNNI inline void fold_chunk(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                     int64_t c, int64_t m, __m512 (&facc)[NX][NW]) {
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  const int64_t K = A.K, nb = A.nb, b0 = c * kCB;
  const __mmask16 mk = static_cast<__mmask16>(kTail ? (1u << m) - 1u : 0xffffu);
  const uint8_t* wq[NW];
  const uint8_t* xq[NX];
  for (int w = 0; w < NW; ++w) wq[w] = wrow[w] + 2 * nb + c * chunk_bytes;
  __m512i D[NX][NW];
  for (int a = 0; a < NX; ++a) {
    xq[a] = A.q.data() + srow[a] * K + c * 512;
    const int32_t* nzx = A.nzx.data() + srow[a] * nb + b0;
    const __m512i init = kTail ? _mm512_maskz_loadu_epi32(mk, nzx) : _mm512_loadu_si512(nzx);
    for (int w = 0; w < NW; ++w) D[a][w] = init;
  }
  chunk_vnni<T, NX, NW, kTail>(wq, xq, m, mk, D);
  __m512 dw[NW];
  for (int w = 0; w < NW; ++w) {
    const uint8_t* d = wrow[w] + 2 * b0;
    dw[w] = _mm512_cvtph_ps(kTail ? _mm256_maskz_loadu_epi16(mk, d)
                                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
  }
  for (int a = 0; a < NX; ++a) {
    const float* d = A.d.data() + srow[a] * nb + b0;
    const __m512 dx = kTail ? _mm512_maskz_loadu_ps(mk, d) : _mm512_loadu_ps(d);
    for (int w = 0; w < NW; ++w)
      facc[a][w] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(D[a][w]), _mm512_mul_ps(dw[w], dx), facc[a][w]);
  }
}

// out[a*NW + w] = dot(activation row srow[a], weight row wrow[w]). With kPrefetch the NW rows
// must be consecutive (one span of NW * row_bytes) and the span kDecodePrefetch ahead is
// prefetched as the chunks advance.
template <DType T, int NX, int NW, bool kPrefetch = false>
GEMSTAGE_VNNI void tile_vnni(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                             float* out, size_t row_bytes = 0) {
  const int64_t nb = A.nb;
  const int64_t n_chunks = (nb + kCB - 1) / kCB;
  const size_t span = NW * row_bytes;
  // The span is prefetched in equal 64-byte-aligned steps, one per chunk (one division per call:
  // two per chunk cost about as much as the chunk's 8 VPDPBUSD of a cache-resident GEMV).
  const size_t pf_step = kPrefetch ? (span / static_cast<size_t>(n_chunks) + 63) & ~size_t{63} : 0;
  __m512 facc[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) facc[a][w] = _mm512_setzero_ps();
  for (int64_t c = 0; c * kCB < nb; ++c) {
    const int64_t m = std::min(kCB, nb - c * kCB);
    if constexpr (kPrefetch) {
      // Prefetches never fault, so running past the end of the mapping is harmless. A tile of
      // NW > 1 rows reads NW streams a row apart, so kDecodePrefetch past its first row's start
      // lands inside its own later rows, which it then reads before the prefetch has arrived;
      // it prefetches the next tile instead, kDecodePrefetch past its start. The 31B MLP at 4
      // verify rows from DRAM (bench VerifyRowsDram): 1.27-1.47x -> 1.15-1.41x the one-row time,
      // and a 31B verify call of 3-4 rows 1.3-1.4 -> 1.1-1.3 plain steps (bench/RESULTS.md).
      const size_t distance = NW == 1 ? kDecodePrefetch : span + kDecodePrefetch;
      const char* ahead = reinterpret_cast<const char*>(wrow[0]) + distance;
      const size_t lo = pf_step * static_cast<size_t>(c);
      const size_t hi = std::min(span, lo + pf_step);
      for (size_t o = lo; o < hi; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T2);
    }
    if (m == kCB) {
      fold_chunk<T, NX, NW, false>(A, srow, wrow, c, m, facc);
    } else {
      fold_chunk<T, NX, NW, true>(A, srow, wrow, c, m, facc);
    }
  }
  if constexpr (NX == 4 && NW == 4) {
    _mm512_storeu_ps(out, reduce_add_4x4(facc));
  } else {
    for (int a = 0; a < NX; ++a)
      for (int w = 0; w < NW; ++w) out[a * NW + w] = _mm512_reduce_add_ps(facc[a][w]);
  }
}

template <DType T>
struct VnniTiles {
  static constexpr int NW = 4;
  static constexpr bool kWeightsPastRows = false;  // measured with the first order only
  template <int NX>
  GEMSTAGE_VNNI static void run(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                float* out) {
    tile_vnni<T, NX, NW>(A, srow, wrow, out);
  }
};

// Decode-sized calls (S <= kStreamMaxRows: one row per sequence of a batched decode step, or a
// speculative round's verify rows) stream the weights in address order with the decode
// prefetch, as the S = 1 GEMV does. The 4 x 4 prefill tiles read four rows at once with no
// prefetch and halved the bandwidth: on the 2-core Xeon the Q4_0 LM head (226 MB) took 1.9x,
// 2.2x and 3.6x the one-row time for 2, 4 and 8 rows (bench "BatchedDecode").
// For S >= 2 four consecutive weight rows (one prefetched span) meet the activation rows at
// once, so each activation vector serves four weight rows. One weight row at a time re-read the
// whole quantized activation block per row: at 31B's down projection (input 21504) four rows'
// codes are 86 KB, past L1, and the call took 3.2x the one-row time; with four weight rows at a
// time 1.9x. E2B's gate projection at S = 4: 414-519 -> 293 us (bench/RESULTS.md,
// 2026-12-06). Outputs are unchanged: each (row, weight row) pair sums exactly as before.
template <DType T, int NX>
GEMSTAGE_VNNI void stream_rows_vnni(const ActQ& A, const uint8_t* wdata, size_t row_bytes,
                                    int64_t N, float* y, int64_t r0, int64_t r1) {
  static constexpr int64_t kRows[kStreamMaxRows] = {0, 1, 2, 3, 4, 5, 6, 7};
  constexpr int NW = NX == 1 ? 1 : 4;  // weight rows per tile
  constexpr int NA = NX > 4 ? 4 : NX;  // activation rows of the streamed tile; the rest from L1
  float out[4 * 4];
  int64_t r = r0;
  if constexpr (NW > 1) {
    for (; r + NW <= r1; r += NW) {
      const uint8_t* wrow[NW];
      for (int w = 0; w < NW; ++w) wrow[w] = wdata + static_cast<size_t>(r + w) * row_bytes;
      tile_vnni<T, NA, NW, true>(A, kRows, wrow, out, row_bytes);
      for (int a = 0; a < NA; ++a)
        for (int w = 0; w < NW; ++w) y[a * N + r + w] = out[a * NW + w];
      if constexpr (NX > 4) {
        tile_vnni<T, NX - 4, NW>(A, kRows + 4, wrow, out);
        for (int a = 0; a < NX - 4; ++a)
          for (int w = 0; w < NW; ++w) y[(4 + a) * N + r + w] = out[a * NW + w];
      }
    }
  }
  for (; r < r1; ++r) {
    const uint8_t* wrow = wdata + static_cast<size_t>(r) * row_bytes;
    tile_vnni<T, NX, 1, true>(A, kRows, &wrow, out, row_bytes);
    for (int a = 0; a < NX; ++a) y[a * N + r] = out[a];
  }
}

// stream_rows_vnni<T, 1> ... <T, kStreamMaxRows>, indexed by S - 1.
template <DType T, size_t... I>
constexpr auto stream_rows_table(std::index_sequence<I...>) {
  return std::array{&stream_rows_vnni<T, static_cast<int>(I) + 1>...};
}

template <DType T>
GEMSTAGE_VNNI void rows_vnni(const ActQ& A, int64_t S, const uint8_t* wdata, size_t row_bytes,
                             int64_t N, float* y, int64_t r0, int64_t r1) {
  if (S <= kStreamMaxRows) {  // decode (S = 1) and batched decode steps
    static constexpr auto kStream =
        stream_rows_table<T>(std::make_index_sequence<kStreamMaxRows>());
    return kStream[static_cast<size_t>(S - 1)](A, wdata, row_bytes, N, y, r0, r1);
  }
  prefill_tiles<VnniTiles<T>>(A, S, wdata, row_bytes, N, y, r0, r1);
}

}  // namespace

void quantize_act_row(const float* x, int64_t K, int z, uint8_t* q, float* d, int32_t* nzx) {
  quantize_act_row_impl(x, K, z, q, d, nzx);
}

QuantRowsFn quant_rows(DType t) {
  return t == DType::Q8_0 ? rows_vnni<DType::Q8_0> : rows_vnni<DType::Q4_0>;
}

}  // namespace gemstage::avx512
