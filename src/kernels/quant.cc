// Q8_0 / Q4_0 row formats: quantize, dequantize, element access. Layouts are documented in
// quant.h; the matmul kernels are in quant_kernels.cc and the architecture folders.
#include "kernels/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>

#include "core/error.h"

namespace gemstage {

namespace {

void check_quantized(DType t, const char* what) {
  if (!dtype_is_quantized(t))
    fail(what, ": dtype ", dtype_name(t), " is not a block-quantized format (Q8_0, Q4_0)");
}

void check_in(DType t, int64_t in, const char* what) {
  check_quantized(t, what);
  if (in <= 0 || in % kQuantBlock != 0)
    fail(what, ": ", dtype_name(t), " rows must hold a whole number of ", kQuantBlock,
         "-weight blocks, but the input width is ", in,
         " (quantize only matrices whose last dimension is a multiple of 32; keep others as "
         "BF16/F32)");
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Picks the f16 scale for a block whose extreme is `extreme` (max|w| for Q8_0, the signed
// largest-magnitude value for Q4_0) and `levels` (127 / -8): d = extreme / levels rounded to
// f16, then nudged up in magnitude while |extreme / d| > |levels| + 0.5.
uint16_t pick_scale(float extreme, float levels, const char* fmt) {
  if (extreme == 0.0f) return 0;
  const float d0 = extreme / levels;
  uint16_t h = f32_to_f16(d0);
  if ((h & 0x7fffu) >= 0x7c00u)
    fail("quantize_row: ", fmt, " block with |w| up to ", std::fabs(extreme),
         " needs a scale beyond the f16 range");
  if ((h & 0x7fffu) == 0) h = static_cast<uint16_t>(h | 1u);  // keep d > 0 for tiny blocks
  const double limit = std::fabs(static_cast<double>(levels)) + 0.5;
  while (std::fabs(static_cast<double>(extreme)) > limit * std::fabs(f16_to_f32(h))) ++h;
  return h;
}

}  // namespace

bool dtype_is_quantized(DType t) {
  return t == DType::Q8_0 || t == DType::Q4_0;
}

size_t quant_block_bytes(DType t) {
  check_quantized(t, "quant_block_bytes");
  return t == DType::Q8_0 ? 34 : 18;
}

size_t quant_row_bytes(DType t, int64_t in) {
  check_in(t, in, "quant_row_bytes");
  return static_cast<size_t>(in / kQuantBlock) * quant_block_bytes(t);
}

void quantize_row(DType t, const float* src, int64_t in, uint8_t* dst) {
  check_in(t, in, "quantize_row");
  const int64_t nb = in / kQuantBlock;
  uint8_t* q = dst + 2 * nb;
  const size_t qbytes = static_cast<size_t>(nb) * (t == DType::Q8_0 ? 32 : 16);
  std::memset(q, 0, qbytes);
  uint8_t codes[kQuantBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const float* w = src + b * kQuantBlock;
    uint16_t h;
    if (t == DType::Q8_0) {
      float amax = 0.0f;
      for (int e = 0; e < kQuantBlock; ++e) {
        if (!std::isfinite(w[e]))
          fail("quantize_row: non-finite weight ", w[e], " at column ", b * kQuantBlock + e);
        amax = std::max(amax, std::fabs(w[e]));
      }
      h = pick_scale(amax, 127.0f, "Q8_0");
      const float d = f16_to_f32(h);
      for (int e = 0; e < kQuantBlock; ++e) {
        const float v = d == 0.0f ? 0.0f : std::nearbyint(w[e] / d);
        codes[e] = static_cast<uint8_t>(static_cast<int>(std::clamp(v, -127.0f, 127.0f)) + 128);
      }
    } else {
      float ext = 0.0f;
      for (int e = 0; e < kQuantBlock; ++e) {
        if (!std::isfinite(w[e]))
          fail("quantize_row: non-finite weight ", w[e], " at column ", b * kQuantBlock + e);
        if (std::fabs(w[e]) > std::fabs(ext)) ext = w[e];
      }
      h = pick_scale(ext, -8.0f, "Q4_0");
      const float d = f16_to_f32(h);
      for (int e = 0; e < kQuantBlock; ++e) {
        const float v = d == 0.0f ? 0.0f : std::nearbyint(w[e] / d);
        codes[e] = static_cast<uint8_t>(static_cast<int>(std::clamp(v + 8.0f, 0.0f, 15.0f)));
      }
    }
    std::memcpy(dst + 2 * b, &h, 2);
    // Scatter into the chunk-interleaved order (quant.h).
    const int64_t c = b / kQuantChunkBlocks, i = b % kQuantChunkBlocks;
    const int64_t m = std::min(kQuantChunkBlocks, nb - c * kQuantChunkBlocks);
    if (t == DType::Q8_0) {
      uint8_t* base = q + c * 512 + 4 * i;
      for (int j = 0; j < 8; ++j) std::memcpy(base + j * 4 * m, codes + 4 * j, 4);
    } else {
      uint8_t* base = q + c * 256 + 4 * i;
      for (int g = 0; g < 4; ++g)
        for (int e = 0; e < 4; ++e)
          base[g * 4 * m + e] =
              static_cast<uint8_t>(codes[8 * g + e] | (codes[8 * g + 4 + e] << 4));
    }
  }
}

void dequantize_row(DType t, const uint8_t* src, int64_t in, float* dst) {
  check_in(t, in, "dequantize_row");
  const int64_t nb = in / kQuantBlock;
  const uint8_t* q = src + 2 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    const float d = f16_to_f32(load_u16(src + 2 * b));
    const int64_t c = b / kQuantChunkBlocks, i = b % kQuantChunkBlocks;
    const int64_t m = std::min(kQuantChunkBlocks, nb - c * kQuantChunkBlocks);
    float* out = dst + b * kQuantBlock;
    if (t == DType::Q8_0) {
      const uint8_t* base = q + c * 512 + 4 * i;
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e)
          out[4 * j + e] = static_cast<float>(static_cast<int>(base[j * 4 * m + e]) - 128) * d;
    } else {
      const uint8_t* base = q + c * 256 + 4 * i;
      for (int g = 0; g < 4; ++g)
        for (int e = 0; e < 4; ++e) {
          const int byte = base[g * 4 * m + e];
          out[8 * g + e] = static_cast<float>((byte & 15) - 8) * d;
          out[8 * g + 4 + e] = static_cast<float>((byte >> 4) - 8) * d;
        }
    }
  }
}

float quant_block_scale(DType t, const uint8_t* row, int64_t in, int64_t b) {
  check_in(t, in, "quant_block_scale");
  return f16_to_f32(load_u16(row + 2 * b));
}

float dequantize_at(DType t, const uint8_t* row, int64_t in, int64_t k) {
  check_in(t, in, "dequantize_at");
  if (k < 0 || k >= in) fail("dequantize_at: column ", k, " outside a row of ", in);
  const int64_t nb = in / kQuantBlock, b = k / kQuantBlock, e = k % kQuantBlock;
  const float d = f16_to_f32(load_u16(row + 2 * b));
  const int64_t c = b / kQuantChunkBlocks, i = b % kQuantChunkBlocks;
  const int64_t m = std::min(kQuantChunkBlocks, nb - c * kQuantChunkBlocks);
  const uint8_t* q = row + 2 * nb;
  if (t == DType::Q8_0)
    return static_cast<float>(static_cast<int>(q[c * 512 + (e / 4) * 4 * m + 4 * i + e % 4]) -
                              128) *
           d;
  const int64_t g = e / 8, r = e % 8;
  const int byte = q[c * 256 + g * 4 * m + 4 * i + (r & 3)];
  return static_cast<float>(((r < 4 ? byte : byte >> 4) & 15) - 8) * d;
}

std::vector<uint8_t> quantize_matrix(DType t, const float* src, int64_t rows, int64_t in,
                                     ThreadPool* pool) {
  const size_t rb = quant_row_bytes(t, in);
  std::vector<uint8_t> out(rb * static_cast<size_t>(rows));
  std::mutex mu;
  std::exception_ptr first_error;
  auto run = [&](size_t b, size_t e) {
    try {
      for (size_t r = b; r < e; ++r)
        quantize_row(t, src + static_cast<int64_t>(r) * in, in, out.data() + r * rb);
    } catch (...) {  // workers must not throw; the first error is rethrown by the caller
      std::lock_guard<std::mutex> lock(mu);
      if (!first_error) first_error = std::current_exception();
    }
  };
  if (pool)
    pool->parallel_for(static_cast<size_t>(rows), run, 16);
  else
    run(0, static_cast<size_t>(rows));
  if (first_error) std::rethrow_exception(first_error);
  return out;
}

}  // namespace gemstage
