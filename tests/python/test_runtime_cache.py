"""The in-memory executable caches are bounded (TORCH_TPU_MAX_CACHED_EXECUTABLES,
least recently used evicted): a process that compiles many distinct programs
keeps its memory mappings bounded and its results correct.

Each case runs in a fresh interpreter (the limit is read once per process),
with the on-disk cache disabled so that every miss really compiles."""
from __future__ import annotations

import json

import pytest

from conftest import run_python

_PRELUDE = """
import json, torch, torch_tpu
def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
"""


def _run(body: str, limit: str | None, mode: str = "strict") -> dict:
    # Exact-shape programs only: these tests make many distinct programs from
    # many lengths, which shape-polymorphic programs would share (buckets).
    # Each program is called once: TORCH_TPU_HOST_FIRST_COMPILE_AFTER=1 compiles
    # it at that call (the default, 2, would compile none of them).
    env = {"TORCH_TPU_CACHE_DIR": "", "TORCH_TPU_EAGER_MODE": mode, "TORCH_TPU_SHAPE_POLY": "0",
           "TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "1"}
    if limit is not None:
        env["TORCH_TPU_MAX_CACHED_EXECUTABLES"] = limit
    r = run_python(_PRELUDE + body, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# Distinct programs: `t * 2 + 1` over lengths 1..N (two executables per
# length: mul and add), compared with CPU on the same values.
_MANY_PROGRAMS = """
torch.ones(1, device="tpu").add(1).cpu()
m0 = maps()
before = torch_tpu.metrics()
ok = True
for n in range(1, N + 1):
    host = torch.arange(n, dtype=torch.float32) - n / 3
    got = (host.to("tpu") * 2 + 1).cpu()
    ok &= torch.equal(got, host * 2 + 1)
after = torch_tpu.metrics()
# The first programs were evicted long ago: they compile again, and still agree.
host = torch.arange(1, dtype=torch.float32) - 1 / 3
ok &= torch.equal((host.to("tpu") * 2 + 1).cpu(), host * 2 + 1)
again = torch_tpu.metrics()
print(json.dumps({"ok": bool(ok), "maps_growth": maps() - m0,
                  "compiles": after["compiles"] - before["compiles"],
                  "recompiles": again["compiles"] - after["compiles"],
                  "evictions": after["executable_cache_evictions"] - before["executable_cache_evictions"],
                  "cached": after["cached_executables"]}))
"""


def test_lru_bounds_cache_and_mappings():
    limited = _run("N = 150\n" + _MANY_PROGRAMS, limit="16")
    assert limited["ok"]
    assert limited["compiles"] >= 290
    assert limited["cached"] <= 16
    # Every compile beyond the limit evicted one executable.
    assert limited["evictions"] >= limited["compiles"] - 16
    assert limited["recompiles"] >= 1
    unbounded = _run("N = 150\n" + _MANY_PROGRAMS, limit=None)  # default 4096: nothing evicted here
    assert unbounded["ok"]
    assert unbounded["evictions"] == 0
    assert unbounded["cached"] >= 290
    # ~3 mappings per live XLA CPU executable: the bounded process grows by a
    # small fraction of the unbounded one.
    assert unbounded["maps_growth"] > 2 * unbounded["compiles"], unbounded
    assert limited["maps_growth"] < unbounded["maps_growth"] / 4, (limited, unbounded)


def test_lru_keeps_recently_used_entries():
    out = _run("""
a = torch.arange(6, dtype=torch.float32).to("tpu")
(a + 1).cpu()
before = torch_tpu.metrics()
for n in range(2, 12):
    b = torch.arange(n, dtype=torch.float32).to("tpu")
    (b * 3).cpu()
    (a + 1).cpu()   # used every step: stays cached
after = torch_tpu.metrics()
print(json.dumps({"compiles": after["compiles"] - before["compiles"],
                  "evictions": after["executable_cache_evictions"] - before["executable_cache_evictions"]}))
""", limit="3")
    # Only the ten `b * 3` programs compile; `a + 1` is never recompiled.
    assert out["compiles"] == 10
    assert out["evictions"] >= 8


def test_fused_regions_bounded_and_correct():
    out = _run("""
before = torch_tpu.metrics()
ok = True
for n in range(1, 41):
    host = torch.linspace(-1, 1, n)
    t = host.to("tpu")
    got = ((t * 2).exp() - t.abs()).cpu()
    ok &= torch.allclose(got, (host * 2).exp() - host.abs(), rtol=1e-6, atol=1e-6)
after = torch_tpu.metrics()
print(json.dumps({"ok": bool(ok), "evictions": after["executable_cache_evictions"] - before["executable_cache_evictions"],
                  "cached": after["cached_executables"]}))
""", limit="4", mode="fused")
    assert out["ok"]
    assert out["cached"] <= 4
    assert out["evictions"] > 0


def test_fused_region_survives_eviction_of_its_recorded_ops():
    # The region records 12 distinct calls while the single-op cache holds 2:
    # the calls' validated entries are evicted before the flush, which still
    # builds (and, if needed, replays) them.
    out = _run("""
host = torch.linspace(-2, 2, 7)
t = host.to("tpu")
fns = [torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.abs, torch.neg, torch.exp,
       lambda x: x * 3, lambda x: x + 2, lambda x: x - 1, torch.relu, torch.square]
exp_t, exp_h = t, host
for f in fns:
    exp_t, exp_h = f(exp_t), f(exp_h)
got = exp_t.cpu()
print(json.dumps({"ok": bool(torch.allclose(got, exp_h, rtol=1e-5, atol=1e-5)),
                  "evictions": torch_tpu.metrics()["executable_cache_evictions"]}))
""", limit="2", mode="fused")
    assert out["ok"]
    assert out["evictions"] > 0


def test_invalid_limit_is_a_clear_error():
    r = run_python(_PRELUDE + "print((torch.ones(2, device='tpu') + 1).cpu())",
                   env={"TORCH_TPU_MAX_CACHED_EXECUTABLES": "lots", "TORCH_TPU_CACHE_DIR": ""})
    assert r.returncode != 0
    assert "TORCH_TPU_MAX_CACHED_EXECUTABLES must be a positive integer, got 'lots'" in r.stderr


@pytest.mark.parametrize("name,value,message", [
    ("TORCH_TPU_CACHE_MAX_BYTES", "2G", "must be a non-negative integer (bytes), got '2G'"),
    ("TORCH_TPU_FUSED_MAX_OPS", "abc", "must be an integer in [1, 16777216], got 'abc'"),
    ("TORCH_TPU_FUSED_MAX_OPS", "0", "must be an integer in [1, 16777216], got '0'"),
    ("TORCH_TPU_FUSED_LOOPS", "yes", "must be 0 or 1, got 'yes'"),
    ("TORCH_TPU_FUSED_GRAPH_BARRIER", "2", "must be 0 or 1, got '2'"),
    ("TORCH_TPU_RECOMPILE_WARN", "-1", "must be a non-negative integer, got '-1'"),
])
def test_invalid_environment_values_are_clear_errors(name, value, message):
    # Each variable is validated where it is first read (fused mode's at its
    # first recorded call, outside the region compile's op-by-op fallback,
    # which would turn the error into a warning): before, atoi/atoll and
    # "anything but 0" read these silently (FUSED_MAX_OPS=abc was 1).
    body = ("torch_tpu.set_eager_mode('fused')\n" if name.startswith("TORCH_TPU_FUSED") else "") + \
        "x = torch.ones(2, device='tpu')\nprint(((x + 1) * 2).cpu(), (x + 1).cpu())"
    r = run_python(_PRELUDE + body, env={name: value})
    assert r.returncode != 0, r.stdout
    assert f"{name} {message}" in r.stderr, r.stderr[-2000:]


def test_eviction_while_launches_are_in_flight():
    # Limit 1: every launch's executable is evicted by the next call's
    # compile while the launch may still run (nothing syncs until the end).
    out = _run("""
x = torch.randn(384, 384, generator=torch.Generator().manual_seed(0))
xt = x.to("tpu")
got, want = [], []
for i in range(24):
    n = 192 + (i % 5) * 32
    f = (lambda a: (a @ a).sin()) if i % 2 else (lambda a: (a * 3 + 1).exp())
    got.append(f(xt[:n, :n]))
    want.append(f(x[:n, :n]))
ok = all(torch.allclose(g.cpu(), w, rtol=1e-4, atol=1e-4) for g, w in zip(got, want))
m = torch_tpu.metrics()
print(json.dumps({"ok": bool(ok), "evictions": m["executable_cache_evictions"], "cached": m["cached_executables"]}))
""", limit="1")
    assert out["ok"]
    assert out["cached"] == 1
    assert out["evictions"] >= 40
