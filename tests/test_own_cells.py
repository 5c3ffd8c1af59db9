"""Live sessions with KV cells of their own (``kv_layout="per_session"``, the default: llama.cpp's
per-sequence streams): a session among long live ones answers as a fresh decode does, a copy from
another sequence (sharing, forks) equals a fresh decode and the wrong copy is caught, a state saved
in one layout reloads only its transcript in the other, and a session's size is bounded by its
own cells with an error that says what to change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import internals
import pytest
from test_reuse import assert_same_as_fresh, check_against_fresh, paragraph, short_prompt_noise, tolerance_for

from llmsession import GenerationOptions, Model
from llmsession.native.llama import bindings

GREEDY = GenerationOptions(max_tokens=24, temperature=0)
SYSTEM = "You are a patient guide to the old city. Answer in full sentences, with one example each."


def test_the_default_layout_gives_each_live_session_cells_of_its_own(smollm2: Model) -> None:
    engine = internals.local(smollm2).engine
    session = smollm2.session()
    session.respond("Hi.", GenerationOptions(max_tokens=2, temperature=0))
    context = internals.live_context(session)
    assert context is not None and context.own_cells and context.n_seq_max == 4
    lib, _ = bindings()  # llama.cpp's own view: 4 streams of SmolLM2's training context each
    assert lib.llama_n_ctx_seq(context.ptr) == engine.session_cells(True) == 8192
    assert lib.llama_n_ctx(context.ptr) == 4 * 8192
    assert session.context_size == 8192


def test_a_session_among_long_live_ones_equals_a_fresh_decode(smollm2: Model) -> None:
    """Three sessions hold long transcripts in the other sequences' cells; the fourth answers as
    a session of a fresh context (within the split noise measured for this build)."""
    others = [smollm2.session(f"You are assistant {i}.") for i in range(3)]
    for i, other in enumerate(others):
        other.respond(paragraph(smollm2, i, 600), GenerationOptions(max_tokens=4, temperature=0))
    mine = smollm2.session(system=SYSTEM)
    mine.respond("Tell me about the history of Paris.", GREEDY)
    assert [internals.placement(s)[0] for s in (*others, mine)] == ["live"] * 4
    assert_same_as_fresh(mine, "Which rivers should a visitor see?")


def test_a_fork_copied_into_its_own_cells_equals_a_fresh_decode(smollm2: Model) -> None:
    source = smollm2.session(system=SYSTEM)
    source.respond("Tell me about the history of Paris.", GREEDY)
    fork = source.fork()
    assert internals.record(fork) == internals.record(source)
    assert internals.placement(fork)[1] != internals.placement(source)[1]
    reply = assert_same_as_fresh(fork, "And its bridges?")
    assert reply.usage.reused_tokens >= len(internals.record(source))


def test_a_fork_given_anothers_state_is_caught(
    smollm2: Model, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork differential's teeth: a copy that takes another live session's state instead of
    the source's fails the check the real copy passes (a model of its own: nobody evicted)."""
    with Model(smollm2_path, threads=2, anticipate=False) as model:
        caught_wrong_fork(model, monkeypatch, tolerance_for(short_prompt_noise(smollm2)))


def caught_wrong_fork(model: Model, monkeypatch: pytest.MonkeyPatch, tolerance: float) -> None:
    pirate = model.session(system="You are a pirate who speaks only of the sea and its ships.")
    pirate.respond("Tell me about your ship and the storms it has seen on the open sea.", GREEDY)
    source = model.session(system=SYSTEM)
    source.respond("Tell me about the history of Paris.", GREEDY)
    if len(internals.record(pirate)) < len(internals.record(source)):
        pytest.fail("the pirate's state must hold at least the source's positions")
    context = internals.live_context(source)
    assert context is not None
    pirate_seq = internals.placement(pirate)[1]
    real = type(context).seq_cp

    def wrong(self: object, src: int, dst: int) -> bool:
        assert real(self, pirate_seq, dst)  # type: ignore[arg-type]
        return bool(self.seq_rm(len(internals.record(source)), dst))  # type: ignore[attr-defined]

    monkeypatch.setattr(type(context), "seq_cp", wrong)
    fork = source.fork()
    monkeypatch.undo()
    assert [internals.placement(s)[0] for s in (pirate, source, fork)] == ["live"] * 3
    reply = fork.respond("And its bridges?", GREEDY)
    assert check_against_fresh(fork, reply, tolerance) != [], "a fork of the wrong state passed"


def test_a_state_saved_in_one_layout_reloads_only_its_transcript_in_the_other(
    smollm2: Model, smollm2_path: Path, tmp_path: Path
) -> None:
    session = smollm2.session(system=SYSTEM)
    session.respond("Tell me about the history of Paris.", GREEDY)
    session.save(tmp_path / "chat.llms")
    with Model(smollm2_path, threads=2, kv_layout="shared") as shared:
        loaded = shared.load_session(tmp_path / "chat.llms")
        assert loaded.messages == session.messages and loaded.cached_tokens == 0
        reply = loaded.respond("And its bridges?", GREEDY)
        assert "kv_layout" in reply.usage.cache_note and reply.usage.restored_tokens == 0
        loaded.save(tmp_path / "shared.llms")
    again = smollm2.load_session(tmp_path / "shared.llms")
    usage = again.respond("And its museums?", GREEDY).usage
    assert usage.restored_tokens == 0 and "kv_layout" in usage.cache_note
    same = smollm2.load_session(tmp_path / "chat.llms")  # its own layout: the state comes back
    assert same.cached_tokens == len(internals.record(session))


def test_a_session_larger_than_its_own_cells_is_refused_with_what_to_change(
    smollm2_path: Path, fixture_path: Callable[[str], Path]
) -> None:
    with Model(smollm2_path, threads=2, kv_tokens=4096, max_live_sessions=4) as model:
        assert model.session().context_size == 1024
        with pytest.raises(ValueError, match=r"1024 cells a live session holds.*kv_layout='shared'"):
            model.session(context_size=2048)
        # (a model without a sliding window has one layout: the small-window flag changes nothing)
        assert model.session(swa_full=False).context_size == 1024
    with Model(smollm2_path, threads=2, kv_tokens=4096, max_live_sessions=4, kv_layout="shared") as model:
        assert model.session(context_size=4096).context_size == 4096
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        Model(smollm2_path, threads=2, kv_layout="streams")
    with pytest.raises(ValueError, match="fewer than 256 cells of its own"):
        Model(smollm2_path, threads=2, kv_tokens=1024, max_live_sessions=8)
    # A recurrent model keeps the pool: the same budget is fine there.
    with Model(fixture_path("mamba-tiny.gguf"), threads=2, kv_tokens=1024, max_live_sessions=8) as mamba:
        assert not internals.local(mamba).engine.own_cells(True)


def test_a_session_saved_larger_than_a_live_session_holds_here_loads_at_what_fits(
    smollm2: Model, smollm2_path: Path, tmp_path: Path
) -> None:
    """A file from a pool with context_size 16,384 loads its transcript into the 8,192 cells
    a default model gives each session instead of refusing the file."""
    with Model(smollm2_path, threads=2, kv_layout="shared", kv_tokens=16384) as shared:
        session = shared.session(system=SYSTEM, context_size=16384)
        session.respond("Tell me about the history of Paris.", GREEDY)
        session.save(tmp_path / "pooled.llms")
    loaded = smollm2.load_session(tmp_path / "pooled.llms")
    assert loaded.context_size == 8192 and loaded.messages == session.messages
    assert loaded.respond("And its bridges?", GREEDY).usage.completion_tokens > 0
