"""Factory lowerings (csrc/lowering/factory.cpp) against CPU PyTorch:
linspace and logspace, every overload (Scalar and 0-d Tensor start/end,
out=). Values must equal CPU's exactly for every dtype (the lowering
follows the CPU kernels' formulas, roundings, fused multiply-adds and
truncations), so all comparisons are exact. A CPU fallback of any op fails the test (conftest.no_cpu_fallback).
"""
import pytest
import torch
import torch_tpu  # noqa: F401

from conftest import no_cpu_fallback

TPU = torch.device("tpu")
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float64, torch.int32, torch.float16]


def check_exact(actual, expected):
    assert actual.device.type == "tpu", actual.device
    actual = actual.cpu()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), (actual, expected)


LIN_CASES = [(-2.0, -3, 50), (4.3, 50, 50), (0, 7, 50), (50, 1, 50), (-7, 7.7, 101), (0.1, -1e4, 1001),
             (1, 3, 1), (2.5, 3, 0), (3, 3, 5), (-2.0, 4, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,end,steps", LIN_CASES)
def test_linspace_scalar(start, end, steps, dtype):
    expected = torch.linspace(start, end, steps, dtype=dtype)
    with no_cpu_fallback():
        check_exact(torch.linspace(start, end, steps, dtype=dtype, device=TPU), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("start,end,steps", LIN_CASES)
def test_linspace_tensor_overloads(start, end, steps, dtype):
    st = torch.tensor(start, dtype=torch.float32 if isinstance(start, float) else torch.int64)
    en = torch.tensor(end, dtype=torch.float32 if isinstance(end, float) else torch.int64)
    for s, e in [(st, en), (st, end), (start, en)]:
        expected = torch.linspace(s, e, steps, dtype=dtype)
        with no_cpu_fallback():
            # CPU 0-d start/end (as the OpInfo samples pass them) and tpu 0-d tensors
            check_exact(torch.linspace(s, e, steps, dtype=dtype, device=TPU), expected)
            s_t = s.to(TPU) if isinstance(s, torch.Tensor) else s
            e_t = e.to(TPU) if isinstance(e, torch.Tensor) else e
            check_exact(torch.linspace(s_t, e_t, steps, dtype=dtype, device=TPU), expected)


def test_linspace_default_dtype_and_out():
    check_exact(torch.linspace(0, 1, 7, device=TPU), torch.linspace(0, 1, 7))
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        out = torch.empty(13, dtype=dtype, device=TPU)
        with no_cpu_fallback():
            r = torch.linspace(-3.5, 9, 13, out=out)
        assert r is out
        check_exact(out, torch.linspace(-3.5, 9, 13, dtype=dtype))
        out = torch.empty(13, dtype=dtype, device=TPU)
        with no_cpu_fallback():
            torch.linspace(torch.tensor(-3.5), torch.tensor(9.0), 13, out=out)
        check_exact(out, torch.linspace(-3.5, 9, 13, dtype=dtype))


def test_linspace_errors_like_cpu():
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.linspace(0, 1, -1, device=TPU)
    with pytest.raises(RuntimeError, match="0-dimensional"):
        torch.linspace(torch.tensor([0.0, 1.0], device=TPU), 1, 3, device=TPU)


LOG_CASES = [(-2.0, -3, 4, 10.0), (0, 1.2, 9, 2.0), (1, 4, 4, 3.0), (2, 2, 2, 1.1), (4.3, 0, 9, 5.0),
             (2.5, 3, 1, 10.0), (0, 3, 1, 2.0), (1, 3, 0, 2.0), (-1.5, 2.5, 33, 2.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,end,steps,base", LOG_CASES)
def test_logspace_scalar(start, end, steps, base, dtype):
    expected = torch.logspace(start, end, steps, base, dtype=dtype)
    with no_cpu_fallback():
        check_exact(torch.logspace(start, end, steps, base, dtype=dtype, device=TPU), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("start,end,steps,base", LOG_CASES)
def test_logspace_tensor_overloads_and_out(start, end, steps, base, dtype):
    st = torch.tensor(start, dtype=torch.float32 if isinstance(start, float) else torch.int64)
    en = torch.tensor(end, dtype=torch.float32 if isinstance(end, float) else torch.int64)
    for s, e in [(st, en), (st, end), (start, en)]:
        expected = torch.logspace(s, e, steps, base, dtype=dtype)
        with no_cpu_fallback():
            check_exact(torch.logspace(s, e, steps, base, dtype=dtype, device=TPU), expected)
    out = torch.empty(steps, dtype=dtype, device=TPU)
    with no_cpu_fallback():
        torch.logspace(start, end, steps, base, out=out)
    check_exact(out, torch.logspace(start, end, steps, base, dtype=dtype))


def test_logspace_default_base():
    with no_cpu_fallback():
        check_exact(torch.logspace(-1, 2, 7, device=TPU), torch.logspace(-1, 2, 7))


# out= with any strides: CPU's linspace/logspace/arange kernels resize `out`
# only when its numel differs, so a view of the right numel keeps its shape
# and strides; resize_ to the same sizes keeps the strides (ones/zeros/full/
# eye with out=). The expected tensor is the CPU base after the same call.
OUT_VIEWS = {
    "narrow_2d": ((3, 4), lambda x: x.narrow(1, 1, 2)),
    "column": ((6, 2), lambda x: x[:, 1]),
    "transposed": ((2, 3), lambda x: x.t()),
    "transposed_row": ((6, 2), lambda x: x.t()[1]),
}
OUT_CALLS = {
    "linspace": lambda o: torch.linspace(0, 1, 6, out=o),
    "logspace": lambda o: torch.logspace(0, 1, 6, base=2.0, out=o),
    "arange": lambda o: torch.arange(0, 6, out=o),
    "arange_step": lambda o: torch.arange(1.0, 4.0, 0.5, out=o),
    "ones": lambda o: torch.ones(o.shape, out=o),
    "zeros": lambda o: torch.zeros(o.shape, out=o),
    "full": lambda o: torch.full(o.shape, 2.5, out=o),
}


@pytest.mark.parametrize("view", list(OUT_VIEWS))
@pytest.mark.parametrize("call", list(OUT_CALLS))
def test_factory_out_with_strides_writes_cpu_elements(call, view):
    shape, make_view = OUT_VIEWS[view]
    base_cpu = torch.arange(1.0, shape[0] * shape[1] + 1.0).reshape(shape) * -1
    base_tpu = base_cpu.to(TPU)
    out_cpu, out_tpu = make_view(base_cpu), make_view(base_tpu)
    r_cpu = OUT_CALLS[call](out_cpu)
    with no_cpu_fallback():
        r_tpu = OUT_CALLS[call](out_tpu)
    assert r_tpu.shape == r_cpu.shape and r_tpu.stride() == r_cpu.stride()
    assert out_tpu.shape == out_cpu.shape and out_tpu.stride() == out_cpu.stride()
    check_exact(base_tpu, base_cpu)


def test_factory_out_of_other_numel_is_resized_like_cpu():
    # Wrong numel: out is resized to the result (contiguous), as on CPU.
    for n in (4, 9):
        base_cpu, base_tpu = torch.zeros(3, 4), torch.zeros(3, 4, device=TPU)
        torch.linspace(0, 1, n, out=base_cpu.narrow(1, 1, 2))
        out_tpu = base_tpu.narrow(1, 1, 2)
        torch.linspace(0, 1, n, out=out_tpu)
        assert out_tpu.shape == (n,) and out_tpu.stride() == (1,)
        check_exact(base_tpu, base_cpu)


@pytest.mark.parametrize("call", ["linspace", "logspace", "arange", "arange_rounding"])
def test_factory_out_resize_warns_like_cpu(call):
    # CPU's kernels resize a wrong-numel out with resize_ (linspace, logspace:
    # no warning), arange after its own warning (RangeFactories.cpp, "The out
    # tensor will be resized ..."), not resize_output's deprecation warning.
    import warnings
    fns = {"linspace": lambda o: torch.linspace(0, 1, 6, out=o),
           "logspace": lambda o: torch.logspace(0, 1, 6, out=o),
           "arange": lambda o: torch.arange(0, 6, out=o),
           "arange_rounding": lambda o: torch.arange(-1, 1, 2.0 / 49, out=o)}
    seen = {}
    for dev in ("cpu", "tpu"):
        out = torch.zeros(1, 49, device=dev)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fns[call](out)
        seen[dev] = ([str(x.message).split(" (Triggered internally")[0] for x in w], tuple(out.shape), out)
    assert seen["tpu"][0] == seen["cpu"][0]
    assert seen["tpu"][1] == seen["cpu"][1]
    if call == "arange_rounding":
        # CPU's vectorized arange adds step * i in float within each vector
        # (Vectorized<float>::arange), the lowering in double: 1 ulp apart.
        torch.testing.assert_close(seen["tpu"][2].cpu(), seen["cpu"][2], rtol=0, atol=1.2e-7)
    else:
        check_exact(seen["tpu"][2], seen["cpu"][2])


# --- torch.range (aten::range, end inclusive): lowered with arange's
# formula (CPU's range_out: start + i * step in acc_type), so the only
# warning is torch.range's own deprecation warning.

RANGE_CASES = [(0, 10, 1), (1, 4, 0.5), (-3.5, 2.25, 0.75), (0, 1, 0.1), (10, 0, -3), (2, 2, 1), (0, 1e4, 7.3)]


@pytest.mark.parametrize("dtype", [None, torch.float64, torch.int64, torch.int32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("start,end,step", RANGE_CASES)
def test_range_matches_cpu(start, end, step, dtype):
    import warnings
    if dtype is not None and not dtype.is_floating_point and any(isinstance(v, float) for v in (start, end, step)):
        pytest.skip("integer range of float arguments: not a case")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        expected = torch.range(start, end, step, dtype=dtype)
        with no_cpu_fallback():
            check_exact(torch.range(start, end, step, dtype=dtype, device=TPU), expected)
            out = torch.empty(0, dtype=expected.dtype, device=TPU)
            torch.range(start, end, step, out=out)
            check_exact(out, expected)


def test_range_warns_once_like_cpu():
    import warnings
    counts = {}
    for dev in ("cpu", "tpu"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.range(0, 10, device=dev)
        counts[dev] = [str(x.message)[:40] for x in w]
    assert counts["tpu"] == counts["cpu"] and len(counts["cpu"]) == 1
