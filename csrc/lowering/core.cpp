// Lowerings of the memory-model primitives every path relies on: copy_
// (host<->device staging, writes into views), clone/contiguous, fill_, zero_.
#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

// copy_(self, src): src converted to self's dtype and broadcast to its sizes;
// the executor writes it into self's storage.
std::vector<Value> LowerCopy(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.tensor("src"), out.dtype, out.sizes)};
}

std::vector<Value> LowerClone(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.tensor("self"), out.dtype, out.sizes)};
}

std::vector<Value> LowerFill(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.value("value"), out.dtype, out.sizes)};
}

std::vector<Value> LowerZero(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Const(ctx.b, ToElementType(out.dtype), 0, out.sizes)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"copy", LowerCopy},
    {"clone", LowerClone},
    {"fill", LowerFill},
    {"zero", LowerZero},
});

}  // namespace torch_tpu::lowering
