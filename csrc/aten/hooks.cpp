// PrivateUse1 hooks: what PyTorch asks of a backend outside op dispatch
// (availability, generators, device of a pointer). Registered at load.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "aten/tpu.h"
#include "runtime/runtime.h"

namespace torch_tpu::aten {
namespace {

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return DeviceCount() > 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return DefaultGenerator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return NewGenerator(index); }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kTpu, CurrentDevice()); }
  bool isPinnedPtr(const void*) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
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
  Registrar() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
} registrar;

}  // namespace
}  // namespace torch_tpu::aten
