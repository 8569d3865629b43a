#include "lowering/helpers.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <c10/util/Float8_e8m0fnu.h>

#include <algorithm>
#include <limits>
#include <numeric>

namespace torch_tpu::lowering {

int64_t NormalizeDim(int64_t dim, int64_t rank) {
  int64_t r = std::max<int64_t>(rank, 1);
  if (dim < -r || dim >= r)
    throw LoweringError("Dimension out of range (expected to be in range of [" + std::to_string(-r) +
                        ", " + std::to_string(r - 1) + "], but got " + std::to_string(dim) + ")");
  return dim < 0 ? dim + r : dim;
}

std::vector<int64_t> BroadcastShapes(std::span<const int64_t> a, std::span<const int64_t> b) {
  size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      throw LoweringError("shapes cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Value BroadcastTo(Builder& b, const Value& v, std::span<const int64_t> dims) {
  if (std::equal(v.dims().begin(), v.dims().end(), dims.begin(), dims.end())) return v;
  if (v.rank() > static_cast<int64_t>(dims.size()))
    throw LoweringError("BroadcastTo: operand rank exceeds target rank");
  // Drop size-1 dims that expand, then broadcast_in_dim.
  int64_t lead = static_cast<int64_t>(dims.size()) - v.rank();
  std::vector<int64_t> kept_dims, bdims;
  for (int64_t i = 0; i < v.rank(); ++i) {
    int64_t d = v.dims()[static_cast<size_t>(i)];
    int64_t t = dims[static_cast<size_t>(i + lead)];
    if (d == t) {
      kept_dims.push_back(d);
      bdims.push_back(i + lead);
    } else if (d != 1) {
      throw LoweringError("BroadcastTo: cannot broadcast " + v.type.ToString());
    }
  }
  Value r = b.Reshape(v, kept_dims);
  return b.BroadcastInDim(r, dims, bdims);
}

namespace {
// --- float8 casts -------------------------------------------------------
// PyTorch converts to and from a float8 type through float (c10's
// Float8_* constructors take a float; operator float() gives the value),
// so every cast into float8 first goes to f32 and every cast out of one
// starts with the exact f32 value (XLA's widening convert, exact). The f32 <-> f8 steps reproduce c10's
// bits (torch/headeronly/util/Float8_*.h); tests/python/test_float8.py
// compares them bit for bit with CPU over every bf16/f16 pattern and the
// f32 values around every float8 rounding boundary.

Value U32Const(Builder& b, uint32_t bits, std::span<const int64_t> dims) {
  return Const(b, ElementType::kU32, static_cast<double>(bits), dims);
}

Value S32Const(Builder& b, int32_t v, std::span<const int64_t> dims) {
  return Const(b, ElementType::kS32, static_cast<double>(v), dims);
}

// f32 -> float8 with c10's rounding, computed on the f32 bits with integer
// ops only (no float arithmetic, so no flush-to-zero, and no XLA convert to
// a float8 type: the XLA CPU plugin's f32 -> f8E5M2 convert rounds twice,
// through f16, in executables loaded from the disk cache, e.g. -45055.996f
// gave 0xfa where c10 gives 0xf9). Round to nearest even everywhere, into
// the subnormals too. Out of range and specials, as c10 does
// (torch/headeronly/util/Float8_*.h):
//   e5m2:     finite overflow and +-inf -> +-inf, NaN -> 0x7f | sign;
//   e4m3fn:   finite overflow and +-inf saturate to +-448, NaN -> 0x7f | sign;
//   e5m2fnuz, e4m3fnuz: overflow, +-inf and NaN -> 0x80 (their NaN); a
//             result of zero is +0 (they have no -0);
//   e8m0fnu:  the exponent of |x| rounded by the guard/round/sticky bits
//             (sign ignored), NaN and +-inf -> 0xff (c10's
//             fp8e8m0fnu_from_fp32_value).
Value F32ToFloat8(Builder& b, const Value& x, ElementType to) {
  const auto& d = x.dims();
  auto u32 = [&](uint32_t v) { return U32Const(b, v, d); };
  auto s32 = [&](int32_t v) { return S32Const(b, v, d); };
  auto shr = [&](const Value& v, const Value& n) { return b.Binary("stablehlo.shift_right_logical", v, n); };
  auto shl = [&](const Value& v, const Value& n) { return b.Binary("stablehlo.shift_left", v, n); };
  using hlo::CompareDirection;
  Value bits = b.BitcastConvert(x, ElementType::kU32);
  Value exponent = b.And(shr(bits, u32(23)), u32(0xFF));
  if (to == ElementType::kF8E8M0FNU) {
    auto set = [&](uint32_t mask) { return b.Compare(b.And(bits, u32(mask)), u32(0), CompareDirection::kNE); };
    Value g = set(0x400000), r = set(0x200000), s = set(0x1FFFFF);
    Value lsb = b.Compare(exponent, u32(0), CompareDirection::kNE);
    Value up = b.And(g, b.Or(b.Or(r, s), lsb));
    Value is_special = b.Compare(exponent, u32(0xFF), CompareDirection::kEQ);
    Value rounded = b.Select(b.And(up, b.Not(is_special)), b.Add(exponent, u32(1)), exponent);
    return b.BitcastConvert(b.Convert(rounded, ElementType::kU8), to);
  }
  struct Format {
    int mantissa, bias;
    uint32_t max_finite, overflow, nan;
    bool fnuz;
  };
  Format f{};
  switch (to) {
    case ElementType::kF8E5M2: f = {2, 15, 0x7B, 0x7C, 0x7F, false}; break;
    case ElementType::kF8E4M3FN: f = {3, 7, 0x7E, 0x7E, 0x7F, false}; break;
    case ElementType::kF8E5M2FNUZ: f = {2, 16, 0x7F, 0x80, 0x80, true}; break;
    case ElementType::kF8E4M3FNUZ: f = {3, 8, 0x7F, 0x80, 0x80, true}; break;
    default: throw LoweringError("F32ToFloat8: not a float8 type");
  }
  Value magnitude_bits = b.And(bits, u32(0x7FFFFFFF));
  Value sign = b.And(shr(bits, u32(24)), u32(0x80));
  Value is_nan = b.Compare(magnitude_bits, u32(0x7F800000), CompareDirection::kGT);
  // Significand with its implicit bit (f32 subnormals: none, exponent 1).
  Value normal = b.Compare(exponent, u32(0), CompareDirection::kNE);
  Value significand = b.Or(b.And(bits, u32(0x7FFFFF)), b.Select(normal, u32(0x800000), u32(0)));
  // Target biased exponent if the result were normal; below 1 the result is
  // subnormal and `extra` more bits are dropped.
  Value target = b.Add(b.Convert(b.Max(exponent, u32(1)), ElementType::kS32), s32(f.bias - 127));
  Value clamped = b.Max(target, s32(1));
  Value extra = b.Sub(clamped, target);
  Value shift = b.Convert(b.Min(b.Add(extra, s32(23 - f.mantissa)), s32(31)), ElementType::kU32);
  Value kept = shr(significand, shift);
  Value rest = b.And(significand, b.Sub(shl(u32(1), shift), u32(1)));
  Value half = shl(u32(1), b.Sub(shift, u32(1)));
  Value odd = b.Compare(b.And(kept, u32(1)), u32(0), CompareDirection::kNE);
  Value up = b.Or(b.Compare(rest, half, CompareDirection::kGT),
                  b.And(b.Compare(rest, half, CompareDirection::kEQ), odd));
  kept = b.Add(kept, b.Select(up, u32(1), u32(0)));
  // (clamped - 1) << mantissa + kept: kept holds the implicit bit, so a
  // carry out of the mantissa steps the exponent, and a subnormal that
  // rounds up to 2^mantissa is the smallest normal.
  Value magnitude = b.Add(shl(b.Convert(b.Sub(clamped, s32(1)), ElementType::kU32), u32(f.mantissa)), kept);
  magnitude = b.Select(b.Compare(magnitude, u32(f.max_finite), CompareDirection::kGT), u32(f.overflow), magnitude);
  magnitude = b.Select(is_nan, u32(f.nan), magnitude);
  Value out = b.Or(magnitude, sign);
  if (f.fnuz) {
    // No signed zero and one NaN (0x80): those take no sign bit.
    Value unsigned_code = b.Or(b.Compare(magnitude, u32(0), CompareDirection::kEQ),
                               b.Compare(magnitude, u32(0x80), CompareDirection::kEQ));
    out = b.Select(unsigned_code, magnitude, out);
  }
  return b.BitcastConvert(b.Convert(out, ElementType::kU8), to);
}

// float8 -> f32, exact. e8m0fnu is built from the bits as c10 does (0 is
// 2^-127, 0xFF is NaN with bits 0x7F800001).
Value Float8ToF32(Builder& b, const Value& x) {
  if (x.element() != ElementType::kF8E8M0FNU) return b.Convert(x, ElementType::kF32);
  const auto& d = x.dims();
  Value bits = b.Convert(b.BitcastConvert(x, ElementType::kU8), ElementType::kU32);
  Value out = b.Binary("stablehlo.shift_left", bits, U32Const(b, 23, d));
  out = b.Select(b.Compare(bits, U32Const(b, 0, d), hlo::CompareDirection::kEQ), U32Const(b, 0x00400000, d), out);
  out = b.Select(b.Compare(bits, U32Const(b, 0xFF, d), hlo::CompareDirection::kEQ), U32Const(b, 0x7F800001, d), out);
  return b.BitcastConvert(out, ElementType::kF32);
}

// c10's bits for `value` as float8 type t (through float, as c10::Scalar's
// conversion to a Float8_* type goes).
uint8_t Float8Bits(ElementType t, double value) {
  const float f = static_cast<float>(value);
  switch (t) {
    case ElementType::kF8E5M2: return c10::Float8_e5m2(f).x;
    case ElementType::kF8E4M3FN: return c10::Float8_e4m3fn(f).x;
    case ElementType::kF8E5M2FNUZ: return c10::Float8_e5m2fnuz(f).x;
    case ElementType::kF8E4M3FNUZ: return c10::Float8_e4m3fnuz(f).x;
    case ElementType::kF8E8M0FNU: return c10::Float8_e8m0fnu(f).x;
    default: throw LoweringError("Float8Bits: not a float8 type");
  }
}
}  // namespace

Value CastElement(Builder& b, const Value& v, ElementType to) {
  if (v.element() == to) return v;
  if (hlo::IsFloat8(v.element())) return CastElement(b, Float8ToF32(b, v), to);
  if (hlo::IsFloat8(to)) return F32ToFloat8(b, CastElement(b, v, ElementType::kF32), to);
  if (to == ElementType::kPred) {
    return b.Compare(v, ConstLike(b, v, 0), hlo::CompareDirection::kNE);
  }
  // complex -> real keeps the real part (PyTorch's cast, which warns that
  // the imaginary part is discarded); real -> complex has imaginary 0.
  if (hlo::IsComplex(v.element()) && !hlo::IsComplex(to)) return CastElement(b, b.Real(v), to);
  if (!hlo::IsComplex(v.element()) && hlo::IsComplex(to)) {
    Value re = CastElement(b, v, hlo::ComplexPart(to));
    return b.Complex(re, ConstLike(b, re, 0));
  }
  // bool -> floating: behind an optimization barrier. XLA's simplifier
  // rewrites convert(pred) * y as select(pred, y, 0) (and divides likewise),
  // dropping IEEE's 0 * inf = nan and 0 / 0 = nan that CPU gives: a bool
  // tensor times [inf, nan] gave 0 for its False elements (review, session
  // 21). The barrier keeps the convert opaque to it.
  if (v.element() == ElementType::kPred && hlo::IsFloating(to)) {
    Value c = b.Convert(v, to);
    const hlo::TensorType type = c.type;
    return b.Op("stablehlo.optimization_barrier", std::span<const Value>(&c, 1),
                std::span<const hlo::TensorType>(&type, 1))[0];
  }
  return b.Convert(v, to);
}

Value Cast(Builder& b, const Value& v, at::ScalarType to) { return CastElement(b, v, ToElementType(to)); }

Value Const(Builder& b, ElementType t, double value, std::span<const int64_t> dims) {
  Value s = hlo::IsFloat8(t) ? b.ConstantBits(TensorType{t, {}}, Float8Bits(t, value)) : b.Constant(TensorType{t, {}}, value);
  if (dims.empty()) return s;
  return b.BroadcastInDim(s, dims, {});
}

Value ConstLike(Builder& b, const Value& like, double value) {
  return Const(b, like.element(), value, like.dims());
}

Value Prepare(Builder& b, const Value& v, at::ScalarType dtype, std::span<const int64_t> dims) {
  return BroadcastTo(b, Cast(b, v, dtype), dims);
}

std::vector<int64_t> ReductionDims(std::span<const int64_t> dims, int64_t rank) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    out.resize(static_cast<size_t>(rank));
    std::iota(out.begin(), out.end(), 0);
    return out;
  }
  for (int64_t d : dims) out.push_back(NormalizeDim(d, rank));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (rank == 0) out.clear();
  return out;
}

std::vector<int64_t> KeepDimShape(std::span<const int64_t> shape, std::span<const int64_t> dims) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  for (int64_t d : dims) out[static_cast<size_t>(d)] = 1;
  return out;
}

namespace {
Value ReduceWith(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim,
                 double init, std::string_view op) {
  Value init_v = Const(b, x.element(), init);
  std::string op_name(op);
  auto r = b.Reduce(std::span(&x, 1), std::span(&init_v, 1), dims,
                    [&](Builder& bb, std::span<const Value> a) {
                      return std::vector<Value>{bb.Binary(op_name, a[0], a[1])};
                    })[0];
  if (keepdim) r = b.Reshape(r, KeepDimShape(x.dims(), dims));
  return r;
}

double Lowest(ElementType t) {
  if (hlo::IsFloating(t)) return -std::numeric_limits<double>::infinity();
  switch (t) {
    case ElementType::kPred: return 0;
    case ElementType::kS8: return -128;
    case ElementType::kS16: return -32768;
    case ElementType::kS32: return -2147483648.0;
    case ElementType::kS64: return static_cast<double>(std::numeric_limits<int64_t>::min());
    default: return 0;
  }
}
double Highest(ElementType t) {
  if (hlo::IsFloating(t)) return std::numeric_limits<double>::infinity();
  switch (t) {
    case ElementType::kPred: return 1;
    case ElementType::kS8: return 127;
    case ElementType::kS16: return 32767;
    case ElementType::kS32: return 2147483647.0;
    case ElementType::kS64: return 9.2233720368547748e18;  // rounded; see ReduceMin
    case ElementType::kU8: return 255;
    case ElementType::kU16: return 65535;
    case ElementType::kU32: return 4294967295.0;
    default: return 0;
  }
}
}  // namespace

Value ReduceSum(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim) {
  return ReduceWith(b, x, dims, keepdim, 0, "stablehlo.add");
}
Value ReduceProd(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim) {
  return ReduceWith(b, x, dims, keepdim, 1, "stablehlo.multiply");
}
Value ReduceAnd(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim) {
  return ReduceWith(b, x, dims, keepdim, 1, "stablehlo.and");
}
Value ReduceOr(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim) {
  return ReduceWith(b, x, dims, keepdim, 0, "stablehlo.or");
}

Value ReduceMax(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim) {
  Value init = x.element() == ElementType::kS64
                   ? b.ConstantInt(TensorType{x.element(), {}}, std::numeric_limits<int64_t>::min())
                   : Const(b, x.element(), Lowest(x.element()));
  auto r = b.Reduce(std::span(&x, 1), std::span(&init, 1), dims,
                    [](Builder& bb, std::span<const Value> a) {
                      return std::vector<Value>{MaxPropagateNaN(bb, a[0], a[1])};
                    })[0];
  if (keepdim) r = b.Reshape(r, KeepDimShape(x.dims(), dims));
  return r;
}

Value ReduceMin(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim) {
  Value init = x.element() == ElementType::kS64
                   ? b.ConstantInt(TensorType{x.element(), {}}, std::numeric_limits<int64_t>::max())
                   : Const(b, x.element(), Highest(x.element()));
  auto r = b.Reduce(std::span(&x, 1), std::span(&init, 1), dims,
                    [](Builder& bb, std::span<const Value> a) {
                      return std::vector<Value>{MinPropagateNaN(bb, a[0], a[1])};
                    })[0];
  if (keepdim) r = b.Reshape(r, KeepDimShape(x.dims(), dims));
  return r;
}

Value MaxPropagateNaN(Builder& b, const Value& x, const Value& y) {
  Value m = b.Max(x, y);
  if (!hlo::IsFloating(x.element())) return m;
  Value x_nan = b.Compare(x, x, hlo::CompareDirection::kNE);
  Value y_nan = b.Compare(y, y, hlo::CompareDirection::kNE);
  return b.Select(x_nan, x, b.Select(y_nan, y, m));
}

Value MinPropagateNaN(Builder& b, const Value& x, const Value& y) {
  Value m = b.Min(x, y);
  if (!hlo::IsFloating(x.element())) return m;
  Value x_nan = b.Compare(x, x, hlo::CompareDirection::kNE);
  Value y_nan = b.Compare(y, y, hlo::CompareDirection::kNE);
  return b.Select(x_nan, x, b.Select(y_nan, y, m));
}

at::ScalarType OpMathType(at::ScalarType out) {
  if (out == at::kBFloat16 || out == at::kHalf) return at::kFloat;
  return out;
}

// ---------------------------------------------------------------------------
// Views of a flat storage.

namespace {

struct DenseLayout {
  bool dense = false;
  std::vector<int64_t> order;      // effective dims, outermost (largest stride) first
  std::vector<int64_t> effective;  // effective dims in original order
  int64_t span = 0;
};

// Effective dims: size > 1 and stride != 0. Dense if, sorted by stride, they
// tile a contiguous block of storage exactly.
DenseLayout AnalyzeDense(const ViewLayout& v) {
  DenseLayout d;
  for (size_t i = 0; i < v.sizes.size(); ++i)
    if (v.sizes[i] > 1 && v.strides[i] != 0) d.effective.push_back(static_cast<int64_t>(i));
  d.order = d.effective;
  std::stable_sort(d.order.begin(), d.order.end(), [&](int64_t a, int64_t b) {
    return v.strides[static_cast<size_t>(a)] > v.strides[static_cast<size_t>(b)];
  });
  int64_t expected = 1;
  d.dense = true;
  for (auto it = d.order.rbegin(); it != d.order.rend(); ++it) {
    size_t i = static_cast<size_t>(*it);
    if (v.strides[i] != expected) {
      d.dense = false;
      break;
    }
    expected *= v.sizes[i];
  }
  d.span = expected;
  return d;
}

bool HasBroadcast(const ViewLayout& v) {
  for (size_t i = 0; i < v.sizes.size(); ++i)
    if (v.sizes[i] > 1 && v.strides[i] == 0) return true;
  return false;
}

// Flat element index of every element of the view, shape = view sizes.
Value ViewIndices(Builder& b, const ViewLayout& v, ElementType index_type) {
  TensorType t{index_type, v.sizes};
  Value idx = Const(b, index_type, static_cast<double>(v.offset), v.sizes);
  for (size_t i = 0; i < v.sizes.size(); ++i) {
    if (v.sizes[i] <= 1 || v.strides[i] == 0) continue;
    Value iota = b.Iota(t, static_cast<int64_t>(i));
    Value stride = Const(b, index_type, static_cast<double>(v.strides[i]), v.sizes);
    idx = b.Add(idx, b.Mul(iota, stride));
  }
  return idx;
}


}  // namespace

Value ReinterpretFlat(Builder& b, const Value& flat, ElementType to) {
  const ElementType from = flat.element();
  if (from == to) return flat;
  // Complex elements are (real, imaginary) pairs of their part type, as in
  // PyTorch's (and PJRT's) memory layout: c64[N] <-> f32[2N], through
  // stablehlo.real/imag/complex (XLA fuses them with the view's slice).
  if (hlo::IsComplex(from)) {
    const int64_t n = flat.dims()[0];
    int64_t col[] = {n, 1}, flat2[] = {2 * n};
    Value parts[] = {b.Reshape(b.Real(flat), col), b.Reshape(b.Imag(flat), col)};
    Value interleaved = b.Reshape(b.Concatenate(parts, 1), flat2);
    return ReinterpretFlat(b, interleaved, to);
  }
  if (hlo::IsComplex(to)) {
    Value p = ReinterpretFlat(b, flat, hlo::ComplexPart(to));
    int64_t m = p.dims()[0];
    if (m % 2 != 0) {  // a trailing odd part no complex element can address (x[:8] of 9 floats)
      int64_t s0[] = {0}, l0[] = {m - 1}, st1[] = {1};
      p = b.Slice(p, s0, l0, st1);
      --m;
    }
    int64_t pairs[] = {m / 2, 2}, half[] = {m / 2};
    Value g = b.Reshape(p, pairs);
    int64_t s0[] = {0, 0}, l0[] = {m / 2, 1}, s1[] = {0, 1}, l1[] = {m / 2, 2}, st[] = {1, 1};
    Value re = b.Reshape(b.Slice(g, s0, l0, st), half);
    Value im = b.Reshape(b.Slice(g, s1, l1, st), half);
    return b.Complex(re, im);
  }
  auto bytes = [](ElementType t) { return std::max(1, hlo::BitWidth(t) / 8); };
  if (from == ElementType::kPred || to == ElementType::kPred) {
    // A bool element is one byte holding 0 or 1 (as PyTorch stores it): bool
    // <-> u8 is a 0/1 cast, and wider types go through those bytes.
    if (from == ElementType::kPred) {
      Value bytes_u8 = CastElement(b, flat, ElementType::kU8);
      return to == ElementType::kU8 ? bytes_u8 : ReinterpretFlat(b, bytes_u8, to);
    }
    Value bytes_u8 = bytes(from) == 1 ? flat : ReinterpretFlat(b, flat, ElementType::kU8);
    return CastElement(b, bytes_u8, ElementType::kPred);
  }
  const int64_t n = flat.dims()[0];
  const int bf = bytes(from), bt = bytes(to);
  if (bf == bt) return b.BitcastConvert(flat, to);
  if (bf > bt) {  // split: f32[N] -> u8[N, 4] -> u8[4N]
    const int64_t k = bf / bt;
    Value split = b.Op("stablehlo.bitcast_convert", std::span(&flat, 1),
                       std::vector<TensorType>{TensorType{to, {n, k}}})[0];
    int64_t dims[] = {n * k};
    return b.Reshape(split, dims);
  }
  const int64_t k = bt / bf;  // join: u8[4N] -> u8[N, 4] -> f32[N]
  if (n % k != 0)
    throw LoweringError("storage of " + std::to_string(n) + " elements cannot be read as " +
                        std::string(hlo::MlirName(to)));
  int64_t grouped[] = {n / k, k};
  Value g = b.Reshape(flat, grouped);
  return b.Op("stablehlo.bitcast_convert", std::span(&g, 1), std::vector<TensorType>{TensorType{to, {n / k}}})[0];
}

Value ReadView(Builder& b, const Value& flat, const ViewLayout& v) {
  const int64_t n = Numel(v.sizes);
  const int64_t storage = flat.dims()[0];
  if (n == 0) return Const(b, flat.element(), 0, v.sizes);
  DenseLayout d = AnalyzeDense(v);
  if (d.dense && v.offset + d.span <= storage) {
    int64_t start[] = {v.offset}, limit[] = {v.offset + d.span}, stride[] = {1};
    Value block = b.Slice(flat, start, limit, stride);
    std::vector<int64_t> sorted_sizes;
    for (int64_t i : d.order) sorted_sizes.push_back(v.sizes[static_cast<size_t>(i)]);
    block = b.Reshape(block, sorted_sizes);
    // Transpose from stride order to the original order of effective dims.
    std::vector<int64_t> perm;
    for (int64_t e : d.effective)
      perm.push_back(std::find(d.order.begin(), d.order.end(), e) - d.order.begin());
    block = b.Transpose(block, perm);
    return b.BroadcastInDim(block, v.sizes, d.effective);
  }
  ElementType it = storage < (int64_t{1} << 31) ? ElementType::kS32 : ElementType::kS64;
  Value idx = ViewIndices(b, v, it);
  std::vector<int64_t> idx_dims = v.sizes;
  idx_dims.push_back(1);
  idx = b.Reshape(idx, idx_dims);
  hlo::GatherDims g;
  g.collapsed_slice_dims = {0};
  g.start_index_map = {0};
  g.index_vector_dim = static_cast<int64_t>(v.sizes.size());
  int64_t slice_sizes[] = {1};
  return b.Gather(flat, idx, g, slice_sizes, TensorType{flat.element(), v.sizes});
}

Value WriteView(Builder& b, const Value& flat, const ViewLayout& v, const Value& value) {
  const int64_t n = Numel(v.sizes);
  const int64_t storage = flat.dims()[0];
  if (n == 0) return flat;
  if (value.element() != flat.element())
    throw LoweringError("WriteView: value type " + value.type.ToString() + " differs from storage " +
                        flat.type.ToString());
  DenseLayout d = AnalyzeDense(v);
  if (d.dense && !HasBroadcast(v) && v.offset + d.span <= storage) {
    std::vector<int64_t> eff_sizes;
    for (int64_t e : d.effective) eff_sizes.push_back(v.sizes[static_cast<size_t>(e)]);
    Value x = b.Reshape(value, eff_sizes);
    std::vector<int64_t> perm;  // original effective order -> stride order
    for (int64_t o : d.order)
      perm.push_back(std::find(d.effective.begin(), d.effective.end(), o) - d.effective.begin());
    x = b.Transpose(x, perm);
    int64_t span[] = {d.span};
    x = b.Reshape(x, span);
    if (v.offset == 0 && d.span == storage) return x;
    Value start = b.ConstantInt(TensorType{ElementType::kS64, {}}, v.offset);
    return b.DynamicUpdateSlice(flat, x, std::span(&start, 1));
  }
  ElementType it = storage < (int64_t{1} << 31) ? ElementType::kS32 : ElementType::kS64;
  Value idx = ViewIndices(b, v, it);
  int64_t idx_dims[] = {n, 1};
  idx = b.Reshape(idx, idx_dims);
  int64_t upd_dims[] = {n};
  Value upd = b.Reshape(value, upd_dims);
  hlo::ScatterDims s;
  s.inserted_window_dims = {0};
  s.scatter_dims_to_operand_dims = {0};
  s.index_vector_dim = 1;
  return b.Scatter(flat, idx, upd, s,
                   [](Builder&, std::span<const Value> a) { return std::vector<Value>{a[1]}; });
}

int64_t Numel(std::span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

Value ResizeFlat(Builder& b, const Value& flat, int64_t n) {
  if (flat.rank() != 1) throw LoweringError("ResizeFlat: expected a rank-1 value");
  const int64_t have = flat.dims()[0];
  if (have == n) return flat;
  if (have > n) {
    int64_t start[] = {0}, limit[] = {n}, stride[] = {1};
    return b.Slice(flat, start, limit, stride);
  }
  int64_t low[] = {0}, high[] = {n - have}, interior[] = {0};
  return b.Pad(flat, Const(b, flat.element(), 0.0), low, high, interior);
}

Value Fit(Builder& b, const Value& v, std::span<const int64_t> sizes) {
  if (std::equal(v.dims().begin(), v.dims().end(), sizes.begin(), sizes.end())) return v;
  if (v.type.numel() == Numel(sizes)) return b.Reshape(v, sizes);
  return BroadcastTo(b, v, sizes);
}

Value Out(Builder& b, const Value& v, const OutputSpec& spec) { return Fit(b, Cast(b, v, spec.dtype), spec.sizes); }

double MaxFinite(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return 65504.0;
    case at::kBFloat16: return 3.3895313892515355e38;
    case at::kFloat: return std::numeric_limits<float>::max();
    default: return std::numeric_limits<double>::max();
  }
}

namespace {

at::ScalarType PromoteSkipUndefined(at::ScalarType a, at::ScalarType b) {
  if (a == at::ScalarType::Undefined) return b;
  if (b == at::ScalarType::Undefined) return a;
  return c10::promoteTypes(a, b);
}

at::ScalarType CombineCategories(at::ScalarType higher, at::ScalarType lower) {
  if (at::isComplexType(higher)) return higher;
  if (at::isComplexType(lower)) return at::isFloatingType(higher) ? c10::toComplexType(higher) : lower;
  if (at::isFloatingType(higher)) return higher;
  if (higher == at::kBool || at::isFloatingType(lower)) return PromoteSkipUndefined(higher, lower);
  if (higher != at::ScalarType::Undefined) return higher;
  return lower;
}

}  // namespace

at::ScalarType ResultType(const LoweringContext& ctx, std::initializer_list<std::string_view> names) {
  using Kind = LoweredArg::Kind;
  at::ScalarType dim = at::ScalarType::Undefined, zero = at::ScalarType::Undefined,
                 wrapped = at::ScalarType::Undefined;
  for (std::string_view name : names) {
    const LoweredArg* a = ctx.find(name);
    if (!a) continue;
    if (a->kind == Kind::kTensor) {
      if (a->value.rank() > 0) dim = PromoteSkipUndefined(dim, a->dtype);
      else zero = PromoteSkipUndefined(zero, a->dtype);
    } else if (a->kind == Kind::kScalar) {
      if (a->wrapped_number) {
        at::ScalarType t = at::isFloatingType(a->dtype)  ? c10::get_default_dtype_as_scalartype()
                           : at::isComplexType(a->dtype) ? c10::typeMetaToScalarType(c10::get_default_complex_dtype())
                                                         : a->dtype;
        wrapped = PromoteSkipUndefined(wrapped, t);
      } else {
        zero = PromoteSkipUndefined(zero, a->dtype);
      }
    }
  }
  at::ScalarType r = CombineCategories(dim, CombineCategories(zero, wrapped));
  if (r == at::ScalarType::Undefined) throw LoweringError(ctx.op_name() + ": no tensor operand");
  return r;
}

Value RandomBits64(Builder& b, const Value& rng_state, std::span<const int64_t> dims) {
  std::vector<int64_t> d(dims.begin(), dims.end());
  return b.RngBitGenerator(rng_state, TensorType{ElementType::kU64, d}).second;
}

std::pair<Value, Value> RandomBits32Pair(Builder& b, const Value& rng_state, std::span<const int64_t> dims) {
  Value bits = RandomBits64(b, rng_state, dims);
  auto u64 = [&](int64_t x) { return BroadcastTo(b, b.ConstantInt(TensorType{ElementType::kU64, {}}, x), bits.dims()); };
  Value lo = b.Convert(b.And(bits, u64(0xFFFFFFFFLL)), ElementType::kU32);
  Value hi = b.Convert(b.Binary("stablehlo.shift_right_logical", bits, u64(32)), ElementType::kU32);
  return {lo, hi};
}

Value RandomBits32(Builder& b, const Value& rng_state, std::span<const int64_t> dims) {
  return RandomBits32Pair(b, rng_state, dims).first;
}

}  // namespace torch_tpu::lowering
