"""Pointwise lowerings (csrc/lowering/pointwise.cpp) against CPU PyTorch.

Every test runs the op on CPU and on tpu copies of the same inputs and
compares: exactly for integer and bool results, with assert_close's default
tolerances for float32 and an explicit tolerance for bfloat16. Each test also
checks that no pointwise op ran through the CPU fallback.
"""
import contextlib
import json
import math
import zlib

import pytest
import torch
import torch_tpu

from conftest import run_python

TPU = torch.device("tpu")


@pytest.fixture(autouse=True)
def strict_mode():
    # The debug mode rejects NaN/Inf outputs, which these tests produce on purpose.
    with torch_tpu.eager_mode("strict"):
        yield


# Base names lowered in pointwise.cpp: a CPU fallback of any of them fails.
POINTWISE = set("""
add sub rsub mul div floor_divide remainder fmod pow neg abs sign sgn reciprocal
sqrt rsqrt exp exp2 expm1 log log2 log10 log1p sin cos tan tanh sigmoid erf
floor ceil trunc round frac clamp clamp_min clamp_max maximum minimum fmax fmin
lerp addcmul addcdiv where masked_fill eq ne lt le gt ge isnan isinf nan_to_num
logical_and logical_or logical_xor logical_not bitwise_and bitwise_or bitwise_xor
bitwise_not relu threshold threshold_backward gelu gelu_backward silu
silu_backward sigmoid_backward tanh_backward hardtanh hardtanh_backward
leaky_relu leaky_relu_backward elu elu_backward softplus softplus_backward mish
hardswish hardswish_backward hardsigmoid hardsigmoid_backward erfinv
""".split())

BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)

# Known issue in the shared runtime (not in the lowerings): an out= tensor whose
# sizes differ from the result (PyTorch resizes it) makes the op run on the CPU
# ("out= tensor has sizes [0] but the result has ...").


def _base(op_name):
    name = op_name.split("::")[-1].split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


@contextlib.contextmanager
def no_fallback():
    before = dict(torch_tpu.metrics()["cpu_fallbacks"])
    yield
    after = torch_tpu.metrics()["cpu_fallbacks"]
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    ours = {k: v for k, v in new.items() if _base(k) in POINTWISE}
    assert not ours, f"pointwise ops fell back to the CPU: {ours}"


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
    """fn on CPU args and on their tpu copies; compares; returns the tpu result."""
    expected = fn(*args)
    with no_fallback():
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected, **tol)
    return actual


def make(dtype, shape, low=-4.0, high=4.0, nonzero=False, gen=None):
    g = gen or torch.Generator().manual_seed(zlib.crc32(repr((dtype, shape, low, high)).encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        x = (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
        if nonzero:
            x = torch.where(x == 0, torch.ones_like(x), x)
        return x
    x = torch.randint(int(low), int(high) + 1, shape, generator=g, dtype=dtype)
    if nonzero:
        x = torch.where(x == 0, torch.ones_like(x), x)
    return x


def cpu_supports(fn, *args):
    try:
        fn(*args)
        return True
    except (RuntimeError, TypeError):
        return False


# ---------------------------------------------------------------------------
# Binary ops: dtypes, broadcasting, Python scalars, 0-d tensors.

BINARY = {
    "add": lambda a, b: torch.add(a, b),
    "add_alpha": lambda a, b: torch.add(a, b, alpha=2),
    "sub": lambda a, b: torch.sub(a, b, alpha=3),
    "rsub": lambda a, b: torch.rsub(a, b),
    "mul": torch.mul,
    "div": torch.div,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "floor_divide": torch.floor_divide,
    "remainder": torch.remainder,
    "fmod": torch.fmod,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "fmax": torch.fmax,
    "fmin": torch.fmin,
    "pow": torch.pow,
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor,
    "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor,
}
DIVIDING = {"div", "div_trunc", "div_floor", "floor_divide", "remainder", "fmod"}
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def binary_inputs(name, dtype):
    a = make(dtype, (3, 4))
    b = make(dtype, (4,), nonzero=name in DIVIDING)
    if name == "pow":
        if dtype.is_floating_point:
            a = make(dtype, (3, 4), 0.1, 3.0)
        else:
            b = make(dtype, (4,), 0, 3)
    return a, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcast(name, dtype):
    fn = BINARY[name]
    a, b = binary_inputs(name, dtype)
    if not cpu_supports(fn, a, b):
        pytest.skip("CPU does not support this dtype")
    run_both(fn, a, b)


SCALARS = {torch.float32: 2.5, torch.bfloat16: -1.5, torch.int64: 3, torch.bool: True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_python_scalar(name, dtype):
    if name.startswith("logical_"):
        pytest.skip("torch.logical_* take no Python scalars")
    fn = BINARY[name]
    a, _ = binary_inputs(name, dtype)
    for s in (SCALARS[dtype], 2 if dtype.is_floating_point else 0.5):
        if not cpu_supports(fn, a, s):
            continue
        if name in DIVIDING and s == 0:
            continue
        run_both(lambda x: fn(x, s), a)


SCALAR_OVERLOADS = {
    "add.Scalar": lambda x, s: torch.ops.aten.add.Scalar(x, s, 2),
    "sub.Scalar": lambda x, s: torch.ops.aten.sub.Scalar(x, s),
    "rsub.Scalar": lambda x, s: torch.ops.aten.rsub.Scalar(x, s, 3),
    "mul.Scalar": torch.ops.aten.mul.Scalar,
    "div.Scalar": torch.ops.aten.div.Scalar,
    "div.Scalar_mode": lambda x, s: torch.ops.aten.div.Scalar_mode(x, s, rounding_mode="floor"),
    "remainder.Scalar": torch.ops.aten.remainder.Scalar,
    "fmod.Scalar": torch.ops.aten.fmod.Scalar,
    "floor_divide.Scalar": torch.ops.aten.floor_divide.Scalar,
    "pow.Tensor_Scalar": torch.ops.aten.pow.Tensor_Scalar,
    "eq.Scalar": torch.ops.aten.eq.Scalar,
    "gt.Scalar": torch.ops.aten.gt.Scalar,
    "bitwise_and.Scalar": torch.ops.aten.bitwise_and.Scalar,
    "bitwise_xor.Scalar": torch.ops.aten.bitwise_xor.Scalar,
    "clamp": lambda x, s: torch.ops.aten.clamp(x, None, s),
    "clamp_min": torch.ops.aten.clamp_min,
    "masked_fill.Scalar": lambda x, s: torch.ops.aten.masked_fill.Scalar(x, x > 1, s),
    "add_.Scalar": lambda x, s: torch.ops.aten.add_.Scalar(x.clone(), s),
    "mul_.Scalar": lambda x, s: torch.ops.aten.mul_.Scalar(x.clone(), s),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("name", sorted(SCALAR_OVERLOADS))
def test_scalar_overloads(name, dtype):
    fn = SCALAR_OVERLOADS[name]
    x = make(dtype, (3, 4), 1, 6)
    ran = False
    for s in (3, 2.5, True):
        if cpu_supports(fn, x, s):
            run_both(lambda t: fn(t, s), x)
            ran = True
    if not ran:
        pytest.skip("CPU does not support this dtype")


def test_binary_mixed_dtypes_and_zero_dim():
    f = make(torch.float32, (2, 3))
    h = make(torch.bfloat16, (2, 3))
    i = make(torch.int64, (2, 3), nonzero=True)
    z = torch.tensor(1.75)  # 0-d float32 on tpu: does not promote bf16 past bf16
    for fn in (torch.add, torch.mul, torch.div, torch.sub, torch.eq, torch.lt, torch.maximum):
        run_both(fn, h, f)
        run_both(fn, i, f)
        run_both(fn, i, h)
        run_both(fn, h, z)
        run_both(fn, i, z)
        run_both(fn, z, z)
    # a CPU 0-d tensor mixed with tpu tensors is a scalar argument
    with no_fallback():
        r = torch.add(h.to(TPU), torch.tensor(0.1))
    check(r, torch.add(h, torch.tensor(0.1)))
    # int tensor with float scalar promotes to the default dtype
    run_both(lambda x: x * 0.5, i)
    run_both(lambda x: x / 3, i)
    run_both(lambda x: x + True, i)


def test_integer_division_semantics():
    a = torch.tensor([7, -7, 7, -7, 0, 6, -6, 1, -1], dtype=torch.int64)
    b = torch.tensor([2, 2, -2, -2, 3, -4, 4, 5, -5], dtype=torch.int64)
    for fn in (torch.floor_divide, torch.remainder, torch.fmod,
               lambda x, y: torch.div(x, y, rounding_mode="trunc"),
               lambda x, y: torch.div(x, y, rounding_mode="floor"), torch.div):
        run_both(fn, a, b)
        run_both(fn, a.to(torch.int32), b.to(torch.int32))
    run_both(lambda x: torch.remainder(x, -3), a)
    run_both(lambda x: torch.remainder(5, x), b)  # remainder.Scalar_Tensor


def test_float_division_semantics():
    inf, nan = math.inf, math.nan
    a = torch.tensor([7.5, -7.5, 7.5, -7.5, 0.0, -0.0, 1.0, -1.0, 0.0, inf, -inf, nan, 5.0, 1e-30, -3.0])
    b = torch.tensor([2.0, 2.0, -2.0, -2.0, 3.0, 3.0, 0.0, 0.0, 0.0, 2.0, 2.0, 1.0, inf, 3.0, 1.5])
    for fn in (torch.floor_divide, torch.remainder, torch.fmod,
               lambda x, y: torch.div(x, y, rounding_mode="trunc"),
               lambda x, y: torch.div(x, y, rounding_mode="floor"), torch.div):
        run_both(fn, a, b)
    big = make(torch.float32, (1000,), -100, 100)
    small = make(torch.float32, (1000,), -3, 3, nonzero=True)
    for fn in (torch.floor_divide, torch.remainder, torch.fmod):
        run_both(fn, big, small)


def test_pow_variants():
    x = make(torch.float32, (4, 5), 0.2, 3.0)
    for e in (2, 3, 0.5, -0.5, -1, -2, 1.7, 0):
        run_both(lambda t: torch.pow(t, e), x)
    run_both(lambda t: t ** 2, make(torch.bfloat16, (8,), -3, 3))
    run_both(lambda t: torch.pow(2, t), make(torch.float32, (7,), -3, 3))   # pow.Scalar
    run_both(lambda t: torch.pow(1, t), torch.tensor([math.nan, 2.0]))
    run_both(lambda t: torch.pow(2, t), torch.arange(6))
    i = torch.tensor([2, -1, 1, -3, 0, 5])
    run_both(lambda t: t ** 3, i)
    run_both(torch.pow, i, torch.tensor([3, -1, -2, 2, 4, 0]))
    run_both(lambda t: t ** 0.5, torch.tensor([4, 9, 2]))  # int ** float -> float
    run_both(torch.pow, x, make(torch.float32, (5,), -2, 2))


def test_nan_propagation():
    nan = math.nan
    a = torch.tensor([nan, 1.0, nan, -2.0, 3.0])
    b = torch.tensor([0.0, nan, nan, 5.0, -1.0])
    for fn in (torch.maximum, torch.minimum, torch.fmax, torch.fmin):
        run_both(fn, a, b)
    run_both(lambda t: torch.clamp(t, min=0.0), a)
    run_both(lambda t: torch.clamp(t, min=nan), b)
    run_both(lambda t: torch.clamp(t, -0.5, 0.5), a)
    run_both(lambda t: torch.clamp(t, min=1.5, max=0.5), b)  # min > max gives max
    run_both(lambda t, lo: torch.clamp(t, min=lo), a, b)
    run_both(lambda t: torch.relu(t), a)
    run_both(lambda t: torch.nn.functional.hardtanh(t), a)


# ---------------------------------------------------------------------------
# Unary ops.

UNARY = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "sgn": torch.sgn,
    "reciprocal": torch.reciprocal, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log,
    "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p, "sin": torch.sin,
    "cos": torch.cos, "tan": torch.tan, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil, "round": torch.round,
    "round_decimals": lambda t: torch.round(t, decimals=2),
    "round_neg_decimals": lambda t: torch.round(t, decimals=-1),
    "trunc": torch.trunc, "frac": torch.frac, "isnan": torch.isnan, "isinf": torch.isinf,
    "nan_to_num": torch.nan_to_num,
    "nan_to_num_args": lambda t: torch.nan_to_num(t, nan=1.0, posinf=2.0, neginf=-3.0),
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not, "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "silu": torch.nn.functional.silu, "mish": torch.nn.functional.mish,
    "hardtanh": lambda t: torch.nn.functional.hardtanh(t, -0.5, 1.5),
    "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, 0.1),
    "elu": lambda t: torch.nn.functional.elu(t, 0.7),
    "softplus": lambda t: torch.nn.functional.softplus(t, beta=2, threshold=3),
    "threshold": lambda t: torch.threshold(t, 0.5, -2.0),
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
}
POSITIVE = {"sqrt", "rsqrt", "log", "log2", "log10"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, dtype):
    fn = UNARY[name]
    low, high = (0.05, 10.0) if name in POSITIVE else (-6.0, 6.0)
    if name == "log1p":
        low = -0.9
    if not dtype.is_floating_point:
        low, high = (1, 10) if name in POSITIVE else (-6, 6)
    x = make(dtype, (5, 7), low, high)
    if not cpu_supports(fn, x):
        pytest.skip("CPU does not support this dtype")
    run_both(fn, x)


SPECIALS = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5,
                         1e-20, -1e-20, 1e20, -1e20, 3.0, -7.25])


@pytest.mark.parametrize("name", ["neg", "abs", "sign", "sgn", "floor", "ceil", "round", "trunc",
                                  "frac", "isnan", "isinf", "nan_to_num", "nan_to_num_args",
                                  "relu", "exp", "tanh", "sigmoid", "erf", "sqrt", "log",
                                  "logical_not", "reciprocal", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unary_special_values(name, dtype):
    x = SPECIALS.to(dtype)
    if name == "gelu":
        # CPU's vectorized gelu gives NaN for +inf; the lowering gives inf
        x = x[x != math.inf]
    run_both(UNARY[name], x)


def test_erf_accuracy():
    x = torch.linspace(-7, 7, 20001)
    run_both(torch.erf, x, atol=1e-7, rtol=4e-7)
    tiny = torch.logspace(-30, 0, 301)
    run_both(torch.erf, torch.cat([tiny, -tiny]), atol=0, rtol=4e-7)
    run_both(torch.erf, x.double(), atol=1e-9, rtol=1e-9)
    # both are within ~7e-7 of the float64 gelu; they differ where 1 + erf cancels
    run_both(torch.nn.functional.gelu, torch.linspace(-10, 10, 4001), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------
# clamp, where, masked_fill, lerp, addcmul, addcdiv.

def test_clamp_variants():
    x = make(torch.float32, (4, 6))
    lo = make(torch.float32, (6,), -2, 0)
    hi = make(torch.float32, (4, 1), 0, 2)
    run_both(lambda t: torch.clamp(t, -1, 1), x)
    run_both(lambda t: torch.clamp(t, min=-1), x)
    run_both(lambda t: torch.clamp(t, max=1), x)
    run_both(lambda t: torch.clamp_min(t, 0.25), x)
    run_both(lambda t: torch.clamp_max(t, 0.25), x)
    run_both(lambda t, a, b: torch.clamp(t, a, b), x, lo, hi)
    run_both(lambda t, a: torch.clamp(t, min=a), x, lo)
    run_both(lambda t, b: torch.clamp(t, max=b), x, hi)
    run_both(lambda t, a: torch.clamp_min(t, a), x, lo)
    run_both(lambda t, b: torch.clamp_max(t, b), x, hi)
    i = make(torch.int64, (10,), -10, 10)
    run_both(lambda t: torch.clamp(t, -3, 4), i)
    run_both(lambda t: torch.clamp(t, min=-2.5), i)  # promotes to float
    run_both(lambda t: torch.clamp(t, -0.3, 0.3), make(torch.bfloat16, (9,), -1, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_where(dtype):
    c = make(torch.bool, (3, 4))
    a = make(dtype, (3, 4))
    b = make(dtype, (4,))
    run_both(torch.where, c, a, b)
    run_both(lambda cc, x: torch.where(cc, x, SCALARS[dtype]), c, a)
    run_both(lambda cc, x: torch.where(cc, SCALARS[dtype], x), c, b)
    run_both(lambda cc: torch.where(cc, 1.5, -2.0), c)
    run_both(lambda cc, x: torch.where(cc[:, :1], x, x * 0), c, a)


def test_where_mixed_dtypes():
    c = make(torch.bool, (2, 5))
    run_both(torch.where, c, make(torch.int64, (2, 5)), make(torch.float32, (2, 5)))
    run_both(torch.where, c, make(torch.bfloat16, (2, 5)), make(torch.float32, (5,)))
    run_both(lambda cc, x: torch.where(cc, x, 0.5), c, make(torch.int64, (2, 5)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_fill(dtype):
    x = make(dtype, (3, 4))
    m = make(torch.bool, (3, 4))
    v = SCALARS[dtype]
    run_both(lambda t, mm: t.masked_fill(mm, v), x, m)
    run_both(lambda t, mm: t.masked_fill(mm[0], v), x, m)  # broadcast mask
    run_both(lambda t, mm, vv: t.masked_fill(mm, vv), x, m, torch.tensor(v, dtype=dtype))
    if dtype.is_floating_point:
        run_both(lambda t, mm: t.masked_fill(mm, -math.inf), x, m)

        def inplace(t, mm):
            t = t.clone()
            t.masked_fill_(mm, 7.0)
            return t
        run_both(inplace, x, m)


def test_masked_fill_cpu_scalar_tensor_value():
    x = make(torch.float32, (3, 4))
    m = make(torch.bool, (3, 4))
    with no_fallback():
        r = x.to(TPU).masked_fill(m.to(TPU), torch.tensor(-1.0))
    check(r, x.masked_fill(m, torch.tensor(-1.0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lerp_addcmul_addcdiv(dtype):
    s = make(dtype, (3, 4))
    e = make(dtype, (4,))
    w = make(dtype, (3, 4), -0.5, 1.5)
    t2 = make(dtype, (3, 1), 0.5, 2.0)
    run_both(lambda a, b: torch.lerp(a, b, 0.3), s, e)
    run_both(lambda a, b: torch.lerp(a, b, 0.8), s, e)
    run_both(torch.lerp, s, e, w)
    run_both(lambda a, b, c: torch.addcmul(a, b, c, value=-0.5), s, e, t2)
    run_both(torch.addcmul, s, e, t2)
    run_both(lambda a, b, c: torch.addcdiv(a, b, c, value=2.0), s, e, t2)
    run_both(torch.addcdiv, s, e, t2)


def test_addcmul_int():
    a, b, c = (make(torch.int64, (6,)) for _ in range(3))
    run_both(lambda x, y, z: torch.addcmul(x, y, z, value=3), a, b, c)


# ---------------------------------------------------------------------------
# Layouts: non-contiguous inputs, in-place ops, out=.

def test_non_contiguous_inputs():
    a = make(torch.float32, (6, 8))
    b = make(torch.float32, (8, 6))
    c = make(torch.bool, (6, 8))
    run_both(lambda x, y: x + y.t(), a, b)
    run_both(lambda x, y: x[::2, 1:5] * y[1:5, ::2].t(), a, b)
    run_both(lambda x, y, cc: torch.where(cc.t(), x.t(), y), a, b, c)
    run_both(lambda x: torch.nn.functional.gelu(x[:, ::3]), a)
    run_both(lambda x: torch.sqrt(x.t() * x.t()), a)
    run_both(lambda x, y: torch.maximum(x.t()[1:], y[1:]), a, b)
    run_both(lambda x: x[:, 2].expand(4, 6) - 1, a)


INPLACE = {
    "add_": lambda x, y: x.add_(y, alpha=0.5),
    "sub_": lambda x, y: x.sub_(y),
    "mul_": lambda x, y: x.mul_(y),
    "div_": lambda x, y: x.div_(y),
    "div_floor_": lambda x, y: x.div_(y, rounding_mode="floor"),
    "remainder_": lambda x, y: x.remainder_(y),
    "pow_": lambda x, y: x.mul_(x).add_(0.1).pow_(y),
    "clamp_": lambda x, y: x.clamp_(-0.5, 0.5),
    "clamp_t_": lambda x, y: x.clamp_(min=y),
    "maximum": lambda x, y: torch.maximum(x, y, out=x),
    "lerp_": lambda x, y: x.lerp_(y, 0.25),
    "addcmul_": lambda x, y: x.addcmul_(y, y, value=2),
    "addcdiv_": lambda x, y: x.addcdiv_(y, y * y + 1, value=-1),
    "neg_": lambda x, y: x.neg_(),
    "sqrt_": lambda x, y: x.mul_(x).sqrt_(),
    "exp_": lambda x, y: x.exp_(),
    "relu_": lambda x, y: x.relu_(),
    "sigmoid_": lambda x, y: x.sigmoid_(),
    "tanh_": lambda x, y: x.tanh_(),
    "eq_": lambda x, y: x.eq_(y),
    "lt_": lambda x, y: x.lt_(0.5),
    "masked_fill_": lambda x, y: x.masked_fill_(y > 0, 3.0),
    "add_scalar_": lambda x, y: x.add_(2),
    "mul_scalar_": lambda x, y: x.mul_(0.5),
}


@pytest.mark.parametrize("name", sorted(INPLACE))
def test_inplace(name):
    fn = INPLACE[name]
    x = make(torch.float32, (4, 5))
    y = make(torch.float32, (5,), nonzero=True)
    xc = x.clone()
    ret = fn(xc, y)
    with no_fallback():
        xt = x.to(TPU)
        ret_t = fn(xt, y.to(TPU))
    assert ret_t is xt
    check(xt, xc)
    assert ret is xc


def test_inplace_on_views_and_dtypes():
    base = make(torch.float32, (6, 6))
    bt = base.to(TPU)
    with no_fallback():
        bt[1:4, ::2].mul_(3)          # strided view: the write goes into base storage
        bt.t()[0].add_(1.5)           # column
        bt.diagonal().clamp_(max=0.1)
    base[1:4, ::2].mul_(3)
    base.t()[0].add_(1.5)
    base.diagonal().clamp_(max=0.1)
    check(bt, base)
    # in-place with a lower-precision target: computed in the promoted dtype, rounded once
    h = make(torch.bfloat16, (8,))
    f = make(torch.float32, (8,))
    run_both(lambda a, b: a.clone().add_(b), h, f)
    run_both(lambda a, b: a.clone().mul_(b), h, f)
    i = make(torch.int64, (8,), nonzero=True)
    run_both(lambda a, b: a.clone().floor_divide_(b), i, i.flip(0))
    run_both(lambda a, b: a.clone().bitwise_xor_(b), i, i.flip(0))
    run_both(lambda a: a.clone().logical_not_(), make(torch.bool, (8,)))


def test_out_variants():
    a = make(torch.float32, (3, 4))
    b = make(torch.float32, (4,), nonzero=True)
    i = make(torch.int64, (3, 4), nonzero=True)

    def with_out(fn, like_dtype, *args, shape=(3, 4)):
        def run(*xs):
            out = torch.empty(shape, dtype=like_dtype, device=xs[0].device)
            r = fn(*xs, out=out)
            assert r is out
            return out
        run_both(run, *args)

    with_out(torch.add, torch.float32, a, b)
    with_out(lambda x, y, out: torch.add(x, y, alpha=2, out=out), torch.float32, a, b)
    with_out(torch.mul, torch.float32, a, b)
    with_out(torch.div, torch.float32, a, b)
    with_out(lambda x, y, out: torch.div(x, y, rounding_mode="floor", out=out), torch.float32, a, b)
    with_out(torch.eq, torch.bool, a, b)
    with_out(torch.lt, torch.float32, a, b)          # bool result written as float
    with_out(torch.add, torch.float32, i, i)         # int result into float out
    with_out(torch.div, torch.float64, i, i)         # true division into double
    with_out(torch.sqrt, torch.float32, a.abs())
    with_out(torch.exp, torch.float64, a)
    with_out(torch.neg, torch.float32, a)
    with_out(lambda x, out: torch.clamp(x, -1, 1, out=out), torch.float32, a)
    with_out(lambda x, out: torch.pow(x, 2, out=out), torch.float32, a)
    with_out(torch.maximum, torch.float32, a, b)
    with_out(torch.logical_and, torch.bool, a, i)
    with_out(lambda c, x, y, out: torch.where(c, x, y, out=out), torch.float32, a > 0, a, b)
    with_out(lambda x, out: torch._C._nn.gelu(x, out=out), torch.float32, a)


def test_out_resized():
    a = make(torch.float32, (3, 4))
    b = make(torch.float32, (4,))

    def run(x, y):
        out = torch.empty(0, device=x.device)
        torch.add(x, y, out=out)
        return out
    run_both(run, a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_abs_logical_out(dtype):
    """abs and logical_* through out= (bool and non-bool targets)."""
    a = make(dtype, (3, 4))
    b = make(dtype, (4,))

    def out_of(fn, out_dtype, *xs):
        def run(*ts):
            out = torch.empty((3, 4), dtype=out_dtype, device=ts[0].device)
            fn(*ts, out=out)
            return out
        run_both(run, *xs)

    for fn in (torch.logical_and, torch.logical_or, torch.logical_xor):
        out_of(fn, torch.bool, a, b)
        out_of(fn, torch.float32, a, b)
    out_of(torch.logical_not, torch.bool, a)
    out_of(torch.logical_not, dtype, a)
    if dtype != torch.bool:
        out_of(torch.abs, dtype, a)
    if dtype.is_floating_point:
        x = SPECIALS[:12].reshape(3, 4).to(dtype)
        out_of(torch.abs, dtype, x)


# ---------------------------------------------------------------------------
# Backward ops: directly, and through autograd with a CPU leaf.

BACKWARD_OPS = {
    "threshold_backward": lambda g, x: torch.ops.aten.threshold_backward(g, x, 0.25),
    "gelu_backward": lambda g, x: torch.ops.aten.gelu_backward(g, x),
    "gelu_backward_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "silu_backward": lambda g, x: torch.ops.aten.silu_backward(g, x),
    "sigmoid_backward": lambda g, x: torch.ops.aten.sigmoid_backward(g, torch.sigmoid(x)),
    "tanh_backward": lambda g, x: torch.ops.aten.tanh_backward(g, torch.tanh(x)),
    "hardtanh_backward": lambda g, x: torch.ops.aten.hardtanh_backward(g, x, -0.5, 0.5),
    "leaky_relu_backward": lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, 0.2, False),
    "elu_backward": lambda g, x: torch.ops.aten.elu_backward(g, 1.0, 1.0, 1.0, False, x),
    "elu_backward_result": lambda g, x: torch.ops.aten.elu_backward(
        g, 0.5, 1.2, 1.0, True, torch.nn.functional.elu(x, 0.5)),
    "softplus_backward": lambda g, x: torch.ops.aten.softplus_backward(g, x, 1.5, 2.0),
    "hardswish_backward": lambda g, x: torch.ops.aten.hardswish_backward(g, x * 3),
    "hardsigmoid_backward": lambda g, x: torch.ops.aten.hardsigmoid_backward(g, x * 3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(BACKWARD_OPS))
def test_backward_ops(name, dtype):
    g = make(dtype, (4, 6))
    x = make(dtype, (4, 6))
    run_both(BACKWARD_OPS[name], g, x)


@pytest.mark.parametrize("name", sorted(BACKWARD_OPS))
def test_backward_ops_of_integers_raise_as_on_cpu(name):
    """CPU's backward kernels of these activations are floating-point only:
    integer arguments raise there, so they raise on tpu too, with CPU's
    message. silu_backward returned floats on tpu before (PyTorch's
    CompositeImplicitAutograd decomposition, meant for backends without a
    kernel of their own, ran instead of our lowering, where CPU runs its
    kernel); where CPU gives a value, tpu gives CPU's."""
    g = make(torch.int64, (4, 6))
    x = make(torch.int64, (4, 6))
    try:
        expected = BACKWARD_OPS[name](g, x)
    except RuntimeError as e:
        message = str(e).splitlines()[0]
        with pytest.raises(RuntimeError) as info:
            BACKWARD_OPS[name](tpu(g), tpu(x)).cpu()
        assert str(info.value).splitlines()[0] == message
        return
    # Defined on CPU (threshold_backward; sigmoid/tanh_backward of an
    # integer gradient and the float sigmoid/tanh of x): CPU's values.
    actual = BACKWARD_OPS[name](tpu(g), tpu(x))
    assert actual.dtype == expected.dtype
    check(actual, expected)


def test_silu_double_backward_matches_cpu():
    """silu_backward runs our lowering (registered for the tpu key as CPU
    registers its kernel), and its own derivative comes from PyTorch's
    formula for it: second derivatives of silu equal CPU's (float32, rtol
    1e-5, atol 1e-6)."""
    x0 = make(torch.float32, (4, 5), -3, 3)
    grads = []
    for dev in ("cpu", TPU):
        x = x0.clone().to(dev).requires_grad_()
        (g1,) = torch.autograd.grad(torch.nn.functional.silu(x).sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * g1).sum(), x)
        grads.append((g1.detach().cpu(), g2.cpu()))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-6)


AUTOGRAD = {
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": torch.nn.functional.silu,
    "hardtanh": torch.nn.functional.hardtanh,
    "leaky_relu": torch.nn.functional.leaky_relu,
    "elu": torch.nn.functional.elu,
    "softplus": torch.nn.functional.softplus,
    "hardswish": lambda x: torch.nn.functional.hardswish(x * 2),
    "hardsigmoid": lambda x: torch.nn.functional.hardsigmoid(x * 2),
    "sqrt": lambda x: torch.sqrt(x * x + 0.5),
    "rsqrt": lambda x: torch.rsqrt(x * x + 0.5),
    "exp_log": lambda x: torch.log(torch.exp(x) + 1),
    "pow": lambda x: torch.pow(x, 3) + torch.pow(x * x + 1, 1.5),
    "div": lambda x: x / (x * x + 1),
    "mul_add_sub": lambda x: (x * 3 - x.flip(0)) + x * x,
    "clamp": lambda x: torch.clamp(x, -0.5, 0.7),
    "where": lambda x: torch.where(x > 0, x * 2, -x),
    "masked_fill": lambda x: x.masked_fill(x < -1, 0.0),
    "maximum": lambda x: torch.maximum(x, x.flip(0) * 0.5),
    "lerp": lambda x: torch.lerp(x, x.flip(0), 0.3),
    "addcmul_addcdiv": lambda x: torch.addcdiv(torch.addcmul(x, x, x, value=0.5), x, x * x + 1),
    "erf_sin_cos": lambda x: torch.erf(x) + torch.sin(x) * torch.cos(x),
    "neg_abs": lambda x: -torch.abs(x) + x.neg(),
}


@pytest.mark.parametrize("name", sorted(AUTOGRAD))
def test_autograd(name):
    fn = AUTOGRAD[name]
    x0 = make(torch.float32, (4, 5), -3, 3)
    grad = make(torch.float32, (4, 5), -1, 1)
    x_ref = x0.clone().requires_grad_()
    fn(x_ref).backward(grad)
    x_leaf = x0.clone().requires_grad_()   # CPU leaf; the graph runs on tpu
    with no_fallback():
        y = fn(x_leaf.to(TPU))
        assert y.device.type == "tpu"
        y.backward(grad.to(TPU))
    assert x_leaf.grad is not None and x_leaf.grad.device.type == "cpu"
    torch.testing.assert_close(x_leaf.grad, x_ref.grad)


def test_transformer_block_pointwise_pattern():
    """The pointwise pattern of a small MLP block with its backward."""
    w = make(torch.float32, (8,))
    x0 = make(torch.float32, (4, 8))
    mask = make(torch.bool, (4, 8))

    def block(x, w):
        h = torch.nn.functional.gelu(x * w + 0.1)
        h = h.masked_fill(mask.to(x.device), 0.0)
        return torch.tanh(h) * torch.rsqrt(h * h + 0.1)

    xr = x0.clone().requires_grad_()
    block(xr, w).backward(torch.ones(4, 8))
    xl = x0.clone().requires_grad_()
    with no_fallback():
        block(xl.to(TPU), w.to(TPU)).backward(torch.ones(4, 8, device=TPU))
    torch.testing.assert_close(xl.grad, xr.grad)


# --- bfloat16/half division with rounding (issue 3) --------------------------------
# CPU computes a bfloat16 trunc/floor division in c10::BFloat16 arithmetic
# (the quotient rounded to bfloat16 before truncating: -3.890625 / -0.216796875
# = 17.94 -> 18 -> 18) unless the divisor is a single broadcast value, which
# it reads and divides in float. Compared exactly.


@pytest.mark.parametrize("mode", ["trunc", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_div_rounding_low_precision_exact(mode, dtype):
    g = torch.Generator().manual_seed(11)
    a = (torch.randn(4000, generator=g) * 10).to(dtype)
    b = torch.randn(4000, generator=g).to(dtype)
    b[:5] = 0
    a[:2] = torch.tensor([-3.890625, 0.0])
    b[5:7] = torch.tensor([-0.216796875, -2.0])
    for other in [b, b[5:6], b[5].reshape(()), 0.37, -2]:
        expected = torch.div(a, other, rounding_mode=mode)
        with no_fallback():
            actual = torch.div(tpu(a), tpu(other) if isinstance(other, torch.Tensor) and other.dim() else other,
                               rounding_mode=mode)
        check(actual, expected, atol=0, rtol=0)
    with no_fallback():
        check(torch.floor_divide(tpu(a), tpu(b)), torch.floor_divide(a, b), atol=0, rtol=0)
        x = tpu(a.clone())
        x.div_(tpu(b), rounding_mode=mode)
    check(x, torch.div(a, b, rounding_mode=mode), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["hardswish", "hardsigmoid"])
def test_hard_activations_edges_out_inplace(name, dtype):
    """Values at and around the kinks (+-3), NaN/inf; out= and in-place."""
    fn = getattr(torch.nn.functional, name)
    x = torch.tensor([-4.0, -3.0, -2.999, -1.0, 0.0, 1.0, 2.999, 3.0, 4.0, math.nan, math.inf, -math.inf]).to(dtype)
    run_both(fn, x)
    g = torch.linspace(-2, 2, x.numel()).to(dtype)
    run_both(lambda g, x: getattr(torch.ops.aten, name + "_backward")(g, x), g, x)
    out = torch.empty(x.shape, dtype=dtype, device=TPU)
    with no_fallback():
        getattr(torch._C._nn, name)(x.to(TPU), out=out)
    torch.testing.assert_close(out.cpu(), fn(x), equal_nan=True)
    t = x.to(TPU)
    with no_fallback():
        fn(t, inplace=True)
    torch.testing.assert_close(t.cpu(), fn(x), equal_nan=True)


BOOL_TIMES_INF = r"""
import json, torch, torch_tpu
b = torch.tensor([True, False, True, False])
f = torch.tensor([float("inf"), float("inf"), float("nan"), float("nan")])
def fn(b, f):
    return [b * f, f * b, torch.div(b, False), b.float() * f,
            b.to(torch.float64) / torch.zeros(4, dtype=torch.float64, device=f.device), (b * 1.0) * f]
ref = fn(b, f)
res = {}
def same(got):
    return all(g.dtype == r.dtype and torch.equal(g.cpu().nan_to_num(7.0), r.nan_to_num(7.0)) for g, r in zip(got, ref))
for mode in ("strict", "fused"):
    torch_tpu.set_eager_mode(mode)
    for i in range(3):
        res[f"{mode}{i}"] = same(fn(b.to("tpu"), f.to("tpu")))
torch_tpu.set_eager_mode("strict")
res["compile"] = same(torch.compile(fn, backend="tpu")(b.to("tpu"), f.to("tpu")))
print(json.dumps(res))
"""


@pytest.mark.parametrize("host_first", ["1", "0"])
def test_bool_to_float_keeps_ieee_zero_times_inf(host_first, tmp_path):
    """A bool tensor converted to a float dtype and multiplied or divided
    keeps IEEE's 0 * inf = nan and 0 / 0 = nan, as CPU: XLA's simplifier
    rewrote convert(pred) * y into select(pred, y, 0), so False * inf gave
    0 in compiled programs (the cast now sits behind an optimization
    barrier, lowering/helpers.cpp CastElement). Strict and fused mode (three
    calls each: host-served, compiled), torch.compile; with
    TORCH_TPU_HOST_FIRST=0 every call runs its program."""
    r = run_python(BOOL_TIMES_INF, env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_HOST_FIRST": host_first},
                   timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(res.values()), res
