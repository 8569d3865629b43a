"""Eager modes (strict, debug), their switches, and the executable cache."""
from __future__ import annotations

import pytest
import torch
import torch_tpu

from conftest import run_python, wait_for_compiles


def test_default_mode_is_strict():
    assert torch_tpu.get_eager_mode() == "strict"


def test_set_and_context_manager():
    torch_tpu.set_eager_mode("debug")
    try:
        assert torch_tpu.get_eager_mode() == "debug"
    finally:
        torch_tpu.set_eager_mode("strict")
    with torch_tpu.eager_mode("debug"):
        assert torch_tpu.get_eager_mode() == "debug"
    assert torch_tpu.get_eager_mode() == "strict"
    with pytest.raises(ValueError, match="fused|unknown"):
        torch_tpu.set_eager_mode("nonsense")


def test_context_manager_restores_the_mode_when_the_flush_raises(tmp_path):
    """Leaving ``eager_mode("fused")`` flushes the recorded region; when that raises the
    error propagates AND the previous mode is back (CI, session 24: a region that failed
    left the process in fused mode and five later tests failed); entering a block whose
    switch raises leaves the mode from before the block. Here the region's first
    run is op by op (its program compiles in the background: a fresh process and an empty
    cache directory, so no program serves it yet) and CPU's index_select kernel raises on
    the out-of-range index, as CPU PyTorch does."""
    code = """
import pytest, torch, torch_tpu
x = torch.arange(13.0).to("tpu")
bad = torch.tensor([2, 99, 5]).to("tpu")
with pytest.raises(IndexError, match="index out of range"):
    with torch_tpu.eager_mode("fused"):
        torch.index_select(x, 0, bad)  # recorded; runs when the block ends
        assert torch_tpu._C._fused_region_size() == 1
assert torch_tpu.get_eager_mode() == "strict", torch_tpu.get_eager_mode()
assert (x[:3] + 1).cpu().tolist() == [1.0, 2.0, 3.0]
# Entering a block: the flush of the switch raises, the mode before the block is back.
torch_tpu.set_eager_mode("fused")
torch.index_select(torch.arange(11.0).to("tpu"), 0, bad)  # another key: runs op by op too
with pytest.raises(IndexError, match="index out of range"):
    with torch_tpu.eager_mode("debug"):
        pass
assert torch_tpu.get_eager_mode() == "fused", torch_tpu.get_eager_mode()
torch_tpu.set_eager_mode("strict")
print("ok")
"""
    r = run_python(code, env={"TORCH_TPU_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok"


@pytest.mark.parametrize("env,expected", [
    ({"TORCH_TPU_EAGER_MODE": "debug"}, "debug"),
    ({"TORCH_TPU_EAGER_MODE": "strict"}, "strict"),
    ({"TPU_LAUNCH_BLOCKING": "1"}, "debug"),
])
def test_mode_from_environment(env, expected):
    r = run_python("import torch_tpu; print(torch_tpu.get_eager_mode())", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


@pytest.mark.parametrize("mode", ["strict", "debug"])
def test_modes_give_cpu_values(mode):
    x = torch.randn(8, 16)
    w = torch.randn(16, 4)
    with torch_tpu.eager_mode(mode):
        y = torch.softmax(torch.tanh(x.to("tpu") @ w.to("tpu")) * 2 + 1, dim=-1)
        got = y.cpu()
    torch.testing.assert_close(got, torch.softmax(torch.tanh(x @ w) * 2 + 1, dim=-1))


def test_debug_nan_names_op_and_line():
    x = torch.tensor([1.0, -1.0], device="tpu")
    with torch_tpu.eager_mode("debug"):
        with pytest.raises(RuntimeError) as info:
            torch.log(x)  # log(-1) = NaN
    msg = str(info.value)
    assert "aten::log" in msg and "NaN" in msg
    assert "test_modes.py" in msg  # the user's source line


def test_debug_inf_names_op():
    x = torch.tensor([1.0, 0.0], device="tpu")
    with torch_tpu.eager_mode("debug"):
        with pytest.raises(RuntimeError, match="aten::div.*Inf"):
            torch.ones(2, device="tpu") / x


def test_debug_allows_non_finite_values_taken_from_inputs():
    # -inf masks and data that already holds NaN are not errors: only values
    # an op produces from finite inputs are.
    with torch_tpu.eager_mode("debug"):
        scores = torch.zeros(2, 3, device="tpu")
        scores.masked_fill_(torch.tensor([[True, False, False]] * 2, device="tpu"), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        nan_data = torch.tensor([1.0, float("nan")], device="tpu")
        doubled = nan_data * 2
    torch.testing.assert_close(probs.cpu(), torch.tensor([[0.0, 0.5, 0.5]] * 2))
    assert torch.isnan(doubled.cpu()[1])


def test_debug_allows_nan_from_infinite_inputs():
    # softmax over a row that is all -inf gives NaN on CPU too (inf - inf):
    # the inputs were not finite, so debug mode must not raise.
    scores = torch.zeros(2, 3)
    scores[0] = float("-inf")
    inf_minus_inf = torch.tensor([float("inf"), 1.0])
    with torch_tpu.eager_mode("debug"):
        probs = torch.softmax(scores.to("tpu"), dim=-1)
        diff = inf_minus_inf.to("tpu") - inf_minus_inf.to("tpu")
    torch.testing.assert_close(probs.cpu(), torch.softmax(scores, dim=-1), equal_nan=True)
    torch.testing.assert_close(diff.cpu(), inf_minus_inf - inf_minus_inf, equal_nan=True)


def test_strict_nan_is_a_value_like_cpu():
    x = torch.tensor([1.0, -1.0])
    torch.testing.assert_close(torch.log(x.to("tpu")).cpu(), torch.log(x), equal_nan=True)


@pytest.mark.parametrize("call", [
    lambda w, i: torch.index_select(w, 0, i),
    lambda w, i: torch.nn.functional.embedding(i, w),
    lambda w, i: torch.gather(w, 0, i.unsqueeze(1).expand(-1, 3)),
    lambda w, i: w[i],
], ids=["index_select", "embedding", "gather", "index"])
def test_debug_index_out_of_range_raises_index_error(call, request):
    w = torch.randn(5, 3, device="tpu")
    bad = torch.tensor([0, 7], device="tpu")
    # CPU raises IndexError, except gather/scatter: RuntimeError
    error = RuntimeError if "gather" in request.node.name else IndexError
    with torch_tpu.eager_mode("debug"):
        with pytest.raises(error, match="out of bounds|out of range"):
            call(w, bad).cpu()
        ok = torch.tensor([0, 4, 2], device="tpu")
        torch.testing.assert_close(call(w, ok).cpu(), call(w.cpu(), ok.cpu()))


def test_debug_negative_index_rules_match_cpu():
    w = torch.randn(5, 3)
    i = torch.tensor([-1, 2])
    with torch_tpu.eager_mode("debug"):
        torch.testing.assert_close(w.to("tpu")[i.to("tpu")].cpu(), w[i])  # advanced indexing wraps
        with pytest.raises(IndexError):
            torch.index_select(w.to("tpu"), 0, i.to("tpu"))  # CPU rejects negative indices here


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("call", [
    lambda w, i: torch.index_select(w, 0, i),
    lambda w, i: torch.nn.functional.embedding(i, w),
    lambda w, i: torch.gather(w, 0, i.unsqueeze(1).expand(-1, 3)),
    lambda w, i: w[i],
    lambda w, i: w.index_put((i,), torch.zeros(2, 3, device=w.device)),
], ids=["index_select", "embedding", "gather", "index", "index_put"])
def test_out_of_range_index_raises_at_sync_point(mode, call, request):
    # XLA clamps out-of-range gathers; PyTorch raises: the program computes a
    # range check and the next sync point raises IndexError naming the op
    # (RuntimeError for gather/scatter, as CPU raises).
    w = torch.randn(5, 3, device="tpu")
    bad = torch.tensor([0, 7], device="tpu")
    error = RuntimeError if "gather" in request.node.name else IndexError
    ok = torch.tensor([0, 4], device="tpu")
    with torch_tpu.eager_mode(mode):
        for _ in range(2):  # strict: a key's first two calls run CPU's kernel (raising at the op)
            torch.testing.assert_close(call(w, ok).cpu(), call(w.cpu(), ok.cpu()))
        wait_for_compiles()  # the second call queued the compile: the bad call runs the program
        result = call(w, bad)
        with pytest.raises(error, match="aten::.*out of range"):
            result.cpu()
        torch.testing.assert_close(call(w, ok).cpu(), call(w.cpu(), ok.cpu()))


def test_repeated_op_hits_cache_and_scalars_do_not_recompile():
    x = torch.randn(32, device="tpu")
    y = torch.randn(32, device="tpu")
    torch.add(x, y, alpha=0.5).cpu()
    before = torch_tpu.metrics()
    for alpha in (0.1, 0.2, 0.3, 0.4):
        x.add_(y, alpha=alpha)        # alpha changes: a runtime input, not a new program
        x.mul_(1.0 + alpha)
    x.cpu()
    after = torch_tpu.metrics()
    assert after["compiles"] - before["compiles"] <= 2  # add_ and mul_ once each at most
    assert after["cache_hits"] - before["cache_hits"] >= 6
    ref = torch.randn(32)
    assert ref.shape == x.shape


# Buffer donation: an in-place write reuses its input buffer (the executable
# aliases the storage's parameter to its new value) when no one else holds
# that buffer; values always equal CPU's.

def _donated(fn):
    torch.tpu.synchronize()
    before = torch_tpu.metrics()["donated_buffers"]
    fn()
    torch.tpu.synchronize()
    return torch_tpu.metrics()["donated_buffers"] - before


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
def test_inplace_write_donates_its_buffer(mode):
    x_cpu = torch.randn(1000)
    y_cpu = torch.randn(1000)
    with torch_tpu.eager_mode(mode):
        x, y = x_cpu.to("tpu"), y_cpu.to("tpu")
        ref = x_cpu.clone()

        def update():
            x.mul_(2).add_(y, alpha=0.5)
            ref.mul_(2).add_(y_cpu, alpha=0.5)
        for _ in range(2):  # strict: a key's first two calls run CPU's kernel (nothing donated)
            update()
            torch.tpu.synchronize()  # the second call in a new sync epoch queues the compile
        wait_for_compiles()  # the second call queued the compiles: the next runs the programs
        if mode == "debug":  # keeps every input buffer to check the op's NaN/Inf against its inputs
            assert _donated(update) == 0
        else:
            assert _donated(update) >= 1
        torch.testing.assert_close(x.cpu(), ref)
        torch.testing.assert_close(y.cpu(), y_cpu)  # read, not donated


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_donation_keeps_values_other_tensors_still_need(mode):
    x_cpu = torch.randn(64, 64)
    with torch_tpu.eager_mode(mode):
        x = x_cpu.to("tpu")
        before = x * 3          # reads x's buffer (possibly still running)
        view = x[8:16]
        clone = x.clone()
        x.add_(1)               # replaces x's buffer
        view.mul_(0)            # a write through a view updates x's storage
        clone.sub_(2)
        expected = x_cpu + 1
        expected[8:16] = 0
        torch.testing.assert_close(before.cpu(), x_cpu * 3)
        torch.testing.assert_close(x.cpu(), expected)
        torch.testing.assert_close(view.cpu(), torch.zeros(8, 64))
        torch.testing.assert_close(clone.cpu(), x_cpu - 2)


def test_optimizer_step_donates_parameters_and_states():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    ref = torch.nn.Linear(32, 8)
    ref.load_state_dict(model.state_dict())
    model = model.to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(16, 32)
    for m, o, inp in ((model, opt, x.to("tpu")), (ref, ref_opt, x)):
        for step in range(4):
            o.zero_grad()
            m(inp).square().mean().backward()
            if m is model and step >= 2:
                # Steps 1 and 2 warm the programs (strict: a key's first two
                # calls run CPU's kernel, donating nothing; the second queues
                # its compile, only when it falls in a later sync epoch than
                # the first, hence the synchronize below); from step 3 on the
                # programs run.
                wait_for_compiles()  # a compile still queued under load would run CPU's kernel
                assert _donated(o.step) >= 4  # 2 parameters and their exp_avg, exp_avg_sq at least
            else:
                o.step()
                if m is model:
                    torch.tpu.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
