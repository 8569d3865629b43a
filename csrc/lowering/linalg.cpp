// Matrix products: mm, bmm, addmm, baddbmm, addbmm, addmv, mv, dot.
//
// bf16/f16 operands are widened to f32 (exact) and contracted with an f32
// accumulator; the result, with beta*self + alpha*product computed in f32,
// is rounded once, as PyTorch's CPU kernels do. beta == 0 ignores self
// entirely (NaN/Inf in self do not propagate), as in PyTorch.
#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;
using hlo::DotDims;

// Every product here also contracts complex operands (dot_general does not
// conjugate, as PyTorch's mm/bmm/dot do not; vdot is a composite over conj).
const LoweringTraits kComplex{.complex = true};

// Accumulation dtype of a product producing `out`.
at::ScalarType AccType(at::ScalarType out) {
  if (out == at::kBool) return at::kLong;
  return OpMathType(out);
}

// Contracts in the accumulation dtype. bf16/f16 operands of the same type
// stay narrow with an f32 result type (exact products, f32 accumulation: what
// PyTorch's CPU kernels compute, and what MXU-style hardware does natively).
Value Dot(Builder& b, const Value& lhs, const Value& rhs, const DotDims& dims, at::ScalarType acc) {
  const ElementType e = ToElementType(acc);
  if (lhs.element() == rhs.element() && e == ElementType::kF32 &&
      (lhs.element() == ElementType::kBF16 || lhs.element() == ElementType::kF16))
    return b.DotGeneral(lhs, rhs, dims, e);
  Value l = Cast(b, lhs, acc), r = Cast(b, rhs, acc);
  return b.DotGeneral(l, r, dims, e);
}

// beta * self + alpha * product, both optional scalars (default 1).
Value AddScaled(LoweringContext& ctx, const Value& product, at::ScalarType acc) {
  auto& b = ctx.b;
  Value p = product;
  if (ctx.has("alpha")) {
    Value alpha = Cast(b, ctx.value("alpha"), acc);
    p = b.Mul(p, BroadcastTo(b, alpha, p.dims()));
  }
  Value self = Prepare(b, ctx.tensor("self"), acc, p.dims());
  if (ctx.has("beta")) {
    Value beta = Cast(b, ctx.value("beta"), acc);
    Value bb = BroadcastTo(b, beta, p.dims());
    Value zero = ConstLike(b, p, 0);
    Value is_zero = b.Compare(bb, zero, CompareDirection::kEQ);
    self = b.Select(is_zero, zero, b.Mul(self, bb));
  }
  return b.Add(self, p);
}

DotDims MatMulDims() { return DotDims{{}, {}, {1}, {0}}; }
DotDims BatchMatMulDims() { return DotDims{{0}, {0}, {2}, {1}}; }

std::vector<Value> LowerMm(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value r = Dot(ctx.b, ctx.tensor("self"), ctx.tensor("mat2"), MatMulDims(), acc);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

std::vector<Value> LowerBmm(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value r = Dot(ctx.b, ctx.tensor("self"), ctx.tensor("mat2"), BatchMatMulDims(), acc);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

std::vector<Value> LowerAddmm(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value p = Dot(ctx.b, ctx.tensor("mat1"), ctx.tensor("mat2"), MatMulDims(), acc);
  return {Fit(ctx.b, Cast(ctx.b, AddScaled(ctx, p, acc), out.dtype), out.sizes)};
}

std::vector<Value> LowerBaddbmm(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value p = Dot(ctx.b, ctx.tensor("batch1"), ctx.tensor("batch2"), BatchMatMulDims(), acc);
  return {Fit(ctx.b, Cast(ctx.b, AddScaled(ctx, p, acc), out.dtype), out.sizes)};
}

std::vector<Value> LowerAddbmm(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  // sum over the batch of batch1[i] @ batch2[i]: contract batch and inner dims.
  Value p = Dot(ctx.b, ctx.tensor("batch1"), ctx.tensor("batch2"), DotDims{{}, {}, {0, 2}, {0, 1}}, acc);
  return {Fit(ctx.b, Cast(ctx.b, AddScaled(ctx, p, acc), out.dtype), out.sizes)};
}

std::vector<Value> LowerAddmv(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value p = Dot(ctx.b, ctx.tensor("mat"), ctx.tensor("vec"), DotDims{{}, {}, {1}, {0}}, acc);
  return {Fit(ctx.b, Cast(ctx.b, AddScaled(ctx, p, acc), out.dtype), out.sizes)};
}

std::vector<Value> LowerMv(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value r = Dot(ctx.b, ctx.tensor("self"), ctx.tensor("vec"), DotDims{{}, {}, {1}, {0}}, acc);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

std::vector<Value> LowerDot(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value r = Dot(ctx.b, ctx.tensor("self"), ctx.tensor("tensor"), DotDims{{}, {}, {0}, {0}}, acc);
  return {Fit(ctx.b, Cast(ctx.b, r, out.dtype), out.sizes)};
}

// vdot(self, other) = sum(conj(self) * other) over 1-d tensors (CPU's
// BLAS dotc); the plain dot of real tensors.
std::vector<Value> LowerVdot(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = AccType(out.dtype);
  Value x = Cast(b, ctx.tensor("self"), acc);
  if (hlo::IsComplex(x.element())) x = b.Complex(b.Real(x), b.Neg(b.Imag(x)));
  Value r = Dot(b, x, ctx.tensor("other"), DotDims{{}, {}, {0}, {0}}, acc);
  return {Fit(b, Cast(b, r, out.dtype), out.sizes)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"mm", LowerMm, kComplex},
    {"bmm", LowerBmm, kComplex},
    {"addmm", LowerAddmm, kComplex},
    {"baddbmm", LowerBaddbmm, kComplex},
    {"addbmm", LowerAddbmm, kComplex},
    {"addmv", LowerAddmv, kComplex},
    {"mv", LowerMv, kComplex},
    {"dot", LowerDot, kComplex},
    {"vdot", LowerVdot, kComplex},
});

}  // namespace torch_tpu::lowering
