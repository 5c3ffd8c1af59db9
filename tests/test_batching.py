"""Concurrent streams of one model decode their steps in one batch, and each still answers what it
answers alone (teacher-forced against a fresh decode, within the measured split noise); a batch
that hands a stream another's logits must be caught."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import internals
import pytest
from test_reuse import batch_noise, check_against_fresh, tolerance_for

from llmsession import GenerationOptions, Model, Reply, Session
from llmsession.engine.batching import Batcher, Step
from llmsession.native.context import DecodeAborted, NativeContext

QUESTIONS = (
    "Tell me a story about a lighthouse.",
    "Describe the sea at night.",
    "Write a poem about winter.",
    "Explain how bridges are built.",
)
OPTIONS = GenerationOptions(max_tokens=18, temperature=0, stop=["\n\n\n"])


def run_concurrently(model: Model) -> list[tuple[Session, Reply]]:
    sessions = [model.session() for _ in QUESTIONS]
    replies: list[Any] = [None] * len(sessions)
    start = threading.Barrier(len(sessions))

    def one(i: int) -> None:
        start.wait()
        replies[i] = sessions[i].respond(QUESTIONS[i], OPTIONS)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return list(zip(sessions, replies, strict=True))


def test_concurrent_streams_share_batches_and_each_equals_its_solo_run(smollm2: Model) -> None:
    batcher = internals.local(smollm2).engine.batcher
    batches, steps = batcher.batches, batcher.steps
    answered = run_concurrently(smollm2)
    assert (batcher.steps - steps) / (batcher.batches - batches) > 1.5, "the steps were not batched"
    noise = batch_noise(smollm2)
    for i, (session, reply) in enumerate(answered):
        assert reply.usage.completion_tokens >= 16
        assert check_against_fresh(session, reply, tolerance_for(noise), final=False) == []
        if noise == 0:  # batched with the others, each decodes exactly what it decodes alone
            assert reply.text == smollm2.session().respond(QUESTIONS[i], OPTIONS).text


def test_a_batch_that_mixes_up_the_rows_is_caught(smollm2: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    decode_many = NativeContext.decode_many

    def neighbours_rows(context: NativeContext, runs: Any, outputs: Any = None, **flags: Any) -> list[int]:
        rows = decode_many(context, runs, outputs, **flags)
        return [rows[-1], *rows[:-1]]  # each run sampled from the row of the run before its own

    monkeypatch.setattr(NativeContext, "decode_many", neighbours_rows)
    answered = run_concurrently(smollm2)
    monkeypatch.undo()
    noise = batch_noise(smollm2)
    # A reply that ended at once (its first token, an end, sampled from another's row) is caught
    # too: unmixed, each of these prompts answers at least 16 tokens (the test above).
    problems = [
        check_against_fresh(s, r, tolerance_for(noise), final=False, at_least=1)
        if r.usage.completion_tokens
        else ["ended at once"]
        for s, r in answered
    ]
    assert any(problems)


def test_an_error_before_a_batch_is_decoded_fails_its_steps_and_the_loop_goes_on(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error in the decode thread while it gathers or takes a batch (not in the decode) ends
    the steps waiting for it with that error: their callers do not wait forever (the thread
    died there, and every later step waited on it), and the next exchanges answer as before."""
    take, broken = Batcher._take, threading.Event()

    def failing(batcher: Batcher, context: Any) -> list[Step]:
        if len(batcher._pending) > 1 and not broken.is_set():
            broken.set()
            raise RuntimeError("taken wrong")
        return take(batcher, context)

    monkeypatch.setattr(Batcher, "_take", failing)
    sessions = [smollm2.session() for _ in QUESTIONS[:3]]
    outcomes: list[Any] = [None] * len(sessions)
    start = threading.Barrier(len(sessions))

    def one(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = sessions[i].respond(QUESTIONS[i], OPTIONS)
        except RuntimeError as error:
            outcomes[i] = error

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a caller waits for a step forever"
    monkeypatch.undo()
    assert broken.is_set() and any(isinstance(o, RuntimeError) for o in outcomes), outcomes
    for session, question in zip(sessions, QUESTIONS, strict=False):
        reply = session.respond(question, OPTIONS)
        assert check_against_fresh(session, reply, tolerance_for(batch_noise(smollm2)), final=False) == []


def test_an_interrupted_step_leaves_the_queue_or_is_waited_out() -> None:
    """After a Ctrl-C the waiting thread waits for its step to end (so memory matches its
    record): a step no batch has taken leaves the queue at once (nothing of it decoded); one
    being decoded, or a prompt part decoded, is waited out, through a second Ctrl-C (which left
    it to be decoded into a sequence its session might no longer hold), and another exception
    met meanwhile (a signal handler's ``SystemExit``) is raised once it has ended. (Steps that
    name no context, and an Event's ``wait`` stand in: the queue's bookkeeping alone.)"""
    from llmsession.engine.batching import wait_out
    from llmsession.engine.work import Gate

    batcher = Batcher(Gate())
    waiting = Step(target=None, tokens=[1], pos=0, sampler=None)  # type: ignore[arg-type]
    sliced = Step(target=None, tokens=[1, 2, 3], pos=0, sampler=None, prompt=True, taken=2)  # type: ignore[arg-type]
    batcher._pending += [waiting, sliced]
    assert batcher._withdraw(waiting) and batcher._pending == [sliced]
    assert not batcher._withdraw(sliced)  # (part of it decoded: its slice is waited for)
    assert not batcher._withdraw(waiting)  # (no longer queued: taken by a batch, say)
    # One a second Ctrl-C kept from leaving the queue (inside ``_withdraw``) is not decoded:
    # the next batch finishes it as it is (it was, nobody waiting for its token).
    context = SimpleNamespace(batch=SimpleNamespace(capacity=8))
    left = Step(target=SimpleNamespace(context=context), tokens=[1], pos=0, sampler=None)  # type: ignore[arg-type]
    left.abandoned, left.done = True, threading.Event()
    batcher._pending = [left]
    assert batcher._take(context) == [] and batcher._pending == []  # type: ignore[arg-type]
    assert left.done.is_set() and isinstance(left.error, DecodeAborted)

    class Interrupted:
        calls = 0

        def wait(self, timeout: float) -> bool:
            self.calls += 1
            if self.calls in (1, 2):
                raise KeyboardInterrupt
            if self.calls == 3:
                raise SystemExit(3)
            return self.calls == 5

    event = Interrupted()
    with pytest.raises(SystemExit):
        wait_out(event)  # type: ignore[arg-type]
    assert event.calls == 5
