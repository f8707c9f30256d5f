#include "template/jinja.h"

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

namespace gemstage::jinja {

using nlohmann::ordered_json;

namespace {

// Python's integers are unbounded; ours are 128-bit. Every JSON integer (int64 and uint64) and
// their sums and products fit, and an arithmetic result past that is an error, never a wrapped
// value or a float.
__extension__ typedef __int128 Int;
__extension__ typedef unsigned __int128 UInt;
constexpr Int kIntMax = static_cast<Int>(~UInt{0} >> 1);
constexpr Int kIntMin = -kIntMax - 1;

std::string int_str(Int v) {
  if (v >= std::numeric_limits<int64_t>::min() && v <= std::numeric_limits<int64_t>::max())
    return std::to_string(static_cast<int64_t>(v));
  UInt m = v < 0 ? UInt{0} - static_cast<UInt>(v) : static_cast<UInt>(v);
  std::string digits;
  for (; m != 0; m /= 10) digits += static_cast<char>('0' + static_cast<int>(m % 10));
  if (v < 0) digits += '-';
  return {digits.rbegin(), digits.rend()};
}

// Decimal digits after an optional sign, as Python's int(str) reads them; nullopt when the text
// is not that or the value does not fit.
std::optional<Int> parse_int(std::string_view t) {
  size_t k = 0;
  const bool negative = !t.empty() && t[0] == '-';
  if (!t.empty() && (t[0] == '-' || t[0] == '+')) ++k;
  if (k == t.size()) return std::nullopt;
  Int v = 0;  // accumulated negatively, so kIntMin is reachable
  for (; k < t.size(); ++k) {
    if (t[k] < '0' || t[k] > '9') return std::nullopt;
    if (__builtin_mul_overflow(v, Int{10}, &v) || __builtin_sub_overflow(v, Int{t[k] - '0'}, &v))
      return std::nullopt;
  }
  if (negative) return v;
  if (v == kIntMin) return std::nullopt;
  return -v;
}

// An index, count or bound taken from an integer: values past 64 bits saturate, which every
// caller then treats as out of range.
int64_t saturate_i64(Int v) {
  return v < std::numeric_limits<int64_t>::min()   ? std::numeric_limits<int64_t>::min()
         : v > std::numeric_limits<int64_t>::max() ? std::numeric_limits<int64_t>::max()
                                                   : static_cast<int64_t>(v);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Numbers and text as Python prints and compares them.

std::string python_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  // Shortest round-trip digits, in scientific form: "d.ddde[+-]XX".
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp10 = std::stoi(sci.substr(e + 1));
  bool neg = false;
  if (!mant.empty() && mant[0] == '-') {
    neg = true;
    mant.erase(0, 1);
  }
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out = neg ? "-" : "";
  if (exp10 < -4 || exp10 >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    return out + eb;
  }
  if (exp10 < 0) {
    out += "0." + std::string(static_cast<size_t>(-exp10 - 1), '0') + digits;
  } else {
    const size_t int_len = static_cast<size_t>(exp10) + 1;
    if (digits.size() <= int_len) {
      out += digits + std::string(int_len - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, int_len) + "." + digits.substr(int_len);
    }
  }
  return out;
}

namespace {

// Decodes one UTF-8 code point at s[i] (advancing i); invalid bytes decode as themselves.
char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1;
  if (i + static_cast<size_t>(len) > s.size()) len = 1;
  char32_t cp = len == 1 ? b : len == 2 ? (b & 0x1f) : len == 3 ? (b & 0x0f) : (b & 0x07);
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  i += static_cast<size_t>(len);
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    next_code_point(s, i);
    out.push_back(s.substr(start, i - start));
  }
  return out;
}

// Unicode case mapping through glibc's C.UTF-8 tables (Python's str.lower / upper for everything
// but the few one-to-many mappings); ASCII only if that locale is missing.
locale_t utf8_locale() {
  static const locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(0));
  return loc;
}

std::string map_case(std::string_view s, bool upper) {
  std::string out;
  out.reserve(s.size());
  const locale_t loc = utf8_locale();
  for (size_t i = 0; i < s.size();) {
    char32_t cp = next_code_point(s, i);
    if (loc)
      cp = static_cast<char32_t>(upper ? towupper_l(static_cast<wint_t>(cp), loc)
                                       : towlower_l(static_cast<wint_t>(cp), loc));
    else if (cp < 0x80)
      cp = static_cast<char32_t>(upper ? std::toupper(static_cast<int>(cp))
                                       : std::tolower(static_cast<int>(cp)));
    append_utf8(out, cp);
  }
  return out;
}

// ASCII whitespace between the tokens inside a tag.
bool is_py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// Byte length of the character at s[i] when Python's str.isspace() holds for it, else 0. That
// set is Unicode's White_Space plus the four information separators U+001C..U+001F: the ASCII
// ones, U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F and U+3000. Only
// their well-formed UTF-8 sequences count (a stray byte 0xA0 is not U+00A0).
size_t py_space_at(std::string_view s, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const size_t left = s.size() - i;
  if (left == 0) return 0;
  const unsigned char b = at(0);
  if ((b >= 0x09 && b <= 0x0D) || (b >= 0x1C && b <= 0x20)) return 1;
  if (b == 0xC2 && left >= 2) return at(1) == 0x85 || at(1) == 0xA0 ? 2 : 0;
  if (left < 3) return 0;
  if (b == 0xE1) return at(1) == 0x9A && at(2) == 0x80 ? 3 : 0;  // U+1680
  if (b == 0xE3) return at(1) == 0x80 && at(2) == 0x80 ? 3 : 0;  // U+3000
  if (b != 0xE2) return 0;
  if (at(1) == 0x80)  // U+2000..U+200A, U+2028, U+2029, U+202F
    return at(2) <= 0x8A || at(2) == 0xA8 || at(2) == 0xA9 || at(2) == 0xAF ? 3 : 0;
  return at(1) == 0x81 && at(2) == 0x9F ? 3 : 0;  // U+205F
}

// Byte length of the Python whitespace character that ends right before s[e], or 0.
size_t py_space_before(std::string_view s, size_t e) {
  for (size_t n = 1; n <= 3 && n <= e; ++n)
    if (py_space_at(s, e - n) == n) return n;
  return 0;
}

// Python's str.strip / lstrip / rstrip: whitespace as str.isspace() has it, or the code points
// of `chars`.
std::string_view py_strip(std::string_view s, bool left, bool right,
                          std::optional<std::string_view> chars = std::nullopt) {
  size_t b = 0, e = s.size();
  if (!chars) {
    while (left && b < e) {
      const size_t n = py_space_at(s, b);
      if (n == 0) break;
      b += n;
    }
    while (right && e > b) {
      const size_t n = py_space_before(s.substr(b), e - b);
      if (n == 0) break;
      e -= n;
    }
    return s.substr(b, e - b);
  }
  const std::vector<std::string_view> set = code_points(*chars);
  const auto in_set = [&](std::string_view cp) {
    return std::find(set.begin(), set.end(), cp) != set.end();
  };
  std::vector<std::string_view> cps = code_points(s);
  size_t first = 0, last = cps.size();
  if (left)
    while (first < last && in_set(cps[first])) b += cps[first++].size();
  if (right)
    while (last > first && in_set(cps[last - 1])) e -= cps[--last].size();
  return s.substr(b, e - b);
}

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

Value Value::make_dict() {
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::make_shared<Dict>();
  return v;
}

Value from_json(const ordered_json& j) {
  switch (j.type()) {
    case ordered_json::value_t::null:
      return Value::none();
    case ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case ordered_json::value_t::number_unsigned:
      return Value::integer(j.get<uint64_t>());
    case ordered_json::value_t::number_float:
      return Value::real(j.get<double>());
    case ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case ordered_json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& e : j) l.push_back(from_json(e));
      return Value::make_list(std::move(l));
    }
    case ordered_json::value_t::object: {
      Value d = Value::make_dict();
      for (const auto& [k, v] : j.items()) d.dict->set(k, from_json(v));
      return d;
    }
    default:
      return Value::none();
  }
}

std::string py_repr_string(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (const char c : s) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c == q) {
          out += '\\';
          out += c;
        } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\x%02x", static_cast<unsigned char>(c));
          out += b;
        } else {
          out += c;
        }
    }
  }
  out += q;
  return out;
}

std::string to_str(const Value& v, bool repr = false);

std::string to_str(const Value& v, bool repr) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.b ? "True" : "False";
    case Value::Kind::kInt:
      return int_str(v.i);
    case Value::Kind::kFloat:
      return python_float_repr(v.f);
    case Value::Kind::kString:
      return repr ? py_repr_string(v.s) : v.s;
    case Value::Kind::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += ", ";
        out += to_str((*v.list)[k], true);
      }
      return out + "]";
    }
    case Value::Kind::kDict: {
      if (v.is_namespace) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, e] : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out += py_repr_string(k) + ": " + to_str(e, true);
      }
      return out + "}";
    }
    case Value::Kind::kCallable:
      return "<function>";
  }
  return "";
}

void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", static_cast<unsigned char>(c));
          out += b;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// Python's json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys), which is what
// transformers installs as the tojson filter.
void to_json_text(std::string& out, const Value& v, int indent, bool sort_keys, int depth) {
  if (depth > 512) throw TemplateError("tojson: value nested too deeply");
  auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  const char* item_sep = indent < 0 ? ", " : ",";
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += int_str(v.i);
      return;
    case Value::Kind::kFloat:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity")
                               : python_float_repr(v.f);
      return;
    case Value::Kind::kString:
      json_string(out, v.s);
      return;
    case Value::Kind::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        to_json_text(out, (*v.list)[k], indent, sort_keys, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& p : v.dict->items) items.push_back(&p);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      bool first = true;
      for (const auto* p : items) {
        if (!first) out += item_sep;
        first = false;
        newline(depth + 1);
        json_string(out, p->first);
        out += ": ";
        to_json_text(out, p->second, indent, sort_keys, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::kCallable:
      throw TemplateError("tojson: a function is not JSON serializable");
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.b;
    case Value::Kind::kInt:
      return v.i != 0;
    case Value::Kind::kFloat:
      return v.f != 0;
    case Value::Kind::kString:
      return !v.s.empty();
    case Value::Kind::kList:
      return !v.list->empty();
    case Value::Kind::kDict:
      return v.is_namespace || !v.dict->items.empty();
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

bool numeric_like(const Value& v) {
  return v.kind == Value::Kind::kInt || v.kind == Value::Kind::kFloat ||
         v.kind == Value::Kind::kBool;
}

// An int or a bool (Python's bool is an int) as an integer.
Int int_of(const Value& v) {
  return v.kind == Value::Kind::kBool ? Int{v.b} : v.i;
}

bool equal(const Value& a, const Value& b) {
  if (numeric_like(a) && numeric_like(b)) {
    if (a.kind != Value::Kind::kFloat && b.kind != Value::Kind::kFloat)
      return int_of(a) == int_of(b);
    return a.as_double() == b.as_double();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.s == b.s;
    case Value::Kind::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::kDict:
      if (a.dict == b.dict) return true;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    case Value::Kind::kCallable:
      return a.fn == b.fn;
    default:
      return false;
  }
}

const char* kind_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "none";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return "list";
    case Value::Kind::kDict:
      return v.is_namespace ? "namespace" : "dict";
    case Value::Kind::kCallable:
      return "function";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Lexer.

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

// ---------------------------------------------------------------------------------------------
// Syntax tree.

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

// ---------------------------------------------------------------------------------------------
// Parser.

constexpr int kMaxNesting = 200;

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& name)
      : toks_(std::move(tokens)), name_(name) {}

  Body parse_template() {
    Body body = parse_body({});
    if (peek().type != Tok::kEof) error(peek().pos, "unexpected tag");
    return body;
  }

 private:
  const Token& peek(size_t ahead = 0) const {
    return toks_[std::min(i_ + ahead, toks_.size() - 1)];
  }
  const Token& take() {
    const Token& t = toks_[i_];
    if (i_ + 1 < toks_.size()) ++i_;
    return t;
  }
  [[noreturn]] void error(Pos p, const std::string& msg) const {
    throw TemplateError(detail::concat(name_, ":", p.line, ":", p.col, ": ", msg));
  }
  bool is_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kOp && peek(ahead).text == op;
  }
  bool is_name(const char* n, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kName && peek(ahead).text == n;
  }
  void expect_op(const char* op) {
    if (!is_op(op)) error(peek().pos, detail::concat("expected '", op, "'", describe(peek())));
    take();
  }
  void expect_name(const char* n) {
    if (!is_name(n)) error(peek().pos, detail::concat("expected '", n, "'", describe(peek())));
    take();
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kName:
      case Tok::kOp:
      case Tok::kInt:
      case Tok::kFloat:
        return ", found '" + t.text + "'";
      case Tok::kString:
        return ", found a string";
      case Tok::kBlockEnd:
        return ", found the end of the tag";
      case Tok::kVarEnd:
        return ", found '}}'";
      case Tok::kEof:
        return ", found the end of the template";
      default:
        return "";
    }
  }
  std::string ident() {
    if (peek().type != Tok::kName) error(peek().pos, "expected a name" + describe(peek()));
    return take().text;
  }
  void end_block() {
    if (peek().type != Tok::kBlockEnd)
      error(peek().pos, "expected the end of the tag" + describe(peek()));
    take();
  }

  // Parses nodes until a block tag whose keyword is one of `stops` (left unconsumed, positioned
  // at its keyword) or the end of the template.
  Body parse_body(std::initializer_list<const char*> stops) {
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::kEof) {
        if (stops.size() != 0)
          error(t.pos, detail::concat("the template ended inside a block; expected '{% ",
                                      *(stops.end() - 1), " %}'"));
        return body;
      }
      if (t.type == Tok::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kText;
        n->pos = t.pos;
        n->text = take().text;
        body.push_back(std::move(n));
        continue;
      }
      if (t.type == Tok::kVarBegin) {
        take();
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kOutput;
        n->pos = t.pos;
        n->expr = parse_expr();
        if (peek().type != Tok::kVarEnd) error(peek().pos, "expected '}}'" + describe(peek()));
        take();
        body.push_back(std::move(n));
        continue;
      }
      if (t.type != Tok::kBlockBegin) error(t.pos, "unexpected token" + describe(t));
      const Token& kw = peek(1);
      if (kw.type != Tok::kName) error(kw.pos, "expected a statement keyword" + describe(kw));
      for (const char* s : stops)
        if (kw.text == s) {
          take();
          return body;
        }
      take();
      body.push_back(parse_statement());
    }
  }

  std::unique_ptr<Node> parse_statement() {
    const Token kw = take();
    if (++depth_ > kMaxNesting) error(kw.pos, "blocks nested too deeply");
    auto n = std::make_unique<Node>();
    n->pos = kw.pos;
    const std::string& k = kw.text;
    if (k == "if") {
      n->kind = Node::Kind::kIf;
      ExprPtr cond = parse_expr();
      end_block();
      while (true) {
        Body b = parse_body({"elif", "else", "endif"});
        n->branches.emplace_back(std::move(cond), std::move(b));
        const std::string which = take().text;
        if (which == "elif") {
          cond = parse_expr();
          end_block();
          continue;
        }
        end_block();
        if (which == "else") {
          n->else_body = parse_body({"endif"});
          take();
          end_block();
        }
        break;
      }
    } else if (k == "for") {
      n->kind = Node::Kind::kFor;
      n->targets.push_back(ident());
      while (is_op(",")) {
        take();
        n->targets.push_back(ident());
      }
      expect_name("in");
      n->expr = parse_or_expr();  // `if` after the iterable is the loop filter, not a ternary
      if (is_name("if")) {
        take();
        n->filter = parse_expr();
      }
      if (is_name("recursive")) error(peek().pos, "recursive loops are not supported");
      end_block();
      n->body = parse_body({"else", "endfor"});
      if (take().text == "else") {
        end_block();
        n->else_body = parse_body({"endfor"});
        take();
      }
      end_block();
    } else if (k == "set") {
      const std::string target = ident();
      if (is_op(".")) {
        take();
        n->attr = ident();
      }
      n->text = target;
      if (is_op("=")) {
        take();
        n->kind = Node::Kind::kSet;
        n->expr = parse_expr();
        if (is_op(",")) error(peek().pos, "tuple assignment is not supported");
        end_block();
      } else {
        if (!n->attr.empty()) error(kw.pos, "a block set assigns a plain name");
        n->kind = Node::Kind::kSetBlock;
        end_block();
        n->body = parse_body({"endset"});
        take();
        end_block();
      }
    } else if (k == "macro") {
      n->kind = Node::Kind::kMacro;
      n->text = ident();
      expect_op("(");
      while (!is_op(")")) {
        std::string p = ident();
        ExprPtr def;
        if (is_op("=")) {
          take();
          def = parse_expr();
        }
        n->params.emplace_back(std::move(p), std::move(def));
        if (!is_op(")")) expect_op(",");
      }
      take();
      end_block();
      n->body = parse_body({"endmacro"});
      take();
      end_block();
    } else if (k == "break" || k == "continue") {
      n->kind = k == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      end_block();
    } else if (k == "generation" || k == "endgeneration") {
      // transformers' assistant-mask marker: renders nothing.
      n->kind = Node::Kind::kText;
      end_block();
    } else {
      error(kw.pos, detail::concat("unknown or misplaced statement '", k, "'"));
    }
    --depth_;
    return n;
  }

  ExprPtr make(Expr::Kind k, Pos p) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = p;
    return e;
  }

  struct DepthGuard {
    Parser& p;
    DepthGuard(Parser& parser, Pos pos) : p(parser) {
      if (++p.depth_ > kMaxNesting) p.error(pos, "expression nested too deeply");
    }
    ~DepthGuard() { --p.depth_; }
  };

  ExprPtr parse_expr() {
    DepthGuard g(*this, peek().pos);
    ExprPtr e = parse_or_expr();
    if (is_name("if")) {
      const Pos p = take().pos;
      auto c = make(Expr::Kind::kCond, p);
      ExprPtr cond = parse_or_expr();
      ExprPtr other;
      if (is_name("else")) {
        take();
        other = parse_expr();
      }
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(other));  // may be null: undefined
      return c;
    }
    return e;
  }
  ExprPtr parse_or_expr() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      auto o = make(Expr::Kind::kOr, take().pos);
      o->args.push_back(std::move(e));
      o->args.push_back(parse_and());
      e = std::move(o);
    }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      auto o = make(Expr::Kind::kAnd, take().pos);
      o->args.push_back(std::move(e));
      o->args.push_back(parse_not());
      e = std::move(o);
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard g(*this, peek().pos);
      auto o = make(Expr::Kind::kNot, take().pos);
      o->args.push_back(parse_not());
      return o;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    while (true) {
      std::string op;
      const Pos p = peek().pos;
      if (peek().type == Tok::kOp &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
           peek().text == "<=" || peek().text == ">" || peek().text == ">=")) {
        op = take().text;
      } else if (is_name("in")) {
        take();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        take();
        take();
        op = "not in";
      } else {
        return e;
      }
      auto b = make(Expr::Kind::kBinary, p);
      b->name = op;
      b->args.push_back(std::move(e));
      b->args.push_back(parse_math1());
      e = std::move(b);
    }
  }
  ExprPtr binary(std::string op, Pos p, ExprPtr l, ExprPtr r) {
    auto b = make(Expr::Kind::kBinary, p);
    b->name = std::move(op);
    b->args.push_back(std::move(l));
    b->args.push_back(std::move(r));
    return b;
  }
  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = take();
      e = binary(t.text, t.pos, std::move(e), parse_concat());
    }
    return e;
  }
  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      const Token& t = take();
      e = binary("~", t.pos, std::move(e), parse_math2());
    }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = take();
      e = binary(t.text, t.pos, std::move(e), parse_pow());
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      const Token& t = take();
      e = binary("**", t.pos, std::move(e), parse_unary(true));
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard g(*this, peek().pos);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& t = take();
      e = make(t.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, t.pos);
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }
  ExprPtr parse_primary() {
    const Token& t = peek();
    switch (t.type) {
      case Tok::kName: {
        take();
        auto lit = make(Expr::Kind::kLiteral, t.pos);
        if (t.text == "true" || t.text == "True") {
          lit->literal = Value::boolean(true);
        } else if (t.text == "false" || t.text == "False") {
          lit->literal = Value::boolean(false);
        } else if (t.text == "none" || t.text == "None") {
          lit->literal = Value::none();
        } else {
          auto n = make(Expr::Kind::kName, t.pos);
          n->name = t.text;
          return n;
        }
        return lit;
      }
      case Tok::kString: {
        take();
        std::string s = t.text;
        // Adjacent string literals concatenate, as in Python.
        while (peek().type == Tok::kString) s += take().text;
        auto lit = make(Expr::Kind::kLiteral, t.pos);
        lit->literal = Value::string(std::move(s));
        return lit;
      }
      case Tok::kInt: {
        take();
        auto lit = make(Expr::Kind::kLiteral, t.pos);
        const std::optional<Int> v = parse_int(t.text);
        if (!v) error(t.pos, "integer literal out of range (integers are 128-bit here)");
        lit->literal = Value::integer(*v);
        return lit;
      }
      case Tok::kFloat: {
        take();
        auto lit = make(Expr::Kind::kLiteral, t.pos);
        lit->literal = Value::real(std::strtod(t.text.c_str(), nullptr));
        return lit;
      }
      case Tok::kOp:
        if (t.text == "(") {
          take();
          if (is_op(")")) {
            take();
            return make(Expr::Kind::kTuple, t.pos);
          }
          ExprPtr e = parse_expr();
          if (is_op(",")) {
            auto tup = make(Expr::Kind::kTuple, t.pos);
            tup->args.push_back(std::move(e));
            while (is_op(",")) {
              take();
              if (is_op(")")) break;
              tup->args.push_back(parse_expr());
            }
            e = std::move(tup);
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          take();
          auto l = make(Expr::Kind::kList, t.pos);
          while (!is_op("]")) {
            l->args.push_back(parse_expr());
            if (!is_op("]")) expect_op(",");
          }
          take();
          return l;
        }
        if (t.text == "{") {
          take();
          auto d = make(Expr::Kind::kDict, t.pos);
          while (!is_op("}")) {
            d->args.push_back(parse_expr());
            expect_op(":");
            d->args.push_back(parse_expr());
            if (!is_op("}")) expect_op(",");
          }
          take();
          return d;
        }
        break;
      default:
        break;
    }
    error(t.pos, "expected an expression" + describe(t));
  }
  void parse_call_args(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == Tok::kName && is_op("=", 1)) {
        std::string k = take().text;
        take();
        call.kwargs.emplace_back(std::move(k), parse_expr());
      } else {
        if (!call.kwargs.empty())
          error(peek().pos, "a positional argument follows a keyword argument");
        call.args.push_back(parse_expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    take();
  }
  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const Pos p = take().pos;
        auto a = make(Expr::Kind::kAttr, p);
        if (peek().type == Tok::kInt)
          a->name = take().text;
        else
          a->name = ident();
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        const Pos p = take().pos;
        ExprPtr parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!is_op(":") && !is_op("]")) parts[k] = parse_expr();
          if (k < 2 && is_op(":")) {
            take();
            slice = true;
          } else {
            break;
          }
        }
        expect_op("]");
        auto s = make(slice ? Expr::Kind::kSlice : Expr::Kind::kItem, p);
        s->args.push_back(std::move(e));
        if (!slice && !parts[0]) error(p, "expected an index");
        for (int k = 0; k < (slice ? 3 : 1); ++k) s->args.push_back(std::move(parts[k]));
        e = std::move(s);
      } else if (is_op("(")) {
        auto c = make(Expr::Kind::kCall, peek().pos);
        c->args.push_back(std::move(e));
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        const Pos p = take().pos;
        auto f = make(Expr::Kind::kFilter, p);
        f->name = ident();
        f->args.push_back(std::move(e));
        if (is_op("(")) parse_call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        const Pos p = take().pos;
        auto t = make(Expr::Kind::kTest, p);
        if (is_name("not")) {
          take();
          t->negated = true;
        }
        if (peek().type == Tok::kName) {
          t->name = take().text;
        } else if (peek().type == Tok::kOp &&
                   (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                    peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
          t->name = take().text;
        } else {
          error(peek().pos, "expected a test name" + describe(peek()));
        }
        t->args.push_back(std::move(e));
        if (is_op("(")) {
          parse_call_args(*t);
        } else if (peek().type == Tok::kString || peek().type == Tok::kInt ||
                   peek().type == Tok::kFloat ||
                   (peek().type == Tok::kName && !is_name("and") && !is_name("or") &&
                    !is_name("else") && !is_name("if") && !is_name("in") && !is_name("not") &&
                    !is_name("is"))) {
          // `x is divisibleby 3`, `x is sameas none`: one argument without parentheses.
          t->args.push_back(parse_primary());
        }
        e = std::move(t);
      } else if (is_op("(")) {
        auto c = make(Expr::Kind::kCall, peek().pos);
        c->args.push_back(std::move(e));
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  const std::string& name_;
  int depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Interpreter.

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

  Interp(const std::string& n, const RenderLimits& l) : name(n), limits(l) {
    scopes.emplace_back();
  }

  [[noreturn]] void error(Pos p, const std::string& msg) const {
    throw TemplateError(detail::concat(name, ":", p.line, ":", p.col, ": ", msg));
  }

  void count_iteration(Pos p) {
    if (++iterations > limits.max_loop_iterations)
      error(p, detail::concat("more than ", limits.max_loop_iterations,
                              " loop iterations in one render (RenderLimits)"));
  }

  void append(std::string& out, std::string_view s, Pos p) const {
    if (out.size() + s.size() > limits.max_output_bytes)
      error(p, detail::concat("the output would exceed ", limits.max_output_bytes,
                              " bytes (RenderLimits)"));
    out.append(s);
  }

  Value lookup(const std::string& n) const {
    for (size_t k = scopes.size(); k-- > barrier;) {
      const auto it = scopes[k].find(n);
      if (it != scopes[k].end()) return it->second;
    }
    const auto it = scopes[0].find(n);
    if (it != scopes[0].end()) return it->second;
    return Value::undefined(n);
  }
  void assign(const std::string& n, Value v) { scopes.back()[n] = std::move(v); }

  // ---- expressions

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName:
        return lookup(e.name);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        List l;
        for (const auto& a : e.args) l.push_back(eval(*a));
        return Value::make_list(std::move(l));
      }
      case Expr::Kind::kDict: {
        Value d = Value::make_dict();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          const Value key = eval(*e.args[k]);
          if (!key.is_string()) error(e.args[k]->pos, "dict keys must be strings");
          d.dict->set(key.s, eval(*e.args[k + 1]));
        }
        return d;
      }
      case Expr::Kind::kAttr:
        return get_attr(eval(*e.args[0]), e.name, e.pos);
      case Expr::Kind::kItem:
        return get_item(eval(*e.args[0]), eval(*e.args[1]), e.pos);
      case Expr::Kind::kSlice:
        return slice(e);
      case Expr::Kind::kCall: {
        const Value f = eval(*e.args[0]);
        Args a = eval_args(e, 1);
        if (f.kind != Value::Kind::kCallable) {
          if (f.is_undefined())
            error(e.pos, detail::concat("'", f.s.empty() ? "value" : f.s,
                                        "' is undefined and cannot be called"));
          error(e.pos, detail::concat("a ", kind_name(f), " is not callable"));
        }
        return (*f.fn)(*this, a);
      }
      case Expr::Kind::kFilter: {
        const Value in = eval(*e.args[0]);
        Args a = eval_args(e, 1);
        return apply_filter(e.name, in, a);
      }
      case Expr::Kind::kTest: {
        const Value in = eval(*e.args[0]);
        Args a = eval_args(e, 1);
        const bool r = apply_test(e.name, in, a);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::Kind::kNot:
        return Value::boolean(!truthy(eval(*e.args[0])));
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        const Value v = eval(*e.args[0]);
        if (!numeric_like(v))
          error(e.pos, detail::concat("bad operand type for unary ",
                                      e.kind == Expr::Kind::kNeg ? "-" : "+", ": ", kind_name(v)));
        if (e.kind == Expr::Kind::kPos) return v;
        if (v.kind == Value::Kind::kFloat) return Value::real(-v.f);
        Int negated = 0;
        if (__builtin_sub_overflow(Int{0}, int_of(v), &negated))
          error(e.pos, "integer overflow in unary - (integers are 128-bit here)");
        return Value::integer(negated);
      }
      case Expr::Kind::kAnd: {
        Value l = eval(*e.args[0]);
        return truthy(l) ? eval(*e.args[1]) : l;
      }
      case Expr::Kind::kOr: {
        Value l = eval(*e.args[0]);
        return truthy(l) ? l : eval(*e.args[1]);
      }
      case Expr::Kind::kCond:
        if (truthy(eval(*e.args[0]))) return eval(*e.args[1]);
        return e.args[2] ? eval(*e.args[2]) : Value::undefined();
      case Expr::Kind::kBinary:
        return binary(e);
    }
    return Value::undefined();
  }

  Args eval_args(const Expr& e, size_t first) {
    Args a;
    a.at = e.pos;
    for (size_t k = first; k < e.args.size(); ++k) a.pos.push_back(eval(*e.args[k]));
    for (const auto& [n, x] : e.kwargs) a.kw.emplace_back(n, eval(*x));
    return a;
  }

  [[noreturn]] void undefined_error(const Value& v, Pos p, const std::string& what) const {
    error(p,
          detail::concat("'", v.s.empty() ? "value" : v.s, "' is undefined, so it has no ", what));
  }

  Value get_attr(const Value& obj, const std::string& attr, Pos p) {
    if (obj.is_undefined()) undefined_error(obj, p, "attribute '" + attr + "'");
    if (Value m = method(obj, attr, p); !m.is_undefined()) return m;
    if (obj.is_dict()) {
      if (const Value* v = obj.dict->find(attr)) return *v;
      return Value::undefined(attr);
    }
    if (obj.is_list() && !attr.empty() && std::isdigit(static_cast<unsigned char>(attr[0])))
      if (const std::optional<Int> k = parse_int(attr)) return get_item(obj, Value::integer(*k), p);
    return Value::undefined(attr);
  }

  Value get_item(const Value& obj, const Value& key, Pos p) {
    if (obj.is_undefined()) undefined_error(obj, p, "items");
    if (obj.is_dict()) {
      if (key.is_string()) {
        if (const Value* v = obj.dict->find(key.s)) return *v;
        if (Value m = method(obj, key.s, p); !m.is_undefined()) return m;
        return Value::undefined(key.s);
      }
      return Value::undefined();
    }
    if (obj.is_list() || obj.is_string()) {
      if (key.kind != Value::Kind::kInt && key.kind != Value::Kind::kBool) {
        if (key.is_string()) return get_attr(obj, key.s, p);
        error(p, detail::concat("indices must be integers, not ", kind_name(key)));
      }
      int64_t k = saturate_i64(int_of(key));
      if (obj.is_list()) {
        const auto n = static_cast<int64_t>(obj.list->size());
        if (k < 0) k += n;
        if (k < 0 || k >= n) return Value::undefined();
        return (*obj.list)[static_cast<size_t>(k)];
      }
      const auto cps = code_points(obj.s);
      const auto n = static_cast<int64_t>(cps.size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::undefined();
      return Value::string(std::string(cps[static_cast<size_t>(k)]));
    }
    return Value::undefined();
  }

  Value slice(const Expr& e) {
    const Value obj = eval(*e.args[0]);
    std::optional<int64_t> b[3];
    for (int k = 0; k < 3; ++k) {
      if (!e.args[static_cast<size_t>(k) + 1]) continue;
      const Value v = eval(*e.args[static_cast<size_t>(k) + 1]);
      if (v.is_none()) continue;
      if (v.kind != Value::Kind::kInt) error(e.pos, "slice indices must be integers");
      b[k] = saturate_i64(v.i);
    }
    const int64_t step = b[2].value_or(1);
    if (step == 0) error(e.pos, "slice step cannot be zero");
    std::vector<Value> items;
    std::vector<std::string_view> cps;
    int64_t n = 0;
    if (obj.is_list()) {
      n = static_cast<int64_t>(obj.list->size());
    } else if (obj.is_string()) {
      cps = code_points(obj.s);
      n = static_cast<int64_t>(cps.size());
    } else {
      error(e.pos, detail::concat("a ", kind_name(obj), " cannot be sliced"));
    }
    auto norm = [&](std::optional<int64_t> x, int64_t def, int64_t lo, int64_t hi) {
      if (!x) return def;
      int64_t v = *x < 0 ? *x + n : *x;
      return std::clamp(v, lo, hi);
    };
    const int64_t start = step > 0 ? norm(b[0], 0, 0, n) : norm(b[0], n - 1, -1, n - 1);
    const int64_t stop = step > 0 ? norm(b[1], n, 0, n) : norm(b[1], -1, -1, n - 1);
    List outl;
    std::string outs;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if (obj.is_list())
        outl.push_back((*obj.list)[static_cast<size_t>(k)]);
      else
        outs += cps[static_cast<size_t>(k)];
    }
    return obj.is_list() ? Value::make_list(std::move(outl)) : Value::string(std::move(outs));
  }

  bool contains(const Value& container, const Value& item, Pos p) {
    if (container.is_string()) {
      if (!item.is_string())
        error(p, detail::concat("'in <string>' requires a string, not ", kind_name(item)));
      return container.s.find(item.s) != std::string::npos;
    }
    if (container.is_list()) {
      for (const Value& v : *container.list)
        if (equal(v, item)) return true;
      return false;
    }
    if (container.is_dict()) return item.is_string() && container.dict->find(item.s);
    if (container.is_undefined()) undefined_error(container, p, "members");
    error(p, detail::concat("argument of type ", kind_name(container), " is not iterable"));
  }

  int compare(const Value& a, const Value& b, Pos p) {
    if (numeric_like(a) && numeric_like(b) && a.kind != Value::Kind::kFloat &&
        b.kind != Value::Kind::kFloat) {
      const Int x = int_of(a), y = int_of(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    if (numeric_like(a) && numeric_like(b)) {
      const double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.is_string() && b.is_string()) return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
    if (a.is_list() && b.is_list()) {
      const size_t n = std::min(a.list->size(), b.list->size());
      for (size_t k = 0; k < n; ++k)
        if (const int c = compare((*a.list)[k], (*b.list)[k], p)) return c;
      return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
    }
    error(p, detail::concat("cannot compare ", kind_name(a), " with ", kind_name(b)));
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    const Value l = eval(*e.args[0]);
    const Value r = eval(*e.args[1]);
    if (op == "==") return Value::boolean(equal(l, r));
    if (op == "!=") return Value::boolean(!equal(l, r));
    if (op == "<") return Value::boolean(compare(l, r, e.pos) < 0);
    if (op == "<=") return Value::boolean(compare(l, r, e.pos) <= 0);
    if (op == ">") return Value::boolean(compare(l, r, e.pos) > 0);
    if (op == ">=") return Value::boolean(compare(l, r, e.pos) >= 0);
    if (op == "in") return Value::boolean(contains(r, l, e.pos));
    if (op == "not in") return Value::boolean(!contains(r, l, e.pos));
    if (op == "~") {
      std::string s = to_str(l);
      const std::string t = to_str(r);
      if (s.size() + t.size() > limits.max_output_bytes)
        error(e.pos, "string too long (RenderLimits)");
      return Value::string(s + t);
    }
    if (op == "+") {
      if (l.is_string() && r.is_string()) {
        if (l.s.size() + r.s.size() > limits.max_output_bytes)
          error(e.pos, "string too long (RenderLimits)");
        return Value::string(l.s + r.s);
      }
      if (l.is_list() && r.is_list()) {
        List out = *l.list;
        out.insert(out.end(), r.list->begin(), r.list->end());
        return Value::make_list(std::move(out));
      }
    }
    if (op == "*" && ((l.is_string() && r.kind == Value::Kind::kInt) ||
                      (l.is_list() && r.kind == Value::Kind::kInt))) {
      const int64_t n = std::max<int64_t>(0, saturate_i64(r.i));
      const size_t unit = l.is_string() ? l.s.size() : l.list->size();
      if (unit != 0 && static_cast<uint64_t>(n) > limits.max_output_bytes / unit)
        error(e.pos, "repetition too long (RenderLimits)");
      if (l.is_string()) {
        std::string out;
        for (int64_t k = 0; k < n; ++k) out += l.s;
        return Value::string(std::move(out));
      }
      List out;
      for (int64_t k = 0; k < n; ++k) out.insert(out.end(), l.list->begin(), l.list->end());
      return Value::make_list(std::move(out));
    }
    if (!numeric_like(l) || !numeric_like(r))
      error(e.pos, detail::concat("unsupported operand types for ", op, ": ", kind_name(l), " and ",
                                  kind_name(r)));
    const bool ints = l.kind != Value::Kind::kFloat && r.kind != Value::Kind::kFloat;
    const Int a = int_of(l), b = int_of(r);
    const double x = l.as_double(), y = r.as_double();
    // Jinja's integers are unbounded (Python's); ours are 128-bit, so a result beyond that is an
    // error, never a wrapped (undefined) value.
    auto checked = [&](bool overflowed, Int v) {
      if (overflowed) error(e.pos, "integer overflow in " + op + " (integers are 128-bit here)");
      return Value::integer(v);
    };
    if (ints && (op == "+" || op == "-" || op == "*")) {
      Int v = 0;
      const bool overflowed = op == "+"   ? __builtin_add_overflow(a, b, &v)
                              : op == "-" ? __builtin_sub_overflow(a, b, &v)
                                          : __builtin_mul_overflow(a, b, &v);
      return checked(overflowed, v);
    }
    if (op == "+") return Value::real(x + y);
    if (op == "-") return Value::real(x - y);
    if (op == "*") return Value::real(x * y);
    if (op == "/") {
      if (y == 0) error(e.pos, "division by zero");
      return Value::real(x / y);
    }
    if (op == "//" || op == "%") {
      if (y == 0) error(e.pos, "division by zero");
      if (ints) {
        checked(a == kIntMin && b == -1, 0);
        Int q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {
          --q;
          m += b;
        }
        return Value::integer(op == "//" ? q : m);
      }
      const double q = std::floor(x / y);
      return Value::real(op == "//" ? q : x - q * y);
    }
    if (op == "**") {
      if (ints && b >= 0) {
        // By squaring: exact for any exponent whose result fits, an error past that.
        Int out = 1, base = a;
        bool overflowed = false;
        for (Int k = b; k > 0 && !overflowed; k >>= 1) {
          if (k & 1) overflowed = __builtin_mul_overflow(out, base, &out);
          if (k > 1 && !overflowed) overflowed = __builtin_mul_overflow(base, base, &base);
        }
        return checked(overflowed, out);
      }
      return Value::real(std::pow(x, y));
    }
    error(e.pos, "unknown operator " + op);
  }

  // ---- methods of strings and dicts

  Value method(const Value& obj, const std::string& m, Pos p) {
    (void)p;
    if (obj.is_string()) {
      const std::string s = obj.s;
      static const char* kStringMethods[] = {
          "startswith", "endswith", "strip", "lstrip", "rstrip", "split",      "upper",
          "lower",      "replace",  "title", "join",   "find",   "capitalize", "count"};
      if (std::find_if(std::begin(kStringMethods), std::end(kStringMethods),
                       [&](const char* n) { return m == n; }) == std::end(kStringMethods))
        return Value::undefined();
      return Value::callable([s, m](Interp& in, Args& a) { return in.string_method(s, m, a); });
    }
    if (obj.is_dict() && !obj.is_namespace) {
      if (m != "items" && m != "keys" && m != "values" && m != "get") return Value::undefined();
      const Value d = obj;
      return Value::callable([d, m](Interp& in, Args& a) -> Value {
        if (m == "items") return in.items_of(d, a.at);
        if (m == "keys" || m == "values") {
          List out;
          for (const auto& [k, v] : d.dict->items)
            out.push_back(m == "keys" ? Value::string(k) : v);
          return Value::make_list(std::move(out));
        }
        const auto key = a.get(0, "key");
        if (!key) in.error(a.at, "get() needs a key");
        if (key->is_string())
          if (const Value* v = d.dict->find(key->s)) return *v;
        return a.get(1, "default").value_or(Value::none());
      });
    }
    return Value::undefined();
  }

  std::string str_arg(const Args& a, size_t k, const char* n, const char* fn) {
    const auto v = a.get(k, n);
    if (!v || !v->is_string())
      error(a.at, detail::concat(fn, "() needs a string argument '", n, "'"));
    return v->s;
  }

  Value string_method(const std::string& s, const std::string& m, Args& a) {
    if (m == "startswith" || m == "endswith") {
      const auto arg = a.get(0, "prefix");
      if (!arg) error(a.at, m + "() needs an argument");
      std::vector<std::string> options;
      if (arg->is_string()) {
        options.push_back(arg->s);
      } else if (arg->is_list()) {
        for (const Value& v : *arg->list)
          if (v.is_string()) options.push_back(v.s);
      } else {
        error(a.at, m + "() needs a string or a tuple of strings");
      }
      for (const std::string& o : options) {
        if (m == "startswith"
                ? s.compare(0, o.size(), o) == 0
                : (s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0))
          return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (m == "strip" || m == "lstrip" || m == "rstrip") {
      const auto chars = a.get(0, "chars");
      std::optional<std::string_view> cs;
      if (chars && chars->is_string()) cs = chars->s;
      return Value::string(std::string(py_strip(s, m != "rstrip", m != "lstrip", cs)));
    }
    if (m == "upper" || m == "lower") return Value::string(map_case(s, m == "upper"));
    if (m == "title" || m == "capitalize") return Value::string(title_case(s, m == "title"));
    if (m == "replace") {
      const std::string from = str_arg(a, 0, "old", "replace");
      const std::string to = str_arg(a, 1, "new", "replace");
      const auto count = a.get(2, "count");
      return Value::string(replace_all(
          s, from, to, count && count->kind == Value::Kind::kInt ? saturate_i64(count->i) : -1,
          a.at));
    }
    if (m == "split") {
      const auto sep = a.get(0, "sep");
      const auto maxsplit_v = a.get(1, "maxsplit");
      const int64_t maxsplit =
          maxsplit_v && maxsplit_v->kind == Value::Kind::kInt ? saturate_i64(maxsplit_v->i) : -1;
      List out;
      if (!sep || sep->is_none()) {
        size_t k = 0;
        int64_t splits = 0;
        while (true) {
          while (const size_t n = py_space_at(s, k)) k += n;
          if (k >= s.size()) break;
          if (maxsplit >= 0 && splits >= maxsplit) {
            out.push_back(Value::string(std::string(py_strip(s.substr(k), false, true))));
            break;
          }
          size_t e = k;
          while (e < s.size() && py_space_at(s, e) == 0) ++e;
          out.push_back(Value::string(s.substr(k, e - k)));
          ++splits;
          k = e;
        }
        return Value::make_list(std::move(out));
      }
      if (!sep->is_string() || sep->s.empty()) error(a.at, "split() needs a non-empty separator");
      size_t k = 0;
      int64_t splits = 0;
      while (true) {
        const size_t f = s.find(sep->s, k);
        if (f == std::string::npos || (maxsplit >= 0 && splits >= maxsplit)) {
          out.push_back(Value::string(s.substr(k)));
          break;
        }
        out.push_back(Value::string(s.substr(k, f - k)));
        ++splits;
        k = f + sep->s.size();
      }
      return Value::make_list(std::move(out));
    }
    if (m == "join") {
      const auto items = a.get(0, "iterable");
      if (!items) error(a.at, "join() needs an argument");
      std::string out;
      bool first = true;
      for (const Value& v : iterate(*items, a.at)) {
        if (!first) out += s;
        first = false;
        out += to_str(v);
        if (out.size() > limits.max_output_bytes) error(a.at, "string too long (RenderLimits)");
      }
      return Value::string(std::move(out));
    }
    if (m == "find" || m == "count") {
      const std::string sub = str_arg(a, 0, "sub", m.c_str());
      if (m == "find") {
        const size_t f = s.find(sub);
        if (f == std::string::npos) return Value::integer(-1);
        return Value::integer(static_cast<int64_t>(code_points(s.substr(0, f)).size()));
      }
      if (sub.empty()) return Value::integer(static_cast<int64_t>(code_points(s).size()) + 1);
      int64_t n = 0;
      for (size_t f = s.find(sub); f != std::string::npos; f = s.find(sub, f + sub.size())) ++n;
      return Value::integer(n);
    }
    error(a.at, "unknown string method " + m);
  }

  std::string title_case(const std::string& s, bool every_word) {
    std::string out;
    bool start = true;
    for (size_t i = 0; i < s.size();) {
      const size_t b = i;
      next_code_point(s, i);
      const std::string cp = s.substr(b, i - b);
      const bool alpha = cp.size() > 1 || std::isalnum(static_cast<unsigned char>(cp[0]));
      if (start && alpha) {
        out += map_case(cp, true);
        start = false;
      } else {
        out += map_case(cp, false);
        if (every_word && !alpha) start = true;
      }
    }
    return out;
  }

  std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                          int64_t count, Pos p) {
    if (from.empty()) {
      // Python inserts `to` around every code point.
      std::string out = to;
      int64_t n = 1;
      for (size_t i = 0; i < s.size();) {
        const size_t b = i;
        next_code_point(s, i);
        out += s.substr(b, i - b);
        if (count < 0 || n < count) {
          out += to;
          ++n;
        }
        if (out.size() > limits.max_output_bytes) error(p, "string too long (RenderLimits)");
      }
      return out;
    }
    std::string out;
    size_t k = 0;
    int64_t n = 0;
    while (true) {
      const size_t f = s.find(from, k);
      if (f == std::string::npos || (count >= 0 && n >= count)) break;
      out.append(s, k, f - k);
      out += to;
      if (out.size() > limits.max_output_bytes) error(p, "string too long (RenderLimits)");
      k = f + from.size();
      ++n;
    }
    out.append(s, k, std::string::npos);
    return out;
  }

  Value items_of(const Value& d, Pos p) {
    if (!d.is_dict()) {
      if (d.is_undefined()) return Value::make_list();
      error(p, detail::concat("items() needs a mapping, not ", kind_name(d)));
    }
    List out;
    for (const auto& [k, v] : d.dict->items) out.push_back(Value::make_list({Value::string(k), v}));
    return Value::make_list(std::move(out));
  }

  // The elements a for loop (or a filter) walks: list items, dict keys, string characters.
  List iterate(const Value& v, Pos p) {
    switch (v.kind) {
      case Value::Kind::kList:
        return *v.list;
      case Value::Kind::kDict: {
        List out;
        for (const auto& [k, x] : v.dict->items) out.push_back(Value::string(k));
        return out;
      }
      case Value::Kind::kString: {
        List out;
        for (std::string_view cp : code_points(v.s)) out.push_back(Value::string(std::string(cp)));
        return out;
      }
      case Value::Kind::kUndefined:
        return {};
      default:
        error(p, detail::concat("a ", kind_name(v), " is not iterable"));
    }
  }

  // ---- filters and tests

  Value attribute_path(const Value& v, const std::string& path, Pos p) {
    Value cur = v;
    size_t k = 0;
    while (true) {
      const size_t dot = path.find('.', k);
      const std::string part = path.substr(k, dot == std::string::npos ? dot : dot - k);
      if (cur.is_undefined()) return cur;
      const std::optional<Int> index =
          !part.empty() && std::isdigit(static_cast<unsigned char>(part[0])) && cur.is_list()
              ? parse_int(part)
              : std::nullopt;
      if (index)
        cur = get_item(cur, Value::integer(*index), p);
      else
        cur = get_item(cur, Value::string(part), p);
      if (dot == std::string::npos) return cur;
      k = dot + 1;
    }
  }

  std::string sort_key_text(const Value& v, bool case_sensitive) {
    return v.is_string() && !case_sensitive ? map_case(v.s, false) : v.s;
  }

  void sort_values(List& items, bool case_sensitive, bool reverse,
                   const std::function<Value(const Value&)>& key, Pos p) {
    auto cmp_key = [&](const Value& v) {
      Value k = key(v);
      if (k.is_string() && !case_sensitive) k.s = map_case(k.s, false);
      return k;
    };
    std::vector<std::pair<Value, Value>> keyed;
    for (Value& v : items) keyed.emplace_back(cmp_key(v), std::move(v));
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
      return reverse ? compare(b.first, a.first, p) < 0 : compare(a.first, b.first, p) < 0;
    });
    items.clear();
    for (auto& kv : keyed) items.push_back(std::move(kv.second));
  }

  Value apply_filter(const std::string& f, const Value& in, Args& a) {
    const Pos p = a.at;
    if (f == "trim") {
      const auto chars = a.get(0, "chars");
      std::optional<std::string_view> cs;
      if (chars && chars->is_string()) cs = chars->s;
      return Value::string(std::string(py_strip(to_str(in), true, true, cs)));
    }
    if (f == "safe" || f == "string") return in.is_string() ? in : Value::string(to_str(in));
    if (f == "upper" || f == "lower") return Value::string(map_case(to_str(in), f == "upper"));
    if (f == "capitalize" || f == "title")
      return Value::string(title_case(to_str(in), f == "title"));
    if (f == "length" || f == "count") {
      if (in.is_string()) return Value::integer(static_cast<int64_t>(code_points(in.s).size()));
      if (in.is_list()) return Value::integer(static_cast<int64_t>(in.list->size()));
      if (in.is_dict()) return Value::integer(static_cast<int64_t>(in.dict->items.size()));
      if (in.is_undefined()) return Value::integer(0);
      error(p, detail::concat("object of type ", kind_name(in), " has no length"));
    }
    if (f == "tojson") {
      const auto indent = a.get(0, "indent");
      const auto sort_keys = a.get(1, "sort_keys");
      std::string out;
      to_json_text(out, in, indent && indent->kind == Value::Kind::kInt ? int(indent->i) : -1,
                   sort_keys && truthy(*sort_keys), 0);
      return Value::string(std::move(out));
    }
    if (f == "default" || f == "d") {
      const Value def = a.get(0, "default_value").value_or(Value::string(""));
      const auto boolean = a.get(1, "boolean");
      if (in.is_undefined() || (boolean && truthy(*boolean) && !truthy(in))) return def;
      return in;
    }
    if (f == "items") return items_of(in, p);
    if (f == "list") return Value::make_list(iterate(in, p));
    if (f == "first" || f == "last") {
      const List l = iterate(in, p);
      if (l.empty()) return Value::undefined();
      return f == "first" ? l.front() : l.back();
    }
    if (f == "reverse") {
      if (in.is_string()) {
        auto cps = code_points(in.s);
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value::string(out);
      }
      List l = iterate(in, p);
      std::reverse(l.begin(), l.end());
      return Value::make_list(std::move(l));
    }
    if (f == "join") {
      const Value sep = a.get(0, "d").value_or(Value::string(""));
      const auto attr = a.get(1, "attribute");
      std::string out;
      bool first = true;
      for (const Value& v : iterate(in, p)) {
        if (!first) out += to_str(sep);
        first = false;
        out += to_str(attr && attr->is_string() ? attribute_path(v, attr->s, p) : v);
        if (out.size() > limits.max_output_bytes) error(p, "string too long (RenderLimits)");
      }
      return Value::string(std::move(out));
    }
    if (f == "replace") {
      const auto from = a.get(0, "old"), to = a.get(1, "new");
      if (!from || !to) error(p, "replace needs two arguments");
      const auto count = a.get(2, "count");
      return Value::string(
          replace_all(to_str(in), to_str(*from), to_str(*to),
                      count && count->kind == Value::Kind::kInt ? saturate_i64(count->i) : -1, p));
    }
    if (f == "int") {
      // Jinja's do_int: int(value), else int(float(value)) ("42.5" gives 42), else the default.
      // Python's int() of an infinite float raises, and so does a value past our 128 bits.
      const auto truncated = [&](double x) -> std::optional<Value> {
        if (std::isnan(x)) return std::nullopt;
        if (!(std::fabs(x) < 0x1p127)) error(p, "int: " + python_float_repr(x) + " is too large");
        return Value::integer(static_cast<Int>(x));
      };
      std::optional<Value> out;
      if (in.kind == Value::Kind::kFloat) out = truncated(in.f);
      if (in.kind == Value::Kind::kInt || in.kind == Value::Kind::kBool)
        out = Value::integer(int_of(in));
      if (in.is_string()) {
        const std::string_view t = py_strip(in.s, true, true);
        if (const std::optional<Int> v = parse_int(t)) {
          out = Value::integer(*v);
        } else if (!t.empty()) {
          const std::string text(t);
          char* end = nullptr;
          const double x = std::strtod(text.c_str(), &end);
          if (end == text.c_str() + text.size()) out = truncated(x);
        }
      }
      return out ? *out : a.get(0, "default").value_or(Value::integer(0));
    }
    if (f == "float") {
      if (numeric_like(in)) return Value::real(in.as_double());
      if (in.is_string()) {
        char* end = nullptr;
        const double v = std::strtod(in.s.c_str(), &end);
        if (end && *end == '\0' && !in.s.empty()) return Value::real(v);
      }
      return a.get(0, "default").value_or(Value::real(0));
    }
    if (f == "abs") {
      if (in.kind == Value::Kind::kFloat) return Value::real(std::fabs(in.f));
      if (numeric_like(in)) {
        const Int v = int_of(in);
        if (v == kIntMin) error(p, "integer overflow in abs (integers are 128-bit here)");
        return Value::integer(v < 0 ? -v : v);
      }
      error(p, "abs needs a number");
    }
    if (f == "unique") {
      List out;
      for (const Value& v : iterate(in, p)) {
        bool seen = false;
        for (const Value& o : out) seen = seen || equal(o, v);
        if (!seen) out.push_back(v);
      }
      return Value::make_list(std::move(out));
    }
    if (f == "dictsort") {
      if (!in.is_dict()) error(p, "dictsort needs a mapping");
      const auto cs = a.get(0, "case_sensitive");
      const auto by = a.get(1, "by");
      const auto rev = a.get(2, "reverse");
      const bool by_value = by && by->is_string() && by->s == "value";
      List l = items_of(in, p).list ? *items_of(in, p).list : List{};
      sort_values(
          l, cs && truthy(*cs), rev && truthy(*rev),
          [&](const Value& kv) { return (*kv.list)[by_value ? 1 : 0]; }, p);
      return Value::make_list(std::move(l));
    }
    if (f == "sort") {
      const auto rev = a.get(0, "reverse");
      const auto cs = a.get(1, "case_sensitive");
      const auto attr = a.get(2, "attribute");
      List l = iterate(in, p);
      sort_values(
          l, cs && truthy(*cs), rev && truthy(*rev),
          [&](const Value& v) {
            return attr && attr->is_string() ? attribute_path(v, attr->s, p) : v;
          },
          p);
      return Value::make_list(std::move(l));
    }
    if (f == "map") {
      List out;
      const auto attr = a.get(99, "attribute");
      if (attr) {
        const auto def = a.get(99, "default");
        for (const Value& v : iterate(in, p)) {
          Value x = attribute_path(v, to_str(*attr), p);
          if (x.is_undefined() && def) x = *def;
          out.push_back(std::move(x));
        }
        return Value::make_list(std::move(out));
      }
      if (a.pos.empty() || !a.pos[0].is_string()) error(p, "map needs a filter name or attribute=");
      Args rest;
      rest.at = p;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const Value& v : iterate(in, p)) out.push_back(apply_filter(a.pos[0].s, v, rest));
      return Value::make_list(std::move(out));
    }
    if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
      const bool by_attr = f == "selectattr" || f == "rejectattr";
      const bool keep_if = f == "select" || f == "selectattr";
      size_t k = 0;
      std::string attr;
      if (by_attr) {
        if (a.pos.empty() || !a.pos[0].is_string()) error(p, f + " needs an attribute name");
        attr = a.pos[0].s;
        k = 1;
      }
      std::string test;
      if (k < a.pos.size()) {
        if (!a.pos[k].is_string()) error(p, f + ": the test name must be a string");
        test = a.pos[k].s;
      }
      Args targs;
      targs.at = p;
      if (k + 1 < a.pos.size())
        targs.pos.assign(a.pos.begin() + static_cast<long>(k) + 1, a.pos.end());
      List out;
      for (const Value& v : iterate(in, p)) {
        const Value x = by_attr ? attribute_path(v, attr, p) : v;
        const bool r = test.empty() ? truthy(x) : apply_test(test, x, targs);
        if (r == keep_if) out.push_back(v);
      }
      return Value::make_list(std::move(out));
    }
    if (f == "sum") {
      Value total = a.get(1, "start").value_or(Value::integer(0));
      const auto attr = a.get(0, "attribute");
      for (const Value& v : iterate(in, p)) {
        const Value x = attr && attr->is_string() ? attribute_path(v, attr->s, p) : v;
        if (!numeric_like(x) || !numeric_like(total)) error(p, "sum needs numbers");
        if (x.kind == Value::Kind::kFloat || total.kind == Value::Kind::kFloat)
          total = Value::real(total.as_double() + x.as_double());
        else if (Int sum = 0; __builtin_add_overflow(int_of(total), int_of(x), &sum))
          error(p, "integer overflow in sum (integers are 128-bit here)");
        else
          total = Value::integer(sum);
      }
      return total;
    }
    if (f == "indent") {
      const auto width = a.get(0, "width");
      const auto first = a.get(1, "first");
      const std::string pad(width && width->kind == Value::Kind::kInt
                                ? static_cast<size_t>(std::clamp<Int>(width->i, 0, 1000))
                                : 4,
                            ' ');
      const std::string s = to_str(in);
      std::string out = first && truthy(*first) ? pad : "";
      for (size_t k = 0; k < s.size(); ++k) {
        out += s[k];
        if (s[k] == '\n' && k + 1 < s.size() && s[k + 1] != '\n') out += pad;
        if (out.size() > limits.max_output_bytes) error(p, "string too long (RenderLimits)");
      }
      return Value::string(std::move(out));
    }
    error(p, "unknown filter '" + f + "'");
  }

  bool apply_test(const std::string& t, const Value& v, Args& a) {
    const Pos p = a.at;
    if (t == "defined") return !v.is_undefined();
    if (t == "undefined") return v.is_undefined();
    if (t == "none") return v.is_none();
    if (t == "string") return v.is_string();
    if (t == "mapping") return v.is_dict();
    if (t == "sequence" || t == "iterable") return v.is_list() || v.is_string() || v.is_dict();
    if (t == "number") return numeric_like(v) && v.kind != Value::Kind::kBool;
    if (t == "integer") return v.kind == Value::Kind::kInt;
    if (t == "float") return v.kind == Value::Kind::kFloat;
    if (t == "boolean") return v.kind == Value::Kind::kBool;
    if (t == "true") return v.kind == Value::Kind::kBool && v.b;
    if (t == "false") return v.kind == Value::Kind::kBool && !v.b;
    if (t == "callable") return v.kind == Value::Kind::kCallable;
    if (t == "lower") return v.is_string() && map_case(v.s, false) == v.s;
    if (t == "upper") return v.is_string() && map_case(v.s, true) == v.s;
    const auto arg = a.get(0, "other");
    auto need = [&]() -> const Value& {
      if (!arg) error(p, "test '" + t + "' needs an argument");
      return *arg;
    };
    if (t == "equalto" || t == "eq" || t == "==" || t == "sameas") return equal(v, need());
    if (t == "ne" || t == "!=") return !equal(v, need());
    if (t == "lt" || t == "<" || t == "lessthan") return compare(v, need(), p) < 0;
    if (t == "le" || t == "<=") return compare(v, need(), p) <= 0;
    if (t == "gt" || t == ">" || t == "greaterthan") return compare(v, need(), p) > 0;
    if (t == "ge" || t == ">=") return compare(v, need(), p) >= 0;
    if (t == "in") return contains(need(), v, p);
    if (t == "odd" || t == "even" || t == "divisibleby") {
      if (v.kind != Value::Kind::kInt) return false;
      if (t == "odd") return v.i % 2 != 0;
      if (t == "even") return v.i % 2 == 0;
      const Value& d = need();
      if (d.kind != Value::Kind::kInt || d.i == 0) error(p, "divisibleby needs a non-zero integer");
      return d.i == -1 || v.i % d.i == 0;  // kIntMin % -1 would trap
    }
    error(p, "unknown test '" + t + "'");
  }

  // ---- statements

  void exec(const Body& body, std::string& out) {
    for (const auto& n : body) exec(*n, out);
  }

  void exec(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::Kind::kText:
        append(out, n.text, n.pos);
        return;
      case Node::Kind::kOutput:
        append(out, to_str(eval(*n.expr)), n.pos);
        return;
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches)
          if (truthy(eval(*cond))) {
            exec(body, out);
            return;
          }
        exec(n.else_body, out);
        return;
      case Node::Kind::kFor:
        exec_for(n, out);
        return;
      case Node::Kind::kSet: {
        Value v = eval(*n.expr);
        if (n.attr.empty()) {
          assign(n.text, std::move(v));
          return;
        }
        const Value ns = lookup(n.text);
        if (!ns.is_dict() || !ns.is_namespace)
          error(n.pos, detail::concat("cannot assign attribute '", n.attr, "' of '", n.text,
                                      "': it is not a namespace()"));
        ns.dict->set(n.attr, std::move(v));
        return;
      }
      case Node::Kind::kSetBlock: {
        std::string captured;
        exec(n.body, captured);
        assign(n.text, Value::string(std::move(captured)));
        return;
      }
      case Node::Kind::kMacro:
        assign(n.text, make_macro(n));
        return;
      case Node::Kind::kBreak:
        throw BreakSignal{};
      case Node::Kind::kContinue:
        throw ContinueSignal{};
    }
  }

  void exec_for(const Node& n, std::string& out) {
    const Value seq = eval(*n.expr);
    List items = iterate(seq, n.expr->pos);
    scopes.emplace_back();
    auto bind = [&](const Value& item) {
      if (n.targets.size() == 1) {
        assign(n.targets[0], item);
        return;
      }
      if (!item.is_list() || item.list->size() != n.targets.size())
        error(n.pos, detail::concat("cannot unpack a ", kind_name(item), " into ", n.targets.size(),
                                    " loop variables"));
      for (size_t k = 0; k < n.targets.size(); ++k) assign(n.targets[k], (*item.list)[k]);
    };
    if (n.filter) {
      // The loop's `if` runs before loop.* is known, so loop.length counts the kept items.
      List kept;
      for (const Value& item : items) {
        count_iteration(n.pos);
        bind(item);
        if (truthy(eval(*n.filter))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const auto len = static_cast<int64_t>(items.size());
    try {
      for (int64_t k = 0; k < len; ++k) {
        count_iteration(n.pos);
        bind(items[static_cast<size_t>(k)]);
        Value loop = Value::make_dict();
        Dict& d = *loop.dict;
        d.set("index", Value::integer(k + 1));
        d.set("index0", Value::integer(k));
        d.set("revindex", Value::integer(len - k));
        d.set("revindex0", Value::integer(len - k - 1));
        d.set("first", Value::boolean(k == 0));
        d.set("last", Value::boolean(k == len - 1));
        d.set("length", Value::integer(len));
        d.set("previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("previtem"));
        d.set("nextitem",
              k + 1 < len ? items[static_cast<size_t>(k + 1)] : Value::undefined("nextitem"));
        assign("loop", std::move(loop));
        try {
          exec(n.body, out);
        } catch (const ContinueSignal&) {
        }
      }
    } catch (const BreakSignal&) {
    }
    scopes.pop_back();
    if (len == 0) exec(n.else_body, out);
  }

  Value make_macro(const Node& n) {
    const Node* node = &n;
    return Value::callable([node](Interp& in, Args& a) -> Value {
      if (++in.call_depth > in.limits.max_call_depth)
        in.error(a.at, detail::concat("macro '", node->text, "' nested more than ",
                                      in.limits.max_call_depth, " calls deep (RenderLimits)"));
      if (a.pos.size() > node->params.size())
        in.error(a.at, detail::concat("macro '", node->text, "' takes ", node->params.size(),
                                      " arguments, ", a.pos.size(), " given"));
      std::unordered_map<std::string, Value> frame;
      for (size_t k = 0; k < node->params.size(); ++k) {
        const auto& [pname, def] = node->params[k];
        std::optional<Value> v;
        if (k < a.pos.size()) v = a.pos[k];
        for (const auto& [kn, kv] : a.kw)
          if (kn == pname) v = kv;
        if (!v) v = def ? in.eval(*def) : Value::undefined(pname);
        frame[pname] = *v;
      }
      for (const auto& [kn, kv] : a.kw) {
        bool known = false;
        for (const auto& prm : node->params) known = known || prm.first == kn;
        if (!known)
          in.error(a.at, detail::concat("macro '", node->text, "' has no parameter '", kn, "'"));
      }
      const size_t saved_barrier = in.barrier;
      const size_t saved_scopes = in.scopes.size();
      in.barrier = in.scopes.size();
      in.scopes.push_back(std::move(frame));
      std::string out;
      try {
        in.exec(node->body, out);
      } catch (...) {
        in.scopes.resize(saved_scopes);
        in.barrier = saved_barrier;
        --in.call_depth;
        throw;
      }
      in.scopes.resize(saved_scopes);
      in.barrier = saved_barrier;
      --in.call_depth;
      return Value::string(std::move(out));
    });
  }

  void install_globals() {
    auto& g = scopes[0];
    g["raise_exception"] = Value::callable([](Interp&, Args& a) -> Value {
      throw TemplateRaised(a.pos.empty() ? std::string("the template raised an exception")
                                         : to_str(a.pos[0]));
    });
    g["namespace"] = Value::callable([](Interp&, Args& a) -> Value {
      Value ns = Value::make_dict();
      ns.is_namespace = true;
      if (!a.pos.empty() && a.pos[0].is_dict())
        for (const auto& [k, v] : a.pos[0].dict->items) ns.dict->set(k, v);
      for (const auto& [k, v] : a.kw) ns.dict->set(k, v);
      return ns;
    });
    g["dict"] = Value::callable([](Interp&, Args& a) -> Value {
      Value d = Value::make_dict();
      if (!a.pos.empty() && a.pos[0].is_dict())
        for (const auto& [k, v] : a.pos[0].dict->items) d.dict->set(k, v);
      for (const auto& [k, v] : a.kw) d.dict->set(k, v);
      return d;
    });
    g["range"] = Value::callable([](Interp& in, Args& a) -> Value {
      Int start = 0, stop = 0, step = 1;
      for (const Value& v : a.pos)
        if (v.kind != Value::Kind::kInt) in.error(a.at, "range() needs integers");
      if (a.pos.size() == 1) {
        stop = a.pos[0].i;
      } else if (a.pos.size() >= 2) {
        start = a.pos[0].i;
        stop = a.pos[1].i;
        if (a.pos.size() >= 3) step = a.pos[2].i;
      } else {
        in.error(a.at, "range() needs an argument");
      }
      if (step == 0) in.error(a.at, "range() step must not be zero");
      List out;
      for (Int k = start; step > 0 ? k < stop : k > stop;) {
        in.count_iteration(a.at);
        out.push_back(Value::integer(k));
        if (__builtin_add_overflow(k, step, &k)) break;  // past every 128-bit stop
      }
      return Value::make_list(std::move(out));
    });
    g["strftime_now"] = Value::callable([](Interp& in, Args& a) -> Value {
      if (a.pos.empty() || !a.pos[0].is_string()) in.error(a.at, "strftime_now needs a format");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof(buf), a.pos[0].s.c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
  }
};

}  // namespace

std::string python_lower(std::string_view s) {
  return map_case(s, false);
}

struct Template::Program {
  std::string name;
  Body body;
};

Template::Template(std::string_view source, std::string name)
    : program_(std::make_unique<Program>()) {
  program_->name = std::move(name);
  Lexer lexer(source, program_->name);
  Parser parser(lexer.run(), program_->name);
  program_->body = parser.parse_template();
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

const std::string& Template::name() const {
  return program_->name;
}

std::string Template::render(const ordered_json& context, const RenderLimits& limits) const {
  if (!context.is_object()) throw TemplateError(program_->name + ": the context must be an object");
  Interp in(program_->name, limits);
  in.install_globals();
  // The context, the globals and the template's top-level variables share the root scope, which
  // macros see too.
  for (const auto& [k, v] : context.items()) in.scopes[0][k] = from_json(v);
  std::string out;
  try {
    in.exec(program_->body, out);
  } catch (const BreakSignal&) {
    throw TemplateError(program_->name + ": {% break %} outside a loop");
  } catch (const ContinueSignal&) {
    throw TemplateError(program_->name + ": {% continue %} outside a loop");
  }
  return out;
}

}  // namespace gemstage::jinja
