#include "core/cpu_features.h"

#include <cstdlib>

#include "core/error.h"
#include "core/platform.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace gemstage {

namespace {

CpuFeatures probe() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0). F16C is
  // read from CPUID leaf 1 (ECX bit 29) because clang's builtin does not know its name.
  unsigned l1a = 0, l1b = 0, l1c = 0, l1d = 0;
  const bool f16c = __get_cpuid(1, &l1a, &l1b, &l1c, &l1d) && ((l1c >> 29) & 1);
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  f.avx512vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
  unsigned a = 0, b = 0, c = 0, d = 0;
  bool amx_bits = false;
  if (f.avx512 && __get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    amx_bits = ((d >> 22) & 1) && ((d >> 24) & 1);  // AMX-BF16, AMX-TILE
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f.avx512bf16 = (a1 >> 5) & 1;
  }
  // The OS hands out the 8 KiB tile state only on request; without the grant the first tile
  // instruction faults.
  f.amx_bf16 = amx_bits && f.avx512bf16 && f.avx512vnni && platform::request_amx_tile_state();
#elif defined(__aarch64__)
  f.neon = true;  // Advanced SIMD is mandatory on aarch64
  const platform::ArmExtensions arm = platform::arm_extensions();
  f.neon_dotprod = arm.dotprod;
  f.neon_i8mm = arm.i8mm;
#endif
  return f;
}

constexpr CpuTier kAllTiers[] = {CpuTier::Scalar, CpuTier::Avx2,    CpuTier::Avx512, CpuTier::Amx,
                                 CpuTier::Neon,   CpuTier::Dotprod, CpuTier::I8mm};

std::string supported_list() {
  std::string s;
  for (CpuTier t : cpu_supported_tiers()) {
    if (!s.empty()) s += ", ";
    s += cpu_tier_name(t);
  }
  return s;
}

void check_supported(CpuTier t, std::string_view source) {
  if (!cpu_tier_supported(t))
    fail(source, ": ISA tier '", cpu_tier_name(t),
         "' is not supported by this CPU (it has: ", cpu_features_string(),
         "); choose one of: ", supported_list());
}

CpuTier parse_or_fail(std::string_view name, std::string_view source) {
  const std::optional<CpuTier> t = parse_cpu_tier(name);
  if (!t)
    fail(source, ": unknown ISA tier '", name,
         "'; expected scalar, avx2, avx512, amx, neon, dotprod or i8mm (this CPU supports: ",
         supported_list(), ")");
  return *t;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = probe();
  return f;
}

std::string cpu_features_string() {
  const CpuFeatures& f = cpu_features();
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(f.avx2, "avx2");
  add(f.avx512, "avx512");
  add(f.avx512vnni, "avx512vnni");
  add(f.avx512bf16, "avx512bf16");
  add(f.amx_bf16, "amx-bf16");
  add(f.neon, "neon");
  add(f.neon_dotprod, "dotprod");
  add(f.neon_i8mm, "i8mm");
  return s.empty() ? "no SIMD extensions gemstage uses" : s;
}

const char* cpu_tier_name(CpuTier t) {
  switch (t) {
    case CpuTier::Scalar:
      return "scalar";
    case CpuTier::Avx2:
      return "avx2";
    case CpuTier::Avx512:
      return "avx512";
    case CpuTier::Amx:
      return "amx";
    case CpuTier::Neon:
      return "neon";
    case CpuTier::Dotprod:
      return "dotprod";
    case CpuTier::I8mm:
      return "i8mm";
  }
  return "?";
}

std::optional<CpuTier> parse_cpu_tier(std::string_view name) {
  for (CpuTier t : kAllTiers)
    if (name == cpu_tier_name(t)) return t;
  return std::nullopt;
}

bool cpu_tier_supported(CpuTier t) {
  const CpuFeatures& f = cpu_features();
  switch (t) {
    case CpuTier::Scalar:
      return true;
    case CpuTier::Avx2:
      return f.avx2;
    case CpuTier::Avx512:
      return f.avx512;
    case CpuTier::Amx:
      return f.amx_bf16;
    case CpuTier::Neon:
      return f.neon;
    case CpuTier::Dotprod:
      return f.neon && f.neon_dotprod;
    case CpuTier::I8mm:
      // Calls too short for SMMLA run the dot-product kernels (arm/quant_i8mm.h).
      return f.neon && f.neon_dotprod && f.neon_i8mm;
  }
  return false;
}

std::vector<CpuTier> cpu_supported_tiers() {
  std::vector<CpuTier> out;
  for (CpuTier t : kAllTiers)
    if (cpu_tier_supported(t)) out.push_back(t);
  return out;
}

CpuTier cpu_best_tier() {
  return cpu_supported_tiers().back();
}

CpuTier cpu_tier_from_environment() {
  if (const char* env = std::getenv("GEMSTAGE_ISA"); env && *env)
    return checked_cpu_tier(std::string_view(env), "GEMSTAGE_ISA");
  return cpu_best_tier();
}

CpuTier checked_cpu_tier(CpuTier t, std::string_view source) {
  check_supported(t, source);
  return t;
}

CpuTier checked_cpu_tier(std::string_view name, std::string_view source) {
  return checked_cpu_tier(parse_or_fail(name, source), source);
}

}  // namespace gemstage
