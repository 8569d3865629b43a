// Pointwise lowerings: arithmetic, division and remainder with PyTorch's
// rounding, powers, unary math, rounding, clamps, where/masked_fill,
// comparisons, logical and bitwise ops, and the activations with the backward
// ops autograd calls.
//
// Type promotion follows TensorIterator: the inputs that take part in
// promotion give a common dtype (dimensioned tensors over 0-d tensors over
// Python numbers, by category); tensors are converted to it, arithmetic runs
// in its opmath type (f32 for bf16/f16) and the result is rounded to the
// common dtype once. Python numbers and CPU 0-d tensors are read directly in
// the opmath type by the arithmetic ops, as PyTorch's CPU kernels read them.
// The executor converts the returned value to the output's dtype (out=,
// in-place targets) and broadcasts it to the output's sizes.
#include <c10/core/DefaultDtype.h>

#include <array>
#include <cmath>
#include <limits>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using at::ScalarType;
using hlo::CompareDirection;
using Kind = LoweredArg::Kind;

constexpr CompareDirection kEQ = CompareDirection::kEQ;
constexpr CompareDirection kNE = CompareDirection::kNE;
constexpr CompareDirection kLT = CompareDirection::kLT;
constexpr CompareDirection kLE = CompareDirection::kLE;
constexpr CompareDirection kGT = CompareDirection::kGT;
constexpr CompareDirection kGE = CompareDirection::kGE;

bool IsFloat(ScalarType t) { return at::isFloatingType(t); }
bool IsComplex(ScalarType t) { return at::isComplexType(t); }
bool IsUnsigned(ScalarType t) {
  return t == at::kByte || t == at::kUInt16 || t == at::kUInt32 || t == at::kUInt64;
}

// Type promotion: ResultType (helpers.h).

// Entries that also compute complex values (StableHLO's arithmetic,
// exponential, log, sqrt, trig, power, select and EQ/NE compare take
// complex operands; abs/sgn/isnan/isinf have complex branches below).
const LoweringTraits kComplex{.complex = true};

// ---------------------------------------------------------------------------
// Operand preparation.

enum class Promote {
  kKeep,        // compute in the common dtype (its opmath type for floats)
  kIntToFloat,  // integer/bool inputs compute in the default float dtype
};

// How an in-place or out= call's result reaches the tensor it writes.
enum class OutputCast {
  kSafe,  // CPU's TensorIterator checks c10::canCast(common, output) (enforce_safe_casting_to_output)
  kAny,   // comparisons: a bool result, cast to any output (build_borrowing_comparison_op: no check)
};

// Operands of one pointwise op: the common dtype, the compute dtype and the
// output's sizes every operand is broadcast to.
struct Pw {
  LoweringContext& ctx;
  Builder& b;
  ScalarType common;
  ScalarType compute;
  std::vector<int64_t> sizes;

  ElementType el() const { return ToElementType(compute); }

  // Argument `name` converted to the common dtype, then to the compute dtype,
  // broadcast to the output's sizes.
  Value In(std::string_view name) const {
    const LoweredArg& a = ctx.arg(name);
    return BroadcastTo(b, Cast(b, Cast(b, a.value, common), compute), sizes);
  }
  // As In, but Python numbers and CPU 0-d tensors go straight to the compute
  // dtype (no rounding to a bf16/f16 common dtype on the way).
  Value InExact(std::string_view name) const {
    const LoweredArg& a = ctx.arg(name);
    if (a.kind == Kind::kScalar) return BroadcastTo(b, Cast(b, a.value, compute), sizes);
    return In(name);
  }
  // A non-promoting Scalar argument (alpha, value, negative_slope...) in the
  // compute dtype.
  Value Scalar(std::string_view name) const {
    return BroadcastTo(b, Cast(b, ctx.value(name), compute), sizes);
  }
  Value C(double v) const { return Const(b, el(), v, sizes); }
  Value Done(const Value& v) const { return Cast(b, v, common); }
};

Pw MakePw(LoweringContext& ctx, std::initializer_list<std::string_view> names,
          Promote promote = Promote::kKeep, OutputCast cast = OutputCast::kSafe) {
  ScalarType common = ResultType(ctx, names);
  if (promote == Promote::kIntToFloat && !IsFloat(common) && !IsComplex(common)) common = c10::get_default_dtype_as_scalartype();
  // An in-place or out= call writes the result into an existing tensor:
  // CPU's TensorIterator (enforce_safe_casting_to_output) raises "result
  // type Float can't be cast to the desired output type Long" when the
  // common dtype cannot be cast to it (c10::canCast: floating -> integral,
  // complex -> real, anything -> bool), but the meta kernels that gave the
  // output specs do not check it (int.mul_(2.5) compiled to [2, 5]). Such a
  // call declines here and runs CPU's kernel: CPU's error, or CPU's value
  // where its kernel allows the cast.
  if (cast == OutputCast::kSafe && ctx.schema.is_mutable() && !ctx.outputs.empty() &&
      !c10::canCast(common, ctx.outputs[0].dtype))
    throw LoweringError(std::string("result type ") + c10::toString(common) + " can't be cast to the output type " +
                        c10::toString(ctx.outputs[0].dtype) + " (CPU's kernel decides)");
  return Pw{ctx, ctx.b, common, OpMathType(common), ctx.outputs.at(0).sizes};
}

// A Pw with an explicit common dtype (ops whose result keeps self's dtype).
Pw MakePwAs(LoweringContext& ctx, ScalarType common) {
  return Pw{ctx, ctx.b, common, OpMathType(common), ctx.outputs.at(0).sizes};
}

Value Cmp(Builder& b, const Value& x, const Value& y, CompareDirection d) { return b.Compare(x, y, d); }
// |z| of a complex z: stablehlo.abs with the part type as result.
Value ComplexAbs(Builder& b, const Value& z) {
  return b.Op("stablehlo.abs", std::span(&z, 1),
              std::vector<TensorType>{TensorType{hlo::ComplexPart(z.element()), z.dims()}})[0];
}
Value IsNan(Builder& b, const Value& x) { return b.Compare(x, x, kNE); }
Value Trunc(Builder& b, const Value& x) {
  return b.Select(Cmp(b, x, ConstLike(b, x, 0), kLT), b.Unary("stablehlo.ceil", x), b.Floor(x));
}

// Polynomial in u, coefficients lowest degree first (Horner).
template <size_t N>
Value Horner(Builder& b, const Value& u, const std::array<double, N>& c) {
  Value r = ConstLike(b, u, c[N - 1]);
  for (size_t i = N - 1; i-- > 0;) r = b.Add(b.Mul(r, u), ConstLike(b, u, c[i]));
  return r;
}

// erf(x) for floating x: CHLO's erf (`chlo.erf`, how JAX lowers lax.erf;
// XLA expands it to rational approximations: within 3 ulp of erf in f32, 1
// ulp in f64 — measured against PyTorch's CPU erf on 40k points from 1e-30
// to 10). Its f32 form clamps |x| to 4, where it is still 2 ulp short of
// +-1; erf rounds to exactly +-1 beyond 3.92 in f32 (erfc < 2^-25) and 6 in
// f64 (erfc < 2^-54), so the tails are set exactly (erf(+-inf) = +-1, which
// keeps gelu(-inf) = -inf * 0 = NaN as on the CPU). Replaces a polynomial
// lowering that was 1.7x slower (GELU on 1024x1536 f32: 1.32 -> 0.78 ms).
Value Erf(Builder& b, const Value& x) {
  const double tail = x.element() == hlo::ElementType::kF64 ? 6.0 : 3.92;
  Value one = ConstLike(b, x, 1);
  Value sign = b.Select(Cmp(b, x, ConstLike(b, x, 0), kLT), b.Neg(one), one);
  return b.Select(Cmp(b, b.Abs(x), ConstLike(b, x, tail), kGE), sign, b.Unary("chlo.erf", x));
}

// ---------------------------------------------------------------------------
// Arithmetic.

// bool arithmetic runs in uint8 and converts back with != 0.
ScalarType ArithCompute(ScalarType common) { return common == at::kBool ? at::kByte : OpMathType(common); }

std::vector<Value> AddSub(LoweringContext& ctx, bool subtract, bool reverse) {
  Pw p = MakePw(ctx, {"self", "other"});
  p.compute = ArithCompute(p.common);
  Value x = p.InExact("self"), y = p.InExact("other");
  if (reverse) std::swap(x, y);
  Value scaled = y;
  if (ctx.has("alpha")) {
    // CPU's add kernel converts alpha to the tensor dtype first
    // (Scalar::to<scalar_t>) and computes in float from there: a bf16/f16
    // alpha of 0.3 is 0.30078125 (bf16) in every element (issue 10).
    Value alpha = ctx.value("alpha");
    if (p.common == at::kBFloat16 || p.common == at::kHalf) alpha = Cast(p.b, alpha, p.common);
    scaled = p.b.Mul(BroadcastTo(p.b, Cast(p.b, alpha, p.compute), p.sizes), y);
  }
  return {p.Done(subtract ? p.b.Sub(x, scaled) : p.b.Add(x, scaled))};
}
std::vector<Value> LowerAdd(LoweringContext& ctx) { return AddSub(ctx, false, false); }
std::vector<Value> LowerSub(LoweringContext& ctx) { return AddSub(ctx, true, false); }
std::vector<Value> LowerRsub(LoweringContext& ctx) { return AddSub(ctx, true, true); }

std::vector<Value> LowerMul(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  p.compute = ArithCompute(p.common);
  return {p.Done(p.b.Mul(p.InExact("self"), p.InExact("other")))};
}

// Integer division rounding toward -inf (XLA's divide truncates).
Value FloorDivInt(Builder& b, const Value& x, const Value& y) {
  Value q = b.Div(x, y);
  Value r = b.Rem(x, y);
  Value zero = ConstLike(b, x, 0);
  Value adjust = b.And(Cmp(b, r, zero, kNE), b.Xor(Cmp(b, r, zero, kLT), Cmp(b, y, zero, kLT)));
  return b.Select(adjust, b.Sub(q, ConstLike(b, q, 1)), q);
}

// PyTorch's floating floor division (c10 div_floor_floating): fmod-based
// quotient, corrected toward -inf, rounded to the nearest integer, with x/0
// giving +-inf/nan and a zero quotient keeping the sign of x/y. `round`
// (bfloat16/half with a tensor divisor) rounds every intermediate to that
// type, as the CPU kernel's c10::BFloat16 arithmetic does; fmod is exact.
Value FloorDivFloat(Builder& b, const Value& x, const Value& y,
                    std::optional<ElementType> round = std::nullopt) {
  auto r = [&](const Value& v) { return round ? b.Convert(b.Convert(v, *round), v.element()) : v; };
  Value zero = ConstLike(b, x, 0), one = ConstLike(b, x, 1);
  Value true_div = r(b.Div(x, y));
  Value mod = b.Rem(x, y);
  Value div = r(b.Div(r(b.Sub(x, mod)), y));
  Value adjust = b.And(Cmp(b, mod, zero, kNE), b.Xor(Cmp(b, y, zero, kLT), Cmp(b, mod, zero, kLT)));
  div = b.Select(adjust, r(b.Sub(div, one)), div);
  Value fl = b.Floor(div);
  fl = b.Select(Cmp(b, r(b.Sub(div, fl)), ConstLike(b, x, 0.5), kGT), r(b.Add(fl, one)), fl);
  Value signed_zero = b.Mul(true_div, zero);
  Value res = b.Select(Cmp(b, div, zero, kNE), fl, signed_zero);
  return b.Select(Cmp(b, y, zero, kEQ), true_div, res);
}

// bfloat16/half division with rounding: PyTorch's CPU kernels compute in
// c10::BFloat16 arithmetic (each operation rounded to the dtype) unless the
// divisor is a single value broadcast over the output (a Scalar, a 0-d or
// one-element tensor: TensorIterator's is_scalar), which they read in float
// and divide in float. Returns the element type to round to, if any.
std::optional<ElementType> DivRounding(const LoweringContext& ctx, ScalarType common) {
  if (common != at::kBFloat16 && common != at::kHalf) return std::nullopt;
  const LoweredArg& other = ctx.arg("other");
  if (other.kind == Kind::kScalar || other.value.type.numel() == 1) return std::nullopt;
  return ToElementType(common);
}

// Integer division or remainder by zero: CPU's kernels raise RuntimeError
// "ZeroDivisionError" (aten/src/ATen/native/cpu/BinaryOpsKernel.cpp); here a
// value check (LoweringContext::check) raises it at the next sync point, at
// the op in debug mode. `y` is the divisor as computed (broadcast): an empty
// result divides nothing and raises nothing, as on CPU. Floating and complex
// division give inf/nan, unchecked.
void CheckIntegerDivisor(const Pw& p, const Value& y) {
  if (IsFloat(p.compute) || IsComplex(p.compute)) return;
  Value zero = Cmp(p.b, y, ConstLike(p.b, y, 0), kEQ);
  p.ctx.check(zero.rank() == 0 ? zero : ReduceOr(p.b, zero, ReductionDims({}, zero.rank()), false),
              "ZeroDivisionError");
}

Value FloorDiv(const Pw& p, const Value& x, const Value& y) {
  CheckIntegerDivisor(p, y);
  if (IsFloat(p.compute)) return FloorDivFloat(p.b, x, y, DivRounding(p.ctx, p.common));
  if (IsUnsigned(p.compute)) return p.b.Div(x, y);
  return FloorDivInt(p.b, x, y);
}

std::vector<Value> LowerDiv(LoweringContext& ctx) {
  std::string_view mode;
  if (ctx.has("rounding_mode")) mode = ctx.string_arg("rounding_mode");
  if (mode.empty()) {
    Pw p = MakePw(ctx, {"self", "other"}, Promote::kIntToFloat);
    return {p.Done(p.b.Div(p.InExact("self"), p.InExact("other")))};
  }
  Pw p = MakePw(ctx, {"self", "other"});
  if (p.common == at::kBool) throw LoweringError(ctx.op_name() + ": bool division");
  if (IsComplex(p.common)) throw LoweringError(ctx.op_name() + ": complex division with a rounding mode");
  Value x = p.InExact("self"), y = p.InExact("other");
  if (mode == "trunc") {
    CheckIntegerDivisor(p, y);
    Value q = p.b.Div(x, y);
    if (auto r = DivRounding(ctx, p.common)) q = p.b.Convert(p.b.Convert(q, *r), q.element());
    return {p.Done(IsFloat(p.compute) ? Trunc(p.b, q) : q)};
  }
  if (mode == "floor") return {p.Done(FloorDiv(p, x, y))};
  throw LoweringError(ctx.op_name() + ": unknown rounding_mode " + std::string(mode));
}

std::vector<Value> LowerFloorDivide(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  if (p.common == at::kBool) throw LoweringError(ctx.op_name() + ": bool division");
  return {p.Done(FloorDiv(p, p.InExact("self"), p.InExact("other")))};
}

// remainder: the result takes the divisor's sign (Python's %).
std::vector<Value> LowerRemainder(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  if (p.common == at::kBool) throw LoweringError(ctx.op_name() + ": bool remainder");
  Builder& b = p.b;
  Value x = p.In("self"), y = p.In("other");
  CheckIntegerDivisor(p, y);
  Value r = b.Rem(x, y);
  if (IsUnsigned(p.compute)) return {p.Done(r)};
  Value zero = p.C(0);
  Value adjust = b.And(Cmp(b, r, zero, kNE), b.Xor(Cmp(b, r, zero, kLT), Cmp(b, y, zero, kLT)));
  return {p.Done(b.Select(adjust, b.Add(r, y), r))};
}

// fmod: the result takes the dividend's sign (C fmod, XLA's remainder).
std::vector<Value> LowerFmod(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  if (p.common == at::kBool) throw LoweringError(ctx.op_name() + ": bool fmod");
  Value y = p.In("other");
  CheckIntegerDivisor(p, y);
  return {p.Done(p.b.Rem(p.In("self"), y))};
}

std::vector<Value> LowerPow(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "exponent"});
  Builder& b = p.b;
  if (p.common == at::kBool) throw LoweringError(ctx.op_name() + ": bool pow");
  const LoweredArg& base_arg = ctx.arg("self");
  const LoweredArg& exp_arg = ctx.arg("exponent");
  Value x = p.InExact("self"), e = p.InExact("exponent");
  Value r = b.Pow(x, e);
  if (!IsFloat(p.compute) && !IsComplex(p.compute)) {
    // CPU's integer pow squares over every bit of the exponent with the
    // dtype's wrapping multiply; stablehlo.power on the CPU plugin squares
    // six times only (an int32 3 ** 64 gave 1, 3 ** 300 a wrong value; issue
    // 10). So: exponentiation by squaring here, one step per exponent bit
    // (a negative exponent is replaced below).
    {
      const int bits = static_cast<int>(c10::elementSize(p.compute)) * 8 - (IsUnsigned(p.compute) ? 0 : 1);
      Value acc = ConstLike(b, x, 1), sq = x, rest = e;
      Value one_e = ConstLike(b, e, 1), two_e = ConstLike(b, e, 2), zero_e = ConstLike(b, e, 0);
      for (int i = 0; i < bits; ++i) {
        acc = b.Select(Cmp(b, b.And(rest, one_e), zero_e, kNE), b.Mul(acc, sq), acc);
        if (i + 1 < bits) {
          sq = b.Mul(sq, sq);
          rest = b.Div(rest, two_e);
        }
      }
      r = acc;
    }
    // An integer tensor to a negative integer Scalar power: CPU's meta
    // kernel raises (pow.Tensor_Scalar); the Scalar is a runtime input.
    const c10::Argument* exp_schema = nullptr;
    for (const auto& a : ctx.schema.arguments())
      if (a.name() == "exponent") exp_schema = &a;
    if (exp_schema && exp_schema->type()->kind() == c10::TypeKind::NumberType && base_arg.kind == Kind::kTensor &&
        at::isIntegralType(exp_arg.dtype, /*includeBool=*/false)) {
      const Value& raw = ctx.value("exponent");
      ctx.check(Cmp(b, raw, ConstLike(b, raw, 0), kLT), "Integers to negative integer powers are not allowed.");
    }
    // Negative integer exponents (tensor exponents): 1 for base 1, +-1 for base -1, else 0.
    if (IsUnsigned(p.compute)) return {p.Done(r)};
    Value zero = p.C(0), one = p.C(1);
    Value odd = Cmp(b, b.Rem(e, p.C(2)), zero, kNE);
    Value neg_one_pow = b.Select(odd, p.C(-1), one);
    Value neg = b.Select(Cmp(b, x, one, kEQ), one,
                         b.Select(Cmp(b, x, p.C(-1), kEQ), neg_one_pow, zero));
    return {p.Done(b.Select(Cmp(b, e, zero, kLT), neg, r))};
  }
  if (exp_arg.kind == Kind::kScalar && base_arg.kind == Kind::kTensor) {
    // PyTorch evaluates these exponents exactly (pow_tensor_scalar_optimized).
    Value sq = b.Mul(x, x);
    auto when = [&](double v, const Value& then) { r = b.Select(Cmp(b, e, p.C(v), kEQ), then, r); };
    when(2, sq);
    when(3, b.Mul(sq, x));
    when(0.5, b.Sqrt(x));
    when(-0.5, b.Rsqrt(x));
    when(-1, b.Div(p.C(1), x));
    when(-2, b.Div(p.C(1), sq));
  }
  if (base_arg.kind == Kind::kScalar) {
    // pow(1, x) is 1 for every x, NaN included.
    r = b.Select(Cmp(b, x, p.C(1), kEQ), p.C(1), r);
  }
  return {p.Done(r)};
}

// ---------------------------------------------------------------------------
// Unary ops.

using UnaryFn = Value (*)(Builder&, const Value&);

// Unary float ops: integer inputs compute in the default float dtype.
template <UnaryFn F>
std::vector<Value> UnaryFloat(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"}, Promote::kIntToFloat);
  return {p.Done(F(p.b, p.In("self")))};
}

Value FSqrt(Builder& b, const Value& x) { return b.Sqrt(x); }
Value FRsqrt(Builder& b, const Value& x) { return b.Rsqrt(x); }
Value FExp(Builder& b, const Value& x) { return b.Exp(x); }
Value FExp2(Builder& b, const Value& x) { return b.Pow(ConstLike(b, x, 2), x); }
Value FExpm1(Builder& b, const Value& x) { return b.Unary("stablehlo.exponential_minus_one", x); }
Value FLog(Builder& b, const Value& x) { return b.Log(x); }
Value FLog2(Builder& b, const Value& x) { return b.Mul(b.Log(x), ConstLike(b, x, 1.4426950408889634)); }
Value FLog10(Builder& b, const Value& x) { return b.Mul(b.Log(x), ConstLike(b, x, 0.43429448190325176)); }
Value FLog1p(Builder& b, const Value& x) { return b.Unary("stablehlo.log_plus_one", x); }
Value FSin(Builder& b, const Value& x) { return b.Unary("stablehlo.sine", x); }
Value FCos(Builder& b, const Value& x) { return b.Unary("stablehlo.cosine", x); }
Value FTan(Builder& b, const Value& x) { return b.Unary("stablehlo.tan", x); }
Value FTanh(Builder& b, const Value& x) { return b.Tanh(x); }
Value FSigmoid(Builder& b, const Value& x) { return b.Unary("stablehlo.logistic", x); }
Value FErf(Builder& b, const Value& x) { return Erf(b, x); }
Value FReciprocal(Builder& b, const Value& x) { return b.Div(ConstLike(b, x, 1), x); }

std::vector<Value> LowerNeg(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"});
  if (p.common == at::kBool) throw LoweringError(ctx.op_name() + ": negation of a bool tensor");
  return {p.Done(p.b.Neg(p.In("self")))};
}

std::vector<Value> LowerAbs(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"});
  Value x = p.In("self");
  if (IsComplex(p.common)) return {ComplexAbs(p.b, x)};  // |z|, real (stablehlo.abs of a complex)
  if (p.common == at::kBool || IsUnsigned(p.common)) return {x};
  return {p.Done(p.b.Abs(x))};
}

// sign = (0 < x) - (x < 0): NaN and -0.0 give +0.0, as PyTorch's CPU kernel.
// sgn of a complex z: z / |z|, and 0 where z == 0 (c10's sgn_impl).
std::vector<Value> LowerSign(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"});
  Builder& b = p.b;
  Value x = p.In("self");
  if (p.common == at::kBool) return {x};
  if (IsComplex(p.common)) {
    if (ctx.schema.name() != "aten::sgn") throw LoweringError(ctx.op_name() + ": sign of a complex tensor");
    Value mag = ComplexAbs(b, x);
    Value zero = ConstLike(b, mag, 0);
    Value q = b.Div(x, CastElement(b, mag, x.element()));
    return {b.Select(Cmp(b, mag, zero, kEQ), p.C(0), q)};
  }
  Value zero = p.C(0);
  Value pos = CastElement(b, Cmp(b, x, zero, kGT), p.el());
  Value neg = CastElement(b, Cmp(b, x, zero, kLT), p.el());
  return {p.Done(b.Sub(pos, neg))};
}

// Rounding ops are the identity on integers.
template <UnaryFn F>
std::vector<Value> RoundingOp(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"});
  Value x = p.In("self");
  if (!IsFloat(p.common)) return {x};
  return {p.Done(F(p.b, x))};
}
Value FFloor(Builder& b, const Value& x) { return b.Floor(x); }
Value FCeil(Builder& b, const Value& x) { return b.Unary("stablehlo.ceil", x); }
Value FTrunc(Builder& b, const Value& x) { return Trunc(b, x); }

std::vector<Value> LowerRound(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"});
  Builder& b = p.b;
  Value x = p.In("self");
  if (!IsFloat(p.common)) return {x};
  int64_t decimals = ctx.find("decimals") ? ctx.int_arg("decimals") : 0;
  if (decimals == 0) return {p.Done(b.Unary("stablehlo.round_nearest_even", x))};
  // PyTorch: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d.
  Value scale = p.C(std::pow(10.0, static_cast<double>(decimals < 0 ? -decimals : decimals)));
  if (decimals > 0) return {p.Done(b.Div(b.Unary("stablehlo.round_nearest_even", b.Mul(x, scale)), scale))};
  return {p.Done(b.Mul(b.Unary("stablehlo.round_nearest_even", b.Div(x, scale)), scale))};
}

std::vector<Value> LowerFrac(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"});
  if (!IsFloat(p.common)) throw LoweringError(ctx.op_name() + ": frac of an integer tensor");
  Value x = p.In("self");
  return {p.Done(p.b.Sub(x, Trunc(p.b, x)))};
}

// ---------------------------------------------------------------------------
// Clamps, maximum/minimum, lerp, addcmul/addcdiv.

// clamp(x, min, max) = min(max(x, lo), hi) with NaN propagation (a NaN bound
// gives NaN).
std::vector<Value> LowerClamp(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "min", "max"});
  bool has_min = ctx.find("min") && ctx.has("min");
  bool has_max = ctx.find("max") && ctx.has("max");
  Value x = p.In("self");
  if (has_min) x = MaxPropagateNaN(p.b, x, p.In("min"));
  if (has_max) x = MinPropagateNaN(p.b, x, p.In("max"));
  return {p.Done(x)};
}

std::vector<Value> LowerMaximum(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  return {p.Done(MaxPropagateNaN(p.b, p.In("self"), p.In("other")))};
}
std::vector<Value> LowerMinimum(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  return {p.Done(MinPropagateNaN(p.b, p.In("self"), p.In("other")))};
}

// fmax/fmin: a NaN operand is ignored (NaN only when both are NaN).
std::vector<Value> FMaxMin(LoweringContext& ctx, bool is_max) {
  Pw p = MakePw(ctx, {"self", "other"});
  Builder& b = p.b;
  Value x = p.In("self"), y = p.In("other");
  Value m = is_max ? b.Max(x, y) : b.Min(x, y);
  if (IsFloat(p.compute)) m = b.Select(IsNan(b, x), y, b.Select(IsNan(b, y), x, m));
  return {p.Done(m)};
}
std::vector<Value> LowerFmax(LoweringContext& ctx) { return FMaxMin(ctx, true); }
std::vector<Value> LowerFmin(LoweringContext& ctx) { return FMaxMin(ctx, false); }

// lerp: |w| < 0.5 ? self + w * (end - self) : end - (end - self) * (1 - w).
std::vector<Value> LowerLerp(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "end"});
  Builder& b = p.b;
  Value s = p.In("self"), e = p.In("end");
  Value w = ctx.arg("weight").kind == Kind::kScalar ? p.Scalar("weight") : p.In("weight");
  Value diff = b.Sub(e, s);
  Value lo = b.Add(s, b.Mul(w, diff));
  Value hi = b.Sub(e, b.Mul(diff, b.Sub(p.C(1), w)));
  return {p.Done(b.Select(Cmp(b, b.Abs(w), p.C(0.5), kLT), lo, hi))};
}

std::vector<Value> AddcOp(LoweringContext& ctx, bool divide) {
  Pw p = MakePw(ctx, {"self", "tensor1", "tensor2"});
  Builder& b = p.b;
  if (divide && !IsFloat(p.common) && !IsComplex(p.common)) throw LoweringError(ctx.op_name() + ": integer addcdiv");
  p.compute = ArithCompute(p.common);
  Value scaled = b.Mul(p.Scalar("value"), p.In("tensor1"));
  Value t = divide ? b.Div(scaled, p.In("tensor2")) : b.Mul(scaled, p.In("tensor2"));
  return {p.Done(b.Add(p.In("self"), t))};
}
std::vector<Value> LowerAddcmul(LoweringContext& ctx) { return AddcOp(ctx, false); }
std::vector<Value> LowerAddcdiv(LoweringContext& ctx) { return AddcOp(ctx, true); }

// ---------------------------------------------------------------------------
// Selection.

std::vector<Value> LowerWhere(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  p.compute = p.common;
  Value cond = BroadcastTo(p.b, Cast(p.b, ctx.value("condition"), at::kBool), p.sizes);
  return {p.b.Select(cond, p.In("self"), p.In("other"))};
}

std::vector<Value> LowerMaskedFill(LoweringContext& ctx) {
  ScalarType dtype = ctx.arg("self").dtype;
  Pw p = MakePwAs(ctx, dtype);
  p.compute = dtype;
  Value mask = BroadcastTo(p.b, Cast(p.b, ctx.tensor("mask"), at::kBool), p.sizes);
  return {p.b.Select(mask, p.Scalar("value"), p.In("self"))};
}

// ---------------------------------------------------------------------------
// Comparisons, logical and bitwise ops.

template <CompareDirection D>
std::vector<Value> Compare(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"}, Promote::kKeep, OutputCast::kAny);
  p.compute = p.common;
  if (IsComplex(p.common) && D != kEQ && D != kNE)
    throw LoweringError(ctx.op_name() + ": complex numbers are not ordered");
  return {Cmp(p.b, p.In("self"), p.In("other"), D)};
}

std::vector<Value> LowerIsnan(LoweringContext& ctx) {
  Pw p = MakePwAs(ctx, ctx.arg("self").dtype);
  p.compute = p.common;
  if (IsComplex(p.common)) {  // either part NaN
    Value x = p.In("self");
    return {p.b.Or(IsNan(p.b, p.b.Real(x)), IsNan(p.b, p.b.Imag(x)))};
  }
  if (!IsFloat(p.common)) return {Const(p.b, ElementType::kPred, 0, p.sizes)};
  Value x = p.In("self");
  return {IsNan(p.b, x)};
}

std::vector<Value> LowerIsinf(LoweringContext& ctx) {
  Pw p = MakePwAs(ctx, ctx.arg("self").dtype);
  p.compute = p.common;
  if (IsComplex(p.common)) {  // either part infinite
    Value x = p.In("self");
    Value re = p.b.Real(x), im = p.b.Imag(x);
    Value inf = ConstLike(p.b, re, std::numeric_limits<double>::infinity());
    return {p.b.Or(Cmp(p.b, p.b.Abs(re), inf, kEQ), Cmp(p.b, p.b.Abs(im), inf, kEQ))};
  }
  if (!IsFloat(p.common)) return {Const(p.b, ElementType::kPred, 0, p.sizes)};
  return {Cmp(p.b, p.b.Abs(p.In("self")), p.C(std::numeric_limits<double>::infinity()), kEQ)};
}

std::vector<Value> LowerNanToNum(LoweringContext& ctx) {
  ScalarType dtype = ctx.arg("self").dtype;
  Pw p = MakePwAs(ctx, dtype);
  p.compute = dtype;
  Builder& b = p.b;
  Value x = p.In("self");
  if (!IsFloat(dtype)) return {x};
  auto opt = [&](std::string_view name, double dflt) {
    return ctx.has(name) ? ctx.float_arg(name) : dflt;
  };
  double big = MaxFinite(dtype);
  Value nan = p.C(opt("nan", 0.0));
  Value pos = p.C(opt("posinf", big));
  Value neg = p.C(opt("neginf", -big));
  double inf = std::numeric_limits<double>::infinity();
  Value r = b.Select(Cmp(b, x, p.C(inf), kEQ), pos, x);
  r = b.Select(Cmp(b, x, p.C(-inf), kEQ), neg, r);
  return {b.Select(IsNan(b, x), nan, r)};
}

Value AsBool(const Pw& p, std::string_view name) {
  return BroadcastTo(p.b, Cast(p.b, p.ctx.value(name), at::kBool), p.sizes);
}

std::vector<Value> LowerLogicalAnd(LoweringContext& ctx) {
  Pw p = MakePwAs(ctx, at::kBool);
  return {p.b.And(AsBool(p, "self"), AsBool(p, "other"))};
}
std::vector<Value> LowerLogicalOr(LoweringContext& ctx) {
  Pw p = MakePwAs(ctx, at::kBool);
  return {p.b.Or(AsBool(p, "self"), AsBool(p, "other"))};
}
std::vector<Value> LowerLogicalXor(LoweringContext& ctx) {
  Pw p = MakePwAs(ctx, at::kBool);
  return {p.b.Xor(AsBool(p, "self"), AsBool(p, "other"))};
}
std::vector<Value> LowerLogicalNot(LoweringContext& ctx) {
  Pw p = MakePwAs(ctx, at::kBool);
  return {p.b.Not(AsBool(p, "self"))};
}

template <int Op>  // 0 and, 1 or, 2 xor
std::vector<Value> Bitwise(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self", "other"});
  if (IsFloat(p.common)) throw LoweringError(ctx.op_name() + ": bitwise op on a floating tensor");
  p.compute = p.common;
  Value x = p.In("self"), y = p.In("other");
  if (Op == 0) return {p.b.And(x, y)};
  if (Op == 1) return {p.b.Or(x, y)};
  return {p.b.Xor(x, y)};
}

std::vector<Value> LowerBitwiseNot(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"});
  if (IsFloat(p.common)) throw LoweringError(ctx.op_name() + ": bitwise op on a floating tensor");
  p.compute = p.common;
  return {p.b.Not(p.In("self"))};
}

// ---------------------------------------------------------------------------
// erfinv: M. Giles, "Approximating the erfinv function" (GPU Computing Gems
// Jade, 2011), single-precision polynomials in w = -log((1 - x)(1 + x)),
// then two Newton steps on erf (the Erf above) in f64, rounded once: within
// float32 tolerance of CPU for float/bf16/f16 (|x| < 1 there keeps
// erfinv(x) < 4, where Erf's error is far below float's). Exact: +-1 ->
// +-inf, |x| > 1 and NaN -> NaN. float64 inputs run on the CPU (Erf is not
// accurate to double precision). Integers promote to the default float dtype.
constexpr std::array<double, 9> kErfinvCentral = {1.50140941,      0.246640727,    -0.00417768164,
                                                  -0.00125372503,  0.00021858087,  -4.39150654e-06,
                                                  -3.5233877e-06,  3.43273939e-07, 2.81022636e-08};
constexpr std::array<double, 9> kErfinvTail = {2.83297682,     1.00167406,     0.00943887047,
                                               -0.0076224613,  0.00573950773,  -0.00367342844,
                                               0.00134934322,  0.000100950558, -0.000200214257};

std::vector<Value> LowerErfinv(LoweringContext& ctx) {
  Pw p = MakePw(ctx, {"self"}, Promote::kIntToFloat);
  if (p.common == at::kDouble)
    throw LoweringError(ctx.op_name() + ": float64 erfinv needs a double-precision erf (runs on the CPU)");
  p.compute = at::kDouble;
  Builder& b = p.b;
  Value x = p.In("self");
  Value one = p.C(1);
  Value w = b.Neg(b.Log(b.Mul(b.Sub(one, x), b.Add(one, x))));
  Value central = b.Mul(Horner(b, b.Sub(w, p.C(2.5)), kErfinvCentral), x);
  Value tail = b.Mul(Horner(b, b.Sub(b.Sqrt(w), p.C(3)), kErfinvTail), x);
  Value y = b.Select(Cmp(b, w, p.C(5), kLT), central, tail);
  for (int i = 0; i < 2; ++i) {
    Value deriv = b.Mul(p.C(1.12837916709551257390), b.Exp(b.Neg(b.Mul(y, y))));
    y = b.Sub(y, b.Div(b.Sub(Erf(b, y), x), deriv));
  }
  Value ax = b.Abs(x);
  y = b.Select(Cmp(b, ax, one, kEQ), b.Mul(x, p.C(std::numeric_limits<double>::infinity())), y);
  y = b.Select(b.Or(Cmp(b, ax, one, kGT), IsNan(b, x)), p.C(std::numeric_limits<double>::quiet_NaN()), y);
  return {p.Done(y)};
}

// ---------------------------------------------------------------------------
// Activations and their backward ops. They compute in the opmath type of the
// input's dtype.

Pw ActivationPw(LoweringContext& ctx, std::initializer_list<std::string_view> names) {
  Pw p = MakePw(ctx, names);
  if (p.common == at::kBool) throw LoweringError(ctx.op_name() + ": bool input");
  return p;
}

std::vector<Value> LowerRelu(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  return {p.Done(MaxPropagateNaN(p.b, p.In("self"), p.C(0)))};
}

// threshold(x, th, v) = x <= th ? v : x
std::vector<Value> LowerThreshold(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Value x = p.In("self");
  return {p.Done(p.b.Select(Cmp(p.b, x, p.Scalar("threshold"), kLE), p.Scalar("value"), x))};
}

// threshold_backward(dy, x, th) = x <= th ? 0 : dy
std::vector<Value> LowerThresholdBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Value x = p.In("self");
  return {p.Done(p.b.Select(Cmp(p.b, x, p.Scalar("threshold"), kLE), p.C(0), p.In("grad_output")))};
}

constexpr double kSqrt1_2 = 0.70710678118654752440;   // 1/sqrt(2)
constexpr double k2SqrtPi = 1.12837916709551257390;   // 2/sqrt(pi)
constexpr double kSqrt2 = 1.41421356237309504880;
constexpr double kGeluKappa = 0.044715;

bool GeluTanh(const LoweringContext& ctx) {
  std::string_view a = ctx.find("approximate") ? ctx.string_arg("approximate") : "none";
  if (a == "tanh") return true;
  if (a == "none") return false;
  throw LoweringError(ctx.op_name() + ": unknown approximate " + std::string(a));
}

std::vector<Value> LowerGelu(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Builder& b = p.b;
  Value x = p.In("self");
  Value half_x = b.Mul(x, p.C(0.5));
  if (GeluTanh(ctx)) {
    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    Value inner = b.Mul(p.C(kSqrt2 * k2SqrtPi * 0.5), b.Add(x, b.Mul(p.C(kGeluKappa), b.Mul(b.Mul(x, x), x))));
    return {p.Done(b.Mul(half_x, b.Add(p.C(1), b.Tanh(inner))))};
  }
  // x * 0.5 * (1 + erf(x / sqrt(2)))
  return {p.Done(b.Mul(half_x, b.Add(p.C(1), Erf(b, b.Mul(x, p.C(kSqrt1_2))))))};
}

std::vector<Value> LowerGeluBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), x = p.In("self");
  if (GeluTanh(ctx)) {
    const double beta = kSqrt2 * k2SqrtPi * 0.5;
    Value x_sq = b.Mul(x, x);
    Value x_cube = b.Mul(x_sq, x);
    Value inner = b.Mul(p.C(beta), b.Add(x, b.Mul(p.C(kGeluKappa), x_cube)));
    Value t = b.Tanh(inner);
    Value left = b.Mul(p.C(0.5), x);
    Value right = b.Add(p.C(1), t);
    Value left_d = b.Mul(p.C(0.5), right);
    Value tanh_d = b.Sub(p.C(1), b.Mul(t, t));
    Value inner_d = b.Mul(p.C(beta), b.Add(p.C(1), b.Mul(p.C(3 * kGeluKappa), x_sq)));
    Value right_d = b.Mul(b.Mul(left, tanh_d), inner_d);
    return {p.Done(b.Mul(dy, b.Add(left_d, right_d)))};
  }
  // dy * (cdf + x * pdf)
  Value cdf = b.Mul(p.C(0.5), b.Add(p.C(1), Erf(b, b.Mul(x, p.C(kSqrt1_2)))));
  Value pdf = b.Mul(p.C(k2SqrtPi * kSqrt1_2 * 0.5), b.Exp(b.Mul(b.Mul(x, x), p.C(-0.5))));
  return {p.Done(b.Mul(dy, b.Add(cdf, b.Mul(x, pdf))))};
}

Value Sigmoid(const Pw& p, const Value& x) {
  return p.b.Div(p.C(1), p.b.Add(p.C(1), p.b.Exp(p.b.Neg(x))));
}

std::vector<Value> LowerSilu(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Value x = p.In("self");
  return {p.Done(p.b.Div(x, p.b.Add(p.C(1), p.b.Exp(p.b.Neg(x)))))};
}

// dy * s * (1 + x * (1 - s)), s = sigmoid(x)
std::vector<Value> LowerSiluBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), x = p.In("self");
  Value s = Sigmoid(p, x);
  return {p.Done(b.Mul(b.Mul(dy, s), b.Add(p.C(1), b.Mul(x, b.Sub(p.C(1), s)))))};
}

// dy * (1 - y) * y
std::vector<Value> LowerSigmoidBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "output"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), y = p.In("output");
  return {p.Done(b.Mul(b.Mul(dy, b.Sub(p.C(1), y)), y))};
}

// dy * (1 - y^2)
std::vector<Value> LowerTanhBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "output"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), y = p.In("output");
  return {p.Done(b.Mul(dy, b.Sub(p.C(1), b.Mul(y, y))))};
}

std::vector<Value> LowerHardtanh(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Value x = MaxPropagateNaN(p.b, p.In("self"), p.Scalar("min_val"));
  return {p.Done(MinPropagateNaN(p.b, x, p.Scalar("max_val")))};
}

// (x <= min || x >= max) ? 0 : dy
std::vector<Value> LowerHardtanhBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Builder& b = p.b;
  Value x = p.In("self");
  Value out = b.Or(Cmp(b, x, p.Scalar("min_val"), kLE), Cmp(b, x, p.Scalar("max_val"), kGE));
  return {p.Done(b.Select(out, p.C(0), p.In("grad_output")))};
}

// x > 0 ? x : x * slope
std::vector<Value> LowerLeakyRelu(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Builder& b = p.b;
  Value x = p.In("self");
  return {p.Done(b.Select(Cmp(b, x, p.C(0), kGT), x, b.Mul(x, p.Scalar("negative_slope"))))};
}

// x > 0 ? dy : dy * slope
std::vector<Value> LowerLeakyReluBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), x = p.In("self");
  return {p.Done(b.Select(Cmp(b, x, p.C(0), kGT), dy, b.Mul(dy, p.Scalar("negative_slope"))))};
}

// x > 0 ? x * scale : (exp(x * input_scale) - 1) * alpha * scale
std::vector<Value> LowerElu(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Builder& b = p.b;
  Value x = p.In("self");
  Value scale = p.Scalar("scale");
  Value neg = b.Mul(b.Mul(FExpm1(b, b.Mul(x, p.Scalar("input_scale"))), p.Scalar("alpha")), scale);
  return {p.Done(b.Select(Cmp(b, x, p.C(0), kGT), b.Mul(x, scale), neg))};
}

std::vector<Value> LowerEluBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self_or_result"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), x = p.In("self_or_result");
  Value negcoef = b.Mul(p.Scalar("alpha"), p.Scalar("scale"));
  Value poscoef = p.Scalar("scale");
  Value negiptcoef = p.Scalar("input_scale");
  Value pos = b.Mul(dy, poscoef);
  Value neg;
  if (ctx.bool_arg("is_result")) {
    neg = b.Mul(b.Mul(dy, negiptcoef), b.Add(x, negcoef));
  } else {
    neg = b.Mul(b.Mul(b.Mul(dy, negiptcoef), negcoef), b.Exp(b.Mul(x, negiptcoef)));
  }
  return {p.Done(b.Select(Cmp(b, x, p.C(0), kLE), neg, pos))};
}

// x * beta > threshold ? x : log1p(exp(x * beta)) / beta
std::vector<Value> LowerSoftplus(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Builder& b = p.b;
  Value x = p.In("self"), beta = p.Scalar("beta");
  Value xb = b.Mul(x, beta);
  Value soft = b.Div(FLog1p(b, b.Exp(xb)), beta);
  return {p.Done(b.Select(Cmp(b, xb, p.Scalar("threshold"), kGT), x, soft))};
}

// z = exp(x * beta); x * beta > threshold ? dy : dy * z / (z + 1)
std::vector<Value> LowerSoftplusBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), x = p.In("self");
  Value xb = b.Mul(x, p.Scalar("beta"));
  Value z = b.Exp(xb);
  Value g = b.Div(b.Mul(dy, z), b.Add(z, p.C(1)));
  return {p.Done(b.Select(Cmp(b, xb, p.Scalar("threshold"), kGT), dy, g))};
}

// x * tanh(log1p(exp(x)))
std::vector<Value> LowerMish(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Builder& b = p.b;
  Value x = p.In("self");
  return {p.Done(b.Mul(x, b.Tanh(FLog1p(b, b.Exp(x)))))};
}

// hardsigmoid(x) = min(max(x + 3, 0), 6) / 6 (NaN propagates, as CPU's
// std::min/std::max and vectorized minimum/maximum do).
Value HardRelu6(const Pw& p, const Value& x) {
  return MinPropagateNaN(p.b, MaxPropagateNaN(p.b, p.b.Add(x, p.C(3)), p.C(0)), p.C(6));
}

std::vector<Value> LowerHardsigmoid(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  return {p.Done(p.b.Div(HardRelu6(p, p.In("self")), p.C(6)))};
}

// hardsigmoid_backward(dy, x) = -3 < x < 3 ? dy / 6 : 0
std::vector<Value> LowerHardsigmoidBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Builder& b = p.b;
  Value x = p.In("self");
  Value inside = b.And(Cmp(b, x, p.C(-3), kGT), Cmp(b, x, p.C(3), kLT));
  return {p.Done(b.Select(inside, b.Div(p.In("grad_output"), p.C(6)), p.C(0)))};
}

// hardswish(x) = x * min(max(x + 3, 0), 6) / 6
std::vector<Value> LowerHardswish(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"self"});
  Value x = p.In("self");
  return {p.Done(p.b.Div(p.b.Mul(x, HardRelu6(p, x)), p.C(6)))};
}

// hardswish_backward(dy, x) = x <= -3 ? 0 : x < 3 ? dy * (x / 3 + 0.5) : dy
// (CPU's branch order: NaN x gives dy).
std::vector<Value> LowerHardswishBackward(LoweringContext& ctx) {
  Pw p = ActivationPw(ctx, {"grad_output", "self"});
  Builder& b = p.b;
  Value dy = p.In("grad_output"), x = p.In("self");
  Value mid = b.Mul(dy, b.Add(b.Div(x, p.C(3)), p.C(0.5)));
  Value r = b.Select(Cmp(b, x, p.C(3), kLT), mid, dy);
  return {p.Done(b.Select(Cmp(b, x, p.C(-3), kLE), p.C(0), r))};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    // arithmetic
    {"add", LowerAdd, kComplex},
    {"sub", LowerSub, kComplex},
    {"rsub", LowerRsub, kComplex},
    {"mul", LowerMul, kComplex},
    {"div", LowerDiv, kComplex},
    {"floor_divide", LowerFloorDivide},
    {"remainder", LowerRemainder},
    {"fmod", LowerFmod},
    {"pow", LowerPow, kComplex},
    {"neg", LowerNeg, {.out_same_dtype = true, .complex = true}},
    {"abs", LowerAbs, {.out_same_dtype = true, .complex = true}},
    {"sign", LowerSign, {.out_same_dtype = true}},
    {"sgn", LowerSign, {.out_same_dtype = true, .complex = true}},
    {"reciprocal", UnaryFloat<FReciprocal>, kComplex},
    // unary math
    {"sqrt", UnaryFloat<FSqrt>, kComplex},
    {"rsqrt", UnaryFloat<FRsqrt>, kComplex},
    {"exp", UnaryFloat<FExp>, kComplex},
    {"exp2", UnaryFloat<FExp2>, kComplex},
    {"expm1", UnaryFloat<FExpm1>, kComplex},
    {"log", UnaryFloat<FLog>, kComplex},
    {"log2", UnaryFloat<FLog2>, kComplex},
    {"log10", UnaryFloat<FLog10>, kComplex},
    {"log1p", UnaryFloat<FLog1p>, kComplex},
    {"sin", UnaryFloat<FSin>, kComplex},
    {"cos", UnaryFloat<FCos>, kComplex},
    {"tan", UnaryFloat<FTan>, kComplex},
    {"tanh", UnaryFloat<FTanh>, kComplex},
    {"sigmoid", UnaryFloat<FSigmoid>, kComplex},
    {"erf", UnaryFloat<FErf>},
    {"erfinv", LowerErfinv},
    // rounding
    {"floor", RoundingOp<FFloor>, {.out_same_dtype = true}},
    {"ceil", RoundingOp<FCeil>, {.out_same_dtype = true}},
    {"trunc", RoundingOp<FTrunc>, {.out_same_dtype = true}},
    {"round", LowerRound, {.out_same_dtype = true}},
    {"frac", LowerFrac, {.out_same_dtype = true}},
    // clamps, extrema, blends
    {"clamp", LowerClamp},
    {"clamp_min", LowerClamp},
    {"clamp_max", LowerClamp},
    {"maximum", LowerMaximum},
    {"minimum", LowerMinimum},
    {"fmax", LowerFmax},
    {"fmin", LowerFmin},
    {"lerp", LowerLerp},
    {"addcmul", LowerAddcmul, kComplex},
    {"addcdiv", LowerAddcdiv, kComplex},
    // selection
    {"where", LowerWhere, kComplex},
    {"masked_fill", LowerMaskedFill, kComplex},
    // comparisons and predicates
    {"eq", Compare<CompareDirection::kEQ>, kComplex},
    {"ne", Compare<CompareDirection::kNE>, kComplex},
    {"lt", Compare<CompareDirection::kLT>},
    {"le", Compare<CompareDirection::kLE>},
    {"gt", Compare<CompareDirection::kGT>},
    {"ge", Compare<CompareDirection::kGE>},
    {"isnan", LowerIsnan, kComplex},
    {"isinf", LowerIsinf, kComplex},
    {"nan_to_num", LowerNanToNum},
    // logical and bitwise
    {"logical_and", LowerLogicalAnd},
    {"logical_or", LowerLogicalOr},
    {"logical_xor", LowerLogicalXor},
    {"logical_not", LowerLogicalNot},
    {"bitwise_and", Bitwise<0>},
    {"bitwise_or", Bitwise<1>},
    {"bitwise_xor", Bitwise<2>},
    {"bitwise_not", LowerBitwiseNot, {.out_same_dtype = true}},
    // activations and backward ops
    {"relu", LowerRelu},
    {"threshold", LowerThreshold},
    {"threshold_backward", LowerThresholdBackward},
    {"gelu", LowerGelu},
    {"gelu_backward", LowerGeluBackward},
    {"silu", LowerSilu},
    {"silu_backward", LowerSiluBackward},
    {"sigmoid_backward", LowerSigmoidBackward},
    {"tanh_backward", LowerTanhBackward},
    {"hardtanh", LowerHardtanh},
    {"hardtanh_backward", LowerHardtanhBackward},
    {"leaky_relu", LowerLeakyRelu},
    {"leaky_relu_backward", LowerLeakyReluBackward},
    {"elu", LowerElu},
    {"elu_backward", LowerEluBackward},
    {"softplus", LowerSoftplus},
    {"softplus_backward", LowerSoftplusBackward},
    {"mish", LowerMish},
    {"hardsigmoid", LowerHardsigmoid},
    {"hardsigmoid_backward", LowerHardsigmoidBackward},
    {"hardswish", LowerHardswish},
    {"hardswish_backward", LowerHardswishBackward},
});

}  // namespace torch_tpu::lowering
