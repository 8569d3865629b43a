"""torch.distributed.checkpoint (DCP) of an FSDP2 model and its optimizer on
tpu, resharded across world sizes (real processes on localhost, tpu_dist).

Three jobs in sequence, each on its own world size, with one training run
split across them (the third under TORCH_TPU_DIST_FULL=1: each job is a
process start and a round of compiles):

1. 2 ranks: fully_shard a small MLP (meta init, to_empty("tpu")), train 2
   Adam steps, save model + optimizer (get_state_dict -> dcp.save);
2. 1 rank: a fresh FSDP2 model on a 1-device mesh, dcp.load + set_state_dict
   (2 -> 1 resharding), train 2 more steps, save again;
3. 2 ranks: load that checkpoint (1 -> 2), train 1 more step.

Checks: every per-step loss within 1e-5 relative of one uninterrupted
single-process CPU run of the same 5 steps (PyTorch's reference); the
parameters and Adam state after each load equal, exactly, the ones the saving
job had (gathered with full_tensor); and each checkpoint is complete as DCP
makes it atomic: `.metadata` is written last through a temporary file and a
rename, no `.tmp` file is left.
"""
from __future__ import annotations

import os

import torch

import pytest

from test_distributed import full_tier, run_job

DIM, GLOBAL_BATCH, LR = 16, 8, 1e-2


def _model():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, DIM), nn.Tanh(), nn.Linear(DIM, 4))


def _init_state():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in _model().state_dict().items()}


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def _reference_losses(steps):
    model = _model()
    model.load_state_dict(_init_state())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_state(model, opt):
    """Parameters and Adam state, gathered to whole CPU tensors."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.full_tensor().cpu()
        for key, v in opt.state[p].items():
            out[f"optim/{name}/{key}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()
    return out


def _dcp_worker(rank, world, args):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.tpu.set_device(rank)
    mesh = init_device_mesh("tpu", (world,))
    with torch.device("meta"):
        model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="tpu")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = {}
    if args["load"]:
        # Adam's state exists only after a step: get_state_dict initializes it
        # (zeros) so that DCP has tensors to load into
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=args["load"])
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        loaded = _full_state(model, opt)
        saved = torch.load(os.path.join(args["load"], "full_state.pt"))
        out["load_mismatch"] = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))
        out["load_missing"] = sorted(k for k in loaded if k not in saved)
    else:
        full = _init_state()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(full[name].chunk(world, dim=0)[rank])
    per_rank = GLOBAL_BATCH // world
    losses = []
    for step in range(args["first"], args["first"] + args["steps"]):
        x, y = _batch(step)
        x, y = (t[rank * per_rank:(rank + 1) * per_rank].to("tpu") for t in (x, y))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    out["losses"] = losses
    if args["save"]:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args["save"])
        state = _full_state(model, opt)
        if rank == 0:
            torch.save(state, os.path.join(args["save"], "full_state.pt"))
    dist.barrier()
    return out


def _run_leg(base, i, world, first, steps, load, save):
    """One job of the split run; checks its losses against the uninterrupted
    CPU run, the loaded state against the saved one, and the checkpoint."""
    ref = _reference_losses(first + steps)
    (base / f"job{i}").mkdir()
    results = run_job(base / f"job{i}", _dcp_worker, {"first": first, "steps": steps, "load": load, "save": save},
                      world=world)
    for rank, res in enumerate(results):
        if load:
            assert res["load_mismatch"] == [] and res["load_missing"] == [], (i, rank, res)
        for k, (a, b) in enumerate(zip(res["losses"], ref[first:first + steps])):
            assert abs(a - b) <= 1e-5 * abs(b), f"job {i} (world {world}) step {first + k}: {a} vs {b}"
    if save:
        names = os.listdir(save)
        assert ".metadata" in names, names
        assert not [n for n in names if n.endswith(".tmp")], names
        assert any(n.endswith(".distcp") for n in names), names


@pytest.fixture(scope="module")
def two_to_one(tmp_path_factory):
    """Jobs 1 (2 ranks, save) and 2 (1 rank: load, train, save); returns the
    base directory and the second checkpoint."""
    base = tmp_path_factory.mktemp("dcp")
    ckpt_a, ckpt_b = str(base / "ckpt_a"), str(base / "ckpt_b")
    _run_leg(base, 1, world=2, first=0, steps=2, load=None, save=ckpt_a)
    _run_leg(base, 2, world=1, first=2, steps=2, load=ckpt_a, save=ckpt_b)
    return base, ckpt_b


def test_dcp_fsdp2_save_2_ranks_load_1(two_to_one):
    """FSDP2 model + Adam saved by 2 ranks, loaded (resharded) by 1, training
    continues as the uninterrupted run (checked in the fixture's jobs)."""
    base, ckpt_b = two_to_one
    assert os.path.isdir(ckpt_b)


@full_tier
def test_dcp_fsdp2_save_1_rank_load_2(two_to_one):
    """The 1-rank job's checkpoint loaded (resharded) by 2 ranks."""
    base, ckpt_b = two_to_one
    _run_leg(base, 3, world=2, first=4, steps=1, load=ckpt_b, save=None)
