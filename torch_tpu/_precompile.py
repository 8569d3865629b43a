"""A warm start for ``torch.compile(model, backend="tpu")`` in a new process.

On by default in the "safe" mode (read when the ``tpu`` Dynamo backend is
first looked up; silently off where TORCH_TPU_CACHE_DIR is disabled or this
PyTorch lacks what it patches, ``_check_signature``):
``TORCH_TPU_COMPILE_CACHE`` unset or ``safe`` saves the frames whose every
guard can be checked in another process; ``1`` (or ``all``, or
``torch_tpu._precompile.enable("all")``) also the frames the safe mode
leaves out (below), which is what stays opt in; ``0``: off. Any other value
raises ValueError. ``TORCH_TPU_COMPILE_CACHE_DIR`` moves the store (the
test suite gives each session its own). A frame compiled by the tpu
backend is saved under ``$TORCH_TPU_CACHE_DIR/dynamo/`` right after its
compile: Dynamo's transformed bytecode and guards (PyTorch's caching
precompile, ``torch._dynamo.config.caching_precompile``) and, per graph,
AOTAutograd's bundled entry (``BundledAOTAutogradResult``, the same one
PyTorch saves for inductor): its runtime metadata and wrappers, and the tpu
programs as ``TpuOutputCode`` (the ATen calls that built each program, not
the XLA executable: that comes from the executable cache). A later process
running the same code loads it at ``torch.compile`` and skips Dynamo's
tracing, AOTAutograd and the FX walk; its first call replays the calls into
a program and loads the executable.

Served: inference graphs, graphs that write into their inputs (AOTAutograd's
epilogue copies the new values back: a KV cache written in place, BatchNorm's
running statistics), outputs that alias inputs, and training graphs (the
forward, its saved tensors and the backward: the backward is compiled with
the forward, ``force_non_lazy_backward_lowering``, so that it is in the
entry). Not saved: graphs with symbolic shapes (their bucket executables are
in the executable cache), graphs that run op by op, programs with constants,
graphs PyTorch's AOTAutograd cache refuses (``check_cacheable``: unsafe ops,
higher-order ops it does not know), frames compiled by other backends.

Guards still protect every call (tensor shapes, dtypes, strides, grad mode,
module attributes): a call they reject compiles as usual and the saved entry
grows by that compile. PyTorch's caching precompile drops, live and saved,
the guards that compare object identity (ID_MATCH and the MODULE_MATCH,
BUILTIN_MATCH, FUNCTION_MATCH, CLOSURE_MATCH guards built on it),
DICT_VERSION and WEAKREF_ALIVE: an id means nothing in another process. Here
(``_guard_verdict``):

- an identity guard on a *by-reference* object (a module, a class, a
  function or builtin found again by its module and qualified name, an enum
  member, a code object by file, line and name) is saved as a description
  and checked once when a later process loads the entry (``_check_identities``:
  ``torch.nn.functional.gelu`` rebound to another function before
  ``torch.compile`` -> the entry is ignored and the frame compiles);
- an identity guard reached from an argument (no value to evaluate at
  load): one PyTorch can save (BUILTIN_MATCH: a builtin passed in) is kept
  in the saved guards (rebuilt on the saved scope's object, pickled by
  reference) and its name checked at load to still be that object; one it
  cannot save (CLOSURE_MATCH on a Python function) makes the frame unsafe;
- a guard reached through a closure cell
  (``forward.__closure__[0].cell_contents``: a decorator's state) cannot be
  rebuilt from a saved scope: an identity guard on a by-reference object, a
  comparison with a constant (bool, int, float, str, None: a decorator's
  flag), a tuple's length or a tuple/list/dict's type
  (``_closure_constant``) is checked once at load like the above; any other
  (the type of another object in a cell, a tensor) makes the frame unsafe;
- default ("safe") mode: the saving process keeps Dynamo's full guards live;
  a frame that would drop any other guard (identity of an object pickled by
  value, a dict version, a weakref, an unsafe closure guard) is not saved;
- opt-in (``TORCH_TPU_COMPILE_CACHE=1``, "all"): those frames are saved
  too, without those guards, live and loaded, as PyTorch's caching
  precompile does. That is the part that stays opt-in: rebinding such an
  object (swapping a by-value global for another) is not noticed.

What neither mode checks: a warm process checks the by-reference identities
once at load, not at every call, so rebinding a library function *after*
``torch.compile`` has loaded an entry (``F.gelu = f`` between calls) is not
noticed there (a cold process's full guards notice it). Use
``TORCH_TPU_COMPILE_CACHE=0`` for code that rebinds library functions between
calls.

Keys: the function's qualified name, first line and bytecode, plus the
torch, Python and torch_tpu versions and the torch_tpu extension's file; Dynamo
itself checks the source of every inlined function at load. An entry that
cannot be read or installed (corrupt, truncated, written by other code) is
reported with one warning and the frame compiles as usual. PyTorch's own
on-disk AOTAutograd cache (keyed without torch_tpu's version) is neither
read nor written for tpu graphs.

PyTorch 2.13's caching precompile needs corrections for functions
decorated with ``functools.wraps`` (Hugging Face models' ``forward``), made
here while enabled: the decorated function's globals are its defining
module's, not ``__module__``'s; modules Dynamo's bytecode loads under a
generated name are recorded with the entry; a wrapped function pickles by
reference; guards reached through a closure cell are checked at load (above),
not saved. Loading, saved guards are built once, as saved (PyTorch builds
them a first time only to re-run its filter, which would drop the identity
guards kept here), under the thread's dispatch key sets they were built
under when saved (tensor guards compare keys through them: a frame compiled
under ``inference_mode`` otherwise never passed its loaded guards outside). And two bugs: a tensor of the saved guard scope restores
its pruned ``.grad`` as None (PyTorch 2.13 assigned its ``_Missing``
sentinel: a TypeError, so no frame compiled after a backward ever loaded;
fixed the same way upstream, pytorch/pytorch#197755); an entry that fails to
install is removed from every code it was installed on (PyTorch's
``uninstall`` resets only the first: a torch.nn module compiled through
``wrap_inline`` kept a guarded code calling a backend no longer installed,
``NameError: __compiled_fn_...``), and the frame compiles as without the
cache. A process never loads an entry it wrote itself (its frames are
compiled already).

Saved guards are pickled without the stacks Dynamo recorded where each was
made (they only add a "# file:line" comment to the verbose guard code of
recompile reasons and TORCH_LOGS=guards; the guard itself is unchanged):
the encoder's saved guards are 30% smaller and are unpickled and built in
20% less CPU time.

Imports: ``_dynamo`` -> this module -> ``_graph`` (and ``_fx_passes``, for
the version key); this module never imports ``_dynamo`` (the compilers are
passed to ``aot_compile``).
"""
from __future__ import annotations

import functools
import gc
import hashlib
import io
import logging
import os
import pickle
import sys
import tempfile
import threading
import warnings
from typing import Any, Callable

import torch

from ._graph import _Program, stats

# Installing a saved entry (unpickling its guard scope, ~19k objects for the
# MiniLM encoder, building its guards and AOTAutograd's wrappers) runs with
# Python's garbage collector paused, restored after (also on error; left off
# if it was off). Everything it builds is kept, so a collection there finds
# nothing of its own; but a process that grew since its last full collection
# (transformers' import and a model load) was tipped into it there, 0.18-0.20
# CPU s of a warm encoder start. That collection is not removed: the process
# pays it at its next collection of the oldest generation, after the warm
# start. TORCH_TPU_GC_PAUSE=0 installs with the collector as it is (A/B).
_GC_PAUSE = os.environ.get("TORCH_TPU_GC_PAUSE", "1") != "0"

__all__ = ["enable", "enabled", "ENV"]

ENV = "TORCH_TPU_COMPILE_CACHE"
_log = logging.getLogger("torch_tpu.compile_cache")
_MAGIC = b"TORCH_TPU_DYNAMO_ENTRY\x01"
_state = {"enabled": False, "mode": "safe"}


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
    (version, its extension file, and the sources of the backend) and the
    graph rewrites' setting (``_fx_passes.ENV``: a program built with the
    projections fused is not the one built without)."""
    import torch_tpu
    from torch_tpu import _C

    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, getattr(torch_tpu, "__version__", ""),
                 _file_digest(getattr(_C, "__file__", None))):
        h.update(part.encode() + b"\0")
    from torch_tpu import _fx_passes

    h.update(f"{_fx_passes.ENV}={int(_fx_passes.enabled())}".encode() + b"\0")
    for name in ("_graph.py", "_dynamo.py", "_precompile.py", "_fx_passes.py"):
        try:
            with open(os.path.join(here, name), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        except OSError:
            pass
    return h.hexdigest()[:24]


DIR_ENV = "TORCH_TPU_COMPILE_CACHE_DIR"


def _directory() -> str:
    """Where entries of this version live: ``$TORCH_TPU_COMPILE_CACHE_DIR``
    (a test session's own store) or else ``$TORCH_TPU_CACHE_DIR/dynamo``,
    then the version key; "" when the executable cache is disabled."""
    from torch_tpu import _C

    base = _C.cache_dir()
    if not base:
        return ""
    root = os.environ.get(DIR_ENV) or os.path.join(base, "dynamo")
    return os.path.join(root, version_key())


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

    class TpuDynamoCache(DiskDynamoCache):
        """Dynamo's cache store, under TORCH_TPU_CACHE_DIR, written when a
        frame compiled by the tpu backend is recorded."""

        def __init__(self):
            super().__init__("")
            self.keys: dict[str, str] = {}  # CompilePackage.source_id -> entry file key
            self.written: set[str] = set()  # entry files this process wrote

        def path_prefix(self) -> str:
            return _directory()

        def _path(self, key: str) -> str:
            d = self.path_prefix()
            return os.path.join(d, key + ".entry") if d else ""

        def record_package(self, package) -> None:
            if getattr(package, "_tpu_not_saved", None):
                _log.info("not saving %s: %s", package._innermost_fn, package._tpu_not_saved)
                return
            try:
                super().record_package(package)
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
                if not _is_tpu_entry(artifact):
                    return  # another backend, or a tpu graph that is not saved
                backends[backend_id] = artifact
            if not cache_entry.backend_ids:
                return
            entry = PrecompileCacheEntry(dynamo=cache_entry, backends=backends)
            _write_atomic(path, _encode((entry, list(getattr(package, "_tpu_identities", ())))))
            self.written.add(path)

        def load(self, fn):
            path = self._path(_entry_key(fn))
            if not path or path in self.written or not os.path.exists(path):
                # (an entry this process wrote: its frames are compiled here
                # already; loading it again would only add a second copy)
                return None
            try:
                with open(path, "rb") as f:
                    data = f.read()
                _loading.prefetch = True  # TpuOutputCode.__setstate__ starts its executable's load
                try:
                    content = _decode(data)
                finally:
                    _loading.prefetch = False
                if not (isinstance(content, tuple) and len(content) == 2):
                    raise ValueError(f"unexpected content {type(content).__name__}")
                entry, identities = content
                if not isinstance(entry, PrecompileCacheEntry):
                    raise ValueError(f"unexpected content {type(entry).__name__}")
                _check_identities(fn, entry, identities)
                for backend in entry.backends.values():
                    if not _is_tpu_entry(backend):
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


# The guard types PyTorch 2.13's caching precompile drops (CheckFunctionManager,
# by the guard's type or among the types its build derived): object identity
# and dict versions cannot be checked against a pickled scope.
_PRECOMPILE_DROPPED = ("ID_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE", "DICT_VERSION")
_PRECOMPILE_DROPPED_DERIVED = ("ID_MATCH", "DICT_VERSION")
_loading = threading.local()  # .unfiltered: the next CheckFunctionManager builds the saved guards once;
# .prefetch: a store entry is being unpickled (TpuOutputCode prefetches its executable)


def _resolve(module: str, qualname: str) -> list:
    """What ``module.qualname`` names, read from class dicts without running
    descriptors: [object], or a property's [fget, fset, fdel]; [] if none."""
    f: Any = sys.modules.get(module)
    for name in qualname.split("."):
        if f is None:
            return []
        f = vars(f).get(name) if hasattr(f, "__dict__") and name in vars(f) else getattr(f, name, None)
    if isinstance(f, property):
        return [f.fget, f.fset, f.fdel]
    if isinstance(f, (staticmethod, classmethod)):
        return [f.__func__]
    return [] if f is None else [f]


def _by_reference(value: Any) -> bool:
    """Whether ``value`` is the same object in any process running the same
    code: a module in sys.modules; a class, function, builtin or enum member
    found again from its module and qualified name (a function also through
    functools.wraps' ``__wrapped__`` and properties' accessors); a code
    object, described by file, first line and qualified name. An identity
    guard on such an object can be checked in another process by looking
    its source up again (``_check_identities``)."""
    import enum
    import types

    if isinstance(value, types.ModuleType):
        return sys.modules.get(value.__name__) is value
    if isinstance(value, types.CodeType):
        return True
    if isinstance(value, enum.Enum):
        return _by_reference(type(value)) and getattr(type(value), value.name, None) is value
    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return False
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not isinstance(module, str) or module not in sys.modules or "<locals>" in qualname:
        return False
    candidates = _resolve(module, qualname)
    if isinstance(value, types.BuiltinFunctionType):  # torch.tanh: _VariableFunctionsClass.tanh in torch
        candidates += _resolve(module, value.__name__)
    for f in candidates:
        for _ in range(8):
            if f is value:
                return True
            f = getattr(f, "__wrapped__", None)
    return False


def _describe(value: Any) -> tuple:
    """What a by-reference object is, the same in every process."""
    import enum
    import types

    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, types.CodeType):
        return ("code", value.co_filename, value.co_firstlineno, value.co_qualname)
    if isinstance(value, enum.Enum):
        return ("enum",) + _describe(type(value))[1:] + (value.name,)
    return ("object", value.__module__, value.__qualname__)


def _guard_verdict(g) -> str:
    """A guard of a frame being saved (a torch._dynamo.types.GuardFilterEntry):
    "keep" (saved and live); "by_reference", an identity guard PyTorch's
    caching precompile drops on a by-reference object (``_by_reference``:
    a module, a builtin, an importable function or class), re-checked once
    when a later process loads the entry (``_check_identities``); "unsafe",
    another guard it drops (identity of an object pickled by value, a dict
    version, a weakref, a closure's cells), which no later process can
    check."""
    derived = tuple(g.derived_guard_types or ())
    if not (g.guard_type in _PRECOMPILE_DROPPED or any(t in derived for t in _PRECOMPILE_DROPPED_DERIVED)):
        return "keep"
    # (CLOSURE_MATCH guards a function's code: the same object has the same.)
    if (g.guard_type not in ("WEAKREF_ALIVE", "DICT_VERSION") and "DICT_VERSION" not in derived
            and g.has_value and _by_reference(g.value)):
        return "by_reference"
    return "unsafe"


_CONSTANT_TYPES = (bool, int, float, str, type(None))


_CONTAINER_TYPES = (tuple, list, dict)


def _closure_constant(g) -> tuple | None:
    """What a guard on a value reached through a closure cell checks, as a
    description ``_check_identities`` checks at load: ("constant", type
    name, value) for a comparison with a constant of a plain type
    (CONSTANT_MATCH: BOOL_MATCH, EQUALS_MATCH, NONE_MATCH); ("length", type
    name, n) for a tuple's or list's type and length (SEQUENCE_LENGTH: a
    function's ``__defaults__``); ("type", name) for a tuple, list or dict
    (TYPE_MATCH). None for any other guard (not checkable)."""
    if not g.has_value:
        return None
    value = g.value
    if g.guard_type == "CONSTANT_MATCH" and type(value) in _CONSTANT_TYPES:
        if isinstance(value, float) and value != value:  # NaN: not comparable by ==
            return None
        return ("constant", type(value).__name__, value)
    if g.guard_type == "SEQUENCE_LENGTH" and type(value) in (tuple, list):
        return ("length", type(value).__name__, len(value))
    if g.guard_type == "TYPE_MATCH" and type(value) in _CONTAINER_TYPES:
        return ("type", type(value).__name__)
    return None


def _from_argument(g) -> bool:
    """Whether a guard's source starts at a local of the frame other than
    ``self`` and its free variables (an argument, or a resumed frame's
    stack value): what ``_check_identities`` has no value for at load."""
    from torch._dynamo.source import LocalSource

    source = getattr(getattr(g, "orig_guard", None), "originating_source", None)
    while source is not None and not isinstance(source, LocalSource):
        source = getattr(source, "base", None)
    return (isinstance(source, LocalSource) and source.local_name != "self"
            and not source.is_derefed_cell_contents)  # a free variable: the closure, evaluated at load


def _serializable(g) -> bool:
    """Whether PyTorch can save the guard itself (its type and the types
    it derives from are none of CheckFunctionManager's
    UNSUPPORTED_SERIALIZATION_GUARD_TYPES, and a TYPE_MATCH or
    BUILTIN_MATCH is not marked unserializable, as serialize_guards
    decides: BUILTIN_MATCH is saved, ID_MATCH, FUNCTION_MATCH,
    CLOSURE_MATCH, MODULE_MATCH are not)."""
    import torch._dynamo.guards as guards

    unsupported = getattr(guards.CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", None)
    if unsupported is None:
        return False
    if g.guard_type in ("TYPE_MATCH", "BUILTIN_MATCH"):  # as CheckFunctionManager.serialize_guards decides
        return not getattr(g.orig_guard, "_unserializable", True)
    return g.guard_type not in unsupported and not any(t in unsupported for t in (g.derived_guard_types or ()))


def _lookup(description: tuple) -> Any:
    """The object a ``_describe`` description names in this process
    (a module, a class or function by module and qualified name, an enum
    member); raises ValueError when it names nothing."""
    import importlib

    kind = description[0]
    if kind == "module":
        return importlib.import_module(description[1])
    if kind in ("object", "enum"):
        module, qualname = description[1], description[2]
        if module not in sys.modules:
            importlib.import_module(module)
        candidates = _resolve(module, qualname) + _resolve(module, qualname.rsplit(".", 1)[-1])
        for f in candidates:
            if kind == "enum":
                f = getattr(f, description[3], None)
            if f is not None:
                return f
    raise ValueError(f"{'.'.join(map(str, description[1:]))} names nothing")


def _check_identities(fn: Any, entry, checks: list) -> None:
    """Raises ValueError unless each (guard source, description) saved with
    an entry still names the same module or object when evaluated against
    the function's scope (``L['self']``: a bound method's object; ``G``: its
    globals and the modules the entry imports under generated names)."""
    import builtins
    import importlib

    from torch._dynamo.eval_frame import innermost_fn

    inner = innermost_fn(fn)
    class Scope(dict):
        def __missing__(self, key):  # the builtins dict install adds under a generated name
            if isinstance(key, str) and key.startswith("__builtins_dict__"):
                return builtins.__dict__
            raise KeyError(key)

    scope = Scope(getattr(inner, "__globals__", {}))
    for code in entry.dynamo.codes:
        for alias, module in code.import_sources.items():
            scope[alias] = importlib.import_module(module)
    local = {"self": fn.__self__} if hasattr(fn, "__self__") else {}
    namespace = {"__builtins__": builtins, "L": local, "G": scope, **local}
    frame_fn = getattr(inner, "__func__", inner)
    code = getattr(frame_fn, "__code__", None)
    if code is not None and frame_fn.__closure__:
        for name, cell in zip(code.co_freevars, frame_fn.__closure__):
            try:
                namespace.setdefault(name, cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    for name, description in checks:
        if description[0] == "resolves":
            # An identity guard kept in the saved guards (on an argument):
            # the saved scope names the object by module and qualified name,
            # which must still be that object (not rebound to another).
            try:
                value = _lookup(tuple(description[1:]))
            except Exception as e:
                raise ValueError(f"cannot check {name} ({type(e).__name__}: {e})") from None
            if not _by_reference(value) or _describe(value) != tuple(description[1:]):
                raise ValueError(f"{name} ({'.'.join(map(str, description[2:]))}) no longer is "
                                 f"{'.'.join(map(str, description[2:]))}")
            continue
        try:
            value = eval(name, namespace)  # noqa: S307 (a guard's source expression)
        except Exception as e:
            raise ValueError(f"cannot check {name} ({type(e).__name__}: {e})") from None
        if description[0] == "constant":
            if type(value).__name__ != description[1] or value != description[2]:
                raise ValueError(f"{name} no longer is {description[2]!r}")
        elif description[0] == "length":
            if type(value).__name__ != description[1] or len(value) != description[2]:
                raise ValueError(f"{name} no longer is a {description[1]} of {description[2]}")
        elif description[0] == "type":
            if type(value).__name__ != description[1] or type(value) not in _CONTAINER_TYPES:
                raise ValueError(f"{name} no longer is a {description[1]}")
        elif not _by_reference(value) or _describe(value) != tuple(description):
            raise ValueError(f"{name} no longer is {'.'.join(map(str, description[1:]))}")


_TLS_MAGIC = b"TORCH_TPU_GUARD_TLS\x01"


def _tls_trailer() -> bytes:
    """The thread's local dispatch key include and exclude sets (raw, 8
    bytes each, little endian) after a marker: what the guards being saved
    were built under (``_patch``, 8.)."""
    include = torch._C._dispatch_tls_local_include_set().raw_repr()
    exclude = torch._C._dispatch_tls_local_exclude_set().raw_repr()
    return _TLS_MAGIC + include.to_bytes(8, "little") + exclude.to_bytes(8, "little")


def _read_tls_trailer(guards_state: bytes) -> tuple[int, int] | None:
    """(include, exclude) raw sets saved by ``_tls_trailer``; None for
    saved guards without the trailer."""
    n = len(_TLS_MAGIC) + 16
    if not isinstance(guards_state, (bytes, bytearray)) or len(guards_state) < n:
        return None
    tail = bytes(guards_state[-n:])
    if not tail.startswith(_TLS_MAGIC):
        return None
    return int.from_bytes(tail[-16:-8], "little"), int.from_bytes(tail[-8:], "little")


def _patch() -> None:
    import inspect

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

    # 1b. A frame whose code PyTorch cannot name (a graph break into a
    #     function reached through a property, transformers' loss_function)
    #     raises PackageError and fails the compile: here the package is
    #     marked not to be saved and the frame compiles as without the cache.
    add_user_function = package.CompilePackage._add_user_function

    def _add_user_function(self, code):
        try:
            return add_user_function(self, code)
        except package.PackageError as e:
            self._tpu_not_saved = f"cannot name {code.co_qualname}: {e}"
            return add_function(self, code, getattr(inspect.getmodule(code), "__name__", ""))

    package.CompilePackage._add_user_function = _add_user_function

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
        if type(obj) is torch._guards.Guard and (getattr(obj, "stack", None) is not None
                                                 or getattr(obj, "user_stack", None) is not None):
            # 3b. A saved guard without the stacks where Dynamo created it
            #     (user_stack: the user's source line; stack: Dynamo's own):
            #     they only add a "# file:line" comment to each verbose
            #     code part (recompile reasons, TORCH_LOGS=guards), and were
            #     30% of the encoder's saved guards (856 -> 597 KB, 26.6k ->
            #     18.7k pickled objects) and a fifth of their build at load
            #     (formatting ~1,300 comments). The guard itself (source,
            #     create_fn, code) is unchanged.
            import dataclasses

            return dataclasses.replace(obj, stack=None, user_stack=None).__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        if isinstance(obj, torch.Tensor):  # PyTorch reads .grad of non-leaf tensors too (a warning each)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                return reducer(self, obj)
        return reducer(self, obj)

    guards.GuardsStatePickler.reducer_override = reducer_override

    # 4. Guards of a frame being saved: PyTorch's caching precompile drops
    #    every identity guard (ID_MATCH and the guards derived from it:
    #    MODULE_MATCH, BUILTIN_MATCH, FUNCTION_MATCH), CLOSURE_MATCH,
    #    DICT_VERSION and WEAKREF_ALIVE, from the saved guards and from the
    #    live ones (the warnings "... is dropped with caching_precompile").
    #    Here (``_guard_verdict``): the saved guards drop them too; identity
    #    guards on by-reference objects are re-checked at load; in the default
    #    ("safe") mode the live guards stay Dynamo's full ones, and a frame
    #    that drops any other guard is not saved. The opt-in mode
    #    (TORCH_TPU_COMPILE_CACHE=1) drops them live and saves, as PyTorch.
    init = guards.CheckFunctionManager.__init__
    import inspect

    signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        if getattr(_loading, "unfiltered", False):
            # Loading: the saved guards are what the filter below kept when
            # the entry was written; one build, none filtered away.
            _loading.unfiltered = False
            bound["guard_filter_fn"] = None
            with torch._dynamo.config.patch(caching_precompile=False):
                init(**bound)
            return
        if not torch._dynamo.config.caching_precompile:
            init(**bound)
            return
        user = bound.get("guard_filter_fn")
        unsafe: list[str] = []
        identities: list[tuple] = []
        closure: list[str] = []

        def keep(entries):
            base = list(user(entries)) if user is not None else [True] * len(entries)
            out = []
            unsafe.clear()
            identities.clear()
            closure.clear()
            for k, g in zip(base, entries):
                verdict = _guard_verdict(g)
                if verdict == "unsafe" and k:
                    unsafe.append(f"{g.guard_type} on {g.name}")
                    _log.debug("guard not checkable in another process: %s on %s (%s, %s)", g.guard_type, g.name,
                               g.derived_guard_types, type(g.value).__name__)
                elif verdict == "by_reference" and k:
                    if "__closure__" not in g.name and _from_argument(g):
                        # Reached from an argument: no scope to evaluate it
                        # in at load. The guard itself is kept (the saved
                        # scope holds the object by reference, so it is
                        # rebuilt on this process's object) and its name
                        # checked at load not to be rebound.
                        description = _describe(g.value)
                        if not _serializable(g):  # CLOSURE_MATCH on a function, ID_MATCH on a module, ...
                            unsafe.append(f"{g.guard_type} on {g.name} (an argument)")
                        else:
                            identities.append((g.name, ("resolves",) + description))
                            out.append(True)
                            continue
                    else:
                        identities.append((g.name, _describe(g.value)))
                if "__closure__" in g.name:  # not rebuilt from a saved scope (see 3.)
                    closure.append(g.name)
                    if k and verdict == "keep":
                        # checked once at load instead: a constant (a
                        # decorator's flags), else the frame is not saved
                        constant = _closure_constant(g)
                        if constant is None:
                            unsafe.append(f"{g.guard_type} on {g.name} (through a closure)")
                        else:
                            identities.append((g.name, constant))
                out.append(bool(k) and verdict == "keep" and "__closure__" not in g.name)
            return out

        bound["guard_filter_fn"] = keep
        try:
            with torch._dynamo.config.patch(caching_precompile=False):
                init(**bound)
        except Exception as e:
            # The guards cannot be serialized (PyTorch raises TypeError for
            # an object whose class is defined in a local scope: a model
            # class made inside a function): the frame runs with Dynamo's
            # full live guards and is not saved, as without the cache.
            package = getattr(bound.get("output_graph"), "package", None)
            if not bound.get("save_guards") or package is None:
                raise
            package._tpu_not_saved = f"its guards cannot be saved ({type(e).__name__}: {str(e)[:200]})"
            bound["guard_filter_fn"], bound["save_guards"] = user, False
            with torch._dynamo.config.patch(caching_precompile=False):
                init(**bound)
            self.guards_state = b""  # convert_frame asserts it is set when a package exists
            return
        package = getattr(bound.get("output_graph"), "package", None)
        if package is not None:
            if not hasattr(package, "_tpu_identities"):
                package._tpu_identities = []
            package._tpu_identities.extend(identities)
        if _state["mode"] == "safe" and (unsafe or identities or closure):
            if unsafe and package is not None:
                package._tpu_not_saved = (f"{len(unsafe)} guards cannot be checked in another process "
                                          f"({', '.join(unsafe[:3])})")
            # Full live guards; the saved guards' state stays (Dynamo records it).
            saved_state = self.guards_state
            bound["guard_filter_fn"], bound["save_guards"] = user, False
            with torch._dynamo.config.patch(caching_precompile=False):
                init(**bound)
            self.guards_state = saved_state
        if isinstance(self.guards_state, bytes) and self.guards_state:
            self.guards_state += _tls_trailer()  # see 8.
        if signature.bind(self, *args, **kwargs).arguments.get("save_guards") and self.guards_state is None \
                and package is None:
            # The output graph bypassed its package (e.g. "Graph contains
            # named parameters due to static addresses": a compiled
            # optimizer step) and set output_graph.package to None; PyTorch
            # 2.13's convert_frame still asserts guards_state is not None.
            # The entry is marked bypassed, so add_guarded_code ignores it.
            self.guards_state = b""

    guards.CheckFunctionManager.__init__ = __init__

    # 7. A tensor in a saved guard scope carries its .grad, pickled as
    #    PyTorch's _Missing sentinel unless a guard reaches it (a parameter
    #    of a frame compiled after a backward); PyTorch 2.13's
    #    _unpickle_tensor assigns it to .grad unconditionally (TypeError
    #    "assigned grad expected to be a Tensor or None", so no such frame
    #    ever loaded). As PyTorch later does (pytorch/pytorch#197755): only
    #    a tensor is assigned; a pruned .grad loads as None (nothing guards
    #    it). Saved entries call this classmethod by name. And one fake mode
    #    per install, not one per tensor: FakeTensorMode() records its
    #    creation stack (traceback.extract_stack), which was 2 of the ~3 s
    #    the encoder's 107 parameters took to unpickle.
    def _unpickle_tensor(cls, meta_tensor, device, pytype, dispatch_keys_raw, grad):
        from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode

        fake = getattr(_loading, "fake", None)
        if fake is None:
            fake = (FakeTensorMode(), FakeTensorConverter())
        ret = fake[1].from_meta_and_device(fake[0], meta_tensor, device, pytype,
                                           torch._C.DispatchKeySet.from_raw_repr(dispatch_keys_raw))
        if isinstance(grad, torch.Tensor):
            ret.grad = grad
        return ret

    guards.GuardsStatePickler._unpickle_tensor = classmethod(_unpickle_tensor)

    # 6. Loading saved guards, PyTorch builds them twice: once to run the
    #    caching-precompile filter over them, then the kept ones; and that
    #    filter would drop the identity guards kept by 4. The saved guards
    #    are built once, as saved.
    #
    # 8. A tensor guard (TENSOR_MATCH) compares a call's dispatch keys as
    #    seen through the thread's local include/exclude sets at the call
    #    with the example's as seen through those sets when the guard was
    #    built (torch/csrc/dynamo/guards.cpp, TensorCheck's LocalState).
    #    Compiling, that is the call's own state (inference_mode excludes
    #    the autograd keys); loading, it was whatever torch.compile ran
    #    under, so a frame compiled under inference_mode and loaded outside
    #    it (or the reverse) never passed its guards: every such process
    #    compiled again and added that compile to the entry. The saved
    #    guards carry the sets they were built under (a trailer after the
    #    pickle, which pickle.loads ignores) and are rebuilt under them.
    load_guard_manager = package.load_guard_manager
    load_guards_state = package.load_guards_state

    def _load_guards_state(guards_state):
        state = load_guards_state(guards_state)
        tls = _read_tls_trailer(guards_state)
        if tls is not None:
            try:
                state._tpu_tls = tls
            except AttributeError:
                pass
        return state

    package.load_guards_state = _load_guards_state

    def _load_guard_manager(guards_state, *args, **kwargs):
        tls = getattr(guards_state, "_tpu_tls", None)
        _loading.unfiltered = True
        try:
            if tls is None:
                return load_guard_manager(guards_state, *args, **kwargs)
            keys = torch._C.DispatchKeySet.from_raw_repr
            with torch._C._ForceDispatchKeyGuard(keys(tls[0]), keys(tls[1])):
                return load_guard_manager(guards_state, *args, **kwargs)
        finally:
            _loading.unfiltered = False

    _load_guard_manager.__wrapped__ = load_guard_manager  # PyTorch's (tests compare both)
    package.load_guard_manager = _load_guard_manager

    # 5. An entry that fails to install leaves the package uninitialized, so
    #    that torch.compile starts a fresh one (PyTorch re-initializes it),
    #    and no guarded code of it installed: PyTorch's uninstall() resets
    #    the precompile entries of the package's first code only, while
    #    install() puts them on each code's target (for a torch.nn module
    #    compiled through external_utils.wrap_inline, the shared ``inner``
    #    code, whose entry would then call a backend no longer installed:
    #    NameError ``__compiled_fn_...``).
    install = package.CompilePackage.install

    def _targets(codes) -> list:
        out = []
        for code, entry in codes.items():
            try:
                out.append(package._lookup_code(entry) if entry.code_source else code)
            except Exception:
                out.append(code)
        return out

    def _install(self, backends):
        from torch._C._dynamo.eval_frame import _reset_precompile_entries

        scopes = {}
        for entry in self._codes.values():
            module = sys.modules.get(entry.python_module)
            if module is not None:
                scopes[id(module)] = (module.__dict__, set(module.__dict__))
        from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode

        _loading.fake = (FakeTensorMode(), FakeTensorConverter())  # for 7.
        paused = _GC_PAUSE and gc.isenabled()
        if paused:
            gc.disable()
        try:
            install(self, backends)
        except Exception as e:
            try:
                self.uninstall()
            except Exception:
                pass
            for target in _targets(self._codes):
                try:
                    _reset_precompile_entries(target)
                except Exception:
                    pass
            for scope, before in scopes.values():  # what install added (the builtins dict)
                for name in set(scope) - before:
                    scope.pop(name, None)
            self._initialized = False
            self._codes = {}
            _warn(f"cannot install a saved entry ({type(e).__name__}: {e}); compiling instead")
            raise RuntimeError(f"torch_tpu compile cache: {e}") from e
        finally:
            _loading.fake = None
            if paused:
                gc.enable()
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
                          (package.CompilePackage, "_add_user_function"), (package, "PackageError"),
                          (package, "load_guard_manager"), (package, "load_guards_state"),
                          (package, "_lookup_code"), (torch._C, "_ForceDispatchKeyGuard"),
                          (torch._guards.Guard, "create_fn_name"),
                          (codegen.PyCodegen, "create_load_python_module"), (package, "DiskDynamoCache"),
                          (getattr(guards, "GuardsStatePickler", None), "reducer_override")):
            if not hasattr(obj, name):
                return f"{name} is missing"
        unpickle = getattr(getattr(guards, "GuardsStatePickler", None), "_unpickle_tensor", None)
        if unpickle is None or list(inspect.signature(unpickle).parameters) != [
                "meta_tensor", "device", "pytype", "dispatch_keys_raw", "grad"]:
            return "GuardsStatePickler._unpickle_tensor has another signature"
        if not hasattr(torch._dynamo.config, "caching_precompile"):
            return "torch._dynamo.config.caching_precompile is missing"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def enable(mode: str = "all", *, quiet: bool = False) -> bool:
    """Turns the cache on for this process (before ``torch.compile``);
    returns whether it is on. ``mode``: "safe" (the default without
    TORCH_TPU_COMPILE_CACHE) saves only frames whose every guard can be
    checked in another process; "all" (TORCH_TPU_COMPILE_CACHE=1) also saves
    frames whose other identity and dict-version guards PyTorch's caching
    precompile drops, dropping them here too. Needs TORCH_TPU_CACHE_DIR to be
    enabled; ``quiet``: no warning when it cannot be enabled.
    Raises ValueError for another mode."""
    if mode not in ("safe", "all"):
        raise ValueError(f"torch_tpu compile cache: mode must be 'safe' or 'all', not {mode!r}")
    if _state["enabled"]:
        _state["mode"] = mode
        return True
    from torch_tpu import _C

    if not _C.cache_dir():
        if not quiet:
            _warn("TORCH_TPU_CACHE_DIR is disabled: not enabled")
        return False
    problem = _check_signature()
    if problem:
        if not quiet:
            _warn(f"this PyTorch ({torch.__version__}) lacks what it needs ({problem}): not enabled")
        return False
    import torch._dynamo.package as package

    _patch()
    package.DynamoCache = _make_store()
    torch._dynamo.config.caching_precompile = True
    _state["enabled"], _state["mode"] = True, mode
    return True


def maybe_enable_from_env() -> None:
    """TORCH_TPU_COMPILE_CACHE: unset or empty: the safe mode (the default;
    silently off where TORCH_TPU_CACHE_DIR is disabled or this PyTorch lacks
    what the cache needs); "safe": the safe mode (warns when it cannot be
    enabled); "0": off; "1" or "all": the "all" mode. Raises ValueError for
    another value."""
    value = os.environ.get(ENV, "").strip().lower()
    if value == "0":
        return
    if value not in ("", "safe", "1", "all"):
        raise ValueError(f"{ENV} must be unset, 'safe', '0', '1' or 'all', not {os.environ[ENV]!r}")
    enable("safe" if value in ("", "safe") else "all", quiet=value == "")


# --- the artifacts: AOTAutograd's bundled entry around tpu programs ----------

# 3: programs compute their calls' value and index checks (raised at the
# next sync point); a format-2 entry was saved by a torch_tpu whose graphs
# dropped them, and is not loaded (its frame compiles again).
_PRECOMPILE_FORMAT = 3


def _bypass(reason: str) -> Exception:
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

    return BypassAOTAutogradCache(f"torch_tpu: {reason}")


@functools.cache
def _output_code_class():
    from torch._inductor.output_code import OutputCode

    class TpuOutputCode(OutputCode):
        """One graph's tpu program as AOTAutograd's cache sees a compiled
        graph (torch._inductor.output_code.OutputCode): called boxed (the
        argument list), pickled as its recipe (the GraphProgram calls that
        built it) and rebuilt from it at the first call of a later process
        (the XLA executable then comes from the executable cache). A graph
        that runs op by op, or whose program feeds constants, is not saved
        (BypassAOTAutogradCache: the frame compiles as usual next time)."""

        def __init__(self, compiled: Callable):
            self._fn: Callable | None = compiled
            self._prefetch = None
            self._boxed_call = True  # an instance attribute: wrappers copy __dict__
            program = getattr(compiled, "program", None)
            if program is None:
                self._content: dict | str = "the graph runs op by op"
            elif program.constants:
                self._content = "the program has constants"
            else:
                self._content = {"format": _PRECOMPILE_FORMAT, "name": program.name, "recipe": program.recipe,
                                 "input_devices": program.input_devices, "output_plan": program.output_plan}

        def __call__(self, inputs):
            if self._fn is None:
                prefetched, self._prefetch = self._prefetch, None
                if (prefetched is not None and prefetched[2] == os.getpid() and
                        prefetched[0].device.index == torch.tpu.current_device()):
                    program, done, _ = prefetched
                    done.result()  # the compile's error, as program.compile() raises it
                else:  # (prefetched for another current device, or before a fork: rebuilt here)
                    program = _rebuild(self._content)
                    program.compile()
                stats["programs"] += 1
                self._fn = program
            return self._fn(inputs)

        def prepare_for_serialization(self) -> None:
            if isinstance(self._content, str):
                raise _bypass(self._content)
            self._fn = None

        def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
            pass

        def set_triton_bundle(self, triton_bundle) -> None:
            pass

        def __deepcopy__(self, memo):
            # AOTAutograd deep-copies a loaded entry to keep a serializable
            # copy (deserialize_bundled_cache_entry); the recipe is never
            # written after it is recorded, so the copy shares it (copying
            # the encoder's ~100k-element recipes took ~1 s of a warm start).
            if isinstance(self._content, str):
                raise TypeError(f"torch_tpu: {self._content}: not copied")
            copy = type(self).__new__(type(self))
            copy._content, copy._fn, copy._boxed_call = self._content, None, True
            copy._prefetch = self._prefetch  # one program serves both (it keeps no call state)
            memo[id(self)] = copy
            return copy

        def __getstate__(self):
            if isinstance(self._content, str):
                raise pickle.PicklingError(f"torch_tpu: {self._content}")
            return {"content": self._content}

        def __setstate__(self, state):
            content = state.get("content")
            if not isinstance(content, dict) or content.get("format") != _PRECOMPILE_FORMAT:
                raise RuntimeError("torch_tpu compile cache: unknown program format")
            self._content, self._fn, self._boxed_call = content, None, True
            # Only when a later process loads the entry from the store: the
            # saving process unpickles its own entries too (AOTAutograd's
            # serializable copy), and those must not build a second program.
            self._prefetch = _prefetch(content) if getattr(_loading, "prefetch", False) else None

    TpuOutputCode.__module__ = __name__
    TpuOutputCode.__qualname__ = TpuOutputCode.__name__ = "TpuOutputCode"
    return TpuOutputCode


def _rebuild(content: dict) -> _Program:
    """A saved graph's program rebuilt from its recipe (not compiled)."""
    return _Program.from_recipe(f"cached_{content['name']}", content["recipe"], content["input_devices"],
                                content["output_plan"])


_prefetcher = None  # concurrent.futures.ThreadPoolExecutor, one worker, made at first use


def _forget_prefetcher() -> None:
    # A forked child has no worker thread: its copy of the executor would
    # queue work nothing runs (a prefetch made before the fork is ignored
    # there: it carries the parent's pid).
    global _prefetcher
    _prefetcher = None


os.register_at_fork(after_in_child=_forget_prefetcher)


def _prefetch(content: dict):
    """Starts loading a saved program's executable (the executable cache;
    an XLA compile where it is not there) on a worker thread, for its first
    call: the program is rebuilt from its recipe here, while the entry is
    unpickled inside ``torch.compile()``, and ``GraphProgram.compile``
    releases the GIL, so the load overlaps Dynamo's guard build that
    follows (the encoder's warm start: ~0.1 s of executable load hidden
    behind ~0.3 s of guards). Returns (program, future, pid), or None where
    the recipe does not replay: the first call rebuilds it and raises there.
    An entry that is then not installed (a failed identity check) only
    wasted the load."""
    global _prefetcher
    try:
        program = _rebuild(content)
    except Exception:
        return None
    if _prefetcher is None:
        from concurrent.futures import ThreadPoolExecutor

        _prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch_tpu_prefetch")
    return program, _prefetcher.submit(program.compile), os.getpid()


def _is_tpu_entry(artifact) -> bool:
    """Whether a backend artifact is AOTAutograd's bundled entry around tpu
    programs (forward or inference, and backward when it has one)."""
    from torch._functorch._aot_autograd.aot_autograd_result import (
        BundledAOTAutogradCacheArtifact,
        BundledAOTAutogradResult,
    )

    if type(artifact) is not BundledAOTAutogradCacheArtifact:
        return False
    entry = artifact.content
    cls = _output_code_class()
    return (isinstance(entry, BundledAOTAutogradResult) and type(entry.compiled_fw.result) is cls
            and (entry.compiled_bw is None or type(entry.compiled_bw.result) is cls))


def aot_compile(gm, example_inputs, fw_compiler: Callable, bw_compiler: Callable,
                inference_compiler: Callable, decompositions: Callable) -> Callable:
    """``aot_autograd`` over the tpu compilers, each program an OutputCode,
    so that PyTorch's AOTAutograd cache bundles the graph with its runtime
    wrappers (input mutations written back, aliased outputs regenerated,
    the training graph's autograd.Function with its saved tensors and
    backward) into the frame's compile package: the entry a later process
    loads is PyTorch's own (torch._functorch._aot_autograd.aot_autograd_result.
    BundledAOTAutogradResult, as for inductor under caching_precompile).

    The backward is compiled with the forward (force_non_lazy_backward_lowering)
    so that it is in the package when Dynamo records the frame. PyTorch's own
    on-disk AOTAutograd cache (under the inductor cache directory, keyed
    without torch_tpu's version) is neither read nor written: entries live
    only in this store."""
    from unittest import mock

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode

    cls = _output_code_class()

    def serializable(compiler):
        return SerializableAOTDispatchCompiler(OutputCode, lambda g, inputs: cls(compiler(g, inputs)))

    backend = aot_autograd(fw_compiler=serializable(fw_compiler), bw_compiler=serializable(bw_compiler),
                           inference_compiler=serializable(inference_compiler), decompositions=decompositions)
    with torch._functorch.config.patch(enable_autograd_cache=True, force_non_lazy_backward_lowering=True,
                                       strict_autograd_cache=False), \
            mock.patch.object(AOTAutogradCache, "_lookup", staticmethod(lambda *args, **kwargs: None)), \
            mock.patch.object(AOTAutogradCache, "_write_to_local_cache", staticmethod(lambda *args: None)):
        return backend(gm, example_inputs)


def __getattr__(name):
    if name == "TpuOutputCode":  # defined on first use: torch._inductor is imported late
        cls = globals()["TpuOutputCode"] = _output_code_class()  # pickles by this name
        return cls
    raise AttributeError(name)
