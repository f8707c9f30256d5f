// llama-server's own endpoints, as its clients (Open WebUI, SillyTavern, Continue, the llama.cpp
// web UI, scripts) call them; field names follow llama.cpp's tools/server README. What stays out
// on purpose is listed in docs/server.md ("llama-server compatibility").
#include <fstream>
#include <limits>
#include <sstream>

#include "server/llama_api.h"
#include "server/server_impl.h"

namespace gemstage::server {

namespace {

using json = nlohmann::json;
using httplib::Request;
using httplib::Response;

bool optional_bool(const json& body, const char* key, bool fallback) {
  const json* v = member(body, key);
  if (!v) return fallback;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

// The chat template's text as /props reports it: chat_template.jinja, or tokenizer_config.json's
// "chat_template" string; empty for the built-in renderer.
std::string chat_template_text(const ConversationRenderer& r) {
  const std::string& src = r.source();
  std::ifstream in(src, std::ios::binary);
  if (!in) return {};
  std::stringstream ss;
  ss << in.rdbuf();
  if (src.size() >= 6 && src.compare(src.size() - 6, 6, ".jinja") == 0) return ss.str();
  try {
    const json cfg = json::parse(ss.str());
    if (const json* t = member(cfg, "chat_template"); t && t->is_string())
      return t->get<std::string>();
  } catch (const std::exception&) {
  }
  return {};
}

}  // namespace

// Answered only once the model is loaded (the API routes wait for it).
std::string Server::Impl::models_reply() const {
  const ModelConfig& cfg = assistant->model().config();
  const bool multimodal =
      cfg.vision.has_value() || cfg.unified_vision.has_value() || cfg.takes_audio();
  return wire_json(models_json(model_name, created, multimodal));
}

json Server::Impl::generation_settings_json(const GenerationOptions& g) const {
  const SamplingParams& s = g.sampling;
  return {{"n_predict", g.max_tokens == std::numeric_limits<int>::max() ? -1 : g.max_tokens},
          {"max_tokens", g.max_tokens},
          {"seed", s.seed},
          {"temperature", s.temperature},
          {"top_k", s.top_k},
          {"top_p", s.top_p},
          {"min_p", s.min_p},
          {"repeat_last_n", s.repeat_last_n},
          {"repeat_penalty", s.repetition_penalty},
          {"stop", g.stop_strings},
          {"ignore_eos", g.stop_ids.empty()},
          {"n_probs", std::max(0, g.top_logprobs)},
          {"samplers", json::array({"penalties", "temperature", "top_k", "top_p", "min_p"})},
          {"speculative.n_max", engine->drafting() ? opt.draft_max : 0},
          {"speculative.n_min", engine->drafting() ? opt.draft_min : 0}};
}

json Server::Impl::native_completion_json(const Job& job, const Generation::Result& r,
                                          const std::string& content, bool stream) const {
  const GenerationResult& g = r.generation;
  const auto predicted = static_cast<int64_t>(g.tokens.size());
  json settings = generation_settings_json(job.gen);
  settings["n_ctx"] = engine->max_context();
  settings["model"] = model_name;
  settings["stream"] = stream;
  json out = {
      {"index", 0},
      {"content", content},
      {"tokens", job.return_tokens && !stream ? json(g.tokens) : json::array()},
      {"id_slot", r.slot},
      {"stop", true},
      {"model", model_name},
      {"tokens_predicted", predicted},
      {"tokens_evaluated", r.prompt_tokens},
      {"generation_settings", std::move(settings)},
      {"prompt", job.prompt_ids ? assistant->tokenizer().decode(*job.prompt_ids) : job.prompt_text},
      {"has_new_line", g.text.find('\n') != std::string::npos},
      {"truncated", g.finish_reason == "context"},
      {"stop_type", llama_stop_type(g.finish_reason, g.stop_string)},
      {"stopping_word", g.stop_string},
      {"tokens_cached", r.cached_tokens},
      {"timings", timings_json(r, predicted)}};
  if (!stream && job.n_probs > 0)
    out["completion_probabilities"] =
        completion_probabilities_json(assistant->tokenizer(), g.logprobs);
  return out;
}

void Server::Impl::answer(const Request& req, Response& res, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    set_error(req, res, e);
  } catch (const Error& e) {
    set_error(req, res, ApiError(400, e.what()));
  } catch (const std::bad_alloc&) {
    set_error(req, res,
              ApiError(503, "out of memory while serving this request", "server_error", {},
                       "out_of_memory"));
  }
}

std::string Server::Impl::llama_metrics_text() {
  const Engine::Stats st = engine->stats();
  double prompt_s = 0, decode_s = 0;
  {
    std::lock_guard<std::mutex> lk(timing_mu);
    prompt_s = prompt_seconds_total;
    decode_s = decode_seconds_total;
  }
  const double prefilled = static_cast<double>(st.prompt_tokens - st.cached_tokens);
  const auto generated = static_cast<double>(st.generated_tokens);
  int64_t steps = 0;
  for (int64_t c : st.step_counts) steps += c;
  std::ostringstream out;
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    out << "# HELP llamacpp:" << name << " " << help << "\n# TYPE llamacpp:" << name << " " << type
        << "\nllamacpp:" << name << " " << v << "\n";
  };
  metric("prompt_tokens_total", "counter", "Number of prompt tokens processed.", prefilled);
  metric("prompt_seconds_total", "counter", "Prompt process time in seconds.", prompt_s);
  metric("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         prompt_s > 0 ? prefilled / prompt_s : 0);
  metric("tokens_predicted_total", "counter", "Number of generation tokens processed.", generated);
  metric("tokens_predicted_seconds_total", "counter", "Predict process time in seconds.", decode_s);
  metric("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         decode_s > 0 ? generated / decode_s : 0);
  metric("requests_processing", "gauge", "Number of requests processing.", st.busy);
  metric("requests_deferred", "gauge", "Number of requests deferred.", st.queued);
  metric("n_decode_total", "counter", "Total number of batched steps run.",
         static_cast<double>(steps));
  metric("spec_decode_num_draft_tokens_total", "counter", "Total draft tokens generated.",
         static_cast<double>(st.drafted));
  metric("spec_decode_num_accepted_tokens_total", "counter",
         "Total draft tokens accepted by the target model.",
         static_cast<double>(st.draft_accepted));
  metric("spec_decode_num_drafts_total", "counter", "Total speculative verification steps.",
         static_cast<double>(st.draft_rounds));
  return out.str();
}

void Server::Impl::record_finished(const Generation::Result& r) {
  std::lock_guard<std::mutex> lk(timing_mu);
  prompt_seconds_total += r.prefill_seconds;
  decode_seconds_total += r.decode_seconds;
}

void Server::Impl::setup_llama_routes() {
  // POST /tokenize {"content", "add_special" (false), "parse_special" (true), "with_pieces"
  // (false)} -> {"tokens": [ids]} or [{"id", "piece"}].
  http.Post("/tokenize", [this](const Request& req, Response& res) {
    answer(req, res, [&] {
      const json body = parse_json_body(req.body);
      const std::string content = required_string(body, "content", "content");
      const bool add_special = optional_bool(body, "add_special", false);
      const bool parse_special = optional_bool(body, "parse_special", true);
      const bool with_pieces = optional_bool(body, "with_pieces", false);
      const Tokenizer& tok = assistant->tokenizer();
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(content, add_special, parse_special);
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "invalid_request_error", "content", "invalid_value");
      }
      json tokens = json::array();
      for (int32_t id : ids)
        tokens.push_back(with_pieces ? json{{"id", id}, {"piece", token_piece_json(tok, id)}}
                                     : json(id));
      res.set_content(wire_json({{"tokens", std::move(tokens)}}), "application/json");
    });
  });
  // POST /detokenize {"tokens": [ids]} -> {"content"}.
  http.Post("/detokenize", [this](const Request& req, Response& res) {
    answer(req, res, [&] {
      const json body = parse_json_body(req.body);
      const Tokenizer& tok = assistant->tokenizer();
      std::vector<int32_t> ids;
      if (const json* t = member(body, "tokens")) {
        if (!t->is_array()) wrong_type("tokens", "an array of token ids", *t);
        ids.reserve(t->size());
        for (size_t i = 0; i < t->size(); ++i) {
          const json& v = (*t)[i];
          const std::string param = "tokens[" + std::to_string(i) + "]";
          if (!v.is_number_integer()) wrong_type(param, "an integer", v);
          const int64_t id = v.get<int64_t>();
          if (id < 0 || id >= static_cast<int64_t>(tok.vocab_size()) ||
              !tok.has_id(static_cast<int32_t>(id)))
            bad_request(param, "invalid_value",
                        "'" + param + "' is " + std::to_string(id) +
                            ", not a token id of this vocabulary (0-" +
                            std::to_string(tok.vocab_size() - 1) + ")");
          ids.push_back(static_cast<int32_t>(id));
        }
      }
      res.set_content(wire_json({{"content", tok.decode(ids)}}), "application/json");
    });
  });
  // POST /apply-template {"messages", ["tools"]} -> {"prompt"}: the conversation as the chat
  // template renders it, ready for /completion.
  http.Post("/apply-template", [this](const Request& req, Response& res) {
    answer(req, res, [&] {
      const json body = parse_json_body(req.body);
      const ToolRequest t = parse_tool_request(body, opt.limits);
      ConversationOptions conv;
      conv.enable_thinking = t.enable_thinking.value_or(opt.think);
      conv.add_generation_prompt = t.add_generation_prompt;
      conv.continue_final_message = t.continue_final_message;
      std::string prompt;
      try {
        prompt = assistant->renderer().render(t.messages, t.tools, conv);
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "invalid_request_error", "messages", "invalid_value");
      }
      res.set_content(wire_json({{"prompt", prompt}}), "application/json");
    });
  });
  http.Get("/props", [this](const Request& req, Response& res) {
    answer(req, res, [&] {
      const ModelConfig& cfg = assistant->model().config();
      const Tokenizer& tok = assistant->tokenizer();
      auto token_text = [&](std::optional<int32_t> id) {
        return id && tok.has_id(*id) ? tok.id_to_token(*id) : std::string();
      };
      json slot = {{"id", 0},
                   {"id_task", -1},
                   {"n_ctx", engine->max_context()},
                   {"speculative", engine->drafting()},
                   {"is_processing", false},
                   {"params", generation_settings_json(defaults)},
                   {"prompt", ""}};
      const json j = {{"default_generation_settings", std::move(slot)},
                      {"total_slots", opt.parallel},
                      {"model_path", opt.model_path},
                      {"model_alias", model_name},
                      {"n_ctx", engine->max_context()},
                      {"chat_template", chat_template_text(assistant->renderer())},
                      {"chat_template_caps", json::object()},
                      {"modalities",
                       {{"vision", cfg.vision.has_value() || cfg.unified_vision.has_value()},
                        {"audio", cfg.takes_audio()}}},
                      {"bos_token", token_text(tok.bos_id())},
                      {"eos_token", token_text(tok.eos_id())},
                      {"build_info", "gemstage"},
                      {"is_sleeping", false}};
      res.set_content(wire_json(j), "application/json");
    });
  });
  // GET /slots (with --slots): each slot's state, read-only. ?fail_on_no_slot=1 answers 503 when
  // every slot is busy.
  http.Get("/slots", [this](const Request& req, Response& res) {
    answer(req, res, [&] {
      if (!opt.slots_endpoint)
        throw ApiError(501, "the /slots endpoint is off; start the server with --slots",
                       "not_supported_error", {}, "not_supported");
      const Engine::Stats st = engine->stats();
      if (req.get_param_value("fail_on_no_slot") == "1" && st.busy >= st.slots)
        throw ApiError(503, "no slot available", "unavailable_error", {}, "no_slot_available");
      json out = json::array();
      for (const Engine::SlotInfo& s : st.slot_info) {
        const bool busy = s.state != Engine::SlotState::kIdle;
        out.push_back({{"id", s.id},
                       {"id_task", -1},
                       {"n_ctx", engine->max_context()},
                       {"speculative", engine->drafting()},
                       {"is_processing", busy},
                       {"state", Engine::slot_state_name(s.state)},
                       {"n_tokens", s.rows},
                       {"params", generation_settings_json(defaults)},
                       {"next_token", json::array({{{"has_next_token", busy},
                                                    {"n_remain", s.remaining},
                                                    {"n_decoded", s.decoded}}})}});
      }
      res.set_content(wire_json(out), "application/json");
    });
  });
  // The native completion API, and the OpenAI routes without their /v1 (llama-server serves
  // /completions as its native API, as it does /completion).
  http.Post("/completion", generation_handler(Route::kNative));
  http.Post("/completions", generation_handler(Route::kNative));
  http.Post("/chat/completions", generation_handler(Route::kChat));
  http.Post("/chat/completions/input_tokens", generation_handler(Route::kChat));
  http.Get("/models", [this](const Request&, Response& res) {
    res.set_content(models_reply(), "application/json");
  });
  http.Post("/responses", generation_handler(Route::kResponses));
}

}  // namespace gemstage::server
