#include <mutex>
#include <unordered_map>
#include <optional>
#include <unordered_set>

#include "lowering/lowering.h"

namespace torch_tpu::lowering {
namespace {

std::unordered_map<std::string_view, LoweringEntry>& Registry() {
  static auto* registry = new std::unordered_map<std::string_view, LoweringEntry>();
  return *registry;
}

// The families whose lowerings are exact on a bucketed leading dim
// (LoweringTraits::shape_poly): elementwise ops (every result element reads
// only the input elements at its own index, after broadcasting), data
// movement and casts (copy_, clone, fill_, zero_), and reductions whose
// padding is filled with their identity. Not here: ops whose result depends
// on the extent itself (mean divides by it; var, std, norms), on positions
// (argmax, cumsum, sort, indexing), or on random streams.
const std::unordered_map<std::string_view, PadFill>& ShapePolyFamilies() {
  static const auto* table = [] {
    auto* t = new std::unordered_map<std::string_view, PadFill>();
    for (std::string_view name :
         {"add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "pow", "neg", "abs", "sign",
          "sgn", "reciprocal", "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin",
          "cos", "tan", "tanh", "sigmoid", "erf", "erfinv", "floor", "ceil", "trunc", "round", "frac", "clamp",
          "clamp_min", "clamp_max", "maximum", "minimum", "fmax", "fmin", "lerp", "addcmul", "addcdiv", "where",
          "masked_fill", "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "nan_to_num", "logical_and",
          "logical_or", "logical_xor", "logical_not", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
          "relu", "threshold", "threshold_backward", "gelu", "gelu_backward", "silu", "silu_backward",
          "sigmoid_backward", "tanh_backward", "hardtanh", "hardtanh_backward", "leaky_relu",
          "leaky_relu_backward", "elu", "elu_backward", "softplus", "softplus_backward", "mish", "hardsigmoid",
          "hardsigmoid_backward", "hardswish", "hardswish_backward", "isneginf", "isposinf", "copy", "clone", "fill",
          "zero",
          // Position masks: a result element reads its own input element
          // and its (row, col) index, which padding past the extent keeps.
          "tril", "triu"})
      t->emplace(name, PadFill::kAny);
    for (std::string_view name : {"sum", "nansum", "count_nonzero", "any"}) t->emplace(name, PadFill::kZero);
    for (std::string_view name : {"prod", "all"}) t->emplace(name, PadFill::kOne);
    t->emplace("amax", PadFill::kLowest);
    // softmax over the dynamic dim: exp(-inf - max) = 0 for padding, so the
    // sum and every real element are unchanged; an all-(-inf), NaN or +inf
    // row gives NaN as on CPU (its max is then -inf, NaN or +inf).
    t->emplace("_softmax", PadFill::kLowest);
    t->emplace("_log_softmax", PadFill::kLowest);
    t->emplace("amin", PadFill::kHighest);
    // bmm along its batch dim, or along every dim of one size
    // (PlanPolyMulti: [b, t, d] @ [b, d, t], [b, t, t] @ [b, t, d]): padding
    // is 0 in both operands, so a padded contraction adds 0 * 0 (never a
    // stale NaN or inf) and real rows and columns are unchanged.
    t->emplace("bmm", PadFill::kZero);
    return t;
  }();
  return *table;
}

}  // namespace

LoweringRegistrar::LoweringRegistrar(std::initializer_list<LoweringEntry> entries) {
  for (const auto& e : entries) {
    auto [it, inserted] = Registry().emplace(e.name, e);
    if (!inserted) throw std::logic_error("duplicate lowering for " + std::string(e.name));
    auto family = ShapePolyFamilies().find(e.name);
    it->second.traits.shape_poly =
        family != ShapePolyFamilies().end() && !e.traits.needs_rng && !e.traits.graph_only ? family->second
                                                                                          : PadFill::kNone;
    // cat along the dynamic dim: no result element reads an item's padding
    // (LowerCat writes each item at its runtime offset, later items over
    // the earlier ones' padding).
    // mm/addmm along the left matrix's rows (the contraction and the
    // output's columns are static): padding rows reach only padding rows.
    if ((e.name == "mm" || e.name == "addmm") && !e.traits.graph_only) {
      it->second.traits.shape_poly = PadFill::kAny;
      it->second.traits.poly_matmul = true;
    }
    // layer norm along a batch dim (never a normalized one: PlanPoly).
    if (e.name == "native_layer_norm" && !e.traits.graph_only) {
      it->second.traits.shape_poly = PadFill::kAny;
      it->second.traits.poly_batch_dims = true;
    }
    if (e.name == "cat") {
      it->second.traits.shape_poly = PadFill::kAny;
      it->second.traits.poly_concat = true;
    }
  }
}

const LoweringEntry* FindLowering(std::string_view base_name) {
  auto& r = Registry();
  auto it = r.find(base_name);
  return it == r.end() ? nullptr : &it->second;
}

bool ComplexSupported(const LoweringEntry& entry, const LoweringContext& ctx) {
  if (entry.traits.complex || entry.traits.graph_only) return true;
  // Data movement and fills: complex elements are copied, filled or cast as
  // they are.
  static const std::unordered_set<std::string_view> kMoves = {
      "copy", "clone", "zero", "fill", "alias_copy", "view_copy", "scalar_tensor", "full", "full_like"};
  bool complex_out = false;
  for (const auto& o : ctx.outputs) complex_out |= at::isComplexType(o.dtype);
  if (kMoves.count(entry.name)) {
    // A complex Scalar filling a real tensor: CPU checks the value (it
    // raises unless the imaginary part is 0); that check stays there.
    for (const auto& a : ctx.args)
      if (a.kind == LoweredArg::Kind::kScalar && hlo::IsComplex(a.value.element()) && !complex_out) return false;
    return true;
  }
  if (complex_out) return false;
  for (const auto& a : ctx.args) {
    if (a.kind == LoweredArg::Kind::kTensor && hlo::IsComplex(a.value.element())) return false;
    if (a.kind == LoweredArg::Kind::kScalar && hlo::IsComplex(a.value.element())) return false;
    for (size_t j = 0; j < a.list.size(); ++j)
      if (a.present[j] && hlo::IsComplex(a.list[j].element())) return false;
  }
  return true;
}

bool Float8Supported(const LoweringEntry& entry, const LoweringContext& ctx) {
  if (entry.traits.graph_only) return true;
  // What PyTorch's CPU kernels do for float8 besides arithmetic: moves,
  // fills, casts, concatenation, selection and indexing (each copies, fills
  // or casts elements); every other op on a float8 tensor runs on the CPU,
  // which computes it as CPU does or raises CPU's error (most kernels are
  // not dispatched for float8: NotImplementedError).
  static const std::unordered_set<std::string_view> kFloat8Ops = {
      "copy",  "clone", "_to_copy",     "zero",        "fill", "alias_copy", "view_copy", "full",
      "full_like", "scalar_tensor", "cat", "stack", "index_select", "index",     "where"};
  if (kFloat8Ops.count(entry.name)) {
    // PyTorch does not promote a float8 type with another ("Promotion for
    // Float8 Types is not supported"): a cat/stack/where mixing float8 with
    // another data type runs on the CPU, which raises that (bool conditions
    // aside).
    static const std::unordered_set<std::string_view> kNoPromotion = {"cat", "stack", "where"};
    if (!kNoPromotion.count(entry.name)) return true;
    std::optional<hlo::ElementType> seen;
    bool float8 = false, mixed = false;
    auto see = [&](hlo::ElementType e) {
      if (e == hlo::ElementType::kPred) return;
      float8 |= hlo::IsFloat8(e);
      mixed |= seen && *seen != e;
      seen = e;
    };
    for (const auto& a : ctx.args) {
      if (a.kind == LoweredArg::Kind::kTensor) see(a.value.element());
      for (size_t j = 0; j < a.list.size(); ++j)
        if (a.present[j]) see(a.list[j].element());
    }
    for (const auto& o : ctx.outputs)  // an unused graph output has no dtype (Undefined)
      if (o.dtype != at::ScalarType::Undefined) see(ToElementType(o.dtype));
    return !(float8 && mixed);
  }
  for (const auto& o : ctx.outputs)  // never ToElementType: an unused graph output's dtype is Undefined
    if (c10::isFloat8Type(o.dtype)) return false;
  for (const auto& a : ctx.args) {
    if (a.kind == LoweredArg::Kind::kTensor && hlo::IsFloat8(a.value.element())) return false;
    for (size_t j = 0; j < a.list.size(); ++j)
      if (a.present[j] && hlo::IsFloat8(a.list[j].element())) return false;
  }
  return true;
}

bool Complex32Supported(const LoweringEntry& entry, const LoweringContext& ctx) {
  // complex32 elements are u32 bit patterns on the device (ToElementType):
  // only moves from complex32 to complex32 (and zeroing, all bits 0 is
  // 0+0j) are exact on them; any other call with a complex32 tensor,
  // Scalar or result runs on the CPU (CPU's values or error). View entries
  // (graph_only) would reinterpret the u32 values: graphs never see one.
  // Tensor lists carry no dtypes here: the eager kernel (aten/fallback.cpp)
  // routes every call holding a complex32 tensor anywhere before this.
  static const std::unordered_set<std::string_view> kComplex32Moves = {"copy", "clone", "zero", "alias_copy",
                                                                       "view_copy"};
  bool c32 = false, other = false;
  auto see = [&](at::ScalarType t) { (t == at::kComplexHalf ? c32 : other) = true; };
  for (const auto& o : ctx.outputs)
    if (o.dtype != at::ScalarType::Undefined) see(o.dtype);
  for (const auto& a : ctx.args) {
    if (a.kind == LoweredArg::Kind::kTensor) see(a.dtype);
    if (a.kind == LoweredArg::Kind::kScalar && a.dtype == at::kComplexHalf) see(a.dtype);
  }
  if (!c32) return true;
  if (entry.traits.graph_only || !kComplex32Moves.count(entry.name) || other) return false;
  for (const auto& a : ctx.args)
    if (a.kind == LoweredArg::Kind::kScalar || a.kind == LoweredArg::Kind::kTensorList) return false;
  return true;
}

bool DtypesSupported(const LoweringEntry& entry, const LoweringContext& ctx) {
  return Complex32Supported(entry, ctx) && ComplexSupported(entry, ctx) && Float8Supported(entry, ctx);
}

std::vector<const LoweringEntry*> AllLowerings() {
  std::vector<const LoweringEntry*> out;
  for (auto& [name, e] : Registry()) out.push_back(&e);
  return out;
}

hlo::ElementType ToElementType(at::ScalarType t) {
  using E = hlo::ElementType;
  switch (t) {
    case at::kBool: return E::kPred;
    case at::kChar: return E::kS8;
    case at::kShort: return E::kS16;
    case at::kInt: return E::kS32;
    case at::kLong: return E::kS64;
    case at::kByte: return E::kU8;
    case at::kUInt16: return E::kU16;
    case at::kUInt32: return E::kU32;
    case at::kUInt64: return E::kU64;
    case at::kHalf: return E::kF16;
    case at::kBFloat16: return E::kBF16;
    case at::kFloat: return E::kF32;
    case at::kDouble: return E::kF64;
    case at::kComplexFloat: return E::kC64;
    case at::kComplexDouble: return E::kC128;
    // complex32 (ComplexHalf) has no XLA element type: its storage holds
    // each element's 4 bytes (real f16, then imaginary f16) as one u32, so
    // moves are bit for bit and view_as_real's f16 [..., 2] view
    // reinterprets the same buffer. No lowering computes on it
    // (Complex32Supported); ToScalarType(kU32) stays UInt32.
    case at::kComplexHalf: return E::kU32;
    case at::kFloat8_e5m2: return E::kF8E5M2;
    case at::kFloat8_e4m3fn: return E::kF8E4M3FN;
    case at::kFloat8_e5m2fnuz: return E::kF8E5M2FNUZ;
    case at::kFloat8_e4m3fnuz: return E::kF8E4M3FNUZ;
    case at::kFloat8_e8m0fnu: return E::kF8E8M0FNU;
    default:
      throw LoweringError(std::string("dtype ") + c10::toString(t) + " is not supported on tpu");
  }
}

at::ScalarType ToScalarType(hlo::ElementType t) {
  using E = hlo::ElementType;
  switch (t) {
    case E::kPred: return at::kBool;
    case E::kS8: return at::kChar;
    case E::kS16: return at::kShort;
    case E::kS32: return at::kInt;
    case E::kS64: return at::kLong;
    case E::kU8: return at::kByte;
    case E::kU16: return at::kUInt16;
    case E::kU32: return at::kUInt32;
    case E::kU64: return at::kUInt64;
    case E::kF16: return at::kHalf;
    case E::kBF16: return at::kBFloat16;
    case E::kF32: return at::kFloat;
    case E::kF64: return at::kDouble;
    case E::kC64: return at::kComplexFloat;
    case E::kC128: return at::kComplexDouble;
    case E::kF8E5M2: return at::kFloat8_e5m2;
    case E::kF8E4M3FN: return at::kFloat8_e4m3fn;
    case E::kF8E5M2FNUZ: return at::kFloat8_e5m2fnuz;
    case E::kF8E4M3FNUZ: return at::kFloat8_e4m3fnuz;
    case E::kF8E8M0FNU: return at::kFloat8_e8m0fnu;
  }
  return at::kFloat;
}

std::string LoweringContext::op_name() const {
  std::string s = schema.name();
  if (!schema.overload_name().empty()) s += "." + schema.overload_name();
  return s;
}

const LoweredArg* LoweringContext::find(std::string_view name) const {
  for (const auto& a : args)
    if (a.name == name) return &a;
  return nullptr;
}

const LoweredArg& LoweringContext::arg(std::string_view name) const {
  const LoweredArg* a = find(name);
  if (!a) throw LoweringError(op_name() + ": lowering asked for unknown argument '" + std::string(name) + "'");
  return *a;
}

bool LoweringContext::has(std::string_view name) const {
  const LoweredArg* a = find(name);
  return a && a->kind != LoweredArg::Kind::kNone &&
         !(a->kind == LoweredArg::Kind::kStatic && a->ivalue.isNone());
}

const hlo::Value& LoweringContext::tensor(std::string_view name) const {
  const auto& a = arg(name);
  if (a.kind != LoweredArg::Kind::kTensor && a.kind != LoweredArg::Kind::kScalar)
    throw LoweringError(op_name() + ": argument '" + std::string(name) + "' is not a tensor");
  return a.value;
}

const hlo::Value& LoweringContext::value(std::string_view name) const { return tensor(name); }

int64_t LoweringContext::int_arg(std::string_view name) const {
  const auto& a = arg(name);
  if (a.kind != LoweredArg::Kind::kStatic) throw LoweringError(op_name() + ": '" + std::string(name) + "' is not static");
  if (a.ivalue.isInt()) return a.ivalue.toInt();
  if (a.ivalue.isBool()) return a.ivalue.toBool();
  throw LoweringError(op_name() + ": '" + std::string(name) + "' is not an int");
}

std::optional<int64_t> LoweringContext::opt_int(std::string_view name) const {
  if (!has(name)) return std::nullopt;
  return int_arg(name);
}

double LoweringContext::float_arg(std::string_view name) const {
  const auto& a = arg(name);
  if (a.ivalue.isDouble()) return a.ivalue.toDouble();
  if (a.ivalue.isInt()) return static_cast<double>(a.ivalue.toInt());
  if (a.ivalue.isBool()) return a.ivalue.toBool();
  throw LoweringError(op_name() + ": '" + std::string(name) + "' is not a static float");
}

bool LoweringContext::bool_arg(std::string_view name) const {
  const auto& a = arg(name);
  if (a.ivalue.isBool()) return a.ivalue.toBool();
  if (a.ivalue.isInt()) return a.ivalue.toInt() != 0;
  if (a.ivalue.isNone()) return false;
  throw LoweringError(op_name() + ": '" + std::string(name) + "' is not a bool");
}

std::vector<int64_t> LoweringContext::ints(std::string_view name) const {
  const LoweredArg* a = find(name);
  if (!a || a->kind == LoweredArg::Kind::kNone || a->ivalue.isNone()) return {};
  const c10::IValue& v = a->ivalue;
  if (v.isIntList()) return v.toIntVector();
  if (v.isInt()) return {v.toInt()};
  if (v.isSymIntList()) {
    std::vector<int64_t> out;
    for (const auto& s : v.toSymIntList()) out.push_back(static_cast<c10::SymInt>(s).expect_int());
    return out;
  }
  if (v.isSymInt()) return {v.toSymInt().expect_int()};
  throw LoweringError(op_name() + ": '" + std::string(name) + "' is not an int list");
}

std::vector<bool> LoweringContext::bools(std::string_view name, size_t n) const {
  std::vector<bool> out(n, true);
  const LoweredArg* a = find(name);
  if (!a || !a->ivalue.isBoolList()) return out;
  auto l = a->ivalue.toBoolList();
  for (size_t i = 0; i < n && i < l.size(); ++i) out[i] = l[i];
  return out;
}

std::optional<std::vector<int64_t>> LoweringContext::opt_ints(std::string_view name) const {
  if (!has(name)) return std::nullopt;
  return ints(name);
}

std::optional<at::ScalarType> LoweringContext::opt_dtype(std::string_view name) const {
  const LoweredArg* a = find(name);
  if (!a || !a->ivalue.isInt()) return std::nullopt;
  return static_cast<at::ScalarType>(a->ivalue.toInt());
}

std::string_view LoweringContext::string_arg(std::string_view name) const {
  const auto& a = arg(name);
  if (!a.ivalue.isString()) throw LoweringError(op_name() + ": '" + std::string(name) + "' is not a string");
  return a.ivalue.toStringView();
}

hlo::Value LoweringContext::rng_state() {
  if (!rng_state_value)
    throw LoweringError(op_name() + ": lowering uses random numbers but its entry lacks needs_rng");
  return *rng_state_value;
}

int64_t LoweringContext::RngIncrement(const std::vector<OutputSpec>& outputs) {
  int64_t n = 1;
  for (const auto& o : outputs) {
    if (o.dtype == at::ScalarType::Undefined) continue;
    for (int64_t d : o.sizes) n *= d;
    break;
  }
  return RngIncrementOf(n);
}

int64_t LoweringContext::RngIncrementOf(int64_t numel) { return std::max<int64_t>((numel + 3) / 4 * 4, 4); }

void LoweringContext::write(std::string_view name, hlo::Value value) {
  const auto& a = arg(name);
  if (a.kind != LoweredArg::Kind::kTensor)
    throw LoweringError(op_name() + ": cannot write to non-tensor argument '" + std::string(name) + "'");
  writes.emplace_back(a.name, std::move(value));
}

void LoweringContext::check(hlo::Value bad, std::string message) {
  if (!bad.type.dims.empty() || bad.element() != hlo::ElementType::kPred)
    throw LoweringError(op_name() + ": a value check must be a 0-d pred, got " + bad.type.ToString());
  checks.emplace_back(std::move(bad), std::move(message));
}

void LoweringContext::check_index(hlo::Value bad, std::string message) {
  if (!bad.type.dims.empty() || bad.element() != hlo::ElementType::kPred)
    throw LoweringError(op_name() + ": a value check must be a 0-d pred, got " + bad.type.ToString());
  index_errors.emplace_back(std::move(bad), std::move(message));
}

}  // namespace torch_tpu::lowering
