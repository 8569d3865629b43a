// Special functions: xlogy, special_xlog1py, special_entr, copysign, heaviside,
// isposinf/isneginf, logit (+logit_backward), lgamma, digamma, polygamma,
// logaddexp, logaddexp2, hypot, nextafter, sinc, trace, i0, special_i1
// (erfinv is in pointwise.cpp, next to erf)
// (mvlgamma is PyTorch's composite of arange, add, lgamma and sum).
//
// Type promotion follows TensorIterator (as in pointwise.cpp): a common dtype
// from the operands (dimensioned tensors over 0-d tensors over Python
// numbers); xlogy, xlog1py, copysign, logit and the gamma functions promote
// integer/bool inputs to the default float dtype. Where the CPU kernel runs
// in c10::BFloat16/Half arithmetic (xlogy, xlog1py, logit) every operation is
// rounded to the dtype (computed in f32); lgamma/digamma/polygamma compute in
// f64 and round once (CPU computes float/bfloat16 in float; the f64 result is
// the more accurate, within float32 tolerance of CPU's).
//
// Formulas:
//  - lgamma: Lanczos approximation, g = 7, n = 9 (the coefficients of
//    Numerical Recipes / Wikipedia "Lanczos approximation", Godfrey's set),
//    reflection lgamma(x) = log(pi / |sin(pi x)|) - lgamma(1 - x) for
//    x < 0.5 (sin of the reduced argument x - round(x)); +inf at the
//    non-positive integers and +-inf.
//  - digamma: Cephes psi as PyTorch's calc_digamma: reflection
//    psi(x) = psi(1 - x) - pi / tan(pi * frac(x)) for x < 0 (NaN at negative
//    integers), psi(+-0) = -+inf, recurrence psi(x) = psi(x + 1) - 1/x up to
//    x >= 10, then the asymptotic series log(x) - 1/(2x) - sum B2k/(2k x^2k).
//  - polygamma(1, x): PyTorch's calc_trigamma (reflection for x < 0.5,
//    six recurrence steps, asymptotic series).
//  For float/bfloat16 inputs trigamma's reflection angle pi * x is rounded to
//  float as CPU's calc_trigamma computes it (PiTimes): near the poles that
//  rounding decides CPU's value to ~1e-4 relative, and matching it keeps
//  float32 tolerance (CPU's float digamma reflects in double, as here).
//  - polygamma(n >= 2, x) = (-1)^(n+1) n! zeta(n + 1, x) with Cephes' Hurwitz
//    zeta (explicit terms until q + k > 9 and at least 9 of them, then the
//    Euler-Maclaurin tail with 12 Bernoulli terms), early exits emulated with
//    flags. The explicit terms are unrolled 40 times, enough for x >= -30;
//    below that the explicit sum stops early (values, not shapes, decide
//    it, so nothing can be raised at lowering time) and the result is less
//    accurate.
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
constexpr double kPi = 3.14159265358979323846;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool IsFloat(ScalarType t) { return at::isFloatingType(t); }
bool IsLow(ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// Type promotion: ResultType (helpers.h).

// Operands converted to the common dtype, then to `compute`, broadcast to the
// output's sizes.
struct Operands {
  LoweringContext& ctx;
  ScalarType common;
  ScalarType compute;
  std::vector<int64_t> sizes;

  Value In(std::string_view name) const {
    Builder& b = ctx.b;
    return BroadcastTo(b, Cast(b, Cast(b, ctx.value(name), common), compute), sizes);
  }
  Value C(double v) const { return Const(ctx.b, ToElementType(compute), v, sizes); }
  // One c10::BFloat16/Half operation's rounding (no-op otherwise).
  Value R(const Value& v) const {
    if (!IsLow(common)) return v;
    return ctx.b.Convert(ctx.b.Convert(v, ToElementType(common)), v.element());
  }
  Value Done(const Value& v) const { return Cast(ctx.b, v, common); }
};

Operands MakeOps(LoweringContext& ctx, std::initializer_list<std::string_view> names, bool int_to_float,
                 bool wide = false) {
  ScalarType common = ResultType(ctx, names);
  if (int_to_float && !IsFloat(common)) common = c10::get_default_dtype_as_scalartype();
  ScalarType compute = wide && IsFloat(common) ? at::kDouble : OpMathType(common);
  return Operands{ctx, common, compute, ctx.outputs.at(0).sizes};
}

Value IsNan(Builder& b, const Value& x) { return b.Compare(x, x, kNE); }
Value Sel(Builder& b, const Value& p, const Value& t, const Value& f) { return b.Select(p, t, f); }

// --- xlogy / xlog1py / copysign / heaviside / isposinf / isneginf ----------

// y NaN -> NaN; x == 0 -> 0; else x * log(y) (log rounded to the dtype first
// for bfloat16/half, as c10's std::log(BFloat16) returns a BFloat16).
template <bool kLog1p>
std::vector<Value> XLogY(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self", "other"}, true);
  Builder& b = ctx.b;
  Value x = o.In("self"), y = o.In("other");
  Value ly = o.R(kLog1p ? b.Unary("stablehlo.log_plus_one", y) : b.Log(y));
  Value r = o.R(b.Mul(x, ly));
  r = Sel(b, b.Compare(x, o.C(0), kEQ), o.C(0), r);
  r = Sel(b, IsNan(b, y), o.C(kNaN), r);
  return {o.Done(r)};
}

// special_entr(x): -x log(x) for x > 0, 0 at 0, -inf below, NaN kept (log
// rounded to the dtype first for bfloat16/half, as the CPU kernel).
std::vector<Value> LowerEntr(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self"}, true);
  Builder& b = ctx.b;
  Value x = o.In("self");
  Value r = o.R(b.Mul(b.Neg(x), o.R(b.Log(x))));
  r = Sel(b, b.Compare(x, o.C(0), kEQ), o.C(0), r);
  r = Sel(b, b.Compare(x, o.C(0), kLT), o.C(-kInf), r);
  return {o.Done(Sel(b, IsNan(b, x), x, r))};
}

// Sign bit of a floating value (true for -0.0 and negative NaNs).
Value SignBit(Builder& b, const Value& v) {
  ElementType it;
  switch (hlo::BitWidth(v.element())) {
    case 16: it = ElementType::kS16; break;
    case 32: it = ElementType::kS32; break;
    default: it = ElementType::kS64; break;
  }
  Value bits = b.BitcastConvert(v, it);
  return b.Compare(bits, ConstLike(b, bits, 0), kLT);
}

// copysign(x, y): |x| with y's sign bit; exact in the common dtype.
std::vector<Value> LowerCopysign(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self", "other"}, true);
  o.compute = o.common;
  Builder& b = ctx.b;
  Value ax = b.Abs(o.In("self"));
  return {Sel(b, SignBit(b, o.In("other")), b.Neg(ax), ax)};
}

// heaviside(x, values): x == 0 ? values : (x > 0). CPU requires equal dtypes
// (the meta kernel checks).
std::vector<Value> LowerHeaviside(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self", "values"}, false);
  o.compute = o.common == at::kBool ? at::kByte : o.common;
  Builder& b = ctx.b;
  Value x = o.In("self"), v = o.In("values");
  Value pos = Cast(b, b.Compare(x, o.C(0), kGT), o.compute);
  return {o.Done(Sel(b, b.Compare(x, o.C(0), kEQ), v, pos))};
}

template <bool kPositive>
std::vector<Value> IsSignedInf(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const LoweredArg& a = ctx.arg("self");
  const auto& sizes = ctx.outputs.at(0).sizes;
  if (at::isComplexType(a.dtype)) throw LoweringError(ctx.op_name() + ": complex input");
  if (!IsFloat(a.dtype)) return {Const(b, ElementType::kPred, 0, sizes)};
  Value x = BroadcastTo(b, ctx.tensor("self"), sizes);
  return {b.Compare(x, ConstLike(b, x, kPositive ? kInf : -kInf), kEQ)};
}

// --- logit -----------------------------------------------------------------

// eps (None -> -1, "no clamping"), rounded to the dtype as the CPU kernel's
// eps_scalar.to<scalar_t>().
double EpsOf(const LoweringContext& ctx) {
  const LoweredArg* a = ctx.find("eps");
  if (!a || a->kind == Kind::kNone || a->ivalue.isNone()) return -1.0;
  return ctx.float_arg("eps");
}

// logit(x, eps): z = eps >= 0 ? clamp(x, eps, 1 - eps) : x;
// log(z / (1 - z)) (each operation rounded for bfloat16/half).
std::vector<Value> LowerLogit(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self"}, true);
  Builder& b = ctx.b;
  Value x = o.In("self");
  const double eps = EpsOf(ctx);
  if (eps >= 0) {
    Value lo = o.R(o.C(eps));
    Value hi = o.R(b.Sub(o.C(1), lo));
    x = Sel(b, b.Compare(x, lo, kLT), lo, Sel(b, b.Compare(x, hi, kGT), hi, x));
  }
  Value r = o.R(b.Log(o.R(b.Div(x, o.R(b.Sub(o.C(1), x))))));
  return {o.Done(r)};
}

// logit_backward(dy, x, eps): outside [lo, hi] (eps >= 0) 0, outside [0, 1]
// (no eps) NaN; else dy / (x (1 - x)).
std::vector<Value> LowerLogitBackward(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"grad_output", "self"}, true);
  Builder& b = ctx.b;
  Value dy = o.In("grad_output"), x = o.In("self");
  const double eps = EpsOf(ctx);
  Value g = b.Div(dy, b.Mul(x, b.Sub(o.C(1), x)));
  Value lo = o.C(eps < 0 ? 0.0 : eps), hi = eps < 0 ? o.C(1) : b.Sub(o.C(1), lo);
  Value outside = b.Or(b.Compare(x, lo, kLT), b.Compare(x, hi, kGT));
  return {o.Done(Sel(b, outside, o.C(eps < 0 ? kNaN : 0.0), g))};
}

// --- gamma functions (f64) ---------------------------------------------------

constexpr std::array<double, 9> kLanczos = {
    0.99999999999980993,  676.5203681218851,     -1259.1392167224028,
    771.32342877765313,   -176.61502916214059,   12.507343278686905,
    -0.13857109526572012, 9.9843695780195716e-6, 1.5056327351493116e-7};
constexpr double kHalfLog2Pi = 0.91893853320467274178;  // log(2 pi) / 2

Value C(Builder& b, const Value& like, double v) { return ConstLike(b, like, v); }

Value RoundHalfEven(Builder& b, const Value& x) { return b.Unary("stablehlo.round_nearest_even", x); }

// lgamma for x >= 0.5 (Lanczos, g = 7).
Value LgammaPositive(Builder& b, const Value& x) {
  Value z = b.Sub(x, C(b, x, 1));
  Value a = C(b, x, kLanczos[0]);
  for (size_t i = 1; i < kLanczos.size(); ++i)
    a = b.Add(a, b.Div(C(b, x, kLanczos[i]), b.Add(z, C(b, x, static_cast<double>(i)))));
  Value t = b.Add(z, C(b, x, 7.5));
  Value r = b.Add(C(b, x, kHalfLog2Pi), b.Mul(b.Add(z, C(b, x, 0.5)), b.Log(t)));
  return b.Add(b.Sub(r, t), b.Log(a));
}

Value Lgamma(Builder& b, const Value& x) {
  Value half = C(b, x, 0.5);
  Value small = b.Compare(x, half, kLT);
  Value y = Sel(b, small, b.Sub(C(b, x, 1), x), x);  // >= 0.5
  Value lg = LgammaPositive(b, y);
  // |sin(pi x)| via the reduced argument r = x - round(x) in [-0.5, 0.5].
  Value r = b.Sub(x, RoundHalfEven(b, x));
  Value s = b.Abs(b.Unary("stablehlo.sine", b.Mul(C(b, x, kPi), r)));
  Value refl = b.Sub(b.Log(b.Div(C(b, x, kPi), s)), lg);
  Value out = Sel(b, small, refl, lg);
  Value pole = b.And(b.Compare(x, C(b, x, 0), kLE), b.Compare(r, C(b, x, 0), kEQ));
  Value inf = C(b, x, kInf);
  out = Sel(b, pole, inf, out);
  out = Sel(b, b.Compare(b.Abs(x), inf, kEQ), inf, out);
  return Sel(b, IsNan(b, x), x, out);
}

// digamma for x > 0 (recurrence to x >= 10, asymptotic series).
constexpr std::array<double, 7> kPsiA = {8.33333333333333333333E-2, -2.10927960927960927961E-2,
                                         7.57575757575757575758E-3, -4.16666666666666666667E-3,
                                         3.96825396825396825397E-3, -8.33333333333333333333E-3,
                                         8.33333333333333333333E-2};
constexpr double kPsi10 = 2.25175258906672110764;

Value DigammaPositive(Builder& b, Value x) {
  Value result = C(b, x, 0);
  Value ten = C(b, x, 10), one = C(b, x, 1);
  for (int i = 0; i < 10; ++i) {
    Value below = b.Compare(x, ten, kLT);
    result = Sel(b, below, b.Sub(result, b.Div(one, x)), result);
    x = Sel(b, below, b.Add(x, one), x);
  }
  Value z = b.Div(one, b.Mul(x, x));
  // polevl(z, A, 6): A[0] z^6 + ... + A[6]
  Value p = C(b, x, kPsiA[0]);
  for (size_t i = 1; i < kPsiA.size(); ++i) p = b.Add(b.Mul(p, z), C(b, x, kPsiA[i]));
  Value y = Sel(b, b.Compare(x, C(b, x, 1e17), kLT), b.Mul(z, p), C(b, x, 0));
  Value series = b.Sub(b.Sub(b.Add(result, b.Log(x)), b.Div(C(b, x, 0.5), x)), y);
  return Sel(b, b.Compare(x, ten, kEQ), b.Add(result, C(b, x, kPsi10)), series);
}

// pi * r as PyTorch's CPU kernel computes it for float/bfloat16 inputs (in
// float: its rounding dominates the reflection's error near the poles, where
// CPU's result is off the true value by up to ~1e-4 relative), else in double.
Value PiTimes(Builder& b, const Value& r, bool float_angle) {
  if (!float_angle) return b.Mul(C(b, r, kPi), r);
  Value rf = b.Convert(r, ElementType::kF32);
  return b.Convert(b.Mul(ConstLike(b, rf, static_cast<double>(static_cast<float>(kPi))), rf), r.element());
}

Value Digamma(Builder& b, const Value& x, bool float_angle) {
  Value zero = C(b, x, 0);
  Value neg = b.Compare(x, zero, kLT);
  Value y = Sel(b, neg, b.Sub(C(b, x, 1), x), x);
  Value psi = DigammaPositive(b, y);
  // frac(x) = x - trunc(x) (modf)
  Value tr = Sel(b, neg, b.Unary("stablehlo.ceil", x), b.Floor(x));
  Value frac = b.Sub(x, tr);
  Value refl = b.Sub(psi, b.Div(C(b, x, kPi), b.Unary("stablehlo.tan", PiTimes(b, frac, float_angle))));
  Value out = Sel(b, neg, refl, psi);
  out = Sel(b, b.And(neg, b.Compare(frac, zero, kEQ)), C(b, x, kNaN), out);
  // psi(+-0) = copysign(inf, -x)
  Value at_zero = b.Compare(x, zero, kEQ);
  out = Sel(b, at_zero, Sel(b, SignBit(b, x), C(b, x, kInf), C(b, x, -kInf)), out);
  out = Sel(b, b.Compare(x, C(b, x, kInf), kEQ), C(b, x, kInf), out);
  out = Sel(b, b.Compare(x, C(b, x, -kInf), kEQ), C(b, x, kNaN), out);
  return Sel(b, IsNan(b, x), x, out);
}

// PyTorch's calc_trigamma.
Value Trigamma(Builder& b, Value x, bool float_angle) {
  Value one = C(b, x, 1);
  Value small = b.Compare(x, C(b, x, 0.5), kLT);
  Value s = b.Unary("stablehlo.sine", PiTimes(b, x, float_angle));
  Value result = Sel(b, small, b.Neg(b.Div(C(b, x, kPi * kPi), b.Mul(s, s))), C(b, x, 0));
  Value sign = Sel(b, small, C(b, x, -1), one);
  x = Sel(b, small, b.Sub(one, x), x);
  for (int i = 0; i < 6; ++i) {
    result = b.Add(result, b.Div(one, b.Mul(x, x)));
    x = b.Add(x, one);
  }
  Value ixx = b.Div(one, b.Mul(x, x));
  Value inner = b.Sub(C(b, x, 1.0 / 30), b.Mul(ixx, C(b, x, 1.0 / 42)));
  inner = b.Sub(C(b, x, 1.0 / 6), b.Mul(ixx, inner));
  Value tail = b.Add(b.Add(one, b.Div(one, b.Mul(C(b, x, 2), x))), b.Mul(ixx, inner));
  result = b.Add(result, b.Div(tail, x));
  return b.Mul(sign, result);
}

// Cephes' Hurwitz zeta(s, q) for a static integer s > 1 (polygamma).
constexpr std::array<double, 12> kZetaA = {
    12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
    -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
    1.8152105401943546773e17, -7.1661652561756670113e18};
constexpr double kMachEp = 1.11022302462515654042E-16;
constexpr int kZetaTerms = 40;

Value Zeta(Builder& b, double s_exp, const Value& q) {
  Value one = C(b, q, 1), zero = C(b, q, 0);
  Value negx = C(b, q, -s_exp);
  Value s = b.Pow(q, negx);
  Value a = q;
  Value bb = zero;
  Value done = b.Compare(zero, zero, kNE);  // false
  Value nine = C(b, q, 9);
  for (int i = 0; i < kZetaTerms; ++i) {
    Value go = b.Not(done);
    if (i >= 9) go = b.And(go, b.Compare(a, nine, kLE));
    Value a2 = b.Add(a, one);
    Value b2 = b.Pow(a2, negx);
    Value s2 = b.Add(s, b2);
    a = Sel(b, go, a2, a);
    bb = Sel(b, go, b2, bb);
    s = Sel(b, go, s2, s);
    // early return when the term is negligible (sets done; s is final)
    Value tiny = b.And(b.Compare(b.Mul(C(b, q, -kMachEp), s), bb, kLT), b.Compare(bb, b.Mul(C(b, q, kMachEp), s), kLT));
    done = b.Or(done, b.And(go, tiny));
  }
  // Euler-Maclaurin tail at w = a.
  Value w = a;
  Value st = b.Add(s, b.Div(b.Mul(bb, w), C(b, q, s_exp - 1)));
  st = b.Sub(st, b.Mul(C(b, q, 0.5), bb));
  Value aa = one, k = zero, bt = bb;
  Value tail_done = b.Compare(zero, zero, kNE);
  for (size_t i = 0; i < kZetaA.size(); ++i) {
    Value xk = C(b, q, s_exp);
    aa = b.Mul(aa, b.Add(xk, k));
    bt = b.Div(bt, w);
    Value t = b.Div(b.Mul(aa, bt), C(b, q, kZetaA[i]));
    Value st2 = b.Add(st, t);
    st = Sel(b, tail_done, st, st2);
    Value small = b.Compare(b.Abs(b.Div(t, st)), C(b, q, kMachEp), kLT);
    tail_done = b.Or(tail_done, small);
    k = b.Add(k, one);
    aa = b.Mul(aa, b.Add(xk, k));
    bt = b.Div(bt, w);
    k = b.Add(k, one);
  }
  Value r = Sel(b, done, s, st);
  // q <= 0: poles at the non-positive integers.
  Value pole = b.And(b.Compare(q, zero, kLE), b.Compare(q, b.Floor(q), kEQ));
  return Sel(b, pole, C(b, q, kInf), r);
}

Value Polygamma(Builder& b, int64_t n, const Value& x, bool float_angle) {
  if (n == 0) return Digamma(b, x, false);  // CPU's float digamma reflects in double
  if (n == 1) return Trigamma(b, x, float_angle);
  double fact = std::exp(std::lgamma(static_cast<double>(n) + 1.0));
  double sign = (n % 2) ? 1.0 : -1.0;
  return b.Mul(C(b, x, sign * fact), Zeta(b, static_cast<double>(n + 1), x));
}

template <int kWhich>  // 0 lgamma, 1 digamma
std::vector<Value> GammaUnary(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self"}, true, /*wide=*/true);
  Value x = o.In("self");
  return {o.Done(kWhich == 0 ? Lgamma(ctx.b, x) : Digamma(ctx.b, x, false))};
}

std::vector<Value> LowerPolygamma(LoweringContext& ctx) {
  const int64_t n = ctx.int_arg("n");
  if (n < 0) throw LoweringError(ctx.op_name() + ": polygamma(n, x) does not support negative n.");
  Operands o = MakeOps(ctx, {"self"}, true, /*wide=*/true);
  return {o.Done(Polygamma(ctx.b, n, o.In("self"), o.common != at::kDouble))};
}

// --- logaddexp / logaddexp2 / hypot / nextafter / sinc / trace -----------

void RequireFloat(const LoweringContext& ctx, ScalarType t) {
  if (!IsFloat(t))
    throw LoweringError(ctx.op_name() + ": not implemented for '" + std::string(c10::toString(t)) + "'");
}

// logaddexp(a, b) = a if a, b are the same infinity, else
// max(a, b) + log1p(exp(-|a - b|)); logaddexp2 the same in base 2:
// max + log1p(exp2(-|a - b|)) / ln 2 (CPU's formulas; bf16/f16 computed in
// f32 and rounded once). Floating dtypes only, as CPU.
template <bool kBase2>
std::vector<Value> LowerLogAddExp(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self", "other"}, false);
  RequireFloat(ctx, o.common);
  Builder& b = ctx.b;
  Value x = o.In("self"), y = o.In("other");
  Value m = MaxPropagateNaN(b, x, y);
  Value nd = b.Neg(b.Abs(b.Sub(x, y)));
  Value t = kBase2 ? b.Div(b.Unary("stablehlo.log_plus_one", b.Pow(o.C(2), nd)), o.C(0.69314718055994530942))
                   : b.Unary("stablehlo.log_plus_one", b.Exp(nd));
  Value r = b.Add(m, t);
  Value same_inf = b.And(b.Compare(b.Abs(x), o.C(kInf), kEQ), b.Compare(x, y, kEQ));
  return {o.Done(Sel(b, same_inf, x, r))};
}

// hypot(a, b) = m sqrt(1 + (n / m)^2), m = max(|a|, |b|), n = min (no
// overflow for large finite inputs); 0 when both are 0; +inf when either is
// infinite (even with a NaN, as std::hypot). Computed in f64 for
// float/bf16/f16 (then correctly rounded bar double rounding), f64 as is.
std::vector<Value> LowerHypot(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self", "other"}, false, /*wide=*/true);
  RequireFloat(ctx, o.common);
  Builder& b = ctx.b;
  Value ax = b.Abs(o.In("self")), ay = b.Abs(o.In("other"));
  Value m = MaxPropagateNaN(b, ax, ay), n = MinPropagateNaN(b, ax, ay);
  Value r = b.Div(n, m);
  Value h = b.Mul(m, b.Sqrt(b.Add(o.C(1), b.Mul(r, r))));
  h = Sel(b, b.Compare(m, o.C(0), kEQ), o.C(0), h);
  Value inf = b.Or(b.Compare(ax, o.C(kInf), kEQ), b.Compare(ay, o.C(kInf), kEQ));
  return {o.Done(Sel(b, inf, o.C(kInf), h))};
}

// nextafter(x, y): the next representable value after x towards y, in the
// common dtype's bits (std::nextafter; bf16 as c10's bit version): NaN if
// either is NaN; y if x == y; +-smallest subnormal (y's sign) if x == 0;
// else the bit pattern of x moved by one away from (x < y) == (x > 0) ? 0 :
// towards 0.
std::vector<Value> LowerNextafter(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self", "other"}, false);
  RequireFloat(ctx, o.common);
  o.compute = o.common;
  Builder& b = ctx.b;
  Value x = o.In("self"), y = o.In("other");
  ElementType it;
  int64_t neg_tiny;
  switch (hlo::BitWidth(x.element())) {
    case 16: it = ElementType::kS16; neg_tiny = -32767; break;
    case 32: it = ElementType::kS32; neg_tiny = -2147483647LL; break;
    default: it = ElementType::kS64; neg_tiny = std::numeric_limits<int64_t>::min() + 1; break;
  }
  Value bits = b.BitcastConvert(x, it);
  Value one = ConstLike(b, bits, 1);
  Value zero = o.C(0);
  Value away = b.Compare(b.Compare(x, y, kLT), b.Compare(x, zero, kGT), kEQ);
  Value moved = b.BitcastConvert(Sel(b, away, b.Add(bits, one), b.Sub(bits, one)), x.element());
  Value tiny_pos = b.BitcastConvert(one, x.element());
  Value tiny_neg = b.BitcastConvert(BroadcastTo(b, b.ConstantInt(TensorType{it, {}}, neg_tiny), o.sizes), x.element());
  Value r = Sel(b, b.Compare(x, zero, kEQ), Sel(b, b.Compare(y, zero, kGT), tiny_pos, tiny_neg), moved);
  r = Sel(b, b.Compare(x, y, kEQ), y, r);
  return {Sel(b, b.Or(IsNan(b, x), IsNan(b, y)), b.Add(x, y), r)};
}

// sinc(x) = 1 at 0, else sin(pi x) / (pi x) with pi x computed in the op-math
// dtype as CPU (f32 for float/bf16/f16); integers promote to the default
// float dtype.
std::vector<Value> LowerSinc(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self"}, true);
  Builder& b = ctx.b;
  Value x = o.In("self");
  Value px = b.Mul(o.C(kPi), x);
  Value r = b.Div(b.Unary("stablehlo.sine", px), px);
  return {o.Done(Sel(b, b.Compare(x, o.C(0), kEQ), o.C(1), r))};
}

// trace(self): sum of the main diagonal of a 2-D tensor (n, m) -> 0-d;
// integer inputs give int64 (the meta kernel's dtype), bf16/f16
// accumulate in f32; bool and complex run on the CPU (which rejects bool).
std::vector<Value> LowerTrace(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const OutputSpec& out = ctx.outputs.at(0);
  Value x = ctx.tensor("self");
  if (x.rank() != 2) throw LoweringError(ctx.op_name() + ": trace: expected a matrix, but got tensor with dim " + std::to_string(x.rank()));
  const LoweredArg& a = ctx.arg("self");
  if (at::isComplexType(a.dtype) || a.dtype == at::kBool)
    throw LoweringError(ctx.op_name() + ": not implemented for '" + std::string(c10::toString(a.dtype)) + "'");
  ScalarType acc = IsFloat(out.dtype) ? OpMathType(out.dtype) : out.dtype;
  Value v = Cast(b, x, acc);
  TensorType it{ElementType::kS64, x.dims()};
  Value diag = b.Compare(b.Iota(it, 0), b.Iota(it, 1), kEQ);
  Value masked = Sel(b, diag, v, ConstLike(b, v, 0));
  return {Out(b, ReduceSum(b, masked, std::vector<int64_t>{0, 1}, false), out)};
}

// i0(x) and special_i1(x), the modified Bessel functions of orders 0 and 1,
// in f64 (rounded once; integers promote to the default float dtype). i0 is
// even, i1 odd (sign(x) i1(|x|)); a = |x|:
//  - a <= 30: the power series sum_k (a^2/4)^k / (k! (k + nu)!) (times a/2
//    for nu = 1; Abramowitz & Stegun 9.6.10; positive terms, 90 of them: the
//    last is < 1e-17 of the sum at 30);
//  - a > 30: the asymptotic expansion e^a / sqrt(2 pi a) * sum_k t_k,
//    t_k = t_(k-1) ((2k - 1)^2 - 4 nu^2) / (8 k a) (A&S 9.7.1; 20 terms, the
//    truncation error is ~1e-20 relative at 30), with e^a split in two
//    halves so that finite results do not overflow early.
// As CPU (Cephes, which multiplies by exp(|x|) in the op-math type): inf
// where that overflows (|x| > log(FLT_MAX) for float/bf16/f16, log(DBL_MAX)
// for double), NaN at +-inf (inf / inf), NaN kept.
template <int kNu>
std::vector<Value> LowerBesselI(LoweringContext& ctx) {
  Operands o = MakeOps(ctx, {"self"}, true, /*wide=*/true);
  o.compute = at::kDouble;
  Builder& b = ctx.b;
  Value x = o.In("self");
  Value a = b.Abs(x);
  Value small_a = Sel(b, b.Compare(a, o.C(30), kLE), a, o.C(0));
  Value q = b.Mul(b.Mul(small_a, small_a), o.C(0.25));
  Value term = o.C(1), series = o.C(1);
  for (int k = 1; k <= 90; ++k) {
    term = b.Mul(term, b.Mul(q, o.C(1.0 / (static_cast<double>(k) * (k + kNu)))));
    series = b.Add(series, term);
  }
  if (kNu == 1) series = b.Mul(series, b.Mul(small_a, o.C(0.5)));
  Value big_a = Sel(b, b.Compare(a, o.C(30), kGT), a, o.C(31));
  Value t = o.C(1), asym = o.C(1);
  for (int k = 1; k <= 20; ++k) {
    const double c = ((2.0 * k - 1) * (2.0 * k - 1) - 4.0 * kNu * kNu) / (8.0 * k);
    t = b.Div(b.Mul(t, o.C(c)), big_a);
    asym = b.Add(asym, t);
  }
  Value half = b.Exp(b.Mul(big_a, o.C(0.5)));
  Value large = b.Mul(half, b.Mul(half, b.Div(asym, b.Sqrt(b.Mul(big_a, o.C(2 * kPi))))));
  Value r = Sel(b, b.Compare(a, o.C(30), kLE), series, large);
  const double overflow = o.common == at::kDouble ? 709.782712893384 : 88.72283905206835;
  r = Sel(b, b.Compare(a, o.C(overflow), kGT), o.C(kInf), r);
  r = Sel(b, b.Compare(a, o.C(kInf), kEQ), o.C(kNaN), r);
  if (kNu == 1) r = Sel(b, b.Compare(x, o.C(0), kLT), b.Neg(r), r);
  return {o.Done(Sel(b, IsNan(b, a), a, r))};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"xlogy", XLogY<false>},
    {"special_xlog1py", XLogY<true>},
    {"special_entr", LowerEntr},
    {"copysign", LowerCopysign},
    {"heaviside", LowerHeaviside},
    {"isposinf", IsSignedInf<true>},
    {"isneginf", IsSignedInf<false>},
    {"logit", LowerLogit},
    {"logit_backward", LowerLogitBackward},
    {"lgamma", GammaUnary<0>},
    {"digamma", GammaUnary<1>},
    {"polygamma", LowerPolygamma},
    {"logaddexp", LowerLogAddExp<false>},
    {"logaddexp2", LowerLogAddExp<true>},
    {"hypot", LowerHypot},
    {"nextafter", LowerNextafter},
    {"sinc", LowerSinc},
    {"trace", LowerTrace},
    {"i0", LowerBesselI<0>},
    {"special_i1", LowerBesselI<1>},
});

}  // namespace torch_tpu::lowering
