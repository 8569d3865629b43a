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
inputs, out= overlapping an input, gather/scatter's RuntimeError,
bernoulli's p, integer division by zero, index dtypes, partial overlaps of
non-dense views.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch_tpu

from conftest import wait_for_compiles

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


def _raises_like_cpu_at_every_call(fn, args, cpu, mode, sync=False):
    """fn on the args moved to tpu raises CPU's exception type and first
    message line `cpu` at the call itself, three times (strict: the
    host-served first calls and the program after them; `sync`: a sync
    point between calls, so the second call's compile is queued)."""
    targs = _to_tpu(args)
    with torch_tpu.eager_mode(mode):
        for _ in range(3):
            with pytest.raises(type(cpu)) as info:
                fn(*targs)
            assert str(info.value).split("\n")[0] == str(cpu).split("\n")[0]
            if sync:
                torch.tpu.synchronize()
            wait_for_compiles()


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

# Checks whose values reach the device: strict mode serves a signature's first
# two calls on the CPU kernel (host-first), so test_invalid_input_on_the_device
# repeats each of these, the third call (after wait_for_compiles) running the
# device program.
DEVICE_CASES = {
    # bernoulli: a float p is checked before the call (CPU's message, with p);
    # a tensor p on its values (a value check, CPU's message)
    "bernoulli_float_p_high": (lambda x: x.bernoulli_(1.5), [torch.empty(3)],
                               r"bernoulli_ expects p to be in \[0, 1\], but got p=1.5"),
    "bernoulli_float_p_negative": (lambda x: x.bernoulli_(-0.25), [torch.empty(3)],
                                   r"bernoulli_ expects p to be in \[0, 1\], but got p=-0.25"),
    "bernoulli_p_functional": (lambda x: torch.bernoulli(x, 2.0), [torch.empty(3)],
                               r"bernoulli_ expects p to be in \[0, 1\]"),
    "bernoulli_tensor_p": (lambda x, p: x.bernoulli_(p), [torch.empty(3), torch.tensor([0.5, 1.5, 0.0])],
                           r"Expected p_in >= 0 && p_in <= 1"),
    "bernoulli_self_negative": (lambda p: torch.bernoulli(p), [torch.tensor([[0.5, -0.5], [0.0, 1.0]])],
                                r"Expected p_in >= 0 && p_in <= 1"),
    "bernoulli_self_nan": (lambda p: torch.bernoulli(p), [torch.tensor([0.5, float("nan")], dtype=torch.float64)],
                           r"Expected p_in >= 0 && p_in <= 1"),
    # uniform_/normal/randperm argument checks (ATen DistributionTemplates.h, TensorFactories.cpp): float and
    # int arguments are part of the key, checked when lowered; a tensor std is a value check
    "uniform_from_above_to": (lambda x: x.uniform_(2.0, 1.0), [torch.empty(4)],
                              r"uniform_ expects to return a \[from, to\) range, but found from=2 > to=1"),
    "uniform_to_minus_from_overflows": (lambda x: x.uniform_(-3.0e38, 3.0e38), [torch.empty(4)],
                                        "uniform_ expects to-from <= std::numeric_limits<Float>::max()"),
    "uniform_from_out_of_bounds": (lambda x: x.uniform_(-1e300, 0.0), [torch.empty(4)],
                                   "from is out of bounds for float"),
    "uniform_to_out_of_bounds_half": (lambda x: x.uniform_(0.0, 1e5), [torch.empty(4, dtype=torch.float16)],
                                      "to is out of bounds for c10::Half"),
    "normal_negative_float_std": (lambda x: x.normal_(0.0, -1.0), [torch.empty(4)],
                                  "normal expects std >= 0.0, but found std -1"),
    "normal_tensor_std_negative": (lambda m, s: torch.normal(m, s), [torch.zeros(3), torch.tensor([1.0, -1.0, 2.0])],
                                   r"normal expects all elements of std >= 0.0"),
    "normal_float_mean_tensor_std_nan": (lambda s: torch.normal(0.0, s), [torch.tensor([1.0, float("nan")])],
                                         r"normal expects all elements of std >= 0.0"),
    "randperm_out_half_too_large": (lambda o: torch.randperm(2050, out=o), [torch.empty(0, dtype=torch.float16)],
                                    "n cannot be greater than 2049 for Half type"),
    "randperm_bool": (lambda o: torch.randperm(3, out=o), [torch.empty(0, dtype=torch.bool)],
                      "\"randperm\" not implemented for 'Bool'"),
    "randperm_out_uint8_overflow": (lambda o: torch.randperm(257, out=o), [torch.empty(0, dtype=torch.uint8)],
                                    "value cannot be converted to type uint8_t without overflow"),
    # integer division and remainder by zero: CPU's RuntimeError "ZeroDivisionError"
    "floor_divide_int_zero": (lambda x, y: x // y, [torch.tensor([1, 2]), torch.tensor([0, 1])], "ZeroDivisionError"),
    "floor_divide_int_scalar_zero": (lambda x: x // 0, [torch.tensor([1, 2])], "ZeroDivisionError"),
    "floor_divide_int32_broadcast": (lambda x, y: x // y, [torch.ones(2, 3, dtype=torch.int32),
                                                           torch.tensor([1, 0, 1], dtype=torch.int32)],
                                     "ZeroDivisionError"),
    "remainder_int_zero": (lambda x, y: x % y, [torch.tensor([1, 2]), torch.tensor([0, 1])], "ZeroDivisionError"),
    "remainder_int_scalar_zero": (lambda x: torch.remainder(x, 0), [torch.tensor([5, 2])], "ZeroDivisionError"),
    "remainder_uint8_zero": (lambda x, y: x % y, [torch.tensor([1, 2], dtype=torch.uint8),
                                                   torch.tensor([3, 0], dtype=torch.uint8)], "ZeroDivisionError"),
    "fmod_int_zero": (lambda x, y: torch.fmod(x, y), [torch.tensor([1, 2]), torch.tensor([1, 0])],
                      "ZeroDivisionError"),
    "div_trunc_int_zero": (lambda x, y: torch.div(x, y, rounding_mode="trunc"),
                           [torch.tensor([1, 2]), torch.tensor([0, 1])], "ZeroDivisionError"),
    "div_floor_int8_zero": (lambda x, y: torch.div(x, y, rounding_mode="floor"),
                            [torch.tensor([1, 2], dtype=torch.int8), torch.tensor([0, 1], dtype=torch.int8)],
                            "ZeroDivisionError"),
    "floor_divide_inplace_zero": (lambda x, y: x.floor_divide_(y), [torch.tensor([4, 2]), torch.tensor([2, 0])],
                                  "ZeroDivisionError"),
    # index dtypes CPU's index_* kernels refuse (the meta kernels accept any)
    "index_fill_float_index": (lambda x, i: x.index_fill(0, i, 1), [torch.zeros(3), torch.tensor([0.])],
                               r"index_fill_\(\): Expected dtype int64 for index"),
    "index_fill_int32_index": (lambda x, i: x.index_fill_(0, i, 1), [torch.zeros(3), torch.tensor([0], dtype=torch.int32)],
                               r"index_fill_\(\): Expected dtype int64 for index"),
    "index_copy_float_index": (lambda x, i, s: x.index_copy(0, i, s), [torch.zeros(3), torch.tensor([0.]), torch.ones(1)],
                               r"index_copy_\(\): Expected a long tensor for index, but got Float"),
    "index_add_float_index": (lambda x, i, s: x.index_add(0, i, s), [torch.zeros(3), torch.tensor([0.]), torch.ones(1)],
                              r"index_add_\(\): Expected dtype int32/int64 for index but got: Float"),
    "index_add_int16_index": (lambda x, i, s: x.index_add(0, i, s),
                              [torch.zeros(3), torch.tensor([0], dtype=torch.int16), torch.ones(1)],
                              r"Expected dtype int32/int64 for index but got: Short"),
    "index_reduce_float_index": (lambda x, i, s: x.index_reduce(0, i, s, "prod"),
                                 [torch.zeros(3), torch.tensor([0.]), torch.ones(1)],
                                 r"index_reduce_\(\): Expected dtype int32/int64 for index"),
    "index_select_float_index": (lambda x, i: x.index_select(0, i), [torch.zeros(3), torch.tensor([0.])],
                                 r"index_select\(\): Expected dtype int32 or int64 for index"),
    # index dimensionality: CPU checks it before the dtype (IndexError); the
    # meta kernels of index_select and index_reduce accept a 2-d index
    "index_select_2d_one_element_index": (lambda x, i: x.index_select(0, i), [torch.zeros(3, 2), torch.tensor([[1]])],
                                          r"index_select\(\): Index is supposed to be a vector"),
    "index_select_2d_index": (lambda x, i: torch.index_select(x, 0, i), [torch.zeros(3, 2), torch.tensor([[1, 2]])],
                              r"index_select\(\): Index is supposed to be a vector"),
    "index_select_2d_float_index": (lambda x, i: x.index_select(0, i), [torch.zeros(3, 2), torch.tensor([[1.]])],
                                    r"index_select\(\): Index is supposed to be a vector"),
    "index_reduce_2d_index": (lambda x, i, s: x.index_reduce(0, i, s, "prod"),
                              [torch.zeros(3, 2), torch.tensor([[1]]), torch.ones(1, 2)],
                              r"index_reduce_\(\): Index is supposed to be a vector, but got dim: 2 with type: Long"),
    "index_reduce_2d_float_index": (lambda x, i, s: x.index_reduce(0, i, s, "amax"),
                                    [torch.zeros(3, 2), torch.tensor([[1.]]), torch.ones(1, 2)],
                                    r"index_reduce_\(\): Index is supposed to be a vector, but got dim: 2 with type: Float"),
    "index_add_2d_float_index": (lambda x, i, s: x.index_add(0, i, s),
                                 [torch.zeros(3, 2), torch.tensor([[1.]]), torch.ones(1, 2)],
                                 r"index_add_\(\): Index is supposed to be a vector, but got dim: 2"),
    "index_copy_2d_float_index": (lambda x, i, s: x.index_copy(0, i, s),
                                  [torch.zeros(3, 2), torch.tensor([[1.]]), torch.ones(1, 2)],
                                  r"index_copy_\(\): Index should have dimension 1 or 0 \(got 2\)"),
    "index_fill_2d_index": (lambda x, i: x.index_fill(0, i, 7.), [torch.zeros(3, 2), torch.tensor([[1]])],
                            r"Index has to be a vector/scalar"),
    # masked_fill's mask must be bool (the meta kernel accepts uint8)
    "masked_fill_uint8_mask": (lambda x, m: x.masked_fill_(m, 5.), [torch.zeros(3), torch.tensor([1, 0, 1], dtype=torch.uint8)],
                               "masked_fill_ only supports boolean masks, but got mask with dtype unsigned char"),
    "masked_fill_uint8_mask_functional": (lambda x, m: x.masked_fill(m, 5.),
                                          [torch.zeros(3), torch.tensor([1, 0, 1], dtype=torch.uint8)],
                                          "masked_fill_ only supports boolean masks"),
    # a Scalar value that does not fit self's dtype: CPU's Scalar::to raises
    # (the lowerings wrapped it: 1000 -> -24 in int8)
    "fill_int8_overflow": (lambda x: x.fill_(1000), [torch.zeros(3, dtype=torch.int8)],
                           "value cannot be converted to type int8_t without overflow"),
    "fill_half_overflow": (lambda x: x.fill_(1e6), [torch.zeros(3, dtype=torch.half)],
                           "value cannot be converted to type c10::Half without overflow"),
    "masked_fill_int8_overflow": (lambda x: x.masked_fill_(x == 0, 1000), [torch.zeros(3, dtype=torch.int8)],
                                  "value cannot be converted to type int8_t without overflow"),
    "masked_fill_complex_into_float": (lambda x: x.masked_fill(x == 0, 1 + 2j), [torch.zeros(3)],
                                       "value cannot be converted to type float without overflow"),
    "index_fill_int8_overflow": (lambda x, i: x.index_fill_(0, i, 1000), [torch.zeros(3, dtype=torch.int8), torch.tensor([1])],
                                 "value cannot be converted to type int8_t without overflow"),
    "index_fill_complex_into_float": (lambda x, i: x.index_fill_(0, i, 1 + 1j), [torch.zeros(3), torch.tensor([1])],
                                      r"index_fill_\(\): Converting complex Scalar to non-complex type is not supported"),
    "scatter_value_int8_overflow": (lambda x, i: x.scatter_(0, i, 1000), [torch.zeros(3, dtype=torch.int8), torch.tensor([1])],
                                    "value cannot be converted to type int8_t without overflow"),
    "full_int8_overflow": (lambda x: torch.full((2,), 1000, dtype=torch.int8, device=x.device), [torch.zeros(1)],
                           "value cannot be converted to type int8_t without overflow"),
    "full_like_uint8_overflow": (lambda x: torch.full_like(x, 300), [torch.zeros(2, dtype=torch.uint8)],
                                 "value cannot be converted to type uint8_t without overflow"),
    # Python indexing makes the scalar on the device with scalar_tensor.
    "setitem_mask_int8_overflow": (lambda x: x.__setitem__(x == 0, 300), [torch.zeros(3, dtype=torch.int8)],
                                   "value cannot be converted to type int8_t without overflow"),
    "setitem_index_int8_overflow": (lambda x: x.__setitem__(0, -129), [torch.zeros(3, dtype=torch.int8)],
                                    "value cannot be converted to type int8_t without overflow"),
    "setitem_mask_int32_overflow": (lambda x: x.__setitem__(x == 0, 1e10), [torch.zeros(3, dtype=torch.int32)],
                                    "value cannot be converted to type int without overflow"),
    "scalar_tensor_int8_overflow": (lambda x: torch.scalar_tensor(300, dtype=torch.int8, device=x.device),
                                    [torch.zeros(1)], "value cannot be converted to type int8_t without overflow"),
}
CASES.update(DEVICE_CASES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_input(case, mode):
    fn, args, regex = CASES[case]
    _check(fn, args, regex, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(DEVICE_CASES))
def test_invalid_input_on_the_device(case, mode):
    """The same invalid input three times: after strict mode's first two calls
    (served on the CPU kernel; the second queues the compile), the device program
    (debug and fused: every call) must raise CPU's exception type and name the
    problem, from a value check on the device where the problem is in the
    values."""
    fn, args, regex = DEVICE_CASES[case]
    for _ in range(2):
        _check(fn, args, regex, mode)
    wait_for_compiles()  # strict: the second call queued the compile
    _check(fn, args, regex, mode)


@pytest.mark.parametrize("mode", MODES)
def test_value_check_surfaces_at_the_op_or_the_sync_point(mode):
    """Integer division by zero on device values: debug mode raises at the
    op; strict and fused mode at the next sync point (reading the result),
    naming the op. The calls before the failing one keep their values."""
    x, y = torch.tensor([7, -7, 5]), torch.tensor([2, 0, 1])
    tx, ty = x.to(TPU), y.to(TPU)
    with torch_tpu.eager_mode(mode):
        for i in range(2):
            ok = (tx // torch.ones_like(ty)).cpu()
            torch.testing.assert_close(ok, x // torch.ones_like(y), rtol=0, atol=0)
            if mode == "debug":
                with pytest.raises(RuntimeError, match="ZeroDivisionError"):
                    tx // ty
            else:
                try:
                    r = tx // ty
                except RuntimeError as e:
                    # strict: the key's first two calls (the good one above,
                    # this one) run CPU's kernel, which raises at once, as CPU
                    assert mode == "strict" and i == 0 and "ZeroDivisionError" in str(e), e
                    wait_for_compiles()  # the second call queued the compile: the next runs the program
                    continue
                with pytest.raises(RuntimeError, match=r"floor_divide.*ZeroDivisionError"):
                    r.cpu()
        torch.tpu.synchronize()  # nothing left pending
        torch.testing.assert_close((tx // (ty + 1)).cpu(), x // (y + 1), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_valid_division_bernoulli_and_index_fill_still_compute(mode):
    """What CPU accepts computes CPU's values on the device (no CPU
    fallback): integer // and % by nonzero values, bernoulli with p in
    [0, 1] (p = 0 and 1 exactly), index_fill with an int64 index; and
    index_fill of a tpu tensor with a CPU index, which CPU's kernel accepts
    (PyTorch's test_stable_sort_against_numpy does it), is moved to the
    device."""
    from conftest import no_cpu_fallback
    x, y = torch.tensor([7, -7, 5, -3]), torch.tensor([2, 3, -1, -2])
    p = torch.tensor([0.0, 1.0, 1.0, 0.0])
    with torch_tpu.eager_mode(mode), no_cpu_fallback():
        for i in range(3):
            if i == 2:
                wait_for_compiles()  # strict: the first two calls ran CPU's kernel; this one the programs
            tx, ty = x.to(TPU), y.to(TPU)
            torch.testing.assert_close((tx // ty).cpu(), x // y, rtol=0, atol=0)
            torch.testing.assert_close((tx % ty).cpu(), x % y, rtol=0, atol=0)
            torch.testing.assert_close(torch.fmod(tx, ty).cpu(), torch.fmod(x, y), rtol=0, atol=0)
            torch.testing.assert_close((tx // 3).cpu(), x // 3, rtol=0, atol=0)
            torch.testing.assert_close(torch.bernoulli(p.to(TPU)).cpu(), p, rtol=0, atol=0)
            torch.testing.assert_close(torch.empty(4, device=TPU).bernoulli_(1.0).cpu(), torch.ones(4))
            z = torch.zeros(3, 4)
            idx = torch.tensor([2, 0])
            torch.testing.assert_close(z.to(TPU).index_fill(0, idx.to(TPU), 5).cpu(), z.index_fill(0, idx, 5))
            torch.testing.assert_close(z.to(TPU).index_fill(1, idx, -1.5).cpu(), z.index_fill(1, idx, -1.5))
            torch.testing.assert_close(z.to(TPU).index_fill_(0, torch.tensor(1), 2).cpu(),
                                       z.clone().index_fill_(0, torch.tensor(1), 2))


@pytest.mark.parametrize("mode", ("strict", "debug"))
def test_pow_scalar_check_is_per_value(mode):
    """The exponent is a runtime Scalar: one executable serves 2 and -1, and
    only -1 raises (a check made once at compile time would miss it)."""
    x = INT.to(TPU)
    with torch_tpu.eager_mode(mode):
        # Strict: the second call (after a sync point) queues the program's
        # compile and metrics() waits for it (with one call the count below
        # held only with the shared disk cache warm: the program loaded at once).
        for _ in range(2):
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
    # Non-dense views sharing elements in other layouts (at::get_overlap_status
    # TooHard): CPU's loop computes in its element order (it does not raise),
    # reading elements it wrote; tpu must give those values.
    "mul_columns": lambda a: a.view(2, 5)[:, 1:].mul_(a.view(2, 5)[:, :-1]),
    "copy_columns": lambda a: a.view(2, 5)[:, 1:].copy_(a.view(2, 5)[:, :-1]),
    "add_out_columns": lambda a: torch.add(a.view(2, 5)[:, :-1], 1, out=a.view(2, 5)[:, 1:]),
    "add_every_other": lambda a: a[2::2].add_(a[:-2:2]),
    "mul_transposed_block": lambda a: a[:9].view(3, 3)[:, :2].mul_(a[:9].view(3, 3).t()[:, :2]),
}


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
        # non-dense views of one storage sharing no element (TooHard for
        # at::get_overlap_status; ViewsShareAnElement tells them apart)
        t[::2].add_(t[1::2])
        t.view(2, 5)[:, 0].mul_(t.view(2, 5)[:, 1])
        t.view(2, 5)[:, 1:3].sub_(t.view(2, 5)[:, 3:])
        t.view(2, 5)[:, 1:].mul_(t.view(2, 5)[:, 1:])  # the same layout: a full overlap
        t.view(2, 5)[:, 0].copy_(t.view(2, 5)[:, 4])
        got = t.cpu()
    a.add_(a)
    a[5:].add_(a[:5])
    a[::2].add_(a[1::2])
    a.view(2, 5)[:, 0].mul_(a.view(2, 5)[:, 1])
    a.view(2, 5)[:, 1:3].sub_(a.view(2, 5)[:, 3:])
    a.view(2, 5)[:, 1:].mul_(a.view(2, 5)[:, 1:])
    a.view(2, 5)[:, 0].copy_(a.view(2, 5)[:, 4])
    torch.testing.assert_close(got, a)


# Writes to a tensor whose elements are one memory location. as_strided
# layouts with a shared element are TooHard for at::has_internal_overlap:
# CPU does not raise and computes in its own element order, reading elements
# it wrote (a.as_strided((4, 4), (2, 1)).mul_(2) gives 2, 4, 12, 16, ...);
# an expanded tensor (a zero stride) makes CPU raise.
SELF_OVERLAP = {
    "mul_scalar": lambda a: a.as_strided((4, 4), (2, 1)).mul_(2),
    "add_scalar": lambda a: a.as_strided((4, 4), (2, 1)).add_(1),
    "add_itself": lambda a: a.as_strided((4, 4), (2, 1)).add_(a.as_strided((4, 4), (2, 1))),
    "sub_tensor": lambda a: a.as_strided((3, 3), (2, 1)).sub_(torch.ones(3, 3, device=a.device)),
    "copy_from_device": lambda a: a.as_strided((4, 4), (2, 1)).copy_(torch.arange(16., device=a.device).view(4, 4)),
    "copy_from_cpu": lambda a: a.as_strided((4, 4), (2, 1)).copy_(torch.arange(16.).view(4, 4)),
    "add_out": lambda a: torch.add(torch.arange(16., device=a.device).view(4, 4), 1, out=a.as_strided((4, 4), (2, 1))),
    "clamp_": lambda a: a.as_strided((2, 5), (1, 1)).clamp_(max=6.),
    "expand_add_": lambda a: a[:1].expand(3).add_(1),
    "expand_mul_tensor": lambda a: a[:2].view(2, 1).expand(2, 3).mul_(torch.ones(2, 3, device=a.device)),
    "expand_copy_": lambda a: a[:1].expand(3).copy_(torch.arange(3., device=a.device)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(SELF_OVERLAP))
def test_self_overlapping_write_runs_like_cpu(case, mode):
    """A written tensor with internally overlapping elements (csrc/aten/
    fallback.cpp WritesOverlappingTensor/HasSelfOverlap, kernels.cpp copy_)
    runs on the CPU mirror: CPU's values where CPU computes (before: tpu
    wrote each element once, 2, 4, 6, ... for mul_), CPU's exception and
    message where it raises. Three times, so that strict mode's third call (its
    program, after two host-served ones) is covered."""
    fn = SELF_OVERLAP[case]
    for i in range(3):
        if i == 2:
            wait_for_compiles()  # strict: the second call queued the compile; this one runs it
        cpu_in = torch.arange(1., 11.)
        try:
            fn(cpu_in)
            cpu_err = None
        except RuntimeError as e:
            cpu_err = e
        t = torch.arange(1., 11., device=TPU)
        err = _tpu_error(lambda: fn(t), (), mode)
        if cpu_err is None:
            assert err is None, err
            torch.testing.assert_close(t.cpu(), cpu_in, rtol=0, atol=0)
        else:
            assert type(err) is type(cpu_err), (err, cpu_err)
            assert "more than one element of the written-to tensor refers to a single memory location" in str(err), err
            assert "more than one element of the written-to tensor" in str(cpu_err), cpu_err


def test_views_without_shared_elements_still_run_natively():
    """Non-dense written views whose elements are distinct (TooHard for
    at::has_internal_overlap: steps, transposes, as_strided with gaps) are
    proven free of overlap (by strides, or by listing the offsets) and run
    on tpu: no CPU fallback, CPU's values."""
    from conftest import no_cpu_fallback

    def ops(a):
        a[::2].mul_(3)
        a[:12].view(3, 4).t().add_(1)
        a[:12].view(3, 4)[:, 1:3].sub_(2)
        a.as_strided((2, 2), (3, 2)).mul_(5)  # offsets 0, 2, 3, 5: the stride test fails, the listing proves it
        a.as_strided((3, 2), (2, 3)).add_(torch.ones(3, 2, device=a.device))  # 0, 3, 2, 5, 4, 7
        return a

    ref = ops(torch.arange(16.))
    t = torch.arange(16., device=TPU)
    with no_cpu_fallback():
        got = ops(t).cpu()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def _mask(x):
    return x > 2


# x[mask] = v and its neighbours (index_put_ with masks or indices): CPU's
# index_put_ serves a single bool/uint8 mask with a one-element value as
# masked_fill_(mask, value.item()) (TensorAdvancedIndexing.cpp
# canDispatchToMaskedFill): a value of another dtype is converted, a uint8
# mask raises masked_fill_'s error; any other call requires the dtypes to
# match. Each case builds its value on the device it is given (None: CPU).
MASK_ASSIGN = {
    "int64_value_into_float": (lambda x, d: x.__setitem__(_mask(x), torch.tensor(3)), torch.float32),
    "float64_value_into_float": (lambda x, d: x.__setitem__(_mask(x), torch.tensor(3.5, dtype=torch.float64)),
                                 torch.float32),
    "device_int64_value": (lambda x, d: x.__setitem__(_mask(x), torch.tensor(3, device=d)), torch.float32),
    "value_of_shape_1x1": (lambda x, d: x.__setitem__(_mask(x), torch.tensor([[4]], device=d)), torch.float32),
    "float_value_into_int": (lambda x, d: x.__setitem__(_mask(x), torch.tensor(2.7)), torch.int32),
    "same_dtype_value": (lambda x, d: x.__setitem__(_mask(x), torch.tensor(-1.5, device=d)), torch.float32),
    "python_scalar": (lambda x, d: x.__setitem__(_mask(x), 5.0), torch.float32),
    "mask_after_none": (lambda x, d: x.view(2, 3).__setitem__((slice(None), x.view(2, 3)[0] > 0), torch.tensor(7)),
                        torch.float32),
    "transposed_mask": (lambda x, d: x.view(2, 3).t().__setitem__(x.view(2, 3).t() > 1, torch.tensor(9)),
                        torch.float32),
    "functional_index_put": (lambda x, d: x.copy_(torch.index_put(x, (_mask(x),), torch.tensor(8))), torch.float32),
    "uint8_mask_two_values": (lambda x, d: x.__setitem__(_mask(x).to(torch.uint8), torch.tensor([5., 6., 7.], device=d)),
                              torch.float32),
    # CPU raises
    "int8_overflow": (lambda x, d: x.__setitem__(_mask(x), torch.tensor(1000.)), torch.int8),
    "complex_value_into_float": (lambda x, d: x.__setitem__(_mask(x), torch.tensor(1 + 2j)), torch.float32),
    "uint8_mask_scalar": (lambda x, d: x.__setitem__(_mask(x).to(torch.uint8), 5.0), torch.float32),
    "uint8_mask_tensor": (lambda x, d: x.__setitem__(_mask(x).to(torch.uint8), torch.tensor(5.)), torch.float32),
    "long_index_other_dtype": (lambda x, d: x.__setitem__(torch.tensor([1, 2], device=d), torch.tensor(3)),
                               torch.float32),
    "long_index_other_dtype_values": (lambda x, d: x.__setitem__(torch.tensor([1, 2], device=d),
                                                                 torch.tensor([3, 4], device=d)), torch.float32),
    "mask_other_dtype_values": (lambda x, d: x.__setitem__(_mask(x), torch.tensor([3, 4, 5], device=d)),
                                torch.float32),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(MASK_ASSIGN))
def test_mask_assignment_like_cpu(case, mode):
    """x[mask] = v gives CPU's values, or CPU's exception type and message,
    in every mode (before: strict raised "Index put requires the source and
    destination dtypes match" for x[m] = torch.tensor(3) into float32,
    where CPU converts; a uint8 mask with a one-element value was accepted;
    values of another dtype with long indices were converted where CPU
    raises; 1000 into int8 saturated to 127). Three times: strict mode's
    third call runs the device program (the first two run CPU's kernel)."""
    fn, dtype = MASK_ASSIGN[case]
    for i in range(3):
        if i == 2:
            wait_for_compiles()  # strict: the second call queued the compile; this one runs it
        cpu_in = torch.arange(6).to(dtype)
        try:
            fn(cpu_in, None)
            cpu_err = None
        except Exception as e:  # noqa: BLE001
            cpu_err = e
        t = torch.arange(6).to(dtype).to(TPU)
        err = _tpu_error(lambda: fn(t, TPU), (), mode)
        if cpu_err is None:
            assert err is None, err
            torch.testing.assert_close(t.cpu(), cpu_in, rtol=0, atol=0)
        else:
            assert err is not None, f"tpu returned {t.cpu()} where CPU raises {cpu_err}"
            assert type(err) is type(cpu_err), (err, cpu_err)
            assert str(cpu_err).split("\n")[0] in str(err), (err, cpu_err)


def test_mask_assignment_stays_on_the_device():
    """The served forms compute on tpu (no CPU fallback), a value of
    self's dtype without a sync."""
    from conftest import no_cpu_fallback
    x = torch.arange(6.)
    t = x.to(TPU)
    with no_cpu_fallback():
        t[t > 2] = torch.tensor(3)
        t[t < 1] = torch.tensor(-1., device=TPU)
        t.view(2, 3)[:, t.view(2, 3)[0] > 0] = 7.
        got = t.cpu()
    x[x > 2] = torch.tensor(3)
    x[x < 1] = torch.tensor(-1.)
    x.view(2, 3)[:, x.view(2, 3)[0] > 0] = 7.
    torch.testing.assert_close(got, x, rtol=0, atol=0)


# --- Mixed floating dtypes where CPU's kernel requires one (issue 10) ---
#
# CPU kernels that take no type promotion (a TensorIterator without
# promote_inputs_to_common_dtype, or data_ptr<scalar_t>() on every operand)
# raise for operands of different floating dtypes, while the meta kernels and
# the lowerings accepted the mix and returned a value. aten/fallback.cpp
# CheckDtypesLikeCpu runs CPU's kernel on zero-filled CPU tensors once per
# (overload, dtype signature) and raises its error at the op, in every mode,
# without reading device values. The cases: the ops an OpInfo sweep (each
# aten op the OpInfo samples reach, forward and backward, replayed with one
# floating argument cast to float64 or bfloat16) found returning a value.

_g64, _x32, _t32 = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4), torch.rand(3, 4)
_A = torch.ops.aten
MIXED_CASES = {
    "huber_loss_backward": (lambda g, x, t: _A.huber_loss_backward(g, x, t, 1, 1.0), [_g64, _x32, _t32],
                            "Found dtype Double but expected Float"),
    "binary_cross_entropy_backward": (lambda g, x, t: _A.binary_cross_entropy_backward(g, x, t, None, 1),
                                      [_g64, _x32.sigmoid(), _t32], "Found dtype Float but expected Double"),
    "binary_cross_entropy": (lambda x, t: torch.nn.functional.binary_cross_entropy(x, t),
                             [_x32.sigmoid(), _t32.double()], "Found dtype Double but expected Float"),
    "prelu_kernel": (lambda x, w: _A._prelu_kernel(x, w), [_x32, torch.rand(1, dtype=torch.float64)],
                     "Found dtype Double but expected Float"),
    "log_softmax_backward_data": (lambda g, o: _A._log_softmax_backward_data(g, o, 1, torch.float32),
                                  [_g64, _x32.log_softmax(1)], "expected scalar type"),
    "softmax_backward_data": (lambda g, o: _A._softmax_backward_data(g, o, 1, torch.float32),
                              [_x32, _x32.softmax(1).double()], "expected scalar type"),
    "glu_backward": (lambda g, x: _A.glu_backward(g, x, 1), [torch.randn(3, 2, dtype=torch.float64), _x32],
                     "Found dtype|expected scalar type"),
    "log_sigmoid_backward": (lambda g, x, b: _A.log_sigmoid_backward(g, x, b), [_g64, _x32, torch.zeros(3, 4)],
                             "Found dtype|expected scalar type"),
    "batch_norm_weight_f64": (lambda x, w, b: torch.nn.functional.batch_norm(x, None, None, w, b, training=True),
                              [_x32, torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)],
                              "scalar type of Float"),
    "nll_loss_backward": (lambda g, x, t: _A.nll_loss_backward(g, x, t, None, 1, -100, torch.tensor(3.)),
                          [torch.tensor(1., dtype=torch.float64), _x32, torch.tensor([0, 1, 2])],
                          "expected scalar type"),
    "mm": (lambda a, b: torch.mm(a, b), [_x32, _g64.T.contiguous()], "expected m1 and m2 to have the same dtype"),
    "layer_norm_backward": (lambda g, x, m, r, w: _A.native_layer_norm_backward(g, x, [4], m, r, w, None,
                                                                                 [True, True, False]),
                            [_g64, _x32, torch.zeros(3, 1), torch.ones(3, 1), torch.ones(4)],
                            "expected scalar type|dtype"),
    "embedding_bag_per_sample_weights": (
        lambda w, i, o, p: torch.nn.functional.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
        [torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 2, 4]), torch.tensor([0, 1]), torch.rand(3)],
        "to have the same type"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(MIXED_CASES))
def test_mixed_dtypes_raise_like_cpu_at_the_op(case, mode):
    """The same exception type and CPU's message, raised by the call itself
    (no sync point needed: a dtype check reads no device values), on every
    call (the first, and the cached ones after a compile)."""
    fn, args, regex = MIXED_CASES[case]
    cpu = _cpu_error(fn, *args)
    assert re.search(regex, str(cpu)), f"CPU's message changed: {cpu}"
    _raises_like_cpu_at_every_call(fn, args, cpu, mode)


_i64 = torch.tensor([[3, -2, 0, 5], [1, 7, -4, 2]])
# Integer or bool inputs CPU's kernel has no dtype case for (AT_DISPATCH_*):
# NotImplementedError "... not implemented for 'Long'", which ATen's C++ meta
# steps leave to the kernel (session 24 review: leaky_relu and mse_loss of
# int64 gave values once a program served the key, after cpp_meta.cpp's
# table replaced their Python meta kernels; hardsigmoid, tanh_backward and
# sigmoid_backward did before).
DISPATCH_CASES = {
    "leaky_relu": (lambda x: torch.nn.functional.leaky_relu(x, 0.2), [_i64]),
    "mse_loss": (lambda x: torch.nn.functional.mse_loss(x, x.flip(1)), [_i64]),
    "mse_loss_none": (lambda x: torch.nn.functional.mse_loss(x, x.flip(1), reduction="none"), [_i64]),
    "hardsigmoid": (lambda x: torch.nn.functional.hardsigmoid(x), [_i64]),
    "tanh_backward": (lambda x: _A.tanh_backward(x, x), [_i64]),
    "sigmoid_backward": (lambda x: _A.sigmoid_backward(x, x), [_i64]),
    "nll_loss_forward": (lambda x, t: _A.nll_loss_forward(x, t, None, 1, -100)[0], [_i64, torch.tensor([1, 3])]),
    "softplus_bool": (lambda x: torch.nn.functional.softplus(x), [_i64 > 0]),
    "elu": (lambda x: torch.nn.functional.elu(x), [_i64]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(DISPATCH_CASES))
def test_dtypes_cpu_kernels_lack_raise_like_cpu_at_the_op(case, mode):
    """CPU's exception type and message at the op, on every call (strict:
    the host-served first calls and the program after them)."""
    fn, args = DISPATCH_CASES[case]
    cpu = _cpu_error(fn, *args)
    assert " not implemented for '" in str(cpu), f"CPU's message changed: {cpu}"
    _raises_like_cpu_at_every_call(fn, args, cpu, mode, sync=True)


def test_integer_calls_cpu_accepts_keep_their_values():
    """Integer calls CPU's kernels accept are probed once per dtype
    signature and keep CPU's values, exactly, in every mode."""
    cases = [lambda x: x + 1, lambda x: x.cumsum(1), lambda x: torch.remainder(x, 3), lambda x: x.abs().max(1).values,
             lambda x: torch.where(x > 0, x, -x), lambda x: x.flip(0) * x]
    for mode in MODES:
        with torch_tpu.eager_mode(mode):
            for fn in cases:
                for _ in range(3):
                    assert torch.equal(fn(_i64.to(TPU)).cpu(), fn(_i64))
                    torch.tpu.synchronize()
                    wait_for_compiles()


def test_valid_mixed_dtypes_still_compute_on_the_device():
    """Mixes CPU accepts keep their values and stay on the device: the probe
    runs once per dtype signature and is not a CPU fallback."""
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    w, b = torch.randn(4), torch.randn(4)
    g = torch.randn(3, 4)
    cases = [
        (lambda x, w, b: torch.nn.functional.layer_norm(x, (4,), w, b), [x, w, b]),
        (lambda g, x, t: _A.mse_loss_backward(g, x, t, 1), [g, x, x.float()]),
        (lambda a, c: a + c, [_x32, _g64]),
        (lambda a, c: torch.where(a > 0, a, c), [_x32, _g64]),
    ]
    before = dict(torch_tpu.metrics().get("cpu_fallbacks", {}))
    for mode in MODES:
        with torch_tpu.eager_mode(mode):
            for fn, args in cases:
                for _ in range(2):
                    got = fn(*_to_tpu(args)).cpu()
                    want = fn(*args)
                    assert got.dtype == want.dtype
                    torch.testing.assert_close(got, want, rtol=1e-2 if want.dtype == torch.bfloat16 else 1e-5,
                                               atol=1e-2 if want.dtype == torch.bfloat16 else 1e-5)
    assert dict(torch_tpu.metrics().get("cpu_fallbacks", {})) == before


_UNSAFE_INPLACE = {
    "int.mul_(2.5)": lambda d: torch.tensor([1, 2], device=d).mul_(2.5),
    "int *= float tensor": lambda d: torch.tensor([1, 3], device=d).__imul__(torch.tensor([1.5, 1.5], device=d)),
    "float.mul_(1j)": lambda d: torch.tensor([1.0, 2.0], device=d).mul_(1j),
    "float.add_(complex tensor)": lambda d: torch.tensor([1.0, 2.0], device=d).add_(torch.tensor([1j, 1j], device=d)),
    "out= Long for a Float result": lambda d: torch.add(torch.tensor([1.5], device=d), 1,
                                                       out=torch.empty(1, dtype=torch.long, device=d)),
    "index_add_ Long source into Float": lambda d: torch.zeros(3, device=d).index_add_(
        0, torch.tensor([0], device=d), torch.tensor([1], device=d)),
    "scatter_ Long src into Float": lambda d: torch.zeros(3, device=d).scatter_(
        0, torch.tensor([0], device=d), torch.tensor([1], device=d)),
}


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
@pytest.mark.parametrize("case", list(_UNSAFE_INPLACE))
def test_unsafe_inplace_cast_raises_like_cpu_every_call(case, mode):
    """CPU refuses to write a result into a tensor its type cannot be cast to
    (TensorIterator's enforce_safe_casting_to_output; index_add_/scatter_'s
    dtype checks); the meta kernels do not check it, so a compiled program
    (a key's 3rd call in strict mode) wrote [2, 5] for int.mul_(2.5). Every
    call must raise CPU's error, also once the key is warm."""
    fn = _UNSAFE_INPLACE[case]
    with pytest.raises(RuntimeError) as cpu_error:
        fn("cpu")
    with torch_tpu.eager_mode(mode):
        for _ in range(4):
            with pytest.raises(RuntimeError) as tpu_error:
                fn("tpu").cpu()
            torch_tpu.metrics()  # waits for compiles queued by the call
            assert str(tpu_error.value).split("\n")[0] == str(cpu_error.value).split("\n")[0]


def test_invalid_call_the_meta_kernel_rejects_raises_without_fallback_warning():
    """A call the meta kernel rejects (an invalid argument) runs CPU's kernel,
    which raises CPU's error: no "runs on the CPU" warning goes with it (CPU
    gives none); the op's first call CPU's kernel completes still warns.
    Fresh process: the warning is once per op and process."""
    from conftest import run_python

    code = (
        "import warnings, torch, torch_tpu\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    try:\n"
        "        torch.empty(4, device='tpu').normal_(0, -1)\n"
        "    except RuntimeError as e:\n"
        "        print('raised', str(e).splitlines()[0])\n"
        "print('invalid', sum('runs on the CPU' in str(x.message) for x in w))\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    torch.special.bessel_j0(torch.ones(3, device='tpu'))\n"
        "    torch.special.bessel_j0(torch.ones(3, device='tpu'))\n"
        "print('valid', sum('runs on the CPU' in str(x.message) for x in w))\n"
    )
    r = run_python(code, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "raised normal expects std >= 0.0, but found std -1" in r.stdout
    assert "invalid 0" in r.stdout and "valid 1" in r.stdout, r.stdout
