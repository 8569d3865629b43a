"""DistributedDataParallel on tpu, checked against a single-process run.

    torchrun --nproc-per-node 2 examples/ddp_train.py [--mode strict|fused|both] [--steps 5]

Each rank binds the tpu device LOCAL_RANK (torch.tpu.set_device), joins the
default process group (init_process_group() with no backend: cpu:gloo,
tpu:tpu_dist), wraps a small MLP in DDP without device_ids (small buckets, so
the gradients go in several bucketed all-reduces) and trains on its shard of
each global batch, with gradient accumulation: two micro-batches per step,
the first under no_sync(). Rank 0 runs the same training single-process on
the CPU (PyTorch's reference) with the whole global batch and prints, per
step, the DDP loss (mean of the ranks' losses) beside the reference loss, and
the largest difference of the parameters across ranks (which must be 0).

Exits non-zero if a loss differs from the reference by more than 1e-5
relative or the ranks' parameters differ.
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

import torch_tpu

GLOBAL_BATCH = 16
MICRO_BATCHES = 2
LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x, y


def reference_losses(steps: int) -> list[float]:
    """Single process, CPU, whole global batch: the losses DDP must match."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(MICRO_BATCHES):
            x, y = batch(step, micro)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total / MICRO_BATCHES)
    return losses


def ddp_losses(steps: int) -> tuple[list[float], list[float]]:
    """DDP on tpu; returns (losses, max parameter difference across ranks) per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert GLOBAL_BATCH % world == 0, f"global batch {GLOBAL_BATCH} not divisible by {world} ranks"
    per_rank = GLOBAL_BATCH // world
    device = torch.device("tpu", torch.tpu.current_device())
    model = nn.parallel.DistributedDataParallel(make_model().to(device), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, spreads = [], []
    for step in range(steps):
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for micro in range(MICRO_BATCHES):
            x, y = batch(step, micro)
            x = x[rank * per_rank:(rank + 1) * per_rank].to(device)
            y = y[rank * per_rank:(rank + 1) * per_rank].to(device)
            if micro < MICRO_BATCHES - 1:
                with model.no_sync():  # accumulate locally, no all-reduce
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
            else:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()  # all-reduces the accumulated gradients
            total += loss.detach()
        opt.step()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item() / MICRO_BATCHES)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        spreads.append(max((g - gathered[0]).abs().max().item() for g in gathered))
    return losses, spreads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="strict", choices=(*torch_tpu.EAGER_MODES, "both"),
                        help="tpu eager mode; both = strict, then fused, in one launch")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.tpu.set_device(local_rank)
    dist.init_process_group()
    try:
        ok = True
        ref = reference_losses(args.steps) if dist.get_rank() == 0 else None
        for mode in ("strict", "fused") if args.mode == "both" else (args.mode,):
            torch_tpu.set_eager_mode(mode)
            losses, spreads = ddp_losses(args.steps)
            if dist.get_rank() == 0:
                print(f"DDP on tpu ({mode}), {dist.get_world_size()} ranks vs single process on CPU")
                print(f"{'step':>4} {'ddp loss':>14} {'reference':>14} {'rel diff':>10} {'param spread':>12}")
                for i, (a, b, s) in enumerate(zip(losses, ref, spreads)):
                    rel = abs(a - b) / max(abs(b), 1e-12)
                    ok &= rel <= 1e-5 and s == 0.0
                    print(f"{i:>4} {a:>14.8f} {b:>14.8f} {rel:>10.2e} {s:>12.2e}")
        if dist.get_rank() == 0:
            print("OK" if ok else "MISMATCH")
        ok_t = torch.tensor([1 if ok else 0])
        dist.broadcast(ok_t, src=0)  # a cpu tensor: the default map's gloo
        return 0 if ok_t.item() == 1 else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
