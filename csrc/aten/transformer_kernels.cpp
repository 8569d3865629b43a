// Kernels for the tpu key of PyTorch's fused transformer fast path.
//
// nn.TransformerEncoderLayer / nn.TransformerEncoder / nn.MultiheadAttention
// in eval mode under no_grad call aten::_transformer_encoder_layer_fwd and
// aten::_native_multi_head_attention (torch/nn/modules/transformer.py and
// activation.py list the PrivateUse1 backend among the fast path's devices).
// Those ops, and the two they are built from (_transform_bias_rescale_qkv,
// _masked_softmax), have only CPU/CUDA kernels, so without these they ran on
// the CPU through the fallback. Each kernel here is composed of ops that
// lower (linear, bmm, softmax, layer_norm, ...), following the CPU kernels
// step by step (aten/src/ATen/native/transformers/transformer.cpp and
// attention.cpp, aten/src/ATen/native/SoftMax.cpp):
//
//   _transform_bias_rescale_qkv(qkv [B, T, 3D], bias [3D], nh)
//       -> q, k, v [B, nh, T, D/nh]; q = (q + bq) / sqrt(D/nh), k + bk, v + bv
//   _masked_softmax(x, mask (bool; true = masked out), dim, mask_type)
//       mask_type 0: mask [L, S] for every batch and head;
//       mask_type 1: mask [B, S] (key padding), broadcast over heads and rows;
//       mask_type 2 or none: mask of x's shape.
//       softmax over dim with masked entries at -inf (a fully masked row is
//       NaN, as on CPU)
//   _native_multi_head_attention(q, k, v, D, nh, W_qkv [3D, D], b_qkv [3D],
//       W_o [D, D], b_o [D], mask, need_weights, average_attn_weights,
//       mask_type) -> (out [B, T, D], weights [B, (nh,) T, T] or undefined)
//   _transformer_encoder_layer_fwd(src [B, T, D], ...) -> [B, T, D]:
//       (norm_first) x + MHA(LN1(x)), then + FFN(LN2(.)), else
//       LN1(x + MHA(x)), then LN2(. + FFN(.)); FFN = W2 act(W1 x + b1) + b2,
//       act = gelu (use_gelu) or relu.
//
// Nested-tensor inputs (TransformerEncoder with enable_nested_tensor and a
// src_key_padding_mask) are not served: tpu has no nested-tensor kernels,
// and the checks below say so instead of returning a wrong value.
// Errors: the CPU kernels' checks (shapes of query/key/value and the
// weights, embed_dim divisible by num_heads, mask shapes), with their messages.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

namespace torch_tpu::aten {
namespace {

void CheckNotNested(const at::Tensor& t, const char* op) {
  TORCH_CHECK(!t.is_nested(), op,
              ": nested-tensor inputs are not supported on tpu (tpu has no nested-tensor kernels); "
              "construct nn.TransformerEncoder with enable_nested_tensor=False");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> TransformBiasRescaleQkv(const at::Tensor& qkv,
                                                                       const at::Tensor& qkv_bias,
                                                                       int64_t num_head) {
  CheckNotNested(qkv, "_transform_bias_rescale_qkv");
  TORCH_CHECK(qkv.dim() == 3, "_transform_bias_rescale_qkv: expected qkv of shape [B, T, 3D], got ", qkv.sizes());
  const int64_t B = qkv.size(0), T = qkv.size(1), three_d = qkv.size(2);
  const int64_t D = three_d / 3;
  TORCH_CHECK(num_head > 0 && D % num_head == 0, "_transform_bias_rescale_qkv: D (", D,
              ") must divide evenly by num_head (", num_head, ")");
  TORCH_CHECK(three_d % 3 == 0, "_transform_bias_rescale_qkv: last dim of qkv (", three_d, ") is not 3D");
  TORCH_CHECK(qkv_bias.dim() == 1 && qkv_bias.size(0) == three_d,
              "_transform_bias_rescale_qkv: expected qkv_bias of shape [", three_d, "], got ", qkv_bias.sizes());
  const int64_t dh = D / num_head;
  // [B, T, 3, nh, dh] -> [3, B, nh, T, dh]
  at::Tensor x = (qkv + qkv_bias).view({B, T, 3, num_head, dh}).permute({2, 0, 3, 1, 4});
  // The CPU kernel scales by a scalar_t-typed 1/sqrt(dh).
  const double inv_sqrt = 1.0 / std::sqrt(static_cast<double>(dh));
  at::Tensor q = (x.select(0, 0) * inv_sqrt).contiguous();
  return {q, x.select(0, 1).contiguous(), x.select(0, 2).contiguous()};
}

at::Tensor MaskedSoftmax(const at::Tensor& input, const at::Tensor& mask_in, std::optional<int64_t> dim_opt,
                         std::optional<int64_t> mask_type) {
  CheckNotNested(input, "_masked_softmax");
  TORCH_CHECK(mask_in.scalar_type() == at::kBool, "Mask should be a boolean tensor");
  const int64_t dim = at::maybe_wrap_dim(dim_opt.value_or(input.dim() - 1), input.dim());
  at::Tensor mask;
  if (mask_type.has_value() && *mask_type == 0) {
    TORCH_CHECK(mask_in.dim() == 2, "_masked_softmax: mask_type 0 expects a 2-D mask [L, S], got ", mask_in.sizes());
    mask = mask_in.expand(input.sizes());
  } else if (mask_type.has_value() && *mask_type == 1) {
    TORCH_CHECK(input.dim() == 4 && mask_in.dim() == 2 && mask_in.size(0) == input.size(0) &&
                    mask_in.size(1) == input.size(3),
                "_masked_softmax: mask_type 1 expects a mask [B, S] for input [B, H, L, S], got ", mask_in.sizes(),
                " for ", input.sizes());
    mask = mask_in.view({input.size(0), 1, 1, input.size(3)}).expand(input.sizes());
  } else if (mask_type.has_value() && *mask_type == 2) {
    TORCH_CHECK(mask_in.sizes() == input.sizes(), "Mask shape should match input. mask: ", mask_in.sizes(),
                " input: ", input.sizes());
    mask = mask_in;
  } else {
    TORCH_CHECK(!mask_type.has_value(), "_masked_softmax: unknown mask_type ", *mask_type);
    TORCH_CHECK(mask_in.sizes() == input.sizes(), "Mask Type should be defined");
    mask = mask_in;
  }
  const bool reduced = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  at::Tensor x = reduced ? input.to(at::kFloat) : input;
  at::Tensor out = at::softmax(x.masked_fill(mask, -std::numeric_limits<double>::infinity()), dim);
  return reduced ? out.to(input.scalar_type()) : out;
}

std::tuple<at::Tensor, at::Tensor> NativeMultiHeadAttention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t embed_dim, int64_t num_head,
    const at::Tensor& qkv_weight, const at::Tensor& qkv_bias, const at::Tensor& proj_weight,
    const at::Tensor& proj_bias, const std::optional<at::Tensor>& mask, bool need_weights,
    bool average_attn_weights, std::optional<int64_t> mask_type) {
  CheckNotNested(query, "_native_multi_head_attention");
  CheckNotNested(key, "_native_multi_head_attention");
  CheckNotNested(value, "_native_multi_head_attention");
  const int64_t D = embed_dim;
  TORCH_CHECK(query.dim() == 3, "expected 3-D `query`, got ", query.dim(), "-D tensor");
  TORCH_CHECK(query.size(2) == embed_dim, "passed-in embed_dim ", embed_dim, " didn't match last dim of query ",
              query.size(2));
  TORCH_CHECK(key.dim() == 3, "expected 3-D `key`, got ", key.dim(), "-D tensor");
  TORCH_CHECK(value.dim() == 3, "expected 3-D `value`, got ", value.dim(), "-D tensor");
  TORCH_CHECK(query.sizes() == key.sizes() && key.sizes() == value.sizes(),
              "expected `query`/`key`/`value` shapes to match");
  TORCH_CHECK(qkv_weight.dim() == 2, "expected 2-D `qkv_weight`, got ", qkv_weight.dim(), "-D tensor");
  TORCH_CHECK(D * 3 == qkv_weight.size(0), "expected `qkv_weight` first dim to be 3x embed_dim");
  TORCH_CHECK(D == qkv_weight.size(1), "expected `qkv_weight` second dim to be embed_Dim");
  TORCH_CHECK(qkv_bias.dim() == 1, "expected 1-D `qkv_bias`, got ", qkv_bias.dim(), "-D tensor");
  TORCH_CHECK(qkv_bias.size(0) == 3 * D, "expected `qkv_bias` first dim and first dim of query to be equal");
  TORCH_CHECK(num_head > 0 && D % num_head == 0, "`embed_dim` must divide evenly by `num_heads`");

  // qkv [B, T, 3D] (attention.cpp's qkv_projection: one matmul for
  // self-attention, split weights otherwise).
  at::Tensor qkv;
  if (key.is_same(value) && query.is_same(key)) {
    qkv = at::matmul(query, qkv_weight.t());
  } else if (key.is_same(value)) {
    auto w = qkv_weight.split_with_sizes({D, 2 * D}, 0);
    qkv = at::cat({at::matmul(query, w[0].t()), at::matmul(key, w[1].t())}, 2);
  } else {
    auto w = qkv_weight.chunk(3, 0);
    qkv = at::cat({at::matmul(query, w[0].t()), at::matmul(key, w[1].t()), at::matmul(value, w[2].t())}, 2);
  }
  if (qkv.numel() == 0) return {at::empty_like(query), at::Tensor()};

  auto [q, k, v] = at::_transform_bias_rescale_qkv(qkv, qkv_bias, num_head);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), dh = q.size(3);
  // [B, H, T, T]
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));
  if (mask.has_value() && mask->defined()) {
    at::Tensor m = mask->scalar_type() == at::kBool ? *mask : mask->to(at::kBool);
    scores = at::_masked_softmax(scores, m, scores.dim() - 1, mask_type);
  } else {
    scores = at::softmax(scores, scores.dim() - 1);
  }
  at::Tensor ctx = at::matmul(scores, v);                                  // [B, H, T, dh]
  at::Tensor merged = ctx.permute({0, 2, 1, 3}).reshape({B, T, H * dh});  // transform_0213
  at::Tensor proj = at::linear(merged, proj_weight, proj_bias);
  at::Tensor weights;
  if (need_weights) {
    weights = average_attn_weights ? scores.sum(1) / static_cast<double>(num_head) : scores;
  }
  return {proj, weights};
}

at::Tensor TransformerEncoderLayerFwd(
    const at::Tensor& src, int64_t embed_dim, int64_t num_heads, const at::Tensor& qkv_weight,
    const at::Tensor& qkv_bias, const at::Tensor& proj_weight, const at::Tensor& proj_bias, bool use_gelu,
    bool norm_first, double eps, const at::Tensor& norm_weight_1, const at::Tensor& norm_bias_1,
    const at::Tensor& norm_weight_2, const at::Tensor& norm_bias_2, const at::Tensor& ffn_weight_1,
    const at::Tensor& ffn_bias_1, const at::Tensor& ffn_weight_2, const at::Tensor& ffn_bias_2,
    const std::optional<at::Tensor>& mask, std::optional<int64_t> mask_type) {
  CheckNotNested(src, "_transformer_encoder_layer_fwd");
  if (src.numel() == 0) return src.clone();
  TORCH_CHECK(src.dim() == 3, "batched input size should be 3");
  TORCH_CHECK(ffn_weight_1.dim() == 2 && ffn_weight_2.dim() == 2, "2d weights expected");
  auto norm = [&](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    return at::layer_norm(x, {embed_dim}, w, b, eps);
  };
  at::Tensor x = norm_first ? norm(src, norm_weight_1, norm_bias_1) : src;
  x = std::get<0>(at::_native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias,
                                                   proj_weight, proj_bias, mask, /*need_weights=*/false,
                                                   /*average_attn_weights=*/true, mask_type));
  x = x + src;
  if (!norm_first) x = norm(x, norm_weight_1, norm_bias_1);
  at::Tensor pre_ffn = x;
  if (norm_first) x = norm(x, norm_weight_2, norm_bias_2);
  at::Tensor h = at::linear(x, ffn_weight_1, ffn_bias_1);
  h = use_gelu ? at::gelu(h) : at::relu(h);
  x = at::linear(h, ffn_weight_2, ffn_bias_2) + pre_ffn;
  if (!norm_first) x = norm(x, norm_weight_2, norm_bias_2);
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_transform_bias_rescale_qkv", TransformBiasRescaleQkv);
  m.impl("_masked_softmax", MaskedSoftmax);
  m.impl("_native_multi_head_attention", NativeMultiHeadAttention);
  m.impl("_transformer_encoder_layer_fwd", TransformerEncoderLayerFwd);
}

}  // namespace torch_tpu::aten
