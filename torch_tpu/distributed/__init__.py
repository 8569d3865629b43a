"""torch.distributed on tpu: the c10d backend ``tpu_dist``.

Registered when torch_tpu is imported (``register()``), so that

- ``torch.distributed.init_process_group("tpu_dist")`` (also ``"tpu"``)
  maps both ``tpu`` and ``cpu`` tensors to the backend (cpu tensors go to
  its internal gloo group as they are; ``barrier()`` uses a cpu tensor);
- ``init_process_group()`` with no backend, on a process whose accelerator
  is tpu, gets ``cpu:gloo,tpu:tpu_dist`` (PyTorch 2.13's ``BackendConfig``
  would map only the accelerator, leaving ``barrier()`` and cpu collectives
  without a backend; see ``_default_backend_config``);
- ``init_device_mesh("tpu", (n,))`` works (DeviceMesh calls
  ``init_process_group()`` and ``torch.tpu.set_device(LOCAL_RANK)``).

The backend is C++ (``csrc/distributed/process_group.*``, a
``c10d::Backend``); its transport is host-staged: tpu -> host copies, the
collective on a gloo backend built here from the same store under the prefix
``tpu_dist_host/`` and the group's timeout, host -> tpu copies when the Work
is waited on. See docs/distributed.md.
"""
from __future__ import annotations

import datetime

import torch

BACKEND_NAME = "tpu_dist"
_ALIASES = ("tpu_dist", "tpu")
_registered = False


def create_backend(store, rank: int, size: int, timeout: datetime.timedelta):
    """The creator c10d calls for each (group, device) mapped to tpu_dist:
    a ``ProcessGroupTPU`` over a gloo backend of the same ``rank``/``size``
    from a prefix of ``store`` (the group's PrefixStore), with ``timeout``
    (the group's; gloo raises on the waiting ranks when it expires)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    from .. import _C

    # Settings first: raised before gloo connects, every rank fails alike
    # (after connecting, one rank's error closed its connections while a
    # peer still connected: "Connection closed by peer" there).
    _C._distributed.ProcessGroupTPU.check_settings()
    host = ProcessGroupGloo(PrefixStore("tpu_dist_host/", store), rank, size, timeout)
    return _C._distributed.ProcessGroupTPU(host, rank, size, timeout)


def _default_backend_config() -> None:
    """``init_process_group()`` without a backend builds ``BackendConfig
    ("undefined")``, which in PyTorch 2.13 maps only the accelerator's device
    type (distributed_c10d.py, BackendConfig.__init__). With a tpu
    accelerator, cpu is added with gloo, as CUDA users get it from
    ``cpu:gloo,cuda:nccl``; other configurations are left as PyTorch builds
    them."""
    from torch.distributed import distributed_c10d as c10d

    original = c10d.BackendConfig.__init__
    if getattr(original, "_torch_tpu", False):
        return

    def __init__(self, backend):
        original(self, backend)
        if str(backend) == c10d.Backend.UNDEFINED and set(self.device_backend_map) == {"tpu"}:
            self.device_backend_map = {"cpu": c10d.Backend(c10d.Backend.GLOO), "tpu": c10d.Backend(BACKEND_NAME)}

    __init__._torch_tpu = True
    c10d.BackendConfig.__init__ = __init__


def register() -> None:
    """Registers tpu_dist (and its alias "tpu") with torch.distributed for
    devices ["tpu", "cpu"] (a list: PyTorch 2.13 iterates a string letter by
    letter); the default backend of device tpu becomes tpu_dist. Idempotent;
    a no-op when torch was built without distributed support."""
    global _registered
    if _registered or not torch.distributed.is_available():
        return
    from torch.distributed import Backend

    for name in _ALIASES:
        if name.upper() not in Backend._plugins:
            Backend.register_backend(name, create_backend, extended_api=False, devices=["tpu", "cpu"])
    Backend.default_device_backend_map["tpu"] = BACKEND_NAME
    _default_backend_config()
    _registered = True


__all__ = ["BACKEND_NAME", "create_backend", "register"]
