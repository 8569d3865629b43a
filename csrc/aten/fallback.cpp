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

void TpuBoxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const lowering::LoweringEntry* entry = EntryFor(op);
  if (!entry) return RunOnCpu(op, stack, "no lowering");
  try {
    runtime::RunOp(op, stack, *entry);
  } catch (const runtime::UnsupportedOp& e) {
    RunOnCpu(op, stack, e.what());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&TpuBoxedKernel>()); }

}  // namespace torch_tpu::aten
