// Neural-network building blocks: softmax/log_softmax (+backward), layer norm
// (+backward), batch norm (+backward), dropout (+backward), nll_loss
// (+backward), mse_loss (+backward), embedding_dense_backward, glu
// (+backward), log_sigmoid_forward (+backward), _prelu_kernel (+backward),
// binary_cross_entropy (+backward), smooth_l1_loss / huber_loss (+backward).
//
// Everything computes in the op-math dtype (f32 for bf16/f16) and rounds
// once to the meta kernel's output dtype.
#include <cmath>
#include <limits>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;



// output_mask with the returns the meta kernel leaves undefined switched
// off: in a graph (FX) an undefined return has dtype Undefined and gets a
// placeholder the graph program drops (eager passes a float placeholder spec).
std::vector<bool> DefinedMask(const LoweringContext& ctx, size_t n) {
  std::vector<bool> out = ctx.bools("output_mask", n);
  for (size_t i = 0; i < n && i < ctx.outputs.size(); ++i)
    if (ctx.outputs[i].dtype == at::ScalarType::Undefined) out[i] = false;
  return out;
}

// A placeholder for a return the op does not compute (output_mask false).
Value Unused(Builder& b, const OutputSpec& spec) {
  at::ScalarType t = spec.dtype == at::ScalarType::Undefined ? at::kFloat : spec.dtype;
  return Const(b, ToElementType(t), 0, spec.sizes);
}

at::ScalarType Acc(at::ScalarType t) { return OpMathType(t); }

int64_t CountOf(const Value& x, std::span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= x.dims()[static_cast<size_t>(d)];
  return n;
}

// Sum over dims, kept as size-1 dims and broadcast back to x's shape.
Value SumBack(Builder& b, const Value& x, std::span<const int64_t> dims) {
  return BroadcastTo(b, ReduceSum(b, x, dims, true), x.dims());
}
// The softmax family's stabilising shift: the max over dims through a
// select(a >= b, a, b) reducer, broadcast back to x's shape. Unlike ReduceMax
// it does not propagate NaN, which softmax does not need (a NaN in a row makes
// that row's sum, and so every output of the row, NaN, as on the CPU; +-inf
// shift as with a true max), and XLA:CPU runs it several times faster than
// its NaN-propagating maximum (xla_cpu_enable_fast_min_max=false).
Value ShiftBack(Builder& b, const Value& x, std::span<const int64_t> dims) {
  Value init = Const(b, x.element(), -std::numeric_limits<double>::infinity());
  Value m = b.Reduce(std::span(&x, 1), std::span(&init, 1), dims, [](Builder& bb, std::span<const Value> a) {
    return std::vector<Value>{bb.Select(bb.Compare(a[0], a[1], CompareDirection::kGE), a[0], a[1])};
  })[0];
  return BroadcastTo(b, b.Reshape(m, KeepDimShape(x.dims(), dims)), x.dims());
}

// v rounded to t's precision (bf16/f16), kept in v's element type: the
// rounding of the CPU kernel's scalar_t arithmetic.
Value RoundTo(Builder& b, const Value& v, at::ScalarType t) {
  if (t != at::kBFloat16 && t != at::kHalf) return v;
  return b.Convert(b.Convert(v, ToElementType(t)), v.element());
}

// A loss's reduction: 0 none, 1 mean, 2 sum over every element (the sum
// accumulated in v's type after rounding each element to t, as CPU's
// sum/mean of the loss tensor).
Value ReduceLoss(Builder& b, const Value& loss, int64_t reduction, at::ScalarType t, const OutputSpec& out) {
  if (reduction == 0) return Out(b, loss, out);
  Value l = RoundTo(b, loss, t);
  Value s = ReduceSum(b, l, ReductionDims({}, l.rank()), false);
  if (reduction == 1) s = b.Div(s, ConstLike(b, s, static_cast<double>(l.type.numel())));
  return Out(b, s, out);
}


// ---------------------------------------------------------------------------
// softmax family

std::vector<int64_t> SoftmaxDim(const LoweringContext& ctx, const Value& x) {
  return ReductionDims(std::vector<int64_t>{ctx.int_arg("dim")}, x.rank());
}

std::vector<Value> LowerSoftmax(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = Cast(b, ctx.tensor("self"), Acc(out.dtype));
  auto dims = SoftmaxDim(ctx, x);
  Value e = b.Exp(b.Sub(x, ShiftBack(b, x, dims)));
  return {Out(b, b.Div(e, SumBack(b, e, dims)), out)};
}

std::vector<Value> LowerLogSoftmax(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = Cast(b, ctx.tensor("self"), Acc(out.dtype));
  auto dims = SoftmaxDim(ctx, x);
  Value shifted = b.Sub(x, ShiftBack(b, x, dims));
  Value lse = b.Log(SumBack(b, b.Exp(shifted), dims));
  return {Out(b, b.Sub(shifted, lse), out)};
}

std::vector<Value> LowerSoftmaxBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  Value y = Cast(b, ctx.tensor("output"), acc);
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, y.dims());
  auto dims = SoftmaxDim(ctx, y);
  Value gy = b.Mul(g, y);
  return {Out(b, b.Sub(gy, b.Mul(y, SumBack(b, gy, dims))), out)};
}

std::vector<Value> LowerLogSoftmaxBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  Value y = Cast(b, ctx.tensor("output"), acc);
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, y.dims());
  auto dims = SoftmaxDim(ctx, y);
  return {Out(b, b.Sub(g, b.Mul(b.Exp(y), SumBack(b, g, dims))), out)};
}

// ---------------------------------------------------------------------------
// layer norm

std::vector<Value> LowerLayerNorm(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value input = ctx.tensor("input");
  at::ScalarType acc = Acc(out.dtype);
  Value x = Cast(b, input, acc);
  const int64_t nd = static_cast<int64_t>(ctx.ints("normalized_shape").size());
  const int64_t axis = x.rank() - nd;
  std::vector<int64_t> dims;
  for (int64_t d = axis; d < x.rank(); ++d) dims.push_back(d);
  const double n = static_cast<double>(CountOf(x, dims));
  Value inv_n = Const(b, ToElementType(acc), 1.0 / n, x.dims());
  Value mean = b.Mul(SumBack(b, x, dims), inv_n);
  Value d = b.Sub(x, mean);
  Value var = b.Mul(SumBack(b, b.Mul(d, d), dims), inv_n);
  double eps = ctx.float_arg("eps");
  Value rstd = b.Rsqrt(b.Add(var, ConstLike(b, var, eps)));
  Value y = b.Mul(d, rstd);
  if (ctx.has("weight")) y = b.Mul(y, Prepare(b, ctx.tensor("weight"), acc, x.dims()));
  if (ctx.has("bias")) y = b.Add(y, Prepare(b, ctx.tensor("bias"), acc, x.dims()));
  // mean/rstd: the batch dims with size-1 normalized dims (the meta's shape).
  std::vector<int64_t> kept = KeepDimShape(x.dims(), dims);
  auto stat = [&](const Value& v, const OutputSpec& spec) {
    std::vector<int64_t> start(static_cast<size_t>(x.rank()), 0), stride(static_cast<size_t>(x.rank()), 1);
    Value s = b.Slice(v, start, kept, stride);
    return Out(b, s, spec);
  };
  return {Out(b, y, out), stat(mean, ctx.outputs[1]), stat(rstd, ctx.outputs[2])};
}

std::vector<Value> LowerLayerNormBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  auto mask = DefinedMask(ctx, 3);
  Value input = ctx.tensor("input");
  at::ScalarType acc = Acc(input.element() == ElementType::kF64 ? at::kDouble : at::kFloat);
  Value x = Cast(b, input, acc);
  Value g = Prepare(b, ctx.tensor("grad_out"), acc, x.dims());
  const int64_t nd = static_cast<int64_t>(ctx.ints("normalized_shape").size());
  const int64_t axis = x.rank() - nd;
  std::vector<int64_t> norm_dims, batch_dims;
  for (int64_t d = 0; d < x.rank(); ++d) (d >= axis ? norm_dims : batch_dims).push_back(d);
  Value mean = Prepare(b, ctx.tensor("mean"), acc, x.dims());
  Value rstd = Prepare(b, ctx.tensor("rstd"), acc, x.dims());
  Value xhat = b.Mul(b.Sub(x, mean), rstd);
  std::vector<Value> res(3);
  if (mask[0]) {
    Value gw = g;
    if (ctx.has("weight")) gw = b.Mul(g, Prepare(b, ctx.tensor("weight"), acc, x.dims()));
    const double n = static_cast<double>(CountOf(x, norm_dims));
    Value inv_n = Const(b, ToElementType(acc), 1.0 / n, x.dims());
    Value m1 = b.Mul(SumBack(b, gw, norm_dims), inv_n);
    Value m2 = b.Mul(SumBack(b, b.Mul(gw, xhat), norm_dims), inv_n);
    Value dx = b.Mul(rstd, b.Sub(b.Sub(gw, m1), b.Mul(xhat, m2)));
    res[0] = Out(b, dx, ctx.outputs[0]);
  } else {
    res[0] = Unused(b, ctx.outputs[0]);
  }
  if (mask[1] && ctx.has("weight")) {
    res[1] = Out(b, ReduceSum(b, b.Mul(g, xhat), batch_dims, false), ctx.outputs[1]);
  } else {
    res[1] = Unused(b, ctx.outputs[1]);
  }
  if (mask[2] && (ctx.has("bias") || ctx.has("weight"))) {
    res[2] = Out(b, ReduceSum(b, g, batch_dims, false), ctx.outputs[2]);
  } else {
    res[2] = Unused(b, ctx.outputs[2]);
  }
  return res;
}

// ---------------------------------------------------------------------------
// batch norm: input (N, C, ...), statistics per channel (dim 1).

std::vector<int64_t> NonChannelDims(const Value& x) {
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (d != 1) dims.push_back(d);
  return dims;
}

// A per-channel vector (C) broadcast along dim 1 of x.
Value PerChannel(Builder& b, const Value& v, at::ScalarType acc, const Value& x) {
  Value c = Cast(b, v, acc);
  int64_t bd[] = {1};
  return b.BroadcastInDim(c, x.dims(), bd);
}

std::vector<Value> LowerBatchNorm(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value input = ctx.tensor("input");
  at::ScalarType acc = Acc(out.dtype);
  Value x = Cast(b, input, acc);
  if (x.rank() < 2) throw LoweringError(ctx.op_name() + ": input must have at least 2 dims");
  const bool training = ctx.find("training") ? ctx.bool_arg("training") : false;
  const double eps = ctx.float_arg("eps");
  const double momentum = ctx.float_arg("momentum");
  const bool has_running = ctx.has("running_mean") && ctx.has("running_var");
  auto dims = NonChannelDims(x);
  const double n = static_cast<double>(CountOf(x, dims));
  ElementType e = ToElementType(acc);
  const std::vector<int64_t> cd{x.dims()[1]};
  Value mean_c, var_c, invstd_c;
  if (training) {
    mean_c = b.Div(ReduceSum(b, x, dims, false), Const(b, e, n, cd));
    Value d = b.Sub(x, b.BroadcastInDim(mean_c, x.dims(), std::vector<int64_t>{1}));
    var_c = b.Div(ReduceSum(b, b.Mul(d, d), dims, false), Const(b, e, n, cd));
    invstd_c = b.Rsqrt(b.Add(var_c, Const(b, e, eps, cd)));
    if (has_running) {
      Value m = Const(b, e, momentum, cd);
      Value one_m = Const(b, e, 1.0 - momentum, cd);
      Value rm = Cast(b, ctx.tensor("running_mean"), acc);
      Value rv = Cast(b, ctx.tensor("running_var"), acc);
      Value unbiased = b.Mul(var_c, Const(b, e, n > 1 ? n / (n - 1) : INFINITY, cd));
      ctx.write("running_mean", b.Add(b.Mul(one_m, rm), b.Mul(m, mean_c)));
      ctx.write("running_var", b.Add(b.Mul(one_m, rv), b.Mul(m, unbiased)));
    }
  } else {
    if (!has_running) throw LoweringError(ctx.op_name() + ": evaluation without running statistics");
    mean_c = Cast(b, ctx.tensor("running_mean"), acc);
    var_c = Cast(b, ctx.tensor("running_var"), acc);
    invstd_c = b.Rsqrt(b.Add(var_c, Const(b, e, eps, cd)));
  }
  Value y = b.Mul(b.Sub(x, PerChannel(b, mean_c, acc, x)), PerChannel(b, invstd_c, acc, x));
  if (ctx.has("weight")) y = b.Mul(y, PerChannel(b, ctx.tensor("weight"), acc, x));
  if (ctx.has("bias")) y = b.Add(y, PerChannel(b, ctx.tensor("bias"), acc, x));
  std::vector<Value> res{Out(b, y, out)};
  // save_mean/save_invstd (eval mode: of the running statistics, where the
  // meta kernel gives them a shape at all).
  for (size_t i = 1; i < 3; ++i) {
    const Value& v = i == 1 ? mean_c : invstd_c;
    res.push_back(Numel(ctx.outputs[i].sizes) == v.type.numel() ? Out(b, v, ctx.outputs[i]) : Unused(b, ctx.outputs[i]));
  }
  return res;
}

std::vector<Value> LowerBatchNormBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  auto mask = DefinedMask(ctx, 3);
  Value input = ctx.tensor("input");
  at::ScalarType acc = input.element() == ElementType::kF64 ? at::kDouble : at::kFloat;
  ElementType e = ToElementType(acc);
  Value x = Cast(b, input, acc);
  Value g = Prepare(b, ctx.tensor("grad_out"), acc, x.dims());
  const bool train = ctx.bool_arg("train");
  const double eps = ctx.float_arg("eps");
  const int64_t c = x.dims()[1];
  const std::vector<int64_t> cd{c};
  auto dims = NonChannelDims(x);
  const double n = static_cast<double>(CountOf(x, dims));
  Value mean_c, invstd_c;
  if (train) {
    mean_c = Cast(b, ctx.tensor("save_mean"), acc);
    invstd_c = Cast(b, ctx.tensor("save_invstd"), acc);
  } else {
    mean_c = Cast(b, ctx.tensor("running_mean"), acc);
    invstd_c = b.Rsqrt(b.Add(Cast(b, ctx.tensor("running_var"), acc), Const(b, e, eps, cd)));
  }
  Value w_c = ctx.has("weight") ? Cast(b, ctx.tensor("weight"), acc) : Const(b, e, 1, cd);
  Value xhat = b.Mul(b.Sub(x, PerChannel(b, mean_c, acc, x)), PerChannel(b, invstd_c, acc, x));
  Value sum_g = ReduceSum(b, g, dims, false);
  Value sum_gx = ReduceSum(b, b.Mul(g, xhat), dims, false);
  std::vector<Value> res(3);
  if (mask[0]) {
    Value scale = PerChannel(b, b.Mul(w_c, invstd_c), acc, x);
    Value dx;
    if (train) {
      Value inv_n = Const(b, e, 1.0 / n, cd);
      Value m1 = PerChannel(b, b.Mul(sum_g, inv_n), acc, x);
      Value m2 = PerChannel(b, b.Mul(sum_gx, inv_n), acc, x);
      dx = b.Mul(scale, b.Sub(b.Sub(g, m1), b.Mul(xhat, m2)));
    } else {
      dx = b.Mul(g, scale);
    }
    res[0] = Out(b, dx, ctx.outputs[0]);
  } else {
    res[0] = Unused(b, ctx.outputs[0]);
  }
  res[1] = mask[1] ? Out(b, sum_gx, ctx.outputs[1]) : Unused(b, ctx.outputs[1]);
  res[2] = mask[2] ? Out(b, sum_g, ctx.outputs[2]) : Unused(b, ctx.outputs[2]);
  return res;
}

// ---------------------------------------------------------------------------
// dropout

// Uniform f32 in [0, 1) from 32 random bits (23 bits of mantissa).
Value UniformFromBits(Builder& b, const Value& bits) {
  Value shifted = b.Binary("stablehlo.shift_right_logical", bits, ConstLike(b, bits, 9));
  Value one_bits = b.ConstantInt(TensorType{ElementType::kU32, {}}, 0x3F800000);
  Value f = b.BitcastConvert(b.Or(shifted, BroadcastTo(b, one_bits, bits.dims())), ElementType::kF32);
  return b.Sub(f, ConstLike(b, f, 1.0));
}

std::vector<Value> LowerNativeDropout(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value input = ctx.tensor("input");
  const double p = ctx.float_arg("p");
  const bool train = !ctx.has("train") || ctx.bool_arg("train");
  if (!train) {
    return {Out(b, input, out), Const(b, ToElementType(ctx.outputs[1].dtype), 1, ctx.outputs[1].sizes)};
  }
  at::ScalarType acc = Acc(out.dtype);
  Value x = Cast(b, input, acc);
  Value u = UniformFromBits(b, RandomBits32(b, ctx.rng_state(), x.dims()));
  const double keep_p = 1.0 - p;
  Value keep = b.Compare(u, ConstLike(b, u, keep_p), CompareDirection::kLT);
  const double scale = keep_p == 0 ? 0.0 : 1.0 / keep_p;
  Value y = b.Select(keep, b.Mul(x, ConstLike(b, x, scale)), ConstLike(b, x, 0));
  return {Out(b, y, out), Out(b, keep, ctx.outputs[1])};
}

std::vector<Value> LowerNativeDropoutBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  Value g = Cast(b, ctx.tensor("grad_output"), acc);
  Value mask = Prepare(b, ctx.tensor("mask"), acc, g.dims());
  Value scale = ConstLike(b, g, ctx.float_arg("scale"));
  return {Out(b, b.Mul(b.Mul(g, mask), scale), out)};
}

// ---------------------------------------------------------------------------
// nll_loss / nll_loss2d: self (N, C, d1..dk), (N, C) or (C); target
// (N, d1..dk), (N) or (). The class dim is moved last and the rest flattened
// to M rows.

struct NllParts {
  Value x;        // (M, C) in acc
  Value target;   // (M) s64, ignored entries replaced by 0
  Value valid;    // (M) pred
  Value w;        // (M) weight of each target, 0 where ignored
  int64_t n, c;   // n = M
  std::vector<int64_t> perm;        // self dims -> (N, d1..dk, C)
  std::vector<int64_t> moved_dims;  // (N, d1..dk, C)
};

NllParts NllPrepare(LoweringContext& ctx, at::ScalarType acc) {
  auto& b = ctx.b;
  NllParts p;
  Value self = Cast(b, ctx.tensor("self"), acc);
  if (self.rank() == 1) {
    int64_t d[] = {1, self.dims()[0]};
    self = b.Reshape(self, d);
  }
  if (self.rank() < 2) throw LoweringError(ctx.op_name() + ": expected an input with a class dim");
  p.perm.push_back(0);
  for (int64_t d = 2; d < self.rank(); ++d) p.perm.push_back(d);
  p.perm.push_back(1);
  Value moved = b.Transpose(self, p.perm);
  p.moved_dims = moved.dims();
  p.c = self.dims()[1];
  p.n = moved.type.numel() / std::max<int64_t>(p.c, 1);
  p.x = b.Reshape(moved, std::vector<int64_t>{p.n, p.c});
  Value t = Cast(b, ctx.tensor("target"), at::kLong);
  int64_t nd[] = {p.n};
  t = b.Reshape(t, nd);
  int64_t ignore = ctx.int_arg("ignore_index");
  Value ign = b.ConstantInt(TensorType{ElementType::kS64, {}}, ignore);
  p.valid = b.Compare(t, BroadcastTo(b, ign, nd), CompareDirection::kNE);
  p.target = b.Select(p.valid, t, ConstLike(b, t, 0));
  ElementType e = ToElementType(acc);
  if (ctx.has("weight")) {
    Value w = Cast(b, ctx.tensor("weight"), acc);
    Value idx = b.Reshape(p.target, std::vector<int64_t>{p.n, 1});
    hlo::GatherDims g;
    g.collapsed_slice_dims = {0};
    g.start_index_map = {0};
    g.index_vector_dim = 1;
    int64_t ss[] = {1};
    Value wt = b.Gather(w, idx, g, ss, TensorType{e, {p.n}});
    p.w = b.Select(p.valid, wt, ConstLike(b, wt, 0));
  } else {
    p.w = b.Select(p.valid, Const(b, e, 1, nd), Const(b, e, 0, nd));
  }
  return p;
}

// (row, target[row]) pairs: (M, 2) s64.
Value NllPairs(Builder& b, const NllParts& p) {
  Value iota = b.Iota(TensorType{ElementType::kS64, {p.n, 1}}, 0);
  Value tcol = b.Reshape(p.target, std::vector<int64_t>{p.n, 1});
  Value both[] = {iota, tcol};
  return b.Concatenate(both, 1);
}

std::vector<Value> LowerNllLossForward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  NllParts p = NllPrepare(ctx, acc);
  const int64_t reduction = ctx.int_arg("reduction");
  if (p.n > 0) {
    // CPU: IndexError "Target 5 is out of bounds." for a target outside
    // [0, C) that is not ignore_index (the value is not named here).
    Value t = b.Reshape(Cast(b, ctx.tensor("target"), at::kLong), std::vector<int64_t>{p.n});
    Value out_of_range = b.Or(b.Compare(t, ConstLike(b, t, 0), CompareDirection::kLT),
                              b.Compare(t, ConstLike(b, t, static_cast<double>(p.c)), CompareDirection::kGE));
    ctx.check_index(ReduceOr(b, b.And(p.valid, out_of_range), std::vector<int64_t>{0}, false),
                    "Target is out of bounds (a class index outside [0, " + std::to_string(p.c) +
                        ") that is not ignore_index)");
  }
  if (p.n == 0) {
    ElementType e = ToElementType(acc);
    Value zero = Const(b, e, 0);
    Value r = reduction == 1 ? b.Div(zero, zero) : zero;  // mean of nothing: NaN
    return {Out(b, reduction == 0 ? Const(b, e, 0, out.sizes) : r, out), Out(b, zero, ctx.outputs[1])};
  }
  hlo::GatherDims g;
  g.collapsed_slice_dims = {0, 1};
  g.start_index_map = {0, 1};
  g.index_vector_dim = 1;
  int64_t ss[] = {1, 1};
  Value picked = b.Gather(p.x, NllPairs(b, p), g, ss, TensorType{p.x.element(), {p.n}});
  Value zero = ConstLike(b, picked, 0);
  Value loss = b.Select(p.valid, b.Neg(b.Mul(picked, p.w)), zero);
  int64_t all[] = {0};
  if (reduction == 0) {
    return {Out(b, loss, out), Unused(b, ctx.outputs[1])};
  }
  Value total = ReduceSum(b, p.w, all, false);
  Value s = ReduceSum(b, loss, all, false);
  if (reduction == 1) s = b.Div(s, total);
  return {Out(b, s, out), Out(b, total, ctx.outputs[1])};
}

std::vector<Value> LowerNllLossBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  NllParts p = NllPrepare(ctx, acc);
  ElementType e = ToElementType(acc);
  if (p.n == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  const int64_t reduction = ctx.int_arg("reduction");
  Value g = Cast(b, ctx.tensor("grad_output"), acc);
  int64_t nd[] = {p.n};
  if (reduction == 0) {
    g = b.Reshape(g, nd);
  } else {
    g = b.Reshape(g, std::vector<int64_t>{});
    if (reduction == 1) g = b.Div(g, b.Reshape(Cast(b, ctx.tensor("total_weight"), acc), std::vector<int64_t>{}));
    g = BroadcastTo(b, g, nd);
  }
  Value gi = b.Select(p.valid, b.Neg(b.Mul(g, p.w)), ConstLike(b, g, 0));
  // scatter -w*g into zeros at (row, target[row]); ignored rows add 0.
  hlo::ScatterDims s;
  s.inserted_window_dims = {0, 1};
  s.scatter_dims_to_operand_dims = {0, 1};
  s.index_vector_dim = 1;
  std::vector<int64_t> shape{p.n, p.c};
  Value grad = b.Scatter(Const(b, e, 0, shape), NllPairs(b, p), gi, s,
                         [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; });
  grad = b.Reshape(grad, p.moved_dims);
  std::vector<int64_t> inv(p.perm.size());
  for (size_t i = 0; i < p.perm.size(); ++i) inv[static_cast<size_t>(p.perm[i])] = static_cast<int64_t>(i);
  grad = b.Transpose(grad, inv);
  return {Out(b, grad, out)};
}

// ---------------------------------------------------------------------------
// mse_loss

std::vector<Value> LowerMseLoss(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  Value x = ctx.tensor("self"), t = ctx.tensor("target");
  std::vector<int64_t> shape = BroadcastShapes(x.dims(), t.dims());
  Value d = b.Sub(Prepare(b, x, acc, shape), Prepare(b, t, acc, shape));
  Value l = b.Mul(d, d);
  return {ReduceLoss(b, l, ctx.int_arg("reduction"), acc, out)};
}

// LoweringTraits::result_dtypes. CPU's mse_loss_backward and
// smooth_l1_loss_backward (`at::zeros_like(self)`, self = argument 1) and
// binary_cross_entropy (`at::empty({0}, input.options())`, argument 0)
// allocate result 0 like `self`.
template <size_t kSelf>
void ResultLikeSelf(std::span<const c10::IValue> args, std::span<at::ScalarType> dtypes) {
  if (kSelf < args.size() && args[kSelf].isTensor() && args[kSelf].toTensor().defined() && !dtypes.empty())
    dtypes[0] = args[kSelf].toTensor().scalar_type();
}

// CPU's layer_norm_cpu (aten/src/ATen/native/layer_norm.cpp): mean and rstd
// have param_scalar_type: float where weight or bias has another dtype
// than the input (mixed type), else the input's (BFloat16 for bf16).
void LayerNormResultDtypes(std::span<const c10::IValue> args, std::span<at::ScalarType> dtypes) {
  if (args.size() < 4 || !args[0].isTensor() || dtypes.size() < 3) return;
  const at::ScalarType in = args[0].toTensor().scalar_type();
  bool mixed = false;
  for (size_t i : {size_t{2}, size_t{3}})
    if (args[i].isTensor() && args[i].toTensor().defined() && args[i].toTensor().scalar_type() != in) mixed = true;
  // opmath_type of the input: float for bf16/f16, else the input's own.
  const bool reduced = in == at::kBFloat16 || in == at::kHalf;
  const at::ScalarType stats = mixed && reduced ? at::kFloat : in;
  dtypes[1] = dtypes[2] = stats;
}

std::vector<Value> LowerMseLossBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  Value x = ctx.tensor("self"), t = ctx.tensor("target");
  std::vector<int64_t> shape = BroadcastShapes(x.dims(), t.dims());
  shape = BroadcastShapes(shape, ctx.tensor("grad_output").dims());
  Value d = b.Sub(Prepare(b, x, acc, shape), Prepare(b, t, acc, shape));
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, shape);
  const int64_t reduction = ctx.int_arg("reduction");
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  double norm = reduction == 1 ? 2.0 / static_cast<double>(n) : 2.0;
  Value r = b.Mul(b.Mul(ConstLike(b, d, norm), d), g);
  return {Out(b, r, out)};
}

// ---------------------------------------------------------------------------
// embedding_dense_backward: scatter-add of grad rows into (num_weights, D).

std::vector<Value> LowerEmbeddingDenseBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType acc = Acc(out.dtype);
  Value grad = Cast(b, ctx.tensor("grad_output"), acc);
  Value idx = Cast(b, ctx.tensor("indices"), at::kLong);
  const int64_t num_weights = ctx.int_arg("num_weights");
  const int64_t padding_idx = ctx.int_arg("padding_idx");
  const bool by_freq = ctx.bool_arg("scale_grad_by_freq");
  const int64_t m = idx.type.numel();
  const int64_t d = grad.type.numel() / std::max<int64_t>(m, 1);
  std::vector<int64_t> result_shape{num_weights, d};
  ElementType e = ToElementType(acc);
  if (m == 0) return {Out(b, Const(b, e, 0, result_shape), out)};
  Value rows = b.Reshape(grad, std::vector<int64_t>{m, d});
  Value flat_idx = b.Reshape(idx, std::vector<int64_t>{m});
  std::vector<int64_t> md{m, d};
  int64_t bd0[] = {0};
  if (padding_idx >= 0) {
    Value pad = b.ConstantInt(TensorType{ElementType::kS64, {}}, padding_idx);
    Value keep = b.Compare(flat_idx, BroadcastTo(b, pad, std::vector<int64_t>{m}), CompareDirection::kNE);
    rows = b.Select(b.BroadcastInDim(keep, md, bd0), rows, Const(b, e, 0, md));
  }
  Value idx2 = b.Reshape(flat_idx, std::vector<int64_t>{m, 1});
  auto add = [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; };
  if (by_freq) {
    // counts[idx] for every occurrence, then divide each row by it.
    hlo::ScatterDims cs;
    cs.inserted_window_dims = {0};
    cs.scatter_dims_to_operand_dims = {0};
    cs.index_vector_dim = 1;
    Value counts = b.Scatter(Const(b, e, 0, std::vector<int64_t>{num_weights}), idx2,
                             Const(b, e, 1, std::vector<int64_t>{m}), cs, add);
    hlo::GatherDims g;
    g.collapsed_slice_dims = {0};
    g.start_index_map = {0};
    g.index_vector_dim = 1;
    int64_t ss[] = {1};
    Value freq = b.Gather(counts, idx2, g, ss, TensorType{e, {m}});
    rows = b.Div(rows, b.BroadcastInDim(freq, md, bd0));
  }
  hlo::ScatterDims s;
  s.update_window_dims = {1};
  s.inserted_window_dims = {0};
  s.scatter_dims_to_operand_dims = {0};
  s.index_vector_dim = 1;
  Value r = b.Scatter(Const(b, e, 0, result_shape), idx2, rows, s, add);
  return {Out(b, r, out)};
}

// ---------------------------------------------------------------------------
// Elementwise nn ops computed as PyTorch's CPU kernels do: in f32 for
// bf16/f16 (rounding once, or after each step where the CPU kernel runs in
// c10::BFloat16 arithmetic), in the dtype itself otherwise.

// One c10::BFloat16/Half operation: round an f32 value to `t` and back (no-op
// for float/double).
void RequireFloating(const LoweringContext& ctx, at::ScalarType t) {
  if (!at::isFloatingType(t))
    throw LoweringError(ctx.op_name() + ": expected a floating point input, got " + std::string(c10::toString(t)));
}

// glu(self, dim): a * sigmoid(b) where a, b are the halves of self along dim
// (its size must be even). Shapes: self (..., 2k, ...) -> (..., k, ...).
struct GluHalves {
  Value a, b;
  int64_t dim;
};
GluHalves SplitHalves(LoweringContext& ctx, const Value& x) {
  auto& b = ctx.b;
  if (x.rank() == 0) throw LoweringError(ctx.op_name() + ": glu does not support scalars because halving size must be even");
  const int64_t dim = NormalizeDim(ctx.int_arg("dim"), x.rank());
  const int64_t n = x.dims()[static_cast<size_t>(dim)];
  if (n % 2 != 0)
    throw LoweringError(ctx.op_name() + ": Halving dimension must be even, but dimension " + std::to_string(dim) +
                        " is size " + std::to_string(n));
  std::vector<int64_t> start(static_cast<size_t>(x.rank()), 0), mid = x.dims(), stride(static_cast<size_t>(x.rank()), 1);
  mid[static_cast<size_t>(dim)] = n / 2;
  std::vector<int64_t> start2 = start;
  start2[static_cast<size_t>(dim)] = n / 2;
  return {b.Slice(x, start, mid, stride), b.Slice(x, start2, x.dims(), stride), dim};
}

Value SigmoidOf(Builder& b, const Value& x) {
  Value one = ConstLike(b, x, 1);
  return b.Div(one, b.Add(one, b.Exp(b.Neg(x))));
}

std::vector<Value> LowerGlu(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  RequireFloating(ctx, out.dtype);
  Value x = Cast(b, ctx.tensor("self"), Acc(out.dtype));
  GluHalves h = SplitHalves(ctx, x);
  return {Out(b, b.Mul(h.a, SigmoidOf(b, h.b)), out)};
}

// glu_backward: d/da = g * s, d/db = g * a * s * (1 - s), s = sigmoid(b)
// (rounded to the dtype first, as the CPU kernel stores it), concatenated.
std::vector<Value> LowerGluBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  RequireFloating(ctx, out.dtype);
  at::ScalarType acc = Acc(out.dtype);
  Value x = Cast(b, ctx.tensor("self"), acc);
  GluHalves h = SplitHalves(ctx, x);
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, h.a.dims());
  Value sig = RoundTo(b, SigmoidOf(b, h.b), out.dtype);
  Value ga = b.Mul(sig, g);
  Value gb = b.Mul(b.Mul(b.Mul(b.Sub(ConstLike(b, sig, 1), sig), sig), h.a), g);
  Value parts[] = {ga, gb};
  return {Out(b, b.Concatenate(parts, h.dim), out)};
}

// log_sigmoid_forward: output = min(x, 0) - log1p(exp(-|x|)), buffer =
// exp(-|x|) (the CPU kernel's buffer; shapes as self).
std::vector<Value> LowerLogSigmoidForward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  RequireFloating(ctx, out.dtype);
  Value x = Cast(b, ctx.tensor("self"), Acc(out.dtype));
  Value z = b.Exp(b.Neg(b.Abs(x)));
  Value y = b.Sub(MinPropagateNaN(b, x, ConstLike(b, x, 0)), b.Unary("stablehlo.log_plus_one", z));
  const auto& buf = ctx.outputs[1];
  Value buffer = Numel(buf.sizes) == z.type.numel() ? Out(b, z, buf) : Unused(b, buf);
  return {Out(b, y, out), buffer};
}

// log_sigmoid_backward: (max_deriv - sign * z / (1 + z)) * g with
// max_deriv = x < 0, sign = x < 0 ? 1 : -1, z = buffer where it holds
// exp(-|x|) for every element (CPU), else recomputed.
std::vector<Value> LowerLogSigmoidBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  RequireFloating(ctx, out.dtype);
  at::ScalarType acc = Acc(out.dtype);
  Value x = Prepare(b, ctx.tensor("self"), acc, out.sizes);
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, out.sizes);
  Value z;
  const Value& buffer = ctx.tensor("buffer");
  if (buffer.dims() == out.sizes) {
    z = Cast(b, buffer, acc);
  } else {
    z = RoundTo(b, b.Exp(b.Neg(b.Abs(x))), out.dtype);
  }
  Value neg = b.Compare(x, ConstLike(b, x, 0), CompareDirection::kLT);
  Value max_deriv = b.Select(neg, ConstLike(b, x, 1), ConstLike(b, x, 0));
  Value sign = b.Select(neg, ConstLike(b, x, 1), ConstLike(b, x, -1));
  Value r = b.Mul(b.Sub(max_deriv, b.Mul(sign, b.Div(z, b.Add(ConstLike(b, z, 1), z)))), g);
  return {Out(b, r, out)};
}

// _prelu_kernel(self, weight): self > 0 ? self : weight * self (weight
// broadcast to self's shape by the caller, prelu).
std::vector<Value> LowerPreluKernel(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  RequireFloating(ctx, out.dtype);
  at::ScalarType acc = Acc(out.dtype);
  Value x = Prepare(b, ctx.tensor("self"), acc, out.sizes);
  Value w = Prepare(b, ctx.tensor("weight"), acc, out.sizes);
  Value pos = b.Compare(x, ConstLike(b, x, 0), CompareDirection::kGT);
  return {Out(b, b.Select(pos, x, b.Mul(w, x)), out)};
}

// _prelu_kernel_backward -> (grad_self, grad_weight), both of the broadcast
// shape (autograd sums grad_weight to weight's shape):
// grad_self = x > 0 ? g : w * g, grad_weight = x > 0 ? 0 : x * g.
std::vector<Value> LowerPreluKernelBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& o0 = ctx.outputs[0];
  const auto& o1 = ctx.outputs[1];
  RequireFloating(ctx, o0.dtype);
  at::ScalarType acc = Acc(o0.dtype);
  std::vector<int64_t> shape = BroadcastShapes(o0.sizes, o1.sizes);
  Value x = Prepare(b, ctx.tensor("self"), acc, shape);
  Value w = Prepare(b, ctx.tensor("weight"), acc, shape);
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, shape);
  Value pos = b.Compare(x, ConstLike(b, x, 0), CompareDirection::kGT);
  Value gx = b.Select(pos, g, b.Mul(w, g));
  Value gw = b.Select(pos, ConstLike(b, x, 0), b.Mul(x, g));
  return {Out(b, gx, o0), Out(b, gw, o1)};
}

// binary_cross_entropy(self, target, weight, reduction): per element
// (t - 1) * max(log1p(-x), -100) - t * max(log(x), -100), times weight, then
// none/mean/sum. As the CPU kernel, bf16/f16 round after every operation
// (c10::BFloat16 arithmetic) and the mean/sum accumulate in f32. CPU also
// raises for inputs outside [0, 1]; here such inputs give NaN (log of a
// negative) or finite garbage, with no error.
std::vector<Value> LowerBinaryCrossEntropy(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const at::ScalarType t = out.dtype;
  RequireFloating(ctx, t);
  at::ScalarType acc = Acc(t);
  Value x0 = ctx.tensor("self");
  const std::vector<int64_t> shape = x0.dims();
  Value x = Cast(b, x0, acc);
  Value y = Prepare(b, ctx.tensor("target"), acc, shape);
  {
    // CPU's check on the values (NaN fails it too): a value check.
    Value inside = b.And(b.Compare(x, ConstLike(b, x, 0), CompareDirection::kGE),
                         b.Compare(x, ConstLike(b, x, 1), CompareDirection::kLE));
    ctx.check(ReduceOr(b, b.Not(inside), ReductionDims({}, x.rank()), false),
              "all elements of input should be between 0 and 1");
  }
  auto r = [&](const Value& v) { return RoundTo(b, v, t); };
  Value floor = ConstLike(b, x, -100);
  Value log1m = MaxPropagateNaN(b, r(b.Unary("stablehlo.log_plus_one", b.Neg(x))), floor);
  Value logx = MaxPropagateNaN(b, r(b.Log(x)), floor);
  Value loss = r(b.Sub(r(b.Mul(r(b.Sub(y, ConstLike(b, y, 1))), log1m)), r(b.Mul(y, logx))));
  if (ctx.has("weight")) loss = r(b.Mul(loss, Prepare(b, ctx.tensor("weight"), acc, shape)));
  return {ReduceLoss(b, loss, ctx.int_arg("reduction"), t, out)};  // loss is already rounded to t
}

// binary_cross_entropy_backward: g * (x - t) / max((1 - x) * x, 1e-12),
// times weight, divided by numel for mean (each step rounded as the CPU
// kernel's scalar_t arithmetic).
std::vector<Value> LowerBinaryCrossEntropyBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const at::ScalarType t = out.dtype;
  RequireFloating(ctx, t);
  at::ScalarType acc = Acc(t);
  const std::vector<int64_t>& shape = out.sizes;
  Value x = Prepare(b, ctx.tensor("self"), acc, shape);
  Value y = Prepare(b, ctx.tensor("target"), acc, shape);
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, shape);
  auto r = [&](const Value& v) { return RoundTo(b, v, t); };
  Value denom = MaxPropagateNaN(b, r(b.Mul(r(b.Sub(ConstLike(b, x, 1), x)), x)), r(ConstLike(b, x, 1e-12)));
  Value gi = r(b.Div(r(b.Mul(g, r(b.Sub(x, y)))), denom));
  if (ctx.has("weight")) gi = r(b.Mul(gi, Prepare(b, ctx.tensor("weight"), acc, shape)));
  if (ctx.int_arg("reduction") == 1) gi = b.Div(gi, ConstLike(b, gi, static_cast<double>(Numel(shape))));
  return {Out(b, gi, out)};
}

// ---------------------------------------------------------------------------
// smooth_l1_loss / huber_loss (self, target of broadcastable shapes; float
// dtypes). Per element, z = |x - t|:
//   smooth_l1: z < beta ? 0.5 z^2 / beta : z - 0.5 beta  (beta == 0: z, as
//              CPU's l1_loss path; beta < 0 raises)
//   huber:     z < delta ? 0.5 z^2 : delta (z - 0.5 delta)  (delta <= 0 raises)
// computed in f32 for bf16/f16 and rounded to the dtype; then none/mean/sum
// (the sum accumulated in f32, as CPU's sum/mean of the loss tensor).

template <bool kHuber>
double LossParam(const LoweringContext& ctx) {
  const double v = ctx.float_arg(kHuber ? "delta" : "beta");
  if (kHuber && !(v > 0)) throw LoweringError(ctx.op_name() + ": huber_loss does not support non-positive values for delta.");
  if (!kHuber && v < 0) throw LoweringError(ctx.op_name() + ": smooth_l1_loss does not support negative values for beta.");
  return v;
}

template <bool kHuber>
std::vector<Value> LowerSmoothLoss(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const double beta = LossParam<kHuber>(ctx);
  at::ScalarType t = ResultType(ctx, {"self", "target"});
  RequireFloating(ctx, t);
  at::ScalarType acc = Acc(t);
  Value x = ctx.tensor("self"), y = ctx.tensor("target");
  std::vector<int64_t> shape = BroadcastShapes(x.dims(), y.dims());
  Value z = b.Abs(b.Sub(Prepare(b, x, acc, shape), Prepare(b, y, acc, shape)));
  Value half = ConstLike(b, z, 0.5), bt = ConstLike(b, z, beta);
  Value loss;
  if (kHuber) {
    loss = b.Select(b.Compare(z, bt, CompareDirection::kLT), b.Mul(b.Mul(half, z), z),
                    b.Mul(bt, b.Sub(z, b.Mul(half, bt))));
  } else if (beta == 0) {
    loss = z;
  } else {
    loss = b.Select(b.Compare(z, bt, CompareDirection::kLT), b.Div(b.Mul(b.Mul(half, z), z), bt),
                    b.Sub(z, b.Mul(half, bt)));
  }
  return {ReduceLoss(b, loss, ctx.int_arg("reduction"), t, out)};
}

// Backward, d = x - t, norm = 1/numel for mean else 1 (CPU's branch order):
//   smooth_l1: d <= -beta ? -norm g : d >= beta ? norm g : norm d g / beta
//   huber:     d <= -delta ? -norm g delta : d >= delta ? norm g delta : norm d g
template <bool kHuber>
std::vector<Value> LowerSmoothLossBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const double beta = LossParam<kHuber>(ctx);
  at::ScalarType t = out.dtype;
  RequireFloating(ctx, t);
  at::ScalarType acc = Acc(t);
  const std::vector<int64_t>& shape = out.sizes;
  Value x = Prepare(b, ctx.tensor("self"), acc, shape);
  Value y = Prepare(b, ctx.tensor("target"), acc, shape);
  Value g = Prepare(b, ctx.tensor("grad_output"), acc, shape);
  const double norm = ctx.int_arg("reduction") == 1 ? 1.0 / static_cast<double>(Numel(shape)) : 1.0;
  Value d = b.Sub(x, y);
  Value ng = b.Mul(ConstLike(b, g, norm), g);
  Value edge = kHuber ? b.Mul(ng, ConstLike(b, g, beta)) : ng;
  Value mid = kHuber ? b.Mul(ng, d) : b.Div(b.Mul(ng, d), ConstLike(b, d, beta));
  Value r = b.Select(b.Compare(d, ConstLike(b, d, beta), CompareDirection::kGE), edge, mid);
  r = b.Select(b.Compare(d, ConstLike(b, d, -beta), CompareDirection::kLE), b.Neg(edge), r);
  return {Out(b, r, out)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"_softmax", LowerSoftmax},
    {"_log_softmax", LowerLogSoftmax},
    {"_softmax_backward_data", LowerSoftmaxBackward},
    {"_log_softmax_backward_data", LowerLogSoftmaxBackward},
    {"native_layer_norm", LowerLayerNorm, {.result_dtypes = LayerNormResultDtypes}},
    {"native_layer_norm_backward", LowerLayerNormBackward},
    {"native_batch_norm", LowerBatchNorm},
    {"_native_batch_norm_legit", LowerBatchNorm},
    {"_native_batch_norm_legit_no_training", LowerBatchNorm},
    {"native_batch_norm_backward", LowerBatchNormBackward},
    // poly_flat: output and mask element i depend only on (seed, offset + i)
    // and input element i (compiled_op.cpp PlanPolyFlat).
    {"native_dropout", LowerNativeDropout, {.needs_rng = true, .poly_flat = true}},
    {"native_dropout_backward", LowerNativeDropoutBackward},
    {"nll_loss_forward", LowerNllLossForward},
    {"nll_loss_backward", LowerNllLossBackward},
    {"nll_loss2d_forward", LowerNllLossForward},
    {"nll_loss2d_backward", LowerNllLossBackward},
    {"mse_loss", LowerMseLoss},
    {"mse_loss_backward", LowerMseLossBackward, {.result_dtypes = ResultLikeSelf<1>}},
    {"embedding_dense_backward", LowerEmbeddingDenseBackward},
    {"glu", LowerGlu},
    {"glu_backward", LowerGluBackward},
    {"log_sigmoid_forward", LowerLogSigmoidForward},
    {"log_sigmoid_backward", LowerLogSigmoidBackward},
    {"_prelu_kernel", LowerPreluKernel},
    {"_prelu_kernel_backward", LowerPreluKernelBackward},
    {"binary_cross_entropy", LowerBinaryCrossEntropy, {.result_dtypes = ResultLikeSelf<0>}},
    {"binary_cross_entropy_backward", LowerBinaryCrossEntropyBackward},
    {"smooth_l1_loss", LowerSmoothLoss<false>},
    {"smooth_l1_loss_backward", LowerSmoothLossBackward<false>, {.result_dtypes = ResultLikeSelf<1>}},
    {"huber_loss", LowerSmoothLoss<true>},
    {"huber_loss_backward", LowerSmoothLossBackward<true>},
});

}  // namespace torch_tpu::lowering
