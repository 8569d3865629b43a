"""Convolution lowerings (csrc/lowering/conv.cpp) against CPU PyTorch:
aten::convolution (1d/2d/3d, stride, padding, dilation, groups, transposed
with output_padding) and convolution_backward.

float32 is compared with assert_close defaults, bfloat16 with an explicit
tolerance. Each test checks that none of these ops ran through the CPU
fallback (except where a known runtime limitation is named).
"""

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from conftest import family_helpers

TPU = torch.device("tpu")
BF16_TOL = dict(atol=5e-2, rtol=1.6e-2)  # bf16 inputs, f32 accumulation, one rounding
# Gradients sum hundreds of products (over batch and space) in an order that
# differs from oneDNN's (XLA CPU sums sequentially, PyTorch pairwise): with
# cancellation the float32 results differ by ~1e-4 on sums of thousands of terms.
GRAD_TOL = dict(atol=3e-4, rtol=1e-5)
OURS = {"convolution", "convolution_backward", "convolution_overrideable",
        "convolution_backward_overrideable"}



no_fallback, tpu, check = family_helpers(OURS, BF16_TOL)


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def run_both(fn, *args, names=OURS, **tol):
    expected = fn(*args)
    with no_fallback(names):
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected, **tol)
    return actual


def grads_both(fn, *args, names=OURS, **tol):
    """Forward + backward (with a non-uniform upstream gradient) on CPU and
    tpu; compares the output and the grads of every floating argument."""
    cpu_args = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
    out_c = fn(*cpu_args)
    up = make(out_c.shape, out_c.dtype, seed=99)
    out_c.backward(up)
    tpu_args = [tpu(a).requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else tpu(a)
                for a in args]
    with no_fallback(names):
        out_t = fn(*tpu_args)
        out_t.backward(tpu(up))
    check(out_t, out_c.detach(), **tol)
    for c, t in zip(cpu_args, tpu_args):
        if isinstance(c, torch.Tensor) and c.requires_grad:
            check(t.grad, c.grad, **tol)


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
SPATIAL = {1: (9,), 2: (7, 6), 3: (6, 5, 7)}

# (stride, padding, dilation, groups)
FORWARD_CASES = [
    (1, 0, 1, 1),
    (2, 1, 1, 1),
    (1, 2, 2, 1),
    (2, 1, 1, 2),
    (3, 0, 2, 4),
]


def _conv_args(nd, groups, dtype=torch.float32, cin=4, cout=8, k=3, bias=True):
    x = make((2, cin) + SPATIAL[nd], dtype)
    w = make((cout, cin // groups) + (k,) * nd, dtype, seed=1)
    b = make((cout,), dtype, seed=2) if bias else None
    return x, w, b


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_conv_forward(nd, case):
    stride, padding, dilation, groups = case
    x, w, b = _conv_args(nd, groups)
    run_both(lambda x, w, b: CONV[nd](x, w, b, stride, padding, dilation, groups), x, w, b)


@pytest.mark.parametrize("nd", [1, 2])
def test_conv_forward_bf16(nd):
    x, w, b = _conv_args(nd, 2, torch.bfloat16)
    run_both(lambda x, w, b: CONV[nd](x, w, b, 2, 1, 1, 2), x, w, b)


def test_conv_int64_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-5, 5, (2, 4, 7, 6), generator=g)
    w = torch.randint(-5, 5, (6, 2, 3, 3), generator=g)
    b = torch.randint(-5, 5, (6,), generator=g)
    run_both(lambda x, w, b: F.conv2d(x, w, b, 2, 1, 1, 2), x, w, b, atol=0, rtol=0)
    wt = torch.randint(-5, 5, (4, 3, 3, 3), generator=g)
    run_both(lambda x, w: F.conv_transpose2d(x, w, None, 2, 1, 1), x, wt, atol=0, rtol=0)


def test_conv2d_asymmetric_params_and_no_bias():
    x = make((2, 3, 9, 8))
    w = make((5, 3, 3, 2), seed=1)
    run_both(lambda x, w: F.conv2d(x, w, None, (2, 1), (1, 0), (1, 2)), x, w)
    run_both(lambda x, w: F.conv2d(x, w, None, 1, "same", (2, 1)), x, w)
    run_both(lambda x, w: F.conv2d(x, w, None, 1, "valid"), x, w)


def test_conv2d_noncontiguous_and_unbatched():
    x = make((2, 6, 5, 3)).permute(0, 3, 1, 2)  # (2, 3, 6, 5), channels-last strides
    w = make((4, 3, 2, 2), seed=1)[:, :, :, :]
    run_both(lambda x, w: F.conv2d(x, w, stride=1, padding=1), x, w)
    run_both(lambda x, w: F.conv2d(x, w), make((3, 5, 5)), w)  # unbatched
    run_both(lambda x, w: F.conv2d(x, w.transpose(2, 3)), x, w)


def test_convolution_out_variant():
    x, w, b = _conv_args(2, 1)
    expected = torch.ops.aten.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    out = torch.empty(expected.shape, device=TPU)
    with no_fallback():
        r = torch.ops.aten.convolution.out(tpu(x), tpu(w), tpu(b), [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                           out=out)
    assert r is out
    check(out, expected)


# (stride, padding, output_padding, dilation, groups)
TRANSPOSED_CASES = [
    (1, 0, 0, 1, 1),
    (2, 1, 1, 1, 1),
    (2, 0, 0, 2, 2),
    (3, 1, 2, 1, 4),
    (1, 3, 0, 1, 1),  # padding > dilation*(k-1): negative internal padding
    (2, 2, 1, 2, 2),
]


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_conv_transposed_forward(nd, case):
    stride, padding, output_padding, dilation, groups = case
    x = make((2, 4) + SPATIAL[nd])
    w = make((4, 8 // groups) + (3,) * nd, seed=1)
    b = make((8,), seed=2)
    run_both(lambda x, w, b: CONV_T[nd](x, w, b, stride, padding, output_padding, groups, dilation), x, w, b)


def test_conv_transposed_bf16():
    x = make((2, 4, 5, 5), torch.bfloat16)
    w = make((4, 3, 3, 3), torch.bfloat16, seed=1)
    run_both(lambda x, w: F.conv_transpose2d(x, w, None, 2, 1, 1), x, w)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_conv_backward(nd, case):
    stride, padding, dilation, groups = case
    x, w, b = _conv_args(nd, groups)
    grads_both(lambda x, w, b: CONV[nd](x, w, b, stride, padding, dilation, groups), x, w, b, **GRAD_TOL)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_conv_transposed_backward(nd, case):
    stride, padding, output_padding, dilation, groups = case
    x = make((2, 4) + SPATIAL[nd])
    w = make((4, 8 // groups) + (3,) * nd, seed=1)
    b = make((8,), seed=2)
    grads_both(lambda x, w, b: CONV_T[nd](x, w, b, stride, padding, output_padding, groups, dilation), x, w, b,
               **GRAD_TOL)


def test_conv_transposed_backward_large_output_padding():
    # The gradient's forward convolution covers the output_padding rows too
    # (one more input row than there is): the extra row is dropped.
    x = make((2, 2, 4, 4))
    w = make((2, 2, 4, 5), seed=1)
    b = make((4,), seed=2)
    grads_both(lambda x, w, b: F.conv_transpose2d(x, w, b, (3, 2), (1, 2), (2, 3), 2, (4, 4)), x, w, b, **GRAD_TOL)
    grads_both(lambda x, w: F.conv_transpose1d(x, w, None, 3, 0, 2, 1, 1), make((2, 3, 5)), make((3, 2, 2), seed=3),
               **GRAD_TOL)


def test_conv_backward_bf16():
    x, w, b = _conv_args(2, 2, torch.bfloat16)
    grads_both(lambda x, w, b: F.conv2d(x, w, b, 2, 1, 1, 2), x, w, b, atol=0.1, rtol=2e-2)


def test_conv_backward_partial_mask():
    # No bias (output_mask [True, True, False]); weight-only gradients
    # ([False, True, False]): the undefined returns stay undefined.
    x, w, _ = _conv_args(2, 1)
    grads_both(lambda x, w: F.conv2d(x, w, None, 2, 1), x, w, **GRAD_TOL)
    wt = w.clone().requires_grad_()
    wt_t = tpu(w).requires_grad_()
    F.conv2d(x, wt, None, 1, 1).sum().backward()
    with no_fallback():
        F.conv2d(tpu(x), wt_t, None, 1, 1).sum().backward()
    check(wt_t.grad, wt.grad, **GRAD_TOL)


def test_convolution_backward_direct():
    x, w, _ = _conv_args(2, 2)
    gy = make((2, 8, 4, 3), seed=5)
    args = ([2, 2], [1, 1], [1, 1], False, [0, 0], 2, [True, True, True])
    expected = torch.ops.aten.convolution_backward(gy, x, w, [8], *args)
    with no_fallback():
        actual = torch.ops.aten.convolution_backward(tpu(gy), tpu(x), tpu(w), [8], *args)
    check(actual, expected, **GRAD_TOL)


def test_conv_module_training_step():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(6, 4, 3, stride=2, groups=2))
    mt = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.ReLU(),
                             torch.nn.Conv2d(6, 4, 3, stride=2, groups=2))
    mt.load_state_dict(m.state_dict())
    mt.to(TPU)
    x = make((2, 3, 8, 8)).requires_grad_()
    xt = tpu(x.detach()).requires_grad_()
    m(x).square().sum().backward()
    with no_fallback():
        mt(xt).square().sum().backward()
    check(xt.grad, x.grad, atol=1e-4, rtol=1e-4)
    for p, pt in zip(m.parameters(), mt.parameters()):
        check(pt.grad, p.grad, atol=1e-4, rtol=1e-4)
