#include "runtime/env.h"

#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace torch_tpu::runtime {

int64_t EnvInteger(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* expected) {
  const char* e = std::getenv(name);
  if (!e || !*e) return fallback;
  char* end = nullptr;
  errno = 0;
  long long n = std::strtoll(e, &end, 10);
  if (errno != 0 || *end != '\0' || n < lo || n > hi)
    throw std::invalid_argument(std::string(name) + " must be " + expected + ", got '" + e + "'");
  return static_cast<int64_t>(n);
}

bool EnvFlag(const char* name, bool fallback) {
  const char* e = std::getenv(name);
  if (!e || !*e) return fallback;
  if (std::string(e) == "1") return true;
  if (std::string(e) == "0") return false;
  throw std::invalid_argument(std::string(name) + " must be 0 or 1, got '" + e + "'");
}

}  // namespace torch_tpu::runtime
