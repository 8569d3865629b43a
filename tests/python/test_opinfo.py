"""OpInfo conformance: PyTorch's own sample inputs (op_db) on tpu against CPU.

One test per (OpInfo, dtype, mode, phase). Each runs the OpInfo's sample
inputs on CPU and on tpu copies and compares the results with the tolerance
rule of tests/python/opinfo_harness.py (float32 rtol=1.3e-6 atol=1e-5;
bfloat16 rtol=1.6e-2 atol=1e-5, atol=1e-2 for reductions/matmuls; int64 and
bool exact; the OpInfo's own toleranceOverrides where larger); backward
compares the input gradients of torch.autograd.grad in float32.

By default a fast subset runs (opinfo_harness.plan(op, full=False)): the first
FAST_MAX_SAMPLES samples, float32 plus one other supported dtype, strict-mode
forward and float32 backward, and a debug-mode forward for FAST_DEBUG_OPS.
TORCH_TPU_OPINFO_FULL=1 runs every sample, dtype and mode.

A test
  fails   when a sample fails on tpu (raises where CPU does not, or differs);
  skips   when no sample ran natively: every sample fell back to the CPU
          (the OpInfo has no lowering yet; the skip names the ATen ops), or
          CPU itself rejects the samples;
  xfails  (strict=False) when listed in opinfo_harness.EXPECTED_FAILURES.
test_opinfo_errors runs every OpInfo's error_inputs (invalid inputs CPU
rejects): the same exception type and a matching message on tpu
(opinfo_harness "error_inputs" section; fast subset error_plan(op, False)).
tools/op_coverage.py runs the same harness and writes docs/op_coverage.md.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch_tpu  # noqa: F401

import opinfo_harness as H

FULL = os.environ.get("TORCH_TPU_OPINFO_FULL", "") not in ("", "0")
MAX_SAMPLES = None if FULL else H.FAST_MAX_SAMPLES


def _cases():
    cases = []
    for op in H.op_db():
        name = H.full_name(op)
        for run in H.plan(op, FULL):
            for mode in run.modes:
                dname = H.DTYPE_NAMES[run.dtype]
                cases.append(pytest.param(name, dname, mode, run.phase, id=f"{name}-{dname}-{mode}-{run.phase}"))
    return cases


@pytest.fixture(autouse=True)
def _strict_default():
    # Each test picks its mode; leave the process in strict mode.
    with torch_tpu.eager_mode("strict"):
        yield


def _summary(outcomes, status):
    return "; ".join(f"sample {o.sample}: " + (f"[{o.category}] " if o.category else "") + o.reason
                     for o in outcomes if o.status == status)


@pytest.mark.parametrize("name,dtype_name,mode,phase", _cases())
def test_opinfo(name, dtype_name, mode, phase, request):
    reason = H.expected_failure(name, dtype_name, mode, phase)
    if reason:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=False))
    op = H.find_op(name)
    dtype = H.NAME_DTYPES[dtype_name]
    samples = H.generate_samples(op, dtype, requires_grad=(phase == "bwd"), limit=MAX_SAMPLES)
    outcomes = [H.run_sample(op, s, i, dtype, mode, phase) for i, s in enumerate(samples)]
    failed = [o for o in outcomes if o.status == "fail"]
    assert not failed, f"{len(failed)}/{len(outcomes)} samples fail: {_summary(outcomes, 'fail')}"
    if not any(o.status == "pass" for o in outcomes):
        fell_back = sorted({f for o in outcomes for f in o.fallbacks})
        if fell_back:
            pytest.skip(f"no lowering: ran on the CPU through {', '.join(fell_back)} (values match CPU)")
        pytest.skip("nothing to compare: " + (_summary(outcomes, "skip")[:300] or "no samples"))


def test_harness_detects_wrong_values():
    """The harness itself: a tpu result that differs from CPU is a failure,
    not a pass (guards the comparison against silently accepting anything)."""
    op = H.find_op("add")
    sample = H.generate_samples(op, torch.float32, requires_grad=False, limit=1)[0]
    ref = H.cpu_reference(op, sample, "fwd")
    assert ref.ok
    ref.out = ref.out + 1 if isinstance(ref.out, torch.Tensor) else ref.out
    outcome = H.run_sample(op, sample, 0, torch.float32, "strict", "fwd", ref)
    assert outcome.status == "fail" and outcome.category == "wrong values", outcome


def test_harness_reports_fallbacks():
    """An op without a lowering is reported as a fallback naming the ATen op."""
    lowered = H.lowered_names()
    candidates = [n for n in ("special.zeta", "nn.functional.logsigmoid", "nextafter", "i0")
                  if H.base_name(H.find_op(n).aten_name or n) not in lowered]
    if not candidates:
        pytest.skip("every candidate op has a lowering now")
    op = H.find_op(candidates[0])
    sample = H.generate_samples(op, torch.float32, requires_grad=False, limit=1)[0]
    outcome = H.run_sample(op, sample, 0, torch.float32, "strict", "fwd")
    assert outcome.status in ("fallback", "fail"), outcome
    if outcome.status == "fallback":
        assert outcome.fallbacks and all(f.startswith("aten::") for f in outcome.fallbacks)


def test_tolerance_rule():
    add, total = H.find_op("add"), H.find_op("sum")
    assert H.tolerance(add, torch.float32) == (1.3e-6, 1e-5)
    assert H.tolerance(add, torch.bfloat16) == (1.6e-2, 1e-5)
    assert H.tolerance(total, torch.bfloat16)[1] >= 1e-2
    assert H.tolerance(add, torch.int64) == (0.0, 0.0)
    assert H.tolerance(add, torch.bool) == (0.0, 0.0)
    # an int64 sample with a float output (true division) compares as float
    assert H.tolerance(add, torch.int64, torch.float32) == (1.3e-6, 1e-5)


def test_core_aten_op_set():
    core = H.core_aten_ops()
    assert "aten.add.Tensor" in core and "aten.convolution.default" in core
    assert len(core) > 150
    assert H.natively_served("aten.add_.Tensor") == "lowering"
    assert H.natively_served("aten.empty_strided.default") in ("direct kernel", "lowering")
    assert H.natively_served("aten.permute.default") in ("view", "lowering")
    assert H.natively_served("aten.sym_size.int") == "metadata"
    assert H.natively_served("aten.not_an_op.default", lowered=set()) is None


# Fused eager mode on the same samples: forward float32 of common OpInfos
# (every OpInfo with TORCH_TPU_OPINFO_FULL=1). Each sample's calls form one
# region that runs at the comparison's sync point; values must match CPU as
# strict mode's do.
FUSED_OPS = ["add", "sub", "mul", "div", "pow", "exp", "log", "tanh", "sigmoid", "nn.functional.gelu",
             "nn.functional.relu", "where", "masked_fill", "clamp", "sum", "mean", "amax", "softmax",
             "log_softmax", "nn.functional.layer_norm", "matmul", "mm", "bmm", "addmm", "nn.functional.linear",
             "index_select", "gather", "cat", "stack", "transpose", "permute", "reshape", "expand",
             "nn.functional.embedding", "cumsum", "topk", "sort", "nn.functional.conv2d",
             "nn.functional.max_pool2d", "nn.functional.dropout"]


def _fused_cases():
    names = {H.full_name(op) for op in H.op_db()}
    chosen = sorted(names) if FULL else [n for n in FUSED_OPS if n in names]
    return [pytest.param(n, id=f"{n}-float32-fused-fwd") for n in chosen]


@pytest.mark.parametrize("name", _fused_cases())
def test_opinfo_fused(name, request):
    reason = H.expected_failure(name, "float32", "fused", "fwd")
    if reason:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=False))
    op = H.find_op(name)
    if torch.float32 not in op.supported_dtypes("cpu"):
        pytest.skip("float32 not supported by the OpInfo")
    samples = H.generate_samples(op, torch.float32, requires_grad=False, limit=MAX_SAMPLES)
    outcomes = [H.run_sample(op, s, i, torch.float32, "fused", "fwd") for i, s in enumerate(samples)]
    failed = [o for o in outcomes if o.status == "fail"]
    assert not failed, f"{len(failed)}/{len(outcomes)} samples fail: {_summary(outcomes, 'fail')}"


# error_inputs: every OpInfo's invalid inputs (opinfo_harness "error_inputs"
# section). A test per (OpInfo, mode): each ErrorInput that CPU rejects with
# its declared exception type and message must be rejected on tpu with the
# same type and a matching message (strict mode: at the sync point that
# reads the result). Fast subset: opinfo_harness.error_plan(op, full=False);
# TORCH_TPU_OPINFO_FULL=1: every ErrorInput in strict and debug mode.
def _error_cases():
    cases = []
    for op in H.op_db():
        name = H.full_name(op)
        for mode, limit in H.error_plan(op, FULL):
            cases.append(pytest.param(name, mode, limit, id=f"{name}-errors-{mode}"))
    return cases


@pytest.mark.parametrize("name,mode,limit", _error_cases())
def test_opinfo_errors(name, mode, limit):
    op = H.find_op(name)
    cases, note = H.generate_error_cases(op)
    outcomes, expected = [], []
    for case in cases[:limit] if limit is not None else cases:
        outcome = H.run_error_case(op, case, mode)
        reason = H.expected_error_failure(name, mode, case.index)
        (expected if outcome.status == "fail" and reason else outcomes).append((outcome, reason))
    failed = [o for o, _ in outcomes if o.status == "fail"]
    assert not failed, f"{len(failed)}/{len(outcomes)} error inputs fail: " + "; ".join(
        f"error input {o.sample}: [{o.category}] {o.reason}" for o in failed)
    if expected:
        pytest.xfail("; ".join(sorted({r for _, r in expected})))
    if not any(o.status == "pass" for o, _ in outcomes):
        pytest.skip("nothing to compare: " + "; ".join(o.reason for o, _ in outcomes)[:300] + (f" ({note})" if note else ""))


def test_error_harness_detects_missing_error():
    """The error_inputs harness itself: tpu returning a value where CPU
    raises is a failure, another exception type too; a match passes."""
    import types

    from torch.testing._internal.opinfo.core import SampleInput

    def fn(x, kind):
        if x.device.type == "cpu" or kind == "same":
            raise ValueError("bad input: negative size")
        if kind == "other type":
            raise TypeError("bad input: negative size")
        return x + 1

    op = types.SimpleNamespace(name="fake", variant_test_name="", op=fn)
    outcomes = {}
    for kind in ("value", "other type", "same"):
        case = H.ErrorCase(0, SampleInput(torch.ones(2), args=(kind,)), [(ValueError, "negative size")])
        outcomes[kind] = H.run_error_case(op, case, "strict")
    assert outcomes["value"].status == "fail" and outcomes["value"].category == "no error", outcomes
    assert outcomes["other type"].status == "fail" and outcomes["other type"].category == "wrong exception type"
    assert outcomes["same"].status == "pass", outcomes["same"]
    # CPU not raising as declared: the ErrorInput is skipped, not counted
    case = H.ErrorCase(0, SampleInput(torch.ones(2), args=("same",)), [(TypeError, "negative size")])
    assert H.run_error_case(op, case, "strict").status == "skip"
