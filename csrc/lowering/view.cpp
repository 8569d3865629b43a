// View and shape ops lowered as VALUES, for whole-graph lowering (fused
// regions, torch.compile). Entries carry traits.graph_only: eager tpu tensors
// never reach them (views are metadata over a shared storage, kernels.cpp;
// fallback.cpp skips graph_only entries), except unfold_backward, a
// computation lowered for eager calls too. In a graph every value is logically
// contiguous, so a view is the same elements rearranged: reshape, transpose,
// slice, broadcast, or (as_strided, diagonal, unfold) a strided read of the
// value's row-major elements.
#include <algorithm>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

const LoweringTraits kView{.graph_only = true};


std::vector<int64_t> ContiguousStrides(std::span<const int64_t> sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 2; i >= 0; --i)
    strides[static_cast<size_t>(i)] =
        strides[static_cast<size_t>(i + 1)] * std::max<int64_t>(sizes[static_cast<size_t>(i + 1)], 1);
  return strides;
}

// Reads the view (sizes, strides, offset) of x's row-major elements.
Value StridedRead(LoweringContext& ctx, const Value& x, const ViewLayout& view) {
  const int64_t n = x.type.numel();
  int64_t last = view.offset;
  bool empty = false;
  for (size_t i = 0; i < view.sizes.size(); ++i) {
    if (view.sizes[i] == 0) empty = true;
    if (view.strides[i] < 0) throw LoweringError(ctx.op_name() + ": negative strides are not supported");
    last += (view.sizes[i] - 1) * view.strides[i];
  }
  if (!empty && (view.offset < 0 || last >= n))
    throw LoweringError(ctx.op_name() + ": view reads element " + std::to_string(last) + " of a value with " +
                        std::to_string(n) + " elements");
  int64_t flat_dims[] = {n};
  return ReadView(ctx.b, ctx.b.Reshape(x, flat_dims), view);
}

// view / _unsafe_view / reshape / _reshape_alias / unsqueeze / squeeze:
// the same elements with the meta's sizes. view.dtype reinterprets bits.
std::vector<Value> LowerReshape(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (const LoweredArg* d = ctx.find("dtype"); d && d->kind == LoweredArg::Kind::kStatic) {
    ElementType to = ToElementType(out.dtype);
    if (to == x.element()) return {x};
    if (to == ElementType::kPred || x.element() == ElementType::kPred ||
        hlo::BitWidth(to) != hlo::BitWidth(x.element()))
      throw LoweringError(ctx.op_name() + ": view as a dtype of another width is not supported in graphs");
    return {ctx.b.Reshape(ctx.b.BitcastConvert(x, to), out.sizes)};
  }
  return {ctx.b.Reshape(x, out.sizes)};
}

// alias / detach / lift_fresh(_copy): the value itself.
std::vector<Value> LowerIdentity(LoweringContext& ctx) { return {ctx.tensor("self")}; }

Value Swap(Builder& b, const Value& x, int64_t d0, int64_t d1) {
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < x.rank(); ++i) perm.push_back(i);
  std::swap(perm[static_cast<size_t>(d0)], perm[static_cast<size_t>(d1)]);
  return b.Transpose(x, perm);
}

std::vector<Value> LowerT(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  if (x.rank() < 2) return {x};
  return {Swap(ctx.b, x, 0, 1)};
}

std::vector<Value> LowerTranspose(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  if (x.rank() == 0) return {x};
  int64_t d0 = NormalizeDim(ctx.int_arg("dim0"), x.rank());
  int64_t d1 = NormalizeDim(ctx.int_arg("dim1"), x.rank());
  return {Swap(ctx.b, x, d0, d1)};
}

std::vector<Value> LowerPermute(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  std::vector<int64_t> perm;
  for (int64_t d : ctx.ints("dims")) perm.push_back(NormalizeDim(d, x.rank()));
  if (static_cast<int64_t>(perm.size()) != x.rank())
    throw LoweringError(ctx.op_name() + ": permutation of the wrong length");
  return {ctx.b.Transpose(x, perm)};
}

// expand(self, size, implicit): broadcast to the meta's sizes.
std::vector<Value> LowerExpand(LoweringContext& ctx) {
  return {BroadcastTo(ctx.b, ctx.tensor("self"), ctx.outputs[0].sizes)};
}

// slice.Tensor(self, dim, start, end, step), with PyTorch's clamping of
// negative and out-of-range bounds.
std::vector<Value> LowerSlice(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  if (x.rank() == 0) throw LoweringError(ctx.op_name() + ": slice of a 0-d tensor");
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : 0, x.rank());
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  int64_t start = ctx.has("start") ? ctx.int_arg("start") : 0;
  int64_t end = ctx.has("end") ? ctx.int_arg("end") : n;
  int64_t step = ctx.has("step") ? ctx.int_arg("step") : 1;
  if (step <= 0) throw LoweringError(ctx.op_name() + ": slice step must be positive");
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
  st[static_cast<size_t>(dim)] = start;
  li[static_cast<size_t>(dim)] = end;
  sr[static_cast<size_t>(dim)] = step;
  return {ctx.b.Slice(x, st, li, sr)};
}

// select.int(self, dim, index)
std::vector<Value> LowerSelect(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  if (x.rank() == 0) throw LoweringError(ctx.op_name() + ": select of a 0-d tensor");
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  int64_t index = ctx.int_arg("index");
  if (index < -n || index >= n)
    throw LoweringError(ctx.op_name() + ": index " + std::to_string(index) + " is out of bounds for dimension " +
                        std::to_string(dim) + " with size " + std::to_string(n));
  if (index < 0) index += n;
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
  st[static_cast<size_t>(dim)] = index;
  li[static_cast<size_t>(dim)] = index + 1;
  return {ctx.b.Reshape(ctx.b.Slice(x, st, li, sr), ctx.outputs[0].sizes)};
}

// split / split_with_sizes / unsafe_split*: consecutive pieces along `dim`
// whose sizes the meta computed.
std::vector<Value> LowerSplit(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  if (x.rank() == 0) throw LoweringError(ctx.op_name() + ": split of a 0-d tensor");
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : 0, x.rank());
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<Value> out;
  int64_t offset = 0;
  for (const auto& spec : ctx.outputs) {
    if (spec.sizes.size() != r) throw LoweringError(ctx.op_name() + ": piece of another rank");
    int64_t len = spec.sizes[static_cast<size_t>(dim)];
    std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
    st[static_cast<size_t>(dim)] = offset;
    li[static_cast<size_t>(dim)] = offset + len;
    out.push_back(ctx.b.Slice(x, st, li, sr));
    offset += len;
  }
  if (offset > x.dims()[static_cast<size_t>(dim)]) throw LoweringError(ctx.op_name() + ": pieces exceed the size");
  return out;
}

// unbind.int(self, dim): one piece per index, `dim` removed.
std::vector<Value> LowerUnbind(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  if (x.rank() == 0) throw LoweringError(ctx.op_name() + ": unbind of a 0-d tensor");
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : 0, x.rank());
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<Value> out;
  for (size_t i = 0; i < ctx.outputs.size(); ++i) {
    std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
    st[static_cast<size_t>(dim)] = static_cast<int64_t>(i);
    li[static_cast<size_t>(dim)] = static_cast<int64_t>(i) + 1;
    out.push_back(ctx.b.Reshape(ctx.b.Slice(x, st, li, sr), ctx.outputs[i].sizes));
  }
  return out;
}

// as_strided(self, size, stride, storage_offset): strides over self's
// row-major elements (the graph's self is its own contiguous storage; the
// Dynamo backend only sends as_strided of such inputs).
std::vector<Value> LowerAsStrided(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  ViewLayout view;
  view.sizes = ctx.ints("size");
  view.strides = ctx.ints("stride");
  view.offset = ctx.has("storage_offset") ? ctx.int_arg("storage_offset") : 0;
  if (view.sizes.size() != view.strides.size())
    throw LoweringError(ctx.op_name() + ": sizes and strides differ in length");
  return {StridedRead(ctx, x, view)};
}

// diagonal(self, offset, dim1, dim2): the other dims in order, then the
// diagonal.
std::vector<Value> LowerDiagonal(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  const int64_t rank = x.rank();
  if (rank < 2) throw LoweringError(ctx.op_name() + ": diagonal needs at least 2 dimensions");
  int64_t offset = ctx.has("offset") ? ctx.int_arg("offset") : 0;
  int64_t d1 = NormalizeDim(ctx.has("dim1") ? ctx.int_arg("dim1") : 0, rank);
  int64_t d2 = NormalizeDim(ctx.has("dim2") ? ctx.int_arg("dim2") : 1, rank);
  if (d1 == d2) throw LoweringError(ctx.op_name() + ": diagonal dimensions cannot be identical");
  auto strides = ContiguousStrides(x.dims());
  const int64_t n1 = x.dims()[static_cast<size_t>(d1)], n2 = x.dims()[static_cast<size_t>(d2)];
  int64_t len = offset >= 0 ? std::min(n1, n2 - offset) : std::min(n1 + offset, n2);
  len = std::max<int64_t>(len, 0);
  ViewLayout view;
  for (int64_t i = 0; i < rank; ++i) {
    if (i == d1 || i == d2) continue;
    view.sizes.push_back(x.dims()[static_cast<size_t>(i)]);
    view.strides.push_back(strides[static_cast<size_t>(i)]);
  }
  view.sizes.push_back(len);
  view.strides.push_back(strides[static_cast<size_t>(d1)] + strides[static_cast<size_t>(d2)]);
  if (len > 0)
    view.offset = offset >= 0 ? offset * strides[static_cast<size_t>(d2)] : -offset * strides[static_cast<size_t>(d1)];
  return {StridedRead(ctx, x, view)};
}

// unfold(self, dimension, size, step): windows along `dimension`, appended
// as the last dimension.
std::vector<Value> LowerUnfold(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  int64_t size = ctx.int_arg("size"), step = ctx.int_arg("step");
  if (step <= 0) throw LoweringError(ctx.op_name() + ": step must be positive");
  if (x.rank() == 0) {
    if (size > 1) throw LoweringError(ctx.op_name() + ": size exceeds the 0-d tensor");
    return {ctx.b.Reshape(x, ctx.outputs[0].sizes)};
  }
  int64_t d = NormalizeDim(ctx.int_arg("dimension"), x.rank());
  auto strides = ContiguousStrides(x.dims());
  const int64_t n = x.dims()[static_cast<size_t>(d)];
  if (size > n) throw LoweringError(ctx.op_name() + ": size exceeds the dimension");
  ViewLayout view;
  view.sizes = x.dims();
  view.strides = strides;
  view.sizes[static_cast<size_t>(d)] = (n - size) / step + 1;
  view.strides[static_cast<size_t>(d)] = strides[static_cast<size_t>(d)] * step;
  view.sizes.push_back(size);
  view.strides.push_back(strides[static_cast<size_t>(d)]);
  return {StridedRead(ctx, x, view)};
}

// unfold_backward(grad_in, input_sizes, dim, size, step) -> the input's
// gradient (input_sizes, grad_in's dtype): window element
// grad_in[..., w, ..., k] (w along `dim`, k the last dimension) is added at
// position w * step + k of `dim`, as PyTorch's unfold_backward. Windows
// that do not overlap (step >= size) are laid out by a pad and a reshape;
// overlapping ones are summed by a scatter-add (in f32 for bf16/f16, as
// PyTorch's opmath). Not graph-only: eager calls lower it too.
std::vector<Value> LowerUnfoldBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value g = ctx.tensor("grad_in");
  const std::vector<int64_t> in = ctx.ints("input_sizes");
  const int64_t size = ctx.int_arg("size"), step = ctx.int_arg("step");
  if (step <= 0) throw LoweringError(ctx.op_name() + ": step must be positive");
  const int64_t rank = static_cast<int64_t>(in.size());
  if (rank == 0 || g.type.numel() == 0 || out.sizes != in) {
    if (rank == 0 && g.type.numel() == 1) return {Cast(b, b.Reshape(g, out.sizes), out.dtype)};  // 0-d: one element
    if (g.type.numel() == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
    throw LoweringError(ctx.op_name() + ": unexpected shapes");
  }
  const int64_t d = NormalizeDim(ctx.int_arg("dim"), rank);
  const size_t du = static_cast<size_t>(d);
  const int64_t n = in[du];
  if (g.rank() != rank + 1 || g.dims()[static_cast<size_t>(rank)] != size)
    throw LoweringError(ctx.op_name() + ": grad_in does not match the windows");
  const int64_t windows = g.dims()[du];
  if (step >= size) {
    // [.., W, .., size] -> [.., W, size, ..] -> pad size to step -> [.., W*step, ..] -> n along d.
    std::vector<int64_t> perm;
    for (int64_t i = 0; i <= d; ++i) perm.push_back(i);
    perm.push_back(rank);
    for (int64_t i = d + 1; i < rank; ++i) perm.push_back(i);
    Value t = b.Transpose(g, perm);
    const size_t r1 = static_cast<size_t>(rank + 1);
    std::vector<int64_t> lo(r1, 0), hi(r1, 0), interior(r1, 0);
    hi[du + 1] = step - size;
    t = b.Pad(t, Const(b, t.element(), 0), lo, hi, interior);
    std::vector<int64_t> merged = in;
    merged[du] = windows * step;
    t = b.Reshape(t, merged);
    std::vector<int64_t> lo2(static_cast<size_t>(rank), 0), hi2(static_cast<size_t>(rank), 0),
        in2(static_cast<size_t>(rank), 0);
    hi2[du] = n - windows * step;  // negative: trims the last window's padding
    t = b.Pad(t, Const(b, t.element(), 0), lo2, hi2, in2);
    return {Cast(b, t, out.dtype)};
  }
  // Overlapping windows: rows [W*size, rest] scattered (added) into [n, rest].
  const ElementType acc = ToElementType(OpMathType(out.dtype));
  std::vector<int64_t> perm{d, rank}, rest_dims;
  int64_t rest = 1;
  for (int64_t i = 0; i < rank; ++i) {
    if (i == d) continue;
    perm.push_back(i);
    rest_dims.push_back(in[static_cast<size_t>(i)]);
    rest *= in[static_cast<size_t>(i)];
  }
  Value rows = b.Reshape(CastElement(b, b.Transpose(g, perm), acc), std::vector<int64_t>{windows * size, rest});
  std::vector<int64_t> wk{windows, size};
  Value pos = b.Add(b.Mul(b.Iota(TensorType{ElementType::kS64, wk}, 0), Const(b, ElementType::kS64,
                                                                                 static_cast<double>(step), wk)),
                    b.Iota(TensorType{ElementType::kS64, wk}, 1));
  pos = b.Reshape(pos, std::vector<int64_t>{windows * size, 1});
  hlo::ScatterDims sd;
  sd.update_window_dims = {1};
  sd.inserted_window_dims = {0};
  sd.scatter_dims_to_operand_dims = {0};
  sd.index_vector_dim = 1;
  Value acc_init = Const(b, acc, 0, std::vector<int64_t>{n, rest});
  Value summed = b.Scatter(acc_init, pos, rows, sd, [](Builder& bb, std::span<const Value> a) {
    return std::vector<Value>{bb.Add(a[0], a[1])};
  });
  std::vector<int64_t> moved{n};
  moved.insert(moved.end(), rest_dims.begin(), rest_dims.end());
  Value t = b.Reshape(summed, moved);
  // [n, others...] -> original order: dim 0 goes back to d.
  std::vector<int64_t> back;
  for (int64_t i = 0; i < rank; ++i) back.push_back(i == d ? 0 : (i < d ? i + 1 : i));
  return {Cast(b, b.Transpose(t, back), out.dtype)};
}

// _to_copy(self, dtype, layout, device, pin_memory, non_blocking,
// memory_format) within the device: a cast. Graph-only like the views
// (traits.graph_only): eager `.to()` keeps PyTorch's kernel, which routes device
// changes to _copy_from.
std::vector<Value> LowerToCopy(LoweringContext& ctx) {
  if (const LoweredArg* d = ctx.find("device"); d && d->kind == LoweredArg::Kind::kStatic && d->ivalue.isDevice() &&
                                                 d->ivalue.toDevice().type() != c10::DeviceType::PrivateUse1)
    throw LoweringError(ctx.op_name() + ": a copy to " + d->ivalue.toDevice().str() + " cannot run inside a graph");
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.tensor("self"), out.dtype, out.sizes)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"view", LowerReshape, kView},
    {"_unsafe_view", LowerReshape, kView},
    {"reshape", LowerReshape, kView},
    {"_reshape_alias", LowerReshape, kView},
    {"unsqueeze", LowerReshape, kView},
    {"squeeze", LowerReshape, kView},
    {"alias", LowerIdentity, kView},
    {"detach", LowerIdentity, kView},
    {"lift_fresh", LowerIdentity, kView},
    {"lift_fresh_copy", LowerIdentity, kView},  // graph values are immutable: a copy is the value
    {"t", LowerT, kView},
    {"transpose", LowerTranspose, kView},
    {"permute", LowerPermute, kView},
    {"expand", LowerExpand, kView},
    {"slice", LowerSlice, kView},
    {"select", LowerSelect, kView},
    {"split", LowerSplit, kView},
    {"split_with_sizes", LowerSplit, kView},
    {"unsafe_split", LowerSplit, kView},
    {"unsafe_split_with_sizes", LowerSplit, kView},
    {"unbind", LowerUnbind, kView},
    {"as_strided", LowerAsStrided, kView},
    {"diagonal", LowerDiagonal, kView},
    {"unfold", LowerUnfold, kView},
    {"unfold_backward", LowerUnfoldBackward},
    {"_to_copy", LowerToCopy, kView},
});

}  // namespace torch_tpu::lowering
