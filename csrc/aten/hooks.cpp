// PrivateUse1 hooks: what PyTorch asks of a backend outside op dispatch
// (availability, generators, device of a pointer). Registered at load.
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <mutex>
#include <unordered_set>

#include "aten/tpu.h"
#include "runtime/runtime.h"

namespace torch_tpu::aten {
namespace {

// The host ("pinned") allocator PyTorch asks for by device type
// (`at::getHostAllocator(PrivateUse1)`: `pin_memory()`, `is_pinned()`,
// `torch.accelerator.empty_host_cache()`, host stats). Host<->device copies
// go through PJRT's own host buffers, so "pinned" memory here is plain CPU
// memory, remembered by address so that `is_pinned()` answers as on CUDA;
// nothing is cached: empty_cache() has nothing to free and the stats stay
// zero. Without a registered allocator PyTorch called through a null pointer
// (a release build only asserts in debug): `empty_host_cache()` crashed.
class HostAllocator final : public at::HostAllocator {
 public:
  at::DataPtr allocate(size_t size) override {
    auto* block = new Block{c10::GetCPUAllocator()->allocate(size)};
    void* ptr = block->memory.get();
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.insert(ptr);
    }
    return {ptr, block, &HostAllocator::Delete, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool record_event(void*, void*, c10::Stream) override { return false; }  // blocks are never reused
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}

  bool Owns(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.count(ptr) > 0;
  }
  static HostAllocator& Get() {
    static HostAllocator* allocator = new HostAllocator();  // outlives every pinned tensor
    return *allocator;
  }

 private:
  struct Block {
    at::DataPtr memory;
  };
  static void Delete(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    if (void* ptr = block->memory.get()) {
      std::lock_guard<std::mutex> lock(Get().mutex_);
      Get().live_.erase(ptr);
    }
    delete block;
  }
  std::mutex mutex_;
  std::unordered_set<const void*> live_;
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return DeviceCount() > 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return DefaultGenerator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return NewGenerator(index); }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kTpu, CurrentDevice()); }
  bool isPinnedPtr(const void* ptr) const override { return HostAllocator::Get().Owns(ptr); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &HostAllocator::Get(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return DeviceCount(); }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    c10::impl::getDeviceGuardImpl(kTpu)->setDevice(c10::Device(kTpu, d));
  }
  c10::DeviceIndex getCurrentDevice() const override { return CurrentDevice(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    return c10::impl::getDeviceGuardImpl(kTpu)->exchangeDevice(c10::Device(kTpu, d)).index();
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    // UntypedStorage.resize_: a byte storage, so bytes when it holds none.
    ResizeStorageBytes(storage, newsize, at::kByte);
  }
};

struct Registrar {
  Registrar() {
    at::RegisterPrivateUse1HooksInterface(new Hooks());
    at::setHostAllocator(at::kPrivateUse1, &HostAllocator::Get());
  }
} registrar;

}  // namespace
}  // namespace torch_tpu::aten
