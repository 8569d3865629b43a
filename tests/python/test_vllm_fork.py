"""How the vLLM plugin lets vLLM start its engine core: fork or spawn.

torch_tpu/vllm/__init__.py register() probes the plugin without creating
the PJRT client, so the API server has none and vLLM may fork its engine
core (which then inherits vLLM's imports); platform.py picks spawn when the
process already has a client (its threads are not in a forked child), and a
child forked from a process with a live client refuses the device with a
clear error.  One real process (vLLM's imports are ~40 s here), real fork.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make installs requirements-serving.txt)")

SCRIPT = r"""
import os
os.environ["TORCH_TPU_VLLM"] = "1"
import torch, torch_tpu
from torch_tpu import _C
from torch_tpu.vllm import register
from torch_tpu.vllm import platform as P

assert register() == "torch_tpu.vllm.platform.TPUPlatform"
print("client after register", _C._is_initialized())
total_probed = P.TPUPlatform.get_device_total_memory()  # vLLM's API server asks this
print("client after total memory", _C._is_initialized())
P._choose_start_method()
print("method without client", os.environ["VLLM_WORKER_MULTIPROC_METHOD"])
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # as vLLM's CLI cli_env_setup sets it
P._choose_start_method()
print("method without client after the CLI's spawn", os.environ["VLLM_WORKER_MULTIPROC_METHOD"])

# a child forked before any client exists may use the device
pid = os.fork()
if pid == 0:
    try:
        P.TPUPlatform.set_device(torch.device("tpu", 0))
        ok = (torch.arange(5, device="tpu") * 3).cpu().tolist() == [0, 3, 6, 9, 12]
        os._exit(0 if ok else 3)
    except BaseException:
        os._exit(4)
print("clean fork child rc", os.waitpid(pid, 0)[1] >> 8)

assert torch.tpu.is_available()  # creates the client here
print("client after is_available", _C._is_initialized())
print("probed total memory equal", total_probed == int(torch.tpu.mem_get_info(0)[1]) > 0)
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
P._choose_start_method()
print("method with client", os.environ["VLLM_WORKER_MULTIPROC_METHOD"])

from torch_tpu.vllm.worker import TPUWorker

for name, use in [("set_device", lambda: P.TPUPlatform.set_device(torch.device("tpu", 0))),
                  ("init_device", lambda: TPUWorker.init_device(None))]:  # checks before self
    pid = os.fork()
    if pid == 0:
        try:
            use()
            os._exit(5)
        except RuntimeError as e:
            os._exit(0 if "forked after its parent created the PJRT client" in str(e) else 6)
        except BaseException:
            os._exit(7)
    print("client fork child", name, "rc", os.waitpid(pid, 0)[1] >> 8)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_PLUGINS", "VLLM_WORKER_MULTIPROC_METHOD")}
    return dict(env, **extra)


def test_fork_only_without_a_live_client():
    env = _env()
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("client", "method", "clean", "probed"))]
    assert lines == [
        "client after register False",
        "client after total memory False",
        "method without client fork",
        "method without client after the CLI's spawn fork",
        "clean fork child rc 0",
        "client after is_available True",
        "probed total memory equal True",
        "method with client spawn",
        "client fork child set_device rc 0",
        "client fork child init_device rc 0",
    ], out.stdout[-3000:] + out.stderr[-2000:]


USER_SCRIPT = r"""
import os
os.environ["TORCH_TPU_VLLM"] = "1"
from torch_tpu.vllm import platform as P
P._choose_start_method()
print("method", os.environ["VLLM_WORKER_MULTIPROC_METHOD"])
"""


def test_users_own_start_method_is_kept():
    """A VLLM_WORKER_MULTIPROC_METHOD the process was started with is the
    user's (not vLLM's CLI default): kept while there is no client."""
    out = subprocess.run([sys.executable, "-c", USER_SCRIPT],
                         env=_env(VLLM_WORKER_MULTIPROC_METHOD="spawn"),
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "method spawn" in out.stdout.splitlines(), out.stdout[-2000:]
