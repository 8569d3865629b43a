"""Invalid input that CPU rejects is rejected on tpu with the same exception
type and a message naming the problem (issue 10, item 2).

Each case runs on CPU first (the reference: it must raise), then on tpu in
strict mode (the error may surface at the sync point that reads the
result: the harness reads it inside the expectation), debug mode (at the
op) and fused mode (at the flush). The OpInfo error_inputs are covered by
tests/python/test_opinfo.py::test_opinfo_errors; these are the cases the
issue names and the checks added with them, which no ErrorInput covers:
value checks on device data (integer pow with a negative Scalar exponent,
class targets out of range), reductions without identity over empty
inputs, out= overlapping an input, gather/scatter's RuntimeError.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch_tpu

TPU = torch.device("tpu")
MODES = ("strict", "debug", "fused")


def _cpu_error(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("CPU did not raise: the case is not an invalid input")


def _tpu_error(fn, args, mode):
    with torch_tpu.eager_mode(mode):
        try:
            out = fn(*args)
            if isinstance(out, torch.Tensor):
                out.cpu()
            elif isinstance(out, (tuple, list)):
                [o.cpu() for o in out if isinstance(o, torch.Tensor)]
            torch.tpu.synchronize()
        except Exception as e:  # noqa: BLE001
            try:
                torch.tpu.synchronize()
            except Exception:  # noqa: BLE001
                pass
            return e
    return None


def _to_tpu(args):
    return [a.to(TPU) if isinstance(a, torch.Tensor) else a for a in args]


def _check(fn, args, regex, mode):
    cpu = _cpu_error(fn, *args)
    assert re.search(regex, str(cpu)), f"CPU's message changed: {cpu}"
    tpu = _tpu_error(fn, _to_tpu(args), mode)
    assert tpu is not None, f"tpu returned a value where CPU raises {type(cpu).__name__}: {cpu}"
    assert type(tpu) is type(cpu), f"tpu raises {type(tpu).__name__}: {tpu}; CPU {type(cpu).__name__}: {cpu}"
    assert re.search(regex, str(tpu)), f"tpu's message does not name the problem: {tpu}"


INT = torch.tensor([2, 3, -1, 1])

CASES = {
    # integer pow with a negative Scalar exponent: a runtime Scalar, checked on the device
    "pow_int_negative_scalar": (lambda x: x ** -1, [INT], "Integers to negative integer powers are not allowed"),
    "pow_int_negative_scalar_inplace": (lambda x: x.pow_(-2), [INT], "Integers to negative integer powers"),
    "pow_uint8_negative_scalar": (lambda x: torch.pow(x, -1), [INT.abs().to(torch.uint8)],
                                  "Integers to negative integer powers"),
    # reductions without identity over empty inputs (meta kernels: shapes are in the key)
    "max_empty": (lambda x: x.max(), [torch.empty(0)], r"max\(\): Expected reduction dim to be specified"),
    "min_empty": (lambda x: x.min(), [torch.empty(0)], r"min\(\): Expected reduction dim to be specified"),
    "amax_empty": (lambda x: x.amax(), [torch.empty(0)], r"amax\(\): Expected reduction dim"),
    "amax_empty_dim": (lambda x: x.amax(0), [torch.empty(0, 3)], "Expected reduction dim 0 to have non-zero size"),
    "amin_empty_dim": (lambda x: x.amin(0), [torch.empty(0, 3)], "Expected reduction dim 0 to have non-zero size"),
    "max_empty_dim": (lambda x: x.max(0), [torch.empty(0, 3)], "Expected reduction dim 0 to have non-zero size"),
    "argmax_empty": (lambda x: x.argmax(), [torch.empty(0)], "Expected reduction dim to be specified"),
    "argmin_empty_dim": (lambda x: x.argmin(0), [torch.empty(0, 3)], "Expected reduction dim 0 to have non-zero"),
    "aminmax_empty": (lambda x: torch.aminmax(x), [torch.empty(0)], "cannot compute aminmax over an empty"),
    "kthvalue_empty": (lambda x: x.kthvalue(1), [torch.empty(0)], "Expected reduction dim 0 to have non-zero"),
    # class targets out of range: checked on the device, IndexError as on CPU
    "nll_loss_target_high": (lambda x, t: torch.nn.functional.nll_loss(x, t),
                             [torch.randn(3, 4), torch.tensor([0, 5, 1])], "Target .*out of bounds"),
    "nll_loss_target_negative": (lambda x, t: torch.nn.functional.nll_loss(x, t),
                                 [torch.randn(3, 4), torch.tensor([0, -1, 1])], "Target .*out of bounds"),
    "cross_entropy_target": (lambda x, t: torch.nn.functional.cross_entropy(x, t),
                             [torch.randn(3, 4), torch.tensor([0, 4, 1])], "Target .*out of bounds"),
    "cross_entropy_2d_target": (lambda x, t: torch.nn.functional.cross_entropy(x, t),
                                [torch.randn(3, 4, 2), torch.tensor([[0, 4], [1, 1], [2, 2]])],
                                "Target .*out of bounds"),
    "nll_loss_1d_target": (lambda x, t: torch.nn.functional.nll_loss(x, t), [torch.randn(4), torch.tensor(7)],
                           "Target .*out of bounds"),
    # gather/scatter: CPU raises RuntimeError (not IndexError) for an index out of range
    "gather_index_out_of_range": (lambda x, i: torch.gather(x, 1, i),
                                  [torch.randn(2, 2), torch.tensor([[0, 23], [1, 0]])],
                                  "out of (bounds|range) for dimension 1"),
    "scatter_index_out_of_range": (lambda x, i, s: x.scatter(0, i, s),
                                   [torch.zeros(3, 5), torch.tensor([[34, 1], [1, 2]]), torch.randn(2, 5)],
                                   "out of (bounds|range) for dimension 0"),
    # out= of another dtype where CPU's TensorIterator requires self's (unary ops)
    "neg_out_float_for_long": (lambda x, o: torch.neg(x, out=o), [torch.tensor([1, 2]), torch.empty(0)],
                               "Found dtype Float but expected Long"),
    "neg_out_complex_for_double": (lambda x, o: torch.neg(x, out=o),
                                   [torch.ones(2, dtype=torch.float64), torch.empty(0, dtype=torch.complex128)],
                                   "Found dtype ComplexDouble but expected Double"),
    "abs_out_double_for_float": (lambda x, o: torch.abs(x, out=o), [torch.ones(3), torch.empty(3, dtype=torch.float64)],
                                 "Found dtype Double but expected Float"),
    "floor_out_float_for_long": (lambda x, o: torch.floor(x, out=o), [torch.tensor([1, 2]), torch.empty(0)],
                                 "Found dtype Float but expected Long"),
    "bitwise_not_out_long_for_int": (lambda x, o: torch.bitwise_not(x, out=o),
                                     [torch.tensor([1, 2], dtype=torch.int32), torch.empty(0, dtype=torch.int64)],
                                     "Found dtype Long but expected Int"),
    # alpha of the wrong kind for the result dtype (ATen's alpha_check)
    "add_float_alpha_int": (lambda x: torch.add(x, x, alpha=1.1), [torch.ones(4, dtype=torch.int)],
                            "For integral input tensors, argument alpha must not be a floating point number"),
    "add_float_alpha_bool": (lambda x: torch.add(x, x, alpha=1.1), [torch.ones(4, dtype=torch.bool)],
                             "alpha must not be a floating point number"),
    "sub_float_alpha_int": (lambda x: torch.sub(x, 1, alpha=0.5), [torch.ones(4, dtype=torch.int64)],
                            "alpha must not be a floating point number"),
    "add_bool_alpha_int": (lambda x: torch.add(x, x, alpha=True), [torch.ones(4, dtype=torch.int)],
                           "Boolean alpha only supported for Boolean results"),
    "add_complex_alpha_float": (lambda x: torch.add(x, x, alpha=1j), [torch.ones(4)],
                                "For non-complex input tensors, argument alpha must not be a complex number"),
    # random_(from, to) outside the dtype's range (CPU's check_from_to_in_range)
    "random_from_ge_to": (lambda x: x.random_(5, 3), [torch.empty(4)],
                          "random_ expects 'from' to be less than 'to', but got from=5 >= to=3"),
    "random_from_below_uint8": (lambda x: x.random_(-1, 5), [torch.empty(4, dtype=torch.uint8)],
                                "from is out of bounds for unsigned char"),
    "random_to_above_int8": (lambda x: x.random_(0, 1000), [torch.empty(4, dtype=torch.int8)],
                             "to - 1 is out of bounds for signed char"),
    "random_bool_to": (lambda x: x.random_(0, 3), [torch.empty(4, dtype=torch.bool)], "to - 1 is out of bounds for bool"),
    "random_to_above_half": (lambda x: x.random_(70000), [torch.empty(4, dtype=torch.float16)],
                             "to - 1 is out of bounds for c10::Half"),
    "random_from_above_half": (lambda x: x.random_(70000, 70010), [torch.empty(4, dtype=torch.float16)],
                               "from is out of bounds for c10::Half"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_input(case, mode):
    fn, args, regex = CASES[case]
    _check(fn, args, regex, mode)


@pytest.mark.parametrize("mode", ("strict", "debug"))
def test_pow_scalar_check_is_per_value(mode):
    """The exponent is a runtime Scalar: one executable serves 2 and -1, and
    only -1 raises (a check made once at compile time would miss it)."""
    x = INT.to(TPU)
    with torch_tpu.eager_mode(mode):
        torch.testing.assert_close((x ** 2).cpu(), INT ** 2)
        compiles = torch_tpu.metrics()["compiles"]
        with pytest.raises(RuntimeError, match="Integers to negative integer powers"):
            (x ** -1).cpu()
        torch.tpu.synchronize()
        assert torch_tpu.metrics()["compiles"] == compiles
        torch.testing.assert_close((x ** 3).cpu(), INT ** 3)  # the failed check left nothing pending


def test_valid_out_dtype_alpha_and_random_bounds_still_lower():
    """What CPU accepts runs as before, on the device: out= of self's dtype,
    alpha of the result's kind (int alpha on floats, bool on bools), and
    random_ bounds inside the dtype's range (values in [from, to))."""
    from conftest import no_cpu_fallback
    x = torch.tensor([1.5, -2.25, 3.0])
    i = torch.tensor([3, -4, 5])
    with no_cpu_fallback():
        out = torch.empty(0, device=TPU)
        torch.neg(x.to(TPU), out=out)
        torch.testing.assert_close(out.cpu(), -x, rtol=0, atol=0)
        torch.testing.assert_close(torch.add(x.to(TPU), x.to(TPU), alpha=2).cpu(), x + 2 * x, rtol=0, atol=0)
        torch.testing.assert_close(torch.add(i.to(TPU), i.to(TPU), alpha=3).cpu(), i + 3 * i, rtol=0, atol=0)
        b = torch.tensor([True, False])
        torch.testing.assert_close(torch.add(b.to(TPU), b.to(TPU), alpha=True).cpu(), b + b)
        for dtype, lo, hi in ((torch.int8, -100, 120), (torch.uint8, 3, 250), (torch.float16, -2048, 2049),
                              (torch.float32, 0, 10)):
            r = torch.empty(2000, dtype=dtype, device=TPU).random_(lo, hi).cpu()
            assert lo <= r.min().item() and r.max().item() < hi, (dtype, r.min(), r.max())


def test_valid_inputs_still_compute():
    """The checks do not reject what CPU accepts: tensor exponents (CPU
    computes 0 for negative ones), ignore_index targets, float pow."""
    x = INT.to(TPU)
    e = torch.tensor([-1, 1, 2, -3])
    torch.testing.assert_close((x ** e.to(TPU)).cpu(), INT ** e)
    torch.testing.assert_close((torch.tensor([2., 4.]).to(TPU) ** -1).cpu(), torch.tensor([0.5, 0.25]))
    logits, target = torch.randn(3, 4), torch.tensor([0, -100, 3])
    torch.testing.assert_close(torch.nn.functional.nll_loss(logits.to(TPU), target.to(TPU)).cpu(),
                               torch.nn.functional.nll_loss(logits, target))
    torch.testing.assert_close(torch.nn.functional.cross_entropy(logits.to(TPU), target.to(TPU), ignore_index=-100).cpu(),
                               torch.nn.functional.cross_entropy(logits, target))
    # out= the same tensor as an elementwise input: CPU allows full overlap
    a = torch.randn(4)
    t = a.to(TPU)
    torch.add(t, 1, out=t)
    torch.testing.assert_close(t.cpu(), a + 1)


@pytest.mark.parametrize("mode", ("strict", "debug"))
def test_out_overlapping_input(mode):
    """out= sharing memory with an input where CPU rejects it (PyTorch's
    meta overlap checks see the storage sharing; the call then runs on a
    CPU mirror that keeps it, where CPU raises)."""
    x = torch.randn(6)
    idx = torch.tensor([0, 2, 1])
    cpu = _cpu_error(lambda: torch.gather(x, 0, idx, out=x))
    t = x.to(TPU)
    err = _tpu_error(lambda: torch.gather(t, 0, idx.to(TPU), out=t), (), mode)
    assert type(err) is type(cpu) and "single memory location" in str(err), err
    # Partial overlap in elementwise ops: test_partial_overlap_runs_like_cpu.


PARTIAL = {
    "add_inplace": lambda a: a[1:].add_(a[:-1]),
    "add_out": lambda a: torch.add(a[:-1], 1, out=a[1:]),
    "copy": lambda a: a[1:].copy_(a[:-1]),
}
# Not covered yet: partial overlaps of non-dense views (a.view(2, 5)[:, 1:]
# .mul_(a.view(2, 5)[:, :-1])): CPU raises, tpu still computes a value
# (at::get_overlap_status answers TooHard there; mirroring every TooHard
# call would send disjoint column-view updates to the CPU too).


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(PARTIAL))
def test_partial_overlap_runs_like_cpu(case, mode):
    """A written tensor partly overlapping an input of the same call
    (a[1:].add_(a[:-1])): CPU's TensorIterator raises; PyTorch's meta kernels
    cannot see it (meta storages have no addresses), so such a call runs on
    the CPU mirror that keeps the sharing (csrc/aten/fallback.cpp
    WritesPartlyOverlappingArgument). Before: tpu returned a value. Where
    CPU computes, the values must be CPU's."""
    fn = PARTIAL[case]
    cpu_in = torch.arange(10.)
    try:
        fn(cpu_in)
        cpu_err = None
    except RuntimeError as e:
        cpu_err = e
    t = torch.arange(10., device=TPU)
    err = _tpu_error(lambda: fn(t), (), mode)
    if cpu_err is None:
        assert err is None, err
        torch.testing.assert_close(t.cpu(), cpu_in)
    else:
        assert type(err) is type(cpu_err) and "single memory location" in str(err), (err, cpu_err)


def test_full_and_disjoint_overlaps_still_run_natively():
    """a.add_(a) (full overlap) and disjoint views of one storage are no
    partial overlap: computed on tpu, no CPU fallback, CPU's values."""
    from conftest import no_cpu_fallback

    a = torch.arange(10.)
    t = a.to(TPU)
    with no_cpu_fallback():
        t.add_(t)
        t[5:].add_(t[:5])
        got = t.cpu()
    a.add_(a)
    a[5:].add_(a[:5])
    torch.testing.assert_close(got, a)
