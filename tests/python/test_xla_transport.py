"""tpu_dist's XLA-native transport (TORCH_TPU_DIST_TRANSPORT=xla) on tpu
tensors, in ONE process: a group of one rank (the CPU plugin's client does
not span processes, so larger groups must stay host-staged; the collective
programs themselves are proven over 2 and 4 devices in
tests/cpp/xla_transport_test.cpp).

What a one-rank group checks here is the tensor plumbing around the
programs: storage buffers of any capacity in, results written back in place
into views with offsets, non-contiguous inputs, dtypes, PREMUL_SUM's
factor, AVG's division, and one compile per collective and shape. Each
check compares with the same operation on CPU tensors (exact). Runs in a
subprocess (its own process group and environment), bounded by a timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import datetime, json, os, sys
import torch
import torch.distributed as dist
import torch_tpu

dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
pg = dist.distributed_c10d._get_default_group()
backend = pg._get_backend(torch.device("tpu"))
out = {"transport": backend.transport, "usable": backend.xla_native_usable, "checks": []}

def check(name, got, want):
    got = got.cpu()
    ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    out["checks"].append([name, bool(ok), str(got.flatten()[:6].tolist()), str(want.flatten()[:6].tolist())])

dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
for dt in dtypes:
    base = (torch.arange(24) % 7 - 3)
    x = (base != 0) if dt == torch.bool else (base.to(dt) / 2 if dt.is_floating_point else base.to(dt))
    x = x.reshape(4, 6)
    # all_reduce SUM in place (world 1: the value itself)
    t = x.to("tpu")
    dist.all_reduce(t)
    check(f"all_reduce sum {dt}", t, x)
    if dt.is_floating_point:
        t = x.to("tpu")
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        check(f"all_reduce avg {dt}", t, x)
        t = x.to("tpu")
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        check(f"all_reduce premul 2.0 {dt}", t, x * 2)
        t = x.to("tpu")
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.5], dtype=dt, device="tpu")))
        check(f"all_reduce premul tensor 0.5 {dt}", t, x * 0.5)
    # a view at an offset of a bigger storage, written back in place
    big = torch.zeros(8, 6, dtype=dt).to("tpu")
    view = big[2:6]
    view.copy_(x.to("tpu"))
    dist.all_reduce(view, op=dist.ReduceOp.MAX)
    want = torch.zeros(8, 6, dtype=dt); want[2:6] = x
    check(f"all_reduce max view {dt}", big, want)
    # all_gather_into_tensor: non-contiguous input, output a slice of a bigger tensor
    src = x.to("tpu").t()                       # [6, 4], not contiguous
    dst_big = torch.zeros(10, 4, dtype=dt).to("tpu")
    dist.all_gather_into_tensor(dst_big[3:9], src)
    want = torch.zeros(10, 4, dtype=dt); want[3:9] = x.t()
    check(f"all_gather_into_tensor {dt}", dst_big, want)
    # reduce_scatter_tensor, broadcast, all_to_all_single (even)
    o = torch.empty(4, 6, dtype=dt).to("tpu")
    dist.reduce_scatter_tensor(o, x.to("tpu"), op=dist.ReduceOp.MIN)
    check(f"reduce_scatter_tensor min {dt}", o, x)
    t = x.to("tpu")
    dist.broadcast(t, src=0)
    check(f"broadcast {dt}", t, x)
    o = torch.empty(4, 6, dtype=dt).to("tpu")
    dist.all_to_all_single(o, x.to("tpu"))
    check(f"all_to_all_single {dt}", o, x)

# one compile per collective and shape: after a first round, repeating the
# same calls compiles nothing
def round_():
    t = torch.ones(4, 6).to("tpu")
    dist.all_reduce(t)
    g = torch.empty(4, 6).to("tpu")
    dist.all_gather_into_tensor(g, t)
    torch.tpu.synchronize()
    return g
round_()
m0 = torch_tpu.metrics()["compiles"]
for _ in range(3):
    g = round_()
m1 = torch_tpu.metrics()["compiles"]
out["repeat_compiles"] = m1 - m0
out["repeat_value"] = g.cpu().eq(1).all().item()
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


def _run(env_value: str, timeout: int = 300, cache_dir=None):
    env = dict(os.environ)
    env["TORCH_TPU_DIST_TRANSPORT"] = env_value
    if cache_dir is not None:
        env["TORCH_TPU_CACHE_DIR"] = str(cache_dir)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_xla_native_one_rank_matches_cpu(tmp_path):
    proc = _run("xla", cache_dir=tmp_path)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["transport"] == "xla-native"
    assert out["usable"] is False  # the CPU plugin's client is one process
    failed = [c for c in out["checks"] if not c[1]]
    assert not failed, failed
    assert len(out["checks"]) == 5 * 6 + 3 * 3  # every check ran
    assert out["repeat_compiles"] == 0
    assert out["repeat_value"]
    # the collectives ran as StableHLO collective programs: the on-disk
    # cache's entries hold their module text (a one-rank broadcast has no
    # collective_permute round)
    entries = b"".join(f.read_bytes() for f in tmp_path.rglob("*") if f.is_file())
    for op in (b"stablehlo.all_reduce", b"stablehlo.all_gather", b"stablehlo.reduce_scatter",
               b"stablehlo.all_to_all"):
        assert op in entries, op


def test_default_stays_host_staged():
    script = SCRIPT[:SCRIPT.index("def check(")] + 'dist.destroy_process_group()\nprint("RESULT " + json.dumps(out))\n'
    env = dict(os.environ)
    env.pop("TORCH_TPU_DIST_TRANSPORT", None)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["transport"] == "host-staged"
    assert out["usable"] is False


def test_bad_setting_raises():
    proc = _run("nccl", timeout=120)
    assert proc.returncode != 0
    assert "TORCH_TPU_DIST_TRANSPORT must be 'host' or 'xla', got 'nccl'" in proc.stderr
