"""DLPack exchange of tpu tensors, compared with the same calls on CPU
(torch.from_dlpack, torch.utils.dlpack.to_dlpack/from_dlpack, Tensor.__dlpack__):
values exact, the imported tensor aliases the exported one (writes through
either are seen by the other), strided views keep their strides."""
from __future__ import annotations

import pytest
import torch
import torch_tpu  # noqa: F401
from torch.utils.dlpack import DLDeviceType

DTYPES = [torch.float32, torch.int64, torch.bool, torch.bfloat16]


def _sample(dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


IMPORTERS = {
    "from_dlpack": lambda t: torch.from_dlpack(t),
    "capsule": lambda t: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t)),
    "dunder": lambda t: torch.from_dlpack(t.__dlpack__()),
}


def test_dlpack_device():
    t = torch.ones(2, device="tpu")
    assert t.__dlpack_device__() == (DLDeviceType.kDLExtDev, 0)
    assert torch.ones(2).__dlpack_device__() == (DLDeviceType.kDLCPU, 0)


@pytest.mark.parametrize("how", sorted(IMPORTERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_values_and_aliasing(dtype, how):
    _round_trip(dtype, how)


@pytest.mark.parametrize("mode", torch_tpu.EAGER_MODES)
def test_round_trip_in_every_eager_mode(mode):
    with torch_tpu.eager_mode(mode):
        _round_trip(torch.float32, "capsule")
        _round_trip(torch.int64, "from_dlpack")


def _round_trip(dtype, how):
    ref = _sample(dtype)
    cpu = ref.clone()
    t = ref.to("tpu")
    cpu_imp, imp = IMPORTERS[how](cpu), IMPORTERS[how](t)
    assert imp.device == t.device and imp.dtype == dtype and imp.shape == t.shape
    assert imp.stride() == cpu_imp.stride()
    assert torch.equal(imp.cpu(), cpu_imp)
    # Writes through the import are seen by the original, and back.
    one = torch.ones((), dtype=dtype)
    for x in (cpu_imp, imp):
        x[1, 2] = one
    assert torch.equal(t.cpu(), cpu)
    for x in (cpu, t):
        x[0].zero_()
    assert torch.equal(imp.cpu(), cpu_imp)
    for x in (cpu_imp, imp):
        x.mul_(2) if dtype != torch.bool else x.logical_not_()
    assert torch.equal(t.cpu(), cpu)
    assert torch.equal(imp.cpu(), cpu_imp)


@pytest.mark.parametrize("view", ["t", "step", "expand"])
def test_strided_views(view):
    base_cpu = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    base = base_cpu.to("tpu")
    make = {"t": lambda b: b.t(), "step": lambda b: b[::2, ::3], "expand": lambda b: b[:1].expand(3, 6)}[view]
    v_cpu, v = make(base_cpu), make(base)
    assert v.storage_offset() == 0
    imp_cpu, imp = torch.from_dlpack(v_cpu), torch.from_dlpack(v)
    assert imp.stride() == imp_cpu.stride()
    assert torch.equal(imp.cpu(), imp_cpu)
    if view != "expand":
        imp_cpu[0, 1] = -7.0
        imp[0, 1] = -7.0
        assert torch.equal(base.cpu(), base_cpu)
    base_cpu.add_(1)
    base.add_(1)
    assert torch.equal(imp.cpu(), imp_cpu)


def test_offset_view_raises_not_wrong_values():
    base = torch.arange(24, dtype=torch.float32, device="tpu")
    v = base[5:]
    for export in (lambda x: x.__dlpack__(), torch.utils.dlpack.to_dlpack, torch.to_dlpack, torch.from_dlpack):
        with pytest.raises(BufferError, match="storage_offset 5"):
            export(v)
    # A copy exports.
    assert torch.equal(torch.from_dlpack(v.clone()).cpu(), torch.arange(5, 24, dtype=torch.float32))


def test_cpu_tpu_exchange():
    cpu = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    t = cpu.to("tpu")
    # Cross-device imports copy (torch.from_dlpack's device=), values exact.
    to_tpu = torch.from_dlpack(cpu, device="tpu")
    assert to_tpu.device.type == "tpu" and torch.equal(to_tpu.cpu(), cpu)
    to_cpu = torch.from_dlpack(t, device="cpu")
    assert to_cpu.device.type == "cpu" and torch.equal(to_cpu, cpu)
    with pytest.raises(ValueError, match="without copying"):
        torch.from_dlpack(t, device="cpu", copy=False)


def test_export_refusals_match_cpu():
    for dev in ("cpu", "tpu"):
        x = torch.ones(3, device=dev, requires_grad=True)
        with pytest.raises(BufferError, match="require gradient"):
            torch.from_dlpack(x)


def test_imported_storage_not_resizable_as_cpu():
    for dev in ("cpu", "tpu"):
        imp = torch.from_dlpack(torch.arange(4.0, device=dev))
        with pytest.raises(RuntimeError, match="not resizable"):
            imp.resize_(100)


def test_same_device_copy_flag_and_edge_shapes():
    for dev in ("cpu", "tpu"):
        t = torch.arange(4.0, device=dev)
        alias = torch.from_dlpack(t, device=dev)
        alias[0] = 9.0
        copy = torch.from_dlpack(t, device=dev, copy=True)
        copy[1] = 9.0
        assert torch.equal(t.cpu(), torch.tensor([9.0, 1.0, 2.0, 3.0]))
        assert torch.equal(copy.cpu(), torch.tensor([9.0, 9.0, 2.0, 3.0]))
        assert torch.from_dlpack(torch.ones(0, 3, device=dev)).shape == (0, 3)
        s = torch.from_dlpack(torch.tensor(3.5, device=dev))
        assert s.dim() == 0 and s.item() == 3.5
