#include "template/lexer.h"

#include <locale.h>
#include <wctype.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <limits>
#include <optional>
#include <unordered_map>
#include <vector>

#include "template/value.h"

namespace gemstage::jinja::internal {
namespace {

class Lexer {
 public:
  Lexer(std::string_view src, const std::string& name) : name_(name) {
    // Jinja reads template source with universal newlines and drops one trailing newline
    // (keep_trailing_newline is off).
    src_.reserve(src.size());
    for (size_t k = 0; k < src.size(); ++k) {
      if (src[k] == '\r') {
        src_ += '\n';
        if (k + 1 < src.size() && src[k + 1] == '\n') ++k;
      } else {
        src_ += src[k];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool strip_next = false;  // the previous tag ended with '-'
    bool trim_newline = false;
    while (pos < src_.size()) {
      const size_t open = find_tag(pos);
      const size_t text_end = open == std::string::npos ? src_.size() : open;
      std::string text = src_.substr(pos, text_end - pos);
      const size_t text_start = pos;
      bool removed_newline = false;
      if (strip_next) {
        text.erase(0, text.size() - py_strip(text, true, false).size());
      } else if (trim_newline && !text.empty() && text[0] == '\n') {
        text.erase(0, 1);
        removed_newline = true;
      }
      strip_next = trim_newline = false;
      if (open == std::string::npos) {
        emit_text(std::move(text), text_start);
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const char modifier = open + 2 < src_.size() ? src_[open + 2] : '\0';
      if (modifier == '-') {
        text.resize(py_strip(text, false, true).size());
      } else if (kind != '{' && modifier != '+') {
        // lstrip_blocks: spaces and tabs between the start of the line and a block or comment
        // tag are removed.
        size_t k = text.size();
        while (k > 0 && (text[k - 1] == ' ' || text[k - 1] == '\t')) --k;
        const bool line_start =
            k > 0 ? text[k - 1] == '\n'
                  : (removed_newline || text_start == 0 || src_[text_start - 1] == '\n');
        if (line_start) text.resize(k);
      }
      emit_text(std::move(text), text_start);
      size_t p = open + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
      if (kind == '#') {
        const size_t close = src_.find("#}", p);
        if (close == std::string::npos) error(open, "comment opened here is never closed");
        strip_next = close > p && src_[close - 1] == '-';
        trim_newline = true;
        pos = close + 2;
        continue;
      }
      const bool block = kind == '%';
      tokens_.push_back({block ? Tok::kBlockBegin : Tok::kVarBegin, {}, at(open)});
      p = lex_tag(p, block, strip_next);
      trim_newline = block;
      // {% raw %} ... {% endraw %}: the text between is output as it is.
      if (block && tokens_.size() >= 3 && tokens_[tokens_.size() - 2].type == Tok::kName &&
          tokens_[tokens_.size() - 2].text == "raw" &&
          tokens_[tokens_.size() - 3].type == Tok::kBlockBegin) {
        tokens_.resize(tokens_.size() - 3);
        p = lex_raw(p, strip_next, trim_newline);
        strip_next = false;
      }
      pos = p;
    }
    tokens_.push_back({Tok::kEof, {}, at(src_.size())});
    return std::move(tokens_);
  }

 private:
  Pos at(size_t offset) const {
    Pos p;
    for (size_t k = 0; k < offset && k < src_.size(); ++k) {
      if (src_[k] == '\n') {
        ++p.line;
        p.col = 1;
      } else {
        ++p.col;
      }
    }
    return p;
  }
  [[noreturn]] void error(size_t offset, const std::string& msg) const {
    const Pos p = at(offset);
    throw TemplateError(detail::concat(name_, ":", p.line, ":", p.col, ": ", msg));
  }
  size_t find_tag(size_t from) const {
    for (size_t k = src_.find('{', from); k != std::string::npos; k = src_.find('{', k + 1))
      if (k + 1 < src_.size() && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#'))
        return k;
    return std::string::npos;
  }
  void emit_text(std::string text, size_t offset) {
    if (!text.empty()) tokens_.push_back({Tok::kText, std::move(text), at(offset)});
  }

  // Lexes the inside of a {% %} or {{ }} up to and including its end; returns the offset after.
  size_t lex_tag(size_t p, bool block, bool& strip_after) {
    int depth = 0;
    const char closer = block ? '%' : '}';
    while (true) {
      while (p < src_.size() && is_py_space(src_[p])) ++p;
      if (p >= src_.size()) error(p, block ? "'{%' is never closed" : "'{{' is never closed");
      // The end of the tag: "-%}" / "%}" (or "}}"), outside brackets.
      if (depth == 0) {
        const bool dash =
            src_[p] == '-' && p + 2 < src_.size() && src_[p + 1] == closer && src_[p + 2] == '}';
        if (dash || (src_[p] == closer && p + 1 < src_.size() && src_[p + 1] == '}')) {
          strip_after = dash;
          tokens_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, {}, at(p)});
          return p + (dash ? 3 : 2);
        }
      }
      const size_t start = p;
      const char c = src_[p];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        while (p < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
          ++p;
        tokens_.push_back({Tok::kName, src_.substr(start, p - start), at(start)});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        bool is_float = false;
        while (p < src_.size() &&
               (std::isdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
          ++p;
        if (p + 1 < src_.size() && src_[p] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[p + 1]))) {
          is_float = true;
          ++p;
          while (p < src_.size() &&
                 (std::isdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
            ++p;
        }
        if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
          size_t q = p + 1;
          if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
          if (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) {
            is_float = true;
            p = q;
            while (p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]))) ++p;
          }
        }
        std::string num;
        for (size_t k = start; k < p; ++k)
          if (src_[k] != '_') num += src_[k];
        tokens_.push_back({is_float ? Tok::kFloat : Tok::kInt, num, at(start)});
      } else if (c == '\'' || c == '"') {
        std::string s;
        ++p;
        while (true) {
          if (p >= src_.size()) error(start, "string literal is never closed");
          const char d = src_[p];
          if (d == c) {
            ++p;
            break;
          }
          if (d == '\\' && p + 1 < src_.size()) {
            p = unescape(p + 1, s, start);
            continue;
          }
          s += d;
          ++p;
        }
        tokens_.push_back({Tok::kString, std::move(s), at(start)});
      } else {
        static constexpr std::string_view kTwo[] = {"==", "!=", "<=", ">=", "//", "**"};
        std::string op(1, c);
        for (std::string_view two : kTwo)
          if (src_.compare(p, 2, two) == 0) op = std::string(two);
        if (std::string_view("+-*/%~()[]{}.,:|=<>!").find(c) == std::string_view::npos)
          error(p, detail::concat("unexpected character '", std::string(1, c), "'"));
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        p += op.size();
        tokens_.push_back({Tok::kOp, op, at(start)});
      }
    }
  }

  // One backslash escape of a string literal (p is after the backslash).
  size_t unescape(size_t p, std::string& s, size_t literal_start) {
    const char e = src_[p++];
    auto hex = [&](int n) {
      if (p + static_cast<size_t>(n) > src_.size()) error(literal_start, "bad escape in string");
      char32_t cp = 0;
      for (int k = 0; k < n; ++k) {
        const char h = src_[p++];
        int d = std::isdigit(static_cast<unsigned char>(h)) ? h - '0'
                : (h >= 'a' && h <= 'f')                    ? h - 'a' + 10
                : (h >= 'A' && h <= 'F')                    ? h - 'A' + 10
                                                            : -1;
        if (d < 0) error(literal_start, "bad hex escape in string");
        cp = cp * 16 + static_cast<char32_t>(d);
      }
      append_utf8(s, cp);
    };
    switch (e) {
      case 'n':
        s += '\n';
        break;
      case 't':
        s += '\t';
        break;
      case 'r':
        s += '\r';
        break;
      case '0':
        s += '\0';
        break;
      case '\\':
      case '\'':
      case '"':
        s += e;
        break;
      case '\n':
        break;
      case 'x':
        hex(2);
        break;
      case 'u':
        hex(4);
        break;
      case 'U':
        hex(8);
        break;
      default:
        s += '\\';
        s += e;
    }
    return p;
  }

  size_t lex_raw(size_t p, bool strip_after_open, bool trim_nl) {
    for (size_t k = find_tag(p); k != std::string::npos; k = find_tag(k + 1)) {
      if (src_[k + 1] != '%') continue;
      size_t q = k + 2;
      const bool dash_before = q < src_.size() && src_[q] == '-';
      if (dash_before || (q < src_.size() && src_[q] == '+')) ++q;
      while (q < src_.size() && is_py_space(src_[q])) ++q;
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q += 6;
      while (q < src_.size() && is_py_space(src_[q])) ++q;
      const bool dash_after = q < src_.size() && src_[q] == '-';
      if (dash_after) ++q;
      if (src_.compare(q, 2, "%}") != 0) continue;
      std::string text = src_.substr(p, k - p);
      if (strip_after_open)
        text.erase(0, text.size() - py_strip(text, true, false).size());
      else if (trim_nl && !text.empty() && text[0] == '\n')
        text.erase(0, 1);
      if (dash_before) text.resize(py_strip(text, false, true).size());
      emit_text(std::move(text), p);
      q += 2;
      if (dash_after) {
        while (q < src_.size() && is_py_space(src_[q])) ++q;
      } else if (q < src_.size() && src_[q] == '\n') {
        ++q;
      }
      return q;
    }
    error(p, "{% raw %} is never closed by {% endraw %}");
  }

  std::string src_;
  const std::string& name_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source, const std::string& name) {
  return Lexer(source, name).run();
}

}  // namespace gemstage::jinja::internal
