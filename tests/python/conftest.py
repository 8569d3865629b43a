"""Shared helpers for the tpu test suite: values are always compared with
PyTorch on CPU on the same inputs."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch_tpu

# The compile cache above Dynamo (torch_tpu._precompile) is on by default: a
# session saves its compiled frames to a store of its own, so that no test
# loads a frame a previous session (or, in-process, an earlier test) saved
# and every count of compiles stays independent of what ran before. The
# executable cache (TORCH_TPU_CACHE_DIR) stays shared. Tests of the warm
# start set their own directories.
if "TORCH_TPU_COMPILE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _compile_cache_dir = tempfile.mkdtemp(prefix="torch_tpu_compile_cache_")
    os.environ["TORCH_TPU_COMPILE_CACHE_DIR"] = _compile_cache_dir
    atexit.register(shutil.rmtree, _compile_cache_dir, ignore_errors=True)


# Test tiers: `make test` runs the default tier; `make test-full` sets
# TORCH_TPU_TEST_FULL=1 (with TORCH_TPU_OPINFO_FULL and TORCH_TPU_DIST_FULL)
# and also runs the tests marked `full_tier` (the slower variants of a
# capability whose fast variant stays in the default tier).
FULL_TIER = os.environ.get("TORCH_TPU_TEST_FULL", "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "full_tier: runs only in the full tier (make test-full, TORCH_TPU_TEST_FULL=1)")


def pytest_collection_modifyitems(config, items):
    if FULL_TIER:
        return
    skip = pytest.mark.skip(reason="full tier: make test-full (TORCH_TPU_TEST_FULL=1)")
    for item in items:
        if item.get_closest_marker("full_tier") is not None:
            item.add_marker(skip)


@contextlib.contextmanager
def no_cpu_fallback():
    """Fails if any op inside the block fell back to the CPU."""
    before = dict(torch_tpu.metrics()["cpu_fallbacks"])
    yield
    after = torch_tpu.metrics()["cpu_fallbacks"]
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert not new, f"ops fell back to the CPU: {new}"


def wait_for_compiles() -> None:
    """Waits for the single-op compiles queued in the background (strict
    mode's host-first calls; docs/design.md "Host-first calls"): after it,
    the next strict call of a key whose compile was queued runs the device
    program. By default (TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2) a key's
    compile is queued at its second call, so a test that needs the device
    program (a value check raised at the sync point, executions per step)
    calls the key twice, then this. torch_tpu.metrics() is what waits."""
    torch_tpu.metrics()


def run_python(code: str, env: dict | None = None, timeout: int = 120,
               drop_env: tuple = ()) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (for start-up behaviour and env
    vars): this process's environment plus `env`, less the `drop_env` names."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    for name in drop_env:
        full_env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


@pytest.fixture
def strict_mode():
    with torch_tpu.eager_mode("strict"):
        yield


@pytest.fixture
def debug_mode():
    with torch_tpu.eager_mode("debug"):
        yield


def base_op_name(op_name: str) -> str:
    """"aten::add_.Tensor" -> "add" (the lowering registry's base name)."""
    name = op_name.split("::")[-1].split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def family_helpers(ours: set, bf16_tol: dict | None = None, exact: bool = False):
    """The helpers of a lowering family's test file (test_conv, test_misc,
    test_nn, test_pool, test_reduction, test_sort), as (no_fallback, tpu, check):

    - ``no_fallback(names=ours)``: a context manager failing if an op whose
      base name is in ``names`` ran on the CPU fallback inside it;
    - ``tpu(x)``: x moved to the tpu device if it is a tensor;
    - ``check(actual, expected, **tol)``: a tpu result (or a tuple/list of
      them) against CPU's: device, dtype and shape exactly, then values with
      ``torch.testing.assert_close`` (NaN equal to NaN; bfloat16/float16 with
      ``bf16_tol`` unless a tolerance is given). With ``exact``, atol and
      rtol default to 0 each (ops that select or count values).
    """
    tpu_device = torch.device("tpu")

    @contextlib.contextmanager
    def no_fallback(names=ours):
        before = dict(torch_tpu.metrics()["cpu_fallbacks"])
        yield
        after = torch_tpu.metrics()["cpu_fallbacks"]
        new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        hit = {k: v for k, v in new.items() if base_op_name(k) in names}
        assert not hit, f"ops fell back to the CPU: {hit}"

    def tpu(x):
        return x.to(tpu_device) if isinstance(x, torch.Tensor) else x

    def check(actual, expected, **tol):
        if isinstance(expected, (tuple, list)):
            assert len(actual) == len(expected), (len(actual), len(expected))
            for a, e in zip(actual, expected):
                check(a, e, **tol)
            return
        assert actual.device.type == "tpu", actual.device
        actual = actual.cpu()
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        if exact:
            tol = {"atol": tol.get("atol", 0), "rtol": tol.get("rtol", 0)}
        elif not tol and bf16_tol and expected.dtype in (torch.bfloat16, torch.float16):
            tol = bf16_tol
        torch.testing.assert_close(actual, expected, equal_nan=True, **tol)

    return no_fallback, tpu, check
