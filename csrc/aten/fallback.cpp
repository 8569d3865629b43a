// The boxed kernel behind every ATen op that has no direct tpu kernel
// (kernels.cpp): it finds the op's lowering and hands the call to the active
// executor; an op without a usable lowering runs on the CPU with one warning
// per op and a counter in torch_tpu.metrics() (TORCH_TPU_CPU_FALLBACK=0
// makes it an error naming the op).
//
// Before that, as PyTorch's CPU/CUDA kernels do:
//  - arguments with the conjugate or negative bit set (x.conj(),
//    torch._neg_view(x), z.conj().imag) are materialized, and written ones
//    get their result copied back through copy_, which re-applies the bits
//    (the Conjugate/Negative dispatch keys fall through for copy_, clone,
//    views and a few linear-algebra ops, so such tensors do reach tpu
//    kernels; a lowering reads a storage's elements as stored);
//  - a call that writes a tensor whose elements overlap (expanded: a zero
//    stride over a size > 1) runs on the CPU on a mirror of the same
//    layout, so that it raises PyTorch's "unsupported operation: more than
//    one element of the written-to tensor refers to a single memory
//    location" where CPU raises it (add_, mul_, out= ...) and computes what
//    CPU computes where CPU allows it (index_put_, masked_fill_, ...).
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/result_type.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "aten/tpu.h"
#include "lowering/lowering.h"
#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::aten {
namespace {

}  // namespace

at::Tensor PhysicalView(const at::Tensor& t);     // kernels.cpp
at::Tensor ResolveMathBits(const at::Tensor& t);  // kernels.cpp

namespace {

bool CpuFallbackAllowed() {
  static bool allowed = [] {
    const char* e = std::getenv("TORCH_TPU_CPU_FALLBACK");
    return !(e && std::string(e) == "0");
  }();
  return allowed;
}

std::string OpName(const c10::FunctionSchema& schema) {
  return schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
}

const lowering::LoweringEntry* EntryFor(const c10::OperatorHandle& op) {
  static std::mutex mutex;
  static std::unordered_map<const c10::FunctionSchema*, const lowering::LoweringEntry*> entries;
  const c10::FunctionSchema* key = &op.schema();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = entries.find(key);
  if (it != entries.end()) return it->second;
  const auto* entry = lowering::FindLowering(runtime::BaseName(op.schema()));
  if (entry && entry->traits.graph_only) entry = nullptr;  // eager views are metadata only
  entries.emplace(key, entry);
  return entry;
}

void RunOnCpu(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& reason) {
  std::string name = OpName(op.schema());
  TORCH_CHECK_NOT_IMPLEMENTED(CpuFallbackAllowed(), "The operator '", name,
                              "' is not implemented for the tpu device (", reason,
                              "), and TORCH_TPU_CPU_FALLBACK=0 forbids running it on the CPU.");
  auto& metrics = runtime::Runtime::Get().metrics();
  bool first;
  {
    std::lock_guard<std::mutex> lock(metrics.fallback_mutex);
    first = metrics.cpu_fallbacks[name]++ == 0;
  }
  if (first) TORCH_WARN("torch_tpu: ", name, " runs on the CPU (", reason, "); results are copied back to tpu.");
  at::native::cpu_fallback(op, stack);
}

// Index lists (Tensor?[]) may hold CPU tensors, as on CUDA: move them. So
// may the index tensor an entry checks (IndexCheck::index: index_fill,
// index_select, gather, ...), as CPU's kernels accept it (CUDA's refuse a CPU
// index for some of them): the call then computes CPU's values.
void MoveCpuIndicesToDevice(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                            const lowering::LoweringEntry& entry) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined() || !t.is_cpu()) continue;
      for (const auto& check : entry.traits.index_checks) {
        if (args[i].name() != check.index) continue;
        c10::Device device(kTpu, CurrentDevice());
        for (size_t j = first; j < stack->size(); ++j)
          if ((*stack)[j].isTensor() && (*stack)[j].toTensor().defined() &&
              (*stack)[j].toTensor().device().type() == kTpu) {
            device = (*stack)[j].toTensor().device();
            break;
          }
        v = t.to(device);
        break;
      }
      continue;
    }
    if (!v.isList() || v.isTensorList() || v.isIntList() || v.isDoubleList() || v.isBoolList()) continue;
    const auto& list = v.toListRef();
    bool has_cpu = false;
    c10::Device device(kTpu, CurrentDevice());
    for (const auto& x : list) {
      if (x.isTensor() && x.toTensor().defined()) {
        if (x.toTensor().device().type() == kTpu) device = x.toTensor().device();
        else has_cpu |= x.toTensor().dim() > 0 && x.toTensor().is_cpu();
      }
    }
    if (!has_cpu) continue;
    c10::List<std::optional<at::Tensor>> moved;
    for (const auto& x : list) {
      if (x.isTensor() && x.toTensor().defined()) moved.push_back(x.toTensor().to(device));
      else moved.push_back(std::nullopt);
    }
    v = moved;
  }
}

// Boolean (or uint8) masks among the indices of index / index_put_ (x[mask],
// x[mask] = v): each k-dim mask becomes k int64 index tensors, the columns
// of its nonzero coordinates, as ATen's expandTensors does before indexing
// (its shape check and message included). The count is read with one sync
// (the nonzero kernel, dynamic_shape_kernels.cpp); then the lowered index /
// index_put run: the data stays on the device. A 0-d bool index (x[True])
// is left to the general path.
void ExpandMaskIndices(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::string base = runtime::BaseName(op.schema());
  if (base != "index" && base != "index_put" && base != "_index_put_impl") return;
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::optional<size_t> self_pos, indices_pos;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == "self") self_pos = first + i;
    if (args[i].name() == "indices") indices_pos = first + i;
  }
  if (!self_pos || !indices_pos || !(*stack)[*indices_pos].isList()) return;
  const auto& list = (*stack)[*indices_pos].toListRef();
  bool has_mask = false;
  for (const auto& x : list) {
    if (x.isTensor() && x.toTensor().defined() && x.toTensor().dim() > 0) {
      auto t = x.toTensor().scalar_type();
      has_mask |= t == at::kBool || t == at::kByte;
    }
  }
  if (!has_mask) return;
  const at::Tensor& self = (*stack)[*self_pos].toTensor();
  c10::List<std::optional<at::Tensor>> expanded;
  int64_t dim = 0;
  for (const auto& x : list) {
    const bool defined = x.isTensor() && x.toTensor().defined();
    const at::Tensor mask = defined ? x.toTensor() : at::Tensor();
    if (!defined || mask.dim() == 0 || (mask.scalar_type() != at::kBool && mask.scalar_type() != at::kByte)) {
      expanded.push_back(defined ? std::optional<at::Tensor>(mask) : std::nullopt);
      ++dim;
      continue;
    }
    if (mask.scalar_type() == at::kByte) {
      // ATen's expandTensors (aten/src/ATen/native/IndexingUtils.h) warns on
      // every uint8 mask it expands; this replaces that step for tpu.
      TORCH_WARN("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.");
    }
    for (int64_t j = 0; j < mask.dim(); ++j) {
      const int64_t d = dim + j;
      TORCH_CHECK_INDEX(d < self.dim() && mask.size(j) == self.size(d), "The shape of the mask ", mask.sizes(),
                        " at index ", j, " does not match the shape of the indexed tensor ", self.sizes(),
                        " at index ", d);
    }
    at::Tensor coords = at::nonzero(mask);  // [n, k] int64
    for (int64_t j = 0; j < mask.dim(); ++j) expanded.push_back(coords.select(1, j));
    dim += mask.dim();
  }
  (*stack)[*indices_pos] = expanded;
}

bool IsWrittenArg(const c10::Argument& a) { return a.alias_info() != nullptr && a.alias_info()->isWrite(); }

// `x[mask] = v` with one bool mask over x's leading dims and a one-element
// value of x's dtype (index_put_ / _index_put_impl_ / index_put, accumulate
// false) is masked_fill(mask, v), with the mask viewed with trailing size-1
// dims: the same elements get the same value as CPU's index_put_, without
// the count of true elements (one sync) and a program per count (ExpandMask
// Indices). Anything else (several indices, a mask of another shape: the
// general path raises CPU's error; values of another dtype or more
// elements; accumulate; out=) is left to the general path. Returns true
// when the call was served (its result on the stack).
bool ServeMaskAssignAsMaskedFill(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::optional<size_t> self_pos, indices_pos, values_pos;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& n = args[i].name();
    if (args[i].is_out()) return false;
    if (n == "self") self_pos = first + i;
    else if (n == "indices") indices_pos = first + i;
    else if (n == "values") values_pos = first + i;
    else if (n == "accumulate" && (*stack)[first + i].isBool() && (*stack)[first + i].toBool()) return false;
  }
  if (!self_pos || !indices_pos || !values_pos || !(*stack)[*indices_pos].isList() ||
      !(*stack)[*self_pos].isTensor() || !(*stack)[*values_pos].isTensor())
    return false;
  const auto& list = (*stack)[*indices_pos].toListRef();
  if (list.size() != 1 || !list[0].isTensor()) return false;
  const at::Tensor mask = list[0].toTensor();
  const at::Tensor self = (*stack)[*self_pos].toTensor();
  const at::Tensor values = (*stack)[*values_pos].toTensor();
  if (!mask.defined() || mask.scalar_type() != at::kBool || mask.dim() == 0 || mask.dim() > self.dim() ||
      !self.defined() || self.device().type() != kTpu || !values.defined() || values.numel() != 1 ||
      values.dim() > 1 || values.scalar_type() != self.scalar_type() ||
      (values.device().type() != kTpu && !(values.is_cpu() && values.dim() == 0)))
    return false;
  for (int64_t j = 0; j < mask.dim(); ++j)
    if (mask.size(j) != self.size(j)) return false;
  std::vector<int64_t> shape = mask.sizes().vec();
  shape.resize(static_cast<size_t>(self.dim()), 1);
  const at::Tensor m = mask.to(self.device()).view(shape);
  const at::Tensor v = values.reshape({});
  const bool in_place = IsWrittenArg(args[*self_pos - first]);
  at::Tensor result = in_place ? self.masked_fill_(m, v) : self.masked_fill(m, v);
  torch::jit::drop(*stack, args.size());
  stack->push_back(in_place ? self : result);
  return true;
}

bool HasMathBits(const at::Tensor& t) { return t.defined() && (t.is_conj() || t.is_neg()); }

// Calls `fn` on every tensor of argument value `v` (a tensor, or an item of
// a tensor list / optional tensor list).
template <typename Fn>
void ForEachTensor(const c10::IValue& v, Fn&& fn) {
  if (v.isTensor()) {
    fn(v.toTensor());
  } else if (v.isTensorList() || (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList())) {
    for (const auto& item : v.toListRef())
      if (item.isTensor()) fn(item.toTensor());
  }
}

// Replaces every tensor of argument value `v` by fn(tensor).
template <typename Fn>
c10::IValue MapTensors(const c10::IValue& v, Fn&& fn) {
  if (v.isTensor()) return fn(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(fn(t));
    return out;
  }
  if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
    bool has_tensor = false;
    for (const auto& item : v.toListRef()) has_tensor |= item.isTensor();
    if (!has_tensor) return v;
    c10::List<std::optional<at::Tensor>> out;
    for (const auto& item : v.toListRef()) {
      if (item.isTensor()) out.push_back(fn(item.toTensor()));
      else out.push_back(std::nullopt);
    }
    return out;
  }
  return v;
}

bool AnyMathBits(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t n = op.schema().arguments().size(), first = stack.size() - n;
  bool any = false;
  for (size_t i = first; i < stack.size(); ++i) ForEachTensor(stack[i], [&](const at::Tensor& t) { any |= HasMathBits(t); });
  return any;
}

void TpuBoxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// The call with its conjugate/negative-bit arguments materialized: read
// arguments are replaced by their values; a written argument by a
// materialized copy, whose final value is copied back into it (copy_
// stores it with the argument's bits undone), as PyTorch's math-bit
// fallback (ATen/native/MathBitsFallback.h) does for CPU and CUDA.
void RunResolvingMathBits(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (argument, its materialized copy)
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = (*stack)[first + i];
    const bool write = IsWrittenArg(args[i]);
    if (write && !v.isTensor()) {
      ForEachTensor(v, [&](const at::Tensor& t) {
        TORCH_CHECK(!HasMathBits(t), "torch_tpu: ", op.schema().name(),
                    " writes a list of tensors that holds a conjugate or negative view; resolve it first "
                    "(resolve_conj()/resolve_neg())");
      });
      continue;
    }
    bool bits = false;
    ForEachTensor(v, [&](const at::Tensor& t) { bits |= HasMathBits(t); });
    if (!bits) continue;
    v = MapTensors(v, [&](const at::Tensor& t) {
      if (!HasMathBits(t)) return t;
      at::Tensor r = ResolveMathBits(t);
      if (write) written.emplace_back(t, r);
      return r;
    });
  }
  TpuBoxedKernel(op, stack);
  for (auto& [arg, copy] : written) {
    at::native::resize_output(arg, copy.sizes());  // out= arguments may have been resized
    arg.copy_(copy);
    for (size_t i = first; i < stack->size(); ++i)
      if ((*stack)[i].isTensor() && (*stack)[i].toTensor().is_same(copy)) (*stack)[i] = arg;
  }
}

// True if the call writes a tensor with internally overlapping elements
// (at::has_internal_overlap: a zero stride over a size > 1), other than
// fill_/zero_, whose lowerings write the same value to every element (CPU
// allows them too).
bool WritesOverlappingTensor(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  bool overlap = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!IsWrittenArg(args[i])) continue;
    ForEachTensor(stack[first + i], [&](const at::Tensor& t) {
      overlap |= t.defined() && t.device().type() == kTpu && at::has_internal_overlap(t) == at::MemOverlap::Yes;
    });
  }
  if (!overlap) return false;
  const std::string base = runtime::BaseName(op.schema());
  return base != "fill" && base != "zero";
}

// Whether two strided views of one storage (same element size) share an
// element, exactly: disjoint byte ranges, or offsets that differ modulo the
// gcd of all strides (a[::2] and a[1::2], the columns of a matrix), share
// none; otherwise both views' element offsets are listed, sorted and merged
// when they hold at most kMaxListed elements together; larger views are
// assumed to share one (the caller then runs the call on the CPU mirror,
// which is exact either way, only slower).
bool ViewsShareAnElement(const at::Tensor& a, const at::Tensor& b) {
  constexpr int64_t kMaxListed = int64_t{1} << 18;
  auto span = [](const at::Tensor& t) {
    int64_t lo = t.storage_offset(), hi = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t extent = t.stride(d) * (t.size(d) - 1);
      (extent < 0 ? lo : hi) += extent;
    }
    return std::pair<int64_t, int64_t>{lo, hi};
  };
  const auto [alo, ahi] = span(a);
  const auto [blo, bhi] = span(b);
  if (ahi < blo || bhi < alo) return false;
  int64_t g = 0;
  for (const at::Tensor* t : {&a, &b})
    for (int64_t d = 0; d < t->dim(); ++d)
      if (t->size(d) > 1) g = std::gcd(g, std::abs(t->stride(d)));
  if (g > 1 && (a.storage_offset() - b.storage_offset()) % g != 0) return false;
  if (a.numel() + b.numel() > kMaxListed) return true;
  auto offsets = [](const at::Tensor& t) {
    std::vector<int64_t> out{t.storage_offset()};
    for (int64_t d = 0; d < t.dim(); ++d) {
      const size_t n = out.size();
      for (int64_t i = 1; i < t.size(d); ++i)
        for (size_t j = 0; j < n; ++j) out.push_back(out[j] + i * t.stride(d));
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  const std::vector<int64_t> ao = offsets(a), bo = offsets(b);
  for (size_t i = 0, j = 0; i < ao.size() && j < bo.size();) {
    if (ao[i] == bo[j]) return true;
    (ao[i] < bo[j]) ? ++i : ++j;
  }
  return false;
}

// True if `w` and `t` (non-empty views of one storage, not the same tensor)
// share elements in different layouts: at::get_overlap_status Partial, or
// TooHard (a non-dense view) with an element in common (ViewsShareAnElement)
// and not the same offset, sizes and strides.
bool PartlyOverlapping(const at::Tensor& w, const at::Tensor& t) {
  const at::MemOverlapStatus status = at::get_overlap_status(w, t);
  if (status == at::MemOverlapStatus::Partial) return true;
  if (status != at::MemOverlapStatus::TooHard) return false;
  if (w.itemsize() != t.itemsize()) return true;  // one storage viewed as two dtypes: CPU decides
  if (w.storage_offset() == t.storage_offset() && w.sizes() == t.sizes() && w.strides() == t.strides())
    return false;
  return ViewsShareAnElement(w, t);
}

// True if a written tpu tensor partly overlaps another tpu tensor argument of
// the call, as `a[1:].add_(a[:-1])` (at::get_overlap_status Partial) or
// `a.view(2, 5)[:, 1:].mul_(a.view(2, 5)[:, :-1])` (TooHard: a non-dense view
// whose elements meet the other's, found exactly by ViewsShareAnElement, with
// a different layout): CPU's kernels raise ("unsupported operation: some
// elements of the input tensor and the written-to tensor refer to a single
// memory location") or define the result by their own element order (the
// TooHard case: CPU's loop reads elements it wrote earlier); the meta kernels
// cannot tell (meta storages have no addresses, so every view of one looks
// like a full overlap), so such a call runs on the CPU mirror, which keeps
// the sharing and gives CPU's result or error. A tpu storage's data pointer
// is a unique address (its DeviceStorage), so offsets compare as on CPU.
// Full overlaps (`a.add_(a)`, or two views of one layout) and views sharing
// no element run natively.
bool WritesPartlyOverlappingArgument(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  // Per call on the dispatch path: functional calls (no written argument)
  // only scan the schema; nothing is copied.
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  auto candidate = [](const at::Tensor& t) {
    return t.defined() && t.device().type() == kTpu && t.has_storage() && t.numel() > 0;
  };
  bool partial = false;
  for (size_t i = 0; i < args.size() && !partial; ++i) {
    if (!IsWrittenArg(args[i])) continue;
    ForEachTensor(stack[first + i], [&](const at::Tensor& w) {
      if (partial || !candidate(w)) return;
      for (size_t j = 0; j < args.size() && !partial; ++j)
        ForEachTensor(stack[first + j], [&](const at::Tensor& t) {
          if (partial || t.is_same(w) || !candidate(t) || !t.storage().is_alias_of(w.storage())) return;
          partial = PartlyOverlapping(w, t);
        });
    });
  }
  return partial;
}

// Runs the call on the CPU with every tpu tensor argument mirrored by a CPU
// tensor of the same sizes, strides and offset over a host copy of its
// storage (arguments sharing a storage share the copy), so that CPU's
// overlap checks and semantics apply; written storages are uploaded back.
// Host copies of the tpu storages a call's tensors view: each tpu tensor
// becomes a CPU tensor of the same sizes, strides and offset over a host
// copy of its storage's bytes (tensors sharing a storage share the copy;
// a never-written storage reads as zeros, as on the device).
class HostMirrors {
 public:
  struct Mirror {
    at::Tensor bytes;  // the storage's bytes on the host
    at::Tensor any;    // a tpu tensor over the storage
    bool written = false;
  };
  at::Tensor Of(const at::Tensor& t, bool write) {
    if (!t.defined() || t.device().type() != kTpu) return t;
    auto& ds = runtime::StorageOf(t);
    auto [it, inserted] = mirrors_.try_emplace(&ds);
    Mirror& m = it->second;
    if (inserted) {
      m.bytes = at::zeros({static_cast<int64_t>(ds.nbytes())}, at::TensorOptions().dtype(at::kByte));
      m.any = t;
      if (ds.initialized()) {
        const auto& cur = ds.Materialize(ds.current().element);
        size_t n = static_cast<size_t>(cur.numel) * runtime::ElementSize(cur.element);
        runtime::Runtime::Get().Download(cur, m.bytes.data_ptr(), std::min(n, ds.nbytes()));
      }
    }
    m.written |= write;
    at::Tensor host = at::empty({0}, t.options().device(at::kCPU));
    host.set_(m.bytes.storage(), t.storage_offset(), t.sizes(), t.strides());
    return host;
  }
  // Replaces the tpu tensors of the call's arguments (stack[first...]).
  void MirrorArguments(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first) {
    const auto& args = op.schema().arguments();
    for (size_t i = 0; i < args.size(); ++i) {
      c10::IValue& v = (*stack)[first + i];
      const bool write = IsWrittenArg(args[i]);
      v = MapTensors(v, [&](const at::Tensor& t) { return Of(t, write); });
    }
  }
  std::unordered_map<runtime::DeviceStorage*, Mirror>& map() { return mirrors_; }
  const at::Tensor& BytesOf(runtime::DeviceStorage* ds) const { return mirrors_.at(ds).bytes; }

 private:
  std::unordered_map<runtime::DeviceStorage*, Mirror> mirrors_;
};

void RunOnCpuMirror(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  const std::string name = OpName(op.schema());
  runtime::FlushPendingWork();  // the storages are read and replaced below
  auto& rt = runtime::Runtime::Get();
  HostMirrors host_mirrors;
  auto& mirrors = host_mirrors.map();
  std::vector<c10::IValue> originals(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  host_mirrors.MirrorArguments(op, stack, first);
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);  // raises as CPU raises
  TORCH_CHECK_NOT_IMPLEMENTED(CpuFallbackAllowed(), "The operator '", name,
                              "' writes a tensor with overlapping elements, which runs on the CPU, and "
                              "TORCH_TPU_CPU_FALLBACK=0 forbids running it on the CPU.");
  {
    auto& metrics = rt.metrics();
    std::lock_guard<std::mutex> lock(metrics.fallback_mutex);
    metrics.cpu_fallbacks[name]++;
  }
  for (auto& [ds, m] : mirrors) {
    if (!m.written) continue;
    hlo::ElementType e = ds->initialized() ? ds->current().element : lowering::ToElementType(m.any.scalar_type());
    const size_t nbytes = ds->nbytes() / runtime::ElementSize(e) * runtime::ElementSize(e);
    ds->Set(rt.UploadStorage(m.bytes.data_ptr(), nbytes, e, m.any.device().index(), name + " (on the CPU)"));
  }
  // Returns: written arguments as the original tpu tensors, new tensors moved
  // to the device.
  const auto& returns = op.schema().returns();
  const size_t rfirst = stack->size() - returns.size();
  for (size_t r = 0; r < returns.size(); ++r) {
    c10::IValue& v = (*stack)[rfirst + r];
    bool aliased = false;
    if (returns[r].alias_info()) {
      for (size_t i = 0; i < args.size(); ++i) {
        const auto* ai = args[i].alias_info();
        if (ai && ai->isWrite() && ai->beforeSets() == returns[r].alias_info()->beforeSets()) {
          v = originals[i];
          aliased = true;
          break;
        }
      }
    }
    if (!aliased) {
      c10::Device device = mirrors.empty() ? c10::Device(kTpu, CurrentDevice()) : mirrors.begin()->second.any.device();
      v = MapTensors(v, [&](const at::Tensor& t) { return t.defined() ? t.to(device) : t; });
    }
  }
}

// True if a written tpu argument shares its storage with another tpu tensor
// argument (out= aliasing an input, views of one base): such a call that
// cannot run natively runs on a CPU mirror that keeps the sharing, so CPU's
// overlap checks ("some elements of the input tensor and the written-to
// tensor refer to a single memory location") and aliasing semantics apply;
// cpu_fallback copies each argument on its own.
bool WritesSharedStorage(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  std::vector<std::pair<const void*, bool>> seen;  // storage, written
  for (size_t i = 0; i < args.size(); ++i) {
    const bool write = IsWrittenArg(args[i]);
    ForEachTensor(stack[first + i], [&](const at::Tensor& t) {
      if (t.defined() && t.device().type() == kTpu && t.has_storage())
        seen.emplace_back(t.storage().unsafeGetStorageImpl(), write);
    });
  }
  for (size_t a = 0; a < seen.size(); ++a)
    for (size_t b = a + 1; b < seen.size(); ++b)
      if (seen[a].first == seen[b].first && (seen[a].second || seen[b].second)) return true;
  return false;
}

// Argument checks CPU's kernels make that the meta kernels (PyTorch's
// Python refs, more permissive) do not, raised with CPU's messages before
// anything runs:
// - out= of another dtype than `self` for ops whose CPU TensorIterator is
//   built with check_all_same_dtype (trait out_same_dtype; TensorIterator's
//   "Found dtype <out> but expected <self>");
// - `alpha` of the wrong kind for the result dtype (add/sub/rsub:
//   ATen's alpha_check over result_type(self, other));
// - an index tensor of a dtype CPU's index_* kernels refuse
//   (CheckIndexDtypeLikeCpu);
// - a float `p` outside [0, 1] for bernoulli (CPU's bernoulli_ check; a
//   tensor p is checked on its values by the lowering, lowering/random.cpp).
void CheckIndexDtypeLikeCpu(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t index_pos);

void CheckArgumentsLikeCpu(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                           const lowering::LoweringEntry& entry) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  std::optional<size_t> self, other, alpha;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == "self") self = i;
    else if (args[i].name() == "other") other = i;
    else if (args[i].name() == "alpha") alpha = i;
    else if (args[i].name() == "index" && !entry.traits.index_checks.empty() && stack[first + i].isTensor())
      CheckIndexDtypeLikeCpu(op, stack, first + i);
    else if (args[i].name() == "p" && stack[first + i].isDouble()) {
      const double p = stack[first + i].toDouble();
      if (!(p >= 0 && p <= 1) && runtime::BaseName(op.schema()) == "bernoulli")
        TORCH_CHECK(false, "bernoulli_ expects p to be in [0, 1], but got p=", p);
    }
  }
  if (entry.traits.out_same_dtype && self && stack[first + *self].isTensor()) {
    const at::Tensor& s = stack[first + *self].toTensor();
    for (size_t i = 0; i < args.size(); ++i) {
      if (!args[i].is_out() || !stack[first + i].isTensor()) continue;
      const at::Tensor& out = stack[first + i].toTensor();
      if (s.defined() && out.defined())
        TORCH_CHECK(out.scalar_type() == s.scalar_type(), "Found dtype ", out.scalar_type(), " but expected ",
                    s.scalar_type());
    }
  }
  if (alpha && self && other && stack[first + *alpha].isScalar() && stack[first + *self].isTensor()) {
    const c10::Scalar a = stack[first + *alpha].toScalar();
    // An integral, non-bool alpha (the default 1) passes every check below:
    // no result_type per call.
    if (a.isIntegral(false)) return;
    const c10::IValue& o = stack[first + *other];
    const at::Tensor& s = stack[first + *self].toTensor();
    if (!s.defined()) return;
    at::ScalarType dtype;
    if (o.isTensor() && o.toTensor().defined()) dtype = at::result_type(s, o.toTensor());
    else if (o.isScalar()) dtype = at::result_type(s, o.toScalar());
    else return;
    TORCH_CHECK(!a.isBoolean() || dtype == at::ScalarType::Bool, "Boolean alpha only supported for Boolean results.");
    TORCH_CHECK(at::isFloatingType(dtype) || at::isComplexType(dtype) || a.isIntegral(true),
                "For integral input tensors, argument alpha must not be a floating point number.");
    TORCH_CHECK(at::isComplexType(dtype) || !a.isComplex(),
                "For non-complex input tensors, argument alpha must not be a complex number.");
  }
}

// The dtypes CPU's index_* kernels accept for their `index` tensor, and
// their errors (aten/src/ATen/native/TensorAdvancedIndexing.cpp, Indexing.cpp),
// raised before the call: the meta kernels accept any dtype, and the
// lowerings would read a float index as positions. gather/scatter run on the
// CPU for a non-integer index (their lowerings refuse it), which raises there.
void CheckIndexDtypeLikeCpu(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t index_pos) {
  const at::Tensor& index = stack[index_pos].toTensor();
  if (!index.defined()) return;
  const at::ScalarType t = index.scalar_type();
  if (t == at::kLong) return;
  const std::string base = runtime::BaseName(op.schema());
  if (base == "index_fill") TORCH_CHECK_INDEX(false, "index_fill_(): Expected dtype int64 for index.");
  if (base == "index_copy")
    TORCH_CHECK(false, "index_copy_(): Expected a long tensor for index, but got ", t);
  if (t == at::kInt) return;
  if (base == "index_add" || base == "index_reduce")
    TORCH_CHECK(false, base, "_(): Expected dtype int32/int64 for index but got: ", t);
  if (base == "index_select") TORCH_CHECK(false, "index_select(): Expected dtype int32 or int64 for index");
}

void TpuBoxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const lowering::LoweringEntry* entry = EntryFor(op);
  if (entry) CheckArgumentsLikeCpu(op, *stack, *entry);
  if (AnyMathBits(op, *stack)) return RunResolvingMathBits(op, stack);
  if (WritesOverlappingTensor(op, *stack) || WritesPartlyOverlappingArgument(op, *stack))
    return RunOnCpuMirror(op, stack);
  if (entry) {
    static const lowering::LoweringEntry* const index_put = lowering::FindLowering("index_put");
    static const lowering::LoweringEntry* const index_put_impl = lowering::FindLowering("_index_put_impl");
    if ((entry == index_put || entry == index_put_impl) && ServeMaskAssignAsMaskedFill(op, stack)) return;
    MoveCpuIndicesToDevice(op, stack, *entry);
    ExpandMaskIndices(op, stack);
  }
  if (!entry) return RunOnCpu(op, stack, "no lowering");
  try {
    runtime::RunOp(op, stack, *entry);
  } catch (const runtime::UnsupportedOp& e) {
    if (WritesSharedStorage(op, *stack)) return RunOnCpuMirror(op, stack);
    RunOnCpu(op, stack, e.what());
  }
}

void ServeOnHost(const runtime::CompiledOp& compiled, const c10::OperatorHandle& op, torch::jit::Stack& stack,
                 size_t num_args) {
  auto& rt = runtime::Runtime::Get();
  const size_t first = stack.size() - num_args;
  std::vector<c10::IValue> originals(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  // The device of the results, as Launch picks it: the first tpu tensor's,
  // else the device argument's (factories), else the current device.
  int device_index = -1;
  for (const auto& v : originals) {
    ForEachTensor(v, [&](const at::Tensor& t) {
      if (device_index < 0 && t.defined() && t.device().type() == kTpu) device_index = t.device().index();
    });
  }
  HostMirrors mirrors;
  mirrors.MirrorArguments(op, &stack, first);
  for (size_t i = first; i < stack.size(); ++i) {
    if (!stack[i].isDevice()) continue;
    if (device_index < 0 && stack[i].toDevice().type() == kTpu)
      device_index = stack[i].toDevice().has_index() ? stack[i].toDevice().index() : CurrentDevice();
    stack[i] = c10::Device(c10::kCPU);
  }
  if (device_index < 0) device_index = CurrentDevice();
  {
    runtime::ProfileScope profile("tpu::host_first", compiled.name);  // torch.profiler event
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);  // raises as CPU raises
  }
  // The results as `compiled` gives them (Launch): checked first, so that a
  // mismatch raises before any storage changes.
  const size_t num_returns = op.schema().returns().size();
  const size_t rfirst = stack.size() - num_returns;
  TORCH_CHECK(compiled.returns.size() == num_returns, "torch_tpu: ", compiled.name,
              ": host-first call returned ", num_returns, " values, its program ", compiled.returns.size());
  std::vector<c10::IValue> returns(num_returns);
  std::vector<std::pair<size_t, std::vector<int64_t>>> new_outputs;  // (return, sizes)
  for (size_t r = 0; r < num_returns; ++r) {
    const runtime::ReturnSlot& rs = compiled.returns[r];
    if (rs.is_arg) {
      returns[r] = originals[static_cast<size_t>(rs.index)];
      continue;
    }
    if (rs.index < 0) {
      returns[r] = at::Tensor();
      continue;
    }
    const runtime::OutputSlot& o = compiled.outputs[static_cast<size_t>(rs.index)];
    std::vector<int64_t> sizes = o.sizes;
    if (o.dynamic) {
      const c10::IValue& leader = originals[static_cast<size_t>(compiled.poly_leader)];
      const at::Tensor& t = compiled.poly_leader_item < 0
                                ? leader.toTensor()
                                : leader.toListRef()[static_cast<size_t>(compiled.poly_leader_item)].toTensor();
      sizes[static_cast<size_t>(o.dynamic_dim)] = o.dynamic_scale * t.size(compiled.poly_dim) + o.dynamic_offset;
    }
    const at::Tensor& host = stack[rfirst + r].toTensor();
    TORCH_CHECK(host.defined() && host.sizes() == c10::IntArrayRef(sizes) && host.scalar_type() == o.dtype,
                "torch_tpu: ", compiled.name, ": the CPU kernel of a host-first call returned ",
                host.defined() ? c10::str(host.scalar_type(), host.sizes()) : std::string("an undefined tensor"),
                " where its program returns ", c10::str(o.dtype, c10::IntArrayRef(sizes)),
                "; TORCH_TPU_HOST_FIRST=0 avoids host-first calls");
    new_outputs.emplace_back(r, std::move(sizes));
  }
  const std::string producer = compiled.name + " (host-first, on the CPU)";
  for (auto& [r, sizes] : new_outputs) {
    const runtime::OutputSlot& o = compiled.outputs[static_cast<size_t>(compiled.returns[r].index)];
    // In the program's memory order: row-major, or the meta kernel's dense
    // permuted strides (OutputSlot::strides; never with a dynamic extent).
    const at::Tensor& result = stack[rfirst + r].toTensor();
    at::Tensor host = o.strides.empty() ? result.contiguous()
                                        : at::empty_strided(sizes, o.strides, result.options()).copy_(result);
    auto sb = rt.UploadStorage(host.data_ptr(), static_cast<size_t>(host.numel()) * host.element_size(), o.element,
                               device_index, producer, o.numel);
    returns[r] = runtime::WrapBuffer(std::move(sb), sizes, o.dtype, device_index, o.strides);
  }
  for (const auto& o : compiled.outputs) {
    if (o.kind != runtime::OutputSlot::Kind::kStorageWrite) continue;
    const c10::IValue& v = originals[static_cast<size_t>(o.arg)];
    const at::Tensor& t = o.item < 0 ? v.toTensor() : v.toListRef()[static_cast<size_t>(o.item)].toTensor();
    runtime::DeviceStorage* ds = &runtime::StorageOf(t);
    const at::Tensor& bytes = mirrors.BytesOf(ds);
    const size_t esize = runtime::ElementSize(o.element);
    ds->Set(rt.UploadStorage(bytes.data_ptr(), ds->nbytes() / esize * esize, o.element, device_index, producer,
                             o.numel));
  }
  rt.metrics().host_served++;
  stack.erase(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  for (auto& v : returns) stack.push_back(std::move(v));
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&TpuBoxedKernel>()); }

void RegisterLoweredOpsDirectly() {
  // Ops with a lowering get the boxed kernel registered for the tpu key
  // itself, ahead of the CompositeExplicitAutograd(NonFunctional) kernels
  // that would otherwise run first: for structured ops those compute the
  // meta result and allocate the output on every call, then call the out=
  // variant. Ops with a CompositeImplicitAutograd kernel keep it (their
  // autograd comes from the decomposition), and copy_ keeps PyTorch's kernel
  // (it routes host<->device copies to _copy_from).
  static torch::Library* library = nullptr;
  if (library) return;
  library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    std::string base = runtime::BaseName(handle->schema());
    const lowering::LoweringEntry* entry = lowering::FindLowering(base);
    if (base == "copy" || !entry || entry->traits.graph_only) continue;
    bool returns_view = false;
    for (const auto& r : handle->schema().returns())
      returns_view |= r.alias_info() != nullptr && !r.alias_info()->isWrite();
    if (returns_view) continue;
    if (handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      continue;
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&TpuBoxedKernel>());
  }
}

// kernels.cpp's tpu-to-tpu copy_: whether dst and src (tpu tensors without
// math bits) are views of one storage sharing elements in different layouts,
// a TooHard overlap CPU's copy_ does not reject (at::assert_no_partial_overlap
// covers the Partial ones) but defines by its element order; if so the copy
// runs on the CPU mirror (RunOnCpuMirror), giving CPU's result, and true is
// returned.
bool CopyOnCpuIfOverlapping(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.numel() == 0 || src.numel() == 0 || !dst.has_storage() || !src.has_storage() || dst.is_same(src) ||
      !dst.storage().is_alias_of(src.storage()) || !PartlyOverlapping(dst, src))
    return false;
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  torch::jit::Stack stack{dst, src, false};
  RunOnCpuMirror(op, &stack);
  return true;
}

}  // namespace torch_tpu::aten

namespace torch_tpu::runtime {

void ServeOnHost(const CompiledOp& compiled, const c10::OperatorHandle& op, torch::jit::Stack& stack,
                 size_t num_args) {
  aten::ServeOnHost(compiled, op, stack, num_args);
}

}  // namespace torch_tpu::runtime
