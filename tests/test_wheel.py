"""Installed as a user would: the wheel, built here, installed into a fresh virtual environment
outside the repository; ``llmsession setup`` finds the build and the model already in the cache
(no second download, no compiler step), and a two-line chat is piped through ``llmsession chat``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STATS = re.compile(r"\[prompt \d+ tokens: reused (\d+), decoded \d+ \|")


def run(*command: str | Path, cwd: Path, stdin: str = "", env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [str(c) for c in command], input=stdin, capture_output=True, text=True, cwd=cwd, timeout=600,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert out.returncode == 0, f"{command}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out.stdout + out.stderr


def test_the_wheel_installs_sets_up_and_chats(tmp_path: Path, smollm2_path: Path) -> None:
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, REPO, cwd=tmp_path)
    (wheel,) = dist.glob("llmsession-*.whl")
    names = ("index.html", "style.css", "main.js", "dom.js", "store.js", "api.js", "view.js")
    page = {f"llmsession/serve/static/{name}" for name in names}
    assert page <= set(zipfile.ZipFile(wheel).namelist())  # the chat page of `llmsession serve`
    run(sys.executable, "-m", "venv", tmp_path / "venv", cwd=tmp_path)
    bin_dir = tmp_path / "venv" / "bin"
    run(bin_dir / "python", "-m", "pip", "install", "--quiet", wheel, cwd=tmp_path)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ""}
    setup = run("llmsession", "setup", cwd=tmp_path, env=env)
    assert "already built" in setup and "already present and verified" in setup, setup
    chat = run("llmsession", "chat", "--max-tokens", "8", "--temperature", "0", stdin="Hi\nBye\n",
               cwd=tmp_path, env=env)  # fmt: skip
    turns = STATS.findall(chat)
    assert len(turns) == 2 and int(turns[1]) > 0, chat  # the second line reused the first exchange
    located = run(bin_dir / "python", "-c", "import llmsession; print(llmsession.__file__)", cwd=tmp_path)
    assert str(tmp_path / "venv") in located and str(REPO) not in located


@pytest.fixture(autouse=True)
def _build_is_available() -> None:
    if subprocess.run([sys.executable, "-m", "build", "--version"], capture_output=True).returncode != 0:
        pytest.fail("the `build` package is missing: it is in the test extras (pip install -e '.[test]')")
