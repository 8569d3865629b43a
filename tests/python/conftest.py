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


@contextlib.contextmanager
def no_cpu_fallback():
    """Fails if any op inside the block fell back to the CPU."""
    before = dict(torch_tpu.metrics()["cpu_fallbacks"])
    yield
    after = torch_tpu.metrics()["cpu_fallbacks"]
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert not new, f"ops fell back to the CPU: {new}"


def run_python(code: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (for start-up behaviour and env vars)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
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
