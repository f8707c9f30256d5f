#include "gemma4/unified_embedder.h"

#include <cmath>

#include "core/error.h"
#include "gemma4/tensor_table.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "kernels/weight_rows.h"

namespace gemstage {

namespace {

// nn.LayerNorm over each row: mean subtracted, biased variance, eps, weight and bias. Sums in
// double so the rows of 6912 values stay at the reference's float32 noise floor.
void layer_norm_rows(const float* x, int64_t rows, int64_t n, const std::vector<float>& w,
                     const std::vector<float>& b, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    double mean = 0;
    for (int64_t i = 0; i < n; ++i) mean += xr[i];
    mean /= static_cast<double>(n);
    double var = 0;
    for (int64_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= static_cast<double>(n);
    const double inv = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < n; ++i)
      yr[i] = static_cast<float>((xr[i] - mean) * inv) * w[static_cast<size_t>(i)] +
              b[static_cast<size_t>(i)];
  }
}

constexpr double kLayerNormEps = 1e-5;  // nn.LayerNorm's default, the released embedder's

}  // namespace

std::string unified_canonical_key(const std::string& k) {
  static const std::string renamed_proj = "model.embed_vision.multimodal_embedder.";
  if (k.rfind(renamed_proj, 0) == 0) return "model.embed_vision." + k.substr(renamed_proj.size());
  static const std::string renamed = "model.embed_vision.";
  for (const char* part :
       {"patch_ln1.", "patch_dense.", "patch_ln2.", "pos_embedding", "pos_norm."}) {
    const std::string from = renamed + part;
    if (k.rfind(from, 0) == 0) return "model.vision_embedder." + k.substr(renamed.size());
  }
  return k;
}

void canonicalize_checkpoint_keys(const ModelConfig& c, TensorStore& store) {
  if (c.unified) store.rename_keys(unified_canonical_key);
}

UnifiedAudioInput unified_audio_frames(std::span<const float> waveform, int frame_samples) {
  if (frame_samples <= 0) fail("audio frames: the frame size must be positive");
  if (waveform.empty()) fail("audio frames: the clip has no samples");
  const int64_t F = frame_samples, n = static_cast<int64_t>(waveform.size());
  UnifiedAudioInput a;
  a.frames = (n + F - 1) / F;  // the partial last frame is kept, zero-padded
  a.samples.assign(static_cast<size_t>(a.frames * F), 0.0f);
  std::copy(waveform.begin(), waveform.end(), a.samples.begin());
  a.mask.assign(static_cast<size_t>(a.frames), 1);
  return a;
}

UnifiedEmbedder::UnifiedEmbedder(const ModelConfig& config, const TensorSource& store)
    : text_hidden_(config.text.hidden_size) {
  if (!config.unified) fail(config.source, ": not a gemma4_unified config");
  if (config.unified_vision) vision_cfg_ = &*config.unified_vision;
  if (config.unified_audio) audio_cfg_ = &*config.unified_audio;
  for (const TensorSpec& s : unified_tensor_specs(config, &vw_, &aw_)) bind_tensor(s, store);
}

const UnifiedVisionConfig& UnifiedEmbedder::vision_config() const {
  if (!vision_cfg_) fail("the model has no vision_config: it takes no images");
  return *vision_cfg_;
}

const UnifiedAudioConfig& UnifiedEmbedder::audio_config() const {
  if (!audio_cfg_) fail("the model has no audio_config: it takes no audio");
  return *audio_cfg_;
}

int64_t UnifiedEmbedder::num_image_soft_tokens(const UnifiedImageInput& im) const {
  const UnifiedVisionConfig& v = vision_config();
  const int64_t pd = v.patch_dim();
  if (im.max_patches <= 0 || static_cast<int64_t>(im.pixel_values.size()) != im.max_patches * pd ||
      static_cast<int64_t>(im.position_ids.size()) != im.max_patches * 2)
    fail("image: pixel_values must be [", im.max_patches, ", ", pd, "] and image_position_ids [",
         im.max_patches, ", 2]; got ", im.pixel_values.size(), " and ", im.position_ids.size(),
         " values");
  int64_t n = 0;
  for (int64_t r = 0; r < im.max_patches; ++r) {
    const int64_t x = im.position_ids[static_cast<size_t>(2 * r)],
                  y = im.position_ids[static_cast<size_t>(2 * r + 1)];
    if (x == -1 && y == -1) continue;  // padding row, dropped
    if (x < 0 || y < 0 || x >= v.mm_posemb_size || y >= v.mm_posemb_size)
      fail("image_position_ids row ", r, " is (", x, ", ", y,
           "): positions must be in [0, mm_posemb_size = ", v.mm_posemb_size,
           ") or (-1, -1) for padding");
    ++n;
  }
  return n;
}

FloatTensor UnifiedEmbedder::encode_images(ThreadPool& pool,
                                           const std::vector<UnifiedImageInput>& images,
                                           TapRecorder* taps) const {
  const UnifiedVisionConfig& v = vision_config();
  const int64_t pd = v.patch_dim(), E = v.mm_embed_dim, D = text_hidden_;
  int64_t total = 0;
  for (const UnifiedImageInput& im : images) total += num_image_soft_tokens(im);
  FloatTensor out({total, D});
  int64_t done = 0;
  for (const UnifiedImageInput& im : images) {
    if (taps) {
      taps->append("pixel_values", {im.max_patches, pd}, im.pixel_values.data(), 1);
      taps->append_ids("image_position_ids", im.position_ids, {im.max_patches, 2});
    }
    // The real rows only: padding rows never reach the output.
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < im.max_patches; ++r)
      if (im.position_ids[static_cast<size_t>(2 * r)] >= 0) rows.push_back(r);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    FloatTensor x({n, pd});
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(im.pixel_values.data() + rows[static_cast<size_t>(i)] * pd, pd, x.row(i));
    layer_norm_rows(x.data.data(), n, pd, vw_.patch_ln1_weight, vw_.patch_ln1_bias, kLayerNormEps,
                    x.data.data());
    FloatTensor h({n, E});
    matmul(pool, x.data.data(), n, vw_.patch_dense, h.data.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < E; ++j) h.row(i)[j] += vw_.patch_dense_bias[static_cast<size_t>(j)];
    if (taps) taps->append("image_patch_dense", {E}, h.data.data(), n);
    layer_norm_rows(h.data.data(), n, E, vw_.patch_ln2_weight, vw_.patch_ln2_bias, kLayerNormEps,
                    h.data.data());
    if (taps) taps->append("image_patch_ln2", {E}, h.data.data(), n);
    // Factorised positions: the x table is pos_embedding[:, 0], the y table pos_embedding[:, 1].
    FloatTensor pos({n, E});
    std::vector<float> ty(static_cast<size_t>(E));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows[static_cast<size_t>(i)];
      const int64_t px = im.position_ids[static_cast<size_t>(2 * r)],
                    py = im.position_ids[static_cast<size_t>(2 * r + 1)];
      // The [P, 2, E] table read as rows of E: row 2p is x = p, row 2p + 1 is y = p.
      weight_row_to_f32(vw_.pos_embedding, 2 * px, pos.row(i));
      weight_row_to_f32(vw_.pos_embedding, 2 * py + 1, ty.data());
      for (int64_t j = 0; j < E; ++j) pos.row(i)[j] += ty[static_cast<size_t>(j)];
    }
    if (taps) taps->append("image_pos_embeds", {E}, pos.data.data(), n);
    for (size_t k = 0; k < h.data.size(); ++k) h.data[k] += pos.data[k];
    layer_norm_rows(h.data.data(), n, E, vw_.pos_norm_weight, vw_.pos_norm_bias, kLayerNormEps,
                    h.data.data());
    if (taps) taps->append("image_pos_norm", {E}, h.data.data(), n);
    rmsnorm_rows(pool.tier(), h.data.data(), n, E, nullptr, static_cast<float>(v.rms_norm_eps),
                 h.data.data());
    matmul(pool, h.data.data(), n, vw_.embedding_projection, out.row(done));
    if (taps) taps->append("image_embedder_out", {D}, out.row(done), n);
    done += n;
  }
  return out;
}

int64_t UnifiedEmbedder::num_audio_soft_tokens(const UnifiedAudioInput& clip) const {
  const UnifiedAudioConfig& a = audio_config();
  if (clip.frames <= 0 ||
      static_cast<int64_t>(clip.samples.size()) != clip.frames * a.frame_samples ||
      static_cast<int64_t>(clip.mask.size()) != clip.frames)
    fail("audio: frames must be [", clip.frames, ", ", a.frame_samples, "] with a mask of ",
         clip.frames, "; got ", clip.samples.size(), " samples and ", clip.mask.size(),
         " mask values");
  int64_t n = 0;
  for (int64_t t = 0; t < clip.frames; ++t) {
    const uint8_t m = clip.mask[static_cast<size_t>(t)];
    if (m > 1) fail("audio frames mask[", t, "] is ", int{m}, "; must be 0 or 1");
    if (m && n != t) fail("audio frames mask: real frames must come first (frame ", t, ")");
    n += m;
  }
  return n;
}

FloatTensor UnifiedEmbedder::encode_audio(ThreadPool& pool,
                                          const std::vector<UnifiedAudioInput>& clips,
                                          TapRecorder* taps) const {
  const UnifiedAudioConfig& a = audio_config();
  const int64_t F = a.frame_samples, D = text_hidden_;
  int64_t total = 0;
  for (const UnifiedAudioInput& c : clips) total += num_audio_soft_tokens(c);
  FloatTensor out({total, D});
  int64_t done = 0;
  for (const UnifiedAudioInput& c : clips) {
    const int64_t n = num_audio_soft_tokens(c);
    if (taps) taps->append("audio_frames", {F}, c.samples.data(), c.frames);
    if (n == 0) continue;
    std::vector<float> x(c.samples.begin(), c.samples.begin() + n * F);
    rmsnorm_rows(pool.tier(), x.data(), n, F, nullptr, static_cast<float>(a.rms_norm_eps),
                 x.data());
    matmul(pool, x.data(), n, aw_.embedding_projection, out.row(done));
    if (taps) taps->append("audio_embedder_out", {D}, out.row(done), n);
    done += n;
  }
  return out;
}

}  // namespace gemstage
