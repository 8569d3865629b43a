"""DLPack exchange of tpu tensors (``torch.from_dlpack``, ``Tensor.__dlpack__``,
``torch.utils.dlpack.to_dlpack`` / ``from_dlpack``).

PyTorch 2.13 maps PrivateUse1 to DLPack's ``kDLExtDev`` in C++
(``aten/src/ATen/DLConvertor.cpp``: export and import), but
``Tensor.__dlpack_device__`` (``torch/_tensor.py``) compares
``self.device.type`` with the literal ``"privateuse1"``, so once the backend is
renamed to ``tpu`` it raises ``ValueError: Unknown device type tpu for
Dlpack`` and ``torch.from_dlpack(tpu_tensor)`` fails before any capsule is
made. ``install()`` wraps ``Tensor.__dlpack_device__`` to answer
``(DLDeviceType.kDLExtDev, index)`` for tpu tensors, exactly what the
original answers for an unrenamed PrivateUse1 tensor; every other device goes
to the original.

A capsule carries the tensor's data pointer (``Tensor.data_ptr()``: the
storage's pointer plus ``storage_offset * itemsize``) and PyTorch's importer
wraps it with ``at::from_blob``; the runtime maps that pointer back to the
storage it belongs to (docs/design.md, "Storages made from a tpu data
pointer"), so the imported tensor aliases the exported one. A view whose
data pointer is inside its storage (nonzero storage offset) cannot be mapped
back (the pointer could even equal another live storage's, which would alias
the wrong data), so exporting a tpu tensor with ``storage_offset() != 0``
raises BufferError (``Tensor.__dlpack__``, ``torch.utils.dlpack.to_dlpack``,
``torch.to_dlpack``); export ``t.clone()`` instead. Strided views at offset 0
(transposes, steps) export with their strides.
"""
from __future__ import annotations

import torch
import torch.utils.dlpack


def _check_export(t) -> None:
    if isinstance(t, torch.Tensor) and t.device.type == "tpu" and t.storage_offset() != 0:
        raise BufferError(
            f"Can't export a tpu tensor with storage_offset {t.storage_offset()} to DLPack: the capsule's data "
            "pointer would not be the start of its tpu storage; export t.clone() (a copy) instead")


def install() -> None:
    original = torch.Tensor.__dlpack_device__
    if getattr(original, "_torch_tpu", False):
        return
    original_dlpack = torch.Tensor.__dlpack__
    original_to_dlpack = torch._C._to_dlpack

    def __dlpack__(self, *args, **kwargs):
        if not torch.overrides.has_torch_function_unary(self):
            _check_export(self)
        return original_dlpack(self, *args, **kwargs)

    def to_dlpack(tensor, *args, **kwargs):
        _check_export(tensor)
        return original_to_dlpack(tensor, *args, **kwargs)

    __dlpack__.__doc__ = original_dlpack.__doc__
    to_dlpack.__doc__ = original_to_dlpack.__doc__
    torch.Tensor.__dlpack__ = __dlpack__
    torch.utils.dlpack.to_dlpack = to_dlpack
    if getattr(torch, "to_dlpack", None) is original_to_dlpack:
        torch.to_dlpack = to_dlpack

    def __dlpack_device__(self):
        if not torch.overrides.has_torch_function_unary(self) and self.device.type == "tpu":
            from torch.utils.dlpack import DLDeviceType

            idx = self.device.index if self.device.index is not None else 0
            return (DLDeviceType.kDLExtDev, idx)
        return original(self)

    __dlpack_device__.__doc__ = original.__doc__
    __dlpack_device__._torch_tpu = True
    torch.Tensor.__dlpack_device__ = __dlpack_device__
