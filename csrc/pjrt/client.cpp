// PJRT_Client wrapper: devices, compilation, host-to-device transfers.
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "call.h"
#include "pjrt.h"

namespace torch_tpu::pjrt {

namespace detail {
namespace {

char* HeapCopy(const std::string& value) {
  char* out = new char[value.size() + 1];
  std::memcpy(out, value.data(), value.size());
  out[value.size()] = '\0';
  return out;
}
void DeleteValue(char* value) { delete[] value; }

PJRT_Error* CallbackError(PJRT_CallbackError* make, PJRT_Error_Code code, const std::string& message) {
  if (make == nullptr || *make == nullptr) return nullptr;  // nothing to report with
  return (*make)(code, message.data(), message.size());
}

}  // namespace

PJRT_Error* KeyValueGet(PJRT_KeyValueGetCallback_Args* args) {
  auto* store = static_cast<KeyValueStore*>(args->user_arg);
  const std::string key(args->key, args->key_size);
  try {
    std::string value = store->Get(key, std::chrono::milliseconds(args->timeout_in_ms));
    args->value = HeapCopy(value);
    args->value_size = value.size();
    args->value_deleter_callback = &DeleteValue;
    return nullptr;
  } catch (const std::exception& e) {
    return CallbackError(args->callback_error, PJRT_Error_Code_DEADLINE_EXCEEDED,
                         "key-value store get of '" + key + "' failed: " + e.what());
  }
}

PJRT_Error* KeyValueTryGet(PJRT_KeyValueTryGetCallback_Args* args) {
  auto* store = static_cast<KeyValueStore*>(args->user_arg);
  const std::string key(args->key, args->key_size);
  try {
    std::optional<std::string> value = store->TryGet(key);
    if (!value) return CallbackError(args->callback_error, PJRT_Error_Code_NOT_FOUND, "key '" + key + "' not found");
    args->value = HeapCopy(*value);
    args->value_size = value->size();
    args->value_deleter_callback = &DeleteValue;
    return nullptr;
  } catch (const std::exception& e) {
    return CallbackError(args->callback_error, PJRT_Error_Code_INTERNAL,
                         "key-value store try-get of '" + key + "' failed: " + e.what());
  }
}

PJRT_Error* KeyValuePut(PJRT_KeyValuePutCallback_Args* args) {
  auto* store = static_cast<KeyValueStore*>(args->user_arg);
  const std::string key(args->key, args->key_size);
  try {
    store->Put(key, std::string(args->value, args->value_size));
    return nullptr;
  } catch (const std::exception& e) {
    return CallbackError(args->callback_error, PJRT_Error_Code_INTERNAL,
                         "key-value store put of '" + key + "' failed: " + e.what());
  }
}

}  // namespace detail

std::shared_ptr<Client> Client::Create(std::shared_ptr<Plugin> plugin,
                                       const std::vector<std::pair<std::string, int64_t>>& int_options) {
  ClientOptions options;
  options.int_options = int_options;
  return Create(std::move(plugin), options);
}

std::shared_ptr<Client> Client::Create(std::shared_ptr<Plugin> plugin, const ClientOptions& client_options) {
  const Plugin& p = *plugin;
  const auto& int_options = client_options.int_options;
  const auto& string_options = client_options.string_options;
  std::vector<PJRT_NamedValue> options(int_options.size() + string_options.size());
  for (size_t i = 0; i < int_options.size(); ++i) {
    PJRT_NamedValue& v = options[i];
    v.struct_size = PJRT_NamedValue_STRUCT_SIZE;
    v.name = int_options[i].first.c_str();
    v.name_size = int_options[i].first.size();
    v.type = PJRT_NamedValue_kInt64;
    v.int64_value = int_options[i].second;
    v.value_size = 1;
  }
  for (size_t i = 0; i < string_options.size(); ++i) {
    PJRT_NamedValue& v = options[int_options.size() + i];
    v.struct_size = PJRT_NamedValue_STRUCT_SIZE;
    v.name = string_options[i].first.c_str();
    v.name_size = string_options[i].first.size();
    v.type = PJRT_NamedValue_kString;
    v.string_value = string_options[i].second.c_str();
    v.value_size = string_options[i].second.size();
  }
  PJRT_Client_Create_Args create{};
  create.create_options = options.data();
  create.num_options = options.size();
  if (KeyValueStore* store = client_options.kv_store.get()) {
    create.kv_get_callback = &detail::KeyValueGet;
    create.kv_get_user_arg = store;
    create.kv_put_callback = &detail::KeyValuePut;
    create.kv_put_user_arg = store;
    create.kv_try_get_callback = &detail::KeyValueTryGet;
    create.kv_try_get_user_arg = store;
  }
  TORCH_TPU_PJRT_CALL(p, PJRT_Client_Create, create);

  std::shared_ptr<Client> client(new Client());
  client->plugin_ = std::move(plugin);
  client->client_ = create.client;  // owned from here: ~Client destroys it
  client->kv_store_ = client_options.kv_store;

  PJRT_Client_AddressableDevices_Args list{};
  list.client = client->client_;
  TORCH_TPU_PJRT_CALL(p, PJRT_Client_AddressableDevices, list);
  client->devices_.reserve(list.num_addressable_devices);
  for (size_t i = 0; i < list.num_addressable_devices; ++i) {
    Device device;
    device.handle = list.addressable_devices[i];

    PJRT_Device_GetDescription_Args desc{};
    desc.device = device.handle;
    TORCH_TPU_PJRT_CALL(p, PJRT_Device_GetDescription, desc);

    PJRT_DeviceDescription_Id_Args id{};
    id.device_description = desc.device_description;
    TORCH_TPU_PJRT_CALL(p, PJRT_DeviceDescription_Id, id);
    device.id = id.id;

    PJRT_DeviceDescription_Kind_Args kind{};
    kind.device_description = desc.device_description;
    TORCH_TPU_PJRT_CALL(p, PJRT_DeviceDescription_Kind, kind);
    device.kind.assign(kind.device_kind, kind.device_kind_size);

    PJRT_DeviceDescription_DebugString_Args debug{};
    debug.device_description = desc.device_description;
    TORCH_TPU_PJRT_CALL(p, PJRT_DeviceDescription_DebugString, debug);
    device.debug_string.assign(debug.debug_string, debug.debug_string_size);

    PJRT_Device_LocalHardwareId_Args hw{};
    hw.device = device.handle;
    TORCH_TPU_PJRT_CALL(p, PJRT_Device_LocalHardwareId, hw);
    device.local_hardware_id = hw.local_hardware_id;

    client->devices_.push_back(std::move(device));
  }
  return client;
}

Client::~Client() {
  if (client_ == nullptr) return;
  PJRT_Client_Destroy_Args args{};
  args.client = client_;
  TORCH_TPU_PJRT_CALL_NOTHROW(*plugin_, PJRT_Client_Destroy, args);
}

int Client::global_device_count() const {
  PJRT_Client_Devices_Args args{};
  args.client = client_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Client_Devices, args);
  return static_cast<int>(args.num_devices);
}

int Client::process_index() const {
  PJRT_Client_ProcessIndex_Args args{};
  args.client = client_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Client_ProcessIndex, args);
  return args.process_index;
}

std::string Client::platform_name() const {
  PJRT_Client_PlatformName_Args args{};
  args.client = client_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Client_PlatformName, args);
  return std::string(args.platform_name, args.platform_name_size);
}

std::string Client::platform_version() const {
  PJRT_Client_PlatformVersion_Args args{};
  args.client = client_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Client_PlatformVersion, args);
  return std::string(args.platform_version, args.platform_version_size);
}

std::optional<MemoryStats> Client::memory_stats(const Device& device) const {
  if (!TORCH_TPU_PJRT_HAS(*plugin_, PJRT_Device_MemoryStats)) {
    return std::nullopt;
  }
  PJRT_Device_MemoryStats_Args args{};
  args.device = device.handle;
  try {
    TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Device_MemoryStats, args);
  } catch (const Error& e) {
    if (e.code() == PJRT_Error_Code_UNIMPLEMENTED) return std::nullopt;
    throw;
  }
  MemoryStats stats;
  stats.bytes_in_use = args.bytes_in_use;
  if (args.peak_bytes_in_use_is_set) {
    stats.peak_bytes_in_use = args.peak_bytes_in_use;
  }
  if (args.bytes_limit_is_set) stats.bytes_limit = args.bytes_limit;
  return stats;
}

std::unique_ptr<Executable> Client::Compile(std::string_view mlir_text,
                                            const CompileOptions& options) {
  static constexpr char kFormat[] = "mlir";
  PJRT_Program program{};
  program.struct_size = PJRT_Program_STRUCT_SIZE;
  // The plugin only reads `code` when compiling.
  program.code = const_cast<char*>(mlir_text.data());
  program.code_size = mlir_text.size();
  program.format = kFormat;
  program.format_size = sizeof(kFormat) - 1;

  const std::string serialized_options = options.Serialize();
  PJRT_Client_Compile_Args args{};
  args.client = client_;
  args.program = &program;
  args.compile_options = serialized_options.data();
  args.compile_options_size = serialized_options.size();
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Client_Compile, args);
  return std::make_unique<Executable>(plugin_, args.executable);
}

std::unique_ptr<Executable> Client::DeserializeAndLoad(
    std::string_view serialized) {
  PJRT_Executable_DeserializeAndLoad_Args args{};
  args.client = client_;
  args.serialized_executable = serialized.data();
  args.serialized_executable_size = serialized.size();
  // overridden_serialized_compile_options left null: use the stored options.
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Executable_DeserializeAndLoad, args);
  return std::make_unique<Executable>(plugin_, args.loaded_executable);
}

std::unique_ptr<Buffer> Client::BufferFromHost(const void* data,
                                               PJRT_Buffer_Type type,
                                               std::span<const int64_t> dims,
                                               const Device& device) {
  // A zero-element buffer may come with no data pointer; hand the plugin a
  // valid (never read) address anyway.
  static const char kEmpty[1] = {0};
  PJRT_Client_BufferFromHostBuffer_Args args{};
  args.client = client_;
  args.data = data != nullptr ? data : kEmpty;
  args.type = type;
  args.dims = dims.data();
  args.num_dims = dims.size();
  args.byte_strides = nullptr;  // dense row-major
  args.num_byte_strides = 0;
  // The plugin copies the data before returning; `data` may be freed then.
  args.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
  args.device = device.handle;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Client_BufferFromHostBuffer, args);
  auto buffer = std::make_unique<Buffer>(plugin_, args.buffer);
  if (args.done_with_host_buffer != nullptr) {
    // Already signalled under kImmutableOnlyDuringCall; owned and destroyed
    // here. Awaiting costs nothing and keeps any plugin that signals late
    // honest about the "may be freed on return" promise.
    Event done(plugin_, args.done_with_host_buffer);
    done.Await();
  }
  return buffer;
}

}  // namespace torch_tpu::pjrt
