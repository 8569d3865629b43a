// Reductions: sum, mean, prod, amax/amin, aminmax, max/min (full and .dim with
// indices), argmax/argmin, any/all, var/std (+_mean), cumsum/cumprod,
// _logcumsumexp,
// logsumexp, linalg_vector_norm and norm.
//
// PyTorch semantics: bf16/f16 reductions accumulate in f32 and round once;
// integer/bool sums accumulate in int64 (the meta kernel's dtype); max/min
// propagate NaN; argmax/argmin and max/min.dim return the first occurrence
// (ties broken by index inside the reduction body, so the result does not
// depend on XLA's reduction order). Empty reductions give the identity
// (sum 0, prod 1, mean NaN); those PyTorch rejects (amax of an empty dim) are
// rejected by the meta kernel before we get here.
#include <cmath>
#include <limits>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;

// An int[] argument (also SymInt[] and a bare int); empty if None/absent.

// Reshapes `v` to the meta kernel's output sizes (keepdim forms).
int64_t CountOf(const Value& x, std::span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= x.dims()[static_cast<size_t>(d)];
  return n;
}

bool IsFloat(at::ScalarType t) { return at::isFloatingType(t); }

// Accumulation dtype for a reduction producing `out`.
at::ScalarType AccType(at::ScalarType out) { return OpMathType(out); }

// The reduction dims of an op: "dim" as int, int[] or None (None/[] = all).
std::vector<int64_t> DimsOf(const LoweringContext& ctx, const Value& x) {
  return ReductionDims(ctx.ints("dim"), x.rank());
}

bool KeepDim(const LoweringContext& ctx) {
  const LoweredArg* a = ctx.find("keepdim");
  return a && a->kind == LoweredArg::Kind::kStatic && ctx.bool_arg("keepdim");
}

// The input converted as PyTorch does when a dtype= argument is given (the
// input is cast to it before reducing), then to the accumulation dtype.
Value InputIn(LoweringContext& ctx, at::ScalarType acc) {
  Value x = ctx.tensor("self");
  if (auto dt = ctx.opt_dtype("dtype")) x = Cast(ctx.b, x, *dt);
  return Cast(ctx.b, x, acc);
}

// ---------------------------------------------------------------------------

std::vector<Value> LowerSum(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = InputIn(ctx, AccType(out.dtype));
  auto dims = DimsOf(ctx, x);
  Value r = ReduceSum(ctx.b, x, dims, false);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

// nansum: NaNs count as zero.
std::vector<Value> LowerNansum(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = InputIn(ctx, AccType(out.dtype));
  if (hlo::IsFloating(x.element())) {
    Value is_nan = ctx.b.Compare(x, x, CompareDirection::kNE);
    x = ctx.b.Select(is_nan, ConstLike(ctx.b, x, 0), x);
  }
  Value r = ReduceSum(ctx.b, x, DimsOf(ctx, x), false);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

std::vector<Value> LowerCountNonzero(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  Value nz = Cast(ctx.b, Cast(ctx.b, x, at::kBool), at::kLong);
  Value r = ReduceSum(ctx.b, nz, DimsOf(ctx, nz), false);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

std::vector<Value> LowerProd(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = InputIn(ctx, AccType(out.dtype));
  auto dims = DimsOf(ctx, x);
  Value r = ReduceProd(ctx.b, x, dims, false);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

std::vector<Value> LowerMean(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  if (!IsFloat(out.dtype) && !at::isComplexType(out.dtype))
    throw LoweringError(ctx.op_name() + ": mean of a non-floating dtype");
  Value x = InputIn(ctx, AccType(out.dtype));
  auto dims = DimsOf(ctx, x);
  Value s = ReduceSum(ctx.b, x, dims, false);
  Value n = ConstLike(ctx.b, s, static_cast<double>(CountOf(x, dims)));
  return {Fit(ctx.b, Cast(ctx.b, ctx.b.Div(s, n), out.dtype), out.sizes)};
}

// amax/amin and the full max()/min(); max.other/min.other (elementwise) too.
Value ExtremeReduce(Builder& b, const Value& x, std::span<const int64_t> dims, bool is_max) {
  if (x.element() == ElementType::kPred)
    return is_max ? ReduceOr(b, x, dims, false) : ReduceAnd(b, x, dims, false);
  return is_max ? ReduceMax(b, x, dims, false) : ReduceMin(b, x, dims, false);
}

// (values, indices) reduction along one dim: NaN wins, ties go to the lower
// index. Returns {values, indices(s64)} with the dim removed.
std::pair<Value, Value> ArgReduce(Builder& b, Value x, int64_t dim, bool is_max) {
  if (x.element() == ElementType::kPred) x = b.Convert(x, ElementType::kU8);
  const bool floating = hlo::IsFloating(x.element());
  TensorType it{ElementType::kS64, x.dims()};
  Value idx = b.Iota(it, dim);
  Value init_v;
  if (floating) {
    init_v = Const(b, x.element(), is_max ? -INFINITY : INFINITY);
  } else if (x.element() == ElementType::kS64) {
    init_v = b.ConstantInt(TensorType{x.element(), {}},
                           is_max ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max());
  } else {
    double lo = 0, hi = 0;
    switch (x.element()) {
      case ElementType::kS8: lo = -128; hi = 127; break;
      case ElementType::kS16: lo = -32768; hi = 32767; break;
      case ElementType::kS32: lo = -2147483648.0; hi = 2147483647.0; break;
      case ElementType::kU8: lo = 0; hi = 255; break;
      case ElementType::kU16: lo = 0; hi = 65535; break;
      case ElementType::kU32: lo = 0; hi = 4294967295.0; break;
      default: throw LoweringError("max/min/argmax: unsupported element type");
    }
    init_v = Const(b, x.element(), is_max ? lo : hi);
  }
  Value init_i = b.ConstantInt(TensorType{ElementType::kS64, {}}, std::numeric_limits<int64_t>::max());
  Value inputs[] = {x, idx};
  Value inits[] = {init_v, init_i};
  int64_t dims[] = {dim};
  auto r = b.Reduce(inputs, inits, dims, [&](Builder& bb, std::span<const Value> a) {
    const Value &av = a[0], &ai = a[1], &xv = a[2], &xi = a[3];
    Value better = bb.Compare(av, xv, is_max ? CompareDirection::kGT : CompareDirection::kLT);
    Value equal = bb.Compare(av, xv, CompareDirection::kEQ);
    Value lower = bb.Compare(ai, xi, CompareDirection::kLT);
    Value pick_a = bb.Or(better, bb.And(equal, lower));
    if (floating) {
      Value a_nan = bb.Compare(av, av, CompareDirection::kNE);
      Value x_nan = bb.Compare(xv, xv, CompareDirection::kNE);
      // both NaN: lower index; a NaN only: a; x NaN only: x; else pick_a.
      Value both = bb.And(a_nan, x_nan);
      Value neither_pick = bb.Or(a_nan, bb.And(bb.Not(x_nan), pick_a));
      pick_a = bb.Select(both, lower, neither_pick);
    }
    return std::vector<Value>{bb.Select(pick_a, av, xv), bb.Select(pick_a, ai, xi)};
  });
  return {r[0], r[1]};
}

std::vector<Value> LowerMaxMin(LoweringContext& ctx, bool is_max) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (ctx.find("other")) {  // max.other / min.other: elementwise, NaN-propagating
    at::ScalarType t = out.dtype;
    Value x = Prepare(b, ctx.tensor("self"), t, out.sizes);
    Value y = Prepare(b, ctx.tensor("other"), t, out.sizes);
    if (t == at::kBool) return {is_max ? b.Or(x, y) : b.And(x, y)};
    return {is_max ? MaxPropagateNaN(b, x, y) : MinPropagateNaN(b, x, y)};
  }
  Value x = ctx.tensor("self");
  const char* what = is_max ? "max()" : "min()";
  if (ctx.find("dim") && ctx.outputs.size() == 2) {  // max.dim: (values, indices)
    int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
    // CPU's checks (no identity over an empty dim), same messages and types.
    TORCH_CHECK_INDEX(x.rank() == 0 || x.dims()[static_cast<size_t>(dim)] != 0, what,
                      ": Expected reduction dim ", dim, " to have non-zero size.");
    if (x.rank() == 0) return {x, Const(b, ElementType::kS64, 0)};
    auto [v, i] = ArgReduce(b, x, dim, is_max);
    return {Fit(b, Cast(b, v, out.dtype), out.sizes), Fit(b, i, ctx.outputs[1].sizes)};
  }
  TORCH_CHECK(x.type.numel() > 0 || ctx.find("dim"), what,
              ": Expected reduction dim to be specified for input.numel() == 0. Specify the reduction dim with the "
              "'dim' argument.");
  auto dims = DimsOf(ctx, x);
  Value r = ExtremeReduce(b, x, dims, is_max);
  return {Fit(b, Cast(b, r, out.dtype), out.sizes)};
}
std::vector<Value> LowerMax(LoweringContext& ctx) { return LowerMaxMin(ctx, true); }
std::vector<Value> LowerMin(LoweringContext& ctx) { return LowerMaxMin(ctx, false); }

std::vector<Value> LowerAmax(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  const auto& out = ctx.outputs[0];
  return {Fit(ctx.b, Cast(ctx.b, ExtremeReduce(ctx.b, x, DimsOf(ctx, x), true), out.dtype), out.sizes)};
}
std::vector<Value> LowerAmin(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  const auto& out = ctx.outputs[0];
  return {Fit(ctx.b, Cast(ctx.b, ExtremeReduce(ctx.b, x, DimsOf(ctx, x), false), out.dtype), out.sizes)};
}

// aminmax(self, dim=None, keepdim=False) -> (min, max): NaN-propagating
// extremes over `dim` (all dims when None; keepdim shapes come from meta).
std::vector<Value> LowerAminmax(LoweringContext& ctx) {
  Value x = ctx.tensor("self");
  auto dims = DimsOf(ctx, x);
  const auto& lo = ctx.outputs[0];
  const auto& hi = ctx.outputs[1];
  return {Fit(ctx.b, Cast(ctx.b, ExtremeReduce(ctx.b, x, dims, false), lo.dtype), lo.sizes),
          Fit(ctx.b, Cast(ctx.b, ExtremeReduce(ctx.b, x, dims, true), hi.dtype), hi.sizes)};
}

std::vector<Value> LowerArg(LoweringContext& ctx, bool is_max) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  const auto& out = ctx.outputs[0];
  auto dim = ctx.opt_int("dim");
  if (x.rank() == 0) return {Const(b, ElementType::kS64, 0, out.sizes)};
  int64_t d;
  if (dim) {
    d = NormalizeDim(*dim, x.rank());
  } else {
    int64_t n[] = {x.type.numel()};
    x = b.Reshape(x, n);
    d = 0;
  }
  Value i = ArgReduce(b, x, d, is_max).second;
  return {Fit(b, Cast(b, i, out.dtype), out.sizes)};
}
std::vector<Value> LowerArgmax(LoweringContext& ctx) { return LowerArg(ctx, true); }
std::vector<Value> LowerArgmin(LoweringContext& ctx) { return LowerArg(ctx, false); }

std::vector<Value> LowerAnyAll(LoweringContext& ctx, bool is_any) {
  Value x = Cast(ctx.b, ctx.tensor("self"), at::kBool);
  const auto& out = ctx.outputs[0];
  auto dims = DimsOf(ctx, x);
  Value r = is_any ? ReduceOr(ctx.b, x, dims, false) : ReduceAnd(ctx.b, x, dims, false);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}
std::vector<Value> LowerAny(LoweringContext& ctx) { return LowerAnyAll(ctx, true); }
std::vector<Value> LowerAll(LoweringContext& ctx) { return LowerAnyAll(ctx, false); }

// var/std/var_mean/std_mean: two-pass (mean, then squared deviations) in the
// accumulation dtype; divisor max(N - correction, 0).
std::vector<Value> LowerVarStd(LoweringContext& ctx, bool take_sqrt) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!IsFloat(out.dtype)) throw LoweringError(ctx.op_name() + ": var/std of a non-floating dtype");
  at::ScalarType acc = AccType(out.dtype);
  Value x = Cast(b, ctx.tensor("self"), acc);
  auto dims = DimsOf(ctx, x);
  const double n = static_cast<double>(CountOf(x, dims));
  Value total = ReduceSum(b, x, dims, false);
  Value mean = b.Div(total, ConstLike(b, total, n));
  Value mean_b;
  {
    // broadcast the mean back over the reduced dims
    std::vector<int64_t> kept = KeepDimShape(x.dims(), dims);
    Value mk = b.Reshape(mean, kept);
    mean_b = BroadcastTo(b, mk, x.dims());
  }
  Value d = b.Sub(x, mean_b);
  Value m2 = ReduceSum(b, b.Mul(d, d), dims, false);
  Value denom;
  Value nconst = Const(b, ToElementType(acc), n, {});
  if (ctx.has("correction")) {
    Value c = Cast(b, ctx.value("correction"), acc);
    denom = b.Max(b.Sub(nconst, c), Const(b, ToElementType(acc), 0));
  } else {
    double c = 1;
    if (ctx.find("unbiased") && ctx.arg("unbiased").kind == LoweredArg::Kind::kStatic)
      c = ctx.bool_arg("unbiased") ? 1 : 0;
    denom = Const(b, ToElementType(acc), std::max(n - c, 0.0));
  }
  Value var = b.Div(m2, BroadcastTo(b, denom, m2.dims()));
  if (take_sqrt) var = b.Sqrt(var);
  std::vector<Value> res{Fit(b, Cast(b, var, out.dtype), out.sizes)};
  if (ctx.outputs.size() == 2)
    res.push_back(Fit(b, Cast(b, mean, ctx.outputs[1].dtype), ctx.outputs[1].sizes));
  return res;
}
std::vector<Value> LowerVar(LoweringContext& ctx) { return LowerVarStd(ctx, false); }
std::vector<Value> LowerStd(LoweringContext& ctx) { return LowerVarStd(ctx, true); }

// Inclusive scan along `dim` (Hillis-Steele: log2(n) shifted combines).
Value Scan(Builder& b, Value x, int64_t dim, bool is_sum) {
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  const size_t r = static_cast<size_t>(x.rank());
  Value identity = Const(b, x.element(), is_sum ? 0 : 1);
  for (int64_t k = 1; k < n; k *= 2) {
    std::vector<int64_t> start(r, 0), limit = x.dims(), stride(r, 1);
    limit[static_cast<size_t>(dim)] = n - k;
    Value head = b.Slice(x, start, limit, stride);
    std::vector<int64_t> low(r, 0), high(r, 0), interior(r, 0);
    low[static_cast<size_t>(dim)] = k;
    Value shifted = b.Pad(head, identity, low, high, interior);
    x = is_sum ? b.Add(x, shifted) : b.Mul(x, shifted);
  }
  return x;
}

std::vector<Value> LowerCum(LoweringContext& ctx, bool is_sum) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = InputIn(ctx, AccType(out.dtype));
  if (x.rank() == 0) return {Cast(b, x, out.dtype)};
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  if (x.element() == ElementType::kPred) x = b.Convert(x, ElementType::kS64);
  return {Fit(b, Cast(b, Scan(b, x, dim, is_sum), out.dtype), out.sizes)};
}
// _logcumsumexp(self, dim): inclusive scan along dim (the Hillis-Steele
// shifts of Scan, padding with -inf, the identity) of CPU's
// _log_add_exp_helper: with lo = min(a, b), hi = max(a, b) (NaN if either
// is), hi + log1p(exp(lo - hi)), except a when lo == hi is infinite (-inf
// with -inf, inf with inf). Floating dtypes only (CPU raises for others);
// computed in CPU's accumulator type (f64 for float, f32 for bf16/f16) and
// rounded once: the backward's exp(b + x) cancels large b and x, so a
// 1-ulp difference in a forward value of magnitude 1e4 would show.
Value LogAddExpCombine(Builder& b, const Value& a, const Value& c) {
  Value lo = MinPropagateNaN(b, a, c), hi = MaxPropagateNaN(b, a, c);
  Value r = b.Add(hi, b.Unary("stablehlo.log_plus_one", b.Exp(b.Sub(lo, hi))));
  Value same_inf = b.And(b.Compare(lo, hi, hlo::CompareDirection::kEQ), b.Not(b.IsFinite(lo)));
  return b.Select(same_inf, a, r);
}

std::vector<Value> LowerLogcumsumexp(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!at::isFloatingType(out.dtype))
    throw LoweringError(ctx.op_name() + ": not implemented for '" + std::string(c10::toString(out.dtype)) + "'");
  // CPU's accumulator: at::acc_type<scalar_t, /*is_cuda=*/false> (double
  // for float, float for bf16/f16), each output rounded once.
  const at::ScalarType acc = out.dtype == at::kFloat ? at::kDouble : OpMathType(out.dtype);
  Value x = Cast(b, ctx.tensor("self"), acc);
  if (x.rank() == 0) return {Out(b, x, out)};
  const int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  const size_t r = static_cast<size_t>(x.rank());
  Value identity = Const(b, x.element(), -std::numeric_limits<double>::infinity());
  for (int64_t k = 1; k < n; k *= 2) {
    std::vector<int64_t> start(r, 0), limit = x.dims(), stride(r, 1);
    limit[static_cast<size_t>(dim)] = n - k;
    Value head = b.Slice(x, start, limit, stride);
    std::vector<int64_t> low(r, 0), high(r, 0), interior(r, 0);
    low[static_cast<size_t>(dim)] = k;
    x = LogAddExpCombine(b, x, b.Pad(head, identity, low, high, interior));
  }
  return {Out(b, x, out)};
}

std::vector<Value> LowerCumsum(LoweringContext& ctx) { return LowerCum(ctx, true); }
std::vector<Value> LowerCumprod(LoweringContext& ctx) { return LowerCum(ctx, false); }

std::vector<Value> LowerLogsumexp(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value x = Cast(b, ctx.tensor("self"), acc);
  auto dims = DimsOf(ctx, x);
  Value m = ReduceMax(b, x, dims, true);
  // |max| == inf -> 0 (PyTorch), so all -inf gives -inf and +inf gives +inf/nan as CPU.
  Value inf = ConstLike(b, m, INFINITY);
  Value is_inf = b.Compare(b.Abs(m), inf, CompareDirection::kEQ);
  m = b.Select(is_inf, ConstLike(b, m, 0), m);
  Value e = b.Exp(b.Sub(x, BroadcastTo(b, m, x.dims())));
  Value s = b.Log(ReduceSum(b, e, dims, false));
  Value r = b.Add(s, b.Reshape(m, s.dims()));
  return {Fit(b, Cast(b, r, out.dtype), out.sizes)};
}

// linalg_vector_norm(self, ord, dim, keepdim, dtype) and norm(self, p, dim,
// keepdim, dtype): the order is compiled in (static_scalars).
std::vector<Value> LowerNorm(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!IsFloat(out.dtype)) throw LoweringError(ctx.op_name() + ": norm of a non-floating dtype");
  double p = 2;
  const char* pname = ctx.find("ord") ? "ord" : "p";
  if (ctx.has(pname)) p = ctx.float_arg(pname);
  at::ScalarType acc = AccType(out.dtype);
  Value x = ctx.tensor("self");
  if (auto dt = ctx.opt_dtype("dtype")) x = Cast(b, x, *dt);
  x = Cast(b, x, acc);
  auto dims = DimsOf(ctx, x);
  Value a = b.Abs(x);
  Value r;
  if (p == 0) {
    Value nz = b.Compare(x, ConstLike(b, x, 0), CompareDirection::kNE);
    r = ReduceSum(b, Cast(b, nz, acc), dims, false);
  } else if (std::isinf(p)) {
    r = p > 0 ? ReduceMax(b, a, dims, false) : ReduceMin(b, a, dims, false);
  } else if (p == 1) {
    r = ReduceSum(b, a, dims, false);
  } else if (p == 2) {
    r = b.Sqrt(ReduceSum(b, b.Mul(x, x), dims, false));
  } else {
    Value s = ReduceSum(b, b.Pow(a, ConstLike(b, a, p)), dims, false);
    r = b.Pow(s, ConstLike(b, s, 1.0 / p));
  }
  return {Fit(b, Cast(b, r, out.dtype), out.sizes)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"sum", LowerSum, {.complex = true}},
    {"nansum", LowerNansum},
    {"count_nonzero", LowerCountNonzero},
    {"mean", LowerMean, {.complex = true}},
    {"prod", LowerProd, {.complex = true}},
    {"amax", LowerAmax},
    {"amin", LowerAmin},
    {"aminmax", LowerAminmax},
    {"max", LowerMax},
    {"min", LowerMin},
    {"argmax", LowerArgmax},
    {"argmin", LowerArgmin},
    {"any", LowerAny},
    {"all", LowerAll},
    {"var", LowerVar},
    {"std", LowerStd},
    {"var_mean", LowerVar},
    {"std_mean", LowerStd},
    {"cumsum", LowerCumsum},
    {"cumprod", LowerCumprod},
    {"_logcumsumexp", LowerLogcumsumexp},
    {"logsumexp", LowerLogsumexp},
    {"linalg_vector_norm", LowerNorm, {.static_scalars = true}},
    {"norm", LowerNorm, {.static_scalars = true}},
});

}  // namespace torch_tpu::lowering
