"""A new session starts from the longest prefix of its prompt another live session holds (a common
system prompt): those cells are shared, not decoded again, and the reply is a fresh decode's;
the one it started from keeps its own; ``share_prefix=False`` keeps a session apart both ways."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import internals
import pytest
from test_reuse import (
    assert_same_as_fresh,
    check_against_fresh,
    short_prompt_noise,
    tolerance_for,
)

from llmsession import GenerationOptions, Model
from llmsession.engine.engine import Engine
from llmsession.native.context import NativeContext

GREEDY = GenerationOptions(max_tokens=24, temperature=0)
SYSTEM = "You are a patient guide to the old city. Answer in full sentences, with one example each."


def test_a_new_session_starts_from_anothers_system_prompt_and_equals_fresh(smollm2: Model) -> None:
    first = smollm2.session(system=SYSTEM)
    mine = first.respond("Tell me about the history of Paris.", GREEDY)
    held = internals.record(first)
    second = smollm2.session(system=SYSTEM)
    reply = assert_same_as_fresh(second, "Which rivers should a visitor see?")
    usage = reply.usage
    own = smollm2.prompt_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}])
    assert usage.shared_tokens == usage.reused_tokens >= len(smollm2.tokenize(SYSTEM, add_special=False))
    assert usage.decoded_prompt_tokens == usage.prompt_tokens - usage.shared_tokens
    assert usage.shared_tokens < len(own)
    assert internals.record(first) == held  # the one it started from keeps all of its own
    follow = first.respond("And its bridges?", GREEDY)
    assert follow.usage.reused_tokens >= mine.usage.prompt_tokens


def test_a_session_started_from_the_wrong_cells_is_caught(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The differential's teeth: an engine whose copy takes another sequence's cells (a pirate's,
    long enough to hold the prefix) than the donor it recorded must fail the check the real one
    passes."""
    pirate = smollm2.session(system="You are a pirate who speaks only of the sea and its ships.")
    pirate.respond("Tell me about your ship.", GREEDY)
    donor = smollm2.session(system=SYSTEM)  # (kept: a session dropped is no donor)
    donor.respond("Hello!", GREEDY)
    state, pirate_seq = internals.placement(pirate)
    assert state == "live"
    copy = NativeContext.seq_cp

    def wrong(self: NativeContext, src: int, dst: int) -> bool:
        return copy(self, pirate_seq, dst)

    monkeypatch.setattr(NativeContext, "seq_cp", wrong)
    session = smollm2.session(system=SYSTEM)
    reply = session.respond("Tell me about the history of Paris.", GREEDY)
    monkeypatch.undo()
    assert reply.usage.shared_tokens > 20
    noise = short_prompt_noise(smollm2)
    assert check_against_fresh(session, reply, tolerance_for(noise), final=False) != []


def test_a_session_apart_neither_takes_nor_gives(smollm2: Model) -> None:
    shared = smollm2.session(system=SYSTEM)
    shared.respond("Hello!", GREEDY)
    apart = smollm2.session(system=SYSTEM, share_prefix=False)
    first = apart.respond("Hello!", GREEDY)
    assert first.usage.reused_tokens == first.usage.shared_tokens == 0
    shared.close()  # the only other holder of the system prompt: now only `apart` holds it
    late = smollm2.session(system=SYSTEM).respond("Hello!", GREEDY)
    assert late.usage.shared_tokens == 0 and late.usage.decoded_prompt_tokens == late.usage.prompt_tokens
    with pytest.raises(TypeError, match="share_prefix"):
        smollm2.session(share_prefix="no")  # type: ignore[arg-type]


def test_a_fork_and_a_saved_session_keep_the_setting(smollm2: Model, tmp_path: Path) -> None:
    apart = smollm2.session(system=SYSTEM, share_prefix=False)
    apart.respond("Hello!", GREEDY)
    assert apart.fork().share_prefix is False
    apart.save(tmp_path / "apart.llmsession")
    assert smollm2.load_session(tmp_path / "apart.llmsession").share_prefix is False


def test_recurrent_memories_share_nothing(fixture_path: Callable[[str], Path]) -> None:
    """A recurrent state holds no positions to cut after a prefix: each session decodes its own."""
    with Model(fixture_path("mamba-tiny.gguf"), threads=2) as mamba:
        mamba.session(system=SYSTEM).respond("Hello!", GREEDY)
        reply = mamba.session(system=SYSTEM).respond("Hello!", GREEDY)
        assert reply.usage.shared_tokens == reply.usage.reused_tokens == 0


def test_on_gemma3_a_shared_system_prompt_equals_fresh(gemma3: Model) -> None:
    """Sliding-window layers in the full-size cache (``swa_full``) share too; the small one not."""
    donor = gemma3.session(system=SYSTEM)
    donor.respond("Tell me about the history of Paris.", GREEDY)
    reply = assert_same_as_fresh(gemma3.session(system=SYSTEM), "Which rivers should a visitor see?")
    assert reply.usage.shared_tokens > 20
    small = gemma3.session(system=SYSTEM, swa_full=False).respond("Hello!", GREEDY)
    assert small.usage.shared_tokens == 0


def test_sessions_in_threads_start_from_each_other_and_equal_fresh(smollm2: Model) -> None:
    donor = smollm2.session(system=SYSTEM)  # for both
    donor.respond("Hello!", GREEDY)
    sessions = [smollm2.session(system=SYSTEM) for _ in range(2)]
    questions = ["Tell me about the history of Paris.", "Which rivers should a visitor see?"]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda i: sessions[i].respond(questions[i], GREEDY), range(2)))
    tolerance = tolerance_for(short_prompt_noise(smollm2))
    for i, session in enumerate(sessions):
        reply = replies[i]
        assert reply.usage.shared_tokens > 20
        assert check_against_fresh(session, reply, tolerance, final=False) == []


def test_a_new_session_starts_from_a_parked_sessions_system_prompt_and_equals_fresh(
    smollm2_path: Path,
) -> None:
    """With two live sequences, two other sessions park the first; a new one still starts from
    the first's system prompt (its state restored into another sequence, then cut), and the first
    comes back whole."""
    with Model(smollm2_path, threads=2, max_live_sessions=2, anticipate=False) as model:
        first = model.session(system=SYSTEM)
        mine = first.respond("Tell me about the history of Paris.", GREEDY)
        _, first_seq = internals.placement(first)
        others = [model.session() for _ in range(2)]  # (kept: a session dropped frees its sequence)
        for other, hello in zip(others, ("Hello!", "Hi."), strict=True):
            other.respond(hello, GenerationOptions(max_tokens=4, temperature=0))
        second = model.session(system=SYSTEM)
        reply = second.respond("Which rivers should a visitor see?", GREEDY)
        assert internals.placement(first)[0] == "parked"
        assert internals.placement(second)[1] != first_seq
        usage = reply.usage
        assert usage.shared_tokens == usage.reused_tokens >= len(model.tokenize(SYSTEM, add_special=False))
        assert usage.decoded_prompt_tokens == usage.prompt_tokens - usage.shared_tokens
        assert check_against_fresh(second, reply, tolerance_for(short_prompt_noise(model)), final=False) == []
        follow = first.respond("And its bridges?", GREEDY)
        assert follow.usage.reused_tokens >= mine.usage.prompt_tokens


def test_a_session_started_from_the_wrong_parked_state_is_caught(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant that must fail: the state restored is another parked session's (a pirate's,
    long enough to hold the prefix) than the donor's whose record is kept."""
    with Model(smollm2_path, threads=2, max_live_sessions=1, anticipate=False) as model:
        pirate = model.session(system="You are a pirate who speaks only of the sea and its ships.")
        pirate.respond("Tell me about your ship.", GREEDY)
        donor = model.session(system=SYSTEM)
        donor.respond("Hello!", GREEDY)
        real = Engine.parked_state
        monkeypatch.setattr(Engine, "parked_state", lambda engine, lease: real(engine, pirate.lease))
        session = model.session(system=SYSTEM)
        reply = session.respond("Tell me about the history of Paris.", GREEDY)
        monkeypatch.undo()
        assert internals.placement(pirate)[0] == internals.placement(donor)[0] == "parked"
        assert reply.usage.shared_tokens > 20
        noise = short_prompt_noise(model)
        assert check_against_fresh(session, reply, tolerance_for(noise), final=False) != []
