"""How a model's KV cells are sized when nobody says (issue 39: the defaults refused an ordinary
session of 4,096 positions), and the memory check of cells asked for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmsession import GenerationOptions, Model
from llmsession.engine.sizing import DEFAULT_CONTEXT_CAP, GIB, MIN_CONTEXT, size_kv
from llmsession.runtime.loading import available_memory

SMOL_CELL = 23040  # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) x 2 bytes


def test_a_session_gets_the_training_context_by_default() -> None:
    sizing = size_kv(None, max_live=4, n_ctx_train=8192, bytes_per_cell=SMOL_CELL, available=20 * GIB)
    assert (sizing.kv_tokens, sizing.context_size) == (4 * 8192, 8192)
    assert sizing.kv_bytes == 4 * 8192 * SMOL_CELL
    assert "training context" in sizing.note


def test_a_long_training_context_is_capped() -> None:
    sizing = size_kv(None, max_live=4, n_ctx_train=131072, bytes_per_cell=1000, available=None)
    assert sizing.context_size == DEFAULT_CONTEXT_CAP
    assert "capped" in sizing.note


def test_a_short_or_missing_training_context_gets_the_least_default() -> None:
    short = size_kv(None, max_live=2, n_ctx_train=512, bytes_per_cell=1, available=None)
    assert short.context_size == MIN_CONTEXT and "least default" in short.note
    missing = size_kv(None, max_live=2, n_ctx_train=0, bytes_per_cell=1, available=None)
    assert missing.context_size == DEFAULT_CONTEXT_CAP and "names no training context" in missing.note
    rounded = size_kv(None, max_live=2, n_ctx_train=10000, bytes_per_cell=1, available=None)
    assert rounded.context_size == 9984 and "capped" not in rounded.note and "in whole 256s" in rounded.note


def test_the_default_is_halved_until_it_fits_half_the_memory() -> None:
    # 4 x 32,768 cells of 100 KB is 12.5 GiB: over half of 16 GiB, so 16,384 each (6.25 GiB)
    sizing = size_kv(None, max_live=4, n_ctx_train=32768, bytes_per_cell=100_000, available=16 * GIB)
    assert sizing.context_size == 16384 and sizing.fits
    assert sizing.kv_bytes <= 8 * GIB
    assert "fitted" in sizing.note


def test_a_floor_that_does_not_fit_says_so() -> None:
    """Never below the least default; where even that takes more than half the memory, the note
    does not claim a fit (and the load logs a warning)."""
    tiny = size_kv(None, max_live=4, n_ctx_train=32768, bytes_per_cell=100_000, available=GIB)
    assert tiny.context_size == MIN_CONTEXT and not tiny.fits
    assert "fitted" not in tiny.note and "set kv_tokens" in tiny.note


def test_a_floor_that_needs_more_than_all_the_memory_is_refused() -> None:
    with pytest.raises(ValueError, match=r"even the least default context .* set a smaller kv_tokens"):
        size_kv(None, max_live=4, n_ctx_train=32768, bytes_per_cell=100_000, available=GIB // 2)


def test_cells_asked_for_are_refused_only_when_they_cannot_fit() -> None:
    """Explicit cells may take more than the default's half of the memory, not more than all."""
    three_quarters = (3 * GIB // 4) // SMOL_CELL
    kept = size_kv(three_quarters, max_live=4, n_ctx_train=8192, bytes_per_cell=SMOL_CELL, available=GIB)
    assert (kept.kv_tokens, kept.context_size) == (three_quarters, 8192)
    with pytest.raises(ValueError, match=re.escape("kv_tokens 16777216 needs about 360.0 GiB")) as caught:
        size_kv(1 << 24, max_live=4, n_ctx_train=8192, bytes_per_cell=SMOL_CELL, available=20 * GIB)
    assert "max_live_sessions" not in str(caught.value)  # (the bytes do not depend on it)


def fake_system(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc with 1 GiB available and the given /proc/self/cgroup, and a cgroup mount."""
    proc, mount = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:    1048576 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_text(text)
    return proc, mount


def test_available_memory_reads_meminfo_and_the_process_cgroup(tmp_path: Path) -> None:
    proc, mount = fake_system(tmp_path / "plain", "0::/\n", {})
    assert available_memory(proc, mount) == GIB
    # cgroup v2, nested: its own limit leaves 300 MiB, of which 100 MiB is reclaimable cache
    v2 = {
        "app/memory.max": str(600 << 20),
        "app/memory.current": str(400 << 20),
        "app/memory.stat": f"anon 1\ninactive_file {100 << 20}\n",
    }
    proc, mount = fake_system(tmp_path / "v2", "0::/app\n", v2)
    assert available_memory(proc, mount) == 300 << 20
    # cgroup v1: no limit of its own ("unlimited" is about 2**63), but its parent's leaves 200 MiB
    v1 = {
        "memory/box/job/memory.limit_in_bytes": "9223372036854771712",
        "memory/box/job/memory.usage_in_bytes": "1",
        "memory/box/job/memory.stat": "total_inactive_file 0\n",
        "memory/box/memory.limit_in_bytes": str(500 << 20),
        "memory/box/memory.usage_in_bytes": str(300 << 20),
        "memory/box/memory.stat": "total_inactive_file 0\n",
    }
    proc, mount = fake_system(tmp_path / "v1", "4:memory:/box/job\n3:pids:/\n", v1)
    assert available_memory(proc, mount) == 200 << 20
    # hybrid (a v2 line beside v1's memory controller), no memory.stat, a group that is not there
    hybrid = {"memory/memory.limit_in_bytes": str(400 << 20), "memory/memory.usage_in_bytes": "0"}
    proc, mount = fake_system(tmp_path / "hybrid", "0::/\n4:memory:/gone\n", hybrid)
    assert available_memory(proc, mount) == 400 << 20
    proc, mount = fake_system(tmp_path / "max", "0::/\n", {"memory.max": "max", "memory.current": "5"})
    assert available_memory(proc, mount) == GIB
    real = available_memory()
    assert real is not None and real > 0


def test_the_default_model_holds_its_training_context_per_session(smollm2: Model) -> None:
    """What issue 39 found refused: 4,096 and 8,192 positions (SmolLM2's training context)."""
    report = smollm2.memory()
    assert report.session_cells == report.context_size == 8192
    assert report.kv_bytes == report.kv_tokens * SMOL_CELL
    assert "training context" in report.kv_sizing and "MiB" in str(report)
    for size in (4096, 8192):
        with smollm2.session(context_size=size) as session:
            assert session.respond("Hi", GenerationOptions(max_tokens=2)).usage.prompt_tokens > 0
    with smollm2.session() as session:
        assert session.context_size == 8192
    with pytest.raises(ValueError, match="load the model with a larger kv_tokens"):
        smollm2.session(context_size=16384)


def test_cells_that_cannot_fit_in_memory_are_refused_at_load(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_tokens 16777216 needs about .* GiB of KV cells"):
        Model(smollm2_path, kv_tokens=1 << 24)
