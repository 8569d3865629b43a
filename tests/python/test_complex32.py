"""complex32 (torch.complex32 / torch.chalf, ComplexHalf) on the device,
compared with PyTorch on CPU on the same inputs.

XLA has no complex<f16> element type: a complex32 storage holds each
element's 4 bytes (real f16, then imaginary f16) as one u32, so moves are
bit for bit (NaN payloads, infinities, subnormal parts, -0.0 kept), and
``torch.view_as_real`` is a float16 ``[..., 2]`` view of the same buffer.
Moves between complex32 tensors (copy, clone, zero, alias_copy, view_copy)
run as tpu programs; every other call with a complex32 tensor, Scalar or
result runs on the CPU, so it gives CPU's values (mul, add, abs, casts,
``half + 1j``) or CPU's error (sum, equal, unique, lt:
NotImplementedError).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import no_cpu_fallback, wait_for_compiles

warnings.filterwarnings("ignore", "ComplexHalf support is experimental")


def _all_f16_pairs():
    """complex32 values whose real parts are every f16 bit pattern (65536)
    and whose imaginary parts are the same patterns in another order."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    imag = bits[torch.randperm(65536, generator=torch.Generator().manual_seed(0))]
    pairs = torch.stack([bits, imag], dim=-1).contiguous()  # int16 [65536, 2]
    return pairs.view(torch.float16).view(torch.complex32).squeeze(-1)


def _bits(t):
    return t.cpu().contiguous().view(torch.int32)


def _assert_bits_equal(tpu, cpu):
    assert tpu.device.type == "tpu" and tpu.dtype == cpu.dtype == torch.complex32
    assert tpu.shape == cpu.shape
    assert torch.equal(_bits(tpu), cpu.contiguous().view(torch.int32))


def test_round_trip_is_bit_for_bit():
    x = _all_f16_pairs()
    d = x.to("tpu")
    assert d.dtype == torch.complex32 and d.device.type == "tpu"
    _assert_bits_equal(d, x)
    # A strided view moved in and out, and a copy into part of a storage.
    _assert_bits_equal(d[1::3], x[1::3])
    y = torch.zeros(70000, dtype=torch.complex32, device="tpu")
    y[100:100 + 65536] = x
    ref = torch.zeros(70000, dtype=torch.complex32)
    ref[100:100 + 65536] = x
    _assert_bits_equal(y, ref)


def test_moves_run_on_the_device_bit_for_bit():
    x = _all_f16_pairs()
    d = x.to("tpu")
    for _ in range(3):  # past the host-first calls: the device programs
        c = d.clone()
        e = torch.empty_like(d)
        e.copy_(d)
        s = d[::2].clone()
        z = d.clone().zero_()
    wait_for_compiles()
    with no_cpu_fallback():
        c = d.clone()
        e = torch.empty_like(d)
        e.copy_(d)
        s = d[::2].clone()
        z = d.clone().zero_()
    _assert_bits_equal(c, x)
    _assert_bits_equal(e, x)
    _assert_bits_equal(s, x[::2].clone())
    _assert_bits_equal(z, torch.zeros_like(x))


@pytest.mark.parametrize("value", [1 + 2j, -0.0, float("inf"), complex(float("nan"), 1), 3, True, 70000.0])
def test_fill_and_factories_as_cpu(value):
    cpu = torch.empty(5, dtype=torch.complex32).fill_(value)
    tpu = torch.empty(5, dtype=torch.complex32, device="tpu").fill_(value)
    _assert_bits_equal(tpu, cpu)
    _assert_bits_equal(torch.full((2, 3), value, dtype=torch.complex32, device="tpu"),
                       torch.full((2, 3), value, dtype=torch.complex32))
    _assert_bits_equal(torch.zeros(3, dtype=torch.complex32, device="tpu"), torch.zeros(3, dtype=torch.complex32))
    _assert_bits_equal(torch.ones(3, dtype=torch.complex32, device="tpu"), torch.ones(3, dtype=torch.complex32))


def _sample():
    g = torch.Generator().manual_seed(1)
    v = (torch.randn(2, 64, 2, generator=g) * 4).to(torch.float16)
    v[0, :4, 0] = torch.tensor([float("inf"), float("nan"), 6e-8, -0.0])  # specials and a subnormal part
    return v.view(torch.complex32).squeeze(-1)


@pytest.mark.parametrize("op", [
    lambda a, b: a * b, lambda a, b: a + b, lambda a, b: a - b,
    lambda a, b: a * 2.5, lambda a, b: a * (1 - 1j), lambda a, b: 100000 * a,
    lambda a, b: a.abs(), lambda a, b: a.neg(), lambda a, b: a.conj().resolve_conj(),
    lambda a, b: a.to(torch.complex64), lambda a, b: a.to(torch.float16),
    lambda a, b: a.to(torch.complex64).to(torch.complex32), lambda a, b: a == b,
    lambda a, b: torch.cat([a, b]), lambda a, b: torch.where(a.real > 0, a, b), lambda a, b: a[[3, 1]],
    lambda a, b: a.nonzero(), lambda a, b: a.masked_select(a.real > 0),
])
def test_ops_give_cpu_values(op):
    a, b = _sample()[0], _sample()[1]
    cpu = op(a, b)
    tpu = op(a.to("tpu"), b.to("tpu"))
    assert tpu.device.type == "tpu" and tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    if cpu.dtype == torch.complex32:
        _assert_bits_equal(tpu, cpu)
    else:
        torch.testing.assert_close(tpu.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


def test_casts_into_complex32_as_cpu():
    src = torch.tensor([1e-8 + 70000j, float("nan"), 65504.0 + 1j, -0.0], dtype=torch.complex64)
    cpu = src.to(torch.complex32)
    _assert_bits_equal(src.to("tpu").to(torch.complex32), cpu)
    dst = torch.zeros(6, dtype=torch.complex32, device="tpu")
    dst[1:5] = src.to("tpu")  # a cast into part of a complex32 storage
    ref = torch.zeros(6, dtype=torch.complex32)
    ref[1:5] = src
    _assert_bits_equal(dst, ref)


@pytest.mark.parametrize("scalar", [1j, complex(-2, 0), 2.5, 3])
def test_promotion_as_cpu(scalar):
    # A float16 0-d tensor with a Python complex is complex32 (CPU's rule).
    h = torch.tensor(1.5, dtype=torch.float16)
    cpu = h + scalar
    tpu = h.to("tpu") + scalar
    assert tpu.dtype == cpu.dtype
    assert torch.equal(tpu.cpu().view(torch.int32) if cpu.dtype == torch.complex32 else tpu.cpu(),
                       cpu.view(torch.int32) if cpu.dtype == torch.complex32 else cpu)
    c = torch.tensor(5.5 + 1j, dtype=torch.complex32)
    for other in (torch.tensor(2, dtype=torch.int64), torch.tensor(1.0, dtype=torch.float16),
                  torch.tensor(1.0, dtype=torch.float32), torch.tensor(1j, dtype=torch.complex128)):
        cpu = c * other
        tpu = c.to("tpu") * other.to("tpu")
        assert tpu.dtype == cpu.dtype == torch.result_type(c.to("tpu"), other.to("tpu"))
        torch.testing.assert_close(tpu.cpu().to(torch.complex128), cpu.to(torch.complex128), rtol=0, atol=0)


def test_view_as_real_is_a_view():
    x = _sample()[0]
    d = x.to("tpu")
    r = torch.view_as_real(d)
    assert r.dtype == torch.float16 and r.shape == (64, 2)
    assert torch.equal(r.cpu().view(torch.int16), torch.view_as_real(x).view(torch.int16))
    # Writes through the float16 view are seen by the complex32 tensor, and back.
    r[3, 1] = 7.0
    r[5] = torch.tensor([float("nan"), -0.0], dtype=torch.float16, device="tpu")
    xr = torch.view_as_real(x)
    xr[3, 1] = 7.0
    xr[5] = torch.tensor([float("nan"), -0.0], dtype=torch.float16)
    _assert_bits_equal(d, x)
    d[0] = 1 - 3j
    x[0] = 1 - 3j
    assert torch.equal(r.cpu().view(torch.int16), xr.view(torch.int16))
    # view_as_complex of a float16 [..., 2] tensor is a complex32 view.
    h = torch.randn(4, 2).to(torch.float16)
    c = torch.view_as_complex(h.to("tpu"))
    assert c.dtype == torch.complex32
    _assert_bits_equal(c, torch.view_as_complex(h))


@pytest.mark.parametrize("name, op", [
    ("sum", lambda a: a.sum()), ("equal", lambda a: torch.equal(a, a)), ("unique", lambda a: torch.unique(a)),
    ("lt", lambda a: a < a), ("div", lambda a: a / a), ("equal2", lambda a: torch.equal(a, a.clone())), ("take", lambda a: a.take(torch.tensor([0], device=a.device))),
])
def test_cpu_errors(name, op):
    a = _sample()[0]
    with pytest.raises(Exception) as cpu:
        op(a)
    with pytest.raises(type(cpu.value), match=str(cpu.value).split("\n")[0][:30].replace("(", r"\(")):
        op(a.to("tpu"))


def test_item_and_repr():
    x = torch.tensor([1.5 - 2j, float("inf")], dtype=torch.complex32)
    d = x.to("tpu")
    assert d[0].item() == x[0].item() and d[1].item() == x[1].item()
    assert repr(d.cpu()) == repr(x)
