"""The runner of PyTorch's device-generic suites (tools/pytorch_suites.py).

The suites themselves run in `make test` (fast subset) and `make test-full`
(everything) as their own step; these tests check the runner's mechanism on a
small device-generic test file written to a temporary folder and run for
`cpu` and `tpu` in real pytest processes: outcomes, the per-test time bound,
resumption after a crash, the comparison and the expected-failures file."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import pytorch_suites as ps  # noqa: E402

SUITE = '''
import os, signal, time
import torch
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCPU


class TestToy(TestCase):
    def test_add(self, device):
        x = torch.arange(6, device=device)
        self.assertEqual((x + x).cpu(), torch.arange(6) * 2)

    def test_fails_on_tpu(self, device):
        self.assertEqual(torch.device(device).type, "cpu")

    def test_hangs_on_tpu(self, device):
        if torch.device(device).type != "cpu":
            time.sleep(30)

    def test_crashes_on_tpu(self, device):
        if torch.device(device).type != "cpu":
            os.abort()

    def test_z_after_crash(self, device):
        self.assertEqual(torch.ones(2, device=device).sum().item(), 2.0)

    @onlyCPU
    def test_cpu_only(self, device):
        pass


class TestNotDeviceGeneric(TestCase):
    def test_plain(self):
        pass


instantiate_device_type_tests(TestToy, globals())

if __name__ == "__main__":
    run_tests()
'''


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    suites = tmp_path_factory.mktemp("suites")
    (suites / "test_toy.py").write_text(SUITE)
    out = tmp_path_factory.mktemp("out")
    runs = {dev: ps.run_file("test_toy.py", dev, out, 1, timeout_s=3, suites_dir=suites,
                             extra_env={"TORCH_TPU_SUITE_GRACE": "5"})
            for dev in ("cpu", "tpu")}
    return runs, out


def _outcomes(run):
    return {k.split("::")[-1]: v["outcome"] for k, v in run["results"].items()}


def test_runner_outcomes_per_device(toy_runs):
    runs, out = toy_runs
    assert _outcomes(runs["cpu"]) == {
        "test_add_cpu": "passed", "test_fails_on_tpu_cpu": "passed", "test_hangs_on_tpu_cpu": "passed",
        "test_crashes_on_tpu_cpu": "passed", "test_z_after_crash_cpu": "passed", "test_cpu_only_cpu": "passed"}
    tpu = _outcomes(runs["tpu"])
    assert tpu == {
        "test_add_tpu": "passed", "test_fails_on_tpu_tpu": "failed", "test_hangs_on_tpu_tpu": "timeout",
        "test_crashes_on_tpu_tpu": "crash", "test_z_after_crash_tpu": "passed", "test_cpu_only_tpu": "skipped"}
    # One restart, after the crash; the non-device class never ran.
    assert runs["tpu"]["restarts"] == 1 and runs["cpu"]["restarts"] == 0
    assert not any("NotDeviceGeneric" in k for r in runs.values() for k in r["results"])
    assert (out / "test_toy.tpu.xml").exists()


def test_runner_comparison_and_expected_list(toy_runs, tmp_path):
    runs, _ = toy_runs
    cpu, tpu = runs["cpu"]["results"], runs["tpu"]["results"]
    res = ps.compare("test_toy.py", cpu, tpu, [])
    assert res["cpu_pass"] == 6
    assert [n.split("::")[-1] for n, _, _ in res["rows"]["passed"]] == ["test_add_tpu", "test_z_after_crash_tpu"]
    assert [n.split("::")[-1] for n, _, _ in res["rows"]["not_for_device"]] == ["test_cpu_only_tpu"]
    assert sorted(n.split("::")[-1] for n, _, _ in res["rows"]["unexpected"]) == [
        "test_crashes_on_tpu_tpu", "test_fails_on_tpu_tpu", "test_hangs_on_tpu_tpu"]
    assert res["broken"]["tpu"] == sorted(k for k in tpu if "hangs" in k or "crashes" in k)

    listed = tmp_path / "expected.txt"
    listed.write_text("# comment\n"
                      "test_toy.py::TestToyPRIVATEUSE1::test_fails_on_tpu_tpu | a reason\n"
                      "test_toy.py::*::test_[hc]*_tpu | another reason\n"
                      "test_toy.py::TestToyPRIVATEUSE1::test_add_tpu | stale\n")
    expected = ps.read_expected(listed)
    res = ps.compare("test_toy.py", cpu, tpu, expected)
    assert not res["rows"]["unexpected"]
    assert {n.split("::")[-1]: r for n, _, r in res["rows"]["expected"]} == {
        "test_fails_on_tpu_tpu": "a reason", "test_hangs_on_tpu_tpu": "another reason",
        "test_crashes_on_tpu_tpu": "another reason"}
    assert [n for n, _ in res["stale"]] == ["test_toy.py::TestToyPRIVATEUSE1::test_add_tpu"]
    text = ps.render([res], {"test_toy.py": {"cpu": 1.0, "tpu": 2.0}}, {"test_toy.py": "all"})
    assert "| test_toy.py | all | 5 | 2 (40.0%) | 3 (60.0%) | 0 | 1 |" in text
    assert "another reason" in text


def test_expected_file_needs_reasons(tmp_path):
    bad = tmp_path / "e.txt"
    bad.write_text("test_x.py::T::test_a_tpu\n")
    with pytest.raises(ValueError, match="PATTERN | reason"):
        ps.read_expected(bad)
    bad.write_text("test_x.py::T::test_a_tpu | \n")
    with pytest.raises(ValueError, match="empty pattern or reason"):
        ps.read_expected(bad)


def test_normalize_and_subset():
    assert ps.normalize("f.py::TestFooCPU::test_x_cpu_float32") == "f.py::TestFoo::test_x_DEV_float32"
    assert ps.normalize("f.py::TestFooPRIVATEUSE1::test_x_tpu_float32") == "f.py::TestFoo::test_x_DEV_float32"
    assert ps.normalize("f.py::TestFooCPU::test_cpu_tensor_cpu") == "f.py::TestFoo::test_cpu_tensor_DEV"
    keys = [f"f.py::T::test_{i}_DEV" for i in range(400)]
    picked = [k for k in keys if ps.in_subset(k, 4)]
    assert 60 < len(picked) < 140 and all(ps.in_subset(k, 1) for k in keys)


def test_checked_in_expected_failures_parse_and_doc_is_generated():
    entries = ps.read_expected()
    assert all(reason for _, reason in entries)
    doc = (ROOT / "docs" / "pytorch_suites.md").read_text()
    assert doc.startswith("# PyTorch's device-generic suites on `tpu`")
    for fname in ps.FILES:
        assert f"| {fname} |" in doc


def test_fast_subset_defers_listed_slow_tests(tmp_path):
    """Tests listed as over the time bound are not run by the fast subset on tpu
    (logged as deferred, still a listed failure in the comparison)."""
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_toy.py").write_text(SUITE)
    out = tmp_path / "out"
    out.mkdir()
    run = ps.run_file("test_toy.py", "tpu", out, 1, timeout_s=3, suites_dir=suites,
                      defer=["test_toy.py::*::test_hangs_on_tpu_tpu", "test_toy.py::*::test_crashes_*"])
    got = _outcomes(run)
    assert got["test_hangs_on_tpu_tpu"] == "deferred" and got["test_crashes_on_tpu_tpu"] == "deferred"
    assert got["test_add_tpu"] == "passed" and run["restarts"] == 0
