#include "runtime/json_constraint.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>

#include "core/error.h"

namespace gemstage {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// The compiled schema.

enum TypeBit : uint8_t {
  kObjectT = 1,
  kArrayT = 2,
  kStringT = 4,
  kIntegerT = 8,
  kNumberT = 16,  // any number (includes integers)
  kBooleanT = 32,
  kNullT = 64,
  kAllT = 127,
};

struct JsonSchemaNode {
  uint8_t types = kAllT;
  // A literal node (enum / const) matches exactly one of these compact JSON texts.
  std::vector<std::string> literals;
  // Objects: declared properties in order; `free_keys`: any keys, each with `free_value`.
  std::vector<std::string> prop_names;
  std::vector<const JsonSchemaNode*> prop_nodes;
  uint64_t required = 0;
  bool free_keys = true;
  const JsonSchemaNode* free_value = nullptr;  // null: any value
  // Arrays.
  // Element i takes prefix_items[i] (prefixItems, or a draft-07 tuple `items`), the rest `items`.
  std::vector<const JsonSchemaNode*> prefix_items;
  const JsonSchemaNode* items = nullptr;  // null: any value
  int64_t min_items = 0, max_items = std::numeric_limits<int64_t>::max();
  // Strings (characters).
  int64_t min_length = 0, max_length = std::numeric_limits<int64_t>::max();
  // Integers.
  bool has_min = false, has_max = false;
  int64_t minimum = 0, maximum = 0;
};

JsonGrammar::JsonGrammar() = default;
JsonGrammar::~JsonGrammar() = default;

namespace {

constexpr size_t kMaxProperties = 64;  // one bit each in the matcher
constexpr size_t kMaxLiterals = 64;
constexpr size_t kMaxNodes = 4096;
constexpr int kMaxSchemaDepth = 24;

const json* get(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

}  // namespace

namespace {

// A JSON value as Gemma's call arguments write it: strings between <|"|> (kGemmaQuote), bare
// keys in sorted order, everything else as JSON.
std::string gemma_text(const json& v) {
  if (v.is_string()) {
    std::string out(1, static_cast<char>(kGemmaQuote));
    out += v.get<std::string>();
    out.push_back(static_cast<char>(kGemmaQuote));
    return out;
  }
  if (v.is_object()) {
    std::string out = "{";
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (out.size() > 1) out += ",";
      out += it.key() + ":" + gemma_text(it.value());
    }
    return out + "}";
  }
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) out += ",";
      out += gemma_text(v[i]);
    }
    return out + "]";
  }
  return v.dump();
}

}  // namespace

struct JsonSchemaCompiler {
  JsonGrammar& g;
  const json& document;

  std::string literal(const json& v) const {
    return g.dialect_ == JsonDialect::kGemmaArgs ? gemma_text(v) : v.dump();
  }

  [[noreturn]] static void refuse(const std::string& where, const std::string& what) {
    fail("schema at ", where.empty() ? "#" : where, ": ", what);
  }

  JsonSchemaNode* node() {
    if (g.nodes_.size() >= kMaxNodes)
      refuse("#", "has more than " + std::to_string(kMaxNodes) + " subschemas");
    g.nodes_.push_back(std::make_unique<JsonSchemaNode>());
    return g.nodes_.back().get();
  }

  static int64_t integer(const json& v, const std::string& where) {
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18)
        return static_cast<int64_t>(d);
    }
    refuse(where, "must be an integer");
  }

  static uint8_t type_bit(const json& t, const std::string& where) {
    if (!t.is_string()) refuse(where, "a type must be a string");
    const std::string s = t.get<std::string>();
    if (s == "object") return kObjectT;
    if (s == "array") return kArrayT;
    if (s == "string") return kStringT;
    if (s == "integer") return kIntegerT;
    if (s == "number") return kNumberT | kIntegerT;
    if (s == "boolean") return kBooleanT;
    if (s == "null") return kNullT;
    refuse(where, "unknown type '" + s + "'");
  }

  const JsonSchemaNode* compile(const json& s, const std::string& where, int depth) {
    if (depth > kMaxSchemaDepth)
      refuse(where, "nests deeper than " + std::to_string(kMaxSchemaDepth) +
                        " levels (or its $refs recurse)");
    if (s.is_boolean()) {
      if (!s.get<bool>()) refuse(where, "'false' allows no value");
      return node();
    }
    if (!s.is_object()) refuse(where, "a schema must be an object");
    for (const char* key :
         {"pattern", "allOf", "not", "if", "multipleOf", "patternProperties", "propertyNames",
          "dependentRequired", "dependentSchemas", "contains", "uniqueItems", "minProperties",
          "maxProperties", "unevaluatedProperties", "unevaluatedItems"})
      if (get(s, key)) refuse(where + "/" + key, "is not supported in constrained output");
    if (const json* ref = get(s, "$ref")) return compile(resolve(*ref, where), where, depth + 1);
    for (const char* key : {"anyOf", "oneOf"})
      if (const json* alts = get(s, key)) return compile_union(s, *alts, where + "/" + key, depth);
    JsonSchemaNode* n = node();
    if (const json* c = get(s, "const")) {
      n->literals.push_back(literal(*c));
      return n;
    }
    if (const json* e = get(s, "enum")) {
      if (!e->is_array() || e->empty()) refuse(where + "/enum", "must be a non-empty array");
      if (e->size() > kMaxLiterals)
        refuse(where + "/enum", "has more than " + std::to_string(kMaxLiterals) + " values");
      for (const json& v : *e) n->literals.push_back(literal(v));
      return n;
    }
    if (const json* t = get(s, "type")) {
      n->types = 0;
      if (t->is_array()) {
        for (size_t i = 0; i < t->size(); ++i)
          n->types |= type_bit((*t)[i], where + "/type/" + std::to_string(i));
        if (!n->types) refuse(where + "/type", "lists no type");
      } else {
        n->types = type_bit(*t, where + "/type");
      }
    } else if (get(s, "properties") || get(s, "required") || get(s, "additionalProperties")) {
      n->types = kObjectT;
    } else if (get(s, "items") || get(s, "prefixItems") || get(s, "minItems") ||
               get(s, "maxItems")) {
      n->types = kArrayT;
    }
    if (const json* nullable = get(s, "nullable");
        nullable && nullable->is_boolean() && nullable->get<bool>())
      n->types |= kNullT;
    fill(*n, s, where, depth);
    return n;
  }

  void fill(JsonSchemaNode& n, const json& s, const std::string& where, int depth) {
    if (const json* props = get(s, "properties")) {
      if (!props->is_object()) refuse(where + "/properties", "must be an object");
      if (props->size() > kMaxProperties)
        refuse(where + "/properties",
               "has more than " + std::to_string(kMaxProperties) + " properties");
      for (auto it = props->begin(); it != props->end(); ++it) {
        for (unsigned char ch : it.key())
          if (ch == '"' || ch == '\\' || ch < 0x20)
            refuse(where + "/properties",
                   "property names with quotes, backslashes or control "
                   "characters are not supported");
        n.prop_names.push_back(it.key());
        n.prop_nodes.push_back(compile(it.value(), where + "/properties/" + it.key(), depth + 1));
      }
      n.free_keys = false;
    }
    if (const json* req = get(s, "required")) {
      if (!req->is_array()) refuse(where + "/required", "must be an array of names");
      for (const json& name : *req) {
        if (!name.is_string()) refuse(where + "/required", "must be an array of names");
        const auto it =
            std::find(n.prop_names.begin(), n.prop_names.end(), name.get<std::string>());
        if (it == n.prop_names.end()) {
          // Required but not described: any value.
          if (n.prop_names.size() >= kMaxProperties)
            refuse(where + "/required", "names too many properties");
          n.prop_names.push_back(name.get<std::string>());
          n.prop_nodes.push_back(node());
          n.required |= uint64_t{1} << (n.prop_names.size() - 1);
        } else {
          n.required |= uint64_t{1} << (it - n.prop_names.begin());
        }
        n.free_keys = false;
      }
    }
    if (const json* ap = get(s, "additionalProperties"); ap && n.free_keys) {
      if (ap->is_boolean()) {
        n.free_keys = ap->get<bool>();  // false with no properties: only {}
      } else {
        n.free_value = compile(*ap, where + "/additionalProperties", depth + 1);
      }
    }
    // Positional items: 2020-12's prefixItems + items, or draft-07's tuple items +
    // additionalItems. A `false` for the rest closes the array after the positional ones.
    const json* prefix = get(s, "prefixItems");
    const json* rest = get(s, "items");
    std::string rest_where = where + "/items", prefix_where = where + "/prefixItems";
    if (rest && rest->is_array()) {
      if (prefix) refuse(where + "/items", "give prefixItems or a tuple 'items', not both");
      prefix = rest;
      prefix_where = rest_where;
      rest = get(s, "additionalItems");
      rest_where = where + "/additionalItems";
    }
    if (prefix) {
      if (!prefix->is_array()) refuse(prefix_where, "must be an array of schemas");
      for (size_t i = 0; i < prefix->size(); ++i)
        n.prefix_items.push_back(
            compile((*prefix)[i], prefix_where + "/" + std::to_string(i), depth + 1));
    }
    bool closed = false;
    if (rest) {
      if (rest->is_boolean())
        closed = !rest->get<bool>();
      else
        n.items = compile(*rest, rest_where, depth + 1);
    }
    if (const json* v = get(s, "minItems")) n.min_items = integer(*v, where + "/minItems");
    if (const json* v = get(s, "maxItems")) n.max_items = integer(*v, where + "/maxItems");
    if (closed) n.max_items = std::min(n.max_items, static_cast<int64_t>(n.prefix_items.size()));
    if (n.min_items < 0 || n.max_items < n.min_items)
      refuse(where + "/maxItems", "no array length fits minItems and maxItems");
    if (const json* v = get(s, "minLength")) n.min_length = integer(*v, where + "/minLength");
    if (const json* v = get(s, "maxLength")) n.max_length = integer(*v, where + "/maxLength");
    if (n.min_length < 0 || n.max_length < n.min_length)
      refuse(where + "/maxLength", "no string length fits minLength and maxLength");
    const bool numeric_bounds = get(s, "minimum") || get(s, "maximum") ||
                                get(s, "exclusiveMinimum") || get(s, "exclusiveMaximum");
    if (numeric_bounds && (n.types & kNumberT))
      refuse(where, "bounds on non-integer numbers are not supported; use type integer");
    if (const json* v = get(s, "minimum")) set_min(n, integer(*v, where + "/minimum"));
    if (const json* v = get(s, "exclusiveMinimum"))
      set_min(n, integer(*v, where + "/exclusiveMinimum") + 1);
    if (const json* v = get(s, "maximum")) set_max(n, integer(*v, where + "/maximum"));
    if (const json* v = get(s, "exclusiveMaximum"))
      set_max(n, integer(*v, where + "/exclusiveMaximum") - 1);
    if (n.has_min && n.has_max && n.maximum < n.minimum)
      refuse(where + "/maximum", "no integer fits the bounds");
  }

  static void set_min(JsonSchemaNode& n, int64_t v) {
    n.minimum = n.has_min ? std::max(n.minimum, v) : v;
    n.has_min = true;
  }
  static void set_max(JsonSchemaNode& n, int64_t v) {
    n.maximum = n.has_max ? std::min(n.maximum, v) : v;
    n.has_max = true;
  }

  // The first byte of a value tells its type, so branches of different types stay one node.
  const JsonSchemaNode* compile_union(const json& s, const json& alts, const std::string& where,
                                      int depth) {
    if (!alts.is_array() || alts.empty()) refuse(where, "must be a non-empty array");
    JsonSchemaNode* n = node();
    n->types = 0;
    for (size_t i = 0; i < alts.size(); ++i) {
      const std::string w = where + "/" + std::to_string(i);
      json branch = alts[i];
      if (branch.is_object())
        for (const char* key :
             {"properties", "required", "items", "prefixItems", "additionalProperties"})
          if (const json* v = get(s, key); v && !branch.contains(key)) branch[key] = *v;
      const JsonSchemaNode* b = compile(branch, w, depth + 1);
      if (!b->literals.empty()) refuse(w, "enum or const inside anyOf / oneOf is not supported");
      uint8_t bt = b->types;
      if (bt & kNumberT) bt |= kIntegerT;
      if (n->types & bt)
        refuse(w,
               "branches of anyOf / oneOf must have different types (an object and null, a "
               "string and a number, ...)");
      n->types |= b->types;
      if (b->types & kObjectT) {
        n->prop_names = b->prop_names;
        n->prop_nodes = b->prop_nodes;
        n->required = b->required;
        n->free_keys = b->free_keys;
        n->free_value = b->free_value;
      }
      if (b->types & kArrayT) {
        n->prefix_items = b->prefix_items;
        n->items = b->items;
        n->min_items = b->min_items;
        n->max_items = b->max_items;
      }
      if (b->types & kStringT) {
        n->min_length = b->min_length;
        n->max_length = b->max_length;
      }
      if (b->types & kIntegerT) {
        n->has_min = b->has_min;
        n->has_max = b->has_max;
        n->minimum = b->minimum;
        n->maximum = b->maximum;
      }
    }
    return n;
  }

  const json& resolve(const json& ref, const std::string& where) {
    if (!ref.is_string()) refuse(where + "/$ref", "must be a string");
    const std::string r = ref.get<std::string>();
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (r.rfind(p, 0) != 0) continue;
      const json* defs = get(document, p.substr(2, p.size() - 3).c_str());
      const std::string name = r.substr(p.size());
      if (defs && defs->is_object())
        if (const json* target = get(*defs, name.c_str())) return *target;
      refuse(where + "/$ref", "'" + r + "' names no definition in the schema");
    }
    refuse(where + "/$ref", "only local references into #/$defs or #/definitions are supported");
  }
};

std::shared_ptr<const JsonGrammar> JsonGrammar::any_object(JsonDialect dialect) {
  auto g = std::shared_ptr<JsonGrammar>(new JsonGrammar());
  g->dialect_ = dialect;
  g->nodes_.push_back(std::make_unique<JsonSchemaNode>());
  g->nodes_.back()->types = kObjectT;
  g->root_ = g->nodes_.back().get();
  return g;
}

std::shared_ptr<const JsonGrammar> JsonGrammar::from_schema(const json& schema,
                                                            JsonDialect dialect) {
  auto g = std::shared_ptr<JsonGrammar>(new JsonGrammar());
  g->dialect_ = dialect;
  JsonSchemaCompiler c{*g, schema};
  g->root_ = c.compile(schema, "#", 0);
  return g;
}

// ---------------------------------------------------------------------------------------------
// The matcher.

namespace {

enum FrameKind : uint8_t { kValue, kObject, kArray, kString, kNumber, kLiteral, kKey };
// Object stages.
enum : uint8_t { kObjOpen, kObjAfterComma, kObjKey, kObjAfterKey, kObjValue, kObjAfterValue };
// Array stages.
enum : uint8_t { kArrOpen, kArrValue, kArrAfterValue };
// Number stages.
enum : uint8_t { kNumSign, kNumZero, kNumInt, kNumDot, kNumFrac, kNumE, kNumESign, kNumExp };

bool is_ws(unsigned char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

bool is_digit(unsigned char c) {
  return c >= '0' && c <= '9';
}

const char* const kTrueFalse[] = {"true", "false"};

// Integer bounds arithmetic on 19-digit magnitudes times powers of ten needs more than 64 bits.
__extension__ typedef __int128 Wide;

// Whether some integer with these leading digits (and up to 19 digits in all) lies in bounds.
bool integer_reachable(const JsonSchemaNode& n, bool negative, uint64_t prefix, uint32_t digits,
                       bool any_digits_yet) {
  const Wide lo = n.has_min ? n.minimum : -(Wide{1} << 100);
  const Wide hi = n.has_max ? n.maximum : (Wide{1} << 100);
  if (!any_digits_yet) {
    // "-" alone: some negative integer must fit; nothing yet: anything from 0 to 19 digits.
    return negative ? lo < 0 : true;
  }
  Wide scale = 1;
  for (uint32_t d = digits; d <= 19; ++d) {
    Wide a = static_cast<Wide>(prefix) * scale;
    Wide b = a + scale - 1;
    if (prefix == 0 && d > digits) break;  // a leading zero takes no more digits
    if (negative) {
      const Wide na = -b, nb = -a;
      if (nb >= lo && na <= hi) return true;
    } else if (b >= lo && a <= hi) {
      return true;
    }
    scale *= 10;
  }
  return false;
}

bool integer_in_bounds(const JsonSchemaNode& n, bool negative, uint64_t v) {
  const Wide x = negative ? -static_cast<Wide>(v) : static_cast<Wide>(v);
  return (!n.has_min || x >= n.minimum) && (!n.has_max || x <= n.maximum);
}

}  // namespace

JsonMatcher::JsonMatcher(const JsonGrammar& grammar)
    : gemma_(grammar.dialect() == JsonDialect::kGemmaArgs) {
  push_value(grammar.root());
}

namespace {

// The schema of an array's element at `index` (null: any value).
const JsonSchemaNode* item_schema(const JsonSchemaNode& array, uint64_t index) {
  return index < array.prefix_items.size() ? array.prefix_items[static_cast<size_t>(index)]
                                           : array.items;
}

}  // namespace

bool JsonMatcher::push_value(const JsonSchemaNode* node) {
  if (depth_ >= static_cast<int>(stack_.size())) return false;
  Frame& f = stack_[static_cast<size_t>(depth_++)];
  f = Frame{};
  f.node = node;
  f.kind = kValue;
  return true;
}

// The value's first byte picks its type and so its frame.
bool JsonMatcher::start_value(Frame& f, unsigned char c) {
  const JsonSchemaNode* n = f.node;
  static const JsonSchemaNode kAny;
  if (!n) n = &kAny;
  f.node = n;
  if (!n->literals.empty()) {
    uint64_t cand = 0;
    for (size_t i = 0; i < n->literals.size(); ++i)
      if (static_cast<unsigned char>(n->literals[i][0]) == c) cand |= uint64_t{1} << i;
    if (!cand) return false;
    f.kind = kLiteral;
    f.cand = cand;
    f.pos = 1;
    return true;
  }
  const uint8_t t = n->types;
  // Nesting is bounded: a container opens only with room for its children.
  const bool room = depth_ < kMaxJsonDepth;
  if (c == '{' && (t & kObjectT) && room) {
    f.kind = kObject;
    f.stage = kObjOpen;
    f.cand = 0;  // properties written
    return true;
  }
  if (c == '[' && (t & kArrayT) && room && n->max_items >= 0) {
    f.kind = kArray;
    f.stage = kArrOpen;
    f.count = 0;
    return true;
  }
  if (c == (gemma_ ? kGemmaQuote : '"') && (t & kStringT)) {
    f.kind = kString;
    f.count = 0;
    return true;
  }
  if ((c == '-' || is_digit(c)) && (t & (kIntegerT | kNumberT))) {
    f.kind = kNumber;
    f.negative = c == '-';
    f.value = 0;
    f.count = 0;
    if (c == '-') {
      f.stage = kNumSign;
    } else {
      f.stage = c == '0' ? kNumZero : kNumInt;
      f.value = static_cast<uint64_t>(c - '0');
      f.count = 1;
    }
    if ((t & kNumberT) == 0 && !integer_reachable(*n, f.negative, f.value, f.count, c != '-'))
      return false;
    return true;
  }
  if ((c == 't' || c == 'f') && (t & kBooleanT)) {
    f.kind = kLiteral;
    f.cand = c == 't' ? 1 : 2;  // bit i: kTrueFalse[i]
    f.pos = 1;
    f.stage = 1;  // literals from kTrueFalse, not the node
    return true;
  }
  if (c == 'n' && (t & kNullT)) {
    f.kind = kLiteral;
    f.cand = 1;
    f.pos = 1;
    f.stage = 2;  // "null"
    return true;
  }
  return false;
}

void JsonMatcher::child_done() {
  if (depth_ == 0) {
    root_done_ = true;
    return;
  }
  Frame& p = stack_[static_cast<size_t>(depth_ - 1)];
  if (p.kind == kObject) {
    p.ws = 0;
    if (p.stage == kObjKey && gemma_) {
      // A bare key ends with its ':'; its value comes next.
      p.stage = kObjValue;
      push_value(p.node->free_keys ? p.node->free_value : p.node->prop_nodes[p.value]);
      return;
    }
    p.stage = p.stage == kObjKey ? kObjAfterKey : kObjAfterValue;
  } else if (p.kind == kArray) {
    ++p.count;
    p.stage = kArrAfterValue;
    p.ws = 0;
  }
}

namespace {

// Literal text of candidate i of a literal frame.
std::string_view literal_text(const JsonMatcher::Frame& f, size_t i) {
  if (f.stage == 1) return kTrueFalse[i];
  if (f.stage == 2) return "null";
  return f.node->literals[i];
}

size_t literal_count(const JsonMatcher::Frame& f) {
  return f.stage == 1 ? 2 : f.stage == 2 ? 1 : f.node->literals.size();
}

bool literal_complete(const JsonMatcher::Frame& f) {
  for (size_t i = 0; i < literal_count(f); ++i)
    if ((f.cand >> i & 1) && literal_text(f, i).size() == f.pos) return true;
  return false;
}

bool number_complete(const JsonMatcher::Frame& f) {
  const bool shape =
      f.stage == kNumZero || f.stage == kNumInt || f.stage == kNumFrac || f.stage == kNumExp;
  if (!shape) return false;
  if ((f.node->types & kNumberT) == 0) return integer_in_bounds(*f.node, f.negative, f.value);
  return true;
}

// Object key candidates at a key position: the declared properties not written yet (f.cand of
// an object frame holds those written). Any order, each once.
uint64_t next_keys(const JsonMatcher::Frame& f) {
  const size_t n = f.node->prop_names.size();
  const uint64_t all = n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  return all & ~f.cand;
}

bool object_may_close(const JsonMatcher::Frame& f) {
  const JsonSchemaNode& n = *f.node;
  return n.free_keys || (n.required & ~f.cand) == 0;
}

bool object_may_continue(const JsonMatcher::Frame& f) {
  return f.node->free_keys || next_keys(f) != 0;
}

}  // namespace

JsonMatcher::Step JsonMatcher::step(Frame& f, unsigned char c) {
  // Gemma writes its call arguments without whitespace, so none is allowed there.
  auto ws = [&] {
    if (gemma_ || !is_ws(c) || f.ws >= kMaxWhitespaceRun) return false;
    ++f.ws;
    return true;
  };
  switch (f.kind) {
    case kValue:
      if (ws()) return Step::kConsumed;
      return start_value(f, c) ? Step::kConsumed : Step::kRejected;

    case kLiteral: {
      uint64_t next = 0;
      for (size_t i = 0; i < literal_count(f); ++i) {
        if (!(f.cand >> i & 1)) continue;
        const std::string_view t = literal_text(f, i);
        if (t.size() > f.pos && static_cast<unsigned char>(t[f.pos]) == c) next |= uint64_t{1} << i;
      }
      if (next) {
        f.cand = next;
        ++f.pos;
        return Step::kConsumed;
      }
      return literal_complete(f) ? Step::kPass : Step::kRejected;
    }

    case kNumber: {
      const bool integer_only = (f.node->types & kNumberT) == 0;
      if (is_digit(c)) {
        switch (f.stage) {
          case kNumSign:
          case kNumInt:
            if (f.count >= 19) return Step::kRejected;
            if (integer_only && !integer_reachable(*f.node, f.negative, f.value * 10 + (c - '0'),
                                                   f.count + 1, true))
              return Step::kRejected;
            f.value = f.value * 10 + static_cast<uint64_t>(c - '0');
            f.stage = (f.stage == kNumSign && c == '0') ? kNumZero : kNumInt;
            ++f.count;
            return Step::kConsumed;
          case kNumDot:
          case kNumFrac:
            if (f.pos >= 20) return Step::kRejected;
            ++f.pos;
            f.stage = kNumFrac;
            return Step::kConsumed;
          case kNumE:
          case kNumESign:
          case kNumExp:
            if (f.utf8_need >= 3) return Step::kRejected;  // exponent digits
            ++f.utf8_need;
            f.stage = kNumExp;
            return Step::kConsumed;
          default:
            break;  // a digit after a leading zero ends the number
        }
      } else if (c == '.' && !integer_only && (f.stage == kNumZero || f.stage == kNumInt)) {
        f.stage = kNumDot;
        f.pos = 0;
        return Step::kConsumed;
      } else if ((c == 'e' || c == 'E') && !integer_only &&
                 (f.stage == kNumZero || f.stage == kNumInt || f.stage == kNumFrac)) {
        f.stage = kNumE;
        f.utf8_need = 0;
        return Step::kConsumed;
      } else if ((c == '+' || c == '-') && f.stage == kNumE) {
        f.stage = kNumESign;
        return Step::kConsumed;
      }
      return number_complete(f) ? Step::kPass : Step::kRejected;
    }

    case kString:
    case kKey: {
      const bool key = f.kind == kKey;
      if (key && f.stage == 1) {
        // A free bare key (Gemma arguments of an object without declared properties).
        const bool name_char = std::isalnum(c) || c == '_' || c == '-' || c == '.';
        if (name_char && f.pos < 256) {
          ++f.pos;
          return Step::kConsumed;
        }
        return c == ':' && f.pos > 0 ? Step::kPass : Step::kRejected;
      }
      if (key) {
        // A declared property name, matched against the candidates; JSON closes it with a quote,
        // Gemma's bare keys with the ':'.
        const JsonSchemaNode& n = *f.node;
        if (c == (gemma_ ? ':' : '"')) {
          for (size_t i = 0; i < n.prop_names.size(); ++i)
            if ((f.cand >> i & 1) && n.prop_names[i].size() == f.pos) {
              Frame& obj = stack_[static_cast<size_t>(depth_ - 2)];
              obj.cand |= uint64_t{1} << i;  // written
              obj.value = i;                 // the property whose value comes next
              return Step::kPass;            // handled by the caller: pops the key
            }
          return Step::kRejected;
        }
        uint64_t next = 0;
        for (size_t i = 0; i < n.prop_names.size(); ++i)
          if ((f.cand >> i & 1) && n.prop_names[i].size() > f.pos &&
              static_cast<unsigned char>(n.prop_names[i][f.pos]) == c)
            next |= uint64_t{1} << i;
        if (!next) return Step::kRejected;
        f.cand = next;
        ++f.pos;
        return Step::kConsumed;
      }
      const JsonSchemaNode& n = *f.node;
      if (gemma_ && !f.utf8_need) {
        // Verbatim text up to the closing <|"|>; no escapes, newlines allowed, no other marker.
        if (c == kGemmaQuote)
          return static_cast<int64_t>(f.count) < n.min_length ? Step::kRejected : Step::kPass;
        if (c <= kChannelClose) return Step::kRejected;  // another marker
        if (c < 0x80) {
          if (static_cast<int64_t>(f.count) >= n.max_length) return Step::kRejected;
          ++f.count;
          return Step::kConsumed;
        }
      }
      if (f.esc == 1) {
        if (c == 'u') {
          f.esc = 2;
          return Step::kConsumed;
        }
        if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' ||
            c == 't') {
          f.esc = 0;
          return Step::kConsumed;
        }
        return Step::kRejected;
      }
      if (f.esc >= 2) {
        if (!std::isxdigit(c)) return Step::kRejected;
        f.esc = f.esc == 5 ? 0 : static_cast<uint8_t>(f.esc + 1);
        return Step::kConsumed;
      }
      if (f.utf8_need) {
        if (c < f.utf8_lo || c > f.utf8_hi) return Step::kRejected;
        --f.utf8_need;
        f.utf8_lo = 0x80;
        f.utf8_hi = 0xBF;
        return Step::kConsumed;
      }
      if (c == '"') {
        if (static_cast<int64_t>(f.count) < n.min_length) return Step::kRejected;
        return Step::kPass;  // the caller pops the string, consuming the quote
      }
      if (c < 0x20 || c == 0x7F) return Step::kRejected;
      if (static_cast<int64_t>(f.count) >= n.max_length) return Step::kRejected;
      if (c == '\\') {
        f.esc = 1;
      } else if (c >= 0x80) {
        // UTF-8 lead bytes and the range of the byte after each (no overlongs, no surrogates).
        f.utf8_lo = 0x80;
        f.utf8_hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
          f.utf8_need = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
          f.utf8_need = 2;
          if (c == 0xE0) f.utf8_lo = 0xA0;
          if (c == 0xED) f.utf8_hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
          f.utf8_need = 3;
          if (c == 0xF0) f.utf8_lo = 0x90;
          if (c == 0xF4) f.utf8_hi = 0x8F;
        } else {
          return Step::kRejected;
        }
      }
      ++f.count;
      return Step::kConsumed;
    }

    case kObject: {
      const JsonSchemaNode& n = *f.node;
      switch (f.stage) {
        case kObjOpen:
        case kObjAfterComma:
          if (ws()) return Step::kConsumed;
          if (c == '}' && f.stage == kObjOpen && object_may_close(f)) return Step::kPass;
          if (gemma_) {
            // A bare key: its first byte is already part of the name.
            if (depth_ >= static_cast<int>(stack_.size())) return Step::kRejected;
            f.ws = 0;
            f.stage = kObjKey;
            Frame& k = stack_[static_cast<size_t>(depth_++)];
            k = Frame{};
            k.node = &n;
            k.kind = kKey;
            if (n.free_keys) {
              k.stage = 1;
            } else {
              k.cand = next_keys(f);
              if (!k.cand) return Step::kRejected;
            }
            return step(k, c);
          }
          if (c != '"') return Step::kRejected;
          f.ws = 0;
          f.stage = kObjKey;
          if (n.free_keys) {
            // Any key: a plain string frame.
            if (depth_ >= static_cast<int>(stack_.size())) return Step::kRejected;
            Frame& k = stack_[static_cast<size_t>(depth_++)];
            k = Frame{};
            static const JsonSchemaNode kAnyString = [] {
              JsonSchemaNode s;
              s.types = kStringT;
              return s;
            }();
            k.node = &kAnyString;
            k.kind = kString;
            return Step::kConsumed;
          }
          {
            const uint64_t cand = next_keys(f);
            if (!cand) return Step::kRejected;
            if (depth_ >= static_cast<int>(stack_.size())) return Step::kRejected;
            Frame& k = stack_[static_cast<size_t>(depth_++)];
            k = Frame{};
            k.node = &n;
            k.kind = kKey;
            k.cand = cand;
            return Step::kConsumed;
          }
        case kObjAfterKey:
          if (ws()) return Step::kConsumed;
          if (c != ':') return Step::kRejected;
          f.stage = kObjValue;
          f.ws = 0;
          return push_value(n.free_keys ? n.free_value : n.prop_nodes[f.value]) ? Step::kConsumed
                                                                                : Step::kRejected;
        case kObjAfterValue:
          if (ws()) return Step::kConsumed;
          if (c == '}' && object_may_close(f)) return Step::kPass;
          if (c == ',' && object_may_continue(f)) {
            f.stage = kObjAfterComma;
            f.ws = 0;
            return Step::kConsumed;
          }
          return Step::kRejected;
        default:
          return Step::kRejected;
      }
    }

    case kArray: {
      const JsonSchemaNode& n = *f.node;
      switch (f.stage) {
        case kArrOpen:
          if (ws()) return Step::kConsumed;
          if (c == ']' && n.min_items == 0) return Step::kPass;
          if (n.max_items < 1) return Step::kRejected;
          f.stage = kArrValue;
          if (!push_value(item_schema(n, 0))) return Step::kRejected;
          return step(stack_[static_cast<size_t>(depth_ - 1)], c);
        case kArrAfterValue:
          if (ws()) return Step::kConsumed;
          if (c == ']' && static_cast<int64_t>(f.count) >= n.min_items) return Step::kPass;
          if (c == ',' && static_cast<int64_t>(f.count) < n.max_items) {
            f.stage = kArrValue;
            f.ws = 0;
            return push_value(item_schema(n, f.count)) ? Step::kConsumed : Step::kRejected;
          }
          return Step::kRejected;
        default:
          return Step::kRejected;
      }
    }
  }
  return Step::kRejected;
}

bool JsonMatcher::feed_byte(unsigned char c) {
  for (;;) {
    if (depth_ == 0) return false;  // the value is closed
    Frame& f = stack_[static_cast<size_t>(depth_ - 1)];
    const uint8_t kind = f.kind;
    const Step s = step(f, c);
    if (s == Step::kRejected) return false;
    if (s == Step::kConsumed) return true;
    // kPass: the frame is complete. Its closing byte (a quote, '}' or ']') is its own; any other
    // byte ends a number or literal and goes on to the frame below.
    --depth_;
    const bool own_close = kind == kString || kind == kKey || kind == kObject || kind == kArray;
    child_done();
    if (own_close) return true;
  }
}

bool JsonMatcher::feed(std::string_view bytes) {
  for (char ch : bytes)
    if (!feed_byte(static_cast<unsigned char>(ch))) return false;
  return true;
}

bool JsonMatcher::complete() const {
  if (depth_ == 0) return root_done_;
  if (depth_ != 1) return false;
  const Frame& f = stack_[0];
  if (f.kind == kNumber) return number_complete(f);
  if (f.kind == kLiteral) return literal_complete(f);
  return false;
}

// ---------------------------------------------------------------------------------------------
// Forced tool calls.

std::shared_ptr<const ToolCallGrammar> ToolCallGrammar::from_tools(
    const nlohmann::ordered_json& tools, const std::string& only_name, bool parallel,
    Thought thought, int64_t max_thought_tokens) {
  auto g = std::make_shared<ToolCallGrammar>();
  g->parallel = parallel;
  g->thought = thought;
  g->max_thought_tokens = std::max<int64_t>(0, max_thought_tokens);
  if (!tools.is_array()) fail("tools: must be an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    const auto& fn = tools[i].contains("function") ? tools[i]["function"] : tools[i];
    const std::string name = fn.value("name", "");
    if (name.empty() || (!only_name.empty() && name != only_name)) continue;
    for (unsigned char ch : name)
      if (ch == '{' || ch == '<' || ch == '>' || std::isspace(ch) || ch < 0x20)
        fail("tools[", i, "].function.name '", name,
             "' cannot be forced: Gemma's call syntax ends a name at '{', '<', '>' or whitespace");
    if (g->names.size() >= 64) fail("tools: at most 64 tools can be forced");
    // A declaration's own key order is kept only as JSON text; the schema compiler needs none.
    const json params =
        fn.contains("parameters") ? json::parse(fn["parameters"].dump()) : json{{"type", "object"}};
    try {
      g->arguments.push_back(JsonGrammar::from_schema(params, JsonDialect::kGemmaArgs));
    } catch (const Error& e) {
      fail("tools[", i, "].function.parameters: ", e.what());
    }
    g->names.push_back(name);
  }
  if (g->names.empty())
    fail(only_name.empty() ? std::string("tool_choice needs at least one function tool")
                           : "tool_choice names '" + only_name + "', which is not among the tools");
  return g;
}

bool ToolCallMatcher::feed_byte(unsigned char c) {
  switch (phase_) {
    case kThoughtMay:
      if (c == kChannelOpen) {
        phase_ = kThought;
        return true;
      }
      phase_ = kOpen;
      return feed_byte(c);
    case kThought:
      if (c == kChannelClose) {
        phase_ = kOpen;
        return true;
      }
      return c > kChannelClose;  // free text; no other marker
    case kOpen:
      if (c != kToolCallOpen) return false;
      phase_ = kName;
      cand_ = g_->names.size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << g_->names.size()) - 1;
      pos_ = 0;
      return true;
    case kName: {
      static constexpr std::string_view kCall = "call:";
      if (pos_ < kCall.size()) {
        if (c != static_cast<unsigned char>(kCall[pos_])) return false;
        ++pos_;
        return true;
      }
      const size_t at = pos_ - kCall.size();
      if (c == '{') {
        for (size_t i = 0; i < g_->names.size(); ++i)
          if ((cand_ >> i & 1) && g_->names[i].size() == at) {
            args_.emplace(*g_->arguments[i]);
            phase_ = kArgs;
            return args_->feed_byte(c);
          }
        return false;
      }
      uint64_t next = 0;
      for (size_t i = 0; i < g_->names.size(); ++i)
        if ((cand_ >> i & 1) && g_->names[i].size() > at &&
            static_cast<unsigned char>(g_->names[i][at]) == c)
          next |= uint64_t{1} << i;
      if (!next) return false;
      cand_ = next;
      ++pos_;
      return true;
    }
    case kArgs:
      if (!args_->feed_byte(c)) return false;
      if (args_->closed()) phase_ = kClose;
      return true;
    case kClose:
      if (c != kToolCallClose) return false;
      phase_ = kAfter;
      return true;
    case kAfter:
      if (c != kToolCallOpen || !g_->parallel) return false;
      phase_ = kOpen;
      return feed_byte(c);
  }
  return false;
}

bool ToolCallMatcher::feed(std::string_view symbols) {
  for (char ch : symbols)
    if (!feed_byte(static_cast<unsigned char>(ch))) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Over the vocabulary.

ConstraintVocabulary::ConstraintVocabulary(const Tokenizer& tokenizer) {
  const auto n = static_cast<int32_t>(tokenizer.vocab_size());
  bytes_.resize(static_cast<size_t>(n));
  for (int32_t id = 0; id < n; ++id) {
    if (!tokenizer.has_id(id) || tokenizer.is_special(id)) continue;
    std::string b = tokenizer.token_bytes(id);
    // Bytes 0-4 stand for the markers below; no JSON, argument or thought text has them raw.
    if (b.empty() || b.find_first_of(std::string_view("\0\1\2\3\4", 5)) != std::string::npos)
      continue;
    by_first_[static_cast<unsigned char>(b[0])].push_back(id);
    bytes_[static_cast<size_t>(id)] = std::move(b);
  }
  // The markers of Gemma's tool calls, as the bytes the tool-call matcher reads them as. No JSON
  // text contains these control bytes, so JSON grammars still never allow them.
  const std::pair<const char*, unsigned char> markers[] = {{"<|\"|>", kGemmaQuote},
                                                           {"<|tool_call>", kToolCallOpen},
                                                           {"<tool_call|>", kToolCallClose},
                                                           {"<|channel>", kChannelOpen},
                                                           {"<channel|>", kChannelClose}};
  for (const auto& [text, byte] : markers)
    if (const auto id = tokenizer.token_to_id(text); id && *id >= 0 && *id < n) {
      bytes_[static_cast<size_t>(*id)] = std::string(1, static_cast<char>(byte));
      by_first_[byte].push_back(*id);
    }
}

std::shared_ptr<const ConstraintVocabulary> ConstraintVocabulary::of(const Tokenizer& tokenizer) {
  // Built once per tokenizer file (a quarter of a million strings), shared by every request.
  static std::mutex mu;
  static std::map<std::pair<std::string, size_t>, std::weak_ptr<const ConstraintVocabulary>> cache;
  std::lock_guard<std::mutex> lk(mu);
  auto& slot = cache[{tokenizer.source_path(), tokenizer.vocab_size()}];
  if (auto v = slot.lock()) return v;
  auto v = std::make_shared<const ConstraintVocabulary>(tokenizer);
  slot = v;
  return v;
}

TokenConstraint::TokenConstraint(std::shared_ptr<const JsonGrammar> grammar,
                                 std::shared_ptr<const ConstraintVocabulary> vocabulary,
                                 std::vector<int32_t> stop_ids)
    : json_grammar_(std::move(grammar)),
      vocab_(std::move(vocabulary)),
      stop_ids_(std::move(stop_ids)) {
  state_.json.emplace(*json_grammar_);
}

TokenConstraint::TokenConstraint(std::shared_ptr<const ToolCallGrammar> grammar,
                                 std::shared_ptr<const ConstraintVocabulary> vocabulary,
                                 std::vector<int32_t> stop_ids)
    : call_grammar_(std::move(grammar)),
      vocab_(std::move(vocabulary)),
      stop_ids_(std::move(stop_ids)) {
  state_.call.emplace(*call_grammar_);
}

bool TokenConstraint::is_stop(int32_t id) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
}

bool TokenConstraint::thought_spent() const {
  return state_.call && state_.call->in_thought() &&
         thought_tokens_ >= call_grammar_->max_thought_tokens;
}

bool TokenConstraint::allows(int32_t id) const {
  if (is_stop(id)) return state_.complete();
  if (id < 0 || id >= vocab_->size()) return false;
  const std::string& b = vocab_->bytes(id);
  if (b.empty()) return false;
  if (thought_spent()) return b.size() == 1 && static_cast<unsigned char>(b[0]) == kChannelClose;
  State m = state_;
  return m.feed(b);
}

int64_t TokenConstraint::mask(float* logits, int64_t vocab) const {
  std::vector<uint8_t> ok(static_cast<size_t>(vocab), 0);
  const bool spent = thought_spent();
  for (int c = 0; c < 256; ++c) {
    if (spent && c != kChannelClose) continue;
    const std::vector<int32_t>& ids = vocab_->starting_with(static_cast<unsigned char>(c));
    if (ids.empty()) continue;
    State first = state_;
    const char byte = static_cast<char>(c);
    if (!first.feed(std::string_view(&byte, 1))) continue;  // the whole bucket fails
    for (const int32_t id : ids) {
      if (id >= vocab) continue;
      const std::string& b = vocab_->bytes(id);
      State m = first;
      if (m.feed(std::string_view(b).substr(1))) ok[static_cast<size_t>(id)] = 1;
    }
  }
  if (state_.complete())
    for (const int32_t id : stop_ids_)
      if (id >= 0 && id < vocab) ok[static_cast<size_t>(id)] = 1;
  int64_t allowed = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (ok[static_cast<size_t>(i)])
      ++allowed;
    else
      logits[i] = -std::numeric_limits<float>::infinity();
  }
  return allowed;
}

void TokenConstraint::accept(int32_t id) {
  if (is_stop(id)) {
    if (!state_.complete()) fail("constrained decoding: a stop token before the value ends");
    return;
  }
  if (!allows(id) || !state_.feed(vocab_->bytes(id)))
    fail("constrained decoding: token ", id, " does not continue the value");
  if (state_.call && state_.call->in_thought()) ++thought_tokens_;
}

}  // namespace gemstage
