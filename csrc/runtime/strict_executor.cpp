// The strict executor (default): each ATen call is compiled once per
// signature (OpCache) and launched asynchronously, in program order. It does
// not wait: an execution error surfaces at the next sync point (.item(),
// .cpu(), torch.tpu.synchronize()), naming the op (Runtime::Sync).
#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::runtime {

void RunStrict(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
  std::shared_ptr<const CompiledOp> compiled = GlobalOpCache().Lookup(op, *stack, entry, /*shape_poly=*/true);
  Launch(*compiled, *stack, op.schema().arguments().size());
}

}  // namespace torch_tpu::runtime
