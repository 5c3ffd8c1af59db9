"""A bare ``import llmsession`` is light: it loads none of the heavy libraries, which come with
the first name that needs them (``Model``, ``Session``, ``Stream``, ``Image``)."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_the_first_heavy_name_loads_what_it_needs() -> None:
    assert {"numpy", "llguidance"} <= loaded_after("from llmsession import Model")
    assert "numpy" in loaded_after("import llmsession; llmsession.Image")


def test_every_public_name_resolves() -> None:
    for name in llmsession.__all__:
        assert getattr(llmsession, name) is not None, name
    assert llmsession.Model.__module__ == "llmsession.runtime.model"
    assert llmsession.__version__ == "0.1.0"  # the installed distribution's (pyproject.toml)
    try:
        llmsession.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("an unknown name resolved")
