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
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/result_type.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "aten/tpu.h"
#include "lowering/lowering.h"
#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::aten {

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

bool IsWrittenArg(const c10::Argument& a) { return a.alias_info() != nullptr && a.alias_info()->isWrite(); }

// What the boxed kernel needs to know about one overload, found once per
// schema (FactsFor) so that a call compares no argument names: the entry
// of its lowering (nullptr: none usable eagerly; views are metadata only)
// and the positions, from the call's first argument, of the arguments the
// CPU-like checks read (-1: absent).
enum class IndexOp : uint8_t { kNone, kIndexSelect, kIndexAdd, kIndexReduce, kIndexFill, kIndexCopy, kOther };
struct OpFacts {
  const lowering::LoweringEntry* entry = nullptr;
  int16_t self = -1, other = -1, alpha = -1, index = -1, p = -1, mask = -1, value = -1;
  int16_t indices = -1, values = -1, accumulate = -1, fill_value = -1, dtype = -1;
  bool written = false;       // some argument is written (in place, out=)
  bool out = false;           // an out= overload
  bool self_written = false;  // self is written (in place)
  bool fill_or_zero = false;  // fill_ / zero_: one value for every element
  bool bernoulli = false;
  bool masked_fill = false;
  bool index_fill = false;
  // CPU's kernel converts Scalar `value` to self's dtype with Scalar::to
  // (checked: "value cannot be converted to type int8_t without overflow"):
  // fill_, masked_fill, index_fill, scatter's value overloads.
  bool checked_scalar_value = false;
  // full / full_like / new_full: `fill_value` is converted the same way to
  // the result's dtype (fill_).
  bool checked_fill_value = false;
  bool scalar_tensor = false; // scalar_tensor: reduced-float values convert as CPU's (no range check)
  bool index_put = false;     // index_put / _index_put_impl: x[...] = v
  bool mask_indexing = false; // index, index_put, _index_put_impl: masks among the indices
  IndexOp index_op = IndexOp::kNone;  // `index` is checked like CPU's index_* kernels
};

std::unique_ptr<OpFacts> MakeFacts(const c10::OperatorHandle& op) {
  auto f = std::make_unique<OpFacts>();
  const c10::FunctionSchema& schema = op.schema();
  const std::string base = runtime::BaseName(schema);
  f->entry = lowering::FindLowering(base);
  if (f->entry && f->entry->traits.graph_only) f->entry = nullptr;
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& n = args[i].name();
    const auto pos = static_cast<int16_t>(i);
    for (auto [name, slot] : {std::pair{"self", &f->self}, {"other", &f->other}, {"alpha", &f->alpha},
                              {"index", &f->index}, {"p", &f->p}, {"mask", &f->mask}, {"value", &f->value},
                              {"indices", &f->indices}, {"values", &f->values}, {"accumulate", &f->accumulate},
                              {"fill_value", &f->fill_value}, {"s", &f->fill_value}, {"dtype", &f->dtype}})
      if (n == name && *slot < 0) *slot = pos;
    f->written |= IsWrittenArg(args[i]);
    f->out |= args[i].is_out();
  }
  f->self_written = f->self >= 0 && IsWrittenArg(args[static_cast<size_t>(f->self)]);
  f->fill_or_zero = base == "fill" || base == "zero";
  f->bernoulli = base == "bernoulli";
  f->masked_fill = base == "masked_fill";
  f->index_fill = base == "index_fill";
  f->checked_scalar_value =
      f->value >= 0 && (base == "fill" || base == "masked_fill" || base == "index_fill" || base == "scatter");
  // scalar_tensor: how Python indexing makes a scalar value on the device
  // (x[m] = 300 -> at::indexing::scalarToTensor, which CPU fills with a
  // checked conversion).
  f->checked_fill_value = f->fill_value >= 0 && (base == "full" || base == "full_like" || base == "new_full" ||
                                                 base == "scalar_tensor");
  f->scalar_tensor = base == "scalar_tensor";
  f->index_put = base == "index_put" || base == "_index_put_impl";
  f->mask_indexing = f->index_put || base == "index";
  if (f->index >= 0 && f->entry && !f->entry->traits.index_checks.empty()) {
    f->index_op = base == "index_select"   ? IndexOp::kIndexSelect
                  : base == "index_add"    ? IndexOp::kIndexAdd
                  : base == "index_reduce" ? IndexOp::kIndexReduce
                  : base == "index_fill"   ? IndexOp::kIndexFill
                  : base == "index_copy"   ? IndexOp::kIndexCopy
                                           : IndexOp::kOther;
  }
  return f;
}

// The facts of `op`'s overload: a per-thread map in front of one shared map
// (the mutex is taken once per overload and thread). Keyed by the schema's
// address, as the dispatcher keeps it for the operator's lifetime.
const OpFacts& FactsFor(const c10::OperatorHandle& op) {
  const c10::FunctionSchema* key = &op.schema();
  thread_local std::unordered_map<const c10::FunctionSchema*, const OpFacts*> local;
  auto it = local.find(key);
  if (it != local.end()) return *it->second;
  static std::mutex mutex;
  static std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpFacts>> all;
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<OpFacts>& slot = all[key];
  if (!slot) slot = MakeFacts(op);
  local.emplace(key, slot.get());
  return *slot;
}

}  // namespace

void RunOnCpu(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& reason,
              void (*cpu_call)(const c10::OperatorHandle&, torch::jit::Stack*)) {
  std::string name = OpName(op.schema());
  TORCH_CHECK_NOT_IMPLEMENTED(CpuFallbackAllowed(), "The operator '", name,
                              "' is not implemented for the tpu device (", reason,
                              "), and TORCH_TPU_CPU_FALLBACK=0 forbids running it on the CPU.");
  auto& metrics = runtime::Runtime::Get().metrics();
  {
    std::lock_guard<std::mutex> lock(metrics.fallback_mutex);
    metrics.cpu_fallbacks[name]++;
  }
  // The warning (once per op) follows the first call CPU's kernel completes:
  // a call it rejects raises CPU's error alone, as on CPU (the meta kernel
  // rejecting an invalid call sends it here).
  if (cpu_call != nullptr)
    cpu_call(op, stack);
  else
    at::native::cpu_fallback(op, stack);
  static std::mutex warned_mutex;
  static std::unordered_set<std::string> warned;
  bool first;
  {
    std::lock_guard<std::mutex> lock(warned_mutex);
    first = warned.insert(name).second;
  }
  if (first) TORCH_WARN("torch_tpu: ", name, " runs on the CPU (", reason, "); results are copied back to tpu.");
}

namespace {

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
void ExpandMaskIndices(const OpFacts& facts, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!facts.mask_indexing || facts.self < 0 || facts.indices < 0) return;
  const size_t first = stack->size() - op.schema().arguments().size();
  const std::optional<size_t> self_pos = first + static_cast<size_t>(facts.self);
  const std::optional<size_t> indices_pos = first + static_cast<size_t>(facts.indices);
  if (!(*stack)[*indices_pos].isList()) return;
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

// `x[mask] = v` as CPU's index_put_ serves it (aten/src/ATen/native/
// TensorAdvancedIndexing.cpp: canDispatchToMaskedFill, then
// self.masked_fill_(mask, value.item())): accumulate false, a one-element
// value (any shape, any dtype), and among the indices exactly one defined
// tensor, a bool or uint8 mask over the dims it indexes (after None
// entries: x[:, m] = v). The call is masked_fill with the mask viewed with
// size-1 dims around it, so that, as on CPU, a uint8 mask raises
// masked_fill_'s "only supports boolean masks" and a value of another
// dtype is converted as a Scalar ("value cannot be converted to type int8_t
// without overflow" where it does not fit). A value of self's dtype stays a
// tensor (no sync for a tpu value); one of another dtype is read with
// item(), as CPU does (a sync for a tpu value). CPU takes this path only for
// a CPU value (CUDA's tpu-like devices: values on the device go the general
// way); tpu values take it too, so that tpu computes what CPU computes on
// the same inputs. Saves the count of true elements (one sync) and a
// program per count (ExpandMaskIndices). Anything else (several indices, a
// mask of another shape: the general path raises CPU's error; values with
// more elements; accumulate; out=) is left to the general path. Returns true
// when the call was served (its result on the stack).
bool ServeMaskAssignAsMaskedFill(const OpFacts& f, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (f.out || f.self < 0 || f.indices < 0 || f.values < 0) return false;
  const size_t nargs = op.schema().arguments().size();
  const size_t first = stack->size() - nargs;
  if (f.accumulate >= 0) {
    const c10::IValue& acc = (*stack)[first + static_cast<size_t>(f.accumulate)];
    if (acc.isBool() && acc.toBool()) return false;
  }
  const c10::IValue& sv = (*stack)[first + static_cast<size_t>(f.self)];
  const c10::IValue& iv = (*stack)[first + static_cast<size_t>(f.indices)];
  const c10::IValue& vv = (*stack)[first + static_cast<size_t>(f.values)];
  if (!sv.isTensor() || !iv.isList() || !vv.isTensor()) return false;
  const at::Tensor self = sv.toTensor(), values = vv.toTensor();
  if (!self.defined() || self.device().type() != kTpu || !values.defined() || values.numel() != 1 ||
      (values.device().type() != kTpu && !values.is_cpu()))
    return false;
  at::Tensor mask;
  int64_t lead = 0, indexed = 0;  // None entries before the mask; dims the indices cover
  for (const auto& x : iv.toListRef()) {
    if (!x.isTensor() || !x.toTensor().defined()) {
      if (!mask.defined()) ++lead;
      ++indexed;
      continue;
    }
    const at::Tensor& t = x.toTensor();
    if ((t.scalar_type() != at::kBool && t.scalar_type() != at::kByte) || mask.defined() || t.dim() == 0) return false;
    mask = t;
    indexed += t.dim();
  }
  if (!mask.defined() || indexed > self.dim()) return false;
  std::vector<int64_t> shape(static_cast<size_t>(self.dim()), 1);
  for (int64_t j = 0; j < mask.dim(); ++j) {
    if (mask.size(j) != self.size(lead + j)) return false;
    shape[static_cast<size_t>(lead + j)] = mask.size(j);
  }
  const at::Tensor m = mask.to(self.device()).reshape(shape);
  at::Tensor result;
  if (values.scalar_type() == self.scalar_type()) {
    const at::Tensor v = values.reshape({});
    result = f.self_written ? self.masked_fill_(m, v) : self.masked_fill(m, v);
  } else {
    const c10::Scalar v = values.item();
    result = f.self_written ? self.masked_fill_(m, v) : self.masked_fill(m, v);
  }
  torch::jit::drop(*stack, nargs);
  stack->push_back(f.self_written ? self : result);
  return true;
}

// index_put_ / _index_put_impl_ / index_put with `values` of another dtype
// than `self`, outside ServeMaskAssignAsMaskedFill: CPU raises ("Index put
// requires the source and destination dtypes match", after its shape
// checks); the lowering would convert the values.
bool IndexPutDtypesDiffer(const OpFacts& f, const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (f.self < 0 || f.values < 0) return false;
  const size_t first = stack.size() - op.schema().arguments().size();
  const c10::IValue& sv = stack[first + static_cast<size_t>(f.self)];
  const c10::IValue& vv = stack[first + static_cast<size_t>(f.values)];
  return sv.isTensor() && vv.isTensor() && sv.toTensor().defined() && vv.toTensor().defined() &&
         sv.toTensor().scalar_type() != vv.toTensor().scalar_type();
}

bool HasMathBits(const at::Tensor& t) { return t.defined() && (t.is_conj() || t.is_neg()); }

using runtime::ForEachTensor;

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

// The storage offsets of every element of strided view `t`, sorted
// (duplicates kept).
std::vector<int64_t> SortedElementOffsets(const at::Tensor& t) {
  std::vector<int64_t> out{t.storage_offset()};
  out.reserve(static_cast<size_t>(t.numel()));
  for (int64_t d = 0; d < t.dim(); ++d) {
    const size_t n = out.size();
    for (int64_t i = 1; i < t.size(d); ++i)
      for (size_t j = 0; j < n; ++j) out.push_back(out[j] + i * t.stride(d));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Views this large are not listed element by element: an overlap that the
// stride test cannot rule out is then assumed (the caller runs the call on
// the CPU mirror, which is exact either way, only slower).
constexpr int64_t kMaxListedElements = int64_t{1} << 18;

// Whether two elements of strided view `t` are one memory location, where
// at::has_internal_overlap says TooHard (no zero stride over a size > 1, not
// non-overlapping-and-dense: slices with a step, transposes, as_strided).
// Exact: with the dims of size > 1 sorted by |stride|, a stride larger than
// the extent of all smaller ones together (sum of |stride| * (size - 1)) at
// every step proves distinct offsets (a[::2], x.t(), x[:, 1:]); otherwise the
// offsets are listed and compared (a.as_strided((4, 4), (2, 1)) overlaps,
// a.as_strided((2, 2), (3, 2)) does not); beyond kMaxListedElements an
// overlap is assumed.
bool HasSelfOverlap(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size), size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(std::abs(t.stride(d)), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t extent = 0;
  bool proven = true;
  for (const auto& [stride, size] : dims) {
    if (stride <= extent) {
      proven = false;
      break;
    }
    extent += stride * (size - 1);
  }
  if (proven) return false;
  if (t.numel() > kMaxListedElements) return true;
  const std::vector<int64_t> offsets = SortedElementOffsets(t);
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

// True if the call writes a tpu tensor two of whose elements are one memory
// location: a zero stride over a size > 1 (at::has_internal_overlap Yes:
// x.expand(3).add_(1), where CPU raises "unsupported operation: more than
// one element of the written-to tensor refers to a single memory
// location"), or a TooHard layout with a shared element (HasSelfOverlap:
// a.as_strided((4, 4), (2, 1)).mul_(2), which CPU computes in its own
// element order, reading elements it wrote); such a call runs on the CPU
// mirror, which gives CPU's error or values. fill_/zero_ are left out: their
// lowerings write the same value to every element, as CPU does.
bool WritesOverlappingTensor(const OpFacts& facts, const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (!facts.written || facts.fill_or_zero) return false;
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  bool overlap = false;
  for (size_t i = 0; i < args.size() && !overlap; ++i) {
    if (!IsWrittenArg(args[i])) continue;
    ForEachTensor(stack[first + i], [&](const at::Tensor& t) {
      if (overlap || !t.defined() || t.device().type() != kTpu) return;
      const at::MemOverlap status = at::has_internal_overlap(t);
      overlap = status == at::MemOverlap::Yes || (status == at::MemOverlap::TooHard && HasSelfOverlap(t));
    });
  }
  return overlap;
}

// Whether two strided views of one storage (same element size) share an
// element, exactly: disjoint byte ranges, or offsets that differ modulo the
// gcd of all strides (a[::2] and a[1::2], the columns of a matrix), share
// none; otherwise both views' element offsets are listed, sorted and merged
// when they hold at most kMaxListedElements together; larger views are
// assumed to share one (the caller then runs the call on the CPU mirror,
// which is exact either way, only slower).
bool ViewsShareAnElement(const at::Tensor& a, const at::Tensor& b) {
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
  if (a.numel() + b.numel() > kMaxListedElements) return true;
  const std::vector<int64_t> ao = SortedElementOffsets(a), bo = SortedElementOffsets(b);
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
// a never-written storage reads as zeros, as on the device). A storage no
// argument writes is read in place from runtime::HostContentsOf's shared,
// read-only copy (no download where the upload's bytes or an earlier
// call's copy are at hand, no copy of them); a written one gets its own.
class HostMirrors {
 public:
  struct Mirror {
    at::Tensor bytes;  // the storage's bytes on the host
    at::Tensor any;    // a tpu tensor over the storage
    bool written = false;
  };
  // `write`: some argument of the call writes the storage.
  at::Tensor Of(const at::Tensor& t, bool write) {
    if (!t.defined() || t.device().type() != kTpu) return t;
    auto& ds = runtime::StorageOf(t);
    auto [it, inserted] = mirrors_.try_emplace(&ds);
    Mirror& m = it->second;
    if (inserted) {
      const auto byte_options = at::TensorOptions().dtype(at::kByte);
      const auto nbytes = static_cast<int64_t>(ds.nbytes());
      m.any = t;
      runtime::HostContents contents;
      if (ds.initialized()) contents = runtime::HostContentsOf(ds);
      if (!write && contents.size == ds.nbytes()) {
        // Read only: CPU's kernel reads the shared copy (never written:
        // no argument over this storage is a written one).
        auto owner = contents.owner;
        m.bytes = at::from_blob(const_cast<char*>(contents.data), {nbytes}, [owner](void*) {}, byte_options);
      } else {
        m.bytes = at::empty({nbytes}, byte_options);
        auto* dst = static_cast<char*>(m.bytes.data_ptr());
        if (contents.size) std::memcpy(dst, contents.data, contents.size);
        std::memset(dst + contents.size, 0, ds.nbytes() - contents.size);
      }
    }
    m.written |= write;
    at::Tensor host = at::empty({0}, t.options().device(at::kCPU));
    host.set_(m.bytes.storage(), t.storage_offset(), t.sizes(), t.strides());
    return host;
  }
  // Replaces the tpu tensors of the call's arguments (stack[first...]).
  // The storages written arguments view are found first: one read and
  // written through different arguments gets a private copy for both.
  void MirrorArguments(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first) {
    const auto& args = op.schema().arguments();
    std::unordered_set<runtime::DeviceStorage*> written;
    for (size_t i = 0; i < args.size(); ++i) {
      if (!IsWrittenArg(args[i])) continue;
      ForEachTensor((*stack)[first + i], [&](const at::Tensor& t) {
        if (t.defined() && t.device().type() == kTpu) written.insert(&runtime::StorageOf(t));
      });
    }
    for (size_t i = 0; i < args.size(); ++i) {
      c10::IValue& v = (*stack)[first + i];
      const bool write = IsWrittenArg(args[i]);
      v = MapTensors(v, [&](const at::Tensor& t) {
        if (!t.defined() || t.device().type() != kTpu) return t;
        return Of(t, write || written.count(&runtime::StorageOf(t)) > 0);
      });
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
// - an index tensor of a dimensionality or dtype CPU's index_* kernels
//   refuse (CheckIndexLikeCpu);
// - a non-bool mask for masked_fill (CPU's "masked_fill_ only supports
//   boolean masks");
// - a Scalar `value` that does not fit self's dtype for fill_, masked_fill,
//   index_fill, scatter, full/full_like/new_full and scalar_tensor (so also
//   x[m] = 300 and x[0] = 300 into int8; CPU's kernels convert it with
//   Scalar::to, which raises
//   "value cannot be converted to type int8_t without overflow"; the
//   lowerings would wrap or saturate it);
// - a float `p` outside [0, 1] for bernoulli (CPU's bernoulli_ check; a
//   tensor p is checked on its values by the lowering, lowering/random.cpp).
// The argument positions come from the overload's OpFacts: a call compares
// no names.
void CheckIndexLikeCpu(IndexOp op, const at::Tensor& index);

void CheckScalarFitsLikeCpu(const c10::Scalar& value, at::ScalarType dtype) {
  switch (dtype) {
    case at::kBool: case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
    case at::kHalf: case at::kBFloat16: case at::kFloat: case at::kDouble: case at::kComplexFloat:
    case at::kComplexDouble:
      AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(at::kBool, at::kHalf, at::kBFloat16, dtype, "fill_",
                                             [&] { (void)value.to<scalar_t>(); });
      return;
    case at::kFloat8_e5m2: (void)value.to<c10::Float8_e5m2>(); return;
    case at::kFloat8_e4m3fn: (void)value.to<c10::Float8_e4m3fn>(); return;
    case at::kFloat8_e5m2fnuz: (void)value.to<c10::Float8_e5m2fnuz>(); return;
    case at::kFloat8_e4m3fnuz: (void)value.to<c10::Float8_e4m3fnuz>(); return;
    case at::kFloat8_e8m0fnu: (void)value.to<c10::Float8_e8m0fnu>(); return;
    default:
      return;  // other dtypes: as the lowering converts
  }
}

// CPU's scalar_tensor converts a value into Half, BFloat16 and the float8
// types without Scalar::to's range check (torch.scalar_tensor(1e300,
// dtype=torch.half) is inf; e4m3fn saturates to 448, the fnuz types give
// NaN), while fill_/full/masked_fill raise. where(c, x, 1e300) with a half
// x makes its scalar operand so, and Python indexing its value.
bool ScalarTensorConvertsUnchecked(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || at::isFloat8Type(t);
}

// scalar_tensor(s, dtype) for those dtypes: `s` is replaced by CPU's
// converted value (a double that the dtype holds exactly: inf, 448, NaN,
// 70144 for 70000 into bf16), so the program's cast of it is exact.
void ConvertScalarTensorValueLikeCpu(const OpFacts& f, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t first = stack->size() - op.schema().arguments().size();
  if (f.fill_value < 0 || f.dtype < 0) return;
  c10::IValue& v = (*stack)[first + static_cast<size_t>(f.fill_value)];
  const c10::IValue& dtype = (*stack)[first + static_cast<size_t>(f.dtype)];
  if (!v.isScalar() || !dtype.isInt()) return;
  const auto st = static_cast<at::ScalarType>(dtype.toInt());
  if (!ScalarTensorConvertsUnchecked(st) || v.toScalar().isBoolean()) return;
  v = c10::Scalar(at::scalar_tensor(v.toScalar(), at::TensorOptions().dtype(st)).item().toDouble());
}

void CheckArgumentsLikeCpu(const OpFacts& f, const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  auto at_pos = [&](int16_t pos) -> const c10::IValue* {
    return pos < 0 ? nullptr : &stack[first + static_cast<size_t>(pos)];
  };
  const c10::IValue* self = at_pos(f.self);
  const bool self_tensor = self && self->isTensor() && self->toTensor().defined();
  if (f.index_op != IndexOp::kNone && at_pos(f.index)->isTensor()) CheckIndexLikeCpu(f.index_op, at_pos(f.index)->toTensor());
  if (f.bernoulli && f.p >= 0 && at_pos(f.p)->isDouble()) {
    const double p = at_pos(f.p)->toDouble();
    TORCH_CHECK(p >= 0 && p <= 1, "bernoulli_ expects p to be in [0, 1], but got p=", p);
  }
  if (f.masked_fill && f.mask >= 0 && at_pos(f.mask)->isTensor()) {
    const at::Tensor& mask = at_pos(f.mask)->toTensor();
    TORCH_CHECK(!mask.defined() || mask.scalar_type() == at::kBool,
                "masked_fill_ only supports boolean masks, but got mask with dtype ", mask.dtype());
  }
  if (f.checked_scalar_value && self_tensor && at_pos(f.value)->isScalar()) {
    const c10::Scalar v = at_pos(f.value)->toScalar();
    // CPU's index_fill_ refuses a complex value for a real self first.
    TORCH_CHECK(!f.index_fill || self->toTensor().is_complex() || !v.isComplex(),
                "index_fill_(): Converting complex Scalar to non-complex type is not supported");
    CheckScalarFitsLikeCpu(v, self->toTensor().scalar_type());
  }
  if (f.checked_fill_value && at_pos(f.fill_value)->isScalar()) {
    // The result's dtype: `dtype`, else self's (full_like, new_full), else
    // the one full infers from the value (which it fits, except a float
    // value into the default dtype).
    const c10::Scalar v = at_pos(f.fill_value)->toScalar();
    const c10::IValue* dtype = at_pos(f.dtype);
    if (dtype && dtype->isInt()) {
      const auto st = static_cast<at::ScalarType>(dtype->toInt());
      if (!(f.scalar_tensor && ScalarTensorConvertsUnchecked(st))) CheckScalarFitsLikeCpu(v, st);
    }
    else if (self_tensor) CheckScalarFitsLikeCpu(v, self->toTensor().scalar_type());
    else if (v.isFloatingPoint()) CheckScalarFitsLikeCpu(v, c10::typeMetaToScalarType(c10::get_default_dtype()));
  }
  if (f.entry->traits.out_same_dtype && self_tensor && f.out) {
    const at::Tensor& s = self->toTensor();
    for (size_t i = 0; i < args.size(); ++i) {
      if (!args[i].is_out() || !stack[first + i].isTensor()) continue;
      const at::Tensor& out = stack[first + i].toTensor();
      if (out.defined())
        TORCH_CHECK(out.scalar_type() == s.scalar_type(), "Found dtype ", out.scalar_type(), " but expected ",
                    s.scalar_type());
    }
  }
  const c10::IValue* alpha = at_pos(f.alpha);
  if (alpha && f.other >= 0 && alpha->isScalar() && self_tensor) {
    const c10::Scalar a = alpha->toScalar();
    // An integral, non-bool alpha (the default 1) passes every check below:
    // no result_type per call.
    if (a.isIntegral(false)) return;
    const c10::IValue& o = *at_pos(f.other);
    const at::Tensor& s = self->toTensor();
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

struct DropWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

std::string Lower(std::string m) {
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return m;
}

bool IsDtypeMessage(const std::string& m) {
  const std::string l = Lower(m);
  return l.find("dtype") != std::string::npos || l.find("scalar type") != std::string::npos ||
         l.find("same type") != std::string::npos;
}

// CPU's dtype dispatch (AT_DISPATCH_*) rejecting a dtype its kernel has no
// case for: NotImplementedError "\"leaky_relu_cpu\" not implemented for
// 'Long'".
bool IsDispatchDtypeMessage(const std::string& m) { return m.find(" not implemented for '") != std::string::npos; }

bool IsScalarConversionMessage(const std::string& m) {
  return m.find("cannot be converted to type") != std::string::npos;
}

// Runs `op` through CPU's kernel on zero-filled CPU tensors of the call's
// tpu tensors' sizes and dtypes (CPU tensors and every other argument as
// they are), with warnings dropped. A c10::Error whose message `adopt`
// accepts is rethrown as is (CPU's exception type and message); any other
// outcome returns (an error of another kind, which zeros may cause, is not
// the call's). Dense zeros, not one zero expanded: CPU kernels index
// their inputs' data as laid out densely (adaptive_max_pool3d_backward's
// read past an expanded input and crashed).
void ProbeOnCpu(const c10::OperatorHandle& op, const torch::jit::Stack& stack, bool (*adopt)(const std::string&)) {
  const size_t first = stack.size() - op.schema().arguments().size();
  torch::jit::Stack probe(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  for (auto& v : probe)
    v = MapTensors(v, [](const at::Tensor& t) {
      return t.defined() && t.device().type() == kTpu ? at::zeros(t.sizes(), t.options().device(at::kCPU)) : t;
    });
  DropWarnings drop;
  c10::WarningUtils::WarningHandlerGuard guard(&drop);
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &probe);
  } catch (const c10::Error& e) {
    if (adopt(e.msg())) throw;
  } catch (const std::exception& e) {
    // c10's Scalar conversions throw std::runtime_error (c10::report_overflow).
    if (adopt(e.what())) throw;
  }
}

// The bytes of the call's tpu tensors; -1 where an argument is a Device
// (a probe would dispatch back to tpu).
int64_t TpuBytes(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t first = stack.size() - op.schema().arguments().size();
  int64_t bytes = 0;
  for (size_t i = first; i < stack.size(); ++i) {
    if (stack[i].isDevice()) return -1;
    ForEachTensor(stack[i], [&](const at::Tensor& t) {
      if (t.defined() && t.device().type() == kTpu) bytes += static_cast<int64_t>(t.numel()) * t.element_size();
    });
  }
  return bytes;
}

constexpr int64_t kProbeMaxBytes = int64_t{256} << 20;
constexpr int64_t kIntegralProbeMaxBytes = int64_t{16} << 20;

// Mixed floating dtypes: CPU's kernel is the reference. Many CPU kernels
// take no type promotion and require their floating operands to share one
// dtype (a TensorIterator built without promote_inputs_to_common_dtype:
// "Found dtype Double but expected Float" from huber_loss_backward,
// binary_cross_entropy_backward, _prelu_kernel, ...; data_ptr<scalar_t>()
// of a tensor of another dtype: "expected scalar type Float but found
// Double" from _log_softmax_backward_data, native_batch_norm's weight,
// embedding_bag, cdist, ...), while the meta kernels (and so the lowerings)
// accept the mix and would return a value. Rather than a list of ops and
// their messages: when a call's tpu tensors (out= included) have more than
// one floating/complex dtype, the first call of each (overload, dtype
// signature) on a thread runs CPU's kernel on zero-filled CPU tensors of
// the call's sizes and dtypes (ProbeOnCpu: no device values are read,
// nothing is waited for). If CPU raises an error about dtypes (its message
// names a dtype, "scalar type" or "same type"), the call raises that error
// — CPU's exception type and message — at the op, in every mode; otherwise
// the signature is remembered as accepted and never probed again. Not
// probed: random ops (the CPU generator would advance), calls with a
// Device argument, and calls whose tpu tensors exceed 256 MiB together
// (the probe would allocate as much on the host).
//
// Likewise a call with an integer or bool tpu tensor (session 24): CPU's
// kernels dispatch on dtype, and one with no case for it raises
// NotImplementedError ("\"leaky_relu_cpu\" not implemented for 'Long'"), a
// check ATen's C++ meta steps leave to the kernel (cpp_meta.cpp's table:
// leaky_relu, mse_loss of int64 gave values once a program served the key;
// hardsigmoid, tanh_backward, silu_backward of integers did before it).
// Probed once per (overload, dtype signature) where the call's tpu tensors
// total at most 16 MiB (the probe allocates their zeros on the host; an
// embedding's table is often larger, and takes integer indices); such an
// error is raised at the op in every mode.
void CheckDtypesLikeCpu(const OpFacts& f, const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (f.entry->traits.needs_rng) return;
  const size_t n = op.schema().arguments().size(), first = stack.size() - n;
  // One pass: whether the tpu tensors mix floating dtypes or hold an
  // integer/bool one, and the signature (every tensor's dtype and device
  // kind, in argument order; hashed: integer tensors are common, this runs
  // for each of their calls).
  at::ScalarType seen = at::ScalarType::Undefined;
  bool mixed = false, integral = false;
  size_t sig = 0;
  for (size_t i = first; i < stack.size(); ++i) {
    ForEachTensor(stack[i], [&](const at::Tensor& t) {
      if (!t.defined()) {
        sig = c10::hash_combine(sig, size_t{1} << 20);
        return;
      }
      const bool tpu = t.device().type() == kTpu;
      sig = c10::hash_combine(sig, static_cast<size_t>(static_cast<int>(t.scalar_type()) * 2 + tpu));
      if (!tpu) return;
      if (!(t.is_floating_point() || t.is_complex())) integral = true;
      else if (seen == at::ScalarType::Undefined) seen = t.scalar_type();
      else if (t.scalar_type() != seen) mixed = true;
    });
    sig = c10::hash_combine(sig, size_t{1} << 21);
  }
  if (!mixed && !integral) return;
  thread_local std::unordered_set<size_t> accepted;
  const size_t key = c10::hash_combine(std::hash<const void*>()(&op.schema()), sig);
  if (accepted.count(key)) return;
  const int64_t bytes = TpuBytes(op, stack);
  if (bytes < 0 || bytes > (mixed ? kProbeMaxBytes : kIntegralProbeMaxBytes)) return;
  // Integer/bool calls adopt the dispatch error only: a dtype error may be
  // one CPU raises after value checks the zeros pass and the real values
  // fail (a bool mask assignment of a wrong shape and dtype: CPU raises
  // "shape mismatch"; on a zero mask, index_put_'s dtype error).
  ProbeOnCpu(op, stack, mixed ? IsDtypeMessage : IsDispatchDtypeMessage);
  accepted.insert(key);
}

bool IsNumberArg(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::NumberType) return true;
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::NumberType;
  return false;
}

void CheckScalarFitsLikeCpu(const c10::Scalar& value, at::ScalarType dtype);

// Scalar arguments out of range: CPU's kernel is the reference. Some CPU
// kernels convert a Scalar argument to the computation's dtype with
// Scalar::to, which raises "value cannot be converted to type int8_t without
// overflow" (clamp's min/max, addcmul/addcdiv's value, threshold, hardtanh,
// add's alpha into int8, pow's exponent into half, ...), where the
// lowerings would wrap or saturate it: a silent wrong value. Others wrap
// the Scalar as a 0-d double tensor and cast it without a check
// (rsub/remainder/eq/gt.Scalar, pow's exponent into f32: 1e300 gives inf),
// where the program's f32 scalar input raised. So a call with a Scalar
// argument that does not fit some tpu tensor's dtype, or a finite float
// beyond f32's range, runs CPU's kernel on zero-filled tensors first
// (ProbeOnCpu; no device values, not cached: such values are rare): CPU's
// conversion error is raised as CPU raises it; if CPU accepts, a float
// beyond f32's range becomes +-inf where the program takes it as f32 (no
// f64 tensor, float32 default dtype), which is the value CPU's unchecked
// cast gives. Not probed: random ops, ops whose Scalars are compiled in
// (arange), calls over 256 MiB of tpu tensors or with a Device argument.
void CheckScalarsLikeCpu(const OpFacts& f, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (f.entry->traits.needs_rng || f.entry->traits.static_scalars) return;
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<size_t> odd;
  std::vector<at::ScalarType> dtypes;
  bool f64 = c10::get_default_dtype_as_scalartype() == at::kDouble;
  for (size_t i = 0; i < args.size(); ++i)
    ForEachTensor((*stack)[first + i], [&](const at::Tensor& t) {
      if (!t.defined() || t.device().type() != kTpu) return;
      dtypes.push_back(t.scalar_type());
      f64 |= t.scalar_type() == at::kDouble || t.scalar_type() == at::kComplexDouble;
    });
  if (dtypes.empty()) return;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (!v.isScalar() || !IsNumberArg(args[i].type())) continue;
    const c10::Scalar s = v.toScalar();
    if (s.isBoolean()) continue;
    bool fits = true;
    for (at::ScalarType dt : dtypes) {
      try {
        CheckScalarFitsLikeCpu(s, dt);
      } catch (const std::exception&) {  // c10::report_overflow's std::runtime_error, or a c10::Error
        fits = false;
        break;
      }
    }
    const bool beyond_f32 = s.isFloatingPoint() && std::isfinite(s.toDouble()) &&
                            std::abs(s.toDouble()) > static_cast<double>(std::numeric_limits<float>::max());
    if (!fits || beyond_f32) odd.push_back(i);
  }
  if (odd.empty()) return;
  const int64_t bytes = TpuBytes(op, *stack);
  if (bytes < 0 || bytes > kProbeMaxBytes) return;
  ProbeOnCpu(op, *stack, IsScalarConversionMessage);
  if (f64) return;
  for (size_t i : odd) {
    c10::IValue& v = (*stack)[first + i];
    const c10::Scalar s = v.toScalar();
    if (s.isFloatingPoint() && std::isfinite(s.toDouble()) &&
        std::abs(s.toDouble()) > static_cast<double>(std::numeric_limits<float>::max()))
      v = c10::Scalar(std::copysign(std::numeric_limits<double>::infinity(), s.toDouble()));
  }
}

// The dimensionality and dtypes CPU's index_* kernels accept for their
// `index` tensor, checked in CPU's order with CPU's errors
// (aten/src/ATen/native/TensorAdvancedIndexing.cpp: index_select_out_cpu_,
// index_func_meta_impl, index_copy's meta, index_fill_), before the call:
// the meta kernels accept a 2-d index for index_select and index_reduce
// (the lowering would then return rows where CPU raises) and any dtype (the
// lowerings would read a float index as positions). gather/scatter run on
// the CPU for a non-integer index (their lowerings refuse it), which raises
// there.
void CheckIndexLikeCpu(IndexOp op, const at::Tensor& index) {
  if (!index.defined()) return;
  const at::ScalarType t = index.scalar_type();
  switch (op) {
    case IndexOp::kIndexSelect:
      TORCH_CHECK_INDEX(index.dim() <= 1, "index_select(): Index is supposed to be a vector");
      TORCH_CHECK(t == at::kLong || t == at::kInt, "index_select(): Expected dtype int32 or int64 for index");
      return;
    case IndexOp::kIndexAdd:
    case IndexOp::kIndexReduce: {
      const char* func = op == IndexOp::kIndexAdd ? "index_add" : "index_reduce";
      TORCH_CHECK_INDEX(index.dim() <= 1, func, "_(): Index is supposed to be a vector, but got dim: ", index.dim(),
                        " with type: ", t, " and size: ", index.sizes());
      TORCH_CHECK(t == at::kLong || t == at::kInt, func, "_(): Expected dtype int32/int64 for index but got: ", t);
      return;
    }
    case IndexOp::kIndexCopy:
      TORCH_CHECK_INDEX(index.dim() < 2, "index_copy_(): Index should have dimension 1 or 0 (got ", index.dim(), ")");
      TORCH_CHECK(t == at::kLong, "index_copy_(): Expected a long tensor for index, but got ", t);
      return;
    case IndexOp::kIndexFill:
      TORCH_CHECK_INDEX(t == at::kLong, "index_fill_(): Expected dtype int64 for index.");
      return;
    default:
      return;
  }
}

// Whether a call must run on the CPU for holding a complex32 (ComplexHalf)
// tensor: its tpu storage holds u32 bit patterns (lowering::ToElementType)
// that no lowering computes on. Any complex32 tensor in a tensor list, or
// in a call of an op other than the complex32 moves (copy, clone, zero,
// alias_copy, view_copy), out= arguments and CPU tensors included; the
// moves are checked again on their dtypes (lowering::Complex32Supported,
// which also catches complex32 results of other inputs: half + 1j).
bool Complex32RunsOnCpu(const lowering::LoweringEntry& entry, const c10::OperatorHandle& op,
                        const torch::jit::Stack& stack) {
  static const std::unordered_set<std::string_view> kMoves = {"copy", "clone", "zero", "alias_copy", "view_copy"};
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  const bool move = kMoves.count(entry.name) > 0;
  bool found = false;
  for (size_t i = 0; i < args.size() && !found; ++i) {
    const c10::IValue& v = stack[first + i];
    ForEachTensor(v, [&](const at::Tensor& t) {
      if (t.defined() && t.scalar_type() == at::kComplexHalf && (!move || !v.isTensor())) found = true;
    });
  }
  return found;
}

void TpuBoxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpFacts& facts = FactsFor(op);
  const lowering::LoweringEntry* entry = facts.entry;
  if (entry) {
    CheckArgumentsLikeCpu(facts, op, *stack);
    CheckDtypesLikeCpu(facts, op, *stack);
    CheckScalarsLikeCpu(facts, op, stack);
    if (facts.scalar_tensor) ConvertScalarTensorValueLikeCpu(facts, op, stack);
  }
  if (AnyMathBits(op, *stack)) return RunResolvingMathBits(op, stack);
  if (facts.written && (WritesOverlappingTensor(facts, op, *stack) || WritesPartlyOverlappingArgument(op, *stack)))
    return RunOnCpuMirror(op, stack);
  if (entry) {
    if (facts.index_put) {
      if (ServeMaskAssignAsMaskedFill(facts, op, stack)) return;
      if (IndexPutDtypesDiffer(facts, op, *stack)) return RunOnCpuMirror(op, stack);  // raises CPU's error
    }
    MoveCpuIndicesToDevice(op, stack, *entry);
    ExpandMaskIndices(facts, op, stack);
  }
  if (!entry) return RunOnCpu(op, stack, "no lowering");
  if (Complex32RunsOnCpu(*entry, op, *stack)) {
    if (WritesSharedStorage(op, *stack)) return RunOnCpuMirror(op, stack);
    return RunOnCpu(op, stack, "complex32 has no XLA element type");
  }
  try {
    runtime::RunOp(op, stack, *entry);
  } catch (const runtime::UnsupportedOp& e) {
    if (WritesSharedStorage(op, *stack)) return RunOnCpuMirror(op, stack);
    RunOnCpu(op, stack, e.what());
  }
}

// `t`'s memory (`nbytes` uploaded from its data pointer) as a
// StorageBuffer::host owner: the tensor itself, kept alive (UploadStorage's
// `keep`; for host tensors nothing writes any more). Null — the upload
// copies — where the tensor's storage is larger than those bytes (a view
// into a bigger allocation would keep all of it alive); the 64-byte slack
// covers a storage whose size is not a whole number of elements.
std::shared_ptr<const void> KeepAlive(const at::Tensor& t, size_t nbytes) {
  if (t.storage_offset() != 0 || t.storage().nbytes() > nbytes + 64) return nullptr;
  auto held = std::make_shared<const at::Tensor>(t);
  return std::shared_ptr<const void>(held, held->const_data_ptr());
}

bool ServeOnHost(const runtime::CompiledOp& compiled, const c10::OperatorHandle& op, torch::jit::Stack& stack,
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
  // A result CPU's kernel gives with other sizes or dtype than the program
  // (an op's internal outputs: embedding_bag's offset2bag, Long[0] on CPU
  // where the meta kernel gives Long[n]; native_batch_norm's save_mean in
  // eval): nothing has been written yet, so the arguments are put back and
  // the caller runs the program instead (every call of the key then gives
  // the program's results, as before host-first calls).
  auto decline = [&] {
    rt.metrics().host_first_declined++;
    stack.erase(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
    for (auto& v : originals) stack.push_back(std::move(v));
    return false;
  };
  if (compiled.returns.size() != num_returns) return decline();
  // A CPU kernel that resized a mirrored storage (an out= tensor resized
  // inside the kernel: binary_cross_entropy's out= of a reduction writes
  // the elementwise loss through a squeezed view, growing the storage, and
  // then sums the 0-d out alone, a wrong value) is not what the program
  // computes: decline.
  for (auto& [ds, m] : mirrors.map())
    if (m.bytes.storage().nbytes() != ds->nbytes()) return decline();
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
      sizes = runtime::DynamicOutputSizes(
          o, compiled.poly_dim,
          runtime::TensorItem(originals[static_cast<size_t>(compiled.poly_leader)], compiled.poly_leader_item));
    }
    const at::Tensor& host = stack[rfirst + r].toTensor();
    if (!host.defined() || host.sizes() != c10::IntArrayRef(sizes) || host.scalar_type() != o.dtype)
      return decline();
    new_outputs.emplace_back(r, std::move(sizes));
  }
  const std::string producer = compiled.name + " (host-first, on the CPU)";
  for (auto& [r, sizes] : new_outputs) {
    const runtime::OutputSlot& o = compiled.outputs[static_cast<size_t>(compiled.returns[r].index)];
    // In the program's memory order: row-major, or the meta kernel's dense
    // permuted strides (OutputSlot::strides; for a dynamic extent, those of
    // OutputSlot::order at these sizes).
    const at::Tensor& result = stack[rfirst + r].toTensor();
    const std::vector<int64_t> strides = runtime::OutputStrides(o, sizes);
    at::Tensor host = strides.empty() ? result.contiguous()
                                      : at::empty_strided(sizes, strides, result.options()).copy_(result);
    // The result's memory is the upload's host copy (StorageBuffer::host):
    // no second copy of it; nothing else holds this tensor.
    const size_t nbytes = static_cast<size_t>(host.numel()) * host.element_size();
    auto sb = rt.UploadStorage(host.data_ptr(), nbytes, o.element, device_index, producer, o.numel,
                               KeepAlive(host, nbytes));
    returns[r] = runtime::WrapBuffer(std::move(sb), sizes, o.dtype, device_index, strides);
  }
  for (const auto& o : compiled.outputs) {
    if (o.kind != runtime::OutputSlot::Kind::kStorageWrite) continue;
    const c10::IValue& v = originals[static_cast<size_t>(o.arg)];
    const at::Tensor& t = o.item < 0 ? v.toTensor() : v.toListRef()[static_cast<size_t>(o.item)].toTensor();
    runtime::DeviceStorage* ds = &runtime::StorageOf(t);
    const at::Tensor& bytes = mirrors.BytesOf(ds);
    const size_t esize = runtime::ElementSize(o.element);
    // The mirror is this call's private copy (HostMirrors): its memory is
    // handed over as the upload's host copy.
    const size_t nbytes = ds->nbytes() / esize * esize;
    ds->Set(rt.UploadStorage(bytes.data_ptr(), nbytes, o.element, device_index, producer, o.numel,
                             KeepAlive(bytes, nbytes)));
  }
  rt.metrics().host_served++;
  stack.erase(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  for (auto& v : returns) stack.push_back(std::move(v));
  return true;
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&TpuBoxedKernel>()); }

void RegisterLoweredOpsDirectly() {
  // Ops with a lowering get the boxed kernel registered for the tpu key
  // itself, ahead of the CompositeExplicitAutograd(NonFunctional) kernels
  // that would otherwise run first: for structured ops those compute the
  // meta result and allocate the output on every call, then call the out=
  // variant. Ops with a CompositeImplicitAutograd kernel keep it (their
  // autograd comes from the decomposition) unless CPU registers a kernel of
  // its own (silu_backward, mish_backward, native_channel_shuffle: CPU runs
  // its kernel, autograd comes from the op's derivative formula, and the
  // decomposition is for backends without one; through it an integer
  // silu_backward returned floats on tpu where CPU raises), and copy_
  // keeps PyTorch's kernel (it routes host<->device copies to _copy_from).
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
        (handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
         !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)))
      continue;
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&TpuBoxedKernel>());
  }
}

// kernels.cpp's copy_ into a tpu tensor: whether dst (no math bits) has
// elements that are one memory location in a layout CPU's copy_ accepts
// (HasSelfOverlap: as_strided((4, 4), (2, 1)), where the last write in CPU's
// element order wins), or src is a tpu view of dst's storage sharing elements
// in a different layout (a TooHard overlap CPU's copy_ does not reject:
// at::assert_no_partial_overlap covers the Partial ones; CPU's element order
// defines the result). If so the copy runs on the CPU mirror
// (RunOnCpuMirror; a CPU src is read as it is), giving CPU's result, and
// true is returned.
bool CopyOnCpuIfOverlapping(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.numel() == 0 || src.numel() == 0 || !dst.has_storage()) return false;
  const bool self_overlap = at::has_internal_overlap(dst) == at::MemOverlap::TooHard && HasSelfOverlap(dst);
  const bool shared = src.device().type() == kTpu && src.has_storage() && !dst.is_same(src) &&
                      dst.storage().is_alias_of(src.storage()) && PartlyOverlapping(dst, src);
  if (!self_overlap && !shared) return false;
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  torch::jit::Stack stack{dst, src, false};
  RunOnCpuMirror(op, &stack);
  return true;
}

}  // namespace torch_tpu::aten

namespace torch_tpu::runtime {

bool ServeOnHost(const CompiledOp& compiled, const c10::OperatorHandle& op, torch::jit::Stack& stack,
                 size_t num_args) {
  return aten::ServeOnHost(compiled, op, stack, num_args);
}

}  // namespace torch_tpu::runtime
