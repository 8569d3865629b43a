"""Random lowerings (csrc/lowering/random.cpp): uniform_, normal, bernoulli,
random_, exponential_ and what reaches them (rand, randn, randint,
rand_like, dropout masks).

The tpu streams are not PyTorch's CPU streams, so the tests check what a
user relies on: reproducibility under a seed, different values on successive
calls, bounds, dtypes and shapes, and the first two moments within a
statistical tolerance (1e5 samples: ~5 standard errors). Each test checks
that none of these ops ran through the CPU fallback.
"""
import contextlib
import math

import pytest
import torch
import torch_tpu

TPU = torch.device("tpu")
OURS = {"uniform", "normal", "bernoulli", "random", "exponential", "multinomial", "randperm"}
N = 100_000


def _base(op_name):
    name = op_name.split("::")[-1].split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


@contextlib.contextmanager
def no_fallback(names=OURS):
    before = dict(torch_tpu.metrics()["cpu_fallbacks"])
    yield
    after = torch_tpu.metrics()["cpu_fallbacks"]
    new = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    ours = {k: v for k, v in new.items() if _base(k) in names}
    assert not ours, f"ops fell back to the CPU: {ours}"


def moments_ok(x, mean, std, k=5.0):
    x = x.double()
    n = x.numel()
    m, s = x.mean().item(), x.std().item()
    assert abs(m - mean) < k * std / math.sqrt(n) + 1e-12, (m, mean)
    # the standard error of the sample std is about std / sqrt(2n)
    assert abs(s - std) < k * std / math.sqrt(2 * n) * 2 + 1e-12, (s, std)


# --- reproducibility -----------------------------------------------------------------

def test_tpu_manual_seed_reproduces():
    with no_fallback():
        torch.tpu.manual_seed(1234)
        a1, b1 = torch.rand(64, device=TPU).cpu(), torch.randn(64, device=TPU).cpu()
        torch.tpu.manual_seed(1234)
        a2, b2 = torch.rand(64, device=TPU).cpu(), torch.randn(64, device=TPU).cpu()
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert not torch.equal(a1, b1)


def test_seed_all_like_cuda():
    """torch.tpu.seed_all, as torch.cuda.seed_all: one fresh random seed on
    every device; seeding with initial_seed() replays the draws."""
    torch.tpu.manual_seed_all(7)
    torch.tpu.seed_all()
    seed = torch.tpu.initial_seed()
    assert seed != 7
    a = torch.rand(16, device=TPU).cpu()
    torch.tpu.manual_seed(seed)
    assert torch.equal(torch.rand(16, device=TPU).cpu(), a)
    torch.tpu.seed_all()
    assert torch.tpu.initial_seed() != seed  # a 64-bit random seed: equal with probability 2**-64


def test_torch_manual_seed_reproduces():
    torch.manual_seed(0)
    a = torch.rand(16, device=TPU).cpu()
    torch.manual_seed(0)
    b = torch.rand(16, device=TPU).cpu()
    assert torch.equal(a, b)


def test_generator_argument():
    g1 = torch.Generator(device=TPU).manual_seed(7)
    g2 = torch.Generator(device=TPU).manual_seed(7)
    with no_fallback():
        a = torch.rand(32, device=TPU, generator=g1).cpu()
        b = torch.rand(32, device=TPU, generator=g2).cpu()
        c = torch.rand(32, device=TPU, generator=g1).cpu()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("make", [
    lambda: torch.rand(1000, device=TPU),
    lambda: torch.randn(1000, device=TPU),
    lambda: torch.randint(0, 1 << 30, (1000,), device=TPU),
    lambda: torch.empty(1000, device=TPU).bernoulli_(0.5),
    lambda: torch.empty(1000, device=TPU).exponential_(),
], ids=["rand", "randn", "randint", "bernoulli", "exponential"])
def test_successive_calls_differ(make):
    with no_fallback():
        a, b = make().cpu(), make().cpu()
    assert not torch.equal(a, b)


# --- uniform ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rand_bounds_and_moments(dtype):
    with no_fallback():
        x = torch.rand(N, device=TPU, dtype=dtype)
    assert x.dtype == dtype and x.shape == (N,)
    x = x.cpu()
    assert (x >= 0).all() and (x <= 1).all()
    if dtype != torch.bfloat16:
        assert (x < 1).all()
    moments_ok(x, 0.5, math.sqrt(1 / 12), k=6 if dtype == torch.bfloat16 else 5)


def test_uniform_range_inplace_and_like():
    t = torch.zeros(300, 400, device=TPU)
    with no_fallback():
        r = t.uniform_(-3.0, 5.0)
        like = torch.rand_like(t)
    assert r is t
    x = t.cpu()
    assert (x >= -3).all() and (x < 5).all()
    moments_ok(x, 1.0, 8 / math.sqrt(12))
    assert like.shape == t.shape and like.device.type == "tpu"


def test_uniform_into_view():
    base = torch.zeros(10, 10, device=TPU)
    with no_fallback():
        base[:, 2:5].uniform_()
    x = base.cpu()
    assert (x[:, :2] == 0).all() and (x[:, 5:] == 0).all()
    assert (x[:, 2:5] > 0).any()


# --- normal ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_randn_moments(dtype):
    with no_fallback():
        x = torch.randn(N, device=TPU, dtype=dtype)
    assert x.dtype == dtype
    x = x.cpu()
    assert torch.isfinite(x).all()
    moments_ok(x, 0.0, 1.0, k=6 if dtype == torch.bfloat16 else 5)
    # tails: about 0.27% beyond 3 sigma
    frac = (x.double().abs() > 3).double().mean().item()
    assert 0.0015 < frac < 0.004, frac


def test_normal_overloads():
    mean = torch.linspace(-5, 5, 10).repeat(10_000).to(TPU)
    std = torch.full((100_000,), 2.0, device=TPU)
    with no_fallback():
        a = torch.normal(mean, 0.5)
        b = torch.normal(3.0, std)
        c = torch.normal(mean, std)
        d = torch.normal(1.0, 2.0, size=(N,), device=TPU)
        e = torch.empty(N, device=TPU).normal_(-2.0, 0.1)
    moments_ok((a - mean).cpu(), 0.0, 0.5)
    moments_ok(b.cpu(), 3.0, 2.0)
    moments_ok((c - mean).cpu(), 0.0, 2.0)
    moments_ok(d.cpu(), 1.0, 2.0)
    moments_ok(e.cpu(), -2.0, 0.1)


def test_nn_init():
    w = torch.empty(256, 512, device=TPU)
    with no_fallback():
        torch.nn.init.normal_(w, std=0.02)
        torch.nn.init.trunc_normal_(w, std=0.02)
        torch.nn.init.xavier_uniform_(w)
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    bound = 1 / math.sqrt(512)
    x = w.cpu()
    assert (x.abs() <= bound).all()


# --- bernoulli -------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_bernoulli_scalar_p(p):
    with no_fallback():
        x = torch.empty(N, device=TPU).bernoulli_(p).cpu()
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    mean = x.mean().item()
    assert abs(mean - p) < 5 * math.sqrt(p * (1 - p) / N) + 1e-12, mean


def test_bernoulli_tensor_p_and_functional():
    p = torch.tensor([0.0, 0.25, 0.9, 1.0]).repeat(25_000).to(TPU)
    with no_fallback():
        x = torch.bernoulli(p)
        y = torch.empty(N, dtype=torch.bool, device=TPU).bernoulli_(p)
        z = torch.bernoulli(torch.zeros(N, device=TPU), 0.3)
    assert x.dtype == torch.float32 and y.dtype == torch.bool
    for r in (x.cpu().float(), y.cpu().float()):
        r = r.view(-1, 4)
        assert r[:, 0].sum() == 0 and r[:, 3].sum() == 25_000
        assert abs(r[:, 1].mean().item() - 0.25) < 0.015
        assert abs(r[:, 2].mean().item() - 0.9) < 0.01
    assert abs(z.cpu().mean().item() - 0.3) < 0.01


# --- random_ / randint -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32])
def test_randint_bounds(dtype):
    with no_fallback():
        x = torch.randint(-3 if dtype != torch.uint8 else 3, 9, (N,), device=TPU, dtype=dtype).cpu()
    lo = -3 if dtype != torch.uint8 else 3
    assert x.dtype == dtype
    assert x.min().item() == lo and x.max().item() == 8
    counts = torch.bincount((x.long() - lo).flatten())
    expected = N / (9 - lo)
    assert (counts.double() - expected).abs().max() < 6 * math.sqrt(expected)


def test_random_defaults():
    with no_fallback():
        a = torch.empty(N, dtype=torch.int64, device=TPU).random_().cpu()
        b = torch.empty(N, dtype=torch.float32, device=TPU).random_().cpu()
        c = torch.empty(N, dtype=torch.bool, device=TPU).random_().cpu()
        d = torch.empty(N, dtype=torch.int64, device=TPU).random_(10).cpu()
        e = torch.empty(N, dtype=torch.int64, device=TPU).random_(-(2 ** 40), 2 ** 40).cpu()
    assert a.min() >= 0 and a.double().mean() > 2.0 ** 61
    assert b.min() >= 0 and b.max() <= 2 ** 24 and (b == b.round()).all()
    assert 0.45 < c.float().mean() < 0.55
    assert d.min() == 0 and d.max() == 9
    assert e.min() >= -(2 ** 40) and e.max() < 2 ** 40 and (e < 0).any() and (e > 2 ** 39).any()


# --- exponential -------------------------------------------------------------------------

@pytest.mark.parametrize("lambd", [1.0, 4.0])
def test_exponential(lambd):
    with no_fallback():
        x = torch.empty(N, device=TPU).exponential_(lambd).cpu()
    assert (x >= 0).all() and torch.isfinite(x).all()
    moments_ok(x, 1 / lambd, 1 / lambd, k=6)


# --- dropout through the generator ---------------------------------------------------------

def test_dropout_reproducible_under_seed():
    x = torch.ones(4096, device=TPU)
    torch.tpu.manual_seed(3)
    a = torch.nn.functional.dropout(x, 0.5).cpu()
    torch.tpu.manual_seed(3)
    b = torch.nn.functional.dropout(x, 0.5).cpu()
    assert torch.equal(a, b)


# --- generator state while a fused region is recorded -----------------------------

def _offset(state):
    return state[8:].view(torch.int64).item()


def _state_sequence():
    """Random calls between reads and writes of the generator's state, no sync point in
    between: what each draws, and the offsets read."""
    torch.tpu.manual_seed(7)
    a = torch.rand(24, device=TPU)
    recorded = torch_tpu._C._fused_region_size()  # fused mode: the draw is recorded, not run
    state = torch.tpu.get_rng_state()
    b = torch.nn.functional.dropout(torch.ones(40, device=TPU), 0.5)
    torch.tpu.set_rng_state(state)
    c = torch.nn.functional.dropout(torch.ones(40, device=TPU), 0.5)
    offset_c = _offset(torch.tpu.get_rng_state())
    torch.tpu.manual_seed(7)
    d = torch.rand(24, device=TPU)
    return [_offset(state), offset_c], [t.cpu() for t in (a, b, c, d)], recorded


def test_rng_state_accounts_for_recorded_draws():
    """Fused mode records random calls, which draw their (seed, offset) when the region
    runs; reading or writing the generator's state (get/set_rng_state, manual_seed) runs the
    region first, so the state holds every draw made before it, as in strict mode and on
    CUDA. Before: the offset read after a recorded rand was 0, restoring that state and
    drawing again gave another dropout mask, and a manual_seed after a recorded call
    changed its values. Both modes draw the same values (exact), and offsets advance by the
    element count (24; 40 -> 64)."""
    with torch_tpu.eager_mode("strict"):
        strict_offsets, strict_values, _ = _state_sequence()
    with torch_tpu.eager_mode("fused"):
        fused_offsets, fused_values, recorded = _state_sequence()
    assert recorded >= 1  # the state read had a recorded draw to run first
    assert strict_offsets == [24, 64]
    assert fused_offsets == strict_offsets
    a, b, c, d = fused_values
    assert torch.equal(b, c) and torch.equal(a, d)
    for got, want in zip(fused_values, strict_values):
        assert torch.equal(got, want)


def test_state_read_after_a_seed_before_the_runtime_with_a_recorded_draw():
    """torch.manual_seed before the runtime exists keeps the seed for the default generators'
    creation; that creation happens at the first random call, and a state read (here after
    a recorded rand, fused mode) ran the region from inside it: a deadlock (review, session
    25). Fresh process, bounded by a timeout; the values equal strict mode's for the seed."""
    import os
    import subprocess
    import sys
    code = """
import torch, torch_tpu
torch.manual_seed(5)
torch_tpu.set_eager_mode("fused")
a = torch.rand(8, device="tpu")
state = torch.tpu.get_rng_state()
print(state[8:].view(torch.int64).item())
torch_tpu.set_eager_mode("strict")
torch.manual_seed(5)
print(torch.equal(a.cpu(), torch.rand(8, device="tpu").cpu()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["8", "True"], out.stdout


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_checkpoint_recompute_draws_the_forward_dropout_mask(mode):
    """torch.utils.checkpoint saves the tpu RNG state before the forward and restores it for
    the recompute in backward (torch.tpu.get/set_rng_state), where torch.tpu._initialized
    is true (it was missing: no mode restored the state). In fused mode the forward's
    dropout was also still recorded when the state was restored. Either way the recompute
    drew another mask: gradients silently differed from the same step without
    checkpointing. Compared: the same seeded step with and without checkpoint; float32
    within 1e-6."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to(TPU)
    x_cpu = torch.randn(8, 16)

    def block(x):
        return torch.nn.functional.dropout(lin(x).relu(), 0.5, training=True) * 3

    results = []
    with torch_tpu.eager_mode(mode):
        for use_checkpoint in (False, True):
            lin.zero_grad(set_to_none=True)
            x = x_cpu.to(TPU).requires_grad_()
            torch.tpu.manual_seed(11)
            y = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
            (y * y).sum().backward()
            results.append([y.detach().cpu(), x.grad.cpu(), lin.weight.grad.cpu()])
    for plain, ckpt in zip(*results):
        torch.testing.assert_close(ckpt, plain, rtol=1e-6, atol=1e-6)
    assert (results[0][0] == 0).any() and (results[0][0] != 0).any()  # dropout dropped some


# --- multinomial ------------------------------------------------------------------

@pytest.mark.parametrize("replacement", [True, False])
def test_multinomial_frequencies_match_weights(replacement):
    # Unnormalised weights with a zero category: it is never drawn; the first
    # draw (with or without replacement) picks i with probability w_i / sum(w).
    w = torch.tensor([1.0, 0.0, 6.0, 3.0])
    p = (w / w.sum()).double()
    torch.manual_seed(3)
    with no_fallback():
        if replacement:
            s = torch.multinomial(w.to(TPU), N, replacement=True)
        else:
            s = torch.multinomial(w.to(TPU).expand(N // 10, 4).contiguous(), 3)
    assert s.device.type == "tpu" and s.dtype == torch.int64
    s = s.cpu()
    first = s if replacement else s[:, 0]
    freq = torch.bincount(first.flatten(), minlength=4).double() / first.numel()
    se = torch.sqrt(p * (1 - p) / first.numel())
    assert torch.all((freq - p).abs() <= 5 * se + 1e-12), (freq, p)
    assert freq[1] == 0
    if not replacement:
        # three distinct categories per row, never the zero-weight one
        assert torch.all(s.sort(dim=1).values == torch.tensor([0, 2, 3]))


def test_multinomial_shapes_seed_and_independent_calls():
    weights = torch.rand(3, 50) + 0.1
    for k, repl in [(4, True), (50, False), (1, False)]:
        torch.manual_seed(0)
        a = torch.multinomial(weights.to(TPU), k, replacement=repl).cpu()
        torch.manual_seed(0)
        b = torch.multinomial(weights.to(TPU), k, replacement=repl).cpu()
        assert a.shape == torch.multinomial(weights, k, replacement=repl).shape
        assert torch.equal(a, b)  # reproducible under a seed
        assert a.min() >= 0 and a.max() < 50
    # Successive one-sample draws from a uniform distribution: independent
    # (the op draws 1000 values per call but its output has one element).
    torch.manual_seed(1)
    with no_fallback():
        draws = torch.cat([torch.multinomial(torch.ones(1000, device=TPU), 1, True).cpu() for _ in range(300)])
    assert (draws[1:] == draws[:-1]).float().mean() < 0.05
    assert abs((draws[1:] - draws[:-1]).abs().double().mean().item() - 333.0) < 60  # E|U1-U2| = n/3


def test_multinomial_too_many_samples_without_replacement_raises():
    with pytest.raises(RuntimeError, match="cannot sample"):
        torch.multinomial(torch.ones(3, device=TPU), 4).cpu()


@pytest.mark.parametrize("weights,k,replacement,message", [
    ([0.5, -0.1], 1, True, "element < 0"),
    ([float("nan"), 1.0], 1, True, "element < 0"),
    ([float("inf"), 1.0], 1, False, "element < 0"),
    ([0.0, 0.0], 1, True, "sum of probabilities"),
])
def test_multinomial_invalid_weights_raise_like_cpu(weights, k, replacement, message):
    w = torch.tensor(weights)
    with pytest.raises(RuntimeError, match=message):
        torch.multinomial(w, k, replacement)
    # on tpu: a value check on the device, raised at the next sync point
    with pytest.raises(RuntimeError, match=message):
        torch.multinomial(w.to(TPU), k, replacement).cpu()
    assert torch.multinomial(torch.tensor([0.2, 0.8], device=TPU), 2).cpu().sort().values.tolist() == [0, 1]


# --- randperm -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_randperm_is_a_permutation(n, dtype):
    with no_fallback():
        p = torch.randperm(n, device=TPU, dtype=dtype)
    assert p.device.type == "tpu" and p.dtype == dtype and p.shape == (n,)
    # the same checks as on CPU's result: sorted it is arange(n)
    expected = torch.randperm(n, dtype=dtype).sort().values
    torch.testing.assert_close(p.cpu().sort().values, expected, rtol=0, atol=0)


def test_randperm_seeded_generator_out_and_uniformity():
    torch.manual_seed(11)
    with no_fallback():
        a, b = torch.randperm(50, device=TPU).cpu(), torch.randperm(50, device=TPU).cpu()
    torch.manual_seed(11)
    with no_fallback():
        a2 = torch.randperm(50, device=TPU).cpu()
    assert torch.equal(a, a2) and not torch.equal(a, b)
    g1, g2 = torch.Generator(TPU).manual_seed(3), torch.Generator(TPU).manual_seed(3)
    with no_fallback():
        assert torch.equal(torch.randperm(20, generator=g1, device=TPU).cpu(),
                           torch.randperm(20, generator=g2, device=TPU).cpu())
    out = torch.empty(9, dtype=torch.int32, device=TPU)
    with no_fallback():
        torch.randperm(9, out=out)
    assert torch.equal(out.cpu().sort().values, torch.arange(9, dtype=torch.int32))
    # every value lands at every position about equally often: 4000 draws of
    # randperm(4), each of the 16 (value, position) counts ~1000 (std ~27)
    with no_fallback():
        perms = torch.stack([torch.randperm(4, device=TPU) for _ in range(4000)]).cpu()
    counts = torch.stack([(perms == v).sum(0) for v in range(4)])
    assert ((counts - 1000).abs() < 150).all(), counts


LAZY_SEED_SCRIPT = r"""
import torch, torch_tpu
from torch_tpu import _C
torch.manual_seed(123)          # before the client: kept, not applied
print("client after seed", _C._is_initialized())
a = torch.rand(8, device="tpu").cpu().tolist()   # creates the client + generators
print("client after rand", _C._is_initialized())
torch.manual_seed(123)          # with the client live: applied at once
b = torch.rand(8, device="tpu").cpu().tolist()
torch.manual_seed(124)
c = torch.rand(8, device="tpu").cpu().tolist()
print("lazy seed draws equal", a == b)
print("another seed differs", a != c)
"""


def test_manual_seed_before_client_is_lazy_and_applied():
    """torch.manual_seed before the PJRT client exists does not create it
    (as torch.cuda queues seeding until CUDA initializes; vLLM's API server
    seeds and must not start the device) and still seeds the generators
    created later with the client. Fresh process: this one has a client."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", LAZY_SEED_SCRIPT], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("client", "lazy", "another"))]
    assert lines == ["client after seed False", "client after rand True",
                     "lazy seed draws equal True", "another seed differs True"], out.stdout + out.stderr[-2000:]


def test_manual_seed_out_of_range_raises():
    with pytest.raises(RuntimeError, match="Overflow"):
        torch_tpu.device.manual_seed_all(1 << 64)
