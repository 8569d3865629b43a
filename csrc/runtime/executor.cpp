#include "runtime/executor.h"
#include "runtime/env.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <unordered_set>

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
// The window between strict-mode graph calls (executor.h, BeginGraphCall).
// Process-wide, not per thread: a backward graph runs on autograd's device
// thread, the loss and the optimizer on the caller's. Written under `mutex`;
// RunOp reads the atomics without it.
struct GraphWindow {
  std::mutex mutex;
  std::atomic<bool> open{false};
  std::atomic<bool> armed{false};
  std::atomic<int64_t> ops{0};             // ops counted in the window so far
  std::atomic<uint64_t> generation{0};     // windows opened so far (a close names the one it saw)
  std::atomic<uint64_t> sync_count{0};     // SyncCount() when it opened
  uint64_t uid = 0;                        // the graph that opened it
  std::unordered_set<uint64_t> followed;   // graphs whose last window the next graph call closed
};
GraphWindow& Window() {
  static GraphWindow* w = new GraphWindow();  // never destroyed: threads may still call at exit
  return *w;
}
constexpr size_t kMaxFollowedGraphs = 4096;  // bounds `followed` (cleared beyond: relearned)

void CloseLocked(GraphWindow& w) {
  if (!w.open.load(std::memory_order_relaxed)) return;
  w.followed.erase(w.uid);
  w.armed.store(false, std::memory_order_release);
  w.open.store(false, std::memory_order_release);
}

void CloseWindow(uint64_t generation) {
  GraphWindow& w = Window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.generation.load(std::memory_order_relaxed) == generation) CloseLocked(w);
}

// A strict-mode call at depth 0, or the first call of a multi-tensor op
// (OneProgramScope; its other calls are not counted): counts one op of the
// open window and says whether the call is to be recorded (the window is
// armed). Closes the window at a sync point since it opened or at its
// kMaxDeferredOps+1-th op.
bool DeferCall() {
  GraphWindow& w = Window();
  if (!w.open.load(std::memory_order_acquire)) return false;
  const uint64_t generation = w.generation.load(std::memory_order_acquire);
  if (SyncCount() != w.sync_count.load(std::memory_order_acquire) ||
      w.ops.fetch_add(1, std::memory_order_acq_rel) >= kMaxDeferredOps) {
    CloseWindow(generation);
    return false;
  }
  return w.armed.load(std::memory_order_acquire);
}

std::function<std::string()>& FrameHook() {
  static std::function<std::string()> hook;
  return hook;
}

}  // namespace

EagerMode CurrentMode() { return static_cast<EagerMode>(ModeStorage().load(std::memory_order_relaxed)); }
void SetMode(EagerMode mode) {
  if (mode != CurrentMode()) {
    CloseGraphWindow();  // before the flush: calls recorded from now on are the new mode's
    // The mode changes even when the flush raises (a region that failed to
    // run: its calls are dropped and its storages hold the error), so that
    // `with torch_tpu.eager_mode(...)` restores the previous mode while the
    // error propagates.
    struct Store {
      EagerMode mode;
      ~Store() { ModeStorage().store(static_cast<int>(mode)); }
    } store{mode};
    FlushFusedRegion();
    return;
  }
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

std::atomic<bool>& DeferralFlag() {
  static std::atomic<bool> on{EnvFlag("TORCH_TPU_DEFER_BETWEEN_GRAPHS", true)};
  return on;
}
bool GraphDeferralEnabled() { return DeferralFlag().load(std::memory_order_acquire); }
void SetGraphDeferralEnabled(bool on) {
  DeferralFlag().store(on, std::memory_order_release);
  if (!on) CloseGraphWindow();
}

bool BeginGraphCall() {
  GraphWindow& w = Window();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (!w.open.load(std::memory_order_relaxed)) return false;
  if (SyncCount() != w.sync_count.load(std::memory_order_relaxed)) {  // a sync point since it opened
    CloseLocked(w);
    return false;
  }
  if (w.followed.size() >= kMaxFollowedGraphs) w.followed.clear();
  w.followed.insert(w.uid);
  return w.armed.load(std::memory_order_relaxed);
}

void EndGraphCall(uint64_t uid) {
  if (!GraphDeferralEnabled()) return;
  GraphWindow& w = Window();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.open.store(false, std::memory_order_release);  // the previous window (BeginGraphCall noted it)
  w.uid = uid;
  w.ops.store(0, std::memory_order_release);
  w.sync_count.store(SyncCount(), std::memory_order_release);
  w.generation.fetch_add(1, std::memory_order_acq_rel);
  w.armed.store(w.followed.count(uid) > 0, std::memory_order_release);
  w.open.store(true, std::memory_order_release);
}

void CloseGraphWindow() {
  GraphWindow& w = Window();
  std::lock_guard<std::mutex> lock(w.mutex);
  CloseLocked(w);
}

bool GraphDeferralArmed() {
  const GraphWindow& w = Window();
  return w.open.load(std::memory_order_acquire) && w.armed.load(std::memory_order_acquire);
}

void RunOp(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
  const EagerMode mode = CurrentMode();
  // Restored on return (also by an exception): nested RunOp calls (a
  // lowering-less op's decomposition) see their own index.
  struct IndexGuard {
    int64_t saved = current_call_index;
    ~IndexGuard() { current_call_index = saved; }
  } index_guard;
  current_call_index = one_program_depth > 0 ? one_program_calls++ : -1;
  if (mode == EagerMode::kStrict && one_program_depth > 0) {
    // A multi-tensor op counts once in a window between graphs (its first
    // call); its calls are recorded either way (one program).
    if (current_call_index == 0) (void)DeferCall();
    return RunFused(op, stack, entry);
  }
  // In an armed window between compiled graphs (BeginGraphCall): recorded,
  // up to kMaxDeferredOps ops; past them (the window closes) the recorded
  // calls run as one region below and this call is strict.
  if (mode == EagerMode::kStrict && DeferCall()) return RunFused(op, stack, entry);
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
