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

#include "template/evaluator.h"

namespace gemstage::jinja::internal {

// ---- methods of strings and dicts

Value Interp::method(const Value& obj, const std::string& m, Pos p) {
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
        for (const auto& [k, v] : d.dict->items) out.push_back(m == "keys" ? Value::string(k) : v);
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

std::string Interp::str_arg(const Args& a, size_t k, const char* n, const char* fn) {
  const auto v = a.get(k, n);
  if (!v || !v->is_string())
    error(a.at, detail::concat(fn, "() needs a string argument '", n, "'"));
  return v->s;
}

Value Interp::string_method(const std::string& s, const std::string& m, Args& a) {
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
    return Value::string(
        replace_all(s, from, to,
                    count && count->kind == Value::Kind::kInt ? saturate_i64(count->i) : -1, a.at));
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

std::string Interp::title_case(const std::string& s, bool every_word) {
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

std::string Interp::replace_all(const std::string& s, const std::string& from,
                                const std::string& to, int64_t count, Pos p) {
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

Value Interp::items_of(const Value& d, Pos p) {
  if (!d.is_dict()) {
    if (d.is_undefined()) return Value::make_list();
    error(p, detail::concat("items() needs a mapping, not ", kind_name(d)));
  }
  List out;
  for (const auto& [k, v] : d.dict->items) out.push_back(Value::make_list({Value::string(k), v}));
  return Value::make_list(std::move(out));
}

List Interp::iterate(const Value& v, Pos p) {
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

Value Interp::attribute_path(const Value& v, const std::string& path, Pos p) {
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

std::string Interp::sort_key_text(const Value& v, bool case_sensitive) {
  return v.is_string() && !case_sensitive ? map_case(v.s, false) : v.s;
}

void Interp::sort_values(List& items, bool case_sensitive, bool reverse,
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

Value Interp::apply_filter(const std::string& f, const Value& in, Args& a) {
  const Pos p = a.at;
  if (f == "trim") {
    const auto chars = a.get(0, "chars");
    std::optional<std::string_view> cs;
    if (chars && chars->is_string()) cs = chars->s;
    return Value::string(std::string(py_strip(to_str(in), true, true, cs)));
  }
  if (f == "safe" || f == "string") return in.is_string() ? in : Value::string(to_str(in));
  if (f == "upper" || f == "lower") return Value::string(map_case(to_str(in), f == "upper"));
  if (f == "capitalize" || f == "title") return Value::string(title_case(to_str(in), f == "title"));
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

bool Interp::apply_test(const std::string& t, const Value& v, Args& a) {
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

}  // namespace gemstage::jinja::internal
