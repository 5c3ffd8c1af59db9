"""Every setting through the public names, type checked: a script that uses each field of
``ModelConfig``, ``MemoryConfig`` and ``SessionConfig`` (as objects and as keyword overrides)
passes ``mypy --strict``, and the same script with one setting misspelled does not. The keyword
overrides (``ModelSettings``, ``SessionSettings``) declare exactly the configs' fields, with the
same types, so the two declarations cannot drift apart."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from llmsession import (
    MemoryConfig,
    Model,
    ModelConfig,
    ModelSettings,
    SessionConfig,
    SessionSettings,
)

SCRIPT = """
from pathlib import Path

from llmsession import (
    CheckpointConfig, GenerationOptions, MemoryConfig, Model, ModelConfig, Reply, Session,
    SessionConfig,
)

config = ModelConfig(
    mmproj_path=None, threads=2, gpu_layers=0, flash_attention=None, kv_type="q8_0",
    use_jinja=None, chat_template=None, anticipate=False, rpc_servers=(), isolated=False,
    worker_timeout=30.0, stateless_sessions=8,
)
memory = MemoryConfig(
    kv_tokens=4096, max_live_sessions=2, kv_layout="shared", host_cache_bytes=1 << 28,
    disk_cache_dir=Path("/tmp"), batch_size=256, checkpoints=CheckpointConfig(max_count=2),
)
chat = SessionConfig(
    system="Be brief.", context_size=1024, batch_size=128, thinking=False, swa_full=True,
    share_prefix=False,
)


def use(path: str) -> Reply:
    with Model(
        path, config=config, memory=memory, threads=1, kv_type="f16", kv_layout="per_session"
    ) as model:
        session: Session = model.session("Hi.", config=chat, context_size=512, thinking="low")
        session.respond("Hello", GenerationOptions(max_tokens=4))
        threads: int = model.threads
        kv = model.kv_type
        assert kv in ("f16", "q8_0", "q4_0") and threads > 0
        model.chat([{"role": "user", "content": "x"}], share_prefix=False, batch_size=64)
        return model.complete("x", config=SessionConfig(context_size=256), swa_full=True)
"""

MISSPELLED = {
    "a model setting": ("threads=1,", "thread=1,"),
    "a memory setting": ('kv_layout="per_session"', 'kv_layuot="per_session"'),
    "a session setting": ("context_size=512,", "context=512,"),
    "a literal": ('kv_type="f16"', 'kv_type="f32"'),
    "an effort": ('thinking="low"', 'thinking="lo"'),
}
USE = SCRIPT[SCRIPT.index("def use(") :]  # (every misspelling is in it)


def misspelled_script() -> tuple[str, dict[str, range]]:
    """The script and a copy of ``use`` per misspelling, and the lines each copy holds."""
    source, lines = SCRIPT, {}
    for what, (right, wrong) in MISSPELLED.items():
        assert right in USE, what
        first = source.count("\n") + 3  # (after the blank lines, the copy's ``def``)
        source += "\n\n" + USE.replace("def use(", f"def use_{len(lines)}(", 1).replace(right, wrong, 1)
        lines[what] = range(first, source.count("\n") + 1)
    return source, lines


def mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "uses_every_setting.py"
    script.write_text(source)
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--no-incremental",
        "--python-version",
        "3.10",
        str(script),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])


def test_the_overrides_declare_exactly_the_configs_fields() -> None:
    fields = {**typing.get_type_hints(ModelConfig), **typing.get_type_hints(MemoryConfig)}
    assert set(ModelSettings.__annotations__) == set(fields)
    session = typing.get_type_hints(SessionConfig)
    assert set(SessionSettings.__annotations__) == set(session) - {"system"}  # (``session(system)``)
    overrides = {**typing.get_type_hints(ModelSettings), **typing.get_type_hints(SessionSettings)}
    for name, held in [*fields.items(), *((n, t) for n, t in session.items() if n != "system")]:
        accepted = set(typing.get_args(overrides[name])) or {overrides[name]}
        given = set(typing.get_args(held)) or {held}  # (an override may take more: a str path)
        assert given <= accepted or held in accepted, (name, overrides[name], held)


def test_every_setting_is_in_the_script() -> None:
    """The script uses them all (a new field must be added to it)."""
    for kind in (ModelConfig, MemoryConfig, SessionConfig):
        missing = [f.name for f in dataclasses.fields(kind) if f"{f.name}=" not in SCRIPT]
        assert missing == [], kind.__name__


@pytest.mark.slow
def test_mypy_strict_passes_the_script_and_fails_a_misspelled_setting(tmp_path: Path) -> None:
    clean = mypy(tmp_path, SCRIPT)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    source, lines = misspelled_script()  # (one run: each misspelling in a copy of its own)
    result = mypy(tmp_path, source)
    assert result.returncode == 1, result.stdout
    found = [int(line.split(":")[1]) for line in result.stdout.splitlines() if ": error:" in line]
    for what, held in lines.items():
        assert any(line in held for line in found), (what, result.stdout)


def test_a_misspelled_setting_is_a_type_error_at_run_time_too() -> None:
    with pytest.raises(TypeError, match="unknown model setting 'thread'"):
        Model("no-such.gguf", thread=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="kv_type must be one of f16, q8_0, q4_0"):
        ModelConfig(kv_type="f32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantizes the V cache"):
        ModelConfig(kv_type="q8_0", flash_attention=False)
    with pytest.raises(ValueError, match="max_live_sessions: must be between 1 and 256"):
        MemoryConfig(max_live_sessions=0)
    with pytest.raises(TypeError, match="thinking must be a bool"):
        SessionConfig(thinking="yes")  # type: ignore[arg-type]
