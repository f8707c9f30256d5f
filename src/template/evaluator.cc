#include "template/evaluator.h"

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

namespace gemstage::jinja::internal {

Interp::Interp(const std::string& n, const RenderLimits& l) : name(n), limits(l) {
  scopes.emplace_back();
}

void Interp::error(Pos p, const std::string& msg) const {
  throw TemplateError(detail::concat(name, ":", p.line, ":", p.col, ": ", msg));
}

void Interp::count_iteration(Pos p) {
  if (++iterations > limits.max_loop_iterations)
    error(p, detail::concat("more than ", limits.max_loop_iterations,
                            " loop iterations in one render (RenderLimits)"));
}

void Interp::append(std::string& out, std::string_view s, Pos p) const {
  if (out.size() + s.size() > limits.max_output_bytes)
    error(p, detail::concat("the output would exceed ", limits.max_output_bytes,
                            " bytes (RenderLimits)"));
  out.append(s);
}

Value Interp::lookup(const std::string& n) const {
  for (size_t k = scopes.size(); k-- > barrier;) {
    const auto it = scopes[k].find(n);
    if (it != scopes[k].end()) return it->second;
  }
  const auto it = scopes[0].find(n);
  if (it != scopes[0].end()) return it->second;
  return Value::undefined(n);
}

void Interp::assign(const std::string& n, Value v) {
  scopes.back()[n] = std::move(v);
}

// ---- expressions

Value Interp::eval(const Expr& e) {
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

Args Interp::eval_args(const Expr& e, size_t first) {
  Args a;
  a.at = e.pos;
  for (size_t k = first; k < e.args.size(); ++k) a.pos.push_back(eval(*e.args[k]));
  for (const auto& [n, x] : e.kwargs) a.kw.emplace_back(n, eval(*x));
  return a;
}

void Interp::undefined_error(const Value& v, Pos p, const std::string& what) const {
  error(p, detail::concat("'", v.s.empty() ? "value" : v.s, "' is undefined, so it has no ", what));
}

Value Interp::get_attr(const Value& obj, const std::string& attr, Pos p) {
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

Value Interp::get_item(const Value& obj, const Value& key, Pos p) {
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

Value Interp::slice(const Expr& e) {
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

bool Interp::contains(const Value& container, const Value& item, Pos p) {
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

int Interp::compare(const Value& a, const Value& b, Pos p) {
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

Value Interp::binary(const Expr& e) {
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

// ---- statements

void Interp::exec(const Body& body, std::string& out) {
  for (const auto& n : body) exec(*n, out);
}

void Interp::exec(const Node& n, std::string& out) {
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

void Interp::exec_for(const Node& n, std::string& out) {
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

Value Interp::make_macro(const Node& n) {
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

void Interp::install_globals() {
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

}  // namespace gemstage::jinja::internal
