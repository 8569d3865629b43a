// The debug executor: synchronous, one op at a time, with checks that name
// the op and the user's source line.
//  1. Before running an indexing op, every index is checked against the
//     indexed size (the entry's IndexCheck traits) and an IndexError-style
//     c10::IndexError is raised, as PyTorch on CPU does.
//  2. After running, the op is waited for, and every floating output (new
//     tensors and written arguments) is checked for NaN/Inf.
#include <ATen/ATen.h>

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
                bool allow_negative) {
  if (!index.defined() || index.numel() == 0) return;
  if (index.scalar_type() == at::kBool || index.scalar_type() == at::kByte) return;  // masks
  at::Tensor host = index.to(at::kCPU).to(at::kLong);
  int64_t lo = host.min().item<int64_t>(), hi = host.max().item<int64_t>();
  const int64_t low_bound = allow_negative ? -size : 0;
  int64_t bad = lo < low_bound ? lo : (hi >= size ? hi : 0);
  if (lo < low_bound || hi >= size)
    TORCH_CHECK_INDEX(false, op_name, ": index ", bad, " is out of bounds for dimension ", dim, " with size ",
                      size, Where());
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
      CheckIndex(op_name, index->toTensor(), src.dim() == 0 ? 1 : src.size(dim), dim, check.allow_negative);
    } else if (index->isList()) {
      const auto& list = index->toListRef();
      for (size_t j = 0; j < list.size(); ++j)
        if (list[j].isTensor() && static_cast<int64_t>(j) < src.dim())
          CheckIndex(op_name, list[j].toTensor(), src.size(static_cast<int64_t>(j)), static_cast<int64_t>(j),
                     check.allow_negative);
    }
  }
}

void CheckFinite(const std::string& op_name, const at::Tensor& t) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.numel() == 0) return;
  at::Tensor host = t.to(at::kCPU);
  if (at::isfinite(host).all().item<bool>()) return;
  bool has_nan = at::isnan(host).any().item<bool>();
  TORCH_CHECK(false, "tpu debug mode: ", op_name, " produced ", has_nan ? "NaN" : "Inf",
              " in an output of shape ", t.sizes(), Where());
}

}  // namespace

void RunDebug(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
  const CompiledOp& compiled = GlobalOpCache().Lookup(op, *stack, entry);
  RunIndexChecks(op, *stack, entry, compiled.name);
  const size_t num_args = op.schema().arguments().size();
  const size_t first = stack->size() - num_args;
  // Written arguments are the returned aliases; keep them to check after.
  std::vector<at::Tensor> written;
  for (const auto& r : compiled.returns)
    if (r.is_arg) written.push_back((*stack)[first + static_cast<size_t>(r.index)].toTensor());
  std::vector<at::Tensor> outputs = Launch(compiled, *stack, num_args);
  Runtime::Get().Sync();
  for (const auto& t : outputs) CheckFinite(compiled.name, t);
  for (const auto& t : written) CheckFinite(compiled.name, t);
}

}  // namespace torch_tpu::runtime
