"""Matrix-product lowerings (csrc/lowering/linalg.cpp) against CPU PyTorch.

float32 is compared with assert_close defaults, bfloat16 with an explicit
tolerance (PyTorch's CPU kernels accumulate bf16 products in f32 and round
once, as the lowering does), integers exactly. Each test checks that no
linalg op ran through the CPU fallback.
"""
import contextlib

import pytest
import torch
import torch_tpu

TPU = torch.device("tpu")
BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)
OURS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot"}


def _base(op_name):
    name = op_name.split("::")[-1].split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


@contextlib.contextmanager
def no_fallback(names=OURS):
    before = dict(torch_tpu.metrics()["cpu_fallbacks"])
    yield
    after = torch_tpu.metrics()["cpu_fallbacks"]
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    ours = {k: v for k, v in new.items() if _base(k) in names}
    assert not ours, f"ops fell back to the CPU: {ours}"


def tpu(x):
    return x.to(TPU) if isinstance(x, torch.Tensor) else x


def check(actual, expected, **tol):
    assert actual.device.type == "tpu", actual.device
    actual = actual.cpu()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not tol and expected.dtype in (torch.bfloat16, torch.float16):
        tol = BF16_TOL
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)


def run_both(fn, *args, **tol):
    expected = fn(*args)
    with no_fallback():
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected, **tol)
    return actual


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-5, 6, shape, generator=g).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm(dtype):
    a, b = make((5, 7), dtype, 1), make((7, 3), dtype, 2)
    run_both(torch.mm, a, b)
    run_both(lambda x, y: x @ y, a, b)
    run_both(lambda x, y: torch.mm(x.t(), y.t()), b, a)  # transposed (non-contiguous) operands


def test_mm_out_and_larger():
    a, b = make((64, 96), torch.float32, 1), make((96, 48), torch.float32, 2)
    run_both(torch.mm, a, b)
    out = torch.empty(64, 48, device=TPU)
    with no_fallback():
        r = torch.mm(tpu(a), tpu(b), out=out)
    assert r is out
    check(out, a @ b)


def test_mm_bf16_rounds_once():
    # A long contraction: bf16 accumulation would drift far beyond 1 bf16 ulp.
    a = torch.full((1, 2048), 1.0, dtype=torch.bfloat16)
    b = torch.full((2048, 1), 1.0 / 3, dtype=torch.bfloat16)
    out = run_both(torch.mm, a, b)
    assert out.cpu().item() == (a.float() @ b.float()).bfloat16().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm(dtype):
    a, b = make((3, 4, 6), dtype, 1), make((3, 6, 5), dtype, 2)
    run_both(torch.bmm, a, b)
    run_both(lambda x, y: torch.bmm(x, y.transpose(1, 2)), a, b.transpose(1, 2).contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_addmm(dtype):
    bias, a, b = make((3,), dtype, 0), make((5, 7), dtype, 1), make((7, 3), dtype, 2)
    run_both(torch.addmm, bias, a, b)
    run_both(lambda s, x, y: torch.addmm(s, x, y, beta=0.5, alpha=2.0), bias, a, b)
    run_both(lambda s, x, y: torch.addmm(s, x, y, beta=2, alpha=-1), make((5, 3), dtype, 3), a, b)
    run_both(lambda s, x, y: torch.nn.functional.linear(x, y.t(), s), bias, a, b)


def test_addmm_beta_zero_ignores_nan():
    s = torch.full((4, 3), float("nan"))
    a, b = make((4, 5), torch.float32, 1), make((5, 3), torch.float32, 2)
    run_both(lambda s, x, y: torch.addmm(s, x, y, beta=0), s, a, b)


def test_addmm_inplace_and_out():
    s, a, b = make((4, 3), torch.float32, 0), make((4, 5), torch.float32, 1), make((5, 3), torch.float32, 2)
    expected = s.clone().addmm_(a, b, alpha=0.5)
    t = tpu(s)
    with no_fallback():
        t.addmm_(tpu(a), tpu(b), alpha=0.5)
    check(t, expected)
    out = torch.empty(4, 3, device=TPU)
    with no_fallback():
        torch.addmm(tpu(s), tpu(a), tpu(b), out=out)
    check(out, torch.addmm(s, a, b))


def test_addmm_int():
    run_both(torch.addmm, make((3,), torch.int64), make((4, 5), torch.int64, 1), make((5, 3), torch.int64, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_baddbmm_addbmm(dtype):
    s, a, b = make((4, 5), dtype, 0), make((3, 4, 6), dtype, 1), make((3, 6, 5), dtype, 2)
    run_both(torch.baddbmm, s, a, b)
    run_both(lambda s, x, y: torch.baddbmm(s, x, y, beta=0.5, alpha=3), s, a, b)
    run_both(torch.addbmm, s, a, b)
    run_both(lambda s, x, y: torch.addbmm(s, x, y, beta=0, alpha=2), s, a, b)


def test_baddbmm_inplace():
    s, a, b = make((3, 4, 5), torch.float32, 0), make((3, 4, 6), torch.float32, 1), make((3, 6, 5), torch.float32, 2)
    expected = s.clone().baddbmm_(a, b, beta=0.5)
    t = tpu(s)
    with no_fallback():
        t.baddbmm_(tpu(a), tpu(b), beta=0.5)
    check(t, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mv_dot_addmv(dtype):
    m, v, w = make((5, 7), dtype, 1), make((7,), dtype, 2), make((5,), dtype, 3)
    run_both(torch.mv, m, v)
    run_both(torch.dot, v, v)
    run_both(lambda x, y: x @ y, v, v)
    run_both(lambda x, y: x @ y, m, v)
    run_both(torch.addmv, w, m, v)
    if dtype.is_floating_point:
        run_both(lambda a, b, c: torch.addmv(a, b, c, beta=0.5, alpha=2.0), w, m, v)


@pytest.mark.parametrize("shapes", [((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)),
                                    ((4,), (2, 4, 3)), ((3, 4), (4,))])
def test_matmul_shapes(shapes):
    a, b = make(shapes[0], torch.float32, 1), make(shapes[1], torch.float32, 2)
    run_both(torch.matmul, a, b)


def test_empty_contraction():
    run_both(torch.mm, torch.zeros(3, 0), torch.zeros(0, 4))
    run_both(torch.addmm, torch.ones(3, 4), torch.zeros(3, 0), torch.zeros(0, 4))


@pytest.mark.parametrize("fn", [
    lambda a, b: (a @ b).pow(2).sum(),
    lambda a, b: torch.bmm(a[None].expand(2, -1, -1), b[None].expand(2, -1, -1)).sum(),
    lambda a, b: torch.nn.functional.linear(a, b.t(), b[0]).sum(),
], ids=["mm", "bmm", "linear"])
def test_backward(fn):
    a, b = make((4, 5), torch.float32, 1), make((5, 5), torch.float32, 2)
    ac, bc = a.clone().requires_grad_(), b.clone().requires_grad_()
    fn(ac, bc).backward()
    at, bt = tpu(a).requires_grad_(), tpu(b).requires_grad_()
    with no_fallback():
        fn(at, bt).backward()
    check(at.grad, ac.grad)
    check(bt.grad, bc.grad)
