"""Ops whose output shape depends on the values (csrc/aten/dynamic_shape_kernels.cpp):
nonzero, masked_select, unique (_unique2 / unique_dim), unique_consecutive (flat and
with dim), equal; also take / put_ (same file). Each runs on tpu with no CPU fallback
(`no_cpu_fallback`) and is compared with CPU PyTorch on the same literal inputs:
exactly for integers/bools (and for these ops' float outputs, which are copies of
input values), NaN equal to NaN. Every test runs in the strict, debug and fused eager
modes (in fused mode the size read is a sync point that flushes the region).
"""
import pytest
import torch
import torch_tpu

from conftest import no_cpu_fallback

TPU = torch.device("tpu")
NAN = float("nan")


@pytest.fixture(params=["strict", "debug", "fused"], autouse=True)
def mode(request):
    with torch_tpu.eager_mode(request.param):
        yield request.param


def tpu(x):
    return x.to(TPU) if isinstance(x, torch.Tensor) else x


def check(actual, expected):
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            check(a, e)
        return
    if isinstance(expected, bool):
        assert actual is expected or actual == expected, (actual, expected)
        return
    assert actual.device.type == "tpu", actual.device
    actual = actual.cpu()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)


def run_both(fn, *args):
    expected = fn(*args)
    with no_cpu_fallback():
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected)
    return actual


X = torch.tensor([[0.0, 1.5, -2.0], [0.0, NAN, 0.0]])
I = torch.tensor([[3, 0, 0, -1], [0, 0, 7, 0]])
B = torch.tensor([[True, False], [False, True], [True, True]])


# --- nonzero -------------------------------------------------------------------------

@pytest.mark.parametrize("x", [X, I, B, torch.tensor([0, 4, 0, 5]), torch.zeros(2, 3), torch.zeros(0, 3),
                               torch.tensor(2.0), torch.tensor(0), torch.ones(2, 1, 2, dtype=torch.bool)],
                         ids=["f32_nan", "i64", "bool", "1d", "all_zero", "empty", "scalar", "scalar_zero", "3d"])
def test_nonzero(x):
    run_both(torch.nonzero, x)
    run_both(lambda a: torch.nonzero(a, as_tuple=True), x) if x.dim() > 0 else None
    run_both(torch.argwhere, x)


def test_nonzero_out():
    out = torch.empty(0, dtype=torch.long, device=TPU)
    with no_cpu_fallback():
        r = torch.nonzero(tpu(I), out=out)
    assert r is out
    check(out, torch.nonzero(I))


# --- masked_select -------------------------------------------------------------------

@pytest.mark.parametrize("x,m", [
    (X, X > 0),
    (X, torch.zeros(2, 3, dtype=torch.bool)),
    (I, I != 0),
    (B, B),
    (torch.arange(6.0).view(2, 3), torch.tensor([True, False, True])),   # mask broadcast
    (torch.tensor([1.0, 2.0]), torch.tensor([[True], [False], [True]])),  # both broadcast
    (torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool)),
    (torch.tensor(5), torch.tensor(True)),
], ids=["f32", "all_false", "i64", "bool", "bcast_mask", "bcast_both", "empty", "scalar"])
def test_masked_select(x, m):
    run_both(torch.masked_select, x, m)


def test_masked_select_out_and_errors():
    out = torch.empty(0, device=TPU)
    with no_cpu_fallback():
        torch.masked_select(tpu(X), tpu(X < 1), out=out)
    check(out, torch.masked_select(X, X < 1))
    with pytest.raises(RuntimeError, match="expected BoolTensor for mask"):
        torch.masked_select(tpu(X), tpu(torch.ones(2, 3, dtype=torch.uint8)))


def test_masked_select_backward():
    x = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]])
    m = torch.tensor([True, False, True])
    xc = x.clone().requires_grad_()
    (torch.masked_select(xc, m) * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    xt = tpu(x).requires_grad_()
    with no_cpu_fallback():
        (torch.masked_select(xt, tpu(m)) * tpu(torch.tensor([1.0, 2.0, 3.0, 4.0]))).sum().backward()
    check(xt.grad, xc.grad)


# --- unique --------------------------------------------------------------------------

UNIQUE_INPUTS = [
    torch.tensor([3, 1, 2, 1, 3, 5, -4]),
    torch.tensor([[2.5, NAN, -1.0], [2.5, -0.0, NAN], [0.0, -1.0, 7.0]]),
    torch.tensor([True, False, True, True]),
    torch.zeros(4, 2),
    torch.zeros(0, 2),
    torch.tensor(3.0),
]
UNIQUE_IDS = ["i64", "f32_nan_signed_zero", "bool", "all_zero", "empty", "scalar"]


@pytest.mark.parametrize("x", UNIQUE_INPUTS, ids=UNIQUE_IDS)
@pytest.mark.parametrize("sorted_", [True, False])
@pytest.mark.parametrize("inverse,counts", [(False, False), (True, False), (False, True), (True, True)])
def test_unique(x, sorted_, inverse, counts):
    run_both(lambda a: torch.unique(a, sorted=sorted_, return_inverse=inverse, return_counts=counts), x)
    # the ATen op itself: absent inverse/counts are empty tensors, as on CPU
    run_both(lambda a: torch.ops.aten._unique2(a, sorted_, inverse, counts), x)


def test_unique_legacy_op():
    run_both(lambda a: torch.ops.aten._unique(a, True, True), torch.tensor([[4, 1], [4, 0]]))


ROWS = torch.tensor([[1, 2, 3], [0, 5, 6], [1, 2, 3], [1, 2, 2], [0, 5, 6], [1, 2, 3]])


@pytest.mark.parametrize("x,dim", [
    (ROWS, 0), (ROWS, 1), (ROWS, -1),
    (ROWS.float(), 0),
    (ROWS > 1, 0),
    (torch.tensor([[[1, 0], [1, 0]], [[0, 1], [1, 0]], [[1, 0], [1, 0]]]), 0),
    (torch.tensor([[[1, 0], [1, 0]], [[0, 1], [1, 0]], [[1, 0], [1, 0]]]), 2),
    (torch.tensor([[-0.0, 1.0], [2.0, 1.0], [0.0, 1.0]]), 0),
    (torch.tensor([3, 1, 3]), 0),
    (torch.zeros(0, 3), 0),
    (torch.zeros(5, 4), 1),
], ids=["rows", "cols", "neg_dim", "f32", "bool", "3d_dim0", "3d_dim2", "signed_zero", "1d", "empty_dim",
        "all_zero"])
def test_unique_dim(x, dim):
    # Not compared: slices holding NaN. CPU orders them with a `<` comparator
    # under which NaN is neither smaller nor larger (an unspecified std::sort
    # order); here NaN sorts last, as in flat unique.
    run_both(lambda a: torch.unique(a, dim=dim, return_inverse=True, return_counts=True), x)
    run_both(lambda a: torch.unique(a, dim=dim), x)
    # unique_dim computes inverse and counts even when not asked for, as on CPU
    run_both(lambda a: torch.ops.aten.unique_dim(a, dim, True, False, False), x)


def test_unique_dim_errors():
    x = tpu(torch.zeros(0, 3))
    with pytest.raises(RuntimeError, match="0 sized dimensions"):
        torch.unique(x, dim=1)


@pytest.mark.parametrize("x", [
    torch.tensor([1, 1, 2, 2, 3, 1, 1, 2]),
    torch.tensor([[NAN, NAN, 1.0], [1.0, -0.0, 0.0]]),
    torch.tensor([True, True, False, True]),
    torch.zeros(3, 2),
    torch.zeros(0),
    torch.tensor(4),
], ids=["i64", "f32_nan", "bool", "all_zero", "empty", "scalar"])
@pytest.mark.parametrize("inverse,counts", [(False, False), (True, True), (True, False)])
def test_unique_consecutive(x, inverse, counts):
    run_both(lambda a: torch.unique_consecutive(a, return_inverse=inverse, return_counts=counts), x)
    run_both(lambda a: torch.ops.aten.unique_consecutive(a, inverse, counts), x)


@pytest.mark.parametrize("x,dim", [
    (ROWS, 0), (ROWS[[0, 2, 5, 1, 4, 3]], 0), (ROWS, 1), (ROWS.t().contiguous(), -1),
    (torch.tensor([[NAN, 1.0], [NAN, 1.0]]), 0), (ROWS > 1, 0), (torch.zeros(0, 2), 0),
], ids=["rows", "runs", "cols", "neg_dim", "nan_rows", "bool", "empty_dim"])
def test_unique_consecutive_dim(x, dim):
    run_both(lambda a: torch.unique_consecutive(a, return_inverse=True, return_counts=True, dim=dim), x)
    run_both(lambda a: torch.unique_consecutive(a, dim=dim), x)
    run_both(lambda a: torch.ops.aten.unique_dim_consecutive(a, dim, False, False), x)


def test_unique_in_a_computation():
    # the results feed further tpu ops (in fused mode: recorded after the sync)
    x = torch.tensor([5, 3, 5, 1, 3, 3])

    def f(a):
        v, inv, c = torch.unique(a, return_inverse=True, return_counts=True)
        return v * 10 + c, v[inv] - a
    run_both(f, x)


# --- equal ---------------------------------------------------------------------------

@pytest.mark.parametrize("a,b", [
    (X, X.clone()),                                   # NaN != NaN -> False
    (I, I.clone()),
    (I, I + (I == 7)),
    (B, B.clone()),
    (I, I.float()),                                   # compared after type promotion, as CPU
    (I, I[:, :3]),                                    # sizes differ
    (torch.ones(3), torch.ones(1)),                   # no broadcasting
    (torch.zeros(0, 2), torch.zeros(0, 2)),
    (torch.tensor(2.0), torch.tensor(2.0)),
], ids=["nan", "i64", "i64_diff", "bool", "promote", "size", "no_bcast", "empty", "scalar"])
def test_equal(a, b):
    expected = torch.equal(a, b)
    with no_cpu_fallback():
        actual = torch.equal(tpu(a), tpu(b))
    assert isinstance(actual, bool) and actual == expected
    x = tpu(a)
    with no_cpu_fallback():
        assert torch.equal(x, x) == torch.equal(a, a)


# --- take / put_ ---------------------------------------------------------------------

T_IDX = torch.tensor([[0, -1], [5, 2], [-6, 3]])


@pytest.mark.parametrize("x", [torch.arange(6.0).view(2, 3), I[:, :3], B.view(2, 3)], ids=["f32", "i64", "bool"])
def test_take(x):
    run_both(torch.take, x, T_IDX)
    run_both(lambda a, i: torch.take(a.t(), i), x, T_IDX)            # non-contiguous
    run_both(torch.take, x, torch.tensor(-2))
    run_both(torch.take, x, torch.zeros(0, dtype=torch.long))
    out = torch.empty(0, dtype=x.dtype, device=TPU)
    with no_cpu_fallback():
        torch.take(tpu(x), tpu(T_IDX), out=out)
    check(out, torch.take(x, T_IDX))


def test_take_out_of_range(mode):
    x = tpu(torch.arange(6.0))
    with pytest.raises(IndexError):
        torch.take(x, tpu(torch.tensor([6]))).cpu()
    with pytest.raises(IndexError):
        torch.take(x, tpu(torch.tensor([-7]))).cpu()
    with pytest.raises(RuntimeError, match="Expected a long tensor"):
        torch.take(x, tpu(torch.tensor([1], dtype=torch.int32)))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_put(accumulate, dtype):
    x = torch.tensor([[1, 0, 3], [4, 5, 0]]).to(dtype)
    i = torch.tensor([[0, -1], [4, 2]])
    i_dup = torch.tensor([1, 1, -5, 2])
    src = torch.tensor([[7, 0], [1, 1]]).to(dtype)
    run_both(lambda a, i, s: a.clone().put_(i, s, accumulate=accumulate), x, i, src)
    run_both(lambda a, i, s: torch.put(a, i, s, accumulate=accumulate), x, i, src)
    run_both(lambda a, i, s: a.t().clone().put_(i, s, accumulate=accumulate), x, i, src)
    if accumulate:                                                     # duplicates sum
        run_both(lambda a, i, s: a.clone().put_(i, s.view(-1), accumulate=True), x, i_dup, src)

    def noncontig(a, i, s):
        base = a.clone()
        base.t().put_(i, s, accumulate=accumulate)                     # writes through a view
        return base
    run_both(noncontig, x, i, src)
    run_both(lambda a, i, s: a.clone().put_(i, s), x, torch.zeros(0, dtype=torch.long), src[:0, 0])


def test_put_errors():
    x = tpu(torch.zeros(2, 3))
    with pytest.raises(IndexError):
        x.put_(tpu(torch.tensor([6])), tpu(torch.tensor([1.0])))
        x.cpu()
    with pytest.raises(RuntimeError, match="same number of elements"):
        x.put_(tpu(torch.tensor([0, 1])), tpu(torch.tensor([1.0])))


def test_take_put_backward():
    x = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]])
    i = torch.tensor([[0, -1], [0, 4]])
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    xc = x.clone().requires_grad_()
    (torch.take(xc, i) * w).sum().backward()
    xt = tpu(x).requires_grad_()
    with no_cpu_fallback():
        (torch.take(xt, tpu(i)) * tpu(w)).sum().backward()
    check(xt.grad, xc.grad)
    s = torch.tensor([5.0, 6.0, 7.0, 8.0])
    sc, xc = s.clone().requires_grad_(), x.clone().requires_grad_()
    (torch.put(xc, i.view(-1), sc, accumulate=True) * 2).sum().backward()
    st, xt = tpu(s).requires_grad_(), tpu(x).requires_grad_()
    with no_cpu_fallback():
        (torch.put(xt, tpu(i.view(-1)), st, accumulate=True) * 2).sum().backward()
    check(xt.grad, xc.grad)
    check(st.grad, sc.grad)


# --- boolean-mask indexing: x[mask], x[mask] = v (index / index_put_ with bool indices) ---

M2 = torch.tensor([[True, False, True], [False, False, True]])


@pytest.mark.parametrize("fn", [
    lambda x, m: x[m],
    lambda x, m: x[:, m[0]],
    lambda x, m: x[m[:, 0]],
    lambda x, m: x[torch.tensor([1, 0], device=x.device), m[0]],
    lambda x, m: x[m.logical_not()],
], ids=["full_mask", "mask_dim1", "mask_dim0", "int_and_mask", "all_false_row"])
def test_bool_mask_getitem(fn):
    run_both(fn, X, M2)


def test_bool_mask_setitem_and_accumulate():
    def setitem_scalar(x, m):
        x = x.clone()
        x[m] = 7.0
        return x

    def setitem_tensor(x, m):
        x = x.clone()
        x[m] = torch.arange(3.0, device=x.device)
        return x

    def accumulate(x, m):
        return x.clone().index_put_((m,), torch.tensor(2.5, device=x.device), accumulate=True)

    for fn in (setitem_scalar, setitem_tensor, accumulate):
        run_both(fn, X, M2)


def test_bool_mask_shape_mismatch_raises_like_cpu():
    with pytest.raises(IndexError, match="does not match the shape of the indexed tensor"):
        tpu(X)[tpu(torch.tensor([True, False, True]))]


def test_bool_mask_getitem_backward():
    xc = X.nan_to_num().requires_grad_()
    (xc[M2] * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    xt = tpu(X.nan_to_num()).requires_grad_()
    with no_cpu_fallback():
        (xt[tpu(M2)] * tpu(torch.tensor([1.0, 2.0, 3.0]))).sum().backward()
    check(xt.grad, xc.grad)
