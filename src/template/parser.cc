#include "template/parser.h"

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
namespace {

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

}  // namespace

Body parse(std::string_view source, const std::string& name) {
  return Parser(lex(source, name), name).parse_template();
}

}  // namespace gemstage::jinja::internal
