// Errors raised by fusebox entry points. Every message names the argument at fault and
// what was expected, so framework bindings can pass it to the user unchanged.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fusebox {

enum class ErrorKind { kInvalidArgument, kUnsupported, kCuda };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace fusebox

// FUSEBOX_CHECK(cond, "x must be ...", value): throws fusebox::Error(kInvalidArgument).
#define FUSEBOX_CHECK(cond, ...)                                                                 \
  do {                                                                                           \
    if (!(cond))                                                                                 \
      throw ::fusebox::Error(::fusebox::ErrorKind::kInvalidArgument,                             \
                             ::fusebox::detail::concat("fusebox: ", __VA_ARGS__));               \
  } while (0)

#define FUSEBOX_UNSUPPORTED(...)                                                                 \
  throw ::fusebox::Error(::fusebox::ErrorKind::kUnsupported,                                     \
                         ::fusebox::detail::concat("fusebox: ", __VA_ARGS__))
