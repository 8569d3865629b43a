"""FSDP2 (fully_shard) on tpu, checked against a single-process run.

    torchrun --nproc-per-node 2 examples/fsdp_train.py [--mode strict|fused] [--steps 4]

Each rank binds the tpu device LOCAL_RANK, joins the default process group
(init_process_group(): cpu:gloo,tpu:tpu_dist), builds a small MLP on the
meta device, shards every Linear and then the root with fully_shard
(reshard_after_forward=True: parameters are all-gathered for forward and
again for backward, gradients reduce-scattered), materializes the shards with
to_empty(device="tpu") and loads the reference model's values into them.
Training (Adam) runs on each rank's shard of the global batch. Rank 0 trains
the same model single-process on the CPU (PyTorch's reference) on the whole
batch and prints the losses side by side, plus the per-rank tpu memory of the
sharded parameters and optimizer state relative to the unsharded model's.

Exits non-zero if a loss differs from the reference by more than 1e-5
relative, and, with --check-memory, if the sharded memory exceeds 0.6x the
unsharded. (Measured: 0.500x on tpu: FSDP2 frees the unsharded parameters
with untyped_storage().resize_(0), which releases the tpu storage.)
"""
from __future__ import annotations

import argparse
import os

# strict mode compiles each op once per shape: expected in a training step,
# so the example turns off the recompile warning (which would bury the loss
# table) unless TORCH_TPU_RECOMPILE_WARN is set
os.environ.setdefault("TORCH_TPU_RECOMPILE_WARN", "0")

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import torch_tpu

GLOBAL_BATCH = 16
DIM = 64
LR = 1e-2


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.Tanh(), nn.Linear(4 * DIM, DIM), nn.Tanh(), nn.Linear(DIM, 8))


def reference_state() -> dict:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in make_model().state_dict().items()}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)


def reference_losses(steps: int) -> list[float]:
    model = make_model()
    model.load_state_dict(reference_state())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fsdp_losses(steps: int) -> tuple[list[float], float]:
    """Returns the per-step losses (mean over ranks) and the per-rank
    torch.tpu.memory_allocated() growth (parameters + Adam state, after the
    first step) divided by the unsharded model's parameters + Adam state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    with torch.device("meta"):
        model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    base = torch.tpu.memory_allocated()
    model.to_empty(device="tpu")
    full = reference_state()
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            # fully_shard shards dim 0 in world chunks (sizes here divide evenly: no padding)
            local.copy_(full[name].chunk(world, dim=0)[rank])
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    sharded_bytes = None
    for step in range(steps):
        x, y = batch(step)
        x = x[rank * per_rank:(rank + 1) * per_rank].to("tpu")
        y = y[rank * per_rank:(rank + 1) * per_rank].to("tpu")
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
        if sharded_bytes is None:
            # what stays allocated between steps: sharded parameters + Adam
            # state (gradients are freed by zero_grad; unsharded parameters
            # must have been freed by FSDP's resize_(0))
            del x, y, loss, total
            torch.tpu.synchronize()
            sharded_bytes = torch.tpu.memory_allocated() - base
    unsharded = 3 * sum(t.nbytes for t in full.values())  # params + exp_avg + exp_avg_sq
    return losses, sharded_bytes / unsharded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="strict", choices=torch_tpu.EAGER_MODES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--check-memory", action="store_true",
                        help="also fail if sharded params + optimizer state exceed 0.6x the unsharded")
    args = parser.parse_args()

    torch.tpu.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch_tpu.set_eager_mode(args.mode)
    dist.init_process_group()
    try:
        assert GLOBAL_BATCH % dist.get_world_size() == 0
        losses, ratio = fsdp_losses(args.steps)
        ratios = [None] * dist.get_world_size()
        dist.all_gather_object(ratios, ratio)
        ok = True
        if dist.get_rank() == 0:
            ref = reference_losses(args.steps)
            print(f"FSDP2 on tpu ({args.mode}), {dist.get_world_size()} ranks vs single process on CPU")
            print(f"{'step':>4} {'fsdp loss':>14} {'reference':>14} {'rel diff':>10}")
            for i, (a, b) in enumerate(zip(losses, ref)):
                rel = abs(a - b) / max(abs(b), 1e-12)
                ok &= rel <= 1e-5
                print(f"{i:>4} {a:>14.8f} {b:>14.8f} {rel:>10.2e}")
            print("per-rank sharded params + optimizer state / unsharded: "
                  + ", ".join(f"{r:.3f}" for r in ratios))
            print(f"LOSSES {'OK' if ok else 'MISMATCH'}; MEMORY RATIO {max(ratios):.3f}")
            if args.check_memory:
                ok &= max(ratios) <= 0.6
            print("OK" if ok else "MISMATCH")
        ok_t = torch.tensor([1 if ok else 0])
        dist.broadcast(ok_t, src=0)
        return 0 if ok_t.item() == 1 else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
