// Internal to csrc/pjrt: the one helper every PJRT C API call goes through.
//
//   PJRT_Buffer_ElementType_Args args{};
//   args.buffer = buffer_;
//   TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Buffer_ElementType, args);
//
// The macro fills args.struct_size from the header's <Fn>_Args_STRUCT_SIZE,
// checks that the loaded PJRT_Api is large enough to hold the function
// pointer and that it is non-null (else Error "plugin <path> does not
// implement PJRT_X"), calls it, and turns a returned PJRT_Error into a
// pjrt::Error "PJRT_X: <plugin message>" carrying the plugin's code (the
// PJRT_Error is destroyed). Callers value-initialize args ({}), so
// extension_start and every unused field are null/zero.
#pragma once

#include <cstddef>

#include "pjrt.h"

namespace torch_tpu::pjrt::detail {

[[noreturn]] void ThrowMissing(const Plugin& plugin, const char* name);
// Takes ownership of `error` (destroys it) and throws.
[[noreturn]] void ThrowError(const Plugin& plugin, const char* name,
                             PJRT_Error* error);
// Takes ownership of `error`, destroys it and writes a warning to stderr;
// for destructors, which must not throw.
void ReportError(const Plugin& plugin, const char* name, PJRT_Error* error);

// The function pointer `member` of the plugin's PJRT_Api, or null when the
// plugin's table is too short to contain it (older minor version) or the
// plugin leaves it unset.
template <typename Fn>
inline Fn* Lookup(const PJRT_Api* api, Fn* PJRT_Api::*member, size_t offset) {
  if (offset + sizeof(Fn*) > api->struct_size) return nullptr;
  return api->*member;
}

template <typename Fn, typename Args>
inline void Call(const Plugin& plugin, Fn* PJRT_Api::*member, size_t offset,
                 const char* name, Args& args, size_t struct_size) {
  args.struct_size = struct_size;
  Fn* fn = Lookup(plugin.api(), member, offset);
  if (fn == nullptr) [[unlikely]]
    ThrowMissing(plugin, name);
  PJRT_Error* error = fn(&args);
  if (error != nullptr) [[unlikely]]
    ThrowError(plugin, name, error);
}

// As Call, but never throws: a missing function or an error is reported on
// stderr. Returns false in that case.
template <typename Fn, typename Args>
inline bool CallNoThrow(const Plugin& plugin, Fn* PJRT_Api::*member,
                        size_t offset, const char* name, Args& args,
                        size_t struct_size) noexcept {
  args.struct_size = struct_size;
  Fn* fn = Lookup(plugin.api(), member, offset);
  if (fn == nullptr) return false;
  PJRT_Error* error = fn(&args);
  if (error != nullptr) {
    ReportError(plugin, name, error);
    return false;
  }
  return true;
}

}  // namespace torch_tpu::pjrt::detail

#define TORCH_TPU_PJRT_CALL(plugin, Fn, args)                             \
  ::torch_tpu::pjrt::detail::Call((plugin), &PJRT_Api::Fn,                \
                                  offsetof(PJRT_Api, Fn), #Fn, (args),    \
                                  static_cast<size_t>(Fn##_Args_STRUCT_SIZE))

#define TORCH_TPU_PJRT_CALL_NOTHROW(plugin, Fn, args)                     \
  ::torch_tpu::pjrt::detail::CallNoThrow(                                 \
      (plugin), &PJRT_Api::Fn, offsetof(PJRT_Api, Fn), #Fn, (args),       \
      static_cast<size_t>(Fn##_Args_STRUCT_SIZE))

// True when the plugin provides Fn.
#define TORCH_TPU_PJRT_HAS(plugin, Fn)                                    \
  (::torch_tpu::pjrt::detail::Lookup((plugin).api(), &PJRT_Api::Fn,       \
                                     offsetof(PJRT_Api, Fn)) != nullptr)
