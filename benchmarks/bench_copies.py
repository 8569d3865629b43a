#!/usr/bin/env python3
"""Copies between tpu and the host against a host memcpy, one process, side by side.

For each size (default 1 MB and 64 MB of float32): ``copy_`` from a tpu
tensor into a reused contiguous CPU tensor, ``.cpu()`` (a fresh CPU tensor),
``copy_`` from the host into a tpu tensor whose storage is already written,
``.to("tpu")`` (a fresh storage), all against ``copy_`` between two CPU
tensors of the same size. Prints the minimum over --iters calls (ms) and the
ratio copy / memcpy (lower is better; 1.0x is memcpy's speed). Values are
checked after the timing: a wrong copy fails the run.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch_tpu  # noqa: F401


def _min_ms(fn, iters):
    fn()
    torch.tpu.synchronize()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.tpu.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 64])
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    print("| size | memcpy (ms) | tpu->host copy_ (ms) | .cpu() (ms) | host->tpu copy_ (ms) | .to(tpu) (ms) "
          "| ratios to memcpy |")
    print("|---|---|---|---|---|---|---|")
    for mb in args.sizes_mb:
        n = int(mb * (1 << 20)) // 4
        host = torch.randn(n)
        out = torch.empty(n)
        dev = host.to("tpu")
        ms = [_min_ms(lambda: out.copy_(host), args.iters),
              _min_ms(lambda: out.copy_(dev), args.iters),
              _min_ms(lambda: dev.cpu(), args.iters),
              _min_ms(lambda: dev.copy_(host), args.iters),
              _min_ms(lambda: host.to("tpu"), args.iters)]
        out.zero_()
        out.copy_(dev)
        assert torch.equal(out, host) and torch.equal(dev.cpu(), host), "a copy changed the values"
        ratios = " / ".join(f"{m / ms[0]:.2f}x" for m in ms[1:])
        print(f"| {mb:g} MB | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ratios} |")


if __name__ == "__main__":
    main()
