// The strict executor (default): each ATen call is compiled once per
// signature (OpCache) and launched asynchronously, in program order. It does
// not wait: an execution error surfaces at the next sync point (.item(),
// .cpu(), torch.tpu.synchronize()), naming the op (Runtime::Sync).
//
// Host-first calls (DESIGN.md "Host-first calls"): a call whose program is
// not compiled yet (in memory or on disk) and that qualifies (OpCache::Lookup)
// is served on the host by the ATen CPU kernel; its program compiles on the
// background compile thread from the key's TORCH_TPU_HOST_FIRST_COMPILE_AFTER-th
// call (default 2), and strict calls stay host-served until it is ready.
#include "runtime/compiled_op.h"
#include "runtime/executor.h"

namespace torch_tpu::runtime {

void RunStrict(const c10::OperatorHandle& op, torch::jit::Stack* stack, const lowering::LoweringEntry& entry) {
  bool host_served = false;
  std::shared_ptr<const CompiledOp> compiled =
      GlobalOpCache().Lookup(op, *stack, entry, /*shape_poly=*/true, &host_served);
  if (host_served) {
    if (ServeOnHost(*compiled, op, *stack, op.schema().arguments().size())) return;
    // CPU's kernel gave other results than the program: the program, compiled now.
    compiled = GlobalOpCache().Lookup(op, *stack, entry, /*shape_poly=*/true);
  }
  Launch(*compiled, *stack, op.schema().arguments().size());
}

}  // namespace torch_tpu::runtime
