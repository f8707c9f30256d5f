#include "template/jinja.h"

#include <gtest/gtest.h>

using namespace gemstage::jinja;
using nlohmann::ordered_json;

namespace {

std::string render(std::string_view src, const ordered_json& ctx = ordered_json::object()) {
  return Template(src).render(ctx);
}

std::string error_of(std::string_view src, const ordered_json& ctx = ordered_json::object(),
                     RenderLimits limits = {}) {
  try {
    Template(src).render(ctx, limits);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

// Expected outputs below are what Jinja2 (trim_blocks, lstrip_blocks) prints for each template,
// worked out from its documented whitespace and expression rules.
TEST(Jinja, TextAndOutput) {
  EXPECT_EQ(render("Hello {{ name }}!", {{"name", "you"}}), "Hello you!");
  EXPECT_EQ(
      render("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 1 / 2 }}"),
      "7 3 -4 1 2 0.5");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none ~ true }}"), "a1NoneTrue");
  EXPECT_EQ(render("{{ [1, 'x', none] }} {{ {'k': 'v'} }}"), "[1, 'x', None] {'k': 'v'}");
  EXPECT_EQ(render("{{ undefined_name }}|"), "|");
  EXPECT_EQ(render("{{ 3.0 }} {{ 1e-7 }} {{ 2.5e-5 }} {{ 1e16 }} {{ 123456.789 }} {{ 0.1 }}"),
            "3.0 1e-07 2.5e-05 1e+16 123456.789 0.1");
  EXPECT_EQ(render("{{ \"it's\" }} {{ ['it\\'s'] }}"), "it's [\"it's\"]");
}

TEST(Jinja, TrimBlocksAndLstripBlocks) {
  // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
  EXPECT_EQ(render("{% if true %}\n  yes\n{% endif %}\nend"), "  yes\nend");
  EXPECT_EQ(render("<\n    {% if true %}\n    x\n    {% endif %}\n>"), "<\n    x\n>");
  // Output tags are not affected.
  EXPECT_EQ(render("  {{ 'a' }}\n{{ 'b' }}\n"), "  a\nb");  // one trailing newline is dropped
  // Explicit control.
  EXPECT_EQ(render("a  \n  {%- if true -%}  \n  b  {{- ' c ' -}}  d{# x #}\ne{% endif %}"),
            "ab c de");
  EXPECT_EQ(render("x\n  {%+ if true %}y{% endif %}"), "x\n  y");
  EXPECT_EQ(render("{% raw %}{{ not evaluated }}{% endraw %}"), "{{ not evaluated }}");
}

TEST(Jinja, LoopsAndScopes) {
  const ordered_json ctx = {{"xs", {"a", "b", "c"}}};
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}"
                   "{% endfor %}",
                   ctx),
            "1a,2b,3c");
  EXPECT_EQ(render("{% for x in xs if x != 'b' %}{{ loop.index0 }}/{{ loop.length }}{{ x }}"
                   "{% endfor %}",
                   ctx),
            "0/2a1/2c");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}={{ v }};{% endfor %}"),
            "b=1;a=2;");
  EXPECT_EQ(render("{% for x in xs %}{% if x == 'b' %}{% continue %}{% endif %}{% if x == 'c' %}"
                   "{% break %}{% endif %}{{ x }}{% endfor %}",
                   ctx),
            "a");
  // A set inside a loop does not leak out; a namespace attribute does.
  EXPECT_EQ(
      render("{% set n = 0 %}{% set ns = namespace(n=0) %}{% for x in xs %}{% set n = n + 1 %}"
             "{% set ns.n = ns.n + 1 %}{% endfor %}{{ n }} {{ ns.n }}",
             ctx),
      "0 3");
}

TEST(Jinja, MacrosRecurse) {
  EXPECT_EQ(
      render("{% macro fmt(v, quote=true) %}{% if v is mapping %}{{ '{' }}"
             "{% for k, x in v | dictsort %}{{ k }}:{{ fmt(x) }}{% if not loop.last %},"
             "{% endif %}{% endfor %}{{ '}' }}{% elif v is string %}{{ '\"' if quote }}{{ v }}"
             "{{ '\"' if quote }}{% else %}{{ v }}{% endif %}{% endmacro %}"
             "{{ fmt({'b': {'z': 'x', 'A': 1}, 'a': 2.5}) }} {{ fmt('s', quote=false) }}"),
      "{a:2.5,b:{A:1,z:\"x\"}} s");
}

TEST(Jinja, FiltersTestsAndMethods) {
  const ordered_json ctx = {
      {"msgs", {{{"role", "system"}, {"content", " S "}}, {{"role", "user"}, {"content", "Hi"}}}}};
  EXPECT_EQ(render("{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | "
                   "join(',') }}|{{ msgs | rejectattr('role', 'eq', 'user') | list | length }}|"
                   "{{ msgs[0].content | trim }}|{{ msgs[-1]['content'] | upper }}",
                   ctx),
            "Hi|1|S|HI");
  EXPECT_EQ(render("{{ x | default('d') }} {{ '' | default('d', true) }} {{ 'abc'[1:] }} "
                   "{{ 'abc'[::-1] }} {{ [1,2,3][:2] }}"),
            "d d bc cba [1, 2]");
  EXPECT_EQ(render("{{ 'a,b'.split(',') }} {{ ' x '.strip() }} {{ 'abc'.startswith('ab') }} "
                   "{{ 'abc'.endswith(('x', 'c')) }} {{ 'aXa'.replace('a', 'b') }} "
                   "{{ 'b' in 'abc' }} {{ 'k' in {'k': 1} }} {{ 2 not in [1] }}"),
            "['a', 'b'] x True True bXb True True True");
  EXPECT_EQ(render("{{ {'b': [1, 2.5, none, true], 'a': 'é\"\\n'} | tojson }}"),
            "{\"b\": [1, 2.5, null, true], \"a\": \"é\\\"\\n\"}");
  EXPECT_EQ(render("{{ x is defined }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }} "
                   "{{ [1] is sequence }} {{ 3 is odd }} {{ 1 is not string }}"),
            "False True True True True True True");
  // dictsort compares keys case-insensitively and keeps case ties stable.
  EXPECT_EQ(render("{% for k, v in d | dictsort %}{{ k }} {% endfor %}",
                   {{"d", {{"beta", 1}, {"alpha", 1}, {"Zeta", 1}, {"Alpha", 1}, {"_p", 1}}}}),
            "_p alpha Alpha beta Zeta ");
  EXPECT_EQ(render("{% for k, v in d | dictsort %}{{ k }} {% endfor %}",
                   {{"d", {{"écu", 1}, {"Ω", 1}, {"zeta", 1}, {"Éclair", 1}, {"apple", 1}}}}),
            "apple zeta Éclair écu Ω ");
  EXPECT_EQ(render("{{ 'x' if false }}|{{ 'a' if 1 > 2 else 'b' }}|{{ 'ÉCU' | lower }}"), "|b|écu");
}

TEST(Jinja, RaiseException) {
  try {
    render("{{ raise_exception('no way: ' ~ 1) }}");
    FAIL() << "expected a raise";
  } catch (const TemplateRaised& e) {
    EXPECT_STREQ(e.what(), "no way: 1");
  }
}

TEST(Jinja, ErrorsNameLineAndColumn) {
  EXPECT_EQ(error_of("line one\n{% if x %}\nno end"),
            "chat template:3:7: the template ended inside a block; expected '{% endif %}'");
  EXPECT_EQ(error_of("ok\n  {{ x.y.z }}", {{"x", nullptr}}).substr(0, 18), "chat template:2:9:");
  EXPECT_NE(error_of("{{ a.b.c }}").find("'a' is undefined"), std::string::npos);
  EXPECT_NE(error_of("{% frobnicate %}").find("1:4: unknown or misplaced statement"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'abc' | nosuchfilter }}").find("unknown filter 'nosuchfilter'"),
            std::string::npos);
  EXPECT_NE(error_of("{{ (1 }}").find("never closed"), std::string::npos);
}

TEST(Jinja, LimitsBoundHostileTemplates) {
  RenderLimits small;
  small.max_output_bytes = 1000;
  small.max_loop_iterations = 5000;
  small.max_call_depth = 50;
  EXPECT_NE(error_of("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
                     ordered_json::object(), small)
                .find("loop iterations"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 100000 }}", ordered_json::object(), small).find("RenderLimits"),
            std::string::npos);
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                     ordered_json::object(), small)
                .find("calls deep"),
            std::string::npos);
  EXPECT_NE(
      error_of("{% for i in range(200) %}{{ 'y' * 10 }}{% endfor %}", ordered_json::object(), small)
          .find("exceed 1000 bytes"),
      std::string::npos);
  // Deep nesting is refused by the parser instead of overflowing the stack.
  EXPECT_NE(
      error_of(std::string("{{ ") + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}")
          .find("nested too deeply"),
      std::string::npos);
}

// Found by fuzz_chat_template: `9**99` multiplied past int64 (undefined behaviour). Jinja2's
// integers are Python's, unbounded; ours are 128-bit, so what fits is exact (Python's values
// below) and what does not is an error naming the operator.
TEST(Jinja, IntegerArithmeticIsExactOrAnErrorNeverWrapped) {
  EXPECT_EQ(render("{{ 2 ** 62 }} {{ (-2) ** 63 }} {{ 1 ** 100000 }} {{ 7 ** 0 }} {{ 3 ** 39 }}"),
            "4611686018427387904 -9223372036854775808 1 1 4052555153018976267");
  EXPECT_EQ(render("{{ 9223372036854775806 + 1 }} {{ 3037000499 * 3037000499 }}"),
            "9223372036854775807 9223372030926249001");
  // Past int64, as Python prints them.
  EXPECT_EQ(render("{{ 2 ** 63 }} {{ 9223372036854775807 + 1 }} {{ -9223372036854775807 - 2 }} "
                   "{{ 3037000500 * 3037000500 }}"),
            "9223372036854775808 9223372036854775808 -9223372036854775809 9223372037000250000");
  EXPECT_EQ(render("{{ 2 ** 126 }} {{ (-2) ** 127 }} {{ 2 ** 126 - 1 + 2 ** 126 }}"),
            "85070591730234615865843651857942052864 -170141183460469231731687303715884105728 "
            "170141183460469231731687303715884105727");
  for (const char* src :
       {"{{ 9 ** 99 }}", "{{ 2 ** 127 }}", "{{ 170141183460469231731687303715884105727 + 1 }}",
        "{{ -170141183460469231731687303715884105727 - 2 }}",
        "{{ 18446744073709551616 * 18446744073709551616 }}", "{{ -((-2) ** 127) }}",
        "{{ ((-2) ** 127) | abs }}", "{{ [2 ** 126, 2 ** 126] | sum }}"}) {
    const std::string err = error_of(src);
    EXPECT_NE(err.find("integer overflow in "), std::string::npos) << src << ": " << err;
  }
  EXPECT_NE(error_of("{{ 170141183460469231731687303715884105728 }}").find("out of range"),
            std::string::npos);
}

// A JSON integer above int64 (a uint64: 12345678901234567890) is an integer to Python's Jinja and
// prints as one, never as 1.2345678901234567e+19; comparisons of integers are exact where a
// double's are not (2**53 + 1).
TEST(Jinja, IntegersBeyondInt64StayIntegers) {
  const ordered_json ctx =
      ordered_json::parse(R"({"n": 12345678901234567890, "m": 18446744073709551615})");
  EXPECT_EQ(render("{{ n }} {{ n | tojson }} {{ [n] }} {{ {'n': n} | tojson }} {{ n ~ '' }}", ctx),
            "12345678901234567890 12345678901234567890 [12345678901234567890] "
            "{\"n\": 12345678901234567890} 12345678901234567890");
  EXPECT_EQ(
      render("{{ n + 1 }} {{ m * 2 }} {{ -m }} {{ n // 10 }} {{ n % 7 }} {{ n is even }}", ctx),
      "12345678901234567891 36893488147419103230 -18446744073709551615 "
      "1234567890123456789 1 True");
  EXPECT_EQ(render("{{ 12345678901234567890 }} {{ '12345678901234567890' | int }} "
                   "{{ ' 42.5 ' | int }} {{ [1, 2, 3][n] is undefined }}",
                   ctx),
            "12345678901234567890 12345678901234567890 42 True");
  EXPECT_EQ(render("{{ 9007199254740993 > 9007199254740992 }} "
                   "{{ 9007199254740993 == 9007199254740992 }} {{ [true, true] | sum }}"),
            "True False 2");
  EXPECT_EQ(render("{% for k in range(n, n + 2) %}{{ k }},{% endfor %}", ctx),
            "12345678901234567890,12345678901234567891,");
}

// `trim`, strip(), lstrip(), rstrip() and split() take Python's str.isspace() set: Unicode
// whitespace (U+00A0, U+3000, U+2003, U+2028, ...) and the information separators, not only
// ASCII; zero-width characters (U+200B, U+FEFF, U+180E) are not whitespace to Python.
TEST(Jinja, StripAndTrimRemoveWhatPythonRemoves) {
  const ordered_json ctx = {{"s", "\u00a0\u3000 hi \u2003\u2028\u001c"},
                            {"words", "a\u3000b\u2028c\u0085d  e"},
                            {"zw", "\u200bhi\ufeff"},
                            {"quoted", "\u00abhi\u00bb"}};
  EXPECT_EQ(render("[{{ s | trim }}][{{ s.strip() }}]", ctx), "[hi][hi]");
  EXPECT_EQ(render("[{{ s.lstrip() }}]", ctx), "[hi \u2003\u2028\u001c]");
  EXPECT_EQ(render("[{{ s.rstrip() }}]", ctx), "[\u00a0\u3000 hi]");
  EXPECT_EQ(render("{{ words.split() }}", ctx), "['a', 'b', 'c', 'd', 'e']");
  EXPECT_EQ(render("[{{ zw | trim }}]", ctx), "[\u200bhi\ufeff]");
  // Characters to strip are code points, not bytes.
  EXPECT_EQ(render("[{{ quoted.strip('\u00ab\u00bb') }}][{{ quoted | trim('\u00bb') }}]", ctx),
            "[hi][\u00abhi]");
  EXPECT_EQ(render("[{{ '\u00e9t\u00e9'.strip('\u00e9') }}]"), "[t]");
}
