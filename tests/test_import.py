"""A bare ``import llmsession`` is light: it loads none of the heavy libraries, which come with
the first name that needs them (``Model``, ``Session``, ``Stream``, ``Image``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import llmsession

HEAVY = {
    "numpy",
    "PIL",
    "llguidance",
    "jinja2",
    "cffi",
    "_cffi_backend",
    "llama_cffi",
    "jsonschema",
    "pydantic",
}


def loaded_after(code: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {name.split(".")[0] for name in json.loads(out.stdout.splitlines()[-1])}


def test_a_bare_import_loads_nothing_heavy() -> None:
    assert not loaded_after("import llmsession") & HEAVY
    assert not loaded_after("from llmsession import GenerationOptions, LlmSessionError, Reply") & HEAVY


def test_the_public_classes_load_nothing_heavy_until_used() -> None:
    assert not loaded_after("from llmsession import AsyncStream, Model") & HEAVY
    runtime = loaded_after("from llmsession import Session, Stream")  # (numpy: the native layer's arrays)
    assert not runtime & {"PIL", "llguidance", "jinja2", "jsonschema", "pydantic"}
    assert "numpy" in loaded_after("import llmsession; llmsession.Image")
    assert "PIL" not in loaded_after("import llmsession; llmsession.Image")  # until one is decoded


@pytest.mark.native
def test_each_heavy_library_loads_when_first_needed(smollm2_path: Path) -> None:
    """Opening a model brings the bindings and numpy (and jinja2, to render its template), not
    the matcher or PIL; without jinja, not jinja2 either; the first constraint compiled brings
    llguidance, the first image decoded PIL."""
    opened = f"from llmsession import Model\nmodel = Model({str(smollm2_path)!r}, threads=1)"
    assert {"numpy", "llama_cffi", "_cffi_backend", "jinja2"} <= loaded_after(opened)
    assert not loaded_after(opened) & {"llguidance", "PIL", "jsonschema", "pydantic"}
    plain = opened.replace("threads=1", "threads=1, use_jinja=False")
    assert not loaded_after(plain) & {"llguidance", "PIL", "jinja2", "jsonschema", "pydantic"}
    regex = "GenerationOptions(regex='[0-9]')"
    constrained = (
        f"{opened}\nfrom llmsession import GenerationOptions\nfrom llmsession.api.model import local_model\n"
        f"local_model(model).constraint({regex})"
    )
    assert "llguidance" in loaded_after(constrained)
    decoded = "import llmsession\ntry:\n    llmsession.Image(b'not an image')\n"
    decoded += "except llmsession.ImageError:\n    pass"
    assert "PIL" in loaded_after(decoded)


def test_every_public_name_resolves() -> None:
    for name in llmsession.__all__:
        assert getattr(llmsession, name) is not None, name
    assert llmsession.Model.__module__ == "llmsession.api.model"
    assert llmsession.__version__ == "0.1.0"  # the installed distribution's (pyproject.toml)
    try:
        llmsession.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("an unknown name resolved")
