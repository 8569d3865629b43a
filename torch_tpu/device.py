"""``torch.tpu``: the ``torch.cuda``-style functions for the tpu device.

Memory figures are bytes of live tpu storages as the allocator counts them
(as torch.cuda counts tensor allocations); the plugin's own statistics are
added to ``memory_stats()`` where it reports them.
"""
from __future__ import annotations

import torch

from . import _C

__all__ = [
    "is_available", "device_count", "current_device", "set_device", "synchronize",
    "get_device_name", "manual_seed", "manual_seed_all", "seed", "initial_seed",
    "get_rng_state", "set_rng_state", "memory_allocated", "max_memory_allocated",
    "reset_peak_memory_stats", "memory_stats", "empty_cache", "is_initialized", "device",
    "get_amp_supported_dtype", "is_bf16_supported", "get_device_properties",
]


def is_available() -> bool:
    """True if a PJRT plugin loads and reports at least one device."""
    return device_count() > 0


def _is_in_bad_fork() -> bool:
    """torch.manual_seed asks this before seeding (torch/random.py); PJRT
    clients are not fork-safe, but a forked child that never touched the
    device may still use it."""
    return False


def is_initialized() -> bool:
    return _C._is_initialized()


def device_count() -> int:
    """Number of addressable devices of the loaded plugin (0 if it cannot load)."""
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "tpu":
        raise ValueError(f"expected a tpu device, got {d}")
    return d.index if d.index is not None else current_device()


def set_device(device) -> None:
    """Sets the current tpu device (an int, "tpu:N" or torch.device)."""
    _C.set_device(_index(device))


class device:
    """Context manager that changes the current tpu device."""

    def __init__(self, device):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = current_device()
        set_device(self.idx)

    def __exit__(self, *exc):
        set_device(self.prev)
        return False


def synchronize(device=None) -> None:
    """Waits for every launched tpu computation; raises the first failure, naming its op."""
    _C.synchronize()


def get_device_name(device=None) -> str:
    """Names the platform and plugin in use, e.g. "XLA cpu (xla_cpu_pjrt.so, PJRT 0.81)"."""
    import os
    major, minor = _C.pjrt_api_version()
    idx = _index(device)
    return (f"XLA {_C.platform_name()} {_C.device_kind(idx)} "
            f"({os.path.basename(_C._plugin_path())}, PJRT {major}.{minor})")


def get_device_properties(device=None):
    class _Properties:
        pass
    p = _Properties()
    p.name = get_device_name(device)
    p.platform = _C.platform_name()
    p.total_memory = memory_stats(device).get("device.bytes_limit", 0)
    return p


def manual_seed(seed: int) -> None:
    """Seeds the current tpu device's generator."""
    _default_generator(current_device()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds every tpu device's generator (torch.manual_seed calls this)."""
    for i in range(max(device_count(), 1)):
        _default_generator(i).manual_seed(int(seed))


def seed() -> int:
    return _default_generator(current_device()).seed()


def initial_seed() -> int:
    return _default_generator(current_device()).initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    """16 bytes (uint8 CPU tensor): the generator's seed and offset."""
    return _default_generator(_index(device)).get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    _default_generator(_index(device)).set_state(state)


def _default_generator(index: int) -> torch.Generator:
    return _C._default_generator(index)


def get_amp_supported_dtype() -> list:
    """Dtypes torch.autocast("tpu", dtype=...) accepts (torch.amp asks this)."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def memory_allocated(device=None) -> int:
    """Bytes held by live tpu tensors' storages."""
    return _C.memory_allocated()


def max_memory_allocated(device=None) -> int:
    """Peak of memory_allocated() since start or reset_peak_memory_stats()."""
    return _C.max_memory_allocated()


def reset_peak_memory_stats(device=None) -> None:
    _C.reset_peak_memory_stats()


def memory_stats(device=None) -> dict:
    return dict(_C.memory_stats())


def empty_cache() -> None:
    """No-op: PJRT frees a buffer's memory when its last tensor goes."""
