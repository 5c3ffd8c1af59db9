"""``Model.close()`` while another thread uses the model outside any session (tokenizing,
rendering and tokenizing a stateless chat's long prompt): close waits for the native call under
way and refuses new ones with ModelClosedError, instead of freeing the model under llama.cpp
(a use-after-free: the process aborted or segfaulted). The races run in a child process, so a
regression fails the test instead of killing pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from llmsession import Model, ModelClosedError
from llmsession.native.inuse import InUse, in_use

REPO = Path(__file__).resolve().parents[1]

# In the child: a fresh model per delay, closed while a thread runs ``CALL(model)``; each
# outcome is ["ok", what it returned] or ["raised", the name of what it raised]. What the text
# tokenizes to is counted first, on a model of its own (a freed vocabulary gave garbage too).
RACE = """
import json, sys, threading, time
from llmsession import GenerationOptions, LlmSessionError, Model

TEXT = "hello world, " * 80000  # (about half a second to tokenize here)
SETTINGS = dict(threads=1, anticipate=False, kv_tokens=2048, max_live_sessions=1)
with Model(sys.argv[1], **SETTINGS) as model:
    expected = len(model.tokenize(TEXT))
outcomes = []
for delay in (0.01, 0.05, 0.1, 0.2, 0.3, 0.45):
    model = Model(sys.argv[1], **SETTINGS)
    out = []

    def work():
        try:
            out.append(["ok", CALL(model)])
        except Exception as error:
            out.append(["raised", type(error).__name__])

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(delay)
    model.close()
    thread.join()
    outcomes.append(out[0])
print(json.dumps({"expected": expected, "outcomes": outcomes}))
"""


def race(model_path: Path, call: str) -> tuple[int, list[list[object]]]:
    """The tokens of the text, and each round's outcome (a child that crashed, or hung on what
    a freed model left, fails the test)."""
    code = textwrap.dedent(RACE).replace("CALL", call)
    result = subprocess.run(
        [sys.executable, "-c", code, str(model_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )
    assert result.returncode == 0, f"the child died ({result.returncode}): {result.stderr[-2000:]}"
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(found["outcomes"]) == 6
    return found["expected"], found["outcomes"]


def test_close_during_a_long_tokenize_waits_for_it_or_refuses_it(smollm2_path: Path) -> None:
    expected, outcomes = race(smollm2_path, "(lambda m: len(m.tokenize(TEXT)))")
    assert expected > 80000
    for outcome in outcomes:  # (the tokens' count, where the call finished before the close)
        assert outcome in (["raised", "ModelClosedError"], ["ok", expected]), outcomes


def test_close_during_a_chat_with_a_long_prompt_waits_for_it_or_refuses_it(smollm2_path: Path) -> None:
    chat = (
        "(lambda m: m.chat([{'role': 'user', 'content': TEXT}],"
        " GenerationOptions(max_tokens=1, temperature=0)).text)"
    )
    _, outcomes = race(smollm2_path, chat)
    # (a prompt built before the close is longer than the context: ContextOverflowError)
    for outcome in outcomes:
        assert outcome in (["raised", "ModelClosedError"], ["raised", "ContextOverflowError"]), outcomes


def test_tokenize_of_what_is_not_text_is_a_type_error(smollm2: Model) -> None:
    for wrong in (b"abc", None, 3):
        with pytest.raises(TypeError, match=f"tokenize takes a str, got {type(wrong).__name__}"):
            smollm2.tokenize(wrong)  # type: ignore[arg-type]


class Held:
    """A stand-in for the native model: ``call`` blocks in its ``in_use`` hold until released."""

    def __init__(self) -> None:
        self.uses = InUse()
        self.entered = threading.Event()
        self.release = threading.Event()

    @in_use
    def call(self, value: int) -> int:
        self.entered.set()
        self.release.wait(10)
        return value

    @in_use
    def quick(self) -> str:
        return "done"


def test_close_waits_for_the_calls_in_flight_and_refuses_new_ones() -> None:
    held = Held()
    results: list[object] = []
    caller = threading.Thread(target=lambda: results.append(held.call(7)))
    caller.start()
    assert held.entered.wait(10)
    closer = threading.Thread(target=held.uses.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # waiting for the call in flight
    with pytest.raises(ModelClosedError):
        held.quick()  # new calls are refused once closing began, not queued
    held.release.set()
    closer.join(10)
    caller.join(10)
    assert not closer.is_alive() and results == [7]
    with pytest.raises(ModelClosedError):
        held.quick()
    held.uses.close()  # (again: returns at once)


def test_a_call_that_raises_still_leaves_the_guard() -> None:
    held = Held()
    with pytest.raises(TypeError):
        held.call()  # type: ignore[call-arg]
    assert held.uses.count == 0
    held.uses.close()
