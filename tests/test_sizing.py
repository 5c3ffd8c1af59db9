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
    assert (
        size_kv(None, max_live=2, n_ctx_train=512, bytes_per_cell=1, available=None).context_size
        == MIN_CONTEXT
    )
    assert (
        size_kv(None, max_live=2, n_ctx_train=0, bytes_per_cell=1, available=None).context_size
        == DEFAULT_CONTEXT_CAP
    )


def test_the_default_is_halved_until_it_fits_half_the_memory() -> None:
    # 4 x 32,768 cells of 100 KB is 12.5 GiB: over half of 16 GiB, so 16,384 each (6.25 GiB)
    sizing = size_kv(None, max_live=4, n_ctx_train=32768, bytes_per_cell=100_000, available=16 * GIB)
    assert sizing.context_size == 16384
    assert sizing.kv_bytes <= 8 * GIB
    assert "fitted" in sizing.note
    tiny = size_kv(None, max_live=4, n_ctx_train=32768, bytes_per_cell=100_000, available=GIB // 8)
    assert tiny.context_size == MIN_CONTEXT  # never below the least default


def test_cells_asked_for_are_refused_only_when_they_cannot_fit() -> None:
    kept = size_kv(9000, max_live=4, n_ctx_train=8192, bytes_per_cell=SMOL_CELL, available=GIB)
    assert (kept.kv_tokens, kept.context_size) == (9000, 8192)
    with pytest.raises(ValueError, match=re.escape("kv_tokens 16777216 needs about 360.0 GiB")):
        size_kv(1 << 24, max_live=4, n_ctx_train=8192, bytes_per_cell=SMOL_CELL, available=20 * GIB)


def test_available_memory_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n")
    assert available_memory(meminfo) == 1000 * 1024
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
