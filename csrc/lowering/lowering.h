// torch_tpu lowering library: ATen op -> StableHLO.
//
// A registry maps an ATen op's base name ("add", "native_layer_norm"; the
// in-place "add_" and out= "add.out" variants share the entry of "add") to a
// lowering function. The function receives a LoweringContext holding the
// op's arguments in schema order (tensor arguments as StableHLO values shaped
// like the tensor, Scalar arguments as 0-d runtime parameters, everything
// else as static values) and the output specs PyTorch's meta kernels
// computed; it returns one StableHLO value per tensor the op returns.
// PyTorch semantics (type promotion, NaN propagation, integer division,
// index checks) live in the lowering functions. The same registry serves
// every executor and torch.compile.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hlo/builder.h"

namespace torch_tpu::lowering {

// How a Scalar argument or a wrapped CPU 0-d tensor reaches the program.
hlo::ElementType ToElementType(at::ScalarType t);
at::ScalarType ToScalarType(hlo::ElementType t);

// One argument of an ATen call, as seen by a lowering function.
struct LoweredArg {
  enum class Kind : uint8_t {
    kNone,        // an absent optional (None)
    kTensor,      // a tensor: `value` has the tensor's dtype and sizes
    kTensorList,  // Tensor[] or Tensor?[]: `list`, with `present` for optionals
    kScalar,      // a Scalar (or CPU 0-d tensor): `value` is a 0-d runtime input
    kStatic,      // anything else (int, float, bool, int[], dtype, ...): `ivalue`
  };
  Kind kind = Kind::kNone;
  std::string_view name;
  hlo::Value value;
  std::vector<hlo::Value> list;
  std::vector<bool> present;
  c10::IValue ivalue;
  at::ScalarType dtype = at::ScalarType::Undefined;  // kTensor/kScalar: torch dtype
  bool wrapped_number = false;                       // Python number / CPU 0-d tensor
  // kTensor: the tensor's is_contiguous() (eager executors; the executable
  // cache keys on strides). For the few ops whose CPU result depends on the
  // input's layout (det/slogdet factor A^T when A is contiguous, and their
  // backward reads that LU). Graph lowering sees values: always true.
  bool contiguous = true;
  // kTensorList in a shape-polymorphic program (LoweringContext::poly_extent):
  // per item, whether it is read at the bucket along poly_dim (its real size
  // there is the runtime extent; positions past it are padding). Empty
  // otherwise.
  std::vector<bool> dynamic_items;
};

// The output PyTorch's meta kernel computed for a returned tensor.
struct OutputSpec {
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
};

class LoweringError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class LoweringContext {
 public:
  LoweringContext(hlo::Builder& builder, const c10::FunctionSchema& schema)
      : b(builder), schema(schema) {}

  hlo::Builder& b;
  const c10::FunctionSchema& schema;
  std::vector<LoweredArg> args;      // schema order, out= arguments excluded
  std::vector<OutputSpec> outputs;   // one per returned tensor
  // A shape-polymorphic program of a poly_concat entry (eager executors):
  // the runtime extent (s64, 0-d) of the list items marked in
  // LoweredArg::dynamic_items, which are read at the bucket along dim
  // `poly_dim`; outputs are sized at the bucket. Unset otherwise.
  std::optional<hlo::Value> poly_extent;
  int64_t poly_dim = 0;

  // Lookup by schema argument name; throws LoweringError if absent.
  const LoweredArg& arg(std::string_view name) const;
  const LoweredArg* find(std::string_view name) const;  // nullptr if no such argument
  bool has(std::string_view name) const;   // exists and is not None
  const hlo::Value& tensor(std::string_view name) const;
  // A tensor or Scalar argument as a value (scalars are 0-d).
  const hlo::Value& value(std::string_view name) const;
  int64_t int_arg(std::string_view name) const;
  std::optional<int64_t> opt_int(std::string_view name) const;
  double float_arg(std::string_view name) const;
  bool bool_arg(std::string_view name) const;
  // An int[]/SymInt[] (or a single int) argument; absent or None -> empty.
  std::vector<int64_t> ints(std::string_view name) const;
  // A bool[n] argument such as output_mask; absent -> all true.
  std::vector<bool> bools(std::string_view name, size_t n) const;
  std::optional<std::vector<int64_t>> opt_ints(std::string_view name) const;
  std::optional<at::ScalarType> opt_dtype(std::string_view name) const;
  std::string_view string_arg(std::string_view name) const;

  // The op's random state: a tensor<2xui64> runtime input (key, counter)
  // drawn from the tpu generator at run time. Only for entries with
  // traits.needs_rng.
  hlo::Value rng_state();
  std::optional<hlo::Value> rng_state_value;

  // How far one call advances the generator's offset: the elements of the
  // first output (every random op draws one counter per element of its first
  // output; native_dropout's mask is the same draws; ops that draw more take
  // a stream of their own), rounded up to a multiple of 4 as DTensor's
  // OffsetBasedRNGTracker rounds its offsets (CUDA's Philox steps in 4s), so
  // a whole-tensor draw and a DTensor draw leave the generator at the same
  // offset. At least 4 (an empty output still moves the stream on).
  static int64_t RngIncrement(const std::vector<OutputSpec>& outputs);
  // The same for a first output of `numel` elements.
  static int64_t RngIncrementOf(int64_t numel);

  // Writes `value` into the tensor argument `name` (which must be a tensor):
  // for ops that mutate arguments they do not return (batch norm's running
  // statistics, _copy_from's dst).
  void write(std::string_view name, hlo::Value value);
  std::vector<std::pair<std::string_view, hlo::Value>> writes;

  // A check PyTorch makes on the input VALUES (CPU raises before computing):
  // `bad` is a 0-d pred, true when the input is invalid. The eager executors
  // raise RuntimeError(`message`, prefixed by the op) at the next sync point
  // (debug mode: right after the op), as they do for index checks; compiled
  // graphs (graph_program.cpp) raise them at the sync point after the graph.
  void check(hlo::Value bad, std::string message);
  std::vector<std::pair<hlo::Value, std::string>> checks;
  // As check(), where CPU raises IndexError (nll_loss: "Target 5 is out of
  // bounds."): the executors raise IndexError(`message`, prefixed by the op).
  void check_index(hlo::Value bad, std::string message);
  std::vector<std::pair<hlo::Value, std::string>> index_errors;

  // Debug label of the op being lowered: "aten::add.Tensor".
  std::string op_name() const;
};

using LowerFn = std::vector<hlo::Value> (*)(LoweringContext& ctx);

// Bounds check that the debug executor runs before an indexing op:
// every value of tensor argument `index` (or each tensor of a list) must lie
// in [0, n) — or [-n, n) where `allow_negative` (advanced indexing) — where
// n = size of argument `source` along dimension `dim_arg` (an int argument;
// empty = dimension 0, or for lists the list position), as on CPU.
struct IndexCheck {
  std::string_view index;
  std::string_view source;
  std::string_view dim_arg;
  bool allow_negative = false;
  // CPU raises RuntimeError, not IndexError, for this op (gather, scatter*:
  // "index 23 is out of bounds for dimension 1 with size 2").
  bool runtime_error = false;
};

// Whether, and how, the eager executors may run an entry's lowering on a
// bucketed leading dim (shape polymorphism, DESIGN.md "One ATen call"):
// the program computes rows [0, B) of the inputs whose leading dim is the
// call's dynamic extent n <= B, and rows [n, B) — the padding — hold `fill`
// where the op could carry them into a result row (a reduction over the
// leading dim), or anything (kAny: every result row reads only its own
// input rows, as elementwise ops). kNone: exact shapes only.
enum class PadFill : uint8_t {
  kNone,
  kAny,
  kZero,     // sum, any, nansum, count_nonzero
  kOne,      // prod, all
  kLowest,   // amax: -inf, or the integer type's minimum (false for bool)
  kHighest,  // amin: +inf, or the integer type's maximum (true for bool)
};

struct LoweringTraits {
  bool needs_rng = false;
  // Set by the registry for the families that are exact on a bucketed
  // leading dim (registry.cpp, kShapePoly); never by an entry itself.
  PadFill shape_poly = PadFill::kNone;
  // Set by the registry for cat: the dynamic dim is the concatenation dim
  // of a tensor list, some of whose items have the extent there (the KV
  // cache's growing operand); the lowering places every later item at a
  // runtime offset (LoweringContext::poly_extent).
  bool poly_concat = false;
  // A random op whose output element i depends only on (seed, offset + i),
  // its static arguments and element i of its same-shape tensor operands
  // (uniform_, normal_/normal, random_, exponential_, bernoulli_/bernoulli
  // with a float p, native_dropout): eager calls of any shape share one
  // program per bucket Capacity(numel) of its tensors' element count
  // (compiled_op.cpp PlanPolyFlat), whose first numel values are the exact
  // program's, bit for bit. Needs needs_rng and no value checks.
  bool poly_flat = false;
  // Set by the registry for mm and addmm: the dynamic dim is the rows of
  // the left matrix (mm's self, addmm's mat1; compiled_op.cpp
  // PlanPolyMatmul); the right matrix and addmm's bias are static. Output
  // row i is the dot of input row i with the right matrix, so padding rows
  // reach only padding rows of the output (no reduction over them).
  bool poly_matmul = false;
  // Set by the registry for native_layer_norm: PlanPoly's dynamic dim must
  // lie before the trailing dims named by the `normalized_shape` argument
  // (each row is normalized by itself, so padding rows never reach a real
  // row's mean or variance; the normalized dims stay exact).
  bool poly_batch_dims = false;
  // Only for whole-graph lowering (torch.compile): view ops (view, permute,
  // slice, ...) computed as values — eager tpu views are metadata over a
  // shared storage and never reach a lowering — and ops whose eager form
  // PyTorch's own kernels serve (_to_copy).
  bool graph_only = false;
  // Scalar arguments are compiled in as constants (part of the cache key)
  // instead of runtime inputs: for ops whose output shape depends on them
  // (arange).
  bool static_scalars = false;
  // CPU's out= kernel resizes `out` only when its numel differs from the
  // result's (linspace, logspace, arange: `if (result.numel() != n)
  // result.resize_({n})`); an out of the right numel keeps its shape and
  // strides and receives the values in its logical order.
  bool out_resized_by_numel = false;
  // With out_resized_by_numel: CPU's kernel warns before that resize when
  // `out` had elements (arange_out, RangeFactories.cpp: "... The out tensor
  // will be resized to a tensor of shape (n,)."); linspace/logspace/range
  // resize silently.
  bool out_resize_warns = false;
  // CPU builds the op's TensorIterator with check_all_same_dtype (unary
  // ops: neg, abs, sign, floor, ...): an out= of another dtype than `self`
  // raises "Found dtype <out> but expected <self>" (checked before lowering,
  // aten/fallback.cpp) instead of being cast into.
  bool out_same_dtype = false;
  std::vector<IndexCheck> index_checks;
  // The lowering computes complex (c64/c128) inputs and outputs with
  // PyTorch's complex semantics. Without it a call with a complex tensor
  // runs on the CPU: a real-only lowering never sees complex values.
  bool complex = false;
  // The results' dtypes where CPU's kernel allocates them otherwise than
  // the meta kernel (a Python decomposition that promotes, or CUDA's
  // rule): called with the call's arguments (schema order) and the meta
  // dtypes of its new results, it sets CPU's. mse_loss_backward's
  // `at::zeros_like(self)` is BFloat16 for a bf16 self and a float
  // grad_output where the meta result is Float; CPU's native_layer_norm
  // gives mean/rstd the input's dtype unless weight/bias have another.
  // Applied by compiled_op.cpp ComputeSpec, so the program, a host-first
  // call (CPU's kernel) and CPU agree. nullptr: the meta dtypes.
  void (*result_dtypes)(std::span<const c10::IValue> args, std::span<at::ScalarType> dtypes) = nullptr;
};

struct LoweringEntry {
  std::string_view name;  // base name, e.g. "add"
  LowerFn fn = nullptr;
  LoweringTraits traits;
};

// nullptr if no lowering is registered for this base name.
const LoweringEntry* FindLowering(std::string_view base_name);
// False when the call has a complex tensor or Scalar (argument or output)
// and the entry does not declare complex support (traits.complex); view
// entries (graph_only) and copy/clone/fill/zero/alias_copy/view_copy move
// complex elements as they are. Both executors' paths and graph lowering
// check it before calling the lowering, so a real-only lowering never sees
// complex values (the call then runs on the CPU).
bool ComplexSupported(const LoweringEntry& entry, const LoweringContext& ctx);
// False when the call has a float8 tensor (argument or output) and the op
// is not one of the moves, fills, casts, cat/stack, index_select/index and
// where that PyTorch's CPU kernels support for float8 (views pass): the
// call then runs on the CPU, which gives CPU's values or CPU's error.
bool Float8Supported(const LoweringEntry& entry, const LoweringContext& ctx);
// False when the call has a complex32 (ComplexHalf) tensor, Scalar or
// output, unless it is copy/clone/zero/alias_copy/view_copy with complex32
// tensors only (u32 bit patterns moved as they are): complex32 has no XLA
// element type, so every other such call runs on the CPU.
bool Complex32Supported(const LoweringEntry& entry, const LoweringContext& ctx);
// Complex32Supported && ComplexSupported && Float8Supported: what both
// executors' paths and graph lowering check before calling a lowering.
bool DtypesSupported(const LoweringEntry& entry, const LoweringContext& ctx);
// Every registered entry, for coverage reports.
std::vector<const LoweringEntry*> AllLowerings();

// Registers at static-initialization time; use TORCH_TPU_LOWERINGS.
struct LoweringRegistrar {
  LoweringRegistrar(std::initializer_list<LoweringEntry> entries);
};

#define TORCH_TPU_CONCAT_INNER(a, b) a##b
#define TORCH_TPU_CONCAT(a, b) TORCH_TPU_CONCAT_INNER(a, b)
// A registration table: TORCH_TPU_LOWERINGS({{"add", LowerAdd}, ...});
#define TORCH_TPU_LOWERINGS(...)                                             \
  static ::torch_tpu::lowering::LoweringRegistrar TORCH_TPU_CONCAT(         \
      torch_tpu_lowerings_, __LINE__)(__VA_ARGS__)

}  // namespace torch_tpu::lowering
