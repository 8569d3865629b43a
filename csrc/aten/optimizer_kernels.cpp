// Kernels for the tpu key of the multi-tensor optimizer and mixed-precision
// ops that PyTorch's fused paths call:
//   _fused_adam_ / _fused_adamw_ (both overloads: float lr and Tensor lr),
//     what torch.optim.Adam/AdamW(fused=True) and Hugging Face's default
//     optimizer ("adamw_torch_fused") call once per step for all parameters;
//   _fused_sgd_ / _fused_adagrad_ (both overloads), SGD/Adagrad(fused=True);
//   _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_,
//     what torch.amp.GradScaler calls;
//   every _foreach_* op (the foreach optimizers, zero_grad, clip_grad_norm_):
//     PyTorch's own CompositeExplicitAutograd kernel (one ATen op per
//     tensor), run under a OneProgramScope (RegisterForeachOps).
//
// Each call runs as ONE program in strict mode (runtime::OneProgramScope:
// the fused executor records its ops and donates the written storages, so
// parameters and moments are updated in place; a step's
// `_foreach_add_(state_steps, 1)` and `_fused_adamw_` share the program).
//
// Why kernels and not lowerings: they update lists of tensors in place,
// which the lowering context (one value per tensor argument, ctx.write for
// a single tensor) does not express. Each kernel is composed of lowered ATen
// ops on tpu tensors, so nothing runs on the CPU and nothing is read to the
// host: the step count, the learning-rate tensor, grad_scale and found_inf
// stay on the device (a found_inf of 1 selects the old values instead of
// skipping, as a branch would need a sync). In fused eager mode the whole
// step records into one region.
//
// Math (PyTorch's CPU fused kernel, aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// computed in float for bfloat16/half parameters as its opmath type):
//   g = grad / grad_scale (written back to grad), negated if maximize
//   Adam:  g += weight_decay * param      AdamW: param -= lr * weight_decay * param
//   exp_avg = lerp(exp_avg, g, 1 - beta1)
//   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
//   max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq)            (amsgrad)
//   denom = sqrt(amsgrad ? max_exp_avg_sq : exp_avg_sq) / sqrt(1 - beta2^step) + eps
//   param -= lr / (1 - beta1^step) * exp_avg / denom
// with `step` the value of state_steps[i] (the optimizer increments it
// before the call). GradScaler's ops follow aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp:
// found_inf = 1 if any value of any grad is Inf/NaN, grads *= inv_scale; the
// scale backs off on found_inf, else grows every growth_interval steps.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "aten/tpu.h"
#include "runtime/executor.h"

namespace torch_tpu::aten {
namespace {

at::ScalarType OpMath(at::ScalarType t) {
  return (t == at::kBFloat16 || t == at::kHalf) ? at::kFloat : t;
}

// lerp(a, b, w) as PyTorch computes it for a scalar weight.
at::Tensor Lerp(const at::Tensor& a, const at::Tensor& b, double w) {
  return w < 0.5 ? a + (b - a) * w : b - (b - a) * (1.0 - w);
}

void FusedAdamImpl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
                   const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2,
                   double weight_decay, double eps, bool amsgrad, bool maximize,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                   bool adamw, const char* name) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && state_steps.size() == n,
              name, ": params, grads, exp_avgs, exp_avg_sqs and state_steps must have the same length, got ",
              n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", state_steps.size());
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n, name, ": amsgrad needs one max_exp_avg_sq per param, got ",
              max_exp_avg_sqs.size(), " for ", n);
  runtime::OneProgramScope one_program;
  // found_inf == 1 keeps every tensor as it was.
  std::optional<at::Tensor> skip;
  if (found_inf && found_inf->defined()) skip = found_inf->to(at::kFloat).eq(1.0);
  auto assign = [&](const at::Tensor& dst, const at::Tensor& value) {
    if (skip) {
      dst.copy_(at::where(*skip, dst.to(value.scalar_type()), value));
    } else {
      dst.copy_(value);
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& param = params[i];
    const at::ScalarType math = OpMath(param.scalar_type());
    at::Tensor p = param.to(math);
    at::Tensor g = grads[i].to(math);
    if (grad_scale && grad_scale->defined()) {
      g = g / grad_scale->to(math);
      assign(grads[i], g);
    }
    if (maximize) g = -g;
    // 1 - beta^step as -expm1(step * log(beta)), log(beta) computed on the
    // host in double: CPU's kernel computes the bias corrections in double
    // on the host, and `1 - pow(beta2, step)` on the device, with beta2 a
    // float32 scalar (0.999 is off by 1.3e-8 there), is off by 1.3e-5
    // relative at step 1; log(beta) is small, so float32 keeps it exact to
    // ~6e-8 relative, and so does expm1.
    at::Tensor step = state_steps[i].to(math);
    at::Tensor bias_correction1 = -at::expm1(step * std::log(beta1));
    at::Tensor bias_correction2_sqrt = at::sqrt(-at::expm1(step * std::log(beta2)));
    at::Tensor lr_value = lr_tensor && lr_tensor->defined() ? lr_tensor->to(math) : at::Tensor();
    auto times_lr = [&](const at::Tensor& x) { return lr_value.defined() ? x * lr_value : x * lr; };
    if (weight_decay != 0) {
      if (adamw) {
        p = p - times_lr(p * weight_decay);
      } else {
        g = g + p * weight_decay;
      }
    }
    at::Tensor m = Lerp(exp_avgs[i].to(math), g, 1.0 - beta1);
    at::Tensor v = exp_avg_sqs[i].to(math) * beta2 + g * g * (1.0 - beta2);
    at::Tensor second = v;
    if (amsgrad) {
      second = at::maximum(max_exp_avg_sqs[i].to(math), v);
      assign(max_exp_avg_sqs[i], second);
    }
    at::Tensor denom = at::sqrt(second) / bias_correction2_sqrt + eps;
    at::Tensor step_size = times_lr(1.0 / bias_correction1);
    p = p - step_size * m / denom;
    assign(exp_avgs[i], m);
    assign(exp_avg_sqs[i], v);
    assign(param, p);
  }
}

// found_inf == 1 keeps `dst` as it was (a select, not a host branch).
struct Assigner {
  std::optional<at::Tensor> skip;
  explicit Assigner(const std::optional<at::Tensor>& found_inf) {
    if (found_inf && found_inf->defined()) skip = found_inf->to(at::kFloat).eq(1.0);
  }
  void operator()(const at::Tensor& dst, const at::Tensor& value) const {
    if (skip) {
      dst.copy_(at::where(*skip, dst.to(value.scalar_type()), value));
    } else {
      dst.copy_(value);
    }
  }
};

// PyTorch's CPU kernel (aten/src/ATen/native/cpu/FusedSGDKernel.cpp), in
// the opmath type:
//   g = grad / grad_scale (written back to grad), negated if maximize
//   g += weight_decay * param
//   momentum != 0: buf = is_first_step ? g : momentum * buf + (1 - dampening) * g
//                  g = nesterov ? g + momentum * buf : buf
//   param -= lr * g
void FusedSgdImpl(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  double weight_decay, double momentum, const std::optional<at::Tensor>& lr_tensor, double lr,
                  double dampening, bool nesterov, bool maximize, bool is_first_step,
                  const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "_fused_sgd_: params and grads must have the same length, got ", n, " and ",
              grads.size());
  TORCH_CHECK(momentum == 0 || momentum_buffers.size() == n,
              "_fused_sgd_: momentum needs one momentum buffer per param, got ", momentum_buffers.size(), " for ", n);
  runtime::OneProgramScope one_program;
  Assigner assign(found_inf);
  for (size_t i = 0; i < n; ++i) {
    const at::ScalarType math = OpMath(params[i].scalar_type());
    at::Tensor p = params[i].to(math);
    at::Tensor g = grads[i].to(math);
    if (grad_scale && grad_scale->defined()) {
      g = g / grad_scale->to(math);
      assign(grads[i], g);
    }
    if (maximize) g = -g;
    if (weight_decay != 0) g = g + p * weight_decay;
    if (momentum != 0) {
      at::Tensor buf = is_first_step ? g : momentum_buffers[i].to(math) * momentum + g * (1.0 - dampening);
      assign(momentum_buffers[i], buf);
      g = nesterov ? g + buf * momentum : buf;
    }
    p = lr_tensor && lr_tensor->defined() ? p - g * lr_tensor->to(math) : p - g * lr;
    assign(params[i], p);
  }
}

// PyTorch's CPU kernel (aten/src/ATen/native/cpu/FusedAdagradKernel.cpp),
// in the opmath type, with `step` the value of state_steps[i] (incremented
// by the optimizer before the call):
//   g = grad / grad_scale (written back to grad), negated if maximize
//   g += weight_decay * param
//   clr = lr / (1 + (step - 1) * lr_decay)
//   state_sum += g * g
//   param -= clr * g / (sqrt(state_sum) + eps)
void FusedAdagradImpl(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                      at::TensorList state_steps, const std::optional<at::Tensor>& lr_tensor, double lr,
                      double lr_decay, double weight_decay, double eps, bool maximize,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && state_sums.size() == n && state_steps.size() == n,
              "_fused_adagrad_: params, grads, state_sums and state_steps must have the same length, got ", n, ", ",
              grads.size(), ", ", state_sums.size(), ", ", state_steps.size());
  runtime::OneProgramScope one_program;
  Assigner assign(found_inf);
  for (size_t i = 0; i < n; ++i) {
    const at::ScalarType math = OpMath(params[i].scalar_type());
    at::Tensor p = params[i].to(math);
    at::Tensor g = grads[i].to(math);
    if (grad_scale && grad_scale->defined()) {
      g = g / grad_scale->to(math);
      assign(grads[i], g);
    }
    if (maximize) g = -g;
    if (weight_decay != 0) g = g + p * weight_decay;
    at::Tensor decay = (state_steps[i].to(math) - 1.0) * lr_decay + 1.0;
    at::Tensor clr = lr_tensor && lr_tensor->defined() ? lr_tensor->to(math) / decay : lr / decay;
    at::Tensor sum = state_sums[i].to(math) + g * g;
    at::Tensor std = at::sqrt(sum) + eps;
    p = p - clr * (g / std);
    assign(state_sums[i], sum);
    assign(params[i], p);
  }
}

template <bool kTensorLr>
void FusedSgdKernel(at::TensorList self, at::TensorList grads, at::TensorList momentum_buffer_list,
                    double weight_decay, double momentum, std::conditional_t<kTensorLr, const at::Tensor&, double> lr,
                    double dampening, bool nesterov, bool maximize, bool is_first_step,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if constexpr (kTensorLr) {
    FusedSgdImpl(self, grads, momentum_buffer_list, weight_decay, momentum, lr, 0.0, dampening, nesterov, maximize,
                 is_first_step, grad_scale, found_inf);
  } else {
    FusedSgdImpl(self, grads, momentum_buffer_list, weight_decay, momentum, std::nullopt, lr, dampening, nesterov,
                 maximize, is_first_step, grad_scale, found_inf);
  }
}

template <bool kTensorLr>
void FusedAdagradKernel(at::TensorList self, at::TensorList grads, at::TensorList state_sums,
                        at::TensorList state_steps, std::conditional_t<kTensorLr, const at::Tensor&, double> lr,
                        double lr_decay, double weight_decay, double eps, bool maximize,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if constexpr (kTensorLr) {
    FusedAdagradImpl(self, grads, state_sums, state_steps, lr, 0.0, lr_decay, weight_decay, eps, maximize,
                     grad_scale, found_inf);
  } else {
    FusedAdagradImpl(self, grads, state_sums, state_steps, std::nullopt, lr, lr_decay, weight_decay, eps, maximize,
                     grad_scale, found_inf);
  }
}

// Every _foreach_* op: PyTorch's CompositeExplicitAutograd kernel (the
// "slow" per-tensor loop, which CPU runs too), reached through the CPU
// entry of the dispatch table, with its per-tensor ops made one program.
void ForeachKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  runtime::OneProgramScope one_program;
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// _fused_adam_ (kAdamW false) and _fused_adamw_ (true), float lr.
template <bool kAdamW>
void FusedAdamFloatLr(at::TensorList self, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
                      double lr, double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                      bool maximize, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  FusedAdamImpl(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, std::nullopt, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, kAdamW,
                kAdamW ? "_fused_adamw_" : "_fused_adam_");
}

// The .tensor_lr overloads: lr a tensor (stays on the device).
template <bool kAdamW>
void FusedAdamTensorLr(at::TensorList self, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
                       const at::Tensor& lr, double beta1, double beta2, double weight_decay, double eps,
                       bool amsgrad, bool maximize, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  FusedAdamImpl(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, 0.0, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, kAdamW,
                kAdamW ? "_fused_adamw_" : "_fused_adam_");
}

// found_inf (a one-element float tensor) = 1 if any grad holds Inf or NaN;
// every grad multiplied by inv_scale (one-element float tensor).
void NonFiniteCheckAndUnscale(at::TensorList self, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  TORCH_CHECK(inv_scale.numel() == 1, "_amp_foreach_non_finite_check_and_unscale_: inv_scale must be a "
              "1-element tensor, got ", inv_scale.numel(), " elements");
  TORCH_CHECK(found_inf.numel() == 1, "_amp_foreach_non_finite_check_and_unscale_: found_inf must be a "
              "1-element tensor, got ", found_inf.numel(), " elements");
  TORCH_CHECK(inv_scale.scalar_type() == at::kFloat && found_inf.scalar_type() == at::kFloat,
              "_amp_foreach_non_finite_check_and_unscale_: inv_scale and found_inf must be float32, got ",
              inv_scale.scalar_type(), " and ", found_inf.scalar_type());
  if (self.empty()) return;
  runtime::OneProgramScope one_program;
  at::Tensor any_bad = at::zeros({}, found_inf.options().dtype(at::kBool));
  for (const at::Tensor& g : self) {
    TORCH_CHECK(at::isFloatingType(g.scalar_type()),
                "_amp_foreach_non_finite_check_and_unscale_: grads must be floating point, got ", g.scalar_type());
    if (g.numel() == 0) continue;
    any_bad = any_bad.logical_or(at::isfinite(g).logical_not().any());
    g.mul_(inv_scale.to(OpMath(g.scalar_type())));
  }
  found_inf.copy_(at::maximum(found_inf, any_bad.to(at::kFloat).reshape(found_inf.sizes())));
}

// scale backs off on found_inf and resets the tracker; otherwise the tracker
// counts successful steps and the scale grows by growth_factor when it
// reaches growth_interval (then resets), unless the grown scale would be
// infinite.
at::Tensor& UpdateScale(at::Tensor& self, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                        double growth_factor, double backoff_factor, int64_t growth_interval) {
  TORCH_CHECK(self.numel() == 1 && growth_tracker.numel() == 1 && found_inf.numel() == 1,
              "_amp_update_scale_: scale, growth_tracker and found_inf must be 1-element tensors");
  TORCH_CHECK(self.scalar_type() == at::kFloat, "_amp_update_scale_: scale must be float32, got ",
              self.scalar_type());
  TORCH_CHECK(growth_tracker.scalar_type() == at::kInt, "_amp_update_scale_: growth_tracker must be int32, got ",
              growth_tracker.scalar_type());
  runtime::OneProgramScope one_program;
  at::Tensor bad = found_inf.to(at::kFloat).reshape(self.sizes()).ne(0);
  at::Tensor next = growth_tracker + 1;
  at::Tensor grow = next.ge(growth_interval);
  at::Tensor grown = self * growth_factor;
  grown = at::where(at::isfinite(grown), grown, self);  // a scale that would overflow stays
  at::Tensor scale = at::where(bad, self * backoff_factor, at::where(grow, grown, self));
  at::Tensor tracker = at::where(bad.logical_or(grow), at::zeros_like(next), next);
  self.copy_(scale);
  growth_tracker.copy_(tracker);
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_fused_adamw_", TORCH_FN(FusedAdamFloatLr<true>));
  m.impl("_fused_adamw_.tensor_lr", TORCH_FN(FusedAdamTensorLr<true>));
  m.impl("_fused_adam_", TORCH_FN(FusedAdamFloatLr<false>));
  m.impl("_fused_adam_.tensor_lr", TORCH_FN(FusedAdamTensorLr<false>));
  m.impl("_fused_sgd_", TORCH_FN(FusedSgdKernel<false>));
  m.impl("_fused_sgd_.tensor_lr", TORCH_FN(FusedSgdKernel<true>));
  m.impl("_fused_adagrad_", TORCH_FN(FusedAdagradKernel<false>));
  m.impl("_fused_adagrad_.tensor_lr", TORCH_FN(FusedAdagradKernel<true>));
  m.impl("_amp_foreach_non_finite_check_and_unscale_", NonFiniteCheckAndUnscale);
  m.impl("_amp_update_scale_", UpdateScale);
}

void RegisterForeachOps() {
  static torch::Library* library = nullptr;
  if (library) return;
  library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::_foreach_", 0) != 0) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    // Only where the CPU entry of the dispatch table is the composite kernel.
    if (handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        handle->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd))
      continue;
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&ForeachKernel>());
  }
}

}  // namespace torch_tpu::aten
