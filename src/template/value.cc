#include "template/value.h"

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
    if (digits.size() > 1) out.append(".").append(digits, 1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    return out + eb;
  }
  if (exp10 < 0) {
    out.append("0.").append(static_cast<size_t>(-exp10 - 1), '0').append(digits);
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

namespace internal {

std::string int_str(Int v) {
  if (v >= std::numeric_limits<int64_t>::min() && v <= std::numeric_limits<int64_t>::max())
    return std::to_string(static_cast<int64_t>(v));
  UInt m = v < 0 ? UInt{0} - static_cast<UInt>(v) : static_cast<UInt>(v);
  std::string digits;
  for (; m != 0; m /= 10) digits += static_cast<char>('0' + static_cast<int>(m % 10));
  if (v < 0) digits += '-';
  return {digits.rbegin(), digits.rend()};
}

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

int64_t saturate_i64(Int v) {
  return v < std::numeric_limits<int64_t>::min()   ? std::numeric_limits<int64_t>::min()
         : v > std::numeric_limits<int64_t>::max() ? std::numeric_limits<int64_t>::max()
                                                   : static_cast<int64_t>(v);
}

// ---------------------------------------------------------------------------------------------
// Numbers and text as Python prints and compares them.

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

bool is_py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

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

size_t py_space_before(std::string_view s, size_t e) {
  for (size_t n = 1; n <= 3 && n <= e; ++n)
    if (py_space_at(s, e - n) == n) return n;
  return 0;
}

std::string_view py_strip(std::string_view s, bool left, bool right,
                          std::optional<std::string_view> chars) {
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

}  // namespace internal
}  // namespace gemstage::jinja
