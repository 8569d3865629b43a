// Tier 2: the XLA-native collective programs (csrc/distributed/xla_transport)
// on the XLA CPU plugin, in ONE process over a client of 4 devices
// (cpu_device_count): every collective, every dtype torch.distributed tests
// (float32, bfloat16, float16, int64, bool), values compared with a host
// reference computed here in double (the inputs are small multiples of 1/2,
// so every reference value is exact in every dtype: the comparisons are
// exact equality, also for floats).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "distributed/xla_transport.h"
#include "pjrt/pjrt.h"

namespace torch_tpu::distributed {
namespace {

using hlo::ElementType;
using pjrt::Buffer;
using pjrt::Client;
using pjrt::Plugin;

PJRT_Buffer_Type PjrtType(ElementType t) {
  switch (t) {
    case ElementType::kF32: return PJRT_Buffer_Type_F32;
    case ElementType::kBF16: return PJRT_Buffer_Type_BF16;
    case ElementType::kF16: return PJRT_Buffer_Type_F16;
    case ElementType::kS64: return PJRT_Buffer_Type_S64;
    case ElementType::kPred: return PJRT_Buffer_Type_PRED;
    default: throw std::invalid_argument("test: unsupported type");
  }
}

size_t Size(ElementType t) { return pjrt::ElementSizeInBytes(PjrtType(t)); }

// Host encodings. The values used are exact in every type, so the
// conversions need no rounding (checked).
std::vector<uint8_t> Encode(ElementType t, const std::vector<double>& v) {
  std::vector<uint8_t> out(v.size() * Size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    uint8_t* p = out.data() + i * Size(t);
    switch (t) {
      case ElementType::kF32: {
        float f = static_cast<float>(v[i]);
        std::memcpy(p, &f, 4);
        break;
      }
      case ElementType::kBF16: {
        uint32_t bits = std::bit_cast<uint32_t>(static_cast<float>(v[i]));
        if ((bits & 0xffff) != 0) throw std::invalid_argument("test: value not exact in bf16");
        uint16_t h = static_cast<uint16_t>(bits >> 16);
        std::memcpy(p, &h, 2);
        break;
      }
      case ElementType::kF16: {
        _Float16 h = static_cast<_Float16>(v[i]);
        if (static_cast<double>(h) != v[i]) throw std::invalid_argument("test: value not exact in f16");
        std::memcpy(p, &h, 2);
        break;
      }
      case ElementType::kS64: {
        int64_t x = static_cast<int64_t>(v[i]);
        std::memcpy(p, &x, 8);
        break;
      }
      case ElementType::kPred: *p = v[i] != 0 ? 1 : 0; break;
      default: throw std::invalid_argument("test: unsupported type");
    }
  }
  return out;
}

std::vector<double> Decode(ElementType t, const std::vector<uint8_t>& bytes) {
  const size_t n = bytes.size() / Size(t);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = bytes.data() + i * Size(t);
    switch (t) {
      case ElementType::kF32: {
        float f;
        std::memcpy(&f, p, 4);
        out[i] = f;
        break;
      }
      case ElementType::kBF16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        out[i] = std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
        break;
      }
      case ElementType::kF16: {
        _Float16 h;
        std::memcpy(&h, p, 2);
        out[i] = static_cast<double>(h);
        break;
      }
      case ElementType::kS64: {
        int64_t x;
        std::memcpy(&x, p, 8);
        out[i] = static_cast<double>(x);
        break;
      }
      case ElementType::kPred: out[i] = *p ? 1 : 0; break;
      default: throw std::invalid_argument("test: unsupported type");
    }
  }
  return out;
}

int64_t Numel(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// Replica r's input: small multiples of 1/2 (integers for int64, 0/1 for
// bool), different per replica and element, with negatives and zeros.
std::vector<double> Input(ElementType t, int r, int64_t n, bool for_product = false) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = (i * 7 + r * 5 + 3) % 9 - 4;  // -4..4
    double x;
    if (t == ElementType::kPred) {
      x = ((i + r) % 3 == 0) ? 1 : 0;
    } else if (t == ElementType::kS64) {
      x = for_product ? static_cast<double>(k) : static_cast<double>(k * 1000 + r);
    } else {
      x = for_product ? (k == 0 ? 1.0 : k * 0.5) : k * 0.5 + r;  // products of 4 stay exact in bf16
    }
    v[static_cast<size_t>(i)] = x;
  }
  return v;
}

double Combine(ReduceKind r, ElementType t, double a, double b) {
  if (t == ElementType::kPred) {
    const bool x = a != 0, y = b != 0;
    return (r == ReduceKind::kProduct || r == ReduceKind::kMin) ? (x && y) : (x || y);
  }
  switch (r) {
    case ReduceKind::kSum:
    case ReduceKind::kAvg:
    case ReduceKind::kPremulSum: return a + b;
    case ReduceKind::kProduct: return a * b;
    case ReduceKind::kMin: return std::min(a, b);
    case ReduceKind::kMax: return std::max(a, b);
  }
  return 0;
}

class XlaTransportTest : public ::testing::Test {
 protected:
  static constexpr int kDevices = 4;
  static void SetUpTestSuite() {
    plugin_ = Plugin::Load(XLA_CPU_PLUGIN_PATH);
    client_ = Client::Create(plugin_, {{"cpu_device_count", kDevices}});
    transport_ = std::make_unique<XlaTransport>(client_);
  }
  static void TearDownTestSuite() {
    transport_.reset();
    client_.reset();
    plugin_.reset();
  }

  static const pjrt::Device& DeviceOf(PJRT_Device* handle) {
    for (const auto& d : client_->addressable_devices())
      if (d.handle == handle) return d;
    throw std::runtime_error("test: device of the program not in the client");
  }

  // Runs `spec` with inputs[r] on replica r; returns each replica's output.
  std::vector<std::vector<double>> Run(const CollectiveSpec& spec, const std::vector<std::vector<double>>& inputs,
                                       const std::vector<double>& factors = {}) {
    std::vector<PJRT_Device*> devices = transport_->Devices(spec);
    EXPECT_EQ(devices.size(), static_cast<size_t>(spec.group_size));
    std::vector<std::unique_ptr<Buffer>> owned;
    std::vector<Buffer*> in, fac;
    for (size_t r = 0; r < devices.size(); ++r) {
      auto bytes = Encode(spec.element, inputs[r]);
      owned.push_back(client_->BufferFromHost(bytes.data(), PjrtType(spec.element), spec.dims, DeviceOf(devices[r])));
      in.push_back(owned.back().get());
      if (!factors.empty()) {
        auto f = Encode(spec.element, {factors[r]});
        owned.push_back(client_->BufferFromHost(f.data(), PjrtType(spec.element), {}, DeviceOf(devices[r])));
        fac.push_back(owned.back().get());
      }
    }
    auto out = transport_->Run(spec, in, fac);
    std::vector<std::vector<double>> result;
    for (auto& b : out) {
      std::vector<uint8_t> bytes(b->on_device_size_in_bytes());
      b->ToHost(bytes.data(), bytes.size());
      result.push_back(Decode(spec.element, bytes));
    }
    return result;
  }

  static std::shared_ptr<Plugin> plugin_;
  static std::shared_ptr<Client> client_;
  static std::unique_ptr<XlaTransport> transport_;
};

std::shared_ptr<Plugin> XlaTransportTest::plugin_;
std::shared_ptr<Client> XlaTransportTest::client_;
std::unique_ptr<XlaTransport> XlaTransportTest::transport_;

const ElementType kTypes[] = {ElementType::kF32, ElementType::kBF16, ElementType::kF16, ElementType::kS64,
                              ElementType::kPred};

std::vector<ReduceKind> Reductions(ElementType t) {
  std::vector<ReduceKind> r{ReduceKind::kSum, ReduceKind::kProduct, ReduceKind::kMin, ReduceKind::kMax};
  if (hlo::IsFloating(t)) {
    r.push_back(ReduceKind::kAvg);
    r.push_back(ReduceKind::kPremulSum);
  }
  return r;
}

std::vector<std::vector<double>> Inputs(ElementType t, int n, int64_t numel, ReduceKind r = ReduceKind::kSum) {
  std::vector<std::vector<double>> in;
  for (int i = 0; i < n; ++i) in.push_back(Input(t, i, numel, r == ReduceKind::kProduct));
  return in;
}

std::vector<double> Premul(int n) {
  std::vector<double> f;
  for (int i = 0; i < n; ++i) f.push_back(i % 2 ? 2.0 : 0.5);
  return f;
}

// Reference: element-wise reduction over replicas of (pre-multiplied) inputs.
std::vector<double> Reduced(ReduceKind r, ElementType t, const std::vector<std::vector<double>>& in,
                            const std::vector<double>& factors) {
  std::vector<double> acc(in[0].size());
  for (size_t i = 0; i < acc.size(); ++i) {
    double a = 0;
    for (size_t k = 0; k < in.size(); ++k) {
      const double x = in[k][i] * (factors.empty() ? 1.0 : factors[k]);
      a = k == 0 ? x : Combine(r, t, a, x);
    }
    if (r == ReduceKind::kAvg) a /= static_cast<double>(in.size());
    acc[i] = a;
  }
  return acc;
}

TEST_F(XlaTransportTest, AllReduceEveryDtypeAndOp) {
  for (int n : {2, 4}) {
    for (ElementType t : kTypes) {
      for (ReduceKind r : Reductions(t)) {
        CollectiveSpec spec{CollectiveKind::kAllReduce, r, t, {2, 3}, n};
        SCOPED_TRACE(spec.ToString());
        auto in = Inputs(t, n, 6, r);
        auto factors = r == ReduceKind::kPremulSum ? Premul(n) : std::vector<double>{};
        auto out = Run(spec, in, factors);
        auto want = Reduced(r, t, in, factors);
        for (int k = 0; k < n; ++k) EXPECT_EQ(out[k], want) << "replica " << k;
      }
    }
  }
}

TEST_F(XlaTransportTest, AllGatherEveryDtype) {
  for (int n : {2, 4}) {
    for (ElementType t : kTypes) {
      CollectiveSpec spec{CollectiveKind::kAllGather, ReduceKind::kSum, t, {3, 2}, n};
      SCOPED_TRACE(spec.ToString());
      auto in = Inputs(t, n, 6);
      auto out = Run(spec, in);
      std::vector<double> want;
      for (const auto& v : in) want.insert(want.end(), v.begin(), v.end());  // concatenated along dim 0
      for (int k = 0; k < n; ++k) EXPECT_EQ(out[k], want) << "replica " << k;
    }
  }
}

TEST_F(XlaTransportTest, ReduceScatterEveryDtypeAndOp) {
  for (int n : {2, 4}) {
    for (ElementType t : kTypes) {
      for (ReduceKind r : Reductions(t)) {
        const int64_t rows = 2 * n;  // replica k keeps rows [2k, 2k + 2) of the reduction
        CollectiveSpec spec{CollectiveKind::kReduceScatter, r, t, {rows, 3}, n};
        SCOPED_TRACE(spec.ToString());
        auto in = Inputs(t, n, rows * 3, r);
        auto factors = r == ReduceKind::kPremulSum ? Premul(n) : std::vector<double>{};
        auto out = Run(spec, in, factors);
        auto full = Reduced(r, t, in, factors);
        for (int k = 0; k < n; ++k) {
          std::vector<double> want(full.begin() + k * 6, full.begin() + (k + 1) * 6);
          EXPECT_EQ(out[k], want) << "replica " << k;
        }
      }
    }
  }
}

TEST_F(XlaTransportTest, AllToAllEveryDtype) {
  for (int n : {2, 4}) {
    for (ElementType t : kTypes) {
      CollectiveSpec spec{CollectiveKind::kAllToAll, ReduceKind::kSum, t, {n * 2, 2}, n};  // blocks of 2 rows
      SCOPED_TRACE(spec.ToString());
      auto in = Inputs(t, n, n * 4);
      auto out = Run(spec, in);
      for (int dst = 0; dst < n; ++dst) {
        std::vector<double> want;  // block dst of every source, in source order
        for (int src = 0; src < n; ++src) want.insert(want.end(), in[src].begin() + dst * 4, in[src].begin() + dst * 4 + 4);
        EXPECT_EQ(out[dst], want) << "replica " << dst;
      }
    }
  }
}

TEST_F(XlaTransportTest, CollectivePermuteSendRecvAndRing) {
  for (ElementType t : kTypes) {
    // send/recv: replica 0 -> replica 1 of a 2-replica program; replica 0
    // (no target) gets zeros.
    CollectiveSpec send{CollectiveKind::kPermute, ReduceKind::kSum, t, {5}, 2, {{0, 1}}};
    SCOPED_TRACE(send.ToString());
    auto in = Inputs(t, 2, 5);
    auto out = Run(send, in);
    EXPECT_EQ(out[1], in[0]);
    EXPECT_EQ(out[0], std::vector<double>(5, 0.0));
    // a ring over 4: r -> r + 1
    CollectiveSpec ring{CollectiveKind::kPermute, ReduceKind::kSum, t, {5}, 4, {{0, 1}, {1, 2}, {2, 3}, {3, 0}}};
    auto in4 = Inputs(t, 4, 5);
    auto out4 = Run(ring, in4);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(out4[(r + 1) % 4], in4[r]) << "from " << r;
  }
}

TEST_F(XlaTransportTest, BroadcastEveryRootAndDtype) {
  for (int n : {2, 3, 4}) {
    for (ElementType t : kTypes) {
      if (n == 3 && t != ElementType::kF32) continue;  // a group size that is no power of two: one dtype
      for (int root = 0; root < n; ++root) {
        CollectiveSpec spec{CollectiveKind::kBroadcast, ReduceKind::kSum, t, {4}, n, {}, root};
        SCOPED_TRACE(spec.ToString() + " root " + std::to_string(root));
        auto in = Inputs(t, n, 4);
        auto out = Run(spec, in);
        for (int k = 0; k < n; ++k) EXPECT_EQ(out[k], in[root]) << "replica " << k;
      }
    }
  }
}

TEST_F(XlaTransportTest, BroadcastKeepsNegativeZeroAndNan) {
  CollectiveSpec spec{CollectiveKind::kBroadcast, ReduceKind::kSum, ElementType::kF32, {3}, 2, {}, 1};
  std::vector<PJRT_Device*> devices = transport_->Devices(spec);
  const float root_values[3] = {-0.0f, std::nanf(""), -3.5f};
  const float other[3] = {1, 2, 3};
  auto b0 = client_->BufferFromHost(other, PJRT_Buffer_Type_F32, spec.dims, DeviceOf(devices[0]));
  auto b1 = client_->BufferFromHost(root_values, PJRT_Buffer_Type_F32, spec.dims, DeviceOf(devices[1]));
  Buffer* in[] = {b0.get(), b1.get()};
  auto out = transport_->Run(spec, in);
  float got[3];
  out[0]->ToHost(got, sizeof got);
  EXPECT_EQ(std::memcmp(got, root_values, sizeof got), 0);  // bit-exact
}

// A group on devices other than the first ones, in any order (what a
// subgroup or a rank -> device map needs): the compile options' device
// assignment places replica r on spec.devices[r].
TEST_F(XlaTransportTest, DeviceAssignmentPlacesReplicas) {
  const auto& all = client_->addressable_devices();
  CollectiveSpec spec{CollectiveKind::kPermute, ReduceKind::kSum, ElementType::kS64, {3}, 2, {{0, 1}}};
  spec.devices = {all[3].id, all[2].id};  // replica 0 on device 3, replica 1 on device 2
  std::vector<PJRT_Device*> devices = transport_->Devices(spec);
  ASSERT_EQ(devices.size(), 2u);
  // the executable runs on exactly devices 2 and 3
  EXPECT_TRUE((devices[0] == all[3].handle && devices[1] == all[2].handle) ||
              (devices[0] == all[2].handle && devices[1] == all[3].handle));
  // Devices() order is Run's order; replica 0 (device 3) sends to replica 1 (device 2)
  const int64_t on3[3] = {7, -8, 9}, on2[3] = {1, 2, 3};
  std::vector<std::unique_ptr<Buffer>> owned;
  std::vector<Buffer*> in;
  for (PJRT_Device* d : devices) {
    owned.push_back(client_->BufferFromHost(d == all[3].handle ? on3 : on2, PJRT_Buffer_Type_S64, spec.dims, DeviceOf(d)));
    in.push_back(owned.back().get());
  }
  auto out = transport_->Run(spec, in);
  for (size_t i = 0; i < devices.size(); ++i) {
    int64_t got[3];
    out[i]->ToHost(got, sizeof got);
    if (devices[i] == all[2].handle) {
      EXPECT_EQ(std::vector<int64_t>(got, got + 3), std::vector<int64_t>(on3, on3 + 3));
    } else {
      EXPECT_EQ(std::vector<int64_t>(got, got + 3), std::vector<int64_t>(3, 0));
    }
  }
  CollectiveSpec bad = spec;
  bad.devices = {all[0].id};
  EXPECT_THROW(BuildCollectiveProgram(bad), std::invalid_argument);
}

// torch_tpu's storage layout: rank-1 buffers longer than the tensor (the
// padding holds anything), results padded with zeros to the output's.
TEST_F(XlaTransportTest, StorageCapacityLayout) {
  for (ElementType t : {ElementType::kF32, ElementType::kBF16, ElementType::kS64, ElementType::kPred}) {
    CollectiveSpec spec{CollectiveKind::kAllGather, ReduceKind::kSum, t, {6}, 2};
    spec.input_capacity = 8;
    spec.output_capacity = 16;
    SCOPED_TRACE(spec.ToString());
    auto in = Inputs(t, 2, 6);
    std::vector<std::vector<double>> padded = in;
    for (auto& v : padded) v.insert(v.end(), {1, 1});  // padding: not zeros, must not leak into the result
    std::vector<PJRT_Device*> devices = transport_->Devices(spec);
    std::vector<std::unique_ptr<Buffer>> owned;
    std::vector<Buffer*> bufs;
    for (size_t r = 0; r < 2; ++r) {
      auto bytes = Encode(t, padded[r]);
      const int64_t cap = 8;
      owned.push_back(client_->BufferFromHost(bytes.data(), PjrtType(t), std::span(&cap, 1), DeviceOf(devices[r])));
      bufs.push_back(owned.back().get());
    }
    auto out = transport_->Run(spec, bufs);
    std::vector<double> want = in[0];
    want.insert(want.end(), in[1].begin(), in[1].end());
    want.insert(want.end(), 4, 0.0);
    for (auto& b : out) {
      std::vector<uint8_t> bytes(b->on_device_size_in_bytes());
      b->ToHost(bytes.data(), bytes.size());
      EXPECT_EQ(Decode(t, bytes), want);
    }
  }
  // PREMUL_SUM with the factor in a 16-element storage buffer
  CollectiveSpec spec{CollectiveKind::kAllReduce, ReduceKind::kPremulSum, ElementType::kF32, {3}, 2};
  spec.input_capacity = 4;
  spec.factor_capacity = 16;
  spec.output_capacity = 4;
  std::vector<PJRT_Device*> devices = transport_->Devices(spec);
  const float x0[4] = {1, 2, 3, 100}, x1[4] = {4, 5, 6, 100};
  std::vector<float> f0(16, 7.0f), f1(16, 7.0f);
  f0[0] = 0.5f;
  f1[0] = 2.0f;
  const int64_t four = 4, sixteen = 16;
  auto a0 = client_->BufferFromHost(x0, PJRT_Buffer_Type_F32, std::span(&four, 1), DeviceOf(devices[0]));
  auto a1 = client_->BufferFromHost(x1, PJRT_Buffer_Type_F32, std::span(&four, 1), DeviceOf(devices[1]));
  auto g0 = client_->BufferFromHost(f0.data(), PJRT_Buffer_Type_F32, std::span(&sixteen, 1), DeviceOf(devices[0]));
  auto g1 = client_->BufferFromHost(f1.data(), PJRT_Buffer_Type_F32, std::span(&sixteen, 1), DeviceOf(devices[1]));
  Buffer* in[] = {a0.get(), a1.get()};
  Buffer* fac[] = {g0.get(), g1.get()};
  auto out = transport_->Run(spec, in, fac);
  float got[4];
  out[1]->ToHost(got, sizeof got);
  EXPECT_EQ(std::vector<float>(got, got + 4), (std::vector<float>{8.5f, 11.0f, 13.5f, 0.0f}));
}

TEST_F(XlaTransportTest, ProgramsAreCachedPerSpec) {
  XlaTransport transport(client_);
  CollectiveSpec a{CollectiveKind::kAllReduce, ReduceKind::kSum, ElementType::kF32, {4}, 2};
  CollectiveSpec b = a;
  b.dims = {8};
  std::vector<PJRT_Device*> devices = transport.Devices(a);
  EXPECT_EQ(transport.compiles(), 1);
  std::vector<float> x(8, 1.0f);
  for (int i = 0; i < 3; ++i) {
    auto b0 = client_->BufferFromHost(x.data(), PJRT_Buffer_Type_F32, a.dims, DeviceOf(devices[0]));
    auto b1 = client_->BufferFromHost(x.data(), PJRT_Buffer_Type_F32, a.dims, DeviceOf(devices[1]));
    Buffer* in[] = {b0.get(), b1.get()};
    transport.Run(a, in);
  }
  EXPECT_EQ(transport.compiles(), 1);
  transport.Devices(b);
  EXPECT_EQ(transport.compiles(), 2);
  EXPECT_EQ(transport.cached(), 2u);
}

TEST_F(XlaTransportTest, BadRequestsRaiseNamingTheCollective) {
  auto message = [](const CollectiveSpec& s) {
    try {
      BuildCollectiveProgram(s);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({CollectiveKind::kAllReduce, ReduceKind::kAvg, ElementType::kS64, {4}, 2}).find("AVG and PREMUL_SUM"),
            std::string::npos);
  EXPECT_NE(message({CollectiveKind::kReduceScatter, ReduceKind::kSum, ElementType::kF32, {3}, 2}).find("not divisible"),
            std::string::npos);
  EXPECT_NE(message({CollectiveKind::kAllToAll, ReduceKind::kSum, ElementType::kF32, {5}, 2}).find("all_to_all"),
            std::string::npos);
  EXPECT_NE(message({CollectiveKind::kBroadcast, ReduceKind::kSum, ElementType::kF32, {4}, 2, {}, 2}).find("root 2"),
            std::string::npos);
  EXPECT_NE(message({CollectiveKind::kPermute, ReduceKind::kSum, ElementType::kF32, {4}, 2, {{0, 2}}}).find("outside"),
            std::string::npos);
  EXPECT_NE(message({CollectiveKind::kPermute, ReduceKind::kSum, ElementType::kF32, {4}, 2, {{0, 1}, {0, 0}}})
                .find("source 0 twice"),
            std::string::npos);
  // a wrong number of buffers
  CollectiveSpec s{CollectiveKind::kAllReduce, ReduceKind::kSum, ElementType::kF32, {4}, 2};
  std::vector<float> x(4, 1.0f);
  auto b0 = client_->BufferFromHost(x.data(), PJRT_Buffer_Type_F32, s.dims, client_->addressable_devices()[0]);
  Buffer* one[] = {b0.get()};
  EXPECT_THROW(transport_->Run(s, one), std::invalid_argument);
}

// The CPU plugin's client is one process: the backend must stay host-staged.
TEST_F(XlaTransportTest, CpuClientDoesNotSpanProcesses) {
  EXPECT_EQ(client_->global_device_count(), kDevices);
  EXPECT_EQ(client_->process_index(), 0);
  EXPECT_FALSE(XlaTransport::UsableFor(*client_, 2));
}

// The multi-process client options: accepted (and, on the CPU plugin,
// ignored) by PJRT_Client_Create; the callbacks themselves are exercised
// directly, as the CPU plugin never calls them.
class MapStore : public pjrt::KeyValueStore {
 public:
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    ++gets;
    last_timeout = timeout;
    auto it = values.find(key);
    if (it == values.end()) throw std::runtime_error("timed out");
    return it->second;
  }
  std::optional<std::string> TryGet(const std::string& key) override {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    return it->second;
  }
  void Put(const std::string& key, const std::string& value) override { values[key] = value; }
  std::map<std::string, std::string> values;
  int gets = 0;
  std::chrono::milliseconds last_timeout{0};
};

struct FakeError {
  static PJRT_Error_Code code;
  static std::string message;
  static PJRT_Error* Make(PJRT_Error_Code c, const char* m, size_t n) {
    code = c;
    message.assign(m, n);
    return reinterpret_cast<PJRT_Error*>(&code);  // any non-null marker
  }
};
PJRT_Error_Code FakeError::code = PJRT_Error_Code_OK;
std::string FakeError::message;

TEST(KeyValueCallbacks, GetPutTryGetThroughTheStore) {
  MapStore store;
  PJRT_CallbackError make = &FakeError::Make;
  const std::string value("bytes\0with nul", 14);
  PJRT_KeyValuePutCallback_Args put{};
  put.key = "pjrt/k";
  put.key_size = 6;
  put.value = value.data();
  put.value_size = value.size();
  put.callback_error = &make;
  put.user_arg = &store;
  EXPECT_EQ(pjrt::detail::KeyValuePut(&put), nullptr);
  EXPECT_EQ(store.values.at("pjrt/k"), value);

  PJRT_KeyValueGetCallback_Args get{};
  get.key = "pjrt/k";
  get.key_size = 6;
  get.timeout_in_ms = 1234;
  get.callback_error = &make;
  get.user_arg = &store;
  ASSERT_EQ(pjrt::detail::KeyValueGet(&get), nullptr);
  EXPECT_EQ(std::string(get.value, get.value_size), value);
  EXPECT_EQ(store.last_timeout.count(), 1234);
  get.value_deleter_callback(get.value);

  get.key = "pjrt/missing";
  get.key_size = 12;
  EXPECT_NE(pjrt::detail::KeyValueGet(&get), nullptr);
  EXPECT_EQ(FakeError::code, PJRT_Error_Code_DEADLINE_EXCEEDED);
  EXPECT_NE(FakeError::message.find("pjrt/missing"), std::string::npos);

  PJRT_KeyValueTryGetCallback_Args tryget{};
  tryget.key = "pjrt/missing";
  tryget.key_size = 12;
  tryget.callback_error = &make;
  tryget.user_arg = &store;
  EXPECT_NE(pjrt::detail::KeyValueTryGet(&tryget), nullptr);
  EXPECT_EQ(FakeError::code, PJRT_Error_Code_NOT_FOUND);
  tryget.key = "pjrt/k";
  tryget.key_size = 6;
  ASSERT_EQ(pjrt::detail::KeyValueTryGet(&tryget), nullptr);
  EXPECT_EQ(std::string(tryget.value, tryget.value_size), value);
  tryget.value_deleter_callback(tryget.value);
}

TEST(MultiProcessClientOptions, AcceptedByTheCpuPlugin) {
  auto plugin = Plugin::Load(XLA_CPU_PLUGIN_PATH);
  pjrt::ClientOptions options;
  options.int_options = {{"cpu_device_count", 2}, {"node_id", 0}, {"num_nodes", 1}};
  options.string_options = {{"platform_name", "cpu"}};
  auto store = std::make_shared<MapStore>();
  options.kv_store = store;
  auto client = Client::Create(plugin, options);
  EXPECT_EQ(client->addressable_devices().size(), 2u);
  EXPECT_EQ(client->global_device_count(), 2);
  EXPECT_FALSE(XlaTransport::UsableFor(*client, 2));
}

}  // namespace
}  // namespace torch_tpu::distributed
