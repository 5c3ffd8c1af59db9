"""The public-API fuzzer (``tests/fuzz_worker.py``), run in a subprocess: llama.cpp may abort
the process, and that must fail this test, not end the suite.

By default the fast, derandomized profile runs (about a minute on 2 quiet cores). With
``LLMSESSION_FUZZ_MINUTES=N`` seeded runs repeat for N minutes; each run prints its seed and the
command that replays it. ``LLMSESSION_FUZZ_THREADS`` sets llama.cpp's threads (default 2): on a
machine whose cores other jobs keep busy, 1 is far faster (llama.cpp's threads spin at barriers).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_reuse import short_prompt_noise

from llmsession import Model

WORKER = Path(__file__).with_name("fuzz_worker.py")
FAST_TIMEOUT_S = 900
TAIL_LINES = 60


def fuzz_minutes() -> float:
    value = os.environ.get("LLMSESSION_FUZZ_MINUTES", "").strip()
    if not value:
        return 0.0
    try:
        minutes = float(value)
    except ValueError:
        pytest.fail(f"LLMSESSION_FUZZ_MINUTES must be a number of minutes, got {value!r}", pytrace=False)
    if not minutes > 0:
        pytest.fail(f"LLMSESSION_FUZZ_MINUTES must be positive, got {value!r}", pytrace=False)
    return minutes


def _requested_minutes() -> float:
    """``LLMSESSION_FUZZ_MINUTES`` as far as it reads as a number (``fuzz_minutes`` reports a bad
    one), for the test's time limit."""
    try:
        return max(0.0, float(os.environ.get("LLMSESSION_FUZZ_MINUTES", "") or 0))
    except ValueError:
        return 0.0


# The suite's 600 s limit for one test (pyproject) would cut a run of more than a few minutes
# short: a run asked for minutes has the fuzzer's own limit, and a minute more.
@pytest.mark.timeout(FAST_TIMEOUT_S + 60 * _requested_minutes() + 60 if _requested_minutes() else 600)
def test_public_api_fuzzer(
    smollm2: Model, smollm2_path: Path, fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """The worker is given the split noise the suite measured here: the same model file, build,
    threads and kernels give the same noise, and measuring it again took 4 to 5 s."""
    projector = fixture_path("mmproj-tiny.gguf")
    for image in ("image-red.png", "image-blue.png"):
        fixture_path(image)
    minutes = fuzz_minutes()
    log = tmp_path / "fuzz-steps.log"
    command = [
        sys.executable,
        str(WORKER),
        "--model",
        str(smollm2_path),
        "--fixtures",
        str(projector.parent),
        "--log",
        str(log),
        "--short-noise",
        repr(short_prompt_noise(smollm2)),
    ]
    if minutes:
        command += ["--minutes", str(minutes)]
    threads = os.environ.get("LLMSESSION_FUZZ_THREADS", "").strip()
    if threads:  # 1 on a machine shared with other jobs: 2 spinning threads there run ~30x slower
        command += ["--threads", threads]
    timeout = FAST_TIMEOUT_S + 60 * minutes
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=WORKER.parent.parent
        )
    except subprocess.TimeoutExpired as expired:
        output = [
            text.decode(errors="replace") if isinstance(text, bytes) else text or ""
            for text in (expired.stdout, expired.stderr)
        ]
        pytest.fail(f"the fuzzer did not finish in {timeout:.0f} s\n" + "\n".join(output), pytrace=False)
    print(result.stdout)
    if result.returncode != 0:
        how = (
            f"was killed by signal {-result.returncode} (a native abort?)"
            if result.returncode < 0
            else f"exited with status {result.returncode}"
        )
        steps = log.read_text(encoding="utf-8").splitlines()[-TAIL_LINES:] if log.exists() else []
        pytest.fail(
            f"the fuzzer {how}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}\n"
            f"--- the last {len(steps)} steps it began ---\n" + "\n".join(steps),
            pytrace=False,
        )
