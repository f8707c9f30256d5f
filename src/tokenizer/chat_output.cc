#include "tokenizer/chat_output.h"

#include <charconv>
#include <cstdlib>

namespace gemstage {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kChannelOpen = "<|channel>";
constexpr std::string_view kChannelClose = "<channel|>";
constexpr std::string_view kCallOpen = "<|tool_call>";
constexpr std::string_view kCallClose = "<tool_call|>";
constexpr int kMaxDepth = 128;

bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

std::string_view trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && is_ws(s[b])) ++b;
  while (e > b && is_ws(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// Recursive-descent parser of one call's arguments. kIncomplete: the text ended before the call
// could be judged (only matters while streaming).
enum class Status { kOk, kMalformed, kIncomplete };

class CallParser {
 public:
  CallParser(std::string_view s, size_t pos) : s_(s), p_(pos) {}
  size_t pos() const { return p_; }

  Status call(ParsedToolCall& out) {
    if (!literal("call:")) return fail_or_incomplete();
    const size_t name_start = p_;
    while (p_ < s_.size() && s_[p_] != '{' && s_[p_] != '<' && s_[p_] != '>' && !is_ws(s_[p_]))
      ++p_;
    if (p_ >= s_.size()) return Status::kIncomplete;
    if (p_ == name_start || s_[p_] != '{') return Status::kMalformed;
    out.name = std::string(s_.substr(name_start, p_ - name_start));
    if (const Status st = object(out.arguments, 0); st != Status::kOk) return st;
    if (s_.size() - p_ < kCallClose.size() && kCallClose.substr(0, s_.size() - p_) == s_.substr(p_))
      return Status::kIncomplete;
    if (s_.compare(p_, kCallClose.size(), kCallClose) != 0) return Status::kMalformed;
    p_ += kCallClose.size();
    return Status::kOk;
  }

 private:
  // The text ends inside what could still be `want`: incomplete; otherwise malformed.
  Status fail_or_incomplete() const {
    return incomplete_ ? Status::kIncomplete : Status::kMalformed;
  }

  bool literal(std::string_view want) {
    if (s_.compare(p_, want.size(), want) == 0) {
      p_ += want.size();
      return true;
    }
    if (s_.size() - p_ < want.size() && want.substr(0, s_.size() - p_) == s_.substr(p_))
      incomplete_ = true;
    return false;
  }
  void ws() {
    while (p_ < s_.size() && is_ws(s_[p_])) ++p_;
  }
  bool at_end() const { return p_ >= s_.size(); }

  Status object(ojson& out, int depth) {
    if (depth > kMaxDepth) return Status::kMalformed;
    out = ojson::object();
    if (at_end()) return Status::kIncomplete;
    if (s_[p_] != '{') return Status::kMalformed;
    ++p_;
    ws();
    if (at_end()) return Status::kIncomplete;
    if (s_[p_] == '}') {
      ++p_;
      return Status::kOk;
    }
    while (true) {
      // KEY: 1+ chars, none of : { } [ ] , and no "<|"; trimmed.
      const size_t key_start = p_;
      while (p_ < s_.size() && std::string_view(":{}[],").find(s_[p_]) == std::string_view::npos &&
             s_.compare(p_, 2, "<|") != 0)
        ++p_;
      if (at_end()) return Status::kIncomplete;
      const std::string_view key = trim(s_.substr(key_start, p_ - key_start));
      if (key.empty() || s_[p_] != ':') return Status::kMalformed;
      ++p_;
      ws();
      ojson v;
      if (const Status st = value(v, depth + 1); st != Status::kOk) return st;
      out[std::string(key)] = std::move(v);
      ws();
      if (at_end()) return Status::kIncomplete;
      if (s_[p_] == '}') {
        ++p_;
        return Status::kOk;
      }
      if (s_[p_] != ',') return Status::kMalformed;
      ++p_;
      ws();
      if (at_end()) return Status::kIncomplete;
      if (s_[p_] == '}') return Status::kMalformed;  // trailing comma
    }
  }

  Status value(ojson& out, int depth) {
    if (depth > kMaxDepth) return Status::kMalformed;
    if (at_end()) return Status::kIncomplete;
    if (s_.compare(p_, kToolStringQuote.size(), kToolStringQuote) == 0) {
      const size_t start = p_ + kToolStringQuote.size();
      const size_t end = s_.find(kToolStringQuote, start);
      if (end == std::string_view::npos) return Status::kIncomplete;
      out = std::string(s_.substr(start, end - start));
      p_ = end + kToolStringQuote.size();
      return Status::kOk;
    }
    if (s_.size() - p_ < kToolStringQuote.size() &&
        kToolStringQuote.substr(0, s_.size() - p_) == s_.substr(p_))
      return Status::kIncomplete;
    const char c = s_[p_];
    if (c == '{') return object(out, depth);
    if (c == '[') {
      ++p_;
      out = ojson::array();
      ws();
      if (at_end()) return Status::kIncomplete;
      if (s_[p_] == ']') {
        ++p_;
        return Status::kOk;
      }
      while (true) {
        ojson v;
        if (const Status st = value(v, depth + 1); st != Status::kOk) return st;
        out.push_back(std::move(v));
        ws();
        if (at_end()) return Status::kIncomplete;
        if (s_[p_] == ']') {
          ++p_;
          return Status::kOk;
        }
        if (s_[p_] != ',') return Status::kMalformed;
        ++p_;
        ws();
        if (at_end()) return Status::kIncomplete;
        if (s_[p_] == ']') return Status::kMalformed;
      }
    }
    // true / false / null / a JSON number, ending at ws , } ]
    size_t e = p_;
    while (e < s_.size() && !is_ws(s_[e]) && s_[e] != ',' && s_[e] != '}' && s_[e] != ']') ++e;
    if (e >= s_.size()) return Status::kIncomplete;
    const std::string_view tok = s_.substr(p_, e - p_);
    if (tok == "true" || tok == "false") {
      out = tok == "true";
    } else if (tok == "null") {
      out = nullptr;
    } else if (!number(tok, out)) {
      return Status::kMalformed;
    }
    p_ = e;
    return Status::kOk;
  }

  static bool number(std::string_view t, ojson& out) {
    // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    size_t k = 0;
    if (k < t.size() && t[k] == '-') ++k;
    if (k >= t.size() || !std::isdigit(static_cast<unsigned char>(t[k]))) return false;
    if (t[k] == '0') {
      ++k;
    } else {
      while (k < t.size() && std::isdigit(static_cast<unsigned char>(t[k]))) ++k;
    }
    bool is_int = true;
    if (k < t.size() && t[k] == '.') {
      is_int = false;
      ++k;
      if (k >= t.size() || !std::isdigit(static_cast<unsigned char>(t[k]))) return false;
      while (k < t.size() && std::isdigit(static_cast<unsigned char>(t[k]))) ++k;
    }
    if (k < t.size() && (t[k] == 'e' || t[k] == 'E')) {
      is_int = false;
      ++k;
      if (k < t.size() && (t[k] == '+' || t[k] == '-')) ++k;
      if (k >= t.size() || !std::isdigit(static_cast<unsigned char>(t[k]))) return false;
      while (k < t.size() && std::isdigit(static_cast<unsigned char>(t[k]))) ++k;
    }
    if (k != t.size()) return false;
    if (is_int) {
      // An integer stays one (as Python's json.loads keeps it) wherever JSON's 64-bit integers
      // reach: int64, and uint64 above that. Only past uint64 does it become a float.
      int64_t v = 0;
      if (std::from_chars(t.data(), t.data() + t.size(), v).ec == std::errc()) {
        out = v;
        return true;
      }
      uint64_t u = 0;
      if (t[0] != '-' && std::from_chars(t.data(), t.data() + t.size(), u).ec == std::errc()) {
        out = u;
        return true;
      }
    }
    const std::string copy(t);
    out = std::strtod(copy.c_str(), nullptr);
    return true;
  }

  std::string_view s_;
  size_t p_;
  bool incomplete_ = false;
};

// Length of the longest suffix of `s` that is a proper prefix of one of the markers: text that
// may still become a marker.
size_t partial_marker_suffix(std::string_view s) {
  size_t best = 0;
  for (std::string_view m : {kChannelOpen, kChannelClose, kCallOpen}) {
    for (size_t n = std::min(m.size() - 1, s.size()); n > best; --n)
      if (s.substr(s.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
  }
  return best;
}

std::string_view thought_body(std::string_view block, bool partial, bool& hold) {
  hold = false;
  constexpr std::string_view kThought = "thought";
  if (block.substr(0, kThought.size()) == kThought) {
    if (block.size() == kThought.size()) {
      hold = partial;  // "thought" then maybe its "\n"
      return {};
    }
    if (block[kThought.size()] == '\n') return block.substr(kThought.size() + 1);
  } else if (partial && kThought.substr(0, block.size()) == block) {
    hold = true;
    return {};
  }
  return block;
}

ParsedOutput parse(std::string_view text, bool partial) {
  ParsedOutput out;
  std::string content;
  std::vector<std::string> reasoning;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t next = std::string_view::npos;
    std::string_view marker;
    for (std::string_view m : {kChannelOpen, kChannelClose, kCallOpen}) {
      const size_t f = text.find(m, pos);
      if (f < next) {
        next = f;
        marker = m;
      }
    }
    if (next == std::string_view::npos) {
      std::string_view rest = text.substr(pos);
      if (partial) rest.remove_suffix(partial_marker_suffix(rest));
      content.append(rest);
      break;
    }
    content.append(text.substr(pos, next - pos));
    if (marker == kChannelClose) {  // stray close outside a thought
      pos = next + marker.size();
      continue;
    }
    if (marker == kChannelOpen) {
      const size_t start = next + marker.size();
      const size_t close = text.find(kChannelClose, start);
      std::string_view block = text.substr(
          start, close == std::string_view::npos ? std::string_view::npos : close - start);
      const bool open_block = close == std::string_view::npos;
      if (partial && open_block) {
        // Still being written: hold a marker cut in half and whitespace that may be trailing.
        size_t cut = 0;
        for (size_t n = std::min(kChannelClose.size() - 1, block.size()); n > 0; --n)
          if (block.substr(block.size() - n) == kChannelClose.substr(0, n)) {
            cut = n;
            break;
          }
        block.remove_suffix(cut);
      }
      bool hold = false;
      const std::string_view body = trim(thought_body(block, partial && open_block, hold));
      if (!body.empty()) reasoning.emplace_back(body);
      if (open_block) break;
      pos = close + kChannelClose.size();
      continue;
    }
    // <|tool_call>
    CallParser cp(text, next + marker.size());
    ParsedToolCall call;
    const Status st = cp.call(call);
    if (st == Status::kOk) {
      out.tool_calls.push_back(std::move(call));
      pos = cp.pos();
      out.end_of_last_call = pos;
      continue;
    }
    const size_t close = text.find(kCallClose, next + marker.size());
    if (partial && (st == Status::kIncomplete || close == std::string_view::npos))
      break;  // not decided yet: hold everything from here
    const size_t end = close == std::string_view::npos ? text.size() : close + kCallClose.size();
    content.append(text.substr(next, end - next));
    pos = end;
  }
  const std::string_view c = trim(content);
  if (!c.empty()) out.content = std::string(c);
  if (!reasoning.empty()) {
    std::string r;
    for (size_t k = 0; k < reasoning.size(); ++k) r += (k ? "\n" : "") + reasoning[k];
    out.reasoning = std::move(r);
  }
  return out;
}

}  // namespace

ParsedOutput parse_model_output(std::string_view text) {
  return parse(text, false);
}

std::string tool_finish_reason(const ParsedOutput& parsed, std::string_view text,
                               bool stopped_on_stop_token) {
  if (stopped_on_stop_token) return parsed.tool_calls.empty() ? "stop" : "tool_calls";
  if (!parsed.tool_calls.empty() && parsed.end_of_last_call <= text.size() &&
      trim(text.substr(parsed.end_of_last_call)).empty())
    return "tool_calls";
  return "length";
}

nlohmann::ordered_json parsed_output_json(const ParsedOutput& parsed) {
  ojson calls = ojson::array();
  for (const ParsedToolCall& c : parsed.tool_calls)
    calls.push_back({{"name", c.name}, {"arguments", c.arguments}});
  return {{"content", parsed.content ? ojson(*parsed.content) : ojson(nullptr)},
          {"reasoning_content", parsed.reasoning ? ojson(*parsed.reasoning) : ojson(nullptr)},
          {"tool_calls", std::move(calls)}};
}

OutputDelta OutputStreamParser::diff(const ParsedOutput& now) {
  OutputDelta d;
  const std::string content = now.content.value_or("");
  const std::string reasoning = now.reasoning.value_or("");
  // Held-back text only ever grows into the final text, so what was sent is a prefix of what is
  // known now; the checks keep a surprise from resending or throwing.
  if (content.size() > content_sent_ &&
      content.compare(0, content_sent_, content, 0, content_sent_) == 0) {
    d.content = content.substr(content_sent_);
    content_sent_ = content.size();
  }
  if (reasoning.size() > reasoning_sent_) {
    d.reasoning = reasoning.substr(reasoning_sent_);
    reasoning_sent_ = reasoning.size();
  }
  d.first_call_index = calls_sent_;
  for (size_t k = calls_sent_; k < now.tool_calls.size(); ++k)
    d.tool_calls.push_back(now.tool_calls[k]);
  calls_sent_ = std::max(calls_sent_, now.tool_calls.size());
  return d;
}

OutputDelta OutputStreamParser::feed(std::string_view piece) {
  text_.append(piece);
  return diff(parse(text_, true));
}

OutputDelta OutputStreamParser::finish() {
  return diff(parse(text_, false));
}

}  // namespace gemstage
