// Shared building blocks for lowering functions: broadcasting, casts,
// constants, reductions, and reading/writing strided views of a flat
// storage buffer (DESIGN.md, "Memory model").
#pragma once

#include <span>
#include <vector>

#include "lowering/lowering.h"

namespace torch_tpu::lowering {

using hlo::Builder;
using hlo::ElementType;
using hlo::TensorType;
using hlo::Value;

// Python-style dim normalization; throws LoweringError naming the op.
int64_t NormalizeDim(int64_t dim, int64_t rank);
// numpy/PyTorch broadcast of two shapes.
std::vector<int64_t> BroadcastShapes(std::span<const int64_t> a, std::span<const int64_t> b);
// Broadcasts `v` (right-aligned) to `dims`.
Value BroadcastTo(Builder& b, const Value& v, std::span<const int64_t> dims);
// Converts to a torch dtype (bool conversion is `!= 0`, as in PyTorch).
Value Cast(Builder& b, const Value& v, at::ScalarType to);
Value CastElement(Builder& b, const Value& v, ElementType to);
// A splat constant with v's element type and dims.
Value ConstLike(Builder& b, const Value& like, double value);
Value Const(Builder& b, ElementType t, double value, std::span<const int64_t> dims = {});
// Cast then broadcast: the usual operand preparation of pointwise ops.
Value Prepare(Builder& b, const Value& v, at::ScalarType dtype, std::span<const int64_t> dims);

// Reductions over `dims` (sorted, normalized); keepdim reshapes back.
Value ReduceSum(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim);
Value ReduceMax(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim);
Value ReduceMin(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim);
Value ReduceProd(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim);
Value ReduceAnd(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim);
Value ReduceOr(Builder& b, const Value& x, std::span<const int64_t> dims, bool keepdim);
// Shape of x with `dims` set to 1 (keepdim form).
std::vector<int64_t> KeepDimShape(std::span<const int64_t> shape, std::span<const int64_t> dims);
// Normalized, sorted, deduplicated reduction dims; empty `dims` = all.
std::vector<int64_t> ReductionDims(std::span<const int64_t> dims, int64_t rank);

// NaN-propagating max/min, as torch.maximum/minimum (StableHLO's
// maximum/minimum propagate NaN too, but the CPU plugin's fast-min-max may
// not, so the choice is explicit).
Value MaxPropagateNaN(Builder& b, const Value& x, const Value& y);
Value MinPropagateNaN(Builder& b, const Value& x, const Value& y);

// Floating compute dtype for an op producing `out`: bf16/f16 compute in f32
// (PyTorch's opmath type), others as they are.
at::ScalarType OpMathType(at::ScalarType out);

// Number of elements of a shape (1 for rank 0).
int64_t Numel(std::span<const int64_t> dims);
// v as `sizes`: unchanged if it has them, reshaped if it has as many
// elements, else broadcast (BroadcastTo's rules).
Value Fit(Builder& b, const Value& v, std::span<const int64_t> sizes);
// v cast to the output's dtype and fitted to its sizes.
Value Out(Builder& b, const Value& v, const OutputSpec& spec);
// The largest finite value of floating dtype t (Half 65504, BFloat16
// 3.3895e38, Float FLT_MAX, else DBL_MAX), as std::numeric_limits<scalar_t>::max().
double MaxFinite(at::ScalarType t);

// PyTorch's type promotion over the named arguments of the op
// (at::native::result_type: dimensioned tensors over 0-d tensors over Python
// numbers, each category only raising the kind: bool < integer < floating
// < complex; a Python float is the default dtype). Absent arguments are
// skipped; a Python complex is the default complex dtype. Throws
// LoweringError when no argument is a tensor or Scalar. Entries whose
// lowering handles complex results say so (LoweringTraits::complex).
at::ScalarType ResultType(const LoweringContext& ctx, std::initializer_list<std::string_view> names);

// --- strided views of a flat storage ------------------------------------
// A tensor's view of its storage: sizes, strides and offset in elements.
struct ViewLayout {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
};
// Extracts the view from `flat` (rank 1, the whole storage) inside the
// program: reshape for a whole contiguous storage, slice+reshape+transpose
// (+broadcast for zero strides) where the strides allow, else a gather.
Value ReadView(Builder& b, const Value& flat, const ViewLayout& view);
// A flat storage reinterpreted with another element type, as PyTorch's
// storages are untyped bytes (x.view(torch.int32), byte copies of a storage
// in torch.save): same width -> bitcast; narrower -> each element splits
// into several (f32[N] -> u8[4N]); wider -> groups join (u8[4N] -> f32[N]).
// Throws LoweringError where the sizes do not divide.
Value ReinterpretFlat(Builder& b, const Value& flat, ElementType to);
// `flat` (rank 1) as `n` elements: its first n (a slice) where it is
// longer, itself followed by zeros where it is shorter. Moves values between
// a storage's elements and its buffer's capacity (runtime::Capacity).
Value ResizeFlat(Builder& b, const Value& flat, int64_t n);
// Returns the new flat storage with `value` (the view's sizes) written at the
// view's elements: update-slice where the layout allows, else a scatter.
Value WriteView(Builder& b, const Value& flat, const ViewLayout& view, const Value& value);

// Random bits for `dims` (row-major) from a THREE_FRY state (key, counter):
// element i depends only on (key, counter + i), the counter-based contract
// of CUDA's Philox generator that DTensor's OffsetBasedRNGTracker relies on
// (a shard drawn at offset o + k equals elements k.. of the whole tensor
// drawn at offset o). rng_bit_generator gives 64-bit outputs one counter
// each (32-bit outputs would pair two elements on one counter), so the
// 32-bit forms take halves of a u64 draw. RandomBits32: the low halves;
// RandomBits32Pair: (low, high), two independent values per element.
Value RandomBits64(Builder& b, const Value& rng_state, std::span<const int64_t> dims);
Value RandomBits32(Builder& b, const Value& rng_state, std::span<const int64_t> dims);
std::pair<Value, Value> RandomBits32Pair(Builder& b, const Value& rng_state, std::span<const int64_t> dims);

}  // namespace torch_tpu::lowering
