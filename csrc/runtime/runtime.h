// torch_tpu runtime: the process-wide PJRT client, device storage, metrics
// and in-flight execution tracking shared by every executor.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <ATen/core/Generator.h>
#include <ATen/record_function.h>

#include "hlo/builder.h"
#include "pjrt/pjrt.h"

namespace torch_tpu::runtime {

// Counters reported by torch_tpu.metrics(). Times in nanoseconds, sizes in
// bytes.
struct Metrics {
  std::atomic<int64_t> compiles{0};
  std::atomic<int64_t> compile_time_ns{0};
  // Time calling threads were blocked on a queued single-op compile
  // (AwaitCompiled: a call that cannot be host-served waits for its program).
  std::atomic<int64_t> compile_wait_ns{0};
  std::atomic<int64_t> cache_hits{0};
  std::atomic<int64_t> cache_misses{0};
  std::atomic<int64_t> executions{0};
  std::atomic<int64_t> host_to_device_bytes{0};
  std::atomic<int64_t> device_to_host_bytes{0};
  std::atomic<int64_t> fused_regions{0};         // fused regions run as one program
  std::atomic<int64_t> fused_region_outputs{0};  // their outputs (storages still referenced at the flush)
  std::atomic<int64_t> fused_regions_op_by_op{0};  // fused regions run call by call (churn, first sight, failed build)
  std::atomic<int64_t> fused_regions_passed_through{0};  // of those: churning regions run unrecorded (PassThrough)
  std::atomic<int64_t> donated_buffers{0};       // input buffers reused for an in-place result
  std::atomic<int64_t> host_served{0};           // host-first calls run by the ATen CPU kernel (ServeOnHost)
  std::atomic<int64_t> host_first_declined{0};   // host-first calls whose CPU results differed from the program's: run by the program
  std::mutex fallback_mutex;
  std::map<std::string, int64_t> cpu_fallbacks;  // op name -> count
};

// Elements a storage's buffer holds for a storage of `numel` elements of
// its element type (DESIGN.md, "Memory model", capacity): 0 for 0, 16 up to
// 16, else `numel` rounded up to the next of 8 steps per power of two
// (n in (p, 2p] rounds up to a multiple of p/8). The overhead is under
// 12.5% above 16 elements (at most 16 elements below). Buckets are what
// lets one shape-polymorphic program serve many lengths (the PJRT client
// checks each input buffer's size against the program's parameter). A
// power-of-two k dividing `numel` (k <= 16) divides the capacity, so the
// buffer reinterprets as k-wide elements as the storage does.
int64_t Capacity(int64_t numel);

// A value check of a launched program (LoweringContext::check / an index
// check; DESIGN.md and docs/design.md, "Value checks"): a pred scalar
// computed by the program (true: a value was bad) and the error to raise
// then. Shared by the pending-check list (Runtime::AddPendingCheck, raised
// once at the next sync point) and by every storage buffer the program
// wrote or that was computed from one (StorageBuffer::checks), which
// raises it again on every read until it is overwritten: a failed check
// poisons what it guards, so no garbage value escapes. Once raised (by
// either path) the pending list's sync point does not raise it again: a
// poisoned read that reported it leaves no stale error for a later, unrelated
// sync (the poisoned storages still raise on every read).
struct CheckState {
  enum State : uint8_t { kPending, kOk, kFailed };
  std::atomic<uint8_t> state{kPending};
  std::atomic<bool> raised{false};     // reported to the caller at least once
  std::mutex mutex;                    // guards flag while resolving
  std::shared_ptr<pjrt::Buffer> flag;  // until resolved
  std::string message;                 // Runtime::ValueCheckMessage-marked: RuntimeError, else IndexError
};
using CheckList = std::vector<std::shared_ptr<CheckState>>;

// A storage's current contents on the host, read-only and shared: its
// first `size` bytes (the storage's bytes, nbytes() at most, without the
// buffer's capacity padding; fewer where the buffer holds fewer) at
// `data`, alive while `owner` is.
struct HostContents {
  std::shared_ptr<const void> owner;
  const char* data = nullptr;
  size_t size = 0;
};

// A device buffer holding the whole contents of one storage: rank 1,
// `numel` elements of `element` — the buffer's own element count, at least
// the storage's (nbytes / element size): Capacity() of it for every buffer
// the runtime gives a storage. Elements past the storage's are padding:
// never read as values, of no defined content. The producer names the op
// that wrote it, for errors that surface later. `checks`: the value checks
// guarding these contents that are not known to have passed (pending or
// failed; empty in the common case) — those of the program that wrote it
// and those inherited from its inputs. Reading a buffer with a failed one
// raises its error (Runtime::Download, DeviceStorage::Materialize).
struct StorageBuffer {
  std::shared_ptr<pjrt::Buffer> buffer;
  hlo::ElementType element = hlo::ElementType::kF32;
  int64_t numel = 0;
  std::string producer;
  CheckList checks;
  // The storage's bytes as a host upload gave them (Runtime::UploadStorage
  // of at most kHostShadowMaxBytes; no owner otherwise), kept until a
  // program first reads the buffer (DeviceStorage::DropHostShadow,
  // GatherInputs): host-served calls read them instead of downloading
  // (HostContentsOf), and a bucket program that needs the buffer at another
  // size uploads it again from here instead of compiling a resize program
  // per (size, size) pair (ResizeStorageBuffer). A copy of the uploaded
  // bytes, or the uploaded memory itself where the uploader hands it over
  // (UploadStorage's `keep`: a host-served call's result). Always the same
  // bytes as the buffer's first ones: every write replaces the
  // StorageBuffer (DeviceStorage::Set), sets it anew
  // (Runtime::OverwriteInPlace) or drops it (a zero-copy collective writing
  // the buffer's memory, csrc/distributed/process_group.cpp Direct).
  HostContents host;
};
// Host uploads up to this size keep StorageBuffer::host (1 MiB).
constexpr size_t kHostShadowMaxBytes = size_t{1} << 20;

// Appends to `into` the checks of `from` not known to have passed, each
// once (a program's inputs -> the checks its outputs inherit).
void InheritChecks(CheckList& into, const CheckList& from);
// Gives a program's output `out` the checks it inherited from the
// program's inputs and the program's own (the states AddPendingCheck
// returned). A no-op when both are empty.
void PoisonWith(StorageBuffer& out, const CheckList& inherited, const CheckList& own);
// Raises the error of the first failed check in `checks` (RuntimeError for
// a value check, IndexError for an index check: the original op's
// message). `resolve`: reads the flag of pending ones first (blocks until
// their program ran: for reads to the host); else pending ones are skipped.
void RaiseIfPoisoned(const CheckList& checks, bool resolve);

// The object behind a `tpu` storage's data pointer. Owns the storage's
// current PJRT buffer; writers swap in a new one (DESIGN.md, "Memory model").
// An empty buffer means "never written": readers see zeros.
class DeviceStorage {
 public:
  DeviceStorage(size_t nbytes, int device_index);
  ~DeviceStorage();
  DeviceStorage(const DeviceStorage&) = delete;
  DeviceStorage& operator=(const DeviceStorage&) = delete;

  size_t nbytes() const { return nbytes_; }
  int device_index() const { return device_index_; }
  // element and numel are valid when initialized(); buffer only when not
  // pending.
  const StorageBuffer& current() const { return current_; }
  // A storage holding only failed checks (a fused region's call that did
  // not run, FusedExecutor::PoisonCall) is initialized: readers raise.
  bool initialized() const { return current_.buffer != nullptr || pending_ || !current_.checks.empty(); }
  // A value computed by a fused region that has not run yet.
  bool pending() const { return pending_; }
  void MarkPending(hlo::ElementType element, int64_t numel) {
    pending_ = true;
    current_ = StorageBuffer{nullptr, element, numel, "fused region"};
    write_id_ = NextWriteId();
  }
  void Set(StorageBuffer buffer) {
    pending_ = false;
    current_ = std::move(buffer);
    write_id_ = NextWriteId();
  }
  // Frees the host copy of the contents (StorageBuffer::host): a program
  // reads the buffer as it is. The contents are unchanged (no new write_id).
  void DropHostShadow() { current_.host = {}; }
  // Changes with every Set/MarkPending and is never the same for two
  // writes of any storages in the process, so a host copy keyed on it
  // (element reads, csrc/aten/kernels.cpp) is never stale — also when the
  // same PJRT buffer was overwritten in place (Runtime::OverwriteInPlace)
  // or a storage reuses a freed one's address.
  uint64_t write_id() const { return write_id_; }
  // The buffer typed as `element`, creating a zero-filled one if the storage
  // was never written. Runs the recorded fused region first when there is
  // one (HasPendingWork: it may write this storage, pending or not), so the
  // buffer is the storage's value in program order. Throws if the storage
  // holds another element type of a different width, and raises the error
  // of a value check known to have failed on the contents (RaiseIfPoisoned)
  // unless `poisoned_ok` (a fused region's inputs: its outputs inherit the
  // failure instead). Checks known to have passed are dropped here.
  // `numel` >= 0 (a program's input slot): a never-written storage gets
  // zeros of exactly that many elements where they hold the storage (no
  // resize program to the slot's size), else of Capacity's.
  const StorageBuffer& Materialize(hlo::ElementType element, bool poisoned_ok = false, int64_t numel = -1);

 private:
  size_t nbytes_;
  int device_index_;
  static uint64_t NextWriteId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }
  bool pending_ = false;
  StorageBuffer current_;
  uint64_t write_id_ = 0;
};

// The contents of `storage` as its element type stores them, for reads on
// the host (a host-served call's or CPU fallback's read-only arguments,
// csrc/aten/fallback.cpp HostMirrors; element reads, kernels.cpp), without
// a download where one is known: the upload's own copy
// (StorageBuffer::host), else a copy made by an earlier call for the same
// write (keyed on DeviceStorage::write_id(): a loop of host-served ops
// over views of one tensor downloaded the whole storage per op, 134 MB for
// bench_dynamic_shapes' offsets table), else one download, kept. Kept:
// kHostContentsMaxEntries copies, kHostContentsMaxBytes in all, the
// oldest dropped first; a copy holds no reference to the device buffer.
// Materializes the storage (a recorded fused region runs first) and raises
// as Runtime::Download does (a failed value check of the contents, an
// execution error naming its producer). `storage` must be initialized().
HostContents HostContentsOf(DeviceStorage& storage);
constexpr size_t kHostContentsMaxEntries = 8;
constexpr size_t kHostContentsMaxBytes = size_t{64} << 20;

// Frees a storage (the allocator's deleter). A pending storage (created by
// a fused region that has not run) is kept until the region has run, so
// that its address cannot be reused by another storage of the same region.
void ReleaseStorage(DeviceStorage* storage);
// The live DeviceStorage whose data pointer is `data` (a storage made by
// at::from_blob over a tpu tensor's data pointer), or nullptr.
DeviceStorage* FindLiveStorage(const void* data);
// Frees the storages ReleaseStorage kept (the fused executor, after a flush).
void ReleaseKeptStorages();
// Devices to ask of a PJRT CPU plugin: TORCH_TPU_CPU_DEVICES, else
// min(4, the cores this process may run on) — the plugin's thread pool has
// max(cores, devices) threads, and its default of 4 devices oversubscribes
// smaller machines. Throws std::invalid_argument naming the variable when
// it is not an integer in [1, 1024].
int64_t CpuDeviceCount();

// Runs the fused executor's recorded region, if any (set by the fused
// executor; a no-op otherwise). Called before a storage is read while a
// region is recorded (DeviceStorage::Materialize) and at every sync point.
void FlushPendingWork();
void SetFlushHook(void (*hook)());
// Sync points so far: Runtime::Sync calls (every copy to the host, item(),
// torch.tpu.synchronize()). The deferral between compiled graphs ends at
// one (executor.h, BeginGraphCall).
uint64_t SyncCount();
// Whether a fused region holds recorded calls that have not run yet (set by
// the fused executor as it records and flushes). While it does, any
// storage's buffer may be stale: a recorded call may write it in place
// (an optimizer step writing a parameter) without making it pending.
bool HasPendingWork();
void SetPendingWork(bool recorded);

// A launch's random state from tpu generator `gen`: its (seed, offset),
// the offset then advanced by `increment` (values drawn, counted as
// LoweringContext::RngIncrementOf). The tpu generator (aten/generator.cpp)
// sets the hook: it draws under its own lock, not gen.mutex(), because its
// state accessors flush the recorded fused region first (whose launches
// draw here) while PyTorch's callers hold gen.mutex() (THPGenerator's
// get_state). A tpu generator without the hook set raises; another
// device's generator is drawn from under gen.mutex().
std::array<uint64_t, 2> DrawRngState(at::Generator gen, uint64_t increment);
void SetRngDrawHook(std::array<uint64_t, 2> (*hook)(c10::GeneratorImpl& gen, uint64_t increment));

class Runtime {
 public:
  // The plugin to load; must be called before the first Get() to take
  // effect (the Python package discovers it, DESIGN.md "Plugins").
  static void SetPluginPath(std::string path);
  static const std::string& PluginPath();
  // Loads the plugin and creates the client on first use; throws
  // pjrt::Error naming the plugin path on failure.
  static Runtime& Get();
  static bool Initialized();

  pjrt::Client& client() { return *client_; }
  int device_count() const { return static_cast<int>(client_->addressable_devices().size()); }
  const pjrt::Device& device(int index) const;
  const pjrt::CompileOptions& compile_options() const { return compile_options_; }
  Metrics& metrics() { return metrics_; }

  // Host data (`nbytes`, a whole number of `element`s) -> a storage buffer
  // of Capacity(nbytes / element size) elements (the padding is zeros,
  // staged on the host only when there is any). Counts `nbytes` as
  // transferred.
  // `numel` >= 0: a buffer of exactly that many elements instead (at least
  // nbytes / element size; what a program's output slot has). Up to
  // kHostShadowMaxBytes, the bytes are kept as StorageBuffer::host: copied,
  // or, where `keep` is given, `data` itself, kept alive by `keep` — the
  // caller hands that memory over and nothing may write it any more (a
  // host-served call's result, csrc/aten/fallback.cpp ServeOnHost).
  StorageBuffer UploadStorage(const void* data, size_t nbytes, hlo::ElementType element, int device_index,
                              std::string producer, int64_t numel = -1, std::shared_ptr<const void> keep = nullptr);
  // Host data (dense, row-major) -> a new device buffer.
  std::shared_ptr<pjrt::Buffer> Upload(const void* data, hlo::ElementType element,
                                       std::span<const int64_t> dims, int device_index);
  // A 0-d device buffer holding `bytes` (the value's bit pattern): buffers
  // are immutable, so recent ones are shared (learning rates, alpha=1 and
  // other repeated scalars cost no transfer).
  std::shared_ptr<pjrt::Buffer> ScalarBuffer(const void* bytes, hlo::ElementType element, int device_index);

  // Host data (dense, row-major, the buffer's first nbytes: a storage's
  // bytes, the capacity's padding left as it is) written into
  // `buffer`'s existing device buffer in place, where that is safe: the
  // storage is the buffer's only holder (use_count 1: no other storage,
  // pending check or kept debug input), no tracked launch is running (none
  // can be reading it) and the plugin's buffers are host memory
  // (pjrt::Buffer::FromHostInPlace). Returns false, changing nothing,
  // otherwise; the caller then uploads a new buffer. Saves the fresh
  // allocation's page faults of an Upload on the CPU plugin.
  bool OverwriteInPlace(StorageBuffer& buffer, const void* data, size_t nbytes);
  // The first `nbytes` of a device buffer (at most its size: a storage's
  // bytes without the capacity's padding) -> host, blocking; an execution
  // error is rethrown naming `producer`, a failed value check of the
  // contents raised with its op's message (RaiseIfPoisoned, resolving).
  void Download(const StorageBuffer& buffer, void* dst, size_t nbytes);

  // Value and index checks computed by launched programs (a pred scalar
  // each: true means a value was bad). Sync() resolves them all and raises
  // the first failing check's error (IndexError, or RuntimeError for a
  // ValueCheckMessage), as CPU would have raised at the op (XLA clamps
  // out-of-range gathers silently, divides by zero without a trap). The
  // returned state must be given to every storage buffer the program wrote
  // (PoisonWith), so the failure is raised again at each later read of
  // them and of values computed from them. Entry point for every executor
  // (single ops, fused regions, compiled graphs).
  std::shared_ptr<CheckState> AddPendingCheck(std::shared_ptr<pjrt::Buffer> flag, std::string message);
  // The message of a value check (LoweringContext::check): raised as
  // RuntimeError; other check messages raise IndexError.
  static std::string ValueCheckMessage(const std::string& message);

  // In-flight executions: an event per launch, named by its op. Sync()
  // waits for all and rethrows the first failure naming its op. Track drops
  // the completed launches at the queue's front (a failed one stays for
  // Sync to report).
  void Track(std::unique_ptr<pjrt::Event> event, std::string op_name);
  void Sync();
  // The pjrt::Buffer deferral hook (pjrt::Buffer::SetDeferDestroyHook, set
  // when the runtime is created): a buffer dropped while launches are in
  // flight is destroyed once every launch tracked so far has completed (when
  // Track or Sync drops the newest of them), so that the host never waits in
  // PJRT_Buffer_Destroy for an execution queued behind others. Returns false
  // (destroy now) when nothing is in flight.
  bool DeferDestroy(const std::shared_ptr<pjrt::Plugin>& plugin, PJRT_Buffer* handle);

  // True when every tracked launch has completed (failed ones included).
  bool Idle();

  // Memory accounting of live storages (bytes). OnAllocate throws
  // c10::OutOfMemoryError (torch.OutOfMemoryError), naming the size and the
  // device, when the live storages plus `nbytes` would exceed the device's
  // total memory (TotalMemory) or the limit set by SetMemoryLimit; nothing is
  // counted then.
  void OnAllocate(int64_t nbytes, int device_index);
  void OnFree(int64_t nbytes);
  int64_t allocated_bytes() const { return allocated_.load(); }
  int64_t peak_allocated_bytes() const { return peak_.load(); }
  int64_t num_allocs() const { return num_allocs_.load(); }
  void ResetPeak() { peak_.store(allocated_.load()); }
  // Bytes of memory of a device: PJRT_Device_MemoryStats' bytes_limit where
  // the plugin reports it; on the CPU plugin (which does not implement it)
  // the host's physical memory; 0 where unknown (then only the limit below
  // applies).
  int64_t TotalMemory(int device_index);
  // Limit on the bytes of live storages (torch.tpu.set_per_process_memory_fraction);
  // 0 removes it.
  void SetMemoryLimit(int64_t bytes) { limit_.store(bytes); }
  int64_t memory_limit() const { return limit_.load(); }

 private:
  Runtime() {
    for (auto& t : total_memory_) t.store(-1);
  }
  std::shared_ptr<pjrt::Client> client_;
  pjrt::CompileOptions compile_options_;
  Metrics metrics_;
  struct ScalarKey {
    uint64_t bits[2];  // the value's bit pattern (16 bytes: complex128)
    hlo::ElementType element;
    int device;
    bool operator==(const ScalarKey&) const = default;
  };
  std::mutex scalar_mutex_;
  std::vector<std::pair<ScalarKey, std::shared_ptr<pjrt::Buffer>>> scalars_;  // most recent last
  std::mutex checks_mutex_;
  CheckList checks_;
  struct DeadBuffer {
    std::shared_ptr<pjrt::Plugin> plugin;
    PJRT_Buffer* handle;
  };
  struct InFlight {
    std::unique_ptr<pjrt::Event> event;
    std::string op_name;
    std::vector<DeadBuffer> dead;  // dropped after this launch was tracked: destroyed once it completed
  };
  static void DestroyDead(std::vector<DeadBuffer>& dead);
  std::mutex inflight_mutex_;
  std::deque<InFlight> inflight_;
  std::atomic<int64_t> allocated_{0}, peak_{0}, num_allocs_{0}, limit_{0};
  static constexpr int kMaxDevices = 256;
  std::atomic<int64_t> total_memory_[kMaxDevices];  // TotalMemory per device; -1 until asked
};

// Throws c10::OutOfMemoryError: "tpu out of memory: tried to allocate
// <size> (<n> bytes) on tpu:<device>" followed by `detail`.
[[noreturn]] void ThrowOutOfMemory(int64_t requested, int device_index, const std::string& detail);
// A PJRT failure of `what` (an op name) on a device: RESOURCE_EXHAUSTED
// becomes c10::OutOfMemoryError naming the size the plugin reports ("Out of
// memory allocating N bytes") and the device; anything else is rethrown as
// std::runtime_error "tpu: <what> failed: <plugin message>".
[[noreturn]] void RethrowDeviceError(const pjrt::Error& e, const std::string& what, int device_index);

// A torch.profiler event named "<kind> <name>" (e.g. "tpu::execute
// aten::add.Tensor") lasting the scope. With no profiler (no RecordFunction
// callbacks) the cost is at::RecordFunction's thread-local check and `name`
// is not copied.
class ProfileScope {
 public:
  ProfileScope(const char* kind, const std::string& name) : guard_(at::RecordScope::FUNCTION) {
    if (guard_.isActive()) guard_.before(std::string(kind) + " " + name);
  }
  bool active() const { return guard_.isActive(); }
  // While profiling, waits for a launch to complete, so that the event lasts
  // the execution and not only the enqueueing (launches are asynchronous).
  // A failure is not raised here: the tracked event reports it at the next
  // sync point.
  void AwaitIfActive(pjrt::Event* done) {
    if (!done || !guard_.isActive()) return;
    try {
      done->Await();
    } catch (const pjrt::Error&) {
    }
  }

 private:
  at::RecordFunction guard_;
};

// Element type <-> PJRT buffer type.
PJRT_Buffer_Type ToPjrtType(hlo::ElementType t);
size_t ElementSize(hlo::ElementType t);

}  // namespace torch_tpu::runtime
