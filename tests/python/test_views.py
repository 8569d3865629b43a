"""The memory model: tpu tensors are strided views over one device storage;
reads extract the view inside the program and writes (in-place ops, copy_,
out=) update the shared storage so every view sees them, exactly as on CPU."""
from __future__ import annotations

import pytest
import torch

from conftest import no_cpu_fallback


def _pair(*shape, dtype=torch.float32):
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(dtype)
    return x, x.to("tpu")


def _assert_same(tpu, cpu):
    assert tpu.device.type == "tpu"
    assert tpu.shape == cpu.shape and tpu.stride() == cpu.stride()
    assert tpu.storage_offset() == cpu.storage_offset()
    torch.testing.assert_close(tpu.cpu(), cpu, rtol=0, atol=0)


def test_inplace_through_transposed_strided_slice_of_larger_tensor():
    cpu, tpu = _pair(6, 8)
    views = {
        "row": lambda t: t[2],
        "col": lambda t: t[:, 3],
        "block": lambda t: t[1:5, 2:6],
        "strided": lambda t: t[1:5, ::2],
        "flat": lambda t: t.view(-1),
        "transposed": lambda t: t.t(),
    }
    with no_cpu_fallback():
        for t in (cpu, tpu):
            v = t[1:5, ::2].t()  # transposed, strided slice of the larger tensor
            v.add_(100)
            v.mul_(2)
            v[0].sub_(1)
    _assert_same(tpu, cpu)
    for name, view in views.items():
        _assert_same(view(tpu), view(cpu))


def test_copy_into_views():
    cpu, tpu = _pair(5, 6)
    src = torch.randn(6, 2)
    cpu[:, 1::3].t().copy_(src.t()[:2].t().t()) if False else None
    for t in (cpu, tpu):
        t[1:4, 2:4].copy_(torch.full((3, 2), -1.0).to(t.device))
        t.t()[0].copy_(torch.arange(5.0).to(t.device))
        t[:, 5].fill_(9)
        t.diagonal().zero_()
    _assert_same(tpu, cpu)


def test_out_into_view():
    cpu, tpu = _pair(4, 4)
    a = torch.randn(4)
    b = torch.randn(4)
    torch.add(a, b, out=cpu[:, 1])
    torch.add(a.to("tpu"), b.to("tpu"), out=tpu[:, 1])
    _assert_same(tpu, cpu)


def test_views_of_views_read():
    cpu, tpu = _pair(2, 3, 4, 5)
    reads = [
        lambda t: t.permute(3, 1, 0, 2),
        lambda t: t[:, 1:, ::2, 1::2],
        lambda t: t.transpose(1, 3)[0, ::2],
        lambda t: t.reshape(6, 20)[::3],
        lambda t: t.select(2, 1).unsqueeze(0),
        lambda t: t.narrow(3, 1, 3).squeeze(),
        lambda t: t[0, 0, 0].expand(4, 5),
        lambda t: t[:, :, :1, :].expand(2, 3, 4, 5),
        lambda t: torch.as_strided(t, (3, 3), (7, 2), 5),
        lambda t: t.flatten()[17:],
    ]
    with no_cpu_fallback():
        for read in reads:
            torch.testing.assert_close((read(tpu) + 0).cpu(), read(cpu) + 0, rtol=0, atol=0)
            torch.testing.assert_close(read(tpu).cpu(), read(cpu), rtol=0, atol=0)


def test_split_unbind_chunk():
    cpu, tpu = _pair(6, 4)
    for a, b in zip(tpu.split(2), cpu.split(2)):
        _assert_same(a, b)
    for a, b in zip(tpu.unbind(1), cpu.unbind(1)):
        _assert_same(a, b)
    for a, b in zip(tpu.chunk(3, dim=1), cpu.chunk(3, dim=1)):
        _assert_same(a, b)


def test_write_through_one_view_visible_in_all():
    cpu, tpu = _pair(3, 4)
    tv, cv = tpu.view(12), cpu.view(12)
    tt, ct = tpu.t(), cpu.t()
    tv[5] = 100.0
    cv[5] = 100.0
    tt[1, 2] = -7.0
    ct[1, 2] = -7.0
    _assert_same(tpu, cpu)
    _assert_same(tt, ct)
    _assert_same(tv, cv)


def test_dtype_view_bitcast():
    cpu, tpu = _pair(4)
    _assert_same(tpu.view(torch.int32), cpu.view(torch.int32))


def test_inplace_on_int_and_bool_views():
    cpu, tpu = _pair(4, 4, dtype=torch.int64)
    for t in (cpu, tpu):
        t[::2, 1:].mul_(3)
    _assert_same(tpu, cpu)
    bc = torch.zeros(3, 3, dtype=torch.bool)
    bt = bc.to("tpu")
    bc[1].fill_(True)
    bt[1].fill_(True)
    _assert_same(bt, bc)


def test_resize_keeps_contents():
    cpu, tpu = _pair(4)
    cpu.resize_(8)
    tpu.resize_(8)
    assert tpu.shape == (8,)
    torch.testing.assert_close(tpu[:4].cpu(), cpu[:4])


@pytest.mark.parametrize("dtype,view_dtype", [(torch.float32, torch.uint8), (torch.float32, torch.int16),
                                              (torch.int16, torch.float32), (torch.bfloat16, torch.int16)])
def test_dtype_views_of_other_widths(dtype, view_dtype):
    cpu = torch.arange(16, dtype=torch.float32).to(dtype)
    tpu = cpu.to("tpu")
    _assert_same(tpu.view(view_dtype), cpu.view(view_dtype))
    # write through the reinterpreted view, read back in the storage's dtype
    cpu.view(view_dtype)[2:6].zero_()
    tpu.view(view_dtype)[2:6].zero_()
    _assert_same(tpu, cpu)
