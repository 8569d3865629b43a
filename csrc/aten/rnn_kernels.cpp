// Kernels for the tpu key of the fused RNN cells that ATen's LSTM/GRU
// (aten/src/ATen/native/RNN.cpp) picks for accelerator devices, CUDA and
// PrivateUse1 alike (use_thnn_fused_lstm_cell): _thnn_fused_lstm_cell,
// _thnn_fused_lstm_cell_backward_impl, _thnn_fused_gru_cell and
// _thnn_fused_gru_cell_backward. They have no CPU kernel, so without these
// nn.LSTM, nn.GRU, LSTMCell and GRUCell could not run on tpu at all (the CPU
// fallback has nothing to call). Each is composed of lowered pointwise ops
// (fused eager mode records a step as one region).
//
// Math (the CUDA kernels' formulas, aten/src/ATen/native/cuda/RNN.cu; gate
// order as RNN.cpp's LSTMCell/GRUCell chunk them):
//   LSTM: gates = input_gates + hidden_gates (+ input_bias + hidden_bias),
//         split [B, 4H] into i, f, g, o;  i, f, o = sigmoid, g = tanh
//         cy = f * cx + i * g;  hy = o * tanh(cy)
//         workspace [B, 4H] = (i, f, g, o) after activation
//   GRU:  split input_gates (+ input_bias) into (ir, iz, in) and
//         hidden_gates (+ hidden_bias) into (hr, hz, hn), [B, H] each:
//         r = sigmoid(ir + hr), z = sigmoid(iz + hz), n = tanh(in + r * hn)
//         hy = n + z * (hx - n)
//         workspace [B, 5H] = (r, z, n, hx, hn)
// The backward kernels differentiate these; the workspace layout is this
// file's own (only these kernels read it). Autograd uses them when grad
// mode is off during backward (the usual .backward()); with create_graph
// PyTorch differentiates through _thnn_differentiable_*_cell_backward, a
// composite of ordinary ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace torch_tpu::aten {
namespace {

at::Tensor AddBias(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  return bias && bias->defined() ? x + *bias : x;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> FusedLstmCell(const at::Tensor& input_gates,
                                                             const at::Tensor& hidden_gates, const at::Tensor& cx,
                                                             const std::optional<at::Tensor>& input_bias,
                                                             const std::optional<at::Tensor>& hidden_bias) {
  TORCH_CHECK(input_gates.sizes() == hidden_gates.sizes() && input_gates.dim() == 2 &&
                  input_gates.size(1) == 4 * cx.size(-1),
              "_thnn_fused_lstm_cell: expected input_gates and hidden_gates of shape [B, 4H] with cx [B, H], got ",
              input_gates.sizes(), ", ", hidden_gates.sizes(), " and ", cx.sizes());
  at::Tensor gates = AddBias(AddBias(input_gates + hidden_gates, input_bias), hidden_bias);
  auto chunks = gates.chunk(4, 1);
  at::Tensor i = chunks[0].sigmoid(), f = chunks[1].sigmoid(), g = chunks[2].tanh(), o = chunks[3].sigmoid();
  at::Tensor cy = f * cx + i * g;
  at::Tensor hy = o * cy.tanh();
  return {hy, cy, at::cat({i, f, g, o}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> FusedLstmCellBackward(const std::optional<at::Tensor>& grad_hy,
                                                                     const std::optional<at::Tensor>& grad_cy,
                                                                     const at::Tensor& cx, const at::Tensor& cy,
                                                                     const at::Tensor& workspace, bool has_bias) {
  const bool has_hy = grad_hy && grad_hy->defined(), has_cy = grad_cy && grad_cy->defined();
  if (!has_hy && !has_cy) return {at::Tensor(), at::Tensor(), at::Tensor()};
  auto gates = workspace.chunk(4, 1);
  const at::Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  at::Tensor tanh_cy = cy.tanh();
  at::Tensor ghy = has_hy ? *grad_hy : at::zeros_like(cy);
  at::Tensor gcx = ghy * o * (1 - tanh_cy * tanh_cy);
  if (has_cy) gcx = gcx + *grad_cy;
  at::Tensor d_o = ghy * tanh_cy * o * (1 - o);
  at::Tensor d_i = gcx * g * i * (1 - i);
  at::Tensor d_f = gcx * cx * f * (1 - f);
  at::Tensor d_g = gcx * i * (1 - g * g);
  at::Tensor grad_gates = at::cat({d_i, d_f, d_g, d_o}, 1);
  at::Tensor grad_cx = gcx * f;
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {grad_gates, grad_cx, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> FusedGruCell(const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                                                const at::Tensor& hx, const std::optional<at::Tensor>& input_bias,
                                                const std::optional<at::Tensor>& hidden_bias) {
  TORCH_CHECK(input_gates.sizes() == hidden_gates.sizes() && input_gates.dim() == 2 &&
                  input_gates.size(1) == 3 * hx.size(-1),
              "_thnn_fused_gru_cell: expected input_gates and hidden_gates of shape [B, 3H] with hx [B, H], got ",
              input_gates.sizes(), ", ", hidden_gates.sizes(), " and ", hx.sizes());
  auto ig = AddBias(input_gates, input_bias).chunk(3, 1);
  auto hg = AddBias(hidden_gates, hidden_bias).chunk(3, 1);
  at::Tensor r = (ig[0] + hg[0]).sigmoid();
  at::Tensor z = (ig[1] + hg[1]).sigmoid();
  at::Tensor n = (ig[2] + r * hg[2]).tanh();
  at::Tensor hy = n + z * (hx - n);
  return {hy, at::cat({r, z, n, hx, hg[2]}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> FusedGruCellBackward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  auto w = workspace.chunk(5, 1);
  const at::Tensor &r = w[0], &z = w[1], &n = w[2], &hx = w[3], &hn = w[4];
  at::Tensor grad_hx = grad_hy * z;
  at::Tensor d_in = grad_hy * (1 - z) * (1 - n * n);  // d(in + r * hn)
  at::Tensor d_z = grad_hy * (hx - n) * z * (1 - z);
  at::Tensor d_r = d_in * hn * r * (1 - r);
  at::Tensor grad_input_gates = at::cat({d_r, d_z, d_in}, 1);
  at::Tensor grad_hidden_gates = at::cat({d_r, d_z, d_in * r}, 1);
  at::Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : at::Tensor();
  return {grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", FusedLstmCell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", FusedLstmCellBackward);
  m.impl("_thnn_fused_gru_cell", FusedGruCell);
  m.impl("_thnn_fused_gru_cell_backward", FusedGruCellBackward);
}

}  // namespace torch_tpu::aten
