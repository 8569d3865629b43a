"""torch.compile(backend="tpu") graphs evaluate the value and index checks CPU
makes (integer division by zero, an integer tensor to a negative power,
cross_entropy targets and indices out of range): each program computes its
calls' checks as extra pred outputs, raised at the next sync point (.cpu(),
.item()) with CPU eager's exception type and the ATen op's name, in strict
and fused mode, for training graphs, symbolic (bucketed) graphs and graphs
loaded from the compile cache in another process. Valid inputs give CPU's
values exactly and run as many programs as before; a graph without checks
has no extra output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
import torch_tpu
from torch_tpu import _dynamic, _graph

from conftest import wait_for_compiles

TPU = torch.device("tpu")
MODES = ["strict", "fused"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def programs(monkeypatch):
    """The graph programs compiled in the test (torch_tpu._graph._Program)."""
    built = []
    compile_ = _graph._Program.compile

    def compile(self):
        built.append(self)
        return compile_(self)

    monkeypatch.setattr(_graph._Program, "compile", compile)
    return built


def _executions() -> int:
    return torch_tpu.metrics()["executions"]


def _cpu_error(fn, *args) -> type:
    """The exception CPU eager raises for fn(*args)."""
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.type


def _outputs(program) -> int:
    """The results of a program's compiled module (its main function's return)."""
    text = program.program.module_text
    main = text[text.index("func.func public @main"):]
    ret = main[main.index('"func.return"('):].split("\n", 1)[0]
    return ret.split(":", 1)[0].count("%")


DIVISIONS = {
    "floor_divide": lambda a, b: (a // b) * 2,
    "remainder": lambda a, b: (a % b) * 2,
    "fmod": lambda a, b: torch.fmod(a, b) * 2,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("op", sorted(DIVISIONS))
def test_integer_division_by_zero_raises_at_the_sync(op, dtype, mode, programs):
    fn = DIVISIONS[op]
    a = torch.tensor([7, -5, 9, 4], dtype=dtype)
    good = torch.tensor([2, 3, -4, 1], dtype=dtype)
    bad = torch.tensor([2, 0, -4, 1], dtype=dtype)
    error = _cpu_error(fn, a, bad)
    assert error is RuntimeError
    f = torch.compile(fn, backend="tpu")
    with torch_tpu.eager_mode(mode):
        at, gt, bt = a.to(TPU), good.to(TPU), bad.to(TPU)
        torch.tpu.synchronize()
        before = _executions()
        got = f(at, gt).cpu()
        valid_executions = _executions() - before
        assert torch.equal(got, fn(a, good))
        out = f(at, bt)  # the same shapes: the same program
        with pytest.raises(error, match=rf"{op}.*ZeroDivisionError"):
            out.cpu()
        before = _executions()
        assert torch.equal(f(at, gt).cpu(), fn(a, good))  # raised once, then valid calls compute
        assert _executions() - before == valid_executions
    assert valid_executions == 1
    assert len(programs) == 1 and len(programs[0].program.check_messages) == 1
    assert _outputs(programs[0]) == 2  # the result and one check


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_graph_check_poisons_its_results(mode):
    """The graph's results hold garbage where its check failed (XLA's
    x // 0): every later read raises the same error, also of a value computed
    from them before the sync, and of an in-place-updated input (the graph
    donates it) - never the garbage (test_value_check_poison.py for eager)."""
    a = torch.tensor([4, 5])
    b = torch.tensor([0, 1])
    assert _cpu_error(lambda: a // b) is RuntimeError

    def step(x, y, acc):
        acc.add_(x // y)  # an input mutation: written in place
        return (x // y) + 1

    f = torch.compile(step, backend="tpu")
    with torch_tpu.eager_mode(mode):
        at, bt = a.to(TPU), b.to(TPU)
        acc = torch.zeros(2, dtype=torch.int64, device=TPU)
        # Warm `* 3`'s key: with an empty disk cache its first calls are
        # host-first (docs/design.md "Host-first calls"), which download `out`
        # and so raise at the op; the device program launches without a sync.
        for _ in range(2):
            acc * 3
            torch.tpu.synchronize()  # the second call, in a new sync epoch, queues the compile
        wait_for_compiles()
        out = f(at, bt, acc)
        derived = out * 3  # launched before the sync: computed from the garbage
        for t in (out, out, derived, acc):
            with pytest.raises(RuntimeError, match="floor_divide.*ZeroDivisionError"):
                t.cpu()
        out.copy_(torch.tensor([7, 8]))  # a whole overwrite from the host clears it
        assert out.cpu().tolist() == [7, 8]


@pytest.mark.parametrize("mode", MODES)
def test_scalar_divisor_zero(mode):
    fn = lambda a: (a // 0) + 1  # noqa: E731
    a = torch.tensor([3, 4])
    assert _cpu_error(fn, a) is RuntimeError
    with torch_tpu.eager_mode(mode):
        out = torch.compile(fn, backend="tpu")(a.to(TPU))
        with pytest.raises(RuntimeError, match="floor_divide.*ZeroDivisionError"):
            out.cpu()


@pytest.mark.parametrize("mode", MODES)
def test_integer_pow_negative_exponent(mode):
    fn = lambda x, n: x ** n + 1  # noqa: E731
    x = torch.tensor([2, 3, -4])
    assert _cpu_error(fn, x, -1) is RuntimeError
    f = torch.compile(fn, backend="tpu", dynamic=True)  # the exponent a runtime value
    with torch_tpu.eager_mode(mode):
        assert torch.equal(f(x.to(TPU), 2).cpu(), fn(x, 2))
        out = f(x.to(TPU), -1)
        with pytest.raises(RuntimeError, match="pow.*Integers to negative integer powers are not allowed"):
            out.cpu()
        assert torch.equal(f(x.to(TPU), 3).cpu(), fn(x, 3))


def _classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5))


@pytest.mark.parametrize("mode", MODES)
def test_cross_entropy_target_out_of_range_forward(mode):
    model = _classifier()
    x = torch.randn(4, 6)
    good, bad = torch.tensor([0, 4, 2, 1]), torch.tensor([0, 5, 2, 1])
    fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    error = _cpu_error(fn, model, x, bad)
    assert error is IndexError
    tm = _classifier().to(TPU)
    f = torch.compile(fn, backend="tpu")
    with torch_tpu.eager_mode(mode), torch.no_grad():
        got = f(tm, x.to(TPU), good.to(TPU)).cpu()
        torch.testing.assert_close(got, fn(model, x, good).detach(), rtol=1e-5, atol=1e-6)
        out = f(tm, x.to(TPU), bad.to(TPU))
        with pytest.raises(error, match="nll_loss.*Target is out of bounds"):
            out.item()


@pytest.mark.parametrize("mode", MODES)
def test_cross_entropy_target_out_of_range_training_step(mode, programs):
    """A training step: the forward graph checks the targets, the backward
    graph runs after it, and the first sync (loss.item(), a gradient read)
    raises CPU's IndexError; a valid step's loss and gradients match CPU."""
    model = _classifier()
    tm = _classifier().to(TPU)
    x = torch.randn(4, 6)
    good, bad = torch.tensor([0, 4, 2, 1]), torch.tensor([-3, 1, 2, 1])
    fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    error = _cpu_error(fn, model, x, bad)
    assert error is IndexError
    f = torch.compile(fn, backend="tpu")
    with torch_tpu.eager_mode(mode):
        loss = f(tm, x.to(TPU), good.to(TPU))
        loss.backward()
        want = fn(model, x, good)
        want.backward()
        torch.testing.assert_close(loss.item(), want.item(), rtol=1e-5, atol=1e-6)
        for p, q in zip(tm.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)
        tm.zero_grad()
        loss = f(tm, x.to(TPU), bad.to(TPU))
        loss.backward()
        with pytest.raises(error, match="nll_loss.*Target is out of bounds"):
            tm[0].weight.grad.cpu()
    kinds = [p.name for p in programs]
    assert any("forward" in k for k in kinds) and any("backward" in k for k in kinds), kinds


@pytest.mark.parametrize("mode", MODES)
def test_index_out_of_range(mode):
    fn = lambda x, i: x[i] * 2  # noqa: E731
    x = torch.arange(12.0).reshape(4, 3)
    good, bad = torch.tensor([3, -4, 0]), torch.tensor([3, 4, 0])
    error = _cpu_error(fn, x, bad)
    assert error is IndexError
    f = torch.compile(fn, backend="tpu")
    with torch_tpu.eager_mode(mode):
        assert torch.equal(f(x.to(TPU), good.to(TPU)).cpu(), fn(x, good))
        out = f(x.to(TPU), bad.to(TPU))
        with pytest.raises(error, match="index.*out of range"):
            out.cpu()


@pytest.mark.parametrize("mode", MODES)
def test_embedding_index_out_of_range(mode):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    temb = nn.Embedding(10, 4).to(TPU)
    temb.load_state_dict(emb.state_dict())
    good, bad = torch.tensor([[1, 9], [0, 3]]), torch.tensor([[1, 10], [0, 3]])
    error = _cpu_error(emb, bad)
    assert error is IndexError
    f = torch.compile(temb, backend="tpu")
    with torch_tpu.eager_mode(mode), torch.no_grad():
        assert torch.equal(f(good.to(TPU)).cpu(), emb(good))
        out = f(bad.to(TPU))
        with pytest.raises(error, match="embedding.*out of range"):
            out.cpu()


def test_a_graph_without_checks_is_unchanged(programs):
    """Float division checks nothing: no extra output, one execution."""
    fn = DIVISIONS["floor_divide"]
    a, b = torch.tensor([7.0, -5.0]), torch.tensor([2.0, 0.0])
    f = torch.compile(fn, backend="tpu")
    with torch_tpu.eager_mode("strict"):
        at, bt = a.to(TPU), b.to(TPU)
        torch.tpu.synchronize()
        before = _executions()
        got = f(at, bt).cpu()
        assert _executions() - before == 1
    torch.testing.assert_close(got, fn(a, b), equal_nan=True)
    assert len(programs) == 1
    assert programs[0].program.check_messages == []
    assert _outputs(programs[0]) == 1


def test_fused_region_holding_the_graph_raises(programs):
    """Fused mode: the graph's launch is one call of the region around it
    (eager ops before and after); the region computes the graph's check."""
    fn = DIVISIONS["remainder"]
    f = torch.compile(fn, backend="tpu")
    a, bad, good = torch.tensor([5, 6, 7]), torch.tensor([1, 0, 2]), torch.tensor([1, 4, 2])
    with torch_tpu.eager_mode("fused"):
        at, bt, gt = a.to(TPU), bad.to(TPU), good.to(TPU)
        # Two good calls written as the checked one: the first compiles the
        # graph (Dynamo's compile holds its inputs and outputs meanwhile, so
        # other storages are alive at the flush: another region key); the
        # second is the checked region's first sight (its calls run as strict
        # calls while it compiles in the background where the disk cache
        # lacks it), then metrics() waits for that compile.
        for _ in range(2):
            warm = f(at + 1, gt) - 1
            assert torch.equal(warm.cpu(), fn(a + 1, good) - 1)
        regions = torch_tpu.metrics()["fused_regions"]
        out = f(at + 1, bt) - 1  # eager add, the graph, eager sub: one region
        with pytest.raises(RuntimeError, match="remainder.*ZeroDivisionError"):
            out.cpu()
        assert torch_tpu.metrics()["fused_regions"] - regions == 1
        torch.tpu.synchronize()  # raised once: a later sync point does not raise it again
        assert torch.equal((f(at + 1, gt) - 1).cpu(), fn(a + 1, good) - 1)


def _bucketed_calls():
    return _dynamic.stats["bucket_programs"], _dynamic.stats["exact_programs"]


def test_dynamic_division_checks_real_rows_only(programs):
    """dynamic=True buckets the inference graph (padded rows hold zeros);
    the divisor's padded rows are masked, so only a real zero raises.
    (floor_divide itself is not on the bucketing whitelist: per shape.)"""
    fn = lambda a, b: (a % b) + torch.fmod(a, b) + torch.div(a, b, rounding_mode="floor")  # noqa: E731
    f = torch.compile(fn, backend="tpu", dynamic=True)
    bucket0, exact0 = _bucketed_calls()
    with torch.no_grad():
        for n in (5, 6, 17):
            a = torch.arange(1, n + 1)
            b = torch.arange(n) % 3 + 1
            assert torch.equal(f(a.to(TPU), b.to(TPU)).cpu(), fn(a, b)), n
        b = torch.tensor([1, 2, 0, 1, 1, 3])
        assert _cpu_error(fn, torch.arange(6), b) is RuntimeError
        out = f(torch.arange(6).to(TPU), b.to(TPU))
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            out.cpu()
    bucket, exact = _bucketed_calls()
    assert exact == exact0 and bucket - bucket0 == 2  # buckets 16 and 32, no exact program


class _Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(20, 4)
        self.pos = nn.Embedding(10, 4)

    def forward(self, ids):
        positions = torch.cumsum(torch.ones_like(ids), 0) - 1  # 0, 1, ... (past the length in padding)
        return self.tok(ids) + self.pos(positions)


def test_dynamic_positions_past_the_table_are_padding():
    """Positions 0..n-1 (a cumsum of ones) into a position table of 10
    rows: at length 9 the bucket (16) computes positions up to 15 in its
    padded rows, which must not fail the embedding's check; length 11 is a real
    out-of-range position (CPU's IndexError)."""
    torch.manual_seed(0)
    model = _Positions()
    tm = _Positions().to(TPU)
    tm.load_state_dict(model.state_dict())
    f = torch.compile(tm, backend="tpu", dynamic=True)
    bucket0, exact0 = _bucketed_calls()
    with torch.no_grad():
        for n in (3, 9, 10):
            ids = torch.arange(n) % 20
            torch.testing.assert_close(f(ids.to(TPU)).cpu(), model(ids), rtol=0, atol=0)
        ids = torch.arange(11)
        error = _cpu_error(model, ids)
        assert error is IndexError
        out = f(ids.to(TPU))
        with pytest.raises(error, match="embedding.*out of range"):
            out.cpu()
    bucket, exact = _bucketed_calls()
    assert exact == exact0 and bucket > bucket0


def test_dynamic_graph_with_an_unmasked_check_compiles_per_shape():
    """cross_entropy in a symbolic inference graph: nll_loss is not on the
    bucketing whitelist (per shape anyway), values and the check exact."""
    fn = lambda x, y: F.cross_entropy(x, y)  # noqa: E731
    f = torch.compile(fn, backend="tpu", dynamic=True)
    with torch.no_grad():
        for n in (3, 5):
            x, y = torch.randn(n, 4), torch.arange(n) % 4
            torch.testing.assert_close(f(x.to(TPU), y.to(TPU)).cpu(), fn(x, y), rtol=1e-5, atol=1e-6)
        x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 4, 0])
        assert _cpu_error(fn, x, y) is IndexError
        out = f(x.to(TPU), y.to(TPU))
        with pytest.raises(IndexError, match="Target is out of bounds"):
            out.item()


WARM_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch, torch_tpu
    import torch.nn.functional as F

    def step(x, w, y, a, b):
        return F.cross_entropy(x @ w, y), (a // b) * 2

    result = {}
    f = torch.compile(step, backend="tpu")
    x, w = torch.randn(4, 6), torch.randn(6, 5)
    y, a = torch.tensor([0, 4, 2, 1]), torch.tensor([7, -5, 9, 4])
    tpu = lambda t: t.to("tpu")
    with torch.no_grad():
        loss, q = f(tpu(x), tpu(w), tpu(y), tpu(a), tpu(torch.tensor([2, 3, -4, 1])))
        want = step(x, w, y, a, torch.tensor([2, 3, -4, 1]))
        result["loss_err"] = abs(loss.item() - want[0].item())
        result["quotient_equal"] = bool(torch.equal(q.cpu(), want[1]))
        for name, yy, bb in (("zero", y, torch.tensor([2, 0, -4, 1])), ("target", torch.tensor([0, 5, 2, 1]), torch.tensor([1, 1, 1, 1]))):
            try:
                loss, q = f(tpu(x), tpu(w), tpu(yy), tpu(a), tpu(bb))
                q.cpu(), loss.item()
                result[name] = "no error"
            except Exception as e:
                result[name] = [type(e).__name__, str(e)]
    result["traced"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    print("RESULT " + json.dumps(result))
''')


def _run_warm(tmp_path, cache):
    script = tmp_path / "checks_script.py"
    script.write_text(WARM_SCRIPT)
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(cache))
    env.pop("TORCH_TPU_COMPILE_CACHE", None)
    env.pop("TORCH_TPU_COMPILE_CACHE_DIR", None)  # the store under `cache`
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_warm_compile_cache_load_keeps_the_checks(tmp_path):
    """A second process loads the saved program (nothing traced) and its
    checks still raise CPU's errors naming the op."""
    cache = tmp_path / "cache"
    for run in ("cold", "warm"):
        got = _run_warm(tmp_path, cache)
        assert got["loss_err"] <= 1e-5 and got["quotient_equal"], (run, got)
        assert got["zero"][0] == "RuntimeError" and "floor_divide" in got["zero"][1] \
            and "ZeroDivisionError" in got["zero"][1], (run, got)
        assert got["target"][0] == "IndexError" and "nll_loss" in got["target"][1], (run, got)
        if run == "cold":
            assert got["traced"] >= 1, got
        else:
            assert got["traced"] == 0, got  # loaded from the compile cache
