// Factory lowerings: linspace and logspace (every overload: Scalar or 0-d
// Tensor start/end, out=).
//
// Output: 1-d of `steps` elements, dtype from the meta kernel (the default
// float dtype unless dtype= or out= says otherwise). Values follow PyTorch's
// CPU kernels exactly (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp for
// linspace, aten/src/ATen/native/RangeFactories.cpp for logspace):
//
//   linspace, T = output dtype, s = T(start), e = T(end):
//     step = (e - s) / (steps - 1)           in T (in double for integer T)
//     i <  steps/2:  s + step * i
//     i >= steps/2:  e - step * (steps - 1 - i)
//   computed in T's own arithmetic: bfloat16/half round to T after every
//   operation (c10::BFloat16 operators), float/double round `s + step * i`
//   once (the CPU kernel is built with FMA contraction), integer T compute
//   in double (also fused) and truncate toward zero; steps == 1 gives
//   T(start). (logspace's kernel is built without FMA: mul, then add.)
//
//   logspace: step = double(e - s) / (steps - 1) (e - s in T), exponents
//   as above in double, base^exponent in double, converted to T; steps == 1
//   gives T(base^double(start)).
//
// Scalar start/end are compiled in (static_scalars: the exact double or
// int64 value, as CPU reads them); 0-d tensor start/end (the .Tensor_*
// overloads) are runtime values read like Tensor.item(). Complex and bool
// outputs raise LoweringError (the CPU path then raises as CPU does, or
// computes complex).
#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using at::ScalarType;
using hlo::CompareDirection;
using Kind = LoweredArg::Kind;

bool IsLowPrecision(ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// start/end as a 0-d value: a static Scalar becomes an exact constant (s64 for
// integers and bools, f64 for floating values); a tensor or runtime Scalar
// keeps its element type.
Value Endpoint(LoweringContext& ctx, std::string_view name) {
  Builder& b = ctx.b;
  const LoweredArg& a = ctx.arg(name);
  if (a.kind == Kind::kTensor || a.kind == Kind::kScalar) {
    if (a.value.rank() != 0)
      throw LoweringError(ctx.op_name() + ": only 0-dimensional start and end tensors are supported, but " +
                          std::string(name) + " has " + std::to_string(a.value.rank()) + " dimension(s)");
    if (hlo::IsComplex(a.value.element())) throw LoweringError(ctx.op_name() + ": complex start/end");
    return a.value;
  }
  if (a.kind != Kind::kStatic) throw LoweringError(ctx.op_name() + ": missing " + std::string(name));
  c10::Scalar s = a.ivalue.toScalar();
  if (s.isComplex()) throw LoweringError(ctx.op_name() + ": complex start/end");
  if (s.isIntegral(/*includeBool=*/true))
    return b.ConstantInt(TensorType{ElementType::kS64, {}}, s.toLong());
  return b.ScalarConstant(ElementType::kF64, s.toDouble());
}

// Scalar::to<T>(): integers truncate toward zero; bfloat16/half from double
// go through float (c10's constructors take a float).
Value ToT(Builder& b, const Value& v, ScalarType t) {
  Value x = v;
  if (IsLowPrecision(t) && x.element() == ElementType::kF64) x = b.Convert(x, ElementType::kF32);
  if (at::isIntegralType(t, false) && x.element() == ElementType::kPred) x = b.Convert(x, ElementType::kS64);
  return Cast(b, x, t);
}

// A double value stored into a T element (bfloat16/half through float).
Value StoreDouble(Builder& b, const Value& v, ScalarType t) {
  Value x = v;
  if (IsLowPrecision(t)) x = b.Convert(x, ElementType::kF32);
  return Cast(b, x, t);
}

// Rounds an f32 value to T and back (one c10::BFloat16/Half operation).
// Half uses reduce_precision (5 exponent, 10 mantissa bits): XLA's CPU
// compiler drops an f32 -> f16 -> f32 convert pair (excess precision), which
// would skip the rounding; bfloat16's convert pair is kept and also rounds
// subnormals as c10 does.
Value Round(Builder& b, const Value& v, ScalarType t) {
  if (t == at::kHalf) {
    std::vector<TensorType> types{v.type};
    return b.Op("stablehlo.reduce_precision", std::span(&v, 1), types,
                "exponent_bits = 5 : i32, mantissa_bits = 10 : i32")[0];
  }
  return b.Convert(b.Convert(v, ToElementType(t)), ElementType::kF32);
}

void CheckDtype(const LoweringContext& ctx, ScalarType t) {
  if (at::isComplexType(t)) throw LoweringError(ctx.op_name() + ": complex outputs are not supported on tpu");
  if (t == at::kBool) throw LoweringError(ctx.op_name() + ": bool outputs are not supported (as on CPU)");
}

const OutputSpec& OneDimOutput(const LoweringContext& ctx) {
  const OutputSpec& out = ctx.outputs.at(0);
  if (out.sizes.size() != 1) throw LoweringError(ctx.op_name() + ": unexpected output rank");
  return out;
}

// The divisor `steps - 1` as a value XLA cannot fold into the division:
// XLA's CPU compiler turns a division by a constant into a multiplication by
// its reciprocal, which is not correctly rounded (linspace(50, 1, 50) would
// give 24.999.. -> 24 for int64). `probe` is a runtime value of the call (a
// tensor start/end); min(isnan(probe), 0) is always 0 but opaque. With static
// start/end the whole computation is constant-folded exactly.
Value Divisor(Builder& b, ElementType e, int64_t n, const std::optional<Value>& probe) {
  Value d = b.ScalarConstant(e, static_cast<double>(n - 1));
  if (!probe) return d;
  Value p = CastElement(b, *probe, ElementType::kF64);
  Value zero = b.Min(b.Convert(b.Compare(p, p, CompareDirection::kNE), e), b.ScalarConstant(e, 0));
  return b.Add(d, zero);
}

// A runtime start/end value of the call, if any (see Divisor).
std::optional<Value> RuntimeProbe(const LoweringContext& ctx) {
  for (std::string_view name : {"start", "end"}) {
    const LoweredArg& a = ctx.arg(name);
    if (a.kind == Kind::kTensor || a.kind == Kind::kScalar) return a.value;
  }
  return std::nullopt;
}

// a * b + c with one rounding, in double: Dekker's exact product (Veltkamp
// splitting with 2^27 + 1) and Knuth's TwoSum give p + c and the two error
// terms, added back last (T. J. Dekker, "A floating-point technique for
// extending the available precision", 1971; Knuth, TAOCP vol. 2, 4.2.2).
// Equal to the fused result except in rare double-rounding ties and for
// |a|, |b| above ~1e300 (the split overflows).
Value FusedMulAdd(Builder& b, const Value& a, const Value& x, const Value& c) {
  auto split = [&](const Value& v) {
    Value t = b.Mul(v, ConstLike(b, v, 134217729.0));
    Value hi = b.Sub(t, b.Sub(t, v));
    return std::pair<Value, Value>{hi, b.Sub(v, hi)};
  };
  Value p = b.Mul(a, x);
  auto [ah, al] = split(a);
  auto [xh, xl] = split(x);
  Value err = b.Add(b.Add(b.Add(b.Sub(b.Mul(ah, xh), p), b.Mul(ah, xl)), b.Mul(al, xh)), b.Mul(al, xl));
  Value sum = b.Add(p, c);
  Value bv = b.Sub(sum, p);
  Value e2 = b.Add(b.Sub(p, b.Sub(sum, bv)), b.Sub(c, bv));
  Value r = b.Add(sum, b.Add(err, e2));
  // non-finite operands: the plain expression (the error terms are NaN).
  return b.Select(b.IsFinite(r), r, sum);
}

// Element index i (as `e`) and the predicate i < steps/2.
std::pair<Value, Value> IndexAndFirstHalf(Builder& b, int64_t n, ElementType e) {
  Value i = b.Iota(TensorType{ElementType::kS64, {n}}, 0);
  Value half = b.ConstantInt(TensorType{ElementType::kS64, {}}, n / 2);
  Value first = b.Compare(i, BroadcastTo(b, half, std::vector<int64_t>{n}), CompareDirection::kLT);
  return {b.Convert(i, e), first};
}

std::vector<Value> LowerLinspace(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const OutputSpec& out = OneDimOutput(ctx);
  const ScalarType t = out.dtype;
  CheckDtype(ctx, t);
  const int64_t n = out.sizes[0];
  if (n == 0) return {Const(b, ToElementType(t), 0, out.sizes)};
  Value start = ToT(b, Endpoint(ctx, "start"), t);
  if (n == 1) return {b.Reshape(start, out.sizes)};
  Value end = ToT(b, Endpoint(ctx, "end"), t);
  const std::vector<int64_t> dims{n};
  auto splat = [&](const Value& v) { return BroadcastTo(b, v, dims); };
  if (at::isIntegralType(t, false)) {
    // step_t = double; start/end are T values read as double.
    ElementType f = ElementType::kF64;
    Value s = b.Convert(start, f), e = b.Convert(end, f);
    Value step = b.Div(b.Sub(e, s), Divisor(b, f, n, RuntimeProbe(ctx)));
    auto [i, first] = IndexAndFirstHalf(b, n, f);
    Value lo = FusedMulAdd(b, splat(step), i, splat(s));
    Value hi = FusedMulAdd(b, b.Neg(splat(step)), b.Sub(Const(b, f, static_cast<double>(n - 1), dims), i), splat(e));
    return {Cast(b, b.Select(first, lo, hi), t)};
  }
  if (IsLowPrecision(t)) {
    // c10::BFloat16/Half arithmetic: compute in float, round after each op;
    // int64 operands are converted to T first.
    ElementType f = ElementType::kF32;
    Value s = b.Convert(start, f), e = b.Convert(end, f);
    Value nm1 = Round(b, Divisor(b, f, n, RuntimeProbe(ctx)), t);
    Value step = Round(b, b.Div(Round(b, b.Sub(e, s), t), nm1), t);
    auto [i, first] = IndexAndFirstHalf(b, n, f);
    Value ri = Round(b, i, t);
    Value lo = Round(b, b.Add(splat(s), Round(b, b.Mul(splat(step), ri), t)), t);
    Value back = Round(b, b.Sub(Const(b, f, static_cast<double>(n - 1), dims), i), t);
    Value hi = Round(b, b.Sub(splat(e), Round(b, b.Mul(splat(step), back), t)), t);
    return {Cast(b, b.Select(first, lo, hi), t)};
  }
  // float / double: step in T arithmetic. PyTorch's CPU build contracts
  // `start + step * i` into one fused multiply-add (one rounding); for float
  // the product is exact in double, so the double sum rounded to float gives
  // the same value; double emulates the fused multiply-add (FusedMulAdd).
  ElementType f = ToElementType(t);
  Value step = b.Div(b.Sub(end, start), Divisor(b, f, n, RuntimeProbe(ctx)));
  ElementType w = t == at::kFloat ? ElementType::kF64 : f;
  Value s = b.Convert(start, w), e = b.Convert(end, w), st = b.Convert(step, w);
  auto [i, first] = IndexAndFirstHalf(b, n, w);
  Value back = b.Sub(Const(b, w, static_cast<double>(n - 1), dims), i);
  Value lo, hi;
  if (t == at::kDouble) {
    lo = FusedMulAdd(b, splat(st), i, splat(s));
    hi = FusedMulAdd(b, b.Neg(splat(st)), back, splat(e));
  } else {
    lo = b.Add(splat(s), b.Mul(splat(st), i));
    hi = b.Sub(splat(e), b.Mul(splat(st), back));
  }
  return {Cast(b, b.Select(first, lo, hi), t)};
}

std::vector<Value> LowerLogspace(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const OutputSpec& out = OneDimOutput(ctx);
  const ScalarType t = out.dtype;
  CheckDtype(ctx, t);
  const int64_t n = out.sizes[0];
  if (n == 0) return {Const(b, ToElementType(t), 0, out.sizes)};
  const ElementType f = ElementType::kF64;
  const double base = ctx.has("base") ? ctx.float_arg("base") : 10.0;
  const std::vector<int64_t> dims{n};
  Value start_raw = Endpoint(ctx, "start");
  if (n == 1) {
    // pow(base, start.to<double>()), start not rounded to T first.
    Value p = b.Pow(b.ScalarConstant(f, base), CastElement(b, start_raw, f));
    return {b.Reshape(StoreDouble(b, p, t), out.sizes)};
  }
  Value start = ToT(b, start_raw, t);
  Value end = ToT(b, Endpoint(ctx, "end"), t);
  // scalar_end - scalar_start in T: integers in int64 (narrow integer types
  // promote to int in C++), bfloat16/half rounded once to T.
  Value diff;
  if (at::isIntegralType(t, false)) {
    diff = b.Sub(Cast(b, end, at::kLong), Cast(b, start, at::kLong));
  } else if (IsLowPrecision(t)) {
    diff = Round(b, b.Sub(b.Convert(end, ElementType::kF32), b.Convert(start, ElementType::kF32)), t);
  } else {
    diff = b.Sub(end, start);
  }
  Value step = b.Div(b.Convert(diff, f), Divisor(b, f, n, RuntimeProbe(ctx)));
  auto splat = [&](const Value& v) { return BroadcastTo(b, v, dims); };
  Value s = b.Convert(start, f), e = b.Convert(end, f);
  auto [i, first] = IndexAndFirstHalf(b, n, f);
  Value lo = b.Add(splat(s), b.Mul(splat(step), i));
  Value hi = b.Sub(splat(e), b.Mul(splat(step), b.Sub(Const(b, f, static_cast<double>(n - 1), dims), i)));
  Value p = b.Pow(Const(b, f, base, dims), b.Select(first, lo, hi));
  return {StoreDouble(b, p, t)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"linspace", LowerLinspace, {.static_scalars = true, .out_resized_by_numel = true}},
    {"logspace", LowerLogspace, {.static_scalars = true, .out_resized_by_numel = true}},
});

}  // namespace torch_tpu::lowering
