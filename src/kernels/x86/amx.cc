// AMX bf16 prefill GEMM for Q8_0 / Q4_0 weights; see amx.h for the scheme and its precision.
//
// Work split, GEMM-style blocking: the input columns are cut into K blocks of at most
// kMaxBlockCols (whole 512-column chunks), the activation rows into passes of up to
// kPackedActBudget bytes of one K block's packed bf16, and the outputs into strips of 32 weight
// rows (two 16-row A tiles). For each (pass, K block) the rows are packed once, in parallel, and
// stay in L2 while the strips are shared out: a thread dequantizes its strip's K block into a
// thread-local buffer and runs every row tile of the pass against it, two at a time, in four f32
// accumulator tiles:
//     tmm0..3 = C (A tile 0/1 x B tile 0/1),  tmm4, tmm5 = A (weights),  tmm6, tmm7 = B (rows).
// Between K blocks the accumulator tiles are parked in a per-call buffer (tile layout); after the
// last one they go to y. Blocking K keeps a pass at 256 rows however wide the input is, so each
// weight is dequantized once per 256 rows: without it a 12288-wide down_proj fitted only 32 rows
// per pass and was dequantized 16 times for a 512-token prompt (that GEMM went from 445 to
// 800-845 GFLOP/s on 2 threads, and pp512 from 105-108 to 123-129 t/s). Wider blocks would
// lengthen the passes but park the accumulators more often; 2048 columns measured best against
// 1024 and 4096.
//
// GCC 12 reports false "uninitialized" warnings inside its own AVX-512 intrinsic headers.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "kernels/x86/amx.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/quant.h"

namespace gemstage::amx {

namespace {

constexpr int64_t kCB = kQuantChunkBlocks;
constexpr int64_t kTileRows = 16;  // outputs per A tile, activation rows per B tile
constexpr int64_t kStep = 32;      // input columns per tile multiply: 32 bf16 = 64-byte rows
constexpr int64_t kStrip = 2 * kTileRows;
constexpr int64_t kTileElems = kTileRows * kStep;  // bf16 elements in one tile (1 KiB)
// The packed rows of one pass and K block, plus one dequantized strip of that block, should stay
// in a core's 2 MiB L2 while every strip runs against them: 256 rows of 2048 columns.
constexpr size_t kPackedActBudget = size_t{1} << 20;
constexpr int64_t kMaxBlockCols = 4 * kCB * kQuantBlock;

#define GEMSTAGE_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// n elements of buf starting on a 64-byte line. A tile row is 64 bytes: from a buffer that is
// not line-aligned (large std::vector blocks come from mmap at 16 bytes past a page) every row
// of every tile load and store spans two cache lines.
template <class T>
T* aligned_to_line(std::vector<T>& buf, size_t n) {
  constexpr size_t kPad = 64 / sizeof(T);
  buf.resize(n + kPad);
  const auto addr = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((64 - addr % 64) % 64) / sizeof(T);
}

// 64-byte tile configuration, palette 1: every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

GEMSTAGE_AMX inline __m512i as_si512(__m512bh v) {
  __m512i r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}

// Group j of a chunk (64 signed codes u - z, block scales spread per quarter in dq) -> steps
// 2j and 2j + 1 of the chunk.
GEMSTAGE_AMX inline void emit_group(uint16_t* chunk_out, size_t stride, const __m512 (&dq)[4],
                                    int j, __m512i codes) {
  const __m512 f0 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, 0))), dq[0]);
  const __m512 f1 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, 1))), dq[1]);
  const __m512 f2 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, 2))), dq[2]);
  const __m512 f3 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, 3))), dq[3]);
  _mm512_storeu_si512(chunk_out + static_cast<size_t>(2 * j) * stride,
                      as_si512(_mm512_cvtne2ps_pbh(f1, f0)));
  _mm512_storeu_si512(chunk_out + static_cast<size_t>(2 * j + 1) * stride,
                      as_si512(_mm512_cvtne2ps_pbh(f3, f2)));
}

// v mod n per lane, for lanes in [0, 16 + n) (a few subtractions: n >= 4).
GEMSTAGE_AMX inline __m512i mod_below(__m512i v, __m512i n) {
  for (__mmask16 k; (k = _mm512_cmpge_epi32_mask(v, n)) != 0;)
    v = _mm512_mask_sub_epi32(v, k, v, n);
  return v;
}

// A short last chunk (m < 16 blocks). Q8-order position p (relative to the chunk's first
// column) holds column 32i + 4j + t for p = j*4m + 4i + t, so its groups of 4m codes do not fall
// on whole 64-byte vectors. The codes are first laid out in position order as signed bytes
// (Q4_0: the low then the high nibbles of each of its four 4m-byte groups), then widened 16 at a
// time, lane l of the run at p0 scaled by block ((p0 + l) mod 4m) / 4. Same values as the full
// chunks' path: code * d rounded to bf16 (a scalar loop here was half of a 12B prefill, whose
// 3840-wide matrices end in an 8-block chunk).
template <DType T>
GEMSTAGE_AMX void dequantize_short_chunk(const uint8_t* row, int64_t nb, int64_t c, int64_t m,
                                         uint16_t* chunk_out, size_t stride) {
  const int group = static_cast<int>(4 * m);  // codes per group, 4..60
  const __mmask64 in_group = (__mmask64{1} << group) - 1;
  alignas(64) int8_t codes[32 * kCB];
  if constexpr (T == DType::Q8_0) {
    const uint8_t* qs = row + 2 * nb + c * 512;
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j)
      _mm512_mask_storeu_epi8(
          codes + j * group, in_group,
          _mm512_xor_si512(_mm512_maskz_loadu_epi8(in_group, qs + j * group), bias));
  } else {
    const uint8_t* qs = row + 2 * nb + c * 256;
    const __m512i lo4 = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
    for (int g = 0; g < 4; ++g) {
      const __m512i pv = _mm512_maskz_loadu_epi8(in_group, qs + g * group);
      _mm512_mask_storeu_epi8(codes + 2 * g * group, in_group,
                              _mm512_sub_epi8(_mm512_and_si512(pv, lo4), eight));
      _mm512_mask_storeu_epi8(
          codes + (2 * g + 1) * group, in_group,
          _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(pv, 4), lo4), eight));
    }
  }
  // Only the chunk's m scales are read (a full 32-byte load could pass the end of a short row).
  const __m512 dv = _mm512_cvtph_ps(
      _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << m) - 1), row + 2 * c * kCB));
  const __m512i group_v = _mm512_set1_epi32(group);
  // pos: (p0 + l) mod 4m for the run at p0.
  __m512i pos = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  pos = mod_below(pos, group_v);
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (int64_t step = 0; step < m; ++step) {
    __m512 half[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_permutexvar_ps(_mm512_srli_epi32(pos, 2), dv);
      const __m128i c16 =
          _mm_load_si128(reinterpret_cast<const __m128i*>(codes + step * kStep + 16 * h));
      half[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c16)), d);
      pos = mod_below(_mm512_add_epi32(pos, sixteen), group_v);
    }
    _mm512_storeu_si512(chunk_out + static_cast<size_t>(step) * stride,
                        as_si512(_mm512_cvtne2ps_pbh(half[1], half[0])));
  }
}

// Chunks [c0, c1) of one weight row (nb blocks) -> their steps of 32 bf16 (scale folded in),
// step s of chunk c0 at out + s * stride.
template <DType T>
GEMSTAGE_AMX void dequantize_row_bf16(const uint8_t* row, int64_t nb, int64_t c0, int64_t c1,
                                      uint16_t* out, size_t stride) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t m = std::min(kCB, nb - c * kCB);
    uint16_t* chunk_out = out + static_cast<size_t>((c - c0) * kCB) * stride;  // 16 steps a chunk
    if (m < kCB) {
      dequantize_short_chunk<T>(row, nb, c, m, chunk_out, stride);
      continue;
    }
    // Lane l of quarter q of a group is block 4q + l/4: spread the 16 block scales to match.
    const __m512 dv =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c * kCB)));
    __m512 dq[4];
    for (int q = 0; q < 4; ++q) {
      const __m512i idx = _mm512_add_epi32(
          _mm512_set1_epi32(4 * q),
          _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            2));
      dq[q] = _mm512_permutexvar_ps(idx, dv);
    }
    if constexpr (T == DType::Q8_0) {
      const uint8_t* qs = row + 2 * nb + c * 512;
      const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int j = 0; j < 8; ++j)
        emit_group(chunk_out, stride, dq, j,
                   _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * j), bias));
    } else {
      const uint8_t* qs = row + 2 * nb + c * 256;
      const __m512i lo4 = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
      for (int g = 0; g < 4; ++g) {
        const __m512i pv = _mm512_loadu_si512(qs + 64 * g);
        emit_group(chunk_out, stride, dq, 2 * g, _mm512_sub_epi8(_mm512_and_si512(pv, lo4), eight));
        emit_group(chunk_out, stride, dq, 2 * g + 1,
                   _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(pv, 4), lo4), eight));
      }
    }
  }
}

// Row x (K natural columns) -> xq in Q8 order, the order the weights are stored in.
void permute_to_q8_order(const float* x, int64_t K, float* xq) {
  const int64_t nb = K / kQuantBlock, n_chunks = (nb + kCB - 1) / kCB;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t m = std::min(kCB, nb - c * kCB);
    const float* xc = x + c * 512;
    float* qc = xq + c * 512;
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t i = 0; i < m; ++i) std::memcpy(qc + j * 4 * m + 4 * i, xc + 32 * i + 4 * j, 16);
  }
}

// v[i] (16 dwords each) -> v[j][i] = old v[i][j]: 32-bit, 64-bit, then two 128-bit lane stages.
GEMSTAGE_AMX inline void transpose_16x16_dwords(__m512i (&v)[16]) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
  }
  // b[4m + c], 128-bit lane L: rows 4m..4m+3 of column 4L + c.
  for (int m = 0; m < 4; ++m) {
    b[4 * m] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
    b[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
    b[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
    b[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
  }
  // Column 4L + c gathers lane L of b[c], b[4 + c], b[8 + c], b[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i e2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i e3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    v[c] = _mm512_shuffle_i32x4(e0, e2, _MM_SHUFFLE(2, 0, 2, 0));
    v[4 + c] = _mm512_shuffle_i32x4(e0, e2, _MM_SHUFFLE(3, 1, 3, 1));
    v[8 + c] = _mm512_shuffle_i32x4(e1, e3, _MM_SHUFFLE(2, 0, 2, 0));
    v[12 + c] = _mm512_shuffle_i32x4(e1, e3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// One B tile row group: activation rows x[0 .. rows) (row stride ld, K columns from x; rows past
// `rows` are padding, packed as zeros) -> for each K step ks the tile at tile0 + ks * 256
// dwords, whose row kk holds column pair kk of the 16 activation rows (dword kk * 16 + row).
// Each step converts 16 rows to bf16 pairs and transposes them in registers (a scatter per row
// was 6% of a 512-token prefill). xq is a 16 * K float scratch.
GEMSTAGE_AMX void pack_activation_tile(const float* x, int64_t ld, int64_t rows, int64_t K,
                                       uint32_t* tile0, float* xq) {
  for (int64_t r = 0; r < kTileRows; ++r) {
    if (r < rows)
      permute_to_q8_order(x + r * ld, K, xq + r * K);
    else
      std::memset(xq + r * K, 0, static_cast<size_t>(K) * sizeof(float));
  }
  for (int64_t ks = 0; ks < K / kStep; ++ks) {
    __m512i v[16];
    for (int64_t r = 0; r < kTileRows; ++r) {
      const float* q = xq + r * K + ks * kStep;
      v[r] = as_si512(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q)));
    }
    transpose_16x16_dwords(v);
    uint32_t* tile = tile0 + static_cast<size_t>(ks) * 256;
    for (int kk = 0; kk < 16; ++kk) _mm512_storeu_si512(tile + kk * 16, v[kk]);
  }
}

// Where a strip's accumulator tiles wait between K blocks: per row-tile pair, its four C tiles.
struct Accumulators {
  float* parked = nullptr;  // null when the input is a single K block
  int64_t pairs = 0;        // row-tile pairs per pass
  float* tiles(int64_t strip, int64_t pair) const {
    return parked + static_cast<size_t>((strip * pairs + pair) * 4 * kTileRows * kTileRows);
  }
};

// All row tiles of one pass against one K block of one strip of dequantized weights (strip row
// r0): the C tiles start from zero on the first block, from their parked values after it, and
// go to y after the last.
GEMSTAGE_AMX void run_strip(const uint16_t* a, const uint16_t* b, int64_t n_steps,
                            int64_t row_tiles, int64_t s0, int64_t S, int64_t strip, int64_t N,
                            const Accumulators& acc, bool first, bool last, float* y) {
  constexpr int64_t kC = kTileRows * kTileRows;  // floats per C tile
  alignas(64) float cbuf[4][kTileRows][kTileRows];
  const int64_t r0 = strip * kStrip;
  for (int64_t bt = 0; bt < row_tiles; bt += 2) {
    float* parked = acc.parked ? acc.tiles(strip, bt / 2) : nullptr;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, parked, 64);
      _tile_loadd(1, parked + kC, 64);
      _tile_loadd(2, parked + 2 * kC, 64);
      _tile_loadd(3, parked + 3 * kC, 64);
    }
    const uint16_t* b0 = b + static_cast<size_t>(bt * n_steps) * kTileElems;
    const uint16_t* b1 = b0 + static_cast<size_t>(n_steps) * kTileElems;
    for (int64_t ks = 0; ks < n_steps; ++ks) {
      const uint16_t* ak = a + static_cast<size_t>(ks) * 2 * kTileElems;
      _tile_loadd(4, ak, 64);
      _tile_loadd(5, ak + kTileElems, 64);
      _tile_loadd(6, b0 + static_cast<size_t>(ks) * kTileElems, 64);
      _tile_loadd(7, b1 + static_cast<size_t>(ks) * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (!last) {
      _tile_stored(0, parked, 64);
      _tile_stored(1, parked + kC, 64);
      _tile_stored(2, parked + 2 * kC, 64);
      _tile_stored(3, parked + 3 * kC, 64);
      continue;
    }
    _tile_stored(0, cbuf[0], 64);
    _tile_stored(1, cbuf[1], 64);
    _tile_stored(2, cbuf[2], 64);
    _tile_stored(3, cbuf[3], 64);
    // C[out][row] -> y[row * N + out], dropping the padding of both.
    for (int t = 0; t < 4; ++t) {
      const int64_t out0 = r0 + (t / 2) * kTileRows, row0 = s0 + (bt + t % 2) * kTileRows;
      const int64_t n_out = std::min<int64_t>(kTileRows, N - out0),
                    n_row = std::min<int64_t>(kTileRows, S - row0);
      for (int64_t s = 0; s < n_row; ++s)
        for (int64_t o = 0; o < n_out; ++o) y[(row0 + s) * N + out0 + o] = cbuf[t][o][s];
    }
  }
}

// One K block: chunks [c0, c1) of the weights.
struct KBlock {
  int64_t c0 = 0, c1 = 0;
  bool first = true, last = true;
};

// Strips [st0, st1) against the packed rows of one pass and K block: dequantize each strip's
// block into a thread-local buffer, then run every row tile against it.
template <DType T>
GEMSTAGE_AMX void run_strips(const uint8_t* w, size_t row_bytes, int64_t nb, int64_t N,
                             const KBlock& kb, int64_t st0, int64_t st1, const uint16_t* packed,
                             int64_t row_tiles, int64_t s0, int64_t S, const Accumulators& acc,
                             float* y) {
  const int64_t n_steps = (std::min(nb, kb.c1 * kCB) - kb.c0 * kCB) * kQuantBlock / kStep;
  thread_local std::vector<uint16_t> strip_buffer;
  uint16_t* strip = aligned_to_line(strip_buffer, static_cast<size_t>(n_steps * 2 * kTileElems));
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = kTileRows;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  for (int64_t st = st0; st < st1; ++st) {
    const int64_t r0 = st * kStrip;
    for (int64_t r = 0; r < kStrip; ++r) {
      // Row r of the strip is row r % 16 of A tile r / 16; step ks of that tile starts at
      // element (ks * 2 + r / 16) * kTileElems.
      uint16_t* out =
          strip + static_cast<size_t>((r / kTileRows) * kTileElems + (r % kTileRows) * kStep);
      if (r0 + r < N)
        dequantize_row_bf16<T>(w + static_cast<size_t>(r0 + r) * row_bytes, nb, kb.c0, kb.c1, out,
                               static_cast<size_t>(2 * kTileElems));
      else
        for (int64_t ks = 0; ks < n_steps; ++ks)
          std::memset(out + static_cast<size_t>(ks * 2 * kTileElems), 0, kStep * 2);
    }
    run_strip(strip, packed, n_steps, row_tiles, s0, S, st, N, acc, kb.first, kb.last, y);
  }
  _tile_release();
}

template <DType T>
GEMSTAGE_AMX void amx_matmul_t(ThreadPool& pool, const float* x, int64_t S, const uint8_t* w,
                               size_t row_bytes, int64_t K, int64_t N, float* y) {
  const int64_t nb = K / kQuantBlock, n_chunks = (nb + kCB - 1) / kCB;
  const int64_t block_chunks = kMaxBlockCols / (kCB * kQuantBlock);
  const int64_t block_cols = std::min(K, kMaxBlockCols);
  // Rows per pass: a multiple of two row tiles, as many as the budget allows (at least 32).
  const int64_t pass_rows = std::max<int64_t>(
      kStrip, static_cast<int64_t>(kPackedActBudget / (static_cast<size_t>(block_cols) * 2)) /
                  kStrip * kStrip);
  const int64_t n_strips = (N + kStrip - 1) / kStrip;
  std::vector<uint16_t> packed;
  std::vector<float> parked;
  for (int64_t s0 = 0; s0 < S; s0 += pass_rows) {
    const int64_t rows = std::min(pass_rows, S - s0);
    const int64_t row_tiles = (rows + kStrip - 1) / kStrip * 2;  // even: tiles go in pairs
    Accumulators acc;
    acc.pairs = row_tiles / 2;
    if (n_chunks > block_chunks) {
      acc.parked = aligned_to_line(
          parked, static_cast<size_t>(n_strips * acc.pairs * 4 * kTileRows * kTileRows));
    }
    for (int64_t c0 = 0; c0 < n_chunks; c0 += block_chunks) {
      KBlock kb;
      kb.c0 = c0;
      kb.c1 = std::min(n_chunks, c0 + block_chunks);
      kb.first = c0 == 0;
      kb.last = kb.c1 == n_chunks;
      const int64_t k0 = c0 * kCB * kQuantBlock;
      const int64_t kw = std::min(K, kb.c1 * kCB * kQuantBlock) - k0, n_steps = kw / kStep;
      // Every lane is written below (the padding rows of the last tile pair as zeros), so the
      // buffer is only resized, not cleared.
      uint16_t* packed_tiles =
          aligned_to_line(packed, static_cast<size_t>(row_tiles * n_steps * kTileElems));
      auto* packed32 = reinterpret_cast<uint32_t*>(packed_tiles);
      pool.parallel_for(static_cast<size_t>(row_tiles), [&](size_t b, size_t e) {
        std::vector<float> xq(static_cast<size_t>(kTileRows * kw));
        for (size_t tile = b; tile < e; ++tile) {
          const int64_t r0 = static_cast<int64_t>(tile) * kTileRows;
          // The block starts on a chunk boundary, so its columns permute like a row of width kw.
          const float* src = r0 < rows ? x + (s0 + r0) * K + k0 : nullptr;  // null: all padding
          pack_activation_tile(src, K, rows - r0, kw,
                               packed32 + static_cast<size_t>(r0 * n_steps) * 16, xq.data());
        }
      });
      // Runs of strips taken as threads come free (quant_kernels.cc says why).
      const size_t strips = static_cast<size_t>(n_strips);
      pool.parallel_chunks(strips, pool.chunk_for(strips, 1), [&](size_t b, size_t e) {
        run_strips<T>(w, row_bytes, nb, N, kb, static_cast<int64_t>(b), static_cast<int64_t>(e),
                      packed_tiles, row_tiles, s0, S, acc, y);
      });
    }
  }
}

}  // namespace

void quant_matmul(ThreadPool& pool, const float* x, int64_t S, DType t, const uint8_t* w,
                  size_t row_bytes, int64_t K, int64_t N, float* y) {
  if (t == DType::Q8_0)
    amx_matmul_t<DType::Q8_0>(pool, x, S, w, row_bytes, K, N, y);
  else
    amx_matmul_t<DType::Q4_0>(pool, x, S, w, row_bytes, K, N, y);
}

}  // namespace gemstage::amx
