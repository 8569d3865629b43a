// Pooling and resampling: max_pool{2,3}d_with_indices (+backward),
// avg_pool{2,3}d (+backward; ceil_mode, count_include_pad,
// divisor_override), _adaptive_avg_pool{2,3}d (+backward),
// adaptive_max_pool{2,3}d (+backward), upsample_nearest{1,2,3}d and
// _upsample_nearest_exact{1,2,3}d (+backward), upsample_linear1d,
// upsample_bilinear2d, upsample_trilinear3d, upsample_bicubic2d (+backward;
// align_corners), max_unpool{2,3}d.
//
// The pooled dims are the trailing spatial dims; everything before them
// (N, C or just C) is batch. Max pooling returns PyTorch's indices: flat
// offsets into the input's spatial plane (h * W + w), choosing the first
// maximum of a window and NaN over any number (the last NaN, as the CPU
// kernel's `val > max || isnan(val)` does). The choice is a total order, so
// the result does not depend on XLA's reduction order.
//
// Window geometry (output sizes, ceil_mode) comes from the meta kernel's
// output sizes; divisors, adaptive windows and interpolation indices/weights
// are computed here at lowering time with the CPU kernels' float formulas
// and enter the program as constants. Floating math runs in the op-math type
// (f32 for bf16/f16) and rounds once.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;


std::vector<int64_t> Expand(const LoweringContext& ctx, std::vector<int64_t> v, size_t n,
                            const std::vector<int64_t>& fallback) {
  if (v.empty()) v = fallback;
  if (v.size() == 1 && n > 1) v.assign(n, v[0]);
  if (v.size() != n)
    throw LoweringError(ctx.op_name() + ": expected " + std::to_string(n) + " values per parameter");
  return v;
}

std::optional<double> OptFloat(const LoweringContext& ctx, std::string_view name) {
  const LoweredArg* a = ctx.find(name);
  if (!a || a->ivalue.isNone()) return std::nullopt;
  if (a->ivalue.isDouble()) return a->ivalue.toDouble();
  if (a->ivalue.isInt()) return static_cast<double>(a->ivalue.toInt());
  return std::nullopt;
}

std::string F32Literal(float f) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08X", std::bit_cast<uint32_t>(f));
  return buf;
}

// A rank-1 f32 constant with the given elements.
Value DenseF32(Builder& b, const std::vector<float>& v) {
  TensorType t{ElementType::kF32, {static_cast<int64_t>(v.size())}};
  std::string attr = "value = dense<";
  if (!v.empty()) {
    attr += "[";
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) attr += ", ";
      attr += F32Literal(v[i]);
    }
    attr += "]";
  }
  attr += "> : " + t.ToString();
  std::vector<TensorType> types{t};
  return b.Op("stablehlo.constant", {}, types, attr)[0];
}

// Broadcasts a rank-1 vector along dimension `dim` of `dims`.
Value AlongDim(Builder& b, const Value& v, std::span<const int64_t> dims, int64_t dim) {
  int64_t bd[] = {dim};
  return b.BroadcastInDim(v, dims, bd);
}

// x gathered along `dim` at the static positions `idx` (one output element
// per entry).
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

// x gathered along `dim` with a (O, K) index value: the dim becomes (O, K).
Value GatherWindows(Builder& b, const Value& x, int64_t dim, const Value& idx) {
  const int64_t o = idx.dims()[0], k = idx.dims()[1];
  int64_t idims[] = {o, k, 1};
  Value iv = b.Reshape(idx, idims);
  hlo::GatherDims g;
  std::vector<int64_t> slice = x.dims(), rdims;
  slice[static_cast<size_t>(dim)] = 1;
  for (int64_t d = 0; d < x.rank(); ++d) {
    if (d == dim) {
      rdims.push_back(o);
      rdims.push_back(k);
    } else {
      g.offset_dims.push_back(d < dim ? d : d + 1);
      rdims.push_back(x.dims()[static_cast<size_t>(d)]);
    }
  }
  g.collapsed_slice_dims = {dim};
  g.start_index_map = {dim};
  g.index_vector_dim = 2;
  return b.Gather(x, iv, g, slice, TensorType{x.element(), rdims});
}

// Contracts x's dimension `dim` (size X) with m (X, Y) and puts Y at `dim`.
Value ContractDim(Builder& b, const Value& x, int64_t dim, const Value& m) {
  hlo::DotDims dd;
  dd.lhs_contract = {dim};
  dd.rhs_contract = {0};
  Value r = b.DotGeneral(x, m, dd, x.element());  // (other dims..., Y)
  std::vector<int64_t> perm;
  const int64_t rank = x.rank();
  for (int64_t d = 0; d < rank; ++d) {
    if (d == dim) perm.push_back(rank - 1);
    else perm.push_back(d < dim ? d : d - 1);
  }
  return b.Transpose(r, perm);
}

// A (rows, cols) f32 matrix: 1 where col == idx[row] (one-hot rows).
Value OneHotRows(Builder& b, const std::vector<int64_t>& idx, int64_t cols) {
  int64_t rows = static_cast<int64_t>(idx.size());
  std::vector<int64_t> dims{rows, cols};
  TensorType it{ElementType::kS64, dims};
  Value sel = AlongDim(b, b.ConstantI64Vector(idx), dims, 0);
  Value eq = b.Compare(b.Iota(it, 1), sel, CompareDirection::kEQ);
  return b.Convert(eq, ElementType::kF32);
}

Value CastTo(Builder& b, const Value& v, ElementType t) { return hlo::IsFloating(t) ? b.Convert(v, t) : v; }

double LowestOf(ElementType t) {
  if (hlo::IsFloating(t)) return -std::numeric_limits<double>::infinity();
  switch (t) {
    case ElementType::kS8: return -128;
    case ElementType::kS16: return -32768;
    case ElementType::kS32: return -2147483648.0;
    case ElementType::kS64: return static_cast<double>(std::numeric_limits<int64_t>::min());
    default: return 0;
  }
}

Value LowestConst(Builder& b, ElementType t) {
  if (t == ElementType::kS64) return b.ConstantInt(TensorType{t, {}}, std::numeric_limits<int64_t>::min());
  return Const(b, t, LowestOf(t));
}

// --- argmax windows -------------------------------------------------------

// Combines (value, index) pairs: NaN beats everything (between NaNs the
// larger index), then the larger value, then the smaller index.
std::vector<Value> ArgmaxBody(Builder& bb, std::span<const Value> a) {
  const Value &av = a[0], &ai = a[1], &bv = a[2], &bi = a[3];
  Value gt = bb.Compare(bv, av, CompareDirection::kGT);
  Value eq = bb.Compare(bv, av, CompareDirection::kEQ);
  Value bi_lt = bb.Compare(bi, ai, CompareDirection::kLT);
  Value pick_b = bb.Or(gt, bb.And(eq, bi_lt));
  if (hlo::IsFloating(av.element())) {
    Value a_nan = bb.Compare(av, av, CompareDirection::kNE);
    Value b_nan = bb.Compare(bv, bv, CompareDirection::kNE);
    Value bi_gt = bb.Compare(bi, ai, CompareDirection::kGT);
    Value both = bb.And(a_nan, b_nan);
    // b NaN, a not: b. a NaN, b not: a. both: larger index. neither: pick_b.
    Value nan_pick = bb.Select(both, bi_gt, b_nan);
    pick_b = bb.Select(bb.Or(a_nan, b_nan), nan_pick, pick_b);
  }
  return {bb.Select(pick_b, bv, av), bb.Select(pick_b, bi, ai)};
}

// Flat index of each element in its trailing `nsp`-dim spatial plane.
Value SpatialIota(Builder& b, std::span<const int64_t> dims, size_t nsp) {
  TensorType it{ElementType::kS64, {dims.begin(), dims.end()}};
  const size_t first = dims.size() - nsp;
  Value idx;
  int64_t stride = 1;
  for (size_t j = dims.size(); j-- > first;) {
    Value term = b.Iota(it, static_cast<int64_t>(j));
    if (stride != 1) term = b.Mul(term, Const(b, ElementType::kS64, static_cast<double>(stride), it.dims));
    idx = idx.name.empty() ? term : b.Add(idx, term);
    stride *= dims[j];
  }
  return idx;
}

// --- max pool ---------------------------------------------------------------

struct PoolGeom {
  size_t nsp = 2;
  std::vector<int64_t> kernel, stride, padding, dilation;
};

PoolGeom ReadPoolGeom(const LoweringContext& ctx, size_t nsp, bool has_dilation) {
  PoolGeom g;
  g.nsp = nsp;
  g.kernel = Expand(ctx, ctx.ints("kernel_size"), nsp, {});
  g.stride = Expand(ctx, ctx.ints("stride"), nsp, g.kernel);
  g.padding = Expand(ctx, ctx.ints("padding"), nsp, {0});
  g.dilation = has_dilation ? Expand(ctx, ctx.ints("dilation"), nsp, {1}) : std::vector<int64_t>(nsp, 1);
  return g;
}

// reduce_window parameters for pooling x (trailing nsp dims) into
// `out_sizes`; the high padding reaches the last (ceil_mode) window.
struct WindowSpec {
  std::vector<int64_t> window, strides, base_dil, win_dil;
  std::vector<std::pair<int64_t, int64_t>> padding;
};

WindowSpec MakeWindow(const PoolGeom& g, std::span<const int64_t> in, std::span<const int64_t> out) {
  WindowSpec w;
  const size_t rank = in.size(), first = rank - g.nsp;
  for (size_t d = 0; d < rank; ++d) {
    if (d < first) {
      w.window.push_back(1);
      w.strides.push_back(1);
      w.base_dil.push_back(1);
      w.win_dil.push_back(1);
      w.padding.emplace_back(0, 0);
      continue;
    }
    size_t j = d - first;
    int64_t span = (g.kernel[j] - 1) * g.dilation[j] + 1;
    int64_t hi = (out[d] - 1) * g.stride[j] + span - in[d] - g.padding[j];
    w.window.push_back(g.kernel[j]);
    w.strides.push_back(g.stride[j]);
    w.base_dil.push_back(1);
    w.win_dil.push_back(g.dilation[j]);
    w.padding.emplace_back(g.padding[j], std::max<int64_t>(hi, 0));
  }
  return w;
}

std::vector<Value> MaxPoolWithIndices(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  Value x = ctx.tensor("self");
  const auto& out = ctx.outputs[0];
  if (x.rank() < static_cast<int64_t>(nsp) + 1)
    throw LoweringError(ctx.op_name() + ": unexpected input rank");
  if (Numel(out.sizes) == 0)
    return {Const(b, ToElementType(out.dtype), 0, out.sizes), Const(b, ElementType::kS64, 0, out.sizes)};
  PoolGeom g = ReadPoolGeom(ctx, nsp, true);
  WindowSpec w = MakeWindow(g, x.dims(), out.sizes);
  Value idx = SpatialIota(b, x.dims(), nsp);
  Value inputs[] = {x, idx};
  Value inits[] = {LowestConst(b, x.element()),
                   b.ConstantInt(TensorType{ElementType::kS64, {}}, std::numeric_limits<int64_t>::max())};
  auto r = b.ReduceWindow(inputs, inits, w.window, w.strides, w.base_dil, w.win_dil, w.padding, ArgmaxBody);
  return {Cast(b, r[0], out.dtype), r[1]};
}

std::vector<Value> LowerMaxPool2d(LoweringContext& ctx) { return MaxPoolWithIndices(ctx, 2); }
std::vector<Value> LowerMaxPool3d(LoweringContext& ctx) { return MaxPoolWithIndices(ctx, 3); }

// grad_input: grad_output scatter-added at the indices (flat offsets into
// each plane of the trailing `nsp` dims of self).
std::vector<Value> MaxPoolBackward(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = ctx.tensor("self");
  ElementType acc = ToElementType(OpMathType(out.dtype));
  Value gy = CastTo(b, ctx.tensor("grad_output"), acc);
  Value idx = Cast(b, ctx.tensor("indices"), at::kLong);
  const std::vector<int64_t>& in = self.dims();
  if (self.type.numel() == 0 || gy.type.numel() == 0) return {Const(b, acc, 0, out.sizes)};
  const size_t first = in.size() - nsp;
  int64_t plane = 1, batch = 1;
  for (size_t d = first; d < in.size(); ++d) plane *= in[d];
  for (size_t d = 0; d < first; ++d) batch *= in[d];
  gy = BroadcastTo(b, gy, idx.dims());
  // Global offset = batch index * plane + idx.
  std::vector<int64_t> gdims = idx.dims();
  int64_t per_batch = 1;
  for (size_t d = first; d < gdims.size(); ++d) per_batch *= gdims[d];
  int64_t m = batch * per_batch;
  int64_t flat2[] = {batch, per_batch};
  Value idx2 = b.Reshape(idx, flat2);
  TensorType bt{ElementType::kS64, {batch, per_batch}};
  Value base = b.Mul(b.Iota(bt, 0), Const(b, ElementType::kS64, static_cast<double>(plane), bt.dims));
  int64_t flat_idx[] = {m, 1};
  Value gidx = b.Reshape(b.Add(base, idx2), flat_idx);
  int64_t flat_m[] = {m};
  Value upd = b.Reshape(gy, flat_m);
  Value zeros = Const(b, acc, 0, std::vector<int64_t>{batch * plane});
  hlo::ScatterDims sd;
  sd.inserted_window_dims = {0};
  sd.scatter_dims_to_operand_dims = {0};
  sd.index_vector_dim = 1;
  Value r = b.Scatter(zeros, gidx, upd, sd, [](Builder& bb, std::span<const Value> a) {
    return std::vector<Value>{bb.Add(a[0], a[1])};
  });
  return {Cast(b, b.Reshape(r, in), out.dtype)};
}

std::vector<Value> LowerMaxPool2dBackward(LoweringContext& ctx) { return MaxPoolBackward(ctx, 2); }
std::vector<Value> LowerMaxPool3dBackward(LoweringContext& ctx) { return MaxPoolBackward(ctx, 3); }

// --- avg pool -------------------------------------------------------------

// Per-dim divisor factors of avg_pool, as the CPU kernel computes them.
struct AvgDivisors {
  std::vector<std::vector<int64_t>> include_pad, exclude_pad;  // per spatial dim, per output
};

AvgDivisors ComputeAvgDivisors(const PoolGeom& g, std::span<const int64_t> in, std::span<const int64_t> out) {
  AvgDivisors dv;
  const size_t first = in.size() - g.nsp;
  for (size_t j = 0; j < g.nsp; ++j) {
    std::vector<int64_t> inc, exc;
    int64_t size = in[first + j], pad = g.padding[j];
    for (int64_t o = 0; o < out[first + j]; ++o) {
      int64_t start = o * g.stride[j] - pad;
      int64_t end = std::min(start + g.kernel[j], size + pad);
      inc.push_back(end - start);
      int64_t s = std::max<int64_t>(start, 0), e = std::min(end, size);
      exc.push_back(std::max<int64_t>(e - s, 0));
    }
    dv.include_pad.push_back(std::move(inc));
    dv.exclude_pad.push_back(std::move(exc));
  }
  return dv;
}

// The divisor of each output element (broadcast over batch dims), in `t`.
Value AvgDivisor(LoweringContext& ctx, const PoolGeom& g, std::span<const int64_t> in,
                 std::span<const int64_t> out, ElementType t) {
  auto& b = ctx.b;
  std::vector<int64_t> odims(out.begin(), out.end());
  if (ctx.has("divisor_override")) {
    int64_t d = ctx.int_arg("divisor_override");
    if (d == 0) throw LoweringError(ctx.op_name() + ": divisor must be not zero");
    return Const(b, t, static_cast<double>(d), odims);
  }
  const bool include = !ctx.has("count_include_pad") || ctx.bool_arg("count_include_pad");
  AvgDivisors dv = ComputeAvgDivisors(g, in, out);
  const size_t first = in.size() - g.nsp;
  Value div;
  for (size_t j = 0; j < g.nsp; ++j) {
    Value v = AlongDim(b, b.ConstantI64Vector(include ? dv.include_pad[j] : dv.exclude_pad[j]), odims,
                       static_cast<int64_t>(first + j));
    div = div.name.empty() ? v : b.Mul(div, v);
  }
  return b.Convert(div, t);
}

std::vector<Value> AvgPool(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (Numel(out.sizes) == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  ElementType acc = hlo::IsFloating(x.element()) ? ToElementType(OpMathType(out.dtype)) : ElementType::kS64;
  x = b.Convert(x, acc);
  PoolGeom g = ReadPoolGeom(ctx, nsp, false);
  WindowSpec w = MakeWindow(g, x.dims(), out.sizes);
  Value init = Const(b, acc, 0);
  Value sum = b.ReduceWindow(std::span(&x, 1), std::span(&init, 1), w.window, w.strides, w.base_dil, w.win_dil,
                             w.padding, [](Builder& bb, std::span<const Value> a) {
                               return std::vector<Value>{bb.Add(a[0], a[1])};
                             })[0];
  Value div = AvgDivisor(ctx, g, x.dims(), out.sizes, acc);
  return {Cast(b, b.Div(sum, div), out.dtype)};
}

std::vector<Value> LowerAvgPool2d(LoweringContext& ctx) { return AvgPool(ctx, 2); }
std::vector<Value> LowerAvgPool3d(LoweringContext& ctx) { return AvgPool(ctx, 3); }

// grad_input[i] = sum over the windows o containing i of gy[o] / divisor[o]:
// a window sum over the stride-dilated, padded gradient.
std::vector<Value> AvgPoolBackward(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = ctx.tensor("self");
  const std::vector<int64_t>& in = self.dims();
  ElementType acc = ToElementType(OpMathType(out.dtype));
  Value gy = ctx.tensor("grad_output");
  if (self.type.numel() == 0 || gy.type.numel() == 0) return {Const(b, acc, 0, out.sizes)};
  gy = b.Convert(gy, acc);
  PoolGeom g = ReadPoolGeom(ctx, nsp, false);
  std::vector<int64_t> odims = gy.dims();
  Value scaled = b.Div(gy, AvgDivisor(ctx, g, in, odims, acc));
  const size_t rank = in.size(), first = rank - nsp;
  std::vector<int64_t> lo(rank, 0), hi(rank, 0), interior(rank, 0), window(rank, 1), ones(rank, 1);
  std::vector<int64_t> crop_hi(rank, 0);
  for (size_t j = 0; j < nsp; ++j) {
    size_t d = first + j;
    int64_t k = g.kernel[j], p = g.padding[j], s = g.stride[j];
    interior[d] = s - 1;
    lo[d] = k - 1 - p;
    int64_t h = in[d] + p - (odims[d] - 1) * s - 1;
    hi[d] = std::max<int64_t>(h, 0);
    window[d] = k;
  }
  Value zero = Const(b, acc, 0);
  Value padded = b.Pad(scaled, zero, lo, hi, interior);
  std::vector<std::pair<int64_t, int64_t>> nopad(rank, {0, 0});
  Value r = b.ReduceWindow(std::span(&padded, 1), std::span(&zero, 1), window, ones, ones, ones, nopad,
                           [](Builder& bb, std::span<const Value> a) {
                             return std::vector<Value>{bb.Add(a[0], a[1])};
                           })[0];
  if (r.dims() != in) {
    std::vector<int64_t> start(rank, 0), step(rank, 1);
    r = b.Slice(r, start, in, step);
  }
  return {Cast(b, r, out.dtype)};
}

std::vector<Value> LowerAvgPool2dBackward(LoweringContext& ctx) { return AvgPoolBackward(ctx, 2); }
std::vector<Value> LowerAvgPool3dBackward(LoweringContext& ctx) { return AvgPoolBackward(ctx, 3); }

// --- adaptive pools -------------------------------------------------------

struct AdaptiveDim {
  std::vector<int64_t> start, end;
  int64_t kmax = 0;
};

AdaptiveDim Adaptive(int64_t in, int64_t out) {
  AdaptiveDim a;
  for (int64_t o = 0; o < out; ++o) {
    int64_t s = (o * in) / out;
    int64_t e = ((o + 1) * in + out - 1) / out;
    a.start.push_back(s);
    a.end.push_back(e);
    a.kmax = std::max(a.kmax, e - s);
  }
  return a;
}

// x with each trailing spatial dim d replaced by (O_d, K_d): the elements of
// every adaptive window (positions past a window's end repeat its last
// element and are flagged invalid). Returns the gathered values, the
// validity mask and the flat plane index of each gathered element.
struct Windows {
  Value values, valid, index;
  std::vector<int64_t> k_dims;  // positions of the K dims in the result
};

Windows AdaptiveWindows(Builder& b, const Value& x, size_t nsp, std::span<const int64_t> out_sp,
                        bool want_index) {
  const size_t first = static_cast<size_t>(x.rank()) - nsp;
  Windows w;
  w.values = x;
  if (want_index) w.index = SpatialIota(b, x.dims(), nsp);
  std::vector<Value> valid_terms;
  for (size_t j = 0; j < nsp; ++j) {
    int64_t d = static_cast<int64_t>(first + 2 * j);  // dim position in the growing result
    int64_t in = x.dims()[first + j];
    AdaptiveDim a = Adaptive(in, out_sp[j]);
    std::vector<int64_t> idx, ok;
    for (size_t o = 0; o < a.start.size(); ++o)
      for (int64_t k = 0; k < a.kmax; ++k) {
        int64_t pos = a.start[o] + k;
        ok.push_back(pos < a.end[o]);
        idx.push_back(std::min(pos, a.end[o] - 1));
      }
    int64_t od = static_cast<int64_t>(a.start.size());
    int64_t ok_dims[] = {od, a.kmax};
    Value iv = b.Reshape(b.ConstantI64Vector(idx), ok_dims);
    w.values = GatherWindows(b, w.values, d, iv);
    if (want_index) w.index = GatherWindows(b, w.index, d, iv);
    Value okv = b.Reshape(b.ConstantI64Vector(ok), ok_dims);
    valid_terms.push_back(okv);
    w.k_dims.push_back(d + 1);
  }
  // Validity: product of the per-dim masks, broadcast to the result.
  Value valid;
  for (size_t j = 0; j < nsp; ++j) {
    int64_t d = static_cast<int64_t>(first + 2 * j);
    int64_t bd[] = {d, d + 1};
    Value v = b.BroadcastInDim(valid_terms[j], w.values.dims(), bd);
    valid = valid.name.empty() ? v : b.Mul(valid, v);
  }
  w.valid = b.Compare(valid, Const(b, ElementType::kS64, 0, w.values.dims()), CompareDirection::kNE);
  return w;
}

std::vector<Value> AdaptiveAvgPool(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (Numel(out.sizes) == 0 || x.type.numel() == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  ElementType acc = ToElementType(OpMathType(out.dtype));
  x = b.Convert(x, acc);
  const size_t first = static_cast<size_t>(x.rank()) - nsp;
  std::vector<int64_t> out_sp(out.sizes.begin() + static_cast<std::ptrdiff_t>(first), out.sizes.end());
  Windows w = AdaptiveWindows(b, x, nsp, out_sp, false);
  Value vals = b.Select(w.valid, w.values, ConstLike(b, w.values, 0));
  Value sum = ReduceSum(b, vals, w.k_dims, false);
  // sum / k_1 / k_2 ... as the CPU kernel divides.
  for (size_t j = 0; j < nsp; ++j) {
    AdaptiveDim a = Adaptive(x.dims()[first + j], out_sp[j]);
    std::vector<int64_t> len;
    for (size_t o = 0; o < a.start.size(); ++o) len.push_back(a.end[o] - a.start[o]);
    Value lv = b.Convert(AlongDim(b, b.ConstantI64Vector(len), sum.dims(), static_cast<int64_t>(first + j)), acc);
    sum = b.Div(sum, lv);
  }
  return {Cast(b, sum, out.dtype)};
}

std::vector<Value> LowerAdaptiveAvgPool2d(LoweringContext& ctx) { return AdaptiveAvgPool(ctx, 2); }
std::vector<Value> LowerAdaptiveAvgPool3d(LoweringContext& ctx) { return AdaptiveAvgPool(ctx, 3); }

// grad_input = sum over windows containing i of gy / k_1 / k_2: the divided
// gradient contracted with each dim's 0/1 window-membership matrix.
std::vector<Value> AdaptiveAvgPoolBackward(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value self = ctx.tensor("self");
  ElementType acc = ToElementType(OpMathType(out.dtype));
  Value gy = ctx.tensor("grad_output");
  if (self.type.numel() == 0 || gy.type.numel() == 0) return {Const(b, acc, 0, out.sizes)};
  gy = b.Convert(gy, acc);
  const size_t first = static_cast<size_t>(self.rank()) - nsp;
  std::vector<AdaptiveDim> dims;
  for (size_t j = 0; j < nsp; ++j) dims.push_back(Adaptive(self.dims()[first + j], gy.dims()[first + j]));
  for (size_t j = 0; j < nsp; ++j) {
    std::vector<int64_t> len;
    for (size_t o = 0; o < dims[j].start.size(); ++o) len.push_back(dims[j].end[o] - dims[j].start[o]);
    gy = b.Div(gy, b.Convert(AlongDim(b, b.ConstantI64Vector(len), gy.dims(), static_cast<int64_t>(first + j)), acc));
  }
  for (size_t j = 0; j < nsp; ++j) {
    int64_t in = self.dims()[first + j];
    int64_t od = static_cast<int64_t>(dims[j].start.size());
    std::vector<int64_t> mdims{od, in};
    TensorType it{ElementType::kS64, mdims};
    Value col = b.Iota(it, 1);
    Value s = AlongDim(b, b.ConstantI64Vector(dims[j].start), mdims, 0);
    Value e = AlongDim(b, b.ConstantI64Vector(dims[j].end), mdims, 0);
    Value m = b.And(b.Compare(col, s, CompareDirection::kGE), b.Compare(col, e, CompareDirection::kLT));
    gy = ContractDim(b, gy, static_cast<int64_t>(first + j), b.Convert(m, acc));
  }
  return {Cast(b, gy, out.dtype)};
}

std::vector<Value> LowerAdaptiveAvgPool2dBackward(LoweringContext& ctx) { return AdaptiveAvgPoolBackward(ctx, 2); }
std::vector<Value> LowerAdaptiveAvgPool3dBackward(LoweringContext& ctx) { return AdaptiveAvgPoolBackward(ctx, 3); }

std::vector<Value> AdaptiveMaxPool(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  if (Numel(out.sizes) == 0 || x.type.numel() == 0)
    return {Const(b, ToElementType(out.dtype), 0, out.sizes), Const(b, ElementType::kS64, 0, out.sizes)};
  const size_t first = static_cast<size_t>(x.rank()) - nsp;
  std::vector<int64_t> out_sp(out.sizes.begin() + static_cast<std::ptrdiff_t>(first), out.sizes.end());
  Windows w = AdaptiveWindows(b, x, nsp, out_sp, true);
  Value vals = b.Select(w.valid, w.values, b.BroadcastInDim(LowestConst(b, x.element()), w.values.dims(), {}));
  Value big = b.ConstantInt(TensorType{ElementType::kS64, {}}, std::numeric_limits<int64_t>::max());
  Value idx = b.Select(w.valid, w.index, b.BroadcastInDim(big, w.index.dims(), {}));
  Value inputs[] = {vals, idx};
  Value inits[] = {LowestConst(b, x.element()), big};
  auto r = b.Reduce(inputs, inits, w.k_dims, ArgmaxBody);
  return {Cast(b, r[0], out.dtype), r[1]};
}

std::vector<Value> LowerAdaptiveMaxPool2d(LoweringContext& ctx) { return AdaptiveMaxPool(ctx, 2); }
std::vector<Value> LowerAdaptiveMaxPool3d(LoweringContext& ctx) { return AdaptiveMaxPool(ctx, 3); }

// --- upsampling -------------------------------------------------------------

// The scale argument of spatial dim j (None = derive from the sizes).
std::vector<std::optional<double>> Scales(const LoweringContext& ctx, size_t nsp) {
  std::vector<std::optional<double>> s(nsp);
  if (const LoweredArg* a = ctx.find("scale_factors"); a && a->ivalue.isDoubleList()) {
    auto l = a->ivalue.toDoubleList();
    for (size_t j = 0; j < nsp && j < l.size(); ++j) s[j] = l[j];
    return s;
  }
  static const char* k1[] = {"scales"};
  static const char* k2[] = {"scales_h", "scales_w"};
  static const char* k3[] = {"scales_d", "scales_h", "scales_w"};
  const char** names = nsp == 1 ? k1 : nsp == 2 ? k2 : k3;
  for (size_t j = 0; j < nsp; ++j) s[j] = OptFloat(ctx, names[j]);
  return s;
}

float ComputeScale(std::optional<double> scale, int64_t in, int64_t out) {
  return (scale.has_value() && *scale > 0.) ? static_cast<float>(1.0 / *scale)
                                            : static_cast<float>(in) / static_cast<float>(out);
}

std::vector<int64_t> NearestIndices(int64_t in, int64_t out, std::optional<double> scale, bool exact) {
  std::vector<int64_t> idx;
  float s = ComputeScale(scale, in, out);
  for (int64_t o = 0; o < out; ++o) {
    if (exact) {
      idx.push_back(std::min(static_cast<int64_t>(std::floor(static_cast<float>((o + 0.5) * s))), in - 1));
    } else if (out == in) {
      idx.push_back(o);
    } else if (out == 2 * in) {
      idx.push_back(o >> 1);
    } else {
      idx.push_back(std::min(static_cast<int64_t>(std::floor(static_cast<float>(o) * s)), in - 1));
    }
  }
  return idx;
}

std::vector<Value> UpsampleNearest(LoweringContext& ctx, size_t nsp, bool exact) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.has("self") ? ctx.tensor("self") : ctx.tensor("input");
  if (Numel(out.sizes) == 0 || x.type.numel() == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  auto scales = Scales(ctx, nsp);
  const size_t first = static_cast<size_t>(x.rank()) - nsp;
  for (size_t j = 0; j < nsp; ++j) {
    int64_t d = static_cast<int64_t>(first + j);
    x = GatherStatic(b, x, d, NearestIndices(x.dims()[first + j], out.sizes[first + j], scales[j], exact));
  }
  return {Cast(b, x, out.dtype)};
}

std::vector<Value> UpsampleNearestBackward(LoweringContext& ctx, size_t nsp, bool exact) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  ElementType acc = ToElementType(OpMathType(out.dtype));
  Value gy = ctx.tensor("grad_output");
  if (Numel(out.sizes) == 0 || gy.type.numel() == 0) return {Const(b, acc, 0, out.sizes)};
  gy = b.Convert(gy, acc);
  auto scales = Scales(ctx, nsp);
  const size_t first = out.sizes.size() - nsp;
  for (size_t j = 0; j < nsp; ++j) {
    int64_t in = out.sizes[first + j];
    auto idx = NearestIndices(in, gy.dims()[first + j], scales[j], exact);
    gy = ContractDim(b, gy, static_cast<int64_t>(first + j), b.Convert(OneHotRows(b, idx, in), acc));
  }
  return {Cast(b, gy, out.dtype)};
}

// Interpolation taps of one dim: output o = sum_k weight[k][o] * input[index[k][o]].
struct Taps {
  std::vector<std::vector<int64_t>> index;
  std::vector<std::vector<float>> weight;
};

float AreaScale(int64_t in, int64_t out, bool align_corners, std::optional<double> scale) {
  if (align_corners) return out > 1 ? static_cast<float>(in - 1) / static_cast<float>(out - 1) : 0.f;
  return ComputeScale(scale, in, out);
}

// Linear: PyTorch's compute_source_index_and_lambda.
Taps LinearTaps(int64_t in, int64_t out, bool align_corners, std::optional<double> scale) {
  Taps t{std::vector<std::vector<int64_t>>(2), std::vector<std::vector<float>>(2)};
  float ratio = AreaScale(in, out, align_corners, scale);
  for (int64_t o = 0; o < out; ++o) {
    if (out == in) {
      t.index[0].push_back(o);
      t.index[1].push_back(o);
      t.weight[0].push_back(1.f);
      t.weight[1].push_back(0.f);
      continue;
    }
    float real;
    if (align_corners) {
      real = ratio * static_cast<float>(o);
    } else {
      real = ratio * (static_cast<float>(o) + 0.5f) - 0.5f;
      if (real < 0.f) real = 0.f;
    }
    int64_t i0 = std::min(static_cast<int64_t>(std::floor(real)), in - 1);
    float l1 = std::min(std::max(real - static_cast<float>(i0), 0.f), 1.f);
    t.index[0].push_back(i0);
    t.index[1].push_back(i0 + (i0 < in - 1 ? 1 : 0));
    t.weight[1].push_back(l1);
    t.weight[0].push_back(1.f - l1);
  }
  return t;
}

// Bicubic (A = -0.75): taps at floor(real) - 1 .. + 2, clamped to the input.
Taps CubicTaps(int64_t in, int64_t out, bool align_corners, std::optional<double> scale) {
  Taps t{std::vector<std::vector<int64_t>>(4), std::vector<std::vector<float>>(4)};
  float ratio = AreaScale(in, out, align_corners, scale);
  const float A = -0.75f;
  auto conv1 = [A](float x) { return ((A + 2) * x - (A + 3)) * x * x + 1; };
  auto conv2 = [A](float x) { return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A; };
  for (int64_t o = 0; o < out; ++o) {
    float real = align_corners ? ratio * static_cast<float>(o) : ratio * (static_cast<float>(o) + 0.5f) - 0.5f;
    float fl = std::floor(real);
    int64_t i = static_cast<int64_t>(fl);
    float x1 = real - fl;
    float c[4] = {conv2(x1 + 1.0f), conv1(x1), conv1(1.0f - x1), conv2((1.0f - x1) + 1.0f)};
    for (int k = 0; k < 4; ++k) {
      t.index[static_cast<size_t>(k)].push_back(std::clamp<int64_t>(i - 1 + k, 0, in - 1));
      t.weight[static_cast<size_t>(k)].push_back(c[k]);
    }
  }
  return t;
}

using TapsFn = Taps (*)(int64_t, int64_t, bool, std::optional<double>);

// round_weights: the weights are rounded to a bf16/f16 output's dtype first,
// as PyTorch's CPU bicubic kernel computes its coefficients in scalar_t
// (that reproduces CPU's bf16 bicubic results exactly; its linear kernels
// keep float weights).
std::vector<Value> UpsampleInterp(LoweringContext& ctx, size_t nsp, TapsFn taps_fn, bool round_weights = false) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.has("self") ? ctx.tensor("self") : ctx.tensor("input");
  if (Numel(out.sizes) == 0 || x.type.numel() == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  ElementType acc = ToElementType(OpMathType(out.dtype));
  x = b.Convert(x, acc);
  const bool align = ctx.bool_arg("align_corners");
  auto scales = Scales(ctx, nsp);
  const size_t first = static_cast<size_t>(x.rank()) - nsp;
  // Innermost dim first: h0 * (w-interp of row h0) + h1 * (w-interp of row h1).
  for (size_t j = nsp; j-- > 0;) {
    int64_t d = static_cast<int64_t>(first + j);
    Taps t = taps_fn(x.dims()[first + j], out.sizes[first + j], align, scales[j]);
    Value sum;
    for (size_t k = 0; k < t.index.size(); ++k) {
      Value xk = GatherStatic(b, x, d, t.index[k]);
      Value wv = DenseF32(b, t.weight[k]);
      if (round_weights && (out.dtype == at::kBFloat16 || out.dtype == at::kHalf))
        wv = b.Convert(b.Convert(wv, ToElementType(out.dtype)), ElementType::kF32);
      Value wk = AlongDim(b, b.Convert(wv, acc), xk.dims(), d);
      Value term = b.Mul(xk, wk);
      sum = sum.name.empty() ? term : b.Add(sum, term);
    }
    x = sum;
  }
  return {Cast(b, x, out.dtype)};
}

std::vector<Value> UpsampleInterpBackward(LoweringContext& ctx, size_t nsp, TapsFn taps_fn) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  ElementType acc = ToElementType(OpMathType(out.dtype));
  Value gy = ctx.tensor("grad_output");
  if (Numel(out.sizes) == 0 || gy.type.numel() == 0) return {Const(b, acc, 0, out.sizes)};
  gy = b.Convert(gy, acc);
  const bool align = ctx.bool_arg("align_corners");
  auto scales = Scales(ctx, nsp);
  const size_t first = out.sizes.size() - nsp;
  for (size_t j = 0; j < nsp; ++j) {
    int64_t in = out.sizes[first + j];
    int64_t od = gy.dims()[first + j];
    Taps t = taps_fn(in, od, align, scales[j]);
    std::vector<int64_t> mdims{od, in};
    Value m;
    for (size_t k = 0; k < t.index.size(); ++k) {
      Value wk = AlongDim(b, b.Convert(DenseF32(b, t.weight[k]), acc), mdims, 0);
      Value term = b.Mul(b.Convert(OneHotRows(b, t.index[k], in), acc), wk);
      m = m.name.empty() ? term : b.Add(m, term);
    }
    gy = ContractDim(b, gy, static_cast<int64_t>(first + j), m);
  }
  return {Cast(b, gy, out.dtype)};
}

std::vector<Value> UpsampleLinear(LoweringContext& ctx, size_t nsp) { return UpsampleInterp(ctx, nsp, LinearTaps); }
std::vector<Value> UpsampleLinearBackward(LoweringContext& ctx, size_t nsp) {
  return UpsampleInterpBackward(ctx, nsp, LinearTaps);
}
std::vector<Value> LowerUpsampleBicubic2d(LoweringContext& ctx) { return UpsampleInterp(ctx, 2, CubicTaps, true); }
std::vector<Value> LowerUpsampleBicubic2dBackward(LoweringContext& ctx) {
  return UpsampleInterpBackward(ctx, 2, CubicTaps);
}

std::vector<Value> LowerUpsampleNearest1d(LoweringContext& ctx) { return UpsampleNearest(ctx, 1, false); }
std::vector<Value> LowerUpsampleNearest2d(LoweringContext& ctx) { return UpsampleNearest(ctx, 2, false); }
std::vector<Value> LowerUpsampleNearest3d(LoweringContext& ctx) { return UpsampleNearest(ctx, 3, false); }
std::vector<Value> LowerUpsampleNearestExact1d(LoweringContext& ctx) { return UpsampleNearest(ctx, 1, true); }
std::vector<Value> LowerUpsampleNearestExact2d(LoweringContext& ctx) { return UpsampleNearest(ctx, 2, true); }
std::vector<Value> LowerUpsampleNearestExact3d(LoweringContext& ctx) { return UpsampleNearest(ctx, 3, true); }
std::vector<Value> LowerUpsampleNearest1dBackward(LoweringContext& ctx) { return UpsampleNearestBackward(ctx, 1, false); }
std::vector<Value> LowerUpsampleNearest2dBackward(LoweringContext& ctx) { return UpsampleNearestBackward(ctx, 2, false); }
std::vector<Value> LowerUpsampleNearest3dBackward(LoweringContext& ctx) { return UpsampleNearestBackward(ctx, 3, false); }
std::vector<Value> LowerUpsampleNearestExact1dBackward(LoweringContext& ctx) { return UpsampleNearestBackward(ctx, 1, true); }
std::vector<Value> LowerUpsampleNearestExact2dBackward(LoweringContext& ctx) { return UpsampleNearestBackward(ctx, 2, true); }
std::vector<Value> LowerUpsampleNearestExact3dBackward(LoweringContext& ctx) { return UpsampleNearestBackward(ctx, 3, true); }
std::vector<Value> LowerUpsampleLinear1d(LoweringContext& ctx) { return UpsampleLinear(ctx, 1); }
std::vector<Value> LowerUpsampleBilinear2d(LoweringContext& ctx) { return UpsampleLinear(ctx, 2); }
std::vector<Value> LowerUpsampleTrilinear3d(LoweringContext& ctx) { return UpsampleLinear(ctx, 3); }
std::vector<Value> LowerUpsampleLinear1dBackward(LoweringContext& ctx) { return UpsampleLinearBackward(ctx, 1); }
std::vector<Value> LowerUpsampleBilinear2dBackward(LoweringContext& ctx) { return UpsampleLinearBackward(ctx, 2); }
std::vector<Value> LowerUpsampleTrilinear3dBackward(LoweringContext& ctx) { return UpsampleLinearBackward(ctx, 3); }

// ---------------------------------------------------------------------------
// max_unpool2d / max_unpool3d: self and indices (N, C, *in) or (C, *in);
// output (N, C, *output_size) zeros with out[n, c, indices[n, c, i]] =
// self[n, c, i] per (N, C) plane, indices being flat offsets into the output
// plane. Where several inputs name one output element PyTorch leaves the
// winner unspecified (CPU's parallel loop keeps one of them); here the last
// in input order wins, deterministically: the max input position is
// scattered to each output element, then its value is gathered. Indices
// outside [0, prod(output_size)) raise "Found an invalid max index" as on CPU
// (a value check: at the next sync point, in debug mode at the op).
// Backward: autograd calls max_pool_double_backward = gather (index.cpp).

std::vector<Value> MaxUnpool(LoweringContext& ctx, size_t nsp) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value x = ctx.tensor("self");
  Value idx = ctx.tensor("indices");
  const ElementType e = ToElementType(out.dtype);
  if (!at::isFloatingType(out.dtype))  // CPU: "not implemented for 'Long'" (raised by the CPU path)
    throw LoweringError(ctx.op_name() + ": floating point input expected");
  if (x.rank() != static_cast<int64_t>(nsp) + 1 && x.rank() != static_cast<int64_t>(nsp) + 2)
    throw LoweringError(ctx.op_name() + ": expected a " + std::to_string(nsp + 1) + "-d or " +
                        std::to_string(nsp + 2) + "-d input");
  if (idx.dims() != x.dims()) throw LoweringError(ctx.op_name() + ": indices must have the shape of self");
  const size_t r = static_cast<size_t>(x.rank());
  int64_t batch = 1, plane = 1;
  for (size_t d = 0; d < r - nsp; ++d) batch *= x.dims()[d];
  for (size_t d = r - nsp; d < r; ++d) plane *= x.dims()[d];
  int64_t q = 1;
  for (size_t d = out.sizes.size() - nsp; d < out.sizes.size(); ++d) q *= out.sizes[d];
  if (Numel(out.sizes) == 0) return {Const(b, e, 0, out.sizes)};
  if (batch * plane == 0) return {Const(b, e, 0, out.sizes)};
  const std::vector<int64_t> bp{batch, plane};
  Value xf = b.Reshape(Cast(b, x, out.dtype), bp);
  Value i = b.Reshape(b.Convert(idx, ElementType::kS64), bp);
  // Out-of-range indices go to a spare column q (sliced off).
  Value valid = b.And(b.Compare(i, ConstLike(b, i, 0), CompareDirection::kGE),
                      b.Compare(i, ConstLike(b, i, static_cast<double>(q)), CompareDirection::kLT));
  int64_t both[] = {0, 1};
  ctx.check(ReduceOr(b, b.Not(valid), both, false),
            "Found an invalid max index (outside [0, " + std::to_string(q) + "), the size of an output plane)");
  Value target = b.Select(valid, i, ConstLike(b, i, static_cast<double>(q)));
  const std::vector<int64_t> bp1{batch, plane, 1};
  Value rows = b.Iota(TensorType{ElementType::kS64, bp1}, 0);
  Value pairs[] = {rows, b.Reshape(target, bp1)};
  Value where = b.Concatenate(pairs, 2);  // (B, P, 2)
  Value pos = b.Iota(TensorType{ElementType::kS64, bp}, 1);
  hlo::ScatterDims s;
  s.inserted_window_dims = {0, 1};
  s.scatter_dims_to_operand_dims = {0, 1};
  s.index_vector_dim = 2;
  const std::vector<int64_t> bq1{batch, q + 1};
  Value winner = b.Scatter(Const(b, ElementType::kS64, -1, bq1), where, pos, s,
                           [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Max(a[0], a[1])}; });
  const std::vector<int64_t> start{0, 0}, limit{batch, q}, step{1, 1};
  winner = b.Slice(winner, start, limit, step);  // (B, Q)
  const std::vector<int64_t> bq{batch, q}, bqc{batch, q, 1};
  Value has = b.Compare(winner, ConstLike(b, winner, 0), CompareDirection::kGE);
  Value src = b.Select(has, winner, ConstLike(b, winner, 0));
  Value grows = b.Iota(TensorType{ElementType::kS64, bqc}, 0);
  Value gpairs[] = {grows, b.Reshape(src, bqc)};
  hlo::GatherDims g;
  g.collapsed_slice_dims = {0, 1};
  g.start_index_map = {0, 1};
  g.index_vector_dim = 2;
  const int64_t ss[] = {1, 1};
  Value vals = b.Gather(xf, b.Concatenate(gpairs, 2), g, ss, TensorType{e, bq});
  Value res = b.Select(has, vals, Const(b, e, 0, bq));
  return {b.Reshape(res, out.sizes)};
}

std::vector<Value> LowerMaxUnpool2d(LoweringContext& ctx) { return MaxUnpool(ctx, 2); }
std::vector<Value> LowerMaxUnpool3d(LoweringContext& ctx) { return MaxUnpool(ctx, 3); }

}  // namespace

TORCH_TPU_LOWERINGS({
    {"max_pool2d_with_indices", LowerMaxPool2d},
    {"max_pool2d_with_indices_backward", LowerMaxPool2dBackward},
    {"max_pool3d_with_indices", LowerMaxPool3d},
    {"max_pool3d_with_indices_backward", LowerMaxPool3dBackward},
    {"avg_pool2d", LowerAvgPool2d},
    {"avg_pool2d_backward", LowerAvgPool2dBackward},
    {"avg_pool3d", LowerAvgPool3d},
    {"avg_pool3d_backward", LowerAvgPool3dBackward},
    {"_adaptive_avg_pool2d", LowerAdaptiveAvgPool2d},
    {"_adaptive_avg_pool2d_backward", LowerAdaptiveAvgPool2dBackward},
    {"_adaptive_avg_pool3d", LowerAdaptiveAvgPool3d},
    {"_adaptive_avg_pool3d_backward", LowerAdaptiveAvgPool3dBackward},
    {"adaptive_max_pool2d", LowerAdaptiveMaxPool2d},
    {"adaptive_max_pool2d_backward", LowerMaxPool2dBackward},
    {"adaptive_max_pool3d", LowerAdaptiveMaxPool3d},
    {"adaptive_max_pool3d_backward", LowerMaxPool3dBackward},
    {"upsample_nearest1d", LowerUpsampleNearest1d},
    {"upsample_nearest2d", LowerUpsampleNearest2d},
    {"upsample_nearest3d", LowerUpsampleNearest3d},
    {"_upsample_nearest_exact1d", LowerUpsampleNearestExact1d},
    {"_upsample_nearest_exact2d", LowerUpsampleNearestExact2d},
    {"_upsample_nearest_exact3d", LowerUpsampleNearestExact3d},
    {"upsample_nearest1d_backward", LowerUpsampleNearest1dBackward},
    {"upsample_nearest2d_backward", LowerUpsampleNearest2dBackward},
    {"upsample_nearest3d_backward", LowerUpsampleNearest3dBackward},
    {"_upsample_nearest_exact1d_backward", LowerUpsampleNearestExact1dBackward},
    {"_upsample_nearest_exact2d_backward", LowerUpsampleNearestExact2dBackward},
    {"_upsample_nearest_exact3d_backward", LowerUpsampleNearestExact3dBackward},
    {"upsample_linear1d", LowerUpsampleLinear1d},
    {"upsample_bilinear2d", LowerUpsampleBilinear2d},
    {"upsample_trilinear3d", LowerUpsampleTrilinear3d},
    {"upsample_linear1d_backward", LowerUpsampleLinear1dBackward},
    {"upsample_bilinear2d_backward", LowerUpsampleBilinear2dBackward},
    {"upsample_trilinear3d_backward", LowerUpsampleTrilinear3dBackward},
    {"upsample_bicubic2d", LowerUpsampleBicubic2d},
    {"upsample_bicubic2d_backward", LowerUpsampleBicubic2dBackward},
    {"max_unpool2d", LowerMaxUnpool2d},
    {"max_unpool3d", LowerMaxUnpool3d},
});

}  // namespace torch_tpu::lowering
