"""The README's Python examples run as they stand: every ```python block, in order, in one
interpreter (a block may use what an earlier one made, as a reader would), against the fixture
models, with only the addresses a reader would change replaced: the model and projector files,
an image, the RPC servers (two started here) and the server's URL (one started here)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from serve_helpers import running

from llmsession import Model
from llmsession.native.rpc import local_servers
from llmsession.serve import create_app

README = Path(__file__).resolve().parents[1] / "README.md"
TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def script(blocks: list[str], replacements: dict[str, str]) -> str:
    """The blocks as one script, each announced (so a failure names its block)."""
    parts = []
    for index, block in enumerate(blocks, 1):
        for old, new in replacements.items():
            block = block.replace(old, new)
        parts.append(f"print('\\n--- README block {index}', flush=True)\n{block}")
    return "\n".join(parts) + "\nprint('--- README done')\n"


def test_the_readme_has_examples_and_each_replacement_is_used() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 10
    text = "\n".join(blocks)
    for address in (
        '"model.gguf"',
        '"mmproj.gguf"',
        '"cat.png"',
        '"bert.gguf"',
        "10.0.0.2:50052",
        "127.0.0.1:8080/v1",
    ):
        assert address in text, address


@pytest.mark.slow
def test_the_readme_examples_run_as_they_stand(
    smollm2_path: Path, smollm2: Model, fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    blocks = python_blocks(README.read_text())
    with local_servers(2, threads=1) as started, running(create_app(smollm2, api_key="sk-local")) as url:
        first, second = (str(endpoint) for endpoint, _ in started)
        replacements = {
            '"model.gguf"': repr(str(smollm2_path)),
            '"mmproj.gguf"': repr(str(fixture_path("mmproj-tiny.gguf"))),
            '"cat.png"': repr(str(fixture_path("image-red.png"))),
            '"bert.gguf"': repr(str(fixture_path("bert-tiny.gguf"))),
            '"qwen3.jinja"': repr(str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja")),
            "10.0.0.2:50052": first,
            "10.0.0.3:50052": second,
            "http://127.0.0.1:8080/v1": url,
            '"http://127.0.0.1:8080"': repr(url.removesuffix("/v1")),  # (Anthropic's base URL)
        }
        source = script(blocks, replacements)
        (tmp_path / "readme_examples.py").write_text(source)
        result = subprocess.run(
            [sys.executable, str(tmp_path / "readme_examples.py")],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,  # (``chat.llmsession`` and the like are written here)
        )
    ran = re.findall(r"^--- README block (\d+)", result.stdout, flags=re.M)
    tail = textwrap.shorten(result.stderr[-3000:], 3000)
    assert result.returncode == 0, f"block {ran[-1] if ran else '?'} failed: {tail}"
    assert len(ran) == len(blocks) and "--- README done" in result.stdout
