#include "gemma4/text_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/dtype.h"
#include "core/error.h"
#include "core/op_profile.h"
#include "kernels/attention_layer.h"
#include "kernels/experts.h"
#include "kernels/matmul.h"
#include "kernels/weight_rows.h"

namespace gemstage {

namespace {

// Gathers rows of a [V, n] table (any float dtype) into out[rows, n], times `scale`. Rows are
// read from the table's file, not its mapping (see gather_weight_row_to_f32).
void gather_rows(const WeightView& table, std::span<const int32_t> ids, float scale, float* out) {
  const int64_t n = table.cols();
  thread_local std::vector<uint8_t> raw;
  for (size_t r = 0; r < ids.size(); ++r) {
    float* o = out + static_cast<int64_t>(r) * n;
    gather_weight_row_to_f32(table, ids[r], o, raw);
    for (int64_t i = 0; i < n; ++i) o[i] *= scale;
  }
}

}  // namespace

std::vector<LayerCachePlan> kv_cache_plan(const TextConfig& t, int begin, int end) {
  std::vector<LayerCachePlan> plan;
  const int stop = end < 0 ? t.num_hidden_layers : end;
  for (int i = begin; i < stop; ++i) {
    const LayerSpec& s = t.layers[static_cast<size_t>(i)];
    if (s.kv_shared) continue;
    plan.push_back({i, s.type == LayerType::Sliding ? CacheKind::Ring : CacheKind::Growing,
                    int64_t{s.num_kv_heads} * s.head_dim, t.sliding_window});
  }
  return plan;
}

KvCache make_kv_cache(const TextConfig& t, int64_t max_context, int begin, int end,
                      KvType kv_type) {
  // A q8_0 row is read a head at a time, so each head's part must start on a 32-value block.
  if (kv_type == KvType::Q8_0)
    for (int i = begin; i < std::min(end, t.num_hidden_layers); ++i)
      if (t.layers[static_cast<size_t>(i)].head_dim % kKvQ8Values != 0)
        fail("a q8_0 KV cache needs a head_dim that is a multiple of ", kKvQ8Values, "; layer ", i,
             "'s is ", t.layers[static_cast<size_t>(i)].head_dim,
             " (use --cache-type-k/--cache-type-v bf16 or f32)");
  return KvCache(t.num_hidden_layers, kv_cache_plan(t, begin, end), max_context, kv_type);
}

TextModel::TextModel(const ModelConfig& config, TextWeights weights)
    : model_cfg_(config), cfg_(config.text), w_(std::move(weights)) {
  int sliding_hd = cfg_.head_dim, full_hd = cfg_.global_head_dim;
  for (const LayerSpec& s : cfg_.layers)
    (s.type == LayerType::Full ? full_hd : sliding_hd) = s.head_dim;
  auto table = [](const RopeParams& p, int hd) {
    return p.type == "proportional" ? RopeTable::proportional(hd, p.theta, p.partial_rotary_factor)
                                    : RopeTable::standard(hd, p.theta);
  };
  rope_sliding_ = table(cfg_.rope_sliding, sliding_hd);
  rope_full_ = table(cfg_.rope_full, full_hd);
}

EmbeddingsOutput TextModel::embed(ThreadPool& pool, std::span<const int32_t> input_ids,
                                  const FloatTensor* soft_tokens, const TextRunOptions& opt,
                                  TapRecorder* taps) const {
  const OpTimer timer(pool.profile(), OpKind::Embeddings);
  const int64_t S = static_cast<int64_t>(input_ids.size());
  const int64_t D = cfg_.hidden_size, L = cfg_.num_hidden_layers, P = cfg_.ple_dim();
  const std::vector<int> placeholders = model_cfg_.placeholder_token_ids();
  const TokenIdentity ident = resolve_token_identity(
      input_ids, placeholders, cfg_.pad_token_id, cfg_.vocab_size,
      cfg_.has_ple() ? cfg_.vocab_size_per_layer_input : 0, opt.ple_identity);
  if (taps) {
    taps->append_ids("input_ids", std::vector<int64_t>(input_ids.begin(), input_ids.end()));
    taps->append_ids("llm_input_ids",
                     std::vector<int64_t>(ident.embed_ids.begin(), ident.embed_ids.end()));
    taps->append_ids("ple_ids", std::vector<int64_t>(ident.ple_ids.begin(), ident.ple_ids.end()));
  }

  EmbeddingsOutput out;
  out.ple_token_ids = ident.ple_ids;
  out.image_splice_mask.assign(static_cast<size_t>(S), 0);
  out.audio_splice_mask.assign(static_cast<size_t>(S), 0);
  // Gemma4TextScaledWordEmbedding casts its f32 scale to the compute dtype before multiplying.
  float scale = std::sqrt(static_cast<float>(D));
  if (opt.embed_scale == EmbedScaleMode::BF16) scale = round_to_bf16(scale);
  out.hidden_states = FloatTensor({S, D});
  gather_rows(w_.embed_tokens, ident.embed_ids, scale, out.hidden_states.data.data());
  if (taps) taps->append("embeds_scaled", {D}, out.hidden_states.data.data(), S);

  // Splice: the k-th placeholder row gets the k-th soft token (HF masked_scatter order).
  int64_t n_ph = 0;
  for (uint8_t p : ident.is_placeholder) n_ph += p;
  const int64_t n_soft = soft_tokens ? soft_tokens->dim(0) : 0;
  // Without any tower features HF leaves placeholder rows at the PAD embedding (e.g. a generated
  // placeholder id fed back during decode); once features are given the counts must agree.
  if (n_soft > 0 && n_ph != n_soft)
    fail("the prompt has ", n_ph, " image/audio/video placeholder tokens but ", n_soft,
         " soft tokens were provided; each image needs exactly as many placeholders as it yields "
         "soft tokens");
  if (n_soft) {
    if (soft_tokens->dim(1) != D)
      fail("soft tokens have width ", soft_tokens->dim(1), ", expected ", D);
    int64_t k = 0;
    for (int64_t r = 0; r < S; ++r)
      if (ident.is_placeholder[static_cast<size_t>(r)]) {
        std::memcpy(out.hidden_states.row(r), soft_tokens->row(k++),
                    static_cast<size_t>(D) * sizeof(float));
        // Audio rows get their own mask on models with an audio tower (see EmbeddingsOutput).
        const bool audio_row = model_cfg_.takes_audio() &&
                               input_ids[static_cast<size_t>(r)] == model_cfg_.audio_token_id;
        (audio_row ? out.audio_splice_mask : out.image_splice_mask)[static_cast<size_t>(r)] = 1;
      }
  }
  if (taps) {
    taps->append_ids("image_splice_mask", std::vector<int64_t>(out.image_splice_mask.begin(),
                                                               out.image_splice_mask.end()));
    if (model_cfg_.takes_audio())
      taps->append_ids("audio_splice_mask", std::vector<int64_t>(out.audio_splice_mask.begin(),
                                                                 out.audio_splice_mask.end()));
    taps->append("inputs_embeds", {D}, out.hidden_states.data.data(), S);
  }

  if (!cfg_.has_ple()) return out;
  if (!w_.embed_tokens_per_layer.valid())
    fail("the per-layer embedding table is not held by this stage");
  PerLayerInputs& pli = out.per_layer_inputs;
  pli.rows = S;
  pli.num_layers = L;
  pli.dim = P;
  // Identity half: E_ple[ple_ids] * sqrt(P).
  std::vector<float> token_part(static_cast<size_t>(S * L * P));
  gather_rows(w_.embed_tokens_per_layer, ident.ple_ids, std::sqrt(static_cast<float>(P)),
              token_part.data());
  if (taps) taps->append("ple_token_embeds", {L, P}, token_part.data(), S);
  // Context half: RMSNorm_P(proj(spliced embeddings) * D^-1/2), one norm weight for all layers.
  pli.data.resize(static_cast<size_t>(S * L * P));
  matmul(pool, out.hidden_states.data.data(), S, w_.per_layer_model_projection, pli.data.data());
  const float inv_sqrt_d = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
  for (float& v : pli.data) v *= inv_sqrt_d;
  rmsnorm_rows(pool.tier(), pli.data.data(), S * L, P, w_.per_layer_projection_norm.data(),
               static_cast<float>(cfg_.rms_norm_eps), pli.data.data());
  const float inv_sqrt2 = static_cast<float>(1.0 / std::sqrt(2.0));
  for (size_t i = 0; i < pli.data.size(); ++i)
    pli.data[i] = (pli.data[i] + token_part[i]) * inv_sqrt2;
  if (taps) taps->append("per_layer_inputs", {L, P}, pli.data.data(), S);
  return out;
}

// What the layers of one run_layers call share: the chunk's RoPE angles per layer type, the
// fresh K/V of every layer that computes its own (KV-shared layers read their donor's), and
// activation buffers reused from layer to layer. The buffers are sized, never cleared: every
// element is written before it is read, and for a prompt they are tens of MB that zeroing and
// first-touch page faults made ~5% of a prefill.
struct TextModel::LayerPass {
  std::span<const RowSegment> segments;
  KvType kv_type = KvType::F32;          // every segment's cache holds rows of this type
  RopeAngles rope_sliding, rope_full;    // one row per call row, at that row's position
  std::vector<std::vector<float>> k, v;  // per layer: [S, kv heads * head_dim]
  // The same rounded to bf16 when the cache holds bf16, so the chunk's own keys enter attention
  // exactly as later chunks will read them back from the cache.
  std::vector<std::vector<uint16_t>> k16, v16;
  std::vector<std::vector<KvQ8Block>> kq8, vq8;  // likewise quantized when the cache holds q8_0
  std::vector<float> x, q, attn, branch, gate, up, ple_gate;
  AttentionWorkspace attention;
  // Per segment, [rows]: the last key each row sees on sliding layers (the image block); empty
  // when the segment has no image group.
  std::vector<std::vector<int64_t>> last_key;
  // The MoE block: router inputs and scores, the chosen experts and weights, expert outputs.
  std::vector<float> moe_x, router_probs, expert_weights, moe_out;
  std::vector<int32_t> expert_ids;
  ExpertsWorkspace experts;
};

namespace {

// Row-wise work of a chunk (norms, RoPE, activations, residual adds): shared out over the pool
// for a prompt, inline for the few rows of a decode step, where a hand-off would cost more
// than the work.
constexpr int64_t kParallelRowsMin = 16;

template <typename Fn>
void for_rows(ThreadPool& pool, int64_t rows, Fn fn) {
  if (rows < kParallelRowsMin) return fn(int64_t{0}, rows);
  pool.parallel_for(static_cast<size_t>(rows), [&](size_t b, size_t e) {
    fn(static_cast<int64_t>(b), static_cast<int64_t>(e));
  });
}

template <typename T>
void sized(std::vector<T>& buf, int64_t n) {
  buf.resize(static_cast<size_t>(n));
}

void to_bf16_rows(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

// hidden += rmsnorm(branch) * w for rows [r0, r1) of width D.
void add_normed(CpuTier tier, float* hidden, float* branch, int64_t r0, int64_t r1, int64_t D,
                const float* w, float eps) {
  rmsnorm_rows(tier, branch + r0 * D, r1 - r0, D, w, eps, branch + r0 * D);
  for (int64_t i = r0 * D; i < r1 * D; ++i) hidden[i] += branch[i];
}

}  // namespace

void TextModel::layer_forward(ThreadPool& pool, int li, FloatTensor& hidden,
                              const PerLayerInputs& pli, LayerPass& pass, TapRecorder* taps) const {
  if (!w_.layers[static_cast<size_t>(li)].bound) fail("layer ", li, " is not held by this stage");
  const int64_t S = hidden.dim(0), D = cfg_.hidden_size;
  const int L = cfg_.num_hidden_layers;
  attention_block(pool, li, hidden, pass);
  if (taps) taps->append_layer("hidden_after_attn", li, L, {D}, hidden.data.data(), S);
  mlp_block(pool, li, hidden, pass, taps);
  if (taps) taps->append_layer("hidden_after_mlp", li, L, {D}, hidden.data.data(), S);
  if (cfg_.has_ple()) {
    ple_block(pool, li, hidden, pli, pass);
  } else {
    // Without a per-layer input, layer_scalar (the layer's last op) applies here.
    const float scalar = w_.layers[static_cast<size_t>(li)].layer_scalar;
    float* h = hidden.data.data();
    for_rows(pool, S, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * D; i < r1 * D; ++i) h[i] *= scalar;
    });
  }
  if (taps) taps->append_layer("hidden_states", li, L, {D}, hidden.data.data(), S);
}

// Pre-norm, Q (and, unless KV-shared, K/V) projections with their norms and RoPE, attention over
// the cache and the call's fresh rows, the output projection, its post-norm and the residual.
void TextModel::attention_block(ThreadPool& pool, int li, FloatTensor& hidden,
                                LayerPass& pass) const {
  const LayerSpec& ls = cfg_.layers[static_cast<size_t>(li)];
  const TextLayerWeights& lw = w_.layers[static_cast<size_t>(li)];
  const int64_t S = hidden.dim(0), D = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  float* h = hidden.data.data();
  const int64_t H = cfg_.num_attention_heads, hd = ls.head_dim, Hkv = ls.num_kv_heads;
  const int64_t kvw = Hkv * hd;
  const RopeAngles& rope = ls.type == LayerType::Full ? pass.rope_full : pass.rope_sliding;

  auto& x = pass.x;
  auto& q = pass.q;
  sized(x, S * D);
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    rmsnorm_rows(pool.tier(), h + r0 * D, r1 - r0, D, lw.input_layernorm.data(), eps,
                 x.data() + r0 * D);
  });
  sized(q, S * H * hd);
  // A KV-shared layer reads its donor's K/V and computes none of its own.
  const bool bf16_kv = pass.kv_type == KvType::BF16;
  const bool q8_kv = pass.kv_type == KvType::Q8_0;
  float* k = nullptr;
  float* v = nullptr;
  if (ls.kv_shared) {
    const OpTimer timer(pool.profile(), OpKind::AttentionProjections);
    matmul(pool, x.data(), S, lw.q_proj, q.data());
  } else {
    auto& kbuf = pass.k[static_cast<size_t>(li)];
    auto& vbuf = pass.v[static_cast<size_t>(li)];
    sized(kbuf, S * kvw);
    sized(vbuf, S * kvw);
    k = kbuf.data();
    v = vbuf.data();
    if (bf16_kv) {
      sized(pass.k16[static_cast<size_t>(li)], S * kvw);
      sized(pass.v16[static_cast<size_t>(li)], S * kvw);
    }
    if (q8_kv) {
      sized(pass.kq8[static_cast<size_t>(li)], S * kvw / kKvQ8Values);
      sized(pass.vq8[static_cast<size_t>(li)], S * kvw / kKvQ8Values);
    }
    const OpTimer timer(pool.profile(), OpKind::AttentionProjections);
    if (ls.k_eq_v) {
      // attention_k_eq_v: V is the raw key projection (v_norm below), taken before k_norm/RoPE.
      matmul_many(pool, x.data(), S, {{lw.q_proj, q.data()}, {lw.k_proj, k}});
      std::memcpy(v, k, static_cast<size_t>(S * kvw) * sizeof(float));
    } else {
      matmul_many(pool, x.data(), S, {{lw.q_proj, q.data()}, {lw.k_proj, k}, {lw.v_proj, v}});
    }
  }
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    float* qr = q.data() + r0 * H * hd;
    rmsnorm_rows(pool.tier(), qr, (r1 - r0) * H, hd, lw.q_norm.data(), eps, qr);
    for (int64_t r = r0; r < r1; ++r)
      apply_rope(rope, r, q.data() + r * H * hd, static_cast<int>(H));
    if (!k) return;
    rmsnorm_rows(pool.tier(), k + r0 * kvw, (r1 - r0) * Hkv, hd, lw.k_norm.data(), eps,
                 k + r0 * kvw);
    for (int64_t r = r0; r < r1; ++r) apply_rope(rope, r, k + r * kvw, static_cast<int>(Hkv));
    rmsnorm_rows(pool.tier(), v + r0 * kvw, (r1 - r0) * Hkv, hd, nullptr, eps, v + r0 * kvw);
    if (q8_kv) {
      const int64_t nb = kvw / kKvQ8Values;
      quantize_kv_q8(k + r0 * kvw, (r1 - r0) * kvw,
                     pass.kq8[static_cast<size_t>(li)].data() + r0 * nb);
      quantize_kv_q8(v + r0 * kvw, (r1 - r0) * kvw,
                     pass.vq8[static_cast<size_t>(li)].data() + r0 * nb);
      return;
    }
    if (!bf16_kv) return;
    auto& k16 = pass.k16[static_cast<size_t>(li)];
    auto& v16 = pass.v16[static_cast<size_t>(li)];
    to_bf16_rows(k + r0 * kvw, (r1 - r0) * kvw, k16.data() + r0 * kvw);
    to_bf16_rows(v + r0 * kvw, (r1 - r0) * kvw, v16.data() + r0 * kvw);
  });
  const int src = ls.kv_shared ? ls.kv_donor : li;
  const auto& ck = pass.k[static_cast<size_t>(src)];
  const auto& cv = pass.v[static_cast<size_t>(src)];
  if (static_cast<int64_t>(ck.size()) != S * kvw)
    fail("layer ", li, " reads the K/V of layer ", src,
         ", which did not run in this pass; a stage must hold each KV-shared layer together with "
         "its donor");
  const int64_t window = ls.type == LayerType::Sliding ? cfg_.sliding_window : 0;
  auto& attn = pass.attn;  // every element is written by attend_layer
  sized(attn, S * H * hd);
  // Each sequence's rows attend to its own cache and its own fresh rows.
  std::optional<OpTimer> attention_timer(std::in_place, pool.profile(), OpKind::Attention);
  for (size_t si = 0; si < pass.segments.size(); ++si) {
    const RowSegment& seg = pass.segments[si];
    // The image block: on sliding layers only; full layers stay plainly causal.
    const int64_t* last_key = ls.type == LayerType::Sliding && !pass.last_key[si].empty()
                                  ? pass.last_key[si].data()
                                  : nullptr;
    const LayerKvCache* past = seg.cache->own(src);
    if (!past) fail("layer ", li, ": this stage's KV cache does not hold layer ", src);
    const size_t s_src = static_cast<size_t>(src);
    const void* fk =
        q8_kv     ? static_cast<const void*>(pass.kq8[s_src].data() + seg.row0 * kvw / kKvQ8Values)
        : bf16_kv ? static_cast<const void*>(pass.k16[s_src].data() + seg.row0 * kvw)
                  : static_cast<const void*>(ck.data() + seg.row0 * kvw);
    const void* fv =
        q8_kv     ? static_cast<const void*>(pass.vq8[s_src].data() + seg.row0 * kvw / kKvQ8Values)
        : bf16_kv ? static_cast<const void*>(pass.v16[s_src].data() + seg.row0 * kvw)
                  : static_cast<const void*>(cv.data() + seg.row0 * kvw);
    attend_layer(pool,
                 {q.data() + seg.row0 * H * hd, seg.rows, H, Hkv, hd, seg.start, window, past, fk,
                  fv, attn.data() + seg.row0 * H * hd, last_key},
                 pass.attention);
  }
  attention_timer.reset();
  auto& branch = pass.branch;
  sized(branch, S * D);
  {
    const OpTimer timer(pool.profile(), OpKind::AttentionProjections);
    matmul(pool, attn.data(), S, lw.o_proj, branch.data());
  }
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    add_normed(pool.tier(), h, branch.data(), r0, r1, D, lw.post_attention_layernorm.data(), eps);
  });
}

// Pre-feedforward norm, gate/up, GELU(tanh) gating, down projection; in an MoE layer its
// post_feedforward_layernorm_1 plus the experts' branch (moe_experts); then the post-norm and
// the residual.
void TextModel::mlp_block(ThreadPool& pool, int li, FloatTensor& hidden, LayerPass& pass,
                          TapRecorder* taps) const {
  const LayerSpec& ls = cfg_.layers[static_cast<size_t>(li)];
  const TextLayerWeights& lw = w_.layers[static_cast<size_t>(li)];
  const int64_t S = hidden.dim(0), D = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  float* h = hidden.data.data();
  const int64_t I = ls.mlp_width;
  auto& x = pass.x;
  sized(x, S * D);
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    rmsnorm_rows(pool.tier(), h + r0 * D, r1 - r0, D, lw.pre_feedforward_layernorm.data(), eps,
                 x.data() + r0 * D);
  });
  auto& gate = pass.gate;
  auto& up = pass.up;
  sized(gate, S * I);
  sized(up, S * I);
  std::optional<OpTimer> timer(std::in_place, pool.profile(), OpKind::MlpProjections);
  matmul_many(pool, x.data(), S, {{lw.gate_proj, gate.data()}, {lw.up_proj, up.data()}});
  timer.reset();
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    gelu_tanh_mul(pool.tier(), gate.data() + r0 * I, up.data() + r0 * I, (r1 - r0) * I,
                  gate.data() + r0 * I);
  });
  auto& branch = pass.branch;
  sized(branch, S * D);
  timer.emplace(pool.profile(), OpKind::MlpProjections);
  matmul(pool, gate.data(), S, lw.down_proj, branch.data());
  timer.reset();
  if (ls.moe) {
    // h1 + h2: the dense MLP after post_feedforward_layernorm_1, plus the experts' branch (both
    // computed from the residual stream before this block adds to it).
    timer.emplace(pool.profile(), OpKind::Experts);
    moe_experts(pool, li, hidden, pass, taps);
    timer.reset();
    const float* moe = pass.moe_out.data();
    for_rows(pool, S, [&](int64_t r0, int64_t r1) {
      float* b = branch.data() + r0 * D;
      rmsnorm_rows(pool.tier(), b, r1 - r0, D, lw.post_feedforward_layernorm_1.data(), eps, b);
      for (int64_t i = r0 * D; i < r1 * D; ++i) branch[static_cast<size_t>(i)] += moe[i];
    });
  }
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    add_normed(pool.tier(), h, branch.data(), r0, r1, D, lw.post_feedforward_layernorm.data(), eps);
  });
}

// The router (scale-free RMSNorm of the residual r, times router.scale and D^-1/2, projected to
// one score per expert, softmax over all experts, top-k by probability with the lower id first
// on ties, renormalised, times per_expert_scale) and the chosen experts on
// pre_feedforward_layernorm_2(r), summed and post-normed (docs: gemma4-large.md).
void TextModel::moe_experts(ThreadPool& pool, int li, const FloatTensor& hidden, LayerPass& pass,
                            TapRecorder* taps) const {
  const TextLayerWeights& lw = w_.layers[static_cast<size_t>(li)];
  const int64_t S = hidden.dim(0), D = cfg_.hidden_size, E = cfg_.num_experts,
                K = cfg_.top_k_experts;
  const int L = cfg_.num_hidden_layers;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const float* h = hidden.data.data();
  const float root = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
  auto& xr = pass.moe_x;
  sized(xr, S * D);
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    rmsnorm_rows(pool.tier(), h + r0 * D, r1 - r0, D, nullptr, eps, xr.data() + r0 * D);
    for (int64_t r = r0; r < r1; ++r) {
      float* xrow = xr.data() + r * D;
      for (int64_t d = 0; d < D; ++d)
        xrow[d] = xrow[d] * lw.router_scale[static_cast<size_t>(d)] * root;
    }
  });
  auto& probs = pass.router_probs;
  sized(probs, S * E);
  matmul(pool, xr.data(), S, lw.router_proj, probs.data());
  auto& ids = pass.expert_ids;
  auto& wts = pass.expert_weights;
  sized(ids, S * K);
  sized(wts, S * K);
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t r = r0; r < r1; ++r) {
      float* p = probs.data() + r * E;
      softmax_inplace(pool.tier(), p, E);
      for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = static_cast<int32_t>(e);
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
        return p[a] > p[b] || (p[a] == p[b] && a < b);
      });
      float sum = 0.0f;
      for (int64_t j = 0; j < K; ++j) sum += p[order[static_cast<size_t>(j)]];
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = order[static_cast<size_t>(j)];
        ids[static_cast<size_t>(r * K + j)] = e;
        wts[static_cast<size_t>(r * K + j)] =
            p[e] / sum * lw.router_per_expert_scale[static_cast<size_t>(e)];
      }
    }
  });
  if (taps) {
    taps->append_layer("router_probs", li, L, {E}, probs.data(), S);
    taps->append_layer("router_topk_weights", li, L, {K}, wts.data(), S);
    if (taps->wants("router_topk_ids")) {
      const std::vector<int64_t> ids64(ids.begin(), ids.end());
      taps->append_layer_ids("router_topk_ids", li, L, {K}, ids64.data(), S);
    }
  }
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    rmsnorm_rows(pool.tier(), h + r0 * D, r1 - r0, D, lw.pre_feedforward_layernorm_2.data(), eps,
                 xr.data() + r0 * D);
  });
  auto& out = pass.moe_out;
  sized(out, S * D);
  experts_forward(pool, xr.data(), S, lw.experts_gate_up, lw.experts_down, ids.data(), wts.data(),
                  K, out.data(), pass.experts);
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    rmsnorm_rows(pool.tier(), out.data() + r0 * D, r1 - r0, D,
                 lw.post_feedforward_layernorm_2.data(), eps, out.data() + r0 * D);
  });
}

// Per-layer input: a gate from the un-normalized stream times this layer's PLE slice, projected
// back, post-normed and added; layer_scalar then scales the whole residual stream.
void TextModel::ple_block(ThreadPool& pool, int li, FloatTensor& hidden, const PerLayerInputs& pli,
                          LayerPass& pass) const {
  const OpTimer timer(pool.profile(), OpKind::PerLayerInput);
  const TextLayerWeights& lw = w_.layers[static_cast<size_t>(li)];
  const int64_t S = hidden.dim(0), D = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  float* h = hidden.data.data();
  const int64_t P = cfg_.ple_dim();
  if (pli.rows != S || pli.dim != P || !pli.holds(li))
    fail("layer ", li, ": per_layer_inputs holds rows ", pli.rows, ", layers [", pli.first_layer,
         ", ", pli.first_layer + pli.num_layers, "), width ", pli.dim, "; expected ", S,
         " rows including layer ", li, ", width ", P);
  auto& g = pass.ple_gate;
  sized(g, S * P);
  matmul(pool, h, S, lw.per_layer_input_gate, g.data());
  // The CPU tier's GELU, as the MLP's: the scalar one (std::tanh per element) was ~1.5% of an
  // AMX-tier prefill.
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* gr = g.data() + r * P;
      gelu_tanh_mul(pool.tier(), gr, pli.at(r, li), P, gr);
    }
  });
  auto& branch = pass.branch;
  sized(branch, S * D);
  matmul(pool, g.data(), S, lw.per_layer_projection, branch.data());
  // layer_scalar scales the whole residual stream, as the layer's last op.
  for_rows(pool, S, [&](int64_t r0, int64_t r1) {
    add_normed(pool.tier(), h, branch.data(), r0, r1, D, lw.post_per_layer_input_norm.data(), eps);
    for (int64_t i = r0 * D; i < r1 * D; ++i) h[i] *= lw.layer_scalar;
  });
}

void TextModel::run_layers(ThreadPool& pool, int begin, int end,
                           std::span<const RowSegment> segments, FloatTensor& hidden,
                           const PerLayerInputs& pli, TapRecorder* taps) const {
  const int L = cfg_.num_hidden_layers;
  if (begin < 0 || end > L || begin >= end)
    fail("layer range [", begin, ", ", end, ") is not inside [0, ", L, ")");
  if (hidden.shape.size() != 2 || hidden.dim(1) != cfg_.hidden_size)
    fail("hidden_states must be [S, ", cfg_.hidden_size, "], got ", shape_str(hidden.shape));
  const int64_t S = hidden.dim(0);
  if (segments.empty()) fail("run_layers: no sequence to run");
  LayerPass pass;
  pass.segments = segments;
  pass.kv_type = segments.front().cache->kv_type();
  int64_t row = 0;
  for (const RowSegment& seg : segments) {
    const KvCache& cache = *seg.cache;
    if (seg.row0 != row || seg.rows <= 0)
      fail("run_layers: sequence segments must cover the rows in order without gaps (rows ",
           seg.row0, "..", seg.row0 + seg.rows, " after row ", row, ")");
    row += seg.rows;
    if (cache.kv_type() != pass.kv_type)
      fail("sequences batched together must keep the same KV row type (",
           kv_type_name(pass.kv_type), " and ", kv_type_name(cache.kv_type()), ")");
    if (seg.start != cache.n_past())
      fail("positions start at ", seg.start, " but this sequence's KV cache holds positions [0, ",
           cache.n_past(), "): a call's rows must continue the cache");
    if (cache.n_past() + seg.rows > cache.max_context())
      fail("context limit reached: ", cache.n_past() + seg.rows,
           " tokens exceed the context size of ", cache.max_context(),
           " (raise --ctx-size / -c, up to the model's max_position_embeddings of ",
           cfg_.max_position_embeddings, ")");
    // RoPE angles for this sequence's rows, at its own positions.
    for (auto [angles, table] :
         {std::pair{&pass.rope_sliding, &rope_sliding_}, std::pair{&pass.rope_full, &rope_full_}}) {
      const RopeAngles part = RopeAngles::at(*table, seg.start, seg.rows);
      angles->head_dim = part.head_dim;
      angles->n_rotated = part.n_rotated;
      angles->cos.insert(angles->cos.end(), part.cos.begin(), part.cos.end());
      angles->sin.insert(angles->sin.end(), part.sin.begin(), part.sin.end());
    }
  }
  if (row != S) fail("run_layers: sequence segments cover ", row, " rows of ", S);
  // The image block's reach: a row of an image group sees up to the last row of its run.
  pass.last_key.assign(segments.size(), {});
  for (size_t si = 0; si < segments.size() && cfg_.bidirectional_vision; ++si) {
    const RowSegment& seg = segments[si];
    if (!seg.vision_groups) continue;
    const int32_t* g = seg.vision_groups;
    bool any = false;
    for (int64_t r = 0; r < seg.rows; ++r) any = any || g[r] >= 0;
    if (!any) continue;
    for (int64_t r = 1; r < seg.rows; ++r)
      if (g[r] >= 0 && g[r] != g[r - 1])
        for (int64_t q = 0; q < r - 1; ++q)
          if (g[q] == g[r])
            fail("vision group ", g[r], " is not one contiguous run of rows (rows ", q, " and ", r,
                 ")");
    auto& last = pass.last_key[si];
    last.resize(static_cast<size_t>(seg.rows));
    for (int64_t r = seg.rows - 1; r >= 0; --r)
      last[static_cast<size_t>(r)] = r + 1 < seg.rows && g[r] >= 0 && g[r + 1] == g[r]
                                         ? last[static_cast<size_t>(r + 1)]
                                         : seg.start + r;
  }
  pass.k.resize(static_cast<size_t>(L));
  pass.v.resize(static_cast<size_t>(L));
  pass.k16.resize(static_cast<size_t>(L));
  pass.v16.resize(static_cast<size_t>(L));
  pass.kq8.resize(static_cast<size_t>(L));
  pass.vq8.resize(static_cast<size_t>(L));
  for (int li = begin; li < end; ++li) layer_forward(pool, li, hidden, pli, pass, taps);
  for (int li = begin; li < end; ++li)
    if (!cfg_.layers[static_cast<size_t>(li)].kv_shared)
      for (const RowSegment& seg : segments) {
        const int64_t kvw = static_cast<int64_t>(pass.k[static_cast<size_t>(li)].size()) / S;
        seg.cache->own(li)->append(pass.k[static_cast<size_t>(li)].data() + seg.row0 * kvw,
                                   pass.v[static_cast<size_t>(li)].data() + seg.row0 * kvw,
                                   seg.rows);
      }
}

FloatTensor TextModel::head(ThreadPool& pool, const FloatTensor& hidden, int64_t first_row,
                            int64_t n_rows, TapRecorder* taps) const {
  const OpTimer timer(pool.profile(), OpKind::Head);
  const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size;
  if (w_.final_norm.empty()) fail("the final norm and LM head are not held by this stage");
  if (first_row < 0 || n_rows < 0 || first_row + n_rows > hidden.dim(0))
    fail("head: row range out of bounds");
  std::vector<float> normed(static_cast<size_t>(n_rows * D));
  rmsnorm_rows(pool.tier(), hidden.row(first_row), n_rows, D, w_.final_norm.data(),
               static_cast<float>(cfg_.rms_norm_eps), normed.data());
  if (taps) taps->append("final_hidden", {D}, normed.data(), n_rows);
  FloatTensor logits({n_rows, V});
  matmul(pool, normed.data(), n_rows, w_.embed_tokens, logits.data.data());
  if (cfg_.final_logit_softcapping > 0)
    softcap(pool.tier(), logits.data.data(), logits.numel(),
            static_cast<float>(cfg_.final_logit_softcapping));
  if (taps) taps->append("logits", {V}, logits.data.data(), n_rows);
  return logits;
}

}  // namespace gemstage
