#include "runtime/compiled_op.h"
#include "runtime/env.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <dirent.h>
#include <deque>
#include <fstream>
#include <map>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>
#include <set>
#include <thread>
#include <tuple>
#include <cstdint>
#include <limits>
#include <cstdlib>
#include <stdexcept>
#include <iostream>
#include <unordered_set>

#include "lowering/helpers.h"
#include "runtime/compile_stats.h"
#include "runtime/cpp_meta.h"
#include "runtime/disk_cache.h"

namespace torch_tpu::runtime {

int64_t StorageNumel(const at::Tensor& t) {
  auto& s = StorageOf(t);
  if (s.initialized()) return s.current().numel;
  return Capacity(static_cast<int64_t>(s.nbytes() / ElementSize(lowering::ToElementType(t.scalar_type()))));
}

namespace {

using lowering::LoweredArg;

bool IsScalarType(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::NumberType) return true;
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::NumberType;
  return false;
}

bool IsOutArg(const c10::Argument& a) {
  return a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite();
}

bool OnTpu(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

[[noreturn]] void DeviceMismatch(const at::Tensor& t) {
  throw std::runtime_error(
      "Expected all tensors to be on the same device, but found at least two devices, tpu:0 and " +
      t.device().str() + "!");
}

// How a scalar reaches the program: floating scalars as f32 unless the call
// computes in f64 (CallHasF64: then f64, so Python floats keep their
// precision and range, as CPU's double opmath does), integers as s64,
// booleans as pred.
hlo::ElementType ScalarElement(const c10::Scalar& s, bool has_f64) {
  if (s.isBoolean()) return hlo::ElementType::kPred;
  if (s.isIntegral(false)) return hlo::ElementType::kS64;
  if (s.isFloatingPoint()) return has_f64 ? hlo::ElementType::kF64 : hlo::ElementType::kF32;
  // Python complex numbers: c64 unless the call has an f64 tensor, as floats.
  return has_f64 ? hlo::ElementType::kC128 : hlo::ElementType::kC64;
}

hlo::ElementType CpuScalarElement(const at::Tensor& t, bool has_f64) {
  at::ScalarType st = t.scalar_type();
  if (st == at::kDouble && !has_f64) return hlo::ElementType::kF32;
  if (st == at::kComplexDouble && !has_f64) return hlo::ElementType::kC64;
  return lowering::ToElementType(st);
}

// Storage element type a tensor's storage has (or would get on first use).
hlo::ElementType StorageElement(const at::Tensor& t) {
  auto& s = StorageOf(t);
  return s.initialized() ? s.current().element : lowering::ToElementType(t.scalar_type());
}

bool IsScalarTypeArg(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::ScalarTypeType) return true;
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::ScalarTypeType;
  return false;
}

// Does the call compute in f64? A tpu f64 tensor of any rank (a 0-d one
// too: `t64 - 1.0000000001` computes in f64 on CPU), a `dtype=float64`
// argument (`full(..., dtype=float64)`), or float64 as the default dtype
// (an integer tensor combined with a float then gives f64). CPU 0-d tensors
// (wrapped Python numbers) do not count: they do not decide the dtype.
bool CallHasF64(const std::vector<c10::Argument>& args, const torch::jit::Stack& stack, size_t first) {
  if (c10::get_default_dtype_as_scalartype() == at::kDouble) return true;
  for (size_t i = first; i < first + args.size(); ++i) {
    const auto& v = stack[i];
    if (v.isTensor() && v.toTensor().defined() && (v.toTensor().dim() > 0 || OnTpu(v.toTensor())) &&
        (v.toTensor().scalar_type() == at::kDouble || v.toTensor().scalar_type() == at::kComplexDouble))
      return true;
    if (v.isInt() && IsScalarTypeArg(args[i - first].real_type()) &&
        static_cast<at::ScalarType>(v.toInt()) == at::kDouble)
      return true;
    if (v.isTensorList())
      for (const auto& t : v.toTensorList())
        if (static_cast<at::Tensor>(t).scalar_type() == at::kDouble ||
            static_cast<at::Tensor>(t).scalar_type() == at::kComplexDouble)
          return true;
  }
  return false;
}

bool IsTensorListValue(const c10::IValue& v) {
  if (v.isTensorList()) return true;
  if (!v.isList() || v.isIntList() || v.isDoubleList() || v.isBoolList()) return false;
  const auto& list = v.toListRef();
  return !list.empty() && (list[0].isTensor() || list[0].isNone());
}

// Appends a static argument's value to the key; throws UnsupportedOp for
// values that cannot be part of a key.
void AppendStatic(std::vector<int64_t>& atoms, const c10::IValue& v) {
  if (v.isNone()) {
    atoms.push_back(100);
  } else if (v.isBool()) {
    atoms.push_back(101);
    atoms.push_back(v.toBool());
  } else if (v.isInt()) {
    atoms.push_back(102);
    atoms.push_back(v.toInt());
  } else if (v.isSymInt()) {
    atoms.push_back(102);
    atoms.push_back(v.toSymInt().expect_int());
  } else if (v.isDouble()) {
    atoms.push_back(103);
    atoms.push_back(std::bit_cast<int64_t>(v.toDouble()));
  } else if (v.isIntList()) {
    atoms.push_back(104);
    auto l = v.toIntList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (int64_t x : l) atoms.push_back(x);
  } else if (v.isSymIntList()) {
    atoms.push_back(104);
    auto l = v.toSymIntList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (size_t j = 0; j < l.size(); ++j) atoms.push_back(static_cast<c10::SymInt>(l[j]).expect_int());
  } else if (v.isString()) {
    atoms.push_back(105);
    atoms.push_back(static_cast<int64_t>(std::hash<std::string_view>()(v.toStringView())));
  } else if (v.isDoubleList()) {
    atoms.push_back(106);
    auto l = v.toDoubleList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (double x : l) atoms.push_back(std::bit_cast<int64_t>(x));
  } else if (v.isBoolList()) {
    atoms.push_back(107);
    auto l = v.toBoolList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (bool x : l) atoms.push_back(x);
  } else if (v.isDevice()) {
    atoms.push_back(108);
    atoms.push_back(static_cast<int64_t>(v.toDevice().type()));
  } else if (v.isScalar()) {  // a Scalar compiled in as a constant
    atoms.push_back(109);
    auto s = v.toScalar();
    if (s.isComplex()) {  // toLong() would throw (linspace(1j, 2j, n))
      auto z = s.toComplexDouble();
      atoms.push_back(std::bit_cast<int64_t>(z.real()));
      atoms.push_back(std::bit_cast<int64_t>(z.imag()));
      atoms.push_back(2);
    } else {
      atoms.push_back(s.isFloatingPoint() ? std::bit_cast<int64_t>(s.toDouble()) : s.toLong());
      atoms.push_back(s.isFloatingPoint());
    }
  } else {
    throw UnsupportedOp("argument of type " + v.tagKind() + " is not supported by the tpu lowering path");
  }
}


// The bucket of extent n >= 1 of a shape family (OpCache::Lookup): the
// next power of two, at least 16 (as torch.compile's buckets, _dynamic.py)
// where `wide`, else Capacity(n). Capacity's eighth-octave steps cost a
// program per step: 9 buckets over issue 12's lengths 1..65 and 12 over a
// linear's 2..130 rows (a transformer block's 20 lengths: 322 compiles over
// two passes; powers of two: 172); buffers and compute are then under 2x
// the tensor's per dynamic dim for n > 16 (Capacity's: 12.5%). But a
// family read at its leading dim (nothing before it) with Capacity buckets
// reads and writes the very buffer an upload or an exact program gives its
// storage (Capacity of the numel); powers of two there made a DDP step's
// flat gradient buckets (9216, 262144, 264708 elements: bucket 524288)
// resize to the bucket and back every step, and compile new copy_ programs
// for four steps (test_dist_compile.py::test_ddp_optimizer). So `wide` is:
// the family's extents span an octave (a range of lengths, not a static
// set of shapes within one), and its buffers are not the storage's anyway
// (a multi-dim plan, dims before the dynamic one, or mm/addmm's rows,
// whose left matrix is a view of [b, t, d] activations).
int64_t PolyBucket(int64_t n, bool wide) {
  if (!wide) return Capacity(n);
  return n <= 16 ? 16 : static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(n)));
}

// The memory order of a dense, possibly permuted and expanded view that
// starts at its storage's first element: its dims of size > 1 and stride
// != 0, by stride descending, when they lay out a contiguous block (each
// stride the product of the sizes inside it); empty otherwise.
std::vector<int64_t> DenseOrder(const at::Tensor& t) {
  std::vector<int64_t> order;
  if (t.storage_offset() != 0) return order;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) != 0) order.push_back(d);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  int64_t expect = 1;
  for (size_t i = order.size(); i-- > 0;) {
    if (t.stride(order[i]) != expect) return {};
    expect *= t.size(order[i]);
  }
  return order;
}

// A read-only tensor of a multi-dim plan (PlanPolyMulti) as a box of a
// dense block that starts at its storage's first element: the view's dims
// of size > 1 and stride != 0 in memory order (outermost first), and per
// place the block's size along it — the next outer stride over this one
// (>= the view's size: a gap is a static block size), the view's size for
// the outermost — static, or the extent n (-1) where the view's dim is
// marked (bit d of `marks`) and its size and the block's are both n. The strides at any extent follow: view dim k's
// is c[k] * n^p[k] (the innermost stride times the block sizes inside it;
// 0 for expanded and size-1 dims), and the block holds numel_c * n^numel_p
// elements. q, k, v of attention (`split` of a [b, t, 3d] projection, then
// view and transpose) are boxes of the [b, t, 3d] block at offsets 0, d, 2d.
// Declines (false) a view that is not such a box, whose offset is not in
// the static part inside its innermost dynamic block dim (then it would
// not be one for every n), or that overlaps itself.
struct BoxLayout {
  std::vector<int64_t> order, block;
  std::vector<int64_t> c;
  std::vector<int> p;
  int64_t unit = 1, offset = 0, numel_c = 1;
  int numel_p = 0;
};

bool BoxOf(const at::Tensor& t, int64_t n, uint64_t marks, BoxLayout& box) {
  box = BoxLayout{};
  const int64_t rank = t.dim();
  box.c.assign(static_cast<size_t>(rank), 0);
  box.p.assign(static_cast<size_t>(rank), 0);
  box.offset = t.storage_offset();
  // At n = 1 the marked dims (size 1) have no stride of their own (a view
  // of a size-1 dim may carry any: view(2, 1, 4, 16) of a [2, 1, 64] slice
  // gives it 64 where n >= 2 gives 192). Each takes its place in memory
  // order by its stride (inside the dims of the same stride) and, as a
  // dynamic block of size n = 1, the stride of the dim outside it (vstride):
  // the box is the family's where the place is (AppendTensor keys it, so a
  // wrong place only misses), and the dims of size > 1 keep their own
  // strides as the formula's (c[k] * 1^p[k]), so a bucket program addresses
  // this view's elements.
  auto unit_mark = [&](int64_t d) { return n == 1 && ((marks >> d) & 1) && t.size(d) == 1; };
  for (int64_t d = 0; d < rank; ++d) {
    if (t.stride(d) < 0) return false;
    if ((t.size(d) > 1 && t.stride(d) != 0) || unit_mark(d)) box.order.push_back(d);
  }
  if (box.order.empty()) {  // one element, read by every index
    box.numel_c = box.offset + 1;
    return true;
  }
  std::stable_sort(box.order.begin(), box.order.end(), [&](int64_t a, int64_t b) {
    if (t.stride(a) != t.stride(b)) return t.stride(a) > t.stride(b);
    return !unit_mark(a) && unit_mark(b);
  });
  std::vector<int64_t> vstride(static_cast<size_t>(rank), 0);
  {
    // The outermost marked dims take the span of the first dim inside them.
    int64_t outside = 1;
    for (int64_t d : box.order)
      if (!unit_mark(d)) {
        outside = t.stride(d) * t.size(d);
        break;
      }
    for (int64_t d : box.order) {
      vstride[static_cast<size_t>(d)] = unit_mark(d) ? outside : t.stride(d);
      outside = vstride[static_cast<size_t>(d)];
    }
  }
  int64_t c = vstride[static_cast<size_t>(box.order.back())];
  int p = 0;
  box.unit = c;
  int64_t inner_extent = 0;  // elements the dims inside the innermost dynamic block dim span
  bool dynamic_seen = false;
  box.block.assign(box.order.size(), 0);
  for (size_t i = box.order.size(); i-- > 0;) {
    const auto d = static_cast<size_t>(box.order[i]);
    const int64_t size = t.size(static_cast<int64_t>(d)), stride = vstride[d];
    box.c[d] = c;
    box.p[d] = p;
    int64_t bs = size;
    if (i > 0) {
      const int64_t outer = vstride[static_cast<size_t>(box.order[i - 1])];
      if (outer % stride != 0 || outer / stride < size) return false;  // overlapping or not nested
      bs = outer / stride;
    }
    const bool dyn = ((marks >> d) & 1) && size == n && bs == n;
    box.block[i] = dyn ? -1 : bs;
    if (dyn) {
      if (!dynamic_seen && box.offset + inner_extent >= stride) return false;  // the offset is not inside
      dynamic_seen = true;
      ++p;
    } else {
      c *= bs;
    }
    if (!dynamic_seen) inner_extent += (size - 1) * stride;
  }
  box.numel_c = c;
  box.numel_p = p;
  if (!dynamic_seen && box.offset + inner_extent >= c) return false;  // static: inside the block
  return true;
}

// Whether argument `arg` (item `item` of a tensor list, or -1) is marked
// dynamic in a shape-polymorphic plan's `dynamic` span: 1 marks a tensor
// argument; 2 marks the (one) tensor-list argument, whose items' marks
// follow the arguments' (dynamic[num_args + item]).
bool PolyMarked(std::span<const int8_t> dynamic, size_t num_args, size_t arg, int64_t item) {
  if (arg >= dynamic.size() || arg >= num_args) return false;
  if (item < 0) return dynamic[arg] == 1;
  const size_t at = num_args + static_cast<size_t>(item);
  return dynamic[arg] == 2 && at < dynamic.size() && dynamic[at] != 0;
}

// `dynamic`: keyed with size(dim) = extent, without strides (a dynamic
// tensor is contiguous) and with whether t covers its storage's bytes
// (instead of their count), without the buffer's size: the program's
// parameter has the canonical size at the bucket (PolyBufferNumel) and a
// launch resizes any other buffer to it (GatherInputs).
// dim < 0 (PlanPolyFlat): keyed by `extent` alone, no rank or sizes.
// `runtime_offsets`: a nonzero storage offset keyed as -1 (an offset
// family's key; the program reads it at launch, InputSlot::kOffset).
// multi_n > 0 (PlanPolyMulti): the dims in `marks` (of size multi_n) are
// dynamic, keyed as -16 - extent.
void AppendTensor(std::vector<int64_t>& atoms, const at::Tensor& t, StorageIds& ids, bool dynamic = false,
                  int64_t extent = 0, int64_t dim = 0, bool runtime_offsets = false, int64_t multi_n = 0,
                  uint64_t marks = 0) {
  if (!ids.seen.empty() && ids.seen.front()->device_index() != StorageOf(t).device_index())
    throw std::runtime_error("Expected all tensors to be on the same device, but found at least two devices, tpu:" +
                             std::to_string(ids.seen.front()->device_index()) + " and " + t.device().str() + "!");
  atoms.push_back(static_cast<int64_t>(t.scalar_type()));
  if (dynamic && dim < 0) {  // flat
    atoms.push_back(-4);
    atoms.push_back(extent);
  } else {
    atoms.push_back(t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (dynamic && multi_n > 0) atoms.push_back((marks >> d) & 1 ? -16 - extent : t.size(d));
      else atoms.push_back(dynamic && d == dim ? extent : t.size(d));
    }
  }
  BoxLayout box;
  if (dynamic && multi_n > 0 && BoxOf(t, multi_n, marks, box)) {  // its box (PlanPolyMulti): order, static blocks, offset
    atoms.push_back(-6);
    for (size_t i = 0; i < box.order.size(); ++i) {
      atoms.push_back(box.order[i]);
      atoms.push_back(box.block[i]);
    }
    atoms.push_back(box.unit);
    atoms.push_back(-6);
  } else if (!dynamic) {
    for (int64_t s : t.strides()) atoms.push_back(s);
  } else if (t.is_contiguous()) {
    atoms.push_back(-3);
  } else {  // a permuted or expanded view (PlanPoly): its memory order, expanded dims -1
    const std::vector<int64_t> order = DenseOrder(t);
    for (int64_t d = 0; d < t.dim(); ++d) {
      auto at = std::find(order.begin(), order.end(), d);
      atoms.push_back(at != order.end() ? at - order.begin() : t.stride(d) == 0 && t.size(d) > 1 ? -1 : -2);
    }
  }
  atoms.push_back(runtime_offsets && t.storage_offset() != 0 ? -1 : t.storage_offset());
  if (dynamic) {
    atoms.push_back(-1);
    atoms.push_back(static_cast<int64_t>(StorageOf(t).nbytes()) == t.numel() * static_cast<int64_t>(t.element_size()));
  } else {
    atoms.push_back(StorageNumel(t));
    atoms.push_back(static_cast<int64_t>(StorageOf(t).nbytes()));  // WriteTensor: does a write cover it all?
  }
  atoms.push_back(static_cast<int64_t>(StorageElement(t)));
  atoms.push_back(ids.Id(&StorageOf(t)));
}

}  // namespace

bool HasOffsetView(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const size_t num_args = op.schema().arguments().size();
  auto offset = [](const c10::IValue& v) {
    if (!v.isTensor()) return false;
    const at::Tensor& t = v.toTensor();
    return t.defined() && OnTpu(t) && t.storage_offset() != 0;
  };
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& v = stack[first + i];
    if (offset(v)) return true;
    if (v.isTensorList() || v.isList())
      for (const auto& item : v.toListRef())
        if (offset(item)) return true;
  }
  return false;
}

int64_t StorageIds::Id(const DeviceStorage* s) {
  for (size_t i = 0; i < seen.size(); ++i)
    if (seen[i] == s) return static_cast<int64_t>(i);
  seen.push_back(s);
  return static_cast<int64_t>(seen.size() - 1);
}

void AppendCallKey(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                   const lowering::LoweringEntry& entry, std::vector<int64_t>& atoms, StorageIds& ids,
                   std::span<const int8_t> dynamic, int64_t extent, int64_t dim, bool runtime_offsets,
                   int64_t multi_n, std::span<const uint64_t> marks) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  bool has_f64 = CallHasF64(args, stack, first);
  // Ops read the default dtype (meta kernels, integer-to-float promotion).
  atoms.push_back(static_cast<int64_t>(c10::get_default_dtype_as_scalartype()));
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        atoms.push_back(1);
      } else if (OnTpu(t)) {
        atoms.push_back(2);
        const bool dyn = PolyMarked(dynamic, args.size(), i, -1);
        AppendTensor(atoms, t, ids, dyn, extent, dim, runtime_offsets, multi_n, i < marks.size() ? marks[i] : 0);
      } else if (t.dim() == 0 && t.device().is_cpu()) {
        atoms.push_back(3);
        atoms.push_back(static_cast<int64_t>(t.scalar_type()));
        atoms.push_back(static_cast<int64_t>(CpuScalarElement(t, has_f64)));
        atoms.push_back(t.unsafeGetTensorImpl()->is_wrapped_number());
      } else {
        DeviceMismatch(t);
      }
    } else if (v.isTensorList() || (v.isList() && args[i].type()->kind() == c10::TypeKind::ListType &&
                                    v.toListRef().size() > 0 &&
                                    (v.toListRef()[0].isTensor() || v.toListRef()[0].isNone()) &&
                                    !v.isIntList())) {
      atoms.push_back(4);
      const auto& list = v.toListRef();
      atoms.push_back(static_cast<int64_t>(list.size()));
      for (size_t j = 0; j < list.size(); ++j) {
        const auto& item = list[j];
        if (item.isNone() || !item.toTensor().defined()) {
          atoms.push_back(1);
          continue;
        }
        const at::Tensor& t = item.toTensor();
        if (!OnTpu(t)) DeviceMismatch(t);
        atoms.push_back(2);
        const bool dyn = PolyMarked(dynamic, args.size(), i, static_cast<int64_t>(j));
        AppendTensor(atoms, t, ids, dyn, extent, dim, runtime_offsets, multi_n, i < marks.size() ? marks[i] : 0);
      }
    } else if (v.isGenerator()) {
      atoms.push_back(5);
    } else if (v.isScalar() && IsScalarType(args[i].type()) && !entry.traits.static_scalars) {
      atoms.push_back(6);
      atoms.push_back(static_cast<int64_t>(ScalarElement(v.toScalar(), has_f64)));
    } else {
      atoms.push_back(7);
      AppendStatic(atoms, v);
    }
  }
}

namespace {

// The hash of a key's operator and atoms.
size_t KeyHash(const OpKey& key) {
  size_t h = std::hash<const void*>()(key.op);
  for (int64_t a : key.atoms) h = c10::hash_combine(h, std::hash<int64_t>()(a));
  return h;
}

// Fills `key` with the call's offset-family key: every nonzero storage
// offset as -1, after a leading -2 (neither a default dtype, which starts
// exact keys, nor -1, which starts shape-polymorphic ones).
void BuildOffsetKey(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                    const lowering::LoweringEntry& entry, OpKey& key) {
  key.op = &op.schema();
  key.atoms.clear();
  key.atoms.push_back(-2);
  StorageIds ids;
  AppendCallKey(op, stack, first, entry, key.atoms, ids, {}, 0, 0, /*runtime_offsets=*/true);
  key.hash = KeyHash(key);
}

// Fills `key` (reusing its storage: this runs for every op).
void BuildKey(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
              const lowering::LoweringEntry& entry, OpKey& key) {
  key.op = &op.schema();
  key.atoms.clear();
  StorageIds ids;
  AppendCallKey(op, stack, first, entry, key.atoms, ids);
  key.hash = KeyHash(key);
}

lowering::ViewLayout LayoutOf(const at::Tensor& t) {
  return {t.sizes().vec(), t.strides().vec(), t.storage_offset()};
}

at::Tensor ToMeta(const at::Tensor& t) {
  auto meta = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) meta.unsafeGetTensorImpl()->set_wrapped_number(true);
  return meta;
}

// Meta tensors for one call's tpu arguments: tensors over one storage get
// meta tensors over one meta storage, with their sizes, strides and offset,
// so that the meta kernels' memory-overlap checks (at::assert_no_overlap,
// assert_no_partial_overlap: "unsupported operation: some elements of the
// input tensor and the written-to tensor refer to a single memory
// location") see what CPU's kernels see. The key records which arguments
// share a storage, so the outcome holds for every call with that key.
class MetaArgs {
 public:
  at::Tensor Make(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1 || !t.has_storage()) return ToMeta(t);
    const void* impl = t.storage().unsafeGetStorageImpl();
    c10::Storage* storage = nullptr;
    for (auto& [k, s] : storages_)
      if (k == impl) storage = &s;
    if (!storage) {
      auto bytes = at::empty({static_cast<int64_t>(t.storage().nbytes())},
                             at::TensorOptions().dtype(at::kByte).device(c10::kMeta));
      storages_.emplace_back(impl, bytes.storage());
      storage = &storages_.back().second;
    }
    at::Tensor meta = at::empty({0}, t.options().device(c10::kMeta));
    meta.set_(*storage, t.storage_offset(), t.sizes(), t.strides());
    return meta;
  }

 private:
  std::vector<std::pair<const void*, c10::Storage>> storages_;
};

c10::IValue ToMetaValue(const c10::IValue& v, MetaArgs& metas) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return v;
    if (t.dim() == 0 && t.device().is_cpu()) return v;  // CPU scalars stay CPU scalars
    return metas.Make(t);
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const auto& t : v.toTensorList()) out.push_back(metas.Make(t));
    return out;
  }
  if (v.isList()) {
    const auto& list = v.toListRef();
    bool tensors = false;
    for (const auto& x : list) tensors |= x.isTensor();
    if (!tensors) return v;
    c10::List<std::optional<at::Tensor>> out;
    for (const auto& x : list) {
      if (x.isNone() || !x.toTensor().defined()) out.push_back(std::nullopt);
      else out.push_back(metas.Make(x.toTensor()));
    }
    return out;
  }
  if (v.isDevice()) return c10::Device(c10::kMeta);
  return v;
}

// Every compiled executable is portable across the client's devices.
pjrt::CompileOptions PortableOptions() {
  pjrt::CompileOptions o = Runtime::Get().compile_options();
  o.portable = true;
  return o;
}

// Eager single-op programs: on the XLA CPU plugin without its MLIR fusion
// emitters (xla_cpu_use_fusion_emitters=false: the elemental IR emitter,
// still LLVM -O2). A one-op program has nothing to fuse, and the fusion
// emitters set up an MLIR context per fusion, which the profile of a
// single-op compile shows as the largest share of its time (about 1.4x
// faster compiles, benchmarks/bench_first_op.py). XLA_FLAGS naming the flag
// wins. Part of the options, so of the disk-cache key.
pjrt::CompileOptions SingleOpOptions() {
  static const pjrt::CompileOptions options = [] {
    pjrt::CompileOptions o = PortableOptions();
    const char* flags = std::getenv("XLA_FLAGS");
    bool user_set = flags && std::string_view(flags).find("xla_cpu_use_fusion_emitters") != std::string_view::npos;
    if (Runtime::Get().client().platform_name() == "cpu" && !user_set)
      o.env_option_overrides.emplace_back("xla_cpu_use_fusion_emitters", "false");
    return o;
  }();
  return options;
}

bool DumpHlo() {
  static bool dump = [] {
    const char* e = std::getenv("TORCH_TPU_DUMP_HLO");
    return e && *e && std::string(e) != "0";
  }();
  return dump;
}

// A new output's strides as the meta kernel gives them, where they differ
// from row-major and describe a dense non-overlapping layout (a permutation
// of the dims: channels_last, a permuted input's TensorIterator order);
// anything else (and zero elements) is allocated contiguous, as before.
std::vector<int64_t> NewTensorStrides(const at::Tensor& mt) {
  if (!mt.defined() || mt.numel() == 0 || mt.storage_offset() != 0) return {};
  if (mt.strides() == c10::contiguous_strides(mt.sizes())) return {};
  if (!mt.is_non_overlapping_and_dense()) return {};
  return mt.strides().vec();
}

// The dims from outermost to innermost in memory for dense `strides`
// (size-1 dims, whose stride is free, keep their logical place).
std::vector<int64_t> PhysicalOrder(std::span<const int64_t> sizes, std::span<const int64_t> strides) {
  std::vector<int64_t> order(sizes.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = static_cast<int64_t>(d);
  std::vector<int64_t> big;  // dims of size > 1, outermost first
  for (int64_t d : order)
    if (sizes[static_cast<size_t>(d)] != 1) big.push_back(d);
  std::stable_sort(big.begin(), big.end(), [&](int64_t a, int64_t b) {
    return strides[static_cast<size_t>(a)] > strides[static_cast<size_t>(b)];
  });
  size_t k = 0;
  for (auto& d : order)
    if (sizes[static_cast<size_t>(d)] != 1) d = big[k++];
  return order;
}

}  // namespace

CallSpec ComputeSpec(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                     bool out_resized_by_numel, std::span<const int8_t> dynamic, int64_t extent, int64_t dim,
                     int64_t multi_n, std::span<const uint64_t> marks) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  // CPU 0-d tensors stay on the CPU for type promotion; meta kernels that
  // insist on one device get a second try with them on meta too.
  torch::jit::Stack meta_stack;
  for (int attempt = 0;; ++attempt) {
    meta_stack.clear();
    MetaArgs metas;
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::IValue& v = stack[first + i];
      if (out_resized_by_numel && IsOutArg(args[i]) && v.isTensor() && v.toTensor().defined()) {
        // An empty out: the meta kernel gives the natural output sizes
        // (and does not warn about resizing a tensor CPU would keep).
        meta_stack.push_back(at::empty({0}, v.toTensor().options().device(c10::kMeta)));
        continue;
      }
      // A dynamic tensor at the extent, in its memory order (a permuted
      // view's: the meta kernel then gives the output strides CPU would).
      auto at_extent = [&](const at::Tensor& t, uint64_t mark) {
        std::vector<int64_t> sizes = t.sizes().vec();
        if (dim < 0) return at::empty({extent}, t.options().device(c10::kMeta));  // flat (PlanPolyFlat)
        if (multi_n > 0) {  // PlanPolyMulti: its marked dims at the extent, strides of its box there
          for (size_t k = 0; k < sizes.size(); ++k)
            if ((mark >> k) & 1) sizes[k] = extent;
          BoxLayout box;
          if (t.is_contiguous() || !BoxOf(t, multi_n, mark, box))
            return at::empty(sizes, t.options().device(c10::kMeta));
          std::vector<int64_t> strides = t.strides().vec();  // size-1 and expanded dims keep theirs
          for (int64_t d : box.order) {
            int64_t stride = box.c[static_cast<size_t>(d)];
            for (int k = 0; k < box.p[static_cast<size_t>(d)]; ++k) stride *= extent;
            strides[static_cast<size_t>(d)] = stride;
          }
          return at::empty_strided(sizes, strides, t.options().device(c10::kMeta));
        } else {
          sizes[static_cast<size_t>(dim)] = extent;
        }
        const std::vector<int64_t> order = t.is_contiguous() ? std::vector<int64_t>{} : DenseOrder(t);
        if (order.empty()) return at::empty(sizes, t.options().device(c10::kMeta));
        std::vector<int64_t> strides = t.strides().vec();  // size-1 and expanded dims keep theirs
        int64_t stride = 1;
        for (size_t k = order.size(); k-- > 0;) {
          strides[static_cast<size_t>(order[k])] = stride;
          stride *= sizes[static_cast<size_t>(order[k])];
        }
        return at::empty_strided(sizes, strides, t.options().device(c10::kMeta));
      };
      if (PolyMarked(dynamic, args.size(), i, -1)) {  // a bucketed dim (shape polymorphism)
        meta_stack.push_back(at_extent(v.toTensor(), i < marks.size() ? marks[i] : 0));
        continue;
      }
      if (i < dynamic.size() && dynamic[i] == 2) {  // a tensor list with bucketed items (PlanPolyConcat)
        c10::List<at::Tensor> list;
        const auto& items = v.toListRef();
        for (size_t j = 0; j < items.size(); ++j)
          list.push_back(PolyMarked(dynamic, args.size(), i, static_cast<int64_t>(j))
                             ? at_extent(items[j].toTensor(), 0)
                             : metas.Make(items[j].toTensor()));
        meta_stack.push_back(list);
        continue;
      }
      meta_stack.push_back(attempt == 1 && v.isTensor() && v.toTensor().defined() && v.toTensor().is_cpu()
                               ? c10::IValue(ToMeta(v.toTensor()))
                               : ToMetaValue(v, metas));
    }
    try {
      // ATen's C++ meta kernel where the table has it (cpp_meta.h: the
      // dispatcher's Meta kernel is a Python one for most ops).
      CppMetaKernel cpp = FindCppMeta(op);
      if (!cpp || !cpp(meta_stack)) op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &meta_stack);
      break;
    } catch (const c10::Error& e) {
      if (attempt == 1) throw UnsupportedOp(std::string("no meta kernel result: ") + e.what_without_backtrace());
    } catch (const std::exception& e) {
      if (attempt == 1) throw UnsupportedOp(std::string("no meta kernel result: ") + e.what());
    }
  }
  const auto& returns = schema.returns();
  if (meta_stack.size() != returns.size()) throw UnsupportedOp("unexpected meta result count");

  std::vector<int16_t> out_args;
  for (size_t i = 0; i < args.size(); ++i)
    if (IsOutArg(args[i])) out_args.push_back(static_cast<int16_t>(i));
  CallSpec spec;
  spec.return_alias.assign(returns.size(), -1);
  size_t next_out = 0;
  for (size_t r = 0; r < returns.size(); ++r) {
    const auto& ret = returns[r];
    if (ret.type()->kind() != c10::TypeKind::TensorType)
      throw UnsupportedOp("returns a " + ret.type()->str() + ", not a Tensor");
    if (ret.alias_info()) {
      for (size_t i = 0; i < args.size(); ++i) {  // the argument with the same alias set
        const auto* ai = args[i].alias_info();
        if (ai && ai->isWrite() && ai->beforeSets() == ret.alias_info()->beforeSets()) {
          spec.return_alias[r] = static_cast<int16_t>(i);
          break;
        }
      }
      if (spec.return_alias[r] < 0 && next_out < out_args.size()) spec.return_alias[r] = out_args[next_out++];
      if (spec.return_alias[r] < 0) throw UnsupportedOp("returns a view of an input");
    }
    const at::Tensor& mt = meta_stack[r].toTensor();
    spec.defined.push_back(mt.defined());
    if (mt.defined()) spec.outputs.push_back({mt.scalar_type(), mt.sizes().vec()});
    else spec.outputs.push_back({at::kFloat, {}});  // placeholder: the lowering's value is dropped
    spec.strides.push_back(NewTensorStrides(mt));
  }
  // CPU's result dtypes where its kernel and the meta kernel differ
  // (LoweringTraits::result_dtypes); out= and in-place results keep their
  // tensor's dtype (below).
  if (const lowering::LoweringEntry* entry = lowering::FindLowering(BaseName(schema));
      entry && entry->traits.result_dtypes) {
    std::vector<at::ScalarType> dtypes;
    for (const auto& o : spec.outputs) dtypes.push_back(o.dtype);
    entry->traits.result_dtypes(std::span<const c10::IValue>(stack.data() + first, args.size()), dtypes);
    for (size_t r = 0; r < spec.outputs.size(); ++r)
      if (spec.defined[r]) spec.outputs[r].dtype = dtypes[r];
  }
  // out= tensors of other sizes are resized as PyTorch's resize_output does
  // (before every launch that shares the key); for `out_resized_by_numel`
  // ops only when the numel differs (AddCall then writes the values in the
  // out's logical order, keeping its shape and strides).
  for (size_t r = 0; r < returns.size(); ++r) {
    int16_t a = spec.return_alias[r];
    if (a < 0) continue;
    const at::Tensor& target = stack[first + static_cast<size_t>(a)].toTensor();
    // A dynamic out= or in-place tensor is at the extent there; a flat
    // program's is [extent] (PlanPolyFlat).
    std::vector<int64_t> target_sizes = target.sizes().vec();
    if (PolyMarked(dynamic, args.size(), static_cast<size_t>(a), -1)) {
      if (dim < 0) {
        target_sizes = {extent};
      } else if (multi_n > 0) {
        const uint64_t mark = static_cast<size_t>(a) < marks.size() ? marks[static_cast<size_t>(a)] : 0;
        for (size_t k = 0; k < target_sizes.size(); ++k)
          if ((mark >> k) & 1) target_sizes[k] = extent;
      } else {
        target_sizes[static_cast<size_t>(dim)] = extent;
      }
    }
    if (target_sizes != spec.outputs[r].sizes) {
      if (std::find(out_args.begin(), out_args.end(), a) == out_args.end())
        throw UnsupportedOp("in-place result has sizes " + c10::str(spec.outputs[r].sizes) +
                            " but the tensor has " + c10::str(target.sizes()));
      if (out_resized_by_numel && target.numel() == c10::multiply_integers(spec.outputs[r].sizes)) continue;
      spec.resize_outputs.emplace_back(a, spec.outputs[r].sizes);
      if (out_resized_by_numel) {  // a rare path: the registry says how CPU's kernel resizes
        const lowering::LoweringEntry* entry = lowering::FindLowering(BaseName(schema));
        spec.out_resize = entry && entry->traits.out_resize_warns ? OutResize::kArange : OutResize::kPlain;
      }
    }
    spec.outputs[r].dtype = target.scalar_type();
  }
  return spec;
}

void ResizeOuts(const std::vector<std::pair<int16_t, std::vector<int64_t>>>& resizes, OutResize rule,
                const torch::jit::Stack& stack, size_t first) {
  for (const auto& [arg, sizes] : resizes) {
    const at::Tensor& t = stack[first + static_cast<size_t>(arg)].toTensor();
    if (rule == OutResize::kResizeOutput) {
      at::native::resize_output(t, sizes);
      continue;
    }
    if (t.sizes() == at::IntArrayRef(sizes)) continue;  // resized already (the compile's ApplyResizes)
    const int64_t n = c10::multiply_integers(sizes);
    if (rule == OutResize::kArange && t.numel() > 0)
      TORCH_WARN("The number of elements in the out tensor of shape ", t.sizes(), " is ", t.numel(),
                 " which does not match the computed number of elements ", n,
                 ". Note that this may occur as a result of rounding error. "
                 "The out tensor will be resized to a tensor of shape (", n, ",).");
    t.resize_(sizes);
  }
}

void ApplyResizes(const CallSpec& spec, const torch::jit::Stack& stack, size_t first) {
  ResizeOuts(spec.resize_outputs, spec.out_resize, stack, first);
}

ProgramBuilder::StorageState& ProgramBuilder::StateFor(const at::Tensor& t, const InputSlot& use) {
  const DeviceStorage* s = &StorageOf(t);
  for (auto& st : storages)
    if (st.storage == s) return st;
  storages.push_back({s, use, StorageElement(t), StorageNumel(t), std::nullopt, std::nullopt});
  return storages.back();
}

hlo::Value ProgramBuilder::ReadFlat(StorageState& st) {
  if (st.current) return *st.current;
  if (!st.param) {
    st.input_index = static_cast<int32_t>(inputs.size());
    if (b.num_parameters() != inputs.size())
      throw std::logic_error("ProgramBuilder: parameters and inputs out of step");
    st.param = b.Parameter(hlo::TensorType{st.element, {st.numel}});
    InputSlot slot = st.first_use;
    slot.kind = InputSlot::Kind::kStorage;
    slot.element = st.element;
    slot.numel = st.numel;
    slot.canonical = st.poly;
    inputs.push_back(slot);
  }
  return *st.param;
}

namespace {

// The value rows past the extent hold for `fill` (PadFill): the identity of
// the reduction the op makes over them. Throws UnsupportedOp for an element
// type without one (complex max/min, u64's maximum).
hlo::Value FillConstant(hlo::Builder& b, hlo::ElementType e, lowering::PadFill fill, std::span<const int64_t> dims) {
  using lowering::PadFill;
  using E = hlo::ElementType;
  auto splat = [&](hlo::Value scalar) { return b.BroadcastInDim(scalar, dims, {}); };
  if (fill == PadFill::kZero || fill == PadFill::kOne) return lowering::Const(b, e, fill == PadFill::kOne ? 1 : 0, dims);
  const bool lowest = fill == PadFill::kLowest;
  if (hlo::IsFloating(e)) return lowering::Const(b, e, lowest ? -INFINITY : INFINITY, dims);
  if (e == E::kPred) return lowering::Const(b, e, lowest ? 0 : 1, dims);
  hlo::TensorType scalar{e, {}};
  switch (e) {
    case E::kS8: return splat(b.ConstantInt(scalar, lowest ? INT8_MIN : INT8_MAX));
    case E::kS16: return splat(b.ConstantInt(scalar, lowest ? INT16_MIN : INT16_MAX));
    case E::kS32: return splat(b.ConstantInt(scalar, lowest ? INT32_MIN : INT32_MAX));
    case E::kS64: return splat(b.ConstantInt(scalar, lowest ? INT64_MIN : INT64_MAX));
    case E::kU8: return splat(b.ConstantInt(scalar, lowest ? 0 : UINT8_MAX));
    case E::kU16: return splat(b.ConstantInt(scalar, lowest ? 0 : UINT16_MAX));
    case E::kU32: return splat(b.ConstantInt(scalar, lowest ? 0 : static_cast<int64_t>(UINT32_MAX)));
    default: throw UnsupportedOp("shape polymorphism: no padding value for this element type");
  }
}

}  // namespace

// At most this many outer slices (the product of the dims before the
// dynamic one) are moved by dynamic slices; more decline the family.
constexpr int64_t kMaxPolySlices = 64;

hlo::Value ProgramBuilder::PolyExtent() {
  if (!poly->extent) {
    if (b.num_parameters() != inputs.size()) throw std::logic_error("ProgramBuilder: parameters and inputs out of step");
    poly->extent = b.Parameter(hlo::TensorType{hlo::ElementType::kS64, {}});
    InputSlot slot;
    slot.kind = InputSlot::Kind::kExtent;
    slot.arg = poly->leader;
    slot.item = poly->leader_item;
    slot.element = hlo::ElementType::kS64;
    slot.extent_dim = static_cast<int8_t>(poly->dim);
    inputs.push_back(slot);
  }
  return *poly->extent;
}

// A contiguous tensor of sizes [outer, n, inner] lies in the buffer as
// `outer` runs of n * inner elements; at the bucket B each run is B * inner
// elements. Outer run o starts at o * n * inner (a runtime offset), so the
// read takes `outer` dynamic slices of B * inner elements (the flat buffer
// zero-padded to outer * B * inner first: every slice is in bounds, none
// clamped) and the write lays the runs back in increasing o, each one
// overwriting the previous run's tail past n * inner.
hlo::Value ProgramBuilder::PolyRead(hlo::Value flat, std::span<const int64_t> dims, int64_t dim) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= dims[static_cast<size_t>(d)];
  for (size_t d = static_cast<size_t>(dim) + 1; d < dims.size(); ++d) inner *= dims[d];
  const int64_t run = dims[static_cast<size_t>(dim)] * inner;
  hlo::Value padded = lowering::ResizeFlat(b, flat, outer * run);
  if (outer == 1) return b.Reshape(padded, dims);
  if (outer > kMaxPolySlices) throw UnsupportedOp("shape polymorphism: too many runs before the dynamic dim");
  hlo::TensorType index{hlo::ElementType::kS64, {}};
  hlo::Value step = b.Mul(PolyExtent(), b.ConstantInt(index, inner));  // n * inner
  std::vector<hlo::Value> runs;
  const int64_t sizes[] = {run};
  for (int64_t o = 0; o < outer; ++o) {
    hlo::Value start[] = {b.Mul(step, b.ConstantInt(index, o))};
    runs.push_back(b.DynamicSlice(padded, start, sizes));
  }
  return b.Reshape(b.Concatenate(runs, 0), dims);
}

bool ProgramBuilder::PolyDynamic(const InputSlot& use) const {
  if (!poly || use.arg < 0) return false;
  const size_t num_args = poly->dynamic.size() - poly->num_items;
  return PolyMarked(poly->dynamic, num_args, static_cast<size_t>(use.arg), use.item);
}

uint64_t ProgramBuilder::PolyMarks(const InputSlot& use) const {
  if (!poly || use.arg < 0 || use.item >= 0 || static_cast<size_t>(use.arg) >= poly->marks.size()) return 0;
  return poly->marks[static_cast<size_t>(use.arg)];
}

hlo::Value ProgramBuilder::PolyWrite(hlo::Value value, int64_t dim, int64_t scale, int64_t offset) {
  const std::vector<int64_t> dims = value.dims();
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= dims[static_cast<size_t>(d)];
  const int64_t numel = lowering::Numel(dims);
  int64_t flat_dims[] = {numel};
  hlo::Value flat = b.Reshape(value, flat_dims);
  if (outer == 1 || numel == 0) return flat;
  if (outer > kMaxPolySlices) throw UnsupportedOp("shape polymorphism: too many runs before the dynamic dim");
  const int64_t run = numel / outer;
  int64_t inner = 1;
  for (size_t d = static_cast<size_t>(dim) + 1; d < dims.size(); ++d) inner *= dims[d];
  hlo::TensorType index{hlo::ElementType::kS64, {}};
  hlo::Value rows = PolyExtent();
  if (scale != 1) rows = b.Mul(rows, b.ConstantInt(index, scale));
  if (offset != 0) rows = b.Add(rows, b.ConstantInt(index, offset));
  hlo::Value step = b.Mul(rows, b.ConstantInt(index, inner));  // (scale * n + offset) * inner
  hlo::Value out = flat;  // run 0 is in place; the others move down
  for (int64_t o = 1; o < outer; ++o) {
    int64_t start[] = {o * run}, limit[] = {(o + 1) * run}, stride[] = {1};
    hlo::Value at[] = {b.Mul(step, b.ConstantInt(index, o))};
    out = b.DynamicUpdateSlice(out, b.Slice(flat, start, limit, stride), at);
  }
  return out;
}

hlo::Value ProgramBuilder::ExtentTerm(int64_t c, int p) {
  hlo::TensorType index{hlo::ElementType::kS64, {}};
  hlo::Value v = b.ConstantInt(index, c);
  for (int i = 0; i < p; ++i) v = b.Mul(v, PolyExtent());
  return v;
}

// Multi-dim plans (PlanPolyMulti). t's elements at the runtime extent n lie
// in `flat` at offset + sum_k i_k * stride_k(n), where stride_k(n) =
// c_k * n^p_k is t's box's (BoxOf: the innermost stride times the block
// sizes inside dim k, p_k of them dynamic; 0 for expanded dims). The read
// gathers every position of the bucket-sized value at that index;
// positions past n along a marked dim read index 0 and are then replaced
// by 0 or the plan's fill. Every index of a real position is below the
// box's block at n, so in bounds of its canonical buffer at the bucket.
hlo::Value ProgramBuilder::MultiRead(const at::Tensor& t, hlo::Value flat, uint64_t marks) {
  const size_t rank = static_cast<size_t>(t.dim());
  std::vector<int64_t> dims = t.sizes().vec();
  for (size_t k = 0; k < rank; ++k)
    if ((marks >> k) & 1) dims[k] = poly->bucket;
  BoxLayout box;
  if (!BoxOf(t, poly->multi_n, marks, box)) throw std::logic_error("MultiRead: not a box (PlanPolyMulti checked)");
  const std::vector<int64_t>& c = box.c;
  const std::vector<int>& p = box.p;
  const hlo::TensorType index{hlo::ElementType::kS64, dims};
  hlo::Value idx = b.BroadcastInDim(b.ConstantInt(hlo::TensorType{hlo::ElementType::kS64, {}}, box.offset), dims, {});
  std::optional<hlo::Value> inside;
  for (size_t k = 0; k < rank; ++k) {
    if (dims[k] == 1) continue;
    hlo::Value iota = b.Iota(index, static_cast<int64_t>(k));
    if (c[k] != 0) idx = b.Add(idx, b.Mul(iota, b.BroadcastInDim(ExtentTerm(c[k], p[k]), dims, {})));
    if ((marks >> k) & 1) {
      hlo::Value in = b.Compare(iota, b.BroadcastInDim(PolyExtent(), dims, {}), hlo::CompareDirection::kLT);
      inside = inside ? b.And(*inside, in) : in;
    }
  }
  if (!inside) throw std::logic_error("MultiRead: a dynamic tensor without a dim of the extent");
  idx = b.Select(*inside, idx, b.BroadcastInDim(b.ConstantInt(hlo::TensorType{hlo::ElementType::kS64, {}}, 0), dims, {}));
  std::vector<int64_t> idx_dims = dims;
  idx_dims.push_back(1);
  hlo::GatherDims g;
  g.collapsed_slice_dims = {0};
  g.start_index_map = {0};
  g.index_vector_dim = static_cast<int64_t>(rank);
  const int64_t slice_sizes[] = {1};
  hlo::Value x = b.Gather(flat, b.Reshape(idx, idx_dims), g, slice_sizes, hlo::TensorType{flat.element(), dims});
  const lowering::PadFill fill = poly->fill == lowering::PadFill::kAny ? lowering::PadFill::kZero : poly->fill;
  return b.Select(*inside, x, FillConstant(b, x.element(), fill, dims));
}

// The inverse of MultiRead for a row-major value: flat position q < numel(n)
// is the element (q / s_k(n)) % size_k(n) along each dim k (s_k the
// row-major strides at n), gathered from the bucket-sized value.
hlo::Value ProgramBuilder::MultiWrite(hlo::Value value, uint64_t mask) {
  const std::vector<int64_t> dims = value.dims();
  const int64_t numel = lowering::Numel(dims);
  int64_t flat_dims[] = {numel};
  hlo::Value flat = b.Reshape(value, flat_dims);
  if (numel == 0) return flat;
  const hlo::TensorType index{hlo::ElementType::kS64, {numel}};
  auto splat = [&](hlo::Value scalar) { return b.BroadcastInDim(scalar, flat_dims, {}); };
  hlo::Value q = b.Iota(index, 0);
  hlo::Value src = splat(b.ConstantInt(hlo::TensorType{hlo::ElementType::kS64, {}}, 0));
  int64_t cc = 1, bucket_stride = 1;
  int pp = 0;
  for (size_t k = dims.size(); k-- > 0;) {
    const bool dyn = (mask >> k) & 1;
    if (dims[k] != 1) {
      hlo::Value i = b.Div(q, splat(ExtentTerm(cc, pp)));
      i = b.Rem(i, splat(dyn ? PolyExtent() : b.ConstantInt(hlo::TensorType{hlo::ElementType::kS64, {}}, dims[k])));
      src = b.Add(src, b.Mul(i, splat(b.ConstantInt(hlo::TensorType{hlo::ElementType::kS64, {}}, bucket_stride))));
    }
    bucket_stride *= dims[k];
    if (dyn) ++pp;
    else cc *= dims[k];
  }
  hlo::Value valid = b.Compare(q, splat(ExtentTerm(cc, pp)), hlo::CompareDirection::kLT);
  src = b.Select(valid, src, splat(b.ConstantInt(hlo::TensorType{hlo::ElementType::kS64, {}}, 0)));
  int64_t idx_dims[] = {numel, 1};
  hlo::GatherDims g;
  g.collapsed_slice_dims = {0};
  g.start_index_map = {0};
  g.index_vector_dim = 1;
  const int64_t slice_sizes[] = {1};
  return b.Gather(flat, b.Reshape(src, idx_dims), g, slice_sizes, hlo::TensorType{flat.element(), {numel}});
}

hlo::Value ProgramBuilder::PolyRows(const at::Tensor& t, hlo::Value flat, uint64_t marks) {
  if (poly->dim < 0) return PolyRead(flat, std::vector<int64_t>{poly->bucket}, 0);  // flat (PlanPolyFlat)
  if (poly->multi_n > 0) return MultiRead(t, flat, marks);
  std::vector<int64_t> dims = t.sizes().vec();
  dims[static_cast<size_t>(poly->dim)] = poly->bucket;
  hlo::Value x;
  if (t.is_contiguous()) {
    x = PolyRead(flat, dims, poly->dim);
  } else {
    // A permuted or expanded view (PlanPoly): the contiguous block in
    // memory order, transposed into the view's dim order, then broadcast
    // over its size-1 and expanded dims.
    const std::vector<int64_t> order = DenseOrder(t);
    std::vector<int64_t> block;
    int64_t at = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      block.push_back(dims[static_cast<size_t>(order[i])]);
      if (order[i] == poly->dim) at = static_cast<int64_t>(i);
    }
    hlo::Value mem = PolyRead(flat, block, at);
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> perm;
    for (int64_t d : sorted) perm.push_back(std::find(order.begin(), order.end(), d) - order.begin());
    x = b.BroadcastInDim(b.Transpose(mem, perm), dims, sorted);
  }
  if (poly->fill == lowering::PadFill::kAny) return x;
  hlo::Value row = b.Iota(hlo::TensorType{hlo::ElementType::kS64, dims}, poly->dim);
  hlo::Value n = b.BroadcastInDim(PolyExtent(), dims, {});
  return b.Select(b.Compare(row, n, hlo::CompareDirection::kLT), x, FillConstant(b, x.element(), poly->fill, dims));
}

int64_t ProgramBuilder::PolyBufferNumel(const at::Tensor& t, uint64_t marks) const {
  if (poly->dim < 0) return poly->bucket;  // flat (PlanPolyFlat): [bucket], bucket = Capacity(numel)
  if (poly->multi_n > 0) {  // its box's block at the bucket
    BoxLayout box;
    if (!BoxOf(t, poly->multi_n, marks, box)) throw std::logic_error("PolyBufferNumel: not a box (PlanPolyMulti checked)");
    int64_t numel = box.numel_c;
    for (int k = 0; k < box.numel_p; ++k) numel *= poly->bucket;
    return numel;
  }
  int64_t numel = 1;
  const std::vector<int64_t> order = t.is_contiguous() ? std::vector<int64_t>{} : DenseOrder(t);
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (!t.is_contiguous() && std::find(order.begin(), order.end(), d) == order.end()) continue;
    numel *= d == poly->dim ? Capacity(poly->bucket) : t.size(d);
  }
  return numel;
}

hlo::Value ProgramBuilder::ReadTensor(const at::Tensor& t, const InputSlot& use) {
  StorageState& st = StateFor(t, use);
  if (PolyDynamic(use)) {  // same element type: PlanPoly checked
    // The parameter is the canonical buffer at the bucket, whatever buffer
    // the storage has now (the launch resizes it): one program per bucket.
    const int64_t numel = PolyBufferNumel(t, PolyMarks(use));
    if (!st.param && !st.current) {
      st.numel = numel;
      st.poly = true;
    } else if (!st.poly || st.numel != numel) {
      throw UnsupportedOp("shape polymorphism: a storage read at two layouts");
    }
    return PolyRows(t, ReadFlat(st), PolyMarks(use));
  }
  if (st.poly) throw UnsupportedOp("shape polymorphism: a storage read with and without the dynamic dim");
  hlo::Value flat = lowering::ReinterpretFlat(b, ReadFlat(st), lowering::ToElementType(t.scalar_type()));
  lowering::ViewLayout layout = LayoutOf(t);
  if (const int64_t extent = RuntimeOffsetExtent(t, flat)) {
    hlo::Value start[] = {OffsetParam(use)};
    const int64_t sizes[] = {extent};
    flat = b.DynamicSlice(flat, start, sizes);
    layout.offset = 0;
  }
  return lowering::ReadView(b, flat, layout);
}

int64_t ProgramBuilder::RuntimeOffsetExtent(const at::Tensor& t, const hlo::Value& flat) const {
  if (!runtime_offsets || t.storage_offset() == 0 || t.numel() == 0) return 0;
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return 0;
    extent += (t.size(d) - 1) * t.stride(d);
  }
  // A view PyTorch made lies in its storage, so every offset of the family
  // has offset + extent <= the storage's elements; a storage read through
  // another element type (a reinterpreted flat) is checked the same way.
  if (extent > flat.dims()[0]) throw UnsupportedOp("offset family: the view's extent exceeds its storage");
  return extent;
}

hlo::Value ProgramBuilder::OffsetParam(const InputSlot& use) {
  for (const auto& [slot, value] : offsets_)
    if (slot.call == use.call && slot.arg == use.arg && slot.item == use.item) return value;
  if (b.num_parameters() != inputs.size()) throw std::logic_error("ProgramBuilder: parameters and inputs out of step");
  hlo::Value param = b.Parameter(hlo::TensorType{hlo::ElementType::kS64, {}});
  InputSlot slot = use;
  slot.kind = InputSlot::Kind::kOffset;
  slot.element = hlo::ElementType::kS64;
  slot.numel = -1;
  slot.canonical = false;
  inputs.push_back(slot);
  offsets_.emplace_back(slot, param);
  return param;
}

void ProgramBuilder::WriteTensor(const at::Tensor& t, const InputSlot& use, hlo::Value value) {
  StorageState& st = StateFor(t, use);
  if (poly) {
    // A dynamic tensor covering its storage (PlanPoly): the storage's new
    // buffer is the [bucket, rest...] rows, flat.
    if (!PolyDynamic(use)) throw UnsupportedOp("shape polymorphism: writes a tensor without the dynamic dim");
    if (poly->dim < 0) {  // flat (PlanPolyFlat): [bucket]
      const int64_t flat[] = {poly->bucket};
      st.current = PolyWrite(lowering::Prepare(b, value, t.scalar_type(), flat), 0);
      return;
    }
    std::vector<int64_t> dims = t.sizes().vec();
    if (poly->multi_n > 0) {  // PlanPolyMulti: contiguous, its marked dims at the bucket
      const uint64_t mask = PolyMarks(use);
      for (size_t k = 0; k < dims.size(); ++k)
        if ((mask >> k) & 1) dims[k] = poly->bucket;
      st.current = lowering::ResizeFlat(b, MultiWrite(lowering::Prepare(b, value, t.scalar_type(), dims), mask),
                                        PolyBufferNumel(t, mask));
      return;
    }
    dims[static_cast<size_t>(poly->dim)] = poly->bucket;
    // The canonical buffer at the bucket (PolyBufferNumel), as a new
    // dynamic output's: the storage's next readers at this bucket declare it.
    st.current = lowering::ResizeFlat(b, PolyWrite(lowering::Prepare(b, value, t.scalar_type(), dims), poly->dim),
                                      PolyBufferNumel(t, 0));
    return;
  }
  value = lowering::Prepare(b, value, t.scalar_type(), t.sizes().vec());
  const hlo::ElementType element = value.element();
  const int64_t numel = t.numel();
  const int64_t nbytes = static_cast<int64_t>(st.storage->nbytes());
  // t's elements span exactly the storage's bytes (not its buffer's
  // capacity: the padding past them is of no defined content).
  bool covers_all = t.is_contiguous() && t.storage_offset() == 0 &&
                    numel * static_cast<int64_t>(ElementSize(element)) == nbytes;
  if (covers_all && !st.current && !st.param) {
    int64_t dims[] = {numel};
    st.current = lowering::ResizeFlat(b, lowering::ReinterpretFlat(b, b.Reshape(value, dims), st.element), st.numel);
  } else {
    hlo::Value old = ReadFlat(st);
    hlo::Value flat = lowering::ReinterpretFlat(b, old, element);
    lowering::ViewLayout layout = LayoutOf(t);
    if (const int64_t extent = RuntimeOffsetExtent(t, flat)) {
      // The view's extent at the runtime offset, written at offset 0 and put back.
      hlo::Value start[] = {OffsetParam(use)};
      const int64_t sizes[] = {extent};
      layout.offset = 0;
      flat = b.DynamicUpdateSlice(flat, lowering::WriteView(b, b.DynamicSlice(flat, start, sizes), layout, value),
                                  start);
    } else {
      flat = lowering::WriteView(b, flat, layout, value);
    }
    hlo::Value updated = lowering::ReinterpretFlat(b, flat, st.element);
    const int64_t kept = updated.dims()[0];
    if (kept < st.numel) {
      // A wider view leaves a tail of the storage no element of it covers
      // (a complex view of an odd number of floats): keep the old tail.
      int64_t start[] = {kept}, limit[] = {st.numel}, stride[] = {1};
      hlo::Value parts[] = {updated, b.Slice(old, start, limit, stride)};
      updated = b.Concatenate(parts, 0);
    }
    st.current = updated;
  }
}

int32_t ProgramBuilder::AliasWrittenStorage(const StorageState& st, size_t result_index) {
  if (!st.param || !st.current || st.input_index < 0 || !(st.param->type == st.current->type)) return -1;
  b.AliasParameter(static_cast<size_t>(st.input_index), result_index);
  return st.input_index;
}

void ProgramBuilder::Define(const DeviceStorage* storage, hlo::ElementType element, int64_t numel,
                            hlo::Value flat) {
  for (auto& st : storages)
    if (st.storage == storage) throw std::logic_error("ProgramBuilder::Define: storage already known");
  storages.push_back({storage, InputSlot{}, element, numel, std::nullopt, std::move(flat)});
}

const char kEagerCheckWhere[] = " (found at the next sync point; TORCH_TPU_EAGER_MODE=debug stops at the op)";

void IndexRangeChecks(hlo::Builder& b, const std::string& name, const lowering::LoweringContext& ctx,
                      const lowering::LoweringEntry& entry, const std::string& where,
                      std::vector<ProgramCheck>& checks) {
  for (const auto& check : entry.traits.index_checks) {
    const LoweredArg* index = ctx.find(check.index);
    const LoweredArg* source = ctx.find(check.source);
    if (!index || !source || source->kind != LoweredArg::Kind::kTensor) continue;
    const auto& dims = source->value.dims();
    auto out_of_range = [&](const hlo::Value& idx, int64_t dim) -> std::optional<hlo::Value> {
      if (!hlo::IsSignedInteger(idx.element()) && !hlo::IsUnsignedInteger(idx.element())) return std::nullopt;
      if (idx.type.numel() == 0) return std::nullopt;
      int64_t n = dims.empty() ? 1 : dims[static_cast<size_t>(dim)];
      hlo::Value i = b.Convert(idx, hlo::ElementType::kS64);
      hlo::Value lo = lowering::ConstLike(b, i, check.allow_negative ? -static_cast<double>(n) : 0.0);
      hlo::Value hi = lowering::ConstLike(b, i, static_cast<double>(n));
      hlo::Value bad = b.Or(b.Compare(i, lo, hlo::CompareDirection::kLT), b.Compare(i, hi, hlo::CompareDirection::kGE));
      std::vector<int64_t> all(static_cast<size_t>(bad.rank()));
      for (size_t d = 0; d < all.size(); ++d) all[d] = static_cast<int64_t>(d);
      return lowering::ReduceOr(b, bad, all, false);
    };
    auto add = [&](const hlo::Value& idx, int64_t dim) {
      if (auto bad = out_of_range(idx, dim)) {
        std::string message = name + ": index out of range for dimension " + std::to_string(dim) + " with size " +
                              std::to_string(dims.empty() ? 1 : dims[dim]) + where;
        checks.emplace_back(*bad, check.runtime_error ? Runtime::ValueCheckMessage(message) : message);
      }
    };
    if (index->kind == LoweredArg::Kind::kTensor) {
      int64_t dim = 0;
      if (!check.dim_arg.empty() && ctx.has(check.dim_arg))
        dim = lowering::NormalizeDim(ctx.int_arg(check.dim_arg), static_cast<int64_t>(dims.size()));
      add(index->value, dim);
    } else if (index->kind == LoweredArg::Kind::kTensorList) {
      for (size_t j = 0; j < index->list.size() && j < dims.size(); ++j)
        if (index->present[j]) add(index->list[j], static_cast<int64_t>(j));
    }
  }
}

void LoweringChecks(const std::string& name, const lowering::LoweringContext& ctx, const std::string& where,
                    std::vector<ProgramCheck>& checks) {
  for (const auto& [bad, message] : ctx.checks)
    checks.emplace_back(bad, Runtime::ValueCheckMessage(name + ": " + message + where));
  for (const auto& [bad, message] : ctx.index_errors)  // raised as IndexError
    checks.emplace_back(bad, name + ": " + message + where);
}

std::vector<std::optional<hlo::Value>> ProgramBuilder::AddCall(int32_t call, const c10::OperatorHandle& op,
                                                                const torch::jit::Stack& stack, size_t first,
                                                                const lowering::LoweringEntry& entry,
                                                                const CallSpec& spec) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const std::string name = schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
  bool has_f64 = CallHasF64(args, stack, first);
  lowering::LoweringContext ctx(b, schema);
  bool poly_list = false;  // a tensor list with items at the bucket (PlanPolyConcat)
  auto slot = [&](InputSlot::Kind kind, int16_t arg, int16_t item, hlo::ElementType e) {
    InputSlot s;
    s.kind = kind;
    s.call = call;
    s.arg = arg;
    s.item = item;
    s.element = e;
    return s;
  };

  for (size_t i = 0; i < args.size(); ++i) {
    const c10::Argument& a = args[i];
    const c10::IValue& v = stack[first + i];
    int16_t ai = static_cast<int16_t>(i);
    if (IsOutArg(a)) continue;
    LoweredArg la;
    la.name = a.name();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        la.kind = LoweredArg::Kind::kNone;
      } else if (OnTpu(t)) {
        la.kind = LoweredArg::Kind::kTensor;
        la.dtype = t.scalar_type();
        la.contiguous = t.is_contiguous();
        la.value = ReadTensor(t, slot(InputSlot::Kind::kStorage, ai, -1, hlo::ElementType::kF32));
      } else {
        la.kind = LoweredArg::Kind::kScalar;
        hlo::ElementType e = CpuScalarElement(t, has_f64);
        la.value = b.Parameter(hlo::TensorType{e, {}});
        // complex32 is u32 bits on the device (not UInt32): kept so that
        // lowering::Complex32Supported sends the call to the CPU.
        la.dtype = t.scalar_type() == at::kComplexHalf ? at::kComplexHalf : lowering::ToScalarType(e);
        la.wrapped_number = t.unsafeGetTensorImpl()->is_wrapped_number();
        inputs.push_back(slot(InputSlot::Kind::kScalar, ai, -1, e));
      }
    } else if (IsTensorListValue(v)) {
      la.kind = LoweredArg::Kind::kTensorList;
      const auto& list = v.toListRef();
      for (size_t j = 0; j < list.size(); ++j) {
        if (list[j].isNone() || !list[j].toTensor().defined()) {
          la.list.push_back(hlo::Value{});
          la.present.push_back(false);
        } else {
          const InputSlot use = slot(InputSlot::Kind::kStorage, ai, static_cast<int16_t>(j), hlo::ElementType::kF32);
          la.list.push_back(ReadTensor(list[j].toTensor(), use));
          la.present.push_back(true);
          if (PolyDynamic(use)) {
            la.dynamic_items.resize(list.size(), false);
            la.dynamic_items[j] = true;
          }
        }
      }
      // The items' runtime extent (after every argument's parameter).
      if (!la.dynamic_items.empty()) poly_list = true;
    } else if (v.isGenerator() || (v.isNone() && a.type()->str().find("Generator") != std::string::npos)) {
      la.kind = LoweredArg::Kind::kNone;
    } else if (v.isScalar() && IsScalarType(a.type()) && !entry.traits.static_scalars) {
      la.kind = LoweredArg::Kind::kScalar;
      hlo::ElementType e = ScalarElement(v.toScalar(), has_f64);
      la.value = b.Parameter(hlo::TensorType{e, {}});
      la.dtype = lowering::ToScalarType(e);
      la.wrapped_number = true;
      inputs.push_back(slot(InputSlot::Kind::kScalar, ai, -1, e));
    } else if (v.isNone()) {
      la.kind = LoweredArg::Kind::kNone;
      la.ivalue = v;
    } else {
      la.kind = LoweredArg::Kind::kStatic;
      la.ivalue = v;
    }
    ctx.args.push_back(std::move(la));
  }
  if (entry.traits.needs_rng) {
    int16_t gen_arg = -1;
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].type()->str().find("Generator") != std::string::npos) gen_arg = static_cast<int16_t>(i);
    ctx.rng_state_value = b.Parameter(hlo::TensorType{hlo::ElementType::kU64, {2}});
    InputSlot s = slot(InputSlot::Kind::kRng, gen_arg, -1, hlo::ElementType::kU64);
    s.rng_increment = lowering::LoweringContext::RngIncrement(spec.outputs);
    // A flat program's outputs are at the bucket: the launch's numel counts.
    if (poly && poly->dim < 0) s.rng_numel_of = poly->leader;
    inputs.push_back(s);
  }
  ctx.outputs = spec.outputs;
  if (poly_list) {
    if (!entry.traits.poly_concat) throw UnsupportedOp("shape polymorphism: a tensor list for an op without offsets");
    ctx.poly_extent = PolyExtent();
    ctx.poly_dim = poly->dim;
  }
  if (!lowering::DtypesSupported(entry, ctx))
    throw UnsupportedOp(name + ": no complex/float8 lowering (runs on the CPU)");
  IndexRangeChecks(b, name, ctx, entry, kEagerCheckWhere, index_checks);

  std::vector<hlo::Value> results;
  try {
    results = entry.fn(ctx);
  } catch (const lowering::LoweringError& e) {
    throw UnsupportedOp(e.what());
  } catch (const hlo::BuildError& e) {
    throw UnsupportedOp("lowering of " + name + " failed: " + e.what());
  }
  LoweringChecks(name, ctx, kEagerCheckWhere, index_checks);
  if (results.size() != spec.outputs.size())
    throw std::logic_error("lowering of " + name + " returned " + std::to_string(results.size()) + " values for " +
                           std::to_string(spec.outputs.size()) + " returns");

  std::vector<std::optional<hlo::Value>> new_values(results.size());
  for (size_t r = 0; r < results.size(); ++r) {
    int16_t a = spec.return_alias[r];
    if (!spec.defined[r]) continue;
    if (a >= 0) {
      const at::Tensor& target = stack[first + static_cast<size_t>(a)].toTensor();
      hlo::Value value = results[r];
      // An out= kept at its shape (ComputeSpec, out_resized_by_numel). Not
      // a flat program's [bucket] value (PlanPolyFlat), whose numel can
      // equal its target's when the numel is a bucket (a [4, 4] draw).
      if (!(poly && poly->dim < 0) && value.dims() != target.sizes().vec() && value.type.numel() == target.numel() &&
          target.numel() > 0)
        value = b.Reshape(value, target.sizes().vec());
      WriteTensor(target, slot(InputSlot::Kind::kStorage, a, -1, hlo::ElementType::kF32), value);
      continue;
    }
    const auto& out = spec.outputs[r];
    hlo::Value v = lowering::Cast(b, results[r], out.dtype);
    if (v.dims() != out.sizes) {
      int64_t n = 1;
      for (int64_t d : out.sizes) n *= d;
      v = n == v.type.numel() ? b.Reshape(v, out.sizes) : lowering::BroadcastTo(b, v, out.sizes);
    }
    // The new tensor's strides (CallSpec::strides): its values in memory
    // order, so the flat buffer is that layout.
    if (r < spec.strides.size() && !spec.strides[r].empty()) {
      std::vector<int64_t> order = PhysicalOrder(out.sizes, spec.strides[r]);
      bool identity = true;
      for (size_t d = 0; d < order.size(); ++d) identity = identity && order[d] == static_cast<int64_t>(d);
      if (!identity) v = b.Transpose(v, order);
    }
    new_values[r] = v;
  }
  for (auto& [arg_name, value] : ctx.writes) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].name() != arg_name) continue;
      WriteTensor(stack[first + i].toTensor(),
                  slot(InputSlot::Kind::kStorage, static_cast<int16_t>(i), -1, hlo::ElementType::kF32), value);
    }
  }
  return new_values;
}

std::unique_ptr<pjrt::Executable> CompileModule(const std::string& name, const std::string& module_text,
                                                bool single_op, bool count) {
  if (DumpHlo()) std::cerr << "[torch_tpu] " << name << ":\n" << module_text;
  auto& rt = Runtime::Get();
  auto start = std::chrono::steady_clock::now();
  std::unique_ptr<pjrt::Executable> exe;
  ProfileScope profile("tpu::compile", name);  // torch.profiler event
  try {
    exe = DiskCache::Get().LoadOrCompile(rt.client(), module_text, single_op ? SingleOpOptions() : PortableOptions());
  } catch (const pjrt::Error& e) {
    throw std::runtime_error("tpu: compiling " + name + " failed: " + e.what() + "\nmodule:\n" + module_text);
  }
  if (count) rt.metrics().compiles++;
  rt.metrics().compile_time_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return exe;
}

namespace {

// How a call runs on a bucketed dim (PlanPoly).
struct PolyPlan {
  std::vector<int8_t> dynamic;  // per argument: a tensor whose dim `dim` is the extent (PolyMarked)
  size_t num_items = 0;         // list-item marks after the arguments' (PlanPolyConcat)
  int16_t leader = -1;          // the argument the extent is read from at launch
  int16_t leader_item = -1;     // its item, where it is a tensor list
  int64_t dim = 0;              // the dynamic dim of the highest-rank tensors
  int64_t extent = 0;           // this call's
  int64_t bucket = 0;           // Capacity(extent)
  int64_t rows_scale = 1;       // cat: bucketed by its output's rows_scale * extent + rows_offset
  int64_t rows_offset = 0;
  int64_t multi_n = 0;          // > 0: a multi-dim plan (PlanPolyMulti), extent = multi_n
  std::vector<uint64_t> marks;  // multi-dim: per argument, its dynamic dims (of size extent)
};

// The highest rank among the call's tpu tensors (0: none, or a tensor-list
// argument, which PlanPoly does not take) and the first argument of that
// rank (an out= tensor counts: PlanPoly treats it as any written tensor).
int64_t PolyRank(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first, int16_t& leader) {
  const auto& args = op.schema().arguments();
  int64_t rank = 0;
  leader = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (IsTensorListValue(v)) return 0;
    if (!v.isTensor() || !v.toTensor().defined() || !OnTpu(v.toTensor())) continue;
    if (v.toTensor().dim() > rank) {
      rank = v.toTensor().dim();
      leader = static_cast<int16_t>(i);
    }
  }
  return rank;
}

// Whether the call can share a program with calls that differ in dim `dim`
// of its highest-rank tensors, and how: its entry is shape_poly, no
// tensor-list argument; the tpu tensors of the highest rank R > dim have
// size(dim) equal to the leader's n >= 1 (dynamic: contiguous, offset 0,
// typed as their storage, and covering it if written) or 1 (broadcast);
// lower-rank tensors are static and, where they reach dim `dim` (trailing
// alignment), have size 1 there; every written tensor (in place or out=)
// is dynamic, so an out= needing a resize at one n needs it at every n and
// declines (PolySpec). n = 0
// stays static (meta kernels raise for empty reductions). Broadcast
// validity is then the same for every n (so a hit needs no meta kernel).
bool PlanPoly(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
              const lowering::LoweringEntry& entry, int64_t dim, PolyPlan& plan) {
  if (entry.traits.shape_poly == lowering::PadFill::kNone || entry.traits.needs_rng) return false;
  const auto& args = op.schema().arguments();
  int16_t leader = -1;
  const int64_t rank = PolyRank(op, stack, first, leader);
  if (rank <= dim) return false;
  if (entry.traits.poly_batch_dims) {  // layer norm: never a normalized dim
    int64_t normalized = -1;
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].name() == "normalized_shape" && stack[first + i].isIntList())
        normalized = static_cast<int64_t>(stack[first + i].toIntList().size());
    if (normalized < 0 || dim >= rank - normalized) return false;
  }
  const int64_t n = stack[first + static_cast<size_t>(leader)].toTensor().size(dim);
  if (n < 1) return false;
  plan.dynamic.assign(args.size(), 0);
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (!v.isTensor() || !v.toTensor().defined() || !OnTpu(v.toTensor())) {
      if (written) return false;
      continue;
    }
    const at::Tensor& t = v.toTensor();
    if (t.dim() == rank && t.size(dim) == n) {
      if (t.storage_offset() != 0 || t.is_conj() || t.is_neg() ||
          StorageElement(t) != lowering::ToElementType(t.scalar_type()))
        return false;
      if (!t.is_contiguous()) {
        // A permuted or expanded view of a contiguous block (read only):
        // n >= 2 so that the dynamic dim has its place in memory order.
        if (written || n < 2) return false;
        const std::vector<int64_t> order = DenseOrder(t);
        if (std::find(order.begin(), order.end(), dim) == order.end()) return false;
      }
      if (written && static_cast<int64_t>(StorageOf(t).nbytes()) != t.numel() * static_cast<int64_t>(t.element_size()))
        return false;
      plan.dynamic[i] = 1;
    } else if (written || (t.dim() == rank && t.size(dim) != 1)) {
      return false;
    } else if (t.dim() < rank && t.dim() > 0 && rank - t.dim() <= dim && t.size(dim - (rank - t.dim())) != 1) {
      return false;  // a lower-rank tensor spanning the dynamic dim
    }
  }
  plan.leader = leader;
  plan.dim = dim;
  plan.extent = n;
  plan.bucket = Capacity(n);  // PolyBucket's rule, once the family is known (OpCache::Lookup)
  return true;
}

// Whether the call can share a program with calls whose marked dims, all
// of one size n >= 2, change together, where PlanPoly's one dim does not
// cover them: a [t, t] mask, the [b, h, t, t] scores of attention, bmm's
// [b, t, d] @ [b, d, t] and [b, t, t] @ [b, t, d], and read-only views
// PlanPoly declines (boxes with gaps or at an offset: attention's q, k, v).
// n is the leader's size(leader_dim), skipped where an earlier dim of the
// leader has it (one candidate per size). The marked dims are subset
// `subset` (of *num_subsets, set here: all dims of size n first, then
// smaller subsets; every one for at most 6 such dims) of the tpu tensors'
// dims of size n (`PolyPlan::marks`); the leader has one. A tensor with a
// marked dim is dynamic (typed as its storage; written ones contiguous at
// offset 0 and covering their storage; read-only ones a box, BoxOf), the
// others static, and a written tensor must be dynamic. A static dim of
// size n left unmarked keys as n: the family of the lengths where it is
// not n (batch 2 at n = 2). PolySpec's meta kernels at the bucket and
// bucket + 1 decline a marking the op's shape rules reject (bmm's
// [8, 16, 16] @ [8, 16, n] with all four marked); shape rules are
// equalities and broadcasts between dims, so holding at two extents they
// hold at every n. Not for layer norm (poly_batch_dims), cat, mm/addmm or
// flat plans, nor for a marking PlanPoly takes (one dim, at the same place
// from the end, in every dynamic tensor, each a dense view at offset 0).
bool PlanPolyMulti(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                   const lowering::LoweringEntry& entry, int64_t leader_dim, size_t subset, PolyPlan& plan,
                   size_t* num_subsets) {
  *num_subsets = 0;
  if (entry.traits.shape_poly == lowering::PadFill::kNone || entry.traits.needs_rng || entry.traits.poly_flat ||
      entry.traits.poly_concat || entry.traits.poly_matmul || entry.traits.poly_batch_dims)
    return false;
  const auto& args = op.schema().arguments();
  int16_t leader = -1;
  const int64_t rank = PolyRank(op, stack, first, leader);
  if (rank <= leader_dim || rank >= 64) return false;
  const at::Tensor& lt = stack[first + static_cast<size_t>(leader)].toTensor();
  const int64_t n = lt.size(leader_dim);
  if (n < 1) return false;
  for (int64_t d = 0; d < leader_dim; ++d)
    if (lt.size(d) == n) return false;  // the same candidate as an earlier dim
  // Every (argument, dim) of size n, in order; the subset marks some of them.
  std::vector<std::pair<size_t, int64_t>> all;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (!v.isTensor() || !v.toTensor().defined() || !OnTpu(v.toTensor())) continue;
    for (int64_t d = 0; d < v.toTensor().dim(); ++d)
      if (v.toTensor().size(d) == n) all.emplace_back(i, d);
  }
  // Subsets by decreasing size, all of them first; every one for at most
  // kMaxSubsetDims dims of size n (63 subsets), else all of them only.
  constexpr size_t kMaxSubsetDims = 6;
  static const auto* subset_orders = [] {
    auto* orders = new std::vector<std::vector<uint64_t>>(kMaxSubsetDims + 1);
    for (size_t bits = 0; bits <= kMaxSubsetDims; ++bits) {
      auto& order = (*orders)[bits];
      for (uint64_t m = (uint64_t{1} << bits) - 1; m > 0; --m) order.push_back(m);
      std::stable_sort(order.begin(), order.end(),
                       [](uint64_t a, uint64_t b) { return std::popcount(a) > std::popcount(b); });
    }
    return orders;
  }();
  const size_t k = all.size();
  *num_subsets = k <= kMaxSubsetDims ? (size_t{1} << k) - 1 : 1;
  if (subset >= *num_subsets) return false;
  const uint64_t chosen = k <= kMaxSubsetDims ? (*subset_orders)[k][subset] : (uint64_t{1} << std::min<size_t>(k, 63)) - 1;
  plan.marks.assign(args.size(), 0);
  for (size_t j = 0; j < k; ++j)
    if ((chosen >> j) & 1) plan.marks[all[j].first] |= uint64_t{1} << all[j].second;
  if (plan.marks[static_cast<size_t>(leader)] == 0) return false;  // the extent is read from the leader
  plan.dynamic.assign(args.size(), 0);
  std::optional<int64_t> single;  // the one dim from the end every dynamic tensor has, if any
  bool multi = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (!v.isTensor() || !v.toTensor().defined() || !OnTpu(v.toTensor())) {
      if (written) return false;
      continue;
    }
    const at::Tensor& t = v.toTensor();
    const uint64_t marks = plan.marks[i];
    if (marks == 0) {
      if (written) return false;
      continue;
    }
    const int64_t lowest = std::countr_zero(marks);
    if (std::popcount(marks) > 1 || (single && *single != t.dim() - lowest)) multi = true;
    single = t.dim() - lowest;
    if (t.is_conj() || t.is_neg() || StorageElement(t) != lowering::ToElementType(t.scalar_type())) return false;
    if (written && (!t.is_contiguous() || t.storage_offset() != 0)) return false;
    BoxLayout box;
    if (!BoxOf(t, n, marks, box)) return false;
    // A view PlanPoly does not take (a box with gaps or at an offset: q, k
    // and v of attention) makes the plan this one's even with one dim.
    if (t.storage_offset() != 0 || (!t.is_contiguous() && DenseOrder(t).empty())) multi = true;
    if (written && static_cast<int64_t>(StorageOf(t).nbytes()) != t.numel() * static_cast<int64_t>(t.element_size()))
      return false;
    plan.dynamic[i] = 1;
  }
  if (!multi) return false;
  plan.leader = leader;
  plan.dim = std::countr_zero(plan.marks[static_cast<size_t>(leader)]);
  plan.extent = n;
  plan.bucket = Capacity(n);  // PolyBucket's rule, once the family is known (OpCache::Lookup)
  plan.multi_n = n;
  return true;
}

// Whether an mm/addmm call (LoweringTraits::poly_matmul) can share a
// program with calls that differ in the rows n >= 1 of its left matrix
// (mm's self, addmm's mat1): that matrix is dynamic along dim 0 (offset 0,
// typed as its storage; contiguous, or for n >= 2 a read-only permuted
// view whose rows have a place in memory order, as in PlanPoly); the right
// matrix is static (its rows are the contraction, never padded); addmm's
// bias is static and must not span the rows (rank <= 1, or one row). No
// out= and no written argument. Matrix shape validity is then the same
// for every n. The padding rows of the left matrix (PadFill::kAny: zeros
// or stale elements) reach only the output's padding rows.
bool PlanPolyMatmul(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                    const lowering::LoweringEntry& entry, PolyPlan& plan) {
  if (!entry.traits.poly_matmul) return false;
  const auto& args = op.schema().arguments();
  int16_t left = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    if (IsOutArg(args[i]) || (args[i].alias_info() && args[i].alias_info()->isWrite())) return false;
    if (args[i].name() == "mat1") left = static_cast<int16_t>(i);
  }
  if (left < 0) {  // mm(self, mat2)
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].name() == "self") left = static_cast<int16_t>(i);
  }
  if (left < 0) return false;
  const c10::IValue& lv = stack[first + static_cast<size_t>(left)];
  if (!lv.isTensor() || !lv.toTensor().defined() || !OnTpu(lv.toTensor())) return false;
  const at::Tensor& a = lv.toTensor();
  if (a.dim() != 2) return false;
  const int64_t n = a.size(0);
  if (n < 1 || a.storage_offset() != 0 || a.is_conj() || a.is_neg() ||
      StorageElement(a) != lowering::ToElementType(a.scalar_type()))
    return false;
  if (!a.is_contiguous()) {
    if (n < 2) return false;
    const std::vector<int64_t> order = DenseOrder(a);
    if (std::find(order.begin(), order.end(), 0) == order.end()) return false;
  }
  plan.dynamic.assign(args.size(), 0);
  for (size_t i = 0; i < args.size(); ++i) {
    if (static_cast<int16_t>(i) == left) continue;
    const c10::IValue& v = stack[first + i];
    if (!v.isTensor() || !v.toTensor().defined() || !OnTpu(v.toTensor())) continue;
    const at::Tensor& t = v.toTensor();
    if (args[i].name() == "self" && t.dim() == 2 && t.size(0) != 1) return false;  // addmm's bias spans the rows
    if (t.dim() > 2) return false;
  }
  plan.dynamic[static_cast<size_t>(left)] = 1;
  plan.leader = left;
  plan.dim = 0;
  plan.extent = n;
  plan.bucket = Capacity(n);  // PolyBucket's rule, once the family is known (OpCache::Lookup)
  return true;
}

// Whether a cat call can share a program with calls that differ in the
// size of some of its items along the cat dim d: the items of the highest
// rank R with the largest size n >= 1 there are dynamic (contiguous, or a
// read-only permuted/expanded view for n >= 2 as in PlanPoly; offset 0;
// typed as their storage), the others static (any size along d; a legacy
// empty 1-d item is skipped by cat). cat's shape rules (equal sizes off
// the cat dim, one rank) hold for every n once they hold for one, so a hit
// runs no meta kernel. No out=.
bool PlanPolyConcat(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                    const lowering::LoweringEntry& entry, PolyPlan& plan) {
  if (!entry.traits.poly_concat) return false;
  const auto& args = op.schema().arguments();
  int16_t list_arg = -1;
  int64_t cat_dim = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (IsOutArg(args[i])) return false;
    if (IsTensorListValue(v)) list_arg = static_cast<int16_t>(i);
    else if (args[i].name() == "dim" && v.isInt()) cat_dim = v.toInt();
  }
  if (list_arg < 0) return false;
  const auto& items = stack[first + static_cast<size_t>(list_arg)].toListRef();
  int64_t rank = 0;
  for (const auto& item : items) {
    if (!item.isTensor() || !item.toTensor().defined() || !OnTpu(item.toTensor())) return false;
    rank = std::max<int64_t>(rank, item.toTensor().dim());
  }
  if (rank == 0) return false;
  if (cat_dim < -rank || cat_dim >= rank) return false;  // the static path raises CPU's error
  const int64_t dim = cat_dim < 0 ? cat_dim + rank : cat_dim;
  int64_t n = 0;
  int16_t leader_item = -1;
  for (size_t j = 0; j < items.size(); ++j) {
    const at::Tensor& t = items[j].toTensor();
    if (t.dim() == rank && t.size(dim) > n) {
      n = t.size(dim);
      leader_item = static_cast<int16_t>(j);
    }
  }
  if (n < 1) return false;
  plan.dynamic.assign(args.size() + items.size(), 0);
  plan.dynamic[static_cast<size_t>(list_arg)] = 2;
  plan.num_items = items.size();
  int64_t scale = 0, offset = 0;  // the output's a * n + c rows along dim
  for (size_t j = 0; j < items.size(); ++j) {
    const at::Tensor& t = items[j].toTensor();
    if (t.dim() != rank) continue;  // a legacy empty 1-d item: skipped by cat
    if (t.size(dim) != n) {
      offset += t.size(dim);
      continue;  // static
    }
    ++scale;
    if (t.storage_offset() != 0 || t.is_conj() || t.is_neg() ||
        StorageElement(t) != lowering::ToElementType(t.scalar_type()))
      return false;
    if (!t.is_contiguous()) {
      if (n < 2) return false;
      const std::vector<int64_t> order = DenseOrder(t);
      if (std::find(order.begin(), order.end(), dim) == order.end()) return false;
    }
    plan.dynamic[args.size() + j] = 1;
  }
  plan.leader = list_arg;
  plan.leader_item = leader_item;
  plan.dim = dim;
  plan.extent = n;
  // Bucketed by the output's rows: the program serves every n whose
  // a * n + c rows have the same Capacity, reading the items at the largest
  // such n, so its output buffer is the canonical one of the output's own
  // bucket (Compile) — what the next step's programs (the growing cache's
  // next cat, its readers) declare, so they need no resize.
  plan.rows_scale = scale;
  plan.rows_offset = offset;
  plan.bucket = (Capacity(scale * n + offset) - offset) / scale;
  return true;
}

// Whether a random draw (LoweringTraits::poly_flat) can share a program
// with calls of any shape: no out= or tensor list; every tpu tensor has
// the leader's sizes (n >= 1 elements) and is contiguous, at offset 0,
// typed as its storage; at most one is written (in place: it is the
// leader, covers its storage's bytes, and every return is it), else the
// leader is the first and the returns are new tensors of its sizes
// (checked in PolySpec). CPU scalars and static arguments are part of the
// key. The program reads and writes every tensor flat at B = Capacity(n)
// elements: element i depends only on (seed, offset + i) and the inputs'
// element i, so the first n are the exact program's bit for bit, and the
// generator advances by the launch's n (InputSlot::rng_numel_of). Written
// storages and new outputs get B-element buffers (Capacity(n), as from any
// producer). dim = -1 marks the plan flat.
bool PlanPolyFlat(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                  const lowering::LoweringEntry& entry, PolyPlan& plan) {
  if (!entry.traits.poly_flat) return false;
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  int16_t leader = -1, written = -1;
  plan.dynamic.assign(args.size(), 0);
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (IsOutArg(args[i]) || IsTensorListValue(v)) return false;
    const bool writes = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (!v.isTensor() || !v.toTensor().defined() || !OnTpu(v.toTensor())) {
      if (writes) return false;
      continue;
    }
    const at::Tensor& t = v.toTensor();
    if (t.numel() < 1 || !t.is_contiguous() || t.storage_offset() != 0 || t.is_conj() || t.is_neg() ||
        StorageElement(t) != lowering::ToElementType(t.scalar_type()))
      return false;
    if (leader >= 0 && t.sizes() != stack[first + static_cast<size_t>(leader)].toTensor().sizes()) return false;
    if (writes) {
      if (written >= 0 ||
          static_cast<int64_t>(StorageOf(t).nbytes()) != t.numel() * static_cast<int64_t>(t.element_size()))
        return false;
      written = static_cast<int16_t>(i);
    }
    if (leader < 0) leader = static_cast<int16_t>(i);
    plan.dynamic[i] = 1;
  }
  if (leader < 0) return false;
  if (written >= 0) {
    for (const auto& ret : schema.returns()) {
      const auto* ai = ret.alias_info();
      if (!ai || !ai->isWrite() || ai->beforeSets() != args[static_cast<size_t>(written)].alias_info()->beforeSets())
        return false;
    }
    leader = written;
  }
  const int64_t n = stack[first + static_cast<size_t>(leader)].toTensor().numel();
  plan.leader = leader;
  plan.dim = -1;
  plan.extent = n;
  plan.bucket = Capacity(n);
  return true;
}

// The call's spec at the bucket, after checking that every output either
// keeps its sizes when the extent changes or has the extent in exactly one
// dim (and its other dims kept); `dynamic_out` gives that dim (-1: none).
// Throws UnsupportedOp otherwise.
// A poly_concat entry's output may instead have scale * extent + offset
// there (`scale` dynamic items, `offset` the static items' total), in
// `affine`: {scale, offset} per output.
CallSpec PolySpec(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                  const lowering::LoweringEntry& entry, const PolyPlan& plan, std::vector<int64_t>& dynamic_out,
                  std::vector<std::pair<int64_t, int64_t>>& affine, std::vector<uint64_t>& masks) {
  CallSpec real = ComputeSpec(op, stack, first, entry.traits.out_resized_by_numel);  // raises as the static path
  if (!real.resize_outputs.empty()) throw UnsupportedOp("shape polymorphism: resizes an output");
  CallSpec at_b =
      ComputeSpec(op, stack, first, false, plan.dynamic, plan.bucket, plan.dim, plan.multi_n, plan.marks);
  masks.assign(real.outputs.size(), 0);
  if (plan.dim < 0) {
    // Flat (PlanPolyFlat): every return is the written leader or a new
    // row-major tensor of the leader's sizes; all are [bucket] here.
    const std::vector<int64_t> flat{plan.bucket};
    const auto leader_sizes = stack[first + static_cast<size_t>(plan.leader)].toTensor().sizes();
    if (at_b.outputs.size() != real.outputs.size() || at_b.return_alias != real.return_alias ||
        at_b.defined != real.defined || !at_b.resize_outputs.empty())
      throw UnsupportedOp("shape polymorphism: outputs change with the extent");
    dynamic_out.assign(real.outputs.size(), -1);
    for (size_t r = 0; r < real.outputs.size(); ++r) {
      if (!real.defined[r]) continue;
      const int16_t a = real.return_alias[r];
      const bool ok = (a < 0 ? real.outputs[r].sizes == leader_sizes && real.strides[r].empty() : a == plan.leader) &&
                      at_b.outputs[r].sizes == flat && at_b.outputs[r].dtype == real.outputs[r].dtype;
      if (!ok) throw UnsupportedOp("shape polymorphism: a flat program's outputs are its leader's elements");
      if (a < 0) dynamic_out[r] = 0;
    }
    affine.assign(real.outputs.size(), {1, 0});
    at_b.strides.assign(real.outputs.size(), {});
    return at_b;
  }
  CallSpec at_b1 =
      ComputeSpec(op, stack, first, false, plan.dynamic, plan.bucket + 1, plan.dim, plan.multi_n, plan.marks);
  const size_t n = real.outputs.size();
  if (at_b.outputs.size() != n || at_b1.outputs.size() != n || at_b.defined != real.defined ||
      at_b1.defined != real.defined || at_b.return_alias != real.return_alias || !at_b.resize_outputs.empty())
    throw UnsupportedOp("shape polymorphism: outputs change with the extent");
  dynamic_out.assign(n, -1);
  affine.assign(n, {1, 0});
  if (plan.multi_n > 0) {
    // Multi-dim (PlanPolyMulti): an output's dims either stay or are the
    // extent (B, B + 1 and n); written tensors change in exactly their dims
    // of size n; new outputs are row-major.
    for (size_t r = 0; r < n; ++r) {
      if (!real.defined[r]) continue;
      const auto &sr = real.outputs[r].sizes, &sb = at_b.outputs[r].sizes, &sb1 = at_b1.outputs[r].sizes;
      if (real.outputs[r].dtype != at_b.outputs[r].dtype || at_b.outputs[r].dtype != at_b1.outputs[r].dtype)
        throw UnsupportedOp("shape polymorphism: output dtype changes with the extent");
      if (sb.size() != sr.size() || sb1.size() != sr.size() || sr.size() >= 64)
        throw UnsupportedOp("shape polymorphism: output rank changes with the extent");
      uint64_t mask = 0;
      for (size_t d = 0; d < sr.size(); ++d) {
        if (sb[d] == sb1[d]) {
          if (sb[d] != sr[d]) throw UnsupportedOp("shape polymorphism: output sizes change with the extent");
        } else if (sb[d] == plan.bucket && sb1[d] == plan.bucket + 1 && sr[d] == plan.extent) {
          mask |= uint64_t{1} << d;
        } else {
          throw UnsupportedOp("shape polymorphism: output sizes are not the extent and static dims");
        }
      }
      masks[r] = mask;
      if (mask) dynamic_out[r] = std::countr_zero(mask);
      if (const int16_t a = real.return_alias[r]; a >= 0) {
        const uint64_t marks = plan.marks[static_cast<size_t>(a)];
        if (marks != mask || mask == 0) throw UnsupportedOp("shape polymorphism: writes a tensor without the dynamic dim");
      } else if (!real.strides[r].empty()) {
        throw UnsupportedOp("shape polymorphism: a new output is not row-major");
      }
      at_b.strides[r].clear();
    }
    return at_b;
  }
  for (size_t r = 0; r < n; ++r) {
    if (!real.defined[r]) continue;
    const auto &sr = real.outputs[r].sizes, &sb = at_b.outputs[r].sizes, &sb1 = at_b1.outputs[r].sizes;
    if (real.outputs[r].dtype != at_b.outputs[r].dtype || at_b.outputs[r].dtype != at_b1.outputs[r].dtype)
      throw UnsupportedOp("shape polymorphism: output dtype changes with the extent");
    if (sb == sb1) {
      if (sb != sr) throw UnsupportedOp("shape polymorphism: output sizes change with the extent");
    } else {
      if (sb.size() != sr.size() || sb1.size() != sr.size())
        throw UnsupportedOp("shape polymorphism: output rank changes with the extent");
      int64_t e = -1;
      for (size_t d = 0; d < sr.size(); ++d) {
        if (sb[d] == sb1[d]) {
          if (sb[d] != sr[d]) throw UnsupportedOp("shape polymorphism: output sizes change with the extent");
          continue;
        }
        const int64_t scale = sb1[d] - sb[d], offset = sr[d] - scale * plan.extent;
        const bool affine_ok = entry.traits.poly_concat ? scale >= 1 && offset >= 0
                                                        : scale == 1 && offset == 0;
        if (e >= 0 || !affine_ok || sb[d] != scale * plan.bucket + offset)
          throw UnsupportedOp("shape polymorphism: output sizes are not the extent and static dims");
        e = static_cast<int64_t>(d);
        affine[r] = {scale, offset};
      }
      dynamic_out[r] = e;
    }
    if (real.return_alias[r] >= 0 && dynamic_out[r] != plan.dim)
      throw UnsupportedOp("shape polymorphism: writes a tensor without the dynamic dim");
    if (real.return_alias[r] < 0 && !real.strides[r].empty()) {
      // A permuted dense output (an elementwise op on a transposed view
      // keeps its input's strides, as CPU's TensorIterator does): served
      // where its memory order is the same at n, the bucket and bucket + 1
      // and the dynamic dim is in it; the program writes it in that order.
      const auto order = PhysicalOrder(sr, real.strides[r]);
      if (entry.traits.poly_concat || dynamic_out[r] < 0 || at_b.strides[r].empty() || at_b1.strides[r].empty() ||
          PhysicalOrder(sb, at_b.strides[r]) != order || PhysicalOrder(sb1, at_b1.strides[r]) != order ||
          sr[static_cast<size_t>(dynamic_out[r])] < 2)
        throw UnsupportedOp("shape polymorphism: a new output is not row-major");
    } else {
      at_b.strides[r].clear();  // row-major, as the call's own
    }
  }
  return at_b;
}

// A program built but not compiled yet (Compile with `defer`).
struct Deferred {
  CallSignature signature;
  std::chrono::steady_clock::time_point start;
};

// `plan`: a shape-polymorphic program for the plan's bucket (OpCache::Lookup).
// `defer`: stop before the PJRT compile (compiled->executable stays empty;
// FinishCompile or the background compile complete it).
std::unique_ptr<CompiledOp> Compile(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                    size_t first, const lowering::LoweringEntry& entry,
                                    const PolyPlan* plan = nullptr, Deferred* defer = nullptr,
                                    bool runtime_offsets = false) {
  const auto& schema = op.schema();
  auto compiled = std::make_unique<CompiledOp>();
  compiled->entry = &entry;
  compiled->name = schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
  const auto compile_start = std::chrono::steady_clock::now();
  const CallSignature signature = SignatureOf(op, stack, first, entry.traits.static_scalars);  // before resizes
  std::vector<int64_t> dynamic_out;
  std::vector<std::pair<int64_t, int64_t>> affine;
  std::vector<uint64_t> masks;  // a multi-dim plan's dynamic output dims
  CallSpec spec = plan ? PolySpec(op, stack, first, entry, *plan, dynamic_out, affine, masks)
                       : ComputeSpec(op, stack, first, entry.traits.out_resized_by_numel);
  if (!plan) ApplyResizes(spec, stack, first);
  compiled->resize_outputs = spec.resize_outputs;
  compiled->out_resize = spec.out_resize;
  compiled->spec = spec;

  ProgramBuilder pb;
  pb.runtime_offsets = runtime_offsets;
  if (plan) {
    pb.poly = ProgramBuilder::Poly{plan->dynamic,
                                   plan->bucket,
                                   plan->leader,
                                   plan->leader_item,
                                   plan->num_items,
                                   plan->dim,
                                   plan->dim < 0 ? lowering::PadFill::kAny : entry.traits.shape_poly,
                                   std::nullopt,
                                   plan->multi_n,
                                   plan->marks};
    compiled->poly_leader = plan->leader;
    compiled->poly_leader_item = plan->leader_item;
    compiled->poly_dim = static_cast<int8_t>(plan->dim);
    compiled->poly_bucket = plan->bucket;
  }
  auto new_values = pb.AddCall(0, op, stack, first, entry, spec);
  // Checks would see the padding rows (a divisor of 0 there): exact shapes.
  if (plan && !pb.index_checks.empty()) throw UnsupportedOp("shape polymorphism: the op checks its values");

  // Outputs: new tensors first, then written storages.
  std::vector<hlo::Value> program_results;
  for (size_t r = 0; r < new_values.size(); ++r) {
    if (!spec.defined[r]) {
      compiled->returns.push_back({false, -1});  // an undefined tensor
      continue;
    }
    if (!new_values[r]) {
      compiled->returns.push_back({true, spec.return_alias[r]});
      continue;
    }
    const auto& out = spec.outputs[r];
    int64_t flat_dims[] = {new_values[r]->type.numel()};
    const bool dynamic = plan && dynamic_out[r] >= 0;
    // A dynamic output's buffer is canonical for its own extent's bucket
    // (PolyBufferNumel of a reader at that bucket): its numel with the
    // dynamic dim at Capacity(its size at the bucket) — the bucket itself,
    // or for cat the Capacity of a * B + c rows (PlanPolyConcat); at least
    // the tensor's elements for every extent of the bucket.
    int64_t n = Capacity(flat_dims[0]);
    const uint64_t mask = dynamic && plan->multi_n > 0 ? masks[r] : 0;
    if (mask) {
      n = flat_dims[0];  // every dynamic dim at the bucket (PolyBufferNumel's numel)
    } else if (dynamic) {
      const int64_t rows = out.sizes[static_cast<size_t>(dynamic_out[r])];
      n = rows == 0 ? 0 : flat_dims[0] / rows * Capacity(rows);
    }
    // A permuted dynamic output (PolySpec): AddCall gave its values in
    // memory order, where the dynamic dim is at `physical_dim`.
    std::vector<int64_t> order;
    int64_t physical_dim = dynamic ? dynamic_out[r] : 0;
    if (dynamic && !spec.strides[r].empty()) {
      order = PhysicalOrder(out.sizes, spec.strides[r]);
      physical_dim = std::find(order.begin(), order.end(), dynamic_out[r]) - order.begin();
    }
    program_results.push_back(
        mask      ? pb.MultiWrite(*new_values[r], mask)
        : dynamic ? lowering::ResizeFlat(pb.b, pb.PolyWrite(*new_values[r], physical_dim, affine[r].first,
                                                            affine[r].second), n)
                  : lowering::ResizeFlat(pb.b, pb.b.Reshape(*new_values[r], flat_dims), n));
    OutputSlot slot;
    slot.kind = OutputSlot::Kind::kNewTensor;
    slot.dtype = out.dtype;
    slot.sizes = out.sizes;
    slot.strides = dynamic ? std::vector<int64_t>{} : spec.strides[r];  // a dynamic one's: `order`
    slot.element = lowering::ToElementType(out.dtype);
    slot.numel = n;
    slot.dynamic = dynamic;
    slot.dynamic_dim = static_cast<int8_t>(dynamic ? dynamic_out[r] : 0);
    if (dynamic) std::tie(slot.dynamic_scale, slot.dynamic_offset) = affine[r];
    slot.dynamic_mask = mask;
    slot.order = std::move(order);
    compiled->returns.push_back({false, static_cast<int16_t>(compiled->outputs.size())});
    compiled->outputs.push_back(std::move(slot));
  }
  for (auto& st : pb.storages) {
    if (!st.current) continue;
    int32_t donor = pb.AliasWrittenStorage(st, program_results.size());
    if (donor >= 0) compiled->donor_inputs.push_back(donor);
    program_results.push_back(*st.current);
    OutputSlot slot;
    slot.kind = OutputSlot::Kind::kStorageWrite;
    slot.arg = st.first_use.arg;
    slot.item = st.first_use.item;
    slot.element = st.element;
    slot.numel = st.current->dims()[0];
    compiled->outputs.push_back(std::move(slot));
  }
  for (auto& [flag, message] : pb.index_checks) {
    program_results.push_back(flag);
    OutputSlot slot;
    slot.kind = OutputSlot::Kind::kIndexCheck;
    slot.element = hlo::ElementType::kPred;
    slot.numel = 1;
    compiled->outputs.push_back(std::move(slot));
    compiled->check_messages.push_back(message);
  }
  pb.b.Return(program_results);
  compiled->inputs = std::move(pb.inputs);
  compiled->module_text = pb.b.Module();
  if (defer) {
    *defer = Deferred{signature, compile_start};
    return compiled;
  }
  compiled->executable = CompileModule(compiled->name, compiled->module_text, /*single_op=*/true);
  CompileStats::Get().Record(compiled->name, signature,
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - compile_start).count());
  return compiled;
}

void FinishCompile(CompiledOp& compiled, const Deferred& d) {
  compiled.executable = CompileModule(compiled.name, compiled.module_text, /*single_op=*/true);
  CompileStats::Get().Record(compiled.name, d.signature,
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - d.start).count());
}

// The background compile thread(s) of host-first calls and fused-mode
// regions: a FIFO queue, plus a low-priority one taken only when it is
// empty (a fused structure's hot keys), one thread
// (TORCH_TPU_COMPILE_THREADS, default 1: this is a 2-core machine and the
// PJRT CPU plugin compiles on the calling thread).
// Niceness (setpriority(2) on the thread's id; the threads a compile starts
// inherit it): TORCH_TPU_COMPILE_NICE=N (0-19) runs them at N; unset, at
// 19 where the process may raise a thread's priority back (CAP_SYS_NICE or
// RLIMIT_NICE >= 20: tried once on a scratch thread), else at 0. A niced
// compile leaves the cores to the calls made meanwhile (host-served, op by
// op) and to the programs they launch on the XLA CPU plugin: generate()
// with a prompt of a new length (issue 12 (b), idle 2-core machine) took
// 0.114-0.141 s strict and 0.159-0.173 s fused at 0, 0.106-0.111 s and
// 0.127-0.140 s at 19 (warm call 0.08 s). The cost is priority inversion:
// a thread that waits for a background compile — AwaitCompiled,
// AwaitAll (metrics(), exit, fork), a synchronous compile behind
// DiskCache's compile mutex — would wait at the compile's niceness, and on
// a machine loaded by other processes a niceness-19 thread gets ~1.5% of a
// core (why the default was 0 before). So each such wait holds a
// CompileBoost, which runs every thread at the worker's niceness at the
// waiter's (0 for a thread nobody niced) for as long as any wait lasts;
// where the priority cannot be raised back
// (unprivileged, RLIMIT_NICE 0) the default stays 0 and an explicit N > 0
// waits as it always did.
// Leaked: it must
// outlive static destructors; AwaitBackgroundCompiles runs at exit and
// before fork() (a child has no worker thread: a compile queued in the
// parent would never finish there). Its settings are read when it is
// first asked for (Get(), a bad value a RuntimeError naming the variable,
// raised again at each later Get()): every path that queues a compile
// calls Get() just before it marks anything as queued (QueueCompile, the
// resize-buffer path, a fused region's background compile), so a bad
// value fails each call that would queue one — and only those: a program
// on disk still loads — and leaves no op waiting for a compile that never
// runs.
class CompileWorker {
 public:
  static CompileWorker& Get() {
    static CompileWorker* worker = [] {
      auto* w = new CompileWorker();
      existing_.store(w, std::memory_order_release);
      return w;
    }();
    return *worker;
  }
  // The worker if Get() has made it, else nullptr (nothing was queued):
  // waiting and counting need no settings.
  static CompileWorker* Existing() { return existing_.load(std::memory_order_acquire); }
  // `low`: run only when no other task is queued (a task already running
  // is not preempted).
  void Submit(std::function<void()> task, bool low = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (threads_ == 0) Start();
    (low ? low_queue_ : queue_).push_back(std::move(task));
    ++outstanding_;
    work_.notify_one();
  }
  void AwaitAll() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (outstanding_ == 0) return;
    }
    CompileBoost boost;
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return outstanding_ == 0; });
  }
  // CompileBoost: the first boost raises every thread of the process at
  // the worker's niceness (its threads and those its compiles started) to
  // the waiter's; the last one lowers them back.
  bool BoostBegin() {
    errno = 0;
    const int waiter = getpriority(PRIO_PROCESS, static_cast<id_t>(gettid()));
    if (nice_ == 0 || errno != 0 || waiter >= nice_) return false;
    std::lock_guard<std::mutex> lock(boost_mutex_);
    if (boosts_++ > 0) return true;
    boosted_.clear();
    before_boost_.clear();
    boosted_to_ = waiter;
    for (pid_t tid : Threads()) {
      before_boost_.push_back(tid);
      errno = 0;
      const int prio = getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
      if (errno == 0 && prio == nice_ && setpriority(PRIO_PROCESS, static_cast<id_t>(tid), waiter) == 0)
        boosted_.push_back(tid);
    }
    return true;
  }
  // The last boost lowers the threads it raised back, and the threads a
  // compile started meanwhile (they inherited the raised niceness: XLA's
  // compile helpers, started by the first compile): new since the boost
  // began, at its niceness, named as a worker thread (XLA's execution
  // pools are named tf_*). Without the latter they stayed at 0 for good
  // (review, session 21: ~40% of later compiles' CPU at niceness 0).
  void BoostEnd() {
    std::lock_guard<std::mutex> lock(boost_mutex_);
    if (--boosts_ > 0) return;
    for (pid_t tid : boosted_) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice_);  // gone: ESRCH
    std::string worker_name;
    {
      std::lock_guard<std::mutex> wl(mutex_);
      if (!worker_tids_.empty()) worker_name = ThreadName(worker_tids_.front());
    }
    if (!worker_name.empty()) {
      for (pid_t tid : Threads()) {
        if (std::find(before_boost_.begin(), before_boost_.end(), tid) != before_boost_.end()) continue;
        errno = 0;
        const int prio = getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
        if (errno == 0 && prio == boosted_to_ && ThreadName(tid) == worker_name)
          (void)setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice_);
      }
    }
    boosted_.clear();
    before_boost_.clear();
  }

 private:
  CompileWorker()
      : threads_wanted_(static_cast<int>(
            EnvInteger("TORCH_TPU_COMPILE_THREADS", 1, 1, 64, "an integer in [1, 64]"))),
        nice_(DefaultNice()) {}
  // This process's thread ids (/proc/self/task).
  static std::vector<pid_t> Threads() {
    std::vector<pid_t> tids;
    if (DIR* dir = opendir("/proc/self/task")) {
      while (dirent* e = readdir(dir)) {
        char* end = nullptr;
        const long tid = std::strtol(e->d_name, &end, 10);
        if (end != e->d_name && *end == '\0') tids.push_back(static_cast<pid_t>(tid));
      }
      closedir(dir);
    }
    return tids;
  }
  static std::string ThreadName(pid_t tid) {
    std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/comm");
    std::string name;
    std::getline(in, name);
    return name;
  }
  static int DefaultNice() {
    if (std::getenv("TORCH_TPU_COMPILE_NICE"))
      return static_cast<int>(EnvInteger("TORCH_TPU_COMPILE_NICE", 0, 0, 19, "an integer in [0, 19]"));
    // Whether a thread may lower its niceness back: tried on a scratch
    // thread (it starts at the caller's niceness).
    bool reversible = false;
    std::thread([&reversible] {
      const id_t tid = static_cast<id_t>(gettid());
      errno = 0;
      const int base = getpriority(PRIO_PROCESS, tid);
      reversible = errno == 0 && base < 19 && setpriority(PRIO_PROCESS, tid, 19) == 0 &&
                   setpriority(PRIO_PROCESS, tid, base) == 0;
    }).join();
    return reversible ? 19 : 0;
  }
  void Start() {
    const int n = threads_wanted_, nice = nice_;
    static std::once_flag hooks;
    std::call_once(hooks, [] {
      std::atexit([] { CompileWorker::Get().AwaitAll(); });
      pthread_atfork([] { CompileWorker::Get().AwaitAll(); }, nullptr, nullptr);
    });
    for (int i = 0; i < n; ++i) std::thread([this, nice] { Loop(nice); }).detach();
    threads_ = n;
  }
  void Loop(int nice) {
    // Best effort: a thread's niceness is per thread on Linux (its id names
    // it); a failure (a sandbox without the permission) leaves it as is.
    if (nice > 0) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), nice);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      worker_tids_.push_back(static_cast<pid_t>(gettid()));
    }
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_.wait(lock, [&] { return !queue_.empty() || !low_queue_.empty(); });
        auto& from = queue_.empty() ? low_queue_ : queue_;
        task = std::move(from.front());
        from.pop_front();
      }
      task();  // never throws: errors go to the task's promise
      std::lock_guard<std::mutex> lock(mutex_);
      if (--outstanding_ == 0) idle_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable work_, idle_;
  std::deque<std::function<void()>> queue_;
  std::deque<std::function<void()>> low_queue_;  // run when queue_ is empty
  int64_t outstanding_ = 0;  // queued (either queue) or running
  int threads_ = 0;
  const int threads_wanted_;  // TORCH_TPU_COMPILE_THREADS
  const int nice_;            // TORCH_TPU_COMPILE_NICE, or DefaultNice()
  std::mutex boost_mutex_;
  int boosts_ = 0;              // CompileBoosts alive that raised threads
  std::vector<pid_t> boosted_;  // the threads they raised
  std::vector<pid_t> before_boost_;  // every thread when the first began
  int boosted_to_ = 0;               // the niceness it raised them to
  std::vector<pid_t> worker_tids_;   // guarded by mutex_
  static inline std::atomic<CompileWorker*> existing_{nullptr};
};

// Gives compiled a PendingCompile whose `queue` (QueueCompile) counts the
// compile and submits its PJRT compile to the background thread.
void PrepareBackground(const std::shared_ptr<CompiledOp>& compiled, const Deferred& d) {
  auto pending = std::make_shared<PendingCompile>();
  auto promise = std::make_shared<std::promise<void>>();
  pending->done = promise->get_future().share();
  // The program's build time (meta kernel, lowering, module text), not the
  // calls between the first and the one that queues the compile.
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - d.start).count();
  pending->queue = [signature = d.signature, build_s, promise](const std::shared_ptr<CompiledOp>& c,
                                                                 bool load_now) {
    // Counted when queued, on the calling thread: compile counts and causes
    // (and the recompile warning) do not depend on when the compile ends.
    Runtime::Get().metrics().compiles++;
    CompileStats::Get().Record(c->name, signature, build_s);
    auto compile = [c, promise] {
      try {
        c->executable = CompileModule(c->name, c->module_text, /*single_op=*/true, /*count=*/false);
        c->pending->ready.store(true, std::memory_order_release);
        promise->set_value();
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    };
    if (load_now) {
      compile();  // on disk: a load, as a program found there at its first call is
    } else {
      CompileWorker::Get().Submit(std::move(compile));
    }
  };
  compiled->pending = pending;
}

// Queues a prepared compile (once); the caller holds the OpCache's mutex.
// A program on disk loads now, on the calling thread (a fused recording
// prepares its ops' entries without looking at the disk, as a region may
// never run them one by one); else the compile goes to the worker, whose
// settings are read first: a bad value raises here, before the op is
// marked queued.
void QueueCompile(const std::shared_ptr<const CompiledOp>& compiled) {
  PendingCompile& p = *compiled->pending;
  if (p.queued) return;
  const bool on_disk = InDiskCache(compiled->module_text, /*single_op=*/true);
  if (!on_disk) CompileWorker::Get();
  p.queued = true;
  auto queue = std::move(p.queue);
  p.queue = nullptr;  // the task holds the CompiledOp; no cycle through `pending`
  queue(std::const_pointer_cast<CompiledOp>(compiled), on_disk);
}

// Waits for a compile started by an earlier host-first call; rethrows its
// error.
void AwaitCompiled(const CompiledOp& compiled) {
  if (!compiled.pending || compiled.pending->ready.load(std::memory_order_acquire)) return;
  CompileBoost boost;
  const auto start = std::chrono::steady_clock::now();
  compiled.pending->done.get();
  Runtime::Get().metrics().compile_wait_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// Bytes of the tpu storages a call reads or writes plus its new outputs'.
int64_t CallBytes(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first, const CallSpec& spec) {
  int64_t bytes = 0;
  std::vector<const void*> seen;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || !OnTpu(t) || !t.has_storage()) return;
    const void* impl = t.storage().unsafeGetStorageImpl();
    if (std::find(seen.begin(), seen.end(), impl) != seen.end()) return;
    seen.push_back(impl);
    bytes += static_cast<int64_t>(t.storage().nbytes());
  };
  for (size_t i = first; i < first + op.schema().arguments().size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) add(v.toTensor());
    else if (IsTensorListValue(v))
      for (const auto& item : v.toListRef())
        if (item.isTensor()) add(item.toTensor());
  }
  for (size_t r = 0; r < spec.outputs.size(); ++r)
    if (spec.return_alias[r] < 0 && spec.defined[r])
      bytes += c10::multiply_integers(spec.outputs[r].sizes) *
               static_cast<int64_t>(c10::elementSize(spec.outputs[r].dtype));
  return bytes;
}

// Whether a call may be served on the host before its program is built
// (OpCache::Lookup, host_served): not a random op (the tpu generator's
// stream must not change), a CPU kernel to run. out= calls qualify here and
// are checked once built (HostFirstFits: no out= resize).
bool HostFirstCall(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                   const lowering::LoweringEntry& entry) {
  if (!HostFirstEnabled() || entry.traits.needs_rng) return false;
  const auto& args = op.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (stack[first + i].isGenerator()) return false;
  return op.hasComputedKernelForDispatchKey(c10::DispatchKey::CPU);
}

// And once the program is built: not too large, no out= tensor to resize
// (the CPU kernel would resize the host mirror, not the tpu tensor; an out=
// tensor of the result's sizes is written in place through its mirror, as
// an in-place op's self is), outputs typed as their dtypes' bytes (the host
// result is uploaded as it is).
bool HostFirstFits(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                   const CompiledOp& compiled) {
  if (!compiled.resize_outputs.empty()) return false;
  if (CallBytes(op, stack, first, compiled.spec) > HostFirstMaxBytes()) return false;
  for (const auto& o : compiled.outputs)
    if (o.kind == OutputSlot::Kind::kNewTensor &&
        ElementSize(o.element) != static_cast<size_t>(c10::elementSize(o.dtype)))
      return false;
  return true;
}

// A new program: fits, and not in the disk cache (a load is cheap).
bool HostFirstProgram(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                      const CompiledOp& compiled) {
  return HostFirstFits(op, stack, first, compiled) &&
         !DiskCache::Get().Has(Runtime::Get().client(), compiled.module_text, SingleOpOptions());
}

// `checked`: Scalar arguments (alpha=1e300 into f32 raises, as on CPU);
// CPU 0-d tensors (wrapped Python numbers) convert as CPU's TensorIterator
// does, without a range check (`f32 * 1e300` is inf).
void ScalarToBytes(const c10::Scalar& s, hlo::ElementType e, void* out, bool checked) {
  switch (e) {
    case hlo::ElementType::kPred: *static_cast<bool*>(out) = s.toBool(); break;
    case hlo::ElementType::kS64: *static_cast<int64_t*>(out) = s.toLong(); break;
    case hlo::ElementType::kS32: *static_cast<int32_t*>(out) = s.toInt(); break;
    case hlo::ElementType::kF32:
      *static_cast<float*>(out) = checked || !s.isFloatingPoint() ? s.toFloat() : static_cast<float>(s.toDouble());
      break;
    case hlo::ElementType::kF64: *static_cast<double*>(out) = s.toDouble(); break;
    default: {
      // Other dtypes of CPU 0-d tensors: convert through a CPU tensor.
      at::Tensor t = at::scalar_tensor(s, at::TensorOptions().dtype(lowering::ToScalarType(e)));
      std::memcpy(out, t.data_ptr(), t.element_size());
    }
  }
}

}  // namespace

std::string BaseName(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  auto pos = name.find("::");
  if (pos != std::string::npos) name = name.substr(pos + 2);
  if (name.size() > 1 && name.back() == '_' && name[name.size() - 2] != '_' && schema.is_mutable()) name.pop_back();
  return name;
}

OpCache& GlobalOpCache() {
  static OpCache* cache = new OpCache();
  return *cache;
}

size_t MaxCachedExecutables() {
  static const size_t limit = static_cast<size_t>(EnvInteger(
      "TORCH_TPU_MAX_CACHED_EXECUTABLES", 4096, 1, std::numeric_limits<int64_t>::max(), "a positive integer"));
  return limit;
}

bool ShapePolyEnabled() {
  static const bool enabled = EnvFlag("TORCH_TPU_SHAPE_POLY", true);
  return enabled;
}

std::atomic<int64_t>& ExecutableEvictions() {
  static std::atomic<int64_t> evictions{0};
  return evictions;
}

bool HostFirstEnabled() {
  static const bool enabled = EnvFlag("TORCH_TPU_HOST_FIRST", true);
  return enabled;
}

int64_t HostFirstMaxBytes() {
  static const int64_t limit = EnvInteger("TORCH_TPU_HOST_FIRST_MAX_BYTES", int64_t{4} << 20, 0,
                                          std::numeric_limits<int64_t>::max(), "a non-negative integer");
  return limit;
}

int64_t HostFirstCompileAfter() {
  static const int64_t after =
      EnvInteger("TORCH_TPU_HOST_FIRST_COMPILE_AFTER", 2, 1, 1000000, "an integer in [1, 1000000]");
  return after;
}

namespace {
thread_local bool host_first_deferred = false;
}  // namespace

HostFirstDeferScope::HostFirstDeferScope(bool on) : previous_(host_first_deferred) {
  host_first_deferred = previous_ || on;
}
HostFirstDeferScope::~HostFirstDeferScope() { host_first_deferred = previous_; }

void AwaitBackgroundCompiles() {
  if (CompileWorker* w = CompileWorker::Existing()) w->AwaitAll();
}

CompileBoost::CompileBoost() {
  if (CompileWorker* w = CompileWorker::Existing()) active_ = w->BoostBegin();
}
CompileBoost::~CompileBoost() {
  if (active_) CompileWorker::Existing()->BoostEnd();
}

void SubmitBackgroundCompile(std::function<void()> task, bool low_priority) {
  CompileWorker::Get().Submit(std::move(task), low_priority);
}

void CheckBackgroundCompileSettings() { CompileWorker::Get(); }

bool InDiskCache(const std::string& module_text, bool single_op) {
  return DiskCache::Get().Has(Runtime::Get().client(), module_text, single_op ? SingleOpOptions() : PortableOptions());
}

namespace {

// A call's shape-family candidates, in order (OpCache::Lookup, DESIGN.md
// "Shape-polymorphic eager programs"): cat one, its cat dim
// (PlanPolyConcat); random fills one, the numel (PlanPolyFlat, dim -1);
// mm/addmm one, the left matrix's rows (PlanPolyMatmul); else every dim
// (PlanPoly), then the multi-dim candidates (PlanPolyMulti): per size n of
// the leader's dims, every subset of the dims of size n, all of them first.
// A subset finds the family of the calls where a static dim is not n: at
// n = 16, [2, 4, 16, 16] of q with head dim 16 is marked {2} as at every
// other n; at n = 2, [2, 4, 2, 2] scores with batch 2 are marked {2, 3}.
// None where `shape_poly` is false, TORCH_TPU_SHAPE_POLY=0 or the op has
// no polymorphic lowering.
class PolyCandidates {
 public:
  PolyCandidates(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                 const lowering::LoweringEntry& entry, bool shape_poly)
      : op_(op), stack_(stack), first_(first), entry_(entry) {
    const bool on = shape_poly && ShapePolyEnabled() &&
                    (entry.traits.shape_poly != lowering::PadFill::kNone || entry.traits.poly_flat);
    int16_t leader = -1;
    rank_ = !on ? 0
            : entry.traits.poly_concat || entry.traits.poly_flat || entry.traits.poly_matmul
                ? 1
                : PolyRank(op, stack, first, leader);
    multi_on_ = on && !entry.traits.poly_concat && !entry.traits.poly_flat && !entry.traits.poly_matmul &&
                !entry.traits.poly_batch_dims;
  }
  // The next candidate that plans, into `plan`, and its family's key (the
  // call's key without the dynamic dims, `family_key.hash` set): false
  // when none is left.
  bool Next(PolyPlan& plan, const void* op_id, OpKey& family_key) {
    for (;; ++candidate_) {
      plan = PolyPlan{};
      bool planned;
      const auto& traits = entry_.traits;
      if (candidate_ < rank_) {
        planned = traits.poly_flat     ? PlanPolyFlat(op_, stack_, first_, entry_, plan)
                  : traits.poly_concat ? PlanPolyConcat(op_, stack_, first_, entry_, plan)
                  : traits.poly_matmul ? PlanPolyMatmul(op_, stack_, first_, entry_, plan)
                                       : PlanPoly(op_, stack_, first_, entry_, candidate_, plan);
      } else {
        if (!multi_on_ || multi_dim_ >= rank_) return false;
        size_t subsets = 0;
        planned = PlanPolyMulti(op_, stack_, first_, entry_, multi_dim_, subset_, plan, &subsets);
        if (++subset_ >= subsets) {
          ++multi_dim_;
          subset_ = 0;
        }
      }
      if (!planned) continue;
      ++candidate_;
      family_key.op = op_id;
      family_key.atoms.clear();
      family_key.atoms.push_back(plan.multi_n > 0 ? -2 : plan.dim);
      StorageIds ids;
      AppendCallKey(op_, stack_, first_, entry_, family_key.atoms, ids, plan.dynamic, -1, plan.dim, false,
                    plan.multi_n, plan.marks);
      family_key.hash = KeyHash(family_key);
      return true;
    }
  }

 private:
  const c10::OperatorHandle& op_;
  const torch::jit::Stack& stack_;
  size_t first_;
  const lowering::LoweringEntry& entry_;
  int64_t rank_ = 0;
  bool multi_on_ = false;
  int64_t candidate_ = 0;
  int64_t multi_dim_ = 0;
  size_t subset_ = 0;
};

// The bucket of a planned call whose family's extents span [min_n, max_n]
// (PolyBucket's rule: powers of two for wide families) into plan.bucket,
// and the key of that bucket's program into `poly_key` (hash set).
void BucketKey(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
               const lowering::LoweringEntry& entry, int64_t min_n, int64_t max_n,
               const void* op_id, PolyPlan& plan, OpKey& poly_key) {
  const int64_t dim = plan.dim;
  if (dim >= 0) {
    const at::Tensor& lt = TensorItem(stack[first + static_cast<size_t>(plan.leader)], plan.leader_item);
    int64_t outer = 1;
    for (int64_t d = 0; d < dim && d < lt.dim(); ++d) outer *= lt.size(d);
    const bool wide = max_n >= 2 * min_n && (plan.multi_n > 0 || entry.traits.poly_matmul || outer > 1);
    plan.bucket =
        (PolyBucket(plan.rows_scale * plan.extent + plan.rows_offset, wide) - plan.rows_offset) / plan.rows_scale;
    // mm/addmm's rows of a left matrix that is its whole storage: the rows
    // its buffer holds where that is a wide bucket (a power of two >= 16)
    // above the rule's. The left matrix is most often a [b * t, d] view of
    // [b, t, d] activations, whose families bucket t: the buffer a bucket
    // program gave it holds b * bucket(t) rows, and bucket(b * t) differs
    // from that for t < 16 (b = 2: 16 rows, the buffer 32) — every such
    // call resized the buffer to 16 rows and its output back for the next
    // [b, t, ...] program: a resize program per size pair and two launches
    // per linear (session 21: 361 of a warm generate() call's 3713 launches).
    if (wide && entry.traits.poly_matmul && lt.dim() == 2 && lt.size(1) > 0) {
      const DeviceStorage& ds = StorageOf(lt);
      const int64_t row = lt.size(1);
      const StorageBuffer& cur = ds.current();
      if (ds.initialized() && cur.numel % row == 0 &&
          static_cast<size_t>(lt.numel()) * lt.element_size() == ds.nbytes()) {
        const int64_t held = cur.numel / row;
        if (held > plan.bucket && held == PolyBucket(held, true)) plan.bucket = held;
      }
    }
  }
  poly_key.op = op_id;
  poly_key.atoms.clear();
  poly_key.atoms.push_back(-1);  // not a default dtype: no exact key starts so
  poly_key.atoms.push_back(plan.bucket);
  poly_key.atoms.push_back(plan.leader);
  poly_key.atoms.push_back(plan.leader_item);
  poly_key.atoms.push_back(plan.multi_n > 0 ? -2 : dim);
  StorageIds poly_ids;
  AppendCallKey(op, stack, first, entry, poly_key.atoms, poly_ids, plan.dynamic, plan.bucket, dim, false,
                plan.multi_n, plan.marks);
  poly_key.hash = KeyHash(poly_key);
}

}  // namespace

// Fused recording of a new exact key (spec_only): where strict mode would
// serve the call with a bucket program that exists (its family ripe,
// PolyCandidates and BucketKey as Lookup's loop, the families left as they
// are), the call's spec is that program's at the call's extent — output
// sizes and strides as its launch gives them (DynamicOutputSizes,
// OutputStrides), written arguments at their own sizes — instead of a meta
// kernel run and a lowering (a generate() call with a prompt of a new length
// recorded ~110 new keys at ~0.17 ms each, mostly the meta kernel: the
// fused +4 call's excess over strict's). The entry has no program: it
// stays in recorded_ (strict lookups never read it; a region built from it
// lowers the call with this spec). Not for calls with out= tensors, n = 0,
// or a bucket program whose spec resizes. `ripe` is set where no bucket
// program exists yet but strict mode would build one for the call (a family
// that compiled kPolyAfter shapes, not an n = 1 multi-dim call): the call's
// exact program would never be used (Lookup's spec_only path then keeps a
// meta-kernel spec only).
std::shared_ptr<CompiledOp> OpCache::SpecFromBucket(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                                    size_t first, const lowering::LoweringEntry& entry,
                                                    const OpKey& key, bool* ripe) {
  const auto& args = op.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (IsOutArg(args[i]) && v.isTensor() && v.toTensor().defined()) return nullptr;
  }
  PolyCandidates candidates(op, stack, first, entry, /*shape_poly=*/true);
  PolyPlan plan;
  thread_local OpKey family_key;
  thread_local OpKey poly_key;
  std::shared_ptr<const CompiledOp> bucket;
  bool strict_builds = false;  // a ripe family before `bucket`'s would build its program in Lookup
  while (!bucket && candidates.Next(plan, key.op, family_key)) {
    // The extents Lookup's loop notes, as it notes them (idempotent: it
    // notes them again when the call runs).
    Family& fam = families_[family_key.hash];
    if (plan.dim >= 0) {
      fam.min_n = std::min(fam.min_n, plan.extent);
      fam.max_n = std::max(fam.max_n, plan.extent);
    }
    if (fam.count < kPolyAfter || plan.extent < 1) continue;
    BucketKey(op, stack, first, entry, fam.min_n, fam.max_n, key.op, plan, poly_key);
    bucket = cache_.Find(poly_key);
    if (!bucket && plan.multi_n != 1) *ripe = strict_builds = true;
  }
  if (!bucket || bucket->poly_leader < 0 || !bucket->spec.resize_outputs.empty()) return nullptr;
  // The exact key serves the call's strict lookup directly (a region run op
  // by op looks it up again), as Lookup's loop makes it serve, where that
  // loop would reach the same program.
  if (!strict_builds) cache_.Insert(key, bucket);
  const at::Tensor& leader = TensorItem(stack[first + static_cast<size_t>(bucket->poly_leader)], bucket->poly_leader_item);
  auto derived = std::make_shared<CompiledOp>();
  derived->name = bucket->name;
  derived->entry = bucket->entry;
  derived->spec = bucket->spec;
  derived->out_resize = bucket->out_resize;
  CallSpec& spec = derived->spec;
  for (size_t r = 0; r < spec.outputs.size(); ++r) {
    if (!spec.defined[r]) continue;
    if (spec.return_alias[r] >= 0) {
      spec.outputs[r].sizes = stack[first + static_cast<size_t>(spec.return_alias[r])].toTensor().sizes().vec();
      continue;
    }
    const ReturnSlot& rs = bucket->returns[r];
    if (rs.is_arg || rs.index < 0) return nullptr;
    const OutputSlot& o = bucket->outputs[static_cast<size_t>(rs.index)];
    if (!o.dynamic) continue;  // static: the bucket's sizes and strides are the call's
    spec.outputs[r].sizes = DynamicOutputSizes(o, bucket->poly_dim, leader);
    spec.strides[r] = OutputStrides(o, spec.outputs[r].sizes);
  }
  return derived;
}

std::shared_ptr<const CompiledOp> OpCache::Lookup(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                                  const lowering::LoweringEntry& entry, bool shape_poly,
                                                  bool* host_served, bool spec_only) {
  size_t num_args = op.schema().arguments().size();
  size_t first = stack.size() - num_args;
  thread_local OpKey key;
  BuildKey(op, stack, first, entry, key);
  std::unique_lock<std::mutex> lock(mutex_);
  auto& metrics = Runtime::Get().metrics();
  // Before a compile (a miss): Compile resizes out= tensors as the call
  // would (ApplyResizes), and resizing a storage flushes a recorded fused
  // region, whose calls run through this lookup — under our lock, a
  // deadlock (fused mode: add(a, b, out=o), then mul(a, b, out=empty)
  // hung; review, session 20). So a call with an out= tensor to resize
  // flushes first, unlocked, and looks up again (the key is rebuilt: the
  // flush's lookups share the thread's key). Once per call: a flush already
  // running (a region's calls run one by one) returns at once.
  thread_local bool out_flushed = false;
  auto flush_for_out = [&]() -> bool {
    if (out_flushed || !HasPendingWork()) return false;
    const auto& args = op.schema().arguments();
    bool has_out = false;
    for (size_t i = 0; i < args.size(); ++i)
      has_out |= IsOutArg(args[i]) && stack[first + i].isTensor() && stack[first + i].toTensor().defined();
    if (!has_out) return false;
    // Only where the compile will resize (a meta kernel run: out= calls
    // only). Flushing every out= call that compiles cut generate()'s
    // decoding steps at its `where(..., out=)` (fused warm call 0.133 s
    // against 0.078 s).
    try {
      if (ComputeSpec(op, stack, first, entry.traits.out_resized_by_numel).resize_outputs.empty()) return false;
    } catch (const std::exception&) {
      return false;  // the compile raises it
    }
    lock.unlock();
    out_flushed = true;  // until the lookup again returns (relookup)
    try {
      FlushPendingWork();
    } catch (...) {
      out_flushed = false;
      throw;
    }
    return true;
  };
  auto relookup = [&]() {
    struct Reset {
      ~Reset() { out_flushed = false; }
    } reset;
    return Lookup(op, stack, entry, shape_poly, host_served, spec_only);
  };
  // Fused recording: the exact program's spec, compiled or not.
  // Where a bucket program serves the key in cache_ (strict calls), the
  // exact entry is kept in recorded_, so recording does not rebuild it.
  if (spec_only) {
    if (auto hit = cache_.Find(key); hit && hit->poly_leader < 0) {
      metrics.cache_hits++;
      return hit;
    }
    if (auto hit = recorded_.Find(key)) {
      metrics.cache_hits++;
      return hit;
    }
    // A call with a view at a nonzero offset: its spec (output sizes,
    // dtypes and strides, resizes, aliases) does not depend on the offsets,
    // so one recorded entry serves the offset family's calls (the region
    // key and program take the offsets at launch). Kept out of cache_: its
    // program has this call's offsets. Else a fused loop over x[:, k]
    // lowered a program per offset and filled both caches with them.
    const bool offsets = ShapePolyEnabled() && HasOffsetView(op, stack, first);
    thread_local OpKey offset_key;
    if (offsets) {
      BuildOffsetKey(op, stack, first, entry, offset_key);
      if (auto hit = recorded_.Find(offset_key)) {
        metrics.cache_hits++;
        return hit;
      }
    }
    // A view at an offset too: strict mode's bucket programs for it keep
    // the offset in their key (BucketKey), as the call's spec does not.
    bool ripe = false;
    if (auto derived = SpecFromBucket(op, stack, first, entry, key, &ripe)) {
      metrics.cache_misses++;
      return recorded_.Insert(key, std::move(derived));
    }
    // A family strict mode serves with a bucket program it has not built
    // yet: the call's spec from the meta kernel, no lowering (its exact
    // program would never run: the region lowers the call itself, a call
    // run op by op builds the bucket program). The (c) block of
    // bench_dynamic_shapes recorded 118 such keys in its first pass, ~30 us
    // each to lower and print (fused's first pass 1.1-1.25x strict's).
    if (ripe) {
      CallSpec spec = ComputeSpec(op, stack, first, entry.traits.out_resized_by_numel);
      if (spec.resize_outputs.empty()) {
        auto built = std::make_shared<CompiledOp>();
        built->entry = &entry;
        built->name = op.schema().name();
        built->out_resize = spec.out_resize;
        built->spec = std::move(spec);
        metrics.cache_misses++;
        return recorded_.Insert(key, std::move(built));
      }
    }
    if (flush_for_out()) return relookup();
    metrics.cache_misses++;
    Deferred d;
    std::shared_ptr<CompiledOp> built(Compile(op, stack, first, entry, nullptr, &d));
    PrepareBackground(built, d);  // calls = 0: recording is not a call
    if (offsets) return recorded_.Insert(offset_key, std::move(built));
    if (!cache_.Find(key)) cache_.Insert(key, built);
    return recorded_.Insert(key, std::move(built));
  }
  // A program compiling in the background (an earlier host-first call) is
  // waited for without the lock: the compile thread does not take it.
  // With TORCH_TPU_HOST_FIRST_COMPILE_AFTER = N > 1, a strict call that
  // qualifies is host-served again instead — its compile is queued at its
  // call in the N-th sync epoch that called the key, or at its
  // kHostFirstBurst-th call in one epoch (a loop with no sync point) — any
  // other caller queues it and waits. Epochs, not calls: a key called again
  // after a sync point is a loop's, one called twice before it may be two
  // layers' at a shape seen once (a transformer block's two layer norms and
  // two residual adds at each of 20 sequence lengths compiled an exact
  // program for the first lengths, which bucket programs serve from the
  // second pass on: two compiles per op more than the buckets', and their
  // outputs' buffers are not the buckets' (a resize or an exact program for
  // each consumer)).
  auto ready = [&](std::shared_ptr<const CompiledOp> op_) {
    if (PendingCompile* p = op_->pending.get(); p && !p->ready.load(std::memory_order_acquire)) {
      p->called = true;
      const int64_t after = HostFirstCompileAfter();
      const bool host = after > 1 && host_served && HostFirstCall(op, stack, first, entry) &&
                        HostFirstFits(op, stack, first, *op_);
      // A region's call while the region's program compiles
      // (HostFirstDeferScope): host-served, not counted.
      if (host && host_first_deferred) {
        *host_served = true;
        return op_;
      }
      if (const uint64_t epoch = SyncCount(); epoch != p->epoch || p->calls == 0) {
        p->epoch = epoch;
        p->epoch_calls = 0;
        ++p->calls;
      }
      ++p->epoch_calls;
      if (host) {
        if (p->calls >= after || p->epoch_calls >= kHostFirstBurst) QueueCompile(op_);
        *host_served = true;
        return op_;
      }
      QueueCompile(op_);
      lock.unlock();
      AwaitCompiled(*op_);
    }
    return op_;
  };
  // An exact key also holds the bucket program that served it (below), for
  // shape_poly callers only: the fused executor reads the call's own spec.
  // An exact entry a fused recording built (spec_only) and no call has used
  // yet does not keep a shape_poly caller (a fused region run op by op) off
  // the polymorphic path: it serves the call only where no bucket program
  // does, counted as the family's exact shape then (strict mode's keys and
  // compiles, whichever mode recorded first). Likewise an exact entry whose
  // program was never queued (a host-first call served it on the host):
  // at its next call a bucket program of its family that exists by then
  // serves it, instead of compiling the exact program (a loop over 20
  // lengths otherwise compiled, in its second pass, an exact program per
  // length that its first pass had served on the host; its family was
  // counted at its first call). No bucket program is built for it (below).
  std::shared_ptr<const CompiledOp> recorded;
  bool recorded_counted = false;
  if (auto hit = cache_.Find(key); hit && (shape_poly || hit->poly_leader < 0)) {
    const PendingCompile* p = hit->pending.get();
    if (!(shape_poly && p && !p->queued && hit->poly_leader < 0)) {  // never queued, so not ready
      metrics.cache_hits++;
      return ready(std::move(hit));
    }
    recorded_counted = p->called;
    recorded = std::move(hit);
  }
  const bool host_first = host_served && HostFirstCall(op, stack, first, entry);
  // Compiles the built program: in the background (the call is served on
  // the host) where it qualifies, else now.
  auto finish = [&](std::unique_ptr<CompiledOp> built, const Deferred& d) -> std::shared_ptr<CompiledOp> {
    std::shared_ptr<CompiledOp> compiled(std::move(built));
    if (HostFirstProgram(op, stack, first, *compiled)) {
      PrepareBackground(compiled, d);
      compiled->pending->calls = host_first_deferred && HostFirstCompileAfter() > 1 ? 0 : 1;
      compiled->pending->epoch = SyncCount();
      compiled->pending->epoch_calls = compiled->pending->calls;
      compiled->pending->called = true;
      if (HostFirstCompileAfter() <= 1) QueueCompile(compiled);
      *host_served = true;
    } else {
      FinishCompile(*compiled, d);
    }
    return compiled;
  };
  // A family's program (a bucket's, `plan`, or an offset family's): built,
  // then compiled as `finish` does; null where the lowering or the compile
  // declines (the exact program then serves, raising what the call raises).
  auto family_program = [&](const PolyPlan* plan, bool runtime_offsets) -> std::shared_ptr<const CompiledOp> {
    std::unique_ptr<CompiledOp> built;
    Deferred d;
    try {
      built = Compile(op, stack, first, entry, plan, &d, runtime_offsets);
    } catch (const std::exception&) {
      return nullptr;
    }
    metrics.cache_misses++;
    if (host_first) return finish(std::move(built), d);
    try {
      FinishCompile(*built, d);
    } catch (const std::exception&) {
      return nullptr;
    }
    return built;
  };
  // Shape churn (DESIGN.md "One ATen call", dynamic dims): the exact key
  // missed; a call of a family that compiled kPolyAfter shapes already is
  // served by (or compiles) the program for its bucket.
  // Every dim d of the highest-rank tensors that the call could share
  // along (PlanPoly) is a family of its own (the key without the dynamic
  // tensors' dim d); the first that compiled kPolyAfter exact shapes
  // serves the call, the others count this compile.
  std::vector<int*> families;
  if (families_.size() > (size_t{1} << 16)) families_.clear();  // a bound; only the heuristic forgets
  // Offset churn (an offset family; DESIGN.md "Shape-polymorphic eager
  // programs"): the exact key missed for a call with a tensor at a nonzero
  // storage offset. Once kPolyAfter offsets of the same views (sizes,
  // strides, storages, dtypes) compiled, one program that reads the offsets
  // at launch serves every offset (ProgramBuilder::runtime_offsets). The
  // exact key is not added for it: a loop over thousands of offsets
  // (x[:, k] for each column) would fill the cache with them.
  // TORCH_TPU_SHAPE_POLY=0: exact offsets only.
  if (ShapePolyEnabled() && HasOffsetView(op, stack, first)) {
    thread_local OpKey offset_key;
    BuildOffsetKey(op, stack, first, entry, offset_key);
    if (auto hit = cache_.Find(offset_key)) {
      metrics.cache_hits++;
      return ready(std::move(hit));
    }
    int* family = &families_[offset_key.hash].count;
    if (*family >= kPolyAfter && !recorded) {
      if (auto compiled = family_program(nullptr, /*runtime_offsets=*/true))
        return cache_.Insert(offset_key, std::move(compiled));
      *family = -1;  // declined: this view keeps exact offsets
    } else if (*family >= 0 && *family < kPolyAfter) {
      families.push_back(family);
    }
  }
  PolyCandidates candidates(op, stack, first, entry, shape_poly);
  PolyPlan plan;
  thread_local OpKey family_key;
  thread_local OpKey poly_key;
  while (candidates.Next(plan, key.op, family_key)) {
    Family& fam = families_[family_key.hash];
    int* family = &fam.count;
    if (plan.dim >= 0) {
      fam.min_n = std::min(fam.min_n, plan.extent);
      fam.max_n = std::max(fam.max_n, plan.extent);
    }
    if (*family < kPolyAfter) {
      if (*family >= 0) families.push_back(family);
      continue;
    }
    BucketKey(op, stack, first, entry, fam.min_n, fam.max_n, key.op, plan, poly_key);
    if (auto hit = cache_.Find(poly_key)) {
      metrics.cache_hits++;
      // A displaced exact entry keeps its spec for fused recording.
      if (recorded) recorded_.Insert(key, recorded);
      // The exact key serves later calls directly (no poly key to build).
      cache_.Insert(key, hit);
      return ready(std::move(hit));
    }
    // A key served on the host takes a bucket program that exists, never a
    // new one: a family's first kPolyAfter shapes keep exact programs (a
    // static workload whose two shapes of one family were both first
    // called before either was called again otherwise ran both through a
    // bucket program for good: for a dim-1 family of [32, n], 32 dynamic
    // slices in and out, 2.1x the exact program's time; review).
    if (recorded_counted) continue;
    // n = 1 of a multi-dim family (size-1 dims marked, BoxOf) takes a bucket
    // program that exists, never builds one: it would lower the dynamic
    // dims from a call where every size-1 dim looks alike.
    if (plan.multi_n == 1) continue;
    if (auto compiled = family_program(&plan, /*runtime_offsets=*/false)) {
      if (recorded) recorded_.Insert(key, recorded);
      cache_.Insert(key, compiled);
      return cache_.Insert(poly_key, std::move(compiled));
    }
    *family = -1;  // declined: this family keeps exact shapes
  }
  if (recorded) {
    if (!recorded_counted)
      for (int* family : families) ++*family;
    metrics.cache_hits++;
    return ready(std::move(recorded));
  }
  if (flush_for_out()) return relookup();
  metrics.cache_misses++;
  std::shared_ptr<const CompiledOp> compiled;
  if (host_first) {
    Deferred d;
    compiled = finish(Compile(op, stack, first, entry, nullptr, &d), d);
  } else {
    compiled = Compile(op, stack, first, entry);
  }
  for (int* family : families) ++*family;
  return cache_.Insert(key, std::move(compiled));
}

std::vector<int64_t> DynamicOutputSizes(const OutputSlot& o, int poly_dim, const at::Tensor& leader) {
  if (poly_dim < 0) return leader.sizes().vec();  // flat (PlanPolyFlat)
  std::vector<int64_t> sizes = o.sizes;
  const int64_t n = leader.size(poly_dim);
  if (o.dynamic_mask) {  // multi-dim (PlanPolyMulti)
    for (size_t k = 0; k < sizes.size(); ++k)
      if ((o.dynamic_mask >> k) & 1) sizes[k] = n;
  } else {
    sizes[static_cast<size_t>(o.dynamic_dim)] = o.dynamic_scale * n + o.dynamic_offset;
  }
  return sizes;
}

std::vector<int64_t> OutputStrides(const OutputSlot& o, std::span<const int64_t> sizes) {
  if (o.order.empty()) return o.strides;
  std::vector<int64_t> strides(sizes.size(), 0);
  int64_t stride = 1;
  for (size_t i = o.order.size(); i-- > 0;) {
    strides[static_cast<size_t>(o.order[i])] = stride;
    stride *= sizes[static_cast<size_t>(o.order[i])];
  }
  return strides;
}

DeviceStorage& StorageOf(const at::Tensor& t) {
  const c10::DataPtr& data = t.storage().data_ptr();
  // The tpu allocator's DataPtrs have the DeviceStorage as context; any other
  // context (at::from_blob with a deleter, as DLPack's importer makes) is not
  // a DeviceStorage and must not be read as one.
  static const c10::DeleterFnPtr tpu_deleter = c10::GetAllocator(c10::DeviceType::PrivateUse1)->raw_deleter();
  if (data.get_context() && data.get_deleter() == tpu_deleter)
    return *static_cast<DeviceStorage*>(data.get_context());
  // at::from_blob over a tpu data pointer (legacy torch.save / pickle copy a
  // storage to the host that way; torch.from_dlpack imports a capsule that
  // way): the pointer is the DeviceStorage.
  if (DeviceStorage* found = FindLiveStorage(data.get())) return *found;
  if (!data.get()) throw std::runtime_error("tpu tensor without device storage");
  throw std::runtime_error(
      "tpu tensor over a data pointer that is not the start of a live tpu storage (a DLPack import of a "
      "view with a nonzero storage offset, or at::from_blob over a foreign pointer): not supported; "
      "export a tensor with storage_offset() == 0, e.g. t.clone()");
}

at::Tensor WrapBuffer(StorageBuffer buffer, at::IntArrayRef sizes, at::ScalarType dtype, int device_index,
                      at::IntArrayRef strides) {
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_index)));
  at::Tensor t = strides.empty()
                     ? at::detail::empty_generic(sizes, c10::GetAllocator(c10::DeviceType::PrivateUse1),
                                                 c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype,
                                                 std::nullopt)
                     : at::detail::empty_strided_generic(sizes, strides,
                                                         c10::GetAllocator(c10::DeviceType::PrivateUse1),
                                                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype);
  StorageOf(t).Set(std::move(buffer));
  return t;
}

const at::Tensor& TensorItem(const c10::IValue& v, int16_t item) {
  if (item < 0) return v.toTensor();
  return v.toListRef()[static_cast<size_t>(item)].toTensor();
}

const at::Tensor& TensorOf(const ArgResolver& arg_of, int32_t call, int16_t arg, int16_t item) {
  return TensorItem(arg_of(call, arg), item);
}

// `sb`'s contents in a buffer of `numel` elements (the prefix copied, the
// rest zeros; a shorter buffer keeps the first `numel`): a device program
// per (element type, sizes), compiled once and counted in
// metrics()["compiles"] and in compiles_by_op as "tpu::resize_buffer".
// The new buffer inherits `sb`'s checks and producer. Asynchronous like any
// launch (tracked for the next sync point).
// Host-first, as a single-op call (DESIGN.md "Host-first calls"): where the
// program is neither compiled nor in the disk cache and the buffers are
// small (HostFirstMaxBytes), the resize is served on the host (the prefix
// downloaded — a wait for `sb`'s producer — and the new buffer uploaded)
// while its program compiles on the background thread, counted when
// queued; later resizes of that key are host-served until it is ready.
// Before, its compile ran on the launch path: a generate() call whose
// bucket programs met exact programs' buffers for the first time spent
// 3.7 of its 4.1 s compiling 27 resize programs.
StorageBuffer ResizeStorageBuffer(const StorageBuffer& sb, int64_t numel, int device_index) {
  using Key = std::tuple<int, int64_t, int64_t>;
  static std::mutex mutex;
  static std::map<Key, std::shared_ptr<pjrt::Executable>> programs;
  static std::set<Key> compiling;  // queued on the background compile thread
  auto& rt = Runtime::Get();
  const Key key = std::make_tuple(static_cast<int>(sb.element), sb.numel, numel);
  if (sb.host.owner) {  // the contents as uploaded: upload them again at the new size, no program
    const size_t keep = std::min(sb.host.size, static_cast<size_t>(numel) * ElementSize(sb.element));
    StorageBuffer out = rt.UploadStorage(sb.host.data, keep, sb.element, device_index, sb.producer, numel);
    out.checks = sb.checks;
    out.host = {};  // a program reads it now (GatherInputs)
    return out;
  }
  std::shared_ptr<pjrt::Executable> exe;
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = programs.find(key); it != programs.end()) exe = it->second;
    queued = compiling.count(key) != 0;
  }
  const int64_t element_size = ElementSize(sb.element);
  auto serve_on_host = [&] {
    std::vector<char> host(static_cast<size_t>(numel * element_size), 0);
    const int64_t keep = std::min(sb.numel, numel);
    std::shared_ptr<pjrt::Buffer> out;
    try {
      if (keep > 0) sb.buffer->ToHost(host.data(), static_cast<size_t>(keep * element_size));
      int64_t dims[] = {numel};
      out = rt.Upload(host.data(), sb.element, dims, device_index);
    } catch (const pjrt::Error& e) {
      RethrowDeviceError(e, "tpu::resize_buffer", device_index);
    }
    return StorageBuffer{std::move(out), sb.element, numel, sb.producer, sb.checks};
  };
  if (!exe && queued) return serve_on_host();
  if (!exe) {
    const auto start = std::chrono::steady_clock::now();
    hlo::Builder b;
    hlo::Value in = b.Parameter(hlo::TensorType{sb.element, {sb.numel}});
    hlo::Value out[] = {lowering::ResizeFlat(b, in, numel)};
    b.Return(out);
    const std::string name = "tpu::resize_buffer";
    std::string module = b.Module();
    CallSignature signature;
    signature.layout = c10::hash_combine(std::hash<int64_t>()(sb.numel), std::hash<int64_t>()(numel));
    signature.dtypes = std::hash<int>()(static_cast<int>(sb.element));
    signature.shapes = "[" + std::to_string(sb.numel) + "] -> [" + std::to_string(numel) + "]";
    auto insert = [key](std::shared_ptr<pjrt::Executable> e) {
      std::lock_guard<std::mutex> lock(mutex);
      compiling.erase(key);
      if (programs.size() >= MaxCachedExecutables()) programs.clear();  // a bound: recompiled on demand
      programs.emplace(key, std::move(e));
    };
    if (HostFirstEnabled() && (sb.numel + numel) * element_size <= HostFirstMaxBytes() &&
        !InDiskCache(module, /*single_op=*/true)) {
      CheckBackgroundCompileSettings();  // before the key is marked as compiling
      {
        std::lock_guard<std::mutex> lock(mutex);
        queued = !compiling.insert(key).second;
      }
      if (!queued) {
        // Counted when queued, as PrepareBackground's compiles.
        rt.metrics().compiles++;
        CompileStats::Get().Record(name, signature,
                                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        SubmitBackgroundCompile([name, module = std::move(module), insert, key] {
          try {
            insert(CompileModule(name, module, /*single_op=*/true, /*count=*/false));
          } catch (...) {  // the next resize of this key compiles on the launch path and raises there
            std::lock_guard<std::mutex> lock(mutex);
            compiling.erase(key);
          }
        });
      }
      return serve_on_host();
    }
    exe = CompileModule(name, module, /*single_op=*/true);
    CompileStats::Get().Record(name, signature,
                               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    insert(exe);
  }
  pjrt::Buffer* args[] = {sb.buffer.get()};
  std::unique_ptr<pjrt::Event> done;
  std::vector<std::unique_ptr<pjrt::Buffer>> outs;
  try {
    outs = exe->Execute(args, rt.device(device_index), {}, &done);
  } catch (const pjrt::Error& e) {
    RethrowDeviceError(e, "tpu::resize_buffer", device_index);
  }
  rt.metrics().executions++;
  if (done) rt.Track(std::move(done), "tpu::resize_buffer");
  return StorageBuffer{std::shared_ptr<pjrt::Buffer>(std::move(outs[0])), sb.element, numel, sb.producer, sb.checks};
}

LaunchInputs GatherInputs(const std::vector<InputSlot>& inputs, const ArgResolver& arg_of, int default_device,
                          const std::vector<int64_t>& donors, bool poisoned_ok) {
  auto& rt = Runtime::Get();
  LaunchInputs li;
  li.buffers.resize(inputs.size());
  int device_index = -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const InputSlot& s = inputs[i];
    if (s.kind != InputSlot::Kind::kStorage) continue;
    const at::Tensor& t = TensorOf(arg_of, s.call, s.arg, s.item);
    if (device_index < 0) device_index = t.device().index();
    DeviceStorage& storage = StorageOf(t);
    const StorageBuffer* current = &storage.Materialize(s.element, poisoned_ok, s.canonical ? s.numel : -1);
    if (current->host.owner && (s.numel < 0 || current->numel == s.numel)) storage.DropHostShadow();
    if (s.numel >= 0 && current->numel != s.numel) {
      // The buffer the program declares (InputSlot::numel): the storage's
      // contents resized to it. For a poly read (its canonical buffer) the
      // storage keeps the new buffer where it holds all its elements (the
      // next read hits); otherwise (a prefix view of a longer storage, or a
      // buffer swapped since the call was keyed) it is this launch's. It is
      // the launch's under a HostFirstDeferScope too (a fused region's calls
      // run one by one while its program compiles, or a region of a
      // compiling key passed through): the storage keeps the buffer the
      // region's key holds and its program declares, else the program's
      // next sight is a new key (compiled again, run op by op again).
      StorageBuffer resized = ResizeStorageBuffer(*current, s.numel, t.device().index());
      if (s.canonical && !host_first_deferred &&
          static_cast<size_t>(s.numel) * ElementSize(s.element) >= storage.nbytes()) {
        storage.Set(std::move(resized));
        current = &storage.current();
      } else {
        li.temps.push_back(resized.buffer);
        if (!resized.checks.empty()) InheritChecks(li.checks, resized.checks);
        li.buffers[i] = resized.buffer.get();
        continue;
      }
    }
    const StorageBuffer& sb = *current;
    if (!sb.checks.empty()) InheritChecks(li.checks, sb.checks);
    li.buffers[i] = sb.buffer.get();
    if (sb.buffer.use_count() == 1 && std::find(donors.begin(), donors.end(), static_cast<int64_t>(i)) != donors.end())
      li.donated.push_back(static_cast<int64_t>(i));
  }
  li.device_index = device_index < 0 ? default_device : device_index;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const InputSlot& s = inputs[i];
    if (s.kind == InputSlot::Kind::kOffset) {
      const int64_t offset = TensorOf(arg_of, s.call, s.arg, s.item).storage_offset();
      li.temps.push_back(rt.ScalarBuffer(&offset, hlo::ElementType::kS64, li.device_index));
      li.buffers[i] = li.temps.back().get();
    } else if (s.kind == InputSlot::Kind::kExtent) {
      const at::Tensor& leader = TensorOf(arg_of, s.call, s.arg, s.item);
      const int64_t n = s.extent_dim < 0 ? leader.numel() : leader.size(s.extent_dim);  // < 0: flat
      li.temps.push_back(rt.ScalarBuffer(&n, hlo::ElementType::kS64, li.device_index));
      li.buffers[i] = li.temps.back().get();
    } else if (s.kind == InputSlot::Kind::kScalar) {
      const c10::IValue& v = arg_of(s.call, s.arg);
      c10::Scalar scalar = v.isTensor() ? v.toTensor().item() : v.toScalar();
      alignas(16) char bytes[16] = {};
      ScalarToBytes(scalar, s.element, bytes, /*checked=*/!v.isTensor());
      li.temps.push_back(rt.ScalarBuffer(bytes, s.element, li.device_index));
      li.buffers[i] = li.temps.back().get();
    } else if (s.kind == InputSlot::Kind::kRng) {
      at::Generator gen;
      if (s.arg >= 0 && arg_of(s.call, s.arg).isGenerator())
        gen = arg_of(s.call, s.arg).toGenerator();
      else
        gen = at::globalContext().defaultGenerator(
            c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(li.device_index)));
      const int64_t increment =
          s.rng_numel_of < 0
              ? s.rng_increment
              : lowering::LoweringContext::RngIncrementOf(TensorOf(arg_of, s.call, s.rng_numel_of, -1).numel());
      const std::array<uint64_t, 2> state = DrawRngState(gen, static_cast<uint64_t>(increment));
      int64_t dims[] = {2};
      li.temps.push_back(rt.Upload(state.data(), hlo::ElementType::kU64, dims, li.device_index));
      li.buffers[i] = li.temps.back().get();
    }
  }
  return li;
}

std::vector<at::Tensor> Launch(const CompiledOp& op, torch::jit::Stack& stack, size_t num_args) {
  auto& rt = Runtime::Get();
  const size_t first = stack.size() - num_args;
  ResizeOuts(op.resize_outputs, op.out_resize, stack, first);
  ArgResolver arg_of = [&](int32_t, int16_t arg) -> const c10::IValue& {
    return stack[first + static_cast<size_t>(arg)];
  };
  int default_device = 0;  // factories: the device argument, else the current device
  for (size_t i = first; i < stack.size(); ++i)
    if (stack[i].isDevice())
      default_device = stack[i].toDevice().has_index()
                           ? stack[i].toDevice().index()
                           : c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  LaunchInputs li = GatherInputs(op.inputs, arg_of, default_device, op.donor_inputs);

  std::unique_ptr<pjrt::Event> done;
  std::vector<std::unique_ptr<pjrt::Buffer>> outs;
  {
    ProfileScope profile("tpu::execute", op.name);  // torch.profiler event (waits while profiling)
    try {
      outs = op.executable->Execute(li.buffers, rt.device(li.device_index), li.donated, &done);
    } catch (const pjrt::Error& e) {
      RethrowDeviceError(e, op.name, li.device_index);  // RESOURCE_EXHAUSTED -> torch.OutOfMemoryError
    }
    profile.AwaitIfActive(done.get());
  }
  rt.metrics().executions++;
  if (!li.donated.empty()) rt.metrics().donated_buffers += static_cast<int64_t>(li.donated.size());

  // The program's checks guard every storage it writes (poisoned until
  // overwritten when one fails), as do the unresolved checks of its inputs.
  CheckList own;
  if (!op.check_messages.empty()) {
    size_t check = 0;
    for (size_t i = 0; i < op.outputs.size(); ++i)
      if (op.outputs[i].kind == OutputSlot::Kind::kIndexCheck)
        own.push_back(rt.AddPendingCheck(std::shared_ptr<pjrt::Buffer>(std::move(outs[i])),
                                         op.check_messages[check++]));
  }
  std::vector<at::Tensor> new_tensors;
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    const OutputSlot& o = op.outputs[i];
    if (o.kind == OutputSlot::Kind::kIndexCheck) continue;
    StorageBuffer sb{std::shared_ptr<pjrt::Buffer>(std::move(outs[i])), o.element, o.numel, op.name};
    PoisonWith(sb, li.checks, own);
    if (o.kind == OutputSlot::Kind::kNewTensor && o.dynamic) {
      const std::vector<int64_t> sizes =
          DynamicOutputSizes(o, op.poly_dim, TensorOf(arg_of, 0, op.poly_leader, op.poly_leader_item));
      new_tensors.push_back(WrapBuffer(std::move(sb), sizes, o.dtype, li.device_index, OutputStrides(o, sizes)));
    } else if (o.kind == OutputSlot::Kind::kNewTensor) {
      new_tensors.push_back(WrapBuffer(std::move(sb), o.sizes, o.dtype, li.device_index, o.strides));
    } else {
      StorageOf(TensorOf(arg_of, 0, o.arg, o.item)).Set(std::move(sb));
    }
  }
  if (done) rt.Track(std::move(done), op.name);

  // Replace the arguments by the returns.
  std::vector<c10::IValue> returns;
  returns.reserve(op.returns.size());
  for (const auto& r : op.returns) {
    if (r.is_arg) returns.push_back(stack[first + static_cast<size_t>(r.index)]);
    else if (r.index < 0) returns.emplace_back(at::Tensor());
    else returns.emplace_back(new_tensors[static_cast<size_t>(r.index)]);
  }
  stack.erase(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  for (auto& v : returns) stack.push_back(std::move(v));
  return new_tensors;
}

}  // namespace torch_tpu::runtime
