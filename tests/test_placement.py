"""Sessions in exchanges together sit in consecutive sequences (``engine.placement``): with cells of
their own, llama.cpp computes together only sequences whose numbers follow each other. A session
starting an exchange trades places with an idle one to join the others; every moved state answers
as a fresh decode does (within the measured split noise), and a move that hands a session
another's state is caught by the same check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import internals
import pytest
from test_reuse import batch_noise, check_against_fresh, short_prompt_noise, tolerance_for

from llmsession import GenerationOptions, Model, NativeError, Reply, Session
from llmsession.engine.lease import SharedContext
from llmsession.engine.moves import Mover
from llmsession.engine.residency import Move
from llmsession.native.context import NativeContext

FIRST = GenerationOptions(max_tokens=12, temperature=0)
GREEDY = GenerationOptions(max_tokens=20, temperature=0)
TOPICS = ("the harbour", "the old bridge", "the orchard", "the winter market")
PIRATE = (
    "You are a pirate who speaks only of the sea, its ships and its storms. You answer every "
    "question with a tale of the open water, of sails torn by the wind, of islands seen at dawn "
    "and of the crew who sang as they hauled the ropes. Never speak of the land."
)


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    with Model(smollm2_path, threads=2, anticipate=False) as model:  # (nothing decodes behind)
        yield model


def four_live(model: Model, pirate: str | None = None) -> list[Session]:
    """Four sessions with one turn each, live in sequences 0 to 3 (the second, ``pirate``'s
    system prompt if given: a longer state than the others')."""
    sessions = [model.session(pirate if i == 1 and pirate else None) for i in range(4)]
    for session, topic in zip(sessions, TOPICS, strict=True):
        session.respond(f"Tell me about {topic}.", FIRST)
    assert [internals.placement(s) for s in sessions] == [("live", i) for i in range(4)]
    return sessions


def three_together(sessions: list[Session]) -> list[tuple[Session, Reply]]:
    """The first, third and fourth sessions each start a turn while the ones before generate,
    then all three finish; their sequences are consecutive while they run."""
    streams: list[Any] = []
    for session in (sessions[0], sessions[2], sessions[3]):
        streams.append(session.stream("Write a long story about it.", GREEDY))
        next(streams[-1])  # its prompt decoded: it is in its exchange
    seqs = sorted(internals.placement(s)[1] for s in (sessions[0], sessions[2], sessions[3]))
    assert seqs == list(range(seqs[0], seqs[0] + 3)), f"not consecutive: {seqs}"
    for stream in streams:
        for _ in stream:
            pass
    return [
        (s, stream.reply) for s, stream in zip((sessions[0], sessions[2], sessions[3]), streams, strict=True)
    ]


def test_sessions_joining_exchanges_are_moved_beside_them_and_answer_as_fresh_decodes(
    model: Model, smollm2: Model
) -> None:
    engine = internals.local(model).engine
    sessions = four_live(model)
    moves, held = engine.counters.moves, [len(internals.record(s)) for s in sessions]
    answered = three_together(sessions)
    assert engine.counters.moves - moves == 2, "the third and the fourth traded places with the idle second"
    tolerance = tolerance_for(batch_noise(smollm2))  # (same file and settings, measured once)
    for (session, reply), before in zip(answered, (held[0], held[2], held[3]), strict=True):
        assert reply.usage.decoded_prompt_tokens <= reply.usage.prompt_tokens - before + 1, (
            "its moved state was lost"
        )
        assert check_against_fresh(session, reply, tolerance, final=False) == []
    idle = sessions[1]  # moved twice while idle: its next turn reads all it held from its cells
    held = len(internals.record(idle))
    reply = idle.respond("Write a long story about it.", GREEDY)
    assert reply.usage.reused_tokens == held
    assert check_against_fresh(idle, reply, tolerance_for(short_prompt_noise(smollm2))) == []


def test_a_move_that_hands_a_session_anothers_state_is_caught(
    model: Model, smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The differential's teeth: a move that leaves the pirate's state (cut to the mover's
    length, so every count still agrees) in the mover's new sequence fails the check above."""
    sessions = four_live(model, pirate=PIRATE)
    pirate = sessions[1]
    real = Mover._swap

    def wrong(self: Mover, home: SharedContext, step: Move) -> None:
        real(self, home, step)
        held = len(internals.record(mover(step)))
        theirs = internals.placement(pirate)[1]
        assert len(internals.record(pirate)) >= held
        home.context.seq_rm(-1, step.to)
        assert home.context.seq_cp(theirs, step.to)
        home.context.seq_rm(held, step.to)

    def mover(step: Move) -> Session:
        return next(s for s in sessions if internals.settled(s).lease.key == step.key)

    monkeypatch.setattr(Mover, "_swap", wrong)
    answered = three_together(sessions)
    monkeypatch.undo()
    tolerance = tolerance_for(batch_noise(smollm2))  # (same file and settings, measured once)
    moved = [(s, r) for s, r in answered if s is not sessions[0]]
    assert all(check_against_fresh(s, r, tolerance, final=False, at_least=1) != [] for s, r in moved)


def test_a_move_that_fails_halfway_leaves_both_sessions_cold_never_wrong(
    model: Model, smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state read that fails in the middle of a trade of places (the ledger already has both
    moved): neither session keeps cells that may be the other's; each answers its next turn from
    nothing, as a fresh decode does, and the stream beside them goes on."""
    sessions = four_live(model)
    first = sessions[0].stream("Write a long story about it.", GREEDY)
    next(first)
    real, reads = NativeContext.state_get, []

    def failing(context: NativeContext, seq: int = 0, **flags: Any) -> Any:
        reads.append(seq)
        if len(reads) == 2:
            raise NativeError("llama_state_seq_get_data failed (injected)")
        return real(context, seq, **flags)

    monkeypatch.setattr(NativeContext, "state_get", failing)
    with pytest.raises(NativeError, match="injected"):
        next(sessions[2].stream("Write a long story about it.", GREEDY))
    monkeypatch.undo()
    assert reads == [2, 1], "the third session's state, then the idle second's"
    for _ in first:
        pass
    assert (
        check_against_fresh(sessions[0], first.reply, tolerance_for(batch_noise(smollm2)), final=False) == []
    )
    for session in (sessions[1], sessions[2]):
        assert internals.record(session) == ()
        reply = session.respond("Write a long story about it.", GREEDY)
        assert reply.usage.reused_tokens == reply.usage.shared_tokens, "its own cells were read"
        assert check_against_fresh(session, reply, tolerance_for(short_prompt_noise(smollm2))) == []
