#!/usr/bin/env python3
"""Time to first result of an eager op at a new shape (issue 12, item 1 / (d)).

For each configuration a fresh process with an empty on-disk executable
cache (TORCH_TPU_CACHE_DIR = a new temporary directory) runs the first float32
sample of each of the first OpInfos of the conformance harness
(tests/python/opinfo_harness.py; random ops and OpInfos without float32 are
skipped) once on tpu in strict mode, timing the call until its result is on
the host, and once on CPU. Every sample is the first call of its op at that
shape, so each tpu time includes the op's compile(s). The configurations run
interleaved in rounds in the same invocation (side by side): the default
(host-first calls, TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2: a key's first call
runs on the ATen CPU kernel and compiles nothing), TORCH_TPU_HOST_FIRST_COMPILE_AFTER=1
(the first call runs on the CPU kernel while the program compiles on the
background thread), TORCH_TPU_HOST_FIRST=0 (the call waits for its compile:
before), and that with XLA's default fusion emitters (before the single-op
compile options).

Printed: per configuration the median time to first result (ms), its split
(compile = torch_tpu.metrics()["compile_time_s"] delta: meta kernel, program
build, PJRT compile, disk-cache write; the rest: dispatch, launch, transfer),
compiles and host-served calls per sample, and the CPU median on the same
samples. metrics() waits for queued background compiles, so each sample
starts with the compile thread idle.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each configuration: environment variables of its processes (XLA_FLAGS is
# appended to the caller's).
CONFIGS = {
    "default, TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2 (host-first; a key seen once compiles nothing)": {
        "TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "2"},
    "TORCH_TPU_HOST_FIRST_COMPILE_AFTER=1 (host-first; served on the CPU while the program compiles)": {
        "TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "1"},
    "TORCH_TPU_HOST_FIRST=0 (compile first: before)": {"TORCH_TPU_HOST_FIRST": "0"},
    "TORCH_TPU_HOST_FIRST=0 + XLA defaults (fusion emitters on)": {
        "TORCH_TPU_HOST_FIRST": "0", "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"},
}


def child(n_ops: int) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import warnings
    import torch
    import torch_tpu
    import opinfo_harness as H

    torch.set_num_threads(1)
    torch_tpu.set_eager_mode("strict")
    w = torch.ones(3, device="tpu")  # runtime start-up, outside the timings
    (w + w).cpu()
    rows = []
    for op in H.op_db():
        if len(rows) >= n_ops:
            break
        if H.is_random(op) or torch.float32 not in H.tested_dtypes(op):
            continue
        try:
            samples = H.generate_samples(op, torch.float32, False, limit=1)
        except Exception:
            continue
        if not samples:
            continue
        sample = samples[0]
        try:
            prepared = H.Prepared(sample, torch.device("tpu"), grad=False)
            cpu_prepared = H.Prepared(sample, torch.device("cpu"), grad=False)
        except Exception:
            continue
        torch.tpu.synchronize()
        m0 = torch_tpu.metrics()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            try:
                H._to_cpu(prepared.call(op.op))
                torch.tpu.synchronize()
            except Exception:
                continue
            tpu_s = time.perf_counter() - start
            start = time.perf_counter()
            try:
                cpu_prepared.call(op.op)
            except Exception:
                continue
            cpu_s = time.perf_counter() - start
        m1 = torch_tpu.metrics()
        rows.append({"op": H.full_name(op), "tpu_s": tpu_s, "cpu_s": cpu_s,
                     "compile_s": m1["compile_time_s"] - m0["compile_time_s"],
                     "compiles": m1["compiles"] - m0["compiles"],
                     "host_served": m1["host_served"] - m0["host_served"],
                     "fallbacks": sum(m1["cpu_fallbacks"].values()) - sum(m0["cpu_fallbacks"].values())})
    print(json.dumps(rows))


def run_config(config: dict, n_ops: int, timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench_first_op.") as cache:
        env = dict(os.environ, TORCH_TPU_CACHE_DIR=cache)
        for k, v in config.items():
            env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--ops", str(n_ops)],
                             env=env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise SystemExit(f"child failed ({config or 'default'}):\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=60, help="OpInfos to sample (first float32 sample of each)")
    p.add_argument("--rounds", type=int, default=2, help="processes per configuration, interleaved")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.ops)
        return
    ms = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
    print(f"first float32 sample of the first {args.ops} OpInfos (non-random); strict mode; fresh process and "
          f"empty cache per configuration and round; {args.rounds} rounds interleaved; one thread")
    print()
    print("| configuration | samples | compiles/sample | median first result tpu (ms) | of which compile (ms) "
          "| rest (ms) | host-served calls/sample | median CPU (ms) | median tpu/CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):  # configurations interleaved, so load drifts hit them alike
        for name, config in CONFIGS.items():
            results[name] += run_config(config, args.ops, args.timeout)
    for name, rows in results.items():
        compiled = [r for r in rows if (r["compiles"] > 0 or r["host_served"] > 0) and r["fallbacks"] == 0]
        tpu = [r["tpu_s"] for r in compiled]
        comp = [r["compile_s"] for r in compiled]
        rest = [r["tpu_s"] - r["compile_s"] for r in compiled]
        cpu = [r["cpu_s"] for r in compiled]
        ratio = [r["tpu_s"] / max(r["cpu_s"], 1e-9) for r in compiled]
        cps = statistics.mean(r["compiles"] for r in compiled) if compiled else float("nan")
        hps = statistics.mean(r.get("host_served", 0) for r in compiled) if compiled else float("nan")
        print(f"| {name} | {len(compiled)} | {cps:.2f} | {ms(tpu):.1f} | {ms(comp):.1f} | {ms(rest):.2f} | {hps:.2f} "
              f"| {ms(cpu):.3f} | {statistics.median(ratio) if ratio else float('nan'):.0f}x |", flush=True)
    print()
    print("Samples counted: those that compiled or were host-served at least once (a new program) and ran without CPU fallback. Target (issue 12): "
          "median first result <= 5 ms. With host-first calls the compile runs on the background thread, off "
          "the first result's path: its column is the compile's time, not part of the first result's.")


if __name__ == "__main__":
    main()
