// torch_tpu: turning one ATen call into a compiled PJRT executable and
// launching it. Shared by every eager executor (strict, debug).
//
// The cache key is a typed struct, compared in full: the operator, then per
// argument its kind and what determines the program (dtype, sizes, strides,
// storage offset and storage size for tensors; value for static arguments;
// element type only for Scalars, which are runtime inputs; DESIGN.md,
// "Executable cache").
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <optional>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "lowering/lowering.h"
#include "runtime/runtime.h"

namespace torch_tpu::runtime {

// The op cannot be run through a lowering (no meta kernel, an unsupported
// argument, a lowering that declines): the caller falls back to CPU.
class UnsupportedOp : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct OpKey {
  const void* op = nullptr;  // the OperatorHandle's schema
  std::vector<int64_t> atoms;
  size_t hash = 0;
  bool operator==(const OpKey& o) const { return op == o.op && atoms == o.atoms; }
};
struct OpKeyHash {
  size_t operator()(const OpKey& k) const { return k.hash; }
};

// Where each runtime input of the executable comes from at launch.
struct InputSlot {
  // kExtent: the dynamic extent of a shape-polymorphic program (an s64
  // scalar): size(extent_dim) of argument `arg`.
  // kOffset: the storage offset (elements, an s64 scalar) of tensor `arg`
  // (`item`) of call `call`, in an offset-family program
  // (ProgramBuilder::runtime_offsets).
  enum class Kind : uint8_t { kStorage, kScalar, kRng, kExtent, kOffset };
  Kind kind = Kind::kStorage;
  int32_t call = 0;   // which call of a fused region (0 for a single op)
  int16_t arg = 0;    // argument position in the call
  int16_t item = -1;  // element of a tensor list, or -1
  hlo::ElementType element = hlo::ElementType::kF32;
  int64_t rng_increment = 0;  // kRng: values drawn, the generator offset's advance
  // kRng of a flat random program (PlanPolyFlat): the advance is
  // RngIncrementOf(numel of argument `rng_numel_of`) at launch instead.
  int16_t rng_numel_of = -1;
  int8_t extent_dim = 0;      // kExtent: the dynamic dim of argument `arg`
  // kStorage: the elements of the buffer the parameter declares
  // (ProgramBuilder::ReadFlat records it for every storage): the storage's
  // buffer when the call was keyed, or for a shape-polymorphic program's
  // dynamic read the canonical size at the bucket (`canonical`). A launch
  // given a buffer of another size resizes it (GatherInputs,
  // ResizeStorageBuffer) instead of failing in PJRT: the buffer can change
  // between a call's key and its launch, as a poly program launched in
  // between swaps in a storage's canonical buffer (debug mode's index
  // check downloads the index, which may clone it through a bucket
  // program). -1: not recorded (the storage's buffer as it is).
  int64_t numel = -1;
  // The storage keeps the resized buffer where it holds all its elements
  // (a poly read: the next poly read at the bucket finds it); otherwise the
  // resized copy is the launch's own and the storage keeps its buffer.
  bool canonical = false;
};

// What each executable output becomes.
struct OutputSlot {
  enum class Kind : uint8_t { kNewTensor, kStorageWrite, kIndexCheck };
  Kind kind = Kind::kNewTensor;
  int16_t arg = -1, item = -1;  // kStorageWrite: whose storage is replaced
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;   // kNewTensor (sizes[dynamic_dim]: the bucket where `dynamic`)
  std::vector<int64_t> strides; // kNewTensor: CallSpec::strides (empty: contiguous)
  hlo::ElementType element = hlo::ElementType::kF32;
  int64_t numel = 0;            // elements of the output buffer
  bool dynamic = false;         // kNewTensor: sizes[dynamic_dim] is scale * the launch's extent + offset
  int8_t dynamic_dim = 0;
  int64_t dynamic_scale = 1;    // cat of `scale` dynamic operands ...
  int64_t dynamic_offset = 0;   // ... and static ones of `offset` elements along the dim (PlanPolyConcat)
  // `dynamic` in a multi-dim plan (PlanPolyMulti): every dim whose bit is
  // set is the launch's extent (row-major; dynamic_dim is the first).
  uint64_t dynamic_mask = 0;
  // `dynamic` and permuted (strides not row-major): the dims outermost to
  // innermost in memory (PhysicalOrder); the launch's strides follow it.
  std::vector<int64_t> order;
};

// A new tensor output's strides at `sizes` (the launch's, for a dynamic
// one): OutputSlot::strides, or for a permuted dynamic output the dense
// strides of its `order` (size-1 dims get the stride of their place in it).
// Empty: row-major.
std::vector<int64_t> OutputStrides(const OutputSlot& o, std::span<const int64_t> sizes);
// A dynamic new output's sizes at a launch (or host-first call) whose
// leader argument is `leader` (OutputSlot::dynamic): the leader's sizes
// for a flat program (poly_dim < 0), else o.sizes with the dims in
// dynamic_mask (multi-dim) or dynamic_dim (scale * extent + offset) at
// the leader's extent, its size(poly_dim).
std::vector<int64_t> DynamicOutputSizes(const OutputSlot& o, int poly_dim, const at::Tensor& leader);

// The op's returns: a new tensor (index into outputs) or an argument
// returned as it is (in-place and out= ops).
struct ReturnSlot {
  bool is_arg = false;
  int16_t index = 0;
};

// What PyTorch's meta kernel says about one call: per return, the output
// spec and whether it is a written argument (in-place self, out=) or a new
// tensor; out= arguments that must be resized first.
// How an op resizes an out= tensor of the wrong size (CPU's kernels):
// at::native::resize_output (warns when it had elements), or, for
// LoweringTraits::out_resized_by_numel ops, a plain resize_ (linspace,
// logspace: no warning) or, with LoweringTraits::out_resize_warns, arange's
// own warning ("... The out tensor will be resized to a tensor of shape
// (n,)", RangeFactories.cpp) then resize_.
enum class OutResize : uint8_t { kResizeOutput, kPlain, kArange };

struct CallSpec {
  std::vector<lowering::OutputSpec> outputs;  // dtype of the target for written returns
  std::vector<int16_t> return_alias;          // written argument, or -1 for a new tensor
  std::vector<std::pair<int16_t, std::vector<int64_t>>> resize_outputs;
  OutResize out_resize = OutResize::kResizeOutput;
  std::vector<bool> defined;                  // false: the op returns an undefined tensor (output_mask)
  // Per return: a new tensor's strides where they are not row-major (the
  // meta kernel's: TensorIterator's stride propagation, memory_format=), a
  // dense non-overlapping permutation; empty: contiguous. The program writes
  // the value in that physical order (AddCall), so the tensor has CPU's strides.
  std::vector<std::vector<int64_t>> strides;
};

// A host-first program without its executable yet (OpCache::Lookup):
// `queue` submits its compile to the background compile thread (once, on the
// key's TORCH_TPU_HOST_FIRST_COMPILE_AFTER-th call or when a caller that
// cannot be served on the host needs it; `queued`, `calls` and `queue` are
// guarded by the OpCache's mutex); `done` is set (or holds the compile's
// error) once the CompiledOp's executable is there; `ready` is its fast check.
struct CompiledOp;
struct PendingCompile {
  std::shared_future<void> done;
  std::atomic<bool> ready{false};
  bool queued = false;
  // Host-first calls of the key so far (host-served before the queue),
  // counted once per sync epoch (the calls between two sync points,
  // Runtime::Sync): `calls` epochs with a call, `epoch` the SyncCount() of
  // the last, `epoch_calls` the calls in it (OpCache::Lookup's rule).
  int64_t calls = 0;
  uint64_t epoch = 0;
  int64_t epoch_calls = 0;
  // Whether any call used the entry (a fused recording is not a call): also
  // set by calls HostFirstDeferScope keeps out of `calls`.
  bool called = false;
  std::function<void(const std::shared_ptr<CompiledOp>&, bool load_now)> queue;
};

struct CompiledOp {
  std::string name;  // "aten::add.Tensor"
  CallSpec spec;
  const lowering::LoweringEntry* entry = nullptr;
  std::unique_ptr<pjrt::Executable> executable;
  std::vector<InputSlot> inputs;
  std::vector<OutputSlot> outputs;
  std::vector<ReturnSlot> returns;
  std::vector<std::string> check_messages;  // per kIndexCheck output, in order
  std::vector<int64_t> donor_inputs;         // inputs aliased to their storage's new value
  // out= arguments resized (to these sizes) before each launch.
  std::vector<std::pair<int16_t, std::vector<int64_t>>> resize_outputs;
  OutResize out_resize = OutResize::kResizeOutput;
  std::string module_text;  // kept for TORCH_TPU_DUMP_HLO and errors
  // A shape-polymorphic program (OpCache::Lookup): serves every call whose
  // argument `poly_leader` has size(poly_dim) in (.., poly_bucket]; `spec`
  // is the call's at the bucket then, not any one call's.
  int16_t poly_leader = -1;
  int16_t poly_leader_item = -1;  // the leader's item where it is a tensor list (cat), else -1
  int8_t poly_dim = 0;            // -1: over the leader's numel (PlanPolyFlat)
  int64_t poly_bucket = 0;
  // Set while (and after) the executable compiles in the background; every
  // user but the call that started it waits on it (OpCache::Lookup).
  std::shared_ptr<PendingCompile> pending;
};

// Runs the op on meta tensors; throws UnsupportedOp if it cannot.
// `dynamic` (per argument, may be empty): the tensor arguments marked 1 are
// seen with size(dim) = `extent` (contiguous); dim < 0: as [extent] (a
// flat program, whose in-place targets keep their own sizes). `multi_n` >
// 0 (a multi-dim plan, PlanPolyMulti): the dims in `marks` (per argument,
// a bitmask of dims of size multi_n) are seen at `extent` instead.
CallSpec ComputeSpec(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                     bool out_resized_by_numel = false, std::span<const int8_t> dynamic = {},
                     int64_t extent = 0, int64_t dim = 0, int64_t multi_n = 0,
                     std::span<const uint64_t> marks = {});
void ApplyResizes(const CallSpec& spec, const torch::jit::Stack& stack, size_t first);
// Resizes each (argument, sizes) of `resizes` as `rule` says.
void ResizeOuts(const std::vector<std::pair<int16_t, std::vector<int64_t>>>& resizes, OutResize rule,
                const torch::jit::Stack& stack, size_t first);

// The checks one lowered call computes beside its results (pred 0-d values,
// true = the call's inputs are invalid) and the message each raises at the
// next sync point (Runtime::AddPendingCheck): IndexRangeChecks for the
// entry's index_checks traits (computed from `ctx`'s arguments: an
// IndexError naming the dimension and size, RuntimeError where
// IndexCheck::runtime_error), LoweringChecks for what the lowering declared
// (ctx.checks: RuntimeError, marked by Runtime::ValueCheckMessage;
// ctx.index_errors: IndexError). Messages start with `name` (the ATen op,
// "aten::floor_divide.Tensor") and end with `where` (when it is raised).
// Shared by the eager executors (ProgramBuilder) and compiled graphs
// (graph_program.cpp).
using ProgramCheck = std::pair<hlo::Value, std::string>;
void IndexRangeChecks(hlo::Builder& b, const std::string& name, const lowering::LoweringContext& ctx,
                      const lowering::LoweringEntry& entry, const std::string& where,
                      std::vector<ProgramCheck>& checks);
void LoweringChecks(const std::string& name, const lowering::LoweringContext& ctx, const std::string& where,
                    std::vector<ProgramCheck>& checks);
// `where` of the eager executors' messages.
extern const char kEagerCheckWhere[];

// Builds one program from one or more ATen calls over tpu storages
// (DESIGN.md, "Memory model"): a storage read for the first time becomes a
// parameter (the whole rank-1 buffer), each tensor argument is its view,
// and written arguments update the storage's value. Eager executors add one
// call; the fused executor adds a region's calls.
class ProgramBuilder {
 public:
  struct StorageState {
    const DeviceStorage* storage;
    InputSlot first_use;  // where the storage is found at launch
    hlo::ElementType element;
    int64_t numel;
    std::optional<hlo::Value> param;    // the storage as read from its buffer
    std::optional<hlo::Value> current;  // its value after this program's writes
    int32_t input_index = -1;           // the parameter (= input) holding `param`
    bool poly = false;                  // read as a dynamic tensor: `numel` is the canonical size (PolyRows)
  };
  hlo::Builder b;
  std::vector<InputSlot> inputs;
  std::vector<StorageState> storages;
  // Checks of the calls: index ranges (entries' index_checks traits; the
  // IndexError message) and the lowerings' value checks
  // (LoweringContext::check; message marked by Runtime::ValueCheckMessage,
  // raised as RuntimeError): a pred value, true = failed.
  std::vector<std::pair<hlo::Value, std::string>> index_checks;
  // Shape polymorphism (one call, call 0): the tensor arguments marked in
  // `dynamic` are read with dim `dim` = bucket (positions past the runtime
  // extent — an s64 parameter, size(dim) of argument `leader` — are
  // padding of no defined content, replaced by `fill` where that is not
  // kAny); their storages and dynamic outputs are written as buffers of
  // numel-at-the-bucket elements whose prefix is the extent's contiguous
  // tensor (PolyRead / PolyWrite). dim = -1: a flat program (PlanPolyFlat):
  // the one dynamic tensor is read and written as [bucket], its numel's.
  struct Poly {
    std::vector<int8_t> dynamic;  // marks per argument, then per list item (PolyMarked in the .cpp)
    int64_t bucket = 0;
    int16_t leader = -1;
    int16_t leader_item = -1;
    size_t num_items = 0;  // list-item marks at the end of `dynamic`
    int64_t dim = 0;
    lowering::PadFill fill = lowering::PadFill::kAny;
    std::optional<hlo::Value> extent;
    // > 0: a multi-dim plan (PlanPolyMulti): the dims in `marks` (per
    // argument, a bitmask of dims of size multi_n, the compiling call's
    // extent) are at the bucket; such tensors are read and written by
    // gathers (MultiRead/MultiWrite).
    int64_t multi_n = 0;
    std::vector<uint64_t> marks;
  };
  std::optional<Poly> poly;
  // Offset families (DESIGN.md "Shape-polymorphic eager programs",
  // **offset families**): a tensor argument at a nonzero storage offset is
  // read and written at a runtime offset (an s64 parameter per use,
  // InputSlot::kOffset): a dynamic slice of the view's extent, then the view
  // at offset 0. One program serves every offset of a view whose sizes,
  // strides and storage are the same (x[:, k] for every k).
  bool runtime_offsets = false;
  // The runtime extent (an s64 parameter, created at first use).
  hlo::Value PolyExtent();
  // `flat` (a buffer holding a contiguous tensor of `dims` with
  // dims[dim] = the extent, then anything) as a `dims` value with
  // dims[dim] = the bucket; positions past the extent along `dim` hold
  // other elements or zeros.
  hlo::Value PolyRead(hlo::Value flat, std::span<const int64_t> dims, int64_t dim);
  // The inverse: `value` (dims[dim] = the bucket) as a flat buffer of its
  // numel whose prefix is the contiguous tensor at the extent.
  // An output of `scale` * extent + `offset` along `dim` (cat) is laid out
  // with runs of that size.
  hlo::Value PolyWrite(hlo::Value value, int64_t dim, int64_t scale = 1, int64_t offset = 0);
  // Multi-dim plans: `value` (row-major, the dims in `mask` at the bucket)
  // as a flat buffer of its numel whose prefix is the contiguous tensor
  // with those dims at the extent (one gather; the rest is zeros).
  hlo::Value MultiWrite(hlo::Value value, uint64_t mask);

  // Lowers one call (arguments at stack[first...]); returns, per return,
  // the value of a new tensor (shaped and typed per `spec`), or nullopt
  // where the return is a written argument (or undefined). Throws
  // UnsupportedOp where the lowering declines.
  std::vector<std::optional<hlo::Value>> AddCall(int32_t call, const c10::OperatorHandle& op,
                                                 const torch::jit::Stack& stack, size_t first,
                                                 const lowering::LoweringEntry& entry, const CallSpec& spec);
  // From now on `storage` holds `flat` (a new tensor of a fused region).
  void Define(const DeviceStorage* storage, hlo::ElementType element, int64_t numel, hlo::Value flat);
  // For a storage the program both reads and writes: lets result
  // `result_index` (its new value) reuse the input buffer when the launch
  // donates it (Builder::AliasParameter). Returns the input index, or -1
  // where the storage is not read (or its value changes type).
  int32_t AliasWrittenStorage(const StorageState& st, size_t result_index);

 private:
  StorageState& StateFor(const at::Tensor& t, const InputSlot& use);
  hlo::Value ReadFlat(StorageState& st);
  hlo::Value ReadTensor(const at::Tensor& t, const InputSlot& use);
  bool PolyDynamic(const InputSlot& use) const;
  // The canonical buffer of a dynamic tensor at the bucket (the parameter's
  // size whatever the storage's buffer is): its contiguous block with the
  // dynamic dim at Capacity(bucket), in elements.
  int64_t PolyBufferNumel(const at::Tensor& t, uint64_t marks) const;
  // A dynamic tensor at the bucket, padding filled; `marks`: its marked dims (multi-dim plans).
  hlo::Value PolyRows(const at::Tensor& t, hlo::Value flat, uint64_t marks);
  uint64_t PolyMarks(const InputSlot& use) const;  // a multi-dim plan's marked dims of an argument
  // Multi-dim plans: t (a box, BoxOf in the .cpp: contiguous, a dense
  // permuted/expanded view, or a view with static gaps at an offset) read
  // from `flat` at the bucket by one gather whose indices use t's strides
  // at the runtime extent; padding positions hold 0 or the plan's fill.
  hlo::Value MultiRead(const at::Tensor& t, hlo::Value flat, uint64_t marks);
  // c * extent^p as an s64 0-d value (a stride or numel at the runtime extent).
  hlo::Value ExtentTerm(int64_t c, int p);
  // The s64 offset parameter of `use` (runtime_offsets), made at first use.
  hlo::Value OffsetParam(const InputSlot& use);
  // The elements from t's first to its last (runtime_offsets and a nonzero
  // offset); 0 where t is read at its static offset. Throws UnsupportedOp
  // where the extent exceeds `flat` (t's storage as t's element type).
  int64_t RuntimeOffsetExtent(const at::Tensor& t, const hlo::Value& flat) const;
  std::vector<std::pair<InputSlot, hlo::Value>> offsets_;
  void WriteTensor(const at::Tensor& t, const InputSlot& use, hlo::Value value);
};

// Compiles a module through the on-disk cache, counting metrics; errors
// name `name` and carry the module text.
// `single_op`: an eager single-op program, compiled with options cheaper to
// compile (SingleOpOptions in compiled_op.cpp; DESIGN.md, "Why eager ops
// compile").
// `count`: add one to metrics()["compiles"] (false: the caller counted it
// when it queued the compile, so that the count does not depend on when a
// background compile ends).
std::unique_ptr<pjrt::Executable> CompileModule(const std::string& name, const std::string& module_text,
                                                bool single_op = false, bool count = true);

// Host-first calls (strict mode; DESIGN.md "Host-first calls"): a call
// whose single-op program is neither in memory nor in the disk cache is
// served by the ATen CPU kernel; its program compiles on a background thread
// from the key's HostFirstCompileAfter()-th call (default: the 2nd), strict
// calls stay host-served until it is ready (with N = 1: later calls wait).
// TORCH_TPU_HOST_FIRST=0 turns it off (default 1); throws
// std::invalid_argument naming the variable for another value.
bool HostFirstEnabled();
// The most bytes (tpu storages read + outputs) of a host-served call:
// TORCH_TPU_HOST_FIRST_MAX_BYTES (a non-negative integer; default 4 MiB).
// Larger calls compile synchronously (on an accelerator the round trip
// would cost more than a compile). Throws std::invalid_argument naming the
// variable for a value that is not a non-negative integer.
int64_t HostFirstMaxBytes();
// The call of a key on which its host-first program's compile is queued:
// TORCH_TPU_HOST_FIRST_COMPILE_AFTER (an integer in [1, 1000000]; default 2).
// N = 1: on the first call, and every later call waits for that compile.
// N > 1: calls are counted once per sync epoch (the calls between two sync
// points: torch.tpu.synchronize(), .item(), a copy to the host); the calls
// of the first N-1 epochs that call the key are host-served without
// compiling anything (a key used in fewer than N epochs costs no compile at
// all), a call in the N-th epoch — or the kHostFirstBurst-th call within
// one epoch (a loop without sync points) — queues the compile, and strict
// calls that qualify are host-served (never waiting) until the executable
// is ready. Throws std::invalid_argument naming the variable for another
// value.
int64_t HostFirstCompileAfter();
constexpr int64_t kHostFirstBurst = 4;
// While a HostFirstDeferScope(true) lives on this thread (the fused
// executor running a region's calls one by one while that region's own
// program is queued on the background compile thread), a host-first call is
// host-served without counting toward HostFirstCompileAfter() and queues no
// single-op compile: the region's program runs those calls from its next
// occurrence on, and a single-op compile queued now would finish after it
// anyway (the compile thread is FIFO). Calls that do not qualify for
// host-first serving compile as before; with N = 1 nothing changes. And a
// bucket program's read of a storage pads it into a copy of the launch's
// own instead of leaving the canonical buffer in the storage (GatherInputs):
// the region's key holds the storage's buffer, which its program declares.
class HostFirstDeferScope {
 public:
  explicit HostFirstDeferScope(bool on);
  ~HostFirstDeferScope();
  HostFirstDeferScope(const HostFirstDeferScope&) = delete;
  HostFirstDeferScope& operator=(const HostFirstDeferScope&) = delete;

 private:
  bool previous_;
};
// Waits until every queued background compile has finished (OpCache::Clear,
// before fork(), at exit).
void AwaitBackgroundCompiles();

// While one lives, the background compile threads (and the threads their
// compiles started) run at the constructing thread's niceness instead of
// TORCH_TPU_COMPILE_NICE's: held by every wait for a background compile
// (AwaitCompiled, AwaitBackgroundCompiles, a synchronous compile queued
// behind DiskCache's compile mutex), so a waiter never waits at a niced
// compile's pace (priority inversion). Nothing where the waiter is not
// less nice than the worker, or no worker exists.
class CompileBoost {
 public:
  CompileBoost();
  ~CompileBoost();
  CompileBoost(const CompileBoost&) = delete;
  CompileBoost& operator=(const CompileBoost&) = delete;

 private:
  bool active_ = false;
};
// Runs `task` on the background compile thread (FIFO, after the compiles
// queued before it at its priority; AwaitBackgroundCompiles waits for it too). `task` must
// not throw. Used by the fused executor for region programs.
// `low_priority`: runs only when no other task is queued (a churning
// structure's hot keys: a bet on recurrences, which must not delay the
// single-op compiles host-served calls are waiting for).
void SubmitBackgroundCompile(std::function<void()> task, bool low_priority = false);
// Reads the background compile thread's settings (TORCH_TPU_COMPILE_THREADS,
// TORCH_TPU_COMPILE_NICE) if not yet read; throws a RuntimeError naming a
// bad value. Callers that queue a compile call it before they mark
// anything as queued.
void CheckBackgroundCompileSettings();
// Whether the on-disk cache holds `module_text` compiled as CompileModule
// compiles it (`single_op` as there): a load is cheap, so callers load it
// at once instead of compiling in the background.
bool InDiskCache(const std::string& module_text, bool single_op = false);
// Serves one call on the host as `compiled` would compute it on the device
// (csrc/aten/fallback.cpp): every tpu storage the call's tensors view is
// copied to the host (a sync of those buffers only), the ATen CPU kernel
// runs on host tensors of the same sizes, strides and offsets (so CPU's
// checks raise at the op, as CPU raises them), the storages `compiled`
// writes are uploaded back and its new tensors are made as Launch makes
// them (contiguous, the same buffer capacity), so later calls see the same
// keys whether a call was served on the host or on the device. Counts
// metrics()["host_served"], not a CPU fallback. Replaces the arguments (the
// last `num_args` values of the stack) by the returns and returns true; or,
// where a result of CPU's kernel has other sizes or dtype than the
// program's (internal outputs such as embedding_bag's offset2bag), leaves
// the stack as it was, counts metrics()["host_first_declined"] and returns
// false: the caller runs the program.
bool ServeOnHost(const CompiledOp& compiled, const c10::OperatorHandle& op, torch::jit::Stack& stack,
                 size_t num_args);

// `sb`'s contents in a new buffer of `numel` elements (the prefix copied, the
// rest zeros): one program per (element type, sizes), compiled once (counted
// in metrics()["compiles"] as "tpu::resize_buffer"), launched asynchronously;
// the new buffer keeps `sb`'s checks and producer (compiled_op.cpp).
StorageBuffer ResizeStorageBuffer(const StorageBuffer& sb, int64_t numel, int device_index);

// Input buffers of a launch. `arg_of(call, arg)` returns the IValue of an
// argument of a call.
struct LaunchInputs {
  std::vector<pjrt::Buffer*> buffers;
  std::vector<std::shared_ptr<pjrt::Buffer>> temps;
  std::vector<int64_t> donated;  // inputs the execution may consume
  int device_index = 0;
  CheckList checks;  // the inputs' value checks not known to have passed: every output inherits them
};
using ArgResolver = std::function<const c10::IValue&(int32_t call, int16_t arg)>;
// `donors`: the executable's inputs aliased to outputs (donor_inputs); each
// is donated when its storage's buffer has no other holder (not shared with
// another storage, a pending check or a transfer), so the write reuses the
// buffer instead of allocating a new one. The caller must then give the
// storage the aliased output. An input whose value check failed raises its
// error (the original op's), unless `poisoned_ok` (a fused region: its
// outputs inherit the failure through LaunchInputs::checks and raise it when
// read, so the region's other values survive).
LaunchInputs GatherInputs(const std::vector<InputSlot>& inputs, const ArgResolver& arg_of, int default_device,
                          const std::vector<int64_t>& donors = {}, bool poisoned_ok = false);
const at::Tensor& TensorOf(const ArgResolver& arg_of, int32_t call, int16_t arg, int16_t item);
// Argument `v` as a tensor, or its item `item` >= 0 where it is a tensor
// list (a shape-polymorphic program's leader: cat's dynamic item).
const at::Tensor& TensorItem(const c10::IValue& v, int16_t item);

// The base lowering name of an ATen op: "aten::add_" and "aten::add.out"
// share "add".
std::string BaseName(const c10::FunctionSchema& schema);

// The most compiled executables each in-memory cache keeps
// (TORCH_TPU_MAX_CACHED_EXECUTABLES, a positive integer; default 4096). Each
// XLA CPU executable holds ~3 memory mappings of JIT code: a process that
// keeps ~20k of them reaches the default vm.max_map_count (65530) and LLVM
// fails ("Cannot allocate memory"). 4096 holds the working set of an eager
// training step (hundreds to a few thousand op signatures) with room to
// spare, and bounds the single-op and fused-region caches together at
// ~25k mappings. Throws std::invalid_argument naming the variable if it is
// not a positive integer.
size_t MaxCachedExecutables();
// Whether OpCache::Lookup may serve calls with shape-polymorphic programs:
// TORCH_TPU_SHAPE_POLY=0 turns it off (exact shapes only; default 1).
// Throws std::invalid_argument naming the variable for another value.
bool ShapePolyEnabled();
// Executables dropped by the in-memory caches' least-recently-used
// eviction (torch_tpu.metrics()["executable_cache_evictions"]).
std::atomic<int64_t>& ExecutableEvictions();

// A map bounded by MaxCachedExecutables(), evicting the least recently
// used entry. Values are shared: an evicted entry lives on while a caller
// (a launch in progress, a fused region that recorded it) holds it; the
// PJRT executable it owns is destroyed with the last holder, and PJRT
// frees the runtime executable only after its last execution completes
// (PJRT_LoadedExecutable_Delete in pjrt_c_api.h). Not thread-safe: the
// owner locks.
template <typename Key, typename Value, typename Hash>
class LruCache {
 public:
  // The entry, now the most recently used; nullptr if absent.
  std::shared_ptr<Value> Find(const Key& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second.position);
    return it->second.value;
  }
  // Inserts (or replaces) the entry as the most recently used and evicts
  // the least recently used ones beyond the limit.
  std::shared_ptr<Value> Insert(const Key& key, std::shared_ptr<Value> value) {
    auto [it, inserted] = map_.try_emplace(key);
    if (inserted) {
      order_.push_front(&it->first);
      it->second.position = order_.begin();
    } else {
      order_.splice(order_.begin(), order_, it->second.position);
    }
    it->second.value = std::move(value);
    std::shared_ptr<Value> result = it->second.value;
    const size_t limit = MaxCachedExecutables();
    while (map_.size() > limit) {
      const Key* oldest = order_.back();
      order_.pop_back();
      map_.erase(*oldest);
      ExecutableEvictions()++;
    }
    return result;
  }
  size_t size() const { return map_.size(); }
  void Clear() {
    map_.clear();
    order_.clear();
  }

 private:
  struct Slot {
    std::shared_ptr<Value> value;
    typename std::list<const Key*>::iterator position;
  };
  std::unordered_map<Key, Slot, Hash> map_;  // node-based: key addresses are stable
  std::list<const Key*> order_;              // most recently used first
};

class OpCache {
 public:
  // The compiled op for this call (compiling on a miss); the caller holds
  // it while launching it (it may be evicted meanwhile). Throws
  // UnsupportedOp where the call cannot be lowered.
  //
  // `shape_poly` (the strict and debug executors; not the fused one, which
  // lowers the call again with the returned spec): once an op has compiled
  // for kPolyAfter distinct shapes that differ only in a leading dim, and
  // its entry is shape_poly, a call whose leading dim n >= 1 is served by a
  // program for the bucket of n (runtime::Capacity), n passed at launch
  // (DESIGN.md "One ATen call", dynamic dims).
  //
  // `host_served` (the strict executor): where non-null, a miss whose call
  // qualifies for host-first serving (HostFirstEnabled; not a random op,
  // no out= tensor to resize, a CPU kernel, at most HostFirstMaxBytes, the program
  // not in the disk cache) sets *host_served, queueing its compile on the
  // background thread at the key's HostFirstCompileAfter()-th call (N > 1:
  // such calls of a queued key stay host-served until it is ready): the op
  // returned has no executable yet, the caller serves the call with
  // ServeOnHost and must not Launch it. Every other
  // return is ready to launch (a pending compile is waited for; its error
  // is raised here).
  //
  // `spec_only` (the fused executor's recording): a miss builds the program
  // up to its module text (meta kernel, lowering, slots: the call is
  // validated and its `spec` known) but compiles nothing; the entry gets an
  // un-queued PendingCompile and no compile is counted. A hit is returned
  // as it is, compiled or not (never waited for). The executable is
  // compiled only when a caller needs it: a strict or debug call of the key
  // (as for a host-first entry; a fused region run op by op runs its calls
  // as strict calls).
  std::shared_ptr<const CompiledOp> Lookup(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                           const lowering::LoweringEntry& entry, bool shape_poly = false,
                                           bool* host_served = nullptr, bool spec_only = false);
  static constexpr int kPolyAfter = 2;
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cache_.size();
  }
  void Clear() {
    AwaitBackgroundCompiles();
    std::lock_guard<std::mutex> lock(mutex_);
    cache_.Clear();
    recorded_.Clear();
    families_.clear();
  }

 private:
  std::mutex mutex_;  // ops run on the Python thread and the autograd thread
  LruCache<OpKey, const CompiledOp, OpKeyHash> cache_;
  // Exact entries built by spec_only lookups (fused recording), whether or
  // not cache_ serves their key with a bucket program.
  LruCache<OpKey, const CompiledOp, OpKeyHash> recorded_;
  // Per shape family (the key without leading dims and storage sizes):
  // its static compiles (-1: a family the polymorphic path declined) and
  // the least and greatest extent its calls had (its bucket rule).
  struct Family {
    int count = 0;
    int64_t min_n = INT64_MAX, max_n = 0;
  };
  std::unordered_map<size_t, Family> families_;
  std::shared_ptr<CompiledOp> SpecFromBucket(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                             size_t first, const lowering::LoweringEntry& entry, const OpKey& key,
                                             bool* ripe);
};

OpCache& GlobalOpCache();

// Elements of the buffer `t`'s storage has (its capacity; Materialize makes
// that many for a never-written one): what a program reading the whole
// storage declares, and what a call's key holds.
int64_t StorageNumel(const at::Tensor& t);

// Appends the key atoms of a call to `atoms`, numbering storages with
// `storage_ids` (shared across the calls of a fused region).
struct StorageIds {
  std::vector<const DeviceStorage*> seen;
  int64_t Id(const DeviceStorage* s);
};
// `dynamic`/`extent`/`dim` (shape-polymorphic keys): marked tensors are
// keyed with size(dim) = extent (-1: a family key), their memory order
// instead of strides and, instead of the storage's bytes, whether they
// cover them all; never their buffer's size (the program declares the
// canonical one, InputSlot::numel).
// `runtime_offsets` (an offset family's key): a tensor's nonzero storage
// offset is keyed as -1 (any nonzero offset; zero stays 0).
// `multi_n` > 0 (a multi-dim plan): the dims in `marks` (per argument, a
// bitmask of dims of size multi_n) are keyed as -16 - extent (a dim marked
// so, told apart from a static dim of the bucket's size).
void AppendCallKey(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                   const lowering::LoweringEntry& entry, std::vector<int64_t>& atoms, StorageIds& storage_ids,
                   std::span<const int8_t> dynamic = {}, int64_t extent = 0, int64_t dim = 0,
                   bool runtime_offsets = false, int64_t multi_n = 0, std::span<const uint64_t> marks = {});

// Whether a tpu tensor argument (or tensor-list item) of the call is a view
// at a nonzero storage offset (OpCache::Lookup's offset families).
bool HasOffsetView(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first);

// Launches the op with the call's arguments (the last `num_args` values of
// the stack), replaces them with the op's returns, and returns the new
// output tensors (for the debug executor's checks). If `track` is set the
// launch's completion event is tracked for the next sync point.
std::vector<at::Tensor> Launch(const CompiledOp& op, torch::jit::Stack& stack, size_t num_args);

// Calls `fn` on every tensor of argument value `v` (a tensor, or an item of
// a tensor list / optional tensor list; undefined ones included).
template <typename Fn>
void ForEachTensor(const c10::IValue& v, Fn&& fn) {
  if (v.isTensor()) {
    fn(v.toTensor());
  } else if (v.isTensorList() || (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList())) {
    for (const auto& item : v.toListRef())
      if (item.isTensor()) fn(item.toTensor());
  }
}

// The device storage behind a `tpu` tensor.
DeviceStorage& StorageOf(const at::Tensor& t);
// A new contiguous `tpu` tensor whose storage holds `buffer`.
at::Tensor WrapBuffer(StorageBuffer buffer, at::IntArrayRef sizes, at::ScalarType dtype, int device_index,
                      at::IntArrayRef strides = {});

}  // namespace torch_tpu::runtime
