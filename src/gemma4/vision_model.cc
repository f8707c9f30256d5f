#include "gemma4/vision_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "gemma4/registry.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "kernels/weight_rows.h"

namespace gemstage {

// ---------------------------------------------------------------------------------------------
// weights

namespace {

constexpr int64_t kTileBytes = 256 * 1024;

// matmul over row tiles of x: a tile stays in cache while the weight streams past it, instead of
// every group of weight rows streaming all of x (the vision tower runs thousands of rows at
// once). Each output row is computed exactly as one matmul call would compute it.
void matmul_tiled(ThreadPool& pool, const float* x, int64_t S, const WeightView& w, float* y) {
  const int64_t K = w.cols(), N = w.rows();
  const int64_t tile = std::max<int64_t>(16, (kTileBytes / (K * 4)) & ~int64_t{3});
  for (int64_t s0 = 0; s0 < S; s0 += tile)
    matmul(pool, x + s0 * K, std::min(tile, S - s0), w, y + s0 * N);
}

void clamp_copy(const float* x, int64_t n, float lo, float hi, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::min(std::max(x[i], lo), hi);
}

}  // namespace

VisionWeights bind_vision_weights(const ModelConfig& c, const TensorSource& store) {
  if (!c.vision) fail(c.source, ": the config has no vision_config");
  // Clip bounds exist in the table only with use_clipped_linears; otherwise they stay infinite.
  VisionWeights w;
  for (const TensorSpec& s : vision_tensor_specs(c, &w))
    if (s.role == TensorRole::Required) bind_tensor(s, store);
  return w;
}

void clippable_linear(ThreadPool& pool, const ClippableLinear& l, const float* x, int64_t S,
                      float* y) {
  const int64_t in = l.weight.cols(), out = l.weight.rows();
  const bool clip_in = std::isfinite(l.input_min) || std::isfinite(l.input_max);
  if (clip_in) {
    std::vector<float> xc(static_cast<size_t>(S * in));
    clamp_copy(x, S * in, l.input_min, l.input_max, xc.data());
    matmul_tiled(pool, xc.data(), S, l.weight, y);
  } else {
    matmul_tiled(pool, x, S, l.weight, y);
  }
  if (std::isfinite(l.output_min) || std::isfinite(l.output_max))
    clamp_copy(y, S * out, l.output_min, l.output_max, y);
}

// ---------------------------------------------------------------------------------------------
// 2D RoPE

VisionRope VisionRope::make(int head_dim, double theta) {
  if (head_dim <= 0 || head_dim % 4 != 0)
    fail("vision head_dim ", head_dim,
         " must be a positive multiple of 4 (2D RoPE splits each head into an x and a y half, "
         "each rotated in pairs)");
  VisionRope r;
  r.head_dim = head_dim;
  const int part = head_dim / 2;
  r.inv_freq.resize(static_cast<size_t>(part / 2));
  for (int i = 0; i < part / 2; ++i)
    r.inv_freq[static_cast<size_t>(i)] =
        static_cast<float>(1.0 / std::pow(theta, (2.0 * i) / part));
  return r;
}

void apply_vision_rope(const VisionRope& rope, int64_t x, int64_t y, float* v, int n_heads) {
  const int part = rope.head_dim / 2, half = part / 2;
  std::vector<float> cs(static_cast<size_t>(2 * part));  // cos/sin for x then y
  for (int axis = 0; axis < 2; ++axis) {
    const float pos = static_cast<float>(axis == 0 ? x : y);
    for (int i = 0; i < half; ++i) {
      const float a = pos * rope.inv_freq[static_cast<size_t>(i)];  // f32, as HF
      cs[static_cast<size_t>(axis * part + i)] = std::cos(a);
      cs[static_cast<size_t>(axis * part + half + i)] = std::sin(a);
    }
  }
  for (int h = 0; h < n_heads; ++h) {
    for (int axis = 0; axis < 2; ++axis) {
      float* p = v + static_cast<int64_t>(h) * rope.head_dim + axis * part;
      const float* c = cs.data() + axis * part;
      const float* s = c + half;
      for (int i = 0; i < half; ++i) {
        const float x1 = p[i], x2 = p[i + half];
        p[i] = x1 * c[i] - x2 * s[i];
        p[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// patch grid and pooling

PatchGrid check_patch_positions(const int64_t* pos, int64_t max_patches, const VisionConfig& v) {
  const int k = v.pooling_kernel_size;
  const int64_t P = v.position_embedding_size;
  if (k <= 0) fail("vision_config.pooling_kernel_size must be positive, got ", k);
  if (max_patches <= 0) fail("image_position_ids: no patches");
  if (max_patches % (static_cast<int64_t>(k) * k) != 0)
    fail("image_position_ids: max_patches = ", max_patches, " is not a multiple of ", k * k,
         " (pooling_kernel_size² = ", k, "²); the processor pads to a multiple of it");
  PatchGrid g;
  g.kernel = k;
  for (int64_t r = 0; r < max_patches; ++r) {
    const int64_t x = pos[2 * r], y = pos[2 * r + 1];
    if (x == -1 && y == -1) continue;  // padding
    if (x < 0 || x >= P || y < 0 || y >= P)
      fail("image_position_ids row ", r, " = (", x, ", ", y,
           ") is outside [0, position_embedding_size = ", P,
           ") (padding rows must be (-1, -1) in both coordinates)");
    g.rows.push_back(r);
    g.width = std::max(g.width, x + 1);
    g.height = std::max(g.height, y + 1);
  }
  const int64_t n = static_cast<int64_t>(g.rows.size());
  if (n == 0) fail("image_position_ids: every row is padding (-1, -1); the image has no patches");
  if (g.width * g.height != n)
    fail("image_position_ids: the ", n, " real patches do not form a grid: x spans 0..",
         g.width - 1, " and y spans 0..", g.height - 1, ", which is ", g.width * g.height,
         " positions");
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
  for (int64_t r : g.rows) {
    const int64_t x = pos[2 * r], y = pos[2 * r + 1];
    uint8_t& s = seen[static_cast<size_t>(y * g.width + x)];
    if (s)
      fail("image_position_ids row ", r, ": patch (", x, ", ", y,
           ") appears twice; the real patches must cover the grid exactly once");
    s = 1;
  }
  if (g.width % k != 0 || g.height % k != 0)
    fail("image_position_ids: the patch grid is ", g.height, "x", g.width,
         " (rows x columns); both sides must be multiples of pooling_kernel_size ", k,
         " so that every pooled cell holds ", k * k, " patches");
  return g;
}

FloatTensor pool_by_position(const float* hidden, const int64_t* xy, int64_t n, int64_t dim, int k,
                             int64_t width, int64_t height) {
  const int64_t pw = width / k, ph = height / k;
  FloatTensor out({pw * ph, dim});
  const float w = 1.0f / static_cast<float>(k * k);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = xy[2 * i], y = xy[2 * i + 1];
    const int64_t slot = x / k + pw * (y / k);
    if (x < 0 || y < 0 || slot >= pw * ph)
      fail("pool_by_position: patch (", x, ", ", y, ") is off the grid");
    float* o = out.row(slot);
    const float* h = hidden + i * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] += h[d] * w;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// inputs

std::vector<VisionInput> vision_inputs_from_arrays(const NpyArray& pix, const NpyArray& pos,
                                                   int64_t patch_dim,
                                                   const std::string& pixels_name,
                                                   const std::string& positions_name) {
  if ((pix.shape.size() != 2 && pix.shape.size() != 3) || pix.shape.back() != patch_dim)
    fail(pixels_name, ": expected pixel_values of shape [max_patches, ", patch_dim,
         "] or [batch, max_patches, ", patch_dim, "] (3·patch_size² per patch), found ",
         shape_str(pix.shape));
  if ((pos.shape.size() != 2 && pos.shape.size() != 3) || pos.shape.back() != 2)
    fail(positions_name,
         ": expected image_position_ids of shape [max_patches, 2] or [batch, "
         "max_patches, 2], found ",
         shape_str(pos.shape));
  const int64_t B = pix.shape.size() == 3 ? pix.shape[0] : 1;
  const int64_t Np = pix.shape[pix.shape.size() - 2];
  const int64_t Bp = pos.shape.size() == 3 ? pos.shape[0] : 1;
  const int64_t Npp = pos.shape[pos.shape.size() - 2];
  if (B != Bp || Np != Npp)
    fail(pixels_name, " (shape ", shape_str(pix.shape), ") and ", positions_name, " (shape ",
         shape_str(pos.shape), ") disagree on the number of images or patches");
  if (pos.dtype != DType::I64 && pos.dtype != DType::I32)
    fail(positions_name, ": image_position_ids must be integers (int64 or int32), found ",
         dtype_name(pos.dtype));
  const std::vector<float> pv = pix.to_f32();
  const std::vector<int64_t> pp = pos.to_i64();
  std::vector<VisionInput> out(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    VisionInput& in = out[static_cast<size_t>(b)];
    in.max_patches = Np;
    in.pixel_values.assign(pv.begin() + b * Np * patch_dim, pv.begin() + (b + 1) * Np * patch_dim);
    in.position_ids.assign(pp.begin() + b * Np * 2, pp.begin() + (b + 1) * Np * 2);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// the tower

VisionTower::VisionTower(const ModelConfig& config, VisionWeights weights)
    : cfg_(config.vision.value()),
      text_hidden_(config.text.hidden_size),
      w_(std::move(weights)),
      rope_(VisionRope::make(config.vision->head_dim, config.vision->rope_theta)) {
  if (cfg_.num_attention_heads % cfg_.num_key_value_heads != 0)
    fail(config.source, ": vision num_attention_heads ", cfg_.num_attention_heads,
         " is not a multiple of num_key_value_heads ", cfg_.num_key_value_heads);
}

int64_t VisionTower::num_soft_tokens(const int64_t* position_ids, int64_t max_patches) const {
  return check_patch_positions(position_ids, max_patches, cfg_).num_soft_tokens();
}

void VisionTower::layer_forward(ThreadPool& pool, int li, FloatTensor& h,
                                const std::vector<int64_t>& xy) const {
  const VisionLayerWeights& lw = w_.layers[static_cast<size_t>(li)];
  const int64_t n = h.dim(0), Dv = cfg_.hidden_size;
  const int64_t H = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads, hd = cfg_.head_dim;
  const int64_t G = H / Hkv, kvw = Hkv * hd;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);

  // ---- attention (bidirectional over the real patches) ----
  std::vector<float> x(static_cast<size_t>(n * Dv));
  rmsnorm_rows(pool.tier(), h.data.data(), n, Dv, lw.input_layernorm.data(), eps, x.data());
  std::vector<float> q(static_cast<size_t>(n * H * hd)), k(static_cast<size_t>(n * kvw)),
      v(static_cast<size_t>(n * kvw));
  clippable_linear(pool, lw.q_proj, x.data(), n, q.data());
  clippable_linear(pool, lw.k_proj, x.data(), n, k.data());
  clippable_linear(pool, lw.v_proj, x.data(), n, v.data());
  rmsnorm_rows(pool.tier(), q.data(), n * H, hd, lw.q_norm.data(), eps, q.data());
  rmsnorm_rows(pool.tier(), k.data(), n * Hkv, hd, lw.k_norm.data(), eps, k.data());
  rmsnorm_rows(pool.tier(), v.data(), n * Hkv, hd, nullptr, eps, v.data());
  pool.parallel_for(static_cast<size_t>(n), [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      const int64_t px = xy[2 * r], py = xy[2 * r + 1];
      apply_vision_rope(rope_, px, py, q.data() + static_cast<int64_t>(r) * H * hd,
                        static_cast<int>(H));
      apply_vision_rope(rope_, px, py, k.data() + static_cast<int64_t>(r) * kvw,
                        static_cast<int>(Hkv));
    }
  });

  // Per head: scores = Q_h · K_hᵀ (scaling 1.0, every real patch attends to every real patch),
  // row softmax, out_h = P · V_h — both products through the matmul kernel (the keys, resp. the
  // transposed values, play the weight matrix).
  std::vector<float> attn(static_cast<size_t>(n * H * hd));
  std::vector<float> qh(static_cast<size_t>(n * hd)), kh(static_cast<size_t>(n * hd)),
      vt(static_cast<size_t>(hd * n)), oh(static_cast<size_t>(n * hd)),
      scores(static_cast<size_t>(n * n));
  auto as_weight = [](const std::vector<float>& m, int64_t rows, int64_t cols) {
    return WeightView{
        "vision attention operand", DType::F32, {rows, cols}, m.data(), m.size() * sizeof(float)};
  };
  int64_t staged_kvh = -1;
  for (int64_t hh = 0; hh < H; ++hh) {
    const int64_t kvh = hh / G;
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(qh.data() + r * hd, q.data() + (r * H + hh) * hd,
                  static_cast<size_t>(hd) * sizeof(float));
    if (kvh != staged_kvh) {
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(kh.data() + r * hd, k.data() + r * kvw + kvh * hd,
                    static_cast<size_t>(hd) * sizeof(float));
        for (int64_t d = 0; d < hd; ++d)
          vt[static_cast<size_t>(d * n + r)] = v[static_cast<size_t>(r * kvw + kvh * hd + d)];
      }
      staged_kvh = kvh;
    }
    matmul_tiled(pool, qh.data(), n, as_weight(kh, n, hd), scores.data());
    pool.parallel_for(static_cast<size_t>(n), [&](size_t b, size_t e) {
      for (size_t r = b; r < e; ++r)
        softmax_inplace(pool.tier(), scores.data() + r * static_cast<size_t>(n), n);
    });
    matmul_tiled(pool, scores.data(), n, as_weight(vt, hd, n), oh.data());
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(attn.data() + (r * H + hh) * hd, oh.data() + r * hd,
                  static_cast<size_t>(hd) * sizeof(float));
  }
  std::vector<float> branch(static_cast<size_t>(n * Dv));
  clippable_linear(pool, lw.o_proj, attn.data(), n, branch.data());
  rmsnorm_rows(pool.tier(), branch.data(), n, Dv, lw.post_attention_layernorm.data(), eps,
               branch.data());
  for (size_t i = 0; i < branch.size(); ++i) h.data[i] += branch[i];

  // ---- MLP ----
  const int64_t I = cfg_.intermediate_size;
  rmsnorm_rows(pool.tier(), h.data.data(), n, Dv, lw.pre_feedforward_layernorm.data(), eps,
               x.data());
  std::vector<float> gate(static_cast<size_t>(n * I)), up(static_cast<size_t>(n * I));
  clippable_linear(pool, lw.gate_proj, x.data(), n, gate.data());
  clippable_linear(pool, lw.up_proj, x.data(), n, up.data());
  gelu_tanh_mul(pool.tier(), gate.data(), up.data(), n * I, gate.data());
  clippable_linear(pool, lw.down_proj, gate.data(), n, branch.data());
  rmsnorm_rows(pool.tier(), branch.data(), n, Dv, lw.post_feedforward_layernorm.data(), eps,
               branch.data());
  for (size_t i = 0; i < branch.size(); ++i) h.data[i] += branch[i];
}

FloatTensor VisionTower::encode(ThreadPool& pool, const float* pixel_values,
                                const int64_t* position_ids, int64_t max_patches,
                                TapRecorder* taps) const {
  const PatchGrid grid = check_patch_positions(position_ids, max_patches, cfg_);
  const int64_t pin = patch_dim(), Dv = cfg_.hidden_size, D = text_hidden_;
  const int64_t P = cfg_.position_embedding_size;
  const int64_t n = static_cast<int64_t>(grid.rows.size());
  if (taps) {
    // One row per image, as the processor's batched outputs: [N_img, max_patches, ...].
    taps->append("pixel_values", {max_patches, pin}, pixel_values, 1);
    taps->append_ids("image_position_ids",
                     std::vector<int64_t>(position_ids, position_ids + 2 * max_patches),
                     {max_patches, 2});
  }

  // ---- patch embedder: input_proj(2·(pix − 0.5)) + (pos_x + pos_y); padded rows: no pos ----
  std::vector<float> scaled(static_cast<size_t>(max_patches * pin));
  for (size_t i = 0; i < scaled.size(); ++i) scaled[i] = 2.0f * (pixel_values[i] - 0.5f);
  FloatTensor embeds({max_patches, Dv});
  matmul_tiled(pool, scaled.data(), max_patches, w_.input_proj, embeds.data.data());
  std::vector<float> px(static_cast<size_t>(Dv)), py(static_cast<size_t>(Dv));
  std::vector<int64_t> xy(static_cast<size_t>(2 * n));
  FloatTensor h({n, Dv});
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = grid.rows[static_cast<size_t>(i)];
    const int64_t x = position_ids[2 * r], y = position_ids[2 * r + 1];
    xy[static_cast<size_t>(2 * i)] = x;
    xy[static_cast<size_t>(2 * i + 1)] = y;
    weight_row_to_f32(w_.position_table, x, px.data());
    weight_row_to_f32(w_.position_table, P + y, py.data());
    float* e = embeds.row(r);
    for (int64_t d = 0; d < Dv; ++d)
      e[d] += px[static_cast<size_t>(d)] + py[static_cast<size_t>(d)];
    std::memcpy(h.row(i), e, static_cast<size_t>(Dv) * sizeof(float));
  }
  if (taps) taps->append("vision_patch_embeds", {Dv}, embeds.data.data(), max_patches);

  // ---- encoder on the real patches ----
  for (int li = 0; li < cfg_.num_hidden_layers; ++li) layer_forward(pool, li, h, xy);
  if (taps && taps->wants("vision_encoder_out")) {
    FloatTensor full({max_patches, Dv});
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(full.row(grid.rows[static_cast<size_t>(i)]), h.row(i),
                  static_cast<size_t>(Dv) * sizeof(float));
    taps->append("vision_encoder_out", {Dv}, full.data.data(), max_patches);
  }

  // ---- pooler: k×k average by position, × sqrt(hidden), standardize ----
  FloatTensor pooled =
      pool_by_position(h.data.data(), xy.data(), n, Dv, grid.kernel, grid.width, grid.height);
  const float root = static_cast<float>(std::sqrt(static_cast<double>(Dv)));
  for (float& val : pooled.data) val *= root;
  const int64_t S = pooled.dim(0);
  if (cfg_.standardize) {
    for (int64_t s = 0; s < S; ++s) {
      float* row = pooled.row(s);
      for (int64_t d = 0; d < Dv; ++d)
        row[d] =
            (row[d] - w_.std_bias[static_cast<size_t>(d)]) * w_.std_scale[static_cast<size_t>(d)];
    }
  }
  if (taps) taps->append("vision_pooled", {Dv}, pooled.data.data(), S);

  // ---- embed_vision: weightless RMSNorm (vision eps), then Linear to the text width ----
  std::vector<float> normed(static_cast<size_t>(S * Dv));
  rmsnorm_rows(pool.tier(), pooled.data.data(), S, Dv, nullptr,
               static_cast<float>(cfg_.rms_norm_eps), normed.data());
  FloatTensor soft({S, D});
  matmul(pool, normed.data(), S, w_.embedding_projection, soft.data.data());
  if (taps) taps->append("vision_embedder_out", {D}, soft.data.data(), S);
  return soft;
}

FloatTensor VisionTower::encode_all(ThreadPool& pool, const std::vector<VisionInput>& images,
                                    TapRecorder* taps) const {
  FloatTensor all({0, text_hidden_});
  for (size_t i = 0; i < images.size(); ++i) {
    const VisionInput& in = images[i];
    if (static_cast<int64_t>(in.pixel_values.size()) != in.max_patches * patch_dim() ||
        static_cast<int64_t>(in.position_ids.size()) != in.max_patches * 2)
      fail("image ", i + 1, ": pixel_values must hold max_patches × ", patch_dim(),
           " floats and image_position_ids max_patches × 2 ids (max_patches = ", in.max_patches,
           ")");
    FloatTensor s;
    try {
      s = encode(pool, in.pixel_values.data(), in.position_ids.data(), in.max_patches, taps);
    } catch (const Error& e) {
      fail("image ", i + 1, ": ", e.what());
    }
    all.data.insert(all.data.end(), s.data.begin(), s.data.end());
    all.shape[0] += s.dim(0);
  }
  return all;
}

}  // namespace gemstage
