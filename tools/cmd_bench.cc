// gemstage bench: llama-bench-style throughput (pp = prefill, tg = decode) at given depths,
// plus load time, peak RSS, the machine's measured read bandwidth and the decode bound it implies.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/op_profile.h"
#include "core/platform.h"
#include "gemma4/tensor_table.h"
#include "kernels/int8_peak.h"
#include "kernels/quant.h"
#include "kernels/vec_kernels.h"
#include "runtime/engine.h"
#include "runtime/speculative.h"
#include "stage/bundle.h"
#include "stage/call_pipeline.h"
#include "stage/sequence.h"
#include "tools/cli_common.h"
#include "tools/commands.h"

namespace gemstage::cli {

namespace {

struct BenchArgs {
  std::string model;
  std::string prompts = "128", gens = "32", depths = "0", sequences = "1";
  int threads = 0, reps = 5;
  bool json = false;
  bool warmup = true;
  std::string cache_type = "auto";
  std::string isa;          // empty: GEMSTAGE_ISA or the CPU's best tier
  std::string model_draft;  // a gemma4_assistant drafter: decode with and without it
  int draft_max = 4;
  std::vector<double> draft_agree;  // with model_draft: drafts replaced to agree this often
  bool profile = false;             // each test's wall time by kind of work (core/op_profile.h)
};

// Decode speed with and without a speculative drafter, interleaved per repetition so both see
// the same machine load: plain greedy decoding against drafting (adaptive) from the same prompt,
// both on the engine, with the drafter's acceptance. Each --draft-agree fraction P adds a row where
// the drafter still runs (its cost is paid) but each draft is then replaced by the target's own
// next greedy token with probability P, else by another token: the speed curve against acceptance
// that a real drafter on real text lands somewhere on. Either way the speculative output must
// equal the plain greedy output, which is checked.
void bench_drafter(const BenchArgs& a, ThreadPool& pool, const Sequence& p,
                   const std::vector<int32_t>& prompt, const std::vector<int64_t>& gens,
                   std::ostream& out) {
  const std::shared_ptr<const AssistantModel> drafter = open_drafter(a.model_draft);
  check_assistant_matches(drafter->config(), p.config(), a.model_draft, a.model);
  std::vector<double> agree = {-1};  // the drafter's own drafts first
  agree.insert(agree.end(), a.draft_agree.begin(), a.draft_agree.end());
  // The last three columns say where a round's time went: a plain step, one draft step, and
  // one verify call (its mean rows, k + 1) against a plain step.
  out << "| drafter | test | k max | drafts agree | plain t/s | drafter t/s | ratio | acceptance "
         "| plain step ms | draft step ms | verify ms (rows) |\n"
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  for (int64_t ng : gens) {
    if (ng <= 1) continue;
    for (double P : agree) {
      double plain_s = 0, spec_s = 0;
      SpeculativeStats st;
      for (int rep = 0; rep < a.reps; ++rep) {
        // Both decodes run on the engine serve runs, one slot each, greedy without stop ids:
        // ng tokens, the first from the prompt's logits, so ng - 1 timed decode steps.
        EngineOptions eo;
        eo.kv_budget = static_cast<int64_t>(prompt.size()) + ng + a.draft_max + 2;
        eo.kv_type = p.kv_type();
        auto decode = [&](const std::shared_ptr<const AssistantModel>& d,
                          std::optional<SpeculativeOptions> so) {
          eo.drafter = d;
          Engine engine(p.shared_model(), nullptr, pool, eo);
          EngineRequest q;
          q.ids = prompt;
          q.gen.max_tokens = static_cast<int>(ng);
          q.gen.sampling = SamplingParams::greedy();
          q.draft = std::move(so);
          const std::shared_ptr<Generation> g = engine.submit(std::move(q));
          engine.run_until_idle();
          Generation::Result res = g->result();
          if (res.error) fail("bench: ", res.error->message);
          return res;
        };
        const Generation::Result plain = decode(nullptr, std::nullopt);
        plain_s += plain.decode_seconds;
        const std::vector<int32_t>& plain_ids = plain.generation.tokens;
        SpeculativeOptions opt;
        opt.draft_max = a.draft_max;
        const int64_t vocab = p.config().text.vocab_size;
        std::mt19937_64 rng(static_cast<uint64_t>(rep) * 1000003u +
                            static_cast<uint64_t>(std::max(0.0, P) * 1e6));
        if (P >= 0)
          opt.replace_drafts = [&](int64_t emitted, std::span<int32_t> drafts) {
            std::uniform_real_distribution<double> u(0.0, 1.0);
            for (size_t i = 0; i < drafts.size(); ++i) {
              const size_t at = static_cast<size_t>(emitted) + i;
              const int32_t right = at < plain_ids.size() ? plain_ids[at] : 0;
              drafts[i] = u(rng) < P ? right : static_cast<int32_t>((right + 1) % vocab);
            }
          };
        const Generation::Result spec = decode(drafter, opt);
        spec_s += spec.decode_seconds;
        st.rounds += spec.draft.rounds;
        st.drafted += spec.draft.drafted;
        st.accepted += spec.draft.accepted;
        st.plain_steps += spec.draft.plain_steps;
        st.draft_steps += spec.draft.draft_steps;
        st.verify_rows += spec.draft.verify_rows;
        st.draft_seconds += spec.draft.draft_seconds;
        st.verify_seconds += spec.draft.verify_seconds;
        if (spec.generation.tokens != plain_ids)
          fail("bench: the speculative decode's output differs from plain greedy decoding (",
               spec.generation.tokens.size(), " against ", plain_ids.size(),
               " tokens); this is a bug, please report it");
      }
      const double n = static_cast<double>((ng - 1) * a.reps);
      out << "| " << a.model_draft << " | tg" << ng << " | " << a.draft_max << " | ";
      if (P >= 0)
        out << std::fixed << std::setprecision(2) << P;
      else
        out << "drafter";
      out << " | " << std::fixed << std::setprecision(2) << n / plain_s << " | " << n / spec_s
          << " | " << std::setprecision(3) << plain_s / spec_s << " | " << st.acceptance() << " ("
          << st.accepted << "/" << st.drafted << ") | " << std::setprecision(1) << 1e3 * plain_s / n
          << " | ";
      if (st.draft_steps > 0)
        out << 1e3 * st.draft_seconds / static_cast<double>(st.draft_steps);
      else
        out << "-";
      out << " | ";
      if (st.rounds > 0)
        out << 1e3 * st.verify_seconds / static_cast<double>(st.rounds) << " ("
            << static_cast<double>(st.verify_rows) / static_cast<double>(st.rounds) << ")";
      else
        out << "-";
      out << " |\n";
    }
  }
}

std::vector<int64_t> int_list(const std::string& s, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    try {
      size_t used = 0;
      const long long v = std::stoll(part, &used);
      if (used != part.size() || v < 0) throw std::invalid_argument(part);
      out.push_back(v);
    } catch (const std::exception&) {
      fail(flag, ": '", part,
           "' is not a non-negative integer (use a comma-separated list such as 128,512)");
    }
  }
  return out;
}

// Resident memory: the peak, and what the pages resident at the end are. File pages are the
// mmapped bundle: the weights read per token plus every embedding and PLE row gathered so far
// (random prompts gather rows all over the tables); anonymous pages are the KV cache,
// activations and heap. The split is known on Linux only (core/platform.h); -1 elsewhere.
struct MemoryUse {
  double peak_gb = 0, file_gb = -1, anon_gb = -1;
};

MemoryUse memory_use() {
  const platform::ProcessMemory pm = platform::process_memory();
  const auto gb = [](int64_t bytes) { return bytes < 0 ? -1.0 : static_cast<double>(bytes) / 1e9; };
  return {std::max(0.0, gb(pm.peak_bytes)), gb(pm.resident_file_bytes), gb(pm.resident_anon_bytes)};
}

// Sustained read bandwidth: every thread sums its part of a buffer much larger than the caches
// with the tier's vector dot (one stream, a == b). How wide the loads are matters: on the 2-core
// Xeon a 64-bit scalar or SSE2 sum read 6-8 GB/s a thread where AVX-512 loads read 12, so a
// portable loop understated the bound below what decode reached.
double measure_read_gbs(ThreadPool& pool) {
  const size_t n = size_t{1} << 28;  // 1 GiB of floats
  std::vector<float> buf(n);
  pool.parallel_for(
      buf.size(), [&](size_t b, size_t e) { std::fill(buf.data() + b, buf.data() + e, 1.0f); },
      4096);
  const VecKernels* k = vec_kernels(pool.tier());  // null on the scalar tier
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> partial(static_cast<size_t>(pool.size()), 0.0);
    const double t0 = now_seconds();
    pool.parallel_for(
        buf.size(),
        [&](size_t b, size_t e) {
          const float* p = buf.data() + b;
          const auto len = static_cast<int64_t>(e - b);
          double s = 0;
          if (k) {
            s = k->dot(p, p, len);
          } else {
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            for (int64_t i = 0; i + 4 <= len; i += 4) {
              s0 += p[i];
              s1 += p[i + 1];
              s2 += p[i + 2];
              s3 += p[i + 3];
            }
            s = s0 + s1 + s2 + s3;
          }
          partial[b * partial.size() / buf.size()] += s;
        },
        4096);
    const double dt = now_seconds() - t0;
    volatile double sink = partial[0];
    (void)sink;
    best = std::max(best, static_cast<double>(buf.size() * sizeof(float)) / dt / 1e9);
  }
  return best;
}

// Weight bytes a decoded token reads: every matrix except the gathered tables (token embedding
// and PLE rows in the embeddings stage), plus one row of each table.
double bytes_per_token(const Sequence& p) {
  const TextWeights& w = p.embeddings_model().weights();
  double b = static_cast<double>(w.per_layer_model_projection.nbytes);
  b += static_cast<double>(w.embed_tokens.nbytes) / std::max<int64_t>(1, w.embed_tokens.rows());
  b += static_cast<double>(w.embed_tokens_per_layer.nbytes) /
       std::max<int64_t>(1, w.embed_tokens_per_layer.rows());
  return b + p.decode_weight_bytes();
}

// Multiply-adds a token costs in the matrices: those the tensor table marks as read whole per
// decoded token (their elements times the share read, as the byte count above), plus the per-layer
// input projection of the embeddings stage. From the config's table, so stages on other ranks
// count too.
double macs_per_token(const Sequence& p) {
  double macs = 0;
  for (const TensorSpec& s : tensor_table(p.config())) {
    if (s.role != TensorRole::Required || s.shape.size() != 2) continue;
    const bool projection = s.key.ends_with("per_layer_model_projection.weight");
    if (s.decode_read_in == 0 && !projection) continue;
    macs += static_cast<double>(s.shape[0]) * static_cast<double>(s.shape[1]) *
            (projection ? 1.0 : s.decode_share);
  }
  return macs;
}

int run_bench(const BenchArgs& a, const RunContext& cx) {
  const CpuTier isa =
      a.isa.empty() ? cpu_tier_from_environment() : checked_cpu_tier(a.isa, "bench --isa");
  const std::string tier = cpu_tier_name(isa);
  const double t0 = now_seconds();
  auto p = std::make_unique<Sequence>(cx.models.open(a.model));
  apply_cache_type(*p, a.cache_type);
  const double t_load = now_seconds() - t0;
  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count(), isa);
  OpProfile profile;
  const auto prompts = int_list(a.prompts, "-p"), gens = int_list(a.gens, "-n"),
             depths = int_list(a.depths, "-d"), sequences = int_list(a.sequences, "--parallel");
  for (int64_t ns : sequences)
    if (ns < 1) fail("--parallel (--sequences): each count must be at least 1, got ", ns);
  const int64_t V = p->config().text.vocab_size;
  std::mt19937 rng(1);
  auto random_ids = [&](int64_t n) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    const std::vector<int> avoid = p->config().placeholder_token_ids();
    for (auto& x : ids) do
        x = static_cast<int32_t>(10 +
                                 rng() % static_cast<uint32_t>(std::min<int64_t>(V - 10, 200000)));
      while (std::find(avoid.begin(), avoid.end(), x) != avoid.end());
    return ids;
  };
  struct Row {
    int64_t n_prompt, n_gen, n_depth;
    std::vector<double> ts;
    int64_t n_seq = 1;  // sequences in one batch: each prefills its prompt / decodes a token a step
    std::vector<RemoteStageStats> hops;  // what each remote stage's calls cost during the row
    double timed_s = 0;                  // --profile: the timed wall time of all repetitions
    OpSeconds op_s{};                    // --profile: of which, per kind of work
  };
  // A row's name in the tables, llama-bench style: pp512, tg32 x4 @ d4096.
  auto test_name = [](const Row& r) {
    std::string name =
        r.n_prompt ? "pp" + std::to_string(r.n_prompt) : "tg" + std::to_string(r.n_gen);
    if (r.n_seq > 1) name += " x" + std::to_string(r.n_seq);
    if (r.n_depth) name += " @ d" + std::to_string(r.n_depth);
    return name;
  };
  // --profile: the op timers run only inside the timed part of a repetition.
  auto timing_starts = [&] {
    if (a.profile) pool.set_profile(&profile);
    return now_seconds();
  };
  auto timing_ends = [&](Row& r, double t_start) {
    const double dt = now_seconds() - t_start;
    pool.set_profile(nullptr);
    r.timed_s += dt;
    return dt;
  };
  // Stages on other ranks (mpirun): their call counters, to report each row's hops.
  auto hop_stats = [&] {
    std::vector<RemoteStageStats> v;
    for (const auto& r : p->model().remote_stages())
      v.push_back(r ? r->stats() : RemoteStageStats{});
    return v;
  };
  std::vector<Row> rows;
  for (int64_t d : depths) {
    for (int64_t np : prompts)
      if (np > 0)
        for (int64_t ns : sequences) rows.push_back({np, 0, d, {}, ns});
    for (int64_t ng : gens)
      if (ng > 0)
        for (int64_t ns : sequences) rows.push_back({0, ng, d, {}, ns});
  }
  const int64_t model_ctx = p->max_context();
  // Refuse up front what would only fail after the depth's prefill (minutes at large depths).
  for (const Row& r : rows)
    if (r.n_depth + r.n_prompt + r.n_gen > model_ctx)
      fail("bench: depth ", r.n_depth, " + ", r.n_prompt + r.n_gen, " tokens needs a context of ",
           r.n_depth + r.n_prompt + r.n_gen, ", but this model's is ", model_ctx,
           " (a bundle's is its export --max-context; re-export with a larger one or lower -d)");
  // Every row runs through the engine serve runs (runtime/engine.h), greedy and without stop ids
  // on random ids, so bench measures what serve does: one slot per sequence, the depth prefilled
  // untimed as a first request each slot's caches keep, then the timed requests reusing it.
  auto greedy = [](int max_tokens) {
    GenerationOptions g;
    g.max_tokens = max_tokens;
    g.sampling = SamplingParams::greedy();
    return g;
  };
  for (Row& r : rows) {
    const int64_t per_seq = std::min<int64_t>(model_ctx, r.n_depth + r.n_prompt + r.n_gen + 8);
    EngineOptions eo;
    eo.slots = static_cast<int>(r.n_seq);
    eo.kv_budget = per_seq * r.n_seq;
    // As llama-batched-bench's S_PP: one batched call takes up to 512 prompt rows of each.
    eo.batch_rows = eo.ubatch_rows = static_cast<int>(512 * r.n_seq);
    eo.kv_type = p->kv_type();
    eo.pipeline_depth = cx.pipeline_depth;
    Engine engine(p->shared_model(), nullptr, pool, eo);
    // Runs `requests` together; returns each one's result and the wall time of the run.
    auto run_all = [&](std::vector<EngineRequest> requests, bool timed) {
      std::vector<std::shared_ptr<Generation>> gens_out;
      for (EngineRequest& q : requests) gens_out.push_back(engine.submit(std::move(q)));
      const double t_start = timed ? timing_starts() : now_seconds();
      engine.run_until_idle();
      const double dt = timed ? timing_ends(r, t_start) : now_seconds() - t_start;
      std::vector<Generation::Result> results;
      for (const auto& g : gens_out) {
        results.push_back(g->result());
        if (results.back().error) fail("bench: ", results.back().error->message);
      }
      return std::pair{std::move(results), dt};
    };
    const std::vector<RemoteStageStats> hops_before = hop_stats();
    profile.reset();
    if (a.warmup) {
      // As llama-bench: one untimed pass (the prompt, or one decoded token) so the first
      // repetition does not pay the page faults of the mmapped weights and scratch buffers.
      EngineRequest w;
      w.ids = random_ids(std::max<int64_t>(1, r.n_prompt) + 1);
      w.gen = greedy(1);
      run_all({std::move(w)}, false);
    }
    for (int rep = 0; rep < a.reps; ++rep) {
      // The depth: each slot's first request, untimed; a request's first sampled token is not
      // fed back, so the slot's caches then hold exactly the depth's rows.
      std::vector<std::vector<int32_t>> depth(static_cast<size_t>(r.n_seq));
      if (r.n_depth > 0) {
        std::vector<EngineRequest> setup;
        for (auto& d : depth) {
          d = random_ids(r.n_depth);
          EngineRequest q;
          q.ids = d;
          q.gen = greedy(1);
          setup.push_back(std::move(q));
        }
        run_all(std::move(setup), false);
      }
      // The timed requests: the depth (found in the caches) plus the prompt, then n_gen decode
      // steps after the first token (which the prompt's own logits give).
      std::vector<EngineRequest> timed;
      for (const auto& d : depth) {
        EngineRequest q;
        q.ids = d;
        const std::vector<int32_t> fresh = random_ids(std::max<int64_t>(1, r.n_prompt));
        q.ids.insert(q.ids.end(), fresh.begin(), fresh.end());
        q.gen = greedy(r.n_prompt > 0 ? 1 : static_cast<int>(r.n_gen) + 1);
        timed.push_back(std::move(q));
      }
      const auto [results, dt] = run_all(std::move(timed), true);
      double span = 0;  // the slowest request's prefill (pp) or decode (tg)
      for (const Generation::Result& res : results)
        span = std::max(span, r.n_prompt > 0 ? res.prefill_seconds : res.decode_seconds);
      // One sequence: its own prefill or decode time, as llama-bench times a test. Several: all
      // their tokens over the wall time of the batch (llama-batched-bench's S_PP / S_TG).
      const double secs = r.n_seq == 1 ? span : (r.n_prompt > 0 ? dt : span);
      r.ts.push_back(static_cast<double>((r.n_prompt + r.n_gen) * r.n_seq) / secs);
    }
    r.op_s = profile.seconds();
    r.hops = hop_stats();
    for (size_t i = 0; i < r.hops.size(); ++i) {
      RemoteStageStats& h = r.hops[i];
      const RemoteStageStats& b = hops_before[i];
      h.calls -= b.calls;
      h.rows -= b.rows;
      h.bytes_sent -= b.bytes_sent;
      h.bytes_received -= b.bytes_received;
      h.round_trip_seconds -= b.round_trip_seconds;
      h.compute_seconds -= b.compute_seconds;
    }
  }
  const MemoryUse mem = memory_use();
  const double rss_gb = mem.peak_gb;
  const double gbs = measure_read_gbs(pool);
  const double bpt = bytes_per_token(*p);
  // The int8 ceiling of each row: the peak of the instruction its GEMM calls run (prefill: up to
  // 512 prompt rows per sequence in one call; batched decode: one row per sequence), probed once
  // per instruction with every pool thread busy.
  const double mpt = macs_per_token(*p);
  std::map<std::string, Int8Peak> peaks;
  auto peak_of = [&](const Row& r) {
    const int64_t call_rows =
        r.n_prompt > 0 ? std::min<int64_t>(r.n_prompt, 512) * r.n_seq : r.n_seq;
    const std::string isa_name = quant_isa(pool.tier(), call_rows);
    auto it = peaks.find(isa_name);
    if (it == peaks.end()) it = peaks.emplace(isa_name, probe_int8_peak(pool, call_rows)).first;
    return it->second;
  };
  auto stats = [](const std::vector<double>& v) {
    double m = 0, s = 0;
    for (double x : v) m += x;
    m /= static_cast<double>(v.size());
    for (double x : v) s += (x - m) * (x - m);
    return std::pair{m, v.size() > 1 ? std::sqrt(s / static_cast<double>(v.size() - 1)) : 0.0};
  };
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      const auto [m, sd] = stats(r.ts);
      const Int8Peak peak = peak_of(r);
      out.push_back({{"model_filename", a.model},
                     {"n_threads", pool.size()},
                     {"isa", tier},
                     {"cpu_features", cpu_features_string()},
                     {"n_prompt", r.n_prompt},
                     {"n_gen", r.n_gen},
                     {"n_depth", r.n_depth},
                     {"n_parallel", r.n_seq},
                     {"n_sequences", r.n_seq},
                     {"type_k", kv_type_name(p->kv_type())},
                     {"type_v", kv_type_name(p->kv_type())},
                     {"avg_ts", m},
                     {"stddev_ts", sd},
                     {"samples_ts", r.ts},
                     {"load_seconds", t_load},
                     {"peak_rss_gb", rss_gb},
                     {"final_rss_file_gb", mem.file_gb},
                     {"final_rss_anon_gb", mem.anon_gb},
                     {"read_bandwidth_gbs", gbs},
                     {"decode_bound_ts", gbs * 1e9 / bpt},
                     {"macs_per_token", mpt},
                     {"gmacs", m * mpt / 1e9},
                     {"int8_peak_gmacs", peak.gmacs},
                     {"int8_peak_instruction", peak.instruction},
                     {"int8_peak_fraction", m * mpt / 1e9 / peak.gmacs}});
      if (a.profile) {
        nlohmann::json prof = {{"timed_seconds", r.timed_s}};
        for (size_t k = 0; k < r.op_s.size(); ++k)
          prof[op_kind_name(static_cast<OpKind>(k))] = r.op_s[k];
        out.back()["profile_seconds"] = prof;
      }
    }
    std::cout << out.dump(2) << "\n";
    if (!a.model_draft.empty()) bench_drafter(a, pool, *p, random_ids(32), gens, std::cerr);
    return 0;
  }
  std::cout << "| model | threads | isa | test | t/s | G MAC/s | % int8 peak |\n"
               "| --- | ---: | --- | ---: | ---: | ---: | ---: |\n";
  for (const Row& r : rows) {
    const auto [m, sd] = stats(r.ts);
    const Int8Peak peak = peak_of(r);
    std::cout << "| " << a.model << " | " << pool.size() << " | " << tier << " | " << test_name(r)
              << " | " << std::fixed << std::setprecision(2) << m << " ± " << sd << " | "
              << std::setprecision(1) << m * mpt / 1e9 << " | " << 100 * m * mpt / 1e9 / peak.gmacs
              << "% |\n";
  }
  std::cout << std::setprecision(3) << "ISA tier " << tier << " (CPU: " << cpu_features_string()
            << "); KV cache " << kv_type_name(p->kv_type()) << "; load " << t_load
            << " s; peak RSS " << rss_gb << " GB";
  if (mem.file_gb >= 0)
    std::cout << " (resident at the end: " << mem.file_gb << " GB of mapped bundle files, "
              << mem.anon_gb << " GB anonymous: KV cache, activations, heap)";
  std::cout << "; read bandwidth " << gbs << " GB/s with " << pool.size()
            << " threads; a decoded token reads " << bpt / 1e9
            << " GB of weights, so the decode bound is " << gbs * 1e9 / bpt
            << " t/s; a token costs " << mpt / 1e9 << " G multiply-adds; int8 peak";
  for (const auto& [isa_name, peak] : peaks)
    std::cout << " " << peak.gmacs << " G MAC/s (" << peak.instruction << ", " << isa_name << ")";
  std::cout << " with " << pool.size() << " threads\n";
  if (a.profile) {
    // Shares of each test's timed wall time; "other" is what no op timer covers (norms, RoPE,
    // activations, residual adds, copies, thread hand-offs).
    std::cout << "\n| test";
    for (size_t k = 0; k < static_cast<size_t>(OpKind::kCount); ++k)
      std::cout << " | " << op_kind_name(static_cast<OpKind>(k));
    std::cout << " | other |\n| ---";
    for (size_t k = 0; k <= static_cast<size_t>(OpKind::kCount); ++k) std::cout << " | ---:";
    std::cout << " |\n" << std::setprecision(1);
    for (const Row& r : rows) {
      std::cout << "| " << test_name(r);
      double covered = 0;
      const double total = std::max(r.timed_s, 1e-12);
      for (double sec : r.op_s) {
        covered += sec;
        std::cout << " | " << 100 * sec / total << "%";
      }
      std::cout << " | " << 100 * std::max(0.0, total - covered) / total << "% |\n";
    }
  }
  // Stages on other ranks (mpirun): what each hop cost per call, row by row (warm-up included).
  // With several calls in flight (x N rows) a call's round trip includes the time it waited
  // behind the others at the far rank, so only one sequence's rows show the cost of the way.
  for (const Row& r : rows)
    for (size_t i = 0; i < r.hops.size(); ++i) {
      const RemoteStageStats& st = r.hops[i];
      if (st.calls == 0) continue;
      const double calls = static_cast<double>(st.calls);
      std::cout << (r.n_prompt ? "pp" + std::to_string(r.n_prompt) : "tg" + std::to_string(r.n_gen))
                << (r.n_seq > 1 ? " x" + std::to_string(r.n_seq) : std::string())
                << ", remote stage " << p->stages()[i].id << ": " << st.calls << " calls, "
                << st.rows << " rows; per call " << st.bytes_sent / calls / 1e3 << " kB out, "
                << st.bytes_received / calls / 1e3 << " kB back, round trip "
                << st.round_trip_seconds / calls * 1e3 << " ms, its compute "
                << st.compute_seconds / calls * 1e3 << " ms";
      if (r.n_seq == 1)
        std::cout << ", so " << (st.round_trip_seconds - st.compute_seconds) / calls * 1e3
                  << " ms on the way";
      std::cout << "\n";
    }
  if (!a.model_draft.empty()) bench_drafter(a, pool, *p, random_ids(32), gens, std::cout);
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<BenchArgs>();
  auto* sub = app.add_subcommand(
      "bench", "Measure prefill (pp) and decode (tg) tokens/s, llama-bench style");
  sub->add_option("-m,--model", a->model, "Hugging Face checkpoint directory or gemstage bundle")
      ->required();
  sub->add_option("-p,--n-prompt", a->prompts, "prompt lengths, comma-separated")
      ->capture_default_str();
  sub->add_option("-n,--n-gen", a->gens, "generated token counts, comma-separated")
      ->capture_default_str();
  sub->add_option("-d,--n-depth", a->depths, "context depths to run each test at, comma-separated")
      ->capture_default_str();
  sub->add_option("-t,--threads", a->threads, "worker threads (default: all cores)");
  sub->add_option("--parallel,--sequences", a->sequences,
                  "sequences in one batch, comma-separated (llama-batched-bench's -npl): each "
                  "prefills its own prompt / decodes a token per batched call; ppN xK and tgN xK "
                  "report the tokens/s of all K together")
      ->capture_default_str();
  add_cache_type(sub, a->cache_type);
  sub->add_option(
      "--model-draft", a->model_draft,
      "also decode with this gemma4_assistant drafter (also -md; a checkpoint, or a bundle "
      "whose drafter stage to use): t/s with and without it and its acceptance, from a "
      "random 32-token prompt");
  sub->add_option("--draft-max", a->draft_max, "drafts per round at most (default 4)")
      ->check(CLI::Range(1, 64));
  sub->add_option("--draft-agree", a->draft_agree,
                  "with -md: also measure with each draft replaced by the target's own greedy "
                  "token with these probabilities (comma-separated, 0-1; the drafter still runs), "
                  "for the speed curve against acceptance")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--isa", a->isa,
                  "kernel tier: scalar, avx2, avx512, amx (x86), neon, dotprod, i8mm (aarch64) "
                  "(default: GEMSTAGE_ISA, else the best this CPU supports; one the CPU lacks is "
                  "an error)");
  sub->add_option("-r,--repetitions", a->reps, "repetitions per test")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_flag("!--no-warmup", a->warmup, "skip the untimed warm-up pass before each test");
  sub->add_flag("--profile", a->profile,
                "also print each test's wall time by kind of work (embeddings, attention "
                "projections, attention, MLP projections, experts, per-layer input, head, other)");
  sub->add_flag("--json", a->json,
                "print a JSON array (n_prompt, n_gen, n_depth, avg_ts, stddev_ts, ...)");
  reg.add(sub, [a, &cx = reg.context] { return run_bench(*a, cx); });
}

}  // namespace gemstage::cli
