// torch.autocast("tpu"): the AutocastPrivateUse1 dispatch key gets the same
// op lists and policies PyTorch registers for CUDA autocast
// (aten/src/ATen/autocast_mode.cpp), through the lists and macros PyTorch
// exports in ATen/autocast_mode.h for backends to reuse: matmuls and
// convolutions run in the autocast dtype, numerically sensitive ops in
// float32, mixed-dtype ops at the widest input type. Ops in no list fall
// through to the tpu kernels unchanged.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace torch_tpu::aten {
namespace {

using at::Tensor;
using at::autocast::CastPolicy;
using c10::IntArrayRef;
using c10::Scalar;
using c10::ScalarType;

#define TPU_KERNEL_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TPU_KERNEL_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TPU_KERNEL_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TPU_KERNEL_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
#define ADD_NS(RAW_OP) at::RAW_OP

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(TPU_KERNEL_LOWER_PRECISION_FP)
  AT_FORALL_FP32(TPU_KERNEL_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TPU_KERNEL_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(TPU_KERNEL_PROMOTE)
}

}  // namespace
}  // namespace torch_tpu::aten
