"""``Model(kv_type=...)``: the KV cells' type. q8_0 cells hold a session in about half the bytes
of f16 ones; a reply from cached q8_0 cells equals a fresh q8_0 decode's; a quantized V cache
without flash attention is refused before llama.cpp sees it; a state saved in one type reloads
only its transcript under another, with a note that says why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from llmsession import GenerationOptions, Model

GREEDY = GenerationOptions(max_tokens=12, temperature=0)
QUESTION = "Describe a lighthouse at night in three sentences."


def parked_bytes(path: Path, kv_type: str) -> int:
    """What one parked session of a short chat takes, in cells of ``kv_type``."""
    with Model(path, threads=2, kv_type=kv_type, max_live_sessions=1) as model:
        first, second = model.session(), model.session()
        first.respond(QUESTION, GREEDY)
        second.respond(QUESTION, GREEDY)  # (the one live sequence: the first is parked)
        report = model.memory()
        assert model.kv_type == kv_type and report.live_sessions == 1
        return report.parked_bytes


def test_q8_0_cells_hold_a_session_in_about_half_the_bytes(smollm2_path: Path) -> None:
    f16, q8 = parked_bytes(smollm2_path, "f16"), parked_bytes(smollm2_path, "q8_0")
    assert f16 > 0 and 0.45 < q8 / f16 < 0.6, (f16, q8)


def test_a_reply_from_cached_q8_0_cells_equals_a_fresh_decode(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2, kv_type="q8_0") as model:
        session = model.session()
        session.respond(QUESTION, GREEDY)
        cached = session.respond("And in the morning?", GREEDY)
        assert cached.usage.reused_tokens > 0
        fresh = model.session(share_prefix=False)
        fresh.messages = session.messages[:-1]
        again = fresh.respond("And in the morning?", GREEDY)
        assert again.usage.reused_tokens == 0 and again.text == cached.text


def test_bad_cell_types_are_refused_before_loading(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match="flash attention"):
        Model(smollm2_path, kv_type="q8_0", flash_attention=False)
    with pytest.raises(ValueError, match="kv_type"):
        Model(smollm2_path, kv_type="bf16")
    with Model(smollm2_path, threads=2, kv_type="f16", flash_attention=False) as model:
        assert model.session().respond("Hi", GenerationOptions(max_tokens=2)).text is not None


def test_a_state_reloads_only_into_cells_of_its_type(smollm2_path: Path, tmp_path: Path) -> None:
    saved = tmp_path / "chat.llms"
    with Model(smollm2_path, threads=2, kv_type="f16") as model:
        session = model.session()
        session.respond(QUESTION, GREEDY)
        session.save(saved)
        same = model.load_session(saved).respond("And in the morning?", GREEDY)
        assert same.usage.restored_tokens > 0  # (the same type: the state comes back)
    with Model(smollm2_path, threads=2, kv_type="q8_0") as other:
        loaded = other.load_session(saved)
        assert loaded.messages == session.messages
        reply = loaded.respond("And in the morning?", GREEDY)
        assert reply.usage.restored_tokens == 0
        assert "f16" in reply.usage.cache_note and "q8_0" in reply.usage.cache_note
        assert "kv_type" in reply.usage.cache_note


def test_quantized_cells_a_model_cannot_hold_are_refused_at_load(fixture_path: Callable[[str], Path]) -> None:
    """T5's decoder attends with a position bias, off flash attention, over a V cache laid out
    for it: quantized, llama.cpp would copy blocks as single values past its buffers. The tiny
    LFM2's attention heads are not a multiple of the quantized block: llama.cpp refuses its
    context. Both are ValueErrors at load, not errors of every exchange (or worse)."""
    with pytest.raises(ValueError, match="encoder-decoder"):
        Model(fixture_path("t5-tiny.gguf"), kv_type="q8_0")
    with pytest.raises(ValueError, match="cannot hold this model's cells"):
        Model(fixture_path("lfm2-tiny.gguf"), kv_type="q4_0")
    with Model(fixture_path("lfm2-tiny.gguf"), threads=1) as model:  # (f16: as before)
        assert model.kv_type == "f16" and model.session().respond("Hi", GREEDY).text is not None
