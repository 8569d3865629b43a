"""Pooling and upsampling lowerings (csrc/lowering/pool.cpp) against CPU
PyTorch: max_pool2d/3d with indices (+backward), avg_pool2d/3d (+backward;
ceil_mode, count_include_pad, divisor_override), adaptive avg/max pooling
(+backward), nearest / nearest-exact / (bi,tri)linear / bicubic upsampling
(+backward).

float32 is compared with assert_close defaults, bfloat16 with an explicit
tolerance; max-pool indices exactly. Each test checks that none of these
ops ran through the CPU fallback.
"""

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from conftest import family_helpers

TPU = torch.device("tpu")
BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)
OURS = set("""
max_pool2d_with_indices max_pool2d_with_indices_backward max_pool3d_with_indices
max_pool3d_with_indices_backward avg_pool2d avg_pool2d_backward avg_pool3d avg_pool3d_backward
_adaptive_avg_pool2d _adaptive_avg_pool2d_backward _adaptive_avg_pool3d _adaptive_avg_pool3d_backward
adaptive_max_pool2d adaptive_max_pool2d_backward adaptive_max_pool3d adaptive_max_pool3d_backward
upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d
_upsample_nearest_exact2d _upsample_nearest_exact3d upsample_nearest1d_backward
upsample_nearest2d_backward upsample_nearest3d_backward _upsample_nearest_exact1d_backward
_upsample_nearest_exact2d_backward _upsample_nearest_exact3d_backward upsample_linear1d
upsample_bilinear2d upsample_trilinear3d upsample_linear1d_backward upsample_bilinear2d_backward
upsample_trilinear3d_backward upsample_bicubic2d upsample_bicubic2d_backward
""".split())


no_fallback, tpu, check = family_helpers(OURS, BF16_TOL)


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def run_both(fn, *args, **tol):
    expected = fn(*args)
    with no_fallback():
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected, **tol)
    return actual


def grads_both(fn, *args, **tol):
    cpu_args = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
    out_c = fn(*cpu_args)
    up = make(out_c.shape, out_c.dtype, seed=99)
    out_c.backward(up)
    tpu_args = [tpu(a).requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else tpu(a)
                for a in args]
    with no_fallback():
        out_t = fn(*tpu_args)
        out_t.backward(tpu(up))
    check(out_t, out_c.detach(), **tol)
    for c, t in zip(cpu_args, tpu_args):
        if isinstance(c, torch.Tensor) and c.requires_grad:
            check(t.grad, c.grad, **tol)


# --- max pool ------------------------------------------------------------------

# (kernel, stride, padding, dilation, ceil_mode)
MAX_CASES = [
    (2, None, 0, 1, False),
    (3, 2, 1, 1, False),
    (3, 2, 1, 1, True),
    ((3, 2), (2, 1), (1, 0), (2, 1), False),
    (2, 3, 1, 2, True),
]


@pytest.mark.parametrize("case", MAX_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pool2d_with_indices(case, dtype):
    k, s, p, d, ceil = case
    x = make((2, 3, 9, 8), dtype)
    run_both(lambda a: F.max_pool2d(a, k, s, p, d, ceil, return_indices=True), x)


def test_max_pool2d_ties_nan_inf_and_unbatched():
    x = torch.tensor([[[1.0, 1.0, 0.0, 2.0],
                       [1.0, 1.0, 2.0, 2.0],
                       [float("nan"), 0.0, float("-inf"), float("-inf")],
                       [3.0, float("nan"), float("-inf"), float("-inf")]]])
    run_both(lambda a: F.max_pool2d(a, 2, return_indices=True), x)
    run_both(lambda a: F.max_pool2d(a, 3, 1, 1, return_indices=True), x)
    run_both(lambda a: F.max_pool2d(a, 2, 1), x.expand(2, 4, 4))  # non-contiguous, no indices


def test_max_pool1d_and_3d():
    run_both(lambda a: F.max_pool1d(a, 3, 2, 1, return_indices=True), make((2, 3, 11)))
    run_both(lambda a: F.max_pool3d(a, 2, 2, 1, ceil_mode=True, return_indices=True), make((2, 2, 5, 6, 7)))
    run_both(lambda a: F.max_pool3d(a, (3, 2, 2), (1, 2, 2), dilation=(1, 2, 1), return_indices=True),
             make((2, 5, 7, 6)))


@pytest.mark.parametrize("case", MAX_CASES)
def test_max_pool2d_backward(case):
    k, s, p, d, ceil = case
    grads_both(lambda a: F.max_pool2d(a, k, s, p, d, ceil), make((2, 3, 9, 8)))


def test_max_pool_backward_overlapping_and_3d():
    # Overlapping windows share maxima: gradients accumulate.
    x = torch.tensor([[[[1.0, 5.0, 1.0], [1.0, 1.0, 1.0], [4.0, 1.0, 9.0]]]])
    grads_both(lambda a: F.max_pool2d(a, 2, 1), x)
    grads_both(lambda a: F.max_pool3d(a, 2, 2, 1, ceil_mode=True), make((1, 2, 5, 6, 7)))
    grads_both(lambda a: F.max_pool1d(a, 3, 2), make((2, 3, 11)))


def test_max_pool_backward_bf16():
    grads_both(lambda a: F.max_pool2d(a, 3, 2, 1), make((2, 3, 8, 8), torch.bfloat16))


def test_max_pool_out_variant():
    x = make((2, 3, 8, 8))
    ev, ei = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    ov = torch.empty(ev.shape, device=TPU)
    oi = torch.empty(ei.shape, dtype=torch.long, device=TPU)
    with no_fallback():
        torch.ops.aten.max_pool2d_with_indices.out(tpu(x), [2, 2], [2, 2], out=ov, indices=oi)
    check(ov, ev)
    check(oi, ei)


# --- avg pool ------------------------------------------------------------------

# (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_CASES = [
    (2, None, 0, False, True, None),
    (3, 2, 1, False, True, None),
    (3, 2, 1, False, False, None),
    (3, 2, 1, True, True, None),
    (3, 2, 1, True, False, None),
    ((3, 2), (2, 3), (1, 1), True, False, None),
    (3, 2, 1, False, True, 5),
]


@pytest.mark.parametrize("case", AVG_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avg_pool2d(case, dtype):
    k, s, p, ceil, inc, div = case
    run_both(lambda a: F.avg_pool2d(a, k, s, p, ceil, inc, div), make((2, 3, 9, 8), dtype))


@pytest.mark.parametrize("case", AVG_CASES)
def test_avg_pool2d_backward(case):
    k, s, p, ceil, inc, div = case
    grads_both(lambda a: F.avg_pool2d(a, k, s, p, ceil, inc, div), make((2, 3, 9, 8)))


def test_avg_pool1d_3d_unbatched():
    grads_both(lambda a: F.avg_pool1d(a, 3, 2, 1, True, False), make((2, 3, 10)))
    grads_both(lambda a: F.avg_pool3d(a, 3, 2, 1, True, False), make((2, 2, 5, 6, 7)))
    grads_both(lambda a: F.avg_pool3d(a, (2, 3, 2), 1, (1, 1, 0), divisor_override=4), make((2, 4, 5, 6)))
    grads_both(lambda a: F.avg_pool2d(a, 2), make((3, 6, 6)))


# --- adaptive pools ------------------------------------------------------------

@pytest.mark.parametrize("out", [(1, 1), (3, 3), (4, 5), (2, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adaptive_avg_pool2d(out, dtype):
    run_both(lambda a: F.adaptive_avg_pool2d(a, out), make((2, 3, 7, 9), dtype))


@pytest.mark.parametrize("out", [(1, 1), (3, 3), (4, 5)])
def test_adaptive_avg_pool2d_backward(out):
    grads_both(lambda a: F.adaptive_avg_pool2d(a, out), make((2, 3, 7, 9)))


def test_adaptive_avg_pool3d():
    grads_both(lambda a: F.adaptive_avg_pool3d(a, (2, 3, 4)), make((2, 2, 5, 7, 6)))
    grads_both(lambda a: F.adaptive_avg_pool3d(a, 1), make((2, 4, 4, 4)))


@pytest.mark.parametrize("out", [(1, 1), (3, 3), (4, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adaptive_max_pool2d(out, dtype):
    run_both(lambda a: F.adaptive_max_pool2d(a, out, return_indices=True), make((2, 3, 7, 9), dtype))


def test_adaptive_max_pool_backward_and_3d():
    grads_both(lambda a: F.adaptive_max_pool2d(a, (3, 4)), make((2, 3, 7, 9)))
    grads_both(lambda a: F.adaptive_max_pool3d(a, (2, 3, 2)), make((1, 2, 5, 7, 6)))
    x = torch.tensor([[[1.0, float("nan"), 2.0], [2.0, 2.0, float("nan")], [0.0, 0.0, 0.0]]])
    run_both(lambda a: F.adaptive_max_pool2d(a, 2, return_indices=True), x)


# --- upsampling ----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize("kw", [dict(size=(7, 5)), dict(scale_factor=2), dict(scale_factor=(1.7, 0.6)),
                                dict(size=(4, 6))])
def test_upsample_nearest2d(mode, kw):
    run_both(lambda a: F.interpolate(a, mode=mode, **kw), make((2, 3, 4, 6)))
    grads_both(lambda a: F.interpolate(a, mode=mode, **kw), make((2, 3, 4, 6)))


def test_upsample_nearest_1d_3d_bf16():
    for mode in ["nearest", "nearest-exact"]:
        grads_both(lambda a: F.interpolate(a, size=9, mode=mode), make((2, 3, 5)))
        grads_both(lambda a: F.interpolate(a, scale_factor=(2, 1.5, 0.5), mode=mode), make((1, 2, 3, 4, 6)))
        run_both(lambda a: F.interpolate(a, size=(5, 9), mode=mode), make((2, 3, 4, 6), torch.bfloat16))


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("kw", [dict(size=(7, 5)), dict(scale_factor=2), dict(scale_factor=(1.7, 0.6)),
                                dict(size=(1, 6)), dict(size=(4, 6))])
def test_upsample_bilinear2d(align_corners, kw):
    grads_both(lambda a: F.interpolate(a, mode="bilinear", align_corners=align_corners, **kw), make((2, 3, 4, 6)))


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("kw", [dict(size=(7, 5)), dict(scale_factor=2), dict(scale_factor=(1.7, 0.6)),
                                dict(size=(1, 6)), dict(size=(4, 6))])
def test_upsample_bicubic2d(align_corners, kw):
    grads_both(lambda a: F.interpolate(a, mode="bicubic", align_corners=align_corners, **kw), make((2, 3, 4, 6)))
    run_both(lambda a: F.interpolate(a, mode="bicubic", align_corners=align_corners, **kw),
             make((2, 3, 4, 6), torch.bfloat16))


@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_linear_trilinear_bf16(align_corners):
    grads_both(lambda a: F.interpolate(a, size=11, mode="linear", align_corners=align_corners), make((2, 3, 5)))
    grads_both(lambda a: F.interpolate(a, size=(3, 5, 8), mode="trilinear", align_corners=align_corners),
               make((1, 2, 2, 4, 6)))
    run_both(lambda a: F.interpolate(a, scale_factor=1.5, mode="bilinear", align_corners=align_corners),
             make((2, 3, 4, 6), torch.bfloat16))
    # channels-last input (non-contiguous strides)
    x = make((2, 4, 6, 3)).permute(0, 3, 1, 2)
    run_both(lambda a: F.interpolate(a, size=(9, 7), mode="bilinear", align_corners=align_corners), x)


def test_upsample_out_variant():
    x = make((2, 3, 4, 6))
    expected = torch.ops.aten.upsample_bilinear2d(x, [7, 9], False)
    out = torch.empty(expected.shape, device=TPU)
    with no_fallback():
        torch.ops.aten.upsample_bilinear2d.out(tpu(x), [7, 9], False, out=out)
    check(out, expected)


# --- max_unpool2d / max_unpool3d (issue 3) ---------------------------------------

from conftest import no_cpu_fallback  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("batched", [True, False])
def test_max_unpool2d(dtype, batched):
    x = make((2, 3, 8, 8) if batched else (3, 8, 8))
    v, i = F.max_pool2d(x, 2, return_indices=True)
    v = v.to(dtype)
    for size in [None, (8, 8), (9, 9)]:
        expected = F.max_unpool2d(v, i, 2, output_size=size)
        with no_cpu_fallback():
            actual = F.max_unpool2d(tpu(v), tpu(i), 2, output_size=size)
        check(actual, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_unpool3d_and_1d(dtype):
    x = make((2, 2, 4, 6, 5))
    v, i = F.max_pool3d(x, 2, stride=(2, 2, 1), return_indices=True)
    v = v.to(dtype)
    expected = F.max_unpool3d(v, i, 2, stride=(2, 2, 1))
    with no_cpu_fallback():
        actual = F.max_unpool3d(tpu(v), tpu(i), 2, stride=(2, 2, 1))
    check(actual, expected, atol=0, rtol=0)
    x1 = make((2, 3, 9))
    v1, i1 = F.max_pool1d(x1, 3, return_indices=True)
    with no_cpu_fallback():
        check(F.max_unpool1d(tpu(v1.to(dtype)), tpu(i1), 3), F.max_unpool1d(v1.to(dtype), i1, 3), atol=0, rtol=0)


def test_max_unpool_duplicate_indices_pick_one_written_value():
    # Several inputs naming one output element: PyTorch leaves the winner
    # unspecified (CPU's parallel loop keeps one of them); tpu keeps the last
    # in input order, deterministically. Elements nobody names are 0.
    v = torch.tensor([[[[1.0, 2.0, 3.0, 4.0, 5.0]]]])
    i = torch.tensor([[[[0, 0, 3, 3, 0]]]])
    # A key's first calls are host-served (CPU's kernel: CPU's winner, any
    # of the allowed); from the third on the device program runs.
    with no_cpu_fallback():
        for _ in range(3):
            actual = F.max_unpool2d(tpu(v), tpu(i), (1, 2), output_size=(1, 10)).cpu()
            assert actual[..., 0].item() in (1.0, 2.0, 5.0) and actual[..., 3].item() in (3.0, 4.0)
            torch_tpu.metrics()  # waits for the background compile
    expected = torch.zeros(1, 1, 1, 10)
    expected[..., 0], expected[..., 3] = 5.0, 4.0
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    cpu = F.max_unpool2d(v, i, (1, 2), output_size=(1, 10))
    assert cpu[..., 0].item() in (1.0, 2.0, 5.0) and cpu[..., 3].item() in (3.0, 4.0)


def test_max_unpool_out_and_backward():
    x = make((1, 2, 6, 6))
    v, i = F.max_pool2d(x, 2, return_indices=True)
    out = torch.empty(1, 2, 6, 6, device=TPU)
    with no_cpu_fallback():
        torch._C._nn.max_unpool2d(tpu(v), tpu(i), [6, 6], out=out)
    check(out, F.max_unpool2d(v, i, 2), atol=0, rtol=0)
    vc = v.clone().requires_grad_()
    vt = tpu(v).requires_grad_()
    g = make((1, 2, 6, 6), seed=3)
    F.max_unpool2d(vc, i, 2).backward(g)
    with no_cpu_fallback():
        F.max_unpool2d(vt, tpu(i), 2).backward(tpu(g))
    check(vt.grad, vc.grad, atol=0, rtol=0)
    v3, i3 = F.max_pool3d(make((1, 1, 4, 4, 4)), 2, return_indices=True)
    vc, vt = v3.clone().requires_grad_(), tpu(v3).requires_grad_()
    g3 = make((1, 1, 4, 4, 4), seed=4)
    F.max_unpool3d(vc, i3, 2).backward(g3)
    with no_cpu_fallback():
        F.max_unpool3d(vt, tpu(i3), 2).backward(tpu(g3))
    check(vt.grad, vc.grad, atol=0, rtol=0)


def test_max_unpool_integer_input_raises_like_cpu():
    v = torch.ones(1, 1, 2, 2, dtype=torch.long)
    i = torch.zeros(1, 1, 2, 2, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="Long"):
        F.max_unpool2d(v, i, 2)
    with pytest.raises(NotImplementedError, match="Long"):
        F.max_unpool2d(tpu(v), tpu(i), 2)


@pytest.mark.parametrize("mode", ["strict", "debug", "fused"])
def test_max_unpool_invalid_index_raises_like_cpu(mode):
    # CPU raises "Found an invalid max index"; on tpu the check runs on the
    # device and raises at the next sync point (debug mode: at the op).
    x, bad = torch.ones(1, 1, 1, 1), torch.tensor([[[[99]]]])
    with pytest.raises(RuntimeError, match="Found an invalid max index"):
        torch.nn.functional.max_unpool2d(x, bad, 2)
    with torch_tpu.eager_mode(mode):
        with pytest.raises(RuntimeError, match="Found an invalid max index"):
            torch.nn.functional.max_unpool2d(x.to("tpu"), bad.to("tpu"), 2).cpu()
        # the device keeps working, and valid indices are not flagged
        good = torch.tensor([[[[3]]]])
        torch.testing.assert_close(torch.nn.functional.max_unpool2d(x.to("tpu"), good.to("tpu"), 2).cpu(),
                                   torch.nn.functional.max_unpool2d(x, good, 2))
