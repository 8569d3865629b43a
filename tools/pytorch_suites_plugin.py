"""pytest plugin used by tools/pytorch_suites.py (loaded with ``-p``).

It runs inside the pytest process that executes one PyTorch test file for one
device type and:

- keeps only the device-generic tests of that device type: items whose class
  name ends with one of ``TORCH_TPU_SUITE_CLASS_SUFFIX`` (comma-separated:
  ``CPU``, or ``PRIVATEUSE1,TPU`` — ``instantiate_device_type_tests`` names
  PrivateUse1 classes either way, depending on when the backend was renamed),
  so both runs compare the same set of tests;
- with ``TORCH_TPU_SUITE_SAMPLE=N`` keeps the fixed 1/N of them whose
  device-independent name hashes to 0 (the runner's fast subset, the same
  tests on both devices); drops the node ids listed in the file
  ``TORCH_TPU_SUITE_SKIP`` (tests already done before a crash); does not run
  the tests matching a pattern of the file ``TORCH_TPU_SUITE_DEFER`` (listed
  as running over the time bound: the fast subset leaves them to the full
  run) and logs them with outcome ``deferred``;
- bounds every test by ``TORCH_TPU_SUITE_TIMEOUT`` seconds: SIGALRM raises a
  ``TimeoutError`` inside the test at that time, and if the test is stuck in
  native code that never returns to Python, ``faulthandler`` ends the whole
  process ``TORCH_TPU_SUITE_GRACE`` (30) s later (the runner then records the test as ``timeout`` and
  resumes with the tests after it);
- appends one JSON line per test to ``TORCH_TPU_SUITE_LOG`` as it finishes
  (``{"nodeid", "outcome", "duration", "message"}``), and a ``{"start"}`` line
  before each test, flushed at once, so a crash loses nothing but the test it
  happened in.

- with ``TORCH_TPU_SUITE_SYNC=1`` (the tpu runs) ends every test with
  ``torch.tpu.synchronize()`` in its teardown: an error that needs device
  values (a value or index check, raised at the next sync point in strict
  mode) that a test left pending fails that test (outcome ``error``), not
  the next test's first read of a tensor.

Outcomes: ``passed``, ``failed``, ``error`` (setup/teardown), ``skipped``,
``xfailed``, ``xpassed``, ``timeout``. Not a public API: the runner's detail.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal

import pytest

_LOG = os.environ.get("TORCH_TPU_SUITE_LOG")
_SUFFIXES = tuple(x for x in os.environ.get("TORCH_TPU_SUITE_CLASS_SUFFIX", "").split(",") if x)
_SKIP = os.environ.get("TORCH_TPU_SUITE_SKIP")
_SAMPLE = int(os.environ.get("TORCH_TPU_SUITE_SAMPLE", "1"))
_DEFER = os.environ.get("TORCH_TPU_SUITE_DEFER")
_TIMEOUT = float(os.environ.get("TORCH_TPU_SUITE_TIMEOUT", "60"))
_HARD_GRACE = float(os.environ.get("TORCH_TPU_SUITE_GRACE", "30"))
_SYNC = os.environ.get("TORCH_TPU_SUITE_SYNC") == "1"


def _write(record: dict) -> None:
    if not _LOG:
        return
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


_HARD = None


def _hard_log():
    """Where faulthandler writes when it ends a stuck process: a file beside the
    log (pytest captures stderr during a test, so that output would be lost);
    the runner reads it to tell a hang from a crash."""
    global _HARD
    if _HARD is None:
        _HARD = open((_LOG or "pytorch_suites") + ".hang", "a", encoding="utf-8")
    return _HARD


class _TestTimeout(Exception):
    pass


def pytest_collection_modifyitems(session, config, items):
    keep = []
    from pytorch_suites import in_subset, normalize  # tools/ is on PYTHONPATH

    skip = set()
    if _SKIP and os.path.exists(_SKIP):
        with open(_SKIP, encoding="utf-8") as f:
            skip = {line.strip() for line in f if line.strip()}
    for item in items:
        cls = item.cls.__name__ if getattr(item, "cls", None) is not None else ""
        if _SUFFIXES and not cls.endswith(_SUFFIXES):
            continue
        if item.nodeid in skip or not in_subset(normalize(item.nodeid), _SAMPLE):
            continue
        keep.append(item)
    if _DEFER and os.path.exists(_DEFER):
        import fnmatch

        with open(_DEFER, encoding="utf-8") as f:
            patterns = [line.strip() for line in f if line.strip()]
        deferred = [i for i in keep if any(fnmatch.fnmatchcase(i.nodeid, p) for p in patterns)]
        for i in deferred:
            _write({"nodeid": i.nodeid, "outcome": "deferred", "duration": 0.0,
                    "message": "listed as over the time bound; run by the full subset (make test-full)"})
        keep = [i for i in keep if i not in deferred]
    kept = set(id(i) for i in keep)
    deselected = [i for i in items if id(i) not in kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = keep


def _on_alarm(signum, frame):
    raise _TestTimeout(f"test ran over {_TIMEOUT:g} s (bound of tools/pytorch_suites.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _write({"start": item.nodeid})
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, _TIMEOUT)
    faulthandler.dump_traceback_later(_TIMEOUT + _HARD_GRACE, exit=True, file=_hard_log())
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _SYNC:
        import torch

        torch.tpu.synchronize()  # raises an error the test left pending


_state: dict = {}
# When phases disagree (a test that passed and then failed in teardown), the
# worse outcome is kept.
_RANK = {"passed": 0, "skipped": 1, "xfailed": 2, "xpassed": 3, "failed": 4, "error": 5, "timeout": 6}


def pytest_runtest_logreport(report):
    rec = _state.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed",
                                            "duration": 0.0, "message": ""})
    rec["duration"] += report.duration
    if hasattr(report, "wasxfail"):
        outcome = "xpassed" if report.passed else "xfailed"
    elif report.skipped:
        outcome = "skipped"
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
    else:
        outcome = "passed"
    if report.failed or report.skipped:
        if report.skipped and isinstance(report.longrepr, tuple):
            text = str(report.longrepr[2])
        else:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)
        if "_TestTimeout" in text or "bound of tools/pytorch_suites.py" in text:
            outcome = "timeout"
        if not rec["message"] and text.strip():
            rec["message"] = text.strip().splitlines()[0][:300]
    if _RANK[outcome] > _RANK[rec["outcome"]]:
        rec["outcome"] = outcome
    if report.when == "teardown":
        _write(_state.pop(report.nodeid))
