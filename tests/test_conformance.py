"""llama-server's own conformance tests for Anthropic's Messages API
(``tools/server/tests/unit/test_compat_anthropic.py`` in the pinned llama.cpp sources), run
unchanged against ``llmsession serve`` on SmolLM2 through a small adapter for their server
fixture: their ``utils.py`` in its external-server mode (``DEBUG_EXTERNAL``, ``PORT``), a
``conftest.py`` of ours that neither downloads their models nor starts llama-server, and a stub
for the ``wget`` module their ``utils`` imports (it downloads nothing here).

The tests that do not apply are deselected, each with its reason (``NOT_APPLICABLE``, and the
README). The Responses API's three (``test_compat_oai_responses.py``) all do not apply: two
assert the text of their 260K-parameter stories model ("Suddenly"), one llama-server's own
telemetry fields; ``tests/test_responses_api.py`` covers what else they check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import running

from llmsession import Model
from llmsession.commands import paths
from llmsession.serve.app import create_app

SOURCES = paths.llama_dir() / "src" / "tools" / "server" / "tests"
NOT_APPLICABLE = {
    "test_anthropic_vision_format_accepted": "expects a 500 for an image sent to a text-only model; "
    "ours is a 400 (a request error)",
    "test_anthropic_vision_base64_with_multimodal_model": "downloads tinygemma3 from Hugging Face",
    "test_anthropic_tool_result_with_image": "expects a 500 for a tool result's image on a text-only "
    "model; ours tells the model in a line that an image was left out",
    "test_anthropic_empty_messages": "expects a 200 for an empty message list; Anthropic's API, and "
    "ours, answer a 400",
    "test_anthropic_thinking_history_in_count_tokens": "sets a Qwen3 template on the server for "
    "itself (an external server keeps its own)",
    "test_anthropic_thinking_history_in_template": "calls llama-server's /apply-template",
    "test_anthropic_thinking_with_reasoning_model": "downloads a 7B DeepSeek-R1 distill",
}
PASSING = 22  # of its 29 at the pinned commit: the others are NOT_APPLICABLE (one runs twice)
ADAPTER = """
import os
import pytest

os.environ["DEBUG_EXTERNAL"] = "1"  # (utils: every ServerProcess is the server already running)


@pytest.fixture
def vision_server():
    pytest.skip("no multimodal model here")
"""


@pytest.fixture(scope="module")
def served(smollm2_path: Path) -> Iterator[str]:
    with Model(smollm2_path, threads=2) as model, running(create_app(model)) as url:
        yield url


def test_llama_servers_anthropic_conformance_tests_pass(served: str, tmp_path: Path) -> None:
    assert SOURCES.is_dir(), f"the pinned llama.cpp sources are not at {SOURCES} (make setup puts them there)"
    shutil.copy(SOURCES / "utils.py", tmp_path / "utils.py")
    shutil.copy(SOURCES / "unit" / "test_compat_anthropic.py", tmp_path / "test_compat_anthropic.py")
    (tmp_path / "conftest.py").write_text(ADAPTER)
    (tmp_path / "wget.py").write_text("def download(*args, **kwargs):\n    raise RuntimeError('offline')\n")
    port = served.rsplit(":", 1)[1].split("/")[0]
    deselected = [f"--deselect=test_compat_anthropic.py::{name}" for name in NOT_APPLICABLE]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "test_compat_anthropic.py",
            *deselected,
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PORT": port, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = result.stdout[-4000:]
    assert result.returncode == 0, tail
    summary = tail.strip().splitlines()[-1]  # "22 passed, 8 deselected in ..."
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed == PASSING and "failed" not in summary and "error" not in summary, summary
