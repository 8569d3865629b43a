// torch_tpu eager executors. Each executor is one file:
//   strict_executor.cpp  asynchronous, one op at a time, program order
//   debug_executor.cpp   synchronous, with index and NaN/Inf checks
//   fused_executor.cpp   deferred: a region of ops compiled as one program
// The active one is chosen by torch_tpu.set_eager_mode() or, at start-up,
// TORCH_TPU_EAGER_MODE=debug|strict|fused (also TPU_LAUNCH_BLOCKING=1 for
// debug, TPU_DEFER_AND_FUSE=1 for fused).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <functional>
#include <string>

#include "lowering/lowering.h"

namespace torch_tpu::runtime {

enum class EagerMode : int { kStrict = 0, kDebug = 1, kFused = 2 };

EagerMode CurrentMode();
void SetMode(EagerMode mode);
// "strict" / "debug"; throws std::invalid_argument naming valid modes.
EagerMode ParseMode(const std::string& name);
const char* ModeName(EagerMode mode);

// Runs an ATen call (arguments on top of the stack, replaced by its
// returns) through the active executor. Throws UnsupportedOp before any
// side effect if the call cannot be lowered.
void RunOp(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry);

void RunStrict(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry);
void RunDebug(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry);
void RunFused(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry);
// Compiles and runs the fused executor's recorded region (no-op if empty).
void FlushFusedRegion();
// Ops recorded in the current region.
size_t FusedRegionSize();
// Flushes the current region, then drops the compiled regions.
void ClearFusedRegionCache();

// While one lives on this thread, in strict mode, the tpu calls made run as
// ONE program instead of one each: they are recorded by the fused executor
// (the same recording, region key and ProgramBuilder as fused mode; written
// storages are donated, so updates happen in place). The region runs at the
// next call outside a scope (RunOp flushes it before running any other
// call: program order is kept), the next read of a storage
// (DeviceStorage::Materialize), or a sync point, so consecutive scoped
// calls (an optimizer's `_foreach_add_(steps, 1)` and its `_fused_adamw_`)
// share one program. Used by the multi-tensor kernels (_fused_adam(w)_,
// _fused_sgd_, _fused_adagrad_, every _foreach_* op:
// csrc/aten/optimizer_kernels.cpp). Debug mode runs the calls one by one
// (it checks each); fused mode records them anyway. Nests.
class OneProgramScope {
 public:
  OneProgramScope();
  ~OneProgramScope();
  OneProgramScope(const OneProgramScope&) = delete;
  OneProgramScope& operator=(const OneProgramScope&) = delete;
};

// The index of the current call inside the outermost OneProgramScope on
// this thread (0 for its first call), or -1 outside any scope. Fused mode's
// loop detector mixes it into the signature of calls inside a scope: the
// per-tensor calls of a foreach optimizer over identical layers would
// otherwise repeat with the period of one layer and cut the step there.
int64_t OneProgramCallIndex();

// Returns "file:line (function)" of the user's code calling into torch
// (set by the Python module; empty when unknown).
void SetUserFrameHook(std::function<std::string()> hook);
std::string UserFrame();

}  // namespace torch_tpu::runtime
