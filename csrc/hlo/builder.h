// torch_tpu StableHLO emission: a Builder that writes one `func.func @main`
// module as MLIR text in the generic operation syntax, with typed SSA values
// and one method per StableHLO op. No torch types.
//
// Op semantics and attribute spellings follow the StableHLO specification
// (openxla/stablehlo docs/spec.md). The text is consumed by
// PJRT_Client_Compile with program format "mlir".
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace torch_tpu::hlo {

// Element types of StableHLO tensors (a subset of PJRT_Buffer_Type's). The
// float8 types are StableHLO's f8E5M2, f8E4M3FN, f8E5M2FNUZ, f8E4M3FNUZ and
// f8E8M0FNU (1 byte each; formats as in the StableHLO spec / ml_dtypes).
enum class ElementType : uint8_t {
  kPred, kS8, kS16, kS32, kS64, kU8, kU16, kU32, kU64,
  kF16, kBF16, kF32, kF64, kC64, kC128,
  kF8E5M2, kF8E4M3FN, kF8E5M2FNUZ, kF8E4M3FNUZ, kF8E8M0FNU,
};

std::string_view MlirName(ElementType t);  // "i1", "f32", "ui8", "complex<f32>", "f8E4M3FN", ...
bool IsFloating(ElementType t);            // f16, bf16, f32, f64 and the float8 types
bool IsFloat8(ElementType t);              // the five float8 types
bool IsComplex(ElementType t);
bool IsSignedInteger(ElementType t);       // s8..s64
bool IsUnsignedInteger(ElementType t);     // u8..u64 (not pred)
int BitWidth(ElementType t);               // pred: 1
// The element type of a complex type's parts (c64 -> f32, c128 -> f64) and
// the complex type with parts `t` (f32 -> c64, f64 -> c128); both throw
// BuildError for other types.
ElementType ComplexPart(ElementType t);
ElementType ComplexOf(ElementType t);

// A ranked tensor type: element type and static dimensions (rank 0 = scalar).
struct TensorType {
  ElementType element = ElementType::kF32;
  std::vector<int64_t> dims;
  int64_t rank() const { return static_cast<int64_t>(dims.size()); }
  int64_t numel() const;
  std::string ToString() const;  // "tensor<2x3xf32>", "tensor<f32>"
  bool operator==(const TensorType&) const = default;
};

// An SSA value of the module being built.
struct Value {
  std::string name;  // "%3", "%arg0", "%5#1"
  TensorType type;
  const std::vector<int64_t>& dims() const { return type.dims; }
  ElementType element() const { return type.element; }
  int64_t rank() const { return type.rank(); }
};

// Thrown for malformed requests (mismatched shapes or types); the message
// names the op.
class BuildError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class CompareDirection { kEQ, kNE, kLT, kLE, kGT, kGE };

struct GatherDims {
  std::vector<int64_t> offset_dims, collapsed_slice_dims, start_index_map;
  std::vector<int64_t> operand_batching_dims, start_indices_batching_dims;
  int64_t index_vector_dim = 0;
};
struct ScatterDims {
  std::vector<int64_t> update_window_dims, inserted_window_dims,
      scatter_dims_to_operand_dims;
  std::vector<int64_t> input_batching_dims, scatter_indices_batching_dims;
  int64_t index_vector_dim = 0;
};
struct DotDims {
  std::vector<int64_t> lhs_batch, rhs_batch, lhs_contract, rhs_contract;
};
// Convolution dimension numbers (StableHLO conv_dimension_numbers).
struct ConvDims {
  int64_t input_batch = 0, input_feature = 1;
  std::vector<int64_t> input_spatial;
  int64_t kernel_output_feature = 0, kernel_input_feature = 1;
  std::vector<int64_t> kernel_spatial;
  int64_t output_batch = 0, output_feature = 1;
  std::vector<int64_t> output_spatial;
};

// How a collective's process ids are read (StableHLO spec, "collective
// ops"): channel_id 0 (no channel_handle) = cross_replica (ids are replica
// ids, the program compiled with num_replicas = processes); channel_id > 0
// without use_global_device_ids = cross_replica_and_partition; with it =
// flattened_ids (ids are replica * num_partitions + partition, needs a
// channel). The channel handle is type DEVICE_TO_DEVICE (1).
struct CollectiveOptions {
  int64_t channel_id = 0;
  bool use_global_device_ids = false;
};

class Builder;
// Builds the body of a region (reduce, scatter, sort): receives the block
// arguments and returns the values passed to stablehlo.return.
using RegionFn = std::function<std::vector<Value>(Builder&, std::span<const Value>)>;

class Builder {
 public:
  Builder() = default;

  // Adds an argument to @main, in call order (may be called between ops).
  Value Parameter(const TensorType& type);
  // Number of @main's arguments so far.
  size_t num_parameters() const { return params_.size(); }
  // Lets XLA write result `result_index` into the buffer of argument
  // `param_index` when the caller donates it at execution (a may-alias
  // input_output_alias: `tf.aliasing_output`, as JAX emits; an argument that
  // is not donated at run time gets a fresh result buffer). The two must
  // have the same type; checked by Module(). Throws BuildError on a bad
  // index or a second alias of the same argument or result.
  void AliasParameter(size_t param_index, size_t result_index);
  // Sets @main's results; must be called exactly once before Module().
  void Return(std::span<const Value> results);
  // The complete module text.
  std::string Module() const;

  // --- constants and shapes -------------------------------------------
  // 0-d or splat constant; value is converted to `type.element` (floats via
  // their exact bit pattern, so NaN and Inf are representable). Float8
  // types throw BuildError: their rounding is the caller's (ConstantBits).
  Value Constant(const TensorType& type, double value);
  // 0-d or splat constant of a floating type given as its bit pattern
  // (the low BitWidth(type.element) bits of `bits`); BuildError for
  // non-floating types.
  Value ConstantBits(const TensorType& type, uint64_t bits);
  Value ConstantInt(const TensorType& type, int64_t value);
  Value ScalarConstant(ElementType t, double value) { return Constant({t, {}}, value); }
  Value ConstantI64Vector(std::span<const int64_t> values);  // tensor<Nxi64>
  Value Iota(const TensorType& type, int64_t dimension);
  Value Reshape(const Value& x, std::span<const int64_t> dims);
  Value BroadcastInDim(const Value& x, std::span<const int64_t> dims,
                       std::span<const int64_t> broadcast_dimensions);
  Value Transpose(const Value& x, std::span<const int64_t> permutation);
  Value Slice(const Value& x, std::span<const int64_t> start,
              std::span<const int64_t> limit, std::span<const int64_t> strides);
  Value DynamicSlice(const Value& x, std::span<const Value> start_indices,
                     std::span<const int64_t> slice_sizes);
  Value DynamicUpdateSlice(const Value& x, const Value& update,
                           std::span<const Value> start_indices);
  Value Concatenate(std::span<const Value> xs, int64_t dimension);
  Value Pad(const Value& x, const Value& padding_value, std::span<const int64_t> low,
            std::span<const int64_t> high, std::span<const int64_t> interior);
  Value Reverse(const Value& x, std::span<const int64_t> dims);
  Value Convert(const Value& x, ElementType to);
  Value BitcastConvert(const Value& x, ElementType to);

  // --- elementwise (operands must have identical types, except Select's
  // predicate and Compare's result) --------------------------------------
  Value Unary(std::string_view op, const Value& x);  // "stablehlo.exponential", ...
  Value Binary(std::string_view op, const Value& a, const Value& b);
  Value Add(const Value& a, const Value& b) { return Binary("stablehlo.add", a, b); }
  Value Sub(const Value& a, const Value& b) { return Binary("stablehlo.subtract", a, b); }
  Value Mul(const Value& a, const Value& b) { return Binary("stablehlo.multiply", a, b); }
  Value Div(const Value& a, const Value& b) { return Binary("stablehlo.divide", a, b); }
  Value Rem(const Value& a, const Value& b) { return Binary("stablehlo.remainder", a, b); }
  Value Max(const Value& a, const Value& b) { return Binary("stablehlo.maximum", a, b); }
  Value Min(const Value& a, const Value& b) { return Binary("stablehlo.minimum", a, b); }
  Value Pow(const Value& a, const Value& b) { return Binary("stablehlo.power", a, b); }
  Value And(const Value& a, const Value& b) { return Binary("stablehlo.and", a, b); }
  Value Or(const Value& a, const Value& b) { return Binary("stablehlo.or", a, b); }
  Value Xor(const Value& a, const Value& b) { return Binary("stablehlo.xor", a, b); }
  Value Neg(const Value& x) { return Unary("stablehlo.negate", x); }
  Value Abs(const Value& x) { return Unary("stablehlo.abs", x); }
  Value Exp(const Value& x) { return Unary("stablehlo.exponential", x); }
  Value Log(const Value& x) { return Unary("stablehlo.log", x); }
  Value Sqrt(const Value& x) { return Unary("stablehlo.sqrt", x); }
  Value Rsqrt(const Value& x) { return Unary("stablehlo.rsqrt", x); }
  Value Tanh(const Value& x) { return Unary("stablehlo.tanh", x); }
  Value Not(const Value& x) { return Unary("stablehlo.not", x); }
  Value Floor(const Value& x) { return Unary("stablehlo.floor", x); }
  Value IsFinite(const Value& x);  // result element type pred
  Value Compare(const Value& a, const Value& b, CompareDirection dir);
  Value Select(const Value& pred, const Value& on_true, const Value& on_false);
  Value Clamp(const Value& min, const Value& x, const Value& max);
  // Complex numbers (StableHLO real/imag/complex): Real and Imag take a
  // complex tensor and return its parts (f32 for c64, f64 for c128); of a
  // floating tensor, Real is the tensor and Imag zeros (the spec's rule).
  // Complex(re, im) takes two f32 (f64) tensors of one shape -> c64 (c128).
  Value Real(const Value& x);
  Value Imag(const Value& x);
  Value Complex(const Value& re, const Value& im);

  // --- reductions, contractions, indexing --------------------------------
  // Reduces each input over `dimensions` with init values and a body taking
  // 2*N scalars (accumulators then elements) and returning N scalars.
  std::vector<Value> Reduce(std::span<const Value> inputs, std::span<const Value> inits,
                            std::span<const int64_t> dimensions, const RegionFn& body);
  std::vector<Value> ReduceWindow(std::span<const Value> inputs, std::span<const Value> inits,
                                  std::span<const int64_t> window_dimensions,
                                  std::span<const int64_t> window_strides,
                                  std::span<const int64_t> base_dilations,
                                  std::span<const int64_t> window_dilations,
                                  std::span<const std::pair<int64_t, int64_t>> padding,
                                  const RegionFn& body);
  Value DotGeneral(const Value& lhs, const Value& rhs, const DotDims& dims,
                   ElementType result_element);
  Value Convolution(const Value& input, const Value& kernel, const ConvDims& dims,
                    std::span<const int64_t> window_strides,
                    std::span<const std::pair<int64_t, int64_t>> padding,
                    std::span<const int64_t> lhs_dilation,
                    std::span<const int64_t> rhs_dilation,
                    int64_t feature_group_count, int64_t batch_group_count,
                    const TensorType& result_type);
  Value Gather(const Value& operand, const Value& start_indices, const GatherDims& dims,
               std::span<const int64_t> slice_sizes, const TensorType& result_type);
  // update computation: body(current, update) -> new value
  Value Scatter(const Value& operand, const Value& indices, const Value& updates,
                const ScatterDims& dims, const RegionFn& body);
  // Sorts all inputs along `dimension` by the comparator body(lhs0, rhs0, lhs1, rhs1, ...)
  std::vector<Value> Sort(std::span<const Value> inputs, int64_t dimension, bool is_stable,
                          const RegionFn& comparator);
  // THREE_FRY random bits: state tensor<2xui64> -> (new state, bits of `type`).
  std::pair<Value, Value> RngBitGenerator(const Value& state, const TensorType& type);

  // stablehlo.fft over the last `lengths.size()` dimensions (1 to 3), as
  // the spec defines it: kind "FFT"/"IFFT" complex -> complex (IFFT divides
  // by the product of `lengths`), "RFFT" f32/f64 -> c64/c128 with the last
  // dimension n -> n/2+1, "IRFFT" c64/c128 -> f32/f64 with the last
  // dimension `lengths.back()` (reads lengths.back()/2+1 inputs, divides by
  // the product). Throws BuildError on mismatched shapes or types.
  Value Fft(const Value& x, std::string_view kind, std::span<const int64_t> lengths);

  // --- control flow and linear algebra ------------------------------------
  // stablehlo.while: loop-carried values start at `init`; cond(values) returns
  // one 0-d pred, body(values) returns the next values (same types). Region
  // bodies may use values defined outside the loop. Returns the final values.
  std::vector<Value> While(std::span<const Value> init, const RegionFn& cond, const RegionFn& body);
  // stablehlo.triangular_solve: a [..., n, n] (only the `lower`/upper triangle
  // is read; unit_diagonal assumes ones on the diagonal), b [..., n, k]
  // (left_side: solves op(a) x = b) or [..., k, n] (x op(a) = b);
  // op(a) = a^T where transpose_a. Floating or complex elements; same batch dims.
  Value TriangularSolve(const Value& a, const Value& b, bool left_side, bool lower,
                        bool unit_diagonal, bool transpose_a);
  // stablehlo.cholesky of a [..., n, n]: lower -> L with a = L L^T (reads the
  // lower triangle), else U with a = U^T U. The opposite triangle of the
  // result is implementation-defined; non positive-definite input gives NaN.
  Value Cholesky(const Value& a, bool lower);
  // stablehlo.custom_call @target (api_version 1, string backend_config),
  // e.g. XLA's "Qr", "Eigh" and "ProductOfElementaryHouseholderReflectors",
  // which XLA's own expander passes rewrite into HLO.
  std::vector<Value> CustomCall(std::string_view target, std::span<const Value> operands,
                                std::span<const TensorType> result_types,
                                std::string_view backend_config = {});

  // --- collectives (StableHLO spec, "all_reduce" .. "collective_permute") --
  // A program run by several processes (replicas or partitions, see
  // CollectiveOptions). `groups`: replica_groups, each a list of process
  // ids; all groups the same size (the op's group size). `body` (AllReduce,
  // ReduceScatter) takes two 0-d values of x's element type and returns one.
  // Shapes: AllReduce and CollectivePermute keep x's type; AllGather
  // multiplies `dimension` by the group size; ReduceScatter divides it (it
  // must be divisible); AllToAll splits `split_dimension` into group-size
  // blocks (divisible) and concatenates the received blocks along
  // `concat_dimension`. CollectivePermute's `pairs` are (source, target)
  // process ids, each source and each target at most once; a process that
  // is no target receives zeros. Throws BuildError on uneven groups, bad
  // dimensions, indivisible sizes or repeated pairs.
  using ReplicaGroups = std::vector<std::vector<int64_t>>;
  Value AllReduce(const Value& x, const ReplicaGroups& groups, const RegionFn& body,
                  const CollectiveOptions& options = {});
  Value AllGather(const Value& x, int64_t dimension, const ReplicaGroups& groups,
                  const CollectiveOptions& options = {});
  Value ReduceScatter(const Value& x, int64_t dimension, const ReplicaGroups& groups,
                      const RegionFn& body, const CollectiveOptions& options = {});
  Value AllToAll(const Value& x, int64_t split_dimension, int64_t concat_dimension,
                 const ReplicaGroups& groups, const CollectiveOptions& options = {});
  Value CollectivePermute(const Value& x, std::span<const std::pair<int64_t, int64_t>> pairs,
                          const CollectiveOptions& options = {});
  // stablehlo.replica_id / partition_id: tensor<ui32> of the running process.
  Value ReplicaId();
  Value PartitionId();

  // Emits an arbitrary op in generic form (escape hatch for lowerings):
  // `attributes` is the text inside {...} (may be empty).
  std::vector<Value> Op(std::string_view name, std::span<const Value> operands,
                        std::span<const TensorType> result_types,
                        std::string_view attributes = {});

 private:
  std::string NewName();
  std::string Emit(std::string_view name, std::span<const Value> operands,
                   std::span<const TensorType> result_types, std::string_view attributes,
                   std::span<const std::pair<std::vector<TensorType>, RegionFn>> regions = {});
  std::vector<Value> EmitValues(std::string_view name, std::span<const Value> operands,
                                std::span<const TensorType> result_types,
                                std::string_view attributes,
                                std::span<const std::pair<std::vector<TensorType>, RegionFn>> regions = {});
  Value Emit1(std::string_view name, std::span<const Value> operands, const TensorType& result,
              std::string_view attributes = {});

  std::vector<TensorType> params_;
  std::vector<std::pair<size_t, size_t>> aliases_;  // (argument, result)
  std::vector<TensorType> results_;
  std::vector<std::string> result_names_;
  std::string body_;
  int indent_ = 2;
  int next_id_ = 0;
  bool returned_ = false;
};

// "array<i64: 1, 2>" and "[1, 2]" spellings used in attributes.
std::string I64Array(std::span<const int64_t> v);
std::string I64List(std::span<const int64_t> v);

}  // namespace torch_tpu::hlo
