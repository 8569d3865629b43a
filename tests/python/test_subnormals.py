"""Subnormal floats on the XLA:CPU plugin, fresh compile vs disk-cache load.

Finding (session 10, H9): the plugin runs every executable with the x86
MXCSR flush-to-zero and denormals-are-zero bits set (TensorFlow's
convention: tsl::port::ScopedFlushDenormal around each execution in
PjRtCpuExecutable::ExecuteHelper, and for the whole life of its thread-pool
threads). No PJRT C API field, compile option or xla_cpu_* debug flag turns
it off. So a subnormal input reads as 0 and a subnormal result is written
as 0, whether the executable was compiled in this process or loaded from the
disk cache: the cache is not the cause. What looked like "a fresh compile is
right" was the host-first call (DESIGN.md "Host-first calls"): a program's
first call is served by the ATen CPU kernel while it compiles, and that
keeps subnormals; the second call runs the executable and flushes.

These tests pin that down with TORCH_TPU_HOST_FIRST=0 (every call runs an
executable), in two fresh interpreters on one fresh cache directory:
- a loaded executable computes bit for bit what a fresh compile does
  (passes);
- the executable's values equal CPU's for subnormals (xfail, strict: the
  plugin flushes; when this starts passing, the xfail must go).
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import run_python

# Each case: (name, dtype, values, op). Values are subnormal in their dtype
# (f32 < 1.18e-38, f64 < 2.2e-308, f16 < 6.1e-5, bf16 < 1.18e-38) or produce
# a subnormal result. The child prints, per case, the result's bits as ints.
_CHILD = r"""
import json, torch, torch_tpu
CASES = [
    ("f64->f32", torch.float64, [8.816207631167156e-39, 1e-40], lambda t: t.float()),
    ("f32->f64", torch.float32, [1e-40, 3e-39], lambda t: t.double()),
    ("f32*1", torch.float32, [1e-40, 3e-39], lambda t: t * 1.0),
    ("f32*0.5", torch.float32, [1e-40, 2e-38], lambda t: t * 0.5),
    ("f32+f32", torch.float32, [1e-40, 3e-39], lambda t: t + t),
    ("f64*0.5", torch.float64, [1e-310, 4e-308], lambda t: t * 0.5),
    ("f64*1e10", torch.float64, [1e-300, 1e-320], lambda t: t * 1e10),
    ("bf16*1", torch.bfloat16, [1e-39, 5e-40], lambda t: t * 1.0),
    ("bf16->f32", torch.bfloat16, [1e-39, 5e-40], lambda t: t.float()),
    ("f16->f32", torch.float16, [1e-6, 3e-7], lambda t: t.float()),
    ("f32->f16", torch.float32, [1e-6, 3e-7], lambda t: t.half()),
    ("f16*0.5", torch.float16, [1e-5, 2e-6], lambda t: t * 0.5),
]
BITS = {torch.float64: torch.int64, torch.float32: torch.int32,
        torch.float16: torch.int16, torch.bfloat16: torch.int16}
before = torch_tpu.metrics()
out = {}
for name, dtype, values, op in CASES:
    host = torch.tensor(values, dtype=dtype)
    got = op(host.to("tpu")).cpu()
    want = op(host)
    out[name] = {"tpu": got.view(BITS[got.dtype]).tolist(), "cpu": want.view(BITS[want.dtype]).tolist()}
after = torch_tpu.metrics()
out["_metrics"] = {k: after[k] - before[k] for k in ("compiles", "disk_cache_hits", "disk_cache_misses", "host_served")}
print(json.dumps(out))
"""


def _run(cache_dir: str) -> dict:
    r = run_python(_CHILD, env={"TORCH_TPU_CACHE_DIR": cache_dir, "TORCH_TPU_HOST_FIRST": "0",
                                "TORCH_TPU_EAGER_MODE": "strict"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("subnormal_cache"))
    cold = _run(cache_dir)   # compiles every program, writes the cache
    warm = _run(cache_dir)   # loads every program from the cache
    return cold, warm


def test_runs_are_what_they_claim(cold_and_warm):
    cold, warm = cold_and_warm
    assert cold["_metrics"]["host_served"] == 0 and warm["_metrics"]["host_served"] == 0
    # metrics()["compiles"] counts programs built (a disk load included);
    # the disk counters say where each executable came from.
    n = cold["_metrics"]["disk_cache_misses"]
    assert n > 0 and cold["_metrics"]["disk_cache_hits"] == 0
    assert warm["_metrics"]["disk_cache_hits"] == n and warm["_metrics"]["disk_cache_misses"] == 0


def test_loaded_executable_equals_fresh_compile(cold_and_warm):
    cold, warm = cold_and_warm
    for name in cold:
        if name.startswith("_"):
            continue
        assert warm[name]["tpu"] == cold[name]["tpu"], name


# Cases whose subnormal input or result goes through an f32/f64 SSE
# operation: flushed by the plugin's FTZ/DAZ.
_FLUSHED = ["f64->f32", "f32->f64", "f32*1", "f32*0.5", "f32+f32", "f64*0.5", "f64*1e10", "bf16*1"]
# Cases that equal CPU today: bf16 -> f32 is a bit shift; f16 subnormals are
# normal f32 numbers, and f32 -> f16 of normal f32 inputs gives the same f16
# subnormals as CPU (measured, session 10).
_KEPT = ["bf16->f32", "f16->f32", "f32->f16", "f16*0.5"]


@pytest.mark.parametrize("name", _KEPT)
def test_subnormals_equal_cpu_where_kept(cold_and_warm, name):
    cold, warm = cold_and_warm
    assert cold[name]["tpu"] == cold[name]["cpu"]
    assert warm[name]["tpu"] == warm[name]["cpu"]


@pytest.mark.xfail(strict=True, reason="XLA:CPU plugin runs executables with FTZ/DAZ set "
                                       "(tsl ScopedFlushDenormal); not reachable through the PJRT C API")
@pytest.mark.parametrize("name", _FLUSHED)
def test_subnormals_equal_cpu(cold_and_warm, name):
    cold, warm = cold_and_warm
    assert cold[name]["tpu"] == cold[name]["cpu"] or warm[name]["tpu"] == warm[name]["cpu"]
