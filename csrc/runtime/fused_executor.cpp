// The fused executor: ops are recorded instead of run. Each call gets its
// outputs at once as tensors whose storages are *pending*; at a sync point
// (a pending storage is read: .cpu(), .item(), printing, a CPU fallback;
// torch.tpu.synchronize(); a metadata change such as resize_/set_; a mode
// switch) or when the region reaches its size bound
// (TORCH_TPU_FUSED_MAX_OPS, default 512 calls), the whole region is lowered
// through the same registry into ONE StableHLO module (ProgramBuilder: the
// storages read become parameters, in-place writes update storage values),
// compiled once per region *structure* and run.
//
// The region's key is the sequence of its calls' keys (op, dtypes, sizes,
// view layouts, static arguments; Scalars and random states are runtime
// inputs), with storages numbered across the region, plus which of the
// region's new storages are still alive at the flush: dead temporaries are
// not outputs, so XLA fuses them away. Values never enter the key.
//
// Recording checks that each call lowers on its own (the eager OpCache
// entry, compiled once per signature); a call that cannot is a sync point
// and runs on the CPU. If the region as a whole fails to build or compile,
// its calls run one by one through their eager executables instead.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/PyInterpreterHooks.h>
#include <c10/core/impl/PyObjectSlot.h>
#include <c10/util/hash.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>

#include "lowering/helpers.h"
#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::runtime {
namespace {

struct RecordedCall {
  c10::OperatorHandle op;
  std::shared_ptr<const CompiledOp> eager;  // validated single-op program (spec, fallback)
  std::vector<c10::IValue> args;    // the call's arguments, kept alive until the flush
  caffe2::TypeMeta default_dtype;   // torch.get_default_dtype() when recorded (lowerings read it)
};

// A storage created by the region: a new output tensor of call `call`.
struct CreatedStorage {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  DeviceStorage* device_storage;
  hlo::ElementType element;
  int64_t numel;
  int32_t call;
  int16_t ret;
};

struct RegionOutput {
  int32_t created = -1;  // index into the region's created storages, or -1
  InputSlot use;         // else: an argument whose storage the region wrote
  hlo::ElementType element;
  int64_t numel;
};

struct CompiledRegion {
  std::unique_ptr<pjrt::Executable> executable;
  std::vector<InputSlot> inputs;
  std::vector<RegionOutput> outputs;
  std::vector<std::string> check_messages;  // outputs after `outputs`: index checks
  std::vector<int64_t> donor_inputs;         // inputs aliased to their storage's new value
};

struct RegionKeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    size_t h = k.size();
    for (int64_t a : k) h = c10::hash_combine(h, std::hash<int64_t>()(a));
    return h;
  }
};

size_t MaxOps() {
  static size_t n = [] {
    const char* e = std::getenv("TORCH_TPU_FUSED_MAX_OPS");
    return e && *e ? static_cast<size_t>(std::max(1, std::atoi(e))) : size_t{512};
  }();
  return n;
}

class FusedExecutor {
 public:
  void Record(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    const size_t num_args = op.schema().arguments().size();
    const size_t first = stack->size() - num_args;
    // Validates the call and gives its spec (throws UnsupportedOp before any
    // side effect: the caller then runs it on the CPU, a sync point).
    std::shared_ptr<const CompiledOp> eager;
    try {
      eager = GlobalOpCache().Lookup(op, *stack, entry);
    } catch (const UnsupportedOp&) {
      FlushLocked();
      throw;
    }
    const CallSpec& spec = eager->spec;
    if (!spec.resize_outputs.empty()) {
      FlushLocked();  // resizing reads and replaces storages
      ApplyResizes(spec, *stack, first);
    }
    // A region runs on one device: a call on another one is a sync point.
    const int device_index = CurrentDeviceIndex(std::span<const c10::IValue>(*stack).subspan(first));
    if (!calls_.empty() && device_index != region_device_) FlushLocked();
    region_device_ = device_index;
    const int32_t call = static_cast<int32_t>(calls_.size());
    key_.push_back(reinterpret_cast<int64_t>(&op.schema()));
    AppendCallKey(op, *stack, first, entry, key_, ids_);

    RecordedCall rc{op, eager,
                    std::vector<c10::IValue>(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end()),
                    c10::get_default_dtype()};
    // CPU tensors among the arguments (0-d runtime scalars: a tensor
    // learning rate) are read when the region runs: copy their values now,
    // as the call would have read them (an LR scheduler's fill_ before the
    // flush must not reach a step recorded earlier).
    for (auto& v : rc.args)
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().is_cpu()) v = v.toTensor().clone();
    // Returns: written arguments as they are, new tensors over pending
    // storages.
    std::vector<c10::IValue> returns;
    for (size_t r = 0; r < spec.outputs.size(); ++r) {
      if (!spec.defined[r]) {
        returns.emplace_back(at::Tensor());
      } else if (spec.return_alias[r] >= 0) {
        returns.push_back(rc.args[static_cast<size_t>(spec.return_alias[r])]);
      } else {
        const auto& out = spec.outputs[r];
        c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_index)));
        at::Tensor t = at::detail::empty_generic(out.sizes, c10::GetAllocator(c10::DeviceType::PrivateUse1),
                                                 c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), out.dtype,
                                                 std::nullopt);
        DeviceStorage& ds = StorageOf(t);
        hlo::ElementType e = lowering::ToElementType(out.dtype);
        ds.MarkPending(e, Capacity(t.numel()));  // the buffer the region will give it
        key_.push_back(-1 - ids_.Id(&ds));  // created here
        created_.push_back({c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl()), &ds, e,
                            Capacity(t.numel()), call, static_cast<int16_t>(r)});
        returns.emplace_back(std::move(t));
      }
    }
    calls_.push_back(std::move(rc));
    SetPendingWork(true);  // from now on every storage read flushes first (Materialize)
    stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
    for (auto& v : returns) stack->push_back(std::move(v));
    if (calls_.size() >= MaxOps()) FlushLocked();
  }

  void Flush() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    FlushLocked();
  }

  size_t size() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    return calls_.size();
  }

  void ClearCache() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    FlushLocked();
    regions_.Clear();
  }

 private:
  static int CurrentDeviceIndex(std::span<const c10::IValue> args) {
    for (const auto& v : args)
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == c10::DeviceType::PrivateUse1)
        return v.toTensor().device().index();
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  }

  void FlushLocked() {
    if (calls_.empty() || flushing_) return;
    flushing_ = true;
    struct Reset {
      FusedExecutor* self;
      ~Reset() {
        self->calls_.clear();
        self->created_.clear();
        self->key_.clear();
        self->ids_.seen.clear();
        self->flushing_ = false;
        SetPendingWork(false);
        ReleaseKeptStorages();
      }
    } reset{this};

    std::vector<c10::intrusive_ptr<c10::StorageImpl>> alive = AliveCreatedStorages();
    for (const auto& a : alive) key_.push_back(a ? 1 : 0);
    std::shared_ptr<CompiledRegion> region = regions_.Find(key_);
    auto& metrics = Runtime::Get().metrics();
    if (region) {
      metrics.cache_hits++;
    } else {
      metrics.cache_misses++;
      try {
        region = regions_.Insert(key_, Build(alive));
      } catch (const std::exception& e) {
        TORCH_WARN_ONCE("torch_tpu: a fused region of ", calls_.size(),
                        " ops could not be compiled as one program; running its ops one by one (", e.what(), ")");
        RunOneByOne(alive);
        return;
      }
    }
    Run(*region, alive);
  }

  // The new storages still referenced from outside the region: only those
  // are outputs (the rest are temporaries XLA can fuse away). A storage is
  // referenced from outside if it, or a tensor over it, has more references
  // than the region's recorded arguments (and our own lock) account for.
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> AliveCreatedStorages() {
    std::unordered_map<c10::TensorImpl*, size_t> recorded;  // TensorImpl -> references held by the region
    std::unordered_map<c10::TensorImpl*, c10::TensorImpl*> view_bases;  // recorded view -> its base
    auto note = [&](const c10::IValue& v) {
      if (!v.isTensor() || !v.toTensor().defined()) return;
      const at::Tensor& t = v.toTensor();
      recorded[t.unsafeGetTensorImpl()]++;
      if (t.is_view()) view_bases.emplace(t.unsafeGetTensorImpl(), t._base().unsafeGetTensorImpl());
    };
    for (const auto& rc : calls_)
      for (const auto& v : rc.args) {
        note(v);
        if (v.isList())
          for (const auto& item : v.toListRef()) note(item);
      }
    // A view holds its base (autograd's view metadata, kept under no_grad
    // too): a base reached only through the region's views is internal.
    for (const auto& [view, base] : view_bases) recorded[base]++;
    std::unordered_map<c10::StorageImpl*, std::pair<size_t, bool>> held;  // impls in the region, held outside
    for (const auto& [impl, refs] : recorded) {
      if (!impl->has_storage()) continue;
      auto& h = held[impl->storage().unsafeGetStorageImpl()];
      h.first++;
      h.second |= HeldOutside(*impl, c10::raw::intrusive_ptr::use_count(impl), refs);
    }
    std::vector<c10::intrusive_ptr<c10::StorageImpl>> alive(created_.size());
    for (size_t i = 0; i < created_.size(); ++i) {
      auto s = created_[i].storage.lock();
      if (!s) continue;
      auto it = held.find(s.get());
      size_t internal = it == held.end() ? 0 : it->second.first;
      bool outside = (it != held.end() && it->second.second) ||
                     HeldOutside(*s, s.use_count(), 1 + internal);  // our lock + the region's tensors
      if (outside) alive[i] = std::move(s);
    }
    return alive;
  }

  // Whether `impl` (a TensorImpl or StorageImpl with `strong` references)
  // has references beyond the `internal` ones the region accounts for.
  // Since PyTorch's PyObject preservation (c10/util/intrusive_ptr.h,
  // kHasPyObject), an object's Python wrapper owns one strong reference, and
  // while C++ holds any other reference, C++ keeps one reference to the
  // wrapper: Python's own references are then Py_REFCNT - 1, read through
  // the PyInterpreter (no Python headers in the runtime).
  template <class Impl>
  static bool HeldOutside(const Impl& impl, size_t strong, size_t internal) {
    PyObject* wrapper = impl.pyobj_slot()->load_pyobj();
    if (!wrapper) return strong > internal;
    const size_t cpp = strong - 1;  // without the wrapper's reference
    if (cpp > internal) return true;
    const c10::impl::PyInterpreter* interpreter = c10::impl::getGlobalPyInterpreter();
    if (!interpreter) return true;  // cannot tell: keep it
    const size_t python = (*interpreter)->refcnt(wrapper);
    return python > (cpp > 0 ? 1u : 0u);
  }

  std::unique_ptr<CompiledRegion> Build(const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& alive) {
    ProgramBuilder pb;
    size_t next_created = 0;
    // Each call is lowered under the default dtype it was recorded (and
    // keyed) with: torch.set_default_dtype may have changed since.
    const caffe2::TypeMeta default_dtype = c10::get_default_dtype();
    struct RestoreDefault {
      caffe2::TypeMeta dtype;
      ~RestoreDefault() { c10::set_default_dtype(dtype); }
    } restore{default_dtype};
    for (size_t c = 0; c < calls_.size(); ++c) {
      const RecordedCall& rc = calls_[c];
      c10::set_default_dtype(rc.default_dtype);
      auto values = pb.AddCall(static_cast<int32_t>(c), rc.op, rc.args, 0, *rc.eager->entry, rc.eager->spec);
      for (size_t r = 0; r < values.size(); ++r) {
        if (!values[r]) continue;
        const CreatedStorage& cs = created_[next_created++];
        int64_t dims[] = {values[r]->type.numel()};
        pb.Define(cs.device_storage, cs.element, cs.numel,
                  lowering::ResizeFlat(pb.b, pb.b.Reshape(*values[r], dims), cs.numel));
      }
    }
    auto region = std::make_unique<CompiledRegion>();
    std::vector<hlo::Value> results;
    for (const auto& st : pb.storages) {
      if (!st.current) continue;
      RegionOutput out;
      out.element = st.element;
      out.numel = st.current->dims()[0];
      for (size_t i = 0; i < created_.size(); ++i)
        if (created_[i].device_storage == st.storage) out.created = static_cast<int32_t>(i);
      if (out.created >= 0 && !alive[static_cast<size_t>(out.created)]) continue;  // a dead temporary
      if (out.created < 0) {
        out.use = st.first_use;
        int32_t donor = pb.AliasWrittenStorage(st, results.size());
        if (donor >= 0) region->donor_inputs.push_back(donor);
      }
      results.push_back(*st.current);
      region->outputs.push_back(out);
    }
    for (auto& [flag, message] : pb.index_checks) {
      results.push_back(flag);
      region->check_messages.push_back(message);
    }
    pb.b.Return(results);
    region->inputs = std::move(pb.inputs);
    region->executable = CompileModule("fused region of " + std::to_string(calls_.size()) + " ops", pb.b.Module());
    return region;
  }

  void Run(const CompiledRegion& region, const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& alive) {
    auto& rt = Runtime::Get();
    ArgResolver arg_of = [&](int32_t call, int16_t arg) -> const c10::IValue& {
      return calls_[static_cast<size_t>(call)].args[static_cast<size_t>(arg)];
    };
    LaunchInputs li = GatherInputs(region.inputs, arg_of, CurrentDeviceIndex(calls_.front().args),
                                   region.donor_inputs);
    std::unique_ptr<pjrt::Event> done;
    const std::string name = "fused region of " + std::to_string(calls_.size()) + " ops";
    std::vector<std::unique_ptr<pjrt::Buffer>> outs;
    {
      ProfileScope profile("tpu::execute", name);  // torch.profiler event (waits while profiling)
      try {
        outs = region.executable->Execute(li.buffers, rt.device(li.device_index), li.donated, &done);
      } catch (const pjrt::Error& e) {
        RethrowDeviceError(e, name, li.device_index);  // RESOURCE_EXHAUSTED -> torch.OutOfMemoryError
      }
      profile.AwaitIfActive(done.get());
    }
    rt.metrics().executions++;
    rt.metrics().donated_buffers += static_cast<int64_t>(li.donated.size());
    rt.metrics().fused_regions++;
    rt.metrics().fused_region_outputs += static_cast<int64_t>(region.outputs.size());
    for (size_t i = 0; i < region.outputs.size(); ++i) {
      const RegionOutput& o = region.outputs[i];
      StorageBuffer sb{std::shared_ptr<pjrt::Buffer>(std::move(outs[i])), o.element, o.numel, name};
      if (o.created >= 0) {
        created_[static_cast<size_t>(o.created)].device_storage->Set(std::move(sb));
      } else {
        StorageOf(TensorOf(arg_of, o.use.call, o.use.arg, o.use.item)).Set(std::move(sb));
      }
    }
    for (size_t i = 0; i < region.check_messages.size(); ++i)
      rt.AddPendingCheck(std::shared_ptr<pjrt::Buffer>(std::move(outs[region.outputs.size() + i])),
                         region.check_messages[i]);
    if (done) rt.Track(std::move(done), name);
    (void)alive;  // kept alive until the storages are set
  }

  // The region's calls through their single-op executables, in order;
  // each new output's buffer goes to the pending storage handed out.
  void RunOneByOne(const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& alive) {
    size_t next_created = 0;
    for (auto& rc : calls_) {
      torch::jit::Stack stack(rc.args.begin(), rc.args.end());
      std::vector<at::Tensor> outputs = Launch(*rc.eager, stack, rc.args.size());
      size_t k = 0;
      for (size_t r = 0; r < rc.eager->spec.outputs.size(); ++r) {
        if (!rc.eager->spec.defined[r] || rc.eager->spec.return_alias[r] >= 0) continue;
        const CreatedStorage& cs = created_[next_created++];
        cs.device_storage->Set(StorageOf(outputs[k++]).current());
      }
    }
    (void)alive;
  }

  std::recursive_mutex mutex_;
  bool flushing_ = false;
  int region_device_ = -1;  // the device of the recorded calls
  std::vector<RecordedCall> calls_;
  std::vector<CreatedStorage> created_;
  std::vector<int64_t> key_;
  StorageIds ids_;
  // Compiled regions by key, least recently used evicted (MaxCachedExecutables).
  LruCache<std::vector<int64_t>, CompiledRegion, RegionKeyHash> regions_;
};

std::atomic<FusedExecutor*> instance{nullptr};

FusedExecutor& Fused() {
  static FusedExecutor* executor = [] {
    auto* e = new FusedExecutor();
    instance.store(e);
    SetFlushHook([] { FlushFusedRegion(); });
    return e;
  }();
  return *executor;
}

}  // namespace

void RunFused(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
  Fused().Record(op, stack, entry);
}

void FlushFusedRegion() {
  if (FusedExecutor* e = instance.load()) e->Flush();
}

void ClearFusedRegionCache() {
  if (FusedExecutor* e = instance.load()) e->ClearCache();
}

size_t FusedRegionSize() {
  FusedExecutor* e = instance.load();
  return e ? e->size() : 0;
}

}  // namespace torch_tpu::runtime
