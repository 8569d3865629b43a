// torch_tpu: why eager ops compile (issue 12, "Visibility").
//
// Every eager single-op compile (compiled_op.cpp, Compile) is recorded here
// with its op name ("aten::add.Tensor") and a CallSignature of the call, and
// gets a cause by comparing the signature with the earlier compiles of the
// same op:
//   first       no earlier compile of this op in this process;
//   new_shape   an earlier compile had the same dtypes and static arguments
//               (only sizes, strides, storage offsets/sizes or size-like
//               SymInt arguments differ);
//   new_dtype   an earlier compile had the same static arguments, none the
//               same dtypes;
//   new_static  no earlier compile had these static arguments (int, float,
//               bool, string, int[] values compiled into the program);
//   other       an earlier compile had the same signature (storages shared
//               differently between arguments, or the executable was
//               evicted from the in-memory cache and compiled again).
// Disk-cache hits count as compiles, as in torch_tpu.metrics()["compiles"].
// Fused regions and torch.compile graphs are not recorded here.
//
// When one op has compiled for TORCH_TPU_RECOMPILE_WARN distinct shapes
// (default 8; 0 disables) a warning, once per op, names the op, the first
// shapes and the remedies (fused mode, torch.compile(dynamic=True), padding
// to a few bucket sizes).
//
// Thread-safe (one mutex; compiles are rare next to launches).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_tpu::runtime {

enum class CompileCause : uint8_t { kFirst = 0, kNewShape, kNewDtype, kNewStatic, kOther };
constexpr size_t kNumCompileCauses = 5;
// "first", "new_shape", "new_dtype", "new_static", "other".
const char* CompileCauseName(CompileCause cause);

// What a call's compile depends on, in three parts (hashes), plus the
// tensor sizes for messages ("[5, 7], [7]").
struct CallSignature {
  size_t layout = 0;   // tensor sizes, strides, storage offsets and sizes; SymInt / SymInt[] values; list lengths
  size_t dtypes = 0;   // tensor dtypes, Scalar kinds, the default dtype
  size_t statics = 0;  // the other non-tensor argument values (and Scalars when `static_scalars`)
  std::string shapes;
};

// The signature of the call whose arguments are stack[first...]; Scalar
// values count as static arguments when `static_scalars` (the lowering
// compiles them in).
CallSignature SignatureOf(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                          bool static_scalars);

struct OpCompileStats {
  int64_t compiles = 0;
  std::array<int64_t, kNumCompileCauses> by_cause{};
  int64_t distinct_shapes = 0;  // distinct `layout`s compiled
  double seconds = 0;           // time in compiles (meta kernel, program build, PJRT compile or cache load)
  std::vector<std::string> shapes;  // the first distinct shapes (at most kKeptShapes)
};

class CompileStats {
 public:
  static constexpr size_t kKeptShapes = 8;
  static CompileStats& Get();

  // Records one compile of `op_name`; returns its cause. May warn (see top).
  CompileCause Record(const std::string& op_name, const CallSignature& sig, double seconds);

  // How many distinct shapes (layouts) `op_name` has compiled for; 0 if none.
  int64_t DistinctShapes(const std::string& op_name) const;
  std::map<std::string, OpCompileStats> Snapshot() const;
  std::array<int64_t, kNumCompileCauses> TotalsByCause() const;
  // TORCH_TPU_RECOMPILE_WARN: distinct shapes before the warning (default 8,
  // 0 = never); throws std::invalid_argument for a value that is not a
  // non-negative integer.
  static int64_t WarnThreshold();

 private:
  struct Seen {
    size_t layout, dtypes, statics;
  };
  struct PerOp {
    OpCompileStats stats;
    std::vector<Seen> seen;  // one per distinct signature
    std::vector<size_t> layouts;
    bool warned = false;
  };
  mutable std::mutex mutex_;
  std::unordered_map<std::string, PerOp> ops_;
};

}  // namespace torch_tpu::runtime
