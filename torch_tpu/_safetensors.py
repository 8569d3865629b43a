"""``safetensors`` with ``device="tpu"``.

safetensors (checked with 0.8.0) parses ``safe_open``'s ``device`` argument
in Rust (``bindings/python/src/lib.rs``, ``impl FromPyObject for Device``)
against a closed list of names: "cpu", "cuda[:N]", "mps", "npu[:N]",
"xpu[:N]", "xla[:N]", "mlu[:N]", "musa[:N]", "hpu[:N]"; anything else raises
``SafetensorError: device tpu is invalid`` (a ``torch.device`` is refused
too). It also accepts a bare integer N (``Device::Anonymous``), and then
moves each tensor with ``tensor.to(N)``, which torch resolves to device N of
the current accelerator. There is no hook for other device names.

So where the current torch accelerator is tpu, ``safe_open`` is wrapped to
turn "tpu", "tpu:N" and ``torch.device("tpu", N)`` into the integer N (the
current tpu device for a bare "tpu"); every other argument passes unchanged.
``safetensors.torch.load_file(path, device="tpu")``, ``load_model`` and
``safe_open(path, framework="pt", device="tpu")`` then work unchanged. The
wrapper (installed by torch_tpu/_integrations.py's import hook) goes on ``safetensors.safe_open`` (which
``safetensors.torch`` imports by name) when ``safetensors`` is imported, or
at once if it already is (a name bound by ``from safetensors import
safe_open`` before torch was imported keeps the original); nothing is
imported ahead of the user. Where the
accelerator is not tpu (e.g. a CUDA machine), the call is unchanged and
"tpu" still raises: load to "cpu" and ``.to("tpu")`` there.
"""
from __future__ import annotations

import functools
import sys

import torch

TARGET = "safetensors"


def _tpu_index(device):
    """N for a tpu device spelled "tpu", "tpu:N" or torch.device("tpu", N), else None."""
    if isinstance(device, torch.device):
        d = device
    elif isinstance(device, str) and (device == "tpu" or device.startswith("tpu:")):
        try:
            d = torch.device(device)
        except RuntimeError:
            return None
    else:
        return None
    if d.type != "tpu":
        return None
    try:
        acc = torch.accelerator.current_accelerator()
    except RuntimeError:
        return None
    if acc is None or acc.type != "tpu":
        return None
    return d.index if d.index is not None else torch.tpu.current_device()


def _wrap(safe_open):
    if getattr(safe_open, "_torch_tpu", False):
        return safe_open

    @functools.wraps(safe_open)
    def wrapped(filename, framework, device="cpu", *args, **kwargs):
        index = _tpu_index(device)
        return safe_open(filename, framework, index if index is not None else device, *args, **kwargs)

    wrapped._torch_tpu = True
    wrapped.__doc__ = (safe_open.__doc__ or "") + (
        "\n(torch_tpu: device may also be 'tpu', 'tpu:N' or torch.device('tpu', N).)\n")
    return wrapped


def patch(module) -> None:
    """Wraps ``module.safe_open`` (module: safetensors), installed by torch_tpu/_integrations.py."""
    original = getattr(module, "safe_open", None)
    if original is None:
        return
    module.safe_open = _wrap(original)
    torch_module = sys.modules.get(TARGET + ".torch")
    if torch_module is not None and getattr(torch_module, "safe_open", None) is original:
        torch_module.safe_open = module.safe_open
