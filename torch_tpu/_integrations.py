"""Making third-party libraries pick the tpu device where they cannot know it.

Hugging Face accelerate (checked with 1.15.0) chooses its single-process
device in ``PartialState.default_device`` from a fixed list of backends (mps,
mlu, sdaa, musa, npu, hpu, cuda, xpu, neuron, else cpu) and never asks
``torch.accelerator``. transformers' ``TrainingArguments.device`` does ask it
(``is_torch_tpu_available``) and answers ``tpu:0``, so a ``Trainer`` first
moves the model to tpu, then ``Accelerator.prepare`` moves it back to
accelerate's device, cpu, while the Trainer sends the batches to tpu: the
first forward fails with "Expected all tensors to be on the same device".

The fix is made where the choice is made: when ``accelerate.state`` is
imported, its ``PartialState.default_device`` is wrapped so that, where the
original answers cpu and the current torch accelerator is the tpu device, it
answers ``tpu:<current device>``. ``Accelerator(cpu=True)`` /
``TrainingArguments(use_cpu=True)`` still give cpu (accelerate only consults
``default_device`` when cpu was not requested), and ``ACCELERATE_TORCH_DEVICE``
still takes precedence (accelerate reads it before ``default_device``).

``device_map="auto"`` (and "balanced", "sequential") sizes each device with
accelerate's ``get_max_memory`` (``accelerate.utils.modeling``; transformers
imports it as ``accelerate_max_memory``), which asks npu, mlu, sdaa, musa,
xpu, hpu or else cuda for ``mem_get_info`` and never torch.accelerator: with
no CUDA it answers only ``{"cpu": ...}`` and the whole model stays on cpu.
The wrapper (``max_memory=None`` only; a user's dict is passed through)
adds the tpu devices when the current accelerator is tpu and the original
found no device: integer keys, which accelerate and torch read as devices
of the current accelerator (``torch.device(0)`` is ``tpu:0``), with
``torch.tpu.mem_get_info(i)[0]`` bytes each. Where the plugin does not
report device memory (the CPU plugin: every device is the host's memory)
only the current device is listed and the separate "cpu" budget is dropped,
as accelerate does for MPS and integrated CUDA devices (one memory counted
twice would over-commit it); a model larger than that goes to disk, as on
MPS.

The wrappers are installed by a ``sys.meta_path`` finder that wraps only the
loaders of ``accelerate.state`` and ``accelerate.utils.modeling``; nothing is
imported ahead of the user.
"""
from __future__ import annotations

import importlib.abc
import sys

import torch

_TARGET = "accelerate.state"


def _tpu_default_device():
    """tpu:<current device> if the current torch accelerator is tpu and available, else None."""
    try:
        acc = torch.accelerator.current_accelerator()
    except RuntimeError:
        return None
    if acc is None or acc.type != "tpu" or not torch.accelerator.is_available():
        return None
    return torch.device("tpu", torch.tpu.current_device())


def _patch_accelerate_state(module) -> None:
    cls = getattr(module, "PartialState", None)
    prop = getattr(cls, "default_device", None) if cls is not None else None
    if not isinstance(prop, property) or getattr(prop.fget, "_torch_tpu", False):
        return
    original = prop.fget

    def default_device(self) -> torch.device:
        device = original(self)
        if device.type == "cpu":
            tpu = _tpu_default_device()
            if tpu is not None:
                return tpu
        return device

    default_device._torch_tpu = True
    default_device.__doc__ = (original.__doc__ or "") + (
        "\n        (torch_tpu: the tpu device where the current torch accelerator is tpu.)\n")
    cls.default_device = property(default_device)


_MEMORY_TARGET = "accelerate.utils.modeling"


def _tpu_max_memory(found: dict) -> dict | None:
    """accelerate's max_memory dict with the tpu devices added, or None when
    the original already found devices or tpu is not the accelerator."""
    if any(isinstance(k, int) for k in found) or _tpu_default_device() is None:
        return None
    current = torch.tpu.current_device()
    shared_host_memory = "device.bytes_limit" not in torch.tpu.memory_stats(current)
    devices = [current] if shared_host_memory else range(torch.tpu.device_count())
    memory = {i: int(torch.tpu.mem_get_info(i)[0]) for i in devices}
    for key, value in found.items():
        if not (shared_host_memory and key == "cpu"):
            memory[key] = value
    return memory


def _patch_accelerate_memory(module) -> None:
    original = getattr(module, "get_max_memory", None)
    if original is None or getattr(original, "_torch_tpu", False):
        return

    def get_max_memory(max_memory=None):
        found = original(max_memory)
        if max_memory is None:
            with_tpu = _tpu_max_memory(found)
            if with_tpu is not None:
                return with_tpu
        return found

    get_max_memory._torch_tpu = True
    get_max_memory.__wrapped__ = original
    get_max_memory.__doc__ = (original.__doc__ or "") + (
        "\n    (torch_tpu: lists the tpu devices where the current torch accelerator is tpu.)\n")
    module.get_max_memory = get_max_memory
    # Names bound before the patch (torch_tpu imported after accelerate).
    for name, attr in (("accelerate.utils", "get_max_memory"),
                       ("transformers.integrations.accelerate", "accelerate_max_memory")):
        other = sys.modules.get(name)
        if other is not None and getattr(other, attr, None) is original:
            setattr(other, attr, get_max_memory)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the module's patch."""

    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_code, ... for tracebacks and tools
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module in `patches` (module name -> patch
    function taking the module)."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        # The spec the other finders would give (editable installs, zips, ...).
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, patch)
        return spec


def install() -> None:
    """Patches each library now if it is already imported, else when it is:
    accelerate's default device and memory query (above) and safetensors' device argument
    (torch_tpu/_safetensors.py)."""
    from . import _safetensors

    patches = {_TARGET: _patch_accelerate_state, _MEMORY_TARGET: _patch_accelerate_memory,
               _safetensors.TARGET: _safetensors.patch}
    pending = {}
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending[name] = patch
    if pending and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(pending))
