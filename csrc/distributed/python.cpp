// Python binding of the distributed layer: torch_tpu._C._distributed.
// ProcessGroupTPU is exposed as a subclass of torch's c10d Backend (the
// pybind type registered by torch._C._distributed_c10d), so the object
// returned to torch.distributed is a Backend it can register for "tpu".
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>
#include <pybind11/chrono.h>

#include "distributed/process_group.h"

namespace py = pybind11;

namespace torch_tpu::distributed {

void Bind(py::module& parent) {
  py::module::import("torch._C._distributed_c10d");  // registers the Backend base type
  py::module m = parent.def_submodule("_distributed", "tpu_dist: the c10d backend for device tpu");
  py::class_<ProcessGroupTPU, c10d::Backend, c10::intrusive_ptr<ProcessGroupTPU>>(m, "ProcessGroupTPU")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& host, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return c10::make_intrusive<ProcessGroupTPU>(host, rank, size, timeout);
           }),
           py::arg("host"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           "ProcessGroupTPU(host: gloo Backend over the same ranks, rank, size, timeout: timedelta)")
      .def_static("check_settings", &ProcessGroupTPU::CheckSettings,
                  "raises RuntimeError naming TORCH_TPU_DIST_ZERO_COPY / TORCH_TPU_DIST_TRANSPORT when its value "
                  "is not one the backend accepts (called before the gloo host backend is built)")
      .def_property_readonly("host", &ProcessGroupTPU::host, "the internal gloo backend (host-staged transport)")
      .def_property_readonly("transport", &ProcessGroupTPU::transport, "the transport collectives take: 'host-staged'")
      .def_property_readonly("xla_native_usable", &ProcessGroupTPU::xla_native_usable,
                             "whether the runtime's PJRT client spans processes (the XLA-native transport's "
                             "capability check); False on the CPU plugin")
      .def_property_readonly("zero_copy", &ProcessGroupTPU::zero_copy,
                             "whether host-staged collectives hand gloo a tpu tensor's own buffer memory where the "
                             "plugin's buffers are host memory (TORCH_TPU_DIST_ZERO_COPY=0 turns it off)");
}

}  // namespace torch_tpu::distributed
