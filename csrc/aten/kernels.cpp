// Kernels registered directly for the tpu (PrivateUse1) dispatch key: what
// is not a lowering. Allocation (empty), views (metadata only, sharing the
// storage), resize/set_, copies between host and device, reading a scalar,
// and the attention backend choice. Every other op reaches fallback.cpp.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/unfold_native.h>
#include <torch/library.h>

#include <vector>

#include "aten/tpu.h"
#include "lowering/lowering.h"
#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::aten {
namespace {

using runtime::Runtime;
using runtime::StorageOf;

c10::DispatchKeySet TpuKeys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

at::Tensor Empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                 std::optional<at::Device> device, std::optional<bool> pin_memory,
                 std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "tpu tensors must be strided, got layout ", *layout);
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, TpuAllocator(), TpuKeys(), c10::dtype_or_default(dtype), memory_format);
}

at::Tensor EmptyStrided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                        std::optional<at::Layout> layout, std::optional<at::Device> device,
                        std::optional<bool> pin_memory) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "tpu tensors must be strided, got layout ", *layout);
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, TpuAllocator(), TpuKeys(), c10::dtype_or_default(dtype));
}

at::Tensor AsStrided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                     std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor View(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor ReshapeAlias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// unfold(self, dimension, size, step): windows of `size` elements every
// `step` along `dimension`, as a new last dimension; a view (PyTorch's own
// size/stride computation and errors, then as_strided over the storage).
at::Tensor Unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

// Bytes of host memory holding the storage's current contents (zeros if it
// was never written).
std::vector<char> StorageBytes(const c10::Storage& storage, at::ScalarType dtype) {
  std::vector<char> bytes(storage.nbytes(), 0);
  auto* ds = static_cast<runtime::DeviceStorage*>(storage.data_ptr().get_context());
  if (ds && ds->initialized()) {
    const auto& cur = ds->Materialize(ds->current().element);
    size_t n = static_cast<size_t>(cur.numel) * runtime::ElementSize(cur.element);
    Runtime::Get().Download(cur, bytes.data(), std::min(n, bytes.size()));
  }
  return bytes;
}

// Grows the storage to `nbytes`, keeping its contents (PyTorch's resize_
// keeps the old elements).
void GrowStorage(const at::Tensor& self, size_t nbytes) {
  c10::Storage storage = self.storage();
  if (nbytes <= storage.nbytes()) return;
  std::vector<char> old = StorageBytes(storage, self.scalar_type());
  c10::DataPtr fresh = TpuAllocator()->allocate(nbytes);
  auto* ds = static_cast<runtime::DeviceStorage*>(fresh.get_context());
  hlo::ElementType e = lowering::ToElementType(self.scalar_type());
  size_t esize = runtime::ElementSize(e);
  int64_t numel = static_cast<int64_t>(nbytes / esize);
  if (!old.empty()) {
    std::vector<char> bytes(static_cast<size_t>(numel) * esize, 0);
    std::memcpy(bytes.data(), old.data(), std::min(old.size(), bytes.size()));
    int64_t dims[] = {numel};
    ds->Set({Runtime::Get().Upload(bytes.data(), e, dims, self.device().index()), e, numel, "resize_"});
  }
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(nbytes);
}

const at::Tensor& Resize(const at::Tensor& self, c10::IntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format) {
  runtime::FlushPendingWork();  // recorded ops saw the old metadata
  auto* impl = self.unsafeGetTensorImpl();
  int64_t numel = c10::multiply_integers(size);
  size_t nbytes = numel == 0 ? 0
                             : static_cast<size_t>(numel + self.storage_offset()) * self.dtype().itemsize();
  GrowStorage(self, nbytes);
  impl->set_sizes_contiguous(size);
  if (memory_format && *memory_format != at::MemoryFormat::Preserve)
    impl->empty_tensor_restride(*memory_format);
  return self;
}

at::Tensor& SetStorage(at::Tensor& self, c10::Storage source, c10::SymInt storage_offset, c10::SymIntArrayRef size,
                       c10::SymIntArrayRef stride) {
  runtime::FlushPendingWork();  // recorded ops saw the old metadata
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(storage_offset.expect_int());
  impl->set_sizes_and_strides(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
  return self;
}

at::Tensor& SetSourceStorage(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  std::vector<c10::SymInt> size{n}, stride{1};
  return SetStorage(self, std::move(source), 0, size, stride);
}

at::Tensor& SetSourceTensor(at::Tensor& self, const at::Tensor& source) {
  return SetStorage(self, source.storage(), source.sym_storage_offset(), source.sym_sizes(), source.sym_strides());
}

at::Tensor& SetEmpty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, TpuAllocator(), true);
  std::vector<c10::SymInt> size{0}, stride{1};
  return SetStorage(self, std::move(storage), 0, size, stride);
}

// True if `t` is the whole of its storage, dense and typed as the storage.
bool IsWholeStorage(const at::Tensor& t) {
  auto& s = StorageOf(t);
  if (!t.is_contiguous() || t.storage_offset() != 0) return false;
  hlo::ElementType e = lowering::ToElementType(t.scalar_type());
  if (s.initialized()) return s.current().element == e && s.current().numel == t.numel();
  return static_cast<int64_t>(s.nbytes()) == t.numel() * static_cast<int64_t>(t.element_size());
}

}  // namespace

// A view of t's elements as stored (same storage and layout) with the
// conjugate and negative bits cleared; t itself if neither is set.
at::Tensor PhysicalView(const at::Tensor& t) {
  if (!t.is_conj() && !t.is_neg()) return t;
  at::Tensor v = at::native::as_strided_tensorimpl(t, t.sizes(), t.strides(), t.storage_offset());
  v.unsafeGetTensorImpl()->_set_conj(false);
  v.unsafeGetTensorImpl()->_set_neg(false);
  return v;
}

// A new tensor holding t's values with its conjugate/negative bits applied
// (what at::resolve_conj(at::resolve_neg(t)) gives on CPU); t itself if
// neither bit is set. Negation lowers; conjugating complex values runs
// wherever conj_physical runs (the CPU today: complex arithmetic).
at::Tensor ResolveMathBits(const at::Tensor& t) {
  if (!t.is_conj() && !t.is_neg()) return t;
  at::Tensor v = PhysicalView(t);
  if (t.is_conj()) v = at::conj_physical(v);
  if (t.is_neg()) v = at::neg(v);
  return v;
}

namespace {

void RunCopy(const at::Tensor& dst, const at::Tensor& src) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  static const lowering::LoweringEntry* entry = lowering::FindLowering("copy");
  TORCH_CHECK(entry, "torch_tpu: no lowering for copy");
  torch::jit::Stack stack{dst, src, false};
  runtime::RunOp(op, &stack, *entry);
}

// copy_ between devices (PyTorch's copy_ sends every copy involving a tpu
// tensor here). As on CPU/CUDA: dst's logical values become src's logical
// values, so the conjugate/negative bits of both are honoured (dst stores
// its values with its own bits undone), and a dst with internally
// overlapping elements (expanded) is rejected.
at::Tensor CopyFrom(const at::Tensor& src, const at::Tensor& dst_logical, bool non_blocking) {
  if (dst_logical.numel() == 0) return dst_logical;
  const bool src_tpu = src.device().type() == kTpu, dst_tpu = dst_logical.device().type() == kTpu;
  if (dst_tpu) at::assert_no_internal_overlap(dst_logical);
  auto& rt = Runtime::Get();
  if (!src_tpu && dst_tpu) {
    TORCH_CHECK(src.device().is_cpu(), "copy to tpu from ", src.device(), " is not supported; copy to the CPU first");
    const at::Tensor dst = PhysicalView(dst_logical);
    at::Tensor host = src.resolve_conj().resolve_neg().to(dst.scalar_type());
    if (dst_logical.is_conj()) host = host.conj_physical();
    if (dst_logical.is_neg()) host = host.neg();
    if (IsWholeStorage(dst)) {
      // Replacing the buffer directly: recorded ops must see the old one.
      runtime::FlushPendingWork();
      host = host.expand(dst.sizes()).contiguous();
      hlo::ElementType e = lowering::ToElementType(dst.scalar_type());
      int64_t dims[] = {dst.numel()};
      StorageOf(dst).Set({rt.Upload(host.data_ptr(), e, dims, dst.device().index()), e, dst.numel(), "copy from cpu"});
      return dst_logical;
    }
    host = host.contiguous();
    hlo::ElementType e = lowering::ToElementType(host.scalar_type());
    int64_t dims[] = {host.numel()};
    at::Tensor staged = runtime::WrapBuffer(
        {rt.Upload(host.data_ptr(), e, dims, dst.device().index()), e, host.numel(), "copy from cpu"}, host.sizes(),
        host.scalar_type(), dst.device().index());
    RunCopy(dst, staged);
    return dst_logical;
  }
  if (src_tpu && !dst_tpu) {
    const at::Tensor& dst = dst_logical;
    TORCH_CHECK(dst.device().is_cpu(), "copy from tpu to ", dst.device(), " is not supported");
    rt.Sync();  // a sync point: earlier failures surface here, naming their op
    // The stored elements, downloaded, then given src's bits: the CPU copy_
    // below resolves them.
    at::Tensor stored = PhysicalView(src);
    at::Tensor whole = IsWholeStorage(stored) ? stored : at::clone(stored, at::MemoryFormat::Contiguous);
    at::Tensor host = at::empty(whole.sizes(), whole.options().device(at::kCPU));
    hlo::ElementType e = lowering::ToElementType(whole.scalar_type());
    rt.Download(StorageOf(whole).Materialize(e), host.data_ptr(), host.nbytes());
    host.unsafeGetTensorImpl()->_set_conj(src.is_conj());
    host.unsafeGetTensorImpl()->_set_neg(src.is_neg());
    dst.copy_(host);
    return dst;
  }
  TORCH_CHECK(src_tpu && dst_tpu, "unsupported copy from ", src.device(), " to ", dst_logical.device());
  if (src.device() != dst_logical.device()) {
    return dst_logical.copy_(src.cpu());
  }
  // Within a device, whole storage onto whole storage of one dtype (how
  // AOTAutograd applies a compiled graph's input mutations: param.copy_(
  // new_param)): dst takes src's buffer, no program. Buffers are never
  // written in place while shared (donation requires a sole holder), so the
  // two storages stay independent. Recorded ops must see dst's old buffer.
  if (src.is_conj() == dst_logical.is_conj() && src.is_neg() == dst_logical.is_neg() &&
      src.scalar_type() == dst_logical.scalar_type() && src.sizes() == dst_logical.sizes() &&
      IsWholeStorage(src) && IsWholeStorage(dst_logical)) {
    runtime::DeviceStorage& from = StorageOf(src);
    if (&from == &StorageOf(dst_logical)) return dst_logical;  // the same elements (a donated graph input)
    hlo::ElementType e = lowering::ToElementType(src.scalar_type());
    if (!from.pending() && from.current().buffer && from.current().element == e &&
        from.current().numel == src.numel()) {
      runtime::FlushPendingWork();
      if (!from.pending() && from.current().buffer) {
        runtime::StorageBuffer shared = from.current();
        StorageOf(dst_logical).Set(std::move(shared));
        return dst_logical;
      }
    }
  }
  // Within a device: the stored elements of src, conjugated/negated where
  // src's and dst's bits differ (each bit is its own inverse).
  at::Tensor value = PhysicalView(src);
  if (src.is_conj() != dst_logical.is_conj() && dst_logical.is_complex()) value = at::conj_physical(value);
  if (src.is_neg() != dst_logical.is_neg()) value = at::neg(value);
  RunCopy(PhysicalView(dst_logical), value);
  return dst_logical;
}

at::Tensor CopyFromAndResize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) Resize(dst, self.sizes(), std::nullopt);
  return CopyFrom(self, dst, false);
}

at::Scalar LocalScalarDense(const at::Tensor& self) {
  // item() of any one-element tensor ([], [1], [1, 1], ...).
  at::Tensor host = at::empty(self.sizes(), self.options().device(at::kCPU));
  CopyFrom(self, host, false);
  return host.item();
}

int64_t FusedSdpChoice(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                       double, bool, std::optional<double>, bool) {
  // The math path decomposes attention into matmul/softmax, which lower.
  return static_cast<int64_t>(sdp::SDPBackend::math);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", Empty);
  m.impl("empty_strided", EmptyStrided);
  m.impl("as_strided", AsStrided);
  m.impl("view", View);
  m.impl("_reshape_alias", ReshapeAlias);
  m.impl("unfold", Unfold);
  m.impl("resize_", Resize);
  m.impl("set_.source_Storage_storage_offset", SetStorage);
  m.impl("set_.source_Storage", SetSourceStorage);
  m.impl("set_.source_Tensor", SetSourceTensor);
  m.impl("set_", SetEmpty);
  m.impl("_copy_from", CopyFrom);
  m.impl("_copy_from_and_resize", CopyFromAndResize);
  m.impl("_local_scalar_dense", LocalScalarDense);
  m.impl("_fused_sdp_choice", FusedSdpChoice);
}

// _copy_from(self, dst) has no alias annotation on dst, so PyTorch's
// Conjugate/Negative fallbacks would materialize a conj/neg dst into a
// temporary clone and the copy would be lost (x.conj().copy_(y) leaving x
// unchanged). CopyFrom honours both bits itself, as copy_ does on CPU and
// CUDA (where copy_ is a fallthrough for these keys), so these pass through.
// The only _copy_from kernels in a torch_tpu process are tpu's.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace torch_tpu::aten
