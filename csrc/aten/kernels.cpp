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
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
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

// as_strided_ changes self's sizes, strides and offset in place; squeeze_,
// unsqueeze_, transpose_, t_ and swapdims_ reach it too (ATen's
// TensorShape.cpp). A fused region holds the tensors its recorded calls
// read, so it runs first: it saw the old layout (as resize_ and set_ do).
// Otherwise at::native::as_strided__symint, as every backend.
const at::Tensor& AsStridedInplace(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                                   std::optional<c10::SymInt> storage_offset) {
  runtime::FlushPendingWork();
  return at::native::as_strided__symint(self, size, stride, std::move(storage_offset));
}

at::Tensor ReshapeAlias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// unfold(self, dimension, size, step): windows of `size` elements every
// `step` along `dimension`, as a new last dimension; a view (PyTorch's own
// size/stride computation and errors, then as_strided over the storage).
at::Tensor Unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

// view_as_real / view_as_complex: PyTorch's own size/stride computation and
// checks (view_as_complex rejects what CPU rejects: a last dimension of size
// other than 2 or stride other than 1, odd strides, an odd storage offset,
// other dtypes than half/float/double), over the same storage. The storage
// keeps its element type; a program reading the view reinterprets its flat
// buffer (c64[N] <-> f32[2N], lowering::ReinterpretFlat), so writes through
// either alias are seen by the other, as on CPU.
at::Tensor ViewAsReal(const at::Tensor& self) { return at::native::view_as_real(self); }
at::Tensor ViewAsComplex(const at::Tensor& self) { return at::native::view_as_complex(self); }

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

}  // namespace

void ResizeStorageBytes(const c10::Storage& storage_ref, size_t nbytes, at::ScalarType dtype) {
  runtime::FlushPendingWork();  // recorded ops saw the old buffer and size
  c10::Storage storage = storage_ref;
  if (nbytes == storage.nbytes()) return;
  // As CPU (aten/src/ATen/native/Resize.cpp): at::from_blob storages (DLPack
  // imports, legacy pickle's host copies) are not resizable, and their
  // DataPtr context is not a DeviceStorage.
  TORCH_CHECK(storage.resizable(), "Trying to resize storage that is not resizable");
  auto* ds = static_cast<runtime::DeviceStorage*>(storage.data_ptr().get_context());
  hlo::ElementType e = lowering::ToElementType(dtype);
  std::vector<char> old;
  if (nbytes > 0 && storage.nbytes() > 0 && ds && ds->initialized()) {
    // Elements keep the storage's type where the new size holds whole ones.
    hlo::ElementType held = ds->Materialize(ds->current().element).element;
    if (nbytes % runtime::ElementSize(held) == 0) e = held;
    old = StorageBytes(storage, dtype);
  }
  size_t esize = runtime::ElementSize(e);
  TORCH_CHECK(nbytes % esize == 0, "resizing a tpu storage to ", nbytes, " bytes: not a whole number of ",
              hlo::MlirName(e), " elements (", esize, " bytes each)");
  // The new storage is counted before the old one is freed, as CUDA's
  // resize allocates, copies and then frees.
  c10::DeviceGuard guard(storage.device());  // the allocator allocates on the current device
  c10::DataPtr fresh = TpuAllocator()->allocate(nbytes);
  auto* fresh_ds = static_cast<runtime::DeviceStorage*>(fresh.get_context());
  if (!old.empty()) {
    std::vector<char> bytes(nbytes, 0);
    std::memcpy(bytes.data(), old.data(), std::min(old.size(), bytes.size()));
    fresh_ds->Set(Runtime::Get().UploadStorage(bytes.data(), nbytes, e, fresh.device().index(), "resize_"));
  }
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(nbytes);
}

namespace {

const at::Tensor& Resize(const at::Tensor& self, c10::IntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!memory_format || *memory_format != at::MemoryFormat::Preserve, "Unsupported memory format",
              *memory_format);
  auto* impl = self.unsafeGetTensorImpl();
  // As resize_impl_cpu_: the same sizes keep the strides (a non-contiguous
  // out= of the right shape stays a view: `ones(..., out=x.narrow(...))`).
  if (self.sizes() == size && !memory_format) return self;
  runtime::FlushPendingWork();  // recorded ops saw the old metadata
  int64_t numel = c10::multiply_integers(size);
  size_t nbytes = numel == 0 ? 0
                             : static_cast<size_t>(numel + self.storage_offset()) * self.dtype().itemsize();
  if (nbytes > self.storage().nbytes()) ResizeStorageBytes(self.storage(), nbytes, self.scalar_type());
  impl->set_sizes_contiguous(size);
  if (memory_format) impl->empty_tensor_restride(*memory_format);
  return self;
}

at::Tensor& SetStorage(at::Tensor& self, c10::Storage source, c10::SymInt storage_offset, c10::SymIntArrayRef size,
                       c10::SymIntArrayRef stride) {
  runtime::FlushPendingWork();  // recorded ops saw the old metadata
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(storage_offset.expect_int());
  if (stride.empty() && !size.empty()) impl->set_sizes_contiguous(C10_AS_INTARRAYREF_SLOW(size));  // stride=None
  else impl->set_sizes_and_strides(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
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
  if (s.initialized() && s.current().element != e) return false;
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

bool CopyOnCpuIfOverlapping(const at::Tensor& dst, const at::Tensor& src);  // fallback.cpp

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
// overlapping elements (expanded) or partly overlapping src is rejected.
at::Tensor CopyFrom(const at::Tensor& src, const at::Tensor& dst_logical, bool non_blocking) {
  if (dst_logical.numel() == 0) return dst_logical;
  const bool src_tpu = src.device().type() == kTpu, dst_tpu = dst_logical.device().type() == kTpu;
  if (dst_tpu) at::assert_no_internal_overlap(dst_logical);
  // As CPU's copy_ (its TensorIterator): dst partly overlapping src raises;
  // a tpu storage's data pointer is a unique address, so offsets compare.
  if (dst_tpu && src_tpu) at::assert_no_partial_overlap(dst_logical, src);
  // A dst whose elements overlap in a layout CPU accepts (TooHard above),
  // or views of one storage sharing elements in other layouts: CPU's
  // element order defines the result.
  if (dst_tpu && !dst_logical.is_conj() && !dst_logical.is_neg() &&
      (src.is_cpu() || (src_tpu && !src.is_conj() && !src.is_neg() && src.device() == dst_logical.device())) &&
      CopyOnCpuIfOverlapping(dst_logical, src))
    return dst_logical;
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
      auto& storage = StorageOf(dst);
      if (!storage.pending() && storage.current().buffer && storage.current().element == e &&
          storage.current().numel >= dst.numel()) {  // the storage's elements, then its capacity's padding
        runtime::StorageBuffer current = storage.current();
        storage.Set({});  // the storage's own reference only, for the holder count
        bool in_place = rt.OverwriteInPlace(current, host.data_ptr(), host.nbytes());
        current.producer = "copy from cpu";
        storage.Set(std::move(current));
        if (in_place) return dst_logical;
      }
      storage.Set(rt.UploadStorage(host.data_ptr(), host.nbytes(), e, dst.device().index(), "copy from cpu"));
      return dst_logical;
    }
    host = host.contiguous();
    hlo::ElementType e = lowering::ToElementType(host.scalar_type());
    at::Tensor staged = runtime::WrapBuffer(
        rt.UploadStorage(host.data_ptr(), host.nbytes(), e, dst.device().index(), "copy from cpu"), host.sizes(),
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
    hlo::ElementType e = lowering::ToElementType(whole.scalar_type());
    if (!src.is_conj() && !src.is_neg() && !dst.is_conj() && !dst.is_neg() && dst.is_contiguous() &&
        dst.scalar_type() == src.scalar_type() && dst.sizes() == src.sizes()) {
      // Straight into dst: no temporary, no second copy, no fresh pages.
      rt.Download(StorageOf(whole).Materialize(e), dst.data_ptr(), dst.nbytes());
      return dst;
    }
    at::Tensor host = at::empty(whole.sizes(), whole.options().device(at::kCPU));
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
  // A cast to or from complex32 (u32 bit patterns on the device, which no
  // lowering converts): CPU's conversion, then a copy of complex32 elements
  // or of another dtype's.
  if (src.scalar_type() != dst_logical.scalar_type() &&
      (src.scalar_type() == at::kComplexHalf || dst_logical.scalar_type() == at::kComplexHalf))
    return dst_logical.copy_(src.cpu().to(dst_logical.scalar_type()));
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
        from.current().numel >= src.numel()) {  // both storages have src's nbytes
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

// One element of `self` (numel 1) read from the host copy of its storage
// (runtime::HostContentsOf: `for v in t`, `all(t)`, `t[i].item()` in a
// loop cost one download, not one per element), or nullopt where that does
// not apply (conjugate/negative bits, a storage typed with another element
// width, one over kHostContentsMaxBytes, which is read element by element).
std::optional<at::Scalar> ElementFromHostCopy(const at::Tensor& self) {
  if (self.is_conj() || self.is_neg() || at::isComplexType(self.scalar_type())) return std::nullopt;
  auto& ds = StorageOf(self);
  if (!ds.initialized() || ds.nbytes() > runtime::kHostContentsMaxBytes) return std::nullopt;
  if (runtime::ElementSize(ds.Materialize(ds.current().element).element) != self.element_size()) return std::nullopt;
  const size_t offset = static_cast<size_t>(self.storage_offset()) * self.element_size();
  const runtime::HostContents contents = runtime::HostContentsOf(ds);
  if (offset + self.element_size() > contents.size) return std::nullopt;
  at::Tensor element = at::empty({}, self.options().device(at::kCPU));
  std::memcpy(element.data_ptr(), contents.data + offset, self.element_size());
  return element.item();
}

at::Scalar LocalScalarDense(const at::Tensor& self) {
  // item() of any one-element tensor ([], [1], [1, 1], ...). A sync point:
  // earlier failures surface here, naming their op.
  Runtime::Get().Sync();
  if (auto v = ElementFromHostCopy(self)) return *v;
  at::Tensor host = at::empty(self.sizes(), self.options().device(at::kCPU));
  CopyFrom(self, host, false);
  return host.item();
}

// _has_compatible_shallow_copy_type(self, from): may `self` take `from`'s
// TensorImpl fields in place (Variable::set_data, `param.data = t`)? This is
// the question Module._apply asks (compute_should_use_set_data) before it
// moves a Parameter: yes keeps the Parameter object (so tied weights stay
// tied and an optimizer made earlier keeps its references), no makes a new
// Parameter. TensorImpl::has_compatible_shallow_copy_type answers yes for
// two dense tensors only when both backends are in a fixed list (CPU, CUDA,
// MPS, HIP, XPU, HPU) — PrivateUse1 is not in it. This kernel gives the same
// answer with tpu (PrivateUse1) added to that list; it is reached only when
// one of the two tensors is on tpu (the dispatcher picks the highest
// backend), so CPU and other devices keep PyTorch's own answer.
//
// Variable::set_data asks this right before it replaces self's storage and
// layout with from's (shallow_copy_from), so a fused region recorded with
// either runs first (as for resize_/set_): its calls saw the old fields
// (`x.data = x.clone()` read the clone's pending output as the clone's own
// input, "this tensor has no value").
bool HasCompatibleShallowCopyType(const at::Tensor& self, const at::Tensor& from) {
  runtime::FlushPendingWork();
  if (self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set())) return true;
  auto dense = [](c10::DispatchKeySet ks) {
    constexpr auto backends = c10::DispatchKeySet(
        {c10::BackendComponent::CPUBit, c10::BackendComponent::CUDABit, c10::BackendComponent::MPSBit,
         c10::BackendComponent::HIPBit, c10::BackendComponent::XPUBit, c10::BackendComponent::HPUBit,
         c10::BackendComponent::PrivateUse1Bit});
    return ks.has_any(c10::DispatchKeySet(c10::DispatchKey::Dense)) && ks.has_any(backends);
  };
  return dense(self.key_set()) && dense(from.key_set());
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
  m.impl("as_strided_", AsStridedInplace);
  m.impl("view", View);
  m.impl("_reshape_alias", ReshapeAlias);
  m.impl("unfold", Unfold);
  m.impl("view_as_real", ViewAsReal);
  m.impl("view_as_complex", ViewAsComplex);
  m.impl("resize_", Resize);
  m.impl("set_.source_Storage_storage_offset", SetStorage);
  m.impl("set_.source_Storage", SetSourceStorage);
  m.impl("set_.source_Tensor", SetSourceTensor);
  m.impl("set_", SetEmpty);
  m.impl("_copy_from", CopyFrom);
  m.impl("_copy_from_and_resize", CopyFromAndResize);
  m.impl("_local_scalar_dense", LocalScalarDense);
  m.impl("_fused_sdp_choice", FusedSdpChoice);
  m.impl("_has_compatible_shallow_copy_type", HasCompatibleShallowCopyType);
}

// The op is CompositeImplicitAutograd; with a PrivateUse1 kernel the
// AutogradPrivateUse1 entry would no longer take the composite, so the same
// kernel serves it (the answer is a bool: nothing to differentiate).
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", HasCompatibleShallowCopyType);
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
