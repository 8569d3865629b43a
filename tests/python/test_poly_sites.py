"""Compiles per op site over many sequence lengths (issue 12 (c): at most 4
per op over 20 lengths) and the mechanisms that keep them there
(docs/design.md "Shape-polymorphic eager programs"):

- a key's host-first calls count once per sync epoch, so two layers calling
  one key at a shape seen once compile no exact program (test_host_first.py
  covers the counting itself);
- n = 1 of a multi-dim family (attention's q, k, v boxes, [n, n] masks and
  scores) runs the family's bucket program (BoxOf places size-1 dims);
- mm/addmm rows follow the buffer a [b, t, d] bucket program gave their
  left matrix (b * bucket(t) rows), so linears do not resize activations;
- a storage's buffer is given another size without a program where the
  storage was never written (zeros of that size) or holds a host upload
  (StorageBuffer::host: uploaded again at that size).

Every value is CPU PyTorch's on the same inputs (float64 within 1e-10).
Each test runs in a fresh process with an empty cache.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_python

BLOCK = r"""
import json, math, os, torch, torch_tpu
import torch.nn as nn, torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
torch_tpu.set_eager_mode(mode)
LENGTHS = [5, 1, 2, 3, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 40, 48, 63, 64, 65]
class Block(nn.Module):  # benchmarks/bench_dynamic_shapes.py's block (c)
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
class Sites(TorchDispatchMode):
    # compiles per op site: the i-th ATen call of a forward (a compile is
    # counted when it is queued: the delta around a call is that call's)
    def __init__(self):
        super().__init__()
        self.i, self.counts = 0, {}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c0 = torch_tpu._C._compiles_queued()
        out = func(*args, **(kwargs or {}))
        site = f"{self.i}:{func}"
        self.i += 1
        self.counts[site] = self.counts.get(site, 0) + torch_tpu._C._compiles_queued() - c0
        return out
torch.manual_seed(0)
cpu_block = Block().double().eval()
block = Block().double().eval()
block.load_state_dict(cpu_block.state_dict())
block = block.to("tpu")
g = torch.Generator().manual_seed(1)
xs = [torch.randn(2, n, 64, generator=g, dtype=torch.float64) for n in LENGTHS]
sites, err, passes = Sites(), 0.0, []
for p in range(3):
    c0 = torch_tpu.metrics()["compiles"]
    for x in xs:
        sites.i = 0
        with torch.no_grad():
            if mode == "strict":
                with sites:
                    y = block(x.to("tpu"))
            else:
                y = block(x.to("tpu"))
            err = max(err, (y.cpu() - cpu_block(x)).abs().max().item())
    passes.append(torch_tpu.metrics()["compiles"] - c0)
by_op = {k: v["compiles"] for k, v in torch_tpu.metrics()["compiles_by_op"].items()}
print(json.dumps({"sites": sites.counts, "by_op": by_op, "passes": passes, "err": err}))
"""


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_block_twenty_lengths_at_most_four_per_site(mode, tmp_path):
    """The transformer block of benchmarks (c) over its 20 lengths (1..65),
    three passes: strict mode compiles at most 4 programs per op site over
    them (the i-th ATen call of the forward: 4 power-of-two buckets, 16, 32,
    64, 128; before: 5-6, an exact program for n = 1 and for the first
    lengths of ops two layers share); fused mode at most 4 per op per site
    (its region programs at most 4 each); no tpu::resize_buffer program
    (before: 33, one per pair of buffer sizes met); the third pass compiles
    nothing; outputs CPU's at every length (float64 within 1e-10)."""
    r = run_python(f"mode = {mode!r}\n" + BLOCK, env={"TORCH_TPU_CACHE_DIR": str(tmp_path)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["err"] <= 1e-10, out["err"]
    assert out["passes"][2] == 0, out["passes"]
    by_op = out["by_op"]
    assert "tpu::resize_buffer" not in by_op, by_op
    if mode == "strict":
        counts = out["sites"]
        assert len(counts) > 40, counts  # every call of the forward is a site
        assert max(counts.values()) <= 4, {k: v for k, v in counts.items() if v > 4}
        assert sum(counts.values()) == sum(by_op.values()), (counts, by_op)
    # Per op: its sites in the block (linears, the q/k/v/y copies, the two matmuls) times 4.
    sites = {"aten::addmm": 4, "aten::clone": 4, "aten::bmm": 2}
    for name, n in by_op.items():
        assert n <= 4 * sites.get(name, 1), (name, by_op)
    assert by_op.get("aten::addmm", 0) >= 4 and by_op.get("aten::_softmax", 0) >= 2, by_op


N1 = r"""
import json, torch, torch_tpu
torch_tpu.set_eager_mode("strict")
def attn(qkv, dev):
    qkv = qkv.to(dev)
    n = qkv.shape[1]
    q, k, v = (z.view(2, n, 2, 16).transpose(1, 2) for z in qkv.split(32, dim=-1))
    s = q @ k.transpose(-1, -2)                           # clones of the q, k boxes, bmm
    keep = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    p = s.masked_fill(~keep, float("-inf")).softmax(-1)  # [2, 2, n, n] with an [n, n] mask
    return [p, p @ v]
g = torch.Generator().manual_seed(2)
def run(n):
    qkv = torch.randn(2, n, 96, generator=g, dtype=torch.float64)
    want, got = attn(qkv, "cpu"), attn(qkv, "tpu")
    err = 0.0
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, b.shape)
        big = [d for d in range(b.dim()) if b.shape[d] > 1]
        assert all(a.stride(d) == b.stride(d) for d in big), (n, a.stride(), b.stride())
        a = a.cpu()
        assert torch.equal(a.isinf(), b.isinf()), n
        err = max(err, (a - b).nan_to_num(posinf=0, neginf=0).abs().max().item())
    return err
err = 0.0
for p in range(2):
    for n in [5, 3, 7, 9, 12]:  # families ripe, bucket 16 programs compiled
        err = max(err, run(n))
torch_tpu.metrics()
c0 = torch_tpu.metrics()["compiles"]
for p in range(3):
    err = max(err, run(1))
n1 = torch_tpu.metrics()["compiles"] - c0
by_op = {k: v["compiles"] for k, v in torch_tpu.metrics()["compiles_by_op"].items()}
print(json.dumps({"err": err, "n1_compiles": n1, "by_op": by_op}))
"""


def test_n1_runs_the_multi_dim_bucket_program(tmp_path):
    """n = 1 of multi-dim families — attention's q, k, v (strided boxes of a
    [2, n, 96] block at offsets 0, 32, 64, whose size-1 dim n carries
    another stride at n = 1 than at n >= 2), their bmm, an [n, n] causal
    mask (fill_, tril, bitwise_not), [2, 2, n, n] scores (masked_fill,
    softmax) — runs the bucket-16 programs its family compiled at lengths
    3..12 (before: an exact program per op at n = 1): three calls at n = 1
    compile nothing; values CPU's (float64 within 1e-12, -inf where CPU has
    it), strides of dims of size > 1 CPU's."""
    r = run_python(N1, env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "2"},
                   timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["err"] <= 1e-12, out
    assert out["n1_compiles"] == 0, out


SHADOW = r"""
import json, torch, torch_tpu
torch_tpu.set_eager_mode("strict")
def resizes():
    return torch_tpu.metrics()["compiles_by_op"].get("tpu::resize_buffer", {}).get("compiles", 0)
g = torch.Generator().manual_seed(4)
out = {"ok": True}
# A dim-1 family of [2, n, 8] (bucket programs once 2 lengths compiled exact ones).
def f(x):
    return x * 2.5 - 1
for n in (3, 5):
    for _ in range(2):
        x = torch.randn(2, n, 8, generator=g, dtype=torch.float64)
        out["ok"] &= torch.equal(f(x.to("tpu")).cpu(), f(x))
r0 = resizes()
for n in (6, 7, 9, 10, 11, 12, 13, 14):
    for _ in range(2):  # fresh uploads of 8 sizes meeting the bucket-16 program
        x = torch.randn(2, n, 8, generator=g, dtype=torch.float64)
        out["ok"] &= torch.equal(f(x.to("tpu")).cpu(), f(x))
out["upload_resizes"] = resizes() - r0
# The host copy follows the storage's value: a copy from the CPU into it
# (overwritten in place), then an in-place program, each read by the bucket program.
x = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
t = x.to("tpu")
x2 = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
t.copy_(x2)
out["ok"] &= torch.equal(f(t).cpu(), f(x2))
u = torch.randn(2, 9, 8, generator=g, dtype=torch.float64)
tu = u.to("tpu")
tu.mul_(3)
out["ok"] &= torch.equal(f(tu).cpu(), f(u * 3))
# Never written: an empty tensor filled in place by a bucket program.
for n in (3, 5, 7, 9, 11):
    for _ in range(2):
        e = torch.empty(2, n, 8, dtype=torch.float64, device="tpu")
        e.fill_(1.5)
        out["ok"] &= torch.equal(e.cpu(), torch.full((2, n, 8), 1.5, dtype=torch.float64))
out["resizes"] = resizes()
print(json.dumps(out))
"""


def test_buffers_take_a_bucket_size_without_a_program(tmp_path):
    """An upload (or a host-served result) read by a bucket program is
    uploaded again at the bucket's size from the host copy kept with it, and
    a never-written storage gets zeros of that size: no tpu::resize_buffer
    program (before: one per (upload size, bucket) pair: 8 here). The host
    copy follows the storage: after copy_ from the CPU (an in-place
    overwrite of the buffer) and after an in-place op, the bucket program
    reads the new values (exact)."""
    r = run_python(SHADOW, env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_HOST_FIRST_COMPILE_AFTER": "2"},
                   timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    assert out["upload_resizes"] == 0 and out["resizes"] == 0, out
