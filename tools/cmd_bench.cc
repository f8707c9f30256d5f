// gemstage bench: llama-bench-style throughput (pp = prefill, tg = decode) at given depths,
// plus load time, peak RSS, the machine's measured read bandwidth and the decode bound it implies.
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"
#include "kernels/cpu_features.h"
#include "kernels/vec_kernels.h"
#include "runtime/speculative.h"
#include "stage/bundle.h"
#include "stage/call_pipeline.h"
#include "stage/sequence.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "trace/op_profile.h"

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
  bool profile = false;             // each test's wall time by kind of work (trace/op_profile.h)
};

// Decode speed with and without a speculative drafter, interleaved per repetition so both see
// the same machine load: plain greedy steps against speculative_generate (adaptive) from the
// same prompt, with the drafter's acceptance. Each --draft-agree fraction P adds a row where the
// drafter still runs (its cost is paid) but each draft is then replaced by the target's own next
// greedy token with probability P, else by another token: the speed curve against acceptance
// that a real drafter on real text lands somewhere on. Either way the speculative output must
// equal the plain greedy output, which is checked.
void bench_drafter(const BenchArgs& a, ThreadPool& pool, const Sequence& p,
                   const std::vector<int32_t>& prompt, const std::vector<int64_t>& gens,
                   std::ostream& out) {
  const auto drafter = open_drafter(a.model_draft);
  check_assistant_matches(drafter->config(), p.config(), a.model_draft, a.model);
  std::vector<double> agree = {-1};  // the drafter's own drafts first
  agree.insert(agree.end(), a.draft_agree.begin(), a.draft_agree.end());
  // The last three columns say where a round's time went: a plain step, one draft step, and
  // one verify call (its mean rows, k + 1) against a plain step.
  out << "| drafter | test | k max | drafts agree | plain t/s | drafter t/s | ratio | acceptance "
         "| plain step ms | draft step ms | verify ms (rows) |\n"
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  const auto argmax = [](const FloatTensor& l) {
    const float* row = l.row(0);
    return static_cast<int32_t>(std::max_element(row, row + l.dim(1)) - row);
  };
  for (int64_t ng : gens) {
    if (ng <= 1) continue;
    for (double P : agree) {
      double plain_s = 0, spec_s = 0;
      SpeculativeStats st;
      for (int rep = 0; rep < a.reps; ++rep) {
        const int64_t ctx = static_cast<int64_t>(prompt.size()) + ng + a.draft_max + 2;
        Sequence plain(p.shared_model(), ctx, p.kv_type());
        FloatTensor l = plain.forward(pool, prompt, nullptr, false, nullptr);
        const int64_t vocab = l.dim(1);
        std::vector<int32_t> plain_ids;
        double t0 = now_seconds();
        for (int64_t i = 1; i < ng; ++i) {
          const int32_t next = argmax(l);
          plain_ids.push_back(next);
          l = plain.forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr);
        }
        plain_s += now_seconds() - t0;
        plain_ids.push_back(argmax(l));
        Sequence spec(p.shared_model(), ctx, p.kv_type());
        SpeculativeOptions opt;
        opt.draft_max = a.draft_max;
        std::mt19937_64 rng(static_cast<uint64_t>(rep) * 1000003u +
                            static_cast<uint64_t>(std::max(0.0, P) * 1e6));
        if (P >= 0)
          opt.replace_drafts = [&](int64_t emitted, std::span<int32_t> drafts) {
            std::uniform_real_distribution<double> u(0.0, 1.0);
            for (size_t i = 0; i < drafts.size(); ++i) {
              const int32_t right = plain_ids[static_cast<size_t>(emitted) + i];
              drafts[i] = u(rng) < P ? right : static_cast<int32_t>((right + 1) % vocab);
            }
          };
        bool first = true;
        const std::vector<int32_t> ids = speculative_generate(
            pool, spec, *drafter, prompt, ng, nullptr, opt, &st, nullptr, [&](int32_t) {
              if (first) t0 = now_seconds();  // after the prefill, as above
              first = false;
              return true;
            });
        spec_s += now_seconds() - t0;
        if (ids != plain_ids)
          fail("bench: the speculative decode's output differs from plain greedy decoding (",
               ids.size(), " against ", plain_ids.size(),
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
// activations and heap. From /proc/self/status on Linux; elsewhere only the peak (getrusage).
struct MemoryUse {
  double peak_gb = 0, file_gb = -1, anon_gb = -1;
};

MemoryUse memory_use() {
  MemoryUse m;
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  m.peak_gb = static_cast<double>(ru.ru_maxrss) * 1024 / 1e9;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    std::istringstream fields(line);
    std::string key;
    double kb = 0;
    if (!(fields >> key >> kb)) continue;
    if (key == "RssFile:") m.file_gb = kb * 1024 / 1e9;
    if (key == "RssAnon:") m.anon_gb = kb * 1024 / 1e9;
  }
  return m;
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
  const VecKernels* k = vec_kernels();  // null on the scalar tier
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

int run_bench(const BenchArgs& a) {
  if (!a.isa.empty()) set_cpu_tier(a.isa, "bench --isa");
  const std::string tier = cpu_tier_name(cpu_tier());
  const double t0 = now_seconds();
  auto p = Sequence::open(a.model);
  apply_cache_type(*p, a.cache_type);
  const double t_load = now_seconds() - t0;
  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count());
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
    op_profile_enable(a.profile);
    return now_seconds();
  };
  auto timing_ends = [&](Row& r, double t_start) {
    const double dt = now_seconds() - t_start;
    op_profile_enable(false);
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
  for (Row& r : rows) {
    p->reset(std::min<int64_t>(model_ctx, r.n_depth + r.n_prompt + r.n_gen + 8));
    const std::vector<RemoteStageStats> hops_before = hop_stats();
    op_profile_reset();
    if (a.warmup) {
      // As llama-bench: one untimed pass (the prompt, or one decoded token) so the first
      // repetition does not pay the page faults of the mmapped weights and scratch buffers.
      p->reset();
      if (r.n_prompt > 0)
        p->prefill(pool, random_ids(r.n_prompt), nullptr, 512, false, nullptr);
      else
        p->forward(pool, random_ids(1), nullptr, false, nullptr);
    }
    for (int rep = 0; rep < a.reps; ++rep) {
      p->reset();
      if (r.n_depth > 0 && r.n_seq == 1)
        p->prefill(pool, random_ids(r.n_depth), nullptr, 512, false, nullptr);
      // Batched rows set their sequences up first and start their own clocks.
      const double ts = r.n_seq == 1 ? timing_starts() : 0.0;
      if (r.n_prompt > 0 && r.n_seq == 1) {
        p->prefill(pool, random_ids(r.n_prompt), nullptr, 512, false, nullptr);
      } else if (r.n_prompt > 0) {
        // n_seq prompts of n_prompt rows prefilled together, chunk by chunk: one batched call
        // takes 512 rows of each (llama-batched-bench's S_PP: all prompt tokens / time).
        std::vector<std::unique_ptr<Sequence>> seqs;
        std::vector<std::vector<int32_t>> ids;
        for (int64_t k = 0; k < r.n_seq; ++k) {
          seqs.push_back(
              std::make_unique<Sequence>(p->shared_model(), p->max_context(), p->kv_type()));
          if (r.n_depth > 0)
            seqs.back()->prefill(pool, random_ids(r.n_depth), nullptr, 512, false, nullptr);
          ids.push_back(random_ids(r.n_prompt));
        }
        const double t_start = timing_starts();
        std::vector<BatchEntry> batch;
        for (int64_t at = 0; at < r.n_prompt; at += 512) {
          batch.clear();
          const auto n = static_cast<size_t>(std::min<int64_t>(512, r.n_prompt - at));
          for (int64_t k = 0; k < r.n_seq; ++k)
            batch.push_back({seqs[static_cast<size_t>(k)].get(),
                             std::span<const int32_t>(ids[static_cast<size_t>(k)])
                                 .subspan(static_cast<size_t>(at), n),
                             nullptr, false});
          Sequence::forward_batch(pool, batch);
        }
        r.ts.push_back(static_cast<double>(r.n_prompt * r.n_seq) / timing_ends(r, t_start));
        continue;
      } else if (r.n_seq == 1) {
        for (int64_t i = 0; i < r.n_gen; ++i) {
          const std::vector<int32_t> one = random_ids(1);
          p->forward(pool, one, nullptr, false, nullptr);
        }
      } else {
        // n_seq sequences of one model, each at the depth, decoding together: one batched call
        // a step, so the weights are read once for all of them. With stages on other processes
        // (MPI ranks), as the server does: the sequences split over one call per process, kept in
        // flight together, each group's next step starting as soon as its last one finished.
        std::vector<std::unique_ptr<Sequence>> seqs;
        for (int64_t k = 0; k < r.n_seq; ++k) {
          seqs.push_back(
              std::make_unique<Sequence>(p->shared_model(), p->max_context(), p->kv_type()));
          if (r.n_depth > 0)
            seqs.back()->prefill(pool, random_ids(r.n_depth), nullptr, 512, false, nullptr);
        }
        const int64_t groups = std::min<int64_t>(r.n_seq, CallPipeline::depth(p->model()));
        CallPipeline pipeline(pool);
        std::vector<int32_t> next(static_cast<size_t>(r.n_seq));
        std::vector<int64_t> steps(static_cast<size_t>(groups), 0);
        std::map<uint64_t, int64_t> group_of;
        auto start_group = [&](int64_t g) {
          std::vector<BatchEntry> batch;
          for (int64_t k = g; k < r.n_seq; k += groups) {
            next[static_cast<size_t>(k)] = random_ids(1)[0];
            batch.push_back({seqs[static_cast<size_t>(k)].get(),
                             std::span<const int32_t>(&next[static_cast<size_t>(k)], 1), nullptr,
                             false});
          }
          group_of[pipeline.start(batch)] = g;
        };
        const double t_start = timing_starts();
        for (int64_t g = 0; g < groups; ++g) start_group(g);
        while (pipeline.in_flight() > 0) {
          CallPipeline::Finished f = pipeline.next();
          if (f.error) std::rethrow_exception(f.error);
          const int64_t g = group_of.at(f.call);
          group_of.erase(f.call);
          if (++steps[static_cast<size_t>(g)] < r.n_gen) start_group(g);
        }
        r.ts.push_back(static_cast<double>(r.n_gen * r.n_seq) / timing_ends(r, t_start));
        continue;
      }
      const double dt = timing_ends(r, ts);
      r.ts.push_back(static_cast<double>(r.n_prompt + r.n_gen) / dt);
    }
    r.op_s = op_profile_seconds();
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
                     {"decode_bound_ts", gbs * 1e9 / bpt}});
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
  std::cout << "| model | threads | isa | test | t/s |\n| --- | ---: | --- | ---: | ---: |\n";
  for (const Row& r : rows) {
    const auto [m, sd] = stats(r.ts);
    std::cout << "| " << a.model << " | " << pool.size() << " | " << tier << " | " << test_name(r)
              << " | " << std::fixed << std::setprecision(2) << m << " ± " << sd << " |\n";
  }
  std::cout << std::setprecision(3) << "ISA tier " << tier << " (CPU: " << cpu_features_string()
            << "); KV cache " << kv_type_name(p->kv_type()) << "; load " << t_load
            << " s; peak RSS " << rss_gb << " GB";
  if (mem.file_gb >= 0)
    std::cout << " (resident at the end: " << mem.file_gb << " GB of mapped bundle files, "
              << mem.anon_gb << " GB anonymous: KV cache, activations, heap)";
  std::cout << "; read bandwidth " << gbs << " GB/s with " << pool.size()
            << " threads; a decoded token reads " << bpt / 1e9
            << " GB of weights, so the decode bound is " << gbs * 1e9 / bpt << " t/s\n";
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
                  "kernel tier: scalar, avx2, avx512, amx or neon (default: GEMSTAGE_ISA, else the "
                  "best this CPU supports; one the CPU lacks is an error)");
  sub->add_option("-r,--repetitions", a->reps, "repetitions per test")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_flag("!--no-warmup", a->warmup, "skip the untimed warm-up pass before each test");
  sub->add_flag("--profile", a->profile,
                "also print each test's wall time by kind of work (embeddings, attention "
                "projections, attention, MLP projections, experts, per-layer input, head, other)");
  sub->add_flag("--json", a->json,
                "print a JSON array (n_prompt, n_gen, n_depth, avg_ts, stddev_ts, ...)");
  reg.add(sub, [a] { return run_bench(*a); });
}

}  // namespace gemstage::cli
