// The one CPU feature probe and the one override every kernel dispatch reads.
//
// A tier is a set of kernel implementations: scalar (the portable reference, every machine),
// avx2 (AVX2 + FMA + F16C), avx512 (AVX-512 F/BW/VL, with VNNI for the quantized matmuls when
// the CPU has it), amx (avx512 plus AMX-BF16 tiles for quantized prefill) and neon (aarch64
// Advanced SIMD: arm/vec_neon.h, and the NEON matmuls, whose int8 dots use SDOT where the CPU has
// the dot-product extension). The tier in force is the best one the CPU supports unless the
// environment variable GEMSTAGE_ISA names another (read once, at the first cpu_tier() call), or
// set_cpu_tier (tests, `bench --isa`) picks one. Asking for a tier the CPU lacks is an error that
// names what the CPU has.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gemstage {

enum class CpuTier { Scalar, Avx2, Avx512, Amx, Neon };

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

// Probed once per process.
const CpuFeatures& cpu_features();
// "avx2 avx512 avx512vnni ..." (the flags above that are set), for messages and bench output.
std::string cpu_features_string();

const char* cpu_tier_name(CpuTier t);
// "scalar" / "avx2" / "avx512" / "amx" / "neon"; nullopt for anything else.
std::optional<CpuTier> parse_cpu_tier(std::string_view name);
bool cpu_tier_supported(CpuTier t);
// Every tier this CPU can run, scalar first, best last.
std::vector<CpuTier> cpu_supported_tiers();
CpuTier cpu_best_tier();

// The tier in force. The first call reads GEMSTAGE_ISA and fails (naming the variable, the value
// and this CPU's tiers) when the value is unknown or unsupported; the CLI calls it at start-up so
// that error comes before any work.
CpuTier cpu_tier();
// Overrides the tier for the whole process; fails like GEMSTAGE_ISA does. `source` names where
// the request came from ("--isa", "GEMSTAGE_ISA", a test) for the error message.
void set_cpu_tier(CpuTier t, std::string_view source = "set_cpu_tier");
// The tier by name, as set_cpu_tier; also fails on an unknown name.
void set_cpu_tier(std::string_view name, std::string_view source);

// True when the tier in force is at least `t` on the x86 ladder scalar < avx2 < avx512 < amx.
inline bool cpu_tier_at_least(CpuTier t) {
  const CpuTier c = cpu_tier();
  return c != CpuTier::Neon && static_cast<int>(c) >= static_cast<int>(t);
}

// Sets a tier for the lifetime of the object and restores the previous one (tests).
class ScopedCpuTier {
 public:
  explicit ScopedCpuTier(CpuTier t) : previous_(cpu_tier()) { set_cpu_tier(t, "ScopedCpuTier"); }
  ~ScopedCpuTier() { set_cpu_tier(previous_, "ScopedCpuTier"); }
  ScopedCpuTier(const ScopedCpuTier&) = delete;
  ScopedCpuTier& operator=(const ScopedCpuTier&) = delete;

 private:
  CpuTier previous_;
};

}  // namespace gemstage
