// The public face of the interpreter (jinja.h): parse once, render many times. The parts are
// value.* (values and Python's semantics), lexer.*, parser.* (syntax tree), evaluator.*
// (expressions and statements) and filters.cc (methods, filters and tests).
#include "template/jinja.h"

#include <memory>
#include <string>

#include "template/evaluator.h"
#include "template/parser.h"
#include "template/value.h"

namespace gemstage::jinja {

using nlohmann::ordered_json;

std::string python_lower(std::string_view s) {
  return internal::map_case(s, false);
}

struct Template::Program {
  std::string name;
  internal::Body body;
};

Template::Template(std::string_view source, std::string name)
    : program_(std::make_unique<Program>()) {
  program_->name = std::move(name);
  program_->body = internal::parse(source, program_->name);
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

const std::string& Template::name() const {
  return program_->name;
}

std::string Template::render(const ordered_json& context, const RenderLimits& limits) const {
  if (!context.is_object()) throw TemplateError(program_->name + ": the context must be an object");
  internal::Interp in(program_->name, limits);
  in.install_globals();
  // The context, the globals and the template's top-level variables share the root scope, which
  // macros see too.
  for (const auto& [k, v] : context.items()) in.scopes[0][k] = internal::from_json(v);
  std::string out;
  try {
    in.exec(program_->body, out);
  } catch (const internal::BreakSignal&) {
    throw TemplateError(program_->name + ": {% break %} outside a loop");
  } catch (const internal::ContinueSignal&) {
    throw TemplateError(program_->name + ": {% continue %} outside a loop");
  }
  return out;
}

}  // namespace gemstage::jinja
