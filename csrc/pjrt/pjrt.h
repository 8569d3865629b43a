// torch_tpu PJRT runtime layer: the only code that sees the PJRT C API.
//
// RAII wrappers over PJRT_Api handles (plugin, client, device, buffer,
// executable, event). Every C call goes through one helper that fills
// struct_size, checks that the plugin provides the function, and turns a
// PJRT_Error into a torch_tpu::pjrt::Error carrying the plugin's message.
// No torch types appear here.
//
// The C API declarations come from the header shipped by the installed
// plugin package (xla_cpu_pjrt/include/pjrt_c_api.h); the plugin's own
// pjrt_api_version is checked against it at load time.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pjrt_c_api.h"

namespace torch_tpu::pjrt {

// A PJRT error (or a failure of this layer): what() carries the plugin's
// message prefixed with the name of the C API function that failed.
class Error : public std::runtime_error {
 public:
  Error(std::string message, PJRT_Error_Code code = PJRT_Error_Code_UNKNOWN)
      : std::runtime_error(std::move(message)), code_(code) {}
  PJRT_Error_Code code() const { return code_; }

 private:
  PJRT_Error_Code code_;
};

// A loaded plugin shared library. Load() dlopens the path, calls GetPjrtApi,
// checks the API major version equals PJRT_API_MAJOR and calls
// PJRT_Plugin_Initialize. Throws Error naming the path and dlerror()/reason.
class Plugin {
 public:
  static std::shared_ptr<Plugin> Load(const std::string& path);
  ~Plugin();  // never dlcloses (plugins do not support unloading)
  const PJRT_Api* api() const { return api_; }
  const std::string& path() const { return path_; }
  int api_major() const;
  int api_minor() const;
  // PJRT_Plugin_Attributes as (name, value rendered as text), e.g.
  // ("xla_version", "2"), ("stablehlo_current_version", "1,9,3"); empty where
  // the plugin does not implement it. Useful in on-disk cache keys.
  std::vector<std::pair<std::string, std::string>> attributes() const;

 private:
  Plugin() = default;
  const PJRT_Api* api_ = nullptr;
  void* handle_ = nullptr;
  std::string path_;
};

class Event;
class Buffer;
class Executable;
class Client;

// Owns a PJRT_Event. Await() blocks; a failed event throws Error.
class Event {
 public:
  Event(std::shared_ptr<Plugin> plugin, PJRT_Event* event);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void Await();          // throws Error if the event completed with an error
  bool IsReady() const;

 private:
  std::shared_ptr<Plugin> plugin_;
  PJRT_Event* event_;
};

// A non-owning view of a device of the client (devices live as long as the
// client).
struct Device {
  PJRT_Device* handle = nullptr;
  int id = 0;
  int local_hardware_id = 0;
  std::string kind;         // PJRT_DeviceDescription_Kind, e.g. "cpu"
  std::string debug_string;
};

// Bytes in use/limit as reported by PJRT_Device_MemoryStats; nullopt where
// the plugin does not implement it.
struct MemoryStats {
  int64_t bytes_in_use = 0;
  std::optional<int64_t> peak_bytes_in_use;
  std::optional<int64_t> bytes_limit;
};

// A host-memory buffer's bytes (Buffer::PinHostMemory), pinned by an
// external reference on the buffer (PJRT_Buffer_IncreaseExternalReferenceCount)
// for as long as this object lives; the Buffer must outlive it. data() is
// the buffer's first byte (dense row-major), size() its on-device size in
// bytes (a storage's capacity, padding included).
class HostMemory {
 public:
  ~HostMemory();
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  friend class Buffer;
  HostMemory(const Buffer* buffer, void* data, size_t size) : buffer_(buffer), data_(data), size_(size) {}
  const Buffer* buffer_;
  void* data_;
  size_t size_;
};

// Owns a PJRT_Buffer (destroyed in the destructor, or handed to the
// deferral hook).
class Buffer {
 public:
  Buffer(std::shared_ptr<Plugin> plugin, PJRT_Buffer* buffer);
  ~Buffer();
  // PJRT_Buffer_Destroy blocks while an execution that was enqueued with the
  // buffer as an argument has not run yet (the XLA CPU plugin waits in
  // CommonPjRtBuffer::ReleaseBuffer for the execution's hold on the
  // buffer): dropping the last reference to a buffer right after launching
  // a program that reads it would make the host wait for every execution
  // queued before that one. A hook set here is offered each buffer the
  // destructor is about to destroy: returning true, it takes the handle and
  // must destroy it later with DestroyHandle (the runtime does so once the
  // executions launched before have completed); false destroys it now. The
  // hook must not destroy Buffers itself and may be called on any thread.
  using DeferDestroyHook = bool (*)(const std::shared_ptr<Plugin>& plugin, PJRT_Buffer* handle);
  static void SetDeferDestroyHook(DeferDestroyHook hook);
  // PJRT_Buffer_Destroy of a handle taken by the hook (errors are ignored,
  // as in the destructor).
  static void DestroyHandle(const Plugin& plugin, PJRT_Buffer* handle);
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  PJRT_Buffer* handle() const { return buffer_; }
  PJRT_Buffer_Type element_type() const;
  std::vector<int64_t> dimensions() const;
  size_t on_device_size_in_bytes() const;

  // Copies the buffer's first nbytes (dense, row-major; at most its size:
  // a prefix of a larger buffer is staged whole on the host unless the
  // buffer is host memory) into dst; blocks until the copy is done (and so until the
  // computation producing this buffer is done). Throws Error with the
  // plugin's message if the producing computation failed.
  void ToHost(void* dst, size_t nbytes) const;
  // ToHost always through PJRT_Buffer_ToHostBuffer, without the direct copy
  // that ToHost makes from buffers the plugin reports on the CPU.
  void ToHostViaPlugin(void* dst, size_t nbytes) const;
  // Overwrites the buffer's nbytes with src's, in place, where the plugin's
  // buffers are host memory (PJRT_Buffer_IsOnCpu: the XLA CPU plugin): a
  // memcpy into memory already touched, instead of a fresh allocation.
  // Returns false, writing nothing, unless the buffer is on the CPU, ready
  // (not failed), dense row-major and at least nbytes long (a shorter write
  // leaves the rest as it is). PJRT buffers are
  // otherwise immutable: the caller guarantees that nothing else holds or
  // reads this one (no other owner, no in-flight execution).
  bool FromHostInPlace(const void* src, size_t nbytes);
  // The buffer's memory, where the plugin's buffers are host memory
  // (PJRT_Buffer_IsOnCpu and PJRT_Buffer_OpaqueDeviceMemoryDataPointer: the
  // XLA CPU plugin), pinned for the returned object's life; nullptr where
  // the plugin cannot give it, or the buffer is not dense row-major. Blocks
  // until the buffer's data is ready; throws Error if the computation
  // producing it failed. Reading it is safe once ready; writing it breaks
  // PJRT's immutability: the caller guarantees that nothing else holds or
  // reads the buffer meanwhile (no other owner, no in-flight execution).
  std::unique_ptr<HostMemory> PinHostMemory() const;
  // Event that becomes ready when the buffer's data is ready (or failed).
  std::unique_ptr<Event> ReadyEvent() const;

 private:
  bool ToHostDirect(void* dst, size_t nbytes) const;
  // The buffer's host memory, pinned by an external reference until
  // ReleaseHostPointer; nullptr where the plugin cannot give it.
  void* AcquireHostPointer() const;
  void ReleaseHostPointer() const;
  friend class HostMemory;
  std::shared_ptr<Plugin> plugin_;
  PJRT_Buffer* buffer_;
};

// Serialized xla.CompileOptionsProto, built without protobuf.
struct CompileOptions {
  int num_replicas = 1;
  int num_partitions = 1;
  // CompileOptionsProto.compile_portable_executable: build an executable that
  // is not bound to a device, so that Execute may run it on any addressable
  // device (a non-portable one runs only on the device it was compiled for,
  // addressable_devices()[0]). Requires num_replicas == num_partitions == 1.
  bool portable = false;
  // XLA flags set through CompileOptionsProto.env_option_overrides, e.g.
  // {"xla_cpu_enable_fast_min_max", "false"}. Values are sent as strings
  // unless they are "true"/"false" (bool) .
  std::vector<std::pair<std::string, std::string>> env_option_overrides;
  // ExecutableBuildOptionsProto.device_assignment for num_partitions == 1:
  // replica r runs on the device whose (global) id is device_assignment[r];
  // its size must equal num_replicas. Empty: the client's default
  // assignment (replica r on device r). Not written when empty, so the
  // serialized options of every other program are unchanged.
  std::vector<int64_t> device_assignment;
  std::string Serialize() const;
};

// A compiled, loaded executable (PJRT_LoadedExecutable) on one device.
class Executable {
 public:
  Executable(std::shared_ptr<Plugin> plugin, PJRT_LoadedExecutable* exe);
  ~Executable();
  Executable(const Executable&) = delete;
  Executable& operator=(const Executable&) = delete;

  size_t num_outputs() const;
  // Runs on `device` (one replica, one partition) asynchronously: returns
  // the output buffers at once; they become ready later. `donated` lists
  // argument indices whose buffers may be donated (consumed) by the
  // execution; all others are marked non-donatable. If `complete` is
  // non-null it receives the device-complete event.
  std::vector<std::unique_ptr<Buffer>> Execute(
      std::span<Buffer* const> arguments, const Device& device,
      std::span<const int64_t> donated = {},
      std::unique_ptr<Event>* complete = nullptr);
  // Serialized executable (PJRT_Executable_Serialize) for the on-disk cache.
  std::string Serialize() const;

  // The devices a replicated / partitioned executable runs on in this
  // process (PJRT_LoadedExecutable_AddressableDevices), in the order
  // ExecuteReplicated takes its argument lists: the compile options' device
  // assignment (the client's default one: replica r on device r) restricted
  // to this process's devices.
  std::vector<PJRT_Device*> addressable_devices() const;
  // Runs a program compiled with num_replicas x num_partitions > 1 once on
  // each of addressable_devices(): argument_lists[i] are the arguments of
  // the i-th (each buffer on that device; no donation), and the result's
  // [i] its outputs. Asynchronous as Execute; `complete`, if non-null,
  // receives one device-complete event per device. Throws Error when the
  // number of lists differs from addressable_devices() or a list from the
  // program's arguments (the plugin's message), or a buffer is null.
  std::vector<std::vector<std::unique_ptr<Buffer>>> ExecuteReplicated(
      std::span<const std::vector<Buffer*>> argument_lists,
      std::vector<std::unique_ptr<Event>>* complete = nullptr);

 private:
  std::shared_ptr<Plugin> plugin_;
  PJRT_LoadedExecutable* exe_;
  PJRT_Executable* executable_ = nullptr;  // from GetExecutable, owned
  size_t num_outputs_ = 0;
};

// The key-value store PJRT_Client_Create's kv_get/kv_try_get/kv_put
// callbacks reach: how a client that spans processes (the XLA CUDA plugin
// with node_id/num_nodes, docs/distributed.md) exchanges its bootstrap data
// (NCCL unique ids, topology) with the other processes. Implementations
// must be thread-safe (the plugin may call from its own threads) and key
// the values so that no other user of the same store collides (the
// distributed layer uses the c10d store under the prefix "pjrt/").
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // The value of `key`, blocking until another process put it; throws
  // (any std::exception) after `timeout` (the plugin's).
  virtual std::string Get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // The value of `key`, or nullopt at once when it is not set.
  virtual std::optional<std::string> TryGet(const std::string& key) = 0;
  virtual void Put(const std::string& key, const std::string& value) = 0;
};

// PJRT_Client_Create's inputs. Option names and meanings are the plugin's
// (unknown ones are ignored by the XLA plugins): CPU "cpu_device_count";
// CUDA "node_id", "num_nodes" (int64), "platform_name" (string),
// "visible_devices" ... The store, when set, is kept alive by the client
// (the plugin may call the callbacks until the client is destroyed).
struct ClientOptions {
  std::vector<std::pair<std::string, int64_t>> int_options;
  std::vector<std::pair<std::string, std::string>> string_options;
  std::shared_ptr<KeyValueStore> kv_store;
};

namespace detail {
// The C callbacks Client::Create hands the plugin, user_arg a
// KeyValueStore*. A store exception becomes a PJRT_Error made by the
// plugin's callback_error: DEADLINE_EXCEEDED for Get (timed out), NOT_FOUND
// for TryGet of an absent key, INTERNAL otherwise, the message the
// exception's what(). Values returned by Get/TryGet are heap copies freed
// by the plugin through value_deleter_callback. Exposed for tests.
PJRT_Error* KeyValueGet(PJRT_KeyValueGetCallback_Args* args);
PJRT_Error* KeyValueTryGet(PJRT_KeyValueTryGetCallback_Args* args);
PJRT_Error* KeyValuePut(PJRT_KeyValuePutCallback_Args* args);
}  // namespace detail

// Owns a PJRT_Client.
class Client {
 public:
  // With string options and a key-value store (ClientOptions). Throws Error
  // with the plugin's diagnostic if the plugin rejects an option.
  static std::shared_ptr<Client> Create(std::shared_ptr<Plugin> plugin, const ClientOptions& options);
  // Every device of the runtime, also those of other processes
  // (PJRT_Client_Devices): more than addressable_devices() exactly when the
  // client spans processes.
  int global_device_count() const;
  // This process's index among the client's processes
  // (PJRT_Client_ProcessIndex; 0 in one process).
  int process_index() const;

  // `int_options`: integer PJRT_Client_Create options (PJRT_NamedValue
  // kInt64), plugin-specific, e.g. the CPU plugin's "cpu_device_count".
  // Throws Error with the plugin's diagnostic if the plugin rejects one.
  static std::shared_ptr<Client> Create(std::shared_ptr<Plugin> plugin,
                                        const std::vector<std::pair<std::string, int64_t>>& int_options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::shared_ptr<Plugin>& plugin() const { return plugin_; }
  PJRT_Client* handle() const { return client_; }
  std::string platform_name() const;     // e.g. "cpu"
  std::string platform_version() const;
  const std::vector<Device>& addressable_devices() const { return devices_; }
  std::optional<MemoryStats> memory_stats(const Device& device) const;

  // Compiles StableHLO/MLIR text (program format "mlir"). Throws Error with
  // the plugin's diagnostic on failure.
  std::unique_ptr<Executable> Compile(std::string_view mlir_text,
                                      const CompileOptions& options);
  std::unique_ptr<Executable> DeserializeAndLoad(std::string_view serialized);

  // Copies dense row-major host data to a new device buffer; the host data
  // may be freed when this returns.
  std::unique_ptr<Buffer> BufferFromHost(const void* data,
                                         PJRT_Buffer_Type type,
                                         std::span<const int64_t> dims,
                                         const Device& device);

 private:
  Client() = default;
  std::shared_ptr<Plugin> plugin_;
  PJRT_Client* client_ = nullptr;
  std::vector<Device> devices_;
  std::shared_ptr<KeyValueStore> kv_store_;  // ClientOptions::kv_store
};

// Size in bytes of one element of `type` (PJRT_Buffer_Type); throws for
// types without a fixed byte size.
size_t ElementSizeInBytes(PJRT_Buffer_Type type);

}  // namespace torch_tpu::pjrt
