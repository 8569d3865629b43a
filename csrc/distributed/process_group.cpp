// ProcessGroupTPU, host-staged transport: see process_group.h.
#include "distributed/process_group.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "aten/tpu.h"
#include "distributed/xla_transport.h"
#include "lowering/lowering.h"
#include "runtime/compiled_op.h"
#include "runtime/disk_cache.h"
#include "runtime/runtime.h"

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

namespace torch_tpu::distributed {
namespace {

using c10d::OpType;
using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

bool OnTpu(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

void CheckDevice(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu() || OnTpu(t), "tpu_dist ", op, ": a tensor is on ", t.device(),
              "; the tpu_dist backend takes tpu and cpu tensors");
}

}  // namespace

// Host staging buffers, reused: a fresh multi-megabyte CPU tensor per
// collective costs its page faults every time (64 MB: ~3x gloo's own
// all_reduce on this 2-core host). A buffer is taken for one collective and
// returned when its Work finished (the copy back to tpu has read it:
// uploads copy during the call, kImmutableOnlyDuringCall). At most
// kMaxIdleBytes of idle buffers are kept.
class StagingPool {
 public:
  static constexpr int64_t kMaxIdleBytes = int64_t{256} << 20;

  explicit StagingPool(bool zero_copy) : zero_copy(zero_copy) {}
  // Whether collectives may hand gloo a tpu tensor's own buffer memory
  // (Staging::Direct; TORCH_TPU_DIST_ZERO_COPY=0 turns it off).
  const bool zero_copy;

  at::Tensor Acquire(at::ScalarType dtype, int64_t numel) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = idle_.find({dtype, numel});
      if (it != idle_.end() && !it->second.empty()) {
        at::Tensor t = std::move(it->second.back());
        it->second.pop_back();
        idle_bytes_ -= t.nbytes();
        return t;
      }
    }
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU));
  }

  void Release(std::vector<at::Tensor> buffers) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& t : buffers) {
      if (idle_bytes_ + static_cast<int64_t>(t.nbytes()) > kMaxIdleBytes) continue;
      idle_bytes_ += t.nbytes();
      idle_[{t.scalar_type(), t.numel()}].push_back(std::move(t));
    }
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<at::ScalarType, int64_t>, std::vector<at::Tensor>> idle_;
  int64_t idle_bytes_ = 0;
};

namespace {

// Zero-copy: a tpu tensor whose elements gloo reads (and writes) in its
// storage buffer's own memory, where the plugin's buffers are host memory
// (pjrt::Buffer::PinHostMemory: the XLA CPU plugin). `host` is a CPU tensor
// over the tensor's bytes in that memory (its storage offset on; the rest of
// the buffer, other views' elements and the capacity's padding, is not
// touched); `buffer` and `memory` keep the buffer alive and pinned until the
// Work finished. `writes`: gloo writes it (the storage's write id is renewed
// when the Work finishes: host copies of its elements are stale).
struct DirectTensor {
  at::Tensor tensor;
  at::Tensor host;
  std::shared_ptr<pjrt::Buffer> buffer;
  std::unique_ptr<pjrt::HostMemory> memory;  // after buffer: released first
  bool writes = false;
};

// What one collective stages: host tensors handed to gloo, the host results
// to write back into tpu (or caller-owned cpu) tensors, host-side steps run
// after gloo finished (AVG's division), and the tensors the future holds.
struct Staging {
  const char* op;
  std::shared_ptr<StagingPool> pool;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (destination, host result)
  std::vector<std::function<void()>> after;                  // run before copy_back
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> pooled;  // returned to the pool when the Work finished
  std::vector<DirectTensor> direct;      // zero-copy tensors, finished after copy_back

  // t's elements in its buffer's host memory, for gloo to use in place;
  // undefined where that is not possible or not safe (the tensor is then
  // staged). Possible for a non-empty contiguous tpu tensor (no conj/neg
  // bit) whose buffer is host memory. Safe: the storage's value is
  // materialized first (a recorded fused region runs: a collective is a sync
  // point); the buffer is ready (a failed producer: staged, which raises
  // naming it); to be written (`writes`), the storage must be its only holder
  // besides this collective's other views of it (no other storage, cached
  // scalar, pending check or debug input shares it: PJRT buffers are shared
  // as immutable values), and every launched program has finished
  // (Runtime::Sync: one launched before may still read it). While the Work
  // runs, this collective's reference keeps the buffer from being donated or
  // overwritten in place; a write to the tensor before wait() gives the
  // storage a new buffer, into which the result is then copied (as staged).
  at::Tensor Direct(const at::Tensor& t, bool writes) {
    if (!pool->zero_copy || !OnTpu(t) || t.numel() == 0 || !t.is_contiguous() || t.is_conj() || t.is_neg()) {
      return {};
    }
    runtime::DeviceStorage& storage = runtime::StorageOf(t);
    storage.Materialize(storage.initialized() ? storage.current().element : lowering::ToElementType(t.scalar_type()));
    if (writes) runtime::Runtime::Get().Sync();
    if (storage.pending() || !storage.current().buffer) return {};
    std::shared_ptr<pjrt::Buffer> buffer = storage.current().buffer;
    if (writes) {
      long mine = 0;
      for (const auto& d : direct) mine += d.buffer == buffer;
      if (buffer.use_count() != 2 + mine) return {};  // the storage's, ours above, this collective's
    }
    std::unique_ptr<pjrt::HostMemory> memory;
    try {
      memory = buffer->PinHostMemory();
    } catch (const std::exception&) {
      return {};  // a failed producer: the staged copy raises, naming it
    }
    if (!memory) return {};
    const size_t offset = static_cast<size_t>(t.storage_offset()) * t.element_size();
    if (offset + t.nbytes() > memory->size()) return {};
    // Written through its memory: the storage's host copy of an upload
    // (StorageBuffer::host) no longer holds its bytes.
    if (writes) storage.DropHostShadow();
    at::Tensor host = at::from_blob(static_cast<char*>(memory->data()) + offset, t.sizes(),
                                    at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU));
    direct.push_back({t, host, std::move(buffer), std::move(memory), writes});
    return host;
  }
  bool IsDirect(const at::Tensor& host) const {
    for (const auto& d : direct) {
      if (d.host.is_same(host)) return true;
    }
    return false;
  }
  // After gloo finished: a written storage that still holds its buffer gets
  // a new write id (the buffer's bytes changed) and no host copy of them;
  // one that took a new buffer
  // (written before wait()) gets the result copied in.
  void FinishDirect() {
    for (auto& d : direct) {
      if (!d.writes) continue;
      runtime::DeviceStorage& storage = runtime::StorageOf(d.tensor);
      if (!storage.pending() && storage.current().buffer == d.buffer) {
        runtime::StorageBuffer written = storage.current();
        written.host = {};  // the host copy of an upload: the bytes it had before the collective
        storage.Set(std::move(written));
      } else {
        d.tensor.copy_(d.host);
      }
    }
  }

  // A contiguous host buffer of t's dtype and sizes from the pool.
  at::Tensor HostBuffer(const at::Tensor& t) {
    at::Tensor flat = pool->Acquire(t.scalar_type(), t.numel());
    pooled.push_back(flat);
    return flat.view(t.sizes());
  }
  // Input only: a host view (Direct) or copy of a tpu tensor (waits for its
  // pending work). direct=false: always a copy (gloo may use it as scratch).
  at::Tensor In(const at::Tensor& t, bool direct = true) {
    CheckDevice(t, op);
    if (!OnTpu(t)) return t;
    if (direct) {
      if (at::Tensor view = Direct(t, false); view.defined()) return view;
    }
    at::Tensor host = HostBuffer(t);
    host.copy_(t);
    return host;
  }
  // Output only: a host buffer, written back into t after the collective.
  at::Tensor Out(const at::Tensor& t, bool write_back = true) {
    CheckDevice(t, op);
    outputs.push_back(t);
    if (!OnTpu(t)) return t;
    if (write_back) {
      if (at::Tensor view = Direct(t, true); view.defined()) return view;
    }
    at::Tensor host = HostBuffer(t);
    if (write_back) copy_back.emplace_back(t, host);
    return host;
  }
  // Read and written in place (allreduce, broadcast, reduce). direct=false:
  // a host copy.
  at::Tensor InOut(const at::Tensor& t, bool write_back = true, bool direct = true) {
    CheckDevice(t, op);
    if (direct && OnTpu(t)) {
      if (at::Tensor view = Direct(t, write_back); view.defined()) {
        outputs.push_back(t);
        return view;
      }
    }
    at::Tensor host = In(t, false);
    outputs.push_back(t);
    if (OnTpu(t) && write_back) copy_back.emplace_back(t, host);
    return host;
  }
};

// AVG and PREMUL_SUM (NCCL's ops; gloo has neither) become SUM here:
// PREMUL_SUM multiplies the host inputs by the factor first, AVG divides the
// host results by the group size afterwards. Both need floating point.
struct ReduceRewrite {
  c10d::ReduceOp op;
  bool average = false;
  std::optional<double> factor;
  at::Tensor tensor_factor;
};

ReduceRewrite Rewrite(const c10d::ReduceOp& op, const char* name, const std::vector<at::Tensor>& tensors) {
  ReduceRewrite r{op};
  if (op.op_ != c10d::ReduceOp::AVG && op.op_ != c10d::ReduceOp::PREMUL_SUM) return r;
  for (const auto& t : tensors) {
    TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), "tpu_dist ", name,
                ": ReduceOp.", op.op_ == c10d::ReduceOp::AVG ? "AVG" : "PREMUL_SUM",
                " needs floating point tensors, got ", t.scalar_type());
  }
  if (op.op_ == c10d::ReduceOp::AVG) {
    r.average = true;
  } else {
    auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(sup != nullptr, "tpu_dist ", name, ": ReduceOp.PREMUL_SUM without a factor");
    if (sup->tensor_factor.defined()) {
      r.tensor_factor = sup->tensor_factor.to(at::kCPU);
    } else {
      r.factor = sup->double_factor;
    }
  }
  r.op = c10d::ReduceOp(c10d::ReduceOp::SUM);
  return r;
}

// PREMUL_SUM: a fresh host tensor (never the caller's cpu tensor in place).
at::Tensor PreMultiply(const ReduceRewrite& r, const at::Tensor& host) {
  if (r.factor) return host.mul(*r.factor);
  if (r.tensor_factor.defined()) return host.mul(r.tensor_factor.to(host.scalar_type()));
  return host;
}

bool Premultiplies(const ReduceRewrite& r) { return r.factor.has_value() || r.tensor_factor.defined(); }

// An in-place reduction's host tensor under PREMUL_SUM: the pre-multiplied
// copy is what gloo reduces, so the result is written back from it (into the
// tpu tensor, or into the caller's cpu tensor).
at::Tensor PremulInPlace(Staging& s, const ReduceRewrite& r, const at::Tensor& dst, at::Tensor host,
                         bool write_back) {
  if (!Premultiplies(r)) return host;
  if (s.IsDirect(host)) {  // the tpu tensor's own memory: multiplied in place (the result replaces it)
    if (r.factor) return host.mul_(*r.factor);
    return host.mul_(r.tensor_factor.to(host.scalar_type()));
  }
  at::Tensor scaled = PreMultiply(r, host);
  for (auto& [d, h] : s.copy_back) {
    if (h.is_same(host)) h = scaled;
  }
  if (!OnTpu(dst) && write_back) s.copy_back.emplace_back(dst, scaled);
  return scaled;
}

void AverageAfter(Staging& s, const ReduceRewrite& r, const at::Tensor& host, int size) {
  if (!r.average) return;
  s.after.push_back([host, size] { host.div_(size); });
}

// Host copies of all-reduced tensors: pre-multiplied for PREMUL_SUM and
// divided by the group size after the sum for AVG (allreduce and
// allreduce_coalesced stage alike).
std::vector<at::Tensor> StageAllReduced(Staging& s, const ReduceRewrite& r, std::vector<at::Tensor>& tensors,
                                        int size) {
  std::vector<at::Tensor> host;
  for (auto& t : tensors) {
    at::Tensor h = PremulInPlace(s, r, t, s.InOut(t), true);
    AverageAfter(s, r, h, size);
    host.push_back(h);
  }
  return host;
}

// The Work of one host-staged collective (see process_group.h for wait,
// isCompleted and getFuture).
class StagedWork : public Work {
 public:
  StagedWork(int rank, OpType type, std::vector<WorkPtr> host_works, Staging staging,
             std::function<int()> source_rank = nullptr)
      : Work(rank, type),
        host_works_(std::move(host_works)),
        staging_(std::move(staging)),
        source_rank_(std::move(source_rank)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(finish_mutex_);
    if (done_) return true;
    for (auto& w : host_works_) {
      if (!w->isCompleted()) return false;
    }
    FinishLocked(::kNoTimeout, /*rethrow=*/false);
    return true;
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(finish_mutex_);
    return done_ && error_ == nullptr;
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(finish_mutex_);
    return error_;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(finish_mutex_);
    FinishLocked(timeout, /*rethrow=*/true);
    return true;
  }

  int sourceRank() const override {
    TORCH_CHECK(source_rank_ != nullptr, "tpu_dist ", staging_.op, ": sourceRank() is only defined for recv from any source");
    return source_rank_();
  }

  std::vector<at::Tensor> result() override { return staging_.outputs; }

  // A Work dropped unfinished: gloo may still be using the zero-copy
  // buffers' memory, which must stay pinned until it is done.
  ~StagedWork() override {
    if (staging_.direct.empty()) return;
    std::lock_guard<std::mutex> lock(finish_mutex_);
    FinishLocked(::kNoTimeout, /*rethrow=*/false);
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(finish_mutex_);
    FinishLocked(::kNoTimeout, /*rethrow=*/false);
    return future_;
  }

  void synchronize() override { wait(::kNoTimeout); }

 private:
  void FinishLocked(std::chrono::milliseconds timeout, bool rethrow) {
    if (!done_) {
      try {
        for (auto& w : host_works_) w->wait(timeout);
        for (auto& step : staging_.after) step();
        for (auto& [dst, host] : staging_.copy_back) dst.copy_(host);
        staging_.FinishDirect();
      } catch (const std::exception& e) {
        error_ = std::make_exception_ptr(c10::DistBackendError(
            {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
            c10::str("tpu_dist ", staging_.op, " failed on rank ", rank_,
                     " (host-staged transport over gloo): ", e.what())));
      }
      done_ = true;
      staging_.pool->Release(std::move(staging_.pooled));
      staging_.pooled.clear();
      staging_.direct.clear();  // unpins the buffers
      if (error_) {
        future_->setError(error_);
      } else {
        future_->markCompleted(c10::IValue(staging_.outputs));
      }
    }
    if (error_ && rethrow) std::rethrow_exception(error_);
  }

  std::vector<WorkPtr> host_works_;
  Staging staging_;
  std::function<int()> source_rank_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  mutable std::mutex finish_mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

WorkPtr Make(int rank, OpType type, std::vector<WorkPtr> works, Staging staging) {
  return c10::make_intrusive<StagedWork>(rank, type, std::move(works), std::move(staging));
}

}  // namespace

bool ProcessGroupTPU::zero_copy() const { return pool_->zero_copy; }

ProcessGroupTPU::Settings ProcessGroupTPU::ReadSettings() {
  const char* zero_copy = std::getenv("TORCH_TPU_DIST_ZERO_COPY");
  const std::string zc = zero_copy ? zero_copy : "";
  TORCH_CHECK(zc.empty() || zc == "0" || zc == "1", "tpu_dist: TORCH_TPU_DIST_ZERO_COPY must be '0' or '1', got '", zc,
              "'");
  const char* env = std::getenv("TORCH_TPU_DIST_TRANSPORT");
  const std::string transport = env ? env : "";
  TORCH_CHECK(transport.empty() || transport == "host" || transport == "xla",
              "tpu_dist: TORCH_TPU_DIST_TRANSPORT must be 'host' or 'xla', got '", transport, "'");
  return Settings{zc != "0", transport == "xla"};
}

void ProcessGroupTPU::CheckSettings() { ReadSettings(); }

ProcessGroupTPU::ProcessGroupTPU(c10::intrusive_ptr<c10d::Backend> host, int rank, int size,
                                 std::chrono::milliseconds timeout)
    : Backend(rank, size), host_(std::move(host)), timeout_(timeout) {
  const Settings settings = ReadSettings();
  pool_ = std::make_shared<StagingPool>(settings.zero_copy);
  TORCH_CHECK(host_, "tpu_dist: the host (gloo) backend is missing");
  TORCH_CHECK(host_->getRank() == rank && host_->getSize() == size, "tpu_dist: the host backend is rank ",
              host_->getRank(), " of ", host_->getSize(), ", this group rank ", rank, " of ", size);
  // Only a client that already exists is asked: a group of cpu tensors
  // alone must not start the device runtime (unless XLA-native is asked for).
  if (settings.xla_transport || runtime::Runtime::Initialized()) {
    xla_native_usable_ = XlaTransport::UsableFor(runtime::Runtime::Get().client(), size);
  }
  if (!settings.xla_transport) return;
  runtime::Runtime& rt = runtime::Runtime::Get();
  pjrt::Client& client = rt.client();
  TORCH_CHECK(xla_native_usable_ || size == 1, "tpu_dist: TORCH_TPU_DIST_TRANSPORT=xla needs a PJRT client that spans ",
              "processes; the ", client.platform_name(), " plugin's client has ", client.global_device_count(),
              " devices, all in this process (a group of ", size, " ranks needs the host-staged transport)");
  device_index_ = aten::CurrentDevice();
  const int64_t own_id = rt.device(device_index_).id;
  if (size == 1) {
    device_ids_ = {own_id};
  } else {  // rank r's device id, from every rank (the program's device assignment)
    at::Tensor mine = at::full({1}, own_id, at::TensorOptions().dtype(at::kLong));
    std::vector<at::Tensor> in{mine};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < size; ++r) out[0].push_back(at::empty({1}, at::TensorOptions().dtype(at::kLong)));
    host_->allgather(out, in)->wait();
    for (auto& t : out[0]) device_ids_.push_back(t.item<int64_t>());
  }
  // Non-owning: the runtime and its client live as long as the process.
  std::shared_ptr<pjrt::Client> shared(&client, [](pjrt::Client*) {});
  xla_ = std::make_shared<XlaTransport>(
      shared, [](pjrt::Client& c, const std::string& module, const pjrt::CompileOptions& o) {
        runtime::Runtime& rt = runtime::Runtime::Get();
        pjrt::CompileOptions options = o;  // the runtime's XLA flags (e.g. NaN-propagating min/max)
        options.env_option_overrides = rt.compile_options().env_option_overrides;
        const auto start = std::chrono::steady_clock::now();
        auto exe = runtime::DiskCache::Get().LoadOrCompile(c, module, options);
        rt.metrics().compiles++;
        rt.metrics().compile_time_ns +=
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
        return exe;
      });
}

// --- XLA-native path ---------------------------------------------------

bool ProcessGroupTPU::UseXla(const std::vector<at::Tensor>& tensors) const {
  if (!xla_) return false;
  for (const auto& t : tensors) {
    if (!OnTpu(t) || t.numel() == 0) return false;
    TORCH_CHECK(t.device().index() == device_index_, "tpu_dist: a tensor on ", t.device(), ", this rank's device is tpu:",
                device_index_, " (XLA-native transport: one device per rank, the one current at init)");
  }
  return true;
}

at::Tensor ProcessGroupTPU::RunXla(CollectiveSpec& spec, const at::Tensor& in, at::IntArrayRef out_sizes,
                                   const at::Tensor& factor, const char* op) {
  // A dense tensor at offset 0 of its storage: the program reads the
  // storage buffer's first numel elements.
  at::Tensor x = in.is_contiguous() && in.storage_offset() == 0 ? in : in.clone(at::MemoryFormat::Contiguous);
  const hlo::ElementType e = lowering::ToElementType(x.scalar_type());
  runtime::StorageBuffer sb = runtime::StorageOf(x).Materialize(e);
  spec.element = e;
  spec.dims = {x.numel()};
  spec.group_size = getSize();
  spec.devices = device_ids_;
  spec.input_capacity = sb.numel;
  int64_t out_numel = 1;
  for (int64_t d : out_sizes) out_numel *= d;
  spec.output_capacity = runtime::Capacity(out_numel);
  std::vector<pjrt::Buffer*> factors;
  runtime::StorageBuffer fb;
  if (factor.defined()) {
    fb = runtime::StorageOf(factor).Materialize(e);
    spec.factor_capacity = fb.numel;
    factors.push_back(fb.buffer.get());
  }
  pjrt::Buffer* inputs[] = {sb.buffer.get()};
  std::vector<std::unique_ptr<pjrt::Buffer>> outs;
  try {
    outs = xla_->Run(spec, inputs, factors);
  } catch (const std::exception& err) {
    throw c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                c10::str("tpu_dist ", op, " failed on rank ", getRank(), " (XLA-native transport, ",
                                         spec.ToString(), "): ", err.what()));
  }
  TORCH_CHECK(outs.size() == 1, "tpu_dist ", op, ": the program ran on ", outs.size(),
              " devices of this process, expected 1");
  std::shared_ptr<pjrt::Buffer> out(std::move(outs[0]));
  runtime::Runtime::Get().metrics().executions++;
  runtime::Runtime::Get().Track(out->ReadyEvent(), std::string("tpu_dist ") + op);
  return runtime::WrapBuffer({out, e, spec.output_capacity, std::string("tpu_dist ") + op}, out_sizes, x.scalar_type(),
                             device_index_);
}

namespace {

bool XlaReduce(const c10d::ReduceOp& op, ReduceKind* kind) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: *kind = ReduceKind::kSum; return true;
    case c10d::ReduceOp::PRODUCT: *kind = ReduceKind::kProduct; return true;
    case c10d::ReduceOp::MIN: *kind = ReduceKind::kMin; return true;
    case c10d::ReduceOp::MAX: *kind = ReduceKind::kMax; return true;
    case c10d::ReduceOp::AVG: *kind = ReduceKind::kAvg; return true;
    case c10d::ReduceOp::PREMUL_SUM: *kind = ReduceKind::kPremulSum; return true;
    default: return false;  // BAND/BOR/BXOR: host-staged
  }
}

// PREMUL_SUM's factor as a 0-d tpu tensor of t's dtype (undefined otherwise).
at::Tensor XlaFactor(const ReduceRewrite& r, const at::Tensor& t) {
  if (r.factor) return at::full({}, *r.factor, t.options());
  if (r.tensor_factor.defined()) return r.tensor_factor.reshape({}).to(t.options()).clone();
  return {};
}

WorkPtr Done(int rank, OpType type, const char* op, const std::shared_ptr<StagingPool>& pool,
             std::vector<at::Tensor> outputs) {
  Staging s{op, pool};
  s.outputs = std::move(outputs);
  return Make(rank, type, {}, std::move(s));
}

}  // namespace

c10::intrusive_ptr<Work> ProcessGroupTPU::XlaAllReduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                                       const char* name) {
  ReduceKind kind;
  XlaReduce(op, &kind);
  ReduceRewrite r = Rewrite(op, name, tensors);  // checks AVG/PREMUL_SUM dtypes
  for (auto& t : tensors) {
    CollectiveSpec spec;
    spec.kind = CollectiveKind::kAllReduce;
    spec.reduce = kind;
    at::Tensor result = RunXla(spec, t, t.sizes(), XlaFactor(r, t), name);
    t.copy_(result);
  }
  return Done(getRank(), OpType::ALLREDUCE, name, pool_, tensors);
}

void ProcessGroupTPU::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  host_->setTimeout(timeout);
}

c10::intrusive_ptr<Work> ProcessGroupTPU::broadcast(std::vector<at::Tensor>& tensors,
                                                    const c10d::BroadcastOptions& opts) {
  if (UseXla(tensors)) {
    for (auto& t : tensors) {
      CollectiveSpec spec;
      spec.kind = CollectiveKind::kBroadcast;
      spec.root = opts.rootRank;
      t.copy_(RunXla(spec, t, t.sizes(), {}, "broadcast"));
    }
    return Done(getRank(), OpType::BROADCAST, "broadcast", pool_, tensors);
  }
  Staging s{"broadcast", pool_};
  const bool receives = getRank() != static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> host;
  for (auto& t : tensors) host.push_back(s.InOut(t, receives));
  auto w = host_->broadcast(host, opts);
  return Make(getRank(), OpType::BROADCAST, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::allreduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceOptions& opts) {
  ReduceKind kind;
  if (UseXla(tensors) && XlaReduce(opts.reduceOp, &kind)) return XlaAllReduce(tensors, opts.reduceOp, "allreduce");
  Staging s{"allreduce", pool_};
  ReduceRewrite r = Rewrite(opts.reduceOp, s.op, tensors);
  std::vector<at::Tensor> host = StageAllReduced(s, r, tensors, getSize());
  c10d::AllreduceOptions o = opts;
  o.reduceOp = r.op;
  auto w = host_->allreduce(host, o);
  return Make(getRank(), OpType::ALLREDUCE, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceCoalescedOptions& opts) {
  Staging s{"allreduce_coalesced", pool_};
  ReduceRewrite r = Rewrite(opts.reduceOp, s.op, tensors);
  std::vector<at::Tensor> host = StageAllReduced(s, r, tensors, getSize());
  c10d::AllreduceCoalescedOptions o = opts;
  o.reduceOp = r.op;
  auto w = host_->allreduce_coalesced(host, o);
  return Make(getRank(), OpType::ALLREDUCE_COALESCED, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::reduce(std::vector<at::Tensor>& tensors,
                                                 const c10d::ReduceOptions& opts) {
  Staging s{"reduce", pool_};
  ReduceRewrite r = Rewrite(opts.reduceOp, s.op, tensors);
  const bool root = getRank() == static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> host;
  for (auto& t : tensors) {
    at::Tensor h = s.InOut(t, root, /*direct=*/root);  // a non-root's input may be gloo's scratch
    if (Premultiplies(r)) {
      h = PremulInPlace(s, r, t, h, root);
    } else if (!root && !OnTpu(t)) {
      h = h.clone();  // gloo may use a non-root buffer as scratch; the caller's stays as it was
    }
    if (root) AverageAfter(s, r, h, getSize());
    host.push_back(h);
  }
  c10d::ReduceOptions o = opts;
  o.reduceOp = r.op;
  auto w = host_->reduce(host, o);
  return Make(getRank(), OpType::REDUCE, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllgatherOptions& opts) {
  Staging s{"allgather", pool_};
  std::vector<at::Tensor> host_in;
  for (auto& t : inputs) host_in.push_back(s.In(t));
  std::vector<std::vector<at::Tensor>> host_out(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (auto& t : outputs[i]) host_out[i].push_back(s.Out(t));
  }
  auto w = host_->allgather(host_out, host_in, opts);
  return Make(getRank(), OpType::ALLGATHER, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                          const c10d::AllgatherOptions& opts) {
  if (UseXla({output, input})) {
    TORCH_CHECK(output.numel() == input.numel() * getSize(), "tpu_dist _allgather_base: output of ", output.numel(),
                " elements for ", getSize(), " inputs of ", input.numel());
    CollectiveSpec spec;
    spec.kind = CollectiveKind::kAllGather;
    output.copy_(RunXla(spec, input, output.sizes(), {}, "_allgather_base"));
    return Done(getRank(), OpType::_ALLGATHER_BASE, "_allgather_base", pool_, {output});
  }
  Staging s{"_allgather_base", pool_};
  at::Tensor host_in = s.In(input);
  at::Tensor host_out = s.Out(output);
  auto w = host_->_allgather_base(host_out, host_in, opts);
  return Make(getRank(), OpType::_ALLGATHER_BASE, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  Staging s{"allgather_coalesced", pool_};
  std::vector<at::Tensor> host_in;
  for (auto& t : inputs) host_in.push_back(s.In(t));
  std::vector<std::vector<at::Tensor>> host_out(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (auto& t : outputs[i]) host_out[i].push_back(s.Out(t));
  }
  auto w = host_->allgather_coalesced(host_out, host_in, opts);
  return Make(getRank(), OpType::ALLGATHER_COALESCED, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                          std::vector<at::Tensor>& inputs,
                                                                          const c10d::AllgatherOptions& opts) {
  Staging s{"allgather_into_tensor_coalesced", pool_};
  std::vector<at::Tensor> host_in, host_out;
  for (auto& t : inputs) host_in.push_back(s.In(t));
  for (auto& t : outputs) host_out.push_back(s.Out(t));
  auto w = host_->allgather_into_tensor_coalesced(host_out, host_in, opts);
  return Make(getRank(), OpType::COALESCED, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                 std::vector<at::Tensor>& inputs,
                                                 const c10d::GatherOptions& opts) {
  Staging s{"gather", pool_};
  std::vector<at::Tensor> host_in;
  for (auto& t : inputs) host_in.push_back(s.In(t));
  std::vector<std::vector<at::Tensor>> host_out(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (auto& t : outputs[i]) host_out[i].push_back(s.Out(t));
  }
  auto w = host_->gather(host_out, host_in, opts);
  return Make(getRank(), OpType::GATHER, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::scatter(std::vector<at::Tensor>& outputs,
                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                  const c10d::ScatterOptions& opts) {
  Staging s{"scatter", pool_};
  std::vector<std::vector<at::Tensor>> host_in(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (auto& t : inputs[i]) host_in[i].push_back(s.In(t));
  }
  std::vector<at::Tensor> host_out;
  for (auto& t : outputs) host_out.push_back(s.Out(t));
  auto w = host_->scatter(host_out, host_in, opts);
  return Make(getRank(), OpType::SCATTER, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ReduceScatterOptions& opts) {
  Staging s{"reduce_scatter", pool_};
  ReduceRewrite r = Rewrite(opts.reduceOp, s.op, outputs);
  std::vector<std::vector<at::Tensor>> host_in(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (auto& t : inputs[i]) host_in[i].push_back(PreMultiply(r, s.In(t)));
  }
  std::vector<at::Tensor> host_out;
  for (auto& t : outputs) {
    host_out.push_back(s.Out(t));
    AverageAfter(s, r, host_out.back(), getSize());
  }
  c10d::ReduceScatterOptions o = opts;
  o.reduceOp = r.op;
  auto w = host_->reduce_scatter(host_out, host_in, o);
  return Make(getRank(), OpType::REDUCE_SCATTER, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::ReduceScatterOptions& opts) {
  ReduceKind kind;
  if (UseXla({output, input}) && XlaReduce(opts.reduceOp, &kind)) {
    TORCH_CHECK(input.numel() == output.numel() * getSize(), "tpu_dist _reduce_scatter_base: input of ", input.numel(),
                " elements for ", getSize(), " outputs of ", output.numel());
    ReduceRewrite r = Rewrite(opts.reduceOp, "_reduce_scatter_base", {output});
    CollectiveSpec spec;
    spec.kind = CollectiveKind::kReduceScatter;
    spec.reduce = kind;
    output.copy_(RunXla(spec, input, output.sizes(), XlaFactor(r, input), "_reduce_scatter_base"));
    return Done(getRank(), OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base", pool_, {output});
  }
  Staging s{"_reduce_scatter_base", pool_};
  ReduceRewrite r = Rewrite(opts.reduceOp, s.op, {output});
  at::Tensor host_in = PreMultiply(r, s.In(input));
  at::Tensor host_out = s.Out(output);
  AverageAfter(s, r, host_out, getSize());
  c10d::ReduceScatterOptions o = opts;
  o.reduceOp = r.op;
  auto w = host_->_reduce_scatter_base(host_out, host_in, o);
  return Make(getRank(), OpType::_REDUCE_SCATTER_BASE, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                          std::vector<at::Tensor>& inputs,
                                                                          const c10d::ReduceScatterOptions& opts) {
  Staging s{"reduce_scatter_tensor_coalesced", pool_};
  ReduceRewrite r = Rewrite(opts.reduceOp, s.op, outputs);
  std::vector<at::Tensor> host_in, host_out;
  for (auto& t : inputs) host_in.push_back(PreMultiply(r, s.In(t)));
  for (auto& t : outputs) {
    host_out.push_back(s.Out(t));
    AverageAfter(s, r, host_out.back(), getSize());
  }
  c10d::ReduceScatterOptions o = opts;
  o.reduceOp = r.op;
  auto w = host_->reduce_scatter_tensor_coalesced(host_out, host_in, o);
  return Make(getRank(), OpType::COALESCED, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                        std::vector<int64_t>& output_split_sizes,
                                                        std::vector<int64_t>& input_split_sizes,
                                                        const c10d::AllToAllOptions& opts) {
  if (UseXla({output, input}) && output_split_sizes.empty() && input_split_sizes.empty() &&
      input.numel() % getSize() == 0) {
    TORCH_CHECK(output.numel() == input.numel(), "tpu_dist alltoall_base: output of ", output.numel(),
                " elements, input of ", input.numel());
    CollectiveSpec spec;
    spec.kind = CollectiveKind::kAllToAll;
    output.copy_(RunXla(spec, input, output.sizes(), {}, "alltoall_base"));
    return Done(getRank(), OpType::ALLTOALL_BASE, "alltoall_base", pool_, {output});
  }
  Staging s{"alltoall_base", pool_};
  at::Tensor host_in = s.In(input);
  at::Tensor host_out = s.Out(output);
  auto w = host_->alltoall_base(host_out, host_in, output_split_sizes, input_split_sizes, opts);
  return Make(getRank(), OpType::ALLTOALL_BASE, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::alltoall(std::vector<at::Tensor>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::AllToAllOptions& opts) {
  // NCCL's list form takes tensors of different sizes; gloo's alltoall needs
  // equal ones. Staged as one alltoall_base of the flattened, concatenated
  // tensors with per-peer splits (element counts), then sliced back.
  Staging s{"alltoall", pool_};
  TORCH_CHECK(static_cast<int>(inputs.size()) == getSize() && static_cast<int>(outputs.size()) == getSize(),
              "tpu_dist alltoall: expected ", getSize(), " input and output tensors, got ", inputs.size(), " and ",
              outputs.size());
  const auto dtype = inputs[0].scalar_type();
  std::vector<at::Tensor> flat_in;
  std::vector<int64_t> in_splits, out_splits;
  for (auto& t : inputs) {
    TORCH_CHECK(t.scalar_type() == dtype, "tpu_dist alltoall: tensors of dtypes ", dtype, " and ", t.scalar_type());
    flat_in.push_back(s.In(t).reshape({-1}));
    in_splits.push_back(t.numel());
  }
  int64_t total = 0;
  for (auto& t : outputs) {
    CheckDevice(t, s.op);
    TORCH_CHECK(t.scalar_type() == dtype, "tpu_dist alltoall: tensors of dtypes ", dtype, " and ", t.scalar_type());
    out_splits.push_back(t.numel());
    total += t.numel();
  }
  at::Tensor host_in = at::cat(flat_in);
  at::Tensor host_out = at::empty({total}, inputs[0].options().device(at::kCPU));
  int64_t offset = 0;
  for (auto& t : outputs) {
    s.copy_back.emplace_back(t, host_out.narrow(0, offset, t.numel()).view(t.sizes()));
    s.outputs.push_back(t);
    offset += t.numel();
  }
  auto w = host_->alltoall_base(host_out, host_in, out_splits, in_splits, opts);
  return Make(getRank(), OpType::ALLTOALL, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  Staging s{"send", pool_};
  std::vector<at::Tensor> host;
  for (auto& t : tensors) host.push_back(s.In(t));
  auto w = host_->send(host, dst_rank, tag);
  return Make(getRank(), OpType::SEND, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  Staging s{"recv", pool_};
  std::vector<at::Tensor> host;
  for (auto& t : tensors) host.push_back(s.Out(t));
  auto w = host_->recv(host, src_rank, tag);
  return Make(getRank(), OpType::RECV, {w}, std::move(s));
}

c10::intrusive_ptr<Work> ProcessGroupTPU::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  Staging s{"recv (any source)", pool_};
  std::vector<at::Tensor> host;
  for (auto& t : tensors) host.push_back(s.Out(t));
  auto w = host_->recvAnysource(host, tag);
  return c10::make_intrusive<StagedWork>(getRank(), OpType::RECVANYSOURCE, std::vector<WorkPtr>{w}, std::move(s),
                                         [w] { return w->sourceRank(); });
}

c10::intrusive_ptr<Work> ProcessGroupTPU::barrier(const c10d::BarrierOptions& opts) {
  Staging s{"barrier", pool_};
  auto w = host_->barrier(opts);
  return Make(getRank(), OpType::BARRIER, {w}, std::move(s));
}

}  // namespace torch_tpu::distributed
