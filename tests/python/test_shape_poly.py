"""Shape-polymorphic eager programs and storage capacity (docs/design.md,
"Memory model" capacity and "One ATen call" dynamic dims).

- Storage buffers hold runtime.Capacity(n) >= n elements (16 up to 16, else
  8 buckets per power of two); what PyTorch sees (nbytes, values, host
  reads, element reads, in-place host copies, DLPack) is unchanged.
- Once an op has compiled for OpCache::kPolyAfter (2) shapes differing only
  in a leading dim, a call whose leading dim n >= 1 runs the program of n's
  bucket, n a runtime input: elementwise ops, casts and copies compute the
  bucket's rows (the padding rows are never visible), reductions fill the
  padding rows with their identity (sum/any 0, prod/all 1, amax -inf or the
  integer minimum, amin +inf or the maximum).

Every expected value is CPU PyTorch's on the same inputs: exact for
integers and bool, and for the floating ops below whose CPU result is one
rounding of the same operations (elementwise ops); sums and products within
float32's torch.testing tolerance (the reduction order differs). Compiles
are counted (torch_tpu.metrics()["compiles"]) to show that one program
serves a bucket.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch_tpu

from conftest import no_cpu_fallback, run_python

TPU = torch.device("tpu", 0)
# Debug mode (the same programs, checked op by op) in the full tier: make test-full.
MODES = ["strict", pytest.param("debug", marks=pytest.mark.full_tier)]
# Bucket edges (16, 20, 128, 144): b-1, b, b+1, and 0, 1. Every length compiles at most once per
# op and bucket, so the sweep stays short; the first two lengths of a family compile exact programs.
EDGE_LENGTHS = [0, 1, 15, 16, 17, 19, 20, 21, 127, 128, 129, 143, 144, 145]


def capacity(n: int) -> int:
    """runtime::Capacity, restated (the test checks the documented rule)."""
    if n <= 0:
        return 0
    if n <= 16:
        return 16
    p = 1 << ((n - 1).bit_length() - 1)  # n in (p, 2p]
    step = p // 8
    return -(-n // step) * step


def poly_bucket(n: int) -> int:
    """compiled_op.cpp PolyBucket, restated, for a family whose extents span an octave and whose
    buffers are not the storage's (multi-dim, dims before the dynamic one, mm rows): the next
    power of two, at least 16. Other families: capacity(n)."""
    return 16 if n <= 16 else 1 << (n - 1).bit_length()


def _data(n, dtype=torch.float32, seed=0, special=True, shape_rest=()):
    g = torch.Generator().manual_seed(seed + n)
    if dtype.is_floating_point:
        x = torch.randn((n, *shape_rest), generator=g, dtype=torch.float64).to(dtype)
        if special and n >= 4:
            x.view(-1)[1] = math.nan
            x.view(-1)[2] = math.inf
            x.view(-1)[3] = -math.inf
        return x
    if dtype == torch.bool:
        return torch.randint(0, 2, (n, *shape_rest), generator=g).bool()
    return torch.randint(-50, 50, (n, *shape_rest), generator=g).to(dtype)


def _same(actual, expected, exact=True):
    assert actual.device.type == "tpu"
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if exact:
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, equal_nan=True)
    else:  # sums/products of many elements in another order: the OpInfo harness's reduction tolerance
        torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=5e-5, equal_nan=True)


def _compiles():
    return torch_tpu.metrics()["compiles"]


@pytest.fixture(params=MODES)
def mode(request):
    with torch_tpu.eager_mode(request.param):
        yield request.param


# --- capacity -------------------------------------------------------------

def test_capacity_rule_and_overhead():
    for n in range(0, 5000):
        c = capacity(n)
        assert c >= n
        if n > 16:
            assert c - n < n / 8, n  # under 12.5%
        for k in (2, 4, 8, 16):
            if n % k == 0:
                assert c % k == 0, (n, k)  # reinterprets as k-wide elements


@pytest.mark.parametrize("n", [0, 1, 17, 19, 1000])
def test_capacity_invisible(mode, n):
    """Host reads, element reads, in-place host copies, resizes, dtype views
    and DLPack see the storage's elements only."""
    x = _data(n, special=False)
    t = x.to(TPU)
    assert t.untyped_storage().nbytes() == x.untyped_storage().nbytes()
    _same(t, x)
    y = (t * 2 + 1)
    _same(y, x * 2 + 1)
    assert y.untyped_storage().nbytes() == 4 * n
    if n:
        assert y[n - 1].item() == (x[n - 1] * 2 + 1).item()
        assert [v.item() for v in y] == [v.item() for v in x * 2 + 1]
    t.copy_(x.flip(0))  # host copy into the (padded) buffer, in place where possible
    _same(t, x.flip(0))
    _same(t.view(torch.int32), x.flip(0).view(torch.int32))
    _same(t.view(torch.uint8), x.flip(0).view(torch.uint8))
    u = torch.empty(n, device=TPU)
    u.copy_(y)
    _same(u, x * 2 + 1)
    z = y.clone()
    z.resize_(n + 3)
    _same(z[:n], x * 2 + 1)
    if n:
        back = torch.from_dlpack(torch.utils.dlpack.to_dlpack(y))
        _same(back, x * 2 + 1)


# --- churn detection and compile counts ------------------------------------

def test_static_workload_pays_nothing(strict):
    x = torch.randn(100).to(TPU)
    (x * 3 + 1).cpu()
    (x * 3 + 1).cpu()  # a key compiles at its second call (TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2)
    before = _compiles()
    for _ in range(5):
        (x * 3 + 1).cpu()
    assert _compiles() == before


@pytest.fixture
def strict():
    with torch_tpu.eager_mode("strict"):
        yield


def test_twenty_lengths_bounded_compiles(strict):
    """x*2+1 (mul, add) and x.sum() over 20 lengths in (64, 128]: buckets 72, 80, ..., 128.
    Each op compiles at most kPolyAfter static programs plus one per bucket."""
    # Unusual constants and dtype (float64) so that no earlier test warmed these families.
    lengths = list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    before = _compiles()
    for n in lengths:
        x = _data(n, torch.float64, special=False)
        t = x.to(TPU)
        for _ in range(2):  # a key (exact or bucket) compiles at its second call
            _same(t * 2.5 + 1.25, x * 2.5 + 1.25)
            _same(t.sum(), x.sum(), exact=False)
    compiles = _compiles() - before
    bound = 3 * (2 + len(buckets))  # mul, add, sum
    assert compiles <= bound, (compiles, bound)
    assert compiles < 3 * len(lengths)
    # Later lengths of the same buckets compile nothing.
    before = _compiles()
    for n in [102, 111, 117, 119]:
        x = _data(n, torch.float64, seed=7, special=False)
        t = x.to(TPU)
        _same(t * 2.5 + 1.25, x * 2.5 + 1.25)
        _same(t.sum(), x.sum(), exact=False)
    assert _compiles() == before


SECOND_PASS = r"""
import json
import torch, torch_tpu
torch_tpu.set_eager_mode("strict")
name = {"mul": "aten::mul.Tensor", "linear": "aten::addmm"}[op]
fn = {"mul": lambda x, w, b: x * 3.375,
      "linear": lambda x, w, b: torch.nn.functional.linear(x, w, b)}[op]
def op_compiles():  # XLA compiles of the op (host-served calls compile nothing)
    return torch_tpu.metrics()["compiles_by_op"].get(name, {}).get("compiles", 0)
g = torch.Generator().manual_seed(3)
w = torch.randn(5, 7, generator=g, dtype=torch.float64)
b = torch.randn(5, generator=g, dtype=torch.float64)
xs = [torch.randn(n, 7, generator=g, dtype=torch.float64) for n in (3, 5, 7, 9)]
ts, wt, bt = [x.to("tpu") for x in xs], w.to("tpu"), b.to("tpu")
compiles, err = [], 0.0
for p in range(3):
    before = op_compiles()
    for x, t in zip(xs, ts):
        y = fn(t, wt, bt).cpu()
        assert y.dtype == torch.float64 and y.shape == fn(x, w, b).shape
        err = max(err, (y - fn(x, w, b)).abs().max().item())
    compiles.append(op_compiles() - before)
print(json.dumps({"compiles": compiles, "err": err}))
"""


@pytest.mark.parametrize("op", ["mul", "linear"])
def test_second_pass_runs_the_bucket_program(op, tmp_path):
    """A loop over lengths, run three times (fresh process, empty cache).
    Its first pass serves the family's first two lengths on the host
    (host-first: a key compiles at its second call) and counts them as the
    family's exact shapes; the later lengths share the bucket program, which
    compiles once. In later passes those first two keys run the bucket
    program that serves their lengths too, and the op compiles nothing (an
    exact program was compiled for each of them before: a 20-length
    transformer block compiled 8 exact addmm programs in its second pass).
    Their input buffers may be copied to the bucket's size
    (tpu::resize_buffer, not counted). Lengths 3, 5, 7, 9 all lie in bucket
    16. Values: CPU's, exact for mul; linear within float64 rounding."""
    r = run_python(f"op = {op!r}\n" + SECOND_PASS,
                   env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiles"] == [1, 0, 0], out
    assert out["err"] <= (0.0 if op == "mul" else 1e-12), out


STATIC_TWO_SHAPES = r"""
import torch, torch_tpu
torch_tpu.set_eager_mode("strict")
g = torch.Generator().manual_seed(5)
xs = [torch.randn(32, 256, generator=g), torch.randn(32, 128, generator=g)]  # one dim-1 family
ts = [x.to("tpu") for x in xs]
for _ in range(4):
    for x, t in zip(xs, ts):  # both shapes' first calls come before either's second
        torch.testing.assert_close(torch.relu(t).cpu(), torch.relu(x), rtol=0, atol=0)
m = torch_tpu.metrics()
print("RELU", m["compiles_by_op"]["aten::relu"]["compiles"])
"""


def test_static_two_shapes_keep_exact_programs(tmp_path):
    """A static workload with two shapes of one family (relu of [32, 256]
    and [32, 128], alternating: the first calls of both are host-served and
    count toward the family before either is called again) compiles an
    exact program for each: a key served on the host takes only a bucket
    program that exists, never builds one. Both shapes running a bucket
    program for good (32 dynamic slices in and out) took 2.1x the exact
    programs' time (review of c140433). TORCH_TPU_DUMP_HLO prints each
    compiled module: no dynamic_slice among them."""
    r = run_python(STATIC_TWO_SHAPES, env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_DUMP_HLO": "1",
                                           "TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RELU 2" in r.stdout, r.stdout[-2000:]
    dump = r.stdout + r.stderr
    assert dump.count("func.func public @main") >= 2, dump[-2000:]  # the compiled modules are printed
    assert "dynamic_slice" not in dump, "a bucket program serves a static shape"


def test_disabled_by_env():
    code = (
        "import torch, torch_tpu\n"
        "t0 = torch_tpu.metrics()['compiles']\n"
        "for n in range(101, 111):\n"
        "    x = torch.arange(n, dtype=torch.float64)\n"
        "    assert torch.equal((x.to('tpu') * 3).cpu(), x * 3)\n"
        "print(torch_tpu.metrics()['compiles'] - t0)\n"
    )
    # Each length is called once: TORCH_TPU_HOST_FIRST_COMPILE_AFTER=1 compiles
    # every program at its first call (the default, 2, compiles a key at its
    # second call: the exact programs of lengths called once never compile).
    once = {"TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "1"}
    on = run_python(code, env=once, timeout=300)
    off = run_python(code, env={"TORCH_TPU_SHAPE_POLY": "0", **once}, timeout=300)
    assert on.returncode == 0, on.stderr
    assert off.returncode == 0, off.stderr
    assert int(off.stdout.split()[-1]) == 10
    assert int(on.stdout.split()[-1]) <= 2 + 2  # 2 static, then buckets 104 and 112


# --- families --------------------------------------------------------------

def _sweep(fn, dtypes=(torch.float32,), lengths=EDGE_LENGTHS, exact=True, rest=(), nargs=1, special=True):
    with no_cpu_fallback():
        for dtype in dtypes:
            for n in lengths:
                xs = [_data(n, dtype, seed=i, special=special, shape_rest=rest) for i in range(nargs)]
                expected = fn(*xs)
                actual = fn(*[x.to(TPU) for x in xs])
                _same(actual, expected, exact=exact)


ELEMENTWISE = {
    "mul_add": (lambda x: x * 2 + 1, 1),
    "sub_scalar_alpha_abs": (lambda x: torch.sub(x, 3, alpha=2).abs(), 1),
    "exp": (lambda x: torch.exp(x), 1),
    "add_maximum": (lambda x, y: torch.maximum(x + y, y), 2),
    "where_lt": (lambda x, y: torch.where(x < y, x, y), 2),
    "clamp_nan_to_num": (lambda x: torch.nan_to_num(x.clamp(-0.5, 0.5), nan=0.0), 1),
    "addcmul": (lambda x, y, z: torch.addcmul(x, y, z, value=0.5), 3),  # CPU may fuse (FMA): not exact
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_float(mode, name):
    fn, nargs = ELEMENTWISE[name]
    exact = name not in ("exp", "addcmul")  # XLA's exp is not glibc's: ulps apart
    _sweep(fn, nargs=nargs, exact=exact)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_elementwise_integer_exact(mode, dtype):
    if dtype == torch.bool:
        _sweep(lambda x, y: (x & y) | ~x, dtypes=(dtype,), nargs=2)
        return
    _sweep(lambda x, y: torch.bitwise_xor(x * 3 + y, 5), dtypes=(dtype,), nargs=2)


def test_broadcast_against_static(mode):
    b = torch.randn(5)
    col = torch.randn(1, 5)
    with no_cpu_fallback():
        for n in EDGE_LENGTHS:
            x = _data(n, shape_rest=(5,))
            _same(x.to(TPU) + b.to(TPU), x + b)
            _same(x.to(TPU) * col.to(TPU), x * col)
            _same(torch.where(x.to(TPU) > 0, x.to(TPU), b.to(TPU)), torch.where(x > 0, x, b))


def test_mismatched_lengths_raise(strict):
    """A static operand with another leading dim than the dynamic one raises as on CPU, also
    where its size is the bucket the program was built for."""
    for n in (17, 18, 19, 21):  # warm: static, static, then bucket 20
        (torch.ones(n, device=TPU) + torch.ones(n, device=TPU)).cpu()
    with pytest.raises(RuntimeError, match="must match the size"):
        (torch.ones(19, device=TPU) + torch.ones(20, device=TPU)).cpu()
    with pytest.raises(RuntimeError, match="must match the size"):
        (torch.ones(20, device=TPU) + torch.ones(19, device=TPU)).cpu()


@pytest.mark.parametrize("to", [torch.int32, torch.float64, torch.bool, torch.uint8])
def test_casts(mode, to):
    # Floats to integers in range only (C's conversion of NaN, inf or a negative float to uint8 is
    # undefined; CPU and XLA need not agree).
    _sweep(lambda x: (x.abs() * 10 if x.is_floating_point() and not to.is_floating_point else x).to(to),
           dtypes=(torch.float32, torch.int64), special=False)
    if to.is_floating_point or to == torch.bool:
        _sweep(lambda x: x.to(to), dtypes=(torch.float32,), lengths=[3, 17, 40, 71])


def test_fill_zero_copy_inplace(mode):
    with no_cpu_fallback():
        for n in EDGE_LENGTHS:
            x = _data(n)
            t = x.to(TPU)
            t.fill_(2.5)
            _same(t, torch.full((n,), 2.5))
            t.zero_()
            _same(t, torch.zeros(n))
            y = _data(n, seed=3)
            t.copy_(y.to(TPU))
            _same(t, y)
            t.add_(1).mul_(2)
            _same(t, (y + 1) * 2)
            i = torch.empty(n, dtype=torch.int64, device=TPU)
            i.copy_(t.to(TPU).nan_to_num(0, 0, 0))
            _same(i, ((y + 1) * 2).nan_to_num(0, 0, 0).to(torch.int64))


REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "sum_dim1": lambda x: x.sum(1),
    "sum_keepdim": lambda x: x.sum(0, keepdim=True),
    "prod": lambda x: x.prod(0),
    "amax": lambda x: x.amax(0),
    "amin": lambda x: x.amin(0),
    "any": lambda x: (x > 1).any(0),
    "all": lambda x: (x > -1).all(0),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_float(mode, name):
    fn = REDUCTIONS[name]
    lengths = [n for n in EDGE_LENGTHS if n > 0 or name not in ("amax", "amin")]
    exact = name in ("amax", "amin", "any", "all")
    # With NaN/inf in the data (amax/amin propagate NaN; padding never masks it).
    _sweep(fn, lengths=lengths, exact=exact, rest=(3,))
    _sweep(fn, lengths=lengths, exact=exact, rest=(3,), special=False)


@pytest.mark.full_tier
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int8])
def test_reductions_integer_exact(mode, dtype):
    for name, fn in REDUCTIONS.items():
        _sweep(fn, dtypes=(dtype,), lengths=[1, 15, 17, 19, 21, 129], rest=(2,))


def test_reductions_bool(mode):
    _sweep(lambda x: x.amax(0), dtypes=(torch.bool,), lengths=[1, 15, 17, 33])
    _sweep(lambda x: x.amin(0), dtypes=(torch.bool,), lengths=[1, 15, 17, 33])
    _sweep(lambda x: x.all(0), dtypes=(torch.bool,), lengths=[1, 15, 17, 33])
    _sweep(lambda x: x.sum(0), dtypes=(torch.bool,), lengths=[1, 15, 17, 33])


def test_empty_reductions_raise_as_cpu(strict):
    for n in (17, 19, 23, 25):  # the family goes polymorphic
        torch.ones(n, device=TPU).amax(0).cpu()
    with pytest.raises((RuntimeError, IndexError)):
        torch.ones(0, device=TPU).amax(0).cpu()
    _same(torch.ones(0, device=TPU).sum(0), torch.ones(0).sum(0))


def test_all_nan_and_all_inf_rows(mode):
    for n in [1, 15, 17, 33]:
        x = torch.full((n, 2), math.nan)
        _same(x.to(TPU).amax(0), x.amax(0))
        x = torch.full((n, 2), -math.inf)
        _same(x.to(TPU).amax(0), x.amax(0))
        _same(x.to(TPU).sum(0), x.sum(0))
        x = torch.full((n, 2), math.inf)
        _same(x.to(TPU).amin(0), x.amin(0))
        _same(x.to(TPU).prod(0), x.prod(0))


def test_views_and_offsets(mode):
    """Non-contiguous and offset views take the exact path; values as on CPU."""
    with no_cpu_fallback():
        for n in [3, 17, 33, 65]:
            x = _data(2 * n + 1)
            t = x.to(TPU)
            _same(t[::2] * 2 + 1, x[::2] * 2 + 1)
            _same(t[1:] * 2 + 1, x[1:] * 2 + 1)
            _same(t[1:].sum(), x[1:].sum(), exact=False)
            m = _data(n, shape_rest=(4,))
            _same(m.to(TPU).t() + 1, m.t() + 1)
            _same(m.to(TPU).t().amax(1), m.t().amax(1))


def test_padding_never_reaches_index_checks(mode):
    """Poly outputs carry padding rows computed from garbage; an index check over them reads
    only the tensor's elements."""
    src = torch.randn(300)
    for n in [17, 19, 21, 23, 33, 60]:
        idx = torch.arange(n) * 2
        i = idx.to(TPU) * 1 + 0  # polymorphic once warm: padding rows after n
        _same(src.to(TPU)[i], src[idx])
        _same(src.to(TPU).index_select(0, i), src.index_select(0, idx))
    bad = (torch.arange(20) * 100).to(TPU) * 1
    with pytest.raises(IndexError):
        src.to(TPU)[bad].cpu()


def test_outputs_feed_other_ops(mode):
    """Polymorphic outputs (buffers of the bucket's rows) as inputs of exact-shape ops, views,
    cat, matmul and host reads."""
    w = torch.randn(3, 4)
    for n in [1, 17, 19, 21, 33, 47]:
        x = _data(n, shape_rest=(3,), special=False)
        y = x.to(TPU) * 2 - 1
        e = x * 2 - 1
        _same(y.view(-1), e.view(-1))
        _same(torch.cat([y, y], 0), torch.cat([e, e], 0))
        _same(y @ w.to(TPU), e @ w, exact=False)
        _same(y.mean(0), e.mean(0), exact=False)
        _same(y[-1], e[-1])
        _same(y.cumsum(0), e.cumsum(0), exact=False)
        _same(y.sum(0), e.sum(0), exact=False)


def test_fused_mode_unchanged():
    with torch_tpu.eager_mode("fused"):
        for n in [17, 19, 21, 33]:
            x = _data(n, special=False)
            t = x.to(TPU)
            _same((t * 2 + 1).sum(), (x * 2 + 1).sum(), exact=False)
            _same(t * 2 + 1, x * 2 + 1)


# --- a dynamic dim other than the leading one ---------------------------------
# PlanPoly tries every dim of the highest-rank tensors; a family per dim. A tensor
# [outer..., n, inner...] is read from its flat buffer by `outer` dynamic slices and
# written back the same way (ProgramBuilder::PolyRead/PolyWrite).

def _data_at(shape, dtype=torch.float32, seed=0, special=True):
    g = torch.Generator().manual_seed(seed + sum(shape) * 31 + len(shape))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, generator=g).to(dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if special and x.numel() >= 8:
        flat = x.view(-1)
        flat[1], flat[4], flat[6] = math.nan, math.inf, -math.inf
    return x


# Bucket edges 16 and 20 (b-1, b, b+1), 0 and 1: few buckets, so few compiles per op.
INNER_LENGTHS = [0, 1, 15, 16, 17, 19, 20, 21]


def _sweep_shapes(fn, shape_of, lengths=INNER_LENGTHS, dtypes=(torch.float32,), nargs=1, exact=True,
                  special=True, skip_empty=False):
    with no_cpu_fallback():
        for dtype in dtypes:
            for n in lengths:
                if skip_empty and n == 0:
                    continue
                xs = [_data_at(shape_of(n, i), dtype, seed=i, special=special) for i in range(nargs)]
                _same(fn(*[x.to(TPU) for x in xs]), fn(*xs), exact=exact)


INNER_ELEMENTWISE = {
    # (fn, shapes per argument as a function of n)
    "mul_add_mid": (lambda x: x * 2 + 1, lambda n, i: (2, n, 3)),
    "add_mask_last": (lambda s, m: s + m, lambda n, i: (1, 4, 1, n) if i == 0 else (1, 1, 1, n)),
    "where_last": (lambda x, y: torch.where(x > y, x, y), lambda n, i: (3, n)),
    "isneginf_last": (lambda x: torch.isneginf(x) | torch.isposinf(x), lambda n, i: (1, 4, 1, n)),
    "bias_static": (lambda x, b: x + b, lambda n, i: (2, n, 5) if i == 0 else (5,)),
    "row_static": (lambda x, b: x * b, lambda n, i: (2, n, 5) if i == 0 else (2, 1, 5)),
}


@pytest.mark.parametrize("name", list(INNER_ELEMENTWISE))
def test_inner_dim_elementwise(mode, name):
    fn, shape_of = INNER_ELEMENTWISE[name]
    nargs = 1 if name in ("mul_add_mid", "isneginf_last") else 2
    _sweep_shapes(fn, shape_of, nargs=nargs)


def test_inner_dim_integer_exact(mode):
    _sweep_shapes(lambda x, y: torch.bitwise_xor(x * 3 + y, 5), lambda n, i: (3, n, 2), dtypes=(torch.int64,),
                  nargs=2)
    _sweep_shapes(lambda x, y: (x & y) | ~x, lambda n, i: (2, 2, n), dtypes=(torch.bool,), nargs=2)


INNER_REDUCTIONS = {
    "sum_over_dynamic": (lambda x: x.sum(-1), lambda n, i: (2, 3, n), False),
    "sum_keeps_dynamic": (lambda x: x.sum(0), lambda n, i: (2, n, 3), False),  # output's dynamic dim is 0
    "amax_over_dynamic": (lambda x: x.amax(1), lambda n, i: (2, n, 3), True),
    "all_over_dynamic": (lambda x: (x > -1).all(-1), lambda n, i: (1, 4, 1, n), True),
    "prod_over_dynamic": (lambda x: x.prod(1), lambda n, i: (3, n), False),
}


@pytest.mark.parametrize("name", list(INNER_REDUCTIONS))
def test_inner_dim_reductions(mode, name):
    fn, shape_of, exact = INNER_REDUCTIONS[name]
    skip_empty = name.startswith("amax")
    _sweep_shapes(fn, shape_of, exact=exact, skip_empty=skip_empty)
    _sweep_shapes(fn, shape_of, exact=exact, skip_empty=skip_empty, special=False)


def _attention_scores(n, seed=0):
    """[1, 4, 1, n] scores with a -inf (masked) tail, an all-(-inf) head, a NaN head."""
    s = _data_at((1, 4, 1, n), seed=seed, special=False)
    if n >= 3:
        s[0, 0, 0, n - 2:] = -math.inf
    if n >= 1:
        s[0, 1] = -math.inf
        s[0, 2, 0, n // 2] = math.nan
        s[0, 3, 0, 0] = math.inf
    return s


@pytest.mark.parametrize("log", [False, True])
def test_inner_dim_softmax(mode, log):
    """Softmax over the dynamic dim: padding is -inf (exp gives 0), so every row, incl. the
    all-(-inf) (NaN), NaN and +inf rows, is CPU's; over a static dim too."""
    f = torch.log_softmax if log else torch.softmax
    with no_cpu_fallback():
        for n in INNER_LENGTHS:
            s = _attention_scores(n)
            _same(f(s.to(TPU), -1), f(s, -1), exact=False)
            x = _data_at((2, n, 3), special=False)
            _same(f(x.to(TPU), 1), f(x, 1), exact=False)
            _same(f(x.to(TPU), -1), f(x, -1), exact=False)  # softmax over a static dim


def test_inner_dim_inplace_and_fill(mode):
    with no_cpu_fallback():
        for n in INNER_LENGTHS:
            x = _data_at((3, n, 2), special=False)
            t = x.to(TPU)
            t.add_(1).mul_(2)
            _same(t, (x + 1) * 2)
            t.relu_()
            _same(t, ((x + 1) * 2).relu())
            t.fill_(2.5)
            _same(t, torch.full((3, n, 2), 2.5))
            y = _data_at((3, n, 2), seed=5)
            t.copy_(y.to(TPU))
            _same(t, y)


def test_inner_dim_outputs_feed_other_ops(mode):
    """Outputs whose dynamic dim is not the leading one (runs laid back contiguous) read by
    exact-shape ops, views, cat and host reads."""
    for n in [1, 16, 17, 19, 21, 33]:
        x = _data_at((2, n, 3), special=False)
        y, e = x.to(TPU) * 2 - 1, x * 2 - 1
        _same(y.reshape(-1), e.reshape(-1))
        _same(y.transpose(0, 1).contiguous(), e.transpose(0, 1).contiguous())
        _same(torch.cat([y, y], 1), torch.cat([e, e], 1))
        _same(y[1, -1], e[1, -1])
        _same(y.softmax(1).sum(0), e.softmax(1).sum(0), exact=False)


def test_inner_dim_lower_rank_spanning_dynamic(mode):
    """A lower-rank operand that reaches the dynamic dim keeps exact shapes (correct values),
    and a mismatch raises as on CPU."""
    for n in [17, 19, 21, 23]:
        x, y = _data_at((2, n), special=False), _data_at((n,), seed=1, special=False)
        _same(x.to(TPU) + y.to(TPU), x + y)
    with pytest.raises(RuntimeError, match="must match the size"):
        (torch.ones(2, 19, device=TPU) + torch.ones(2, 20, device=TPU)).cpu()
    with pytest.raises(RuntimeError, match="must match the size"):
        (torch.ones(2, 19, device=TPU) + torch.ones(20, device=TPU)).cpu()


def test_inner_dim_many_runs_declines(mode):
    """More than 64 runs before the dynamic dim: exact shapes, values as on CPU."""
    _sweep_shapes(lambda x: x * 3 - 1, lambda n, i: (65, n), lengths=[1, 17, 19, 21])


def test_inner_dim_bounded_compiles(strict):
    """20 lengths of [1, 4, 1, n] scores + a [1, 1, 1, n] mask, softmax, isneginf and all
    over the last dim: per op at most kPolyAfter exact programs plus one per bucket."""
    lengths = list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    before = _compiles()
    for n in lengths:
        s = _data_at((1, 4, 1, n), torch.float64, special=False)
        m = _data_at((1, 1, 1, n), torch.float64, seed=2, special=False)
        for _ in range(2):  # a key (exact or bucket) compiles at its second call
            p = (s.to(TPU) + m.to(TPU)).softmax(-1)
            _same(p, (s + m).softmax(-1), exact=False)
            _same(torch.isneginf(p).all(-1), torch.isneginf((s + m).softmax(-1)).all(-1))
    compiles = _compiles() - before
    bound = 4 * (2 + len(buckets))  # add, softmax, isneginf, all
    assert compiles <= bound, (compiles, bound)
    before = _compiles()
    for n in [102, 111, 117]:  # later lengths of the same buckets compile nothing
        s = _data_at((1, 4, 1, n), torch.float64, seed=9, special=False)
        _same(s.to(TPU).softmax(-1), s.softmax(-1), exact=False)
    assert _compiles() == before


def _repeat_kv(k, n_rep=2):
    """transformers' repeat_kv: [b, kv, n, d] -> [b, kv * n_rep, n, d] through an expanded view."""
    b, kv, n, d = k.shape
    return k[:, :, None, :, :].expand(b, kv, n_rep, n, d).reshape(b, kv * n_rep, n, d)


def test_inner_dim_views(mode):
    """Permuted and expanded views of a contiguous block (offset 0) are read through their
    memory order: repeat_kv's clone of an expanded view, reductions of a transposed view
    (whose output's dynamic dim is another one), elementwise ops on a transposed view (CPU
    keeps the transposed strides: exact shapes)."""
    with no_cpu_fallback():
        for n in [0, 1, 2, 16, 17, 19]:
            k = _data_at((1, 2, n, 16), special=False)
            _same(_repeat_kv(k.to(TPU)), _repeat_kv(k))
            m = _data_at((n, 4))
            _same(m.to(TPU).t().amax(1) if n else m.to(TPU).t().sum(1), m.t().amax(1) if n else m.t().sum(1))
            _same(m.to(TPU).t().sum(0), m.t().sum(0), exact=False)
            _same(m.to(TPU).t() * 2, m.t() * 2)
            x = _data_at((2, n, 3), special=False)
            _same(x.to(TPU).transpose(1, 2).softmax(-1), x.transpose(1, 2).softmax(-1), exact=False)


def test_repeat_kv_bounded_compiles(strict):
    """repeat_kv over 20 KV-cache lengths: the clone of the expanded view compiles at most
    kPolyAfter exact programs plus one per bucket."""
    lengths = list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    before = torch_tpu.metrics()["compiles_by_op"].get("aten::clone", {}).get("compiles", 0)
    for n in lengths:
        k = _data_at((1, 2, n, 8), torch.float64, special=False)
        _same(_repeat_kv(k.to(TPU)), _repeat_kv(k))
    compiles = torch_tpu.metrics()["compiles_by_op"]["aten::clone"]["compiles"] - before
    assert compiles <= 2 + len(buckets), compiles


# --- cat along the dynamic dim (the KV cache's growing operand) ------------

CAT_LENGTHS = [0, 1, 15, 16, 17, 19, 20, 21]


def _cat_cases(n):
    """(tensors, dim) calls whose items of the largest size n along the cat dim are dynamic:
    the KV cache ([1, 2, n, 16] + [1, 2, 1, 16] along -2), generate()'s attention mask
    ([1, n] + [1, 1] int64), a static item before and after the dynamic one (later items at a
    runtime offset), two dynamic items (output 2n + 1), bool, and type promotion."""
    past = _data_at((1, 2, n, 16), seed=1)
    new = _data_at((1, 2, 1, 16), seed=2)
    mask = _data_at((1, n), torch.int64, seed=3)
    one = torch.ones((1, 1), dtype=torch.int64)
    head = _data_at((1, 2, 3, 16), seed=4)
    x = _data_at((2, n, 3), torch.float64, seed=5)
    y = _data_at((2, 1, 3), torch.float64, seed=6)
    b = _data_at((3, n), torch.bool, seed=7)
    i32 = _data_at((n, 4), torch.int32, seed=8)
    f = _data_at((2, 4), seed=9)
    return [([past, new], -2), ([mask, one], -1), ([head, past, new], 2), ([x, y, x], 1),
            ([b, b[:, :1].clone()], 1), ([i32, f], 0)]


def test_cat_dynamic_operand_values(mode):
    """cat whose growing operand is one (or more) of the items: every length, bucket edges
    and 0 and 1 included, equals CPU exactly (a copy: no rounding), NaN and inf included."""
    with no_cpu_fallback():
        for n in CAT_LENGTHS:
            for tensors, dim in _cat_cases(n):
                _same(torch.cat([t.to(TPU) for t in tensors], dim), torch.cat(tensors, dim))


def _op_compiles(name):
    return torch_tpu.metrics()["compiles_by_op"].get(name, {}).get("compiles", 0)


def _cat_compiles():
    return _op_compiles("aten::cat")


def _resizes():
    """Compiles of the buffer resize (a launch giving a dynamic input the canonical size)."""
    return _op_compiles("tpu::resize_buffer")


def test_cat_bounded_compiles(strict):
    """20 lengths of the KV-cache cat and the mask cat (fresh uploads): per call site at most
    kPolyAfter exact programs plus one per bucket of the output's n + 1 rows (cat is bucketed
    by its output); later lengths of a bucket compile nothing. (The bound was 2 + the
    operand's buckets for both sites together, which held only after earlier tests had
    compiled some of these programs: 12 compiles in a fresh process.)"""
    lengths = list(range(101, 121))
    buckets = {capacity(n + 1) for n in lengths}
    before = _cat_compiles()
    for n in lengths:
        for tensors, dim in _cat_cases(n)[:2]:
            _same(torch.cat([t.to(TPU) for t in tensors], dim), torch.cat(tensors, dim))
    compiles = _cat_compiles() - before
    assert compiles <= 2 * (2 + len(buckets)), (compiles, len(buckets))
    before = _cat_compiles()
    for n in [102, 111, 117]:
        for tensors, dim in _cat_cases(n)[:2]:
            _same(torch.cat([t.to(TPU) for t in tensors], dim), torch.cat(tensors, dim))
    assert _cat_compiles() == before


def test_cat_growing_cache(strict):
    """The KV cache as generate() grows it (each step's past is the previous step's cat
    output, a buffer canonical for its own bucket): values equal CPU's at every step; cat
    compiles at most kPolyAfter exact programs plus one per bucket (cat is bucketed by its
    output's rows), the buffer resize at most one per bucket (a bucket's first step pads the
    previous bucket's buffer), and the reader `past * 2` one per bucket (buffer size not in
    the key)."""
    past_cpu = _data_at((1, 2, 100, 8), torch.float64, seed=1)
    past = past_cpu.to(TPU)
    lengths = list(range(100, 130))
    buckets = {capacity(n) for n in lengths}
    before = _cat_compiles()
    resizes_before, muls_before = _resizes(), _op_compiles("aten::mul.Tensor")
    for n in lengths:
        new_cpu = _data_at((1, 2, 1, 8), torch.float64, seed=n)
        past_cpu = torch.cat([past_cpu, new_cpu], -2)
        past = torch.cat([past, new_cpu.to(TPU)], -2)
        _same(past, past_cpu)
        _same(past * 2, past_cpu * 2)  # the bucket-sized buffer feeds other programs
    compiles = _cat_compiles() - before
    assert compiles <= 2 + len(buckets), (compiles, len(buckets))
    assert _resizes() - resizes_before <= len(buckets), (_resizes() - resizes_before, len(buckets))
    muls = _op_compiles("aten::mul.Tensor") - muls_before
    assert muls <= 2 + len(buckets), (muls, len(buckets))


# --- matmul rows: mm, addmm --------------------------------------------------

MATMUL_LENGTHS = [0, 1, 2, 15, 16, 17, 19, 20, 21, 127, 128, 129]


def _device_result(fn):
    """fn()'s result from the device program: in strict mode host-first serves a key's first
    two calls on the CPU (the second, after a sync point, queues its compile; metrics() waits
    for it). Without the sync the two calls are one sync epoch, which queues nothing: the
    tests passed only where the shared disk cache held the programs (loaded at once)."""
    fn()
    torch.tpu.synchronize()
    fn()
    torch_tpu.metrics()
    return fn()


def _matmul_cases(n, dtype=torch.float32):
    """(CPU fn, tpu fn) pairs over an [n, 24] left matrix: mm, addmm with a [40] bias and
    with a [1, 40] bias (alpha/beta), a transposed left matrix (a read-only permuted view),
    F.linear over [2, n, 24] (addmm over its [2n, 24] view), and addmm with an [n, 40] bias
    (spans the rows: stays exact). Row 0 holds NaN and inf (special values), which stay in
    output row 0 as on CPU."""
    a = _data_at((n, 24), dtype, seed=1)
    at_ = _data_at((24, n), dtype, seed=2)
    w = _data_at((24, 40), dtype, seed=3, special=False)
    bias = _data_at((40,), dtype, seed=4, special=False)
    bias_row = _data_at((1, 40), dtype, seed=5, special=False)
    bias_full = _data_at((n, 40), dtype, seed=6, special=False)
    x3 = _data_at((2, n, 24), dtype, seed=7)
    lw = _data_at((40, 24), dtype, seed=8, special=False)
    t = lambda z: z.to(TPU)  # noqa: E731
    cases = [
        (lambda: a @ w, lambda: t(a) @ t(w)),
        (lambda: torch.addmm(bias, a, w), lambda: torch.addmm(t(bias), t(a), t(w))),
        (lambda: torch.addmm(bias_row, a, w, beta=0.5, alpha=2.0),
         lambda: torch.addmm(t(bias_row), t(a), t(w), beta=0.5, alpha=2.0)),
        (lambda: at_.t() @ w, lambda: t(at_).t() @ t(w)),
        (lambda: torch.addmm(bias_full, a, w), lambda: torch.addmm(t(bias_full), t(a), t(w))),
    ]
    if dtype.is_floating_point:
        cases.append((lambda: torch.nn.functional.linear(x3, lw, bias),
                      lambda: torch.nn.functional.linear(t(x3), t(lw), t(bias))))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_matmul_rows_values(mode, dtype):
    """mm/addmm along the left matrix's rows (PlanPolyMatmul) at lengths 0, 1, 2 and around
    the bucket edges 16, 20, 128 after two other lengths warmed each family (so the bucket
    programs serve them), each compared on the device program's result: float32 within the
    harness's matmul tolerance (NaN and inf in their rows), int64 exactly."""
    exact = not dtype.is_floating_point
    with no_cpu_fallback():
        for n in [200, 230] + MATMUL_LENGTHS:
            for cpu_fn, tpu_fn in _matmul_cases(n, dtype):
                _same(_device_result(tpu_fn), cpu_fn(), exact=exact)


def test_matmul_rows_bounded_compiles(strict):
    """20 lengths in (100, 120] of mm and addmm ([n, 24] left matrix, [24, 40] right, a [40]
    bias) and of F.linear over [2, n, 24] (addmm over [2n, 24] rows): mm and addmm compile
    at most kPolyAfter exact programs plus one per bucket of their rows per call site
    (before: one per length)."""
    lengths = list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    buckets2 = {capacity(2 * n) for n in lengths}
    before = {op: _op_compiles(op) for op in ("aten::mm", "aten::addmm")}
    with no_cpu_fallback():
        for n in lengths:
            cases = _matmul_cases(n)
            for k in (0, 1, 5):  # mm, addmm with a [40] bias, linear (addmm over [2n, 24])
                cpu_fn, tpu_fn = cases[k]
                _same(_device_result(tpu_fn), cpu_fn(), exact=False)
    mm = _op_compiles("aten::mm") - before["aten::mm"]
    addmm = _op_compiles("aten::addmm") - before["aten::addmm"]
    assert mm <= 2 + len(buckets), (mm, len(buckets))
    assert addmm <= 2 + len(buckets) + 2 + len(buckets2), (addmm, len(buckets), len(buckets2))
    assert addmm < len(lengths)


# --- layer norm along a batch dim ---------------------------------------------

def _layer_norm_cases(n):
    """(CPU fn, tpu fn) pairs: F.layer_norm over [2, n, 24] with weight and bias, without
    them, over the last two dims of [n, 3, 8], and over [4, n] normalized along n itself
    (the dynamic dim is a normalized one there: PlanPoly must keep it exact). NaN and inf
    in the first row stay in that row, as on CPU."""
    F = torch.nn.functional
    x = _data_at((2, n, 24), seed=1)
    y = _data_at((n, 3, 8), seed=2)
    z = _data_at((4, n), seed=3)
    w, b = _data_at((24,), seed=4, special=False), _data_at((24,), seed=5, special=False)
    t = lambda v: v.to(TPU)  # noqa: E731
    cases = [
        (lambda: F.layer_norm(x, (24,), w, b), lambda: F.layer_norm(t(x), (24,), t(w), t(b))),
        (lambda: F.layer_norm(x, (24,)), lambda: F.layer_norm(t(x), (24,))),
        (lambda: F.layer_norm(y, (3, 8)), lambda: F.layer_norm(t(y), (3, 8))),
    ]
    if n:
        cases.append((lambda: F.layer_norm(z, (n,)), lambda: F.layer_norm(t(z), (n,))))
    return cases


def test_layer_norm_batch_dim_values(mode):
    """native_layer_norm along a batch dim at lengths 0, 1, 2 and around the bucket edges
    16, 20, 128 after two other lengths warmed each family: the device program's result
    equals CPU within the harness's float tolerance (NaN and inf in their rows), and a
    normalized dynamic dim stays exact (same values)."""
    with no_cpu_fallback():
        for n in [200, 230] + MATMUL_LENGTHS:
            for cpu_fn, tpu_fn in _layer_norm_cases(n):
                _same(_device_result(tpu_fn), cpu_fn(), exact=False)


def test_layer_norm_bounded_compiles(strict):
    """20 lengths in (100, 120] of F.layer_norm over [2, n, 24]: at most kPolyAfter exact
    programs plus one per bucket (before: one per length); over [4, n] normalized along n:
    one per length (never a bucket program)."""
    F = torch.nn.functional
    lengths = list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    before = _op_compiles("aten::native_layer_norm")
    with no_cpu_fallback():
        for n in lengths:
            cpu_fn, tpu_fn = _layer_norm_cases(n)[0]
            _same(_device_result(tpu_fn), cpu_fn(), exact=False)
    compiles = _op_compiles("aten::native_layer_norm") - before
    assert compiles <= 2 + len(buckets), (compiles, len(buckets))
    before = _op_compiles("aten::native_layer_norm")
    with no_cpu_fallback():
        for n in lengths[:6]:
            cpu_fn, tpu_fn = _layer_norm_cases(n)[3]
            _same(_device_result(tpu_fn), cpu_fn(), exact=False)
    assert _op_compiles("aten::native_layer_norm") - before == 6


# --- the buffer size is not in the bucket key ------------------------------

BUFFER_LENGTHS = [0, 1, 15, 16, 17, 31, 32, 33]


def _producers(n, seed):
    """[2, n, 3] float32 tensors (CPU value, tpu tensor) whose buffers differ: an upload
    (Capacity(6n) elements), an exact program's output (cumsum: never polymorphic, Capacity(6n)),
    a polymorphic program's output at n's bucket (2 * Capacity(n) * 3), and the first 6n
    elements of a polymorphic output of [2, 2n + 40, 3] (another bucket, a longer storage:
    read through a resized copy, the storage keeps its buffer)."""
    x = _data_at((2, n, 3), seed=seed)
    long = _data_at((2, 2 * n + 40, 3), seed=seed + 1)
    t, tl = x.to(TPU), long.to(TPU)
    prefix = (long * 1.5).view(-1)[: 6 * n].view(2, n, 3)
    prefix_t = (tl * 1.5).view(-1)[: 6 * n].view(2, n, 3)
    return [(x, t), (torch.cumsum(x, 0), torch.cumsum(t, 0)), (x * 1.5, t * 1.5), (prefix, prefix_t)]


def test_inputs_of_any_buffer_size(mode):
    """Polymorphic programs read inputs whatever their buffer's size (uploads, exact
    programs' Capacity(numel) buffers, polymorphic outputs of this bucket or of another):
    elementwise, in-place, reductions with padding filled (NaN and inf included), softmax
    over the dynamic dim, and a cat, all equal CPU exactly (sums to float32 tolerance) at
    lengths 0, 1 and around the bucket edges 16 and 32."""
    with no_cpu_fallback():
        for n in BUFFER_LENGTHS:
            for k, (x, t) in enumerate(_producers(n, seed=11)):
                _same(t * 2.5 + 1.25, x * 2.5 + 1.25)
                if n:
                    _same(t.amax(1), x.amax(1))
                _same(t.sum(1), x.sum(1), exact=False)
                _same(torch.isneginf(t).any(1), torch.isneginf(x).any(1))
                _same(t.transpose(1, 2).softmax(-1), x.transpose(1, 2).softmax(-1), exact=False)
                _same(torch.cat([t, t[:, :1]], 1), torch.cat([x, x[:, :1]], 1))
                y, yc = t.clone(), x.clone()
                y.mul_(3.0)
                yc.mul_(3.0)
                _same(y, yc)
                _same(t, x)  # a resized input still holds its values


def test_integer_inputs_of_any_buffer_size(mode):
    """int64 and bool inputs from exact programs (Capacity(numel) buffers, padded with zeros
    by the resize) through sum, amin and all: exact, the padding never counted."""
    with no_cpu_fallback():
        for n in BUFFER_LENGTHS[1:]:
            x = _data_at((3, n), torch.int64, seed=5)
            t = torch.cumsum(x.to(TPU), 0)
            xc = torch.cumsum(x, 0)
            _same(t.sum(1), xc.sum(1))
            _same(t.amin(1), xc.amin(1))
            b, bc = t > -1000, xc > -1000
            _same(b.all(1), bc.all(1))
            _same((t + 1).prod(1), (xc + 1).prod(1))


def test_buffer_size_not_in_key_bounded_compiles(strict):
    """Over 20 lengths in (100, 120] with [2, n, 3] inputs from exact programs (cumsum,
    Capacity(6n) buffers: a new size at nearly every length), the polymorphic readers compile
    at most kPolyAfter exact programs plus one per bucket each (before: one per buffer
    size), and the resizes one per (buffer size, bucket), shared by the readers."""
    lengths = list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    ops = ("aten::mul.Tensor", "aten::add.Tensor", "aten::sum.dim_IntList")
    before = {op: _op_compiles(op) for op in ops}
    resizes = _resizes()
    for n in lengths:
        x = torch.cumsum(_data_at((2, n, 3), torch.float64, seed=3, special=False), 0)
        t = torch.cumsum(_data_at((2, n, 3), torch.float64, seed=3, special=False).to(TPU), 0)
        _same(t * t + t, x * x + x)
        _same(t.sum(1), x.sum(1), exact=False)
    for op in ops:
        compiles = _op_compiles(op) - before[op]
        assert compiles <= 2 + len(buckets), (op, compiles, len(buckets))
    assert _resizes() - resizes <= len(lengths)


def test_buffer_swapped_between_key_and_launch():
    """A program keyed at a storage's buffer is launched with whatever buffer the storage has
    then. In debug mode the index check of gather/scatter_ downloads the index between the
    call's key and its launch; a transposed index is cloned for that, and once clone's family
    has compiled kPolyAfter shapes the clone is a bucket program, which swaps the index
    storage's Capacity(7n) buffer for the bucket's canonical one (7 * Capacity(n)). The
    launch then resizes the buffer to the one the program declares (before: PJRT's
    'Executable expected parameter 1 of size 640 but got buffer with incompatible size
    896', test_dynamic_shape's debug unique_dim after the nonzero tests). Values equal
    CPU's exactly."""
    g = torch.Generator().manual_seed(7)
    resizes = _resizes()
    with torch_tpu.eager_mode("debug"), no_cpu_fallback():
        for n in (9, 10, 11, 12):  # 9, 10: clone's exact programs; 11, 12: its [7, 16] bucket program
            # every column of idx a permutation of 0..6 (scatter_ writes each element once)
            idx = torch.argsort(torch.rand(n, 7, generator=g), dim=1).t()
            src = torch.randn(7, n, generator=g)
            i, s = idx.t().to(TPU).t(), src.to(TPU)  # a transposed view of a fresh [n, 7] upload
            assert not i.is_contiguous()
            _same(torch.gather(s, 0, i), torch.gather(src, 0, idx))
            _same(torch.zeros(7, n, device=TPU).scatter_(0, i, s), torch.zeros(7, n).scatter_(0, idx, src))
    assert _resizes() > resizes  # the bucket clone ran between a key and its launch


# --- written tensors: out= and in place ------------------------------------

def test_out_and_inplace_values_and_bounded_compiles(strict):
    """out= (where.self_out with a [1, 4, 1, n] condition, a 0-d value, [1, 4, 1, n] scores
    and out; attention masking's [1, 4, 1, 1] condition comes first and leads, so that call
    stays exact) and in-place ops (add_, mul_ on [2, n, 3]) over 20
    lengths in (100, 120] and the edges 15..17: values equal CPU exactly (NaN and inf
    included), the out= tensor keeps its identity and shape, and each op compiles at most
    kPolyAfter exact programs plus one per bucket (before: one per length). The written
    storage gets the bucket's canonical buffer, so a reader at that bucket needs no resize."""
    lengths = [15, 16, 17] + list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    ops = ("aten::where.self_out", "aten::add_.Tensor", "aten::mul_.Scalar")
    before = {op: _op_compiles(op) for op in ops}
    value = torch.tensor(-1.5)
    with no_cpu_fallback():
        for n in lengths:
            s_cpu = _data_at((1, 4, 1, n), seed=n)
            cond_cpu = s_cpu > 0
            cond = cond_cpu.to(TPU)
            out_cpu = torch.empty_like(s_cpu)
            torch.where(cond_cpu, s_cpu, value, out=out_cpu)
            out = torch.empty(1, 4, 1, n, device=TPU)
            r = torch.where(cond, s_cpu.to(TPU), value.to(TPU), out=out)
            assert r is out and out.shape == (1, 4, 1, n)
            _same(out, out_cpu)
            _same(out * 2, out_cpu * 2)  # the written buffer feeds another program
            x_cpu = _data_at((2, n, 3), seed=n + 1)
            x = x_cpu.to(TPU)
            x.add_(x).mul_(0.5)
            x_cpu.add_(x_cpu).mul_(0.5)
            _same(x, x_cpu)
    for op in ops:
        compiles = _op_compiles(op) - before[op]
        assert compiles <= 2 + len(buckets), (op, compiles, len(buckets))


def test_out_needing_resize_stays_exact(strict):
    """An out= of the wrong size is resized as CPU resizes it (one program per shape, never a
    polymorphic one): values and the out's new shape equal CPU's at every length."""
    with no_cpu_fallback():
        for n in [3, 4, 5, 17, 18]:
            a_cpu = _data_at((2, n), seed=n)
            out_cpu = torch.empty(0)
            torch.add(a_cpu, 1.0, out=out_cpu)
            out = torch.empty(0, device=TPU)
            torch.add(a_cpu.to(TPU), 1.0, out=out)
            _same(out, out_cpu)


def test_permuted_outputs_values_strides_and_bounded_compiles(strict):
    """An elementwise op on a transposed view returns CPU's permuted strides (k^T * scale
    in attention: [1, 4, 16, n] over a contiguous [1, 4, n, 16]): at lengths 2..3, the edges
    15..17 and 20 lengths in (100, 120], values equal CPU exactly (NaN and inf included),
    the strides are CPU's (size-1 dims aside), the result feeds a matmul and a reduction,
    and mul compiles at most kPolyAfter exact programs plus one per bucket."""
    lengths = [2, 3, 15, 16, 17] + list(range(101, 121))
    buckets = {capacity(n) for n in lengths}
    before = _op_compiles("aten::mul.Tensor") + _op_compiles("aten::mul.Scalar")
    q_cpu = _data_at((1, 4, 1, 16), seed=2, special=False)
    q = q_cpu.to(TPU)
    with no_cpu_fallback():
        for n in lengths:
            k_cpu = _data_at((1, 4, n, 16), seed=n)
            kt_cpu = k_cpu.transpose(2, 3) * 0.25
            kt = k_cpu.to(TPU).transpose(2, 3) * 0.25
            _same(kt, kt_cpu)
            big = [d for d in range(4) if kt_cpu.size(d) != 1]
            assert [kt.stride(d) for d in big] == [kt_cpu.stride(d) for d in big], (kt.stride(), kt_cpu.stride())
            _same(kt.amax(-1), kt_cpu.amax(-1))
            k_fin = _data_at((1, 4, n, 16), seed=n, special=False)
            _same(q @ (k_fin.to(TPU).transpose(2, 3) * 0.25), q_cpu @ (k_fin.transpose(2, 3) * 0.25),
                  exact=False)
    compiles = _op_compiles("aten::mul.Tensor") + _op_compiles("aten::mul.Scalar") - before
    assert compiles <= 2 + len(buckets), (compiles, len(buckets))


# --- multi-dim families (PlanPolyMulti) -------------------------------------

MULTI_DIM = r"""
import json, math
import torch, torch_tpu
torch_tpu.set_eager_mode(mode)
g = torch.Generator().manual_seed(5)
names = ["aten::tril", "aten::bitwise_not", "aten::masked_fill.Scalar", "aten::_softmax", "aten::bmm",
         "aten::sum", "aten::amax", "aten::mul_.Tensor", "aten::add.Tensor", "aten::clone"]
def op_compiles():
    by_op = torch_tpu.metrics()["compiles_by_op"]
    return {n: by_op.get(n, {}).get("compiles", 0) for n in names}
def block(n, dev, x, w, m, col, qkv):
    x, w, m, col, qkv = (a.to(dev) for a in (x, w, m, col, qkv))
    # q, k, v: views of one [2, n, 96] block at offsets 0, 32, 64, viewed [2, n, 2, 16] and
    # transposed (strided boxes with gaps); matmul copies them (clone) before bmm.
    q, k, v = (z.view(2, n, 2, 16).transpose(1, 2) for z in qkv.split(32, dim=-1))
    att = (q @ k.transpose(-1, -2)).softmax(-1) @ v
    keep = torch.ones(n, n, dtype=torch.bool, device=dev).tril()       # [n, n] fill_, tril
    s = (x @ x.transpose(-1, -2)) / 4.0                                  # bmm [8, n, 16] @ [8, 16, n]
    s = s.view(2, 4, n, n).masked_fill(~keep, float("-inf"))             # [2, 4, n, n] with a [n, n] mask
    p = s.softmax(-1)                                                    # padding -inf along the last dim
    y = p.view(8, n, n) @ x                                              # bmm [8, n, n] @ [8, n, 16]: padded contraction
    w2 = w.clone()
    w2.mul_(m)                                                           # in place, [n, n] written
    z = w2 + col.expand(n, n)                                            # an expanded [n, 1] view read
    return [y, p, z, z.sum(), z.amax(0), m.sum(), (m * 3).sum(1),         # reductions over padded dims; int64 exact
            att, k * 2]                                                  # an elementwise op on a box view
errs, exact_ok = [], True
lengths = [5, 2, 3, 7, 16, 17, 31, 32, 33, 40]
for p_ in range(2):
    for n in lengths:
        x = torch.randn(8, n, 16, generator=g, dtype=torch.float64)
        x[0, 0, 0] = math.nan if n == 7 else x[0, 0, 0]                   # NaN reaches CPU's rows and no others
        w = torch.randn(n, n, generator=g, dtype=torch.float64)
        m = torch.randint(-5, 5, (n, n), generator=g)
        col = torch.randn(n, 1, generator=g, dtype=torch.float64)
        qkv = torch.randn(2, n, 96, generator=g, dtype=torch.float64)
        want = block(n, "cpu", x, w, m, col, qkv)
        got = block(n, "tpu", x, w, m, col, qkv)
        assert [a.stride() for a in got] == [b.stride() for b in want], n
        got = [t.cpu() for t in got]
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, b.shape, a.dtype, b.dtype)
            if a.dtype == torch.int64:
                exact_ok &= torch.equal(a, b)
            else:
                assert torch.equal(a.isnan(), b.isnan()), n
                errs.append((a - b).nan_to_num().abs().max().item())
print(json.dumps({"compiles": op_compiles(), "err": max(errs), "exact": exact_ok}))
"""


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_multi_dim_families(mode, tmp_path):
    """Ops whose dims of one size n change together — a causal [n, n] mask
    (fill_, tril, bitwise_not), [2, 4, n, n] scores with that mask
    (masked_fill, softmax), bmm's [8, n, 16] @ [8, 16, n] and
    [8, n, n] @ [8, n, 16] (a padded contraction), an in-place mul_ of an
    [n, n] tensor, an expanded [n, 1] view, sums and amax over padded dims,
    attention's q, k, v (strided views of one [2, n, 96] block at offsets
    0, 32, 64, transposed: boxes with gaps, copied by matmul's clone) —
    share a program per power-of-two bucket (PlanPolyMulti; before: one per
    length). 10 lengths in buckets 16, 32, 64, two passes, fresh process and
    empty cache: each op site compiles at most kPolyAfter exact programs and
    one per bucket (n = 2 and n = 16, where static dims of those sizes —
    batch, heads, head dim — are n too, find the family by marking a subset
    of those dims); values
    are CPU's (float64 within 1e-12; NaN where CPU has it; int64 exact)."""
    r = run_python(f"mode = {mode!r}\n" + MULTI_DIM, env={"TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["exact"], out
    assert out["err"] <= 1e-12, out
    buckets = {poly_bucket(n) for n in [5, 2, 3, 7, 16, 17, 31, 32, 33, 40]}
    assert buckets == {16, 32, 64}
    for name, n in out["compiles"].items():
        # 10 lengths: 10 compiles per site before (clone: q, k^T and v of the attention)
        sites = {"aten::bmm": 4, "aten::sum": 2, "aten::_softmax": 2, "aten::clone": 3}.get(name, 1)
        assert n <= sites * (2 + len(buckets)), (name, out["compiles"])
    assert out["compiles"]["aten::_softmax"] >= 1 and out["compiles"]["aten::bmm"] >= 2, out


FUSED_SPEC_FROM_BUCKET = r"""
import json, torch, torch_tpu
torch_tpu.set_eager_mode("fused")
torch.manual_seed(0)
def f(x, w):
    y = x.transpose(1, 2) * 2   # a permuted dynamic output: [2, 4, n], the transpose's strides
    z = (y + 1).softmax(-1)     # over the dynamic dim
    s = z.sum(-1)               # a static output, [2, 4]
    x2 = x.clone()
    x2.mul_(3)                  # in place, on a dynamic tensor
    return y, z, s, x2, x @ w   # matmul: the rows family
w = torch.randn(4, 5, dtype=torch.float64)
wt = w.to("tpu")
res = {"err": 0.0, "layout": True}
for p in range(2):
    for n in [5, 9, 3, 12, 17, 7, 30, 33, 1, 16]:
        x = torch.randn(2, n, 4, dtype=torch.float64)
        for r, g in zip(f(x, w), f(x.to("tpu"), wt)):
            res["err"] = max(res["err"], (g.cpu() - r).abs().max().item())
            # strides of dims of size > 1 (a size-1 dim's is free: at n = 1,
            # CPU gives y [2, 4, 1] strides (4, 1, 4), tpu (4, 1, 1), as with
            # TORCH_TPU_SHAPE_POLY=0)
            big = [d for d in range(r.dim()) if r.shape[d] > 1]
            res["layout"] &= tuple(g.shape) == tuple(r.shape) and all(g.stride(d) == r.stride(d) for d in big)
print(json.dumps(res))
"""


def test_fused_recording_takes_specs_from_bucket_programs(tmp_path):
    """Fused mode records a call of a new shape whose family has a bucket
    program with that program's spec at the call's extent (OpCache::
    SpecFromBucket: no meta kernel run, which for ops with Python meta
    kernels cost ~0.15-0.2 ms per new key): permuted dynamic outputs keep
    CPU's strides, static outputs (a sum over the dynamic dim) their sizes,
    in-place ops their target; regions built from such specs and calls run
    op by op give CPU's values (float64 within 1e-12) at every length, two
    passes, n = 1 included."""
    r = run_python(FUSED_SPEC_FROM_BUCKET, env={"TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["layout"], out
    assert out["err"] <= 1e-12, out
