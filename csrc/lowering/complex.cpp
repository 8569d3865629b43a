// Lowerings specific to complex numbers: conj_physical, angle, polar,
// complex (view_as_real/view_as_complex/.real/.imag are views: direct
// kernels in csrc/aten/kernels.cpp over the storage reinterpretation of
// ReinterpretFlat). Semantics follow PyTorch's CPU kernels
// (aten/src/ATen/native/cpu/UnaryOpsKernel.cpp, TensorFactories.cpp).
#include <cmath>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

const LoweringTraits kComplex{.complex = true};

// conj_physical(self): (re, -im) for complex self; a copy of real self.
std::vector<Value> LowerConjPhysical(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const Value& x = ctx.tensor("self");
  if (!hlo::IsComplex(x.element())) return {x};
  return {b.Complex(b.Real(x), b.Neg(b.Imag(x)))};
}

// angle(self): atan2(im, re) for complex self (float result); for real self
// pi where x < 0, 0 elsewhere, NaN kept (angle_impl); integers compute in
// the default float dtype (the meta kernel gives the output dtype).
std::vector<Value> LowerAngle(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const Value& x = ctx.tensor("self");
  const OutputSpec& out = ctx.outputs.at(0);
  if (hlo::IsComplex(x.element())) return {b.Binary("stablehlo.atan2", b.Imag(x), b.Real(x))};
  Value xf = Cast(b, x, OpMathType(out.dtype));
  Value zero = ConstLike(b, xf, 0);
  Value r = b.Select(b.Compare(xf, zero, hlo::CompareDirection::kLT), ConstLike(b, xf, M_PI), zero);
  Value nan = b.Compare(xf, xf, hlo::CompareDirection::kNE);
  return {b.Select(nan, xf, r)};
}

// polar(abs, angle) = abs * (cos(angle) + i sin(angle)); float/double inputs
// of one dtype (the meta kernel checks), complex result.
std::vector<Value> LowerPolar(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const OutputSpec& out = ctx.outputs.at(0);
  const ElementType part = hlo::ComplexPart(ToElementType(out.dtype));
  Value r = Fit(b, CastElement(b, ctx.tensor("abs"), part), out.sizes);
  Value t = Fit(b, CastElement(b, ctx.tensor("angle"), part), out.sizes);
  Value re = b.Mul(r, b.Unary("stablehlo.cosine", t));
  Value im = b.Mul(r, b.Unary("stablehlo.sine", t));
  return {b.Complex(re, im)};
}

// complex(real, imag): broadcast, same float dtype (the meta kernel checks).
std::vector<Value> LowerComplex(LoweringContext& ctx) {
  Builder& b = ctx.b;
  const OutputSpec& out = ctx.outputs.at(0);
  const ElementType part = hlo::ComplexPart(ToElementType(out.dtype));
  // CPU's checks (complex_check_dtype, aten/src/ATen/native/TensorFactories.cpp).
  const at::ScalarType real_t = ctx.arg("real").dtype, imag_t = ctx.arg("imag").dtype;
  TORCH_CHECK(real_t == at::kHalf || real_t == at::kFloat || real_t == at::kDouble,
              "Expected both inputs to be Half, Float or Double tensors but got ", real_t, " and ", imag_t);
  TORCH_CHECK(real_t == imag_t, "Expected object of scalar type ", real_t, " but got scalar type ", imag_t,
              " for second argument");
  Value re = Fit(b, CastElement(b, ctx.tensor("real"), part), out.sizes);
  Value im = Fit(b, CastElement(b, ctx.tensor("imag"), part), out.sizes);
  return {b.Complex(re, im)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"conj_physical", LowerConjPhysical, kComplex},
    {"_conj_physical", LowerConjPhysical, kComplex},
    {"angle", LowerAngle, kComplex},
    {"polar", LowerPolar, kComplex},
    {"complex", LowerComplex, kComplex},
});

}  // namespace torch_tpu::lowering
