// Constrained decoding: generated text that is always one JSON value of a given JSON schema (or
// any JSON object), enforced while sampling. A schema compiles once to a tree of nodes; a
// JsonMatcher walks text against it a byte at a time with a small fixed-size stack, so copying one
// to try a token is cheap; a TokenConstraint masks the vocabulary with it at each step.
//
// What a schema may say: `type` (one or a list), `enum` / `const`, `properties` / `required` /
// `additionalProperties`, `items` / `minItems` / `maxItems`, `minLength` / `maxLength`,
// `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` on integers, `anyOf` / `oneOf`
// whose branches have different types, `nullable`, and local `$ref`s into `$defs` /
// `definitions`. Anything else that would constrain the value (`pattern`, `allOf`, bounds on
// non-integer numbers, `multipleOf`, ...) is refused with its place in the schema named, rather
// than ignored, so a client never gets output its schema rejects. Annotations (`description`,
// `title`, `default`, `examples`, `format`, which JSON Schema treats as an annotation) are
// ignored.
//
// Generated objects hold declared properties only, each at most once and every required one (in
// any order: a parsed JSON request keeps no key order), so the output validates whatever
// `additionalProperties` says; whitespace between
// tokens is bounded (kMaxWhitespaceRun) so a model cannot ramble in it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace gemstage {

struct JsonSchemaNode;

// The text a grammar matches: JSON, or the arguments of a Gemma 4 tool call
// (docs/gemma4-tools.md, "ARGS grammar": bare keys, strings between <|"|> tokens with
// no escaping, otherwise JSON's values). The <|"|> token is the byte kGemmaQuote to a matcher.
enum class JsonDialect { kJson, kGemmaArgs };
inline constexpr unsigned char kGemmaQuote = 0x00;
inline constexpr unsigned char kToolCallOpen = 0x01;   // <|tool_call>
inline constexpr unsigned char kToolCallClose = 0x02;  // <tool_call|>
inline constexpr unsigned char kChannelOpen = 0x03;    // <|channel>
inline constexpr unsigned char kChannelClose = 0x04;   // <channel|>

class JsonGrammar {
 public:
  // Any JSON object (OpenAI's response_format {"type": "json_object"}).
  static std::shared_ptr<const JsonGrammar> any_object(JsonDialect dialect = JsonDialect::kJson);
  // Throws gemstage::Error naming the place in the schema ("#/properties/age/minimum: ...").
  static std::shared_ptr<const JsonGrammar> from_schema(const nlohmann::json& schema,
                                                        JsonDialect dialect = JsonDialect::kJson);
  const JsonSchemaNode* root() const { return root_; }
  JsonDialect dialect() const { return dialect_; }
  ~JsonGrammar();

 private:
  JsonGrammar();
  friend struct JsonSchemaCompiler;
  std::vector<std::unique_ptr<JsonSchemaNode>> nodes_;
  const JsonSchemaNode* root_ = nullptr;
  JsonDialect dialect_ = JsonDialect::kJson;
};

inline constexpr int kMaxWhitespaceRun = 12;  // spaces, tabs and newlines in a row
inline constexpr int kMaxJsonDepth = 32;      // nesting of generated arrays and objects

// One value being matched. A copy is a snapshot (the stack is inline and only its used part is
// copied), which is how a token is tried without committing to it. The grammar must outlive it.
class JsonMatcher {
 public:
  explicit JsonMatcher(const JsonGrammar& grammar);
  JsonMatcher(const JsonMatcher& o) { *this = o; }
  JsonMatcher& operator=(const JsonMatcher& o) {
    gemma_ = o.gemma_;
    depth_ = o.depth_;
    root_done_ = o.root_done_;
    std::copy(o.stack_.begin(), o.stack_.begin() + depth_, stack_.begin());
    return *this;
  }
  // Consumes the bytes if they can continue a valid value; otherwise returns false, leaving the
  // matcher in an unspecified state (try on a copy).
  bool feed(std::string_view bytes);
  bool feed_byte(unsigned char c);
  // A whole value has been matched (the text may stop here).
  bool complete() const;
  // Nothing more may follow (the value is closed).
  bool closed() const { return depth_ == 0; }

  struct Frame {
    const JsonSchemaNode* node;
    uint8_t kind, stage, ws, esc;
    uint8_t utf8_need;  // string: UTF-8 continuation bytes due; number: exponent digits
    uint8_t utf8_lo, utf8_hi, negative;
    uint32_t pos;    // bytes matched of a key or literal; number: fraction digits
    uint32_t count;  // array items, string characters, integer digits
    uint64_t cand;   // key / literal candidates still matching; object: properties written
    uint64_t value;  // integer magnitude so far
  };

 private:
  enum class Step { kConsumed, kRejected, kPass };
  Step step(Frame& f, unsigned char c);
  bool push_value(const JsonSchemaNode* node);
  void child_done();
  bool start_value(Frame& f, unsigned char c);

  std::array<Frame, kMaxJsonDepth + 2> stack_;
  bool gemma_ = false;  // JsonDialect::kGemmaArgs
  int depth_ = 0;
  bool root_done_ = false;
};

// The tool calls a request forces (tool_choice "required" or a named function), as Gemma 4 writes
// them: <|tool_call>call:NAME{ARGS}<tool_call|>, with ARGS matched against that tool's
// `parameters` schema in the Gemma dialect; then more calls when parallel calls are allowed, then
// a stop id. With thinking on, a thought channel (<|channel>...<channel|>, free text) may come
// first, at most max_thought_tokens tokens long; then the call.
struct ToolCallGrammar {
  // kNone: the call comes first. kMayOpen: the model may open a thought channel first. kOpen: the
  // prompt already opened one (its generation prefix), so the text starts inside it.
  enum class Thought { kNone, kMayOpen, kOpen };
  std::vector<std::string> names;
  std::vector<std::shared_ptr<const JsonGrammar>> arguments;  // per name
  bool parallel = true;
  Thought thought = Thought::kNone;
  // Tokens a thought may take before only <channel|> is allowed, so room is left for the call.
  int64_t max_thought_tokens = 0;
  // tools: OpenAI function tools ([{"type": "function", "function": {"name", "parameters"}}]);
  // only_name: the one tool a named tool_choice allows ("" for any). Throws gemstage::Error
  // naming the tool whose parameters cannot be enforced.
  static std::shared_ptr<const ToolCallGrammar> from_tools(const nlohmann::ordered_json& tools,
                                                           const std::string& only_name,
                                                           bool parallel,
                                                           Thought thought = Thought::kNone,
                                                           int64_t max_thought_tokens = 0);
};

class ToolCallMatcher {
 public:
  explicit ToolCallMatcher(const ToolCallGrammar& grammar)
      : g_(&grammar),
        phase_(grammar.thought == ToolCallGrammar::Thought::kMayOpen ? kThoughtMay
               : grammar.thought == ToolCallGrammar::Thought::kOpen  ? kThought
                                                                     : kOpen) {}
  bool feed(std::string_view symbols);
  bool feed_byte(unsigned char c);
  // Between calls, with at least one closed: a stop id may come.
  bool complete() const { return phase_ == kAfter; }
  // Inside the thought channel (free text until <channel|>).
  bool in_thought() const { return phase_ == kThought; }

 private:
  enum Phase : uint8_t { kThoughtMay, kThought, kOpen, kName, kArgs, kClose, kAfter };
  const ToolCallGrammar* g_;
  Phase phase_ = kOpen;
  uint64_t cand_ = 0;  // names still matching "call:NAME"
  uint32_t pos_ = 0;
  std::optional<JsonMatcher> args_;
};

// Each token's bytes, bucketed by first byte, built once per tokenizer and shared.
class ConstraintVocabulary {
 public:
  static std::shared_ptr<const ConstraintVocabulary> of(const Tokenizer& tokenizer);
  explicit ConstraintVocabulary(const Tokenizer& tokenizer);
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  const std::vector<int32_t>& starting_with(unsigned char c) const { return by_first_[c]; }

 private:
  std::vector<std::string> bytes_;  // empty for special and unnamed ids: never allowed
  std::array<std::vector<int32_t>, 256> by_first_;
};

// The grammar over token ids: which ids may come next, and the state after one is taken. Stop
// ids (end of turn) are allowed exactly when the value is complete, and then only they are
// allowed once it is closed.
class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const JsonGrammar> grammar,
                  std::shared_ptr<const ConstraintVocabulary> vocabulary,
                  std::vector<int32_t> stop_ids);
  TokenConstraint(std::shared_ptr<const ToolCallGrammar> grammar,
                  std::shared_ptr<const ConstraintVocabulary> vocabulary,
                  std::vector<int32_t> stop_ids);
  bool allows(int32_t id) const;
  // Sets the logits of every id not allowed to -infinity; returns how many are allowed.
  int64_t mask(float* logits, int64_t vocab) const;
  // Takes an allowed id (throws on one that is not).
  void accept(int32_t id);
  bool complete() const { return state_.complete(); }

 private:
  // The matcher of either grammar; copied to try a token.
  struct State {
    std::optional<JsonMatcher> json;
    std::optional<ToolCallMatcher> call;
    bool feed(std::string_view bytes) { return json ? json->feed(bytes) : call->feed(bytes); }
    bool complete() const { return json ? json->complete() : call->complete(); }
  };
  bool is_stop(int32_t id) const;
  // A thought that used its max_thought_tokens: only <channel|> may come.
  bool thought_spent() const;
  std::shared_ptr<const JsonGrammar> json_grammar_;
  std::shared_ptr<const ToolCallGrammar> call_grammar_;
  std::shared_ptr<const ConstraintVocabulary> vocab_;
  std::vector<int32_t> stop_ids_;
  State state_;
  int64_t thought_tokens_ = 0;
};

}  // namespace gemstage
