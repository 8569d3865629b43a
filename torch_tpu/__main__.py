"""``python -m torch_tpu info | cache info | cache clear``."""
from __future__ import annotations

import argparse
import os
import sys


def _info(args) -> int:
    import torch
    import torch_tpu
    from torch_tpu import _C, _cache

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
    return 0


def _cache_clear(args) -> int:
    from torch_tpu import _cache

    n = _cache.clear()
    print(f"removed {n} entries from {_cache.directory() or '(disabled cache)'}")
    return 0


def main(argv=None) -> int:
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    p = argparse.ArgumentParser(prog="python -m torch_tpu", description="torch_tpu command line")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, plugin, platform, devices, memory, cache location").set_defaults(fn=_info)
    cache = sub.add_parser("cache", help="the on-disk executable cache")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("info", help="entries, size and hit rates").set_defaults(fn=_cache_info)
    cache_sub.add_parser("clear", help="remove every entry").set_defaults(fn=_cache_clear)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
