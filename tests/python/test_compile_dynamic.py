"""torch.compile(backend="tpu") with symbolic shapes (dynamic=True,
torch._dynamo.mark_dynamic): inference graphs compile once per size bucket
(torch_tpu._dynamic), values equal the CPU eager module at every length
(bucket edges and 1 included), compiles are counted."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
import torch_tpu
from torch_tpu import _dynamic
from torch_tpu._graph import stats as graph_stats

TPU = torch.device("tpu")

# 20 sequence lengths: 1, both sides of every bucket edge (8, 16, 32, 64).
LENGTHS = [5, 1, 2, 3, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 40, 48, 63, 64, 65]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    """Pre-norm transformer block: softmax attention over the sequence dim
    (optionally causal), layer norms, GELU MLP; also returns the mean over
    the sequence."""

    def __init__(self, dim=32, heads=4, causal=False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
        if self.causal:
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, x.mean(1)


class PooledMLP(nn.Module):
    """A plain MLP per position, then reductions over the sequence dim
    (sum, mean, max, logsumexp, log_softmax): each needs its own mask."""

    def __init__(self, dim=16, hidden=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        h = self.net(x)
        return h, h.sum(1), h.mean(1), h.amax(1), torch.logsumexp(h, 1), h.log_softmax(1)


def _run(module_cpu, make_input, lengths, mark: bool, dynamic):
    """Runs the compiled tpu copy at every length, checks values against
    the CPU module, returns the compiles counted during compiled calls."""
    tpu = copy.deepcopy(module_cpu).to(TPU)
    compiled = torch.compile(tpu, backend="tpu", dynamic=dynamic)
    compiles = 0
    before = dict(_dynamic.stats)
    with torch.no_grad():
        for n in lengths:
            x = make_input(n)
            expected = module_cpu(x)
            xt = x.to(TPU)
            if mark and n > 1:
                torch._dynamo.mark_dynamic(xt, 1)
            c0 = torch_tpu.metrics()["compiles"]
            out = compiled(xt)
            compiles += torch_tpu.metrics()["compiles"] - c0
            assert len(out) == len(expected)
            for got, want in zip(out, expected):
                assert got.device.type == "tpu" and got.shape == want.shape, (n, got.shape, want.shape)
                torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5, msg=lambda m: f"length {n}: {m}")
    delta = {k: _dynamic.stats[k] - before[k] for k in before}
    return compiles, delta


def _buckets(lengths):
    return {_dynamic.bucket(n) for n in lengths if n > 1}


_FULL = pytest.mark.full_tier


# The default tier runs the causal block under mark_dynamic (~15 s); the
# other three variants (~20-35 s each) run in the full tier.
@pytest.mark.parametrize("causal,how", [
    pytest.param(True, "mark_dynamic"),
    pytest.param(False, "mark_dynamic", marks=_FULL),
    pytest.param(True, "dynamic", marks=_FULL),
    pytest.param(False, "dynamic", marks=_FULL),
])
def test_block_one_compile_per_bucket(causal, how):
    torch.manual_seed(0)
    block = Block(causal=causal).eval()
    # batch 2 (a symbol too under dynamic=True: the flattened batch x sequence
    # rows of the linears stay padded correctly)
    compiles, delta = _run(block, lambda n: torch.randn(2, n, 32), LENGTHS, how == "mark_dynamic",
                           True if how == "dynamic" else None)
    buckets = _buckets(LENGTHS)
    # Dynamo specializes length 1 into a graph of its own: static under
    # mark_dynamic, bucketed on the batch symbol under dynamic=True.
    extra = 1 if how == "dynamic" else 0
    assert delta == {"bucket_programs": len(buckets) + extra, "exact_programs": 0, "fallback_graphs": 0}
    # one program per bucket touched, plus the graph of length 1
    assert compiles <= len(buckets) + 1, compiles


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
def test_pooled_mlp_masks_every_reduction(how):
    torch.manual_seed(1)
    mlp = PooledMLP().eval()
    lengths = [6, 1, 2, 8, 9, 16, 17, 31]
    compiles, delta = _run(mlp, lambda n: torch.randn(3, n, 16) * 4, lengths, how == "mark_dynamic",
                           True if how == "dynamic" else None)
    buckets = _buckets(lengths)
    extra = 1 if how == "dynamic" else 0
    assert delta == {"bucket_programs": len(buckets) + extra, "exact_programs": 0, "fallback_graphs": 0}
    assert compiles <= len(buckets) + 1, compiles


def test_integer_reductions_exact():
    """Integer sums/max over a padded dim equal CPU exactly (padding is
    masked with each reduction's identity, including for max of negatives)."""

    def f(x):
        return x.sum(1), x.amax(1), x.amin(1), x.argmax(1), (x * 2).cumsum(1)

    compiled = torch.compile(f, backend="tpu", dynamic=True)
    before = dict(_dynamic.stats)
    for n in [3, 5, 16, 17, 29]:
        x = torch.randint(-50, -1, (2, n), dtype=torch.int64)
        for got, want in zip(compiled(x.to(TPU)), f(x)):
            assert torch.equal(got.cpu(), want), n
    assert _dynamic.stats["bucket_programs"] - before["bucket_programs"] == 2  # buckets 16 and 32
    assert _dynamic.stats["fallback_graphs"] == before["fallback_graphs"]


def test_unsupported_graph_falls_back_per_shape(capsys, monkeypatch):
    """A select from the padded dim (the last position) cannot be bucketed:
    the graph compiles per shape, values still equal CPU, the debug log
    names the node."""
    monkeypatch.setenv("TORCH_TPU_COMPILE_DEBUG", "1")

    def last(x):
        return torch.tanh(x)[:, -1] * 2

    compiled = torch.compile(last, backend="tpu", dynamic=True)
    before = dict(_dynamic.stats)
    lengths = [3, 4, 5]
    for n in lengths:
        x = torch.randn(2, n, 8)
        torch.testing.assert_close(compiled(x.to(TPU)).cpu(), last(x))
    assert _dynamic.stats["fallback_graphs"] - before["fallback_graphs"] == 1
    assert _dynamic.stats["exact_programs"] - before["exact_programs"] == len(lengths)
    assert "select" in capsys.readouterr().out


def test_bucket_sizes():
    assert [_dynamic.bucket(n) for n in (1, 2, 8, 9, 16, 17, 100)] == [16, 16, 16, 16, 16, 32, 128]


def test_bucket_env_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("TORCH_TPU_DYNAMIC_MIN_BUCKET", "zero")
    with pytest.raises(ValueError, match="TORCH_TPU_DYNAMIC_MIN_BUCKET"):
        _dynamic.bucket(3)


class ScaledNorm(nn.Module):
    """LayerNorm (its eps a float Dynamo passes as a tensor under
    dynamic=True), then a linear scaled by a Python float argument."""

    def __init__(self, dim=16):
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x, scale):
        return self.lin(self.ln(x)) * scale


_TRAIN_MODELS = {
    "layer_norm": lambda: nn.LayerNorm(16),
    "scaled_norm": ScaledNorm,
    "encoder_layer": lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
    "pooled_mlp": lambda: _First(PooledMLP()),
}


class _First(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)[2]


# the encoder layer (~55 s) runs in the full tier
@pytest.mark.parametrize("name", [pytest.param(n, marks=_FULL) if n == "encoder_layer" else n
                                  for n in _TRAIN_MODELS])
def test_training_dynamic_matches_cpu(name):
    """Training graphs under dynamic=True (AOTAutograd inside Dynamo's
    tracing context; forward and backward compiled per exact shape): a
    LayerNorm, a Python float argument that changes every call, a
    TransformerEncoderLayer; the input needs no grad (layer norm backward
    with a partial output_mask). Outputs and every gradient equal CPU's;
    no graph runs op by op."""
    torch.manual_seed(2)
    m = _TRAIN_MODELS[name]()
    tpu = copy.deepcopy(m).to(TPU)
    compiled = torch.compile(tpu, backend="tpu", dynamic=True)
    before, graphs = dict(_dynamic.stats), dict(graph_stats)
    lengths = [3, 5, 9, 5]
    for i, n in enumerate(lengths):
        x = torch.randn(2, n, 16)
        args = (x, 0.5 + i) if name == "scaled_norm" else (x,)
        m.zero_grad()
        tpu.zero_grad()
        want = m(*args)
        (want * want).sum().backward()
        got = compiled(*[a.to(TPU) if isinstance(a, torch.Tensor) else a for a in args])
        (got * got).sum().backward()
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-4, atol=1e-5)
        for (pn, p), q in zip(m.named_parameters(), tpu.parameters()):
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-4, msg=lambda s: f"{pn} at {n}: {s}")
    assert graph_stats["eager_graphs"] == graphs["eager_graphs"]
    # a forward and a backward program per distinct length
    exact = _dynamic.stats["exact_programs"] - before["exact_programs"]
    assert exact == 2 * len(set(lengths)), exact


def test_encoder_layer_fast_path_buckets():
    """nn.TransformerEncoderLayer's fused fast path (eval, no_grad:
    aten::_transformer_encoder_layer_fwd, decomposed in the graph) under
    dynamic=True: one program per bucket, values equal CPU's fast path."""
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    lengths = [5, 3, 7, 9, 12, 16, 17]
    compiles, delta = _run(_Tuple(layer), lambda n: torch.randn(2, n, 32), lengths, False, True)
    assert delta == {"bucket_programs": len(_buckets(lengths)), "exact_programs": 0, "fallback_graphs": 0}, delta


class _Tuple(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return (self.m(x),)


class SdpaBlock(nn.Module):
    """The issue-12 reviewer's block: F.layer_norm with a weight (and
    without a bias), causal scaled_dot_product_attention, a GELU MLP."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.w1, self.b1 = nn.Parameter(torch.randn(d) * 0.1 + 1), nn.Parameter(torch.randn(d) * 0.1)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.w2 = nn.Parameter(torch.randn(d) * 0.1 + 1)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(F.layer_norm(x, (d,), self.w1, self.b1)).chunk(3, -1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return (x + self.fc2(F.gelu(self.fc1(F.layer_norm(x, (d,), self.w2)))),)


def test_sdpa_block_38_lengths_one_compile_per_bucket():
    """Issue 12's report (45 compiles at 38 lengths): under no_grad no node
    is declined; the graph compiles once per bucket (8, 16, 32, 64) plus
    Dynamo's graph of length 1. (Compiles counted inside the compiled
    calls: reading a narrowed output with .cpu() compiles a per-shape copy
    in eager mode.)"""
    torch.manual_seed(4)
    lengths = list(range(1, 39))
    compiles, delta = _run(SdpaBlock().eval(), lambda n: torch.randn(2, n, 32), lengths, False, True)
    assert delta == {"bucket_programs": len(_buckets(lengths)) + 1, "exact_programs": 0, "fallback_graphs": 0}
    assert compiles == len(_buckets(lengths)) + 1, compiles


def test_float_argument_is_an_input_not_a_constant():
    """A Python float argument under dynamic=True (Dynamo passes it as a
    0-d float64 tensor) is a program input: new values at lengths of one
    bucket reuse the bucket's program and give CPU's values."""
    torch.manual_seed(5)
    lin = nn.Linear(8, 8)
    lin_t = copy.deepcopy(lin).to(TPU)

    def f(layer, x, scale):
        return layer(x) * scale + scale

    compiled = torch.compile(lambda x, scale: f(lin_t, x, scale), backend="tpu", dynamic=True)
    before, graphs = dict(_dynamic.stats), dict(graph_stats)
    with torch.no_grad():
        for n, scale in [(3, 0.5), (5, -2.25), (7, 3.0), (6, 0.5)]:
            x = torch.randn(2, n, 8)
            torch.testing.assert_close(compiled(x.to(TPU), scale).cpu(), f(lin, x, scale), rtol=1e-5, atol=1e-6)
    assert _dynamic.stats["bucket_programs"] - before["bucket_programs"] == 1  # bucket 16
    assert graph_stats["eager_graphs"] == graphs["eager_graphs"]
