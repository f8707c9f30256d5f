// gemstage generate / chat: text (and images, videos, audio) in, streamed text out.
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/mapped_file.h"
#include "runtime/assistant.h"
#include "runtime/engine.h"
#include "runtime/generation.h"
#include "runtime/speculative.h"
#include "stage/bundle.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "tools/generation_args.h"

namespace gemstage::cli {

namespace {

void print_stats(const GenerationResult& r) {
  std::cerr << "\nprompt " << r.prompt_tokens << " tokens";
  if (r.reused_tokens) std::cerr << " (" << r.reused_tokens << " reused from the cache)";
  const double pf = static_cast<double>(r.prompt_tokens - r.reused_tokens);
  std::cerr << "; prefill " << (r.prefill_seconds > 0 ? pf / r.prefill_seconds : 0.0)
            << " t/s; generated " << r.tokens.size() << " tokens, decode "
            << (r.decode_seconds > 0 ? static_cast<double>(r.tokens.size()) / r.decode_seconds
                                     : 0.0)
            << " t/s; finish: " << r.finish_reason << "\n";
  if (r.finish_reason == "context")
    std::cerr << "stopped: the context limit was reached (raise --ctx-size / -c)\n";
}

struct GenerateArgs : CommonArgs {
  std::string prompt, system;
  std::vector<std::string> images, audios, videos;
  VideoArgs video;
  bool raw = false, json = false;
  std::string json_schema, json_schema_file;  // constrained output (llama.cpp's -j / -jf)
  // Speculative decoding with a gemma4_assistant drafter (docs/gemma4-mtp.md).
  std::string model_draft;
  int draft_max = 4, draft_min = 0;
  bool no_draft_adapt = false;
  bool no_bundle_drafter = false;  // a bundle's drafter stage is used unless this is set
};

// The end of a generate run on stdout: with --json one object (text, ids, finish reason, usage,
// plus `extra`), otherwise the newline after the streamed text.
void print_result(const GenerateArgs& a, const GenerationResult& r, const PreparedPrompt& p,
                  const nlohmann::json& extra = nlohmann::json::object()) {
  if (!a.json) {
    std::cout << "\n";
    return;
  }
  nlohmann::json j = {{"text", r.text},
                      {"tokens", r.tokens},
                      {"prompt_ids", p.ids},
                      {"finish_reason", r.finish_reason},
                      {"prompt_tokens", r.prompt_tokens},
                      {"completion_tokens", r.tokens.size()}};
  j.update(extra);
  std::cout << j.dump() << "\n";
}

// The grammar --json-schema / --json-schema-file ask for; "{}" means any JSON object.
std::shared_ptr<const JsonGrammar> output_grammar(const GenerateArgs& a) {
  if (a.json_schema.empty() && a.json_schema_file.empty()) return nullptr;
  if (!a.json_schema.empty() && !a.json_schema_file.empty())
    fail("give --json-schema or --json-schema-file, not both");
  std::string text = a.json_schema;
  std::string where = "--json-schema";
  if (!a.json_schema_file.empty()) {
    text = read_text_file(a.json_schema_file);
    where = a.json_schema_file;
  }
  nlohmann::json schema;
  try {
    schema = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": not valid JSON: ", e.what());
  }
  if (schema.is_object() && schema.empty()) return JsonGrammar::any_object();
  try {
    return JsonGrammar::from_schema(schema);
  } catch (const Error& e) {
    fail(where, ": ", e.what());
  }
}

// The drafter generate decodes with: -md DIR (or a bundle's drafter stage), else the bundle's own
// drafter stage unless --no-bundle-drafter or an output constraint (drafts are not constrained).
std::shared_ptr<const AssistantModel> choose_drafter(const GenerateArgs& a, const Assistant& as) {
  if (!a.model_draft.empty()) {
    if (output_grammar(a))
      fail("--model-draft cannot be combined with --json-schema yet (drafts are not constrained)");
    std::shared_ptr<const AssistantModel> d = open_drafter(a.model_draft);
    check_assistant_matches(d->config(), as.model().config(), d->path(), a.model);
    return d;
  }
  if (a.no_bundle_drafter || !is_bundle_dir(a.model) || output_grammar(a)) return nullptr;
  return open_bundle_drafter(a.model, read_bundle_manifest(a.model));
}

// The engine generate and chat run their one conversation on: one slot, prompts prefilled in
// chunks of -b rows.
EngineOptions engine_options(const CommonArgs& a, const Assistant& as) {
  EngineOptions eo;
  eo.slots = 1;
  eo.kv_budget = as.max_context();
  eo.batch_rows = eo.ubatch_rows = static_cast<int>(std::clamp<int64_t>(a.chunk, 1, 1 << 20));
  eo.kv_type = cache_type_of(a.cache_type);
  return eo;
}

// Runs one request on the engine, streaming its text to `out` (null: none) as each step makes it;
// the result in the shape the stats printer takes.
GenerationResult run_request(Engine& engine, EngineRequest request, std::ostream* out,
                             Generation::Result* full = nullptr) {
  std::shared_ptr<Generation> g;
  try {
    g = engine.submit(std::move(request));
  } catch (const RequestRejected& e) {
    if (e.reason() != RequestRejected::Reason::kPromptTooLong) throw;
    fail(e.what(), "; shorten the prompt or raise --ctx-size / -c");
  }
  engine.run_until_idle([&] {
    const Generation::Progress p = g->take(std::chrono::milliseconds(0));
    if (out && !p.text.empty()) *out << p.text << std::flush;
  });
  if (out) *out << g->take(std::chrono::milliseconds(0)).text << std::flush;
  Generation::Result r = g->result();
  if (r.error) fail(r.error->message);
  GenerationResult res = r.generation;
  res.prompt_tokens = r.prompt_tokens;
  res.reused_tokens = r.cached_tokens;
  res.prefill_seconds = r.prefill_seconds;
  res.decode_seconds = r.decode_seconds;
  if (full) *full = std::move(r);
  return res;
}

// A --video / /video file decoded and preprocessed now (chat keeps it for later turns), with a
// note of what was sampled.
ChatInputPart load_video_part(const Assistant& as, const VideoArgs& v, const std::string& path) {
  const double t0 = now_seconds();
  ChatInputPart part;
  part.video = as.load_video(v.source(path));
  const ProcessedVideo& p = *part.video;
  std::cerr << "video " << path << ": " << p.num_frames << " of " << p.info.total_frames
            << " frames (" << p.info.codec << " " << p.info.width << "x" << p.info.height << ", "
            << p.fps << " fps), " << p.num_soft_tokens_per_frame << " soft tokens each, in "
            << now_seconds() - t0 << " s\n";
  return part;
}

int run_generate(const GenerateArgs& a, const RunContext& cx) {
  auto as = Assistant::open(a.model, a.ctx, cache_type_of(a.cache_type), cx.models);
  print_model_notes(as->model().notes(), a.verbose);
  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count());
  PreparedPrompt p;
  if (a.raw) {
    if (!a.images.empty() || !a.audios.empty() || !a.videos.empty())
      fail(
          "--raw prompts cannot take --image, --audio or --video (they need the chat format's "
          "markers)");
    p = as->prepare_raw(a.prompt);
  } else {
    std::vector<ChatInput> msgs;
    if (!a.system.empty()) msgs.push_back({"system", {{a.system, std::nullopt}}});
    ChatInput user{"user", {}};
    for (const std::string& f : a.images) user.parts.push_back({"", decode_image_file(f)});
    for (const std::string& f : a.videos) user.parts.push_back(load_video_part(*as, a.video, f));
    for (const std::string& f : a.audios)
      user.parts.push_back({"", std::nullopt, decode_audio_file(f)});
    user.parts.push_back({a.prompt, std::nullopt});
    msgs.push_back(std::move(user));
    p = as->prepare_chat(pool, msgs, {true, a.think});
  }
  EngineOptions eo = engine_options(a, *as);
  eo.pipeline_depth = cx.pipeline_depth;
  eo.drafter = choose_drafter(a, *as);
  std::unique_ptr<Engine> engine;
  try {
    engine = std::make_unique<Engine>(as->shared_model(), &as->tokenizer(), pool, eo);
  } catch (const Error& e) {
    // A bundle's own drafter stage reads the caches of the stage it is placed with; where that
    // stage runs in another process, decode without it (an explicit -md is an error).
    if (!eo.drafter || !a.model_draft.empty()) throw;
    std::cerr << "note: decoding without the bundle's drafter stage: " << e.what() << "\n";
    eo.drafter = nullptr;
    engine = std::make_unique<Engine>(as->shared_model(), &as->tokenizer(), pool, eo);
  }
  EngineRequest request;
  request.ids = p.ids;
  request.soft_tokens = p.soft_tokens;
  request.gen = generation_options(a, *as);
  request.gen.json_grammar = output_grammar(a);
  if (engine->drafting()) {
    SpeculativeOptions so;
    so.draft_max = a.draft_max;
    so.draft_min = a.draft_min;
    so.adaptive = !a.no_draft_adapt;
    request.draft = so;
  }
  Generation::Result full;
  const GenerationResult r =
      run_request(*engine, std::move(request), a.json ? nullptr : &std::cout, &full);
  nlohmann::json extra = nlohmann::json::object();
  if (engine->drafting())
    extra = {{"draft_rounds", full.draft.rounds},
             {"drafted", full.draft.drafted},
             {"draft_accepted", full.draft.accepted}};
  print_result(a, r, p, extra);
  print_stats(r);
  if (engine->drafting())
    std::cerr << "drafter: " << full.draft.rounds << " rounds, " << full.draft.accepted << " of "
              << full.draft.drafted << " drafts accepted (" << 100.0 * full.draft.acceptance()
              << "%), " << full.draft.plain_steps << " plain steps\n";
  return 0;
}

struct ChatArgs : CommonArgs {
  std::vector<std::string> audios, videos;  // attached to the first message
  VideoArgs video;
};

int run_chat(const ChatArgs& a, const RunContext& cx) {
  auto as = Assistant::open(a.model, a.ctx, cache_type_of(a.cache_type), cx.models);
  print_model_notes(as->model().notes(), a.verbose);
  ThreadPool pool(a.threads > 0 ? a.threads : default_thread_count());
  EngineOptions eo = engine_options(a, *as);
  eo.pipeline_depth = cx.pipeline_depth;
  // Each turn is the whole conversation so far; the slot's caches hold the earlier turns, so
  // only the new suffix is prefilled.
  Engine engine(as->shared_model(), &as->tokenizer(), pool, eo);
  const GenerationOptions opt = generation_options(a, *as);
  const bool tty = isatty(0);
  std::vector<ChatInput> history;
  std::vector<RgbImage> pending_images;
  std::vector<AudioClip> pending_audio;
  std::vector<ChatInputPart> pending_videos;
  for (const std::string& f : a.audios) pending_audio.push_back(decode_audio_file(f));
  for (const std::string& f : a.videos) pending_videos.push_back(load_video_part(*as, a.video, f));
  if (tty)
    std::cerr << "gemstage chat: /image FILE, /video FILE and /audio FILE attach an image, a video "
                 "or a recording to the next message, /system TEXT sets the system prompt, /reset "
                 "starts over, /exit quits\n";
  std::string line;
  while (true) {
    if (tty) std::cerr << "> " << std::flush;
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    try {
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        history.clear();
        std::cerr << "(conversation reset)\n";
        continue;
      }
      if (line.rfind("/image ", 0) == 0) {
        pending_images.push_back(decode_image_file(line.substr(7)));
        std::cerr << "(image attached to the next message)\n";
        continue;
      }
      if (line.rfind("/video ", 0) == 0) {
        pending_videos.push_back(load_video_part(*as, a.video, line.substr(7)));
        std::cerr << "(video attached to the next message)\n";
        continue;
      }
      if (line.rfind("/audio ", 0) == 0) {
        pending_audio.push_back(decode_audio_file(line.substr(7)));
        std::cerr << "(audio attached to the next message: " << pending_audio.back().seconds()
                  << " s)\n";
        continue;
      }
      if (line.rfind("/system ", 0) == 0) {
        history.erase(std::remove_if(history.begin(), history.end(),
                                     [](const ChatInput& m) { return m.role == "system"; }),
                      history.end());
        history.insert(history.begin(), {"system", {{line.substr(8), std::nullopt}}});
        continue;
      }
      ChatInput user{"user", {}};
      for (RgbImage& img : pending_images) user.parts.push_back({"", std::move(img)});
      pending_images.clear();
      for (ChatInputPart& v : pending_videos) user.parts.push_back(std::move(v));
      pending_videos.clear();
      for (AudioClip& clip : pending_audio)
        user.parts.push_back({"", std::nullopt, std::move(clip)});
      pending_audio.clear();
      user.parts.push_back({line, std::nullopt});
      history.push_back(std::move(user));
      const PreparedPrompt p = as->prepare_chat(pool, history, {true, a.think});
      EngineRequest request;
      request.ids = p.ids;
      request.soft_tokens = p.soft_tokens;
      request.gen = opt;
      const GenerationResult r = run_request(engine, std::move(request), &std::cout);
      std::cout << "\n" << std::flush;
      print_stats(r);
      history.push_back({"model", {{strip_thinking(r.text), std::nullopt}}});
    } catch (const Error& e) {
      std::cerr << "error: " << e.what() << "\n";
      if (!history.empty() && history.back().role == "user") history.pop_back();
    }
  }
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<GenerateArgs>();
  auto* sub = app.add_subcommand("generate", "Generate a reply to one prompt, streamed to stdout");
  add_common(sub, *a);
  sub->add_option("-p,--prompt", a->prompt, "the user message (or the whole text with --raw)")
      ->required();
  sub->add_option("--system", a->system, "system prompt");
  sub->add_option("--image", a->images,
                  "image file (PNG/JPEG) placed before the prompt text (repeatable)");
  sub->add_option("--video", a->videos,
                  "video file (MP4/MOV, WebM/MKV, GIF) placed before the prompt text, after any "
                  "images; frames sampled as --video-frames says (repeatable)");
  add_video_options(sub, a->video);
  sub->add_option("--audio", a->audios,
                  "audio file (WAV, FLAC, OGG, MP3; at most 30 s) placed before the prompt text, "
                  "after any images and videos (repeatable)");
  sub->add_flag("--raw", a->raw, "no chat format: <bos> + the prompt text");
  sub->add_flag("--json", a->json,
                "print one JSON object (text, tokens, finish_reason, usage) instead of streaming");
  sub->add_option("-j,--json-schema", a->json_schema,
                  "constrain the output to one JSON value of this JSON schema ('{}': any JSON "
                  "object), enforced while sampling");
  sub->add_option("--json-schema-file", a->json_schema_file,
                  "the same, with the schema read from a file");
  sub->add_option("--model-draft", a->model_draft,
                  "speculative decoding with this gemma4_assistant (MTP) drafter (also -md): a "
                  "checkpoint, or a bundle whose drafter stage (export -md) to use");
  sub->add_option("--draft-max", a->draft_max, "drafts per round at most (default 4)")
      ->check(CLI::Range(1, 64));
  sub->add_option("--draft-min", a->draft_min,
                  "draft only when at least this many drafts fit (default 0)")
      ->check(CLI::Range(0, 64));
  sub->add_flag("--no-bundle-drafter", a->no_bundle_drafter,
                "decode without the bundle's drafter stage (export -md) even when it has one");
  sub->add_flag("--no-draft-adapt", a->no_draft_adapt,
                "keep the draft length fixed (default: adapt it to the acceptance and stop "
                "drafting while it does not pay)");
  reg.add(sub, [a, &cx = reg.context] { return run_generate(*a, cx); });
}

void add_chat_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<ChatArgs>();
  auto* sub = app.add_subcommand(
      "chat", "Interactive multi-turn chat that keeps the KV cache between turns");
  add_common(sub, *a);
  sub->add_option("--audio", a->audios,
                  "audio file attached to the first message (as /audio FILE; repeatable)");
  sub->add_option("--video", a->videos,
                  "video file attached to the first message (as /video FILE; repeatable)");
  add_video_options(sub, a->video);
  reg.add(sub, [a, &cx = reg.context] { return run_chat(*a, cx); });
}

}  // namespace gemstage::cli
