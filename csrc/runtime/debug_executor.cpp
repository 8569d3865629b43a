// The debug executor: synchronous, one op at a time, with checks that name
// the op and the user's source line.
//  1. Before running an indexing op, every index is checked against the
//     indexed size (the entry's IndexCheck traits) and an IndexError-style
//     c10::IndexError is raised, as PyTorch on CPU does.
//  2. After running, the op is waited for, and every floating output (new
//     tensors and written arguments) is checked for NaN/Inf that the op
//     produced: a NaN (Inf) is an error unless an input already held one
//     (masking with -inf, copying data that holds NaN are not errors).
#include <ATen/ATen.h>

#include <cmath>

#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::runtime {
namespace {

const c10::IValue* ArgByName(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first,
                             std::string_view name) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].name() == name) return &stack[first + i];
  return nullptr;
}

std::string Where() {
  std::string frame = UserFrame();
  return frame.empty() ? std::string() : " (called from " + frame + ")";
}

void CheckIndex(const std::string& op_name, const at::Tensor& index, int64_t size, int64_t dim,
                bool allow_negative, bool runtime_error = false) {
  if (!index.defined() || index.numel() == 0) return;
  if (index.scalar_type() == at::kBool || index.scalar_type() == at::kByte) return;  // masks
  at::Tensor host = index.to(at::kCPU).to(at::kLong);
  int64_t lo = host.min().item<int64_t>(), hi = host.max().item<int64_t>();
  const int64_t low_bound = allow_negative ? -size : 0;
  int64_t bad = lo < low_bound ? lo : (hi >= size ? hi : 0);
  if (!(lo < low_bound || hi >= size)) return;
  if (runtime_error)  // CPU raises RuntimeError for these ops (gather, scatter)
    TORCH_CHECK(false, op_name, ": index ", bad, " is out of bounds for dimension ", dim, " with size ", size,
                Where());
  TORCH_CHECK_INDEX(false, op_name, ": index ", bad, " is out of bounds for dimension ", dim, " with size ", size,
                    Where());
}

void RunIndexChecks(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                    const lowering::LoweringEntry& entry, const std::string& op_name) {
  const auto& schema = op.schema();
  const size_t first = stack.size() - schema.arguments().size();
  for (const auto& check : entry.traits.index_checks) {
    const c10::IValue* index = ArgByName(schema, stack, first, check.index);
    const c10::IValue* source = ArgByName(schema, stack, first, check.source);
    if (!index || !source || !source->isTensor()) continue;
    const at::Tensor& src = source->toTensor();
    int64_t dim = 0;
    if (!check.dim_arg.empty()) {
      const c10::IValue* d = ArgByName(schema, stack, first, check.dim_arg);
      if (d && d->isInt()) dim = c10::maybe_wrap_dim(d->toInt(), std::max<int64_t>(src.dim(), 1));
    }
    if (index->isTensor()) {
      CheckIndex(op_name, index->toTensor(), src.dim() == 0 ? 1 : src.size(dim), dim, check.allow_negative,
                 check.runtime_error);
    } else if (index->isList()) {
      const auto& list = index->toListRef();
      for (size_t j = 0; j < list.size(); ++j)
        if (list[j].isTensor() && static_cast<int64_t>(j) < src.dim())
          CheckIndex(op_name, list[j].toTensor(), src.size(static_cast<int64_t>(j)), static_cast<int64_t>(j),
                     check.allow_negative);
    }
  }
}

// NaN / Inf present in a tensor's values.
struct NonFinite {
  bool nan = false, inf = false;
};

NonFinite Scan(const at::Tensor& host) {
  if (!at::isFloatingType(host.scalar_type()) || host.numel() == 0) return {};
  // CPU's isinf has no float8 kernels (NotImplementedError): scan their
  // exact float values.
  const at::Tensor h = c10::isFloat8Type(host.scalar_type()) ? host.to(at::kFloat) : host;
  return {at::isnan(h).any().item<bool>(), at::isinf(h).any().item<bool>()};
}

// A floating input as it was before the op ran: storage buffers are
// immutable, so keeping the buffer keeps the old values (in-place ops swap
// in a new one).
struct InputSnapshot {
  StorageBuffer buffer;
  at::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
};

NonFinite ScanSnapshot(const InputSnapshot& in) {
  hlo::ElementType e = lowering::ToElementType(in.dtype);
  if (in.buffer.element != e) return {};  // a dtype view of another storage type: not checked
  at::Tensor flat = at::empty({in.buffer.numel}, at::TensorOptions().dtype(in.dtype));
  Runtime::Get().Download(in.buffer, flat.data_ptr(), flat.nbytes());
  return Scan(flat.as_strided(in.sizes, in.strides, in.offset));
}

std::vector<InputSnapshot> SnapshotInputs(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                          NonFinite& scalars) {
  std::vector<InputSnapshot> out;
  const size_t first = stack.size() - op.schema().arguments().size();
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) return;
    if (t.device().type() != c10::DeviceType::PrivateUse1) {
      NonFinite n = Scan(t);
      scalars.nan |= n.nan;
      scalars.inf |= n.inf;
      return;
    }
    auto& s = StorageOf(t);
    if (!s.initialized()) return;
    out.push_back({s.Materialize(s.current().element), t.scalar_type(), t.sizes().vec(), t.strides().vec(),
                   t.storage_offset()});
  };
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isList()) {
      for (const auto& item : v.toListRef())
        if (item.isTensor()) add(item.toTensor());
    } else if (v.isDouble()) {
      double d = v.toDouble();
      scalars.nan |= std::isnan(d);
      scalars.inf |= std::isinf(d);
    }
  }
  return out;
}

// Raises if `t` holds NaN or Inf that the op produced from finite inputs:
// a NaN counts only when the inputs held neither NaN nor Inf (IEEE gives
// NaN for inf - inf, 0 * inf, softmax over a row of -inf, as CPU does), an
// Inf only when the inputs held no Inf.
void CheckFinite(const std::string& op_name, const at::Tensor& t, const std::vector<InputSnapshot>& inputs,
                 NonFinite known) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.numel() == 0) return;
  NonFinite out = Scan(t.to(at::kCPU));
  if (!out.nan && !out.inf) return;
  for (const auto& in : inputs) {
    if ((!out.nan || known.nan || known.inf) && (!out.inf || known.inf)) break;
    NonFinite n = ScanSnapshot(in);
    known.nan |= n.nan;
    known.inf |= n.inf;
  }
  bool produced_nan = out.nan && !known.nan && !known.inf, produced_inf = out.inf && !known.inf;
  if (!produced_nan && !produced_inf) return;
  TORCH_CHECK(false, "tpu debug mode: ", op_name, " produced ", produced_nan ? "NaN" : "Inf",
              " from finite inputs in an output of shape ", t.sizes(), Where());
}

}  // namespace

void RunDebug(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
  std::shared_ptr<const CompiledOp> held = GlobalOpCache().Lookup(op, *stack, entry, /*shape_poly=*/true);
  const CompiledOp& compiled = *held;
  RunIndexChecks(op, *stack, entry, compiled.name);
  const size_t num_args = op.schema().arguments().size();
  const size_t first = stack->size() - num_args;
  // Written arguments are the returned aliases; keep them to check after.
  std::vector<at::Tensor> written;
  for (const auto& r : compiled.returns)
    if (r.is_arg) written.push_back((*stack)[first + static_cast<size_t>(r.index)].toTensor());
  NonFinite in_scalars;
  std::vector<InputSnapshot> inputs = SnapshotInputs(op, *stack, in_scalars);
  // A failed value check raises at the op, as on CPU, and leaves the
  // written arguments as they were (CPU raises before writing): their old
  // buffers are kept (storage buffers are immutable; holding one also keeps
  // it from being donated) and put back.
  std::vector<std::pair<at::Tensor, StorageBuffer>> before;
  if (!compiled.check_messages.empty())
    for (const auto& t : written)
      if (StorageOf(t).initialized()) before.emplace_back(t, StorageOf(t).Materialize(StorageOf(t).current().element));
  std::vector<at::Tensor> outputs = Launch(compiled, *stack, num_args);
  try {
    Runtime::Get().Sync();
  } catch (...) {
    for (auto& [t, buffer] : before) StorageOf(t).Set(std::move(buffer));
    throw;
  }
  for (const auto& t : outputs) CheckFinite(compiled.name, t, inputs, in_scalars);
  for (const auto& t : written) CheckFinite(compiled.name, t, inputs, in_scalars);
}

}  // namespace torch_tpu::runtime
