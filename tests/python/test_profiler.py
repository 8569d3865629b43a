"""torch.profiler sees tpu work: "tpu::compile <op>" around compilation and
"tpu::execute <op>" around each launch (which waits for the execution while
a profiler is active), with durations."""
from __future__ import annotations

import torch
import torch_tpu
from torch.profiler import ProfilerActivity, profile


def _tpu_events(prof) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name.startswith("tpu::"):
            out.setdefault(e.name, []).append(e.cpu_time_total)
    return out


def test_profile_records_compile_and_execute_events():
    torch_tpu._C.clear_executable_cache()  # so that the ops below compile inside the profile
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    ta, tb = a.to("tpu"), b.to("tpu")
    # Debug mode compiles a key at its first call, on the calling thread.
    # (Strict mode serves a new key's first calls on the CPU kernel, events
    # "tpu::host_first <op>", and compiles it on the background thread from
    # its second call, which the profiler does not record; docs/design.md
    # "Host-first calls". With the shared disk cache holding the program, a
    # strict call loads it on the calling thread instead: either way.)
    with torch_tpu.eager_mode("debug"), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = (ta + tb) * tb
        out.cpu()
    torch.testing.assert_close(out.cpu(), (a + b) * b, rtol=0, atol=0)
    events = _tpu_events(prof)
    for name in ("tpu::compile aten::add.Tensor", "tpu::execute aten::add.Tensor",
                 "tpu::compile aten::mul.Tensor", "tpu::execute aten::mul.Tensor"):
        assert name in events, sorted(events)
        assert all(d > 0 for d in events[name]), (name, events[name])

    # Cached: strict mode runs the compiled programs, executions only.
    with torch_tpu.eager_mode("strict"), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = (ta + tb) * tb
        out.cpu()
    events = _tpu_events(prof)
    assert "tpu::execute aten::add.Tensor" in events and "tpu::execute aten::mul.Tensor" in events
    assert not [n for n in events if n.startswith("tpu::compile")], sorted(events)


def test_profile_of_a_fused_region():
    a = torch.randn(3, 11)
    ta = a.to("tpu")
    with torch_tpu.eager_mode("fused"):
        # A new region key runs op by op while it compiles in the
        # background; metrics() waits, so the profiled one is the program.
        (ta * 2 - 1).exp().cpu()
        torch_tpu.metrics()
    with torch_tpu.eager_mode("fused"), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = (ta * 2 - 1).exp()
        got = out.cpu()
    torch.testing.assert_close(got, (a * 2 - 1).exp())
    events = _tpu_events(prof)
    assert any(n.startswith("tpu::execute fused region of ") for n in events), sorted(events)


def test_no_events_without_a_profiler():
    # Outside a profile nothing is recorded (and the tpu scopes take
    # RecordFunction's inactive fast path).
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pass
    x = torch.ones(4, device="tpu") + 1
    assert x.cpu().tolist() == [2.0] * 4
    assert not _tpu_events(prof)
