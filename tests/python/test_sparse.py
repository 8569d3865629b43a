"""Sparse COO tensors on tpu (csrc/aten/sparse_kernels.cpp), compared with
PyTorch on CPU on the same inputs: construction and metadata use PyTorch's
device-generic kernels (indices/values stay tpu tensors and alias the sparse
tensor), every computing op runs on the CPU, so values, dtypes and errors
are CPU's exactly (integers) or within float32's rounding of the same
kernel (none here: the same CPU kernel computes both sides)."""
from __future__ import annotations

import pytest
import torch
import torch_tpu

pytestmark = [pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
              pytest.mark.filterwarnings("ignore:.*runs on the CPU \\(sparse layout\\)")]

MODES = ("strict", "debug", "fused")


def _dense(seed, shape=(4, 5), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * (torch.rand(shape, generator=g) < 0.4)
    return x.to(dtype)


def _assert_sparse_equal(tpu, cpu):
    assert tpu.device.type == "tpu" and tpu.layout == torch.sparse_coo
    assert tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    assert tpu.is_coalesced() == cpu.is_coalesced()
    assert tpu._indices().device.type == "tpu" and tpu._values().device.type == "tpu"
    assert torch.equal(tpu._indices().cpu(), cpu._indices())
    assert torch.equal(tpu._values().cpu(), cpu._values())


@pytest.mark.parametrize("mode", MODES)
def test_construction_and_metadata_match_cpu(mode):
    d = _dense(0)
    i = torch.tensor([[0, 1, 0, 3], [4, 2, 4, 0]])
    v = torch.tensor([1.5, -2.0, 3.0, 4.0])
    with torch_tpu.eager_mode(mode):
        s = d.to("tpu").to_sparse()
        _assert_sparse_equal(s, d.to_sparse())
        assert s._nnz() == d.to_sparse()._nnz() and s.sparse_dim() == 2 and s.dense_dim() == 0
        # Device inference from tpu indices/values (PyTorch's
        # test_tensor_ctor_device_inference), and an explicit device.
        u = torch.sparse_coo_tensor(i.to("tpu"), v.to("tpu"), (4, 5))
        _assert_sparse_equal(u, torch.sparse_coo_tensor(i, v, (4, 5)))
        u64 = torch.sparse_coo_tensor(i, v, (4, 5), dtype=torch.float64, device="tpu")
        _assert_sparse_equal(u64, torch.sparse_coo_tensor(i, v, (4, 5), dtype=torch.float64))
        # Uncoalesced (a repeated index) -> coalesce sums, as on CPU.
        _assert_sparse_equal(u.coalesce(), torch.sparse_coo_tensor(i, v, (4, 5)).coalesce())
        assert torch.equal(u.to_dense().cpu(), torch.sparse_coo_tensor(i, v, (4, 5)).to_dense())
        # Round trips between devices keep the layout and the coalesced flag.
        _assert_sparse_equal(d.to_sparse().to("tpu"), d.to_sparse())
        back = s.cpu()
        assert back.layout == torch.sparse_coo and torch.equal(back.to_dense(), d)
        # zeros/empty with a sparse layout on tpu.
        z = torch.zeros(2, 3, layout=torch.sparse_coo, device="tpu")
        _assert_sparse_equal(z, torch.zeros(2, 3, layout=torch.sparse_coo))
        # A hybrid tensor (one sparse dim, one dense dim).
        h = d.to("tpu").to_sparse(1)
        _assert_sparse_equal(h, d.to_sparse(1))


@pytest.mark.parametrize("mode", MODES)
def test_values_alias_the_sparse_tensor(mode):
    """_values()/_indices() are aliases (PyTorch's kernels, not copies): a
    write through them changes the sparse tensor, as on CPU."""
    d = _dense(1)
    with torch_tpu.eager_mode(mode):
        s, c = d.to("tpu").to_sparse(), d.to_sparse()
        s._values().mul_(3)
        c._values().mul_(3)
        assert torch.equal(s.to_dense().cpu(), c.to_dense())
        s.values().add_(1)
        c.values().add_(1)
        assert torch.equal(s.to_dense().cpu(), c.to_dense())


OPS = ("add", "sub", "mul", "div")
DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.float16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OPS)
def test_arithmetic_matches_cpu_values_dtypes_and_errors(mode, op):
    """op(sparse, sparse), op(dense, sparse), op(sparse, dense), op(sparse,
    scalar), in place and not, over dtype pairs: the same result (layout,
    dtype, elements) or the same exception type as CPU."""
    def run(device, a, b, inplace, kind):
        x = a.to(device)
        y = b.to(device)
        xs, ys = x.to_sparse(), y.to_sparse()
        name = op + ("_" if inplace else "")
        args = {"ss": (xs, ys), "ds": (x, ys), "sd": (xs, y), "sc": (xs, 2)}[kind]
        try:
            r = getattr(args[0], name)(args[1])
        except (RuntimeError, TypeError) as e:
            return type(e)
        return r

    checked = 0
    with torch_tpu.eager_mode(mode):
        for da in DTYPES:
            for db in DTYPES:
                a, b = _dense(2, dtype=da), _dense(3, dtype=db)
                if op == "div":
                    b = b + (b == 0).to(db)  # no division by zero
                for inplace in (False, True):
                    for kind in ("ss", "ds", "sd", "sc"):
                        exp = run("cpu", a.clone(), b.clone(), inplace, kind)
                        got = run("tpu", a.clone(), b.clone(), inplace, kind)
                        what = f"{op}{'_' if inplace else ''} {kind} {da} {db}"
                        if isinstance(exp, type):
                            assert got is exp, f"{what}: CPU raised {exp.__name__}, tpu gave {got}"
                            continue
                        assert not isinstance(got, type), f"{what}: tpu raised {got.__name__}, CPU did not"
                        assert got.device.type == "tpu" and got.layout == exp.layout, what
                        assert got.dtype == exp.dtype, what
                        gd = got.to_dense() if got.is_sparse else got
                        ed = exp.to_dense() if exp.is_sparse else exp
                        assert torch.equal(gd.cpu(), ed), what
                        checked += 1
    assert checked > 50


@pytest.mark.parametrize("mode", MODES)
def test_in_place_write_back_and_reductions(mode):
    d1, d2 = _dense(4), _dense(5)
    with torch_tpu.eager_mode(mode):
        s1, c1 = d1.to("tpu").to_sparse(), d1.to_sparse()
        # A sparse in-place op changes nnz: the tpu tensor takes CPU's result.
        s1.add_(d2.to("tpu").to_sparse())
        c1.add_(d2.to_sparse())
        _assert_sparse_equal(s1, c1)
        # dense += sparse writes the dense tpu tensor.
        t, c = d1.to("tpu"), d1.clone()
        t.add_(d2.to("tpu").to_sparse(), alpha=2)
        c.add_(d2.to_sparse(), alpha=2)
        assert torch.equal(t.cpu(), c)
        # sum() of a sparse tensor is CPU's dense 0-dim sum, not the
        # CompositeExplicitAutograd kernel's sparse result.
        assert torch.equal(s1.sum().cpu(), c1.sum())
        assert s1.sum().layout == torch.strided
        _assert_sparse_equal(torch.sparse.sum(s1, dim=1), torch.sparse.sum(c1, dim=1))
        # sparse @ dense on the CPU, the result a dense tpu tensor.
        w = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))
        r = torch.sparse.mm(s1, w.to("tpu"))
        assert r.device.type == "tpu" and torch.equal(r.cpu(), torch.sparse.mm(c1, w))


def test_sparse_embedding_gradients_train_like_cpu():
    """nn.Embedding(sparse=True) with SGD: the weight's gradient is a sparse
    tpu tensor and three steps give CPU's weights."""
    torch.manual_seed(0)
    ref = torch.nn.Embedding(10, 4, sparse=True)
    dev = torch.nn.Embedding(10, 4, sparse=True)
    dev.load_state_dict(ref.state_dict())
    dev.to("tpu")
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.1)
    for step in range(3):
        idx = (torch.tensor([[1, 2, 4], [4, 3, 9]]) + step) % 10
        for m, o, x in ((ref, opt_r, idx), (dev, opt_d, idx.to("tpu"))):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
        assert dev.weight.grad.is_sparse and dev.weight.grad.device.type == "tpu"
        torch.testing.assert_close(dev.weight.detach().cpu(), ref.weight.detach(), rtol=1e-6, atol=1e-6)


def test_sparse_fallback_counted_and_forbidden_like_every_cpu_fallback():
    from conftest import run_python
    code = (
        "import torch, torch_tpu\n"
        "s = torch.tensor([[0., 1.], [2., 0.]]).to_sparse().to('tpu')\n"
        "try:\n"
        "    s.to_dense()\n"
        "except NotImplementedError as e:\n"
        "    print('raised', 'aten::' in str(e) and 'TORCH_TPU_CPU_FALLBACK=0' in str(e))\n")
    r = run_python(code, env={"TORCH_TPU_CPU_FALLBACK": "0"})
    assert "raised True" in r.stdout, r.stdout + r.stderr
    before = dict(torch_tpu.metrics()["cpu_fallbacks"])
    s = torch.tensor([[0., 1.], [2., 0.]]).to_sparse().to("tpu")
    s.to_dense()
    after = torch_tpu.metrics()["cpu_fallbacks"]
    assert after.get("aten::_to_dense", 0) == before.get("aten::_to_dense", 0) + 1


def _coo_opinfos():
    from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if op.supports_sparse]


def _to_dense_cpu(x):
    if isinstance(x, torch.Tensor):
        x = x.cpu()
        return x.to_dense() if x.is_sparse else x
    return x


@pytest.mark.parametrize("mode", [
    "strict", pytest.param("debug", marks=pytest.mark.full_tier), pytest.param("fused", marks=pytest.mark.full_tier)])
def test_opinfo_sparse_coo_samples_match_cpu(mode):
    """Every OpInfo with supports_sparse: its sample_inputs_sparse(COO)
    (float32 and int64, the first 4 samples) on tpu against CPU: the same
    layout and values (integers exact, floats within assert_close's
    defaults: masked.sum reduces part of its work on the device) or the same
    exception type. Its error_inputs_sparse for COO are empty in PyTorch
    2.13 (mul, sum, zeros_like, randn_like define CSR cases only)."""
    from torch.utils import _pytree as pytree

    def to_tpu(x):
        return x.to("tpu") if isinstance(x, torch.Tensor) else x

    checked, failures = 0, []
    for op in _coo_opinfos():
        if op.error_inputs_sparse_func is not None:
            assert not list(op.error_inputs_sparse("cpu", torch.sparse_coo)), op.name
        for dtype in (torch.float32, torch.int64):
            if dtype not in op.supported_dtypes("cpu"):
                continue
            try:
                samples = list(op.sample_inputs_sparse(torch.sparse_coo, "cpu", dtype))[:4]
            except Exception:  # noqa: BLE001 - the OpInfo defines no COO samples (isnan, erf, ...)
                continue
            for i, s in enumerate(samples):
                what = f"{op.name} {dtype} sample {i}"
                try:
                    exp, cpu_err = op.op(s.input, *s.args, **s.kwargs), None
                except Exception as e:  # noqa: BLE001
                    exp, cpu_err = None, e
                tin, targs, tkw = pytree.tree_map(to_tpu, (s.input, s.args, s.kwargs))
                try:
                    with torch_tpu.eager_mode(mode):
                        got, tpu_err = op.op(tin, *targs, **tkw), None
                        got_dense = pytree.tree_map(_to_dense_cpu, got)
                except Exception as e:  # noqa: BLE001
                    got, tpu_err = None, e
                checked += 1
                if cpu_err is not None or tpu_err is not None:
                    if type(cpu_err) is not type(tpu_err):
                        failures.append(f"{what}: CPU raised {cpu_err!r}, tpu {tpu_err!r}")
                    continue
                if isinstance(exp, torch.Tensor) and (got.layout != exp.layout or got.device.type != "tpu"):
                    failures.append(f"{what}: {got.layout} on {got.device}, CPU {exp.layout}")
                    continue
                tol = {} if dtype.is_floating_point else {"rtol": 0, "atol": 0}
                try:
                    torch.testing.assert_close(got_dense, pytree.tree_map(_to_dense_cpu, exp), equal_nan=True, **tol)
                except AssertionError as e:
                    failures.append(f"{what}: {str(e)[:200]}")
    assert not failures, "\n".join(failures)
    assert checked >= 40  # 48 in PyTorch 2.13: the test must not pass on no samples


def test_mixing_a_cpu_tensor_raises_like_cuda():
    """A sparse tpu tensor with a dense CPU tensor (not a 0-dim scalar)
    raises PyTorch's device mismatch error, as a CUDA one does, instead of
    computing on the CPU; 0-dim CPU tensors are allowed as scalars."""
    s = torch.tensor([[0., 1.], [2., 0.]]).to_sparse().to("tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(2, 2).add_(s)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        s.mul(torch.ones(2, 2))
    r = s.mul(torch.tensor(3.0))
    assert r.device.type == "tpu" and torch.equal(r.to_dense().cpu(), torch.tensor([[0., 3.], [6., 0.]]))


@pytest.mark.parametrize("mode", MODES)
def test_in_place_ops_keep_cpus_aliasing(mode):
    """Where CPU's kernel writes a sparse tensor's values in place (div_ by a
    scalar, neg_, sqrt_), an earlier _values() alias and the dense tensor
    the sparse tensor was built from see the change, on tpu too; where it
    puts in new values (add_, mul_), they do not (found by review: the
    write-back swapped in new tensors for every op)."""
    i = torch.tensor([[0, 1, 0, 2], [1, 2, 1, 0]])
    v = torch.tensor([1., 2., 3., 4.])
    with torch_tpu.eager_mode(mode):
        for name, f in (("div_", lambda s: s.div_(2)), ("neg_", lambda s: s.neg_()),
                        ("sqrt_", lambda s: s.sqrt_()), ("add_", lambda s: s.add_(s)),
                        ("mul_", lambda s: s.mul_(3))):
            got = {}
            for dev in ("cpu", "tpu"):
                s = torch.sparse_coo_tensor(i, v, (3, 3)).coalesce().to(dev)
                alias = s._values()
                f(s)
                alias_after = alias.cpu().clone()
                alias.add_(100)  # a write through the old alias reaches s where it still aliases
                got[dev] = (alias_after, s.to_dense().cpu(), s.is_coalesced())
            assert torch.equal(got["tpu"][0], got["cpu"][0]), name
            assert torch.equal(got["tpu"][1], got["cpu"][1]), name
            assert got["tpu"][2] == got["cpu"][2], name
        for dev in ("cpu", "tpu"):
            x = torch.tensor([1., 4., 9.], device=dev)
            torch.sparse_coo_tensor(torch.tensor([[0, 1, 2]], device=dev), x, (3,)).neg_()
            assert torch.equal(x.cpu(), torch.tensor([-1., -4., -9.])), dev


def test_a_tensor_passed_twice_stays_one_tensor_on_the_cpu():
    """smm calls sspaddmm_out(result, result, ...): self and out= are one
    tensor, and CPU's kernel relies on it (found by review: two CPU copies
    raised "Expected dim 0 size 3, got 0")."""
    i = torch.tensor([[0, 1, 0, 2], [1, 2, 1, 0]])
    s = torch.sparse_coo_tensor(i, torch.tensor([1., 2., 3., 4.]), (3, 3))
    d = torch.arange(9.).reshape(3, 3)
    exp = torch.smm(s, d)
    got = torch.smm(s.to("tpu"), d.to("tpu"))
    assert got.device.type == "tpu" and got.layout == exp.layout
    assert torch.equal(got.to_dense().cpu(), exp.to_dense())
    c = s.coalesce()
    ct = c.to("tpu")
    torch._foreach_mul_([c], 2.0)
    torch._foreach_mul_([ct], 2.0)
    assert ct.is_coalesced() == c.is_coalesced() and torch.equal(ct.to_dense().cpu(), c.to_dense())


def test_compressed_results_raise_instead_of_unusable_tensors():
    s = torch.tensor([[0., 1.], [2., 0.]]).to_sparse().to("tpu")
    with pytest.raises(NotImplementedError, match="compressed layouts"):
        s.to_sparse_csr()
