// Indexing and data movement: index_select, embedding, gather, scatter
// (+_add, _reduce), index (advanced indexing), index_put, index_add,
// index_copy, index_reduce, index_fill, masked_scatter, nonzero_static,
// segment_reduce (+ backward), histc, cat, stack, constant_pad_nd, flip,
// roll, repeat, tril/triu, arange, full, eye, sort, topk. (Ops whose output
// shape depends on values — nonzero, masked_select, unique — are kernels in
// csrc/aten/dynamic_shape_kernels.cpp built on these lowerings.)
//
// StableHLO gather clamps and scatter drops out-of-range indices; PyTorch
// raises on them (and wraps negative ones in advanced indexing). Negative
// indices are wrapped here (idx < 0 ? idx + size : idx); out-of-range ones
// are reported by the debug executor's index checks (the entries'
// index_checks traits: negative allowed only for index/index_put, as on CPU).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;


std::vector<int64_t> Iota(int64_t from, int64_t to) {
  std::vector<int64_t> v;
  for (int64_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

// Index tensor as s64 with negative entries wrapped by `size`.
Value WrapIndex(Builder& b, const Value& index, int64_t size) {
  Value idx = CastElement(b, index, ElementType::kS64);
  Value zero = ConstLike(b, idx, 0);
  Value neg = b.Compare(idx, zero, CompareDirection::kLT);
  return b.Select(neg, b.Add(idx, ConstLike(b, idx, static_cast<double>(size))), idx);
}

// Full coordinates for gather/scatter along `dim`: shape index.dims + [rank],
// coordinate `dim` from the (wrapped) index, the others from iotas.
Value AlongDimCoordinates(Builder& b, const Value& idx, int64_t dim, int64_t rank) {
  std::vector<int64_t> shape = idx.dims();
  std::vector<int64_t> col_shape = shape;
  col_shape.push_back(1);
  std::vector<Value> cols;
  for (int64_t d = 0; d < rank; ++d) {
    Value c = d == dim ? idx : b.Iota(TensorType{ElementType::kS64, shape}, d);
    cols.push_back(b.Reshape(c, col_shape));
  }
  return b.Concatenate(cols, rank);
}

// ---------------------------------------------------------------------------

// Rows of `x` along `dim` selected by a 1-D s64 index (already wrapped).
Value SelectAlong(Builder& b, const Value& x, int64_t dim, const Value& idx1d) {
  const int64_t k = idx1d.dims()[0];
  Value idx = b.Reshape(idx1d, std::vector<int64_t>{k, 1});
  hlo::GatherDims g;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (d != dim) g.offset_dims.push_back(d);
  g.collapsed_slice_dims = {dim};
  g.start_index_map = {dim};
  g.index_vector_dim = 1;
  std::vector<int64_t> slice = x.dims();
  slice[static_cast<size_t>(dim)] = 1;
  std::vector<int64_t> rdims = x.dims();
  rdims[static_cast<size_t>(dim)] = k;
  return b.Gather(x, idx, g, slice, TensorType{x.element(), rdims});
}

std::vector<Value> LowerIndexSelect(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (x.rank() == 0) x = b.Reshape(x, std::vector<int64_t>{1});
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  Value index = ctx.tensor("index");
  const int64_t k = index.type.numel();
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  Value idx = WrapIndex(b, b.Reshape(index, std::vector<int64_t>{k}), x.dims()[static_cast<size_t>(dim)]);
  return {Out(b, SelectAlong(b, x, dim, idx), out)};
}

std::vector<Value> LowerEmbedding(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value w = ctx.tensor("weight");
  Value index = ctx.tensor("indices");
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  const int64_t k = index.type.numel();
  Value idx = WrapIndex(b, b.Reshape(index, std::vector<int64_t>{k}), w.dims()[0]);
  return {Out(b, SelectAlong(b, w, 0, idx), out)};
}

std::vector<Value> LowerGather(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  Value index = ctx.tensor("index");
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  if (x.rank() == 0) return {Out(b, BroadcastTo(b, x, index.dims()), out)};
  if (index.rank() == 0) index = b.Reshape(index, std::vector<int64_t>(static_cast<size_t>(x.rank()), 1));
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  Value idx = WrapIndex(b, index, x.dims()[static_cast<size_t>(dim)]);
  Value coords = AlongDimCoordinates(b, idx, dim, x.rank());
  hlo::GatherDims g;
  g.collapsed_slice_dims = Iota(0, x.rank());
  g.start_index_map = Iota(0, x.rank());
  g.index_vector_dim = x.rank();
  std::vector<int64_t> slice(static_cast<size_t>(x.rank()), 1);
  return {Out(b, b.Gather(x, coords, g, slice, TensorType{x.element(), idx.dims()}), out)};
}

// The lowest (or highest) value of an integer element type, splat to dims.
Value Extreme(Builder& b, ElementType e, bool highest, std::span<const int64_t> dims) {
  int64_t v = 0;
  switch (e) {
    case ElementType::kPred: v = highest ? 1 : 0; break;
    case ElementType::kS8: v = highest ? 127 : -128; break;
    case ElementType::kS16: v = highest ? 32767 : -32768; break;
    case ElementType::kS32: v = highest ? 2147483647LL : -2147483648LL; break;
    case ElementType::kS64:
      v = highest ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
      break;
    case ElementType::kU8: v = highest ? 255 : 0; break;
    case ElementType::kU16: v = highest ? 65535 : 0; break;
    case ElementType::kU32: v = highest ? 4294967295LL : 0; break;
    default: v = 0;
  }
  Value c = b.ConstantInt(TensorType{e, {}}, v);
  return BroadcastTo(b, c, dims);
}

// scatter / scatter_add / scatter_reduce: reduce is "" (replace), "add",
// "multiply", or scatter_reduce's "sum", "prod", "mean", "amax", "amin".
// `self` (rank >= 1) and `updates` have the out dtype; `idx` (wrapped, s64)
// has the updates' shape. Shared with index_reduce.
Value ScatterReduceCore(LoweringContext& ctx, Value self, int64_t dim, const Value& idx, const Value& updates,
                        const std::string& reduce, bool include_self, at::ScalarType t);

// CPU's index_add_/index_copy_/index_reduce_/scatter kernels require source
// (src) to have self's dtype and raise otherwise; the meta kernels do not
// check it (index_add_ of a Long source into a Float self lowered to a
// value). Such a call declines and runs CPU's kernel (its error).
void SourceDtypeLikeSelf(const LoweringContext& ctx, std::string_view source) {
  const LoweredArg* src = ctx.find(source);
  if (src && src->kind == LoweredArg::Kind::kTensor && src->dtype != ctx.arg("self").dtype)
    throw LoweringError(std::string(source) + " dtype " + c10::toString(src->dtype) + " differs from self's " +
                        c10::toString(ctx.arg("self").dtype) + " (CPU's kernel decides)");
}

std::vector<Value> ScatterAlongDim(LoweringContext& ctx, std::string reduce, bool include_self) {
  SourceDtypeLikeSelf(ctx, "src");
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType t = out.dtype;
  Value self = Cast(b, ctx.tensor("self"), t);
  Value index = ctx.tensor("index");
  if (index.type.numel() == 0) return {self};
  const bool scalar_self = self.rank() == 0;
  if (scalar_self) self = b.Reshape(self, std::vector<int64_t>{1});
  if (index.rank() == 0) index = b.Reshape(index, std::vector<int64_t>(static_cast<size_t>(self.rank()), 1));
  const int64_t r = self.rank();
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), r);
  Value idx = WrapIndex(b, index, self.dims()[static_cast<size_t>(dim)]);
  Value updates;
  if (ctx.find("src")) {
    Value src = Cast(b, ctx.tensor("src"), t);
    if (src.rank() == 0) src = b.Reshape(src, std::vector<int64_t>(static_cast<size_t>(r), 1));
    std::vector<int64_t> start(static_cast<size_t>(r), 0), stride(static_cast<size_t>(r), 1);
    updates = b.Slice(src, start, idx.dims(), stride);
  } else {
    updates = Prepare(b, ctx.value("value"), t, idx.dims());
  }
  Value result = ScatterReduceCore(ctx, self, dim, idx, updates, reduce, include_self, t);
  if (scalar_self) result = b.Reshape(result, std::vector<int64_t>{});
  return {Out(b, result, out)};
}

Value ScatterReduceCore(LoweringContext& ctx, Value self, int64_t dim, const Value& idx, const Value& updates,
                        const std::string& reduce, bool include_self, at::ScalarType t) {
  auto& b = ctx.b;
  const int64_t r = self.rank();
  Value coords = AlongDimCoordinates(b, idx, dim, r);
  hlo::ScatterDims s;
  s.inserted_window_dims = Iota(0, r);
  s.scatter_dims_to_operand_dims = Iota(0, r);
  s.index_vector_dim = r;
  const bool is_bool = t == at::kBool;
  auto body = [&](std::string_view op) {
    std::string o(op);
    return [o, is_bool](Builder& bb, std::span<const Value> a) {
      if (o == "replace") return std::vector<Value>{a[1]};
      if (o == "add") return std::vector<Value>{is_bool ? bb.Or(a[0], a[1]) : bb.Add(a[0], a[1])};
      if (o == "mul") return std::vector<Value>{is_bool ? bb.And(a[0], a[1]) : bb.Mul(a[0], a[1])};
      if (o == "max") return std::vector<Value>{MaxPropagateNaN(bb, a[0], a[1])};
      return std::vector<Value>{MinPropagateNaN(bb, a[0], a[1])};
    };
  };
  std::string op = reduce.empty() ? "replace"
                   : reduce == "add" || reduce == "sum" || reduce == "mean" ? "add"
                   : reduce == "multiply" || reduce == "prod" ? "mul"
                   : reduce == "amax" ? "max"
                   : reduce == "amin" ? "min"
                                      : "";
  if (op.empty()) throw LoweringError(ctx.op_name() + ": unknown reduce '" + reduce + "'");
  Value base = self;
  Value touched;
  if (!include_self || reduce == "mean") {
    hlo::ScatterDims ts = s;
    touched = b.Scatter(Const(b, ElementType::kPred, 0, self.dims()), coords,
                        Const(b, ElementType::kPred, 1, idx.dims()), ts,
                        [](Builder&, std::span<const Value> a) { return std::vector<Value>{a[1]}; });
  }
  if (!include_self) {
    double identity = op == "add" ? 0 : op == "mul" ? 1 : op == "max" ? -INFINITY : INFINITY;
    Value id;
    if ((op == "max" || op == "min") && !hlo::IsFloating(self.element())) {
      id = Extreme(b, self.element(), op == "min", self.dims());
    } else {
      id = Const(b, self.element(), identity, self.dims());
    }
    base = b.Select(touched, id, self);
  }
  Value result = b.Scatter(base, coords, updates, s, body(op));
  if (reduce == "mean") {
    Value ones = Const(b, self.element(), 1, idx.dims());
    Value count0 = Const(b, self.element(), include_self ? 1 : 0, self.dims());
    Value count = b.Scatter(count0, coords, ones, s, body("add"));
    Value safe = b.Select(touched, count, ConstLike(b, count, 1));
    Value mean;
    if (hlo::IsFloating(self.element())) {
      mean = b.Div(result, safe);
    } else {
      // floor division, as PyTorch's integer mean
      Value q = b.Div(result, safe);
      Value rem = b.Rem(result, safe);
      Value zero = ConstLike(b, rem, 0);
      Value adjust = b.And(b.Compare(rem, zero, CompareDirection::kNE),
                           b.Compare(b.Compare(rem, zero, CompareDirection::kLT),
                                     b.Compare(safe, ConstLike(b, safe, 0), CompareDirection::kLT),
                                     CompareDirection::kNE));
      mean = b.Select(adjust, b.Sub(q, ConstLike(b, q, 1)), q);
    }
    result = b.Select(touched, mean, self);
  }
  return result;
}

std::vector<Value> LowerScatter(LoweringContext& ctx) {
  std::string reduce;
  if (ctx.has("reduce")) reduce = std::string(ctx.string_arg("reduce"));
  return ScatterAlongDim(ctx, reduce, true);
}
std::vector<Value> LowerScatterAdd(LoweringContext& ctx) { return ScatterAlongDim(ctx, "add", true); }
std::vector<Value> LowerScatterReduce(LoweringContext& ctx) {
  bool include_self = !ctx.find("include_self") || ctx.bool_arg("include_self");
  return ScatterAlongDim(ctx, std::string(ctx.string_arg("reduce")), include_self);
}

// index_add / index_copy: rows of `source` along dim, placed at index.
std::vector<Value> IndexAlongDim(LoweringContext& ctx, bool add) {
  SourceDtypeLikeSelf(ctx, "source");
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType t = out.dtype;
  at::ScalarType acc = add ? OpMathType(t) : t;
  Value self = Cast(b, ctx.tensor("self"), acc);
  Value index = ctx.tensor("index");
  if (add) {
    // CPU's index_add check (aten/src/ATen/native/TensorAdvancedIndexing.cpp), same message.
    std::vector<int64_t> ss = self.dims(), rs = ctx.tensor("source").dims();
    const int64_t d = NormalizeDim(ctx.int_arg("dim"), std::max<int64_t>(self.rank(), 1));
    if (!ss.empty()) ss.erase(ss.begin() + d);
    if (!rs.empty() && d < static_cast<int64_t>(rs.size())) rs.erase(rs.begin() + d);
    TORCH_CHECK(self.rank() == 0 || ctx.tensor("source").rank() == 0 || ss == rs,
                "source tensor shape must match self tensor shape, excluding the specified dimension. Got self.shape = ",
                c10::IntArrayRef(self.dims()), " source.shape = ", c10::IntArrayRef(ctx.tensor("source").dims()));
  }
  const int64_t k = index.type.numel();
  if (k == 0) return {Out(b, self, out)};
  const bool scalar_self = self.rank() == 0;
  if (scalar_self) self = b.Reshape(self, std::vector<int64_t>{1});
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), self.rank());
  Value src = Cast(b, ctx.tensor("source"), acc);
  std::vector<int64_t> udims = self.dims();
  udims[static_cast<size_t>(dim)] = k;
  src = Fit(b, src, udims);
  if (add && ctx.has("alpha")) src = b.Mul(src, BroadcastTo(b, Cast(b, ctx.value("alpha"), acc), udims));
  Value idx = WrapIndex(b, b.Reshape(index, std::vector<int64_t>{k, 1}), self.dims()[static_cast<size_t>(dim)]);
  hlo::ScatterDims s;
  for (int64_t d = 0; d < self.rank(); ++d)
    if (d != dim) s.update_window_dims.push_back(d);
  s.inserted_window_dims = {dim};
  s.scatter_dims_to_operand_dims = {dim};
  s.index_vector_dim = 1;
  const bool is_bool = acc == at::kBool;
  Value r = b.Scatter(self, idx, src, s, [add, is_bool](Builder& bb, std::span<const Value> a) {
    if (!add) return std::vector<Value>{a[1]};
    return std::vector<Value>{is_bool ? bb.Or(a[0], a[1]) : bb.Add(a[0], a[1])};
  });
  if (scalar_self) r = b.Reshape(r, std::vector<int64_t>{});
  return {Out(b, r, out)};
}
std::vector<Value> LowerIndexAdd(LoweringContext& ctx) { return IndexAlongDim(ctx, true); }
std::vector<Value> LowerIndexCopy(LoweringContext& ctx) { return IndexAlongDim(ctx, false); }

// index_reduce(self, dim, index, source, reduce, include_self): the rows of
// `source` along dim (index.numel() of them) are reduced ("prod", "mean",
// "amax", "amin") into self's rows index[i]; as scatter_reduce with the
// index broadcast over the other dims (mean: integer results floor-divide,
// as on CPU). Index values must lie in [0, size) (checked: index_checks).
std::vector<Value> LowerIndexReduce(LoweringContext& ctx) {
  SourceDtypeLikeSelf(ctx, "source");
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType t = out.dtype;
  Value self = Cast(b, ctx.tensor("self"), t);
  Value index = ctx.tensor("index");
  const int64_t k = index.type.numel();
  if (k == 0) return {Out(b, self, out)};
  const bool scalar_self = self.rank() == 0;
  if (scalar_self) self = b.Reshape(self, std::vector<int64_t>{1});
  const int64_t dim = NormalizeDim(ctx.int_arg("dim"), self.rank());
  std::vector<int64_t> udims = self.dims();
  udims[static_cast<size_t>(dim)] = k;
  Value src = Fit(b, Cast(b, ctx.tensor("source"), t), udims);
  Value idx1 = WrapIndex(b, b.Reshape(index, std::vector<int64_t>{k}), self.dims()[static_cast<size_t>(dim)]);
  Value idx = b.BroadcastInDim(idx1, udims, std::vector<int64_t>{dim});
  const bool include_self = !ctx.find("include_self") || ctx.bool_arg("include_self");
  Value r = ScatterReduceCore(ctx, self, dim, idx, src, std::string(ctx.string_arg("reduce")), include_self, t);
  if (scalar_self) r = b.Reshape(r, std::vector<int64_t>{});
  return {Out(b, r, out)};
}

// index_fill(self, dim, index, value): self with the slices index[i] along
// dim set to `value` (a Scalar or 0-d tensor). Negative indices wrap; values
// outside [-size, size) are reported (index_checks), as on CPU.
std::vector<Value> LowerIndexFill(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType t = out.dtype;
  Value self = Fit(b, Cast(b, ctx.tensor("self"), t), out.sizes);
  Value index = ctx.tensor("index");
  const int64_t k = index.type.numel();
  if (k == 0 || Numel(out.sizes) == 0) return {self};
  const bool scalar_self = self.rank() == 0;
  if (scalar_self) self = b.Reshape(self, std::vector<int64_t>{1});
  const int64_t dim = NormalizeDim(ctx.int_arg("dim"), self.rank());
  const int64_t n = self.dims()[static_cast<size_t>(dim)];
  Value idx = WrapIndex(b, b.Reshape(index, std::vector<int64_t>{k, 1}), n);
  hlo::ScatterDims s;
  s.inserted_window_dims = {0};
  s.scatter_dims_to_operand_dims = {0};
  s.index_vector_dim = 1;
  Value hit = b.Scatter(Const(b, ElementType::kPred, 0, std::vector<int64_t>{n}), idx,
                        Const(b, ElementType::kPred, 1, std::vector<int64_t>{k}), s,
                        [](Builder&, std::span<const Value> a) { return std::vector<Value>{a[1]}; });
  Value mask = b.BroadcastInDim(hit, self.dims(), std::vector<int64_t>{dim});
  Value v = Prepare(b, ctx.value("value"), t, self.dims());
  Value r = b.Select(mask, v, self);
  if (scalar_self) r = b.Reshape(r, std::vector<int64_t>{});
  return {Out(b, r, out)};
}

// Inclusive prefix sum of a rank-1 value (Hillis-Steele: ceil(log2 n)
// shifted adds).
Value PrefixSum1D(Builder& b, Value pos) {
  const int64_t n = pos.dims()[0];
  for (int64_t k = 1; k < n; k *= 2) {
    int64_t st[] = {0}, li[] = {n - k}, sr[] = {1}, lo[] = {k}, hi[] = {0}, in[] = {0};
    Value head = b.Slice(pos, st, li, sr);
    pos = b.Add(pos, b.Pad(head, Const(b, pos.element(), 0), lo, hi, in));
  }
  return pos;
}

// Inclusive prefix sum along the last dim of a rank-2 value.
Value PrefixSumRows(Builder& b, Value pos) {
  const int64_t rows = pos.dims()[0], n = pos.dims()[1];
  for (int64_t k = 1; k < n; k *= 2) {
    int64_t st[] = {0, 0}, li[] = {rows, n - k}, sr[] = {1, 1}, lo[] = {0, k}, hi[] = {0, 0}, in[] = {0, 0};
    Value head = b.Slice(pos, st, li, sr);
    pos = b.Add(pos, b.Pad(head, Const(b, pos.element(), 0), lo, hi, in));
  }
  return pos;
}

// --- segment reductions ------------------------------------------------------
// segment_reduce(data, reduce, lengths?, indices?, offsets?, axis, unsafe,
// initial?) and _segment_reduce_backward(grad, output, data, reduce,
// lengths?, offsets?, axis, initial?), as PyTorch's CPU kernels
// (aten/src/ATen/native/SegmentReduce.cpp). lengths (or offsets, lengths =
// offsets[..., 1:] - offsets[..., :-1]) has shape data.shape[:axis] + [S]
// (axis = lengths.dim() - 1); the output is data's shape with size S at
// axis. Empty segments give `initial`, else 0 (sum), 1 (prod), -inf (max),
// inf (min), NaN (mean); max/min propagate NaN; mean = (initial + sum) /
// length. Floating data only. Not reproduced: the !unsafe checks (negative
// lengths, lengths not summing to data.size(axis)), which need a host sync.
struct Segments {
  int64_t outer = 1, len = 0, inner = 1, count = 0;
  Value seg;      // s64 [outer, len]: the segment of each position along axis
  Value lengths;  // s64 [outer, count]
};

Segments SegmentsOf(LoweringContext& ctx, const Value& data) {
  auto& b = ctx.b;
  Value lengths;
  if (ctx.has("lengths")) {
    lengths = CastElement(b, ctx.tensor("lengths"), ElementType::kS64);
  } else if (ctx.has("offsets")) {
    Value off = CastElement(b, ctx.tensor("offsets"), ElementType::kS64);
    const size_t r = static_cast<size_t>(off.rank());
    std::vector<int64_t> st(r, 0), li = off.dims(), sr(r, 1);
    st[r - 1] = 1;
    Value hi = b.Slice(off, st, li, sr);
    st[r - 1] = 0;
    li[r - 1] -= 1;
    lengths = b.Sub(hi, b.Slice(off, st, li, sr));
  } else {
    throw LoweringError(ctx.op_name() + ": either lengths or offsets must be given");
  }
  const int64_t axis = lengths.rank() - 1;
  if (ctx.has("axis") && NormalizeDim(ctx.int_arg("axis"), data.rank()) != axis)
    throw LoweringError(ctx.op_name() + ": axis must be the last dimension of lengths");
  Segments sg;
  for (int64_t d = 0; d < data.rank(); ++d) {
    const int64_t sz = data.dims()[static_cast<size_t>(d)];
    if (d < axis) sg.outer *= sz;
    else if (d == axis) sg.len = sz;
    else sg.inner *= sz;
  }
  sg.count = lengths.dims().back();
  sg.lengths = b.Reshape(lengths, std::vector<int64_t>{sg.outer, sg.count});
  // marks[o, e] = number of segments ending at position e; its prefix sum is
  // the number of segments ended at or before j, i.e. j's segment.
  std::vector<int64_t> os{sg.outer, sg.count, 1};
  Value ends = b.Reshape(PrefixSumRows(b, sg.lengths), os);
  Value rows = b.Iota(TensorType{ElementType::kS64, os}, 0);
  Value coords_parts[] = {rows, ends};
  hlo::ScatterDims s;
  s.inserted_window_dims = {0, 1};
  s.scatter_dims_to_operand_dims = {0, 1};
  s.index_vector_dim = 2;
  Value marks = b.Scatter(Const(b, ElementType::kS64, 0, std::vector<int64_t>{sg.outer, sg.len}),
                          b.Concatenate(coords_parts, 2), Const(b, ElementType::kS64, 1, std::vector<int64_t>{sg.outer, sg.count}), s,
                          [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; });
  sg.seg = PrefixSumRows(b, marks);
  return sg;
}

// (o, seg(o, j)) coordinates: s64 [outer, len, 2].
Value SegmentCoords(Builder& b, const Segments& sg) {
  std::vector<int64_t> s3{sg.outer, sg.len, 1};
  Value parts[] = {b.Iota(TensorType{ElementType::kS64, s3}, 0), b.Reshape(sg.seg, s3)};
  return b.Concatenate(parts, 2);
}

hlo::ScatterDims SegmentScatterDims() {
  hlo::ScatterDims s;
  s.update_window_dims = {2};
  s.inserted_window_dims = {0, 1};
  s.scatter_dims_to_operand_dims = {0, 1};
  s.index_vector_dim = 2;
  return s;
}

std::vector<Value> LowerSegmentReduce(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value data = ctx.tensor("data");
  if (!hlo::IsFloating(data.element())) throw LoweringError(ctx.op_name() + ": floating data only");
  const std::string reduce(ctx.string_arg("reduce"));
  Segments sg = SegmentsOf(ctx, data);
  const ElementType e = data.element();
  std::vector<int64_t> o3{sg.outer, sg.count, sg.inner};
  if (Numel(o3) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  const bool has_initial = ctx.has("initial");
  double dflt = reduce == "max" ? -INFINITY : reduce == "min" ? INFINITY : reduce == "prod" ? 1 : 0;
  Value init = has_initial ? Prepare(b, ctx.value("initial"), out.dtype, o3) : Const(b, e, dflt, o3);
  Value r = init;
  if (sg.len > 0) {
    Value x = b.Reshape(data, std::vector<int64_t>{sg.outer, sg.len, sg.inner});
    r = b.Scatter(init, SegmentCoords(b, sg), x, SegmentScatterDims(),
                  [reduce](Builder& bb, std::span<const Value> a) {
                    if (reduce == "max") return std::vector<Value>{MaxPropagateNaN(bb, a[0], a[1])};
                    if (reduce == "min") return std::vector<Value>{MinPropagateNaN(bb, a[0], a[1])};
                    if (reduce == "prod") return std::vector<Value>{bb.Mul(a[0], a[1])};
                    return std::vector<Value>{bb.Add(a[0], a[1])};
                  });
  } else if (reduce != "sum" && reduce != "mean" && reduce != "max" && reduce != "min" && reduce != "prod") {
    throw LoweringError(ctx.op_name() + ": unsupported reduction '" + reduce + "'");
  }
  if (reduce == "mean") {
    Value len = b.BroadcastInDim(sg.lengths, o3, std::vector<int64_t>{0, 1});
    Value empty = b.Compare(len, ConstLike(b, len, 0), CompareDirection::kEQ);
    Value lenf = b.Convert(len, e);
    Value mean = b.Div(r, b.Select(empty, ConstLike(b, lenf, 1), lenf));
    r = b.Select(empty, has_initial ? init : Const(b, e, NAN, o3), mean);
  }
  return {Out(b, r, out)};
}

std::vector<Value> LowerSegmentReduceBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value data = ctx.tensor("data");
  if (!hlo::IsFloating(data.element())) throw LoweringError(ctx.op_name() + ": floating data only");
  const std::string reduce(ctx.string_arg("reduce"));
  Segments sg = SegmentsOf(ctx, data);
  const ElementType e = data.element();
  std::vector<int64_t> d3{sg.outer, sg.len, sg.inner}, o3{sg.outer, sg.count, sg.inner};
  if (Numel(d3) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  if (sg.count == 0) return {Const(b, e, 0, out.sizes)};
  Value x = b.Reshape(data, d3);
  Value grad = b.Reshape(Cast(b, ctx.tensor("grad"), ToScalarType(e)), o3);
  Value output = b.Reshape(Cast(b, ctx.tensor("output"), ToScalarType(e)), o3);
  Value coords = SegmentCoords(b, sg);
  // Per position: its segment's gradient, output and length (positions past
  // the last segment get 0).
  hlo::GatherDims g;
  g.offset_dims = {2};
  g.collapsed_slice_dims = {0, 1};
  g.start_index_map = {0, 1};
  g.index_vector_dim = 2;
  std::vector<int64_t> slice{1, 1, sg.inner};
  auto pick = [&](const Value& v) { return b.Gather(v, coords, g, slice, TensorType{v.element(), d3}); };
  Value valid = b.BroadcastInDim(b.Compare(sg.seg, Const(b, ElementType::kS64, static_cast<double>(sg.count), std::vector<int64_t>{sg.outer, sg.len}),
                                           CompareDirection::kLT),
                                 d3, std::vector<int64_t>{0, 1});
  Value gx = pick(grad);
  Value zero = Const(b, e, 0, d3);
  Value r;
  if (reduce == "sum") {
    r = gx;
  } else if (reduce == "mean") {
    Value len = b.Convert(pick(b.BroadcastInDim(sg.lengths, o3, std::vector<int64_t>{0, 1})), e);
    r = b.Div(gx, len);
  } else if (reduce == "max" || reduce == "min") {
    Value ox = pick(output);
    Value hit = b.Or(b.Compare(x, x, CompareDirection::kNE), b.Compare(x, ox, CompareDirection::kEQ));
    Value cnt = b.Scatter(Const(b, e, 0, o3), coords, b.Select(hit, Const(b, e, 1, d3), zero), SegmentScatterDims(),
                          [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; });
    Value cx = pick(cnt);
    Value gi = b.Select(hit, gx, zero);
    // CPU divides only the positive gradients of tied elements.
    Value split = b.And(b.Compare(cx, Const(b, e, 2, d3), CompareDirection::kGE), b.Compare(gi, zero, CompareDirection::kGT));
    r = b.Select(split, b.Div(gi, cx), gi);
  } else if (reduce == "prod") {
    Value ox = pick(output);
    Value is_nan = b.Compare(x, x, CompareDirection::kNE);
    Value is_zero = b.Compare(x, zero, CompareDirection::kEQ);
    Value special = b.Or(is_nan, is_zero);
    auto count = [&](const Value& p) {
      Value c = b.Scatter(Const(b, e, 0, o3), coords, b.Select(p, Const(b, e, 1, d3), zero), SegmentScatterDims(),
                          [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; });
      return pick(c);
    };
    Value nans = b.Sub(count(is_nan), b.Select(is_nan, Const(b, e, 1, d3), zero));
    Value zeros = b.Sub(count(is_zero), b.Select(is_zero, Const(b, e, 1, d3), zero));
    Value init = ctx.has("initial") ? Prepare(b, ctx.value("initial"), ToScalarType(e), o3) : Const(b, e, 1, o3);
    Value rest = b.Scatter(init, coords, b.Select(special, Const(b, e, 1, d3), x), SegmentScatterDims(),
                           [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Mul(a[0], a[1])}; });
    Value excl = b.Select(b.Compare(nans, zero, CompareDirection::kGT), Const(b, e, NAN, d3),
                          b.Select(b.Compare(zeros, zero, CompareDirection::kGT), zero, pick(rest)));
    r = b.Select(special, b.Mul(gx, excl), b.Div(b.Mul(gx, ox), x));
  } else {
    throw LoweringError(ctx.op_name() + ": unsupported reduction '" + reduce + "'");
  }
  r = b.Select(valid, r, zero);
  return {Out(b, r, out)};
}

// nonzero_static(self, size, fill_value): s64 [size, self.dim()], the
// coordinates of the nonzero elements (NaN counts as nonzero) in row-major
// order, truncated to `size` rows; missing rows are filled with fill_value.
// The position of each nonzero is a prefix sum of the mask; elements past
// `size` are dropped by the scatter (out-of-range scatter indices are skipped).
std::vector<Value> LowerNonzeroStatic(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  const int64_t size = out.sizes.at(0);
  const int64_t r = x.rank();
  const double fill = ctx.has("fill_value") ? static_cast<double>(ctx.int_arg("fill_value")) : -1.0;
  if (Numel(out.sizes) == 0) return {Const(b, ElementType::kS64, 0, out.sizes)};
  const int64_t n = x.type.numel();
  Value init = Const(b, ElementType::kS64, fill, out.sizes);
  if (n == 0) return {init};
  int64_t nd[] = {n};
  Value m = Cast(b, b.Reshape(x, nd), at::kBool);
  Value pos = b.Sub(PrefixSum1D(b, b.Convert(m, ElementType::kS64)), Const(b, ElementType::kS64, 1, nd));
  Value target = b.Select(m, pos, Const(b, ElementType::kS64, static_cast<double>(size), nd));
  Value flat = b.Iota(TensorType{ElementType::kS64, {n}}, 0);
  std::vector<Value> cols;
  int64_t stride = n;
  for (int64_t d = 0; d < r; ++d) {
    const int64_t sz = x.dims()[static_cast<size_t>(d)];
    stride /= sz;
    Value c = b.Rem(b.Div(flat, Const(b, ElementType::kS64, static_cast<double>(stride), nd)),
                    Const(b, ElementType::kS64, static_cast<double>(sz), nd));
    cols.push_back(b.Reshape(c, std::vector<int64_t>{n, 1}));
  }
  Value coords = b.Concatenate(cols, 1);
  hlo::ScatterDims s;
  s.update_window_dims = {1};
  s.inserted_window_dims = {0};
  s.scatter_dims_to_operand_dims = {0};
  s.index_vector_dim = 1;
  Value res = b.Scatter(init, b.Reshape(target, std::vector<int64_t>{n, 1}), coords, s,
                        [](Builder&, std::span<const Value> a) { return std::vector<Value>{a[1]}; });
  return {Out(b, res, out)};
}

// histc(self, bins, min, max): f [bins], the counts of the elements in
// [min, max] over `bins` equal-width bins, as PyTorch's CPU kernel
// (aten/src/ATen/native/Histogram.cpp, cpu/HistogramKernel.cpp): min == max
// takes the data's own range (aminmax, computed here on the device); an
// empty range becomes [min - 1, max + 1]; bin = (int)((x - lo) * bins /
// (hi - lo)) in the input dtype, x == hi in the last bin; NaN and values
// outside the range are not counted. Floating inputs only (CPU raises for
// others: the lowering declines). Not reproduced: CPU's errors for a
// non-finite or reversed range (they would need a host sync).
std::vector<Value> LowerHistc(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (!hlo::IsFloating(x.element())) throw LoweringError(ctx.op_name() + ": histc needs a floating input");
  const int64_t bins = ctx.int_arg("bins");
  const ElementType e = x.element();
  const int64_t n = x.type.numel();
  std::vector<int64_t> bd{bins};
  if (n == 0 || bins == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  Value lo = CastElement(b, ctx.value("min"), ElementType::kF64);
  Value hi = CastElement(b, ctx.value("max"), ElementType::kF64);
  Value flat = b.Reshape(x, std::vector<int64_t>{n});
  std::vector<int64_t> all{0};
  Value dmin = CastElement(b, ReduceMin(b, flat, all, false), ElementType::kF64);
  Value dmax = CastElement(b, ReduceMax(b, flat, all, false), ElementType::kF64);
  Value same = b.Compare(lo, hi, CompareDirection::kEQ);
  lo = b.Select(same, dmin, lo);
  hi = b.Select(same, dmax, hi);
  Value empty = b.Compare(lo, hi, CompareDirection::kEQ);
  Value one = Const(b, ElementType::kF64, 1);
  lo = b.Select(empty, b.Sub(lo, one), lo);
  hi = b.Select(empty, b.Add(hi, one), hi);
  Value loe = BroadcastTo(b, CastElement(b, lo, e), std::vector<int64_t>{n});
  Value hie = BroadcastTo(b, CastElement(b, hi, e), std::vector<int64_t>{n});
  Value in = b.And(b.Compare(flat, loe, CompareDirection::kGE), b.Compare(flat, hie, CompareDirection::kLE));
  Value scaled = b.Div(b.Mul(b.Sub(flat, loe), Const(b, e, static_cast<double>(bins), std::vector<int64_t>{n})),
                       b.Sub(hie, loe));
  Value pos = b.Convert(scaled, ElementType::kS64);
  Value nb = Const(b, ElementType::kS64, static_cast<double>(bins), std::vector<int64_t>{n});
  pos = b.Select(b.Compare(pos, nb, CompareDirection::kEQ), b.Sub(pos, Const(b, ElementType::kS64, 1, std::vector<int64_t>{n})), pos);
  pos = b.Select(in, pos, nb);
  hlo::ScatterDims s;
  s.inserted_window_dims = {0};
  s.scatter_dims_to_operand_dims = {0};
  s.index_vector_dim = 1;
  Value counts = b.Scatter(Const(b, ElementType::kS64, 0, bd), b.Reshape(pos, std::vector<int64_t>{n, 1}),
                           Const(b, ElementType::kS64, 1, std::vector<int64_t>{n}), s,
                           [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; });
  return {Out(b, counts, out)};
}

// ---------------------------------------------------------------------------
// Advanced indexing: self[indices] with a list of optional integer tensors.

struct AdvancedIndex {
  Value coords;                    // B + [k], s64
  std::vector<int64_t> positions;  // indexed dims, ascending (list order)
  std::vector<int64_t> batch;      // B
  std::vector<int64_t> offset_dims;
  std::vector<int64_t> result_dims;
};

bool IsMask(const LoweredArg& list, size_t j) {
  ElementType e = list.list[j].element();
  return e == ElementType::kPred || e == ElementType::kU8;
}

AdvancedIndex BuildAdvancedIndex(LoweringContext& ctx, const Value& self, const LoweredArg& list) {
  auto& b = ctx.b;
  AdvancedIndex ai;
  std::vector<int64_t> batch;
  bool first = true;
  for (size_t j = 0; j < list.list.size(); ++j) {
    if (!list.present[j]) continue;
    if (IsMask(list, j)) throw LoweringError(ctx.op_name() + ": boolean mask indices have a data-dependent shape");
    if (static_cast<int64_t>(j) >= self.rank()) throw LoweringError(ctx.op_name() + ": too many indices");
    ai.positions.push_back(static_cast<int64_t>(j));
    batch = first ? list.list[j].dims() : BroadcastShapes(batch, list.list[j].dims());
    first = false;
  }
  if (ai.positions.empty()) throw LoweringError(ctx.op_name() + ": no index tensors");
  // Any index into a dimension of size 0 is out of bounds; a gather cannot
  // even be built. The CPU fallback raises PyTorch's IndexError ("index 0 is
  // out of bounds for dimension with size 0").
  if (Numel(batch) > 0)
    for (int64_t p : ai.positions)
      if (self.dims()[static_cast<size_t>(p)] == 0)
        throw LoweringError(ctx.op_name() + ": index into a dimension of size 0");
  ai.batch = batch;
  std::vector<int64_t> col = batch;
  col.push_back(1);
  std::vector<Value> cols;
  for (int64_t p : ai.positions) {
    Value idx = WrapIndex(b, list.list[static_cast<size_t>(p)], self.dims()[static_cast<size_t>(p)]);
    cols.push_back(b.Reshape(BroadcastTo(b, idx, batch), col));
  }
  ai.coords = b.Concatenate(cols, static_cast<int64_t>(batch.size()));
  bool adjacent = ai.positions.back() - ai.positions.front() + 1 == static_cast<int64_t>(ai.positions.size());
  std::vector<int64_t> rest;
  for (int64_t d = 0; d < self.rank(); ++d)
    if (std::find(ai.positions.begin(), ai.positions.end(), d) == ai.positions.end()) rest.push_back(d);
  const int64_t nb = static_cast<int64_t>(batch.size());
  if (adjacent) {
    int64_t first_pos = ai.positions.front();
    int64_t pos = 0;
    for (int64_t d : rest) {
      if (d < first_pos) {
        ai.offset_dims.push_back(pos);
        ai.result_dims.push_back(self.dims()[static_cast<size_t>(d)]);
        ++pos;
      }
    }
    for (int64_t x : batch) ai.result_dims.push_back(x);
    pos += nb;
    for (int64_t d : rest) {
      if (d > first_pos) {
        ai.offset_dims.push_back(pos++);
        ai.result_dims.push_back(self.dims()[static_cast<size_t>(d)]);
      }
    }
  } else {
    ai.result_dims = batch;
    for (size_t i = 0; i < rest.size(); ++i) {
      ai.offset_dims.push_back(nb + static_cast<int64_t>(i));
      ai.result_dims.push_back(self.dims()[static_cast<size_t>(rest[i])]);
    }
  }
  return ai;
}

std::vector<Value> LowerIndex(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = ctx.tensor("self");
  const auto& list = ctx.arg("indices");
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  AdvancedIndex ai = BuildAdvancedIndex(ctx, self, list);
  hlo::GatherDims g;
  g.offset_dims = ai.offset_dims;
  g.collapsed_slice_dims = ai.positions;
  g.start_index_map = ai.positions;
  g.index_vector_dim = static_cast<int64_t>(ai.batch.size());
  std::vector<int64_t> slice = self.dims();
  for (int64_t p : ai.positions) slice[static_cast<size_t>(p)] = 1;
  Value r = b.Gather(self, ai.coords, g, slice, TensorType{self.element(), ai.result_dims});
  return {Out(b, r, out)};
}

// index_put / _index_put_impl_(self, indices, values, accumulate)
std::vector<Value> LowerIndexPut(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType t = out.dtype;
  Value self = Cast(b, ctx.tensor("self"), t);
  const auto& list = ctx.arg("indices");
  const bool accumulate = ctx.find("accumulate") && ctx.bool_arg("accumulate");
  Value values = Cast(b, ctx.tensor("values"), t);
  const bool is_bool = t == at::kBool;
  // A single boolean mask with one value: a masked fill.
  size_t present = 0, mask_at = 0;
  bool has_mask = false;
  for (size_t j = 0; j < list.list.size(); ++j) {
    if (!list.present[j]) continue;
    ++present;
    if (IsMask(list, j)) {
      has_mask = true;
      mask_at = j;
    }
  }
  if (has_mask) {
    if (present != 1 || values.type.numel() != 1)
      throw LoweringError(ctx.op_name() + ": boolean mask indices have a data-dependent shape");
    Value mask = CastElement(b, list.list[mask_at], ElementType::kPred);
    std::vector<int64_t> bd;
    for (int64_t i = 0; i < mask.rank(); ++i) bd.push_back(static_cast<int64_t>(mask_at) + i);
    if (static_cast<int64_t>(mask_at) + mask.rank() > self.rank())
      throw LoweringError(ctx.op_name() + ": mask has too many dims");
    for (int64_t i = 0; i < mask.rank(); ++i)
      if (mask.dims()[static_cast<size_t>(i)] != self.dims()[mask_at + static_cast<size_t>(i)])
        throw LoweringError(ctx.op_name() + ": mask shape does not match");
    Value m = b.BroadcastInDim(mask, self.dims(), bd);
    Value v = BroadcastTo(b, b.Reshape(values, std::vector<int64_t>{}), self.dims());
    if (accumulate) v = is_bool ? b.Or(self, v) : b.Add(self, v);
    return {Out(b, b.Select(m, v, self), out)};
  }
  AdvancedIndex ai = BuildAdvancedIndex(ctx, self, list);
  if (Numel(ai.result_dims) == 0) return {Out(b, self, out)};
  Value updates = BroadcastTo(b, values, ai.result_dims);
  hlo::ScatterDims s;
  s.update_window_dims = ai.offset_dims;
  s.inserted_window_dims = ai.positions;
  s.scatter_dims_to_operand_dims = ai.positions;
  s.index_vector_dim = static_cast<int64_t>(ai.batch.size());
  Value r = b.Scatter(self, ai.coords, updates, s, [accumulate, is_bool](Builder& bb, std::span<const Value> a) {
    if (!accumulate) return std::vector<Value>{a[1]};
    return std::vector<Value>{is_bool ? bb.Or(a[0], a[1]) : bb.Add(a[0], a[1])};
  });
  return {Out(b, r, out)};
}

// masked_scatter(self, mask, source): the i-th True position (row-major) of
// the broadcast mask takes source.flatten()[i].
std::vector<Value> LowerMaskedScatter(LoweringContext& ctx) {
  auto& b = ctx.b;
  TORCH_CHECK(ctx.arg("mask").dtype == at::kBool, "masked_scatter_ only supports boolean masks, but got mask with dtype ",
              ctx.arg("mask").dtype);  // CPU's check, same message
  const auto& out = ctx.outputs[0];
  Value self = Cast(b, ctx.tensor("self"), out.dtype);
  self = Fit(b, self, out.sizes);
  Value mask = Prepare(b, ctx.tensor("mask"), at::kBool, out.sizes);
  Value source = Cast(b, ctx.tensor("source"), out.dtype);
  const int64_t n = Numel(out.sizes);
  const int64_t ns = source.type.numel();
  if (n == 0 || ns == 0) return {self};
  int64_t nd[] = {n};
  Value m = b.Reshape(mask, nd);
  // inclusive prefix sum minus one = source position
  Value pos = PrefixSum1D(b, b.Convert(m, ElementType::kS64));
  pos = b.Sub(pos, ConstLike(b, pos, 1));
  pos = b.Clamp(Const(b, ElementType::kS64, 0, nd), pos, Const(b, ElementType::kS64, static_cast<double>(ns - 1), nd));
  Value flat_src = b.Reshape(source, std::vector<int64_t>{ns});
  Value picked = SelectAlong(b, flat_src, 0, pos);
  Value r = b.Select(m, picked, b.Reshape(self, nd));
  return {Out(b, r, out)};
}

// ---------------------------------------------------------------------------
// cat / stack

std::vector<Value> LowerCat(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const auto& list = ctx.arg("tensors");
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  std::vector<Value> parts;
  int64_t rank = static_cast<int64_t>(out.sizes.size());
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), rank);
  for (size_t i = 0; i < list.list.size(); ++i) {
    if (!list.present[i]) continue;
    const Value& v = list.list[i];
    if (v.rank() == 1 && v.dims()[0] == 0) continue;  // legacy empty tensors are skipped
    if (v.type.numel() == 0) continue;
    parts.push_back(Cast(b, v, out.dtype));
  }
  if (parts.empty()) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  if (ctx.poly_extent && !list.dynamic_items.empty()) {
    // A shape-polymorphic program (LoweringTraits::poly_concat): items
    // marked dynamic are read at the bucket B along `dim` (real size: the
    // runtime extent n); the output is sized for them at B. Each item is
    // written at its real offset (a runtime value once a dynamic item
    // precedes it), in order, so later items overwrite the padding rows of
    // the earlier ones; the output's rows past the real total are padding.
    // Every start is in bounds (offset + size <= the output's size for
    // every n <= B), so dynamic_update_slice never clamps.
    if (dim != ctx.poly_dim) throw LoweringError("cat: polymorphic along another dim than the cat dim");
    hlo::TensorType index{ElementType::kS64, {}};
    Value result = Const(b, ToElementType(out.dtype), 0, out.sizes);
    Value offset = b.ConstantInt(index, 0);
    for (size_t i = 0; i < list.list.size(); ++i) {
      if (!list.present[i]) continue;
      const Value& v = list.list[i];
      if (v.rank() == 1 && v.dims()[0] == 0 && rank != 1) continue;
      if (v.type.numel() == 0) continue;
      const bool dynamic = i < list.dynamic_items.size() && list.dynamic_items[i];
      std::vector<Value> starts;
      for (int64_t d = 0; d < rank; ++d) starts.push_back(d == dim ? offset : b.ConstantInt(index, 0));
      result = b.DynamicUpdateSlice(result, Cast(b, v, out.dtype), starts);
      offset = b.Add(offset, dynamic ? *ctx.poly_extent : b.ConstantInt(index, v.dims()[static_cast<size_t>(dim)]));
    }
    return {Out(b, result, out)};
  }
  return {Out(b, b.Concatenate(parts, dim), out)};
}

std::vector<Value> LowerStack(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const auto& list = ctx.arg("tensors");
  int64_t rank = static_cast<int64_t>(out.sizes.size());
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), rank);
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  std::vector<Value> parts;
  for (size_t i = 0; i < list.list.size(); ++i) {
    std::vector<int64_t> d = list.list[i].dims();
    d.insert(d.begin() + dim, 1);
    parts.push_back(b.Reshape(Cast(b, list.list[i], out.dtype), d));
  }
  return {Out(b, b.Concatenate(parts, dim), out)};
}

// ---------------------------------------------------------------------------
// padding, flips, rolls, repeats, triangles

std::vector<Value> LowerConstantPadNd(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = Cast(b, ctx.tensor("self"), out.dtype);
  auto pad = ctx.ints("pad");
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<int64_t> low(r, 0), high(r, 0), interior(r, 0);
  for (size_t i = 0; 2 * i < pad.size() && i < r; ++i) {
    low[r - 1 - i] = pad[2 * i];
    high[r - 1 - i] = 2 * i + 1 < pad.size() ? pad[2 * i + 1] : 0;
  }
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  Value v = ctx.has("value") ? Cast(b, ctx.value("value"), out.dtype) : Const(b, ToElementType(out.dtype), 0);
  if (x.type.numel() == 0) return {BroadcastTo(b, v, out.sizes)};
  return {Out(b, b.Pad(x, v, low, high, interior), out)};
}

std::vector<Value> LowerFlip(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  auto dims = ReductionDims(ctx.ints("dims"), x.rank());
  if (ctx.ints("dims").empty()) dims.clear();
  return {Out(b, b.Reverse(x, dims), out)};
}

Value RollDim(Builder& b, const Value& x, int64_t shift, int64_t dim) {
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  if (n == 0) return x;
  int64_t s = ((shift % n) + n) % n;
  if (s == 0) return x;
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
  st[static_cast<size_t>(dim)] = n - s;
  Value tail = b.Slice(x, st, li, sr);
  st[static_cast<size_t>(dim)] = 0;
  li[static_cast<size_t>(dim)] = n - s;
  Value head = b.Slice(x, st, li, sr);
  Value parts[] = {tail, head};
  return b.Concatenate(parts, dim);
}

std::vector<Value> LowerRoll(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  auto shifts = ctx.ints("shifts");
  auto dims = ctx.ints("dims");
  if (dims.empty()) {
    std::vector<int64_t> shape = x.dims();
    Value flat = b.Reshape(x, std::vector<int64_t>{x.type.numel()});
    return {Out(b, b.Reshape(RollDim(b, flat, shifts.at(0), 0), shape), out)};
  }
  if (shifts.size() != dims.size()) throw LoweringError(ctx.op_name() + ": shifts and dims differ in length");
  for (size_t i = 0; i < dims.size(); ++i) x = RollDim(b, x, shifts[i], NormalizeDim(dims[i], x.rank()));
  return {Out(b, x, out)};
}

std::vector<Value> LowerRepeat(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  auto reps = ctx.ints("repeats");
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  const size_t n = reps.size();
  std::vector<int64_t> padded(n - static_cast<size_t>(x.rank()), 1);
  for (int64_t d : x.dims()) padded.push_back(d);
  x = b.Reshape(x, padded);
  std::vector<int64_t> big, bd;
  for (size_t i = 0; i < n; ++i) {
    big.push_back(reps[i]);
    big.push_back(padded[i]);
    bd.push_back(static_cast<int64_t>(2 * i + 1));
  }
  Value r = b.BroadcastInDim(x, big, bd);
  return {Out(b, b.Reshape(r, out.sizes), out)};
}

std::vector<Value> Triangle(LoweringContext& ctx, bool lower) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = Cast(b, ctx.tensor("self"), out.dtype);
  if (x.rank() < 2) throw LoweringError(ctx.op_name() + ": input must have at least 2 dims");
  int64_t diagonal = ctx.has("diagonal") ? ctx.int_arg("diagonal") : 0;
  TensorType it{ElementType::kS64, x.dims()};
  Value row = b.Iota(it, x.rank() - 2), col = b.Iota(it, x.rank() - 1);
  Value diff = b.Sub(col, row);
  Value keep = b.Compare(diff, Const(b, ElementType::kS64, static_cast<double>(diagonal), x.dims()),
                         lower ? CompareDirection::kLE : CompareDirection::kGE);
  return {Out(b, b.Select(keep, x, ConstLike(b, x, 0)), out)};
}
std::vector<Value> LowerTril(LoweringContext& ctx) { return Triangle(ctx, true); }
std::vector<Value> LowerTriu(LoweringContext& ctx) { return Triangle(ctx, false); }

// ---------------------------------------------------------------------------
// factories

c10::Scalar StaticScalar(const LoweringContext& ctx, std::string_view name, double dflt) {
  const LoweredArg* a = ctx.find(name);
  if (!a || a->kind == LoweredArg::Kind::kNone || a->ivalue.isNone()) return c10::Scalar(dflt);
  if (a->kind != LoweredArg::Kind::kStatic) throw LoweringError(ctx.op_name() + ": scalar is not static");
  return a->ivalue.toScalar();
}

// arange: start + i * step, computed as PyTorch's CPU kernel does (in int64
// for integer outputs, in double for floating ones) and converted once.
std::vector<Value> LowerArange(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  c10::Scalar start = StaticScalar(ctx, "start", 0), step = StaticScalar(ctx, "step", 1);
  if (out.sizes.size() != 1) throw LoweringError(ctx.op_name() + ": unexpected output rank");
  const int64_t n = out.sizes[0];
  if (n == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  if (at::isIntegralType(out.dtype, /*includeBool=*/true)) {
    Value i = b.Iota(TensorType{ElementType::kS64, {n}}, 0);
    Value st = b.ConstantInt(TensorType{ElementType::kS64, {}}, step.toLong());
    Value s0 = b.ConstantInt(TensorType{ElementType::kS64, {}}, start.toLong());
    Value r = b.Add(b.Mul(i, BroadcastTo(b, st, out.sizes)), BroadcastTo(b, s0, out.sizes));
    return {Out(b, r, out)};
  }
  // bf16/f16: PyTorch accumulates in float; f32/f64 in double.
  ElementType e = (out.dtype == at::kBFloat16 || out.dtype == at::kHalf) ? ElementType::kF32 : ElementType::kF64;
  Value i = b.Iota(TensorType{e, {n}}, 0);
  Value r = b.Add(b.Mul(i, Const(b, e, step.toDouble(), out.sizes)), Const(b, e, start.toDouble(), out.sizes));
  return {Out(b, r, out)};
}

std::vector<Value> LowerFull(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.value("fill_value"), out.dtype, out.sizes)};
}

std::vector<Value> LowerEye(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (out.sizes.size() != 2) throw LoweringError(ctx.op_name() + ": unexpected output rank");
  TensorType it{ElementType::kS64, out.sizes};
  Value diag = b.Compare(b.Iota(it, 0), b.Iota(it, 1), CompareDirection::kEQ);
  return {Out(b, diag, out)};
}

// ---------------------------------------------------------------------------
// sort / topk: stable, NaN sorted as the largest value (as on CPU).

std::pair<Value, Value> SortAlong(Builder& b, const Value& x, int64_t dim, bool descending) {
  Value idx = b.Iota(TensorType{ElementType::kS64, x.dims()}, dim);
  Value in[] = {x, idx};
  const bool floating = hlo::IsFloating(x.element());
  auto r = b.Sort(in, dim, true, [&](Builder& bb, std::span<const Value> a) {
    const Value &l = a[0], &rr = a[1];
    Value lv = l, rv = rr;
    if (l.element() == ElementType::kPred) {
      lv = bb.Convert(l, ElementType::kU8);
      rv = bb.Convert(rr, ElementType::kU8);
    }
    Value cmp = bb.Compare(lv, rv, descending ? CompareDirection::kGT : CompareDirection::kLT);
    if (floating) {
      Value l_nan = bb.Compare(lv, lv, CompareDirection::kNE);
      Value r_nan = bb.Compare(rv, rv, CompareDirection::kNE);
      // ascending: non-NaN < NaN; descending: NaN first.
      Value nan_order = descending ? bb.And(l_nan, bb.Not(r_nan)) : bb.And(bb.Not(l_nan), r_nan);
      cmp = bb.Or(cmp, nan_order);
    }
    return std::vector<Value>{cmp};
  });
  return {r[0], r[1]};
}

std::vector<Value> LowerSort(LoweringContext& ctx) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  const bool descending = ctx.has("descending") && ctx.bool_arg("descending");
  if (x.rank() == 0) return {Out(b, x, ctx.outputs[0]), Const(b, ElementType::kS64, 0)};
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : -1, x.rank());
  if (x.type.numel() == 0) return {Out(b, x, ctx.outputs[0]), Const(b, ElementType::kS64, 0, x.dims())};
  auto [v, i] = SortAlong(b, x, dim, descending);
  return {Out(b, v, ctx.outputs[0]), Out(b, i, ctx.outputs[1])};
}

std::vector<Value> LowerTopk(LoweringContext& ctx) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  const bool largest = !ctx.has("largest") || ctx.bool_arg("largest");
  const int64_t k = ctx.int_arg("k");
  if (x.rank() == 0) return {Out(b, x, ctx.outputs[0]), Const(b, ElementType::kS64, 0)};
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : -1, x.rank());
  if (Numel(ctx.outputs[0].sizes) == 0)
    return {Const(b, ToElementType(ctx.outputs[0].dtype), 0, ctx.outputs[0].sizes),
            Const(b, ElementType::kS64, 0, ctx.outputs[1].sizes)};
  auto [v, i] = SortAlong(b, x, dim, largest);
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
  li[static_cast<size_t>(dim)] = k;
  return {Out(b, b.Slice(v, st, li, sr), ctx.outputs[0]), Out(b, b.Slice(i, st, li, sr), ctx.outputs[1])};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"index_select", LowerIndexSelect, {.index_checks = {{"index", "self", "dim"}}}},
    {"embedding", LowerEmbedding, {.index_checks = {{"indices", "weight", ""}}}},
    {"gather", LowerGather, {.index_checks = {{"index", "self", "dim", false, true}}}},
    {"scatter", LowerScatter, {.index_checks = {{"index", "self", "dim", false, true}}}},
    {"scatter_add", LowerScatterAdd, {.index_checks = {{"index", "self", "dim", false, true}}}},
    {"scatter_reduce", LowerScatterReduce, {.index_checks = {{"index", "self", "dim", false, true}}}},
    {"index_add", LowerIndexAdd, {.index_checks = {{"index", "self", "dim"}}}},
    {"index_copy", LowerIndexCopy, {.index_checks = {{"index", "self", "dim"}}}},
    {"index_reduce", LowerIndexReduce, {.index_checks = {{"index", "self", "dim"}}}},
    {"index_fill", LowerIndexFill, {.index_checks = {{"index", "self", "dim", true}}}},
    {"nonzero_static", LowerNonzeroStatic},
    {"histc", LowerHistc},
    {"segment_reduce", LowerSegmentReduce},
    {"_segment_reduce_backward", LowerSegmentReduceBackward},
    {"index", LowerIndex, {.index_checks = {{"indices", "self", "", true}}}},
    {"index_put", LowerIndexPut, {.index_checks = {{"indices", "self", "", true}}}},
    {"_index_put_impl", LowerIndexPut, {.index_checks = {{"indices", "self", "", true}}}},
    {"masked_scatter", LowerMaskedScatter},
    {"cat", LowerCat, {.complex = true}},  // data movement: complex as is
    {"stack", LowerStack, {.complex = true}},  // data movement: complex as is
    {"constant_pad_nd", LowerConstantPadNd, {.complex = true}},  // data movement: complex as is
    {"flip", LowerFlip},
    {"roll", LowerRoll},
    {"repeat", LowerRepeat},
    {"tril", LowerTril},
    {"triu", LowerTriu},
    {"arange", LowerArange, {.static_scalars = true, .out_resized_by_numel = true, .out_resize_warns = true}},
    // range(start, end, step): end inclusive; CPU's range_out computes
    // start + i * step in acc_type (double for float/double, float for
    // half/bfloat16, int64 for integers), as arange: its lowering serves.
    {"range", LowerArange, {.static_scalars = true, .out_resized_by_numel = true}},
    {"full", LowerFull},
    {"eye", LowerEye},
    {"sort", LowerSort},
    {"topk", LowerTopk},
});

}  // namespace torch_tpu::lowering
