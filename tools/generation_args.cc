#include "tools/generation_args.h"

#include <unistd.h>

#include <limits>

#include "tools/cli_common.h"

namespace gemstage::cli {

void add_video_options(CLI::App* sub, VideoArgs& a) {
  sub->add_option("--video-frames", a.frames,
                  "frames sampled uniformly from each video (default: the model's, 32)")
      ->check(CLI::Range(1, 1024));
  sub->add_option("--video-budget", a.budget,
                  "soft tokens per video frame: 70, 140, 280, 560 or 1120 (default: the "
                  "model's, 70)")
      ->check(CLI::IsMember({70, 140, 280, 560, 1120}));
}

void add_common(CLI::App* sub, CommonArgs& a) {
  sub->add_option("-m,--model", a.model, "Hugging Face checkpoint directory or gemstage bundle")
      ->required();
  sub->add_option("-n,--max-tokens", a.max_tokens,
                  "maximum tokens to generate (-1: until a stop or the context is full, as "
                  "llama.cpp's -n -1)")
      ->capture_default_str()
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  sub->add_option("--temp,--temperature", a.temperature, "sampling temperature (0: greedy)")
      ->capture_default_str();
  sub->add_option("--top-k", a.top_k, "top-k (0: off)")->capture_default_str();
  sub->add_option("--top-p", a.top_p, "top-p / nucleus (1: off)")->capture_default_str();
  sub->add_option("--min-p", a.min_p, "min-p (0: off)")->capture_default_str();
  sub->add_option("--repeat-penalty", a.repeat_penalty, "repetition penalty (1: off)")
      ->capture_default_str();
  sub->add_option("--repeat-last-n", a.repeat_last_n,
                  "tokens the repetition penalty looks back over")
      ->capture_default_str();
  sub->add_option("-s,--seed", a.seed, "random seed (default: a fresh one each run)")
      ->each([&a](const std::string&) { a.seed_given = true; });
  sub->add_option("--stop", a.stop, "stop string (repeatable)");
  sub->add_option(
      "-c,--ctx-size", a.ctx,
      "context size in tokens (default: the model's or bundle's maximum; caches grow as used)");
  add_cache_type(sub, a.cache_type);
  sub->add_option("-b,--chunk", a.chunk, "prefill chunk size")->capture_default_str();
  sub->add_option("-t,--threads", a.threads, "worker threads (default: all cores)");
  sub->add_flag("--ignore-eos", a.ignore_eos, "do not stop on the model's end-of-turn / EOS ids");
  sub->add_flag("--think", a.think,
                "enable the model's thinking mode (<|think|> in the system turn)");
  sub->add_flag("-v,--verbose", a.verbose, "list unused config fields and tensors");
}

GenerationOptions generation_defaults(const CommonArgs& a) {
  GenerationOptions o;
  // -1: no limit of its own; the context (and stop tokens) end the generation.
  o.max_tokens = a.max_tokens < 0 ? std::numeric_limits<int>::max() : a.max_tokens;
  o.sampling.temperature = a.temperature;
  o.sampling.top_k = a.top_k;
  o.sampling.top_p = a.top_p;
  o.sampling.min_p = a.min_p;
  o.sampling.repetition_penalty = a.repeat_penalty;
  o.sampling.repeat_last_n = a.repeat_last_n;
  o.sampling.seed = a.seed_given ? a.seed : 0;
  o.stop_strings = a.stop;
  o.chunk = a.chunk;
  return o;
}

GenerationOptions generation_options(const CommonArgs& a, const Assistant& as) {
  GenerationOptions o = generation_defaults(a);
  if (!a.seed_given)
    o.sampling.seed =
        static_cast<uint64_t>(now_seconds() * 1e6) ^ static_cast<uint64_t>(::getpid());
  if (!a.ignore_eos) o.stop_ids = as.stop_ids();
  o.sampling.suppress_tokens = as.suppress_tokens();
  return o;
}

}  // namespace gemstage::cli
