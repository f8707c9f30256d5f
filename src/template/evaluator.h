// The interpreter: evaluates a template's tree against a context. Its expressions and statements
// are in evaluator.cc, the string and dict methods, filters and tests in filters.cc.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "template/parser.h"
#include "template/value.h"

namespace gemstage::jinja::internal {

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  Pos at;

  // Positional argument k, or keyword `name`, or nullopt.
  std::optional<Value> get(size_t k, const char* name) const {
    for (const auto& [n, v] : kw)
      if (n == name) return v;
    if (k < pos.size()) return pos[k];
    return std::nullopt;
  }
};

struct BreakSignal {};

struct ContinueSignal {};

struct Macro {
  const Node* node;
};

struct Interp {
  const std::string& name;
  const RenderLimits& limits;
  std::vector<std::unordered_map<std::string, Value>> scopes;
  size_t barrier = 1;  // scopes below this (other than the root, 0) are a caller's: not visible
  int call_depth = 0;
  int64_t iterations = 0;
  Interp(const std::string& n, const RenderLimits& l);
  [[noreturn]] void error(Pos p, const std::string& msg) const;
  void count_iteration(Pos p);
  void append(std::string& out, std::string_view s, Pos p) const;
  Value lookup(const std::string& n) const;
  void assign(const std::string& n, Value v);

  // ---- expressions (evaluator.cc)
  Value eval(const Expr& e);
  Args eval_args(const Expr& e, size_t first);
  [[noreturn]] void undefined_error(const Value& v, Pos p, const std::string& what) const;
  Value get_attr(const Value& obj, const std::string& attr, Pos p);
  Value get_item(const Value& obj, const Value& key, Pos p);
  Value slice(const Expr& e);
  bool contains(const Value& container, const Value& item, Pos p);
  int compare(const Value& a, const Value& b, Pos p);
  Value binary(const Expr& e);

  // ---- methods of strings and dicts (filters.cc)
  Value method(const Value& obj, const std::string& m, Pos p);
  std::string str_arg(const Args& a, size_t k, const char* n, const char* fn);
  Value string_method(const std::string& s, const std::string& m, Args& a);
  std::string title_case(const std::string& s, bool every_word);
  std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                          int64_t count, Pos p);
  Value items_of(const Value& d, Pos p);

  // The elements a for loop (or a filter) walks: list items, dict keys, string characters.
  List iterate(const Value& v, Pos p);

  // ---- filters and tests (filters.cc)
  Value attribute_path(const Value& v, const std::string& path, Pos p);
  std::string sort_key_text(const Value& v, bool case_sensitive);
  void sort_values(List& items, bool case_sensitive, bool reverse,
                   const std::function<Value(const Value&)>& key, Pos p);
  Value apply_filter(const std::string& f, const Value& in, Args& a);
  bool apply_test(const std::string& t, const Value& v, Args& a);

  // ---- statements (evaluator.cc)
  void exec(const Body& body, std::string& out);
  void exec(const Node& n, std::string& out);
  void exec_for(const Node& n, std::string& out);
  Value make_macro(const Node& n);
  void install_globals();
};

}  // namespace gemstage::jinja::internal
