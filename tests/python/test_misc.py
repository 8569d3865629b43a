"""Lowerings of csrc/lowering/misc.cpp against CPU PyTorch: group norm
(+backward), reflection/replication padding (+backward), im2col/col2im
(unfold/fold), select/slice/diagonal_scatter, pdist/cdist (+backward),
grid_sampler_2d (+backward), inverse trigonometric/hyperbolic functions and
atan2, embedding_bag (+backward), embedding_renorm_ (max_norm), scalar_tensor,
full_like.

float32 is compared with assert_close defaults (sums of many terms with an
explicit, stated tolerance), bfloat16 with an explicit tolerance, integers
exactly. Each test checks that none of these ops ran through the CPU
fallback (except where a known runtime limitation is named).
"""

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from conftest import family_helpers

TPU = torch.device("tpu")
BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)
SUM_TOL = dict(atol=1e-4, rtol=1e-5)  # reductions over many terms, summed in another order
OURS = set("""
native_group_norm native_group_norm_backward reflection_pad1d reflection_pad2d reflection_pad3d
reflection_pad1d_backward reflection_pad2d_backward reflection_pad3d_backward replication_pad1d
replication_pad2d replication_pad3d replication_pad1d_backward replication_pad2d_backward
replication_pad3d_backward im2col col2im select_scatter slice_scatter diagonal_scatter
_pdist_forward _pdist_backward _cdist_forward _cdist_backward grid_sampler_2d grid_sampler_2d_backward
scalar_tensor full_like asin acos atan atan2 sinh cosh asinh acosh atanh _embedding_bag
_embedding_bag_forward_only _embedding_bag_backward _embedding_bag_dense_backward
_embedding_bag_per_sample_weights_backward
""".split())


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


# --- group norm ------------------------------------------------------------------

@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 4), 3), ((3, 4), 2), ((2, 8, 7), 1), ((2, 4, 3, 2, 2), 4)])
def test_group_norm(shape, groups):
    c = shape[1]
    x, w, b = make(shape) * 2 + 1, make((c,), seed=1), make((c,), seed=2)
    run_both(lambda a, w, b: F.group_norm(a, groups, w, b, eps=1e-5), x, w, b)
    run_both(lambda a: F.group_norm(a, groups), x)
    grads_both(lambda a, w, b: F.group_norm(a, groups, w, b), x, w, b, **SUM_TOL)


def test_group_norm_bf16_and_stats():
    x, w, b = make((2, 6, 4, 4), torch.bfloat16), make((6,), torch.bfloat16, 1), make((6,), torch.bfloat16, 2)
    run_both(lambda a, w, b: F.group_norm(a, 2, w, b), x, w, b)
    xf = make((2, 6, 4, 4))
    expected = torch.ops.aten.native_group_norm(xf, None, None, 2, 6, 16, 3, 1e-5)
    with no_fallback():
        actual = torch.ops.aten.native_group_norm(tpu(xf), None, None, 2, 6, 16, 3, 1e-5)
    check(actual, expected)


def test_group_norm_module_training_step():
    m = torch.nn.GroupNorm(2, 4)
    mt = torch.nn.GroupNorm(2, 4).to(TPU)
    x = make((3, 4, 5))
    grads_both(lambda a: (m(a) if a.device.type == "cpu" else mt(a)).pow(2), x, **SUM_TOL)


def test_group_norm_backward_partial_mask():
    # No weight/bias: output_mask [True, False, False].
    grads_both(lambda a: F.group_norm(a, 2), make((2, 4, 3, 3)), **SUM_TOL)
    # Only the affine parameters need gradients: [False, True, True].
    m = torch.nn.GroupNorm(2, 4)
    mt = torch.nn.GroupNorm(2, 4).to(TPU)
    x = make((2, 4, 3))
    m(x).pow(2).sum().backward()
    with no_fallback():
        mt(tpu(x)).pow(2).sum().backward()
    check(mt.weight.grad, m.weight.grad, **SUM_TOL)
    check(mt.bias.grad, m.bias.grad, **SUM_TOL)


# --- padding ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@pytest.mark.parametrize("shape,pad", [
    ((2, 3, 7), (2, 3)),
    ((3, 7), (3, 0)),
    ((2, 3, 5, 6), (1, 2, 3, 0)),
    ((3, 5, 6), (2, 2, 2, 2)),
    ((1, 2, 4, 5, 3), (1, 1, 2, 0, 3, 1)),
])
def test_reflection_replication_pad(mode, shape, pad):
    x = make(shape)
    run_both(lambda a: F.pad(a, pad, mode=mode), x)
    grads_both(lambda a: F.pad(a, pad, mode=mode), x)
    run_both(lambda a: F.pad(a, pad, mode=mode), x.to(torch.bfloat16))


def test_pad_negative_and_int():
    run_both(lambda a: F.pad(a, (-1, 2), mode="reflect"), make((2, 3, 6)))
    run_both(lambda a: F.pad(a, (2, -1, 1, 1), mode="replicate"), make((1, 2, 4, 5)))
    run_both(lambda a: F.pad(a, (1, 2), mode="replicate"), torch.arange(12).reshape(2, 6).float())


# --- im2col / col2im ----------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=(3, 2), dilation=(1, 2), padding=1, stride=(2, 1)),
                                dict(kernel_size=3, stride=2, padding=2)])
def test_unfold_fold(kw):
    x = make((2, 3, 7, 6))
    run_both(lambda a: F.unfold(a, **kw), x)
    grads_both(lambda a: F.unfold(a, **kw), x)
    cols = F.unfold(x, **kw)
    run_both(lambda c: F.fold(c, (7, 6), **kw), cols)
    grads_both(lambda c: F.fold(c, (7, 6), **kw), cols)
    run_both(lambda a: F.unfold(a, **kw), x[0])  # unbatched
    run_both(lambda a: F.unfold(a, **kw), x.to(torch.bfloat16))


# --- scatter-into-view ops ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_slice_select_diagonal_scatter(dtype):
    x = make((4, 6, 5)).to(dtype) if dtype != torch.bool else make((4, 6, 5)) > 0
    src_slice = torch.ones(4, 2, 5).to(dtype)
    run_both(lambda a, s: torch.slice_scatter(a, s, 1, 1, 5, 2), x, src_slice)
    run_both(lambda a, s: torch.slice_scatter(a, s, 1, -3, None), x, torch.zeros(4, 3, 5).to(dtype))
    run_both(lambda a, s: torch.slice_scatter(a, s, 0), x, torch.ones(4, 6, 5).to(dtype))
    run_both(lambda a, s: torch.select_scatter(a, s, 2, -1), x, torch.ones(4, 6).to(dtype))
    run_both(lambda a, s: torch.select_scatter(a, s, 0, 2), x, torch.zeros(6, 5).to(dtype))
    for off, d1, d2, n in [(0, 0, 1, 4), (2, 1, 2, 3), (-1, 0, 2, 3), (-2, 2, 0, 4)]:
        y = torch.diagonal(x, off, d1, d2)
        src = torch.ones(y.shape).to(dtype)
        run_both(lambda a, s: torch.diagonal_scatter(a, s, off, d1, d2), x, src)


def test_scatter_ops_backward():
    x, s = make((4, 6)), make((4, 2), seed=1)
    grads_both(lambda a, b: torch.slice_scatter(a, b, 1, 0, 4, 2), x, s)
    grads_both(lambda a, b: torch.select_scatter(a, b, 0, 1), x, make((6,), seed=2))


# --- distances -------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
def test_pdist(p):
    x = make((6, 4))
    run_both(lambda a: F.pdist(a, p), x)
    if p != 0.0:
        grads_both(lambda a: F.pdist(a, p), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 1.5, float("inf")])
def test_cdist(p):
    x1, x2 = make((2, 5, 3)), make((2, 4, 3), seed=1)
    run_both(lambda a, b: torch.cdist(a, b, p), x1, x2)
    if p != 0.0:
        grads_both(lambda a, b: torch.cdist(a, b, p), x1, x2, atol=1e-5, rtol=1e-5)
    run_both(lambda a, b: torch.cdist(a, b, p), make((5, 3)), make((1, 3), seed=2))


# --- grid_sampler_2d ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample(mode, padding_mode, align_corners):
    x = make((2, 3, 5, 6))
    grid = make((2, 4, 7, 2), seed=1) * 0.8  # some points outside [-1, 1]
    run_both(lambda a, g: F.grid_sample(a, g, mode, padding_mode, align_corners), x, grid, atol=1e-5, rtol=1e-5)
    grads_both(lambda a, g: F.grid_sample(a, g, mode, padding_mode, align_corners), x, grid, atol=1e-5, rtol=1e-5)
    if mode == "bicubic":
        return
    # Only the input needs a gradient (output_mask [True, False]).
    grads_both(lambda a: F.grid_sample(a, tpu(grid) if a.device.type == "tpu" else grid, mode, padding_mode,
                                       align_corners), x, atol=1e-5, rtol=1e-5)


def test_grid_sample_bf16():
    # CPU computes bf16 grid sampling in bf16 arithmetic; so does the lowering.
    x, grid = make((2, 3, 5, 5), torch.bfloat16), make((2, 5, 5, 2), torch.bfloat16, 1) * 1.2
    run_both(lambda a, g: F.grid_sample(a, g, align_corners=False), x, grid, atol=2e-2, rtol=1.6e-2)


# --- factories -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_full_like_scalar_tensor(dtype):
    x = make((3, 4)).to(dtype)
    run_both(lambda a: torch.full_like(a, 3), x)
    run_both(lambda a: torch.full_like(a, 1.5, dtype=torch.float32), x)
    expected = torch.scalar_tensor(2.5, dtype=dtype)
    with no_fallback():
        actual = torch.scalar_tensor(2.5, dtype=dtype, device=TPU)
    check(actual, expected)


# --- inverse trigonometric / hyperbolic ----------------------------------------------

UNARY = ["asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh"]
SPECIAL = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-8, -1e-8, 1e-3, 0.999999, -0.999999, 1.000001, 2.0,
                        -2.0, 10.0, -10.0, 20.0, 30.0, 88.0, 89.0, -89.0, 1e10, 1e20, 1e30, -1e30,
                        float("inf"), float("-inf"), float("nan")])


@pytest.mark.parametrize("name", UNARY)
def test_unary_trig_values(name):
    f = getattr(torch, name)
    x = torch.cat([SPECIAL, make((500,)) * 3, torch.rand(500, generator=torch.Generator().manual_seed(1)) * 2 - 1])
    run_both(f, x)
    run_both(f, x.to(torch.bfloat16))
    run_both(f, torch.arange(-3, 4))  # int -> float32
    run_both(f, torch.tensor([True, False]))
    run_both(f, x[:40].reshape(5, 8).t())  # non-contiguous
    run_both(f, torch.tensor(0.25))


@pytest.mark.parametrize("name", UNARY)
def test_unary_trig_inplace_out_backward(name):
    f = getattr(torch, name)
    x = torch.rand(3, 4, generator=torch.Generator().manual_seed(2)) * 0.9 + (1.05 if name == "acosh" else -0.45)
    xt = tpu(x)
    with no_fallback():
        getattr(xt, name + "_")()
        out = torch.empty(3, 4, device=TPU)
        f(tpu(x), out=out)
    check(xt, f(x))
    check(out, f(x))
    grads_both(f, x)


def test_atan2():
    y, x = make((4, 5)), make((5,), seed=1)
    run_both(torch.atan2, y, x)
    run_both(torch.atan2, y.to(torch.bfloat16), x.to(torch.bfloat16))
    run_both(torch.atan2, torch.tensor([1, -2, 0]), torch.tensor([3, 0, -1]))  # int -> float32
    run_both(lambda a: torch.atan2(a, torch.tensor(2.0)), y)  # 0-d tensor
    s = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan")])
    a, b = torch.meshgrid(s, s, indexing="ij")
    run_both(torch.atan2, a, b)
    grads_both(torch.atan2, y, x.expand(4, 5).contiguous())
    yt = tpu(y)
    with no_fallback():
        yt.atan2_(tpu(x))
    check(yt, torch.atan2(y, x))


# --- embedding_bag -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("last", [False, True])
def test_embedding_bag(mode, padding_idx, last):
    w = make((10, 3))
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    off = torch.tensor([0, 4, 4, 8]) if last else torch.tensor([0, 4, 4, 6])  # an empty bag
    fn = lambda w, i, o: F.embedding_bag(i, w, o, mode=mode, padding_idx=padding_idx, include_last_offset=last)
    grads_both(fn, w, idx, off)
    run_both(fn, w.to(torch.bfloat16), idx, off)
    run_both(lambda w, i: F.embedding_bag(i, w, mode=mode, padding_idx=padding_idx), w,
             torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(3)))


def test_embedding_bag_per_sample_weights_and_module():
    w, psw = make((10, 3)), torch.rand(8, generator=torch.Generator().manual_seed(4))
    idx, off = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 3, 5])
    grads_both(lambda w, p: F.embedding_bag(idx if w.device.type == "cpu" else tpu(idx), w,
                                            off if w.device.type == "cpu" else tpu(off),
                                            mode="sum", per_sample_weights=p), w, psw)
    m = torch.nn.EmbeddingBag(10, 4, mode="mean")
    mt = torch.nn.EmbeddingBag(10, 4, mode="mean").to(TPU)
    mt.load_state_dict(m.state_dict())
    m(idx, off).pow(2).sum().backward()
    with no_fallback():
        mt(tpu(idx), tpu(off)).pow(2).sum().backward()
    check(mt.weight.grad, m.weight.grad)


def test_embedding_bag_scale_grad_by_freq_runs_on_cpu():
    # CPU's scale_grad_by_freq gradients do not follow its documentation; the
    # backward keeps them by running on the CPU (the forward stays native).
    w = make((10, 3))
    idx, off = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4, 4, 6])
    grads_both(lambda w, i, o: F.embedding_bag(i, w, o, scale_grad_by_freq=True), w, idx, off,
               names=OURS - {"_embedding_bag_backward"})


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_embedding_max_norm_renorm(norm_type):
    w = make((6, 4)) * 3
    i = torch.tensor([[0, 2], [2, 5]])
    wc, wt = w.clone(), tpu(w)
    expected = F.embedding(i, wc, max_norm=1.5, norm_type=norm_type)
    with no_fallback():
        actual = F.embedding(tpu(i), wt, max_norm=1.5, norm_type=norm_type)
    check(actual, expected)
    check(wt, wc)  # rows 0, 2, 5 renormalized in place, the others untouched
    run_both(lambda w, i: F.embedding_bag(i, w.clone(), max_norm=1.5, norm_type=norm_type), w, i)
