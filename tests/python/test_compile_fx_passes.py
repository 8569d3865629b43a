"""Graph rewrites before lowering (torch_tpu._fx_passes): the projections of
one input (a layer's Q, K and V linears) become one dot. Values are compared
with eager PyTorch on CPU on the same inputs; the rewrites are counted
(``_fx_passes.stats``), and TORCH_TPU_FUSE_PROJECTIONS=0 turns them off."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch_tpu import _dynamo as tpu_dynamo
from torch_tpu import _fx_passes

TPU = torch.device("tpu")
# Float tolerance: the fused dot sums over K in an order of the backend's
# choosing, as each separate dot does.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Attention(nn.Module):
    """Q, K, V linears of one input (biased), a bias-free gate of the same
    input, and a linear of another input (none of the group)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, 2 * dim)
        self.gate = nn.Linear(dim, 8, bias=False)
        self.gate2 = nn.Linear(dim, 4, bias=False)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.heads
        q = self.q(x).view(b, s, h, -1).transpose(1, 2)
        k = self.k(x).view(b, s, h, -1).transpose(1, 2)
        v = self.v(x).view(b, s, h, -1).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, -1)
        return self.out(y) + self.gate(x).sum(-1, keepdim=True) * self.gate2(x).mean(-1, keepdim=True)


def _fused_delta(fn):
    before = dict(_fx_passes.stats)
    result = fn()
    return result, {k: _fx_passes.stats[k] - before[k] for k in before}


def test_qkv_forward_matches_cpu_one_program():
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        ref = model(x)
    m = copy.deepcopy(model).to(TPU)
    f = torch.compile(m, backend="tpu")
    programs = tpu_dynamo.stats["programs"]
    with torch.no_grad():
        out, delta = _fused_delta(lambda: f(x.to(TPU)).cpu())
    assert tpu_dynamo.stats["programs"] - programs == 1
    # q, k, v (biased) as one dot; gate and gate2 (no bias) as another.
    assert delta == {"fused_projections": 5, "fused_projection_groups": 2}
    torch.testing.assert_close(out, ref, **TOL)
    with torch.no_grad():  # the weights are inputs: a changed weight is seen
        m.k.weight.mul_(2)
        model.k.weight.mul_(2)
        torch.testing.assert_close(f(x.to(TPU)).cpu(), model(x), **TOL)


def test_qkv_training_matches_cpu():
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 8, 32)
    model(x).square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    m = copy.deepcopy(model).to(TPU)
    m.zero_grad()
    f = torch.compile(m, backend="tpu")
    xt = x.to(TPU)
    _, delta = _fused_delta(lambda: f(xt).square().mean().backward())
    assert delta["fused_projections"] == 5
    for (name, p), g in zip(m.named_parameters(), ref):
        torch.testing.assert_close(p.grad.cpu(), g, **TOL, msg=name)


def test_off_switch(monkeypatch):
    monkeypatch.setenv(_fx_passes.ENV, "0")
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 8, 32)
    f = torch.compile(copy.deepcopy(model).to(TPU), backend="tpu")
    with torch.no_grad():
        out, delta = _fused_delta(lambda: f(x.to(TPU)).cpu())
        torch.testing.assert_close(out, model(x), **TOL)
    assert delta == {"fused_projections": 0, "fused_projection_groups": 0}


def test_integer_and_single_projections_untouched():
    """One projection per input is left alone; int64 mm values are exact."""
    a = torch.randint(-50, 50, (6, 5))
    w1 = torch.randint(-50, 50, (7, 5))
    w2 = torch.randint(-50, 50, (3, 5))

    def fn(a, w1, w2):
        return a @ w1.t(), (a + 1) @ w2.t()

    f = torch.compile(fn, backend="tpu")
    out, delta = _fused_delta(lambda: [o.cpu() for o in f(a.to(TPU), w1.to(TPU), w2.to(TPU))])
    assert delta["fused_projections"] == 0
    for o, r in zip(out, fn(a, w1, w2)):
        assert torch.equal(o, r)


def test_integer_projections_fused_exact():
    a = torch.randint(-50, 50, (6, 5))
    w1 = torch.randint(-50, 50, (7, 5))
    w2 = torch.randint(-50, 50, (3, 5))

    def fn(a, w1, w2):
        return a @ w1.t(), a @ w2.t()

    f = torch.compile(fn, backend="tpu")
    out, delta = _fused_delta(lambda: [o.cpu() for o in f(a.to(TPU), w1.to(TPU), w2.to(TPU))])
    assert delta["fused_projections"] == 2
    for o, r in zip(out, fn(a, w1, w2)):
        assert torch.equal(o, r)
