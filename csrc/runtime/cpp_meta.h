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

using CppMetaKernel = void (*)(torch::jit::Stack& stack);

// The C++ meta kernel for `op`, or nullptr (the dispatcher's Meta kernel
// serves it). TORCH_TPU_CPP_META=0 turns the table off.
CppMetaKernel FindCppMeta(const c10::OperatorHandle& op);

}  // namespace torch_tpu::runtime
