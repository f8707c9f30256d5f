// The values of the Jinja interpreter and the Python semantics a chat template relies on:
// integers (128-bit here), how floats print, str's whitespace and case rules, truthiness,
// equality, repr() and json.dumps(). Internal to src/template; jinja.h is the interface.
#pragma once

#include <locale.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "template/jinja.h"

namespace gemstage::jinja::internal {

using nlohmann::ordered_json;

// Python's integers are unbounded; ours are 128-bit. Every JSON integer (int64 and uint64) and
// their sums and products fit, and an arithmetic result past that is an error, never a wrapped
// value or a float.
__extension__ typedef __int128 Int;

__extension__ typedef unsigned __int128 UInt;
constexpr Int kIntMax = static_cast<Int>(~UInt{0} >> 1);
constexpr Int kIntMin = -kIntMax - 1;

std::string int_str(Int v);

// Decimal digits after an optional sign, as Python's int(str) reads them; nullopt when the text
// is not that or the value does not fit.
std::optional<Int> parse_int(std::string_view t);

// An index, count or bound taken from an integer: values past 64 bits saturate, which every
// caller then treats as out of range.
int64_t saturate_i64(Int v);

// ---------------------------------------------------------------------------------------------
// Numbers and text as Python prints and compares them.

// Decodes one UTF-8 code point at s[i] (advancing i); invalid bytes decode as themselves.
char32_t next_code_point(std::string_view s, size_t& i);

void append_utf8(std::string& out, char32_t cp);

std::vector<std::string_view> code_points(std::string_view s);

// Unicode case mapping through glibc's C.UTF-8 tables (Python's str.lower / upper for everything
// but the few one-to-many mappings); ASCII only if that locale is missing.
locale_t utf8_locale();

std::string map_case(std::string_view s, bool upper);

// ASCII whitespace between the tokens inside a tag.
bool is_py_space(char c);

// Byte length of the character at s[i] when Python's str.isspace() holds for it, else 0. That
// set is Unicode's White_Space plus the four information separators U+001C..U+001F: the ASCII
// ones, U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F and U+3000. Only
// their well-formed UTF-8 sequences count (a stray byte 0xA0 is not U+00A0).
size_t py_space_at(std::string_view s, size_t i);

// Byte length of the Python whitespace character that ends right before s[e], or 0.
size_t py_space_before(std::string_view s, size_t e);

// Python's str.strip / lstrip / rstrip: whitespace as str.isspace() has it, or the code points
// of `chars`.
std::string_view py_strip(std::string_view s, bool left, bool right,
                          std::optional<std::string_view> chars = std::nullopt);

// ---------------------------------------------------------------------------------------------
// Values.

struct Value;
using List = std::vector<Value>;
struct Dict;
struct Interp;
struct Args;
using NativeFn = std::function<Value(Interp&, Args&)>;

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };
  Kind kind = Kind::kUndefined;
  bool b = false;
  Int i = 0;
  double f = 0;
  std::string s;  // kString; kUndefined: the name that was not found (for messages)
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<NativeFn> fn;
  bool is_namespace = false;  // a kDict made by namespace(): its attributes can be assigned

  static Value undefined(std::string name = {}) {
    Value v;
    v.s = std::move(name);
    return v;
  }
  static Value none() {
    Value v;
    v.kind = Kind::kNone;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.kind = Kind::kBool;
    v.b = x;
    return v;
  }
  static Value integer(Int x) {
    Value v;
    v.kind = Kind::kInt;
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v;
    v.kind = Kind::kFloat;
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v;
    v.kind = Kind::kString;
    v.s = std::move(x);
    return v;
  }
  static Value make_list(List items = {}) {
    Value v;
    v.kind = Kind::kList;
    v.list = std::make_shared<List>(std::move(items));
    return v;
  }
  static Value make_dict();
  static Value callable(NativeFn f) {
    Value v;
    v.kind = Kind::kCallable;
    v.fn = std::make_shared<NativeFn>(std::move(f));
    return v;
  }

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_dict() const { return kind == Kind::kDict; }
  double as_double() const {
    return kind == Kind::kFloat ? f : kind == Kind::kBool ? b : double(i);
  }
};

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  std::unordered_map<std::string, size_t> index;

  const Value* find(const std::string& k) const {
    const auto it = index.find(k);
    return it == index.end() ? nullptr : &items[it->second].second;
  }
  void set(const std::string& k, Value v) {
    const auto it = index.find(k);
    if (it != index.end()) {
      items[it->second].second = std::move(v);
      return;
    }
    index.emplace(k, items.size());
    items.emplace_back(k, std::move(v));
  }
};

Value from_json(const ordered_json& j);

std::string py_repr_string(std::string_view s);

std::string to_str(const Value& v, bool repr = false);

void json_string(std::string& out, std::string_view s);

// Python's json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys), which is what
// transformers installs as the tojson filter.
void to_json_text(std::string& out, const Value& v, int indent, bool sort_keys, int depth);

bool truthy(const Value& v);

bool numeric_like(const Value& v);

// An int or a bool (Python's bool is an int) as an integer.
Int int_of(const Value& v);

bool equal(const Value& a, const Value& b);

const char* kind_name(const Value& v);

}  // namespace gemstage::jinja::internal
