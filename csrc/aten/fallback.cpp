// The boxed kernel behind every ATen op that has no direct tpu kernel
// (kernels.cpp): it finds the op's lowering and hands the call to the active
// executor; an op without a usable lowering runs on the CPU with one warning
// per op and a counter in torch_tpu.metrics() (TORCH_TPU_CPU_FALLBACK=0
// makes it an error naming the op).
#include <ATen/native/CPUFallback.h>
#include <torch/library.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "aten/tpu.h"
#include "lowering/lowering.h"
#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::aten {
namespace {

bool CpuFallbackAllowed() {
  static bool allowed = [] {
    const char* e = std::getenv("TORCH_TPU_CPU_FALLBACK");
    return !(e && std::string(e) == "0");
  }();
  return allowed;
}

std::string OpName(const c10::FunctionSchema& schema) {
  return schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
}

const lowering::LoweringEntry* EntryFor(const c10::OperatorHandle& op) {
  static std::mutex mutex;
  static std::unordered_map<const c10::FunctionSchema*, const lowering::LoweringEntry*> entries;
  const c10::FunctionSchema* key = &op.schema();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = entries.find(key);
  if (it != entries.end()) return it->second;
  const auto* entry = lowering::FindLowering(runtime::BaseName(op.schema()));
  if (entry && entry->traits.graph_only) entry = nullptr;  // eager views are metadata only
  entries.emplace(key, entry);
  return entry;
}

void RunOnCpu(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& reason) {
  std::string name = OpName(op.schema());
  TORCH_CHECK_NOT_IMPLEMENTED(CpuFallbackAllowed(), "The operator '", name,
                              "' is not implemented for the tpu device (", reason,
                              "), and TORCH_TPU_CPU_FALLBACK=0 forbids running it on the CPU.");
  auto& metrics = runtime::Runtime::Get().metrics();
  bool first;
  {
    std::lock_guard<std::mutex> lock(metrics.fallback_mutex);
    first = metrics.cpu_fallbacks[name]++ == 0;
  }
  if (first) TORCH_WARN("torch_tpu: ", name, " runs on the CPU (", reason, "); results are copied back to tpu.");
  at::native::cpu_fallback(op, stack);
}

// Index lists (Tensor?[]) may hold CPU tensors, as on CUDA: move them.
void MoveCpuIndicesToDevice(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = (*stack)[first + i];
    if (!v.isList() || v.isTensorList() || v.isIntList() || v.isDoubleList() || v.isBoolList()) continue;
    const auto& list = v.toListRef();
    bool has_cpu = false;
    c10::Device device(kTpu, CurrentDevice());
    for (const auto& x : list) {
      if (x.isTensor() && x.toTensor().defined()) {
        if (x.toTensor().device().type() == kTpu) device = x.toTensor().device();
        else has_cpu |= x.toTensor().dim() > 0 && x.toTensor().is_cpu();
      }
    }
    if (!has_cpu) continue;
    c10::List<std::optional<at::Tensor>> moved;
    for (const auto& x : list) {
      if (x.isTensor() && x.toTensor().defined()) moved.push_back(x.toTensor().to(device));
      else moved.push_back(std::nullopt);
    }
    v = moved;
  }
}

void TpuBoxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const lowering::LoweringEntry* entry = EntryFor(op);
  if (entry) MoveCpuIndicesToDevice(op, stack);
  if (!entry) return RunOnCpu(op, stack, "no lowering");
  try {
    runtime::RunOp(op, stack, *entry);
  } catch (const runtime::UnsupportedOp& e) {
    RunOnCpu(op, stack, e.what());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&TpuBoxedKernel>()); }

void RegisterLoweredOpsDirectly() {
  // Ops with a lowering get the boxed kernel registered for the tpu key
  // itself, ahead of the CompositeExplicitAutograd(NonFunctional) kernels
  // that would otherwise run first: for structured ops those compute the
  // meta result and allocate the output on every call, then call the out=
  // variant. Ops with a CompositeImplicitAutograd kernel keep it (their
  // autograd comes from the decomposition), and copy_ keeps PyTorch's kernel
  // (it routes host<->device copies to _copy_from).
  static torch::Library* library = nullptr;
  if (library) return;
  library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    std::string base = runtime::BaseName(handle->schema());
    const lowering::LoweringEntry* entry = lowering::FindLowering(base);
    if (base == "copy" || !entry || entry->traits.graph_only) continue;
    bool returns_view = false;
    for (const auto& r : handle->schema().returns())
      returns_view |= r.alias_info() != nullptr && !r.alias_info()->isWrite();
    if (returns_view) continue;
    if (handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      continue;
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&TpuBoxedKernel>());
  }
}

}  // namespace torch_tpu::aten
