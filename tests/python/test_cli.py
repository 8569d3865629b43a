"""``python -m torch_tpu info | doctor | cache clear``: output and exit codes,
checked against what the running process reports (torch_tpu._C, torch.tpu)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
import torch_tpu


def run_cli(*args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "torch_tpu", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, stdin=subprocess.DEVNULL)


def _lines(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


def test_info_reports_this_installation():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert f"torch         {torch.__version__}" in r.stdout
    assert f"plugin        {torch_tpu._C._plugin_path()}" in r.stdout
    assert f"devices       {torch.tpu.device_count()}" in r.stdout
    assert f"platform      {torch_tpu._C.platform_name()}" in r.stdout


def test_doctor_passes_on_a_working_installation():
    r = run_cli("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    checks = [line for line in r.stdout.splitlines()[1:-1]]
    assert checks and all(line.startswith("OK") for line in checks), r.stdout
    for name in ("torch version", "plugin", "devices", "compile and execute", "cache directory"):
        assert any(line[6:].startswith(name) for line in checks), (name, r.stdout)
    assert torch_tpu._C._plugin_path() in r.stdout
    assert f"{torch.tpu.device_count()} (tpu:0" in r.stdout
    assert r.stdout.rstrip().endswith("all checks passed")


def test_doctor_fails_on_a_missing_plugin_naming_path_and_reason():
    r = run_cli("doctor", env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so"})
    assert r.returncode == 1, r.stdout + r.stderr
    fail = _lines(r.stdout, "FAIL  plugin")
    assert len(fail) == 1 and "/nonexistent/plugin.so" in fail[0] and "no such file" in fail[0], r.stdout
    after = r.stdout.splitlines()[r.stdout.splitlines().index(fail[0]) + 1]
    assert after.strip().startswith("fix:") and "TORCH_TPU_PJRT_PLUGIN" in after
    # the checks that need a device are skipped, not failed twice
    assert _lines(r.stdout, "SKIP  compile and execute")


def test_doctor_fails_on_a_file_that_is_not_a_plugin(tmp_path):
    bogus = tmp_path / "not_a_plugin.so"
    bogus.write_bytes(b"not an ELF file")
    r = run_cli("doctor", env={"TORCH_TPU_PJRT_PLUGIN": str(bogus)})
    assert r.returncode == 1, r.stdout + r.stderr
    fail = _lines(r.stdout, "FAIL  plugin")
    assert len(fail) == 1 and str(bogus) in fail[0] and "cannot load PJRT plugin" in fail[0], r.stdout


def test_doctor_fails_on_an_unwritable_cache_directory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = run_cli("doctor", env={"TORCH_TPU_CACHE_DIR": str(blocker / "cache")})
    assert r.returncode == 1, r.stdout + r.stderr
    fail = _lines(r.stdout, "FAIL  cache directory")
    assert len(fail) == 1 and str(blocker / "cache") in fail[0], r.stdout
    assert "TORCH_TPU_CACHE_DIR" in r.stdout.splitlines()[r.stdout.splitlines().index(fail[0]) + 1]


def test_cache_clear_removes_entries_quietly_without_a_terminal(tmp_path):
    for i in range(5):
        (tmp_path / f"{i:040x}.pjrt").write_bytes(b"x" * 10)
    (tmp_path / "unrelated.txt").write_text("kept")
    (tmp_path / "sub.pjrt").mkdir()  # a directory, not an entry (review, session 23: counted, then not removed)
    r = run_cli("cache", "info", env={"TORCH_TPU_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert re.search(r"^entries\s+5$", r.stdout, re.M), r.stdout
    r = run_cli("cache", "clear", env={"TORCH_TPU_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"removed 5 entries from {tmp_path}"
    assert "\r" not in r.stderr and "%|" not in r.stderr  # no progress bar in a pipe
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub.pjrt", "unrelated.txt"]


def test_cache_info_and_clear_cover_saved_compiled_frames(tmp_path):
    frames = tmp_path / "dynamo" / "0123abcd"
    frames.mkdir(parents=True)
    for i in range(3):
        (frames / f"{i:040x}.entry").write_bytes(b"y" * 100)
    (tmp_path / f"{7:040x}.pjrt").write_bytes(b"x" * 10)
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path)}
    r = run_cli("cache", "info", env=env)
    assert r.returncode == 0, r.stderr
    assert "compiled frames 3, 300 bytes" in r.stdout, r.stdout
    r = run_cli("cache", "clear", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"removed 4 entries from {tmp_path}"
    assert list(tmp_path.iterdir()) == []


def test_info_with_a_missing_plugin_names_it_and_points_to_doctor():
    r = run_cli("info", env={"TORCH_TPU_PJRT_PLUGIN": "/nonexistent/plugin.so"})
    assert r.returncode == 1
    assert "/nonexistent/plugin.so" in r.stderr and "doctor" in r.stderr
    assert "Traceback" not in r.stderr
