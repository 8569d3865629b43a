// Environment variables read by the runtime (TORCH_TPU_*; README.md lists
// them). Every reader validates its value and names the variable in the
// error, so a typo is an error at first use rather than a silent default.
#pragma once

#include <cstdint>

namespace torch_tpu::runtime {

// The integer environment variable `name`: unset or empty gives `fallback`;
// a decimal integer in [lo, hi] is returned; anything else throws
// std::invalid_argument "<name> must be <expected>, got '<value>'"
// (`expected` names the accepted range, e.g. "a positive integer").
int64_t EnvInteger(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* expected);

// The 0/1 switch `name`: unset or empty gives `fallback`, "0" false, "1"
// true; anything else throws std::invalid_argument "<name> must be 0 or 1,
// got '<value>'".
bool EnvFlag(const char* name, bool fallback);

}  // namespace torch_tpu::runtime
