"""``torch.tpu``: the ``torch.cuda``-style functions for the tpu device.

Memory figures are bytes of live tpu storages as the allocator counts them
(as torch.cuda counts tensor allocations); the plugin's own statistics are
added to ``memory_stats()`` where it reports them.

Streams and events: PJRT runs the launches of a device in order, and
torch_tpu launches everything on one queue per device, so each device has
exactly one stream (``current_stream() == default_stream()``; a new
``Stream`` is that same queue). ``Event`` marks a point of it; timing events
read the host clock after waiting for the work launched so far (see Event).
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from . import _C

__all__ = [
    "is_available", "device_count", "current_device", "set_device", "synchronize",
    "get_device_name", "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
    "get_rng_state", "set_rng_state", "memory_allocated", "max_memory_allocated",
    "reset_peak_memory_stats", "memory_stats", "empty_cache", "is_initialized", "device",
    "get_amp_supported_dtype", "is_bf16_supported", "get_device_properties",
    "memory_reserved", "max_memory_reserved", "mem_get_info", "memory_summary",
    "reset_max_memory_allocated", "set_per_process_memory_fraction", "get_per_process_memory_fraction",
    "get_device_capability", "Stream", "Event", "StreamContext", "current_stream", "default_stream",
    "set_stream", "stream", "init", "OutOfMemoryError",
]

OutOfMemoryError = torch.OutOfMemoryError  # raised when a tpu allocation or launch runs out of memory


def is_available() -> bool:
    """True if a PJRT plugin loads and reports at least one device; False
    (never an error, as torch.cuda.is_available) when none can be loaded."""
    try:
        return device_count() > 0
    except RuntimeError:
        return False


def _is_in_bad_fork() -> bool:
    """torch.manual_seed asks this before seeding (torch/random.py); PJRT
    clients are not fork-safe, but a forked child that never touched the
    device may still use it."""
    return False


def is_initialized() -> bool:
    return _C._is_initialized()


def __getattr__(name: str):
    """``torch.tpu._initialized``: whether the PJRT client exists, as
    ``torch.cuda._initialized``. torch.utils.checkpoint saves and restores a
    device type's RNG state only where ``getattr(device_module,
    "_initialized", False)`` is true (torch/utils/checkpoint.py); without it a
    checkpointed block's recompute drew new dropout masks and its gradients
    were silently wrong."""
    if name == "_initialized":
        return _C._is_initialized()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device_count() -> int:
    """Number of addressable devices of the loaded plugin (0 if it cannot load)."""
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "tpu":
        raise ValueError(f"expected a tpu device, got {d}")
    return d.index if d.index is not None else current_device()


def set_device(device) -> None:
    """Sets the current tpu device (an int, "tpu:N" or torch.device)."""
    _C.set_device(_index(device))


class device:
    """Context manager that changes the current tpu device."""

    def __init__(self, device):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = current_device()
        set_device(self.idx)

    def __exit__(self, *exc):
        set_device(self.prev)
        return False


def synchronize(device=None) -> None:
    """Waits for every launched tpu computation; raises the first failure, naming its op."""
    _C.synchronize()


def get_device_name(device=None) -> str:
    """Names the platform and plugin in use, e.g. "XLA cpu (xla_cpu_pjrt.so, PJRT 0.81)"."""
    import os
    major, minor = _C.pjrt_api_version()
    idx = _index(device)
    return (f"XLA {_C.platform_name()} {_C.device_kind(idx)} "
            f"({os.path.basename(_C._plugin_path())}, PJRT {major}.{minor})")


class _DeviceProperties:
    """What ``get_device_properties`` returns (torch.cuda's fields where they
    have a meaning here): name, type ("tpu"), index, platform (the PJRT
    platform, e.g. "cpu"), kind (PJRT_DeviceDescription_Kind), total_memory
    (bytes, see mem_get_info), major/minor (0: there is no CUDA compute
    capability), pjrt_api_version, plugin (path)."""

    def __repr__(self) -> str:
        return (f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', kind='{self.kind}', "
                f"total_memory={self.total_memory // 2**20}MB)")


def get_device_properties(device=None) -> _DeviceProperties:
    """Properties of a tpu device (default: the current one); raises
    IndexError naming the index if there is no such device."""
    idx = _index(device)
    p = _DeviceProperties()
    p.name = get_device_name(idx)
    p.type = "tpu"
    p.index = idx
    p.platform = _C.platform_name()
    p.kind = _C.device_kind(idx)
    p.total_memory = _C._total_memory(idx)
    p.major, p.minor = get_device_capability(idx)
    p.pjrt_api_version = tuple(_C.pjrt_api_version())
    p.plugin = _C._plugin_path()
    return p


def get_device_capability(device=None) -> tuple[int, int]:
    """(0, 0): an XLA device has no CUDA compute capability. Callers that
    compare it with CUDA thresholds (e.g. >= (8, 0) for bf16 kernels) take
    their generic path; use is_bf16_supported() for bf16."""
    _index(device)
    return (0, 0)


def init() -> None:
    """Loads the plugin and creates the PJRT client now (it is otherwise
    done on first use); raises RuntimeError naming the plugin path on failure."""
    _C._init()


def manual_seed(seed: int) -> None:
    """Seeds the current tpu device's generator."""
    _default_generator(current_device()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds every tpu device's generator (torch.manual_seed calls this).

    Lazy, as torch.cuda.manual_seed_all: before the PJRT client exists the
    seed is kept and applied when the generators are created with it, so
    seeding does not start the device (a process that only seeds, such as
    vLLM's API server, can still fork a child that uses it). Negative seeds
    wrap to uint64 as torch.Generator.manual_seed does."""
    s = int(seed)
    if not -(1 << 63) <= s < (1 << 64):
        raise RuntimeError(f"Overflow when unpacking long: seed {s} is outside [-2**63, 2**64)")
    _C._seed_all(s + (1 << 64) if s < 0 else s)


def seed() -> int:
    return _default_generator(current_device()).seed()


def seed_all() -> None:
    """Seeds every tpu device's generator with one random seed, as
    torch.cuda.seed_all: the first device's generator draws it
    (Generator.seed), the others take it (manual_seed)."""
    chosen = None
    for i in range(device_count()):
        gen = _default_generator(i)
        if chosen is None:
            gen.seed()
            chosen = gen.initial_seed()
        else:
            gen.manual_seed(chosen)


def initial_seed() -> int:
    return _default_generator(current_device()).initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    """16 bytes (uint8 CPU tensor): the generator's seed and offset."""
    return _default_generator(_index(device)).get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    _default_generator(_index(device)).set_state(state)


def _default_generator(index: int) -> torch.Generator:
    return _C._default_generator(index)


def get_amp_supported_dtype() -> list:
    """Dtypes torch.autocast("tpu", dtype=...) accepts (torch.amp asks this)."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """True: every XLA backend compiles bf16 (the CPU plugin computes it
    through f32 conversions inside the compiled program)."""
    return True


def memory_allocated(device=None) -> int:
    """Bytes held by live tpu tensors' storages."""
    return _C.memory_allocated()


def max_memory_allocated(device=None) -> int:
    """Peak of memory_allocated() since start or reset_peak_memory_stats()."""
    return _C.max_memory_allocated()


def reset_peak_memory_stats(device=None) -> None:
    """Sets the peak of memory_allocated() (and max_memory_reserved()) to the current value."""
    _C.reset_peak_memory_stats()


def reset_max_memory_allocated(device=None) -> None:
    """Same as reset_peak_memory_stats (torch.cuda keeps this older name too)."""
    reset_peak_memory_stats(device)


def memory_stats(device=None) -> dict:
    """allocated_bytes.all.{current,peak}, allocation.all.allocated,
    device.total_memory (see mem_get_info), device.memory_limit (if set), and
    device.bytes_in_use / peak_bytes_in_use / bytes_limit where the plugin
    implements PJRT_Device_MemoryStats (the CPU plugin does not)."""
    idx = _index(device)
    if idx == current_device():
        return dict(_C.memory_stats())
    with globals()["device"](idx):
        return dict(_C.memory_stats())


def memory_reserved(device=None) -> int:
    """Bytes the plugin reports in use on the device (PJRT_Device_MemoryStats);
    where it does not report them (the CPU plugin) memory_allocated(): there
    is no caching allocator, a buffer's memory is freed with its last tensor."""
    stats = memory_stats(device)
    return int(stats.get("device.bytes_in_use", stats["allocated_bytes.all.current"]))


def max_memory_reserved(device=None) -> int:
    """Peak of memory_reserved(): the plugin's peak_bytes_in_use where it
    reports it, else max_memory_allocated()."""
    stats = memory_stats(device)
    return int(stats.get("device.peak_bytes_in_use", stats["allocated_bytes.all.peak"]))


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device. Where the plugin implements
    PJRT_Device_MemoryStats: (bytes_limit - bytes_in_use, bytes_limit). The
    CPU plugin does not (UNIMPLEMENTED): its device memory is the host's, so
    this returns the host's available memory (MemAvailable of /proc/meminfo)
    and physical memory. Elsewhere: total = 0 where unknown."""
    idx = _index(device)
    stats = memory_stats(idx)
    if "device.bytes_limit" in stats:
        total = int(stats["device.bytes_limit"])
        return max(total - int(stats.get("device.bytes_in_use", 0)), 0), total
    total = int(_C._total_memory(idx))
    if _C.platform_name() == "cpu":
        return min(_host_available_bytes(), total), total
    return max(total - memory_allocated(idx), 0), total


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """Limits the bytes of live tpu tensors to ``fraction`` of the device's
    total memory (mem_get_info()[1]); an allocation beyond it raises
    torch.OutOfMemoryError naming the size. The limit is process-wide (it
    counts the tensors of every tpu device). Raises ValueError if fraction is
    not in [0, 1] and RuntimeError where the total memory is unknown."""
    if not isinstance(fraction, (float, int)) or not 0 <= fraction <= 1:
        raise ValueError(f"invalid fraction {fraction!r}: it must be a number in [0, 1]")
    total = _C._total_memory(_index(device))
    if total <= 0:
        raise RuntimeError("set_per_process_memory_fraction: the plugin does not report the device's memory")
    # fraction 1 removes the limit (the total itself still applies); 0 forbids any allocation
    _C._set_memory_limit(0 if fraction == 1 else max(int(fraction * total), 1))


def get_per_process_memory_fraction(device=None) -> float:
    """The fraction set by set_per_process_memory_fraction (1.0 if none)."""
    limit = _C._memory_limit()
    total = _C._total_memory(_index(device))
    return 1.0 if limit <= 0 or total <= 0 else limit / total


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A human-readable table of the memory figures of a device (what
    memory_stats(), mem_get_info() and the limit say), for printing."""
    idx = _index(device)
    stats = memory_stats(idx)
    free, total = mem_get_info(idx)
    limit = _C._memory_limit()
    rows = [
        ("tensors allocated (current)", _fmt(stats["allocated_bytes.all.current"])),
        ("tensors allocated (peak)", _fmt(stats["allocated_bytes.all.peak"])),
        ("allocations (count)", str(stats["allocation.all.allocated"])),
        ("reserved (current)", _fmt(memory_reserved(idx))),
        ("reserved (peak)", _fmt(max_memory_reserved(idx))),
        ("device total", _fmt(total) + (" (host memory: the CPU plugin)" if _C.platform_name() == "cpu"
                                        and "device.bytes_limit" not in stats else "")),
        ("device free", _fmt(free)),
        ("per-process limit", _fmt(limit) if limit > 0 else "none"),
    ]
    if not abbreviated and "device.bytes_in_use" not in stats:
        rows.append(("plugin statistics", "not reported (PJRT_Device_MemoryStats unimplemented)"))
    width = max(len(k) for k, _ in rows)
    title = f" torch_tpu memory summary, tpu:{idx} ({_C.platform_name()}) "
    line = "=" * (width + 30)
    out = [line, title.center(len(line), "="), line]
    out += [f"{k.ljust(width)} : {v}" for k, v in rows]
    out.append(line)
    return "\n".join(out) + "\n"


def empty_cache() -> None:
    """No-op: PJRT frees a buffer's memory when its last tensor goes."""


# Streams and events (module docstring): one in-order queue per device.

class Stream(torch.Stream):
    """The in-order launch queue of a tpu device (``torch.Stream`` with
    device_type tpu). PJRT executes a device's launches in order and
    torch_tpu uses one queue per device, so every Stream of a device is that
    queue: ``Stream()`` equals ``current_stream()``; ``wait_event`` and
    ``wait_stream`` have nothing to wait for; ``priority`` is accepted and
    ignored. Raises ValueError for a non-tpu device."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        return super().__new__(cls, stream_id=0, device_index=_index(device), device_type=_C._device_type())

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.priority = priority

    def wait_event(self, event) -> None:
        """No-op: the event's work precedes anything launched later on this queue."""

    def wait_stream(self, stream) -> None:
        """No-op: a device has one queue."""

    def record_event(self, event=None) -> "Event":
        """Records ``event`` (a new Event if None) on this stream and returns it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        """True if every launched tpu computation has completed."""
        return bool(_C._idle())

    def synchronize(self) -> None:
        """Waits for the launched work; raises the first failure, naming its op."""
        synchronize(self.device_index)

    def __eq__(self, other) -> bool:
        return isinstance(other, torch.Stream) and other.device_type == self.device_type and \
            other.device_index == self.device_index and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash((self.device_type, self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.tpu.Stream device=tpu:{self.device_index}>"


class Event(torch.Event):
    """A point in a tpu device's launch queue.

    ``record()`` marks the work launched so far. With ``enable_timing=True``
    it first waits for that work (a sync point: a failed op raises here) and
    reads the host's monotonic clock, so ``elapsed_time(end)`` is the
    milliseconds between the completion of the work before each event
    (host-clock timing: PJRT offers no device timestamps). ``query()`` is
    True once every launch so far has completed; ``synchronize()`` and
    ``wait()`` wait for all launched work (one queue per device)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return super().__new__(cls, device="tpu", enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time_ns = None
        self._recorded = False

    def record(self, stream=None) -> None:
        stream = current_stream() if stream is None else stream
        if self.enable_timing:
            synchronize(stream.device_index)
            self._time_ns = time.perf_counter_ns()
        self._recorded = True

    def query(self) -> bool:
        return bool(_C._idle())

    def wait(self, stream=None) -> None:
        """No-op: work launched later on the device's one queue runs after this event's."""

    def synchronize(self) -> None:
        synchronize()

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds from this event to ``end_event``; raises RuntimeError
        unless both were recorded with enable_timing=True."""
        for e, what in ((self, "start"), (end_event, "end")):
            if not getattr(e, "enable_timing", False):
                raise RuntimeError(f"elapsed_time: the {what} event was created without enable_timing=True")
            if getattr(e, "_time_ns", None) is None:
                raise RuntimeError(f"elapsed_time: the {what} event has not been recorded")
        return (end_event._time_ns - self._time_ns) / 1e6

    def __repr__(self) -> str:
        return f"<torch.tpu.Event enable_timing={self.enable_timing} recorded={self._recorded}>"


def current_stream(device=None) -> Stream:
    """The stream of a tpu device (its one launch queue)."""
    return Stream(device)


def default_stream(device=None) -> Stream:
    """The same stream as current_stream(): a device has one launch queue."""
    return Stream(device)


def set_stream(stream) -> None:
    """Accepts a tpu Stream (there is only one per device); raises
    ValueError for a stream of another device type."""
    if stream is not None and getattr(stream, "device_type", None) != _C._device_type():
        raise ValueError(f"expected a tpu stream, got {stream!r}")


class StreamContext:
    """``with torch.tpu.stream(s):``: work inside runs on s's device's one
    queue, as everywhere else (a device has one stream); the current device
    is set to s's device inside the block."""

    def __init__(self, stream):
        set_stream(stream)
        self.stream = stream
        self._device = None

    def __enter__(self):
        if self.stream is not None:
            self._device = globals()["device"](self.stream.device_index)
            self._device.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self._device is not None:
            self._device.__exit__(*exc)
        return False


def stream(stream) -> StreamContext:
    return StreamContext(stream)
