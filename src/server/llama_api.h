// llama-server's own wire format (llama.cpp's tools/server README), for the endpoints clients of
// llama-server call besides the OpenAI ones: the native /completion reply and stream, its
// `timings`, /tokenize's pieces and the completion_probabilities list. Plain JSON, no sockets.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "runtime/engine.h"
#include "runtime/generation.h"
#include "tokenizer/tokenizer.h"

namespace gemstage::server {

// `timings` of one finished request: cache_n (prompt tokens reused from a slot's caches),
// prompt_n / prompt_ms (the prompt tokens actually prefilled and how long that took),
// predicted_n / predicted_ms (generated tokens and the time from the first to the last), each
// with its per-token milliseconds and per-second rate (0 when no time was measured).
nlohmann::json timings_json(const Generation::Result& r, int64_t predicted_tokens);

// llama-server's stop_type: "eos" (a stop id), "word" (a stop string), "limit" (n_predict or the
// context), "none" (not stopped).
std::string llama_stop_type(const std::string& finish_reason, const std::string& stop_string);

// A token as /tokenize's with_pieces shows it: the piece as a string when its bytes are valid
// UTF-8, else the list of its bytes.
nlohmann::json token_piece_json(const Tokenizer& tokenizer, int32_t id);

// completion_probabilities: [{"id", "token", "logprob", "bytes", "top_logprobs": [{"id", "token",
// "logprob", "bytes"}]}], one entry per generated token.
nlohmann::json completion_probabilities_json(const Tokenizer& tokenizer,
                                             std::span<const TokenLogprob> tokens);

}  // namespace gemstage::server
