// The tokens of a template: text between tags, and inside {{ }} / {% %} the names, literals and
// operators, with trim_blocks, lstrip_blocks and the `-` / `+` whitespace control applied.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace gemstage::jinja::internal {

struct Pos {
  int line = 1, col = 1;
};

enum class Tok {
  kText,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type;
  std::string text;  // kText / kName / kString (unescaped) / kOp / number text
  Pos pos;
};

// The tokens of `source`; errors name `name`, the line and the column.
std::vector<Token> lex(std::string_view source, const std::string& name);

}  // namespace gemstage::jinja::internal
