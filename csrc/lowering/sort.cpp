// Order statistics and sorted-sequence ops: kthvalue, median / nanmedian
// (full and .dim), mode, cummax / cummin, searchsorted, bucketize, isin.
// (sort and topk live in index.cpp; argsort and msort decompose into sort.)
//
// PyTorch semantics: NaN sorts as the largest value; median returns the
// lower median and NaN (the first NaN of the row, with its index) when the
// row has one, nanmedian the lower median of the non-NaN values; cummax /
// cummin carry NaN forward and move to the latest index on ties, as the CPU
// kernel's `x >= max || isnan(x)` does; mode picks the most frequent value,
// the smallest among equally frequent ones, with the index of its last
// occurrence. Which of several equal elements kthvalue/median report is
// unspecified in PyTorch (CPU uses nth_element); here it is the first.
// searchsorted/bucketize count the boundaries below each value, and isin
// compares every element with every test element (O(n*m) compares, no
// data-dependent shapes; CPU switches to a sort-based method for large m).
#include <algorithm>
#include <limits>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;

std::vector<Value> EmptyOutputs(Builder& b, const LoweringContext& ctx) {
  std::vector<Value> r;
  for (const auto& o : ctx.outputs) r.push_back(Const(b, ToElementType(o.dtype), 0, o.sizes));
  return r;
}

// x with `dim` moved to the last position.
Value MoveToLast(Builder& b, const Value& x, int64_t dim) {
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (d != dim) perm.push_back(d);
  perm.push_back(dim);
  return b.Transpose(x, perm);
}

// Comparable form of a value: bool compares as u8.
Value Comparable(Builder& b, const Value& v) {
  return v.element() == ElementType::kPred ? b.Convert(v, ElementType::kU8) : v;
}

Value IsNan(Builder& b, const Value& v) {
  if (!hlo::IsFloating(v.element())) return Const(b, ElementType::kPred, 0, v.dims());
  return b.Compare(v, v, CompareDirection::kNE);
}

// Stable ascending sort along the last dim, NaN last; returns (values, indices).
std::pair<Value, Value> SortLast(Builder& b, const Value& x) {
  const int64_t last = x.rank() - 1;
  Value idx = b.Iota(TensorType{ElementType::kS64, x.dims()}, last);
  Value in[] = {x, idx};
  const bool floating = hlo::IsFloating(x.element());
  auto r = b.Sort(in, last, true, [&](Builder& bb, std::span<const Value> a) {
    Value l = Comparable(bb, a[0]), rr = Comparable(bb, a[1]);
    Value cmp = bb.Compare(l, rr, CompareDirection::kLT);
    if (floating) {
      Value l_nan = bb.Compare(l, l, CompareDirection::kNE);
      Value r_nan = bb.Compare(rr, rr, CompareDirection::kNE);
      cmp = bb.Or(cmp, bb.And(bb.Not(l_nan), r_nan));
    }
    return std::vector<Value>{cmp};
  });
  return {r[0], r[1]};
}

// The elements of `vals` (…, n) at position pos (…, 1) of the last dim.
Value PickLast(Builder& b, const Value& vals, const Value& pos) {
  const int64_t last = vals.rank() - 1;
  TensorType it{ElementType::kS64, vals.dims()};
  Value flag = b.Compare(b.Iota(it, last), BroadcastTo(b, pos, vals.dims()), CompareDirection::kEQ);
  Value inputs[] = {flag, vals};
  Value inits[] = {Const(b, ElementType::kPred, 0), Const(b, vals.element(), 0)};
  int64_t dims[] = {last};
  auto r = b.Reduce(inputs, inits, dims, [](Builder& bb, std::span<const Value> a) {
    // Block order: accumulators (flag, value), then elements (flag, value).
    const Value &af = a[0], &av = a[1], &bf = a[2], &bv = a[3];
    return std::vector<Value>{bb.Or(af, bf), bb.Select(bf, bv, av)};
  });
  std::vector<int64_t> keep = vals.dims();
  keep.back() = 1;
  return b.Reshape(r[1], keep);
}

// --- kthvalue / median ---------------------------------------------------------

std::vector<Value> LowerKthvalue(LoweringContext& ctx) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  if (Numel(ctx.outputs[0].sizes) == 0 || x.type.numel() == 0) return EmptyOutputs(b, ctx);
  const int64_t k = ctx.int_arg("k");
  if (x.rank() == 0) return {Out(b, x, ctx.outputs[0]), Const(b, ElementType::kS64, 0)};
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : -1, x.rank());
  Value xt = MoveToLast(b, x, dim);
  auto [v, i] = SortLast(b, xt);
  const size_t r = static_cast<size_t>(xt.rank());
  std::vector<int64_t> st(r, 0), li = xt.dims(), step(r, 1);
  st[r - 1] = k - 1;
  li[r - 1] = k;
  return {Out(b, b.Slice(v, st, li, step), ctx.outputs[0]), Out(b, b.Slice(i, st, li, step), ctx.outputs[1])};
}

// Median along the last dim of xt; `ignore_nan` for nanmedian.
std::pair<Value, Value> MedianLast(Builder& b, const Value& xt, bool ignore_nan) {
  const int64_t n = xt.dims().back();
  auto [v, i] = SortLast(b, xt);
  std::vector<int64_t> keep = xt.dims();
  keep.back() = 1;
  Value pos;
  if (!hlo::IsFloating(xt.element())) {
    pos = Const(b, ElementType::kS64, static_cast<double>((n - 1) / 2), keep);
  } else {
    Value not_nan = b.Convert(b.Not(IsNan(b, xt)), ElementType::kS64);
    int64_t last[] = {xt.rank() - 1};
    Value c = ReduceSum(b, not_nan, last, true);  // count of non-NaN
    Value one = Const(b, ElementType::kS64, 1, keep), two = Const(b, ElementType::kS64, 2, keep);
    Value zero = Const(b, ElementType::kS64, 0, keep);
    if (ignore_nan) {
      Value mid = b.Div(b.Sub(c, one), two);
      pos = b.Select(b.Compare(c, zero, CompareDirection::kGT), mid, zero);
    } else {
      Value nfull = Const(b, ElementType::kS64, static_cast<double>(n), keep);
      Value mid = Const(b, ElementType::kS64, static_cast<double>((n - 1) / 2), keep);
      // A NaN in the row: the first NaN sits at sorted position c.
      pos = b.Select(b.Compare(c, nfull, CompareDirection::kLT), c, mid);
    }
  }
  return {PickLast(b, v, pos), PickLast(b, i, pos)};
}

std::vector<Value> Median(LoweringContext& ctx, bool ignore_nan) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  if (x.type.numel() == 0) {
    // median of nothing is NaN (full reduction); .dim over an empty dim is
    // rejected by the meta kernel.
    std::vector<Value> r = EmptyOutputs(b, ctx);
    if (ctx.outputs.size() == 1 && hlo::IsFloating(ToElementType(ctx.outputs[0].dtype)))
      r[0] = Const(b, ToElementType(ctx.outputs[0].dtype), std::numeric_limits<double>::quiet_NaN(),
                   ctx.outputs[0].sizes);
    return r;
  }
  if (!ctx.find("dim")) {  // full reduction: value only
    int64_t flat[] = {x.type.numel()};
    auto [v, i] = MedianLast(b, b.Reshape(x, flat), ignore_nan);
    return {Out(b, v, ctx.outputs[0])};
  }
  if (x.rank() == 0) return {Out(b, x, ctx.outputs[0]), Const(b, ElementType::kS64, 0)};
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  auto [v, i] = MedianLast(b, MoveToLast(b, x, dim), ignore_nan);
  return {Out(b, v, ctx.outputs[0]), Out(b, i, ctx.outputs[1])};
}

std::vector<Value> LowerMedian(LoweringContext& ctx) { return Median(ctx, false); }
std::vector<Value> LowerNanmedian(LoweringContext& ctx) { return Median(ctx, true); }

// --- mode ----------------------------------------------------------------------

std::vector<Value> LowerMode(LoweringContext& ctx) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  if (Numel(ctx.outputs[0].sizes) == 0 || x.type.numel() == 0) return EmptyOutputs(b, ctx);
  if (x.rank() == 0) return {Out(b, x, ctx.outputs[0]), Const(b, ElementType::kS64, 0)};
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : -1, x.rank());
  Value xt = Comparable(b, MoveToLast(b, x, dim));
  const int64_t r = xt.rank(), n = xt.dims().back();
  // Pairwise equality (…, i, j).
  std::vector<int64_t> pdims = xt.dims();
  pdims.push_back(n);
  std::vector<int64_t> bi, bj;
  for (int64_t d = 0; d < r - 1; ++d) {
    bi.push_back(d);
    bj.push_back(d);
  }
  bi.push_back(r - 1);
  bj.push_back(r);
  Value xi = b.BroadcastInDim(xt, pdims, bi), xj = b.BroadcastInDim(xt, pdims, bj);
  Value eq = b.Compare(xi, xj, CompareDirection::kEQ);
  int64_t jdim[] = {r};
  Value freq = ReduceSum(b, b.Convert(eq, ElementType::kS64), jdim, false);  // (…, n)
  TensorType pt{ElementType::kS64, pdims};
  Value jidx = b.Select(eq, b.Iota(pt, r), Const(b, ElementType::kS64, -1, pdims));
  Value last = ReduceMax(b, jidx, jdim, false);
  last = b.Max(last, b.Iota(TensorType{ElementType::kS64, xt.dims()}, r - 1));  // NaN: itself
  const bool floating = hlo::IsFloating(xt.element());
  Value inputs[] = {freq, xt, last};
  Value inits[] = {Const(b, ElementType::kS64, -1), Const(b, xt.element(), 0),
                   b.ConstantInt(TensorType{ElementType::kS64, {}}, std::numeric_limits<int64_t>::max())};
  int64_t rdim[] = {r - 1};
  auto res = b.Reduce(inputs, inits, rdim, [floating](Builder& bb, std::span<const Value> a) {
    const Value &af = a[0], &av = a[1], &al = a[2], &bf = a[3], &bv = a[4], &bl = a[5];
    // Order: higher frequency, then smaller value (NaN largest), then smaller index.
    Value v_lt = bb.Compare(bv, av, CompareDirection::kLT);
    Value v_eq = bb.Compare(bv, av, CompareDirection::kEQ);
    if (floating) {
      Value a_nan = bb.Compare(av, av, CompareDirection::kNE);
      Value b_nan = bb.Compare(bv, bv, CompareDirection::kNE);
      v_lt = bb.Or(v_lt, bb.And(a_nan, bb.Not(b_nan)));
      v_eq = bb.Or(v_eq, bb.And(a_nan, b_nan));
    }
    Value better_v = bb.Or(v_lt, bb.And(v_eq, bb.Compare(bl, al, CompareDirection::kLT)));
    Value f_gt = bb.Compare(bf, af, CompareDirection::kGT);
    Value f_eq = bb.Compare(bf, af, CompareDirection::kEQ);
    Value pick = bb.Or(f_gt, bb.And(f_eq, better_v));
    return std::vector<Value>{bb.Select(pick, bf, af), bb.Select(pick, bv, av), bb.Select(pick, bl, al)};
  });
  Value v = res[1];
  if (x.element() == ElementType::kPred) v = Cast(b, v, at::kBool);
  return {Out(b, v, ctx.outputs[0]), Out(b, res[2], ctx.outputs[1])};
}

// --- cummax / cummin -----------------------------------------------------------

double Lowest(ElementType t) {
  if (hlo::IsFloating(t)) return -std::numeric_limits<double>::infinity();
  switch (t) {
    case ElementType::kS8: return -128;
    case ElementType::kS16: return -32768;
    case ElementType::kS32: return -2147483648.0;
    default: return 0;
  }
}
double Highest(ElementType t) {
  if (hlo::IsFloating(t)) return std::numeric_limits<double>::infinity();
  switch (t) {
    case ElementType::kS8: return 127;
    case ElementType::kS16: return 32767;
    case ElementType::kS32: return 2147483647.0;
    case ElementType::kU8: return 255;
    case ElementType::kU16: return 65535;
    case ElementType::kU32: return 4294967295.0;
    default: return 0;
  }
}

Value Extreme(Builder& b, ElementType t, bool highest) {
  if (t == ElementType::kS64)
    return b.ConstantInt(TensorType{t, {}}, highest ? std::numeric_limits<int64_t>::max()
                                                    : std::numeric_limits<int64_t>::min());
  if (t == ElementType::kU64)
    return b.ConstantInt(TensorType{t, {}}, highest ? -1 : 0);  // all bits set
  return Const(b, t, highest ? Highest(t) : Lowest(t));
}

// Prefix scan (Hillis-Steele, log2(n) steps) of (value, index) along the
// last dim: `b` (later) replaces `a` when it is NaN and a is not, or both are
// NaN (the later NaN), or b >= a (b <= a for cummin) and neither is NaN.
std::vector<Value> LowerCumExtreme(LoweringContext& ctx, bool is_max) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  if (x.type.numel() == 0) return EmptyOutputs(b, ctx);
  if (x.rank() == 0) return {Out(b, x, ctx.outputs[0]), Const(b, ElementType::kS64, 0)};
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  Value xt = Comparable(b, MoveToLast(b, x, dim));
  const int64_t r = xt.rank(), n = xt.dims().back();
  const bool floating = hlo::IsFloating(xt.element());
  Value v = xt;
  Value idx = b.Iota(TensorType{ElementType::kS64, xt.dims()}, r - 1);
  Value pad_v = Extreme(b, xt.element(), !is_max);
  Value pad_i = b.ConstantInt(TensorType{ElementType::kS64, {}}, -1);
  std::vector<int64_t> zeros(static_cast<size_t>(r), 0), ones(static_cast<size_t>(r), 1);
  for (int64_t s = 1; s < n; s *= 2) {
    // a = element s positions earlier (padding before the start), b = current.
    std::vector<int64_t> lo = zeros, hi = zeros;
    lo.back() = s;
    std::vector<int64_t> start = zeros, limit = xt.dims();
    Value av = b.Slice(b.Pad(v, pad_v, lo, hi, zeros), start, limit, ones);
    Value ai = b.Slice(b.Pad(idx, pad_i, lo, hi, zeros), start, limit, ones);
    const Value &bv = v, &bi = idx;
    Value take_b = b.Compare(bv, av, is_max ? CompareDirection::kGE : CompareDirection::kLE);
    if (floating) {
      Value a_nan = IsNan(b, av), b_nan = IsNan(b, bv);
      // b NaN: b (it is later). a NaN, b not: a. Neither: the comparison.
      take_b = b.Select(b_nan, b_nan, b.And(b.Not(a_nan), take_b));
    }
    // Indices: b is always the later element.
    v = b.Select(take_b, bv, av);
    idx = b.Select(take_b, bi, ai);
  }
  std::vector<int64_t> perm;  // inverse of MoveToLast
  for (int64_t d = 0; d < r; ++d) perm.push_back(d < dim ? d : d == dim ? r - 1 : d - 1);
  if (x.element() == ElementType::kPred) v = Cast(b, v, at::kBool);
  return {Out(b, b.Transpose(v, perm), ctx.outputs[0]), Out(b, b.Transpose(idx, perm), ctx.outputs[1])};
}

std::vector<Value> LowerCummax(LoweringContext& ctx) { return LowerCumExtreme(ctx, true); }
std::vector<Value> LowerCummin(LoweringContext& ctx) { return LowerCumExtreme(ctx, false); }

// --- searchsorted / bucketize ------------------------------------------------------

// For each value of `x`, the number of entries of the sorted last dim of
// `seq` below it (left) or not above it (right). seq is 1-D (shared by all
// values) or has x's leading dims.
Value CountBelow(Builder& b, const Value& seq, const Value& x, bool right) {
  std::vector<int64_t> cdims = x.dims();
  const int64_t m = seq.dims().back();
  cdims.push_back(m);
  const int64_t xr = x.rank();
  std::vector<int64_t> xb, sb;
  for (int64_t d = 0; d < xr; ++d) xb.push_back(d);
  if (seq.rank() == 1) {
    sb.push_back(xr);
  } else {
    for (int64_t d = 0; d < seq.rank() - 1; ++d) sb.push_back(d);
    sb.push_back(xr);
  }
  Value xv = b.BroadcastInDim(x, cdims, xb), sv = b.BroadcastInDim(seq, cdims, sb);
  // CPU's binary search: left counts !(seq >= x), right !(seq > x) (so a
  // NaN value lands past every entry).
  Value hit = b.Not(b.Compare(sv, xv, right ? CompareDirection::kGT : CompareDirection::kGE));
  int64_t last[] = {xr};
  return ReduceSum(b, b.Convert(hit, ElementType::kS64), last, false);
}

at::ScalarType CommonType(const LoweringContext& ctx, std::string_view seq, std::string_view val) {
  at::ScalarType st = ctx.arg(seq).dtype;
  const LoweredArg& v = ctx.arg(val);
  if (v.kind == LoweredArg::Kind::kScalar && v.wrapped_number) {
    if (at::isFloatingType(v.dtype) && !at::isFloatingType(st)) return at::kDouble;
    return st;
  }
  return at::promoteTypes(st, v.dtype);
}

at::ScalarType CompareType(at::ScalarType t) {
  if (t == at::kBFloat16 || t == at::kHalf) return at::kFloat;
  if (t == at::kBool) return at::kByte;
  return t;
}

std::vector<Value> LowerSearchsorted(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  bool right = ctx.has("right") && ctx.bool_arg("right");
  if (ctx.has("side")) right = ctx.string_arg("side") == "right";
  Value seq = ctx.tensor("sorted_sequence");
  Value x = ctx.value("self");
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  if (seq.dims().back() == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  at::ScalarType ct = CompareType(CommonType(ctx, "sorted_sequence", "self"));
  seq = Cast(b, seq, ct);
  x = Cast(b, x, ct);
  if (ctx.has("sorter")) {
    Value sorter = Cast(b, ctx.tensor("sorter"), at::kLong);
    // seq gathered by sorter along the last dim (one-hot pick per position).
    const int64_t m = seq.dims().back(), sr = seq.rank();
    std::vector<int64_t> pdims = seq.dims();
    pdims.push_back(m);  // (…, position p, source j)
    std::vector<int64_t> bp, bs;
    for (int64_t d = 0; d < sr; ++d) bp.push_back(d);
    for (int64_t d = 0; d < sr - 1; ++d) bs.push_back(d);
    bs.push_back(sr);
    Value src = b.Iota(TensorType{ElementType::kS64, pdims}, sr);
    Value flag = b.Compare(src, b.BroadcastInDim(sorter, pdims, bp), CompareDirection::kEQ);
    Value vals = b.BroadcastInDim(seq, pdims, bs);
    Value inputs[] = {flag, vals};
    Value inits[] = {Const(b, ElementType::kPred, 0), Const(b, seq.element(), 0)};
    int64_t rd[] = {sr};
    seq = b.Reduce(inputs, inits, rd, [](Builder& bb, std::span<const Value> a) {
      return std::vector<Value>{bb.Or(a[0], a[2]), bb.Select(a[2], a[3], a[1])};
    })[1];
  }
  return {Out(b, CountBelow(b, seq, x, right), out)};
}

std::vector<Value> LowerBucketize(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const bool right = ctx.has("right") && ctx.bool_arg("right");
  Value seq = ctx.tensor("boundaries");
  TORCH_CHECK(seq.rank() == 1, "boundaries tensor must be 1 dimension, but got dim(", seq.rank(), ")");  // CPU's check
  Value x = ctx.value("self");
  if (Numel(out.sizes) == 0 || seq.dims().back() == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  at::ScalarType ct = CompareType(CommonType(ctx, "boundaries", "self"));
  return {Out(b, CountBelow(b, Cast(b, seq, ct), Cast(b, x, ct), right), out)};
}

// isin(elements, test_elements, *, assume_unique, invert) and its
// Tensor_Scalar / Scalar_Tensor overloads: bool of elements' shape, true
// where the element equals some test element (compared in the promoted
// dtype, as torch.result_type; NaN matches nothing), negated by invert.
std::vector<Value> LowerIsin(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const bool invert = ctx.has("invert") && ctx.bool_arg("invert");
  const std::string_view en = ctx.find("elements") ? "elements" : "element";
  const std::string_view tn = ctx.find("test_elements") ? "test_elements" : "test_element";
  const LoweredArg& e = ctx.arg(en);
  const LoweredArg& t = ctx.arg(tn);
  if (Numel(out.sizes) == 0) return {Const(b, ElementType::kPred, 0, out.sizes)};
  at::ScalarType ct;
  if (e.kind == LoweredArg::Kind::kScalar && e.wrapped_number)
    ct = CommonType(ctx, tn, en);
  else
    ct = CommonType(ctx, en, tn);
  ct = CompareType(ct);
  Value x = b.Reshape(Cast(b, e.value, ct), std::vector<int64_t>{Numel(out.sizes)});
  Value tests = Cast(b, t.value, ct);
  const int64_t m = tests.type.numel();
  if (m == 0) return {Const(b, ElementType::kPred, invert ? 1 : 0, out.sizes)};
  tests = b.Reshape(tests, std::vector<int64_t>{m});
  const int64_t n = x.dims()[0];
  std::vector<int64_t> grid{n, m};
  Value eq = b.Compare(b.BroadcastInDim(x, grid, std::vector<int64_t>{0}),
                       b.BroadcastInDim(tests, grid, std::vector<int64_t>{1}), CompareDirection::kEQ);
  int64_t last[] = {1};
  Value found = ReduceOr(b, eq, last, false);
  if (invert) found = b.Not(found);
  return {b.Reshape(found, out.sizes)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"isin", LowerIsin},
    {"kthvalue", LowerKthvalue},
    {"median", LowerMedian},
    {"nanmedian", LowerNanmedian},
    {"mode", LowerMode},
    {"cummax", LowerCummax},
    {"cummin", LowerCummin},
    {"searchsorted", LowerSearchsorted},
    {"bucketize", LowerBucketize},
});

}  // namespace torch_tpu::lowering
