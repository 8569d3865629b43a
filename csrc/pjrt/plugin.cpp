// Plugin loading and the error plumbing shared by every PJRT call.
#include <dlfcn.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "call.h"
#include "pjrt.h"

namespace torch_tpu::pjrt {
namespace detail {
namespace {

// Message and code of `error`, read with the plugin's own accessors (which
// every plugin must provide; they are checked at load time).
std::string ErrorMessage(const PJRT_Api* api, PJRT_Error* error) {
  PJRT_Error_Message_Args args{};
  args.struct_size = PJRT_Error_Message_Args_STRUCT_SIZE;
  args.error = error;
  api->PJRT_Error_Message(&args);
  return std::string(args.message, args.message_size);
}

PJRT_Error_Code ErrorCode(const PJRT_Api* api, PJRT_Error* error) {
  if (Lookup(api, &PJRT_Api::PJRT_Error_GetCode,
             offsetof(PJRT_Api, PJRT_Error_GetCode)) == nullptr) {
    return PJRT_Error_Code_UNKNOWN;
  }
  PJRT_Error_GetCode_Args args{};
  args.struct_size = PJRT_Error_GetCode_Args_STRUCT_SIZE;
  args.error = error;
  PJRT_Error* nested = api->PJRT_Error_GetCode(&args);
  if (nested != nullptr) {
    PJRT_Error_Destroy_Args d{};
    d.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
    d.error = nested;
    api->PJRT_Error_Destroy(&d);
    return PJRT_Error_Code_UNKNOWN;
  }
  return args.code;
}

void DestroyError(const PJRT_Api* api, PJRT_Error* error) {
  PJRT_Error_Destroy_Args args{};
  args.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
  args.error = error;
  api->PJRT_Error_Destroy(&args);
}

}  // namespace

void ThrowMissing(const Plugin& plugin, const char* name) {
  throw Error("plugin " + plugin.path() + " does not implement " + name,
              PJRT_Error_Code_UNIMPLEMENTED);
}

void ThrowError(const Plugin& plugin, const char* name, PJRT_Error* error) {
  const PJRT_Api* api = plugin.api();
  std::string message = ErrorMessage(api, error);
  PJRT_Error_Code code = ErrorCode(api, error);
  DestroyError(api, error);
  throw Error(std::string(name) + ": " + message, code);
}

void ReportError(const Plugin& plugin, const char* name, PJRT_Error* error) {
  const PJRT_Api* api = plugin.api();
  std::string message = ErrorMessage(api, error);
  DestroyError(api, error);
  std::fprintf(stderr, "torch_tpu: %s: %s\n", name, message.c_str());
}

}  // namespace detail

namespace {

std::string DlError() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown dlerror");
}

bool HasErrorAccessors(const PJRT_Api* api) {
  using detail::Lookup;
  return Lookup(api, &PJRT_Api::PJRT_Error_Destroy,
                offsetof(PJRT_Api, PJRT_Error_Destroy)) != nullptr &&
         Lookup(api, &PJRT_Api::PJRT_Error_Message,
                offsetof(PJRT_Api, PJRT_Error_Message)) != nullptr;
}

}  // namespace

std::shared_ptr<Plugin> Plugin::Load(const std::string& path) {
  // Plugins are never unloaded, so the cache holds them for the life of the
  // process; loading a path again returns the same object.
  static std::mutex mu;
  static auto* cache = new std::map<std::string, std::shared_ptr<Plugin>>();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache->find(path); it != cache->end()) return it->second;

  dlerror();  // clear any stale error
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    throw Error("cannot load PJRT plugin " + path + ": " + DlError(),
                PJRT_Error_Code_NOT_FOUND);
  }
  dlerror();
  using GetPjrtApiFn = const PJRT_Api* (*)();
  auto get_api = reinterpret_cast<GetPjrtApiFn>(dlsym(handle, "GetPjrtApi"));
  if (get_api == nullptr) {
    throw Error("PJRT plugin " + path + " has no symbol GetPjrtApi: " +
                    DlError(),
                PJRT_Error_Code_INVALID_ARGUMENT);
  }
  const PJRT_Api* api = get_api();
  if (api == nullptr) {
    throw Error("PJRT plugin " + path + ": GetPjrtApi returned null",
                PJRT_Error_Code_INTERNAL);
  }
  // pjrt_api_version sits at a fixed offset in every version of the table.
  if (api->struct_size < offsetof(PJRT_Api, pjrt_api_version) +
                             sizeof(PJRT_Api_Version)) {
    throw Error("PJRT plugin " + path + ": PJRT_Api table too small (" +
                    std::to_string(api->struct_size) + " bytes)",
                PJRT_Error_Code_FAILED_PRECONDITION);
  }
  const int major = api->pjrt_api_version.major_version;
  const int minor = api->pjrt_api_version.minor_version;
  if (major != PJRT_API_MAJOR) {
    throw Error("PJRT plugin " + path + " implements PJRT C API version " +
                    std::to_string(major) + "." + std::to_string(minor) +
                    " but torch_tpu was built against " +
                    std::to_string(PJRT_API_MAJOR) + "." +
                    std::to_string(PJRT_API_MINOR) +
                    "; the major versions must match",
                PJRT_Error_Code_FAILED_PRECONDITION);
  }
  if (!HasErrorAccessors(api)) {
    throw Error("PJRT plugin " + path +
                    " does not implement PJRT_Error_Destroy/PJRT_Error_Message",
                PJRT_Error_Code_FAILED_PRECONDITION);
  }

  std::shared_ptr<Plugin> plugin(new Plugin());
  plugin->api_ = api;
  plugin->handle_ = handle;
  plugin->path_ = path;
  if (TORCH_TPU_PJRT_HAS(*plugin, PJRT_Plugin_Initialize)) {
    PJRT_Plugin_Initialize_Args args{};
    TORCH_TPU_PJRT_CALL(*plugin, PJRT_Plugin_Initialize, args);
  }
  (*cache)[path] = plugin;
  return plugin;
}

Plugin::~Plugin() = default;  // never dlclose: plugins do not support it

int Plugin::api_major() const { return api_->pjrt_api_version.major_version; }
int Plugin::api_minor() const { return api_->pjrt_api_version.minor_version; }

std::vector<std::pair<std::string, std::string>> Plugin::attributes() const {
  std::vector<std::pair<std::string, std::string>> out;
  if (!TORCH_TPU_PJRT_HAS(*this, PJRT_Plugin_Attributes)) return out;
  PJRT_Plugin_Attributes_Args args{};
  TORCH_TPU_PJRT_CALL(*this, PJRT_Plugin_Attributes, args);
  out.reserve(args.num_attributes);
  for (size_t i = 0; i < args.num_attributes; ++i) {
    const PJRT_NamedValue& v = args.attributes[i];
    std::string value;
    switch (v.type) {
      case PJRT_NamedValue_kString:
        value.assign(v.string_value, v.value_size);
        break;
      case PJRT_NamedValue_kInt64:
        value = std::to_string(v.int64_value);
        break;
      case PJRT_NamedValue_kInt64List:
        for (size_t j = 0; j < v.value_size; ++j) {
          if (j != 0) value += ",";
          value += std::to_string(v.int64_array_value[j]);
        }
        break;
      case PJRT_NamedValue_kFloat:
        value = std::to_string(v.float_value);
        break;
      case PJRT_NamedValue_kBool:
        value = v.bool_value ? "true" : "false";
        break;
    }
    out.emplace_back(std::string(v.name, v.name_size), std::move(value));
  }
  return out;
}

}  // namespace torch_tpu::pjrt
