// Errors raised by fusebox entry points. Every message names the argument at fault and
// what was expected, so framework bindings can pass it to the user unchanged.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

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
// Message formatting without iostreams (no locale machinery on the error path).
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
template <typename T>
std::enable_if_t<std::is_integral_v<T>> append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T>
std::enable_if_t<std::is_floating_point_v<T>> append(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", double(v));
  s += buf;
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
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
