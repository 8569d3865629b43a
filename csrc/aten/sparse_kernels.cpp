// Sparse COO tensors on tpu (the SparsePrivateUse1 dispatch key): a
// `torch.sparse_coo` tensor whose device is tpu is PyTorch's own
// SparseTensorImpl holding two dense tpu tensors, indices (int64,
// [sparse_dim, nnz]) and values ([nnz, *dense_sizes]), as on CUDA.
//
//  - Structure and metadata (construction, empty/zeros/clone/copy_,
//    _indices/_values and indices/values as aliases, _nnz, sparse_dim,
//    dense_dim, is_coalesced, sparse_resize_, and the views permute /
//    unsqueeze / view_as_real / view_as_complex / _sparse_broadcast_to) use
//    PyTorch's own device-generic kernels, the ones SparseCPU, SparseCUDA
//    and SparseMPS share (aten/src/ATen/native/sparse/SparseTensor.cpp).
//  - Every other op with a sparse tpu argument (add/sub/mul/div, to_dense,
//    coalesce, mm, sum, unary math, ...; registered for each op with a
//    SparseCPU kernel by RegisterSparseOps, and as the key's fallback) runs
//    on the CPU: sparse tpu arguments become sparse CPU tensors (indices and
//    values copied), dense tpu ones dense CPU tensors, a tpu device argument
//    the CPU; CPU's kernel runs, so results, dtypes and errors are CPU's;
//    written arguments get their new value back (a sparse one: its sizes,
//    indices, values and coalesced flag, through copy_), and other results
//    move to the tpu device. Counted and warned once per op like every CPU
//    fallback (torch_tpu.metrics()["cpu_fallbacks"]; TORCH_TPU_CPU_FALLBACK=0
//    makes it a NotImplementedError naming the op).
// Sparse compressed layouts (CSR/CSC/BSR/BSC) have no tpu kernels.
#include <ATen/ATen.h>
#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_dimI_native.h>
#include <ATen/ops/_dimV_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_broadcast_to_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/clone_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/copy_sparse_to_sparse_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/empty_like_native.h>
#include <ATen/ops/empty_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/permute_native.h>
#include <ATen/ops/resize_as_sparse_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/sparse_resize_and_clear_native.h>
#include <ATen/ops/sparse_resize_native.h>
#include <ATen/ops/unsqueeze_native.h>
#include <ATen/ops/values_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/zero_native.h>
#include <ATen/ops/zeros_native.h>
#include <ATen/native/Resize.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "aten/tpu.h"

namespace torch_tpu::aten {
namespace {

bool OnTpu(const at::Tensor& t) { return t.defined() && t.device().type() == kTpu; }

// A tpu tensor's CPU counterpart (sparse: its indices and values copied by
// _to_copy, the coalesced flag kept); other tensors as they are, but a
// tensor of another device (0-dim CPU tensors aside, as PyTorch allows
// them) raises PyTorch's device mismatch error, as on CUDA, rather than
// computing on the CPU.
at::Tensor ToCpu(const at::Tensor& t, std::optional<c10::Device>& device, std::optional<c10::Device>& other) {
  if (!t.defined()) return t;
  if (!OnTpu(t)) {
    if (!(t.is_cpu() && t.dim() == 0) && !other) other = t.device();
    return t;
  }
  if (!device) device = t.device();
  return t.cpu();
}

// Writes `cpu`, the value a CPU kernel left in the CPU counterpart of the
// written tpu argument `tpu`, back into it: a sparse one takes its sizes,
// dims, indices, values and coalesced flag (copy_sparse_), a dense one is
// resized as CPU's kernel resized it, then copied.
void WriteBack(const at::Tensor& tpu, const at::Tensor& cpu) {
  if (tpu.is_sparse()) {
    TORCH_CHECK(cpu.is_sparse(), "torch_tpu: a sparse tpu tensor was written with a ", cpu.layout(),
                " value on the CPU");
    tpu.copy_(cpu);
    return;
  }
  if (tpu.sizes() != cpu.sizes()) at::native::resize_output(tpu, cpu.sizes());
  tpu.copy_(cpu);
}

// The CPU call behind the fallback (see the file comment). Runs under
// RunOnCpu, which counts and warns.
void SparseCpuCall(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t n = args.size();
  const size_t first = stack->size() - n;
  std::optional<c10::Device> device, other;
  // Written tensor arguments: (position, tpu tensor, its CPU counterpart).
  struct Written {
    size_t arg;
    at::Tensor tpu, cpu;
  };
  std::vector<Written> written;
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[first + i];
    const bool write = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    if (v.isTensor()) {
      at::Tensor cpu = ToCpu(v.toTensor(), device, other);
      if (write && OnTpu(v.toTensor())) written.push_back({i, v.toTensor(), cpu});
      v = cpu;
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) {
        TORCH_CHECK(!(write && OnTpu(t)), "torch_tpu: ", schema.name(),
                    " writes a tensor list with tpu tensors, which the sparse CPU fallback does not support");
        list.push_back(ToCpu(t, device, other));
      }
      v = list;
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList())
        list.push_back(t.has_value() ? std::optional<at::Tensor>(ToCpu(*t, device, other)) : std::nullopt);
      v = list;
    } else if (v.isDevice() && v.toDevice().type() == kTpu) {
      if (!device) device = v.toDevice();
      v = c10::Device(c10::kCPU);
    }
  }
  TORCH_INTERNAL_ASSERT(device.has_value(), "torch_tpu: sparse fallback for ", schema.name(), " saw no tpu argument");
  TORCH_CHECK(!other, "Expected all tensors to be on the same device, but found at least two devices, ", *device,
              " and ", *other, "! (", schema.name(), ")");
  op.callBoxed(stack);
  for (const Written& w : written) WriteBack(w.tpu, w.cpu);
  const auto& returns = schema.returns();
  const size_t rfirst = stack->size() - returns.size();
  for (size_t r = 0; r < returns.size(); ++r) {
    c10::IValue& v = (*stack)[rfirst + r];
    const c10::AliasInfo* alias = returns[r].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      // Returns a written argument (in-place, out=): the tpu tensor itself.
      bool found = false;
      for (const Written& w : written)
        if (args[w.arg].alias_info() && *args[w.arg].alias_info() == *alias) {
          v = w.tpu;
          found = true;
          break;
        }
      TORCH_INTERNAL_ASSERT(found, "torch_tpu: sparse fallback for ", schema.name(),
                            ": a returned alias matches no written tpu argument");
      continue;
    }
    // A view of a tpu input would come back as a copy: refuse rather than
    // break aliasing silently (the views PyTorch gives sparse tensors are
    // registered below).
    TORCH_CHECK_NOT_IMPLEMENTED(alias == nullptr, "torch_tpu: ", schema.name(),
                                " returns a view of a sparse tensor; it has no tpu kernel");
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined()) v = t.to(*device);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(t.defined() ? t.to(*device) : t);
      v = list;
    }
  }
}

void SparseFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  RunOnCpu(op, stack, "sparse layout", &SparseCpuCall);
}

}  // namespace

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&SparseFallback>());
}

// The device-generic structural kernels SparseCPU/SparseCUDA/SparseMPS share.
TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(at::native::empty_sparse));
  m.impl("empty_like", TORCH_FN(at::native::empty_like_sparse_coo));
  m.impl("_sparse_coo_tensor_with_dims", TORCH_FN(at::native::new_with_dims_sparse));
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", TORCH_FN(at::native::new_with_dims_and_tensor_sparse_symint));
  m.impl("sparse_resize_", TORCH_FN(at::native::sparse_resize_));
  m.impl("sparse_resize_and_clear_", TORCH_FN(at::native::sparse_resize_and_clear_));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("_dimI", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("_dimV", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse));
  m.impl("is_coalesced", TORCH_FN(at::native::is_coalesced_sparse));
  m.impl("_coalesced_", TORCH_FN(at::native::_coalesced_sparse_));
  m.impl("_indices", TORCH_FN(at::native::_indices_sparse));
  m.impl("_values", TORCH_FN(at::native::_values_sparse));
  m.impl("indices", TORCH_FN(at::native::indices_sparse));
  m.impl("values", TORCH_FN(at::native::values_sparse));
  m.impl("copy_", TORCH_FN(at::native::copy_sparse_wrapper_));
  m.impl("copy_sparse_to_sparse_", TORCH_FN(at::native::copy_sparse_));
  m.impl("resize_as_sparse_", TORCH_FN(at::native::resize_as_sparse_));
  m.impl("zero_", TORCH_FN(at::native::zero_sparse_));
  m.impl("zeros.out", TORCH_FN(at::native::zeros_sparse_out));
  m.impl("clone", TORCH_FN(at::native::clone_sparse));
  m.impl("permute", TORCH_FN(at::native::permute_sparse_coo));
  m.impl("unsqueeze", TORCH_FN(at::native::unsqueeze_sparse));
  m.impl("_sparse_broadcast_to", TORCH_FN(at::native::sparse_broadcast_to));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real_sparse));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex_sparse));
}

void RegisterSparseOps() {
  static torch::Library* library = nullptr;
  if (library) return;
  library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::SparsePrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    if (!handle->hasKernelForDispatchKey(c10::DispatchKey::SparseCPU) ||
        handle->hasKernelForDispatchKey(c10::DispatchKey::SparsePrivateUse1))
      continue;
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&SparseFallback>());
  }
}

}  // namespace torch_tpu::aten
