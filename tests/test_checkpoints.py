"""Checkpoints on the real library: recurrent (Mamba) and hybrid (LFM2) sessions resume an edit,
a regenerate or a deleted exchange from a copy of their recurrent state, and answer exactly what
a fresh session answers; SmolLM2's attention cache needs none."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import internals
import pytest
from test_reuse import GREEDY, assert_same_as_fresh

from llmsession import CheckpointConfig, Model, Session
from llmsession.engine.seat import Seat
from llmsession.native.llama import bindings

CAP = CheckpointConfig(max_count=4, max_bytes=200_000, every=64)


@pytest.fixture(params=["mamba", "lfm2"], scope="module")
def recurrent(request: pytest.FixtureRequest, fixture_path: Callable[[str], Path]) -> Iterator[Model]:
    with Model(fixture_path(f"{request.param}-tiny.gguf"), threads=2, checkpoints=CAP) as model:
        assert internals.local(model).native.is_recurrent
        yield model


def chat(session: Session, turns: int) -> list[int]:
    """``turns`` exchanges; the record's length when each exchange began."""
    starts = []
    for i in range(turns):
        starts.append(len(internals.record(session)))  # with the opening decoded ahead
        session.respond(f"Question {i}: what do you know about item {7 * i}?", GREEDY)
    return starts


def test_edit_regenerate_and_delete_resume_from_a_checkpoint(recurrent: Model) -> None:
    session = recurrent.session(system="You are a helpful assistant.", context_size=2048)
    last_start = chat(session, 3)[-1]
    question = session.messages[-2]["content"]

    del session.messages[-2:]  # regenerate the last reply: resumes before the prompt's last token
    regenerated = assert_same_as_fresh(session, question)
    assert regenerated.usage.from_checkpoint
    assert regenerated.usage.decoded_prompt_tokens == 1

    del session.messages[-2:]  # edit the last user message: resumes where that exchange began
    edited = assert_same_as_fresh(session, question + " Answer briefly.")
    assert edited.usage.from_checkpoint and edited.usage.reused_tokens == last_start
    assert edited.usage.decoded_prompt_tokens == edited.usage.prompt_tokens - last_start

    del session.messages[-2:]  # delete the last exchange, ask something else
    other = assert_same_as_fresh(session, "Something else entirely.")
    assert other.usage.from_checkpoint and other.usage.reused_tokens == last_start
    report = recurrent.memory()
    assert 0 < report.checkpoint_bytes <= CAP.max_bytes


def test_regenerating_after_twenty_turns_decodes_under_five_percent(recurrent: Model) -> None:
    session = recurrent.session(context_size=2048)
    chat(session, 20)
    transcript = session.cached_tokens
    question = session.messages[-2]["content"]
    del session.messages[-2:]
    reply = session.respond(question, GREEDY)
    assert reply.usage.from_checkpoint
    assert reply.usage.decoded_prompt_tokens <= 0.05 * transcript, (reply.usage, transcript)
    held = session.lease.cache.checkpoints
    assert held is not None and len(held.positions) <= CAP.max_count
    assert held.nbytes <= CAP.max_bytes


def test_an_aborted_prefill_goes_back_to_a_checkpoint(
    recurrent: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled inside its third batch, a decode leaves the recurrent state partly advanced: the
    session goes back to its newest checkpoint at or below its record, not to nothing."""
    session = recurrent.session(context_size=2048, batch_size=8)
    chat(session, 2)
    held = session.cached_tokens
    calls, decode = [], Seat.decode

    def cancel_on_third(seat: Seat, tokens: list[int], pos: int, **kwargs: Any) -> int:
        calls.append(pos)
        if len(calls) == 3:
            seat.cancelled.set()  # as Stream.cancel() from another thread, mid-graph
        return decode(seat, tokens, pos, **kwargs)

    monkeypatch.setattr(Seat, "decode", cancel_on_third)
    cancelled = session.respond("A question that is cancelled before it is answered. " * 4, GREEDY)
    monkeypatch.undo()
    assert cancelled.finish_reason == "cancelled" and len(calls) == 3
    kept = session.lease.cache.checkpoints
    assert kept is not None and session.cached_tokens in kept.positions  # where it began, or on the way
    assert held <= session.cached_tokens <= held + 16
    reply = assert_same_as_fresh(session, "And now a real one.")
    assert reply.usage.reused_tokens >= held


def test_checkpoints_off_means_a_full_decode(fixture_path: Callable[[str], Path]) -> None:
    off = CheckpointConfig(max_count=0)
    with Model(fixture_path("lfm2-tiny.gguf"), threads=2, checkpoints=off) as model:
        session = model.session(context_size=2048)
        chat(session, 2)
        question = session.messages[-2]["content"]
        del session.messages[-2:]
        reply = session.respond(question, GREEDY)
        assert (reply.usage.reused_tokens, reply.usage.from_checkpoint) == (0, False)
        assert model.memory().checkpoint_bytes == 0


def test_llama_cpp_rollback_stays_off(recurrent: Model) -> None:
    """llama.cpp's own rollback (n_rs_seq) can return true with a stale state; we never ask for it."""
    lib, _ = bindings()
    session = recurrent.session()
    session.respond("Hello", GREEDY)
    context = session.lease.shared_context.context
    assert lib.llama_n_rs_seq(context.ptr) == 0


def test_an_attention_cache_needs_no_checkpoint(smollm2: Model) -> None:
    session = smollm2.session(system="You are a helpful assistant.")
    chat(session, 2)
    question = session.messages[-2]["content"]
    del session.messages[-2:]
    reply = assert_same_as_fresh(session, question)
    assert not reply.usage.from_checkpoint and reply.usage.decoded_prompt_tokens == 1
    assert session.lease.cache.checkpoints is None
    assert smollm2.memory().checkpoint_bytes == 0
