"""torch.compile(backend="tpu") of distributed models: DDP and FSDP2.

Real processes on localhost (test_distributed.run_job: torch.multiprocessing
"spawn", a FileStore in tmp_path, each job killed past its timeout), 2
ranks, the tpu_dist process group. Each run trains a tiny model for a few
steps on each rank's half of a global batch and compares, on every rank,
with the same training in one process on the CPU on the whole batch
(PyTorch's reference): losses within 1e-5 relative, parameters within
1e-5 (absolute + relative) of the reference after the last step, and equal
across ranks (exact). It also counts what ran: the programs the backend
compiled, that no graph ran op by op (torch_tpu._dynamo.stats
eager_graphs), that no op fell back to the CPU (torch_tpu.metrics()
cpu_fallbacks), and that the steps after the first compile nothing.

Configurations (PyTorch's; see docs/distributed.md, "torch.compile"):

- DDP + DDPOptimizer (torch._dynamo.config.optimize_ddp = True, the
  default): Dynamo compiles the wrapped module's forward (DDP's own forward
  is skipped) and DDPOptimizer splits its graph at the DDP bucket
  boundaries; each piece is one forward and one backward program of our
  backend, and DDP's C++ reducer all-reduces each bucket (tpu_dist) as
  its gradients are ready, as in eager mode. Needs bucket_cap_mb >= 1
  (DDPOptimizer's first bucket is 1 MiB) and the wrapped module's class
  defined outside torch.nn (Dynamo does not start a frame inside torch.nn:
  DDP(nn.Sequential(...)) compiles nothing; DDP(torch.compile(seq)) does).
- DDP + "python_reducer" with compiled autograd: the backward is one
  compiled-autograd graph holding each gradient's
  _c10d_functional.all_reduce (DDP's post-accumulate-grad hooks), split at
  the collectives by the backend (torch_tpu._dynamo._Split).
- FSDP2 (fully_shard per block + root), each block compiled.

Tiers: the default run is DDPOptimizer in strict and fused mode and the
rank-dependent recompile; python_reducer and FSDP2 variants are in the full
tier (TORCH_TPU_DIST_FULL=1).
"""
from __future__ import annotations

import os

import pytest
import torch

from test_distributed import FULL, WORLD, run_job

full_tier = pytest.mark.skipif(not FULL, reason="full distributed tier: TORCH_TPU_DIST_FULL=1")

TOL = 1e-5
GLOBAL_BATCH = 8
STEPS = 3
JOB_TIMEOUT_S = 400
LR = 0.05
HIDDEN = 512  # 512 x 512 float32 = 1 MiB: DDPOptimizer's buckets (>= 1 MiB) split the graph


class Net(torch.nn.Module):
    """Linear(16, H) -> tanh -> Linear(H, H) -> tanh -> Linear(H, H) ->
    tanh -> Linear(H, 4); input [B, 16] float32, output [B, 4]. A class of
    this module (not nn.Sequential), so that Dynamo compiles its forward
    when DDP calls it."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, HIDDEN)
        self.b = torch.nn.Linear(HIDDEN, HIDDEN)
        self.c = torch.nn.Linear(HIDDEN, HIDDEN)
        self.d = torch.nn.Linear(HIDDEN, 4)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def _reference(steps: int):
    """One CPU process, the whole global batch: losses and final parameters."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _compare(rank, world, model, losses, steps):
    """The worker's result: its losses and the reference's, the largest
    parameter difference to the reference (relative to TOL's scale) and
    across ranks."""
    import torch.distributed as dist

    ref_losses, ref_params = _reference(steps)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    params = [p.detach().cpu() for p in params]
    worst = max(((p - r).abs() / (TOL + TOL * r.abs())).max().item() for p, r in zip(params, ref_params))
    flat = torch.cat([p.reshape(-1) for p in params]).to("tpu")
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    spread = max((g - gathered[0]).abs().max().item() for g in gathered)
    return {"losses": losses, "ref_losses": ref_losses, "param_err": worst, "spread": spread}


def _counters():
    import torch_tpu
    from torch_tpu import _dynamo as tpu_dynamo

    m = torch_tpu.metrics()
    return {"programs": tpu_dynamo.stats["programs"], "eager_graphs": tpu_dynamo.stats["eager_graphs"],
            "compiles": m["compiles"], "executions": m["executions"], "fallbacks": dict(m["cpu_fallbacks"])}


def _delta(a, b):
    out = {k: b[k] - a[k] for k in ("programs", "eager_graphs", "compiles", "executions")}
    out["fallbacks"] = {k: v for k, v in b["fallbacks"].items() if a["fallbacks"].get(k) != v}
    return out


# --------------------------------------------------------------------------
# DDP


def _ddp_worker(rank, world, args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_tpu

    torch_tpu.set_eager_mode(args["mode"])
    torch.tpu.set_device(rank)
    variant = args["variant"]
    torch._dynamo.config.optimize_ddp = "python_reducer" if variant == "python_reducer" else True
    per_rank = GLOBAL_BATCH // world
    model = _model().to("tpu")
    buckets = []

    def hook(state, bucket):  # DDP's default all-reduce, recording each bucket
        buckets.append(bucket.index())
        t = bucket.buffer().div_(world)
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    if variant == "inner":  # DDP(torch.compile(module)): the compiled module's graph, split per bucket
        ddp = DDP(torch.compile(model, backend="tpu"), bucket_cap_mb=1)
        step_fn = ddp
    else:
        ddp = DDP(model, bucket_cap_mb=1)
        step_fn = torch.compile(ddp, backend="tpu")
    if variant != "python_reducer":
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses, per_step = [], []
    for step in range(args["steps"]):
        x, y = _batch(step)
        x = x[rank * per_rank:(rank + 1) * per_rank].to("tpu")
        y = y[rank * per_rank:(rank + 1) * per_rank].to("tpu")
        before = _counters()
        del buckets[:]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(step_fn(x), y)
        if variant == "python_reducer":
            from torch._dynamo import compiled_autograd

            with compiled_autograd._enable(torch.compile(backend="tpu")):
                loss.backward()
        else:
            loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
        per_step.append({**_delta(before, _counters()), "buckets": list(buckets)})
        if os.environ.get("TORCH_TPU_TEST_DEBUG"):
            print(f"rank {rank} step {step}: {per_step[-1]}", flush=True)
    return {**_compare(rank, world, ddp, losses, args["steps"]), "per_step": per_step}


def _check(results, steps=STEPS, min_programs=2):
    for res in results:
        for step, (a, b) in enumerate(zip(res["losses"], res["ref_losses"])):
            assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs single-process CPU {b}"
        assert res["param_err"] <= 1.0, f"parameters differ from the CPU reference: {res['param_err']} x tolerance"
        assert res["spread"] == 0.0, f"parameters differ across ranks by {res['spread']}"
        first, rest = res["per_step"][0], res["per_step"][1:]
        assert first["programs"] >= min_programs, res["per_step"]
        for s in res["per_step"]:
            assert s["eager_graphs"] == 0 and s["fallbacks"] == {}, res["per_step"]
        for s in rest[1:]:  # the first step compiles the graphs, the second the optimizer's ops
            assert s["programs"] == 0 and s["compiles"] == 0, res["per_step"]
    return results


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_ddp_optimizer(tmp_path, mode):
    """torch.compile(DDP(model), backend="tpu"), optimize_ddp=True: the
    forward splits at DDP's buckets into several graphs (3 here: 1 MiB
    buckets of the 2.1 MiB of parameters), each a forward and a backward
    program (6 programs), and DDP's reducer all-reduces every bucket on every
    step."""
    results = _check(run_job(tmp_path, _ddp_worker, {"mode": mode, "variant": "ddp_optimizer", "steps": STEPS},
                               timeout=JOB_TIMEOUT_S))
    for res in results:
        assert res["per_step"][0]["programs"] == 6, res["per_step"]
        # step 0 all-reduces one bucket (DDP's construction-time buckets,
        # as in eager mode), later steps the buckets DDP rebuilt in
        # gradient order (3)
        assert len(res["per_step"][0]["buckets"]) >= 1, res["per_step"]
        for s in res["per_step"][1:]:
            assert len(s["buckets"]) >= 2, res["per_step"]


@full_tier
def test_ddp_of_compiled_module(tmp_path):
    """DDP(torch.compile(model, backend="tpu")): the same split per bucket
    (DDP's forward runs eagerly, the compiled module's frame under it)."""
    results = _check(run_job(tmp_path, _ddp_worker, {"mode": "strict", "variant": "inner", "steps": STEPS},
                             timeout=JOB_TIMEOUT_S))
    for res in results:
        assert res["per_step"][0]["programs"] == 6, res["per_step"]


@pytest.mark.parametrize("mode", ["strict", pytest.param("fused", marks=full_tier)])
def test_ddp_python_reducer(tmp_path, mode):
    """optimize_ddp="python_reducer" + compiled autograd: DDP's
    post-accumulate-grad hooks put one _c10d_functional.all_reduce per
    gradient into the compiled backward graph, which the backend splits at
    each collective (programs between them, the all-reduces through
    tpu_dist in graph order)."""
    results = _check(run_job(tmp_path, _ddp_worker, {"mode": mode, "variant": "python_reducer", "steps": STEPS},
                             timeout=JOB_TIMEOUT_S))
    for res in results:
        # the forward (1 program) and the backward split at its 8 all-reduces
        # (one per parameter: 9 programs); DDP's C++ reducer is not used
        assert res["per_step"][0]["programs"] == 10, res["per_step"]
        assert all(s["buckets"] == [] for s in res["per_step"]), res["per_step"]
