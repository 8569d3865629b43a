// Tier 2: the PJRT runtime layer against the XLA CPU plugin.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "pjrt/pjrt.h"

namespace torch_tpu::pjrt {
namespace {

constexpr char kAddF32x4[] = R"(
module @m {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
)";

class PjrtRuntimeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    plugin_ = Plugin::Load(XLA_CPU_PLUGIN_PATH);
    client_ = Client::Create(plugin_);
  }
  static void TearDownTestSuite() {
    client_.reset();
    plugin_.reset();
  }

  const Device& dev() const { return client_->addressable_devices().at(0); }

  std::unique_ptr<Buffer> Upload(const std::vector<float>& v,
                                 std::vector<int64_t> dims) {
    return client_->BufferFromHost(v.data(), PJRT_Buffer_Type_F32, dims,
                                   dev());
  }
  std::unique_ptr<Buffer> Upload(const std::vector<float>& v) {
    return Upload(v, {static_cast<int64_t>(v.size())});
  }
  static std::vector<float> Download(const Buffer& b, size_t n) {
    std::vector<float> out(n);
    b.ToHost(out.data(), n * sizeof(float));
    return out;
  }
  std::unique_ptr<Executable> Compile(const std::string& text,
                                      const CompileOptions& options = {}) {
    return client_->Compile(text, options);
  }

  static std::shared_ptr<Plugin> plugin_;
  static std::shared_ptr<Client> client_;
};

std::shared_ptr<Plugin> PjrtRuntimeTest::plugin_;
std::shared_ptr<Client> PjrtRuntimeTest::client_;

TEST_F(PjrtRuntimeTest, PluginLoadsWithMatchingApiVersion) {
  EXPECT_EQ(plugin_->api_major(), PJRT_API_MAJOR);
  EXPECT_GT(plugin_->api_minor(), 0);
  EXPECT_EQ(plugin_->path(), XLA_CPU_PLUGIN_PATH);
  // Cached by path.
  EXPECT_EQ(Plugin::Load(XLA_CPU_PLUGIN_PATH).get(), plugin_.get());
  for (const auto& [name, value] : plugin_->attributes()) {
    std::printf("  plugin attribute %s = %s\n", name.c_str(), value.c_str());
  }
}

TEST_F(PjrtRuntimeTest, ClientReportsCpuPlatformAndDevices) {
  EXPECT_EQ(client_->platform_name(), "cpu");
  EXPECT_FALSE(client_->platform_version().empty());
  ASSERT_GE(client_->addressable_devices().size(), 1u);
  for (const Device& d : client_->addressable_devices()) {
    EXPECT_NE(d.handle, nullptr);
    EXPECT_FALSE(d.kind.empty());
    std::printf("  device id=%d local=%d kind=%s debug=%s\n", d.id,
                d.local_hardware_id, d.kind.c_str(), d.debug_string.c_str());
  }
  std::printf("  platform version %s\n", client_->platform_version().c_str());
}

TEST_F(PjrtRuntimeTest, MissingPluginPathThrowsNamingThePath) {
  const std::string path = "/nonexistent/dir/libno_such_pjrt_plugin.so";
  try {
    Plugin::Load(path);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST_F(PjrtRuntimeTest, NonPluginLibraryThrowsNamingGetPjrtApi) {
  // A real shared library that is not a PJRT plugin.
  try {
    Plugin::Load("libm.so.6");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GetPjrtApi"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("libm.so.6"), std::string::npos)
        << e.what();
  }
}

TEST_F(PjrtRuntimeTest, AddF32) {
  auto exe = Compile(kAddF32x4);
  ASSERT_EQ(exe->num_outputs(), 1u);
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 1e30f};
  std::vector<float> b = {0.5f, 4.0f, -3.25f, 1e30f};
  auto ba = Upload(a);
  auto bb = Upload(b);
  Buffer* args[] = {ba.get(), bb.get()};
  auto out = exe->Execute(args, dev());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0]->element_type(), PJRT_Buffer_Type_F32);
  EXPECT_EQ(out[0]->dimensions(), std::vector<int64_t>{4});
  EXPECT_GE(out[0]->on_device_size_in_bytes(), 4 * sizeof(float));
  std::vector<float> got = Download(*out[0], 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], a[i] + b[i]) << i;
}

TEST_F(PjrtRuntimeTest, ScalarInputBroadcast) {
  auto exe = Compile(R"(
module @m {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<f32>) -> (tensor<4xf32>, tensor<f32>) {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %1 = stablehlo.multiply %arg0, %0 : tensor<4xf32>
    %2 = stablehlo.negate %arg1 : tensor<f32>
    return %1, %2 : tensor<4xf32>, tensor<f32>
  }
}
)");
  ASSERT_EQ(exe->num_outputs(), 2u);
  std::vector<float> x = {1.f, 2.f, -3.f, 0.5f};
  float s = 2.5f;
  auto bx = Upload(x);
  auto bs = client_->BufferFromHost(&s, PJRT_Buffer_Type_F32, {}, dev());
  EXPECT_TRUE(bs->dimensions().empty());
  Buffer* args[] = {bx.get(), bs.get()};
  auto out = exe->Execute(args, dev());
  ASSERT_EQ(out.size(), 2u);
  std::vector<float> got = Download(*out[0], 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], x[i] * s) << i;
  EXPECT_TRUE(out[1]->dimensions().empty());
  float neg = 0;
  out[1]->ToHost(&neg, sizeof(neg));
  EXPECT_EQ(neg, -s);
}

TEST_F(PjrtRuntimeTest, ZeroElementBuffers) {
  auto exe = Compile(R"(
module @m {
  func.func public @main(%arg0: tensor<0x3xf32>, %arg1: tensor<0x3xf32>) -> tensor<0x3xf32> {
    %0 = stablehlo.add %arg0, %arg1 : tensor<0x3xf32>
    return %0 : tensor<0x3xf32>
  }
}
)");
  const int64_t dims[] = {0, 3};
  auto a = client_->BufferFromHost(nullptr, PJRT_Buffer_Type_F32, dims, dev());
  std::vector<float> empty;
  auto b = client_->BufferFromHost(empty.data(), PJRT_Buffer_Type_F32, dims,
                                   dev());
  EXPECT_EQ(a->dimensions(), (std::vector<int64_t>{0, 3}));
  Buffer* args[] = {a.get(), b.get()};
  auto out = exe->Execute(args, dev());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0]->dimensions(), (std::vector<int64_t>{0, 3}));
  out[0]->ToHost(nullptr, 0);
}

TEST_F(PjrtRuntimeTest, IntegerAndPredicateTypes) {
  auto exe = Compile(R"(
module @m {
  func.func public @main(%arg0: tensor<3xi32>, %arg1: tensor<3xi32>) -> (tensor<3xi32>, tensor<3xi1>) {
    %0 = stablehlo.subtract %arg0, %arg1 : tensor<3xi32>
    %1 = stablehlo.compare GT, %arg0, %arg1 : (tensor<3xi32>, tensor<3xi32>) -> tensor<3xi1>
    return %0, %1 : tensor<3xi32>, tensor<3xi1>
  }
}
)");
  std::vector<int32_t> a = {5, -7, 2147483647}, b = {3, 1, -1};
  const int64_t dims[] = {3};
  auto ba = client_->BufferFromHost(a.data(), PJRT_Buffer_Type_S32, dims, dev());
  auto bb = client_->BufferFromHost(b.data(), PJRT_Buffer_Type_S32, dims, dev());
  Buffer* args[] = {ba.get(), bb.get()};
  auto out = exe->Execute(args, dev());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1]->element_type(), PJRT_Buffer_Type_PRED);
  std::vector<int32_t> diff(3);
  out[0]->ToHost(diff.data(), diff.size() * sizeof(int32_t));
  EXPECT_EQ(diff[0], 2);
  EXPECT_EQ(diff[1], -8);
  EXPECT_EQ(diff[2], std::numeric_limits<int32_t>::min());  // wraps
  uint8_t gt[3] = {9, 9, 9};
  out[1]->ToHost(gt, sizeof(gt));
  EXPECT_EQ(gt[0], 1);
  EXPECT_EQ(gt[1], 0);
  EXPECT_EQ(gt[2], 1);
}

TEST_F(PjrtRuntimeTest, ToHostPathsAgree) {
  auto exe = Compile(kAddF32x4);
  std::vector<float> a = {1.f, -2.f, 3.5f, 4.f};
  auto ba = Upload(a);
  Buffer* args[] = {ba.get(), ba.get()};
  auto out = exe->Execute(args, dev());
  std::vector<float> direct(4), via_plugin(4);
  out[0]->ToHostViaPlugin(via_plugin.data(), 16);
  out[0]->ToHost(direct.data(), 16);
  EXPECT_EQ(direct, via_plugin);
  EXPECT_EQ(direct, (std::vector<float>{2.f, -4.f, 7.f, 8.f}));
  // Host buffers straight from BufferFromHost, 0-d and 2-d.
  float s = 3.f, s_back = 0.f;
  auto bs = client_->BufferFromHost(&s, PJRT_Buffer_Type_F32, {}, dev());
  bs->ToHost(&s_back, sizeof(s_back));
  EXPECT_EQ(s_back, 3.f);
  std::vector<double> m = {1, 2, 3, 4, 5, 6}, m_back(6), m_via(6);
  const int64_t dims[] = {2, 3};
  auto bm = client_->BufferFromHost(m.data(), PJRT_Buffer_Type_F64, dims, dev());
  bm->ToHost(m_back.data(), 6 * sizeof(double));
  bm->ToHostViaPlugin(m_via.data(), 6 * sizeof(double));
  EXPECT_EQ(m_back, m);
  EXPECT_EQ(m_via, m);
}

TEST_F(PjrtRuntimeTest, ToHostReadsAPrefixAndRejectsMoreThanTheBuffer) {
  // A storage's bytes are a prefix of its buffer (capacity padding): a
  // shorter read copies the first nbytes; a longer one throws.
  auto ba = Upload({1, 2, 3, 4});
  std::vector<float> small(2, -1.f);
  ba->ToHost(small.data(), 2 * sizeof(float));
  EXPECT_EQ(small[0], 1.f);
  EXPECT_EQ(small[1], 2.f);
  std::vector<float> large(8);
  EXPECT_THROW(ba->ToHost(large.data(), 8 * sizeof(float)), Error);
}

TEST_F(PjrtRuntimeTest, ChainedExecutionsWithoutWaiting) {
  auto exe = Compile(kAddF32x4);
  std::vector<float> a = {1.f, 2.f, 3.f, 4.f};
  std::vector<float> b = {10.f, 20.f, 30.f, 40.f};
  auto ba = Upload(a);
  auto bb = Upload(b);
  Buffer* args1[] = {ba.get(), bb.get()};
  auto r1 = exe->Execute(args1, dev());
  Buffer* args2[] = {r1[0].get(), r1[0].get()};  // same buffer twice
  auto r2 = exe->Execute(args2, dev());
  Buffer* args3[] = {r2[0].get(), ba.get()};
  auto r3 = exe->Execute(args3, dev());
  std::vector<float> got = Download(*r3[0], 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], 2 * (a[i] + b[i]) + a[i]) << i;
  // Earlier results stay valid and readable.
  got = Download(*r1[0], 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], a[i] + b[i]) << i;
}

TEST_F(PjrtRuntimeTest, DeviceCompleteAndReadyEvents) {
  auto exe = Compile(kAddF32x4);
  auto ba = Upload({1, 2, 3, 4});
  Buffer* args[] = {ba.get(), ba.get()};
  std::unique_ptr<Event> complete;
  auto out = exe->Execute(args, dev(), {}, &complete);
  ASSERT_NE(complete, nullptr);
  complete->Await();
  EXPECT_TRUE(complete->IsReady());
  auto ready = out[0]->ReadyEvent();
  ready->Await();
  EXPECT_TRUE(ready->IsReady());
  EXPECT_EQ(Download(*out[0], 4), (std::vector<float>{2, 4, 6, 8}));
}

TEST_F(PjrtRuntimeTest, DonatedArgumentsAreAccepted) {
  // An aliased output lets the plugin reuse a donated input's memory.
  auto exe = Compile(R"(
module @m {
  func.func public @main(%arg0: tensor<4xf32> {tf.aliasing_output = 0 : i32}, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
)");
  auto ba = Upload({1, 2, 3, 4});
  auto bb = Upload({1, 1, 1, 1});
  Buffer* args[] = {ba.get(), bb.get()};
  const int64_t donated[] = {0};
  auto out = exe->Execute(args, dev(), donated);
  EXPECT_EQ(Download(*out[0], 4), (std::vector<float>{2, 3, 4, 5}));
  EXPECT_EQ(Download(*bb, 4), (std::vector<float>{1, 1, 1, 1}));
  // Not donated: the input stays usable.
  auto bc = Upload({1, 2, 3, 4});
  Buffer* args2[] = {bc.get(), bb.get()};
  auto out2 = exe->Execute(args2, dev());
  EXPECT_EQ(Download(*out2[0], 4), (std::vector<float>{2, 3, 4, 5}));
  EXPECT_EQ(Download(*bc, 4), (std::vector<float>{1, 2, 3, 4}));
}

TEST_F(PjrtRuntimeTest, PortableExecutableRunsOnEveryDevice) {
  const auto& devices = client_->addressable_devices();
  if (devices.size() < 2) GTEST_SKIP() << "needs two devices";
  CompileOptions portable;
  portable.portable = true;
  auto exe = Compile(kAddF32x4, portable);
  for (const Device& d : devices) {
    const float a[4] = {1, 2, 3, static_cast<float>(d.id)};
    const int64_t dims[] = {4};
    auto b = client_->BufferFromHost(a, PJRT_Buffer_Type_F32, dims, d);
    Buffer* args[] = {b.get(), b.get()};
    auto out = exe->Execute(args, d);
    EXPECT_EQ(Download(*out[0], 4),
              (std::vector<float>{2, 4, 6, 2.f * static_cast<float>(d.id)}))
        << d.debug_string;
  }
  // A non-portable executable is bound to the first device.
  auto bound = Compile(kAddF32x4);
  const float a[4] = {1, 2, 3, 4};
  const int64_t dims[] = {4};
  auto b = client_->BufferFromHost(a, PJRT_Buffer_Type_F32, dims, devices[1]);
  Buffer* args[] = {b.get(), b.get()};
  EXPECT_THROW(bound->Execute(args, devices[1]), Error);
}

TEST_F(PjrtRuntimeTest, WrongArgumentCountIsACleanError) {
  auto exe = Compile(kAddF32x4);
  auto ba = Upload({1, 2, 3, 4});
  Buffer* args[] = {ba.get()};
  EXPECT_THROW(exe->Execute(args, dev()), Error);
}

TEST_F(PjrtRuntimeTest, SyntaxErrorThrowsWithPluginDiagnostic) {
  try {
    Compile("module @m { func.func public @main( this is not mlir");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    std::string what = e.what();
    std::printf("  syntax error: %s\n", what.c_str());
    EXPECT_EQ(what.rfind("PJRT_Client_Compile: ", 0), 0u) << what;
    EXPECT_GT(what.size(), std::strlen("PJRT_Client_Compile: ") + 10) << what;
    EXPECT_NE(e.code(), PJRT_Error_Code_OK);
  }
}

TEST_F(PjrtRuntimeTest, TypeMismatchThrowsWithPluginDiagnostic) {
  try {
    Compile(R"(
module @m {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<3xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %arg0, %arg1 : (tensor<4xf32>, tensor<3xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
)");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    std::string what = e.what();
    std::printf("  type mismatch: %s\n", what.c_str());
    EXPECT_EQ(what.rfind("PJRT_Client_Compile: ", 0), 0u) << what;
    // The verifier's message names the offending op.
    EXPECT_NE(what.find("stablehlo.add"), std::string::npos) << what;
  }
}

TEST_F(PjrtRuntimeTest, UnknownOptionOverrideIsRejected) {
  CompileOptions options;
  options.env_option_overrides = {{"xla_no_such_flag_for_torch_tpu", "1"}};
  try {
    Compile(kAddF32x4, options);
    std::printf("  unknown override accepted silently\n");
  } catch (const Error& e) {
    std::printf("  unknown override: %s\n", e.what());
  }
}

constexpr char kMaxF32x4[] = R"(
module @m {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.maximum %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
)";

TEST_F(PjrtRuntimeTest, FastMinMaxOverrideMakesMaximumPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x = {nan, 1.f, nan, -2.f};
  std::vector<float> y = {0.f, nan, nan, 3.f};
  auto bx = Upload(x);
  auto by = Upload(y);
  Buffer* args[] = {bx.get(), by.get()};

  CompileOptions options;
  options.env_option_overrides = {{"xla_cpu_enable_fast_min_max", "false"}};
  auto exe = Compile(kMaxF32x4, options);
  std::vector<float> got = Download(*exe->Execute(args, dev())[0], 4);
  EXPECT_TRUE(std::isnan(got[0]));
  EXPECT_TRUE(std::isnan(got[1]));
  EXPECT_TRUE(std::isnan(got[2]));
  EXPECT_EQ(got[3], 3.f);

  // For the record: what the plugin's default does.
  auto fast = Compile(kMaxF32x4);
  got = Download(*fast->Execute(args, dev())[0], 4);
  std::printf("  default max(NaN,0)=%g max(1,NaN)=%g\n", got[0], got[1]);
}

TEST_F(PjrtRuntimeTest, SerializeAndDeserializeRoundTrip) {
  auto exe = Compile(kAddF32x4);
  std::string bytes;
  try {
    bytes = exe->Serialize();
  } catch (const Error& e) {
    GTEST_SKIP() << "plugin cannot serialize: " << e.what();
  }
  ASSERT_FALSE(bytes.empty());
  std::unique_ptr<Executable> loaded;
  try {
    loaded = client_->DeserializeAndLoad(bytes);
  } catch (const Error& e) {
    GTEST_SKIP() << "plugin cannot deserialize: " << e.what();
  }
  EXPECT_EQ(loaded->num_outputs(), 1u);
  auto ba = Upload({1, 2, 3, 4});
  auto bb = Upload({0.5f, 0.5f, 0.5f, 0.5f});
  Buffer* args[] = {ba.get(), bb.get()};
  auto want = Download(*exe->Execute(args, dev())[0], 4);
  auto got = Download(*loaded->Execute(args, dev())[0], 4);
  EXPECT_EQ(got, want);
  EXPECT_EQ(got, (std::vector<float>{1.5f, 2.5f, 3.5f, 4.5f}));
}

TEST_F(PjrtRuntimeTest, GarbageSerializedExecutableIsACleanError) {
  EXPECT_THROW(client_->DeserializeAndLoad("definitely not an executable"),
               Error);
}

TEST_F(PjrtRuntimeTest, MemoryStatsDoesNotCrash) {
  auto stats = client_->memory_stats(dev());
  if (stats) {
    std::printf("  bytes_in_use=%lld\n",
                static_cast<long long>(stats->bytes_in_use));
    EXPECT_GE(stats->bytes_in_use, 0);
  } else {
    std::printf("  memory stats not available\n");
  }
}

TEST(PjrtCompileOptionsTest, SerializesBuildOptions) {
  CompileOptions options;
  // field 3 (len 4) { field 4 = 1, field 5 = 1 }
  EXPECT_EQ(options.Serialize(), std::string("\x1a\x04\x20\x01\x28\x01", 6));
  options.num_replicas = 300;  // two-byte varint
  EXPECT_EQ(options.Serialize(),
            std::string("\x1a\x05\x20\xac\x02\x28\x01", 7));
}

TEST(PjrtCompileOptionsTest, SerializesPortable) {
  CompileOptions options;
  options.portable = true;
  EXPECT_EQ(options.Serialize(),
            std::string("\x1a\x04\x20\x01\x28\x01\x20\x01", 8));
}

TEST(PjrtCompileOptionsTest, SerializesOverrides) {
  CompileOptions options;
  options.env_option_overrides = {{"ab", "false"}, {"c", "xy"}};
  const std::string want =
      std::string("\x1a\x04\x20\x01\x28\x01", 6) +
      // field 7 entry { 1: "ab", 2: { 2: false } }
      std::string("\x3a\x08\x0a\x02" "ab" "\x12\x02\x10\x00", 10) +
      // field 7 entry { 1: "c", 2: { 1: "xy" } }
      std::string("\x3a\x09\x0a\x01" "c" "\x12\x04\x0a\x02" "xy", 11);
  EXPECT_EQ(options.Serialize(), want);
}

TEST(PjrtElementSizeTest, Sizes) {
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_PRED), 1u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_S8), 1u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_U8), 1u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_S16), 2u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_F16), 2u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_BF16), 2u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_S32), 4u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_F32), 4u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_U32), 4u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_S64), 8u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_F64), 8u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_C64), 8u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_C128), 16u);
  EXPECT_EQ(ElementSizeInBytes(PJRT_Buffer_Type_F8E4M3FN), 1u);
  EXPECT_THROW(ElementSizeInBytes(PJRT_Buffer_Type_S4), Error);
  EXPECT_THROW(ElementSizeInBytes(PJRT_Buffer_Type_INVALID), Error);
}

}  // namespace
}  // namespace torch_tpu::pjrt
