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
//    written arguments get their new value back (WriteBack: keeping CPU's
//    aliasing of a sparse tensor's indices and values), and other results
//    move to the tpu device. Counted and warned once per op like every CPU
//    fallback (torch_tpu.metrics()["cpu_fallbacks"]; TORCH_TPU_CPU_FALLBACK=0
//    makes it a NotImplementedError naming the op).
// Sparse compressed layouts (CSR/CSC/BSR/BSC) have no tpu kernels.
#include <ATen/ATen.h>
#include <ATen/SparseTensorImpl.h>
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
#include <unordered_map>
#include <vector>

#include "aten/tpu.h"

namespace torch_tpu::aten {
namespace {

bool OnTpu(const at::Tensor& t) { return t.defined() && t.device().type() == kTpu; }

// A tpu tensor's CPU counterpart (sparse: its indices and values copied by
// _to_copy, the coalesced flag kept), one per tensor: a tensor passed twice
// (self and out= of smm's sspaddmm_out) stays one tensor on the CPU. Other
// tensors stay as they are, but one of another device (0-dim CPU tensors
// read as scalars aside, as PyTorch allows them) raises PyTorch's device
// mismatch error, as on CUDA, rather than computing on the CPU.
struct CpuCopies {
  std::optional<c10::Device> device, other;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> copies;

  at::Tensor Of(const at::Tensor& t, bool written) {
    if (!t.defined()) return t;
    if (!OnTpu(t)) {
      if ((written || !(t.is_cpu() && t.dim() == 0)) && !other) other = t.device();
      return t;
    }
    if (!device) device = t.device();
    auto [it, inserted] = copies.try_emplace(t.unsafeGetTensorImpl());
    if (inserted) it->second = t.cpu();
    return it->second;
  }
};

// A written tpu argument and its CPU counterpart; for a sparse one, the
// counterpart's indices and values tensors before the call.
struct Written {
  size_t arg;
  at::Tensor tpu, cpu, cpu_indices, cpu_values;
};

// Writes the value CPU's kernel left in `w.cpu` back into `w.tpu`. Sparse:
// where CPU's kernel wrote its indices or values tensor in place (div_ by a
// scalar, neg_, sqrt_: earlier _values() aliases see the change), the tpu
// tensor's own one is written in place too (resized if CPU's was); where it
// put in a new tensor (add_, mul_, zero_), the tpu tensor gets a new one;
// then sizes, dims and the coalesced flag. Dense: resized as CPU's kernel
// resized it, then copied.
void WriteBack(const Written& w) {
  const at::Tensor& tpu = w.tpu;
  const at::Tensor& cpu = w.cpu;
  if (tpu.is_sparse()) {
    TORCH_CHECK(cpu.is_sparse(), "torch_tpu: a sparse tpu tensor was written with a ", cpu.layout(),
                " value on the CPU");
    const at::Tensor ci = cpu._indices(), cv = cpu._values();
    auto in_place = [&](const at::Tensor& own, const at::Tensor& now, const at::Tensor& before) {
      if (now.unsafeGetTensorImpl() != before.unsafeGetTensorImpl()) return now.to(tpu.device());
      if (own.sizes() != now.sizes()) own.resize_(now.sizes());
      own.copy_(now);
      return own;
    };
    at::Tensor indices = in_place(tpu._indices(), ci, w.cpu_indices);
    at::Tensor values = in_place(tpu._values(), cv, w.cpu_values);
    auto* impl = static_cast<at::SparseTensorImpl*>(tpu.unsafeGetTensorImpl());
    impl->raw_resize_(cpu.sparse_dim(), cpu.dense_dim(), cpu.sizes());
    impl->set_indices_and_values_unsafe(indices, values);
    impl->set_coalesced(cpu.is_coalesced());
    return;
  }
  if (tpu.sizes() != cpu.sizes()) at::native::resize_output(tpu, cpu.sizes());
  tpu.copy_(cpu);
}

bool Compressed(const at::Tensor& t) {
  const c10::Layout l = t.layout();
  return l == c10::kSparseCsr || l == c10::kSparseCsc || l == c10::kSparseBsr || l == c10::kSparseBsc;
}

// The CPU call behind the fallback (see the file comment). Runs under
// RunOnCpu, which counts and warns.
void SparseCpuCall(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t n = args.size();
  const size_t first = stack->size() - n;
  CpuCopies cpu;
  std::vector<Written> written;
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[first + i];
    const bool write = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    if (v.isTensor()) {
      const at::Tensor t = v.toTensor();
      at::Tensor c = cpu.Of(t, write);
      if (write && OnTpu(t))
        written.push_back({i, t, c, t.is_sparse() ? c._indices() : at::Tensor(),
                           t.is_sparse() ? c._values() : at::Tensor()});
      v = c;
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) {
        TORCH_CHECK(!(write && OnTpu(t)), "torch_tpu: ", schema.name(),
                    " writes a tensor list with tpu tensors, which the sparse CPU fallback does not support");
        list.push_back(cpu.Of(t, write));
      }
      v = list;
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList())
        list.push_back(t.has_value() ? std::optional<at::Tensor>(cpu.Of(*t, write)) : std::nullopt);
      v = list;
    } else if (v.isDevice() && v.toDevice().type() == kTpu) {
      if (!cpu.device) cpu.device = v.toDevice();
      v = c10::Device(c10::kCPU);
    }
  }
  TORCH_INTERNAL_ASSERT(cpu.device.has_value(), "torch_tpu: sparse fallback for ", schema.name(),
                        " saw no tpu argument");
  TORCH_CHECK(!cpu.other, "Expected all tensors to be on the same device, but found at least two devices, ",
              *cpu.device, " and ", *cpu.other, "! (", schema.name(), ")");
  const c10::Device device = *cpu.device;
  op.callBoxed(stack);
  for (const Written& w : written) WriteBack(w);
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
    auto to_device = [&](const at::Tensor& t) {
      if (!t.defined()) return t;
      TORCH_CHECK_NOT_IMPLEMENTED(!Compressed(t), "torch_tpu: ", schema.name(), " returns a ", t.layout(),
                                  " tensor: sparse compressed layouts (CSR/CSC/BSR/BSC) have no tpu kernels");
      return t.to(device);
    };
    if (v.isTensor()) {
      v = to_device(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(to_device(t));
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
