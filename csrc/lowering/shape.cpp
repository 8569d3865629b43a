// Copying forms of shape operations (expand_copy, permute_copy, view_copy,
// ...). Eager views are metadata-only (kernels.cpp) and never reach a
// lowering; these serve the *_copy ops that functionalized graphs contain.
#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {


// expand_copy(self, size): broadcast to the meta's sizes.
std::vector<Value> LowerExpandCopy(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.tensor("self"), out.dtype, out.sizes)};
}

// view_copy / _reshape_copy / reshape-like: same elements, new sizes.
std::vector<Value> LowerViewCopy(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = Cast(ctx.b, ctx.tensor("self"), out.dtype);
  return {ctx.b.Reshape(x, out.sizes)};
}

std::vector<Value> LowerPermuteCopy(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  std::vector<int64_t> perm;
  for (int64_t d : ctx.ints("dims")) perm.push_back(NormalizeDim(d, x.rank()));
  return {Cast(ctx.b, ctx.b.Transpose(x, perm), out.dtype)};
}

std::vector<Value> LowerTransposeCopy(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (x.rank() < 2) return {Cast(ctx.b, x, out.dtype)};
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < x.rank(); ++i) perm.push_back(i);
  int64_t d0 = ctx.find("dim0") ? NormalizeDim(ctx.int_arg("dim0"), x.rank()) : 0;
  int64_t d1 = ctx.find("dim1") ? NormalizeDim(ctx.int_arg("dim1"), x.rank()) : 1;
  std::swap(perm[static_cast<size_t>(d0)], perm[static_cast<size_t>(d1)]);
  return {Cast(ctx.b, ctx.b.Transpose(x, perm), out.dtype)};
}

// slice_copy(self, dim, start, end, step)
std::vector<Value> LowerSliceCopy(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  int64_t start = ctx.has("start") ? ctx.int_arg("start") : 0;
  int64_t end = ctx.has("end") ? ctx.int_arg("end") : n;
  int64_t step = ctx.int_arg("step");
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
  st[static_cast<size_t>(dim)] = start;
  li[static_cast<size_t>(dim)] = end;
  sr[static_cast<size_t>(dim)] = step;
  Value s = ctx.b.Slice(x, st, li, sr);
  return {Cast(ctx.b, s, out.dtype)};
}

// select_copy(self, dim, index)
std::vector<Value> LowerSelectCopy(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  int64_t index = ctx.int_arg("index");
  if (index < -n || index >= n) throw LoweringError(ctx.op_name() + ": index out of range");
  if (index < 0) index += n;
  const size_t r = static_cast<size_t>(x.rank());
  std::vector<int64_t> st(r, 0), li = x.dims(), sr(r, 1);
  st[static_cast<size_t>(dim)] = index;
  li[static_cast<size_t>(dim)] = index + 1;
  Value s = ctx.b.Slice(x, st, li, sr);
  return {ctx.b.Reshape(Cast(ctx.b, s, out.dtype), out.sizes)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"expand_copy", LowerExpandCopy},
    {"view_copy", LowerViewCopy},
    {"_reshape_copy", LowerViewCopy},
    {"unsqueeze_copy", LowerViewCopy},
    {"squeeze_copy", LowerViewCopy},
    {"alias_copy", LowerViewCopy},
    {"permute_copy", LowerPermuteCopy},
    {"transpose_copy", LowerTransposeCopy},
    {"t_copy", LowerTransposeCopy},
    {"slice_copy", LowerSliceCopy},
    {"select_copy", LowerSelectCopy},
});

}  // namespace torch_tpu::lowering
