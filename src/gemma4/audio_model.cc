#include "gemma4/audio_model.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"
#include "gemma4/registry.h"
#include "gemma4/tensor_table.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"

namespace gemstage {

namespace {

// The FFN blocks and the layer norms use Gemma4RMSNorm's default eps; the light-conv norms the
// config's rms_norm_eps (gemma4-audio.md "Norms and linears").
constexpr float kDefaultEps = 1e-6f;
constexpr int64_t kAudioMaxFrames = 3000;

void clamp_inplace(std::vector<float>& v, float lim) {
  for (float& x : v) x = std::min(std::max(x, -lim), lim);
}

float silu(float x) {
  return x / (1.0f + std::exp(-x));
}

// torch.nn.functional.softplus with its default threshold of 20.
float softplus(float x) {
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

// Conv2d 3×3, stride 2, padding 1, no bias, over channel-last input [T, W, Cin] whose rows t with
// mask[t] == 0 read as zero; then LayerNorm over the Cout channels (biased variance, weight only)
// and ReLU. Returns [ceil(T/2), ceil(W/2), Cout]. weight: [Cout, Cin, 3, 3] (cross-correlation).
FloatTensor subsample_layer(ThreadPool& pool, const FloatTensor& x,
                            const std::vector<uint8_t>& mask, const std::vector<float>& weight,
                            const std::vector<float>& norm, int64_t cout, float eps) {
  const int64_t T = x.dim(0), W = x.dim(1), cin = x.dim(2);
  const int64_t To = (T + 1) / 2, Wo = (W + 1) / 2;
  // [kt][kf][ci][co] so the innermost loop runs over output channels.
  std::vector<float> wt(static_cast<size_t>(9 * cin * cout));
  for (int64_t co = 0; co < cout; ++co)
    for (int64_t ci = 0; ci < cin; ++ci)
      for (int64_t k = 0; k < 9; ++k)
        wt[static_cast<size_t>((k * cin + ci) * cout + co)] =
            weight[static_cast<size_t>((co * cin + ci) * 9 + k)];
  FloatTensor y({To, Wo, cout});
  pool.parallel_for(static_cast<size_t>(To), [&](size_t b, size_t e) {
    std::vector<double> acc(static_cast<size_t>(cout));
    for (int64_t t = static_cast<int64_t>(b); t < static_cast<int64_t>(e); ++t)
      for (int64_t f = 0; f < Wo; ++f) {
        float* out = y.data.data() + (t * Wo + f) * cout;
        std::fill(out, out + cout, 0.0f);
        for (int64_t kt = 0; kt < 3; ++kt) {
          const int64_t ti = 2 * t + kt - 1;
          if (ti < 0 || ti >= T || !mask[static_cast<size_t>(ti)]) continue;
          for (int64_t kf = 0; kf < 3; ++kf) {
            const int64_t fi = 2 * f + kf - 1;
            if (fi < 0 || fi >= W) continue;
            const float* in = x.data.data() + (ti * W + fi) * cin;
            const float* wk = wt.data() + (kt * 3 + kf) * cin * cout;
            for (int64_t ci = 0; ci < cin; ++ci) {
              const float v = in[ci];
              const float* wr = wk + ci * cout;
              for (int64_t co = 0; co < cout; ++co) out[co] += v * wr[co];
            }
          }
        }
        float mean = 0.0f;
        for (int64_t co = 0; co < cout; ++co) mean += out[co];
        mean /= static_cast<float>(cout);
        float var = 0.0f;
        for (int64_t co = 0; co < cout; ++co) var += (out[co] - mean) * (out[co] - mean);
        var /= static_cast<float>(cout);
        const float inv = 1.0f / std::sqrt(var + eps);
        for (int64_t co = 0; co < cout; ++co)
          out[co] = std::max(0.0f, (out[co] - mean) * inv * norm[static_cast<size_t>(co)]);
      }
  });
  return y;
}

std::vector<uint8_t> every_second(const std::vector<uint8_t>& m) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i < m.size(); i += 2) out.push_back(m[i]);
  return out;
}

}  // namespace

AudioWeights bind_audio_weights(const ModelConfig& c, const TensorSource& store) {
  if (!c.audio) fail(c.source, ": the config has no audio_config");
  AudioWeights w;
  for (const TensorSpec& s : audio_tensor_specs(c, &w))
    if (s.role == TensorRole::Required) bind_tensor(s, store);
  return w;
}

AudioTower::AudioTower(const ModelConfig& config, AudioWeights weights)
    : cfg_(*config.audio), text_hidden_(config.text.hidden_size), w_(std::move(weights)) {
  // rel_pos_enc: positions left−1 … 0, each [sin(p·inv_ts), cos(p·inv_ts)], in float32.
  const int64_t H = cfg_.hidden_size, half = H / 2, rows = cfg_.attention_context_left;
  const float denom = static_cast<float>(std::max<int64_t>(half - 1, 1));
  std::vector<float> inv_ts(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_ts[static_cast<size_t>(i)] =
        std::exp(static_cast<float>(i) * -(std::log(10000.0f) / denom));
  rel_pos_.assign(static_cast<size_t>(rows * H), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float p = static_cast<float>(rows - 1 - r);
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * inv_ts[static_cast<size_t>(i)];
      rel_pos_[static_cast<size_t>(r * H + i)] = std::sin(a);
      rel_pos_[static_cast<size_t>(r * H + half + i)] = std::cos(a);
    }
  }
}

int64_t AudioTower::num_soft_tokens(const std::vector<uint8_t>& mask) const {
  bool ended = false;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i] > 1) fail("audio_features_mask[", i, "] is ", int(mask[i]), "; must be 0 or 1");
    if (mask[i] && ended)
      fail("audio_features_mask: valid frame ", i,
           " follows an invalid one; the feature extractor marks a prefix of frames valid");
    ended = ended || !mask[i];
  }
  int64_t n = 0;
  for (uint8_t v : every_second(every_second(mask))) n += v;
  return n;
}

void AudioTower::ffn(ThreadPool& pool, const AudioFfnWeights& w, FloatTensor& x) const {
  const int64_t T = x.dim(0), H = x.dim(1), I = w.ffw_layer_1.weight.rows();
  const float gc = static_cast<float>(std::min(cfg_.gradient_clipping, 3.4e38));
  std::vector<float> h = x.data;
  clamp_inplace(h, gc);
  rmsnorm_rows(pool.tier(), h.data(), T, H, w.pre_layer_norm.data(), kDefaultEps, h.data());
  std::vector<float> mid(static_cast<size_t>(T * I));
  clippable_linear(pool, w.ffw_layer_1, h.data(), T, mid.data());
  for (float& v : mid) v = silu(v);
  clippable_linear(pool, w.ffw_layer_2, mid.data(), T, h.data());
  clamp_inplace(h, gc);
  rmsnorm_rows(pool.tier(), h.data(), T, H, w.post_layer_norm.data(), kDefaultEps, h.data());
  const float rw = static_cast<float>(cfg_.residual_weight);
  for (size_t i = 0; i < h.size(); ++i) x.data[i] += h[i] * rw;
}

void AudioTower::attention(ThreadPool& pool, const AudioLayerWeights& w, const FloatTensor& x,
                           const std::vector<uint8_t>& valid, FloatTensor& out) const {
  const int64_t T = x.dim(0), H = cfg_.hidden_size, nh = cfg_.num_attention_heads, hd = H / nh;
  const int64_t window = cfg_.attention_context_left - 1;  // self + window−1 past keys
  const int64_t n_rel = cfg_.attention_context_left;       // distances 0 … left−1
  std::vector<float> q(static_cast<size_t>(T * H)), k(q.size()), v(q.size());
  clippable_linear(pool, w.q_proj, x.data.data(), T, q.data());
  clippable_linear(pool, w.k_proj, x.data.data(), T, k.data());
  clippable_linear(pool, w.v_proj, x.data.data(), T, v.data());
  const float r_softplus_0 = static_cast<float>(1.0 / std::log(2.0));
  const float q_base = static_cast<float>(std::pow(static_cast<double>(hd), -0.5)) * r_softplus_0;
  std::vector<float> qscale(static_cast<size_t>(hd));
  for (int64_t d = 0; d < hd; ++d)
    qscale[static_cast<size_t>(d)] = q_base * softplus(w.per_dim_scale[static_cast<size_t>(d)]);
  const float kscale = static_cast<float>(std::log1p(std::numbers::e) / std::log(2.0));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t d = 0; d < hd; ++d) {
        q[static_cast<size_t>(t * H + h * hd + d)] *= qscale[static_cast<size_t>(d)];
        k[static_cast<size_t>(t * H + h * hd + d)] *= kscale;
      }
  // rel[r] = relative_k_proj(pe[r]) for position n_rel−1−r; distance d reads rel[n_rel−1−d].
  std::vector<float> rel(static_cast<size_t>(n_rel * H));
  matmul(pool, rel_pos_.data(), n_rel, w.relative_k_proj, rel.data());
  const float cap = static_cast<float>(cfg_.attention_logit_cap);
  const float invalid = static_cast<float>(cfg_.attention_invalid_logits_value);
  std::vector<float> ctx(static_cast<size_t>(T * H), 0.0f);
  pool.parallel_for(static_cast<size_t>(T * nh), [&](size_t b, size_t e) {
    std::vector<float> logits(static_cast<size_t>(window));
    for (size_t job = b; job < e; ++job) {
      const int64_t t = static_cast<int64_t>(job) / nh, h = static_cast<int64_t>(job) % nh;
      const float* qt = q.data() + t * H + h * hd;
      int64_t n = 0;  // keys s = t, t−1, …, in distance order
      bool any = false;
      for (int64_t dist = 0; dist < window; ++dist, ++n) {
        const int64_t s = t - dist;
        if (s < 0 || !valid[static_cast<size_t>(s)]) {
          logits[static_cast<size_t>(n)] = invalid;
          continue;
        }
        const float* ks = k.data() + s * H + h * hd;
        const float* rs = rel.data() + (n_rel - 1 - dist) * H + h * hd;
        float content = 0.0f, position = 0.0f;
        for (int64_t d = 0; d < hd; ++d) {
          content += qt[d] * ks[d];
          position += qt[d] * rs[d];
        }
        logits[static_cast<size_t>(n)] = std::tanh((content + position) / cap) * cap;
        any = true;
      }
      if (!any) continue;  // an invalid query row with no valid key: never read by valid rows
      softmax_inplace(pool.tier(), logits.data(), n);
      float* o = ctx.data() + t * H + h * hd;
      for (int64_t dist = 0; dist < n; ++dist) {
        const int64_t s = t - dist;
        if (s < 0) continue;
        const float p = logits[static_cast<size_t>(dist)];
        const float* vs = v.data() + s * H + h * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] += p * vs[d];
      }
    }
  });
  out = FloatTensor({T, H});
  clippable_linear(pool, w.post, ctx.data(), T, out.data.data());
}

void AudioTower::light_conv(ThreadPool& pool, const AudioLayerWeights& w, FloatTensor& x) const {
  const int64_t T = x.dim(0), H = x.dim(1), K = cfg_.conv_kernel_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const float gc = static_cast<float>(std::min(cfg_.gradient_clipping, 3.4e38));
  std::vector<float> h(x.data.size());
  rmsnorm_rows(pool.tier(), x.data.data(), T, H, w.lconv_pre_norm.data(), eps, h.data());
  std::vector<float> wide(static_cast<size_t>(T * 2 * H));
  clippable_linear(pool, w.linear_start, h.data(), T, wide.data());
  for (int64_t t = 0; t < T; ++t)  // GLU: first half × sigmoid(second half)
    for (int64_t c = 0; c < H; ++c) {
      const float a = wide[static_cast<size_t>(t * 2 * H + c)];
      const float g = wide[static_cast<size_t>(t * 2 * H + H + c)];
      h[static_cast<size_t>(t * H + c)] = a * (1.0f / (1.0f + std::exp(-g)));
    }
  // Causal depthwise conv: K−1 zeros on the left only.
  std::vector<float> y(h.size(), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t src = t + j - (K - 1);
      if (src < 0) continue;
      for (int64_t c = 0; c < H; ++c)
        y[static_cast<size_t>(t * H + c)] +=
            w.depthwise_conv[static_cast<size_t>(c * K + j)] * h[static_cast<size_t>(src * H + c)];
    }
  clamp_inplace(y, gc);
  rmsnorm_rows(pool.tier(), y.data(), T, H, w.conv_norm.data(), eps, y.data());
  for (float& v : y) v = silu(v);
  clippable_linear(pool, w.linear_end, y.data(), T, h.data());
  for (size_t i = 0; i < h.size(); ++i) x.data[i] += h[i];
}

void AudioTower::layer_forward(ThreadPool& pool, int li, FloatTensor& x,
                               const std::vector<uint8_t>& valid) const {
  const AudioLayerWeights& w = w_.layers[static_cast<size_t>(li)];
  const int64_t T = x.dim(0), H = x.dim(1);
  const float gc = static_cast<float>(std::min(cfg_.gradient_clipping, 3.4e38));
  ffn(pool, w.feed_forward1, x);
  FloatTensor normed = x;
  clamp_inplace(normed.data, gc);
  rmsnorm_rows(pool.tier(), normed.data.data(), T, H, w.norm_pre_attn.data(), kDefaultEps,
               normed.data.data());
  FloatTensor att;
  attention(pool, w, normed, valid, att);
  clamp_inplace(att.data, gc);
  rmsnorm_rows(pool.tier(), att.data.data(), T, H, w.norm_post_attn.data(), kDefaultEps,
               att.data.data());
  for (size_t i = 0; i < x.data.size(); ++i) x.data[i] += att.data[i];
  light_conv(pool, w, x);
  ffn(pool, w.feed_forward2, x);
  clamp_inplace(x.data, gc);
  rmsnorm_rows(pool.tier(), x.data.data(), T, H, w.norm_out.data(), kDefaultEps, x.data.data());
}

FloatTensor AudioTower::encode(ThreadPool& pool, const AudioInput& clip, TapRecorder* taps) const {
  const int64_t F = clip.frames, H = cfg_.hidden_size, P = cfg_.output_proj_dims;
  if (F <= 0) fail("audio: a clip with no feature frames");
  // 30 s at 16 kHz is 3000 frames (the processor's max_length); more is not one clip.
  if (F > kAudioMaxFrames)
    fail("audio: a clip of ", F, " feature frames; at most ", kAudioMaxFrames,
         " (30 s) are accepted");
  if (static_cast<int64_t>(clip.features.size()) != F * 128 ||
      static_cast<int64_t>(clip.mask.size()) != F)
    fail("audio: features hold ", clip.features.size(), " values and the mask ", clip.mask.size(),
         " entries for ", F, " frames of 128 mel bins");
  const int64_t n_soft = num_soft_tokens(clip.mask);
  if (n_soft == 0) fail("audio: the clip has no valid frame after subsampling (too short)");
  if (taps) {
    taps->append("audio_features", {128}, clip.features.data(), F);
    taps->append_ids("audio_features_mask",
                     std::vector<int64_t>(clip.mask.begin(), clip.mask.end()));
  }
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const int64_t c0 = cfg_.subsampling_channels[0], c1 = cfg_.subsampling_channels[1];
  FloatTensor x({F, 128, 1});
  std::copy(clip.features.begin(), clip.features.end(), x.data.begin());
  FloatTensor l0 = subsample_layer(pool, x, clip.mask, w_.conv0, w_.norm0, c0, eps);
  const std::vector<uint8_t> mask1 = every_second(clip.mask);
  FloatTensor l1 = subsample_layer(pool, l0, mask1, w_.conv1, w_.norm1, c1, eps);
  const std::vector<uint8_t> valid = every_second(mask1);
  const int64_t T = l1.dim(0);
  FloatTensor h({T, H});
  matmul(pool, l1.data.data(), T, w_.input_proj, h.data.data());  // [T, 32·C1] flattened (f, c)
  if (taps) {
    taps->append("audio_subsample_out", {H}, h.data.data(), T);
    taps->append_ids("audio_subsample_mask", std::vector<int64_t>(valid.begin(), valid.end()));
  }
  const int L = cfg_.num_hidden_layers;
  for (int li = 0; li < L; ++li) {
    layer_forward(pool, li, h, valid);
    if (taps) taps->append_layer("audio_layer_out", li, L, {H}, h.data.data(), T);
  }
  if (taps) taps->append("audio_encoder_out", {H}, h.data.data(), T);
  FloatTensor out({T, P});
  matmul(pool, h.data.data(), T, w_.output_proj, out.data.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t p = 0; p < P; ++p)
      out.data[static_cast<size_t>(t * P + p)] += w_.output_proj_bias[static_cast<size_t>(p)];
  if (taps) taps->append("audio_tower_out", {P}, out.data.data(), T);
  // The embedder sees only the valid rows (a prefix): the ones spliced into the prompt.
  FloatTensor normed({n_soft, P});
  rmsnorm_rows(pool.tier(), out.data.data(), n_soft, P, nullptr, eps, normed.data.data());
  FloatTensor soft({n_soft, text_hidden_});
  matmul(pool, normed.data.data(), n_soft, w_.embedding_projection, soft.data.data());
  if (taps) taps->append("audio_embedder_out", {text_hidden_}, soft.data.data(), n_soft);
  return soft;
}

FloatTensor AudioTower::encode_all(ThreadPool& pool, const std::vector<AudioInput>& clips,
                                   TapRecorder* taps) const {
  FloatTensor all({0, text_hidden_});
  for (const AudioInput& c : clips) {
    const FloatTensor s = encode(pool, c, taps);
    all.data.insert(all.data.end(), s.data.begin(), s.data.end());
    all.shape[0] += s.dim(0);
  }
  return all;
}

}  // namespace gemstage
