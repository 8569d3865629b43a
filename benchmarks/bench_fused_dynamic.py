#!/usr/bin/env python3
"""Bounded dynamism in fused eager mode (issue 12, benchmark (e)).

Two workloads, each configuration in a fresh process with an empty
TORCH_TPU_CACHE_DIR, run one after the other in this one invocation:

1. 40 AdamW training steps of an MLP (256-512-512-10, GELU, batch 64,
   foreach=False: about 90 recorded calls a step) in fused mode, with a sync
   (`loss.item()`) every step, every 10 steps, or only once at the end.
   Targets: one sync at the end takes at most 1.2x the time of a sync every
   step, and at most 4 compiles happen after the first two steps.
2. 20 sequence lengths through a small transformer encoder layer (d_model 64,
   4 heads, feed-forward 128, eval, no_grad; one forward and a `.cpu()` per
   length) in strict and in fused mode. Target: fused is never slower than
   strict.

Printed: wall time, compiles (all, and after the first two steps), fused
regions, and the largest difference against the first configuration (MLP)
or CPU PyTorch (encoder), which must be within float32 tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STEPS = 40
LENGTHS = [5 + 3 * i for i in range(20)]


def _mlp(sync_every: int) -> dict:
    import torch
    import torch_tpu

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10)).to("tpu")
    x = torch.randn(64, 256).to("tpu")
    y = torch.randint(0, 10, (64,)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    torch_tpu.set_eager_mode("fused")
    losses = []
    after_two = None
    start = time.perf_counter()
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if sync_every and (step + 1) % sync_every == 0:
            loss.item()
        if step == 1:
            after_two = torch_tpu.metrics()
    values = torch.stack(losses).cpu()
    elapsed = time.perf_counter() - start
    m = torch_tpu.metrics()
    return {"seconds": elapsed, "compiles": m["compiles"], "compiles_after_2": m["compiles"] - after_two["compiles"],
            "regions": m["fused_regions"], "values": values.tolist()}


def _encoder(mode: str) -> dict:
    import torch
    import torch_tpu

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True,
                                             dropout=0.0).eval()
    inputs = [torch.randn(2, n, 64) for n in LENGTHS]
    with torch.no_grad():
        ref = [layer(x) for x in inputs]
    layer_tpu = layer.to("tpu")
    tpu_inputs = [x.to("tpu") for x in inputs]
    torch_tpu.set_eager_mode(mode)
    outs = []
    start = time.perf_counter()
    with torch.no_grad():
        for x in tpu_inputs:
            outs.append(layer_tpu(x).cpu())
    elapsed = time.perf_counter() - start
    m = torch_tpu.metrics()
    err = max(float((o - r).abs().max()) for o, r in zip(outs, ref))
    return {"seconds": elapsed, "compiles": m["compiles"], "regions": m["fused_regions"], "max_abs_err": err}


def _child(spec: str) -> None:
    import torch
    torch.set_num_threads(1)
    kind, arg = spec.split(":")
    result = _mlp(int(arg)) if kind == "mlp" else _encoder(arg)
    print("RESULT " + json.dumps(result))


def _run(spec: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCH_TPU_CACHE_DIR=cache)
        r = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True,
                           timeout=timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{spec} failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--rounds", type=int, default=5, help="interleaved processes per mode of the encoder table")
    args = p.parse_args()
    if args.child:
        return _child(args.child)

    print(f"## MLP AdamW, {STEPS} steps, fused mode (fresh process, empty cache each)\n")
    print("| sync pattern | seconds | ratio to sync every step | compiles | compiles after step 2 | fused regions "
          "| max abs diff of losses |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for label, every in [("every step", 1), ("every 10 steps", 10), ("once at the end", 0)]:
        r = _run(f"mlp:{every}", args.timeout)
        if base is None:
            base = r
        diff = max(abs(a - b) for a, b in zip(r["values"], base["values"]))
        print(f"| {label} | {r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f}x | {r['compiles']} "
              f"| {r['compiles_after_2']} | {r['regions']} | {diff:.2e} |", flush=True)

    print(f"\n## Transformer encoder layer, {len(LENGTHS)} sequence lengths ({LENGTHS[0]}..{LENGTHS[-1]}), "
          "one forward each (fresh process, empty cache each)\n")
    # Strict and fused interleaved, args.rounds fresh processes each: seconds
    # are medians, the ratio the median [min-max] of the per-round ratios
    # (one process's time varies by ~10%); counts are the first round's.
    runs = {"strict": [], "fused": []}
    for _ in range(max(1, args.rounds)):
        for mode in runs:
            runs[mode].append(_run(f"enc:{mode}", args.timeout))
    print(f"{max(1, args.rounds)} interleaved rounds.\n")
    print("| mode | seconds | ratio to strict | compiles | fused regions | max abs err vs CPU |")
    print("|---|---|---|---|---|---|")
    for mode, rs in runs.items():
        r = rs[0]
        v = [a["seconds"] / b["seconds"] for a, b in zip(rs, runs["strict"])]
        print(f"| {mode} | {statistics.median(x['seconds'] for x in rs):.3f} | "
              f"{statistics.median(v):.2f}x [{min(v):.2f}-{max(v):.2f}] | {r['compiles']} "
              f"| {r['regions']} | {max(x['max_abs_err'] for x in rs):.1e} |", flush=True)


if __name__ == "__main__":
    main()
