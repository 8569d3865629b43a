"""Offset families (docs/design.md "Shape-polymorphic eager programs",
**offset families**): once an op has compiled OpCache::kPolyAfter (2)
programs for views that differ only in their storage offsets, one program
that reads the offsets at launch serves every offset (x[:, k] for each k).

Every expected value is CPU PyTorch's on the same inputs, compared exactly
(the programs compute the same elementwise operations; reductions here are
over bool or integer values). Compiles are counted
(torch_tpu.metrics()["compiles"]): in strict and debug mode a loop over
offsets compiles during its first few offsets (offset 0 and kPolyAfter
nonzero offsets exact, then the family's program, per op and view layout)
and nothing after them, however many offsets follow. Fused mode's region
keys and programs take every nonzero offset at launch: a loop over offsets
compiles its region once (run op by op until that program is ready).
"""
from __future__ import annotations

import pytest
import torch
import torch_tpu

TPU = torch.device("tpu", 0)
MODES = ["strict", "debug", "fused"]
OFFSETS = 40
# Offsets after which a loop compiles nothing (offset 0, two exact, the family;
# a key compiles at its second call: TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2).
WARM = 8


@pytest.fixture(params=MODES)
def mode(request):
    with torch_tpu.eager_mode(request.param):
        yield request.param


class _Steady:
    """Counts compiles after the loop's WARM-th offset (call .tick(k) each iteration)."""

    def __init__(self, mode, ops):
        # ops: the ATen calls per iteration; after WARM each runs as a program
        # (not host-served, as a key without a program is at its first call).
        self.mode, self.ops, self.start, self.iterations = mode, ops, None, 0
        self.compiles = self.executions = None

    def tick(self, k):
        if k == WARM:
            m = torch_tpu.metrics()
            self.start = (m["compiles"], m["executions"])
        if self.start is not None:
            self.iterations += 1

    def stop(self):
        """At the end of the loop (before the checks, which compile ops of their own)."""
        torch.tpu.synchronize()  # fused mode: runs what the loop left pending
        m = torch_tpu.metrics()
        self.compiles, self.executions = m["compiles"] - self.start[0], m["executions"] - self.start[1]

    def check(self):
        if self.mode == "fused":
            # The loop's region compiles in the background, its calls run
            # op by op until it is ready (single-op programs of their own,
            # as in strict mode), and the region left pending at the end is
            # one more key: bounded, not one per offset (as exact region
            # keys were: a new key per iteration, each run op by op).
            assert self.compiles < self.iterations // 2, f"{self.compiles} compiles after offset {WARM}"
            assert self.executions > 0, "no program ran"
            return
        assert self.compiles == 0, f"{self.compiles} compiles after offset {WARM}"
        assert self.executions == self.ops * self.iterations, (self.executions, self.ops, self.iterations)


def test_column_loop_reads(mode):
    """The order check of PyTorch's test_sort: two column views of one storage per call."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, OFFSETS + 1, generator=g)
    x[1, 5] = float("nan")
    x[:, 9] = x[:, 8]
    t = x.to(TPU)
    steady = _Steady(mode, ops=4)  # ne, le, bitwise_or, all
    got, want = [], []
    for k in range(1, OFFSETS + 1):
        steady.tick(k)
        a, b = t[:, k - 1], t[:, k]
        got.append(((b != b) | (a <= b)).all())
        want.append(((x[:, k] != x[:, k]) | (x[:, k - 1] <= x[:, k])).all())
    steady.stop()
    assert torch.stack(got).cpu().tolist() == torch.stack(want).tolist()
    steady.check()


def test_column_writes_and_inplace(mode):
    """copy_ into a view at each offset, then an in-place op on a narrower view."""
    y = torch.zeros(5, OFFSETS)
    t = y.to(TPU)
    # arange, mul, copy_ (setitem), add_; debug mode also clones the two written views to check them
    steady = _Steady(mode, ops={'strict': 4, 'debug': 6, 'fused': None}[mode])
    for k in range(OFFSETS):
        steady.tick(k)
        t[:, k] = torch.arange(5.0, device=TPU) * k
        y[:, k] = torch.arange(5.0) * k
        t[1:3, k].add_(1.5)
        y[1:3, k].add_(1.5)
    steady.stop()
    torch.testing.assert_close(t.cpu(), y, rtol=0, atol=0)
    steady.check()


def test_sliding_window_sums(mode):
    """A contiguous window at each offset of a 1-d storage, int64 (exact)."""
    s = torch.randint(-1000, 1000, (OFFSETS + 16,), generator=torch.Generator().manual_seed(1))
    t = s.to(TPU)
    steady = _Steady(mode, ops=1)  # sum
    got = []
    for k in range(OFFSETS):
        steady.tick(k)
        got.append(t[k:k + 7].sum())
    steady.stop()
    want = [s[k:k + 7].sum() for k in range(OFFSETS)]
    assert torch.stack(got).cpu().tolist() == torch.stack(want).tolist()
    steady.check()


def test_reinterpreted_and_complex_views(mode):
    """Views read through another element type: an int32 view of a float
    storage and the .real part of a complex storage, at each offset."""
    f = torch.randn(OFFSETS + 8, generator=torch.Generator().manual_seed(2))
    c = torch.randn(OFFSETS + 8, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    tf, tc = f.to(TPU), c.to(TPU)
    iv, tiv = f.view(torch.int32), tf.view(torch.int32)
    got, want = [], []
    for k in range(OFFSETS):
        got.append(tiv[k:k + 3] ^ 5)
        want.append(iv[k:k + 3] ^ 5)
        got.append((tc.real[k:k + 3] * 2).view(torch.int32))
        want.append((c.real[k:k + 3] * 2).view(torch.int32))
    assert torch.stack(got).cpu().tolist() == torch.stack(want).tolist()
    # writes through .imag at each offset
    for k in range(OFFSETS):
        tc.imag[k:k + 2] = float(k)
        c.imag[k:k + 2] = float(k)
    torch.testing.assert_close(tc.cpu(), c, rtol=0, atol=0)


def test_expanded_and_empty_views_at_offsets(mode):
    x = torch.randn(3, OFFSETS + 2, generator=torch.Generator().manual_seed(4))
    t = x.to(TPU)
    for k in range(OFFSETS):
        torch.testing.assert_close((t[:, k:k + 1].expand(3, 4) + 1).cpu(), x[:, k:k + 1].expand(3, 4) + 1,
                                   rtol=0, atol=0)
        assert (t[:, k:k] * 2).cpu().shape == (3, 0)


def test_family_program_serves_new_offsets_without_compiling():
    """After the family's program exists, each further offset runs it: one
    program per call, no compile (without the family each new offset's key
    would be host-served at its first call and compile at its second)."""
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(5))
    t = x.to(TPU)
    with torch_tpu.eager_mode("strict"):
        for k in range(8):
            (t[:, k] * 3).cpu()
        m0 = torch_tpu.metrics()
        for k in range(8, 200):
            torch.testing.assert_close((t[:, k] * 3).cpu(), x[:, k] * 3, rtol=0, atol=0)
        m1 = torch_tpu.metrics()
    assert m1["compiles"] == m0["compiles"]
    assert m1["executions"] - m0["executions"] == 192
