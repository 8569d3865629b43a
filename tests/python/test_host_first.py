"""Host-first calls in strict mode (docs/design.md, "Host-first calls").

A call whose single-op program is neither in memory nor in the disk cache is
served on the host by the ATen CPU kernel. With the default
TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2 a key's first call compiles nothing,
its second queues the compile on the background compile thread and is
host-served too, and strict calls stay host-served until the executable is
ready (torch_tpu.metrics() waits for queued compiles, so a call after it
runs the device program). With TORCH_TPU_HOST_FIRST_COMPILE_AFTER=1 the
first call queues the compile and every later call waits for it. Checked
here, each in a fresh process with the disk cache off (TORCH_TPU_CACHE_DIR="":
every program is new) or in a temporary directory:

- values: the host-served calls and the device-run call all match CPU
  PyTorch on the same inputs (exact for integers and bool; floats within
  torch.testing's float32 tolerance: the device program may round
  differently in the last ulp), with CPU's dtypes and strides;
- counts, at the default and at N = 1: which calls are host-served, which
  count the compile, which execute; results have the layout the device
  program gives (CPU's strides), so a chain of ops compiles each key once;
- shape-polymorphic programs: a bucket's program is host-first too, and the
  next length of the bucket runs it;
- exclusions: random ops (the tpu generator's stream is the same with and
  without host-first), calls over TORCH_TPU_HOST_FIRST_MAX_BYTES, programs
  on disk, debug and fused modes, TORCH_TPU_HOST_FIRST=0;
- errors the CPU kernel raises surface at the op;
- a host-served call is not a CPU fallback (metrics()["cpu_fallbacks"]).

Each check runs fresh processes (the switches are read once per process):
the default tier keeps values, counts, random ops, big calls, modes and
errors; polymorphic buckets, the disk cache, TORCH_TPU_HOST_FIRST=0 and bad
environment values are in the full tier (make test-full).
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import run_python

PRELUDE = r"""
import json, sys, torch, torch_tpu
torch_tpu.set_eager_mode("strict")
out = {}
def snap():
    m = torch_tpu.metrics()
    return {k: m[k] for k in ("host_served", "executions", "compiles")}
def delta(fn):
    torch.tpu.synchronize()
    a = snap()
    r = fn()
    b = snap()
    return r, {k: b[k] - a[k] for k in a}
def cpu(t):
    return t.cpu()
"""


def run(code: str, env: dict | None = None) -> dict:
    """Runs PRELUDE + code in a fresh process (the disk cache off unless env
    names one; TORCH_TPU_HOST_FIRST_COMPILE_AFTER at its default unless env
    sets it) and returns its `out`."""
    full = {"TORCH_TPU_CACHE_DIR": ""}
    full.update(env or {})
    code = PRELUDE + code + "\nprint('JSON' + json.dumps(out))\n"
    if "TORCH_TPU_HOST_FIRST_COMPILE_AFTER" not in full:  # the default, whatever the caller's environment
        code = "import os; os.environ.pop('TORCH_TPU_HOST_FIRST_COMPILE_AFTER', None)\n" + code
    r = run_python(code, env=full, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [l for l in r.stdout.splitlines() if l.startswith("JSON")][-1]
    return json.loads(line[4:])


VALUES = r"""
g = torch.Generator().manual_seed(0)
xf = torch.randn(5, 7, generator=g); yf = torch.randn(5, 7, generator=g)
xi = torch.randint(-50, 50, (6, 3), generator=g); yi = torch.randint(1, 9, (6, 3), generator=g)
X, Y, XI, YI = xf.to("tpu"), yf.to("tpu"), xi.to("tpu"), yi.to("tpu")
fb0 = dict(torch_tpu.metrics()["cpu_fallbacks"])
cases = {
    "add": (lambda a, b, c, d: a + b, "float"),
    "exp": (lambda a, b, c, d: torch.exp(a), "float"),
    "sum_dim": (lambda a, b, c, d: a.sum(1), "float"),
    "t_add": (lambda a, b, c, d: a.t() + 1.5, "float"),
    "mul_int": (lambda a, b, c, d: c * d, "int"),
    "floordiv_int": (lambda a, b, c, d: torch.floor_divide(c, d), "int"),
    "lt_bool": (lambda a, b, c, d: a < b, "int"),
    "where": (lambda a, b, c, d: torch.where(a > 0, a, b), "float"),
}
for name, (fn, kind) in cases.items():
    want = fn(xf, yf, xi, yi)
    held = {}

    def first_call():
        held["t"] = fn(X, Y, XI, YI)
        return cpu(held["t"])
    r1, d1 = delta(first_call)
    t1 = {}
    def call():
        t1["t"] = fn(X, Y, XI, YI)
        return cpu(t1["t"])
    r2, d2 = delta(call)  # second call (delta's metrics() waits for a queued compile)
    s2 = list(t1["t"].stride())
    r3, d3 = delta(call)  # third call: the device program at N = 1 and 2
    rs = (r1, r2, r3)
    if kind == "int":
        ok = [torch.equal(r, want) for r in rs]
    else:
        ok = [torch.allclose(r, want, rtol=1.3e-6, atol=1e-5, equal_nan=True) for r in rs]
    out[name] = dict(first=d1, second=d2, third=d3, ok=ok, dtypes=[str(r.dtype) for r in rs],
                     want_dtype=str(want.dtype), strides=[list(held["t"].stride()), s2, list(t1["t"].stride()),
                                                           list(want.stride())])
# In-place: the written storage is uploaded back; a chain of ops compiles each key once.
a = xf.clone(); A = a.to("tpu")
_, d_inplace1 = delta(lambda: A.add_(Y, alpha=2.0))
a.add_(yf, alpha=2.0)
_, d_inplace2 = delta(lambda: A.add_(Y, alpha=2.0))
a.add_(yf, alpha=2.0)
_, d_inplace3 = delta(lambda: A.add_(Y, alpha=2.0))
a.add_(yf, alpha=2.0)
out["inplace"] = dict(first=d_inplace1, second=d_inplace2, third=d_inplace3,
                      ok=torch.allclose(A.cpu(), a, rtol=1.3e-6, atol=1e-5))
def chain(x):
    return ((x * 3 + 1).relu() - x).abs().sum()
_, c1 = delta(lambda: chain(X).cpu())
_, c2 = delta(lambda: chain(X).cpu())
_, c3 = delta(lambda: chain(X).cpu())
out["chain"] = dict(first=c1, second=c2, third=c3,
                    ok=torch.allclose(chain(X).cpu(), chain(xf), rtol=1.3e-6, atol=1e-5))
fb1 = dict(torch_tpu.metrics()["cpu_fallbacks"])
out["fallbacks"] = {k: v - fb0.get(k, 0) for k, v in fb1.items() if v != fb0.get(k, 0)}
"""


# "2": the default (TORCH_TPU_HOST_FIRST_COMPILE_AFTER unset); "1": compile at the first call.
@pytest.fixture(scope="module", params=["2", "1"], ids=["default_after2", "after1"])
def values(request):
    env = {} if request.param == "2" else {"TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "1"}
    return request.param, run(VALUES, env)


CASES = ["add", "exp", "sum_dim", "t_add", "mul_int", "floordiv_int", "lt_bool", "where"]


def expected_counts(after: str, k: int) -> list:
    """metrics() deltas of a key's first three calls (k ops per call), each
    read after metrics() waited for queued compiles."""
    host = {"host_served": k, "executions": 0, "compiles": 0}
    device = {"host_served": 0, "executions": k, "compiles": 0}
    if after == "1":  # call 1 host-served and counts the compile; calls 2, 3 wait for it
        return [dict(host, compiles=k), device, device]
    # call 1 host-served, compiles nothing; call 2 queues (counts) the compile
    # and is host-served (the executable cannot be ready when it is queued);
    # call 3 comes after metrics() waited for it: the device program.
    return [host, dict(host, compiles=k), device]


@pytest.mark.parametrize("name", CASES)
def test_first_calls_host_served_then_device(values, name):
    after, values = values
    r = values[name]
    assert all(r["ok"]), r
    assert r["dtypes"] == [r["want_dtype"]] * 3, r
    k = r["first"]["host_served"]
    assert k >= 1, r
    assert [r["first"], r["second"], r["third"]] == expected_counts(after, k), r
    # Every call gives CPU's strides (a.t() + 1.5 keeps the transposed layout).
    assert r["strides"][0] == r["strides"][1] == r["strides"][2] == r["strides"][3], r


def test_inplace_and_chain(values):
    after, values = values
    r = values["inplace"]
    assert r["ok"]
    assert [r["first"], r["second"], r["third"]] == expected_counts(after, 1), r
    c = values["chain"]
    assert c["ok"]
    k = c["first"]["host_served"]
    assert k >= 1, c
    # Host-served results have the device program's layout: every pass sees
    # the same k keys (a new key would be host-served without its compile, or
    # compile on a later pass).
    assert [c["first"], c["second"], c["third"]] == expected_counts(after, k), c


def test_not_a_cpu_fallback(values):
    _, values = values
    assert values["fallbacks"] == {}


POLY = r"""
def resizes():
    return torch_tpu.metrics()["compiles_by_op"].get("tpu::resize_buffer", {}).get("compiles", 0)
res = []
for n in (10, 11, 12, 13, 17, 18):
    xc = torch.randn(n, 4); X = xc.to("tpu")
    r0 = resizes()
    r, d = delta(lambda: cpu(torch.relu(X) * 2))
    d["op_compiles"] = d["compiles"] - (resizes() - r0)
    res.append(dict(n=n, d=d, ok=torch.equal(r, torch.relu(xc) * 2)))
out["poly"] = res
"""


@pytest.mark.full_tier  # two fresh processes or more: make test-full
def test_poly_bucket_program_host_first():
    # Each length is called once: N = 1 compiles every program at its first
    # call, so the programs compiled match host-first off.
    on = run(POLY, env={"TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "1"})["poly"]
    off = run(POLY, env={"TORCH_TPU_HOST_FIRST": "0"})["poly"]
    default = run(POLY)["poly"]
    assert all(r["ok"] for r in on + off + default), (on, off, default)
    # The default (N = 2): an exact key or a bucket's key compiles at its
    # second call, so the lengths called once compile fewer programs than
    # host-first off, and every call is host-served or runs a program.
    for r in default:
        assert r["d"]["executions"] + r["d"]["host_served"] == 2, default
    assert sum(r["d"]["compiles"] for r in default) < sum(r["d"]["compiles"] for r in off), (default, off)
    # The same op programs compile with and without host-first (exact ones
    # for the first lengths, then buckets' programs); each compile's call is
    # the host-served one, every other call executes a program. (Buffer
    # resizes, tpu::resize_buffer, are not compared: a launch resizes an
    # input whose buffer is not its bucket's, and host-served calls launch
    # nothing — off, n = 12 resizes X's 48-element upload, on does not; a
    # host-first resize is host-served too, so it runs no program.)
    assert [r["d"]["op_compiles"] for r in on] == [r["d"]["op_compiles"] for r in off], (on, off)
    for r in on:
        assert r["d"]["host_served"] == r["d"]["op_compiles"], on
        assert r["d"]["executions"] + r["d"]["host_served"] == 2, on
    # The bucket programs serve later lengths: some step compiles nothing.
    assert any(r["d"]["op_compiles"] == 0 for r in on[2:]), on


RANDOM = r"""
torch.manual_seed(7)
X = torch.randn(6, 5).to("tpu")
vals = []
for _ in range(2):
    a = torch.exp(X)                     # host-served the first time
    b = torch.rand(6, 5, device="tpu")  # random: compiled synchronously, on the device
    c = torch.nn.functional.dropout(X, 0.5, training=True)
    vals.append([b.cpu().tolist(), c.cpu().tolist()])
_, d = delta(lambda: torch.rand(3, 2, device="tpu").cpu())
out["vals"] = vals
out["rand_first"] = d
"""


def test_random_ops_keep_their_stream():
    on = run(RANDOM)
    off = run(RANDOM, env={"TORCH_TPU_HOST_FIRST": "0"})
    assert on["vals"] == off["vals"]
    assert on["rand_first"]["host_served"] == 0 and on["rand_first"]["executions"] == 1


BIG = r"""
X = torch.randn(64, 64).to("tpu")            # 16 KiB in, 16 KiB out
_, d_big = delta(lambda: (X + 1).cpu())
Z = torch.randn(8).to("tpu")
_, d_small = delta(lambda: (Z + 1).cpu())
out["big"] = d_big
out["small"] = d_small
"""


def test_big_calls_compile_synchronously():
    r = run(BIG, env={"TORCH_TPU_HOST_FIRST_MAX_BYTES": "16384"})
    assert r["big"]["host_served"] == 0 and r["big"]["executions"] == 1, r
    assert r["small"]["host_served"] == 1 and r["small"]["executions"] == 0, r


@pytest.mark.full_tier  # two fresh processes or more: make test-full
def test_programs_on_disk_run_on_the_device(tmp_path):
    code = r"""
import os
X = torch.arange(12.0).reshape(3, 4).to("tpu")
def calls():
    return [(X * 2 - 1).cpu() for _ in range(int(os.environ["CALLS"]))]
r, d = delta(calls)
out["d"] = d
out["ok"] = all(torch.equal(v, torch.arange(12.0).reshape(3, 4) * 2 - 1) for v in r)
"""
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path)}
    # Two calls (the default compiles a key at its second call); exit waits
    # for the background compiles (they write the cache).
    first = run(code, dict(env, CALLS="2"))
    second = run(code, dict(env, CALLS="1"))
    assert first["ok"] and second["ok"]
    assert first["d"] == {"host_served": 4, "executions": 0, "compiles": 2}, first
    assert second["d"] == {"host_served": 0, "executions": 2, "compiles": 2}, second


MODES = r"""
for mode in ("debug", "fused"):
    torch_tpu.set_eager_mode(mode)
    X = torch.randn(3, 9 if mode == "debug" else 10).to("tpu")
    r, d = delta(lambda: (X.cos() + 2).cpu())
    out[mode] = dict(d=d, ok=torch.allclose(r, X.cpu().cos() + 2))
torch_tpu.set_eager_mode("strict")
"""


def test_debug_mode_compiles_synchronously_fused_mode_serves_a_new_region_on_the_host():
    """Debug mode compiles each call's program and runs it. Fused mode's new
    region compiles in the background, its calls (cos, add: keys called once)
    run as strict calls meanwhile, host-served; the region compile is the
    only compile (docs/design.md "Host-first calls", per mode)."""
    r = run(MODES)
    assert r["debug"]["ok"] and r["fused"]["ok"]
    assert r["debug"]["d"]["host_served"] == 0, r
    assert r["fused"]["d"] == {"host_served": 2, "executions": 0, "compiles": 1}, r


WAIT = r"""
x = torch.randn(11, 13).to("tpu")
m0 = torch_tpu.metrics()
a = x.sin().cpu()  # host-served; its program is not queued (compile at the 2nd call)
m1 = torch_tpu.metrics()
with torch_tpu.eager_mode("debug"):  # cannot be host-served: queues the compile and waits for it
    b = x.sin().cpu()
m2 = torch_tpu.metrics()
c = x.sin().cpu()  # compiled: runs the program, no wait
m3 = torch_tpu.metrics()
ref = x.cpu().sin()
out["ok"] = [torch.allclose(v, ref, rtol=1.3e-6, atol=1e-5) for v in (a, b, c)]  # float32 sin: torch.testing defaults
out["wait"] = [m1["compile_wait_s"] - m0["compile_wait_s"], m2["compile_wait_s"] - m1["compile_wait_s"],
               m3["compile_wait_s"] - m2["compile_wait_s"]]
out["compiles"] = [m1["compiles"] - m0["compiles"], m2["compiles"] - m1["compiles"], m3["compiles"] - m2["compiles"]]
out["compile_s"] = m2["compile_time_s"] - m1["compile_time_s"]
"""


def test_compile_wait_is_counted():
    """metrics()["compile_wait_s"]: seconds a calling thread was blocked on a
    queued compile. A strict call served on the host waits for nothing; the
    same call in debug mode (never host-served) queues the program and
    waits for it; the compiled program then serves without a wait."""
    r = run(WAIT)
    assert r["ok"] == [True, True, True], r
    assert r["compiles"] == [0, 1, 0], r
    assert r["wait"][0] == 0 and r["wait"][2] == 0, r
    assert 0 < r["wait"][1], r
    assert r["wait"][1] >= 0.5 * r["compile_s"], r  # the wait covers the compile it waited for


@pytest.mark.full_tier  # two fresh processes or more: make test-full
def test_switched_off():
    r = run(BIG, env={"TORCH_TPU_HOST_FIRST": "0"})
    assert r["small"]["host_served"] == 0 and r["small"]["executions"] == 1, r


ERRORS = r"""
X = torch.randn(4, 3).to("tpu")
bad = torch.tensor([0, 7]).to("tpu")
good = torch.tensor([3, 1]).to("tpu")
I = torch.tensor([7, -7, 5]).to("tpu"); Z = torch.tensor([2, 0, 1]).to("tpu")
torch.tpu.synchronize()
def first_line(e):
    return [type(e).__name__, str(e).split("\n")[0]]
def where_raised(fn):
    # ["op", type, message]: the call raised; ["sync", ...]: reading its result did
    try:
        r = fn()
    except Exception as e:
        return ["op"] + first_line(e)
    try:
        r.cpu()
    except Exception as e:
        return ["sync"] + first_line(e)
    return None
try:
    torch.index_select(torch.randn(4, 3), 0, torch.tensor([0, 7]))
except Exception as e:
    out["cpu_index"] = first_line(e)
try:
    torch.tensor([7, -7, 5]) // torch.tensor([2, 0, 1])
except Exception as e:
    out["cpu_floordiv"] = first_line(e)
# index_select's key: call 1 (bad) and call 2 (good) host-served, then the
# device program (after metrics() waited for the compile call 2 queued).
out["index_bad1"] = where_raised(lambda: torch.index_select(X, 0, bad))
r, d = delta(lambda: torch.index_select(X, 0, good).cpu())
out["good"] = torch.equal(r, torch.index_select(X.cpu(), 0, torch.tensor([3, 1])))
out["good_d"] = d
out["index_bad3"] = where_raised(lambda: torch.index_select(X, 0, bad))
# Integer division by zero (a value check in the program): calls 1 and 2 on
# the CPU kernel, call 3 on the device. A key's calls count once per sync
# epoch: call 2 comes after a sync point (call 1 raised at the op, before any).
out["floordiv"] = [where_raised(lambda: I // Z)]
torch.tpu.synchronize()
out["floordiv"].append(where_raised(lambda: I // Z))
torch_tpu.metrics()
out["floordiv"].append(where_raised(lambda: I // Z))
r, d = delta(lambda: (I // (Z + 1)).cpu())
out["floordiv_after"] = dict(ok=torch.equal(r, torch.tensor([7, -7, 5]) // torch.tensor([3, 1, 2])), d=d)
"""


def test_cpu_errors_surface_at_the_op():
    """Host-served calls raise CPU's exception at the op (CPU's kernel runs);
    the device program raises a value check's error at the next sync point
    with CPU's exception type (docs/op_coverage.md, value checks)."""
    r = run(ERRORS)
    assert r["index_bad1"] == ["op"] + r["cpu_index"], r
    # The failing call was the key's first: the good call is its second
    # (host-served, queues the compile), values CPU's.
    assert r["good"] and r["good_d"] == {"host_served": 1, "executions": 0, "compiles": 1}, r
    assert r["index_bad3"][0] == "sync" and r["index_bad3"][1] == r["cpu_index"][0], r
    f = r["floordiv"]
    assert f[0] == f[1] == ["op"] + r["cpu_floordiv"], r
    assert f[2][0] == "sync" and f[2][1] == r["cpu_floordiv"][0] and "ZeroDivisionError" in f[2][2], r
    assert "floor_divide" in f[2][2], r  # names the op
    # Z + 1: a new key (host-served); the division's key runs its program.
    a = r["floordiv_after"]
    assert a["ok"] and a["d"] == {"host_served": 1, "executions": 1, "compiles": 0}, r


@pytest.mark.full_tier
@pytest.mark.parametrize("var,value", [("TORCH_TPU_HOST_FIRST", "yes"), ("TORCH_TPU_HOST_FIRST_MAX_BYTES", "-1"),
                                       ("TORCH_TPU_HOST_FIRST_COMPILE_AFTER", "0")])
def test_bad_environment_is_named(var, value):
    code = PRELUDE + "X = torch.randn(3).to('tpu')\n(X + 1).cpu()\n"
    r = run_python(code, env={"TORCH_TPU_CACHE_DIR": "", var: value}, timeout=120)
    assert r.returncode != 0
    assert var in r.stderr


# TORCH_TPU_HOST_FIRST_COMPILE_AFTER=N > 1: keys seen fewer than N times cost
# no compile at all; the N-th call queues the compile; strict calls are
# host-served (not blocked) until the executable is ready; a debug or fused
# call of a key not compiled yet queues its compile and waits.
COMPILE_AFTER = r"""
g = torch.Generator().manual_seed(1)
# 20 shapes, no two in one shape family (no bucket program serves two).
shapes = [(i + 1, 20 - i) for i in range(20)]
xs = [torch.randint(-40, 40, s, generator=g) for s in shapes]
fs = [torch.randn(s, generator=g) for s in shapes]
XS = [x.to("tpu") for x in xs]
FS = [f.to("tpu") for f in fs]
torch.tpu.synchronize()
def once():
    ok = True
    for x, X, f, F in zip(xs, XS, fs, FS):
        ok &= torch.equal((X * 3 - 7).cpu(), x * 3 - 7)
        ok &= torch.allclose((F.exp() * 0.5).cpu(), f.exp() * 0.5, rtol=1.3e-6, atol=1e-5)
    return ok
ok, d = delta(once)
out["once"] = dict(ok=ok, d=d)
# A repeated key: calls 1..N-1 host-served with no compile, call N queues it.
Y = torch.arange(12, dtype=torch.int64).reshape(3, 4).to("tpu")
y = Y.cpu()
def calls(k):
    return [torch.equal((Y + 5).cpu(), y + 5) for _ in range(k)]
N = int(__import__("os").environ["TORCH_TPU_HOST_FIRST_COMPILE_AFTER"])
r1, d1 = delta(lambda: calls(N - 1))
# Call N and 30 more without waiting: each host-served or executed, all right.
r2, d2 = delta(lambda: calls(31))
r3, d3 = delta(lambda: calls(1))  # after metrics(): the compile is done
out["repeat"] = dict(ok=all(r1 + r2 + r3), d1=d1, d2=d2, d3=d3)
# A key host-served once in strict mode, then called in debug mode.
Z = torch.randn(2, 11, generator=g); ZT = Z.to("tpu")
rs, ds = delta(lambda: (ZT.cos() - 1).cpu())
torch_tpu.set_eager_mode("debug")
rd, dd = delta(lambda: (ZT.cos() - 1).cpu())
torch_tpu.set_eager_mode("strict")
want = Z.cos() - 1
out["debug"] = dict(ok=torch.allclose(rs, want, rtol=1.3e-6, atol=1e-5) and torch.allclose(rd, want, rtol=1.3e-6, atol=1e-5),
                    ds=ds, dd=dd)
"""


@pytest.mark.parametrize("after", [2, 3])
def test_compile_after_n_calls(after):
    r = run(COMPILE_AFTER, env={"TORCH_TPU_HOST_FIRST_COMPILE_AFTER": str(after)})
    # 20 shapes x 2 ops (3 programs: mul, sub; exp, mul) called once each:
    # every call host-served, not one compile, values CPU's.
    assert r["once"]["ok"], r
    assert r["once"]["d"]["compiles"] == 0 and r["once"]["d"]["executions"] == 0, r
    assert r["once"]["d"]["host_served"] == 20 * 4, r
    rep = r["repeat"]
    assert rep["ok"], r
    # add.Tensor's key (Y + 5): N-1 host-served calls, no compile.
    assert rep["d1"] == {"host_served": after - 1, "executions": 0, "compiles": 0}, r
    # Call N queues the one compile; the 31 calls are each served once.
    assert rep["d2"]["compiles"] == 1, r
    assert rep["d2"]["host_served"] >= 1 and rep["d2"]["host_served"] + rep["d2"]["executions"] == 31, r
    assert rep["d3"] == {"host_served": 0, "executions": 1, "compiles": 0}, r
    assert r["debug"]["ok"], r
    assert r["debug"]["ds"] == {"host_served": 2, "executions": 0, "compiles": 0}, r
    assert r["debug"]["dd"]["host_served"] == 0 and r["debug"]["dd"]["compiles"] == 2, r
    assert r["debug"]["dd"]["executions"] == 2, r


EPOCHS = r"""
Y = torch.arange(12, dtype=torch.float32).reshape(3, 4).to("tpu")
W = torch.arange(10, dtype=torch.float32).reshape(2, 5).to("tpu")
def calls(t, k):  # k calls of one key between two sync points
    return [t * 1.75 - 0.5 for _ in range(k)]
_, out["burst3"] = delta(lambda: calls(Y, 3))        # 3 calls, one epoch
_, out["next_epoch"] = delta(lambda: calls(Y, 1))    # the key's second epoch (delta synced)
_, out["after"] = delta(lambda: calls(Y, 1))         # the compile is done (metrics() waited)
_, out["burst4"] = delta(lambda: calls(W, 4))        # 4 calls, one epoch: the 4th queues it
out["ok"] = all(torch.equal(r.cpu(), torch.arange(12.).reshape(3, 4) * 1.75 - 0.5) for r in calls(Y, 2))
"""


def test_calls_count_once_per_sync_epoch():
    """With TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2 (the default) a key's calls
    count once per sync epoch: three calls with no sync point between them
    are host-served and compile nothing (two layers calling one key at a
    shape seen once: a transformer block's two layer norms compiled an
    exact program per sequence length); its call after a sync point queues
    the compile (mul and sub: 2 programs); a key called kHostFirstBurst (4)
    times in one epoch (a loop without sync points) queues it at the 4th."""
    r = run(EPOCHS)
    assert r["ok"], r
    assert r["burst3"] == {"host_served": 6, "executions": 0, "compiles": 0}, r
    assert r["next_epoch"] == {"host_served": 2, "executions": 0, "compiles": 2}, r
    assert r["after"] == {"host_served": 0, "executions": 2, "compiles": 0}, r
    assert r["burst4"]["compiles"] == 2, r
    assert r["burst4"]["host_served"] + r["burst4"]["executions"] == 8, r


VIEW_READS = r"""
base = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
ref = base.clone()
with torch_tpu.eager_mode("debug"):
    X = base.to("tpu") * 1  # a program's output: its bytes are only on the device
def reads(cols):
    torch.tpu.synchronize()
    m0 = torch_tpu.metrics()
    got = [X[:, k] * 2 + X[:, k + 1] for k in cols]  # a new offset: a new key, host-served
    m1 = torch_tpu.metrics()
    want = [ref[:, k] * 2 + ref[:, k + 1] for k in cols]
    return dict(host_served=m1["host_served"] - m0["host_served"],
                d2h=m1["device_to_host_bytes"] - m0["device_to_host_bytes"],
                ok=all(torch.allclose(g.cpu(), w, rtol=1.3e-6, atol=1e-5) for g, w in zip(got, want)))
out["first"] = reads(range(0, 8))
with torch_tpu.eager_mode("debug"):
    X.add_(1)  # a new write: the host copy made above is stale
ref.add_(1)
out["after_write"] = reads(range(8, 16))
out["nbytes"] = X.numel() * 4
"""


def test_host_served_views_of_one_storage_share_one_host_copy():
    """Host-served calls reading views of one device storage read one host
    copy of it (runtime::HostContentsOf), made at the first and kept until
    the storage is written: 8 calls over column views of a 16 x 64 tensor
    cost one download of it, not one per call (bench_dynamic_shapes'
    offsets table downloaded 134 MB for a 131 KB tensor); after an in-place
    write by a program the next calls download it once more and see the
    new values (CPU's, within float32 tolerance)."""
    r = run(VIEW_READS, {"TORCH_TPU_SHAPE_POLY": "0"})
    for phase in ("first", "after_write"):
        assert r[phase]["ok"], r
        assert r[phase]["host_served"] == 8 * 2, r  # mul and add per column (views are no calls)
        assert r[phase]["d2h"] == r["nbytes"], r


SHADOW_CHAIN = r"""
g = torch.Generator().manual_seed(0)
xc = torch.randn(8, 33, generator=g)
X = xc.to("tpu")
def chain(x):
    a = x + 1
    b = a * 3
    a.mul_(2)          # in place: the call's private host copy of a becomes a's host copy
    c = a + b          # reads a's new contents and b's, both from their host copies
    d = b.t() * 0.5    # a transposed read
    e = torch.cat([a, b]).sum(0)
    return a, b, c, d, e
torch.tpu.synchronize()
m0 = torch_tpu.metrics()
got = chain(X)
m1 = torch_tpu.metrics()
want = chain(xc)
out["host_served"] = m1["host_served"] - m0["host_served"]
out["executions"] = m1["executions"] - m0["executions"]
out["d2h"] = m1["device_to_host_bytes"] - m0["device_to_host_bytes"]
out["equal"] = [torch.equal(g_.cpu(), w) for g_, w in zip(got, want)]
out["strides"] = [list(g_.stride()) == list(w.stride()) for g_, w in zip(got, want)]
"""


def test_host_served_results_are_read_from_their_host_copy():
    """A host-served call's result keeps its bytes on the host as the
    upload's copy (StorageBuffer::host: the CPU kernel's result itself, not a
    second copy of it), and the next host-served calls read them from there:
    a chain of new-shape calls, one of them in place, moves nothing back
    from the device and gives CPU's values exactly (each call is CPU's
    kernel) and CPU's strides."""
    r = run(SHADOW_CHAIN, {"TORCH_TPU_SHAPE_POLY": "0"})
    assert r["executions"] == 0 and r["host_served"] == 7, r  # add, mul, mul_, add, mul, cat, sum
    assert r["d2h"] == 0, r
    assert all(r["equal"]) and all(r["strides"]), r


def test_call_whose_cpu_results_differ_runs_the_program():
    """embedding_bag's CPU kernel returns offset2bag as Long[0] where the
    program (the meta kernel) gives Long[n]: the host-first call declines
    (metrics()["host_first_declined"]) and runs the program, whose bag
    values equal CPU's; no error. A fresh process with no disk cache, so the
    first calls are host-first ones."""
    code = r"""
import json, torch, torch_tpu
import torch.nn.functional as F
g = torch.Generator().manual_seed(0)
w = torch.randn(10, 4, generator=g)
idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
off = torch.tensor([0, 4])
err = 0.0
for _ in range(3):
    got = F.embedding_bag(idx.tpu(), w.tpu(), off.tpu(), mode="sum")
    err = max(err, (got.cpu() - F.embedding_bag(idx, w, off, mode="sum")).abs().max().item())
m = torch_tpu.metrics()
print("RESULT " + json.dumps({"err": err, "declined": m["host_first_declined"]}))
"""
    r = run_python(code, env={"TORCH_TPU_CACHE_DIR": ""}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert res["err"] <= 1e-6 and res["declined"] >= 1, res


def test_out_calls():
    """out= calls (docs/design.md "Host-first calls"): an out= tensor that
    already has the result's sizes is host-served (written through its host
    mirror and uploaded, as an in-place self is; _safe_softmax's
    where.self_out in every attention call); one the call must resize runs
    the program (the CPU kernel would resize the host mirror, not the tpu
    tensor); a CPU kernel that grows a mirrored storage inside the call
    (binary_cross_entropy's out= of a reduction: CPU's own kernel then sums
    the 0-d out alone and returns the first element's loss) declines and
    runs the program, whose value is the reduction's. Values against CPU's
    functional results; a fresh process with no disk cache."""
    code = r"""
import json, torch, torch_tpu
import torch.nn.functional as F
g = torch.Generator().manual_seed(0)
c = torch.randn(4, 5, generator=g) > 0
a, b = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
want = torch.where(c, a, b)
res = {}
o = torch.empty(4, 5, device="tpu")
m0 = torch_tpu.metrics()
r = torch.where(c.tpu(), a.tpu(), b.tpu(), out=o)
m1 = torch_tpu.metrics()
res["sized"] = dict(same=r is o, exact=torch.equal(o.cpu(), want),
                    served=m1["host_served"] - m0["host_served"], executions=m1["executions"] - m0["executions"])
o = torch.empty(0, device="tpu")
m0 = torch_tpu.metrics()
torch.where(c.tpu(), a.tpu(), b.tpu(), out=o)
m1 = torch_tpu.metrics()
res["resized"] = dict(shape=list(o.shape), exact=torch.equal(o.cpu(), want),
                      served=m1["host_served"] - m0["host_served"], executions=m1["executions"] - m0["executions"])
p = torch.rand(5, generator=g).clamp(0.1, 0.9); y = torch.rand(5, generator=g)
o = torch.empty((), device="tpu")
m0 = torch_tpu.metrics()
torch._C._nn.binary_cross_entropy(p.tpu(), y.tpu(), None, 2, out=o)
m1 = torch_tpu.metrics()
res["bce"] = dict(err=abs(o.item() - F.binary_cross_entropy(p, y, reduction="sum").item()),
                  declined=m1["host_first_declined"] - m0["host_first_declined"])
print("RESULT " + json.dumps(res))
"""
    r = run_python(code, env={"TORCH_TPU_CACHE_DIR": ""}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert res["sized"] == {"same": True, "exact": True, "served": 1, "executions": 0}, res
    assert res["resized"]["shape"] == [4, 5] and res["resized"]["exact"], res
    assert res["resized"]["served"] == 0 and res["resized"]["executions"] == 1, res
    assert res["bce"]["declined"] == 1 and res["bce"]["err"] <= 1e-5, res


# The background compile thread runs at TORCH_TPU_COMPILE_NICE (unset: 19
# where the process may raise a thread's priority back, else 0): read from
# /proc, each thread's nice value (stat field 19) while a compile of a
# host-first call is queued or running, and after it finished (the thread
# stays). The XLA threads it starts inherit it; the calling thread keeps
# its own.
NICE = r"""
import os
def nices():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[int(tid)] = int(fields[16])  # field 19 of stat(5); fields[0] is field 3
    return out
before = nices()
X = torch.randn(5, 7).to("tpu")
for _ in range(2):  # the second call queues the compile
    (X * 2 + 1).cpu()
torch_tpu.metrics()  # waits for it: the thread has run
after = nices()
out["main"] = after[os.getpid()]
out["new"] = sorted(v for t, v in after.items() if t not in before)
"""


def _can_raise_priority_back():
    """Whether a thread of this process may set its niceness to 19 and back
    (CAP_SYS_NICE or RLIMIT_NICE >= 20): the default niceness's test."""
    import threading
    ok = []

    def probe():
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, tid)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            os.setpriority(os.PRIO_PROCESS, tid, base)
            ok.append(base < 19)
        except OSError:
            ok.append(False)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return ok[0]


@pytest.mark.parametrize("env,want", [({"TORCH_TPU_COMPILE_NICE": "19"}, 19), ({"TORCH_TPU_COMPILE_NICE": "0"}, 0),
                                      ({"TORCH_TPU_COMPILE_NICE": "7"}, 7), ({}, "default")])
def test_compile_thread_niceness(env, want):
    if want == "default":
        want = 19 if _can_raise_priority_back() else 0
    r = run_python(PRELUDE + NICE + "print(json.dumps(out))\n", env={"TORCH_TPU_CACHE_DIR": "", **env}, timeout=120,
                   drop_env=("TORCH_TPU_COMPILE_NICE",) if not env else ())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["main"] == 0, out
    assert want in out["new"], out  # the compile thread
    assert all(v in (0, want) for v in out["new"]), out


# Priority inheritance (CompileBoost): while a thread waits for background
# compiles (here metrics(), which waits for them), the compile threads run
# at its niceness, 0, and at 19 again after. A second Python thread samples
# the niceness of the threads the compiles run on (those at 19 before the
# wait) every ~0.2 ms during the wait; 24 single-op compiles queued first
# (24 unary ops: 24 keys, an empty cache directory) keep the worker busy
# for it (~20 ms each).
BOOST = r"""
import os, threading, time
def nice_of(tid):
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except OSError:
        return None
X = torch.randn(5, 7).to("tpu")
names = ["sin", "cos", "tan", "exp", "expm1", "tanh", "sigmoid", "neg", "abs", "sqrt", "rsqrt", "log1p",
         "erf", "erfc", "atan", "asinh", "sinh", "cosh", "floor", "ceil", "round", "trunc", "square", "reciprocal"]
fns = [getattr(torch, n) for n in names]  # 24 ops: 24 keys, 24 compiles
for f in fns:
    f(X).cpu()  # host-served
for f in fns:
    f(X).cpu()  # queues its compile
# The worker thread nices itself when it first runs (on a loaded machine
# that can come after the calls that queued its compiles).
deadline = time.monotonic() + 10
while True:
    niced = [int(t) for t in os.listdir("/proc/self/task") if nice_of(t) == 19]
    if niced or time.monotonic() > deadline:
        break
    time.sleep(0.001)
seen, waiting = [], True
def sample():
    while waiting:
        seen.append([nice_of(t) for t in niced])
        time.sleep(0.0002)
th = threading.Thread(target=sample)
th.start()
time.sleep(0.005)
before = list(seen)
torch_tpu.metrics()  # waits for the compiles: boosted
waiting = False
th.join()
out["niced"] = len(niced)
out["before"] = sorted({v for s in before for v in s if v is not None})
out["during"] = sorted({v for s in seen[len(before):] for v in s if v is not None})
out["after"] = sorted({nice_of(t) for t in niced} - {None})
"""


def test_waiting_for_compiles_raises_their_priority(tmp_path):
    if not _can_raise_priority_back():
        pytest.skip("this process may not raise a thread's priority back (no CAP_SYS_NICE, RLIMIT_NICE < 20)")
    r = run_python(PRELUDE + BOOST + "print(json.dumps(out))\n", env={"TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=120,
                   drop_env=("TORCH_TPU_COMPILE_NICE",))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["niced"] >= 1, out  # the worker (at the default 19)
    assert out["before"] == [19], out
    assert 0 in out["during"], out  # boosted while metrics() waited
    assert out["after"] == [19], out  # and lowered again


BAD_SETTING = r"""
X = torch.randn(5, 7)
XT = X.to("tpu")
errors = []
for mode, f in zip(MODES, (lambda t: t.sin() * 3, lambda t: t.cos() + 1)):
    torch_tpu.set_eager_mode(mode)
    for i in range(3):  # new keys: the 1st call is host-served, the 2nd would queue the compile
        try:
            errors.append(None if torch.allclose(f(XT).cpu(), f(X), atol=1e-6) else "wrong value")
        except RuntimeError as e:
            errors.append(str(e))
torch_tpu.set_eager_mode("strict")
out["errors"] = errors
out["compiles"] = torch_tpu.metrics()["compiles"]  # returns: no compile is left queued
"""


@pytest.mark.parametrize("name,value", [("TORCH_TPU_COMPILE_NICE", "20"), ("TORCH_TPU_COMPILE_THREADS", "x")])
def test_compile_worker_bad_setting_is_named(name, value, tmp_path):
    """A bad TORCH_TPU_COMPILE_NICE / _THREADS is a RuntimeError naming it at
    each call that would queue a background compile, raised before the op
    is marked as queued (before: the first error came after, so the op's
    later calls were host-served for good with no compile ever running),
    and only there: a key's first call is host-served with CPU's value; a
    fused region that cannot queue its compile runs its calls op by op
    (values kept, not lost); with the programs on disk (a run with good
    settings first, in strict mode only: the fused run's regions are not
    on disk, its ops' single-op programs are) nothing needs the worker and
    every call gives its value. metrics() (which waits for background
    compiles) returns."""
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path), name: value}
    script = PRELUDE + 'MODES = ("fused", "strict")\n' + BAD_SETTING + "print(json.dumps(out))\n"
    r = run_python(script, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    errors = out["errors"]
    assert errors[0] is None and errors[3] is None, out  # first calls: host-served, CPU's values
    assert all(e is not None and name in e for k, e in enumerate(errors) if k not in (0, 3)), out
    assert out["compiles"] == 0, out
    # Programs on disk: a run with good settings compiles them, a run with
    # the bad value loads them and never needs the worker.
    fill = script.replace('MODES = ("fused", "strict")', 'MODES = ("strict", "strict")')
    good = run_python(fill, env={"TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert good.returncode == 0, good.stderr[-3000:]
    assert json.loads(good.stdout.strip().splitlines()[-1])["errors"] == [None] * 6
    warm = run_python(script, env=env, timeout=120)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert json.loads(warm.stdout.strip().splitlines()[-1])["errors"] == [None] * 6


# Threads a compile starts while a wait boosts the worker inherit the raised
# niceness; the wait's end lowers them too (CompileWorker::BoostEnd: new
# since the boost began, at its niceness, named as the worker). metrics()
# right after queuing 30 compiles boosts before the first compile has
# started XLA's compile helper threads (review, session 21: they stayed at
# 0 for good in 5 of 8 runs, ~40% of later compiles' CPU).
BOOST_NEW_THREADS = r"""
import os
def threads():
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out.append((int(tid), name, nice))
    return sorted(out)
for k in range(1, 31):  # 30 new keys, 2 calls each: 30 background compiles
    x = torch.ones(k, 3, device="tpu")
    for _ in range(2):
        (x * 2 + 1).sin()
torch_tpu.metrics()  # boosts, typically before the first compile has started its helpers
for k in range(40, 70):
    x = torch.ones(k, 3, device="tpu")
    for _ in range(2):
        (x * 2 + 1).sin()
torch_tpu.metrics()
out["threads"] = threads()
"""


def test_threads_started_during_a_boost_are_lowered_after_it(tmp_path):
    if not _can_raise_priority_back():
        pytest.skip("this process may not raise a thread's priority back (no CAP_SYS_NICE, RLIMIT_NICE < 20)")
    r = run_python(PRELUDE + BOOST_NEW_THREADS + "print(json.dumps(out))\n",
                   env={"TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=180, drop_env=("TORCH_TPU_COMPILE_NICE",))
    assert r.returncode == 0, r.stderr[-3000:]
    threads = json.loads(r.stdout.strip().splitlines()[-1])["threads"]
    niced = [t for t in threads if t[2] == 19]
    assert niced, threads  # the worker
    worker_tid, worker_name = niced[0][0], niced[0][1]
    # every thread started after the worker under its name: the worker's compile helpers
    later = [t for t in threads if t[0] > worker_tid and t[1] == worker_name]
    assert all(t[2] == 19 for t in later), threads
