// The syntax tree of a template and the parser that builds it from the lexer's tokens.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "template/lexer.h"
#include "template/value.h"

namespace gemstage::jinja::internal {

struct Expr;

using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,
    kName,
    kList,
    kTuple,
    kDict,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kPos,
    kBinary,
    kAnd,
    kOr,
    kCond
  };
  Kind kind;
  Pos pos;
  Value literal;
  std::string name;  // name / attribute / filter / test / operator
  bool negated = false;
  std::vector<ExprPtr> args;  // operands, then call / filter / test arguments
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Node;

using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue };
  Kind kind;
  Pos pos;
  std::string text;                                     // kText; kSet / kSetBlock / kMacro: name
  std::string attr;                                     // kSet: namespace attribute
  ExprPtr expr;                                         // kOutput, kSet value, kFor iterable
  ExprPtr filter;                                       // kFor: `if` condition
  std::vector<std::pair<ExprPtr, Body>> branches;       // kIf
  Body body, else_body;                                 // kFor, kMacro, kSetBlock; kIf / kFor else
  std::vector<std::string> targets;                     // kFor loop variables
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro (default may be null)
};

// The tree of `source`; a syntax error names `name`, the line and the column.
Body parse(std::string_view source, const std::string& name);

}  // namespace gemstage::jinja::internal
