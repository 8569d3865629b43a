"""Order-statistic lowerings (csrc/lowering/sort.cpp) against CPU PyTorch:
kthvalue, median/nanmedian, mode, cummax/cummin (+backward), searchsorted,
bucketize; plus argsort/msort, which decompose into sort (index.cpp).

Values are compared exactly (these ops select elements, they do not compute
new ones); indices exactly where PyTorch defines them (inputs without ties
for kthvalue/median, whose tie index CPU leaves to nth_element). Each test
checks that none of these ops ran through the CPU fallback.
"""

import pytest
import torch
import torch_tpu

from conftest import family_helpers

TPU = torch.device("tpu")
NAN = float("nan")
OURS = set("kthvalue median nanmedian mode cummax cummin searchsorted bucketize sort isin".split())


no_fallback, tpu, check = family_helpers(OURS, exact=True)


def run_both(fn, *args, **tol):
    expected = fn(*args)
    with no_fallback():
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected, **tol)
    return actual


def distinct(shape, dtype=torch.float32, seed=0):
    """Values without ties (a permutation), scaled into dtype's exact range."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n, generator=g).reshape(shape) - n // 2).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_kthvalue(dtype, dim):
    x = distinct((5, 6, 7), dtype)
    for k in (1, 3, x.shape[dim]):
        run_both(lambda a: torch.kthvalue(a, k, dim), x)
        run_both(lambda a: torch.kthvalue(a, k, dim, keepdim=True), x)


def test_kthvalue_nan_scalar_noncontiguous():
    x = torch.tensor([[3.0, NAN, 1.0, 2.0], [0.0, -1.0, NAN, NAN]])
    run_both(lambda a: torch.kthvalue(a, 4, 1), x)
    run_both(lambda a: torch.kthvalue(a, 2, 1), x)
    run_both(lambda a: torch.kthvalue(a, 1), torch.tensor(5.0))
    run_both(lambda a: torch.kthvalue(a.t(), 2, 1), distinct((4, 3)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_median(dtype):
    for shape in [(7,), (4, 6), (3, 5, 4)]:
        x = distinct(shape, dtype)
        run_both(torch.median, x)
        run_both(torch.nanmedian, x)
        for d in range(len(shape)):
            run_both(lambda a: torch.median(a, d), x)
            run_both(lambda a: torch.nanmedian(a, d, keepdim=True), x)


def test_median_nan():
    x = torch.tensor([[3.0, NAN, 1.0, NAN, 2.0], [4.0, 1.0, 2.0, 0.0, 5.0], [NAN, 7.0, -1.0, 6.0, 8.0]])
    run_both(lambda a: torch.median(a, 1), x)  # NaN and the index of the row's first NaN
    run_both(lambda a: torch.nanmedian(a, 1), x)
    run_both(torch.median, x)
    run_both(torch.nanmedian, x)
    # All-NaN row: nanmedian is NaN (CPU's index there is arbitrary).
    y = torch.tensor([[NAN, NAN, NAN], [1.0, NAN, 0.0]])
    expected = torch.nanmedian(y, 1)
    with no_fallback():
        actual = torch.nanmedian(tpu(y), 1)
    check(actual.values, expected.values)
    check(actual.indices[1:], expected.indices[1:])
    run_both(torch.median, torch.tensor([]))
    run_both(lambda a: torch.median(a, 0), torch.tensor(2.5))


def test_median_out():
    x = distinct((4, 5))
    ev, ei = torch.median(x, 1)
    ov, oi = torch.empty(4, device=TPU), torch.empty(4, dtype=torch.long, device=TPU)
    with no_fallback():
        torch.median(tpu(x), 1, out=(ov, oi))
    check(ov, ev)
    check(oi, ei)


def test_median_backward():
    x = distinct((4, 5)).requires_grad_()
    xt = tpu(x.detach()).requires_grad_()
    torch.median(x, 1).values.sum().backward()
    torch.median(xt, 1).values.sum().backward()
    check(xt.grad, x.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_mode(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (5, 9), generator=g).to(dtype)
    run_both(lambda a: torch.mode(a, 1), x)
    run_both(lambda a: torch.mode(a, 0, keepdim=True), x)
    run_both(lambda a: torch.mode(a), torch.tensor([2, 1, 1, 2, 3]).to(dtype))  # tie: smallest value


def test_mode_all_nan_row():
    run_both(lambda a: torch.mode(a, 1), torch.tensor([[NAN, NAN, NAN], [1.0, 2.0, 1.0]]))


@pytest.mark.parametrize("op", [torch.cummax, torch.cummin])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_cummax_cummin(op, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (4, 13), generator=g).to(dtype)  # many ties: latest index wins
    run_both(lambda a: op(a, 1), x)
    run_both(lambda a: op(a, 0), x)
    run_both(lambda a: op(a.t(), 0), x)


@pytest.mark.parametrize("op", [torch.cummax, torch.cummin])
def test_cummax_cummin_nan_and_backward(op):
    x = torch.tensor([1.0, 3.0, 3.0, NAN, 5.0, NAN, 2.0, -1.0])
    run_both(lambda a: op(a, 0), x)
    run_both(lambda a: op(a, 0), torch.tensor(4.0))
    y = torch.randn(3, 10, generator=torch.Generator().manual_seed(1)).requires_grad_()
    yt = tpu(y.detach()).requires_grad_()
    op(y, 1).values.pow(2).sum().backward()
    op(yt, 1).values.pow(2).sum().backward()
    torch.testing.assert_close(yt.grad.cpu(), y.grad)


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted(right):
    seq = torch.tensor([-1.0, 0.0, 0.0, 2.5, 4.0, 4.0, 9.0])
    vals = torch.tensor([[-3.0, 0.0, 1.0], [4.0, 9.0, 12.0], [NAN, 2.5, -1.0]])
    run_both(lambda s, v: torch.searchsorted(s, v, right=right), seq, vals)
    run_both(lambda s, v: torch.searchsorted(s, v, side="right" if right else "left"), seq, vals)
    run_both(lambda s, v: torch.searchsorted(s, v, right=right, out_int32=True), seq, vals)
    run_both(lambda s: torch.searchsorted(s, 2.5, right=right), seq)
    # Batched sequences (leading dims match) and int64.
    bseq = torch.sort(torch.randint(0, 10, (3, 8), generator=torch.Generator().manual_seed(2)), 1).values
    bval = torch.randint(-1, 11, (3, 5), generator=torch.Generator().manual_seed(3))
    run_both(lambda s, v: torch.searchsorted(s, v, right=right), bseq, bval)
    # sorter: an unsorted sequence with its argsort.
    useq = torch.tensor([5.0, 1.0, 3.0, 9.0, 0.0])
    sorter = torch.argsort(useq)
    run_both(lambda s, v, srt: torch.searchsorted(s, v, right=right, sorter=srt), useq, vals, sorter)


@pytest.mark.parametrize("right", [False, True])
def test_bucketize(right):
    bounds = torch.tensor([0.0, 1.0, 1.0, 5.0])
    x = torch.tensor([[-1.0, 0.0, 0.5], [1.0, 5.0, 7.0]])
    run_both(lambda a, bd: torch.bucketize(a, bd, right=right), x, bounds)
    run_both(lambda a, bd: torch.bucketize(a, bd, right=right, out_int32=True), x.to(torch.bfloat16), bounds)
    run_both(lambda bd: torch.bucketize(3, bd, right=right), bounds)
    run_both(lambda a, bd: torch.bucketize(a, bd, right=right), torch.tensor([0, 2, 5, 9]), bounds.long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_argsort_msort_decompose_to_sort(dtype):
    x = distinct((4, 7), dtype)
    run_both(lambda a: torch.argsort(a, 1), x)
    run_both(lambda a: torch.argsort(a, 0, descending=True), x)
    run_both(lambda a: torch.argsort(a, dim=1, stable=True), x)
    run_both(torch.msort, x)


# --- isin ----------------------------------------------------------------------------

@pytest.mark.parametrize("invert", [False, True])
def test_isin_matches_cpu(invert):
    e = torch.tensor([[1, 2, 3], [4, 5, -6]])
    t = torch.tensor([2, 5, 9, -6])
    f = torch.tensor([1.0, NAN, 2.5, -0.0])
    ft = torch.tensor([NAN, 2.5, 0.0])
    cases = [
        (e, t), (e, t.to(torch.int32)), (e, t.double()), (f, ft), (f.bfloat16(), ft),
        (e[:, ::2], t), (torch.empty(0, 3), t), (e, torch.empty(0, dtype=torch.long)),
    ]
    with no_fallback():
        for x, y in cases:
            got = torch.isin(x.to(TPU), y.to(TPU), invert=invert)
            assert got.dtype == torch.bool and got.device.type == "tpu"
            assert torch.equal(got.cpu(), torch.isin(x, y, invert=invert)), (x, y)
        # Tensor_Scalar and Scalar_Tensor overloads
        assert torch.equal(torch.isin(e.to(TPU), 5, invert=invert).cpu(), torch.isin(e, 5, invert=invert))
        assert torch.equal(torch.isin(2.5, ft.to(TPU), invert=invert).cpu(), torch.isin(2.5, ft, invert=invert))
