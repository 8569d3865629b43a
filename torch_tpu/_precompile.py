"""A warm start for ``torch.compile(model, backend="tpu")`` in a new process.

Opt in with ``TORCH_TPU_COMPILE_CACHE=1`` (read when the ``tpu`` Dynamo
backend is first looked up) or ``torch_tpu._precompile.enable()`` before
``torch.compile``. A frame compiled by the tpu backend is then saved under
``$TORCH_TPU_CACHE_DIR/dynamo/`` right after its compile: Dynamo's transformed
bytecode and guards (PyTorch's caching precompile,
``torch._dynamo.config.caching_precompile``) and, per graph, the ATen calls of
its tpu program (not the XLA executable: that comes from the executable
cache). A later process running the same code loads it at ``torch.compile``
and skips Dynamo's tracing, AOTAutograd and the FX walk: its first call
replays the ATen calls into a program and loads the executable.

Guards still protect every call (tensor shapes, dtypes, strides, grad mode,
module attributes): a call they reject compiles as usual and the saved entry
grows by that compile. Not saved: graphs whose AOTAutograd wrapper does work
(input mutations, outputs aliasing inputs, training graphs), graphs with
symbolic shapes, frames compiled by other backends.

Keys: the function's qualified name, first line and bytecode, plus the
torch, Python and torch_tpu versions and the torch_tpu extension's file; Dynamo
itself checks the source of every inlined function at load. An entry that
cannot be read or installed (corrupt, truncated, written by other code) is
reported with one warning and the frame compiles as usual.

PyTorch 2.13's caching precompile needs three corrections for functions
decorated with ``functools.wraps`` (Hugging Face models' ``forward``), made
here while enabled: the decorated function's globals are its defining
module's, not ``__module__``'s; modules Dynamo's bytecode loads under a
generated name are recorded with the entry; and guards reached through a
closure cell (``forward.__closure__[0].cell_contents``, the wrapped function)
are not saved, as PyTorch already does for ``ID_MATCH`` and ``CLOSURE_MATCH``.

Loading, saved guards are built once, not twice: PyTorch builds them a first
time only to run its caching-precompile filter, which already kept exactly
these guards when the entry was written (see ``_filter_keeps_all``).
"""
from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import sys
import tempfile
import threading
import warnings
from typing import Any, Callable

import torch

from ._graph import _Program, stats

__all__ = ["enable", "enabled", "ENV"]

ENV = "TORCH_TPU_COMPILE_CACHE"
_MAGIC = b"TORCH_TPU_DYNAMO_ENTRY\x01"
_state = {"enabled": False}


def enabled() -> bool:
    return _state["enabled"]


def _warn(message: str) -> None:
    warnings.warn(f"torch_tpu compile cache: {message}", stacklevel=3)


# --- keys ---------------------------------------------------------------------

def _file_digest(path: str | None) -> str:
    if not path:
        return ""
    try:
        st = os.stat(path)
        return f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return ""


def version_key() -> str:
    """What an entry must have been written by: torch, Python, torch_tpu
    (version, its extension file, and the sources of the backend)."""
    import torch_tpu
    from torch_tpu import _C

    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, getattr(torch_tpu, "__version__", ""),
                 _file_digest(getattr(_C, "__file__", None))):
        h.update(part.encode() + b"\0")
    for name in ("_graph.py", "_dynamo.py", "_precompile.py"):
        try:
            with open(os.path.join(here, name), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        except OSError:
            pass
    return h.hexdigest()[:24]


def _directory() -> str:
    from torch_tpu import _C

    base = _C.cache_dir()
    return os.path.join(base, "dynamo", version_key()) if base else ""


def _entry_key(fn: Any) -> str:
    from torch._dynamo.eval_frame import innermost_fn
    from torch._dynamo.package import CompilePackage

    inner = innermost_fn(fn)
    code = inner.__code__
    h = hashlib.sha256(CompilePackage.source_id_from_fn(inner).encode())
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(inner.__globals__.get("__name__", "").encode())
    return h.hexdigest()[:40]


# --- the store ----------------------------------------------------------------

def _write_atomic(path: str, payload: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".entry.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _encode(entry: Any) -> bytes:
    body = pickle.dumps(entry)
    return _MAGIC + hashlib.sha256(body).digest() + body


def _decode(data: bytes) -> Any:
    if not data.startswith(_MAGIC):
        raise ValueError("not a torch_tpu Dynamo cache entry")
    digest, body = data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch (corrupt or truncated)")
    return pickle.loads(body)


def _make_store():
    from torch._dynamo.package import DiskDynamoCache, PrecompileCacheEntry
    from torch._dynamo.precompile_context import PrecompileContext

    TpuProgramArtifact = _artifact_class()

    class TpuDynamoCache(DiskDynamoCache):
        """Dynamo's cache store, under TORCH_TPU_CACHE_DIR, written when a
        frame compiled by the tpu backend is recorded."""

        def __init__(self):
            super().__init__("")
            self.keys: dict[str, str] = {}  # CompilePackage.source_id -> entry file key

        def path_prefix(self) -> str:
            return _directory()

        def _path(self, key: str) -> str:
            d = self.path_prefix()
            return os.path.join(d, key + ".entry") if d else ""

        def record_package(self, package) -> None:
            super().record_package(package)
            try:
                self._save(package)
            except Exception as e:  # saving is best effort
                _warn(f"cannot save the compiled frame ({type(e).__name__}: {e})")

        def _save(self, package) -> None:
            if package._innermost_fn is None:
                return
            path = self._path(_entry_key(package._innermost_fn))
            if not path:
                return
            cache_entry = package.cache_entry()
            backends = {}
            for backend_id in cache_entry.backend_ids:
                artifact = PrecompileContext.serialize_artifact_by_key(backend_id)
                if not isinstance(artifact, TpuProgramArtifact):
                    return  # another backend, or a tpu graph that is not saved
                backends[backend_id] = artifact
            if not cache_entry.backend_ids:
                return
            entry = PrecompileCacheEntry(dynamo=cache_entry, backends=backends)
            _write_atomic(path, _encode(entry))

        def load(self, fn):
            path = self._path(_entry_key(fn))
            if not path or not os.path.exists(path):
                return None
            try:
                with open(path, "rb") as f:
                    entry = _decode(f.read())
                if not isinstance(entry, PrecompileCacheEntry):
                    raise ValueError(f"unexpected content {type(entry).__name__}")
                for backend in entry.backends.values():
                    if not isinstance(backend, TpuProgramArtifact):
                        raise ValueError(f"unexpected backend {type(backend).__name__}")
                    PrecompileContext.record_artifact(backend)
                return entry
            except Exception as e:
                _warn(f"ignoring {path}: {type(e).__name__}: {e}; compiling instead")
                return None

        def write(self, cache_entry, path: str) -> None:  # save_cache_artifacts()
            _write_atomic(self._path(path), _encode(cache_entry))

        def read(self, path: str):
            with open(self._path(path), "rb") as f:
                return _decode(f.read())

    return TpuDynamoCache()


# --- corrections to PyTorch 2.13's caching precompile -------------------------

def _resolve_wrapped(module: str, qualname: str, depth: int):
    """The function ``depth`` steps down the ``__wrapped__`` chain of
    ``module.qualname`` (a function decorated with functools.wraps)."""
    import importlib

    f: Any = importlib.import_module(module)
    for name in qualname.split("."):
        f = getattr(f, name)
    for _ in range(depth):
        f = f.__wrapped__
    return f


def _guard_filter(guards) -> list[bool]:
    return ["__closure__" not in g.name for g in guards]


# The guard types PyTorch 2.13's CheckFunctionManager drops under
# caching_precompile (by the guard's create function, or among the types its
# build derived).
_PRECOMPILE_DROPPED = ("ID_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE", "DICT_VERSION")
_PRECOMPILE_DROPPED_DERIVED = ("ID_MATCH", "DICT_VERSION")
_loading = threading.local()  # .unfiltered: the next CheckFunctionManager builds once


def _filter_keeps_all(guards) -> bool:
    """Whether the caching-precompile filter (PyTorch's rule and
    ``_guard_filter``) keeps every one of these saved guards. It reads only a
    guard's create function, the guard types its build recorded
    (``guard.guard_types``, saved with it) and its name, never a value."""
    for g in guards:
        derived = tuple(g.guard_types or ())
        if (g.create_fn_name() in _PRECOMPILE_DROPPED or "__closure__" in g.name
                or any(t in derived for t in _PRECOMPILE_DROPPED_DERIVED)):
            return False
    return True


def _patch() -> None:
    import torch._dynamo.codegen as codegen
    import torch._dynamo.guards as guards
    import torch._dynamo.package as package

    # 1. A function's globals are where its body looks names up; functools.wraps
    #    copies __module__ from the wrapped function.
    add_function = package.CompilePackage._add_function

    def _add_function(self, python_code, python_module, *args, **kwargs):
        fn = self._innermost_fn
        if fn is not None and python_code is getattr(fn, "__code__", None) and not args and not kwargs:
            python_module = getattr(fn, "__globals__", {}).get("__name__", python_module)
        return add_function(self, python_code, python_module, *args, **kwargs)

    package.CompilePackage._add_function = _add_function

    # 2. Modules the bytecode loads as ___module_<name>_<id>_c<n> are
    #    re-installed with the entry.
    load_module = codegen.PyCodegen.create_load_python_module

    def create_load_python_module(self, mod):
        inst = load_module(self, mod)
        pkg = getattr(self.tx.output, "package", None)
        name = getattr(inst, "argval", None)
        if pkg is not None and isinstance(name, str) and name.startswith("___module_"):
            try:
                pkg.add_import_source(name, mod.__name__)
            except AssertionError:
                pass
        return inst

    codegen.PyCodegen.create_load_python_module = create_load_python_module

    # 3. A function hidden by its functools.wraps wrapper (the wrapper has
    #    its qualified name) pickles as the wrapper's __wrapped__, not missing.
    reducer = guards.GuardsStatePickler.reducer_override

    def reducer_override(self, obj):
        import inspect

        if inspect.isfunction(obj) and "<locals>" not in obj.__qualname__ and obj.__module__ in sys.modules:
            f: Any = sys.modules[obj.__module__]
            for name in obj.__qualname__.split("."):
                f = getattr(f, name, None)
            depth = 0
            while f is not None and f is not obj and depth < 8:
                f = getattr(f, "__wrapped__", None)
                depth += 1
            if f is obj and depth:
                return _resolve_wrapped, (obj.__module__, obj.__qualname__, depth)
        return reducer(self, obj)

    guards.GuardsStatePickler.reducer_override = reducer_override

    # 4. Guards reached through closure cells cannot be rebuilt from a saved
    #    scope (the wrapped function pickles as missing).
    init = guards.CheckFunctionManager.__init__

    def __init__(self, *args, **kwargs):
        if getattr(_loading, "unfiltered", False):
            # Saved guards the filter keeps whole (see 6.): one build, as
            # without caching_precompile, instead of a build to filter and a
            # second one.
            _loading.unfiltered = False
            kwargs.pop("guard_filter_fn", None)
            if len(args) >= 5:
                args = args[:4] + (None,) + args[5:]
            with torch._dynamo.config.patch(caching_precompile=False):
                init(self, *args, **kwargs)
            return
        if torch._dynamo.config.caching_precompile:
            user = kwargs.get("guard_filter_fn")
            if user is None and len(args) >= 5:
                user = args[4]
            combined = (_guard_filter if user is None else
                        (lambda gs: [a and b for a, b in zip(user(gs), _guard_filter(gs))]))
            if len(args) >= 5:
                args = args[:4] + (combined,) + args[5:]
            else:
                kwargs["guard_filter_fn"] = combined
        init(self, *args, **kwargs)

    guards.CheckFunctionManager.__init__ = __init__

    # 6. Loading saved guards, PyTorch builds them twice: once to run the
    #    caching-precompile filter over them, then the kept ones. The saved
    #    guards are what that same filter kept when the entry was written
    #    (serialize_guards pickles the filtered list, each guard with the
    #    guard types its build recorded), and the filter decides from those
    #    fields alone, so it keeps them all again: when _filter_keeps_all
    #    confirms it, the guards are built once. Otherwise PyTorch filters.
    load_guard_manager = package.load_guard_manager

    def _load_guard_manager(guards_state, *args, **kwargs):
        _loading.unfiltered = _filter_keeps_all(guards_state.output_graph._guards)
        try:
            return load_guard_manager(guards_state, *args, **kwargs)
        finally:
            _loading.unfiltered = False

    _load_guard_manager.__wrapped__ = load_guard_manager  # PyTorch's (tests compare both)
    package.load_guard_manager = _load_guard_manager

    # 5. An entry that fails to install leaves the package uninitialized, so
    #    that torch.compile starts a fresh one (PyTorch re-initializes it).
    install = package.CompilePackage.install

    def _install(self, backends):
        scopes = {}
        for entry in self._codes.values():
            module = sys.modules.get(entry.python_module)
            if module is not None:
                scopes[id(module)] = (module.__dict__, set(module.__dict__))
        try:
            install(self, backends)
        except Exception as e:
            try:
                self.uninstall()
            except Exception:
                pass
            for scope, before in scopes.values():  # what install added (the builtins dict)
                for name in set(scope) - before:
                    scope.pop(name, None)
            self._initialized = False
            self._codes = {}
            _warn(f"cannot install a saved entry ({type(e).__name__}: {e}); compiling instead")
            raise RuntimeError(f"torch_tpu compile cache: {e}") from e
        # Names install added (the builtins dict, "__builtins_dict___0") came
        # from another process's unique_id counter: a later compile in this
        # one must not generate them again.
        import itertools
        import re

        import torch._dynamo.bytecode_transformation as bt

        top = -1
        for scope, before in scopes.values():
            for name in set(scope) - before:
                m = re.search(r"_(\d+)$", name)
                if m:
                    top = max(top, int(m.group(1)))
        if top >= 0 and hasattr(bt, "_unique_id_counter"):
            bt._unique_id_counter = itertools.count(max(next(bt._unique_id_counter), top + 1))

    package.CompilePackage.install = _install


def _check_signature() -> str | None:
    """Why this torch lacks what the cache relies on; None when it has it."""
    try:
        import inspect

        import torch._dynamo.codegen as codegen
        import torch._dynamo.guards as guards
        import torch._dynamo.package as package
        import torch._dynamo.precompile_context  # noqa: F401

        params = list(inspect.signature(guards.CheckFunctionManager.__init__).parameters)
        if params[5:6] != ["guard_filter_fn"]:
            return "CheckFunctionManager has no guard_filter_fn in 5th position"
        for obj, name in ((package.CompilePackage, "_add_function"), (package.CompilePackage, "install"),
                          (package, "load_guard_manager"), (torch._guards.Guard, "create_fn_name"),
                          (codegen.PyCodegen, "create_load_python_module"), (package, "DiskDynamoCache"),
                          (getattr(guards, "GuardsStatePickler", None), "reducer_override")):
            if not hasattr(obj, name):
                return f"{name} is missing"
        if not hasattr(torch._dynamo.config, "caching_precompile"):
            return "torch._dynamo.config.caching_precompile is missing"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def enable() -> bool:
    """Turns the cache on for this process (before ``torch.compile``);
    returns whether it is on. Needs TORCH_TPU_CACHE_DIR to be enabled."""
    if _state["enabled"]:
        return True
    from torch_tpu import _C

    if not _C.cache_dir():
        _warn("TORCH_TPU_CACHE_DIR is disabled: not enabled")
        return False
    problem = _check_signature()
    if problem:
        _warn(f"this PyTorch ({torch.__version__}) lacks what it needs ({problem}): not enabled")
        return False
    import torch._dynamo.package as package

    _patch()
    package.DynamoCache = _make_store()
    torch._dynamo.config.caching_precompile = True
    _state["enabled"] = True
    return True


def maybe_enable_from_env() -> None:
    if os.environ.get(ENV, "0") not in ("", "0"):
        enable()


# --- the artifacts: one tpu program per saved graph ---------------------------

_PRECOMPILE_FORMAT = 1


def savable(compiled: Callable, example_inputs) -> tuple | str:
    """(recipe, input_devices, output_plan, signature) of an inference
    program (the tpu backend's `compiled`, run under AOTAutograd's tracing
    context) whose
    AOTAutograd wrapper passes the Dynamo graph's arguments through and
    returns its outputs unchanged; else why not."""
    from torch._functorch._aot_autograd.schemas import OutputType

    program = getattr(compiled, "program", None)
    if program is None:
        return "runs op by op"
    if program.constants:
        return "has constants"
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if meta is None:
        return "no AOTAutograd metadata"
    if any(i.mutates_data or i.mutates_metadata for i in meta.input_info):
        return "mutates an input"
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        return "an output aliases"
    if meta.num_intermediate_bases or meta.tokens or meta.is_rng_op_functionalized:
        return "AOTAutograd wraps the graph"
    from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

    if any(isinstance(m, SubclassCreationMeta) for m in list(meta.subclass_inp_meta or ()) +
           list(meta.subclass_fw_graph_out_meta or ())):
        return "tensor subclass inputs or outputs"
    return (program.recipe, program.input_devices, program.output_plan, [
        (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x) for x in example_inputs])


def record_artifact(backend_id: str, example_inputs, captured: list) -> None:
    """Saves the backend's program for the compile cache when its whole
    output is one pass-through inference program."""
    import pickle

    if len(captured) != 1 or isinstance(captured[0], str):
        return
    recipe, input_devices, output_plan, signature = captured[0]
    if signature != [(x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x)
                     for x in example_inputs]:
        return  # AOTAutograd changed the arguments (deduplicated, synthetic bases)
    if not all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in example_inputs):
        return
    try:
        content = pickle.dumps({"format": _PRECOMPILE_FORMAT, "recipe": recipe, "input_devices": input_devices,
                                "output_plan": output_plan})
    except Exception:
        return
    from torch._dynamo.precompile_context import PrecompileContext

    PrecompileContext.record_artifact(_artifact_class()(backend_id, content))


class _LoadedProgram:
    """A saved backend program: rebuilt from its recipe at the first call
    (the executable then comes from the executable cache)."""

    def __init__(self, name: str, content: dict):
        self.name = name
        self.content = content
        self.program: _Program | None = None

    def __call__(self, *args):
        if self.program is None:
            c = self.content
            self.program = _Program.from_recipe(self.name, c["recipe"], c["input_devices"], c["output_plan"])
            self.program.compile()
            stats["programs"] += 1
        return self.program(list(args))


@functools.cache
def _artifact_class():
    from torch._dynamo.precompile_context import BackendCacheArtifact

    class TpuProgramArtifact(BackendCacheArtifact):
        """A tpu backend's compiled graph in Dynamo's compile package."""

        def after_deserialization(self):
            import pickle

            content = pickle.loads(self.content)
            if not isinstance(content, dict) or content.get("format") != _PRECOMPILE_FORMAT:
                raise RuntimeError("torch_tpu compile cache: unknown program format")
            return _LoadedProgram(f"cached{self.key}", content)

    TpuProgramArtifact.__module__ = __name__
    TpuProgramArtifact.__qualname__ = "TpuProgramArtifact"
    return TpuProgramArtifact


def __getattr__(name):
    if name == "TpuProgramArtifact":  # defined on first use: torch._dynamo is imported late
        cls = globals()["TpuProgramArtifact"] = _artifact_class()  # pickles by this name
        return cls
    raise AttributeError(name)
