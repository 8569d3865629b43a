#include "runtime/runtime.h"
#include "runtime/env.h"

#include <c10/util/Exception.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>
#include <unordered_set>
#include <vector>

namespace torch_tpu::runtime {
namespace {
std::string& PluginPathStorage() {
  static std::string path;
  return path;
}
std::mutex init_mutex;
Runtime* instance = nullptr;
}  // namespace

PJRT_Buffer_Type ToPjrtType(hlo::ElementType t) {
  using E = hlo::ElementType;
  switch (t) {
    case E::kPred: return PJRT_Buffer_Type_PRED;
    case E::kS8: return PJRT_Buffer_Type_S8;
    case E::kS16: return PJRT_Buffer_Type_S16;
    case E::kS32: return PJRT_Buffer_Type_S32;
    case E::kS64: return PJRT_Buffer_Type_S64;
    case E::kU8: return PJRT_Buffer_Type_U8;
    case E::kU16: return PJRT_Buffer_Type_U16;
    case E::kU32: return PJRT_Buffer_Type_U32;
    case E::kU64: return PJRT_Buffer_Type_U64;
    case E::kF16: return PJRT_Buffer_Type_F16;
    case E::kBF16: return PJRT_Buffer_Type_BF16;
    case E::kF32: return PJRT_Buffer_Type_F32;
    case E::kF64: return PJRT_Buffer_Type_F64;
    case E::kC64: return PJRT_Buffer_Type_C64;
    case E::kC128: return PJRT_Buffer_Type_C128;
    case E::kF8E5M2: return PJRT_Buffer_Type_F8E5M2;
    case E::kF8E4M3FN: return PJRT_Buffer_Type_F8E4M3FN;
    case E::kF8E5M2FNUZ: return PJRT_Buffer_Type_F8E5M2FNUZ;
    case E::kF8E4M3FNUZ: return PJRT_Buffer_Type_F8E4M3FNUZ;
    case E::kF8E8M0FNU: return PJRT_Buffer_Type_F8E8M0FNU;
  }
  return PJRT_Buffer_Type_INVALID;
}

size_t ElementSize(hlo::ElementType t) {
  int bits = hlo::BitWidth(t);
  return bits == 1 ? 1 : static_cast<size_t>(bits / 8);
}

namespace {
// Every live DeviceStorage, so that a storage made by at::from_blob over a
// tpu data pointer (PyTorch's legacy serialization does this to copy a
// storage to the host) can be traced back to its DeviceStorage.
std::mutex live_mutex;
std::unordered_set<const void*>& LiveStorages() {
  static auto* live = new std::unordered_set<const void*>();
  return *live;
}
}  // namespace

DeviceStorage::DeviceStorage(size_t nbytes, int device_index)
    : nbytes_(nbytes), device_index_(device_index) {
  Runtime::Get().OnAllocate(static_cast<int64_t>(nbytes), device_index);
  std::lock_guard<std::mutex> lock(live_mutex);
  LiveStorages().insert(this);
}

DeviceStorage* FindLiveStorage(const void* data) {
  std::lock_guard<std::mutex> lock(live_mutex);
  return LiveStorages().count(data) ? static_cast<DeviceStorage*>(const_cast<void*>(data)) : nullptr;
}

namespace {

std::string HumanBytes(int64_t n) {
  static const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(n));
  else std::snprintf(buf, sizeof(buf), "%.2f %s", v, units[u]);
  return buf;
}

// The N of "... allocating N bytes" in an XLA message, or -1.
int64_t BytesInMessage(const std::string& message) {
  auto pos = message.find("allocating ");
  if (pos == std::string::npos) return -1;
  pos += 11;
  int64_t n = 0;
  bool any = false;
  while (pos < message.size() && std::isdigit(static_cast<unsigned char>(message[pos]))) {
    n = n * 10 + (message[pos++] - '0');
    any = true;
  }
  return any ? n : -1;
}

}  // namespace

void ThrowOutOfMemory(int64_t requested, int device_index, const std::string& detail) {
  std::string size = requested >= 0 ? HumanBytes(requested) + " (" + std::to_string(requested) + " bytes)"
                                     : std::string("memory");
  std::string where = device_index >= 0 ? " on tpu:" + std::to_string(device_index) : std::string();
  TORCH_CHECK_WITH(OutOfMemoryError, false, "tpu out of memory: tried to allocate ", size, where, ". ", detail);
  throw std::logic_error("unreachable");
}

void RethrowDeviceError(const pjrt::Error& e, const std::string& what, int device_index) {
  std::string message = e.what();
  if (e.code() == PJRT_Error_Code_RESOURCE_EXHAUSTED ||
      message.find("Out of memory") != std::string::npos) {
    std::string detail = what + " failed: " + message;
    if (instance) detail += " (" + HumanBytes(instance->allocated_bytes()) + " held by live tpu tensors)";
    ThrowOutOfMemory(BytesInMessage(message), device_index, detail);
  }
  throw std::runtime_error("tpu: " + what + " failed: " + message);
}

DeviceStorage::~DeviceStorage() {
  if (instance) instance->OnFree(static_cast<int64_t>(nbytes_));
  std::lock_guard<std::mutex> lock(live_mutex);
  LiveStorages().erase(this);
}

namespace {
void (*flush_hook)() = nullptr;
std::atomic<bool> pending_work{false};
}  // namespace

void SetFlushHook(void (*hook)()) { flush_hook = hook; }
namespace {
std::atomic<uint64_t> sync_count{0};
}  // namespace
uint64_t SyncCount() { return sync_count.load(std::memory_order_acquire); }
bool HasPendingWork() { return pending_work.load(std::memory_order_acquire); }
void SetPendingWork(bool recorded) { pending_work.store(recorded, std::memory_order_release); }

namespace {
std::mutex kept_mutex;
std::vector<DeviceStorage*> kept_storages;
}  // namespace

void ReleaseStorage(DeviceStorage* storage) {
  if (storage->pending()) {
    std::lock_guard<std::mutex> lock(kept_mutex);
    kept_storages.push_back(storage);
    return;
  }
  delete storage;
}

void ReleaseKeptStorages() {
  std::vector<DeviceStorage*> kept;
  {
    std::lock_guard<std::mutex> lock(kept_mutex);
    kept.swap(kept_storages);
  }
  for (DeviceStorage* s : kept) delete s;
}
void FlushPendingWork() {
  if (flush_hook) flush_hook();
}

namespace {
std::atomic<std::array<uint64_t, 2> (*)(c10::GeneratorImpl&, uint64_t)> rng_draw_hook{nullptr};
}  // namespace

void SetRngDrawHook(std::array<uint64_t, 2> (*hook)(c10::GeneratorImpl& gen, uint64_t increment)) {
  rng_draw_hook.store(hook, std::memory_order_release);
}

std::array<uint64_t, 2> DrawRngState(at::Generator gen, uint64_t increment) {
  auto* hook = rng_draw_hook.load(std::memory_order_acquire);
  if (gen.device().type() == c10::DeviceType::PrivateUse1) {
    // The tpu generator's accessors run the recorded region: never called
    // from a launch (it may be that region's).
    TORCH_CHECK(hook != nullptr, "tpu: no random draw hook is set for the tpu generator");
    return hook(*gen.unsafeGetGeneratorImpl(), increment);
  }
  std::lock_guard<std::mutex> lock(gen.mutex());
  std::array<uint64_t, 2> state{gen.current_seed(), gen.get_offset()};
  gen.set_offset(state[1] + increment);
  return state;
}

int64_t Capacity(int64_t numel) {
  if (numel <= 0) return 0;
  if (numel <= 16) return 16;
  const int64_t p = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(numel - 1)));  // n in (p, 2p]
  const int64_t step = p / 8;
  return (numel + step - 1) / step * step;
}

const StorageBuffer& DeviceStorage::Materialize(hlo::ElementType element, bool poisoned_ok, int64_t slot_numel) {
  // A recorded region may write this storage in place (not pending then):
  // reading before it ran would see the value from before those writes.
  if (pending_ || HasPendingWork()) FlushPendingWork();
  if (pending_)
    throw std::runtime_error(
        "tpu: this tensor has no value: the fused region that was to compute it failed (the error was raised "
        "when it ran)");
  if (!current_.checks.empty()) {
    std::erase_if(current_.checks, [](const std::shared_ptr<CheckState>& c) {
      return c->state.load(std::memory_order_acquire) == CheckState::kOk;
    });
    if (!poisoned_ok) RaiseIfPoisoned(current_.checks, /*resolve=*/false);
  }
  if (current_.buffer) {
    if (ElementSize(current_.element) != ElementSize(element))
      throw std::runtime_error(std::string("tpu storage holds ") + std::string(hlo::MlirName(current_.element)) +
                               " elements and cannot be read as " + std::string(hlo::MlirName(element)));
    return current_;
  }
  const int64_t elements = static_cast<int64_t>(nbytes_ / ElementSize(element));
  int64_t numel = slot_numel >= elements && slot_numel > 0 ? slot_numel : Capacity(elements);
  std::vector<char> zeros;
  try {
    zeros.assign(static_cast<size_t>(numel) * ElementSize(element), 0);
  } catch (const std::bad_alloc&) {
    ThrowOutOfMemory(static_cast<int64_t>(nbytes_), device_index_,
                     "The zeros of a never-written storage are staged on the host, which could not allocate them.");
  }
  int64_t dims[] = {numel};
  current_.buffer = Runtime::Get().Upload(zeros.data(), element, dims, device_index_);
  current_.element = element;
  current_.numel = numel;
  current_.producer = "empty";
  return current_;
}

int64_t CpuDeviceCount() {
  if (const char* e = std::getenv("TORCH_TPU_CPU_DEVICES"); e && *e)
    return EnvInteger("TORCH_TPU_CPU_DEVICES", 0, 1, 1024, "the number of CPU plugin devices, an integer from 1 to 1024");
  cpu_set_t set;
  int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cores <= 0) cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::min<int64_t>(4, cores);
}

void Runtime::SetPluginPath(std::string path) { PluginPathStorage() = std::move(path); }
const std::string& Runtime::PluginPath() { return PluginPathStorage(); }
bool Runtime::Initialized() { return instance != nullptr; }

Runtime& Runtime::Get() {
  if (instance) return *instance;
  std::lock_guard<std::mutex> lock(init_mutex);
  if (instance) return *instance;
  std::string path = PluginPathStorage();
  if (path.empty()) {
    const char* env = std::getenv("TORCH_TPU_PJRT_PLUGIN");
    if (env) path = env;
  }
  if (path.empty())
    throw pjrt::Error("torch_tpu: no PJRT plugin configured (set TORCH_TPU_PJRT_PLUGIN or import torch_tpu)");
  auto* rt = new Runtime();
  // XLA plugins log INFO lines to stderr (the CPU plugin: one per client
  // created with options); as PyTorch users expect, only warnings and errors
  // are shown unless the user set the level.
  setenv("TF_CPP_MIN_LOG_LEVEL", "1", /*overwrite=*/0);
  auto plugin = pjrt::Plugin::Load(path);
  rt->client_ = pjrt::Client::Create(plugin);
  if (rt->client_->platform_name() == "cpu") {
    // The CPU plugin sizes its intra-op thread pool to max(cores, devices)
    // and defaults to 4 devices: on fewer cores that oversubscribes them.
    const int64_t want = CpuDeviceCount();
    if (want != static_cast<int64_t>(rt->client_->addressable_devices().size())) {
      rt->client_.reset();
      rt->client_ = pjrt::Client::Create(plugin, {{"cpu_device_count", want}});
    }
  }
  if (rt->client_->addressable_devices().empty())
    throw pjrt::Error("torch_tpu: plugin " + path + " reports no addressable devices");
  // PyTorch propagates NaN through max/min; the CPU plugin's fast min/max
  // does not (DESIGN.md, "Facts from the field").
  if (rt->client_->platform_name() == "cpu")
    rt->compile_options_.env_option_overrides.emplace_back("xla_cpu_enable_fast_min_max", "false");
  instance = rt;
  pjrt::Buffer::SetDeferDestroyHook(+[](const std::shared_ptr<pjrt::Plugin>& plugin, PJRT_Buffer* handle) {
    return instance != nullptr && instance->DeferDestroy(plugin, handle);
  });
  return *instance;
}

const pjrt::Device& Runtime::device(int index) const {
  const auto& devices = client_->addressable_devices();
  if (index < 0 || index >= static_cast<int>(devices.size()))
    throw std::out_of_range("tpu device index " + std::to_string(index) + " out of range (" +
                            std::to_string(devices.size()) + " devices)");
  return devices[static_cast<size_t>(index)];
}

std::shared_ptr<pjrt::Buffer> Runtime::Upload(const void* data, hlo::ElementType element,
                                              std::span<const int64_t> dims, int device_index) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  metrics_.host_to_device_bytes += n * static_cast<int64_t>(ElementSize(element));
  try {
    return client_->BufferFromHost(data, ToPjrtType(element), dims, device(device_index));
  } catch (const pjrt::Error& e) {
    RethrowDeviceError(e, "a host-to-device copy of " + HumanBytes(n * static_cast<int64_t>(ElementSize(element))),
                       device_index);
  }
}

namespace {
// A copy of `n` bytes at `data`, as StorageBuffer::host holds one.
HostContents CopiedHostContents(const void* data, size_t n) {
  auto copy = std::make_shared<const std::vector<char>>(static_cast<const char*>(data),
                                                        static_cast<const char*>(data) + n);
  return {copy, copy->data(), n};
}
}  // namespace

StorageBuffer Runtime::UploadStorage(const void* data, size_t nbytes, hlo::ElementType element, int device_index,
                                     std::string producer, int64_t buffer_numel, std::shared_ptr<const void> keep) {
  const size_t esize = ElementSize(element);
  const int64_t numel = static_cast<int64_t>(nbytes / esize);
  if (buffer_numel >= 0 && buffer_numel < numel)
    throw std::logic_error("UploadStorage: a buffer of " + std::to_string(buffer_numel) + " elements cannot hold " +
                           std::to_string(numel));
  const int64_t capacity = buffer_numel >= 0 ? buffer_numel : Capacity(numel);
  int64_t dims[] = {capacity};
  std::shared_ptr<pjrt::Buffer> buffer;
  if (capacity == numel) {
    buffer = Upload(data, element, dims, device_index);
  } else {
    std::vector<char> padded;
    try {
      padded.assign(static_cast<size_t>(capacity) * esize, 0);
    } catch (const std::bad_alloc&) {
      ThrowOutOfMemory(static_cast<int64_t>(nbytes), device_index, "The host staging copy could not be allocated.");
    }
    if (nbytes) std::memcpy(padded.data(), data, static_cast<size_t>(numel) * esize);
    buffer = Upload(padded.data(), element, dims, device_index);
    metrics_.host_to_device_bytes -= (capacity - numel) * static_cast<int64_t>(esize);  // padding: not data
  }
  StorageBuffer sb{std::move(buffer), element, capacity, std::move(producer)};
  if (nbytes <= kHostShadowMaxBytes) {
    const size_t stored = static_cast<size_t>(numel) * esize;
    sb.host = keep ? HostContents{std::move(keep), static_cast<const char*>(data), stored}
                   : CopiedHostContents(data, stored);
  }
  return sb;
}

std::shared_ptr<pjrt::Buffer> Runtime::ScalarBuffer(const void* bytes, hlo::ElementType element,
                                                    int device_index) {
  ScalarKey key{{0, 0}, element, device_index};
  std::memcpy(key.bits, bytes, std::min(sizeof(key.bits), ElementSize(element)));
  std::lock_guard<std::mutex> lock(scalar_mutex_);
  for (auto it = scalars_.rbegin(); it != scalars_.rend(); ++it)
    if (it->first == key) return it->second;
  constexpr size_t kMaxScalars = 64;
  if (scalars_.size() >= kMaxScalars) scalars_.erase(scalars_.begin());
  scalars_.emplace_back(key, Upload(bytes, element, {}, device_index));
  return scalars_.back().second;
}

bool Runtime::OverwriteInPlace(StorageBuffer& buffer, const void* data, size_t nbytes) {
  if (!buffer.buffer || buffer.buffer.use_count() != 1 || !Idle()) return false;
  if (!buffer.buffer->FromHostInPlace(data, nbytes)) return false;
  metrics_.host_to_device_bytes += static_cast<int64_t>(nbytes);
  buffer.checks.clear();  // new contents from the host: no check guards them
  buffer.host = nbytes <= kHostShadowMaxBytes ? CopiedHostContents(data, nbytes) : HostContents{};
  return true;
}

void Runtime::Download(const StorageBuffer& buffer, void* dst, size_t nbytes) {
  if (!buffer.checks.empty()) RaiseIfPoisoned(buffer.checks, /*resolve=*/true);
  metrics_.device_to_host_bytes += static_cast<int64_t>(nbytes);
  try {
    buffer.buffer->ToHost(dst, nbytes);
  } catch (const pjrt::Error& e) {
    RethrowDeviceError(e, buffer.producer, -1);
  }
}

namespace {
struct KeptContents {
  uint64_t write_id = 0;
  std::shared_ptr<const std::vector<char>> bytes;
};
std::mutex kept_contents_mutex;
std::deque<KeptContents> kept_contents;  // oldest first
size_t kept_contents_bytes = 0;
}  // namespace

HostContents HostContentsOf(DeviceStorage& storage) {
  const StorageBuffer& cur = storage.Materialize(storage.current().element);
  const size_t stored = std::min(static_cast<size_t>(cur.numel) * ElementSize(cur.element), storage.nbytes());
  if (cur.host.owner && cur.host.size >= stored) {
    if (!cur.checks.empty()) RaiseIfPoisoned(cur.checks, /*resolve=*/true);  // as Download
    return {cur.host.owner, cur.host.data, stored};
  }
  const uint64_t id = storage.write_id();
  {
    std::lock_guard<std::mutex> lock(kept_contents_mutex);
    for (const auto& k : kept_contents)
      if (k.write_id == id && k.bytes->size() >= stored) return {k.bytes, k.bytes->data(), stored};
  }
  auto bytes = std::make_shared<std::vector<char>>();
  try {
    bytes->resize(stored);
  } catch (const std::bad_alloc&) {
    ThrowOutOfMemory(static_cast<int64_t>(stored), storage.device_index(), "The host copy could not be allocated.");
  }
  Runtime::Get().Download(cur, bytes->data(), stored);
  if (stored <= kHostContentsMaxBytes) {
    std::lock_guard<std::mutex> lock(kept_contents_mutex);
    kept_contents.push_back({id, bytes});
    kept_contents_bytes += stored;
    while (kept_contents.size() > kHostContentsMaxEntries || kept_contents_bytes > kHostContentsMaxBytes) {
      kept_contents_bytes -= kept_contents.front().bytes->size();
      kept_contents.pop_front();
    }
  }
  return {bytes, bytes->data(), stored};
}

void Runtime::DestroyDead(std::vector<DeadBuffer>& dead) {
  for (auto& d : dead) pjrt::Buffer::DestroyHandle(*d.plugin, d.handle);
  dead.clear();
}

bool Runtime::DeferDestroy(const std::shared_ptr<pjrt::Plugin>& plugin, PJRT_Buffer* handle) {
  std::lock_guard<std::mutex> lock(inflight_mutex_);
  if (inflight_.empty()) return false;
  inflight_.back().dead.push_back(DeadBuffer{plugin, handle});
  return true;
}

void Runtime::Track(std::unique_ptr<pjrt::Event> event, std::string op_name) {
  std::vector<DeadBuffer> dead;
  std::vector<std::unique_ptr<pjrt::Event>> done;
  {
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    // Drop completed launches from the front, in launch order: a buffer
    // dropped after a launch was tracked may be read by it or by any
    // launch before it, so it is destroyed (without waiting) once they
    // all completed. A failed launch stays for Sync() to report.
    while (!inflight_.empty() && inflight_.front().event->IsReady()) {
      try {
        inflight_.front().event->Await();
      } catch (const pjrt::Error&) {
        break;
      }
      auto& front = inflight_.front();
      dead.insert(dead.end(), front.dead.begin(), front.dead.end());
      done.push_back(std::move(front.event));
      inflight_.pop_front();
    }
    inflight_.push_back(InFlight{std::move(event), std::move(op_name), {}});
  }
  DestroyDead(dead);  // outside the lock: nothing here may re-enter DeferDestroy under it
}

namespace {
// Value-check messages carry this first byte (stripped when raised), so one
// list of pending checks serves IndexError and RuntimeError checks.
constexpr char kValueCheckMark = '\x01';

// Reads a pending check's flag (once; later callers see the state).
// Returns whether it failed.
bool Resolve(CheckState& check) {
  uint8_t state = check.state.load(std::memory_order_acquire);
  if (state != CheckState::kPending) return state == CheckState::kFailed;
  std::lock_guard<std::mutex> lock(check.mutex);
  state = check.state.load(std::memory_order_acquire);
  if (state != CheckState::kPending) return state == CheckState::kFailed;
  bool failed = false;
  check.flag->ToHost(&failed, sizeof(failed));
  check.flag.reset();
  check.state.store(failed ? CheckState::kFailed : CheckState::kOk, std::memory_order_release);
  return failed;
}

[[noreturn]] void Raise(CheckState& check) {
  check.raised.store(true, std::memory_order_release);
  const std::string& message = check.message;
  if (!message.empty() && message[0] == kValueCheckMark) TORCH_CHECK(false, message.substr(1));
  TORCH_CHECK_INDEX(false, message);
}

// Resolves every check of `checks`, then raises the first failed one not
// raised before (a poisoned read may have reported it already).
void ResolveAll(const CheckList& checks) {
  CheckState* first_failed = nullptr;
  for (const auto& c : checks)
    if (Resolve(*c) && !first_failed && !c->raised.load(std::memory_order_acquire)) first_failed = c.get();
  if (first_failed) Raise(*first_failed);
}
}  // namespace

void InheritChecks(CheckList& into, const CheckList& from) {
  for (const auto& c : from) {
    if (c->state.load(std::memory_order_acquire) == CheckState::kOk) continue;
    if (std::find(into.begin(), into.end(), c) == into.end()) into.push_back(c);
  }
}

void PoisonWith(StorageBuffer& out, const CheckList& inherited, const CheckList& own) {
  if (inherited.empty() && own.empty()) return;
  InheritChecks(out.checks, inherited);
  InheritChecks(out.checks, own);
}

void RaiseIfPoisoned(const CheckList& checks, bool resolve) {
  for (const auto& c : checks) {
    bool failed = resolve ? Resolve(*c) : c->state.load(std::memory_order_acquire) == CheckState::kFailed;
    if (failed) Raise(*c);
  }
}

std::string Runtime::ValueCheckMessage(const std::string& message) { return kValueCheckMark + message; }

std::shared_ptr<CheckState> Runtime::AddPendingCheck(std::shared_ptr<pjrt::Buffer> flag, std::string message) {
  auto check = std::make_shared<CheckState>();
  check->flag = std::move(flag);
  check->message = std::move(message);
  CheckList due;
  {
    std::lock_guard<std::mutex> lock(checks_mutex_);
    checks_.push_back(check);
    if (checks_.size() >= 1024) due.swap(checks_);  // bound the memory of a program that never syncs
  }
  ResolveAll(due);
  return check;
}

void Runtime::Sync() {
  sync_count.fetch_add(1, std::memory_order_acq_rel);
  FlushPendingWork();
  std::deque<InFlight> pending;
  {
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    pending.swap(inflight_);
  }
  std::optional<pjrt::Error> first_error;
  std::string first_name;
  for (auto& entry : pending) {
    try {
      entry.event->Await();
    } catch (const pjrt::Error& e) {
      if (!first_error) {
        first_error = e;
        first_name = entry.op_name;
      }
    }
  }
  // Every launch tracked before Sync has completed: the buffers dropped
  // meanwhile are destroyed without waiting.
  for (auto& entry : pending) DestroyDead(entry.dead);
  if (first_error) RethrowDeviceError(*first_error, first_name, -1);
  CheckList checks;
  {
    std::lock_guard<std::mutex> lock(checks_mutex_);
    checks.swap(checks_);
  }
  ResolveAll(checks);  // all resolved (the storages they guard raise later), the first failure raised
}

bool Runtime::Idle() {
  std::lock_guard<std::mutex> lock(inflight_mutex_);
  for (const auto& entry : inflight_)
    if (!entry.event->IsReady()) return false;
  return true;
}

int64_t Runtime::TotalMemory(int device_index) {
  const bool cacheable = device_index >= 0 && device_index < kMaxDevices;
  if (cacheable) {
    int64_t known = total_memory_[device_index].load(std::memory_order_relaxed);
    if (known >= 0) return known;
  }
  int64_t total = 0;
  auto stats = client_->memory_stats(device(device_index));
  if (stats && stats->bytes_limit) {
    total = *stats->bytes_limit;
  } else if (client_->platform_name() == "cpu") {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) total = static_cast<int64_t>(pages) * page;
  }
  if (cacheable) total_memory_[device_index].store(total, std::memory_order_relaxed);
  return total;
}

void Runtime::OnAllocate(int64_t nbytes, int device_index) {
  int64_t held = allocated_.load();
  int64_t limit = limit_.load();
  if (limit > 0 && nbytes > 0 && held + nbytes > limit)
    ThrowOutOfMemory(nbytes, device_index,
                     "Live tpu tensors hold " + HumanBytes(held) + " and the limit set by "
                     "torch.tpu.set_per_process_memory_fraction is " + HumanBytes(limit) + ".");
  int64_t total = nbytes > 0 ? TotalMemory(device_index) : 0;
  if (total > 0 && held + nbytes > total)
    ThrowOutOfMemory(nbytes, device_index,
                     "The device has " + HumanBytes(total) + " in total" +
                         (client_->platform_name() == "cpu" ? " (the host's memory, for the CPU plugin)" : "") +
                         " and live tpu tensors hold " + HumanBytes(held) + ".");
  int64_t now = allocated_ += nbytes;
  ++num_allocs_;
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

void Runtime::OnFree(int64_t nbytes) { allocated_ -= nbytes; }

}  // namespace torch_tpu::runtime
