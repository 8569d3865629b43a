#include "runtime/cpp_meta.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/cpu/mixed_data_type.h>
#include <ATen/native/layer_norm.h>
#include <ATen/ops/_log_softmax_meta_dispatch.h>
#include <ATen/ops/_softmax_meta_dispatch.h>
#include <ATen/ops/add_meta_dispatch.h>
#include <ATen/ops/addmm_meta_dispatch.h>
#include <ATen/ops/all_meta_dispatch.h>
#include <ATen/ops/amax_meta_dispatch.h>
#include <ATen/ops/any_meta_dispatch.h>
#include <ATen/ops/argmax_meta_dispatch.h>
#include <ATen/ops/bitwise_and_meta_dispatch.h>
#include <ATen/ops/bitwise_not_meta_dispatch.h>
#include <ATen/ops/bitwise_or_meta_dispatch.h>
#include <ATen/ops/bmm_meta_dispatch.h>
#include <ATen/ops/cat_meta_dispatch.h>
#include <ATen/ops/clamp_meta_dispatch.h>
#include <ATen/ops/clamp_min_meta_dispatch.h>
#include <ATen/ops/clamp_max_meta_dispatch.h>
#include <ATen/ops/erf_meta_dispatch.h>
#include <ATen/ops/log_meta_dispatch.h>
#include <ATen/ops/log1p_meta_dispatch.h>
#include <ATen/ops/log2_meta_dispatch.h>
#include <ATen/ops/log10_meta_dispatch.h>
#include <ATen/ops/floor_meta_dispatch.h>
#include <ATen/ops/ceil_meta_dispatch.h>
#include <ATen/ops/round_meta_dispatch.h>
#include <ATen/ops/trunc_meta_dispatch.h>
#include <ATen/ops/sign_meta_dispatch.h>
#include <ATen/ops/reciprocal_meta_dispatch.h>
#include <ATen/ops/expm1_meta_dispatch.h>
#include <ATen/ops/exp2_meta_dispatch.h>
#include <ATen/ops/cos_meta_dispatch.h>
#include <ATen/ops/cumsum_meta_dispatch.h>
#include <ATen/ops/div_meta_dispatch.h>
#include <ATen/ops/eq_meta_dispatch.h>
#include <ATen/ops/exp_meta_dispatch.h>
#include <ATen/ops/ge_meta_dispatch.h>
#include <ATen/ops/gelu_meta_dispatch.h>
#include <ATen/ops/gt_meta_dispatch.h>
#include <ATen/ops/isneginf_meta_dispatch.h>
#include <ATen/ops/le_meta_dispatch.h>
#include <ATen/ops/lt_meta_dispatch.h>
#include <ATen/ops/maximum_meta_dispatch.h>
#include <ATen/ops/mean_meta_dispatch.h>
#include <ATen/ops/minimum_meta_dispatch.h>
#include <ATen/ops/mm_meta_dispatch.h>
#include <ATen/ops/mul_meta_dispatch.h>
#include <ATen/ops/ne_meta_dispatch.h>
#include <ATen/ops/neg_meta_dispatch.h>
#include <ATen/ops/pow_meta_dispatch.h>
#include <ATen/ops/rsqrt_meta_dispatch.h>
#include <ATen/ops/sigmoid_meta_dispatch.h>
#include <ATen/ops/silu_meta_dispatch.h>
#include <ATen/ops/sin_meta_dispatch.h>
#include <ATen/ops/sqrt_meta_dispatch.h>
#include <ATen/ops/sub_meta_dispatch.h>
#include <ATen/ops/sum_meta_dispatch.h>
#include <ATen/ops/tanh_meta_dispatch.h>
#include <ATen/ops/tril_meta_dispatch.h>
#include <ATen/ops/triu_meta_dispatch.h>

#include <ATen/ops/acos_meta_dispatch.h>
#include <ATen/ops/acosh_meta_dispatch.h>
#include <ATen/ops/asin_meta_dispatch.h>
#include <ATen/ops/asinh_meta_dispatch.h>
#include <ATen/ops/atan_meta_dispatch.h>
#include <ATen/ops/atan2_meta_dispatch.h>
#include <ATen/ops/atanh_meta_dispatch.h>
#include <ATen/ops/bitwise_xor_meta_dispatch.h>
#include <ATen/ops/copysign_meta_dispatch.h>
#include <ATen/ops/cosh_meta_dispatch.h>
#include <ATen/ops/cumprod_meta_dispatch.h>
#include <ATen/ops/digamma_meta_dispatch.h>
#include <ATen/ops/elu_meta_dispatch.h>
#include <ATen/ops/erfinv_meta_dispatch.h>
#include <ATen/ops/fmax_meta_dispatch.h>
#include <ATen/ops/fmin_meta_dispatch.h>
#include <ATen/ops/fmod_meta_dispatch.h>
#include <ATen/ops/frac_meta_dispatch.h>
#include <ATen/ops/gelu_backward_meta_dispatch.h>
#include <ATen/ops/hardsigmoid_meta_dispatch.h>
#include <ATen/ops/heaviside_meta_dispatch.h>
#include <ATen/ops/hypot_meta_dispatch.h>
#include <ATen/ops/i0_meta_dispatch.h>
#include <ATen/ops/leaky_relu_meta_dispatch.h>
#include <ATen/ops/linalg_vector_norm_meta_dispatch.h>
#include <ATen/ops/lgamma_meta_dispatch.h>
#include <ATen/ops/logaddexp_meta_dispatch.h>
#include <ATen/ops/logaddexp2_meta_dispatch.h>
#include <ATen/ops/mish_meta_dispatch.h>
#include <ATen/ops/mse_loss_meta_dispatch.h>
#include <ATen/ops/nextafter_meta_dispatch.h>
#include <ATen/ops/nll_loss_forward_meta_dispatch.h>
#include <ATen/ops/remainder_meta_dispatch.h>
#include <ATen/ops/sgn_meta_dispatch.h>
#include <ATen/ops/sigmoid_backward_meta_dispatch.h>
#include <ATen/ops/silu_backward_meta_dispatch.h>
#include <ATen/ops/sinc_meta_dispatch.h>
#include <ATen/ops/sinh_meta_dispatch.h>
#include <ATen/ops/softplus_meta_dispatch.h>
#include <ATen/ops/tan_meta_dispatch.h>
#include <ATen/ops/tanh_backward_meta_dispatch.h>
#include <ATen/ops/threshold_backward_meta_dispatch.h>
#include <ATen/ops/xlogy_meta_dispatch.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/env.h"

namespace torch_tpu::runtime {
namespace {

using Stack = torch::jit::Stack;

const at::Tensor& T(const Stack& s, size_t i) { return s[i].toTensor(); }
at::Scalar S(const Stack& s, size_t i) { return s[i].toScalar(); }
std::optional<at::Tensor> OptT(const Stack& s, size_t i) {
  if (s[i].isNone()) return std::nullopt;
  return s[i].toTensor();
}
std::optional<at::Scalar> OptS(const Stack& s, size_t i) {
  if (s[i].isNone()) return std::nullopt;
  return S(s, i);
}
std::optional<at::ScalarType> Dtype(const Stack& s, size_t i) {
  if (s[i].isNone()) return std::nullopt;
  return s[i].toScalarType();
}
// The result replaces the arguments (a boxed call's stack discipline).
bool Ret(Stack& s, at::Tensor r) {
  s.clear();
  s.emplace_back(std::move(r));
  return true;
}
// Several results, in the schema's order.
bool Ret(Stack& s, std::initializer_list<at::Tensor> rs) {
  s.clear();
  for (const at::Tensor& r : rs) s.emplace_back(r);
  return true;
}

// A Scalar operand as ATen's .Scalar overloads pass it to their .Tensor
// form (add.Scalar -> add(self, wrapped_scalar_tensor(other))): a CPU 0-d
// wrapped number, which type promotion treats as a Python scalar.
at::Tensor Wrapped(const Stack& s, size_t i) { return at::native::wrapped_scalar_tensor(S(s, i)); }

// Elementwise ops (TensorIterator) and the rest, by schema.
#define UNARY(fn) [](Stack& s) { return Ret(s, at::meta::fn(T(s, 0))); }
#define BINARY(fn) [](Stack& s) { return Ret(s, at::meta::fn(T(s, 0), T(s, 1))); }
#define BINARY_SCALAR(fn) [](Stack& s) { return Ret(s, at::meta::fn(T(s, 0), S(s, 1))); }
#define BINARY_ALPHA(fn) [](Stack& s) { return Ret(s, at::meta::fn(T(s, 0), T(s, 1), S(s, 2))); }
#define WRAPPED(fn) [](Stack& s) { return Ret(s, at::meta::fn(T(s, 0), Wrapped(s, 1))); }
#define WRAPPED_ALPHA(fn) [](Stack& s) { return Ret(s, at::meta::fn(T(s, 0), Wrapped(s, 1), S(s, 2))); }
#define INPLACE_UNARY(fn) [](Stack& s) { at::Tensor self = T(s, 0); at::meta::fn(self); return Ret(s, self); }
#define INPLACE_BINARY(fn) \
  [](Stack& s) { at::Tensor self = T(s, 0); at::meta::fn(self, T(s, 1)); return Ret(s, self); }
#define INPLACE_BINARY_ALPHA(fn) \
  [](Stack& s) { at::Tensor self = T(s, 0); at::meta::fn(self, T(s, 1), S(s, 2)); return Ret(s, self); }

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out,
// mean, rstd), as CPU's layer_norm_cpu (aten/src/ATen/native/layer_norm.cpp)
// builds them: its dtype checks (a parameter of another dtype than the
// input is CPU's "mixed dtype" error unless the input is bfloat16/half and
// the parameters float: raised here, the call runs CPU's kernel, which
// raises it; review, session 22: an int64 weight gave values) and argument
// checks (_check_layer_norm_inputs), out contiguous like the input, mean
// and rstd of the input's dtype shaped input.shape[:axis] + [1] *
// len(normalized_shape). float32/float64 with weight and bias of that dtype
// only; other dtypes decline (CPU keeps reduced-precision statistics in
// float where the parameters are float).
bool NativeLayerNorm(Stack& s) {
  const at::Tensor& input = T(s, 0);
  const std::vector<int64_t> shape = s[1].toIntVector();
  const at::Tensor weight = s[2].isNone() ? at::Tensor() : T(s, 2);
  const at::Tensor bias = s[3].isNone() ? at::Tensor() : T(s, 3);
  const at::ScalarType dtype = input.scalar_type();
  if (at::native::is_mixed_type(input, weight, bias)) at::native::check_mixed_data_type(input, weight, bias);
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  if ((weight.defined() && weight.scalar_type() != dtype) || (bias.defined() && bias.scalar_type() != dtype))
    return false;
  at::native::_check_layer_norm_inputs(input, shape, weight, bias);
  const int64_t axis = input.dim() - static_cast<int64_t>(shape.size());
  std::vector<int64_t> stat(input.sizes().begin(), input.sizes().begin() + axis);
  stat.resize(static_cast<size_t>(input.dim()), 1);
  const at::TensorOptions options = input.options();
  return Ret(s, {at::empty(input.sizes(), options), at::empty(stat, options), at::empty(stat, options)});
}

// CPU's where_self_out iterator: self and other in their result type
// `type`, `out` (resized by the iterator where it is empty) laid out over
// the three.
at::TensorIterator WhereIterator(const at::Tensor& condition, const at::Tensor& self, const at::Tensor& other,
                                 at::ScalarType type, const at::Tensor& out) {
  const at::Tensor self_ = self.scalar_type() != type ? self.to(type) : self;
  const at::Tensor other_ = other.scalar_type() != type ? other.to(type) : other;
  return at::TensorIteratorConfig()
      .check_all_same_dtype(false)
      .add_output(out)
      .add_const_input(condition)
      .add_input(self_)
      .add_input(other_)
      .build();
}

// where.self(condition, self, other): CPU's where_self_out
// (aten/src/ATen/native/TensorCompare.cpp): self and other in their result
// type, the output laid out by a TensorIterator over the three (broadcast,
// CPU's strides for permuted inputs). A condition that is not bool (uint8:
// CPU warns and converts) declines.
bool Where(Stack& s) {
  const at::Tensor& condition = T(s, 0);
  const at::Tensor& self = T(s, 1);
  const at::Tensor& other = T(s, 2);
  if (condition.scalar_type() != at::kBool) return false;
  const at::ScalarType type = at::result_type(self, other);
  at::Tensor out = at::empty({0}, self.options().dtype(type));  // as CPU's where: the iterator resizes it
  auto iter = WhereIterator(condition, self, other, type, out);
  return Ret(s, iter.output());
}

// where.self_out(condition, self, other, out): CPU's where_self_out, as
// Where into the given out (the iterator resizes an empty one). An out of
// another dtype than self's and other's result type (CPU raises) and a
// condition that is not bool decline. _safe_softmax's C++ body (the
// softmax of scaled_dot_product_attention's math path) reaches it.
bool WhereOut(Stack& s) {
  const at::Tensor& condition = T(s, 0);
  const at::Tensor& self = T(s, 1);
  const at::Tensor& other = T(s, 2);
  at::Tensor out = T(s, 3);
  const at::ScalarType type = at::result_type(self, other);
  if (condition.scalar_type() != at::kBool || out.scalar_type() != type) return false;
  WhereIterator(condition, self, other, type, out);  // resizes out
  return Ret(s, out);
}

// relu: CPU's (aten/src/ATen/native/Activation.cpp) refuses bool, then is
// clamp_min(self, 0).
bool Relu(Stack& s) {
  TORCH_CHECK(T(s, 0).scalar_type() != at::kBool, "Boolean inputs not supported for relu");
  return Ret(s, at::meta::clamp_min(T(s, 0), 0));
}

// abs of a real, non-bool tensor: a unary TensorIterator op keeping the
// dtype (CPU's unary_op_impl_with_complex_to_float), as sign's meta
// builds it; complex (a real result) and bool decline.
bool Abs(Stack& s) {
  const at::Tensor& self = T(s, 0);
  if (self.is_complex() || self.scalar_type() == at::kBool) return false;
  return Ret(s, at::meta::sign(self));
}

// masked_fill.Scalar(self, mask, value): ATen's composite
// (aten/src/ATen/native/TensorAdvancedIndexing.cpp) expands self to the
// broadcast shape (infer_size raises CPU's error where they do not
// broadcast), clones it contiguous and runs masked_fill_, which takes only
// a bool mask (CPU's message). A value of a higher kind than self's dtype
// (a float into an integer tensor, a number into a bool one) declines: the
// Python meta kernel's checks stand there.
bool MaskedFill(Stack& s) {
  const at::Tensor& self = T(s, 0);
  const at::Tensor& mask = T(s, 1);
  const at::Scalar value = S(s, 2);
  const at::ScalarType dtype = self.scalar_type();
  if (!at::isFloatingType(dtype) && !at::isComplexType(dtype) && (value.isFloatingPoint() || value.isComplex()))
    return false;
  if (dtype == at::kBool && !value.isBoolean()) return false;
  if (value.isComplex() && !at::isComplexType(dtype)) return false;
  TORCH_CHECK(mask.scalar_type() == at::kBool, "masked_fill_ only supports boolean masks, but got mask with dtype ",
              mask.scalar_type());
  const std::vector<int64_t> shape = at::infer_size(self.sizes(), mask.sizes());
  return Ret(s, at::empty(shape, self.options()));
}

// An int[1]? argument: its values, kept alive for the OptionalIntArrayRef
// (ref()) that ATen's meta functions take.
struct OptDims {
  std::optional<std::vector<int64_t>> dims;
  explicit OptDims(const c10::IValue& v) {
    if (!v.isNone()) dims = v.toIntVector();
  }
  at::OptionalIntArrayRef ref() const {
    return dims ? at::OptionalIntArrayRef(*dims) : at::OptionalIntArrayRef(std::nullopt);
  }
};

// sum.dim_IntList / mean.dim: (self, int[1]? dim, bool keepdim, *, ScalarType? dtype)
template <at::Tensor (*Fn)(const at::Tensor&, at::OptionalIntArrayRef, bool, std::optional<at::ScalarType>)>
bool DimReduce(Stack& s) {
  const OptDims dim(s[1]);
  return Ret(s, Fn(T(s, 0), dim.ref(), s[2].toBool(), Dtype(s, 3)));
}

// _softmax/_log_softmax(self, dim, half_to_float): the C++ meta function
// does not check self's dtype where half_to_float is set; the Python meta
// kernel (and CUDA's kernel) take only half or bfloat16 then, and CPU's
// kernel none at all. Raised here, the call falls back to the CPU kernel,
// which raises CPU's error (review, session 21: float64 was downcast).
const at::Tensor& HalfToFloat(const Stack& s) {
  const at::Tensor& self = T(s, 0);
  TORCH_CHECK(!s[2].toBool() || self.scalar_type() == at::kHalf || self.scalar_type() == at::kBFloat16,
              "softmax with half_to_float expects a half or bfloat16 input");
  return self;
}

// logical_and/or/xor(self, other): CPU's comparison_op (BinaryOps.cpp): a
// bool result resized by TensorIterator::comparison_op over the two
// (broadcast, promoted to their common dtype for the comparison only).
bool LogicalBinary(Stack& s) {
  at::Tensor out = at::empty({0}, T(s, 0).options().dtype(at::kBool));
  auto iter = at::TensorIterator::comparison_op(out, T(s, 0), T(s, 1));
  return Ret(s, iter.output());
}

// logical_not(self): a bool result resized by a unary TensorIterator that
// does not require equal dtypes (CPU's logical_not_out, UnaryOps.cpp).
bool LogicalNot(Stack& s) {
  at::Tensor out = at::empty({0}, T(s, 0).options().dtype(at::kBool));
  auto iter = at::TensorIteratorConfig().check_all_same_dtype(false).add_output(out).add_const_input(T(s, 0)).build();
  return Ret(s, iter.output());
}

// empty_like(self)'s layout (TensorFactories.cpp, preserve_format): self's
// strides where it is non-overlapping and dense, else its suggested memory
// format. at::empty_like on a meta tensor is torch._refs' Python kernel,
// whose first call imports sympy (~0.25 s).
at::Tensor EmptyLike(const at::Tensor& self) {
  if (self.is_non_overlapping_and_dense()) return at::empty_strided(self.sizes(), self.strides(), self.options());
  return at::empty(self.sizes(), self.options().memory_format(self.suggest_memory_format()));
}

// hardtanh(self, min_val, max_val) of a floating tensor: CPU's hardtanh
// (Activation.cpp) is clamp_out into empty_like(self) (EmptyLike). Bool
// (CPU raises) and integer inputs (CPU converts and checks the limits)
// decline: the Python meta kernel's checks stand there.
bool Hardtanh(Stack& s) {
  const at::Tensor& self = T(s, 0);
  if (!at::isFloatingType(self.scalar_type())) return false;
  return Ret(s, EmptyLike(self));
}

// native_dropout(input, p, train?) of a non-empty floating tensor, p in
// [0, 1]: CPU's native_dropout_cpu (Dropout.cpp) returns the output and a
// bool mask, both laid out as empty_like(input) (checked against CPU:
// dense, transposed and channels_last inputs keep their strides, train or
// not). An empty input (CPU returns the input itself and a mask of its
// dtype), other dtypes and p outside [0, 1] decline.
bool NativeDropout(Stack& s) {
  const at::Tensor& input = T(s, 0);
  const double p = s[1].toDouble();
  if (!at::isFloatingType(input.scalar_type()) || input.numel() == 0 || !(p >= 0 && p <= 1)) return false;
  return Ret(s, {EmptyLike(input), EmptyLike(input).to(at::kBool)});
}

// clone(self, memory_format?): CPU's clone (TensorFactories.cpp): with
// Preserve (the default), self's strides where it is non-overlapping and
// dense, else empty_like's suggested memory format; another format, an
// empty tensor in it (a format the rank cannot take raises c10's error, as
// on CPU).
bool Clone(Stack& s) {
  const at::Tensor& self = T(s, 0);
  const auto format = s[1].isNone() ? c10::MemoryFormat::Preserve : s[1].toMemoryFormat();
  if (format == c10::MemoryFormat::Preserve) return Ret(s, EmptyLike(self));
  return Ret(s, at::empty(self.sizes(), self.options().memory_format(format)));
}

// fill_.Scalar(self, value): self (CPU fills an expanded tensor too: every
// write is the same value). The value's conversion is checked where the
// call runs (the CPU kernel or ScalarToBytes), as before.
bool FillScalar(Stack& s) { return Ret(s, T(s, 0)); }

// stack(tensors, dim) of contiguous tensors of one dtype and one shape:
// CPU's stack (TensorShape.cpp) is a cat along the new dim, a contiguous
// result of the inputs' dtype shaped as the inputs with len(tensors)
// inserted at dim. Anything else (mixed dtypes or shapes — CPU promotes or
// raises — non-contiguous inputs, an empty list, a bad dim) declines.
bool Stack_(Stack& s) {
  const std::vector<at::Tensor> tensors = s[0].toTensorVector();
  if (tensors.empty()) return false;
  const at::Tensor& first = tensors.front();
  for (const auto& t : tensors)
    if (t.scalar_type() != first.scalar_type() || t.sizes() != first.sizes() || !t.is_contiguous()) return false;
  const int64_t rank = first.dim() + 1;
  int64_t dim = s[1].toInt();
  if (dim < -rank || dim >= rank) return false;
  if (dim < 0) dim += rank;
  std::vector<int64_t> sizes = first.sizes().vec();
  sizes.insert(sizes.begin() + dim, static_cast<int64_t>(tensors.size()));
  return Ret(s, at::empty(sizes, first.options()));
}

// hardswish(self) of a floating tensor: CPU's hardswish (Activation.cpp)
// is a unary TensorIterator op into a result it allocates; other dtypes
// (CPU's kernel raises for them) decline.
bool Hardswish(Stack& s) {
  const at::Tensor& self = T(s, 0);
  if (!at::isFloatingType(self.scalar_type())) return false;
  at::Tensor out;
  auto iter = at::TensorIterator::unary_op(out, self);
  return Ret(s, iter.output());
}

// roll(self, shifts, dims) of a contiguous, non-empty tensor: CPU's roll
// (TensorTransformations.cpp, roll_cpu / roll_common) is a cat of two
// narrowed views per rolled dim (or of the flattened tensor where dims is
// empty): contiguous, self's shape and dtype. Other inputs (a layout the
// cat would keep, an empty tensor, shifts and dims that do not pair, a
// dim out of range, any dim of a 0-d tensor: CPU's messages) decline.
bool Roll(Stack& s) {
  const at::Tensor& self = T(s, 0);
  const std::vector<int64_t> shifts = s[1].toIntVector();
  const std::vector<int64_t> dims = s[2].toIntVector();
  if (!self.is_contiguous() || self.numel() == 0 || shifts.empty()) return false;
  if (dims.empty() ? shifts.size() != 1 : dims.size() != shifts.size()) return false;
  // A 0-d tensor takes no dim at all (CPU: "Dimension specified as 0 but
  // tensor has no dimensions"; the lowering indexes the dim it is given).
  for (int64_t d : dims)
    if (d < -self.dim() || d >= self.dim()) return false;
  return Ret(s, at::empty(self.sizes(), self.options()));
}

// scalar_tensor(s, *, dtype?, layout?, device?, pin_memory?): a 0-d tensor
// of dtype, else the default dtype (ATen's scalar_tensor: at::empty({})
// with the call's options, then filled).
bool ScalarTensor(Stack& s) {
  const at::ScalarType dtype = Dtype(s, 1).value_or(c10::get_default_dtype_as_scalartype());
  return Ret(s, at::empty({}, at::TensorOptions().dtype(dtype).device(c10::kMeta)));
}

// logsumexp(self, dim, keepdim) of a non-empty real tensor: CPU's
// (ReduceOps.cpp) resizes an empty result of self's dtype (the default
// dtype for integer and bool inputs) to the reduced shape, contiguous; the
// shape (and the dims' checks) is amax's structured meta step's. Empty and
// complex inputs decline.
bool Logsumexp(Stack& s) {
  const at::Tensor& self = T(s, 0);
  if (self.numel() == 0 || self.is_complex()) return false;
  const std::vector<int64_t> dims = s[1].toIntVector();
  const at::Tensor reduced = at::meta::amax(self, dims, s[2].toBool());
  const at::ScalarType dtype = at::isIntegralType(self.scalar_type(), /*includeBool=*/true)
                                   ? c10::get_default_dtype_as_scalartype()
                                   : self.scalar_type();
  return Ret(s, at::empty(reduced.sizes(), self.options().dtype(dtype)));
}

// float32, float64, float16 and bfloat16 (not the float8 types, which
// c10::isFloatingType includes and CPU's kernels below reject).
bool IsCpuFloat(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// log_sigmoid_forward(self) -> (output, buffer): CPU's
// log_sigmoid_forward_cpu (Activation.cpp) returns both contiguous, of
// self's shape and dtype, whatever self's layout (the Python meta kernel
// lays them out as empty_like(self): a transposed input gave transposed
// strides). Floating inputs only (CPU raises for the others).
bool LogSigmoidForward(Stack& s) {
  const at::Tensor& self = T(s, 0);
  if (!IsCpuFloat(self.scalar_type())) return false;
  return Ret(s, {at::empty(self.sizes(), self.options()), at::empty(self.sizes(), self.options())});
}

// std/var.correction(self, dim?, *, correction?, keepdim) and
// std_mean/var_mean.correction (the same, two results): CPU's std_var_out
// (ReduceOps.cpp) reduces over `dim` (every dim where it is None or empty),
// contiguous, of self's dtype for a floating self; the shape and the dims'
// checks are amax's structured meta step's (an empty dim list reduces every
// dim there too). Complex inputs (a real result; var_mean's mean stays
// complex), empty and 0-d ones (CPU warns and gives NaN) decline.
template <int kResults>
bool StdVar(Stack& s) {
  const at::Tensor& self = T(s, 0);
  if (!IsCpuFloat(self.scalar_type()) || self.numel() == 0 || self.dim() == 0) return false;
  const std::vector<int64_t> dims = s[1].isNone() ? std::vector<int64_t>{} : s[1].toIntVector();
  const at::Tensor reduced = at::meta::amax(self, dims, s[3].toBool());
  if constexpr (kResults == 1) return Ret(s, at::empty(reduced.sizes(), self.options()));
  return Ret(s, {at::empty(reduced.sizes(), self.options()), at::empty(reduced.sizes(), self.options())});
}

// native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out,
// mean, rstd): CPU's native_group_norm (group_norm.cpp): out laid out as
// the input in its suggested memory format (CPU requires the input
// contiguous in it: F.group_norm makes it so), mean and rstd [N, group] of
// the input's dtype. A floating input with weight and bias of its dtype (or
// none) whose arguments pass CPU's checks (N * C * HxW elements, C
// divisible by group, C-element parameters); anything else declines (a
// bfloat16/half input with float parameters has float statistics on CPU).
bool NativeGroupNorm(Stack& s) {
  const at::Tensor& input = T(s, 0);
  const at::ScalarType dtype = input.scalar_type();
  if (!IsCpuFloat(dtype) || input.dim() < 2 || input.numel() == 0) return false;
  const at::MemoryFormat format = input.suggest_memory_format();
  if (!input.is_contiguous(format)) return false;
  const int64_t n = s[3].toInt(), c = s[4].toInt(), hxw = s[5].toInt(), group = s[6].toInt();
  if (group <= 0 || c % group != 0 || input.size(0) != n || input.size(1) != c || n * c * hxw != input.numel())
    return false;
  for (size_t i : {size_t{1}, size_t{2}}) {
    if (s[i].isNone() || !T(s, i).defined()) continue;  // None, or undefined from a C++ caller
    const at::Tensor& p = T(s, i);
    if (p.scalar_type() != dtype || p.dim() != 1 || p.numel() != c) return false;
  }
  return Ret(s, {at::empty(input.sizes(), input.options().memory_format(format)),
                 at::empty({n, group}, input.options()), at::empty({n, group}, input.options())});
}

const std::unordered_map<std::string, CppMetaKernel>& Table() {
  static const auto* table = new std::unordered_map<std::string, CppMetaKernel>{
      {"aten::add.Tensor", BINARY_ALPHA(add)},
      {"aten::add.Scalar", WRAPPED_ALPHA(add)},
      {"aten::sub.Scalar", WRAPPED_ALPHA(sub)},
      {"aten::mul.Scalar", WRAPPED(mul)},
      {"aten::div.Scalar", WRAPPED(div)},
      {"aten::native_layer_norm", NativeLayerNorm},
      {"aten::masked_fill.Scalar", MaskedFill},
      {"aten::where.self", Where},
      {"aten::where.self_out", WhereOut},
      {"aten::relu", Relu},
      {"aten::abs", Abs},
      {"aten::clamp",
       [](Stack& s) { return Ret(s, at::meta::clamp(T(s, 0), OptS(s, 1), OptS(s, 2))); }},
      {"aten::clamp_min", BINARY_SCALAR(clamp_min)},
      {"aten::clamp_max", BINARY_SCALAR(clamp_max)},
      {"aten::erf", UNARY(erf)},
      {"aten::log", UNARY(log)},
      {"aten::log1p", UNARY(log1p)},
      {"aten::log2", UNARY(log2)},
      {"aten::log10", UNARY(log10)},
      {"aten::floor", UNARY(floor)},
      {"aten::ceil", UNARY(ceil)},
      {"aten::round", UNARY(round)},
      {"aten::trunc", UNARY(trunc)},
      {"aten::sign", UNARY(sign)},
      {"aten::reciprocal", UNARY(reciprocal)},
      {"aten::expm1", UNARY(expm1)},
      {"aten::exp2", UNARY(exp2)},
      {"aten::add_.Tensor", INPLACE_BINARY_ALPHA(add_)},
      {"aten::sub.Tensor", BINARY_ALPHA(sub)},
      {"aten::sub_.Tensor", INPLACE_BINARY_ALPHA(sub_)},
      {"aten::mul.Tensor", BINARY(mul)},
      {"aten::mul_.Tensor", INPLACE_BINARY(mul_)},
      {"aten::div.Tensor", BINARY(div)},
      {"aten::div_.Tensor", INPLACE_BINARY(div_)},
      {"aten::minimum", BINARY(minimum)},
      {"aten::maximum", BINARY(maximum)},
      {"aten::bitwise_and.Tensor", BINARY(bitwise_and)},
      {"aten::bitwise_or.Tensor", BINARY(bitwise_or)},
      {"aten::eq.Tensor", BINARY(eq)},
      {"aten::ne.Tensor", BINARY(ne)},
      {"aten::lt.Tensor", BINARY(lt)},
      {"aten::le.Tensor", BINARY(le)},
      {"aten::gt.Tensor", BINARY(gt)},
      {"aten::ge.Tensor", BINARY(ge)},
      {"aten::eq.Scalar", BINARY_SCALAR(eq)},
      {"aten::ne.Scalar", BINARY_SCALAR(ne)},
      {"aten::lt.Scalar", BINARY_SCALAR(lt)},
      {"aten::le.Scalar", BINARY_SCALAR(le)},
      {"aten::gt.Scalar", BINARY_SCALAR(gt)},
      {"aten::ge.Scalar", BINARY_SCALAR(ge)},
      {"aten::pow.Tensor_Scalar", BINARY_SCALAR(pow)},
      {"aten::pow.Tensor_Tensor", BINARY(pow)},
      {"aten::neg", UNARY(neg)},
      {"aten::isneginf", UNARY(isneginf)},
      {"aten::cos", UNARY(cos)},
      {"aten::sin", UNARY(sin)},
      {"aten::rsqrt", UNARY(rsqrt)},
      {"aten::exp", UNARY(exp)},
      {"aten::sqrt", UNARY(sqrt)},
      {"aten::tanh", UNARY(tanh)},
      {"aten::sigmoid", UNARY(sigmoid)},
      {"aten::silu", UNARY(silu)},
      {"aten::bitwise_not", UNARY(bitwise_not)},
      {"aten::gelu", [](Stack& s) { return Ret(s, at::meta::gelu(T(s, 0), s[1].toStringView())); }},
      {"aten::all", UNARY(all)},
      {"aten::any", UNARY(any)},
      {"aten::all.dim", [](Stack& s) { return Ret(s, at::meta::all(T(s, 0), s[1].toInt(), s[2].toBool())); }},
      {"aten::any.dim", [](Stack& s) { return Ret(s, at::meta::any(T(s, 0), s[1].toInt(), s[2].toBool())); }},
      {"aten::sum.dim_IntList", DimReduce<&at::meta::sum>},
      {"aten::mean.dim", DimReduce<&at::meta::mean>},
      {"aten::amax",
       [](Stack& s) {
         const std::vector<int64_t> dim = s[1].toIntVector();
         return Ret(s, at::meta::amax(T(s, 0), dim, s[2].toBool()));
       }},
      {"aten::argmax",
       [](Stack& s) {
         const std::optional<int64_t> dim = s[1].isNone() ? std::nullopt : std::optional<int64_t>(s[1].toInt());
         return Ret(s, at::meta::argmax(T(s, 0), dim, s[2].toBool()));
       }},
      {"aten::cumsum", [](Stack& s) { return Ret(s, at::meta::cumsum(T(s, 0), s[1].toInt(), Dtype(s, 2))); }},
      {"aten::cat",
       [](Stack& s) {
         const c10::List<at::Tensor> tensors = s[0].toTensorList();
         return Ret(s, at::meta::cat(tensors, s[1].toInt()));
       }},
      {"aten::tril", [](Stack& s) { return Ret(s, at::meta::tril(T(s, 0), s[1].toInt())); }},
      {"aten::triu", [](Stack& s) { return Ret(s, at::meta::triu(T(s, 0), s[1].toInt())); }},
      {"aten::_softmax",
       [](Stack& s) { return Ret(s, at::meta::_softmax(HalfToFloat(s), s[1].toInt(), s[2].toBool())); }},
      {"aten::_log_softmax",
       [](Stack& s) { return Ret(s, at::meta::_log_softmax(HalfToFloat(s), s[1].toInt(), s[2].toBool())); }},
      // Session 24: ops whose Python meta kernel is a torch._refs one (the
      // first call imports torch._dynamo, ~0.9 s), found by calling each on
      // a fresh process's tpu tensors (tests/python/test_cpp_meta.py).
      {"aten::atan", UNARY(atan)},
      {"aten::asin", UNARY(asin)},
      {"aten::acos", UNARY(acos)},
      {"aten::tan", UNARY(tan)},
      {"aten::sinh", UNARY(sinh)},
      {"aten::cosh", UNARY(cosh)},
      {"aten::asinh", UNARY(asinh)},
      {"aten::acosh", UNARY(acosh)},
      {"aten::atanh", UNARY(atanh)},
      {"aten::erfinv", UNARY(erfinv)},
      {"aten::lgamma", UNARY(lgamma)},
      {"aten::digamma", UNARY(digamma)},
      {"aten::frac", UNARY(frac)},
      {"aten::sgn", UNARY(sgn)},
      {"aten::i0", UNARY(i0)},
      {"aten::sinc", UNARY(sinc)},
      {"aten::hardsigmoid", UNARY(hardsigmoid)},
      {"aten::mish", UNARY(mish)},
      {"aten::atan2", BINARY(atan2)},
      {"aten::fmod.Tensor", BINARY(fmod)},
      {"aten::remainder.Tensor", BINARY(remainder)},
      {"aten::hypot", BINARY(hypot)},
      {"aten::logaddexp", BINARY(logaddexp)},
      {"aten::logaddexp2", BINARY(logaddexp2)},
      {"aten::xlogy.Tensor", BINARY(xlogy)},
      {"aten::copysign.Tensor", BINARY(copysign)},
      {"aten::fmax", BINARY(fmax)},
      {"aten::fmin", BINARY(fmin)},
      {"aten::nextafter", BINARY(nextafter)},
      {"aten::heaviside", BINARY(heaviside)},
      {"aten::bitwise_xor.Tensor", BINARY(bitwise_xor)},
      {"aten::tanh_backward", BINARY(tanh_backward)},
      {"aten::sigmoid_backward", BINARY(sigmoid_backward)},
      {"aten::silu_backward", BINARY(silu_backward)},
      {"aten::fmod.Scalar", WRAPPED(fmod)},
      {"aten::remainder.Scalar", WRAPPED(remainder)},
      {"aten::copysign.Scalar", WRAPPED(copysign)},
      {"aten::xlogy.Scalar_Other", WRAPPED(xlogy)},
      {"aten::bitwise_xor.Scalar", WRAPPED(bitwise_xor)},
      {"aten::sigmoid_", INPLACE_UNARY(sigmoid_)},
      {"aten::exp_", INPLACE_UNARY(exp_)},
      {"aten::tanh_", INPLACE_UNARY(tanh_)},
      {"aten::sqrt_", INPLACE_UNARY(sqrt_)},
      {"aten::rsqrt_", INPLACE_UNARY(rsqrt_)},
      {"aten::sin_", INPLACE_UNARY(sin_)},
      {"aten::cos_", INPLACE_UNARY(cos_)},
      {"aten::log_", INPLACE_UNARY(log_)},
      {"aten::neg_", INPLACE_UNARY(neg_)},
      {"aten::erf_", INPLACE_UNARY(erf_)},
      {"aten::log1p_", INPLACE_UNARY(log1p_)},
      {"aten::reciprocal_", INPLACE_UNARY(reciprocal_)},
      {"aten::floor_", INPLACE_UNARY(floor_)},
      {"aten::ceil_", INPLACE_UNARY(ceil_)},
      {"aten::round_", INPLACE_UNARY(round_)},
      {"aten::trunc_", INPLACE_UNARY(trunc_)},
      {"aten::expm1_", INPLACE_UNARY(expm1_)},
      {"aten::softplus", [](Stack& s) { return Ret(s, at::meta::softplus(T(s, 0), S(s, 1), S(s, 2))); }},
      {"aten::elu", [](Stack& s) { return Ret(s, at::meta::elu(T(s, 0), S(s, 1), S(s, 2), S(s, 3))); }},
      {"aten::leaky_relu", BINARY_SCALAR(leaky_relu)},
      {"aten::threshold_backward",
       [](Stack& s) { return Ret(s, at::meta::threshold_backward(T(s, 0), T(s, 1), S(s, 2))); }},
      {"aten::gelu_backward",
       [](Stack& s) { return Ret(s, at::meta::gelu_backward(T(s, 0), T(s, 1), s[2].toStringView())); }},
      {"aten::mse_loss", [](Stack& s) { return Ret(s, at::meta::mse_loss(T(s, 0), T(s, 1), s[2].toInt())); }},
      {"aten::nll_loss_forward",
       [](Stack& s) {
         auto [out, total_weight] =
             at::meta::nll_loss_forward(T(s, 0), T(s, 1), OptT(s, 2), s[3].toInt(), s[4].toInt());
         s.clear();
         s.emplace_back(std::move(out));
         s.emplace_back(std::move(total_weight));
         return true;
       }},
      {"aten::cumprod", [](Stack& s) { return Ret(s, at::meta::cumprod(T(s, 0), s[1].toInt(), Dtype(s, 2))); }},
      // 2 ** t: pow.Scalar is structured (CPU's meta step); rsub is sub with
      // the operands swapped (ATen's rsub kernels: at::sub(other, self, alpha)).
      {"aten::pow.Scalar", [](Stack& s) { return Ret(s, at::meta::pow(S(s, 0), T(s, 1))); }},
      {"aten::rsub.Scalar", [](Stack& s) { return Ret(s, at::meta::sub(Wrapped(s, 1), T(s, 0), S(s, 2))); }},
      {"aten::rsub.Tensor", [](Stack& s) { return Ret(s, at::meta::sub(T(s, 1), T(s, 0), S(s, 2))); }},
      // mean.default: ATen's mean(self, dtype) is mean.dim over every dim.
      {"aten::mean",
       [](Stack& s) { return Ret(s, at::meta::mean(T(s, 0), at::OptionalIntArrayRef(), false, Dtype(s, 1))); }},
      {"aten::clamp.Tensor",
       [](Stack& s) { return Ret(s, at::meta::clamp(T(s, 0), OptT(s, 1), OptT(s, 2))); }},
      {"aten::clamp_",
       [](Stack& s) {
         at::Tensor self = T(s, 0);
         at::meta::clamp_(self, OptS(s, 1), OptS(s, 2));
         return Ret(s, self);
       }},
      // isnan: ATen's kernel is self != self.
      {"aten::isnan", [](Stack& s) { return Ret(s, at::meta::ne(T(s, 0), T(s, 0))); }},
      // Session 26 (each imported torch._dynamo at a fresh process's first call).
      // floor_divide: CPU's kernel is a binary TensorIterator op running
      // div_floor (aten/src/ATen/native/BinaryOps.cpp), as div's "floor" mode;
      // the .Scalar overload wraps its operand. Bool operands decline (the
      // Python meta kernel's checks stand there).
      {"aten::floor_divide",
       [](Stack& s) {
         if (T(s, 0).scalar_type() == at::kBool || T(s, 1).scalar_type() == at::kBool) return false;
         return Ret(s, at::meta::div(T(s, 0), T(s, 1), "floor"));
       }},
      {"aten::floor_divide.Scalar",
       [](Stack& s) {
         if (T(s, 0).scalar_type() == at::kBool || S(s, 1).isBoolean()) return false;
         return Ret(s, at::meta::div(T(s, 0), Wrapped(s, 1), "floor"));
       }},
      // abs_ of a real, non-bool tensor (as Abs); complex (CPU raises: in-place
      // abs of a complex tensor) and bool decline.
      {"aten::abs_",
       [](Stack& s) {
         at::Tensor self = T(s, 0);
         if (self.is_complex() || self.scalar_type() == at::kBool) return false;
         at::meta::sign_(self);
         return Ret(s, self);
       }},
      // linalg_vector_norm(self, ord, dim?, keepdim, *, dtype?): structured
      // (CPU's meta step, its dtype checks included); torch.norm and
      // Tensor.norm reach it.
      {"aten::linalg_vector_norm",
       [](Stack& s) {
         const OptDims dim(s[2]);
         return Ret(s, at::meta::linalg_vector_norm(T(s, 0), S(s, 1), dim.ref(), s[3].toBool(), Dtype(s, 4)));
       }},
      // Session 28: each imported torch._dynamo at a fresh process's first
      // call, except clone and fill_.Scalar (Python meta kernels without
      // the import, the last ones (c)'s block ran).
      {"aten::logical_and", LogicalBinary},
      {"aten::logical_or", LogicalBinary},
      {"aten::logical_xor", LogicalBinary},
      {"aten::logical_not", LogicalNot},
      {"aten::hardtanh", Hardtanh},
      {"aten::stack", Stack_},
      {"aten::hardswish", Hardswish},
      {"aten::roll", Roll},
      {"aten::scalar_tensor", ScalarTensor},
      {"aten::clone", Clone},
      {"aten::native_dropout", NativeDropout},
      {"aten::fill_.Scalar", FillScalar},
      {"aten::logsumexp", Logsumexp},
      {"aten::log_sigmoid_forward", LogSigmoidForward},
      {"aten::std.correction", StdVar<1>},
      {"aten::var.correction", StdVar<1>},
      {"aten::std_mean.correction", StdVar<2>},
      {"aten::var_mean.correction", StdVar<2>},
      {"aten::native_group_norm", NativeGroupNorm},
      {"aten::bmm", BINARY(bmm)},
      {"aten::mm", BINARY(mm)},
      {"aten::addmm",
       [](Stack& s) { return Ret(s, at::meta::addmm(T(s, 0), T(s, 1), T(s, 2), S(s, 3), S(s, 4))); }},
  };
  return *table;
}

#undef UNARY
#undef BINARY
#undef BINARY_SCALAR
#undef BINARY_ALPHA
#undef WRAPPED
#undef WRAPPED_ALPHA
#undef INPLACE_BINARY
#undef INPLACE_UNARY
#undef INPLACE_BINARY_ALPHA

}  // namespace

CppMetaKernel FindCppMeta(const c10::OperatorHandle& op) {
  static const bool on = EnvFlag("TORCH_TPU_CPP_META", true);
  if (!on) return nullptr;
  const auto& schema = op.schema();
  const std::string& overload = schema.overload_name();
  const auto& table = Table();
  auto it = table.find(overload.empty() ? schema.name() : schema.name() + "." + overload);
  return it == table.end() ? nullptr : it->second;
}

}  // namespace torch_tpu::runtime
