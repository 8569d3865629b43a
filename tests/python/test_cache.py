"""The on-disk executable cache: reuse across processes, atomic entries,
recovery from corrupt entries, size bound, and the command line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import run_python

# Each key is called twice, a sync point between: by default
# (TORCH_TPU_HOST_FIRST_COMPILE_AFTER=2) a key compiles at its call in a
# second sync epoch, and a key called once writes no entry.
PROGRAM = """
import torch, torch_tpu
x = torch.arange(12.0, device="tpu").reshape(3, 4)
for _ in range(2):
    y = (torch.softmax(x * 0.5, dim=-1) @ x.t()).sum(dim=0)
    torch.tpu.synchronize()
print(",".join(f"{v:.6f}" for v in y.cpu().tolist()))
m = torch_tpu.metrics()
print(m["disk_cache_hits"], m["disk_cache_misses"], m["disk_cache_errors"])
"""


def _run(cache_dir, **extra_env):
    env = {"TORCH_TPU_CACHE_DIR": str(cache_dir)}
    env.update(extra_env)
    r = run_python(PROGRAM, env=env)
    assert r.returncode == 0, r.stderr
    values, counts = r.stdout.strip().splitlines()
    hits, misses, errors = map(int, counts.split())
    return values, hits, misses, errors, r.stderr


def _entries(cache_dir):
    return sorted(p for p in os.listdir(cache_dir) if p.endswith(".pjrt"))


def test_second_process_hits(tmp_path):
    v1, hits1, misses1, _, _ = _run(tmp_path)
    assert hits1 == 0 and misses1 > 0
    assert len(_entries(tmp_path)) == misses1
    v2, hits2, misses2, _, _ = _run(tmp_path)
    assert (hits2, misses2) == (misses1, 0)
    assert v1 == v2


def test_compiler_flags_from_the_environment_are_part_of_the_key(tmp_path):
    # XLA_FLAGS changes the code XLA compiles for the same module: a process
    # with other flags must not reuse executables compiled without them.
    v1, _, misses1, _, _ = _run(tmp_path)
    v2, hits2, misses2, _, _ = _run(tmp_path, XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert (hits2, misses2) == (0, misses1)
    assert v1 == v2
    assert len(_entries(tmp_path)) == 2 * misses1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "key"])
def test_corrupt_entry_is_recompiled_and_replaced(tmp_path, damage):
    reference, _, misses, _, _ = _run(tmp_path)
    victim = tmp_path / _entries(tmp_path)[0]
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        victim.write_bytes(os.urandom(len(data)))
    else:  # a different plugin version in the stored key
        victim.write_bytes(data.replace(b"torch_tpu 0.1.0", b"torch_tpu 9.9.9", 1))
    values, hits, misses2, errors, stderr = _run(tmp_path)
    assert values == reference
    assert errors == 1 and misses2 == 1 and hits == misses - 1
    assert "recompiling" in stderr
    # replaced: a third run hits everything
    _, hits3, misses3, errors3, _ = _run(tmp_path)
    assert (misses3, errors3) == (0, 0) and hits3 == misses


def test_two_processes_filling_at_once(tmp_path):
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert outs[0][0].splitlines()[0] == outs[1][0].splitlines()[0]
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]  # no leftovers
    _, hits, misses, errors, _ = _run(tmp_path)
    assert misses == 0 and errors == 0 and hits > 0


def test_size_bound_evicts(tmp_path):
    _, _, misses, _, _ = _run(tmp_path, TORCH_TPU_CACHE_MAX_BYTES="1")
    assert len(_entries(tmp_path)) <= 1


# The size bound lists the directory (a stat per entry) at a process's first
# write, then only when its writes pass the bound: with room, many writes
# cost one listing; with the bound tight, each write past it lists and
# evicts, so the directory is back under the bound after the process.
SCANS = """
import json, torch, torch_tpu
torch_tpu.set_eager_mode("debug")  # every new program compiles (and is written) at once
for n in range(3, 15):
    (torch.arange(float(n), device="tpu") * 2.5).cpu()
m = torch_tpu.metrics()
print(json.dumps({k: m["disk_cache_" + k] for k in ("writes", "scans", "evictions")}))
"""


@pytest.mark.parametrize("bound", [None, 60000])
def test_size_bound_lists_the_directory_when_due(tmp_path, bound):
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path)}
    if bound:
        env["TORCH_TPU_CACHE_MAX_BYTES"] = str(bound)
    r = run_python(SCANS, env=env)
    assert r.returncode == 0, r.stderr
    out = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    total = sum(os.path.getsize(tmp_path / e) for e in _entries(tmp_path))
    assert out["writes"] >= 10, out  # arange at 12 sizes, mul until its bucket programs serve it
    if bound is None:
        assert out["scans"] == 1 and out["evictions"] == 0, out
    else:
        assert 1 < out["scans"] <= out["writes"] and out["evictions"] > 0, out
        assert total <= bound, (total, out)


def test_empty_dir_disables(tmp_path):
    r = run_python(PROGRAM, env={"TORCH_TPU_CACHE_DIR": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[1] == "0 0 0"


def test_cli_info_and_clear(tmp_path):
    _run(tmp_path)
    _run(tmp_path)
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path)}
    r = run_python("import sys; from torch_tpu.__main__ import main; sys.exit(main(['cache', 'info']))", env=env)
    assert r.returncode == 0, r.stderr
    n = len(_entries(tmp_path))
    assert f"entries       {n}" in r.stdout
    assert "hit rate      50.0%" in r.stdout
    r = run_python("import sys; from torch_tpu.__main__ import main; sys.exit(main(['cache', 'clear']))", env=env)
    assert r.returncode == 0 and f"removed {n} entries" in r.stdout
    assert _entries(tmp_path) == []


def test_cli_info():
    r = run_python("import sys; from torch_tpu.__main__ import main; sys.exit(main(['info']))")
    assert r.returncode == 0, r.stderr
    assert "platform      cpu" in r.stdout and "PJRT API      0." in r.stdout and "tpu:0" in r.stdout
