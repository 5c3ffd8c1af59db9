"""The test tiers hold: without the native libraries a native test is skipped with the command
that sets them up, and ``--no-skips`` (what ``make test`` passes) turns any skip into a failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NATIVE_TEST = "tests/test_bindings.py::test_every_declared_function_is_in_the_cdef_and_exported"


def pytest_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"LLMSESSION_LIB_DIR": str(tmp_path), "LLMSESSION_CACHE": str(tmp_path)}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_a_native_test_without_libraries_is_skipped_and_no_skips_fails_the_run(tmp_path: Path) -> None:
    out = pytest_run(tmp_path, "--no-skips", NATIVE_TEST)
    assert "1 skipped" in out.stdout and "llmsession setup" in out.stdout, out.stdout  # the reason
    assert out.returncode != 0 and "--no-skips: 1 test(s) were skipped" in out.stdout, out.stdout


def test_the_pure_tier_deselects_the_native_tests(tmp_path: Path) -> None:
    files = ("tests/test_bindings.py", "tests/test_stops.py")
    out = pytest_run(tmp_path, "--collect-only", "-m", "not native", *files)
    assert out.returncode == 0, out.stdout
    assert "test_stops.py::" in out.stdout and "test_bindings.py::" not in out.stdout
    assert re.search(r"\d+/\d+ tests collected \((\d+) deselected\)", out.stdout), out.stdout


def test_a_skip_on_a_parallel_worker_fails_the_run_too(tmp_path: Path) -> None:
    """``make test`` runs the ``parallel`` tier on pytest-xdist workers: a skip there reaches the
    controller's ``--no-skips`` as one in a single process does."""
    out = pytest_run(tmp_path, "--no-skips", "-n", "2", NATIVE_TEST)
    assert "1 skipped" in out.stdout, out.stdout
    assert out.returncode != 0 and "--no-skips: 1 test(s) were skipped" in out.stdout, out.stdout


def test_the_tiers_split_the_suite_and_a_parallel_worker_has_a_core_of_its_own(tmp_path: Path) -> None:
    """The two runs of ``make test`` (``-m "not parallel"``, ``-m parallel``) are the whole suite,
    and a worker of the second decodes on one core (two spinning thread pools on two cores stall);
    a lone process keeps every core (this test is not of that tier: it has every core)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\n\n\ndef test_one_core():\n    assert len(os.sched_getaffinity(0)) == 1\n")
    path = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"PYTHONPATH": path}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(probe)]
    lone, pinned = (
        subprocess.run([*command, *more], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        for more in ((), ("-n", "2"))
    )
    assert pinned.returncode == 0, pinned.stdout + pinned.stderr
    assert ("1 failed" in lone.stdout) == (len(os.sched_getaffinity(0)) > 1), lone.stdout
    files = ("tests/test_bindings.py", "tests/test_stops.py", "tests/test_attention.py")
    tiers = ("parallel", "not parallel")
    lanes = [pytest_run(tmp_path, "--collect-only", "-m", tier, *files).stdout for tier in tiers]
    assert "test_stops.py::" in lanes[0] and "test_attention.py::" not in lanes[0], lanes[0]
    assert "test_attention.py::" in lanes[1] and "test_stops.py::" not in lanes[1], lanes[1]
