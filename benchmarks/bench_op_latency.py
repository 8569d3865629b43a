#!/usr/bin/env python3
"""Per-op latency of a cached small op: tpu strict eager vs PyTorch CPU eager.

Both sides run in this one process on the same inputs, interleaved in rounds,
and the script prints the median time per op and the ratio tpu/CPU. The tpu
figure includes dispatch, the executable cache lookup, launching through
PJRT and the output tensor's creation; a synchronize closes each timed loop,
so asynchronous work is counted.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch_tpu


def _time_loop(fn, iters: int, sync) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--numel", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch_tpu.set_eager_mode("strict")

    cases = {
        "add (x + y)": lambda x, y: x + y,
        "mul_ with scalar": lambda x, y: x.mul_(1.0),
        "addcmul_ (AdamW-style)": lambda x, y: x.addcmul_(y, y, value=0.5),
        "sum": lambda x, y: x.sum(),
    }
    cpu_x, cpu_y = torch.randn(args.numel), torch.randn(args.numel)
    tpu_x, tpu_y = cpu_x.to("tpu"), cpu_y.to("tpu")
    print(f"torch {torch.__version__}; {torch.tpu.get_device_name()}; "
          f"{args.numel} float32 elements; median of {args.rounds} rounds x {args.iters} ops")
    print()
    print("| op | CPU eager (µs/op) | tpu strict (µs/op) | ratio strict/CPU | fused capture (µs/op) | capture/strict |")
    print("|---|---|---|---|---|---|")
    for name, fn in cases.items():
        for _ in range(50):  # warm up, compile once
            fn(tpu_x, tpu_y)
            fn(cpu_x, cpu_y)
        torch.tpu.synchronize()
        cpu_t, tpu_t = [], []
        for _ in range(args.rounds):
            cpu_t.append(_time_loop(lambda: fn(cpu_x, cpu_y), args.iters, lambda: None))
            tpu_t.append(_time_loop(lambda: fn(tpu_x, tpu_y), args.iters, torch.tpu.synchronize))
        c, t = statistics.median(cpu_t) * 1e6, statistics.median(tpu_t) * 1e6
        # Fused mode: the cost of recording an op (the region runs afterwards,
        # outside the timed loop; 400 ops stay under the region size bound).
        fused_t = []
        with torch_tpu.eager_mode("fused"):
            for _ in range(args.rounds + 1):
                start = time.perf_counter()
                for _ in range(400):
                    fn(tpu_x, tpu_y)
                fused_t.append((time.perf_counter() - start) / 400)
                torch.tpu.synchronize()
        f = statistics.median(fused_t[1:]) * 1e6
        print(f"| {name} | {c:.2f} | {t:.2f} | {t / c:.2f}x | {f:.2f} | {f / t:.2f}x |")


if __name__ == "__main__":
    main()
