"""The memory model: tpu tensors are strided views over one device storage;
reads extract the view inside the program and writes (in-place ops, copy_,
out=) update the shared storage so every view sees them, exactly as on CPU."""
from __future__ import annotations

import pytest
import torch

from conftest import no_cpu_fallback, wait_for_compiles


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


@pytest.mark.parametrize("view_dtype", [torch.int16, torch.float32, torch.int64, torch.uint8, torch.int8])
def test_bool_storage_views_of_other_widths(view_dtype):
    """bool storages reinterpret like CPU's: each bool is a 0/1 byte."""
    cpu = (torch.arange(32) % 3 == 0)
    tpu = cpu.to("tpu")
    _assert_same(tpu.view(view_dtype), cpu.view(view_dtype))
    _assert_same(tpu.view(view_dtype).view(torch.bool), cpu)
    # the other direction: bytes of 0/1 read as bool
    src = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.uint8).view(view_dtype)
    _assert_same(src.to("tpu").view(torch.bool), src.view(torch.bool))
    # write through the reinterpreted view (values whose bytes are 0/1), read back as bool
    ones = torch.ones(1, dtype=torch.uint8).expand(torch._utils._element_size(view_dtype)).clone().view(view_dtype)
    cpu.view(view_dtype)[1:3] = ones
    tpu.view(view_dtype)[1:3] = ones.to("tpu")
    _assert_same(tpu, cpu)


# --- conjugate and negative bits (x.conj(), torch._neg_view) ----------------

def _complex_pair(*shape):
    g = torch.Generator().manual_seed(0)
    z = torch.complex(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))
    return z, z.to("tpu")


def test_conj_view_copies_to_cpu_conjugated():
    z, zt = _complex_pair(3, 4)
    v = zt.conj()
    assert v.is_conj()
    torch.testing.assert_close(v.cpu(), z.conj(), rtol=0, atol=0)
    assert not v.cpu().is_conj() or torch.equal(v.cpu().resolve_conj(), z.conj().resolve_conj())
    torch.testing.assert_close(v.t().cpu(), z.conj().t(), rtol=0, atol=0)  # a view of the conj view
    torch.testing.assert_close(v.resolve_conj().cpu(), z.conj().resolve_conj(), rtol=0, atol=0)
    torch.testing.assert_close(v.clone().cpu(), z.conj().clone(), rtol=0, atol=0)
    assert not v.clone().is_conj()
    torch.testing.assert_close(zt.cpu(), z, rtol=0, atol=0)  # the base is untouched


def test_conj_view_item_imag_and_ops():
    z, zt = _complex_pair(5)
    assert zt.conj()[2].item() == z.conj()[2].item()
    torch.testing.assert_close(zt.conj().imag.cpu(), z.conj().imag, rtol=0, atol=0)
    torch.testing.assert_close((zt.conj() * 2).cpu(), z.conj() * 2)
    torch.testing.assert_close((zt.conj() + zt).cpu(), z.conj() + z)
    torch.testing.assert_close(torch.abs(zt.conj()).cpu(), torch.abs(z.conj()))


def test_copy_between_conj_views_on_device_and_from_host():
    z, zt = _complex_pair(2, 3)
    w, wt = _complex_pair(2, 3)
    cpu_dst, tpu_dst = z.clone(), zt.clone()
    cpu_dst.conj().copy_(w)      # dst conj, src plain
    tpu_dst.conj().copy_(wt)
    torch.testing.assert_close(tpu_dst.cpu(), cpu_dst, rtol=0, atol=0)
    cpu_dst.copy_(w.conj())      # src conj within the device
    tpu_dst.copy_(wt.conj())
    torch.testing.assert_close(tpu_dst.cpu(), cpu_dst, rtol=0, atol=0)
    cpu_dst.conj().copy_(w.conj())  # both: no conjugation
    tpu_dst.conj().copy_(wt.conj())
    torch.testing.assert_close(tpu_dst.cpu(), cpu_dst, rtol=0, atol=0)
    tpu_dst.conj().copy_(w.conj())  # from the host, both conj
    cpu_dst.conj().copy_(w.conj())
    torch.testing.assert_close(tpu_dst.cpu(), cpu_dst, rtol=0, atol=0)
    tpu_dst.conj()[1].copy_(w[0])   # from the host into part of a conj view
    cpu_dst.conj()[1].copy_(w[0])
    torch.testing.assert_close(tpu_dst.cpu(), cpu_dst, rtol=0, atol=0)


def test_inplace_on_conj_view_writes_conjugated():
    z, zt = _complex_pair(4)
    for t in (z, zt):
        t.conj().mul_(2)
    torch.testing.assert_close(zt.cpu(), z)


def test_neg_view_values_ops_and_inplace():
    x, xt = _pair(3, 4)
    x = x - 5
    xt = x.to("tpu")
    with no_cpu_fallback():
        n = torch._neg_view(xt)
        assert n.is_neg()
        torch.testing.assert_close(n.cpu(), torch._neg_view(x), rtol=0, atol=0)
        torch.testing.assert_close((n + 1).cpu(), torch._neg_view(x) + 1, rtol=0, atol=0)
        torch.testing.assert_close((n @ xt.t()).cpu(), torch._neg_view(x) @ x.t())
        torch.testing.assert_close(n.sum(1).cpu(), torch._neg_view(x).sum(1))
        torch.testing.assert_close(n.clone().cpu(), torch._neg_view(x).clone(), rtol=0, atol=0)
        torch.testing.assert_close(n[1:, ::2].cpu(), torch._neg_view(x)[1:, ::2], rtol=0, atol=0)
        assert n[1, 2].item() == torch._neg_view(x)[1, 2].item()
        # In-place through the neg view: the base stores the negated result.
        cx, tx = x.clone(), xt.clone()
        torch._neg_view(cx).add_(3)
        torch._neg_view(tx).add_(3)
        torch.testing.assert_close(tx.cpu(), cx, rtol=0, atol=0)
        torch._neg_view(cx).copy_(x * 2)
        torch._neg_view(tx).copy_(xt * 2)
        torch.testing.assert_close(tx.cpu(), cx, rtol=0, atol=0)
        torch.add(x, 1, out=torch._neg_view(cx))
        torch.add(xt, 1, out=torch._neg_view(tx))
        torch.testing.assert_close(tx.cpu(), cx, rtol=0, atol=0)
        # Integers too.
        i = torch.arange(-4, 8).reshape(3, 4)
        it = i.to("tpu")
        torch.testing.assert_close(torch._neg_view(it).cpu(), torch._neg_view(i), rtol=0, atol=0)
        torch.testing.assert_close((torch._neg_view(it) * 3).cpu(), torch._neg_view(i) * 3, rtol=0, atol=0)


def test_neg_view_to_host_dtype_conversion():
    x = torch.tensor([1.5, -2.25, 3.0])
    xt = x.to("tpu")
    torch.testing.assert_close(torch._neg_view(xt).to("cpu", torch.float64), torch._neg_view(x).double(),
                               rtol=0, atol=0)
    torch.testing.assert_close(torch._neg_view(xt).to(torch.float64).cpu(), torch._neg_view(x).double(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("fn", ["hfft", "ihfft_roundtrip", "hfft2", "hfftn"])
def test_hfft_matches_cpu(fn):
    z, zt = _complex_pair(4, 6)
    if fn == "hfft":
        want, got = torch.fft.hfft(z), torch.fft.hfft(zt)
    elif fn == "ihfft_roundtrip":
        r = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
        want, got = torch.fft.hfft(torch.fft.ihfft(r)), torch.fft.hfft(torch.fft.ihfft(r.to("tpu")))
    elif fn == "hfft2":
        want, got = torch.fft.hfft2(z), torch.fft.hfft2(zt)
    else:
        want, got = torch.fft.hfftn(z, s=(4, 8)), torch.fft.hfftn(zt, s=(4, 8))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


# --- unfold: a view on tpu, with a native backward ----------------------------

@pytest.mark.parametrize("shape,dim,size,step", [
    ((10,), 0, 3, 2), ((10,), 0, 3, 3), ((10,), 0, 4, 5), ((4, 9, 3), 1, 4, 2), ((4, 9, 3), -1, 2, 1),
    ((2, 7), 0, 2, 1), ((6,), 0, 6, 1), ((6,), 0, 0, 2), ((), 0, 1, 1)])
def test_unfold_is_a_view_matching_cpu(shape, dim, size, step):
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    xt = x.to("tpu")
    with no_cpu_fallback():
        u = xt.unfold(dim, size, step)
    want = x.unfold(dim, size, step)
    assert u._base is xt or u.untyped_storage().data_ptr() == xt.untyped_storage().data_ptr()
    _assert_same(u, want)


@pytest.mark.parametrize("shape,dim,size,step", [
    ((10,), 0, 3, 2), ((10,), 0, 3, 3), ((10,), 0, 2, 4), ((4, 9, 3), 1, 4, 2), ((3, 8), 1, 5, 1), ((5,), 0, 5, 1)])
def test_unfold_backward_native_matches_cpu(shape, dim, size, step):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(*x.unfold(dim, size, step).shape, generator=g)
    xc = x.clone().requires_grad_()
    (xc.unfold(dim, size, step) * w).sum().backward()
    xt = x.to("tpu").requires_grad_()
    with no_cpu_fallback():
        (xt.unfold(dim, size, step) * w.to("tpu")).sum().backward()
        grad = xt.grad
    torch.testing.assert_close(grad.cpu(), xc.grad, rtol=1e-6, atol=1e-6)
    # The op itself, called directly (also bf16: summed in f32).
    for dtype in (torch.float32, torch.bfloat16):
        gi = w.to(dtype)
        want = torch.ops.aten.unfold_backward(gi, list(shape), dim, size, step)
        with no_cpu_fallback():
            got = torch.ops.aten.unfold_backward(gi.to("tpu"), list(shape), dim, size, step)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)


def test_inplace_through_unfold_view():
    cpu, tpu = _pair(3, 12)
    with no_cpu_fallback():
        for t in (cpu, tpu):
            u = t.unfold(1, 4, 4)        # non-overlapping windows
            u.mul_(2)
            u[:, 1].add_(100)
            u[..., 0].copy_(torch.full((3, 3), -1.0).to(t.device))
            t.unfold(1, 3, 5).sub_(0.5)  # gaps between windows
    _assert_same(tpu, cpu)


# --- in-place writes to overlapping (expanded) tensors -------------------------

_OVERLAP_ERROR = "more than one element of the written-to tensor refers to a single memory location"


@pytest.mark.parametrize("name,fn", [
    ("add_", lambda t: t.add_(1)),
    ("mul_", lambda t: t.mul_(2)),
    ("exp_", lambda t: t.exp_()),
    ("clamp_", lambda t: t.clamp_(0, 1)),
    ("copy_", lambda t: t.copy_(torch.ones(2, 3, device=t.device))),
    ("copy_from_host", lambda t: t.copy_(torch.ones(2, 3))),
    ("addcmul_", lambda t: t.addcmul_(torch.ones(2, 3, device=t.device), torch.ones(2, 3, device=t.device))),
    ("sub_out", lambda t: torch.sub(torch.ones(2, 3, device=t.device), 1, out=t)),
    ("uniform_", lambda t: t.uniform_()),
    ("scatter_", lambda t: t.scatter_(1, torch.tensor([[0], [1]], device=t.device), 1.0)),
])
def test_inplace_on_expanded_tensor_raises_like_cpu(name, fn):
    if name == "copy_from_host":
        with pytest.raises(RuntimeError, match=_OVERLAP_ERROR):
            fn(torch.zeros(3).expand(2, 3))
    else:
        with pytest.raises(RuntimeError, match=_OVERLAP_ERROR):
            fn(torch.zeros(3).expand(2, 3))
    base = torch.zeros(3, device="tpu")
    with pytest.raises(RuntimeError, match=_OVERLAP_ERROR):
        fn(base.expand(2, 3))
    torch.testing.assert_close(base.cpu(), torch.zeros(3), rtol=0, atol=0)  # nothing written


@pytest.mark.filterwarnings("ignore:Use of .* on expanded tensors is deprecated")
@pytest.mark.parametrize("name,fn", [
    ("fill_", lambda t: t.fill_(2.5)),
    ("zero_", lambda t: t.zero_()),
    ("setitem", lambda t: t.__setitem__(0, 4.0)),
    ("masked_fill_", lambda t: t.masked_fill_(torch.tensor([[True, False, True]] * 2, device=t.device), 7.0)),
    ("index_put_", lambda t: t.index_put_((torch.tensor([1], device=t.device),), torch.tensor(3.0, device=t.device))),
    ("index_fill_", lambda t: t.index_fill_(1, torch.tensor([0], device=t.device), 5.0)),
])
def test_writes_cpu_allows_on_expanded_tensors_match_cpu(name, fn):
    cpu_base = torch.arange(3.0)
    tpu_base = cpu_base.to("tpu")
    fn(cpu_base.expand(2, 3))
    fn(tpu_base.expand(2, 3))
    torch.testing.assert_close(tpu_base.cpu(), cpu_base, rtol=0, atol=0)


@pytest.mark.parametrize("args", [(0, 20, 1), (0, 3, 0), (2, 2, 1)])
def test_unfold_errors_match_cpu(args):
    x = torch.arange(10.0)
    with pytest.raises((RuntimeError, IndexError)) as cpu_err:
        x.unfold(*args)
    with pytest.raises(type(cpu_err.value)) as tpu_err:
        x.to("tpu").unfold(*args)
    assert str(tpu_err.value) == str(cpu_err.value)


def test_compiled_graph_reads_neg_view_input_values():
    x = torch.arange(-2.0, 4.0)
    f = torch.compile(lambda t: t * 2 + 1, backend="tpu")
    got = f(torch._neg_view(x.to("tpu")))
    torch.testing.assert_close(got.cpu(), torch._neg_view(x) * 2 + 1, rtol=0, atol=0)


# --- New outputs take CPU's strides (the meta kernel's): TensorIterator's
# stride propagation over permuted inputs, memory_format= (channels_last);
# the program writes the values in that memory order.

_LAYOUT_CASES = {
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "clone_channels_last": lambda t: t.clone(memory_format=torch.channels_last),
    "exp_permuted": lambda t: torch.exp(t.permute(0, 2, 3, 1)),
    "neg_transposed": lambda t: -t.transpose(1, 2),
    "add_permuted_scalar": lambda t: t.permute(3, 1, 2, 0) + 1,
    "mul_two_permuted": lambda t: t.permute(0, 2, 3, 1) * t.permute(0, 2, 3, 1),
    "clone_preserve": lambda t: t.permute(0, 2, 3, 1).clone(),
    "zeros_like_permuted": lambda t: torch.zeros_like(t.permute(0, 2, 3, 1)),
    "full_like_permuted": lambda t: torch.full_like(t.permute(2, 0, 3, 1), 7.0),
    "chain_then_reduce": lambda t: torch.exp(t.permute(0, 2, 3, 1)).sum(1),
    "chain_channels_last_pointwise": lambda t: (t.contiguous(memory_format=torch.channels_last) + 1) * 3,
}


@pytest.mark.parametrize("mode", ("strict", "debug", "fused"))
@pytest.mark.parametrize("name", sorted(_LAYOUT_CASES))
def test_new_outputs_have_cpu_strides(name, mode):
    import torch_tpu
    fn = _LAYOUT_CASES[name]
    x = torch.randn(2, 3, 4, 5)
    cpu = fn(x)
    with no_cpu_fallback(), torch_tpu.eager_mode(mode):
        got = fn(x.to("tpu"))
        assert got.stride() == cpu.stride() and got.shape == cpu.shape
        torch.testing.assert_close(got.cpu(), cpu)


def test_channels_last_template_for_resize_as_preserve_format():
    # PyTorch's test_memory_format_resize_as, compared against CPU.
    for shape, fmt in (((10, 3, 8, 8), torch.channels_last), ((3, 10, 3, 4, 4), torch.channels_last_3d)):
        res = {}
        for dev in ("cpu", "tpu"):
            xc = torch.randn(shape, device=dev).contiguous(memory_format=fmt)
            flat = torch.randn(xc.numel(), device=dev)
            flat.resize_as_(xc, memory_format=torch.preserve_format)
            res[dev] = (xc.stride(), flat.stride(), flat.is_contiguous(memory_format=fmt))
        assert res["tpu"] == res["cpu"] and res["tpu"][2]


def test_channels_last_conv_and_batch_norm_match_cpu():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    bn = torch.nn.BatchNorm2d(4)
    x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    cpu = bn(conv(x))
    conv_t, bn_t = torch.nn.Conv2d(3, 4, 3, padding=1).to("tpu"), torch.nn.BatchNorm2d(4).to("tpu")
    conv_t.load_state_dict(conv.state_dict())
    bn_t.load_state_dict(bn.state_dict())
    got = bn_t(conv_t(x.to("tpu")))
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-4, atol=1e-4)
    assert got.shape == cpu.shape
    # (The convolution's own output is still contiguous on tpu, where CPU's
    # is channels_last: the meta kernel's layout is not CPU's there.)


def test_permuted_output_costs_one_program():
    import torch_tpu
    x = torch.randn(3, 4, 5).to("tpu").permute(2, 0, 1)
    torch.exp(x).cpu()  # warm: the op's program (compiled at the key's second call)
    torch.exp(x).cpu()
    wait_for_compiles()
    before = torch_tpu.metrics()["compiles"]
    for _ in range(3):
        y = torch.exp(x)
    assert y.stride() == torch.exp(torch.empty(3, 4, 5).permute(2, 0, 1)).stride()
    assert torch_tpu.metrics()["compiles"] == before
