"""Random fills as shape-polymorphic programs over the flat element count
(docs/design.md, "Shape-polymorphic eager programs", random fills;
compiled_op.cpp PlanPolyFlat).

uniform_, normal_, random_ (all three overloads), exponential_ and
bernoulli_ with a float p, in place on one contiguous tensor, and the
functional draws over same-shape tensors (dropout's native_dropout,
normal(mean, std) with tensor operands, bernoulli(x, p) with a float p)
share one program per bucket Capacity(numel) once the op has compiled
kPolyAfter (2) exact shapes: the program draws the bucket's values flat,
element i from (seed, offset + i) and the operands' element i, so its
first numel values are the exact-shape program's. The reference is the same script with the polymorphic path off
(TORCH_TPU_SHAPE_POLY=0): values bit for bit and the generator state
(torch.tpu.get_rng_state: seed and offset) after every call must be equal.
Compiles are counted (torch_tpu.metrics()["compiles"]).
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_python

# Numels 0, 1 (two shapes: [1] and []), bucket edges 15/16/17, 18 twice (two shapes), 19, 20 (two shapes), 21: buckets
# 16, 18, 20, 22 (0 stays exact). The full tier adds 127, 128 (two shapes), 129: buckets 128, 144.
SHAPES = [(0,), (1,), (), (15,), (16,), (17,), (3, 6), (19,), (4, 5), (20,), (21,), (2, 3, 3)]
SHAPES_FULL = SHAPES + [(127,), (128,), (8, 16), (129,)]

FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["bool", "uint8", "int8", "int16", "int32", "int64"]
# name -> (expression of `t` (the tensor to fill) and `g` (a tpu Generator or None), dtypes default, full)
CASES = {
    "uniform_": ("t.uniform_(-9, 9, generator=g)", ["float32"], FLOATS),
    "normal_": ("t.normal_(2.0, 3.0, generator=g)", ["float32"], FLOATS),
    "random_from_to": ("t.random_(-3, 7, generator=g)", ["int64"], INTS[2:] + FLOATS),
    "random_bool": ("t.random_(0, 2, generator=g)", [], ["bool", "uint8"]),
    "random_to": ("t.random_(5, generator=g)", [], INTS[1:] + FLOATS),  # CPU rejects bool (to - 1 > 1)
    "random_": ("t.random_(generator=g)", [], INTS + FLOATS),
    "exponential_": ("t.exponential_(1.5, generator=g)", [], FLOATS),
    "bernoulli_": ("t.bernoulli_(0.3, generator=g)", [], FLOATS + ["int64", "bool"]),
}

SCRIPT = r"""
import json, sys, torch, torch_tpu
cases, shapes, use_generator = json.loads(sys.argv[1])
out = {}
for name, expr, dtypes in cases:
    for dtype in dtypes:
        torch.manual_seed(1234)
        g = torch.Generator(device="tpu").manual_seed(99) if use_generator else None
        values, states = [], []
        c0 = torch_tpu.metrics()["compiles"]
        for shape in shapes:
            t = torch.empty(shape, device="tpu", dtype=getattr(torch, dtype))
            r = eval(expr)
            assert r is t and r.shape == tuple(shape) and r.dtype == getattr(torch, dtype)
            v = t.cpu().contiguous().view(-1)
            values.append(list(v.view(torch.uint8).tolist()))
            state = (g.get_state() if use_generator else torch.tpu.get_rng_state())
            states.append(state.tolist())
        first = torch_tpu.metrics()["compiles"] - c0
        c0 = torch_tpu.metrics()["compiles"]
        for shape in shapes:  # the same shapes again: no compile
            t = torch.empty(shape, device="tpu", dtype=getattr(torch, dtype))
            eval(expr).cpu()
        again = torch_tpu.metrics()["compiles"] - c0
        out[name + ":" + dtype] = {"values": values, "states": states, "compiles": first, "again": again}
print("RESULT " + json.dumps(out))
"""


def capacity(n: int) -> int:
    """runtime::Capacity, restated (as in test_shape_poly.py)."""
    if n <= 0:
        return 0
    if n <= 16:
        return 16
    p = 1 << ((n - 1).bit_length() - 1)
    return -(-n // (p // 8)) * (p // 8)


def _run(cases, shapes, use_generator, poly):
    env = {} if poly else {"TORCH_TPU_SHAPE_POLY": "0"}
    arg = json.dumps([cases, [list(s) for s in shapes], use_generator])
    r = run_python(SCRIPT.replace("sys.argv[1]", repr(arg)), env=env, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _check(cases, shapes, use_generator=False):
    off = _run(cases, shapes, use_generator, poly=False)
    on = _run(cases, shapes, use_generator, poly=True)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    # The first two numels >= 1 compile exact programs (kPolyAfter); 0 stays exact; then one per bucket.
    buckets = {capacity(n) for n in numels if n >= 1}
    bound = 2 + (0 in numels) + len(buckets)
    assert set(on) == set(off)
    for key in off:
        for i, shape in enumerate(shapes):
            assert on[key]["values"][i] == off[key]["values"][i], (key, shape, "values differ")
            assert on[key]["states"][i] == off[key]["states"][i], (key, shape, "generator state differs")
        assert off[key]["compiles"] == len(set(shapes)), (key, off[key]["compiles"])
        if key.split(":")[0] == "exponential_":  # exact programs (random.cpp: log1p's rounding depends on the length)
            assert on[key]["compiles"] == off[key]["compiles"], key
        else:
            assert on[key]["compiles"] <= bound, (key, on[key]["compiles"], bound)
        assert on[key]["again"] == 0 and off[key]["again"] == 0, key


def test_random_fills_bit_identical_default_generator():
    cases = [(name, expr, dts) for name, (expr, dts, _) in CASES.items() if dts]
    _check(cases, SHAPES)


# Multi-dim shapes whose numel is a bucket (4 x 4 = 16, 4 x 5 = 20) first reaching it: the flat program's
# [bucket] value was reshaped to the target's sizes, the build failed and the family fell back to exact
# programs for good (6 compiles, bound 4).
SHAPES_2D = [(2, 5), (3, 4), (4, 4), (3, 3), (4, 5), (2, 2, 5)]


def test_random_fills_multi_dim_bucket_numel():
    cases = [(name, CASES[name][0], CASES[name][1]) for name in ("uniform_", "random_from_to", "bernoulli_")]
    cases[-1] = ("bernoulli_", CASES["bernoulli_"][0], ["float32"])
    _check(cases, SHAPES_2D)


def test_random_fills_bit_identical_tpu_generator():
    _check([("uniform_", CASES["uniform_"][0], ["float32"])], SHAPES[:6], use_generator=True)


@pytest.mark.full_tier
def test_random_fills_bit_identical_all_dtypes():
    cases = [(name, expr, full) for name, (expr, _, full) in CASES.items()]
    _check(cases, SHAPES_FULL)


def test_twenty_sizes_bounded_compiles():
    """torch.rand and uniform_ over 20 lengths in (100, 120]: buckets 104, 112, 120."""
    code = (
        "import torch, torch_tpu\n"
        "c0 = torch_tpu.metrics()['compiles']\n"
        "for n in range(101, 121):\n"
        "    torch.rand(n, device='tpu').cpu()\n"
        "    torch.empty(n, 2, device='tpu', dtype=torch.float64).uniform_(-1, 1).cpu()\n"
        "print(torch_tpu.metrics()['compiles'] - c0)\n"
    )
    on = run_python(code, timeout=900)
    assert on.returncode == 0, on.stderr[-4000:]
    buckets_randn = {capacity(n) for n in range(101, 121)}
    buckets_uniform = {capacity(2 * n) for n in range(101, 121)}
    assert int(on.stdout.split()[-1]) <= 2 + len(buckets_randn) + 2 + len(buckets_uniform)


def test_functional_and_tensor_p_stay_exact():
    """Calls that keep exact programs (a tensor p, whose values are
    checked; a view at an offset) keep their values: they still match a run
    with the polymorphic path off."""
    code = (
        "import json, torch, torch_tpu\n"
        "torch.manual_seed(7)\n"
        "out = []\n"
        "for n in (3, 5, 17, 19, 21):\n"
        "    p = torch.full((n,), 0.4, device='tpu')\n"
        "    out.append(torch.empty(n, device='tpu').bernoulli_(p).tolist())\n"
        "    out.append(torch.bernoulli(p).tolist())\n"
        "    base = torch.zeros(n + 2, device='tpu')\n"
        "    base[1:n + 1].uniform_()\n"
        "    out.append(base.tolist())\n"
        "    out.append(torch.tpu.get_rng_state().tolist())\n"
        "print('RESULT ' + json.dumps(out))\n"
    )
    res = []
    for env in ({}, {"TORCH_TPU_SHAPE_POLY": "0"}):
        r = run_python(code, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        res.append([x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1])
    assert res[0] == res[1]


FUNCTIONAL = r"""
import json, torch, torch_tpu
torch_tpu.set_eager_mode(MODE)
shapes = SHAPES
out = {}
def draws(x):
    y, mask = torch.ops.aten.native_dropout(x, 0.4, True)
    return {
        "dropout": torch.nn.functional.dropout(x, 0.4, training=True),  # native_dropout, as below
        "native_dropout": y, "native_dropout_mask": mask,
        "normal_tensor_float": torch.normal(x, 2.0),
        "normal_float_tensor": torch.normal(1.5, x.abs() + 0.5),
        "normal_tensor_tensor": torch.normal(x, x.abs() + 1.0),
        "bernoulli_p": torch.bernoulli(x, 0.3),
    }
for dtype in DTYPES:
    torch.manual_seed(4321)
    c0 = torch_tpu.metrics()["compiles_by_op"]
    for shape in shapes:
        n = torch.Size(shape).numel()
        x = (torch.arange(n, dtype=torch.float64) / 7 - 1).to(getattr(torch, dtype)).reshape(shape).to("tpu")
        for name, r in draws(x).items():
            assert r.shape == tuple(shape), (name, r.shape, shape)
            v = r.cpu().contiguous().view(-1)
            out.setdefault(dtype + ":" + name, []).append(v.view(torch.uint8).tolist() if v.dtype != torch.bool
                                                         else v.tolist())
        out.setdefault(dtype + ":state", []).append(torch.tpu.get_rng_state().tolist())
    c = torch_tpu.metrics()["compiles_by_op"]
    # normal with a tensor std is value-checked: exact programs.
    for op in ("aten::native_dropout", "aten::bernoulli.p", "aten::normal.Tensor_float"):
        out[dtype + ":compiles:" + op] = c.get(op, {}).get("compiles", 0) - c0.get(op, {}).get("compiles", 0)
print("RESULT " + json.dumps(out))
"""


def _functional(mode, dtypes, shapes):
    res = []
    for env in ({}, {"TORCH_TPU_SHAPE_POLY": "0"}):
        code = (FUNCTIONAL.replace("MODE", repr(mode)).replace("DTYPES", repr(dtypes))
                .replace("SHAPES", repr([list(s) for s in shapes])))
        r = run_python(code, env=env, timeout=1500)
        assert r.returncode == 0, r.stderr[-4000:]
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
        res.append(json.loads(line[len("RESULT "):]))
    on, off = res
    assert set(on) == set(off)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    bound = 2 + (0 in numels) + len({capacity(n) for n in numels if n >= 1})
    for key in off:
        if ":compiles:" in key:
            # F.dropout calls native_dropout (as the explicit call, same p: one key per shape).
            assert off[key] == len(set(shapes)), (key, off[key])
            assert on[key] <= bound, (key, on[key], bound)
            continue
        for i, shape in enumerate(shapes):
            assert on[key][i] == off[key][i], (key, shape, "values or generator state differ")


def test_functional_draws_bit_identical():
    """dropout, normal with tensor operands and bernoulli(x, p): the same
    values and generator states as exact programs at every size, compiles
    bounded by the buckets."""
    _functional("strict", ["float32"], SHAPES)


def test_functional_draws_debug_mode():
    _functional("debug", ["float32"], SHAPES[:8])


@pytest.mark.full_tier
def test_functional_draws_all_float_dtypes():
    _functional("strict", ["float64", "float16", "bfloat16"], SHAPES_FULL)
