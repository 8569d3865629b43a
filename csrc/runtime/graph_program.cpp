#include "runtime/graph_program.h"
#include "runtime/env.h"

#include <ATen/ATen.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "lowering/helpers.h"
#include "runtime/compiled_op.h"
#include "runtime/disk_cache.h"
#include "runtime/executor.h"
#include "runtime/runtime.h"

namespace torch_tpu::runtime {
namespace {

using lowering::LoweredArg;

bool IsScalarType(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::NumberType) return true;
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::NumberType;
  return false;
}

bool IsOutArg(const c10::Argument& a) { return a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite(); }

bool IsGeneratorType(const c10::TypePtr& t) { return t->str().find("Generator") != std::string::npos; }

std::string OpName(const c10::FunctionSchema& schema) {
  return schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
}

int64_t Numel(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool DumpHlo() {
  static bool dump = [] {
    const char* e = std::getenv("TORCH_TPU_DUMP_HLO");
    return e && *e && std::string(e) != "0";
  }();
  return dump;
}

// A Python number compiled into the graph as a 0-d constant of the element
// type an eager call would upload it as (floats f32 unless the call has an
// f64 tensor, integers s64, booleans pred).
hlo::Value ScalarConstant(hlo::Builder& b, const c10::Scalar& s, bool has_f64, hlo::ElementType* element) {
  if (s.isBoolean()) {
    *element = hlo::ElementType::kPred;
    return b.Constant({*element, {}}, s.toBool() ? 1.0 : 0.0);
  }
  if (s.isIntegral(false)) {
    *element = hlo::ElementType::kS64;
    return b.ConstantInt({*element, {}}, s.toLong());
  }
  if (s.isFloatingPoint()) {
    *element = has_f64 ? hlo::ElementType::kF64 : hlo::ElementType::kF32;
    return b.Constant({*element, {}}, s.toDouble());
  }
  throw GraphUnsupported("complex scalars are not supported on tpu");
}

}  // namespace

namespace {
std::atomic<uint64_t> next_uid{1};
}  // namespace

GraphProgram::GraphProgram(std::string name) : name_(std::move(name)), uid_(next_uid.fetch_add(1)) {}
GraphProgram::~GraphProgram() = default;

bool GraphProgram::HasLowering(const std::string& qualified_name) {
  auto dot = qualified_name.find('.');
  std::string name = dot == std::string::npos ? qualified_name : qualified_name.substr(0, dot);
  std::string overload = dot == std::string::npos ? "" : qualified_name.substr(dot + 1);
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op) return false;
  return lowering::FindLowering(BaseName(op->schema())) != nullptr;
}

int GraphProgram::AddInput(at::ScalarType dtype, const std::vector<int64_t>& sizes) {
  if (executable_ || !module_text_.empty()) throw std::logic_error("GraphProgram: AddInput after Compile");
  InputInfo in;
  in.dtype = dtype;
  in.sizes = sizes;
  in.numel = Numel(sizes);
  // complex32 is stored as u32 bit patterns (lowering::ToElementType) that
  // no lowering computes on: a graph with a complex32 input runs eagerly.
  if (dtype == at::kComplexHalf) throw GraphUnsupported("graph input: complex32 (ComplexHalf) runs on the CPU");
  try {
    in.element = lowering::ToElementType(dtype);
  } catch (const lowering::LoweringError& e) {
    throw GraphUnsupported(std::string("graph input: ") + e.what());
  }
  // The storage's whole buffer (its capacity, runtime::Capacity), of which
  // the tensor is the first numel elements.
  hlo::Value p = builder_.Parameter(hlo::TensorType{in.element, {Capacity(in.numel)}});
  params_.push_back({false, static_cast<int>(inputs_.size())});
  ValueInfo v;
  v.value = builder_.Reshape(lowering::ResizeFlat(builder_, p, in.numel), sizes);
  v.dtype = dtype;
  v.input = static_cast<int>(inputs_.size());
  steps_.push_back(-1 - static_cast<int>(inputs_.size()));
  inputs_.push_back(std::move(in));
  values_.push_back(std::move(v));
  return static_cast<int>(values_.size() - 1);
}

std::vector<int> GraphProgram::AddCall(const std::string& qualified_name, std::vector<GraphArg> args,
                                       const std::vector<lowering::OutputSpec>& outputs) {
  std::string name = qualified_name, overload;
  if (auto dot = qualified_name.find('.'); dot != std::string::npos) {
    name = qualified_name.substr(0, dot);
    overload = qualified_name.substr(dot + 1);
  }
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op) throw GraphUnsupported("unknown operator " + qualified_name);
  return AddCall(*op, std::move(args), outputs);
}

std::vector<int> GraphProgram::AddCall(const c10::OperatorHandle& op, std::vector<GraphArg> args,
                                       const std::vector<lowering::OutputSpec>& outputs) {
  if (executable_ || !module_text_.empty()) throw std::logic_error("GraphProgram: AddCall after Compile");
  const auto& schema = op.schema();
  const std::string op_name = OpName(schema);
  const lowering::LoweringEntry* entry = lowering::FindLowering(BaseName(schema));
  if (!entry) throw GraphUnsupported(op_name + " has no tpu lowering");
  if (schema.is_mutable()) throw GraphUnsupported(op_name + " mutates its arguments (graphs must be functional)");
  const auto& sargs = schema.arguments();

  // Positions of non-out arguments; trailing ones take their defaults.
  std::vector<size_t> positions;
  for (size_t i = 0; i < sargs.size(); ++i)
    if (!IsOutArg(sargs[i])) positions.push_back(i);
  if (args.size() > positions.size())
    throw GraphUnsupported(op_name + ": " + std::to_string(args.size()) + " arguments for " +
                           std::to_string(positions.size()));
  for (size_t k = args.size(); k < positions.size(); ++k) {
    const c10::Argument& a = sargs[positions[k]];
    if (!a.default_value()) throw GraphUnsupported(op_name + ": missing argument '" + a.name() + "'");
    GraphArg d;
    d.kind = a.default_value()->isNone() ? GraphArg::Kind::kNone : GraphArg::Kind::kConstant;
    d.constant = *a.default_value();
    args.push_back(std::move(d));
  }

  // Returns: one spec per returned tensor (ops returning Tensor[] any number).
  const auto& returns = schema.returns();
  bool list_return = returns.size() == 1 && returns[0].type()->kind() == c10::TypeKind::ListType;
  if (!list_return) {
    for (const auto& r : returns)
      if (r.type()->kind() != c10::TypeKind::TensorType)
        throw GraphUnsupported(op_name + " returns a " + r.type()->str() + ", not a Tensor");
    if (returns.size() != outputs.size())
      throw GraphUnsupported(op_name + ": " + std::to_string(outputs.size()) + " output specs for " +
                             std::to_string(returns.size()) + " returns");
  }

  CallRecord call{op, entry, std::move(args), outputs, c10::get_default_dtype()};
  std::optional<hlo::Value> rng_state;
  if (entry->traits.needs_rng) rng_state = builder_.Parameter(hlo::TensorType{hlo::ElementType::kU64, {2}});
  std::vector<int> ids = LowerCall(builder_, values_, call, rng_state, checks_);
  if (entry->traits.needs_rng) {
    params_.push_back({true, static_cast<int>(rng_increments_.size())});
    rng_increments_.push_back(lowering::LoweringContext::RngIncrement(outputs));
  }
  steps_.push_back(static_cast<int>(calls_.size()));
  calls_.push_back(std::move(call));
  ++num_calls_;
  return ids;
}

const GraphProgram::ValueInfo& GraphProgram::ValueAt(const std::vector<ValueInfo>& values, int id,
                                                     const std::string& op) {
  if (id < 0 || id >= static_cast<int>(values.size()))
    throw GraphUnsupported(op + ": argument refers to unknown graph value " + std::to_string(id));
  return values[static_cast<size_t>(id)];
}

std::vector<int> GraphProgram::LowerCall(hlo::Builder& b, std::vector<ValueInfo>& values, const CallRecord& call,
                                         std::optional<hlo::Value> rng_state, std::vector<Check>& checks) const {
  const auto& schema = call.op.schema();
  const std::string op_name = OpName(schema);
  const lowering::LoweringEntry* entry = call.entry;
  const auto& sargs = schema.arguments();
  const auto& outputs = call.outputs;
  std::vector<size_t> positions;
  for (size_t i = 0; i < sargs.size(); ++i)
    if (!IsOutArg(sargs[i])) positions.push_back(i);

  bool has_f64 = false;
  for (const auto& ga : call.args) {
    auto check = [&](int id) {
      if (id < 0) return;
      const auto& v = ValueAt(values, id, op_name);
      if (v.dtype == at::kDouble && v.value.rank() > 0) has_f64 = true;
    };
    if (ga.kind == GraphArg::Kind::kValue) check(ga.id);
    if (ga.kind == GraphArg::Kind::kList)
      for (int id : ga.list) check(id);
  }

  lowering::LoweringContext ctx(b, schema);
  for (size_t k = 0; k < positions.size(); ++k) {
    const c10::Argument& a = sargs[positions[k]];
    const GraphArg& ga = call.args[k];
    LoweredArg la;
    la.name = a.name();
    switch (ga.kind) {
      case GraphArg::Kind::kNone:
        la.kind = LoweredArg::Kind::kNone;
        la.ivalue = c10::IValue();
        break;
      case GraphArg::Kind::kValue: {
        const ValueInfo& v = ValueAt(values, ga.id, op_name);
        la.value = v.value;
        la.dtype = v.dtype;
        la.kind = IsScalarType(a.type()) ? LoweredArg::Kind::kScalar : LoweredArg::Kind::kTensor;
        break;
      }
      case GraphArg::Kind::kList:
        la.kind = LoweredArg::Kind::kTensorList;
        for (int id : ga.list) {
          if (id < 0) {
            la.list.push_back(hlo::Value{});
            la.present.push_back(false);
          } else {
            la.list.push_back(ValueAt(values, id, op_name).value);
            la.present.push_back(true);
          }
        }
        break;
      case GraphArg::Kind::kConstant: {
        const c10::IValue& c = ga.constant;
        bool tensor_arg = a.type()->kind() == c10::TypeKind::TensorType ||
                          (a.type()->cast<c10::OptionalType>() &&
                           a.type()->cast<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType);
        if (c.isNone()) {
          la.kind = LoweredArg::Kind::kNone;
          la.ivalue = c;
        } else if (c.isGenerator() || IsGeneratorType(a.type())) {
          la.kind = LoweredArg::Kind::kNone;
        } else if (c.isTensor()) {
          throw GraphUnsupported(op_name + ": tensor constant for argument '" + a.name() +
                                 "' (pass it as a graph input)");
        } else if ((IsScalarType(a.type()) && !entry->traits.static_scalars && c.isScalar()) ||
                   (tensor_arg && c.isScalar())) {
          // Python numbers: 0-d constants, as eager's 0-d runtime scalars.
          hlo::ElementType e;
          la.kind = LoweredArg::Kind::kScalar;
          la.value = ScalarConstant(b, c.toScalar(), has_f64, &e);
          la.dtype = lowering::ToScalarType(e);
          la.wrapped_number = true;
        } else {
          la.kind = LoweredArg::Kind::kStatic;
          la.ivalue = c;
        }
        break;
      }
    }
    ctx.args.push_back(std::move(la));
  }
  ctx.outputs = outputs;
  if (entry->traits.needs_rng) {
    if (!rng_state) throw std::logic_error("GraphProgram: " + op_name + " lowered without its random state");
    ctx.rng_state_value = *rng_state;
  }

  if (!lowering::DtypesSupported(*entry, ctx)) throw GraphUnsupported(op_name + ": no complex/float8 lowering");
  // The checks CPU makes on the values, as the eager executors compute them
  // (ProgramBuilder::AddCall: index ranges from the arguments before the
  // lowering, then what the lowering declared), raised at the next sync
  // point.
  const std::string where = " (found at the next sync point after compiled graph " + name_ + ")";
  try {
    IndexRangeChecks(b, op_name, ctx, *entry, where, checks);
  } catch (const hlo::BuildError& e) {
    throw GraphUnsupported("index checks of " + op_name + " failed: " + e.what());
  }
  std::vector<hlo::Value> results;
  try {
    results = entry->fn(ctx);
  } catch (const lowering::LoweringError& e) {
    throw GraphUnsupported(e.what());
  } catch (const hlo::BuildError& e) {
    throw GraphUnsupported("lowering of " + op_name + " failed: " + e.what());
  }
  if (!ctx.writes.empty()) throw GraphUnsupported(op_name + " writes to its arguments (not functional)");
  LoweringChecks(op_name, ctx, where, checks);
  if (results.size() != outputs.size())
    throw GraphUnsupported("lowering of " + op_name + " returned " + std::to_string(results.size()) +
                           " values for " + std::to_string(outputs.size()) + " outputs");

  std::vector<int> ids;
  for (size_t r = 0; r < outputs.size(); ++r) {
    const auto& spec = outputs[r];
    if (spec.dtype == at::ScalarType::Undefined) {
      ids.push_back(-1);
      continue;
    }
    hlo::Value v;
    try {
      v = lowering::Cast(b, results[r], spec.dtype);
      if (v.dims() != spec.sizes) {
        v = Numel(spec.sizes) == v.type.numel() ? b.Reshape(v, spec.sizes) : lowering::BroadcastTo(b, v, spec.sizes);
      }
    } catch (const std::exception& e) {
      throw GraphUnsupported(op_name + ": result " + std::to_string(r) + " of type " + results[r].type.ToString() +
                             " does not fit the output " + c10::str(spec.sizes) + ": " + e.what());
    }
    ValueInfo info;
    info.value = std::move(v);
    info.dtype = spec.dtype;
    values.push_back(std::move(info));
    ids.push_back(static_cast<int>(values.size() - 1));
  }
  return ids;
}

std::vector<hlo::Value> GraphProgram::EmitInto(hlo::Builder& b, std::span<const hlo::Value> inputs,
                                               std::span<const hlo::Value> rng,
                                               std::vector<hlo::Value>* checks) const {
  if (!outputs_set_) throw std::logic_error("GraphProgram: EmitInto before SetOutputs");
  if (inputs.size() != inputs_.size() || rng.size() != rng_increments_.size())
    throw std::invalid_argument("tpu graph " + name_ + ": EmitInto with " + std::to_string(inputs.size()) +
                                " inputs and " + std::to_string(rng.size()) + " random states for " +
                                std::to_string(inputs_.size()) + " and " + std::to_string(rng_increments_.size()));
  // Each call is lowered under the default dtype it was added with.
  struct RestoreDefault {
    caffe2::TypeMeta dtype;
    ~RestoreDefault() { c10::set_default_dtype(dtype); }
  } restore{c10::get_default_dtype()};
  std::vector<ValueInfo> values;
  values.reserve(values_.size());
  std::vector<Check> raw_checks;
  size_t next_rng = 0;
  for (int step : steps_) {
    if (step < 0) {
      const int input = -1 - step;
      const InputInfo& info = inputs_[static_cast<size_t>(input)];
      const hlo::Value& v = inputs[static_cast<size_t>(input)];
      if (v.element() != info.element || v.dims() != info.sizes)
        throw std::invalid_argument("tpu graph " + name_ + ": EmitInto input " + std::to_string(input) + " is " +
                                    v.type.ToString() + ", the graph expects " + c10::toString(info.dtype) +
                                    c10::str(info.sizes));
      ValueInfo vi;
      vi.value = v;
      vi.dtype = info.dtype;
      vi.input = input;
      values.push_back(std::move(vi));
      continue;
    }
    const CallRecord& call = calls_[static_cast<size_t>(step)];
    c10::set_default_dtype(call.default_dtype);
    std::optional<hlo::Value> rng_state;
    if (call.entry->traits.needs_rng) rng_state = rng[next_rng++];
    LowerCall(b, values, call, rng_state, raw_checks);
  }
  if (values.size() != values_.size())
    throw std::logic_error("tpu graph " + name_ + ": EmitInto made " + std::to_string(values.size()) +
                           " values, the graph has " + std::to_string(values_.size()));
  std::vector<hlo::Value> results;
  results.reserve(computed_ids_.size());
  for (int id : computed_ids_) results.push_back(values[static_cast<size_t>(id)].value);
  if (checks) {
    std::vector<std::string> messages;
    *checks = CombineChecks(b, raw_checks, &messages);
    if (messages != check_messages_)
      throw std::logic_error("tpu graph " + name_ + ": EmitInto computed other checks than the graph");
  }
  return results;
}

std::vector<hlo::Value> GraphProgram::CombineChecks(hlo::Builder& b, const std::vector<Check>& checks,
                                                    std::vector<std::string>* messages) {
  std::vector<hlo::Value> preds;
  std::vector<std::string> seen;
  for (const auto& [bad, message] : checks) {
    auto it = std::find(seen.begin(), seen.end(), message);
    if (it == seen.end()) {
      seen.push_back(message);
      preds.push_back(bad);
    } else {
      hlo::Value& pred = preds[static_cast<size_t>(it - seen.begin())];
      pred = b.Or(pred, bad);
    }
  }
  if (messages) *messages = std::move(seen);
  return preds;
}

void GraphProgram::SetOutputs(const std::vector<int>& ids) {
  if (outputs_set_) throw std::logic_error("GraphProgram: SetOutputs called twice");
  std::vector<hlo::Value> program_results;
  std::vector<int> computed_ids;  // value id per program output
  for (int id : ids) {
    const ValueInfo& v = ValueAt(values_, id, "graph output");
    ResultSlot slot;
    if (v.input >= 0) {
      slot.kind = ResultSlot::Kind::kInput;
      slot.index = v.input;
    } else {
      auto it = std::find(computed_ids.begin(), computed_ids.end(), id);
      slot.kind = ResultSlot::Kind::kComputed;
      if (it != computed_ids.end()) {
        slot.index = static_cast<int>(it - computed_ids.begin());
      } else {
        slot.index = static_cast<int>(computed_ids.size());
        computed_ids.push_back(id);
        int64_t flat[] = {v.value.type.numel()};
        program_results.push_back(lowering::ResizeFlat(builder_, builder_.Reshape(v.value, flat), Capacity(flat[0])));
        output_specs_.push_back({v.dtype, v.value.dims()});
      }
    }
    results_.push_back(slot);
  }
  output_ids_ = ids;
  computed_ids_ = computed_ids;
  // The checks' preds follow the results (none: the program is unchanged).
  for (hlo::Value& pred : CombineChecks(builder_, checks_, &check_messages_)) program_results.push_back(pred);
  checks_.clear();
  builder_.Return(program_results);
  outputs_set_ = true;
}

void GraphProgram::DonateInput(int input, int output) {
  if (executable_ || !module_text_.empty()) throw std::logic_error("GraphProgram: DonateInput after Compile");
  if (!outputs_set_) throw std::logic_error("GraphProgram: DonateInput before SetOutputs");
  if (input < 0 || input >= static_cast<int>(inputs_.size()) || output < 0 ||
      output >= static_cast<int>(results_.size()))
    throw std::invalid_argument("tpu graph " + name_ + ": DonateInput(" + std::to_string(input) + ", " +
                                std::to_string(output) + ") out of range");
  const ResultSlot& slot = results_[static_cast<size_t>(output)];
  if (slot.kind != ResultSlot::Kind::kComputed)
    throw std::invalid_argument("tpu graph " + name_ + ": output " + std::to_string(output) +
                                " is a graph input, not a computed value");
  const auto& spec = output_specs_[static_cast<size_t>(slot.index)];
  const InputInfo& in = inputs_[static_cast<size_t>(input)];
  if (spec.dtype != in.dtype || spec.sizes != in.sizes)
    throw std::invalid_argument("tpu graph " + name_ + ": output " + std::to_string(output) + " is " +
                                c10::toString(spec.dtype) + c10::str(spec.sizes) + ", input " +
                                std::to_string(input) + " " + c10::toString(in.dtype) + c10::str(in.sizes));
  // A value that is also another output (a training forward graph saving a
  // running statistic's new value for the backward) must be a tensor of
  // its own there: the input tensor would carry the mutation's version
  // bump into the saved value (autograd then rejects it), and later
  // in-place writes too.
  for (size_t k = 0; k < results_.size(); ++k)
    if (static_cast<int>(k) != output && results_[k].kind == ResultSlot::Kind::kComputed &&
        results_[k].index == slot.index)
      throw std::invalid_argument("tpu graph " + name_ + ": output " + std::to_string(output) +
                                  " is also output " + std::to_string(k) + ": not donated");
  for (const auto& d : donations_)
    if (d.first == input || d.second == slot.index)
      throw std::invalid_argument("tpu graph " + name_ + ": input " + std::to_string(input) + " or output " +
                                  std::to_string(output) + " donated twice");
  size_t param = 0;
  while (param < params_.size() && (params_[param].rng || params_[param].index != input)) ++param;
  builder_.AliasParameter(param, static_cast<size_t>(slot.index));
  donations_.push_back({input, slot.index});
}

void GraphProgram::Compile() {
  if (executable_) return;
  if (!outputs_set_) throw std::logic_error("GraphProgram: Compile before SetOutputs");
  if (module_text_.empty()) {
    module_text_ = builder_.Module();
    builder_ = hlo::Builder();  // the text is all that is needed from here on
  }
  if (DumpHlo()) std::cerr << "[torch_tpu] compiled graph " << name_ << ":\n" << module_text_;
  auto& rt = Runtime::Get();
  pjrt::CompileOptions options = rt.compile_options();
  options.portable = true;  // one executable serves every device of the client
  auto start = std::chrono::steady_clock::now();
  try {
    executable_ = DiskCache::Get().LoadOrCompile(rt.client(), module_text_, options);
  } catch (const pjrt::Error& e) {
    throw std::runtime_error("tpu: compiling graph " + name_ + " failed: " + e.what() + "\nmodule:\n" +
                             module_text_);
  }
  rt.metrics().compiles++;
  rt.metrics().compile_time_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

int GraphProgram::CheckInputs(const std::vector<at::Tensor>& inputs) const {
  if (inputs.size() != inputs_.size())
    throw std::invalid_argument("tpu graph " + name_ + ": expected " + std::to_string(inputs_.size()) +
                                " inputs, got " + std::to_string(inputs.size()));
  int device_index = -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const InputInfo& info = inputs_[i];
    if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1)
      throw std::invalid_argument("tpu graph " + name_ + ": input " + std::to_string(i) + " is not a tpu tensor");
    if (t.scalar_type() != info.dtype || t.sizes() != at::IntArrayRef(info.sizes))
      throw std::invalid_argument("tpu graph " + name_ + ": input " + std::to_string(i) + " is " +
                                  c10::toString(t.scalar_type()) + c10::str(t.sizes()) + ", the graph expects " +
                                  c10::toString(info.dtype) + c10::str(info.sizes));
    if (device_index < 0) device_index = t.device().index();
    if (t.device().index() != device_index)
      throw std::invalid_argument("tpu graph " + name_ + ": input " + std::to_string(i) + " is on " +
                                  t.device().str() + ", input 0 on tpu:" + std::to_string(device_index) +
                                  " (a graph runs on one device)");
  }
  if (device_index < 0)
    device_index = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  return device_index;
}

bool GraphProgram::FeedsAsIs(int input, const at::Tensor& t) const {
  const InputInfo& info = inputs_.at(static_cast<size_t>(input));
  const DeviceStorage& s = StorageOf(t);
  // A conjugate/negative view holds other values than its storage's: the
  // clone materializes them. The buffer's capacity is not a condition: a
  // storage's values are its buffer's first elements whatever the capacity
  // (a bucket program's canonical buffer holds padding after them), and the
  // launch resizes a buffer of another capacity to the declared one (Launch
  // here, GatherInputs in a fused region). Required here, it failed
  // whenever the buffer was swapped between the check and the launch (a
  // fused region's calls run op by op after the graph call was recorded:
  // "graph ... input 3 changed layout before the region ran").
  return t.is_contiguous() && t.storage_offset() == 0 &&
         static_cast<int64_t>(s.nbytes()) == info.numel * static_cast<int64_t>(ElementSize(info.element)) &&
         (!s.initialized() || s.current().element == info.element) && !t.is_conj() && !t.is_neg();
}

namespace {
// TORCH_TPU_FUSED_GRAPHS=0: in fused eager mode a compiled graph is a sync
// point of the region and launches by itself (as before graph calls joined
// regions).
bool FusedGraphsEnabled() {
  static const bool on = EnvFlag("TORCH_TPU_FUSED_GRAPHS", true);
  return on;
}
}  // namespace

std::vector<at::Tensor> GraphProgram::Run(const std::vector<at::Tensor>& inputs) {
  if (!executable_) Compile();  // also the op-by-op fallback of a region holding the graph
  std::vector<at::Tensor> computed;
  std::shared_ptr<GraphProgram> self = weak_from_this().lock();
  const EagerMode mode = CurrentMode();
  if (self && mode == EagerMode::kFused && FusedGraphsEnabled()) {
    computed = RecordGraphCall(self, inputs);
  } else if (mode == EagerMode::kStrict) {
    // The window between graph calls (executor.h, BeginGraphCall): when the
    // previous graph's window is armed, the calls recorded since then (the
    // loss and its backward's first calls before a backward graph) and this
    // graph run now as one region, the graph as its last call; else the
    // graph launches by itself, as always. Either way it runs here, at its
    // call.
    try {
      if (BeginGraphCall() && self && FusedRegionSize() > 0) {
        computed = RecordGraphCall(self, inputs);
        FlushFusedRegion();
      } else {
        CheckInputs(inputs);
        computed = Launch(inputs);
      }
    } catch (...) {
      CloseGraphWindow();
      throw;
    }
    EndGraphCall(uid_);
  } else {
    CheckInputs(inputs);
    computed = Launch(inputs);
  }
  std::vector<at::Tensor> results;
  results.reserve(results_.size());
  for (const auto& r : results_)
    results.push_back(r.kind == ResultSlot::Kind::kInput ? inputs[static_cast<size_t>(r.index)]
                                                         : computed[static_cast<size_t>(r.index)]);
  return results;
}

std::vector<at::Tensor> GraphProgram::Launch(const std::vector<at::Tensor>& inputs) {
  if (!executable_) Compile();
  auto& rt = Runtime::Get();
  const int device_index = CheckInputs(inputs);
  // The graph runs after every call recorded before it: a fused region (or
  // strict mode's calls deferred between graphs) may still hold writes to
  // these inputs (an optimizer step updating the parameters in place) or
  // the values of pending ones. Flushed first, so that the buffers read
  // below are the ones the storages will have at the launch (a buffer of
  // another size than the program declares is resized there: PJRT
  // rejected one with "expected parameter 7 of size 104 but got buffer
  // with incompatible size 320"), and again after the clones (fused mode
  // records them), so no flush happens in the middle of the loop below: it
  // could replace (and donate) a buffer already collected (torch.compile
  // with fused eager mode read stale parameters and, after a donation,
  // freed memory).
  FlushPendingWork();
  // Contiguous whole-storage versions of the inputs (kept alive until the
  // launch has been enqueued; PJRT holds the buffers afterwards).
  std::vector<at::Tensor> dense(inputs.size());
  bool cloned = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool as_is = FeedsAsIs(static_cast<int>(i), inputs[i]);
    dense[i] = as_is ? inputs[i] : at::clone(inputs[i], at::MemoryFormat::Contiguous);
    cloned |= !as_is;
  }
  if (cloned) FlushPendingWork();
  std::vector<pjrt::Buffer*> args(params_.size());
  std::vector<std::shared_ptr<pjrt::Buffer>> temps;
  std::vector<bool> resized(inputs.size(), false);  // per input: fed a resized copy of its buffer
  CheckList inherited;  // the inputs' unresolved value checks: the outputs are poisoned by them too
  for (size_t p = 0; p < params_.size(); ++p) {
    const ParamSlot& slot = params_[p];
    if (!slot.rng) {
      const InputInfo& info = inputs_[static_cast<size_t>(slot.index)];
      const StorageBuffer& sb = StorageOf(dense[static_cast<size_t>(slot.index)]).Materialize(info.element);
      if (!sb.checks.empty()) InheritChecks(inherited, sb.checks);
      args[p] = sb.buffer.get();
      if (sb.numel != Capacity(info.numel)) {
        // A buffer of another capacity (FeedsAsIs does not look at it): a
        // storage written, or a clone served, by a shape-polymorphic bucket
        // program keeps the bucket's rows as its buffer (a [5, 5] clone in
        // a buffer of 16 x 5), which PJRT rejects for this parameter
        // ("expected parameter 7 of size 104 but got buffer with
        // incompatible size 320"): its first elements, resized. This
        // launch's copy; never donated.
        temps.push_back(ResizeStorageBuffer(sb, Capacity(info.numel), device_index).buffer);
        args[p] = temps.back().get();
        resized[static_cast<size_t>(slot.index)] = true;
      }
      continue;
    }
    at::Generator gen = at::globalContext().defaultGenerator(
        c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_index)));
    const std::array<uint64_t, 2> state =
        DrawRngState(gen, static_cast<uint64_t>(rng_increments_[static_cast<size_t>(slot.index)]));
    int64_t dims[] = {2};
    temps.push_back(rt.Upload(state.data(), hlo::ElementType::kU64, dims, device_index));
    args[p] = temps.back().get();
  }

  // Donated inputs: whole storages fed once whose buffer has no other
  // holder (a shared buffer, or a storage fed twice, is never consumed).
  std::vector<int64_t> donated;
  std::vector<std::pair<int, int>> applied;  // (input, program output) written in place
  for (const auto& [input, result] : donations_) {
    const at::Tensor& t = inputs[static_cast<size_t>(input)];
    if (!dense[static_cast<size_t>(input)].is_same(t) || resized[static_cast<size_t>(input)]) continue;
    const DeviceStorage* storage = &StorageOf(t);
    bool fed_once = true;
    for (size_t j = 0; j < dense.size(); ++j)
      if (static_cast<int>(j) != input && &StorageOf(dense[j]) == storage) fed_once = false;
    if (!fed_once || storage->pending() || storage->current().buffer.use_count() != 1) continue;
    size_t param = 0;
    while (param < params_.size() && (params_[param].rng || params_[param].index != input)) ++param;
    donated.push_back(static_cast<int64_t>(param));
    applied.push_back({input, result});
  }

  const std::string producer = "compiled graph " + name_;
  std::unique_ptr<pjrt::Event> done;
  std::vector<std::unique_ptr<pjrt::Buffer>> outs;
  {
    // torch.profiler event "tpu::execute compiled graph <name>" (waits
    // while profiling), as the eager executors' launches.
    ProfileScope profile("tpu::execute", producer);
    try {
      outs = executable_->Execute(args, rt.device(device_index), donated, &done);
    } catch (const pjrt::Error& e) {
      RethrowDeviceError(e, producer, device_index);
    }
    profile.AwaitIfActive(done.get());
  }
  rt.metrics().executions++;
  if (!donated.empty()) rt.metrics().donated_buffers += static_cast<int64_t>(donated.size());

  if (outs.size() != output_specs_.size() + check_messages_.size())
    throw std::logic_error("tpu graph " + name_ + ": " + std::to_string(outs.size()) + " outputs for " +
                           std::to_string(output_specs_.size()) + " results and " +
                           std::to_string(check_messages_.size()) + " checks");
  std::vector<std::unique_ptr<pjrt::Buffer>> flags;
  for (size_t i = output_specs_.size(); i < outs.size(); ++i) flags.push_back(std::move(outs[i]));
  outs.resize(output_specs_.size());
  const CheckList own = flags.empty() ? CheckList{} : RegisterChecks(std::move(flags));
  std::vector<at::Tensor> computed;
  computed.reserve(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& spec = output_specs_[i];
    hlo::ElementType element = lowering::ToElementType(spec.dtype);
    StorageBuffer sb{std::shared_ptr<pjrt::Buffer>(std::move(outs[i])), element, Capacity(Numel(spec.sizes)),
                     producer};
    PoisonWith(sb, inherited, own);
    computed.push_back(WrapBuffer(std::move(sb), spec.sizes, spec.dtype, device_index));
  }
  if (done) rt.Track(std::move(done), producer);
  for (const auto& [input, result] : applied) {
    StorageOf(inputs[static_cast<size_t>(input)]).Set(StorageOf(computed[static_cast<size_t>(result)]).current());
    computed[static_cast<size_t>(result)] = inputs[static_cast<size_t>(input)];
  }
  return computed;
}

CheckList GraphProgram::RegisterChecks(std::vector<std::unique_ptr<pjrt::Buffer>> flags) const {
  // Each flag raises its message at the next sync point (Runtime::Sync), as
  // an eager program's checks (compiled_op.cpp, OutputSlot::kIndexCheck).
  auto& rt = Runtime::Get();
  CheckList states;
  states.reserve(flags.size());
  for (size_t i = 0; i < flags.size(); ++i)
    states.push_back(rt.AddPendingCheck(std::shared_ptr<pjrt::Buffer>(std::move(flags[i])), check_messages_[i]));
  return states;
}

}  // namespace torch_tpu::runtime
