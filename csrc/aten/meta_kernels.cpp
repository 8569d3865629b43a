// Meta kernels PyTorch lacks for ops the tpu lowers. The runtime learns an
// op's output shapes from its Meta kernel (docs/design.md, "One ATen call,
// end to end"), so an op without one always ran on the CPU. Each is
// registered only where PyTorch has none (a later PyTorch that adds one
// wins).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace torch_tpu::aten {
namespace {

// geqrf (PyTorch 2.13 has none): gives CPU's outputs (a [*, m, n]
// column-major as LAPACK writes it, tau [*, min(m, n)]) and its dtype check.
// Registered only where PyTorch has none.
std::tuple<at::Tensor, at::Tensor> GeqrfMeta(const at::Tensor& self) {
  TORCH_CHECK(self.dim() >= 2, "torch.geqrf: input must have at least 2 dimensions.");
  TORCH_CHECK(at::isFloatingType(self.scalar_type()) || at::isComplexType(self.scalar_type()),
              "geqrf: Expected a floating point or complex tensor as input. Got ", self.scalar_type());
  std::vector<int64_t> sizes = self.sizes().vec();
  const int64_t m = sizes[sizes.size() - 2], n = sizes.back();
  std::vector<int64_t> strides(sizes.size());
  strides[sizes.size() - 2] = 1;
  strides[sizes.size() - 1] = std::max<int64_t>(m, 1);
  int64_t step = std::max<int64_t>(m * n, 1);
  for (size_t i = sizes.size() - 2; i-- > 0;) {
    strides[i] = step;
    step *= std::max<int64_t>(sizes[i], 1);
  }
  std::vector<int64_t> tau_sizes(sizes.begin(), sizes.end() - 2);
  tau_sizes.push_back(std::min(m, n));
  return {at::empty_strided(sizes, strides, self.options()), at::empty(tau_sizes, self.options())};
}

struct GeqrfMetaRegistrar {
  GeqrfMetaRegistrar() {
    auto op = c10::Dispatcher::singleton().findSchema({"aten::geqrf", ""});
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::Meta)) return;
    static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__);
    lib.impl("geqrf", TORCH_FN(GeqrfMeta));
  }
};
const GeqrfMetaRegistrar geqrf_meta_registrar;

// _logcumsumexp (PyTorch 2.13 has no Meta kernel): self's sizes and dtype;
// CPU's dtype check. The out= overload resizes `out` like CPU's kernel.
at::Tensor LogcumsumexpMeta(const at::Tensor& self, int64_t dim) {
  TORCH_CHECK(at::isFloatingType(self.scalar_type()) || at::isComplexType(self.scalar_type()),
              "\"logcumsumexp_out_cpu\" not implemented for '", self.scalar_type(), "'");
  (void)at::maybe_wrap_dim(dim, self.dim());
  return at::empty_like(self, at::MemoryFormat::Contiguous);
}
at::Tensor& LogcumsumexpOutMeta(const at::Tensor& self, int64_t dim, at::Tensor& out) {
  at::Tensor r = LogcumsumexpMeta(self, dim);
  out.resize_(r.sizes());
  return out;
}

struct LogcumsumexpMetaRegistrar {
  LogcumsumexpMetaRegistrar() {
    auto& d = c10::Dispatcher::singleton();
    static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__);
    auto op = d.findSchema({"aten::_logcumsumexp", ""});
    if (op && !op->hasKernelForDispatchKey(c10::DispatchKey::Meta)) lib.impl("_logcumsumexp", TORCH_FN(LogcumsumexpMeta));
    auto out_op = d.findSchema({"aten::_logcumsumexp", "out"});
    if (out_op && !out_op->hasKernelForDispatchKey(c10::DispatchKey::Meta))
      lib.impl("_logcumsumexp.out", TORCH_FN(LogcumsumexpOutMeta));
  }
};
const LogcumsumexpMetaRegistrar logcumsumexp_meta_registrar;

}  // namespace
}  // namespace torch_tpu::aten
