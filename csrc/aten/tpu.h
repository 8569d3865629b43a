// torch_tpu PrivateUse1 glue: shared declarations of the aten/ files.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>

namespace torch_tpu::aten {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

// allocator.cpp: storages whose data pointer is a runtime::DeviceStorage.
c10::Allocator* TpuAllocator();
// guard.cpp: the calling thread's current tpu device.
c10::DeviceIndex CurrentDevice();
// Number of tpu devices; 0 if the plugin cannot be loaded.
c10::DeviceIndex DeviceCount();
// generator.cpp
const at::Generator& DefaultGenerator(c10::DeviceIndex index);
// Seeds every device's default generator without creating the PJRT client
// (torch.manual_seed, as torch.cuda's lazy seeding): applied now when the
// generators exist, else when they are created with the client.
void SeedAllDefaultGenerators(uint64_t seed);
at::Generator NewGenerator(c10::DeviceIndex index);

// kernels.cpp: sets a tpu storage's size to `nbytes` (Tensor.resize_ when
// it grows, UntypedStorage.resize_). A sync point: the fused region is run
// first. The old buffer is released (resize_(0) frees it:
// torch.tpu.memory_allocated() drops by the old size) and the first
// min(old, new) bytes are kept, the rest zero (PyTorch leaves them
// uninitialized). Elements keep the stored type when `nbytes` holds whole
// ones, else take `dtype`'s; raises RuntimeError if `nbytes` is not a whole
// number of them, or torch.OutOfMemoryError if the new size does not fit.
void ResizeStorageBytes(const c10::Storage& storage, size_t nbytes, at::ScalarType dtype);

// fallback.cpp: registers the boxed kernel directly for every ATen op that
// has a lowering (called once when torch_tpu._C loads).
void RegisterLoweredOpsDirectly();
// fallback.cpp: runs `op` on the CPU, with one warning per op naming
// `reason` and a count in torch_tpu.metrics()["cpu_fallbacks"]; raises
// NotImplementedError naming the op under TORCH_TPU_CPU_FALLBACK=0.
// `cpu_call` moves the arguments to the CPU, calls the op and moves the
// results back (nullptr: PyTorch's at::native::cpu_fallback, dense tensors).
void RunOnCpu(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& reason,
              void (*cpu_call)(const c10::OperatorHandle&, torch::jit::Stack*) = nullptr);
// sparse_kernels.cpp: registers the sparse CPU fallback for the
// SparsePrivateUse1 key of every ATen op with a SparseCPU kernel and no
// SparsePrivateUse1 one, ahead of CompositeExplicitAutograd kernels that
// would compute otherwise than CPU's sparse kernel (sum() of a sparse
// tensor). Called once when torch_tpu._C loads.
void RegisterSparseOps();
// optimizer_kernels.cpp: registers PyTorch's composite kernel of every
// _foreach_* op for the tpu key, run as one program per call.
void RegisterForeachOps();

}  // namespace torch_tpu::aten
