"""Reduction lowerings (csrc/lowering/reduction.cpp) against CPU PyTorch.

Each test runs the op on CPU and on tpu copies of the same inputs and
compares: exactly for integer and bool results, assert_close defaults for
float32, an explicit tolerance for bfloat16. Each test also checks that no
reduction op ran through the CPU fallback.
"""
import math

import pytest
import torch
import torch_tpu

from conftest import family_helpers

TPU = torch.device("tpu")
BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)

OURS = set("""
sum nansum count_nonzero mean prod amax amin max min argmax argmin any all var std var_mean std_mean
cumsum cumprod logsumexp linalg_vector_norm norm _logcumsumexp
""".split())



no_fallback, tpu, check = family_helpers(OURS, BF16_TOL)


def run_both(fn, *args, **tol):
    expected = fn(*args)
    with no_fallback():
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected, **tol)
    return actual


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-5, 6, shape, generator=g).to(dtype)


FLOATS = [torch.float32, torch.bfloat16]
ALL = [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool]


# --- sum / mean / prod --------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("dim,keepdim", [(None, False), (1, False), ((0, 2), True), (-1, True), ((), False)])
def test_sum(dtype, dim, keepdim):
    x = make((3, 4, 5), dtype)
    if dim is None:
        run_both(lambda a: a.sum(), x)
    else:
        run_both(lambda a: a.sum(dim, keepdim=keepdim), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_sum_dtype_arg(dtype):
    x = make((4, 6), dtype)
    run_both(lambda a: a.sum(1, dtype=torch.float64 if dtype != torch.float32 else torch.float32), x)
    run_both(lambda a: a.sum(dtype=torch.int32), x)


def test_sum_bf16_accumulates_in_f32():
    # 4096 ones plus small values: a bf16 accumulator would stall at 256.
    x = torch.ones(4096, dtype=torch.bfloat16)
    out = run_both(lambda a: a.sum(), x)
    assert out.cpu().item() == 4096


def test_sum_noncontiguous_and_out():
    x = make((6, 5), torch.float32)
    run_both(lambda a: a.t().sum(0), x)
    run_both(lambda a: a[::2, 1:].sum(1), x)
    expected = x.sum(0)
    out = torch.empty(5, device=TPU)
    with no_fallback():
        r = torch.sum(tpu(x), 0, out=out)
    assert r is out
    check(out, expected)


def test_sum_empty_and_scalar():
    run_both(lambda a: a.sum(), torch.zeros(0))
    run_both(lambda a: a.sum(0), torch.zeros(0, 3))
    run_both(lambda a: a.sum(), torch.tensor(2.5))
    run_both(lambda a: a.sum(0), torch.tensor(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_nansum_count_nonzero(dtype):
    x = make((4, 5), dtype)
    if dtype.is_floating_point:
        x[0, 1] = float("nan")
        x[2, 3] = float("nan")
    run_both(lambda a: torch.nansum(a), x)
    run_both(lambda a: torch.nansum(a, 1, keepdim=True), x)
    run_both(lambda a: torch.count_nonzero(a), x)
    run_both(lambda a: torch.count_nonzero(a, 0), x)
    run_both(lambda a: torch.count_nonzero(a, (0, 1)), x)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [None, 0, (1, 2), -1])
def test_mean(dtype, dim):
    x = make((3, 4, 5), dtype)
    if dim is None:
        run_both(lambda a: a.mean(), x)
    else:
        run_both(lambda a: a.mean(dim, keepdim=True), x)
        run_both(lambda a: a.mean(dim), x)


def test_mean_dtype_and_empty():
    run_both(lambda a: a.mean(1, dtype=torch.float32), make((3, 4), torch.int64))
    run_both(lambda a: a.mean(0), torch.zeros(0, 3))  # NaN, like CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_prod(dtype):
    x = make((3, 4), dtype)
    if dtype.is_floating_point:
        x = x * 0.5 + 1
    run_both(lambda a: a.prod(), x)
    run_both(lambda a: a.prod(1), x)
    run_both(lambda a: a.prod(0, keepdim=True), x)
    run_both(lambda a: a.prod(0), torch.zeros(0, 2))


# --- amax / amin / max / min / argmax / argmin ------------------------------------

@pytest.mark.parametrize("dtype", ALL)
def test_amax_amin(dtype):
    x = make((3, 4, 5), dtype)
    for f in (torch.amax, torch.amin):
        run_both(lambda a: f(a, 1), x)
        run_both(lambda a: f(a, (0, 2), keepdim=True), x)
        run_both(lambda a: f(a), x)


def test_amax_nan_propagates():
    x = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, -1.0]])
    run_both(lambda a: torch.amax(a, 1), x)
    run_both(lambda a: torch.amin(a, 1), x)
    run_both(lambda a: a.max(), x)
    run_both(lambda a: a.min(), x)


@pytest.mark.parametrize("dtype", ALL)
def test_max_min_dim(dtype):
    x = make((4, 6), dtype)
    run_both(lambda a: tuple(a.max(1)), x)
    run_both(lambda a: tuple(a.min(0, keepdim=True)), x)
    run_both(lambda a: tuple(torch.max(a, -1)), x)


def test_max_dim_ties_and_nan_first_occurrence():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0],
                      [float("nan"), 1.0, float("nan"), 5.0], [0.0, float("nan"), 7.0, 7.0]])
    run_both(lambda a: tuple(a.max(1)), x)
    run_both(lambda a: tuple(a.min(1)), x)
    run_both(lambda a: a.argmax(1), x)
    run_both(lambda a: a.argmin(1), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32])
def test_argmax_argmin(dtype):
    x = make((5, 7), dtype)  # int values in [-5, 5]: many ties
    for f in (torch.argmax, torch.argmin):
        run_both(lambda a: f(a), x)
        run_both(lambda a: f(a, 0), x)
        run_both(lambda a: f(a, 1, keepdim=True), x)
        run_both(lambda a: f(a, None, keepdim=True), x)


def test_argmax_noncontiguous_and_scalar():
    x = make((6, 4), torch.float32)
    run_both(lambda a: a.t().argmax(1), x)
    run_both(lambda a: a.argmax(), torch.tensor(3.0))


def test_max_dim_out():
    x = make((4, 5), torch.float32)
    ev, ei = x.max(1)
    v = torch.empty(4, device=TPU)
    i = torch.empty(4, dtype=torch.long, device=TPU)
    with no_fallback():
        torch.max(tpu(x), 1, out=(v, i))
    check(v, ev)
    check(i, ei)


# --- any / all ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.int64, torch.uint8])
def test_any_all(dtype):
    x = make((4, 5), dtype) if dtype != torch.uint8 else torch.randint(0, 2, (4, 5), dtype=torch.uint8)
    if dtype == torch.float32:
        x = torch.where(x > 0.5, x, torch.zeros(()))
    for f in (torch.any, torch.all):
        run_both(lambda a: f(a), x)
        run_both(lambda a: f(a, 1), x)
        run_both(lambda a: f(a, 0, keepdim=True), x)
    run_both(lambda a: torch.any(a, (0, 1)), x)


def test_any_all_nan_and_empty():
    x = torch.tensor([0.0, float("nan")])
    run_both(lambda a: torch.any(a), x)
    run_both(lambda a: torch.all(a), x)
    run_both(lambda a: torch.any(a), torch.zeros(0, dtype=torch.bool))
    run_both(lambda a: torch.all(a), torch.zeros(0, dtype=torch.bool))


# --- var / std ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_var_std(dtype):
    x = make((4, 6), dtype)
    run_both(lambda a: a.var(), x)
    run_both(lambda a: a.var(1), x)
    run_both(lambda a: a.std(0, keepdim=True), x)
    run_both(lambda a: a.var(1, unbiased=False), x)
    run_both(lambda a: torch.var(a, 1, correction=0), x)
    run_both(lambda a: torch.std(a, (0, 1), correction=2), x)


def test_var_mean_std_mean():
    x = make((4, 6), torch.float32)
    run_both(lambda a: tuple(torch.var_mean(a, 1)), x)
    run_both(lambda a: tuple(torch.std_mean(a, 0, keepdim=True, correction=0)), x)
    run_both(lambda a: tuple(torch.var_mean(a)), x)


def test_var_single_element_is_nan():
    run_both(lambda a: a.var(), torch.tensor([3.0]))
    run_both(lambda a: a.var(0), torch.zeros(0, 2))


# --- scans -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool])
def test_cumsum(dtype):
    x = make((5, 37), dtype)
    run_both(lambda a: torch.cumsum(a, 1), x)
    run_both(lambda a: torch.cumsum(a, 0), x)
    run_both(lambda a: torch.cumsum(a, -1, dtype=torch.float32), x)


def test_cumsum_inplace_out_and_scalar():
    x = make((4, 9), torch.float32)
    expected = x.clone().cumsum_(1)
    t = tpu(x)
    with no_fallback():
        t.cumsum_(1)
    check(t, expected)
    out = torch.empty(4, 9, device=TPU)
    with no_fallback():
        torch.cumsum(tpu(x), 0, out=out)
    check(out, x.cumsum(0))
    run_both(lambda a: a.cumsum(0), torch.tensor(2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_cumprod(dtype):
    x = make((3, 11), dtype)
    if dtype.is_floating_point:
        x = x * 0.3 + 1
    run_both(lambda a: torch.cumprod(a, 1), x)
    run_both(lambda a: torch.cumprod(a, 0), x)


# --- logsumexp ------------------------------------------------------------------------

def test_logsumexp_special_values():
    x = make((4, 6), torch.float32) * 10
    out = torch.empty(4, device=TPU)
    with no_fallback():
        torch.logsumexp(tpu(x), 1, out=out)
    check(out, torch.logsumexp(x, 1))
    x = torch.tensor([[float("-inf"), float("-inf")], [1.0, float("inf")]])
    out = torch.empty(2, device=TPU)
    with no_fallback():
        torch.logsumexp(tpu(x), 1, out=out)
    check(out, torch.logsumexp(x, 1))


@pytest.mark.parametrize("dtype", FLOATS)
def test_logsumexp(dtype):
    x = make((4, 6), dtype) * 5
    run_both(lambda a: torch.logsumexp(a, 1), x)
    run_both(lambda a: torch.logsumexp(a, (0, 1), keepdim=True), x)
    run_both(lambda a: torch.logsumexp(a, 0), make((3,), torch.int64))


# --- norms -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("ord", [2, 1, float("inf"), float("-inf"), 0, 3, 0.5])
def test_vector_norm(dtype, ord):
    x = make((4, 6), dtype)
    x[0, 0] = 0
    run_both(lambda a: torch.linalg.vector_norm(a, ord), x)
    run_both(lambda a: torch.linalg.vector_norm(a, ord, dim=1), x)
    run_both(lambda a: torch.linalg.vector_norm(a, ord, dim=(0,), keepdim=True), x)


def test_vector_norm_dtype_and_norm():
    x = make((4, 6), torch.bfloat16)
    run_both(lambda a: torch.linalg.vector_norm(a, 2, dtype=torch.float32), x)
    x = make((4, 6), torch.float32)
    run_both(lambda a: torch.norm(a), x)
    run_both(lambda a: torch.norm(a, p=1, dim=1), x)
    run_both(lambda a: a.norm(3, dim=0, keepdim=True), x)


def test_clip_grad_norm():
    ps = [make((5, 3), torch.float32, seed=i) for i in range(3)]
    exp = torch._foreach_norm(ps)
    with no_fallback():
        got = torch._foreach_norm([tpu(p) for p in ps])
    for g, e in zip(got, exp):
        check(g, e)


# --- backward ------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda a: a.sum(1).pow(2).sum(),
    lambda a: a.mean((0, 1)),
    lambda a: a.amax(1).sum(),
    lambda a: a.max(1)[0].sum(),
    lambda a: a.var(1).sum(),
    lambda a: a.std(0).sum(),
    lambda a: a.cumsum(1).sum(),
    lambda a: torch.linalg.vector_norm(a, 2, dim=1).sum(),
    lambda a: a.prod(1).sum(),
], ids=["sum", "mean", "amax", "max_dim", "var", "std", "cumsum", "norm", "prod"])
def test_backward(fn):
    x = make((4, 5), torch.float32)
    xc = x.clone().requires_grad_()
    fn(xc).backward()
    xt = tpu(x).requires_grad_()
    with no_fallback():
        loss = fn(xt)
        loss.backward()
    check(xt.grad, xc.grad)


# --- aminmax (issue 3) -----------------------------------------------------------

from conftest import no_cpu_fallback  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("kw", [{}, {"dim": 1}, {"dim": -1, "keepdim": True}, {"keepdim": True}, {"dim": 0}])
def test_aminmax(dtype, kw):
    x = (torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    expected = torch.aminmax(x, **kw)
    with no_cpu_fallback():
        actual = torch.aminmax(x.to("tpu"), **kw)
    for a, e in zip(actual, expected):
        assert a.device.type == "tpu"
        torch.testing.assert_close(a.cpu(), e, atol=0, rtol=0)


def test_aminmax_nan_0d_and_out():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    x[1, 2] = float("nan")
    for kw in [{}, {"dim": 1}, {"dim": 0, "keepdim": True}]:
        expected = torch.aminmax(x, **kw)
        with no_cpu_fallback():
            actual = torch.aminmax(x.to("tpu"), **kw)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a.cpu(), e, atol=0, rtol=0, equal_nan=True)
    s = torch.tensor(3.5)
    with no_cpu_fallback():
        lo, hi = torch.aminmax(s.to("tpu"))
    assert lo.cpu().item() == 3.5 and hi.cpu().item() == 3.5
    mn, mx = torch.empty(4, device="tpu"), torch.empty(4, device="tpu")
    with no_cpu_fallback():
        torch.aminmax(x.to("tpu"), dim=0, out=(mn, mx))
    e = torch.aminmax(x, dim=0)
    torch.testing.assert_close(mn.cpu(), e.min, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(mx.cpu(), e.max, atol=0, rtol=0, equal_nan=True)


# --- _logcumsumexp -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_logcumsumexp(dtype, dim):
    x = make((5, 9), torch.float32, seed=3) * 30   # spreads far beyond exp's range
    x[0, 2] = -math.inf
    x[1, :] = -math.inf        # a row of -inf stays -inf
    x[2, 3] = math.inf
    x[3, 4:6] = math.inf       # inf with inf stays inf
    x[4, 5] = math.nan
    run_both(lambda t: torch.logcumsumexp(t, dim), x.to(dtype))


def test_logcumsumexp_shapes_out_autograd():
    run_both(lambda t: torch.logcumsumexp(t, 0), torch.tensor(2.5))          # 0-d
    run_both(lambda t: torch.logcumsumexp(t, 1), make((2, 0, 3), torch.float32))  # empty
    run_both(lambda t: torch.logcumsumexp(t, 0), make((37,), torch.float32, seed=5))  # non power of 2
    x = make((4, 6), torch.float32, seed=7)
    out = torch.empty(4, 6, device=TPU)
    with no_fallback():
        torch.logcumsumexp(tpu(x), 1, out=out)
    check(out, torch.logcumsumexp(x, 1))
    xc, xt = x.clone().requires_grad_(), tpu(x).requires_grad_()
    torch.logcumsumexp(xc, 1).sum().backward()
    with no_fallback():
        torch.logcumsumexp(xt, 1).sum().backward()
    check(xt.grad, xc.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="Long"):
        torch.logcumsumexp(tpu(torch.arange(3)), 0)
