"""Every setting that reaches ``llama_context_params``, swept at its edges in a subprocess: each
one loads and answers, or is a typed error naming it; none may end the process with a signal
(llama.cpp asserts, aborting the interpreter, on some combinations: ``batch_size`` below
``max_live_sessions`` did, issue 39)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHILD = Path(__file__).with_name("settings_sweep.py")
BIG = 2**31 - 1
CASES: list[dict[str, Any]] = [
    {"model": {"batch_size": 1}},
    {"model": {"batch_size": 2}, "streams": 4},
    {"model": {"batch_size": 3, "max_live_sessions": 4}, "streams": 4},
    {"model": {"batch_size": 1, "max_live_sessions": 8, "kv_tokens": 2048}, "streams": 8},
    {"model": {"batch_size": 1, "kv_layout": "shared", "max_live_sessions": 8}, "streams": 8},
    {"model": {"batch_size": BIG}},
    {"model": {"batch_size": 0}},
    {"model": {"kv_tokens": 16, "kv_layout": "shared"}},
    {"model": {"kv_tokens": 16}},
    {"model": {"kv_tokens": 257, "max_live_sessions": 1}},
    {"model": {"kv_tokens": BIG}},
    {"model": {"kv_tokens": 1 << 40}},
    {"model": {"max_live_sessions": 0}},
    {"model": {"max_live_sessions": 256, "kv_layout": "shared", "kv_tokens": 256}, "streams": 3},
    {"model": {"max_live_sessions": 257}},
    {"model": {"threads": 0}},
    {"model": {"threads": 513}},
    {"model": {"threads": 1, "batch_size": 1, "max_live_sessions": 2}, "streams": 2},
    {"model": {"kv_type": "q4_0", "batch_size": 1}, "streams": 2},
    {"session": {"context_size": 1}},
    {"session": {"context_size": 8}},
    {"session": {"context_size": BIG}},
    {"session": {"batch_size": 1}},
    {"session": {"batch_size": 0}},
    {"session": {"batch_size": BIG}},
]


def sweep(path: Path, cases: list[dict[str, Any]], child: Path = CHILD) -> dict[int, str]:
    """Each case's outcome: "ok", the typed error it raised, or the signal that ended its
    process (a new process then goes on from the next case)."""
    outcomes: dict[int, str] = {}
    start = 0
    while start < len(cases):
        run = subprocess.run(
            [sys.executable, str(child), str(path), json.dumps(cases), str(start)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        began = None
        for line in run.stdout.splitlines():
            event = json.loads(line)
            if "start" in event:
                began = event["start"]
            else:
                outcomes[event["end"]] = event["outcome"]
        if run.returncode == 0:
            break
        assert began is not None and began not in outcomes, run.stderr[-2000:]
        code = run.returncode
        outcomes[began] = f"died: {signal.Signals(-code).name if code < 0 else f'exit {code}'}"
        start = began + 1
    return outcomes


@pytest.mark.slow
def test_no_setting_ends_the_process(smollm2_path: Path) -> None:
    outcomes = sweep(smollm2_path, CASES)
    report = "\n".join(f"{json.dumps(CASES[i])}: {outcomes[i][:160]}" for i in sorted(outcomes))
    print(report)
    assert len(outcomes) == len(CASES), report
    died = {i: o for i, o in outcomes.items() if o.startswith("died")}
    assert not died, report
    # the batch settings below the live sessions are served, not refused
    assert all(outcomes[i] == "ok" for i in range(5)), report
    # what cannot work is refused by a typed error naming its setting
    for i, case in enumerate(CASES):
        if outcomes[i] != "ok":
            named = [*case.get("model", {}), *case.get("session", {})]
            assert any(name in outcomes[i] for name in named), (case, outcomes[i])


def test_a_death_is_reported_with_its_signal(smollm2_path: Path, tmp_path: Path) -> None:
    """The must-fail variant: a case that aborts the child is reported as a death by SIGABRT."""
    child = tmp_path / "abort.py"
    child.write_text(
        "import json, os, sys\nprint(json.dumps({'start': int(sys.argv[3])}), flush=True)\nos.abort()\n"
    )
    assert sweep(smollm2_path, [{}], child) == {0: "died: SIGABRT"}
