// Core ATen ops no other family file covers: group norm (+backward),
// reflection / replication padding 1d-3d (+backward), im2col / col2im,
// select_scatter / slice_scatter / diagonal_scatter, _pdist_forward /
// _cdist_forward (+backward), grid_sampler_2d (bilinear / nearest / bicubic;
// +backward), asin/acos/atan/atan2, sinh/cosh, asinh/acosh/atanh,
// _embedding_bag (+backward), embedding_renorm_, scalar_tensor, full_like.
//
// Floating math runs in the op-math type (f32 for bf16/f16) and rounds once
// to the meta kernel's dtype. Static index patterns (padding, patches) are
// computed at lowering time and enter the program as constants; gradients of
// gathers are contractions with 0/1 matrices or padded sums, never scatters.
#include <algorithm>
#include <cmath>
#include <array>
#include <limits>
#include <tuple>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;



// Zeros of an output; a return output_mask leaves undefined (dtype
// Undefined in graph lowering) gets an f32 placeholder the executor drops.
Value Zeros(Builder& b, const OutputSpec& spec) {
  at::ScalarType t = spec.dtype == at::ScalarType::Undefined ? at::kFloat : spec.dtype;
  return Const(b, ToElementType(t), 0, spec.sizes);
}

ElementType AccOf(at::ScalarType t) { return ToElementType(OpMathType(t)); }

// x gathered along `dim` at static positions.
Value GatherStatic(Builder& b, const Value& x, int64_t dim, const std::vector<int64_t>& idx) {
  Value iv = b.ConstantI64Vector(idx);
  int64_t m = static_cast<int64_t>(idx.size());
  int64_t idims[] = {m, 1};
  iv = b.Reshape(iv, idims);
  hlo::GatherDims g;
  std::vector<int64_t> slice = x.dims(), rdims = x.dims();
  slice[static_cast<size_t>(dim)] = 1;
  rdims[static_cast<size_t>(dim)] = m;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (d != dim) g.offset_dims.push_back(d);
  g.collapsed_slice_dims = {dim};
  g.start_index_map = {dim};
  g.index_vector_dim = 1;
  return b.Gather(x, iv, g, slice, TensorType{x.element(), rdims});
}

// Contracts x's dimension `dim` (size X) with m (X, Y) and puts Y at `dim`.
Value ContractDim(Builder& b, const Value& x, int64_t dim, const Value& m) {
  hlo::DotDims dd;
  dd.lhs_contract = {dim};
  dd.rhs_contract = {0};
  Value r = b.DotGeneral(x, m, dd, x.element());
  std::vector<int64_t> perm;
  const int64_t rank = x.rank();
  for (int64_t d = 0; d < rank; ++d) perm.push_back(d == dim ? rank - 1 : d < dim ? d : d - 1);
  return b.Transpose(r, perm);
}

// (rows, cols) matrix in `t`: 1 where col == idx[row].
Value OneHotRows(Builder& b, const std::vector<int64_t>& idx, int64_t cols, ElementType t) {
  int64_t rows = static_cast<int64_t>(idx.size());
  std::vector<int64_t> dims{rows, cols};
  int64_t bd[] = {0};
  Value sel = b.BroadcastInDim(b.ConstantI64Vector(idx), dims, bd);
  Value eq = b.Compare(b.Iota(TensorType{ElementType::kS64, dims}, 1), sel, CompareDirection::kEQ);
  return b.Convert(eq, t);
}

// --- group norm ----------------------------------------------------------------

Value PerChannel(Builder& b, const Value& v, std::span<const int64_t> dims) {
  int64_t bd[] = {1};
  return b.BroadcastInDim(v, dims, bd);
}

std::vector<Value> LowerGroupNorm(LoweringContext& ctx) {
  auto& b = ctx.b;
  Value x = ctx.tensor("input");
  const int64_t n = ctx.int_arg("N"), c = ctx.int_arg("C"), hw = ctx.int_arg("HxW"), g = ctx.int_arg("group");
  const double eps = ctx.float_arg("eps");
  const auto& out = ctx.outputs[0];
  ElementType acc = AccOf(out.dtype);
  if (x.type.numel() == 0 || g == 0) {
    Value nan = Const(b, acc, std::numeric_limits<double>::quiet_NaN(), ctx.outputs[1].sizes);
    return {Zeros(b, out), Out(b, nan, ctx.outputs[1]), Out(b, nan, ctx.outputs[2])};
  }
  Value xf = b.Convert(x, acc);
  int64_t gdims[] = {n, g, (c / g) * hw};
  Value xg = b.Reshape(xf, gdims);
  const double m = static_cast<double>((c / g) * hw);
  int64_t last[] = {2};
  Value mean = b.Div(ReduceSum(b, xg, last, true), Const(b, acc, m, std::vector<int64_t>{n, g, 1}));
  Value xc = b.Sub(xg, BroadcastTo(b, mean, xg.dims()));
  Value var = b.Div(ReduceSum(b, b.Mul(xc, xc), last, true), Const(b, acc, m, std::vector<int64_t>{n, g, 1}));
  Value rstd = b.Rsqrt(b.Add(var, Const(b, acc, eps, var.dims())));
  Value y = b.Reshape(b.Mul(xc, BroadcastTo(b, rstd, xg.dims())), x.dims());
  std::vector<int64_t> xd = x.dims();
  if (ctx.has("weight")) y = b.Mul(y, PerChannel(b, b.Convert(ctx.tensor("weight"), acc), xd));
  if (ctx.has("bias")) y = b.Add(y, PerChannel(b, b.Convert(ctx.tensor("bias"), acc), xd));
  int64_t ng[] = {n, g};
  return {Out(b, y, out), Out(b, b.Reshape(mean, ng), ctx.outputs[1]), Out(b, b.Reshape(rstd, ng), ctx.outputs[2])};
}

std::vector<Value> LowerGroupNormBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  auto mask = ctx.bools("output_mask", 3);
  Value x = ctx.tensor("input");
  const int64_t n = ctx.int_arg("N"), c = ctx.int_arg("C"), hw = ctx.int_arg("HxW"), g = ctx.int_arg("group");
  ElementType acc = AccOf(ctx.arg("input").dtype);
  std::vector<Value> res{Zeros(b, ctx.outputs[0]), Zeros(b, ctx.outputs[1]), Zeros(b, ctx.outputs[2])};
  if (x.type.numel() == 0 || g == 0) return res;
  const int64_t cg = c / g;
  Value xf = b.Convert(x, acc);
  Value dy = b.Convert(ctx.tensor("grad_out"), acc);
  // (N, G, C/G, HxW) views.
  std::vector<int64_t> d4{n, g, cg, hw};
  Value x4 = b.Reshape(xf, d4), dy4 = b.Reshape(dy, d4);
  int64_t bd[] = {0, 1};
  Value mean = b.BroadcastInDim(b.Reshape(b.Convert(ctx.tensor("mean"), acc), std::vector<int64_t>{n, g}), d4, bd);
  Value rstd = b.BroadcastInDim(b.Reshape(b.Convert(ctx.tensor("rstd"), acc), std::vector<int64_t>{n, g}), d4, bd);
  Value xhat = b.Mul(b.Sub(x4, mean), rstd);
  // Per-channel sums over N and HxW (channel c = group * C/G + c').
  int64_t red_nh[] = {0, 3};
  if (mask[1]) {
    Value dgamma = ReduceSum(b, b.Mul(dy4, xhat), red_nh, false);  // (G, C/G)
    res[1] = Out(b, dgamma, ctx.outputs[1]);
  }
  if (mask[2]) res[2] = Out(b, ReduceSum(b, dy4, red_nh, false), ctx.outputs[2]);
  if (mask[0]) {
    Value gdy = dy4;
    if (ctx.has("weight")) {
      Value w = b.Reshape(b.Convert(ctx.tensor("weight"), acc), std::vector<int64_t>{g, cg});
      int64_t wd[] = {1, 2};
      gdy = b.Mul(gdy, b.BroadcastInDim(w, d4, wd));
    }
    const double m = static_cast<double>(cg * hw);
    int64_t red[] = {2, 3};
    Value mg = b.Div(ReduceSum(b, gdy, red, false), Const(b, acc, m, std::vector<int64_t>{n, g}));
    Value mgx = b.Div(ReduceSum(b, b.Mul(gdy, xhat), red, false), Const(b, acc, m, std::vector<int64_t>{n, g}));
    Value dx = b.Sub(b.Sub(gdy, b.BroadcastInDim(mg, d4, bd)), b.Mul(xhat, b.BroadcastInDim(mgx, d4, bd)));
    dx = b.Mul(dx, rstd);
    res[0] = Out(b, b.Reshape(dx, x.dims()), ctx.outputs[0]);
  }
  return res;
}

// --- reflection / replication padding -------------------------------------------

// Source index of every output position of one padded dim.
std::vector<int64_t> PadIndices(int64_t n, int64_t lo, int64_t hi, bool reflect) {
  std::vector<int64_t> idx;
  for (int64_t o = 0; o < n + lo + hi; ++o) {
    int64_t i = o - lo;
    if (reflect) {
      if (i < 0) i = -i;
      if (i >= n) i = 2 * (n - 1) - i;
    } else {
      i = std::clamp<int64_t>(i, 0, n - 1);
    }
    idx.push_back(i);
  }
  return idx;
}

// padding = [last_lo, last_hi, prev_lo, prev_hi, ...] as PyTorch orders it.
std::vector<Value> PadForward(LoweringContext& ctx, bool reflect) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  auto pad = ctx.ints("padding");
  if (Numel(out.sizes) == 0 || x.type.numel() == 0) return {Zeros(b, out)};
  const size_t k = pad.size() / 2;
  for (size_t j = 0; j < k; ++j) {
    int64_t d = x.rank() - 1 - static_cast<int64_t>(j);
    x = GatherStatic(b, x, d, PadIndices(x.dims()[static_cast<size_t>(d)], pad[2 * j], pad[2 * j + 1], reflect));
  }
  return {Out(b, x, out)};
}

std::vector<Value> PadBackward(LoweringContext& ctx, bool reflect) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = ctx.tensor("self");
  Value gy = ctx.tensor("grad_output");
  auto pad = ctx.ints("padding");
  if (Numel(out.sizes) == 0 || gy.type.numel() == 0) return {Zeros(b, out)};
  ElementType acc = AccOf(out.dtype);
  gy = b.Convert(gy, acc);
  const size_t k = pad.size() / 2;
  for (size_t j = 0; j < k; ++j) {
    int64_t d = self.rank() - 1 - static_cast<int64_t>(j);
    int64_t n = self.dims()[static_cast<size_t>(d)];
    gy = ContractDim(b, gy, d, OneHotRows(b, PadIndices(n, pad[2 * j], pad[2 * j + 1], reflect), n, acc));
  }
  return {Out(b, gy, out)};
}

std::vector<Value> LowerReflectionPad(LoweringContext& ctx) { return PadForward(ctx, true); }
std::vector<Value> LowerReplicationPad(LoweringContext& ctx) { return PadForward(ctx, false); }
std::vector<Value> LowerReflectionPadBackward(LoweringContext& ctx) { return PadBackward(ctx, true); }
std::vector<Value> LowerReplicationPadBackward(LoweringContext& ctx) { return PadBackward(ctx, false); }

// --- im2col / col2im ---------------------------------------------------------------

struct Patches {
  std::vector<int64_t> kernel, dilation, padding, stride;
};

Patches ReadPatches(const LoweringContext& ctx) {
  auto two = [&](std::string_view name) {
    auto v = ctx.ints(name);
    if (v.size() == 1) v.push_back(v[0]);
    if (v.size() != 2) throw LoweringError(ctx.op_name() + ": expected 2 values for " + std::string(name));
    return v;
  };
  return {two("kernel_size"), two("dilation"), two("padding"), two("stride")};
}

// (…, C, H, W) -> (…, C*kh*kw, L): strided slices of the zero-padded input.
std::vector<Value> LowerIm2col(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (Numel(out.sizes) == 0 || x.type.numel() == 0) return {Zeros(b, out)};
  Patches p = ReadPatches(ctx);
  const int64_t r = x.rank();
  const size_t hd = static_cast<size_t>(r - 2), wd = static_cast<size_t>(r - 1);
  std::vector<int64_t> lo(static_cast<size_t>(r), 0), hi(static_cast<size_t>(r), 0), in(static_cast<size_t>(r), 0);
  lo[hd] = hi[hd] = p.padding[0];
  lo[wd] = hi[wd] = p.padding[1];
  Value xp = b.Pad(x, Const(b, x.element(), 0), lo, hi, in);
  const int64_t oh = (xp.dims()[hd] - (p.dilation[0] * (p.kernel[0] - 1) + 1)) / p.stride[0] + 1;
  const int64_t ow = (xp.dims()[wd] - (p.dilation[1] * (p.kernel[1] - 1) + 1)) / p.stride[1] + 1;
  std::vector<Value> blocks;
  std::vector<int64_t> bshape(x.dims().begin(), x.dims().end() - 2);
  bshape.push_back(1);
  bshape.push_back(oh * ow);
  for (int64_t i = 0; i < p.kernel[0]; ++i)
    for (int64_t j = 0; j < p.kernel[1]; ++j) {
      std::vector<int64_t> st(static_cast<size_t>(r), 0), li = xp.dims(), step(static_cast<size_t>(r), 1);
      st[hd] = i * p.dilation[0];
      st[wd] = j * p.dilation[1];
      li[hd] = st[hd] + (oh - 1) * p.stride[0] + 1;
      li[wd] = st[wd] + (ow - 1) * p.stride[1] + 1;
      step[hd] = p.stride[0];
      step[wd] = p.stride[1];
      blocks.push_back(b.Reshape(b.Slice(xp, st, li, step), bshape));  // (…, C, 1, L)
    }
  Value cat = b.Concatenate(blocks, r - 1);  // (…, C, kh*kw, L)
  return {Out(b, cat, out)};
}

// (…, C*kh*kw, L) -> (…, C, H, W): each patch position added back at its
// strided place (interior padding), then the padding cropped.
std::vector<Value> LowerCol2im(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (Numel(out.sizes) == 0) return {Zeros(b, out)};
  if (x.type.numel() == 0) return {Zeros(b, out)};
  ElementType acc = AccOf(out.dtype);
  x = b.Convert(x, acc);
  Patches p = ReadPatches(ctx);
  auto osize = ctx.ints("output_size");
  const int64_t H = osize[0], W = osize[1];
  const int64_t kh = p.kernel[0], kw = p.kernel[1];
  const int64_t hp = H + 2 * p.padding[0], wp = W + 2 * p.padding[1];
  const int64_t oh = (hp - (p.dilation[0] * (kh - 1) + 1)) / p.stride[0] + 1;
  const int64_t ow = (wp - (p.dilation[1] * (kw - 1) + 1)) / p.stride[1] + 1;
  std::vector<int64_t> lead(x.dims().begin(), x.dims().end() - 2);
  const int64_t c = x.dims()[x.dims().size() - 2] / (kh * kw);
  std::vector<int64_t> split = lead;
  split.insert(split.end(), {c, kh, kw, oh, ow});
  Value x6 = b.Reshape(x, split);
  const size_t nl = lead.size();
  const int64_t r = static_cast<int64_t>(nl) + 5;
  Value zero = Const(b, acc, 0);
  Value sum;
  for (int64_t i = 0; i < kh; ++i)
    for (int64_t j = 0; j < kw; ++j) {
      std::vector<int64_t> st(static_cast<size_t>(r), 0), li = split, step(static_cast<size_t>(r), 1);
      st[nl + 1] = i;
      li[nl + 1] = i + 1;
      st[nl + 2] = j;
      li[nl + 2] = j + 1;
      std::vector<int64_t> bdims = lead;
      bdims.insert(bdims.end(), {c, oh, ow});
      Value blk = b.Reshape(b.Slice(x6, st, li, step), bdims);
      const size_t rb = bdims.size();
      std::vector<int64_t> lo(rb, 0), hi(rb, 0), interior(rb, 0);
      lo[rb - 2] = i * p.dilation[0];
      lo[rb - 1] = j * p.dilation[1];
      interior[rb - 2] = p.stride[0] - 1;
      interior[rb - 1] = p.stride[1] - 1;
      hi[rb - 2] = hp - lo[rb - 2] - ((oh - 1) * p.stride[0] + 1);
      hi[rb - 1] = wp - lo[rb - 1] - ((ow - 1) * p.stride[1] + 1);
      Value placed = b.Pad(blk, zero, lo, hi, interior);
      sum = sum.name.empty() ? placed : b.Add(sum, placed);
    }
  const size_t rs = sum.dims().size();
  std::vector<int64_t> st(rs, 0), li = sum.dims(), step(rs, 1);
  st[rs - 2] = p.padding[0];
  st[rs - 1] = p.padding[1];
  li[rs - 2] = p.padding[0] + H;
  li[rs - 1] = p.padding[1] + W;
  return {Out(b, b.Slice(sum, st, li, step), out)};
}

// --- scatter-into-view ops ---------------------------------------------------------

// self with the positions start, start+step, ... (count of them) of `dim`
// replaced by src (src has self's shape with `dim` of size count).
Value StridedReplace(Builder& b, const Value& self, const Value& src, int64_t dim, int64_t start, int64_t step) {
  const size_t r = static_cast<size_t>(self.rank()), d = static_cast<size_t>(dim);
  const int64_t count = src.dims()[d], n = self.dims()[d];
  if (count == 0) return self;
  std::vector<int64_t> lo(r, 0), hi(r, 0), interior(r, 0);
  lo[d] = start;
  interior[d] = step - 1;
  hi[d] = n - start - ((count - 1) * step + 1);
  Value placed = b.Pad(src, Const(b, src.element(), 0), lo, hi, interior);
  Value mask = b.Pad(Const(b, ElementType::kPred, 1, src.dims()), Const(b, ElementType::kPred, 0), lo, hi, interior);
  return b.Select(mask, placed, self);
}

std::vector<Value> LowerSliceScatter(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = Cast(b, ctx.tensor("self"), out.dtype);
  Value src = Cast(b, ctx.tensor("src"), out.dtype);
  if (self.type.numel() == 0) return {Zeros(b, out)};
  if (self.rank() == 0) return {self};
  int64_t dim = NormalizeDim(ctx.has("dim") ? ctx.int_arg("dim") : 0, self.rank());
  const int64_t n = self.dims()[static_cast<size_t>(dim)];
  int64_t start = ctx.has("start") ? ctx.int_arg("start") : 0;
  int64_t step = ctx.has("step") ? ctx.int_arg("step") : 1;
  if (start < 0) start += n;
  start = std::clamp<int64_t>(start, 0, n);
  std::vector<int64_t> want = self.dims();
  int64_t count = src.dims().empty() ? 0 : src.dims()[static_cast<size_t>(dim)];
  want[static_cast<size_t>(dim)] = count;
  src = BroadcastTo(b, src, want);
  return {StridedReplace(b, self, src, dim, start, step)};
}

std::vector<Value> LowerSelectScatter(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = Cast(b, ctx.tensor("self"), out.dtype);
  Value src = Cast(b, ctx.tensor("src"), out.dtype);
  if (self.type.numel() == 0) return {Zeros(b, out)};
  int64_t dim = NormalizeDim(ctx.int_arg("dim"), self.rank());
  const int64_t n = self.dims()[static_cast<size_t>(dim)];
  int64_t index = ctx.int_arg("index");
  if (index < 0) index += n;
  if (index < 0 || index >= n) throw LoweringError(ctx.op_name() + ": index out of range");
  std::vector<int64_t> want = self.dims();
  want[static_cast<size_t>(dim)] = 1;
  std::vector<int64_t> sel = want;
  sel.erase(sel.begin() + dim);
  src = b.Reshape(BroadcastTo(b, src, sel), want);
  return {StridedReplace(b, self, src, dim, index, 1)};
}

std::vector<Value> LowerDiagonalScatter(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = Cast(b, ctx.tensor("self"), out.dtype);
  Value src = Cast(b, ctx.tensor("src"), out.dtype);
  if (self.type.numel() == 0 || src.type.numel() == 0) return {self.type.numel() == 0 ? Zeros(b, out) : self};
  const int64_t offset = ctx.has("offset") ? ctx.int_arg("offset") : 0;
  int64_t d1 = NormalizeDim(ctx.has("dim1") ? ctx.int_arg("dim1") : 0, self.rank());
  int64_t d2 = NormalizeDim(ctx.has("dim2") ? ctx.int_arg("dim2") : 1, self.rank());
  const std::vector<int64_t>& sd = self.dims();
  TensorType it{ElementType::kS64, sd};
  // Diagonal positions: i2 - i1 == offset.
  Value diff = b.Sub(b.Iota(it, d2), b.Iota(it, d1));
  Value mask = b.Compare(diff, Const(b, ElementType::kS64, static_cast<double>(offset), sd), CompareDirection::kEQ);
  // src is (other dims…, L), element k at (i1, i2) = (k - min(offset,0), k + max(offset,0)):
  // index it along d1 (offset >= 0) or d2 (offset < 0), padded to that dim.
  const int64_t along = offset >= 0 ? d1 : d2;
  const int64_t len = src.dims().back();
  const int64_t size = sd[static_cast<size_t>(along)];
  std::vector<int64_t> lo(static_cast<size_t>(src.rank()), 0), hi = lo, in = lo;
  hi.back() = size - len;
  Value padded = b.Pad(src, Const(b, src.element(), 0), lo, hi, in);
  // Broadcast: src's leading dims are self's dims without d1, d2 in order.
  std::vector<int64_t> bd;
  for (int64_t d = 0; d < self.rank(); ++d)
    if (d != d1 && d != d2) bd.push_back(d);
  bd.push_back(along);
  Value full = b.BroadcastInDim(padded, sd, bd);
  return {b.Select(mask, full, self)};
}

// --- pairwise distances --------------------------------------------------------------

// p-norm of `diff` over its last dim, with PyTorch's special cases.
Value PNorm(Builder& b, const Value& diff, double p) {
  int64_t last[] = {diff.rank() - 1};
  Value a = b.Abs(diff);
  if (p == 0) {
    Value nz = b.Convert(b.Compare(a, ConstLike(b, a, 0), CompareDirection::kNE), a.element());
    return ReduceSum(b, nz, last, false);
  }
  if (std::isinf(p)) return ReduceMax(b, a, last, false);
  if (p == 1) return ReduceSum(b, a, last, false);
  if (p == 2) return b.Sqrt(ReduceSum(b, b.Mul(a, a), last, false));
  Value s = ReduceSum(b, b.Pow(a, ConstLike(b, a, p)), last, false);
  return b.Pow(s, ConstLike(b, s, 1.0 / p));
}

// d dist / d diff, times grad, following PyTorch's CPU formulas (0 where
// dist == 0).
Value PNormGrad(Builder& b, const Value& diff, const Value& grad, const Value& dist, double p) {
  Value zero = ConstLike(b, diff, 0);
  Value sign = b.Unary("stablehlo.sign", diff);
  Value a = b.Abs(diff);
  Value dist0 = b.Compare(dist, zero, CompareDirection::kEQ);
  if (p == 0) return zero;
  if (p == 1) return b.Mul(sign, grad);
  Value r;
  if (std::isinf(p)) {
    Value is_max = b.Compare(a, dist, CompareDirection::kEQ);
    r = b.Mul(b.Mul(sign, grad), b.Convert(is_max, diff.element()));
    return b.Select(dist0, zero, r);
  }
  if (p == 2) {
    r = b.Div(b.Mul(grad, diff), dist);
  } else if (p < 2) {
    r = b.Div(b.Mul(b.Mul(sign, b.Pow(a, ConstLike(b, a, p - 1))), grad), b.Pow(dist, ConstLike(b, dist, p - 1)));
    if (p < 1) r = b.Select(b.Compare(diff, zero, CompareDirection::kEQ), zero, r);
  } else {
    r = b.Div(b.Mul(b.Mul(diff, b.Pow(a, ConstLike(b, a, p - 2))), grad), b.Pow(dist, ConstLike(b, dist, p - 1)));
  }
  return b.Select(dist0, zero, r);
}

void PdistPairs(int64_t n, std::vector<int64_t>& I, std::vector<int64_t>& J) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i + 1; j < n; ++j) {
      I.push_back(i);
      J.push_back(j);
    }
}

std::vector<Value> LowerPdist(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (Numel(out.sizes) == 0) return {Zeros(b, out)};
  x = b.Convert(x, AccOf(out.dtype));
  const double p = ctx.has("p") ? ctx.float_arg("p") : 2.0;
  std::vector<int64_t> I, J;
  PdistPairs(x.dims()[0], I, J);
  Value diff = b.Sub(GatherStatic(b, x, 0, I), GatherStatic(b, x, 0, J));
  return {Out(b, PNorm(b, diff, p), out)};
}

std::vector<Value> LowerPdistBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  ElementType acc = AccOf(out.dtype);
  if (Numel(out.sizes) == 0 || x.dims()[0] < 2) return {Zeros(b, out)};
  x = b.Convert(x, acc);
  const double p = ctx.float_arg("p");
  const int64_t n = x.dims()[0], m = x.dims()[1];
  std::vector<int64_t> I, J;
  PdistPairs(n, I, J);
  const int64_t k = static_cast<int64_t>(I.size());
  Value diff = b.Sub(GatherStatic(b, x, 0, I), GatherStatic(b, x, 0, J));  // (k, m)
  int64_t bd[] = {0};
  std::vector<int64_t> km{k, m};
  Value g = b.BroadcastInDim(b.Convert(ctx.tensor("grad"), acc), km, bd);
  Value dist = b.BroadcastInDim(b.Convert(ctx.tensor("pdist"), acc), km, bd);
  Value contrib = PNormGrad(b, diff, g, dist, p);  // (k, m)
  // x_i += contrib, x_j -= contrib.
  Value a = b.Sub(OneHotRows(b, I, n, acc), OneHotRows(b, J, n, acc));  // (k, n)
  return {Out(b, ContractDim(b, contrib, 0, a), out)};
}

std::vector<Value> LowerCdist(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (Numel(out.sizes) == 0) return {Zeros(b, out)};
  ElementType acc = AccOf(out.dtype);
  Value x1 = b.Convert(ctx.tensor("x1"), acc), x2 = b.Convert(ctx.tensor("x2"), acc);
  const double p = ctx.float_arg("p");
  // (B…, P, M), (B…, R, M) -> (B…, P, R, M).
  std::vector<int64_t> d = out.sizes;
  const int64_t r = static_cast<int64_t>(d.size());
  const int64_t m = x1.dims().back();
  d.push_back(m);
  std::vector<int64_t> batch(out.sizes.begin(), out.sizes.end() - 2);
  std::vector<int64_t> w1 = batch, w2 = batch;
  w1.insert(w1.end(), {out.sizes[static_cast<size_t>(r - 2)], m});
  w2.insert(w2.end(), {out.sizes[static_cast<size_t>(r - 1)], m});
  x1 = BroadcastTo(b, x1, w1);
  x2 = BroadcastTo(b, x2, w2);
  if (m == 0) return {Zeros(b, out)};
  std::vector<int64_t> b1, b2;
  for (int64_t i = 0; i < r - 2; ++i) {
    b1.push_back(i);
    b2.push_back(i);
  }
  b1.insert(b1.end(), {r - 2, r});
  b2.insert(b2.end(), {r - 1, r});
  Value diff = b.Sub(b.BroadcastInDim(x1, d, b1), b.BroadcastInDim(x2, d, b2));
  return {Out(b, PNorm(b, diff, p), out)};
}

std::vector<Value> LowerCdistBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  ElementType acc = AccOf(out.dtype);
  Value x1 = b.Convert(ctx.tensor("x1"), acc), x2 = b.Convert(ctx.tensor("x2"), acc);
  Value grad = b.Convert(ctx.tensor("grad"), acc), dist = b.Convert(ctx.tensor("cdist"), acc);
  if (Numel(out.sizes) == 0 || grad.type.numel() == 0) return {Zeros(b, out)};
  const double p = ctx.float_arg("p");
  std::vector<int64_t> gd = grad.dims();  // (B…, P, R)
  const int64_t r = static_cast<int64_t>(gd.size());
  const int64_t m = x1.dims().back();
  std::vector<int64_t> batch(gd.begin(), gd.end() - 2);
  std::vector<int64_t> w1 = batch, w2 = batch;
  w1.insert(w1.end(), {gd[static_cast<size_t>(r - 2)], m});
  w2.insert(w2.end(), {gd[static_cast<size_t>(r - 1)], m});
  x1 = BroadcastTo(b, x1, w1);
  x2 = BroadcastTo(b, x2, w2);
  std::vector<int64_t> d = gd;
  d.push_back(m);
  std::vector<int64_t> b1, b2, bg;
  for (int64_t i = 0; i < r - 2; ++i) {
    b1.push_back(i);
    b2.push_back(i);
    bg.push_back(i);
  }
  b1.insert(b1.end(), {r - 2, r});
  b2.insert(b2.end(), {r - 1, r});
  bg.insert(bg.end(), {r - 2, r - 1});
  Value diff = b.Sub(b.BroadcastInDim(x1, d, b1), b.BroadcastInDim(x2, d, b2));
  Value contrib = PNormGrad(b, diff, b.BroadcastInDim(grad, d, bg), b.BroadcastInDim(dist, d, bg), p);
  int64_t red[] = {r - 1};
  Value g1 = ReduceSum(b, contrib, red, false);  // (B…, P, M)
  return {Out(b, g1, out)};
}

// --- grid_sampler_2d -------------------------------------------------------------------

// grid_sampler_unnormalize: (source coordinate, d source / d grid).
std::pair<Value, Value> Unnormalize(Builder& b, const Value& coord, int64_t size, bool align) {
  auto c = [&](double v) { return ConstLike(b, coord, v); };
  Value x = align ? b.Mul(b.Div(b.Add(coord, c(1)), c(2)), c(static_cast<double>(size - 1)))
                  : b.Div(b.Sub(b.Mul(b.Add(coord, c(1)), c(static_cast<double>(size))), c(1)), c(2));
  return {x, c(align ? (size - 1) / 2.0 : size / 2.0)};
}

// compute_coordinates (border: clip; reflection: reflect then clip),
// multiplying `grad` by the derivative, as PyTorch's *_set_grad helpers.
Value ComputeCoordinates(Builder& b, Value x, Value& grad, int64_t size, int64_t padding_mode, bool align) {
  auto c = [&](double v) { return ConstLike(b, x, v); };
  auto clip = [&](const Value& v) {
    Value inside = b.And(b.Compare(v, c(0), CompareDirection::kGT),
                         b.Compare(v, c(static_cast<double>(size - 1)), CompareDirection::kLT));
    grad = b.Mul(grad, b.Select(inside, c(1), c(0)));
    return b.Min(c(static_cast<double>(size - 1)), b.Max(v, c(0)));
  };
  if (padding_mode == 1) return clip(x);
  if (padding_mode == 2) {
    int64_t twice_low = align ? 0 : -1, twice_high = align ? 2 * (size - 1) : 2 * size - 1;
    if (twice_low == twice_high) {
      grad = c(0);
      return c(0);
    }
    double mn = twice_low / 2.0, span = (twice_high - twice_low) / 2.0;
    Value shifted = b.Sub(x, c(mn));
    Value sign = b.Select(b.Compare(shifted, c(0), CompareDirection::kLT), c(-1), c(1));
    Value in = b.Abs(shifted);
    Value extra = b.Rem(in, c(span));
    Value flips = b.Floor(b.Div(in, c(span)));
    Value odd = b.Compare(b.Rem(flips, c(2)), c(0), CompareDirection::kNE);
    x = b.Select(odd, b.Add(b.Sub(c(span), extra), c(mn)), b.Add(extra, c(mn)));
    grad = b.Mul(grad, b.Select(odd, b.Neg(sign), sign));
    return clip(x);
  }
  return x;
}

struct GridSetup {
  int64_t N, C, H, W, Ho, Wo;
  ElementType t;
  std::vector<int64_t> gdims, odims;  // (N, Ho, Wo), (N, Ho, Wo, C)
  Value ix, iy, gx_mult, gy_mult, nidx;
};

GridSetup SetupGrid(LoweringContext& ctx, ElementType t, bool apply_padding) {
  auto& b = ctx.b;
  GridSetup s;
  s.t = t;
  const Value& input = ctx.tensor("input");
  Value grid = b.Convert(ctx.tensor("grid"), t);  // (N, Ho, Wo, 2)
  s.N = input.dims()[0];
  s.C = input.dims()[1];
  s.H = input.dims()[2];
  s.W = input.dims()[3];
  s.Ho = grid.dims()[1];
  s.Wo = grid.dims()[2];
  s.gdims = {s.N, s.Ho, s.Wo};
  s.odims = {s.N, s.Ho, s.Wo, s.C};
  const int64_t padding_mode = ctx.int_arg("padding_mode");
  const bool align = ctx.bool_arg("align_corners");
  std::vector<int64_t> st{0, 0, 0, 0}, li{s.N, s.Ho, s.Wo, 1}, step{1, 1, 1, 1};
  Value gx = b.Reshape(b.Slice(grid, st, li, step), s.gdims);
  st[3] = 1;
  li[3] = 2;
  Value gy = b.Reshape(b.Slice(grid, st, li, step), s.gdims);
  std::tie(s.ix, s.gx_mult) = Unnormalize(b, gx, s.W, align);
  std::tie(s.iy, s.gy_mult) = Unnormalize(b, gy, s.H, align);
  if (apply_padding) {  // bicubic applies padding per tap instead
    s.ix = ComputeCoordinates(b, s.ix, s.gx_mult, s.W, padding_mode, align);
    s.iy = ComputeCoordinates(b, s.iy, s.gy_mult, s.H, padding_mode, align);
  }
  s.nidx = b.Iota(TensorType{ElementType::kS64, s.gdims}, 0);
  return s;
}

// Integer corner (xf, yf given as float values): clamped gather coordinates
// (N, Ho, Wo, 3) = (n, y, x) and the in-bounds mask (N, Ho, Wo).
std::pair<Value, Value> Corner(Builder& b, const GridSetup& s, const Value& xf, const Value& yf) {
  Value xi = b.Convert(xf, ElementType::kS64), yi = b.Convert(yf, ElementType::kS64);
  Value zero = Const(b, ElementType::kS64, 0, s.gdims);
  auto lt = [&](const Value& v, int64_t n) {
    return b.Compare(v, Const(b, ElementType::kS64, static_cast<double>(n), s.gdims), CompareDirection::kLT);
  };
  Value inb = b.And(b.And(b.Compare(xi, zero, CompareDirection::kGE), lt(xi, s.W)),
                    b.And(b.Compare(yi, zero, CompareDirection::kGE), lt(yi, s.H)));
  std::vector<int64_t> one{s.N, s.Ho, s.Wo, 1};
  Value coords = b.Concatenate(std::vector<Value>{b.Reshape(s.nidx, one), b.Reshape(b.Select(inb, yi, zero), one),
                                                  b.Reshape(b.Select(inb, xi, zero), one)},
                               3);
  return {coords, inb};
}

Value PerPoint(Builder& b, const GridSetup& s, const Value& v) {
  int64_t bd[] = {0, 1, 2};
  return b.BroadcastInDim(v, s.odims, bd);
}

// Values of nhwc (N, H, W, C) at a corner, 0 outside the input: (N, Ho, Wo, C).
Value Fetch(Builder& b, const GridSetup& s, const Value& nhwc, const Value& coords, const Value& inb) {
  hlo::GatherDims g;
  g.offset_dims = {3};
  g.collapsed_slice_dims = {0, 1, 2};
  g.start_index_map = {0, 1, 2};
  g.index_vector_dim = 3;
  std::vector<int64_t> slice{1, 1, 1, s.C};
  Value v = b.Gather(nhwc, coords, g, slice, TensorType{nhwc.element(), s.odims});
  return b.Select(PerPoint(b, s, inb), v, Const(b, nhwc.element(), 0, s.odims));
}

struct Bilinear {
  Value x0, y0, x1, y1;
  Value nw, ne, sw, se;  // weights (N, Ho, Wo)
};

Bilinear BilinearCorners(Builder& b, const GridSetup& s) {
  Bilinear r;
  r.x0 = b.Floor(s.ix);
  r.y0 = b.Floor(s.iy);
  Value one = ConstLike(b, r.x0, 1);
  r.x1 = b.Add(r.x0, one);
  r.y1 = b.Add(r.y0, one);
  r.nw = b.Mul(b.Sub(r.x1, s.ix), b.Sub(r.y1, s.iy));
  r.ne = b.Mul(b.Sub(s.ix, r.x0), b.Sub(r.y1, s.iy));
  r.sw = b.Mul(b.Sub(r.x1, s.ix), b.Sub(s.iy, r.y0));
  r.se = b.Mul(b.Sub(s.ix, r.x0), b.Sub(s.iy, r.y0));
  return r;
}

// Bicubic (A = -0.75) coefficients of the 4 taps at floor - 1 .. floor + 2
// for fraction t, and their derivatives d coeff / d t.
std::array<Value, 4> CubicCoeffs(Builder& b, const Value& t) {
  auto c = [&](double v) { return ConstLike(b, t, v); };
  const double A = -0.75;
  auto conv1 = [&](const Value& x) {  // ((A + 2) x - (A + 3)) x x + 1
    return b.Add(b.Mul(b.Mul(b.Sub(b.Mul(c(A + 2), x), c(A + 3)), x), x), c(1));
  };
  auto conv2 = [&](const Value& x) {  // ((A x - 5A) x + 8A) x - 4A
    return b.Sub(b.Mul(b.Add(b.Mul(b.Sub(b.Mul(c(A), x), c(5 * A)), x), c(8 * A)), x), c(4 * A));
  };
  Value x2 = b.Sub(c(1), t);
  return {conv2(b.Add(t, c(1))), conv1(t), conv1(x2), conv2(b.Add(x2, c(1)))};
}

std::array<Value, 4> CubicCoeffsGrad(Builder& b, const Value& t) {
  auto c = [&](double v) { return ConstLike(b, t, v); };
  const double A = -0.75;
  auto d1 = [&](const Value& x) {  // d/dx conv1 = 3(A + 2) x^2 - 2(A + 3) x
    return b.Mul(b.Sub(b.Mul(c(3 * (A + 2)), x), c(2 * (A + 3))), x);
  };
  auto d2 = [&](const Value& x) {  // d/dx conv2 = 3A x^2 - 10A x + 8A
    return b.Add(b.Mul(b.Sub(b.Mul(c(3 * A), x), c(10 * A)), x), c(8 * A));
  };
  Value x2 = b.Sub(c(1), t);
  return {d2(b.Add(t, c(1))), d1(t), b.Neg(d1(x2)), b.Neg(d2(b.Add(x2, c(1))))};
}

// A bicubic tap: clamped gather coordinates and in-bounds mask after the
// padding mode maps its (float) position.
std::pair<Value, Value> CubicTap(Builder& b, const GridSetup& s, const Value& xf, const Value& yf,
                                 int64_t padding_mode, bool align) {
  Value unused_x = ConstLike(b, xf, 1), unused_y = ConstLike(b, yf, 1);
  Value x = ComputeCoordinates(b, xf, unused_x, s.W, padding_mode, align);
  Value y = ComputeCoordinates(b, yf, unused_y, s.H, padding_mode, align);
  return Corner(b, s, x, y);  // converts truncating, as the CPU kernel's (int64_t) cast
}

// PyTorch's CPU kernel computes coordinates and weights in the tensor's own
// dtype (Vectorized<BFloat16> rounds after every operation), which for bf16
// is off the exact result by several bf16 ulps; computing in bf16 here
// reproduces it within about one ulp, f32 would not.
std::vector<Value> LowerGridSampler2d(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const int64_t mode = ctx.int_arg("interpolation_mode");
  const int64_t padding_mode = ctx.int_arg("padding_mode");
  const bool align = ctx.bool_arg("align_corners");
  if (mode < 0 || mode > 2) throw LoweringError(ctx.op_name() + ": unknown interpolation mode");
  if (Numel(out.sizes) == 0) return {Zeros(b, out)};
  ElementType t = ToElementType(out.dtype);
  GridSetup s = SetupGrid(ctx, t, mode != 2);
  Value nhwc = b.Transpose(b.Convert(ctx.tensor("input"), t), std::vector<int64_t>{0, 2, 3, 1});
  auto fetch = [&](const Value& xf, const Value& yf) {
    auto [coords, inb] = Corner(b, s, xf, yf);
    return Fetch(b, s, nhwc, coords, inb);
  };
  Value res;
  if (mode == 1) {
    res = fetch(b.Unary("stablehlo.round_nearest_even", s.ix), b.Unary("stablehlo.round_nearest_even", s.iy));
  } else if (mode == 2) {
    Value x0 = b.Floor(s.ix), y0 = b.Floor(s.iy);
    auto cx = CubicCoeffs(b, b.Sub(s.ix, x0));
    auto cy = CubicCoeffs(b, b.Sub(s.iy, y0));
    // Rows first (interpolate along x for each of the 4 rows), then along y.
    for (int i = 0; i < 4; ++i) {
      Value yi = b.Add(y0, ConstLike(b, y0, i - 1));
      Value row;
      for (int j = 0; j < 4; ++j) {
        Value xj = b.Add(x0, ConstLike(b, x0, j - 1));
        auto [coords, inb] = CubicTap(b, s, xj, yi, padding_mode, align);
        Value term = b.Mul(Fetch(b, s, nhwc, coords, inb), PerPoint(b, s, cx[static_cast<size_t>(j)]));
        row = row.name.empty() ? term : b.Add(row, term);
      }
      Value term = b.Mul(row, PerPoint(b, s, cy[static_cast<size_t>(i)]));
      res = res.name.empty() ? term : b.Add(res, term);
    }
  } else {
    Bilinear q = BilinearCorners(b, s);
    auto term = [&](const Value& xf, const Value& yf, const Value& w) {
      return b.Mul(fetch(xf, yf), PerPoint(b, s, w));
    };
    res = b.Add(b.Add(term(q.x0, q.y0, q.nw), term(q.x1, q.y0, q.ne)),
                b.Add(term(q.x0, q.y1, q.sw), term(q.x1, q.y1, q.se)));
  }
  return {Out(b, b.Transpose(res, std::vector<int64_t>{0, 3, 1, 2}), out)};
}

// grad_input: grad_output scatter-added at the corners with their weights;
// grad_grid: the bilinear weights' derivatives times the corner values,
// summed over channels, times d source / d grid (0 for nearest).
std::vector<Value> LowerGridSampler2dBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  auto mask = ctx.bools("output_mask", 2);
  const int64_t mode = ctx.int_arg("interpolation_mode");
  const int64_t padding_mode = ctx.int_arg("padding_mode");
  const bool align = ctx.bool_arg("align_corners");
  if (mode < 0 || mode > 2) throw LoweringError(ctx.op_name() + ": unknown interpolation mode");
  const auto& gin_spec = ctx.outputs[0];
  const auto& ggrid_spec = ctx.outputs[1];
  std::vector<Value> res{Zeros(b, gin_spec), Zeros(b, ggrid_spec)};
  const Value& input = ctx.tensor("input");
  const Value& grad_out = ctx.tensor("grad_output");
  if (input.type.numel() == 0 || grad_out.type.numel() == 0) return res;
  ElementType t = ToElementType(ctx.arg("input").dtype);
  GridSetup s = SetupGrid(ctx, t, mode != 2);
  Value gy = b.Transpose(b.Convert(grad_out, t), std::vector<int64_t>{0, 2, 3, 1});  // (N, Ho, Wo, C)
  Value nhwc = b.Transpose(b.Convert(input, t), std::vector<int64_t>{0, 2, 3, 1});
  // Every tap's (coordinates, weighted gradient), scatter-added at the end
  // in one scatter (one op compiles much faster than 16).
  std::vector<Value> all_coords, all_updates;
  auto scatter = [&](const Value& coords, const Value& inb, const Value& w) {
    Value upd = b.Select(PerPoint(b, s, inb), b.Mul(gy, PerPoint(b, s, w)), Const(b, t, 0, s.odims));
    all_coords.push_back(b.Reshape(coords, std::vector<int64_t>{1, s.N, s.Ho, s.Wo, 3}));
    all_updates.push_back(b.Reshape(upd, std::vector<int64_t>{1, s.N, s.Ho, s.Wo, s.C}));
  };
  if (mode == 1) {
    auto [coords, inb] = Corner(b, s, b.Unary("stablehlo.round_nearest_even", s.ix),
                                b.Unary("stablehlo.round_nearest_even", s.iy));
    if (mask[0]) scatter(coords, inb, ConstLike(b, s.ix, 1));
  } else if (mode == 2) {
    Value x0 = b.Floor(s.ix), y0 = b.Floor(s.iy);
    Value tx = b.Sub(s.ix, x0), ty = b.Sub(s.iy, y0);
    auto cx = CubicCoeffs(b, tx), cy = CubicCoeffs(b, ty);
    auto dcx = CubicCoeffsGrad(b, tx), dcy = CubicCoeffsGrad(b, ty);
    Value gix, giy;
    for (size_t i = 0; i < 4; ++i) {
      Value yi = b.Add(y0, ConstLike(b, y0, static_cast<double>(i) - 1));
      for (size_t j = 0; j < 4; ++j) {
        Value xj = b.Add(x0, ConstLike(b, x0, static_cast<double>(j) - 1));
        auto [coords, inb] = CubicTap(b, s, xj, yi, padding_mode, align);
        if (mask[0]) scatter(coords, inb, b.Mul(cx[j], cy[i]));
        if (mask[1]) {
          Value vg = b.Mul(Fetch(b, s, nhwc, coords, inb), gy);  // (N, Ho, Wo, C)
          int64_t cdim[] = {3};
          Value sv = ReduceSum(b, vg, cdim, false);
          Value tx_term = b.Mul(sv, b.Mul(dcx[j], cy[i]));
          Value ty_term = b.Mul(sv, b.Mul(cx[j], dcy[i]));
          gix = gix.name.empty() ? tx_term : b.Add(gix, tx_term);
          giy = giy.name.empty() ? ty_term : b.Add(giy, ty_term);
        }
      }
    }
    if (mask[1]) {
      std::vector<int64_t> one{s.N, s.Ho, s.Wo, 1};
      Value gg = b.Concatenate(std::vector<Value>{b.Reshape(b.Mul(gix, s.gx_mult), one),
                                                  b.Reshape(b.Mul(giy, s.gy_mult), one)}, 3);
      res[1] = Out(b, gg, ggrid_spec);
    }
  } else {
    Bilinear q = BilinearCorners(b, s);
    auto [c_nw, in_nw] = Corner(b, s, q.x0, q.y0);
    auto [c_ne, in_ne] = Corner(b, s, q.x1, q.y0);
    auto [c_sw, in_sw] = Corner(b, s, q.x0, q.y1);
    auto [c_se, in_se] = Corner(b, s, q.x1, q.y1);
    if (mask[0]) {
      scatter(c_nw, in_nw, q.nw);
      scatter(c_ne, in_ne, q.ne);
      scatter(c_sw, in_sw, q.sw);
      scatter(c_se, in_se, q.se);
    }
    if (mask[1]) {
      Value v_nw = Fetch(b, s, nhwc, c_nw, in_nw), v_ne = Fetch(b, s, nhwc, c_ne, in_ne);
      Value v_sw = Fetch(b, s, nhwc, c_sw, in_sw), v_se = Fetch(b, s, nhwc, c_se, in_se);
      auto P = [&](const Value& v) { return PerPoint(b, s, v); };
      Value y1_iy = P(b.Sub(q.y1, s.iy)), iy_y0 = P(b.Sub(s.iy, q.y0));
      Value x1_ix = P(b.Sub(q.x1, s.ix)), ix_x0 = P(b.Sub(s.ix, q.x0));
      Value dx = b.Add(b.Mul(b.Sub(v_ne, v_nw), y1_iy), b.Mul(b.Sub(v_se, v_sw), iy_y0));
      Value dy = b.Add(b.Mul(b.Sub(v_sw, v_nw), x1_ix), b.Mul(b.Sub(v_se, v_ne), ix_x0));
      int64_t cdim[] = {3};
      Value gix = b.Mul(ReduceSum(b, b.Mul(dx, gy), cdim, false), s.gx_mult);
      Value giy = b.Mul(ReduceSum(b, b.Mul(dy, gy), cdim, false), s.gy_mult);
      std::vector<int64_t> one{s.N, s.Ho, s.Wo, 1};
      Value gg = b.Concatenate(std::vector<Value>{b.Reshape(gix, one), b.Reshape(giy, one)}, 3);
      res[1] = Out(b, gg, ggrid_spec);
    }
  }
  if (mask[0]) {
    Value gin = Const(b, t, 0, std::vector<int64_t>{s.N, s.H, s.W, s.C});
    hlo::ScatterDims sd;
    sd.update_window_dims = {4};
    sd.inserted_window_dims = {0, 1, 2};
    sd.scatter_dims_to_operand_dims = {0, 1, 2};
    sd.index_vector_dim = 4;
    gin = b.Scatter(gin, b.Concatenate(all_coords, 0), b.Concatenate(all_updates, 0), sd,
                    [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; });
    res[0] = Out(b, b.Transpose(gin, std::vector<int64_t>{0, 3, 1, 2}), gin_spec);
  }
  return res;
}

// --- inverse trigonometric and hyperbolic functions ---------------------------------
// Built from the StableHLO primitives with the usual cancellation-free
// forms (log1p/expm1 near 0, log(2|x|) where squares would overflow).
// Integer and bool inputs compute in the meta kernel's float dtype; bf16/f16
// in f32, rounded once.

Value C(Builder& b, const Value& like, double v) { return ConstLike(b, like, v); }
Value Log1p(Builder& b, const Value& x) { return b.Unary("stablehlo.log_plus_one", x); }
Value Expm1(Builder& b, const Value& x) { return b.Unary("stablehlo.exponential_minus_one", x); }
Value Atan2(Builder& b, const Value& y, const Value& x) { return b.Binary("stablehlo.atan2", y, x); }
Value Sign(Builder& b, const Value& x) { return b.Unary("stablehlo.sign", x); }
constexpr double kLn2 = 0.69314718055994530942;

// sqrt(1 - x^2) without cancellation near |x| = 1.
Value OneMinusSqSqrt(Builder& b, const Value& x) {
  return b.Sqrt(b.Mul(b.Sub(C(b, x, 1), x), b.Add(C(b, x, 1), x)));
}

Value FAsin(Builder& b, const Value& x) {
  // 2 * atan2(x, 1 + sqrt(1 - x^2))
  return b.Mul(C(b, x, 2), Atan2(b, x, b.Add(C(b, x, 1), OneMinusSqSqrt(b, x))));
}
Value FAcos(Builder& b, const Value& x) {
  // 2 * atan2(sqrt(1 - x^2), 1 + x); pi at x = -1.
  Value r = b.Mul(C(b, x, 2), Atan2(b, OneMinusSqSqrt(b, x), b.Add(C(b, x, 1), x)));
  return b.Select(b.Compare(x, C(b, x, -1), CompareDirection::kEQ), C(b, x, M_PI), r);
}
Value FAtan(Builder& b, const Value& x) { return Atan2(b, x, C(b, x, 1)); }
// sinh/cosh: e^|x|/2 beyond |x| = 20 (e^-|x| is below rounding there),
// overflowing to inf where e^|x| does, as PyTorch's CPU kernels do.
Value FSinh(Builder& b, const Value& x) {
  Value a = b.Abs(x);
  Value small = b.Div(b.Sub(Expm1(b, a), Expm1(b, b.Neg(a))), C(b, x, 2));
  Value large = b.Mul(b.Exp(a), C(b, x, 0.5));
  Value r = b.Select(b.Compare(a, C(b, x, 20), CompareDirection::kLT), small, large);
  return b.Select(b.Compare(x, C(b, x, 0), CompareDirection::kLT), b.Neg(r),
                  b.Select(b.Compare(a, C(b, x, 0), CompareDirection::kEQ), x, r));
}
Value FCosh(Builder& b, const Value& x) {
  Value a = b.Abs(x);
  Value small = b.Div(b.Add(b.Exp(a), b.Exp(b.Neg(a))), C(b, x, 2));
  Value large = b.Mul(b.Exp(a), C(b, x, 0.5));
  return b.Select(b.Compare(a, C(b, x, 20), CompareDirection::kLT), small, large);
}
Value FAsinh(Builder& b, const Value& x) {
  Value a = b.Abs(x);
  Value sq = b.Mul(a, a);
  // log1p(a + a^2 / (1 + sqrt(1 + a^2))); log(2a) where a^2 would overflow.
  Value small = Log1p(b, b.Add(a, b.Div(sq, b.Add(C(b, x, 1), b.Sqrt(b.Add(C(b, x, 1), sq))))));
  Value large = b.Add(b.Log(a), C(b, x, kLn2));
  Value r = b.Select(b.Compare(a, C(b, x, 1e18), CompareDirection::kLT), small, large);
  // sign(x) * r, keeping -0.0 and NaN.
  return b.Select(b.Compare(x, C(b, x, 0), CompareDirection::kLT), b.Neg(r), b.Select(b.Compare(a, C(b, x, 0), CompareDirection::kEQ), x, r));
}
Value FAcosh(Builder& b, const Value& x) {
  // log1p(y + sqrt(y * (y + 2))) with y = x - 1; log(2x) for huge x; NaN below 1.
  Value y = b.Sub(x, C(b, x, 1));
  Value small = Log1p(b, b.Add(y, b.Sqrt(b.Mul(y, b.Add(y, C(b, x, 2))))));
  Value large = b.Add(b.Log(x), C(b, x, kLn2));
  Value r = b.Select(b.Compare(x, C(b, x, 1e18), CompareDirection::kLT), small, large);
  return b.Select(b.Compare(x, C(b, x, 1), CompareDirection::kLT), C(b, x, std::numeric_limits<double>::quiet_NaN()), r);
}
Value FAtanh(Builder& b, const Value& x) {
  // sign(x) * 0.5 * log1p(2a / (1 - a)), a = |x| (accurate near +-1):
  // +-inf at +-1, NaN beyond, -0.0 kept.
  Value a = b.Abs(x);
  Value r = b.Mul(C(b, x, 0.5), Log1p(b, b.Div(b.Mul(C(b, x, 2), a), b.Sub(C(b, x, 1), a))));
  return b.Select(b.Compare(x, C(b, x, 0), CompareDirection::kLT), b.Neg(r),
                  b.Select(b.Compare(a, C(b, x, 0), CompareDirection::kEQ), x, r));
}

using UnaryFn = Value (*)(Builder&, const Value&);

template <UnaryFn F>
std::vector<Value> LowerUnaryFloat(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!at::isFloatingType(out.dtype)) throw LoweringError(ctx.op_name() + ": unsupported output dtype");
  Value x = Cast(b, ctx.tensor("self"), OpMathType(out.dtype));
  return {Out(b, F(b, x), out)};
}

// atan2(self, other): broadcast, computed in the meta kernel's float dtype.
std::vector<Value> LowerAtan2(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!at::isFloatingType(out.dtype)) throw LoweringError(ctx.op_name() + ": unsupported output dtype");
  at::ScalarType t = OpMathType(out.dtype);
  Value y = Prepare(b, ctx.value("self"), t, out.sizes);
  Value x = Prepare(b, ctx.value("other"), t, out.sizes);
  return {Out(b, Atan2(b, y, x), out)};
}

// --- embedding_bag ----------------------------------------------------------------------
// Bags are scatter reductions of the gathered rows into (num_bags, D), with
// an extra dummy bag that absorbs padding_idx entries (sliced off). The
// auxiliary outputs follow the meta kernel's shapes: offset2bag = bag of
// every index, bag_size = entries per bag (mean/max; zeros for sum, as CPU),
// max_indices = the row chosen per bag and feature (max; zeros otherwise).
// Out-of-range indices are reported by the debug executor (index_checks).

// Bag of each index position: (number of offsets[0:B] <= i) - 1.
Value BagIds(Builder& b, const Value& offsets, int64_t n, int64_t num_bags) {
  Value off = Cast(b, offsets, at::kLong);
  std::vector<int64_t> st{0}, li{num_bags}, step{1};
  off = b.Slice(off, st, li, step);
  std::vector<int64_t> d{n, num_bags};
  Value pos = b.Iota(TensorType{ElementType::kS64, d}, 0);
  int64_t bd[] = {1};
  Value le = b.Compare(b.BroadcastInDim(off, d, bd), pos, CompareDirection::kLE);
  int64_t red[] = {1};
  return b.Sub(ReduceSum(b, b.Convert(le, ElementType::kS64), red, false), Const(b, ElementType::kS64, 1, {&n, 1}));
}

Value ValidMask(Builder& b, const Value& idx, int64_t padding_idx) {
  if (padding_idx < 0) return Const(b, ElementType::kPred, 1, idx.dims());
  return b.Compare(idx, Const(b, ElementType::kS64, static_cast<double>(padding_idx), idx.dims()), CompareDirection::kNE);
}

// Scatter of `upd` (n, D) rows into (rows, D) at row ids (n), combined by `op`.
Value ScatterRows(Builder& b, const Value& init, const Value& ids, const Value& upd, std::string_view op) {
  int64_t n = ids.dims()[0];
  std::vector<int64_t> id2{n, 1};
  hlo::ScatterDims sd;
  sd.update_window_dims = {1};
  sd.inserted_window_dims = {0};
  sd.scatter_dims_to_operand_dims = {0};
  sd.index_vector_dim = 1;
  std::string name(op);
  return b.Scatter(init, b.Reshape(ids, id2), upd, sd, [name](Builder& bb, std::span<const Value> a) {
    return std::vector<Value>{bb.Binary(name, a[0], a[1])};
  });
}

Value GatherRows(Builder& b, const Value& table, const Value& idx) {
  int64_t n = idx.dims()[0], d = table.dims()[1];
  std::vector<int64_t> id2{n, 1};
  hlo::GatherDims g;
  g.offset_dims = {1};
  g.collapsed_slice_dims = {0};
  g.start_index_map = {0};
  g.index_vector_dim = 1;
  std::vector<int64_t> slice{1, d};
  return b.Gather(table, b.Reshape(idx, id2), g, slice, TensorType{table.element(), {n, d}});
}

int64_t PaddingIdx(const LoweringContext& ctx) { return ctx.has("padding_idx") ? ctx.int_arg("padding_idx") : -1; }

std::vector<Value> LowerEmbeddingBag(LoweringContext& ctx) {
  auto& b = ctx.b;
  const int64_t mode = ctx.int_arg("mode");
  const int64_t padding_idx = PaddingIdx(ctx);
  const auto& out = ctx.outputs[0];
  ElementType acc = AccOf(out.dtype);
  Value weight = b.Convert(ctx.tensor("weight"), acc);
  Value idx = Cast(b, ctx.tensor("indices"), at::kLong);
  if (idx.rank() != 1) throw LoweringError(ctx.op_name() + ": expects 1-D indices with offsets");
  const int64_t n = idx.dims()[0], num_bags = out.sizes[0], D = out.sizes[1];
  std::vector<Value> res{Zeros(b, out), Zeros(b, ctx.outputs[1]), Zeros(b, ctx.outputs[2]), Zeros(b, ctx.outputs[3])};
  if (n == 0 || num_bags == 0) return res;
  Value bag = BagIds(b, ctx.tensor("offsets"), n, num_bags);
  Value valid = ValidMask(b, idx, padding_idx);
  Value target = b.Select(valid, bag, Const(b, ElementType::kS64, static_cast<double>(num_bags), {&n, 1}));
  Value rows = GatherRows(b, weight, idx);  // (n, D)
  std::vector<int64_t> nd{n, D};
  int64_t bd0[] = {0};
  // Entries per bag (padding excluded).
  Value ones = Const(b, ElementType::kS64, 1, {&n, 1});
  Value counts = ScatterRows(b, Const(b, ElementType::kS64, 0, std::vector<int64_t>{num_bags + 1, 1}), target,
                             b.Reshape(ones, std::vector<int64_t>{n, 1}), "stablehlo.add");
  counts = b.Reshape(b.Slice(counts, std::vector<int64_t>{0, 0}, std::vector<int64_t>{num_bags, 1},
                             std::vector<int64_t>{1, 1}), std::vector<int64_t>{num_bags});
  std::vector<int64_t> bdims{num_bags + 1, D}, st{0, 0}, li{num_bags, D}, step{1, 1};
  Value output;
  if (mode == 2) {
    Value neg = Const(b, acc, -std::numeric_limits<double>::infinity(), bdims);
    Value mx = b.Slice(ScatterRows(b, neg, target, rows, "stablehlo.maximum"), st, li, step);  // (B, D)
    // First position holding each bag's maximum, then its index.
    Value mx_rows = GatherRows(b, b.Concatenate(std::vector<Value>{mx, Const(b, acc, 0, std::vector<int64_t>{1, D})}, 0),
                               target);  // (n, D): the max of each entry's bag
    Value is_max = b.Compare(rows, mx_rows, CompareDirection::kEQ);
    Value posn = b.Iota(TensorType{ElementType::kS64, nd}, 0);
    Value big = Const(b, ElementType::kS64, static_cast<double>(n), nd);
    Value cand = b.Select(is_max, posn, big);
    Value first = ScatterRows(b, Const(b, ElementType::kS64, static_cast<double>(n), bdims), target, cand,
                              "stablehlo.minimum");
    first = b.Slice(first, st, li, step);  // (B, D) positions, n for empty bags
    Value nonempty = b.Compare(first, Const(b, ElementType::kS64, static_cast<double>(n), li), CompareDirection::kLT);
    Value safe = b.Select(nonempty, first, Const(b, ElementType::kS64, 0, li));
    // indices[first] via a (B*D) gather from the index vector.
    int64_t bdn = num_bags * D;
    Value flat = b.Reshape(safe, std::vector<int64_t>{bdn});
    Value picked = b.Reshape(GatherRows(b, b.Reshape(idx, std::vector<int64_t>{n, 1}), flat), li);
    output = b.Select(nonempty, mx, Const(b, acc, 0, li));
    res[3] = Out(b, b.Select(nonempty, picked, Const(b, ElementType::kS64, 0, li)), ctx.outputs[3]);
  } else {
    Value upd = rows;
    if (mode == 0 && ctx.has("per_sample_weights")) {
      Value psw = b.Convert(ctx.tensor("per_sample_weights"), acc);
      upd = b.Mul(upd, b.BroadcastInDim(psw, nd, bd0));
    }
    Value sum = b.Slice(ScatterRows(b, Const(b, acc, 0, bdims), target, upd, "stablehlo.add"), st, li, step);
    if (mode == 1) {
      int64_t bdb[] = {0};
      Value cnt = b.BroadcastInDim(b.Convert(counts, acc), li, bdb);
      Value pos = b.Compare(cnt, Const(b, acc, 0, li), CompareDirection::kGT);
      sum = b.Select(pos, b.Div(sum, cnt), Const(b, acc, 0, li));
    }
    output = sum;
  }
  res[0] = Out(b, output, out);
  if (Numel(ctx.outputs[1].sizes) == n) res[1] = Out(b, bag, ctx.outputs[1]);
  if (mode != 0) {
    // include_last_offset: the meta kernel sizes bag_size like offsets.
    int64_t want = Numel(ctx.outputs[2].sizes);
    if (want > num_bags) {
      std::vector<int64_t> lo{0}, hi{want - num_bags}, in{0};
      counts = b.Pad(counts, Const(b, ElementType::kS64, 0), lo, hi, in);
    }
    if (want == Numel(counts.dims())) res[2] = Out(b, counts, ctx.outputs[2]);
  }
  return res;
}

// grad_weight (num_weights, D) of a bag reduction; `bag` = bag of each index.
Value EmbeddingBagGrad(LoweringContext& ctx, const Value& grad_in, const Value& idx, const Value& bag,
                       int64_t num_weights, int64_t mode, int64_t padding_idx, ElementType acc) {
  auto& b = ctx.b;
  Value grad = b.Convert(grad_in, acc);
  const int64_t n = idx.dims()[0], num_bags = grad.dims()[0], D = grad.dims()[1];
  std::vector<int64_t> wd{num_weights + 1, D}, st{0, 0}, li{num_weights, D}, step{1, 1}, nd{n, D};
  Value valid = ValidMask(b, idx, padding_idx);
  Value dummy = Const(b, ElementType::kS64, static_cast<double>(num_weights), {&n, 1});
  Value target = b.Select(valid, idx, dummy);
  int64_t bd0[] = {0};
  if (mode == 2) {
    // Every (bag, feature) of a non-empty bag sends its gradient to the row
    // max_indices chose.
    Value mi = Cast(b, ctx.tensor("maximum_indices"), at::kLong);  // (B, D)
    Value vb = b.Select(valid, bag, Const(b, ElementType::kS64, static_cast<double>(num_bags), {&n, 1}));
    Value counts = ScatterRows(b, Const(b, ElementType::kS64, 0, std::vector<int64_t>{num_bags + 1, 1}), vb,
                               Const(b, ElementType::kS64, 1, std::vector<int64_t>{n, 1}), "stablehlo.add");
    counts = b.Reshape(b.Slice(counts, std::vector<int64_t>{0, 0}, std::vector<int64_t>{num_bags, 1},
                               std::vector<int64_t>{1, 1}), std::vector<int64_t>{num_bags});
    std::vector<int64_t> bdd{num_bags, D};
    Value nonempty = b.BroadcastInDim(b.Compare(counts, Const(b, ElementType::kS64, 0, {&num_bags, 1}),
                                                CompareDirection::kGT), bdd, bd0);
    Value rowid = b.Select(nonempty, mi, Const(b, ElementType::kS64, static_cast<double>(num_weights), bdd));
    Value col = b.Iota(TensorType{ElementType::kS64, bdd}, 1);
    std::vector<int64_t> one{num_bags, D, 1};
    Value coords = b.Concatenate(std::vector<Value>{b.Reshape(rowid, one), b.Reshape(col, one)}, 2);
    hlo::ScatterDims sd;
    sd.inserted_window_dims = {0, 1};
    sd.scatter_dims_to_operand_dims = {0, 1};
    sd.index_vector_dim = 2;
    Value r = b.Scatter(Const(b, acc, 0, wd), coords, grad, sd, [](Builder& bb, std::span<const Value> a) {
      return std::vector<Value>{bb.Add(a[0], a[1])};
    });
    return b.Slice(r, st, li, step);
  }
  Value g = GatherRows(b, grad, b.Select(valid, bag, Const(b, ElementType::kS64, 0, {&n, 1})));  // (n, D)
  Value scale;
  if (mode == 1) {
    Value vb = b.Select(valid, bag, Const(b, ElementType::kS64, static_cast<double>(num_bags), {&n, 1}));
    Value counts = ScatterRows(b, Const(b, acc, 0, std::vector<int64_t>{num_bags + 1, 1}), vb,
                               Const(b, acc, 1, std::vector<int64_t>{n, 1}), "stablehlo.add");
    Value per = b.Reshape(GatherRows(b, counts, vb), std::vector<int64_t>{n});
    scale = b.Div(Const(b, acc, 1, {&n, 1}), per);
  }
  if (mode == 0 && ctx.has("per_sample_weights")) {
    Value psw = b.Convert(ctx.tensor("per_sample_weights"), acc);
    scale = scale.name.empty() ? psw : b.Mul(scale, psw);
  }
  if (!scale.name.empty()) g = b.Mul(g, b.BroadcastInDim(scale, nd, bd0));
  return b.Slice(ScatterRows(b, Const(b, acc, 0, wd), target, g, "stablehlo.add"), st, li, step);
}

std::vector<Value> LowerEmbeddingBagBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (ctx.has("sparse") && ctx.bool_arg("sparse")) throw LoweringError(ctx.op_name() + ": sparse gradients are not lowered");
  const int64_t mode = ctx.int_arg("mode");
  // PyTorch's CPU kernel scales by frequencies in a way that does not match
  // its documentation (counts looked up for other rows than the one being
  // updated); rather than guess, these calls run on the CPU.
  if (ctx.bool_arg("scale_grad_by_freq"))
    throw LoweringError(ctx.op_name() + ": scale_grad_by_freq runs on the CPU (its CPU semantics are kept)");
  Value idx = Cast(b, ctx.tensor("indices"), at::kLong);
  const Value& grad = ctx.tensor("grad");
  const int64_t n = idx.dims()[0];
  if (n == 0 || grad.type.numel() == 0) return {Zeros(b, out)};
  Value bag = ctx.find("offsets") ? BagIds(b, ctx.tensor("offsets"), n, grad.dims()[0])
                                  : Cast(b, ctx.tensor("offset2bag"), at::kLong);
  return {Out(b, EmbeddingBagGrad(ctx, grad, idx, bag, ctx.int_arg("num_weights"), mode, PaddingIdx(ctx),
                                  AccOf(out.dtype)), out)};
}

// d loss / d per_sample_weights[i] = <grad[bag(i)], weight[indices[i]]> (0 for padding).
std::vector<Value> LowerEmbeddingBagPswBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (ctx.int_arg("mode") != 0) throw LoweringError(ctx.op_name() + ": per_sample_weights need mode='sum'");
  ElementType acc = AccOf(out.dtype);
  Value idx = Cast(b, ctx.tensor("indices"), at::kLong);
  Value grad = b.Convert(ctx.tensor("grad"), acc);
  Value weight = b.Convert(ctx.tensor("weight"), acc);
  const int64_t n = idx.dims()[0];
  if (n == 0 || grad.type.numel() == 0) return {Zeros(b, out)};
  Value bag = BagIds(b, ctx.tensor("offsets"), n, grad.dims()[0]);
  Value valid = ValidMask(b, idx, PaddingIdx(ctx));
  Value g = GatherRows(b, grad, bag);
  Value w = GatherRows(b, weight, idx);
  int64_t red[] = {1};
  Value dot = ReduceSum(b, b.Mul(g, w), red, false);
  return {Out(b, b.Select(valid, dot, Const(b, acc, 0, {&n, 1})), out)};
}

// embedding_renorm_: rows named by `indices` whose norm exceeds max_norm
// are scaled by max_norm / (norm + 1e-7); other rows stay bit-identical.
std::vector<Value> LowerEmbeddingRenorm(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = ctx.tensor("self");
  if (self.type.numel() == 0 || self.rank() != 2) {
    if (self.rank() != 2) throw LoweringError(ctx.op_name() + ": expects a 2-D weight");
    return {self};
  }
  Value idx = b.Reshape(Cast(b, ctx.tensor("indices"), at::kLong), std::vector<int64_t>{ctx.tensor("indices").type.numel()});
  const int64_t n = idx.dims()[0], rows = self.dims()[0], d = self.dims()[1];
  ElementType acc = AccOf(ctx.arg("self").dtype);
  const double max_norm = ctx.float_arg("max_norm"), p = ctx.float_arg("norm_type");
  Value w = b.Convert(self, acc);
  Value referenced = Const(b, ElementType::kPred, 0, std::vector<int64_t>{rows});
  if (n > 0) {
    Value hits = ScatterRows(b, Const(b, ElementType::kS64, 0, std::vector<int64_t>{rows, 1}), idx,
                             Const(b, ElementType::kS64, 1, std::vector<int64_t>{n, 1}), "stablehlo.add");
    referenced = b.Compare(b.Reshape(hits, std::vector<int64_t>{rows}), Const(b, ElementType::kS64, 0, std::vector<int64_t>{rows}),
                           CompareDirection::kGT);
  }
  Value norm = PNorm(b, w, p);  // (rows)
  Value cond = b.And(referenced, b.Compare(norm, Const(b, acc, max_norm, std::vector<int64_t>{rows}), CompareDirection::kGT));
  Value scale = b.Div(Const(b, acc, max_norm, std::vector<int64_t>{rows}), b.Add(norm, Const(b, acc, 1e-7, std::vector<int64_t>{rows})));
  std::vector<int64_t> rd{rows, d};
  int64_t bd0[] = {0};
  Value scaled = Cast(b, b.Mul(w, b.BroadcastInDim(scale, rd, bd0)), ctx.arg("self").dtype);
  return {Out(b, b.Select(b.BroadcastInDim(cond, rd, bd0), scaled, self), out)};
}

// --- factories -----------------------------------------------------------------

std::vector<Value> LowerScalarTensor(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.value("s"), out.dtype, out.sizes)};
}

std::vector<Value> LowerFullLike(LoweringContext& ctx) {
  const auto& out = ctx.outputs[0];
  return {Prepare(ctx.b, ctx.value("fill_value"), out.dtype, out.sizes)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"native_group_norm", LowerGroupNorm},
    {"native_group_norm_backward", LowerGroupNormBackward},
    {"reflection_pad1d", LowerReflectionPad},
    {"reflection_pad2d", LowerReflectionPad},
    {"reflection_pad3d", LowerReflectionPad},
    {"reflection_pad1d_backward", LowerReflectionPadBackward},
    {"reflection_pad2d_backward", LowerReflectionPadBackward},
    {"reflection_pad3d_backward", LowerReflectionPadBackward},
    {"replication_pad1d", LowerReplicationPad},
    {"replication_pad2d", LowerReplicationPad},
    {"replication_pad3d", LowerReplicationPad},
    {"replication_pad1d_backward", LowerReplicationPadBackward},
    {"replication_pad2d_backward", LowerReplicationPadBackward},
    {"replication_pad3d_backward", LowerReplicationPadBackward},
    {"im2col", LowerIm2col},
    {"col2im", LowerCol2im},
    {"select_scatter", LowerSelectScatter},
    {"slice_scatter", LowerSliceScatter},
    {"diagonal_scatter", LowerDiagonalScatter},
    {"_pdist_forward", LowerPdist},
    {"_pdist_backward", LowerPdistBackward},
    {"_cdist_forward", LowerCdist},
    {"_cdist_backward", LowerCdistBackward},
    {"grid_sampler_2d", LowerGridSampler2d},
    {"grid_sampler_2d_backward", LowerGridSampler2dBackward},
    {"asin", LowerUnaryFloat<FAsin>},
    {"acos", LowerUnaryFloat<FAcos>},
    {"atan", LowerUnaryFloat<FAtan>},
    {"sinh", LowerUnaryFloat<FSinh>},
    {"cosh", LowerUnaryFloat<FCosh>},
    {"asinh", LowerUnaryFloat<FAsinh>},
    {"acosh", LowerUnaryFloat<FAcosh>},
    {"atanh", LowerUnaryFloat<FAtanh>},
    {"atan2", LowerAtan2},
    {"_embedding_bag", LowerEmbeddingBag, {.index_checks = {{"indices", "weight", ""}}}},
    {"_embedding_bag_forward_only", LowerEmbeddingBag, {.index_checks = {{"indices", "weight", ""}}}},
    {"_embedding_bag_backward", LowerEmbeddingBagBackward},
    {"_embedding_bag_dense_backward", LowerEmbeddingBagBackward},
    {"_embedding_bag_per_sample_weights_backward", LowerEmbeddingBagPswBackward},
    {"embedding_renorm", LowerEmbeddingRenorm, {.index_checks = {{"indices", "self", ""}}}},
    {"scalar_tensor", LowerScalarTensor},
    {"full_like", LowerFullLike},
});

}  // namespace torch_tpu::lowering
