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
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "hlo/builder.h"
#include "lowering/lowering.h"
#include "pjrt/pjrt.h"

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

class GraphProgram {
 public:
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
  // declared dtypes and sizes; others than contiguous whole-storage tensors
  // are copied contiguous first). Returns one tensor per SetOutputs id:
  // outputs that are inputs return the input tensor itself, repeated ids the
  // same tensor. Asynchronous: errors surface at the next sync point.
  std::vector<at::Tensor> Run(const std::vector<at::Tensor>& inputs);

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
  // What each Run() result is.
  struct ResultSlot {
    enum class Kind : uint8_t { kComputed, kInput } kind = Kind::kComputed;
    int index = 0;  // program output index, or input index
  };
  struct ValueInfo {
    hlo::Value value;
    at::ScalarType dtype = at::kFloat;
    int input = -1;  // >= 0: this value is graph input `input`
  };

  const ValueInfo& ValueAt(int id, const std::string& op) const;

  std::string name_;
  hlo::Builder builder_;
  std::vector<ValueInfo> values_;
  std::vector<InputInfo> inputs_;
  std::vector<ParamSlot> params_;
  std::vector<int64_t> rng_increments_;
  std::vector<ResultSlot> results_;
  std::vector<lowering::OutputSpec> output_specs_;  // per program output
  std::vector<int> output_ids_;                     // SetOutputs ids
  std::vector<std::pair<int, int>> donations_;      // (input, program output) aliased
  bool outputs_set_ = false;
  int num_calls_ = 0;
  std::string module_text_;
  std::unique_ptr<pjrt::Executable> executable_;
};

}  // namespace torch_tpu::runtime
