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

// Deferral between compiled graphs (strict mode; docs/design.md, "Programs
// per training step"). Each torch.compile graph call in strict mode opens a
// *window*, which the next graph call closes; so do a sync point
// (SyncCount() moving: a copy to the host, item(), torch.tpu.synchronize),
// a mode switch, a failed graph call, and the window's kMaxDeferredOps+1-th
// op (a multi-tensor op counted once). A graph whose window was last closed
// by the next graph call is *followed*; after a followed graph the window is
// *armed*: its eager calls (a loss outside the model and its backward's
// first calls, an optimizer step) are recorded by the fused executor
// instead of launched one by one, and the next graph call absorbs them (the
// graph becomes the region's last call and the region runs at once, one
// program, GraphProgram::Run). Otherwise (never followed, or the window
// closes another way, which also forgets it) every call runs as strict mode
// always ran it: an eager tail after a graph that no graph follows (before
// a sync point, within the bound) is never deferred, and the first time
// any graph runs nothing is deferred. A closed armed window's recorded
// calls run as one region at the sync point (or at the op past the bound).
// Errors: a call's own errors (arguments, shapes, dtypes) raise at the call
// as always; value and index checks at the next sync point naming the op,
// as strict mode's always do. Debug and fused mode are unaffected.
// TORCH_TPU_DEFER_BETWEEN_GRAPHS=0 turns it off (no window ever opens).
// Process-wide, not per thread: a backward graph runs on autograd's device
// thread, the loss and the optimizer on the caller's.
bool GraphDeferralEnabled();
// Turns it on or off from now on (torch_tpu._C._set_graph_deferral, for
// side-by-side measurements); off closes the open window.
void SetGraphDeferralEnabled(bool on);
// At a strict-mode graph call, before it runs: notes that the open window
// (if any) is followed by this call; true if that window is armed (the
// region the fused executor holds is the calls to absorb). The window stays
// open (and armed) until EndGraphCall, so the graph's own input copies are
// recorded into the region too.
bool BeginGraphCall();
// After a strict-mode graph call (graph `uid`) ran: opens its window, armed
// if `uid` is followed.
void EndGraphCall(uint64_t uid);
// Closes the open window (forgetting that its graph is followed).
void CloseGraphWindow();
// Whether the open window is armed (its calls are recorded).
bool GraphDeferralArmed();
// Ops a window holds at most; its next op closes it.
constexpr int64_t kMaxDeferredOps = 64;

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
