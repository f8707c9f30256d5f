// Elementwise and row-wise kernels of the Gemma 4 forward pass. Each states the reference
// formula it implements; the scalar code in ops.cc is the reference, and gelu_tanh_mul, softcap,
// softmax_inplace, rmsnorm_rows (and attention.h's dot/axpy and key blocks) dispatch to AVX-512
// (x86/vec_avx512.h), AVX2 (x86/vec_avx2.h) or NEON (arm/vec_neon.h) twins by the tier in force
// (core/cpu_features.h) the caller names (its ThreadPool's tier()), through the tier's table
// (vec_kernels.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/cpu_features.h"

namespace gemstage {

// Which twins the dispatching kernels take under `tier`; tests pass each tier this CPU has to
// compare it against the scalar reference on one machine.
enum class VecPath { Scalar, Avx2, Avx512, Neon };
VecPath vector_ops_path(CpuTier tier);

// Gemma4RMSNorm: y = x * (mean(x^2) + eps)^(-1/2) * w. The weight is used as-is (not 1 + w).
// w == nullptr is the scale-free variant (attention V, the multimodal embedders).
void rmsnorm_rows(CpuTier tier, const float* x, int64_t rows, int64_t n, const float* w, float eps,
                  float* y);

// gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
float gelu_tanh(float x);
// out[i] = gelu_tanh(gate[i]) * up[i]
void gelu_tanh_mul(CpuTier tier, const float* gate, const float* up, int64_t n, float* out);

// cap * tanh(x / cap), in place.
void softcap(CpuTier tier, float* x, int64_t n, float cap);

// Rotate-half RoPE tables for one layer type. inv_freq has head_dim/2 slots; slots past
// n_rotated are zero (proportional RoPE), so those channel pairs pass through unchanged.
struct RopeTable {
  int head_dim = 0;
  int n_rotated = 0;  // leading frequency slots that are non-zero
  std::vector<float> inv_freq;

  // default RoPE: every pair rotates, inv_freq[i] = theta^(-2i/d).
  static RopeTable standard(int head_dim, double theta);
  // proportional RoPE: the first partial*d/2 slots of a full-width table, the rest zero.
  static RopeTable proportional(int head_dim, double theta, double partial_rotary_factor);
};

// cos and sin of every rotated slot at `rows` consecutive positions from `first`. A forward
// computes them once per layer type and every layer of that type reuses them (sin/cos per layer
// was ~5% of a 512-token prefill).
struct RopeAngles {
  int head_dim = 0, n_rotated = 0;
  std::vector<float> cos, sin;  // [rows, n_rotated], row r at position first + r

  static RopeAngles at(const RopeTable& table, int64_t first, int64_t rows);
};

// Applies RoPE at row `row` of the angles (position first + row) to n_heads consecutive vectors of
// head_dim floats.
void apply_rope(const RopeAngles& angles, int64_t row, float* v, int n_heads);
// The same at `pos` alone.
void apply_rope(const RopeTable& table, int64_t pos, float* v, int n_heads);

// Softmax over n scores in place (max-subtracted, f32).
void softmax_inplace(CpuTier tier, float* s, int64_t n);

}  // namespace gemstage
