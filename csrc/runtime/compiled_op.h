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

#include <memory>
#include <mutex>
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
  enum class Kind : uint8_t { kStorage, kScalar, kRng };
  Kind kind = Kind::kStorage;
  int16_t arg = 0;    // argument position on the stack
  int16_t item = -1;  // element of a tensor list, or -1
  hlo::ElementType element = hlo::ElementType::kF32;
};

// What each executable output becomes.
struct OutputSlot {
  enum class Kind : uint8_t { kNewTensor, kStorageWrite };
  Kind kind = Kind::kNewTensor;
  int16_t arg = -1, item = -1;  // kStorageWrite: whose storage is replaced
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;   // kNewTensor
  hlo::ElementType element = hlo::ElementType::kF32;
  int64_t numel = 0;
};

// The op's returns: a new tensor (index into outputs) or an argument
// returned as it is (in-place and out= ops).
struct ReturnSlot {
  bool is_arg = false;
  int16_t index = 0;
};

struct CompiledOp {
  std::string name;  // "aten::add.Tensor"
  const lowering::LoweringEntry* entry = nullptr;
  std::unique_ptr<pjrt::Executable> executable;
  std::vector<InputSlot> inputs;
  std::vector<OutputSlot> outputs;
  std::vector<ReturnSlot> returns;
  int64_t rng_increment = 0;
  // out= arguments resized (to these sizes) before each launch.
  std::vector<std::pair<int16_t, std::vector<int64_t>>> resize_outputs;
  std::string module_text;  // kept for TORCH_TPU_DUMP_HLO and errors
};

// The base lowering name of an ATen op: "aten::add_" and "aten::add.out"
// share "add".
std::string BaseName(const c10::FunctionSchema& schema);

class OpCache {
 public:
  // The compiled op for this call (compiling on a miss). Throws
  // UnsupportedOp where the call cannot be lowered.
  const CompiledOp& Lookup(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                           const lowering::LoweringEntry& entry);
  size_t size() const { return map_.size(); }
  void Clear() { map_.clear(); }

 private:
  std::mutex mutex_;  // ops run on the Python thread and the autograd thread
  std::unordered_map<OpKey, std::unique_ptr<CompiledOp>, OpKeyHash> map_;
};

OpCache& GlobalOpCache();

// Launches the op with the call's arguments (the last `num_args` values of
// the stack), replaces them with the op's returns, and returns the new
// output tensors (for the debug executor's checks). If `track` is set the
// launch's completion event is tracked for the next sync point.
std::vector<at::Tensor> Launch(const CompiledOp& op, torch::jit::Stack& stack, size_t num_args);

// The device storage behind a `tpu` tensor.
DeviceStorage& StorageOf(const at::Tensor& t);
// A new contiguous `tpu` tensor whose storage holds `buffer`.
at::Tensor WrapBuffer(StorageBuffer buffer, at::IntArrayRef sizes, at::ScalarType dtype, int device_index);

}  // namespace torch_tpu::runtime
