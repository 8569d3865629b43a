#include "runtime/executor.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "runtime/runtime.h"

namespace torch_tpu::runtime {
namespace {

EagerMode InitialMode() {
  if (const char* e = std::getenv("TORCH_TPU_EAGER_MODE"); e && *e) return ParseMode(e);
  if (const char* e = std::getenv("TPU_LAUNCH_BLOCKING"); e && std::string(e) == "1") return EagerMode::kDebug;
  if (const char* e = std::getenv("TPU_DEFER_AND_FUSE"); e && std::string(e) == "1") return EagerMode::kFused;
  return EagerMode::kStrict;
}

std::atomic<int>& ModeStorage() {
  static std::atomic<int> mode{static_cast<int>(InitialMode())};
  return mode;
}

thread_local int one_program_depth = 0;  // OneProgramScope nesting on this thread
thread_local int64_t one_program_calls = 0;  // calls run inside the outermost scope so far
thread_local int64_t current_call_index = -1;  // OneProgramCallIndex() of the call being run

std::function<std::string()>& FrameHook() {
  static std::function<std::string()> hook;
  return hook;
}

}  // namespace

EagerMode CurrentMode() { return static_cast<EagerMode>(ModeStorage().load(std::memory_order_relaxed)); }
void SetMode(EagerMode mode) {
  if (mode != CurrentMode()) FlushFusedRegion();
  ModeStorage().store(static_cast<int>(mode));
}

EagerMode ParseMode(const std::string& name) {
  if (name == "strict") return EagerMode::kStrict;
  if (name == "debug") return EagerMode::kDebug;
  if (name == "fused") return EagerMode::kFused;
  throw std::invalid_argument("unknown tpu eager mode '" + name + "' (expected 'strict', 'debug' or 'fused')");
}

const char* ModeName(EagerMode mode) {
  switch (mode) {
    case EagerMode::kDebug: return "debug";
    case EagerMode::kFused: return "fused";
    case EagerMode::kStrict: break;
  }
  return "strict";
}

OneProgramScope::OneProgramScope() {
  if (one_program_depth++ == 0) one_program_calls = 0;
}
OneProgramScope::~OneProgramScope() { --one_program_depth; }

int64_t OneProgramCallIndex() { return current_call_index; }

void RunOp(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
  const EagerMode mode = CurrentMode();
  // Restored on return (also by an exception): nested RunOp calls (a
  // lowering-less op's decomposition) see their own index.
  struct IndexGuard {
    int64_t saved = current_call_index;
    ~IndexGuard() { current_call_index = saved; }
  } index_guard;
  current_call_index = one_program_depth > 0 ? one_program_calls++ : -1;
  if (mode == EagerMode::kStrict && one_program_depth > 0) return RunFused(op, stack, entry);
  // A region recorded under a OneProgramScope runs before any later call.
  if (mode != EagerMode::kFused && HasPendingWork()) FlushFusedRegion();
  switch (mode) {
    case EagerMode::kDebug: return RunDebug(op, stack, entry);
    case EagerMode::kStrict: return RunStrict(op, stack, entry);
    case EagerMode::kFused: return RunFused(op, stack, entry);
  }
}

void SetUserFrameHook(std::function<std::string()> hook) { FrameHook() = std::move(hook); }
std::string UserFrame() {
  auto& hook = FrameHook();
  return hook ? hook() : std::string();
}

}  // namespace torch_tpu::runtime
