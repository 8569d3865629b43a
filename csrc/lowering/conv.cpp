// Convolutions: aten::convolution (1d/2d/3d, stride, padding, dilation,
// groups, transposed with output_padding) and convolution_backward, plus the
// names PyTorch's backend selection routes the same computation to for
// out-of-tree devices (convolution_overrideable,
// convolution_backward_overrideable). F.conv*d reach aten::convolution
// through the CompositeImplicit conv*d/_convolution kernels.
//
// Layout is PyTorch's: input (N, C, *spatial), weight (C_out, C_in/groups,
// *k), or (C_in, C_out/groups, *k) when transposed. bf16/f16 operands are
// widened to f32 (exact), convolved with f32 accumulation at HIGHEST
// precision and rounded once, as PyTorch's CPU kernels do.
//
// Transposed convolutions (and the input gradient) are convolutions of the
// stride-dilated input with the spatially flipped kernel; the weight
// gradient is a convolution that contracts over the batch, with
// batch_group_count = groups.
#include <algorithm>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::ConvDims;



// A per-spatial-dim parameter: PyTorch accepts one value for all dims.
std::vector<int64_t> Expand(std::vector<int64_t> v, size_t n, int64_t fill) {
  if (v.empty()) v.assign(n, fill);
  if (v.size() == 1 && n > 1) v.assign(n, v[0]);
  if (v.size() != n) throw LoweringError("convolution: parameter has " + std::to_string(v.size()) +
                                         " values for " + std::to_string(n) + " spatial dims");
  return v;
}

struct ConvParams {
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;
};

ConvParams ReadParams(const LoweringContext& ctx, size_t nsp) {
  ConvParams p;
  p.stride = Expand(ctx.ints("stride"), nsp, 1);
  p.padding = Expand(ctx.ints("padding"), nsp, 0);
  p.dilation = Expand(ctx.ints("dilation"), nsp, 1);
  p.transposed = ctx.has("transposed") && ctx.bool_arg("transposed");
  p.output_padding = Expand(ctx.has("output_padding") ? ctx.ints("output_padding") : std::vector<int64_t>{},
                            nsp, 0);
  p.groups = ctx.has("groups") ? ctx.int_arg("groups") : 1;
  return p;
}

ConvDims StandardDims(size_t nsp) {
  ConvDims d;
  d.input_batch = 0;
  d.input_feature = 1;
  d.kernel_output_feature = 0;
  d.kernel_input_feature = 1;
  d.output_batch = 0;
  d.output_feature = 1;
  for (size_t i = 0; i < nsp; ++i) {
    d.input_spatial.push_back(static_cast<int64_t>(i + 2));
    d.kernel_spatial.push_back(static_cast<int64_t>(i + 2));
    d.output_spatial.push_back(static_cast<int64_t>(i + 2));
  }
  return d;
}

Value Widen(Builder& b, const Value& v, ElementType acc) { return b.Convert(v, acc); }

// Accumulation type: f32 for bf16/f16, the dtype itself otherwise (integer
// convolutions accumulate exactly in their own type, as CPU does).
ElementType AccOf(at::ScalarType out) { return ToElementType(OpMathType(out)); }

// Plain (forward) convolution with symmetric `padding`; the output's spatial
// sizes follow from the operands.
Value ConvForward(Builder& b, const Value& x, const Value& w, const std::vector<int64_t>& stride,
                  const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation,
                  int64_t groups) {
  const size_t nsp = static_cast<size_t>(x.rank() - 2);
  std::vector<std::pair<int64_t, int64_t>> pad;
  std::vector<int64_t> dims{x.dims()[0], w.dims()[0]};
  for (size_t i = 0; i < nsp; ++i) {
    pad.emplace_back(padding[i], padding[i]);
    int64_t in = x.dims()[i + 2] + 2 * padding[i];
    int64_t win = (w.dims()[i + 2] - 1) * dilation[i] + 1;
    dims.push_back(in < win ? 0 : (in - win) / stride[i] + 1);
  }
  std::vector<int64_t> ones(nsp, 1);
  return b.Convolution(x, w, StandardDims(nsp), stride, pad, ones, dilation, groups, 1,
                       TensorType{x.element(), dims});
}

// Transposed convolution of x (N, C_in, *s) with a weight in PyTorch's
// transposed layout (C_in, C_out/groups, *k), producing spatial sizes
// `out_spatial` (= (s-1)*stride - 2p + dilation*(k-1) + 1 + output_padding).
Value ConvTransposed(Builder& b, const Value& x, const Value& w, const std::vector<int64_t>& stride,
                     const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation,
                     int64_t groups, const std::vector<int64_t>& out_spatial) {
  const size_t nsp = static_cast<size_t>(x.rank() - 2);
  const int64_t cin = w.dims()[0], cout_g = w.dims()[1];
  // Kernel in forward layout (C_out, C_in/groups, *k), spatially flipped.
  Value k = w;
  if (groups == 1) {
    std::vector<int64_t> perm{1, 0};
    for (size_t i = 0; i < nsp; ++i) perm.push_back(static_cast<int64_t>(i + 2));
    k = b.Transpose(k, perm);
  } else {
    std::vector<int64_t> split{groups, cin / groups, cout_g};
    for (size_t i = 0; i < nsp; ++i) split.push_back(w.dims()[i + 2]);
    k = b.Reshape(k, split);
    std::vector<int64_t> perm{0, 2, 1};
    for (size_t i = 0; i < nsp; ++i) perm.push_back(static_cast<int64_t>(i + 3));
    k = b.Transpose(k, perm);
    std::vector<int64_t> merged{groups * cout_g, cin / groups};
    for (size_t i = 0; i < nsp; ++i) merged.push_back(w.dims()[i + 2]);
    k = b.Reshape(k, merged);
  }
  std::vector<int64_t> sp;
  for (size_t i = 0; i < nsp; ++i) sp.push_back(static_cast<int64_t>(i + 2));
  k = b.Reverse(k, sp);

  // Padding of the stride-dilated input; negative amounts are cropped from
  // the output afterwards (the window stride is 1, so cropping the output
  // equals cropping the input).
  std::vector<std::pair<int64_t, int64_t>> pad;
  std::vector<int64_t> crop_lo(nsp, 0), full{x.dims()[0], groups * cout_g};
  bool crop = false;
  for (size_t i = 0; i < nsp; ++i) {
    int64_t kk = (w.dims()[i + 2] - 1) * dilation[i];
    int64_t dilated = (x.dims()[i + 2] - 1) * stride[i] + 1;
    int64_t lo = kk - padding[i];
    int64_t hi = out_spatial[i] + kk - dilated - lo;
    if (x.dims()[i + 2] == 0) dilated = 0;
    crop_lo[i] = lo < 0 ? -lo : 0;
    int64_t lo_p = std::max<int64_t>(lo, 0), hi_p = std::max<int64_t>(hi, 0);
    crop |= lo < 0 || hi < 0;
    pad.emplace_back(lo_p, hi_p);
    int64_t len = dilated + lo_p + hi_p - kk;
    full.push_back(std::max<int64_t>(len, 0));
  }
  std::vector<int64_t> ones(nsp, 1);
  Value y = b.Convolution(x, k, StandardDims(nsp), ones, pad, stride, dilation, groups, 1,
                          TensorType{x.element(), full});
  if (crop) {
    std::vector<int64_t> start{0, 0}, limit{full[0], full[1]}, step(nsp + 2, 1);
    for (size_t i = 0; i < nsp; ++i) {
      start.push_back(crop_lo[i]);
      limit.push_back(crop_lo[i] + out_spatial[i]);
    }
    y = b.Slice(y, start, limit, step);
  }
  return y;
}

// Gradient of a forward convolution's weight: x (N, C_in, *s), gy
// (N, C_out, *o) -> (C_out, C_in/groups, *k).
Value ConvWeightGrad(Builder& b, Value x, const Value& gy, const std::vector<int64_t>& stride,
                     const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation,
                     int64_t groups, const std::vector<int64_t>& kernel) {
  const size_t nsp = static_cast<size_t>(x.rank() - 2);
  // Input elements past the last window are never read: slice them off so
  // the high padding is never negative.
  std::vector<std::pair<int64_t, int64_t>> pad;
  std::vector<int64_t> limit = x.dims();
  bool slice = false;
  for (size_t i = 0; i < nsp; ++i) {
    int64_t o = gy.dims()[i + 2];
    int64_t hi = (kernel[i] - 1) * dilation[i] + (o - 1) * stride[i] + 1 - x.dims()[i + 2] - padding[i];
    if (hi < 0) {
      limit[i + 2] = x.dims()[i + 2] + hi;
      slice = true;
      hi = 0;
    }
    pad.emplace_back(padding[i], hi);
  }
  if (slice) {
    std::vector<int64_t> start(nsp + 2, 0), step(nsp + 2, 1);
    x = b.Slice(x, start, limit, step);
  }
  ConvDims d;
  d.input_batch = 1;    // C_in plays the batch
  d.input_feature = 0;  // N is contracted
  d.kernel_input_feature = 0;
  d.kernel_output_feature = 1;
  d.output_batch = 1;
  d.output_feature = 0;
  std::vector<int64_t> dims{gy.dims()[1], x.dims()[1] / groups};
  for (size_t i = 0; i < nsp; ++i) {
    d.input_spatial.push_back(static_cast<int64_t>(i + 2));
    d.kernel_spatial.push_back(static_cast<int64_t>(i + 2));
    d.output_spatial.push_back(static_cast<int64_t>(i + 2));
    dims.push_back(kernel[i]);
  }
  std::vector<int64_t> ones(nsp, 1);
  return b.Convolution(x, gy, d, dilation, pad, ones, stride, 1, groups, TensorType{x.element(), dims});
}

Value AddBias(Builder& b, const Value& y, const Value& bias) {
  std::vector<int64_t> bd{1};
  return b.Add(y, b.BroadcastInDim(bias, y.dims(), bd));
}

std::vector<Value> LowerConvolution(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  ElementType acc = AccOf(out.dtype);
  if (acc == ElementType::kPred || hlo::IsComplex(acc))
    throw LoweringError(ctx.op_name() + ": bool and complex convolutions are not lowered");
  Value x = Widen(b, ctx.tensor("input"), acc);
  Value w = Widen(b, ctx.tensor("weight"), acc);
  if (x.rank() < 3 || w.rank() != x.rank())
    throw LoweringError(ctx.op_name() + ": expects batched input with a weight of the same rank");
  const size_t nsp = static_cast<size_t>(x.rank() - 2);
  ConvParams p = ReadParams(ctx, nsp);
  // CPU's argument checks (ConvParams in aten/src/ATen/native/Convolution.cpp), same messages.
  for (int64_t v : p.padding) TORCH_CHECK(v >= 0, "negative padding is not supported");
  for (int64_t v : p.stride) TORCH_CHECK(v > 0, "non-positive stride is not supported");
  for (int64_t v : p.dilation) TORCH_CHECK(v > 0, "dilation should be greater than zero");
  if (x.type.numel() == 0 || Numel(out.sizes) == 0) return {Const(b, acc, 0, out.sizes)};
  Value y;
  if (p.transposed) {
    std::vector<int64_t> osp(out.sizes.begin() + 2, out.sizes.end());
    y = ConvTransposed(b, x, w, p.stride, p.padding, p.dilation, p.groups, osp);
  } else {
    y = ConvForward(b, x, w, p.stride, p.padding, p.dilation, p.groups);
  }
  if (ctx.has("bias")) y = AddBias(b, y, Widen(b, ctx.tensor("bias"), acc));
  return {Cast(b, y, out.dtype)};
}

std::vector<Value> LowerConvolutionBackward(LoweringContext& ctx) {
  auto& b = ctx.b;
  auto mask = ctx.bools("output_mask", 3);
  const Value& x_in = ctx.tensor("input");
  at::ScalarType xt = ctx.arg("input").dtype;
  ElementType acc = AccOf(xt);
  if (acc == ElementType::kPred || hlo::IsComplex(acc))
    throw LoweringError(ctx.op_name() + ": bool and complex convolutions are not lowered");
  Value x = Widen(b, x_in, acc);
  Value w = Widen(b, ctx.tensor("weight"), acc);
  Value gy = Widen(b, ctx.tensor("grad_output"), acc);
  if (x.rank() < 3 || w.rank() != x.rank())
    throw LoweringError(ctx.op_name() + ": expects batched input with a weight of the same rank");
  const size_t nsp = static_cast<size_t>(x.rank() - 2);
  ConvParams p = ReadParams(ctx, nsp);
  std::vector<int64_t> in_sp(x.dims().begin() + 2, x.dims().end());
  std::vector<int64_t> k_sp(w.dims().begin() + 2, w.dims().end());
  const bool empty = x.type.numel() == 0 || gy.type.numel() == 0 || w.type.numel() == 0;

  std::vector<Value> results(3);
  // Returns output_mask leaves undefined get a placeholder the executor drops.
  auto placeholder = [&](size_t i) {
    at::ScalarType t = ctx.outputs[i].dtype == at::ScalarType::Undefined ? at::kFloat : ctx.outputs[i].dtype;
    return Const(b, ToElementType(t), 0, ctx.outputs[i].sizes);
  };
  // grad_input
  if (mask[0] && !empty) {
    Value gi;
    if (p.transposed) {
      // output_padding rows were never read from the input: the forward
      // convolution of the gradient may produce them; drop them.
      gi = ConvForward(b, gy, w, p.stride, p.padding, p.dilation, p.groups);
      if (gi.dims() != x.dims()) {
        std::vector<int64_t> st(nsp + 2, 0), step(nsp + 2, 1);
        gi = b.Slice(gi, st, x.dims(), step);
      }
    } else {
      gi = ConvTransposed(b, gy, w, p.stride, p.padding, p.dilation, p.groups, in_sp);
    }
    results[0] = Cast(b, gi, ctx.outputs[0].dtype);
  } else {
    results[0] = placeholder(0);
  }
  // grad_weight
  if (mask[1] && !empty) {
    Value gw = p.transposed ? ConvWeightGrad(b, gy, x, p.stride, p.padding, p.dilation, p.groups, k_sp)
                            : ConvWeightGrad(b, x, gy, p.stride, p.padding, p.dilation, p.groups, k_sp);
    results[1] = Cast(b, gw, ctx.outputs[1].dtype);
  } else {
    results[1] = placeholder(1);
  }
  // grad_bias
  if (mask[2] && gy.type.numel() > 0) {
    std::vector<int64_t> dims{0};
    for (size_t i = 0; i < nsp; ++i) dims.push_back(static_cast<int64_t>(i + 2));
    results[2] = Cast(b, ReduceSum(b, gy, dims, false), ctx.outputs[2].dtype);
  } else {
    results[2] = placeholder(2);
  }
  return results;
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"convolution", LowerConvolution},
    {"convolution_overrideable", LowerConvolution},
    {"convolution_backward", LowerConvolutionBackward},
    {"convolution_backward_overrideable", LowerConvolutionBackward},
});

}  // namespace torch_tpu::lowering
