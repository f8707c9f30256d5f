#include "gemma4/assistant_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/error.h"
#include "gemma4/registry.h"
#include "io/mapped_file.h"
#include "kernels/matmul.h"
#include "kernels/weight_rows.h"

namespace gemstage {

using nlohmann::json;

namespace {

int get_int_field(const json& j, const char* key, int def, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_number_integer()) fail(where, ": ", key, " must be an integer");
  return j[key].get<int>();
}

bool get_bool_field(const json& j, const char* key, bool def, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_boolean()) fail(where, ": ", key, " must be true or false");
  return j[key].get<bool>();
}

RopeTable rope_table(const RopeParams& p, int hd) {
  return p.type == "proportional" ? RopeTable::proportional(hd, p.theta, p.partial_rotary_factor)
                                  : RopeTable::standard(hd, p.theta);
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

AssistantConfig parse_assistant_config(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(source, ": not valid JSON (", e.what(), ")");
  }
  if (!j.is_object()) fail(source, ": top level must be an object");
  const std::string mt = j.value("model_type", std::string());
  if (mt != "gemma4_assistant")
    fail(source, ": model_type is '", mt, "', a drafter must be 'gemma4_assistant'");
  if (!j.contains("text_config") || !j["text_config"].is_object())
    fail(source, ": a gemma4_assistant config needs a text_config object");
  AssistantConfig a;
  a.source = source;
  a.backbone_hidden_size = get_int_field(j, "backbone_hidden_size", 0, source);
  if (a.backbone_hidden_size <= 0) fail(source, ": backbone_hidden_size must be positive");
  a.use_ordered_embeddings = get_bool_field(j, "use_ordered_embeddings", false, source);
  a.num_centroids = get_int_field(j, "num_centroids", 0, source);
  a.centroid_top_k = get_int_field(j, "centroid_intermediate_top_k", 0, source);
  json tj = j["text_config"];
  const std::string where = source + ": text_config";
  const int layers = get_int_field(tj, "num_hidden_layers", 0, where);
  const int shared = get_int_field(tj, "num_kv_shared_layers", 0, where);
  // Every drafter layer reads the target's K/V; 0 or missing means all of them (the doc).
  if (shared != 0 && shared != layers)
    fail(where, ": num_kv_shared_layers is ", shared, "; a drafter's layers are all KV-shared (",
         layers, ")");
  if (get_int_field(tj, "hidden_size_per_layer_input", 0, where) != 0 ||
      get_int_field(tj, "vocab_size_per_layer_input", 0, where) != 0)
    fail(where,
         ": a drafter has no per-layer inputs (hidden_size_per_layer_input and "
         "vocab_size_per_layer_input must be 0)");
  if (get_bool_field(tj, "enable_moe_block", false, where))
    fail(where, ": a drafter has no MoE block (enable_moe_block must be false)");
  if (get_bool_field(tj, "use_double_wide_mlp", false, where))
    fail(where, ": a drafter has no double-wide MLP (use_double_wide_mlp must be false)");
  // Parsed as a plain text decoder whose layers keep their own (Q-only) attention; the target
  // supplies every K/V.
  tj["num_kv_shared_layers"] = 0;
  tj["hidden_size_per_layer_input"] = 0;
  tj["vocab_size_per_layer_input"] = 0;
  tj["model_type"] = "gemma4_text";
  ModelConfig mc = parse_model_config(tj.dump(), where);
  a.text = std::move(mc.text);
  a.warnings = std::move(mc.warnings);
  if (a.use_ordered_embeddings) {
    if (a.num_centroids <= 0 || a.text.vocab_size % a.num_centroids != 0)
      fail(source, ": num_centroids (", a.num_centroids, ") must divide vocab_size (",
           a.text.vocab_size, ")");
    if (a.centroid_top_k <= 0 || a.centroid_top_k > a.num_centroids)
      fail(source, ": centroid_intermediate_top_k (", a.centroid_top_k, ") must be in [1, ",
           a.num_centroids, "]");
  }
  return a;
}

AssistantConfig load_assistant_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::exists(path))
    fail(path,
         " does not exist; a drafter (--model-draft) is a gemma4_assistant checkpoint "
         "directory");
  return parse_assistant_config(read_text_file(path, size_t{16} << 20), path);
}

AssistantDonors assistant_donor_layers(const TextConfig& t) {
  AssistantDonors d;
  const int L = t.num_hidden_layers;
  const int last_own = t.num_kv_shared_layers > 0 ? t.first_kv_shared_layer() : L;
  for (int i = 0; i < last_own && i < static_cast<int>(t.layers.size()); ++i)
    (t.layers[static_cast<size_t>(i)].type == LayerType::Full ? d.full : d.sliding) = i;
  return d;
}

void check_assistant_matches(const AssistantConfig& a, const ModelConfig& target,
                             const std::string& assistant_path, const std::string& target_path) {
  const TextConfig& t = target.text;
  auto mismatch = [&](const std::string& field, int64_t drafter, int64_t tgt) {
    fail("drafter ", assistant_path, " does not fit target ", target_path, ": ", field, " is ",
         drafter, " in the drafter but ", tgt, " in the target");
  };
  if (a.backbone_hidden_size != t.hidden_size)
    mismatch("backbone_hidden_size (target hidden_size)", a.backbone_hidden_size, t.hidden_size);
  if (a.text.vocab_size != t.vocab_size) mismatch("vocab_size", a.text.vocab_size, t.vocab_size);
  const AssistantDonors donors = assistant_donor_layers(t);
  for (const LayerSpec& ls : a.text.layers) {
    const bool full = ls.type == LayerType::Full;
    const int donor = full ? donors.full : donors.sliding;
    const std::string kind = full ? "full_attention" : "sliding_attention";
    if (donor < 0)
      fail("drafter ", assistant_path, " does not fit target ", target_path, ": it has ", kind,
           " layers but the target has no ", kind, " layer to read K/V from");
    const LayerSpec& ts = t.layers[static_cast<size_t>(donor)];
    if (ls.head_dim != ts.head_dim)
      mismatch(full ? "global_head_dim" : "head_dim", ls.head_dim, ts.head_dim);
    if (ls.num_kv_heads != ts.num_kv_heads)
      mismatch(full && ls.k_eq_v ? "num_global_key_value_heads" : "num_key_value_heads",
               ls.num_kv_heads, ts.num_kv_heads);
    if (ls.k_eq_v != ts.k_eq_v) mismatch("attention_k_eq_v", ls.k_eq_v, ts.k_eq_v);
  }
  // The drafter sees the last W+1 sliding positions; the target's ring keeps its window plus
  // kRollbackSlack rows, minus the rows a verify may add and roll back.
  if (a.text.sliding_window + 1 + 64 > t.sliding_window + kRollbackSlack)
    mismatch("sliding_window", a.text.sliding_window, t.sliding_window);
}

AssistantModel::~AssistantModel() = default;

std::unique_ptr<AssistantModel> AssistantModel::open(const std::string& dir) {
  return open_from(dir, load_assistant_config(dir),
                   std::make_shared<TensorStore>(TensorStore::open_dir(dir)));
}

std::unique_ptr<AssistantModel> AssistantModel::open_from(
    const std::string& dir, AssistantConfig cfg, std::shared_ptr<const TensorSource> tensors) {
  std::unique_ptr<AssistantModel> m(new AssistantModel());
  m->path_ = dir;
  m->cfg_ = std::move(cfg);
  m->tensors_ = std::move(tensors);
  const TensorSource& store = *m->tensors_;
  const AssistantConfig& c = m->cfg_;
  const TextConfig& t = c.text;
  const int64_t Ha = t.hidden_size, Ht = c.backbone_hidden_size, V = t.vocab_size,
                H = t.num_attention_heads;
  std::vector<std::string> problems;
  auto take = [&](const std::string& key, const Shape& shape, DType need_dtype = DType::F32,
                  bool any_float = true) -> WeightView {
    if (!store.has(key)) {
      problems.push_back("missing tensor " + key + " (expected " + shape_str(shape) + ")");
      return {};
    }
    WeightView w = store.view(key);
    m->keys_.push_back(key);
    if (w.shape != shape) {
      problems.push_back("tensor " + key + " in " + store.file_of(key) + ": expected " +
                         shape_str(shape) + ", found " + shape_str(w.shape));
      return {};
    }
    // Matrices may be quantized blocks (a bundle's q8_0 / q4_0 drafter); vectors are widened.
    const bool quant_ok = shape.size() == 2 && (w.dtype == DType::Q8_0 || w.dtype == DType::Q4_0);
    const bool float_ok =
        w.dtype == DType::F32 || w.dtype == DType::BF16 || w.dtype == DType::F16 || quant_ok;
    if (any_float ? !float_ok : w.dtype != need_dtype) {
      problems.push_back("tensor " + key + ": dtype " + std::string(dtype_name(w.dtype)) +
                         " is not supported");
      return {};
    }
    return w;
  };
  auto vec = [&](const std::string& key, int64_t n) {
    WeightView w = take(key, {n});
    return w.valid() ? vector_to_f32(w) : std::vector<float>{};
  };
  m->pre_projection_ = take("pre_projection.weight", {Ha, 2 * Ht});
  m->post_projection_ = take("post_projection.weight", {Ht, Ha});
  m->embed_tokens_ = take("model.embed_tokens.weight", {V, Ha});
  m->final_norm_ = vec("model.norm.weight", Ha);
  if (c.use_ordered_embeddings) {
    m->centroids_ = take("masked_embedding.centroids.weight", {c.num_centroids, Ha});
    WeightView order = take("masked_embedding.token_ordering", {V}, DType::I64, false);
    if (order.valid()) {
      m->token_ordering_.resize(static_cast<size_t>(V));
      std::memcpy(m->token_ordering_.data(), order.data, static_cast<size_t>(V) * 8);
      std::vector<uint8_t> seen(static_cast<size_t>(V), 0);
      for (int64_t id : m->token_ordering_) {
        if (id < 0 || id >= V || seen[static_cast<size_t>(id)]) {
          problems.push_back("masked_embedding.token_ordering is not a permutation of 0.." +
                             std::to_string(V - 1) + " (id " + std::to_string(id) + ")");
          break;
        }
        seen[static_cast<size_t>(id)] = 1;
      }
    }
  }
  m->layers_.resize(static_cast<size_t>(t.num_hidden_layers));
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    const LayerSpec& ls = t.layers[static_cast<size_t>(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const int64_t hd = ls.head_dim, I = ls.mlp_width;
    Layer& L = m->layers_[static_cast<size_t>(i)];
    L.q_proj = take(p + "self_attn.q_proj.weight", {H * hd, Ha});
    L.o_proj = take(p + "self_attn.o_proj.weight", {Ha, H * hd});
    L.q_norm = vec(p + "self_attn.q_norm.weight", hd);
    L.gate_proj = take(p + "mlp.gate_proj.weight", {I, Ha});
    L.up_proj = take(p + "mlp.up_proj.weight", {I, Ha});
    L.down_proj = take(p + "mlp.down_proj.weight", {Ha, I});
    L.input_layernorm = vec(p + "input_layernorm.weight", Ha);
    L.post_attention_layernorm = vec(p + "post_attention_layernorm.weight", Ha);
    L.pre_feedforward_layernorm = vec(p + "pre_feedforward_layernorm.weight", Ha);
    L.post_feedforward_layernorm = vec(p + "post_feedforward_layernorm.weight", Ha);
    const std::vector<float> scalar = vec(p + "layer_scalar", 1);
    if (!scalar.empty()) L.layer_scalar = scalar[0];
  }
  if (!problems.empty()) {
    std::string msg = "drafter " + dir + ": " + std::to_string(problems.size()) + " problem(s):";
    for (const std::string& s : problems) msg += "\n  " + s;
    fail(msg);
  }
  int sliding_hd = t.head_dim, full_hd = t.global_head_dim;
  for (const LayerSpec& s : t.layers)
    (s.type == LayerType::Full ? full_hd : sliding_hd) = s.head_dim;
  m->rope_sliding_ = rope_table(t.rope_sliding, sliding_hd);
  m->rope_full_ = rope_table(t.rope_full, full_hd);
  return m;
}

void AssistantModel::attend(CpuTier tier, const LayerSpec& ls, const LayerKvCache& cache,
                            int64_t position, const float* q, float* out) const {
  const int64_t H = cfg_.text.num_attention_heads, hd = ls.head_dim, Hkv = ls.num_kv_heads;
  if (cache.width() != Hkv * hd)
    fail("drafter: the target's donor cache holds rows of ", cache.width(),
         " floats, the drafter "
         "expects ",
         Hkv * hd);
  if (cache.size() < position)
    fail("drafter: the target's cache holds ", cache.size(),
         " positions, fewer than the draft "
         "position ",
         position);
  // Full layers see every position 0..P-1; sliding layers the last W+1 of them (the drafter's
  // bidirectional window |q - kv| <= W, docs/gemma4-mtp.md pitfall 7).
  const int64_t first = ls.type == LayerType::Full
                            ? 0
                            : std::max<int64_t>(0, position - cfg_.text.sliding_window - 1);
  const int64_t n = position - first;
  std::fill(out, out + H * hd, 0.0f);
  if (n <= 0) return;
  std::vector<float> scores(static_cast<size_t>(n)), krow(static_cast<size_t>(hd));
  const int64_t group = H / Hkv;
  const bool f32 = cache.kv_type() == KvType::F32;
  auto row = [&](bool is_k, int64_t pos, int64_t kvh) -> const float* {
    if (f32) return (is_k ? cache.k_at<float>(pos) : cache.v_at<float>(pos)) + kvh * hd;
    cache.widen(is_k, pos, kvh * hd, hd, krow.data());  // bf16 or q8_0 rows
    return krow.data();
  };
  for (int64_t h = 0; h < H; ++h) {
    const int64_t kvh = h / group;
    const float* qh = q + h * hd;
    for (int64_t j = 0; j < n; ++j)
      scores[static_cast<size_t>(j)] = dot(qh, row(true, first + j, kvh), hd);  // scale 1.0
    softmax_inplace(tier, scores.data(), n);
    float* oh = out + h * hd;
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = row(false, first + j, kvh);
      const float p = scores[static_cast<size_t>(j)];
      for (int64_t i = 0; i < hd; ++i) oh[i] += p * vr[i];
    }
  }
}

int32_t AssistantModel::step(ThreadPool& pool, const DraftContext& ctx, int32_t token,
                             std::vector<float>& h, DraftStepRecord* rec) const {
  const TextConfig& t = cfg_.text;
  const int64_t Ha = t.hidden_size, Ht = cfg_.backbone_hidden_size, V = t.vocab_size,
                H = t.num_attention_heads;
  const float eps = static_cast<float>(t.rms_norm_eps);
  if (!ctx.target_embed || ctx.target_embed->cols() != Ht)
    fail("drafter: the target's embedding table must be [V, ", Ht, "]");
  if (static_cast<int64_t>(h.size()) != Ht)
    fail("drafter: the hidden state has ", h.size(), " values, expected ", Ht);
  if (token < 0 || token >= ctx.target_embed->rows())
    fail("drafter: token id ", token, " is outside the target's vocabulary of ",
         ctx.target_embed->rows());
  // concat(target_embed[x] * sqrt(H_t), h): the embedding first (doc pitfall 3).
  std::vector<float> in(static_cast<size_t>(2 * Ht));
  std::vector<uint8_t> raw;
  gather_weight_row_to_f32(*ctx.target_embed, token, in.data(), raw);
  const float scale = std::sqrt(static_cast<float>(Ht));
  for (int64_t i = 0; i < Ht; ++i) in[static_cast<size_t>(i)] *= scale;
  std::copy(h.begin(), h.end(), in.begin() + Ht);
  std::vector<float> x(static_cast<size_t>(Ha)), a(static_cast<size_t>(Ha)),
      branch(static_cast<size_t>(Ha));
  matmul(pool, in.data(), 1, pre_projection_, x.data());
  if (rec) rec->pre_projection = x;
  if (rec) rec->layer_out.clear();
  for (int li = 0; li < t.num_hidden_layers; ++li) {
    const LayerSpec& ls = t.layers[static_cast<size_t>(li)];
    const Layer& L = layers_[static_cast<size_t>(li)];
    const int64_t hd = ls.head_dim, I = ls.mlp_width;
    const LayerKvCache* cache = ls.type == LayerType::Full ? ctx.full : ctx.sliding;
    if (!cache) fail("drafter layer ", li, ": no target donor cache of its type was given");
    rmsnorm_rows(pool.tier(), x.data(), 1, Ha, L.input_layernorm.data(), eps, a.data());
    std::vector<float> q(static_cast<size_t>(H * hd)), o(static_cast<size_t>(H * hd));
    matmul(pool, a.data(), 1, L.q_proj, q.data());
    rmsnorm_rows(pool.tier(), q.data(), H, hd, L.q_norm.data(), eps, q.data());
    apply_rope(ls.type == LayerType::Full ? rope_full_ : rope_sliding_, ctx.position, q.data(),
               static_cast<int>(H));
    attend(pool.tier(), ls, *cache, ctx.position, q.data(), o.data());
    matmul(pool, o.data(), 1, L.o_proj, branch.data());
    rmsnorm_rows(pool.tier(), branch.data(), 1, Ha, L.post_attention_layernorm.data(), eps,
                 branch.data());
    for (int64_t i = 0; i < Ha; ++i) x[static_cast<size_t>(i)] += branch[static_cast<size_t>(i)];
    rmsnorm_rows(pool.tier(), x.data(), 1, Ha, L.pre_feedforward_layernorm.data(), eps, a.data());
    std::vector<float> gate(static_cast<size_t>(I)), up(static_cast<size_t>(I));
    matmul_many(pool, a.data(), 1, {{L.gate_proj, gate.data()}, {L.up_proj, up.data()}});
    gelu_tanh_mul(pool.tier(), gate.data(), up.data(), I, gate.data());
    matmul(pool, gate.data(), 1, L.down_proj, branch.data());
    rmsnorm_rows(pool.tier(), branch.data(), 1, Ha, L.post_feedforward_layernorm.data(), eps,
                 branch.data());
    for (int64_t i = 0; i < Ha; ++i)
      x[static_cast<size_t>(i)] =
          (x[static_cast<size_t>(i)] + branch[static_cast<size_t>(i)]) * L.layer_scalar;
    if (rec) rec->layer_out.insert(rec->layer_out.end(), x.begin(), x.end());
  }
  std::vector<float> hn(static_cast<size_t>(Ha));
  rmsnorm_rows(pool.tier(), x.data(), 1, Ha, final_norm_.data(), eps, hn.data());
  if (rec) rec->final_hidden = hn;
  matmul(pool, hn.data(), 1, post_projection_, h.data());
  if (rec) rec->hidden_out = h;
  // The tied head without soft-cap (doc pitfall 8); with centroids only the candidates of the
  // top centroids are scored, every other token gets min(candidates) - 1.
  int32_t best = 0;
  if (!cfg_.use_ordered_embeddings) {
    std::vector<float> logits(static_cast<size_t>(V));
    matmul(pool, hn.data(), 1, embed_tokens_, logits.data());
    best = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    if (rec) rec->logits = std::move(logits);
    return best;
  }
  const int64_t C = cfg_.num_centroids, K = cfg_.centroid_top_k, per = V / C;
  std::vector<float> cl(static_cast<size_t>(C));
  matmul(pool, hn.data(), 1, centroids_, cl.data());
  std::vector<int64_t> order(static_cast<size_t>(C));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int64_t l, int64_t r) {
    const float a1 = cl[static_cast<size_t>(l)], b1 = cl[static_cast<size_t>(r)];
    return a1 > b1 || (a1 == b1 && l < r);
  });
  order.resize(static_cast<size_t>(K));
  if (rec) rec->centroid_topk = order;
  std::vector<float> row(static_cast<size_t>(Ha));
  std::vector<int64_t> cand;
  std::vector<float> cand_logit;
  cand.reserve(static_cast<size_t>(K * per));
  for (int64_t c : order)
    for (int64_t j = 0; j < per; ++j)
      cand.push_back(token_ordering_[static_cast<size_t>(c * per + j)]);
  float best_logit = -std::numeric_limits<float>::infinity(),
        min_logit = std::numeric_limits<float>::infinity();
  for (int64_t id : cand) {
    gather_weight_row_to_f32(embed_tokens_, id, row.data(), raw);
    const float l = dot(hn.data(), row.data(), Ha);
    cand_logit.push_back(l);
    min_logit = std::min(min_logit, l);
    // First index on ties, as argmax over the full masked vector.
    if (l > best_logit || (l == best_logit && id < best)) {
      best_logit = l;
      best = static_cast<int32_t>(id);
    }
  }
  if (rec) {
    rec->logits.assign(static_cast<size_t>(V), min_logit - 1.0f);
    for (size_t i = 0; i < cand.size(); ++i)
      rec->logits[static_cast<size_t>(cand[i])] = cand_logit[i];
  }
  return best;
}

}  // namespace gemstage
