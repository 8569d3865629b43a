"""``python -m torch_tpu info | doctor | cache info | cache clear``."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile


def _info(args) -> int:
    import torch
    import torch_tpu
    from torch_tpu import _C, _cache

    if torch_tpu._plugin_error is not None:
        print(f"plugin        not found: {torch_tpu._plugin_error}", file=sys.stderr)
        print("run `python -m torch_tpu doctor` for the checks and fixes", file=sys.stderr)
        return 1
    major, minor = _C.pjrt_api_version()
    hmajor, hminor = _C.pjrt_header_version()
    print(f"torch_tpu     {torch_tpu.__version__}")
    print(f"torch         {torch.__version__}")
    print(f"plugin        {_C._plugin_path()}")
    print(f"platform      {_C.platform_name()} {_C.platform_version()}")
    print(f"PJRT API      {major}.{minor} (plugin), {hmajor}.{hminor} (header built against)")
    print(f"devices       {torch.tpu.device_count()}")
    for i in range(torch.tpu.device_count()):
        print(f"  tpu:{i}       {_C.device_kind(i)}")
    print(f"eager mode    {torch_tpu.get_eager_mode()}")
    mem = torch.tpu.memory_stats()
    print(f"memory        {mem.get('allocated_bytes.all.current', 0)} bytes allocated by tensors"
          + (f", device limit {mem['device.bytes_limit']}" if "device.bytes_limit" in mem else ""))
    print(f"cache         {_cache.directory() or '(disabled)'}")
    print(f"lowered ops   {len(_C.lowered_ops())}")
    return 0


def _cache_info(args) -> int:
    from torch_tpu import _C, _cache

    d = _cache.directory()
    if not d:
        print("executable cache: disabled (TORCH_TPU_CACHE_DIR is empty)")
        return 0
    entries = _cache.entries()
    size = sum(s for _, s in entries)
    stats = _cache.read_stats()
    lookups = stats["hits"] + stats["misses"]
    rate = f"{100.0 * stats['hits'] / lookups:.1f}%" if lookups else "n/a"
    print(f"directory     {d}")
    print(f"entries       {len(entries)}")
    print(f"size          {size} bytes ({size / 2**20:.1f} MiB) of at most {_C.cache_max_bytes()} bytes")
    print(f"hits          {stats['hits']}")
    print(f"misses        {stats['misses']}")
    print(f"hit rate      {rate}")
    print(f"writes        {stats['writes']}, errors {stats['errors']}, evictions {stats['evictions']}")
    frames = _cache.compile_entries()
    print(f"compiled frames {len(frames)}, {sum(s for _, s in frames)} bytes "
          f"(torch.compile cache, TORCH_TPU_COMPILE_CACHE=1)")
    hot = _cache.hottest_recompiles(10)
    if not hot:
        print("recompiling ops: none recorded")
    else:
        print("hottest recompiling ops (eager compiles after an op's first in a process, all processes; "
              "remedies: fused mode, torch.compile(dynamic=True), padding to bucket sizes)")
        print(f"  {'op':40s} {'compiles':>9s} {'recompiles':>10s} {'new shape':>9s} {'new dtype':>9s} "
              f"{'new static':>10s}")
        for name, s in hot:
            print(f"  {name:40s} {s['compiles']:9d} {s['recompiles']:10d} {s['new_shape']:9d} {s['new_dtype']:9d} "
                  f"{s['new_static']:10d}")
    return 0


def _cache_clear(args) -> int:
    from torch_tpu import _cache

    n = _cache.clear(progress=True)
    print(f"removed {n} entries from {_cache.directory() or '(disabled cache)'}")
    return 0


class _Doctor:
    """Collects check results: "OK   <check>  <detail>" or "FAIL <check>  <detail>"
    followed by "     fix: <what to do>"; "SKIP" where an earlier failure
    makes a check meaningless."""

    def __init__(self):
        self.failed = False

    def ok(self, check: str, detail: str) -> None:
        print(f"OK    {check:<22}{detail}", flush=True)

    def fail(self, check: str, detail: str, fix: str) -> None:
        self.failed = True
        print(f"FAIL  {check:<22}{detail}", flush=True)
        print(f"      fix: {fix}", flush=True)

    def skip(self, check: str, why: str) -> None:
        print(f"SKIP  {check:<22}{why}", flush=True)


def _required_torch() -> str | None:
    """The X of torch_tpu's ``torch==X`` requirement (package metadata), if any."""
    try:
        from importlib import metadata
        for req in metadata.requires("torch_tpu") or ():
            m = re.fullmatch(r"torch\s*==\s*([^;\s]+)\s*", req)
            if m:
                return m.group(1)
    except Exception:  # not installed as a distribution (a source tree on sys.path)
        pass
    return None


def _doctor(args) -> int:
    import torch
    import torch_tpu
    from torch_tpu import _C, _cache

    d = _Doctor()
    print(f"torch_tpu {torch_tpu.__version__} doctor", flush=True)

    # 1. torch version: the pin and the headers the extension was built with.
    installed = torch.__version__.split("+")[0]
    required = _required_torch()
    built = getattr(_C, "_torch_version_built", None)
    problems = []
    if required and installed != required:
        problems.append(f"torch_tpu requires torch=={required}")
    if built and installed != built:
        problems.append(f"torch_tpu._C was built against torch {built}")
    if problems:
        d.fail("torch version", f"torch {torch.__version__} is installed but " + " and ".join(problems),
               f"pip install torch=={required or built} (then rebuild: make build)")
    else:
        d.ok("torch version", f"torch {torch.__version__} (required {required or 'unpinned'}, built against {built})")

    # 2. plugin found and loadable.
    plugin_ok = False
    if torch_tpu._plugin_error is not None:
        d.fail("plugin", str(torch_tpu._plugin_error),
               "unset TORCH_TPU_PJRT_PLUGIN or point it at a PJRT plugin .so; for the CPU plugin: "
               "pip install xla-cpu-pjrt")
    else:
        path = _C._plugin_path()
        try:
            _C._init()
        except Exception as e:  # the loader's message names the path and the reason
            d.fail("plugin", f"{path}: {e}",
                   "check that the file is a PJRT plugin built for this machine (GetPjrtApi, PJRT C API "
                   f"major {_C.pjrt_header_version()[0]}), or unset TORCH_TPU_PJRT_PLUGIN to use the discovered one")
        else:
            major, minor = _C.pjrt_api_version()
            d.ok("plugin", f"{path} ({_C.platform_name()} {_C.platform_version()}, PJRT {major}.{minor})")
            plugin_ok = True

    # 3. devices.
    devices_ok = False
    if not plugin_ok:
        d.skip("devices", "the plugin did not load")
    else:
        n = torch.tpu.device_count()
        if n < 1:
            d.fail("devices", "the plugin reports no addressable devices",
                   "check that the accelerator is visible to this process (drivers, permissions, "
                   "CUDA_VISIBLE_DEVICES/TPU_VISIBLE_CHIPS)")
        else:
            kinds = ", ".join(f"tpu:{i} {_C.device_kind(i)}" for i in range(n))
            d.ok("devices", f"{n} ({kinds})")
            devices_ok = True

    # 4. a tiny compile + execute round trip, compared with the CPU.
    if not devices_ok:
        d.skip("compile and execute", "no device")
    else:
        try:
            x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            before = sum(torch_tpu.metrics()["cpu_fallbacks"].values())
            got = ((x.to("tpu") * 2 + 1).sum(0)).cpu()
            fell_back = sum(torch_tpu.metrics()["cpu_fallbacks"].values()) - before
            want = (x * 2 + 1).sum(0)
            if not torch.equal(got, want):
                d.fail("compile and execute", f"(x * 2 + 1).sum(0) gave {got.tolist()}, the CPU gives {want.tolist()}",
                       "report this with `python -m torch_tpu info`; try TORCH_TPU_EAGER_MODE=debug")
            elif fell_back:
                d.fail("compile and execute", f"{fell_back} op(s) ran on the CPU instead of the device",
                       "see torch_tpu.metrics()['cpu_fallbacks']")
            else:
                d.ok("compile and execute", "(x * 2 + 1).sum(0) on tpu equals the CPU result")
        except Exception as e:
            d.fail("compile and execute", f"{type(e).__name__}: {e}".splitlines()[0],
                   "run with TORCH_TPU_EAGER_MODE=debug for the failing op; see `python -m torch_tpu info`")

    # 5. the executable cache directory: writable, and room on its disk.
    cache_dir = _cache.directory()
    if not cache_dir:
        d.ok("cache directory", "disabled (TORCH_TPU_CACHE_DIR is empty)")
    else:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".doctor."):
                pass
        except OSError as e:
            d.fail("cache directory", f"{cache_dir} is not writable: {e}",
                   "set TORCH_TPU_CACHE_DIR to a writable directory (or to '' to disable the cache)")
        else:
            d.ok("cache directory", f"{cache_dir} is writable")
            free = shutil.disk_usage(cache_dir).free
            want = min(_C.cache_max_bytes(), 256 * 2**20)
            if free < want:
                d.fail("cache free space", f"{free // 2**20} MiB free on the disk of {cache_dir}",
                       "free disk space, or set TORCH_TPU_CACHE_DIR elsewhere / TORCH_TPU_CACHE_MAX_BYTES lower")
            else:
                d.ok("cache free space", f"{free // 2**20} MiB free (the cache keeps at most "
                                         f"{_C.cache_max_bytes() // 2**20} MiB)")

    print("all checks passed" if not d.failed else "some checks failed", flush=True)
    return 1 if d.failed else 0


def main(argv=None) -> int:
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    p = argparse.ArgumentParser(prog="python -m torch_tpu", description="torch_tpu command line")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, plugin, platform, devices, memory, cache location").set_defaults(fn=_info)
    sub.add_parser("doctor", help="check the installation: OK/FAIL per check with a fix; exit code 1 on failure"
                   ).set_defaults(fn=_doctor)
    cache = sub.add_parser("cache", help="the on-disk executable cache")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("info", help="entries, size and hit rates").set_defaults(fn=_cache_info)
    cache_sub.add_parser("clear", help="remove every entry").set_defaults(fn=_cache_clear)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
