// torch_tpu distributed layer, XLA-native transport: each collective is one
// StableHLO program (stablehlo.all_reduce, all_gather, reduce_scatter,
// all_to_all, collective_permute) compiled for num_replicas = the group
// size and run on every device of the group at once, so the data moves
// device to device inside XLA (ICI on TPU, NCCL inside the XLA CUDA plugin)
// instead of through host memory and gloo.
//
// No torch here (csrc/hlo builds the programs, csrc/pjrt runs them): the
// programs are tested in GoogleTest on the CPU plugin's devices in one
// process (tests/cpp/xla_transport_test.cpp). process_group.cpp decides
// whether a group takes this transport (UsableFor) and converts tensors.
//
// Semantics follow torch.distributed (ProcessGroupNCCL where gloo has no
// counterpart):
// - all_reduce SUM / PRODUCT / MIN / MAX in the element type; AVG = SUM,
//   then division by the group size in the element type; PREMUL_SUM = each
//   input multiplied by its process's factor (a 0-d argument of the element
//   type), then SUM. AVG and PREMUL_SUM need floating point. Bool: SUM and
//   MAX are logical or, PRODUCT and MIN logical and (as NCCL maps them).
// - all_gather: the inputs concatenated along dimension 0 in replica order
//   (_allgather_base / all_gather_into_tensor).
// - reduce_scatter: dimension 0 (divisible by the group size) reduced, and
//   replica r keeps block r (_reduce_scatter_base), same reductions.
// - all_to_all: even splits along dimension 0 (all_to_all_single without
//   split sizes): block j of replica i goes to replica j, the received
//   blocks concatenated in source order. Uneven splits are not one StableHLO
//   op; they stay on the host-staged transport.
// - collective_permute: (source, target) replica pairs; a replica that is
//   no target receives zeros (send/recv: one pair).
// - broadcast from `root`: ceil(log2 n) collective_permute rounds (each
//   holder sends to one new replica), a replica keeping its value until it
//   is a round's target: bit-exact for every dtype.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "hlo/builder.h"
#include "pjrt/pjrt.h"

namespace torch_tpu::distributed {

enum class CollectiveKind : uint8_t { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kPermute, kBroadcast };
enum class ReduceKind : uint8_t { kSum, kProduct, kMin, kMax, kAvg, kPremulSum };

// What determines one collective program: the in-memory cache key,
// compared in full.
struct CollectiveSpec {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  ReduceKind reduce = ReduceKind::kSum;  // all_reduce, reduce_scatter
  hlo::ElementType element = hlo::ElementType::kF32;
  std::vector<int64_t> dims;  // each replica's input (static shape)
  int group_size = 1;
  std::vector<std::pair<int64_t, int64_t>> pairs;  // permute: (source, target) replicas
  int64_t root = 0;                                // broadcast
  // Replica r runs on the device of id devices[r] (pjrt::Device::id: global
  // ids on a client that spans processes); empty: the client's default
  // assignment (replica r on device r).
  std::vector<int64_t> devices;
  // Storage layout (torch_tpu's storages are rank-1 buffers of a capacity
  // >= their elements, DESIGN.md "Memory model"): when > 0, the input
  // parameter is rank 1 of input_capacity elements whose first numel(dims)
  // are the input (row-major), the PREMUL_SUM factor rank 1 of
  // factor_capacity elements whose first is the factor, and the output is
  // flattened and zero-padded to output_capacity elements. 0: exact shapes.
  int64_t input_capacity = 0;
  int64_t factor_capacity = 0;
  int64_t output_capacity = 0;
  bool operator==(const CollectiveSpec&) const = default;
  std::string ToString() const;  // "all_reduce(sum) f32[4] over 2 replicas"
};

// The program of a spec: MLIR text of @main(input [, factor]) -> output and
// the compile options (num_replicas = group size, num_partitions 1, the
// spec's device assignment).
// `num_inputs`: 2 for PREMUL_SUM (the factor, 0-d of the element type), 1
// otherwise. Throws std::invalid_argument (hlo::BuildError) naming the
// collective for: group size < 1, AVG/PREMUL_SUM of non-floating types,
// a dimension 0 not divisible by the group size (reduce_scatter,
// all_to_all) or rank 0 where a dimension 0 is needed, pairs or root out of
// range, a device list that is not one device per replica.
struct CollectiveProgram {
  std::string module;
  pjrt::CompileOptions options;
  int num_inputs = 1;
  hlo::TensorType output;
};
CollectiveProgram BuildCollectiveProgram(const CollectiveSpec& spec);

class XlaTransport {
 public:
  // Compiles a module: the backend passes one through the on-disk
  // executable cache (runtime::DiskCache, keyed on the module text and the
  // serialized options like every other program); the default calls
  // Client::Compile.
  using Compiler = std::function<std::unique_ptr<pjrt::Executable>(pjrt::Client&, const std::string& module,
                                                                   const pjrt::CompileOptions& options)>;
  explicit XlaTransport(std::shared_ptr<pjrt::Client> client, Compiler compile = {});

  // Whether this transport can carry a group of `group_size` processes of
  // this client, one device each: the client must span processes
  // (global_device_count() > its addressable devices, as libtpu and the
  // XLA CUDA plugin created with node_id/num_nodes do) and hold at least
  // group_size devices. False on the CPU plugin, whose client is one
  // process ("Multiprocess computations aren't implemented on the CPU
  // backend"): there the backend stays host-staged.
  static bool UsableFor(const pjrt::Client& client, int group_size);

  // The devices of this process the spec's program runs on, in the order
  // Run takes its inputs (compiles the program on first use).
  std::vector<PJRT_Device*> Devices(const CollectiveSpec& spec);

  // Runs the collective: inputs[i] (and factors[i] for PREMUL_SUM) are the
  // buffers of the i-th of Devices(spec), of the spec's element type and
  // dims; returns one output buffer per device, in the same order (ready
  // later: the caller awaits or reads them). Throws std::invalid_argument
  // for a wrong number of buffers or missing factors, pjrt::Error from the
  // plugin.
  std::vector<std::unique_ptr<pjrt::Buffer>> Run(const CollectiveSpec& spec, std::span<pjrt::Buffer* const> inputs,
                                                 std::span<pjrt::Buffer* const> factors = {});

  // Programs compiled by this transport (cache misses) and kept.
  int64_t compiles() const { return compiles_; }
  size_t cached() const;

 private:
  struct Entry {
    CollectiveSpec spec;
    int num_inputs;
    std::shared_ptr<pjrt::Executable> executable;
  };
  const Entry& Lookup(const CollectiveSpec& spec);

  std::shared_ptr<pjrt::Client> client_;
  Compiler compile_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Entry>> entries_;  // few: one per (collective, dtype, shape, group)
  int64_t compiles_ = 0;
};

}  // namespace torch_tpu::distributed
