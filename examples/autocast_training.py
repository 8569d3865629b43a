#!/usr/bin/env python3
"""Mixed-precision training under ``torch.autocast("tpu", dtype=torch.bfloat16)``.

An MLP (Linear-GELU-Linear-GELU-Linear, 32 -> --hidden -> 4 classes) is
trained with AdamW and cross-entropy on a fixed random classification set,
identically on ``tpu`` and on CPU from the same initial weights, each under
its own device's autocast (bf16 matmuls, fp32 softmax/cross-entropy and fp32
master weights, CUDA's op lists). Prints per step both losses and their
difference, the dtypes autocast chose, and exits non-zero if a loss differs
from CPU's by more than --rtol * |loss| + --atol (low-precision rounding: both sides
round the same products, but accumulation orders differ) or the tpu loss does
not fall. ``--dtype float16`` adds ``torch.amp.GradScaler`` on both devices.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch_tpu


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                   help="autocast dtype (default: bfloat16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=2e-2)
    p.add_argument("--atol", type=float, default=1e-3)
    return p.parse_args(argv)


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, 4))


def train(args, device: str, init_state: dict, x: torch.Tensor, y: torch.Tensor):
    dtype = getattr(torch, args.dtype)
    model = make_model(args.hidden)
    model.load_state_dict(init_state)
    model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    # float16 needs loss scaling (bfloat16 has float32's exponent range and does not).
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    losses, times, dtypes = [], [], None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())  # a sync point on tpu
        times.append(time.perf_counter() - t0)
        dtypes = (logits.dtype, loss.dtype, model[0].weight.dtype, model[0].weight.grad.dtype)
    return losses, times, dtypes


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    init_state = make_model(args.hidden).state_dict()
    x = torch.randn(args.batch, 32)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()  # 4 learnable classes

    print(f"torch {torch.__version__}, device {torch.tpu.get_device_name()}, "
          f"autocast dtype {args.dtype}")
    tpu_losses, tpu_times, tpu_dtypes = train(args, "tpu", init_state, x, y)
    cpu_losses, cpu_times, cpu_dtypes = train(args, "cpu", init_state, x, y)
    names = ("logits", "loss", "weight", "grad")
    print("dtypes under autocast: tpu " + ", ".join(f"{n} {d}" for n, d in zip(names, tpu_dtypes))
          + "\n                       cpu " + ", ".join(f"{n} {d}" for n, d in zip(names, cpu_dtypes)))

    failures = []
    if tpu_dtypes != cpu_dtypes:
        failures.append(f"autocast dtypes differ: tpu {tpu_dtypes}, cpu {cpu_dtypes}")
    print(f"\n{'step':>4s}  {'loss tpu':>10s}  {'loss cpu':>10s}  {'|diff|':>9s}")
    for i, (t, c) in enumerate(zip(tpu_losses, cpu_losses)):
        bad = abs(t - c) > args.rtol * abs(c) + args.atol
        print(f"{i:4d}  {t:10.6f}  {c:10.6f}  {abs(t - c):9.2e}{' !' if bad else ''}")
        if bad:
            failures.append(f"step {i}: loss tpu {t:.6f} vs cpu {c:.6f}")
    if not tpu_losses[-1] < tpu_losses[0]:
        failures.append(f"tpu loss did not fall: {tpu_losses[0]:.6f} -> {tpu_losses[-1]:.6f}")
    if len(tpu_times) > 1:
        print(f"time per step after the first: tpu {sum(tpu_times[1:]) / (len(tpu_times) - 1) * 1e3:.1f} ms, "
              f"cpu {sum(cpu_times[1:]) / (len(cpu_times) - 1) * 1e3:.1f} ms")
    print(f"CPU fallbacks: {torch_tpu.metrics()['cpu_fallbacks']}")
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    print(f"OK: tpu loss fell from {tpu_losses[0]:.4f} to {tpu_losses[-1]:.4f}, "
          f"within {args.dtype} tolerance of CPU autocast at every step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
