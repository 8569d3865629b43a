"""The tpu device: registration, torch.tpu, torch.accelerator, factories,
copies in both directions, RNG, memory accounting, errors."""
from __future__ import annotations

import pytest
import torch
import torch_tpu

from conftest import no_cpu_fallback, run_python

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]


def _sample(dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def test_device_exists_after_plain_import_torch():
    # The torch.backends entry point imports torch_tpu: no explicit import needed.
    r = run_python("import torch; x = torch.ones(2, device='tpu'); "
                   "print(x.device, torch.tpu.device_count() >= 1, (x + 0).cpu().tolist())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["tpu:0", "True", "[1.0,", "1.0]"]


def test_device_count_and_name():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    name = torch.tpu.get_device_name()
    assert "cpu" in name.lower() and "PJRT" in name


def test_accelerator_api():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator().type == "tpu"
    assert torch.accelerator.device_count() == torch.tpu.device_count()
    torch.accelerator.synchronize()


def test_current_and_set_device():
    assert torch.tpu.current_device() == 0
    if torch.tpu.device_count() > 1:
        torch.tpu.set_device(1)
        try:
            assert torch.tpu.current_device() == 1
            assert torch.empty(2, device="tpu").device == torch.device("tpu", 1)
            x = torch.arange(4.0, device="tpu")
            assert x.device.index == 1
            assert torch.equal((x * 2).cpu(), torch.arange(4.0) * 2)
        finally:
            torch.tpu.set_device(0)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.tpu.set_device(10_000)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(dtype):
    x = _sample(dtype)
    y = x.to("tpu")
    assert y.device.type == "tpu" and y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.cpu(), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
def test_non_contiguous_copies(dtype):
    x = _sample(dtype, (6, 8))
    # non-contiguous CPU source
    assert torch.equal(x.t().to("tpu").cpu(), x.t())
    assert torch.equal(x[::2, 1::3].to("tpu").cpu(), x[::2, 1::3])
    # non-contiguous tpu source
    y = x.to("tpu")
    assert torch.equal(y.t().cpu(), x.t())
    assert torch.equal(y[1:5, ::2].t().cpu(), x[1:5, ::2].t())
    # CPU -> tpu view destination
    z_cpu, z = x.clone(), x.to("tpu")
    src = _sample(dtype, (4, 3))
    z_cpu[1:5, ::3].copy_(src)
    z[1:5, ::3].copy_(src)
    assert torch.equal(z.cpu(), z_cpu)
    # tpu -> CPU view destination
    out = torch.zeros(8, 6, dtype=dtype)
    expected = out.clone()
    expected.t()[:, :].copy_(x)
    out.t()[:, :].copy_(y)
    assert torch.equal(out, expected)


def test_copy_with_dtype_conversion_and_broadcast():
    x = torch.randn(4, 3)
    y = torch.empty(4, 3, dtype=torch.float64, device="tpu")
    y.copy_(x)
    assert torch.equal(y.cpu(), x.double())
    b = torch.empty(2, 4, 3, device="tpu")
    b.copy_(x.to("tpu"))
    assert torch.equal(b.cpu(), x.expand(2, 4, 3))
    i = torch.empty(4, 3, dtype=torch.int64, device="tpu")
    i.copy_((x * 10).to("tpu"))
    assert torch.equal(i.cpu(), (x * 10).long())


def test_factories():
    with no_cpu_fallback():
        assert torch.equal(torch.zeros(2, 3, device="tpu").cpu(), torch.zeros(2, 3))
        assert torch.equal(torch.ones(2, 3, dtype=torch.int64, device="tpu").cpu(), torch.ones(2, 3, dtype=torch.int64))
        assert torch.equal(torch.full((2, 2), 7.5, device="tpu").cpu(), torch.full((2, 2), 7.5))
        assert torch.equal(torch.arange(10, device="tpu").cpu(), torch.arange(10))
        assert torch.equal(torch.arange(1.0, 2.0, 0.25, device="tpu").cpu(), torch.arange(1.0, 2.0, 0.25))
        e = torch.empty(3, 4, device="tpu")
        assert e.shape == (3, 4) and e.device.type == "tpu"
        like = torch.zeros_like(e)
        assert torch.equal(like.cpu(), torch.zeros(3, 4))
        assert torch.equal(torch.ones_like(e).cpu(), torch.ones(3, 4))
        assert torch.equal(torch.full_like(e, 3).cpu(), torch.full((3, 4), 3.0))
        r = torch.rand(1000, device="tpu").cpu()
        assert r.min() >= 0 and r.max() < 1
        n = torch.randn(10000, device="tpu").cpu()
        assert abs(n.mean().item()) < 0.05 and abs(n.std().item() - 1) < 0.05
        assert torch.rand_like(e).shape == (3, 4)
        assert torch.randn_like(e).device.type == "tpu"


def test_item_and_print():
    x = torch.tensor([[1.5, -2.0], [3.25, 4.0]])
    y = x.to("tpu")
    assert y[1, 0].item() == 3.25
    assert torch.tensor(7, device="tpu").item() == 7
    assert repr(y) == repr(x)[:-1] + ", device='tpu:0')"
    assert str(y.long()) == str(x.long())[:-1] + ", device='tpu:0')"


def test_manual_seed_reproducible():
    torch.manual_seed(1234)
    a = torch.rand(64, device="tpu").cpu()
    b = torch.randn(64, device="tpu").cpu()
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(64, device="tpu").cpu(), a)
    assert torch.equal(torch.randn(64, device="tpu").cpu(), b)
    # successive draws differ
    assert not torch.equal(torch.rand(64, device="tpu").cpu(), a)
    torch.tpu.manual_seed(5)
    state = torch.tpu.get_rng_state()
    c = torch.rand(16, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.rand(16, device="tpu").cpu(), c)


def test_memory_accounting():
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    x = torch.empty(1024, 256, device="tpu")
    assert torch.tpu.memory_allocated() - base == 1024 * 256 * 4
    assert torch.tpu.max_memory_allocated() >= base + 1024 * 256 * 4
    del x
    assert torch.tpu.memory_allocated() == base
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base
    torch.tpu.empty_cache()


def test_module_to_tpu():
    m = torch.nn.Linear(4, 3)
    m_tpu = torch.nn.Linear(4, 3)
    m_tpu.load_state_dict(m.state_dict())
    m_tpu.to("tpu")
    assert all(p.device.type == "tpu" for p in m_tpu.parameters())
    x = torch.randn(5, 4)
    torch.testing.assert_close(m_tpu(x.to("tpu")).cpu(), m(x))
    assert m_tpu.weight.is_tpu


def test_cross_device_error():
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, device="tpu") + torch.ones(3)


def test_bad_plugin_path_names_path():
    r = run_python("import torch_tpu", env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so",
                                           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode != 0
    assert "/nonexistent/plugin.so" in r.stderr


def test_plugin_that_is_not_a_plugin_names_path(tmp_path):
    bogus = tmp_path / "not_a_plugin.so"
    bogus.write_bytes(b"not an ELF file")
    r = run_python("import torch, torch_tpu; torch.ones(1, device='tpu')",
                   env={"TORCH_TPU_PJRT_PLUGIN": str(bogus), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode != 0
    assert str(bogus) in r.stderr


# An op with no lowering (checked below): it runs on the CPU.
UNLOWERED = "histc"


def test_cpu_fallback_warns_once_and_counts():
    assert UNLOWERED not in torch_tpu._C.lowered_ops()

    def count():
        return sum(v for k, v in torch_tpu.metrics()["cpu_fallbacks"].items() if k.startswith("aten::histc"))
    before = count()
    x = torch.randn(50)
    with pytest.warns(UserWarning, match="histc"):
        h = torch.histc(x.to("tpu"), bins=5, min=-2, max=2)
    assert h.device.type == "tpu"
    assert torch.equal(h.cpu(), torch.histc(x, bins=5, min=-2, max=2))
    torch.histc(x.to("tpu"), bins=3)
    assert count() == before + 2


def test_cpu_fallback_disabled_names_op():
    r = run_python("import torch, torch_tpu; torch.histc(torch.ones(3, device='tpu'), bins=2)",
                   env={"TORCH_TPU_CPU_FALLBACK": "0"})
    assert r.returncode != 0
    assert "aten::histc" in r.stderr and "TORCH_TPU_CPU_FALLBACK" in r.stderr


def test_metrics_keys():
    m = torch_tpu.metrics()
    for key in ("compiles", "compile_time_s", "cache_hits", "cache_misses", "executions",
                "host_to_device_bytes", "device_to_host_bytes", "cpu_fallbacks"):
        assert key in m


def test_torch_save_load_round_trip(tmp_path):
    x = torch.randn(3, 4)
    state = {"x": x.to("tpu"), "view": x.to("tpu").t()[1:], "ints": torch.arange(5).to("tpu"),
             "mask": (x > 0).to("tpu"), "half": x.to(torch.bfloat16).to("tpu")}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    on_tpu = torch.load(path, map_location="tpu")
    on_cpu = torch.load(path, map_location="cpu")
    expected = {"x": x, "view": x.t()[1:], "ints": torch.arange(5), "mask": x > 0, "half": x.to(torch.bfloat16)}
    for k, v in expected.items():
        assert on_tpu[k].device.type == "tpu" and on_cpu[k].device.type == "cpu"
        assert torch.equal(on_tpu[k].cpu(), v) and torch.equal(on_cpu[k], v)
    m = torch.nn.Linear(4, 2).to("tpu")
    ref = torch.nn.Linear(4, 2)
    m.load_state_dict(ref.state_dict())
    assert torch.equal(m.weight.cpu(), ref.weight) and torch.equal(m.bias.cpu(), ref.bias)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_item_of_one_element_tensors(shape):
    x = torch.full(shape, 2.5)
    t = x.to("tpu")
    assert t.item() == 2.5 and float(t) == 2.5 and int(t) == 2
    assert bool(t > 0) is True
    assert torch.tensor([3], device="tpu").reshape(shape).item() == 3


def test_tensors_on_two_tpu_devices_raise_like_cpu():
    if torch.tpu.device_count() < 2:
        pytest.skip("one tpu device")
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2, device="tpu:0") * torch.ones(2, device="tpu:1")


def test_bad_plugin_path_prints_one_error():
    r = run_python("import torch", env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so"})
    assert r.returncode != 0
    assert "/nonexistent/plugin.so" in r.stderr
    assert "atexit" not in r.stderr
