#!/usr/bin/env python3
"""all_reduce bus bandwidth, 2 ranks on localhost, measured side by side in one run.

For each size (default 1 MB and 64 MB of float32): ``dist.all_reduce`` of a
tpu tensor through tpu_dist's default group (zero-copy on the CPU plugin:
gloo runs on the tpu buffer's own host memory), through a second tpu_dist
group made with TORCH_TPU_DIST_ZERO_COPY=0 (host-staged: tpu -> host, gloo,
host -> tpu), each timed until the result is in the tpu tensor
(``torch.tpu.synchronize``), and of a CPU tensor of the same size through a
gloo group, the three interleaved call by call (the same load on all).
Prints the median time of --iters calls after --warmup, the bus bandwidth
(NCCL's definition for all_reduce: 2 (n - 1) / n * bytes / time) and the
ratios tpu / gloo (higher is better; the issue's target is at least 0.8x),
and a breakdown of the staged call: a tpu->host copy_ into a host tensor,
gloo's all_reduce, a host->tpu copy_ + synchronize, beside a host memcpy of
the same size. Then the DDP training step
(MLP 256-512-512-10, batch 64 per rank, SGD, strict mode) on 2 ranks vs the
same DDP step on 1 rank: the ratio is the cost of the gradient all-reduce. Each rank runs with one
intra-op thread, as torchrun sets it (OMP_NUM_THREADS=1): with a thread pool
per rank on an oversubscribed host, the staging copies (PyTorch parallelizes
copies above 32768 elements) spend their time in OpenMP barriers.

    python benchmarks/bench_distributed.py [--sizes-mb 1 64] [--iters 10]
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time


def _ddp_step_ms(iters, warmup):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to("tpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device="tpu")
    y = torch.randint(0, 10, (64,), device="tpu")
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.tpu.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _worker(rank, world, store, sizes_mb, iters, warmup, out):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    import torch_tpu  # noqa: F401

    torch.tpu.set_device(rank)
    dist.init_process_group("tpu_dist", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    os.environ["TORCH_TPU_DIST_ZERO_COPY"] = "0"
    staged = dist.new_group(backend="tpu_dist")
    del os.environ["TORCH_TPU_DIST_ZERO_COPY"]
    assert dist.group.WORLD._get_backend(torch.device("tpu")).zero_copy
    assert not staged._get_backend(torch.device("tpu")).zero_copy
    rows = []
    for mb in sizes_mb if world > 1 else []:
        n = int(mb * 2**20) // 4
        t = torch.ones(n, device="tpu")
        c = torch.ones(n)
        host = torch.empty(n)
        times = {k: [] for k in ("tpu zero-copy", "tpu host-staged", "gloo cpu", "tpu->host copy", "host->tpu copy",
                                 "host memcpy")}

        def timed(name, fn, i):
            dist.barrier(group=gloo)
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)

        # interleaved per iteration, so that both sides see the same load
        for i in range(warmup + iters):
            timed("tpu zero-copy", lambda: (dist.all_reduce(t), torch.tpu.synchronize()), i)
            timed("tpu host-staged", lambda: (dist.all_reduce(t, group=staged), torch.tpu.synchronize()), i)
            timed("gloo cpu", lambda: dist.all_reduce(c, group=gloo), i)
            # the staging's parts, for the breakdown (host holds t's values)
            timed("tpu->host copy", lambda: host.copy_(t), i)
            timed("host->tpu copy", lambda: (t.copy_(host), torch.tpu.synchronize()), i)
            timed("host memcpy", lambda: host.copy_(c), i)
        timings = {k: statistics.median(v) for k, v in times.items()}
        # the values are still right after warmup + iters sums of ones
        # (t: two all_reduces per iteration, c: one)
        calls = warmup + iters
        assert t[:4].cpu().tolist() == [float(world ** (2 * calls))] * 4 or n == 0
        assert c[:4].tolist() == [float(world ** calls)] * 4 or n == 0
        rows.append({"mb": mb, **timings})
    ddp_ms = _ddp_step_ms(iters, warmup + 1)
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "ddp_ms": ddp_ms}, f)


def _launch(world, args, tmp):
    out = os.path.join(tmp, f"result{world}.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, f"store{world}"), args.sizes_mb,
                                               args.iters, args.warmup, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for p in procs:
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs) or not os.path.exists(out):
        raise SystemExit(f"bench_distributed: a rank failed: {[p.exitcode for p in procs]}")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 64])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    world = 2
    os.environ["TORCH_TPU_CPU_DEVICES"] = str(world)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        two = _launch(world, args, tmp)
        one = _launch(1, args, tmp)
    rows = two["rows"]
    factor = 2 * (world - 1) / world
    print(f"all_reduce float32, {world} ranks on localhost, median of {args.iters} calls, "
          f"load average {os.getloadavg()[0]:.2f} (1 min) at the end")
    print("| size | tpu zero-copy (ms) | tpu host-staged (ms) | gloo cpu (ms) | zero-copy busbw (GB/s) | "
          "gloo busbw (GB/s) | ratio zero-copy/gloo | ratio staged/gloo |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        nbytes = r["mb"] * 2**20
        bw = {k: factor * nbytes / r[k] / 1e9 for k in ("tpu zero-copy", "tpu host-staged", "gloo cpu")}
        print(f"| {r['mb']:g} MB | {r['tpu zero-copy'] * 1e3:.2f} | {r['tpu host-staged'] * 1e3:.2f} | "
              f"{r['gloo cpu'] * 1e3:.2f} | {bw['tpu zero-copy']:.2f} | {bw['gloo cpu']:.2f} | "
              f"{bw['tpu zero-copy'] / bw['gloo cpu']:.2f}x | {bw['tpu host-staged'] / bw['gloo cpu']:.2f}x |")
    print()
    print("where the staged tpu all_reduce's time goes (median ms; the staged call is a tpu->host copy into a")
    print("pooled buffer, gloo's all_reduce of it, a host->tpu copy back; the zero-copy call is gloo's alone)")
    print("| size | tpu->host copy | gloo all_reduce | host->tpu copy | sum | staged call | host memcpy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        parts = (r["tpu->host copy"], r["gloo cpu"], r["host->tpu copy"])
        print(f"| {r['mb']:g} MB | " + " | ".join(f"{x * 1e3:.2f}" for x in parts)
              + f" | {sum(parts) * 1e3:.2f} | {r['tpu host-staged'] * 1e3:.2f} | {r['host memcpy'] * 1e3:.2f} |")
    print()
    print("DDP training step (MLP 256-512-512-10, batch 64 per rank, SGD, strict), median ms")
    print("| ranks | ms per step | ratio to 1 rank |")
    print("|---|---|---|")
    print(f"| 1 | {one['ddp_ms']:.2f} | 1.00x |")
    print(f"| {world} | {two['ddp_ms']:.2f} | {two['ddp_ms'] / one['ddp_ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
