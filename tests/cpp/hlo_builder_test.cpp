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

TEST(Builder, AliasParameterMarksTheArgument) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {4}});
  Value s = b.Parameter({ElementType::kF32, {}});
  EXPECT_EQ(b.num_parameters(), 2u);
  Value y = b.Mul(x, b.BroadcastInDim(s, std::vector<int64_t>{4}, {}));
  b.AliasParameter(0, 0);
  EXPECT_THROW(b.AliasParameter(0, 1), BuildError);  // argument already aliased
  EXPECT_THROW(b.AliasParameter(7, 1), BuildError);  // no such argument
  b.Return(std::span(&y, 1));
  EXPECT_TRUE(Contains(b.Module(), "%arg0: tensor<4xf32> {tf.aliasing_output = 0 : i32}, %arg1: tensor<f32>)"));
}

TEST(Builder, AliasParameterRejectsAResultOfAnotherType) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {4}});
  Value y = b.Convert(x, ElementType::kF16);
  b.AliasParameter(0, 0);
  b.Return(std::span(&y, 1));
  EXPECT_THROW(b.Module(), BuildError);
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

TEST(Builder, WhileLoopHasConditionAndBodyRegions) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {3}});
  Value init[] = {b.ConstantInt({ElementType::kS32, {}}, 0), x};
  auto r = b.While(
      init,
      [](Builder& bb, std::span<const Value> v) {
        return std::vector<Value>{bb.Compare(v[0], bb.ConstantInt({ElementType::kS32, {}}, 4),
                                             CompareDirection::kLT)};
      },
      [&](Builder& bb, std::span<const Value> v) {
        // Uses `x`, defined outside the loop.
        return std::vector<Value>{bb.Add(v[0], bb.ConstantInt({ElementType::kS32, {}}, 1)), bb.Add(v[1], x)};
      });
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].name.substr(r[0].name.size() - 2), "#0");
  EXPECT_EQ(r[1].type, x.type);
  b.Return(std::span(&r[1], 1));
  std::string m = b.Module();
  EXPECT_TRUE(Contains(m, "\"stablehlo.while\"("));
  EXPECT_TRUE(Contains(m, "}, {"));  // two regions
  EXPECT_TRUE(Contains(m, "-> (tensor<i32>, tensor<3xf32>)"));
}

TEST(Builder, WhileRejectsMismatchedRegions) {
  Builder b;
  Value x = b.Parameter({ElementType::kF32, {3}});
  auto cond_ok = [](Builder& bb, std::span<const Value>) {
    return std::vector<Value>{bb.Constant({ElementType::kPred, {}}, 1)};
  };
  auto same = [](Builder&, std::span<const Value> v) { return std::vector<Value>(v.begin(), v.end()); };
  // Condition must be one tensor<i1>.
  EXPECT_THROW(b.While(std::span(&x, 1), same, same), BuildError);
  // Body results must keep the loop-carried types.
  EXPECT_THROW(b.While(std::span(&x, 1), cond_ok,
                       [](Builder& bb, std::span<const Value> v) {
                         return std::vector<Value>{bb.Convert(v[0], ElementType::kF64)};
                       }),
               BuildError);
  EXPECT_THROW(b.While({}, cond_ok, same), BuildError);
}

TEST(Builder, LinearAlgebraOps) {
  Builder b;
  Value a = b.Parameter({ElementType::kF32, {2, 4, 4}});
  Value rhs = b.Parameter({ElementType::kF32, {2, 4, 3}});
  Value wide = b.Parameter({ElementType::kF32, {2, 4, 5}});
  Value x = b.TriangularSolve(a, rhs, true, false, true, true);
  EXPECT_EQ(x.type, rhs.type);
  Value l = b.Cholesky(a, true);
  EXPECT_EQ(l.type, a.type);
  TensorType qr_types[] = {a.type, TensorType{ElementType::kF32, {2, 4}}};
  auto qr = b.CustomCall("Qr", std::span(&a, 1), qr_types);
  ASSERT_EQ(qr.size(), 2u);
  EXPECT_EQ(qr[1].dims(), (std::vector<int64_t>{2, 4}));
  Value outs[] = {x, l, qr[0]};
  b.Return(outs);
  std::string m = b.Module();
  EXPECT_TRUE(Contains(m, "left_side = true, lower = false, unit_diagonal = true, "
                          "transpose_a = #stablehlo<transpose TRANSPOSE>"));
  EXPECT_TRUE(Contains(m, "\"stablehlo.cholesky\"(%arg0) {lower = true}"));
  EXPECT_TRUE(Contains(m, "call_target_name = \"Qr\", backend_config = \"\", api_version = 1 : i32"));
  // Shape errors name the op.
  EXPECT_THROW(b.TriangularSolve(wide, rhs, true, true, false, false), BuildError);
  EXPECT_THROW(b.TriangularSolve(a, rhs, false, true, false, false), BuildError);  // right side: k x n
  EXPECT_THROW(b.Cholesky(wide, true), BuildError);
}

TEST(Builder, ModuleRequiresReturn) {
  Builder b;
  b.Parameter({ElementType::kF32, {1}});
  EXPECT_THROW(b.Module(), BuildError);
}

}  // namespace
}  // namespace torch_tpu::hlo
