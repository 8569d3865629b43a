#!/usr/bin/env python3
"""20 sequence lengths through a small transformer block forward: CPU eager,
tpu strict, tpu fused, torch.compile(backend="tpu", dynamic=True).

Issue 12 benchmark (c). Each configuration runs in a fresh process with an
empty TORCH_TPU_CACHE_DIR (so every compile is paid), one thread, launched
back to back by this script; the table lists per configuration the time of
the first pass over the 20 lengths (compiles included), XLA compiles during
it, the time of a second pass (everything warm), and the first pass against
CPU eager. Block: pre-norm attention (4 heads, softmax over the sequence),
layer norms, GELU MLP, hidden 64, batch 2, causal mask; lengths 1..65
around the bucket edges 8, 16, 32, 64 (torch_tpu._dynamic buckets).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

LENGTHS = [5, 1, 2, 3, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 40, 48, 63, 64, 65]


def _child(config: str) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self, dim=64, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, d = x.shape
            h = self.heads
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            s = q @ k.transpose(-1, -2) / math.sqrt(d // h)
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
            y = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    block = Block().eval()
    inputs = [torch.randn(2, n, 64) for n in LENGTHS]
    if config == "cpu":
        fn, sync, metrics = block, (lambda: None), None
    else:
        import torch_tpu

        block = block.to("tpu")
        inputs = [x.to("tpu") for x in inputs]
        mode = "fused" if config == "fused" else "strict"
        torch_tpu.set_eager_mode(mode)
        fn = torch.compile(block, backend="tpu", dynamic=True) if config == "compile" else block
        sync, metrics = torch.tpu.synchronize, torch_tpu.metrics
        sync()

    def one_pass():
        start = time.perf_counter()
        with torch.no_grad():
            for x in inputs:
                fn(x)
                sync()
        return time.perf_counter() - start

    c0 = metrics()["compiles"] if metrics else 0
    first = one_pass()
    compiles = (metrics()["compiles"] - c0) if metrics else 0
    second = one_pass()
    out = {"first_s": first, "compiles": compiles, "warm_s": second}
    if config == "compile":
        from torch_tpu import _dynamic

        out["programs"] = dict(_dynamic.stats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return
    results = {}
    for config in ("cpu", "strict", "fused", "compile"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCH_TPU_CACHE_DIR=cache, OMP_NUM_THREADS="1")
            r = subprocess.run([sys.executable, __file__, "--child", config], env=env,
                               capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"{config} failed:\n{r.stderr[-3000:]}")
        results[config] = json.loads(r.stdout.strip().splitlines()[-1])
    cpu = results["cpu"]["first_s"]
    names = {"cpu": "CPU eager", "strict": "tpu strict", "fused": "tpu fused",
             "compile": 'torch.compile(backend="tpu", dynamic=True)'}
    print(f"20 lengths {LENGTHS[0]}..{max(LENGTHS)}, batch 2, hidden 64; fresh process and empty cache per row")
    print()
    print("| configuration | first pass (s) | XLA compiles | warm pass (s) | first pass / CPU |")
    print("|---|---|---|---|---|")
    for config, r in results.items():
        print(f"| {names[config]} | {r['first_s']:.2f} | {r['compiles']} | {r['warm_s']:.3f} | "
              f"{r['first_s'] / cpu:.1f}x |")
    if "programs" in results["compile"]:
        print()
        print(f"torch.compile programs: {results['compile']['programs']}")


if __name__ == "__main__":
    main()
