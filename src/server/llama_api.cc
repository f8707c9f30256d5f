#include "server/llama_api.h"

#include "server/api.h"
#include "tokenizer/utf8.h"

namespace gemstage::server {

using json = nlohmann::json;

json timings_json(const Generation::Result& r, int64_t predicted_tokens) {
  const int64_t prompt_n = std::max<int64_t>(0, r.prompt_tokens - r.cached_tokens);
  const double prompt_ms = r.prefill_seconds * 1e3, predicted_ms = r.decode_seconds * 1e3;
  auto per_token = [](double ms, int64_t n) { return n > 0 ? ms / static_cast<double>(n) : 0.0; };
  auto per_second = [](double ms, int64_t n) {
    return ms > 0 ? 1e3 * static_cast<double>(n) / ms : 0.0;
  };
  // The decode phase runs from the first token to the last: the steps in it produced the tokens
  // after the first, so the rate counts those (and is 0 for a one-token reply), as llama.cpp's.
  const int64_t decoded = std::max<int64_t>(0, predicted_tokens - 1);
  return {{"cache_n", r.cached_tokens},
          {"prompt_n", prompt_n},
          {"prompt_ms", prompt_ms},
          {"prompt_per_token_ms", per_token(prompt_ms, prompt_n)},
          {"prompt_per_second", per_second(prompt_ms, prompt_n)},
          {"predicted_n", predicted_tokens},
          {"predicted_ms", predicted_ms},
          {"predicted_per_token_ms", per_token(predicted_ms, decoded)},
          {"predicted_per_second", decoded > 0 ? per_second(predicted_ms, decoded) : 0.0}};
}

std::string llama_stop_type(const std::string& finish_reason, const std::string& stop_string) {
  if (finish_reason == "stop") return stop_string.empty() ? "eos" : "word";
  if (finish_reason == "length" || finish_reason == "context") return "limit";
  return "none";
}

json token_piece_json(const Tokenizer& tokenizer, int32_t id) {
  const std::string bytes = tokenizer.has_id(id) ? tokenizer.token_bytes(id) : std::string();
  if (utf8::find_invalid(bytes) == std::string::npos) return bytes;
  json list = json::array();
  for (unsigned char b : bytes) list.push_back(b);
  return list;
}

json completion_probabilities_json(const Tokenizer& tokenizer,
                                   std::span<const TokenLogprob> tokens) {
  // logprobs_json's entries with each token's id added, as llama-server lists them.
  json content = std::move(logprobs_json(tokenizer, tokens)["content"]);
  for (size_t i = 0; i < tokens.size(); ++i) {
    content[i]["id"] = tokens[i].id;
    for (size_t k = 0; k < tokens[i].top.size(); ++k)
      content[i]["top_logprobs"][k]["id"] = tokens[i].top[k].first;
  }
  return content;
}

}  // namespace gemstage::server
