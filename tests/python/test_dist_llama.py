"""A Llama-style model (transformers' LlamaForCausalLM, seeded random
weights, 2 layers, hidden 64, 4 heads, 2 kv heads, vocabulary 256) trained
with FSDP2 x tensor parallelism on tpu, against one CPU process.

Runs examples/llama_fsdp_tp.py under torchrun on localhost (real processes,
the launcher's process group killed if it runs past the timeout): the
example trains AdamW for N steps on a (dp, tp) DeviceMesh over device "tpu"
(TP: ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down over "tp"; FSDP2:
fully_shard per decoder layer + root over "dp") and, on rank 0, the same
model in one process on the CPU on the whole global batch. The test parses
the printed per-step losses and checks them itself: within 1e-4 relative of
the CPU run at every step (the issue's tolerance; measured 2x2: at most
4.7e-6, FSDP-only: at most 1.7e-7), and falling. It also checks from the
printed q_proj shard that the weights really are sharded over both mesh
dimensions.

Tiers: the default run is the 2-process FSDP-only variant (mesh (2, 1),
4 steps, 55 s on 2 busy cores); the 4-process 2 x 2 runs, 10 steps, strict
and fused mode, are in the full tier (75-150 s each).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_distributed import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-4


def _torchrun(nproc: int, *args: str, timeout: int) -> str:
    """Runs examples/llama_fsdp_tp.py under torchrun with `nproc` local
    processes; returns its output. Kills the whole process group and fails
    if it runs past `timeout` seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), os.path.join(ROOT, "examples", "llama_fsdp_tp.py"),
           *args]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TORCH_TPU_CPU_DEVICES": str(nproc)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun still running after {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def _check(out: str, steps: int, local_q_rows: int, placements: str) -> None:
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("LOSS ")]
    assert len(rows) == steps, out[-4000:]
    losses = [(float(r[2]), float(r[3])) for r in rows]
    for step, (par, ref) in enumerate(losses):
        assert abs(par - ref) <= TOL * abs(ref), f"step {step}: parallel loss {par} vs single process {ref}"
    assert losses[-1][0] < losses[0][0] - 0.1, f"loss did not fall: {losses}"
    m = re.search(r"q_proj weight on rank 0: local \[(\d+), (\d+)\] of \[64, 64\], placements (.*)", out)
    assert m, out[-4000:]
    assert (int(m.group(1)), int(m.group(2))) == (local_q_rows, 64), m.group(0)
    assert m.group(3) == placements, m.group(0)


def test_llama_fsdp2_two_ranks_matches_single_process():
    """Mesh (dp=2, tp=1): FSDP2 only; q_proj's local shard is half its rows."""
    out = _torchrun(2, "--tp", "1", "--steps", "4", timeout=420)
    _check(out, 4, 32, "(Shard(dim=0),)")


@pytest.mark.full_tier
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_llama_fsdp2_x_tp_2x2_matches_single_process(mode):
    """Mesh (dp=2, tp=2), 4 processes, 10 steps, in strict and in fused
    mode: q_proj is sharded over "tp" (ColwiseParallel: rows) and then over
    "dp" (FSDP2 on top of TP shards the TP shard's rows again:
    _StridedShard), a quarter of its rows per rank."""
    out = _torchrun(4, "--tp", "2", "--steps", "10", "--mode", mode, timeout=900)
    _check(out, 10, 16, "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
