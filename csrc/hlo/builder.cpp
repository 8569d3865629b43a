#include "hlo/builder.h"

#include <bit>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace torch_tpu::hlo {
namespace {

// Appends v in decimal (std::to_chars: no temporary string; the module
// text is built on the calling thread of every compile, ~15 us per fused
// region call before).
void AppendInt(std::string& s, int64_t v) {
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  s.append(buf, end);
}

// Appends t as TensorType::ToString spells it.
void AppendType(std::string& s, const TensorType& t) {
  s += "tensor<";
  for (int64_t d : t.dims) {
    AppendInt(s, d);
    s += 'x';
  }
  s += MlirName(t.element);
  s += '>';
}

// IEEE binary16 bits of a float, round to nearest even.
uint16_t FloatToHalfBits(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  int32_t e = static_cast<int32_t>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;
  return static_cast<uint16_t>(half);
}

uint16_t FloatToBFloat16Bits(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((x >> 16) | 0x40u);
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

std::string Hex(uint64_t bits, int hex_digits) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%0*llX", hex_digits, static_cast<unsigned long long>(bits));
  return buf;
}

// The literal of `value` in an MLIR dense attribute of element type t.
std::string ScalarLiteral(ElementType t, double value) {
  switch (t) {
    case ElementType::kPred: return value != 0 ? "true" : "false";
    case ElementType::kF16: return Hex(FloatToHalfBits(static_cast<float>(value)), 4);
    case ElementType::kBF16: return Hex(FloatToBFloat16Bits(static_cast<float>(value)), 4);
    case ElementType::kF32: return Hex(std::bit_cast<uint32_t>(static_cast<float>(value)), 8);
    case ElementType::kF64: return Hex(std::bit_cast<uint64_t>(value), 16);
    case ElementType::kC64:
    case ElementType::kC128: {
      // (real, imaginary) as float literals: MLIR rejects integer literals here.
      char buf[64];
      std::snprintf(buf, sizeof(buf), "(%.17e, 0.000000e+00)", value);
      return buf;
    }
    default: {
      if (IsFloat8(t))
        throw BuildError(std::string("constant of type ") + std::string(MlirName(t)) +
                         ": float8 rounding is the caller's (use ConstantBits)");
      if (IsUnsignedInteger(t)) return std::to_string(static_cast<uint64_t>(value));
      return std::to_string(static_cast<int64_t>(value));
    }
  }
}

void AppendTypes(std::string& s, std::span<const TensorType> types) {
  for (size_t i = 0; i < types.size(); ++i) {
    if (i) s += ", ";
    AppendType(s, types[i]);
  }
}

std::string Types(std::span<const TensorType> types) {
  std::string s;
  AppendTypes(s, types);
  return s;
}

void AppendValueTypes(std::string& s, std::span<const Value> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) s += ", ";
    AppendType(s, values[i].type);
  }
}

void CheckSameType(std::string_view op, const Value& a, const Value& b) {
  if (!(a.type == b.type))
    throw BuildError(std::string(op) + ": operand types differ: " + a.type.ToString() + " vs " +
                     b.type.ToString());
}

std::string PaddingAttr(std::span<const std::pair<int64_t, int64_t>> padding) {
  std::string s = "dense<";
  if (padding.empty()) {
    s += "0> : tensor<0x2xi64>";
    return s;
  }
  s += "[";
  for (size_t i = 0; i < padding.size(); ++i) {
    if (i) s += ", ";
    s += "[" + std::to_string(padding[i].first) + ", " + std::to_string(padding[i].second) + "]";
  }
  s += "]> : tensor<" + std::to_string(padding.size()) + "x2xi64>";
  return s;
}

}  // namespace

std::string_view MlirName(ElementType t) {
  switch (t) {
    case ElementType::kPred: return "i1";
    case ElementType::kS8: return "i8";
    case ElementType::kS16: return "i16";
    case ElementType::kS32: return "i32";
    case ElementType::kS64: return "i64";
    case ElementType::kU8: return "ui8";
    case ElementType::kU16: return "ui16";
    case ElementType::kU32: return "ui32";
    case ElementType::kU64: return "ui64";
    case ElementType::kF16: return "f16";
    case ElementType::kBF16: return "bf16";
    case ElementType::kF32: return "f32";
    case ElementType::kF64: return "f64";
    case ElementType::kC64: return "complex<f32>";
    case ElementType::kC128: return "complex<f64>";
    case ElementType::kF8E5M2: return "f8E5M2";
    case ElementType::kF8E4M3FN: return "f8E4M3FN";
    case ElementType::kF8E5M2FNUZ: return "f8E5M2FNUZ";
    case ElementType::kF8E4M3FNUZ: return "f8E4M3FNUZ";
    case ElementType::kF8E8M0FNU: return "f8E8M0FNU";
  }
  return "?";
}

bool IsFloat8(ElementType t) {
  return t == ElementType::kF8E5M2 || t == ElementType::kF8E4M3FN || t == ElementType::kF8E5M2FNUZ ||
         t == ElementType::kF8E4M3FNUZ || t == ElementType::kF8E8M0FNU;
}
bool IsFloating(ElementType t) {
  return t == ElementType::kF16 || t == ElementType::kBF16 || t == ElementType::kF32 ||
         t == ElementType::kF64 || IsFloat8(t);
}
bool IsComplex(ElementType t) { return t == ElementType::kC64 || t == ElementType::kC128; }
ElementType ComplexPart(ElementType t) {
  if (t == ElementType::kC64) return ElementType::kF32;
  if (t == ElementType::kC128) return ElementType::kF64;
  throw BuildError("ComplexPart: " + std::string(MlirName(t)) + " is not complex");
}
ElementType ComplexOf(ElementType t) {
  if (t == ElementType::kF32) return ElementType::kC64;
  if (t == ElementType::kF64) return ElementType::kC128;
  throw BuildError("ComplexOf: complex numbers have f32 or f64 parts, not " + std::string(MlirName(t)));
}
bool IsSignedInteger(ElementType t) {
  return t == ElementType::kS8 || t == ElementType::kS16 || t == ElementType::kS32 ||
         t == ElementType::kS64;
}
bool IsUnsignedInteger(ElementType t) {
  return t == ElementType::kU8 || t == ElementType::kU16 || t == ElementType::kU32 ||
         t == ElementType::kU64;
}
int BitWidth(ElementType t) {
  switch (t) {
    case ElementType::kPred: return 1;
    case ElementType::kS8: case ElementType::kU8: return 8;
    case ElementType::kF8E5M2: case ElementType::kF8E4M3FN: case ElementType::kF8E5M2FNUZ:
    case ElementType::kF8E4M3FNUZ: case ElementType::kF8E8M0FNU: return 8;
    case ElementType::kS16: case ElementType::kU16: case ElementType::kF16: case ElementType::kBF16: return 16;
    case ElementType::kS32: case ElementType::kU32: case ElementType::kF32: return 32;
    case ElementType::kS64: case ElementType::kU64: case ElementType::kF64: case ElementType::kC64: return 64;
    case ElementType::kC128: return 128;
  }
  return 0;
}

int64_t TensorType::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string TensorType::ToString() const {
  std::string s;
  s.reserve(8 + 5 * dims.size() + 4);
  AppendType(s, *this);
  return s;
}

std::string I64Array(std::span<const int64_t> v) {
  std::string s = "array<i64";
  for (size_t i = 0; i < v.size(); ++i) {
    s += i ? ", " : ": ";
    AppendInt(s, v[i]);
  }
  s += '>';
  return s;
}

std::string I64List(std::span<const int64_t> v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    AppendInt(s, v[i]);
  }
  s += ']';
  return s;
}

Value Builder::Parameter(const TensorType& type) {
  if (returned_) throw BuildError("Parameter: called after Return()");
  Value v{"%arg" + std::to_string(params_.size()), type};
  params_.push_back(type);
  return v;
}

void Builder::Return(std::span<const Value> results) {
  if (returned_) throw BuildError("Return: called twice");
  returned_ = true;
  for (const auto& r : results) {
    results_.push_back(r.type);
    result_names_.push_back(r.name);
  }
}

void Builder::AliasParameter(size_t param_index, size_t result_index) {
  if (param_index >= params_.size())
    throw BuildError("AliasParameter: argument " + std::to_string(param_index) + " does not exist");
  for (const auto& [p, r] : aliases_)
    if (p == param_index || r == result_index)
      throw BuildError("AliasParameter: argument " + std::to_string(param_index) + " or result " +
                       std::to_string(result_index) + " is already aliased");
  aliases_.emplace_back(param_index, result_index);
}

std::string Builder::Module() const {
  if (!returned_) throw BuildError("Module: Return() was not called");
  std::string s;
  s.reserve(body_.size() + 64 * (params_.size() + results_.size()) + 128);
  s += "module @torch_tpu {\n  func.func public @main(";
  for (size_t i = 0; i < params_.size(); ++i) {
    if (i) s += ", ";
    s += "%arg" + std::to_string(i) + ": " + params_[i].ToString();
    for (const auto& [p, r] : aliases_) {
      if (p != i) continue;
      if (r >= results_.size() || !(results_[r] == params_[i]))
        throw BuildError("AliasParameter: result " + std::to_string(r) + " does not have argument " +
                         std::to_string(p) + "'s type " + params_[i].ToString());
      s += " {tf.aliasing_output = " + std::to_string(r) + " : i32}";
    }
  }
  s += ") -> (" + Types(results_) + ") {\n";
  s += body_;
  s += "    \"func.return\"(";
  for (size_t i = 0; i < result_names_.size(); ++i) {
    if (i) s += ", ";
    s += result_names_[i];
  }
  s += ") : (" + Types(results_) + ") -> ()\n  }\n}\n";
  return s;
}

std::string Builder::NewName() {
  std::string name = "%";
  AppendInt(name, next_id_++);
  return name;
}

std::string Builder::Emit(std::string_view name, std::span<const Value> operands,
                          std::span<const TensorType> result_types, std::string_view attributes,
                          std::span<const std::pair<std::vector<TensorType>, RegionFn>> regions) {
  std::string result = NewName();
  // Appended in place (no per-line temporaries).
  body_.append(static_cast<size_t>(indent_ + 2), ' ');
  if (!result_types.empty()) {
    body_ += result;
    if (result_types.size() > 1) {
      body_ += ':';
      AppendInt(body_, static_cast<int64_t>(result_types.size()));
    }
    body_ += " = ";
  }
  body_ += '"';
  body_ += name;
  body_ += "\"(";
  for (size_t i = 0; i < operands.size(); ++i) {
    if (i) body_ += ", ";
    body_ += operands[i].name;
  }
  body_ += ')';
  if (!regions.empty()) {
    body_ += " (";
    for (size_t r = 0; r < regions.size(); ++r) {
      if (r) body_ += ", ";
      body_ += "{\n";
      indent_ += 2;
      std::vector<Value> args;
      std::string header(static_cast<size_t>(indent_), ' ');
      header += "^bb0(";
      for (size_t i = 0; i < regions[r].first.size(); ++i) {
        Value a{NewName(), regions[r].first[i]};
        if (i) header += ", ";
        header += a.name + ": " + a.type.ToString();
        args.push_back(std::move(a));
      }
      header += "):\n";
      body_ += header;
      std::vector<Value> rets = regions[r].second(*this, args);
      std::string ret(static_cast<size_t>(indent_ + 2), ' ');
      ret += "\"stablehlo.return\"(";
      for (size_t i = 0; i < rets.size(); ++i) {
        if (i) ret += ", ";
        ret += rets[i].name;
      }
      ret += ") : (";
      AppendValueTypes(ret, rets);
      ret += ") -> ()\n";
      body_ += ret;
      indent_ -= 2;
      body_ += std::string(static_cast<size_t>(indent_ + 2), ' ') + "}";
    }
    body_ += ")";
  }
  if (!attributes.empty()) {
    body_ += " {";
    body_ += attributes;
    body_ += "}";
  }
  body_ += " : (";
  AppendValueTypes(body_, operands);
  body_ += ") -> ";
  if (result_types.size() == 1) {
    AppendType(body_, result_types[0]);
  } else {
    body_ += '(';
    AppendTypes(body_, result_types);
    body_ += ')';
  }
  body_ += '\n';
  return result;
}

std::vector<Value> Builder::EmitValues(
    std::string_view name, std::span<const Value> operands,
    std::span<const TensorType> result_types, std::string_view attributes,
    std::span<const std::pair<std::vector<TensorType>, RegionFn>> regions) {
  std::string base = Emit(name, operands, result_types, attributes, regions);
  std::vector<Value> out;
  if (result_types.size() == 1) {
    out.push_back({std::move(base), result_types[0]});
  } else {
    for (size_t i = 0; i < result_types.size(); ++i)
      out.push_back({base + "#" + std::to_string(i), result_types[i]});
  }
  return out;
}

Value Builder::Emit1(std::string_view name, std::span<const Value> operands,
                     const TensorType& result, std::string_view attributes) {
  return {Emit(name, operands, std::span<const TensorType>(&result, 1), attributes), result};
}

std::vector<Value> Builder::Op(std::string_view name, std::span<const Value> operands,
                               std::span<const TensorType> result_types,
                               std::string_view attributes) {
  return EmitValues(name, operands, result_types, attributes);
}

Value Builder::Constant(const TensorType& type, double value) {
  std::string attr = "value = dense<" + ScalarLiteral(type.element, value) + "> : " + type.ToString();
  return Emit1("stablehlo.constant", {}, type, attr);
}

Value Builder::ConstantBits(const TensorType& type, uint64_t bits) {
  if (!IsFloating(type.element))
    throw BuildError(std::string("ConstantBits: ") + std::string(MlirName(type.element)) + " is not a floating type");
  const int width = BitWidth(type.element);
  if (width < 64) bits &= (uint64_t{1} << width) - 1;
  std::string attr = "value = dense<" + Hex(bits, width / 4) + "> : " + type.ToString();
  return Emit1("stablehlo.constant", {}, type, attr);
}

Value Builder::ConstantInt(const TensorType& type, int64_t value) {
  std::string lit;
  if (IsFloating(type.element) || IsComplex(type.element) || type.element == ElementType::kPred)
    lit = ScalarLiteral(type.element, static_cast<double>(value));
  else
    lit = std::to_string(value);
  std::string attr = "value = dense<" + lit + "> : " + type.ToString();
  return Emit1("stablehlo.constant", {}, type, attr);
}

Value Builder::ConstantI64Vector(std::span<const int64_t> values) {
  TensorType t{ElementType::kS64, {static_cast<int64_t>(values.size())}};
  std::string attr = "value = dense<" + I64List(values) + "> : " + t.ToString();
  if (values.empty()) attr = "value = dense<> : " + t.ToString();
  return Emit1("stablehlo.constant", {}, t, attr);
}

Value Builder::Iota(const TensorType& type, int64_t dimension) {
  if (dimension < 0 || dimension >= type.rank()) throw BuildError("Iota: dimension out of range");
  return Emit1("stablehlo.iota", {}, type, "iota_dimension = " + std::to_string(dimension) + " : i64");
}

Value Builder::Reshape(const Value& x, std::span<const int64_t> dims) {
  TensorType t{x.element(), {dims.begin(), dims.end()}};
  if (t.numel() != x.type.numel())
    throw BuildError("Reshape: element count differs: " + x.type.ToString() + " -> " + t.ToString());
  if (t == x.type) return x;
  Value in[] = {x};
  return Emit1("stablehlo.reshape", in, t);
}

Value Builder::BroadcastInDim(const Value& x, std::span<const int64_t> dims,
                              std::span<const int64_t> broadcast_dimensions) {
  if (static_cast<int64_t>(broadcast_dimensions.size()) != x.rank())
    throw BuildError("BroadcastInDim: broadcast_dimensions must have one entry per operand dim");
  TensorType t{x.element(), {dims.begin(), dims.end()}};
  if (t == x.type) {
    bool identity = true;
    for (size_t i = 0; i < broadcast_dimensions.size(); ++i)
      identity &= broadcast_dimensions[i] == static_cast<int64_t>(i);
    if (identity) return x;
  }
  Value in[] = {x};
  return Emit1("stablehlo.broadcast_in_dim", in, t,
               "broadcast_dimensions = " + I64Array(broadcast_dimensions));
}

Value Builder::Transpose(const Value& x, std::span<const int64_t> permutation) {
  if (static_cast<int64_t>(permutation.size()) != x.rank())
    throw BuildError("Transpose: permutation rank mismatch");
  TensorType t{x.element(), {}};
  bool identity = true;
  for (size_t i = 0; i < permutation.size(); ++i) {
    t.dims.push_back(x.dims()[static_cast<size_t>(permutation[i])]);
    identity &= permutation[i] == static_cast<int64_t>(i);
  }
  if (identity) return x;
  Value in[] = {x};
  return Emit1("stablehlo.transpose", in, t, "permutation = " + I64Array(permutation));
}

Value Builder::Slice(const Value& x, std::span<const int64_t> start, std::span<const int64_t> limit,
                     std::span<const int64_t> strides) {
  TensorType t{x.element(), {}};
  bool identity = true;
  for (size_t i = 0; i < start.size(); ++i) {
    int64_t n = limit[i] > start[i] ? (limit[i] - start[i] + strides[i] - 1) / strides[i] : 0;
    t.dims.push_back(n);
    identity &= start[i] == 0 && strides[i] == 1 && limit[i] == x.dims()[i];
  }
  if (identity) return x;
  Value in[] = {x};
  return Emit1("stablehlo.slice", in, t,
               "start_indices = " + I64Array(start) + ", limit_indices = " + I64Array(limit) +
                   ", strides = " + I64Array(strides));
}

Value Builder::DynamicSlice(const Value& x, std::span<const Value> start_indices,
                            std::span<const int64_t> slice_sizes) {
  std::vector<Value> in{x};
  in.insert(in.end(), start_indices.begin(), start_indices.end());
  TensorType t{x.element(), {slice_sizes.begin(), slice_sizes.end()}};
  return Emit1("stablehlo.dynamic_slice", in, t, "slice_sizes = " + I64Array(slice_sizes));
}

Value Builder::DynamicUpdateSlice(const Value& x, const Value& update,
                                  std::span<const Value> start_indices) {
  std::vector<Value> in{x, update};
  in.insert(in.end(), start_indices.begin(), start_indices.end());
  return Emit1("stablehlo.dynamic_update_slice", in, x.type);
}

Value Builder::Concatenate(std::span<const Value> xs, int64_t dimension) {
  if (xs.empty()) throw BuildError("Concatenate: no operands");
  if (xs.size() == 1) return xs[0];
  TensorType t = xs[0].type;
  t.dims[static_cast<size_t>(dimension)] = 0;
  for (const auto& x : xs) t.dims[static_cast<size_t>(dimension)] += x.dims()[static_cast<size_t>(dimension)];
  return Emit1("stablehlo.concatenate", xs, t, "dimension = " + std::to_string(dimension) + " : i64");
}

Value Builder::Pad(const Value& x, const Value& padding_value, std::span<const int64_t> low,
                   std::span<const int64_t> high, std::span<const int64_t> interior) {
  TensorType t{x.element(), {}};
  for (size_t i = 0; i < low.size(); ++i) {
    int64_t d = x.dims()[i];
    t.dims.push_back(low[i] + high[i] + d + (d > 0 ? (d - 1) * interior[i] : 0));
  }
  Value in[] = {x, padding_value};
  return Emit1("stablehlo.pad", in, t,
               "edge_padding_low = " + I64Array(low) + ", edge_padding_high = " + I64Array(high) +
                   ", interior_padding = " + I64Array(interior));
}

Value Builder::Reverse(const Value& x, std::span<const int64_t> dims) {
  if (dims.empty()) return x;
  Value in[] = {x};
  return Emit1("stablehlo.reverse", in, x.type, "dimensions = " + I64Array(dims));
}

Value Builder::Convert(const Value& x, ElementType to) {
  if (x.element() == to) return x;
  Value in[] = {x};
  return Emit1("stablehlo.convert", in, TensorType{to, x.dims()});
}

Value Builder::BitcastConvert(const Value& x, ElementType to) {
  if (x.element() == to) return x;
  if (BitWidth(x.element()) != BitWidth(to))
    throw BuildError("BitcastConvert: element widths differ");
  Value in[] = {x};
  return Emit1("stablehlo.bitcast_convert", in, TensorType{to, x.dims()});
}

Value Builder::Unary(std::string_view op, const Value& x) {
  Value in[] = {x};
  return Emit1(op, in, x.type);
}

Value Builder::Binary(std::string_view op, const Value& a, const Value& b) {
  CheckSameType(op, a, b);
  Value in[] = {a, b};
  return Emit1(op, in, a.type);
}

Value Builder::IsFinite(const Value& x) {
  Value in[] = {x};
  return Emit1("stablehlo.is_finite", in, TensorType{ElementType::kPred, x.dims()});
}

Value Builder::Compare(const Value& a, const Value& b, CompareDirection dir) {
  CheckSameType("stablehlo.compare", a, b);
  static constexpr const char* kDir[] = {"EQ", "NE", "LT", "LE", "GT", "GE"};
  const char* type = IsFloating(a.element()) ? "FLOAT"
                     : IsUnsignedInteger(a.element()) || a.element() == ElementType::kPred ? "UNSIGNED"
                     : IsComplex(a.element()) ? "FLOAT"
                                              : "SIGNED";
  std::string attr = "comparison_direction = #stablehlo<comparison_direction ";
  attr += kDir[static_cast<int>(dir)];
  attr += ">, compare_type = #stablehlo<comparison_type ";
  attr += type;
  attr += ">";
  Value in[] = {a, b};
  return Emit1("stablehlo.compare", in, TensorType{ElementType::kPred, a.dims()}, attr);
}

Value Builder::Select(const Value& pred, const Value& on_true, const Value& on_false) {
  CheckSameType("stablehlo.select", on_true, on_false);
  if (pred.element() != ElementType::kPred) throw BuildError("stablehlo.select: predicate must be i1");
  Value in[] = {pred, on_true, on_false};
  return Emit1("stablehlo.select", in, on_true.type);
}

Value Builder::Clamp(const Value& min, const Value& x, const Value& max) {
  Value in[] = {min, x, max};
  return Emit1("stablehlo.clamp", in, x.type);
}

std::vector<Value> Builder::Reduce(std::span<const Value> inputs, std::span<const Value> inits,
                                   std::span<const int64_t> dimensions, const RegionFn& body) {
  if (inputs.size() != inits.size() || inputs.empty())
    throw BuildError("stablehlo.reduce: need one init value per input");
  std::vector<Value> operands(inputs.begin(), inputs.end());
  operands.insert(operands.end(), inits.begin(), inits.end());
  std::vector<TensorType> results;
  for (const auto& in : inputs) {
    TensorType t{in.element(), {}};
    for (int64_t d = 0; d < in.rank(); ++d) {
      bool reduced = false;
      for (int64_t r : dimensions) reduced |= r == d;
      if (!reduced) t.dims.push_back(in.dims()[static_cast<size_t>(d)]);
    }
    results.push_back(std::move(t));
  }
  std::vector<TensorType> block;
  for (const auto& in : inits) block.push_back(TensorType{in.element(), {}});
  for (const auto& in : inits) block.push_back(TensorType{in.element(), {}});
  std::pair<std::vector<TensorType>, RegionFn> region{block, body};
  return EmitValues("stablehlo.reduce", operands, results, "dimensions = " + I64Array(dimensions),
                    std::span(&region, 1));
}

std::vector<Value> Builder::ReduceWindow(std::span<const Value> inputs, std::span<const Value> inits,
                                         std::span<const int64_t> window_dimensions,
                                         std::span<const int64_t> window_strides,
                                         std::span<const int64_t> base_dilations,
                                         std::span<const int64_t> window_dilations,
                                         std::span<const std::pair<int64_t, int64_t>> padding,
                                         const RegionFn& body) {
  std::vector<Value> operands(inputs.begin(), inputs.end());
  operands.insert(operands.end(), inits.begin(), inits.end());
  std::vector<TensorType> results;
  for (const auto& in : inputs) {
    TensorType t{in.element(), {}};
    for (size_t d = 0; d < in.dims().size(); ++d) {
      int64_t size = (in.dims()[d] - 1) * base_dilations[d] + 1 + padding[d].first + padding[d].second;
      int64_t window = (window_dimensions[d] - 1) * window_dilations[d] + 1;
      t.dims.push_back(size < window ? 0 : (size - window) / window_strides[d] + 1);
    }
    results.push_back(std::move(t));
  }
  std::vector<TensorType> block;
  for (const auto& in : inits) block.push_back(TensorType{in.element(), {}});
  for (const auto& in : inits) block.push_back(TensorType{in.element(), {}});
  std::pair<std::vector<TensorType>, RegionFn> region{block, body};
  std::string attr = "window_dimensions = " + I64Array(window_dimensions) +
                     ", window_strides = " + I64Array(window_strides) +
                     ", base_dilations = " + I64Array(base_dilations) +
                     ", window_dilations = " + I64Array(window_dilations) +
                     ", padding = " + PaddingAttr(padding);
  return EmitValues("stablehlo.reduce_window", operands, results, attr, std::span(&region, 1));
}

Value Builder::DotGeneral(const Value& lhs, const Value& rhs, const DotDims& dims,
                          ElementType result_element) {
  TensorType t{result_element, {}};
  for (int64_t d : dims.lhs_batch) t.dims.push_back(lhs.dims()[static_cast<size_t>(d)]);
  auto in_list = [](const std::vector<int64_t>& v, int64_t d) {
    for (int64_t x : v) if (x == d) return true;
    return false;
  };
  for (int64_t d = 0; d < lhs.rank(); ++d)
    if (!in_list(dims.lhs_batch, d) && !in_list(dims.lhs_contract, d))
      t.dims.push_back(lhs.dims()[static_cast<size_t>(d)]);
  for (int64_t d = 0; d < rhs.rank(); ++d)
    if (!in_list(dims.rhs_batch, d) && !in_list(dims.rhs_contract, d))
      t.dims.push_back(rhs.dims()[static_cast<size_t>(d)]);
  std::string attr = "dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = " +
                     I64List(dims.lhs_batch) + ", rhs_batching_dimensions = " + I64List(dims.rhs_batch) +
                     ", lhs_contracting_dimensions = " + I64List(dims.lhs_contract) +
                     ", rhs_contracting_dimensions = " + I64List(dims.rhs_contract) +
                     ">, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]";
  Value in[] = {lhs, rhs};
  return Emit1("stablehlo.dot_general", in, t, attr);
}

Value Builder::Convolution(const Value& input, const Value& kernel, const ConvDims& d,
                           std::span<const int64_t> window_strides,
                           std::span<const std::pair<int64_t, int64_t>> padding,
                           std::span<const int64_t> lhs_dilation, std::span<const int64_t> rhs_dilation,
                           int64_t feature_group_count, int64_t batch_group_count,
                           const TensorType& result_type) {
  std::string attr = "dimension_numbers = #stablehlo.conv<raw input_batch_dimension = " +
                     std::to_string(d.input_batch) +
                     ", input_feature_dimension = " + std::to_string(d.input_feature) +
                     ", input_spatial_dimensions = " + I64List(d.input_spatial) +
                     ", kernel_input_feature_dimension = " + std::to_string(d.kernel_input_feature) +
                     ", kernel_output_feature_dimension = " + std::to_string(d.kernel_output_feature) +
                     ", kernel_spatial_dimensions = " + I64List(d.kernel_spatial) +
                     ", output_batch_dimension = " + std::to_string(d.output_batch) +
                     ", output_feature_dimension = " + std::to_string(d.output_feature) +
                     ", output_spatial_dimensions = " + I64List(d.output_spatial) + ">" +
                     ", window_strides = " + I64Array(window_strides) +
                     ", padding = " + PaddingAttr(padding) +
                     ", lhs_dilation = " + I64Array(lhs_dilation) +
                     ", rhs_dilation = " + I64Array(rhs_dilation) +
                     ", feature_group_count = " + std::to_string(feature_group_count) + " : i64" +
                     ", batch_group_count = " + std::to_string(batch_group_count) + " : i64" +
                     ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]";
  Value in[] = {input, kernel};
  return Emit1("stablehlo.convolution", in, result_type, attr);
}

Value Builder::Gather(const Value& operand, const Value& start_indices, const GatherDims& d,
                      std::span<const int64_t> slice_sizes, const TensorType& result_type) {
  std::string attr = "dimension_numbers = #stablehlo.gather<offset_dims = " + I64List(d.offset_dims) +
                     ", collapsed_slice_dims = " + I64List(d.collapsed_slice_dims);
  if (!d.operand_batching_dims.empty())
    attr += ", operand_batching_dims = " + I64List(d.operand_batching_dims) +
            ", start_indices_batching_dims = " + I64List(d.start_indices_batching_dims);
  attr += ", start_index_map = " + I64List(d.start_index_map) +
          ", index_vector_dim = " + std::to_string(d.index_vector_dim) +
          ">, slice_sizes = " + I64Array(slice_sizes) + ", indices_are_sorted = false";
  Value in[] = {operand, start_indices};
  return Emit1("stablehlo.gather", in, result_type, attr);
}

Value Builder::Scatter(const Value& operand, const Value& indices, const Value& updates,
                       const ScatterDims& d, const RegionFn& body) {
  std::string attr = "scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = " +
                     I64List(d.update_window_dims) +
                     ", inserted_window_dims = " + I64List(d.inserted_window_dims);
  if (!d.input_batching_dims.empty())
    attr += ", input_batching_dims = " + I64List(d.input_batching_dims) +
            ", scatter_indices_batching_dims = " + I64List(d.scatter_indices_batching_dims);
  attr += ", scatter_dims_to_operand_dims = " + I64List(d.scatter_dims_to_operand_dims) +
          ", index_vector_dim = " + std::to_string(d.index_vector_dim) +
          ">, indices_are_sorted = false, unique_indices = false";
  std::vector<TensorType> block{TensorType{operand.element(), {}}, TensorType{operand.element(), {}}};
  std::pair<std::vector<TensorType>, RegionFn> region{block, body};
  Value in[] = {operand, indices, updates};
  TensorType rt = operand.type;
  return EmitValues("stablehlo.scatter", in, std::span(&rt, 1), attr, std::span(&region, 1))[0];
}

std::vector<Value> Builder::Sort(std::span<const Value> inputs, int64_t dimension, bool is_stable,
                                 const RegionFn& comparator) {
  std::vector<TensorType> results, block;
  for (const auto& in : inputs) {
    results.push_back(in.type);
    block.push_back(TensorType{in.element(), {}});
    block.push_back(TensorType{in.element(), {}});
  }
  std::pair<std::vector<TensorType>, RegionFn> region{block, comparator};
  return EmitValues("stablehlo.sort", inputs, results,
                    "dimension = " + std::to_string(dimension) + " : i64, is_stable = " +
                        (is_stable ? "true" : "false"),
                    std::span(&region, 1));
}

std::pair<Value, Value> Builder::RngBitGenerator(const Value& state, const TensorType& type) {
  TensorType results[] = {state.type, type};
  Value in[] = {state};
  auto v = EmitValues("stablehlo.rng_bit_generator", in, results,
                      "rng_algorithm = #stablehlo<rng_algorithm THREE_FRY>");
  return {v[0], v[1]};
}

std::vector<Value> Builder::While(std::span<const Value> init, const RegionFn& cond,
                                 const RegionFn& body) {
  if (init.empty()) throw BuildError("stablehlo.while: no loop-carried values");
  std::vector<TensorType> types;
  for (const auto& v : init) types.push_back(v.type);
  RegionFn checked_cond = [&](Builder& b, std::span<const Value> args) {
    std::vector<Value> r = cond(b, args);
    if (r.size() != 1 || !(r[0].type == TensorType{ElementType::kPred, {}}))
      throw BuildError("stablehlo.while: the condition must return one tensor<i1>");
    return r;
  };
  RegionFn checked_body = [&](Builder& b, std::span<const Value> args) {
    std::vector<Value> r = body(b, args);
    if (r.size() != types.size())
      throw BuildError("stablehlo.while: the body must return one value per loop-carried value");
    for (size_t i = 0; i < r.size(); ++i)
      if (!(r[i].type == types[i]))
        throw BuildError("stablehlo.while: body result " + std::to_string(i) + " has type " +
                         r[i].type.ToString() + ", expected " + types[i].ToString());
    return r;
  };
  std::pair<std::vector<TensorType>, RegionFn> regions[] = {{types, checked_cond}, {types, checked_body}};
  return EmitValues("stablehlo.while", init, types, {}, regions);
}

Value Builder::Real(const Value& x) {
  if (!IsComplex(x.element())) {
    if (!IsFloating(x.element())) throw BuildError("stablehlo.real: needs a floating or complex operand");
    return x;
  }
  Value in[] = {x};
  return Emit1("stablehlo.real", in, TensorType{ComplexPart(x.element()), x.dims()});
}

Value Builder::Imag(const Value& x) {
  if (!IsComplex(x.element())) {
    if (!IsFloating(x.element())) throw BuildError("stablehlo.imag: needs a floating or complex operand");
    return BroadcastInDim(Constant(TensorType{x.element(), {}}, 0), x.dims(), {});
  }
  Value in[] = {x};
  return Emit1("stablehlo.imag", in, TensorType{ComplexPart(x.element()), x.dims()});
}

Value Builder::Complex(const Value& re, const Value& im) {
  CheckSameType("stablehlo.complex", re, im);
  Value in[] = {re, im};
  return Emit1("stablehlo.complex", in, TensorType{ComplexOf(re.element()), re.dims()});
}

Value Builder::Fft(const Value& x, std::string_view kind, std::span<const int64_t> lengths) {
  const int64_t k = static_cast<int64_t>(lengths.size());
  if (k < 1 || k > 3 || x.rank() < k)
    throw BuildError("stablehlo.fft: 1 to 3 transformed dimensions within the operand's rank, got " +
                     std::to_string(k) + " for " + x.type.ToString());
  TensorType out = x.type;
  const size_t r = static_cast<size_t>(x.rank());
  auto check_dims = [&](int64_t last_expected) {
    for (int64_t i = 0; i < k; ++i) {
      size_t d = r - static_cast<size_t>(k) + static_cast<size_t>(i);
      int64_t want = i == k - 1 ? last_expected : lengths[static_cast<size_t>(i)];
      if (x.dims()[d] != want)
        throw BuildError("stablehlo.fft " + std::string(kind) + ": operand " + x.type.ToString() +
                         " does not match fft_length " + I64List(lengths));
    }
  };
  if (kind == "FFT" || kind == "IFFT") {
    if (!IsComplex(x.element())) throw BuildError("stablehlo.fft " + std::string(kind) + ": needs a complex operand");
    check_dims(lengths.back());
  } else if (kind == "RFFT") {
    if (!IsFloating(x.element())) throw BuildError("stablehlo.fft RFFT: needs an f32/f64 operand");
    check_dims(lengths.back());
    out.element = ComplexOf(x.element());
    out.dims.back() = lengths.back() / 2 + 1;
  } else if (kind == "IRFFT") {
    if (!IsComplex(x.element())) throw BuildError("stablehlo.fft IRFFT: needs a complex operand");
    check_dims(lengths.back() / 2 + 1);
    out.element = ComplexPart(x.element());
    out.dims.back() = lengths.back();
  } else {
    throw BuildError("stablehlo.fft: unknown fft_type " + std::string(kind));
  }
  std::string attr = "fft_type = #stablehlo<fft_type " + std::string(kind) + ">, fft_length = " + I64Array(lengths);
  Value in[] = {x};
  return Emit1("stablehlo.fft", in, out, attr);
}

Value Builder::TriangularSolve(const Value& a, const Value& b, bool left_side, bool lower,
                               bool unit_diagonal, bool transpose_a) {
  if (a.rank() < 2 || a.rank() != b.rank())
    throw BuildError("stablehlo.triangular_solve: a and b need the same rank >= 2, got " +
                     a.type.ToString() + " and " + b.type.ToString());
  if (a.element() != b.element())
    throw BuildError("stablehlo.triangular_solve: element types differ");
  const size_t r = static_cast<size_t>(a.rank());
  const int64_t n = a.dims()[r - 1];
  if (a.dims()[r - 2] != n) throw BuildError("stablehlo.triangular_solve: a must be square");
  if ((left_side ? b.dims()[r - 2] : b.dims()[r - 1]) != n)
    throw BuildError("stablehlo.triangular_solve: b's size does not match a: " + a.type.ToString() +
                     " vs " + b.type.ToString());
  for (size_t i = 0; i + 2 < r; ++i)
    if (a.dims()[i] != b.dims()[i]) throw BuildError("stablehlo.triangular_solve: batch dims differ");
  auto tf = [](bool v) { return v ? std::string("true") : std::string("false"); };
  std::string attr = "left_side = " + tf(left_side) + ", lower = " + tf(lower) +
                     ", unit_diagonal = " + tf(unit_diagonal) +
                     ", transpose_a = #stablehlo<transpose " +
                     (transpose_a ? "TRANSPOSE" : "NO_TRANSPOSE") + ">";
  Value in[] = {a, b};
  return Emit1("stablehlo.triangular_solve", in, b.type, attr);
}

Value Builder::Cholesky(const Value& a, bool lower) {
  if (a.rank() < 2 || a.dims()[static_cast<size_t>(a.rank() - 1)] != a.dims()[static_cast<size_t>(a.rank() - 2)])
    throw BuildError("stablehlo.cholesky: needs square matrices, got " + a.type.ToString());
  Value in[] = {a};
  return Emit1("stablehlo.cholesky", in, a.type, std::string("lower = ") + (lower ? "true" : "false"));
}

std::vector<Value> Builder::CustomCall(std::string_view target, std::span<const Value> operands,
                                       std::span<const TensorType> result_types,
                                       std::string_view backend_config) {
  std::string attr = "call_target_name = \"" + std::string(target) + "\", backend_config = \"" +
                     std::string(backend_config) + "\", api_version = 1 : i32";
  return EmitValues("stablehlo.custom_call", operands, result_types, attr);
}

namespace {

// replica_groups = dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>, checked: at
// least one group, every group of one size >= 1, no id twice.
std::string ReplicaGroupsAttr(const std::string& op, const Builder::ReplicaGroups& groups) {
  if (groups.empty() || groups[0].empty()) throw BuildError(op + ": replica_groups is empty");
  const size_t size = groups[0].size();
  std::vector<int64_t> seen;
  std::string text = "replica_groups = dense<[";
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].size() != size)
      throw BuildError(op + ": replica groups of different sizes (" + std::to_string(size) + " and " +
                       std::to_string(groups[g].size()) + ")");
    for (int64_t id : groups[g]) {
      if (id < 0) throw BuildError(op + ": negative process id " + std::to_string(id) + " in replica_groups");
      for (int64_t s : seen)
        if (s == id) throw BuildError(op + ": process id " + std::to_string(id) + " twice in replica_groups");
      seen.push_back(id);
    }
    if (g) text += ", ";
    text += I64List(groups[g]);
  }
  text += "]> : tensor<" + std::to_string(groups.size()) + "x" + std::to_string(size) + "xi64>";
  return text;
}

std::string CollectiveAttrs(const std::string& op, const CollectiveOptions& options) {
  if (options.channel_id < 0) throw BuildError(op + ": negative channel_id");
  if (options.use_global_device_ids && options.channel_id == 0)
    throw BuildError(op + ": use_global_device_ids needs a channel (channel_id > 0)");
  std::string text;
  if (options.channel_id > 0)
    text += ", channel_handle = #stablehlo.channel_handle<handle = " + std::to_string(options.channel_id) +
            ", type = 1>";
  if (options.use_global_device_ids) text += ", use_global_device_ids";
  return text;
}

void CheckDimension(const std::string& op, const Value& x, int64_t dimension) {
  if (dimension < 0 || dimension >= x.rank())
    throw BuildError(op + ": dimension " + std::to_string(dimension) + " out of range for " + x.type.ToString());
}

std::pair<std::vector<TensorType>, RegionFn> ScalarRegion(const Value& x, const RegionFn& body) {
  TensorType scalar{x.element(), {}};
  return {{scalar, scalar}, body};
}

}  // namespace

Value Builder::AllReduce(const Value& x, const ReplicaGroups& groups, const RegionFn& body,
                         const CollectiveOptions& options) {
  const std::string op = "stablehlo.all_reduce";
  std::string attr = ReplicaGroupsAttr(op, groups) + CollectiveAttrs(op, options);
  auto region = ScalarRegion(x, body);
  Value in[] = {x};
  TensorType result = x.type;
  return EmitValues(op, in, std::span(&result, 1), attr, std::span(&region, 1))[0];
}

Value Builder::AllGather(const Value& x, int64_t dimension, const ReplicaGroups& groups,
                         const CollectiveOptions& options) {
  const std::string op = "stablehlo.all_gather";
  CheckDimension(op, x, dimension);
  std::string attr = "all_gather_dim = " + std::to_string(dimension) + " : i64, " + ReplicaGroupsAttr(op, groups) +
                     CollectiveAttrs(op, options);
  TensorType result = x.type;
  result.dims[static_cast<size_t>(dimension)] *= static_cast<int64_t>(groups[0].size());
  Value in[] = {x};
  return Emit1(op, in, result, attr);
}

Value Builder::ReduceScatter(const Value& x, int64_t dimension, const ReplicaGroups& groups, const RegionFn& body,
                             const CollectiveOptions& options) {
  const std::string op = "stablehlo.reduce_scatter";
  CheckDimension(op, x, dimension);
  std::string attr = "scatter_dimension = " + std::to_string(dimension) + " : i64, " +
                     ReplicaGroupsAttr(op, groups) + CollectiveAttrs(op, options);
  const int64_t n = static_cast<int64_t>(groups[0].size());
  TensorType result = x.type;
  int64_t& d = result.dims[static_cast<size_t>(dimension)];
  if (d % n != 0)
    throw BuildError(op + ": dimension " + std::to_string(dimension) + " of " + x.type.ToString() +
                     " is not divisible by the group size " + std::to_string(n));
  d /= n;
  auto region = ScalarRegion(x, body);
  Value in[] = {x};
  return EmitValues(op, in, std::span(&result, 1), attr, std::span(&region, 1))[0];
}

Value Builder::AllToAll(const Value& x, int64_t split_dimension, int64_t concat_dimension,
                        const ReplicaGroups& groups, const CollectiveOptions& options) {
  const std::string op = "stablehlo.all_to_all";
  CheckDimension(op, x, split_dimension);
  CheckDimension(op, x, concat_dimension);
  const int64_t n = static_cast<int64_t>(groups.empty() ? 0 : groups[0].size());
  std::string attr = "split_dimension = " + std::to_string(split_dimension) + " : i64, concat_dimension = " +
                     std::to_string(concat_dimension) + " : i64, split_count = " + std::to_string(n) + " : i64, " +
                     ReplicaGroupsAttr(op, groups) + CollectiveAttrs(op, options);
  TensorType result = x.type;
  int64_t& s = result.dims[static_cast<size_t>(split_dimension)];
  if (s % n != 0)
    throw BuildError(op + ": split dimension " + std::to_string(split_dimension) + " of " + x.type.ToString() +
                     " is not divisible by the group size " + std::to_string(n));
  s /= n;
  result.dims[static_cast<size_t>(concat_dimension)] *= n;
  Value in[] = {x};
  return Emit1(op, in, result, attr);
}

Value Builder::CollectivePermute(const Value& x, std::span<const std::pair<int64_t, int64_t>> pairs,
                                 const CollectiveOptions& options) {
  const std::string op = "stablehlo.collective_permute";
  if (pairs.empty()) throw BuildError(op + ": no source_target_pairs");
  std::string text = "source_target_pairs = dense<[";
  for (size_t i = 0; i < pairs.size(); ++i) {
    const auto& [src, dst] = pairs[i];
    if (src < 0 || dst < 0) throw BuildError(op + ": negative process id in source_target_pairs");
    for (size_t j = 0; j < i; ++j) {
      if (pairs[j].first == src) throw BuildError(op + ": source " + std::to_string(src) + " twice");
      if (pairs[j].second == dst) throw BuildError(op + ": target " + std::to_string(dst) + " twice");
    }
    if (i) text += ", ";
    text += "[" + std::to_string(src) + ", " + std::to_string(dst) + "]";
  }
  text += "]> : tensor<" + std::to_string(pairs.size()) + "x2xi64>" + CollectiveAttrs(op, options);
  Value in[] = {x};
  return Emit1(op, in, x.type, text);
}

Value Builder::ReplicaId() { return Emit1("stablehlo.replica_id", {}, TensorType{ElementType::kU32, {}}); }
Value Builder::PartitionId() { return Emit1("stablehlo.partition_id", {}, TensorType{ElementType::kU32, {}}); }

}  // namespace torch_tpu::hlo
