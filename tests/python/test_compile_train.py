"""Training with torch.compile(model, backend="tpu") in every eager mode
(strict, debug, fused), the optimizer outside the graph: losses AND every
parameter's gradient at every step against the same training on CPU.

The step is the one users write: ``zero_grad(set_to_none=True); loss =
cross_entropy(f(x), y); loss.backward(); opt.step()``, first with a
``loss.item()`` after each step, then several steps with no sync in between
(their losses and gradients are kept on the device and compared at the end).
In fused mode the optimizer's in-place parameter updates are still recorded
when the next compiled forward reads the parameters: the graph must see the
updated values (before the fix it read the old buffers, and after a donation
freed ones: a segmentation fault).

Tolerances: float32; losses within 1e-5 relative, gradients within 1e-5
absolute + 1e-4 relative (the tpu's matmuls/reductions sum in another order
than CPU's; AdamW's division by sqrt(v) amplifies rounding after a few
steps).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
import torch_tpu

from conftest import run_python

TPU = torch.device("tpu")
MODES = ["strict", "debug", "fused"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 10))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _mlp_loss(f, batch):
    x, y = batch
    return F.cross_entropy(f(x), y)


def _lm_loss(f, batch):
    (ids,) = batch
    return f(input_ids=ids, labels=ids).loss


def _train(model, loss_fn, batch, steps_synced=3, steps_unsynced=5, compile=False):
    """Losses and {name: grad} per step (CPU copies), AdamW outside the graph."""
    f = torch.compile(model, backend="tpu") if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01,
                            foreach=None if compile else False)
    losses, grads = [], []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(f, batch)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        return loss

    for _ in range(steps_synced):
        loss = step()
        losses.append(loss.item())
    pending = [step() for _ in range(steps_unsynced)]
    losses += [l.item() for l in pending]
    return losses, [{n: g.cpu() for n, g in gs.items()} for gs in grads]


def _compare(model_fn, loss_fn, batch_fn, mode, tie=False):
    cpu_model = model_fn()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    if tie:
        # Module.to() keeps each Parameter object (docs/design.md,
        # "Parameter identity across moves"), so the tie survives the move.
        assert tpu_model.lm_head.weight is tpu_model.transformer.wte.weight
    batch = batch_fn()
    expected_losses, expected_grads = _train(cpu_model, loss_fn, batch)
    with torch_tpu.eager_mode(mode):
        losses, grads = _train(tpu_model, loss_fn, [t.to(TPU) for t in batch], compile=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    assert len(grads) == len(expected_grads)
    for step, (got, want) in enumerate(zip(grads, expected_grads)):
        assert got.keys() == want.keys(), f"step {step}: parameters with gradients differ"
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"step {step}, grad of {name}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_compiled_mlp_training_matches_cpu(mode):
    def batch():
        g = torch.Generator().manual_seed(1)
        return [torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)]

    _compare(_mlp, _mlp_loss, batch, mode)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_gpt2_training_matches_cpu(mode):
    def batch():
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, 96, (2, 16), generator=g)]

    _compare(_gpt2, _lm_loss, batch, mode, tie=True)


def test_compiled_mlp_inputs_made_on_device_fused():
    """The reported crash: inputs made on the device (torch.randn(...,
    device="tpu")), fused mode, three synced steps then five unsynced."""
    model = _mlp()
    ref = copy.deepcopy(model)
    model = model.to(TPU)
    with torch_tpu.eager_mode("fused"):
        torch.manual_seed(3)
        x = torch.randn(16, 32, device=TPU)
        y = torch.randint(0, 10, (16,), device=TPU)
        losses, _ = _train(model, _mlp_loss, [x, y], compile=True)
    expected, _ = _train(ref, _mlp_loss, [x.cpu(), y.cpu()])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


def test_compiled_norms_without_bias_or_affine_stay_one_program():
    """LayerNorm(bias=False) and BatchNorm1d(affine=False): their backward's
    output_mask leaves returns undefined; the backward graph must still be
    one program (it ran op by op before) with CPU's gradients."""
    import warnings

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64, bias=False), nn.GELU(),
                             nn.BatchNorm1d(64, affine=False), nn.Linear(64, 10))

    def batch():
        g = torch.Generator().manual_seed(1)
        return [torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compare(model, _mlp_loss, batch, "strict")
    op_by_op = [str(w.message) for w in caught if "runs op by op" in str(w.message)]
    assert not op_by_op, op_by_op


@pytest.mark.parametrize("max_ops", ["1", "512"])
def test_graph_input_whose_buffer_a_bucket_program_swapped_after_recording(tmp_path, max_ops):
    """CI failure (session 24): the MLP above in fused mode raised "Executable expected
    parameter 7 of size 2560 but got buffer with incompatible size 4096", and a Hugging Face
    generate() "graph ... input 3 changed layout before the region ran". A graph call's
    input storage was checked (FeedsAsIs) while it held its exact buffer; then the calls
    writing it ran op by op and a bucket program (rows 10 -> 16) left its canonical buffer
    there. TORCH_TPU_FUSED_MAX_OPS=1: every region holds one call, so the mul_ region is
    flushed (op by op: its program compiles in the background) after f's check, and the
    graph's region key (graph uid, storage numbers) matched a program declared for the
    exact buffer. 512: [mul_, graph] is one region run op by op, and the graph's launch
    refused x. Now a graph call's key holds its inputs' buffer sizes (keyed after the
    flush), the region's parameter declares that buffer (a launch finding another resizes
    it), and the graph's own launch resizes a buffer of another capacity. mul_
    has a compiled bucket-16 program on [n, 8] (two exact lengths, then 12). Values equal
    CPU's exactly (x * 2 + 1 rounds once). An empty cache directory: a region program
    found on disk compiles at once, and the mul_ region would then not run op by op."""
    code = """
import torch, torch_tpu
def same(a, b):
    torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
f = torch.compile(lambda a: a * 2 + 1, backend="tpu")
x_cpu = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
x = x_cpu.to("tpu")
torch_tpu.set_eager_mode("fused")
for _ in range(4):  # the region [graph(x)] compiles for x's exact buffer
    y = f(x)
    torch.tpu.synchronize()
    torch_tpu.metrics()
same(y, x_cpu * 2 + 1)
regions = torch_tpu.metrics()["fused_regions"]
torch_tpu.set_eager_mode("strict")
for n in (20, 24, 12, 12):  # mul_'s exact programs, then its bucket-16 program
    t = torch.ones(n, 8).to("tpu")
    t.mul_(1.0)
    t.cpu()
    torch_tpu.metrics()
torch_tpu.set_eager_mode("fused")
x.mul_(3.0)  # run op by op after f's FeedsAsIs: x gets the bucket program's [16, 8] buffer
y = f(x)
same(y, x_cpu * 3.0 * 2 + 1)
assert torch_tpu._C._storage_buffer_numel(x) == 16 * 8, torch_tpu._C._storage_buffer_numel(x)
same(x, x_cpu * 3.0)
for _ in range(3):  # x keeps the bucket's buffer: the graph's region for it, compiled, equals CPU too
    y = f(x)
    torch.tpu.synchronize()
    torch_tpu.metrics()
same(y, x_cpu * 3.0 * 2 + 1)
assert torch_tpu.metrics()["fused_regions"] > regions
print("ok")
"""
    r = run_python(code, env={"TORCH_TPU_FUSED_MAX_OPS": max_ops, "TORCH_TPU_CACHE_DIR": str(tmp_path)},
                   timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
