// Kernels for the tpu key of ops whose output SHAPE depends on the input
// VALUES: nonzero, masked_select, unique (_unique, _unique2, unique_dim),
// unique_consecutive (+ unique_dim_consecutive), and equal (a host bool).
//
// Why kernels and not lowerings: a lowering is compiled for output shapes
// that PyTorch's meta kernels compute from the input shapes alone
// (docs/design.md, "One ATen call, end to end"); these ops have no such
// shape. Each kernel instead
//   1. computes the output size on the device with lowered ops,
//   2. reads it to the host with ONE sync (`.item()`; in fused mode this is a
//      sync point that flushes the recorded region),
//   3. produces the result with lowered ATen ops on tpu tensors of now-known
//      shapes (nonzero_static with the counted size, index_select, scatter,
//      sort, cumsum, ...): the data never leaves the device and no CPU
//      fallback runs.
// They sit below autograd (VariableType) like any backend kernel, so
// masked_select keeps its derivative formula (masked_scatter, lowered).
//
// Also here, composed of lowered ops for the range checks the index
// machinery offers (IndexCheck traits measure one dimension, while these
// index the flattened tensor): take (= self.flatten()[index]) and put_
// (= flatten().index_put_({index}, source)): negative indices wrap and
// out-of-range ones raise IndexError at the next sync point (debug mode:
// at the op), as index/index_put report them.
//
// Semantics follow PyTorch's CPU kernels (aten/src/ATen/native/Unique.cpp,
// Nonzero/TensorAdvancedIndexing.cpp, ReduceOps.cpp for equal):
//  - unique always sorts (CPU ignores sorted=False); NaNs are never equal to
//    each other, so each NaN is its own value, sorted last; inverse has the
//    input's shape (_unique2) or [size(dim)] (dim variants); absent
//    inverse/counts are empty s64 tensors, except for unique_dim and
//    unique_dim_consecutive, which (as on CPU) always compute both.
//  - unique_dim orders slices lexicographically (element 0 of the flattened
//    slice most significant). Computed as a dense rank per column (one
//    batched stable sort), then pairs of adjacent column ranks are combined
//    (rank_l * n + rank_r) and ranked again until one column is left:
//    O(log(columns)) sorts instead of one per column.
//  - equal(a, b): false if the sizes differ, else all(a == b) (type
//    promotion as eq; NaN is unequal to itself).
#include <ATen/MemoryOverlap.h>
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/native/Resize.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace torch_tpu::aten {
namespace {

// complex32 (ComplexHalf) is stored as u32 bit patterns that no lowering
// computes on: these kernels then run CPU's (its values, or its
// NotImplementedError for unique, equal, take and put_) on host copies,
// and move the results back.
bool IsComplex32(const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kComplexHalf; }
at::Tensor OnCpu(const at::Tensor& t) { return t.defined() ? t.cpu() : t; }
template <typename... T>
std::tuple<T...> ToDevice(std::tuple<T...> r, const at::Tensor& like) {
  return std::apply([&](auto&... t) { return std::tuple<T...>{t.to(like.device())...}; }, r);
}

at::Tensor EmptyLong(const at::Tensor& like, at::IntArrayRef sizes) {
  return at::empty(sizes, like.options().dtype(at::kLong));
}

// The one host read of a kernel.
int64_t ReadCount(const at::Tensor& count) { return count.item<int64_t>(); }

// [1, x[1:] != x[:-1] (any over the trailing dims)] for a [n, ...] tensor, n >= 1.
at::Tensor NewRunMask(const at::Tensor& x) {
  const int64_t n = x.size(0);
  if (n == 1) return at::ones({1}, x.options().dtype(at::kBool));
  at::Tensor ne = at::ne(x.slice(0, 1, n), x.slice(0, 0, n - 1));
  if (ne.dim() > 1) ne = ne.flatten(1).any(1);
  return at::constant_pad_nd(ne, {1, 0}, 1);
}

// Positions of the first element of each run, given the run-start mask and
// the number of runs.
at::Tensor RunStarts(const at::Tensor& mask, int64_t runs) { return at::nonzero_static(mask, runs, 0).view({runs}); }

// Run lengths from run starts: next start (or n) minus start.
at::Tensor RunLengths(const at::Tensor& starts, int64_t n) {
  return at::sub(at::constant_pad_nd(starts.slice(0, 1, starts.size(0)), {0, 1}, n), starts);
}

// --- nonzero / masked_select ------------------------------------------------

at::Tensor Nonzero(const at::Tensor& self) {
  if (IsComplex32(self)) return at::nonzero(OnCpu(self)).to(self.device());
  if (self.numel() == 0) return EmptyLong(self, {0, self.dim()});
  const int64_t n = ReadCount(at::count_nonzero(self));
  return at::nonzero_static(self, n, -1);
}

at::Tensor& NonzeroOut(const at::Tensor& self, at::Tensor& out) {
  at::Tensor r = Nonzero(self);
  at::native::resize_output(out, r.sizes());
  out.copy_(r);
  return out;
}

at::Tensor MaskedSelect(const at::Tensor& self, const at::Tensor& mask) {
  if (IsComplex32(self)) return at::masked_select(OnCpu(self), OnCpu(mask)).to(self.device());
  TORCH_CHECK(mask.scalar_type() == at::kBool, "masked_select: expected BoolTensor for mask");
  auto [s, m] = at::expand_outplace(self, mask);
  if (s->numel() == 0) return at::empty({0}, self.options());
  const int64_t n = ReadCount(at::count_nonzero(*m));
  at::Tensor idx = at::nonzero_static(m->reshape({-1}), n, 0).view({n});
  return s->reshape({-1}).index_select(0, idx);
}

at::Tensor& MaskedSelectOut(const at::Tensor& self, const at::Tensor& mask, at::Tensor& out) {
  // CPU's masked_select_out checks (the same messages).
  TORCH_CHECK(mask.scalar_type() == at::kBool, "masked_select: expected BoolTensor for mask");
  TORCH_CHECK(self.scalar_type() == out.scalar_type(), "masked_select(): self and result must have the same scalar type");
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, self);
  at::assert_no_overlap(out, mask);
  at::Tensor r = MaskedSelect(self, mask);
  at::native::resize_output(out, r.sizes());
  out.copy_(r);
  return out;
}

// --- unique ----------------------------------------------------------------

// Flattened unique, always sorted: (values, inverse shaped like self or
// empty, counts or empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor> UniqueFlat(const at::Tensor& self, bool return_inverse,
                                                          bool return_counts) {
  const int64_t n = self.numel();
  at::Tensor inverse = return_inverse ? EmptyLong(self, self.sizes()) : EmptyLong(self, {0});
  if (n == 0) return {at::empty({0}, self.options()), inverse, EmptyLong(self, {0})};
  auto [sorted, perm] = at::sort(self.reshape({-1}), /*stable=*/true, 0, false);
  at::Tensor mask = NewRunMask(sorted);
  const int64_t u = ReadCount(mask.sum());
  at::Tensor starts = RunStarts(mask, u);
  at::Tensor values = sorted.index_select(0, starts);
  if (return_inverse) {
    at::Tensor group = at::sub(at::cumsum(mask, 0, at::kLong), 1);
    inverse = at::zeros({n}, self.options().dtype(at::kLong)).scatter_(0, perm, group).view(self.sizes());
  }
  at::Tensor counts = return_counts ? RunLengths(starts, n) : EmptyLong(self, {0});
  return {values, inverse, counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> Unique2(const at::Tensor& self, bool /*sorted*/,
                                                       bool return_inverse, bool return_counts) {
  if (IsComplex32(self)) return ToDevice(at::_unique2(OnCpu(self), true, return_inverse, return_counts), self);
  return UniqueFlat(self, return_inverse, return_counts);
}

std::tuple<at::Tensor, at::Tensor> Unique(const at::Tensor& self, bool /*sorted*/, bool return_inverse) {
  if (IsComplex32(self)) return ToDevice(at::_unique(OnCpu(self), true, return_inverse), self);
  auto [v, i, c] = UniqueFlat(self, return_inverse, false);
  return {v, i};
}

// CPU's checks for the dim variants; returns the early result for an
// empty selected dim.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> UniqueDimEmpty(const at::Tensor& self, int64_t dim) {
  int64_t zeros = 0;
  for (int64_t s : self.sizes()) zeros += s == 0;
  if (self.size(dim) == 0) {
    TORCH_CHECK(zeros == 1, "Number of zero sized dimensions is more than one, so unique cannot be applied ");
    return std::make_tuple(at::empty(self.sizes(), self.options()), EmptyLong(self, {0}), EmptyLong(self, {0}));
  }
  TORCH_CHECK(zeros == 0, "There are 0 sized dimensions, and they aren't selected, so unique cannot be applied");
  return std::nullopt;
}

// Dense rank (0, 1, ... in sorted order; equal values share a rank, NaNs
// never do) of each column of a [n, k] tensor: s64 [n, k].
at::Tensor DenseRankColumns(const at::Tensor& x) {
  auto [sorted, perm] = at::sort(x, /*stable=*/true, 0, false);
  const int64_t n = x.size(0);
  at::Tensor first = at::ones({1, x.size(1)}, x.options().dtype(at::kBool));
  at::Tensor mask = n == 1 ? first : at::cat({first, at::ne(sorted.slice(0, 1, n), sorted.slice(0, 0, n - 1))}, 0);
  at::Tensor rank = at::sub(at::cumsum(mask, 0, at::kLong), 1);
  return at::zeros_like(rank).scatter_(0, perm, rank);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> UniqueDim(const at::Tensor& self, int64_t dim, bool /*sorted*/,
                                                         bool return_inverse, bool return_counts) {
  if (IsComplex32(self)) return ToDevice(at::unique_dim(OnCpu(self), dim, true, return_inverse, return_counts), self);
  dim = at::maybe_wrap_dim(dim, self.dim());
  if (auto early = UniqueDimEmpty(self, dim)) return *early;
  const int64_t n = self.size(dim);
  at::Tensor rows = self.movedim(dim, 0).reshape({n, -1});
  at::Tensor key = DenseRankColumns(rows);
  while (key.size(1) > 1) {
    if (key.size(1) % 2) key = at::constant_pad_nd(key, {0, 1}, 0);
    at::Tensor pair = at::add(at::mul(key.slice(1, 0, key.size(1), 2), n), key.slice(1, 1, key.size(1), 2));
    key = DenseRankColumns(pair);
  }
  at::Tensor group = key.view({n});
  const int64_t u = ReadCount(at::add(group.max(), 1));
  at::Tensor positions = at::arange(n, self.options().dtype(at::kLong));
  at::Tensor first = at::full({u}, n, self.options().dtype(at::kLong))
                         .scatter_reduce_(0, group, positions, "amin", /*include_self=*/true);
  at::Tensor values = self.index_select(dim, first);
  at::Tensor counts = at::zeros({u}, self.options().dtype(at::kLong))
                          .scatter_add_(0, group, at::ones({n}, self.options().dtype(at::kLong)));
  return {values, group, counts};
}

// --- unique_consecutive ------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> UniqueDimConsecutive(const at::Tensor& self, int64_t dim,
                                                                    bool return_inverse,
                                                                    bool return_counts) {
  if (IsComplex32(self))
    return ToDevice(at::unique_dim_consecutive(OnCpu(self), dim, return_inverse, return_counts), self);
  dim = at::maybe_wrap_dim(dim, self.dim());
  if (auto early = UniqueDimEmpty(self, dim)) return *early;
  const int64_t n = self.size(dim);
  at::Tensor mask = NewRunMask(self.movedim(dim, 0));
  const int64_t u = ReadCount(mask.sum());
  at::Tensor starts = RunStarts(mask, u);
  at::Tensor inverse = at::sub(at::cumsum(mask, 0, at::kLong), 1);
  return {self.index_select(dim, starts), inverse, RunLengths(starts, n)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> UniqueConsecutive(const at::Tensor& self, bool return_inverse,
                                                                 bool return_counts, std::optional<int64_t> dim) {
  if (IsComplex32(self))
    return ToDevice(at::unique_consecutive(OnCpu(self), return_inverse, return_counts, dim), self);
  if (dim && self.dim() > 0) return UniqueDimConsecutive(self, *dim, return_inverse, return_counts);
  const int64_t n = self.numel();
  at::Tensor inverse = return_inverse ? EmptyLong(self, self.sizes()) : EmptyLong(self, {0});
  if (n == 0) return {at::empty({0}, self.options()), inverse, EmptyLong(self, {0})};
  at::Tensor flat = self.reshape({-1});
  at::Tensor mask = NewRunMask(flat);
  const int64_t u = ReadCount(mask.sum());
  at::Tensor starts = RunStarts(mask, u);
  if (return_inverse) inverse = at::sub(at::cumsum(mask, 0, at::kLong), 1).view(self.sizes());
  at::Tensor counts = return_counts ? RunLengths(starts, n) : EmptyLong(self, {0});
  return {flat.index_select(0, starts), inverse, counts};
}

// --- equal -----------------------------------------------------------------

bool Equal(const at::Tensor& self, const at::Tensor& other) {
  TORCH_CHECK(self.device() == other.device(), "Cannot compare two tensors on different devices. Got: ",
              self.device(), " and ", other.device());
  if (IsComplex32(self) || IsComplex32(other)) {
    const at::Tensor a = OnCpu(self);  // equal(x, x) is one tensor on CPU too (its is_same path)
    return at::equal(a, self.is_same(other) ? a : OnCpu(other));
  }
  if (self.sizes() != other.sizes()) return false;
  if (self.numel() == 0) return true;
  return at::eq(self, other).all().item<bool>();
}

// --- take / put_ -------------------------------------------------------------

at::Tensor Take(const at::Tensor& self, const at::Tensor& index) {
  if (IsComplex32(self)) return at::take(OnCpu(self), OnCpu(index)).to(self.device());
  TORCH_CHECK(index.scalar_type() == at::kLong, "take(): Expected a long tensor for index, but got ",
              index.scalar_type());
  TORCH_CHECK(self.numel() > 0 || index.numel() == 0, "take(): tried to take from an empty tensor");
  if (index.numel() == 0) return at::empty(index.sizes(), self.options());
  at::Tensor flat = self.reshape({-1});
  return at::index(flat, c10::List<std::optional<at::Tensor>>({index}));
}

at::Tensor& TakeOut(const at::Tensor& self, const at::Tensor& index, at::Tensor& out) {
  // CPU's take_out checks (the same messages).
  TORCH_CHECK(out.device() == self.device(), "take(): self and out expected to be in the same device, but got self.device = ",
              self.device(), " and out.device = ", out.device());
  TORCH_CHECK(out.scalar_type() == self.scalar_type(), "take(): self and out expected to have the same dtype, but got self.dtype = ",
              self.scalar_type(), " and out.dtype = ", out.scalar_type());
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, index);
  at::assert_no_overlap(out, self);
  at::Tensor r = Take(self, index);
  at::native::resize_output(out, r.sizes());
  out.copy_(r);
  return out;
}

at::Tensor& Put(at::Tensor& self, const at::Tensor& index, const at::Tensor& source, bool accumulate) {
  if (IsComplex32(self) || IsComplex32(source)) {
    at::Tensor host = OnCpu(self);
    host.put_(OnCpu(index), OnCpu(source), accumulate);
    return self.copy_(host);
  }
  TORCH_CHECK(index.scalar_type() == at::kLong, "put_(): Expected a long tensor for index, but got ",
              index.scalar_type());
  TORCH_CHECK(self.scalar_type() == source.scalar_type(),
              "put_(): self and source expected to have the same dtype, but got self.dtype = ",
              self.scalar_type(), " and source.dtype = ", source.scalar_type());
  TORCH_CHECK(source.numel() == index.numel(),
              "put_(): Expected source and index to have the same number of elements, but got source.numel() = ",
              source.numel(), ", index.numel() = ", index.numel());
  TORCH_CHECK(self.numel() > 0 || index.numel() == 0, "put_(): Tried to put elements into an empty tensor");
  if (index.numel() == 0) return self;
  const bool direct = self.is_contiguous();
  at::Tensor flat = direct ? self.view({-1}) : self.reshape({-1});
  flat.index_put_(c10::List<std::optional<at::Tensor>>({index.reshape({-1})}), source.reshape({-1}), accumulate);
  if (!direct) self.copy_(flat.view(self.sizes()));
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("nonzero", Nonzero);
  m.impl("nonzero.out", NonzeroOut);
  m.impl("masked_select", MaskedSelect);
  m.impl("masked_select.out", MaskedSelectOut);
  m.impl("_unique", Unique);
  m.impl("_unique2", Unique2);
  m.impl("unique_dim", UniqueDim);
  m.impl("unique_consecutive", UniqueConsecutive);
  m.impl("unique_dim_consecutive", UniqueDimConsecutive);
  m.impl("equal", Equal);
  m.impl("take", Take);
  m.impl("take.out", TakeOut);
  m.impl("put_", Put);
}

}  // namespace torch_tpu::aten
