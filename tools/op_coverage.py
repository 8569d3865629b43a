#!/usr/bin/env python
"""Runs the OpInfo conformance harness (tests/python/opinfo_harness.py) and
writes docs/op_coverage.md.

    python tools/op_coverage.py                # fast subset (what the test suite runs)
    python tools/op_coverage.py --full         # every sample, dtype and mode
    python tools/op_coverage.py --ops add,mm   # only these OpInfos (names or regexes)
    python tools/op_coverage.py --report-only  # rewrite the report from the last results
    python tools/op_coverage.py --error-inputs [--full]  # only the OpInfos' error_inputs: rewrites
                                               # the "error_inputs" section of the report in place

Each OpInfo's error_inputs (invalid inputs CPU rejects) run after its
samples (opinfo_harness.error_plan: fast subset, or every ErrorInput in strict
and debug mode with --full); their outcomes have phase "error" and are
counted in their own section of the report.

The OpInfos run in a worker process that appends one JSON line per outcome
to a results file (--results). A worker that dies (segfault, abort) or stalls
(--stall seconds without progress) is replaced: the sample it was running is
recorded as a "crash"/"timeout" failure with a repro command, and the new
worker resumes after it. Compile times are measured against a fresh on-disk
executable cache (a temporary TORCH_TPU_CACHE_DIR) unless --keep-cache.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

DEFAULT_RESULTS = os.path.join(ROOT, "build", "opinfo_results.jsonl")
DEFAULT_OUTPUT = os.path.join(ROOT, "docs", "op_coverage.md")
DEFAULT_ERROR_RESULTS = os.path.join(ROOT, "build", "opinfo_error_results.jsonl")

try:
    from tqdm import tqdm
except ImportError:  # plain prints instead
    tqdm = None


# ---------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------


def worker_main(args) -> int:
    import torch  # noqa: F401
    import torch_tpu  # noqa: F401
    import opinfo_harness as H

    with open(args.worker_ops) as f:
        names = [line.strip() for line in f if line.strip()]
    skip_keys = set()
    if args.worker_skip and os.path.exists(args.worker_skip):
        with open(args.worker_skip) as f:
            skip_keys = {tuple(json.loads(line)) for line in f if line.strip()}
    out = open(args.results, "a", buffering=1)

    def emit(record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    crash_at = os.environ.get("OP_COVERAGE_TEST_CRASH_AT")  # "op|dtype|mode|phase|sample": tests the recovery

    def on_start(key) -> None:
        emit({"type": "start", "key": list(key)})
        if crash_at and "|".join(map(str, key)) == crash_at:
            os.kill(os.getpid(), signal.SIGSEGV)

    max_samples = None if args.full else H.FAST_MAX_SAMPLES
    for name in names:
        # Each XLA CPU executable keeps ~3 memory mappings; a process that
        # compiles ~20k of them hits vm.max_map_count and LLVM crashes
        # ("Cannot allocate memory"). Drop the in-memory cache now and then.
        if torch_tpu.metrics()["cached_executables"] > args.max_cached:
            torch_tpu._C.clear_executable_cache()
        op = H.find_op(name)
        emit({"type": "op_start", "op": name})
        try:
            if not args.error_inputs:
                for outcome in H.run_op(op, H.plan(op, args.full), max_samples=max_samples, skip_keys=skip_keys,
                                        on_start=on_start, trace=True):
                    emit({"type": "outcome", **outcome.__dict__})
            for mode, limit in H.error_plan(op, args.full):
                for outcome in H.run_error_inputs(op, (mode,), skip_keys=skip_keys, on_start=on_start, limit=limit):
                    emit({"type": "outcome", **outcome.__dict__})
        except Exception as e:  # noqa: BLE001 - harness bug: record and go on
            emit({"type": "outcome", **H.Outcome(name, "*", "*", "*", -1, "fail", H.first_line(e),
                                                 "harness error").__dict__})
        emit({"type": "op_done", "op": name})
    return 0


# ---------------------------------------------------------------------------
# Parent: workers, crash and stall handling
# ---------------------------------------------------------------------------


def read_records(path: str) -> list[dict]:
    records = []
    if not os.path.exists(path):
        return records
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                pass
    return records


def repro_command(key, full: bool) -> str:
    op, dtype, mode, phase, sample = key
    if phase == "error":
        return (f"python -c \"import sys; sys.path.insert(0, 'tests/python'); import opinfo_harness as H; "
                f"op = H.find_op('{op}'); c = [c for c in H.generate_error_cases(op)[0] if c.index == {sample}][0]; "
                f"print(H.run_error_case(op, c, '{mode}'))\"")
    return (f"python -c \"import sys; sys.path.insert(0, 'tests/python'); import torch, opinfo_harness as H; "
            f"op = H.find_op('{op}'); s = H.generate_samples(op, torch.{dtype}, {phase == 'bwd'}, "
            f"{sample + 1})[{sample}]; print(H.run_sample(op, s, {sample}, torch.{dtype}, '{mode}', '{phase}'))\"")


def run_workers(names: list[str], args) -> None:
    """Runs `names` in worker subprocesses until every op is done, appending to args.results."""
    state_dir = tempfile.mkdtemp(prefix="op_coverage_")
    skip_path = os.path.join(state_dir, "skip.jsonl")
    env = dict(os.environ)
    env.setdefault("TORCH_TPU_EAGER_MODE", "strict")
    cache_dir = None
    if not args.keep_cache:
        cache_dir = os.path.join(state_dir, "cache")
        env["TORCH_TPU_CACHE_DIR"] = cache_dir
    env["PYTHONUNBUFFERED"] = "1"
    done = {r["op"] for r in read_records(args.results) if r.get("type") == "op_done"}
    skip_keys = {tuple(r["key"]) for r in read_records(args.results)
                 if r.get("type") == "outcome" and r.get("category") in ("crash", "timeout")}
    with open(skip_path, "w") as f:
        for k in skip_keys:
            f.write(json.dumps(list(k)) + "\n")
    todo = [n for n in names if n not in done]
    # A bar on a terminal; one line per op in logs (no carriage-return redraws).
    bar = (tqdm(total=len(names), initial=len(names) - len(todo), unit="op", dynamic_ncols=True)
           if tqdm and sys.stderr.isatty() else None)
    restarts = 0
    while todo:
        ops_path = os.path.join(state_dir, "ops.txt")
        with open(ops_path, "w") as f:
            f.write("\n".join(todo) + "\n")
        offset = os.path.getsize(args.results) if os.path.exists(args.results) else 0
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--worker-ops", ops_path,
               "--worker-skip", skip_path, "--results", args.results, "--max-cached", str(args.max_cached)]
        cmd += ["--full"] if args.full else []
        cmd += ["--error-inputs"] if args.error_inputs else []
        if args.nice:
            cmd = ["nice", "-n", str(args.nice)] + cmd
        log = open(os.path.join(state_dir, f"worker{restarts}.log"), "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        last_key, last_progress, current_op = None, time.time(), None
        pos = offset
        stalled = False
        while True:
            rc = proc.poll()
            with open(args.results) as f:
                f.seek(pos)
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1] if "\n" in chunk else ""
            pos += len(complete.encode())
            for line in complete.splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                last_progress = time.time()
                t = r.get("type")
                if t == "start":
                    last_key = tuple(r["key"])
                elif t == "outcome":
                    last_key = None
                elif t == "op_start":
                    current_op = r["op"]
                    if bar:
                        bar.set_postfix_str(current_op[:40])
                elif t == "op_done":
                    done.add(r["op"])
                    current_op = None
                    if bar:
                        bar.update(1)
                    else:
                        print(f"[{len(done)}/{len(names)}] {r['op']}", flush=True)
            if rc is not None:
                break
            if time.time() - last_progress > args.stall:
                stalled = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = proc.returncode
                break
            time.sleep(0.5)
        log.close()
        todo = [n for n in names if n not in done]
        if not todo:
            break
        # The worker died or stalled: record what it was running, then resume.
        restarts += 1
        import opinfo_harness as H  # noqa: E402 (only for the Outcome record)

        if last_key is None and current_op is not None:
            # died between samples (sample generation, CPU reference...)
            last_key = (current_op, "*", "*", "*", -1)
        if last_key is None:
            print(f"worker exited with {rc} outside any op; log: {log.name}", file=sys.stderr)
            last_key = (todo[0], "*", "*", "*", -1)
        category = "timeout" if stalled else "crash"
        with open(log.name) as f:
            tail = [ln for ln in f.read().splitlines() if ln.strip()][-3:]
        why = f"stalled > {args.stall}s" if stalled else f"process died (exit {rc}" + (
            f", signal {signal.Signals(-rc).name})" if rc and rc < 0 else ")")
        reason = why + (": " + " | ".join(tail)[-300:] if tail else "")
        outcome = H.Outcome(*last_key, status="fail", reason=reason, category=category)
        record = {"type": "outcome", **outcome.__dict__, "repro": repro_command(last_key, args.full)}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"\n{category}: {last_key}: {reason}", file=sys.stderr)
        if last_key[1] == "*":  # cannot resume inside the op: give it up
            with open(args.results, "a") as f:
                f.write(json.dumps({"type": "op_done", "op": last_key[0]}) + "\n")
            done.add(last_key[0])
            if bar:
                bar.update(1)
        else:
            with open(skip_path, "a") as f:
                f.write(json.dumps(list(last_key)) + "\n")
        todo = [n for n in names if n not in done]
        if restarts > args.max_restarts:
            print("too many worker restarts; stopping", file=sys.stderr)
            break
    if bar:
        bar.close()
    if cache_dir:
        shutil.rmtree(state_dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def latest_outcomes(records: list[dict]) -> dict:
    """Outcome records by key (op, dtype, mode, phase, sample); a rerun of an op
    (after a crash) replaces its earlier records."""
    outcomes = {}
    for r in records:
        if r.get("type") == "outcome":
            outcomes[(r["op"], r["dtype"], r["mode"], r["phase"], r["sample"])] = r
    return outcomes


def pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.1f}%" if b else "n/a"


def md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def shorten_reason(reason: str) -> str:
    """Groups reasons that differ only in numbers/indices."""
    r = re.sub(r"0x[0-9a-f]+", "0x…", reason)
    r = re.sub(r"\(called from [^)]*\)", "", r)
    r = re.sub(r"\bat index \([^)]*\)", "", r)
    r = re.sub(r"(?<![A-Za-z_\d])-?\d+(\.\d+)?(e[-+]?\d+)?", "N", r)
    return r.strip()[:240]


def write_report(args) -> dict:
    import torch
    import torch_tpu
    import opinfo_harness as H

    records = read_records(args.results)
    outcomes = latest_outcomes(records)
    meta = next((r for r in records if r.get("type") == "meta"), {})
    error_outcomes = {k: o for k, o in outcomes.items() if o["phase"] == H.ERROR_PHASE}
    outcomes = {k: o for k, o in outcomes.items() if o["phase"] != H.ERROR_PHASE}
    if args.error_inputs:
        return splice_error_section(args, error_section(error_outcomes, meta))
    # The lowerings of the build that ran (the library may have grown since).
    lowered = set(meta["lowered_ops"]) if meta.get("lowered_ops") else H.lowered_names()

    by_op = collections.defaultdict(list)
    for o in outcomes.values():
        by_op[o["op"]].append(o)

    # ATen overloads each OpInfo reached (CPU trace) and every fallback seen.
    reached_by = collections.defaultdict(set)    # overload -> OpInfo names
    fell_back = collections.defaultdict(set)     # overload -> OpInfo names
    for o in outcomes.values():
        for a in o.get("aten_ops") or ():
            reached_by[a].add(o["op"])
        for fb in o.get("fallbacks") or ():
            fell_back[H.fallback_to_overload(fb)].add(o["op"])

    # An OpInfo "has a lowering" when a sample reached an ATen op with one,
    # or with an op kernel of the tpu key's own (the data-dependent-shape
    # kernels; not the generic empty/copy/view plumbing of DIRECT_KERNELS).
    def served_by_op_kernel(a: str) -> bool:
        base = H.base_name(a)
        return base in lowered or (base not in H.DIRECT_KERNELS and H._has_tpu_kernel(a))

    def op_has_lowering(name: str) -> bool:
        return any(served_by_op_kernel(a) for o in by_op[name] for a in (o.get("aten_ops") or ()))

    in_scope = sorted(n for n in by_op if op_has_lowering(n))

    # A sample is "fully lowered" when every ATen op it reaches (CPU trace of
    # the strict run) has a lowering, a direct kernel, or a PyTorch
    # decomposition kernel for the tpu key.
    strict_of = {(o["op"], o["dtype"], o["phase"], o["sample"]): o for o in outcomes.values()
                 if o["mode"] == "strict"}
    composite_cache = {}

    def is_composite(a: str) -> bool:
        if a not in composite_cache:
            composite_cache[a] = H.has_composite_kernel(a) is not None
        return composite_cache[a]

    def fully_lowered(o) -> bool:
        """Every ATen op the sample reaches is served natively; ops that
        PyTorch decomposes for the tpu key count when the sample had no
        fallback (else the decomposition reached an op without a lowering)."""
        s = strict_of.get((o["op"], o["dtype"], o["phase"], o["sample"]))
        ops = (s.get("aten_ops") or ()) if s else ()
        if not ops:
            return False
        rest = [a for a in ops if not H.natively_served(a, lowered)]
        if any(not is_composite(a) for a in rest):
            return False
        return not rest or not s.get("fallbacks")
    out_of_scope = sorted(n for n in by_op if n not in set(in_scope))

    # -- core ATen ops
    core = H.core_aten_ops()
    core_rows = []
    core_status = collections.Counter()
    for ov in core:
        why = H.natively_served(ov, lowered)
        users = reached_by.get(ov, set())
        fbs = fell_back.get(ov, set())
        composite = H.has_composite_kernel(ov)
        if why:
            status = "lowered natively" if not fbs else "lowered natively (some inputs fall back)"
            note = why
        elif composite == "CompositeImplicitAutograd":
            status, note = "decomposed (runs natively)", "CompositeImplicitAutograd: decomposed before the tpu key"
        elif users and not fbs and composite:
            status, note = "decomposed (runs natively)", f"PyTorch's {composite} kernel; no fallback seen"
        elif fbs:
            status, note = "CPU fallback", "observed"
        elif users:
            status, note = "CPU fallback", "reached; no lowering"
        else:
            status, note = "untested", "no lowering" + (f"; has a {composite} kernel" if composite else "")
        core_status[status] += 1
        examples = sorted(users)[:3]
        core_rows.append((ov, status, note, len(users), examples, sorted(fbs)[:3]))
    n_core = len(core)
    n_native = core_status["lowered natively"] + core_status["lowered natively (some inputs fall back)"]
    n_decomposed = core_status["decomposed (runs natively)"]
    core_packets = collections.defaultdict(list)
    for ov, status, *_ in core_rows:
        core_packets[ov.rsplit(".", 1)[0]].append(status.startswith("lowered"))

    # -- sample totals (strict mode; in-scope OpInfos)
    def tally(filter_fn):
        c = collections.Counter()
        for name in in_scope:
            for o in by_op[name]:
                if filter_fn(o):
                    c[o["status"]] += 1
        return c

    counted = ("pass", "fail", "fallback")

    def rate(c):
        n = sum(c[s] for s in counted)
        return c["pass"], n

    strict_all = tally(lambda o: o["mode"] == "strict")
    strict_lowered = tally(lambda o: o["mode"] == "strict" and fully_lowered(o))
    strict_lowered_dtype = {d: tally(lambda o, d=d: o["mode"] == "strict" and o["dtype"] == d and fully_lowered(o))
                            for d in H.DTYPE_NAMES.values()}
    debug_all = tally(lambda o: o["mode"] == "debug")
    per_dtype = {d: tally(lambda o, d=d: o["mode"] == "strict" and o["dtype"] == d) for d in H.DTYPE_NAMES.values()}
    strict_fwd = tally(lambda o: o["mode"] == "strict" and o["phase"] == "fwd")
    strict_bwd = tally(lambda o: o["mode"] == "strict" and o["phase"] == "bwd")
    every = collections.Counter(o["status"] for o in outcomes.values() if o["mode"] == "strict")

    # -- failures grouped by cause
    causes = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    example = {}  # (category, op, normalized reason) -> first raw reason, with where it happened
    for o in outcomes.values():
        if o["status"] == "fail":
            cat = o.get("category") or "runtime error"
            reason = o["reason"]
        elif o["status"] == "fallback":
            cat, reason = "missing lowering (CPU fallback)", ", ".join(o.get("fallbacks") or ())
        else:
            continue
        norm = shorten_reason(reason)
        causes[cat][o["op"]][norm] += 1
        example.setdefault((cat, o["op"], norm), f"{reason} [{o['dtype']} {o['mode']} {o['phase']}]")

    # -- compile time per OpInfo
    compile_s = collections.Counter()
    compiles = collections.Counter()
    for o in outcomes.values():
        compile_s[o["op"]] += o.get("compile_s") or 0.0
        compiles[o["op"]] += o.get("compiles") or 0

    # Per lowering: samples whose trace reaches exactly one lowered ATen op
    # (plus ops without compiles: views, direct kernels) attribute their
    # compile time to it.
    per_lowering_s = collections.Counter()
    per_lowering_n = collections.Counter()
    per_lowering_max = {}
    for o in outcomes.values():
        if not o.get("compiles") or o["mode"] != "strict":
            continue
        bases = {H.base_name(a) for a in (o.get("aten_ops") or ()) if H.base_name(a) in lowered}
        if len(bases) != 1:
            continue
        (b,) = bases
        per_lowering_s[b] += o["compile_s"]
        per_lowering_n[b] += o["compiles"]
        per_compile = o["compile_s"] / o["compiles"]
        if per_compile > per_lowering_max.get(b, (0, ""))[0]:
            per_lowering_max[b] = (per_compile, f"{o['op']} {o['dtype']} {o['phase']} sample {o['sample']}")

    crashes = [o for o in outcomes.values() if o.get("category") in ("crash", "timeout")]

    # -- write
    L = []
    w = L.append
    w("# Op coverage: core ATen ops and PyTorch's OpInfo samples on `tpu`")
    w("")
    w(f"Generated by `tools/op_coverage.py{' --full' if meta.get('full') else ''}` "
      f"on {meta.get('date', '?')} (torch {torch.__version__}, plugin "
      f"{meta.get('platform', '?')}); {len(lowered)} lowerings registered. Do not edit by hand.")
    w("")
    w("## How to read this page")
    w("")
    w("**Core ATen ops** are the overloads of `torch.ops.aten` tagged `torch.Tag.core`. Status rule:")
    w("")
    w("- *lowered natively*: the overload's base name (in-place `_` stripped, overload ignored: "
      "`add_.Tensor` → `add`) is in `torch_tpu._C.lowered_ops()`; or the tpu key serves it without a "
      "lowering: a direct kernel in `csrc/aten/kernels.cpp` (`empty.memory_format`, `empty_strided`, "
      "`as_strided`, `view`, `_reshape_alias`, `_copy_from`, `_local_scalar_dense`, ...) or any other kernel "
      "registered for the tpu key (the data-dependent-shape ops of `csrc/aten/dynamic_shape_kernels.cpp`: "
      "`nonzero`, `masked_select`, `unique*`, `equal`, `take`, `put_`), a view op whose "
      "PyTorch kernel only builds an `as_strided`/`alias` view (`expand`, `permute`, `select`, `slice`, "
      "`squeeze`, `unsqueeze`, `diagonal`, `split_with_sizes`, `alias`), or a size/stride query (`sym_*`). "
      "\"(some inputs fall back)\": the lowering raised for some samples, which then ran on the CPU.")
    w("- *decomposed (runs natively)*: no lowering, but PyTorch decomposes it: a CompositeImplicitAutograd "
      "kernel (the op never reaches the tpu key), or a CompositeExplicitAutograd kernel that turns it into "
      "lowered ops, with no fallback in any OpInfo sample that reached it.")
    w("- *CPU fallback*: no lowering; \"observed\" when an OpInfo sample was seen falling back through it "
      "(`torch_tpu.metrics()[\"cpu_fallbacks\"]`).")
    w("- *untested*: no lowering and no OpInfo sample reached it (it would fall back).")
    w("")
    w("\"Reached by\" comes from running each sample on CPU under a `TorchDispatchMode` that records the "
      "ATen overloads after autograd and PyTorch's CompositeImplicitAutograd decompositions (what the tpu "
      "key sees).")
    w("")
    w("**OpInfo samples** (`tests/python/opinfo_harness.py`): each sample of "
      "`op.sample_inputs(\"cpu\", dtype)` runs on CPU and on a tpu copy, for float32, bfloat16, int64 and "
      "bool where the OpInfo supports them on CPU; forward in every dtype, backward (input gradients of "
      "`torch.autograd.grad` with fixed random output gradients) in float32 where the OpInfo supports "
      "autograd; in strict and debug mode. Outcomes: *pass*; *fail* (tpu raised where CPU did not, or "
      "values differ); *fallback* (values match but an ATen op ran on the CPU); *skip* (CPU itself raises "
      "for the sample, complex inputs, no gradient to compare, or debug mode's NaN/Inf check fired as "
      "designed on non-finite values). Percentages count pass / (pass + fail + fallback).")
    w("")
    w("Tolerances (`opinfo_harness.tolerance`): float32 rtol=1.3e-6 atol=1e-5; bfloat16 rtol=1.6e-2 "
      "atol=1e-5, atol=1e-2 for reductions, matmuls, convolutions, norms, losses and pooling; int64 and "
      "bool exact; raised to any `toleranceOverride` the OpInfo declares for that dtype; NaN equals NaN. "
      "Random ops (names with rand/normal/bernoulli/dropout/..., `empty*`) compare shapes, dtypes and "
      "devices only. Unstable `sort`/`argsort`/`topk` accept any tie order that selects the same values.")
    w("")
    w("An OpInfo is *in scope* when one of its samples reached an ATen op with a lowering (or a tpu-key op kernel); the sample "
      "totals count in-scope OpInfos only. OpInfos without any lowering are listed at the end.")
    w("")
    w("## Totals")
    w("")
    w(f"- Core ATen ops lowered natively: **{n_native} / {n_core} = {pct(n_native, n_core)}** "
      f"(with PyTorch's decompositions that run natively: {n_native + n_decomposed} / {n_core} = "
      f"{pct(n_native + n_decomposed, n_core)}; by op name: "
      f"{sum(all(v) for v in core_packets.values())} / {len(core_packets)} fully lowered).")
    w(f"- Core ATen ops: " + ", ".join(f"{k} {v}" for k, v in core_status.most_common()) + ".")
    p, n = rate(strict_lowered)
    w(f"- OpInfo samples passing in strict mode, counting the samples whose ATen ops all have a lowering "
      f"(all dtypes incl. bfloat16, forward and backward): **{p} / {n} = {pct(p, n)}** "
      f"(fail {strict_lowered['fail']}, fallback {strict_lowered['fallback']}, skipped {strict_lowered['skip']}); "
      + ", ".join(f"{d} {pct(*rate(c))}" for d, c in strict_lowered_dtype.items()) + ".")
    p, n = rate(strict_all)
    w(f"- OpInfo samples passing in strict mode, every sample of the in-scope OpInfos (a fallback counts as "
      f"not passing): **{p} / {n} = {pct(p, n)}** (fail {strict_all['fail']}, fallback {strict_all['fallback']}, "
      f"skipped {strict_all['skip']}).")
    for label, c in (("strict forward", strict_fwd), ("strict backward (float32)", strict_bwd),
                     ("debug mode", debug_all)):
        p, n = rate(c)
        w(f"  - {label}: {p} / {n} = {pct(p, n)} (fail {c['fail']}, fallback {c['fallback']}, skip {c['skip']})")
    for d, c in per_dtype.items():
        p, n = rate(c)
        w(f"  - strict {d}: {p} / {n} = {pct(p, n)} (fail {c['fail']}, fallback {c['fallback']}, skip {c['skip']})")
    p = every["pass"]
    n = sum(every[s] for s in counted)
    w(f"- All OpInfos, strict mode, including those without any lowering: {p} / {n} = {pct(p, n)}.")
    clean = [n for n in in_scope if not any(o["status"] in ("fail", "fallback") for o in by_op[n] if o["mode"] == "strict")]
    failing = [n for n in in_scope if any(o["status"] == "fail" for o in by_op[n] if o["mode"] == "strict")]
    w(f"- In-scope OpInfos whose strict samples all pass natively (no fail, no fallback): {len(clean)} / "
      f"{len(in_scope)} = {pct(len(clean), len(in_scope))}; with at least one failing strict sample: {len(failing)}.")
    w(f"- OpInfos: {len(by_op)} run, {len(in_scope)} in scope, {len(out_of_scope)} without any lowering; "
      f"{len(crashes)} crash/timeout records.")
    w("")

    w("## Failures by cause")
    w("")
    w("Every mode and phase; each reason is shown as first seen, with its dtype, mode and phase, and the "
      "number of samples that failed for a reason of the same form (numbers aside). Causes: *crash* (the "
      "process died), *compile error* (PJRT rejected the lowered module), *runtime error* (tpu raised "
      "where CPU did not), *wrong values* (results differ from CPU beyond the tolerance, or differ in "
      "shape, dtype or device), *debug check* (debug mode's NaN/Inf check raised on a sample whose CPU "
      "values are finite: an intermediate NaN/Inf that the op later masks), *missing lowering* (values "
      "match but ATen ops ran on the CPU).")
    w("")
    order = ["crash", "timeout", "compile error", "runtime error", "wrong values", "debug check", "harness error",
             "missing lowering (CPU fallback)"]
    for cat in order + sorted(set(causes) - set(order)):
        if cat not in causes:
            continue
        ops = causes[cat]
        total = sum(sum(c.values()) for c in ops.values())
        w(f"### {cat} ({total} samples, {len(ops)} OpInfos)")
        w("")
        w("| OpInfo | samples | reasons (count) |")
        w("|---|---:|---|")
        for name, reasons in sorted(ops.items(), key=lambda kv: -sum(kv[1].values())):
            text = "; ".join(f"{md_escape(example[(cat, name, r)][:300])} ({c})" for r, c in reasons.most_common(3))
            if len(reasons) > 3:
                text += f"; … {len(reasons) - 3} more"
            w(f"| `{name}` | {sum(reasons.values())} | {text} |")
        w("")
    if crashes:
        w("### Crash/timeout repros")
        w("")
        for o in crashes:
            w(f"- `{o['op']}` {o['dtype']} {o['mode']} {o['phase']} sample {o['sample']}: {md_escape(o['reason'])}")
            if o.get("repro"):
                w(f"  `{o['repro']}`")
        w("")

    L.extend(error_section(error_outcomes, meta))

    w("## Slowest to compile")
    w("")
    w("Compile seconds per OpInfo (sum of `torch_tpu.metrics()[\"compile_time_s\"]` deltas over its samples, "
      "fresh executable cache; an executable compiled for an earlier OpInfo is a cache hit here).")
    w("")
    w("| OpInfo | compile s | compiles | s / compile |")
    w("|---|---:|---:|---:|")
    for name, s in compile_s.most_common(15):
        if s <= 0:
            break
        w(f"| `{name}` | {s:.2f} | {compiles[name]} | {s / max(compiles[name], 1):.3f} |")
    w("")

    w("Per lowering: strict-mode samples whose ATen ops include exactly one lowered op (the others being "
      "views or direct kernels) charge their compile time to it; mean and worst seconds per compile.")
    w("")
    w("| lowering | compiles | mean s | worst s | worst sample |")
    w("|---|---:|---:|---:|---|")
    ranked = sorted(per_lowering_max, key=lambda b: -per_lowering_max[b][0])[:20]
    for b in ranked:
        w(f"| `{b}` | {per_lowering_n[b]} | {per_lowering_s[b] / per_lowering_n[b]:.3f} | "
          f"{per_lowering_max[b][0]:.3f} | {per_lowering_max[b][1]} |")
    w("")

    w("## Core ATen ops")
    w("")
    w("| overload | status | note | reached by (OpInfos) | fell back in |")
    w("|---|---|---|---|---|")
    for ov, status, note, n_users, examples, fbs in core_rows:
        ex = ", ".join(f"`{e}`" for e in examples) + (f" +{n_users - len(examples)}" if n_users > len(examples) else "")
        w(f"| `{ov}` | {status} | {note} | {ex} | {', '.join(f'`{e}`' for e in fbs)} |")
    w("")

    w("## OpInfo results (in scope)")
    w("")
    w("Cells: pass / fail / fallback / skip for that dtype, mode and phase; `-` not run.")
    w("")
    cols = [(d, m, ph) for ph in ("fwd", "bwd") for m in ("strict", "debug") for d in H.DTYPE_NAMES.values()
            if ph == "fwd" or d == "float32"]
    present = {(o["dtype"], o["mode"], o["phase"]) for o in outcomes.values()}
    cols = [c for c in cols if c in present]
    w("| OpInfo | " + " | ".join(f"{m} {ph} {d}" for d, m, ph in cols) + " |")
    w("|---|" + "---|" * len(cols))
    for name in in_scope:
        cells = []
        for col in cols:
            c = collections.Counter(o["status"] for o in by_op[name] if (o["dtype"], o["mode"], o["phase"]) == col)
            cells.append("-" if not c else f"{c['pass']}/{c['fail']}/{c['fallback']}/{c['skip']}")
        w(f"| `{name}` | " + " | ".join(cells) + " |")
    w("")

    w("## OpInfos without any lowering")
    w("")
    w("No sample of these reached an ATen op with a lowering (everything ran on the CPU or was skipped). "
      "The ATen ops that fell back:")
    w("")
    w("| OpInfo | fell back |")
    w("|---|---|")
    for name in out_of_scope:
        fbs = sorted({fb for o in by_op[name] for fb in (o.get("fallbacks") or ())})
        note = ", ".join(f"`{f}`" for f in fbs[:6]) + (" …" if len(fbs) > 6 else "")
        if not fbs:
            skips = collections.Counter(shorten_reason(o["reason"]) for o in by_op[name] if o["status"] == "skip")
            note = "(all skipped: " + md_escape(skips.most_common(1)[0][0] if skips else "no samples") + ")"
        w(f"| `{name}` | {note} |")
    w("")

    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write("\n".join(L))
    summary = {
        "core_native": n_native, "core_total": n_core, "core_decomposed": n_decomposed,
        "strict_pass": rate(strict_all)[0], "strict_counted": rate(strict_all)[1],
        "lowered_pass": rate(strict_lowered)[0], "lowered_counted": rate(strict_lowered)[1],
        "in_scope": len(in_scope), "opinfos": len(by_op),
    }
    return summary


ERROR_BEGIN = "<!-- error_inputs: begin (tools/op_coverage.py --error-inputs rewrites this section) -->"
ERROR_END = "<!-- error_inputs: end -->"


def error_section(outcomes: dict, meta: dict) -> list[str]:
    """The report's "error_inputs" section (between ERROR_BEGIN/ERROR_END)."""
    import opinfo_harness as H

    L = [ERROR_BEGIN]
    w = L.append
    w("## error_inputs: invalid inputs that CPU rejects")
    w("")
    if not outcomes:
        w("Not run in this report's run.")
        w("")
        w(ERROR_END)
        return L
    modes = sorted({o["mode"] for o in outcomes.values()})
    w(f"From `tools/op_coverage.py{' --full' if meta.get('full') else ''}"
      f"{' --error-inputs' if meta.get('error_inputs') else ''}` on {meta.get('date', '?')}, "
      f"modes {', '.join(modes)}.")
    w("")
    w("Every OpInfo's `error_inputs(device)` (PyTorch's own invalid inputs, each with the exception type and "
      "the message regex PyTorch raises: what `test_ops.py::test_errors` asserts on each device), run by "
      "`opinfo_harness.run_error_case`: each ErrorInput generated for `\"cpu\"` is first checked on CPU (CPU "
      "must raise the declared type with a matching message, else the case is a *skip*), then its tensors "
      "are copied to tpu keeping their layout (views of one storage stay views of one storage, expanded "
      "tensors stay expanded) and the call, the copy of its result to the host and a synchronize() run "
      "inside the expectation: in strict mode an error that needs device values surfaces at that sync "
      "point. *pass*: tpu raised the same exception type with a message matching the regex (or the regex "
      "PyTorch declares for a non-CPU device for the same sample, generated with `error_inputs(\"tpu\")`); "
      "ErrorInputs that only exist for a non-CPU device (a CPU tensor mixed into a tpu call) run as "
      "generated. *fail*: *no error* (tpu returned a value), *wrong exception type*, *message differs*. "
      "Passes counted \"via CPU fallback\" raised from an op that ran on the CPU (no lowering, or a call "
      "whose written tensor overlaps another argument, which runs on a CPU mirror of the same layout). "
      "`error_inputs_sparse` is not run here: the OpInfos with sparse error inputs (`mul`, `sum`, "
      "`zeros_like`, `randn_like`) define none for the COO layout, the sparse layout tpu has "
      "(tests/python/test_sparse.py checks that and runs every OpInfo's COO samples against CPU); "
      "compressed layouts (CSR/CSC/BSR/BSC) have no tpu kernels.")
    w("")
    w("Errors that need device values (beyond the ErrorInputs; tests/python/test_errors.py checks each in "
      "strict, debug and fused mode against CPU's exception type and message) are value checks "
      "(`LoweringContext::check`: a 0-d pred computed in the op's program): strict and fused mode raise them "
      "at the next sync point naming the op, debug mode at the op; strict mode's host-served calls of a "
      "signature (its first two, by default) run CPU's kernel, which raises CPU's own message. The next sync point may be a read of an "
      "unrelated tensor (`d = a // b; e = a * 3; e.cpu()` raises d's error); afterwards every tensor holding the "
      "bad value (the op's results, in-place and out= arguments, their views, and values computed from them; in "
      "fused mode every value its region wrote) raises the same error at each read or use, until replaced by a copy from the host or a whole-storage "
      "`copy_` of a clean tpu tensor (tests/python/test_value_check_poison.py). Checked so: integer `pow` with a "
      "negative Scalar exponent; integer `floor_divide`, `remainder`, `fmod` and `div(rounding_mode=...)` by "
      "zero (\"ZeroDivisionError\"); `bernoulli` with a tensor p outside [0, 1] or NaN; `normal` with a "
      "tensor std holding a value < 0 or NaN; `multinomial`'s "
      "weights; `binary_cross_entropy`'s inputs; `max_unpool` indices; `nll_loss`/`cross_entropy` targets "
      "(IndexError); the index ranges of index_*/gather/scatter*/index/index_put/embedding (the message "
      "names the dimension and size, not the index). Checked before the call, on the host: a float p of "
      "`bernoulli`, index dtypes of index_fill/index_copy/index_add/index_reduce/index_select, out= dtypes "
      "and `alpha` kinds of TensorIterator ops, `random_` bounds; when lowered (float and int arguments are "
      "part of the key): `uniform_`'s from/to (within the dtype, to - from <= its max), `normal`'s float std, "
      "`randperm`'s n against its dtype. Partial overlaps of views of one storage, "
      "dense or not, run on a CPU mirror (CPU's error or CPU's element-order result). Not checked, no "
      "cheap check being available: `histc` with a non-finite range, `segment_reduce`'s unsafe=False "
      "checks, the out= dtype exactness of `aminmax`/`multinomial` and the out= overlaps of `cat` (after "
      "resizing) and `kthvalue` (below). torch.compile(backend=\"tpu\") graphs evaluate the same value and "
      "index checks (each a pred output of the graph's program, raised at the next sync point after the "
      "graph with CPU's exception type, naming the op; in fused regions holding the graph too; "
      "tests/python/test_compile_checks.py); a symbolic graph with a check is bucketed only where the "
      "checked operand's padding is masked (`remainder`, `fmod`, `div(rounding_mode=...)` divisors, "
      "`embedding` indices), and compiles per shape otherwise.")
    w("")
    by_mode = collections.defaultdict(collections.Counter)
    via_fallback = collections.Counter()
    fails = []
    skips = collections.Counter()
    for o in outcomes.values():
        by_mode[o["mode"]][o["status"]] += 1
        if o["status"] == "fail":
            by_mode[o["mode"]][o.get("category") or "fail"] += 1
            fails.append(o)
        if o["status"] == "pass" and o.get("fallbacks"):
            via_fallback[o["mode"]] += 1
        if o["status"] == "skip":
            skips[shorten_reason(o["reason"])] += 1
    n_ops = len({o["op"] for o in outcomes.values()})
    w(f"### Totals ({n_ops} OpInfos with error_inputs)")
    w("")
    w("| mode | pass | of which via CPU fallback | fail | no error | wrong exception type | message differs | "
      "skip |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in modes:
        c = by_mode[m]
        w(f"| {m} | **{c['pass']} / {c['pass'] + c['fail']} = {pct(c['pass'], c['pass'] + c['fail'])}** | "
          f"{via_fallback[m]} | {c['fail']} | {c['no error']} | {c['wrong exception type']} | "
          f"{c['message differs']} | {c['skip']} |")
    w("")
    if fails:
        w("### Failing error inputs")
        w("")
        w("Expected failures (`opinfo_harness.ERROR_EXPECTED_FAILURES`, xfail in tests/python/test_opinfo.py) "
          "give the reason: mostly checks a lowering cannot make cheaply.")
        w("")
        w("| OpInfo | mode | error input | cause | reason | expected failure |")
        w("|---|---|---:|---|---|---|")
        for o in sorted(fails, key=lambda o: (o["op"], o["sample"], o["mode"])):
            why = H.expected_error_failure(o["op"], o["mode"], o["sample"]) or ""
            w(f"| `{o['op']}` | {o['mode']} | {o['sample']} | {o.get('category')} | {md_escape(o['reason'][:300])} | "
              f"{md_escape(why)} |")
        w("")
    if skips:
        w("### Skipped error inputs")
        w("")
        w("| reason | count |")
        w("|---|---:|")
        for r, c in skips.most_common():
            w(f"| {md_escape(r)} | {c} |")
        w("")
    w(ERROR_END)
    return L


def splice_error_section(args, section: list[str]) -> dict:
    """Replaces the error_inputs section of an existing report (or adds it
    before "## Slowest to compile")."""
    text = open(args.output).read() if os.path.exists(args.output) else ""
    block = "\n".join(section)
    if ERROR_BEGIN in text and ERROR_END in text:
        head, rest = text.split(ERROR_BEGIN, 1)
        text = head + block + rest.split(ERROR_END, 1)[1]
    elif "## Slowest to compile" in text:
        head, rest = text.split("## Slowest to compile", 1)
        text = head + block + "\n\n## Slowest to compile" + rest
    else:
        text = text + ("\n" if text else "") + block + "\n"
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(text)
    return {"error_section": True}


def print_expected_failures(args) -> None:
    """Prints EXPECTED_FAILURES entries (opinfo_harness.py) for every
    (OpInfo, dtype, mode, phase) with a failing sample in the results; mode
    "*" where both modes fail."""
    outcomes = latest_outcomes(read_records(args.results))
    found = {}
    for o in sorted(outcomes.values(), key=lambda o: (o["op"], o["dtype"], o["phase"], o["mode"], o["sample"])):
        if o["status"] != "fail":
            continue
        key = (o["op"], o["dtype"], o["phase"])
        found.setdefault(key, {}).setdefault(o["mode"], f"{o.get('category') or 'fail'}: {o['reason'][:110]}")
    for (op, dtype, phase), modes in sorted(found.items()):
        if len(modes) == 2:
            print(f"    {(op, dtype, '*', phase)!r}: {modes.get('strict')!r},")
        else:
            ((mode, reason),) = modes.items()
            print(f"    {(op, dtype, mode, phase)!r}: {reason!r},")


# ---------------------------------------------------------------------------


def select_ops(patterns: str | None, error_inputs_only: bool = False) -> list[str]:
    import opinfo_harness as H

    names = []
    seen = set()
    for op in H.op_db():
        name = H.full_name(op)
        wanted = H.has_error_inputs(op) if error_inputs_only else (H.tested_dtypes(op) or H.has_error_inputs(op))
        if name in seen or not wanted:
            continue
        seen.add(name)
        names.append(name)
    if patterns:
        wanted = [p.strip() for p in patterns.split(",") if p.strip()]
        names = [n for n in names if any(n == p or re.fullmatch(p, n) for p in wanted)]
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="every sample, dtype and mode (default: fast subset)")
    parser.add_argument("--ops", help="comma-separated OpInfo names or regexes (default: all)")
    parser.add_argument("--results", default=DEFAULT_RESULTS, help="JSON-lines results file (default: %(default)s)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="report to write (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="keep the results file and skip OpInfos already done")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from --results")
    parser.add_argument("--stall", type=float, default=600, help="seconds without progress before a worker is killed")
    parser.add_argument("--max-restarts", type=int, default=200)
    parser.add_argument("--max-cached", type=int, default=4000,
                        help="clear the in-memory executable cache between OpInfos above this many executables")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the worker (0: none)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the normal on-disk executable cache (compile times then measure cache loads)")
    parser.add_argument("--print-xfail", action="store_true",
                        help="print EXPECTED_FAILURES entries for the failures in --results and exit")
    parser.add_argument("--error-inputs", action="store_true",
                        help="run only the OpInfos' error_inputs (results in build/opinfo_error_results.jsonl "
                             "unless --results) and rewrite only the report's error_inputs section")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-ops", help=argparse.SUPPRESS)
    parser.add_argument("--worker-skip", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.error_inputs and args.results == DEFAULT_RESULTS:
        args.results = DEFAULT_ERROR_RESULTS
    if args.worker:
        return worker_main(args)
    if args.print_xfail:
        print_expected_failures(args)
        return 0

    import torch
    import torch_tpu

    if not args.report_only:
        names = select_ops(args.ops, args.error_inputs)
        os.makedirs(os.path.dirname(args.results), exist_ok=True)
        if not args.resume and os.path.exists(args.results):
            os.remove(args.results)
        with open(args.results, "a") as f:
            f.write(json.dumps({"type": "meta", "full": args.full, "ops": args.ops, "error_inputs": args.error_inputs,
                                "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                                "platform": torch_tpu._C.platform_name() if hasattr(torch_tpu._C, "platform_name")
                                else "?", "lowered_ops": sorted(torch_tpu._C.lowered_ops())}) + "\n")
        t0 = time.time()
        run_workers(names, args)
        print(f"ran {len(names)} OpInfos in {time.time() - t0:.0f}s; results in {args.results}")
    summary = write_report(args)
    if args.error_inputs:
        print(f"wrote the error_inputs section of {args.output}")
        return 0
    print(f"wrote {args.output}: core ATen ops lowered natively {summary['core_native']}/{summary['core_total']}, "
          f"strict samples passing {summary['lowered_pass']}/{summary['lowered_counted']} (fully lowered samples), "
          f"{summary['strict_pass']}/{summary['strict_counted']} (all in-scope samples) "
          f"({summary['in_scope']} of {summary['opinfos']} OpInfos in scope)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
