// The Gemma 4 MTP drafter and speculative decoding against the gemma4-tiny-assistant fixtures
// (docs/gemma4-mtp.md): every drafter tap of K = 4 steps from three starts, the per-round
// drafts and accepted counts, greedy output identical to plain decoding (also past the sliding
// ring's wrap, where rollback must keep the window intact), mismatched pairs refused, and the
// sampling acceptance rule's output distribution.
#include "runtime/speculative.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "gemma4/assistant_model.h"
#include "gemma4/config.h"
#include "gemma4/presets.h"
#include "stage/sequence.h"
#include "test_util.h"
#include "trace/taps.h"

namespace gemstage {
namespace {

using testing::error_of;
using testing::load_ids;
using testing::max_abs_diff;

std::string fx(const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/" + rel;
}

struct FixtureSet {
  std::string name, assistant, target;
};

const FixtureSet kSets[] = {
    {"e_text", "assistant_e", "gemma4-tiny/model"},
    {"e_long", "assistant_e", "gemma4-tiny/model"},
    {"dense_text", "assistant_dense", "gemma4-tiny-dense/model"},
    {"dense_long", "assistant_dense", "gemma4-tiny-dense/model"},
};

std::string set_file(const FixtureSet& s, const std::string& tap) {
  return fx("gemma4-tiny-assistant/" + s.name + "/" + tap + ".npy");
}

std::map<std::string, double> tolerances(const FixtureSet& s) {
  std::ifstream f(fx("gemma4-tiny-assistant/" + s.name + "/manifest.json"));
  const auto j = nlohmann::json::parse(f);
  std::map<std::string, double> out;
  for (const auto& [k, v] : j.at("tolerances_atol_computed").items()) out[k] = v.get<double>();
  return out;
}

std::vector<float> slice(const std::vector<float>& all, size_t begin, size_t n) {
  return {all.begin() + static_cast<std::ptrdiff_t>(begin),
          all.begin() + static_cast<std::ptrdiff_t>(begin + n)};
}

std::shared_ptr<const Model> target_model(const FixtureSet& s) {
  static std::map<std::string, std::shared_ptr<const Model>> cache;
  auto& m = cache[s.target];
  if (!m) m = Model::open(fx(s.target));
  return m;
}

const AssistantModel& drafter(const std::string& name) {
  static std::map<std::string, std::unique_ptr<AssistantModel>> cache;
  auto& m = cache[name];
  if (!m) m = AssistantModel::open(fx("gemma4-tiny-assistant/" + name));
  return *m;
}

std::vector<int32_t> plain_greedy(ThreadPool& pool, const std::shared_ptr<const Model>& model,
                                  const std::vector<int32_t>& prompt, int64_t n_new) {
  Sequence seq(model);
  FloatTensor logits = seq.forward(pool, prompt, nullptr, false, nullptr);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n_new; ++i) {
    const float* l = logits.row(0);
    const int32_t t = static_cast<int32_t>(std::max_element(l, l + logits.dim(1)) - l);
    out.push_back(t);
    if (i + 1 < n_new)
      logits = seq.forward(pool, std::span<const int32_t>(&out.back(), 1), nullptr, false, nullptr);
  }
  return out;
}

class DraftFixture : public ::testing::TestWithParam<FixtureSet> {};

TEST_P(DraftFixture, EveryDrafterTapMatches) {
  const FixtureSet& s = GetParam();
  ThreadPool pool(2);
  const auto tol = tolerances(s);
  const AssistantModel& a = drafter(s.assistant);
  const auto model = target_model(s);
  check_assistant_matches(a.config(), model->config(), s.assistant, s.target);
  const std::vector<int32_t> prompt = load_ids(set_file(s, "input_ids"));
  const auto starts = load_npy(set_file(s, "draft_start_positions")).to_i64();
  const auto tokens = load_npy(set_file(s, "draft_input_tokens")).to_i64();
  const auto ids = load_npy(set_file(s, "draft_ids")).to_i64();
  const auto want_h = load_npy(set_file(s, "draft_target_hidden")).to_f32();
  const auto want_pre = load_npy(set_file(s, "draft_pre_projection")).to_f32();
  const auto want_layers = load_npy(set_file(s, "draft_layer_out")).to_f32();
  const auto want_final = load_npy(set_file(s, "draft_final_hidden")).to_f32();
  const auto want_hout = load_npy(set_file(s, "draft_hidden_out")).to_f32();
  const auto want_logits = load_npy(set_file(s, "draft_logits")).to_f32();
  const bool centroids = a.config().use_ordered_embeddings;
  const std::vector<int64_t> want_topk =
      centroids ? load_npy(set_file(s, "draft_centroid_topk")).to_i64() : std::vector<int64_t>{};
  ASSERT_EQ(starts.size(), 3u);
  const size_t K = 4, Ht = static_cast<size_t>(a.config().backbone_hidden_size),
               Ha = static_cast<size_t>(a.config().text.hidden_size),
               NL = static_cast<size_t>(a.config().text.num_hidden_layers),
               V = static_cast<size_t>(a.config().text.vocab_size);
  const size_t topk = static_cast<size_t>(a.config().centroid_top_k);

  Sequence seq(model);
  const AssistantDonors donors = assistant_donor_layers(model->config().text);
  std::vector<float> h;
  for (size_t si = 0; si < starts.size(); ++si) {
    const int64_t P = starts[si];
    ASSERT_GT(P, seq.n_past());
    ASSERT_LE(P, static_cast<int64_t>(prompt.size()));
    // Run the prompt up to P; h is the post-norm hidden of row P-1.
    TapRecorder taps({"final_hidden"});
    seq.forward(pool,
                std::span<const int32_t>(prompt).subspan(static_cast<size_t>(seq.n_past()),
                                                         static_cast<size_t>(P - seq.n_past())),
                nullptr, false, &taps);
    const FloatTensor fh = taps.get("final_hidden");
    h.assign(fh.row(0), fh.row(0) + Ht);
    EXPECT_LE(max_abs_diff(h, slice(want_h, si * Ht, Ht)), tol.at("draft_target_hidden"))
        << s.name << " start " << si;
    DraftContext ctx;
    ctx.target_embed = &model->embeddings_model().weights().embed_tokens;
    ctx.sliding = seq.layer_cache(donors.sliding);
    ctx.full = seq.layer_cache(donors.full);
    ctx.position = P;
    if (P < static_cast<int64_t>(prompt.size())) {
      EXPECT_EQ(tokens[si], prompt[static_cast<size_t>(P)]);
    }
    int32_t tok = static_cast<int32_t>(tokens[si]);
    for (size_t k = 0; k < K; ++k) {
      DraftStepRecord rec;
      tok = a.step(pool, ctx, tok, h, &rec);
      const size_t sk = si * K + k;
      const std::string where =
          s.name + " start " + std::to_string(si) + " step " + std::to_string(k);
      EXPECT_LE(max_abs_diff(rec.pre_projection, slice(want_pre, sk * Ha, Ha)),
                tol.at("draft_pre_projection"))
          << where;
      EXPECT_LE(max_abs_diff(rec.layer_out, slice(want_layers, sk * NL * Ha, NL * Ha)),
                tol.at("draft_layer_out"))
          << where;
      EXPECT_LE(max_abs_diff(rec.final_hidden, slice(want_final, sk * Ha, Ha)),
                tol.at("draft_final_hidden"))
          << where;
      EXPECT_LE(max_abs_diff(rec.hidden_out, slice(want_hout, sk * Ht, Ht)),
                tol.at("draft_hidden_out"))
          << where;
      EXPECT_LE(max_abs_diff(rec.logits, slice(want_logits, sk * V, V)), tol.at("draft_logits"))
          << where;
      EXPECT_EQ(tok, ids[sk]) << where;
      if (centroids) {
        EXPECT_EQ(
            rec.centroid_topk,
            std::vector<int64_t>(want_topk.begin() + static_cast<std::ptrdiff_t>(sk * topk),
                                 want_topk.begin() + static_cast<std::ptrdiff_t>((sk + 1) * topk)))
            << where;
      }
    }
    // Drafting never touches the target's cache.
    EXPECT_EQ(seq.n_past(), P);
  }
}

TEST_P(DraftFixture, RoundsAndIdsMatchExactly) {
  const FixtureSet& s = GetParam();
  ThreadPool pool(2);
  const auto model = target_model(s);
  const std::vector<int32_t> prompt = load_ids(set_file(s, "input_ids"));
  Sequence seq(model);
  SpeculativeOptions opt;
  opt.draft_max = 4;
  opt.adaptive = false;  // the fixtures use a constant K
  SpeculativeStats stats;
  std::vector<SpeculativeRound> rounds;
  const auto out = speculative_generate(pool, seq, drafter(s.assistant), prompt, 16, nullptr, opt,
                                        &stats, &rounds);
  const std::vector<int32_t> greedy = load_ids(set_file(s, "greedy_ids"));
  EXPECT_EQ(out, load_ids(set_file(s, "spec_new_ids")));
  EXPECT_EQ(out, greedy);
  EXPECT_EQ(out, plain_greedy(pool, model, prompt, 16));
  const auto pos = load_npy(set_file(s, "spec_round_positions")).to_i64();
  const auto in = load_npy(set_file(s, "spec_round_input_tokens")).to_i64();
  const auto nd = load_npy(set_file(s, "spec_round_num_drafts")).to_i64();
  const auto acc = load_npy(set_file(s, "spec_round_accepted")).to_i64();
  const auto drafts = load_npy(set_file(s, "spec_round_drafts")).to_i64();
  const auto tids = load_npy(set_file(s, "spec_round_target_ids")).to_i64();
  ASSERT_EQ(rounds.size(), pos.size()) << s.name;
  bool some_rejected = false, some_accepted = false;
  for (size_t r = 0; r < rounds.size(); ++r) {
    const SpeculativeRound& R = rounds[r];
    EXPECT_EQ(R.position, pos[r]) << s.name << " round " << r;
    EXPECT_EQ(R.input_token, in[r]) << s.name << " round " << r;
    EXPECT_EQ(static_cast<int64_t>(R.drafts.size()), nd[r]) << s.name << " round " << r;
    EXPECT_EQ(R.accepted, acc[r]) << s.name << " round " << r;
    for (size_t i = 0; i < 4; ++i) {
      const int64_t want = drafts[r * 4 + i];
      EXPECT_EQ(i < R.drafts.size() ? R.drafts[i] : -1, want) << s.name << " round " << r;
    }
    for (size_t i = 0; i < 5; ++i) {
      const int64_t want = tids[r * 5 + i];
      EXPECT_EQ(i < R.target_ids.size() ? R.target_ids[i] : -1, want) << s.name << " round " << r;
    }
    some_rejected = some_rejected || R.accepted < static_cast<int>(R.drafts.size());
    some_accepted = some_accepted || R.accepted > 0;
  }
  EXPECT_TRUE(some_rejected && some_accepted) << s.name;
  EXPECT_EQ(seq.n_past(), static_cast<int64_t>(prompt.size() + out.size() - 1));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DraftFixture, ::testing::ValuesIn(kSets),
                         [](const auto& param_info) { return param_info.param.name; });

// Greedy speculative output equals plain greedy output for every draft length, with the
// adaptive controller on, and far past the sliding ring's size (window + kRollbackSlack rows),
// so rollbacks of rejected rows happen after the ring has wrapped many times.
TEST(Speculative, GreedyIdenticalToPlainPastRingWrap) {
  ThreadPool pool(1);
  for (const FixtureSet& s : {kSets[1], kSets[3]}) {
    const auto model = target_model(s);
    const std::vector<int32_t> prompt = load_ids(set_file(s, "input_ids"));
    const int64_t ring = model->config().text.sliding_window + kRollbackSlack;
    const int64_t n_new = ring + 40;
    const auto plain = plain_greedy(pool, model, prompt, n_new);
    for (const auto& [K, adaptive] : {std::pair{5, false}, std::pair{2, true}}) {
      {
        Sequence seq(model);
        SpeculativeOptions opt;
        opt.draft_max = K;
        opt.adaptive = adaptive;
        SpeculativeStats st;
        const auto out =
            speculative_generate(pool, seq, drafter(s.assistant), prompt, n_new, nullptr, opt, &st);
        EXPECT_EQ(out, plain) << s.name << " K=" << K << " adaptive=" << adaptive;
        if (adaptive) continue;
        EXPECT_GT(st.rounds, 0);
        EXPECT_LT(st.accepted, st.drafted);  // rollbacks did happen
        // After many rollbacks past the ring's wrap, the donor layers hold what a fresh prefill
        // of the same ids holds over the whole span the drafter and the target read.
        Sequence fresh(model);
        fresh.forward(pool, seq.tokens(), nullptr, false, nullptr);
        const AssistantDonors donors = assistant_donor_layers(model->config().text);
        const int64_t n = seq.n_past(), W = model->config().text.sliding_window;
        for (int layer : {donors.sliding, donors.full}) {
          const LayerKvCache* a = seq.layer_cache(layer);
          const LayerKvCache* b = fresh.layer_cache(layer);
          ASSERT_TRUE(a && b);
          ASSERT_EQ(a->size(), n);
          for (int64_t pos = n - W - 1; pos < n; ++pos) {
            const std::vector<float> ka(a->k_at<float>(pos), a->k_at<float>(pos) + a->width());
            const std::vector<float> kb(b->k_at<float>(pos), b->k_at<float>(pos) + b->width());
            const std::vector<float> va(a->v_at<float>(pos), a->v_at<float>(pos) + a->width());
            const std::vector<float> vb(b->v_at<float>(pos), b->v_at<float>(pos) + b->width());
            EXPECT_LE(max_abs_diff(ka, kb), 1e-4) << s.name << " layer " << layer << " pos " << pos;
            EXPECT_LE(max_abs_diff(va, vb), 1e-4) << s.name << " layer " << layer << " pos " << pos;
          }
        }
      }
    }
  }
}

// The drafter reads bf16 KV rows too (the default for quantized targets): its drafts from the
// fixture starts stay those of the f32 reference: every first step, and nearly all chained ones
// (bf16 rounding of the target's own K/V and hidden states moves later steps' logits, which the
// chain feeds forward, so one late step may flip).
TEST(Speculative, DrafterReadsBf16Caches) {
  ThreadPool pool(1);
  for (const FixtureSet& s : {kSets[0], kSets[2]}) {
    const AssistantModel& a = drafter(s.assistant);
    const auto model = target_model(s);
    const std::vector<int32_t> prompt = load_ids(set_file(s, "input_ids"));
    const auto starts = load_npy(set_file(s, "draft_start_positions")).to_i64();
    const auto tokens = load_npy(set_file(s, "draft_input_tokens")).to_i64();
    const auto ids = load_npy(set_file(s, "draft_ids")).to_i64();
    const AssistantDonors donors = assistant_donor_layers(model->config().text);
    int same = 0;
    for (size_t si = 0; si < starts.size(); ++si) {
      Sequence seq(model, 0, KvType::BF16);
      TapRecorder taps({"final_hidden"});
      seq.forward(pool, std::span<const int32_t>(prompt).first(static_cast<size_t>(starts[si])),
                  nullptr, false, &taps);
      const FloatTensor fh = taps.get("final_hidden");
      std::vector<float> h(fh.row(0), fh.row(0) + fh.dim(1));
      DraftContext ctx{&model->embeddings_model().weights().embed_tokens,
                       seq.layer_cache(donors.sliding), seq.layer_cache(donors.full), starts[si]};
      ASSERT_EQ(ctx.sliding->kv_type(), KvType::BF16);
      int32_t tok = static_cast<int32_t>(tokens[si]);
      for (size_t k = 0; k < 4; ++k) {
        DraftStepRecord rec;
        tok = a.step(pool, ctx, tok, h, &rec);
        if (k == 0) {
          EXPECT_EQ(tok, ids[si * 4]) << s.name << " start " << si;
        }
        same += tok == ids[si * 4 + k];
      }
    }
    EXPECT_GE(same, 10) << s.name << ": drafts equal to the f32 reference, of 12";
  }
}

// The adaptive draft length, as the server drives it (untimed: only acceptance decides) and as
// speculative_generate does (each round's seconds per token against plain steps').
TEST(Speculative, DraftControlAdaptsAndPausesADrafterThatDoesNotPay) {
  SpeculativeOptions opt;
  opt.draft_max = 4;
  {  // Untimed, never accepted: the first rounds draft 2, k steps down, three empty rounds pause
     // for 16, then 32 steps.
    DraftControl c(opt);
    EXPECT_EQ(c.next_draft(100), 2);
    EXPECT_EQ(c.next_draft(1), 1);  // never past what max_tokens and the context leave
    c.round(2, 0, -1);
    EXPECT_EQ(c.next_draft(100), 1);
    c.round(1, 0, -1);
    EXPECT_EQ(c.next_draft(100), 1);
    c.round(1, 0, -1);
    for (int i = 0; i < 16; ++i) {
      EXPECT_EQ(c.next_draft(100), 0) << "paused step " << i;
      EXPECT_EQ(c.paused_beyond_next(), i < 15) << i;
      c.plain_step(-1);
    }
    EXPECT_EQ(c.next_draft(100), 1);  // a cheap probe
    c.round(1, 0, -1);
    for (int i = 0; i < 32; ++i) {
      ASSERT_EQ(c.next_draft(100), 0) << "second pause, step " << i;
      c.plain_step(-1);
    }
    c.round(1, 1, -1);  // the probe's draft accepted: k grows again, no pause
    EXPECT_EQ(c.next_draft(100), 2);
    c.round(2, 2, -1);
    c.round(3, 3, -1);
    c.round(4, 4, -1);
    EXPECT_EQ(c.next_draft(100), 4);  // at --draft-max
    c.round(4, 1, -1);
    EXPECT_EQ(c.next_draft(100), 3);
  }
  {  // --draft-min: the first round drafts that many; a round that would draft fewer is a plain
     // step.
    SpeculativeOptions o = opt;
    o.draft_min = 3;
    DraftControl c(o);
    EXPECT_EQ(c.next_draft(100), 3);
    c.round(3, 0, -1);
    EXPECT_EQ(c.next_draft(100), 3);
    EXPECT_EQ(c.next_draft(2), 0);
  }
  {  // Timed: the first step is plain, to compare the first round with; a round slower per token
     // than plain steps pauses at once.
    DraftControl c(opt, /*timed=*/true);
    EXPECT_EQ(c.next_draft(100), 0);
    EXPECT_FALSE(c.paused_beyond_next());  // the drafter needs that step's hidden state
    c.plain_step(0.1);
    EXPECT_EQ(c.next_draft(100), 2);
    c.round(2, 0, 0.4);
    EXPECT_EQ(c.next_draft(100), 0);
    EXPECT_TRUE(c.paused_beyond_next());
  }
  {  // Timed, a drafter that pays: k climbs to the maximum and drafting never pauses.
    DraftControl c(opt, /*timed=*/true);
    c.plain_step(0.1);
    for (int i = 0; i < 20; ++i) {
      const int64_t k = c.next_draft(100);
      ASSERT_EQ(k, std::min(2 + i, 4)) << i;
      c.round(k, k, 0.03);
    }
  }
  {  // Not adaptive: always --draft-max, whatever the rounds do.
    SpeculativeOptions o = opt;
    o.adaptive = false;
    DraftControl c(o);
    for (int i = 0; i < 5; ++i) c.round(4, 0, 1.0);
    EXPECT_EQ(c.next_draft(100), 4);
  }
}

// make-random's drafter presets parse as gemma4_assistant configs and fit their targets' real
// shapes (head dims, KV heads, window, vocabulary, backbone width); the other target does not.
TEST(Speculative, AssistantPresetsFitTheirTargets) {
  for (const char* target : {"26b-a4b", "31b"}) {
    const std::string name = std::string(target) + "-assistant";
    ASSERT_TRUE(is_assistant_preset(name));
    const AssistantConfig a =
        parse_assistant_config(assistant_preset_config(name).dump(), name + " preset");
    EXPECT_EQ(a.text.layers.size(), 4u) << name;
    const ModelConfig t = parse_model_config(preset_config(target).dump(), target);
    EXPECT_NO_THROW(check_assistant_matches(a, t, name, target)) << name;
    const char* other = std::string(target) == "31b" ? "26b-a4b" : "31b";
    const ModelConfig o = parse_model_config(preset_config(other).dump(), other);
    EXPECT_ANY_THROW(check_assistant_matches(a, o, name, other)) << name << " on " << other;
  }
  EXPECT_FALSE(is_assistant_preset("e2b"));
  EXPECT_ANY_THROW(assistant_preset_config("e2b-assistant"));
}

TEST(Speculative, MismatchedPairRefusedNamingBothAndTheField) {
  const auto e_target = target_model(kSets[0]);
  AssistantConfig wide = drafter("assistant_e").config();
  wide.backbone_hidden_size += 32;
  const std::string msg = error_of(
      [&] { check_assistant_matches(wide, e_target->config(), "DRAFTER_DIR", "TARGET_DIR"); });
  EXPECT_NE(msg.find("DRAFTER_DIR"), std::string::npos) << msg;
  EXPECT_NE(msg.find("TARGET_DIR"), std::string::npos) << msg;
  EXPECT_NE(msg.find("backbone_hidden_size"), std::string::npos) << msg;
  // The dense drafter on the E-series target: same hidden size, other head dims.
  const std::string msg_pair = error_of([&] {
    check_assistant_matches(drafter("assistant_dense").config(), e_target->config(), "DRAFTER_DIR",
                            "TARGET_DIR");
  });
  EXPECT_NE(msg_pair.find("head_dim"), std::string::npos) << msg_pair;
  // Same hidden size, other head dims: the head-dim check names its field.
  AssistantConfig c = drafter("assistant_e").config();
  for (LayerSpec& ls : c.text.layers)
    if (ls.type == LayerType::Sliding) ls.head_dim *= 2;
  const std::string msg2 = error_of(
      [&] { check_assistant_matches(c, e_target->config(), "DRAFTER_DIR", "TARGET_DIR"); });
  EXPECT_NE(msg2.find("head_dim"), std::string::npos) << msg2;
  AssistantConfig c3 = drafter("assistant_e").config();
  for (LayerSpec& ls : c3.text.layers)
    if (ls.type == LayerType::Full) ls.num_kv_heads += 1;
  const std::string msg3 = error_of(
      [&] { check_assistant_matches(c3, e_target->config(), "DRAFTER_DIR", "TARGET_DIR"); });
  EXPECT_NE(msg3.find("num_key_value_heads"), std::string::npos) << msg3;
}

TEST(Speculative, BadAssistantConfigsRefused) {
  const std::string base = R"({"model_type": "gemma4_assistant", "backbone_hidden_size": 128,
    "text_config": {"model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "global_head_dim": 32, "intermediate_size": 64, "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0, "layer_types": ["sliding_attention", "full_attention"],
    "num_kv_shared_layers": 2 %EXTRA%}})";
  auto with = [&](const std::string& extra) {
    std::string s = base;
    s.replace(s.find("%EXTRA%"), 7, extra);
    return s;
  };
  EXPECT_NO_THROW(parse_assistant_config(with(""), "cfg"));
  EXPECT_NE(error_of([&] {
              parse_assistant_config(with(", \"enable_moe_block\": true"), "cfg");
            }).find("enable_moe_block"),
            std::string::npos);
  std::string wrong_type = with("");
  wrong_type.replace(wrong_type.find("gemma4_assistant"), 16, "gemma4");
  EXPECT_NE(error_of([&] { parse_assistant_config(wrong_type, "cfg"); }).find("gemma4_assistant"),
            std::string::npos);
  std::string partial = with("");
  partial.replace(partial.find("\"num_kv_shared_layers\": 2"), 25, "\"num_kv_shared_layers\": 1");
  EXPECT_NE(error_of([&] { parse_assistant_config(partial, "cfg"); }).find("num_kv_shared_layers"),
            std::string::npos);
}

// The acceptance rule's output distribution is exactly the target's: integrate over both uniform
// draws on a fine midpoint grid and compare the mass of every token with p.
TEST(Speculative, AcceptanceRuleKeepsTargetDistribution) {
  const std::vector<int32_t> ids = {7, 3, 11, 5};
  const std::vector<double> prob = {0.5, 0.25, 0.15, 0.1};
  const double total = 1.0;
  for (int32_t draft : {7, 11, 5, 42}) {  // 42: a draft outside the target's candidates
    std::map<int32_t, double> mass;
    const int N = 400;
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) {
        bool acc = false;
        const int32_t t = speculative_accept_or_resample(ids, prob, total, draft, (i + 0.5) / N,
                                                         (j + 0.5) / N, &acc);
        EXPECT_EQ(acc, t == draft);
        mass[t] += 1.0 / (N * N);
      }
    for (size_t k = 0; k < ids.size(); ++k)
      EXPECT_NEAR(mass[ids[k]], prob[k], 2e-3) << "draft " << draft << " token " << ids[k];
    EXPECT_EQ(mass.count(42), 0u);
  }
}

// End to end with sampling: the distribution of the first two sampled tokens with a drafter
// matches plain sampling (same sampler settings, many seeds), within a statistical bound.
TEST(Speculative, SampledOutputFollowsTargetDistribution) {
  ThreadPool pool(1);
  const FixtureSet& s = kSets[2];
  const auto model = target_model(s);
  const std::vector<int32_t> prompt = load_ids(set_file(s, "input_ids"));
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.top_k = 2;
  sp.top_p = 1.0f;
  const int runs = 400;
  std::map<int32_t, int> spec_counts[2], plain_counts[2];
  SpeculativeOptions opt;
  opt.draft_max = 3;
  opt.adaptive = false;
  int64_t drafted = 0, accepted = 0;
  for (int r = 0; r < runs; ++r) {
    sp.seed = 1000 + static_cast<uint64_t>(r);
    Sampler a(sp);
    Sequence seq(model);
    SpeculativeStats st;
    const auto out = speculative_generate(pool, seq, drafter(s.assistant), prompt, 3, &a, opt, &st);
    ASSERT_EQ(out.size(), 3u);
    drafted += st.drafted;
    accepted += st.accepted;
    ++spec_counts[0][out[1]];
    ++spec_counts[1][out[2]];
    sp.seed = 50000 + static_cast<uint64_t>(r);
    Sampler b(sp);
    Sequence plain(model);
    std::vector<int32_t> hist = prompt;
    FloatTensor l = plain.forward(pool, prompt, nullptr, false, nullptr);
    std::vector<int32_t> got;
    for (int i = 0; i < 3; ++i) {
      const int32_t t = b.sample(l.row(0), l.dim(1), hist);
      got.push_back(t);
      hist.push_back(t);
      if (i < 2)
        l = plain.forward(pool, std::span<const int32_t>(&got.back(), 1), nullptr, false, nullptr);
    }
    ++plain_counts[0][got[1]];
    ++plain_counts[1][got[2]];
  }
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
  // Total variation distance between the empirical distributions of the second and third
  // tokens (a handful of outcomes with top_k = 2): for equal distributions and 400 samples each it
  // stays below ~0.06; accepting every draft, or resampling without removing the rejected
  // draft, moves far more mass than 0.12.
  for (int pos = 0; pos < 2; ++pos) {
    std::map<int32_t, double> diff;
    for (const auto& [k, c] : spec_counts[pos]) diff[k] += c;
    for (const auto& [k, c] : plain_counts[pos]) diff[k] -= c;
    double tv = 0;
    for (const auto& [k, d] : diff) tv += std::fabs(d);
    tv /= 2.0 * runs;
    EXPECT_LT(tv, 0.12) << "token " << pos + 1;
  }
}

// generate -md: the same ids as plain greedy generate, and the drafter's statistics reported;
// a drafter made for another target is refused naming the field.
TEST(Speculative, GenerateWithDrafterMatchesPlain) {
  const std::string dir = testing::temp_dir("spec_cli");
  auto run = [&](const std::string& args, const std::string& name) {
    const std::string cmd = std::string(GEMSTAGE_CLI) + " generate -m " + fx("gemma4-tiny/model") +
                            " --json -t 2 -p \"Tell me a story\" --temp 0 -n 24 " + args + " > " +
                            dir + "/" + name + ".out 2> " + dir + "/" + name + ".err < /dev/null";
    return std::system(cmd.c_str());
  };
  auto slurp = [&](const std::string& name) {
    std::ifstream in(dir + "/" + name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  ASSERT_EQ(run("", "plain"), 0) << slurp("plain.err");
  ASSERT_EQ(run("-md " + fx("gemma4-tiny-assistant/assistant_e") + " --draft-max 3", "spec"), 0)
      << slurp("spec.err");
  const auto plain = nlohmann::json::parse(slurp("plain.out"));
  const auto spec = nlohmann::json::parse(slurp("spec.out"));
  EXPECT_EQ(spec["tokens"], plain["tokens"]);
  EXPECT_EQ(spec["text"], plain["text"]);
  EXPECT_EQ(spec["finish_reason"], plain["finish_reason"]);
  EXPECT_GT(spec["drafted"].get<int64_t>(), 0);
  EXPECT_NE(slurp("spec.err").find("drafts accepted"), std::string::npos);
  EXPECT_NE(run("-md " + fx("gemma4-tiny-assistant/assistant_dense"), "bad"), 0);
  EXPECT_NE(slurp("bad.err").find("head_dim"), std::string::npos) << slurp("bad.err");
}

// dump --model-draft writes the spec_* taps as the fixtures name and shape them.
TEST(Speculative, DumpWritesSpecRoundTaps) {
  const std::string dir = testing::temp_dir("spec_dump");
  for (const FixtureSet& s : {kSets[0], kSets[3]}) {
    const std::string out = dir + "/" + s.name;
    const std::string cmd = std::string(GEMSTAGE_CLI) + " dump -m " + fx(s.target) + " --ids " +
                            set_file(s, "input_ids") + " --decode 16 -t 2 -md " +
                            fx("gemma4-tiny-assistant/" + s.assistant) +
                            " --taps spec_round_drafts,spec_round_accepted,spec_new_ids,"
                            "spec_round_target_ids --out " +
                            out + " > " + out + ".log 2>&1 < /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << s.name;
    for (const char* tap :
         {"spec_round_drafts", "spec_round_accepted", "spec_new_ids", "spec_round_target_ids"}) {
      const NpyArray got = load_npy(out + "/" + tap + ".npy");
      const NpyArray want = load_npy(set_file(s, tap));
      EXPECT_EQ(got.shape, want.shape) << s.name << " " << tap;
      EXPECT_EQ(got.to_i64(), want.to_i64()) << s.name << " " << tap;
    }
  }
}

// dump --model-draft after a prompt with an image: the drafted greedy ids are plain decoding's
// (the fixture's decode_ids), with the prompt prefilled in chunks across the image.
TEST(Speculative, DumpDraftsAfterAnImagePrompt) {
  const std::string dir = testing::temp_dir("spec_dump_image");
  const std::string mm = fx("gemma4-tiny/multimodal/");
  const std::string cmd = std::string(GEMSTAGE_CLI) + " dump -m " + fx("gemma4-tiny/model") +
                          " --ids " + mm + "input_ids.npy --pixel-values " + mm +
                          "pixel_values.npy --image-position-ids " + mm +
                          "image_position_ids.npy --decode 12 --chunk 16 -t 2 -md " +
                          fx("gemma4-tiny-assistant/assistant_e") +
                          " --taps decode_ids,spec_new_ids,spec_round_num_drafts --out " + dir +
                          "/o > " + dir + "/log 2>&1 < /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << [&] {
    std::ifstream in(dir + "/log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  const std::vector<int64_t> spec = load_npy(dir + "/o/spec_new_ids.npy").to_i64();
  const std::vector<int64_t> plain = load_npy(dir + "/o/decode_ids.npy").to_i64();
  const std::vector<int64_t> want = load_npy(mm + "decode_ids.npy").to_i64();
  ASSERT_EQ(spec.size(), 12u);
  EXPECT_EQ(spec, plain);
  for (size_t i = 0; i < spec.size() && i < want.size(); ++i) EXPECT_EQ(spec[i], want[i]) << i;
  int64_t drafted = 0;
  for (int64_t n : load_npy(dir + "/o/spec_round_num_drafts.npy").to_i64()) drafted += n;
  EXPECT_GT(drafted, 0);
}

}  // namespace
}  // namespace gemstage
