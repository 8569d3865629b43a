"""NN lowerings (csrc/lowering/nn.cpp) against CPU PyTorch: softmax and
log_softmax (+backward), layer norm, batch norm, dropout, nll_loss/
cross_entropy, mse_loss, embedding backward.

float32 is compared with assert_close defaults, bfloat16 with an explicit
tolerance. Each test checks that none of these ops ran through the CPU
fallback (except where a known runtime limitation is named).
"""

import pytest
import torch
import torch.nn.functional as F
import torch_tpu

from conftest import family_helpers

TPU = torch.device("tpu")
BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)
OURS = set("""
_softmax _log_softmax _softmax_backward_data _log_softmax_backward_data
native_layer_norm native_layer_norm_backward native_batch_norm _native_batch_norm_legit
_native_batch_norm_legit_no_training native_batch_norm_backward native_dropout
native_dropout_backward nll_loss_forward nll_loss_backward mse_loss mse_loss_backward
embedding_dense_backward
""".split())
UNDEFINED_RETURN_ISSUE = ("the executor cannot return the undefined tensors that output_mask=False "
                          "leaves (native_layer_norm_backward/native_batch_norm_backward run on the CPU)")


no_fallback, tpu, check = family_helpers(OURS, BF16_TOL)


def run_both(fn, *args, **tol):
    expected = fn(*args)
    with no_fallback():
        actual = fn(*[tpu(a) for a in args])
    check(actual, expected, **tol)
    return actual


def grads_both(fn, *args, names=OURS, **tol):
    """Forward + backward on CPU and tpu; compares outputs and the grads of
    every floating argument."""
    cpu_args = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
    out_c = fn(*cpu_args)
    out_c.backward(torch.ones_like(out_c) if out_c.dim() else None)
    tpu_args = [tpu(a).requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else tpu(a)
                for a in args]
    with no_fallback(names):
        out_t = fn(*tpu_args)
        out_t.backward(torch.ones_like(out_t) if out_t.dim() else None)
    check(out_t, out_c.detach(), **tol)
    for c, t in zip(cpu_args, tpu_args):
        if isinstance(c, torch.Tensor) and c.requires_grad:
            check(t.grad, c.grad, **tol)


def ramp(like, n):
    """0, 1, ..., n-1 (a weighting that makes gradients non-trivial) on like's device."""
    return torch.arange(n, dtype=like.dtype).to(like.device)


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


# --- softmax ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_log_softmax(dtype, dim):
    x = make((4, 5, 6), dtype) * 3
    run_both(lambda a: torch.softmax(a, dim), x)
    run_both(lambda a: torch.log_softmax(a, dim), x)


def test_softmax_special_values():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[0.0, -inf, 1.0], [-inf] * 3, [1e30, 1e30, -1e30], [nan, 1.0, 2.0], [3.0, nan, -inf],
                      [inf, 1.0, -inf], [inf, inf, 0.0], [nan] * 3])
    run_both(lambda a: torch.softmax(a, 1), x)
    run_both(lambda a: torch.log_softmax(a, 1), x)
    run_both(lambda a: torch.softmax(a, 0), torch.tensor(2.0))


def test_softmax_dtype_arg_and_noncontiguous():
    x = make((5, 4), torch.bfloat16)
    run_both(lambda a: torch.softmax(a, 1, dtype=torch.float32), x)
    run_both(lambda a: torch.log_softmax(a.t(), 1), make((5, 4)))
    out = torch.empty(5, 4, device=TPU)
    with no_fallback():
        torch._softmax(tpu(make((5, 4))), 1, False, out=out)
    check(out, torch._softmax(make((5, 4)), 1, False))


@pytest.mark.parametrize("fn", [lambda a: (torch.softmax(a, -1) * ramp(a, 6)).sum(),
                                lambda a: (torch.log_softmax(a, 0) * ramp(a, 6)).sum()],
                         ids=["softmax", "log_softmax"])
def test_softmax_backward(fn):
    grads_both(lambda a: fn(a), make((4, 6)))


def test_softmax_backward_bf16():
    g, y = make((3, 7), torch.bfloat16, 1), torch.softmax(make((3, 7), torch.bfloat16), 1)
    run_both(lambda g, y: torch._softmax_backward_data(g, y, 1, torch.bfloat16), g, y)
    run_both(lambda g, y: torch._log_softmax_backward_data(g, y, 1, torch.bfloat16), g, torch.log_softmax(y.float(), 1).bfloat16())


# --- layer norm -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalized", [(6,), (5, 6)])
def test_layer_norm(dtype, normalized):
    x = make((3, 5, 6), dtype) * 2 + 1
    w, b = make(normalized, dtype, 1), make(normalized, dtype, 2)
    run_both(lambda a, w, b: F.layer_norm(a, normalized, w, b, 1e-5), x, w, b)
    run_both(lambda a: F.layer_norm(a, normalized), x)
    expected = torch.native_layer_norm(x, normalized, w, b, 1e-3)
    with no_fallback():
        actual = torch.native_layer_norm(tpu(x), normalized, tpu(w), tpu(b), 1e-3)
    check(actual[0], expected[0])
    # mean/rstd: the meta kernel (which decides the tpu dtype) says float32 for
    # bf16 input where the CPU kernel returns bf16; compare the values.
    for a, e in zip(actual[1:], expected[1:]):
        torch.testing.assert_close(a.cpu().to(e.dtype), e, **(BF16_TOL if dtype == torch.bfloat16 else {}))


def test_layer_norm_backward():
    x, w, b = make((4, 3, 8)), make((8,), seed=1), make((8,), seed=2)
    grads_both(lambda a, w, b: (F.layer_norm(a, (8,), w, b) * ramp(a, 8)).sum(), x, w, b)
    grads_both(lambda a, w, b: F.layer_norm(a, (3, 8), w.expand(3, 8), b.expand(3, 8)).pow(2).sum(), x, w, b)


def test_layer_norm_backward_bf16():
    x, w, b = make((4, 8), torch.bfloat16), make((8,), torch.bfloat16, 1), make((8,), torch.bfloat16, 2)
    grads_both(lambda a, w, b: (F.layer_norm(a, (8,), w, b) * ramp(a, 8)).sum(), x, w, b, atol=5e-2, rtol=5e-2)


def test_layer_norm_backward_partial_mask():
    # output_mask [True, False, False]: correct, but currently runs on the CPU
    # (UNDEFINED_RETURN_ISSUE); only the result is checked here.
    x = make((4, 8))
    grads_both(lambda a: (F.layer_norm(a, (8,)) * ramp(a, 8)).sum(), x,
               names=OURS - {"native_layer_norm_backward"})


# --- batch norm -------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (2, 3, 4, 4)])
def test_batch_norm_train_updates_running_stats(shape):
    x, w, b = make(shape) * 2 + 0.5, make((3,), seed=1), make((3,), seed=2)
    rm, rv = torch.zeros(3), torch.ones(3)
    rmt, rvt = tpu(rm), tpu(rv)
    expected = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2)
    with no_fallback():
        actual = F.batch_norm(tpu(x), rmt, rvt, tpu(w), tpu(b), training=True, momentum=0.2)
    check(actual, expected)
    check(rmt, rm)
    check(rvt, rv)


def test_batch_norm_eval_and_backward():
    x, w, b = make((4, 3, 5)), make((3,), seed=1), make((3,), seed=2)
    rm, rv = make((3,), seed=3), make((3,), seed=4).abs() + 0.5
    run_both(lambda a, rm, rv, w, b: F.batch_norm(a, rm, rv, w, b, training=False), x, rm, rv, w, b)
    grads_both(lambda a, w, b: (F.batch_norm(a, None, None, w, b, training=True) * ramp(a, 5)).sum(), x, w, b)
    bn = torch.nn.BatchNorm1d(3)
    bnt = torch.nn.BatchNorm1d(3).to(TPU)
    grads_both(lambda a: bn(a).pow(2).sum() if a.device.type == "cpu" else bnt(a).pow(2).sum(), x)


# --- dropout ----------------------------------------------------------------------

def test_dropout_statistics_and_scale():
    x = torch.ones(200, 500, device=TPU)
    with no_fallback():
        y = F.dropout(x, 0.3, training=True).cpu()
    kept = y != 0
    frac = kept.float().mean().item()
    assert abs(frac - 0.7) < 0.01, frac
    torch.testing.assert_close(y[kept], torch.full((int(kept.sum()),), 1 / 0.7))


def test_dropout_mask_and_backward_agree():
    x = make((50, 40)).to(TPU).requires_grad_()
    with no_fallback():
        out, mask = torch.native_dropout(x, 0.4, True)
        out.backward(torch.ones_like(out))
    assert mask.dtype == torch.bool
    m = mask.cpu()
    torch.testing.assert_close(out.detach().cpu(), x.detach().cpu() * m / 0.6)
    torch.testing.assert_close(x.grad.cpu(), m.float() / 0.6)
    with no_fallback():
        g = torch.ops.aten.native_dropout_backward(tpu(torch.ones(50, 40)), mask, 2.0)
    torch.testing.assert_close(g.cpu(), m.float() * 2.0)


def test_dropout_eval_p0_p1_and_bf16():
    x = make((8, 9))
    run_both(lambda a: F.dropout(a, 0.5, training=False), x)
    with no_fallback():
        y1 = torch.native_dropout(tpu(x), 1.0, True)
        y0 = torch.native_dropout(tpu(x), 0.0, True)
        yb = F.dropout(tpu(x).bfloat16(), 0.5, training=True)
    assert (y1[0].cpu() == 0).all() and not y1[1].cpu().any()
    torch.testing.assert_close(y0[0].cpu(), x)
    assert yb.dtype == torch.bfloat16
    kept = yb.cpu() != 0
    torch.testing.assert_close(yb.cpu()[kept], (x.bfloat16() * 2)[kept])


def test_dropout_differs_between_calls():
    x = torch.ones(1000, device=TPU)
    with no_fallback():
        a = F.dropout(x, 0.5).cpu()
        b = F.dropout(x, 0.5).cpu()
    assert not torch.equal(a, b)


# --- losses -----------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss(reduction, weighted):
    x = torch.log_softmax(make((6, 5)), 1)
    t = torch.tensor([0, 4, 2, -100, 1, 4])
    w = make((5,), seed=3).abs() if weighted else None
    run_both(lambda a, t, w: F.nll_loss(a, t, w, reduction=reduction), x, t, w)
    grads_both(lambda a: (F.nll_loss(a, tpu(t) if a.is_floating_point() and a.device.type == "tpu" else t,
                                     tpu(w) if w is not None and a.device.type == "tpu" else w,
                                     reduction=reduction) * 1.5).sum(), x)


def test_nll_loss_1d_ignore_all_and_custom_ignore():
    x = torch.log_softmax(make((5,)), 0)
    run_both(lambda a, t: F.nll_loss(a, t), x, torch.tensor(3))
    xs = torch.log_softmax(make((3, 4)), 1)
    run_both(lambda a, t: F.nll_loss(a, t), xs, torch.tensor([-100, -100, -100]))  # NaN like CPU
    run_both(lambda a, t: F.nll_loss(a, t, ignore_index=2), xs, torch.tensor([2, 1, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy(dtype):
    x, t = make((8, 10), dtype) * 3, torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(1))
    run_both(lambda a, t: F.cross_entropy(a, t), x, t)
    run_both(lambda a, t: F.cross_entropy(a, t, label_smoothing=0.1), x, t)
    if dtype == torch.float32:
        grads_both(lambda a: F.cross_entropy(a, t if a.device.type == "cpu" else tpu(t)), x)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(2, 5, 7), (2, 5, 3, 4)])
def test_cross_entropy_spatial(reduction, shape):
    # (N, C, d...) inputs reach nll_loss2d_forward/backward
    x = make(shape) * 2
    t = torch.randint(0, shape[1], (shape[0],) + shape[2:], generator=torch.Generator().manual_seed(2))
    t[0, 0] = -100
    w = make((shape[1],), seed=4).abs()
    run_both(lambda a, t, w: F.cross_entropy(a, t, w, reduction=reduction), x, t, w)
    grads_both(lambda a: (F.cross_entropy(a, t if a.device.type == "cpu" else tpu(t),
                                          reduction=reduction) * 1.5).sum(), x)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(reduction):
    x, y = make((4, 5)), make((4, 5), seed=1)
    run_both(lambda a, b: F.mse_loss(a, b, reduction=reduction), x, y)
    grads_both(lambda a, b: F.mse_loss(a, b, reduction=reduction).sum(), x, y)


# --- embedding backward ------------------------------------------------------------

@pytest.mark.parametrize("padding_idx,scale", [(None, False), (2, False), (None, True), (0, True)])
def test_embedding_backward(padding_idx, scale):
    w = make((10, 4))
    idx = torch.tensor([[1, 2, 2, 9], [0, 2, 5, 1]])
    g = make((2, 4, 4), seed=5)
    wc = w.clone().requires_grad_()
    F.embedding(idx, wc, padding_idx=padding_idx, scale_grad_by_freq=scale).backward(g)
    wt = tpu(w).requires_grad_()
    with no_fallback():
        out = F.embedding(tpu(idx), wt, padding_idx=padding_idx, scale_grad_by_freq=scale)
        out.backward(tpu(g))
    check(out.detach(), F.embedding(idx, w, padding_idx=padding_idx))
    check(wt.grad, wc.grad)


def test_embedding_dense_backward_bf16():
    g = make((6, 3), torch.bfloat16)
    idx = torch.tensor([0, 1, 1, 3, 3, 3])
    run_both(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 5, -1, False), g, idx)


# --- integration: a tiny BERT-like encoder, one training step -------------------------

class _TinyEncoder(torch.nn.Module):
    def __init__(self, vocab=40, dim=16, seq=6, classes=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = torch.nn.Embedding(seq, dim)
        self.ln0 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.o = torch.nn.Linear(dim, dim)
        self.ln1 = torch.nn.LayerNorm(dim)
        self.ff = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.ln2 = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, ids, mask):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.ln0(self.emb(ids) + self.pos(pos)[None])
        q, k, v = self.qkv(h).chunk(3, -1)
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        s = s.masked_fill(~mask[:, None, :], -1e9)
        h = self.ln1(h + self.o(torch.softmax(s, -1) @ v))
        h = self.ln2(h + self.ff(h))
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def test_tiny_encoder_training_step_matches_cpu():
    torch.manual_seed(0)
    model = _TinyEncoder()
    model_t = _TinyEncoder().to(TPU)
    model_t.load_state_dict(model.state_dict())
    ids = torch.randint(1, 40, (3, 6))
    ids[0, -2:] = 0
    mask = ids != 0
    y = torch.tensor([0, 2, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(model_t.parameters(), lr=1e-2)
    for _ in range(2):
        loss = F.cross_entropy(model(ids, mask), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with no_fallback(OURS | {"mm", "addmm", "bmm", "sum", "mean", "index_select", "cat", "arange"}):
            loss_t = F.cross_entropy(model_t(tpu(ids), tpu(mask)), tpu(y))
            opt_t.zero_grad()
            loss_t.backward()
            opt_t.step()
        torch.testing.assert_close(loss_t.cpu(), loss.detach())
    for (name, p), p_t in zip(model.named_parameters(), model_t.parameters()):
        torch.testing.assert_close(p_t.grad.cpu(), p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


# --- glu, logsigmoid, prelu, binary_cross_entropy (issue 3) -------------------
# Any CPU fallback fails these tests (conftest.no_cpu_fallback); float32
# gradients use rtol=1e-5 atol=5e-5 (backward chains several ops).

from conftest import no_cpu_fallback  # noqa: E402

GRAD_TOL = dict(rtol=1e-5, atol=5e-5)


def _both_with_grads(fn, args, dtype, grad_tol=None, grad_args=None):
    """fn on CPU and tpu copies of args (floating args, or those at the
    positions grad_args, require grad); compares outputs and, for float32, the
    input gradients for fixed output grads."""
    want_grad = dtype == torch.float32
    cpu_args = [a.to(dtype).clone().requires_grad_(want_grad and (grad_args is None or i in grad_args))
                if isinstance(a, torch.Tensor) and a.is_floating_point() else a for i, a in enumerate(args)]
    tpu_args = [tpu(a.detach()).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                for a in cpu_args]
    out_c = fn(*cpu_args)
    with no_cpu_fallback():
        out_t = fn(*tpu_args)
    check(out_t, out_c.detach())
    if want_grad:
        g = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(5))
        leaves_c = [a for a in cpu_args if isinstance(a, torch.Tensor) and a.requires_grad]
        leaves_t = [a for a in tpu_args if isinstance(a, torch.Tensor) and a.requires_grad]
        gc = torch.autograd.grad(out_c, leaves_c, g)
        with no_cpu_fallback():
            gt = torch.autograd.grad(out_t, leaves_t, tpu(g))
        for a, e in zip(gt, gc):
            check(a, e, **(grad_tol or GRAD_TOL))


def _rand(shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_glu(dtype, dim):
    _both_with_grads(lambda x: F.glu(x, dim), [_rand((4, 6, 8), scale=3)], dtype)


def test_glu_out_and_errors():
    x = _rand((4, 6))
    out = torch.empty(4, 3, device=TPU)
    with no_cpu_fallback():
        torch._C._nn.glu(tpu(x), -1, out=out)
    check(out, F.glu(x))
    with pytest.raises(RuntimeError, match="even"):
        F.glu(tpu(_rand((4, 5))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logsigmoid(dtype):
    x = _rand((5, 7), scale=10)
    x[0, :4] = torch.tensor([0.0, 100.0, -100.0, -30.0])
    _both_with_grads(F.logsigmoid, [x], dtype)


def test_logsigmoid_forward_buffer_and_inplace_module():
    x = _rand((3, 4), scale=4)
    out_c, buf_c = torch.ops.aten.log_sigmoid_forward(x)
    with no_cpu_fallback():
        out_t, buf_t = torch.ops.aten.log_sigmoid_forward(tpu(x))
    check(out_t, out_c)
    check(buf_t, buf_c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wshape", [(1,), (6,)])
def test_prelu(dtype, wshape):
    w = torch.rand(wshape, generator=torch.Generator().manual_seed(3)) * 0.5
    _both_with_grads(F.prelu, [_rand((4, 6, 5), scale=2), w], dtype)


def test_prelu_unbatched_scalar_input():
    _both_with_grads(F.prelu, [_rand((6,)), torch.tensor([0.25])], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_binary_cross_entropy(dtype, reduction, weighted):
    g = torch.Generator().manual_seed(7)
    p = torch.rand(4, 6, generator=g).clamp(0.02, 0.98)
    p[0, :2] = torch.tensor([0.0, 1.0])  # log clamped at -100
    y = torch.rand(4, 6, generator=g)
    w = torch.rand(4, 6, generator=g)
    args = [p, y] + ([w] if weighted else [])
    fn = (lambda p, y, w: F.binary_cross_entropy(p, y, w, reduction=reduction)) if weighted else \
        (lambda p, y: F.binary_cross_entropy(p, y, reduction=reduction))
    # gradient w.r.t. p at p in {0, 1} divides by max(p (1 - p), 1e-12): huge
    # but equal values; relative tolerance covers them.
    _both_with_grads(fn, args, dtype, grad_args={0, 1})


def test_binary_cross_entropy_out():
    p = torch.rand(5).clamp(0.1, 0.9)
    y = torch.rand(5)
    out = torch.empty((), device=TPU)
    with no_cpu_fallback():
        torch._C._nn.binary_cross_entropy(tpu(p), tpu(y), None, 2, out=out)
    check(out, F.binary_cross_entropy(p, y, reduction="sum"))


# ---------------------------------------------------------------------------
# smooth_l1_loss / huber_loss (+backward)

def _loss_inputs():
    x = _rand((4, 6), seed=3, scale=2)
    y = _rand((4, 6), seed=4, scale=2)
    # differences exactly at +-beta / +-delta (0.5) and 0
    x[0, :4] = torch.tensor([1.0, 1.0, 2.0, -1.0])
    y[0, :4] = torch.tensor([0.5, 1.5, 2.0, -0.5])
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("kind,param", [("smooth_l1", 1.0), ("smooth_l1", 0.5), ("smooth_l1", 0.0),
                                        ("huber", 1.0), ("huber", 0.5)])
def test_smooth_l1_and_huber(kind, param, reduction, dtype):
    x, y = _loss_inputs()
    if kind == "smooth_l1":
        fn = lambda x, y: F.smooth_l1_loss(x, y, reduction=reduction, beta=param)  # noqa: E731
    else:
        fn = lambda x, y: F.huber_loss(x, y, reduction=reduction, delta=param)  # noqa: E731
    _both_with_grads(fn, [x, y], dtype)


@pytest.mark.parametrize("name", ["smooth_l1_loss", "huber_loss"])
def test_smooth_l1_huber_backward_ops_out_and_errors(name):
    x, y = _loss_inputs()
    g = _rand((4, 6), seed=6)
    param = 0.5
    for reduction in (0, 1, 2):
        gout = g if reduction == 0 else g[0, 0]
        bw = getattr(torch.ops.aten, name + "_backward")
        expected = bw(gout, x, y, reduction, param)
        with no_cpu_fallback():
            actual = bw(tpu(gout), tpu(x), tpu(y), reduction, param)
        check(actual, expected)
    out = torch.empty((), device=TPU)
    with no_cpu_fallback():
        getattr(torch._C._nn, name)(tpu(x), tpu(y), 2, param, out=out)
    check(out, getattr(torch._C._nn, name)(x, y, 2, param))
    # broadcasting target (CPU warns and broadcasts)
    with no_cpu_fallback():
        r = getattr(torch._C._nn, name)(tpu(x), tpu(y[0]), 0, param)
    check(r, getattr(torch._C._nn, name)(x, y[0], 0, param))
    bad = -1.0 if name == "smooth_l1_loss" else 0.0
    with pytest.raises(RuntimeError, match="beta" if name == "smooth_l1_loss" else "delta"):
        getattr(torch._C._nn, name)(tpu(x), tpu(y), 1, bad)


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_binary_cross_entropy_input_outside_unit_interval_raises_like_cpu(bad):
    x, y = torch.tensor([bad, 0.5]), torch.tensor([1.0, 0.0])
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        torch.nn.functional.binary_cross_entropy(x, y)
    # a value check on the device: raised at the next sync point
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        torch.nn.functional.binary_cross_entropy(x.to("tpu"), y.to("tpu")).cpu()
    ok = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(torch.nn.functional.binary_cross_entropy(ok.to("tpu"), y.to("tpu")).cpu(),
                               torch.nn.functional.binary_cross_entropy(ok, y))


_A = torch.ops.aten


@pytest.mark.parametrize(
    "name,call",
    [
        # CPU's kernels allocate the result like `self` (zeros_like / empty(input.options())),
        # where the meta kernels (decompositions) promote: LoweringTraits::result_dtype_of.
        ("mse_loss_backward", lambda f, s, t, w: _A.mse_loss_backward(f, s, t, 1)),
        ("smooth_l1_loss_backward", lambda f, s, t, w: _A.smooth_l1_loss_backward(f, s, t, 1, 1.0)),
        ("binary_cross_entropy", lambda f, s, t, w: _A.binary_cross_entropy(s, t, w, 1)),
    ],
)
def test_mixed_dtype_loss_ops_give_cpus_result_dtype(name, call):
    """A bf16 `self` with float operands: the result is BFloat16 on CPU. The
    first calls are host-served (CPU's kernel) and the later ones run the
    device program; every call must have CPU's dtype and values (bf16
    tolerance), and none may raise the host-first mismatch error."""
    g = torch.Generator().manual_seed(0)
    f = torch.rand(4, 4, generator=g)
    s = torch.rand(4, 4, generator=g).to(torch.bfloat16)
    t = torch.rand(4, 4, generator=g).to(torch.bfloat16 if name == "binary_cross_entropy" else torch.float32)
    w = torch.rand(4, 4, generator=g)
    want = call(f, s, t, w)
    assert want.dtype == torch.bfloat16
    for _ in range(4):
        got = call(f.tpu(), s.tpu(), t.tpu(), w.tpu())
        torch_tpu.metrics()  # waits for the background compile: the next call runs the program
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got.cpu(), want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("param", ["none", "same", "float32"])
def test_native_layer_norm_stats_dtype_is_cpus(dtype, param):
    """CPU's native_layer_norm gives mean/rstd the input's dtype unless
    weight/bias have another (then float): host-served first calls and the
    device program must both give CPU's dtypes and values."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, generator=g).to(dtype)
    pd = {"none": None, "same": dtype, "float32": torch.float32}[param]
    w = None if pd is None else torch.randn(4, generator=g).to(pd)
    b = None if pd is None else torch.randn(4, generator=g).to(pd)
    want = _A.native_layer_norm(x, [4], w, b, 1e-5)
    on = lambda t: None if t is None else t.tpu()  # noqa: E731
    for _ in range(4):
        got = _A.native_layer_norm(x.tpu(), [4], on(w), on(b), 1e-5)
        torch_tpu.metrics()
        for gi, wi in zip(got, want):
            assert gi.dtype == wi.dtype
            tol = 1e-5 if wi.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(gi.cpu(), wi, rtol=tol, atol=tol)
