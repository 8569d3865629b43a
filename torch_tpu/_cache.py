"""The on-disk executable cache as seen from Python: location, entries,
size, and hit/miss counters accumulated across processes (``stats.json`` in
the cache directory, updated under a file lock when a process exits).

``stats.json`` also accumulates eager compiles by op (``"ops"``: op name ->
``{"compiles": n, "recompiles": n, "new_shape": n, "new_dtype": n,
"new_static": n}``, where recompiles are the compiles after an op's first one
in a process; torch_tpu.metrics()["compiles_by_op"] is this process's part),
so ``python -m torch_tpu cache info`` can name the ops that recompile most."""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import sys
import tempfile

from . import _C

_STATS = "stats.json"
_KEYS = ("hits", "misses", "writes", "errors", "evictions")
_OP_KEYS = ("compiles", "recompiles", "new_shape", "new_dtype", "new_static")


def directory() -> str:
    """The cache directory; "" when the cache is disabled (TORCH_TPU_CACHE_DIR="")."""
    return _C.cache_dir()


def entries() -> list[tuple[str, int]]:
    """(file name, size in bytes) of every cache entry."""
    d = directory()
    if not d or not os.path.isdir(d):
        return []
    out = []
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if name.endswith(".pjrt") and os.path.isfile(path):  # not a directory that happens to be named so
            try:
                out.append((name, os.path.getsize(path)))
            except OSError:
                pass
    return out


def compile_entries() -> list[tuple[str, int]]:
    """(path relative to the cache directory, size in bytes) of every saved
    torch.compile frame (torch_tpu._precompile, under ``dynamo/``)."""
    d = directory()
    root = os.path.join(d, "dynamo") if d else ""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for version in sorted(os.listdir(root)):
        sub = os.path.join(root, version)
        if not os.path.isdir(sub):
            continue
        for name in sorted(os.listdir(sub)):
            if name.endswith(".entry"):
                try:
                    out.append((os.path.join("dynamo", version, name), os.path.getsize(os.path.join(sub, name))))
                except OSError:
                    pass
    return out


def _process_counts() -> dict:
    """This process's counters; zeros where the runtime cannot start (no plugin)."""
    try:
        m = _C.metrics()
    except RuntimeError:
        return {k: 0 for k in _KEYS}
    return {k: int(m[f"disk_cache_{k}"]) for k in _KEYS}


def _process_op_counts() -> dict:
    """This process's eager compiles by op: name -> {_OP_KEYS: count}."""
    try:
        by_op = _C.metrics()["compiles_by_op"]
    except RuntimeError:
        return {}
    out = {}
    for name, s in by_op.items():
        out[name] = {"compiles": int(s["compiles"]), "recompiles": int(s["compiles"] - s["first"]),
                     "new_shape": int(s["new_shape"]), "new_dtype": int(s["new_dtype"]),
                     "new_static": int(s["new_static"])}
    return out


def _merge_ops(saved: dict, counts: dict) -> dict:
    merged = {name: {k: int(v.get(k, 0)) for k in _OP_KEYS} for name, v in saved.items() if isinstance(v, dict)}
    for name, c in counts.items():
        m = merged.setdefault(name, {k: 0 for k in _OP_KEYS})
        for k in _OP_KEYS:
            m[k] += c[k]
    return merged


def read_op_stats() -> dict:
    """Eager compiles by op of every process that used this cache directory,
    including this one: name -> {"compiles", "recompiles", "new_shape",
    "new_dtype", "new_static": count}."""
    d = directory()
    path = os.path.join(d, _STATS) if d else ""
    saved = {}
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                saved = json.load(f).get("ops", {})
        except (OSError, ValueError, AttributeError):
            saved = {}
    return _merge_ops(saved, _process_op_counts() if _C._is_initialized() else {})


def hottest_recompiles(limit: int = 10) -> list[tuple[str, dict]]:
    """The ops with the most recompiles (read_op_stats), most first; ops that
    never recompiled are left out."""
    ops = [(name, s) for name, s in read_op_stats().items() if s["recompiles"] > 0]
    ops.sort(key=lambda item: (-item[1]["recompiles"], item[0]))
    return ops[:limit]


def read_stats() -> dict:
    """Counters of every process that used this cache directory, including this one."""
    totals = {k: 0 for k in _KEYS}
    d = directory()
    path = os.path.join(d, _STATS) if d else ""
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                saved = json.load(f)
            totals.update({k: int(saved.get(k, 0)) for k in _KEYS})
        except (OSError, ValueError):
            pass
    for k, v in _process_counts().items():
        totals[k] += v
    return totals


def _save_stats() -> None:
    if not _C._is_initialized():
        return  # the runtime never started (no plugin, or no tpu work): nothing to count
    d = directory()
    counts = _process_counts()
    op_counts = _process_op_counts()
    if not d or not (any(counts.values()) or op_counts) or not os.path.isdir(d):
        return
    path = os.path.join(d, _STATS)
    try:
        with open(os.path.join(d, ".stats.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            saved = {}
            if os.path.exists(path):
                try:
                    with open(path) as f:
                        saved = json.load(f)
                except ValueError:
                    saved = {}
            merged = {k: int(saved.get(k, 0)) + counts[k] for k in _KEYS}
            saved_ops = saved.get("ops", {})
            merged["ops"] = _merge_ops(saved_ops if isinstance(saved_ops, dict) else {}, op_counts)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".stats.")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, path)
    except OSError:
        pass


def _progress(items: list, desc: str, enabled: bool):
    """``items`` wrapped in a tqdm bar when enabled, stderr is a terminal and
    tqdm is installed; else ``items`` (quiet in logs and pipes)."""
    if not enabled or not items or not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="entry", leave=False)


def clear(progress: bool = False) -> int:
    """Removes every entry (executables and saved torch.compile frames) and
    the counters; returns the number of entries removed. ``progress``: a
    progress bar on a terminal."""
    d = directory()
    removed = 0
    for name, _ in _progress(entries() + compile_entries(), "removing cache entries", progress):
        try:
            os.remove(os.path.join(d, name))
            removed += 1
        except OSError:
            pass
    if d and os.path.exists(os.path.join(d, _STATS)):
        os.remove(os.path.join(d, _STATS))
    root = os.path.join(d, "dynamo") if d else ""
    if root and os.path.isdir(root):
        for version in os.listdir(root):  # now-empty version directories
            try:
                os.rmdir(os.path.join(root, version))
            except OSError:
                pass
        try:
            os.rmdir(root)
        except OSError:
            pass
    return removed


atexit.register(_save_stats)
