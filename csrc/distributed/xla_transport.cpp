// XLA-native transport: see xla_transport.h.
#include "distributed/xla_transport.h"

#include <stdexcept>

namespace torch_tpu::distributed {
namespace {

using hlo::Builder;
using hlo::BuildError;
using hlo::ElementType;
using hlo::TensorType;
using hlo::Value;

const char* KindName(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kPermute: return "collective_permute";
    case CollectiveKind::kBroadcast: return "broadcast";
  }
  return "?";
}

const char* ReduceName(ReduceKind r) {
  switch (r) {
    case ReduceKind::kSum: return "sum";
    case ReduceKind::kProduct: return "product";
    case ReduceKind::kMin: return "min";
    case ReduceKind::kMax: return "max";
    case ReduceKind::kAvg: return "avg";
    case ReduceKind::kPremulSum: return "premul_sum";
  }
  return "?";
}

bool Reduces(CollectiveKind k) { return k == CollectiveKind::kAllReduce || k == CollectiveKind::kReduceScatter; }

// The scalar combiner of a reduction. Bool has no add/multiply in
// StableHLO: SUM/MAX are or, PRODUCT/MIN and (NCCL's mapping for bool).
hlo::RegionFn Combiner(ReduceKind r, ElementType element) {
  const bool pred = element == ElementType::kPred;
  return [r, pred](Builder& b, std::span<const Value> a) -> std::vector<Value> {
    switch (r) {
      case ReduceKind::kSum:
      case ReduceKind::kAvg:
      case ReduceKind::kPremulSum:
        return {pred ? b.Or(a[0], a[1]) : b.Add(a[0], a[1])};
      case ReduceKind::kProduct: return {pred ? b.And(a[0], a[1]) : b.Mul(a[0], a[1])};
      case ReduceKind::kMin: return {pred ? b.And(a[0], a[1]) : b.Min(a[0], a[1])};
      case ReduceKind::kMax: return {pred ? b.Or(a[0], a[1]) : b.Max(a[0], a[1])};
    }
    throw BuildError("unknown reduction");
  };
}

// ceil(log2 n) permute rounds from `root`: in round k (step 2^k) every
// replica at distance d < step from the root (in ring order) sends to the
// one at distance d + step; a target takes the received value, the others
// keep theirs (a non-target's permute result is zeros).
Value Broadcast(Builder& b, const Value& x, int n, int64_t root) {
  const TensorType u32{ElementType::kU32, {}};
  Value rid = b.ReplicaId();
  // distance from the root: (rid + n - root) % n
  Value dist = b.Rem(b.Add(rid, b.ConstantInt(u32, n - root)), b.ConstantInt(u32, n));
  Value current = x;
  for (int64_t step = 1; step < n; step *= 2) {
    std::vector<std::pair<int64_t, int64_t>> pairs;
    for (int64_t d = 0; d < step && d + step < n; ++d) pairs.emplace_back((d + root) % n, (d + step + root) % n);
    Value received = b.CollectivePermute(current, pairs);
    Value lo = b.Compare(dist, b.ConstantInt(u32, step), hlo::CompareDirection::kGE);
    Value hi = b.Compare(dist, b.ConstantInt(u32, 2 * step), hlo::CompareDirection::kLT);
    Value target = b.And(lo, hi);
    Value mask = b.BroadcastInDim(target, x.dims(), {});
    current = b.Select(mask, received, current);
  }
  return current;
}

}  // namespace

std::string CollectiveSpec::ToString() const {
  std::string s = KindName(kind);
  if (Reduces(kind)) s += std::string("(") + ReduceName(reduce) + ")";
  s += " " + TensorType{element, dims}.ToString() + " over " + std::to_string(group_size) + " replicas";
  return s;
}

CollectiveProgram BuildCollectiveProgram(const CollectiveSpec& spec) {
  const std::string what = spec.ToString();
  const int n = spec.group_size;
  if (n < 1) throw BuildError(what + ": group size must be at least 1");
  if (Reduces(spec.kind) && (spec.reduce == ReduceKind::kAvg || spec.reduce == ReduceKind::kPremulSum) &&
      !hlo::IsFloating(spec.element))
    throw BuildError(what + ": AVG and PREMUL_SUM need a floating point element type");
  const bool needs_dim0 = spec.kind == CollectiveKind::kAllGather || spec.kind == CollectiveKind::kReduceScatter ||
                          spec.kind == CollectiveKind::kAllToAll;
  if (needs_dim0 && spec.dims.empty()) throw BuildError(what + ": needs a tensor of rank >= 1");
  if ((spec.kind == CollectiveKind::kReduceScatter || spec.kind == CollectiveKind::kAllToAll) &&
      spec.dims[0] % n != 0)
    throw BuildError(what + ": dimension 0 (" + std::to_string(spec.dims[0]) +
                     ") is not divisible by the group size");
  if (spec.kind == CollectiveKind::kBroadcast && (spec.root < 0 || spec.root >= n))
    throw BuildError(what + ": root " + std::to_string(spec.root) + " is not a replica of the group");
  if (spec.kind == CollectiveKind::kPermute) {
    for (const auto& [src, dst] : spec.pairs)
      if (src < 0 || src >= n || dst < 0 || dst >= n)
        throw BuildError(what + ": pair (" + std::to_string(src) + ", " + std::to_string(dst) +
                         ") names a replica outside the group");
  }

  if (!spec.devices.empty() && static_cast<int>(spec.devices.size()) != n)
    throw BuildError(what + ": " + std::to_string(spec.devices.size()) + " devices for " + std::to_string(n) +
                     " replicas");
  std::vector<int64_t> all(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) all[static_cast<size_t>(i)] = i;
  const Builder::ReplicaGroups groups{all};

  const int64_t numel = TensorType{spec.element, spec.dims}.numel();
  if (spec.input_capacity < 0 || spec.output_capacity < 0 || spec.factor_capacity < 0 ||
      (spec.input_capacity > 0 && spec.input_capacity < numel))
    throw BuildError(what + ": input capacity " + std::to_string(spec.input_capacity) + " below its " +
                     std::to_string(numel) + " elements");

  Builder b;
  // A rank-1 buffer of `capacity` elements -> its first numel(dims) as dims.
  auto from_storage = [&](const Value& v, int64_t capacity, const std::vector<int64_t>& dims) {
    if (capacity == 0) return v;
    const int64_t n = TensorType{spec.element, dims}.numel();
    const int64_t zero = 0, one = 1;
    Value flat = b.Slice(v, std::span(&zero, 1), std::span(&n, 1), std::span(&one, 1));
    return b.Reshape(flat, dims);
  };
  Value x = b.Parameter(TensorType{spec.element, spec.input_capacity ? std::vector<int64_t>{spec.input_capacity}
                                                                     : spec.dims});
  x = from_storage(x, spec.input_capacity, spec.dims);
  CollectiveProgram program;
  if (Reduces(spec.kind) && spec.reduce == ReduceKind::kPremulSum) {
    Value factor = b.Parameter(TensorType{spec.element, spec.factor_capacity
                                                            ? std::vector<int64_t>{spec.factor_capacity}
                                                            : std::vector<int64_t>{}});
    factor = from_storage(factor, spec.factor_capacity, {});
    x = b.Mul(x, b.BroadcastInDim(factor, spec.dims, {}));
    program.num_inputs = 2;
  }
  Value out;
  switch (spec.kind) {
    case CollectiveKind::kAllReduce:
      out = b.AllReduce(x, groups, Combiner(spec.reduce, spec.element));
      break;
    case CollectiveKind::kReduceScatter:
      out = b.ReduceScatter(x, 0, groups, Combiner(spec.reduce, spec.element));
      break;
    case CollectiveKind::kAllGather:
      out = b.AllGather(x, 0, groups);
      break;
    case CollectiveKind::kAllToAll:
      out = b.AllToAll(x, 0, 0, groups);
      break;
    case CollectiveKind::kPermute:
      out = b.CollectivePermute(x, spec.pairs);
      break;
    case CollectiveKind::kBroadcast:
      out = Broadcast(b, x, n, spec.root);
      break;
  }
  if (Reduces(spec.kind) && spec.reduce == ReduceKind::kAvg)
    out = b.Div(out, b.Constant(out.type, static_cast<double>(n)));
  if (spec.output_capacity > 0) {
    const int64_t n = out.type.numel();
    if (spec.output_capacity < n)
      throw BuildError(what + ": output capacity " + std::to_string(spec.output_capacity) + " below its " +
                       std::to_string(n) + " elements");
    Value flat = b.Reshape(out, std::vector<int64_t>{n});
    const int64_t lo = 0, hi = spec.output_capacity - n, interior = 0;
    Value zero = b.Constant(TensorType{spec.element, {}}, 0.0);
    out = b.Pad(flat, zero, std::span(&lo, 1), std::span(&hi, 1), std::span(&interior, 1));
  }
  b.Return(std::span(&out, 1));
  program.module = b.Module();
  program.options.num_replicas = n;
  program.options.num_partitions = 1;
  program.options.device_assignment = spec.devices;
  program.output = out.type;
  return program;
}

XlaTransport::XlaTransport(std::shared_ptr<pjrt::Client> client, Compiler compile)
    : client_(std::move(client)), compile_(std::move(compile)) {
  if (!client_) throw std::invalid_argument("XlaTransport: no client");
  if (!compile_) {
    compile_ = [](pjrt::Client& c, const std::string& module, const pjrt::CompileOptions& options) {
      return c.Compile(module, options);
    };
  }
}

bool XlaTransport::UsableFor(const pjrt::Client& client, int group_size) {
  const int global = client.global_device_count();
  const int local = static_cast<int>(client.addressable_devices().size());
  return global > local && global >= group_size;
}

const XlaTransport::Entry& XlaTransport::Lookup(const CollectiveSpec& spec) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : entries_)
    if (e->spec == spec) return *e;
  CollectiveProgram program = BuildCollectiveProgram(spec);
  auto entry = std::make_unique<Entry>();
  entry->spec = spec;
  entry->num_inputs = program.num_inputs;
  entry->executable = compile_(*client_, program.module, program.options);
  ++compiles_;
  entries_.push_back(std::move(entry));
  return *entries_.back();
}

size_t XlaTransport::cached() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

std::vector<PJRT_Device*> XlaTransport::Devices(const CollectiveSpec& spec) {
  return Lookup(spec).executable->addressable_devices();
}

std::vector<std::unique_ptr<pjrt::Buffer>> XlaTransport::Run(const CollectiveSpec& spec,
                                                             std::span<pjrt::Buffer* const> inputs,
                                                             std::span<pjrt::Buffer* const> factors) {
  const Entry& entry = Lookup(spec);
  const size_t devices = entry.executable->addressable_devices().size();
  if (inputs.size() != devices)
    throw std::invalid_argument(spec.ToString() + ": " + std::to_string(inputs.size()) + " inputs for " +
                                std::to_string(devices) + " devices of this process");
  if (entry.num_inputs == 2 && factors.size() != devices)
    throw std::invalid_argument(spec.ToString() + ": PREMUL_SUM needs one factor per device, got " +
                                std::to_string(factors.size()));
  std::vector<std::vector<pjrt::Buffer*>> lists(devices);
  for (size_t d = 0; d < devices; ++d) {
    lists[d].push_back(inputs[d]);
    if (entry.num_inputs == 2) lists[d].push_back(factors[d]);
  }
  auto outputs = entry.executable->ExecuteReplicated(lists);
  std::vector<std::unique_ptr<pjrt::Buffer>> result;
  for (auto& per_device : outputs) result.push_back(std::move(per_device.at(0)));
  return result;
}

}  // namespace torch_tpu::distributed
