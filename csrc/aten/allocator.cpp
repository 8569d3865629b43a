// The tpu allocator: a storage's data pointer is its runtime::DeviceStorage,
// which owns the storage's PJRT buffer (DESIGN.md, "Memory model"). Bytes
// are counted for torch.tpu.memory_allocated(); device memory itself is
// taken by the plugin when a buffer is written. An allocation that cannot
// fit (more than the device's total memory, or over the limit of
// torch.tpu.set_per_process_memory_fraction) raises torch.OutOfMemoryError
// naming the size and device (runtime::Runtime::OnAllocate).
#include <c10/core/CPUAllocator.h>

#include "aten/tpu.h"
#include "runtime/runtime.h"

namespace torch_tpu::aten {
namespace {

void DeleteStorage(void* ptr) { runtime::ReleaseStorage(static_cast<runtime::DeviceStorage*>(ptr)); }

struct Allocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex device = CurrentDevice();
    auto* storage = new runtime::DeviceStorage(nbytes, device);
    return {storage, storage, &DeleteStorage, c10::Device(kTpu, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &DeleteStorage; }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "tpu storages cannot be copied byte-wise; use Tensor.copy_");
  }
};

Allocator allocator;

}  // namespace

c10::Allocator* TpuAllocator() { return &allocator; }

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &allocator);

}  // namespace torch_tpu::aten
