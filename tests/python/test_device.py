"""The tpu device: registration, torch.tpu, torch.accelerator, factories,
copies in both directions, RNG, memory accounting, errors."""
from __future__ import annotations

import pytest
import torch
import torch_tpu

from conftest import no_cpu_fallback, run_python, wait_for_compiles

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


def test_cpu_plugin_device_count_follows_the_cores_or_the_environment():
    code = ("import os, torch, torch_tpu; x = torch.ones(3, device='tpu'); "
            "print(torch.tpu.device_count(), min(4, len(os.sched_getaffinity(0))), (x * 2).cpu().tolist())")
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    count, expected, values = r.stdout.split(maxsplit=2)
    assert count == expected and values.strip() == "[2.0, 2.0, 2.0]"
    assert "cpu_device_count" not in r.stderr  # the plugin's INFO log stays quiet
    r = run_python("import torch; x = torch.ones(3, device='tpu:2'); print(torch.tpu.device_count(), x.sum().item())",
                   env={"TORCH_TPU_CPU_DEVICES": "3"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "3.0"]
    r = run_python("import torch; torch.ones(1, device='tpu')", env={"TORCH_TPU_CPU_DEVICES": "two"})
    assert r.returncode != 0 and "Traceback" in r.stderr
    assert "TORCH_TPU_CPU_DEVICES must be the number of CPU plugin devices" in r.stderr and "got 'two'" in r.stderr


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
    # The import warns (naming the path); using the device raises, naming it again.
    r = run_python("import torch_tpu, torch\n"
                   "assert not torch.tpu.is_available()\n"
                   "torch.ones(1, device='tpu')",
                   env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode != 0
    warning, _, error = r.stderr.partition("Traceback")
    assert "/nonexistent/plugin.so" in warning and "no such file" in warning
    assert "/nonexistent/plugin.so" in error


def test_plugin_that_is_not_a_plugin_names_path(tmp_path):
    bogus = tmp_path / "not_a_plugin.so"
    bogus.write_bytes(b"not an ELF file")
    r = run_python("import torch, torch_tpu; torch.ones(1, device='tpu')",
                   env={"TORCH_TPU_PJRT_PLUGIN": str(bogus), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode != 0
    assert str(bogus) in r.stderr


# An op with no lowering (checked below): it runs on the CPU.
UNLOWERED = "special_bessel_j0"


def test_cpu_fallback_warns_once_and_counts():
    assert UNLOWERED not in torch_tpu._C.lowered_ops()

    def count():
        return sum(v for k, v in torch_tpu.metrics()["cpu_fallbacks"].items()
                   if k.startswith(f"aten::{UNLOWERED}"))
    before = count()
    x = torch.randn(50)
    with pytest.warns(UserWarning, match=UNLOWERED):
        y = torch.special.bessel_j0(x.to("tpu"))
    assert y.device.type == "tpu"
    # The fallback runs PyTorch's CPU kernel on the same values: bit-identical.
    assert torch.equal(y.cpu(), torch.special.bessel_j0(x))
    torch.special.bessel_j0(x.to("tpu") * 2)
    assert count() == before + 2


def test_cpu_fallback_disabled_names_op():
    r = run_python("import torch, torch_tpu; torch.special.bessel_j0(torch.ones(3, device='tpu'))",
                   env={"TORCH_TPU_CPU_FALLBACK": "0"})
    assert r.returncode != 0
    assert f"aten::{UNLOWERED}" in r.stderr and "TORCH_TPU_CPU_FALLBACK" in r.stderr


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


def test_bad_plugin_path_leaves_cpu_work_alone():
    # As with CUDA, a missing device does not fail `import torch` (the backend
    # autoloads): one warning naming the path, CPU work runs, exit is clean.
    r = run_python("import torch\nprint(torch.ones(2).sum().item(), torch.tpu.is_available())",
                   env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2.0", "False"]
    assert r.stderr.count("/nonexistent/plugin.so") == 1
    assert "Traceback" not in r.stderr and "atexit" not in r.stderr


# --- torch.cuda parity: memory figures, properties, streams and events ---

def test_memory_reserved_and_mem_get_info():
    torch.tpu.synchronize()
    x = torch.ones(1000, device="tpu")
    stats = torch.tpu.memory_stats()
    if "device.bytes_in_use" in stats:  # the plugin reports its own figures
        assert torch.tpu.memory_reserved() == stats["device.bytes_in_use"]
    else:  # the CPU plugin: no caching allocator, reserved = allocated
        assert torch.tpu.memory_reserved() == torch.tpu.memory_allocated()
        assert torch.tpu.max_memory_reserved() == torch.tpu.max_memory_allocated()
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total
    assert total == torch.tpu.get_device_properties().total_memory == stats["device.total_memory"]
    if torch_tpu._C.platform_name() == "cpu" and "device.bytes_limit" not in stats:
        import os
        assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    summary = torch.tpu.memory_summary()
    assert "tpu:0" in summary and "tensors allocated (current)" in summary
    del x


def test_device_properties_and_capability():
    p = torch.tpu.get_device_properties(0)
    assert p.name == torch.tpu.get_device_name(0)
    assert p.platform == torch_tpu._C.platform_name() and p.kind == torch_tpu._C.device_kind(0)
    assert p.total_memory > 0 and "total_memory=" in repr(p)
    assert torch.tpu.get_device_capability() == (p.major, p.minor) == (0, 0)
    assert torch.tpu.is_bf16_supported()
    with pytest.raises(IndexError, match="out of range"):
        torch.tpu.get_device_properties(10_000)


def test_streams_are_the_one_queue_of_a_device():
    s = torch.tpu.current_stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("tpu", 0)
    assert s == torch.tpu.default_stream() == torch.tpu.Stream() == torch.accelerator.current_stream()
    x = torch.randn(8, 8)
    with torch.tpu.stream(s):
        y = x.to("tpu") @ x.to("tpu")
    s.synchronize()
    assert s.query()
    torch.testing.assert_close(y.cpu(), x @ x)
    s.wait_stream(torch.tpu.default_stream())
    ev = s.record_event()
    s.wait_event(ev)
    assert isinstance(ev, torch.tpu.Event)
    with pytest.raises(ValueError, match="tpu stream"):
        torch.tpu.set_stream(torch.Stream("cpu"))


def test_event_timing_measures_the_work_between_records():
    import time
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    x = torch.randn(128, 128).to("tpu")
    (x @ x).cpu()  # compile outside the timed span
    start.record()
    t0 = time.perf_counter()
    for _ in range(5):
        x = x @ x / 128
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    ms = start.elapsed_time(end)
    assert 0 < ms <= host_ms + 1.0
    assert end.query()
    end.synchronize()
    untimed = torch.tpu.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        start.elapsed_time(untimed)
    with pytest.raises(RuntimeError, match="not been recorded"):
        start.elapsed_time(torch.tpu.Event(enable_timing=True))


# --- out of memory and failed ops ---

def test_allocation_larger_than_the_device_raises_out_of_memory():
    before = torch.tpu.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError, match=r"tried to allocate 32\.00 TiB \(35184372088832 bytes\) on tpu:0"):
        torch.empty(2**45, dtype=torch.uint8, device="tpu")
    assert torch.tpu.memory_allocated() == before
    assert torch.tpu.OutOfMemoryError is torch.OutOfMemoryError
    assert (torch.ones(2, device="tpu") + 1).cpu().tolist() == [2.0, 2.0]  # still usable


def test_launch_out_of_memory_raises_out_of_memory_naming_size_and_op():
    # The output (64 TiB) is allocated by PJRT at launch: RESOURCE_EXHAUSTED
    # becomes torch.OutOfMemoryError.
    x = torch.ones(1, dtype=torch.uint8, device="tpu").expand(2**46)
    with torch_tpu.eager_mode("strict"):
        with pytest.raises(torch.OutOfMemoryError, match=r"70368744177664 bytes\) on tpu:0.*aten::add"):
            x + 1
    assert (x[:3] + 1).cpu().tolist() == [2, 2, 2]


def test_per_process_memory_fraction_limits_allocations():
    torch.tpu.synchronize()
    total = torch.tpu.mem_get_info()[1]
    held = torch.tpu.memory_allocated()
    fraction = (held + 2**20) / total  # room for 1 MiB more
    torch.tpu.set_per_process_memory_fraction(fraction)
    try:
        assert abs(torch.tpu.get_per_process_memory_fraction() - fraction) < 1e-9
        ok = torch.empty(2**19, dtype=torch.uint8, device="tpu")
        with pytest.raises(torch.OutOfMemoryError, match=r"2\.00 MiB \(2097152 bytes\).*set_per_process_memory_fraction"):
            torch.empty(2**21, dtype=torch.uint8, device="tpu")
        del ok
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0)
    assert torch.tpu.get_per_process_memory_fraction() == 1.0
    with pytest.raises(ValueError, match="fraction"):
        torch.tpu.set_per_process_memory_fraction(1.5)
    torch.empty(2**21, dtype=torch.uint8, device="tpu")


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_using_the_output_of_an_asynchronously_failed_op_raises(mode):
    # An out-of-range index is found by the launched program (XLA clamps):
    # the failure is asynchronous; reading the output, or a value computed
    # from it, raises naming the failed op instead of returning clamped data
    # or hanging.
    x = torch.arange(5.0).to("tpu")
    bad = torch.tensor([7]).to("tpu")
    with torch_tpu.eager_mode(mode):
        for _ in range(2):  # strict: a key's first two calls run CPU's kernel (raising at the op)
            assert (x[torch.tensor([3]).to("tpu")] * 2).cpu().tolist() == [6.0]
        wait_for_compiles()  # the second call queued the compiles: the next calls run the programs
        y = x[bad]
        with pytest.raises(IndexError, match="aten::index.Tensor: index out of range"):
            y.cpu()
        z = x[bad] * 2
        with pytest.raises(IndexError, match="aten::index.Tensor"):
            z.cpu()
        assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # the device still works


# --- safetensors with device="tpu" (torch_tpu/_safetensors.py) ---

def _safetensors_sample() -> dict:
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3.0e38, -1.5])
    return {
        "f32": torch.randn(4, 5, generator=torch.Generator().manual_seed(0)),
        "bf16": torch.cat([special, torch.randn(8)]).to(torch.bfloat16),
        "f16": special.to(torch.float16),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, -1, 2**40 + 3]),
        "i32": torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4),
        "u8": torch.arange(0, 256, 17, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


@pytest.mark.parametrize("device", ["tpu", "tpu:0", torch.device("tpu"), torch.device("tpu", 0)], ids=str)
def test_safetensors_load_file_on_tpu_is_bit_exact(tmp_path, device):
    from safetensors.torch import load_file, save_file
    tensors = _safetensors_sample()
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    loaded = load_file(path, device=device)
    assert sorted(loaded) == sorted(tensors)
    for k, v in tensors.items():
        assert loaded[k].device == torch.device("tpu", 0) and loaded[k].dtype == v.dtype and loaded[k].shape == v.shape
        assert torch.equal(_bits(loaded[k]), _bits(v)), k
    # saving tpu tensors round-trips as well
    path2 = str(tmp_path / "w2.safetensors")
    save_file(loaded, path2)
    again = load_file(path2)
    for k, v in tensors.items():
        assert again[k].device.type == "cpu" and torch.equal(_bits(again[k]), _bits(v)), k


def test_safetensors_safe_open_on_tpu_and_other_devices_unchanged(tmp_path):
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file, save_file
    tensors = _safetensors_sample()
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    with safe_open(path, framework="pt", device="tpu") as f:
        t = f.get_tensor("i64")
        s = f.get_slice("f32")[1:3]
    assert t.device.type == "tpu" and torch.equal(t.cpu(), tensors["i64"])
    assert torch.equal(s.cpu(), tensors["f32"][1:3])
    assert load_file(path, device="cpu")["bf16"].device.type == "cpu"
    with pytest.raises(SafetensorError, match="invalid"):
        load_file(path, device="tpux")


def test_safetensors_imported_before_torch(tmp_path):
    path = str(tmp_path / "w.safetensors")
    from safetensors.torch import save_file
    save_file({"w": torch.arange(6, dtype=torch.int64).reshape(2, 3)}, path)
    # (a name bound by `from safetensors import safe_open` before torch is
    # imported keeps the original, which refuses "tpu")
    r = run_python("import safetensors; import torch; from safetensors import safe_open; "
                   "from safetensors.torch import load_file; "
                   f"w = load_file({path!r}, device='tpu')['w']; "
                   f"g = safe_open({path!r}, 'pt', device='tpu:0').get_tensor('w'); "
                   "print(w.device, g.device, w.cpu().tolist())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["tpu:0", "tpu:0", "[[0,", "1,", "2],", "[3,", "4,", "5]]"]


def test_pickle_and_legacy_torch_save_round_trip():
    # pickle and the legacy (non-zipfile) torch.save copy a storage to the
    # host through at::from_blob over the tpu data pointer.
    import pickle

    t = torch.tensor([[1.5, -2.0, float("nan")], [0.0, 3.25, float("inf")]], device="tpu")
    for load in (lambda: pickle.loads(pickle.dumps(t)),
                 lambda: _legacy_round_trip(t, None),
                 lambda: _legacy_round_trip(t, "cpu")):
        r = load()
        assert r.dtype == t.dtype and r.shape == t.shape
        torch.testing.assert_close(r.cpu(), t.cpu(), rtol=0, atol=0, equal_nan=True)
    assert pickle.loads(pickle.dumps(t)).device.type == "tpu"
    assert _legacy_round_trip(t, "cpu").device.type == "cpu"


def _legacy_round_trip(t, map_location):
    import io

    f = io.BytesIO()
    torch.save(t, f, _use_new_zipfile_serialization=False)
    f.seek(0)
    return torch.load(f, map_location=map_location)


def _storage_values(storage, dtype, n, device):
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (n,)).cpu()


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_untyped_storage_resize_frees_and_reallocates_like_cpu(mode, dtype):
    """UntypedStorage.resize_ as on CPU: resize_(0) frees the buffer
    (memory_allocated drops by its size), resize_(n) of an empty storage
    allocates n bytes, shrinking and growing keep the prefix (FSDP2 frees
    and re-allocates unsharded parameters this way)."""
    src = _sample(dtype, (64,))
    n, size = 64, src.element_size()
    with torch_tpu.eager_mode(mode):
        x = src.to("tpu")
        base = torch.tpu.memory_allocated()
        cpu = src.clone()
        t = x + 0  # pending in fused mode: the resize runs the region first
        st, sc = t.untyped_storage(), cpu.untyped_storage()
        assert torch.tpu.memory_allocated() - base == n * size
        for nbytes in [40 * size, 80 * size]:  # shrink, then grow: the first 40 elements survive
            st.resize_(nbytes)
            sc.resize_(nbytes)
            assert st.nbytes() == sc.nbytes() == nbytes
            assert torch.tpu.memory_allocated() - base == nbytes
            assert torch.equal(_storage_values(st, dtype, 40, "tpu"), _storage_values(sc, dtype, 40, "cpu"))
        st.resize_(0)
        sc.resize_(0)
        assert st.nbytes() == sc.nbytes() == 0
        assert torch.tpu.memory_allocated() == base
        st.resize_(n * size)
        assert st.nbytes() == n * size and torch.tpu.memory_allocated() - base == n * size
        # Written through the tensor that still owns the storage, as FSDP2 does.
        t.copy_(x * 2)
        assert torch.equal(t.cpu(), src * 2)
        del t, st
        torch.tpu.synchronize()
        assert torch.tpu.memory_allocated() == base


def test_untyped_storage_resize_reads_pending_fused_work():
    """A resize is a sync point: an op recorded in a fused region before the
    resize reads the storage's old contents."""
    with torch_tpu.eager_mode("fused"):
        a = torch.arange(8, dtype=torch.float32, device="tpu") + 1
        b = a * 3  # recorded: reads a's storage
        a.untyped_storage().resize_(0)
        assert torch.equal(b.cpu(), (torch.arange(8, dtype=torch.float32) + 1) * 3)
        assert a.untyped_storage().nbytes() == 0


def test_untyped_storage_resize_to_a_partial_element_then_typed_read():
    # 7 bytes are kept as bytes (not a whole number of f32); the storage's
    # buffer is a capacity bucket of them, so an f32 view of its first
    # element reads the same 4 bytes as on CPU.
    t = torch.arange(1, 5, dtype=torch.float32, device="tpu") + 0
    s = t.untyped_storage()
    s.resize_(7)
    assert s.nbytes() == 7
    assert torch.equal(torch.empty(0, dtype=torch.uint8, device="tpu").set_(s, 0, (7,)).cpu(),
                       torch.arange(1, 5, dtype=torch.float32).view(torch.uint8)[:7])
    cpu = torch.arange(1, 5, dtype=torch.float32)
    cpu.untyped_storage().resize_(7)
    assert torch.equal(torch.empty(0, device="tpu").set_(s, 0, (1,)).cpu(),
                       torch.empty(0).set_(cpu.untyped_storage(), 0, (1,)))


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
def test_copy_from_cpu_into_a_whole_storage_leaves_earlier_readers_their_values(mode):
    """A host->tpu copy_ into a whole storage may overwrite its buffer in
    place (CPU plugin): ops issued before it (recorded, in flight, or kept by
    debug mode) still see the old values; views of the storage see the new."""
    g = torch.Generator().manual_seed(3)
    old, new = torch.randn(1 << 18, generator=g), torch.randn(1 << 18, generator=g)
    with torch_tpu.eager_mode(mode):
        a = old.to("tpu") + 0
        view = a[5:9]
        b = a * 2  # issued before the copy
        c = a.amax()
        a.copy_(new)
        d = a * 3  # after
        assert torch.equal(b.cpu(), old * 2)
        assert torch.equal(c.cpu(), old.amax())
        assert torch.equal(a.cpu(), new) and torch.equal(view.cpu(), new[5:9])
        assert torch.equal(d.cpu(), new * 3)
        a.copy_(old)  # again, now nothing else reads it
        assert torch.equal(a.cpu(), old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_copy_to_cpu_into_existing_tensors(dtype):
    """tpu->host copy_ into a contiguous CPU tensor of the same dtype (the
    direct download), and into ones that are not (strided, other dtype,
    broadcast), against the CPU copy_."""
    src = _sample(dtype, (64, 33))
    d = src.to("tpu")
    for dst_cpu in [torch.empty(64, 33, dtype=dtype), torch.empty(33, 64, dtype=dtype).t(),
                    torch.empty(64, 33, dtype=torch.float64)]:
        ref = dst_cpu.clone().copy_(src)
        dst_cpu.copy_(d)
        assert torch.equal(dst_cpu, ref)
    out = torch.empty(64, 33, dtype=dtype)
    out.copy_(d[:, 1:2])  # a broadcast view
    assert torch.equal(out, src[:, 1:2].expand(64, 33))
    out = torch.empty(33, dtype=dtype)
    out.copy_(d[3])  # a view of part of the storage
    assert torch.equal(out, src[3])


def test_host_allocator_pinned_memory_and_empty_host_cache():
    # PyTorch asks `at::getHostAllocator(PrivateUse1)` for pinned memory and
    # its cache; with none registered, empty_host_cache() crashed the process
    # (vLLM's cleanup calls it). As on CUDA: pin_memory() gives a pinned host
    # tensor, plain CPU tensors are not pinned, copies from pinned memory
    # (non_blocking) give the same values.
    x = torch.ones(4, device="tpu")
    assert torch.equal((x + 1).cpu(), torch.full((4,), 2.0))
    torch.accelerator.empty_host_cache()
    src = torch.arange(6, dtype=torch.float32)
    pinned = src.pin_memory()
    assert pinned.is_pinned() and not src.is_pinned()
    assert torch.empty(3, pin_memory=True).is_pinned()
    on_device = pinned.to("tpu", non_blocking=True)
    assert torch.equal(on_device.cpu(), src)
    back = torch.empty(6, pin_memory=True)
    back.copy_(on_device)
    assert torch.equal(back, src)
    del pinned
    torch.accelerator.empty_host_cache()
