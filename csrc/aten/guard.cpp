// Device guard for the tpu device: current device per thread, one default
// stream per device (PJRT orders each device's work), and synchronization
// through the runtime's in-flight tracking.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "aten/tpu.h"
#include "runtime/runtime.h"

namespace torch_tpu::aten {
namespace {

thread_local c10::DeviceIndex current_device = 0;

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kTpu, current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kTpu, "expected a tpu device, got ", d);
    c10::DeviceIndex n = DeviceCount();
    TORCH_CHECK(d.index() >= 0 && d.index() < n, "tpu device index ", static_cast<int>(d.index()),
                " is out of range: ", static_cast<int>(n), " tpu devices are available");
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return DeviceCount(); }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { runtime::Runtime::Get().Sync(); }
  void synchronizeDevice(const c10::DeviceIndex) const override { runtime::Runtime::Get().Sync(); }
};

}  // namespace

c10::DeviceIndex CurrentDevice() { return current_device; }

c10::DeviceIndex DeviceCount() {
  try {
    return static_cast<c10::DeviceIndex>(runtime::Runtime::Get().device_count());
  } catch (const std::exception&) {
    return 0;
  }
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

}  // namespace torch_tpu::aten
