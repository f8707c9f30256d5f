// gemstage dump: run a prompt (token ids from .npy) and write the requested taps as .npy files,
// named and shaped as the golden fixtures. Optional greedy decode with the KV cache.
#include <algorithm>
#include <filesystem>
#include <iostream>

#include "audio/audio_decode.h"
#include "audio/audio_features.h"
#include "core/error.h"
#include "gemma4/multimodal.h"
#include "image/image_decode.h"
#include "image/image_processor.h"
#include "image/unified_image.h"
#include "io/npy.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"
#include "stage/bundle.h"
#include "stage/cache_files.h"
#include "stage/sequence.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "tools/generation_args.h"
#include "video/video_processor.h"

namespace gemstage::cli {

namespace {

struct DumpArgs {
  std::string model, ids, out, taps = "logits";
  int decode = 0;
  int chunk = 0;  // 0: whole prompt in one pass
  int threads = 0;
  int64_t ctx = 0;
  std::string cache_type = "auto";
  std::string ple_identity = "pad", embed_scale = "f32";
  std::vector<std::string> pixel_values, image_position_ids;  // preprocessed images, in order
  std::vector<std::string> images;                            // image files, preprocessed here
  std::vector<std::string> audios;                            // audio files, in prompt order
  std::vector<std::string> videos;                            // video files, in prompt order
  VideoArgs video;
  bool verbose = false;
  std::string model_draft;  // with --decode: a speculative decode too (spec_* taps)
  int draft_max = 4;
  std::string cache_out;  // each transformer stage's KV cache as the run leaves it
};

// --cache-out DIR: DIR/<stage id>/ for every transformer stage (stage/cache_files.h).
void save_caches(const Sequence& seq, const std::string& dir) {
  const auto& stages = seq.model().stages();
  for (size_t i = 0; i < stages.size(); ++i) {
    const StageDecl& d = seq.stages()[i];
    if (d.role != StageRole::TransformerLayers) continue;
    if (!stages[i] || !seq.stage_cache(i))
      fail("--cache-out: stage '", d.id, "' runs in another process, which keeps its cache");
    save_stage_cache(*stages[i], *seq.stage_cache(i), (std::filesystem::path(dir) / d.id).string());
  }
}

// The spec_* taps of docs/gemma4-mtp.md: a greedy speculative decode of n_new tokens with
// a constant draft length, on a fresh sequence of the same model; rows padded with -1.
void record_speculative(const DumpArgs& a, ThreadPool& pool, const Sequence& model,
                        std::span<const int32_t> ids, const FloatTensor* soft, int64_t chunk,
                        int n_new, TapRecorder& taps) {
  const auto drafter = open_drafter(a.model_draft);
  check_assistant_matches(drafter->config(), model.config(), a.model_draft, a.model);
  Sequence seq(model.shared_model(),
               std::min<int64_t>(model.max_context(),
                                 static_cast<int64_t>(ids.size()) + n_new + a.draft_max + 1),
               model.kv_type());
  SpeculativeOptions opt;
  opt.draft_max = a.draft_max;
  opt.adaptive = false;
  std::vector<SpeculativeRound> rounds;
  const auto out = speculative_generate(pool, seq, *drafter, ids, soft, chunk, n_new, nullptr, opt,
                                        nullptr, &rounds);
  std::vector<int64_t> pos, in, nd, acc, drafts, tids;
  const size_t K = static_cast<size_t>(a.draft_max);
  for (const SpeculativeRound& r : rounds) {
    pos.push_back(r.position);
    in.push_back(r.input_token);
    nd.push_back(static_cast<int64_t>(r.drafts.size()));
    acc.push_back(r.accepted);
    for (size_t i = 0; i < K; ++i) drafts.push_back(i < r.drafts.size() ? r.drafts[i] : -1);
    for (size_t i = 0; i <= K; ++i) tids.push_back(i < r.target_ids.size() ? r.target_ids[i] : -1);
  }
  taps.append_ids("spec_new_ids", std::vector<int64_t>(out.begin(), out.end()));
  taps.append_ids("spec_round_positions", pos);
  taps.append_ids("spec_round_input_tokens", in);
  taps.append_ids("spec_round_num_drafts", nd);
  taps.append_ids("spec_round_accepted", acc);
  taps.append_ids("spec_round_drafts", drafts, {static_cast<int64_t>(K)});
  taps.append_ids("spec_round_target_ids", tids, {static_cast<int64_t>(K + 1)});
}

// The images of the prompt, in prompt order, as the vision tower takes them.
std::vector<VisionInput> load_images(const DumpArgs& a, const Sequence& model) {
  std::vector<VisionInput> images;
  if (!a.images.empty() && !a.pixel_values.empty())
    fail(
        "give images either as --image files or as --pixel-values arrays, not both (their prompt "
        "order would be ambiguous)");
  if (a.pixel_values.size() != a.image_position_ids.size())
    fail("got ", a.pixel_values.size(), " --pixel-values but ", a.image_position_ids.size(),
         " --image-position-ids; give one positions file per pixel file, in the same order");
  const VisionTower* vision = model.vision();
  if (!a.pixel_values.empty() && !vision)
    fail(a.model,
         ": this checkpoint has no vision tower (no vision_config), so it cannot take "
         "--pixel-values");
  for (size_t i = 0; i < a.pixel_values.size(); ++i) {
    std::vector<VisionInput> v =
        vision_inputs_from_arrays(load_npy(a.pixel_values[i]), load_npy(a.image_position_ids[i]),
                                  vision->patch_dim(), a.pixel_values[i], a.image_position_ids[i]);
    for (VisionInput& in : v) {
      try {
        vision->num_soft_tokens(in.position_ids.data(), in.max_patches);  // validates
      } catch (const Error& e) {
        fail(a.image_position_ids[i], ": ", e.what());
      }
      images.push_back(std::move(in));
    }
  }
  // --image FILE: decoded and preprocessed exactly as the Gemma 4 image processor does.
  if (!a.images.empty()) {
    if (!vision)
      fail(a.model,
           ": this checkpoint has no vision tower (no vision_config), so it cannot take --image");
    const ImageProcessorConfig pc = load_processor_config(model.assets_dir());
    for (const std::string& path : a.images) {
      const ProcessedImage p = preprocess_image(decode_image_file(path), pc);
      images.push_back({p.max_patches, p.pixel_values, p.position_ids});
    }
  }
  return images;
}

// --video FILE: sampled and preprocessed as Gemma4VideoProcessor does (docs/video.md); taps
// pixel_values_videos [F, max_patches, 3pp] and video_position_ids [F, max_patches, 2]. Returns
// every frame, videos in order.
std::vector<VisionInput> load_video_frames(const DumpArgs& a, const Sequence& model,
                                           TapRecorder& taps, int& soft_per_frame) {
  std::vector<VisionInput> frames;
  if (a.videos.empty()) return frames;
  if (!model.vision() || model.model().embeddings().unified())
    fail(a.model, ": this checkpoint has no vision tower, so it cannot take --video");
  VideoProcessorConfig cfg = load_video_processor_config(model.assets_dir());
  if (a.video.frames) cfg.num_frames = a.video.frames;
  if (a.video.budget) cfg.frame.max_soft_tokens = a.video.budget;
  for (const std::string& path : a.videos) {
    const ProcessedVideo v = process_video_file(path, cfg);
    soft_per_frame = v.num_soft_tokens_per_frame;
    taps.append("pixel_values_videos", {v.max_patches, v.patch_dim}, v.pixel_values.data(),
                v.num_frames);
    taps.append_ids("video_position_ids", v.position_ids, {v.max_patches, 2});
    const size_t nv = static_cast<size_t>(v.max_patches) * v.patch_dim;
    const size_t np = static_cast<size_t>(v.max_patches) * 2;
    for (size_t f = 0; f < static_cast<size_t>(v.num_frames); ++f)
      frames.push_back({v.max_patches,
                        {v.pixel_values.begin() + static_cast<ptrdiff_t>(f * nv),
                         v.pixel_values.begin() + static_cast<ptrdiff_t>((f + 1) * nv)},
                        {v.position_ids.begin() + static_cast<ptrdiff_t>(f * np),
                         v.position_ids.begin() + static_cast<ptrdiff_t>((f + 1) * np)}});
  }
  return frames;
}

// The images and video frames in the order the prompt places them: each run of <|image|> rows
// takes the next image, each run of <|video|> rows the next frame. is_frame marks the frames.
std::vector<VisionInput> in_prompt_order(const ModelConfig& c, std::span<const int32_t> ids,
                                         std::vector<VisionInput> images,
                                         std::vector<VisionInput> frames,
                                         std::vector<bool>& is_frame) {
  std::vector<VisionInput> out;
  size_t next_image = 0, next_frame = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0 && ids[i] == ids[i - 1]) continue;  // inside a run
    const bool video = ids[i] == c.video_token_id;
    if (!video && ids[i] != c.image_token_id) continue;
    std::vector<VisionInput>& from = video ? frames : images;
    size_t& next = video ? next_frame : next_image;
    if (next >= from.size())
      fail("the prompt has more ", video ? "video frames (<|video|> runs)" : "images",
           " than were given (", from.size(), ")");
    out.push_back(std::move(from[next++]));
    is_frame.push_back(video);
  }
  if (next_frame != frames.size() || next_image != images.size())
    fail("the prompt holds ", next_image, " image(s) and ", next_frame, " video frame(s) but ",
         images.size(), " and ", frames.size(), " were given");
  return out;
}

// gemma4_unified: --image files / --pixel-values arrays and --audio files through the model's
// embedders (no towers); soft tokens in prompt order.
FloatTensor unified_soft_tokens(const DumpArgs& a, const Sequence& model, const UnifiedEmbedder& u,
                                std::span<const int32_t> ids, ThreadPool& pool, TapRecorder& taps,
                                double& audio_seconds) {
  std::vector<UnifiedImageInput> images;
  for (size_t i = 0; i < a.pixel_values.size(); ++i) {
    const int64_t pd = u.vision_config().patch_dim();
    for (VisionInput& in :
         vision_inputs_from_arrays(load_npy(a.pixel_values[i]), load_npy(a.image_position_ids[i]),
                                   pd, a.pixel_values[i], a.image_position_ids[i]))
      images.push_back({in.max_patches, std::move(in.pixel_values), std::move(in.position_ids)});
  }
  if (!a.images.empty()) {
    const ImageProcessorConfig pc = load_processor_config(model.assets_dir());
    u.vision_config();  // refuses a model without vision_config
    for (const std::string& path : a.images) {
      const UnifiedPatches p = preprocess_unified_image(decode_image_file(path), pc);
      images.push_back({p.max_soft_tokens, p.pixel_values, p.position_ids});
    }
  }
  for (size_t i = 0; i < images.size(); ++i) try {
      u.num_image_soft_tokens(images[i]);
    } catch (const Error& e) {
      fail("image ", i + 1, ": ", e.what());
    }
  std::vector<UnifiedAudioInput> clips;
  for (const std::string& path : a.audios) {
    const AudioClip clip = decode_audio_file(path);
    audio_seconds += clip.seconds();
    taps.append("audio_waveform", {}, clip.samples.data(),
                static_cast<int64_t>(clip.samples.size()));
    clips.push_back(unified_audio_frames(clip.samples, u.audio_config().frame_samples));
  }
  FloatTensor vis, aud;
  if (!images.empty()) vis = u.encode_images(pool, images, &taps);
  if (!clips.empty()) aud = u.encode_audio(pool, clips, &taps);
  return merge_soft_tokens(model.config(), ids, images.empty() ? nullptr : &vis,
                           clips.empty() ? nullptr : &aud);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= s.size()) {
    const size_t e = s.find(',', b);
    const std::string part = s.substr(b, e == std::string::npos ? std::string::npos : e - b);
    if (!part.empty()) out.push_back(part);
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

int run_dump(const DumpArgs& a, const RunContext& cx) {
  const double t0 = now_seconds();
  auto model = std::make_unique<Sequence>(cx.models.open(a.model), a.ctx);
  apply_cache_type(*model, a.cache_type);
  print_model_notes(model->notes(), a.verbose);
  const TextConfig& tc = model->config().text;
  const double t_load = now_seconds() - t0;

  const NpyArray ids_npy = load_npy(a.ids);
  if (ids_npy.shape.size() != 1 && !(ids_npy.shape.size() == 2 && ids_npy.shape[0] == 1))
    fail(a.ids, ": expected a 1-D array of token ids (or [1, S]), found shape ",
         shape_str(ids_npy.shape));
  std::vector<int32_t> ids;
  for (int64_t v : ids_npy.to_i64()) {
    if (v < 0 || v > INT32_MAX) fail(a.ids, ": token id ", v, " is out of range");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) fail(a.ids, ": no token ids");

  TextRunOptions opt;
  if (a.ple_identity == "raw") {
    opt.ple_identity = PleIdentity::Raw;
    std::cerr << "warning: --ple-identity raw is a DIAGNOSTIC that reproduces the known "
                 "staged-export bug "
                 "(raw placeholder ids feed the PLE lookup); outputs are wrong on purpose\n";
  } else if (a.ple_identity != "pad") {
    fail("--ple-identity must be pad or raw");
  }
  opt.embed_scale = a.embed_scale == "bf16" ? EmbedScaleMode::BF16 : EmbedScaleMode::F32;

  TapRecorder taps(split_list(a.taps));
  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count());
  const UnifiedEmbedder* unified = model->model().embeddings().unified();
  std::vector<VisionInput> images = unified ? std::vector<VisionInput>{} : load_images(a, *model);
  int soft_per_frame = 0;
  std::vector<VisionInput> frames = load_video_frames(a, *model, taps, soft_per_frame);
  const size_t n_frames = frames.size(), n_images = images.size();
  std::vector<bool> is_frame;
  if (n_frames)
    images = in_prompt_order(model->config(), ids, std::move(images), std::move(frames), is_frame);
  const int64_t n_placeholders = count_placeholders(model->config(), ids);
  FloatTensor soft;
  double t_vision = 0, t_audio = 0, t_features = 0, audio_seconds = 0;
  if (unified) {
    const double tv = now_seconds();
    soft = unified_soft_tokens(a, *model, *unified, ids, pool, taps, audio_seconds);
    t_vision = now_seconds() - tv;
  } else if (!images.empty()) {
    const double tv = now_seconds();
    soft = model->vision()->encode_all(pool, images, &taps);
    t_vision = now_seconds() - tv;
    // The soft tokens of each video frame, [F, K, D].
    int64_t row = 0;
    for (size_t k = 0; k < images.size(); ++k) {
      const int64_t n =
          model->vision()->num_soft_tokens(images[k].position_ids.data(), images[k].max_patches);
      if (!is_frame.empty() && is_frame[k])
        taps.append("video_soft_tokens", {n, soft.dim(1)}, soft.row(row), 1);
      row += n;
    }
  }
  // --audio FILE: decoded, featurized (Gemma4AudioFeatureExtractor) and run through the tower.
  if (!a.audios.empty() && !unified) {
    if (!model->audio())
      fail(a.model,
           ": this checkpoint has no audio tower (no audio_config), so it cannot take --audio");
    std::vector<AudioInput> clips;
    for (const std::string& path : a.audios) {
      const AudioClip clip = decode_audio_file(path);
      audio_seconds += clip.seconds();
      taps.append("audio_waveform", {}, clip.samples.data(),
                  static_cast<int64_t>(clip.samples.size()));
      const double tf = now_seconds();
      const LogMelFeatures f = log_mel_features(clip.samples, path.c_str());
      t_features += now_seconds() - tf;
      clips.push_back({f.frames, f.values, f.mask});
    }
    const double ta = now_seconds();
    const FloatTensor audio_soft = model->audio()->encode_all(pool, clips, &taps);
    t_audio = now_seconds() - ta;
    soft = merge_soft_tokens(model->config(), ids, images.empty() ? nullptr : &soft, &audio_soft);
  }
  const int64_t n_soft = soft.shape.empty() ? 0 : soft.dim(0);
  if (n_soft != n_placeholders)
    fail(a.ids, ": the prompt has ", n_placeholders,
         " image/audio/video placeholder tokens but the ", n_images, " image(s), ", n_frames,
         " video frame(s)", a.audios.empty() ? "" : " and the audio clip(s)", " yield ", n_soft,
         " soft tokens; the processor must write exactly one placeholder per soft token");
  const int64_t S = static_cast<int64_t>(ids.size());
  if (a.ctx <= 0)
    model->reset(std::min<int64_t>(model->max_context(), S + std::max(0, a.decode) + 1));
  const bool all_logits = taps.wants("logits");
  const int64_t chunk = a.chunk > 0 ? a.chunk : S;

  const double t1 = now_seconds();
  FloatTensor last =
      model->prefill(pool, ids, n_soft ? &soft : nullptr, chunk, all_logits, &taps, opt);
  const double t_prefill = now_seconds() - t1;

  const int64_t V = tc.vocab_size;
  std::vector<int64_t> decode_ids;
  std::vector<float> decode_logits, margins;
  double t_decode = 0;
  if (a.decode > 0) {
    std::vector<float> row(last.row(last.dim(0) - 1), last.row(last.dim(0) - 1) + V);
    // generation_config.json suppress_tokens never win (decode_logits stay raw).
    const std::vector<int32_t> suppress = load_suppress_tokens(model->assets_dir());
    std::vector<float> choose;
    const double t2 = now_seconds();
    for (int step = 0; step < a.decode; ++step) {
      choose = row;
      for (int32_t t : suppress)
        if (t >= 0 && t < V) choose[static_cast<size_t>(t)] = -INFINITY;
      const int64_t best = argmax_first(choose.data(), V);
      float second = -INFINITY;
      for (int64_t i = 0; i < V; ++i)
        if (i != best) second = std::max(second, choose[static_cast<size_t>(i)]);
      decode_ids.push_back(best);
      margins.push_back(row[static_cast<size_t>(best)] - second);
      decode_logits.insert(decode_logits.end(), row.begin(), row.end());
      if (step + 1 == a.decode) break;
      const int32_t next = static_cast<int32_t>(best);
      FloatTensor l =
          model->forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr, opt);
      row.assign(l.row(0), l.row(0) + V);
    }
    t_decode = now_seconds() - t2;
    taps.append_ids("decode_ids", decode_ids);
    taps.append("decode_logits", {V}, decode_logits.data(), a.decode);
    taps.append("decode_top2_margin", {}, margins.data(), a.decode);
    std::vector<int64_t> seq(ids.begin(), ids.end());
    seq.insert(seq.end(), decode_ids.begin(), decode_ids.end());
    taps.append_ids("sequence_ids", seq);
    if (!a.model_draft.empty()) {
      record_speculative(a, pool, *model, ids, n_soft ? &soft : nullptr, chunk, a.decode, taps);
    }
  }
  if (!a.model_draft.empty() && a.decode <= 0) fail("--model-draft needs --decode N");
  taps.write_dir(a.out);
  if (!a.cache_out.empty()) save_caches(*model, a.cache_out);

  std::cerr << "load " << t_load << " s; ";
  if (!images.empty())
    std::cerr << "vision " << n_images << " image(s) and " << n_frames << " video frame(s) ("
              << soft_per_frame << " soft tokens each), " << soft.dim(0) << " soft tokens in "
              << t_vision << " s; ";
  if (!a.audios.empty())
    std::cerr << "audio " << a.audios.size() << " clip(s), " << audio_seconds << " s: features "
              << t_features << " s, tower " << t_audio << " s (real-time factor "
              << (audio_seconds > 0 ? (t_features + t_audio) / audio_seconds : 0.0) << "); ";
  std::cerr << "prefill " << S << " tokens in " << t_prefill << " s ("
            << (t_prefill > 0 ? static_cast<double>(S) / t_prefill : 0.0) << " t/s)";
  if (a.decode > 1)
    std::cerr << "; decode " << a.decode - 1 << " tokens in " << t_decode << " s ("
              << static_cast<double>(a.decode - 1) / t_decode << " t/s)";
  std::cerr << "; " << pool.size() << " threads; wrote " << taps.recorded().size() << " taps to "
            << a.out << "\n";
  return 0;
}

}  // namespace

void add_dump_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<DumpArgs>();
  auto* sub = app.add_subcommand(
      "dump", "Run token ids through the model and write named taps as .npy files");
  sub->add_option("-m,--model", a->model, "Hugging Face checkpoint directory or gemstage bundle")
      ->required();
  sub->add_option("--ids", a->ids, ".npy file of prompt token ids (int64 or int32, shape [S])")
      ->required();
  sub->add_option("--out", a->out, "output directory for <tap>.npy files")->required();
  sub->add_option("--taps", a->taps, "comma-separated tap names, or 'all'")->capture_default_str();
  sub->add_option("--decode", a->decode,
                  "greedy decode N tokens with the KV cache (decode_ids, decode_logits)");
  sub->add_option("--model-draft", a->model_draft,
                  "with --decode: also a greedy speculative decode with this gemma4_assistant "
                  "drafter (also -md; a checkpoint, or a bundle with a drafter stage), writing the "
                  "spec_* taps (spec_round_drafts, spec_round_accepted, ...)");
  sub->add_option("--draft-max", a->draft_max, "drafts per speculative round (default 4)")
      ->check(CLI::Range(1, 64));
  sub->add_option("--chunk", a->chunk, "prefill chunk size (0 = whole prompt in one pass)");
  sub->add_option("--cache-out", a->cache_out,
                  "write each transformer stage's KV cache, as the run leaves it (the prompt and "
                  "every decoded token but the last), to DIR/<stage id>/ for run-stage --past");
  sub->add_option("-t,--threads", a->threads, "worker threads (default: all cores)");
  add_cache_type(sub, a->cache_type);
  sub->add_option("-c,--ctx-size", a->ctx, "KV cache context size (default: prompt + decode)");
  sub->add_option("--ple-identity", a->ple_identity,
                  "pad (HF, default) or raw (DIAGNOSTIC: reproduce the raw-placeholder-id PLE bug)")
      ->check(CLI::IsMember({"pad", "raw"}));
  sub->add_option(
         "--embed-scale", a->embed_scale,
         "f32 (HF in float32, default) or bf16 (sqrt(D) rounded to bf16, as HF running in bf16)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  sub->add_option(
      "--image", a->images,
      "image file (PNG or JPEG), decoded and preprocessed as the HF Gemma 4 processor does "
      "(repeatable, in prompt order)");
  sub->add_option("--pixel-values", a->pixel_values,
                  ".npy of preprocessed image patches [max_patches, 3*patch^2] or [1, ...] "
                  "(repeatable, one per image in prompt order; bypasses image preprocessing)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--image-position-ids", a->image_position_ids,
                  ".npy of patch (x, y) positions [max_patches, 2] or [1, ...], -1 for padding "
                  "(repeatable, one per --pixel-values, same order)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option(
      "--audio", a->audios,
      "audio file (WAV, FLAC, OGG, MP3; resampled to 16 kHz, at most 30 s), through the "
      "feature extractor and the audio tower (repeatable, in prompt order; taps "
      "audio_waveform, audio_features, audio_subsample_out, audio_encoder_out, "
      "audio_tower_out, audio_embedder_out, ...)");
  sub->add_option("--video", a->videos,
                  "video file (MP4/MOV, WebM/MKV, GIF), frames sampled and preprocessed as the HF "
                  "Gemma 4 video processor does (repeatable, in prompt order; taps "
                  "pixel_values_videos, video_position_ids, video_soft_tokens)");
  add_video_options(sub, a->video);
  sub->add_flag("-v,--verbose", a->verbose, "list unused config fields and tensors");
  reg.add(sub, [a, &cx = reg.context] { return run_dump(*a, cx); });
}

}  // namespace gemstage::cli
