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
