"""PJRT plugin discovery (DESIGN.md, "Plugins").

Order: ``TORCH_TPU_PJRT_PLUGIN`` (a path), then libtpu where a TPU is
present, then the XLA CUDA plugin where an NVIDIA GPU is present, then the
XLA CPU plugin from the ``xla-cpu-pjrt`` package.
"""
from __future__ import annotations

import glob
import importlib.util
import os


class PluginNotFoundError(RuntimeError):
    """No usable PJRT plugin was found; the message names what was tried."""


def _tpu_present() -> bool:
    # libtpu off a TPU VM polls a metadata server and can hang: only consider
    # it where TPU device nodes exist.
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _gpu_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*"))


def _package_file(module: str, pattern: str) -> str | None:
    spec = importlib.util.find_spec(module) if importlib.util.find_spec(module.split(".")[0]) else None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        hits = sorted(glob.glob(os.path.join(location, pattern)))
        if hits:
            return hits[0]
    return None


def _libtpu() -> str | None:
    return _package_file("libtpu", "libtpu.so")


def _cuda_plugin() -> str | None:
    for module in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            path = _package_file(module, "xla_cuda_plugin.so")
        except (ImportError, ValueError):
            path = None
        if path:
            return path
    return None


def _cpu_plugin() -> str | None:
    try:
        return _package_file("xla_plugins.xla_cpu_pjrt", "xla_cpu_pjrt.so")
    except (ImportError, ValueError):
        return None


def discover() -> str:
    """Returns the path of the PJRT plugin to load.

    Raises PluginNotFoundError naming the places looked at, or a path set in
    ``TORCH_TPU_PJRT_PLUGIN`` that does not exist.
    """
    env = os.environ.get("TORCH_TPU_PJRT_PLUGIN")
    if env:
        if not os.path.isfile(env):
            raise PluginNotFoundError(
                f"TORCH_TPU_PJRT_PLUGIN={env!r}: no such file (it must be the path of a PJRT plugin .so)")
        return env
    if _tpu_present() and (path := _libtpu()):
        return path
    if _gpu_present() and (path := _cuda_plugin()):
        return path
    if path := _cpu_plugin():
        return path
    raise PluginNotFoundError(
        "no PJRT plugin found: set TORCH_TPU_PJRT_PLUGIN to a plugin path, or install the "
        "XLA CPU plugin with `pip install xla-cpu-pjrt`")
