"""The compile cache (torch_tpu._precompile, TORCH_TPU_COMPILE_CACHE=1): a
fresh process loads a frame compiled by an earlier one instead of tracing it,
its results equal CPU eager, a corrupt entry falls back to a compile, and a
new input shape still compiles (guards still protect)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import functools, json, sys, warnings
    import torch, torch_tpu

    def keeps_name(fn):  # a functools.wraps decorator, as Hugging Face models use
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            return fn(self, *args, **kwargs)
        return wrapper

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.norm = torch.nn.LayerNorm(32)
            self.fc2 = torch.nn.Linear(32, 8)

        @keeps_name
        def forward(self, x, scale=None):
            h = torch.nn.functional.gelu(self.norm(self.fc1(x)))
            return {"out": self.fc2(h).softmax(-1), "hidden": h * 2}

    shapes = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = Block().eval()
    result = {"max_err": 0.0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model.to("tpu"), backend="tpu")  # loads a saved entry
        for shape in shapes:
            x = torch.randn(*shape)
            with torch.no_grad():
                got = compiled(x.to("tpu"))
                want = model.cpu()(x)
                model.to("tpu")
            for k in want:
                assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
                result["max_err"] = max(result["max_err"], (got[k].cpu() - want[k]).abs().max().item())
    result["traced"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    result["warnings"] = [str(w.message) for w in caught if "compile cache" in str(w.message)]
    print("RESULT " + json.dumps(result))
''')


def _run(tmp_path, shapes, cache):
    script = tmp_path / "model_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(cache), TORCH_TPU_COMPILE_CACHE="1")
    r = subprocess.run([sys.executable, str(script), json.dumps(shapes)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _entries(cache):
    root = cache / "dynamo"
    return sorted(p for p in root.rglob("*.entry")) if root.exists() else []


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def test_warm_process_skips_tracing_and_matches_cpu(tmp_path, cache):
    cold = _run(tmp_path, [[4, 16]], cache)
    assert cold["traced"] >= 1
    assert cold["max_err"] <= 1e-4
    assert len(_entries(cache)) == 1
    warm = _run(tmp_path, [[4, 16]], cache)
    assert warm["traced"] == 0, warm  # loaded, not traced again
    assert warm["max_err"] <= 1e-4
    assert warm["warnings"] == []


def test_corrupt_entry_falls_back_to_a_compile(tmp_path, cache):
    _run(tmp_path, [[4, 16]], cache)
    (entry,) = _entries(cache)
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2] + b"garbage")
    warm = _run(tmp_path, [[4, 16]], cache)
    assert warm["traced"] >= 1
    assert warm["max_err"] <= 1e-4
    assert any("ignoring" in w for w in warm["warnings"]), warm
    # the compile rewrote a good entry: the next process loads it
    again = _run(tmp_path, [[4, 16]], cache)
    assert again["traced"] == 0 and again["max_err"] <= 1e-4


def test_new_shape_recompiles_correctly(tmp_path, cache):
    _run(tmp_path, [[4, 16]], cache)
    warm = _run(tmp_path, [[4, 16], [6, 16], [4, 16]], cache)
    assert warm["traced"] >= 1  # the guards rejected the saved program for (6, 16)
    assert warm["max_err"] <= 1e-4


def test_disabled_without_opt_in(tmp_path, cache):
    script = tmp_path / "model_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(cache))
    env.pop("TORCH_TPU_COMPILE_CACHE", None)
    r = subprocess.run([sys.executable, str(script), json.dumps([[4, 16]])], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _entries(cache) == []
