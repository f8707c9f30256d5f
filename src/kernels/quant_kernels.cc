// y = x * W^T for Q8_0 / Q4_0 weights, consumed in their stored, chunk-interleaved form.
//
// Every call first quantizes the activation rows per block of 32 (f32 scale dx = max|x| / 127,
// int8 codes xq) into the same interleaved order as a Q8_0 row, plus per block the integer
// -z * sum(xq) (z = the weight format's zero point). A block's contribution is then
//     d * dx * ( sum(u * xq) - z * sum(xq) )          (exact in int32)
// and with the interleaving, int32 lane i of a VPDPBUSD accumulator is block i of the chunk:
// 8 VPDPBUSD per 16 blocks per (weight row, activation row) (Q4_0: after 4 loads and 12
// AND/shift unpack ops per weight row, shared by the activation rows), then one convert, one
// scale product and one FMA per chunk; the -z*sum(xq) term seeds the int32 accumulator. Register
// blocking: decode (S = 1, and on VNNI up to kStreamMaxRows rows of a batched decode step) walks
// the weight rows one at a time in address order, prefetching ahead (see kDecodePrefetch);
// prefill keeps a 4 x 4 tile (each unpacked weight vector is used by 4
// activation rows, each activation vector by 4 weight rows). The AVX2 tier (VPMADDUBSW, 8
// lanes = half a chunk) keeps a 4 x 2 tile for prefill (tile_avx2); its decode GEMV (gemv_avx2)
// walks the rows one at a time with the same prefetch as the VNNI one. The 1 x 4 tile it
// replaced read four row streams without prefetch and reached ~45% of the VNNI GEMV's GB/s on
// the Zen 4 VM; gemv_avx2 measured at or above the VNNI GEMV there (bench/RESULTS.md).
//
#if defined(__x86_64__) || defined(__i386__)
// GCC 12 reports false "uninitialized" warnings inside its own AVX-512 intrinsic headers.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/amx.h"
#include "kernels/cpu_features.h"
#include "kernels/quant.h"

namespace gemstage {

namespace {

constexpr int64_t kQB = kQuantBlock;
constexpr int64_t kCB = kQuantChunkBlocks;

int zero_point(DType t) {
  return t == DType::Q8_0 ? 128 : 8;
}

// Quantized activations: row s has K codes at q + s*K (interleaved like a Q8_0 row's quant
// section, or natural order for the scalar path), nb scales at d + s*nb and nb corrections
// -z*sum(xq) at nzx + s*nb.
struct ActQ {
  int64_t K = 0, nb = 0;
  std::vector<uint8_t> q;
  std::vector<float> d;
  std::vector<int32_t> nzx;
};

void quantize_act_row(const float* x, int64_t K, int z, bool interleave, uint8_t* q, float* d,
                      int32_t* nzx) {
  const int64_t nb = K / kQB;
  int8_t codes[kQB];
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQB;
    float amax = 0.0f;
    bool nan = false;
    for (int e = 0; e < kQB; ++e) {
      amax = std::max(amax, std::fabs(xb[e]));
      nan = nan || std::isnan(xb[e]);
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = nan ? NAN : amax / 127.0f;
    int sum = 0;
    for (int e = 0; e < kQB; ++e) {
      // NaN/Inf activations give NaN scales and so NaN outputs, as a float matmul would.
      const float v = std::clamp(std::nearbyint(xb[e] * id), -127.0f, 127.0f);
      codes[e] = static_cast<int8_t>(std::isnan(v) ? 0.0f : v);
      sum += codes[e];
    }
    nzx[b] = -z * sum;
    if (!interleave) {
      std::memcpy(q + b * kQB, codes, kQB);
      continue;
    }
    const int64_t c = b / kCB, i = b % kCB, m = std::min(kCB, nb - c * kCB);
    uint8_t* base = q + c * 512 + 4 * i;
    for (int j = 0; j < 8; ++j) std::memcpy(base + j * 4 * m, codes + 4 * j, 4);
  }
}

#if defined(__x86_64__) || defined(__i386__)
#define GEMSTAGE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// The same codes as quantize_act_row (VCVTPS2DQ rounds to nearest even, like nearbyint).
GEMSTAGE_VNNI void quantize_act_row_avx512(const float* x, int64_t K, int z, uint8_t* q, float* d,
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

// The same codes as quantize_act_row, 8 lanes at a time (VCVTPS2DQ rounds like nearbyint).
__attribute__((target("avx2,fma,f16c"))) void quantize_act_row_avx2(const float* x, int64_t K,
                                                                    int z, uint8_t* q, float* d,
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

#endif  // x86

// use_vnni: quantize with the AVX-512 twin (the VNNI kernels' callers only).
void quantize_acts(ThreadPool& pool, const float* x, int64_t S, int64_t K, int z, bool interleave,
                   [[maybe_unused]] bool use_vnni, ActQ* a) {
#if defined(__x86_64__) || defined(__i386__)
  const bool use_avx2 = interleave && !use_vnni && cpu_tier_at_least(CpuTier::Avx2);
#endif
  a->K = K;
  a->nb = K / kQB;
  a->q.resize(static_cast<size_t>(S * K));
  a->d.resize(static_cast<size_t>(S * a->nb));
  a->nzx.resize(static_cast<size_t>(S * a->nb));
  auto run = [&](size_t b, size_t e) {
    for (size_t s = b; s < e; ++s) {
      const int64_t si = static_cast<int64_t>(s);
#if defined(__x86_64__) || defined(__i386__)
      if (interleave && use_vnni) {
        quantize_act_row_avx512(x + si * K, K, z, a->q.data() + si * K, a->d.data() + si * a->nb,
                                a->nzx.data() + si * a->nb);
        continue;
      }
      if (use_avx2) {
        quantize_act_row_avx2(x + si * K, K, z, a->q.data() + si * K, a->d.data() + si * a->nb,
                              a->nzx.data() + si * a->nb);
        continue;
      }
#endif
      quantize_act_row(x + si * K, K, z, interleave, a->q.data() + si * K, a->d.data() + si * a->nb,
                       a->nzx.data() + si * a->nb);
    }
  };
  if (S < 8)
    run(0, static_cast<size_t>(S));
  else
    pool.parallel_for(static_cast<size_t>(S), run, 4);
}

// ---- scalar: unpack a row to (u - z) in natural order, integer block dots ---------------------

void rows_scalar(DType t, const ActQ& a, int64_t S, const uint8_t* wdata, size_t row_bytes,
                 int64_t N, float* y, int64_t r0, int64_t r1) {
  const int64_t K = a.K, nb = a.nb;
  std::vector<float> wf(static_cast<size_t>(K));
  std::vector<int8_t> wq(static_cast<size_t>(K));
  std::vector<float> dw(static_cast<size_t>(nb));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = wdata + static_cast<size_t>(r) * row_bytes;
    dequantize_row(t, row, K, wf.data());
    for (int64_t b = 0; b < nb; ++b) {
      dw[static_cast<size_t>(b)] = quant_block_scale(t, row, K, b);
      const float inv = dw[static_cast<size_t>(b)] != 0.0f ? 1.0f / dw[static_cast<size_t>(b)] : 0;
      // w^ / d is the exact small integer u - z.
      for (int64_t e = b * kQB; e < (b + 1) * kQB; ++e)
        wq[static_cast<size_t>(e)] =
            static_cast<int8_t>(std::nearbyint(wf[static_cast<size_t>(e)] * inv));
    }
    for (int64_t s = 0; s < S; ++s) {
      const int8_t* xq = reinterpret_cast<const int8_t*>(a.q.data()) + s * K;
      const float* dx = a.d.data() + s * nb;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t e = b * kQB; e < (b + 1) * kQB; ++e)
          dot += static_cast<int32_t>(wq[static_cast<size_t>(e)]) * xq[e];
        acc += dw[static_cast<size_t>(b)] * dx[b] * static_cast<float>(dot);
      }
      y[s * N + r] = acc;
    }
  }
}

// ---- prefill loop order, shared by every SIMD tier -------------------------------------------
//
// Every activation row meets every weight row. Walking all S rows per strip of NW weight rows
// streamed the whole quantized activation matrix (S x K bytes: 786 KB for a 512-row prompt of
// width 1536, 3 MB at width 6144) through the caches once per strip. Instead the rows are walked
// in blocks of about kActBlockBytes of codes, which stay in L2 while the thread's weight rows
// stream past each block; the weights are re-read once per block, far below the tile's compute
// rate. Measured on the Zen 4 VM (bench/RESULTS.md): VNNI pp512 +15-20%.
constexpr int64_t kActBlockBytes = int64_t{256} << 10;

// On the VNNI kernels, calls of at most this many activation rows (a batched decode step) stream
// the weights as decode does (see stream_rows_vnni) and are scheduled like it. The AVX2 kernels
// keep their prefill tiles: streamed 1 x NX tiles measured no faster there (they are bound by the
// maddubs arithmetic, 55-85 GFLOP/s on 2 Xeon cores, at every S from 1 to 16).
constexpr int64_t kStreamMaxRows = 8;

// Whole 4-row tiles per block, at least one.
inline int64_t activation_block_rows(int64_t K) {
  return std::max<int64_t>(4, kActBlockBytes / K / 4 * 4);
}

// Tiles: a struct with NW (weight rows per tile) and run<NX>(A, srow, wrow, out) writing
// out[a * NW + w] = dot(activation row srow[a], weight row wrow[w]) for NX = 1..4.
template <class Tiles>
void prefill_tiles(const ActQ& A, int64_t S, const uint8_t* wdata, size_t row_bytes, int64_t N,
                   float* y, int64_t r0, int64_t r1) {
  constexpr int NW = Tiles::NW;
  float out[4 * NW];
  const int64_t block = activation_block_rows(A.K);
  for (int64_t s0 = 0; s0 < S; s0 += block) {
    const int64_t s1 = std::min(S, s0 + block);
    for (int64_t r = r0; r < r1; r += NW) {
      const int nw = static_cast<int>(std::min<int64_t>(NW, r1 - r));
      const uint8_t* wrow[NW];
      for (int w = 0; w < NW; ++w)
        wrow[w] = wdata + static_cast<size_t>(r + std::min(w, nw - 1)) * row_bytes;
      for (int64_t s = s0; s < s1;) {
        const int nx = static_cast<int>(std::min<int64_t>(4, s1 - s));
        const int64_t srow[4] = {s, s + 1, s + 2, s + 3};
        switch (nx) {
          case 4:
            Tiles::template run<4>(A, srow, wrow, out);
            break;
          case 3:
            Tiles::template run<3>(A, srow, wrow, out);
            break;
          case 2:
            Tiles::template run<2>(A, srow, wrow, out);
            break;
          default:
            Tiles::template run<1>(A, srow, wrow, out);
            break;
        }
        for (int a = 0; a < nx; ++a)
          for (int w = 0; w < nw; ++w) y[(s + a) * N + r + w] = out[a * NW + w];
        s += nx;
      }
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
// ---- AVX-512 VNNI -----------------------------------------------------------------------------

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

// Decode streams every weight byte once from DRAM. The hardware prefetchers alone leave the GEMV
// at ~60% of the measured read bandwidth (they stop at 4 KiB pages and lag the demand stream), so
// the decode tile asks for the bytes kDecodePrefetch ahead into L2, spread over its chunks.
// Measured on the 2-core Xeon: 1-4 KiB ahead all reach ~95% of the read bandwidth; 4 KiB is
// kept so each prefetch lands one page ahead of the demand loads.
constexpr size_t kDecodePrefetch = 4096;

// out[a*NW + w] = dot(activation row srow[a], weight row wrow[w]). With kPrefetch the NW rows
// must be consecutive (one span of NW * row_bytes) and the span kDecodePrefetch ahead is
// prefetched as the chunks advance.
template <DType T, int NX, int NW, bool kPrefetch = false>
GEMSTAGE_VNNI void tile_vnni(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                             float* out, size_t row_bytes = 0) {
  const int64_t K = A.K, nb = A.nb;
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  const int64_t n_chunks = (nb + kCB - 1) / kCB;
  const size_t span = NW * row_bytes;
  // The span is prefetched in equal 64-byte-aligned steps, one per chunk (one division per call:
  // two per chunk cost about as much as the chunk's 8 VPDPBUSD of a cache-resident GEMV).
  const size_t pf_step = kPrefetch ? (span / static_cast<size_t>(n_chunks) + 63) & ~size_t{63} : 0;
  __m512 facc[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) facc[a][w] = _mm512_setzero_ps();
  for (int64_t c = 0; c * kCB < nb; ++c) {
    const int64_t b0 = c * kCB, m = std::min(kCB, nb - b0);
    if constexpr (kPrefetch) {
      // Prefetches never fault, so running past the end of the mapping is harmless.
      const char* ahead = reinterpret_cast<const char*>(wrow[0]) + kDecodePrefetch;
      const size_t lo = pf_step * static_cast<size_t>(c);
      const size_t hi = std::min(span, lo + pf_step);
      for (size_t o = lo; o < hi; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T2);
    }
    const __mmask16 mk = static_cast<__mmask16>(m == 16 ? 0xffffu : (1u << m) - 1u);
    const uint8_t* wq[NW];
    const uint8_t* xq[NX];
    for (int w = 0; w < NW; ++w) wq[w] = wrow[w] + 2 * nb + c * chunk_bytes;
    __m512i D[NX][NW];
    for (int a = 0; a < NX; ++a) {
      xq[a] = A.q.data() + srow[a] * K + c * 512;
      const __m512i init = _mm512_maskz_loadu_epi32(mk, A.nzx.data() + srow[a] * nb + b0);
      for (int w = 0; w < NW; ++w) D[a][w] = init;
    }
    if (m == kCB)
      chunk_vnni<T, NX, NW, false>(wq, xq, m, mk, D);
    else
      chunk_vnni<T, NX, NW, true>(wq, xq, m, mk, D);
    __m512 dw[NW];
    for (int w = 0; w < NW; ++w)
      dw[w] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, wrow[w] + 2 * b0));
    for (int a = 0; a < NX; ++a) {
      const __m512 dx = _mm512_maskz_loadu_ps(mk, A.d.data() + srow[a] * nb + b0);
      for (int w = 0; w < NW; ++w)
        facc[a][w] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(D[a][w]), _mm512_mul_ps(dw[w], dx), facc[a][w]);
    }
  }
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) out[a * NW + w] = _mm512_reduce_add_ps(facc[a][w]);
}

template <DType T>
struct VnniTiles {
  static constexpr int NW = 4;
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
// time 1.9x. E2B's gate projection at S = 4: 414-519 -> 293 us (bench/RESULTS.md, tenth
// session). Outputs are unchanged: each (row, weight row) pair sums exactly as before.
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

// ---- AVX2 (maddubs): 8 lanes = half a chunk; Q8_0 uses the sign trick (|q|, sign(x, q)) ------

#define GEMSTAGE_AVX2 __attribute__((target("avx2,fma,f16c")))

// `bytes` (<= 32) bytes from p, zero-filled: full loads for whole halves, a copy for tails.
GEMSTAGE_AVX2 inline __m256i load_part(const void* p, int bytes) {
  if (bytes == 32) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint8_t buf[32] = {};
  std::memcpy(buf, p, static_cast<size_t>(bytes));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}

GEMSTAGE_AVX2 inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// One (NX activation rows x NW weight rows) tile over the whole input width. Per half chunk
// (8 blocks, one int32 lane each) the NX * NW int32 accumulators stay in registers while every
// unpacked weight vector is used by NX activation rows and every activation vector by NW weight
// rows; then one convert, one scale product and one FMA per (row, weight row) fold the half into
// f32 accumulators. The 4 x 2 prefill tile keeps 8 accumulators, 4 unpacked weight vectors and
// the activation pair in the 16 ymm registers (4 x 4 spilled and measured slower).
template <DType T, int NX, int NW>
GEMSTAGE_AVX2 void tile_avx2(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                             float* out) {
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  const int64_t K = A.K, nb = A.nb;
  const __m256i ones16 = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0f);
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 facc[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) facc[a][w] = _mm256_setzero_ps();
  for (int64_t c = 0; c * kCB < nb; ++c) {
    const int64_t m = std::min(kCB, nb - c * kCB), gs = 4 * m;
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t L = std::min<int64_t>(8, m - 8 * h);
      if (L <= 0) break;
      const int lb = static_cast<int>(4 * L);
      const int64_t b0 = c * kCB + 8 * h;
      const uint8_t* xq[NX];
      const uint8_t* wq[NW];
      __m256i D[NX][NW];
      for (int a = 0; a < NX; ++a) {
        xq[a] = A.q.data() + srow[a] * K + c * 512 + 32 * h;
        const __m256i init = load_part(A.nzx.data() + srow[a] * nb + b0, lb);
        for (int w = 0; w < NW; ++w) D[a][w] = init;
      }
      for (int w = 0; w < NW; ++w) wq[w] = wrow[w] + 2 * nb + c * chunk_bytes + 32 * h;
      if constexpr (T == DType::Q8_0) {
        for (int j = 0; j < 8; ++j) {
          __m256i qa[NW], qs[NW];  // |q| and q's sign pattern
          for (int w = 0; w < NW; ++w) {
            qs[w] = _mm256_xor_si256(load_part(wq[w] + j * gs, lb), bias);
            qa[w] = _mm256_sign_epi8(qs[w], qs[w]);
          }
          for (int a = 0; a < NX; ++a) {
            const __m256i xv = load_part(xq[a] + j * gs, lb);
            for (int w = 0; w < NW; ++w) {
              const __m256i p = _mm256_maddubs_epi16(qa[w], _mm256_sign_epi8(xv, qs[w]));
              D[a][w] = _mm256_add_epi32(D[a][w], _mm256_madd_epi16(p, ones16));
            }
          }
        }
      } else {
        for (int g = 0; g < 4; ++g) {
          __m256i wl[NW], wh[NW];
          for (int w = 0; w < NW; ++w) {
            const __m256i pv = load_part(wq[w] + g * gs, lb);
            wl[w] = _mm256_and_si256(pv, lo4);
            wh[w] = _mm256_and_si256(_mm256_srli_epi16(pv, 4), lo4);
          }
          for (int a = 0; a < NX; ++a) {
            const __m256i xl = load_part(xq[a] + 2 * g * gs, lb),
                          xh = load_part(xq[a] + (2 * g + 1) * gs, lb);
            for (int w = 0; w < NW; ++w) {
              // u <= 15 and |xq| <= 127: the two int16 pair sums stay below 2^15.
              const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wl[w], xl),
                                                 _mm256_maddubs_epi16(wh[w], xh));
              D[a][w] = _mm256_add_epi32(D[a][w], _mm256_madd_epi16(p, ones16));
            }
          }
        }
      }
      __m256 dw[NW];
      for (int w = 0; w < NW; ++w) {
        if (L == 8) {
          dw[w] =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow[w] + 2 * b0)));
        } else {
          alignas(16) uint16_t hs[8] = {};
          std::memcpy(hs, wrow[w] + 2 * b0, static_cast<size_t>(2 * L));
          dw[w] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hs)));
        }
      }
      for (int a = 0; a < NX; ++a) {
        const __m256 dx = _mm256_castsi256_ps(load_part(A.d.data() + srow[a] * nb + b0, lb));
        for (int w = 0; w < NW; ++w)
          facc[a][w] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(D[a][w]), _mm256_mul_ps(dw[w], dx), facc[a][w]);
      }
    }
  }
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) out[a * NW + w] = hsum8(facc[a][w]);
}

template <bool kFull>
GEMSTAGE_AVX2 inline __m256i load_half(const uint8_t* p, int lb) {
  return kFull ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : load_part(p, lb);
}

// Integer dots of half a chunk of one weight row with one activation row: int32 lane i is block
// i of the half (lanes past the half's L blocks are 0 when kFull is false). gs is the chunk's
// group stride (4 m bytes), lb = 4 L the bytes of the half in each group.
template <DType T, bool kFull>
GEMSTAGE_AVX2 inline __m256i half_dot_avx2(const uint8_t* wq, const uint8_t* xq, int64_t gs,
                                           int lb) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  if constexpr (T == DType::Q4_0) {
    // A 16-bit lane of VPMADDUBSW holds u0 x0 + u1 x1 with u <= 15, |x| <= 127 (<= 3810), so
    // the eight products of the block's 32 weights per lane pair sum to <= 30480 < 2^15: the
    // whole half accumulates in int16 and widens once.
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m256i pv = load_half<kFull>(wq + g * gs, lb);
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(pv, lo4),
                                                       load_half<kFull>(xq + 2 * g * gs, lb)));
      s16 = _mm256_add_epi16(s16,
                             _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(pv, 4), lo4),
                                                  load_half<kFull>(xq + (2 * g + 1) * gs, lb)));
    }
    return _mm256_madd_epi16(s16, ones16);
  } else {
    // Signed q = u - 128 by the sign trick: |q| as the unsigned operand, x carrying q's sign. A
    // pair sum reaches 2 * 127 * 127, so each group widens to int32 on its own.
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i s32 = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i qs = _mm256_xor_si256(load_half<kFull>(wq + j * gs, lb), bias);
      const __m256i p = _mm256_maddubs_epi16(
          _mm256_sign_epi8(qs, qs), _mm256_sign_epi8(load_half<kFull>(xq + j * gs, lb), qs));
      s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(p, ones16));
    }
    return s32;
  }
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
        const __m256i d0 =
            _mm256_add_epi32(half_dot_avx2<T, true>(wc, xc, 64, 32),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nzx + b0)));
        const __m256i d1 =
            _mm256_add_epi32(half_dot_avx2<T, true>(wc + 32, xc + 32, 64, 32),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nzx + b0 + 8)));
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
        const __m256i dh = _mm256_add_epi32(
            half_dot_avx2<T, false>(wc + 32 * h, xc + 32 * h, 4 * m, lb), load_part(nzx + bh, lb));
        alignas(16) uint16_t hs[8] = {};
        std::memcpy(hs, wrow + 2 * bh, static_cast<size_t>(2 * L));
        const __m256 sh = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hs)));
        const __m256 xs = _mm256_castsi256_ps(load_part(dx + bh, lb));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_mul_ps(sh, xs), acc);
      }
    }
    y[r] = hsum8(acc);
  }
}

template <DType T>
struct Avx2Tiles {
  static constexpr int NW = 2;
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

#endif  // x86

#if defined(__aarch64__)
// ---- NEON: int8 dots on signed weights, 4 int32 lanes = a quarter chunk ------------------------
//
// The activations carry no zero-point term here (z = 0): the weights are made signed in
// registers, Q8_0 as u ^ 0x80 = u - 128, Q4_0 as each nibble - 8, and the integer block dot is
// sum(w * xq) directly. A 16-byte vector of a group holds four bytes of each of 4 blocks, so with
// SDOT (the dot-product extension, FEAT_DotProd: most cores since Cortex-A55/A75, every Apple
// core) int32 lane i accumulates block i, as VPDPBUSD's lanes do. Cores without it multiply with
// SMULL (int16 products) and fold adjacent pairs with SADALP, so one block spans two int32 lanes
// of two accumulators, added pairwise (ADDP) at the end of the quarter.

#define GEMSTAGE_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))

// `bytes` (<= 16) bytes from p, zero-filled: a quarter chunk of one group, or its short tail.
inline int8x16_t load_quarter(const uint8_t* p, int bytes) {
  if (bytes == 16) return vreinterpretq_s8_u8(vld1q_u8(p));
  uint8_t buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(bytes));
  return vreinterpretq_s8_u8(vld1q_u8(buf));
}

// Signed weights of a group's raw bytes: Q8_0 the group itself, Q4_0 its low (plane 0) or high
// (plane 1) nibbles.
template <DType T>
inline int8x16_t signed_weights(int8x16_t packed, [[maybe_unused]] int plane) {
  if constexpr (T == DType::Q8_0) {
    return veorq_s8(packed, vdupq_n_s8(static_cast<int8_t>(0x80)));
  } else {
    const uint8x16_t u = vreinterpretq_u8_s8(packed);
    const uint8x16_t nib = plane ? vshrq_n_u8(u, 4) : vandq_u8(u, vdupq_n_u8(0x0f));
    return vsubq_s8(vreinterpretq_s8_u8(nib), vdupq_n_s8(8));
  }
}

// Integer dots of one quarter chunk (L <= 4 blocks, lb = 4 L bytes per group) of NW weight rows
// with NX activation rows: D[a][w] lane i = block i's sum(w * xq). gs is the chunk's group stride.
template <DType T, int NX, int NW, bool kDot>
GEMSTAGE_DOTPROD inline void quarter_dots(const uint8_t* const* wq, const uint8_t* const* xq,
                                          int64_t gs, int lb, int32x4_t (&D)[NX][NW]) {
  [[maybe_unused]] int32x4_t lo[NX][NW], hi[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) {
      D[a][w] = vdupq_n_s32(0);
      if constexpr (!kDot) lo[a][w] = hi[a][w] = vdupq_n_s32(0);
    }
  // Q8_0: 8 weight groups of one plane each; Q4_0: 4 packed groups of two nibble planes.
  constexpr int kGroups = T == DType::Q8_0 ? 8 : 4, kPlanes = 8 / kGroups;
  for (int g = 0; g < kGroups; ++g) {
    int8x16_t packed[NW];
    for (int w = 0; w < NW; ++w) packed[w] = load_quarter(wq[w] + g * gs, lb);
    for (int pl = 0; pl < kPlanes; ++pl) {
      const int j = g * kPlanes + pl;  // the activation group (element plane) it meets
      int8x16_t wv[NW];
      for (int w = 0; w < NW; ++w) wv[w] = signed_weights<T>(packed[w], pl);
      for (int a = 0; a < NX; ++a) {
        const int8x16_t xv = load_quarter(xq[a] + j * gs, lb);
        for (int w = 0; w < NW; ++w) {
          if constexpr (kDot) {
            D[a][w] = vdotq_s32(D[a][w], wv[w], xv);
          } else {
            lo[a][w] = vpadalq_s16(lo[a][w], vmull_s8(vget_low_s8(wv[w]), vget_low_s8(xv)));
            hi[a][w] = vpadalq_s16(hi[a][w], vmull_high_s8(wv[w], xv));
          }
        }
      }
    }
  }
  if constexpr (!kDot)
    for (int a = 0; a < NX; ++a)
      for (int w = 0; w < NW; ++w) D[a][w] = vpaddq_s32(lo[a][w], hi[a][w]);
}

// out[a * NW + w] = dot(activation row srow[a], weight row wrow[w]) over the whole width.
template <DType T, int NX, int NW, bool kDot>
GEMSTAGE_DOTPROD void tile_neon(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                float* out) {
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  const int64_t K = A.K, nb = A.nb;
  float32x4_t facc[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) facc[a][w] = vdupq_n_f32(0);
  for (int64_t c = 0; c * kCB < nb; ++c) {
    const int64_t m = std::min(kCB, nb - c * kCB), gs = 4 * m;
    for (int64_t qt = 0; qt < 4; ++qt) {
      const int64_t L = std::min<int64_t>(4, m - 4 * qt);
      if (L <= 0) break;
      const int64_t b0 = c * kCB + 4 * qt;
      const uint8_t* wq[NW];
      const uint8_t* xq[NX];
      for (int w = 0; w < NW; ++w) wq[w] = wrow[w] + 2 * nb + c * chunk_bytes + 16 * qt;
      for (int a = 0; a < NX; ++a) xq[a] = A.q.data() + srow[a] * K + c * 512 + 16 * qt;
      int32x4_t D[NX][NW];
      quarter_dots<T, NX, NW, kDot>(wq, xq, gs, static_cast<int>(4 * L), D);
      float32x4_t dw[NW];
      for (int w = 0; w < NW; ++w) {
        uint16_t h[4] = {};
        std::memcpy(h, wrow[w] + 2 * b0, static_cast<size_t>(2 * L));
        dw[w] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
      }
      for (int a = 0; a < NX; ++a) {
        float dxs[4] = {};
        std::memcpy(dxs, A.d.data() + srow[a] * nb + b0, static_cast<size_t>(4 * L));
        const float32x4_t dx = vld1q_f32(dxs);
        for (int w = 0; w < NW; ++w)
          facc[a][w] = vfmaq_f32(facc[a][w], vcvtq_f32_s32(D[a][w]), vmulq_f32(dw[w], dx));
      }
    }
  }
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) out[a * NW + w] = vaddvq_f32(facc[a][w]);
}

// Prefill keeps a 4 x 4 tile with SDOT (16 int32 accumulators) and 4 x 2 without (each pair of
// accumulators is one SDOT's worth).
template <DType T, bool kDot>
struct NeonTiles {
  static constexpr int NW = kDot ? 4 : 2;
  template <int NX>
  GEMSTAGE_DOTPROD static void run(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                   float* out) {
    tile_neon<T, NX, NW, kDot>(A, srow, wrow, out);
  }
};

// Decode walks the rows one at a time in address order.
template <DType T, bool kDot>
GEMSTAGE_DOTPROD void rows_neon(const ActQ& A, int64_t S, const uint8_t* wdata, size_t row_bytes,
                                int64_t N, float* y, int64_t r0, int64_t r1) {
  if (S == 1) {
    const int64_t s0 = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wrow = wdata + static_cast<size_t>(r) * row_bytes;
      tile_neon<T, 1, 1, kDot>(A, &s0, &wrow, y + r);
    }
    return;
  }
  prefill_tiles<NeonTiles<T, kDot>>(A, S, wdata, row_bytes, N, y, r0, r1);
}

#endif  // aarch64

// The kernel family for S rows under the tier in force.
enum class Kernel { Scalar, Avx2, Vnni, Amx, Neon, NeonDot };
Kernel kernel_for(int64_t S) {
  const CpuTier tier = cpu_tier();
  const CpuFeatures& f = cpu_features();
  if (tier == CpuTier::Amx && S >= kAmxMinRows) return Kernel::Amx;
  if ((tier == CpuTier::Amx || tier == CpuTier::Avx512) && f.avx512vnni) return Kernel::Vnni;
  if (cpu_tier_at_least(CpuTier::Avx2)) return Kernel::Avx2;
  if (tier == CpuTier::Neon) return f.neon_dotprod ? Kernel::NeonDot : Kernel::Neon;
  return Kernel::Scalar;
}

}  // namespace

const char* quant_isa(int64_t S) {
  switch (kernel_for(S)) {
    case Kernel::Amx:
      return "amx-bf16";
    case Kernel::Vnni:
      return "avx512vnni";
    case Kernel::Avx2:
      return "avx2";
    case Kernel::NeonDot:
      return "neon-dotprod";
    case Kernel::Neon:
      return "neon";
    case Kernel::Scalar:
      break;
  }
  return "scalar";
}

void quant_matmul(ThreadPool& pool, const float* x, int64_t S, const WeightView& w, float* y) {
  const QuantTarget one{&w, y};
  quant_matmul_many(pool, x, S, {&one, 1});
}

void quant_matmul_many(ThreadPool& pool, const float* x, int64_t S,
                       std::span<const QuantTarget> targets) {
  if (targets.empty()) return;
  const DType t = targets[0].w->dtype;
  const int64_t K = targets[0].w->cols();
  if (K % kQB != 0)
    fail("matmul: weight ", targets[0].w->name, " is ", dtype_name(t), " with input width ", K,
         ", not a multiple of ", kQB, " (quantized rows are whole 32-weight blocks)");
  const size_t rb = quant_row_bytes(t, K);
  int64_t total_rows = 0;
  for (const QuantTarget& tg : targets) {
    const WeightView& w = *tg.w;
    if (w.dtype != t || w.cols() != K)
      fail("matmul: weight ", w.name, " is ", dtype_name(w.dtype), " ", shape_str(w.shape),
           "; the matrices sharing its input are ", dtype_name(t), " with width ", K);
    const int64_t N = w.rows();
    if (w.nbytes != rb * static_cast<size_t>(N))
      fail("matmul: weight ", w.name, " ", dtype_name(t), " ", shape_str(w.shape), " holds ",
           w.nbytes, " bytes; the format needs ", rb * static_cast<size_t>(N), " (", N, " rows of ",
           rb, ")");
    if (!tg.x && !x) fail("matmul: weight ", w.name, " has no input (internal error)");
    total_rows += N;
  }
  if (S <= 0 || total_rows == 0) return;
  const Kernel kernel = kernel_for(S);
  if (kernel == Kernel::Amx) {
    for (const QuantTarget& tg : targets)
      amx_quant_matmul(pool, tg.x ? tg.x : x, S, t, static_cast<const uint8_t*>(tg.w->data), rb, K,
                       tg.w->rows(), tg.y);
    return;
  }
  // AVX2's Q8_0 sign trick multiplies signed q directly, so its activations carry no z term.
  // The NEON kernels make the weights signed in registers: no z term either.
  const bool neon = kernel == Kernel::Neon || kernel == Kernel::NeonDot;
  const int z = (kernel == Kernel::Avx2 && t == DType::Q8_0) || neon ? 0 : zero_point(t);
  // The shared input is quantized once, on first use; a target with its own input gets its own.
  std::vector<ActQ> acts;
  acts.reserve(targets.size());  // act_of points into acts: no reallocation
  std::vector<const ActQ*> act_of(targets.size());
  const ActQ* shared = nullptr;
  const auto quantize = [&](const float* in) {
    ActQ* a = &acts.emplace_back();
    quantize_acts(pool, in, S, K, kernel == Kernel::Scalar ? 0 : z, kernel != Kernel::Scalar,
                  kernel == Kernel::Vnni, a);
    return a;
  };
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i].x)
      act_of[i] = quantize(targets[i].x);
    else
      act_of[i] = shared ? shared : (shared = quantize(x));
  }
  using Fn =
      void (*)(const ActQ&, int64_t, const uint8_t*, size_t, int64_t, float*, int64_t, int64_t);
  Fn fn = nullptr;
#if defined(__x86_64__) || defined(__i386__)
  if (kernel == Kernel::Vnni)
    fn = t == DType::Q8_0 ? rows_vnni<DType::Q8_0> : rows_vnni<DType::Q4_0>;
  else if (kernel == Kernel::Avx2)
    fn = t == DType::Q8_0 ? rows_avx2<DType::Q8_0> : rows_avx2<DType::Q4_0>;
#endif
#if defined(__aarch64__)
  if (kernel == Kernel::NeonDot)
    fn = t == DType::Q8_0 ? rows_neon<DType::Q8_0, true> : rows_neon<DType::Q4_0, true>;
  else if (kernel == Kernel::Neon)
    fn = t == DType::Q8_0 ? rows_neon<DType::Q8_0, false> : rows_neon<DType::Q4_0, false>;
#endif
  // Rows [b, e) of the matrices stacked in order, each piece run by its own matrix.
  auto rows = [&](size_t b, size_t e) {
    int64_t first = 0;
    for (size_t i = 0; i < targets.size(); ++i) {
      const QuantTarget& tg = targets[i];
      const ActQ& A = *act_of[i];
      const int64_t N = tg.w->rows();
      const int64_t r0 = std::max<int64_t>(static_cast<int64_t>(b), first) - first;
      const int64_t r1 = std::min<int64_t>(static_cast<int64_t>(e), first + N) - first;
      first += N;
      if (r0 >= r1) continue;
      const auto* data = static_cast<const uint8_t*>(tg.w->data);
      if (fn)
        fn(A, S, data, rb, N, tg.y, r0, r1);
      else
        rows_scalar(t, A, S, data, rb, N, tg.y, r0, r1);
    }
  };
  const size_t n = static_cast<size_t>(total_rows);
  if (S <= kStreamMaxRows && fn && (S == 1 || kernel == Kernel::Vnni)) {
    // Decode: about 4 chunks per thread (whole 16-row groups), taken as threads come free. An
    // even static split left one thread waiting at the end of most matrices: tg32 15.0-15.2 ->
    // 15.4-15.5 t/s measured on the E2B-shape Q4_0 bundle, run for run interleaved.
    const size_t chunk = std::max<size_t>(16, n / (4 * static_cast<size_t>(pool.size())) / 16 * 16);
    pool.parallel_chunks(n, chunk, rows);
    return;
  }
  pool.parallel_for(n, rows, 16);
}

}  // namespace gemstage
