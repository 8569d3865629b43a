// The fused executor: ops are recorded instead of run. Each call gets its
// outputs at once as tensors whose storages are *pending*; at a sync point
// (a pending storage is read: .cpu(), .item(), printing, a CPU fallback;
// torch.tpu.synchronize(); a metadata change such as resize_/set_; a mode
// switch), at a detected loop's boundary (one region per iteration, below)
// or when the region reaches its size bound
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
// entry, built once per signature up to its module text: OpCache::Lookup
// spec_only, no PJRT compile); a call that cannot is a sync point and runs
// on the CPU. A new region key's program compiles on the background compile
// thread (fused mode; a strict-mode region compiles at once) and its calls
// run one by one meanwhile, each as strict mode runs it (RunStrict:
// host-served until its single-op program exists, that compile queued at
// the key's 2nd call); so do the regions of a structure that keeps changing
// sizes (churn, below) and a region that fails to build or compile. A
// churning structure's next regions are not even recorded: their calls run
// at once (pass-through, below).
//
// A torch.compile graph launched in fused mode is recorded as ONE call of
// the region (RecordGraph): its inputs are read like any call's arguments,
// its outputs are pending storages, and the region's module holds the
// graph's body (GraphProgram::EmitInto: the same lowering code the graph's
// own program was built with), so XLA sees the graph and the eager calls
// around it as one program. Keys, loop detection and churn count a graph
// call as one call, named by the graph's uid.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/PyInterpreterHooks.h>
#include <c10/core/impl/PyObjectSlot.h>
#include <c10/util/hash.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "lowering/helpers.h"
#include "runtime/compiled_op.h"
#include "runtime/env.h"
#include "runtime/executor.h"
#include "runtime/graph_program.h"

namespace torch_tpu::runtime {
namespace {

// One recorded call: an ATen call (op, eager) or a compiled graph's launch
// (graph; args are its inputs, in order).
struct RecordedCall {
  std::optional<c10::OperatorHandle> op;
  std::shared_ptr<const CompiledOp> eager;  // validated single-op program (spec, fallback)
  std::vector<c10::IValue> args;    // the call's arguments, kept alive until the flush
  caffe2::TypeMeta default_dtype;   // torch.get_default_dtype() when recorded (lowerings read it)
  std::shared_ptr<GraphProgram> graph;
  // Graph calls, per GraphProgram::donations() entry: the output is written
  // into the input's storage (the input fed as it is, once) instead of
  // being a new tensor.
  std::vector<bool> applied;
  // Counts against the size bound: an ATen call made outside any
  // multi-tensor op, a graph call, or the first call of a multi-tensor op
  // (OneProgramScope: its other calls are part of that one op).
  bool unit = true;
};

// Key atom opening a graph call (an ATen call opens with its schema's
// address, never 0).
constexpr int64_t kGraphCallAtom = 0;

// Loop-detection signature of a graph call: odd, so never the address of
// an OpCache entry (the signature of an ATen call).
uintptr_t GraphSignature(const GraphProgram& g) { return static_cast<uintptr_t>(g.uid() << 1 | 1); }

// The value of `t` (a graph input GraphProgram::FeedsAsIs accepted: a
// contiguous tensor over its whole storage, of the storage's element type)
// in the region being built: the storage's current value if the region
// defined or wrote it, else its buffer as a new parameter, first used as
// `use`. This is what ProgramBuilder::ReadTensor does for a whole-storage
// view (the same StorageState bookkeeping), kept here because that method
// is private to compiled_op.cpp.
hlo::Value ReadWholeStorage(ProgramBuilder& pb, const at::Tensor& t, const InputSlot& use) {
  const DeviceStorage* s = &StorageOf(t);
  const hlo::ElementType element = lowering::ToElementType(t.scalar_type());
  ProgramBuilder::StorageState* st = nullptr;
  for (auto& known : pb.storages)
    if (known.storage == s) st = &known;
  if (!st) {
    pb.storages.push_back({s, use, element, StorageNumel(t), std::nullopt, std::nullopt});
    st = &pb.storages.back();
  }
  hlo::Value flat;
  if (st->current) {
    flat = *st->current;
  } else {
    if (!st->param) {
      if (pb.b.num_parameters() != pb.inputs.size())
        throw std::logic_error("fused region: parameters and inputs out of step");
      st->input_index = static_cast<int32_t>(pb.inputs.size());
      st->param = pb.b.Parameter(hlo::TensorType{st->element, {st->numel}});
      InputSlot slot = st->first_use;
      slot.kind = InputSlot::Kind::kStorage;
      slot.element = st->element;
      // The buffer the parameter declares (the one the storage has, as an
      // ATen call's read declares it: ProgramBuilder::StateFor; the graph
      // call's key holds its size): the launch resizes a storage whose
      // buffer has another capacity by then (GatherInputs). A flush after
      // the call was recorded (a loop boundary or the size bound in
      // RecordGraph, the calls before a partial flush) may run the calls
      // writing it op by op, and a bucket program leaves its canonical
      // buffer there (more elements; the MLP of test_compile_train:
      // "expected parameter 7 of size 2560 but got ... 4096").
      slot.numel = st->numel;
      pb.inputs.push_back(slot);
    }
    flat = *st->param;
  }
  if (flat.element() != element)
    throw std::logic_error("fused region: graph input of " + hlo::TensorType{element, {}}.ToString() +
                           " over a storage of " + flat.type.ToString());
  return pb.b.Reshape(lowering::ResizeFlat(pb.b, flat, t.numel()), t.sizes().vec());
}

// From here on `t`'s storage (a graph input read by ReadWholeStorage) holds
// `value` (AOTAutograd's new value of a mutated input, written in place).
void WriteWholeStorage(ProgramBuilder& pb, const at::Tensor& t, const hlo::Value& value) {
  const DeviceStorage* s = &StorageOf(t);
  for (auto& st : pb.storages)
    if (st.storage == s) {
      int64_t dims[] = {t.numel()};
      st.current = lowering::ResizeFlat(pb.b, pb.b.Reshape(value, dims), st.numel);
      return;
    }
  throw std::logic_error("fused region: a graph writes a storage it did not read");
}

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
  // Set once `ready` (compiled on the calling thread, or by the background
  // compile thread: fused mode, CompileInBackground); `failed`: that
  // compile raised `error` (the key then runs op by op).
  std::unique_ptr<pjrt::Executable> executable;
  std::string module_text;  // until compiled
  std::atomic<bool> ready{false};
  std::atomic<bool> failed{false};
  std::string error;
  std::vector<InputSlot> inputs;
  std::vector<RegionOutput> outputs;
  std::vector<std::string> check_messages;  // outputs after `outputs`: index checks
  std::vector<int64_t> donor_inputs;         // inputs aliased to their storage's new value
  // Its key was flushed again after the flush that built it (fused mode's
  // Churning reads it: a structure whose first key never recurred changes
  // sizes). Main thread only.
  bool recurred = false;
};

// A region structure's compiled keys (FusedExecutor::Churning).
struct StructureKeys {
  int compiled = 0;        // keys compiled (churn: kMaxSizesPerStructure)
  size_t first_sizes = 0;  // the first key's RegionSizes (PredictChurn: do the sizes vary?)
  std::weak_ptr<CompiledRegion> first_region;  // the first key's program (early churn: has it recurred?)
};

struct RegionKeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    size_t h = k.size();
    for (int64_t a : k) h = c10::hash_combine(h, std::hash<int64_t>()(a));
    return h;
  }
};

// The size bound, in ops as the program makes them: an ATen call, a graph
// call, or one whole multi-tensor op (a foreach/fused optimizer kernel,
// however many per-tensor calls it records). A region is cut before the op
// that would exceed it, so a multi-tensor op is never split by it (a foreach
// AdamW over a 6-layer MiniLM's 100 parameters records ~1000 calls: cut by
// a per-call bound of 512 it was 2 programs in strict mode, and the compiled
// fused step 2 regions). MaxCallsPerRegion() bounds the recorded calls
// themselves (compile time and memory of one program), inside a
// multi-tensor op too.
size_t MaxOps() {
  static size_t n =
      static_cast<size_t>(EnvInteger("TORCH_TPU_FUSED_MAX_OPS", 512, 1, int64_t{1} << 24, "an integer in [1, 16777216]"));
  return n;
}
size_t MaxCallsPerRegion() { return 16 * MaxOps(); }
// A graph call's outputs pass through one stablehlo.optimization_barrier in
// the region, so XLA does not fuse the graph's body with the calls after it
// (the loss, the next graph, the optimizer): each graph stays as its own
// program compiled it. Measured on the 6-layer MiniLM compiled fine-tuning
// step, fused (batch 2 x 32, XLA CPU): without it the one region compiled
// in 165 s and ran 3.8-4.2 s a step, with it 68 s and 2.1-2.3 s (the
// graphs as separate programs, TORCH_TPU_FUSED_GRAPHS=0: 4 programs, 1.7
// s). TORCH_TPU_FUSED_GRAPH_BARRIER=0 leaves the region unbarriered.
bool GraphBarrier() {
  static const bool on = EnvFlag("TORCH_TPU_FUSED_GRAPH_BARRIER", true);
  return on;
}

// Loop detection (fused mode). Each recorded call has a signature: its
// single-op OpCache entry (op, dtypes, sizes, static arguments), whose
// address is stable while cached. The recorded stream is watched for a
// period P: a run of calls each equal to the call P before it (a shorter
// candidate is tracked alongside and replaces a longer one once
// established); once the run covers two full periods and kMinLoopRegion
// calls the program is in a loop of P calls and regions are cut at the
// loop's boundaries (a region ending at one runs when the next call is
// recorded, when its temporaries are dead), so each region is one
// iteration (or kMinLoopRegion / P iterations when P is short; a longer
// iteration is cut by the size bound from its start) and its key repeats.
// The boundaries are anchored at the last sync point inside the loop (a
// program that syncs every step keeps one region per step) or else at the
// start of the run. Cost per call: one ring-buffer compare and one hash map
// update.
constexpr size_t kLoopHistory = 8192;               // signatures kept (ring buffer)
constexpr uint64_t kMaxPeriod = kLoopHistory / 2;   // longest loop detected, calls
constexpr uint64_t kMinLoopRegion = 64;             // short loops: this many calls per region at least
constexpr size_t kMaxSignatures = size_t{1} << 16;  // last-seen map bound (cleared beyond)

// Churn (adaptive fusion): a region structure (its op sequence, modulo
// sizes and dtypes) compiled for kMaxSizesPerStructure different keys runs
// op by op (strict mode's calls: host-served until their single-op programs
// are compiled) for any further key, unless that key itself has been run
// op by op kHotRecurrence - 1 times (then it is compiled: it repeats, so
// fusing it pays off). A second key already churns where the first key has
// not recurred yet (Churning's `early`). 4, not 3: a generate() call's
// decoding steps are one structure at a new KV length each, so each key
// recurs once per call; at 3 the third call compiled ~23 regions (27 s on
// 2 loaded cores) where op by op costs ~nothing more once the single-op
// programs exist.
// Hot keys compile in the background one at a time and at low priority
// (after every other queued compile): while one hot key's compile is
// queued or running, other hot keys stay op by op and are compiled at a
// later sight (a hot key on disk loads at once). Without
// this the call in which a generate() prompt's ~20 decoding keys all
// turned hot built and hashed ~20 region programs on the calling thread
// and queued ~25 s of compiles ahead of the single-op compiles its own
// new shapes needed: a 12-token prompt after three calls of an 8-token
// one (issue 12 (b)) took 2.2x the warm call (median of 5 runs), 1.3x with
// no hot keys compiled. Counted per hot compile, not gated on the whole
// compile queue: other compiles queued before each sight would starve a
// hot key for good.
constexpr int kMaxSizesPerStructure = 2;
constexpr int kHotRecurrence = 4;
constexpr size_t kMaxStructures = 4096;

// Churn pass-through. A churning structure's region runs op by op anyway;
// recording it first (a spec lookup, a key, pending outputs per call) and
// then running each call as strict mode does cost ~8 us a call on top of
// strict mode's: the (c) block of bench_dynamic_shapes (20 sequence
// lengths through a transformer block) was 1.1-1.25x slower in fused mode
// than in strict mode in its first pass. So after a churning region that
// ended at a sync point, the next region's calls run at once, as strict
// mode runs them (RunStrict), unrecorded, when its first call's op begins a
// churning structure; a region whose calls follow the size signatures
// (SizeSignature) of a key that is compiled or hot is recorded while they
// do (PassThrough, Demote). At the
// next sync point the passed-through region is checked: its op sequence
// must be a churning structure's, else the prediction was wrong (a region
// of another structure began with that op) and regions beginning with that
// op are recorded from then on. Its sizes count towards kHotRecurrence as a
// recorded op-by-op run does (by size signature in both): at its
// kHotRecurrence - 1-th run its next sight is recorded, and compiles as a
// hot key. Never inside a multi-tensor op or for a graph call (recorded,
// as before). A call raises its error at once, as in strict mode.
// TORCH_TPU_FUSED_PASS_THROUGH=0 records every region.
bool PassThroughEnabled() {
  static const bool on = EnvFlag("TORCH_TPU_FUSED_PASS_THROUGH", true);
  return on;
}

// Pass-through from a structure's last compiled key on, and a second key
// that churns early (Churning): TORCH_TPU_FUSED_CHURN_AHEAD=0 compiles two
// keys per structure and waits for the first key that churns.
bool AheadOfChurnEnabled() {
  static const bool on = EnvFlag("TORCH_TPU_FUSED_CHURN_AHEAD", true);
  return on;
}

// A call's op (the schema's address) for structure hashes.
size_t OpSignature(const c10::OperatorHandle& op) { return std::hash<const void*>()(&op.schema()); }

// Pass-through's check of a prediction compares op sequences without
// aten::copy_: a copy between whole storages whose source is not pending
// shares the buffer without reaching the executor (kernels.cpp), so a
// passed-through region lacks the copy_ its recorded twin has
// (generate()'s decoding step: 139 calls passed through against 140).
bool SkippedInPrediction(const c10::OperatorHandle& op) {
  static const c10::OperatorName copy{"aten::copy_", ""};
  return op.operator_name() == copy;
}

// The op sequence a prediction check compares (SkippedInPrediction's ops
// aside), built call by call.
struct PredictedOps {
  size_t hash = 0;
  size_t calls = 0;
  void Add(const c10::OperatorHandle& op) {
    if (SkippedInPrediction(op)) return;
    hash = c10::hash_combine(hash, OpSignature(op));
    ++calls;
  }
  void AddGraph(uint64_t uid) {
    hash = c10::hash_combine(hash, std::hash<uint64_t>()(uid));
    ++calls;
  }
  size_t Value() const { return c10::hash_combine(hash, calls); }
};

// A call's op and the static parts of its arguments: each tensor's dtype,
// sizes and strides (not its offset or values), integers, booleans and
// integer lists (view sizes, dims). Two calls of one region key have one
// signature; a collision only mispredicts pass-through, never a value.
size_t SizeSignature(const c10::OperatorHandle& op, std::span<const c10::IValue> args) {
  size_t h = OpSignature(op);
  auto tensor = [&](const at::Tensor& t) {
    if (!t.defined()) {
      h = c10::hash_combine(h, 0x9e37);
      return;
    }
    h = c10::hash_combine(h, static_cast<size_t>(t.scalar_type()) + 1);
    h = c10::hash_combine(h, static_cast<size_t>(t.dim()));
    for (int64_t d : t.sizes()) h = c10::hash_combine(h, static_cast<size_t>(d));
    for (int64_t d : t.strides()) h = c10::hash_combine(h, static_cast<size_t>(d));
  };
  auto value = [&](const c10::IValue& v, auto& self) -> void {
    if (v.isTensor()) {
      tensor(v.toTensor());
    } else if (v.isList()) {  // tensor and integer lists, read in place (per-call path: no copies)
      for (const c10::IValue& item : v.toListRef()) self(item, self);
    } else if (v.isInt()) {
      h = c10::hash_combine(h, static_cast<size_t>(v.toInt()));
    } else if (v.isBool()) {
      h = c10::hash_combine(h, v.toBool() ? 3 : 5);
    } else {
      h = c10::hash_combine(h, static_cast<size_t>(v.tag));
    }
  };
  for (const auto& v : args) value(v, value);
  return h;
}
std::atomic<int> hot_compiles_outstanding{0};  // hot keys' background compiles queued or running

// TORCH_TPU_FUSED_LOOPS=0 turns loop detection off (regions end at sync
// points and the size bound only, as before it existed).
bool LoopsEnabled() {
  static const bool on = EnvFlag("TORCH_TPU_FUSED_LOOPS", true);
  return on;
}

class FusedExecutor {
 public:
  void Record(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
    // Fused mode's variables are read at its first call, outside the region
    // compile's fallback (which would turn a bad value into a warning).
    static const bool env_read = (MaxOps(), GraphBarrier(), LoopsEnabled(), true);
    (void)env_read;
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (pass_through_ && PassThrough(op, stack, entry)) return;
    const size_t num_args = op.schema().arguments().size();
    const size_t first = stack->size() - num_args;
    // Validates the call and gives its spec (throws UnsupportedOp before any
    // side effect: the caller then runs it on the CPU, a sync point).
    std::shared_ptr<const CompiledOp> eager;
    try {
      eager = GlobalOpCache().Lookup(op, *stack, entry, /*shape_poly=*/false, /*host_served=*/nullptr,
                                     /*spec_only=*/true);
    } catch (const UnsupportedOp&) {
      FlushLocked(Cause::kSync);
      throw;
    }
    const CallSpec& spec = eager->spec;
    if (!spec.resize_outputs.empty()) {
      FlushLocked(Cause::kSync);  // resizing reads and replaces storages
      ApplyResizes(spec, *stack, first);
    }
    // A region runs on one device: a call on another one is a sync point.
    // The region reached a loop boundary with the previous call: it runs now,
    // before this call is recorded (not at once: by now the code that made
    // the previous call has returned and dropped its temporaries, which
    // are then not outputs, as at a sync point there).
    if (at_loop_boundary_) FlushLocked(Cause::kLoop);
    const int device_index = CurrentDeviceIndex(std::span<const c10::IValue>(*stack).subspan(first));
    if (!calls_.empty() && device_index != region_device_) FlushLocked(Cause::kSync);
    region_device_ = device_index;
    const bool unit = OneProgramCallIndex() <= 0;
    CutAtSizeBound(unit);
    const int32_t call = static_cast<int32_t>(calls_.size());
    call_key_begin_.push_back(key_.size());
    key_.push_back(reinterpret_cast<int64_t>(&op.schema()));
    // Nonzero storage offsets are runtime inputs of region programs
    // (ProgramBuilder::runtime_offsets): a loop over x[:, k] is one region
    // (TORCH_TPU_SHAPE_POLY=0: a region per offset, as before).
    AppendCallKey(op, *stack, first, entry, key_, ids_, {}, 0, 0, /*runtime_offsets=*/ShapePolyEnabled());

    RecordedCall rc{op, eager,
                    std::vector<c10::IValue>(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end()),
                    c10::get_default_dtype(), nullptr, {}, unit};
    // CPU tensors among the arguments (0-d runtime scalars: a tensor
    // learning rate) are read when the region runs: copy their values now,
    // as the call would have read them (an LR scheduler's fill_ before the
    // flush must not reach a step recorded earlier).
    for (auto& v : rc.args)
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().is_cpu()) {
        at::Tensor copy = v.toTensor().clone();
        // The copy stands for the argument (and keys the same when a region
        // is split and its rest re-keyed): a wrapped Python number stays one.
        if (v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) copy.unsafeGetTensorImpl()->set_wrapped_number(true);
        v = std::move(copy);
      }
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
        // CPU's strides (CallSpec::strides; AddCall writes that memory order).
        at::Tensor t = spec.strides[r].empty()
                           ? at::detail::empty_generic(out.sizes, c10::GetAllocator(c10::DeviceType::PrivateUse1),
                                                       c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), out.dtype,
                                                       std::nullopt)
                           : at::detail::empty_strided_generic(out.sizes, spec.strides[r],
                                                               c10::GetAllocator(c10::DeviceType::PrivateUse1),
                                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                               out.dtype);
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
    units_ += unit ? 1 : 0;
    if (CurrentMode() == EagerMode::kStrict && GraphDeferralArmed()) deferred_ = true;
    SetPendingWork(true);  // from now on every storage read flushes first (Materialize)
    stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
    for (auto& v : returns) stack->push_back(std::move(v));
    // Loop boundaries apply to fused mode only (a strict-mode OneProgramScope
    // records one multi-tensor op, which must stay one program).
    // Inside a multi-tensor op (OneProgramScope) a call's signature also
    // carries its index in the op: a foreach optimizer's per-tensor calls
    // over identical layers must not look periodic with one layer's period.
    if (CurrentMode() == EagerMode::kFused && LoopsEnabled()) {
      uintptr_t sig = reinterpret_cast<uintptr_t>(eager.get());
      if (const int64_t k = OneProgramCallIndex(); k > 0)
        sig = static_cast<uintptr_t>(c10::hash_combine(sig, static_cast<size_t>(k)));
      ObserveLoop(sig);
    }
  }

  // A compiled graph's launch as one call (RecordGraphCall).
  std::vector<at::Tensor> RecordGraph(std::shared_ptr<GraphProgram> graph, const std::vector<at::Tensor>& given) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    EndPassThrough();  // graph calls are recorded
    const int device_index = graph->CheckInputs(given);
    // Inputs the program cannot take as they are (views, conjugate bits)
    // are copied contiguous first: recorded clones, before the graph call.
    // A buffer of another capacity is taken as it is (the launch resizes
    // it: ReadWholeStorage's slot, GraphProgram::Launch).
    std::vector<at::Tensor> inputs(given.size());
    for (size_t i = 0; i < given.size(); ++i)
      inputs[i] = graph->FeedsAsIs(static_cast<int>(i), given[i]) ? given[i]
                                                                    : at::clone(given[i], at::MemoryFormat::Contiguous);
    if (at_loop_boundary_) FlushLocked(Cause::kLoop);
    if (!calls_.empty() && device_index != region_device_) FlushLocked(Cause::kSync);
    region_device_ = device_index;
    CutAtSizeBound(/*unit=*/true);

    RecordedCall rc{std::nullopt, nullptr, {}, c10::get_default_dtype(), graph, {}, true};
    rc.args.assign(inputs.begin(), inputs.end());
    // A donated input's new value is written into its storage, as the launch
    // does when it donates (the output is the input tensor itself), where
    // the input is fed as it is and once; else the output is a new tensor
    // and AOTAutograd's copy_ applies the mutation.
    for (const auto& [input, output] : graph->donations()) {
      const at::Tensor& t = inputs[static_cast<size_t>(input)];
      bool once = t.is_same(given[static_cast<size_t>(input)]);
      for (size_t j = 0; j < inputs.size() && once; ++j)
        if (static_cast<int>(j) != input && &StorageOf(inputs[j]) == &StorageOf(t)) once = false;
      rc.applied.push_back(once);
    }
    const int32_t call = static_cast<int32_t>(calls_.size());
    call_key_begin_.push_back(key_.size());
    AppendGraphKey(rc, key_, ids_);

    const auto& specs = graph->output_specs();
    std::vector<at::Tensor> computed(specs.size());
    for (size_t d = 0; d < rc.applied.size(); ++d)
      if (rc.applied[d])
        computed[static_cast<size_t>(graph->donations()[d].second)] = given[static_cast<size_t>(graph->donations()[d].first)];
    for (size_t k = 0; k < specs.size(); ++k) {
      if (computed[k].defined()) continue;
      c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_index)));
      at::Tensor t = at::detail::empty_generic(specs[k].sizes, c10::GetAllocator(c10::DeviceType::PrivateUse1),
                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), specs[k].dtype,
                                               std::nullopt);
      DeviceStorage& ds = StorageOf(t);
      hlo::ElementType e = lowering::ToElementType(specs[k].dtype);
      ds.MarkPending(e, Capacity(t.numel()));
      key_.push_back(-1 - ids_.Id(&ds));  // created here
      created_.push_back({c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl()), &ds, e,
                          Capacity(t.numel()), call, static_cast<int16_t>(k)});
      computed[k] = std::move(t);
    }
    calls_.push_back(std::move(rc));
    ++units_;
    if (CurrentMode() == EagerMode::kStrict && GraphDeferralArmed()) deferred_ = true;
    SetPendingWork(true);
    if (CurrentMode() == EagerMode::kFused && LoopsEnabled()) ObserveLoop(GraphSignature(*graph));
    return computed;
  }

  void Flush() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    EndPassRegionAtSync();
    FlushLocked(Cause::kSync);
  }

  size_t size() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    return calls_.size();
  }

  void ClearCache() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    EndPassThrough();
    FlushLocked(Cause::kSync);
    regions_.Clear();
    structures_.clear();
    churn_counts_.clear();
    ClearPassThroughState();
  }

 private:
  static int CurrentDeviceIndex(std::span<const c10::IValue> args) {
    for (const auto& v : args)
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == c10::DeviceType::PrivateUse1)
        return v.toTensor().device().index();
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  }

  // A graph call's key atoms: the graph's uid (which determines its
  // program, inputs and outputs), each input's storage number and buffer
  // size (inputs are whole storages of the graph's types: FeedsAsIs; the
  // buffer, a bucket program's canonical one or the exact one, is what the
  // region's parameter declares: ReadWholeStorage), which donations write
  // in place. Its created storages follow, as for an ATen call.
  static void AppendGraphKey(const RecordedCall& rc, std::vector<int64_t>& key, StorageIds& ids) {
    key.push_back(kGraphCallAtom);
    key.push_back(static_cast<int64_t>(rc.graph->uid()));
    for (const auto& v : rc.args) {
      key.push_back(ids.Id(&StorageOf(v.toTensor())));
      key.push_back(StorageNumel(v.toTensor()));
    }
    for (bool a : rc.applied) key.push_back(a ? 1 : 0);
  }

  // Before recording a call: the region runs first if the call would take
  // it past the size bound (MaxOps() ops, a multi-tensor op counted once:
  // `unit` is false for its calls after the first) or past
  // MaxCallsPerRegion() recorded calls. Cutting before the op that exceeds
  // the bound, not after the op that reaches it, keeps a multi-tensor op in
  // one region; the region runs when the next op is recorded, as at a loop
  // boundary (its last op's temporaries already dropped).
  void CutAtSizeBound(bool unit) {
    if (calls_.empty()) return;
    if ((unit && units_ >= MaxOps()) || calls_.size() >= MaxCallsPerRegion()) FlushLocked(Cause::kSizeBound);
  }

  enum class Cause {
    kSync,       // a sync point of the program (a read, synchronize, a device change, ...)
    kLoop,       // a loop boundary (ObserveLoop)
    kSizeBound,  // TORCH_TPU_FUSED_MAX_OPS
  };

  // Runs the first `n` recorded calls (all by default) as one region. The
  // calls after them stay recorded, re-keyed as the start of the next
  // region: their references to the flushed calls' new storages count as
  // outside references, so those storages are outputs.
  void FlushLocked(Cause cause, size_t n = SIZE_MAX) {
    if (calls_.empty() || flushing_) return;
    if (n >= calls_.size()) at_loop_boundary_ = false;
    if (cause == Cause::kSync) {
      last_sync_pos_ = pos_;
      if (loop_confirmed_) loop_anchor_ = pos_;  // the program's own boundary: cut there
    }
    std::vector<RecordedCall> rest;
    std::vector<CreatedStorage> rest_created;
    if (n < calls_.size()) {
      rest.assign(std::make_move_iterator(calls_.begin() + static_cast<std::ptrdiff_t>(n)),
                  std::make_move_iterator(calls_.end()));
      calls_.erase(calls_.begin() + static_cast<std::ptrdiff_t>(n), calls_.end());
      key_.resize(call_key_begin_[n]);
      call_key_begin_.resize(n);
      size_t split = 0;
      while (split < created_.size() && created_[split].call < static_cast<int32_t>(n)) ++split;
      rest_created.assign(created_.begin() + static_cast<std::ptrdiff_t>(split), created_.end());
      created_.erase(created_.begin() + static_cast<std::ptrdiff_t>(split), created_.end());
    }
    arm_pass_through_ = false;
    const bool was_tentative = tentative_;
    tentative_ = false;
    try {
      FlushRegion(/*last=*/rest.empty());
    } catch (...) {
      Rerecord(rest, rest_created, n);
      throw;
    }
    // A churning structure's region that ended at a sync point: the next
    // region may be passed through (PassThrough).
    if (arm_pass_through_ && cause == Cause::kSync && rest.empty() && PassThroughEnabled()) {
      pass_through_ = true;
      pass_calls_ = 0;
    } else if (was_tentative) {
      pass_through_ = false;  // not armed again by this region
    }
    Rerecord(rest, rest_created, n);
  }

  // Records `rest` (calls that followed a flushed prefix of `n` calls) as
  // the current region: new storage numbering, so the key is the one a
  // region starting with these calls gets.
  void Rerecord(std::vector<RecordedCall>& rest, std::vector<CreatedStorage>& rest_created, size_t n) {
    if (rest.empty()) return;
    const caffe2::TypeMeta default_dtype = c10::get_default_dtype();
    struct RestoreDefault {
      caffe2::TypeMeta dtype;
      ~RestoreDefault() { c10::set_default_dtype(dtype); }
    } restore{default_dtype};
    size_t next_created = 0;
    for (size_t c = 0; c < rest.size(); ++c) {
      RecordedCall& rc = rest[c];
      c10::set_default_dtype(rc.default_dtype);  // the call's key records it
      call_key_begin_.push_back(key_.size());
      if (rc.graph) {
        AppendGraphKey(rc, key_, ids_);
      } else {
        key_.push_back(reinterpret_cast<int64_t>(&rc.op->schema()));
        AppendCallKey(*rc.op, rc.args, 0, *rc.eager->entry, key_, ids_, {}, 0, 0,
                      /*runtime_offsets=*/ShapePolyEnabled());
      }
      while (next_created < rest_created.size() &&
             rest_created[next_created].call == static_cast<int32_t>(n + c)) {
        CreatedStorage cs = rest_created[next_created++];
        cs.call = static_cast<int32_t>(c);
        key_.push_back(-1 - ids_.Id(cs.device_storage));
        created_.push_back(cs);
      }
      units_ += rc.unit ? 1 : 0;
      calls_.push_back(std::move(rc));
    }
    SetPendingWork(true);
  }

  // Notes the call just recorded (at stream position pos_) for loop
  // detection; cuts the region at the loop's boundaries (a region ending at
  // one runs before the next call: at_loop_boundary_).
  void ObserveLoop(uintptr_t sig) {
    const uint64_t i = pos_++;
    if (loop_history_.empty()) loop_history_.assign(kLoopHistory, 0);
    // Distance to the signature's previous occurrence: the candidate period.
    uint64_t distance = 0;
    if (auto it = last_seen_.find(sig); it != last_seen_.end()) {
      distance = i - it->second <= kMaxPeriod ? i - it->second : 0;
      it->second = i;
    } else {
      if (last_seen_.size() >= kMaxSignatures) last_seen_.clear();
      last_seen_.emplace(sig, i);
    }
    auto follows = [&](uint64_t period) {
      return period && i >= period && loop_history_[(i - period) % kLoopHistory] == sig;
    };
    // The period holds, or the candidate becomes the new period.
    if (follows(loop_period_)) {
      ++loop_run_;
    } else {
      loop_period_ = distance;
      loop_run_ = distance ? 1 : 0;
      loop_confirmed_ = false;
    }
    // A shorter period, tracked alongside, replaces a longer one once it is
    // itself established (a program run twice is periodic with the length
    // of the whole run, and with its step's).
    if (follows(shorter_period_)) {
      ++shorter_run_;
    } else {
      shorter_period_ = distance < loop_period_ ? distance : 0;  // only shorter candidates
      shorter_run_ = shorter_period_ ? 1 : 0;
    }
    loop_history_[i % kLoopHistory] = sig;
    if (shorter_period_ && shorter_period_ < loop_period_ &&
        shorter_run_ >= std::max(shorter_period_, kMinLoopRegion)) {
      loop_period_ = shorter_period_;
      loop_run_ = shorter_run_;
      loop_confirmed_ = false;
    }
    // Two full periods, and at least kMinLoopRegion calls of evidence (two
    // equal calls in a row are not yet a loop).
    if (!loop_period_ || loop_run_ < std::max(loop_period_, kMinLoopRegion)) return;
    const uint64_t region_start = i + 1 - calls_.size();
    if (!loop_confirmed_) {
      // [i + 1 - P - run, i] is periodic. Cut the region at
      // every boundary it now contains (what precedes the first one is the
      // program before the loop: one region of its own).
      loop_confirmed_ = true;
      const uint64_t run_start = i + 1 - loop_period_ - loop_run_;
      loop_anchor_ = last_sync_pos_ >= run_start && last_sync_pos_ <= i ? last_sync_pos_ : run_start;
      std::vector<uint64_t> cuts;
      for (uint64_t b = std::max(region_start + 1, loop_anchor_); b <= i + 1; ++b)
        if (IsLoopBoundary(b)) cuts.push_back(b);
      uint64_t flushed = region_start;
      for (uint64_t b : cuts) {
        if (b == i + 1) break;  // the whole region: runs before the next call
        FlushLocked(Cause::kLoop, static_cast<size_t>(b - flushed));
        flushed = b;
      }
    }
    at_loop_boundary_ = IsLoopBoundary(i + 1);
  }

  // Calls per loop region: whole periods, at least kMinLoopRegion calls
  // (while that fits the size bound).
  uint64_t LoopCycle() const {
    uint64_t k = std::max<uint64_t>(1, (kMinLoopRegion + loop_period_ - 1) / loop_period_);
    while (k > 1 && k * loop_period_ > MaxOps()) --k;
    return k * loop_period_;
  }

  // Whether a region starts at stream position `b` in the confirmed loop:
  // at the anchor plus whole cycles. A cycle longer than the size bound is
  // cut by the bound (CutAtSizeBound), counted from the cycle's start, so
  // its pieces repeat too.
  bool IsLoopBoundary(uint64_t b) const {
    if (b < loop_anchor_) return false;
    return (b - loop_anchor_) % LoopCycle() == 0;
  }

  // Compiles (or finds) and runs the recorded region; `last`: no calls
  // remain recorded after it (the pending-work flag drops, the storages
  // kept for the region are freed).
  void FlushRegion(bool last) {
    flushing_ = true;
    struct Reset {
      FusedExecutor* self;
      bool last;
      ~Reset() { self->ClearRecorded(last); }
    } reset{this, last};

    std::vector<c10::intrusive_ptr<c10::StorageImpl>> alive = AliveCreatedStorages();
    for (const auto& a : alive) key_.push_back(a ? 1 : 0);
    std::shared_ptr<CompiledRegion> region = regions_.Find(key_);
    auto& metrics = Runtime::Get().metrics();
    const std::string name = "fused region of " + std::to_string(calls_.size()) + " ops";
    auto warn = [&](const std::string& error) {
      TORCH_WARN_ONCE("torch_tpu: a fused region of ", calls_.size(),
                      " ops could not be compiled as one program; running its ops one by one (", error, ")");
    };
    if (region) {
      metrics.cache_hits++;
      region->recurred = true;
      // A compiled key of a churning structure: the next region may be
      // passed through (PassThrough).
      if (CurrentMode() == EagerMode::kFused && !deferred_ && PassThroughEnabled()) {
        auto it = structures_.find(RegionStructure());
        if (it != structures_.end() && it->second.compiled >= kMaxSizesPerStructure) arm_pass_through_ = true;
      }
      if (!region->ready.load(std::memory_order_acquire)) {
        // Compiling in the background: the calls run as strict mode runs
        // them meanwhile (never waiting for the region).
        const bool failed = region->failed.load(std::memory_order_acquire);
        if (failed) warn(region->error);
        if (!failed) NoteCompiling(region);
        RunOneByOne(alive, /*region_compiling=*/!failed);
        return;
      }
    } else {
      metrics.cache_misses++;
      // Churn applies to fused mode's regions and to those deferred between
      // graphs in strict mode, not to a strict-mode multi-tensor op's (one
      // program, always).
      const bool background = CurrentMode() == EagerMode::kFused && !deferred_;  // where a new key compiles
      bool sizes_vary = false;  // the structure has been compiled for other sizes already
      bool hot = false;         // a churning structure's key compiled for recurring
      StructureKeys* keys = nullptr;  // the structure's entry (Churning)
      if ((CurrentMode() == EagerMode::kFused || deferred_) && Churning(background, &sizes_vary, &hot, &keys)) {
        RunOneByOne(alive);
        return;
      }
      std::shared_ptr<CompiledRegion> built;
      try {
        built = Build(alive);
      } catch (const std::exception& e) {
        warn(e.what());
        RunOneByOne(alive);
        return;
      }
      // Fused mode: a new region compiles off the critical path, as a
      // host-first single op does (its calls run op by op this time), unless
      // the program is in a confirmed loop and this is the first key of its
      // structure (the loop's iterations repeat the same calls, and nothing
      // says their sizes change: the region recurs at the next iteration,
      // so it compiles now and runs as one program from the first iteration
      // on). A structure compiled for other sizes already changes sizes
      // across iterations (generate()'s decoding loop: one KV length per
      // step), so its next key compiles in the background too: compiled on
      // the calling thread it would stall the loop for a program the next
      // iteration does not run (a generate() call whose 20 decoding keys
      // turned hot: 1.6 s instead of 0.25 s). A region on disk loads now. A
      // strict-mode region (a multi-tensor op, calls deferred between
      // graphs) is one program at once.
      if (background && (!loop_confirmed_ || sizes_vary) && !InDiskCache(built->module_text)) {
        // The background compile thread's settings, before the key is
        // cached as compiling: a bad value runs the calls op by op (each
        // raises it where it would queue its own compile).
        try {
          CheckBackgroundCompileSettings();
        } catch (const std::exception& e) {
          warn(e.what());
          RunOneByOne(alive);
          return;
        }
        NoteRegionProgram(keys, built);
        CompileInBackground(regions_.Insert(key_, built), name, hot);
        RunOneByOne(alive, /*region_compiling=*/true);
        return;
      }
      try {
        built->executable = CompileModule(name, built->module_text);
      } catch (const std::exception& e) {
        warn(e.what());
        RunOneByOne(alive);
        return;
      }
      built->module_text.clear();
      built->ready.store(true, std::memory_order_release);
      NoteRegionProgram(keys, built);
      region = regions_.Insert(key_, std::move(built));
    }
    Run(*region, alive);
  }

  // The recorded region's key has a program (compiled or compiling): a
  // region whose calls follow its size signatures is recorded, not passed
  // through (PassThrough); the structure's first key's program is kept
  // (weakly) for Churning's early churn.
  void NoteRegionProgram(StructureKeys* keys, const std::shared_ptr<CompiledRegion>& region) {
    if (keys && keys->compiled == 1) keys->first_region = region;
    if (CurrentMode() != EagerMode::kFused || deferred_) return;
    WantRecordedPrefixes();
  }

  // The recorded region's key recurred while its program compiles in the
  // background (fused mode): until the program is ready its regions run op
  // by op, so a region beginning with the same op after this one's sync
  // point is passed through (PassThrough) rather than recorded, flushed and
  // then run op by op all the same (bench_dynamic_shapes' offsets table:
  // 510 regions of 4 ops while one program compiled; fused mode's first
  // pass was 1.26x strict mode's). Only a recurring key: at its first sight
  // the next region, even of the same structure, may be another key that
  // wants its own compile (the offsets table's first column pair is one key,
  // the other 511 another), which pass-through would put off until this
  // program is ready. A region with a graph call is never passed through.
  void NoteCompiling(const std::shared_ptr<CompiledRegion>& region) {
    if (CurrentMode() != EagerMode::kFused || deferred_ || calls_.empty() || !PassThroughEnabled()) return;
    if (std::any_of(calls_.begin(), calls_.end(), [](const RecordedCall& rc) { return rc.graph != nullptr; })) return;
    const size_t first_op = OpSignature(*calls_.front().op);
    if (ambiguous_compiling_ops_.count(first_op)) return;
    PredictedOps predicted;
    for (const auto& rc : calls_) predicted.Add(*rc.op);
    compiling_[first_op] = Compiling{region, predicted.Value(), calls_.size(),
                                     c10::hash_combine(size_t{0}, SizeSignature(*calls_.front().op, calls_.front().args))};
    arm_pass_through_ = true;
  }

  // The recorded region's size-signature prefixes (one per call) join
  // wanted_prefixes_: a region whose calls follow them is recorded.
  void WantRecordedPrefixes() {
    std::vector<size_t> prefixes;
    size_t h = 0;
    for (const auto& rc : calls_) {
      if (rc.graph) break;
      h = c10::hash_combine(h, SizeSignature(*rc.op, rc.args));
      prefixes.push_back(h);
    }
    WantPrefixes(prefixes);
  }

  void WantPrefixes(const std::vector<size_t>& prefixes) {
    if (wanted_prefixes_.size() >= kMaxStructures * 64) wanted_prefixes_.clear();
    wanted_prefixes_.insert(prefixes.begin(), prefixes.end());
  }

  // After a flushed (or demoted) region: nothing recorded; `last`: no
  // calls remain recorded after it (the pending-work flag drops, the
  // storages kept for the region are freed).
  void ClearRecorded(bool last) {
    calls_.clear();
    units_ = 0;
    created_.clear();
    key_.clear();
    call_key_begin_.clear();
    ids_.seen.clear();
    flushing_ = false;
    deferred_ = false;
    if (last) {
      SetPendingWork(false);
      ReleaseKeptStorages();
    }
  }

  // Queues `region`'s compile on the background compile thread, counted
  // now (metrics()["compiles"] does not depend on when it ends;
  // torch_tpu.metrics() waits for it). Until it is ready the key's regions
  // run op by op; a compile error is kept and warned about at the key's
  // next flush (it then always runs op by op). `hot`: a churning
  // structure's recurring key (Churning), counted in
  // hot_compiles_outstanding until its compile ends.
  static void CompileInBackground(std::shared_ptr<CompiledRegion> region, const std::string& name, bool hot) {
    Runtime::Get().metrics().compiles++;
    if (hot) hot_compiles_outstanding.fetch_add(1, std::memory_order_acq_rel);
    SubmitBackgroundCompile([region = std::move(region), name, hot] {
      struct Done {
        bool hot;
        ~Done() {
          if (hot) hot_compiles_outstanding.fetch_sub(1, std::memory_order_acq_rel);
        }
      } done{hot};
      try {
        region->executable = CompileModule(name, region->module_text, /*single_op=*/false, /*count=*/false);
        region->module_text.clear();
        region->ready.store(true, std::memory_order_release);
      } catch (const std::exception& e) {
        region->error = e.what();
        region->failed.store(true, std::memory_order_release);
      } catch (...) {
        region->error = "unknown error";
        region->failed.store(true, std::memory_order_release);
      }
    }, /*low_priority=*/hot);
  }

  // On a region-cache miss: whether this region's structure (its sequence
  // of ops, modulo sizes) has already been compiled for
  // kMaxSizesPerStructure other keys, so it is run op by op instead of
  // compiling once more (a key recurring kHotRecurrence times is compiled
  // after all: `hot` is set; where it would compile in the background,
  // `background`, only while no other hot key's compile is outstanding).
  // Counts the compile otherwise; `sizes_vary` is set when the structure
  // had been compiled for another key before.
  bool Churning(bool background, bool* sizes_vary, bool* hot, StructureKeys** keys_out) {
    const size_t structure = RegionStructure();
    if (structures_.size() >= kMaxStructures) {
      structures_.clear();
      churn_counts_.clear();
      ClearPassThroughState();
    }
    const size_t sizes = RegionSizes();
    StructureKeys& keys = structures_.try_emplace(structure, StructureKeys{0, sizes}).first->second;
    *keys_out = &keys;
    int& compiled = keys.compiled;
    *sizes_vary = compiled > 0;
    // A second key at other sizes while the structure's first key (a
    // program, compiled or compiling) has not recurred: the sizes change
    // from one sight to the next (the (c) block of bench_dynamic_shapes:
    // 20 sequence lengths, each seen once; generate()'s decoding steps, one
    // KV length each), so this key churns as a later one would, one key
    // early: its program is neither built (~0.15-0.3 ms on the calling
    // thread for a 21-call region) nor compiled, and its calls count toward
    // their single-op compiles as strict mode's do (a compiling region's
    // defer them). (c) first pass, 20 interleaved rounds: fused 35.5 ms,
    // 36.3 ms without, strict 35.7 ms. A first key that recurs first (a
    // workload alternating between two shapes) lets the second compile at
    // its next sight. Only at the key's first sight: its sizes are wanted
    // (a region following them is recorded, not passed through), so a key
    // that recurs compiles at its second sight (two lengths alternating,
    // 17 and 40, 40 times each: 2 compiles, as without early churn; with
    // it alone, the second length was passed through until hot and ran its
    // single-op compiles, 20). Fused mode's background keys only;
    // TORCH_TPU_FUSED_CHURN_AHEAD=0 turns it off with PredictChurn's.
    const bool early = compiled > 0 && compiled < kMaxSizesPerStructure && background && sizes != keys.first_sizes &&
                       CurrentMode() == EagerMode::kFused && !deferred_ && AheadOfChurnEnabled() &&
                       FirstKeyUnused(keys) && !churn_counts_.count(sizes);
    if (compiled >= kMaxSizesPerStructure || early) {
      // Op-by-op runs are counted by size signature, as PassThrough counts
      // the regions it runs.
      int& seen = churn_counts_[sizes];
      if (CurrentMode() == EagerMode::kFused && !deferred_) NoteChurning(sizes);
      if (early) WantRecordedPrefixes();
      if (++seen < kHotRecurrence) return true;
      if (background && hot_compiles_outstanding.load(std::memory_order_acquire) > 0) return true;
      *hot = true;
    }
    // This key is the structure's last before it churns, and its sizes
    // differ from the structure's first key's (not just which values stay
    // alive after it: a training loop synced every 3 steps has two keys of
    // its step, cut at the loop boundary and at the sync, whose later sights
    // recur): any other key of it will run op by op, so regions beginning
    // with its first op may be passed through from this one's sync point on
    // (a region following a compiled key's sizes is still recorded: wanted
    // prefixes). Before, the third key's region was recorded only to run op
    // by op.
    if (++compiled == kMaxSizesPerStructure && sizes != keys.first_sizes && CurrentMode() == EagerMode::kFused &&
        !deferred_ && AheadOfChurnEnabled())
      PredictChurn();
    return false;
  }

  // Whether the structure's first key has a program whose key has not been
  // flushed again since (Churning's early churn).
  static bool FirstKeyUnused(const StructureKeys& keys) {
    const std::shared_ptr<CompiledRegion> first = keys.first_region.lock();
    return first && !first->recurred;
  }

  // The recorded region's structure: its op sequence (graph calls by uid).
  size_t RegionStructure() const {
    size_t structure = 0;
    for (const auto& rc : calls_)
      structure = c10::hash_combine(structure, rc.graph ? std::hash<uint64_t>()(rc.graph->uid()) : OpSignature(*rc.op));
    return c10::hash_combine(structure, calls_.size());
  }

  // The recorded region's size signature (SizeSignature of each call).
  size_t RegionSizes() const {
    size_t sizes = 0;
    for (const auto& rc : calls_)
      sizes = c10::hash_combine(sizes, rc.graph ? std::hash<uint64_t>()(rc.graph->uid()) : SizeSignature(*rc.op, rc.args));
    return c10::hash_combine(sizes, calls_.size());
  }

  // The recorded region (of a churning structure) runs op by op: regions
  // beginning with its first call's op may be passed through from the next
  // sync point on; once its sizes have run op by op kHotRecurrence - 1
  // times, a region following its size signatures is recorded (it turns
  // hot at its next sight).
  void NoteChurning(size_t sizes) {
    if (!PredictChurn()) return;
    if (churn_counts_[sizes] + 1 >= kHotRecurrence - 1) WantRecordedPrefixes();
  }

  // The recorded region's structure churns (or will at its next key):
  // regions beginning with its first op may be passed through from the next
  // sync point on. False (nothing predicted) for a region opening with a
  // graph call.
  bool PredictChurn() {
    if (calls_.empty() || calls_.front().graph) return false;
    PredictedOps predicted;
    for (const auto& rc : calls_) {
      if (rc.graph) {
        predicted.AddGraph(rc.graph->uid());  // never passed through: such a structure never matches one
      } else {
        predicted.Add(*rc.op);
      }
    }
    churn_structures_.insert(predicted.Value());
    churn_first_ops_.insert(OpSignature(*calls_.front().op));
    max_churn_calls_ = std::max(max_churn_calls_, calls_.size());
    arm_pass_through_ = true;
    return true;
  }

  // Runs `op` at once as strict mode does, unrecorded, when the program is
  // passing a churning structure's region through (see PassThroughEnabled);
  // false: the call is to be recorded. A region whose calls so far follow a
  // wanted key's (a compiled or hot key: wanted_prefixes_, by size
  // signature) is recorded tentatively: once a call leaves every wanted
  // prefix, the calls recorded so far run op by op (Demote) and the rest of
  // the region is passed through. (generate()'s decoding steps all begin
  // with the same few calls, the one-token embedding and projections: from
  // the first call alone, every step looked like the compiled ones.)
  bool PassThrough(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
    if (CurrentMode() != EagerMode::kFused || OneProgramCallIndex() >= 0) {
      EndPassThrough();
      return false;
    }
    EndPassRegionAtSync();
    // A tentatively recorded region that followed a wanted key up to a loop
    // boundary ends there, recorded: Record flushes it (a compiled key runs
    // as one program) and records this call, pass-through over (FlushLocked).
    // Before, this call left every wanted prefix, so the recorded step ran op
    // by op and the rest was passed through: in a loop synced every 3 steps
    // whose structure churned, every step after a sync (its key compiled)
    // ran op by op.
    if (tentative_ && at_loop_boundary_ && !calls_.empty()) return false;
    const size_t num_args = op.schema().arguments().size();
    std::span<const c10::IValue> args = std::span<const c10::IValue>(*stack).subspan(stack->size() - num_args);
    // An argument holding a failed check: recorded, so its results inherit
    // the failure as fused mode's do (RunStrict would raise it here).
    if (!FailedInputChecks(args).empty()) {
      EndPassThrough();
      return false;
    }
    const size_t sizes = SizeSignature(op, args);
    const size_t op_sig = OpSignature(op);
    if (tentative_ && !calls_.empty()) {
      const size_t prefix = c10::hash_combine(tentative_prefix_, sizes);
      if (wanted_prefixes_.count(prefix)) {
        tentative_prefix_ = prefix;
        return false;  // still a wanted key's prefix: recorded
      }
      if (std::any_of(calls_.begin(), calls_.end(), [](const RecordedCall& rc) { return rc.graph != nullptr; })) {
        EndPassThrough();
        return false;
      }
      Demote();
    } else if (!calls_.empty()) {
      EndPassThrough();
      return false;
    }
    tentative_ = false;
    if (pass_calls_ == 0) {
      // A region's first call: pass it through where it begins the region
      // of a key whose program is compiling (NoteCompiling) or a churning
      // structure's region; record it tentatively where it begins a wanted
      // key's (of a churning structure).
      auto c = compiling_.find(op_sig);
      if (c != compiling_.end() && (c->second.region->ready.load(std::memory_order_acquire) ||
                                    c->second.region->failed.load(std::memory_order_acquire))) {
        compiling_.erase(c);  // recorded: the program runs it (a failed compile is warned about)
        c = compiling_.end();
      }
      const bool compiling = c != compiling_.end();
      const bool churning = churn_first_ops_.count(op_sig) && !ambiguous_first_ops_.count(op_sig);
      if (!compiling && !churning) {
        pass_through_ = false;
        return false;
      }
      // A wanted key's region is recorded tentatively, unless it begins
      // as the compiling key's does (that key's regions run op by op until
      // its program is ready). Another wanted key of the compiling key's
      // structure (a second length churned early, Churning) is recorded:
      // passed through, it ran its single-op compiles instead of compiling
      // at its second sight.
      const size_t first_prefix = c10::hash_combine(size_t{0}, sizes);
      if (wanted_prefixes_.count(first_prefix) && (!compiling || c->second.first_prefix != first_prefix)) {
        tentative_ = true;
        tentative_prefix_ = first_prefix;
        return false;
      }
      pass_compiling_ = compiling;
      // A region beginning as the compiling key's does is taken for that
      // key's (its program serves it from its next sight on): its calls
      // queue no single-op compile, even where its structure churns (two
      // lengths alternating, the first still compiling, counted one length's
      // single-op compiles: 11 compiles instead of 2).
      pass_defer_ = compiling && (!churning || c->second.first_prefix == first_prefix);
      pass_compiling_structure_ = compiling ? c->second.structure : 0;
      pass_limit_ = std::max(churning ? max_churn_calls_ : 0, compiling ? c->second.calls : 0);
      pass_first_op_ = op_sig;
      pass_epoch_ = SyncCount();
      pass_predicted_ = PredictedOps();
      pass_sizes_ = 0;
      pass_prefixes_.clear();
    } else if (pass_calls_ >= pass_limit_) {
      // Longer than the predicted region (any churning structure's, the
      // compiling key's), and no sync point
      // (one ends a recorded region at a read of a pending storage too; a
      // passed-through one only at Runtime::Sync): a wrong prediction.
      EndPassThrough();
      return false;
    }
    try {
      // A compiling key's region: its host-first calls queue no single-op
      // compile, as RunOneByOne's of a compiling region (the program serves
      // the key's next occurrence).
      HostFirstDeferScope defer(pass_defer_);
      RunStrict(op, stack, entry);
    } catch (const UnsupportedOp&) {
      // Runs on the CPU (the caller's fallback), a sync point: the region
      // ends before it, as a recorded one does (Record).
      EndPassRegion();
      throw;
    }
    ++pass_calls_;
    pass_predicted_.Add(op);
    pass_sizes_ = c10::hash_combine(pass_sizes_, sizes);
    pass_prefixes_.push_back(pass_sizes_);
    return true;
  }

  // A tentatively recorded region left every wanted prefix: its calls run
  // op by op now, as the first calls of a passed-through region (counted
  // once, at its end).
  void Demote() {
    PredictedOps predicted;
    size_t sizes = 0;
    // (A tentative region holds no graph call: RecordGraph ends
    // pass-through, and PassThrough checks before it calls Demote.)
    pass_prefixes_.clear();
    for (const auto& rc : calls_) {
      predicted.Add(*rc.op);
      sizes = c10::hash_combine(sizes, SizeSignature(*rc.op, rc.args));
      pass_prefixes_.push_back(sizes);
    }
    pass_first_op_ = OpSignature(*calls_.front().op);
    pass_epoch_ = SyncCount();
    pass_compiling_ = false;
    pass_defer_ = false;
    pass_limit_ = max_churn_calls_;
    const size_t n = calls_.size();
    tentative_ = false;
    {
      flushing_ = true;
      struct Reset {
        FusedExecutor* self;
        ~Reset() {
          self->ClearRecorded(/*last=*/true);
          self->at_loop_boundary_ = false;  // nothing recorded is left to cut
        }
      } reset{this};
      try {
        RunOneByOne(AliveCreatedStorages());
      } catch (...) {
        pass_through_ = false;
        throw;
      }
    }
    Runtime::Get().metrics().fused_regions_op_by_op--;  // counted with the passed-through rest (EndPassRegion)
    pass_calls_ = n;
    pass_predicted_ = predicted;
    pass_sizes_ = sizes;
  }

  // A sync point (Runtime::Sync: a read, torch.tpu.synchronize) since the
  // passed-through region began ends it. Not every flush request is one:
  // copy_ between whole storages asks for a flush (FlushPendingWork) before
  // sharing a buffer, which a recorded region's pending source never takes.
  void EndPassRegionAtSync() {
    if (pass_calls_ > 0 && SyncCount() != pass_epoch_) EndPassRegion();
  }

  // The passed-through region (if any) ends. Counted as a region run op by
  // op; checked against the prediction.
  void EndPassRegion() {
    if (pass_calls_ == 0) return;
    const size_t structure = pass_predicted_.Value();
    const size_t sizes = c10::hash_combine(pass_sizes_, pass_calls_);
    pass_calls_ = 0;
    Runtime::Get().metrics().fused_regions_op_by_op++;
    Runtime::Get().metrics().fused_regions_passed_through++;
    if (churn_structures_.count(structure)) {
      if (++churn_counts_[sizes] >= kHotRecurrence - 1) WantPrefixes(pass_prefixes_);
      return;
    }
    if (pass_compiling_) {
      if (structure == pass_compiling_structure_) return;
      // Another structure's region began with the compiling key's first op
      // (generate(): the prefill region's and a decoding step's): such
      // regions are recorded from now on while a key compiles (this one's
      // structure may want a program; pass-through of churning regions
      // beginning with the op is unchanged).
      ambiguous_compiling_ops_.insert(pass_first_op_);
      compiling_.erase(pass_first_op_);
      return;
    }
    // Not a churning structure's region: regions beginning with this op
    // are recorded from now on (this one's structure may want a program).
    ambiguous_first_ops_.insert(pass_first_op_);
  }

  // Pass-through ends: a region that had been passed through so far ends
  // there (a multi-tensor op or a graph call follows, recorded).
  void EndPassThrough() {
    EndPassRegion();
    pass_through_ = false;
    tentative_ = false;
  }

  void ClearPassThroughState() {
    pass_through_ = false;
    pass_calls_ = 0;
    churn_structures_.clear();
    churn_first_ops_.clear();
    ambiguous_first_ops_.clear();
    wanted_prefixes_.clear();
    max_churn_calls_ = 0;
    tentative_ = false;
    compiling_.clear();
    ambiguous_compiling_ops_.clear();
    pass_compiling_ = false;
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

  // The region's program (module text, input and output slots), not
  // compiled yet.
  std::shared_ptr<CompiledRegion> Build(const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& alive) {
    ProgramBuilder pb;
    pb.runtime_offsets = ShapePolyEnabled();  // as the region key (RecordCall)
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
      if (rc.graph) {
        AddGraphCall(pb, static_cast<int32_t>(c), rc, next_created);
        continue;
      }
      auto values = pb.AddCall(static_cast<int32_t>(c), *rc.op, rc.args, 0, *rc.eager->entry, rc.eager->spec);
      for (size_t r = 0; r < values.size(); ++r) {
        if (!values[r]) continue;
        const CreatedStorage& cs = created_[next_created++];
        int64_t dims[] = {values[r]->type.numel()};
        pb.Define(cs.device_storage, cs.element, cs.numel,
                  lowering::ResizeFlat(pb.b, pb.b.Reshape(*values[r], dims), cs.numel));
      }
    }
    auto region = std::make_shared<CompiledRegion>();
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
    region->module_text = pb.b.Module();
    return region;
  }

  // Lowers graph call `c` into the region: its inputs read from their
  // storages, its random ops' states as runtime inputs (drawn at the launch,
  // in program order), its body emitted inline, its outputs defined as the
  // created storages (from created_[next_created]) or written into donated
  // inputs' storages.
  void AddGraphCall(ProgramBuilder& pb, int32_t c, const RecordedCall& rc, size_t& next_created) {
    const GraphProgram& g = *rc.graph;
    std::vector<hlo::Value> inputs;
    inputs.reserve(rc.args.size());
    for (size_t k = 0; k < rc.args.size(); ++k) {
      InputSlot use;
      use.kind = InputSlot::Kind::kStorage;
      use.call = c;
      use.arg = static_cast<int16_t>(k);
      inputs.push_back(ReadWholeStorage(pb, rc.args[k].toTensor(), use));
    }
    std::vector<hlo::Value> rng;
    for (int64_t increment : g.rng_increments()) {
      if (pb.b.num_parameters() != pb.inputs.size()) throw std::logic_error("fused region: parameters and inputs out of step");
      rng.push_back(pb.b.Parameter(hlo::TensorType{hlo::ElementType::kU64, {2}}));
      InputSlot slot;
      slot.kind = InputSlot::Kind::kRng;
      slot.call = c;
      slot.arg = -1;  // the device's default generator, as the graph's own launch
      slot.element = hlo::ElementType::kU64;
      slot.rng_increment = increment;
      pb.inputs.push_back(slot);
    }
    // The graph's checks become the region's (raised at the sync point
    // after the region runs, as the graph's own launch would).
    std::vector<hlo::Value> checks;
    std::vector<hlo::Value> outs = g.EmitInto(pb.b, inputs, rng, &checks);
    for (size_t k = 0; k < checks.size(); ++k) pb.index_checks.emplace_back(checks[k], g.check_messages()[k]);
    if (GraphBarrier() && !outs.empty()) {
      std::vector<hlo::TensorType> types;
      for (const auto& v : outs) types.push_back(v.type);
      outs = pb.b.Op("stablehlo.optimization_barrier", outs, types);
    }
    std::vector<int> written(outs.size(), -1);  // program output -> input whose storage takes it
    for (size_t d = 0; d < rc.applied.size(); ++d)
      if (rc.applied[d]) written[static_cast<size_t>(g.donations()[d].second)] = g.donations()[d].first;
    for (size_t k = 0; k < outs.size(); ++k) {
      if (written[k] >= 0) {
        WriteWholeStorage(pb, rc.args[static_cast<size_t>(written[k])].toTensor(), outs[k]);
        continue;
      }
      const CreatedStorage& cs = created_[next_created++];
      if (cs.call != c || cs.ret != static_cast<int16_t>(k))
        throw std::logic_error("fused region: graph outputs and created storages out of step");
      int64_t dims[] = {outs[k].type.numel()};
      pb.Define(cs.device_storage, cs.element, cs.numel, lowering::ResizeFlat(pb.b, pb.b.Reshape(outs[k], dims), cs.numel));
    }
  }

  void Run(const CompiledRegion& region, const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& alive) {
    auto& rt = Runtime::Get();
    ArgResolver arg_of = [&](int32_t call, int16_t arg) -> const c10::IValue& {
      return calls_[static_cast<size_t>(call)].args[static_cast<size_t>(arg)];
    };
    LaunchInputs li = GatherInputs(region.inputs, arg_of, CurrentDeviceIndex(calls_.front().args),
                                   region.donor_inputs, /*poisoned_ok=*/true);
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
    // The region's checks and its inputs' unresolved ones guard every value
    // it writes (per region, not per value: a failure poisons all of them).
    CheckList own;
    own.reserve(region.check_messages.size());
    for (size_t i = 0; i < region.check_messages.size(); ++i)
      own.push_back(rt.AddPendingCheck(std::shared_ptr<pjrt::Buffer>(std::move(outs[region.outputs.size() + i])),
                                       region.check_messages[i]));
    for (size_t i = 0; i < region.outputs.size(); ++i) {
      const RegionOutput& o = region.outputs[i];
      StorageBuffer sb{std::shared_ptr<pjrt::Buffer>(std::move(outs[i])), o.element, o.numel, name};
      PoisonWith(sb, li.checks, own);
      if (o.created >= 0) {
        created_[static_cast<size_t>(o.created)].device_storage->Set(std::move(sb));
      } else {
        StorageOf(TensorOf(arg_of, o.use.call, o.use.arg, o.use.item)).Set(std::move(sb));
      }
    }
    if (done) rt.Track(std::move(done), name);
    (void)alive;  // kept alive until the storages are set
  }

  // The region's calls one by one, each exactly as strict mode runs it
  // (RunStrict: the same keys, shape-polymorphic programs included; a key
  // whose program is not compiled yet — recording only built its spec — is
  // served on the host by the ATen CPU kernel where it qualifies, its
  // compile queued on the background thread at its
  // HostFirstCompileAfter()-th call; else compiled and waited for); each
  // new output's buffer goes to the pending storage handed out (a bucket
  // program's output buffer may hold more elements than the recording
  // assumed: later calls are keyed on the buffers they find, as in strict
  // mode).
  //
  // `region_compiling`: the region's own program is queued on the
  // background compile thread (a new key, or one whose compile has not
  // ended). Its host-first calls then queue no single-op compile
  // (HostFirstDeferScope): the region's program serves the key's next
  // occurrence, and a single-op compile queued now would end after it (the
  // compile thread is FIFO). Without this a loop's region, a program's
  // tail or a per-step region queued one compile per repeated op key
  // (every AdamW op of a step: ~10 for an MLP) that nothing ran afterwards.
  // Regions run op by op for good (churn, a failed build or compile) count
  // calls as strict mode does.
  void RunOneByOne(const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& alive, bool region_compiling = false) {
    Runtime::Get().metrics().fused_regions_op_by_op++;
    HostFirstDeferScope defer(region_compiling);
    size_t next_created = 0;
    // Each call runs under the default dtype it was recorded (and keyed)
    // with (CPU's kernel of a host-served call reads it).
    struct RestoreDefault {
      caffe2::TypeMeta dtype;
      ~RestoreDefault() { c10::set_default_dtype(dtype); }
    } restore{c10::get_default_dtype()};
    size_t i = 0;
    try {
      for (; i < calls_.size(); ++i) {
        RecordedCall& rc = calls_[i];
        if (rc.graph) {
          RunGraphAlone(rc, next_created);
          continue;
        }
        // An input known to hold a failed check (poisoned before the region
        // ran, its error reported): the call does not run and what it writes
        // inherits the failure, as the region's program would give it;
        // strict mode's RunStrict would raise here, at an unrelated flush.
        if (CheckList failed = FailedInputChecks(rc); !failed.empty()) {
          PoisonCall(rc, next_created, failed);
          continue;
        }
        c10::set_default_dtype(rc.default_dtype);
        torch::jit::Stack stack(rc.args.begin(), rc.args.end());
        RunStrict(*rc.op, &stack, *rc.eager->entry);
        // The stack holds the op's returns: new tensors where the spec says so.
        for (size_t r = 0; r < rc.eager->spec.outputs.size(); ++r) {
          if (!rc.eager->spec.defined[r] || rc.eager->spec.return_alias[r] >= 0) continue;
          const CreatedStorage& cs = created_[next_created++];
          cs.device_storage->Set(StorageOf(stack[r].toTensor()).current());
        }
      }
    } catch (const c10::IndexError& e) {
      PoisonUnrun(i, next_created, e.what_without_backtrace(), /*index_error=*/true);
      throw;
    } catch (const c10::Error& e) {
      PoisonUnrun(i, next_created, e.what_without_backtrace(), false);
      throw;
    } catch (const std::exception& e) {
      PoisonUnrun(i, next_created, e.what(), false);
      throw;
    }
    (void)alive;
  }

  // The failed checks (known failed, not pending) guarding the storages of
  // call rc's tpu tensor arguments.
  static CheckList FailedInputChecks(const RecordedCall& rc) { return FailedInputChecks(rc.args); }
  static CheckList FailedInputChecks(std::span<const c10::IValue> args) {
    CheckList failed;
    for (const auto& v : args)
      ForEachTensor(v, [&](const at::Tensor& t) {
        if (!IsTpuStorage(t)) return;
        for (const auto& c : StorageOf(t).current().checks)
          if (c->state.load(std::memory_order_acquire) == CheckState::kFailed) InheritChecks(failed, CheckList{c});
      });
    return failed;
  }

  // Whether t is a defined tensor with a tpu storage.
  static bool IsTpuStorage(const at::Tensor& t) {
    return t.defined() && t.has_storage() && t.device().type() == c10::DeviceType::PrivateUse1;
  }

  // What ATen call rc would write, guarded by `checks` instead of computed:
  // its new storages (created_[next_created...]) get an empty buffer with
  // the checks, the storages it writes in place (Tensor(a!) arguments, and
  // _copy_from's dst, which `.float()` / `.to()` write into a new tensor)
  // get them added, so every read raises the failure, never the value from
  // before (zeros for a fresh tensor).
  void PoisonCall(const RecordedCall& rc, size_t& next_created, const CheckList& checks) {
    for (size_t r = 0; r < rc.eager->spec.outputs.size(); ++r) {
      if (!rc.eager->spec.defined[r] || rc.eager->spec.return_alias[r] >= 0) continue;
      const CreatedStorage& cs = created_[next_created++];
      cs.device_storage->Set(StorageBuffer{nullptr, cs.element, cs.numel, "fused region", checks});
    }
    const auto& schema_args = rc.op->schema().arguments();
    const bool copy_from = rc.op->schema().name() == "aten::_copy_from";
    auto poison = [&](const at::Tensor& t) {
      if (!IsTpuStorage(t)) return;
      DeviceStorage& ds = StorageOf(t);
      if (ds.pending()) return;  // a later call's new storage: poisoned when that call is reached
      StorageBuffer sb = ds.current();
      if (!sb.buffer) {  // never written (a new tensor `.float()` copies into): typed as the tensor
        sb.element = lowering::ToElementType(t.scalar_type());
        sb.numel = Capacity(static_cast<int64_t>(ds.nbytes() / ElementSize(sb.element)));
        sb.producer = "fused region";
      }
      InheritChecks(sb.checks, checks);
      ds.Set(std::move(sb));
    };
    for (size_t a = 0; a < schema_args.size() && a < rc.args.size(); ++a) {
      const auto* alias = schema_args[a].alias_info();
      if ((alias && alias->isWrite()) || (copy_from && a == 1)) ForEachTensor(rc.args[a], poison);
    }
  }

  // A call of a region run op by op raised (calls_[failed]: CPU's error at
  // the op, e.g. a host-served a // 0): it and the calls after it never
  // run; what they would write is poisoned with the error (PoisonCall). The
  // error is being raised now: the poison raises again on reads only, not
  // at a later sync point. Graph calls' new storages stay pending (a read
  // raises "has no value").
  void PoisonUnrun(size_t failed, size_t next_created, const std::string& message, bool index_error) {
    auto check = std::make_shared<CheckState>();
    check->message = index_error ? message : Runtime::ValueCheckMessage(message);
    check->state.store(CheckState::kFailed, std::memory_order_release);
    check->raised.store(true, std::memory_order_release);
    const CheckList checks{check};
    for (size_t i = failed; i < calls_.size(); ++i) {
      const RecordedCall& rc = calls_[i];
      if (rc.graph) return;  // how many storages it creates is the graph's: stop here
      PoisonCall(rc, next_created, checks);
    }
  }

  // A graph call of a region run op by op: the graph's own program, its
  // outputs given to the storages the recording handed out.
  void RunGraphAlone(const RecordedCall& rc, size_t& next_created) {
    GraphProgram& g = *rc.graph;
    std::vector<at::Tensor> inputs;
    inputs.reserve(rc.args.size());
    for (size_t k = 0; k < rc.args.size(); ++k) {
      inputs.push_back(rc.args[k].toTensor());
      // Recording checked it (a view, conjugate bits: a recorded clone);
      // a copy now would record into this region. A buffer swapped since
      // (another capacity) still feeds as is: Launch resizes it.
      if (!g.FeedsAsIs(static_cast<int>(k), inputs.back()))
        throw std::logic_error("fused region: graph " + g.name() + " input " + std::to_string(k) +
                               " changed layout before the region ran");
    }
    std::vector<at::Tensor> outs = g.Launch(inputs);
    std::vector<int> written(outs.size(), -1);
    for (size_t d = 0; d < rc.applied.size(); ++d)
      if (rc.applied[d]) written[static_cast<size_t>(g.donations()[d].second)] = g.donations()[d].first;
    for (size_t k = 0; k < outs.size(); ++k) {
      if (written[k] >= 0) {
        const at::Tensor& input = inputs[static_cast<size_t>(written[k])];
        if (!outs[k].is_same(input)) StorageOf(input).Set(StorageOf(outs[k]).current());  // not donated: copy in
        continue;
      }
      created_[next_created++].device_storage->Set(StorageOf(outs[k]).current());
    }
  }

  std::recursive_mutex mutex_;
  bool flushing_ = false;
  bool deferred_ = false;  // calls recorded while deferring between graphs (strict mode): churn applies
  int region_device_ = -1;  // the device of the recorded calls
  std::vector<RecordedCall> calls_;
  size_t units_ = 0;  // calls_ with `unit` set: the ops the size bound counts
  std::vector<CreatedStorage> created_;
  std::vector<int64_t> key_;
  std::vector<size_t> call_key_begin_;  // per call: where its atoms start in key_
  StorageIds ids_;
  // Loop detection (ObserveLoop): stream positions count the calls recorded
  // in fused mode since the start.
  uint64_t pos_ = 0;                     // position of the next call
  uint64_t last_sync_pos_ = 0;           // position after the last sync point
  std::vector<uintptr_t> loop_history_;  // signatures, ring buffer of kLoopHistory
  std::unordered_map<uintptr_t, uint64_t> last_seen_;  // signature -> last position
  uint64_t loop_period_ = 0;             // candidate period (0: none)
  uint64_t loop_run_ = 0;                // consecutive calls equal to the call a period before
  uint64_t shorter_period_ = 0;          // a second candidate (the latest distance), and its run
  uint64_t shorter_run_ = 0;
  bool loop_confirmed_ = false;          // the run covers two periods: cut at boundaries
  bool at_loop_boundary_ = false;        // the recorded calls end at a loop boundary
  uint64_t loop_anchor_ = 0;             // a position where a loop region starts
  // Churn: compiled keys per region structure; op-by-op runs per key hash.
  std::unordered_map<size_t, StructureKeys> structures_;
  std::unordered_map<size_t, int> churn_counts_;  // region size signature -> op-by-op runs
  // Churn pass-through (PassThroughEnabled).
  bool pass_through_ = false;       // regions may be passed through (armed at a churning region's sync)
  bool arm_pass_through_ = false;   // set by the region being flushed (NoteChurning)
  size_t pass_calls_ = 0;           // calls of the region being passed through
  size_t pass_first_op_ = 0;        // its first call's op
  uint64_t pass_epoch_ = 0;         // SyncCount() when it began
  std::vector<size_t> pass_prefixes_;  // its size-signature prefixes, one per call
  bool tentative_ = false;          // the recorded region follows a wanted key's prefix so far
  size_t tentative_prefix_ = 0;     // its size-signature prefix
  PredictedOps pass_predicted_;     // its op sequence and sizes so far
  size_t pass_sizes_ = 0;
  size_t max_churn_calls_ = 0;      // the longest churning structure's region, calls
  std::unordered_set<size_t> churn_structures_;    // structures whose regions ran op by op for churn
  std::unordered_set<size_t> churn_first_ops_;     // their first calls' ops
  std::unordered_set<size_t> ambiguous_first_ops_; // ops that began a region of another structure
  std::unordered_set<size_t> wanted_prefixes_;     // size-signature prefixes of keys to record (compiled, hot)
  // Keys whose program compiles in the background (NoteCompiling), by
  // their region's first op: the latest such key per op.
  struct Compiling {
    std::shared_ptr<CompiledRegion> region;
    size_t structure = 0;          // PredictedOps of its calls
    size_t calls = 0;
    size_t first_prefix = 0;       // its first call's size-signature prefix (PassThrough)
  };
  std::unordered_map<size_t, Compiling> compiling_;
  std::unordered_set<size_t> ambiguous_compiling_ops_;  // began another structure's region while compiling
  bool pass_compiling_ = false;        // the passed-through region is predicted by compiling_
  bool pass_defer_ = false;            // ... and not by a churning structure (HostFirstDeferScope)
  size_t pass_compiling_structure_ = 0;
  size_t pass_limit_ = 0;              // its predicted length, calls (at most)
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

std::vector<at::Tensor> RecordGraphCall(std::shared_ptr<GraphProgram> graph, const std::vector<at::Tensor>& inputs) {
  return Fused().RecordGraph(std::move(graph), inputs);
}

size_t FusedRegionSize() {
  FusedExecutor* e = instance.load();
  return e ? e->size() : 0;
}

}  // namespace torch_tpu::runtime
