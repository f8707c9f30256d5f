// A Jinja interpreter for the subset that Hugging Face chat templates use (chat_template.jinja,
// tokenizer_config.json's chat_template), with the settings transformers' apply_chat_template
// renders them under: trim_blocks, lstrip_blocks, no autoescape, loop controls, and no mutation of
// lists or dicts (its sandbox is the immutable one, so namespace() is the only assignable object).
//
// Supported: {{ }}, {% %}, {# #} with `-` / `+` whitespace control; if / elif / else, for (with
// `if` filter, else, loop.index / index0 / revindex / first / last / length / previtem /
// nextitem, tuple unpacking), break / continue, set (name, namespace attribute, block form),
// macro (defaults, keyword arguments, recursion), raw; literals, lists, dicts, tuples, attribute
// and item access, slicing, calls, the arithmetic / comparison / logic operators, `~`, `in`,
// `x if c else y`, filters and tests (the list is in jinja.cc), string and dict methods, and the
// globals raise_exception, namespace, range, dict and strftime_now.
//
// A template is outside input (it ships with a checkpoint), so rendering is bounded: output size,
// loop iterations, macro call depth and expression nesting all have limits, and every error names
// the template line and column.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/error.h"

namespace gemstage::jinja {

// A template that does not parse, or fails while rendering (an undefined attribute, a bad
// operand, a limit reached). The message starts with "<name>:<line>:<column>: ".
class TemplateError : public Error {
 public:
  using Error::Error;
};

// The template called raise_exception(message). what() is the template's message verbatim; a
// server answers it with a 400, since the template refused the conversation it was given.
class TemplateRaised : public Error {
 public:
  using Error::Error;
};

struct RenderLimits {
  size_t max_output_bytes = size_t{64} << 20;
  int64_t max_loop_iterations = 10'000'000;  // all loops of one render together, range() too
  int max_call_depth = 100;                  // nested macro calls
};

class Template {
 public:
  // Throws TemplateError naming `name`, line and column when the source does not parse.
  explicit Template(std::string_view source, std::string name = "chat template");
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the variables of `context` (a JSON object; key order is kept, as Python dicts
  // keep it) plus the globals. Throws TemplateError or TemplateRaised.
  std::string render(const nlohmann::ordered_json& context, const RenderLimits& limits = {}) const;

  const std::string& name() const;

 private:
  struct Program;
  std::unique_ptr<Program> program_;
};

// Python's str() of a float: the shortest repr that round-trips, in exponent form when the
// decimal exponent is below -4 or at least 16 (0.1, 3.0, 1e-07, 1e+16). Shared with the built-in
// chat format, which must print numbers as the template does.
std::string python_float_repr(double v);

// Python's str.lower() (Unicode simple case mapping), which dictsort compares keys by.
std::string python_lower(std::string_view s);

}  // namespace gemstage::jinja
