// One exception type for everything a user can cause: bad files, bad flags, bad requests.
// The message must name the file / tensor / field and, where possible, say what to do next.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace gemstage {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}
}  // namespace detail

// fail("tensor ", key, ": expected ", a, " found ", b) — builds the message in place.
template <typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(detail::concat(std::forward<Parts>(parts)...));
}

#define GEMSTAGE_CHECK(cond, ...)               \
  do {                                          \
    if (!(cond)) ::gemstage::fail(__VA_ARGS__); \
  } while (0)

}  // namespace gemstage
