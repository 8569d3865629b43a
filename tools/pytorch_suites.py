"""Runs PyTorch's own device-generic test files for `cpu` and for `tpu` and
compares them.

The files live in ``../shared/pytorch-tests/`` (see its README: PyTorch's
repository at stated commits); they are run from there, never copied. For each
file and each device type this starts one pytest process in that folder with
``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu`` or ``privateuse1`` (PyTorch's
``instantiate_device_type_tests`` then makes ``...CPU`` / ``...PRIVATEUSE1``
classes with ``..._cpu`` / ``..._tpu`` tests) and the plugin
``tools/pytorch_suites_plugin.py``, which keeps only that device type's tests,
bounds each test by 60 s and logs every outcome as it happens. A process that
crashes or hangs is resumed after the test it died in (recorded as ``crash`` or
``timeout``). pytest runs with ``-p no:cacheprovider`` and writes nothing
outside ``--out`` (default ``build/pytorch_suites``): the shared folder may be
read-only.

The comparison: every test that passes on CPU must pass on tpu, unless its tpu
node id matches a line of ``tools/pytorch_suites_expected_failures.txt``
(``PATTERN | reason``; PATTERN is an fnmatch pattern over tpu node ids such as
``test_view_ops.py::TestViewOpsPRIVATEUSE1::test_foo_tpu``). A tpu test the
file itself skips for its device (``@onlyCPU``, ``@onlyCUDA``, ...) is counted
apart, with its skip reason. The exit status is 1 when a CPU-passing test
fails on tpu without an entry, when a test crashed or timed out on either
device, or when an expected-failure entry now passes on tpu (a stale entry).

``--subset fast`` (what ``make test`` runs) keeps a fixed, name-hashed 1/N of
each file's tests (the same tests on both devices, N per file in ``FILES``),
and on tpu does not run the listed tests whose reason starts "over 60 s"
(outcome ``deferred``: compile-bound tests that would spend the bound);
``--subset full`` runs everything (``make test-full``). ``--write-doc``
regenerates ``docs/pytorch_suites.md`` (its table says per file whether all
tests or the fast subset ran); every run writes ``<out>/report.md`` and
``<out>/<file>.<device>.<subset>.json``.

Usage::

    python tools/pytorch_suites.py [--subset fast|full] [--files test_view_ops.py ...]
                                   [--devices cpu tpu] [--out DIR] [--write-doc] [--reuse]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _suites_dir() -> Path:
    """``$TORCH_TPU_PYTORCH_TESTS``, else ``../shared/pytorch-tests`` beside the
    checkout, else beside the main checkout of a git worktree."""
    if os.environ.get("TORCH_TPU_PYTORCH_TESTS"):
        return Path(os.environ["TORCH_TPU_PYTORCH_TESTS"]).resolve()
    here = (ROOT / ".." / "shared" / "pytorch-tests").resolve()
    if here.is_dir():
        return here
    try:
        common = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute",
                                 "--git-common-dir"], capture_output=True, text=True, timeout=30).stdout.strip()
        if common:
            main = (Path(common).parent / ".." / "shared" / "pytorch-tests").resolve()
            if main.is_dir():
                return main
    except (OSError, subprocess.SubprocessError):
        pass
    return here


SUITES_DIR = _suites_dir()
EXPECTED_FILE = ROOT / "tools" / "pytorch_suites_expected_failures.txt"
DOC = ROOT / "docs" / "pytorch_suites.md"
PLUGIN_DIR = ROOT / "tools"
TEST_TIMEOUT_S = 60

# file -> N of the fast subset (1 = every test). Chosen from each file's full
# duration on the 2-core development machine, so that the fast subset of all
# files together takes a few minutes (see docs/pytorch_suites.md).
FILES = {
    "test_view_ops.py": 2,
    "test_indexing.py": 8,
    "test_sort_and_select.py": 4,
    "test_type_promotion.py": 4,
    "test_tensor_creation_ops.py": 16,
}

DEVICES = {
    # device -> (PYTORCH_TESTING_DEVICE_ONLY_FOR, class suffix, test-name token)
    "cpu": ("cpu", "CPU", "cpu"),
    "tpu": ("privateuse1", "PRIVATEUSE1,TPU", "tpu"),
}

# Skip reasons with which a test file itself says a test is not for this device
# type (common_device_type's onlyCPU/onlyCUDA/onlyOn/... decorators). Such a
# tpu skip is not counted as a tpu failure; any other skip of a CPU-passing
# test is.
NOT_FOR_DEVICE = re.compile(r"Only runs on|onlyOn|only runs on|doesn't run on|not supported on privateuse1"
                            r"|Only runs on (cpu|cuda|mps|xpu)", re.IGNORECASE)

_DEVICE_TOKEN = re.compile(r"_(cpu|tpu)(?=(_|$))")


def normalize(nodeid: str) -> str:
    """A device-independent key: ``f.py::TestFooCPU::test_x_cpu_float32`` and
    ``f.py::TestFooPRIVATEUSE1::test_x_tpu_float32`` (or ``TestFooTPU``) give
    ``f.py::TestFoo::test_x_DEV_float32`` (the last device token of the name)."""
    parts = nodeid.split("::")
    if len(parts) >= 2:
        for suffix in ("PRIVATEUSE1", "TPU", "CPU"):
            if parts[-2].endswith(suffix):
                parts[-2] = parts[-2][: -len(suffix)]
                break
        name = parts[-1]
        matches = list(_DEVICE_TOKEN.finditer(name))
        if matches:
            m = matches[-1]
            name = name[: m.start()] + "_DEV" + name[m.end():]
        parts[-1] = name
    return "::".join(parts)


def in_subset(key: str, n: int) -> bool:
    return n <= 1 or zlib.crc32(key.encode()) % n == 0


def read_expected(path: Path = EXPECTED_FILE) -> list[tuple[str, str]]:
    """``[(pattern, reason)]`` from the expected-failures file; every line
    needs a reason (ValueError naming the line otherwise)."""
    out = []
    if not path.exists():
        return out
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "|" not in line:
            raise ValueError(f"{path}:{lineno}: expected 'PATTERN | reason', got {line!r}")
        pattern, reason = (x.strip() for x in line.split("|", 1))
        if not pattern or not reason:
            raise ValueError(f"{path}:{lineno}: empty pattern or reason in {line!r}")
        out.append((pattern, reason))
    return out


def _read_log(log: Path) -> tuple[dict, list]:
    done, started = {}, []
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if "start" in rec:
                started.append(rec["start"])
            else:
                done[rec["nodeid"]] = rec
    return done, started


def run_file(fname: str, device: str, out: Path, n: int, python: str = sys.executable,
             timeout_s: float = TEST_TIMEOUT_S, suites_dir: Path | None = None, extra_env: dict | None = None,
             defer: list[str] | None = None) -> dict:
    """Runs one file for one device; returns ``{"results": {nodeid: rec},
    "duration": seconds, "restarts": k}``. Crashed/hung processes are resumed
    after the test they stopped in."""
    only_for, suffix, _ = DEVICES[device]
    stem = f"{Path(fname).stem}.{device}"
    log = out / f"{stem}.jsonl"
    log.unlink(missing_ok=True)
    Path(str(log) + ".hang").unlink(missing_ok=True)
    skip = out / f"{stem}.skip"
    skip.write_text("")
    defer_file = out / f"{stem}.defer"
    defer_file.write_text("".join(p + "\n" for p in (defer or [])))
    env = dict(os.environ)
    env.update({
        "PYTORCH_TESTING_DEVICE_ONLY_FOR": only_for,
        "TORCH_TPU_SUITE_LOG": str(log),
        "TORCH_TPU_SUITE_CLASS_SUFFIX": suffix,
        "TORCH_TPU_SUITE_TIMEOUT": str(timeout_s),
        "TORCH_TPU_SUITE_SKIP": str(skip),
        "TORCH_TPU_SUITE_SAMPLE": str(n),
        "TORCH_TPU_SUITE_DEFER": str(defer_file),
        "TORCH_TPU_SUITE_SYNC": "1" if device == "tpu" else "0",
        "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    env.update(extra_env or {})
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytorch_suites_plugin",
           "--junitxml", str(out / f"{stem}.xml"), "-o", "junit_family=xunit1", fname]
    t0 = time.monotonic()
    restarts = 0
    crashed: dict = {}
    while True:
        proc = subprocess.run(cmd, cwd=suites_dir or SUITES_DIR, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace")
        (out / f"{stem}.{restarts}.out").write_text(proc.stdout)
        done, started = _read_log(log)
        lost = [s for s in started if s not in done and s not in crashed]
        if not lost:
            break
        # The process died inside `lost[-1]` (faulthandler's hard bound, or a crash).
        victim = lost[-1]
        # faulthandler.dump_traceback_later writes "Timeout (0:01:30)!" there before ending the process.
        hang = Path(str(log) + ".hang")
        timed_out = hang.exists() and "Timeout (0:" in hang.read_text(errors="replace")
        hang.unlink(missing_ok=True)
        crashed[victim] = {"nodeid": victim, "outcome": "timeout" if timed_out else "crash",
                           "duration": 0.0,
                           "message": f"process ended (rc {proc.returncode}) inside this test"}
        with skip.open("w") as f:
            for nodeid in list(done) + list(crashed):
                f.write(nodeid + "\n")
        restarts += 1
        if restarts > 50:
            break
    results = dict(done)
    results.update(crashed)
    return {"results": results, "duration": time.monotonic() - t0, "restarts": restarts}


def compare(fname: str, cpu: dict, tpu: dict, expected: list[tuple[str, str]]) -> dict:
    """The per-file comparison (see the module docstring)."""
    cpu_by_key = {normalize(k): v for k, v in cpu.items()}
    tpu_by_key = {normalize(k): v for k, v in tpu.items()}
    cpu_pass = sorted(k for k, v in cpu_by_key.items() if v["outcome"] in ("passed", "xfailed"))
    rows = {"passed": [], "expected": [], "unexpected": [], "not_for_device": [], "missing": []}
    used = set()
    for key in cpu_pass:
        t = tpu_by_key.get(key)
        if t is None:
            if tpu:  # the file does not instantiate this test for tpu (only_for=...)
                rows["not_for_device"].append((key, None, "not instantiated for tpu by the file"))
            else:    # nothing ran on tpu at all: the file failed to import or collect
                rows["missing"].append((key, None, ""))
            continue
        if t["outcome"] == cpu_by_key[key]["outcome"]:
            rows["passed"].append((t["nodeid"], t, ""))
            continue
        if t["outcome"] == "skipped" and NOT_FOR_DEVICE.search(t.get("message", "")):
            rows["not_for_device"].append((t["nodeid"], t, t.get("message", "")))
            continue
        reason = next((r for p, r in expected if fnmatch.fnmatchcase(t["nodeid"], p)), None)
        if reason is not None:
            used.update(p for p, r in expected if fnmatch.fnmatchcase(t["nodeid"], p))
            rows["expected"].append((t["nodeid"], t, reason))
        else:
            rows["unexpected"].append((t["nodeid"], t, t.get("message", "")))
    stale = []
    for nodeid, t in tpu.items():
        if t["outcome"] == "passed":
            for p, r in expected:
                if fnmatch.fnmatchcase(nodeid, p) and p == nodeid:
                    stale.append((nodeid, r))
    broken = {dev: sorted(k for k, v in res.items() if v["outcome"] in ("crash", "timeout"))
              for dev, res in (("cpu", cpu), ("tpu", tpu))}
    return {"file": fname, "cpu_tests": len(cpu), "cpu_pass": len(cpu_pass), "rows": rows,
            "stale": stale, "broken": broken,
            "slowest": sorted(((v["duration"], k) for k, v in tpu.items()), reverse=True)[:5]}


def _pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.1f}%" if b else "-"


def render(results: list[dict], durations: dict, subsets: dict) -> str:
    """docs/pytorch_suites.md's text; ``subsets[file]`` says which tests ran
    ("all" or "1/N", the fast subset)."""
    lines = ["# PyTorch's device-generic suites on `tpu`", "",
             "Generated by `tools/pytorch_suites.py --write-doc`; do not edit by hand. The files are PyTorch's (see `../shared/pytorch-tests/README.md`"
             " for their commits); each runs once per device type, every test bounded by "
             f"{TEST_TIMEOUT_S} s. The reasons come from `tools/pytorch_suites_expected_failures.txt`.", "",
             "A test counts when it passes on CPU (torch 2.13 wheel); it must pass on `tpu` too, "
             "or be listed below with a reason. Tests the file itself marks as not for this device "
             "type (`@onlyCPU` and the like) are counted apart.", "",
             "| file | tests run | CPU passing | `tpu` passing | listed failures | unlisted failures | not for this device | crash/timeout (cpu, tpu) | time cpu / tpu (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    tot = [0, 0, 0, 0, 0]
    for r in results:
        rows = r["rows"]
        denom = r["cpu_pass"] - len(rows["not_for_device"])
        d = durations.get(r["file"], {})
        lines.append(
            f"| {r['file']} | {subsets.get(r['file'], 'all')} | {denom} | {len(rows['passed'])} ({_pct(len(rows['passed']), denom)}) "
            f"| {len(rows['expected'])} ({_pct(len(rows['expected']), denom)}) "
            f"| {len(rows['unexpected']) + len(rows['missing'])} | {len(rows['not_for_device'])} "
            f"| {len(r['broken']['cpu'])}, {len(r['broken']['tpu'])} "
            f"| {d.get('cpu', 0):.0f} / {d.get('tpu', 0):.0f} |")
        tot[0] += denom
        tot[1] += len(rows["passed"])
        tot[2] += len(rows["expected"])
        tot[3] += len(rows["unexpected"]) + len(rows["missing"])
        tot[4] += len(rows["not_for_device"])
    lines.append(f"| **total** | | {tot[0]} | {tot[1]} ({_pct(tot[1], tot[0])}) | {tot[2]} ({_pct(tot[2], tot[0])}) "
                 f"| {tot[3]} | {tot[4]} | | |")
    for r in results:
        rows = r["rows"]
        lines += ["", f"## {r['file']}", ""]
        if rows["expected"]:
            lines += ["Listed failures (tpu outcome: reason):", ""]
            for nodeid, t, reason in rows["expected"]:
                lines.append(f"- `{nodeid.split('::', 1)[1]}` ({t['outcome']}): {reason}")
        if rows["unexpected"] or rows["missing"]:
            lines += ["", "Unlisted failures (tpu outcome: first line of the error):", ""]
            for nodeid, t, msg in rows["unexpected"]:
                lines.append(f"- `{nodeid.split('::', 1)[1]}` ({t['outcome']}): {msg}")
            for key, _, _ in rows["missing"]:
                lines.append(f"- `{key}`: not run on tpu")
        if rows["not_for_device"]:
            reasons: dict = {}
            for _, _, msg in rows["not_for_device"]:
                reasons[msg] = reasons.get(msg, 0) + 1
            lines += ["", "Not for this device type (skipped by the file on tpu): "
                      + "; ".join(f"{c} × “{m}”" for m, c in sorted(reasons.items()))]
        if r["stale"]:
            lines += ["", "Stale entries (listed, but pass on tpu now):", ""]
            lines += [f"- `{n}`" for n, _ in r["stale"]]
        for dev in ("cpu", "tpu"):
            if r["broken"][dev]:
                lines += ["", f"Crashed or timed out on {dev}: " + ", ".join(f"`{k}`" for k in r["broken"][dev])]
        if r["slowest"]:
            lines += ["", "Slowest tpu tests: " + ", ".join(
                f"`{k.split('::')[-1]}` {d:.1f} s" for d, k in r["slowest"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subset", choices=("fast", "full"), default="fast")
    ap.add_argument("--files", nargs="*", default=list(FILES))
    ap.add_argument("--devices", nargs="*", default=["cpu", "tpu"])
    ap.add_argument("--out", default=str(ROOT / "build" / "pytorch_suites"))
    ap.add_argument("--write-doc", action="store_true", help="regenerate docs/pytorch_suites.md")
    ap.add_argument("--reuse", action="store_true",
                    help="for devices not run now (e.g. --devices tpu), use <out>'s results of an earlier run")
    args = ap.parse_args(argv)
    for f in args.files:
        if f not in FILES:
            ap.error(f"unknown file {f!r}; known: {', '.join(FILES)}")
    if not SUITES_DIR.is_dir():
        print(f"pytorch_suites: {SUITES_DIR} not found (PyTorch's test files, see ../shared)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    expected = read_expected()

    def store(fname: str, dev: str, subset: str) -> Path:
        return out / f"{Path(fname).stem}.{dev}.{subset}.json"

    for fname in args.files:
        for dev in args.devices:
            print(f"pytorch_suites: {fname} on {dev} ...", flush=True)
            # The fast subset does not spend the time bound on tests listed as
            # running over it (their reason starts "over 60 s"); the full run does.
            defer = [p for p, r in expected if r.startswith("over ")] if args.subset == "fast" and dev == "tpu" else []
            r = run_file(fname, dev, out, FILES[fname] if args.subset == "fast" else 1, defer=defer)
            counts: dict = {}
            for v in r["results"].values():
                counts[v["outcome"]] = counts.get(v["outcome"], 0) + 1
            print(f"  {r['duration']:.0f} s, {counts}" + (f", {r['restarts']} restarts" if r["restarts"] else ""),
                  flush=True)
            store(fname, dev, args.subset).write_text(json.dumps(r))
    results, durations, subsets = [], {}, {}
    for fname in args.files:
        runs = {}
        for dev in ("cpu", "tpu"):
            # This run's results; with --reuse, an earlier run's (full preferred).
            candidates = [args.subset] if dev in args.devices else ([args.subset, "full", "fast"] if args.reuse else [])
            for subset in dict.fromkeys(candidates):
                if store(fname, dev, subset).exists():
                    runs[dev] = (subset, json.loads(store(fname, dev, subset).read_text()))
                    break
        if set(runs) != {"cpu", "tpu"}:
            print(f"pytorch_suites: {fname}: no results for both devices (run with both, or --reuse)")
            return 2
        if runs["cpu"][0] != runs["tpu"][0]:
            print(f"pytorch_suites: {fname}: cpu ran the {runs['cpu'][0]} subset, tpu the {runs['tpu'][0]}")
            return 2
        results.append(compare(fname, runs["cpu"][1]["results"], runs["tpu"][1]["results"], expected))
        durations[fname] = {d: runs[d][1]["duration"] for d in ("cpu", "tpu")}
        subsets[fname] = "all" if runs["cpu"][0] == "full" else f"1/{FILES[fname]}"
    text = render(results, durations, subsets)
    (out / "report.md").write_text(text)
    if args.write_doc:
        DOC.write_text(text)
    bad = 0
    for r in results:
        rows = r["rows"]
        for nodeid, t, msg in rows["unexpected"]:
            print(f"UNLISTED tpu failure: {nodeid} ({t['outcome']}): {msg}")
            bad += 1
        for key, _, _ in rows["missing"]:
            print(f"NOT RUN on tpu: {key}")
            bad += 1
        for n, _ in r["stale"]:
            print(f"STALE expected-failure entry (passes now): {n}")
            bad += 1
        for dev in ("cpu", "tpu"):
            for k in r["broken"][dev]:
                if not (dev == "tpu" and any(k == n for n, _, _ in rows["expected"])):
                    print(f"CRASH/TIMEOUT on {dev}: {k}")
                    bad += 1
    print(f"pytorch_suites: report in {out / 'report.md'}" + (f"; {bad} problem(s)" if bad else "; ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
