// The one CPU feature probe, the tiers of kernels it allows, and the GEMSTAGE_ISA override.
//
// A tier is a set of kernel implementations: scalar (the portable reference, every machine),
// avx2 (AVX2 + FMA + F16C), avx512 (AVX-512 F/BW/VL, with VNNI for the quantized matmuls when
// the CPU has it), amx (avx512 plus AMX-BF16 tiles for quantized prefill), and on aarch64 neon
// (Advanced SIMD: arm/vec_neon.h and the NEON matmuls, int8 dots with SMULL), dotprod (neon with
// the quantized matmuls' int8 dots on SDOT, FEAT_DotProd) and i8mm (dotprod with the quantized
// prefill on SMMLA, FEAT_I8MM: arm/quant_i8mm.h). Which tier a computation runs is not process
// state: it is the tier of the ThreadPool the computation is handed (core/thread_pool.h), chosen by
// whoever made the pool (the CLI from GEMSTAGE_ISA or `bench --isa`, a test per case). Asking for a
// tier the CPU lacks is an error that names what the CPU has.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gemstage {

// Two ladders: scalar < avx2 < avx512 < amx on x86, scalar < neon < dotprod < i8mm on aarch64.
enum class CpuTier { Scalar, Avx2, Avx512, Amx, Neon, Dotprod, I8mm };

struct CpuFeatures {
  bool avx2 = false;        // AVX2 + FMA + F16C
  bool avx512 = false;      // AVX-512 F + BW + VL
  bool avx512vnni = false;  // AVX-512 VNNI (with avx512)
  bool avx512bf16 = false;
  bool amx_bf16 = false;  // AMX-TILE + AMX-BF16 + AVX512-BF16, and the OS granted tile state
  bool neon = false;      // aarch64 Advanced SIMD
  bool neon_dotprod = false;
  bool neon_i8mm = false;
};

// Probed once per process (a read-only fact of the machine).
const CpuFeatures& cpu_features();
// "avx2 avx512 avx512vnni ..." (the flags above that are set), for messages and bench output.
std::string cpu_features_string();

const char* cpu_tier_name(CpuTier t);
// "scalar" / "avx2" / "avx512" / "amx" / "neon" / "dotprod" / "i8mm"; nullopt for anything else.
std::optional<CpuTier> parse_cpu_tier(std::string_view name);
bool cpu_tier_supported(CpuTier t);
// Every tier this CPU can run, scalar first, best last.
std::vector<CpuTier> cpu_supported_tiers();
CpuTier cpu_best_tier();

// The tier a front end runs when nobody chose one: GEMSTAGE_ISA when set, else the best tier
// this CPU supports. Fails (naming the variable, the value and this CPU's tiers) when the value
// is unknown or unsupported; the CLI calls it at start-up so that error comes before any work.
// Reads the environment each call: no process state remembers a tier. A ThreadPool carries the
// tier its jobs run (core/thread_pool.h), so two pools in one process may run different tiers.
CpuTier cpu_tier_from_environment();
// `t` if this CPU supports it; else fails like GEMSTAGE_ISA does, `source` naming where the
// request came from ("--isa", a test).
CpuTier checked_cpu_tier(CpuTier t, std::string_view source);
// The same by name; also fails on an unknown name.
CpuTier checked_cpu_tier(std::string_view name, std::string_view source);

// Whether `t` is one of the aarch64 tiers (neon, dotprod, i8mm), which share the NEON vector and
// float kernels and differ in the quantized matmuls.
inline bool cpu_tier_is_arm(CpuTier t) {
  return t == CpuTier::Neon || t == CpuTier::Dotprod || t == CpuTier::I8mm;
}

// True when `c` is at least `t` on the x86 ladder scalar < avx2 < avx512 < amx.
inline bool cpu_tier_at_least(CpuTier c, CpuTier t) {
  return !cpu_tier_is_arm(c) && static_cast<int>(c) >= static_cast<int>(t);
}

}  // namespace gemstage
