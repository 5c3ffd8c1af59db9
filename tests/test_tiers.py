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
