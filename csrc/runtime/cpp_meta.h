// ATen's C++ meta kernels, called directly for the ops a call spec needs
// most (ComputeSpec in compiled_op.cpp).
//
// Once `torch._meta_registrations` is imported (by `import torch`), PyTorch
// registers Python meta kernels at the Meta dispatch key for most ATen ops,
// over the C++ structured meta kernels (`torch._C._dispatch_dump` lists
// those as "Meta (inactive)"), so `redispatchBoxed(Meta)` runs Python:
// ~0.15-0.2 ms per call on this machine (a generate() call of a new prompt
// length ran ~590 of them, ~86 ms, in fused mode). The C++ meta functions
// stay exported (`at::meta::add` etc., ATen/ops/*_meta_dispatch.h): they
// are the ones CPU's own kernels run (a structured kernel's meta step), so
// their sizes, strides, dtypes and argument errors are CPU's. The table
// maps an operator (name and overload) to a function that replaces the
// op's arguments on a stack with its meta result, as a boxed call would.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace torch_tpu::runtime {

// Returns false, the stack unchanged, where it declines the call (the
// dispatcher's Meta kernel serves it then: native_layer_norm of reduced
// precision or mixed dtypes, whose statistics' dtype the table does not
// restate).
using CppMetaKernel = bool (*)(torch::jit::Stack& stack);

// The C++ meta kernel for `op`, or nullptr (the dispatcher's Meta kernel
// serves it). TORCH_TPU_CPP_META=0 turns the table off.
//
// Besides the per-call cost, a Python meta kernel that is a reference
// implementation (torch._refs: elementwise ops, native_layer_norm) is
// wrapped by torch._disable_dynamo, whose first call imports torch._dynamo:
// ~0.9 s once per process, which was 94% of the first pass over the (c)
// block's 20 lengths (native_layer_norm's ref, the block's first op) and
// of a TransformerEncoderLayer's first 20 forwards (mul.Scalar's). Session
// 24 added the ops a fresh process's first call showed importing it
// (atan, fmod, softplus, cross_entropy's nll_loss_forward, 2 ** t, 1 - t,
// mean(), in-place unary ops, ...), session 26 floor_divide, abs_ and
// linalg_vector_norm (norm), session 28 logical_and/or/xor/not, hardtanh
// (relu6), stack (same-dtype, same-shape contiguous inputs), hardswish,
// roll (contiguous inputs), logsumexp, scalar_tensor and where.self_out
// (scaled_dot_product_attention's math path: _safe_softmax's C++ body,
// CompositeExplicitAutograd, calls it on tpu tensors; generate()'s
// decoding calls it too), and clone and fill_.Scalar (no dynamo import,
// but the only Python meta kernels left in (c)'s block: 56 and 14 calls of
// its first pass), and native_dropout (training-mode dropout); session 29
// log_sigmoid_forward (logsigmoid), std/var(_mean).correction and
// native_group_norm (group_norm).
CppMetaKernel FindCppMeta(const c10::OperatorHandle& op);

}  // namespace torch_tpu::runtime
