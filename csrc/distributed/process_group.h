// torch_tpu distributed layer: the c10d backend "tpu_dist" for device tpu.
//
// ProcessGroupTPU is a c10d::Backend (PyTorch's own collective engine calls
// it through ProcessGroup::getBackend(tpu)). This file holds its
// host-staged transport: every collective copies its tpu tensors to host
// tensors (the copy waits for the tensors' pending tpu work, strict or
// fused), runs the same collective on an internal gloo backend built from
// the same store (created by torch_tpu/distributed/__init__.py, under the
// store prefix "tpu_dist_host/"), and, when the Work is waited on, copies
// the host results back into the tpu tensors' storages (in place, as PyTorch
// requires: an output tensor keeps its identity, strides and storage).
//
// With TORCH_TPU_DIST_TRANSPORT=xla, all_reduce, broadcast,
// _allgather_base, _reduce_scatter_base and even alltoall_base of tpu
// tensors run as one StableHLO collective program each instead
// (distributed/xla_transport.h, transport() below); the rest stays
// host-staged.
//
// Zero-copy (zero_copy() below): where the plugin's buffers are host
// memory, gloo runs on the tpu tensors' buffer memory directly, in place;
// the staging copies are skipped for those tensors.
//
// CPU tensors given to this backend (init_process_group("tpu_dist") maps cpu
// to it as well, so barrier() and CPU collectives work) go to gloo directly.
//
// Semantics follow PyTorch's ProcessGroupGloo / ProcessGroupNCCL:
// - ReduceOp SUM, PRODUCT, MIN, MAX, BAND/BOR/BXOR as gloo does; AVG (NCCL's;
//   gloo has none) = SUM then division by the group size, floating point
//   only; PREMUL_SUM (NCCL's, factor a double or a 1-element tensor) =
//   inputs multiplied by the factor on host, then SUM, floating point only.
// - Work: wait() blocks until gloo finished and the results are in the tpu
//   tensors (raising c10::DistBackendError naming the collective, the rank
//   and the transport if gloo failed or timed out: the group's timeout);
//   isCompleted() is true once that has happened (it finishes the copy back
//   when gloo is done); getFuture() finishes the work on the calling thread
//   and returns a completed future holding the output tensors (the copy back
//   runs tpu ops, which stay on the thread that issued the collective).
// Errors: a tensor on a device other than tpu/cpu, AVG/PREMUL_SUM on
// integer or bool tensors: c10::Error naming the collective.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace torch_tpu::distributed {

class StagingPool;  // process_group.cpp: reused host staging buffers
class XlaTransport;  // xla_transport.h
struct CollectiveSpec;

class ProcessGroupTPU : public c10d::Backend {
 public:
  // host: a gloo backend over the same ranks (rank, size), built from a
  // prefix of this group's store. timeout: the group's timeout (reported).
  ProcessGroupTPU(c10::intrusive_ptr<c10d::Backend> host, int rank, int size,
                  std::chrono::milliseconds timeout);

  // Validates the group settings read from the environment
  // (TORCH_TPU_DIST_ZERO_COPY: '0' or '1'; TORCH_TPU_DIST_TRANSPORT: 'host'
  // or 'xla'); throws c10::Error naming the variable and its value. The
  // constructor reads them the same way (ReadSettings); the Python creator
  // calls this before it builds the gloo host backend, so a bad value fails
  // every rank at once instead of one rank closing its gloo connections
  // while a peer still connects ("Connection closed by peer").
  static void CheckSettings();

  const std::string getBackendName() const override { return "tpu_dist"; }
  // The transport tpu tensors take: "host-staged" (default, every plugin)
  // or "xla-native" (TORCH_TPU_DIST_TRANSPORT=xla: all_reduce, broadcast,
  // all_gather_into_tensor, reduce_scatter_tensor and even
  // all_to_all_single of tpu tensors each run one StableHLO collective
  // program, distributed/xla_transport.h; the other collectives stay
  // host-staged). xla_native_usable(): the XLA-native transport's capability
  // check on the runtime's client at construction (XlaTransport::UsableFor:
  // the client spans processes, as libtpu's and the XLA CUDA plugin's with
  // node_id/num_nodes do; false on the CPU plugin). The XLA-native path is
  // opt-in, not chosen automatically where usable, until it has run on a
  // client that spans processes (docs/distributed.md). With
  // TORCH_TPU_DIST_TRANSPORT=xla the constructor raises unless the check
  // passes or the group has one rank (one process: what the tests run).
  std::string transport() const { return xla_ ? "xla-native" : "host-staged"; }
  bool xla_native_usable() const { return xla_native_usable_; }
  // Whether host-staged collectives may skip the staging copies: on a
  // plugin whose buffers are host memory (the XLA CPU plugin:
  // pjrt::Buffer::PinHostMemory), a contiguous tpu tensor gloo reads, or
  // writes when its storage is the buffer's sole holder, is handed to gloo
  // as a CPU tensor over its buffer's own memory (its elements only; the
  // rest of the storage and the capacity's padding untouched), no
  // tpu->host or host->tpu copy. Anything else (non-contiguous, conj/neg,
  // a shared buffer to write, another plugin) is staged. On unless
  // TORCH_TPU_DIST_ZERO_COPY=0 ('0' or '1'; anything else raises).
  bool zero_copy() const;
  const c10::intrusive_ptr<c10d::Backend>& host() const { return host_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void setTimeout(std::chrono::milliseconds timeout) override;

 private:
  // The environment's settings, validated (CheckSettings).
  struct Settings {
    bool zero_copy;      // TORCH_TPU_DIST_ZERO_COPY is not '0'
    bool xla_transport;  // TORCH_TPU_DIST_TRANSPORT=xla
  };
  static Settings ReadSettings();

  c10::intrusive_ptr<c10d::Backend> host_;
  std::chrono::milliseconds timeout_;
  // XLA-native path (null: host-staged only). Runs `spec` (its kind,
  // reduction and root set) on this rank's tpu tensor `in`, returning a new
  // tpu tensor of `out_sizes`; `factor`: PREMUL_SUM's 0-d tpu tensor.
  bool UseXla(const std::vector<at::Tensor>& tensors) const;
  at::Tensor RunXla(CollectiveSpec& spec, const at::Tensor& in, at::IntArrayRef out_sizes,
                    const at::Tensor& factor, const char* op);
  c10::intrusive_ptr<c10d::Work> XlaAllReduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                              const char* name);

  std::shared_ptr<StagingPool> pool_;
  bool xla_native_usable_ = false;
  std::shared_ptr<XlaTransport> xla_;
  std::vector<int64_t> device_ids_;  // rank r's device id (XLA-native)
  int device_index_ = 0;             // this rank's tpu device (XLA-native)
};

}  // namespace torch_tpu::distributed
