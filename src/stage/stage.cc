#include "stage/stage.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "gemma4/registry.h"

namespace gemstage {

namespace {

// Removes and returns an input the contract check has already validated.
HostTensor take(TensorMap& in, const std::string& name) {
  auto it = in.find(name);
  HostTensor t = std::move(it->second);
  in.erase(it);
  return t;
}

}  // namespace

Stage::Stage(const ModelConfig& config, StageDecl decl, std::shared_ptr<TensorSource> weights)
    : config_(config), decl_(std::move(decl)), weights_(std::move(weights)) {
  text_ = std::make_unique<TextModel>(config_,
                                      bind_text_weights(config_, *weights_, stage_parts(decl_)));
  if (decl_.role == StageRole::Embeddings && config_.vision)
    vision_ = std::make_unique<VisionTower>(config_, bind_vision_weights(config_, *weights_));
  if (decl_.role == StageRole::Embeddings && config_.audio)
    audio_ = std::make_unique<AudioTower>(config_, bind_audio_weights(config_, *weights_));
  if (decl_.role == StageRole::Embeddings && config_.unified)
    unified_ = std::make_unique<UnifiedEmbedder>(config_, *weights_);
}

Stage::~Stage() = default;

std::unique_ptr<KvCache> Stage::new_cache(int64_t max_context, KvType kv_type) const {
  if (decl_.role != StageRole::TransformerLayers) return nullptr;
  return std::make_unique<KvCache>(
      make_kv_cache(config_.text, max_context, decl_.layers.begin, decl_.layers.end, kv_type));
}

TensorMap Stage::run(ThreadPool& pool, TensorMap inputs, std::span<KvCache* const> caches,
                     const TextRunOptions& opt, TapRecorder* taps) const {
  DimBindings dims;
  check_call_tensors(decl_, "input", decl_.contract.inputs, inputs, dims);
  TensorMap out;
  switch (decl_.role) {
    case StageRole::Embeddings:
      out = run_embeddings(pool, inputs, opt, taps);
      break;
    case StageRole::TransformerLayers:
      out = run_layers(pool, inputs, caches, taps);
      break;
    case StageRole::FinalNormHead:
      out = run_head(pool, inputs, taps);
      break;
    case StageRole::Drafter:
      fail("stage '", decl_.id, "': a drafter runs through DrafterStage, not as a pipeline stage");
  }
  check_call_tensors(decl_, "output", decl_.contract.outputs, out, dims);
  return out;
}

FloatTensor Stage::encode_images(ThreadPool& pool, const std::vector<VisionInput>& images,
                                 TapRecorder* taps) const {
  if (!vision_) fail("stage '", decl_.id, "' has no vision tower (the model has no vision_config)");
  return vision_->encode_all(pool, images, taps);
}

FloatTensor Stage::encode_audio(ThreadPool& pool, const std::vector<AudioInput>& clips,
                                TapRecorder* taps) const {
  if (!audio_) fail("stage '", decl_.id, "' has no audio tower (the model has no audio_config)");
  return audio_->encode_all(pool, clips, taps);
}

TensorMap Stage::run_embeddings(ThreadPool& pool, TensorMap& in, const TextRunOptions& opt,
                                TapRecorder* taps) const {
  const std::string where = "stage '" + decl_.id + "' (embeddings)";
  const HostTensor ids = take(in, "input_ids");
  FloatTensor soft;
  const bool pixels = in.count("pixel_values") != 0, positions = in.count("image_position_ids");
  if (pixels != positions)
    fail(where, ": pixel_values and image_position_ids come together; got only ",
         pixels ? "pixel_values" : "image_position_ids");
  if (pixels && in.count("image_soft_tokens"))
    fail(where,
         ": give either pixel_values (the tower runs here) or image_soft_tokens (already "
         "encoded), not both");
  if (pixels && unified_) {
    // gemma4_unified: the image embedder runs here (no tower).
    const HostTensor pix = take(in, "pixel_values");
    const HostTensor pos = take(in, "image_position_ids");
    const int64_t n_img = pix.shape()[0], np = pix.shape()[1], pd = pix.shape()[2];
    std::vector<UnifiedImageInput> images(static_cast<size_t>(n_img));
    const auto pv = pix.values<float>();
    const auto pp = pos.values<int64_t>();
    for (int64_t b = 0; b < n_img; ++b) {
      UnifiedImageInput& im = images[static_cast<size_t>(b)];
      im.max_patches = np;
      im.pixel_values.assign(pv.begin() + b * np * pd, pv.begin() + (b + 1) * np * pd);
      im.position_ids.assign(pp.begin() + b * np * 2, pp.begin() + (b + 1) * np * 2);
      try {
        unified_->num_image_soft_tokens(im);  // validates the positions
      } catch (const Error& e) {
        fail(where, ": image ", b, ": ", e.what());
      }
    }
    soft = unified_->encode_images(pool, images, taps);
  } else if (pixels) {
    const HostTensor pix = take(in, "pixel_values");
    const HostTensor pos = take(in, "image_position_ids");
    const int64_t n_img = pix.shape()[0], np = pix.shape()[1], pd = pix.shape()[2];
    std::vector<VisionInput> images(static_cast<size_t>(n_img));
    const auto pv = pix.values<float>();
    const auto pp = pos.values<int64_t>();
    for (int64_t b = 0; b < n_img; ++b) {
      VisionInput& im = images[static_cast<size_t>(b)];
      im.max_patches = np;
      im.pixel_values.assign(pv.begin() + b * np * pd, pv.begin() + (b + 1) * np * pd);
      im.position_ids.assign(pp.begin() + b * np * 2, pp.begin() + (b + 1) * np * 2);
      try {
        vision_->num_soft_tokens(im.position_ids.data(), np);  // validates the grid
      } catch (const Error& e) {
        fail(where, ": image_position_ids of image ", b, ": ", e.what());
      }
    }
    soft = encode_images(pool, images, taps);
  } else if (in.count("image_soft_tokens")) {
    soft = take(in, "image_soft_tokens").take_float();
  }
  const auto id_values = ids.values<int32_t>();
  FloatTensor audio_soft;
  if (in.count("audio_frames") != in.count("audio_frames_mask"))
    fail(where, ": audio_frames and audio_frames_mask come together; got only ",
         in.count("audio_frames") ? "audio_frames" : "audio_frames_mask");
  if (in.count("audio_frames") && in.count("audio_soft_tokens"))
    fail(where,
         ": give either audio_frames (the embedder runs here) or audio_soft_tokens (already "
         "encoded), not both");
  if (in.count("audio_frames")) {
    // gemma4_unified: raw frames through the audio embedder (no tower).
    const HostTensor f = take(in, "audio_frames");
    const HostTensor m = take(in, "audio_frames_mask");
    const int64_t n_clip = f.shape()[0], frames = f.shape()[1], F = f.shape()[2];
    std::vector<UnifiedAudioInput> clips(static_cast<size_t>(n_clip));
    const auto fv = f.values<float>();
    const auto mv = m.values<uint8_t>();
    for (int64_t b = 0; b < n_clip; ++b) {
      UnifiedAudioInput& a = clips[static_cast<size_t>(b)];
      a.frames = frames;
      a.samples.assign(fv.begin() + b * frames * F, fv.begin() + (b + 1) * frames * F);
      a.mask.assign(mv.begin() + b * frames, mv.begin() + (b + 1) * frames);
      try {
        unified_->num_audio_soft_tokens(a);  // validates the mask
      } catch (const Error& e) {
        fail(where, ": audio clip ", b, ": ", e.what());
      }
    }
    in["audio_soft_tokens"] = HostTensor::from(unified_->encode_audio(pool, clips, taps));
  }
  const bool feats = in.count("audio_features") != 0, fmask = in.count("audio_features_mask") != 0;
  if (feats != fmask)
    fail(where, ": audio_features and audio_features_mask come together; got only ",
         feats ? "audio_features" : "audio_features_mask");
  if (feats && in.count("audio_soft_tokens"))
    fail(where,
         ": give either audio_features (the tower runs here) or audio_soft_tokens (already "
         "encoded), not both");
  if (feats) {
    const HostTensor f = take(in, "audio_features");
    const HostTensor m = take(in, "audio_features_mask");
    const int64_t n_clip = f.shape()[0], frames = f.shape()[1];
    std::vector<AudioInput> clips(static_cast<size_t>(n_clip));
    const auto fv = f.values<float>();
    const auto mv = m.values<uint8_t>();
    for (int64_t b = 0; b < n_clip; ++b) {
      AudioInput& a = clips[static_cast<size_t>(b)];
      a.frames = frames;
      a.features.assign(fv.begin() + b * frames * 128, fv.begin() + (b + 1) * frames * 128);
      a.mask.assign(mv.begin() + b * frames, mv.begin() + (b + 1) * frames);
      try {
        audio_->num_soft_tokens(a.mask);  // validates the mask
      } catch (const Error& e) {
        fail(where, ": audio clip ", b, ": ", e.what());
      }
    }
    audio_soft = encode_audio(pool, clips, taps);
  } else if (in.count("audio_soft_tokens")) {
    audio_soft = take(in, "audio_soft_tokens").take_float();
  }
  // Image/video rows take the vision soft tokens in order, audio rows the audio ones (HF's
  // masked_scatter per modality); the text model splices one list in row order.
  std::vector<uint8_t> audio_row(static_cast<size_t>(ids.numel()), 0);
  for (size_t r = 0; r < audio_row.size(); ++r)
    audio_row[r] = id_values[r] == config_.audio_token_id ? 1 : 0;
  if (!audio_soft.data.empty()) {
    int64_t n_audio_rows = 0;
    for (uint8_t a : audio_row) n_audio_rows += a;
    if (n_audio_rows != audio_soft.dim(0))
      fail(where, ": the call has ", n_audio_rows, " audio placeholder rows (audio_token_id ",
           config_.audio_token_id, ") but the audio yields ", audio_soft.dim(0),
           " soft tokens; each clip needs exactly as many placeholders as it yields soft tokens");
    const int64_t D = config_.text.hidden_size;
    const int64_t n_vis = soft.data.empty() ? 0 : soft.dim(0);
    FloatTensor merged({n_vis + audio_soft.dim(0), D});
    int64_t vi = 0, ai = 0, k = 0;
    const std::vector<int> ph = config_.placeholder_token_ids();
    for (size_t r = 0; r < audio_row.size(); ++r) {
      if (std::find(ph.begin(), ph.end(), id_values[r]) == ph.end()) continue;
      if (audio_row[r]) {
        std::copy_n(audio_soft.row(ai++), D, merged.row(k++));
      } else {
        if (vi >= n_vis)
          fail(where, ": image/video placeholder row ", r,
               " has no vision soft token (the call gives ", n_vis, ")");
        std::copy_n(soft.row(vi++), D, merged.row(k++));
      }
    }
    if (vi != n_vis)
      fail(where, ": ", n_vis, " vision soft tokens but ", vi, " image/video placeholder rows");
    soft = std::move(merged);
  }
  EmbeddingsOutput e;
  try {
    e = text_->embed(pool, id_values, soft.data.empty() ? nullptr : &soft, opt, taps);
  } catch (const Error& err) {
    fail(where, ": ", err.what());
  }
  const int64_t S = ids.numel();
  const auto& t = config_.text;
  TensorMap out;
  out["hidden_states"] = HostTensor::from(std::move(e.hidden_states));
  Shape pli_shape{S, t.num_hidden_layers, t.ple_dim()};
  if (e.per_layer_inputs.data.empty())
    e.per_layer_inputs.data.assign(static_cast<size_t>(shape_numel(pli_shape)), 0.0f);
  out["per_layer_inputs"] = HostTensor(pli_shape, std::move(e.per_layer_inputs.data));
  out["ple_token_ids"] = HostTensor({S}, std::move(e.ple_token_ids));
  if (config_.takes_audio())
    out["audio_splice_mask"] = HostTensor({S}, std::move(e.audio_splice_mask));
  out["image_splice_mask"] = HostTensor({S}, std::move(e.image_splice_mask));
  return out;
}

TensorMap Stage::run_layers(ThreadPool& pool, TensorMap& in, std::span<KvCache* const> caches,
                            TapRecorder* taps) const {
  const std::string where =
      "stage '" + decl_.id + "' (transformer_layers " + decl_.layers.str() + ")";
  if (caches.empty()) fail(where, ": runs with a sequence's KV cache; none was given");
  FloatTensor hidden = take(in, "hidden_states").take_float();
  HostTensor pli_t = take(in, "per_layer_inputs");
  const HostTensor pos = take(in, "positions");
  const int64_t S = hidden.dim(0);
  const auto p = pos.values<int32_t>();
  // Rows of one sequence form one segment; without row_sequence every row is caches[0]'s.
  std::vector<int32_t> seq_of(static_cast<size_t>(S), 0);
  if (in.count("row_sequence")) {
    const HostTensor rs = take(in, "row_sequence");
    seq_of.assign(rs.values<int32_t>().begin(), rs.values<int32_t>().end());
  } else if (caches.size() != 1) {
    fail(where, ": a call with ", caches.size(), " sequences needs row_sequence");
  }
  std::vector<RowSegment> segments;
  std::vector<uint8_t> seen(caches.size(), 0);
  for (int64_t r = 0; r < S; ++r) {
    const int32_t k = seq_of[static_cast<size_t>(r)];
    if (k < 0 || static_cast<size_t>(k) >= caches.size() || !caches[static_cast<size_t>(k)])
      fail(where, ": row_sequence[", r, "] is ", k, ", but the call has ", caches.size(),
           " sequence(s)");
    if (segments.empty() || seq_of[static_cast<size_t>(r - 1)] != k) {
      if (seen[static_cast<size_t>(k)])
        fail(where, ": the rows of sequence ", k, " are not contiguous (again at row ", r, ")");
      seen[static_cast<size_t>(k)] = 1;
      segments.push_back(
          {r, 0, caches[static_cast<size_t>(k)]->n_past(), caches[static_cast<size_t>(k)]});
    }
    RowSegment& seg = segments.back();
    const int64_t want = seg.start + seg.rows;
    if (p[static_cast<size_t>(r)] != want)
      fail(where,
           ": positions must be consecutive and continue each sequence's cache, which holds ",
           seg.start, " positions: expected position ", want, " at row ", r, ", got ",
           p[static_cast<size_t>(r)]);
    ++seg.rows;
  }
  // The image block's groups: a group must not straddle two sequences of a batch.
  std::vector<int32_t> groups;
  if (in.count("vision_groups")) {
    const HostTensor g = take(in, "vision_groups");
    groups.assign(g.values<int32_t>().begin(), g.values<int32_t>().end());
    for (RowSegment& seg : segments) {
      seg.vision_groups = groups.data() + seg.row0;
      const int32_t first = groups[static_cast<size_t>(seg.row0)];
      if (first >= 0 && seg.row0 > 0 && groups[static_cast<size_t>(seg.row0 - 1)] == first)
        fail(where, ": vision group ", first, " spans two sequences (row ", seg.row0, ")");
    }
  }
  PerLayerInputs pli;
  if (config_.text.has_ple()) {
    pli.rows = S;
    pli.first_layer = decl_.layers.begin;
    pli.num_layers = decl_.layers.end - decl_.layers.begin;
    pli.dim = config_.text.ple_dim();
    pli.data = pli_t.take_float().data;  // moved, not copied
  }
  try {
    text_->run_layers(pool, decl_.layers.begin, decl_.layers.end, segments, hidden, pli, taps);
  } catch (const Error& err) {
    fail(where, ": ", err.what());
  }
  TensorMap out;
  out["hidden_states"] = HostTensor::from(std::move(hidden));
  return out;
}

TensorMap Stage::run_head(ThreadPool& pool, TensorMap& in, TapRecorder* taps) const {
  const FloatTensor hidden = take(in, "hidden_states").take_float();
  TensorMap out;
  out["logits"] = HostTensor::from(text_->head(pool, hidden, 0, hidden.dim(0), taps));
  return out;
}

double Stage::decode_weight_bytes() const {
  // The table marks the matrices read whole per decoded token, and in which part (the tied
  // embedding counts as the head, not where its rows are gathered).
  const PartSet held = stage_parts(decl_);
  double b = 0;
  for (const TensorSpec& s : tensor_table(config_))
    if (s.role == TensorRole::Required && (s.decode_read_in & held.parts) && part_holds(held, s))
      b += static_cast<double>(weights_->view(s.key).nbytes) * s.decode_share;
  return b;
}

}  // namespace gemstage
