// torch_tpu: one whole graph of ATen calls (an FX graph from TorchDynamo /
// AOTAutograd) lowered as ONE StableHLO module through the same lowering
// registry as the eager executors, compiled once and launched as one
// executable (DESIGN.md, "What a user sees": torch.compile(backend="tpu")).
//
// Values are SSA ids. Graph inputs are whole contiguous tpu tensors: the
// program's parameter is the flat storage buffer (rank 1) reshaped to the
// input's sizes. Every call is lowered by FindLowering(base name); view ops
// (entries with traits.graph_only) are lowered as values. Results are cast and
// reshaped to the output specs the graph's meta values give, as
// compiled_op.cpp does for new outputs. Random ops (traits.needs_rng) get a
// tensor<2xui64> (seed, offset) input each, drawn from the tpu generator at
// run time.
//
// Value and index checks: every call's checks (the ones the eager executors
// compute: the entry's index_checks traits, the lowering's ctx.check /
// ctx.check_index; compiled_op.h, IndexRangeChecks / LoweringChecks) are
// program outputs too, one pred per distinct message (checks with the same
// message OR-combined, in the order of their first call), after the
// results. Launch registers them (RegisterChecks) so the next sync point
// raises CPU's error naming the ATen op; a fused region holding the graph
// takes them as its own checks (EmitInto). A graph without checks has no
// extra output.
//
// In fused eager mode a launch is not a sync point: Run records the graph as
// ONE call of the fused region (RecordGraphCall, fused_executor.cpp) and the
// region re-emits the graph's calls into its own module (EmitInto: the same
// lowering code as AddCall), so the eager calls between graphs (a loss, an
// optimizer step) and the graphs make one program (docs/design.md,
// "Programs per training step").
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "hlo/builder.h"
#include "lowering/lowering.h"
#include "pjrt/pjrt.h"
#include "runtime/runtime.h"

namespace torch_tpu::runtime {

// The call cannot be lowered inside a graph (no lowering, an argument kind
// the graph path does not handle, a lowering that declines): the caller
// (the Dynamo backend) runs the graph another way.
class GraphUnsupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One argument of a graph call, by schema position.
struct GraphArg {
  enum class Kind : uint8_t {
    kNone,      // None / an absent optional / a generator (the tpu default one is used)
    kValue,     // a graph value (tensor)
    kList,      // Tensor[] / Tensor?[]: `list` (-1 = None entry)
    kConstant,  // anything else, already converted to the schema type
  };
  Kind kind = Kind::kNone;
  int id = -1;
  std::vector<int> list;
  c10::IValue constant;
};

class GraphProgram : public std::enable_shared_from_this<GraphProgram> {
 public:
  // A check computed by the program: a 0-d pred (true = failed) and its
  // message (compiled_op.h, ProgramCheck).
  using Check = std::pair<hlo::Value, std::string>;
  explicit GraphProgram(std::string name = "graph");
  ~GraphProgram();
  GraphProgram(const GraphProgram&) = delete;
  GraphProgram& operator=(const GraphProgram&) = delete;

  // A graph input: a tpu tensor of `dtype` and `sizes`. Returns its value id.
  int AddInput(at::ScalarType dtype, const std::vector<int64_t>& sizes);

  // One ATen call. `args` are in schema order (out= arguments excluded; a
  // trailing argument may be omitted to take its default); `outputs` has one
  // spec per returned tensor (one per element for ops returning Tensor[]; a
  // spec with dtype Undefined for a return the op leaves undefined). Returns
  // a value id per output (-1 for undefined ones). Throws GraphUnsupported.
  std::vector<int> AddCall(const c10::OperatorHandle& op, std::vector<GraphArg> args,
                           const std::vector<lowering::OutputSpec>& outputs);
  // Same, by qualified name: "aten::add.Tensor".
  std::vector<int> AddCall(const std::string& qualified_name, std::vector<GraphArg> args,
                           const std::vector<lowering::OutputSpec>& outputs);

  // The graph's results, in order (an id may repeat or be an input).
  void SetOutputs(const std::vector<int>& ids);

  // Lets graph output `output` (a SetOutputs position holding a computed
  // value of input `input`'s dtype and sizes: AOTAutograd's new value of a
  // mutated input) reuse input `input`'s buffer. At Run, when the input is a
  // whole storage that alone holds its buffer and is fed once, the buffer
  // is donated, the storage takes the result (the mutation applied in
  // place) and that output is the input tensor itself; otherwise the output
  // is a new tensor. Call after SetOutputs, before Compile. Throws
  // std::invalid_argument for a bad index, a non-computed output, a type
  // mismatch, an output whose value is also another output (a training
  // forward graph's saved tensor), or a second donation of the input or
  // output.
  void DonateInput(int input, int output);

  // Builds the module and compiles it (through the on-disk cache).
  void Compile();
  bool compiled() const { return executable_ != nullptr; }

  // Runs the program: `inputs` in AddInput order (tpu tensors of the
  // declared dtypes and sizes, all on one device; others than contiguous
  // whole-storage tensors are copied contiguous first). Returns one tensor
  // per SetOutputs id: outputs that are inputs return the input tensor
  // itself, repeated ids the same tensor. Asynchronous: errors surface at
  // the next sync point. In fused eager mode (unless
  // TORCH_TPU_FUSED_GRAPHS=0, or the program is not owned by a shared_ptr)
  // the launch is recorded as one call of the fused region and the outputs
  // are pending tensors; otherwise the recorded region runs first and the
  // program is launched by itself (Launch). Throws std::invalid_argument
  // for inputs of another count, dtype, size or device.
  std::vector<at::Tensor> Run(const std::vector<at::Tensor>& inputs);

  // The program launched by itself, now: the recorded fused region (if
  // any) runs first. Returns one tensor per program output (output_specs()
  // order; a donated input's output is the input tensor itself when the
  // donation applied, else a new tensor).
  std::vector<at::Tensor> Launch(const std::vector<at::Tensor>& inputs);

  // Validates `inputs` as Run does; returns their device index (the current
  // device for a graph without inputs).
  int CheckInputs(const std::vector<at::Tensor>& inputs) const;
  // Whether `t` can be fed as input `input` as it is: a contiguous tensor
  // covering its whole storage, whose buffer has the input's element type
  // (Run copies other tensors contiguous first). A buffer of another
  // capacity is fed as is: the launch resizes it (its first elements).
  bool FeedsAsIs(int input, const at::Tensor& t) const;

  // Emits the graph's calls into `b` (another module: a fused region's),
  // with the lowering code AddCall uses. `inputs`: one value per graph
  // input (its declared dtype's element type and sizes); `rng`: one
  // tensor<2xui64> (seed, offset) value per random op (num_rng_ops(), in
  // rng_increments() order). Returns one value per program output, of
  // output_specs()' dtypes and sizes. Throws GraphUnsupported where a
  // lowering declines (it accepted the same call in AddCall).
  // `checks` (when given) receives the graph's checks in `b`: one pred
  // per check_messages() entry, in order.
  std::vector<hlo::Value> EmitInto(hlo::Builder& b, std::span<const hlo::Value> inputs,
                                   std::span<const hlo::Value> rng, std::vector<hlo::Value>* checks = nullptr) const;

  // What a Run result is: a program output (kComputed) or an input as it is.
  struct ResultSlot {
    enum class Kind : uint8_t { kComputed, kInput } kind = Kind::kComputed;
    int index = 0;  // program output index, or input index
  };
  const std::vector<ResultSlot>& results() const { return results_; }
  // Per program output: dtype and sizes (the checks' preds, which follow
  // them in the executable's outputs, excluded).
  const std::vector<lowering::OutputSpec>& output_specs() const { return output_specs_; }
  // The message each check pred raises (Runtime::AddPendingCheck's
  // format: Runtime::ValueCheckMessage-marked ones as RuntimeError, others
  // as IndexError). Known after SetOutputs.
  const std::vector<std::string>& check_messages() const { return check_messages_; }
  int num_checks() const { return static_cast<int>(check_messages_.size()); }
  // (input, program output) pairs DonateInput accepted.
  const std::vector<std::pair<int, int>>& donations() const { return donations_; }
  // Values each random op draws (the generator offset's advance), in order.
  const std::vector<int64_t>& rng_increments() const { return rng_increments_; }
  at::ScalarType input_dtype(int input) const { return inputs_.at(static_cast<size_t>(input)).dtype; }
  // A number no other GraphProgram of the process has (a fused region's key
  // names the graph by it: an address could be reused by a later program).
  uint64_t uid() const { return uid_; }

  const std::string& module_text() const { return module_text_; }
  const std::string& name() const { return name_; }
  int num_inputs() const { return static_cast<int>(inputs_.size()); }
  int num_calls() const { return num_calls_; }
  int num_rng_ops() const { return static_cast<int>(rng_increments_.size()); }
  // Whether the op ("aten::add.Tensor") has a lowering (by base name).
  static bool HasLowering(const std::string& qualified_name);

 private:
  struct InputInfo {
    at::ScalarType dtype;
    std::vector<int64_t> sizes;
    int64_t numel;
    hlo::ElementType element;
  };
  // Program parameters in order: a graph input (index) or an RNG state
  // (index into rng_increments_).
  struct ParamSlot {
    bool rng = false;
    int index = 0;
  };
  struct ValueInfo {
    hlo::Value value;
    at::ScalarType dtype = at::kFloat;
    int input = -1;  // >= 0: this value is graph input `input`
  };
  // One call as AddCall accepted it (arguments with defaults filled in),
  // kept so that EmitInto can lower it again into another module.
  struct CallRecord {
    c10::OperatorHandle op;
    const lowering::LoweringEntry* entry;
    std::vector<GraphArg> args;
    std::vector<lowering::OutputSpec> outputs;
    caffe2::TypeMeta default_dtype;  // lowerings may read it
  };
  // Lowers `call` into `b` over `values` (value ids index it), appending a
  // value per defined output; `rng_state`: the call's (seed, offset) value
  // when its entry needs_rng. Returns the output ids (-1 for undefined).
  // The call's checks are appended to `checks` (messages naming the op).
  std::vector<int> LowerCall(hlo::Builder& b, std::vector<ValueInfo>& values, const CallRecord& call,
                             std::optional<hlo::Value> rng_state, std::vector<Check>& checks) const;
  // `checks` OR-combined per message (first appearance order): the preds
  // (in `b`) and, when `messages` is given, their messages.
  static std::vector<hlo::Value> CombineChecks(hlo::Builder& b, const std::vector<Check>& checks,
                                               std::vector<std::string>* messages);
  // Hands a launch's check flags (check_messages() order) to the runtime,
  // raised at the next sync point (Runtime::AddPendingCheck), and returns
  // their states: Launch gives them to every buffer the launch writes (its
  // outputs, donated inputs included: PoisonWith), so a failed check
  // raises again at each later read of those values. The one place graph
  // launches register checks.
  CheckList RegisterChecks(std::vector<std::unique_ptr<pjrt::Buffer>> flags) const;
  static const ValueInfo& ValueAt(const std::vector<ValueInfo>& values, int id, const std::string& op);

  std::string name_;
  uint64_t uid_;
  hlo::Builder builder_;
  std::vector<ValueInfo> values_;
  std::vector<InputInfo> inputs_;
  std::vector<ParamSlot> params_;
  std::vector<int64_t> rng_increments_;
  std::vector<ResultSlot> results_;
  std::vector<lowering::OutputSpec> output_specs_;  // per program output
  std::vector<int> output_ids_;                     // SetOutputs ids
  std::vector<int> computed_ids_;                   // value id per program output
  std::vector<CallRecord> calls_;
  // Value-producing steps in order: >= 0 a call (index into calls_), < 0
  // graph input -1 - step (EmitInto replays them to number values alike).
  std::vector<int> steps_;
  std::vector<std::pair<int, int>> donations_;      // (input, program output) aliased
  std::vector<Check> checks_;                // the calls' checks in builder_, in call order
  std::vector<std::string> check_messages_;         // per check output (SetOutputs)
  bool outputs_set_ = false;
  int num_calls_ = 0;
  std::string module_text_;
  std::unique_ptr<pjrt::Executable> executable_;
};

// Records a launch of `graph` with `inputs` as ONE call of the fused
// executor's region (fused_executor.cpp; GraphProgram::Run in fused mode):
// validates the inputs (CheckInputs), copies those that cannot be fed as
// they are contiguous (recorded clones), and returns one tensor per program
// output (output_specs() order): a new tensor over a pending storage, or,
// for a donated input fed as it is and once, the input tensor itself, whose
// storage the region writes. The region keeps `graph` alive until it runs.
std::vector<at::Tensor> RecordGraphCall(std::shared_ptr<GraphProgram> graph, const std::vector<at::Tensor>& inputs);

}  // namespace torch_tpu::runtime
