// Random sampling: uniform_, normal (in-place and functional overloads),
// bernoulli, random_, exponential_, multinomial, randperm. torch.rand/randn/randint/
// rand_like/dropout masks reach these through empty + the in-place op.
//
// Bits come from stablehlo.rng_bit_generator (THREE_FRY) seeded with the op's
// generator state (seed, offset); the executor advances the generator's
// offset by the op's output size after each call, so consecutive calls
// differ and torch.manual_seed reproduces a sequence. The streams are not
// PyTorch's CPU streams (no backend matches them); the distributions are.
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

using hlo::CompareDirection;

// Uniform values in [0, 1) of `dims`: f32 from 32 random bits (23 mantissa
// bits) or, for f64 outputs, f64 from 64 bits (52 mantissa bits). Element i
// depends only on (seed, offset + i) (RandomBits64/32, helpers.h).
Value UniformFromU32(Builder& b, const Value& bits) {
  const auto& d = bits.dims();
  Value sh = b.Binary("stablehlo.shift_right_logical", bits, b.BroadcastInDim(b.ConstantInt(TensorType{ElementType::kU32, {}}, 9), d, {}));
  Value one = b.BroadcastInDim(b.ConstantInt(TensorType{ElementType::kU32, {}}, 0x3F800000), d, {});
  Value f = b.BitcastConvert(b.Or(sh, one), ElementType::kF32);
  return b.Sub(f, ConstLike(b, f, 1.0));
}
Value UniformFrom(Builder& b, const Value& rng_state, std::span<const int64_t> dims, bool f64) {
  if (f64) {
    Value bits = RandomBits64(b, rng_state, dims);
    const auto& d = bits.dims();
    Value sh = b.Binary("stablehlo.shift_right_logical", bits, b.BroadcastInDim(b.ConstantInt(TensorType{ElementType::kU64, {}}, 12), d, {}));
    Value one = b.BroadcastInDim(b.ConstantInt(TensorType{ElementType::kU64, {}}, 0x3FF0000000000000LL), d, {});
    Value f = b.BitcastConvert(b.Or(sh, one), ElementType::kF64);
    return b.Sub(f, ConstLike(b, f, 1.0));
  }
  return UniformFromU32(b, RandomBits32(b, rng_state, dims));
}
Value Uniform(LoweringContext& ctx, std::span<const int64_t> dims, bool f64) {
  return UniformFrom(ctx.b, ctx.rng_state(), dims, f64);
}

// A THREE_FRY state of its own for an op that draws more values than its
// output has elements (the executor advances the generator's offset by the
// output size only): the first 128 bits of the op's stream become the key
// and counter of a new stream, so the next op's (offset + output size)
// never replays values this op used.
Value OwnStream(LoweringContext& ctx) {
  return ctx.b.RngBitGenerator(ctx.rng_state(), TensorType{ElementType::kU64, {2}}).second;
}

bool WantsF64(at::ScalarType t) { return t == at::kDouble; }
at::ScalarType FloatCompute(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// A float argument that is either static (a Python float) or a tensor.
Value FloatOrTensor(LoweringContext& ctx, std::string_view name, at::ScalarType t,
                    const std::vector<int64_t>& sizes, double dflt) {
  const LoweredArg* a = ctx.find(name);
  if (!a || a->kind == LoweredArg::Kind::kNone) return Const(ctx.b, ToElementType(t), dflt, sizes);
  if (a->kind == LoweredArg::Kind::kTensor || a->kind == LoweredArg::Kind::kScalar)
    return Prepare(ctx.b, a->value, t, sizes);
  return Const(ctx.b, ToElementType(t), ctx.float_arg(name), sizes);
}

std::vector<Value> LowerUniform(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!at::isFloatingType(out.dtype)) throw LoweringError(ctx.op_name() + ": uniform_ needs a floating dtype");
  at::ScalarType t = FloatCompute(out.dtype);
  const double from = ctx.has("from") ? ctx.float_arg("from") : 0.0;
  const double to = ctx.has("to") ? ctx.float_arg("to") : 1.0;
  // CPU's uniform_impl_ (ATen DistributionTemplates.h) checks, in this
  // order: from and to within the dtype's range (CHECK_OUT_OF_BOUNDS),
  // from <= to, and to - from <= the dtype's max. `from` and `to` are float
  // arguments, part of the key, so a check here covers every call.
  const double highest = MaxFinite(out.dtype), lowest = -highest;
  TORCH_CHECK(from >= lowest && from <= highest, "from is out of bounds for ", c10::scalarTypeToTypeMeta(out.dtype));
  TORCH_CHECK(to >= lowest && to <= highest, "to is out of bounds for ", c10::scalarTypeToTypeMeta(out.dtype));
  TORCH_CHECK(from <= to, "uniform_ expects to return a [from, to) range, but found from=", from, " > to=", to);
  TORCH_CHECK(to - from <= highest, "uniform_ expects to-from <= std::numeric_limits<", out.dtype,
              ">::max(), but found to=", to, " and from=", from, " which result in to-from to exceed the limit");
  Value u = Uniform(ctx, out.sizes, WantsF64(out.dtype));
  Value r = b.Add(b.Mul(u, ConstLike(b, u, to - from)), ConstLike(b, u, from));
  return {Out(b, Cast(b, r, t), out)};
}

// Box-Muller on pairs of uniforms.
std::vector<Value> LowerNormal(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!at::isFloatingType(out.dtype)) throw LoweringError(ctx.op_name() + ": normal needs a floating dtype");
  at::ScalarType t = FloatCompute(out.dtype);
  int64_t n = 1;
  for (int64_t s : out.sizes) n *= s;
  if (n == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  int64_t flat[] = {n};
  Value u1, u2;
  if (WantsF64(out.dtype)) {
    // f64 needs 2 x 64 bits per element: the second uniform comes from a
    // stream of its own (OwnStream), so only u1 follows the per-element
    // counter and f64 normal values are not shard-consistent.
    u1 = Uniform(ctx, flat, true);
    u2 = UniformFrom(b, OwnStream(ctx), flat, true);
  } else {
    // f32: both uniforms from the halves of element i's 64 bits, so element i
    // depends only on (seed, offset + i), as for uniform_ (shard-consistent:
    // DTensor's RNG tracker draws each shard at its own offset).
    auto [lo, hi] = RandomBits32Pair(b, ctx.rng_state(), flat);
    u1 = UniformFromU32(b, lo);
    u2 = UniformFromU32(b, hi);
  }
  u1 = b.Sub(ConstLike(b, u1, 1.0), u1);  // (0, 1]
  Value radius = b.Sqrt(b.Mul(ConstLike(b, u1, -2.0), b.Log(u1)));
  Value angle = b.Mul(ConstLike(b, u2, 2.0 * M_PI), u2);
  Value z = b.Reshape(b.Mul(radius, b.Unary("stablehlo.cosine", angle)), out.sizes);
  Value mean = FloatOrTensor(ctx, "mean", t, out.sizes, 0.0);
  Value std = FloatOrTensor(ctx, "std", t, out.sizes, 1.0);
  // CPU's normal checks std first (ATen DistributionTemplates.h): a float
  // std < 0 (CHECK_NORMAL_STD; a float argument is part of the key, so
  // checked here for every call), a tensor std with an element < 0 or NaN
  // (CHECK_NORMAL_TENSOR_STD, std.min().ge(0)): a value check, raised at
  // the next sync point (debug mode: at the op).
  if (const LoweredArg* s = ctx.find("std"); s && s->kind == LoweredArg::Kind::kTensor) {
    if (std.type.numel() > 0) {
      Value bad = b.Not(b.Compare(std, ConstLike(b, std, 0), CompareDirection::kGE));
      ctx.check(bad.rank() == 0 ? bad : ReduceOr(b, bad, ReductionDims({}, bad.rank()), false),
                "normal expects all elements of std >= 0.0");
    }
  } else if (s && s->kind != LoweredArg::Kind::kNone && s->kind != LoweredArg::Kind::kScalar) {
    const double sd = ctx.float_arg("std");
    TORCH_CHECK(sd >= 0.0, "normal expects std >= 0.0, but found std ", sd);
  }
  return {Out(b, b.Add(b.Mul(z, std), mean), out)};
}

// bernoulli_(self, p: float | Tensor), bernoulli(self) (p = self),
// bernoulli.p(self, p). A float p outside [0, 1] is rejected before the call
// (aten/fallback.cpp CheckArgumentsLikeCpu, CPU's "bernoulli_ expects p to be
// in [0, 1], but got p=..."); a tensor p holding a value outside [0, 1] or
// NaN raises CPU's RuntimeError (its CPU_tensor_apply check) at the next sync
// point (a value check), at the op in debug mode.
std::vector<Value> LowerBernoulli(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  at::ScalarType t = FloatCompute(out.dtype);
  Value p;
  if (ctx.find("p")) {
    p = FloatOrTensor(ctx, "p", t, out.sizes, 0.5);
  } else {
    p = Prepare(b, ctx.tensor("self"), t, out.sizes);
  }
  const LoweredArg* p_arg = ctx.find("p");
  if ((!p_arg || p_arg->kind == LoweredArg::Kind::kTensor) && p.type.numel() > 0) {
    Value inside = b.And(b.Compare(p, ConstLike(b, p, 0), CompareDirection::kGE),
                         b.Compare(p, ConstLike(b, p, 1), CompareDirection::kLE));
    Value outside = b.Not(inside);
    ctx.check(outside.rank() == 0 ? outside : ReduceOr(b, outside, ReductionDims({}, outside.rank()), false),
              "Expected p_in >= 0 && p_in <= 1 to be true, but got false.");
  }
  Value u = Cast(b, Uniform(ctx, out.sizes, t == at::kDouble), t);
  Value hit = b.Compare(u, p, CompareDirection::kLT);
  return {Out(b, hit, out)};
}

// random_: integers uniform in [from, to) (defaults: [0, 2^mantissa] for
// floats, [0, max] for integers, as PyTorch).
// True when random_(from, to) with these bounds is valid on CPU and needs
// none of its floating-point bound adjustments (update_from/update_to) or
// warnings: from < to (to given), and from and the top value (to - 1, or
// the dtype's largest value for to=None) in the dtype's range, within
// +-2^digits for floating dtypes (aten/native/DistributionTemplates.h).
bool RandomBoundsPlain(at::ScalarType t, int64_t from, std::optional<int64_t> to) {
  if (to && from >= *to) return false;
  int64_t lo = 0, hi = 0;
  switch (t) {
    case at::kBool: lo = 0, hi = 1; break;
    case at::kByte: lo = 0, hi = 255; break;
    case at::kChar: lo = -128, hi = 127; break;
    case at::kShort: lo = -32768, hi = 32767; break;
    case at::kInt: lo = INT32_MIN, hi = INT32_MAX; break;
    case at::kLong: lo = INT64_MIN, hi = INT64_MAX; break;
    case at::kHalf: lo = -(int64_t{1} << 11), hi = int64_t{1} << 11; break;
    case at::kBFloat16: lo = -(int64_t{1} << 8), hi = int64_t{1} << 8; break;
    case at::kFloat: lo = -(int64_t{1} << 24), hi = int64_t{1} << 24; break;
    case at::kDouble: lo = -(int64_t{1} << 53), hi = int64_t{1} << 53; break;
    default: return false;
  }
  if (from < lo || from > hi) return false;
  if (to && (*to - 1 < lo || *to - 1 > hi)) return false;
  return true;
}

std::vector<Value> LowerRandom(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  int64_t from = 0;
  uint64_t range = 0;  // 0 = 2^64
  auto default_to = [&]() -> int64_t {
    switch (out.dtype) {
      case at::kBool: return 2;
      case at::kByte: return 256;
      case at::kChar: return 128;
      case at::kShort: return 32768;
      case at::kInt: return 2147483648LL;
      case at::kLong: return std::numeric_limits<int64_t>::max();  // inclusive max handled below
      case at::kHalf: return (1LL << 11) + 1;
      case at::kBFloat16: return (1LL << 8) + 1;
      case at::kFloat: return (1LL << 24) + 1;
      case at::kDouble: return (1LL << 53) + 1;
      default: throw LoweringError(ctx.op_name() + ": unsupported dtype");
    }
  };
  if (ctx.find("from")) {
    from = ctx.int_arg("from");
    // CPU's random_from_to_impl checks from < to and that from and to - 1
    // (or the dtype's top) fit the dtype, adjusts floating bounds past
    // 2^digits to representable values and warns there: such calls run on
    // the CPU, which raises (or warns and computes) as it does.
    const std::optional<int64_t> to =
        ctx.has("to") ? std::optional<int64_t>(ctx.int_arg("to")) : std::nullopt;
    if (!RandomBoundsPlain(out.dtype, from, to))
      throw LoweringError(ctx.op_name() + ": from/to outside the dtype's plain range (CPU checks and adjusts them)");
    if (ctx.has("to")) {
      range = static_cast<uint64_t>(ctx.int_arg("to")) - static_cast<uint64_t>(from);
    } else {
      // to=None: up to the dtype's max (inclusive)
      int64_t top = default_to();
      range = out.dtype == at::kLong ? static_cast<uint64_t>(top) - static_cast<uint64_t>(from) + 1
                                     : static_cast<uint64_t>(top) - static_cast<uint64_t>(from);
    }
  } else if (ctx.has("to")) {
    if (!RandomBoundsPlain(out.dtype, 0, ctx.int_arg("to")))  // random_(to): from = 0
      throw LoweringError(ctx.op_name() + ": to outside the dtype's plain range (CPU checks and adjusts it)");
    range = static_cast<uint64_t>(ctx.int_arg("to"));
  } else {
    int64_t top = default_to();
    range = out.dtype == at::kLong ? static_cast<uint64_t>(top) + 1 : static_cast<uint64_t>(top);
  }
  std::vector<int64_t> d = out.sizes;
  auto [state, bits] = b.RngBitGenerator(ctx.rng_state(), TensorType{ElementType::kU64, d});
  auto u64 = [&](uint64_t x) {
    return b.BroadcastInDim(b.ConstantInt(TensorType{ElementType::kU64, {}}, static_cast<int64_t>(x)), d, {});
  };
  Value v = bits;
  if (range != 0 && (range & (range - 1)) == 0) {
    v = b.And(bits, u64(range - 1));
  } else if (range != 0) {
    if (range > (uint64_t{1} << 63)) throw LoweringError(ctx.op_name() + ": range too large");
    v = b.Rem(bits, u64(range));
  }
  // v < range <= 2^63 (or all 64 bits): add `from` with int64 wrap-around.
  v = b.BitcastConvert(v, ElementType::kS64);
  v = b.Add(v, b.BroadcastInDim(b.ConstantInt(TensorType{ElementType::kS64, {}}, from), d, {}));
  if (out.dtype == at::kBool) return {Out(b, b.Compare(v, ConstLike(b, v, 0), CompareDirection::kNE), out)};
  return {Out(b, v, out)};
}

std::vector<Value> LowerExponential(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  if (!at::isFloatingType(out.dtype)) throw LoweringError(ctx.op_name() + ": exponential_ needs a floating dtype");
  at::ScalarType t = FloatCompute(out.dtype);
  const double lambd = ctx.has("lambd") ? ctx.float_arg("lambd") : 1.0;
  Value u = Uniform(ctx, out.sizes, WantsF64(out.dtype));
  // -log(1 - u) / lambda, u in [0, 1): finite and >= 0.
  Value r = b.Div(b.Neg(b.Unary("stablehlo.log_plus_one", b.Neg(u))), ConstLike(b, u, lambd));
  return {Out(b, Cast(b, r, t), out)};
}

// multinomial(self [n] or [B, n] of non-negative weights, num_samples k,
// replacement) -> int64 [k] or [B, k], by exponential races: with
// E_i ~ Exp(1), argmax_i w_i / E_i picks i with probability w_i / sum(w)
// (the Gumbel-max trick). Without replacement the k largest keys of one
// race, in decreasing order, are a weighted sample without replacement —
// PyTorch's own CPU/CUDA algorithm (aten/src/ATen/native/Distributions.cpp,
// multinomial). With replacement each sample runs its own race. Zero-weight
// categories are never drawn. PyTorch's checks on the values (negative, inf
// or NaN weights, an all-zero row) are value checks (LoweringContext::check):
// RuntimeError with CPU's message at the next sync point. Without
// replacement and fewer non-zero categories than k, CPU (2.13) draws
// zero-weight categories after the others; so does this (stable order).
std::vector<Value> LowerMultinomial(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  Value w = ctx.tensor("self");
  const bool replacement = ctx.has("replacement") && ctx.bool_arg("replacement");
  const int64_t k = ctx.int_arg("num_samples");
  // Inputs CPU rejects for their dtype or shape are declined: the call then
  // runs on the CPU, which raises its own error.
  if (!at::isFloatingType(ctx.arg("self").dtype) || (w.rank() != 1 && w.rank() != 2) || k <= 0 ||
      w.dims().back() == 0)
    throw LoweringError(ctx.op_name() + ": input CPU rejects (dtype, rank, num_samples or empty distribution)");
  const bool batched = w.rank() == 2;
  const int64_t rows = batched ? w.dims()[0] : 1, n = w.dims().back();
  TORCH_CHECK(n <= (int64_t{1} << 24), "number of categories cannot exceed 2^24");  // CPU's check
  if (rows == 0) return {Const(b, ElementType::kS64, 0, out.sizes)};
  const at::ScalarType t = FloatCompute(ctx.arg("self").dtype);
  w = b.Reshape(Cast(b, w, t), std::vector<int64_t>{rows, n});
  {
    // CPU's checks on the values (aten/src/ATen/native/Distributions.cpp).
    int64_t both[] = {0, 1}, last[] = {1};
    Value finite = b.IsFinite(w);
    Value negative = b.Compare(w, ConstLike(b, w, 0), CompareDirection::kLT);
    // With replacement and more than one sample CPU's sampling kernel
    // raises "invalid multinomial distribution (encountering ...)".
    ctx.check(ReduceOr(b, b.Or(b.Not(finite), negative), both, false),
              replacement && k > 1 ? "invalid multinomial distribution (encountering probability entry < 0, "
                                     "infinity or NaN)"
                                   : "probability tensor contains either `inf`, `nan` or element < 0");
    Value positive = b.Compare(w, ConstLike(b, w, 0), CompareDirection::kGT);
    Value count = ReduceSum(b, b.Convert(positive, ElementType::kS64), last, false);  // [rows]
    ctx.check(ReduceOr(b, b.Compare(count, ConstLike(b, count, 0), CompareDirection::kEQ), std::vector<int64_t>{0},
                       false),
              "invalid multinomial distribution (sum of probabilities <= 0)");
  }
  const Value stream = OwnStream(ctx);
  auto race = [&](const std::vector<int64_t>& dims, const Value& weights) {
    Value u = Cast(b, UniformFrom(b, stream, dims, t == at::kDouble), t);
    Value e = b.Neg(b.Unary("stablehlo.log_plus_one", b.Neg(u)));  // Exp(1), >= 0
    Value key = b.Div(weights, e);  // w / 0 = inf for w > 0: that category wins
    Value positive = b.Compare(weights, ConstLike(b, weights, 0), CompareDirection::kGT);
    return b.Select(positive, key, ConstLike(b, key, -1));
  };
  Value idx;
  if (replacement) {
    std::vector<int64_t> dims{rows, k, n};
    Value key = race(dims, b.BroadcastInDim(w, dims, std::vector<int64_t>{0, 2}));
    // First index of the maximum along n.
    Value iota = b.Iota(TensorType{ElementType::kS64, dims}, 2);
    Value inputs[] = {key, iota};
    Value inits[] = {Const(b, key.element(), -2), Const(b, ElementType::kS64, 0)};
    int64_t last[] = {2};
    idx = b.Reduce(inputs, inits, last, [](Builder& bb, std::span<const Value> a) {
      // accumulators (value, index), then elements (value, index)
      Value take = bb.Or(bb.Compare(a[2], a[0], CompareDirection::kGT),
                         bb.And(bb.Compare(a[2], a[0], CompareDirection::kEQ),
                                bb.Compare(a[3], a[1], CompareDirection::kLT)));
      return std::vector<Value>{bb.Select(take, a[2], a[0]), bb.Select(take, a[3], a[1])};
    })[1];
  } else {
    if (k > n) throw LoweringError(ctx.op_name() + ": cannot sample n_sample > prob_dist.size(-1) samples without "
                                   "replacement");
    std::vector<int64_t> dims{rows, n};
    Value key = race(dims, w);
    Value iota = b.Iota(TensorType{ElementType::kS64, dims}, 1);
    Value in[] = {key, iota};
    auto sorted = b.Sort(in, 1, true, [](Builder& bb, std::span<const Value> a) {
      return std::vector<Value>{bb.Compare(a[0], a[1], CompareDirection::kGT)};
    });
    int64_t start[] = {0, 0}, limit[] = {rows, k}, stride[] = {1, 1};
    idx = b.Slice(sorted[1], start, limit, stride);
  }
  return {Out(b, idx, out)};
}

// randperm(n) -> (n) in the output's dtype (int64 by default): one random
// u64 key per position from a stream of the op's own (OwnStream: the keys
// are 64-bit draws, more than the output's n elements); positions ordered
// by their keys' high 64 - ceil(log2 n) bits, equal high bits (probability
// ~n^3 / 2^65) in position order.
std::vector<Value> LowerRandperm(LoweringContext& ctx) {
  auto& b = ctx.b;
  const auto& out = ctx.outputs[0];
  const int64_t n = ctx.int_arg("n");
  if (n < 0) throw LoweringError(ctx.op_name() + ": n must be non-negative, got " + std::to_string(n));
  // CPU's randperm checks n against the result's dtype first
  // (check_supported_max_int_with_precision, ATen TensorFactories.cpp):
  // n - 1 converts to it without overflow (Scalar::to's checked conversion,
  // as CPU's at::scalar_tensor), and a floating dtype holds every integer
  // up to n. n is an int argument, part of the key: checked for every call.
  const c10::Scalar top(n > 0 ? n - 1 : n);
  switch (out.dtype) {
    case at::kBool: TORCH_CHECK_NOT_IMPLEMENTED(false, "\"randperm\" not implemented for 'Bool'"); break;
    case at::kByte: (void)top.to<uint8_t>(); break;
    case at::kChar: (void)top.to<int8_t>(); break;
    case at::kShort: (void)top.to<int16_t>(); break;
    case at::kInt: (void)top.to<int32_t>(); break;
    case at::kHalf: TORCH_CHECK(n <= (int64_t{1} << 11) + 1, "n cannot be greater than 2049 for Half type."); break;
    case at::kFloat: TORCH_CHECK(n <= (int64_t{1} << 24) + 1, "n cannot be greater than 2^24+1 for Float type."); break;
    case at::kDouble: TORCH_CHECK(n <= (int64_t{1} << 53) + 1, "n cannot be greater than 2^53+1 for Double type."); break;
    default: break;
  }
  std::vector<int64_t> dims{n};
  if (n == 0) return {Const(b, ToElementType(out.dtype), 0, out.sizes)};
  Value stream = OwnStream(ctx);
  const TensorType u64{ElementType::kU64, dims};
  Value keys = b.RngBitGenerator(stream, u64).second;
  // One u64 per position: the key's high bits, the position in the low
  // `bits` (n <= 2^bits), so every value is distinct and a one-operand sort
  // orders positions by their random high bits, ties by position (what a
  // stable key/position sort gives). One operand: XLA:CPU sorts it several
  // times faster than a (key, position) pair (2^25 elements: 23 s before).
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) < n) ++bits;
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  Value iota = b.Iota(u64, 0);
  Value low_mask = b.ConstantInt(u64, static_cast<int64_t>(mask));
  Value packed = b.Or(b.Sub(keys, b.And(keys, low_mask)), iota);
  Value in[] = {packed};
  auto sorted = b.Sort(in, 0, false, [](Builder& bb, std::span<const Value> a) {
    return std::vector<Value>{bb.Compare(a[0], a[1], CompareDirection::kLT)};
  });
  Value idx = b.And(sorted[0], low_mask);
  return {Out(b, b.Convert(idx, ElementType::kS64), out)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"multinomial", LowerMultinomial, {.needs_rng = true}},
    {"randperm", LowerRandperm, {.needs_rng = true}},
    // poly_flat: element i of the output depends only on (seed, offset + i),
    // static arguments and element i of same-shape tensor operands
    // (normal's mean/std); at a flat shape [B] the first n values are the
    // [n] program's (compiled_op.cpp PlanPolyFlat). A tensor p of
    // bernoulli, a tensor std of normal are value-checked, so such calls
    // stay exact. Not exponential: log1p of the draws on the XLA CPU plugin
    // rounds differently with the array length (exponential_ at n = 9 in
    // the [16] bucket program gave element 0 one ulp off the [9] program's;
    // 32-43 of 306 sizes differ per seed), so its stream would depend on
    // which program ran. normal's log/sqrt/cos showed no such difference:
    // 0 of ~375k f32 and f64 values over 306 sizes (1..299, 511-513, 1000,
    // 1023, 4097, 10000) and two seeds, bucket vs exact program (2026-12-04).
    {"uniform", LowerUniform, {.needs_rng = true, .poly_flat = true}},
    {"normal", LowerNormal, {.needs_rng = true, .poly_flat = true}},
    {"bernoulli", LowerBernoulli, {.needs_rng = true, .poly_flat = true}},
    {"random", LowerRandom, {.needs_rng = true, .poly_flat = true}},
    {"exponential", LowerExponential, {.needs_rng = true}},
});

}  // namespace torch_tpu::lowering
