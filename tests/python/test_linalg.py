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


# ---------------------------------------------------------------------------
# Decompositions and solves (csrc/lowering/linalg_decompositions.cpp).
# float32 compared with F32_TOL (LAPACK and the lowering order their
# operations differently); outputs unique only up to sign (singular vectors,
# eigenvectors) are compared through reconstructions and |.|. Every test runs
# under conftest's no_cpu_fallback: no op at all may fall back.
# ---------------------------------------------------------------------------
from conftest import no_cpu_fallback  # noqa: E402

F32_TOL = dict(atol=1e-4, rtol=1e-4)


def on_both(fn, *args, tol=F32_TOL):
    """fn on CPU and on tpu copies (under no_cpu_fallback); compares every output."""
    expected = fn(*args)
    with no_cpu_fallback():
        actual = fn(*[tpu(a) for a in args])
    exp = expected if isinstance(expected, (tuple, list)) else (expected,)
    act = actual if isinstance(actual, (tuple, list)) else (actual,)
    assert len(exp) == len(act)
    for a, e in zip(act, exp):
        check(a, e, **(tol if e.is_floating_point() else {}))
    return actual


def well_conditioned(shape, seed=0):
    """Random square matrices with a boosted diagonal (condition number ~ 10)."""
    a = make(shape, torch.float32, seed)
    n = shape[-1]
    return a + 3 * n ** 0.5 * torch.eye(n)


def spd(shape, seed=0):
    a = make(shape, torch.float32, seed)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


def test_solve_triangular_literal():
    a = torch.tensor([[2.0, 0.0, 0.0], [1.0, 4.0, 0.0], [-1.0, 2.0, 5.0]])
    b = torch.tensor([[2.0], [9.0], [16.0]])
    x = on_both(lambda a, b: torch.linalg.solve_triangular(a, b, upper=False), a, b)
    assert torch.equal(x.cpu(), torch.tensor([[1.0], [2.0], [2.6]]))  # forward substitution by hand


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unit", [True, False])
def test_solve_triangular(upper, left, unit):
    a = well_conditioned((2, 3, 5, 5), 1)
    b = make((2, 3, 5, 4) if left else (2, 3, 4, 5), torch.float32, 2)
    fn = lambda a, b: torch.linalg.solve_triangular(a, b, upper=upper, left=left, unitriangular=unit)  # noqa: E731
    on_both(fn, a, b)
    on_both(fn, a[0], b)                                              # batch broadcast
    on_both(fn, a.mT.contiguous().mT, b.mT.contiguous().mT)            # non-contiguous
    on_both(lambda a, b: torch.triangular_solve(b, a, upper=upper, transpose=not left, unitriangular=unit),
            a, make((2, 3, 5, 4), torch.float32, 3))


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky(upper):
    a = spd((3, 5, 5), 4)
    on_both(lambda a: torch.linalg.cholesky(a, upper=upper), a)
    on_both(lambda a: torch.linalg.cholesky_ex(a, upper=upper), a)
    on_both(lambda a: torch.cholesky(a, upper), a)
    on_both(lambda a: torch.linalg.cholesky(a.mT, upper=upper), a)  # non-contiguous
    l = torch.linalg.cholesky(a, upper=upper)
    on_both(lambda l, b: torch.cholesky_solve(b, l, upper=upper), l, make((3, 5, 2), torch.float32, 5))
    on_both(lambda l: torch.cholesky_inverse(l, upper=upper), l[0])


def test_cholesky_not_positive_definite():
    # Leading minors: 1 > 0, then det [[1, 2], [2, 1]] = -3 < 0: info = 2, as LAPACK.
    a = torch.tensor([[[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [[4.0, 0, 0], [0, 9.0, 0], [0, 0, 1.0]]])
    with no_cpu_fallback():
        l, info = torch.linalg.cholesky_ex(tpu(a))
    assert torch.equal(info.cpu(), torch.linalg.cholesky_ex(a).info)
    assert info.cpu().tolist() == [2, 0]
    check(l[1], torch.linalg.cholesky(a[1]))
    with pytest.raises(torch.linalg.LinAlgError, match="leading minor of order 2"):
        torch.linalg.cholesky(tpu(a))


@pytest.mark.parametrize("shape", [(5, 5), (3, 4, 4), (2, 4, 6), (2, 6, 4), (1, 1)])
def test_lu_factor_and_unpack(shape):
    a = make(shape, torch.float32, 6)
    lu, piv = on_both(torch.linalg.lu_factor, a)
    assert lu.cpu().dtype == torch.float32 and piv.cpu().dtype == torch.int32
    on_both(torch.linalg.lu_factor_ex, a)
    on_both(torch.linalg.lu, a)
    on_both(torch.lu_unpack, *torch.linalg.lu_factor(a))


def test_lu_literal_pivots_and_singular_info():
    # The pivot is the row of largest |a| in the column (the first one on ties).
    a = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 5.0, 6.0], [4.0, 8.0, 9.0]])
    lu, piv, info = on_both(torch.linalg.lu_factor_ex, a)
    assert piv.cpu().tolist() == [2, 3, 3] and info.item() == 0
    singular = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 1.0, 1.0]])
    _, _, info = on_both(torch.linalg.lu_factor_ex, singular)
    assert info.item() == 3  # U[2, 2] == 0, as LAPACK's getrf reports


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("adjoint", [True, False])
def test_lu_solve(left, adjoint):
    a = well_conditioned((2, 5, 5), 7)
    b = make((3, 2, 5, 3) if left else (3, 2, 3, 5), torch.float32, 8)  # broadcast batch
    lu, piv = torch.linalg.lu_factor(a)
    on_both(lambda lu, piv, b: torch.linalg.lu_solve(lu, piv, b, left=left, adjoint=adjoint), lu, piv, b)


def test_solve_det_inv():
    a = well_conditioned((3, 4, 4), 9)
    b = make((3, 4, 2), torch.float32, 10)
    on_both(torch.linalg.solve, a, b)
    on_both(torch.linalg.solve, a, b[..., 0])                      # vector right-hand side
    on_both(lambda a, b: torch.linalg.solve(a, b, left=False), a, b.mT)
    on_both(torch.linalg.solve_ex, a, b)
    on_both(torch.linalg.det, a)
    on_both(torch.linalg.slogdet, a)
    on_both(torch.linalg.inv, a)
    on_both(torch.linalg.inv_ex, a.mT)                              # non-contiguous
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    on_both(torch.linalg.det, singular)
    on_both(torch.linalg.slogdet, singular)                         # sign 0, logabsdet -inf
    on_both(lambda a: torch.linalg.det(a).sum(), make((2, 3, 3), torch.float32, 11))


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4), (2, 1, 6, 2)])
@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
def test_qr(shape, mode):
    # Householder QR in LAPACK's convention (R's diagonal sign included): Q and R match CPU.
    a = make(shape, torch.float32, 12)
    on_both(lambda a: torch.linalg.qr(a, mode=mode), a)


def test_geqrf_householder_ormqr():
    a = make((2, 6, 4), torch.float32, 13)
    c = make((2, 6, 3), torch.float32, 14)
    with no_cpu_fallback():
        qa, tau = torch.geqrf(tpu(a))
    ea, etau = torch.geqrf(a)
    check(qa, ea, **F32_TOL)
    check(tau, etau, **F32_TOL)
    on_both(torch.linalg.householder_product, ea, etau)
    on_both(torch.linalg.householder_product, ea[..., :3], etau[..., :2])
    for left, transpose in [(True, False), (True, True)]:
        on_both(lambda a, t, c: torch.ormqr(a, t, c, left=left, transpose=transpose), ea, etau, c)
    on_both(lambda a, t, c: torch.ormqr(a, t, c, left=False, transpose=True), ea, etau, c.mT)


def _svd_checks(a, full_matrices):
    with no_cpu_fallback():
        u, s, vh = torch.linalg.svd(tpu(a), full_matrices=full_matrices)
    u, s, vh = u.cpu(), s.cpu(), vh.cpu()
    eu, es, evh = torch.linalg.svd(a, full_matrices=full_matrices)
    assert (u.shape, s.shape, vh.shape) == (eu.shape, es.shape, evh.shape)
    torch.testing.assert_close(s, es, **F32_TOL)
    k = s.shape[-1]
    torch.testing.assert_close((u[..., :k] * s[..., None, :]) @ vh[..., :k, :], a, **F32_TOL)
    eye_u = torch.eye(u.shape[-1]).expand(u.mT.shape[:-2] + (u.shape[-1], u.shape[-1]))
    torch.testing.assert_close(u.mT @ u, eye_u, **F32_TOL)
    eye_v = torch.eye(vh.shape[-2]).expand(vh.shape[:-2] + (vh.shape[-2], vh.shape[-2]))
    torch.testing.assert_close(vh @ vh.mT, eye_v, **F32_TOL)
    # Distinct singular values: vectors agree with LAPACK's up to sign.
    torch.testing.assert_close(u[..., :k].abs(), eu[..., :k].abs(), **F32_TOL)
    torch.testing.assert_close(vh[..., :k, :].abs(), evh[..., :k, :].abs(), **F32_TOL)


@pytest.mark.parametrize("shape", [(5, 5), (6, 3), (3, 6), (2, 4, 5), (2, 5, 3), (1, 1), (4, 1)])
@pytest.mark.parametrize("full_matrices", [False, True])
def test_svd(shape, full_matrices):
    _svd_checks(make(shape, torch.float32, 15), full_matrices)


def test_svd_literal_and_rank_deficient():
    a = torch.tensor([[3.0, 0.0], [0.0, -4.0], [0.0, 0.0]])
    with no_cpu_fallback():
        s = torch.linalg.svdvals(tpu(a))
    assert torch.equal(s.cpu(), torch.tensor([4.0, 3.0]))
    r = make((6, 4), torch.float32, 16)
    r[:, 3] = r[:, 0] - r[:, 1]  # rank 3
    with no_cpu_fallback():
        u, s, vh = torch.linalg.svd(tpu(r))
    torch.testing.assert_close(s.cpu(), torch.linalg.svdvals(r), **F32_TOL)
    torch.testing.assert_close(u.cpu().mT @ u.cpu(), torch.eye(6), **F32_TOL)  # completed, orthonormal
    torch.testing.assert_close((u.cpu()[:, :4] * s.cpu()) @ vh.cpu(), r, **F32_TOL)


def test_svd_consumers():
    a = make((3, 5, 4), torch.float32, 17)
    on_both(torch.linalg.svdvals, a)
    on_both(torch.linalg.pinv, a)
    on_both(lambda a: torch.linalg.matrix_norm(a, ord=2), a)
    on_both(lambda a: torch.linalg.matrix_norm(a, ord="nuc"), a)
    on_both(lambda a: torch.linalg.norm(a, ord=-2, dim=(-2, -1)), a)
    on_both(lambda a: torch.linalg.svd(a.mT, full_matrices=False)[1], a)  # non-contiguous


@pytest.mark.parametrize("uplo", ["L", "U"])
def test_eigh(uplo):
    a = make((3, 5, 5), torch.float32, 18)
    sym = a + a.mT
    # Only the UPLO triangle is read: garbage in the other one must not matter.
    tri = torch.tril(sym) if uplo == "L" else torch.triu(sym)
    junk = tri + (torch.triu(a, 1) if uplo == "L" else torch.tril(a, -1)) * 100
    with no_cpu_fallback():
        w, v = torch.linalg.eigh(tpu(junk), UPLO=uplo)
    ew, ev = torch.linalg.eigh(junk, UPLO=uplo)
    torch.testing.assert_close(w.cpu(), ew, **F32_TOL)
    torch.testing.assert_close(v.cpu().abs(), ev.abs(), **F32_TOL)
    torch.testing.assert_close(v.cpu() @ torch.diag_embed(w.cpu()) @ v.cpu().mT, sym, **F32_TOL)
    on_both(lambda x: torch.linalg.eigvalsh(x, UPLO=uplo), junk)


def test_decompositions_reject_bfloat16_like_cpu():
    a = make((3, 3), torch.float32, 19).bfloat16()
    with pytest.raises(RuntimeError) as cpu_err:
        torch.linalg.cholesky(a)
    with pytest.raises(RuntimeError) as tpu_err:
        torch.linalg.cholesky(tpu(a))
    assert str(tpu_err.value).splitlines()[0] == str(cpu_err.value).splitlines()[0]


@pytest.mark.parametrize("name", ["solve_triangular", "cholesky", "qr", "lu_solve", "svd", "eigh", "det"])
def test_decomposition_backward(name):
    a = well_conditioned((2, 4, 4), 20)
    b = make((2, 4, 3), torch.float32, 21)
    fns = {
        "solve_triangular": lambda a, b: torch.linalg.solve_triangular(a.triu(), b, upper=True).sum(),
        "cholesky": lambda a, b: torch.linalg.cholesky(a @ a.mT).pow(2).sum(),
        "qr": lambda a, b: sum(t.pow(2).sum() for t in torch.linalg.qr(a)) + torch.linalg.qr(a)[0].sum(),
        "lu_solve": lambda a, b: torch.linalg.solve(a, b).pow(2).sum(),
        "svd": lambda a, b: torch.linalg.svdvals(a).pow(3).sum(),
        "eigh": lambda a, b: torch.linalg.eigvalsh(a + a.mT).pow(3).sum(),
        "det": lambda a, b: torch.linalg.slogdet(a)[1].sum() + torch.linalg.det(a).sum(),
    }
    fn = fns[name]
    ac, bc = a.clone().requires_grad_(), b.clone().requires_grad_()
    fn(ac, bc).backward()
    at, bt = tpu(a).requires_grad_(), tpu(b).requires_grad_()
    with no_cpu_fallback():
        fn(at, bt).backward()
    check(at.grad, ac.grad, atol=1e-3, rtol=1e-3)
    if bc.grad is not None:
        check(bt.grad, bc.grad, atol=1e-3, rtol=1e-3)


def test_det_backward_non_contiguous():
    # det/slogdet's LU output is of A^T when A is contiguous (CPU's
    # convention, read by their backward): the lowering follows A's layout.
    a = well_conditioned((4, 4), 22)
    ac = a.clone().requires_grad_()
    torch.linalg.det(ac.mT).backward()
    at = tpu(a).requires_grad_()
    with no_cpu_fallback():
        torch.linalg.det(at.mT).backward()
    check(at.grad, ac.grad, atol=1e-3, rtol=1e-3)


def test_decompositions_float64():
    a = make((2, 5, 5), torch.float32, 23).double() + 5 * torch.eye(5, dtype=torch.float64)
    b = make((2, 5, 2), torch.float32, 24).double()
    tol = dict(atol=1e-10, rtol=1e-10)
    on_both(torch.linalg.solve, a, b, tol=tol)
    on_both(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), a, b, tol=tol)
    on_both(lambda a: torch.linalg.cholesky(a @ a.mT), a, tol=tol)
    on_both(torch.linalg.qr, a, tol=tol)
    on_both(torch.linalg.svdvals, a, tol=tol)
    on_both(lambda a: torch.linalg.eigvalsh(a + a.mT), a, tol=tol)
    on_both(torch.linalg.det, a, tol=tol)
