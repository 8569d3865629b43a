"""float8 tensors on the device: torch.float8_e5m2, float8_e4m3fn,
float8_e5m2fnuz, float8_e4m3fnuz and float8_e8m0fnu stored as StableHLO's
f8E5M2 / f8E4M3FN / f8E5M2FNUZ / f8E4M3FNUZ / f8E8M0FNU, compared with
PyTorch on CPU on the same inputs.

Casts are compared bit for bit with CPU's ``.to()``: into float8 from every
bf16 and f16 bit pattern, from the f32 values at and one or two ulps around
every rounding boundary of each float8 type (plus subnormals, max, beyond
max, +-inf, NaN, -0.0), from f64 values just off those boundaries (PyTorch
rounds through float), and from integers, bool and complex; out of float8
from all 256 bit patterns to every other dtype. Two exceptions, both stated
where they are checked: a NaN result is compared as "both NaN" (PyTorch's
NaN payloads differ per type, and XLA's differ again), and float -> integer
is compared only for values the integer type holds (out-of-range float ->
int conversion is undefined behaviour in C++ and differs between CPU
kernels).

Ops: the moves, fills, casts, cat/stack, index_select/index and where that
CPU supports for float8 run as tpu programs (no CPU fallback); every other
op on a float8 tensor runs on the CPU, so it gives CPU's values (mul, abs,
eq, matmul, ...) or CPU's error (add, sum, sort, ...: NotImplementedError).
"""
from __future__ import annotations

import pytest
import torch

from conftest import no_cpu_fallback

F8 = [torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz, torch.float8_e8m0fnu]
F8_IDS = [str(d).removeprefix("torch.") for d in F8]
INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}


def _all_f8(dtype):
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)


def _assert_f8_bits_equal(tpu, cpu, src):
    assert tpu.device.type == "tpu" and tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    t = tpu.cpu()
    both_nan = t.float().isnan() & cpu.float().isnan()
    bad = ((t.view(torch.uint8) != cpu.view(torch.uint8)) & ~both_nan).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {cpu.numel()} casts to {cpu.dtype} differ from CPU, e.g. "
        + ", ".join(f"{src.flatten()[i].item()!r}: cpu {cpu.view(torch.uint8).flatten()[i].item():#04x} "
                    f"tpu {t.view(torch.uint8).flatten()[i].item():#04x}" for i in bad[:5].tolist()))
    assert torch.equal(t.float().isnan(), cpu.float().isnan())


def _boundary_f32(dtype):
    """f32 values at, and 1-2 ulps either side of, every midpoint between
    consecutive finite float8 values, the float8 values themselves, and the
    specials."""
    v = _all_f8(dtype).float()
    v = v[v.isfinite()].unique()  # sorted
    mids = (v[1:] + v[:-1]) / 2  # exact in f32 (float8 has few mantissa bits)
    top = v[-1]
    above = torch.stack([top * 1.0625, top * 1.125, top * 1.5, top * 2, top * 1e6])
    base = torch.cat([v, mids, above, -above, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                                                             -float("nan"), 1e-30, -1e-30, 1e-45, 3e38])])
    out = [base]
    for k in (1, 2):
        up, down = base.clone(), base.clone()
        for _ in range(k):
            up = torch.nextafter(up, torch.tensor(float("inf")))
            down = torch.nextafter(down, torch.tensor(-float("inf")))
        out += [up, down]
    return torch.cat(out)


# ---------------------------------------------------------------------------
# Storage


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_round_trip_every_bit_pattern(dtype):
    x = _all_f8(dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and t.element_size() == 1
    assert torch.equal(t.cpu().view(torch.uint8), x.view(torch.uint8))
    # uint8 <-> float8 views of one storage, both ways.
    with no_cpu_fallback():
        u = t.view(torch.uint8)
        back = u.view(dtype)
    assert u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert torch.equal(u.cpu(), x.view(torch.uint8))
    assert torch.equal(back.cpu().view(torch.uint8), x.view(torch.uint8))


# ---------------------------------------------------------------------------
# Casts into float8, bit for bit with CPU


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
@pytest.mark.parametrize("src", ["bf16", "f16"])
def test_cast_every_16_bit_pattern(dtype, src):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16 if src == "bf16" else torch.float16)
    with no_cpu_fallback():
        t = x.to("tpu").to(dtype)
    _assert_f8_bits_equal(t, x.to(dtype), x)


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_cast_from_f32_around_every_rounding_boundary(dtype):
    x = _boundary_f32(dtype)
    with no_cpu_fallback():
        t = x.to("tpu").to(dtype)
    _assert_f8_bits_equal(t, x.to(dtype), x)


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_cast_from_f64_rounds_through_float(dtype):
    x32 = _boundary_f32(dtype).double()
    # f64 values just off the f32 midpoints: PyTorch rounds them to f32
    # first (onto the midpoint, then ties to even), not straight to float8.
    x = torch.cat([x32, x32 * (1 + 2.0 ** -40), x32 * (1 - 2.0 ** -40), torch.tensor([1e300, -1e300, 1e-300])])
    with no_cpu_fallback():
        t = x.to("tpu").to(dtype)
    _assert_f8_bits_equal(t, x.to(dtype), x)


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_cast_from_integers_bool_complex(dtype):
    ints = torch.tensor([0, 1, -1, 2, 3, 7, 100, 255, 448, 500, 1000, 57344, 65504, 70000, -70000, 2**31 - 1,
                         -2**31, 2**40 + 1, 2**62])
    sources = [ints, ints.to(torch.int32), ints.clamp(-128, 127).to(torch.int8), ints.clamp(0, 255).to(torch.uint8),
               ints.clamp(-32768, 32767).to(torch.int16), torch.tensor([True, False, True]),
               torch.complex(_boundary_f32(dtype)[:64], torch.ones(64))]
    for x in sources:
        with no_cpu_fallback():
            t = x.to("tpu").to(dtype)
        _assert_f8_bits_equal(t, x.to(dtype), x)


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_float8_to_float8(dtype):
    x = _all_f8(dtype)
    for to in F8:
        with no_cpu_fallback():
            t = x.to("tpu").to(to)
        _assert_f8_bits_equal(t, x.to(to), x)


# ---------------------------------------------------------------------------
# Casts out of float8


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_cast_to_floating_every_bit_pattern(dtype):
    x = _all_f8(dtype)
    for to in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64):
        with no_cpu_fallback():
            t = x.to("tpu").to(to).cpu()
        c = x.to(to)
        if to == torch.complex64:
            t, c = torch.view_as_real(t), torch.view_as_real(c)
        nan = c.isnan()
        assert torch.equal(t.isnan(), nan), to
        # Bit for bit (so -0.0, subnormals and the e8m0 2^-127 too), NaNs aside.
        iv = INT_VIEW[t.dtype]
        assert torch.equal(t[~nan].view(iv), c[~nan].view(iv)), to


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_cast_to_integers_and_bool(dtype):
    x = _all_f8(dtype)
    f = x.float()
    for to, lo, hi in ((torch.int64, -2.0**63, 2.0**63), (torch.int32, -2.0**31, 2.0**31), (torch.int16, -32768, 32768),
                       (torch.int8, -128, 128), (torch.uint8, 0, 256)):
        # Only values the integer type holds: out-of-range float -> int is
        # undefined behaviour in C++ (CPU's own kernels disagree on it).
        keep = f.isfinite() & (f > lo - 1) & (f < hi)
        with no_cpu_fallback():
            t = x.to("tpu").to(to).cpu()
        assert torch.equal(t[keep], x.to(to)[keep]), to
    with no_cpu_fallback():
        t = x.to("tpu").to(torch.bool).cpu()
    assert torch.equal(t, x.to(torch.bool))


# ---------------------------------------------------------------------------
# Moves, fills, indexing (tpu programs, compared with CPU)


def _sample(dtype, *shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 8).to(dtype)


def _same(tpu, cpu):
    assert tpu.device.type == "tpu" and tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    assert torch.equal(tpu.cpu().view(torch.uint8), cpu.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_views_and_copies(dtype):
    x = _sample(dtype, 4, 6)
    t = x.to("tpu")
    with no_cpu_fallback():
        _same(t.reshape(3, 8), x.reshape(3, 8))
        _same(t.t().contiguous(), x.t().contiguous())
        _same(t[1:3, ::2].clone(), x[1:3, ::2].clone())
        _same(t[:1].expand(3, 6).contiguous(), x[:1].expand(3, 6).contiguous())
        _same(t.unsqueeze(0).permute(2, 0, 1).contiguous(), x.unsqueeze(0).permute(2, 0, 1).contiguous())
        d = torch.empty(4, 6, dtype=dtype, device="tpu")
        d.copy_(t)
        _same(d, x)
        d[1].copy_(t[2])  # a write through a view
        xd = x.clone()
        xd[1].copy_(x[2])
        _same(d, xd)


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_index_select_cat_stack_where_index(dtype):
    x = _sample(dtype, 5, 4)
    y = _sample(dtype, 2, 4, seed=1)
    t, u = x.to("tpu"), y.to("tpu")
    idx = torch.tensor([4, 0, 0, 2])
    cond = torch.randn(5, 4, generator=torch.Generator().manual_seed(2)) > 0
    with no_cpu_fallback():
        _same(t.index_select(0, idx.to("tpu")), x.index_select(0, idx))
        cols = torch.tensor([3, 0, 3])
        _same(t.index_select(1, cols.to("tpu")), x.index_select(1, cols))
        _same(torch.cat([t, u]), torch.cat([x, y]))
        _same(torch.stack([t[:2], u]), torch.stack([x[:2], y]))
        _same(torch.where(cond.to("tpu"), t, t[0]), torch.where(cond, x, x[0]))
        _same(t[idx.to("tpu")], x[idx])
        _same(t[cond.to("tpu")], x[cond])


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_fills_and_factories(dtype):
    with no_cpu_fallback():
        for v in (0.0, 1.0, -3.0, 0.3, 2.0**-9, 448.0, float("nan")):
            try:
                c = torch.full((3,), v, dtype=dtype)
            except RuntimeError:  # out of range for this type: the next test
                continue
            _same(torch.full((3,), v, dtype=dtype, device="tpu"), c)
            _same(torch.empty(3, dtype=dtype, device="tpu").fill_(v), c)
        _same(torch.zeros(2, 3, dtype=dtype, device="tpu"), torch.zeros(2, 3, dtype=dtype))
        _same(torch.ones(2, 3, dtype=dtype, device="tpu"), torch.ones(2, 3, dtype=dtype))
        _same(_sample(dtype, 4).to("tpu").zero_(), torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_fill_value_that_does_not_fit_raises_like_cpu(dtype):
    for v in (1e6, 1e39, float("inf"), -3.0, 448.0, 241.0, float("nan")):
        try:
            torch.zeros(2, dtype=dtype).fill_(v)
        except RuntimeError as e:
            with pytest.raises(RuntimeError, match="cannot be converted"):
                torch.zeros(2, dtype=dtype, device="tpu").fill_(v)
            assert "cannot be converted" in str(e)
        else:
            _same(torch.zeros(2, dtype=dtype, device="tpu").fill_(v), torch.zeros(2, dtype=dtype).fill_(v))


# ---------------------------------------------------------------------------
# Everything else: CPU's values or CPU's error


UNSUPPORTED_ON_CPU = {
    "add": lambda x: x + x, "neg": lambda x: -x, "sum": lambda x: x.sum(), "max": lambda x: x.max(),
    "sort": lambda x: x.sort(), "flip": lambda x: x.flip(0), "lt": lambda x: x < x,
    "gather": lambda x: x.gather(0, torch.zeros(2, dtype=torch.long, device=x.device)),
    "masked_fill": lambda x: x.masked_fill(torch.ones_like(x, dtype=torch.bool), 1.0),
}
SUPPORTED_ON_CPU = {
    "mul": lambda x: x * x, "abs": lambda x: x.abs(), "eq": lambda x: x == x[:1],
    "ne": lambda x: x != x[:1], "isnan": lambda x: x.isnan(), "mm": lambda x: x.reshape(2, 2) @ x.reshape(2, 2),
}


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_other_ops_give_cpu_values_or_cpu_errors(dtype):
    x = _sample(dtype, 4)
    t = x.to("tpu")
    for name, fn in {**UNSUPPORTED_ON_CPU, **SUPPORTED_ON_CPU}.items():
        try:
            c = fn(x)
        except Exception as e:  # noqa: BLE001 - the same type must come from tpu
            with pytest.raises(type(e)):
                fn(t)
            continue
        r = fn(t)
        if isinstance(c, torch.Tensor):
            assert r.device.type == "tpu" and r.dtype == c.dtype, name
            if c.dtype in F8:
                _same(r, c)
            else:
                assert torch.equal(r.cpu(), c), name


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_printing_and_item(dtype):
    x = _all_f8(dtype)[::9]
    t = x.to("tpu")
    def same_text(a, b):  # repr wraps its lines after adding device='tpu:0'
        return a.replace("device='tpu:0',", "").split() == b.split()
    assert same_text(repr(t), repr(x)), (repr(t), repr(x))
    assert same_text(str(t[3]), str(x[3])), (str(t[3]), str(x[3]))
    y = _sample(dtype, 3)
    assert y.to("tpu").tolist() == y.tolist()
    assert y.to("tpu")[1].item() == y[1].item()


def test_same_bits_from_a_warm_executable_cache(tmp_path):
    # Executables the XLA CPU plugin loads from the disk cache flush
    # denormals, which moved float8 casts off CPU's bits (2^-15 -> e5m2fnuz
    # gave 0x06, not 0x04; f64 -> e8m0fnu lost f32 subnormals), so float8
    # programs are not disk-cached (runtime/disk_cache.h). Two processes on
    # one fresh cache: the second must give CPU's bits too.
    code = (
        "import torch, torch_tpu\n"
        "x = torch.tensor([2.0**-15, 1.75 * 2**-15, -2.0**-15, -45055.996, 8.8e-39], dtype=torch.float64)\n"
        "for d in (torch.float8_e5m2fnuz, torch.float8_e5m2, torch.float8_e8m0fnu):\n"
        "    t = x.to('tpu').to(d).cpu().view(torch.uint8)\n"
        "    assert torch.equal(t, x.to(d).view(torch.uint8)), (d, t, x.to(d).view(torch.uint8))\n"
        "print('ok', torch_tpu.metrics()['disk_cache_hits'])\n")
    from conftest import run_python
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path)}
    for _ in range(2):
        r = run_python(code, env=env, timeout=300)
        assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("dtype", F8, ids=F8_IDS)
def test_no_promotion_with_other_dtypes_like_cpu(dtype):
    # CPU: "Promotion for Float8 Types is not supported" for a float8 beside
    # another dtype; a Python scalar converts to the float8 type.
    x = _sample(dtype, 4)
    f = torch.randn(4)
    t, u = x.to("tpu"), f.to("tpu")
    cond = f > 0
    for fn in (lambda a, b: torch.cat([a, b]), lambda a, b: torch.stack([a, b]),
               lambda a, b: torch.where(cond.to(a.device), a, b), lambda a, b: torch.cat([a, b.to(torch.bfloat16)])):
        with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
            fn(x, f)
        with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
            fn(t, u)
    # (Out-of-range values differ: CPU's where casts the value unchecked,
    # e5m2 -> inf; tpu raises "cannot be converted", as it does for
    # float16/bfloat16.)
    for v in (1.0, 0.3, 2.0, 3.0, 200.0):
        try:
            c = torch.where(cond, x, v)
        except RuntimeError as e:
            with pytest.raises(type(e)):
                torch.where(cond.to("tpu"), t, v)
            continue
        _same(torch.where(cond.to("tpu"), t, v), c)
