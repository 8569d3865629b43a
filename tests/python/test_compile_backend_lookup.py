"""Looking up backend="tpu" (torch_tpu._seed_dynamo_backend): Dynamo's
registry names ``tpu`` as its entry point before the first lookup, so
``torch.compile(..., backend="tpu")`` does not run ``registry._lazy_import()``
(which imports every Dynamo backend module); the backend found is
torch_tpu's, its results equal CPU's, and the other backends are still
listed. Fresh processes: torch_tpu imported before torch._dynamo (the hook)
and after it."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    if os.environ.get("DYNAMO_FIRST"):
        import torch._dynamo
    import torch_tpu
    from torch._dynamo.backends import registry

    fn = registry.lookup_backend("tpu")
    lazy_imports = registry._lazy_import.cache_info().currsize
    x = torch.randn(4, 5)
    got = torch.compile(lambda t: (t * 2).sin(), backend="tpu")(x.to("tpu")).cpu()
    result = {
        "ours": fn is sys.modules["torch_tpu._dynamo"].tpu_backend,
        "lazy_imports_at_lookup": lazy_imports,
        "err": (got - (x * 2).sin()).abs().max().item(),
        "hooks_left": sum(type(f).__name__ == "_RegistryHook" for f in sys.meta_path),
    }
    names = registry.list_backends()
    result["listed"] = "tpu" in names and "inductor" in names
    result["same_after_listing"] = registry.lookup_backend("tpu") is fn
    print("RESULT " + json.dumps(result))
''')


@pytest.mark.parametrize("dynamo_first", [False, True])
def test_tpu_lookup_skips_importing_every_backend(tmp_path, dynamo_first):
    script = tmp_path / "lookup.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(tmp_path / "cache"), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    if dynamo_first:
        env["DYNAMO_FIRST"] = "1"
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert result["ours"], result
    assert result["err"] <= 1e-6, result
    # the lookup imported no other backend (a compile afterwards may:
    # convert_frame's clear_compile_context_weakrefs asks the registry)
    assert result["lazy_imports_at_lookup"] == 0, result
    assert result["listed"] and result["same_after_listing"], result
    assert result["hooks_left"] == 0, result


# A warm process (its frame loaded from the compile cache) installs the entry
# with the garbage collector paused (torch_tpu._precompile) and never calls the
# backend; torch_tpu._dynamo._DirectBackend stands where Dynamo's
# get_compiler_fn would first import torch._dynamo.repro.after_dynamo (AOT
# modules, partitioners, networkx) for any backend.
WARM = textwrap.dedent('''
    import json, sys
    import torch, torch_tpu
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(5, 8)
    want = model(x)
    import gc
    from torch._dynamo import package
    from torch._dynamo.backends import registry
    registry.lookup_backend("tpu")  # imports torch_tpu._dynamo: the compile cache's patches are in
    load, gc_during_load = package.load_guards_state, []

    def recording(*args, **kwargs):
        gc_during_load.append(gc.isenabled())
        return load(*args, **kwargs)

    package.load_guards_state = recording
    compiled = torch.compile(model.to("tpu"), backend="tpu")
    with torch.no_grad():
        got = compiled(x.to("tpu")).cpu()
    from torch._dynamo.utils import counters
    print("RESULT " + json.dumps({
        "err": (got - want).abs().max().item(),
        "traced": counters["stats"].get("unique_graphs", 0),
        "after_dynamo": "torch._dynamo.repro.after_dynamo" in sys.modules,
        "networkx": "networkx" in sys.modules,
        "gc_during_load": gc_during_load,
        "gc_after": gc.isenabled(),
    }))
''')


def _result(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])


def test_warm_start_skips_dynamo_repro_chain_and_collection(tmp_path):
    script = tmp_path / "warm.py"
    script.write_text(WARM)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_TPU_COMPILE_CACHE", "TORCH_TPU_COMPILE_CACHE_DIR")}
    env["TORCH_TPU_CACHE_DIR"] = str(tmp_path / "cache")
    empty, warm = (_result(subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                                          timeout=600)) for _ in range(2))
    assert empty["err"] <= 1e-5 and warm["err"] <= 1e-5, (empty, warm)
    assert empty["traced"] == 1 and warm["traced"] == 0, (empty, warm)  # the warm frame came from the cache
    assert not warm["after_dynamo"] and not warm["networkx"], warm
    # the saved entry is installed with the garbage collector paused, and it is on again after
    assert warm["gc_during_load"] == [False] and warm["gc_after"], warm


def test_direct_backend_only_for_tpu_and_minifier_still_wraps(monkeypatch):
    import torch
    import torch._dynamo
    from torch._dynamo import eval_frame
    from torch._dynamo.repro import after_dynamo

    import torch_tpu._dynamo as tpu_dynamo

    assert isinstance(eval_frame.get_compiler_fn("eager"), after_dynamo.WrapBackendDebug)
    wrapped = eval_frame.get_compiler_fn("tpu")
    assert isinstance(wrapped, tpu_dynamo._DirectBackend)
    assert wrapped._torchdynamo_orig_backend is tpu_dynamo.tpu_backend

    # torch._dynamo.config.repro_after set: the call goes through PyTorch's
    # WrapBackendDebug (the minifier's hook), as for every other backend.
    # ("aot": with "dynamo" WrapBackendDebug also reruns the compiled graph
    # on the example inputs unboxed, which the tpu backend's boxed callable
    # refuses with or without this wrapper.)
    calls = []
    original_call = after_dynamo.WrapBackendDebug.__call__

    def counting(self, *args, **kwargs):
        calls.append(self._compiler_name)
        return original_call(self, *args, **kwargs)

    monkeypatch.setattr(after_dynamo.WrapBackendDebug, "__call__", counting)
    # config.patch, not monkeypatch.setattr: pytest >= 9.2 restores a module
    # attribute missing from its __dict__ by deleting it, and ConfigModule's
    # __delattr__ then hides repro_after from every later test.
    torch._dynamo.reset()
    x = torch.randn(4, 5)
    with torch._dynamo.config.patch(repro_after="aot"):
        got = torch.compile(lambda t: (t * 3).cos(), backend="tpu")(x.to("tpu")).cpu()
    assert calls == ["tpu"], calls
    assert (got - (x * 3).cos()).abs().max().item() <= 1e-6
    assert torch._dynamo.config.repro_after is None
    torch._dynamo.reset()
