// The extension module torch_tpu._C: what the thin Python package needs
// from the C++ core.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>
#include <torch/csrc/Generator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/headeronly/version.h>

#include "aten/tpu.h"
#include "lowering/lowering.h"
#include "runtime/compile_stats.h"
#include "runtime/compiled_op.h"
#include "runtime/disk_cache.h"
#include "runtime/executor.h"
#include "runtime/runtime.h"

namespace py = pybind11;
using torch_tpu::runtime::Runtime;

void BindGraphProgram(py::module& m);  // graph_bindings.cpp
namespace torch_tpu::distributed {
void Bind(py::module& m);  // distributed/python.cpp
}

namespace {

py::dict Metrics() {
  auto& m = Runtime::Get().metrics();
  {  // host-first calls' compiles still running: their counts are part of the metrics
    py::gil_scoped_release release;
    torch_tpu::runtime::AwaitBackgroundCompiles();
  }
  py::dict d;
  d["compiles"] = m.compiles.load();
  d["compile_time_s"] = static_cast<double>(m.compile_time_ns.load()) * 1e-9;
  d["compile_wait_s"] = static_cast<double>(m.compile_wait_ns.load()) * 1e-9;
  d["cache_hits"] = m.cache_hits.load();
  d["cache_misses"] = m.cache_misses.load();
  d["executions"] = m.executions.load();
  d["host_to_device_bytes"] = m.host_to_device_bytes.load();
  d["device_to_host_bytes"] = m.device_to_host_bytes.load();
  d["fused_regions"] = m.fused_regions.load();
  d["fused_region_outputs"] = m.fused_region_outputs.load();
  d["fused_regions_op_by_op"] = m.fused_regions_op_by_op.load();
  d["fused_regions_passed_through"] = m.fused_regions_passed_through.load();
  d["donated_buffers"] = m.donated_buffers.load();
  d["host_served"] = m.host_served.load();
  d["host_first_declined"] = m.host_first_declined.load();
  py::dict fallbacks;
  {
    std::lock_guard<std::mutex> lock(m.fallback_mutex);
    for (const auto& [name, count] : m.cpu_fallbacks) fallbacks[py::str(name)] = count;
  }
  d["cpu_fallbacks"] = fallbacks;
  {  // eager single-op compiles by op and cause (runtime/compile_stats.h)
    namespace rt = torch_tpu::runtime;
    auto& stats = rt::CompileStats::Get();
    py::dict causes;
    auto totals = stats.TotalsByCause();
    for (size_t c = 0; c < rt::kNumCompileCauses; ++c)
      causes[rt::CompileCauseName(static_cast<rt::CompileCause>(c))] = totals[c];
    d["compiles_by_cause"] = causes;
    py::dict by_op;
    for (const auto& [name, s] : stats.Snapshot()) {
      py::dict o;
      o["compiles"] = s.compiles;
      for (size_t c = 0; c < rt::kNumCompileCauses; ++c)
        o[rt::CompileCauseName(static_cast<rt::CompileCause>(c))] = s.by_cause[c];
      o["distinct_shapes"] = s.distinct_shapes;
      o["compile_time_s"] = s.seconds;
      o["shapes"] = s.shapes;
      by_op[py::str(name)] = o;
    }
    d["compiles_by_op"] = by_op;
  }
  d["cached_executables"] = torch_tpu::runtime::GlobalOpCache().size();
  d["executable_cache_evictions"] = torch_tpu::runtime::ExecutableEvictions().load();
  auto& disk = torch_tpu::runtime::DiskCache::Get().stats();
  d["disk_cache_hits"] = disk.hits.load();
  d["disk_cache_misses"] = disk.misses.load();
  d["disk_cache_writes"] = disk.writes.load();
  d["disk_cache_errors"] = disk.errors.load();
  d["disk_cache_evictions"] = disk.evictions.load();
  d["disk_cache_scans"] = disk.scans.load();
  return d;
}

py::dict MemoryStats() {
  auto& rt = Runtime::Get();
  py::dict d;
  d["allocated_bytes.all.current"] = rt.allocated_bytes();
  d["allocated_bytes.all.peak"] = rt.peak_allocated_bytes();
  d["allocation.all.allocated"] = rt.num_allocs();
  d["device.total_memory"] = rt.TotalMemory(torch_tpu::aten::CurrentDevice());
  if (rt.memory_limit() > 0) d["device.memory_limit"] = rt.memory_limit();
  auto stats = rt.client().memory_stats(rt.device(torch_tpu::aten::CurrentDevice()));
  if (stats) {
    d["device.bytes_in_use"] = stats->bytes_in_use;
    if (stats->bytes_limit) d["device.bytes_limit"] = *stats->bytes_limit;
    if (stats->peak_bytes_in_use) d["device.peak_bytes_in_use"] = *stats->peak_bytes_in_use;
  }
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_tpu C++ core: PJRT runtime, lowerings and eager executors";
  torch_tpu::aten::RegisterLoweredOpsDirectly();
  torch_tpu::aten::RegisterForeachOps();
  torch_tpu::aten::RegisterSparseOps();
  m.def("_set_plugin_path", &Runtime::SetPluginPath, "Plugin to load on first use");
  m.def("_plugin_path", [] { return Runtime::PluginPath(); });
  m.def("_init", [] {
    try {
      Runtime::Get();
    } catch (const std::exception& e) {
      throw std::runtime_error(e.what());
    }
  });
  m.def("_is_initialized", &Runtime::Initialized);
  m.attr("_torch_version_built") = TORCH_VERSION;  // the torch headers this extension was compiled against
  m.def("device_count", [] { return static_cast<int>(torch_tpu::aten::DeviceCount()); });
  m.def("platform_name", [] { return Runtime::Get().client().platform_name(); });
  m.def("platform_version", [] { return Runtime::Get().client().platform_version(); });
  m.def("pjrt_api_version", [] {
    auto& p = *Runtime::Get().client().plugin();
    return py::make_tuple(p.api_major(), p.api_minor());
  });
  m.def("pjrt_header_version", [] { return py::make_tuple(PJRT_API_MAJOR, PJRT_API_MINOR); });
  m.def("device_kind", [](int index) { return Runtime::Get().device(index).kind; });
  m.def("current_device", [] { return static_cast<int>(torch_tpu::aten::CurrentDevice()); });
  m.def("set_device", [](int index) {
    c10::impl::getDeviceGuardImpl(torch_tpu::aten::kTpu)->setDevice(c10::Device(torch_tpu::aten::kTpu, static_cast<c10::DeviceIndex>(index)));
  });
  m.def("_seed_all", [](uint64_t seed) { torch_tpu::aten::SeedAllDefaultGenerators(seed); });
  m.def("_default_generator", [](int index) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(torch_tpu::aten::DefaultGenerator(static_cast<c10::DeviceIndex>(index))));
  });
  m.def("synchronize", [] {
    py::gil_scoped_release no_gil;
    Runtime::Get().Sync();
  });
  m.def("set_eager_mode", [](const std::string& name) {
    torch_tpu::runtime::SetMode(torch_tpu::runtime::ParseMode(name));
  });
  m.def("get_eager_mode", [] { return std::string(torch_tpu::runtime::ModeName(torch_tpu::runtime::CurrentMode())); });
  m.def("memory_allocated", [] { return Runtime::Get().allocated_bytes(); });
  m.def("max_memory_allocated", [] { return Runtime::Get().peak_allocated_bytes(); });
  m.def("reset_peak_memory_stats", [] { Runtime::Get().ResetPeak(); });
  m.def("memory_stats", &MemoryStats);
  m.def("_total_memory", [](int index) { return Runtime::Get().TotalMemory(index); });
  m.def("_memory_limit", [] { return Runtime::Get().memory_limit(); });
  m.def("_set_memory_limit", [](int64_t bytes) { Runtime::Get().SetMemoryLimit(bytes); });
  m.def("_idle", [] { return Runtime::Get().Idle(); });
  m.def("_device_type", [] { return static_cast<int>(c10::DeviceType::PrivateUse1); });
  m.def("metrics", &Metrics);
  // metrics()["compiles"] without waiting for background compiles (each is
  // counted when queued): benchmarks attribute compiles to the calls that
  // queued them without changing when programs become ready.
  m.def("_compiles_queued", [] { return Runtime::Get().metrics().compiles.load(); });
  m.def("cache_dir", [] { return torch_tpu::runtime::DiskCache::Get().directory(); });
  m.def("cache_max_bytes", [] { return torch_tpu::runtime::DiskCache::Get().max_bytes(); });
  m.def("clear_executable_cache", [] {
    torch_tpu::runtime::ClearFusedRegionCache();  // flushes the recorded region first
    torch_tpu::runtime::GlobalOpCache().Clear();
  });
  m.def("_fused_region_size", [] { return torch_tpu::runtime::FusedRegionSize(); });
  // Strict mode's deferral between compiled graphs (docs/design.md,
  // "Programs per training step"); TORCH_TPU_DEFER_BETWEEN_GRAPHS=0 at start.
  m.def("_set_graph_deferral", [](bool on) { torch_tpu::runtime::SetGraphDeferralEnabled(on); });
  m.def("_graph_deferral", [] { return torch_tpu::runtime::GraphDeferralEnabled(); });
  m.def("lowered_ops", [] {
    std::vector<std::string> names;
    for (const auto* e : torch_tpu::lowering::AllLowerings()) names.emplace_back(e->name);
    std::sort(names.begin(), names.end());
    return names;
  });
  m.def("_set_user_frame_hook", [](py::function hook) {
    auto* held = new py::function(std::move(hook));  // lives for the process
    torch_tpu::runtime::SetUserFrameHook([held]() -> std::string {
      py::gil_scoped_acquire gil;
      try {
        return (*held)().cast<std::string>();
      } catch (const std::exception&) {
        return {};
      }
    });
  });
  m.def("_storage_element_type", [](const at::Tensor& t) {
    auto& s = torch_tpu::runtime::StorageOf(t);
    return s.initialized() ? std::string(torch_tpu::hlo::MlirName(s.current().element)) : std::string();
  });
  // Elements of the buffer the tpu tensor's storage holds now (its
  // capacity: runtime::Capacity(numel) for an exact buffer, more for a
  // bucket program's canonical one); -1 when it has none yet. For tests
  // that need a storage in a bucket buffer.
  m.def("_storage_buffer_numel", [](const at::Tensor& t) -> int64_t {
    auto& s = torch_tpu::runtime::StorageOf(t);
    return s.initialized() ? s.current().numel : -1;
  });
  BindGraphProgram(m);
  torch_tpu::distributed::Bind(m);
}
