"""Eager compiles by op and cause (torch_tpu.metrics()["compiles_by_op"],
["compiles_by_cause"]; csrc/runtime/compile_stats.h), the recompile warning,
and the per-op counters `python -m torch_tpu cache info` shows across
processes. Counts, not times. Each scenario runs in a fresh process (counters
and the once-per-op warning are process-wide) with its own cache directory."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import run_python

CAUSES = """
import json, torch, torch_tpu
torch_tpu.set_eager_mode("strict")
out = {}
def snap(name):
    return dict(torch_tpu.metrics()["compiles_by_op"].get(name, {}))
def check(t, ref):
    assert torch.equal(t.cpu(), ref), (t.cpu(), ref)

a, b = torch.randn(5), torch.randn(5)
check(a.to("tpu") + b.to("tpu"), a + b)                    # first
out["first"] = snap("aten::add.Tensor")
check(a.to("tpu") + b.to("tpu"), a + b)                    # same key: no compile
check(torch.add(a.to("tpu"), b.to("tpu"), alpha=3), torch.add(a, b, alpha=3))  # Scalar: runtime input
out["same"] = snap("aten::add.Tensor")
c, d = torch.randn(6), torch.randn(6)
check(c.to("tpu") + d.to("tpu"), c + d)                    # new shape
out["shape"] = snap("aten::add.Tensor")
ad, bd = a.double(), b.double()
check(ad.to("tpu") + bd.to("tpu"), ad + bd)                # new dtype, shape seen before
out["dtype"] = snap("aten::add.Tensor")
x = torch.randn(3, 4)
check(x.to("tpu").sum(0), x.sum(0))                        # first
check(x.to("tpu").sum(1), x.sum(1))                        # new static (dim)
y = torch.randn(5, 4)
check(y.to("tpu").sum(0), y.sum(0))                        # new shape
out["sum"] = snap("aten::sum.dim_IntList")
m = torch_tpu.metrics()
out["totals"] = m["compiles_by_cause"]
out["compiles"] = m["compiles"]
print(json.dumps(out))
"""


def _run(code, cache_dir, **env):
    # The scenarios call most keys once: TORCH_TPU_HOST_FIRST_COMPILE_AFTER=1
    # compiles each at its first call, where its cause is decided (at the
    # default, 2, the compile and its cause are counted at the second call;
    # tests/python/test_host_first.py).
    env = {"TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "1", **env}
    r = run_python(code, env={"TORCH_TPU_CACHE_DIR": str(cache_dir), **env}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_compiles_by_op_and_cause(tmp_path):
    out = json.loads(_run(CAUSES, tmp_path).stdout.strip().splitlines()[-1])
    first, same, shape, dtype = out["first"], out["same"], out["shape"], out["dtype"]
    assert (first["compiles"], first["first"], first["distinct_shapes"]) == (1, 1, 1)
    assert first["shapes"] == ["[5], [5]"]
    assert same["compiles"] == 1  # a repeated call and a new Scalar value compile nothing
    assert (shape["compiles"], shape["new_shape"], shape["distinct_shapes"]) == (2, 1, 2)
    assert (dtype["compiles"], dtype["new_dtype"], dtype["distinct_shapes"]) == (3, 1, 2)
    assert dtype["new_static"] == 0 and dtype["other"] == 0
    s = out["sum"]
    assert (s["compiles"], s["first"], s["new_static"], s["new_shape"], s["new_dtype"]) == (3, 1, 1, 1, 0)
    # Every strict-mode compile is an eager single-op compile with one cause.
    assert sum(out["totals"].values()) == out["compiles"]
    assert out["totals"]["first"] >= 2 and out["totals"]["new_shape"] >= 2


WARN = """
import json, warnings, torch, torch_tpu
torch_tpu.set_eager_mode("strict")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for n in range(1, 6):
        x = torch.randn(n)
        assert torch.equal((x.to("tpu") * x.to("tpu")).cpu(), x * x)
msgs = [str(w.message) for w in caught if "different shapes" in str(w.message)]
print(json.dumps({"count": len(msgs), "message": msgs[0] if msgs else ""}))
"""


def test_recompile_warning_once_and_cache_info(tmp_path):
    # Exact-shape programs only (TORCH_TPU_SHAPE_POLY=0): five lengths are five
    # compiles per process (with shape-polymorphic programs, lengths 3-5 share
    # one bucket program: tests/python/test_shape_poly.py).
    r = _run(WARN, tmp_path, TORCH_TPU_RECOMPILE_WARN="3", TORCH_TPU_SHAPE_POLY="0")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    count, message = out["count"], out["message"]
    assert count == 1  # once per op, at the third distinct shape
    assert "aten::mul.Tensor has compiled for 3 different shapes" in message
    assert "[1], [1]; [2], [2]; [3], [3]" in message
    assert "fused" in message and "dynamic=True" in message and "bucket" in message

    # A second process with the same cache directory: disk hits still count
    # as compiles; the counters add up across processes in stats.json.
    r = _run(WARN, tmp_path, TORCH_TPU_RECOMPILE_WARN="0", TORCH_TPU_SHAPE_POLY="0")
    assert json.loads(r.stdout.strip().splitlines()[-1])["count"] == 0  # 0 disables the warning
    stats = json.loads((tmp_path / "stats.json").read_text())
    mul = stats["ops"]["aten::mul.Tensor"]
    assert (mul["compiles"], mul["recompiles"], mul["new_shape"]) == (10, 8, 8)

    info = subprocess.run([sys.executable, "-m", "torch_tpu", "cache", "info"], capture_output=True, text=True,
                          env={**__import__("os").environ, "TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "hottest recompiling ops" in info.stdout
    line = next(l for l in info.stdout.splitlines() if "aten::mul.Tensor" in l)
    assert line.split()[1:4] == ["10", "8", "8"]


def test_bad_threshold_is_a_clear_error(tmp_path):
    # Read at the first compile: a key's second call by default.
    r = run_python("import torch, torch_tpu\nx = torch.ones(2, device='tpu')\nprint((x + x).cpu(), (x + x).cpu())",
                   env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_RECOMPILE_WARN": "lots"}, timeout=120)
    assert r.returncode != 0
    assert "TORCH_TPU_RECOMPILE_WARN must be a non-negative integer, got 'lots'" in r.stderr
