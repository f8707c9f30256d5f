// The machine's int8 multiply-add peak for the instruction a quantized GEMM of a given row count
// runs on a tier, with every thread of the pool busy: the ceiling `bench` reports prefill and
// batched decode against (as its read-bandwidth probe is the ceiling of decode).
//
// Each thread runs independent accumulator chains of that instruction (enough to cover its
// latency), so the loop is bound by the instruction's issue rate alone: VPDPBUSD zmm (64 MACs) on
// the VNNI kernels, VPMADDUBSW + VPMADDWD ymm (32 MACs) on AVX2, TDPBF16PS (16 x 16 x 32 = 8192
// MACs a tile op) on AMX prefill, SDOT (16 MACs) on NEON with the dot-product extension, SMULL +
// SADALP (8 MACs a multiply) without it, and an int32 loop on the scalar tier.
#pragma once

#include <cstdint>

#include "core/thread_pool.h"

namespace gemstage {

struct Int8Peak {
  double gmacs = 0;              // G multiply-adds per second, all threads together
  const char* instruction = "";  // what was issued, as the comment above names it
};

// The peak of the instruction quant_matmul uses for calls of `rows` activation rows on the pool's
// tier (quant_isa). Runs for about `seconds` (best of three passes of a third each).
Int8Peak probe_int8_peak(ThreadPool& pool, int64_t rows, double seconds = 0.3);

namespace peak_loops {
// The per-ISA loops (int8_peak.cc, x86/int8_peak_x86.cc, arm/int8_peak_neon.cc): run `iters`
// iterations of the independent chains on this thread and return the multiply-adds issued.
// `seed` keeps the operands opaque to the compiler.
uint64_t scalar(int64_t iters, int seed);
uint64_t vnni_zmm(int64_t iters, int seed);
uint64_t maddubs_ymm(int64_t iters, int seed);
uint64_t amx_bf16(int64_t iters, int seed);
uint64_t neon_sdot(int64_t iters, int seed);
uint64_t neon_smull(int64_t iters, int seed);
uint64_t neon_smmla(int64_t iters, int seed);
}  // namespace peak_loops

}  // namespace gemstage
