// PJRT_Buffer wrapper and element sizes.
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "call.h"
#include "pjrt.h"

namespace torch_tpu::pjrt {

Buffer::Buffer(std::shared_ptr<Plugin> plugin, PJRT_Buffer* buffer)
    : plugin_(std::move(plugin)), buffer_(buffer) {}

namespace {
std::atomic<Buffer::DeferDestroyHook> defer_destroy_hook{nullptr};
}  // namespace

void Buffer::SetDeferDestroyHook(DeferDestroyHook hook) { defer_destroy_hook.store(hook); }

void Buffer::DestroyHandle(const Plugin& plugin, PJRT_Buffer* handle) {
  if (handle == nullptr) return;
  PJRT_Buffer_Destroy_Args args{};
  args.buffer = handle;
  TORCH_TPU_PJRT_CALL_NOTHROW(plugin, PJRT_Buffer_Destroy, args);
}

Buffer::~Buffer() {
  if (buffer_ == nullptr) return;
  if (DeferDestroyHook hook = defer_destroy_hook.load(std::memory_order_relaxed); hook && hook(plugin_, buffer_))
    return;
  DestroyHandle(*plugin_, buffer_);
}

PJRT_Buffer_Type Buffer::element_type() const {
  PJRT_Buffer_ElementType_Args args{};
  args.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Buffer_ElementType, args);
  return args.type;
}

std::vector<int64_t> Buffer::dimensions() const {
  PJRT_Buffer_Dimensions_Args args{};
  args.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Buffer_Dimensions, args);
  return std::vector<int64_t>(args.dims, args.dims + args.num_dims);
}

size_t Buffer::on_device_size_in_bytes() const {
  PJRT_Buffer_OnDeviceSizeInBytes_Args args{};
  args.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Buffer_OnDeviceSizeInBytes, args);
  return args.on_device_size_in_bytes;
}

namespace {

// Awaits and destroys `event` (which may be null); throws the event's error.
void AwaitAndDestroy(const std::shared_ptr<Plugin>& plugin, PJRT_Event* event) {
  if (event == nullptr) return;
  Event owned(plugin, event);
  owned.Await();
}

}  // namespace

namespace {

// True when the buffer's bytes are dense row-major: the default (descending)
// minor_to_major and no tiling. Anything else, or a plugin that cannot say,
// is false.
bool IsDenseRowMajor(const Plugin& plugin, PJRT_Buffer* buffer) {
  if (!TORCH_TPU_PJRT_HAS(plugin, PJRT_Buffer_GetMemoryLayout)) return false;
  PJRT_Buffer_GetMemoryLayout_Args args{};
  args.buffer = buffer;
  TORCH_TPU_PJRT_CALL(plugin, PJRT_Buffer_GetMemoryLayout, args);
  if (args.layout.type != PJRT_Buffer_MemoryLayout_Type_Tiled) return false;
  const PJRT_Buffer_MemoryLayout_Tiled& tiled = args.layout.tiled;
  if (tiled.num_tiles != 0) return false;
  const size_t rank = tiled.minor_to_major_size;
  for (size_t i = 0; i < rank; ++i) {
    if (tiled.minor_to_major[i] != static_cast<int64_t>(rank - 1 - i)) {
      return false;
    }
  }
  return true;
}

}  // namespace

// Plugins whose buffers live in host memory (the XLA CPU plugin) complete
// PJRT_Buffer_ToHostBuffer on a worker thread, which costs ~15 us per call
// even for a ready 16-byte buffer. For those, once the buffer is ready,
// copy straight from its memory (pinned with an external reference) when it
// is dense row-major and exactly nbytes long; otherwise use the plugin.
bool Buffer::ToHostDirect(void* dst, size_t nbytes) const {
  const Plugin& p = *plugin_;
  if (!TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_IsOnCpu) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_OpaqueDeviceMemoryDataPointer) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_IncreaseExternalReferenceCount) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_DecreaseExternalReferenceCount)) {
    return false;
  }
  PJRT_Buffer_IsOnCpu_Args on_cpu{};
  on_cpu.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(p, PJRT_Buffer_IsOnCpu, on_cpu);
  if (!on_cpu.is_on_cpu) return false;

  // Waits for the producing computation and throws its error, if any.
  PJRT_Buffer_ReadyEvent_Args ready{};
  ready.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(p, PJRT_Buffer_ReadyEvent, ready);
  Event(plugin_, ready.event).Await();

  if (on_device_size_in_bytes() < nbytes || !IsDenseRowMajor(p, buffer_)) {
    return false;
  }
  void* data = AcquireHostPointer();
  if (data == nullptr) return false;
  std::memcpy(dst, data, nbytes);
  ReleaseHostPointer();
  return true;
}

void* Buffer::AcquireHostPointer() const {
  const Plugin& p = *plugin_;
  PJRT_Buffer_IncreaseExternalReferenceCount_Args inc{};
  inc.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(p, PJRT_Buffer_IncreaseExternalReferenceCount, inc);
  PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args ptr{};
  ptr.buffer = buffer_;
  try {
    TORCH_TPU_PJRT_CALL(p, PJRT_Buffer_OpaqueDeviceMemoryDataPointer, ptr);
  } catch (...) {
    ReleaseHostPointer();
    throw;
  }
  if (ptr.device_memory_ptr == nullptr) ReleaseHostPointer();
  return ptr.device_memory_ptr;
}

void Buffer::ReleaseHostPointer() const {
  PJRT_Buffer_DecreaseExternalReferenceCount_Args dec{};
  dec.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Buffer_DecreaseExternalReferenceCount, dec);
}

bool Buffer::FromHostInPlace(const void* src, size_t nbytes) {
  const Plugin& p = *plugin_;
  if (nbytes == 0 || !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_IsOnCpu) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_OpaqueDeviceMemoryDataPointer) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_IncreaseExternalReferenceCount) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_DecreaseExternalReferenceCount)) {
    return false;
  }
  PJRT_Buffer_IsOnCpu_Args on_cpu{};
  on_cpu.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(p, PJRT_Buffer_IsOnCpu, on_cpu);
  if (!on_cpu.is_on_cpu) return false;
  auto ready = ReadyEvent();
  if (!ready->IsReady()) return false;
  try {
    ready->Await();  // a failed producer: leave the buffer (and its error) alone
  } catch (const Error&) {
    return false;
  }
  if (on_device_size_in_bytes() < nbytes || !IsDenseRowMajor(p, buffer_)) return false;
  void* data = AcquireHostPointer();
  if (data == nullptr) return false;
  std::memcpy(data, src, nbytes);
  ReleaseHostPointer();
  return true;
}

std::unique_ptr<HostMemory> Buffer::PinHostMemory() const {
  const Plugin& p = *plugin_;
  if (!TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_IsOnCpu) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_OpaqueDeviceMemoryDataPointer) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_IncreaseExternalReferenceCount) ||
      !TORCH_TPU_PJRT_HAS(p, PJRT_Buffer_DecreaseExternalReferenceCount)) {
    return nullptr;
  }
  PJRT_Buffer_IsOnCpu_Args on_cpu{};
  on_cpu.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(p, PJRT_Buffer_IsOnCpu, on_cpu);
  if (!on_cpu.is_on_cpu) return nullptr;
  ReadyEvent()->Await();  // throws the producer's error
  if (!IsDenseRowMajor(p, buffer_)) return nullptr;
  const size_t size = on_device_size_in_bytes();
  void* data = AcquireHostPointer();
  if (data == nullptr) return nullptr;
  return std::unique_ptr<HostMemory>(new HostMemory(this, data, size));
}

HostMemory::~HostMemory() {
  try {
    buffer_->ReleaseHostPointer();
  } catch (...) {  // a destructor does not throw; the reference stays (the buffer is kept, not corrupted)
  }
}

void Buffer::ToHost(void* dst, size_t nbytes) const {
  if (nbytes == 0) {
    // Nothing to copy (dst == nullptr would ask the plugin for the size
    // instead), but still wait for the data so that a failed computation
    // surfaces here as documented.
    ReadyEvent()->Await();
    return;
  }
  // The dense host size (the on-device size may include a layout's padding).
  size_t whole = ElementSizeInBytes(element_type());
  for (int64_t d : dimensions()) whole *= static_cast<size_t>(d);
  if (nbytes > whole)
    throw Error("Buffer::ToHost: asked for " + std::to_string(nbytes) + " bytes of a " + std::to_string(whole) +
                "-byte buffer");
  if (ToHostDirect(dst, nbytes)) return;
  if (nbytes < whole) {  // a prefix: the plugin copies whole buffers
    std::vector<char> all(whole);
    ToHostViaPlugin(all.data(), whole);
    std::memcpy(dst, all.data(), nbytes);
    return;
  }
  ToHostViaPlugin(dst, nbytes);
}

void Buffer::ToHostViaPlugin(void* dst, size_t nbytes) const {
  PJRT_Buffer_ToHostBuffer_Args args{};
  args.src = buffer_;
  args.dst = dst;
  args.dst_size = nbytes;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Buffer_ToHostBuffer, args);
  AwaitAndDestroy(plugin_, args.event);
}

std::unique_ptr<Event> Buffer::ReadyEvent() const {
  PJRT_Buffer_ReadyEvent_Args args{};
  args.buffer = buffer_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Buffer_ReadyEvent, args);
  return std::make_unique<Event>(plugin_, args.event);
}

size_t ElementSizeInBytes(PJRT_Buffer_Type type) {
  switch (type) {
    case PJRT_Buffer_Type_PRED:
    case PJRT_Buffer_Type_S8:
    case PJRT_Buffer_Type_U8:
    case PJRT_Buffer_Type_F8E5M2:
    case PJRT_Buffer_Type_F8E4M3FN:
    case PJRT_Buffer_Type_F8E4M3B11FNUZ:
    case PJRT_Buffer_Type_F8E5M2FNUZ:
    case PJRT_Buffer_Type_F8E4M3FNUZ:
    case PJRT_Buffer_Type_F8E4M3:
    case PJRT_Buffer_Type_F8E3M4:
    case PJRT_Buffer_Type_F8E8M0FNU:
      return 1;
    case PJRT_Buffer_Type_S16:
    case PJRT_Buffer_Type_U16:
    case PJRT_Buffer_Type_F16:
    case PJRT_Buffer_Type_BF16:
      return 2;
    case PJRT_Buffer_Type_S32:
    case PJRT_Buffer_Type_U32:
    case PJRT_Buffer_Type_F32:
      return 4;
    case PJRT_Buffer_Type_S64:
    case PJRT_Buffer_Type_U64:
    case PJRT_Buffer_Type_F64:
    case PJRT_Buffer_Type_C64:
      return 8;
    case PJRT_Buffer_Type_C128:
      return 16;
    case PJRT_Buffer_Type_S4:
    case PJRT_Buffer_Type_U4:
    case PJRT_Buffer_Type_S2:
    case PJRT_Buffer_Type_U2:
    case PJRT_Buffer_Type_F4E2M1FN:
    case PJRT_Buffer_Type_TOKEN:
    case PJRT_Buffer_Type_INVALID:
      break;
  }
  throw Error("PJRT_Buffer_Type " + std::to_string(static_cast<int>(type)) +
                  " has no fixed size in bytes",
              PJRT_Error_Code_INVALID_ARGUMENT);
}

}  // namespace torch_tpu::pjrt
