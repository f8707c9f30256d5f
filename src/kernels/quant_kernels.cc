// y = x * W^T for Q8_0 / Q4_0 weights, consumed in their stored, chunk-interleaved form: the
// dispatch, the activation quantizer and the scalar reference kernels. The SIMD kernels live in
// the folder of their architecture (x86/quant_avx512.cc, x86/quant_avx2.cc, x86/amx.cc,
// arm/quant_neon.cc, arm/quant_i8mm.cc), compiled only there.
//
// Every call first quantizes the activation rows per block of 32 (f32 scale dx = max|x| / 127,
// int8 codes xq) into the same interleaved order as a Q8_0 row (natural order for the scalar and
// SMMLA kernels), plus per block the integer
// -z * sum(xq) (z = the weight format's zero point). A block's contribution is then
//     d * dx * ( sum(u * xq) - z * sum(xq) )          (exact in int32)
// and every kernel sums those exact block dots; they differ only in the f32 summation order
// (and the AMX tiles, which round both operands to bf16 instead: x86/amx.h).
#include "kernels/quant_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "kernels/arm/quant_i8mm.h"
#include "kernels/arm/quant_neon.h"
#include "kernels/quant.h"
#include "kernels/x86/amx.h"
#include "kernels/x86/quant_avx2.h"
#include "kernels/x86/quant_avx512.h"

namespace gemstage {

namespace {

constexpr int64_t kQB = kQuantBlock;
constexpr int64_t kCB = kQuantChunkBlocks;

int zero_point(DType t) {
  return t == DType::Q8_0 ? 128 : 8;
}

// One row, portably: the codes, scales and corrections every SIMD twin reproduces exactly.
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

// The scalar reference: unpack a row to (u - z) in natural order, integer block dots.

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

// The kernel family for S rows under `tier`: the one place that maps tiers to kernels.
enum class Kernel { Scalar, Avx2, Vnni, Amx, Neon, NeonDot, NeonI8mm };
Kernel kernel_for(CpuTier tier, int64_t S) {
  const CpuFeatures& f = cpu_features();
  if (tier == CpuTier::Amx && S >= kAmxMinRows) return Kernel::Amx;
  if ((tier == CpuTier::Amx || tier == CpuTier::Avx512) && f.avx512vnni) return Kernel::Vnni;
  if (cpu_tier_at_least(tier, CpuTier::Avx2)) return Kernel::Avx2;
  if (tier == CpuTier::I8mm && S >= neon::kI8mmMinRows) return Kernel::NeonI8mm;
  if (tier == CpuTier::I8mm || tier == CpuTier::Dotprod) return Kernel::NeonDot;
  if (tier == CpuTier::Neon) return Kernel::Neon;
  return Kernel::Scalar;
}

}  // namespace

void quantize_acts(ThreadPool& pool, const float* x, int64_t S, int64_t K, int z, bool interleave,
                   [[maybe_unused]] bool use_avx512, ActQ* a) {
#if defined(__x86_64__) || defined(__i386__)
  const bool use_avx2 = interleave && !use_avx512 && cpu_tier_at_least(pool.tier(), CpuTier::Avx2);
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
      if (interleave && use_avx512) {
        avx512::quantize_act_row(x + si * K, K, z, a->q.data() + si * K, a->d.data() + si * a->nb,
                                 a->nzx.data() + si * a->nb);
        continue;
      }
      if (use_avx2) {
        avx2::quantize_act_row(x + si * K, K, z, a->q.data() + si * K, a->d.data() + si * a->nb,
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

const char* quant_isa(CpuTier tier, int64_t S) {
  switch (kernel_for(tier, S)) {
    case Kernel::Amx:
      return "amx-bf16";
    case Kernel::Vnni:
      return "avx512vnni";
    case Kernel::Avx2:
      return "avx2";
    case Kernel::NeonI8mm:
      return "neon-i8mm";
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
  const Kernel kernel = kernel_for(pool.tier(), S);
#if defined(__x86_64__) || defined(__i386__)
  if (kernel == Kernel::Amx) {
    for (const QuantTarget& tg : targets)
      amx::quant_matmul(pool, tg.x ? tg.x : x, S, t, static_cast<const uint8_t*>(tg.w->data), rb, K,
                        tg.w->rows(), tg.y);
    return;
  }
#endif
  // AVX2's Q8_0 sign trick multiplies signed q directly, so its activations carry no z term.
  // The NEON kernels make the weights signed in registers: no z term either.
  const bool neon =
      kernel == Kernel::Neon || kernel == Kernel::NeonDot || kernel == Kernel::NeonI8mm;
  const int z = (kernel == Kernel::Avx2 && t == DType::Q8_0) || neon ? 0 : zero_point(t);
  // The shared input is quantized once, on first use; a target with its own input gets its own.
  std::vector<ActQ> acts;
  acts.reserve(targets.size());  // act_of points into acts: no reallocation
  std::vector<const ActQ*> act_of(targets.size());
  const ActQ* shared = nullptr;
  const auto quantize = [&](const float* in) {
    ActQ* a = &acts.emplace_back();
    const bool natural = kernel == Kernel::Scalar || kernel == Kernel::NeonI8mm;
    quantize_acts(pool, in, S, K, kernel == Kernel::Scalar ? 0 : z, !natural,
                  kernel == Kernel::Vnni, a);
    return a;
  };
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i].x)
      act_of[i] = quantize(targets[i].x);
    else
      act_of[i] = shared ? shared : (shared = quantize(x));
  }
  QuantRowsFn fn = nullptr;
#if defined(__x86_64__) || defined(__i386__)
  if (kernel == Kernel::Vnni)
    fn = avx512::quant_rows(t);
  else if (kernel == Kernel::Avx2)
    fn = avx2::quant_rows(t);
#endif
#if defined(__aarch64__)
  if (kernel == Kernel::NeonDot || kernel == Kernel::Neon)
    fn = neon::quant_rows(t, kernel == Kernel::NeonDot);
  else if (kernel == Kernel::NeonI8mm)
    fn = neon::quant_rows_i8mm(t);
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
  if (!fn) return pool.parallel_for(n, rows, 16);
  // Chunks of whole 16-row groups (about 4 per thread), taken as threads come free. Decode: an even
  // static split left one thread waiting at the end of most matrices: tg32 15.0-15.2 -> 15.4-15.5
  // t/s measured on the E2B-shape Q4_0 bundle, run for run interleaved. Prefill: threads that run
  // at different speeds (the performance and efficiency cores of a hybrid CPU, a busy VM host)
  // finish an even split at the slower one's pace. Each row is still computed whole by one
  // thread, so the outputs do not depend on which one.
  pool.parallel_chunks(n, pool.chunk_for(n, 16), rows);
}

}  // namespace gemstage
