"""torch_tpu: PyTorch, unmodified, on XLA devices through the PJRT C API.

Importing this package (which PyTorch does by itself through the
``torch.backends`` entry point) registers the ``tpu`` device:
``torch.device("tpu")``, ``tensor.to("tpu")``, ``torch.tpu.*`` and
``torch.accelerator``. See DESIGN.md and docs/design.md.
"""
from __future__ import annotations


def _autoload() -> None:
    """Entry point named in the ``torch.backends`` group. Defined before
    ``import torch`` so that `import torch_tpu` as a first import works:
    torch then loads this entry point from the partly imported module, and
    the registration below runs once torch has finished importing."""


import contextlib
import os
import sys

import torch

from . import _plugin

try:
    from . import _C
except ImportError as _e:  # an extension built for another torch, or a broken build
    raise ImportError(
        f"torch_tpu's C++ extension (torch_tpu._C) cannot be loaded: {_e}. It must be built against the "
        f"installed torch {torch.__version__}: rebuild it (`make build`) or install the torch version "
        f"torch_tpu requires.") from _e
from . import _cache  # noqa: F401  (saves cache counters at exit)

__version__ = "0.1.0"



def _cli_mode() -> bool:
    """True under ``python -m torch_tpu ...``: a plugin that cannot be found
    is then reported by the command (``doctor`` names it) instead of failing
    the import."""
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and argv[i + 1:i + 2] == ["torch_tpu"] for i, a in enumerate(argv))


# No usable plugin does not fail `import torch` (the backend autoloads): as
# with CUDA, CPU work goes on, torch.tpu.is_available() is False, and using
# the device raises, naming the plugin path when one was given. One warning
# names the reason here (under `python -m torch_tpu`, the command reports it).
_plugin_error: Exception | None = None  # why no plugin was found
try:
    _C._set_plugin_path(_plugin.discover())
except _plugin.PluginNotFoundError as _e:
    _plugin_error = _e
    if os.environ.get("TORCH_TPU_PJRT_PLUGIN"):
        _C._set_plugin_path(os.environ["TORCH_TPU_PJRT_PLUGIN"])  # first use: the loader's error names it
    if not _cli_mode():
        import warnings

        warnings.warn(f"torch_tpu: {_e}; the tpu device is unavailable", RuntimeWarning, stacklevel=2)

if torch._C._get_privateuse1_backend_name() != "tpu":
    torch.utils.rename_privateuse1_backend("tpu")

from . import device as _device_module  # noqa: E402

torch._register_device_module("tpu", _device_module)
if not hasattr(torch.Tensor, "is_tpu"):
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)


def _install_print_hook() -> None:
    """Formats tpu tensors from one host copy, as PyTorch does for "xla" and
    "lazy" devices (torch/_tensor_str.py), instead of running the
    formatter's dozen small ops (masked_select among them) on the device."""
    import torch._tensor_str as tensor_str

    original = tensor_str._tensor_str
    if getattr(original, "_torch_tpu", False):
        return

    def _tensor_str(self, indent):
        if self.device.type == "tpu":
            self = self.to("cpu")
        return original(self, indent)

    _tensor_str._torch_tpu = True
    tensor_str._tensor_str = _tensor_str


_install_print_hook()

from . import _dlpack  # noqa: E402

# Tensor.__dlpack_device__ for the renamed PrivateUse1 device: see _dlpack.py.
_dlpack.install()

from . import _integrations  # noqa: E402

# accelerate's default device (Trainer, Accelerator) becomes tpu, and
# safetensors' safe_open/load_file accept device="tpu": see _integrations.py.
_integrations.install()

_PACKAGE_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules[__name__]))


def _user_frame() -> str:
    """``file:line (function)`` of the innermost caller outside torch and torch_tpu."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_PACKAGE_DIRS) and not filename.startswith("<frozen"):
            return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return ""


_C._set_user_frame_hook(_user_frame)


def _register_distributed() -> None:
    """torch.distributed backend "tpu_dist" (alias "tpu") for device tpu:
    see torch_tpu/distributed/__init__.py and docs/distributed.md."""
    from . import distributed as _distributed

    _distributed.register()


_register_distributed()


_DYNAMO_REGISTRY = "torch._dynamo.backends.registry"


def _seed_dynamo_backend(registry) -> None:
    """Names ``tpu`` in Dynamo's backend registry as the entry point it is
    (``torch_dynamo_backends``: ``torch_tpu._dynamo:tpu_backend``), loaded
    on its first lookup. Without it, ``lookup_backend("tpu")`` finds no
    such name and first runs ``registry._lazy_import()``, which imports
    every Dynamo backend module (aot_autograd's partitioners and networkx,
    inductor's codecache) and scans every installed distribution's entry
    points: ~1.4 s of a warm ``torch.compile`` here. A name someone
    registered already is left as it is."""
    backends = getattr(registry, "_BACKENDS", None)
    if isinstance(backends, dict) and "tpu" not in backends:
        from importlib.metadata import EntryPoint

        backends["tpu"] = EntryPoint(name="tpu", value="torch_tpu._dynamo:tpu_backend",
                                     group="torch_dynamo_backends")


def _register_dynamo_backend() -> None:
    """Seeds ``tpu`` in Dynamo's registry (``_seed_dynamo_backend``) now if
    torch._dynamo is imported, else right after its registry module is
    first imported (one import hook on sys.meta_path, removed when it
    fires): importing torch_tpu does not import torch._dynamo."""
    registry = sys.modules.get(_DYNAMO_REGISTRY)
    if registry is not None:
        _seed_dynamo_backend(registry)
        return
    import importlib.abc
    import importlib.machinery

    class _RegistryHook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _DYNAMO_REGISTRY:
                return None
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            loader = getattr(spec, "loader", None)
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            exec_module = loader.exec_module

            def exec_and_seed(module):
                exec_module(module)
                _seed_dynamo_backend(module)

            loader.exec_module = exec_and_seed
            return spec

    sys.meta_path.insert(0, _RegistryHook())


_register_dynamo_backend()

EAGER_MODES = ("strict", "debug", "fused")


def set_eager_mode(mode: str) -> None:
    """Selects how tpu ops run: "strict" (default, asynchronous, one op at a
    time), "debug" (synchronous; index and NaN/Inf checks naming the op and
    the user's source line) or "fused" (ops are recorded and run as one
    compiled region at the next sync point). Raises ValueError for other
    names."""
    if mode not in EAGER_MODES:
        raise ValueError(f"unknown tpu eager mode {mode!r}; expected one of {EAGER_MODES}")
    _C.set_eager_mode(mode)


def get_eager_mode() -> str:
    return _C.get_eager_mode()


@contextlib.contextmanager
def eager_mode(mode: str):
    """``with torch_tpu.eager_mode("debug"): ...`` — the mode inside the block."""
    previous = get_eager_mode()
    try:
        # Inside the try: switching runs the recorded region, and if that
        # raises the block's mode is already set (runtime::SetMode): the
        # finally restores the previous one.
        set_eager_mode(mode)
        yield
    finally:
        set_eager_mode(previous)


def metrics() -> dict:
    """Counters since start: compiles (count, seconds), the seconds calling
    threads were blocked on a queued compile (``compile_wait_s``), executable
    cache hits and misses, executions, host<->device bytes, and CPU fallbacks
    by op. Waits for background compiles first (their counts are included)."""
    return dict(_C.metrics())


__all__ = ["set_eager_mode", "get_eager_mode", "eager_mode", "metrics", "EAGER_MODES"]
