// Tier-1 tests of the StableHLO Builder: the text it emits, without a plugin.
// (Tests that the text compiles and computes the right values run through
// the Python suite and tests/cpp/pjrt_runtime_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>

#include "hlo/builder.h"

namespace torch_tpu::hlo {
namespace {

bool Contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(TensorType, Spelling) {
  EXPECT_EQ((TensorType{ElementType::kF32, {2, 3}}).ToString(), "tensor<2x3xf32>");
  EXPECT_EQ((TensorType{ElementType::kPred, {}}).ToString(), "tensor<i1>");
  EXPECT_EQ((TensorType{ElementType::kU8, {0}}).ToString(), "tensor<0xui8>");
  EXPECT_EQ((TensorType{ElementType::kBF16, {4}}).numel(), 4);
}

TEST(Builder, AddModule) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {4}});
  Value y = b.Parameter({ElementType::kF32, {4}});
  Value z = b.Add(x, y);
  b.Return(std::span(&z, 1));
  std::string m = b.Module();
  EXPECT_TRUE(Contains(m, "func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> (tensor<4xf32>)"));
  EXPECT_TRUE(Contains(m, "\"stablehlo.add\"(%arg0, %arg1) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>"));
  EXPECT_TRUE(Contains(m, "\"func.return\"(%0)"));
}

TEST(Builder, ConstantsUseExactBitPatterns) {
  Builder b;
  Value one = b.ScalarConstant(ElementType::kF32, 1.0);
  Value nan = b.ScalarConstant(ElementType::kF32, std::nan(""));
  Value bf = b.ScalarConstant(ElementType::kBF16, 1.0);
  Value half = b.ScalarConstant(ElementType::kF16, -2.0);
  Value i = b.ScalarConstant(ElementType::kS64, -3);
  Value p = b.ScalarConstant(ElementType::kPred, 1);
  Value outs[] = {one, nan, bf, half, i, p};
  b.Return(outs);
  std::string m = b.Module();
  EXPECT_TRUE(Contains(m, "dense<0x3F800000> : tensor<f32>"));
  EXPECT_TRUE(Contains(m, "dense<0x7FC00000> : tensor<f32>"));
  EXPECT_TRUE(Contains(m, "dense<0x3F80> : tensor<bf16>"));
  EXPECT_TRUE(Contains(m, "dense<0xC000> : tensor<f16>"));
  EXPECT_TRUE(Contains(m, "dense<-3> : tensor<i64>"));
  EXPECT_TRUE(Contains(m, "dense<true> : tensor<i1>"));
}

TEST(Builder, ShapeOpsComputeResultTypes) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {2, 3, 4}});
  int64_t perm[] = {2, 0, 1};
  Value t = b.Transpose(x, perm);
  EXPECT_EQ(t.dims(), (std::vector<int64_t>{4, 2, 3}));
  int64_t start[] = {0, 1, 0}, limit[] = {2, 3, 4}, strides[] = {1, 1, 2};
  Value s = b.Slice(x, start, limit, strides);
  EXPECT_EQ(s.dims(), (std::vector<int64_t>{2, 2, 2}));
  int64_t dims[] = {6, 4};
  EXPECT_EQ(b.Reshape(x, dims).dims(), (std::vector<int64_t>{6, 4}));
  int64_t bad[] = {5, 5};
  EXPECT_THROW(b.Reshape(x, bad), BuildError);
  // Identity reshapes and transposes emit nothing.
  int64_t same[] = {2, 3, 4};
  EXPECT_EQ(b.Reshape(x, same).name, x.name);
}

TEST(Builder, ReduceRegion) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {2, 3}});
  Value init = b.ScalarConstant(ElementType::kF32, 0);
  int64_t dims[] = {1};
  auto r = b.Reduce(std::span(&x, 1), std::span(&init, 1), dims,
                    [](Builder& bb, std::span<const Value> a) { return std::vector<Value>{bb.Add(a[0], a[1])}; });
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].dims(), (std::vector<int64_t>{2}));
  b.Return(r);
  std::string m = b.Module();
  EXPECT_TRUE(Contains(m, "\"stablehlo.reduce\""));
  EXPECT_TRUE(Contains(m, "^bb0("));
  EXPECT_TRUE(Contains(m, "\"stablehlo.return\""));
  EXPECT_TRUE(Contains(m, "dimensions = array<i64: 1>"));
}

TEST(Builder, MismatchedOperandsAreRejected) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {4}});
  Value y = b.Parameter({ElementType::kS32, {4}});
  EXPECT_THROW(b.Add(x, y), BuildError);
  EXPECT_THROW(b.Select(x, x, x), BuildError);
}

TEST(Builder, MultiResultOpsAreNumbered) {
  Builder b;
  Value state = b.Parameter({ElementType::kU64, {2}});
  auto [new_state, bits] = b.RngBitGenerator(state, {ElementType::kU32, {8}});
  EXPECT_EQ(new_state.name.substr(new_state.name.size() - 2), "#0");
  EXPECT_EQ(bits.name.substr(bits.name.size() - 2), "#1");
  EXPECT_EQ(bits.dims(), (std::vector<int64_t>{8}));
}

TEST(Builder, ModuleRequiresReturn) {
  Builder b;
  b.Parameter({ElementType::kF32, {1}});
  EXPECT_THROW(b.Module(), BuildError);
}

}  // namespace
}  // namespace torch_tpu::hlo
