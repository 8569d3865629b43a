"""Complex numbers on the device: complex64/complex128 storage, the views
view_as_real / view_as_complex / .real / .imag as true aliases of one
storage (writes through either are seen by the other, as on CPU), the
complex lowerings (arithmetic with PyTorch's promotion, abs/angle/conj,
polar/complex, matmul, sum/mean) and RoPE written with complex numbers as in
Meta's Llama reference, forward and backward — all compared with CPU on the
same inputs, with no CPU fallback.

Tolerances: complex64 results within rtol=1.3e-6/atol=1e-5 of CPU (float32
rounding of XLA's own complex kernels), complex128 within 1e-12."""
from __future__ import annotations

import pytest
import torch

from conftest import no_cpu_fallback

C64_TOL = dict(rtol=1.3e-6, atol=1e-5)
C128_TOL = dict(rtol=1e-12, atol=1e-12)


def _tol(dtype):
    return C128_TOL if dtype in (torch.complex128, torch.float64) else C64_TOL


def _rand(*shape, dtype=torch.complex64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=g)


def _check(tpu, cpu, **tol):
    assert tpu.device.type == "tpu"
    assert tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    torch.testing.assert_close(tpu.cpu(), cpu, **(tol or _tol(cpu.dtype)))


# ---------------------------------------------------------------------------
# Storage and views


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_round_trip_and_view_as_real_reads(dtype):
    x = _rand(3, 4, dtype=dtype)
    t = x.to("tpu")
    with no_cpu_fallback():
        r = torch.view_as_real(t)
        assert r.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert r.shape == (3, 4, 2) and r.stride() == (8, 2, 1)
        rr = r * 1  # a program reading the float view of a complex storage
        re, im = t.real * 1, t.imag * 1
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)
    torch.testing.assert_close(rr.cpu(), torch.view_as_real(x), rtol=0, atol=0)
    torch.testing.assert_close(re.cpu(), x.real, rtol=0, atol=0)
    torch.testing.assert_close(im.cpu(), x.imag, rtol=0, atol=0)


def test_writes_through_real_and_imag_are_seen_by_the_complex_tensor():
    x = _rand(4, 5)
    t = x.to("tpu")
    with no_cpu_fallback():
        for z in (x, t):
            z.real[1:3] = 7.0
            z.imag[:, 2].mul_(-3)
            z.imag[0] += z.real[0]
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["strict", "debug", "fused"])
def test_writes_through_view_as_real_and_view_as_complex_alias(mode):
    import torch_tpu

    base = torch.arange(24, dtype=torch.float32).reshape(3, 4, 2)
    t = base.to("tpu")
    with torch_tpu.eager_mode(mode), no_cpu_fallback():
        for f in (base, t):
            c = torch.view_as_complex(f)
            c[1] = c[1] * c[2]       # complex write into a float storage
            f[0, :, 1] = -1.0         # float write seen through c
            c[2].mul_(2)
            r = torch.view_as_real(c)
            r[2, 3] = torch.tensor([0.5, 0.25], device=f.device)
        got_c = torch.view_as_complex(t) * 1
    torch.testing.assert_close(t.cpu(), base, rtol=0, atol=0)
    torch.testing.assert_close(got_c.cpu(), torch.view_as_complex(base), rtol=0, atol=0)


def test_complex_storage_written_through_float_view():
    x = _rand(6)
    t = x.to("tpu")
    with no_cpu_fallback():
        for z in (x, t):
            r = torch.view_as_real(z)
            r[::2, 0] = 3.0
            r.add_(1)
        s = t * 1
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)
    torch.testing.assert_close(s.cpu(), x, rtol=0, atol=0)


@pytest.mark.parametrize(
    "base, view",
    [
        (torch.zeros(4, 3), lambda t: t),                                  # last dim not 2
        (torch.zeros(2, 4), lambda t: t.t()),                              # last dim stride != 1
        (torch.zeros(12), lambda t: t.as_strided((3, 2), (3, 1))),        # odd stride
        (torch.zeros(9), lambda t: t[1:].view(4, 2)),                     # odd storage offset
        (torch.zeros(4, 2, dtype=torch.int32), lambda t: t),               # not a float type
    ],
)
def test_view_as_complex_rejects_what_cpu_rejects(base, view):
    cpu = view(base)
    tpu = view(base.to("tpu"))
    assert tpu.stride() == cpu.stride() and tpu.storage_offset() == cpu.storage_offset()
    with pytest.raises(RuntimeError) as cpu_err:
        torch.view_as_complex(cpu)
    with pytest.raises(RuntimeError) as tpu_err:
        torch.view_as_complex(tpu)
    assert str(tpu_err.value).split("\n")[0] == str(cpu_err.value).split("\n")[0]


def test_view_as_real_rejects_conjugated_and_real():
    x = _rand(3).to("tpu")
    with pytest.raises(RuntimeError, match="view_as_real doesn't work on unresolved conjugated"):
        torch.view_as_real(x.conj())
    with pytest.raises(RuntimeError, match="view_as_real is only supported for complex"):
        torch.view_as_real(torch.zeros(3, device="tpu"))


# ---------------------------------------------------------------------------
# Arithmetic


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_binary_arithmetic_and_promotion(dtype):
    a, b = _rand(4, 5, dtype=dtype, seed=1), _rand(4, 5, dtype=dtype, seed=2)
    f = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    i = torch.arange(5)
    cases = {
        "add": lambda a, b, f, i: a + b,
        "add_alpha": lambda a, b, f, i: torch.add(a, b, alpha=2),
        "sub": lambda a, b, f, i: a - b,
        "mul": lambda a, b, f, i: a * b,
        "div": lambda a, b, f, i: a / b,
        "pow": lambda a, b, f, i: torch.pow(a, b),
        "pow_scalar2": lambda a, b, f, i: a ** 2,
        "pow_scalar_half": lambda a, b, f, i: a ** 0.5,
        "mul_float": lambda a, b, f, i: a * f,        # complex x float32 -> complex
        "add_int": lambda a, b, f, i: a + i,           # complex x int64 -> complex
        "mul_py_complex": lambda a, b, f, i: a * (2 - 1j),
        "float_times_py_complex": lambda a, b, f, i: f * 1j,  # float32 x complex -> complex64
        "rsub": lambda a, b, f, i: 1 - a,
        "eq": lambda a, b, f, i: a == a.clone(),
        "ne": lambda a, b, f, i: a != b,
        "where": lambda a, b, f, i: torch.where(f > 0, a, b),
    }
    with no_cpu_fallback():
        for name, fn in cases.items():
            want = fn(a, b, f, i)
            got = fn(a.to("tpu"), b.to("tpu"), f.to("tpu"), i.to("tpu"))
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got.cpu(), want, **_tol(dtype), msg=name)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_unary_math(dtype):
    x = _rand(64, dtype=dtype, seed=4)
    ops = {
        "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
        "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh, "neg": torch.neg,
        "reciprocal": torch.reciprocal, "log1p": torch.log1p, "expm1": torch.expm1,
        "sigmoid": torch.sigmoid, "sgn": torch.sgn, "abs": torch.abs, "angle": torch.angle,
        "conj_physical": torch.conj_physical, "isnan": torch.isnan, "isinf": torch.isinf,
    }
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.complex64 else dict(rtol=1e-10, atol=1e-10)
    with no_cpu_fallback():
        for name, fn in ops.items():
            want = fn(x)
            got = fn(x.to("tpu"))
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got.cpu(), want, **tol, msg=name)


def test_conj_bit_is_resolved_on_the_device():
    a, b = _rand(3, 4, seed=5), _rand(3, 4, seed=6)
    with no_cpu_fallback():
        got = a.to("tpu") * b.to("tpu").conj()
        res = b.to("tpu").conj().resolve_conj()
        imag_of_conj = b.to("tpu").conj().imag * 1
    _check(got, a * b.conj())
    _check(res, b.conj().resolve_conj())
    torch.testing.assert_close(imag_of_conj.cpu(), b.conj().imag, rtol=0, atol=0)


def test_polar_complex_abs_angle():
    r = torch.rand(5, 6, generator=torch.Generator().manual_seed(7)) + 0.1
    th = torch.randn(5, 6, generator=torch.Generator().manual_seed(8))
    with no_cpu_fallback():
        z = torch.polar(r.to("tpu"), th.to("tpu"))
        w = torch.complex(r.to("tpu"), th.to("tpu"))
        ab, an = z.abs(), z.angle()
        real_angle = torch.angle(th.to("tpu"))
    _check(z, torch.polar(r, th))
    _check(w, torch.complex(r, th))
    torch.testing.assert_close(ab.cpu(), torch.polar(r, th).abs(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(an.cpu(), torch.polar(r, th).angle(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(real_angle.cpu(), torch.angle(th), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_matmul_bmm_einsum_sum_mean(dtype):
    a, b = _rand(2, 3, 4, dtype=dtype, seed=9), _rand(2, 4, 5, dtype=dtype, seed=10)
    m = _rand(4, 5, dtype=dtype, seed=11)
    cases = {
        "matmul": lambda a, b, m: a @ b,
        "bmm": lambda a, b, m: torch.bmm(a, b),
        "mm": lambda a, b, m: a[0] @ m,
        "einsum": lambda a, b, m: torch.einsum("bij,bjk->bik", a, b),
        "vdot": lambda a, b, m: torch.vdot(m[0], m[1]),
        "sum": lambda a, b, m: a.sum(),
        "sum_dim": lambda a, b, m: a.sum(dim=1),
        "mean": lambda a, b, m: a.mean(dim=(0, 2)),
        "prod": lambda a, b, m: a.prod(dim=-1),
    }
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.complex64 else C128_TOL
    with no_cpu_fallback():
        for name, fn in cases.items():
            want = fn(a, b, m)
            got = fn(a.to("tpu"), b.to("tpu"), m.to("tpu"))
            torch.testing.assert_close(got.cpu(), want, **tol, msg=name)


# ---------------------------------------------------------------------------
# RoPE written with complex numbers (Meta's Llama reference / TorchTitan)


def _precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, device="cpu"):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def _reshape_for_broadcast(freqs_cis, x):
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def _apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = _reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


@pytest.mark.parametrize("mode", ["strict", "debug", "fused"])
def test_complex_rope_forward_backward_matches_cpu(mode):
    import torch_tpu

    bsz, seqlen, heads, head_dim = 2, 8, 3, 16
    g = torch.Generator().manual_seed(12)
    xq = torch.randn(bsz, seqlen, heads, head_dim, generator=g)
    xk = torch.randn(bsz, seqlen, heads, head_dim, generator=g)
    wq = torch.randn(bsz, seqlen, heads, head_dim, generator=g)

    def run(device):
        q = xq.detach().clone().to(device).requires_grad_()
        k = xk.detach().clone().to(device).requires_grad_()
        fc = _precompute_freqs_cis(head_dim, seqlen, device=device)
        oq, ok = _apply_rotary_emb(q, k, fc)
        loss = (oq * wq.to(device)).sum() + (ok * ok).sum()
        loss.backward()
        return oq, ok, q.grad, k.grad, loss

    want = run("cpu")
    with torch_tpu.eager_mode(mode), no_cpu_fallback():
        got = run("tpu")
        got = [t.cpu() for t in got]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_.detach(), rtol=1e-5, atol=1e-5)


def test_complex_rope_with_cpu_fallback_disabled():
    """TORCH_TPU_CPU_FALLBACK=0 makes any op without a lowering an error."""
    from conftest import run_python

    code = """
import torch, torch_tpu
freqs = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, device="tpu").float() / 8))
freqs_cis = torch.polar(torch.ones(4, 4, device="tpu"), torch.outer(torch.arange(4, device="tpu").float(), freqs))
x = torch.randn(1, 4, 2, 8, device="tpu", requires_grad=True)
x_ = torch.view_as_complex(x.float().reshape(1, 4, 2, -1, 2))
out = torch.view_as_real(x_ * freqs_cis.view(1, 4, 1, 4)).flatten(3)
out.pow(2).sum().backward()
ref = torch.view_as_real(torch.view_as_complex(x.detach().cpu().reshape(1, 4, 2, -1, 2)) * freqs_cis.cpu().view(1, 4, 1, 4)).flatten(3)
torch.testing.assert_close(out.detach().cpu(), ref, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(x.grad.cpu(), 2 * x.detach().cpu(), rtol=1e-5, atol=1e-5)  # |rotation| = 1
print("ok", sum(torch_tpu.metrics()["cpu_fallbacks"].values()))
"""
    r = run_python(code, env={"TORCH_TPU_CPU_FALLBACK": "0"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", "0"]


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_complex_view_of_an_odd_float_storage(mode):
    """A complex view of 8 of 9 floats: the 9th float is untouched by writes."""
    import torch_tpu

    base = torch.arange(9.0)
    t = base.to("tpu")
    with torch_tpu.eager_mode(mode), no_cpu_fallback():
        for f in (base, t):
            c = torch.view_as_complex(f[:8].view(4, 2))
            c.mul_(1j)
            c[1:3] = 5
            c[3] = 2 - 3j
        got = torch.view_as_complex(t[:8].view(4, 2)) * 2
    torch.testing.assert_close(t.cpu(), base, rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), torch.view_as_complex(base[:8].view(4, 2)) * 2, rtol=0, atol=0)


def test_complex_fills_and_factories():
    with no_cpu_fallback():
        got = [torch.full((2, 3), 1 - 2j, device="tpu"), torch.zeros(3, dtype=torch.complex64, device="tpu"),
               torch.ones(2, dtype=torch.complex128, device="tpu"),
               torch.full_like(torch.zeros(2, 2, dtype=torch.complex64, device="tpu"), 3j)]
    want = [torch.full((2, 3), 1 - 2j), torch.zeros(3, dtype=torch.complex64),
            torch.ones(2, dtype=torch.complex128), torch.full_like(torch.zeros(2, 2, dtype=torch.complex64), 3j)]
    for g, w in zip(got, want):
        _check(g, w, rtol=0, atol=0)
    # a complex value into a real tensor: CPU's check decides (it raises)
    with pytest.raises(RuntimeError) as cpu_err:
        torch.zeros(2).fill_(1j)
    with pytest.raises(RuntimeError) as tpu_err:
        torch.zeros(2, device="tpu").fill_(1j)
    assert str(tpu_err.value).split("\n")[0] == str(cpu_err.value).split("\n")[0]
