#include "runtime/cpp_meta.h"

#include <ATen/ATen.h>
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
std::optional<at::ScalarType> Dtype(const Stack& s, size_t i) {
  if (s[i].isNone()) return std::nullopt;
  return s[i].toScalarType();
}
// The result replaces the arguments (a boxed call's stack discipline).
void Ret(Stack& s, at::Tensor r) {
  s.clear();
  s.emplace_back(std::move(r));
}

// Elementwise ops (TensorIterator) and the rest, by schema.
#define UNARY(fn) [](Stack& s) { Ret(s, at::meta::fn(T(s, 0))); }
#define BINARY(fn) [](Stack& s) { Ret(s, at::meta::fn(T(s, 0), T(s, 1))); }
#define BINARY_SCALAR(fn) [](Stack& s) { Ret(s, at::meta::fn(T(s, 0), S(s, 1))); }
#define BINARY_ALPHA(fn) [](Stack& s) { Ret(s, at::meta::fn(T(s, 0), T(s, 1), S(s, 2))); }
#define INPLACE_BINARY(fn) [](Stack& s) { at::Tensor self = T(s, 0); at::meta::fn(self, T(s, 1)); Ret(s, self); }
#define INPLACE_BINARY_ALPHA(fn) \
  [](Stack& s) { at::Tensor self = T(s, 0); at::meta::fn(self, T(s, 1), S(s, 2)); Ret(s, self); }

// sum.dim_IntList / mean.dim: (self, int[1]? dim, bool keepdim, *, ScalarType? dtype)
template <at::Tensor (*Fn)(const at::Tensor&, at::OptionalIntArrayRef, bool, std::optional<at::ScalarType>)>
void DimReduce(Stack& s) {
  std::optional<std::vector<int64_t>> dim;
  if (!s[1].isNone()) dim = s[1].toIntVector();
  at::OptionalIntArrayRef ref = dim ? at::OptionalIntArrayRef(*dim) : at::OptionalIntArrayRef(std::nullopt);
  Ret(s, Fn(T(s, 0), ref, s[2].toBool(), Dtype(s, 3)));
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

const std::unordered_map<std::string, CppMetaKernel>& Table() {
  static const auto* table = new std::unordered_map<std::string, CppMetaKernel>{
      {"aten::add.Tensor", BINARY_ALPHA(add)},
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
      {"aten::gelu", [](Stack& s) { Ret(s, at::meta::gelu(T(s, 0), s[1].toStringView())); }},
      {"aten::all", UNARY(all)},
      {"aten::any", UNARY(any)},
      {"aten::all.dim", [](Stack& s) { Ret(s, at::meta::all(T(s, 0), s[1].toInt(), s[2].toBool())); }},
      {"aten::any.dim", [](Stack& s) { Ret(s, at::meta::any(T(s, 0), s[1].toInt(), s[2].toBool())); }},
      {"aten::sum.dim_IntList", DimReduce<&at::meta::sum>},
      {"aten::mean.dim", DimReduce<&at::meta::mean>},
      {"aten::amax",
       [](Stack& s) {
         const std::vector<int64_t> dim = s[1].toIntVector();
         Ret(s, at::meta::amax(T(s, 0), dim, s[2].toBool()));
       }},
      {"aten::argmax",
       [](Stack& s) {
         const std::optional<int64_t> dim = s[1].isNone() ? std::nullopt : std::optional<int64_t>(s[1].toInt());
         Ret(s, at::meta::argmax(T(s, 0), dim, s[2].toBool()));
       }},
      {"aten::cumsum", [](Stack& s) { Ret(s, at::meta::cumsum(T(s, 0), s[1].toInt(), Dtype(s, 2))); }},
      {"aten::cat",
       [](Stack& s) {
         const c10::List<at::Tensor> tensors = s[0].toTensorList();
         Ret(s, at::meta::cat(tensors, s[1].toInt()));
       }},
      {"aten::tril", [](Stack& s) { Ret(s, at::meta::tril(T(s, 0), s[1].toInt())); }},
      {"aten::triu", [](Stack& s) { Ret(s, at::meta::triu(T(s, 0), s[1].toInt())); }},
      {"aten::_softmax", [](Stack& s) { Ret(s, at::meta::_softmax(HalfToFloat(s), s[1].toInt(), s[2].toBool())); }},
      {"aten::_log_softmax",
       [](Stack& s) { Ret(s, at::meta::_log_softmax(HalfToFloat(s), s[1].toInt(), s[2].toBool())); }},
      {"aten::bmm", BINARY(bmm)},
      {"aten::mm", BINARY(mm)},
      {"aten::addmm", [](Stack& s) { Ret(s, at::meta::addmm(T(s, 0), T(s, 1), T(s, 2), S(s, 3), S(s, 4))); }},
  };
  return *table;
}

#undef UNARY
#undef BINARY
#undef BINARY_SCALAR
#undef BINARY_ALPHA
#undef INPLACE_BINARY
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
