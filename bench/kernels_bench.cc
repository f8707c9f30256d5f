// Kernel micro-benchmarks at Gemma 4 E2B shapes (hidden 1536, MLP 6144, vocab 262144).
//
//   build/gemstage_bench --benchmark_min_time=0.2
//   build/gemstage_bench --benchmark_filter='Gemv/Q8'
//
// GEMV (S = 1, decode) and GEMM (S = 128, a prefill chunk) per weight format F32, BF16, Q8_0,
// Q4_0. The GEMVs run once per SIMD tier the CPU supports (Gemv/Q4_0/avx2, .../avx512), so one
// run gives the tiers' ratios; the GEMMs and the rest run under the tier in force (GEMSTAGE_ISA).
// "GB/s" is stored weight bytes read per second (the decode roofline); "GFLOP/s" counts 2 * S * out
// * in. Times are wall-clock (the pool's workers do the work). Weights are random, generated once
// per (format, shape) and kept only while consecutive benchmarks use them.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/attention.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "kernels/quant.h"

using namespace gemstage;

namespace {

// Cheap deterministic pseudo-normal-ish values in [-scale, scale].
struct Lcg {
  uint64_t s;
  float next(float scale) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t a = static_cast<uint32_t>(s >> 40) & 0xffffu,
                   b = static_cast<uint32_t>(s >> 24) & 0xffffu;
    return (static_cast<float>(a) + static_cast<float>(b) - 65535.0f) / 65535.0f * scale;
  }
};

// A pool per thread count and tier (nullopt: GEMSTAGE_ISA, else the CPU's best), kept for the
// whole run so the benchmarks do not time thread start-up.
ThreadPool& pool_of(int threads, std::optional<CpuTier> tier = std::nullopt) {
  static std::map<std::pair<int, int>, std::unique_ptr<ThreadPool>> pools;
  const CpuTier t = tier ? *tier : cpu_tier_from_environment();
  auto& p = pools[{threads, static_cast<int>(t)}];
  if (!p) p = std::make_unique<ThreadPool>(threads, t);
  return *p;
}

struct Matrix {
  DType t;
  int64_t out, in;
  std::vector<uint8_t> bytes;
  WeightView view;
};

// The one live random matrix (the LM head is 0.2-1.6 GB, so only one is kept at a time).
const Matrix& matrix(DType t, int64_t out, int64_t in) {
  static std::unique_ptr<Matrix> cur;
  if (cur && cur->t == t && cur->out == out && cur->in == in) return *cur;
  cur.reset();
  auto m = std::make_unique<Matrix>();
  m->t = t;
  m->out = out;
  m->in = in;
  const size_t rb =
      dtype_is_quantized(t) ? quant_row_bytes(t, in) : static_cast<size_t>(in) * dtype_size(t);
  m->bytes.resize(rb * static_cast<size_t>(out));
  pool_of(2).parallel_for(
      static_cast<size_t>(out),
      [&](size_t b, size_t e) {
        std::vector<float> row(static_cast<size_t>(in));
        Lcg rng{b * 2654435761u + 1};
        for (size_t r = b; r < e; ++r) {
          for (auto& v : row) v = rng.next(0.05f);
          uint8_t* dst = m->bytes.data() + r * rb;
          if (dtype_is_quantized(t)) {
            quantize_row(t, row.data(), in, dst);
          } else if (t == DType::F32) {
            std::memcpy(dst, row.data(), rb);
          } else {
            for (int64_t k = 0; k < in; ++k) {
              const uint16_t h = f32_to_bf16(row[static_cast<size_t>(k)]);
              std::memcpy(dst + 2 * k, &h, 2);
            }
          }
        }
      },
      64);
  m->view = WeightView{"bench", t, {out, in}, m->bytes.data(), m->bytes.size()};
  cur = std::move(m);
  return *cur;
}

std::vector<float> activations(int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  Lcg rng{42};
  for (auto& v : x) v = rng.next(2.0f);
  return x;
}

// Weights of the DRAM variant: enough copies of the matrix to fill this, one per call in turn.
constexpr size_t kStackBytes = size_t{1280} << 20;

// args: out, in, S, threads. tier: the tier to run under (nullopt: GEMSTAGE_ISA or the best).
// from_dram: each call multiplies the next of enough copies of the matrix to fill kStackBytes, so
// every call reads its weights from DRAM as a decode step of a model far past the caches does (the
// last-level cache of a server CPU holds a whole 31B-shape MLP matrix, which one copy measures
// from cache).
void run_matmul(benchmark::State& state, DType t, std::optional<CpuTier> tier, bool from_dram) {
  const int64_t out = state.range(0), in = state.range(1), S = state.range(2);
  const int threads = static_cast<int>(state.range(3));
  const Matrix& m = matrix(t, out, in);
  std::vector<uint8_t> stack;
  std::vector<WeightView> views{m.view};
  if (from_dram) {
    const size_t copies = std::max<size_t>(2, kStackBytes / m.bytes.size());
    stack.resize(copies * m.bytes.size());
    views.clear();
    for (size_t c = 0; c < copies; ++c) {
      uint8_t* dst = stack.data() + c * m.bytes.size();
      std::memcpy(dst, m.bytes.data(), m.bytes.size());
      views.push_back(WeightView{"bench", t, {out, in}, dst, m.bytes.size()});
    }
  }
  const auto x = activations(S * in);
  std::vector<float> y(static_cast<size_t>(S * out));
  ThreadPool& pool = pool_of(threads, tier);
  size_t c = 0;
  for (auto _ : state) {
    matmul(pool, x.data(), S, views[c], y.data());
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
    c = (c + 1) % views.size();
  }
  const double it = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(it * static_cast<double>(m.bytes.size())));
  state.counters["GB/s"] = benchmark::Counter(it * static_cast<double>(m.bytes.size()) / 1e9,
                                              benchmark::Counter::kIsRate);
  state.counters["GFLOP/s"] = benchmark::Counter(it * 2.0 * static_cast<double>(S * out * in) / 1e9,
                                                 benchmark::Counter::kIsRate);
  state.SetLabel(dtype_is_quantized(t) ? quant_isa(pool.tier(), S) : matmul_isa(pool.tier()));
}

void BM_Matmul(benchmark::State& state, DType t, std::optional<CpuTier> tier) {
  run_matmul(state, t, tier, false);
}

void BM_MatmulDram(benchmark::State& state, DType t, CpuTier tier) {
  run_matmul(state, t, tier, true);
}

void gemv_args(benchmark::internal::Benchmark* b, bool lm_head) {
  b->ArgNames({"out", "in", "S", "threads"});
  if (lm_head) {
    b->Args({262144, 1536, 1, 1})->Args({262144, 1536, 1, 2});
  } else {
    for (auto [o, i] : {std::pair<int64_t, int64_t>{6144, 1536}, {1536, 6144}})
      for (int th : {1, 2}) b->Args({o, i, 1, th});
  }
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

// The MLP's up and down shapes, and the double-wide down of the KV-shared layers, at a 128-row
// prefill chunk and a 512-row prompt.
void gemm_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"out", "in", "S", "threads"});
  for (auto [o, i] : {std::pair<int64_t, int64_t>{6144, 1536}, {1536, 6144}, {1536, 12288}})
    for (int64_t S : {128, 512})
      for (int th : {1, 2}) b->Args({o, i, S, th});
  // The 12B's MLP (3840 -> 15360 -> 3840: 3840 = 7.5 chunks, so every row ends in a short
  // chunk) at a 64-row prompt, past the caches.
  for (auto [o, i] : {std::pair<int64_t, int64_t>{15360, 3840}, {3840, 15360}})
    b->Args({o, i, 64, 2});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

// Batched decode: one row per sequence, 1 to 16 sequences, on the LM head (226 MB in Q4_0, far
// past the caches, so the weights stream from DRAM as in a real decode step) and the MLP shapes.
void batched_decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"out", "in", "S", "threads"});
  // The E2B LM head and MLP, then the 31B MLP (the verify rows of a speculative round).
  for (auto [o, i] : {std::pair<int64_t, int64_t>{262144, 1536},
                      {6144, 1536},
                      {1536, 6144},
                      {21504, 5376},
                      {5376, 21504}})
    for (int64_t S : {1, 2, 4, 8, 16}) b->Args({o, i, S, 2});
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

struct Fmt {
  const char* name;
  DType t;
};
constexpr Fmt kFormats[] = {
    {"F32", DType::F32}, {"BF16", DType::BF16}, {"Q8_0", DType::Q8_0}, {"Q4_0", DType::Q4_0}};

// rmsnorm over E2B hidden rows. args: rows
void BM_RmsNorm(benchmark::State& state) {
  const int64_t rows = state.range(0), n = 1536;
  const auto x = activations(rows * n), w = activations(n);
  std::vector<float> y(x.size());
  for (auto _ : state) {
    rmsnorm_rows(cpu_tier_from_environment(), x.data(), rows, n, w.data(), 1e-6f, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(state.iterations() * rows * n * 4 * 2);
}
BENCHMARK(BM_RmsNorm)->Arg(1)->Arg(128);

// M query heads of one KV group (head_dim 256 sliding / 512 full) over n_keys cached keys, all
// visible: 8 queries is one decode row of E2B's group, 16 a prefill task. args: hd, n_keys, M.
// Rows are f32, or bf16 bits (kv_bf16) as the cache stores them for quantized bundles.
void BM_Attention(benchmark::State& state, bool kv_bf16) {
  const int64_t hd = state.range(0), n = state.range(1), M = state.range(2);
  const auto q = activations(M * hd), k = activations(n * hd), v = activations(n * hd);
  std::vector<uint16_t> k16(k.size()), v16(v.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k16[i] = f32_to_bf16(k[i]);
    v16[i] = f32_to_bf16(v[i]);
  }
  std::vector<float> out(static_cast<size_t>(M * hd));
  ThreadPool& pool = pool_of(1);
  QueryBlock queries;
  queries.tier = pool.tier();
  for (int64_t m = 0; m < M; ++m) queries.add(q.data() + m * hd, out.data() + m * hd, 0, n - 1);
  AttentionScratch scratch;
  // As a pool job, so with subnormals flushed as in the decoder: softmax tails are subnormal, and
  // each one costs a microcode assist otherwise.
  for (auto _ : state) {
    pool.parallel_for(1, [&](size_t, size_t) {
      if (kv_bf16)
        attend_contiguous(queries, hd, k16.data(), v16.data(), scratch);
      else
        attend_contiguous(queries, hd, k.data(), v.data(), scratch);
    });
    benchmark::DoNotOptimize(out.data());
  }
  const double it = static_cast<double>(state.iterations());
  const double row_bytes = kv_bf16 ? 2 : 4;
  state.SetBytesProcessed(static_cast<int64_t>(it * 2.0 * static_cast<double>(n * hd) * row_bytes));
  state.counters["GFLOP/s"] = benchmark::Counter(it * 4.0 * static_cast<double>(M * n * hd) / 1e9,
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK_CAPTURE(BM_Attention, f32, false)
    ->Args({256, 512, 8})
    ->Args({256, 512, 16})
    ->Args({512, 4096, 8});
// bf16 rows as the cache stores them for quantized bundles; 32768 keys is E2B's full-layer
// attention of one decoded token (one KV head, 8 query heads) at depth 32k.
BENCHMARK_CAPTURE(BM_Attention, bf16, true)
    ->Args({256, 512, 16})
    ->Args({512, 4096, 8})
    ->Args({512, 32768, 8});

// One decoded token's attention as the decoder runs it at depth: the group's 8 queries over
// n_keys bf16 rows, the keys split into one range per thread, the partial softmax states merged.
// The cache lives in one allocation, as LayerKvCache's does. args: n_keys, threads
void BM_AttentionDecode(benchmark::State& state) {
  const int64_t hd = 512, M = 8, n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const auto q = activations(M * hd);
  std::vector<uint16_t> k16(static_cast<size_t>(n * hd)), v16(k16.size());
  {
    const auto f = activations(n * hd);
    for (size_t i = 0; i < k16.size(); ++i) k16[i] = v16[(i + 7) % v16.size()] = f32_to_bf16(f[i]);
  }
  std::vector<float> part_out(static_cast<size_t>(threads * M * hd)),
      part_max(static_cast<size_t>(threads * M)), part_sum(part_max.size()),
      out(static_cast<size_t>(M * hd));
  std::vector<AttentionScratch> scratch(static_cast<size_t>(threads));
  ThreadPool& pool = pool_of(threads);
  const int64_t per_part = (n + threads - 1) / threads;
  for (auto _ : state) {
    pool.parallel_for(static_cast<size_t>(threads), [&](size_t b, size_t e) {
      for (size_t t = b; t < e; ++t) {
        const int64_t lo = static_cast<int64_t>(t) * per_part, hi = std::min(n, lo + per_part) - 1;
        QueryBlock queries;
        queries.tier = pool.tier();
        for (int64_t m = 0; m < M; ++m)
          queries.add(q.data() + m * hd, part_out.data() + (static_cast<int64_t>(t) * M + m) * hd,
                      lo, hi);
        AttentionScratch& s = scratch[t];
        attend_queries_partial(
            queries, hd, [&](int64_t j) { return k16.data() + j * hd; },
            [&](int64_t j) { return v16.data() + j * hd; }, s);
        std::copy(s.max.begin(), s.max.end(), part_max.begin() + static_cast<int64_t>(t) * M);
        std::copy(s.sum.begin(), s.sum.end(), part_sum.begin() + static_cast<int64_t>(t) * M);
      }
    });
    for (int64_t m = 0; m < M; ++m)
      merge_partial_attention(pool.tier(), part_out.data() + m * hd, part_max.data() + m,
                              part_sum.data() + m, threads, M, hd, out.data() + m * hd);
    benchmark::DoNotOptimize(out.data());
  }
  const double it = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(it * 2.0 * static_cast<double>(n * hd) * 2));
  state.counters["GFLOP/s"] = benchmark::Counter(it * 4.0 * static_cast<double>(M * n * hd) / 1e9,
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionDecode)
    ->ArgNames({"keys", "threads"})
    ->Args({32768, 1})
    ->Args({32768, 2})
    ->UseRealTime();

const bool registered = [] {
  std::vector<CpuTier> simd;
  for (CpuTier t : cpu_supported_tiers())
    if (t != CpuTier::Scalar) simd.push_back(t);
  for (const Fmt& f : kFormats)
    for (CpuTier t : simd)
      gemv_args(benchmark::RegisterBenchmark(
                    (std::string("Gemv/") + f.name + "/" + cpu_tier_name(t)).c_str(), BM_Matmul,
                    f.t, std::optional<CpuTier>(t)),
                false);
  for (const Fmt& f : kFormats)
    gemm_args(benchmark::RegisterBenchmark((std::string("Gemm/") + f.name).c_str(), BM_Matmul, f.t,
                                           std::optional<CpuTier>()));
  for (const Fmt& f : kFormats)
    for (CpuTier t : simd)
      gemv_args(benchmark::RegisterBenchmark(
                    (std::string("GemvLmHead/") + f.name + "/" + cpu_tier_name(t)).c_str(),
                    BM_Matmul, f.t, std::optional<CpuTier>(t)),
                true);
  for (const Fmt& f : kFormats)
    if (dtype_is_quantized(f.t))
      for (CpuTier t : simd)
        batched_decode_args(benchmark::RegisterBenchmark(
            (std::string("BatchedDecode/") + f.name + "/" + cpu_tier_name(t)).c_str(), BM_Matmul,
            f.t, std::optional<CpuTier>(t)));
  // The 31B MLP at a speculative round's 1-4 verify rows, weights from DRAM.
  for (CpuTier t : simd)
    benchmark::RegisterBenchmark((std::string("VerifyRowsDram/Q4_0/") + cpu_tier_name(t)).c_str(),
                                 BM_MatmulDram, DType::Q4_0, t)
        ->ArgNames({"out", "in", "S", "threads"})
        ->ArgsProduct({{21504}, {5376}, {1, 2, 3, 4}, {2}})
        ->ArgsProduct({{5376}, {21504}, {1, 2, 3, 4}, {2}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
